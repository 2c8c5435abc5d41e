"""Ring (context-parallel) attention over torch.distributed: each rank holds part of the
sequence (a layout from attnlab.parallel.layout); keys and values travel around the ring
with point-to-point ops, the next transfer overlapping the current block's compute; partial
results merge by log-sum-exp. Works on gloo (CPU) and nccl (CUDA) process groups.

Shapes: q (b, hq, n, d), k and v (b, hkv, n, d) per rank, n = tokens / world; hkv divides
hq (grouped-query heads, each key/value head serving hq / hkv query heads).

Memory: the ring runs once per key/value head (with its query heads), so what travels and
what is held beside the inputs is one head's keys and values, twice (the block being
computed and the one in flight): 2/hkv of the local keys and values, not twice all of them.

Backward (a custom autograd function): keys and values go round again, one transfer ahead of
the compute as in the forward, and gradient accumulators (float32 at least) follow them on a ring of
their own; each rank adds its part for the block it holds, so after a full turn every
accumulator is back at its owner.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from attnlab import heads, masks
from attnlab.parallel.checks import check_arguments
from attnlab.parallel.layout import Layout, block_for

Backend = Literal["auto", "attnlab", "torch"]


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    layout: Layout = "contiguous",
    group: dist.ProcessGroup | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """This rank's part of softmax(q k^T / sqrt(d)) v over the whole sequence.

    Every rank passes its part of the sequence in `layout` (see attnlab.parallel.layout;
    `shard_sequence` cuts a whole tensor that way). Keys and values travel around the ring
    with point-to-point ops, the next transfer overlapping the current block's compute, and
    partial results merge by log-sum-exp. Arguments are checked on every rank with one
    collective first (shapes and settings must agree across ranks), so bad input is an
    error on every rank, never a hang. Differentiable once (a second derivative is refused).

    Args:
        q: (b, hq, n, d) this rank's queries, floating point (float32, float64, float16 or
            bfloat16).
        k: (b, hkv, n, d) this rank's keys, hkv dividing hq (grouped-query), q's dtype and
            device.
        v: (b, hkv, n, d) this rank's values.
        causal: mask each query's future in the whole sequence.
        layout: "contiguous" (rank r holds tokens [r n, (r + 1) n)) or "zigzag" (pieces r
            and 2W - 1 - r of 2W, which balances causal work; n must be even).
        group: the process group (default the world).
        backend: "attnlab" is the ring of this module (any device, the four floating dtypes,
            grouped-query heads, memory of one key/value head in flight); "torch" is the ring
            engine behind PyTorch's context_parallel (flash kernels, equal query and
            key/value heads); "auto" takes "torch" on CUDA where its flash kernel applies,
            "attnlab" everywhere else.

    Returns:
        (b, hq, n, d) this rank's part of the output, in q's dtype.

    Raises:
        TypeError: an argument of the wrong type or dtype, on the rank that passed it.
        ValueError: shapes, settings or a layout that do not fit, on any rank (the others
            raise a ValueError naming it), or backend "torch" for inputs its engine cannot
            take.
    """
    check_arguments(q, k, v, causal=causal, layout=layout, backend=backend, group=group)
    if backend == "torch" or (backend == "auto" and q.device.type == "cuda"):
        from attnlab.parallel.torch_ring import torch_engine_refusal, torch_ring_attention

        refusal = torch_engine_refusal(q, k)
        if refusal is None:
            return torch_ring_attention(q, k, v, causal=causal, layout=layout, group=group)
        if backend == "torch":
            raise ValueError(f"backend 'torch': {refusal}; backend 'attnlab' takes these")
    # PyTorch's CPU flash kernel reads a stepped head_dim (stride != 1) wrongly, silently:
    # it gets dense tensors (a no-op for the usual contiguous chunks)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _RingAttention.apply(q, k, v, causal, layout, group)


def _head_groups(q_heads: int, kv_heads: int):
    """(query heads, key/value head) slices: each key/value head with the queries it serves."""
    share = q_heads // kv_heads
    for head in range(kv_heads):
        yield slice(head * share, (head + 1) * share), slice(head, head + 1)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, layout, group):
        plan = _Plan(group, q, causal, layout)
        out = torch.empty(q.shape, dtype=plan.acc, device=q.device)
        lse = torch.empty(q.shape[:3], dtype=plan.acc, device=q.device)  # (b, hq, n)
        for q_heads, kv_heads in _head_groups(q.shape[1], k.shape[1]):
            kv = (k[:, kv_heads], v[:, kv_heads])
            _ring_forward(plan, q[:, q_heads], *kv, out[:, q_heads], lse[:, q_heads])
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        return out.to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        acc = ctx.plan.acc
        grad_q = torch.zeros_like(q, dtype=acc)
        grad_k, grad_v = torch.empty_like(k, dtype=acc), torch.empty_like(v, dtype=acc)
        for q_heads, kv_heads in _head_groups(q.shape[1], k.shape[1]):
            grad_k[:, kv_heads], grad_v[:, kv_heads] = _ring_backward(
                ctx.plan,
                grad_out[:, q_heads],
                q[:, q_heads],
                k[:, kv_heads],
                v[:, kv_heads],
                out[:, q_heads],
                lse[:, q_heads],
                grad_q[:, q_heads],
            )
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None


class _Plan:
    """The ring's fixed facts for one call: who this rank is, what it computes, and the
    dtype partial results accumulate in (float32 at least, float64 for float64 inputs)."""

    def __init__(self, group, q: torch.Tensor, causal: bool, layout: Layout) -> None:
        self.group, self.scale = group, 1.0 / math.sqrt(q.shape[-1])
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.tokens, self.causal, self.layout = q.shape[2], causal, layout
        self.acc = torch.promote_types(q.dtype, torch.float32)

    def block(self, step: int):
        """The block computed at `step`, against the chunk of rank (rank - step), or None."""
        source = (self.rank - step) % self.world
        return block_for(self.rank, source, self.tokens, causal=self.causal, layout=self.layout)


def _ring_forward(plan: _Plan, q, k, v, out, lse) -> None:
    """One key/value head's ring: fills `out` (b, g, n, d) and `lse` (b, g, n) in place."""
    ring = _Ring(plan.group, (k, v), tag=0)
    for step in range(plan.world):
        k_block, v_block = ring.current()
        if step < plan.world - 1:
            ring.start_next()  # the next block travels while this one is computed
        block = plan.block(step)
        if block is not None:
            rows, cols = block.rows, block.cols
            part = _block(q[:, :, rows], k_block[:, :, cols], v_block[:, :, cols], block, plan)
            if step == 0:  # the rank's own block: every row, never skipped
                out.copy_(part[0])
                lse.copy_(part[1])
            else:
                _merge(out[:, :, rows], lse[:, :, rows], *part)
        if step < plan.world - 1:
            ring.finish()


