"""One way to say how a batch becomes a loss (issue 40): `loss_fn`, `step_fn` and `keys` mean the same to every entry
point that runs a model on a batch. A nanoGPT-style model, whose `forward(idx, targets)` returns `(logits, loss)`,
goes through each with one `step_fn`; a dict-batch classifier with `keys=`; and an `(x, y)` pair without `loss_fn`
is inputs and targets everywhere. The CPU is the subject: ranks are CPU ranks on gloo (`cpu_ranks`, conftest.py)."""
import pytest
import torch, torch.nn as nn, torch.nn.functional as F
from dtnb.core.batches import BatchLoss, forward_loss, split_batch
from dtnb.plan.activations import trace_activations
from dtnb.plan.memory import estimate_memory
from dtnb.plan.measure import measure_memory
from dtnb.plan.batch_size import find_batch_size, batch_of
from dtnb.bench.throughput import bench_model, step_flops
from dtnb.debug.equivalence import check_equivalence
from dtnb.train.loop import fit
import models_debug as md

pytestmark = pytest.mark.usefixtures('cpu_ranks')

GPT_STEP = lambda m, b: m(*b)[1]  # forward(idx, targets) -> (logits, loss): the loss
B, T, V = 8, 8, 32                # md.tokens(): 8 sequences of 8 tokens, a vocabulary of 32


def gpt():
    torch.manual_seed(0)
    return md.ClassicGPT(vocab=V, n_embd=16, n_head=2, block=T)


def ce_bytes():
    "What the model's own cross-entropy keeps for backward: fp32 log-softmax, int64 targets, a 4-byte total weight"
    return B * T * V * 4 + B * T * 8 + 4


# ---- a nanoGPT-style model: one step_fn everywhere ------------------------------------------------------------------

def test_gpt_memory_measured_equals_estimated_with_step_fn():
    "One real step beside the estimate, as for plain models: model states exact, activations as traced"
    batch = md.tokens()
    r = measure_memory(gpt(), batch, step_fn=GPT_STEP)
    assert r.exact, str(r)
    assert r.measured[0]['activations'] == r.estimates[0].activations > 0
    est = estimate_memory(gpt(), batch=batch, step_fn=GPT_STEP)
    assert est.activations == r.estimates[0].activations and est.total == r.estimates[0].total
    # the step_fn's loss is traced: its cross-entropy's saved tensors on top of the logits' graph alone
    logits_only = trace_activations(gpt(), batch[0])  # inputs alone: the logits' sum stands in for a loss
    assert est.activations - logits_only.saved == ce_bytes()
    assert trace_activations(gpt(), batch, step_fn=GPT_STEP).saved == est.activations


def test_gpt_memory_on_two_ddp_ranks_with_step_fn():
    r = measure_memory(gpt(), md.tokens(), 'ddp', world_size=2, step_fn=GPT_STEP, timeout=120)
    assert r.exact and [m['rank'] for m in r.measured] == [0, 1]
    assert all(m['activations'] == e.activations for e, m in zip(r.estimates, r.measured)), str(r)


def test_gpt_without_step_fn_says_what_to_pass():
    for call in (lambda: estimate_memory(gpt(), batch=md.tokens()), lambda: measure_memory(gpt(), md.tokens()),
                 lambda: bench_model(gpt(), md.tokens(), steps=1, warmup=0, matmul_peak=1.0, device='cpu'),
                 lambda: forward_loss(gpt(), md.tokens())):
        with pytest.raises(ValueError, match=r"step_fn=lambda model, batch: model\(\*batch\)\[1\]"): call()


def test_gpt_batch_size_with_step_fn():
    "The largest batch is the one whose estimate, traced through the step_fn, fits the budget"
    sample = md.tokens()
    found = find_batch_size(gpt(), sample, step_fn=GPT_STEP, memory='8MB')
    assert found.method == 'estimate' and found.batch_size > 1, found
    fits = lambda n: estimate_memory(gpt(), batch=batch_of(sample, n), step_fn=GPT_STEP).total
    assert found.bytes == fits(found.batch_size) <= found.budget
    assert found.next_batch is None or fits(found.next_batch) > found.budget
    plain = find_batch_size(gpt(), sample[0], memory='8MB')  # inputs alone: no cross-entropy to keep
    assert plain.batch_size >= found.batch_size


