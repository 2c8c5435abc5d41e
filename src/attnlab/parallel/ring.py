"""Ring (context-parallel) attention over torch.distributed: each rank holds one contiguous
chunk of the sequence; keys and values travel around the ring with point-to-point ops, the
next transfer overlapping the current block's compute; partial results merge by
log-sum-exp. Works on gloo (CPU) and nccl (CUDA) process groups.

Layout: rank r passes q, k, v of shape (batch, heads, tokens / world, head_dim) holding
tokens [r * n, (r + 1) * n) of the sequence, n = tokens / world (`shard_sequence` cuts a
full tensor that way). With causal=True, the blocks of later ranks are fully masked for
rank r and skipped (no load balancing: rank world-1 does the most work).

Backward (a custom autograd function) passes keys, values and their gradient accumulators
around the ring once more; each rank adds its contribution for the block it holds, so the
accumulated gradients arrive back at their owner after a full turn.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def shard_sequence(
    x: torch.Tensor, dim: int = 2, *, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """This rank's contiguous chunk of `x` along `dim` (a clear ValueError, on every rank,
    when the length does not divide by the world size)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    length = x.shape[dim]
    if length % world != 0:
        raise ValueError(
            f"sequence length {length} (dim {dim}) is not divisible by the world size {world}"
        )
    return x.chunk(world, dim=dim)[rank].contiguous()


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """This rank's chunk of softmax(q k^T / sqrt(d)) v over the whole sequence; q is
    (b, hq, n, d) and k, v are (b, hkv, n, d) with hkv dividing hq (grouped-query).
    Every rank must call it with chunks of one shape; a mismatch is a ValueError on every
    rank (the shapes are compared with a collective first, so no rank is left waiting)."""
    _check_same_everywhere(q, k, v, group)
    return _RingAttention.apply(q, k, v, causal, group)


def _check_same_everywhere(q, k, v, group) -> None:
    """All-gather each rank's shapes (-1 for a malformed input) and raise on all of them."""
    mine = [*_shape4(q), *_shape4(k), *_shape4(v)]
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    local = torch.tensor(mine, dtype=torch.long, device=device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    shapes = [tuple(g.tolist()) for g in gathered]
    if any(-1 in s for s in shapes):
        bad = [rank for rank, s in enumerate(shapes) if -1 in s]
        raise ValueError(
            f"q, k, v must be 4-D tensors (batch, heads, tokens, head_dim) on every rank; "
            f"ranks {bad} passed something else"
        )
    if len(set(shapes)) > 1:
        raise ValueError(f"q, k, v chunk shapes differ across ranks: {shapes}")
    b, hq, n, d, kb, hkv, kn, kd = shapes[0][:8]
    if (kb, kn, kd) != (b, n, d) or shapes[0][4:8] != shapes[0][8:12] or hq % hkv:
        raise ValueError(
            f"q {shapes[0][:4]}, k {shapes[0][4:8]}, v {shapes[0][8:12]}: batch, tokens and "
            f"head_dim must agree and the key/value heads must divide the query heads"
        )


def _shape4(t) -> list[int]:
    return list(t.shape) if isinstance(t, torch.Tensor) and t.dim() == 4 else [-1] * 4


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, group):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        scale = 1.0 / math.sqrt(q.shape[-1])
        out = lse = None
        ring = _Ring(group, (k, v))
        for step in range(world):
            k_block, v_block = ring.current()
            last = step == world - 1
            if not last:
                ring.start_next()  # the next block travels while this one is computed
            source = (rank - step) % world
            if not (causal and source > rank):  # a later chunk is all future: skip it
                diagonal = causal and source == rank
                block_out, block_lse = _block(q, k_block, v_block, diagonal, scale)
                out, lse = _merge(out, lse, block_out, block_lse)
            if not last:
                ring.finish()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.group, ctx.scale = causal, group, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        rank, world = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        grad_q = torch.zeros_like(q, dtype=torch.float32)
        # keys, values and their gradient accumulators go round together
        zeros = [torch.zeros_like(t, dtype=torch.float32) for t in (k, v)]
        ring = _Ring(ctx.group, (k, v, *zeros))
        for step in range(world):
            k_block, v_block, dk, dv = ring.current()
            source = (rank - step) % world
            if not (ctx.causal and source > rank):
                diagonal = ctx.causal and source == rank
                dq_part, dk_part, dv_part = _block_backward(
                    grad_out, q, k_block, v_block, out, lse, diagonal, ctx.scale
                )
                grad_q += dq_part
                dk, dv = dk + dk_part, dv + dv_part
            ring.replace((k_block, v_block, dk, dv))
            ring.start_next()
            ring.finish()
        _, _, grad_k, grad_v = ring.current()  # after a full turn: this rank's own block
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None


