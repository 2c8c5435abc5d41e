"""Attention as modern code writes it, rewritten here in the style of each family (never
copied): rotary positions in both conventions (halves rotated, as GPT-NeoX and HF Llama;
interleaved pairs or complex numbers, as GPT-J and Meta's Llama), partial rotary dimensions,
the base kept as an attribute, an inv_freq buffer or a cos/sin table; and the book's bonus
MHAPyTorchClass (nn.MultiheadAttention followed by a Linear). Each family has planted-bug
copies (tests/check/test_modern.py)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

D, T = 32, 16


class MHAPyTorchClass(nn.Module):
    """The book's bonus pattern: PyTorch's MultiheadAttention, then one more Linear."""

    def __init__(self, d_in=D, d_out=D, num_heads=4, context_length=T, qkv_bias=False):
        super().__init__()
        self.context_length = context_length
        self.multihead_attn = nn.MultiheadAttention(
            embed_dim=d_out, num_heads=num_heads, bias=qkv_bias, add_bias_kv=qkv_bias,
            batch_first=True,
        )  # fmt: skip
        self.proj = nn.Linear(d_out, d_out)
        mask = torch.triu(torch.ones(context_length, context_length), diagonal=1).bool()
        self.register_buffer("mask", mask)

    def forward(self, x):
        num_tokens = x.shape[1]
        attn_mask = self.mask[:num_tokens, :num_tokens]
        attn_output, _ = self.multihead_attn(x, x, x, attn_mask=attn_mask, need_weights=False)
        return self.proj(attn_output)


# ---------------------------------------------------------------------------------------------
# halves rotated (HF Llama, GPT-NeoX): an inner rotary module with an inv_freq buffer


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, seq_len):
        t = torch.arange(seq_len, dtype=self.inv_freq.dtype)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


class LlamaStyleAttention(nn.Module):
    """q_proj/k_proj/v_proj/o_proj, grouped key/value heads, rotate_half rotary, SDPA."""

    def __init__(self, hidden_size=D, num_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                 scale_bug=False, rotate_bug=False):  # fmt: skip
        super().__init__()
        self.num_heads, self.num_key_value_heads = num_heads, num_key_value_heads
        self.head_dim = hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)
        self.rotary_emb = RotaryEmbedding(self.head_dim, base=rope_theta)
        self.scale_bug, self.rotate_bug = scale_bug, rotate_bug

    def forward(self, hidden_states):
        bsz, q_len, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = self.rotary_emb(q_len)
        q = q * cos + rotate_half(q) * sin
        if not self.rotate_bug:  # the bug: keys left unrotated
            k = k * cos + rotate_half(k) * sin
        groups = self.num_heads // self.num_key_value_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scale = 1.0 if self.scale_bug else None  # the bug: no 1/sqrt(head_dim)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        out = out.transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(out)


class NeoXStyleAttention(nn.Module):
    """GPT-NeoX: one fused query_key_value laid out per head (q, k, v of head 0, then head
    1, ...), partial rotary (rotary_pct of each head), a cos/sin table as buffers, the mask
    written with torch.where."""

    def __init__(self, hidden_size=D, num_attention_heads=4, rotary_pct=0.5, max_positions=T,
                 rotary_emb_base=10000, mask_bug=False):  # fmt: skip
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.head_size = hidden_size // num_attention_heads
        self.rotary_ndims = int(self.head_size * rotary_pct)
        self.query_key_value = nn.Linear(hidden_size, 3 * hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)
        inv_freq = 1.0 / (
            rotary_emb_base ** (torch.arange(0, self.rotary_ndims, 2).float() / self.rotary_ndims)
        )
        freqs = torch.outer(torch.arange(max_positions).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)
        bias = torch.tril(torch.ones(max_positions, max_positions, dtype=torch.bool))
        self.register_buffer("bias", bias, persistent=False)
        self.mask_bug = mask_bug

    def forward(self, hidden_states):
        b, t, _ = hidden_states.shape
        qkv = self.query_key_value(hidden_states)
        qkv = qkv.view(b, t, self.num_attention_heads, 3 * self.head_size).permute(0, 2, 1, 3)
        query, key, value = qkv.chunk(3, dim=-1)  # (b, nh, t, hs) each
        cos, sin = self.cos_cached[:t], self.sin_cached[:t]
        r = self.rotary_ndims
        q_rot, q_pass = query[..., :r], query[..., r:]
        k_rot, k_pass = key[..., :r], key[..., r:]
        query = torch.cat((q_rot * cos + rotate_half(q_rot) * sin, q_pass), dim=-1)
        key = torch.cat((k_rot * cos + rotate_half(k_rot) * sin, k_pass), dim=-1)
        scores = query @ key.transpose(-1, -2) / self.head_size**0.5
        causal = self.bias[:t, :t]
        if self.mask_bug:  # the bug: the mask inverted
            causal = ~causal
        scores = torch.where(causal, scores, torch.finfo(scores.dtype).min)
        weights = scores.softmax(dim=-1)
        out = (weights @ value).transpose(1, 2).reshape(b, t, -1)
        return self.dense(out)


# ---------------------------------------------------------------------------------------------
# interleaved pairs (GPT-J's rotate_every_two; Meta Llama's complex freqs_cis)


def rotate_every_two(x):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class GPTJStyleAttention(nn.Module):
    """GPT-J: separate q/k/v/out projections without biases, rotary on the first rotary_dim
    features of each head in interleaved pairs, sin/cos from a base attribute."""

    def __init__(self, embed_dim=D, num_attention_heads=4, rotary_dim=4, base=10000.0,
                 scale_bug=False):  # fmt: skip
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.head_dim = embed_dim // num_attention_heads
        self.rotary_dim, self.base = rotary_dim, base
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.scale_bug = scale_bug

    def _rotary(self, x):  # x (b, t, h, hd)
        t = x.shape[1]
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.rotary_dim, 2) / self.rotary_dim))
        sinusoid = torch.einsum("i,j->ij", torch.arange(t, dtype=torch.float), inv_freq)
        sin = sinusoid.sin().repeat_interleave(2, dim=-1)[None, :, None, :]
        cos = sinusoid.cos().repeat_interleave(2, dim=-1)[None, :, None, :]
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        return torch.cat([rot * cos + rotate_every_two(rot) * sin, rest], dim=-1)

    def forward(self, hidden_states):
        b, t, _ = hidden_states.shape
        shape = (b, t, self.num_attention_heads, self.head_dim)
        query = self._rotary(self.q_proj(hidden_states).view(shape)).permute(0, 2, 1, 3)
        key = self._rotary(self.k_proj(hidden_states).view(shape)).permute(0, 2, 1, 3)
        value = self.v_proj(hidden_states).view(shape).permute(0, 2, 1, 3)
        scores = torch.matmul(query, key.transpose(-1, -2))
        if not self.scale_bug:  # the bug: the scale left out
            scores = scores / self.head_dim**0.5
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        out = torch.matmul(scores.softmax(-1), value).permute(0, 2, 1, 3).reshape(b, t, -1)
        return self.out_proj(out)


class MetaLlamaStyleAttention(nn.Module):
    """Meta's Llama: wq/wk/wv/wo, grouped heads, rotary as complex multiplication by
    freqs_cis (interleaved pairs), theta 500000, kept as a complex buffer."""

    def __init__(self, dim=D, n_heads=4, n_kv_heads=1, max_seq_len=T, rope_theta=500000.0,
                 merge_bug=False):  # fmt: skip
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        freqs = 1.0 / (rope_theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        freqs = torch.outer(torch.arange(max_seq_len).float(), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(freqs), freqs))
        self.merge_bug = merge_bug

    def forward(self, x):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        freqs_cis = self.freqs_cis[:seqlen].view(1, seqlen, 1, -1)
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
        xq = torch.view_as_real(xq_ * freqs_cis).flatten(3).type_as(x)
        xk = torch.view_as_real(xk_ * freqs_cis).flatten(3).type_as(x)
        n_rep = self.n_heads // self.n_kv_heads
        keys = xk.repeat_interleave(n_rep, dim=2).transpose(1, 2)
        values = xv.repeat_interleave(n_rep, dim=2).transpose(1, 2)
        xq = xq.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / self.head_dim**0.5
        mask = torch.full((seqlen, seqlen), float("-inf")).triu(1)
        scores = F.softmax((scores + mask).float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, values)  # (bs, n_heads, seqlen, head_dim)
        if self.merge_bug:  # the bug: heads merged without the transpose back
            output = output.contiguous().view(bsz, seqlen, -1)
        else:
            output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class TimmStyleAttention(nn.Module):
    """timm's ViT attention: fused qkv, q_norm/k_norm as Identity, self.scale, non-causal
    (audited with causal=False), attn_drop and proj_drop."""

    def __init__(self, dim=D, num_heads=4, qkv_bias=True, scale_bug=False):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = 1.0 if scale_bug else self.head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm, self.k_norm = nn.Identity(), nn.Identity()
        self.attn_drop = nn.Dropout(0.0)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(0.0)

    def forward(self, x):
        B, N, C = x.shape  # noqa: N806 (timm's names)
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        attn = self.attn_drop(attn.softmax(dim=-1))
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(x))


class XTransformersStyleAttention(nn.Module):
    """x-transformers style: to_q, to_k, to_v, to_out, einsum scores, a causal mask built
    with triu on the fly, heads split with einops-like rearranges written out."""

    def __init__(self, dim=D, heads=4, dim_head=8, causal=True, mask_bug=False):
        super().__init__()
        self.heads, self.scale, self.causal = heads, dim_head**-0.5, causal
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.Linear(inner, dim, bias=False)
        self.mask_bug = mask_bug

    def forward(self, x):
        b, n, _ = x.shape
        h = self.heads
        q, k, v = (
            f(x).view(b, n, h, -1).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v)
        )
        dots = torch.einsum("b h i d, b h j d -> b h i j", q, k) * self.scale
        if self.causal:
            diagonal = 2 if self.mask_bug else 1  # the bug: each query sees the next token
            causal_mask = torch.ones(n, n, dtype=torch.bool).triu(diagonal)
            dots = dots.masked_fill(causal_mask, -torch.finfo(dots.dtype).max)
        attn = dots.softmax(dim=-1)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


def apply_rotary_pos_emb(t, freqs):
    """x-transformers' rotation of the first freqs.shape[-1] features (halves)."""
    rot_dim = freqs.shape[-1]
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    t = t * freqs.cos() + rotate_half(t) * freqs.sin()
    return torch.cat((t, t_pass), dim=-1)


