"""Rotary attention layers whose forward takes the model's cos/sin tables as separate
arguments, rewritten here in the style of each family (never copied): the book's Llama 3
`GroupedQueryAttention.forward(x, mask, cos, sin)` with tables from a `compute_rope_params`
(halves layout, Llama 3's frequency smoothing in `freq_config`) and a boolean mask True where
a key is hidden, as its model passes; as its Qwen3 layer, with per-head RMSNorm on queries and
keys (a `scale` parameter as the book writes it, or a `weight` as Meta's and transformers'
norms do); the book's fast variant `forward(x, cos, sin)` on SDPA; llama2.c's
`Attention.forward(x, freqs_cos, freqs_sin)` ((tokens, head_dim/2) tables rotating
interleaved pairs) built from this file's one `ModelArgs` dataclass; a layer configured by an
unannotated `cfg` dict; a forward taking arguments no model convention names. Each has
planted-bug copies (constructor flags), audited through `attnlab check` with no adapter in
tests/check/test_forms_rotary.py.

Shapes: b batch, t tokens, h heads, g key/value groups, hd head width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

# --------------------------------------------------------------------------- the book's tables


def compute_rope_params(head_dim, theta_base=10_000, context_length=4096, freq_config=None):
    """(cos, sin), each (context_length, head_dim) in the halves layout: the angles of the
    head_dim/2 frequencies, written twice; Llama 3's smoothing of the low frequencies when
    freq_config gives factor, low/high_freq_factor and original_context_length."""
    inv_freq = 1.0 / theta_base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    if freq_config is not None:
        low_wavelen = freq_config["original_context_length"] / freq_config["low_freq_factor"]
        high_wavelen = freq_config["original_context_length"] / freq_config["high_freq_factor"]
        wavelen = 2 * torch.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / freq_config["factor"], inv_freq)
        smooth = (
            freq_config["original_context_length"] / wavelen - freq_config["low_freq_factor"]
        ) / (freq_config["high_freq_factor"] - freq_config["low_freq_factor"])
        smoothed = (1 - smooth) * (inv_freq / freq_config["factor"]) + smooth * inv_freq
        medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    angles = torch.arange(context_length).float()[:, None] * inv_freq[None, :]  # (t, hd/2)
    angles = torch.cat([angles, angles], dim=1)  # (t, hd)
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x, cos, sin):
    """x (b, h, t, hd) rotated in halves by the first t rows of the tables."""
    seq_len, head_dim = x.shape[2], x.shape[3]
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2 :]
    cos = cos[:seq_len, :].unsqueeze(0).unsqueeze(0)  # (1, 1, t, hd)
    sin = sin[:seq_len, :].unsqueeze(0).unsqueeze(0)
    rotated = torch.cat((-x2, x1), dim=-1)
    return ((x * cos) + (rotated * sin)).to(dtype=x.dtype)


class RMSNorm(nn.Module):
    """The book's Qwen3 norm: a `scale` (and an optional `shift`), computed in float32."""

    def __init__(self, emb_dim, eps=1e-6, bias=False, qwen3_compatible=True):
        super().__init__()
        self.eps, self.qwen3_compatible = eps, qwen3_compatible
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim)) if bias else None

    def forward(self, x):
        input_dtype = x.dtype
        if self.qwen3_compatible:
            x = x.to(torch.float32)
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        norm_x = x * torch.rsqrt(variance + self.eps) * self.scale
        if self.shift is not None:
            norm_x = norm_x + self.shift
        return norm_x.to(input_dtype)


