"""Hugging Face transformers: attnlab as an attention implementation, and weight conversion
for GPT-2's attention layers and the Llama family's (Llama 3's scaled rotary, Mistral,
Qwen2, Qwen3, Gemma 3, OLMo 2: from_llama_attention, to_llama_attention, swap_attention).
transformers is an optional extra (`pip install 'attnlab[hf]'`), imported only here.

register() adds "attnlab" to transformers' AttentionInterface, so
`AutoModelForCausalLM.from_config(config, attn_implementation="attnlab")` (or
`model.set_attn_implementation("attnlab")`) runs every model that uses that interface on
attnlab.functional.attention, with masks in SDPA's boolean form (True = may attend, the
polarity attnlab uses) and output_attentions supported.

Right or refused, never silently wrong:

- every keyword argument transformers passes is implemented (IMPLEMENTED: attention sinks,
  relative-position bias, softcapping, output_attentions), known to be carried elsewhere
  (CARRIED, each with its reason), or refused with a ValueError naming it and the module
  (NOT_YET: sparse key selection, paged caches);
  an unknown keyword is refused too. `attention_arguments` is the one place that maps
  transformers' keywords to attention()'s.
- a model whose attention does not go through the interface (Bloom, Falcon, ... on
  transformers 5.24) is refused when it is built or switched to attnlab (see
  `bypassing_classes`), also where attnlab's function is registered under another name or
  wrapped (see `is_attnlab_attention`).

Shapes from transformers: query (b, h, tq, d), key and value (b, hkv, tk, d) (grouped-query
heads are passed unrepeated); the output goes back as (b, tq, h, d).
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
import warnings

import torch
from torch import nn
from torch.nn import functional as F

from attnlab import functional, masks, qkv
from attnlab.attention import MultiHeadAttention
from attnlab.mla import MultiHeadLatentAttention

NAME = "attnlab"
MARKER = "__attnlab_attention__"  # on attention_forward; functools.wraps copies it

# transformers' keywords attnlab need not act on: what each carries is already in the mask,
# in query and key, or outside attention. Each one has a test: attnlab == eager with it.
CARRIED = {
    "position_ids": "rotary positions are applied to query and key before the call",
    "sliding_window": "the window is already in the mask transformers builds",
    "use_cache": "the module updates its key/value cache before the call",
    "cache_position": "the module updates its key/value cache before the call",
    "cu_seq_lens_q": "flash-attention's form of packed sequences, which the mask holds",
    "cu_seq_lens_k": "flash-attention's form of packed sequences, which the mask holds",
    "max_length_q": "flash-attention's form of packed sequences, which the mask holds",
    "max_length_k": "flash-attention's form of packed sequences, which the mask holds",
    "deterministic": "flash-attention's switch for a deterministic backward pass",
    "output_hidden_states": "a model-level output flag",
    "output_router_logits": "a model-level output flag",
    "past_key_values": "the module updates its key/value cache before the call",
    "encoder_hidden_states": "a cross-attention layer projects its keys and values from it "
    "before the call; a self-attention layer (BERT's) receives it unused",
}

# transformers' keywords attention() implements: each mapped in attention_arguments, each
# tested against the eager implementation of a model that passes it
IMPLEMENTED = {
    "output_attentions": "need_weights (the weights eager returns)",
    "s_aux": "sinks: gpt-oss's learned per-head logit in the softmax's denominator",
    "sinks": "sinks: a per-head logit in the softmax's denominator",
    "position_bias": "added to the mask: T5's relative-position bias on the scores",
    "softcap": "softcap: Gemma 2's softcap * tanh(scores / softcap) before the mask",
}

# transformers' keywords that need an argument attention() does not have yet: refused when
# they carry a value. Supporting one = removing it here and mapping it in attention_arguments.
NOT_YET = {
    "indices": "sparse attention over the keys an indexer selected",
    "block_indices": "block-sparse attention over the key blocks an indexer selected",
    "cache": "a paged key/value cache to update (continuous batching)",
}


# why a model may declare no SDPA support that attnlab judges by keyword instead (sinks,
# softcapping): such a model is not refused wholesale for _supports_sdpa = False
SDPA_LACKS = ("s_aux", "sinks", "softcap")
_EXTENDS_MASK = re.compile(r"attention_mask = (torch\.cat|F\.pad|nn\.functional\.pad)\(")


def register(name: str = NAME) -> str:
    """Register attnlab's attention (and SDPA's boolean masks) under `name` and guard
    transformers' model construction against models that bypass the interface.

    Args:
        name: the attn_implementation name to register.

    Returns:
        `name`.
    """
    from transformers import AttentionInterface, PreTrainedModel
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    _guard(PreTrainedModel)
    return name


def attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention signature on attnlab.functional.attention.

    Args:
        module: the calling attention layer (its class names it in errors).
        query: (b, h, tq, d).
        key: (b, hkv, tk, d).
        value: (b, hkv, tk, dv).
        attention_mask: transformers' mask (it holds the causal pattern), or None.
        dropout: dropout probability, applied while the module trains.
        scaling: the score scale; None is 1 / sqrt(d).
        is_causal: None reads the module's is_causal.
        **kwargs: transformers' other keywords, each implemented, carried elsewhere or
            refused (see attention_arguments).

    Returns:
        The output (b, tq, h, dv) and the weights (b, h, tq, tk) when transformers records
        attentions, else None.

    Raises:
        ValueError: for a keyword attnlab does not support or does not know.
    """
    arguments = attention_arguments(module, query, key, attention_mask, kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal) and attention_mask is None and query.shape[2] > 1
    tk = key.shape[2]
    # transformers' mask skip assumes SDPA's top-left causal alignment: query i at position
    # i, so no query reaches past the last one's visible keys; attnlab's bottom-right causal
    # over those keys is then the same mask
    reached = masks.visible_keys(query.shape[2] - 1).stop if causal else tk
    if reached < tk:
        key, value = key.narrow(2, 0, reached), value.narrow(2, 0, reached)
    need_weights = arguments.pop("need_weights")
    if need_weights and arguments["sinks"] is not None:
        _note_sink_weights(module)
    result = functional.attention(
        query,
        key,
        value,
        causal=causal,
        scale=scaling,
        dropout_p=dropout,
        training=module.training,
        need_weights=need_weights,
        **arguments,
    )
    out, weights = result if need_weights else (result, None)
    if weights is not None and weights.shape[-1] < tk:  # the cut keys weigh nothing
        weights = F.pad(weights, (0, tk - weights.shape[-1]))  # (b, h, tq, tk)
    out = out.transpose(1, 2)  # (b, h, tq, d) -> (b, tq, h, d), contiguous as sdpa's
    if not out.is_contiguous():  # (SDPA's CUDA kernels often return it laid out so already)
        out = out.clone(memory_format=torch.contiguous_format)
    return out, weights


