"""FSDP on 2 ranks, measured side by side: bytes per rank, peak memory while building, step time. Prints figures; not a test.

Targets (issue 4): parameter and optimizer-state bytes per rank within 2% of 1/2 of one process; a model built on the
meta device never held whole by a rank.
    python benchmarks/bench_fsdp.py [--steps 20] [--rounds 3]
"""
import argparse, gc, statistics, time
import torch
import torch.nn.functional as F
import torch.distributed.fsdp  # once in the parent: forked ranks inherit it
from dtnb.launcher.processes import launch
from dtnb.parallel.ddp import distributed_loader
from dtnb.parallel.wrap import wrap
from dtnb.parallel.fsdp import state_bytes
from dtnb.core.models import ToyModel, toy_data

SIZE = dict(d=256, hidden=1024, depth=8)   # 4.3 M parameters, 16 MiB in fp32
BIG = dict(d=256, hidden=2048, depth=16)   # 16.8 M parameters, 64 MiB in fp32


def bytes_after_step(strategy):
    torch.manual_seed(0)
    model = wrap(ToyModel(**SIZE), strategy)
    o = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = toy_data(16)[:]
    F.mse_loss(model(x), y).backward(); o.step()
    return state_bytes(model, o)


def _rss(key): return int(open('/proc/self/status').read().split(key + ':')[1].split()[0]) * 1024


def build_peak(where):
    with torch.device('meta'): wrap(ToyModel(), 'fsdp')  # first-use costs of FSDP are not the model's
    gc.collect()
    with open('/proc/self/clear_refs', 'w') as f: f.write('5')  # reset the peak (VmHWM)
    base = _rss('VmRSS')
    with torch.device(where): m = ToyModel(**BIG)
    m = wrap(m, 'fsdp')
    return _rss('VmHWM') - base


def steps_per_s(strategy, steps, options):
    torch.manual_seed(0)
    model = wrap(ToyModel(**SIZE), strategy, **options)
    o = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dl = distributed_loader(toy_data(64 * (steps + 5)), global_batch_size=64, shuffle=False)
    for i, (x, y) in enumerate(dl):
        if i == 5: t = time.perf_counter()  # 5 warm-up steps
        o.zero_grad(); F.mse_loss(model(x), y).backward(); o.step()
    torch.distributed.barrier()
    return steps / (time.perf_counter() - t)


def main():
    ap = argparse.ArgumentParser(); ap.add_argument('--steps', type=int, default=20); ap.add_argument('--rounds', type=int, default=3)
    a = ap.parse_args()
    n = sum(p.numel() for p in ToyModel(**SIZE).parameters())
    print(f"ToyModel({SIZE}): {n / 1e6:.1f} M parameters; AdamW; torch {torch.__version__}\n")

    one = launch(bytes_after_step, 'single', nprocs=1)[0]
    two = launch(bytes_after_step, 'fsdp', nprocs=2)
    print("Bytes held per rank after one step, 2 ranks FSDP / 1 process (target: 0.50 within 2%)")
    for k in one: print(f"  {k:<11} {one[k] / 2**20:7.2f} MiB in one process   " + '   '.join(f"rank {r}: {t[k] / one[k]:.4f}" for r, t in enumerate(two)))

    full = sum(p.numel() * 4 for p in ToyModel(**BIG).parameters())
    print(f"\nPeak resident memory added while building and wrapping a {full / 2**20:.0f} MiB model, per rank (2 ranks)")
    for where in ('cpu', 'meta'):
        peaks = launch(build_peak, where, nprocs=2)
        print(f"  built on {where:<5} " + '   '.join(f"rank {r}: {p / 2**20:6.1f} MiB = {p / full:.2f} of the model" for r, p in enumerate(peaks)))

    variants = [('1 process', 'single', {}, 1), ('DDP, 2 ranks', 'ddp', {}, 2), ('FSDP (ZeRO-3), 2 ranks', 'fsdp', {}, 2),
                ('FSDP reshard_after_forward=False, 2 ranks', 'fsdp', dict(reshard_after_forward=False), 2),
                ('HSDP mesh=(2, 1), 2 ranks', 'fsdp', dict(mesh=(2, 1)), 2)]
    print(f"\nTraining throughput, global batch 64, {a.steps} steps after 5 warm-up; median of {a.rounds} interleaved rounds "
          "(1 torch thread per rank; 2 cores)")
    runs = {name: [] for name, *_ in variants}
    for _ in range(a.rounds):
        for name, strategy, options, nprocs in variants:
            runs[name].append(min(launch(steps_per_s, strategy, a.steps, options, nprocs=nprocs, threads=1)))
    base = statistics.median(runs['DDP, 2 ranks'])
    for name, r in runs.items(): print(f"  {name:<44} {statistics.median(r):7.1f} steps/s   ({statistics.median(r) / base:.2f} × DDP)")


if __name__ == '__main__': main()
