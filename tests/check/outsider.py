# ruff: noqa: N806 - the published names (B, T, C), as people write them
"""Attention modules as other people write them, written afresh for `attnlab.check` (none
is copied): a Llama-style module with rotary positions and grouped-query heads, a T5-style
relative position bias (decoder, causal, no score scale), an x-transformers-style module
(`heads`, to_q / to_kv / to_out, einops-like reshapes with torch ops), SDPA with dropout
only in training, a learned absolute position table inside, a causal buffer of block_size
(non-persistent), multi-query attention, qk-layernorm, F.multi_head_attention_forward with
its own weights, ALiBi, a GPT-NeoX-style fused query_key_value with per-head interleaving.
Then copies with one planted bug each, marked `# bug:`. CORRECT and BUGS at the end say
what the audit must conclude. Sizes are tiny: d 8, context 6.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

# --------------------------------------------------------------------------- correct modules


def _rope(x, base=10000.0):
    """Rotary positions on (b, h, t, hd), rotating the two halves (GPT-NeoX / Llama HF)."""
    t, hd = x.shape[-2], x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    angles = torch.outer(torch.arange(t, dtype=torch.float32), inv)  # (t, hd/2)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos.to(x.dtype) + rotated * sin.to(x.dtype)).to(x.dtype)


class LlamaAttention(nn.Module):
    """q_proj/k_proj/v_proj/o_proj, rotary positions, grouped-query heads, a float mask."""

    def __init__(
        self, hidden_size, num_attention_heads, num_key_value_heads, max_position_embeddings=6
    ):
        super().__init__()
        self.num_heads, self.num_kv = num_attention_heads, num_key_value_heads
        self.head_dim = hidden_size // num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.q_proj = nn.Linear(hidden_size, num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_attention_heads * self.head_dim, hidden_size, bias=False)

    def forward(self, hidden_states):
        bsz, q_len, _ = hidden_states.size()
        q = (
            self.q_proj(hidden_states)
            .view(bsz, q_len, self.num_heads, self.head_dim)
            .transpose(1, 2)
        )
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_kv, self.head_dim).transpose(1, 2)
        q, k = _rope(q), _rope(k)
        k = self.repeat_kv(k)
        v = self.repeat_kv(v)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        weights = F.softmax(
            scores + self.causal_mask(q_len, scores.dtype), dim=-1, dtype=torch.float32
        )
        out = torch.matmul(weights.to(q.dtype), v)  # (b, h, t, hd)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))

    def causal_mask(self, t, dtype):
        return torch.full((t, t), torch.finfo(dtype).min, dtype=dtype).triu(1)  # (t, t)

    def repeat_kv(self, x):
        b, kv, t, hd = x.shape
        rep = self.num_heads // self.num_kv
        return x[:, :, None].expand(b, kv, rep, t, hd).reshape(b, kv * rep, t, hd)


class T5Attention(nn.Module):
    """A T5 decoder's self-attention: q/k/v/o without bias, no 1/sqrt(d) scale (T5 folds it
    into the initialisation), a bucketed relative position bias, causal."""

    def __init__(self, d_model, n_heads, d_kv, num_buckets=8, max_distance=16, is_decoder=True):
        super().__init__()
        self.n_heads, self.d_kv, self.is_decoder = n_heads, d_kv, is_decoder
        self.num_buckets, self.max_distance = num_buckets, max_distance
        inner = n_heads * d_kv
        self.q = nn.Linear(d_model, inner, bias=False)
        self.k = nn.Linear(d_model, inner, bias=False)
        self.v = nn.Linear(d_model, inner, bias=False)
        self.o = nn.Linear(inner, d_model, bias=False)
        self.relative_attention_bias = nn.Embedding(num_buckets, n_heads)

    def bucket(self, relative):  # relative = key - query, <= 0 in a decoder
        n = -torch.clamp(relative, max=0)
        exact = self.num_buckets // 2
        large = (
            exact
            + (
                torch.log(n.float() / exact + 1e-6)
                / math.log(self.max_distance / exact)
                * (self.num_buckets - exact)
            ).long()
        )
        large = torch.clamp(large, max=self.num_buckets - 1)
        return torch.where(n < exact, n, large)

    def forward(self, hidden_states):
        b, t, _ = hidden_states.shape

        def shape(y):
            return y.view(b, -1, self.n_heads, self.d_kv).transpose(1, 2)

        q, k, v = (
            shape(self.q(hidden_states)),
            shape(self.k(hidden_states)),
            shape(self.v(hidden_states)),
        )
        scores = torch.matmul(q, k.transpose(3, 2))  # T5: no scale
        pos = torch.arange(t, device=hidden_states.device)
        bias = self.relative_attention_bias(self.bucket(pos[None, :] - pos[:, None]))  # (t, t, h)
        bias = bias.permute(2, 0, 1)[None]  # (1, h, t, t)
        if self.is_decoder:
            future = torch.ones(t, t, dtype=torch.bool, device=scores.device).triu(1)
            bias = bias.masked_fill(future, torch.finfo(scores.dtype).min)
        weights = F.softmax((scores + bias).float(), dim=-1).type_as(scores)
        out = (
            torch.matmul(weights, v)
            .transpose(1, 2)
            .contiguous()
            .view(b, -1, self.n_heads * self.d_kv)
        )
        return self.o(out)


def _split_heads(t, h):  # "b n (h d) -> b h n d"
    b, n, hd = t.shape
    return t.reshape(b, n, h, hd // h).permute(0, 2, 1, 3)


def _merge_heads(t):  # "b h n d -> b n (h d)"
    b, h, n, d = t.shape
    return t.permute(0, 2, 1, 3).reshape(b, n, h * d)


class XAttention(nn.Module):
    """x-transformers' shape: dim_head, heads, to_q and a fused to_kv, to_out, the mask
    value -finfo.max, an optional context for cross-attention."""

    def __init__(self, dim, heads=2, dim_head=4, causal=True, dropout=0.0):
        super().__init__()
        inner = heads * dim_head
        self.heads, self.causal, self.scale = heads, causal, dim_head**-0.5
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_kv = nn.Linear(dim, inner * 2, bias=False)
        self.to_out = nn.Linear(inner, dim, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, context=None):
        kv_input = x if context is None else context
        q = self.to_q(x)
        k, v = self.to_kv(kv_input).chunk(2, dim=-1)
        q, k, v = (_split_heads(t, self.heads) for t in (q, k, v))
        dots = torch.einsum("b h i d, b h j d -> b h i j", q, k) * self.scale
        if self.causal:
            i, j = dots.shape[-2:]
            mask = torch.ones(i, j, device=x.device, dtype=torch.bool).triu(j - i + 1)
            dots = dots.masked_fill(mask, -torch.finfo(dots.dtype).max)
        attn = self.dropout(dots.softmax(dim=-1))
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        return self.to_out(_merge_heads(out))


class SdpaTrainDropout(nn.Module):
    """Separate q/k/v projections, F.scaled_dot_product_attention with dropout in training
    only, and an output projection named `out`."""

    def __init__(self, embed_dim, num_heads, dropout=0.1, max_len=6):
        super().__init__()
        self.num_heads, self.dropout, self.max_len = num_heads, dropout, max_len
        self.query = nn.Linear(embed_dim, embed_dim)
        self.key = nn.Linear(embed_dim, embed_dim)
        self.value = nn.Linear(embed_dim, embed_dim)
        self.out = nn.Linear(embed_dim, embed_dim)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (
            layer(x).view(B, T, self.num_heads, -1).transpose(1, 2)
            for layer in (self.query, self.key, self.value)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        return self.out(y.transpose(1, 2).reshape(B, T, C))


class LearnedPositions(nn.Module):
    """A learned absolute position table added inside the attention, then a fused qkv."""

    def __init__(self, d_model, n_heads, block_size=6):
        super().__init__()
        self.n_heads, self.block_size = n_heads, block_size
        self.pos_emb = nn.Parameter(torch.randn(1, block_size, d_model) * 0.02)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, C = x.shape
        x = x + self.pos_emb[:, :T]
        q, k, v = self.qkv(x).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class CausalBuffer(nn.Module):
    """A boolean causal buffer of block_size, non-persistent, sliced per input."""

    def __init__(self, n_embd, n_head, block_size=6):
        super().__init__()
        self.n_head = n_head
        self.attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.proj = nn.Linear(n_embd, n_embd, bias=False)
        causal = torch.tril(torch.ones(block_size, block_size, dtype=torch.bool))
        self.register_buffer("causal_mask", causal, persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.attn(x).chunk(3, dim=-1)
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        att = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
        att = att.masked_fill(~self.causal_mask[:T, :T], float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(B, T, C))


class MultiQuery(nn.Module):
    """Multi-query attention: every query head shares one key/value head (kv_proj gives
    both), broadcasting instead of repeating."""

    def __init__(self, d_model, n_heads, max_len=6):
        super().__init__()
        self.n_heads, self.head_dim, self.max_len = n_heads, d_model // n_heads, max_len
        self.q_proj = nn.Linear(d_model, d_model)
        self.kv_proj = nn.Linear(d_model, 2 * self.head_dim)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        b, t, d = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv_proj(x).unsqueeze(1).split(self.head_dim, dim=-1)  # (b, 1, t, hd)
        scores = q @ k.transpose(-2, -1) * self.head_dim**-0.5
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        out = scores.softmax(-1) @ v  # (b, h, t, hd)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, d))


class QKNorm(nn.Module):
    """qk-layernorm (per head, over head_dim) before SDPA, as in ViT-22B / OLMo."""

    def __init__(self, dim, num_heads, max_len=6):
        super().__init__()
        self.num_heads, self.max_len = num_heads, max_len
        head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.q_norm, self.k_norm = nn.LayerNorm(head_dim), nn.LayerNorm(head_dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = (
            self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        )
        q, k, v = qkv.unbind(0)  # each (b, h, n, hd)
        q, k = self.q_norm(q), self.k_norm(k)
        x = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class FunctionalMHA(nn.Module):
    """Its own in_proj_weight / out_proj_weight parameters fed to
    F.multi_head_attention_forward (sequence first inside), a boolean causal attn_mask."""

    def __init__(self, embed_dim, num_heads, max_len=6):
        super().__init__()
        self.embed_dim, self.num_heads, self.max_len = embed_dim, num_heads, max_len
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * embed_dim))
        self.out_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim))
        self.out_proj_bias = nn.Parameter(torch.zeros(embed_dim))
        nn.init.xavier_uniform_(self.in_proj_weight)
        nn.init.xavier_uniform_(self.out_proj_weight)

    def forward(self, x):
        t = x.shape[1]
        x = x.transpose(0, 1)  # (t, b, d)
        blocked = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        out, _ = F.multi_head_attention_forward(
            x, x, x, self.embed_dim, self.num_heads,
            self.in_proj_weight, self.in_proj_bias, None, None, False, 0.0,
            self.out_proj_weight, self.out_proj_bias,
            training=self.training, need_weights=False, attn_mask=blocked,
        )  # fmt: skip
        return out.transpose(0, 1)


class Alibi(nn.Module):
    """ALiBi: no positions but a per-head linear penalty on distance, a slopes buffer."""

    def __init__(self, dim, heads, max_len=6):
        super().__init__()
        self.heads, self.max_len = heads, max_len
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        slopes = torch.tensor([2 ** (-8 * (h + 1) / heads) for h in range(heads)])
        self.register_buffer("slopes", slopes.view(1, heads, 1, 1))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in self.qkv(x).chunk(3, -1))
        pos = torch.arange(t, device=x.device)
        distance = (pos[None, :] - pos[:, None]).float()  # key - query, <= 0 in the past
        bias = self.slopes * distance  # (1, h, t, t)
        bias = bias.masked_fill(distance > 0, float("-inf"))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class NeoXAttention(nn.Module):
    """GPT-NeoX's fused query_key_value, interleaved per head ((h, 3, hd) rows), baddbmm
    scores in float32, a `dense` output."""

    def __init__(self, hidden_size, num_attention_heads, max_position_embeddings=6):
        super().__init__()
        self.h, self.hd = num_attention_heads, hidden_size // num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.query_key_value = nn.Linear(hidden_size, 3 * hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.norm_factor = math.sqrt(self.hd)

    def forward(self, hidden_states):
        b, t, _ = hidden_states.shape
        qkv = self.query_key_value(hidden_states).view(b, t, self.h, 3 * self.hd)
        q, k, v = qkv.permute(0, 2, 1, 3).split(self.hd, dim=-1)  # each (b, h, t, hd)
        scores = torch.baddbmm(
            torch.zeros(b * self.h, t, t, dtype=torch.float32),
            q.reshape(b * self.h, t, self.hd).float(),
            k.reshape(b * self.h, t, self.hd).float().transpose(1, 2),
            beta=0.0,
            alpha=1.0 / self.norm_factor,
        ).view(b, self.h, t, t)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        scores = torch.where(causal, scores, torch.finfo(scores.dtype).min)
        weights = scores.softmax(-1).to(v.dtype)
        out = (weights @ v).permute(0, 2, 1, 3).reshape(b, t, -1)
        return self.dense(out)


# --------------------------------------------------------------------------- one bug per copy


class LlamaMaskDtype(LlamaAttention):
    """Bug: the mask made in float32 whatever the scores' dtype (float64 overflows)."""

    def causal_mask(self, t, dtype):
        return torch.full((t, t), torch.finfo(dtype).min).triu(1)  # bug: no dtype=


