"""Memory planner figures: the ZeRO paper's table, estimate vs measurement on 2 gloo ranks, fake trace vs real forward,
formula vs trace, and what a trace of a model too big for this machine costs. Run: python benchmarks/bench_memory.py"""
import resource, sys, time
import torch, torch.nn as nn, torch.nn.functional as F
from dtnb.core.utils import text_table
from dtnb.plan.activations import trace_activations
from dtnb.plan.memory import estimate_memory, TransformerShape
from dtnb.plan.measure import measure_memory
from dtnb.core.models import ToyModel, GPT


def zero_table():
    print("== ZeRO paper, figure 1: 7.5B parameters, 64 devices, mixed-precision Adam (model states per device)")
    rows = []
    for s, paper in dict(ddp=120, zero1=31.4, zero2=16.6, zero3=1.9).items():
        e = estimate_memory(7.5e9, s, 64, optimizer='adam', precision='zero-mixed').model_states / 1e9
        rows.append((s, f"{e:.4g} GB", f"{paper} GB", f"{100 * (e - paper) / paper:+.2f}%"))
    print(text_table(('strategy', 'dtnb', 'paper', 'difference'), rows), '\n')


def measured_table():
    print("== Estimated vs measured model-state bytes, one real AdamW step on 2 gloo ranks (CPU)")
    rows, x, y = [], torch.randn(8, 16), torch.randn(8, 5)
    for strategy in ('ddp', 'fsdp'):
        for precision in ('fp32', 'bf16-mixed', 'bf16-true'):
            t = time.perf_counter()
            r = measure_memory(ToyModel(d_in=16, d=30, depth=2, d_out=5), (x, y), strategy, 2, precision=precision, loss_fn=F.mse_loss)
            dt = time.perf_counter() - t
            for e, m in zip(r.estimates, r.measured):
                est = e.parameters + e.gradients + e.optimizer_states
                meas = m['parameters'] + m['gradients'] + m['optimizer_states']
                rows.append((strategy, precision, m['rank'], f"{est:,}", f"{meas:,}", 'yes' if est == meas else 'NO',
                             f"{e.activations:,}", f"{m['activations']:,}", f"{dt:.1f}"))
    print(text_table(('strategy', 'precision', 'rank', 'states est.', 'states meas.', 'exact', 'acts est.', 'acts meas.', 'launch+step s'), rows), '\n')


def trace_table():
    print("== Fake trace (no memory) vs the same forward on real tensors: bytes saved for backward")
    models = {
        'ToyModel d=256 depth=4': (ToyModel(d_in=64, d=256, depth=4, d_out=8), torch.randn(64, 64)),
        'GPT 2x256, s=256 b=4': (GPT(2, 256, 8), torch.randn(256, 4, 256)),
        'nn.TransformerEncoder 2x128': (nn.TransformerEncoder(nn.TransformerEncoderLayer(128, 4, 512, batch_first=True), 2,
                                                              enable_nested_tensor=False), torch.randn(8, 64, 128)),
    }
    rows = []
    for name, (m, x) in models.items():
        for precision in ('fp32', 'bf16-mixed', 'bf16-true'):
            t = time.perf_counter(); fake = trace_activations(m, x, precision=precision); tf = time.perf_counter() - t
            t = time.perf_counter(); real = trace_activations(m, x, precision=precision, fake=False); tr = time.perf_counter() - t
            rows.append((name, precision, f"{fake.saved:,}", f"{real.saved:,}", f"{real.saved - fake.saved:+,}", f"{1e3 * tf:.0f}", f"{1e3 * tr:.0f}"))
    print(text_table(('model', 'precision', 'fake trace', 'real forward', 'real - fake', 'fake ms', 'real ms'), rows), '\n')


def formula_table():
    print("== Korthikanti et al. formula sbh(34 + 5as/h) per layer vs the trace of that layer (bf16)")
    rows = []
    for L, h, a, s, b in ((2, 256, 8, 128, 2), (4, 512, 8, 256, 1), (2, 1024, 16, 512, 1)):
        sh, m = TransformerShape(L, h, a, s, b), GPT(L, h, a)
        tr = trace_activations(m, torch.randn(s, b, h), precision='zero-mixed')
        f, fc = sh.activation_bytes(2), sh.activation_bytes(2, activation_checkpointing=True)
        rows.append((f"L={L} h={h} a={a} s={s} b={b}", f"{f:,}", f"{tr.saved:,}", f"{tr.saved - f:,}", f"{L * 4 * s * b * 2:,}",
                     f"{fc:,}", f"{tr.checkpointed:,}"))
    print(text_table(('shape', 'formula', 'trace', 'trace - formula', 'LayerNorm stats 8sbL', 'formula ckpt', 'trace ckpt'), rows), '\n')


def huge_model():
    print("== A model this machine cannot train: GPT 32 x 4096 on the meta device, s=2048, b=1")
    t = time.perf_counter()
    with torch.device('meta'): m = GPT(32, 4096, 32)
    x = torch.empty(2048, 1, 4096, device='meta')
    build = time.perf_counter() - t
    t = time.perf_counter(); e = estimate_memory(m, 'zero3', 64, precision='zero-mixed', batch=x); dt = time.perf_counter() - t
    print(f"parameters {e.params / 1e9:.2f}B; built in {build:.2f} s; traced and estimated in {dt:.2f} s; "
          f"process max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB")
    print(e, '\n')


if __name__ == '__main__':
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, python {sys.version.split()[0]}\n")
    zero_table(); measured_table(); trace_table(); formula_table(); huge_model()
