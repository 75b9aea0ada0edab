"""Probe: where dtnb's save spends wall time on each rank, interleaved with plain dcp.save (medians)."""
import os, sys, shutil, statistics, tempfile, time
from pathlib import Path
import torch


def _bench(root, rounds):
    from dtnb.core.dist import barrier
    from dtnb.core.models import ToyModel
    from dtnb.parallel.wrap import wrap
    import torch.distributed.checkpoint as dcp
    from dtnb.train import checkpoint as ck
    model = wrap(ToyModel(d_in=64, d=512, depth=8, d_out=8, seed=0), 'ddp')
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.zero_grad(); model(torch.randn(8, 64)).pow(2).mean().backward(); opt.step()
    sd = ck.state_dicts(model, opt)[0]
    root = Path(root)
    spent = {}
    def timer(mod, name, label):
        f = getattr(mod, name)
        def w(*a, **k):
            t = time.perf_counter()
            try: return f(*a, **k)
            finally: spent.setdefault(label, []).append(time.perf_counter() - t)
        setattr(mod, name, w)
    for name in ('state_dicts', 'live_buffers', 'all_gather_objects', 'agree', '_rank0_buffers', '_hash_files',
                 '_commit', '_pt_bytes', '_write_file', 'rng_state', '_fsync', '_fsync_dir'):
        timer(ck, name, name)
    timer(dcp, 'save', 'dcp.save')
    plain, tot = [], []
    for i in range(rounds):
        for v in ((0, 1) if i % 2 else (1, 0)):
            barrier(); t = time.perf_counter()
            if v: ck.save_checkpoint(ck.checkpoint_path(root / 'dtnb', i), model, opt, step=i)
            else: dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(root / f'dcp_{i}')))
            barrier(); (tot if v else plain).append(time.perf_counter() - t)
    # dcp.save timer also caught the plain saves: drop them (every other call)
    return plain, tot, spent


def main():
    from dtnb.launcher.processes import launch
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    root = tempfile.mkdtemp(prefix='dtnb-probe-')
    try: res = launch(_bench, root, rounds, nprocs=2)
    finally: shutil.rmtree(root, ignore_errors=True)
    for r, (plain, tot, spent) in enumerate(res):
        print(f"rank {r}: plain {statistics.median(plain)*1e3:.0f} ms, dtnb {statistics.median(tot)*1e3:.0f} ms, "
              f"ratio {statistics.median(a / b for a, b in zip(tot, plain)):.2f}")
        for k, v in sorted(spent.items(), key=lambda kv: -sum(kv[1])):
            print(f"   {k:20} n={len(v):3} sum/round {sum(v) / rounds * 1e3:7.1f} ms  median {statistics.median(v)*1e3:6.1f}")


if __name__ == '__main__':
    main()