class XAttentionInvertedMask(XAttention):
    """Bug: the mask keeps the future and hides the past (tril where triu belongs)."""

    def forward(self, x, context=None):
        q = self.to_q(x)
        k, v = self.to_kv(x).chunk(2, dim=-1)
        q, k, v = (_split_heads(t, self.heads) for t in (q, k, v))
        dots = torch.einsum("b h i d, b h j d -> b h i j", q, k) * self.scale
        i, j = dots.shape[-2:]
        mask = torch.ones(i, j, device=x.device, dtype=torch.bool).tril(-1)  # bug
        dots = dots.masked_fill(mask, -torch.finfo(dots.dtype).max)
        out = torch.einsum("b h i j, b h j d -> b h i d", dots.softmax(dim=-1), v)
        return self.to_out(_merge_heads(out))


class XAttentionHeadDimScale(XAttention):
    """Bug: scale = dim_head ** -1 instead of dim_head ** -0.5."""

    def __init__(self, dim, heads=2, dim_head=4):
        super().__init__(dim, heads, dim_head)
        self.scale = dim_head**-1  # bug


class XAttentionMergeWithoutPermute(XAttention):
    """Bug: the heads merged with reshape from (b, h, n, d), no permute back."""

    def forward(self, x, context=None):
        q = self.to_q(x)
        k, v = self.to_kv(x).chunk(2, dim=-1)
        q, k, v = (_split_heads(t, self.heads) for t in (q, k, v))
        dots = torch.einsum("b h i d, b h j d -> b h i j", q, k) * self.scale
        i, j = dots.shape[-2:]
        mask = torch.ones(i, j, device=x.device, dtype=torch.bool).triu(1)
        dots = dots.masked_fill(mask, -torch.finfo(dots.dtype).max)
        out = torch.einsum("b h i j, b h j d -> b h i d", dots.softmax(dim=-1), v)
        return self.to_out(out.reshape(x.shape[0], x.shape[1], -1))  # bug


