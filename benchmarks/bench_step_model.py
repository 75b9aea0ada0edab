"""The step-time model checked where it runs: `dtnb.bench.validate` on this machine's CPU ranks, over loopback and
over links between network-namespace hosts limited with tc tbf, for two model sizes. Prints the tables and writes
them (JSON and Markdown) to --out. Not a test: the figures are this machine's.

    .venv/bin/python benchmarks/bench_step_model.py --out benchmarks/results/DATE-cpu-validation
    sudo .venv/bin/python benchmarks/bench_step_model.py --links --out ...     # also 1 Gbit/s and 100 Mbit/s links
    .venv/bin/python benchmarks/bench_step_model.py --remodel --out ...        # the layout model's column again

Each layout's step is predicted from parts measured apart (its compute stepped by plain modules in every rank at
once, its parameters' communication by the wrapped model at one token, its activation collectives one by one after
their compute, DTensor's dispatch on a one-rank mesh, the 1F1B bubble from each stage's time), then run for real.
Over a link, rank 0 runs on host 1 and rank 1 on host 2 (tools/cluster.sh's namespaces, tests/cluster.py); the
one-process samples run here, as they need no network. Latency cannot be shaped here (no netem): links differ in rate.
"""
import argparse, json, os, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / 'tests'))
PORT = 29720
SIZES = {'small': dict(layers=4, hidden=128, heads=4, seq_len=128, batch=4),
         'base': dict(layers=4, hidden=256, heads=4, seq_len=128, batch=4)}
LINKS = (('namespace link', None), ('link at 1 Gbit/s', '1gbit'), ('link at 100 Mbit/s', '100mbit'))


def worker(a):
    "One rank on a namespace host: the rank's samples and real steps of every layout; prints them as JSON"
    import warnings; warnings.filterwarnings('ignore')
    import dtnb
    from dtnb.bench.validate import validate_rank
    from dtnb.plan.memory import TransformerShape
    job = json.loads(Path(a.job).read_text())
    dtnb.init_distributed()
    out = validate_rank(TransformerShape(**job['shape']), job['names'], job['one'], job['steps'], job['seconds'])
    print('RESULT ' + json.dumps(out), flush=True)
    dtnb.shutdown()


def over_link(c, rate, shape, names, one, steps, seconds, tmp):
    "Rows of the 2-rank layouts `names`, rank i on host i + 1, both ends of each cable limited to `rate`"
    from dataclasses import asdict
    for h in c.hosts: c.shape(h, rate)
    job = Path(tmp) / 'job.json'
    job.write_text(json.dumps(dict(shape=asdict(shape), names=names, one=one, steps=steps, seconds=seconds)))
    env = {k: v for k, v in os.environ.items() if not k.endswith('SOCKET_IFNAME')}
    procs = [c.run(h, [sys.executable, __file__, '--worker', '--job', str(job)], cwd=ROOT, text=True,
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                   env=dict(env, RANK=str(r), WORLD_SIZE='2', LOCAL_RANK='0', LOCAL_WORLD_SIZE='1',
                            MASTER_ADDR=c.addr(c.hosts[0]), MASTER_PORT=str(PORT), DTNB_DEVICE='cpu',
                            OMP_NUM_THREADS='1'))
             for r, h in enumerate(c.hosts)]
    outs = [p.communicate(timeout=3600) for p in procs]
    res = [next((json.loads(l[7:]) for l in o.splitlines() if l.startswith('RESULT ')), None) for o, _ in outs]
    if None in res: raise RuntimeError('a rank gave no result:\n' + '\n'.join(e[-3000:] for _, e in outs))
    return res


def write(out, results):
    "validation.json and validation.md of `results`, [(size, Validation)], in folder `out`"
    out.mkdir(parents=True, exist_ok=True)
    (out / 'validation.json').write_text(json.dumps([dict(size=s, **v.to_dict()) for s, v in results], indent=1))
    (out / 'validation.md').write_text('\n\n'.join(f"### {s}: {v.link}\n\n{v._repr_markdown_()}"
                                                   for s, v in results) + '\n')
    print(f"wrote {out}/validation.json and validation.md")


def remodel(out):
    "The layout model's step of every multi-rank row again, from the node measured there; the rest as it was"
    from dtnb.bench.validate import Validation, layout_model
    from dtnb.plan.memory import TransformerShape
    from dtnb.plan.recommend import Node
    from dtnb.parallel.parallelize import Degrees
    results = []
    for d in json.loads((out / 'validation.json').read_text()):
        shape = TransformerShape(**d['shape'])
        for r in d['rows']:
            if r['node'] is None: continue  # one process: the model's calibration, no link
            degrees = {k: v for k, v in r['degrees'].items() if k != 'enabled'}
            r['model_parts'] = layout_model(shape, r['layout'], Degrees(**degrees), Node(**r['node']))
            r['model'] = sum(r['model_parts'].values()); r['model_error'] = r['model'] / r['measured'] - 1
        results.append((d['size'], Validation(shape, d['link'], d['rows'], d['machine'], d['skipped'])))
        print(f"\n{d['size']}: {results[-1][1]}")
    write(out, results)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--worker', action='store_true'); ap.add_argument('--job')
    ap.add_argument('--sizes', default='small,base'); ap.add_argument('--ranks', default='1,2,4')
    ap.add_argument('--links', action='store_true', help="also across namespace hosts (root): 1 Gbit/s, 100 Mbit/s")
    ap.add_argument('--steps', type=int, default=8); ap.add_argument('--seconds', type=float, default=4.0)
    ap.add_argument('--out', help="folder for validation.json and validation.md")
    ap.add_argument('--remodel', action='store_true', help="only recompute the layout model's column of --out's "
                    "validation.json from the links measured there (after a change to step_parts)")
    a = ap.parse_args()
    if a.worker: return worker(a)
    if a.remodel: return remodel(Path(a.out))
    import warnings; warnings.filterwarnings('ignore')
    from dataclasses import replace
    from dtnb.bench.validate import validate, assemble, Validation, DEFAULT_LAYOUTS, _one_process, shape_model
    from dtnb.plan.recommend import colwise_per_layer
    from dtnb.launcher.processes import launch
    from dtnb.plan.memory import TransformerShape
    results, t0 = [], time.time()
    for size in a.sizes.split(','):
        shape = TransformerShape(**SIZES[size])
        v = validate(shape, [int(r) for r in a.ranks.split(',')], steps=a.steps, seconds=a.seconds)
        results.append((size, v)); print(f"\n{size}: {v}  [{time.time() - t0:.0f} s]", flush=True)
    if a.links:
        from cluster import Cluster, cluster_unavailable
        if (why := cluster_unavailable()): sys.exit(f"bench_step_model --links: {why}")
        import tempfile
        with Cluster(2) as c, tempfile.TemporaryDirectory() as tmp:
            for size in a.sizes.split(','):
                shape, names = TransformerShape(**SIZES[size]), DEFAULT_LAYOUTS[2]
                shape = replace(shape, colwise=colwise_per_layer(shape_model(shape)))  # as validate() counts them
                one = launch(_one_process, shape, names, 2, a.steps, nprocs=1, threads=1, device='cpu')[0]
                for link, rate in LINKS:
                    steps = a.steps if rate != '100mbit' else max(4, a.steps // 2)
                    rows = assemble(shape, 2, names, one, over_link(c, rate, shape, names, one, steps, a.seconds, tmp))
                    v = Validation(shape, link, rows); results.append((size, v))
                    print(f"\n{size}: {v}  [{time.time() - t0:.0f} s]", flush=True)
    if a.out: write(Path(a.out), results)


if __name__ == '__main__': main()
