"""Several hosts on one machine (network namespaces with their own addresses, tests/cluster.py): `dtnb launch` on
each of 2 and 3 hosts trains equal to one process with no *_SOCKET_IFNAME set by the test (each host's hostname
resolves to 127.0.1.1, as on Debian); a host cut off or killed mid-training stops every surviving rank within
DTNB_PEER_TIMEOUT with one error naming it, and leaves no process on any host. Needs root (skips otherwise)."""
import json, os, re, subprocess, sys, time
from pathlib import Path
import pytest
from conftest import cpu_env

pytestmark = [pytest.mark.usefixtures('cpu_ranks'), pytest.mark.cluster]

ROOT = Path(__file__).resolve().parent.parent
DTNB = str(Path(sys.executable).parent / 'dtnb')
BOUND = 15  # DTNB_PEER_TIMEOUT in these tests
SLACK = 25  # on top of BOUND: one heartbeat period, torchrun's teardown, and a loaded 2-core machine
STOPS = r"\[rank \d\] ERROR: dtnb\.launcher\.network: "  # a surviving rank's last line (dtnb.core.logs)
TRAIN = ['examples/train.py', '--steps', '6', '--global-batch', '12']
LAUNCH_VARS = ('OMPI_', 'PMI', 'PMIX_', 'SLURM_', 'MV2_', 'MPI_', 'I_MPI_', 'PALS_', 'TORCHELASTIC_', 'DTNB_')
PLAIN = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'GROUP_RANK', 'MASTER_ADDR', 'MASTER_PORT',
         'GLOO_SOCKET_IFNAME', 'NCCL_SOCKET_IFNAME')


def clean_env(**extra):
    "This environment without launcher or interface variables: what a user's shell on a fresh host has"
    e = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_VARS) and k not in PLAIN}
    return {**cpu_env(e, ROOT), 'OMP_NUM_THREADS': '1', **extra}


def launch_all(c, tmp_path, script, nnodes=None, env=None):
    "`dtnb launch -n 1` on each host of `c`, rendezvous at host 1; returns the processes and their log files"
    n = nnodes or len(c.hosts)
    procs, logs = [], []
    for i in c.hosts[:n]:
        logs.append(tmp_path / f'host{i}.log')
        argv = [DTNB, 'launch', '-n', '1', f'--peer-timeout={BOUND}', f'--nnodes={n}', f'--node-rank={i - 1}',
                f'--master-addr={c.addr(1)}', '--master-port=29500', *script]
        procs.append(c.run(i, argv, env=env or clean_env(), cwd=ROOT, stdout=open(logs[-1], 'w'),
                           stderr=subprocess.STDOUT))
    return procs, logs


def results(log):
    return [json.loads(l) for l in Path(log).read_text().splitlines() if l.startswith('{')]


