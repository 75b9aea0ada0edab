"""Every untagged notebook cell and test that starts ranks runs unchanged on a machine with one GPU.

Two ranks cannot share one GPU (NCCL refuses it, and dtnb says so before any rank starts), so whatever starts two
ranks without a `#| multicuda` flag must pin dtnb to the CPU: a notebook with `os.environ['DTNB_DEVICE'] = 'cpu'`
before such a cell, a test module with the `cpu_ranks` fixture. These checks read the sources; the behaviour behind
them is proved elsewhere: `bash run.sh test` runs the pinned notebooks with torch.accelerator answering as a one-GPU
node (tests/standin), and `cpu_ranks` does the same for the pinned tests, so a cell or test that still reached for a
GPU would fail on this CPU machine."""
import ast, json, re
from pathlib import Path
import pytest
import torch
from conftest import ROOT, gpu_standin
from dtnb.utils import accelerators, placement

PIN = "os.environ['DTNB_DEVICE'] = 'cpu'"
GPU_FLAGS = re.compile(r'^#\|\s*(cuda|multicuda)\b', re.M)
# a line that starts 2 or more ranks: launch(...) (not nprocs=1), `dtnb launch -n 2`, mpirun; error paths that fail
# before any rank starts (test_fail, pytest.raises, --dry-run) do not count
STARTS_RANKS = re.compile(r"(?:^|[^.\w]|dtnb\.)launch\((?![^)]*\bnprocs=1\b)|'launch', '-n', '[2-9]|\[MPIRUN\b|\bmpirun -n")
ERROR_PATH = re.compile(r"test_fail\(|pytest\.raises\(|--dry-run")
def starts_ranks(src: str) -> bool: return any(STARTS_RANKS.search(l) and not ERROR_PATH.search(l) for l in src.split('\n'))
NOTEBOOKS = sorted((ROOT / 'nbs').glob('*.ipynb')) + sorted((ROOT / 'nbs' / 'tutorials').glob('*.ipynb'))


def unpinned_rank_cells(nb: Path) -> list:
    "Source of each untagged, non-exported cell of `nb` that starts ranks before the notebook pins the CPU"
    out, pinned = [], False
    for c in json.loads(nb.read_text())['cells']:
        s = ''.join(c['source'])
        if c['cell_type'] != 'code' or GPU_FLAGS.search(s) or s.startswith('#| export'): continue
        pinned = pinned or PIN in s
        if not pinned and starts_ranks(s) and "device='cpu'" not in s: out.append(s)
    return out


@pytest.mark.parametrize('nb', NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_cells_that_start_ranks_are_pinned_to_the_cpu(nb):
    assert unpinned_rank_cells(nb) == [], f"{nb.name}: add a cell `{PIN}` before these (see nbs/00_utils.ipynb)"


def test_the_check_sees_an_unpinned_cell(tmp_path):
    "The check above finds a 2-rank cell with no pin before it, and none once it follows the pin"
    cell = lambda s: dict(cell_type='code', source=[s], metadata={}, outputs=[], execution_count=None)
    nb = tmp_path / 'x.ipynb'
    nb.write_text(json.dumps(dict(cells=[cell("launch(train, nprocs=2)"), cell(PIN), cell("launch(train, nprocs=2)")])))
    assert unpinned_rank_cells(nb) == ["launch(train, nprocs=2)"]


def _pytestmark_fixtures(tree) -> set:
    "Fixture names a module's `pytestmark = pytest.mark.usefixtures(...)` lists"
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, 'id', None) == 'pytestmark' for t in node.targets):
            return {a.value for a in getattr(node.value, 'args', []) if isinstance(a, ast.Constant)}
    return set()


TEST_MODULES = sorted(p for p in (ROOT / 'tests').glob('test_*.py') if p.name != 'test_gpu_node.py')


@pytest.mark.parametrize('path', TEST_MODULES, ids=lambda p: p.name)
def test_test_modules_that_start_ranks_use_cpu_ranks(path):
    src = path.read_text()
    if not starts_ranks(src): return
    assert 'cpu_ranks' in _pytestmark_fixtures(ast.parse(src)), (
        f"{path.name} starts ranks: add `pytestmark = pytest.mark.usefixtures('cpu_ranks')` and say in its docstring "
        "that the CPU is its subject, or mark its GPU tests `multicuda`")


def test_cpu_ranks_pins_dtnb_and_stands_in_for_one_gpu(cpu_ranks):
    "Under `cpu_ranks` dtnb sees no accelerator, while torch.accelerator answers as a one-GPU node (none here is real)"
    assert accelerators() == (None, 0)
    with placement(None):
        assert accelerators() == ('cuda', 1) or torch.accelerator.current_accelerator(check_available=True) is not None


# --- GPU rules proved on this CPU: torch.accelerator answers as a one-GPU node, nothing pinned ----------------------
# On torch's CPU build, the first thing placed on 'cuda:0' fails with "Torch not compiled with CUDA enabled": so
# each failure below shows where dtnb would put the work on a real one-GPU machine.
@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.delenv('DTNB_DEVICE', raising=False)
    for name, answer in gpu_standin.answers(1).items(): monkeypatch.setattr(torch.accelerator, name, answer)


def test_loader_report_step_puts_its_model_where_input_bound_puts_batches(one_gpu):
    from dtnb.tune import _toy_step
    from dtnb.utils import default_device
    assert default_device() == torch.device('cuda', 0)
    with pytest.raises((AssertionError, RuntimeError), match='CUDA'): _toy_step((3, 4, 4))  # the model goes to cuda:0
    with placement('cpu'):
        assert next(_toy_step((3, 4, 4)).model.parameters()).device.type == 'cpu'


def test_two_ranks_on_one_gpu_are_refused_unless_pinned(one_gpu):
    from dtnb.launcher import launch
    with pytest.raises(ValueError, match="2 ranks on this node but 1 cuda device"): launch(str, nprocs=2)
    with placement('cpu'): assert launch(str, 1, nprocs=2) == ['1', '1']