class _Ring:
    """Tensors passed to the next rank and received from the previous one, asynchronously."""

    def __init__(self, group, tensors) -> None:
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.tensors = tuple(t.contiguous() for t in tensors)
        self.incoming = None
        self.requests = []

    def current(self):
        return self.tensors

    def replace(self, tensors) -> None:
        self.tensors = tuple(t.contiguous() for t in tensors)

    def _global(self, rank: int) -> int:
        rank %= self.world
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def start_next(self) -> None:
        if self.world == 1:
            return
        to_rank, from_rank = self._global(self.rank + 1), self._global(self.rank - 1)
        self.incoming = tuple(torch.empty_like(t) for t in self.tensors)
        operations = [dist.P2POp(dist.isend, t, to_rank, self.group) for t in self.tensors]
        operations += [dist.P2POp(dist.irecv, t, from_rank, self.group) for t in self.incoming]
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


def _block(q, k, v, causal: bool, scale: float):
    """(out float32 (b, hq, n, d), logsumexp float32 (b, hq, n)) of q against one block."""
    k, v = _expand_heads(q, k), _expand_heads(q, v)
    if _fused(q):  # square blocks: PyTorch's top-left causal mask is the diagonal one
        out, lse = _CPU_FLASH(q, k, v, 0.0, causal, scale=scale)
        return out.float(), lse.float()
    scores = _scores(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)  # (b, hq, n)
    out = torch.exp(scores - lse.unsqueeze(-1)) @ v.float()
    return out, lse


def _block_backward(grad_out, q, k, v, out, lse, causal: bool, scale: float):
    """Gradients of one block's part, from the merged output and logsumexp: exact for it."""
    groups = q.shape[1] // k.shape[1]
    if _fused(q):
        k_full, v_full = _expand_heads(q, k), _expand_heads(q, v)
        dq, dk, dv = _CPU_FLASH_BACKWARD(
            grad_out.contiguous(), q, k_full, v_full, out.to(q.dtype), lse, 0.0, causal, scale=scale
        )
        return dq.float(), *_sum_groups(dk.float(), dv.float(), groups)
    k_full, v_full = _expand_heads(q, k).float(), _expand_heads(q, v).float()
    scores = _scores(q, k_full, causal, scale)
    p = torch.exp(scores - lse.unsqueeze(-1))  # (b, hq, n, n): this block's weights
    g = grad_out.float()
    dv = p.transpose(-2, -1) @ g  # (b, hq, n, d)
    dp = g @ v_full.transpose(-2, -1)
    delta = (g * out).sum(-1, keepdim=True)  # (b, hq, n, 1)
    ds = p * (dp - delta) * scale
    dq = ds @ k_full
    dk = ds.transpose(-2, -1) @ q.float()
    return dq, *_sum_groups(dk, dv, groups)


def _sum_groups(dk: torch.Tensor, dv: torch.Tensor, groups: int) -> tuple:
    """Gradients of repeated key/value heads summed back onto each key/value head."""
    if groups == 1:
        return dk, dv
    b, hq, n, d = dk.shape
    dk = dk.view(b, hq // groups, groups, n, d).sum(2)  # (b, hkv, n, d)
    return dk, dv.view(b, hq // groups, groups, n, d).sum(2)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """Scaled float32 scores (b, hq, n, n) of q against a block's expanded keys; a diagonal
    block masks its future."""
    scores = (q.float() @ k.float().transpose(-2, -1)) * scale
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, -torch.inf)
    return scores


def _expand_heads(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    groups = q.shape[1] // kv.shape[1]
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)  # (b, hq, n, d)


def _merge(out, lse, block_out, block_lse):
    """Combine two softmax partial results by their log-sum-exp, in place (both are this
    function's own tensors: no extra chunk-sized temporaries)."""
    if out is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1))
    out.add_(block_out.mul_(torch.exp(block_lse - new_lse).unsqueeze(-1)))
    return out, new_lse
