"""Elastic recovery across namespace hosts (tools/cluster.sh): `dtnb launch` on each host with the c10d rendezvous at
host 1's own address and `--max-restarts`; every process of host 2 killed mid-run, then host 2 started again: the
job continues from its last complete checkpoint (`fit(checkpoint_dir=...)`) and ends with parameters and losses
bitwise equal to an uninterrupted 2-rank run. With `--nnodes=1:2` and host 2 lost for good, host 1 goes on alone.
The CPU is the subject (`cpu_ranks`): ranks are CPU ranks on gloo, whose all-reduce of two ranks sums two numbers,
so the result does not depend on which hosts the ranks ran on. Needs root (skips without)."""
import json, os, subprocess, sys, time
from pathlib import Path
import pytest
from conftest import cpu_env

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
DTNB = str(Path(PY).parent / 'dtnb')
ARGS = ['examples/train.py', '--steps', '60', '--epochs', '4', '--every', '5']
# One torch thread per rank everywhere: the matmuls of a rank with 2 threads may round differently from 1 thread's
# (and no *_SOCKET_IFNAME: dtnb picks the interface that reaches the rendezvous host)
ENV = {**{k: v for k, v in cpu_env(None, ROOT).items() if not k.endswith('_SOCKET_IFNAME')}, 'OMP_NUM_THREADS': '1'}
pytestmark = [pytest.mark.usefixtures('cpu_ranks'), pytest.mark.cluster_long]


