"""`fit` beside a plain hand-written loop: one process, DDP on 2 ranks, FSDP on 2 ranks. Prints figures; not a test.

Target (issue 27): steps/s through `fit` at least 0.97 x the plain loop for each setting.
Both drive the same wrapped model, optimizer and `distributed_loader` (a 4-block MLP, 64 -> 256 -> 8, batch 32 per
rank, AdamW, one torch thread per rank). Each round runs `fit(..., max_steps=steps, progress=False)` and the plain
loop once each, in alternating order (a barrier before and after each), so that load from other processes falls on
both alike; the ratio of each round is taken and the median over rounds printed: of wall time (the target), and of
this process's CPU time (rank 0's), which load from other processes disturbs less on a shared machine.
With malloc as glibc sets it, a round's ratio ranges from 0.89 to 1.06 (page faults differ from round to round), so a
median of 15 rounds moved by up to 0.05 between runs; 25 rounds narrow that. What `fit` itself adds per step is
measured in 05f (nbs/05f_train.loop.ipynb, beside these figures), on a model of almost no work.

glibc's malloc gives freed memory back to the kernel and faults it in again: 2,000 to 5,000 page faults per step of
this model, 20% of its CPU step, and a count that differs from process to process and from one loop to the other
(with them, the ratio of one process swung from 0.89 to 1.04 between runs). Each process therefore keeps its freed
memory (mallopt: no trimming, no mmap for large blocks: what MALLOC_TRIM_THRESHOLD_ and MALLOC_MMAP_THRESHOLD_, or
jemalloc, do), for both loops alike; --glibc-defaults measures with malloc as it comes. Faults per step are printed.
    python benchmarks/bench_fit.py [--steps 30] [--rounds 25] [--only single,ddp,fsdp] [--glibc-defaults]
"""
import argparse, ctypes, ctypes.util, resource, statistics, time
import torch
import torch.nn.functional as F
import torch.distributed.fsdp  # once in the parent: forked ranks inherit it
from dtnb.launcher.processes import launch
from dtnb.parallel.ddp import distributed_loader
from dtnb.parallel.wrap import wrap
from dtnb.core.models import ToyModel, toy_data
from dtnb.core.dist import barrier, world_size, current_device
from dtnb.train.loop import fit


def plain_loop(model, loader, opt, steps, device):
    "What a user writes by hand: forward, loss, backward, step, zero; the loss kept on the device"
    losses = []
    for i, (x, y) in enumerate(loader):
        if i == steps: break
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step(); opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses


def keep_freed_memory():
    "glibc: freed memory stays in the process (no trimming, no mmap per large block), so no page faults per step"
    libc = ctypes.CDLL(ctypes.util.find_library('c'))
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    assert libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1) and libc.mallopt(M_MMAP_THRESHOLD, 2**30), "mallopt failed"


def rounds(strategy, steps, n_rounds, warmup=20, glibc_defaults=False):
    "Steps/s, CPU steps/s and page faults per step of fit and of the plain loop in `n_rounds` interleaved rounds"
    if not glibc_defaults: keep_freed_memory()
    torch.manual_seed(0)
    model = wrap(ToyModel(d_in=64, d=256, depth=4, d_out=8), strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = distributed_loader(toy_data(32 * world_size() * steps, d_in=64, d_out=8), batch_size=32, shuffle=False)
    device = current_device()
    run = dict(fit=lambda n: fit(model, loader, opt, max_steps=n, progress=False),
               plain=lambda n: plain_loop(model, loader, opt, n, device))
    for f in run.values(): f(warmup)
    out = []
    for r in range(n_rounds):
        t, c, pf = {}, {}, {}
        for name in (('fit', 'plain') if r % 2 else ('plain', 'fit')):
            barrier(); t0, c0 = time.perf_counter(), time.process_time()
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            run[name](steps)
            c[name] = steps / (time.process_time() - c0)  # CPU time of this process: less hit by other load
            pf[name] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / steps
            barrier(); t[name] = steps / (time.perf_counter() - t0)
        out.append((t['fit'], t['plain'], c['fit'], c['plain'], pf['fit'], pf['plain']))
    return out


def _ranked(strategy, steps, n_rounds, glibc_defaults):
    import gc
    r = rounds(strategy, steps, n_rounds, glibc_defaults=glibc_defaults)
    gc.collect(); barrier()  # drop the model before the group ends (gloo's exit abort)
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--steps', type=int, default=30); ap.add_argument('--rounds', type=int, default=25)
    ap.add_argument('--only', default='single,ddp,fsdp'); ap.add_argument('--glibc-defaults', action='store_true')
    a = ap.parse_args()
    rows = []
    for setting in a.only.split(','):
        if setting == 'single':
            n = torch.get_num_threads(); torch.set_num_threads(1)
            try: res = rounds('single', a.steps, a.rounds, glibc_defaults=a.glibc_defaults)
            finally: torch.set_num_threads(n)
        else: res = launch(_ranked, setting, a.steps, a.rounds, a.glibc_defaults, nprocs=2, threads=1)[0]
        ratio, cpu = statistics.median(r[0] / r[1] for r in res), statistics.median(r[2] / r[3] for r in res)
        fit_s, plain_s = statistics.median(r[0] for r in res), statistics.median(r[1] for r in res)
        faults = statistics.median(r[4] for r in res), statistics.median(r[5] for r in res)
        rows.append((setting, fit_s, plain_s, ratio, 1e3 * (1 / fit_s - 1 / plain_s), cpu, faults,
                     ' '.join(f"{r[0] / r[1]:.3f}" for r in res)))
    print(f"fit vs a plain loop: ToyModel 64->256->8, 4 blocks, batch 32 per rank, AdamW, {a.steps} steps, "
          f"median of {a.rounds} interleaved rounds, one thread per rank; "
          f"malloc {'as glibc sets it' if a.glibc_defaults else 'keeping freed memory (see the docstring)'}")
    print(f"{'setting':8} {'fit steps/s':>12} {'plain steps/s':>14} {'ratio':>6} {'ms/step':>8} {'CPU ratio':>9} "
          f"{'faults/step fit, plain':>23}  ratio of each round")
    for s, f, p, r, ms, cpu, (ff, fp), each in rows:
        print(f"{s:8} {f:12.1f} {p:14.1f} {r:6.3f} {ms:+8.2f} {cpu:9.3f} {ff:11.0f} {fp:11.0f}  {each}")


if __name__ == '__main__':
    main()
