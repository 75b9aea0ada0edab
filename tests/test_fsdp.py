"""FSDP on real gloo ranks: equal to one process under every option, half the bytes per rank, the traps caught.
The CPU is the subject: ranks are CPU ranks on gloo on any machine (`cpu_ranks`, conftest.py)."""
import gc
import pytest
import torch
import torch.nn.functional as F
import torch.distributed.fsdp  # imported once here, so that forked ranks do not each pay for it
from torch import nn
from dtnb.launcher.processes import launch
from dtnb.parallel.ddp import distributed_loader
from dtnb.parallel.wrap import wrap
from dtnb.parallel.fsdp import state_bytes, full_state_dict, check_optimizer, plan_fsdp, _step_pre_hook
from dtnb.core.models import ToyModel, Block, toy_data


pytestmark = pytest.mark.usefixtures('one_thread_per_module', 'cpu_ranks')


def make_opt(model, opt):
    return torch.optim.AdamW(model.parameters(), lr=1e-2) if opt == 'adamw' else torch.optim.SGD(model.parameters(),
                                                                                                 lr=0.05)


def reference(opt='adamw', steps=5, batch=16):
    torch.manual_seed(0)
    model, ds = ToyModel(), toy_data(256)
    o = make_opt(model, opt)
    for i in range(steps):
        x, y = ds[i * batch:(i + 1) * batch]
        o.zero_grad(); F.mse_loss(model(x), y).backward(); o.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


REF = {}
def ref(opt):
    if opt not in REF: REF[opt] = reference(opt)
    return REF[opt]


def train(opt='adamw', steps=5, meta=False, **options):
    "5 steps on this rank's share of each batch of 16; return the full parameters, every rank's local bytes, the export"
    if meta:
        with torch.device('meta'): model = ToyModel()
    torch.manual_seed(0)
    model = wrap(model if meta else ToyModel(), 'fsdp', **options)
    o = make_opt(model, opt)
    dl = iter(distributed_loader(toy_data(256), global_batch_size=16, shuffle=False))
    for _ in range(steps):
        x, y = next(dl)
        o.zero_grad(); F.mse_loss(model(x), y).backward(); o.step()
    return {k: p.full_tensor() for k, p in model.named_parameters()}, state_bytes(model, o), full_state_dict(model)


def max_diff(a, b): return max((a[k] - b[k]).abs().max().item() for k in b)


def single_bytes(opt='adamw'):
    torch.manual_seed(0)
    model = ToyModel(); o = make_opt(model, opt)
    x, y = toy_data(16)[:]
    F.mse_loss(model(x), y).backward(); o.step()
    return state_bytes(model, o)


@pytest.mark.parametrize('opt,options,eps', [
    ('adamw', {}, 1e-4),
    ('sgd', {}, 1e-5),
    ('adamw', dict(reshard_after_forward=False), 1e-4),
    ('adamw', dict(cpu_offload=True), 1e-4),
    ('adamw', dict(mesh=(1, 2)), 1e-4),
    ('adamw', dict(mesh=(2, 1)), 1e-4),
    ('adamw', dict(layer_cls='Linear'), 1e-4),
    ('adamw', dict(meta=True), 1e-4),
    ('adamw', dict(meta=True, mesh=(2, 1)), 1e-4),
    ('adamw', dict(meta=True, cpu_offload=True), 1e-4),
])
def test_two_ranks_equal_one_process(opt, options, eps):
    res = launch(train, opt, nprocs=2, **options)
    for params, _, _ in res: assert max_diff(params, ref(opt)) < eps
    assert max_diff(res[0][2], ref(opt)) < eps and res[1][2] == {}  # the export: full tensors on rank 0 only


def test_bytes_per_rank_are_half():
    one = single_bytes()
    for r in launch(train, nprocs=2):
        for k in ('parameters', 'gradients', 'optimizer'):
            assert abs(r[1][k] / one[k] - 0.5) <= 0.01, (k, r[1][k], one[k])  # within 2% of 1/2
    assert plan_fsdp(ToyModel(), mesh=(1, 2)).rank_bytes == one['parameters'] // 2


def test_four_ranks_hybrid_2x2():
    "2 replicas × 2 shards on 4 gloo ranks: equal to one process, and each rank holds half"
    one = single_bytes()
    for params, b, _ in launch(train, nprocs=4, mesh=(2, 2)):
        assert max_diff(params, ref('adamw')) < 1e-4
        assert abs(b['parameters'] / one['parameters'] - 0.5) <= 0.01


# The ranks below return the message of the error they catch: when ranks raise, `launch` stops the others as soon as
# the first one fails, and can then name a rank it stopped instead of the one that raised (a race in dtnb.launch).
def hooked() -> bool:
    "Whether dtnb's optimizer step hook is in torch's global hooks (it is only while a replaced parameter lives)"
    from torch.optim.optimizer import _global_optimizer_pre_hooks
    return any(h is _step_pre_hook for h in _global_optimizer_pre_hooks.values())


def optimizer_first(check):
    model = ToyModel()
    o = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model = wrap(model, 'fsdp')
    x, y = toy_data(16)[:]
    msg = None
    try:
        if check: check_optimizer(model, o)
        F.mse_loss(model(x), y).backward()
        o.step()
    except RuntimeError as e: msg = str(e)
    held = hooked()
    del o  # the last holder of the replaced parameters: the hook goes with them
    gc.collect()
    return msg, held, hooked()


