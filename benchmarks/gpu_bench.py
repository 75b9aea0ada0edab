"""GPU benchmarks held to their anchors (issue 15): dtnb's benchmarks beside plain torch loops, measured in one run.

  matmul  dtnb.bench_matmul vs a plain `torch.matmul` loop at the same shapes, in bf16, fp16, tf32 and fp32.
          Anchor: dtnb's max achievable within 5% of the plain loop's; % of the spec peak (dtnb.core.specs; H100 SXM bf16
          989.4 dense) and of the known measured max (H100 SXM bf16: about 794 TFLOPS).
  memory  device memory bandwidth: dtnb.bench_memory's copy vs a plain `copy_` loop, % of spec (H100 SXM 3.35 TB/s);
          host<->device, pageable vs pinned (`pin_memory()`, `non_blocking=True`), H2D and D2H, dtnb beside plain.
  mfu     MFU of dtnb.core.models.GPT (Korthikanti GPTBlocks) by dtnb.bench_model and by a hand-written autocast loop,
          against the spec peak and the measured matmul peak; FLOPs counted beside 72bsh^2 + 12bs^2h per layer.
  step    one GPU, DDP and FSDP2: training steps/s through dtnb.wrap beside DistributedDataParallel / fully_shard
          written by hand (one rank, launched by dtnb.launch), and the losses of both.

    python benchmarks/gpu_bench.py [--quick] [--only matmul,memory,mfu,step] [--out DIR] [--strict]
    python benchmarks/gpu_bench.py --device cpu --quick   # the same comparison logic on the CPU: no GPU figure

Without CUDA (and without --device cpu) it says so and exits 0, measuring and writing nothing. Otherwise it prints
a table per section with the device fingerprint and writes gpu_bench.json to --out, else $DTNB_BENCH_OUT, else
./gpu-bench-<UTC time>/, after each section (`complete` turns true at the end: a run stopped early keeps what it
measured). Exit 1 when a section raised, or (--strict, or DTNB_BENCH_STRICT=1) when an anchor was missed on a GPU.
tools/gpu_check.sh runs it that way. Not a test.
"""
import argparse, datetime, gc, json, math, os, platform, shutil, statistics, subprocess, sys, time, traceback
from pathlib import Path
import torch

SECTIONS = ('matmul', 'memory', 'mfu', 'step')
DTYPE = dict(bf16=torch.bfloat16, fp16=torch.float16, tf32=torch.float32, fp32=torch.float32)
# The best measured bf16 matmul rate known for a device (the anchor); everything else says 'unknown'
KNOWN_MAX = {('H100 SXM', 'bf16'): (794.0, 'about 794 TFLOPS: the known max achievable bf16 matmul (issue 15)')}
RATIO_TARGET = 0.95  # dtnb within 5% of the plain loop


def config(device, quick):
    "Sizes per device: real ones on a GPU; tiny ones on a CPU, where only the logic is being checked"
    if device.type == 'cpu':
        return dict(shapes=[64, 128], dtypes=['fp32', 'bf16'], repeats=3, iters=2, rounds=1, copy_bytes=16 * 2**20,
                    transfer_bytes=None, gpt=dict(L=1, h=64, a=4, s=32, b=2), amp=None, steps=4, warmup=1,
                    step_gpt=dict(L=2, h=32, a=2, s=16, b=2))
    return dict(shapes=[4096, 8192] if quick else [2048, 4096, 8192, 16384], dtypes=['bf16', 'fp16', 'tf32', 'fp32'],
                repeats=10, iters=10, rounds=2 if quick else 3, copy_bytes=2**30,
                transfer_bytes=(64 if quick else 256) * 2**20,
                gpt=dict(L=2 if quick else 4, h=4096, a=32, s=2048, b=2), amp='bf16', steps=10 if quick else 20,
                warmup=3, step_gpt=dict(L=4, h=2048, a=16, s=1024, b=4))


