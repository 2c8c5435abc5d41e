"""The call plan: which executor runs a MultiHeadAttention call after forward's checks, and
how each projection runs.

attnlab's fast paths stand beside the reference (the module's own Python path, which calls
its submodules): the native decode step (decode_cpu: projections, rotary positions, cache
append, attention and output projection in one C++ call) and the blocked small-row product
(matvec). A fast path computes a layer without calling it, so it is taken only for what it
implements exactly, by an allow-list checked on every call (attribute reads and
comparisons): a plain `nn.Linear` of the expected shapes with no hook of any kind, local or
global, forward or backward; attnlab's own rotary embedding with tables long enough; the
module's own steps (no subclass or instance override); float32 on the CPU; no autocast,
tracing or autograd recording. Anything else, whatever the user did to the module, takes the
reference path, which calls the submodules as they are.

Checking on every call is the plan's invalidation: nothing the user changes (a submodule
replaced, a parameter swapped or reshaped, a hook added, the rope tables, dtype, device,
autocast, grad mode) can go unseen, and the checks cost a few attribute reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.modules import module as _module

from attnlab import decode_cpu, matvec
from attnlab.kv_cache import KVCache
from attnlab.rope import RotaryEmbedding

if TYPE_CHECKING:
    from attnlab.attention import MultiHeadAttention

# MultiHeadAttention's steps the native call stands for, checks included: a subclass that
# overrides one (MultiHeadAttention._steps_as_written) or an instance that replaces one gets
# the Python path (its own steps and checks)
STEPS = (
    "_attend",
    "_project",
    "_split_heads",
    "_attention_mask",
    "_check_input",
    "_check_cache",
    "_check_mask",
    "_check_layers",
    "_start_position",
)
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = tuple(
    getattr(_module, f"_global{name}")
    for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
)


def no_global_hooks() -> bool:
    """True when no global module hook (torch.nn.modules.module.register_module_*_hook) is
    registered: a fast path that computes a layer without calling it would skip them."""
    return not any(_GLOBAL_HOOKS)


def plain_linear(layer: object, shape: tuple[int | None, int]) -> bool:
    """True when `layer` is exactly an nn.Linear (not a subclass, wrapper or parametrized
    layer) of weight `shape` (out, in; out None: any width), contiguous, with no bias or a
    bias of its output width, and no hook of its own: what a fast path computes in its
    place is then what calling it gives, global hooks aside (no_global_hooks)."""
    if type(layer) is not nn.Linear:
        return False
    state = layer.__dict__  # attribute reads without nn.Module.__getattr__: paid per call
    if (
        state["_forward_hooks"]
        or state["_forward_pre_hooks"]
        or state["_backward_hooks"]
        or state["_backward_pre_hooks"]
    ):
        return False
    weight, bias = state["_parameters"]["weight"], state["_parameters"]["bias"]
    if weight is None or weight.dim() != 2 or not weight.is_contiguous():
        return False
    out, features = shape
    if weight.shape[1] != features or (out is not None and weight.shape[0] != out):
        return False
    return bias is None or (bias.shape == weight.shape[:1] and bias.is_contiguous())


def blocked_projection(x: torch.Tensor, layer: object, shape: tuple[int | None, int]) -> bool:
    """Whether matvec.linear may compute `layer(x)` for x (..., in): a plain nn.Linear of
    `shape`, no global hooks, and matvec faster for x's rows (outside compilation, which
    fuses the projection itself and must not see the row count as a guard)."""
    if torch.compiler.is_compiling() or not plain_linear(layer, shape) or not no_global_hooks():
        return False
    return matvec.helps(x, layer.weight)


def project(x: torch.Tensor, layer: nn.Module, shape: tuple[int | None, int]) -> torch.Tensor:
    """layer(x), computed by matvec.linear where blocked_projection allows, else by calling
    the layer as it is (its hooks, subclass or wrapper included).

    Args:
        x: (..., in).
        layer: the projection, any module.
        shape: the (out, in) weight the module expects of it (out None: any width).

    Returns:
        layer(x).
    """
    if blocked_projection(x, layer, shape):
        return matvec.linear(x, layer.weight, layer.bias)
    return layer(x)


def native_module(module: MultiHeadAttention) -> tuple[nn.Linear, nn.Linear] | None:
    """The fused projection and the output projection when the module as it is now suits
    the native decode step, else None: backend "auto", causal, no dropout applied, a
    head_dim that is a multiple of 4, its own steps and rotary embedding, and plain float32
    CPU projections of exactly its shapes, with no hooks."""
    if module.backend != "auto" or not module.causal or (module.training and module.dropout > 0):
        return None
    if module.head_dim % 4 or not module.fused or not type(module)._steps_as_written():
        return None
    if any(step in module.__dict__ for step in STEPS):  # a method replaced on the instance
        return None
    layers = module._modules
    qkv, out = layers.get("qkv_proj"), layers.get("out_proj")
    d_qkv = module.d_out + 2 * module.kv_dim
    if not plain_linear(qkv, (d_qkv, module.d_in)):
        return None
    if not plain_linear(out, (module.d_out, module.d_out)) or not no_global_hooks():
        return None
    if not (_float32_cpu(qkv) and _float32_cpu(out)):
        return None
    rope = layers.get("rope")
    if rope is not None and not _own_rope(rope, module.head_dim):
        return None
    return qkv, out


def _float32_cpu(layer: nn.Linear) -> bool:
    weight, bias = layer._parameters["weight"], layer._parameters["bias"]
    if weight.dtype != torch.float32 or not weight.is_cpu:
        return False
    return bias is None or (bias.dtype == torch.float32 and bias.is_cpu)


def native_decode(
    module: MultiHeadAttention, x: torch.Tensor, cache: KVCache
) -> tuple[nn.Linear, nn.Linear] | None:
    """The projections for the native decode step when module(x, cache=cache), already
    checked by forward, can take it: one float32 token per sequence on the CPU, a cache the
    kernel reads and may write (its dtype and window, room left), rope tables covering the
    position, no autocast, tracing or autograd recording; else None."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():  # traces take the Python path
        return None
    if x.shape[1] != 1 or x.dtype != torch.float32 or not x.is_cpu:
        return None
    if torch.is_autocast_enabled("cpu") or type(cache) is not KVCache:
        return None
    if torch.is_grad_enabled() and module._records_grad(x):  # as forward judges it
        return None
    layers = native_module(module)
    if layers is None or not _cache_suits(module, cache):
        return None
    rope = module._modules.get("rope")
    if rope is not None and cache.position >= rope.cos.shape[0]:
        return None
    return layers if decode_cpu.available() else None


def _cache_suits(module: MultiHeadAttention, cache: KVCache) -> bool:
    """The cache's dtype, window, room and writability for the kernel."""
    keys = cache.keys_t
    if not decode_cpu.reads(keys.dtype, keys.device) or cache.records_grad:
        return False
    if cache.locked_by_inference_mode:
        return False  # forward refuses to write it: never written behind its back
    if cache.window is not None and cache.window != module.window:
        return False  # a wider window: the Python path
    return cache.rolling or cache.position < cache.capacity


def _own_rope(rope: object, head_dim: int) -> bool:
    """attnlab's RotaryEmbedding, of head_dim, with float32 contiguous CPU tables."""
    if type(rope) is not RotaryEmbedding or any(getattr(rope, name) for name in _HOOKS):
        return False
    cos, sin = rope.cos, rope.sin
    return (
        cos.dim() == 2
        and cos.shape[1] == head_dim
        and cos.shape == sin.shape
        and cos.dtype == sin.dtype == torch.float32
        and cos.is_cpu
        and cos.is_contiguous()
        and sin.is_contiguous()
    )
