"""Two ranks on a GPU, through dtnb's public names: `launch(..., device='shared')` puts both ranks on the one GPU
(NCCL refuses two ranks on one device, so they talk over gloo, which stages CUDA tensors through host memory). First
which collectives gloo runs on CUDA tensors (the ones FSDP2 and tensor parallelism need among them), then `wrap`
ddp / zero2 / fsdp and `parallelize(model, Degrees(tp=2))` on a small transformer, each against one process on the
same device: the parameters after a few SGD steps must agree. Where 2 or more GPUs are present, the same on NCCL with
one GPU per rank. Step `ranks` of tools/gpu_check.sh.

    python tools/gpu_ranks_check.py [--out FILE.json] [--device cpu] [--steps K]

The model is `dtnb.TinyTransformer` (no dropout: dtnb's `GPT` drops out on every call, so no two runs could agree).
`--device cpu` (tools/gpu_check.sh --dry-run) runs the same with `device='shared'` on a machine without a GPU, which
means CPU ranks on gloo. Exit 1 when a check failed; results are written to --out as soon as known, with a `headline`.
"""
import argparse, json, sys, time, traceback
from pathlib import Path
import torch
import dtnb

TOL = dict(cpu=1e-5, cuda=2e-4)  # fp32 (TF32 off): the ranks' reductions add in another order than one process's
B, S, D = 8, 16, 32  # batch, sequence, width: a few milliseconds a step on either device


def probe_collectives():
    "Each collective on this rank's device: 'ok', 'wrong result', or torch's refusal (its first line)"
    import torch.distributed as dist
    r, w, dev = dist.get_rank(), dist.get_world_size(), dtnb.current_device()
    x = lambda *s: torch.full(s, float(r + 1), device=dev)
    total = w * (w + 1) / 2
    def all_gather_into_tensor():
        out = torch.empty(w * 2, device=dev); dist.all_gather_into_tensor(out, x(2))
        return out.tolist() == [float(i + 1) for i in range(w) for _ in range(2)]
    def reduce_scatter_tensor():
        out = torch.empty(2, device=dev); dist.reduce_scatter_tensor(out, x(2 * w))
        return out.tolist() == [total] * 2
    def all_gather():
        out = [torch.empty(2, device=dev) for _ in range(w)]; dist.all_gather(out, x(2))
        return [t[0].item() for t in out] == [float(i + 1) for i in range(w)]
    def reduce_scatter():
        out = torch.empty(2, device=dev); dist.reduce_scatter(out, [x(2) for _ in range(w)])
        return out.tolist() == [total] * 2
    def all_to_all_single():
        out = torch.empty(w, device=dev); dist.all_to_all_single(out, x(w))
        return out.tolist() == [float(i + 1) for i in range(w)]
    def all_reduce(): t = x(2); dist.all_reduce(t); return t.tolist() == [total] * 2
    def broadcast(): t = x(2); dist.broadcast(t, 0); return t.tolist() == [1.0] * 2
    def reduce(): t = x(2); dist.reduce(t, 0); return r != 0 or t.tolist() == [total] * 2
    res = {}
    for f in (all_reduce, broadcast, all_gather_into_tensor, reduce_scatter_tensor, all_gather, reduce_scatter,
              all_to_all_single, reduce):
        try: res[f.__name__] = 'ok' if f() else 'wrong result'
        except Exception as e: res[f.__name__] = f"refused: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        dist.barrier()
    return dict(backend=dist.get_backend(), device=str(dev), collectives=res)


def probe_send_recv():
    """Point to point (what pipeline stages use): gloo's send/recv hand the tensor's pointer to gloo as it is, with no
    host staging for CUDA tensors in the sources read; run apart, last, so that a crash loses nothing else"""
    import torch.distributed as dist
    r, dev = dist.get_rank(), dtnb.current_device()
    t = torch.full((4,), float(r + 1), device=dev)
    try:
        if r == 0: dist.send(t, 1)
        else: dist.recv(t, 0)
        dist.barrier()
        return dict(device=str(dev), send_recv='ok' if t.tolist() == [1.0] * 4 else 'wrong result')
    except Exception as e: return dict(device=str(dev), send_recv=f"refused: {type(e).__name__}: {str(e)[:200]}")


def _data(k):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(B, S, D, generator=g), torch.randn(B, S, 4, generator=g)) for _ in range(k)]


def _full(t): return t.full_tensor() if hasattr(t, 'full_tensor') else t


def _train(model, batches, dev):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(model(x.to(dev)), y.to(dev))
        loss.backward(); opt.step(); opt.zero_grad()
    return {n.removeprefix('module.').replace('_checkpoint_wrapped_module.', ''): _full(p).detach().cpu()
            for n, p in model.named_parameters()}