# ---------------------------------------------------------------- the plain reference: no dtnb in the timed path
def plain_seconds(fn, device, iters, repeats, warmup=3, target_s=0.02):
    "Seconds per call of `fn()`: `warmup` calls, then `repeats` timings of `iters` back-to-back calls (CUDA events)"
    for _ in range(warmup): fn()
    if iters is None:  # enough calls to last about `target_s` per timing, at most 50
        once = plain_seconds(fn, device, 1, 1, 0)[0]
        iters = min(50, max(1, math.ceil(target_s / max(once, 1e-9))))
    if device.type != 'cuda':
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(iters): fn()
            out.append((time.perf_counter() - t0) / iters)
        return out
    torch.cuda.synchronize(device)
    stream, pairs = torch.cuda.current_stream(device), []
    for _ in range(repeats):  # all queued before one synchronize: the GPU never waits for the host between them
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        for _ in range(iters): fn()
        b.record(stream); pairs.append((a, b))
    torch.cuda.synchronize(device)
    return [a.elapsed_time(b) / 1e3 / iters for a, b in pairs]


def spin(device, seconds=2.0):
    "Keep the GPU busy for `seconds` so clocks and power have ramped up before anything is measured"
    if device.type != 'cuda': return
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20): a @ a
        torch.cuda.synchronize(device)


class precision:
    "fp32 matmuls on TF32 tensor cores for 'tf32' only, true fp32 otherwise; restored afterwards"
    def __init__(self, name): self.name = name
    def __enter__(self):
        self.old = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision('high' if self.name == 'tf32' else 'highest')
    def __exit__(self, *a): torch.set_float32_matmul_precision(self.old)


def peaks_of(name, dtype):
    "(spec peak TFLOPS from dtnb.core.specs, best known measured TFLOPS, where that comes from) of the device `name`"
    from dtnb.core.specs import peak_tflops
    peaks, src = peak_tflops(name)
    known, known_src = KNOWN_MAX.get((src.split(':')[0] if src else None, dtype), (None, None))
    return peaks.get(dtype), known, known_src


def ratio(a, b): return a / b if a and b else None


def verdict(r, target=RATIO_TARGET):
    return 'unknown' if r is None else ('ok' if r >= target else 'MISSED')


def anchor_verdict(v, device):
    "An anchor's verdict; on a CPU the figures only exercise the logic, so no anchor is held there"
    return verdict(v) if device.type == 'cuda' else 'cpu n/a'



def pct(x, peak): return 100 * x / peak if isinstance(peak, (int, float)) and peak else 'unknown'


# ---------------------------------------------------------------- (a) matmul
def plain_matmul_tflops(name, n, device, repeats):
    "Median TFLOPS of `torch.matmul` on one fixed pair of n x n inputs, in a loop"
    with precision(name):
        a = torch.randn(n, n, device=device, dtype=DTYPE[name]); b = torch.randn(n, n, device=device, dtype=DTYPE[name])
        t = statistics.median(plain_seconds(lambda: torch.matmul(a, b), device, None, repeats))
    del a, b
    return 2 * n**3 / t / 1e12


