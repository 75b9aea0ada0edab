"""Sequence parallel (Ulysses) on a transformers Llama against one process: wrapped by hand (03h), and as a degree of
`parallelize` (03i).
The CPU is the subject: ranks are CPU ranks on gloo on any machine (`cpu_ranks`, conftest.py)."""
import pytest, torch
import torch.distributed as dist
import torch.distributed.fsdp  # imported once here, so that forked ranks do not each pay for it
transformers = pytest.importorskip('transformers')  # imported once: forked ranks inherit it
from transformers import LlamaConfig, LlamaForCausalLM
from dtnb.launcher.processes import launch
from dtnb.parallel.ulysses import ulysses, ulysses_data
from dtnb.parallel.wrap import wrap

transformers.logging.set_verbosity_error()
pytestmark = pytest.mark.usefixtures('cpu_ranks')
VOCAB = 64
TOKENS = torch.randint(0, VOCAB, (3, 2, 32), generator=torch.Generator().manual_seed(0))  # steps, batch, sequence

def llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                        num_key_value_heads=1,  # fewer than the ranks: repeated per query head
                                        intermediate_size=64, vocab_size=VOCAB, use_cache=False, bos_token_id=0,
                                        eos_token_id=0, pad_token_id=0))

def train(model):
    opt, losses = torch.optim.AdamW(model.parameters(), lr=1e-2), []
    for t in TOKENS:
        loss = model(input_ids=t, labels=t).loss
        loss.backward(); opt.step(); opt.zero_grad(); losses.append(loss.detach())
    return torch.stack(losses)

def _rank():
    model = wrap(ulysses(llama(), 2), 'fsdp')
    losses = train(model)
    dist.all_reduce(losses); losses /= dist.get_world_size()
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return ulysses_data(model), losses, full

def test_ulysses_fsdp_equals_one_process():
    ref = llama(); ref_losses = train(ref)
    for data, losses, sd in launch(_rank, nprocs=2, device='cpu'):
        assert data == dict(num_replicas=1, rank=0)  # both ranks split the same sequences
        torch.testing.assert_close(losses, ref_losses, rtol=0, atol=1e-5)
        for k, v in ref.state_dict().items(): torch.testing.assert_close(sd[k], v, rtol=0, atol=1e-4)


# ---- sp as a degree of `parallelize`: the sp ranks average gradients with the data-parallel ones -------------------

BATCHES = torch.randint(0, VOCAB, (3, 4, 32), generator=torch.Generator().manual_seed(1))  # steps, batch, sequence

def _parallelized(degrees):
    from dtnb.parallel.parallelize import Degrees, parallelize, data_rank
    d = Degrees(**degrees)
    mesh = d.build_mesh()
    model = parallelize(llama(), d, mesh=mesh)
    (r, n), b = data_rank(mesh), BATCHES.shape[1] // data_rank(mesh)[1]
    opt, losses = torch.optim.AdamW(model.parameters(), lr=1e-2), []
    for t in BATCHES[:, r * b:(r + 1) * b]:
        loss = model(input_ids=t, labels=t).loss
        loss.backward(); opt.step(); opt.zero_grad(); losses.append(loss.detach())
    losses = torch.stack(losses); dist.all_reduce(losses); losses /= dist.get_world_size()
    sd = {k: getattr(v, 'full_tensor', lambda: v)() for k, v in getattr(model, 'module', model).state_dict().items()}
    return type(model).__name__, ulysses_data(model), losses, sd

@pytest.mark.parametrize('degrees,wrapped', [
    (dict(sp=2), 'DistributedDataParallel'),                   # DDP over the sp ranks
    (dict(dp_replicate=2, sp=2), 'DistributedDataParallel'),   # DDP over dp_replicate × sp
    pytest.param(dict(dp_replicate=2, dp_shard=2, sp=2), 'FSDPLlamaForCausalLM', marks=pytest.mark.long)])  # 8 ranks
def test_parallelize_sp_equals_one_process(degrees, wrapped):
    from dtnb.parallel.parallelize import Degrees
    ref = llama()
    opt, ref_losses = torch.optim.AdamW(ref.parameters(), lr=1e-2), []
    for t in BATCHES:
        loss = ref(input_ids=t, labels=t).loss
        loss.backward(); opt.step(); opt.zero_grad(); ref_losses.append(loss.detach())
    ws = Degrees(**degrees).world_size
    res = launch(_parallelized, degrees, nprocs=ws, device='cpu', timeout=240)
    assert [data for _, data, _, _ in res] == [dict(rank=i // 2, num_replicas=ws // 2) for i in range(ws)]
    for kind, _, losses, sd in res:
        assert kind == wrapped
        torch.testing.assert_close(losses, torch.stack(ref_losses), rtol=0, atol=1e-5)
        for k, v in ref.state_dict().items(): torch.testing.assert_close(sd[k], v, rtol=0, atol=1e-4)
