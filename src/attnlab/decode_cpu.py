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

Shapes: x (b, 1, d_in) -> (b, 1, d_out); the cache's buffers (b, hkv, hd, capacity).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from attnlab import _build
from attnlab.kv_cache import KVCache

if TYPE_CHECKING:
    from attnlab.attention import MultiHeadAttention

_SOURCE = Path(__file__).with_name("csrc") / "decode_step.cpp"
_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
_EMPTY = torch.empty(0)


@functools.cache
def load_error() -> str | None:
    """None once the extension is built and loaded, else why it is not (one line, warned
    once; built on the first call, once per environment: attnlab._build)."""
    return _build.load(
        "attnlab_decode_step", _SOURCE, "attnlab's native CPU decode step", "the Python path"
    )


def available() -> bool:
    """True when the kernel is built and loaded (builds it on the first call)."""
    return load_error() is None


def handles(
    module: MultiHeadAttention,
    x: torch.Tensor,
    cache: KVCache,
    mask: torch.Tensor | None,
    need_weights: bool,
) -> bool:
    """True when a checked cached call can take the native step: one float32 token per
    sequence on the CPU, backend "auto", no mask, no weights, no dropout, nothing recording
    gradients, plain nn.Linear projections, a head_dim that is a multiple of 4 (the kernel
    reads four of its rows side by side), a cache whose window is the module's; never
    while torch.compile or export traces the module."""
    if x.shape[1] != 1 or mask is not None or need_weights or module.backend != "auto":
        return False
    if torch.compiler.is_compiling():  # the compiler traces the Python path into its graph
        return False
    if x.dtype != torch.float32 or not x.is_cpu or cache.dtype not in _CACHE_DTYPES:
        return False
    if (module.training and module.dropout > 0) or module.head_dim % 4:
        return False
    if cache.rolling and cache.window != module.window:
        return False
    layers = _layers(module)
    if layers is None:
        return False
    if torch.is_grad_enabled() and _records_grad(x, layers, cache):
        return False
    return available()


def _layers(module: MultiHeadAttention) -> tuple[nn.Linear, nn.Linear] | None:
    """The fused projection and the output projection, when both are plain nn.Linear
    (not a subclass or wrapper) without hooks and with contiguous float32 parameters."""
    submodules = module._modules  # the dict itself: nn.Module.__getattr__ costs per call
    layers = (submodules.get("qkv_proj"), submodules.get("out_proj"))
    for layer in layers:
        if type(layer) is not nn.Linear or layer._forward_hooks or layer._forward_pre_hooks:
            return None
        for param in layer._parameters.values():
            if param is not None and (param.dtype != torch.float32 or not param.is_contiguous()):
                return None
    return layers


def _records_grad(x: torch.Tensor, layers, cache: KVCache) -> bool:
    if x.requires_grad or cache.records_grad:
        return True
    return any(p.requires_grad for layer in layers for p in layer.parameters())


def step(module: MultiHeadAttention, x: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
    """The cached call for one token per sequence (the caller checked it and `handles`):
    appends its keys and values at position `start` and returns the output (b, 1, d_out)."""
    slot, first, count = cache.native_slots(start, module.window)
    qkv, out = (layer._parameters for layer in _layers(module))
    rope = module.rope
    cos, sin = (_EMPTY, _EMPTY) if rope is None else (rope.cos, rope.sin)
    key_scales, value_scales = cache.scales
    y = _op()(
        x.reshape(x.shape[0], x.shape[2]).contiguous(),  # (b, d_in)
        qkv["weight"],
        _or_empty(qkv["bias"]),
        out["weight"],
        _or_empty(out["bias"]),
        cos,
        sin,
        cache.keys_t,
        cache.values_t,
        key_scales,
        value_scales,
        module.num_heads,
        start,
        slot,
        first,
        count,
        1.0 / math.sqrt(module.head_dim),
    )
    cache.position = start + 1
    return y.unsqueeze(1)  # (b, d_out) -> (b, 1, d_out)


@functools.cache
def _op():
    return torch.ops.attnlab_decode.decode_step.default


def _or_empty(tensor: torch.Tensor | None) -> torch.Tensor:
    return _EMPTY if tensor is None else tensor
