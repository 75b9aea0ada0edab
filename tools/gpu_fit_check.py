"""`fit` beside a plain hand-written loop on one GPU, through dtnb's public names: steps/s of each on a model whose GPU
step takes a few milliseconds, in alternating rounds, and the ratio (goal: fit >= 0.97 x the plain loop; printed, not
enforced: a figure to read). Then the host synchronisations per step of each, counted once each outside the timed
rounds: `torch.cuda.set_sync_debug_mode('warn')` makes every synchronising CUDA call (an `.item()`, a copy back to the
host, a `nonzero`) warn, and the warnings are caught and counted. A per-step sync costs nothing on a CPU and stalls a
GPU's queue. Step `fit` of tools/gpu_check.sh.

    python tools/gpu_fit_check.py [--out FILE.json] [--device cpu] [--steps N] [--rounds R]

The plain loop is benchmarks/bench_fit.py's (the CPU version of this figure). `--device cpu` (tools/gpu_check.sh
--dry-run) runs the same rounds on a small model on the CPU; host syncs are not measurable there (nothing to
synchronise with). Exit 1 when a check failed (an error; the ratio never fails it); results go to --out with a
`headline`.
"""
import argparse, json, statistics, sys, time, traceback, warnings
from pathlib import Path
import torch
import dtnb
from dtnb.core.utils import synchronize  # waits for the GPU before a clock is read (a no-op on the CPU)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / 'benchmarks'))
from bench_fit import plain_loop  # noqa: E402  the same hand-written loop as the CPU benchmark

# ToyModel(d_in, d, depth, d_out), batch: on a GPU about 1e11 flops a step (a few ms in fp32); on the CPU the bench's
SETUP = dict(cuda=((512, 2048, 8, 8), 512), cpu=((64, 256, 4, 8), 32))


def count_syncs(fn, steps):
    "Synchronising CUDA calls per step while `fn(steps)` runs (each warns under sync debug mode 'warn')"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter('always')
        torch.cuda.set_sync_debug_mode('warn')
        try: fn(steps); torch.cuda.synchronize()
        finally: torch.cuda.set_sync_debug_mode(0)
    said = [str(w.message) for w in seen if 'synchroniz' in str(w.message).lower()]
    return len(said) / steps, sorted(set(s.splitlines()[0][:160] for s in said))[:5]


def run(device, steps, n_rounds, out:dict, warmup=10):
    (d_in, d, depth, d_out), b = SETUP[device]
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 as written: the step stays a few ms
    model = dtnb.ToyModel(d_in=d_in, d=d, depth=depth, d_out=d_out).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = dtnb.toy_data(b * (steps + warmup), d_in=d_in, d_out=d_out)
    loader = torch.utils.data.DataLoader(data, batch_size=b, shuffle=False, pin_memory=device == 'cuda')
    loops = dict(fit=lambda n: dtnb.fit(model, loader, opt, max_steps=n, progress=False),
                 plain=lambda n: plain_loop(model, loader, opt, n, device))
    for f in loops.values(): f(warmup)
    synchronize(device)
    rounds = []
    for r in range(n_rounds):
        t = {}
        for name in (('fit', 'plain') if r % 2 else ('plain', 'fit')):
            synchronize(device); t0 = time.perf_counter()
            loops[name](steps); synchronize(device)
            t[name] = steps / (time.perf_counter() - t0)
        rounds.append((t['fit'], t['plain']))
    out.update(model=dict(d_in=d_in, d=d, depth=depth, d_out=d_out, batch=b), steps=steps, rounds=n_rounds,
               fit_steps_s=statistics.median(f for f, _ in rounds),
               plain_steps_s=statistics.median(p for _, p in rounds),
               ratio=statistics.median(f / p for f, p in rounds), each=[round(f / p, 3) for f, p in rounds])
    out['plain_step_ms'] = 1e3 / out['plain_steps_s']
    if device == 'cuda':
        for name, f in loops.items():
            out[f'{name}_syncs_per_step'], out[f'{name}_sync_examples'] = count_syncs(f, steps)
    else: out['syncs_per_step'] = 'not measurable on the CPU (no device queue to synchronise with)'
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--out', default='fit.json'); ap.add_argument('--device', default='cuda', choices=('cuda', 'cpu'))
    ap.add_argument('--steps', type=int, default=None); ap.add_argument('--rounds', type=int, default=None)
    a = ap.parse_args(argv)
    if a.device == 'cuda' and not torch.cuda.device_count():
        print("gpu_fit_check: no CUDA device here: nothing run (`--device cpu` checks the logic)"); return 0
    if a.device == 'cpu': import os; os.environ['DTNB_DEVICE'] = 'cpu'; torch.set_num_threads(1)
    steps, n = a.steps or (40 if a.device == 'cuda' else 10), a.rounds or (7 if a.device == 'cuda' else 3)
    out = dict(device=a.device, torch=torch.__version__, goal=0.97)
    try: run(a.device, steps, n, out); failed = False  # fills `out` as it goes: a failure keeps what it measured
    except Exception as e: out.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()); failed = True
    keys = ('ratio', 'fit_steps_s', 'plain_steps_s', 'plain_step_ms', 'fit_syncs_per_step', 'plain_syncs_per_step',
            'syncs_per_step')
    out['headline'] = dict({k: out[k] for k in keys if k in out}, meets_goal=out.get('ratio', 0) >= 0.97,
                           passed=not failed)
    Path(a.out).write_text(json.dumps(out, indent=1, default=str))
    print(json.dumps({k: v for k, v in out.items() if k != 'traceback'}, default=str)[:1500])
    ratio = out.get('ratio', float('nan'))
    print("fit check:", "FAILED" if failed else "ran", f"(fit / plain = {ratio:.3f}, goal 0.97)")
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
