"""The book's Qwen3 (its bonus chapter's standalone model: grouped-query attention whose
queries and keys go through an RMSNorm per head before the rotation, heads wider than the
model over their count, RMSNorm with a `scale` parameter, SwiGLU) with attnlab's attention:
swap it in, load the original weights, decode with a KV cache, and go back.

    python examples/qwen3.py

The swap carries each layer's `q_norm` and `k_norm` over to attnlab's (`qk_norm="head"`),
their weights included; the state maps rename `q_norm.scale` to `attention.q_norm.weight`
and back. tests/examples/test_recipes.py checks every claim printed here on a tiny
configuration.
"""

from __future__ import annotations

import torch
from torch import nn

import attnlab
from attnlab.interop import llama

QWEN3_CONFIG_TINY = {
    "vocab_size": 96,
    "context_length": 64,
    "emb_dim": 32,
    "n_heads": 4,
    "n_layers": 2,
    "hidden_dim": 64,
    "head_dim": 16,  # 4 heads of 16: wider than emb_dim, as in Qwen3-0.6B
    "qk_norm": True,
    "n_kv_groups": 2,
    "rope_base": 1_000_000.0,
    "dtype": torch.float32,
}

# ---------------------------------------------------------------------------------------------
# the model, as the bonus chapter writes it


class RMSNorm(nn.Module):
    def __init__(self, emb_dim, eps=1e-6, bias=False, qwen3_compatible=True):
        super().__init__()
        self.eps, self.qwen3_compatible = eps, qwen3_compatible
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim)) if bias else None

    def forward(self, x):
        input_dtype = x.dtype
        if self.qwen3_compatible:
            x = x.to(torch.float32)
        norm_x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.scale
        if self.shift is not None:
            norm_x = norm_x + self.shift
        return norm_x.to(input_dtype)


def compute_rope_params(head_dim, theta_base=10_000, context_length=4096):
    inv_freq = 1.0 / theta_base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.arange(context_length).float()[:, None] * inv_freq[None, :]  # (ctx, hd // 2)
    angles = torch.cat([angles, angles], dim=1)  # (context_length, head_dim)
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x, cos, sin):
    seq_len, head_dim = x.shape[2], x.shape[3]  # x (b, heads, t, hd)
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2 :]
    cos, sin = cos[:seq_len][None, None], sin[:seq_len][None, None]  # (1, 1, t, hd)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class GroupedQueryAttention(nn.Module):
    def __init__(self, d_in, num_heads, num_kv_groups, head_dim=None, qk_norm=False, dtype=None):
        super().__init__()
        self.num_heads, self.num_kv_groups = num_heads, num_kv_groups
        self.group_size = num_heads // num_kv_groups
        self.head_dim = d_in // num_heads if head_dim is None else head_dim
        self.d_out = num_heads * self.head_dim
        self.W_query = nn.Linear(d_in, self.d_out, bias=False, dtype=dtype)
        self.W_key = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=False, dtype=dtype)
        self.W_value = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=False, dtype=dtype)
        self.out_proj = nn.Linear(self.d_out, d_in, bias=False, dtype=dtype)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=1e-6)
            self.k_norm = RMSNorm(self.head_dim, eps=1e-6)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, mask, cos, sin):
        b, t, _ = x.shape
        queries = self.W_query(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        keys = self.W_key(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)
        values = self.W_value(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)
        if self.q_norm:
            queries = self.q_norm(queries)
        if self.k_norm:
            keys = self.k_norm(keys)
        queries, keys = apply_rope(queries, cos, sin), apply_rope(keys, cos, sin)
        keys = keys.repeat_interleave(self.group_size, dim=1)
        values = values.repeat_interleave(self.group_size, dim=1)
        attn_scores = (queries @ keys.transpose(2, 3)).masked_fill(mask, -torch.inf)
        attn_weights = torch.softmax(attn_scores / self.head_dim**0.5, dim=-1)
        context = (attn_weights @ values).transpose(1, 2).reshape(b, t, self.d_out)
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
            d_in=cfg["emb_dim"],
            num_heads=cfg["n_heads"],
            head_dim=cfg["head_dim"],
            num_kv_groups=cfg["n_kv_groups"],
            qk_norm=cfg["qk_norm"],
            dtype=cfg["dtype"],
        )
        self.ff = FeedForward(cfg)
        self.norm1 = RMSNorm(cfg["emb_dim"], eps=1e-6)
        self.norm2 = RMSNorm(cfg["emb_dim"], eps=1e-6)

    def forward(self, x, mask, cos, sin):
        x = x + self.att(self.norm1(x), mask, cos, sin)
        return x + self.ff(self.norm2(x))


