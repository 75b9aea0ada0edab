"""launch from a real Jupyter kernel, torchrun through `dtnb launch`, two nodes on loopback, and clean-up.

Every test checks that no rank process is left behind: checked with psutil, not assumed.
The CPU is the subject: ranks are CPU ranks on gloo on any machine (`cpu_ranks`, conftest.py)."""
import json, os, subprocess, sys, time
from pathlib import Path
import pytest, psutil
from conftest import cpu_env, gpu_standin, mp_helper

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
DTNB = str(Path(PY).parent / 'dtnb')
ENV = cpu_env(None, ROOT)  # DTNB_DEVICE=cpu for the subprocesses too
pytestmark = pytest.mark.usefixtures('cpu_ranks')


def ranks_left():
    "Child processes of this test process, less the test kernel and multiprocessing's own helpers (its and ours)"
    kids = psutil.Process().children(recursive=True)
    kernels = {c.pid for c in kids if 'ipykernel' in ' '.join(c.cmdline())}
    return [c for c in kids if c.pid not in kernels and not mp_helper(c, kernels | {os.getpid()})]


@pytest.fixture(scope='module')
def kernel():
    "A real ipykernel, driven through jupyter_client"
    from jupyter_client.manager import start_new_kernel
    km, kc = start_new_kernel(kernel_name='python3', env=ENV, cwd=str(ROOT))
    yield km, kc
    kc.stop_channels(); km.shutdown_kernel(now=True)


def run(kc, code, timeout=120):
    "Execute `code` in the kernel; return its stdout and (error name, value) if it raised"
    msg_id = kc.execute(code)
    out, err = [], None
    while True:
        m = kc.get_iopub_msg(timeout=timeout)
        if m['parent_header'].get('msg_id') != msg_id: continue
        t, c = m['msg_type'], m['content']
        if t == 'stream': out.append(c['text'])
        elif t == 'error': err = (c['ename'], c['evalue'])
        elif t == 'status' and c['execution_state'] == 'idle': break
    return ''.join(out), err


def kernel_children(km):
    pid = km.provisioner.process.pid
    return [c for c in psutil.Process(pid).children(recursive=True) if not mp_helper(c, {pid})]


SETUP = '''
import torch, torch.distributed as dist, time
from dtnb.launcher.processes import launch, LaunchError
from dtnb.core.dist import rank, world_size
def train(k):
    t = torch.full((2,), float(rank() + 1)); dist.all_reduce(t)
    print(f"rank {rank()} of {world_size()} sees {t.tolist()}")
    return t.sum().item() * k
'''


def test_fork_and_spawn_from_a_real_kernel(kernel):
    km, kc = kernel
    out, err = run(kc, SETUP + "print(launch(train, 2, nprocs=2))")
    assert err is None, err
    assert '[12.0, 12.0]' in out and 'rank 1 of 2 sees [3.0, 3.0]' in out  # children's output shows in the cell
    out, err = run(kc, "print(launch(train, 3, nprocs=2, start_method='spawn', prefix=True))")
    assert err is None, err
    assert '[18.0, 18.0]' in out and '[rank 1] rank 1 of 2 sees' in out
    out, err = run(kc, "print(launch(train, 4, nprocs=2, start_method='forkserver'))")  # Python 3.14's default on Linux
    assert err is None, err
    assert '[24.0, 24.0]' in out
    assert kernel_children(km) == []


def test_rank_error_from_kernel(kernel):
    km, kc = kernel
    run(kc, SETUP)
    code = '''
def boom():
    if rank() == 1: raise KeyError("missing shard")
    dist.barrier()
t0 = time.monotonic()
try: launch(boom, nprocs=2)
except LaunchError as e: print("FAILED", e.failed, "KeyError: 'missing shard'" in str(e), round(time.monotonic() - t0))
'''
    out, err = run(kc, code)
    assert err is None, err
    failed, has_tb, secs = out.split('FAILED')[1].split(']')[0] + ']', 'True' in out, int(out.split()[-1])
    assert failed.strip() == '[1' + ']' and has_tb and secs < 20
    assert kernel_children(km) == []


