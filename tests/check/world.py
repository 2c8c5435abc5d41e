# ruff: noqa: N806, RUF059 - the published names (B, T, C) and unpackings, as people write them
"""Attention modules in the shapes they take in published code, written afresh for
`attnlab.check` (none is copied): the chapter's classes as printed (no length check, the
first two unbatched), a head wrapper with an output projection, grouped-query (Llama-style
wq/wk/wv/wo), a sliding window, nanoGPT's fused c_attn/c_proj with SDPA, minGPT's
key/query/value/proj with a (1, 1, T, T) `bias` mask, an einsum variant, a latent-attention
(MLA-like) module, FlexAttention (no backward on the CPU), GPT-2's attention from
transformers. Then one planted bug per copy, marked `# bug:`. CORRECT and BUGS at the end
say what the audit must conclude. Sizes are tiny: d_in 8, context 6.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

# --------------------------------------------------------------------------- the chapter, printed


class PrintedSelfAttentionV1(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.W_query = nn.Parameter(torch.rand(d_in, d_out))
        self.W_key = nn.Parameter(torch.rand(d_in, d_out))
        self.W_value = nn.Parameter(torch.rand(d_in, d_out))

    def forward(self, x):
        keys = x @ self.W_key
        queries = x @ self.W_query
        values = x @ self.W_value
        attn_scores = queries @ keys.T
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        return attn_weights @ values


class PrintedSelfAttentionV2(nn.Module):
    def __init__(self, d_in, d_out, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x):
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)
        attn_scores = queries @ keys.T
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        return attn_weights @ values


class PrintedCausalAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        self.d_out = d_out
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )

    def forward(self, x):
        b, num_tokens, d_in = x.shape
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)
        attn_scores = queries @ keys.transpose(1, 2)
        attn_scores.masked_fill_(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        return attn_weights @ values


class PrintedWrapper(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.heads = nn.ModuleList(
            [
                PrintedCausalAttention(d_in, d_out, context_length, dropout, qkv_bias)
                for _ in range(num_heads)
            ]
        )

    def forward(self, x):
        return torch.cat([head(x) for head in self.heads], dim=-1)


class PrintedMultiHeadAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )

    def forward(self, x):
        b, num_tokens, d_in = x.shape
        keys = self.W_key(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        queries = self.W_query(x).view(b, num_tokens, self.num_heads, self.head_dim)
        queries = queries.transpose(1, 2)
        values = self.W_value(x).view(b, num_tokens, self.num_heads, self.head_dim)
        values = values.transpose(1, 2)
        attn_scores = queries @ keys.transpose(2, 3)
        attn_scores.masked_fill_(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        context_vec = (attn_weights @ values).transpose(1, 2)
        context_vec = context_vec.contiguous().view(b, num_tokens, self.d_out)
        return self.out_proj(context_vec)


class WrapperWithProjection(PrintedWrapper):
    """Head modules, concatenated, then an output projection (a common exercise answer)."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads):
        super().__init__(d_in, d_out, context_length, dropout, num_heads)
        self.out_proj = nn.Linear(d_out * num_heads, d_out * num_heads)

    def forward(self, x):
        return self.out_proj(torch.cat([head(x) for head in self.heads], dim=-1))


# --------------------------------------------------------------------------- published shapes


