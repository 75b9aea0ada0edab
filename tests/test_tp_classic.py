"""Tensor parallel on classic model code against one process (03fb, 03g, 03i): fused q/k/v layers split by head groups,
head counts stored on the module set per rank; 3 AdamW steps, losses and parameters compared. The notebook proves
`tp=2`; here the 4-rank layouts, a user's plan naming the fused layer, Hugging Face's fused layouts, Falcon (its
in-place residual; multi-query attention refused, or left whole), checkpoints and exported weights of re-ordered
fused layers across degrees, and the refusals.
The CPU is the subject: ranks are CPU ranks on gloo on any machine (`cpu_ranks`, conftest.py)."""
import pytest, torch
import torch.distributed as dist
import torch.distributed.tensor.parallel, torch.distributed.fsdp  # imported once here, not in every forked rank
transformers = pytest.importorskip('transformers')  # imported once: forked ranks inherit it
from dtnb.launcher.processes import launch, LaunchError
import models_tp as mt
import models_debug as md

transformers.logging.set_verbosity_error()
pytestmark = pytest.mark.usefixtures('cpu_ranks')
VOCAB = 64
TOKENS = torch.randint(0, VOCAB, (3, 4, 16), generator=torch.Generator().manual_seed(0))  # steps, batch, sequence


def gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=16, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
        use_cache=False))

def phi3():  # fused qkv_proj with grouped-query attention, fused gate_up_proj; head counts read from its config
    torch.manual_seed(0)
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False,
        max_position_embeddings=32, original_max_position_embeddings=32))

def neox():  # query_key_value interleaved by head: whole heads in a row already
    torch.manual_seed(0)
    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64, vocab_size=VOCAB,
        max_position_embeddings=16, use_cache=False, attention_dropout=0., hidden_dropout=0.))

def falcon(new_decoder_architecture=True, multi_query=False):
    "Falcon's decoder layer: attention and MLP side by side, `mlp_output += attention_output` (in place)"
    torch.manual_seed(0)
    return transformers.FalconForCausalLM(transformers.FalconConfig(
        hidden_size=64, num_attention_heads=4, num_kv_heads=2 if new_decoder_architecture else 4, num_hidden_layers=2,
        vocab_size=VOCAB, bias=False,
        new_decoder_architecture=new_decoder_architecture, multi_query=multi_query, parallel_attn=True,
        max_position_embeddings=16, use_cache=False, attention_dropout=0., hidden_dropout=0.))

MODELS = dict(nano_gpt=mt.nano_gpt, llama_classic=mt.llama_classic, gpt2=gpt2, phi3=phi3, neox=neox,
              falcon=falcon,                                           # new architecture: grouped-query attention
              falcon_mha=lambda: falcon(False),                        # [q, k, v] by head, one key/value per head
              falcon_mqa=lambda: falcon(False, multi_query=True))      # one key/value head for every query head


def train_with(model, opt, batches):
    losses = []
    for b in batches:
        loss = model(input_ids=b, labels=b).loss if hasattr(model, 'config') else model(b[:, :-1], b[:, 1:])[1]
        loss.backward(); opt.step(); opt.zero_grad(); losses.append(loss.detach())
    return torch.stack(losses)

def train(model, batches): return train_with(model, torch.optim.AdamW(model.parameters(), lr=1e-2), batches)

def tied(model): return len(list(model.named_parameters(remove_duplicate=False))) > len(list(model.parameters()))

def _ranked(name, degrees, plan=None):
    from dtnb.parallel.parallelize import Degrees, parallelize, data_rank
    from dtnb.parallel.heads import original_rows
    d = Degrees(**degrees)
    mesh = d.build_mesh()
    model = parallelize(MODELS[name](), d, mesh=mesh, plan=plan)
    (r, n), b = data_rank(mesh), TOKENS.shape[1] // data_rank(mesh)[1]
    losses = train(model, [t[r * b:(r + 1) * b] for t in TOKENS])
    dist.all_reduce(losses); losses /= dist.get_world_size()
    sd = {k: getattr(v, 'full_tensor', lambda: v)().detach() for k, v in model.state_dict().items()}
    return losses, original_rows(model, sd), tied(model)

def check(name, degrees, atol=1e-4, plan=None):
    ref = MODELS[name]()
    ref_losses = train(ref, TOKENS)
    ws = 2 * degrees.get('dp_shard', 1)
    for losses, sd, is_tied in launch(_ranked, name, degrees, plan, nprocs=ws, device='cpu', timeout=240):
        assert is_tied == tied(ref)
        torch.testing.assert_close(losses, ref_losses, rtol=0, atol=1e-5)
        assert sorted(sd) == sorted(ref.state_dict())
        for k, v in ref.state_dict().items(): torch.testing.assert_close(sd[k], v, rtol=0, atol=atol, msg=k)