def test_gpt_bench_model_with_step_fn():
    model, batch = gpt(), md.tokens()
    before = [p.detach().clone() for p in model.parameters()]
    r = bench_model(model, batch, step_fn=GPT_STEP, steps=3, warmup=1, matmul_peak=1.0, device='cpu')
    assert r.summary['samples/s'] > 0 and r.summary['tokens/s'] == pytest.approx(T * r.summary['samples/s'])
    assert r.summary['FLOPs per step'] == step_flops(gpt(), batch, step_fn=GPT_STEP) > 0
    assert r.config['batch'] == [B, T]
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # it trained on the step_fn's loss


def test_gpt_equivalence_and_fit_with_step_fn():
    "check_equivalence and fit already took step_fn: the same one, unchanged"
    r = check_equivalence(gpt, md.tokens(), strategies=['ddp'], step_fn=GPT_STEP, steps=2)
    assert r.equal, str(r)
    x, y = md.tokens()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    model = gpt()
    res = fit(model, loader, torch.optim.SGD(model.parameters(), lr=0.1), step_fn=GPT_STEP, max_steps=2,
              progress=False)
    assert len(res.losses) == 2 and res.losses[0] == pytest.approx(GPT_STEP(gpt(), (x[:4], y[:4])).item())


def make_tokens(): return md.tokens()


def test_gpt_report_with_step_fn(tmp_path):
    "report(...) plans and trains the nanoGPT model through the step_fn; a pipeline cannot cut a step_fn: skipped"
    from dtnb.reporting.sections import report
    rep = report(tmp_path, quick=True, model=gpt, batch=make_tokens, step_fn=GPT_STEP,
                 sections=['plan', 'training'], progress=False)
    plan, training = rep.sections
    assert plan.error is None and training.error is None, (plan.error, training.error)
    assert 'your step_fn' in training.data['description']
    runs = training.data['runs']
    assert runs['single']['losses'] and training.data['agree'] is True
    assert 'step_fn' in runs['pipeline']['skipped']
    assert plan.data['plan']['strategy']


def test_report_task_takes_the_three():
    "report's Task carries loss_fn, step_fn and keys to the sections; without them the loss is derived as before"
    from dtnb.reporting.sections import Task
    t = Task(gpt, batch=make_tokens, how=BatchLoss(step_fn=GPT_STEP))
    assert t.loss_fn is None and t.batch_loss() == BatchLoss(None, GPT_STEP, None)
    assert forward_loss(gpt(), make_tokens(), t.batch_loss())[0].dim() == 0
    assert Task(lambda: nn.Linear(4, 1), input_shape=(4,)).batch_loss().loss_fn is F.mse_loss
    d = Task(classifier, batch=make_dict, how=BatchLoss(F.cross_entropy, keys=KEYS))
    x, y = d.examples(10)  # keys pick the pair out of the dict batch; the report trains on (inputs, targets)
    assert x.shape == (10, 16) and torch.equal(y[:8], LABELS) and d.batch_loss() == BatchLoss(F.cross_entropy)
    with pytest.raises(ValueError, match=r"say which are the input and the target with keys="):
        Task(classifier, batch=make_dict).examples(4)


def make_dict(): return dict(DICT)


def test_report_with_a_dict_batch_and_keys(tmp_path):
    "report(...) on a dict batch: keys= names its input and target, loss_fn its loss; every strategy agrees"
    from dtnb.reporting.sections import report
    rep = report(tmp_path, quick=True, model=classifier, batch=make_dict, keys=KEYS, loss_fn=F.cross_entropy,
                 sections=['plan', 'training'], progress=False)
    plan, training = rep.sections
    assert plan.error is None and training.error is None, (plan.error, training.error)
    assert training.data['agree'] is True and 'cross_entropy' in training.data['description']
    assert 'losses' in training.data['runs']['pipeline']  # a loss_fn: the pipeline trains too


# ---- a dict batch with keys= ----------------------------------------------------------------------------------------

def classifier():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3))

