"""FP8 training on one GPU, through dtnb's public names: `fit(..., precision='fp8')` (torchao's float8 training) beside
`fit(..., precision='bf16-mixed')` on the same small GPT and data: the step time of each, their ratio, and the loss
after a few hundred steps of each, within a tolerance of the other. The last step of tools/gpu_check.sh.

    python tools/gpu_fp8_check.py [--out FILE.json] [--device cpu] [--steps N] [--compile]

On a GPU without FP8 tensor cores (compute capability under 8.9: an A100) the check is the refusal: its message is
recorded, nothing trained. `--device cpu` (tools/gpu_check.sh --dry-run) checks the refusal on the CPU, then trains a
tiny GPT a few steps under torchao's emulation (FP8 casts, fp32 matmuls) beside bf16: the same code path, no speed
figure. Exit 1 when a check failed; the results are written to --out as soon as each is known.
"""
import argparse, importlib.metadata, json, sys, time, traceback
from pathlib import Path
import torch
from torch import nn
import torch.nn.functional as F
import dtnb
from dtnb.core.fp8 import float8_training, float8_linears, fp8_refusal
from dtnb.core.utils import synchronize

TOLERANCE = 0.05  # |fp8 - bf16| / bf16 of the loss averaged over the last tenth of the steps


class Block(nn.Module):
    def __init__(self, h, heads):
        super().__init__(); self.heads = heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(h), nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.ln2, self.up, self.down = nn.LayerNorm(h), nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(a)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    "A small causal LM: every Linear's sizes multiples of 16, so every one trains in FP8"
    def __init__(self, vocab, h, layers, heads, seq):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, h), nn.Parameter(torch.randn(seq, h) * 0.02)
        self.blocks = nn.ModuleList(Block(h, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(h), nn.Linear(h, vocab)
    def forward(self, ids):
        x = self.tok(ids) + self.pos[:ids.shape[1]]
        for b in self.blocks: x = b(x)
        return self.head(self.ln(x))


def lm_loss(logits, targets): return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def markov_batches(n, batch, seq, vocab, device, seed=0):
    "Token sequences of a random Markov chain, 4 possible next tokens each: a loss that falls, to a floor above 0"
    g = torch.Generator(device=device).manual_seed(seed)
    succ = torch.randint(0, vocab, (vocab, 4), generator=g, device=device)
    probs = torch.softmax(torch.randn(vocab, 4, generator=g, device=device), -1)
    ids = torch.empty(n * batch, seq + 1, dtype=torch.long, device=device)
    ids[:, 0] = torch.randint(0, vocab, (n * batch,), generator=g, device=device)
    for t in range(seq):
        pick = torch.multinomial(probs[ids[:, t]], 1, generator=g)
        ids[:, t + 1] = succ[ids[:, t]].gather(1, pick).squeeze(1)
    return [(c[:, :-1], c[:, 1:]) for c in ids.view(n, batch, seq + 1)]


def refusal(device):
    "precision='fp8' where this device has no FP8 tensor cores: refused by wrap and fit with the reason"
    why = fp8_refusal(device)
    if why is None: return dict(fp8=True)
    msgs, m = [], nn.Sequential(nn.Linear(16, 16))
    for call in (lambda: dtnb.wrap(m, 'single', precision='fp8'),
                 lambda: dtnb.fit(m, [], torch.optim.SGD(m.parameters(), lr=0.1), precision='fp8')):
        try: call(); raise AssertionError("precision='fp8' was not refused on a device without FP8")
        except ValueError as e: msgs.append(str(e))
    assert all("precision='fp8' needs FP8 tensor cores" in m and why in m for m in msgs), msgs
    return dict(fp8=False, reason=why, message=msgs[0])


def train(device, steps, size, compile=False, out=None):
    "fit in bf16-mixed, then in fp8, the same model and data: step times (after a warm-up), losses, peak memory"
    vocab, h, layers, heads, seq, batch = size
    emulate, out = device == 'cpu', {} if out is None else out  # `out`: filled as figures come, kept on a failure
    out['emulated'], out['compiled'] = emulate, compile
    out['size'] = dict(zip(('vocab', 'hidden', 'layers', 'heads', 'seq', 'batch'), size))
    data = markov_batches(64, batch, seq, vocab, device)
    warm, lr = (10, 5e-4) if device == 'cuda' else (5, 1e-2)
    for precision in ('bf16-mixed', 'fp8'):
        torch.manual_seed(0)
        m = GPT(vocab, h, layers, heads, seq).to(device)
        if emulate and precision == 'fp8': float8_training(m, emulate=True)  # the CPU: torchao's emulation
        opt = torch.optim.AdamW(m.parameters(), lr=lr, fused=device == 'cuda')
        loader = lambda k: [data[i % len(data)] for i in range(k)]
        kw = dict(loss_fn=lm_loss, precision=precision, progress=False, compile=compile)
        if device == 'cuda': torch.cuda.reset_peak_memory_stats()
        first = dtnb.fit(m, loader(warm), opt, **kw)  # converts the model (fp8), cuBLAS's first calls, compiles
        synchronize(device)
        t0 = time.perf_counter()
        r = dtnb.fit(m, loader(steps), opt, **kw)
        synchronize(device)
        secs = time.perf_counter() - t0
        losses = first.losses + r.losses
        tail = max(1, len(losses) // 10)
        out[precision] = dict(step_s=secs / steps, first_loss=losses[0], last_loss=sum(losses[-tail:]) / tail,
                              fp8_linears=len(float8_linears(m)), steps=len(losses), curve=losses[::10],
                              peak_bytes=torch.cuda.max_memory_allocated() if device == 'cuda' else None)
        learnt = 0.8 if device == 'cuda' else 0.9  # the CPU's few steps: a start
        assert out[precision]['last_loss'] < learnt * losses[0], f"{precision} did not learn: {out[precision]}"
    b, f = out['bf16-mixed'], out['fp8']
    assert f['fp8_linears'] == 4 * layers + 1 and b['fp8_linears'] == 0, out
    out['step_time_ratio'] = f['step_s'] / b['step_s']  # under 1: FP8 is faster
    out['loss_diff'] = f['last_loss'] - b['last_loss']
    out['loss_rel_diff'] = abs(out['loss_diff']) / b['last_loss']
    out['tolerance'] = TOLERANCE
    assert out['loss_rel_diff'] <= TOLERANCE, f"fp8 ends {out['loss_rel_diff']:.1%} away from bf16: {out}"
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--out', default='gpu_fp8_check.json')
    ap.add_argument('--device', default='cuda', choices=('cuda', 'cpu'))
    ap.add_argument('--steps', type=int, help="timed steps of each precision (default: 250 on a GPU, 20 on the CPU)")
    ap.add_argument('--compile', action='store_true', help="fit(compile=True) for both (adds minutes of compiling)")
    a = ap.parse_args(argv)
    if a.device == 'cuda' and not torch.cuda.is_available():
        print("gpu_fp8_check: no CUDA device here: nothing run (`--device cpu` checks the logic)"); return 0
    if a.device == 'cpu':
        import os; os.environ['DTNB_DEVICE'] = 'cpu'; torch.set_num_threads(1)
    size = (2048, 1536, 4, 12, 1024, 8) if a.device == 'cuda' else (64, 32, 2, 2, 16, 4)
    steps = a.steps or (250 if a.device == 'cuda' else 20)
    try: tao = importlib.metadata.version('torchao')  # not imported here: `float8_training` does, quietly
    except importlib.metadata.PackageNotFoundError: tao = None
    results, failed = dict(device=a.device, torch=torch.__version__, torchao=tao, checks={}), False
    if a.device == 'cuda': results['gpu'] = torch.cuda.get_device_name()
    figures = {}  # what train measured before any failed assertion
    for name, check in (('refusal', lambda: refusal(a.device)),
                        ('train', lambda: train(a.device, steps, size, a.compile, figures))):
        if name == 'train' and a.device == 'cuda' and not results['checks']['refusal'].get('fp8'):
            results['checks'][name] = dict(passed=True, skipped="no FP8 tensor cores here: the refusal is the check")
            continue
        t0 = time.perf_counter()
        try: res = dict(passed=True, **check())
        except Exception: res, failed = dict(passed=False, error=traceback.format_exc(), **figures), True
        res['seconds'] = round(time.perf_counter() - t0, 2)
        results['checks'][name] = res
        print(f"{name}: {'passed' if res['passed'] else 'FAILED'} in {res['seconds']} s")
        if not res['passed']: print(res['error'])
        elif name == 'train':
            print(f"  fp8 / bf16 step time {res['step_time_ratio']:.3f} ({res['fp8']['step_s'] * 1e3:.2f} / "
                  f"{res['bf16-mixed']['step_s'] * 1e3:.2f} ms); loss after {res['fp8']['steps']} steps "
                  f"{res['fp8']['last_loss']:.4f} / {res['bf16-mixed']['last_loss']:.4f} "
                  f"({res['loss_rel_diff']:.2%}, tolerance {TOLERANCE:.0%})" + (" [emulated]" * res['emulated']))
        tr = results['checks'].get('train', {})  # summary.json's `headlines` carries these (gpu_check.sh's pack)
        results['headline'] = dict(fp8=results['checks']['refusal'].get('fp8'), emulated=tr.get('emulated'),
                                   **{k: tr[k] for k in ('step_time_ratio', 'loss_rel_diff', 'skipped') if k in tr})
        Path(a.out).write_text(json.dumps(results, indent=1, default=str))
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