def matmul_section(device, cfg, ctx):
    from dtnb.bench.compute import bench_matmul
    from dtnb.core.specs import peak_tflops
    spin(device)
    best = {}  # (dtype, n) -> [dtnb, plain]: the best median of each over interleaved rounds
    for _ in range(cfg['rounds']):
        for name in cfg['dtypes']:
            r = bench_matmul([name], sizes=cfg['shapes'], device=device, repeats=cfg['repeats'], progress=False)
            for row in r.rows:
                n = row['m']; b = best.setdefault((name, n), [0.0, 0.0])
                b[0] = max(b[0], row['tflops'])
                b[1] = max(b[1], plain_matmul_tflops(name, n, device, cfg['repeats']))
    src = peak_tflops(ctx['fp']['name'])[1]
    rows = [dict(dtype=name, shape=f"{n}^3", dtnb_tflops=d, plain_tflops=p, ratio=ratio(d, p))
            for (name, n), (d, p) in best.items()]
    summary, anchors = {}, []
    for name in cfg['dtypes']:
        mine = [v for (k, _), v in best.items() if k == name]
        d, p = max(v[0] for v in mine), max(v[1] for v in mine)
        spec, known, known_src = peaks_of(ctx['fp']['name'], name)
        summary[name] = dict(dtnb_max_tflops=d, plain_max_tflops=p, ratio=ratio(d, p),
                             verdict=anchor_verdict(ratio(d, p), device),
                             spec_peak_tflops=spec or 'unknown', pct_of_spec=pct(d, spec),
                             known_max_tflops=known or 'unknown', pct_of_known_max=pct(d, known),
                             known_source=known_src)
        anchors.append((f"matmul {name}: dtnb max within 5% of the plain loop", ratio(d, p)))
        if spec and d > spec: anchors.append((f"matmul {name}: below the spec peak (else the timer is wrong)", 0.0))
    ctx['matmul_peak'] = {k: v['dtnb_max_tflops'] for k, v in summary.items()}
    cols = ['dtype', 'shape', 'dtnb_tflops', 'plain_tflops', 'ratio']
    notes = [f"spec peaks: {src or 'unknown device: no datasheet figure'}",
             'TFLOPS per call: median of the measurements; per shape the best of the interleaved rounds']
    return dict(columns=cols, rows=rows, summary=summary, anchors=anchors, notes=notes)


