"tools/gpu_check.sh on a machine without a GPU: it says so, exits 0, and runs, installs and writes nothing"
import os, shutil, subprocess, sys
from pathlib import Path
import pytest, torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / 'tools' / 'gpu_check.sh'


def _has_gpu():
    smi = shutil.which('nvidia-smi')
    listed = smi and 'GPU ' in subprocess.run([smi, '-L'], capture_output=True, text=True).stdout
    return bool(listed) or torch.cuda.device_count() > 0  # NVML-based count: CUDA stays uninitialised


pytestmark = pytest.mark.skipif(_has_gpu() or bool(os.environ.get('DTNB_GPU_CHECK')),
                                reason="a GPU is here: tools/gpu_check.sh runs the real checks, not its no-GPU path")


def run(*args, **env):
    e = {**os.environ, 'PYTHON': sys.executable, **env}
    return subprocess.run(['bash', str(SCRIPT), *args], capture_output=True, text=True, env=e, cwd=ROOT, timeout=120)


def test_no_gpu_path_exits_0_and_does_nothing(tmp_path):
    out, venv = tmp_path / 'out', tmp_path / 'venv'
    r = run(str(out), GPU_CHECK_VENV=str(venv), WHEELHOUSE=str(tmp_path / 'no-wheels'))
    assert r.returncode == 0, r.stderr
    assert 'no GPU on this machine' in r.stdout and 'nothing run' in r.stdout
    assert not out.exists() and not venv.exists()  # no output folder, no install


def test_requirements_leave_torch_to_the_gpu_machine():
    r = run('--requirements')
    reqs = r.stdout.split()
    assert r.returncode == 0 and 'nbdev>=3.3' in reqs and 'fastcore>=1.8' in reqs and 'nvidia-ml-py>=12' in reqs
    assert not [q for q in reqs if q.startswith(('torch', 'playwright'))]


def test_multicuda_cells_only_with_two_gpus():
    "On one GPU the #| multicuda cells would put 2 ranks on it (an oversubscription error): they run from 2 GPUs"
    flags = [run('--flags-for', str(n)).stdout.split() for n in (1, 2, 8)]
    assert flags == [['cuda', 'slow'], ['cuda', 'multicuda', 'slow'], ['cuda', 'multicuda', 'slow']]

