"""Every strategy `recommend` can name, applied with `wrap` to models nobody here wrote (Hugging Face GPT-2 and Llama,
random init from tiny configs): equal to one process on real gloo ranks, model states as estimated.
The CPU is the subject: ranks are CPU ranks on gloo on any machine (`cpu_ranks`, conftest.py)."""
import copy
import pytest
import torch
import torch.distributed.fsdp  # imported once here, so that forked ranks do not each pay for it
import torch.distributed as dist
transformers = pytest.importorskip('transformers')  # imported once: forked ranks inherit it
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from dtnb.launcher.processes import launch
from dtnb.parallel.ddp import make_optimizer, distributed_loader
from dtnb.parallel.wrap import wrap
from dtnb.plan.memory import estimate_memory
from dtnb.plan.recommend import recommend
from dtnb.plan.measure import _measure_step
from dtnb.core.models import ToyModel, toy_data

transformers.logging.set_verbosity_error()
STEPS, BATCH, SEQ, VOCAB = 3, 4, 16, 128


pytestmark = pytest.mark.usefixtures('one_thread_per_module', 'cpu_ranks')


def gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64, resid_pdrop=0,
                                      embd_pdrop=0, attn_pdrop=0, use_cache=False, bos_token_id=0, eos_token_id=0))

def llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                        num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB, use_cache=False,
                                        bos_token_id=0, eos_token_id=0, pad_token_id=0))

MODELS = dict(gpt2=gpt2, llama=llama)
TOKENS = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(0))
SETUPS = dict(ddp=('ddp', {}), zero1=('zero1', {}), zero2=('zero2', {}), zero3=('zero3', {}),
              ddp_ac=('ddp', dict(activation_checkpointing=True)), zero2_ac=('zero2',
                  dict(activation_checkpointing=True)),
              zero3_offload=('zero3', dict(offload=True)))


def full_params(model):
    full = lambda p: p.full_tensor() if hasattr(p, 'full_tensor') else p
    return {k.removeprefix('module.'): full(p).detach().clone() for k, p in model.named_parameters()}


def train(model, rank=0, world=1):
    "3 AdamW steps with the model's own loss on dict batches (this rank's share of each); the global loss of each"
    o = make_optimizer(model, torch.optim.AdamW, lr=1e-3)
    share, losses = BATCH // world, []
    for ids in TOKENS:
        ids = ids[rank * share:(rank + 1) * share]
        loss = model(**dict(input_ids=ids, labels=ids)).loss  # Hugging Face: .loss computed from labels
        o.zero_grad(); loss.backward(); o.step()
        l = loss.detach().clone()
        if world > 1: dist.all_reduce(l); l /= world
        losses.append(l.item())
    return losses


REFS = {}
def reference(name):
    if name not in REFS:
        m = MODELS[name]()
        REFS[name] = train(m), full_params(m)
    return REFS[name]


def every_setup(refs):
    "On this rank: for each model and setup, the largest difference to one process (losses, parameters)"
    r, ws, out = dist.get_rank(), dist.get_world_size(), {}
    for name, make in MODELS.items():
        ref_losses, ref_params = refs[name]
        for key, (strategy, opts) in SETUPS.items():
            model = wrap(make(), strategy, **opts)
            losses = train(model, r, ws)
            p = full_params(model)
            out[name, key] = (max(abs(a - b) for a, b in zip(losses, ref_losses)),
                              max((p[k] - ref_params[k]).abs().max().item() for k in ref_params))
    return out


def measure_each(batches):
    "On this rank: one measured step per (model, strategy), beside this rank's estimate"
    r, out = dist.get_rank(), {}
    for name, make in MODELS.items():
        for s in ('ddp', 'zero1', 'zero2', 'zero3'):
            m = _measure_step(make(), batches[name], s, 'adamw', 'fp32', None, None, 1e-3)
            e = estimate_memory(make(), s, 2, rank=r)
            out[name, s] = [(m[c], getattr(e, c)) for c in ('parameters', 'gradients', 'optimizer_states')]
    return out


IDS = TOKENS[0, :2]
BATCHES = dict(gpt2=dict(input_ids=IDS, labels=IDS), llama=(IDS, IDS))  # a dict, and an (inputs, labels) pair

def on_two_ranks(refs, batches): return every_setup(refs), measure_each(batches)

@pytest.fixture(scope='module')
def hf_ranks():
    "One launch of 2 gloo ranks for all the Hugging Face checks (each rank's results)"
    return launch(on_two_ranks, {name: reference(name) for name in MODELS}, BATCHES, nprocs=2, timeout=240)


def test_hf_models_every_strategy_equals_one_process(hf_ranks):
    "GPT-2 and Llama under ddp, zero1, zero2, zero3, with checkpointing and offload: 3 AdamW steps as one process"
    for res, _ in hf_ranks:
        assert set(res) == {(n, k) for n in MODELS for k in SETUPS}
        for case, (dl, dp) in res.items():
            assert dl < 1e-4 and dp < 1e-4, (case, dl, dp)


