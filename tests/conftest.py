import os, subprocess, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parent.parent


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
        if check and r.returncode: raise AssertionError(f"dtnb {' '.join(args)} exited {r.returncode}\n{r.stdout}\n{r.stderr}")
        return r
    return run
