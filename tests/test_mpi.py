"""The training script under `mpirun -n 2`, and under SLURM and MPICH variables set by hand: ranks right, results equal
one process, a missing address named, never a hang. Every subprocess has a timeout.
The CPU is the subject: ranks are CPU ranks on gloo on any machine (`cpu_ranks`, conftest.py)."""
import json, os, random, shutil, socket, subprocess, sys, time
from pathlib import Path
import pytest
from conftest import cpu_env
from dtnb.core.env import parse_launch_env
from dtnb.launcher.processes import init_distributed, free_port

pytestmark = pytest.mark.usefixtures('cpu_ranks')

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
TRAIN = ['examples/train.py', '--steps', '6']
MPIRUN = shutil.which('mpirun')
needs_mpirun = pytest.mark.skipif(MPIRUN is None, reason="mpirun not found: install Open MPI (`apt-get install "
                                  "openmpi-bin`; `bash run.sh test` does it when run as root)")
# loopback only, no MPI transport needed beyond mpirun's own start-up; root allowed in containers
MPI_OPTS = ['--allow-run-as-root', '--oversubscribe', '--mca', 'btl', 'self,tcp', '--mca', 'btl_tcp_if_include', 'lo',
            '--mca', 'oob_tcp_if_include', 'lo', '-x', 'PYTHONPATH', '-x', 'OMP_NUM_THREADS', '-x', 'DTNB_DEVICE',
            '-x', 'DTNB_STANDIN_GPUS']
LAUNCH_VARS = ('OMPI_', 'PMI', 'PMIX_', 'SLURM_', 'MV2_', 'MPI_', 'I_MPI_', 'PALS_', 'TORCHELASTIC_', 'DTNB_')
PROBE = '''import json, torch, torch.distributed as dist, dtnb
g = dtnb.init_distributed()
t = torch.tensor([float(dtnb.rank() + 1)]); dist.all_reduce(t)
le = dtnb.detection.device.parse_launch_env()
print(json.dumps(dict(rank=dtnb.rank(), world=dtnb.world_size(), local=dtnb.local_rank(), launcher=le.launcher,
                      master=[le.master_addr, le.master_port], sum=t.item())), flush=True)
dtnb.shutdown()'''


def clean_env(**extra):
    "This environment without any launcher's variables, plus `extra`"
    plain = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'GROUP_RANK', 'MASTER_ADDR', 'MASTER_PORT')
    e = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_VARS) and k not in plain}
    return {**cpu_env(e, ROOT), 'OMP_NUM_THREADS': '1', **extra}  # DTNB_DEVICE=cpu: CPU ranks beside any GPUs


def last_json(out):
    "Every JSON object the ranks printed, in order: mpirun may join two ranks' lines before their newlines"
    dec, objs, i = json.JSONDecoder(), [], 0
    while (i := out.find('{', i)) != -1:
        try: o, i = dec.raw_decode(out, i)
        except json.JSONDecodeError: i += 1; continue
        if isinstance(o, dict): objs.append(o)
    return objs


