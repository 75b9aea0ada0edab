# Which call initialises CUDA, and what cuBLAS keeps allocated (run on the H200, 2026-11-28: the log beside it)
import torch, time
def st(tag):
    i = torch.cuda.is_initialized()
    print(f"{tag}: cuda initialized={i} allocated={torch.cuda.memory_allocated() if i else '-'}", flush=True)
st('start')
import dtnb.detection.device as d
st('import dtnb.detection.device')
for name, f in [('_torch_build', lambda: d._torch_build(torch)), ('_backends', d._backends), ('_host', d._host),
                ('_cpu_device', d._cpu_device), ('_cuda_devices', lambda: d._cuda_devices(torch, False)),
                ('_other_accelerators', lambda: d._other_accelerators(torch)), ('fork_hazards', d.fork_hazards),
                ('detect', d.detect)]:
    try: f()
    except Exception as e: print(name, 'raised', repr(e))
    st(name)
from execnb.shell import CaptureShell; st('execnb')
from fastcore.test import *; from nbdev.showdoc import show_doc; st('showdoc')
import dtnb; st('import dtnb')
import torch.nn as nn
x = torch.randn(2, 8, device='cuda'); torch.cuda.synchronize(); a0 = torch.cuda.memory_allocated()
nn.Linear(8, 8, device='cuda')(x).sum().backward(); torch.cuda.synchronize(); a1 = torch.cuda.memory_allocated()
with torch.autocast('cuda', torch.bfloat16): nn.Linear(8, 8, device='cuda')(x).sum().backward()
torch.cuda.synchronize(); a2 = torch.cuda.memory_allocated()
m = nn.Linear(64, 64, device='cuda'); o = torch.optim.AdamW(m.parameters())
with torch.autocast('cuda', torch.bfloat16): m(torch.randn(32, 64, device='cuda')).sum().backward()
o.step(); del m, o; torch.cuda.synchronize(); a3 = torch.cuda.memory_allocated()
print('workspace probe: after x', a0, 'fp32 fwd/bwd', a1, 'bf16 fwd/bwd', a2, 'adamw step', a3, flush=True)
