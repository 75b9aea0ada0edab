"""Benchmarks: timing against torch.utils.benchmark, nccl-tests' formulas, collectives and scaling on real gloo ranks.
The CPU is the subject: ranks are CPU ranks on gloo on any machine (`cpu_ranks`, conftest.py)."""
import json, math, statistics, functools, time, itertools
import pytest, torch
import torch.utils.benchmark as tbench
from dtnb.bench.compute import (bench_matmul, time_fn, BenchResult, matmul_flops, cache_bytes, _matmul_case, _pool,
                                _pool_size, _threads)
from dtnb.bench.collectives import (bench_collectives, busbw_factor, busbw, algbw, collective_counts, collective_sizes,
                              expected_output, COLLECTIVES)
from dtnb.bench.throughput import bench_scaling, bench_all, predict_sync_seconds, _ranks
from dtnb.detection.device import detect
from dtnb.core.models import ToyModel
from dtnb.launcher.processes import launch, default_backend
from dtnb.detection.device import usable_cores
from dtnb.core.utils import default_device

pytestmark = pytest.mark.usefixtures('cpu_ranks')


def test_matmul_agrees_with_torch_utils_benchmark():
    """dtnb's timing of a matmul and torch.utils.benchmark's timing of the same matmul agree within 5%.

    The operation is the one bench_matmul times: an fp32 matmul whose inputs rotate through at least twice the cache
    (`_matmul_case`); both harnesses call that same function, with the same thread count (1) and the same clock, this
    thread's CPU time (on this shared 2-core machine other processes inflate wall time by up to several times). Even
    CPU time drifts by ~30% in phases of a few hundred ms (caches refilled after every preemption), so the two alternate
    call by call, in ABBA order so that neither always goes first, and the statistic is the median over adjacent pairs
    of their ratio: a phase falls on both calls of a pair alike."""
    n, pairs = 1024, 41
    with _threads(1):
        cache = cache_bytes('cpu')
        fn, span = _matmul_case('fp32', n, n, n, _pool('fp32', _pool_size([(n, n, n)], 4, cache), 'cpu'), cache)
        assert span >= 2 * cache
        nxt = itertools.count()
        step = lambda i=None: fn(next(nxt))
        timer = tbench.Timer('step()', globals=dict(step=step), num_threads=1, timer=time.thread_time)
        ours = lambda: time_fn(step, 'cpu', repeats=1, warmup=0, clock='thread')[0]
        theirs = lambda: timer.timeit(1).median
        ours(); theirs()   # warm-up for both
        ratios = []
        for j in range(pairs):
            if j % 2: t, o = theirs(), ours()
            else: o, t = ours(), theirs()
            ratios.append(t / o)   # = our GFLOPS / theirs
    ratio = statistics.median(ratios)
    assert abs(ratio - 1) < 0.05, (ratio, ratios)


def test_bench_matmul_reports_the_median_call():
    r = bench_matmul(['fp32'], sizes=[(64, 32, 16), 128], device='cpu', repeats=7, warmup=2, progress=False)
    for row in r.rows:
        times = r.series['seconds'][f"fp32 {row['shape']}"]
        assert len(times) == 7 and min(times) > 0
        assert row['value'] == pytest.approx(matmul_flops(row['m'], row['n'],
                                                          row['k']) / statistics.median(times) / 1e9)
        assert row['best'] == pytest.approx(matmul_flops(row['m'], row['n'], row['k']) / min(times) / 1e9)
    assert r.summary['fp32 max achievable GFLOPS'] == max(x['value'] for x in r.rows)