# ---------------------------------------------------------------- (b, c) memory and host<->device transfers
def plain_copy_gbs(nbytes, device, iters, repeats):
    "Device copy bandwidth of a plain `dst.copy_(src)` loop: bytes read + written per second"
    src = torch.ones(nbytes // 4, device=device); dst = torch.empty_like(src)
    t = statistics.median(plain_seconds(lambda: dst.copy_(src), device, iters, repeats))
    del src, dst
    return 2 * nbytes / t / 1e9


def plain_transfer_gbs(n, device, iters, repeats):
    "GB/s of host->device and device->host copies of `n` bytes, from pageable and from pinned host memory"
    dev = torch.ones(n, dtype=torch.uint8, device=device)
    pageable = torch.ones(n, dtype=torch.uint8)          # touched: its pages exist before the first copy
    pinned = torch.ones(n, dtype=torch.uint8).pin_memory()
    assert pinned.is_pinned() and not pageable.is_pinned()
    cases = {('host->device', 'pageable'): lambda: dev.copy_(pageable),
             ('host->device', 'pinned'): lambda: dev.copy_(pinned, non_blocking=True),
             ('device->host', 'pageable'): lambda: pageable.copy_(dev),
             ('device->host', 'pinned'): lambda: pinned.copy_(dev, non_blocking=True)}  # the end event waits for it
    return {k: n / statistics.median(plain_seconds(fn, device, iters, repeats)) / 1e9 for k, fn in cases.items()}


def memory_section(device, cfg, ctx):
    from dtnb.bench.compute import bench_memory, peak_memory_bw
    spin(device, 1.0)
    copy, xfer, res = [0.0, 0.0], {}, None
    iters = max(1, cfg['iters'] // 2)
    for _ in range(cfg['rounds']):
        res = bench_memory(device, nbytes=cfg['copy_bytes'], transfer_bytes=cfg['transfer_bytes'],
                           repeats=cfg['repeats'], progress=False)
        by = {r['test']: r['gbs'] for r in res.rows}
        copy[0] = max(copy[0], by['device memory copy' if device.type == 'cuda' else 'host memory copy'])
        copy[1] = max(copy[1], plain_copy_gbs(cfg['copy_bytes'], device, iters, cfg['repeats']))
        if device.type == 'cuda':
            plain = plain_transfer_gbs(cfg['transfer_bytes'], device, iters, cfg['repeats'])
            for (d, kind), v in plain.items():
                x = xfer.setdefault((d, kind), [0.0, 0.0])
                x[0] = max(x[0], by[f"{d} {kind}"]); x[1] = max(x[1], v)
    spec, src = peak_memory_bw(ctx['fp']['name']) if device.type == 'cuda' else (None, None)
    spec_gbs = spec * 1e3 if spec else None
    rows = [dict(test='device memory copy' if device.type == 'cuda' else 'host memory copy (CPU)', dtnb_gbs=copy[0],
                 plain_gbs=copy[1], ratio=ratio(*copy), pct_of_spec=pct(copy[0], spec_gbs))]
    for (d, kind), (ours, plain) in xfer.items():
        rows.append(dict(test=f"{d} {kind}", dtnb_gbs=ours, plain_gbs=plain, ratio=ratio(ours, plain),
                         pct_of_spec='-'))
    summary = dict(copy_dtnb_gbs=copy[0], copy_plain_gbs=copy[1], copy_ratio=ratio(*copy),
                   copy_verdict=anchor_verdict(ratio(*copy), device), spec_gbs=spec_gbs or 'unknown',
                   pct_of_spec=pct(copy[0], spec_gbs), spec_source=src)
    anchors = [('memory copy: dtnb within 5% of a plain copy_ loop', ratio(*copy))]
    if spec_gbs and copy[0] > spec_gbs: anchors.append(('memory copy: below the spec bandwidth', 0.0))
    for d in ('host->device', 'device->host'):
        if (d, 'pinned') in xfer:
            summary[f"{d} pinned / pageable (plain)"] = ratio(xfer[d, 'pinned'][1], xfer[d, 'pageable'][1])
            anchors.append((f"{d}: dtnb's pinned copy within 5% of the plain one", ratio(*xfer[d, 'pinned'])))
    notes = ['copy: bytes read + written per second; transfers: bytes moved one way per second']
    if device.type != 'cuda': notes.append('host<->device transfers: no accelerator here, nothing to transfer')
    return dict(columns=['test', 'dtnb_gbs', 'plain_gbs', 'ratio', 'pct_of_spec'], rows=rows, summary=summary,
                anchors=anchors, notes=notes)


# ---------------------------------------------------------------- (d) MFU of GPT blocks
def gpt_flops(L, h, a, s, b):
    "Matmul FLOPs of one training step (forward + backward) of L Korthikanti layers: L(72bsh^2 + 12bs^2h)"
    return L * (72 * b * s * h * h + 12 * b * s * s * h)


def hand_step(model, x, amp, device):
    "The hand-written training step: autocast forward, backward, SGD"
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=DTYPE.get(amp, torch.bfloat16), enabled=amp is not None):
            loss = model(x).float().mean()
        loss.backward(); opt.step()
    return step


def mfu_section(device, cfg, ctx):
    from dtnb.core.models import GPT
    from dtnb.bench.throughput import bench_model
    from dtnb.core.specs import peak_tflops
    g, amp = cfg['gpt'], cfg['amp']
    name = amp or 'fp32'
    peak = ctx.get('matmul_peak', {}).get(name)   # from the matmul section; bench_model measures it when None
    torch.manual_seed(0)
    model = GPT(g['L'], g['h'], g['a']).to(device)
    x = torch.randn(g['s'], g['b'], g['h'], device=device)
    r = bench_model(model, x, amp=amp, steps=cfg['steps'], warmup=cfg['warmup'], matmul_peak=peak, device=device)
    counted, formula = r.summary['FLOPs per step'], gpt_flops(**g)
    plain_s = statistics.median(plain_seconds(hand_step(model, x, amp, device), device, 1, cfg['steps'],
                                              cfg['warmup']))
    del model, x; gc.collect()
    if device.type == 'cuda': torch.cuda.empty_cache()
    spec = peak_tflops(ctx['fp']['name'])[0].get(name) if device.type == 'cuda' else None
    measured = peak if peak else (r.summary['measured matmul peak TFLOPS'] if device.type == 'cuda' else None)
    ours_tf, plain_tf = counted / (r.summary['step ms (median)'] / 1e3) / 1e12, counted / plain_s / 1e12
    rows = [dict(loop=who, step_ms=ms, tflops=tf, mfu_vs_spec=pct(tf, spec), mfu_vs_measured=pct(tf, measured))
            for who, ms, tf in (('dtnb.bench_model', r.summary['step ms (median)'], ours_tf),
                                ('hand-written', plain_s * 1e3, plain_tf))]
    summary = dict(model=f"GPT(L={g['L']}, h={g['h']}, a={g['a']}), s={g['s']}, b={g['b']}", compute_dtype=name,
                   flops_counted=counted, flops_formula=formula, flops_agree=counted == formula,
                   spec_peak_tflops=spec or 'unknown', measured_matmul_peak_tflops=measured or 'unknown',
                   dtnb_mfu_vs_spec=r.summary['MFU % vs spec peak'],
                   dtnb_mfu_vs_measured=r.summary['MFU % vs measured matmul peak'],
                   step_ratio=ratio(plain_s * 1e3, r.summary['step ms (median)']))
    anchors = [('mfu: bench_model step time within 5% of the hand-written loop', summary['step_ratio']),
               ('mfu: FLOPs counted = L(72bsh^2 + 12bs^2h)', 1.0 if counted == formula else 0.0)]
    notes = ["MFU in %: achieved TFLOPS (counted FLOPs / median step) over the spec peak and over the measured "
             "max achievable matmul rate (the matmul section's dtnb max)"]
    return dict(columns=['loop', 'step_ms', 'tflops', 'mfu_vs_spec', 'mfu_vs_measured'], rows=rows, summary=summary,
                anchors=anchors, notes=notes)


# ---------------------------------------------------------------- (e) DDP / FSDP2 on one GPU
def by_hand(model, strategy, device):
    "What a user writes without dtnb: DistributedDataParallel, or fully_shard on each block and then the root"
    model = model.to(device)
    if strategy == 'ddp':
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model, device_ids=[device.index] if device.type == 'cuda' else None)
    from torch.distributed.fsdp import fully_shard
    for block in model.layers: fully_shard(block)
    return fully_shard(model)