setattr(attention_forward, MARKER, True)


def attention_arguments(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    kwargs: dict,
) -> dict:
    """attention()'s keyword arguments (mask, need_weights) for transformers' `kwargs`: the
    one place a keyword is implemented, accepted as carried elsewhere (CARRIED) or refused.

    Args:
        module: the calling attention layer, named in errors.
        query: (b, h, tq, d), for the shapes of future per-head arguments.
        key: (b, hkv, tk, d).
        attention_mask: transformers' mask or None.
        kwargs: the keywords beyond attention_forward's named parameters.

    Returns:
        {"mask", "need_weights", "sinks", "softcap"} for attention(): the mask with any
        position_bias added, the sinks from s_aux (or sinks), softcap as given.

    Raises:
        ValueError: naming the keyword and the module, for one in NOT_YET with a value or
            one attnlab does not know.
    """
    for name, value in kwargs.items():
        if name in CARRIED or name in IMPLEMENTED:
            continue
        if name in NOT_YET:
            if value is None:
                continue
            raise ValueError(
                f"{_describe(module)} passes {name} ({NOT_YET[name]}), which attnlab's "
                f"attention does not support yet: use attn_implementation='eager' for it"
            )
        raise ValueError(
            f"{_describe(module)} passes the keyword argument {name!r}, which attnlab "
            f"neither implements nor knows to be carried elsewhere; refused rather than "
            f"ignored (transformers {_transformers_version()})"
        )
    need_weights = bool(kwargs.get("output_attentions", False)) or _attentions_requested()
    sinks = kwargs.get("s_aux") if kwargs.get("s_aux") is not None else kwargs.get("sinks")
    return {
        "mask": _with_bias(attention_mask, kwargs.get("position_bias")),
        "need_weights": need_weights,
        "sinks": sinks,
        "softcap": kwargs.get("softcap"),
    }


def _with_bias(mask: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor | None:
    """transformers' mask with an additive bias (T5's relative positions, (1|b, h, tq, tk))
    added: one additive float mask, -inf where the boolean mask blocks."""
    if bias is None:
        return mask
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return bias.masked_fill(mask.logical_not(), -torch.inf)  # (b, h, tq, tk)
    return bias + mask.to(bias.dtype)


def _describe(module: nn.Module) -> str:
    """'GptOssAttention (model type gpt_oss)': the module class and its model, for errors."""
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    return type(module).__name__ + (f" (model type {model_type})" if model_type else "")


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _attentions_requested() -> bool:
    """True while a transformers model records attention weights (output_attentions=True):
    transformers 5 collects them with hooks instead of passing the flag down."""
    try:
        from transformers.utils.output_capturing import _active_collector

        collected = _active_collector.get()
    except (ImportError, AttributeError, LookupError):
        return False
    return isinstance(collected, dict) and "attentions" in collected


_COMPUTES_ATTENTION = re.compile(r"(?i)softmax\(|scaled_dot_product_attention|flash_attn")
_USES_INTERFACE = re.compile(r"ALL_ATTENTION_FUNCTIONS|attention_interface")
_ATTENTION_CLASS = re.compile(r"Attention|Attn")


def bypassing_classes(model: nn.Module) -> list[str]:
    """The classes of `model`'s modules that compute attention themselves (a softmax, SDPA or
    flash-attention call) instead of looking up transformers' attention interface: parts of
    the model attn_implementation="attnlab" would not reach.

    Args:
        model: a built transformers model (any nn.Module).

    Returns:
        The class names, sorted; empty when all its attention goes through the interface.
    """
    classes = {type(sub) for sub in model.modules()}
    return sorted(klass.__name__ for klass in classes if _computes_attention_itself(klass))


@functools.cache
def _computes_attention_itself(klass: type) -> bool:
    """True for a transformers attention class (or one it inherits from) whose source
    computes attention without the interface."""
    chain = [
        c
        for c in klass.__mro__
        if c.__module__.startswith("transformers.") and _ATTENTION_CLASS.search(c.__name__)
    ]
    source = "".join(_source(c) for c in chain)
    return bool(_COMPUTES_ATTENTION.search(source)) and not _USES_INTERFACE.search(source)


@functools.cache
def _module_bypasses(module_name: str) -> tuple[str, ...]:
    """Before a model is built: its modeling module's attention classes when no code there
    looks up the interface (Bloom, GPT-J, Falcon: the whole model bypasses it)."""
    module = sys.modules.get(module_name)
    source = _source(module) if module is not None else ""
    if _USES_INTERFACE.search(source):
        return ()
    classes = (obj for obj in vars(module).values() if isinstance(obj, type)) if module else ()
    return tuple(
        sorted(
            klass.__name__
            for klass in classes
            if klass.__module__ == module_name
            and issubclass(klass, nn.Module)
            and _computes_attention_itself(klass)
        )
    )


def _source(obj: object) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):  # built-in or source not shipped
        return ""