class XAttend(nn.Module):
    """x-transformers' Attend: the core attention behind flags (causal, an explicit scale,
    inverted attention: the softmax over the queries, renormalised over the keys)."""

    def __init__(self, causal=False, scale=None, inverted_attention=False, scale_bug=False):
        super().__init__()
        self.scale, self.causal = scale, causal
        self.inverted_attention = inverted_attention
        self.attn_dim = -2 if inverted_attention else -1
        self.scale_bug = scale_bug

    def forward(self, q, k, v, mask=None):
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k)
        if not self.scale_bug:  # the bug: the scale removed
            sim = sim * scale
        mask_value = -torch.finfo(sim.dtype).max
        if mask is not None:
            sim = sim.masked_fill(~mask, mask_value)
        if self.causal:
            i, j = sim.shape[-2:]
            causal_mask = torch.ones((i, j), dtype=torch.bool, device=sim.device).triu(j - i + 1)
            sim = sim.masked_fill(causal_mask, mask_value)
        attn = sim.softmax(dim=self.attn_dim)
        if self.inverted_attention:
            if mask is not None:
                attn = attn.masked_fill(~mask, 0.0)
            attn = attn / attn.sum(dim=-1, keepdim=True).clamp(min=1e-5)
        return torch.einsum("b h i j, b h j d -> b h i d", attn, v)


