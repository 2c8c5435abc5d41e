"""A Llama-style model written from scratch (grouped-query attention, rotary positions,
RMSNorm, SwiGLU), as the book's bonus chapters build one, with attnlab's attention: swap it
in, load the original weights, decode with a KV cache, and go back.

    python examples/llama.py

tests/examples/test_llama.py checks every claim printed here on a tiny configuration.
"""

from __future__ import annotations

import torch
from torch import nn

import attnlab
from attnlab.interop import llama

LLAMA_CONFIG_TINY = {
    "vocab_size": 96,
    "context_length": 64,
    "emb_dim": 32,
    "n_heads": 4,
    "n_layers": 2,
    "hidden_dim": 64,
    "n_kv_groups": 2,
    "rope_base": 500_000.0,
    "dtype": torch.float32,
}

# ---------------------------------------------------------------------------------------------
# the model, from scratch


def compute_rope_params(head_dim, theta_base, context_length):
    inv_freq = 1.0 / (theta_base ** (torch.arange(0, head_dim, 2).float() / head_dim))
    positions = torch.arange(context_length).float()
    angles = positions[:, None] * inv_freq[None, :]  # (context_length, head_dim // 2)
    angles = torch.cat([angles, angles], dim=1)  # (context_length, head_dim)
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x, cos, sin):
    seq_len, head_dim = x.shape[2], x.shape[3]  # x (b, heads, t, hd)
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2 :]
    cos, sin = cos[:seq_len][None, None], sin[:seq_len][None, None]  # (1, 1, t, hd)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class GroupedQueryAttention(nn.Module):
    def __init__(self, d_in, d_out, num_heads, num_kv_groups, dtype=None):
        super().__init__()
        self.num_heads, self.num_kv_groups = num_heads, num_kv_groups
        self.group_size = num_heads // num_kv_groups
        self.head_dim = d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=False, dtype=dtype)
        self.W_key = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=False, dtype=dtype)
        self.W_value = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=False, dtype=dtype)
        self.out_proj = nn.Linear(d_out, d_out, bias=False, dtype=dtype)

    def forward(self, x, mask, cos, sin):
        b, num_tokens, _ = x.shape
        queries = self.W_query(x).view(b, num_tokens, self.num_heads, self.head_dim)
        keys = self.W_key(x).view(b, num_tokens, self.num_kv_groups, self.head_dim)
        values = self.W_value(x).view(b, num_tokens, self.num_kv_groups, self.head_dim)
        queries, keys, values = (t.transpose(1, 2) for t in (queries, keys, values))
        queries, keys = apply_rope(queries, cos, sin), apply_rope(keys, cos, sin)
        keys = keys.repeat_interleave(self.group_size, dim=1)
        values = values.repeat_interleave(self.group_size, dim=1)
        attn_scores = queries @ keys.transpose(2, 3)
        attn_scores = attn_scores.masked_fill(mask[:num_tokens, :num_tokens], -torch.inf)
        attn_weights = torch.softmax(attn_scores / self.head_dim**0.5, dim=-1)
        context = (attn_weights @ values).transpose(1, 2).reshape(b, num_tokens, -1)
        return self.out_proj(context)


