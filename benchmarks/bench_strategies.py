"""Each `wrap` strategy beside the same torch calls written by hand, side by side on 2 ranks. Prints figures only.

Target (issue 13): steps/s through dtnb at least 0.98 × the hand-written torch calls, for every strategy.
Each round is one launch in which every rank builds each setup twice, through dtnb and by hand, and trains the two
step by step in turn (a barrier before each timed step), so that load from other processes falls on both alike;
the ratio of each round is taken, and the median over rounds is printed.
    python benchmarks/bench_strategies.py [--steps 30] [--rounds 3]
"""
import argparse, statistics, time
import torch
import torch.nn.functional as F
import torch.distributed as dist
import torch.distributed.fsdp  # once in the parent: forked ranks inherit it
from dtnb.launcher.processes import launch
from dtnb.parallel.ddp import make_optimizer
from dtnb.parallel.wrap import wrap
from dtnb.core.models import ToyModel, toy_data

SIZE = dict(d=256, hidden=1024, depth=8)   # 4.3 M parameters, 16 MiB in fp32
SETUPS = {  # name: (strategy, wrap options)
    'ddp': ('ddp', {}), 'zero1': ('zero1', {}), 'zero2': ('zero2', {}), 'zero3': ('zero3', {}),
    'ddp + activation checkpointing': ('ddp', dict(activation_checkpointing=True)),
    'zero3 + activation checkpointing': ('zero3', dict(activation_checkpointing=True)),
    'zero3 + offload': ('zero3', dict(offload=True)),
}


def by_hand(model, strategy, activation_checkpointing=False, offload=False):
    "The same strategy with torch's calls written out: model and optimizer"
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.distributed.fsdp import fully_shard, CPUOffloadPolicy, OffloadPolicy
    from torch.distributed._composable import checkpoint as ckpt
    if activation_checkpointing:
        for block in model.layers: ckpt(block)
    if strategy in ('ddp', 'zero1'):
        model = DDP(model, gradient_as_bucket_view=strategy == 'zero1')
        if strategy == 'zero1':
            return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    kw = dict(reshard_after_forward=strategy == 'zero3',
              offload_policy=CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy())
    for block in model.layers: fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def through_dtnb(model, strategy, **options):
    model = wrap(model, strategy, **options)
    return model, make_optimizer(model, torch.optim.AdamW, lr=1e-3)


def paired_steps(pair, steps, warmup=5):
    "Steps of the two (model, optimizer) pairs interleaved one by one (which goes first alternates); steps/s of each"
    x, y = toy_data(32 * (steps + warmup))[:]
    x, y = x.view(steps + warmup, 32, -1), y.view(steps + warmup, 32, -1)
    spent = [0.0, 0.0]
    for i in range(steps + warmup):
        for j in ((0, 1) if i % 2 else (1, 0)):
            model, o = pair[j]
            dist.barrier(); t = time.perf_counter()
            o.zero_grad(); F.mse_loss(model(x[i]), y[i]).backward(); o.step()
            if i >= warmup: spent[j] += time.perf_counter() - t
    return [steps / s for s in spent]


def one_round(steps):
    "On each rank: {setup: (dtnb steps/s, hand-written steps/s)}, their steps interleaved one by one"
    out = {}
    for name, (strategy, options) in SETUPS.items():
        pair = []
        for how in ('dtnb', 'hand'):
            torch.manual_seed(0)
            m = ToyModel(**SIZE)
            pair.append(through_dtnb(m, strategy, **options) if how == 'dtnb' else by_hand(m, strategy, **options))
        out[name] = tuple(paired_steps(pair, steps))
        del pair
    return out


def main():
    ap = argparse.ArgumentParser(); ap.add_argument('--steps', type=int, default=30)
    ap.add_argument('--rounds', type=int, default=3)
    a = ap.parse_args()
    n = sum(p.numel() for p in ToyModel(**SIZE).parameters())
    print(f"ToyModel({SIZE}): {n / 1e6:.1f} M parameters; AdamW; 2 gloo ranks, 1 torch thread each; "
          f"torch {torch.__version__}")
    print(f"{a.steps} steps of batch 32 per rank after 5 warm-up, dtnb's and hand-written steps interleaved; "
          f"median of {a.rounds} rounds\n")
    ratios, speeds = {k: [] for k in SETUPS}, {k: ([], []) for k in SETUPS}
    for i in range(a.rounds):
        res = launch(one_round, a.steps, nprocs=2, threads=1, timeout=600)[0]
        for k, (d, h) in res.items():
            ratios[k].append(d / h); speeds[k][0].append(d); speeds[k][1].append(h)
    print(f"  {'strategy':<24} {'dtnb steps/s':>13} {'torch by hand':>14} {'ratio':>7}   (target >= 0.98)")
    for k in SETUPS:
        d, h, r = statistics.median(speeds[k][0]), statistics.median(speeds[k][1]), statistics.median(ratios[k])
        print(f"  {k:<24} {d:13.1f} {h:14.1f} {r:7.3f}   {'ok' if r >= 0.98 else 'BELOW TARGET'}"
              f"   (rounds: {', '.join(f'{x:.2f}' for x in ratios[k])})")


if __name__ == '__main__': main()