@pytest.fixture(scope='module')
def one_process():
    r = subprocess.run([sys.executable, *TRAIN], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize('n', [2, 3])
def test_hosts_train_equal_to_one_process(cluster, tmp_path, one_process, n):
    c = cluster(n)
    procs, logs = launch_all(c, tmp_path, TRAIN)
    codes = [p.wait(timeout=300) for p in procs]
    out = [l.read_text() for l in logs]
    assert codes == [0] * n, '\n'.join(o[-3000:] for o in out)
    for i, o in zip(c.hosts, out):  # each host chose its own interface, and said so
        assert f"dtnb.launcher.network: host{i} uses GLOO_SOCKET_IFNAME=eth0, NCCL_SOCKET_IFNAME=eth0 (the interface " \
               f"that routes to the rendezvous host {c.addr(1)}" in o, o[-2000:]
    got = results(logs[0])
    assert len(got) == 1 and not any(results(l) for l in logs[1:])  # only the main rank reports
    got = got[0]
    assert (one_process['world_size'], got['world_size']) == (1, n)
    assert got['losses'] == pytest.approx(one_process['losses'], abs=1e-5)
    assert got['checksum'] == pytest.approx(one_process['checksum'], abs=1e-4)
    assert c.pids() == []


def test_loopback_interface_is_refused_at_start(cluster, tmp_path):
    c = cluster(2)
    procs, logs = launch_all(c, tmp_path, TRAIN, env=clean_env(GLOO_SOCKET_IFNAME='lo'))
    codes = [p.wait(timeout=120) for p in procs]
    out = logs[1].read_text()
    assert codes[1] != 0 and "this node would advertise 127.0.0.1 to the other node, because GLOO_SOCKET_IFNAME=lo " \
        "is a loopback interface" in out and "set GLOO_SOCKET_IFNAME=eth0" in out, out[-3000:]
    assert 'connectFullMesh failed' not in out and 'Traceback' not in out
    assert c.pids() == []


def wait_training(procs, logs, timeout=240):
    "Wait until rank 0 has done a step"
    end = time.monotonic() + timeout
    while 'rank 0: training' not in logs[0].read_text():
        assert time.monotonic() < end and all(p.poll() is None for p in procs), \
            '\n'.join(l.read_text()[-2000:] for l in logs)
        time.sleep(0.5)
    time.sleep(1)


def ended_within(c, procs, since, limit):
    "Seconds after `since` each host's processes were all gone (None: not within `limit`)"
    ends = [None] * len(procs)
    while time.monotonic() - since < limit and None in ends:
        for k, i in enumerate(c.hosts):
            if ends[k] is None and procs[k].poll() is not None and not c.pids(i): ends[k] = time.monotonic() - since
        time.sleep(0.25)
    return ends


def test_cut_host_stops_every_rank_naming_it(cluster, tmp_path):
    c = cluster(3)
    procs, logs = launch_all(c, tmp_path, ['tests/scripts/train_long.py'])
    wait_training(procs, logs)
    t = time.monotonic(); c.cut(3)
    ends = ended_within(c, procs, t, BOUND + SLACK)
    out = [l.read_text() for l in logs]
    assert None not in ends, (ends, [o[-2500:] for o in out])
    assert all(e > BOUND * 0.8 for e in ends), ends  # a heartbeat missed for the bound, not something sooner
    for o in out[:2]:  # every survivor: one error naming the lost rank and host, and what it was doing
        assert re.search(rf"{STOPS}rank [01] on host[12] stops: lost rank 2 on host3 \(10\.77\.0\.3\): not heard "
                         rf"from for \d+ s \(limit DTNB_PEER_TIMEOUT={BOUND} s\); it was last (in|at) ", o), o[-3000:]
    assert "lost rank 0 on host1 (10.77.0.1), which holds the job's store" in out[2], out[2][-3000:]
    assert c.pids() == []


def test_killed_host_stops_every_rank_naming_it(cluster, tmp_path):
    c = cluster(2)
    procs, logs = launch_all(c, tmp_path, ['tests/scripts/train_long.py'])
    wait_training(procs, logs)
    t = time.monotonic()
    subprocess.run(['kill', '-9', *map(str, c.pids(2))])
    ends = ended_within(c, procs, t, BOUND + SLACK)
    out = logs[0].read_text()
    assert ends[0] is not None, out[-3000:]
    assert re.search(rf"{STOPS}rank 0 on host1 stops: lost host2 \(10\.77\.0\.2: rank 1\): the connection broke "
                     r"\([^)]*\[10\.77\.0\.2\]:\d+[^)]*\); its last heartbeat, \d+ s before, said it was (in|at) "
                     r".*; this rank was (in|at) ", out) or \
        re.search(rf"{STOPS}rank 0 on host1 stops: lost rank 1 on host2 \(10\.77\.0\.2\)", out), out[-3000:]
    assert c.pids() == []


def test_dtnb_env_names_the_interface_on_a_host(cluster):
    c = cluster(2)
    job = dict(RANK='1', WORLD_SIZE='2', LOCAL_WORLD_SIZE='1', MASTER_ADDR=c.addr(1), MASTER_PORT='29500')
    p = c.run(2, [DTNB, 'env'], env=clean_env(**job), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
              text=True)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "network: gloo advertises 127.0.1.1 (hostname host2); 2 nodes, rendezvous at 10.77.0.1: dtnb sets " \
           "GLOO_SOCKET_IFNAME=eth0, NCCL_SOCKET_IFNAME=eth0 (the interface that routes there)" in out, out
