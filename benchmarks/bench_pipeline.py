"""Pipeline schedules on real ranks: measured step time and bubble beside the bubble each schedule should have.
Prints figures; not a test.

For each schedule and microbatch count, on `--ranks` pipeline ranks: the median step time of `--steps` timed steps,
the bubble measured by `Pipeline.profile_step` (idle fraction of rank-time, median over the profiled steps), the
bubble simulated on an ideal machine from the same action order, and the formula (p−1)/(v·m+p−1) where it applies.
A one-process step on the same model and batch (one thread, as each rank gets) is timed just before each row, so
each speed-up compares runs made under the same load.
    python benchmarks/bench_pipeline.py [--ranks 2] [--d 512] [--depth 8] [--batch 128] [--steps 5]
"""
import argparse, statistics, time
import torch
from torch import nn
import torch.distributed.pipelining  # once, before the ranks fork
from dtnb.launcher import launch
from dtnb.models import ToyModel, toy_data
from dtnb.schedules import simulate_schedule, bubble_fraction, schedule_name, SCHEDULES
from dtnb.pipeline import apply_pipeline

def model_data(a):
    return ToyModel(d=a.d, depth=a.depth, seed=0), toy_data(a.batch, d_in=16)[:a.batch]

def one_process(a):
    model, (x, y) = model_data(a)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ts = []
    for i in range(a.steps + 1):
        t = time.perf_counter()
        opt.zero_grad(); nn.functional.mse_loss(model(x), y).backward(); opt.step()
        if i: ts.append(time.perf_counter() - t)
    return statistics.median(ts)

def ranked(a, schedule, m):
    import torch.distributed as dist
    model, (x, y) = model_data(a)
    pipe = apply_pipeline(model, nn.functional.mse_loss, schedule=schedule, n_microbatches=m)
    opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
    steps, bubbles = [], []
    for i in range(a.steps + 1):
        dist.barrier(); t = time.perf_counter()
        opt.zero_grad(); pipe.step(x, y); opt.step()
        dist.barrier()
        if i: steps.append(time.perf_counter() - t)
    for _ in range(3):
        opt.zero_grad(); bubbles.append(pipe.profile_step(x, y).bubble); opt.step()
    return statistics.median(steps), statistics.median(bubbles), pipe.order(), pipe.n_stages

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--ranks', type=int, default=2); ap.add_argument('--d', type=int, default=512)
    ap.add_argument('--depth', type=int, default=8); ap.add_argument('--batch', type=int, default=128)
    ap.add_argument('--steps', type=int, default=5)
    ap.add_argument('--schedules', default='gpipe,1f1b,interleaved1f1b,zbvzerobubble')
    ap.add_argument('--microbatches', default='2,4,8')
    a = ap.parse_args()
    print(f"ToyModel d={a.d} depth={a.depth}, batch {a.batch}: {a.ranks} pipeline ranks (1 thread each) vs one process "
          f"(1 thread) timed just before each row; medians of {a.steps} steps")
    print(f"{'schedule':<16}{'m':>3}{'step ms':>10}{'1 proc ms':>11}{'speed-up':>10}{'measured bubble':>17}{'ideal (simulated)':>19}{'formula':>9}")
    for s in a.schedules.split(','):
        s = schedule_name(s)
        for m in map(int, a.microbatches.split(',')):
            if SCHEDULES[s][1] != 'one' and m < 2 * a.ranks and s != 'interleaved1f1b': continue
            one = launch(one_process, a, nprocs=1, threads=1)[0]
            step, bubble, order, n_stages = launch(ranked, a, s, m, nprocs=a.ranks)[0]
            sim = simulate_schedule(order, s).bubble
            v = n_stages // a.ranks
            formula = f"{bubble_fraction(a.ranks, m, v):.1%}" if s in ('gpipe', '1f1b', 'interleaved1f1b') else '—'
            print(f"{s:<16}{m:>3}{step * 1e3:>10.1f}{one * 1e3:>11.1f}{one / step:>9.2f}×{bubble:>17.1%}{sim:>19.1%}{formula:>9}", flush=True)

if __name__ == '__main__': main()