def test_hf_models_model_states_as_estimated(hf_ranks):
    "estimate_memory's model states equal the bytes measured on each rank, for each strategy wrap runs"
    for _, res in hf_ranks:
        assert len(res) == 8
        for case, pairs in res.items():
            for measured, estimated in pairs: assert measured == estimated, (case, pairs)
    for name, b in BATCHES.items():  # the planner traces these models' own loss, from either kind of batch
        assert estimate_memory(MODELS[name](), batch=b).activations > 0


def saved_bytes(model, ids):
    "Bytes of the distinct storages the forward saves for backward (parameters included: they are the same)"
    seen = {}
    def pack(t): seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes(); return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t): model(input_ids=ids, labels=ids)
    return sum(seen.values())


def test_checkpointing_really_recomputes():
    "activation_checkpointing=True trains equal (above) and keeps less for backward: each block saves only its input"
    plain, ckpt = wrap(gpt2(), 'single'), wrap(gpt2(), 'single', activation_checkpointing=True)
    assert saved_bytes(ckpt, IDS) < 0.7 * saved_bytes(plain, IDS)


def apply_plan(plans):
    "On each rank: each plan applied with wrap, trained 3 steps; the losses"
    out = []
    for plan in plans:
        torch.manual_seed(0)
        model = wrap(ToyModel(), **plan)
        o = make_optimizer(model, torch.optim.AdamW, lr=1e-2)
        ds, losses = toy_data(64), []
        for i in range(3):
            x, y = ds[i * 8 + dist.get_rank() * 4:i * 8 + dist.get_rank() * 4 + 4]
            loss = torch.nn.functional.mse_loss(model(x), y)
            o.zero_grad(); loss.backward(); o.step(); losses.append(loss.item())
        out.append(losses)
    return out


def test_every_recommend_answer_runs():
    "Each answer recommend gives on 2 ranks as memory shrinks: wrap(model, **plan.wrap_kwargs) applies it; it trains"
    model, x = ToyModel(), torch.randn(4, 16)
    full = recommend(model, x, world_size=2, memory=1e9)
    totals = sorted({e.total for e in full.estimates if e.strategy != 'pipeline'}, reverse=True)
    plans = {}
    for t in totals:  # a budget just above each option's total: every option becomes the answer once
        p = recommend(model, x, world_size=2, memory=int((t + 1) / 0.9) + 1)
        if p.strategy not in (None, 'pipeline'): plans[p.label] = p.wrap_kwargs
    assert {'ddp', 'zero1', 'zero3', 'zero3 + offload'} <= set(plans), plans
    assert any(k.get('activation_checkpointing') for k in plans.values()), plans
    torch.manual_seed(0)
    ref = ToyModel(); o = torch.optim.AdamW(ref.parameters(), lr=1e-2); ds, ref_losses = toy_data(64), []
    for i in range(3):
        x, y = ds[i * 8:(i + 1) * 8]
        loss = torch.nn.functional.mse_loss(ref(x), y); o.zero_grad(); loss.backward(); o.step()
        ref_losses.append(loss.item())
    ranks = launch(apply_plan, list(plans.values()), nprocs=2, timeout=120)
    for i, label in enumerate(plans):
        got = [(a + b) / 2 for a, b in zip(ranks[0][i], ranks[1][i])]
        assert max(abs(a - b) for a, b in zip(got, ref_losses)) < 1e-5, (label, got, ref_losses)


def zero1_fit(ckpt_dir):
    "On this rank: the check on a full optimizer; fit 4 steps with checkpoints, then a fresh run to 6 that resumes"
    from dtnb.parallel.fsdp import check_optimizer
    from dtnb.train.loop import fit
    model = wrap(ToyModel(), 'zero1')
    try: check_optimizer(model, torch.optim.AdamW(model.parameters())); msg = None
    except RuntimeError as e: msg = str(e)
    runs = []
    for steps in (4, 6):
        torch.manual_seed(0)
        model = wrap(ToyModel(), 'zero1')
        o = make_optimizer(model, torch.optim.AdamW, lr=1e-2)
        dl = distributed_loader(toy_data(256), global_batch_size=16, shuffle=False)
        runs.append(fit(model, dl, o, max_steps=steps, progress=False, checkpoint_dir=ckpt_dir, checkpoint_every=2))
    return msg, [(r.start_step, r.losses) for r in runs]


def test_zero1_optimizer_checked_and_resumable(tmp_path):
    "fit refuses a full optimizer on a zero1 model; with ZeRO's, a run stopped at step 4 resumes to the same losses"
    from dtnb.train.loop import fit
    torch.manual_seed(0)
    m = ToyModel(); o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    ref = fit(m, torch.utils.data.DataLoader(toy_data(256), batch_size=16), o, max_steps=6, progress=False).losses
    msg, runs = launch(zero1_fit, str(tmp_path), nprocs=2, timeout=120)[0]
    assert "wrap(model, 'zero1') splits the optimizer state over the ranks, but this AdamW keeps all of it" in msg
    assert "dtnb.make_optimizer(model, torch.optim.AdamW, lr=...)" in msg
    (s0, first), (s1, resumed) = runs
    assert (s0, s1, len(first), len(resumed)) == (0, 4, 4, 6)  # the second run started from the checkpoint of step 4
    assert max(abs(a - b) for a, b in zip(resumed, ref)) < 1e-5, (resumed, ref)
