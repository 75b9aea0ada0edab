"""All-reduce bandwidth between hosts, and dtnb's predicted DDP gradient sync against the measured one, on a network
whose rate we set. Needs root: the hosts are network namespaces (tools/cluster.sh), their links limited with tc tbf.

    sudo .venv/bin/python benchmarks/bench_network.py            # loopback, namespace link, 1 Gbit/s, 100 Mbit/s
    sudo .venv/bin/python benchmarks/bench_network.py --json out.json

For each link it measures the gloo all-reduce busbw between 2 ranks (one per host; both on one host for loopback),
and the DDP sync overhead of a ~4 MiB-gradient MLP (median step time minus the same step under `no_sync`, as
`bench_scaling` does). The prediction is `predict_sync_seconds` (the column `bench_scaling` prints as "predicted sync
ms"), equal to `predict`'s communication term `bus_bytes(step_collectives('ddp', ...)) / busbw`, from (a) the link's
nominal rate, what a user would give, and (b) the busbw measured on that link. Ratios are measured / predicted
(goal: within 30%). Latency cannot be shaped here (the kernel has no netem), so the links differ only in rate.
"""
import argparse, json, os, statistics, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / 'tests'))
PORT = 29700
GRAD_SIZES = {None: [2**20, 4 * 2**20, 16 * 2**20, 64 * 2**20], '1gbit': [4 * 2**20], '100mbit': [4 * 2**20]}
GRAD = 4 * 2**20  # the busbw the predictions use: at the model's gradient size (4.2 MB)


def mlp():
    import torch.nn as nn
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))  # 1.05 M parameters: 4.2 MB of grads


def worker(sizes, steps):
    "One rank: all-reduce busbw at `sizes`, then the DDP step with and without gradient sync; rank 0 prints JSON"
    import torch, torch.distributed as dist
    import dtnb
    from dtnb.bench.throughput import scaling_rank
    torch.set_num_threads(1)
    dtnb.init_distributed()
    n, out = dtnb.world_size(), dict(busbw={})
    for size in sizes:
        t = torch.ones(size // 4)
        for _ in range(2): dist.all_reduce(t)
        times = []
        for _ in range(5):
            dist.barrier(); s = time.perf_counter(); dist.all_reduce(t); times.append(time.perf_counter() - s)
        out['busbw'][size] = size / statistics.median(times) * 2 * (n - 1) / n / 1e9
    torch.manual_seed(0)
    r = scaling_rank(mlp, (torch.randn(32, 512), torch.randn(32, 512)), 'ddp', steps=steps, warmup=2)
    out.update(r, ranks=n, sync_s=r['step_s'] - r['local_step_s'])
    if dtnb.rank() == 0: print('RESULT ' + json.dumps(out), flush=True)
    dtnb.shutdown()


def run_pair(c, hosts, sizes, steps):
    "Rank 0 on hosts[0], rank 1 on hosts[1] (the same host: loopback); returns rank 0's result"
    env = {k: v for k, v in os.environ.items() if not k.endswith('SOCKET_IFNAME')}
    procs = []
    for r, h in enumerate(hosts):
        e = dict(env, RANK=str(r), WORLD_SIZE='2', LOCAL_RANK='0', MASTER_ADDR=c.addr(hosts[0]), MASTER_PORT=str(PORT),
                 LOCAL_WORLD_SIZE='1', DTNB_DEVICE='cpu', OMP_NUM_THREADS='1')
        if hosts[0] == hosts[1]: e.update(MASTER_ADDR='127.0.0.1', LOCAL_RANK=str(r), LOCAL_WORLD_SIZE='2')
        argv = [sys.executable, __file__, '--worker', '--sizes', ','.join(map(str, sizes)), '--steps', str(steps)]
        procs.append(c.run(h, argv, env=e, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=600) for p in procs]
    line = next((l for l in outs[0][0].splitlines() if l.startswith('RESULT ')), None)
    if line is None: raise RuntimeError(f"no result: {outs[0][1][-3000:]} {outs[1][1][-3000:]}")
    return json.loads(line[7:])


def predicted(grad_bytes, n, busbw_gbs):
    from dtnb.bench.throughput import predict_sync_seconds
    from dtnb.bench.forecast import step_collectives, bus_bytes
    s = predict_sync_seconds('ddp', grad_bytes, n, busbw_gbs)
    comm = bus_bytes(step_collectives('ddp', grad_bytes // 4, n), n) / (busbw_gbs * 1e9)  # predict()'s comm term
    assert abs(s - comm) <= 1e-9 * max(s, 1), (s, comm)
    return s


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--worker', action='store_true'); ap.add_argument('--sizes', default='')
    ap.add_argument('--steps', type=int, default=8); ap.add_argument('--json')
    a = ap.parse_args()
    if a.worker: return worker([int(s) for s in a.sizes.split(',')], a.steps)
    from cluster import Cluster, cluster_unavailable
    if (why := cluster_unavailable()): sys.exit(f"bench_network: {why}")
    rows = []
    with Cluster(2) as c:
        for name, hosts, rate in (('loopback (one host)', (1, 1), None), ('namespace link', (1, 2), None),
                                  ('link at 1 Gbit/s', (1, 2), '1gbit'), ('link at 100 Mbit/s', (1, 2), '100mbit')):
            for h in c.hosts: c.shape(h, rate)
            r = run_pair(c, hosts, GRAD_SIZES[rate], a.steps)
            nominal = {'1gbit': 0.125, '100mbit': 0.0125}.get(rate)
            bw = r['busbw'][str(GRAD)]
            row = dict(link=name, busbw={int(k) // 2**20: v for k, v in r['busbw'].items()}, grad_bytes=r['grad_bytes'],
                       sync_ms=r['sync_s'] * 1e3, step_ms=r['step_s'] * 1e3,
                       pred_measured_ms=predicted(r['grad_bytes'], 2, bw) * 1e3,
                       pred_nominal_ms=predicted(r['grad_bytes'], 2, nominal) * 1e3 if nominal else None)
            rows.append(row); print(fmt(row), flush=True)
    if a.json: Path(a.json).write_text(json.dumps(rows, indent=2))


def fmt(r):
    bw = ', '.join(f"{k} MiB {v:.3f}" for k, v in r['busbw'].items())
    s = (f"{r['link']:>20}: all-reduce busbw GB/s [{bw}]; DDP sync of {r['grad_bytes'] / 2**20:.1f} MiB: measured "
         f"{r['sync_ms']:.1f} ms (step {r['step_ms']:.1f} ms), predicted from measured busbw "
         f"{r['pred_measured_ms']:.1f} ms (ratio {r['sync_ms'] / r['pred_measured_ms']:.2f})")
    if r['pred_nominal_ms']:
        s += f", from the nominal rate {r['pred_nominal_ms']:.1f} ms (ratio {r['sync_ms'] / r['pred_nominal_ms']:.2f})"
    return s


if __name__ == '__main__':
    main()
