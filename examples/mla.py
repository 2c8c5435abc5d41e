"""The book's GPT with multi-head latent attention (its bonus chapter's MLA, DeepSeek-V2/V3's
attention without the rotary part: keys and values up-projected per head from one low-rank
latent of each token, which is all its cache keeps) on attnlab's MultiHeadLatentAttention:
swap it in, load the original weights, decode with attnlab's LatentCache, and go back.

    python examples/mla.py

attnlab's layer computes the same attention; decoding, it attends in the latent space
itself (the up-projections absorbed into the queries and outputs), reading the cached
latents as they are instead of expanding every key and value at every step. There is no
library swap for the book's MLA: the recipe's swap section converts each layer itself, and
the state maps below fuse W_UK and W_UV into kv_b_proj's rows head by head. The swapped
layer also takes the book's own call `att(x, use_cache=...)`, so the book's cached
generation runs on it too. tests/examples/test_recipes.py checks every claim printed here
on a tiny configuration.
"""

from __future__ import annotations

import torch
from torch import nn

import attnlab

MLA_CONFIG_TINY = {
    "vocab_size": 96,
    "context_length": 64,
    "emb_dim": 32,
    "n_heads": 4,
    "n_layers": 2,
    "drop_rate": 0.0,
    "qkv_bias": False,
    "latent_dim": 8,  # the cache's values per token and layer (keys and values: 2 x 32)
}

# ---------------------------------------------------------------------------------------------
# the model, as the bonus chapter writes it


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, d_in, d_out, dropout, num_heads, qkv_bias=False, latent_dim=None):
        super().__init__()
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.latent_dim = latent_dim if latent_dim is not None else max(16, d_out // 8)
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)  # per-head queries
        self.W_DKV = nn.Linear(d_in, self.latent_dim, bias=qkv_bias)  # down to the latent
        self.W_UK = nn.Linear(self.latent_dim, d_out, bias=qkv_bias)  # latent -> keys
        self.W_UV = nn.Linear(self.latent_dim, d_out, bias=qkv_bias)  # latent -> values
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("cache_c_kv", None, persistent=False)  # the latent cache
        self.ptr_current_pos = 0

    def reset_cache(self):
        self.cache_c_kv, self.ptr_current_pos = None, 0

    def _heads(self, t):
        b, n, _ = t.shape  # (b, n, d_out) -> (b, heads, n, head_dim)
        return t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x, use_cache=False):
        b, num_tokens, _ = x.shape
        latent = self.W_DKV(x)  # (b, n, latent_dim)
        if use_cache:
            if self.cache_c_kv is not None:
                latent = torch.cat([self.cache_c_kv, latent], dim=1)
            self.cache_c_kv = latent
        queries = self._heads(self.W_query(x))
        keys, values = self._heads(self.W_UK(latent)), self._heads(self.W_UV(latent))
        attn_scores = queries @ keys.transpose(-2, -1)
        first = self.ptr_current_pos if use_cache else 0
        self.ptr_current_pos = first + num_tokens if use_cache else 0
        q_positions = torch.arange(first, first + num_tokens, device=x.device)
        k_positions = torch.arange(keys.shape[-2], device=x.device)
        attn_scores.masked_fill_(q_positions[:, None] < k_positions[None, :], -torch.inf)
        attn_weights = self.dropout(torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1))
        context = (attn_weights @ values).transpose(1, 2).reshape(b, num_tokens, self.d_out)
        return self.out_proj(context)


class LayerNorm(nn.Module):
    def __init__(self, emb_dim):
        super().__init__()
        self.eps = 1e-5
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim))

    def forward(self, x):
        mean = x.mean(dim=-1, keepdim=True)
        var = x.var(dim=-1, keepdim=True, unbiased=False)
        return self.scale * (x - mean) / torch.sqrt(var + self.eps) + self.shift


class GELU(nn.Module):
    def forward(self, x):
        inner = torch.sqrt(torch.tensor(2.0 / torch.pi)) * (x + 0.044715 * torch.pow(x, 3))
        return 0.5 * x * (1 + torch.tanh(inner))


class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(cfg["emb_dim"], 4 * cfg["emb_dim"]),
            GELU(),
            nn.Linear(4 * cfg["emb_dim"], cfg["emb_dim"]),
        )

    def forward(self, x):
        return self.layers(x)


class TransformerBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.att = MultiHeadLatentAttention(
            d_in=cfg["emb_dim"],
            d_out=cfg["emb_dim"],
            num_heads=cfg["n_heads"],
            dropout=cfg["drop_rate"],
            qkv_bias=cfg["qkv_bias"],
            latent_dim=cfg["latent_dim"],
        )
        self.ff = FeedForward(cfg)
        self.norm1 = LayerNorm(cfg["emb_dim"])
        self.norm2 = LayerNorm(cfg["emb_dim"])
        self.drop_shortcut = nn.Dropout(cfg["drop_rate"])

    def forward(self, x, use_cache=False):
        x = x + self.drop_shortcut(self.att(self.norm1(x), use_cache=use_cache))
        return x + self.drop_shortcut(self.ff(self.norm2(x)))


class GPTModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"])
        self.pos_emb = nn.Embedding(cfg["context_length"], cfg["emb_dim"])
        self.drop_emb = nn.Dropout(cfg["drop_rate"])
        self.trf_blocks = nn.ModuleList([TransformerBlock(cfg) for _ in range(cfg["n_layers"])])
        self.current_pos = 0
        self.final_norm = LayerNorm(cfg["emb_dim"])
        self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False)

    def forward(self, in_idx, use_cache=False):
        seq_len = in_idx.shape[1]
        first = self.current_pos if use_cache else 0
        self.current_pos = first + seq_len if use_cache else self.current_pos
        pos_embeds = self.pos_emb(torch.arange(first, first + seq_len, device=in_idx.device))
        x = self.drop_emb(self.tok_emb(in_idx) + pos_embeds[None])
        for block in self.trf_blocks:
            x = block(x, use_cache=use_cache)
        return self.out_head(self.final_norm(x))

    def reset_kv_cache(self):
        for block in self.trf_blocks:
            block.att.reset_cache()
        self.current_pos = 0


def generate_text_simple_cached(model, idx, max_new_tokens, context_size=None, use_cache=True):
    """The book's greedy generation: through the layers' own caches, or (use_cache=False)
    the whole context recomputed for every token."""
    model.eval()
    context_size = context_size or model.pos_emb.num_embeddings
    with torch.no_grad():
        if use_cache:
            model.reset_kv_cache()
            logits = model(idx[:, -context_size:], use_cache=True)
        for _ in range(max_new_tokens):
            if not use_cache:
                logits = model(idx[:, -context_size:])
            next_idx = logits[:, -1].argmax(dim=-1, keepdim=True)
            idx = torch.cat([idx, next_idx], dim=1)
            if use_cache:
                logits = model(next_idx, use_cache=True)
    return idx


# ---------------------------------------------------------------------------------------------
# the recipe


# --8<-- [start:swap]
class LatentAttention(nn.Module):
    """attnlab's MultiHeadLatentAttention (`attention`) taking the book layer's call
    att(x, use_cache=...): with use_cache, a LatentCache holds the latents, as the book's
    cache_c_kv does."""

    def __init__(self, attention: attnlab.MultiHeadLatentAttention):
        super().__init__()
        self.attention, self.cache = attention, None

    def reset_cache(self):
        self.cache = None

    def forward(self, x, use_cache=False):
        if not use_cache:
            return self.attention(x)
        if self.cache is None:
            self.cache = self.attention.make_cache(x.shape[0])
        return self.attention(x, cache=self.cache)


_NAMES = {  # the book's layer -> attnlab's, under each block's att
    "W_query.weight": "attention.q_proj.weight",
    "W_DKV.weight": "attention.kv_a_proj_with_mqa.weight",
    "out_proj.weight": "attention.o_proj.weight",
    "out_proj.bias": "attention.o_proj.bias",
}


def from_mla_state(state: dict, heads: int) -> dict:
    """The book model's state_dict with each layer's names as attnlab's, and W_UK, W_UV
    fused into kv_b_proj: for each head its key rows, then its value rows."""
    result = dict(state)
    for key in [k for k in state if k.endswith("W_UK.weight")]:
        prefix = key.removesuffix("W_UK.weight")
        keys, values = result.pop(key), result.pop(f"{prefix}W_UV.weight")  # (d_out, r) each
        rows = torch.cat([keys.unflatten(0, (heads, -1)), values.unflatten(0, (heads, -1))], 1)
        result[f"{prefix}attention.kv_b_proj.weight"] = rows.flatten(0, 1)  # (h (hd + hd), r)
        for book, ours in _NAMES.items():
            result[prefix + ours] = result.pop(prefix + book)
    return result


def from_book_mla(layer, context_length: int) -> LatentAttention:
    """attnlab's layer for the book's: queries from W_query, the latent from W_DKV (no
    rotary dims, no latent norm), kv_b_proj's rows head by head [W_UK's, W_UV's]."""
    if layer.W_UK.bias is not None:
        raise ValueError("qkv_bias: attnlab's MLA, as DeepSeek's, has no bias up from the latent")
    heads, head_dim, latent = layer.num_heads, layer.head_dim, layer.latent_dim
    attention = attnlab.MultiHeadLatentAttention(
        layer.W_query.in_features, heads, None, latent, head_dim, 0, head_dim, context_length,
        dropout=layer.dropout.p, out_bias=True, latent_norm=False,
    )  # fmt: skip
    swapped = LatentAttention(attention).to(layer.W_query.weight)
    swapped.load_state_dict(from_mla_state(layer.state_dict(), heads))  # strict
    return swapped