class WeightRMSNorm(nn.Module):
    """Meta's and transformers' form: the scale is a `weight`."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


# --------------------------------------------------------------------------- the book's layers


class GroupedQueryAttention(nn.Module):
    """The book's Llama 3 layer: forward(x, mask, cos, sin), the mask a (t, t) bool True
    where a key is hidden, the tables those of compute_rope_params. Its Qwen3 layer adds a
    head_dim of its own (d_out = num_heads * head_dim need not be d_in) and, with qk_norm,
    RMSNorm on each head's queries and keys before the rotation (`norm`: "scale" as the
    book's RMSNorm holds it, "weight" as Meta's and transformers')."""

    def __init__(self, d_in, num_heads, num_kv_groups, head_dim=None, qk_norm=False,
                 norm="scale", dtype=None, scale_bug=False, rope_bug=False):  # fmt: skip
        super().__init__()
        self.num_heads, self.num_kv_groups = num_heads, num_kv_groups
        self.group_size = num_heads // num_kv_groups
        self.head_dim = head_dim if head_dim is not None else d_in // num_heads
        self.d_out = num_heads * self.head_dim
        kv_width = num_kv_groups * self.head_dim
        self.W_query = nn.Linear(d_in, self.d_out, bias=False, dtype=dtype)
        self.W_key = nn.Linear(d_in, kv_width, bias=False, dtype=dtype)
        self.W_value = nn.Linear(d_in, kv_width, bias=False, dtype=dtype)
        self.out_proj = nn.Linear(self.d_out, d_in, bias=False, dtype=dtype)
        make_norm = RMSNorm if norm == "scale" else WeightRMSNorm
        if qk_norm:
            self.q_norm = make_norm(self.head_dim, eps=1e-6)
            self.k_norm = make_norm(self.head_dim, eps=1e-6)
        else:
            self.q_norm = self.k_norm = None
        self.scale_bug, self.rope_bug = scale_bug, rope_bug

    def forward(self, x, mask, cos, sin):
        b, num_tokens, _ = x.shape
        queries, keys, values = self.W_query(x), self.W_key(x), self.W_value(x)
        queries = queries.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        keys = keys.view(b, num_tokens, self.num_kv_groups, self.head_dim).transpose(1, 2)
        values = values.view(b, num_tokens, self.num_kv_groups, self.head_dim).transpose(1, 2)
        if self.q_norm:
            queries = self.q_norm(queries)
        if self.k_norm:
            keys = self.k_norm(keys)
        queries = apply_rope(queries, cos, sin)
        if not self.rope_bug:  # the bug: the keys left unrotated
            keys = apply_rope(keys, cos, sin)
        keys = keys.repeat_interleave(self.group_size, dim=1)
        values = values.repeat_interleave(self.group_size, dim=1)
        attn_scores = queries @ keys.transpose(2, 3)
        attn_scores = attn_scores.masked_fill(mask, -torch.inf)
        width = self.d_out if self.scale_bug else keys.shape[-1]  # the bug: d_out's root
        attn_weights = torch.softmax(attn_scores / width**0.5, dim=-1)
        context = (attn_weights @ values).transpose(1, 2).reshape(b, num_tokens, self.d_out)
        return self.out_proj(context)


class FastGroupedQueryAttention(nn.Module):
    """The book's fast Llama layer: forward(x, cos, sin), no mask argument, SDPA causal."""

    def __init__(self, d_in, num_heads, num_kv_groups, merge_bug=False):
        super().__init__()
        self.num_heads, self.num_kv_groups = num_heads, num_kv_groups
        self.head_dim = d_in // num_heads
        self.d_out = d_in
        self.W_query = nn.Linear(d_in, d_in, bias=False)
        self.W_key = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=False)
        self.W_value = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=False)
        self.out_proj = nn.Linear(d_in, d_in, bias=False)
        self.merge_bug = merge_bug

    def forward(self, x, cos, sin):
        b, num_tokens, _ = x.shape
        queries = self.W_query(x).view(b, num_tokens, self.num_heads, self.head_dim)
        keys = self.W_key(x).view(b, num_tokens, self.num_kv_groups, self.head_dim)
        values = self.W_value(x).view(b, num_tokens, self.num_kv_groups, self.head_dim)
        queries, keys, values = (t.transpose(1, 2) for t in (queries, keys, values))
        queries, keys = apply_rope(queries, cos, sin), apply_rope(keys, cos, sin)
        context = F.scaled_dot_product_attention(
            queries, keys, values, is_causal=True, enable_gqa=True
        )  # (b, h, t, hd)
        if not self.merge_bug:  # the bug: merged without the transpose back
            context = context.transpose(1, 2)
        return self.out_proj(context.reshape(b, num_tokens, self.d_out))