def _ring_backward(plan: _Plan, grad_out, q, k, v, out, lse, grad_q):
    """One key/value head's backward ring: adds into `grad_q` in place and returns this
    rank's (grad_k, grad_v) for the head, in the accumulation dtype."""
    kv_ring = _Ring(plan.group, (k, v), tag=0)
    accumulators = [torch.zeros_like(t, dtype=plan.acc) for t in (k, v)]
    grad_ring = _Ring(plan.group, accumulators, tag=1)
    for step in range(plan.world):
        k_block, v_block = kv_ring.current()
        if step < plan.world - 1:
            kv_ring.start_next()
        block = plan.block(step)
        parts = None
        if block is not None:
            rows, cols = block.rows, block.cols
            parts = _block_backward(
                grad_out[:, :, rows],
                q[:, :, rows],
                k_block[:, :, cols],
                v_block[:, :, cols],
                out[:, :, rows],
                lse[:, :, rows],
                block,
                plan,
            )
        if step > 0:
            grad_ring.finish()  # this block's accumulators, from the previous rank
        if parts is not None:
            dk, dv = grad_ring.current()
            grad_q[:, :, rows] += parts[0]
            dk[:, :, cols] += parts[1]
            dv[:, :, cols] += parts[2]
        grad_ring.start_next()  # on to the next rank; the last turn brings ours home
        if step < plan.world - 1:
            kv_ring.finish()
    grad_ring.finish()
    return grad_ring.current()