@pytest.mark.long  # 4 ranks on 2 cores, four models (about 20 s): bash run.sh test-long
@pytest.mark.parametrize('name', ['nano_gpt', 'llama_classic', 'gpt2', 'falcon'])
def test_classic_tp_times_fsdp_equals_one_process(name):
    "tp=2 × dp_shard=2: each FSDP shard of a model split by head groups; the tied embeddings stay one tensor"
    check(name, dict(tp=2, dp_shard=2))


def test_a_plan_naming_the_fused_layer_colwise_splits_it_by_heads():
    "A plan naming c_attn colwise (torch alone would cut it into the wrong thirds of q, k, v) trains as one process"
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    plan = {'transformer.h.*.attn.c_attn': ColwiseParallel(), 'transformer.h.*.attn.c_proj': RowwiseParallel()}
    check('nano_gpt', dict(tp=2), plan=plan)


@pytest.mark.long  # two Hugging Face models on 2 ranks (about 8 s): bash run.sh test-long
@pytest.mark.parametrize('name,atol', [
    ('phi3', 1e-4),
    ('neox', 1e-3)])  # gradients equal to 1e-6; AdamW turns near-zero ones (the key bias's) into steps of ~1e-4
def test_hugging_face_fused_layouts_equal_one_process(name, atol):
    "Phi-3's [q|k|v] with grouped-query attention and [gate|up], GPT-NeoX's per-head query_key_value: tp=2"
    check(name, dict(tp=2), atol=atol)


def _split(make, tp=2):
    from dtnb.parallel.parallelize import Degrees, parallelize
    parallelize(make(), Degrees(tp=tp))

def test_attention_written_inline_is_refused_before_any_step():
    "nanoGPT-like attention inside the model's own forward (ClassicGPT): its input also feeds the embeddings' sum"
    with pytest.raises(LaunchError) as e: launch(_split, md.ClassicGPT, nprocs=2, device='cpu')
    assert ("ClassicGPT stores head counts that its forward reads and holds wte, wpe, lm_head beside its attention's "
            "c_attn: dtnb gives that forward a stand-in input of one rank's width") in str(e.value)


def test_a_forward_using_its_input_beyond_q_k_v_stops_at_that_line():
    "An attention that normalizes its own input: the stand-in refuses the norm, naming the module, in the first forward"
    class NormedAttention(mt.CausalSelfAttention):
        def __init__(self): super().__init__(32, 4, False); self.norm = torch.nn.LayerNorm(32)
        def forward(self, x): return super().forward(self.norm(x))
    def step():
        _split_model = torch.nn.Sequential(NormedAttention())
        from dtnb.parallel.parallelize import Degrees, parallelize
        parallelize(_split_model, Degrees(tp=2))(torch.randn(2, 4, 32))
    with pytest.raises(LaunchError) as e: launch(step, nprocs=2, device='cpu')
    assert "0's forward used its input for layer_norm: under tensor parallel" in str(e.value)


def mlp_only(model):
    "Falcon's multi-query attention left whole, its MLP split: the plan its refusal proposes"
    from dtnb.parallel.tensor import tp_plan
    return {k: v for k, v in tp_plan(model).items() if '.self_attention.' not in k}

@pytest.mark.long  # two Falcon layouts and one plan on 2 ranks (about 10 s): bash run.sh test-long
@pytest.mark.parametrize('name', ['falcon', 'falcon_mha', 'falcon_mqa'])
def test_falcon_equals_one_process(name):
    "Falcon's `mlp_output += attention_output` on the split layers' outputs: tp=2 trains as one process. The "\
    "new architecture's key/value groups and the per-head layout split by heads; multi-query attention stays whole"
    check(name, dict(tp=2), plan=mlp_only(MODELS[name]()) if name == 'falcon_mqa' else None)


def test_falcon_multi_query_attention_is_refused_before_any_step():
    "One key/value head shared by every query head cannot be split by heads: refused in parallelize, with the plan"
    with pytest.raises(LaunchError) as e: launch(_split, MODELS['falcon_mqa'], nprocs=2, device='cpu')
    assert ("transformer.h.0.self_attention.query_key_value holds one key/value head that every query head shares "
            "(FalconAttention.multi_query=True): its rows cannot be split by heads over tp=2 ranks; leave the "
            "attention whole and split the rest: plan={k: s for k, s in tp_plan(model).items() if "
            "'.self_attention.' not in k}") in str(e.value)


