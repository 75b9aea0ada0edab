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
from dtnb.core.utils import accelerators, placement

PIN = "os.environ['DTNB_DEVICE'] = 'cpu'"
GPU_FLAGS = re.compile(r'^#\|\s*(cuda|multicuda)\b', re.M)
# A line that starts ranks: launch(...) (not nprocs=1), the library calls that launch ranks themselves, `dtnb launch`
# (torchrun), mpirun, a report (it trains on 2 ranks). Argument errors that fail before any rank starts do not count.
STARTS_RANKS = re.compile(r"(?:^|[^.\w]|dtnb\.)launch\((?![^)]*\bnprocs=1\b)|measure_memory\(.*world_size=[2-9]|"
                          r"\bbench_(collectives|scaling|all)\(|'launch', '-n', '(?!1')\d|\[MPIRUN\b|\bmpirun -n|"
                          r"'report',|\breport\(")
ERROR_PATH = re.compile(r"test_fail\(lambda: (main|launch)\(|--dry-run")

def starts_ranks(src: str) -> bool:
    return any(STARTS_RANKS.search(l) and not ERROR_PATH.search(l) for l in src.split('\n'))
NOTEBOOKS = sorted((ROOT / 'nbs').glob('*.ipynb')) + sorted((ROOT / 'nbs' / 'tutorials').glob('*.ipynb'))

# Notebooks that run unpinned: none of their untagged cells starts ranks or places work through dtnb's device choice
# (run.sh runs them as they are; the pinned ones under the one-GPU stand-in). A new notebook is pinned or listed here.
UNPINNED = {
    '00a_core.env': "reads launch environments: no device", '00a_core.specs': "device spec tables: no device",
    '00_core.utils': "defines the pin; shows this machine's own devices",
    '01_detection.device': "detection: what this machine has",
    '00c_core.models': "model definitions, run where they are built",
    '00d_core.logs': "log records and warnings: no device",
    '00e_core.batches': "a batch's loss on CPU tensors in this process: no ranks, no device choice",
    '00f_core.state': "attributes on modules in this process: no ranks, no device",
    '00g_core.fp8': "the refusal and the emulated conversion in this process (its ranks: tests/test_fp8.py)",
    '05ab_train.checkpoint_format': "a checkpoint's files, marker and checksums of CPU tensors in one process",
    '05ea_train.fit_checkpoints': "fit's state saved and resumed from CPU tensors in this process: no ranks",
    '05h_train.trackers': "tracker callbacks and an import error: no device (the runs: tests/test_trackers.py)",
    '02_launcher.failures': "error reports: no device",
    '09_debug.divergence': "the causes' rules on tables written by hand: no ranks, no device",
    '02_launcher.hangs': "flight recorder entries and heartbeat records on paper: no device",
    '05d_train.stragglers': "per-rank step splits on paper (fit's ranks: tests/test_hangs.py)",
    '02_launcher.network': "routes, addresses and a store heartbeat in one process: no device",
    '02_launcher.starts': "how ranks start, decided in this process (the launches: 02a): no device",
    '02b_launcher.torchrun': "builds torchrun commands",
    '02c_launcher.doctor': "one process in its cells (the multi-host runs are tests/test_doctor.py); gloo on CPU",
    '03c_parallel.pipeline_schedules': "pipeline schedules on paper",
    '04_plan.activations': "traces activations where the model is",
    '04_plan.layout': "shapes and a copy on the meta device: no ranks, no device",
    '04a_plan.memory': "estimates from shapes",
    '04b_plan.recommend': "plans from shapes and this machine's report",
    '06_data.loaders': "loaders in the host process", '07_bench.compute': "benchmarks of the device each call names",
    '07d_bench.forecast': "predictions on paper", '07c_bench.ops': "ops traced on meta, timed in this process",
    '08_reporting.document': "renders results",
    '10_cli': "the commands' arguments",
    '08a_reporting.sections': "the report's sections start CPU ranks themselves where accelerators are too few",
    'predict': "predictions on paper; its validate() pins its own ranks to the CPU",
}


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
def test_notebooks_are_pinned_or_listed_and_pin_before_ranks_start(nb):
    pinned = any(PIN in ''.join(c['source']) for c in json.loads(nb.read_text())['cells'])
    assert pinned != (nb.stem in UNPINNED), (f"{nb.name}: pin it (a cell `{PIN}` after its imports, see "
                                             "CONTRIBUTING.md) or list it in UNPINNED with the reason it needs none")
    if pinned: assert unpinned_rank_cells(nb) == [], f"{nb.name}: move the cell `{PIN}` before these"