def _uses_attnlab(implementation: object) -> bool:
    """True when an attn_implementation (a name, or a dict of them per sub-config) asks for
    attnlab's attention_forward, or a wrapper of it, under any registered name."""
    if isinstance(implementation, dict):
        return any(_uses_attnlab(value) for value in implementation.values())
    if not isinstance(implementation, str):
        return False
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    function = ALL_ATTENTION_FUNCTIONS.get(implementation.removeprefix("paged|"))
    return function is not None and is_attnlab_attention(function)


_WRAPPER_DEPTH = 4  # wrappers of wrappers followed before a function counts as not attnlab's


def is_attnlab_attention(function: object) -> bool:
    """True when `function` is attnlab's attention_forward or a wrapper of it, so that a
    model built with it is guarded like one built with "attnlab".

    Recognised, up to four wrappers deep: attention_forward itself; anything carrying the
    marker attribute `__attnlab_attention__` (functools.wraps copies it); a `__wrapped__`
    chain; a functools.partial; a bound method's function; and a plain function that names
    attnlab's function among its closure variables or the globals its code reads
    (`def logged(*a, **k): return fn(*a, **k)`). A function that looks attnlab's up at call
    time (from the interface, by name) cannot be recognised before it runs.

    Args:
        function: a callable registered in transformers' AttentionInterface.

    Returns:
        Whether it runs attnlab's attention.
    """
    return _reaches_attnlab(function, _WRAPPER_DEPTH, set())


def _reaches_attnlab(function: object, depth: int, seen: set[int]) -> bool:
    if function is attention_forward or getattr(function, MARKER, False) is True:
        return True
    if depth == 0 or id(function) in seen or not callable(function):
        return False
    seen.add(id(function))
    return any(_reaches_attnlab(inner, depth - 1, seen) for inner in _wrapped_by(function))


def _wrapped_by(function: object) -> list:
    """The callables `function` may delegate to: its __wrapped__, a partial's func, a bound
    method's __func__, its closure's callables and the callable globals its code names."""
    inner = [getattr(function, name, None) for name in ("__wrapped__", "func", "__func__")]
    code, namespace = getattr(function, "__code__", None), getattr(function, "__globals__", {})
    cells = getattr(function, "__closure__", None) or ()
    inner += [_cell_contents(cell) for cell in cells]
    if code is not None:
        inner += [namespace.get(name) for name in code.co_names]
    return [f for f in inner if callable(f) and not isinstance(f, type)]


def _cell_contents(cell) -> object:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _refuse(model_class: type, classes: tuple[str, ...] | list[str]) -> None:
    if classes:
        raise ValueError(
            f"{model_class.__name__} computes attention in {', '.join(classes)} without "
            f"transformers' attention interface, so attn_implementation='attnlab' would not "
            f"run attnlab there and its masks would not fit: use {_supported(model_class)} "
            f"for it"
        )


def _supported(model_class: type) -> str:
    """The implementations to suggest instead: 'eager', and 'sdpa' where the model does
    not declare it unsupported (Bloom, GPT-Neo, MPT and XGLM do)."""
    if getattr(model_class, "_supports_sdpa", True) is False:
        return "'eager'"
    return "'eager' or 'sdpa'"


_NOTED_SINK_WEIGHTS: set[type] = set()


def _note_sink_weights(module: nn.Module) -> None:
    """Once per attention class: attnlab's weights with sinks leave the sink's share out
    (each row sums to 1 minus it, as gpt-oss's eager returns them), while some models'
    eager return the weights before the sink (GraniteSWA's rows sum to 1)."""
    if type(module) in _NOTED_SINK_WEIGHTS:
        return
    _NOTED_SINK_WEIGHTS.add(type(module))
    warnings.warn(
        f"{_describe(module)}: attnlab's output_attentions with attention sinks leave the "
        f"sink's share out, so each row sums to less than 1 (gpt-oss's eager convention); "
        f"a model whose eager returns the weights before the sink (GraniteSWA) sums each "
        f"row to 1. The outputs are the same either way.",
        stacklevel=2,
    )


