"""Pipeline schedules on real ranks: measured step time and bubble beside the bubble each schedule should have.
Prints figures; not a test.

For each schedule and microbatch count, on `--ranks` pipeline ranks: the median step time of `--steps` timed steps,
the bubble measured by `Pipeline.profile_step` (idle fraction of rank-time, median over the profiled steps), the
bubble simulated on an ideal machine from the same action order, and the formula (p−1)/(v·m+p−1) where it applies.
A one-process step on the same model and batch (one thread, as each rank gets) is timed just before each row, so
each speed-up compares runs made under the same load.
    python benchmarks/bench_pipeline.py [--ranks 2] [--d 512] [--depth 8] [--batch 128] [--steps 5]

Then a model that is not a chain (Hugging Face GPT-2, random init, untied; needs `transformers`): `apply_pipeline`
traces it with torch's front end; beside it, the same torch calls written by hand (`pipeline(..., split_spec=...)`,
`Pipe.build_stage`, `ScheduleGPipe`). Both pipelines live in the same ranks and alternate step by step, so they run
under the same load; the ratio is hand-written step time over dtnb's (1.0: as fast; target >= 0.98).
    python benchmarks/bench_pipeline.py --only-traced [--gpt2-layers 4] [--gpt2-d 128] [--gpt2-batch 16] [--seq 64] [--steps 20]
"""
import argparse, statistics, time
import torch
from torch import nn
import torch.distributed.pipelining  # once, before the ranks fork
from dtnb.launcher.processes import launch
from dtnb.core.models import ToyModel, toy_data
from dtnb.parallel.pipeline_schedules import simulate_schedule, bubble_fraction, schedule_name, SCHEDULES
from dtnb.parallel.pipeline import apply_pipeline, causal_lm_loss

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

def gpt2(a):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=a.gpt2_layers, n_embd=a.gpt2_d, n_head=4, vocab_size=512,
                                      n_positions=a.seq, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, use_cache=False,
                                      tie_word_embeddings=False))

def traced_vs_hand(a, m=4):
    "dtnb's traced GPipe and torch's calls written by hand, alternating steps: median step times (s) and losses"
    import torch.distributed as dist
    from torch.distributed.pipelining import pipeline, SplitPoint, ScheduleGPipe
    ids = torch.randint(0, 512, (a.gpt2_batch, a.seq), generator=torch.Generator().manual_seed(1))
    mb = ids[:a.gpt2_batch // m]
    ours = apply_pipeline(gpt2(a), causal_lm_loss, schedule='gpipe', n_microbatches=m, example=mb)
    point = ours.split.stage_units(1)[0]  # dtnb's balanced cut, given to the hand-written pipeline too
    with torch.no_grad(): pipe = pipeline(gpt2(a), (mb,), split_spec={point: SplitPoint.BEGINNING})
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    stage = pipe.build_stage(rank, torch.device('cpu'))
    logits = lambda out: out[0] if isinstance(out, tuple) else out  # what the traced last stage returns
    hand = ScheduleGPipe(stage, n_microbatches=m, loss_fn=lambda out, y: causal_lm_loss(logits(out), y))
    opts = [torch.optim.AdamW(ours.parameters(), lr=1e-4), torch.optim.AdamW(stage.submod.parameters(), lr=1e-4)]
    def step_ours(): return ours.step(ids, ids).item()
    def step_hand():
        losses = []
        if rank == 0: hand.step(ids)
        elif rank == last: hand.step(target=ids, losses=losses)
        else: hand.step()
        return torch.stack(losses).mean().item() if losses else None
    times, cpu, losses = ([], []), ([], []), ([], [])
    for i in range(a.steps + 1):
        for k in ((0, 1) if i % 2 else (1, 0)):
            opts[k].zero_grad(); dist.barrier(); t, c = time.perf_counter(), time.process_time()
            losses[k].append((step_ours, step_hand)[k]()); opts[k].step(); c = time.process_time() - c; dist.barrier()
            if i: times[k].append(time.perf_counter() - t); cpu[k].append(c)
    return [(statistics.median(t), min(t), statistics.median(c)) for t, c in zip(times, cpu)], losses, point

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--ranks', type=int, default=2); ap.add_argument('--d', type=int, default=512)
    ap.add_argument('--depth', type=int, default=8); ap.add_argument('--batch', type=int, default=128)
    ap.add_argument('--steps', type=int, default=5)
    ap.add_argument('--schedules', default='gpipe,1f1b,interleaved1f1b,zbvzerobubble')
    ap.add_argument('--microbatches', default='2,4,8')
    ap.add_argument('--only-traced', action='store_true'); ap.add_argument('--seq', type=int, default=64)
    ap.add_argument('--gpt2-layers', type=int, default=4); ap.add_argument('--gpt2-d', type=int, default=128)
    ap.add_argument('--gpt2-batch', type=int, default=16)
    a = ap.parse_args()
    if not a.only_traced: schedules_table(a)
    traced_table(a)

def traced_table(a):
    try: import transformers  # noqa: F401  (once, before the ranks fork)
    except ImportError: return print("transformers is not installed: no traced GPT-2 comparison")
    (ours, hand), (l_ours, l_hand), point = launch(traced_vs_hand, a, nprocs=2, threads=1)[-1]
    print(f"\nGPT-2 (not a chain: traced), {a.gpt2_layers} layers, d={a.gpt2_d}, batch {a.gpt2_batch} x {a.seq} "
          f"tokens, gpipe, 4 microbatches, 2 ranks cut before {point}; medians of {a.steps} alternating steps")
    print("(wall: median and fastest step; CPU: this rank's process time per step, which other jobs on the machine "
          "do not inflate)")
    print(f"{'per step':<18}{'dtnb apply_pipeline ms':>24}{'torch by hand ms':>18}{'ratio (hand / dtnb)':>22}")
    for i, what in enumerate(('wall, median', 'wall, fastest', 'CPU, median')):
        print(f"{what:<18}{ours[i] * 1e3:>24.1f}{hand[i] * 1e3:>18.1f}{hand[i] / ours[i]:>22.3f}")
    print(f"same losses in both: {max(abs(x - y) for x, y in zip(l_ours, l_hand)) < 1e-5}")

def schedules_table(a):
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