X16, LABELS = torch.randn(8, 16, generator=torch.Generator().manual_seed(0)), torch.arange(8) % 3
DICT, KEYS, PAIR = dict(image=X16, label=LABELS, id=torch.arange(8)), ('image', 'label'), (X16, LABELS)


def test_dict_batch_with_keys_everywhere_as_its_pair():
    "A dict batch split by keys= costs and runs what the (inputs, targets) pair does, in every entry point"
    kw, ce = dict(keys=KEYS, loss_fn=F.cross_entropy), F.cross_entropy
    r = measure_memory(classifier(), DICT, **kw)
    assert r.exact and r.measured[0]['activations'] == r.estimates[0].activations
    pair = measure_memory(classifier(), PAIR, loss_fn=ce)
    assert r.measured[0]['activations'] == pair.measured[0]['activations']
    assert estimate_memory(classifier(), batch=DICT, **kw).total == estimate_memory(classifier(), batch=PAIR,
                                                                                     loss_fn=ce).total
    assert (find_batch_size(classifier(), DICT, memory='1MB', **kw).batch_size
            == find_batch_size(classifier(), PAIR, memory='1MB', loss_fn=ce).batch_size > 0)
    b = bench_model(classifier(), DICT, steps=2, warmup=0, matmul_peak=1.0, device='cpu', **kw)
    assert b.summary['FLOPs per step'] == step_flops(classifier(), PAIR, ce) and b.config['batch'] == [8, 16]
    with pytest.raises(ValueError, match="dict with keys 'image', 'label', 'id' to Sequential.forward"):
        estimate_memory(classifier(), batch=DICT, loss_fn=ce)  # without keys: the names are not the model's
    with pytest.raises(ValueError, match="no 'x'"): measure_memory(classifier(), DICT, keys=('x', 'label'))


def test_a_batch_loss_passes_where_only_loss_fn_is_taken():
    "recommend takes loss_fn only: a BatchLoss given as loss_fn carries the step_fn and keys through"
    from dtnb.plan.recommend import recommend
    p = recommend(gpt(), md.tokens(), world_size=1, memory=1e9, loss_fn=BatchLoss(step_fn=GPT_STEP))
    assert p.estimates[p.chosen].activations == estimate_memory(gpt(), batch=md.tokens(), step_fn=GPT_STEP).activations
    assert BatchLoss.of(BatchLoss(F.cross_entropy), keys=KEYS) == BatchLoss(F.cross_entropy, None, KEYS)
    with pytest.raises(ValueError, match="pass step_fn, or loss_fn/keys, not both"):
        BatchLoss.of(BatchLoss(step_fn=GPT_STEP), keys=KEYS)  # a step_fn says the whole step, as in `fit`


# ---- an (x, y) pair without loss_fn: one meaning ------------------------------------------------------------------

class Strict(nn.Module):
    "Takes its inputs only: a second argument means the targets were fed to it"
    def __init__(self): super().__init__(); torch.manual_seed(0); self.lin = nn.Linear(16, 3)
    def forward(self, x, *rest):
        assert not rest, "the targets were fed to the model"
        return self.lin(x)


class OwnLoss(nn.Module):
    "Hugging Face style: labels= in, an output with .loss"
    def __init__(self): super().__init__(); torch.manual_seed(0); self.lin = nn.Linear(16, 3)
    def forward(self, x, labels=None):
        logits = self.lin(x)
        return dict(logits=logits, loss=None if labels is None else F.cross_entropy(logits, labels))


def test_a_pair_is_inputs_and_targets_everywhere():
    "(x, y) without loss_fn: model(x), and fit's loss (mse where it fits) in the planner, fit and the benchmark"
    y = torch.randn(8, 3)
    assert split_batch(Strict(), (X16, y)) == (((X16,), {}), y)
    assert forward_loss(Strict(), (X16, y))[0].item() == F.mse_loss(Strict()(X16), y).item()  # fit's meaning
    est = estimate_memory(Strict(), batch=(X16, y))
    assert est.activations == estimate_memory(Strict(), batch=(X16, y), loss_fn=F.mse_loss).activations
    r = measure_memory(Strict(), (X16, y))
    assert r.exact and r.measured[0]['activations'] == est.activations
    assert find_batch_size(Strict(), (X16, y), memory='1MB').batch_size > 0
    assert bench_model(Strict(), (X16, y), steps=1, warmup=0, matmul_peak=1.0, device='cpu').summary['samples/s'] > 0


