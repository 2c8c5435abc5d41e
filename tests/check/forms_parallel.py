"""Meta's Llama reference form on fairscale's model-parallel layers, rewritten here (never
copied): the head count divided by the model-parallel world size (which asserts that a group
exists), Column/RowParallelLinear projections built with `init_method=lambda x: x` over
uninitialised memory (the weights come from a checkpoint), caches made with .cuda().
Imports fairscale: audited by tests/check/test_forms.py where fairscale is installed."""

from __future__ import annotations

import math
from dataclasses import dataclass

import fairscale.nn.model_parallel.initialize as fs_init
import torch
from fairscale.nn.model_parallel.layers import ColumnParallelLinear, RowParallelLinear
from torch import nn
from torch.nn import functional as F


@dataclass
class ModelArgs:
    dim: int = 32
    n_heads: int = 4
    max_batch_size: int = 4
    max_seq_len: int = 16
    is_gpu: bool = True
    scale_bug: bool = False


def _column(args: ModelArgs, width: int) -> nn.Module:
    return ColumnParallelLinear(
        args.dim, width, bias=False, gather_output=False, init_method=lambda w: w
    )


def rotate(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # (b, t, h, hd/2)
    turned = pairs * freqs_cis.view(1, pairs.shape[1], 1, pairs.shape[-1])
    return torch.view_as_real(turned).flatten(3).type_as(x)  # (b, t, h, hd)


class ParallelAttention(nn.Module):
    """forward(x, start_pos, freqs_cis, mask) on model-parallel projections."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_local_heads = args.n_heads // fs_init.get_model_parallel_world_size()
        self.head_dim = args.dim // args.n_heads
        self.wq = _column(args, args.n_heads * self.head_dim)
        self.wk = _column(args, args.n_heads * self.head_dim)
        self.wv = _column(args, args.n_heads * self.head_dim)
        self.wo = RowParallelLinear(
            args.n_heads * self.head_dim,
            args.dim,
            bias=False,
            input_is_parallel=True,
            init_method=lambda w: w,
        )
        shape = (args.max_batch_size, args.max_seq_len, self.n_local_heads, self.head_dim)
        self.cache_k, self.cache_v = torch.zeros(shape), torch.zeros(shape)
        if args.is_gpu:
            self.cache_k, self.cache_v = self.cache_k.cuda(), self.cache_v.cuda()
        self.scale_bug = args.scale_bug

    def forward(self, x, start_pos, freqs_cis, mask):
        bsz, seqlen, _ = x.shape
        shape = (bsz, seqlen, self.n_local_heads, self.head_dim)
        xq, xk, xv = self.wq(x).view(shape), self.wk(x).view(shape), self.wv(x).view(shape)
        xq, xk = rotate(xq, freqs_cis), rotate(xk, freqs_cis)
        self.cache_k, self.cache_v = self.cache_k.to(xq), self.cache_v.to(xq)
        self.cache_k[:bsz, start_pos : start_pos + seqlen] = xk
        self.cache_v[:bsz, start_pos : start_pos + seqlen] = xv
        keys = self.cache_k[:bsz, : start_pos + seqlen].transpose(1, 2)  # (b, h, s, hd)
        values = self.cache_v[:bsz, : start_pos + seqlen].transpose(1, 2)
        scores = torch.matmul(xq.transpose(1, 2), keys.transpose(2, 3))
        if not self.scale_bug:
            scores = scores / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask
        weights = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = torch.matmul(weights, values).transpose(1, 2)  # (b, t, h, hd)
        return self.wo(output.contiguous().view(bsz, seqlen, -1))