class SdpaDropoutAlways(SdpaTrainDropout):
    """Bug: dropout_p given in eval mode too."""

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (
            layer(x).view(B, T, self.num_heads, -1).transpose(1, 2)
            for layer in (self.query, self.key, self.value)
        )
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout, is_causal=True)  # bug
        return self.out(y.transpose(1, 2).reshape(B, T, C))


class CausalBufferNotSliced(CausalBuffer):
    """Bug: the block_size mask used whole, whatever the input's length."""

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.attn(x).chunk(3, dim=-1)
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        att = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
        att = att.masked_fill(~self.causal_mask, float("-inf")).softmax(-1)  # bug
        return self.proj((att @ v).transpose(1, 2).reshape(B, T, C))


class MultiQuerySoftmaxOverQueries(MultiQuery):
    """Bug: softmax over dim=-2 (the queries)."""

    def forward(self, x):
        b, t, d = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv_proj(x).unsqueeze(1).split(self.head_dim, dim=-1)
        scores = q @ k.transpose(-2, -1) * self.head_dim**-0.5
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        out = scores.softmax(-2) @ v  # bug
        return self.out_proj(out.transpose(1, 2).reshape(b, t, d))


class FunctionalMHAFloatMask(FunctionalMHA):
    """Bug: a float 0/1 mask (triu of ones) added to the scores: the future is not hidden."""

    def forward(self, x):
        t = x.shape[1]
        x = x.transpose(0, 1)
        future = torch.triu(torch.ones(t, t, device=x.device), diagonal=1)  # bug: 1.0, not -inf
        out, _ = F.multi_head_attention_forward(
            x, x, x, self.embed_dim, self.num_heads,
            self.in_proj_weight, self.in_proj_bias, None, None, False, 0.0,
            self.out_proj_weight, self.out_proj_bias,
            training=self.training, need_weights=False, attn_mask=future,
        )  # fmt: skip
        return out.transpose(0, 1)


