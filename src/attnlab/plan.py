"""The call plan: which executor runs a MultiHeadAttention call after forward's checks, and
how each projection runs.

attnlab's fast paths stand beside the reference (the module's own Python path, which calls
its submodules): the native decode step (decode_cpu: projections, rotary positions, cache
append, attention and output projection in one C++ call) and the blocked small-row product
(matvec). A fast path computes a layer without calling it, so it is taken only for a
pristine state, stated positively and checked on every call (attribute reads and
comparisons): each projection is exactly an `nn.Linear` of the expected shapes whose
instance holds nothing a fresh `nn.Linear` does not (no instance `forward` or `__call__`, as
accelerate's hooks and many adapters attach, no attribute of its own), whose `weight` and
`bias` are registered `nn.Parameter`s, with no hook of any kind, local or global, forward or
backward; the code they run torch's own as torch wrote it (nn.Linear's forward and call
machinery, F.linear: no class-level patch, made before or after attnlab was imported); the
rotary embedding and the query/key norms are exactly attnlab's, in the same sense, with
tables long enough; the module's own code (no subclass override of any method
MultiHeadAttention defines, no instance or class-level patch); inputs, weights and tables
plain tensors (no subclass, no lazily negated view); no torch function mode or dispatch mode
active (op-level instrumentation, FlopCounter-like tools, quantisation and sharding
frameworks, FakeTensorMode), no torch.func transform or forward-mode AD level; float32 on
the CPU; no autocast, tracing or autograd recording. Anything else, whatever the user did to
the module, takes the reference path, which calls the submodules as they are.

What the fast paths stand for is what the module calls (its layers and their code). The
attention itself (scores, softmax, weighted values) is attnlab's own arithmetic: a patch of
a torch function it happens to use on the Python path (torch.softmax, Tensor.__matmul__)
changes that path's arithmetic and not the native step's, and is outside this contract.

Checking on every call is the plan's invalidation: nothing the user changes (a submodule
replaced, a parameter swapped or reshaped, a hook added, the rope tables, dtype, device,
autocast, grad mode) can go unseen, and the checks cost a few attribute reads.

The decode step's plan is also read in C++ (decode_lane, csrc/decode_plan.h), where its
checks cost about 2 us instead of about 25: forward asks it first for a one-token cached
call, and what it does not take goes on to forward's checks and native_decode here, which
stay the reference it is tested against (it takes a call only where they would).
"""

from __future__ import annotations

import functools
import operator
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules import linear as _linear
from torch.nn.modules import module as _module

from attnlab import debug, decode_cpu, matvec
from attnlab.kv_cache import KVCache
from attnlab.kv_cache import code_as_written as cache_code_as_written
from attnlab.latent_cache import LatentCache
from attnlab.latent_cache import code_as_written as latent_cache_code_as_written
from attnlab.norms import RMSNorm
from attnlab.norms import code_as_written as norm_code_as_written
from attnlab.rope import RotaryEmbedding
from attnlab.rope import code_as_written as rope_code_as_written

if TYPE_CHECKING:
    from attnlab.attention import MultiHeadAttention
    from attnlab.mla import MultiHeadLatentAttention

_LINEAR_TENSORS = frozenset({"weight", "bias"})
_ROPE_TENSORS = frozenset({"cos", "sin"})
_NORM_TENSORS = frozenset({"weight"})
_FLOAT32_MAX = torch.finfo(torch.float32).max
_GLOBAL_HOOKS = tuple(
    getattr(_module, f"_global{name}")
    for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
)


