"""The book's Llama 3.2 (its bonus chapter's standalone model: grouped-query attention,
rotary positions with Llama 3's frequency scaling, RMSNorm, SwiGLU) and its SDPA variant
with attnlab's attention: swap it in with the model's `freq_config`, load the original
weights, decode with a KV cache, and go back.

    python examples/llama32.py

Llama 3.1 and 3.2 slow their rotary positions' long wavelengths by `factor` (32) and keep
the short ones, blending those between (the `rope_freq` entry of the configuration below,
as every Llama 3.2 configuration carries it). The swap takes that dict as it is. The SDPA
variant (`Llama3ModelFast`) calls its attention as `att(x, cos, sin)`, with no mask: the
swapped layer takes that call too. tests/examples/test_recipes.py checks every claim
printed here on a tiny configuration.
"""

from __future__ import annotations

import torch
from torch import nn

import attnlab
from attnlab.interop import llama

LLAMA32_CONFIG_TINY = {
    "vocab_size": 96,
    "context_length": 64,
    "emb_dim": 64,
    "n_heads": 4,
    "n_layers": 2,
    "hidden_dim": 128,
    "n_kv_groups": 2,
    "rope_base": 500_000.0,
    "dtype": torch.float32,
    "rope_freq": {  # Llama 3.2's own rotary scaling
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_context_length": 8192,
    },
}

# ---------------------------------------------------------------------------------------------
# the model, as the bonus chapter writes it