def test_the_check_sees_an_unpinned_cell(tmp_path):
    "The check above finds a 2-rank cell with no pin before it, and none once it follows the pin"
    cell = lambda s: dict(cell_type='code', source=[s], metadata={}, outputs=[], execution_count=None)
    nb = tmp_path / 'x.ipynb'
    cells = ["launch(train, nprocs=2)", "bench_collectives(nprocs=2)", PIN, "launch(train, nprocs=2)"]
    nb.write_text(json.dumps(dict(cells=[cell(c) for c in cells])))
    assert unpinned_rank_cells(nb) == cells[:2]
    assert not starts_ranks("test_fail(lambda: launch(f, nprocs=0), contains='nprocs=0')")


def _pytestmark_fixtures(tree) -> set:
    "Fixture names a module's `pytestmark = pytest.mark.usefixtures(...)` lists (one mark or a list of marks)"
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, 'id', None) == 'pytestmark' for t in node.targets):
            marks = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            return {a.value for m in marks for a in getattr(m, 'args', []) if isinstance(a, ast.Constant)}
    return set()


# Test modules that run unpinned, and why; every other module lists `cpu_ranks` in its pytestmark.
UNPINNED_TESTS = {
    'test_api.py': "imports and signatures", 'test_cuda.py': "the GPU is its subject (skips without CUDA)",
    'test_device.py': "detection, with its own NVML and CUDA stand-ins",
    'test_gpu_bench.py': "gpu_bench.py with --device cpu; its GPU path runs under tools/gpu_check.sh",
    'test_gpu_check.py': "tools/gpu_check.sh's no-GPU path and dry run (which pins what it runs itself); skips "
                         "itself where a GPU is",
    'test_gpu_node.py': "this module: GPU rules on the stand-in", 'test_site.py': "the docs site in a browser",
    'test_ops.py': "steps traced on meta tensors and priced: no ranks, no device",
    'test_stages.py': "reads the modules' imports: nothing runs",
}
TEST_MODULES = sorted((ROOT / 'tests').glob('test_*.py'))


@pytest.mark.parametrize('path', TEST_MODULES, ids=lambda p: p.name)
def test_test_modules_are_pinned_or_listed(path):
    pinned = 'cpu_ranks' in _pytestmark_fixtures(ast.parse(path.read_text()))
    assert pinned != (path.name in UNPINNED_TESTS), (
        f"{path.name}: add `pytestmark = pytest.mark.usefixtures('cpu_ranks')` and say in its docstring that the "
        "CPU is its subject, or list it in UNPINNED_TESTS with the reason it needs no pin")


def test_cpu_ranks_pins_dtnb_and_stands_in_for_one_gpu(cpu_ranks):
    "Under `cpu_ranks` dtnb sees no accelerator, while torch.accelerator answers as a GPU node (stand-in or real)"
    assert accelerators() == (None, 0)
    with placement(None):
        assert accelerators()[1] >= 1 and accelerators()[0] is not None


# --- GPU rules proved on this CPU: torch.accelerator answers as a one-GPU node, nothing pinned ----------------------
# On torch's CPU build, the first thing placed on 'cuda:0' fails with "Torch not compiled with CUDA enabled": so
# each failure below shows where dtnb would put the work on a real one-GPU machine.
needs_no_gpu = pytest.mark.skipif(gpu_standin.REAL, reason="a real GPU is here: work placed on cuda:0 succeeds "
                                  "(tools/gpu_check.sh checks the GPU path there)")


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.delenv('DTNB_DEVICE', raising=False)
    for name, answer in gpu_standin.answers(1).items(): monkeypatch.setattr(torch.accelerator, name, answer)


@needs_no_gpu
def test_loader_report_step_puts_its_model_where_input_bound_puts_batches(one_gpu):
    from dtnb.data.tune import _toy_step
    from dtnb.core.utils import default_device
    assert default_device() == torch.device('cuda', 0)
    with pytest.raises((AssertionError, RuntimeError), match='CUDA|NVIDIA'):
        _toy_step((3, 4, 4))  # its model goes to cuda:0, where input_bound puts the batches
    with placement('cpu'):
        assert next(_toy_step((3, 4, 4)).model.parameters()).device.type == 'cpu'


def test_two_ranks_on_one_gpu_are_refused_unless_pinned(one_gpu):
    from dtnb.launcher.processes import launch
    with pytest.raises(ValueError, match="2 ranks on this node but 1 cuda device"): launch(str, nprocs=2)
    with placement('cpu'): assert launch(str, 1, nprocs=2) == ['1', '1']
