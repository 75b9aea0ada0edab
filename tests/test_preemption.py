"""Preemption: a SIGTERM sent to `dtnb launch` (what a scheduler or `kill` sends) goes through torchrun to the ranks;
fit stops them at the next log step with a checkpoint of that step, nothing is left running, and the rerun resumes there
and ends bitwise where an uninterrupted run ends. SLURM's SIGUSR1 and requeue are in tests/test_slurm.py; one process
and two `launch` ranks in nbs/05e_train.callbacks.ipynb. CPU ranks on gloo (`cpu_ranks`); real processes and signals."""
import json, signal, subprocess, sys, time
from pathlib import Path
import pytest, psutil
from conftest import cpu_env

pytestmark = [pytest.mark.usefixtures('cpu_ranks'), pytest.mark.long]

ROOT = Path(__file__).resolve().parent.parent
DTNB = str(Path(sys.executable).parent / 'dtnb')
ARGS = ['examples/train.py', '--steps', '400', '--epochs', '13', '--every', '100']  # 32 steps an epoch


def launch(ckpt, **kw):
    return subprocess.Popen([DTNB, 'launch', '-n', '2', *ARGS, '--checkpoint-dir', str(ckpt)], cwd=ROOT,
                            env=cpu_env(None, ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def result(out:str) -> dict:
    return json.loads([l for l in out.splitlines() if l.startswith('{')][-1])


def test_sigterm_to_dtnb_launch_saves_the_step_and_the_rerun_ends_bitwise(tmp_path):
    from dtnb.train.checkpoint import latest_checkpoint, list_checkpoints
    plain = launch(tmp_path / 'plain')
    out, err = plain.communicate(timeout=240)
    assert plain.returncode == 0, err[-3000:]
    ckpt, p = tmp_path / 'ckpt', launch(tmp_path / 'ckpt')
    end = time.monotonic() + 120
    while not (ckpt.exists() and latest_checkpoint(ckpt, warn=False)):  # step 100 is saved: fit is in its loop
        assert p.poll() is None and time.monotonic() < end, p.communicate()[1][-3000:]
        time.sleep(0.02)
    p.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    _, err = p.communicate(timeout=60)
    took = time.monotonic() - t0
    assert p.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "dtnb launch: stopped by SIGTERM: torchrun passed it on to its ranks, which have ended" in err, err[-3000:]
    assert "fit: SIGTERM received: stopped at step" in err, err[-3000:]
    assert [q for q in psutil.process_iter(['cmdline']) if str(ckpt) in ' '.join(q.info['cmdline'] or [])] == []
    steps = [c['step'] for c in list_checkpoints(ckpt).complete]
    stop = steps[-1]
    assert 100 < stop < 400 and stop % 10 == 0, steps  # the step it stopped at, a log step past the periodic one
    assert f"stopped at step {stop}" in err
    again = launch(ckpt)
    out2, err2 = again.communicate(timeout=240)
    assert again.returncode == 0, err2[-3000:]
    a, b = result(out), result(out2)
    assert (b['start_step'], b['steps']) == (stop, 400)
    assert b['params_sha256'] == a['params_sha256'] and b['losses'] == a['losses']
    print(f"SIGTERM at step 100+: stopped at step {stop}, dtnb launch ended {took:.1f} s after the signal")
