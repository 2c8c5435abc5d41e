"""Attention layers in the forms their families publish them, rewritten here (never copied):
constructors that take a configuration object, forwards that take positions, rotary tables
and masks the model builds, a cache allocated with .cuda() in the constructor. Audited with
no adapter through `attnlab check FILE:Class --init JSON` (tests/check/test_forms.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class ModelArgs:
    """Meta's Llama style: a dataclass of the model's sizes."""

    dim: int = 32
    n_heads: int = 4
    n_kv_heads: int | None = 2
    max_batch_size: int = 4
    max_seq_len: int = 16
    scale_bug: bool = False
    offset_bug: bool = False


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class MetaAttention(nn.Module):
    """forward(x, start_pos, freqs_cis, mask); key/value caches made with .cuda()."""

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
        shape = (args.max_batch_size, args.max_seq_len, self.n_local_kv_heads, self.head_dim)
        self.cache_k = torch.zeros(shape).cuda()
        self.cache_v = torch.zeros(shape).cuda()
        self.scale_bug, self.offset_bug = args.scale_bug, args.offset_bug

    def forward(self, x, start_pos, freqs_cis, mask):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        self.cache_k = self.cache_k.to(xq)
        self.cache_v = self.cache_v.to(xq)
        write = 0 if self.offset_bug else start_pos  # the bug: the cache written from 0
        self.cache_k[:bsz, write : write + seqlen] = xk
        self.cache_v[:bsz, write : write + seqlen] = xv
        keys = self.cache_k[:bsz, : start_pos + seqlen].repeat_interleave(self.n_rep, dim=2)
        values = self.cache_v[:bsz, : start_pos + seqlen].repeat_interleave(self.n_rep, dim=2)
        xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3))
        if not self.scale_bug:
            scores = scores / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, values).transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class MetaSoftmaxOverQueries(MetaAttention):
    """Meta's form with a softmax-dim bug written as a port writes it: over the queries,
    and the weights left in float32 (no .type_as(xq)). Its caches are moved by the forward
    (self.cache_k.to(xq)), so they follow .to(): not to be blamed."""

    def forward(self, x, start_pos, freqs_cis, mask):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        self.cache_k = self.cache_k.to(xq)
        self.cache_v = self.cache_v.to(xq)
        self.cache_k[:bsz, start_pos : start_pos + seqlen] = xk
        self.cache_v[:bsz, start_pos : start_pos + seqlen] = xv
        keys = self.cache_k[:bsz, : start_pos + seqlen].repeat_interleave(self.n_rep, dim=2)
        values = self.cache_v[:bsz, : start_pos + seqlen].repeat_interleave(self.n_rep, dim=2)
        xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask
        scores = F.softmax(scores.float(), dim=-2)  # bug: dim=-2, and float32 kept
        output = torch.matmul(scores, values).transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


@dataclass
class FastArgs:
    """gpt-fast style."""

    dim: int = 32
    n_head: int = 4
    n_local_heads: int = 4
    head_dim: int = 8
    block_size: int = 16
    merge_bug: bool = False
    tile_bug: bool = False


def apply_rotary_emb_real(x, freqs_cis):
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
    freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
            xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
        ],
        -1,
    )
    return x_out2.flatten(3).type_as(x)


class FastAttention(nn.Module):
    """forward(x, freqs_cis, mask, input_pos=None): real rotary tables, SDPA with the mask."""

    def __init__(self, config: FastArgs):
        super().__init__()
        total_head_dim = (config.n_head + 2 * config.n_local_heads) * config.head_dim
        self.wqkv = nn.Linear(config.dim, total_head_dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)
        self.kv_cache = None
        self.n_head, self.head_dim = config.n_head, config.head_dim
        self.n_local_heads, self.dim = config.n_local_heads, config.dim
        self.merge_bug, self.tile_bug = config.merge_bug, config.tile_bug

    def forward(self, x, freqs_cis, mask, input_pos=None):
        bsz, seqlen, _ = x.shape
        kv_size = self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([self.dim, kv_size, kv_size], dim=-1)
        q = q.view(bsz, seqlen, self.n_head, self.head_dim)
        k = k.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        q = apply_rotary_emb_real(q, freqs_cis)
        k = apply_rotary_emb_real(k, freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        group = self.n_head // self.n_local_heads
        if self.tile_bug:  # the bug: query head h reads key/value head h % n_local_heads
            k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
        else:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        if not self.merge_bug:
            y = y.transpose(1, 2)
        y = y.contiguous().view(bsz, seqlen, self.dim)
        return self.wo(y)


class FastMergedWithoutTranspose(FastAttention):
    """gpt-fast's form with the bug written out: the heads merged straight from (b, heads,
    tokens, head_dim), a line the source reading points at."""

    def forward(self, x, freqs_cis, mask, input_pos=None):
        bsz, seqlen, _ = x.shape
        kv_size = self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([self.dim, kv_size, kv_size], dim=-1)
        q = apply_rotary_emb_real(q.view(bsz, seqlen, self.n_head, self.head_dim), freqs_cis)
        k = apply_rotary_emb_real(k.view(bsz, seqlen, self.n_head, self.head_dim), freqs_cis)
        v = v.view(bsz, seqlen, self.n_head, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        y = y.contiguous().view(bsz, seqlen, self.dim)
        return self.wo(y)


class MinGPTSelfAttention(nn.Module):
    """minGPT style: a config read by attribute (n_embd, n_head, block_size, attn_pdrop,
    resid_pdrop), no annotation."""

    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.attn_dropout = nn.Dropout(config.attn_pdrop)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)
        size = config.block_size
        self.register_buffer("bias", torch.tril(torch.ones(size, size)).view(1, 1, size, size))
        self.n_head, self.n_embd = config.n_head, config.n_embd

    def forward(self, x):
        B, T, C = x.size()  # noqa: N806 (minGPT's names)
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))
