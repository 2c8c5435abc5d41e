"""attnlab's native decode step for the CPU: one token per sequence through a whole
MultiHeadAttention layer (fused projection, rotary positions, cache append, attention over
the cache, output projection) in one C++ call, csrc/decode_step.cpp.

Producing a token is bound by reading every weight and the whole cache once; the Python path
(MultiHeadAttention._attend) reads them at a fraction of the bandwidth and pays dispatch
per tensor operation, which dominates at short contexts and small caches. The kernel
streams each weight once for the whole batch and each key/value head's cache once for the
query heads sharing it, split in chunks of keys over the cores.

It is built on first use as attnlab.flash_cpu is (attnlab._build: torch.utils.cpp_extension,
about 15 s, once per environment, or ahead of time by `attnlab build`); where it cannot be
built attnlab warns once and decodes with the Python path, which stays the reference it is
tested against. ATTNLAB_NO_EXTENSION=1 turns it off.

Shapes: x (b, 1, d_in) -> (b, 1, width), the output projection's; the cache's buffers (b,
hkv, hd * capacity), in blocks of cache.block tokens (KVCache.keys_t).

attnlab.plan decides when a call takes this step (after forward's checks, by an allow-list);
this module is the kernel's Python face only: it knows tensors and a KVCache, not the module.
The kernel checks x's finiteness as it reads x, before it writes anything.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import NamedTuple

import torch

from attnlab import _build, debug
from attnlab.kv_cache import KVCache

_SOURCE = Path(__file__).with_name("csrc") / "decode_step.cpp"
_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
EMPTY = torch.empty(0)  # the kernel's "none": no bias, no rotary tables, no int8 scales
_NAME = "attnlab_decode_step"
_WIDE = True  # AVX-512 where the CPU has it: grouped heads' scores are arithmetic-bound


@functools.cache
def load_error() -> str | None:
    """None once the extension is built and loaded, else why it is not (one line, warned
    once; built on the first call, once per environment: attnlab._build)."""
    return _build.load(
        _NAME,
        _SOURCE,
        "attnlab's native CPU decode step",
        "the Python path",
        wide=_WIDE,
    )


def build_name() -> str:
    """The extension's name here (attnlab._build.name_for): one per environment."""
    return _build.name_for(_NAME, _SOURCE, wide=_WIDE)


def available() -> bool:
    """True when the kernel is built and loaded (builds it on the first call)."""
    return load_error() is None


def loaded() -> bool:
    """True when the kernel is already built and loaded; unlike `available`, never starts a
    build (a few rows through attnlab.matvec take it only once decoding has built it)."""
    return _build.is_loaded(_NAME) and load_error() is None


def computes(*tensors: torch.Tensor) -> bool:
    """Whether linear_rows and latent_step may compute from `tensors` what torch's own
    operations would: every one a float32 CPU tensor, none a lazily negated view (its memory
    is not its values); no gradient wanted (they record no autograd history, forward-mode
    tangents included); no CPU autocast (which would cast torch's inputs); and the extension
    already loaded (`loaded`: this never starts a build)."""
    if torch.is_autocast_enabled("cpu") or debug.under_transform():
        return False
    for t in tensors:
        if t.dtype != torch.float32 or not t.is_cpu or t.is_neg():
            return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return loaded()


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (rows, in) @ weight (out, in)^T + bias through the step's projection kernel, which
    reads each weight row once for all the rows; float32, contiguous, on the CPU, the
    extension loaded (its own checks refuse anything else with a RuntimeError).

    Returns:
        (rows, out), a new tensor; no autograd history (the caller needs none).
    """
    return binding().linear_rows(x, weight, EMPTY if bias is None else bias)


class LatentTables(NamedTuple):
    """What multi-head latent attention's native step reads besides the projections: the
    latent norm's weight (r,) with its eps and offset, or an empty weight for none; the
    rotary tables (positions, dr), or empty for none."""

    norm: torch.Tensor
    norm_eps: float
    norm_offset: float
    cos: torch.Tensor
    sin: torch.Tensor


def latent_step(
    query: torch.Tensor,
    compressed: torch.Tensor,
    tables: LatentTables,
    position: int,
    rows: torch.Tensor,
    weight: torch.Tensor,
    scale: float,
) -> torch.Tensor | None:
    """Multi-head latent attention's absorbed step for one token per sequence (attnlab.mla)
    after its projections: the token's row (the latent normalised, the rotary key rotated)
    written to row `position` of each sequence's rows, then each head's query (rotated)
    folded through kv_b_proj's key rows, its scores against rows [0, position], their
    latents weighted, and kv_b_proj's value rows applied; each sequence's rows read once
    for all heads, in chunks over the cores. Float32, contiguous, on the CPU, the extension
    loaded (its own checks refuse anything else with a RuntimeError, before any write).

    Args:
        query: (b, h, dn + dr) each head's query as projected (unrotated).
        compressed: (b, r + dr) kv_a_proj_with_mqa's output: the latent, then the rotary key.
        tables: the latent norm and rotary tables (LatentTables).
        position: the token's position: the row it is written to.
        rows: (b, capacity, r + dr) a LatentCache's buffer, written at `position`.
        weight: kv_b_proj's weight (h (dn + dv), r).
        scale: the softmax scale.

    Returns:
        (b, h, dv), each head's output before o_proj, or None where it is not finite
        (float32 overflowed: the row is written, and the caller's own path then computes
        the step, writing it again, or names the overflow).
    """
    norm, eps, offset, cos, sin = tables
    out = binding().latent_step(
        query, compressed, norm, eps, offset, cos, sin, position, rows, weight, scale
    )
    return out if out.numel() else None


def bfloat16_products() -> bool:
    """Whether this build's step multiplies an int8 or bfloat16 cache in bfloat16 where a
    key/value head serves several query heads (AVX512_BF16: the queries and the softmax
    weights rounded to bfloat16, the sums float32); else, or where the step is unavailable
    (built on the first call, as `available`), it multiplies in float32."""
    return available() and binding().bfloat16_products()


def reads(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel reads a cache of this dtype on this device (float32, bfloat16 or
    int8 on the CPU) and is built; then make_cache lays a cache out in its blocks."""
    return device.type == "cpu" and dtype in _CACHE_DTYPES and available()


