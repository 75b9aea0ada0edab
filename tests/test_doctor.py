"""`dtnb doctor` on hosts made of network namespaces (tests/cluster.py): real processes on hosts with their own
addresses, torch's TCPStore and a gloo group between them, links shaped with tc. The CPU is its subject (gloo, CPU
tensors): each host's process runs under `cpu_env()`. Those tests carry the `cluster` marker and skip where
namespaces cannot be made (not root); the others run under torchrun --standalone and mpirun on this machine."""
import json, os, shutil, subprocess, sys, time
from pathlib import Path
import pytest
from conftest import ROOT, cpu_env

pytestmark = pytest.mark.usefixtures('cpu_ranks')
DTNB = str(Path(sys.executable).parent / 'dtnb')
# The links' threshold for these tests: a tc limit of 10 Mbit/s is 0.00125 GB/s, an unshaped veth pair on a loaded
# 2-core machine measured 0.3-0.5 GB/s; 0.01 GB/s (80 Mbit/s) sits far from both, whatever this machine's speed.
MIN = ['--min-busbw', '0.01']


def doctor_on(c, hosts, args=(), env=None, wait=120):
    "Run `dtnb doctor --hosts <every host>` on each of `hosts` at once; {host: (exit code, stdout, seconds)}"
    every = ','.join(c.addr(i) for i in c.hosts)
    t0, procs = time.monotonic(), {}
    for i in hosts:
        argv = [DTNB, 'doctor', '--hosts', every, *(args[i] if isinstance(args, dict) else args)]
        procs[i] = c.run(i, argv, env=cpu_env({**os.environ, **(env or {}).get(i, {})}), cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = {}
    for i, p in procs.items():
        text, _ = p.communicate(timeout=wait)
        out[i] = (p.returncode, '\n'.join(l for l in text.splitlines() if 'socket.cpp' not in l),
                  time.monotonic() - t0)
    return out


@pytest.mark.cluster
def test_healthy_two_hosts_say_so_with_the_interface_dtnb_chose(cluster):
    c = cluster(2)
    out = doctor_on(c, [1, 2], {1: MIN + ['--json'], 2: MIN})
    (rc1, js, _), (rc2, line, _) = out[1], out[2]
    assert rc1 == 0 and rc2 == 0, out
    r = json.loads(js)
    assert r['ok'] and r['verdict'] == 'healthy (2 nodes, 2 ranks)', js
    seen = {ch['detail'] for ch in r['checks']}
    for i in (1, 2):  # the hostname resolves to 127.0.1.1 here: dtnb's interface choice is what makes it healthy
        assert (f"node {i - 1} (host{i}) advertises 10.77.0.{i} (on eth0, chosen by dtnb); torch alone would advertise "
                "127.0.1.1") in seen, seen
    link = next(ch for ch in r['checks'] if ch['name'] == 'link')
    assert link['status'] == 'ok' and link['detail'].startswith('node 0 <-> node 1 (10.77.0.1 <-> 10.77.0.2)'), link
    assert r['measured']['links'][0]['busbw'] > 0.01 and '1' in r['measured']['clocks']
    assert line.strip() == 'dtnb doctor: healthy (2 nodes, 2 ranks) (rank 0 printed the report)', line


@pytest.mark.cluster
def test_a_host_advertising_loopback_is_named_with_the_interface_it_needs(cluster):
    "GLOO_SOCKET_IFNAME=lo on host 2: both get the verdict at once (no gloo mesh that would hang); rank 0 names it"
    c = cluster(2)
    out = doctor_on(c, [1, 2], MIN, env={2: {'GLOO_SOCKET_IFNAME': 'lo'}})
    (rc1, text, t1), (rc2, line, _) = out[1], out[2]
    assert rc1 == 1 and rc2 == 1, out
    assert text.startswith('dtnb doctor: 1 problem (2 nodes, 2 ranks)'), text
    assert '[FAIL] address: node 1 (host2) advertises 127.0.0.1 (on lo, your GLOO_SOCKET_IFNAME)' in text, text
    fix = text.split('[FAIL] address: node 1')[1].split('\n')[1]
    assert 'fix:' in fix and '127.0.0.1' in fix and 'eth0' in fix and 'GLOO_SOCKET_IFNAME' in fix, fix
    assert 'links: not measured' in text and '(on eth0, chosen by dtnb)' in text, text
    assert line.strip().startswith('dtnb doctor: 1 problem'), line


@pytest.mark.cluster
def test_an_unreachable_port_is_named_on_both_sides_within_the_timeout(cluster):
    "Host 2 looks for the rendezvous on another port: it says the port refused, host 1 names the rank that never came"
    c = cluster(2)
    out = doctor_on(c, [1, 2], {1: MIN + ['--timeout', '10'], 2: MIN + ['--timeout', '10', '--port', '29501']})
    (rc1, text1, t1), (rc2, text2, t2) = out[1], out[2]
    assert rc1 == 1 and rc2 == 1, out
    assert ('[FAIL] rendezvous: 1 of 2 ranks met at 10.77.0.1:29500 within 10s; rank 1 never came (node 1)'
            in text1), text1
    assert ('[FAIL] rendezvous: rank 1 cannot reach 10.77.0.1:29501: 10.77.0.1 refused port 29501: the host is up '
            'but nothing listens there') in text2, text2
    assert max(t1, t2) < 10 + 45, (t1, t2)  # the timeout, plus starting Python and torch on a loaded machine


@pytest.mark.cluster
def test_a_cut_link_is_named_by_the_host_that_cannot_reach_the_rendezvous(cluster):
    c = cluster(2)
    c.cut(2)
    (rc, text, t), = doctor_on(c, [2], MIN + ['--timeout', '5']).values()
    assert rc == 1 and '[FAIL] rendezvous: rank 1 cannot reach 10.77.0.1:29500:' in text, text
    assert 'no answer from 10.77.0.1:29500' in text or 'no route' in text, text


@pytest.mark.cluster
def test_a_shaped_slow_link_is_named(cluster):
    "Three hosts, host 3's link limited to 10 Mbit/s: its link fails the threshold and is named the slowest"
    c = cluster(3)
    c.shape(3, '10mbit')
    out = doctor_on(c, [1, 2, 3], MIN, wait=180)
    rc1, text, _ = out[1]
    assert rc1 == 1 and all(rc == 1 for rc, _, _ in out.values()), out
    assert text.startswith('dtnb doctor: 1 problem (3 nodes, 3 ranks)'), text
    assert '[FAIL] link: node 0 <-> node 2 (10.77.0.1 <-> 10.77.0.3): busbw' in text, text
    assert '[ok  ] link: node 0 <-> node 1 (10.77.0.1 <-> 10.77.0.2)' in text, text
    assert '[ok  ] slowest link: node 0 <-> node 2 (10.77.0.1 <-> 10.77.0.3)' in text, text


@pytest.mark.cluster
def test_under_torchrun_on_two_hosts(cluster):
    """Under torchrun's c10d rendezvous the ranks join the agent's store. The hostname resolves to 127.0.1.1 here, so
    torchrun cannot tell which agent hosts the rendezvous: `is_host` and `--local-addr` say it (torchrun's own need)"""
    c = cluster(2)
    tr = str(Path(sys.executable).parent / 'torchrun')
    procs = {i: c.run(i, [tr, '--nnodes', '2', '--nproc-per-node', '1', '--rdzv-backend', 'c10d', '--rdzv-endpoint',
                          f'{c.addr(1)}:29400', '--rdzv-conf', f'is_host={int(i == 1)}', '--local-addr', c.addr(i),
                          DTNB, 'doctor', *MIN], env=cpu_env(), cwd=ROOT, stdout=subprocess.PIPE,
                      stderr=subprocess.DEVNULL, text=True) for i in c.hosts}
    out = {i: (p.communicate(timeout=150)[0], p.returncode) for i, p in procs.items()}
    assert out[1][1] == 0 and out[1][0].startswith('dtnb doctor: healthy (2 nodes, 2 ranks)'), out
    assert '[ok  ] rendezvous: all 2 ranks met at 10.77.0.1:' in out[1][0], out[1][0]
    assert '[ok  ] link: node 0 <-> node 1 (10.77.0.1 <-> 10.77.0.2)' in out[1][0], out[1][0]
    assert 'dtnb doctor: healthy (2 nodes, 2 ranks) (rank 0 printed the report)' in out[2][0], out[2]


def without_gloo_lines(out:str) -> str:
    "`out` without the lines older gloo builds print on stdout as a group forms (torch 2.10: '[Gloo] Rank 0 is ...')"
    return ''.join(l for l in out.splitlines(keepends=True) if not l.startswith('[Gloo] '))


def test_two_ranks_on_one_node_under_torchrun_standalone(tmp_path):
    "No namespaces needed: one node, two ranks; the link is the whole group's all-reduce"
    tr = str(Path(sys.executable).parent / 'torchrun')
    r = subprocess.run([tr, '--standalone', '--nproc-per-node', '2', DTNB, 'doctor', '--json', *MIN,
                        '--checkpoint-dir', str(tmp_path / 'ckpt')], env=cpu_env(), cwd=ROOT, capture_output=True,
                       text=True, timeout=150)
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads(without_gloo_lines(r.stdout))
    assert d['verdict'] == 'healthy (1 node, 2 ranks)' and len(d['facts']) == 2, d
    assert [l['ranks'] for l in d['measured']['links']] == [2] and d['measured']['clocks'] == {}, d['measured']
    assert any(c['detail'].startswith('node 0 (') and f"at {tmp_path / 'ckpt'}" in c['detail']
               for c in d['checks'] if c['name'] == 'checkpoint dir'), d['checks']


def test_a_launch_without_a_rendezvous_address_is_refused_with_what_to_set(run_cli):
    env = {'OMPI_COMM_WORLD_RANK': '0', 'OMPI_COMM_WORLD_SIZE': '2', 'OMPI_COMM_WORLD_LOCAL_SIZE': '1'}
    r = run_cli('doctor', env=env, check=False, timeout=60)  # mpirun's variables, no MASTER_ADDR/MASTER_PORT
    assert r.returncode == 2, r
    assert ('mpirun (Open MPI) started 2 ranks without a rendezvous address: set MASTER_ADDR (the host of rank 0) '
            'and MASTER_PORT on every rank') in r.stderr, r.stderr


def test_under_mpirun_with_no_rendezvous_variables():
    "mpirun on one node: the rendezvous is 127.0.0.1 and a port from the job id, as init_distributed derives them"
    from test_mpi import MPIRUN, MPI_OPTS, LAUNCH_VARS
    if MPIRUN is None: pytest.skip("mpirun not found: install Open MPI (`apt-get install openmpi-bin`)")
    env = cpu_env({k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_VARS + ('MASTER_',))})
    r = subprocess.run([MPIRUN, *MPI_OPTS, '-n', '2', DTNB, 'doctor', *MIN], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=150)
    assert r.returncode == 0, r.stdout + r.stderr
    out = without_gloo_lines(r.stdout)
    assert out.startswith('dtnb doctor: healthy (1 node, 2 ranks)\n[ok  ] rendezvous: all 2 ranks met at '
                          '127.0.0.1:'), out
    assert '[ok  ] link: all 2 ranks: busbw' in out and out.count('dtnb doctor:') == 1, out


def test_a_small_dev_shm_and_a_full_checkpoint_disk_are_warned_with_their_fixes():
    "A mount namespace whose /dev/shm is a 16 MiB tmpfs (a container's kind), checkpoints written there"
    if os.geteuid() != 0 or not shutil.which('unshare'): pytest.skip("a private /dev/shm needs root and unshare")
    sh = f'mount -t tmpfs -o size=16m tmpfs /dev/shm && exec {DTNB} doctor --checkpoint-dir /dev/shm/ckpt'
    r = subprocess.run(['unshare', '-m', 'sh', '-c', sh], env=cpu_env(), cwd=ROOT, capture_output=True, text=True,
                       timeout=90)
    assert r.returncode == 0, r.stdout + r.stderr  # warnings: the job would run
    assert r.stdout.startswith('dtnb doctor: healthy, 2 warnings (1 node, 1 rank)'), r.stdout
    assert '[WARN] /dev/shm: node 0 (' in r.stdout and 'free, under 1 GiB' in r.stdout, r.stdout
    assert 'fix: docker run --shm-size=16g' in r.stdout, r.stdout
    assert 'free at /dev/shm/ckpt, under 10 GiB' in r.stdout, r.stdout