def _parallel(name, degrees):
    "The model split by `degrees`, its AdamW, and this rank's share of each batch of TOKENS"
    from dtnb.parallel.parallelize import Degrees, parallelize, data_rank
    d = Degrees(**degrees)
    mesh = d.build_mesh()
    model = parallelize(MODELS[name](), d, mesh=mesh)
    (r, n), b = data_rank(mesh), TOKENS.shape[1] // data_rank(mesh)[1]
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), TOKENS[:, r * b:(r + 1) * b]

def _save_split(name, degrees, root, steps):
    "Train `steps` steps split by `degrees`, save a checkpoint (model and AdamW), export the weights to one file"
    from dtnb.train.checkpoint import save_checkpoint
    from dtnb.train.export import export_model
    model, opt, tokens = _parallel(name, degrees)
    train_with(model, opt, tokens[:steps])
    save_checkpoint(f"{root}/ck", model, opt, step=steps)
    export_model(f"{root}/weights.safetensors", model)

def _load_split(name, degrees, root, steps):
    "Load a checkpoint split by `degrees`, train the remaining steps: the mean losses (the weights: after.pt)"
    from dtnb.train.checkpoint_load import load_checkpoint
    from dtnb.train.export import export_model
    model, opt, tokens = _parallel(name, degrees)
    load_checkpoint(f"{root}/ck", model, opt)
    losses = train_with(model, opt, tokens[steps:])
    dist.all_reduce(losses); losses /= dist.get_world_size()
    export_model(f"{root}/after.pt", model)
    return losses

def check_checkpoints(name, degrees, root):
    "Saved split by `degrees`, loaded in one process: the weights (and the exported file) are one process's after "\
    "2 steps, the third step (AdamW's moments) one process's; saved in one process, loaded split, the same"
    from dtnb.train.checkpoint import save_checkpoint
    from dtnb.train.checkpoint_load import load_checkpoint
    from dtnb.train.export import load_exported
    ws = 2 * degrees.get('dp_shard', 1)
    ref = MODELS[name](); ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    train_with(ref, ref_opt, TOKENS[:2])
    two = {k: v.clone() for k, v in ref.state_dict().items()}
    save_checkpoint(root / 'one' / 'ck', ref, ref_opt, step=2)
    last = train_with(ref, ref_opt, TOKENS[2:])
    launch(_save_split, name, degrees, str(root / 'split'), 2, nprocs=ws, device='cpu', timeout=240)
    exported = load_exported(root / 'split' / 'weights.safetensors')
    assert sorted(exported) == sorted(two)
    for k, v in two.items(): torch.testing.assert_close(exported[k], v, rtol=0, atol=1e-4, msg=k)
    model = MODELS[name](); opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    load_checkpoint(root / 'split' / 'ck', model, opt)
    for k, v in two.items(): torch.testing.assert_close(model.state_dict()[k], v, rtol=0, atol=1e-4, msg=k)
    torch.testing.assert_close(train_with(model, opt, TOKENS[2:]), last, rtol=0, atol=1e-5)
    for k, v in ref.state_dict().items(): torch.testing.assert_close(model.state_dict()[k], v, rtol=0, atol=1e-4, msg=k)
    for losses in launch(_load_split, name, degrees, str(root / 'one'), 2, nprocs=ws, device='cpu', timeout=240):
        torch.testing.assert_close(losses, last, rtol=0, atol=1e-5)
    after = torch.load(root / 'one' / 'after.pt')
    for k, v in ref.state_dict().items(): torch.testing.assert_close(after[k], v, rtol=0, atol=1e-4, msg=k)


LONG = pytest.mark.long  # the two Hugging Face models (about 15 s): bash run.sh test-long
@pytest.mark.parametrize('name', ['nano_gpt', pytest.param('gpt2', marks=LONG), pytest.param('phi3', marks=LONG)])
def test_checkpoint_of_reordered_fused_layers_loads_under_any_degree(name, tmp_path):
    "c_attn (nanoGPT's Linear, GPT-2's Conv1D), Phi-3's qkv_proj and gate_up_proj re-ordered for tp=2: the "\
    "checkpoint and the exported file hold the model's own row order, which any degree loads"
    check_checkpoints(name, dict(tp=2), tmp_path)


@pytest.mark.long  # 4 ranks on 2 cores, twice (about 15 s): bash run.sh test-long
def test_checkpoint_of_reordered_fused_layers_under_tp_times_fsdp(tmp_path):
    "tp=2 × dp_shard=2: the re-ordered c_attn gathered from its FSDP shards to be saved, split back into them to load"
    check_checkpoints('nano_gpt', dict(tp=2, dp_shard=2), tmp_path)
