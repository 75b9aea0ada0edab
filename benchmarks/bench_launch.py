"""Launch latency and DDP training speed, side by side in one run. Prints figures; not a test.

Targets (issue 3): dtnb's fork launch ≤ 0.5× accelerate's notebook_launcher (when installed);
DDP steps/s through dtnb (wrap + distributed_loader + fit) ≥ 0.98× hand-written torch DDP on the same model and data.
    python benchmarks/bench_launch.py [--repeats 10] [--steps 300]

Start methods (issue 38): a fresh interpreter per method that ran `torch.export` and a backward first (on PyPI's CUDA
build that makes fork unsafe: `launch` then starts ranks from its fork server), timing the first launch of 2 ranks
and the median of the later ones. Target: later launches under a second on the CUDA build too.
    python benchmarks/bench_launch.py --start-methods [--repeats 5]     # with each torch build's python
"""
import argparse, statistics, time
import torch, torch.distributed as dist
import torch.multiprocessing as tmp
from dtnb.launcher.processes import launch, usable_cores


def trivial(*_):
    t = torch.ones(1); dist.all_reduce(t); return t.item()


def _floor_rank(i, store_path):  # start_processes floor: fork + FileStore + one all_reduce, nothing else
    torch.set_num_threads(1)
    dist.init_process_group('gloo', store=dist.FileStore(store_path, 2), rank=i, world_size=2)
    t = torch.ones(1); dist.all_reduce(t); dist.barrier()
    import os; os._exit(0)


def median_ms(f, repeats):
    f()  # warm
    ts = []
    for _ in range(repeats):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return 1000 * statistics.median(ts)


def floor():
    import tempfile, os
    d = tempfile.mkdtemp()
    tmp.start_processes(_floor_rank, args=(os.path.join(d, 's'),), nprocs=2, start_method='fork')


def trivial_env():  # under accelerate's launcher the ranks form the group themselves from its env:// variables
    if not dist.is_initialized(): dist.init_process_group('gloo')
    t = torch.ones(1); dist.all_reduce(t); dist.destroy_process_group(); return t.item()


def accelerate_launch():
    from accelerate import notebook_launcher
    notebook_launcher(trivial_env, num_processes=2)


# ---------------------------------------------------------------- DDP throughput
def hand_ddp(steps, batch):
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler
    from dtnb.core.models import ToyModel, toy_data
    torch.manual_seed(0)
    model = DDP(ToyModel(d=64, depth=4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ds = toy_data(steps * batch)
    dl = DataLoader(ds, batch_size=batch // dist.get_world_size(), sampler=DistributedSampler(ds, shuffle=False))
    t = time.perf_counter()
    for x, y in dl:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
    return time.perf_counter() - t


def dtnb_ddp(steps, batch):
    from dtnb.parallel.ddp import distributed_loader
    from dtnb.parallel.wrap import wrap
    from dtnb.train.loop import fit
    from dtnb.core.models import ToyModel, toy_data
    torch.manual_seed(0)
    model = wrap(ToyModel(d=64, depth=4), 'ddp')
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    dl = distributed_loader(toy_data(steps * batch), global_batch_size=batch, shuffle=False)
    return fit(model, dl, opt, progress=False).seconds


ONE = """
import json, sys, time, warnings, torch
from dtnb.launcher.processes import launch
import torch.distributed as dist
def trivial():
    t = torch.ones(1); dist.all_reduce(t); return t.item()
if __name__ == '__main__':
    method, repeats = (None if sys.argv[1] == 'default' else sys.argv[1]), int(sys.argv[2])
    torch.export.export(torch.nn.Linear(2, 2), (torch.zeros(1, 2),))
    torch.nn.Linear(2, 2)(torch.zeros(1, 2)).sum().backward()   # autograd's device threads, on the CUDA build
    ts, said = [], []
    try:
        for _ in range(repeats + 1):
            t = time.perf_counter()
            with warnings.catch_warnings(record=True) as ws:
                warnings.simplefilter('always'); assert launch(trivial, nprocs=2, device='cpu', start_method=method) == [2.0, 2.0]
            ts.append(time.perf_counter() - t); said += [str(w.message) for w in ws if 'starts the ranks' in str(w.message)]
        out = dict(first=ts[0], later=sorted(ts[1:])[len(ts[1:]) // 2], said=said[:1])
    except Exception as e: out = dict(error=str(e).splitlines()[0])
    print(json.dumps(out))
"""


def start_methods(repeats):
    "Each start method in a fresh interpreter after an export and a backward: first launch, median of the later ones"
    import json, subprocess, sys
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}), python {sys.version.split()[0]}, "
          f"{usable_cores()} usable cores; 2 CPU ranks, after torch.export + backward in the parent; "
          f"median of {repeats} later launches")
    for method in ('fork', 'spawn', 'forkserver', 'default'):
        r = subprocess.run([sys.executable, '-c', ONE, method, str(repeats)], capture_output=True, text=True, timeout=600)
        try: out = json.loads(r.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError): out = dict(error=(r.stderr.strip().splitlines() or ['no output'])[-1])
        if 'error' in out: print(f"  {method:<11} refused or failed: {out['error'][:150]}"); continue
        why = f"   ({out['said'][0][:70]}...)" if out['said'] else ''
        print(f"  {method:<11} first {1000 * out['first']:8.0f} ms   later {1000 * out['later']:8.0f} ms{why}")
    try: out = in_kernel(repeats)
    except ImportError as e: return print(f"  in a kernel: {e}")
    print(f"  {'default, in a Jupyter kernel':<11} first {1000 * out['first']:8.0f} ms   later {1000 * out['later']:8.0f} ms"
          f"   ({out['method']})")