# torch's code a fast path stands for when it computes a projection without calling it: the
# class's call machinery and forward, and F.linear. Read at import and checked to be torch's
# own (defined in torch's files: a patch made before attnlab was imported counts too); on
# every call compared by identity, so that a class-level patch (stable-diffusion-webui's LoRA
# sets nn.Linear.forward; profilers wrap nn.Module.__call__; F.linear replaced) takes the
# Python path, which runs it
_LINEAR_NAMES = ("forward", "__call__", "_call_impl", "_wrapped_call_impl")
_LINEAR_CODE = operator.attrgetter(*_LINEAR_NAMES)
_LINEAR_AS_IMPORTED = _LINEAR_CODE(nn.Linear)
_F_LINEAR = torch._C._nn.linear
_TORCH_FILES = {"forward": _linear.__file__}


def _is_torchs(function: object, name: str) -> bool:
    code = getattr(function, "__code__", None)
    return code is not None and code.co_filename == _TORCH_FILES.get(name, _module.__file__)


_LINEAR_IS_TORCHS = all(
    _is_torchs(function, name)
    for function, name in zip(_LINEAR_AS_IMPORTED, _LINEAR_NAMES, strict=True)
)


def linear_code_as_torch_wrote_it() -> bool:
    """True when nn.Linear's forward and call machinery and F.linear are torch's own, as
    attnlab found them at import (a class-level patch of any of them is False)."""
    return (
        _LINEAR_IS_TORCHS
        and F.linear is _F_LINEAR
        and _LINEAR_CODE(nn.Linear) == _LINEAR_AS_IMPORTED
    )


def no_global_hooks() -> bool:
    """True when no global module hook (torch.nn.modules.module.register_module_*_hook) is
    registered: a fast path that computes a layer without calling it would skip them."""
    return not any(_GLOBAL_HOOKS)


def no_active_modes() -> bool:
    """True when no torch function mode and no dispatch mode (FakeTensorMode included) is
    active: a fast path's C++ or blocked kernels would run beneath them unseen."""
    return not (torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack())


@functools.cache
def _fresh_state(module_class: type) -> frozenset[str]:
    """The instance attributes a freshly made object of `module_class` holds (nn.Linear,
    attnlab's RotaryEmbedding and RMSNorm, KVCache): anything beyond them is the user's or a
    tool's."""
    # on meta: no random draw (the first forward's dropout stays what the seed gives)
    fresh = {
        nn.Linear: lambda: nn.Linear(1, 1, device="meta"),
        RotaryEmbedding: lambda: RotaryEmbedding(2, 1),
        RMSNorm: lambda: RMSNorm(1, device="meta"),
        KVCache: lambda: KVCache(1, 1, 1, 1, device="meta"),
        LatentCache: lambda: LatentCache(1, 1, 1, 0, device="meta"),
    }[module_class]()
    return frozenset(fresh.__dict__)


@functools.cache
def _fresh_latent_state() -> frozenset[str]:
    """The instance attributes a fresh MultiHeadLatentAttention holds, with and without
    low-rank queries, latent norms and rotary dims."""
    from attnlab.mla import MultiHeadLatentAttention  # mla imports this module

    made = (  # on meta: no random draw
        MultiHeadLatentAttention(4, 1, None, 2, 2, 2, 2, 4, device="meta"),
        MultiHeadLatentAttention(4, 1, 2, 2, 2, 0, 2, 4, latent_norm=False, device="meta"),
    )
    return frozenset().union(*(module.__dict__ for module in made))


@functools.cache
def _fresh_attention_state() -> frozenset[str]:
    """The instance attributes a fresh MultiHeadAttention holds, with and without rope and
    query/key norms."""
    from attnlab.attention import MultiHeadAttention  # attention imports this module

    plain, rotary = (
        MultiHeadAttention(4, 4, 4, 0.0, 1, device="meta"),  # meta: no random draw
        MultiHeadAttention(4, 4, 4, 0.0, 1, rope=True, qk_norm="head", device="meta"),
    )
    return frozenset(plain.__dict__) | frozenset(rotary.__dict__)