def test_integer_targets_without_loss_fn():
    "Training and planning refuse to guess (the error names cross_entropy); the benchmark keeps its default_loss"
    for call in (lambda: forward_loss(Strict(), PAIR), lambda: estimate_memory(Strict(), batch=PAIR),
                 lambda: measure_memory(Strict(), PAIR)):
        with pytest.raises(ValueError, match="loss_fn=torch.nn.functional.cross_entropy"): call()
    assert step_flops(Strict(), PAIR) == step_flops(Strict(), PAIR, F.cross_entropy)  # default_loss: cross-entropy


def test_a_model_with_its_own_loss_gets_labels_from_a_pair():
    "Without loss_fn a model whose forward takes labels= gets model(x, labels=y) and its own loss, in every room"
    own = forward_loss(OwnLoss(), PAIR)[0]
    assert own.item() == F.cross_entropy(OwnLoss().lin(X16), LABELS).item()
    by_name = estimate_memory(OwnLoss(), batch=dict(x=X16, labels=LABELS)).activations
    assert estimate_memory(OwnLoss(), batch=PAIR).activations == by_name
    assert measure_memory(OwnLoss(), PAIR).measured[0]['activations'] == by_name
    assert step_flops(OwnLoss(), PAIR) == step_flops(OwnLoss(), PAIR, F.cross_entropy)
    mine = forward_loss(OwnLoss(), PAIR, loss_fn=lambda p, y: F.cross_entropy(p, y) * 0)[0]  # a loss_fn reads .logits
    assert mine.item() == 0


# ---- the entry points that price or scale a step: trace_step, op_compute, predict, bench_scaling, recommend ----------

class Logits(nn.Module):
    "The same nanoGPT model returning its logits alone: its loss said by a loss_fn instead of a step_fn"
    def __init__(self, m): super().__init__(); self.m = m
    def forward(self, idx): return self.m(idx)[0]

def token_ce(logits, y): return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))  # as the model's own

TWICE = lambda m, b: 2 * m(*b)[1]
NOT_A_LOSS = "step_fn(model, batch) must return the loss, one number (or (loss, predictions, targets)); it returned a"


def test_trace_step_and_op_compute_with_step_fn():
    "The traced step through the step_fn is the step of the same model returning logits with the equivalent loss_fn"
    from dtnb.bench.ops import trace_step, op_compute
    batch = md.tokens()
    for device in ('meta', 'cpu'):
        mine = trace_step(gpt(), batch, step_fn=GPT_STEP, optimizer='sgd', device=device)
        same = trace_step(Logits(gpt()), batch, token_ce, optimizer='sgd', device=device)
        assert mine.flops == same.flops > 0 and [o.name for o in mine.ops] == [o.name for o in same.ops]
        twice = trace_step(gpt(), batch, step_fn=TWICE, optimizer='sgd', device=device)
        assert len(twice.ops) > len(mine.ops)  # its doubling: a mul forward, one backward
    h200 = op_compute(gpt(), batch, 'H200', step_fn=GPT_STEP)
    assert h200.total == op_compute(Logits(gpt()), batch, 'H200', loss_fn=token_ce).total > 0


def test_predict_with_step_fn():
    "predict's plan, FLOPs and op-level compute go through the step_fn: the figures of the equivalent loss_fn"
    from dtnb.bench.forecast import predict, flops_per_sample
    batch, kw = md.tokens(), dict(samples=1e6, targets=['H200x1', 'H100x1'], optimizer='sgd')
    mine, same = predict(gpt(), batch, step_fn=GPT_STEP, **kw), predict(Logits(gpt()), batch, loss_fn=token_ce, **kw)
    for a, b in zip(mine.rows, same.rows):
        assert a['fits'] and (a['plan'], a['memory'], a['compute_s'], a['step_s']) == (b['plan'], b['memory'],
                                                                                         b['compute_s'], b['step_s'])
    assert mine.rows[0]['compute_model'] and mine.rows[0]['memory'] == same.rows[0]['memory'] > 0
    assert flops_per_sample(gpt(), batch, step_fn=GPT_STEP)[:2] == (step_flops(gpt(), batch, step_fn=GPT_STEP) / B, B)
    with pytest.raises(ValueError, match=r"step_fn=lambda model, batch: model\(\*batch\)\[1\]"):
        predict(gpt(), batch, **kw)  # without it: what to pass