def _refuse_without_sdpa(model_class: type) -> None:
    """attnlab takes SDPA's conventions (boolean masks, a skipped causal mask read as the
    module's is_causal); a model that declares it cannot run on SDPA (NLLB-MoE's decoder
    is not marked causal) is refused, unless what SDPA lacks for it is a keyword attnlab
    handles itself (SDPA_LACKS) and it leaves transformers' mask as built: a model that pads
    or concatenates additive values onto the mask (DeepSeek-V4's compressed keys) would turn
    them into booleans of the wrong polarity."""
    source = _source(sys.modules.get(model_class.__module__))
    keywords_only = any(f"{name}=" in source for name in SDPA_LACKS)
    if keywords_only and not _EXTENDS_MASK.search(source):
        return
    if getattr(model_class, "_supports_sdpa", True) is False:
        raise ValueError(
            f"{model_class.__name__} declares it does not support SDPA (_supports_sdpa is "
            f"False), whose masks and is_causal conventions attnlab takes: use 'eager' for it"
        )


def _guard(base: type) -> None:
    """Wrap, once, the three places transformers takes an attention implementation for a
    model (its check at construction, post_init, set_attn_implementation), so that asking a
    model that bypasses the interface for attnlab raises instead of being ignored (or
    crashing with KeyError: 'attnlab' inside transformers)."""
    if getattr(base.post_init, "_attnlab_guard", False):
        return
    check, post_init, switch = (
        base._check_and_adjust_attn_implementation,
        base.post_init,
        base.set_attn_implementation,
    )

    @functools.wraps(check)
    def guarded_check(self, attn_implementation, *args, **kwargs):
        if _uses_attnlab(attn_implementation):  # before any layer is built
            _refuse(type(self), _module_bypasses(type(self).__module__))
            _refuse_without_sdpa(type(self))
        return check(self, attn_implementation, *args, **kwargs)

    @functools.wraps(post_init)
    def guarded_post_init(self, *args, **kwargs):
        post_init(self, *args, **kwargs)
        if _uses_attnlab(self.config._attn_implementation):  # every layer is built
            _refuse(type(self), bypassing_classes(self))

    @functools.wraps(switch)
    def guarded_switch(self, attn_implementation, *args, **kwargs):
        if _uses_attnlab(attn_implementation):  # before anything changes
            _refuse(type(self), _module_bypasses(type(self).__module__))
            _refuse_without_sdpa(type(self))
            _refuse(type(self), bypassing_classes(self))
        return switch(self, attn_implementation, *args, **kwargs)

    guarded_post_init._attnlab_guard = True
    base._check_and_adjust_attn_implementation = guarded_check
    base.post_init = guarded_post_init
    base.set_attn_implementation = guarded_switch


def from_gpt2_attention(
    layer: nn.Module, *, context_length: int | None = None
) -> MultiHeadAttention:
    """attnlab's MultiHeadAttention with the weights of a GPT2Attention (self-attention),
    giving the same outputs.

    Args:
        layer: a transformers GPT2Attention: c_attn and c_proj are Conv1D layers, weights
            stored (in, out), c_attn's columns [queries | keys | values].
        context_length: the longest input; default the config's max_position_embeddings.

    Returns:
        A causal MultiHeadAttention with qkv_bias, on the layer's device and dtype.

    Raises:
        TypeError: layer is not a GPT2Attention (or is its cross-attention).
    """
    _check_gpt2(layer)
    d, heads = layer.embed_dim, layer.num_heads
    length = context_length or layer.config.max_position_embeddings
    module = MultiHeadAttention(d, d, length, 0.0, heads, qkv_bias=True).to(layer.c_attn.weight)
    rows = layer.c_attn.weight.T  # (in, 3d) -> (3d, in): fused rows [q, k, v]
    weights = qkv.split_rows(rows, d, d) + qkv.split_rows(layer.c_attn.bias, d, d)
    module.load_qkv_weights(qkv.QKVWeights(*weights))
    with torch.no_grad():
        module.out_proj.weight.copy_(layer.c_proj.weight.T)
        module.out_proj.bias.copy_(layer.c_proj.bias)
    return module


def to_gpt2_attention(module: MultiHeadAttention, layer: nn.Module) -> nn.Module:
    """Copy `module`'s weights into a GPT2Attention `layer`.

    Args:
        module: a MultiHeadAttention of GPT-2's shape: self-attention, d_in == d_out ==
            embed_dim, as many key/value heads as query heads, qkv_bias, no rope or window.
        layer: a transformers GPT2Attention, changed in place.

    Returns:
        `layer`.

    Raises:
        TypeError: module or layer is not of the kind named.
        ValueError: module's shape does not fit the layer's.
    """
    _check_module(module)
    _check_gpt2(layer)
    fits = (
        module.fused
        and module.qkv_bias
        and module.d_in == module.d_out == layer.embed_dim
        and module.num_heads == module.num_kv_heads == layer.num_heads
        and module.rope is None
        and module.window is None
    )
    if not fits:
        raise ValueError(
            f"GPT2Attention has {layer.num_heads} heads of width {layer.embed_dim} with q/k/v "
            f"biases and no rope or window; the module has {module.extra_repr()}"
        )
    w = module.qkv_weights()
    with torch.no_grad():
        layer.c_attn.weight.copy_(qkv.fuse_rows(*w.weights).T)  # (3d, in) -> (in, 3d)
        layer.c_attn.bias.copy_(qkv.fuse_rows(*w.biases))
        layer.c_proj.weight.copy_(module.out_proj.weight.T)
        layer.c_proj.bias.copy_(module.out_proj.bias)
    return layer


