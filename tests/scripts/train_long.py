"""Train dtnb's example model data-parallel with `fit` for a long time (until stopped), printing one line when the
first step is done: the subject of the lost-peer tests (tests/test_cluster.py), which cut a host off mid-training.

    dtnb launch -n 1 --nnodes=2 --node-rank=R --master-addr=10.77.0.1 tests/scripts/train_long.py
"""
import sys, time
import torch
from dtnb.launcher.processes import init_distributed, shutdown
from dtnb.core.dist import rank
from dtnb.parallel.ddp import distributed_loader
from dtnb.parallel.wrap import wrap
from dtnb.core.models import ToyModel, toy_data
from dtnb.train.loop import fit
from dtnb.train.callbacks import Callback


class Announce(Callback):
    "Say when training has begun; then slow down so that the ranks keep 2 cores free for the test"
    def on_step_end(self, state):
        if state.step == 1: print(f"rank {rank()}: training", flush=True)
        time.sleep(0.1 if rank() == 1 else 0.02)  # rank 1 lags: a kill finds the others waiting in a collective that
                                                   # it never issued (a lost peer, not a skipped collective)


def main():
    init_distributed()
    torch.manual_seed(0)
    model = wrap(ToyModel(), 'ddp')
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = distributed_loader(toy_data(512), global_batch_size=12)
    fit(model, loader, opt, epochs=10**6, max_steps=int(sys.argv[1]) if len(sys.argv) > 1 else None, progress=False,
        callbacks=[Announce()])
    del model, opt
    shutdown()


if __name__ == '__main__':
    main()
