"""A Llama-style model written from scratch (the book's bonus chapters: grouped-query
attention with rotary positions) with attnlab's attention, and back.

The from-scratch layer is `GroupedQueryAttention`: projections `W_query`, `W_key`,
`W_value` and `out_proj`, none with a bias (Qwen2's biases on the first three are taken
too); optionally `q_norm` and `k_norm`, RMSNorms over each head's features (Qwen3, and
Gemma 3 with its `1 + weight`) or over the whole projection (OLMo 2); a `scaling` attribute
where the scores' scale is not 1 / sqrt(head_dim) (Gemma 3's query_pre_attn_scalar). Its
forward takes `(x, mask, cos, sin)`: the causal mask (True where a key is hidden) and the
model's rotary tables (halves rotated, as GPT-NeoX and HF Llama do); or `(x, cos, sin)`
with no mask (the book's SDPA variant, causal by `is_causal=True`). `swap(model,
rope_base=..., rope_scaling=...)` replaces each by `GroupedQueryAttention` here:
attnlab's MultiHeadAttention with rope on the same base and scaling (the book's
`freq_config` or transformers' `rope_scaling`), the same key/value heads, norms and scale,
its three projections fused into `qkv_proj`. It takes the layer's own call, read from the
layer's signature when it is swapped: a mask is passed on to attnlab (inverted to
attnlab's polarity) unless it is the layer's own causal (or sliding-window) one, and the
rotary tables are checked against attnlab's, never ignored. Each swapped layer is run
beside the original on a probe before anything is replaced: a layer that computes
something the swap does not carry over is refused by name then, never at its first
forward.

State dicts: `from_llama_state(state)` fuses `W_query`, `W_key`, `W_value` into the swapped
model's `attention.qkv_proj` (rows in query, key, value order) and renames `out_proj` and
the norms (`q_norm.scale` or `q_norm.weight` to `attention.q_norm.weight`), so the original
checkpoint loads strictly; `to_llama_state(state)` splits and renames them back.
"""

from __future__ import annotations

import inspect
import math
import numbers
import re

import torch
from torch import nn

from attnlab import debug, masks
from attnlab.attention import MultiHeadAttention
from attnlab.interop import swap as _swap
from attnlab.kv_cache import KVCache
from attnlab.norms import RMSNorm

_PROJECTIONS = ("W_query", "W_key", "W_value", "out_proj")
_NORMS = ("q_norm", "k_norm")
_NORM_WEIGHTS = ("scale", "weight")  # the book's RMSNorm, torch's and transformers'
_ORIGINAL = re.compile(r"^(?P<prefix>.*)W_query\.weight$")
_FUSED = re.compile(r"^(?P<prefix>.*)attention\.qkv_proj\.weight$")
# rotary tables computed in float32 (as from-scratch code does) differ from attnlab's
# float64-exact ones by rounding that grows with the position; a different base or a
# frequency scaling differs by far more at the first positions already
_TABLE_ROWS, _TABLE_TOLERANCE = 1024, 1e-4
# the from-scratch forward's arguments after x, by what they carry
_ROLES = {
    "mask": "mask",
    "attn_mask": "mask",
    "attention_mask": "mask",
    "cos": "cos",
    "freqs_cos": "cos",
    "sin": "sin",
    "freqs_sin": "sin",
}
CALL = ("mask", "cos", "sin")  # the book's GroupedQueryAttention.forward(x, mask, cos, sin)
_PROBE_TOKENS = 16


