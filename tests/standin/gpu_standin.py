"""A stand-in for one device query: torch's CPU build answering as a node with `n` CUDA GPUs.

Only the `torch.accelerator` answers that dtnb asks change (which accelerator torch was built for, how many devices
it counts, which is current); torch, its tensors and torch.distributed stay real. Whether one is *available* keeps
its real answer, no (`is_available()`, `current_accelerator(check_available=True)`): torch's own code asks that
before it uses a device stream (Adam's graph-capture check), which a real GPU node has and this stand-in cannot
give. Code that places work through dtnb's `accelerators()` / `current_device()` then sees a GPU node, and anything
it would put on a GPU fails at once with "Torch not compiled with CUDA enabled". So a CPU machine can prove that
work pinned to the CPU (`DTNB_DEVICE=cpu`, `launch(device='cpu')`) never reaches for a GPU, which is what a one-GPU
machine needs of the 2-rank tests.
"""
import torch

REAL = torch.accelerator.device_count() > 0  # a real device here (a CUDA build without a GPU counts 0: stand in there)


def answers(n: int) -> dict:
    "torch.accelerator's answers on a node with `n` CUDA GPUs, by function name"
    return dict(current_accelerator=lambda check_available=False: None if check_available else torch.device('cuda'),
                device_count=lambda: n, current_device_index=lambda: 0)


def apply(n: int, setattr=setattr) -> bool:
    """Make torch.accelerator answer as a node with `n` CUDA GPUs (through `setattr`: pytest's monkeypatch.setattr
    undoes it); False, and nothing changed, where a real accelerator is here"""
    if n <= 0 or REAL: return False
    for name, f in answers(n).items(): setattr(torch.accelerator, name, f)
    return True
