import os, subprocess, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parent.parent

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