def strategies(k):
    "Each strategy's parameters after `k` steps against one process's on this rank's device: the largest gap"
    import torch.distributed as dist
    torch.backends.cuda.matmul.allow_tf32 = False; torch.backends.cudnn.allow_tf32 = False
    r, w, dev = dist.get_rank(), dist.get_world_size(), dtnb.current_device()
    batches = _data(k)
    start = {n: p.detach().clone() for n, p in dtnb.TinyTransformer(d_in=D, d=D).named_parameters()}
    ref = _train(dtnb.TinyTransformer(d_in=D, d=D).to(dev), batches, dev)  # one process, the whole batch
    moved = max((ref[n] - start[n]).abs().max().item() for n in ref)  # what a gap is measured against
    mine = [(x.chunk(w)[r], y.chunk(w)[r]) for x, y in batches]  # data parallel: this rank's share of each batch
    out = {}
    for name in ('ddp', 'zero2', 'fsdp', 'tp'):
        t0 = time.perf_counter()
        try:
            m = dtnb.TinyTransformer(d_in=D, d=D)
            if name == 'tp': got = _train(dtnb.parallelize(m, dtnb.Degrees(tp=w)), batches, dev)  # tp: whole batch
            else: got = _train(dtnb.wrap(m.to(dev), name), mine, dev)
            missing = sorted(set(ref) ^ set(got))
            gap = max((got[n] - ref[n]).abs().max().item() for n in ref if n in got)
            out[name] = dict(max_gap=gap, missing=missing, seconds=round(time.perf_counter() - t0, 3))
        except Exception as e:
            out[name] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
                             traceback=traceback.format_exc())
        dist.barrier()
    mem = torch.cuda.max_memory_allocated(dev) if dev.type == 'cuda' else None
    return dict(backend=dist.get_backend(), device=str(dev), strategies=out, peak_bytes=mem, moved=moved)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--out', default='ranks.json'); ap.add_argument('--device', default='cuda', choices=('cuda', 'cpu'))
    ap.add_argument('--steps', type=int, default=3)
    a = ap.parse_args(argv)
    gpus = torch.cuda.device_count() if a.device == 'cuda' else 0  # NVML: CUDA stays uninitialised for the forks
    if a.device == 'cuda' and not gpus:
        print("gpu_ranks_check: no CUDA device here: nothing run (`--device cpu` checks the logic)"); return 0
    runs = [('shared', dict(device='shared'))]  # 2 ranks on cuda:0 (gloo); on a CPU machine, CPU ranks (gloo)
    if gpus >= 2: runs.append(('nccl', dict(backend='nccl')))  # one GPU each
    out, failed = dict(device=a.device, gpus=gpus, torch=torch.__version__, steps=a.steps, tolerance=TOL[a.device]), []
    save = lambda: Path(a.out).write_text(json.dumps(out, indent=1, default=str))
    def p2p(run, kw):  # a finding, not a failure: pipelines over gloo on a GPU need it
        try: res = [r['send_recv'] for r in dtnb.launch(probe_send_recv, nprocs=2, timeout=60, **kw)]
        except Exception as e: res = [f"the ranks failed: {type(e).__name__}: {str(e)[:300]}"]
        out[run]['send_recv'] = res; save(); print(run, 'send_recv', res, flush=True)
    for run, kw in runs:
        for name, fn, args in (('collectives', probe_collectives, ()), ('strategies', strategies, (a.steps,))):
            t0 = time.perf_counter()
            try: res = dtnb.launch(fn, *args, nprocs=2, timeout=120, **kw)
            except Exception as e:
                res = [dict(error=f"{type(e).__name__}: {str(e)[:2000]}")]; failed.append(f"{run}/{name}")
            out.setdefault(run, {})[name] = dict(seconds=round(time.perf_counter() - t0, 2), ranks=res)
            for r in res:
                if 'moved' in r and r["moved"] < 10 * TOL[a.device]: failed.append(f"{run}/reference_did_not_move")
                for s, v in (r.get('strategies') or {}).items():
                    if 'error' in v or v['missing'] or v['max_gap'] > TOL[a.device]: failed.append(f"{run}/{s}")
            save(); print(run, name, json.dumps(res)[:600], flush=True)
        p2p(run, kw)
    head = {}
    for run in out:
        if not isinstance(out[run], dict) or 'strategies' not in out[run]: continue
        ranks = out[run]['strategies']['ranks']
        head[f'{run}_backend'], head[f'{run}_reference_moved'] = ranks[0].get('backend'), ranks[0].get('moved')
        for s in ('ddp', 'zero2', 'fsdp', 'tp'):
            v = [r.get('strategies', {}).get(s, {}) for r in ranks]
            head[f'{run}_{s}_max_gap'] = max((x['max_gap'] for x in v if 'max_gap' in x), default=None)
        coll = out[run]['collectives']['ranks'][0].get('collectives', {})
        head[f'{run}_refused'] = sorted(c for c, v in coll.items() if v != 'ok')
        head[f'{run}_peak_bytes'] = ranks[0].get('peak_bytes')
        head[f'{run}_send_recv'] = out[run].get('send_recv', ['not run'])[-1]
    out['headline'] = dict(head, passed=not failed, failed=sorted(set(failed)))
    save()
    print("ranks check:", "FAILED " + ', '.join(sorted(set(failed))) if failed else "passed")
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