class T5EncoderAsDecoder(T5Attention):
    """Bug: a decoder built with is_decoder=False by default (bidirectional)."""

    def __init__(self, d_model, n_heads, d_kv):
        super().__init__(d_model, n_heads, d_kv, is_decoder=False)  # bug


class LlamaRenormalised(LlamaAttention):
    """Correct, though it looks wrong: the future zeroed after the softmax and each row
    renormalised (the same weights as masking before it)."""

    def forward(self, hidden_states):
        bsz, q_len, _ = hidden_states.size()
        q = (
            self.q_proj(hidden_states)
            .view(bsz, q_len, self.num_heads, self.head_dim)
            .transpose(1, 2)
        )
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_kv, self.head_dim).transpose(1, 2)
        q, k = _rope(q), _rope(k)
        k, v = self.repeat_kv(k), self.repeat_kv(v)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        weights = F.softmax(scores, dim=-1)
        weights = weights.masked_fill(torch.ones(q_len, q_len, dtype=torch.bool).triu(1), 0.0)
        weights = weights / weights.sum(-1, keepdim=True)  # renormalised: still right
        out = torch.matmul(weights, v)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class QKNormOverTokens(QKNorm):
    """Bug: the key norm over the token axis (normalised across positions: a leak)."""

    def forward(self, x):
        B, N, C = x.shape
        qkv = (
            self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        )
        q, k, v = qkv.unbind(0)
        q = self.q_norm(q)
        k = (k - k.mean(dim=2, keepdim=True)) / (k.std(dim=2, keepdim=True) + 1e-5)  # bug
        x = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