class XTransformersAttention(nn.Module):
    """x-transformers' Attention around its Attend: to_q/to_k/to_v/to_out, optional context,
    mask and rotary frequencies (None here, as an audit calls it)."""

    def __init__(self, dim=D, dim_head=8, heads=4, causal=True, inverted_attention=False,
                 scale_bug=False):  # fmt: skip
        super().__init__()
        self.heads = heads
        inner = dim_head * heads
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.Linear(inner, dim, bias=False)
        self.attend = XAttend(causal, dim_head**-0.5, inverted_attention, scale_bug)

    def forward(self, x, context=None, mask=None, rotary_pos_emb=None):
        b, n, _ = x.shape
        kv_input = x if context is None else context
        q, k, v = self.to_q(x), self.to_k(kv_input), self.to_v(kv_input)
        q, k, v = (t.view(b, t.shape[1], self.heads, -1).transpose(1, 2) for t in (q, k, v))
        if rotary_pos_emb is not None:
            q = apply_rotary_pos_emb(q, rotary_pos_emb)
            k = apply_rotary_pos_emb(k, rotary_pos_emb)
        out = self.attend(q, k, v, mask=mask)  # (b, h, n, d)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


# name -> (constructor keywords, the bug's words in the report) for the planted bugs
CORRECT = {
    "MHAPyTorchClass": {},
    "MHAPyTorchClass-bias": {"qkv_bias": True},
    "LlamaStyleAttention": {},
    "NeoXStyleAttention": {},
    "GPTJStyleAttention": {},
    "MetaLlamaStyleAttention": {},
    "TimmStyleAttention": {},  # audited with causal=False (NON_CAUSAL)
    "XTransformersStyleAttention": {},
    "XTransformersAttention": {},
}
BUGS = {
    "LlamaStyleAttention": ({"scale_bug": True}, "scale is missing"),
    "NeoXStyleAttention": ({"mask_bug": True}, "inverted"),
    "GPTJStyleAttention": ({"scale_bug": True}, "scale is missing"),
    "MetaLlamaStyleAttention": ({"merge_bug": True}, "no transpose(1, 2)"),
    "TimmStyleAttention": ({"scale_bug": True}, "scale is missing"),
    "XTransformersStyleAttention": ({"mask_bug": True}, "one diagonal too high"),
    "XTransformersAttention": ({"scale_bug": True}, "scale is missing"),
}
NON_CAUSAL = {"TimmStyleAttention"}
