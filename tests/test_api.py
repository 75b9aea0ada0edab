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
    for m in MODULES:  # a room may be named for its one entry point (dtnb.parallel.wrap.wrap): it lives there
        name = m.rsplit('.', 1)[1]
        if name in dtnb._API: assert dtnb._module_of(name) == m, f"room {m} shares its name with dtnb.{name}"
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
    code = ("import sys, dtnb; assert 'torch' not in sys.modules; dtnb.detect; "
            "assert 'torch.distributed.fsdp' not in sys.modules")
    subprocess.run([sys.executable, '-c', code], check=True)


def _imports():
    "(file, line, source line, absolute module, name) of every `from X import name` inside dtnb/"
    import ast, pathlib
    root = pathlib.Path(dtnb.__file__).parent
    for p in sorted(root.rglob('*.py')):
        if p.name == '_modidx.py': continue
        rel = p.relative_to(root.parent)
        pkg = list(rel.parent.parts)
        lines = p.read_text().splitlines()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = pkg[:len(pkg) - node.level + 1] if node.level else []
                mod = '.'.join(base + [node.module] if node.module else base) if node.level else node.module
                for a in node.names: yield str(rel), node.lineno, lines[node.lineno - 1], mod, a.name
            elif isinstance(node, ast.Import):
                for a in node.names: yield str(rel), node.lineno, lines[node.lineno - 1], a.name, None


def test_private_names_stay_in_their_room():
    "At most 5 private names cross a module border inside dtnb/, each on a commented import line"
    crossing = [(f, line, src, f"{m}.{n}") for f, line, src, m, n in _imports()
                if n and n.startswith('_') and not n.startswith('__') and m and m.startswith('dtnb')
                and m != f.removesuffix('.py').replace('/', '.')]
    assert len(crossing) <= 5, '\n'.join(f"{f}:{line}: {name}" for f, line, _, name in crossing)
    assert all('#' in src for *_, src, _ in crossing), "a private name crossing rooms needs a comment saying why"


def test_wiring_is_visible():
    "Inside dtnb/ nothing imports through the package facade or by importlib; only dtnb/__init__.py's lazy names do"
    bad = [f"{f}:{line}: {src.strip()}" for f, line, src, m, n in _imports()
           if f != 'dtnb/__init__.py' and (m == 'importlib' or (m == 'dtnb' and n))]  # `import dtnb` alone: its path
    import pathlib
    root = pathlib.Path(dtnb.__file__).parent
    bad += [f"{p}: __import__" for p in root.rglob('*.py') if '__import__(' in p.read_text() and p.name != '_modidx.py']
    assert not bad, '\n'.join(bad)


def test_lines_and_modules_stay_short():
    "No line over 120 characters in dtnb/, tests/, tools/ (nbdev's `__all__` and index aside); no module over 450 lines"
    import pathlib
    root = pathlib.Path(dtnb.__file__).parent.parent
    files = [p for d in ('dtnb', 'tests', 'tools') for p in (root / d).rglob('*') if p.suffix in ('.py', '.sh')]
    long = [f"{p.relative_to(root)}:{i}" for p in files if p.name != '_modidx.py'
            for i, l in enumerate(p.read_text().splitlines(), 1) if len(l) > 120 and not l.startswith('__all__ = ')]
    assert not long, long
    big = [f"{p.relative_to(root)}: {n}" for p in (root / 'dtnb').rglob('*.py') if p.name != '_modidx.py'
           and (n := len(p.read_text().splitlines())) > 450]
    assert not big, big