class GroupedQueryAttention(nn.Module):
    """The from-scratch layer's call on attnlab: `attention` (MultiHeadAttention with rope).

    Args:
        attention: the attention, rope, norms and output projection included.
        call: the names of the from-scratch forward's arguments after x (call_form): the
            book's ("mask", "cos", "sin"), or ("cos", "sin") for its SDPA variant.
    """

    def __init__(self, attention: MultiHeadAttention, call: tuple[str, ...] = CALL) -> None:
        super().__init__()
        self.attention = attention
        self.call = _check_call(tuple(call), "call")
        self._checked_tables: tuple | None = None

    def extra_repr(self) -> str:
        return f"call=(x, {', '.join(self.call)})"

    def forward(
        self, x: torch.Tensor, *args, cache: KVCache | None = None, **kwargs
    ) -> torch.Tensor:
        """(b, t, d_in) -> (b, t, d_out), called as the from-scratch layer is (`call`).

        Args:
            x: the tokens.
            *args: the from-scratch layer's arguments after x, in its order:
                a mask, True where a key is hidden ((t, t), a square buffer of the context
                length sliced to (t, t) as the from-scratch layer slices it, or
                broadcastable to the scores); the layer's own (causal, with its window if
                it has one) is attnlab's and is not passed on; and the model's rotary
                tables cos and sin (positions, head_dim), checked against attnlab's.
            cache: a KVCache, as MultiHeadAttention's.
            **kwargs: those arguments by name.

        Raises:
            TypeError: more arguments than the layer takes, or one it does not take.
            ValueError: rotary tables that are not attnlab's (another base or scaling); a
                mask that shows a query a key outside this layer's causal window.
        """
        mask, cos, sin = self._arguments(args, kwargs)
        if cos is not None or sin is not None:
            self._check_tables(cos, sin)
        return self.attention(x, cache=cache, mask=self._allowed(mask, x.shape[1]))

    def _arguments(self, args: tuple, kwargs: dict) -> tuple:
        """(mask, cos, sin) as the from-scratch layer's signature binds them (None: not given)."""
        if len(args) > len(self.call):
            raise TypeError(
                f"the layer takes x and {len(self.call)} more arguments ({', '.join(self.call)}), "
                f"got {len(args)} more"
            )
        given = dict(zip(self.call, args, strict=False))
        for name, value in kwargs.items():
            if name not in self.call or name in given:
                problem = "an unexpected" if name not in self.call else "a second value for"
                raise TypeError(
                    f"the layer got {problem} argument {name!r} ({', '.join(self.call)})"
                )
            given[name] = value
        roles = {_ROLES[name]: value for name, value in given.items()}
        return roles.get("mask"), roles.get("cos"), roles.get("sin")

    def _allowed(self, mask: torch.Tensor | None, tokens: int) -> torch.Tensor | None:
        """attnlab's mask (True where a query may attend) for a from-scratch one, None for
        the layer's own positional mask (causal, windowed where it is), which attnlab
        applies anyway."""
        if mask is None:
            return None
        if mask.dim() == 2 and mask.shape[0] == mask.shape[1] >= tokens:
            mask = mask[:tokens, :tokens]  # a (context, context) buffer, sliced as the layer does
        if not debug.reads_values(mask):  # off the CPU: combined with the layer's own, unread
            return mask.bool().logical_not()
        own = _positional(self.attention, tokens, mask.device)  # (t, t), True where allowed
        if mask.shape == (tokens, tokens) and torch.equal(mask, ~own):
            return None
        allowed = ~mask.bool()
        if _broadcasts(allowed, own) and (allowed & ~own).any():
            window = self.attention.window
            where = "its causal mask" if window is None else f"its window of {window} keys"
            raise ValueError(
                f"the mask lets a query attend to a key outside {where}, which attnlab's "
                f"layer always applies: the from-scratch layer would attend there, the swap "
                f"would not"
            )
        return allowed

    def _check_tables(self, cos: torch.Tensor | None, sin: torch.Tensor | None) -> None:
        if cos is None or sin is None:
            raise ValueError("cos and sin come together: pass both rotary tables or neither")
        key = (cos.data_ptr(), tuple(cos.shape), sin.data_ptr(), cos._version, sin._version)
        if key == self._checked_tables:
            return
        check_tables(self.attention, cos, sin)
        self._checked_tables = key


def _positional(attention: MultiHeadAttention, tokens: int, device) -> torch.Tensor:
    """The layer's own mask over `tokens` (t, t): causal, within its window if it has one."""
    if attention.window is None:
        return masks.causal_mask(tokens, device=device)
    return masks.sliding_window_mask(tokens, window=attention.window, device=device)


