"""Transformers written the classic way, for tensor parallel against one process (tests/test_tp_classic.py,
tests/test_memory.py): a nanoGPT-style GPT (fused `c_attn`, `n_head`/`n_embd` on the module, tied embeddings) and a
Meta-Llama-style transformer (separate wq/wk/wv/wo, grouped-query attention, reshaped by a stored `n_heads`)."""
import torch
from torch import nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, bias):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd, bias=bias), nn.Linear(n_embd, n_embd, bias=bias)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, n_embd, bias):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(n_embd, 4 * n_embd, bias=bias), nn.Linear(4 * n_embd, n_embd, bias=bias)

    def forward(self, x): return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, bias):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd), CausalSelfAttention(n_embd, n_head, bias)
        self.ln_2, self.mlp = nn.LayerNorm(n_embd), MLP(n_embd, bias)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    "nanoGPT's GPT, small: forward(idx, targets) -> (logits, loss); `bias=False` is nanoGPT's option too"
    def __init__(self, vocab=64, block_size=16, n_layer=2, n_embd=32, n_head=4, bias=False):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, n_embd), wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList(Block(n_embd, n_head, bias) for _ in range(n_layer)), ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied

    def forward(self, idx, targets):
        t = self.transformer
        x = t.wte(idx) + t.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in t.h: x = block(x)
        logits = self.lm_head(t.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


class Attention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads):
        super().__init__()
        self.n_heads, self.n_kv_heads, kv = n_heads, n_kv_heads, n_kv_heads * dim // n_heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, d, bias=False) for d in (dim, kv, kv))
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        hd = C // self.n_heads
        q = self.wq(x).view(B, T, self.n_heads, hd)
        k, v = (l(x).view(B, T, self.n_kv_heads, hd) for l in (self.wk, self.wv))
        k, v = (t.repeat_interleave(self.n_heads // self.n_kv_heads, dim=2) for t in (k, v))
        y = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, C))


class FeedForward(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x): return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads):
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(dim), Attention(dim, n_heads, n_kv_heads)
        self.ffn_norm, self.feed_forward = nn.RMSNorm(dim), FeedForward(dim)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    "Meta's Llama written small: forward(idx, targets) -> (logits, loss)"
    def __init__(self, vocab=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LlamaBlock(dim, n_heads, n_kv_heads) for _ in range(n_layers))
        self.norm, self.output = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.tok_embeddings(idx)
        for layer in self.layers: x = layer(x)
        logits = self.output(self.norm(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def nano_gpt(): torch.manual_seed(0); return NanoGPT()
def llama_classic(): torch.manual_seed(0); return Transformer()