def compute_rope_params(head_dim, theta_base=10_000, context_length=4096, freq_config=None):
    inv_freq = 1.0 / theta_base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    if freq_config is not None:  # Llama 3's scaling: long wavelengths slowed, short kept
        low_wavelen = freq_config["original_context_length"] / freq_config["low_freq_factor"]
        high_wavelen = freq_config["original_context_length"] / freq_config["high_freq_factor"]
        wavelen = 2 * torch.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / freq_config["factor"], inv_freq)
        smooth = (
            freq_config["original_context_length"] / wavelen - freq_config["low_freq_factor"]
        ) / (freq_config["high_freq_factor"] - freq_config["low_freq_factor"])
        blended = (1 - smooth) * inv_freq / freq_config["factor"] + smooth * inv_freq
        medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv_freq = torch.where(medium, blended, scaled)
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
    def __init__(self, d_in, d_out, num_heads, num_kv_groups, dtype=None):
        super().__init__()
        self.d_out, self.num_heads, self.num_kv_groups = d_out, num_heads, num_kv_groups
        self.head_dim = d_out // num_heads
        self.group_size = num_heads // num_kv_groups
        self.W_key = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=False, dtype=dtype)
        self.W_value = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=False, dtype=dtype)
        self.W_query = nn.Linear(d_in, d_out, bias=False, dtype=dtype)
        self.out_proj = nn.Linear(d_out, d_out, bias=False, dtype=dtype)

    def heads(self, x, cos, sin):
        """Queries, keys and values (b, heads, t, hd), rotated; keys and values repeated."""
        b, t, _ = x.shape
        queries = self.W_query(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        keys = self.W_key(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)
        values = self.W_value(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)
        queries, keys = apply_rope(queries, cos, sin), apply_rope(keys, cos, sin)
        keys = keys.repeat_interleave(self.group_size, dim=1)
        values = values.repeat_interleave(self.group_size, dim=1)
        return queries, keys, values

    def forward(self, x, mask, cos, sin):
        b, num_tokens, _ = x.shape
        queries, keys, values = self.heads(x, cos, sin)
        attn_scores = queries @ keys.transpose(2, 3)
        attn_scores = attn_scores.masked_fill(mask, -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        context = (attn_weights @ values).transpose(1, 2).reshape(b, num_tokens, self.d_out)
        return self.out_proj(context)


class GroupedQueryAttentionFast(GroupedQueryAttention):
    """The same layer on PyTorch's scaled_dot_product_attention: causal, no mask taken."""

    def forward(self, x, cos, sin):
        b, num_tokens, _ = x.shape
        queries, keys, values = self.heads(x, cos, sin)
        out = nn.functional.scaled_dot_product_attention(queries, keys, values, is_causal=True)
        return self.out_proj(out.transpose(1, 2).reshape(b, num_tokens, self.d_out))


class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc1 = nn.Linear(cfg["emb_dim"], cfg["hidden_dim"], bias=False, dtype=cfg["dtype"])
        self.fc2 = nn.Linear(cfg["emb_dim"], cfg["hidden_dim"], bias=False, dtype=cfg["dtype"])
        self.fc3 = nn.Linear(cfg["hidden_dim"], cfg["emb_dim"], bias=False, dtype=cfg["dtype"])

    def forward(self, x):
        return self.fc3(nn.functional.silu(self.fc1(x)) * self.fc2(x))


class TransformerBlock(nn.Module):
    attention = GroupedQueryAttention

    def __init__(self, cfg):
        super().__init__()
        self.att = self.attention(
            cfg["emb_dim"], cfg["emb_dim"], cfg["n_heads"], cfg["n_kv_groups"], cfg["dtype"]
        )
        self.ff = FeedForward(cfg)
        self.norm1 = nn.RMSNorm(cfg["emb_dim"], eps=1e-5, dtype=cfg["dtype"])
        self.norm2 = nn.RMSNorm(cfg["emb_dim"], eps=1e-5, dtype=cfg["dtype"])

    def forward(self, x, mask, cos, sin):
        x = x + self.att(self.norm1(x), mask, cos, sin)
        return x + self.ff(self.norm2(x))


class TransformerBlockFast(TransformerBlock):
    attention = GroupedQueryAttentionFast

    def forward(self, x, cos, sin):
        x = x + self.att(self.norm1(x), cos, sin)
        return x + self.ff(self.norm2(x))


class Llama3Model(nn.Module):
    block = TransformerBlock

    def __init__(self, cfg):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"], dtype=cfg["dtype"])
        self.trf_blocks = nn.ModuleList([self.block(cfg) for _ in range(cfg["n_layers"])])
        self.final_norm = nn.RMSNorm(cfg["emb_dim"], eps=1e-5, dtype=cfg["dtype"])
        self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False, dtype=cfg["dtype"])
        cos, sin = compute_rope_params(
            head_dim=cfg["emb_dim"] // cfg["n_heads"],
            theta_base=cfg["rope_base"],
            context_length=cfg["context_length"],
            freq_config=cfg["rope_freq"],
        )
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


class Llama3ModelFast(Llama3Model):
    block = TransformerBlockFast

    def forward(self, in_idx):
        x = self.tok_emb(in_idx)
        for block in self.trf_blocks:
            x = block(x, self.cos, self.sin)
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


def swapped_copy(original: Llama3Model, cfg: dict) -> Llama3Model:
    """The model (Llama3Model or Llama3ModelFast) with attnlab's attention and the same
    weights."""
    # --8<-- [start:swap]
    model = type(original)(cfg)
    # each block's att: attnlab, rope scaled by the model's own freq_config
    llama.swap(model, rope_base=cfg["rope_base"], rope_scaling=cfg["rope_freq"])
    model.load_state_dict(llama.from_llama_state(original.state_dict()))  # strict
    # --8<-- [end:swap]
    return model


# --8<-- [start:cached]
def forward_cached(model: Llama3Model, idx: torch.Tensor, caches, pad=None):
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
def generate_cached(model: Llama3Model, idx: torch.Tensor, max_new_tokens: int, pad=None):
    """Greedy decoding: the prompt once, then one token per step through the caches."""
    caches = attnlab.interop.make_caches(model, idx.shape[0], idx.shape[1] + max_new_tokens)
    logits = forward_cached(model, idx, caches, pad)
    for _ in range(max_new_tokens):
        idx = torch.cat((idx, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
        logits = forward_cached(model, idx[:, -1:], caches, pad)
    return idx


# --8<-- [end:cached]


def restored_copy(model: Llama3Model, cfg: dict) -> Llama3Model:
    """The from-scratch class again, with the swapped model's weights."""
    # --8<-- [start:back]
    original = type(model)(cfg)
    original.load_state_dict(llama.to_llama_state(model.state_dict()))  # strict
    # --8<-- [end:back]
    return original


def main() -> None:
    cfg = LLAMA32_CONFIG_TINY
    for model_class in (Llama3Model, Llama3ModelFast):
        torch.manual_seed(0)
        original = model_class(cfg).eval()
        model = swapped_copy(original, cfg).eval()
        idx = torch.randint(0, cfg["vocab_size"], (2, 10))
        with torch.no_grad():
            difference = (model(idx) - original(idx)).abs().max().item()
        name = model_class.__name__
        print(f"{name} logits, swapped against the original: max difference {difference:.1e}")
        want = generate(original, idx, 20, cfg["context_length"])
        same = torch.equal(generate_cached(model, idx, 20), want)
        print(f"{name} greedy ids, cached against recomputed: identical {same}")
        back = restored_copy(model, cfg).eval()
        same = torch.equal(generate(back, idx, 5, cfg["context_length"]), want[:, :15])
        print(f"{name} back to the from-scratch class: the same ids {same}")


if __name__ == "__main__":
    main()