def from_llama_attention(
    layer: nn.Module, *, context_length: int | None = None
) -> MultiHeadAttention:
    """attnlab's MultiHeadAttention (rope, grouped-query heads, query/key norms, the layer's
    scale and window) with the weights of a Llama-style attention layer, giving the same
    outputs.

    One function for the Llama family's layers: Llama (its rope_scaling of type llama3,
    linear or yarn included), Mistral and Qwen2 (their sliding window), Qwen3 (q_norm and
    k_norm per head), Gemma 3 (q_norm and k_norm scaling by 1 + weight, scaling =
    query_pre_attn_scalar ** -0.5, its layer type's window and rotary parameters), OLMo 2
    (q_norm and k_norm over the whole projections). The converted module is run beside the
    layer on a probe (random tokens, the layer's causal or sliding mask, attnlab's rotary
    tables) before it is returned.

    Args:
        layer: an attention layer with Linear q_proj, k_proj, v_proj, o_proj, a config
            and head_dim; optionally q_norm and k_norm (RMSNorms with one weight).
        context_length: the longest input; default the config's max_position_embeddings.

    Returns:
        A causal MultiHeadAttention with rope, on the layer's device and dtype; its out_proj
        maps the heads to o_proj's width, with o_proj's bias (zeros where it has none).

    Raises:
        TypeError: layer is not such a layer.
        ValueError: what attnlab's layer would not compute, named: a rotary type other than
            the default, llama3, linear and yarn, partial rotary, attention logit
            softcapping, bidirectional attention, anything else the layer holds (a sink),
            biases on some projections only, norms of another kind; or a layer that differs
            from its conversion on the probe.
    """
    _check_llama(layer)
    spec = _llama_spec(layer, context_length)
    weight = layer.q_proj.weight
    module = MultiHeadAttention(**spec).to(weight)
    d_out, width = spec["d_out"], layer.o_proj.out_features
    if width != d_out:  # Qwen3, Gemma 3: heads wider (or narrower) than the model
        module.out_proj = nn.Linear(d_out, width).to(weight)
    projections = (layer.q_proj, layer.k_proj, layer.v_proj)
    module.load_qkv_weights(
        qkv.QKVWeights(*(p.weight for p in projections), *(p.bias for p in projections))
    )
    with torch.no_grad():
        module.out_proj.weight.copy_(layer.o_proj.weight)
        o_bias = layer.o_proj.bias
        module.out_proj.bias.copy_(o_bias if o_bias is not None else torch.zeros(width))
        for name in _QK_NORMS if spec.get("qk_norm") else ():
            getattr(module, name).weight.copy_(_norm_weight(getattr(layer, name)))
    _probe_llama(layer, module)
    return module


def to_llama_attention(module: MultiHeadAttention, layer: nn.Module) -> nn.Module:
    """Copy `module`'s weights into a Llama-style attention `layer` (any from_llama_attention
    converts).

    Args:
        module: a MultiHeadAttention computing what the layer computes: its head counts
            and widths, rope base and scaling, window, scale and query/key norms (kind,
            eps and convention) as from_llama_attention would make them, and a zero
            out_proj bias when o_proj has none.
        layer: as for from_llama_attention, changed in place.

    Returns:
        `layer`.

    Raises:
        TypeError: module or layer is not of the kind named.
        ValueError: module does not fit the layer (the message names what differs), or the
            layer holds what attnlab does not compute (as from_llama_attention).
    """
    _check_module(module)
    _check_llama(layer)
    spec = _llama_spec(layer, module.context_length)
    w = module.qkv_weights()
    projections = (layer.q_proj, layer.k_proj, layer.v_proj)
    differs = [key for key, value in spec.items() if not _same(module.config.get(key), value)]
    if not module.fused:
        differs.append("fused")
    if module.out_proj.weight.shape != layer.o_proj.weight.shape:
        differs.append("out_proj's shape")
    if layer.o_proj.bias is None and module.out_proj.bias is not None:
        differs += ["out_proj's bias (o_proj has none)"] if module.out_proj.bias.any() else []
    if not all(p.weight.shape == t.shape for p, t in zip(projections, w.weights, strict=True)):
        differs.append("projection shapes")
    if differs:
        what = [f"{k} {module.config.get(k)!r} != {spec[k]!r}" if k in spec else k for k in differs]
        raise ValueError(
            f"the module ({module.extra_repr()}) does not fit this Llama attention layer "
            f"({layer.config.num_attention_heads} heads, {layer.config.num_key_value_heads} "
            f"key/value heads, rope, o_proj bias {layer.o_proj.bias is not None}): "
            f"{', '.join(what)}"
        )
    with torch.no_grad():
        for target, weight, bias in zip(projections, w.weights, w.biases, strict=True):
            target.weight.copy_(weight)
            if bias is not None:
                target.bias.copy_(bias)
        layer.o_proj.weight.copy_(module.out_proj.weight)
        if layer.o_proj.bias is not None:
            layer.o_proj.bias.copy_(module.out_proj.bias)
        for name in _QK_NORMS if spec.get("qk_norm") else ():
            _norm_weight(getattr(layer, name)).copy_(getattr(module, name).weight)
    return layer