def results(*logs) -> list[dict]:
    "The JSON result lines printed into `logs` (by whichever host ran rank 0)"
    return [json.loads(l) for p in logs for l in Path(p).read_text().splitlines() if l.startswith('{')]


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory):
    "The same training on 2 ranks of this machine, never interrupted"
    ck = tmp_path_factory.mktemp('uninterrupted')
    r = subprocess.run([DTNB, 'launch', '-n', '2', *ARGS, '--checkpoint-dir', str(ck)], cwd=ROOT,
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (res,) = [json.loads(l) for l in r.stdout.splitlines() if l.startswith('{')]
    return res


def test_killed_host_restarts_and_resumes_bitwise(cluster, uninterrupted, tmp_path):
    import dtnb
    c, ck = cluster(2), tmp_path / 'checkpoints'
    def agent(i, log):
        return c.run(i, [DTNB, 'launch', '-n', '1', '--nnodes=2', '--max-restarts=2', '--rdzv-backend=c10d',
                         f'--rdzv-endpoint={c.addr(1)}:29400', '--rdzv-id=elastic', *ARGS, '--checkpoint-dir', ck],
                     env=ENV, cwd=ROOT, stdout=open(log, 'w'), stderr=subprocess.STDOUT)
    logs = [tmp_path / n for n in ('host1.log', 'host2.log', 'host2-again.log')]
    dtnb.latest_checkpoint(tmp_path, warn=False)  # imported now, so that the first look below is quick
    a1, a2 = agent(1, logs[0]), agent(2, logs[1])
    end = time.monotonic() + 240
    while not (ck.exists() and dtnb.latest_checkpoint(ck, warn=False)):
        assert a1.poll() is None and a2.poll() is None, [l.read_text()[-2000:] for l in logs[:2]]
        assert time.monotonic() < end, "no checkpoint within 240 s"
        time.sleep(0.05)
    subprocess.run(['kill', '-KILL', *map(str, c.pids(2))])  # host 2 dies: its agent and its rank
    assert a2.wait(timeout=30) == -9
    assert a1.poll() is None  # host 1 waits for the lost node (it restarts its rank and rendezvouses again)
    a2 = agent(2, logs[2])
    assert (a1.wait(timeout=300), a2.wait(timeout=300)) == (0, 0), [l.read_text()[-3000:] for l in logs]
    (res,) = results(*logs)
    text = ''.join(l.read_text() for l in logs)
    assert 'fit: resumed from' in text and 0 < res['start_step'] < 60, res  # it went on from a checkpoint
    assert (res['world_size'], res['steps']) == (2, 60)
    assert res['params_sha256'] == uninterrupted['params_sha256']
    assert res['losses'] == uninterrupted['losses']
    assert c.pids() == []  # nothing left on either host


def test_min_max_nodes_go_on_without_a_lost_host(cluster, tmp_path):
    "--nnodes=1:2 and host 2 lost for good: host 1 resumes alone from the checkpoint and ends as one process does"
    import dtnb
    one = subprocess.run([PY, *ARGS], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    (ref,) = [json.loads(l) for l in one.stdout.splitlines() if l.startswith('{')]
    c, ck = cluster(2), tmp_path / 'checkpoints'
    dtnb.latest_checkpoint(tmp_path, warn=False)  # imported now, so that the first look below is quick
    logs = [tmp_path / 'host1.log', tmp_path / 'host2.log']
    a1, a2 = [c.run(i, [DTNB, 'launch', '-n', '1', '--nnodes=1:2', '--max-restarts=2', '--rdzv-backend=c10d',
                        f'--rdzv-endpoint={c.addr(1)}:29400', '--rdzv-id=minmax', *ARGS, '--checkpoint-dir', ck],
                  env=ENV, cwd=ROOT, stdout=open(log, 'w'), stderr=subprocess.STDOUT) for i, log in zip((1, 2), logs)]
    end = time.monotonic() + 240
    while not (ck.exists() and dtnb.latest_checkpoint(ck, warn=False)):
        assert a1.poll() is None and a2.poll() is None, [l.read_text()[-2000:] for l in logs]
        assert time.monotonic() < end, "no checkpoint within 240 s"
        time.sleep(0.05)
    subprocess.run(['kill', '-KILL', *map(str, c.pids(2))])  # host 2 is gone and stays gone
    assert a1.wait(timeout=300) == 0, logs[0].read_text()[-3000:]
    (res,) = results(logs[0])
    assert 'fit: resumed from' in logs[0].read_text() and 0 < res['start_step'] < 60, res
    assert (res['world_size'], res['steps']) == (1, 60)  # the world shrank to the one node left
    assert res['losses'] == pytest.approx(ref['losses'], abs=1e-5)
    assert res['checksum'] == pytest.approx(ref['checksum'], abs=1e-4)
    assert c.pids() == []


def test_lost_host_not_back_in_time_ends_the_job_saying_so(cluster, tmp_path):
    "Host 2 lost for good under --nnodes=2 --max-restarts: host 1 rendezvouses again, waits --join-timeout, then ends"
    import dtnb
    c, ck, log = cluster(2), tmp_path / 'checkpoints', tmp_path / 'host1.log'
    dtnb.latest_checkpoint(tmp_path, warn=False)
    a1, a2 = [c.run(i, [DTNB, 'launch', '-n', '1', '--nnodes=2', '--max-restarts=2', '--join-timeout=10',
                        '--rdzv-backend=c10d', f'--rdzv-endpoint={c.addr(1)}:29400', '--rdzv-id=gone', *ARGS,
                        '--checkpoint-dir', ck],
                  env=ENV, cwd=ROOT, stdout=open(out, 'w'), stderr=subprocess.STDOUT)
              for i, out in ((1, log), (2, tmp_path / 'host2.log'))]
    end = time.monotonic() + 240
    while not (ck.exists() and dtnb.latest_checkpoint(ck, warn=False)):
        assert a1.poll() is None and a2.poll() is None, log.read_text()[-2000:]
        assert time.monotonic() < end, "no checkpoint within 240 s"
        time.sleep(0.05)
    t = time.monotonic()
    subprocess.run(['kill', '-KILL', *map(str, c.pids(2))])  # host 2 is gone and stays gone
    # the restarted rank's rendezvous waits 10 s, not torch's 600 (the rest: noticing the loss, starting the agent's
    # rendezvous again, and a busy 2-core machine)
    assert a1.wait(timeout=120) == 1, log.read_text()[-3000:]
    took, out = time.monotonic() - t, log.read_text()
    assert 10 <= took, took
    assert f"dtnb launch: the rendezvous at {c.addr(1)}:29400 did not gather 2 nodes within 10 s (a node was not " \
           "started, cannot reach" in out and "--join-timeout=S (DTNB_JOIN_TIMEOUT; now 10 s)" in out, out[-3000:]
    assert c.pids() == []