def _pristine(layer: nn.Module, module_class: type, tensors: str, names: set[str]) -> bool:
    """`layer` is exactly `module_class`, holds no attribute a fresh one does not, no hook,
    and exactly `names` in its `tensors` dict (_parameters or _buffers)."""
    if type(layer) is not module_class:
        return False
    state = layer.__dict__  # attribute reads without nn.Module.__getattr__: paid per call
    if not state.keys() <= _fresh_state(module_class):
        return False  # an instance forward or __call__ (accelerate's hooks), any extra
    if (
        state["_forward_hooks"]
        or state["_forward_pre_hooks"]
        or state["_backward_hooks"]
        or state["_backward_pre_hooks"]
    ):  # each hook dict, spelled out: a generator costs a microsecond per call
        return False
    return state[tensors].keys() == names


def pristine_linear(layer: object) -> bool:
    """True when `layer` is exactly an nn.Linear holding nothing a fresh one does not, with
    no hook, `weight` and `bias` registered parameters (of any shape, dtype or type), and
    nn.Linear's code and F.linear torch's own (linear_code_as_torch_wrote_it)."""
    return _pristine(layer, nn.Linear, "_parameters", _LINEAR_TENSORS) and (
        linear_code_as_torch_wrote_it()
    )


def plain_linear(layer: object, shape: tuple[int | None, int]) -> bool:
    """True when `layer` is a pristine nn.Linear (_pristine: not a subclass, wrapper or
    parametrized layer, no instance forward, no hook of its own; nn.Linear's code torch's
    own) of weight `shape` (out, in; out None: any width), its weight and bias registered
    nn.Parameters (not a tensor subclass, not a lazily negated view), the weight contiguous,
    no bias or one of its output width: what a fast path computes in its place is then what
    calling it gives, global hooks and modes aside (no_global_hooks, no_active_modes)."""
    return linear_code_as_torch_wrote_it() and _plain_tensors(layer, shape) is not None


def _plain_tensors(layer: object, shape: tuple[int | None, int]) -> tuple | None:
    """plain_linear's layer checks but nn.Linear's code (the caller's): its (weight, bias),
    else None."""
    if not _pristine(layer, nn.Linear, "_parameters", _LINEAR_TENSORS):
        return None
    parameters = layer.__dict__["_parameters"]
    weight, bias = parameters["weight"], parameters["bias"]
    if type(weight) is not nn.Parameter or not weight.is_contiguous() or weight.is_neg():
        return None  # a lazily negated view (torch._neg_view): kernels read its memory
    if bias is not None and (type(bias) is not nn.Parameter or bias.is_neg()):
        return None
    out, features = shape
    if out is None:  # any width: the weight's own (torch.Size comparisons: one call each)
        if weight.dim() != 2 or weight.shape[1] != features:
            return None
        out = weight.shape[0]
    elif weight.shape != shape:
        return None
    if bias is None or (bias.shape == (out,) and bias.is_contiguous()):
        return weight, bias
    return None


def check_projection_dtype(name: str, layer: object, x: torch.Tensor) -> None:
    """Raise unless a pristine nn.Linear's weight and bias (pristine_linear: nothing that
    could cast or move its input, as accelerate's offloading hooks do) are in x's dtype
    (unless autocast casts) and on its device: else F.linear's raw dtype or device
    RuntimeError would be the user's message.

    Args:
        name: the projection's name, for the message.
        layer: the projection, any module (only a pristine nn.Linear is judged).
        x: the module's input.

    Raises:
        ValueError: a weight or bias on another device than x.
        TypeError: a weight or bias in another dtype than x, outside autocast.
    """
    if torch.compiler.is_compiling():  # a mismatch fails the trace itself
        return
    if _in_dtype_and_device_of(layer, x):  # first: the usual case, nothing to name
        return
    if not pristine_linear(layer) or not no_active_modes():
        return
    for part in ("weight", "bias"):
        tensor = getattr(layer, part)
        if tensor is None:
            continue
        if tensor.device != x.device:
            raise ValueError(f"{name}'s {part} is on {tensor.device} but x is on {x.device}")
        if tensor.dtype == x.dtype:
            continue
        if not torch.is_autocast_enabled(x.device.type) or tensor.dtype == torch.float64:
            raise TypeError(  # autocast casts float32 parameters, never float64 ones
                f"{name}'s {part} is {tensor.dtype} but the module computes in {x.dtype} (x's "
                f"and its first projection's dtype): convert the whole module, e.g. "
                f"module.to({x.dtype})"
            )