class SwappedAttention(nn.Module):
    """attnlab's MultiHeadAttention in a transformers attention layer's place (swap_attention):
    it takes the layer's call, `(hidden_states, position_embeddings, attention_mask, ...)`,
    and returns `(output, None)`.

    What the call carries is checked, not ignored: the rotary tables (position_embeddings)
    must be attnlab's rope at positions 0 .. t - 1 (position_ids, where given, those
    positions); the mask (transformers' additive float one, or a boolean one True where a
    query may attend) is passed on. transformers' key/value cache is not filled by attnlab:
    a call with a cache is refused (run the model with use_cache=False; attnlab decodes with
    its own KVCache, MultiHeadAttention.make_cache).

    Args:
        attention: the converted layer (from_llama_attention, or
            deepseek.from_deepseek_v3_attention for a DeepSeek-V3 layer).
    """

    # the keywords transformers' decoder layers pass that change nothing here (no cache)
    _PASSED = ("use_cache", "cache_position", "output_attentions")

    def __init__(self, attention: MultiHeadAttention | MultiHeadLatentAttention) -> None:
        super().__init__()
        _check_swappable(attention)
        self.attention = attention

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: object = None,
        past_key_values: object = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        """(b, t, hidden) -> ((b, t, hidden), None), as the layer it replaces.

        Raises:
            ValueError: a cache, recorded attention weights, a keyword attnlab does not
                know (named), positions other than 0 .. t - 1, rotary tables that are not
                attnlab's rope.
        """
        if cache is not None or past_key_values is not None:
            raise ValueError(
                "a swapped attnlab layer does not fill transformers' key/value cache: run the "
                "model with use_cache=False (attnlab decodes with its own KVCache: "
                "MultiHeadAttention.make_cache)"
            )
        if kwargs.get("output_attentions") or _attentions_requested():
            raise ValueError(
                "a swapped attnlab layer returns no attention weights: for output_attentions "
                "use attn_implementation='attnlab' instead (attnlab.interop.hf.register)"
            )
        unknown = sorted(k for k, v in kwargs.items() if k not in self._PASSED and v is not None)
        if unknown:
            raise ValueError(
                f"a swapped attnlab layer got {', '.join(unknown)}, which it neither computes "
                f"nor knows to change nothing; refused rather than ignored"
            )
        tokens = hidden_states.shape[1]
        _check_positions(position_ids, tokens, hidden_states.device)
        if position_embeddings is not None:
            _check_position_embeddings(self.attention, position_embeddings, tokens)
        return self.attention(hidden_states, mask=attention_mask), None


def swap_attention(model: nn.Module, *, context_length: int | None = None) -> int:
    """Replace, in place, every Llama-style attention layer of a transformers model by
    attnlab's MultiHeadAttention (from_llama_attention), and every DeepSeek-V3 attention
    layer by attnlab's MultiHeadLatentAttention (deepseek.from_deepseek_v3_attention), each
    wrapped in SwappedAttention. Every layer is converted (and probed) before any is
    replaced: a swap that raises leaves the model as it was.

    The swapped model computes its attention on attnlab's modules and equals its eager self;
    it runs without transformers' cache (use_cache=False).

    Args:
        model: a transformers model (or any module holding such layers).
        context_length: the longest input; default each config's max_position_embeddings.

    Returns:
        How many layers were replaced.

    Raises:
        ValueError: the model holds no such layer, or one from_llama_attention refuses.
    """
    from attnlab.interop import deepseek
    from attnlab.interop import swap as _swap

    conversions = {}  # id(layer) -> (layer, its converter)
    for m in model.modules():
        if _is_llama_style(m):
            conversions[id(m)] = (m, from_llama_attention)
        elif deepseek.is_deepseek_v3_attention(m):
            conversions[id(m)] = (m, deepseek.from_deepseek_v3_attention)
    if not conversions:
        raise ValueError(
            f"{type(model).__name__} holds no Llama-style or DeepSeek-V3 attention layer"
        )
    converted = {
        key: SwappedAttention(convert(layer, context_length=context_length))
        for key, (layer, convert) in conversions.items()
    }
    return _swap.replace_modules(model, lambda m: id(m) in converted, lambda m: converted[id(m)])


def _check_gpt2(layer: nn.Module) -> None:
    fits = all(hasattr(layer, name) for name in ("c_attn", "c_proj", "embed_dim", "num_heads"))
    if not fits or getattr(layer, "is_cross_attention", False):
        raise TypeError(
            f"layer must be a GPT2Attention (self-attention), got {type(layer).__name__}"
        )


_LLAMA_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "config", "head_dim")
_QK_NORMS = ("q_norm", "k_norm")
_PROBE_TOKENS = 16