@pytest.mark.parametrize('check', [False, True])
def test_optimizer_built_before_sharding_is_refused(check):
    for msg, held, after in launch(optimizer_first, check, nprocs=2):
        assert (held, after) == (True, False)
        assert msg == ("the optimizer holds 28 parameter(s) that are not the model's (sharded) parameters: "
                       "sharding replaced them, "
                       "so optimizer.step() would train nothing. Build the optimizer after wrap(model, 'fsdp') or "
                       "parallelize(model, degrees), e.g. torch.optim.AdamW(model.parameters())")


def optimizer_after():
    "In the right order no hook is left to get in the way: not of this optimizer, nor of one dtnb never saw"
    gc.collect()
    model = wrap(ToyModel(), 'fsdp')
    assert not hooked()
    o = torch.optim.SGD(model.parameters(), lr=0.1)
    check_optimizer(model, o)
    x, y = toy_data(16)[:]
    F.mse_loss(model(x), y).backward(); o.step(); o.step()
    other = nn.Linear(2, 2)
    torch.optim.SGD(other.parameters(), lr=0.1).step()
    return not hooked()


def test_optimizer_built_after_sharding_steps():
    assert launch(optimizer_after, nprocs=2) == [True, True]


def misuse(case):
    try:
        if case == 'layer': wrap(ToyModel(), 'fsdp', layer_cls='DecoderLayer')
        if case == 'mesh': wrap(ToyModel(), 'fsdp', mesh=(4, 1))
        if case == 'dtype': wrap(ToyModel(), 'fsdp', param_dtype='bf17')
        if case == 'twice': wrap(wrap(ToyModel(), 'fsdp'), 'fsdp')
        if case == 'meta':
            with torch.device('meta'): m = nn.Sequential(nn.Linear(2, 2), nn.Module())
            m[1].w = nn.Parameter(torch.ones(2))
            wrap(m, 'fsdp')
    except (ValueError, TypeError) as e: return str(e)


@pytest.mark.parametrize('case,msg', [
    ('layer', "layer_cls='DecoderLayer' is not a module class in this model; candidate block classes found: "
              "Block (4 in layers); other repeated classes: Linear (10)"),
    ('mesh', r"mesh=(4, 1) needs 4 ranks (4 replicas × 1 shards) but the world has 2: choose replicate × shard = 2, "
             r"e.g. (1, 2) or (2, 1)"),
    ('dtype', "param_dtype='bf17' is not a number format"),
    ('twice', "this model is already sharded (FSDPToyModel): wrap the original model once"),
    ('meta', "this meta-device model cannot be initialised: 1 (Module) hold parameters or buffers but have no "
             "reset_parameters(); pass init=fn"),
])
def test_errors_say_what_to_do(case, msg):
    for err in launch(misuse, case, nprocs=2): assert err is not None and msg in err, err


def test_no_process_group():
    with pytest.raises(RuntimeError, match="needs a process group: run it inside dtnb.launch"): wrap(ToyModel(), 'fsdp')


def test_full_state_dict_of_ddp_and_plain_models():
    "The export helper is not FSDP-only: DDP's 'module.' prefix is gone, and a plain model needs no group"
    def ddp_export(): return full_state_dict(wrap(ToyModel(), 'ddp'))
    r0, r1 = launch(ddp_export, nprocs=2)
    assert r1 == {} and max_diff(r0, dict(ToyModel().named_parameters())) == 0
    assert set(full_state_dict(ToyModel())) == set(r0)


def fit_fsdp(accumulate, clip, **options):
    from dtnb.train.loop import fit
    torch.manual_seed(0)
    model = wrap(ToyModel(), 'fsdp', **options)
    r = fit(model, distributed_loader(toy_data(256), global_batch_size=16 // accumulate, shuffle=False),
            make_opt(model, 'adamw'),
            accumulate=accumulate, clip=clip, max_steps=5, progress=False, log_every=2)
    return r.losses, r.strategy, {k: p.full_tensor() for k, p in model.named_parameters()}, r.grad_norms


@pytest.mark.parametrize('accumulate,clip,options', [(1, None, {}), (2, 0.5, {}), (2, 0.5,
    dict(reshard_after_forward=False, mesh=(2, 1)))])
def test_fit_runs_fsdp_unchanged(accumulate, clip, options):
    "dtnb.train.loop.fit on an FSDP model: the losses, gradient norms and parameters of the same fit in one process"
    from dtnb.train.loop import fit
    torch.manual_seed(0)
    model = ToyModel()
    one = fit(model, torch.utils.data.DataLoader(toy_data(256), batch_size=16 // accumulate), make_opt(model, 'adamw'),
              accumulate=accumulate, clip=clip, max_steps=5, progress=False, log_every=2)
    measured = [clip is not None or i % 2 == 1 for i in range(5)]  # without clip: the norms of the steps logged
    assert [n == n for n in one.grad_norms] == measured
    for losses, strategy, params, norms in launch(fit_fsdp, accumulate, clip, nprocs=2, **options):
        assert strategy == 'fsdp'
        assert max(abs(a - b) for a, b in zip(losses, one.losses)) < 1e-5
        assert [n == n for n in norms] == measured
        assert max(abs(a - b) / b for a, b in zip(norms, one.grad_norms) if b == b) < 1e-5, (norms, one.grad_norms)
        assert max_diff(params, dict(model.named_parameters())) < 1e-4