def test_recommend_takes_step_fn_and_keys():
    from dtnb.plan.recommend import recommend
    p = recommend(gpt(), md.tokens(), world_size=1, memory=1e9, step_fn=GPT_STEP)
    assert p.estimates[p.chosen].activations == estimate_memory(gpt(), batch=md.tokens(), step_fn=GPT_STEP).activations
    d = recommend(classifier(), DICT, world_size=1, memory=1e9, loss_fn=F.cross_entropy, keys=KEYS)
    assert d.estimates[d.chosen].activations == recommend(classifier(), PAIR, world_size=1, memory=1e9,
                                                          loss_fn=F.cross_entropy).estimates[0].activations


def test_scaling_with_step_fn():
    "A rank's step (in this process) and bench_scaling's launched rank train through the step_fn, which they need"
    from dtnb.bench.throughput import scaling_rank, bench_scaling
    from dtnb.launcher.failures import LaunchError
    r = scaling_rank(gpt, md.tokens(), steps=1, warmup=0, step_fn=GPT_STEP)
    assert r['samples'] == B and r['step_s'] > 0
    with pytest.raises(ValueError, match=r"step_fn=lambda model, batch"): scaling_rank(gpt, md.tokens(), steps=1)
    with pytest.raises(ValueError, match=NOT_A_LOSS.replace('(', r'\(').replace(')', r'\)')):
        scaling_rank(gpt, md.tokens(), steps=1, step_fn=md.gpt_output)
    s = bench_scaling(gpt, md.tokens(), nprocs=(1,), steps=2, warmup=0, step_fn=GPT_STEP, progress=False, timeout=120)
    assert s.rows[0]['samples_s'] > 0
    with pytest.raises(LaunchError, match="must return the loss, one number"):  # raised in the rank, said here
        bench_scaling(gpt, md.tokens(), nprocs=(1,), steps=1, warmup=0, step_fn=md.gpt_output, progress=False,
                      timeout=120)


def test_bad_step_fn_one_message_everywhere():
    "step_fn beside loss_fn, or a step_fn that returns no single loss: the same error from core.batches, everywhere"
    from dtnb.core.batches import STEP_FN_ALONE
    from dtnb.bench.ops import trace_step, op_compute
    from dtnb.bench.forecast import predict, flops_per_sample
    from dtnb.bench.throughput import bench_scaling
    from dtnb.plan.recommend import recommend
    from dtnb.train.lr_finder import find_lr
    from dtnb.train.batches import evaluate
    batch = md.tokens()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*batch), batch_size=4)
    calls = {
        'trace_step': lambda **kw: trace_step(gpt(), batch, **kw),
        'op_compute': lambda **kw: op_compute(gpt(), batch, 'H200', **kw),
        'predict': lambda **kw: predict(gpt(), batch, samples=1e6, targets=['H200x1'], **kw),
        'flops_per_sample': lambda **kw: flops_per_sample(gpt(), batch, **kw),
        'recommend': lambda **kw: recommend(gpt(), batch, world_size=1, memory=1e9, **kw),
        'estimate_memory': lambda **kw: estimate_memory(gpt(), batch=batch, **kw),
        'measure_memory': lambda **kw: measure_memory(gpt(), batch, **kw),
        'bench_model': lambda **kw: bench_model(gpt(), batch, steps=1, warmup=0, matmul_peak=1.0, device='cpu', **kw),
        'step_flops': lambda **kw: step_flops(gpt(), batch, **kw),
        'find_batch_size': lambda **kw: find_batch_size(gpt(), batch, memory='8MB', **kw),
        'evaluate': lambda **kw: evaluate(gpt(), loader, **kw),
        'fit': lambda **kw: fit((m := gpt()), loader, torch.optim.SGD(m.parameters(), lr=0.1), max_steps=1,
                                progress=False, **kw),
        'find_lr': lambda **kw: find_lr((m := gpt()), loader, torch.optim.SGD(m.parameters(), lr=0.1), num_steps=2,
                                          **kw),
        'check_equivalence': lambda **kw: check_equivalence(gpt, batch, steps=1, **kw)}
    for name, call in calls.items():
        with pytest.raises(ValueError) as e: call(step_fn=GPT_STEP, loss_fn=token_ce)
        assert str(e.value) == STEP_FN_ALONE, name
        if name in ('check_equivalence', 'fit'): continue  # they train on ranks / the same forward_loss: below
        with pytest.raises(ValueError) as e: call(step_fn=md.gpt_output)
        assert str(e.value).startswith(NOT_A_LOSS) and 'a tuple of 2 (tensor[' in str(e.value), name
    with pytest.raises(ValueError, match=STEP_FN_ALONE):
        bench_scaling(gpt, batch, nprocs=(1,), step_fn=GPT_STEP, keys=KEYS)
    with pytest.raises(ValueError, match=STEP_FN_ALONE): BatchLoss(step_fn=GPT_STEP, keys=KEYS)
    with pytest.raises(ValueError) as e: calls['fit'](step_fn=lambda m, b: m(*b)[0])  # the logits, not a loss
    assert str(e.value) == NOT_A_LOSS + " tensor[4, 8, 32] float32"