def _check_llama(layer: nn.Module) -> None:
    missing = [name for name in _LLAMA_PARTS if not hasattr(layer, name)]
    if missing or not all(isinstance(getattr(layer, n), nn.Linear) for n in _LLAMA_PARTS[:4]):
        raise TypeError(
            f"layer must be a Llama-style attention layer (Linear q_proj, k_proj, v_proj, "
            f"o_proj, a config and head_dim), got {type(layer).__name__}"
            + (f" without {', '.join(missing)}" if missing else "")
        )


def _is_llama_style(m: nn.Module) -> bool:
    return all(hasattr(m, name) for name in _LLAMA_PARTS) and all(
        isinstance(getattr(m, n), nn.Linear) for n in _LLAMA_PARTS[:4]
    )


def _check_module(module: object) -> None:
    if not isinstance(module, MultiHeadAttention):
        raise TypeError(
            f"module must be an attnlab.MultiHeadAttention, got {type(module).__name__}"
        )


def _check_swappable(module: object) -> None:
    """SwappedAttention holds attnlab's MultiHeadAttention or MultiHeadLatentAttention."""
    if not isinstance(module, (MultiHeadAttention, MultiHeadLatentAttention)):
        raise TypeError(
            f"attention must be an attnlab.MultiHeadAttention or MultiHeadLatentAttention, "
            f"got {type(module).__name__}"
        )


def _rope_parameters(layer: nn.Module) -> dict:
    """The layer's rotary parameters: its config's rope_parameters (transformers 5), or their
    entry for the layer's type where they are per type (Gemma 3's sliding and full
    attention), or an older config's rope_theta and rope_scaling."""
    config = layer.config
    parameters = getattr(config, "rope_parameters", None)
    if parameters is None:  # transformers 4: rope_theta and rope_scaling beside each other
        scaling = getattr(config, "rope_scaling", None) or {}
        parameters = {"rope_theta": getattr(config, "rope_theta", 10000.0), **scaling}
    layer_type = getattr(layer, "layer_type", None)
    if isinstance(parameters.get(layer_type), dict):
        parameters = parameters[layer_type]
    return dict(parameters)


def _rope_theta(config) -> float:
    parameters = getattr(config, "rope_parameters", None) or {}
    return parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0))


def _llama_spec(layer: nn.Module, context_length: int | None) -> dict:
    """MultiHeadAttention's arguments for what the layer computes; ValueError naming what
    attnlab's layer would not compute."""
    from attnlab import rope_scaling
    from attnlab.interop import llama, swap

    config, name = layer.config, type(layer).__name__
    norms = tuple(n for n in _QK_NORMS if getattr(layer, n, None) is not None)
    swap.check_nothing_else(layer, _LLAMA_PARTS[:4] + norms)  # sinks, own rotary modules
    parameters = _rope_parameters(layer)
    partial = parameters.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"{name} rotates a part of each head (partial_rotary_factor {partial})")
    softcap = getattr(layer, "attn_logit_softcapping", None)
    if softcap is not None:
        raise ValueError(
            f"{name} has attn_logit_softcapping ({softcap}), which attnlab's "
            f"MultiHeadAttention does not compute: convert it with softcapping off, or use "
            f"attn_implementation='attnlab' (its softcap)"
        )
    if not getattr(layer, "is_causal", True):
        raise ValueError(f"{name} is bidirectional (is_causal False); attnlab's layer is causal")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    d_in, d_out = layer.q_proj.in_features, layer.q_proj.out_features
    if d_out != heads * layer.head_dim or layer.o_proj.in_features != d_out:
        raise ValueError(
            f"{name}: q_proj's {d_out} features and o_proj's {layer.o_proj.in_features} are "
            f"not {heads} heads of head_dim {layer.head_dim}"
        )
    biased = [n for n in _LLAMA_PARTS[:3] if getattr(layer, n).bias is not None]
    if biased and len(biased) < 3:
        raise ValueError(
            f"{name}: {', '.join(biased)} have a bias and the other query/key/value "
            f"projections none; attnlab's fused projection has biases on all three or none"
        )
    window = getattr(layer, "sliding_window", getattr(config, "sliding_window", None))
    spec = {
        "d_in": d_in,
        "d_out": d_out,
        "context_length": context_length or config.max_position_embeddings,
        "dropout": float(getattr(config, "attention_dropout", 0.0) or 0.0),
        "num_heads": heads,
        "qkv_bias": bool(biased),
        "num_kv_heads": kv_heads,
        "rope": True,
        "rope_base": float(parameters.get("rope_theta", 10000.0)),
        "rope_scaling": rope_scaling.check_scaling(parameters, f"{name}'s rope_parameters"),
        "window": window,
        "scale": _scale(layer),
    }
    if norms:
        spec.update(_norm_spec(layer, norms, d_out, kv_heads * layer.head_dim, llama))
    return spec


def _scale(layer: nn.Module) -> float | None:
    """The layer's scaling where it is not 1 / sqrt(head_dim) (Gemma 3's
    query_pre_attn_scalar ** -0.5), else None."""
    scaling = getattr(layer, "scaling", None)
    if scaling is None or abs(scaling - layer.head_dim**-0.5) <= 1e-12 * scaling:
        return None
    return float(scaling)


