"""precision='fp8' on the CPU: refused, with the reason, wherever a user asks for it (wrap, parallelize, fit, the
planner); the message naming the extra when torchao is missing; and, through torchao's emulation (FP8 casts, fp32
matmuls: DTNB_FP8_EMULATE=1), the conversion wrap, parallelize and fit make themselves, trained on real gloo ranks:
DDP, FSDP and tensor parallel equal to one process, the loss close to bf16's. The speed and the loss on FP8 tensor
cores are tools/gpu_fp8_check.py's (tools/gpu_check.sh's `fp8` step)."""
import sys
import pytest
import torch
import torch.nn.functional as F
import torch.distributed.fsdp  # imported once here, so that forked ranks do not each pay for it
from dtnb.core.fp8 import float8_training, float8_linears, check_fp8
from dtnb.core.models import TinyTransformer, ToyModel
from dtnb.launcher.processes import launch
from dtnb.parallel.wrap import wrap
from dtnb.parallel.parallelize import parallelize, Degrees
from dtnb.plan.recommend import recommend
from dtnb.train.loop import fit

pytestmark = pytest.mark.usefixtures('one_thread_per_module', 'cpu_ranks')
REFUSED = "precision='fp8' needs FP8 tensor cores, on a CUDA GPU of compute capability 8.9 or newer"
STEPS, RANKS = 3, 2


def test_refused_on_the_cpu_with_the_reason():
    for call in (lambda: wrap(ToyModel(), 'single', precision='fp8'),
                 lambda: fit(ToyModel(), [], torch.optim.SGD(ToyModel().parameters()), precision='fp8'),
                 lambda: launch(lambda: parallelize(ToyModel(), Degrees(), precision='fp8'), nprocs=1)):
        with pytest.raises(Exception, match="needs FP8 tensor cores") as e: call()
        assert REFUSED in str(e.value) and "the CPU, which has no FP8 matmul" in str(e.value)
        assert "train in 'bf16-mixed' (the same memory)" in str(e.value)


def test_planner_refuses_a_device_without_fp8_and_plans_a_given_one():
    with pytest.raises(ValueError, match="needs FP8 tensor cores") as e: recommend(7e9, precision='fp8')
    assert 'has no FP8' in str(e.value)
    given = recommend(7e9, world_size=8, memory=80e9, precision='fp8')  # a device given by its memory: planned
    bf16 = recommend(7e9, world_size=8, memory=80e9, precision='bf16-mixed')
    assert [x.total for x in given.estimates] == [x.total for x in bf16.estimates] and given.strategy == bf16.strategy
    assert "precision='fp8'" in given.code and given.wrap_kwargs["precision"] == "fp8"


def test_missing_torchao_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m == 'torchao' or m.startswith('torchao.')] + ['torchao']:
        monkeypatch.setitem(sys.modules, name, None)  # `import torchao` raises ImportError, as when not installed
    with pytest.raises(ImportError, match=r'pip install "dtnb\[fp8\]"'): float8_training(ToyModel(), emulate=True)


torchao = pytest.importorskip('torchao.float8')  # the tests below train the emulated conversion


def model():
    m = TinyTransformer(d_out=16)  # every Linear's sizes multiples of 16: all of them FP8
    return float8_training(m, emulate=True)


@pytest.fixture
def emulated(monkeypatch):
    "DTNB_FP8_EMULATE=1: wrap, parallelize and fit convert with torchao's emulation themselves (ranks inherit it)"
    monkeypatch.setenv('DTNB_FP8_EMULATE', '1')


def data():
    g = torch.Generator().manual_seed(1)
    return [[(torch.randn(4, 8, 16, generator=g), torch.randn(4, 8, 16, generator=g)) for _ in range(RANKS)]
            for _ in range(STEPS)]  # [step][rank]: each rank's share of the step's batch


