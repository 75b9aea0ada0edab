"""dtnb inside Ray Train's `TorchTrainer` (examples/ray_train.py): 2 CPU workers on gloo, the process group Ray's,
dtnb's `wrap` and `fit` unchanged, parameters equal to one process's; Ray named as the launcher; no Ray process left
behind. Skips without Ray (`pip install 'dtnb[ray]'`; `bash run.sh test-long` installs it). The CPU is the subject:
CPU workers on gloo (`cpu_ranks`, conftest.py).

A local Ray binds the machine's own address, not a loopback one it is given, so the run goes in a network namespace of
its own whose only interface is loopback (`unshare -n`, root): its traffic never leaves 127.0.0.1."""
import json, os, shutil, subprocess, sys, tempfile, time
from pathlib import Path
import pytest
from conftest import cpu_env

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.usefixtures('cpu_ranks'), pytest.mark.long]


def _left(tag):
    "Pids of processes whose command line names `tag` (the Ray session folder of this test)"
    out = []
    for p in Path('/proc').iterdir():
        try:
            if p.name.isdigit() and tag in (p / 'cmdline').read_bytes().decode(errors='replace'):
                out.append(int(p.name))
        except OSError: pass
    return [p for p in out if p != os.getpid()]


def test_torch_trainer_runs_wrap_and_fit_unchanged_and_equals_one_process():
    pytest.importorskip('ray.train.torch', reason="no Ray Train: pip install 'dtnb[ray]'")
    sys.path.insert(0, str(ROOT / 'examples'))
    try: from ray_train import train_func
    finally: sys.path.remove(str(ROOT / 'examples'))
    if os.geteuid() != 0 or not shutil.which('unshare') or not shutil.which('ip'):
        pytest.skip("needs root, unshare and ip: Ray runs in a loopback-only network namespace")
    one = train_func(dict(steps=5))  # the same function, one process, no Ray
    tmp = tempfile.mkdtemp(prefix='dr', dir='/tmp')  # short: Ray's socket paths must fit in 107 bytes
    try:
        run = [sys.executable, 'examples/ray_train.py', '--workers', '2', '--steps', '5', '--temp-dir', tmp]
        isolated = ['unshare', '-n', 'sh', '-c', 'ip link set lo up && exec "$@"', 'sh']  # loopback only
        r = subprocess.run(isolated + run, cwd=ROOT, env=cpu_env({**os.environ, 'HOME': tmp}),  # Ray's ~/.ray too
                           capture_output=True, text=True, timeout=300)
        deadline = time.monotonic() + 10
        while (left := _left(tmp)) and time.monotonic() < deadline: time.sleep(0.2)  # ray.shutdown ends them
        assert not left, f"Ray processes left behind: {left}"
    finally:
        for pid in _left(tmp):
            try: os.kill(pid, 9)
            except OSError: pass
        shutil.rmtree(tmp, ignore_errors=True)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    two = json.loads(r.stdout.strip().splitlines()[-1])
    assert (two['world_size'], two['launcher'], two['group_was_ours']) == (2, 'ray', False)
    assert 'master 127.0.0.1:' in two['summary'], two['summary']  # the workers met on loopback
    assert (one['world_size'], one['launcher'], one['group_was_ours']) == (1, None, True)
    assert len(two['params']) == len(one['params'])
    assert max(abs(a - b) for a, b in zip(two['params'], one['params'])) < 1e-6
    assert max(abs(a - b) for a, b in zip(two['losses'], one['losses'])) < 1e-6