class ConfiguredGroupedQueryAttention(nn.Module):
    """A layer configured by the model's cfg dict (the book's style, read by item), holding
    its own tables: built from --init as a dict, not as this file's ModelArgs."""

    def __init__(self, cfg):
        super().__init__()
        self.inner = GroupedQueryAttention(cfg["emb_dim"], cfg["n_heads"], cfg["n_kv_groups"])
        cos, sin = compute_rope_params(
            cfg["emb_dim"] // cfg["n_heads"], cfg["rope_base"], cfg["context_length"]
        )
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.context_length = cfg["context_length"]

    def forward(self, x):
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        return self.inner(x, mask, self.cos, self.sin)


class CachedRotaryAttention(GroupedQueryAttention):
    """A forward whose extra arguments no model convention names: the check cannot build
    them."""

    def forward(self, x, rope_cache, segment_ids):
        cos, sin = rope_cache
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1) | (segment_ids < 0)
        return super().forward(x, mask, cos, sin)


# --------------------------------------------------------------------------- llama2.c


@dataclass
class ModelArgs:
    """llama2.c's sizes (this file's one dataclass named ...Args)."""

    dim: int = 32
    n_layers: int = 1
    n_heads: int = 4
    n_kv_heads: int | None = 2
    vocab_size: int = 64
    max_seq_len: int = 16
    dropout: float = 0.0
    causal_bug: bool = False


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0):
    """(freqs_cos, freqs_sin), each (end, dim/2)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    freqs = torch.outer(torch.arange(end, device=freqs.device).float(), freqs)
    return torch.cos(freqs), torch.sin(freqs)


def reshape_for_broadcast(freqs_cis, x):
    assert freqs_cis.shape == (x.shape[1], x.shape[-1])
    shape = [d if i == 1 or i == x.ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(shape)


def apply_rotary_emb(xq, xk, freqs_cos, freqs_sin):
    """Interleaved pairs (2i, 2i + 1) rotated by the real tables."""
    xq_r, xq_i = xq.float().reshape((*xq.shape[:-1], -1, 2)).unbind(-1)
    xk_r, xk_i = xk.float().reshape((*xk.shape[:-1], -1, 2)).unbind(-1)
    freqs_cos = reshape_for_broadcast(freqs_cos, xq_r)
    freqs_sin = reshape_for_broadcast(freqs_sin, xq_r)
    xq_out_r, xq_out_i = xq_r * freqs_cos - xq_i * freqs_sin, xq_r * freqs_sin + xq_i * freqs_cos
    xk_out_r, xk_out_i = xk_r * freqs_cos - xk_i * freqs_sin, xk_r * freqs_sin + xk_i * freqs_cos
    xq_out = torch.stack([xq_out_r, xq_out_i], dim=-1).flatten(3)
    xk_out = torch.stack([xk_out_r, xk_out_i], dim=-1).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class Attention(nn.Module):
    """llama2.c's layer: forward(x, freqs_cos, freqs_sin), SDPA with is_causal."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_kv_heads = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
        self.n_local_heads, self.n_local_kv_heads = args.n_heads, self.n_kv_heads
        self.n_rep = self.n_local_heads // self.n_local_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.attn_dropout = nn.Dropout(args.dropout)
        self.resid_dropout = nn.Dropout(args.dropout)
        self.dropout = args.dropout
        self.causal_bug = args.causal_bug

    def forward(self, x, freqs_cos, freqs_sin):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cos, freqs_sin)
        xk = xk.repeat_interleave(self.n_rep, dim=2)
        xv = xv.repeat_interleave(self.n_rep, dim=2)
        xq, xk, xv = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        if self.causal_bug:  # the bug: is_causal left out
            output = F.scaled_dot_product_attention(
                xq, xk, xv, attn_mask=None, dropout_p=self.dropout if self.training else 0.0
            )
        else:
            output = F.scaled_dot_product_attention(
                xq, xk, xv, attn_mask=None, dropout_p=self.dropout if self.training else 0.0,
                is_causal=True,
            )  # fmt: skip
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.resid_dropout(self.wo(output))
