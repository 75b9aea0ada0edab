"""Train dtnb's example model data-parallel, with the same code under every launcher.

    python examples/train.py                      # one process
    dtnb launch -n 2 examples/train.py            # 2 local ranks through torchrun
    torchrun --nproc-per-node=2 examples/train.py
    srun python examples/train.py                 # on SLURM (examples/slurm.sbatch)
    python examples/train.py --checkpoint-dir ckpt --every 5   # checkpoints; a rerun resumes from the newest

The global batch is fixed (--global-batch), so every launch computes the same steps: the final losses and
parameters agree whatever the number of ranks. The main rank prints one JSON line with the results: the losses, a
checksum and a hash of the final parameters' bytes (equal hashes: bitwise equal parameters).
"""
import argparse, hashlib, json, sys
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
    ap.add_argument('--epochs', type=int, default=1, help="passes over the 512 samples (32 steps each at batch 16)")
    ap.add_argument('--global-batch', type=int, default=16)
    ap.add_argument('--strategy', default='ddp', choices=['ddp', 'fsdp', 'single'])
    ap.add_argument('--lr', type=float, default=0.05)
    ap.add_argument('--checkpoint-dir', default=None, help="save checkpoints here; resume from the newest one found")
    ap.add_argument('--every', type=int, default=None, help="save a checkpoint every N steps (and at the end)")
    a = ap.parse_args()
    init_distributed()
    torch.manual_seed(0)
    model = wrap(ToyModel(), a.strategy if world_size() > 1 or a.strategy != 'ddp' else 'ddp')
    opt = torch.optim.SGD(model.parameters(), lr=a.lr)
    loader = distributed_loader(toy_data(512), global_batch_size=a.global_batch, shuffle=False)
    res = fit(model, loader, opt, epochs=a.epochs, max_steps=a.steps, progress=False,
              checkpoint_dir=a.checkpoint_dir, checkpoint_every=a.every)
    inner = getattr(model, 'module', model)
    checksum = sum(p.detach().double().sum().item() for p in inner.parameters())
    sha = hashlib.sha256(b''.join(p.detach().cpu().numpy().tobytes() for p in inner.parameters())).hexdigest()
    if is_main():  # one write, newline included (print writes the newline apart, and another writer may come between)
        sys.stdout.write(json.dumps(dict(world_size=world_size(), steps=res.steps, losses=res.losses, checksum=checksum,
                                         params_sha256=sha, start_step=res.start_step,
                                         samples_per_s=res.samples_per_s)) + '\n')
        sys.stdout.flush()
    del model, opt
    shutdown()


if __name__ == '__main__':
    main()
