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


def test_wheelhouse_installs_offline(tmp_path):
    """The two steps a GPU machine without network needs, end to end on this one: a stand-in for the GPU image (a
    fresh venv with torch and the big packages images carry), the wheelhouse built against its package list (HAVE),
    then `gpu_check.sh --install-only` with no index and no reachable proxy, and dtnb's stack importable from it"""
    img, whl, have = tmp_path / 'image', tmp_path / 'whl', tmp_path / 'have.txt'
    py = img / 'bin' / 'python'
    subprocess.run([sys.executable, '-m', 'venv', str(img)], check=True, timeout=120)
    big = ['torch==' + torch.__version__.split('+')[0], 'numpy', 'matplotlib', 'transformers', 'tensorboard']
    subprocess.run([str(py), '-m', 'pip', 'install', '-q', '--no-compile', *big], check=True, timeout=600)  # 2× faster
    have.write_text(subprocess.run([str(py), '-m', 'pip', 'list', '--format=freeze'], capture_output=True, text=True,
                                   check=True).stdout)
    b = subprocess.run(['bash', str(ROOT / 'tools' / 'build_wheelhouse.sh'), str(whl)], capture_output=True, text=True,
                       env={**os.environ, 'PYTHON': str(py), 'HAVE': str(have)}, cwd=ROOT, timeout=600)
    assert b.returncode == 0 and 'wheelhouse' in b.stdout and 'left out' in b.stdout, b.stdout[-2000:] + b.stderr[-999:]
    assert not list(whl.glob('torch-*')) and list(whl.glob('nbdev-*')) and list(whl.glob('setuptools-*'))
    offline = {k: v for k, v in os.environ.items() if not k.startswith('PIP_')}  # no find-links but the wheelhouse
    offline.update(PIP_NO_INDEX='1', PIP_CONFIG_FILE=os.devnull, PYTHON=str(py), WHEELHOUSE=str(whl),
                   GPU_CHECK_VENV='none', **{k: 'http://127.0.0.1:9' for k in ('http_proxy', 'https_proxy',
                                                                           'HTTP_PROXY', 'HTTPS_PROXY')})
    r = subprocess.run(['bash', str(SCRIPT), '--install-only'], capture_output=True, text=True, env=offline, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    code = 'import dtnb, nbdev, execnb, fastcore, ipywidgets; print(dtnb.__file__)'
    out = subprocess.run([str(py), '-c', code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith(str(ROOT)), out.stderr
