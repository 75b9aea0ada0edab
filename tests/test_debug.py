"""check_equivalence and trace_collectives on real gloo ranks, and `dtnb check`: each cause named for a model that has
it, figures equal to a hand comparison, planted collective divergences found with their lines.
The CPU is the subject: ranks are CPU ranks on gloo on any machine (`cpu_ranks`, conftest.py)."""
import inspect
import pytest
import torch
import torch.nn.functional as F
import torch.distributed as dist
import torch.distributed.fsdp  # imported once here, so that forked ranks do not each pay for it
from torch.utils.data import DataLoader
from dtnb.cli import main
from dtnb.debug.collectives import trace_collectives
from dtnb.debug.equivalence import check_equivalence
from dtnb.launcher.processes import launch
from dtnb.parallel.ddp import make_optimizer
from dtnb.parallel.pipeline import causal_lm_loss
from dtnb.parallel.wrap import wrap
import models_debug as md

pytestmark = pytest.mark.usefixtures('one_thread_per_module', 'cpu_ranks')
STEPS, LR = 3, 0.05
CASES = dict(mlp_ddp=(md.mlp, 'ddp', md.batch, None), mlp_fsdp=(md.mlp, 'fsdp', md.batch, None),
             cnn_ddp=(md.cnn, 'ddp', lambda: (md.IMAGES, md.LABELS), F.cross_entropy))


def full(t): return (t.full_tensor() if hasattr(t, 'full_tensor') else t).detach().clone()


def by_hand(make, strategy, data, loss_fn, rank=0, world=1):
    "SGD written out: per step, the global loss, full gradients and parameters (this rank's half of each batch)"
    torch.manual_seed(0)
    model = make() if world == 1 else wrap(make(), strategy)
    opt = torch.optim.SGD(model.parameters(), lr=LR) if world == 1 else make_optimizer(model, torch.optim.SGD, lr=LR)
    x, y = (t.chunk(world)[rank] for t in data())
    out = []
    for _ in range(STEPS):
        loss = (loss_fn or F.mse_loss)(model(x), y)
        opt.zero_grad(); loss.backward()
        g = {n.removeprefix('module.'): full(p.grad) for n, p in model.named_parameters()}
        opt.step()
        ls = [loss.item()] * world
        if world > 1: dist.all_gather_object(ls, loss.item())  # equal halves: the global loss is the ranks' mean
        out.append((sum(ls) / world, g, {n.removeprefix('module.'): full(p) for n, p in model.named_parameters()}))
    return out


def hand_ranks():
    return {k: by_hand(*case, dist.get_rank(), dist.get_world_size()) for k, case in CASES.items()}


@pytest.fixture(scope='module')
def hand():
    "Each case's largest differences per step, DDP/FSDP by hand on 2 ranks beside one process by hand"
    ranks = launch(hand_ranks, nprocs=2, device='cpu', timeout=120)[0]
    out = {}
    for k, case in CASES.items():
        ref = by_hand(*case)
        mx = lambda a, b: max((a[n] - b[n]).abs().max().item() for n in b)
        out[k] = [(abs(l - rl), mx(g, rg), mx(p, rp)) for (l, g, p), (rl, rg, rp) in zip(ranks[k], ref)]
    return out


def figures(check): return [(r['loss'], r['grad'], r['param']) for r in check.rows]


def test_clean_mlp_is_equal_under_ddp_and_fsdp_and_its_figures_are_the_hand_comparison(hand):
    r = check_equivalence(md.mlp, md.batch(), strategies=['ddp', 'fsdp'], steps=STEPS, lr=LR)
    assert r.equal and all(c.causes == [] and c.first_step is None for c in r.checks.values()), r
    for s in ('ddp', 'fsdp'):
        for got, want in zip(figures(r[s]), hand[f'mlp_{s}']):
            assert got == pytest.approx(want, abs=1e-9), (s, got, want)  # both are rounding, around 1e-8
    assert 'equal to one process at every step' in str(r)