def _in_dtype_and_device_of(layer: object, x: torch.Tensor) -> bool:
    """True when `layer` is exactly an nn.Linear whose registered weight and bias (read from
    its parameter dict: no property or parametrization runs) are nn.Parameters in x's dtype
    and on its device: then check_projection_dtype has nothing to raise, pristine or not."""
    if type(layer) is not nn.Linear:
        return False
    parameters = layer.__dict__.get("_parameters", {})
    weight, bias = parameters.get("weight"), parameters.get("bias")
    dtype, device = x.dtype, x.device
    for tensor in (weight,) if bias is None else (weight, bias):
        if type(tensor) is not nn.Parameter or tensor.dtype != dtype or tensor.device != device:
            return False
    return True


def blocked_projection(x: torch.Tensor, layer: object, shape: tuple[int | None, int]) -> bool:
    """Whether matvec.linear may compute `layer(x)` for x (..., in): a plain nn.Linear of
    `shape`, no global hooks, and matvec faster for x's rows (outside compilation, which
    fuses the projection itself and must not see the row count as a guard)."""
    if torch.compiler.is_compiling():  # before any test of the rows: it would be a guard
        return False
    if type(x) is not torch.Tensor or not matvec.few_rows(x):  # then: a GPU's x, a prompt's
        return False
    if not plain_linear(layer, shape) or not no_global_hooks():
        return False
    return no_active_modes() and matvec.helps(x, layer.weight)


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


def native_module(module: MultiHeadAttention) -> decode_cpu.Weights | None:
    """The tensors the native decode step reads (decode_cpu.Weights) when the module as it
    is now suits it, else None: backend "auto", causal, no dropout applied, its own steps,
    rotary embedding and query/key norms, and plain float32 CPU projections of exactly its
    shapes (the output projection of any width), with no hooks."""
    state = module.__dict__  # attribute reads without nn.Module.__getattr__: paid per call
    d_in, d_out = state["d_in"], state["d_out"]
    head_dim = d_out // state["num_heads"]  # the properties head_dim, kv_dim, fused
    if state["backend"] != "auto" or not state["causal"] or state["context_dim"] != d_in:
        return None
    if state["training"] and state["dropout"] > 0:
        return None
    if not type(module)._steps_as_written() or not state.keys() <= _fresh_attention_state():
        return None  # a subclass's step; the instance's own step or attribute (forward...)
    if not _fields_as_read():
        return None  # a class attribute over a field read below (a property on nn.Linear...)
    layers = state["_modules"]
    if not no_global_hooks() or not linear_code_as_torch_wrote_it():
        return None
    qkv_weight, qkv_bias = _float32_linear(
        layers.get("qkv_proj"), (d_out + 2 * state["num_kv_heads"] * head_dim, d_in)
    )
    out_weight, out_bias = _float32_linear(layers.get("out_proj"), (None, d_out))  # any width
    if qkv_weight is None or out_weight is None:
        return None
    rope = layers.get("rope")
    if "rope" not in layers and state.get("rope", 0) is not None:
        return None  # deleted: the module's own read of it raises
    none = decode_cpu.EMPTY
    cos, sin = (none, none) if rope is None else _own_rope_tables(rope, head_dim)
    if cos is None:
        return None
    weights = decode_cpu.Weights(qkv_weight, qkv_bias, out_weight, out_bias, cos, sin)
    if state["qk_norm"] is None:
        return weights
    per_head = state["qk_norm"] == "head"
    return _with_own_norms(
        weights,
        layers.get("q_norm"),
        layers.get("k_norm"),
        head_dim if per_head else d_out,
        head_dim if per_head else state["num_kv_heads"] * head_dim,
    )