def _broadcasts(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        torch.broadcast_shapes(a.shape, b.shape)
    except RuntimeError:
        return False  # attnlab's own check names the shape
    return True


def _check_call(call: tuple, what: str) -> tuple[str, ...]:
    unknown = [name for name in call if name not in _ROLES]
    roles = [_ROLES.get(name) for name in call]
    if unknown or len(set(roles)) != len(roles) or not {"cos", "sin"} <= set(roles):
        raise ValueError(
            f"{what} takes ({', '.join(['x', *call])}); the swap wraps a layer called with "
            f"x, then rotary tables cos and sin and optionally a mask, each once "
            f"(names {sorted(_ROLES)})"
            + (f": {', '.join(map(repr, unknown))} unknown" if unknown else "")
        )
    return call


def call_form(layer: nn.Module) -> tuple[str, ...]:
    """The names of the from-scratch layer's forward arguments after x: a mask and the
    rotary tables (("mask", "cos", "sin") for the book's layer, ("cos", "sin") for its SDPA
    variant), read from its signature.

    Raises:
        ValueError: a forward taking anything else, or *args / **kwargs (named).
    """
    name = f"{type(layer).__name__}.forward"
    try:
        signature = inspect.signature(layer.forward)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name} has no signature to read: {error}") from None
    parameters = list(signature.parameters.values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if not parameters or parameters[0].kind not in positional:
        raise ValueError(f"{name}{signature} takes no tokens x first")
    variadic = [p.name for p in parameters if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if variadic:
        raise ValueError(
            f"{name}{signature} takes *{variadic[0]}: the swap cannot tell what it passes"
        )
    return _check_call(tuple(p.name for p in parameters[1:]), f"{name}{signature}")


def check_tables(attention: MultiHeadAttention, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Raise unless the from-scratch rotary tables (positions, head_dim) are attnlab's rope
    of `attention`, on their first positions (up to 1024), within 1e-4.

    Raises:
        ValueError: another shape, base, or frequency scaling (the message says how far).
    """
    rope = attention.rope
    rows = min(_TABLE_ROWS, cos.shape[0], rope.cos.shape[0])
    if cos.shape[-1] != rope.cos.shape[-1] or sin.shape != cos.shape:
        raise ValueError(
            f"rotary tables of shape cos {tuple(cos.shape)}, sin {tuple(sin.shape)}; attnlab's "
            f"rope has head_dim {rope.cos.shape[-1]}"
        )
    # tables stored in a narrow dtype (a bfloat16 model's buffers) are rounded to it
    tolerance = max(_TABLE_TOLERANCE, 2 * torch.finfo(cos.dtype).eps)
    for name, theirs, ours in (("cos", cos, rope.cos), ("sin", sin, rope.sin)):
        error = (theirs[:rows].to(ours) - ours[:rows]).abs().max().item()
        if not error <= tolerance:
            scaling = attention.rope_scaling
            raise ValueError(
                f"the model's rotary {name} table differs from attnlab's rope (base "
                f"{attention.rope_base}, rope_scaling {scaling}) by {error:.2e} on its first "
                f"{rows} positions (tolerance {tolerance:.1e} for {cos.dtype}): another base, "
                f"a frequency scaling other than attnlab's (pass the model's rope_scaling or "
                f"freq_config to the swap), or tables that start at another position"
            )


def from_llama_attention(
    layer: nn.Module,
    context_length: int,
    rope_base: float,
    *,
    rope_scaling: dict | None = None,
    window: int | None = None,
    scale: float | None = None,
) -> GroupedQueryAttention:
    """attnlab's GroupedQueryAttention with the weights, head layout, query/key norms and
    scale of the from-scratch layer, taking its call (call_form).

    Args:
        layer: W_query, W_key, W_value, out_proj (biases on none or the first three),
            num_heads, num_kv_groups; optionally q_norm and k_norm (RMSNorms with one
            weight, `scale` or `weight`, over head_dim or the whole projection: their
            convention, x / rms * w or Gemma's x / rms * (1 + w), is found by running them)
            and `scaling` (the scores' scale).
        context_length: the model's context length.
        rope_base: the rotary base (theta) the model's tables were made with.
        rope_scaling: their frequency scaling: the book's freq_config or transformers'
            rope_scaling / rope_parameters dict (attnlab.rope_scaling), or None.
        window: the layer's sliding window (Gemma 3's local layers), or None.
        scale: the scores' scale (default the layer's `scaling`, else 1 / sqrt(head_dim)).

    Returns:
        The same layer on attnlab, on its device and dtype.

    Raises:
        TypeError: layer lacks one of those attributes (named).
        ValueError: anything else it holds, a call form the wrapper does not take, norms
            it cannot carry over, or a layer that differs from its swap on a probe (named).
    """
    for name in ("W_query", "W_key", "W_value", "out_proj", "num_heads", "num_kv_groups"):
        if not hasattr(layer, name):
            raise TypeError(f"layer has no {name!r}: it is not a from-scratch Llama attention")
    norms = [name for name in _NORMS if getattr(layer, name, None) is not None]
    _swap.check_nothing_else(layer, _PROJECTIONS + tuple(norms))  # own tables, sinks
    call = call_form(layer)
    if layer.out_proj.bias is not None:
        raise ValueError("out_proj has a bias; the from-scratch Llama layout has none")
    weight = layer.W_query.weight
    d_out, d_in = weight.shape
    biased = [name for name in _PROJECTIONS[:3] if getattr(layer, name).bias is not None]
    if biased and len(biased) < 3:
        raise ValueError(
            f"{', '.join(biased)} have a bias and the other query/key/value projections none: "
            f"attnlab's fused projection has biases on all three (Qwen2) or none (Llama)"
        )
    qkv_bias = bool(biased)  # Qwen2-style biases on the three
    head_dim = d_out // layer.num_heads
    attention = MultiHeadAttention(
        d_in,
        d_out,
        context_length,
        0.0,
        layer.num_heads,
        qkv_bias=qkv_bias,
        num_kv_heads=layer.num_kv_groups,
        rope=True,
        rope_base=rope_base,
        rope_scaling=rope_scaling,
        window=window,
        scale=_layer_scale(layer, head_dim) if scale is None else scale,
        **_qk_norm_options(layer, norms, d_out, layer.num_kv_groups * head_dim),
        device=weight.device,
        dtype=weight.dtype,
    )
    # Llama: no bias; out_proj maps the heads back to d_in (Qwen3, Gemma 3: d_out != d_in)
    attention.out_proj = nn.Linear(d_out, layer.out_proj.out_features, bias=False).to(weight)
    wrapper = GroupedQueryAttention(attention, call)
    wrapper.load_state_dict(from_llama_state(layer.state_dict()))  # keys as the wrapper's
    _probe(layer, wrapper)
    return wrapper


def _layer_scale(layer: nn.Module, head_dim: int) -> float | None:
    """The layer's `scaling` attribute (Gemma 3's query_pre_attn_scalar ** -0.5) where it
    has one that is not 1 / sqrt(head_dim); None otherwise."""
    scaling = getattr(layer, "scaling", None)
    if isinstance(scaling, bool) or not isinstance(scaling, numbers.Real):
        return None
    return None if math.isclose(scaling, head_dim**-0.5, rel_tol=1e-12) else float(scaling)


def _qk_norm_options(layer: nn.Module, norms: list[str], d_out: int, kv_dim: int) -> dict:
    """MultiHeadAttention's qk_norm arguments for the layer's q_norm and k_norm."""
    if not norms:
        return {}
    if len(norms) == 1:
        other = "k_norm" if norms == ["q_norm"] else "q_norm"
        kind = type(getattr(layer, norms[0])).__name__
        raise ValueError(
            f"the layer holds submodule {norms[0]} ({kind}) without {other}: attnlab's "
            f"query/key norms come together"
        )
    head_dim = d_out // layer.num_heads
    found = [norm_convention(getattr(layer, name), name) for name in norms]
    sizes = (found[0][3], found[1][3])
    if sizes == (head_dim, head_dim):
        kind = "head"
    elif sizes == (d_out, kv_dim):
        kind = "projection"
    else:
        raise ValueError(
            f"q_norm and k_norm normalise {sizes[0]} and {sizes[1]} features; attnlab's "
            f"normalise each head's ({head_dim}, {head_dim}) or the whole projections "
            f"({d_out}, {kv_dim})"
        )
    (_, eps_q, offset_q, _), (_, eps_k, offset_k, _) = found
    if (eps_q, offset_q) != (eps_k, offset_k):
        raise ValueError(
            f"q_norm (eps {eps_q}, offset {offset_q}) and k_norm (eps {eps_k}, offset "
            f"{offset_k}) differ; attnlab's share one eps and one convention"
        )
    return {"qk_norm": kind, "qk_norm_eps": eps_q, "qk_norm_offset": offset_q}


def norm_convention(norm: nn.Module, name: str = "norm") -> tuple[str, float, float, int]:
    """How an RMSNorm-like module scales: its weight's name ("scale" or "weight"), its eps,
    the offset added to the weight (0: x / rms(x) * w, as Qwen3, OLMo 2 and torch; 1:
    Gemma's x / rms(x) * (1 + w)), and the features it normalises. The convention is found
    by running the module on a probe and comparing it with attnlab's RMSNorm of each.

    Args:
        norm: the module (one weight parameter of shape (features,), an `eps` or
            `variance_epsilon` attribute, nothing else).
        name: its name, for messages.

    Returns:
        (weight name, eps, offset, features).

    Raises:
        ValueError: anything else it holds, no weight, no eps, or a computation that is
            neither convention (named).
    """
    kind = type(norm).__name__
    parameters = dict(norm.named_parameters())
    extra = [f"submodule {n}" for n, _ in norm.named_children()]
    extra += [f"buffer {n}" for n, _ in norm.named_buffers()]
    extra += [f"parameter {n}" for n in parameters if n not in _NORM_WEIGHTS]
    weights = [n for n in parameters if n in _NORM_WEIGHTS]
    if extra or len(weights) != 1 or parameters[weights[0]].dim() != 1:
        held = ", ".join(extra) or f"parameters {sorted(parameters) or 'none'}"
        raise ValueError(
            f"submodule {name} ({kind}) holds {held}: the swap carries over an RMSNorm with "
            f"one weight (named {' or '.join(_NORM_WEIGHTS)}) and nothing else"
        )
    weight = parameters[weights[0]]
    eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
    if eps is None and isinstance(norm, nn.RMSNorm):
        eps = torch.finfo(weight.dtype).eps  # torch's default
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps > 0:
        raise ValueError(f"submodule {name} ({kind}) has no positive eps (or variance_epsilon)")
    eps = float(eps)
    features = weight.shape[0]
    if weight.is_meta:
        raise ValueError(f"submodule {name} ({kind}) is on the meta device: it cannot be probed")
    generator = torch.Generator().manual_seed(0)
    probe = torch.randn(4, features, generator=generator)
    probe = (probe * torch.tensor([[1.0], [1e-2], [1e-3], [30.0]])).to(weight)  # eps shows
    tolerance = 1e-5 if torch.finfo(weight.dtype).bits >= 32 else 2e-2
    with torch.no_grad():
        theirs = norm(probe).float()
        for offset in (0.0, 1.0):
            ours = RMSNorm(features, eps, offset=offset, device=weight.device, dtype=weight.dtype)
            ours.weight.copy_(weight)
            if torch.allclose(ours(probe).float(), theirs, rtol=tolerance, atol=tolerance):
                return weights[0], eps, offset, features
    raise ValueError(
        f"submodule {name} ({kind}) computes neither x / rms(x) * {weights[0]} nor Gemma's "
        f"x / rms(x) * (1 + {weights[0]}) with eps {eps}, which attnlab's RMSNorm does"
    )


def _probe(layer: nn.Module, wrapper: GroupedQueryAttention) -> None:
    """Run the from-scratch layer and its swap on the same probe (random tokens, the
    layer's own mask, attnlab's rotary tables): raise unless they agree."""
    attention = wrapper.attention
    weight = attention.qkv_proj.weight
    if weight.is_meta:
        return
    tokens = min(attention.context_length, _PROBE_TOKENS)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, tokens, attention.d_in, generator=generator).to(weight)
    hidden = ~_positional(attention, tokens, weight.device)  # the from-scratch polarity
    rope = attention.rope
    given = {"mask": hidden, "cos": rope.cos[:tokens], "sin": rope.sin[:tokens]}
    modes = layer.training, attention.training
    layer.eval(), attention.eval()
    try:
        with torch.no_grad():
            theirs = layer(x, *(given[_ROLES[name]] for name in wrapper.call)).float()
            ours = attention(x).float()
    finally:
        layer.train(modes[0]), attention.train(modes[1])
    tolerance = 1e-4 if torch.finfo(weight.dtype).bits >= 32 else 5e-2
    error = (ours - theirs).abs().max().item()
    if not error <= tolerance * (1 + theirs.abs().max().item()):
        raise ValueError(
            f"{type(layer).__name__} and its swap differ by {error:.2e} on a probe of "
            f"{tokens} tokens (the layer's own mask, attnlab's rotary tables): the layer "
            f"computes something the swap does not carry over (another scale: pass scale=; "
            f"a norm or an order of operations attnlab's layer does not have)"
        )


def swap(
    model: nn.Module,
    *,
    rope_base: float,
    rope_scaling: dict | None = None,
    context_length: int | None = None,
) -> int:
    """Replace, in place, every from-scratch GroupedQueryAttention in `model` by attnlab's
    (from_llama_attention); where the model keeps its rotary tables as buffers `cos` and
    `sin`, they are checked against attnlab's first (check_tables). Every layer is
    converted and checked before any is replaced: a swap that raises leaves the model as it
    was.

    Args:
        model: the from-scratch Llama model, or any module holding its attention layers.
        rope_base: the rotary base (theta) of the model's configuration.
        rope_scaling: its rotary frequency scaling: the book's freq_config (Llama 3.1 and
            3.2) or transformers' rope_scaling / rope_parameters dict, or None.
        context_length: the context length (default the rows of the model's `cos`).

    Returns:
        How many layers were replaced.

    Raises:
        ValueError: the model holds none; tables that are not attnlab's; no context length;
            a layer the swap cannot carry over (from_llama_attention).
    """
    layers = [m for m in model.modules() if _is_llama_attention(m)]
    if not layers:
        raise ValueError(f"{type(model).__name__} holds no from-scratch GroupedQueryAttention")
    tables = getattr(model, "cos", None), getattr(model, "sin", None)
    if context_length is None:
        if not isinstance(tables[0], torch.Tensor):
            raise ValueError(f"{type(model).__name__} has no `cos` table: pass context_length")
        context_length = tables[0].shape[0]
    options = {"rope_scaling": rope_scaling}
    converted = {
        id(layer): from_llama_attention(layer, context_length, rope_base, **options)
        for layer in layers
    }
    if all(isinstance(table, torch.Tensor) for table in tables):
        check_tables(next(iter(converted.values())).attention, *tables)
    return _swap.replace_modules(model, lambda m: id(m) in converted, lambda m: converted[id(m)])


def _is_llama_attention(m: nn.Module) -> bool:
    return all(hasattr(m, name) for name in ("W_query", "W_key", "W_value", "num_kv_groups"))


def from_llama_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The from-scratch model's state_dict with each attention's W_query, W_key, W_value
    fused (concatenated rows, biases too where they have them) into
    `attention.qkv_proj`, `out_proj` renamed `attention.out_proj` and the norms' weights
    (`q_norm.scale` or `q_norm.weight`, k_norm's too) `attention.q_norm.weight`; every
    other key as it is."""
    result = dict(state)
    for key in [k for k in state if _ORIGINAL.match(k)]:
        prefix = _ORIGINAL.match(key)["prefix"]
        for what in ("weight", "bias"):
            names = [f"{prefix}{name}.{what}" for name in _PROJECTIONS[:3]]
            if all(name in result for name in names):  # biases: Qwen2-style, or none
                parts = [result.pop(name) for name in names]
                result[f"{prefix}attention.qkv_proj.{what}"] = torch.cat(parts)  # rows q, k, v
        result[f"{prefix}attention.out_proj.weight"] = result.pop(f"{prefix}out_proj.weight")
        for norm in _NORMS:
            for weight in _NORM_WEIGHTS:
                if f"{prefix}{norm}.{weight}" in result:
                    value = result.pop(f"{prefix}{norm}.{weight}")
                    result[f"{prefix}attention.{norm}.weight"] = value
    return result


def to_llama_state(
    state: dict[str, torch.Tensor], *, norm_weight: str = "scale"
) -> dict[str, torch.Tensor]:
    """The inverse of from_llama_state, for the from-scratch class.

    Args:
        state: the swapped model's state_dict.
        norm_weight: the name of the from-scratch q_norm's and k_norm's weight: "scale"
            (the book's RMSNorm) or "weight" (torch's nn.RMSNorm).

    Raises:
        ValueError: another norm_weight.
    """
    if norm_weight not in _NORM_WEIGHTS:
        raise ValueError(f"norm_weight must be one of {_NORM_WEIGHTS}, got {norm_weight!r}")
    result = dict(state)
    for key in [k for k in state if _FUSED.match(k)]:
        prefix = _FUSED.match(key)["prefix"]
        out = result.pop(f"{prefix}attention.out_proj.weight")
        result[f"{prefix}out_proj.weight"] = out
        for what in ("weight", "bias"):
            fused = result.pop(f"{prefix}attention.qkv_proj.{what}", None)
            if fused is None:
                continue
            kv = (fused.shape[0] - out.shape[1]) // 2
            parts = fused.split([out.shape[1], kv, kv])  # rows q, k, v
            result.update(
                {
                    f"{prefix}{name}.{what}": part
                    for name, part in zip(_PROJECTIONS[:3], parts, strict=True)
                }
            )
        for norm in _NORMS:
            value = result.pop(f"{prefix}attention.{norm}.weight", None)
            if value is not None:
                result[f"{prefix}{norm}.{norm_weight}"] = value
    return result