def swapped_copy(original: GPTModel, cfg: dict) -> GPTModel:
    """The model with attnlab's attention and the same weights."""
    model = GPTModel(cfg)
    for block in model.trf_blocks:
        block.att = from_book_mla(block.att, cfg["context_length"])
    model.load_state_dict(from_mla_state(original.state_dict(), cfg["n_heads"]))  # strict
    return model


# --8<-- [end:swap]


# --8<-- [start:cached]
def forward_cached(model: GPTModel, idx: torch.Tensor, caches, pad=None):
    """Logits of idx's tokens, which follow those the caches hold (one LatentCache per
    block); pad (b,): left-padding tokens per row, masked and not counted as positions."""
    start = caches[0].position
    if start + idx.shape[1] > model.pos_emb.num_embeddings:  # no crop: the cache holds all
        raise ValueError(f"{start + idx.shape[1]} tokens exceed the context length")
    pos = torch.arange(start, start + idx.shape[1])  # (t,) absolute positions
    mask = None
    if pad is not None:
        pos = (pos - pad[:, None]).clamp(min=0)  # (b, t): each row's own positions
        mask = (torch.arange(start + idx.shape[1]) >= pad[:, None])[:, None, None]  # (b,1,1,k)
    x = model.drop_emb(model.tok_emb(idx) + model.pos_emb(pos))
    for block, cache in zip(model.trf_blocks, caches, strict=True):
        attended = block.att.attention(block.norm1(x), cache=cache, mask=mask)
        x = x + block.drop_shortcut(attended)
        x = x + block.drop_shortcut(block.ff(block.norm2(x)))
    return model.out_head(model.final_norm(x))


def make_caches(model: GPTModel, batch_size: int, max_tokens: int | None = None):
    """One empty LatentCache per block: per token, the latent alone."""
    return [block.att.attention.make_cache(batch_size, max_tokens) for block in model.trf_blocks]


@torch.no_grad()
def generate_cached(model: GPTModel, idx: torch.Tensor, max_new_tokens: int, pad=None):
    """Greedy decoding: the prompt once, then one token per step through the caches."""
    caches = make_caches(model, idx.shape[0], idx.shape[1] + max_new_tokens)
    logits = forward_cached(model, idx, caches, pad)
    for _ in range(max_new_tokens):
        idx = torch.cat((idx, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
        logits = forward_cached(model, idx[:, -1:], caches, pad)
    return idx


# --8<-- [end:cached]


# --8<-- [start:back]
def to_mla_state(state: dict, heads: int) -> dict:
    """The inverse of from_mla_state, for the book's class."""
    result = dict(state)
    for key in [k for k in state if k.endswith("attention.kv_b_proj.weight")]:
        prefix = key.removesuffix("attention.kv_b_proj.weight")
        rows = result.pop(key).unflatten(0, (heads, -1))  # (h, hd + hd, r)
        keys, values = rows.chunk(2, dim=1)
        result[f"{prefix}W_UK.weight"] = keys.flatten(0, 1)
        result[f"{prefix}W_UV.weight"] = values.flatten(0, 1)
        for book, ours in _NAMES.items():
            result[prefix + book] = result.pop(prefix + ours)
    return result


def restored_copy(model: GPTModel, cfg: dict) -> GPTModel:
    """The book's class again, with the swapped model's weights."""
    original = GPTModel(cfg)
    original.load_state_dict(to_mla_state(model.state_dict(), cfg["n_heads"]))  # strict
    return original


# --8<-- [end:back]


def main() -> None:
    torch.manual_seed(0)
    cfg = MLA_CONFIG_TINY
    original = GPTModel(cfg).eval()
    model = swapped_copy(original, cfg).eval()
    idx = torch.randint(0, cfg["vocab_size"], (2, 10))
    with torch.no_grad():
        difference = (model(idx) - original(idx)).abs().max().item()
    print(f"logits, swapped against the book's MLA: max difference {difference:.1e}")
    want = generate_text_simple_cached(original, idx, 20, use_cache=False)
    same = torch.equal(generate_cached(model, idx, 20), want)
    print(f"greedy ids, cached (latents only) against recomputed: identical {same}")
    cache = model.trf_blocks[0].att.attention.make_cache(1)
    print(
        f"cache per token and layer: {cache.bytes_per_token // 4} values "
        f"(multi-head attention's: {2 * cfg['emb_dim']})"
    )
    back = restored_copy(model, cfg).eval()
    same = torch.equal(generate_text_simple_cached(back, idx, 5, use_cache=False), want[:, :15])
    print(f"back to the book's class: the same ids {same}")


if __name__ == "__main__":
    main()