def _with_own_norms(
    weights: decode_cpu.Weights, q_norm: object, k_norm: object, q_dim: int, k_dim: int
) -> decode_cpu.Weights | None:
    """weights with the query and key norms' weights, eps and offset when both are
    attnlab's own RMSNorm, pristine (_pristine), over q_dim and k_dim features, with one eps
    and one offset between them (floats within float32's range) and float32 contiguous CPU
    weights; else None."""
    if not norm_code_as_written():
        return None  # a class-level patch of its forward
    q_own, k_own = _own_norm(q_norm, q_dim), _own_norm(k_norm, k_dim)
    if q_own is None or k_own is None or q_own[1:] != k_own[1:]:
        return None  # the kernel takes one eps and one offset for both
    (q_weight, eps, offset), k_weight = q_own, k_own[0]
    return weights._replace(q_norm=q_weight, k_norm=k_weight, norm_eps=eps, norm_offset=offset)


def _own_norm(norm: object, dim: int) -> tuple[torch.Tensor, float, float] | None:
    """(weight, eps, offset) of a pristine attnlab RMSNorm over `dim` features
    (_own_norm_weight) whose eps and offset are floats within float32's range; else None.
    RMSNorm's code is the caller's to check (norm_code_as_written)."""
    weight = _own_norm_weight(norm, dim)
    if weight is None:
        return None
    state = norm.__dict__  # a deleted one: the norm's own error on the Python path
    eps, offset = state.get("eps"), state.get("offset")
    if type(eps) is not float or type(offset) is not float:
        return None  # set to something else since construction checked them
    if eps > _FLOAT32_MAX or abs(offset) > _FLOAT32_MAX:
        return None  # past what the kernel's float32 holds: the Python path computes it
    return weight, eps, offset


def _own_norm_weight(norm: object, dim: int) -> torch.Tensor | None:
    """The weight of a pristine attnlab RMSNorm over `dim` features, a registered float32
    contiguous CPU parameter of shape (dim,) (no subclass, no negated view); else None."""
    if not _pristine(norm, RMSNorm, "_parameters", _NORM_TENSORS):
        return None
    weight = norm.__dict__["_parameters"]["weight"]
    suits = (
        type(weight) is nn.Parameter
        and weight.shape == (dim,)
        and weight.dtype is torch.float32
        and weight.is_cpu
        and weight.is_contiguous()
        and not weight.is_neg()
    )
    return weight if suits else None


def latent_tables(
    norm: object, rope: object, r: int, dr: int, position: int
) -> decode_cpu.LatentTables | None:
    """What multi-head latent attention's native step reads in place of its latent norm
    and rotary embedding, when each is None or attnlab's own, pristine: RMSNorm over r
    features (_own_norm), RotaryEmbedding of dr features with float32 CPU tables covering
    `position` (_own_rope_tables); else None.

    Args:
        norm: the module's kv_a_layernorm.
        rope: its rotary embedding.
        r: kv_lora_rank.
        dr: qk_rope_head_dim.
        position: the token's position.

    Returns:
        decode_cpu.LatentTables (empty tensors for an absent norm or rope), or None.
    """
    none = decode_cpu.EMPTY
    own = (none, 1e-6, 0.0)  # no norm: an empty weight (eps and offset unread)
    if norm is not None:
        own = _own_norm(norm, r) if norm_code_as_written() else None
        if own is None:
            return None
    cos = sin = none
    if rope is not None:
        cos, sin = _own_rope_tables(rope, dr)
        if cos is None or cos.shape[0] <= position:
            return None
    return decode_cpu.LatentTables(*own, cos, sin)


