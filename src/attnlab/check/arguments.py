"""The arguments a module's forward takes besides its input, supplied by the auditor as the
model around it would: modern attention layers are called with positions, rotary tables
and masks that the model builds once, not with x alone.

Recognised by the parameter's name, each built for the call's (batch, tokens) and the
position of its first token (0, or the tokens a module's own cache holds before it):

- start_pos (Meta's Llama): 0, the call starts at position 0;
- input_pos, cache_position (gpt-fast, transformers): arange(tokens);
- position_ids: arange(tokens) per row;
- freqs_cis (Meta's Llama: complex (tokens, head_dim/2); gpt-fast: real (tokens,
  head_dim/2, 2), tried second): rotary tables of base 10000 or the module's rope_theta;
- position_embeddings (transformers' attention classes): (cos, sin) from the model's own
  `...RotaryEmbedding` class built from the module's config (partial widths and rope
  scaling as the model has them); else each (batch, tokens, head_dim), halves rotated, of
  the config's rope_theta;
- mask, attn_mask, attention_mask: the causal mask as an additive float (1, 1, tokens,
  tokens), 0 where a query may attend and -inf elsewhere (added to the scores, or given to
  SDPA, both read it so); all zeros in an audit with causal=False.

Parameters without a default are supplied, and of those defaulting to None the ones
transformers' attention classes need from their model; a required one of another name
leaves the module called with x alone (its error is then the audit's finding).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

import torch
from torch import nn

# (x (b, t, d), the position of its first token) -> the argument's value
Builder = Callable[..., object]


def builders(module: nn.Module, head_dim: int | None, causal: bool) -> list[dict[str, Builder]]:
    """For each form the module's forward may take, the builder of every argument to
    supply after the input (by name); [{}] when it takes x alone or needs an unknown one.
    Required parameters are supplied; of those defaulting to None, the ones transformers'
    attention classes need from their model (position_embeddings, and attention_mask in a
    causal audit of a module with a config)."""
    required, optional = _parameters(module)
    names = required[1:] + [n for n in optional if _supplied_when_optional(module, n, causal)]
    if not names or any(name not in _KNOWN for name in names) or _alibi_wanted(module, names):
        return [{}]
    if head_dim is None and {"freqs_cis", "position_embeddings"} & set(names):
        return [{}]  # tables of an unknown width: called with x alone
    base = _rope_base(module)
    own = _models_own_rotary(module) if "position_embeddings" in names else None
    forms = []
    for rotary in ("complex", "real"):
        forms.append({name: _KNOWN[name](head_dim, base, rotary, causal) for name in names})
        if own is not None:
            forms[-1]["position_embeddings"] = own
        if "freqs_cis" not in names:
            break
    return forms


def _models_own_rotary(module: nn.Module) -> Builder | None:
    """position_embeddings made by the model's own rotary class, as its model makes them:
    the `...RotaryEmbedding` of the modeling file of the module's class or, for a subclass
    written elsewhere, of the nearest base class whose file has one, built from the module's
    config (partial rotary widths, rope scaling and bases as the model has them); None when
    there is no such class or it does not build and run so."""
    config = getattr(module, "config", None)
    rotary_class = _rotary_class(type(module))
    if config is None or rotary_class is None:
        return None
    try:
        rotary = rotary_class(config=config)
        probe = torch.zeros(1, 2, 1)
        cos, sin = rotary(probe, torch.arange(2)[None])
    except Exception:  # another signature: the check's own tables
        return None
    if not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)):
        return None

    def build(x, start=0):
        positions = _positions(x, start).expand(x.shape[0], -1)  # (b, t)
        with torch.no_grad():
            cos, sin = rotary(x, positions)
        return cos.to(x.dtype), sin.to(x.dtype)

    return build


def _rotary_class(cls: type) -> type | None:
    """The single `...RotaryEmbedding` class of the nearest modeling file in cls's MRO."""
    for base in cls.__mro__:
        modeling = sys.modules.get(base.__module__)
        names = [n for n in dir(modeling) if n.endswith("RotaryEmbedding")] if modeling else []
        if len(names) == 1:
            return getattr(modeling, names[0])
        if names:
            return None  # several: which one the model uses is not known
    return None


