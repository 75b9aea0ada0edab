"Models, batches and steps for tests/test_debug.py and `dtnb check --model models_debug:<fn>` with tests/ on the path"
import time
import torch
import torch.distributed as dist
from torch import nn

G = torch.Generator().manual_seed(0)
X, Y = torch.randn(8, 4, generator=G), torch.randn(8, 2, generator=G)
IMAGES, LABELS = torch.randn(8, 3, 6, 6, generator=G), torch.randint(3, (8,), generator=G)


def mlp() -> nn.Module: return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
def dropout_mlp() -> nn.Module: return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 2))
def cnn() -> nn.Module:
    "Conv-BatchNorm-ReLU, pooled, then a classifier of 3 classes: for 3x6x6 images"
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(4, 3))
def batch(): return X, Y
def seven(): return torch.utils.data.TensorDataset(X[:7], Y[:7])


def good_step():
    "A correct step: the same collectives on every rank"
    x = torch.ones(4)
    dist.all_reduce(x)
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, dist.get_rank())
    return x.sum().item()

def uneven_step():
    "Rank 1 takes a branch with an extra all_reduce"
    x = torch.ones(4)
    if dist.get_rank() == 1: dist.all_reduce(x)  # extra all_reduce on rank 1
    dist.all_reduce(x)
    dist.all_reduce(torch.ones(2))

def metric_on_rank0():
    "A metric gathered only on rank 0"
    dist.all_reduce(torch.ones(4))
    if dist.get_rank() == 0: dist.all_reduce(torch.ones(1))  # metric on rank 0 only


class Shifted(nn.Module):
    "A linear layer plus a buffer that each rank builds from its own rank: unequal unless someone broadcasts it"
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.register_buffer('shift', torch.full((2,), float(dist.get_rank() if dist.is_initialized() else 0)))
    def forward(self, x): return self.lin(x) + self.shift


def stuck():
    "Rank 1 never reaches the all_reduce rank 0 waits in"
    if dist.get_rank() == 0: dist.all_reduce(torch.ones(3))
    else: time.sleep(60)


class Noise(nn.Module):
    "Adds noise drawn from a generator seeded with the clock: each run of the same step draws other numbers"
    def forward(self, x):
        return x + 1e-3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(time.time_ns()))
def noisy_mlp() -> nn.Module: return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), Noise())


def gpt2_tied() -> nn.Module:
    "A tiny Hugging Face GPT-2 whose lm_head is its token embedding (tied), dropout off"
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64, resid_pdrop=0,
                                      embd_pdrop=0, attn_pdrop=0, use_cache=False, tie_word_embeddings=True))
def tokens():
    ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(1))
    return ids, ids


def uneven_loader():
    "Each rank loops over its own shard of 7 samples with no sampler: rank 0 has 4 steps, rank 1 has 3"
    model = nn.Linear(4, 2)
    shard = X[:7].tensor_split(dist.get_world_size())[dist.get_rank()]
    for x in torch.utils.data.DataLoader(shard, batch_size=1):
        loss = model(x).square().mean()
        dist.all_reduce(loss.detach())  # the step's loss over the ranks, for the log


def fsdp_forward_on_rank0():
    "An FSDP2 model evaluated on rank 0 only: its forward all-gathers the parameters that rank 1 never sends"
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = fully_shard(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)),
                        mesh=init_device_mesh('cpu', (dist.get_world_size(),)))
    loss = model(X).square().mean()
    loss.backward()
    if dist.get_rank() == 0: model(X)  # validation on rank 0 only
    dist.all_reduce(loss.detach())


def pipeline_without_split(model):
    "`model` in dtnb's traced stages, in a Pipeline put together by hand without split=: no one sums the tied copies"
    from dtnb.parallel.pipeline import Pipeline, causal_lm_loss, pipeline_stages
    split, mine, mods = pipeline_stages(model, example=tokens()[0][:2])
    return Pipeline(mods, mine, split.n_stages, causal_lm_loss)


class ClassicGPT(nn.Module):
    "Written the classic (nanoGPT) way: fused c_attn, head counts on the module; forward(idx, targets) -> logits, loss"
    def __init__(self, vocab=32, n_embd=16, n_head=2, block=8):
        super().__init__()
        self.n_head, self.n_embd = n_head, n_embd
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(block, n_embd)
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.ln_f, self.lm_head = nn.LayerNorm(n_embd), nn.Linear(n_embd, vocab)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, self.n_embd // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        logits = self.lm_head(self.ln_f(x + self.c_proj(y.transpose(1, 2).reshape(B, T, self.n_embd))))
        if targets is None: return logits, None
        return logits, nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


TOKENS = torch.randint(32, (8, 9), generator=G)
def tokens(): return TOKENS[:, :-1].contiguous(), TOKENS[:, 1:].contiguous()
def gpt_step(model, batch): return model(*batch)[1]  # `--step-fn`: forward(idx, targets) -> (logits, loss): the loss
def gpt_output(model, batch): return model(*batch)   # the whole (logits, loss): not a loss