class _Ring:
    """Tensors passed to the next rank and received from the previous one, asynchronously.
    `tag` keeps two rings on one group apart (gloo matches messages by tag)."""

    def __init__(self, group, tensors, *, tag: int) -> None:
        self.group, self.tag = group, tag
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.tensors = tuple(t.contiguous() for t in tensors)
        self.incoming = None
        self.requests = []

    def current(self):
        return self.tensors

    def _global(self, rank: int) -> int:
        rank %= self.world
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def start_next(self) -> None:
        if self.world == 1:
            return
        to_rank, from_rank = self._global(self.rank + 1), self._global(self.rank - 1)
        self.incoming = tuple(torch.empty_like(t) for t in self.tensors)
        send, recv = dist.isend, dist.irecv
        operations = [dist.P2POp(send, t, to_rank, self.group, self.tag) for t in self.tensors]
        operations += [dist.P2POp(recv, t, from_rank, self.group, self.tag) for t in self.incoming]
        self.requests = dist.batch_isend_irecv(operations)

    def finish(self) -> None:
        if self.world == 1:
            return
        for request in self.requests:
            request.wait()
        self.tensors, self.incoming, self.requests = self.incoming, None, []


_CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _fused(q: torch.Tensor) -> bool:
    """PyTorch's CPU flash kernel, which returns the logsumexp, serves this block: no
    (n x n) scores are held (elsewhere, the explicit product below)."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)


def _block(q, k, v, block, plan: _Plan):
    """(out (b, g, rows, d), logsumexp (b, g, rows)) of q against one block, in the
    accumulation dtype. A causal block is square (the rank's own), so the top-left mask is
    the diagonal one."""
    k, v = _expand_heads(q, k), _expand_heads(q, v)
    if _fused(q):
        out, lse = _CPU_FLASH(q, k, v, 0.0, block.causal, scale=plan.scale)
        return out.to(plan.acc), lse.to(plan.acc)
    scores = _scores(q, k, block.causal, plan)
    lse = torch.logsumexp(scores, dim=-1)  # (b, g, rows)
    out = torch.exp(scores - lse.unsqueeze(-1)) @ v.to(plan.acc)
    return out, lse


def _block_backward(grad_out, q, k, v, out, lse, block, plan: _Plan):
    """Gradients of one block's part, from the merged output and logsumexp: exact for it."""
    groups = q.shape[1] // k.shape[1]
    k_full, v_full = _expand_heads(q, k), _expand_heads(q, v)
    if _fused(q):
        dq, dk, dv = _CPU_FLASH_BACKWARD(
            grad_out.contiguous(),
            q,
            k_full,
            v_full,
            out.to(q.dtype),
            lse.to(q.dtype).contiguous(),
            0.0,
            block.causal,
            scale=plan.scale,
        )
        dk, dv = (heads.sum_groups(t.to(plan.acc), groups) for t in (dk, dv))
        return dq.to(plan.acc), dk, dv
    k_full, v_full = k_full.to(plan.acc), v_full.to(plan.acc)
    scores = _scores(q, k_full, block.causal, plan)
    p = torch.exp(scores - lse.unsqueeze(-1))  # (b, g, rows, cols): this block's weights
    g = grad_out.to(plan.acc)
    dv = p.transpose(-2, -1) @ g  # (b, g, cols, d)
    dp = g @ v_full.transpose(-2, -1)
    delta = (g * out).sum(-1, keepdim=True)  # (b, g, rows, 1)
    ds = p * (dp - delta) * plan.scale
    dq = ds @ k_full
    dk = ds.transpose(-2, -1) @ q.to(plan.acc)
    return dq, heads.sum_groups(dk, groups), heads.sum_groups(dv, groups)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, plan: _Plan) -> torch.Tensor:
    """Scaled scores (b, g, rows, cols) of q against a block's expanded keys, in the
    accumulation dtype; a causal (diagonal) block masks its future."""
    scores = (q.to(plan.acc) @ k.to(plan.acc).transpose(-2, -1)) * plan.scale
    if causal:  # a diagonal block is square: its queries and keys share positions
        allowed = masks.causal_mask(scores.shape[-2], scores.shape[-1], device=q.device)
        scores = scores.masked_fill(~allowed, -torch.inf)
    return scores


def _expand_heads(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    groups = q.shape[1] // kv.shape[1]
    return heads.repeat_kv(kv, groups)  # (b, g, n, d)


def _merge(out, lse, block_out, block_lse) -> None:
    """Fold one block's softmax partial result into (out, lse) by their log-sum-exp, in
    place (out and lse may be views into the whole result)."""
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1))
    out.add_(block_out.mul_(torch.exp(block_lse - new_lse).unsqueeze(-1)))
    lse.copy_(new_lse)
