"""Probe: dcp.save with torch's FileSystemWriter vs dtnb's summing writer vs save_checkpoint, 2 ranks, interleaved.

    python benchmarks/probe_save.py [--rounds 9] [--variants plain,summing,nocrc,dtnb]

variants: plain (torch's FileSystemWriter), nosync (the same, sync_files=False), summing (dtnb's writer, torch.save's
CRC32 on), nocrc (dtnb's writer as a synchronous save uses it), dtnb (save_checkpoint). The first is the baseline.
"""
import argparse, os, shutil, statistics, tempfile, time
from pathlib import Path
import torch


def _bench(root, rounds, variants):
    from dtnb.core.dist import rank, barrier
    from dtnb.core.models import ToyModel
    from dtnb.parallel.wrap import wrap
    import torch.distributed.checkpoint as dcp
    from dtnb.train import checkpoint as ck
    model = wrap(ToyModel(d_in=64, d=512, depth=8, d_out=8, seed=0), 'ddp')
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.zero_grad(); model(torch.randn(8, 64)).pow(2).mean().backward(); opt.step()
    sd = ck.state_dicts(model, opt)[0]
    root = Path(root)
    fs = {'t': 0.0, 'n': 0}
    real_fsync = os.fsync
    def fsync(fd):
        t = time.perf_counter()
        try: return real_fsync(fd)
        finally: fs['t'] += time.perf_counter() - t; fs['n'] += 1
    os.fsync = fsync
    fns = {
        'plain': lambda i: dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(root / f'plain_{i}'))),
        'nosync': lambda i: dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(root / f'nosync_{i}'), sync_files=False)),
        'summing': lambda i: dcp.save(sd, storage_writer=ck._summing_writer(root / f'summing_{i}', {})),
        'nocrc': lambda i: dcp.save(sd, storage_writer=ck._summing_writer(root / f'nocrc_{i}', {}, zip_crc=False)),
        'dtnb': lambda i: ck.save_checkpoint(ck.checkpoint_path(root / 'dtnb', i), model, opt, step=i),
    }
    times = {v: [] for v in variants}
    syncs = {v: [] for v in variants}
    for i in range(rounds):
        order = variants[i % len(variants):] + variants[:i % len(variants)]
        for v in order:
            barrier(); fs['t'] = 0.0; fs['n'] = 0
            c = time.process_time()
            t = time.perf_counter(); fns[v](i); barrier(); times[v].append(time.perf_counter() - t)
            syncs[v].append((fs['t'], fs['n'], time.process_time() - c))
    os.fsync = real_fsync
    return times, syncs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--rounds', type=int, default=9); ap.add_argument('--variants', default='plain,summing,dtnb')
    ap.add_argument('--dir', default=None)
    a = ap.parse_args()
    from dtnb.launcher.processes import launch
    variants = a.variants.split(',')
    root = tempfile.mkdtemp(prefix='dtnb-probe-', dir=a.dir)
    try: res = launch(_bench, root, a.rounds, variants, nprocs=2)
    finally: shutil.rmtree(root, ignore_errors=True)
    times, _ = res[0]
    base = times[variants[0]]
    for v in variants:
        ratios = [x / y for x, y in zip(times[v], base)]
        print(f"{v:8} median {statistics.median(times[v]) * 1e3:7.1f} ms  ratio/{variants[0]} median "
              f"{statistics.median(ratios):.2f}  all: {' '.join(f'{x * 1e3:.0f}' for x in times[v])}")
    for r, (_, syncs) in enumerate(res):
        for v in variants:
            print(f"  rank {r} {v:8} cpu ms median {statistics.median(c for _, _, c in syncs[v]) * 1e3:5.0f}; "
                  f"fsync ms/count: {' '.join(f'{t * 1e3:.0f}/{n}' for t, n, _ in syncs[v])}")


if __name__ == '__main__':
    main()