def test_keyboard_interrupt_stops_every_rank(kernel):
    km, kc = kernel
    run(kc, SETUP)
    msg_id = kc.execute("def sleepy():\n    time.sleep(60)\nlaunch(sleepy, nprocs=2)")
    deadline = time.monotonic() + 30
    while len(kernel_children(km)) < 2 and time.monotonic() < deadline: time.sleep(0.1)
    assert len(kernel_children(km)) >= 2
    km.interrupt_kernel()
    ename = None
    while True:
        m = kc.get_iopub_msg(timeout=30)
        if m['parent_header'].get('msg_id') != msg_id: continue
        if m['msg_type'] == 'error': ename = m['content']['ename']
        if m['msg_type'] == 'status' and m['content']['execution_state'] == 'idle': break
    assert ename == 'KeyboardInterrupt'
    deadline = time.monotonic() + 10
    while kernel_children(km) and time.monotonic() < deadline: time.sleep(0.1)
    assert kernel_children(km) == []


def test_a_kernel_after_export_and_backward_launches_from_one_fork_server():
    """On PyPI's CUDA build a notebook that ran torch.export and a backward cannot fork ranks (they would die at their
    first backward): every launch then forks its ranks from dtnb's fork server, started once with torch imported
    (milliseconds a launch, not a spawned rank's seconds of imports: bench_launch.py --start-methods).
    On the CPU build nothing stops fork, and the kernel forks them itself. A kernel of its own: its state is the point.
    """
    from jupyter_client.manager import start_new_kernel
    km, kc = start_new_kernel(kernel_name='python3', env=ENV, cwd=str(ROOT))
    try:
        run(kc, SETUP)
        out, err = run(kc, """
import os, json
from dtnb.detection.device import fork_hazards
torch.export.export(torch.nn.Linear(2, 2), (torch.zeros(1, 2),))
torch.nn.Linear(2, 2)(torch.zeros(1, 2)).sum().backward()
def parent(k): return os.getppid(), train(k)
res = [launch(parent, k, nprocs=2) for k in (1, 2)]
autograd = any(h.startswith("autograd's") for h in fork_hazards())
print("RESULT", json.dumps(dict(res=res, me=os.getpid(), autograd=autograd)))
""")
        assert err is None, err
        o = json.loads(out.split('RESULT')[1])
        assert [s for r in o['res'] for _, s in r] == [6.0, 6.0, 12.0, 12.0], o
        parents = {p for r in o['res'] for p, _ in r}
        assert (len(parents) == 1 and o['me'] not in parents) if o['autograd'] else parents == {o['me']}, o
        assert kernel_children(km) == []
    finally:
        kc.stop_channels(); km.shutdown_kernel(now=True)


@pytest.mark.long  # a stress test: bash run.sh test-long
@pytest.mark.parametrize('method', [None, 'forkserver'])  # fork here, and the fork server of the CUDA builds
def test_200_launches_in_one_kernel(kernel, method):
    km, kc = kernel
    run(kc, SETUP)
    code = f'''
import os, psutil
def quick(): t = torch.ones(1); dist.all_reduce(t); return t.item()
t0 = time.monotonic()
bad = [i for i in range(200) if launch(quick, nprocs=2, timeout=60, start_method={method!r}) != [2.0, 2.0]]
helper = lambda c, cmd: 'resource_tracker' in cmd or ('forkserver' in cmd and c.ppid() == os.getpid())
left = [c for c in psutil.Process().children(recursive=True) if not helper(c, ' '.join(c.cmdline()))]
print("DONE", len(bad), len(left), round(time.monotonic() - t0, 1))
'''
    out, err = run(kc, code, timeout=300)
    assert err is None, err
    _, nbad, nleft, secs = out.split('DONE')[1].split()[:1] + out.split('DONE')[1].split()
    assert (int(nbad), int(nleft)) == (0, 0), out