@pytest.fixture(scope='module')
def one_process():
    "The single-process reference run of the example script"
    r = subprocess.run([PY, *TRAIN], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return last_json(r.stdout)[-1]


def same_as(ref, got):
    assert (ref['world_size'], got['world_size']) == (1, 2)
    assert got['losses'] == pytest.approx(ref['losses'], abs=1e-5)
    assert got['checksum'] == pytest.approx(ref['checksum'], abs=1e-4)
    assert got['losses'][-1] < got['losses'][0]


def mpirun(*args, timeout=180):
    return subprocess.run([MPIRUN, *MPI_OPTS, '-n', '2', *args], cwd=ROOT, env=clean_env(), capture_output=True,
                          text=True, timeout=timeout)


@needs_mpirun
def test_mpirun_trains_and_equals_one_process(one_process):
    r = mpirun(PY, *TRAIN)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = last_json(r.stdout)
    assert len(res) == 1  # only the main rank reports
    same_as(one_process, res[0])


@needs_mpirun
def test_mpirun_ranks_and_dtnb_env():
    r = mpirun(PY, '-c', PROBE)
    assert r.returncode == 0, r.stderr[-3000:]
    res = sorted(last_json(r.stdout), key=lambda d: d['rank'])
    assert [(d['rank'], d['world'], d['local'], d['launcher'], d['sum']) for d in res] == \
        [(0, 2, 0, 'openmpi', 3.0), (1, 2, 1, 'openmpi', 3.0)]
    addr, port = res[0]['master']  # no MASTER_ADDR/PORT given: loopback, and a port both ranks derived alike
    assert res[1]['master'] == [addr, port] and addr == '127.0.0.1' and 15000 <= port < 35000
    r = mpirun(str(Path(PY).parent / 'dtnb'), 'env', timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    for k in (0, 1): assert f"launched by mpirun (Open MPI): rank {k} of 2, local rank {k} of 2" in r.stdout


def free_port_in(lo, hi):
    "A free TCP port in [lo, hi)"
    for _ in range(500):
        p = random.randrange(lo, hi)
        with socket.socket() as s:
            try: s.bind(('127.0.0.1', p)); return p
            except OSError: pass
    raise RuntimeError(f"no free port in {lo}-{hi}")


def two_ranks(var_sets, args, timeout=180):
    "Start one plain process per environment in `var_sets`, as a launcher would; return their outputs in rank order"
    procs = [subprocess.Popen([PY, *args], cwd=ROOT, env=clean_env(**v), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for v in var_sets]
    try: outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs: p.kill()
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    return outs


def slurm_vars(r, job):
    return dict(SLURM_PROCID=str(r), SLURM_NTASKS='2', SLURM_LOCALID=str(r), SLURM_NODEID='0', SLURM_NNODES='1',
                SLURM_NODELIST=socket.gethostname(), SLURM_TASKS_PER_NODE='2', SLURM_JOB_ID=str(job))


def hydra_vars(r, port):
    return dict(PMI_RANK=str(r), PMI_SIZE='2', MPI_LOCALRANKID=str(r), MPI_LOCALNRANKS='2', PMI_FD=str(5 + r),
                MASTER_PORT=str(port))


@pytest.mark.long  # srun's variables (a real SLURM: the cluster tests): bash run.sh test-long
def test_srun_style_variables_train_and_equal_one_process(one_process):
    job = free_port_in(15000, 35000) - 15000  # SLURM's port is 15000 + job id % 20000: pick a job whose port is free
    outs = two_ranks([slurm_vars(r, job) for r in (0, 1)], TRAIN)
    res = last_json(outs[0][0])
    assert len(res) == 1 and last_json(outs[1][0]) == []
    same_as(one_process, res[0])
    job = free_port_in(15000, 35000) - 15000
    outs = two_ranks([slurm_vars(r, job) for r in (0, 1)], ['-c', PROBE])
    got = [last_json(o)[0] for o, _ in outs]
    assert [(d['rank'], d['world'], d['local'], d['launcher'], d['sum']) for d in got] == \
        [(0, 2, 0, 'slurm', 3.0), (1, 2, 1, 'slurm', 3.0)]
    assert got[0]['master'][0] == '127.0.0.1'  # one node: loopback, not a name to resolve


@pytest.mark.long  # a second launcher's variables (mpirun's own run stays here): bash run.sh test-long
def test_pmi_variables_train_and_equal_one_process(one_process):
    port = free_port()
    outs = two_ranks([hydra_vars(r, port) for r in (0, 1)], TRAIN)
    same_as(one_process, last_json(outs[0][0])[0])
    port = free_port()
    outs = two_ranks([hydra_vars(r, port) for r in (0, 1)], ['-c', PROBE])
    got = [last_json(o)[0] for o, _ in outs]
    assert [(d['rank'], d['world'], d['local'], d['launcher'], d['sum']) for d in got] == \
        [(0, 2, 0, 'mpich', 3.0), (1, 2, 1, 'mpich', 3.0)]


OMPI_4_ON_2_NODES = dict(OMPI_COMM_WORLD_RANK='1', OMPI_COMM_WORLD_SIZE='4', OMPI_COMM_WORLD_LOCAL_RANK='1',
                         OMPI_COMM_WORLD_LOCAL_SIZE='2', OMPI_MCA_ess_base_jobid='4242')


def test_missing_address_rule():
    one = lambda r: parse_launch_env(dict(OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_SIZE='2', PMIX_NAMESPACE='n7',
                                          OMPI_COMM_WORLD_LOCAL_RANK=str(r), OMPI_COMM_WORLD_LOCAL_SIZE='2'))
    assert (one(0).master_addr, one(0).master_port) == (one(1).master_addr, one(1).master_port)  # every rank agrees
    assert one(0).master_addr == '127.0.0.1' and 15000 <= one(0).master_port < 35000
    l = parse_launch_env(OMPI_4_ON_2_NODES)  # two nodes: no address is guessed; the port still comes from the job id
    assert l.master_addr is None and l.master_port is not None
    l = parse_launch_env({**OMPI_4_ON_2_NODES, 'OMPI_COMM_WORLD_LOCAL_SIZE': '4', 'OMPI_COMM_WORLD_SIZE': '4'})
    assert l.master_addr == '127.0.0.1'
    no_local = {k: v for k, v in OMPI_4_ON_2_NODES.items() if 'LOCAL' not in k}  # local size unknown: no guess
    assert parse_launch_env(no_local).master_addr is None
    given = parse_launch_env({**OMPI_4_ON_2_NODES, 'MASTER_ADDR': 'node01', 'MASTER_PORT': '29500'})
    assert (given.master_addr, given.master_port, given.master_from) == ('node01', 29500, '')


@pytest.mark.parametrize('env,how', [
    (OMPI_4_ON_2_NODES, "mpirun -x MASTER_ADDR=$(hostname) -x MASTER_PORT=29500"),
    (dict(PMI_RANK='1', PMI_SIZE='4', MPI_LOCALRANKID='1', MPI_LOCALNRANKS='2'), "mpiexec -genv MASTER_ADDR"),
    (dict(PMI_RANK='1', PMI_SIZE='4', MPI_LOCALRANKID='1', MPI_LOCALNRANKS='2', I_MPI_ROOT='/opt/intel'),
     "mpirun (Intel MPI) started 4 ranks but MASTER_ADDR and MASTER_PORT are not set"),
])
def test_missing_address_is_a_named_error(monkeypatch, env, how):
    for k in list(os.environ):
        if k.startswith(LAUNCH_VARS) and k != 'DTNB_DEVICE' or k in ('RANK', 'WORLD_SIZE', 'MASTER_ADDR',
                                                                     'MASTER_PORT'):
            monkeypatch.delenv(k)
    for k, v in env.items(): monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match='MASTER_ADDR') as e: init_distributed(backend='gloo')
    assert how in str(e.value)
    import torch.distributed as dist
    assert not dist.is_initialized()


def test_rendezvous_never_hangs():
    "A rank whose peers never come stops after rdzv_timeout with a named error (rank 0 and rank 1 alone, side by side)"
    code = 'import dtnb; dtnb.init_distributed(rdzv_timeout=2)'
    ports = [free_port()]
    while (p := free_port()) == ports[0]: pass  # two ports: the two lone ranks must not meet each other
    ports.append(p)
    t = time.monotonic()
    procs = [subprocess.Popen([PY, '-c', code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=clean_env(OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_SIZE='2',
                                            OMPI_COMM_WORLD_LOCAL_RANK=str(r), OMPI_COMM_WORLD_LOCAL_SIZE='2',
                                            MASTER_PORT=str(ports[r]))) for r in (0, 1)]
    try: errs = [p.communicate(timeout=60)[1] for p in procs]
    finally:
        for p in procs: p.kill()
    assert time.monotonic() - t < 30
    for r, (p, err) in enumerate(zip(procs, errs)):
        assert p.returncode != 0, err[-2000:]
        assert f"RendezvousError: rank {r} of 2 (mpirun (Open MPI)) could not meet the other ranks at 127.0.0.1" \
            in err, err[-2000:]
