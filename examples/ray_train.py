"""dtnb's wrap and fit inside Ray Train's TorchTrainer, unchanged: Ray starts the workers and their process group.

    pip install 'dtnb[ray]'
    python examples/ray_train.py                  # 2 CPU workers on gloo, on a local Ray started here
    python examples/ray_train.py --workers 4 --address auto --storage /shared/runs   # on a running Ray cluster

Ray Train runs `train_func` on every worker with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK,
MASTER_ADDR and MASTER_PORT set, and the default process group already initialised (gloo on CPU workers). dtnb asks
nothing more: `init_distributed()` returns Ray's group, `wrap` and `fit` use it, and `parse_launch_env()` names Ray
as the launcher. The global batch is fixed, so the parameters after N steps equal those of one process
(`train_func({'steps': N})` without Ray). The driver prints one JSON line: rank 0's report.
"""
import argparse, json, os, shutil, tempfile


def train_func(config):
    "One worker's training: the same code in one process, under torchrun, or in a Ray Train worker"
    import torch, torch.distributed as dist
    from dtnb.core.dist import world_size
    from dtnb.core.models import ToyModel, toy_data
    from dtnb.core.env import parse_launch_env
    from dtnb.launcher.processes import init_distributed, shutdown
    from dtnb.parallel.ddp import distributed_loader
    from dtnb.parallel.wrap import wrap
    from dtnb.train.loop import fit
    torch.set_num_threads(1)  # a tiny model: one thread per worker
    ours = not dist.is_initialized()  # True in one process; under Ray the group is Ray's
    init_distributed()  # under Ray: Ray's group, as it is; in one process: a group of one
    torch.manual_seed(0)
    model = wrap(ToyModel(), 'ddp' if world_size() > 1 else 'single')
    loader = distributed_loader(toy_data(256), global_batch_size=16, shuffle=False)
    res = fit(model, loader, torch.optim.SGD(model.parameters(), lr=0.05), max_steps=config['steps'],
              progress=False)
    params = [float(v) for p in getattr(model, 'module', model).parameters() for v in p.detach().flatten()]
    le = parse_launch_env()
    out = dict(world_size=world_size(), launcher=le.launcher, summary=le.summary(), group_was_ours=ours,
               losses=res.losses, params=params)
    del model
    if ours: shutdown()  # the group init_distributed started (one process); Ray ends its own
    return out


def ray_train_func(config):
    "The function each Ray worker runs: train, then hand rank 0's results to the driver (in a checkpoint)"
    import ray.train
    out = train_func(config)
    with tempfile.TemporaryDirectory() as d:
        rank0 = ray.train.get_context().get_world_rank() == 0
        if rank0: open(os.path.join(d, 'result.json'), 'w').write(json.dumps(out))
        ckpt = ray.train.Checkpoint.from_directory(d) if rank0 else None
        ray.train.report(dict(loss=out['losses'][-1]), checkpoint=ckpt)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--workers', type=int, default=2)
    ap.add_argument('--steps', type=int, default=5)
    ap.add_argument('--address', default=None, help="a running Ray cluster ('auto'); default: start a local one")
    ap.add_argument('--temp-dir', default=None, help="Ray's session folder (a local Ray only); default: Ray's own")
    ap.add_argument('--storage', default=None, help="where Ray keeps the run (shared by the nodes of a cluster); "
                                                    "default: a temporary folder, removed at the end")
    a = ap.parse_args()
    import ray
    from ray.train import ScalingConfig, RunConfig
    from ray.train.torch import TorchTrainer, TorchConfig
    local = dict(num_cpus=a.workers, include_dashboard=False, _temp_dir=a.temp_dir)  # on this machine's address
    ray.init(address=a.address, **({} if a.address else local))
    storage = a.storage or tempfile.mkdtemp(prefix='dtnb-ray-')  # the run, and rank 0's result in its checkpoint
    try:
        trainer = TorchTrainer(ray_train_func, train_loop_config=dict(steps=a.steps),
                               scaling_config=ScalingConfig(num_workers=a.workers, use_gpu=False),
                               torch_config=TorchConfig(backend='gloo'), run_config=RunConfig(storage_path=storage))
        with trainer.fit().checkpoint.as_directory() as d:
            print(open(os.path.join(d, 'result.json')).read(), flush=True)
    finally:
        ray.shutdown()
        if not a.storage: shutil.rmtree(storage, ignore_errors=True)


if __name__ == '__main__':
    main()