def test_batchnorm_cnn_under_ddp_names_batchnorm_and_its_figures_are_the_hand_comparison(hand):
    r = check_equivalence(md.cnn, (md.IMAGES, md.LABELS), loss_fn=F.cross_entropy, steps=STEPS, lr=LR)
    c = r['ddp']
    assert (c.first_step, c.first_what, [x.name for x in c.likely]) == (1, 'loss', ['batchnorm']), r
    assert "module '1' (BatchNorm2d)" in c.likely[0].evidence and 'sync_batchnorm=True' in c.likely[0].fix
    for got, want in zip(figures(c), hand['cnn_ddp']):
        assert got == pytest.approx(want, rel=1e-4, abs=1e-7), (got, want)
    assert min(f[0] for f in figures(c)) > 1e-4  # a real difference, not rounding
    assert c.first_param == '0.weight' and 'likely cause: batchnorm' in str(r)


def test_dropout_names_the_random_numbers_and_the_fix():
    c = check_equivalence(md.dropout_mlp, md.batch(), steps=2)['ddp']
    assert (c.first_step, [x.name for x in c.likely]) == (1, ['rng']), c
    assert "module '2' (Dropout)" in c.likely[0].evidence and 'torch.manual_seed(seed + rank)' in c.likely[0].fix
    assert 'same random state' in c.likely[0].evidence  # dtnb's ranks start from one state: same masks per share


def test_seven_samples_on_two_ranks_padding_in_a_loader_mean_of_means_in_a_batch():
    c = check_equivalence(md.mlp, DataLoader(md.seven(), batch_size=4))['ddp']
    assert (c.first_step, [x.name for x in c.likely]) == (2, ['padding']), c
    assert 'sample(s) [0]' in c.likely[0].evidence and [r['samples'] for r in c.rows] == [[2, 2]] * 3
    c = check_equivalence(md.mlp, (md.X[:7], md.Y[:7]), steps=1)['ddp']
    assert (c.first_step, c.first_what, [x.name for x in c.likely]) == (1, 'gradient', ['mean_of_means']), c
    assert c.rows[0]['loss'] < 1e-6 and c.rows[0]['samples'] == [4, 3]  # the loss is right, its gradient is not


def test_a_buffer_built_per_rank_is_found_under_fsdp_and_broadcast_by_ddp():
    r = check_equivalence(md.Shifted, md.batch(), strategies=['ddp', 'fsdp'], steps=1)
    assert r['ddp'].equal and [c.name for c in r['fsdp'].likely] == ['buffers'], r
    assert 'buffer shift differs' in r['fsdp'].likely[0].evidence


def test_trace_collectives_names_the_extra_all_reduce_and_equal_on_a_correct_step():
    t = trace_collectives(md.uneven_step, timeout=10)
    assert not t.equal and t.first_difference == 0
    assert t.at(0)[1].line.startswith('if dist.get_rank() == 1: dist.all_reduce(x)'), t
    lines, first = inspect.getsourcelines(md.uneven_step)
    at = first + next(i for i, l in enumerate(lines) if l.strip() == 'dist.all_reduce(x)')
    assert t.at(0)[0].line == 'dist.all_reduce(x)' and t.at(0)[0].where == f"{md.__file__}:{at}", t.at(0)[0]
    t = trace_collectives(md.metric_on_rank0, timeout=10)
    assert (t.first_difference, t.at(1)[1], t.returned) == (1, None, [False, True]), t
    assert 'rank 1 returned after 1 collectives' in t.error and 'metric on rank 0 only' in t.at(1)[0].line
    t = trace_collectives(md.stuck, timeout=1)  # rank 1 never comes: rank 0 stops at the timeout, and says so
    assert (t.first_difference, t.returned, [len(c) for c in t.calls]) == (0, [False, False], [1, 0]), t
    assert 'rank 1 did not issue it within 1s' in t.error
    t = trace_collectives(md.good_step)
    assert t.equal and [[c.op for c in cs] for cs in t.calls] == [['all_reduce', 'all_gather_object']] * 2, t


def test_trace_collectives_names_uneven_loader_lengths_and_an_fsdp_forward_on_one_rank():
    t = trace_collectives(md.uneven_loader, timeout=10)  # rank 0 has one more step: its 4th all_reduce has no partner
    (c0, c1), at = t.at(t.first_difference), line_of(md.uneven_loader, 'dist.all_reduce(loss.detach())')
    assert (t.first_difference, c1, t.returned) == (3, None, [False, True]), t
    assert c0.line.startswith('dist.all_reduce(loss.detach())') and c0.where == f"{md.__file__}:{at}", c0
    assert 'rank 1 returned after 3 collectives' in t.error
    t = trace_collectives(md.fsdp_forward_on_rank0, timeout=10)  # rank 0's forward all-gathers, rank 1 reduces
    c0, c1 = t.at(t.first_difference)
    assert c0.op.startswith('all_gather') and c0.line.startswith('if dist.get_rank() == 0: model(X)'), t
    assert c0.where == f"{md.__file__}:{line_of(md.fsdp_forward_on_rank0, 'if dist.get_rank() == 0')}", c0
    assert c1.op == 'all_reduce' and c1.line.startswith('dist.all_reduce(loss.detach())'), t
    assert t.first_difference > 0 and t.at(0)[0].signature() == t.at(0)[1].signature()  # the training step agrees