@pytest.mark.parametrize('n', [2, 3, 4, 8, 16, 64])
def test_bus_bandwidth_is_nccl_tests_definition(n):
    "busbw = algbw * 2(n-1)/n (all-reduce), * (n-1)/n (all-gather, reduce-scatter, all-to-all), * 1 (broadcast); "
    "GB = 1e9 B"
    S, t = 3 * 2**27, 0.0123
    assert algbw(S, t) == pytest.approx(S / t / 1e9)
    assert busbw('all_reduce', S, t, n) == pytest.approx(S / t / 1e9 * 2 * (n - 1) / n)
    for op in ('all_gather', 'reduce_scatter', 'all_to_all'):
        assert busbw(op, S, t, n) == pytest.approx(S / t / 1e9 * (n - 1) / n)
    assert busbw('broadcast', S, t, n) == pytest.approx(S / t / 1e9)
    # nccl-tests' sizes: all-gather reports the gathered output, reduce-scatter the input, both rounded to n elements
    assert collective_counts('all_gather', 1000, n, 4)['size'] == (250 // n) * n * 4
    assert collective_counts('reduce_scatter', 1000, n, 4)['count'] == 250 // n


def _run_each(ops, numel, seed):
    "Inside a rank: each collective on this rank's random input; returns {op: (input, output)}"
    import torch.distributed as dist
    from dtnb.bench.collectives import _run_collective
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for op in ops:
        c = collective_counts(op, numel * 4, n, 4)
        send = torch.randn(c['send'], generator=torch.Generator().manual_seed(seed + 1000 * r + hash(op) % 997))
        recv = send.clone() if op in ('all_reduce', 'broadcast') else torch.zeros(c['recv'])
        _run_collective(op, send, recv)
        out[op] = (send, recv)
    return out

def test_collectives_match_a_single_process_reference():
    "Each collective on 2 gloo ranks with random data equals the same operation done in one process on all inputs"
    n = 2   # the subject is what each collective computes: CPU tensors, so gloo whatever the machine has
    res = launch(_run_each, list(COLLECTIVES), 48, 7, nprocs=n, timeout=120, backend='gloo')
    for op in COLLECTIVES:
        ins = [res[r][op][0] for r in range(n)]
        for r in range(n):
            want = {'all_reduce': lambda: sum(ins), 'broadcast': lambda: ins[0], 'all_gather': lambda: torch.cat(ins),
                    'reduce_scatter': lambda: sum(ins).chunk(n)[r],
                    'all_to_all': lambda: torch.cat([x.chunk(n)[r] for x in ins])}[op]()
            torch.testing.assert_close(res[r][op][1], want, msg=f"{op} on rank {r}")


def test_bench_collectives_on_two_ranks():
    "Two ranks of this machine's backend: gloo on a CPU, nccl on NVIDIA GPUs"
    r = bench_collectives(sizes=collective_sizes(8, 2**14), nprocs=2, iters=3, warmup=1, progress=False)
    assert r.summary['#wrong'] == 0 and r.config['backend'] == default_backend()
    assert [x['size'] for x in r.rows if x['op'] == 'all_reduce'] == collective_sizes(8, 2**14)
    for x in r.rows:
        assert x['seconds'] > 0 and x['busbw'] == pytest.approx(busbw(x['op'], x['size'], x['seconds'], 2))
    back = BenchResult.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back == r


def _corrupt(*args):
    from dtnb.bench import collectives
    from dtnb.core.dist import rank
    if rank() == 1: collectives._pattern = lambda r, pos: 2 + r + pos % 7   # rank 1 sends data off by one
    return collectives.collective_rank(*args)

def test_wrong_data_is_counted():
    res = launch(_corrupt, ['all_reduce', 'broadcast'], [64], 'fp32', 2, 1, nprocs=2, timeout=120)
    wrong = {(rank, row['op']): row['wrong'] for rank, rows in enumerate(res) for row in rows}
    assert wrong[(0, 'all_reduce')] == wrong[(1, 'all_reduce')] == 16   # every element of the sum is off
    # rank 1 expected its own (wrong) pattern from rank 0
    assert wrong[(0, 'broadcast')] == 0 and wrong[(1, 'broadcast')] == 16


def test_bad_arguments_fail_fast():
    with pytest.raises(ValueError, match="at least 2 ranks"): bench_collectives(nprocs=1)
    with pytest.raises(ValueError, match="Unknown collective 'allreduce'"): bench_collectives(['allreduce'])
    with pytest.raises(ValueError, match="Collective dtype"): bench_collectives(dtype='int8')
    with pytest.raises(ValueError, match="use sizes >= 16 bytes"): bench_collectives(['all_gather'], sizes=[4, 8],
                                                                                     nprocs=4)


def test_scaling_with_ddp_on_local_ranks():
    toy = functools.partial(ToyModel, d_in=32, d=64, depth=2, d_out=4)
    r = bench_scaling(toy, (torch.randn(16, 32), torch.randn(16, 4)), nprocs=(1, 2), steps=4, warmup=1, progress=False)
    one, two = r.rows
    grad = sum(p.numel() * 4 for p in toy().parameters())
    assert two['grad_bytes'] == grad and two['busbw'] > 0
    assert 0 <= two['overlap'] <= 1 and two['latency'] > 0 and two['compute_ms'] > 0, two
    assert two['predicted_ms'] == pytest.approx(predict_sync_seconds(  # the step-time model's exposed sync
        'ddp', grad, 2, two['busbw'], compute=two['compute_ms'] / 1e3, overlap=two['overlap'],
        latency=two['latency']) * 1e3)
    assert two['predicted_ms'] <= predict_sync_seconds('ddp', grad, 2, two['busbw'], latency=two['latency']) * 1e3
    assert two['samples_s'] == pytest.approx(32 / (two['step_ms'] / 1e3))
    assert two['efficiency'] == pytest.approx(100 * two['samples_s'] / (2 * one['samples_s']))
    assert two['overhead_ms'] is not None
    cpu = default_device().type == 'cpu'   # CPU ranks share the usable cores (1 each on 2 cores); GPU ranks: None
    assert r.config['threads_per_rank'] == (max(1, usable_cores() // 2) if cpu else None)


@pytest.mark.long  # a whole-tool run (`dtnb bench all`; 07's notebooks test each benchmark): bash run.sh test-long
def test_bench_all_saves_json_and_png(tmp_path):
    lines = []
    res = bench_all(quick=True, out=tmp_path, only=['matmul', 'collectives'], progress=False, print_fn=lines.append)
    two = _ranks(detect()) >= 2   # 2 ranks need 2 usable cores (not so under `taskset -c 0`) or accelerators
    files = ['collectives.json', 'collectives.png'] * two + ['matmul.json', 'matmul.png']
    assert sorted(p.name for p in tmp_path.iterdir()) == files, lines
    assert BenchResult.load(tmp_path / 'matmul.json') == res[0]
    assert lines[0].startswith(f'dtnb bench matmul on {default_device()}')
    assert 'busbw (GB/s)' in lines[1] if two else 'collectives: skipped, it needs 2 ranks' in lines[1], lines