class GroupedQuery(nn.Module):
    """Llama-style names (wq, wk, wv, wo), fewer key/value heads, repeat_interleave, SDPA."""

    def __init__(self, dim, n_heads, n_kv_heads, max_seq_len=6):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = dim // n_heads
        self.max_seq_len = max_seq_len
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x):
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        rep = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class SlidingWindow(nn.Module):
    """to_q/to_k/to_v/to_out names; each query sees itself and the window - 1 keys before."""

    def __init__(self, dim, heads, window, max_len=6):
        super().__init__()
        self.heads, self.window, self.max_len = heads, window, max_len
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(dim, dim, bias=False)
        self.to_v = nn.Linear(dim, dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (
            f(x).view(b, n, self.heads, -1).transpose(1, 2)
            for f in (self.to_q, self.to_k, self.to_v)
        )
        i = torch.arange(n, device=x.device)
        allowed = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - self.window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.to_out(out.transpose(1, 2).reshape(b, n, d))


class NanoGPTStyle(nn.Module):
    """Fused c_attn, c_proj, n_head/n_embd/block_size, SDPA with is_causal."""

    def __init__(self, n_embd, n_head, block_size, dropout=0.0, bias=True):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head, self.n_embd, self.dropout = n_head, n_embd, dropout
        self.block_size = block_size

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MinGPTStyle(nn.Module):
    """Separate key/query/value, proj, a (1, 1, T, T) `bias` mask, attn_drop/resid_drop."""

    def __init__(self, n_embd, n_head, block_size, attn_pdrop=0.0):
        super().__init__()
        self.key = nn.Linear(n_embd, n_embd)
        self.query = nn.Linear(n_embd, n_embd)
        self.value = nn.Linear(n_embd, n_embd)
        self.attn_drop = nn.Dropout(attn_pdrop)
        self.resid_drop = nn.Dropout(attn_pdrop)
        self.proj = nn.Linear(n_embd, n_embd)
        tril = torch.tril(torch.ones(block_size, block_size))
        self.register_buffer("bias", tril.view(1, 1, block_size, block_size))
        self.n_head = n_head

    def forward(self, x):
        B, T, C = x.size()
        k = self.key(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = self.query(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = self.value(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class EinsumAttention(nn.Module):
    """A fused to_qkv, einsum scores and mixing, a boolean causal mask, to_out."""

    def __init__(self, dim, heads, context_length=6):
        super().__init__()
        self.heads, self.context_length = heads, context_length
        self.scale = (dim // heads) ** -0.5
        self.to_qkv = nn.Linear(dim, dim * 3, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        qkv = self.to_qkv(x).view(b, n, 3, self.heads, d // self.heads)
        q, k, v = qkv.unbind(dim=2)  # each (b, n, h, hd)
        sim = torch.einsum("bihd,bjhd->bhij", q, k) * self.scale
        future = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        attn = sim.masked_fill(future, -torch.finfo(sim.dtype).max).softmax(dim=-1)
        out = torch.einsum("bhij,bjhd->bihd", attn, v)
        return self.to_out(out.reshape(b, n, d))


class LatentAttention(nn.Module):
    """MLA-like: keys and values expanded from one low-rank latent (kv_down, k_up, v_up)."""

    def __init__(self, dim, n_heads, kv_rank, max_seq_len=6):
        super().__init__()
        self.n_heads, self.max_seq_len = n_heads, max_seq_len
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.kv_down = nn.Linear(dim, kv_rank, bias=False)
        self.k_up = nn.Linear(kv_rank, dim, bias=False)
        self.v_up = nn.Linear(kv_rank, dim, bias=False)
        self.out_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        latent = self.kv_down(x)  # (b, t, kv_rank): what a cache would keep
        q, k, v = (
            y.view(b, t, self.n_heads, -1).transpose(1, 2)
            for y in (self.q_proj(x), self.k_up(latent), self.v_up(latent))
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, d))


class _NoCpuBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("this kernel has no backward on the CPU")


class NoCpuBackward(nn.Module):
    """FlexAttention when it imports (its CPU forward refuses inputs that need a gradient),
    else a custom kernel whose backward raises NotImplementedError."""

    def __init__(self, dim, heads, context_length=6):
        super().__init__()
        self.heads, self.context_length = heads, context_length
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (
            y.view(b, t, self.heads, -1).transpose(1, 2) for y in self.qkv(x).chunk(3, dim=-1)
        )
        try:
            from torch.nn.attention.flex_attention import flex_attention
        except ImportError:
            out = _NoCpuBackward.apply(q, k, v)
        else:

            def causal(score, b, h, q_idx, kv_idx):
                return torch.where(q_idx >= kv_idx, score, -float("inf"))

            out = flex_attention(q, k, v, score_mod=causal)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class GPT2AttentionBlock(nn.Module):
    """transformers' GPT2Attention on a tiny config, called as GPT-2's blocks call it."""

    def __init__(self, n_embd=8, n_head=2, n_positions=6):
        super().__init__()
        from transformers import GPT2Config
        from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

        config = GPT2Config(n_embd=n_embd, n_head=n_head, n_positions=n_positions)
        config._attn_implementation = "sdpa"  # is_causal, as inside GPT2Model
        self.attn = GPT2Attention(config, layer_idx=0)
        self.n_positions = n_positions

    def forward(self, x):
        return self.attn(x)[0]


# --------------------------------------------------------------------------- one bug per copy


class NanoGPTNoScale(NanoGPTStyle):
    """Bug: the explicit path without the 1/sqrt(head_dim) scale."""

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = (
            y.view(B, T, self.n_head, -1).transpose(1, 2) for y in self.c_attn(x).split(C, 2)
        )
        att = q @ k.transpose(-2, -1)  # bug: no scale
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class NanoGPTDModelScale(NanoGPTStyle):
    """Bug: the scores divided by d_model (n_embd), not sqrt(head_dim)."""

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = (
            y.view(B, T, self.n_head, -1).transpose(1, 2) for y in self.c_attn(x).split(C, 2)
        )
        att = (q @ k.transpose(-2, -1)) / self.n_embd  # bug: 1/d_model
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class NanoGPTMergeWithoutTranspose(NanoGPTStyle):
    """Bug: the heads merged with view straight after SDPA, without transposing back."""

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = (
            y.view(B, T, self.n_head, -1).transpose(1, 2) for y in self.c_attn(x).split(C, 2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.contiguous().view(B, T, C)  # bug: no transpose(1, 2) first
        return self.c_proj(y)


class NanoGPTNoIsCausal(NanoGPTStyle):
    """Bug: SDPA called without is_causal=True."""

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = (
            y.view(B, T, self.n_head, -1).transpose(1, 2) for y in self.c_attn(x).split(C, 2)
        )
        y = F.scaled_dot_product_attention(q, k, v)  # bug: no is_causal
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class SwappedKeysValues(GroupedQuery):
    """Bug: keys from wv and values from wk."""

    def forward(self, x):
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)  # bug
        v = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)  # bug
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class MissingOutputProjection(SlidingWindow):
    """Bug: to_out is defined but never applied (full causal attention otherwise)."""

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (
            f(x).view(b, n, self.heads, -1).transpose(1, 2)
            for f in (self.to_q, self.to_k, self.to_v)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(b, n, d)  # bug: self.to_out not applied


class MaskOneDiagonalHigh(PrintedCausalAttention):
    """Bug: triu(..., diagonal=2): each query also sees the next token."""

    def __init__(self, d_in, d_out, context_length, dropout):
        super().__init__(d_in, d_out, context_length, dropout)
        self.register_buffer(
            "mask",
            torch.triu(torch.ones(context_length, context_length), diagonal=2),  # bug
        )


class DropoutBeforeSoftmax(PrintedCausalAttention):
    """Bug: dropout on the masked scores (a dropped -inf is NaN in train mode)."""

    def forward(self, x):
        b, num_tokens, d_in = x.shape
        keys, queries, values = self.W_key(x), self.W_query(x), self.W_value(x)
        attn_scores = queries @ keys.transpose(1, 2)
        attn_scores.masked_fill_(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)
        attn_scores = self.dropout(attn_scores)  # bug: dropout before the softmax
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        return attn_weights @ values


# --------------------------------------------------------------------------- what must be found

D, T = 8, 6
# name -> (constructor kwargs, causal, the statuses some properties must have)
CORRECT = {
    "PrintedSelfAttentionV1": (dict(d_in=D, d_out=4), False, {"runs": "warning"}),
    "PrintedSelfAttentionV2": (dict(d_in=D, d_out=4), False, {"runs": "warning"}),
    "PrintedCausalAttention": (
        dict(d_in=D, d_out=4, context_length=T, dropout=0.1),
        True,
        {"long_input": "warning", "reference": "passed"},
    ),
    "PrintedWrapper": (
        dict(d_in=D, d_out=2, context_length=T, dropout=0.0, num_heads=2),
        True,
        {"long_input": "warning", "reference": "passed"},
    ),
    "PrintedMultiHeadAttention": (
        dict(d_in=D, d_out=D, context_length=T, dropout=0.1, num_heads=2),
        True,
        {"long_input": "warning", "reference": "passed"},
    ),
    "WrapperWithProjection": (
        dict(d_in=D, d_out=2, context_length=T, dropout=0.0, num_heads=2),
        True,
        {"reference": "passed"},
    ),
    "GroupedQuery1": (dict(dim=D, n_heads=4, n_kv_heads=1), True, {"reference": "passed"}),
    "GroupedQuery2": (dict(dim=D, n_heads=4, n_kv_heads=2), True, {"reference": "passed"}),
    "SlidingWindow": (dict(dim=D, heads=2, window=3), True, {"reference": "passed"}),
    "NanoGPTStyle": (dict(n_embd=D, n_head=2, block_size=T, dropout=0.1), True, {}),
    "MinGPTStyle": (dict(n_embd=D, n_head=2, block_size=T, attn_pdrop=0.1), True, {}),
    "EinsumAttention": (dict(dim=D, heads=2), True, {"reference": "passed"}),
    "LatentAttention": (dict(dim=D, n_heads=2, kv_rank=4), True, {"reference": "passed"}),
    "NoCpuBackward": (dict(dim=D, heads=2), True, {"finite_gradients": "warning"}),
    "GPT2AttentionBlock": (dict(), True, {"reference": "passed"}),
}
GroupedQuery1 = GroupedQuery2 = GroupedQuery  # the two head counts share the class

# name -> (constructor kwargs, properties that must fail, words the causes must hold)
BUGS = {
    "NanoGPTNoScale": (dict(n_embd=D, n_head=2, block_size=T), {"reference"}, "scale is missing"),
    "NanoGPTDModelScale": (dict(n_embd=D, n_head=2, block_size=T), {"reference"}, "1/d_out"),
    "NanoGPTMergeWithoutTranspose": (
        dict(n_embd=D, n_head=2, block_size=T),
        {"reference"},
        "without transpose(1, 2) back",
    ),
    "NanoGPTNoIsCausal": (dict(n_embd=D, n_head=2, block_size=T), {"causal"}, "is_causal"),
    "SwappedKeysValues": (
        dict(dim=D, n_heads=2, n_kv_heads=2),
        {"reference"},
        "keys and values are swapped",
    ),
    "MissingOutputProjection": (
        dict(dim=D, heads=2, window=T),
        {"reference"},
        "output projection `to_out` is missing",
    ),
    "MaskOneDiagonalHigh": (
        dict(d_in=D, d_out=4, context_length=T, dropout=0.0),
        {"causal"},
        "diagonal=2",
    ),
    "DropoutBeforeSoftmax": (
        dict(d_in=D, d_out=4, context_length=T, dropout=0.1),
        {"dropout_modes"},
        "dropout is applied to the scores before the softmax",
    ),
}
