"""The layout planner's step time model (`step_parts`) beside measured steps here. Prints figures; not a test.

The model's inputs are measured here first: a device's achieved FLOP/s (one rank's step of the model in one process,
divided into 6 x parameters x tokens) and the gloo all-reduce bus bandwidth between the ranks (a gradient-sized
tensor). With that `Node`, each layout's predicted seconds per step are printed beside the measured median of real
steps of `parallelize(TinyTransformer, degrees)` on 2 CPU ranks (one thread each), the micro-batch per rank as the
model counts it (`shape.batch` sequences per device, so a tp or pp group runs `batch x tp x pp` sequences).
The compute part is calibrated on the one-process step, so the ratio measured/predicted shows what the model misses
in each dimension's communication and overheads (latency of small collectives, DTensor dispatch, contention when the
ranks share cores). Seen in two runs on a 2-core machine shared with other jobs, torch 2.13 CPU, the defaults: one
process 222-246 ms a step (41-46 GFLOP/s), all-reduce busbw 0.55-0.65 GB/s; measured/predicted dp_replicate 2:
1.40-1.41, dp_shard 2: 1.69-1.72, tp 2: 1.53-2.42, pp 2: 0.84-1.01. The model leaves out per-collective latency
and FSDP's/DTensor's CPU overheads, which dominate at this size; it is meant for GPU-sized layers.
The "+latency" columns add `Node.latency`, the median 4-byte gloo all-reduce measured here, times `step_collectives`:
in one run here (2 cores under a load average of 8-10 from other jobs) it was 0.27 ms, which moved the ratios only
from 2.44/4.11/4.74/2.04 to 2.43/4.04/4.65/2.02: the per-collective cost these CPU layouts pay is not a tiny
message's latency but the CPU work around each collective (FSDP's copies, DTensor dispatch, ranks sharing cores).
    python benchmarks/bench_step_model.py [--hidden 256] [--layers 4] [--seq 128] [--batch 4] [--steps 8]
"""
import argparse, dataclasses, statistics, time, warnings
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.distributed.fsdp, torch.distributed.tensor.parallel, torch.distributed.pipelining  # once, before forking
from dtnb.launcher.processes import launch
from dtnb.core.models import TinyTransformer
from dtnb.parallel.tensor import Degrees, parallelize
from dtnb.plan.memory import TransformerShape
from dtnb.plan.recommend import Node, step_parts


def model(a): return TinyTransformer(d_in=a.hidden, d=a.hidden, n_heads=a.heads, depth=a.layers, d_out=a.hidden)


def steps(a, degrees=None):
    "Median seconds of a training step (after 2 warm-up steps), on this rank or in this process"
    torch.set_num_threads(1); warnings.filterwarnings('ignore')
    m, d = model(a), degrees and Degrees(**degrees)
    if d: m = parallelize(m, d, F.mse_loss)
    n = a.batch * ((d.tp * d.pp) if d else 1)  # sequences this rank's data-parallel group runs
    x, y = torch.randn(n, a.seq, a.hidden), torch.randn(n, a.seq, a.hidden)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    ts = []
    for i in range(a.steps + 2):
        t = time.perf_counter()
        if d and d.pp_enabled: m.step(x, y)
        else: F.mse_loss(m(x), y).backward()
        opt.step(); opt.zero_grad()
        if d: dist.barrier()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts[2:])


def allreduce_busbw(nbytes, reps=5):
    torch.set_num_threads(1)
    t = torch.zeros(nbytes // 4)
    dist.all_reduce(t); dist.barrier()
    s = time.perf_counter()
    for _ in range(reps): dist.all_reduce(t)
    sec = (time.perf_counter() - s) / reps
    n = dist.get_world_size()
    return 2 * (n - 1) / n * nbytes / sec


def allreduce_latency(reps=50):
    "Median seconds of a 4-byte all-reduce: the fixed cost of one collective here"
    torch.set_num_threads(1)
    t, ts = torch.zeros(1), []
    dist.all_reduce(t); dist.barrier()
    for _ in range(reps):
        s = time.perf_counter(); dist.all_reduce(t); ts.append(time.perf_counter() - s)
    return statistics.median(ts)


def main():
    p = argparse.ArgumentParser()
    for k, v in dict(hidden=256, heads=4, layers=4, seq=128, batch=4, steps=8).items():
        p.add_argument(f'--{k}', type=int, default=v)
    a = p.parse_args()
    shape = TransformerShape(layers=a.layers, hidden=a.hidden, heads=a.heads, seq_len=a.seq, batch=a.batch)
    params = sum(q.numel() for q in model(a).parameters())
    one = steps(a)
    flops = 6 * params * a.seq * a.batch / one
    bw = launch(allreduce_busbw, params * 4, nprocs=2, threads=1)[0]
    lat = max(launch(allreduce_latency, nprocs=2, threads=1))
    node = Node(devices=2, flops=flops, intra=bw, inter=bw)
    timed = dataclasses.replace(node, latency=lat)
    print(f"{params:,} parameters (the shape counts {shape.params():,}); one process, 1 thread: {one * 1e3:.1f} ms "
          f"a step = {flops / 1e9:.1f} GFLOP/s achieved; gloo all-reduce busbw {bw / 1e9:.2f} GB/s on 2 ranks, "
          f"a 4-byte all-reduce {lat * 1e3:.2f} ms (the latency)")
    print(f"{'layout':28} {'predicted ms':>12} {'+latency':>9} {'measured ms':>12} {'ratio':>6} {'+latency':>8}   "
          "predicted parts with latency (ms)")
    for d in (Degrees(dp_replicate=2), Degrees(dp_shard=2), Degrees(tp=2), Degrees(pp=2)):
        pred, parts = sum(step_parts(shape, d, 'fp32', node).values()), step_parts(shape, d, 'fp32', timed)
        pred_l = sum(parts.values())
        meas = max(launch(steps, a, dataclasses.asdict(d), nprocs=2, threads=1))
        detail = ', '.join(f"{k} {v * 1e3:.1f}" for k, v in parts.items() if v)
        name = ' × '.join(f"{k} {getattr(d, k)}" for k in d.enabled)
        print(f"{name:28} {pred * 1e3:12.1f} {pred_l * 1e3:9.1f} {meas * 1e3:12.1f} {meas / pred:6.2f} "
              f"{meas / pred_l:8.2f}   {detail}")


if __name__ == '__main__': main()
