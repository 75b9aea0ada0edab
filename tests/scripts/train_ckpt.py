"""Train with checkpoints under `dtnb launch --max-restarts=K`; optionally one rank kills itself mid-run.

    dtnb launch -n 2 --max-restarts=1 tests/scripts/train_ckpt.py --dir CKPTS --out final.pt --kill-at 7

`--kill-at S`: rank `--kill-rank` sends itself SIGKILL in the forward pass of step S, in the first attempt only
(torchrun's TORCHELASTIC_RESTART_COUNT is 0), so torchrun restarts the group and `fit` resumes from the newest
complete checkpoint. The main rank writes the final parameters to `--out` and prints one JSON line.
"""
import argparse, json, os, signal
import torch
from torch import nn
from dtnb.launcher.processes import init_distributed, shutdown
from dtnb.core.dist import rank, is_main, world_size
from dtnb.parallel.ddp import distributed_loader
from dtnb.parallel.wrap import wrap
from dtnb.core.models import ToyModel, toy_data
from dtnb.train.loop import fit
from dtnb.train.export import export_model


def train(steps=12, every=3, dir=None, out=None, kill_at=0, kill_rank=1) -> dict:
    "Train DDP ToyModel for `steps` with checkpoints in `dir`; export the final parameters to `out`: fit's result"
    init_distributed()
    attempt = int(os.environ.get('TORCHELASTIC_RESTART_COUNT', '0'))
    torch.manual_seed(0)
    model = wrap(ToyModel(), 'ddp' if world_size() > 1 else 'single')
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = distributed_loader(toy_data(96), global_batch_size=16, shuffle=True)
    calls = 0

    def loss_fn(out, y):
        nonlocal calls
        calls += 1
        if calls == kill_at and attempt == 0 and rank() == kill_rank:
            print(f"rank {rank()}: SIGKILL at step {calls}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return nn.functional.mse_loss(out + 0.05 * torch.randn_like(out), y)

    res = fit(model, loader, opt, loss_fn, epochs=3, max_steps=steps, progress=False, checkpoint_dir=dir,
              checkpoint_every=every)
    export_model(out, model)
    return dict(attempt=attempt, world_size=world_size(), steps=res.steps, start_step=res.start_step,
                resumed_from=res.resumed_from, losses=res.losses)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--steps', type=int, default=12)
    ap.add_argument('--every', type=int, default=3)
    ap.add_argument('--dir', required=True, help="checkpoint directory")
    ap.add_argument('--out', required=True, help="final parameters (.pt or .safetensors)")
    ap.add_argument('--kill-at', type=int, default=0, help="step whose forward pass kills a rank (0: none)")
    ap.add_argument('--kill-rank', type=int, default=1)
    a = ap.parse_args()
    r = train(a.steps, a.every, a.dir, a.out, a.kill_at, a.kill_rank)
    if is_main(): print(json.dumps(r), flush=True)
    shutdown()


if __name__ == '__main__':
    main()