class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc1 = nn.Linear(cfg["emb_dim"], cfg["hidden_dim"], bias=False, dtype=cfg["dtype"])
        self.fc2 = nn.Linear(cfg["emb_dim"], cfg["hidden_dim"], bias=False, dtype=cfg["dtype"])
        self.fc3 = nn.Linear(cfg["hidden_dim"], cfg["emb_dim"], bias=False, dtype=cfg["dtype"])

    def forward(self, x):
        return self.fc3(nn.functional.silu(self.fc1(x)) * self.fc2(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.att = GroupedQueryAttention(
            cfg["emb_dim"], cfg["emb_dim"], cfg["n_heads"], cfg["n_kv_groups"], cfg["dtype"]
        )
        self.ff = FeedForward(cfg)
        self.norm1 = nn.RMSNorm(cfg["emb_dim"], eps=1e-5, dtype=cfg["dtype"])
        self.norm2 = nn.RMSNorm(cfg["emb_dim"], eps=1e-5, dtype=cfg["dtype"])

    def forward(self, x, mask, cos, sin):
        x = x + self.att(self.norm1(x), mask, cos, sin)
        return x + self.ff(self.norm2(x))


class Llama(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"], dtype=cfg["dtype"])
        self.trf_blocks = nn.ModuleList([TransformerBlock(cfg) for _ in range(cfg["n_layers"])])
        self.final_norm = nn.RMSNorm(cfg["emb_dim"], eps=1e-5, dtype=cfg["dtype"])
        self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False, dtype=cfg["dtype"])
        cos, sin = compute_rope_params(
            cfg["emb_dim"] // cfg["n_heads"], cfg["rope_base"], cfg["context_length"]
        )
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, in_idx):
        x = self.tok_emb(in_idx)
        num_tokens = x.shape[1]
        mask = torch.triu(torch.ones(num_tokens, num_tokens, dtype=torch.bool), diagonal=1)
        for block in self.trf_blocks:
            x = block(x, mask, self.cos, self.sin)
        return self.out_head(self.final_norm(x))


def generate(model, idx, max_new_tokens, context_size):
    """Greedy generation, the whole context recomputed for every token."""
    for _ in range(max_new_tokens):
        with torch.no_grad():
            logits = model(idx[:, -context_size:])
        idx = torch.cat((idx, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    return idx


# ---------------------------------------------------------------------------------------------
# the recipe


def swapped_copy(original: Llama, cfg: dict) -> Llama:
    """The model with attnlab's attention and the same weights."""
    # --8<-- [start:swap]
    model = Llama(cfg)
    llama.swap(model, rope_base=cfg["rope_base"])  # each block's att: attnlab, rope included
    model.load_state_dict(llama.from_llama_state(original.state_dict()))  # strict
    # --8<-- [end:swap]
    return model


# --8<-- [start:cached]
def forward_cached(model: Llama, idx: torch.Tensor, caches, pad=None):
    """Logits of idx's tokens, which follow those the caches hold (one cache per block);
    pad (b,): left-padding tokens per row, masked (rotary positions are relative, so a row
    shifted by its padding attends as it would alone)."""
    start = caches[0].position
    mask = None
    if pad is not None:
        mask = (torch.arange(start + idx.shape[1]) >= pad[:, None])[:, None, None]  # (b,1,1,k)
    x = model.tok_emb(idx)
    for block, cache in zip(model.trf_blocks, caches, strict=True):
        x = x + block.att.attention(block.norm1(x), cache=cache, mask=mask)
        x = x + block.ff(block.norm2(x))
    return model.out_head(model.final_norm(x))


@torch.no_grad()
def generate_cached(model: Llama, idx: torch.Tensor, max_new_tokens: int, pad=None):
    """Greedy decoding: the prompt once, then one token per step through the caches."""
    caches = attnlab.interop.make_caches(model, idx.shape[0], idx.shape[1] + max_new_tokens)
    logits = forward_cached(model, idx, caches, pad)
    for _ in range(max_new_tokens):
        idx = torch.cat((idx, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
        logits = forward_cached(model, idx[:, -1:], caches, pad)
    return idx


# --8<-- [end:cached]


def restored_copy(model: Llama, cfg: dict) -> Llama:
    """The from-scratch class again, with the swapped model's weights."""
    # --8<-- [start:back]
    original = Llama(cfg)
    original.load_state_dict(llama.to_llama_state(model.state_dict()))  # strict
    # --8<-- [end:back]
    return original


def main() -> None:
    torch.manual_seed(0)
    cfg = LLAMA_CONFIG_TINY
    original = Llama(cfg).eval()
    model = swapped_copy(original, cfg).eval()
    idx = torch.randint(0, cfg["vocab_size"], (2, 10))
    with torch.no_grad():
        difference = (model(idx) - original(idx)).abs().max().item()
    print(f"logits, swapped against the from-scratch attention: max difference {difference:.1e}")
    want = generate(original, idx, 20, cfg["context_length"])
    same = torch.equal(generate_cached(model, idx, 20), want)
    print(f"greedy ids, cached against recomputed: identical {same}")
    back = restored_copy(model, cfg).eval()
    same = torch.equal(generate(back, idx, 5, cfg["context_length"]), want[:, :15])
    print(f"back to the from-scratch class: the same ids {same}")


if __name__ == "__main__":
    main()
