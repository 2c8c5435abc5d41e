"""ring_attention's "torch" backend: the ring engine behind PyTorch's context_parallel
(torch.distributed.tensor.experimental), called on this rank's chunks directly.

context_parallel itself is a context manager that patches F.scaled_dot_product_attention
and reads its options (load balancing, rotation) when the forward runs and again when the
backward runs, so it cannot sit behind a function whose backward comes later. This module
calls the same two functions it dispatches to, _templated_ring_attention and its backward,
from a custom autograd function, setting those options for each call and restoring them:
keys and values rotate by all-to-all (the "alltoall" method: one chunk in flight, where
PyTorch's default all-gathers every rank's keys and values), and PyTorch's load balancing
is on exactly when the layout is "zigzag" (its head-tail order) and attention is causal.

The kernel is PyTorch's flash attention: on CUDA `_scaled_dot_product_flash_attention`
(half precision), on the CPU `_scaled_dot_product_flash_attention_for_cpu`.

On gloo, the engine's functional collectives (as DTensor's) leave work that a gloo worker
thread may release while the interpreter shuts down, aborting the process at exit
("terminate called without an active exception"; about 1 run in 30 here). A script that
ends with dist.destroy_process_group() and os._exit(0) avoids it (see
attnlab.bench.parallel.exit_rank and examples/scale_out.py).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable
from torch.distributed.tensor.experimental._context_parallel import _attention as cp

from attnlab.parallel.layout import Layout

aten = torch.ops.aten


@dataclass(frozen=True)
class _Kernel:
    """A flash kernel pair as the ring engine calls it, and how its backward is fed."""

    forward: object
    backward: object
    forward_outputs: tuple[str, ...]  # names of the forward's outputs after (out, lse)


_CUDA_FLASH = _Kernel(
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_backward.default,
    ("cum_seq_q", "cum_seq_k", "max_q", "max_k", "philox_seed", "philox_offset"),
)
_CPU_FLASH = _Kernel(
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    (),
)


def torch_engine_refusal(q: torch.Tensor, k: torch.Tensor) -> str | None:
    """Why PyTorch's engine cannot take these chunks, or None when it can."""
    if q.shape[1] != k.shape[1]:
        return (
            f"PyTorch's engine needs as many key/value heads ({k.shape[1]}) as query heads "
            f"({q.shape[1]})"
        )
    if q.device.type == "cpu":
        return None
    if q.device.type != "cuda":
        return f"PyTorch's engine runs on cpu or cuda tensors, got {q.device.type}"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"PyTorch's CUDA flash kernel takes float16 or bfloat16, got {q.dtype}"
    head_dim = q.shape[-1]
    if head_dim > 256 or head_dim % 8:
        return f"PyTorch's CUDA flash kernel takes a head_dim multiple of 8 to 256, not {head_dim}"
    major, minor = torch.cuda.get_device_capability(q.device)
    if major < 8:
        return f"PyTorch's CUDA flash kernel needs compute capability 8.0+, not {major}.{minor}"
    return None


def torch_ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    layout: Layout,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """This rank's part of attention over the whole sequence through PyTorch's engine
    (arguments already checked on every rank, and torch_engine_refusal(q, k) is None)."""
    group = group if group is not None else dist.group.WORLD
    return _TorchRing.apply(q, k, v, causal, layout, group)


@contextlib.contextmanager
def _engine_options(causal: bool, layout: Layout):
    """PyTorch's context-parallel options for one call, restored afterwards."""
    saved = (cp._cp_options.enable_load_balance, cp._cp_options.rotate_method)
    cp._cp_options.enable_load_balance = causal and layout == "zigzag"
    cp._cp_options.rotate_method = cp._RotateMethod.ALL_TO_ALL
    try:
        yield
    finally:
        cp._cp_options.enable_load_balance, cp._cp_options.rotate_method = saved


class _TorchRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, layout, group):
        kernel = _CUDA_FLASH if q.device.type == "cuda" else _CPU_FLASH
        scale = 1.0 / math.sqrt(q.shape[-1])
        with _engine_options(causal, layout):
            out, lse, *rest = cp._templated_ring_attention(
                group, 2, kernel.forward, q, k, v, is_causal=causal, dropout_p=0.0, scale=scale
            )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel, ctx.scale = kernel, scale
        ctx.causal, ctx.layout, ctx.group = causal, layout, group
        ctx.forward_outputs = dict(zip(kernel.forward_outputs, rest, strict=False))
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        with _engine_options(ctx.causal, ctx.layout):
            grad_q, grad_k, grad_v, *_ = cp._templated_ring_attention_backward(
                ctx.group,
                2,
                ctx.kernel.backward,
                grad_out=grad_out.contiguous(),
                grad_out_name="grad_out",
                query=q,
                key=k,
                value=v,
                out=out,
                logsumexp=lse,
                is_causal=ctx.causal,
                dropout_p=0.0,
                scale=ctx.scale,
                **ctx.forward_outputs,
            )
        return grad_q, grad_k, grad_v, None, None, None