def line_of(fn, start):
    "The file line number of the first line of `fn` that starts with `start`"
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, l in enumerate(lines) if l.strip().startswith(start))


def test_a_forward_that_does_not_repeat_is_named_nondeterministic_with_the_fix():
    c = check_equivalence(md.noisy_mlp, md.batch(), steps=1)['ddp']
    assert (c.first_step, [x.name for x in c.likely]) == (1, ['nondeterministic']), c
    assert "module '3' (Noise)" in c.likely[0].evidence and 'differs from itself at step 1' in c.likely[0].evidence
    assert 'torch.use_deterministic_algorithms(True)' in c.likely[0].fix


def test_gpt2_with_tied_embeddings_under_a_pipeline_equal_and_by_hand_the_tied_copies_part():
    pytest.importorskip('transformers')
    import torch.distributed.pipelining  # noqa: F401  (once, before the ranks fork)
    from dtnb.core.utils import torch_version, TORCH_NEEDS
    check = lambda: check_equivalence(md.gpt2_tied, md.tokens(), strategies=['pipeline', md.pipeline_without_split],
                                      loss_fn=causal_lm_loss, steps=2)
    feature = 'integer tensors between pipeline stages'  # GPT-2's stages pass on its position ids
    if torch_version() < TORCH_NEEDS[feature][0]:
        with pytest.raises(Exception, match=f"{feature} needs torch >= 2.13"): check()
        return
    r = check()
    c = r['pipeline']  # dtnb's apply_pipeline sums the copies' gradients
    assert c.equal and c.causes == [] and max(row['loss'] for row in c.rows) < 1e-5, r
    assert 'transformer.wte.weight (stage 0) = lm_head.weight (stage 1)' in c.notes[0], c.notes
    assert [row['tied'] for row in c.rows] == [0., 0.] and 'note: tied weights split across stages' in str(r)
    c = r['pipeline_without_split']  # the same stages in a Pipeline built by hand, without split=
    assert (c.first_step, c.first_what, c.first_param, [x.name for x in c.likely]) == (
        1, 'gradient', 'transformer.wte.weight', ['tied']), r
    assert 'transformer.wte.weight (stage 0) = lm_head.weight (stage 1) are one parameter' in c.likely[0].evidence
    assert c.rows[0]['tied'] > 1e-4 and 'apply_pipeline(model, loss_fn, example=...)' in c.likely[0].fix
    assert c.rows[0]['loss'] < 1e-5  # the forward is right: only the tied weight's gradient is not


def test_dtnb_check_cli(capsys):
    assert main(['check', '--model', 'models_debug:dropout_mlp', '--batch', 'models_debug:batch', '--steps', '1']) == 1
    assert 'likely cause: rng' in capsys.readouterr().out
    assert main(['check', '--collectives', 'models_debug:uneven_step', '--timeout', '10']) == 1
    assert 'extra all_reduce on rank 1' in capsys.readouterr().out


def test_a_model_that_returns_logits_and_loss_is_checked_through_step_fn():
    """A nanoGPT-style forward(idx, targets) -> (logits, loss): `step_fn` says how a batch becomes a loss, as in `fit`
    (it was a TypeError here); DDP and FSDP equal one process. A pipeline refuses step_fn with the reason."""
    step = lambda m, b: m(*b)[1]
    r = check_equivalence(md.ClassicGPT, md.tokens(), strategies=('ddp', 'fsdp'), steps=STEPS, step_fn=step)
    assert r.equal and max(row['loss'] for c in r.checks.values() for row in c.rows) < 1e-5, r
    with pytest.raises(ValueError, match="computes the loss on the last stage from the model's output: pass loss_fn"):
        check_equivalence(md.ClassicGPT, md.tokens(), strategies=('pipeline',), step_fn=step)