def step_rank(g, amp, steps, warmup, rounds):
    "In one rank: steps/s and losses of DDP and FSDP2, through dtnb.wrap and by hand, interleaved over rounds"
    from dtnb.core.dist import current_device
    from dtnb.parallel.wrap import wrap
    from dtnb.core.models import GPT
    device, out = current_device(), {}
    for _ in range(rounds):
        for strategy in ('ddp', 'fsdp'):
            for who in ('dtnb', 'torch'):
                torch.manual_seed(0)
                model = GPT(g['L'], g['h'], g['a'])
                model = wrap(model, strategy) if who == 'dtnb' else by_hand(model, strategy, device)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
                gen = torch.Generator(device=device).manual_seed(1)
                x = torch.randn(g['s'], g['b'], g['h'], device=device, generator=gen)
                losses = []
                def step():
                    opt.zero_grad(set_to_none=True)
                    with torch.autocast(device.type, dtype=DTYPE.get(amp, torch.bfloat16), enabled=amp is not None):
                        loss = model(x).float().pow(2).mean()
                    loss.backward(); opt.step(); losses.append(loss.detach())
                torch.manual_seed(2)  # dropout draws the same masks in both
                t = statistics.median(plain_seconds(step, device, 1, steps, warmup))
                o = out.setdefault((strategy, who), dict(steps_s=0.0))
                o['steps_s'] = max(o['steps_s'], 1 / t)
                o['losses'] = [float(l) for l in losses[:warmup + 3]]
                del model, opt, step, losses; gc.collect()
                if device.type == 'cuda': torch.cuda.empty_cache()
    return {f"{s} {w}": v for (s, w), v in out.items()}