# --------------------------------------------------------------------------- what must be found

D, T = 8, 6
# name -> (constructor kwargs, causal)
CORRECT = {
    "LlamaAttention": (dict(hidden_size=D, num_attention_heads=4, num_key_value_heads=2), True),
    "T5Attention": (dict(d_model=D, n_heads=2, d_kv=4), True),
    "XAttention": (dict(dim=D, heads=2, dim_head=4, dropout=0.1), True),
    "SdpaTrainDropout": (dict(embed_dim=D, num_heads=2), True),
    "LearnedPositions": (dict(d_model=D, n_heads=2), True),
    "CausalBuffer": (dict(n_embd=D, n_head=2), True),
    "MultiQuery": (dict(d_model=D, n_heads=4), True),
    "QKNorm": (dict(dim=D, num_heads=2), True),
    "FunctionalMHA": (dict(embed_dim=D, num_heads=2), True),
    "Alibi": (dict(dim=D, heads=2), True),
    "NeoXAttention": (dict(hidden_size=D, num_attention_heads=2), True),
    "LlamaRenormalised": (dict(hidden_size=D, num_attention_heads=4, num_key_value_heads=2), True),
}

# name -> (constructor kwargs, properties that must fail, words the report must hold)
BUGS = {
    "LlamaMaskDtype": (
        dict(hidden_size=D, num_attention_heads=4, num_key_value_heads=2),
        {"follows_to"},
        "dtype=x.dtype",
    ),
    "XAttentionInvertedMask": (dict(dim=D), {"causal"}, "inverted"),
    "XAttentionHeadDimScale": (dict(dim=D), {"reference"}, "1/head_dim"),
    "XAttentionMergeWithoutPermute": (dict(dim=D), {"reference"}, "transpose"),
    "SdpaDropoutAlways": (dict(embed_dim=D, num_heads=2), {"dropout_modes"}, "eval mode"),
    "CausalBufferNotSliced": (dict(n_embd=D, n_head=2), {"runs"}, "sliced"),
    "MultiQuerySoftmaxOverQueries": (dict(d_model=D, n_heads=4), {"causal"}, "dim=-2"),
    "FunctionalMHAFloatMask": (dict(embed_dim=D, num_heads=2), {"causal"}, "float"),
    "T5EncoderAsDecoder": (dict(d_model=D, n_heads=2, d_kv=4), {"causal"}, "is_decoder=True"),
    "QKNormOverTokens": (dict(dim=D, num_heads=2), {"causal"}, "k.std"),
}
