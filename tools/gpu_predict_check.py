"""The step times the GPU check's benchmark is about to measure, predicted before it runs: step `predict` of
tools/gpu_check.sh. The models are benchmarks/gpu_bench.py's own (its `config()`): the MFU GPT of the quick and of the
full configuration (forward, `mean` loss, backward, SGD, bf16 autocast) and the GPT of the one-GPU DDP/FSDP step
(AdamW, `pow(2).mean()` loss). Each is traced on meta tensors (`trace_step`: nothing allocated) and predicted three
ways, each written to --out as soon as known:

  datasheet  `op_seconds` with the device's datasheet row alone (none for a device the table lacks: said so)
  curves     `op_seconds` with the device's measured curves (`CURVES`; none yet for a new device: said so, and this
             run's gpu_bench.json adds them through `load_curves`)
  sampled    `sample_ops` on the device here: each distinct op replayed and timed (on a GPU, the op times alone: the
             host's work overlaps them; on a CPU plus `per_op_cost()` per op)

    python tools/gpu_predict_check.py [--out predict.json] [--device cpu]
    python tools/gpu_predict_check.py --compare predict.json gpu_bench.json

--compare (gpu_check.sh runs it once gpu_bench.json exists) sets the measured step of each model beside its predictions,
with the error of each, under 'compare' in predict.json; it reads JSON only. `--device cpu` (the dry run) predicts the
CPU configuration on the CPU, one thread, as gpu_bench.py --device cpu measures it. Exit 1 when a prediction failed.
"""
import argparse, json, sys, traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def bench_models(device):
    "name -> (GPT config, optimizer, loss, amp) of the steps gpu_bench.py measures on `device`"
    sys.path.insert(0, str(ROOT / 'benchmarks'))
    from gpu_bench import config
    quick, full = config(device, True), config(device, False)
    out = {'mfu quick': (quick['gpt'], 'sgd', 'mean', quick['amp'])}
    if full['gpt'] != quick['gpt']: out['mfu full'] = (full['gpt'], 'sgd', 'mean', full['amp'])
    out['step'] = (quick['step_gpt'], 'adamw', 'pow', quick['amp'])
    return out


def trace(g, optimizer, loss, amp, policy):
    "The meta trace of one step of gpu_bench's GPT `g`"
    import torch
    from dtnb.bench.ops import trace_step
    from dtnb.core.models import GPT
    with torch.device('meta'): model, x = GPT(g['L'], g['h'], g['a']), torch.randn(g['s'], g['b'], g['h'])
    fn = (lambda out, y: out.float().pow(2).mean()) if loss == 'pow' else None
    return trace_step(model, x, fn, optimizer=optimizer, amp=amp, policy=policy)


def this_device(device):
    "(the device table's name or None, the name torch gives) of `device`"
    import torch
    from dtnb.core.specs import peak_tflops
    if device.type != 'cuda': return None, 'CPU'
    name = torch.cuda.get_device_name(device)
    src = peak_tflops(name)[1]
    return (src.split(':')[0] if src else None), name


def predict(args):
    import torch
    from dtnb.bench.ops import CURVES, op_seconds, per_op_cost, sample_ops
    from dtnb.core.specs import device_spec
    device = torch.device(args.device or ('cuda' if torch.cuda.is_available() else 'cpu'))
    if device.type == 'cpu': torch.set_num_threads(1)  # as gpu_bench.py --device cpu measures
    label, name = this_device(device)
    out = dict(torch=torch.__version__, device=name, table_name=label, models={}, notes=[])
    if label is None: out['notes'].append(f"{name}: not in dtnb's device table, so no datasheet prediction")
    elif label not in CURVES:
        out['notes'].append(f"{label}: no measured curves yet, datasheet only; this run's gpu_bench.json adds them "
                            "(dtnb.bench.ops.load_curves)")
    save = lambda: Path(args.out).write_text(json.dumps(out, indent=1))
    models, failed = bench_models(device), []
    traces = {}
    for key, (g, opt, loss, amp) in models.items():
        r = out['models'][key] = dict(gpt=g, optimizer=opt, loss=loss, amp=amp)
        try:
            t = traces[key] = trace(g, opt, loss, amp, 'cuda' if device.type == 'cuda' else 'cpu')
            r.update(flops=t.flops, ops=sum(o.kind != 'free' for o in t.ops))
            if label: r['datasheet_ms'] = op_seconds(t, device_spec(label)).total * 1e3
            if label in CURVES: r['curves_ms'] = op_seconds(t, label).total * 1e3
        except Exception: failed.append(key); r['error'] = traceback.format_exc()
        save()
    per_op = per_op_cost() if device.type == 'cpu' else 0.0
    out['per_op_us'] = per_op * 1e6
    for key, t in traces.items():  # the slowest part last: whatever it reached is kept
        try:
            s = sample_ops(t, device, per_op=per_op)
            out['models'][key].update(sampled_ms=s.total * 1e3, sampled=s.source)
        except Exception: failed.append(key); out['models'][key]['sampled_error'] = traceback.format_exc()
        save()
        print(key, json.dumps({k: v for k, v in out['models'][key].items() if k.endswith('_ms')}), flush=True)
    for n in out['notes']: print('note:', n)
    return 1 if failed else 0


def measured(key, model, bench):
    "(what, seconds) gpu_bench measured for the model `key`, from its gpu_bench.json; [] where it did not run it"
    sec, cfg = bench.get('sections', {}), bench.get('config', {})
    if key.startswith('mfu') and cfg.get('gpt') == model['gpt'] and 'rows' in sec.get('mfu', {}):
        return [('bench_model step', sec['mfu']['rows'][0]['step_ms'] / 1e3)]
    if key == 'step' and cfg.get('step_gpt') == model['gpt'] and 'rows' in sec.get('step', {}):
        return [(f"{r['strategy']} step", 1 / r['dtnb_steps_s']) for r in sec['step']['rows']]
    return []


def compare(pred_path, bench_path):
    "Measured beside predicted, for each model gpu_bench ran, into predict.json's 'compare'"
    pred, bench = json.loads(Path(pred_path).read_text()), json.loads(Path(bench_path).read_text())
    rows = []
    for key, m in pred['models'].items():
        for what, s in measured(key, m, bench):
            row = dict(model=key, measured=what, measured_ms=s * 1e3)
            for how in ('datasheet', 'curves', 'sampled'):
                if f'{how}_ms' in m:
                    row[f'{how}_ms'] = m[f'{how}_ms']; row[f'{how}_error'] = m[f'{how}_ms'] / (s * 1e3) - 1
            rows.append(row)
    pred['compare'] = rows
    Path(pred_path).write_text(json.dumps(pred, indent=1))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--out', default='predict.json')
    ap.add_argument('--device', default=None, help="'cpu' for the dry run; default the GPU, else the CPU")
    ap.add_argument('--compare', nargs=2, metavar=('PREDICT_JSON', 'GPU_BENCH_JSON'))
    args = ap.parse_args()
    if args.compare:
        for r in compare(*args.compare): print(json.dumps(r))
        return 0
    return predict(args)


if __name__ == '__main__':
    sys.exit(main())