def _alibi_wanted(module: nn.Module, names: list[str]) -> bool:
    """Whether the forward takes ALiBi biases its config turns on (the check passes None,
    as Falcon's model does only without ALiBi)."""
    return "alibi" in names and bool(getattr(getattr(module, "config", None), "alibi", False))


def supplies(names: list[str]) -> bool:
    """Whether the check knows how to build every one of these forward arguments."""
    return all(name in _KNOWN for name in names)


def _supplied_when_optional(module: nn.Module, name: str, causal: bool) -> bool:
    if name == "position_embeddings":
        return True
    return name == "attention_mask" and causal and hasattr(module, "config")


def _parameters(module: nn.Module) -> tuple[list[str], list[str]]:
    """(required positional parameters, those defaulting to None) of module.forward."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return [], []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [
        p.name for p in parameters if p.default is inspect.Parameter.empty and p.kind in kinds
    ]
    optional = [p.name for p in parameters if p.default is None and p.kind in kinds]
    return required, optional


def _rope_base(module: nn.Module) -> float:
    config = getattr(module, "config", None)
    rope_parameters = getattr(config, "rope_parameters", None)  # transformers 5
    for owner in (module, config, rope_parameters):
        for name in ("rope_theta", "rope_base", "theta"):
            value = owner.get(name) if isinstance(owner, dict) else getattr(owner, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 1:
                return float(value)
    return 10000.0


def _angles(positions: torch.Tensor, head_dim: int, base: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    return positions.double()[:, None] * base**-exponents  # (t, hd/2)


def _positions(x: torch.Tensor, start: int) -> torch.Tensor:
    return torch.arange(start, start + x.shape[1], device=x.device)  # (t,)


def _freqs_cis(head_dim, base, rotary, causal) -> Builder:
    def build(x, start=0):
        angles = _angles(_positions(x, start).cpu(), head_dim, base).to(x.device)
        if rotary == "complex":
            return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)
        return torch.stack([angles.cos(), angles.sin()], -1).to(x.dtype)  # (t, hd/2, 2)

    return build


def _position_embeddings(head_dim, base, rotary, causal) -> Builder:
    def build(x, start=0):
        angles = _angles(_positions(x, start).cpu(), head_dim, base).to(x.device)
        both = torch.cat([angles, angles], -1)  # (t, hd): halves rotated
        expand = (x.shape[0], *both.shape)
        return both.cos().to(x.dtype).expand(expand), both.sin().to(x.dtype).expand(expand)

    return build


def _mask(head_dim, base, rotary, causal) -> Builder:
    def build(x, start=0):
        """(1, 1, t, start + t): query i, at position start + i, sees keys up to it."""
        t, keys = x.shape[1], start + x.shape[1]
        ones = torch.ones(t, keys, dtype=torch.bool, device=x.device)
        blocked = ones.triu(start + 1) if causal else ones.triu(keys)
        additive = torch.zeros(t, keys, dtype=x.dtype, device=x.device)
        return additive.masked_fill(blocked, -torch.inf)[None, None]  # (1, 1, t, keys)

    return build


def _value(make: Callable[[torch.Tensor, int], object]) -> Callable[..., Builder]:
    return lambda head_dim, base, rotary, causal: make


_KNOWN: dict[str, Callable[..., Builder]] = {
    "start_pos": _value(lambda x, start=0: start),
    "input_pos": _value(_positions),
    "cache_position": _value(_positions),
    "position_ids": _value(lambda x, start=0: _positions(x, start).expand(x.shape[0], -1)),
    "freqs_cis": _freqs_cis,
    "position_embeddings": _position_embeddings,
    "mask": _mask,
    "attn_mask": _mask,
    "attention_mask": _mask,
    "alibi": _value(lambda x, start=0: None),  # Falcon's, None where its config has no ALiBi
}
