"""The book's Gemma 3 (its bonus chapter's standalone model: sliding-window layers with a
local rotary base between global ones, queries and keys through an RMSNorm per head that
scales by 1 + weight, scores scaled by query_pre_attn_scalar ** -0.5, four norms per block)
with attnlab's attention: swap it in layer by layer, load the original weights, decode
with a KV cache, and go back.

    python examples/gemma3.py

A sliding layer becomes a MultiHeadAttention with that window (its cache rolls, holding
the window's tokens only) and the local base; a global one has the global base and no
window. The swap reads the layer's `scaling` and finds its norms' `1 + weight` convention by
running them. tests/examples/test_recipes.py checks every claim printed here on a tiny
configuration.
"""

from __future__ import annotations

import torch
from torch import nn

import attnlab
from attnlab.interop import llama

GEMMA3_CONFIG_TINY = {
    "vocab_size": 96,
    "context_length": 64,
    "emb_dim": 32,
    "n_heads": 4,
    "n_layers": 3,
    "hidden_dim": 64,
    "head_dim": 16,
    "qk_norm": True,
    "n_kv_groups": 2,
    "rope_local_base": 10_000.0,
    "rope_base": 1_000_000.0,
    "sliding_window": 4,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    "dtype": torch.float32,
    "query_pre_attn_scalar": 24,  # not head_dim: the scale is Gemma's own
}

# ---------------------------------------------------------------------------------------------
# the model, as the bonus chapter writes it


