"""The loader tuner against the full grid: wall time of each search, and the throughput of each one's best setting,
re-measured side by side (alternating, median of --rounds) so that both face the same machine. Prints figures; not a test.

Target (issue 7): the tuner's best >= 95% of the grid's best throughput, in <= 35% of the grid's wall time.
    python benchmarks/bench_loader_tuner.py [--trial-s 1.0] [--sets cpu,sleep] [--rounds 5] [--json out.json]

The grid is every combination tune_loader(search='grid') tries: num_workers 0..limit × persistent_workers ×
prefetch_factor {2, 4} × in_order (× pin_memory with an accelerator). When both searches pick the same setting (torch's
defaults filled in) it is measured once for both. Other jobs on the machine make timings noisy: the free cores are
measured before and after each set and printed with it.
"""
import argparse, json, statistics
import torch
from dtnb.data.loaders import SyntheticDataset, cores_free
from dtnb.data.tune import tune_loader
from dtnb.data.trials import loader_trial
from dtnb.detection.device import detect


def settings(s): return ', '.join(f"{k}={v}" for k, v in s.items())


def canonical(s):
    "DataLoader settings with torch's defaults filled in, so equal settings compare equal"
    if not s.get('num_workers'): return dict(num_workers=0)
    return dict(dict(prefetch_factor=2, persistent_workers=False, pin_memory=False, in_order=True), **s)


def bench(mode, n, bs, trial_s, rounds):
    ds = SyntheticDataset(n, cost_ms=2, mode=mode)
    free = [cores_free()]
    smart = tune_loader(ds, bs, trial_s=trial_s)
    grid = tune_loader(ds, bs, trial_s=trial_s, search='grid')
    same = canonical(smart.best.settings) == canonical(grid.best.settings)
    s_sps, g_sps, z_sps = [], [], []
    for _ in range(rounds):  # alternate, so drifts in the machine's load hit both
        s_sps.append(loader_trial(ds, bs, 2 * trial_s, **smart.best.settings).samples_per_s)
        g_sps.append(s_sps[-1] if same else loader_trial(ds, bs, 2 * trial_s, **grid.best.settings).samples_per_s)
        z_sps.append(loader_trial(ds, bs, 2 * trial_s, num_workers=0).samples_per_s)
    free.append(cores_free())
    s, g, z = statistics.median(s_sps), statistics.median(g_sps), statistics.median(z_sps)
    return dict(mode=mode, n=n, batch_size=bs, trial_s=trial_s, cores_free=free, same_setting=same,
                smart=dict(best=smart.best.settings, trials=len(smart.trials), wall_s=smart.wall_s, found_sps=smart.best.samples_per_s, sps=s_sps),
                grid=dict(best=grid.best.settings, trials=len(grid.trials), wall_s=grid.wall_s, found_sps=grid.best.samples_per_s, sps=g_sps),
                zero_sps=z_sps, throughput_ratio=s / g, time_ratio=smart.wall_s / grid.wall_s, speedup_vs_zero=s / z,
                advice=smart.advice)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--trial-s', type=float, default=1.0); ap.add_argument('--rounds', type=int, default=5)
    ap.add_argument('--sets', default='cpu,sleep'); ap.add_argument('--n', type=int, default=4096)
    ap.add_argument('--batch-size', type=int, default=32); ap.add_argument('--json')
    a = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{detect().fingerprint()}\nsynthetic samples of 2 ms, batch {a.batch_size}, {a.n} samples, trials of {a.trial_s} s, "
          f"best settings re-measured {a.rounds}× alternately in trials of {2 * a.trial_s} s\n")
    out = []
    for mode in a.sets.split(','):
        r = bench(mode, a.n, a.batch_size, a.trial_s, a.rounds); out.append(r)
        sm, gr = r['smart'], r['grid']
        ok_t, ok_s = r['throughput_ratio'] >= 0.95, r['time_ratio'] <= 0.35
        print(f"== {mode}-bound samples (cores free before/after: {r['cores_free'][0]:.2f} / {r['cores_free'][1]:.2f})")
        print(f"  tuner  {sm['trials']:3d} trials {sm['wall_s']:6.1f} s  best {settings(sm['best'])}: {statistics.median(sm['sps']):7.0f} samples/s")
        print(f"  grid   {gr['trials']:3d} trials {gr['wall_s']:6.1f} s  best {settings(gr['best'])}: {statistics.median(gr['sps']):7.0f} samples/s")
        print(f"  num_workers=0                                  {statistics.median(r['zero_sps']):7.0f} samples/s")
        print(f"  tuner/grid throughput {r['throughput_ratio']:.3f}  target >= 0.95  {'OK' if ok_t else 'MISSED'}"
              + ("  (the same setting: measured once)" if r['same_setting'] else ''))
        print(f"  tuner/grid wall time  {r['time_ratio']:.3f}  target <= 0.35  {'OK' if ok_s else 'MISSED'}")
        print(f"  tuner vs num_workers=0 {r['speedup_vs_zero']:.2f}×")
        for adv in r['advice']: print(f"  advice: {adv}")
        print()
    if a.json:
        with open(a.json, 'w') as f: json.dump(out, f, indent=2)


if __name__ == '__main__':
    main()
