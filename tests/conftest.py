import os, subprocess, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parent.parent
STANDIN = Path(__file__).resolve().parent / 'standin'
sys.path.insert(0, str(STANDIN))
import gpu_standin  # noqa: E402

# Tests whose subject is the CPU path (distributed results against a single CPU process, gloo, loaders) pin dtnb to
# the CPU with `pytestmark = pytest.mark.usefixtures('cpu_ranks')`, so that they run unchanged beside GPUs: a machine
# with one GPU cannot host their 2 NCCL ranks. Their GPU counterparts are the `#| cuda` cells, the `cuda`-marked tests
# and benchmarks/gpu_bench.py, which tools/gpu_check.sh runs on a GPU machine.
def cpu_env(env=None, *paths) -> dict:
    """`env` (default: this environment) for a subprocess of a `cpu_ranks` test: `DTNB_DEVICE=cpu`, and the one-GPU
    stand-in where there is no real accelerator; `paths` go first on PYTHONPATH"""
    env = dict(os.environ if env is None else env)
    path = [*map(str, paths), str(STANDIN), env.get('PYTHONPATH')]
    return {**env, 'DTNB_DEVICE': 'cpu', 'DTNB_STANDIN_GPUS': '1', 'PYTHONPATH': os.pathsep.join(filter(None, path))}


# What differs between torch builds (PyPI's CUDA build, the oldest torch declared): how ranks start (fork, the fork
# server, spawn, threads, a kernel's state), each strategy's numerics against one process (tolerances), the version
# gates (pipeline schedules, DTensor, DCP, tracing), detection and the GPU-node stand-in. `.ci/run` runs these files
# on the other builds (`pytest -m builds`, tools/test_torch_build.sh), and the whole suite on the CPU wheel. A file's
# `long` tests stay with the CPU wheel's test-long unless its value here is True (every test of it is about the build).
BUILDS = {'test_fork_safety.py': True, 'test_launch.py': False, 'test_hangs.py': False, 'test_device.py': False,
          'test_api.py': False, 'test_gpu_node.py': False, 'test_strategies.py': False, 'test_fsdp.py': False,
          'test_pipeline.py': False, 'test_pipeline_hf.py': False, 'test_ulysses.py': False, 'test_memory.py': False,
          'test_checkpoint.py': False, 'test_debug.py': False, 'test_ops.py': False,
          'test_tp_classic.py': False}


def pytest_collection_modifyitems(config, items):
    for item in items:
        long_too = BUILDS.get(item.path.name)
        if long_too or (long_too is False and not item.get_closest_marker('long')):
            item.add_marker(pytest.mark.builds)


@pytest.fixture
def cpu_ranks(monkeypatch):
    """dtnb places this test's work on the CPU (`DTNB_DEVICE=cpu`: CPU ranks on gloo, CPU tensors), whatever the
    machine has. On a machine without an accelerator, torch.accelerator also answers as a one-GPU node (tests/standin),
    in this process, its forked ranks and (through `cpu_env()`) its subprocesses: so CI proves the test never reaches
    for a GPU, which on a real one-GPU machine it could not share between two ranks."""
    monkeypatch.setenv('DTNB_DEVICE', 'cpu')
    gpu_standin.apply(1, monkeypatch.setattr)


@pytest.fixture(scope='module')
def one_thread_per_module():
    "One torch thread for a module's tests: its single-process references are tiny, and the other core goes to ranks"
    import torch
    n = torch.get_num_threads(); torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

@pytest.fixture
def run_cli():
    "Run the installed `dtnb` command as a subprocess; returns the CompletedProcess"
    exe = Path(sys.executable).parent / 'dtnb'
    def run(*args, timeout=120, env=None, check=True):
        e = {**os.environ, **(env or {})}
        r = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=timeout, env=e, cwd=ROOT)
        if check and r.returncode:
            raise AssertionError(f"dtnb {' '.join(args)} exited {r.returncode}\n{r.stdout}\n{r.stderr}")
        return r
    return run


@pytest.fixture
def cluster():
    """Factory of namespace-host clusters (tests/cluster.py): `c = cluster(2, rate='100mbit')`; every cluster it made is
    taken down after the test, its processes killed. Skips with the reason where namespaces cannot be made."""
    from cluster import Cluster, cluster_unavailable
    if (why := cluster_unavailable()): pytest.skip(why)
    made = []
    def make(n, rate=None):
        made.append(Cluster(n, rate=rate)); return made[-1]
    yield make
    for c in made: c.down()


def mp_helper(proc, parents=None) -> bool:
    """Is `proc` one of multiprocessing's own long-lived helpers started by one of `parents` (pids; default: this
    process): its resource tracker, or its fork server (`launch` starts ranks from one where fork is unsafe)? The ranks
    a fork server forks carry its command line too, but their parent is the server: they are never helpers."""
    import psutil
    try: cmd, ppid = ' '.join(proc.cmdline()), proc.ppid()
    except psutil.Error: return True  # gone already
    return 'resource_tracker' in cmd or ('forkserver' in cmd and ppid in (parents or {os.getpid()}))
