"""The operator-level step model (`dtnb.bench.ops`) against the one GPU measurement we own, the H200 run in
benchmarks/results/2026-11-28-h200: its 2-layer MFU GPT predicted from the device's curves within 10% of the step the
file records (read from the file, not copied here). The curves' memory-bound fraction is fitted on the file's other
step (the one-GPU DDP step of a 4-layer GPT with AdamW), so the 2-layer step is a prediction, not a fit.

Everything is traced on meta tensors in this process: no ranks, no device, no time measured here. The op lists are
torch's own decompositions, which differ between torch builds: the file is in conftest's BUILDS."""
import json, subprocess, sys
from pathlib import Path
import torch
from dtnb.bench.ops import CURVES, H200_FILE, load_curves, op_seconds, trace_step
from dtnb.core.models import GPT
from dtnb.core.specs import device_spec

ROOT = Path(__file__).resolve().parent.parent
RUN = json.loads((ROOT / H200_FILE).read_text())


def _trace(g, optimizer, loss_fn=None):
    "The meta trace of one bf16 step of gpu_bench's GPT config `g`"
    with torch.device('meta'): model, x = GPT(g['L'], g['h'], g['a']), torch.randn(g['s'], g['b'], g['h'])
    return trace_step(model, x, loss_fn, optimizer=optimizer, amp=RUN['config']['amp'])


def test_h200_two_layer_gpt_from_its_curves_within_10_percent():
    measured = RUN['sections']['mfu']['rows'][0]['step_ms'] / 1e3
    t = _trace(RUN['config']['gpt'], 'sgd')
    assert t.flops == RUN['sections']['mfu']['summary']['flops_counted']  # the same model and batch as measured
    curves, sheet = op_seconds(t, 'H200'), op_seconds(t, device_spec('H200'))
    error = curves.total / measured - 1
    print(f"H200 GPT(2, 4096, 32): curves {curves.total * 1e3:.1f} ms, datasheet {sheet.total * 1e3:.1f} ms, "
          f"measured {measured * 1e3:.1f} ms: {error:+.1%}")
    assert abs(error) <= 0.10, (curves.parts, measured)
    assert sheet.total < measured  # the datasheet alone misses the memory-bound ops' slowness: fast


def test_the_curves_are_the_committed_files_and_fit_the_other_step():
    c = load_curves(ROOT / H200_FILE)
    ref = CURVES[c.device]
    assert c.device == 'H200 SXM' and c.fingerprint['driver'] == ref.fingerprint['driver']
    for k, pts in ref.matmul.items():
        assert [n for n, _ in c.matmul[k]] == [n for n, _ in pts]
        assert all(abs(a - b) < 0.06 for (_, a), (_, b) in zip(c.matmul[k], pts)), k
    assert abs(c.memory_fraction - ref.memory_fraction) < 0.002
    ddp = 1 / RUN['sections']['step']['rows'][0]['dtnb_steps_s']
    t = _trace(RUN['config']['step_gpt'], 'adamw', lambda out, y: out.float().pow(2).mean())
    assert abs(op_seconds(t, c).total / ddp - 1) < 0.01  # the fit's own step, by construction


def test_gpu_check_compare_sets_the_measured_steps_beside_the_predicted(tmp_path):
    "tools/gpu_predict_check.py --compare on the H200 file, from a predict.json as the predict step writes it"
    g = RUN['config']['gpt']
    pred = dict(models={'mfu quick': dict(gpt=g, datasheet_ms=28.0, curves_ms=35.0),
                        'mfu full': dict(gpt=dict(g, L=4), datasheet_ms=56.0),
                        'step': dict(gpt=RUN['config']['step_gpt'], curves_ms=24.0)})
    p = tmp_path / 'predict.json'; p.write_text(json.dumps(pred))
    subprocess.run([sys.executable, ROOT / 'tools/gpu_predict_check.py', '--compare', p, ROOT / H200_FILE], check=True)
    rows = json.loads(p.read_text())['compare']
    assert [(r['model'], r['measured']) for r in rows] == [('mfu quick', 'bench_model step'), ('step', 'ddp step'),
                                                          ('step', 'fsdp step')]  # the full config was not run
    mfu = RUN['sections']['mfu']['rows'][0]['step_ms']
    assert abs(rows[0]['curves_error'] - (35.0 / mfu - 1)) < 1e-12 and 'datasheet_error' in rows[0]