def step_section(device, cfg, ctx):
    from dtnb.launcher.processes import launch
    cpu = device.type == 'cpu'
    res = launch(step_rank, cfg['step_gpt'], cfg['amp'], cfg['steps'], cfg['warmup'], cfg['rounds'], nprocs=1,
                 device='cpu' if cpu else None, threads=1 if cpu else None, timeout=600)[0]
    rows, summary, anchors = [], {}, []
    for s in ('ddp', 'fsdp'):
        d, t = res[f"{s} dtnb"], res[f"{s} torch"]
        diff = max(abs(a - b) for a, b in zip(d['losses'], t['losses']))
        rows.append(dict(strategy=s, dtnb_steps_s=d['steps_s'], torch_steps_s=t['steps_s'],
                         ratio=ratio(d['steps_s'], t['steps_s']), loss_max_diff=diff))
        summary[s] = dict(ratio=rows[-1]['ratio'], verdict=anchor_verdict(rows[-1]['ratio'], device),
                          loss_max_diff=diff,
                          dtnb_losses=d['losses'], torch_losses=t['losses'])
        anchors.append((f"step {s}: dtnb.wrap steps/s within 5% of the hand-written torch step", rows[-1]['ratio']))
    g = cfg['step_gpt']
    notes = [f"GPT(L={g['L']}, h={g['h']}, a={g['a']}), s={g['s']}, b={g['b']}, AdamW, autocast {cfg['amp']}; "
             f"one rank ({'gloo, CPU' if cpu else 'nccl, one GPU'}); steps/s: best median over rounds"]
    if not cpu and device.index: notes.append("the rank runs on cuda:0 (launch's local rank 0), not on --device: "
                                              "pick the GPU with CUDA_VISIBLE_DEVICES instead")
    return dict(columns=['strategy', 'dtnb_steps_s', 'torch_steps_s', 'ratio', 'loss_max_diff'], rows=rows,
                summary=summary, anchors=anchors, notes=notes)


RUNS = dict(matmul=matmul_section, memory=memory_section, mfu=mfu_section, step=step_section)


# ---------------------------------------------------------------- fingerprint, tables, main
def nvidia_smi(fields):
    "One line per GPU of `nvidia-smi --query-gpu=fields`, or None without nvidia-smi or when it fails"
    smi = shutil.which('nvidia-smi')
    if not smi: return None
    try: q = subprocess.run([smi, f'--query-gpu={fields}', '--format=csv,noheader'], capture_output=True, text=True,
                            timeout=30)
    except (OSError, subprocess.SubprocessError): return None
    return q.stdout.strip().splitlines() if q.returncode == 0 else None


def fingerprint(device):
    "What was measured on: device name, capability, torch/CUDA/cuDNN versions, the driver (nvidia-smi), dtnb's view"
    from dtnb.detection.device import detect
    fp = dict(device=str(device), torch=torch.__version__, cuda=torch.version.cuda,
              cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
              python=platform.python_version(), dtnb=detect().fingerprint())
    if device.type == 'cuda':
        p = torch.cuda.get_device_properties(device)
        fp.update(name=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                  sms=p.multi_processor_count)
        fp['nvidia_smi'] = smi = nvidia_smi('index,name,driver_version,pci.bus_id,clocks.max.sm,power.limit')
        fp['driver'] = (nvidia_smi('driver_version') or [None])[0] if smi is not None else None
    else: fp.update(name=platform.processor() or platform.machine(), capability=None, driver=None)
    return fp


def fmt(v):
    if v is None: return '-'
    if isinstance(v, float): return f"{v:.1f}" if abs(v) >= 100 else f"{v:.3g}"
    return str(v)


