"""The public API of `dtnb` is the same whatever was imported before: no submodule shares a name with a public
function, every name in `dtnb._API` is the function or class its module documents, and the names resolve without
importing the heavy submodules up front."""
import importlib, inspect, pkgutil, subprocess, sys
import dtnb

SUBMODULES = sorted(m.name for m in pkgutil.iter_modules(dtnb.__path__) if not m.name.startswith('_'))  # the stages
MODULES = sorted(m.name for m in pkgutil.walk_packages(dtnb.__path__, 'dtnb.') if '._' not in m.name)  # every room


def test_every_public_name_is_what_it_documents_after_every_submodule_is_imported():
    for m in MODULES: importlib.import_module(m)  # rebinds dtnb.<stage> and dtnb.<stage>.<room> to each module
    assert not set(SUBMODULES) & set(dtnb._API), "a stage package shares its name with a public function"
    assert not {m.rsplit('.', 1)[1] for m in MODULES} & set(dtnb._API), "a module shares its name with a public function"
    for name in dtnb._API:
        obj = getattr(dtnb, name)
        home = importlib.import_module(dtnb._module_of(name))
        assert obj is getattr(home, name), name
        assert callable(obj) and not inspect.ismodule(obj), f"dtnb.{name} is {obj!r}"
        assert (inspect.getdoc(obj) or '').strip(), f"dtnb.{name} has no docstring"


def test_submodules_reachable_as_attributes():
    for m in SUBMODULES: assert inspect.ismodule(getattr(dtnb, m)), m


def test_import_dtnb_is_cheap():
    "`import dtnb` loads no torch; the first public name loads only what it needs"
    code = "import sys, dtnb; assert 'torch' not in sys.modules; dtnb.detect; assert 'torch.distributed.fsdp' not in sys.modules"
    subprocess.run([sys.executable, '-c', code], check=True)