# ---- the CLI: --loss-fn, --step-fn, --keys, loaded as --model is -----------------------------------------------------

GPT_ARGS = ['--model', 'models_debug:ClassicGPT', '--batch', 'models_debug:tokens']


def test_cli_check_with_step_fn():
    "`dtnb check` trains the nanoGPT model through --step-fn; without it, or with a bad one, it says what is wrong"
    from dtnb.cli import main
    from dtnb.core.batches import STEP_FN_ALONE
    assert main(['check', *GPT_ARGS, '--step-fn', 'models_debug:gpt_step', '--steps', '2']) == 0
    with pytest.raises(ValueError, match=r"step_fn=lambda model, batch"): main(['check', *GPT_ARGS, '--steps', '1'])
    with pytest.raises(ValueError, match=NOT_A_LOSS.replace('(', r'\(').replace(')', r'\)')):
        main(['check', *GPT_ARGS, '--step-fn', 'models_debug:gpt_output', '--steps', '1'])
    with pytest.raises(ValueError) as e:
        main(['check', *GPT_ARGS, '--step-fn', 'models_debug:gpt_step', '--loss-fn', 'cross_entropy'])
    assert str(e.value) == STEP_FN_ALONE
    with pytest.raises(ValueError, match="--step-fn 'gpt_step': use the form module:factory"):
        main(['check', *GPT_ARGS, '--step-fn', 'gpt_step'])


def test_load_loss_reads_the_cli_forms():
    from dtnb.reporting.sections import load_loss
    assert load_loss('cross_entropy', keys='image,label') == BatchLoss(F.cross_entropy, None, KEYS)
    assert load_loss(step_fn='models_debug:gpt_step') == BatchLoss(step_fn=md.gpt_step)
    assert load_loss('models_debug:gpt_step').loss_fn is md.gpt_step and load_loss() == BatchLoss()


def test_cli_report_with_step_fn(tmp_path):
    "`dtnb report`, as a command: plans and trains the nanoGPT model through --step-fn"
    import json, subprocess, sys
    from pathlib import Path
    from conftest import cpu_env
    tests = Path(__file__).parent
    args = ['report', '--quick', '--out', tmp_path, *GPT_ARGS, '--step-fn', 'models_debug:gpt_step',
            '--sections', 'plan', 'training']
    r = subprocess.run([sys.executable, '-m', 'dtnb', *map(str, args)], cwd=tests.parent, capture_output=True,
                       text=True, timeout=600, env=cpu_env(None, tests))
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / 'results.json').read_text())
    plan, training = res['sections'].values()
    assert plan['error'] is None and training['error'] is None, (plan['error'], training['error'])
    assert 'your step_fn' in training['data']['description'] and training['data']['runs']['single']['losses']
    assert training['data']['agree'] is True and plan['data']['plan']['strategy']
