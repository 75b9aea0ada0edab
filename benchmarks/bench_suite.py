"""dtnb.bench.compute, dtnb.bench.collectives and dtnb.bench.throughput against references, side by side in one run. Prints figures; not a test.

    python benchmarks/bench_suite.py [--full]

1. Matmul: dtnb's timing vs torch.utils.benchmark's of the matmul bench_matmul times (inputs rotated beyond the cache),
   one thread, alternated call by call (ABBA), median of pair ratios, with wall time and with thread CPU time
   (target: within 5%); and the same
   matmul on inputs that stay in cache, which shows what rotation costs.
2. Memory: bench_memory's copy bandwidth vs a bare `dst.copy_(src)` loop timed with perf_counter on the same buffers.
3. Collectives: gloo all_reduce busbw on 2 ranks at 1 MiB and 64 MiB (FACTS.md: about 1.2 and 3.3 GB/s here).
4. Model: samples/s and MFU of a small residual MLP; scaling 1 -> 2 DDP ranks; `bench_all(quick=True)` wall time.
"""
import argparse, functools, itertools, statistics, time, tempfile
import torch, torch.utils.benchmark as tbench
from dtnb.bench.compute import bench_matmul, bench_memory, matmul_flops, cache_bytes, time_fn, _threads, _matmul_case, _pool
from dtnb.bench.collectives import bench_collectives
from dtnb.bench.throughput import bench_model, bench_scaling, bench_all
from dtnb.core.models import ToyModel


def matmul_vs_timer(n=1024, pairs=41):
    "dtnb's time_fn vs torch.utils.benchmark on the matmul bench_matmul times (rotated inputs), alternated ABBA, per clock"
    a, b, c = torch.rand(n, n), torch.rand(n, n), torch.empty(n, n)
    g = lambda s: matmul_flops(n, n, n) / s / 1e9
    with _threads(1):
        fn, span = _matmul_case('fp32', n, n, n, _pool('fp32', 2 * cache_bytes('cpu') // 4, 'cpu'))
        nxt = itertools.count()
        step = lambda i=None: fn(next(nxt))
        for clock, tfn in (('wall', time.perf_counter), ('thread', time.thread_time)):
            same = tbench.Timer('step()', globals=dict(step=step), num_threads=1, timer=tfn)
            cached = tbench.Timer('torch.mm(a, b, out=c)', globals=dict(torch=torch, a=a, b=b, c=c), num_threads=1, timer=tfn)
            ours = lambda: time_fn(step, 'cpu', repeats=1, warmup=0, clock=clock)[0]
            trio = [ours, lambda: same.timeit(1).median, lambda: cached.timeit(1).median]
            for f in trio: f()
            res = []
            for j in range(pairs):
                order = trio if j % 2 == 0 else trio[::-1]
                out = {id(f): f() for f in order}
                res.append([out[id(f)] for f in trio])
            o, t, cc = (statistics.median(x) for x in zip(*res))
            r = statistics.median(x[1] / x[0] for x in res)
            rot = statistics.median(x[2] / x[0] for x in res)
            print(f"  fp32 {n}^3, 1 thread, clock={clock:6}: dtnb {g(o):6.1f} GFLOPS, torch.utils.benchmark {g(t):6.1f}, "
                  f"median pair ratio {r:.3f} {'OK' if abs(r - 1) < 0.05 else 'MISSED'} (target within 5%); "
                  f"on cached inputs {g(cc):6.1f} GFLOPS: rotation costs {100 * (1 - rot):.1f}%")


def memory_vs_bare():
    r = bench_memory('cpu', repeats=7, progress=False)
    n = r.config['nbytes']
    src, dst = torch.ones(n // 4), torch.empty(n // 4)
    dst.copy_(src); ts = []
    for _ in range(7):
        t = time.perf_counter(); dst.copy_(src); ts.append(time.perf_counter() - t)
    bare = 2 * n / statistics.median(ts) / 1e9
    print(f"  host copy of {n / 2**20:.0f} MiB ({n / cache_bytes('cpu'):.0f}x the cache), {torch.get_num_threads()} threads: "
          f"dtnb {r.rows[0]['gbs']:.1f} GB/s, bare loop {bare:.1f} GB/s, ratio {r.rows[0]['gbs'] / bare:.3f}")


def main():
    ap = argparse.ArgumentParser(); ap.add_argument('--full', action='store_true'); a = ap.parse_args()
    print("1. matmul vs torch.utils.benchmark"); matmul_vs_timer()
    print("2. memory copy vs a bare loop"); memory_vs_bare()
    print("3. gloo all_reduce, 2 ranks")
    c = bench_collectives(['all_reduce'], sizes=[2**20, 64 * 2**20], nprocs=2, progress=False)
    for row in c.rows: print(f"  {row['size'] / 2**20:5.0f} MiB: time {row['time_us'] / 1e3:7.2f} ms  algbw {row['algbw']:.2f}  busbw {row['busbw']:.2f} GB/s  #wrong {row['wrong']}")
    print("4. model, scaling, whole suite")
    toy = functools.partial(ToyModel, d_in=64, d=256, depth=2, d_out=64)
    batch = (torch.randn(64, 64), torch.randn(64, 64))
    m = bench_model(toy(), batch, device='cpu')
    print(f"  ToyModel(d=256): {m.summary['samples/s']:.0f} samples/s, {m.summary['achieved GFLOPS']:.1f} GFLOPS, "
          f"MFU {m.summary['MFU % vs measured matmul peak']:.1f}% of measured matmul peak, spec-peak MFU {m.summary['MFU % vs spec peak']}")
    s = bench_scaling(toy, batch, nprocs=(1, 2), progress=False)
    two = s.rows[-1]
    print(f"  DDP 1 -> 2 ranks: speed-up {two['speedup']:.2f}, efficiency {two['efficiency']:.0f}%, sync overhead "
          f"{two['overhead_ms']:.2f} ms measured vs {two['predicted_ms']:.2f} ms predicted from busbw {two['busbw']:.2f} GB/s")
    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as d: bench_all(quick=not a.full, out=d, progress=False, print_fn=lambda s: None)
    print(f"  bench_all(quick={not a.full}) with JSON and PNG output: {time.perf_counter() - t:.1f} s")

if __name__ == '__main__':
    main()
