"""attnlab's causal flash-attention kernel for the CPU (float32), behind the "auto" backend.

PyTorch's CPU flash kernel skips causal work only in whole 512-key blocks: at 1024 tokens
its causal call does 0.75 of the unmasked work where 0.5 is needed. The kernel in
csrc/causal_attention.cpp reads each query block's keys only up to its diagonal. It is a
C++ extension compiled on first use with torch.utils.cpp_extension (about 20 s, once per
environment: attnlab._build keys the build by torch, Python, compiler, flags and source;
`attnlab build` builds it ahead of time); where it cannot be built (no compiler, no BLAS
symbols, macOS) attnlab warns once in one line and uses PyTorch's kernel instead.
ATTNLAB_NO_EXTENSION=1 turns it off. "auto" takes it only where it wins (`preferred`).

The backward pass is the kernel's own (causal_flash_backward, same file): the probabilities
recomputed from the forward's logsumexp over the same causal cut, grouped-query heads read
in place (no key or value repeated per query head), memory linear in the tokens. Every call
the forward takes (bias, key ranges, sinks as a biased key, causal or not) has it; dropout
and softcap never reach this kernel (functional sends them to SDPA and math).
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import torch

from attnlab import _build
from attnlab.strides import dense_rows

_SOURCE = Path(__file__).with_name("csrc") / "causal_attention.cpp"
_NAME = "attnlab_causal_flash"
_Q_SPLIT, _KV_SPLIT, _DIAG_SPLIT = 128, 512, 32  # rows, keys, diagonal rows per tile
# the backward's tiles: query rows, keys per block, diagonal rows
_BACKWARD_Q_SPLIT, _BACKWARD_KV_SPLIT, _BACKWARD_DIAG_SPLIT = 256, 128, 32


@functools.cache
def load_error() -> str | None:
    """None once the extension is built and loaded, else why it is not (one line, warned
    once; built on the first call, once per environment: attnlab._build)."""
    return _build.load(_NAME, _SOURCE, "attnlab's C++ causal kernel", "PyTorch's SDPA")


def build_name() -> str:
    """The extension's name here (attnlab._build.name_for): one per environment."""
    return _build.name_for(_NAME, _SOURCE)


def available() -> bool:
    """True when the kernel is built and loaded (builds it on the first call)."""
    return load_error() is None


# A compiled caller reads it once, at trace time: torch.compiler.assume_constant_result's
# whole effect (torch/_dynamo/decorators.py), set without importing torch._dynamo, which
# was 1.4 s of `import attnlab` (tests/test_flash_cpu.py compares it with torch's own).
available._dynamo_marked_constant = True  # type: ignore[attr-defined]


def preferred() -> bool:
    """True where the "auto" backend should take the kernel: its vectorised build (x86-64
    with AVX2 or AVX-512), measured faster than PyTorch's SDPA, and loaded. The portable
    build (CPU_CAPABILITY=DEFAULT) measured 1.6x slower than SDPA at 2x12x1024x64 on x86,
    and the NEON one (aarch64) is not measured: there "auto" takes SDPA without building,
    and backend="flash" still asks for the kernel. Never on macOS (see attnlab._build)."""
    return _build.vectorised() and platform.system() != "Darwin" and available()


def supports(dtype: torch.dtype, device: torch.device, head_dims: tuple[int, ...]) -> bool:
    """Inputs the kernel handles: float32 on the CPU, one head_dim for q, k and v."""
    return device.type == "cpu" and dtype == torch.float32 and len(set(head_dims)) == 1


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    causal: bool,
    key_ranges: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of q (b, hq, tq, d) over k, v (b, hkv, tk, d), causal (bottom-right
    aligned, the masked work skipped) or not, with an optional additive float bias
    broadcastable to (b, hq, tq, tk), -inf where a query may not attend. key_ranges
    (start, end), int64 (b,) each: sequence i reads only keys [start[i], end[i]) (a padded
    batch, at the cost of its real keys only). A row with no key it may see gets zeros.
    Any strides (dense_rows copies what the kernel cannot read). Differentiable.

    Raises:
        RuntimeError: the kernel is unavailable (the reason), or, from the op, an argument
            outside its contract (tensors on different devices included), named.
    """
    if not available():  # builds or loads the op on the first call of a process
        raise RuntimeError(f"attnlab's C++ causal kernel is unavailable: {load_error()}")
    out, _ = _Flash.apply(q, k, v, bias, scale, causal, key_ranges)  # lse: not differentiable
    return out


class _Flash(torch.autograd.Function):
    """Forward and backward: attnlab's kernel (the backward recomputes the probabilities
    from the forward's logsumexp). Written with setup_context, so that torch.func.grad and
    jacrev run it; the backward is not itself differentiable (once_differentiable: a
    second derivative raises instead of coming back zero)."""

    @staticmethod
    def forward(q, k, v, bias, scale, causal, key_ranges):
        # the rows BLAS can read; no generator unpacked (Dynamo 2.14+ fails on it in a
        # function traced with autograd: "generator already executing")
        q, k, v = dense_rows(q), dense_rows(k), dense_rows(v)
        starts, ends = _ranges(key_ranges, q)
        return tuple(  # (out, lse): the op returns a list, which apply would not track
            torch.ops.attnlab.causal_flash_forward(
                q,
                k,
                v,
                _mask(bias, q, k),
                starts,
                ends,
                scale,
                causal,
                _Q_SPLIT,
                _KV_SPLIT,
                _DIAG_SPLIT,
            )
        )

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, bias, scale, causal, key_ranges = inputs
        out, lse = output
        starts, ends = _ranges(key_ranges, q)
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, bias, out, lse, starts, ends)
        ctx.scale, ctx.causal = scale, causal

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, bias, out, lse, starts, ends = ctx.saved_tensors
        q, k, v = dense_rows(q), dense_rows(k), dense_rows(v)  # as the forward read them
        grad_q, grad_k, grad_v = torch.ops.attnlab.causal_flash_backward(
            dense_rows(grad_out),
            q,
            k,
            v,
            out,
            lse,
            _mask(bias, q, k),
            starts,
            ends,
            ctx.scale,
            ctx.causal,
            _BACKWARD_Q_SPLIT,
            _BACKWARD_KV_SPLIT,
            _BACKWARD_DIAG_SPLIT,
        )
        return grad_q, grad_k, grad_v, None, None, None, None


def _mask(bias: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The kernel's mask argument: empty (on q's device) for no bias, else the bias as a
    4-D view."""
    return q.new_empty(0) if bias is None else _broadcast_4d(bias, q, k)


def _ranges(
    key_ranges: tuple[torch.Tensor, torch.Tensor] | None, q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's key_start and key_end: the ranges, or empty int64 tensors on q's device
    (the op refuses tensors on different devices, an empty one included)."""
    if key_ranges is not None:
        return key_ranges
    none = q.new_empty(0, dtype=torch.long)
    return none, none


def _broadcast_4d(bias: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The bias as a float32 (b, hq, tq, tk) view (broadcast dimensions have stride 0)."""
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return bias.to(torch.float32).expand(shape)