def _float32_linear(
    layer: object, shape: tuple[int | None, int]
) -> tuple[torch.Tensor | None, ...]:
    """A plain_linear's weight and bias (empty for none) when both are float32 on the CPU,
    else (None, None); nn.Linear's code is the caller's to check (once per call)."""
    tensors = _plain_tensors(layer, shape)
    if tensors is None:
        return None, None
    weight, bias = tensors
    if weight.dtype is not torch.float32 or not weight.is_cpu:
        return None, None
    if bias is None:
        return weight, decode_cpu.EMPTY
    return (weight, bias) if bias.dtype is torch.float32 and bias.is_cpu else (None, None)


def native_decode(
    module: MultiHeadAttention, x: torch.Tensor, cache: KVCache
) -> decode_cpu.Weights | None:
    """The tensors for the native decode step when module(x, cache=cache), already checked
    by forward, can take it: one float32 token per sequence on the CPU, a cache the kernel
    reads and may write (its dtype and window, room left), rope tables covering the
    position, no autocast, tracing or autograd recording; else None."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():  # traces take the Python path
        return None
    if x.shape[1] != 1 or x.dtype != torch.float32 or not x.is_cpu or type(x) is not torch.Tensor:
        return None
    if x.is_neg():  # a lazily negated view: the kernel reads its memory
        return None
    if not no_active_modes() or debug.under_transform():  # wrappers, dual tensors
        return None
    if torch.is_autocast_enabled("cpu") or type(cache) is not KVCache:
        return None
    if torch.is_grad_enabled() and module._records_grad(x):  # as forward judges it
        return None
    weights = native_module(module)
    if weights is None or not _cache_suits(module, cache):
        return None
    if weights.cos.numel() and cache.position >= weights.cos.shape[0]:
        return None  # past the rotary tables: the Python path raises forward's error
    return weights if decode_cpu.available() else None


def decode_lane(module: MultiHeadAttention, x: object, cache: object) -> torch.Tensor | None:
    """module(x, cache=cache) through the native decode step when its plan, read in C++
    (csrc/decode_plan.h), takes the call, else None, with nothing written.

    It takes a call only where forward's checks would pass and native_decode would take it,
    and beyond them only for exact classes (MultiHeadAttention, KVCache) and no gradient
    mode; a step that is not finite, or whose float32 arithmetic overflowed, is None too,
    with a rolling cache's overwritten slot put back. Forward asks it first (outside
    compilation, where its caller checks), for a call with a cache and no context, mask or
    weights.

    Args:
        module: the MultiHeadAttention called.
        x: its input, any object (the lane reads exact tensors only).
        cache: the cache given, any object.

    Returns:
        The output (b, 1, width), or None.
    """
    lane = _lane()
    return None if lane is None else lane(module, x, cache)


def _fields_as_read() -> bool:
    """True when the native step is built and no watched class (MultiHeadAttention,
    nn.Linear and nn.Module, RotaryEmbedding, RMSNorm, KVCache) holds a class attribute over
    a field the plans read from instances' dictionaries (a property Python's reads would
    run instead), nor another __getattribute__ or __getattr__: the extension's check, made
    again only when a class changes (csrc/decode_plan.h)."""
    return _lane() is not None and decode_cpu.binding().classes_as_written()


def latent_lane(module: MultiHeadLatentAttention, x: object, cache: object) -> torch.Tensor | None:
    """module(x, cache=cache) through multi-head latent attention's native step, its plan read
    in C++ (csrc/latent_plan.h), else None with the position unmoved.

    It takes a call only where forward's checks would pass and the module's Python path
    would take the native step (MultiHeadLatentAttention._native_tables, absorbed by the
    default rule), and beyond them only for exact classes (MultiHeadLatentAttention,
    LatentCache), no gradient mode and layers of sizes under 2^20 (the rule's products in
    64 bits); it computes the projections too. A step that is not finite is None (the
    Python path then computes it, or names the overflow). Forward asks it first (outside
    compilation), for a call with a cache and no mask, weights or absorb given. It never
    starts the extension's build: make_cache does, for a float32 CPU module.

    Args:
        module: the MultiHeadLatentAttention called.
        x: its input, any object (the lane reads exact tensors only).
        cache: the cache given, any object.

    Returns:
        The output (b, 1, d_model), or None.
    """
    if not decode_cpu.loaded():
        return None
    return _lanes().latent_lane(module, x, cache)


def _lane():
    """The extension's decode_lane, set up (_lanes), or None without the extension."""
    lanes = _lanes()
    return None if lanes is None else lanes.decode_lane


