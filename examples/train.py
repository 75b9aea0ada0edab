"""Train dtnb's example model data-parallel, with the same code under every launcher.

    python examples/train.py                      # one process
    dtnb launch -n 2 examples/train.py            # 2 local ranks through torchrun
    torchrun --nproc-per-node=2 examples/train.py
    srun python examples/train.py                 # on SLURM

The global batch is fixed (--global-batch), so every launch computes the same steps: the final losses and
parameters agree whatever the number of ranks. The main rank prints one JSON line with the results.
"""
import argparse, json
import torch
from dtnb.launcher.processes import init_distributed, shutdown
from dtnb.core.dist import is_main, world_size
from dtnb.parallel.ddp import distributed_loader
from dtnb.parallel.wrap import wrap
from dtnb.core.models import ToyModel, toy_data
from dtnb.train.loop import fit


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--steps', type=int, default=10)
    ap.add_argument('--global-batch', type=int, default=16)
    ap.add_argument('--strategy', default='ddp', choices=['ddp', 'fsdp', 'single'])
    ap.add_argument('--lr', type=float, default=0.05)
    a = ap.parse_args()
    init_distributed()
    torch.manual_seed(0)
    model = wrap(ToyModel(), a.strategy if world_size() > 1 or a.strategy != 'ddp' else 'ddp')
    opt = torch.optim.SGD(model.parameters(), lr=a.lr)
    loader = distributed_loader(toy_data(512), global_batch_size=a.global_batch, shuffle=False)
    res = fit(model, loader, opt, max_steps=a.steps, progress=False)
    inner = getattr(model, 'module', model)
    checksum = sum(p.detach().double().sum().item() for p in inner.parameters())
    if is_main():
        print(json.dumps(dict(world_size=world_size(), steps=res.steps, losses=res.losses, checksum=checksum,
                              samples_per_s=res.samples_per_s)), flush=True)
    del model, opt
    shutdown()


if __name__ == '__main__':
    main()
