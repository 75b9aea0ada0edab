"""Pipeline parallel for models whose forward is not a chain: Hugging Face GPT-2 (untied and tied) and Llama, tiny and
randomly initialised, traced by torch's pipelining front end on 2 gloo ranks (on example=, or without it at the first
step), equal to one process; each rank's model states as `estimate_memory(model, 'pipeline', 2, rank=r, example=...)`
counts them, byte for byte.
The CPU is the subject: ranks are CPU ranks on gloo on any machine (`cpu_ranks`, conftest.py)."""
import pytest
import torch
transformers = pytest.importorskip('transformers')  # the `dev` extra; imported once here, inherited by forked ranks
import torch.distributed.pipelining  # once, before the ranks fork
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from dtnb.launcher.processes import launch, LaunchError
from dtnb.core.utils import torch_version, TORCH_NEEDS
from dtnb.parallel.pipeline import apply_pipeline, causal_lm_loss, Pipeline
from dtnb.parallel.parallelize import Degrees, parallelize
from dtnb.plan.memory import estimate_memory
from dtnb.plan.measure import _stage_bytes

pytestmark = pytest.mark.usefixtures('cpu_ranks')

BATCH, SEQ, STEPS, LR = 8, 16, 3, 1e-3
torch.export.export(torch.nn.Linear(2, 2), (torch.zeros(1, 2),))  # warms torch.export once: forked ranks inherit it

def gpt2(tied=False):
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64,
                                      resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, use_cache=False,
                                      tie_word_embeddings=tied))

def llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                        num_key_value_heads=2, intermediate_size=64, vocab_size=128,
                                        attn_implementation='eager'))  # use_cache left on: dtnb traces without it

MODELS = {'gpt2': gpt2, 'gpt2-tied': lambda: gpt2(tied=True), 'llama': llama}
TIED = {'lm_head.weight': 'transformer.wte.weight'}  # GPT-2's tied output layer: the second stage's copy

def tokens(): return torch.randint(0, 128, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(1))
def params(named): return {k: v.detach().clone() for k, v in named}

def one_process(name, steps=STEPS):
    "The reference: the model's own loss (labels=), AdamW, one process"
    model, ids = MODELS[name](), tokens()
    opt, losses = torch.optim.AdamW(model.parameters(), lr=LR), []
    for i in range(steps):
        x = ids[i * BATCH:(i + 1) * BATCH]
        opt.zero_grad(); loss = model(x, labels=x).loss; loss.backward(); opt.step(); losses.append(loss.item())
    return losses, params(model.named_parameters())

def mistakes(pipe, x):
    "Error messages, raised on every rank before any message between ranks"
    def err(f):
        try: f()
        except ValueError as e: return str(e)
    return dict(shape=err(lambda: pipe.step(x[:4], x[:4])),
                mask=err(lambda: pipe.step(dict(input_ids=x, labels=x, attention_mask=(x > 3).long()))),
                keys=err(lambda: pipe.step(dict(ids=x, labels=x))),
                loss=err(lambda: apply_pipeline(gpt2(), None, example=x[:2])),
                zbv=err(lambda: apply_pipeline(gpt2(), causal_lm_loss, schedule='zbv')),  # no example: refused now
                order=err(lambda: apply_pipeline(gpt2(), causal_lm_loss, schedule='interleaved1f1b').order()),
                ac=err(lambda: parallelize(gpt2(), Degrees(pp=2), causal_lm_loss, example=x[:2],
                                           activation_checkpointing=True)),
                ac_lazy=err(lambda: parallelize(gpt2(), Degrees(pp=2), causal_lm_loss, activation_checkpointing=True)))

def train(pipe, ids, dict_batch):
    opt, losses = torch.optim.AdamW(pipe.parameters(), lr=LR), []
    for i in range(STEPS):
        x = ids[i * BATCH:(i + 1) * BATCH]
        opt.zero_grad()
        loss = pipe.step(dict(input_ids=x, labels=x)) if dict_batch else pipe.step(x, x)
        opt.step(); losses.append(loss.item())
    return losses, params(pipe.named_parameters()), pipe.split.to_dict(), str(pipe.split), _stage_bytes(pipe, opt)