@functools.cache
def _lanes():
    """The extension, its lanes set up with this module's references (the classes whose code
    the fast paths stand for, their tests and fresh attributes), or None without it."""
    if not decode_cpu.available():
        return None
    from attnlab.attention import _AS_DEFINED, MultiHeadAttention
    from attnlab.mla import _AS_DEFINED as _LATENT_AS_DEFINED
    from attnlab.mla import MultiHeadLatentAttention

    binding = decode_cpu.binding()
    binding.plan_setup(
        (
            MultiHeadAttention,
            nn.Linear,
            RotaryEmbedding,
            RMSNorm,
            KVCache,
            MultiHeadLatentAttention,
            LatentCache,
        ),
        (
            functools.partial(_AS_DEFINED, MultiHeadAttention),
            linear_code_as_torch_wrote_it,
            rope_code_as_written,
            norm_code_as_written,
            cache_code_as_written,
            functools.partial(_LATENT_AS_DEFINED, MultiHeadLatentAttention),
            latent_cache_code_as_written,
        ),
        (
            _fresh_attention_state(),
            _fresh_state(nn.Linear),
            _fresh_state(RotaryEmbedding),
            _fresh_state(RMSNorm),
            _fresh_state(KVCache),
            _fresh_latent_state(),
            _fresh_state(LatentCache),
        ),
        nn.Parameter,
        torch.Tensor,
        _GLOBAL_HOOKS,
        F,
        _F_LINEAR,
        torch.autograd.forward_ad,
    )
    return binding


def _cache_suits(module: MultiHeadAttention, cache: KVCache) -> bool:
    """The cache's dtype, window, room and writability for the kernel."""
    keys = cache.keys_t
    if not cache.tokens_last or not decode_cpu.reads_buffer(keys) or cache.records_grad:
        return False
    if cache.locked_by_inference_mode:
        return False  # forward refuses to write it: never written behind its back
    if cache.window is not None and cache.window != module.window:
        return False  # a wider window: the Python path
    return cache.rolling or cache.position < cache.capacity


def _own_rope_tables(rope: object, head_dim: int) -> tuple[torch.Tensor | None, ...]:
    """(cos, sin) of attnlab's RotaryEmbedding, of head_dim, with float32 contiguous CPU
    tables and no hooks; else (None, None)."""
    if not _pristine(rope, RotaryEmbedding, "_buffers", _ROPE_TENSORS):
        return None, None
    if not rope_code_as_written():
        return None, None  # a class-level patch of its forward or tables
    buffers = rope.__dict__["_buffers"]
    cos, sin = buffers.get("cos"), buffers.get("sin")
    if type(cos) is not torch.Tensor or type(sin) is not torch.Tensor:
        return None, None  # not a table, or a tensor subclass (its memory is not its values)
    shape = cos.shape
    suits = (
        shape == sin.shape
        and len(shape) == 2
        and shape[1] == head_dim
        and cos.dtype is torch.float32
        and sin.dtype is torch.float32
        and cos.is_cpu
        and cos.is_contiguous()
        and sin.is_contiguous()
        and not (cos.is_neg() or sin.is_neg())
    )
    return (cos, sin) if suits else (None, None)