def show(name, sec):
    from dtnb.core.utils import text_table
    print(f"\n== {name}")
    if 'error' in sec: print(sec['error']); return
    print(text_table(sec['columns'], [[fmt(r.get(c)) for c in sec['columns']] for r in sec['rows']]))
    for k, v in sec['summary'].items():
        print(f"  {k}: " + (', '.join(f"{a}={fmt(b)}" for a, b in v.items()) if isinstance(v, dict) else fmt(v)))
    for n in sec['notes']: print(f"  note: {n}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--device', default='cuda', help="'cuda' (default), 'cuda:N', or 'cpu' to check the logic")
    ap.add_argument('--quick', action='store_true', help='fewer shapes, rounds and steps')
    ap.add_argument('--only', default=','.join(SECTIONS), help=f"comma-separated, from {', '.join(SECTIONS)}")
    ap.add_argument('--out', default=None, help='output folder (default $DTNB_BENCH_OUT, else ./gpu-bench-<time>)')
    ap.add_argument('--strict', action='store_true', default=os.environ.get('DTNB_BENCH_STRICT') == '1',
                    help='exit 1 when an anchor is missed (default under DTNB_BENCH_STRICT=1, as tools/gpu_check.sh)')
    a = ap.parse_args(argv)
    only = [s.strip() for s in a.only.split(',') if s.strip()]
    if bad := [s for s in only if s not in SECTIONS]: ap.error(f"unknown section(s) {bad}: choose from {SECTIONS}")
    device = torch.device(a.device)
    if device.type != 'cpu' and (device.type != 'cuda' or not torch.cuda.is_available()):
        print(f"gpu_bench: no CUDA device here (torch {torch.__version__}, built for CUDA {torch.version.cuda}): "
              "nothing measured, nothing written. `--device cpu --quick` checks the logic on the CPU.")
        return 0
    if device.type == 'cuda':
        device = torch.device('cuda', device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
    else: torch.set_num_threads(1)  # a logic check on a shared CPU, not a CPU benchmark
    out = Path(a.out or os.environ.get('DTNB_BENCH_OUT') or
               f"gpu-bench-{datetime.datetime.now(datetime.timezone.utc):%Y%m%d-%H%M%S}")
    cfg, fp = config(device, a.quick), fingerprint(device)
    ctx = dict(fp=fp)
    print(f"gpu_bench on {fp['name']} (capability {fp['capability']}, torch {fp['torch']}, CUDA {fp['cuda']}, "
          f"driver {fp.get('driver')}); {fp['dtnb']}")
    if device.type == 'cpu': print("gpu_bench: --device cpu: tiny sizes, the comparison logic only; no GPU figure")
    result = dict(script='benchmarks/gpu_bench.py', gpu_figures=device.type == 'cuda', measured_on=str(device),
                  quick=a.quick, timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
                  fingerprint=fp, config={k: v for k, v in cfg.items()}, sections={}, complete=False)
    out.mkdir(parents=True, exist_ok=True)
    path = out / 'gpu_bench.json'
    failed = False
    for name in only:
        t0 = time.perf_counter()
        try: sec = RUNS[name](device, cfg, ctx)
        except Exception: sec, failed = dict(error=traceback.format_exc()), True
        sec['seconds'] = time.perf_counter() - t0
        sec['anchors'] = [dict(anchor=k, value=v, verdict=anchor_verdict(v, device)) for k, v in sec.get('anchors', [])]
        result['sections'][name] = sec
        path.write_text(json.dumps(result, indent=1, default=str))  # each section kept as soon as it is measured
        show(name, sec)
        if device.type == 'cuda': gc.collect(); torch.cuda.empty_cache()
    anchors = [x for s in result['sections'].values() for x in s['anchors']]
    missed = [x['anchor'] for x in anchors if x['verdict'] == 'MISSED']
    result.update(anchors_missed=missed, failed_sections=[k for k, s in result['sections'].items() if 'error' in s],
                  complete=True)
    print('\n== anchors' + ('' if device.type == 'cuda' else ' (CPU: the logic only, no GPU anchor is checked here)'))
    for x in anchors: print(f"  {x['verdict']:>7}  {x['anchor']}: {fmt(x['value'])}")
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"\ngpu_bench: wrote {path}")
    return 1 if failed or (a.strict and missed) else 0


if __name__ == '__main__':
    sys.exit(main())