def ranked(name, check_errors=False):
    "GPipe, then 1F1B on the same traced stages reset to the start: losses, parameters after 3 AdamW steps, the split"
    ids = tokens()
    pipe = apply_pipeline(MODELS[name](), causal_lm_loss, schedule='gpipe', example=ids[:BATCH // 4])  # traces
    start = {k: v.clone() for k, v in pipe.state_dict().items()}
    out = dict(gpipe=train(pipe, ids, dict_batch=False))
    pipe.load_state_dict(start)
    pipe = Pipeline(pipe.modules, pipe.stage_indices, pipe.n_stages, causal_lm_loss, schedule='1f1b', split=pipe.split)
    out['1f1b'] = train(pipe, ids, dict_batch=True)  # a dict batch: input_ids and labels
    e = estimate_memory(MODELS[name](), 'pipeline', 2, rank=pipe.pp_rank, example=ids[:BATCH // 4])  # a CPU trace
    out['estimate'] = {c: getattr(e, c) for c in ('parameters', 'gradients', 'optimizer_states')}
    tl = pipe.profile_step(ids[:BATCH], ids[:BATCH])  # timelines of traced stages: what ran is the plan
    out['timeline'] = [(e['stage'], e['kind'], e['mb']) for e in sorted(tl.events, key=lambda e: e['start'])
                       if e['rank'] == pipe.pp_rank], pipe.order()[pipe.pp_rank]
    return out, mistakes(pipe, ids[:BATCH]) if check_errors else None

@pytest.mark.parametrize('name', list(MODELS))
def test_hf_pipeline_equals_one_process(name):
    """Losses on every rank and all parameters (a tied one: each stage's copy) after 3 AdamW steps match, to 1e-4; each
    rank's model states are estimate_memory's for its stage"""
    losses, want = one_process(name)
    feature = 'integer tensors between pipeline stages'  # GPT-2's stages pass on its position ids
    if name.startswith('gpt2') and torch_version() < TORCH_NEEDS[feature][0]:
        with pytest.raises(LaunchError, match=f"{feature} needs torch >= 2.13"):
            launch(ranked, name, check_errors=name == 'gpt2-tied', nprocs=2)
        return
    res = launch(ranked, name, check_errors=name == 'gpt2-tied', nprocs=2)
    for schedule in ('gpipe', '1f1b'):
        got = {}
        for r in res:
            assert max(abs(a - b) for a, b in zip(r[0][schedule][0], losses)) < 1e-4, (schedule, r[0][schedule], losses)
            got.update(r[0][schedule][1])
        split, text = res[0][0][schedule][2:4]
        assert split['traced'] and len(split['stages']) == 2
        assert sorted(got) == sorted([*want, *(['lm_head.weight'] if name == 'gpt2-tied' else [])])
        for k, v in got.items():
            d = (v - want[TIED.get(k, k) if name == 'gpt2-tied' else k]).abs().max().item()
            assert d < 1e-4, f"{schedule} {k}: max difference {d:.3g}"
    for r in res: assert r[0]['timeline'][0] == r[0]['timeline'][1] and len(r[0]['timeline'][0]) == 8
    # memory: each rank's parameters, gradients and AdamW states (a tied copy included) are the bytes estimated for
    # its stage, byte for byte
    for schedule in ('gpipe', '1f1b'):
        for r in res:
            assert r[0][schedule][4] == r[0]['estimate'], (schedule, r[0][schedule][4], r[0]['estimate'])
    assert res[0][0]['estimate'] != res[1][0]['estimate'] and min(res[0][0]['estimate'].values()) > 0
    if name == 'gpt2-tied':
        assert 'tied, copied per stage: transformer.wte.weight (stage 0) = lm_head.weight (stage 1)' in text
        errs = res[0][1]
        assert errs == res[1][1]
        assert "traced on microbatches of shape [(2, 16)], but this batch in 4 microbatches makes [(1, 16)]" \
            in errs['shape']
        assert "attention_mask has zeros (padding)" in errs['mask'] and "set the padded labels to -100" in errs['mask']
        assert ("holds 'input_ids' (the first stage's input) and 'labels' (the targets of loss_fn); "
                "got ['ids', 'labels']") in errs['keys']
        assert "loss_fn=None: a pipeline computes the loss on its last stage" in errs['loss']
        assert ("GPT2LMHeadModel is not a chain of units, so torch's tracer cuts it, and traced stages cannot run the "
                "V-shaped schedule 'zbvzerobubble'") in errs['zbv']
        assert ("the order of 'interleaved1f1b' is the table of torch's schedule over the traced stages, and these are "
                "traced at the first step (no example= was given): call order() after a step") in errs['order']
        for ac in ('ac', 'ac_lazy'):
            assert ("GPT2LMHeadModel is not a chain of units: torch's tracer cut it, and traced stages run as traced, "
                    "with pipeline and data parallelism (FSDP or DDP over each whole stage) alone: drop "
                    "activation_checkpointing and tp") in errs[ac]


def ranked_lazy(name, how):
    """No example=: `apply_pipeline` (schedule `how`) or `parallelize` builds stage copies, the optimizer takes their
    parameters, the first step traces the model on its first microbatch"""
    ids, x = tokens(), tokens()[:BATCH]
    model = MODELS[name]()
    pipe = (parallelize(model, Degrees(pp=2), causal_lm_loss) if how == 'parallelize' else
            apply_pipeline(model, causal_lm_loss, schedule=how))
    pending, before = (pipe.pending, str(pipe.split)), dict(pipe.named_parameters())
    losses, got, split, text, _ = train(pipe, ids, dict_batch=how == '1f1b')
    after = dict(pipe.named_parameters())
    try: pipe.step(x[:4], x[:4]); shape = None
    except ValueError as e: shape = str(e)
    return dict(pending=pending, traced=(pipe.pending, split, text), losses=losses, params=got, shape=shape,
                names=(sorted(before), sorted(after)), same=all(p is before[n] for n, p in after.items()))

@pytest.mark.parametrize('name,how', [('gpt2-tied', '1f1b'), ('gpt2', 'gpipe'), ('llama', 'parallelize')])
def test_hf_pipeline_without_example_equals_one_process(name, how):
    """Without example=, the stages are traced at the first step: an optimizer built from pipe.parameters() before it
    trains them (the very parameters), and the losses and all parameters after 3 AdamW steps match one process"""
    losses, want = one_process(name)
    feature = 'integer tensors between pipeline stages'  # GPT-2's stages pass on its position ids
    if name.startswith('gpt2') and torch_version() < TORCH_NEEDS[feature][0]:
        with pytest.raises(LaunchError, match=f"{feature} needs torch >= 2.13"):
            launch(ranked_lazy, name, how, nprocs=2)
        return
    res = launch(ranked_lazy, name, how, nprocs=2)
    got = {}
    for r in res:
        assert r['pending'][0] and 'traced by torch.distributed.pipelining at the first step' in r['pending'][1]
        assert not r['traced'][0] and r['traced'][1]['traced'] and r['names'][0] == r['names'][1] and r['same']
        assert max(abs(a - b) for a, b in zip(r['losses'], losses)) < 1e-4, (r['losses'], losses)
        assert ("the stages were traced on microbatches of shape [(2, 16)], but this batch in 4 microbatches makes "
                "[(1, 16)]") in r['shape']
        got.update(r['params'])
    assert len(res[0]['traced'][1]['stages']) == 2
    assert sorted(got) == sorted([*want, *(['lm_head.weight'] if name == 'gpt2-tied' else [])])
    for k, v in got.items():
        d = (v - want[TIED.get(k, k) if name == 'gpt2-tied' else k]).abs().max().item()
        assert d < 1e-4, f"{k}: max difference {d:.3g}"
    if name == 'gpt2-tied':
        assert 'tied, copied per stage: transformer.wte.weight (stage 0) = lm_head.weight' in res[0]['traced'][2]


def full(t): return t.full_tensor() if hasattr(t, 'full_tensor') else t

def ranked_dp(layouts):
    """Pipeline × data parallel on 4 ranks, each layout from the start: pp 2 × (dp_shard 2: FSDP2 over each traced
    stage, or dp_replicate 2); each data-parallel rank trains on its half of every batch"""
    from dtnb.parallel.parallelize import data_rank
    ids, out = tokens(), {}
    for name, dp in layouts:
        deg = Degrees(pp=2, **{dp: 2})
        mesh = deg.build_mesh()
        r, n = data_rank(mesh)
        try: parallelize(MODELS[name](), deg, causal_lm_loss, mesh=mesh, n_microbatches=2)  # no example=
        except ValueError as e: out[name, dp, 'refused'] = str(e)
        pipe = parallelize(MODELS[name](), deg, causal_lm_loss, mesh=mesh, n_microbatches=2,
                           example=ids[:BATCH // (2 * n)])
        opt, losses = torch.optim.AdamW(pipe.parameters(), lr=LR), []
        for i in range(2):
            x = ids[i * BATCH:(i + 1) * BATCH][r * BATCH // n:(r + 1) * BATCH // n]
            opt.zero_grad(); losses.append(pipe.step(x, x).item()); opt.step()
        out[name, dp] = losses, {k: full(v).detach().clone() for k, v in pipe.named_parameters()}
    return out

@pytest.mark.parametrize('layouts', [
    [('llama', 'dp_shard')],                                   # FSDP2 over each traced stage of a Llama
    pytest.param([('llama', 'dp_replicate'), ('gpt2-tied', 'dp_shard')],  # its copies' gradient shards summed
                 marks=pytest.mark.long)],                     # 4 more traces: bash run.sh test-long
    ids=['llama-fsdp', 'replicate-tied'])
def test_hf_pipeline_times_data_parallel_equals_one_process(layouts):
    """Traced stages under pp 2 × dp_shard 2 or dp_replicate 2 on 4 ranks: losses and every parameter after 2 AdamW
    steps equal one process on the whole batch"""
    res = launch(ranked_dp, layouts, nprocs=4, timeout=240)
    for name, dp in layouts:
        for r in res:  # without example=, data parallelism would wrap the copies that the first step's trace replaces
            assert (f"is not a chain of units, and without example= torch's tracer cuts it at the first step, but data "
                    f"parallelism ({dp}=2") in r.get((name, dp, 'refused'), ''), r.get((name, dp, 'refused'))
            assert "pass example=<one microbatch of the training shape>" in r[name, dp, 'refused']
        losses, want = one_process(name, steps=2)
        got = {}
        for r in res:
            got_losses = r[name, dp][0]
            assert len(got_losses) == 2 and max(abs(a - b) for a, b in zip(got_losses, losses)) < 1e-4, (dp, got_losses)
            got.update(r[name, dp][1])
        assert sorted(got) == sorted([*want, *(['lm_head.weight'] if name == 'gpt2-tied' else [])])
        for k, v in got.items():
            d = (v - want[TIED.get(k, k) if name == 'gpt2-tied' else k]).abs().max().item()
            assert d < 1e-4, f"{name} pp 2 × {dp} 2, {k}: max difference {d:.3g}"
