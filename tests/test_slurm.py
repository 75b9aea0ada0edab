"""A real SLURM on namespace hosts (tools/slurm.sh: munged, slurmctld on host 1, one slurmd per host, each node at its
host's own address): `sbatch examples/slurm.sbatch` trains equal to one process on 2 and 3 nodes, `scontrol requeue`
of the running job resumes from its checkpoint to the bitwise result of an uninterrupted job, and so does the job that
requeues itself on SIGUSR1 (what `--signal=USR1@90` sends before the time limit) after saving the step it stopped at.
The SLURM-variable parsing itself is unit-tested with given variables in nbs/00_launchenv.ipynb. The CPU is the
subject (`cpu_ranks`): ranks are CPU ranks on gloo. Needs root and `slurm-wlm munge` (run.sh test installs them); skips
with the reason otherwise."""
import json, os, re, subprocess, sys, time
from pathlib import Path
import pytest, psutil
from conftest import cpu_env
from slurm_cluster import SlurmCluster, slurm_unavailable

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
pytestmark = [pytest.mark.usefixtures('cpu_ranks'), pytest.mark.cluster_long]


@pytest.fixture(scope='module')
def slurm():
    "SLURM on 3 namespace hosts for this module; afterwards no daemon, job process or folder of it is left"
    if (why := slurm_unavailable()): pytest.skip(why)
    s = SlurmCluster(3)
    d, prefix = s.dir, (s.dir / 'prefix').read_text().strip()
    yield s
    s.down()
    assert not d.exists()
    assert [p for p in psutil.process_iter(['cmdline']) if str(d) in ' '.join(p.info['cmdline'] or [])] == []
    assert prefix not in subprocess.run(['ip', 'netns', 'list'], capture_output=True, text=True).stdout


def job_env(tmp_path):
    "The environment a job inherits from sbatch: dtnb's python first on PATH, checkpoints under tmp_path"
    env = {k: v for k, v in cpu_env(None, ROOT).items() if not k.endswith('_SOCKET_IFNAME')}  # dtnb picks it
    env['PATH'] = f"{Path(PY).parent}{os.pathsep}{env['PATH']}"
    env['DTNB_CHECKPOINTS'] = str(tmp_path / 'checkpoints')
    return env


def results(out:Path) -> list[dict]:
    "The JSON result lines train.py's main rank printed into a job's output file"
    # The JSON object that begins the line: srun writes its own messages into the same file, and when it stops a
    # requeued step one can land right after a long line, before its newline ('...}srun: error: host2: task 1:
    # Terminated'); a line cut inside the object still fails here.
    return [json.JSONDecoder().raw_decode(l)[0] for l in out.read_text().splitlines() if l.startswith('{')]


SHORT = ['--steps', '6', '--global-batch', '12']  # 12 samples a step: a whole number per rank on 1, 2 or 3 nodes


