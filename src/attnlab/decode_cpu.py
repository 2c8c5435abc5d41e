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

Shapes: x (b, 1, d_in) -> (b, 1, d_out); the cache's buffers (b, hkv, hd * capacity), in
blocks of cache.block tokens (KVCache.keys_t).

attnlab.plan decides when a call takes this step (after forward's checks, by an allow-list);
this module is the kernel's Python face only: it knows tensors and a KVCache, not the module.
The kernel checks x's finiteness as it reads x, before it writes anything.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

from attnlab import _build
from attnlab.kv_cache import KVCache

_SOURCE = Path(__file__).with_name("csrc") / "decode_step.cpp"
_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
_EMPTY = torch.empty(0)


@functools.cache
def load_error() -> str | None:
    """None once the extension is built and loaded, else why it is not (one line, warned
    once; built on the first call, once per environment: attnlab._build)."""
    return _build.load(
        "attnlab_decode_step",
        _SOURCE,
        "attnlab's native CPU decode step",
        "the Python path",
        wide=True,  # AVX-512 where the CPU has it: grouped heads' scores are arithmetic-bound
    )


def available() -> bool:
    """True when the kernel is built and loaded (builds it on the first call)."""
    return load_error() is None


def reads(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel reads a cache of this dtype on this device (float32, bfloat16 or
    int8 on the CPU) and is built; then make_cache lays a cache out in its blocks."""
    return device.type == "cpu" and dtype in _CACHE_DTYPES and available()


def step(
    x: torch.Tensor,
    qkv: nn.Linear,
    out: nn.Linear,
    rope: nn.Module | None,
    heads: int,
    scale: float,
    cache: KVCache,
    window: int | None,
) -> torch.Tensor | None:
    """One token per sequence through a layer at the cache's position: appends its keys and
    values and returns the output (b, 1, d_out), or None, with nothing written, when x holds
    a NaN or an infinity. A rolling cache's write, which overwrites a held token, runs in
    KVCache.transaction; a non-rolling cache is written past the tokens it holds and its
    position moves last.

    Args:
        x: (b, 1, d_in) float32 on the CPU.
        qkv: the fused projection, weight (d_out + 2 kv_dim, d_in), float32.
        out: the output projection, weight (d_out, d_out), float32.
        rope: attnlab's RotaryEmbedding (tables covering the position) or None.
        heads: query heads.
        scale: the score scale.
        cache: a KVCache the kernel reads (reads), with room for the token.
        window: the keys each query sees (None: all).

    Returns:
        The output, or None for a non-finite x.
    """
    start = cache.position
    if not cache.rolling:
        return _call(x, qkv, out, rope, heads, scale, cache, window, start)
    with cache.transaction(1):
        return _call(x, qkv, out, rope, heads, scale, cache, window, start)


def _call(x, qkv, out, rope, heads, scale, cache, window, start) -> torch.Tensor | None:
    slot, first, count = cache.native_slots(start, window)
    cos, sin = (_EMPTY, _EMPTY) if rope is None else (rope.cos, rope.sin)
    key_scales, value_scales = cache.scales
    y = _op()(
        x if x.is_contiguous() else x.contiguous(),  # (b, 1, d_in)
        qkv.weight,
        _or_empty(qkv.bias),
        out.weight,
        _or_empty(out.bias),
        cos,
        sin,
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
    )
    if not y.numel():
        return None
    cache.position = start + 1
    return y  # (b, 1, d_out)


@functools.cache
def _op():
    return torch.ops.attnlab_decode.decode_step.default


def _or_empty(tensor: torch.Tensor | None) -> torch.Tensor:
    return _EMPTY if tensor is None else tensor
