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


def regression(seed=2):
    "y = xW + noise, features of uneven scale; and plain SGD's largest stable rate on its MSE, 2 / λmax of the Hessian"
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1024, 16, generator=g) * torch.linspace(0.2, 3, 16)
    y = x @ torch.randn(16, 4, generator=g) + 0.1 * torch.randn(1024, 4, generator=g)
    return torch.utils.data.TensorDataset(x, y), 2 / torch.linalg.eigvalsh(2 * x.T @ x / y.numel()).max().item()


def known_sweep(strategy, seed, plain=False):
    "find_lr on a linear model and `regression(seed)`, batches of 16 (global), plain SGD: (suggestion, old rule, bound)"
    ds, bound = regression(seed)
    torch.manual_seed(seed)
    model = wrap(torch.nn.Linear(16, 4, bias=False), strategy)
    loader = (torch.utils.data.DataLoader(ds, batch_size=16, shuffle=True) if plain else
              distributed_loader(ds, global_batch_size=16, shuffle=True, seed=seed))
    r = find_lr(model, loader, torch.optim.SGD(model.parameters(), lr=0.01), loss_fn=torch.nn.functional.mse_loss)
    return r.suggestion, r.min_lr / 10, bound


def test_suggestion_where_the_old_rule_said_a_tenth_of_the_start():
    "The case of the issue: the EMA never fell below the first batches', and the old rule (its lowest / 10) said 1e-8"
    suggestion, old, bound = known_sweep('single', 2, plain=True)
    assert bound / 100 <= suggestion <= bound and old < 1e-7, (suggestion, old, bound)


@pytest.mark.parametrize('seed', [2, 5])
def test_suggestion_lies_below_the_known_stable_bound_on_one_and_two_ranks(seed):
    "Where the answer is known: between 1/100 of 2/λmax and 2/λmax, in one process and on 2 ranks (the same rate)"
    one = known_sweep('single', seed)
    two = launch(known_sweep, 'ddp', seed, nprocs=2)
    for suggestion, _, bound in [one, *two]: assert bound / 100 <= suggestion <= bound, (one, two)
    assert two[0][0] == two[1][0] == pytest.approx(one[0], rel=1e-6), (one, two)
