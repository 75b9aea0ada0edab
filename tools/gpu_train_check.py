"""The training path on one GPU, through dtnb's public names: `fit` in `bf16-mixed` beside `fp32`, and
`find_batch_size`'s trying path (real steps until the device runs out of memory, the error caught). The last step of
tools/gpu_check.sh, run when time is left.

    python tools/gpu_train_check.py [--out FILE.json] [--device cpu]

On a GPU both run there. `--device cpu` (tools/gpu_check.sh --dry-run) runs the same `fit` calls on the CPU, and
find_batch_size's estimate against a memory budget (trying needs an accelerator): no GPU figure. Exit 1 when a check
failed; each check's result is written to --out as soon as it is known.
"""
import argparse, json, sys, time
from pathlib import Path
from gpu_checks import run_check  # tools/: one named check, timed, its failure kept
import torch
import torch.nn.functional as F
import dtnb


def fit_bf16(device):
    "fp32 and bf16-mixed `fit` of the same model and data: both learn, the parameters stay fp32 on `device`"
    out = {}
    for precision in ('fp32', 'bf16-mixed'):
        torch.manual_seed(0)
        m = dtnb.ToyModel()
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        loader = torch.utils.data.DataLoader(dtnb.toy_data(512), batch_size=32)
        t0 = time.perf_counter()
        r = dtnb.fit(m, loader, opt, epochs=2, precision=precision, progress=False)
        p = next(m.parameters())
        out[precision] = dict(first=r.losses[0], last=r.losses[-1], steps=r.steps, seconds=time.perf_counter() - t0,
                              param_device=p.device.type, param_dtype=str(p.dtype))
        assert p.device.type == device, f"{precision}: parameters on {p.device}, not {device}"
        assert p.dtype == torch.float32, f"{precision}: parameters in {p.dtype}: mixed precision keeps them fp32"
        assert r.losses[-1] < r.losses[0] / 2, f"{precision}: the loss went {r.losses[0]} -> {r.losses[-1]}"
    gap = abs(out['bf16-mixed']['last'] - out['fp32']['last']) / out['fp32']['last']
    out['relative_gap_last_loss'] = gap
    assert gap < 0.2, f"bf16-mixed ends {gap:.0%} away from fp32: {out}"
    return out


def batch_size_tried(device):
    "find_batch_size by trying: on a GPU with a memory fraction that makes it run out quickly; on the CPU a budget"
    big, xy = dtnb.ToyModel(d_in=1024, d=512, depth=4, d_out=10), (torch.randn(1, 1024), torch.tensor([1]))
    if device == 'cuda':
        for amp in (False, True):  # cuBLAS's workspaces (one per thread) exist from here on, for the process's life
            with torch.autocast('cuda', torch.bfloat16, enabled=amp):
                torch.nn.Linear(8, 8, device='cuda')(torch.randn(2, 8, device='cuda')).sum().backward()
        torch.cuda.synchronize(); base = torch.cuda.memory_allocated()
        torch.cuda.set_per_process_memory_fraction(0.05)  # a few GB: the steps that fill it are quick
        try: r = dtnb.find_batch_size(big, xy, loss_fn=F.cross_entropy, precision='bf16-mixed', method='try',
                                      max_batch=2**22)
        finally: torch.cuda.set_per_process_memory_fraction(1.0)
        assert any(b is None for _, b, _ in r.checks), r  # it ran out of memory at least once, and went on
        left = torch.cuda.memory_allocated() - base
        assert left < 2**20, (base, left)  # the failed steps left nothing behind
    else:  # trying needs an accelerator (on a CPU running out of memory kills the process): the estimate instead
        r = dtnb.find_batch_size(big, xy, loss_fn=F.cross_entropy, precision='bf16-mixed', method='estimate',
                                 memory='1GB', max_batch=4096)
    assert r.method == ('tried' if device == 'cuda' else 'estimate') and r.batch_size > 0, r
    return dict(method=r.method, batch_size=r.batch_size, next_batch=r.next_batch, bytes=r.bytes, checks=len(r.checks),
                budget_source=r.budget_source)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--out', default='gpu_train_check.json')
    ap.add_argument('--device', default='cuda', choices=('cuda', 'cpu'))
    a = ap.parse_args(argv)
    if a.device == 'cuda' and not torch.cuda.is_available():
        print("gpu_train_check: no CUDA device here: nothing run (`--device cpu` checks the logic)"); return 0
    if a.device == 'cpu':
        import os; os.environ['DTNB_DEVICE'] = 'cpu'; torch.set_num_threads(1)
    results, failed = dict(device=a.device, torch=torch.__version__, checks={}), False
    for name, check in (('fit_bf16_mixed', fit_bf16), ('find_batch_size', batch_size_tried)):
        failed |= not run_check(name, lambda: check(a.device), results['checks'])['passed']
        Path(a.out).write_text(json.dumps(results, indent=1, default=str))
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