def test_dtnb_launch_trains_and_equals_one_process():
    # the one-process reference runs beside the launch (one process, no port: the two cannot meet)
    one = subprocess.Popen([PY, 'examples/train.py', '--steps', '6'], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        # `python -m dtnb` is the `dtnb` command; `-m module` runs a module as torchrun does (script files: next test)
        two = subprocess.run([PY, '-m', 'dtnb', 'launch', '-n', '2', '-m', 'examples.train', '--steps', '6'], cwd=ROOT,
                             env=ENV, capture_output=True, text=True, timeout=180)
        one_out, one_err = one.communicate(timeout=120)
    finally: one.kill()
    assert one.returncode == 0, one_err
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = json.loads(one_out.strip().splitlines()[-1]), json.loads(two.stdout.strip().splitlines()[-1])
    assert (a['world_size'], b['world_size']) == (1, 2)
    assert b['losses'] == pytest.approx(a['losses'], abs=1e-5)
    assert b['checksum'] == pytest.approx(a['checksum'], abs=1e-4)
    assert b['losses'][-1] < b['losses'][0]


@pytest.mark.long  # two nodes (namespace hosts: the cluster tests): bash run.sh test-long
def test_two_nodes_on_loopback():
    from dtnb.launcher.processes import free_port
    port = free_port()
    node = lambda i: subprocess.Popen(
        [DTNB, 'launch', '-n', '1', '--nnodes=2', f'--node-rank={i}', '--rdzv-backend=c10d',
         f'--rdzv-endpoint=127.0.0.1:{port}',
         '--rdzv-id=twonode', '--local-addr=127.0.0.1', 'examples/train.py', '--steps', '3'],
        cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs = [node(0), node(1)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    results = [json.loads(l) for o, _ in outs for l in o.splitlines() if l.startswith('{')]
    assert len(results) == 1 and results[0]['world_size'] == 2 and results[0]['steps'] == 3


@pytest.mark.long  # torchrun restarts (elastic ones: the cluster tests): bash run.sh test-long
def test_plain_torchrun_restarts_on_gloo_are_warned_about():
    "torchrun --max-restarts on gloo: init_distributed warns (rank 0) unless each restart gets a store of its own"
    from dtnb.launcher.processes import free_port
    env = {k: v for k, v in ENV.items() if k != 'TORCH_DISABLE_SHARE_RDZV_TCP_STORE'}
    run = lambda **extra: subprocess.Popen(
        [PY, '-m', 'torch.distributed.run', '--nproc-per-node=1', '--max-restarts=1', '--rdzv-backend=c10d',
         f'--rdzv-endpoint=127.0.0.1:{free_port()}', 'examples/train.py', '--steps', '1'],
        cwd=ROOT, env={**env, **extra}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    shared, own = run(), run(TORCH_DISABLE_SHARE_RDZV_TCP_STORE='1')
    (_, err_shared), (_, err_own) = shared.communicate(timeout=180), own.communicate(timeout=180)
    assert (shared.returncode, own.returncode) == (0, 0), (err_shared[-2000:], err_own[-2000:])
    said = "torchrun --max-restarts=1 on gloo with the agent's shared store: restarted ranks reuse its port"
    assert said in err_shared and "Set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in err_shared, err_shared[-2000:]
    assert said not in err_own, err_own[-2000:]


def test_cli_launch_bad_input_is_fast():
    t = time.monotonic()
    subprocess.run([sys.executable, '-c', 'import torch'], check=True)   # what any torch command costs here, now
    torch_s, t = time.monotonic() - t, time.monotonic()
    r = subprocess.run([DTNB, 'launch', '-n', '0', 'examples/train.py'], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "nprocs=0: launch needs a whole number of ranks >= 1" in r.stderr
    r = subprocess.run([DTNB, 'launch', '-n', '2', 'missing.py'], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "script 'missing.py' not found" in r.stderr
    assert time.monotonic() - t < 2 * (3 * torch_s + 5), torch_s   # two commands: no rank started, nothing waited for


def test_version():
    import dtnb
    for cmd in ([PY, '-m', 'dtnb', '--version'], [DTNB, '--version']):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert (r.returncode, r.stdout.strip()) == (0, f"dtnb {dtnb.__version__}"), r


WARM = """
import sys, json
from dtnb.launcher.processes import launch
from dtnb.launcher.starts import choose_start_method
before = 'torch._dynamo' in sys.modules
def has_dynamo(): return 'torch._dynamo' in sys.modules
print(json.dumps([choose_start_method(None, 1), before, launch(has_dynamo, nprocs=2)]))
"""

def test_forked_ranks_inherit_torch_dynamo_imported_once():
    "Each rank's first optimizer, DDP or FSDP imports torch._dynamo (1-2 s of CPU): launch imports it before forking"
    r = subprocess.run([PY, '-c', WARM], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    method, before, ranks = json.loads(r.stdout.strip().splitlines()[-1])
    if method != 'fork': pytest.skip(f"launch spawns its ranks here ({method}): they import everything anew")
    assert (before, ranks) == (False, [True, True])


def test_launch_in_process_leaves_nothing():
    from dtnb.launcher.processes import launch, LaunchError
    import torch.distributed as dist, torch
    def f(): return dist.get_world_size()
    assert launch(f, nprocs=3) == [3, 3, 3]
    with pytest.raises(LaunchError, match=r"did not finish within timeout=2s"):
        launch(time.sleep, 30, nprocs=2, timeout=2)
    left = ranks_left(); assert left == [], [(c.pid, c.ppid(), c.cmdline()[:4]) for c in left]


# --- More ranks than accelerators (issue 15, defect 2) ----------------------------------------------------------------
# torch stays the real CPU build and the process groups are real gloo groups; only torch.accelerator's answers (which
# accelerator torch was built for, how many devices it counts) are a stand-in, for a node with `n` CUDA GPUs.
import torch
from dtnb.launcher.processes import launch, init_distributed, shutdown, free_port
from dtnb.core.dist import current_device
from dtnb.core.utils import placement


@pytest.fixture
def gpus(monkeypatch):
    def node(n):
        monkeypatch.delenv('DTNB_DEVICE', raising=False)  # these tests are about the accelerators: no CPU pin
        for name, answer in gpu_standin.answers(n).items(): monkeypatch.setattr(torch.accelerator, name, answer)
    return node


def _where(): return str(current_device())


def test_more_ranks_than_gpus_fails_before_any_rank_starts(gpus):
    gpus(1)
    with pytest.raises(ValueError, match=r"2 ranks on this node but 1 cuda device\b") as e: launch(_where, nprocs=2)
    assert "nprocs=1" in str(e.value) and "backend='gloo', device='cpu'" in str(e.value)
    left = ranks_left(); assert left == [], [(c.pid, c.ppid(), c.cmdline()[:4]) for c in left]


def test_gloo_with_more_ranks_than_gpus_runs_cpu_ranks(gpus):
    gpus(1)
    assert launch(_where, nprocs=2, backend='gloo') == ['cpu', 'cpu']


def test_device_cpu_runs_cpu_ranks_beside_gpus(gpus):
    gpus(2)
    assert launch(_where, nprocs=2, device='cpu') == ['cpu', 'cpu']
    with pytest.raises(ValueError, match=r"CPU ranks \(device='cpu'\) need backend='gloo', not 'nccl'"):
        launch(_where, nprocs=2, device='cpu', backend='nccl')


def test_placement_cpu_pins_every_launch_beside_a_gpu(gpus):
    "Under placement('cpu') (DTNB_DEVICE=cpu) a plain launch starts CPU ranks on gloo where it would need 2 GPUs"
    gpus(1)
    with placement('cpu'):
        assert launch(_where, nprocs=2) == ['cpu', 'cpu']
        with pytest.raises(ValueError, match=r"CPU ranks \(DTNB_DEVICE=cpu\) need backend='gloo'"):
            launch(_where, nprocs=2, backend='nccl')
    with pytest.raises(ValueError, match="2 ranks on this node but 1 cuda device"): launch(_where, nprocs=2)  # put back


@pytest.mark.skipif(gpu_standin.REAL, reason="a real GPU is here: fit's placement on cuda:0 succeeds")
def test_fit_places_an_unwrapped_model_where_batches_go(gpus):
    "On a one-GPU node fit moves model and batches to cuda:0 (so on torch's CPU build it fails there); pinned, the CPU"
    from dtnb.train.loop import fit
    from dtnb.core.models import ToyModel, toy_data
    gpus(1)
    model, data = ToyModel(), [toy_data(8)[:]]
    with pytest.raises((AssertionError, RuntimeError), match="CUDA|NVIDIA"):
        fit(model, data, torch.optim.SGD(model.parameters(), lr=0.1), max_steps=1, progress=False)
    with placement('cpu'):
        res = fit(model, data, torch.optim.SGD(model.parameters(), lr=0.1), max_steps=1, progress=False)
    assert len(res.losses) == 1 and next(model.parameters()).device.type == 'cpu'


def test_torchrun_with_more_local_ranks_than_gpus(gpus, monkeypatch):
    "Under torchrun the same rule holds in each rank: init_distributed names the counts before joining any group"
    gpus(2)
    for k, v in dict(TORCHELASTIC_RUN_ID='t', RANK='1', WORLD_SIZE='4', LOCAL_RANK='1', LOCAL_WORLD_SIZE='4',
                     GROUP_RANK='0', MASTER_ADDR='127.0.0.1', MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match="4 ranks on this node but 2 cuda devices"):
        init_distributed('gloo', timeout=5)
    assert not torch.distributed.is_initialized()
    monkeypatch.setenv('DTNB_DEVICE', 'cpu')
    assert current_device() == torch.device('cpu')
    with pytest.raises(ValueError, match="backend='nccl' needs GPUs, and DTNB_DEVICE=cpu places this rank on the CPU"):
        init_distributed('nccl', timeout=5)
    monkeypatch.delenv('DTNB_DEVICE')
    monkeypatch.setenv('LOCAL_WORLD_SIZE', '2'); monkeypatch.setenv('WORLD_SIZE', '2')
    assert current_device() == torch.device('cuda', 1)