@pytest.fixture(scope='module')
def one_process():
    r = subprocess.run([PY, 'examples/train.py', *SHORT], cwd=ROOT, env=cpu_env(None, ROOT),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize('nodes', [2, 3])
def test_sbatch_trains_equal_to_one_process(slurm, one_process, tmp_path, nodes):
    out = tmp_path / 'job.out'
    job = slurm.sbatch('examples/slurm.sbatch', *SHORT, env=job_env(tmp_path), output=out,
                       options=['-N', nodes])
    slurm.wait(job, timeout=240)
    res = results(out)
    assert len(res) == 1, out.read_text()[-3000:]
    assert res[0]['world_size'] == nodes
    assert res[0]['losses'] == pytest.approx(one_process['losses'], abs=1e-5)
    assert res[0]['checksum'] == pytest.approx(one_process['checksum'], abs=1e-4)
    assert f"job {job} on host[1-{nodes}], restart 0" in out.read_text()


def test_requeue_resumes_from_checkpoint_bitwise(slurm, tmp_path):
    "Requeued once a checkpoint exists, the job resumes from it and ends bitwise where an uninterrupted job ends"
    import dtnb
    args = ['--steps', '60', '--epochs', '4', '--every', '5']
    plain_out, requeued_out = tmp_path / 'plain.out', tmp_path / 'requeued.out'
    env = job_env(tmp_path)
    dtnb.latest_checkpoint(tmp_path, warn=False)  # imported now, so that the first look below is quick
    plain = slurm.sbatch('examples/slurm.sbatch', *args, env=env, output=plain_out)
    slurm.wait(plain, timeout=240)
    job = slurm.sbatch('examples/slurm.sbatch', *args, env=env, output=requeued_out)
    ckpts, end = tmp_path / 'checkpoints' / str(job), time.monotonic() + 240
    while not (ckpts.exists() and dtnb.latest_checkpoint(ckpts, warn=False)):
        assert slurm.state(job) in ('PENDING', 'RUNNING', 'CONFIGURING'), requeued_out.read_text()[-3000:]
        assert time.monotonic() < end, "no checkpoint within 240 s"
        time.sleep(0.05)
    slurm.requeue(job)
    slurm.wait(job, timeout=240)
    text = requeued_out.read_text()
    (a,), second = results(plain_out), results(requeued_out)[-1]  # the first run may have printed its steps too
    assert f"job {job} on host[1-2], restart 1" in text, text[-3000:]
    stop = re.search(r"fit: SIGTERM received: stopped at step (\d+)", text)  # requeue sends SIGTERM (KillWait: 5 s)
    assert stop, text[-3000:]
    assert second['start_step'] == int(stop.group(1)) and 0 < second['start_step'] < 60, second  # the step it saved
    assert "fit: resumed from" in text
    assert (second['world_size'], second['steps']) == (2, 60)
    assert second['params_sha256'] == a['params_sha256']
    assert second['losses'] == a['losses']


def test_usr1_saves_requeues_itself_and_resumes_bitwise(slurm, tmp_path):
    """SIGUSR1, what `sbatch --signal=USR1@90` sends 90 s before the time limit (here sent by `scancel --signal`):
    fit stops at the next log step with a checkpoint of it, the job requeues itself, and resumes to the bitwise end"""
    args = ['--steps', '1000', '--epochs', '32', '--every', '100000']  # no periodic checkpoint: only the signal's
    env, plain_out, out = job_env(tmp_path), tmp_path / 'plain.out', tmp_path / 'usr1.out'
    plain = slurm.sbatch('examples/slurm.sbatch', *args, env=env, output=plain_out)
    slurm.wait(plain, timeout=240)
    job = slurm.sbatch('examples/slurm.sbatch', *args, env=env, output=out)
    text, end = lambda: out.read_text() if out.exists() else '', time.monotonic() + 240
    while f"requeues job {job}" not in text():  # rank 0 is in fit's loop, its handlers set (rank 1's before the
        assert time.monotonic() < end, text()[-3000:]  # same all-reduce)
        assert slurm.state(job) in ('PENDING', 'RUNNING', 'CONFIGURING'), text()[-3000:]
        time.sleep(0.05)
    slurm.run('scancel', '--signal=USR1', job)
    slurm.wait(job, timeout=120, until=lambda s: s == 'PENDING' and "fit: SIGUSR1 received" in text())
    assert 'restart 1' not in text()  # requeued by the job itself, and held back as SLURM holds a requeued job
    slurm.release(job)
    slurm.wait(job, timeout=240)
    log = text()
    stop = int(re.search(r"fit: SIGUSR1 received: stopped at step (\d+)", log).group(1))
    assert 0 < stop < 1000 and stop % 10 == 0, log[-3000:]
    assert f"job {job} on host[1-2], restart 1" in log, f"{log[-3000:]}\nstates {slurm.seen}\n{slurm.show(job)}"
    (a,), second = results(plain_out), results(out)[-1]
    assert (second['world_size'], second['start_step'], second['steps']) == (2, stop, 1000), log[-3000:]
    assert second['params_sha256'] == a['params_sha256'] and second['losses'] == a['losses']