def _norm_spec(layer: nn.Module, norms: tuple, d_out: int, kv_dim: int, llama) -> dict:
    """qk_norm, qk_norm_eps and qk_norm_offset for the layer's q_norm and k_norm, their
    convention found by running them (attnlab.interop.llama.norm_convention)."""
    name = type(layer).__name__
    if len(norms) == 1:
        raise ValueError(f"{name} has {norms[0]} alone; attnlab's query/key norms come together")
    (_, eps, offset, q_width), (_, k_eps, k_offset, k_width) = (
        llama.norm_convention(getattr(layer, n), n) for n in norms
    )
    if (eps, offset) != (k_eps, k_offset):
        raise ValueError(f"{name}: q_norm and k_norm differ in eps or convention")
    if (q_width, k_width) == (layer.head_dim, layer.head_dim):
        kind = "head"
    elif (q_width, k_width) == (d_out, kv_dim):
        kind = "projection"
    else:
        raise ValueError(
            f"{name}: q_norm and k_norm normalise {q_width} and {k_width} features, neither "
            f"each head's ({layer.head_dim}) nor the whole projections ({d_out}, {kv_dim})"
        )
    return {"qk_norm": kind, "qk_norm_eps": eps, "qk_norm_offset": offset}


def _norm_weight(norm: nn.Module) -> torch.Tensor:
    """The one weight of a norm norm_convention accepted."""
    return next(p for n, p in norm.named_parameters() if n in ("weight", "scale"))


def _same(mine: object, theirs: object) -> bool:
    if isinstance(mine, float) and isinstance(theirs, float):
        return abs(mine - theirs) <= 1e-12 * max(abs(mine), abs(theirs))
    return mine == theirs


def _hidden_as_additive(module: MultiHeadAttention, tokens: int, dtype, device) -> torch.Tensor:
    """The module's own mask over `tokens` (causal, windowed where it is) as transformers'
    eager models pass it: (1, 1, t, t), 0 where a query may attend, the dtype's minimum
    elsewhere."""
    if module.window is None:
        allowed = masks.causal_mask(tokens, device=device)
    else:
        allowed = masks.sliding_window_mask(tokens, window=module.window, device=device)
    hidden = torch.zeros(tokens, tokens, dtype=dtype, device=device)
    return hidden.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def _probe_llama(layer: nn.Module, module: MultiHeadAttention) -> None:
    """Run the layer and its conversion on the same probe (random tokens, the layer's
    mask, attnlab's rotary tables as position_embeddings): raise unless they agree."""
    weight = layer.q_proj.weight
    if weight.is_meta:
        return
    tokens = min(module.context_length, _PROBE_TOKENS)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, tokens, module.d_in, generator=generator).to(weight)
    rope = module.rope
    tables = tuple(t[:tokens][None].to(weight) for t in (rope.cos, rope.sin))  # (1, t, hd)
    mask = _hidden_as_additive(module, tokens, weight.dtype, weight.device)
    modes = layer.training, module.training
    layer.eval(), module.eval()
    try:
        with torch.no_grad():
            theirs = layer(hidden_states=x, position_embeddings=tables, attention_mask=mask)
            theirs, ours = theirs[0].float(), module(x).float()
    finally:
        layer.train(modes[0]), module.train(modes[1])
    tolerance = 1e-4 if torch.finfo(weight.dtype).bits >= 32 else 5e-2
    error = (ours - theirs).abs().max().item()
    if not error <= tolerance * (1 + theirs.abs().max().item()):
        raise ValueError(
            f"{type(layer).__name__} and its conversion differ by {error:.2e} on a probe of "
            f"{tokens} tokens: the layer computes something attnlab's layer does not (a "
            f"scale, a norm, a rotary schedule or a mask it does not read from the layer)"
        )


def _check_positions(position_ids: torch.Tensor | None, tokens: int, device) -> None:
    if position_ids is None:
        return
    expected = torch.arange(tokens, device=device)
    if position_ids.shape[-1] != tokens or not torch.equal(
        position_ids, expected.expand_as(position_ids)
    ):
        raise ValueError(
            "a swapped attnlab layer places its tokens at positions 0 .. t - 1; these "
            "position_ids differ (a generate() step, packed sequences): run the model on "
            "whole sequences, left padding in the attention mask"
        )


def _check_position_embeddings(module: MultiHeadAttention, tables: tuple, tokens: int) -> None:
    """transformers' (cos, sin), each (b, t, rotary_dim), are attnlab's rope's at 0 .. t - 1."""
    rope = module.rope
    for name, theirs, ours in zip(("cos", "sin"), tables, (rope.cos, rope.sin), strict=True):
        ours = ours[:tokens]
        if theirs.shape[-2:] != ours.shape:
            raise ValueError(
                f"position_embeddings' {name} has shape {tuple(theirs.shape)}; attnlab's rope "
                f"gives {tuple(ours.shape)} for {tokens} tokens"
            )
        tolerance = max(1e-4, 2 * torch.finfo(theirs.dtype).eps)
        error = (theirs.to(ours) - ours).abs().max().item()
        if not error <= tolerance:
            raise ValueError(
                f"the model's rotary {name} differs from attnlab's rope (base "
                f"{module.rope_base}, rope_scaling {module.rope_scaling}) by {error:.2e}"
            )