def one_process(precision='fp8'):
    "Each step's rank shares as micro-batches of one step: what DDP's averaged gradients equal; fit converts"
    m = TinyTransformer(d_out=16)  # precision='fp8': fit's own conversion (emulated)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    r = fit(m, [b for step in data() for b in step], opt, loss_fn=F.mse_loss, accumulate=RANKS, precision=precision,
            progress=False)
    return r.losses, {k: v.detach().clone() for k, v in m.state_dict().items()}


def on_ranks(strategy):
    import torch.distributed as dist
    r = dist.get_rank()
    m = TinyTransformer(d_out=16)  # converted by wrap or parallelize, before they shard it (emulated)
    m = parallelize(m, Degrees(tp=RANKS), precision='fp8') if strategy == 'tp' else wrap(m, strategy, precision='fp8')
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    loader = [step[0 if strategy == 'tp' else r] for step in data()]  # tp: every rank the whole batch
    res = fit(m, loader, opt, loss_fn=F.mse_loss, precision='fp32' if strategy == 'tp' else 'fp8', progress=False)
    full = lambda t: t.full_tensor() if hasattr(t, 'full_tensor') else t
    sd = {k.removeprefix('module.'): full(v).detach().clone() for k, v in m.state_dict().items()}
    return res.losses, sd, len(float8_linears(m))


def test_conversion_keeps_parameters_and_state_dict_keys():
    plain = TinyTransformer(d_out=16)
    m = model()
    assert len(float8_linears(m)) == sum(isinstance(x, torch.nn.Linear) for x in plain.modules()) == 14
    assert list(m.state_dict()) == list(plain.state_dict())  # checkpoints and exports read the same names
    assert float8_training(m) is m  # converted with emulation: taken as it is, on any device


@pytest.mark.parametrize('strategy', ['ddp', 'fsdp'])
def test_data_parallel_equal_one_process(strategy, emulated):
    losses, sd = one_process()
    got = launch(on_ranks, strategy, nprocs=RANKS)
    for r_losses, r_sd, n in got:
        assert n == 14
        torch.testing.assert_close(torch.tensor(r_losses), torch.tensor(losses), rtol=1e-5, atol=1e-6)
        for k in sd: torch.testing.assert_close(r_sd[k], sd[k], rtol=1e-5, atol=1e-6, msg=k)


def test_tensor_parallel_equal_one_process(emulated):
    """Tensor parallel splits each Float8Linear as it splits a Linear; every rank sees the whole batch. Without
    autocast (the FP8 casts stay): under bf16 autocast tp's partial sums round differently, bf16-mixed's own ~3e-4"""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    r = fit(m, [step[0] for step in data()], opt, loss_fn=F.mse_loss, precision='fp32', progress=False)
    sd = m.state_dict()
    for r_losses, r_sd, n in launch(on_ranks, 'tp', nprocs=RANKS):
        assert n == 14  # parallelize converted every Linear before splitting it
        torch.testing.assert_close(torch.tensor(r_losses), torch.tensor(r.losses), rtol=1e-5, atol=1e-6)
        for k in sd: torch.testing.assert_close(r_sd[k], sd[k], rtol=1e-5, atol=1e-6, msg=k)


def test_loss_close_to_bf16(emulated):
    "FP8's rounding (3-4 bits of mantissa) moves the loss, but by little: within 2% of bf16-mixed after the steps"
    fp8, _ = one_process('fp8')
    bf16, _ = one_process('bf16-mixed')
    assert fp8 != bf16  # FP8 did change the numbers
    for a, b in zip(fp8, bf16): assert abs(a - b) <= 0.02 * abs(b), (fp8, bf16)


def test_fit_refuses_before_changing_the_model_and_a_sharded_model_is_refused():
    m = TinyTransformer(d_out=16)
    with pytest.raises(ValueError, match=REFUSED): fit(m, [], torch.optim.SGD(m.parameters()), precision='fp8')
    assert float8_linears(m) == []  # refused before anything changed

    def sharded():
        m = wrap(TinyTransformer(d_out=16), 'fsdp')
        float8_training(m, emulate=True)
    with pytest.raises(Exception, match="already sharded") as e: launch(sharded, nprocs=RANKS)
    assert "pass precision='fp8' to wrap or parallelize" in str(e.value)