class RMSNorm(nn.Module):
    def __init__(self, emb_dim, eps=1e-6, bias=False):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.zeros(emb_dim))  # Gemma: scaled by 1 + scale
        self.shift = nn.Parameter(torch.zeros(emb_dim)) if bias else None

    def forward(self, x):
        input_dtype = x.dtype
        x_f = x.float()
        out = x_f * torch.rsqrt(x_f.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        out = out * (1.0 + self.scale.float())
        if self.shift is not None:
            out = out + self.shift.float()
        return out.to(input_dtype)


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
    def __init__(
        self,
        d_in,
        num_heads,
        num_kv_groups,
        head_dim=None,
        qk_norm=False,
        query_pre_attn_scalar=None,
        dtype=None,
    ):
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
        scalar = self.head_dim if query_pre_attn_scalar is None else query_pre_attn_scalar
        self.scaling = scalar**-0.5

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
        queries = queries * self.scaling
        attn_scores = (queries @ keys.transpose(2, 3)).masked_fill(mask, -torch.inf)
        attn_weights = torch.softmax(attn_scores, dim=-1)
        context = (attn_weights @ values).transpose(1, 2).reshape(b, t, self.d_out)
        return self.out_proj(context)


class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc1 = nn.Linear(cfg["emb_dim"], cfg["hidden_dim"], bias=False, dtype=cfg["dtype"])
        self.fc2 = nn.Linear(cfg["emb_dim"], cfg["hidden_dim"], bias=False, dtype=cfg["dtype"])
        self.fc3 = nn.Linear(cfg["hidden_dim"], cfg["emb_dim"], bias=False, dtype=cfg["dtype"])

    def forward(self, x):
        return self.fc3(nn.functional.gelu(self.fc1(x), approximate="tanh") * self.fc2(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg, attn_type):
        super().__init__()
        self.attn_type = attn_type
        self.att = GroupedQueryAttention(
            d_in=cfg["emb_dim"],
            num_heads=cfg["n_heads"],
            num_kv_groups=cfg["n_kv_groups"],
            head_dim=cfg["head_dim"],
            qk_norm=cfg["qk_norm"],
            query_pre_attn_scalar=cfg["query_pre_attn_scalar"],
            dtype=cfg["dtype"],
        )
        self.ff = FeedForward(cfg)
        self.input_layernorm = RMSNorm(cfg["emb_dim"], eps=1e-6)
        self.post_attention_layernorm = RMSNorm(cfg["emb_dim"], eps=1e-6)
        self.pre_feedforward_layernorm = RMSNorm(cfg["emb_dim"], eps=1e-6)
        self.post_feedforward_layernorm = RMSNorm(cfg["emb_dim"], eps=1e-6)

    def forward(self, x, mask_global, mask_local, cos_global, sin_global, cos_local, sin_local):
        if self.attn_type == "sliding_attention":
            mask, cos, sin = mask_local, cos_local, sin_local
        else:
            mask, cos, sin = mask_global, cos_global, sin_global
        x_attn = self.att(self.input_layernorm(x), mask, cos, sin)
        x = x + self.post_attention_layernorm(x_attn)
        x_ffn = self.ff(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(x_ffn)


class Gemma3Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"], dtype=cfg["dtype"])
        self.blocks = nn.ModuleList([TransformerBlock(cfg, kind) for kind in cfg["layer_types"]])
        self.final_norm = RMSNorm(cfg["emb_dim"], eps=1e-6)
        self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False, dtype=cfg["dtype"])
        self.cfg = cfg
        for kind, base in (("local", cfg["rope_local_base"]), ("global", cfg["rope_base"])):
            cos, sin = compute_rope_params(cfg["head_dim"], base, cfg["context_length"])
            self.register_buffer(f"cos_{kind}", cos, persistent=False)
            self.register_buffer(f"sin_{kind}", sin, persistent=False)

    def _create_masks(self, seq_len, device):
        ones = torch.ones((seq_len, seq_len), dtype=torch.bool, device=device)
        mask_global = torch.triu(ones, diagonal=1)  # the future hidden
        far_past = torch.triu(ones, diagonal=self.cfg["sliding_window"]).T  # i - j >= window
        return mask_global, mask_global | far_past

    def forward(self, input_ids):
        x = self.tok_emb(input_ids) * (self.cfg["emb_dim"] ** 0.5)
        mask_global, mask_local = self._create_masks(input_ids.shape[1], x.device)
        for block in self.blocks:
            x = block(
                x,
                mask_global=mask_global,
                mask_local=mask_local,
                cos_global=self.cos_global,
                sin_global=self.sin_global,
                cos_local=self.cos_local,
                sin_local=self.sin_local,
            )
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


def swapped_copy(original: Gemma3Model, cfg: dict) -> Gemma3Model:
    """The model with attnlab's attention and the same weights."""
    # --8<-- [start:swap]
    model = Gemma3Model(cfg)
    for block in model.blocks:  # each layer with its own window and rotary base
        local = block.attn_type == "sliding_attention"
        block.att = llama.from_llama_attention(
            block.att,
            cfg["context_length"],
            cfg["rope_local_base"] if local else cfg["rope_base"],
            window=cfg["sliding_window"] if local else None,
        )  # its q_norm/k_norm (1 + weight) and its scaling carried over
    model.load_state_dict(llama.from_llama_state(original.state_dict()))  # strict
    # --8<-- [end:swap]
    return model


# --8<-- [start:cached]
def forward_cached(model: Gemma3Model, idx: torch.Tensor, caches, pad=None):
    """Logits of idx's tokens, which follow those the caches hold (one cache per block: a
    sliding layer's rolls over its window); pad (b,): left-padding tokens per row, masked
    (the positions and the windows are relative)."""
    start = caches[0].position
    mask = None
    if pad is not None:
        mask = (torch.arange(start + idx.shape[1]) >= pad[:, None])[:, None, None]  # (b,1,1,k)
    x = model.tok_emb(idx) * (model.cfg["emb_dim"] ** 0.5)
    for block, cache in zip(model.blocks, caches, strict=True):
        x_attn = block.att.attention(block.input_layernorm(x), cache=cache, mask=mask)
        x = x + block.post_attention_layernorm(x_attn)
        x = x + block.post_feedforward_layernorm(block.ff(block.pre_feedforward_layernorm(x)))
    return model.out_head(model.final_norm(x))


@torch.no_grad()
def generate_cached(model: Gemma3Model, idx: torch.Tensor, max_new_tokens: int, pad=None):
    """Greedy decoding: the prompt once, then one token per step through the caches."""
    caches = attnlab.interop.make_caches(model, idx.shape[0], idx.shape[1] + max_new_tokens)
    logits = forward_cached(model, idx, caches, pad)
    for _ in range(max_new_tokens):
        idx = torch.cat((idx, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
        logits = forward_cached(model, idx[:, -1:], caches, pad)
    return idx


# --8<-- [end:cached]


def restored_copy(model: Gemma3Model, cfg: dict) -> Gemma3Model:
    """The from-scratch class again, with the swapped model's weights."""
    # --8<-- [start:back]
    original = Gemma3Model(cfg)
    original.load_state_dict(llama.to_llama_state(model.state_dict(), norm_weight="scale"))
    # --8<-- [end:back]
    return original


def main() -> None:
    torch.manual_seed(0)
    cfg = GEMMA3_CONFIG_TINY
    original = Gemma3Model(cfg).eval()
    with torch.no_grad():  # trained norms are not all zeros
        for name, parameter in original.named_parameters():
            if name.endswith("norm.scale"):
                parameter.normal_(0.0, 0.2)
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
