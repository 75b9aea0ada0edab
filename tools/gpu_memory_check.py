"""Peak memory, estimated and measured, through dtnb's public names: `estimate_memory`'s total beside the peak one real
step reaches (`measure_memory`: `torch.cuda.max_memory_allocated`, reset before each step) for one GPU, FSDP on 2
ranks (`placement('shared')`: both on the one GPU where there is one, over gloo), activation checkpointing and
bf16-mixed, each on a GPT at two sizes; the goal is within 10% (each error is printed, none fails the step; FSDP's
ranks on one GPU talk over gloo, whose reduce-scatter of CUDA tensors is a full all-reduce of a copy staged through
the host: its peak carries that copy, which NCCL would not make). Then
`find_batch_size`'s estimate beside the batch it finds by trying, under the same budget. Step `memory` of
tools/gpu_check.sh.

    python tools/gpu_memory_check.py [--out FILE.json] [--device cpu]

`--device cpu` (tools/gpu_check.sh --dry-run): a CPU has no peak counter, so only the model states (parameters,
gradients, optimizer state: storage bytes after a real step) are measured, and they must equal the estimate byte for
byte; peaks are marked not measurable, and find_batch_size only estimates (trying needs an accelerator). Exit 1 when
a check failed; results go to --out as soon as known, with a `headline`.
"""
import argparse, json, sys
from pathlib import Path
from gpu_checks import run_check  # tools/: one named check, timed, its failure kept
import torch
import torch.nn.functional as F
import dtnb
from dtnb.core.models import GPT  # not exported at the top: the Korthikanti layer stack the memory notebooks use

SIZES = dict(cuda=dict(small=(2, 256, 4, 128, 8), large=(4, 1024, 16, 512, 8)),  # layers, hidden, heads, seq, batch
             cpu=dict(small=(2, 32, 4, 16, 2), large=(2, 64, 4, 32, 2)))
SETUPS = dict(single=dict(strategy='single'), fsdp=dict(strategy='zero3', world_size=2),
              checkpointing=dict(strategy='single', activation_checkpointing=True),
              bf16_mixed=dict(strategy='single', precision='bf16-mixed'))


def gpt(L, h, a, ac=False):
    torch.manual_seed(0)
    return GPT(L, h, a, activation_checkpointing=ac)


def one(size, setup, device):
    "The estimate and the measurement of one setup at one size"
    L, h, a, s, b = SIZES[device][size]
    kw = dict(SETUPS[setup]); ac = kw.pop('activation_checkpointing', False)
    kw.setdefault('precision', 'fp32'); kw.setdefault('world_size', 1)
    batch = (torch.randn(s, b, h), torch.randn(s, b, h))
    est = dtnb.estimate_memory(gpt(L, h, a), batch=batch, loss_fn=F.mse_loss, activation_checkpointing=ac, **kw)
    with dtnb.placement('shared' if device == 'cuda' else 'cpu'):  # fsdp's 2 ranks: on the one GPU, or CPU ranks
        m = dtnb.measure_memory(gpt(L, h, a, ac), batch, loss_fn=F.mse_loss, **kw)
    got = m.measured[0]
    states = got['parameters'] + got['gradients'] + got['optimizer_states']
    out = dict(params=est.params, estimated_total=est.total, estimated_states=est.model_states,
               estimated_activations=est.activations, measured_states=states, measured_peak=got['peak'],
               measured_activations=got['activations'] if device == 'cuda' else None)
    assert states == est.model_states, f"model states measured {states:,} B, estimated {est.model_states:,} B"
    if got['peak'] is None: out['peak'] = 'not measurable on the CPU (no peak counter)'
    else: out['error'] = round(est.total / got['peak'] - 1, 4)
    return out


def batch_size(device):
    "find_batch_size's estimate and, on a GPU, what trying finds, under one budget"
    L, h, a, s, _ = SIZES[device]['small']
    budget = '2GB' if device == 'cuda' else '64MB'
    model = dtnb.TinyTransformer(d_in=h, d=h, depth=L)  # (batch, seq, d) inputs, as find_batch_size stacks samples
    def bs(method):
        return dtnb.find_batch_size(model, (torch.randn(1, s, h), torch.randn(1, s, 4)), loss_fn=F.mse_loss,
                                    memory=budget, method=method, precision='fp32', max_batch=4096)
    e = bs('estimate')
    out = dict(budget=budget, estimated=e.batch_size, estimated_bytes=e.bytes)
    if device == 'cuda':
        t = bs('try')
        out.update(tried=t.batch_size, tried_bytes=t.bytes, error=round(e.batch_size / max(t.batch_size, 1) - 1, 4))
    else: out['tried'] = 'not measurable on the CPU (trying needs an accelerator)'
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--out', default='memory.json')
    ap.add_argument('--device', default='cuda', choices=('cuda', 'cpu'))
    a = ap.parse_args(argv)
    if a.device == 'cuda' and not torch.cuda.device_count():
        print("gpu_memory_check: no CUDA device here: nothing run (`--device cpu` checks the logic)"); return 0
    if a.device == 'cpu': torch.set_num_threads(1)
    out, failed, head = dict(device=a.device, torch=torch.__version__, sizes=SIZES[a.device], checks={}), [], {}
    checks = [(f'{size}_{setup}', lambda size=size, setup=setup: one(size, setup, a.device))
              for size in ('small', 'large') for setup in SETUPS] + [('find_batch_size', lambda: batch_size(a.device))]
    for name, fn in checks:
        res = run_check(name, fn, out['checks'], error_key='error_text')  # 'error': an estimate's, a figure
        if not res['passed']: failed.append(name)
        if name == 'find_batch_size': head[name] = {k: res.get(k) for k in ('estimated', 'tried', 'error')}
        else: head[name] = res.get('error', 'states exact' if res['passed'] else 'FAILED')
        out['headline'] = dict(head, within_10pct=[k for k, v in head.items() if isinstance(v, float) and abs(v) <= .1],
                               passed=not failed, failed=failed)
        Path(a.out).write_text(json.dumps(out, indent=1, default=str))
    print("memory check:", "FAILED " + ', '.join(failed) if failed else "passed")
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