class Weights(NamedTuple):
    """The tensors of a layer the kernel reads: float32, contiguous, on the CPU.

    Attributes:
        qkv: the fused projection's weight (d_out + 2 kv_dim, d_in), rows in query, key,
            value order.
        qkv_bias: its bias (d_out + 2 kv_dim,), or an empty tensor for none.
        out: the output projection's weight (width, d_out), any width.
        out_bias: its bias (width,), or empty.
        cos: the rotary cosines (positions, head_dim), or empty without rotary positions.
        sin: the rotary sines, cos's shape, or empty.
        q_norm: the query norm's weight, (head_dim,) per head or (d_out,) over the
            projection, or empty without query/key norms.
        k_norm: the key norm's weight, (head_dim,) or (kv_dim,), or empty.
        norm_eps: the norms' eps (attnlab.norms.RMSNorm's), read only with norm weights.
        norm_offset: what the norms add to their weights (1.0 for Gemma's 1 + weight).
    """

    qkv: torch.Tensor
    qkv_bias: torch.Tensor
    out: torch.Tensor
    out_bias: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    q_norm: torch.Tensor = EMPTY
    k_norm: torch.Tensor = EMPTY
    norm_eps: float = 1e-6
    norm_offset: float = 0.0


_TENSORS = Weights._fields.index("norm_eps")  # Weights' tensors come before its floats


def reads_buffer(buffer: torch.Tensor) -> bool:
    """reads(buffer.dtype, buffer.device) for a cache's buffer, without building a
    torch.device (the plan asks this per decoded token and layer)."""
    return buffer.is_cpu and buffer.dtype in _CACHE_DTYPES and available()


def step(
    x: torch.Tensor,
    weights: Weights,
    heads: int,
    scale: float,
    cache: KVCache,
    window: int | None,
) -> torch.Tensor | None:
    """One token per sequence through a layer at the cache's position: appends its keys and
    values and returns the output (b, 1, width), or None, with nothing written, when x holds
    a NaN or an infinity or the step's float32 arithmetic overflowed (a projection, or a
    score or a partial sum of one, past 3.4e38: the caller's Python path then computes the
    step, exactly, or names the overflow). A rolling cache's write, which overwrites a held
    token, runs in KVCache.transaction; a non-rolling cache is written past the tokens it
    holds and its position moves last.

    Args:
        x: (b, 1, d_in) float32 on the CPU.
        weights: the layer's tensors (Weights; rotary tables covering the position).
        heads: query heads.
        scale: the score scale.
        cache: a KVCache the kernel reads (reads), with room for the token.
        window: the keys each query sees (None: all).

    Returns:
        The output, or None for a non-finite x or an overflow.
    """
    start = cache.position
    try:
        if not cache.rolling:
            return _call(x, weights, heads, scale, cache, window, start)
        with cache.transaction(1):  # the overwritten slot is put back if the step overflows
            return _call(x, weights, heads, scale, cache, window, start)
    except _OverflowError:
        return None  # the Python path computes the step exactly or names the overflow


class _OverflowError(Exception):
    """The op refused its own float32 result (a projection, a score or a partial sum of
    one past 3.4e38) with the cache's position unmoved."""


def _call(x, weights, heads, scale, cache, window, start) -> torch.Tensor | None:
    slot, first, count = cache.native_slots(start, window)
    key_scales, value_scales = cache.scales
    try:
        y = _op()(
            x if x.is_contiguous() else x.contiguous(),  # (b, 1, d_in)
            *weights[:_TENSORS],  # the tensors, qkv to k_norm
            cache.keys_t,
            cache.values_t,
            key_scales,
            value_scales,
            heads,
            start,
            slot,
            first,
            count,
            cache.block,
            scale,
            weights.norm_eps,
            weights.norm_offset,
        )
    except RuntimeError as error:  # the op's overflow is the caller's values
        if str(error).startswith(_OVERFLOW):
            raise _OverflowError from None
        raise
    if not y.numel():
        return None
    cache.position = start + 1
    return y  # (b, 1, width)


_OVERFLOW = "decode_step: the output is not finite"


@functools.cache  # looked up per call by linear_rows and latent_step: once is enough
def binding():
    """The extension's Python module (its functions bound directly: decode_step,
    linear_rows, latent_step, and the call plan's lane, attnlab.plan.decode_lane); the
    extension must be available (a failed lookup raises and is not cached)."""
    return _build.python_module(_NAME)


@functools.cache
def _op():
    """The op's direct binding (the same checked C++ function without torch.ops' schema
    parsing, ~2 us less per call); torch.ops.attnlab_decode.decode_step is the registered
    face, which torch.compile and export trace (fake_ops)."""
    return binding().decode_step