def in_kernel(repeats):
    "The default start method in a real Jupyter kernel after an export and a backward: first launch, later ones"
    import json
    from jupyter_client.manager import start_new_kernel
    km, kc = start_new_kernel(kernel_name='python3')
    try:
        code = ONE.split("if __name__ == '__main__':")[0] + f"""
from dtnb.launcher.starts import choose_start_method
torch.export.export(torch.nn.Linear(2, 2), (torch.zeros(1, 2),))
torch.nn.Linear(2, 2)(torch.zeros(1, 2)).sum().backward()
warnings.simplefilter('ignore')
ts = []
for _ in range({repeats + 1}):
    t = time.perf_counter(); assert launch(trivial, nprocs=2, device='cpu') == [2.0, 2.0]; ts.append(time.perf_counter() - t)
print('RESULT', json.dumps(dict(first=ts[0], later=sorted(ts[1:])[len(ts[1:]) // 2], method=choose_start_method(None))))
"""
        msg_id, out = kc.execute(code), []
        while True:
            m = kc.get_iopub_msg(timeout=300)
            if m['parent_header'].get('msg_id') != msg_id: continue
            if m['msg_type'] == 'stream': out.append(m['content']['text'])
            if m['msg_type'] == 'error': raise RuntimeError(m['content']['evalue'])
            if m['msg_type'] == 'status' and m['content']['execution_state'] == 'idle': break
        return json.loads(''.join(out).split('RESULT')[1])
    finally:
        kc.stop_channels(); km.shutdown_kernel(now=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--start-methods', action='store_true', help='first and later launches per start method, then stop')
    ap.add_argument('--repeats', type=int, default=10); ap.add_argument('--steps', type=int, default=300)
    ap.add_argument('--rounds', type=int, default=3)
    a = ap.parse_args()
    if a.start_methods: return start_methods(a.repeats)
    print(f"{usable_cores()} usable cores, torch {torch.__version__}; median of {a.repeats} launches of 2 ranks, warm")
    rows = [('torch start_processes(fork) + FileStore (floor)', median_ms(floor, a.repeats)),
            ('dtnb launch, fork', median_ms(lambda: launch(trivial, nprocs=2), a.repeats)),
            ('dtnb launch, spawn', median_ms(lambda: launch(trivial, nprocs=2, start_method='spawn'), max(3, a.repeats // 3)))]
    try: rows.append(('accelerate notebook_launcher (fork)', median_ms(accelerate_launch, a.repeats)))
    except ImportError: rows.append(('accelerate notebook_launcher: not installed', float('nan')))
    for name, ms in rows: print(f"  {name:<50} {ms:8.1f} ms")
    acc = dict(rows).get('accelerate notebook_launcher (fork)')
    if acc: print(f"  dtnb fork / accelerate = {dict(rows)['dtnb launch, fork'] / acc:.2f}   (target <= 0.50)")
    print(f"\nDDP, 2 ranks, {a.steps} steps of global batch 32, ToyModel(d=64, depth=4); {a.rounds} interleaved rounds")
    hand, ours = [], []
    for _ in range(a.rounds):  # interleaved, so machine noise hits both alike
        hand.append(max(launch(hand_ddp, a.steps, 32, nprocs=2))); ours.append(max(launch(dtnb_ddp, a.steps, 32, nprocs=2)))
    h, o = statistics.median(hand), statistics.median(ours)
    print(f"  hand-written torch DDP loop   {a.steps / h:8.1f} steps/s")
    print(f"  dtnb wrap + loader + fit      {a.steps / o:8.1f} steps/s")
    print(f"  ratio dtnb / hand-written     {h / o:8.3f}   (target >= 0.98)")


if __name__ == '__main__':
    main()