class Qwen3Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"], dtype=cfg["dtype"])
        self.trf_blocks = nn.ModuleList([TransformerBlock(cfg) for _ in range(cfg["n_layers"])])
        self.final_norm = RMSNorm(cfg["emb_dim"])
        self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False, dtype=cfg["dtype"])
        head_dim = cfg["emb_dim"] // cfg["n_heads"] if cfg["head_dim"] is None else cfg["head_dim"]
        cos, sin = compute_rope_params(head_dim, cfg["rope_base"], cfg["context_length"])
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.cfg = cfg

    def forward(self, in_idx):
        x = self.tok_emb(in_idx)
        num_tokens = x.shape[1]
        mask = torch.triu(
            torch.ones(num_tokens, num_tokens, device=x.device, dtype=torch.bool), diagonal=1
        )
        for block in self.trf_blocks:
            x = block(x, mask, self.cos, self.sin)
        return self.out_head(self.final_norm(x).to(self.cfg["dtype"]))


def generate(model, idx, max_new_tokens, context_size):
    """Greedy generation, the whole context recomputed for every token."""
    for _ in range(max_new_tokens):
        with torch.no_grad():
            logits = model(idx[:, -context_size:])
        idx = torch.cat((idx, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    return idx


# ---------------------------------------------------------------------------------------------
# the recipe


def swapped_copy(original: Qwen3Model, cfg: dict) -> Qwen3Model:
    """The model with attnlab's attention and the same weights."""
    # --8<-- [start:swap]
    model = Qwen3Model(cfg)
    llama.swap(model, rope_base=cfg["rope_base"])  # each att: attnlab, q_norm/k_norm per head
    model.load_state_dict(llama.from_llama_state(original.state_dict()))  # strict
    # --8<-- [end:swap]
    return model


# --8<-- [start:cached]
def forward_cached(model: Qwen3Model, idx: torch.Tensor, caches, pad=None):
    """Logits of idx's tokens, which follow those the caches hold (one cache per block);
    pad (b,): left-padding tokens per row, masked (the positions are relative)."""
    start = caches[0].position
    mask = None
    if pad is not None:
        mask = (torch.arange(start + idx.shape[1]) >= pad[:, None])[:, None, None]  # (b,1,1,k)
    x = model.tok_emb(idx)
    for block, cache in zip(model.trf_blocks, caches, strict=True):
        x = x + block.att.attention(block.norm1(x), cache=cache, mask=mask)  # norms inside
        x = x + block.ff(block.norm2(x))
    return model.out_head(model.final_norm(x))


@torch.no_grad()
def generate_cached(model: Qwen3Model, idx: torch.Tensor, max_new_tokens: int, pad=None):
    """Greedy decoding: the prompt once, then one token per step through the caches."""
    caches = attnlab.interop.make_caches(model, idx.shape[0], idx.shape[1] + max_new_tokens)
    logits = forward_cached(model, idx, caches, pad)
    for _ in range(max_new_tokens):
        idx = torch.cat((idx, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
        logits = forward_cached(model, idx[:, -1:], caches, pad)
    return idx


# --8<-- [end:cached]


def restored_copy(model: Qwen3Model, cfg: dict) -> Qwen3Model:
    """The from-scratch class again, with the swapped model's weights."""
    # --8<-- [start:back]
    original = Qwen3Model(cfg)
    # attention.q_norm.weight back to q_norm.scale, the book's RMSNorm's name
    original.load_state_dict(llama.to_llama_state(model.state_dict(), norm_weight="scale"))
    # --8<-- [end:back]
    return original


def main() -> None:
    torch.manual_seed(0)
    cfg = QWEN3_CONFIG_TINY
    original = Qwen3Model(cfg).eval()
    with torch.no_grad():  # trained norms are not all ones
        for name, parameter in original.named_parameters():
            if name.endswith("norm.scale"):
                parameter.normal_(1.0, 0.2)
    model = swapped_copy(original, cfg).eval()
    idx = torch.randint(0, cfg["vocab_size"], (2, 10))
    with torch.no_grad():
        difference = (model(idx) - original(idx)).abs().max().item()
    print(f"logits, swapped against the original: max difference {difference:.1e}")
    want = generate(original, idx, 20, cfg["context_length"])
    same = torch.equal(generate_cached(model, idx, 20), want)
    print(f"greedy ids, cached against recomputed: identical {same}")
    back = restored_copy(model, cfg).eval()
    same = torch.equal(generate(back, idx, 5, cfg["context_length"]), want[:, :15])
    print(f"back to the from-scratch class: the same ids {same}")


if __name__ == "__main__":
    main()
