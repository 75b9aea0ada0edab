"""find_lr on two data-parallel ranks equals one process on the whole batch: the same losses and suggestion on every
rank, and the model and optimizer as they were afterwards. The CPU is the subject: CPU ranks on gloo (`cpu_ranks`)."""
import pytest, torch
from dtnb.core.models import ToyModel, toy_data
from dtnb.launcher.processes import launch
from dtnb.parallel.ddp import distributed_loader
from dtnb.parallel.wrap import wrap
from dtnb.train.lr_finder import find_lr

pytestmark = pytest.mark.usefixtures('cpu_ranks')


def sweep(strategy):
    "find_lr under `strategy`; (its losses, its suggestion, whether weights, optimizer state and lr are unchanged)"
    torch.manual_seed(0)
    model = wrap(ToyModel(), strategy)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loader = distributed_loader(toy_data(512), global_batch_size=32)
    r = find_lr(model, loader, opt, num_steps=60)
    same = (all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and opt.state_dict()['state'] == {}
            and opt.param_groups[0]['lr'] == 0.01)
    return r.losses, r.suggestion, same


def test_find_lr_on_two_ranks_equals_one_process():
    n = torch.get_num_threads(); torch.set_num_threads(1)
    try: one = sweep('single')
    finally: torch.set_num_threads(n)
    two = launch(sweep, 'ddp', nprocs=2)
    assert one[2] and all(t[2] for t in two)                    # everything as it was, on every rank
    assert two[0][:2] == two[1][:2]                             # the ranks agree, bit for bit
    assert two[0][0] == pytest.approx(one[0], rel=1e-5)         # the mean loss over the ranks is one process's loss
    assert two[0][1] == one[1] and len(one[0]) < 60, one[1]     # the same suggestion; the sweep stopped on divergence
