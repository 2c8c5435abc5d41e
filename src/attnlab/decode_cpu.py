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

MultiHeadAttention.forward calls try_step first: the step's gate (`handles`) is attribute
reads and comparisons, and x's finiteness is checked by the kernel as it reads x, so that a
decoded token pays little Python per layer.
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
# MultiHeadAttention's steps the native call stands for, checks included: a subclass or an
# instance that replaces one gets the Python path (its own steps and checks)
_STEPS = (
    "_attend",
    "_project",
    "_split_heads",
    "_attention_mask",
    "_check_input",
    "_check_cache",
    "_check_mask",
    "_start_position",
)


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


def try_step(module: MultiHeadAttention, x: object, cache: object) -> torch.Tensor | None:
    """module(x, cache=cache), with no mask, context or weights, as one native step where
    it applies (`handles`), else None: then forward's own checks and Python path run, and
    raise what they must (a non-finite x included: the kernel checks x before it writes).

    The step is all or nothing: a non-rolling cache is written past the tokens it holds and
    its position moves last; a rolling cache's write, which overwrites a held token, runs in
    KVCache.transaction.
    """
    layers = _plan(module, x, cache)
    if layers is None:
        return None
    start = cache.position
    if cache.rolling:
        with cache.transaction(1):
            return step(module, x, cache, start, layers)
    return step(module, x, cache, start, layers)


def reads(module: MultiHeadAttention, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the native step will decode with a cache that make_cache builds for this
    module, of this dtype on this device (then laid out for the step: kv_cache.BLOCK_TOKENS);
    what a call brings (x, autograd) is left to each call's gate."""
    if device.type != "cpu" or dtype not in _CACHE_DTYPES:
        return False
    return _module_plan(module) is not None and available()


def handles(module: MultiHeadAttention, x: object, cache: object) -> bool:
    """True when module(x, cache=cache) can take the native step: every check of
    MultiHeadAttention.forward passes except x's finiteness (the kernel's own), and the
    call is one float32 token per sequence on the CPU, backend "auto", no dropout, nothing
    recording gradients, plain nn.Linear projections, the Python path's own steps (no
    subclass overriding them) and rotary embedding, a head_dim that is a multiple of 4
    (the kernel reads four of its rows side by side), a cache of float32, bfloat16 or
    int8 whose window is the module's; never while torch.compile, export or torch.jit.trace
    traces."""
    return _plan(module, x, cache) is not None


def _plan(module: MultiHeadAttention, x: object, cache: object) -> tuple[dict, dict] | None:
    """The projections' parameters when `handles` holds, else None (attribute reads and
    comparisons only: a decoded token pays this per layer)."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():  # traces take the Python path
        return None
    if type(x) is not torch.Tensor or type(cache) is not KVCache:
        return None
    if x.dim() != 3 or x.shape[1] != 1 or x.shape[2] != module.d_in:
        return None
    if x.dtype != torch.float32 or not x.is_cpu or not _fits(module, cache, x.shape[0]):
        return None
    layers = _module_plan(module)
    if layers is None or _unwritable(cache):
        return None
    if torch.is_grad_enabled() and module._records_grad(x):  # as forward judges it
        return None
    return layers if available() else None


def _unwritable(cache: KVCache) -> bool:
    """Buffers the kernel must not write behind autograd's or inference mode's back (it
    writes through data pointers): buffers autograd saved, which the Python path's in-place
    write would have it refuse at backward, and inference tensors outside inference mode,
    which the Python path refuses to write."""
    if cache.records_grad:
        return True
    return cache.keys_t.is_inference() and not torch.is_inference_mode_enabled()


def _module_plan(module: MultiHeadAttention) -> tuple[dict, dict] | None:
    """The projections' parameters when the module's settings suit the step, else None."""
    if module.backend != "auto" or not module.causal or (module.training and module.dropout > 0):
        return None
    if module.head_dim % 4 or not _runs_the_python_path_as_is(type(module), type(module.rope)):
        return None
    if any(step in module.__dict__ for step in _STEPS):  # a method replaced on the instance
        return None
    return _layers(module)


def _fits(module: MultiHeadAttention, cache: KVCache, batch: int) -> bool:
    """The cache's shape, dtype, window and room for this module and batch."""
    made_for = (cache.batch_size, cache.num_kv_heads, cache.head_dim)
    if made_for != (batch, module.num_kv_heads, module.head_dim):
        return False
    keys, window = cache.keys_t, module.window
    if keys.dtype not in _CACHE_DTYPES or not keys.is_cpu:
        return False
    if cache.window is not None and (window is None or cache.window != window):
        return False  # forward's error (a narrower window), or a wider one: the Python path
    start = cache.position
    room = cache.rolling or start < cache.capacity
    return room and start < module.context_length


@functools.cache
def _runs_the_python_path_as_is(module_class: type, rope_class: type) -> bool:
    """False for a subclass that overrides a step the kernel stands for (_STEPS: the
    projection, heads, attention and forward's checks), or a rotary embedding other than
    attnlab's: the kernel would not do what they do."""
    from attnlab.attention import MultiHeadAttention
    from attnlab.rope import RotaryEmbedding

    same = all(getattr(module_class, s) is getattr(MultiHeadAttention, s) for s in _STEPS)
    return same and rope_class in (type(None), RotaryEmbedding)


def _layers(module: MultiHeadAttention) -> tuple[dict, dict] | None:
    """The parameters of the fused projection and the output projection, when both are
    plain nn.Linear (not a subclass or wrapper) without hooks and with contiguous float32
    parameters on the CPU."""
    submodules = module._modules  # the dict itself: nn.Module.__getattr__ costs per call
    layers = (submodules.get("qkv_proj"), submodules.get("out_proj"))
    for layer in layers:
        if type(layer) is not nn.Linear or layer._forward_hooks or layer._forward_pre_hooks:
            return None
        for param in layer._parameters.values():
            if param is None:
                continue
            if param.dtype != torch.float32 or not param.is_cpu or not param.is_contiguous():
                return None
    return layers[0]._parameters, layers[1]._parameters


def step(
    module: MultiHeadAttention,
    x: torch.Tensor,
    cache: KVCache,
    start: int,
    layers: tuple[dict, dict],
) -> torch.Tensor | None:
    """The native call for one token per sequence at position `start` (`try_step` checked
    it): appends its keys and values and returns the output (b, 1, d_out), or None, with
    nothing written, when x holds a NaN or an infinity."""
    slot, first, count = cache.native_slots(start, module.window)
    qkv, out = layers
    rope = module.rope
    cos, sin = (_EMPTY, _EMPTY) if rope is None else (rope.cos, rope.sin)
    key_scales, value_scales = cache.scales
    y = _op()(
        x if x.is_contiguous() else x.contiguous(),  # (b, 1, d_in)
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
        cache.block,
        1.0 / math.sqrt(module.head_dim),
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
