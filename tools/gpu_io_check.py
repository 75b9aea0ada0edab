"""Input and output on a GPU, through dtnb's public names: `save_checkpoint` and its verified `load_checkpoint` of a
model and AdamW state held on the GPU, timed against `torch.distributed.checkpoint`'s `dcp.save` / `dcp.load` of the
same state (interleaved pairs, the median ratio; the state loaded back must equal what was saved); then `input_bound`'s
verdict on a real GPU step fed from a slow loader (samples that wait, as I/O does) and from a fast one (samples in
memory), both with pinned memory, beside `profile_loader`'s figures for each loader alone: the slow one must be judged
input-bound, the fast one not. Step `io` of tools/gpu_check.sh.

    python tools/gpu_io_check.py [--out FILE.json] [--device cpu] [--dir TMP]

`--device cpu` (tools/gpu_check.sh --dry-run): the same on the CPU with a smaller model, without pinned memory (there
is no device to pin for). Exit 1 when a check failed; results go to --out as soon as known, with a `headline`.
"""
import argparse, json, shutil, statistics, sys, tempfile, time
from pathlib import Path
from gpu_checks import run_check  # tools/: one named check, timed, its failure kept
import torch
import torch.nn.functional as F
import dtnb
from dtnb.core.utils import synchronize  # waits for the device before a clock is read (a no-op on the CPU)
from dtnb.train.checkpoint import state_dicts  # the (model, optimizer) state dicts save_checkpoint hands to DCP

SIZE = dict(cuda=dict(d=1024, depth=6, repeats=3), cpu=dict(d=256, depth=4, repeats=2))


def checkpoints(device, root, repeats):
    import torch.distributed.checkpoint as dcp
    s = SIZE[device]
    model = dtnb.ToyModel(d_in=256, d=s['d'], depth=s['depth'], d_out=8).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 256, device=device)).pow(2).mean().backward(); opt.step()  # optimizer state exists
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sd = state_dicts(model, opt)[0]
    def pair(a, b):  # interleaved, the order alternating: medians of each and of the ratio a / b
        ta, tb = [], []
        for i in range(repeats):
            for f, out in ((a, ta), (b, tb))[::(1 if i % 2 else -1)]:
                synchronize(device); t = time.perf_counter(); f(i); synchronize(device)
                out.append(time.perf_counter() - t)
        return statistics.median(ta), statistics.median(tb), statistics.median(x / y for x, y in zip(ta, tb))
    out = dict(bytes=sum(t.numel() * t.element_size() for t in sd['model'].values()) if 'model' in sd else None)
    out['save_s'], out['dcp_save_s'], out['save_ratio'] = pair(
        lambda i: dtnb.save_checkpoint(dtnb.checkpoint_path(root / 'dtnb', i), model, opt, step=i),
        lambda i: dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(root / f'dcp_{i}'))))
    with torch.no_grad():
        for p in model.parameters(): p.zero_()  # what a load must put back
    last = dtnb.checkpoint_path(root / 'dtnb', repeats - 1)
    out['load_verified_s'], out['dcp_load_s'], out['load_ratio'] = pair(
        lambda i: dtnb.load_checkpoint(last, model, opt),
        lambda i: dcp.load(sd, storage_reader=dcp.FileSystemReader(str(root / f'dcp_{repeats - 1}'))))
    bad = [k for k, v in model.state_dict().items() if not torch.equal(v, saved[k])]
    assert not bad, f"loaded state differs from the saved one in {bad[:3]}"
    assert all(t.device.type == device for t in model.state_dict().values())
    return out


def verdicts(device):
    "input_bound on a real step fed from a slow and a fast loader; the slow one must be input-bound, the fast one not"
    # the fast loader's batch must come well inside a step on any machine, or its verdict would be the machine's: a GPU
    # step of about 6 ms (batch 256, 4 blocks 8192 wide, fp32) against 4 workers' collate and pinning of 3 MB; on a CPU
    # one of about 50 ms (64 samples, 512 wide) against collating 0.8 MB in-process. slow: 64 ms of waiting a batch
    gpu = device == 'cuda'
    b, n, cost, workers = (256, 24, 0.25, 4) if gpu else (64, 24, 1.0, 0)
    model = dtnb.ToyModel(d_in=3 * 32 * 32, d=8192 if gpu else 512, depth=4, d_out=10).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    def step(batch):
        x, y = batch
        F.cross_entropy(model(x.flatten(1)), y).backward(); opt.step(); opt.zero_grad()
    loaders = dict(slow=dtnb.SyntheticDataset(n=b * (n + 8), cost_ms=cost, mode='sleep'),
                   fast=dtnb.SyntheticDataset(n=b * (n + 8), mode='memory'))
    out = {}
    for name, ds in loaders.items():
        dl = torch.utils.data.DataLoader(ds, batch_size=b, pin_memory=gpu, num_workers=workers)
        lp = dtnb.profile_loader(dl, n_batches=8, progress=False)
        sp = dtnb.input_bound(step, dl, n_steps=n, device=device, progress=False)
        out[name] = dict(input_bound=sp.input_bound, data_fraction=sp.fraction('data'), step_s=sp.step_s,
                         verdict=sp.verdict, loader_batches_s=lp.batches_per_s, pinned=dl.pin_memory)
    assert out['slow']['input_bound'] and not out['fast']['input_bound'], out
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--out', default='io.json'); ap.add_argument('--device', default='cuda', choices=('cuda', 'cpu'))
    ap.add_argument('--dir', default=None)
    a = ap.parse_args(argv)
    if a.device == 'cuda' and not torch.cuda.device_count():
        print("gpu_io_check: no CUDA device here: nothing run (`--device cpu` checks the logic)"); return 0
    if a.device == 'cpu': import os; os.environ['DTNB_DEVICE'] = 'cpu'; torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix='dtnb-io-', dir=a.dir))
    out, failed = dict(device=a.device, torch=torch.__version__, size=SIZE[a.device], checks={}), []
    try:
        for name, fn in (('checkpoint', lambda: checkpoints(a.device, root, SIZE[a.device]['repeats'])),
                         ('input_bound', lambda: verdicts(a.device))):
            if not run_check(name, fn, out['checks'], show=800)['passed']: failed.append(name)
            c, v = out['checks'].get('checkpoint', {}), out['checks'].get('input_bound', {})
            out['headline'] = dict(save_ratio=c.get('save_ratio'), load_ratio=c.get('load_ratio'),
                                   slow_input_bound=v.get('slow', {}).get('input_bound'),
                                   fast_input_bound=v.get('fast', {}).get('input_bound'), passed=not failed,
                                   failed=failed)
            Path(a.out).write_text(json.dumps(out, indent=1, default=str))
    finally: shutil.rmtree(root, ignore_errors=True)
    print("io check:", "FAILED " + ', '.join(failed) if failed else "passed")
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
