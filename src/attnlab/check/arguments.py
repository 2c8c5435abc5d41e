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
- cos and sin (the book's Llama 3 and Qwen3: (tokens, head_dim), the angles written twice
  as its compute_rope_params writes them), freqs_cos and freqs_sin (llama2.c: (tokens,
  head_dim/2)): each name's usual width first, then the other, then (batch, tokens,
  head_dim);
- position_embeddings (transformers' attention classes): (cos, sin) from the model's own
  `...RotaryEmbedding` class built from the module's config (partial widths and rope
  scaling as the model has them); else each (batch, tokens, head_dim), halves rotated, of
  the config's rope_theta;
- mask, attn_mask, attention_mask: the causal mask (1, 1, tokens, tokens) as an additive
  float, 0 where a query may attend and -inf elsewhere (added to the scores, or given to
  SDPA, both read it so), else as a bool in the polarity the forward's source reads it
  (`masked_fill(mask, ...)`: True where a key is hidden, as the book's models pass it;
  `masked_fill(~mask, ...)` or `mask == 0`: True where it may attend); a forward that
  only selects with it (masked_fill, where) gets the bool alone; nothing hidden in an audit
  with causal=False.

Parameters without a default are supplied, and of those defaulting to None the ones
transformers' attention classes need from their model. A required parameter of another
name cannot be built: the forward's `needs` are reported by name, and the module is not
called.
"""

from __future__ import annotations

import inspect
import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from attnlab.check import causes

# (x (b, t, d), the position of its first token) -> the argument's value
Builder = Callable[..., object]

# names whose values are rotary tables of the head width
ROTARY_NAMES = frozenset(
    ("freqs_cis", "position_embeddings", "cos", "sin", "freqs_cos", "freqs_sin")
)
_TABLES = ("cos", "sin", "freqs_cos", "freqs_sin")  # one width for all: a family
_MASKS = ("mask", "attn_mask", "attention_mask")


@dataclass
class Supply:
    """What the check passes the forward after x: every form to try (a builder per
    argument name, the first form that runs is taken), and the required arguments it
    cannot build (`needs`, with why)."""

    forms: list[dict[str, Builder]] = field(default_factory=lambda: [{}])
    needs: list[str] = field(default_factory=list)
    why: str = ""


def builders(module: nn.Module, head_dim: int | None, causal: bool) -> Supply:
    """The forms of the arguments to supply after the input (by name), and what cannot be
    supplied. Required parameters are supplied; of those defaulting to None, the ones
    transformers' attention classes need from their model (position_embeddings, and
    attention_mask in a causal audit of a module with a config). One form ({}) when the
    forward takes x alone."""
    required, optional = _parameters(module)
    names = required[1:] + [n for n in optional if _supplied_when_optional(module, n, causal)]
    unknown = [name for name in required[1:] if name not in _KNOWN]
    if unknown:
        why = "no model convention the check knows names them"
        return Supply(needs=unknown, why=why)
    if not names or _alibi_wanted(module, names):
        return Supply()
    if head_dim is None and ROTARY_NAMES & set(names):
        tables = [name for name in names if name in ROTARY_NAMES]
        why = (
            "rotary tables of an unknown head width (no head_dim attribute, and no head "
            "count dividing the input width): give the head count in --init"
        )
        return Supply(needs=tables, why=why)
    base = rope_base(module)
    own = _models_own_rotary(module) if "position_embeddings" in names else None
    families = _families(module, names)
    forms = []
    for choice in itertools.product(*families.values()):
        variants = dict(zip(families, choice, strict=True))
        form = {
            name: _KNOWN[name](head_dim, base, variants.get(_family(name)), causal)
            for name in names
        }
        if own is not None:
            form["position_embeddings"] = own
        forms.append(form)
    return Supply(forms=forms)


def _family(name: str) -> str:
    """Arguments that take one variant together (cos and sin the same width)."""
    if name in _TABLES:
        return "tables"
    return "masks" if name in _MASKS else name


def _families(module: nn.Module, names: list[str]) -> dict[str, tuple[str, ...]]:
    """{family: its variants, in the order they are tried} for the families with more
    than one form."""
    families: dict[str, tuple[str, ...]] = {}
    if "freqs_cis" in names:
        families["freqs_cis"] = ("complex", "real")
    tables = [name for name in names if name in _TABLES]
    if tables:  # freqs_cos: llama2.c's half width first; cos: the book's full width first
        half_first = tables[0].startswith("freqs")
        families["tables"] = (
            ("half", "full", "batched") if half_first else ("full", "half", "batched")
        )
    masks = [name for name in names if name in _MASKS]
    if masks:
        read = causes.mask_convention(module, masks[0])
        families["masks"] = (read,) if read else ("additive", "blocked")
    return families


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


def known_names() -> list[str]:
    """The forward arguments the check knows how to build, by name."""
    return list(_KNOWN)


def supplies(names: list[str]) -> bool:
    """Whether the check knows how to build every one of these forward arguments."""
    return all(name in _KNOWN for name in names)


def _supplied_when_optional(module: nn.Module, name: str, causal: bool) -> bool:
    if name == "position_embeddings":
        return True
    return name == "attention_mask" and causal and hasattr(module, "config")


def _parameters(module: nn.Module) -> tuple[list[str], list[str]]:
    """(required parameters, those defaulting to None) of module.forward, positional or
    keyword-only (the check passes its arguments by keyword)."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return [], []
    kinds = (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
    )
    required = [
        p.name for p in parameters if p.default is inspect.Parameter.empty and p.kind in kinds
    ]
    optional = [p.name for p in parameters if p.default is None and p.kind in kinds]
    return required, optional


def rope_base(module: nn.Module) -> float:
    """The rotary base the check's own tables use: the module's or its config's
    rope_theta (rope_base, theta), else 10000."""
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


def _freqs_cis(head_dim, base, variant, causal) -> Builder:
    def build(x, start=0):
        angles = _angles(_positions(x, start).cpu(), head_dim, base).to(x.device)
        if variant == "complex":
            return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)
        return torch.stack([angles.cos(), angles.sin()], -1).to(x.dtype)  # (t, hd/2, 2)

    return build


def _table(function: str) -> Callable[..., Builder]:
    """cos or sin tables: (t, hd/2) "half"; (t, hd) "full", the angles written twice
    (cat(angles, angles), the layout of the book's compute_rope_params and transformers'
    tables: halves rotated); "batched" (b, t, hd)."""

    def make(head_dim, base, variant, causal) -> Builder:
        def build(x, start=0):
            angles = _angles(_positions(x, start).cpu(), head_dim, base).to(x.device)
            if variant != "half":
                angles = torch.cat([angles, angles], -1)  # (t, hd)
            table = getattr(angles, function)().to(x.dtype)
            return table.expand(x.shape[0], *table.shape) if variant == "batched" else table

        return build

    return make


def _position_embeddings(head_dim, base, variant, causal) -> Builder:
    def build(x, start=0):
        angles = _angles(_positions(x, start).cpu(), head_dim, base).to(x.device)
        both = torch.cat([angles, angles], -1)  # (t, hd): halves rotated
        expand = (x.shape[0], *both.shape)
        return both.cos().to(x.dtype).expand(expand), both.sin().to(x.dtype).expand(expand)

    return build


def _mask(head_dim, base, variant, causal) -> Builder:
    """The causal mask as the forward reads it: "additive" (0 or -inf, in x's dtype),
    "blocked" (bool, True where a key is hidden), "allowed" (bool, True where it is seen)."""

    def build(x, start=0):
        """(1, 1, t, start + t): query i, at position start + i, sees keys up to it."""
        t, keys = x.shape[1], start + x.shape[1]
        ones = torch.ones(t, keys, dtype=torch.bool, device=x.device)
        blocked = ones.triu(start + 1) if causal else ones.triu(keys)
        if variant == "blocked":
            return blocked[None, None]
        if variant == "allowed":
            return ~blocked[None, None]
        additive = torch.zeros(t, keys, dtype=x.dtype, device=x.device)
        return additive.masked_fill(blocked, -torch.inf)[None, None]  # (1, 1, t, keys)

    return build


def _value(make: Callable[[torch.Tensor, int], object]) -> Callable[..., Builder]:
    return lambda head_dim, base, variant, causal: make


_KNOWN: dict[str, Callable[..., Builder]] = {
    "start_pos": _value(lambda x, start=0: start),
    "input_pos": _value(_positions),
    "cache_position": _value(_positions),
    "position_ids": _value(lambda x, start=0: _positions(x, start).expand(x.shape[0], -1)),
    "freqs_cis": _freqs_cis,
    "cos": _table("cos"),
    "sin": _table("sin"),
    "freqs_cos": _table("cos"),
    "freqs_sin": _table("sin"),
    "position_embeddings": _position_embeddings,
    "mask": _mask,
    "attn_mask": _mask,
    "attention_mask": _mask,
    "alibi": _value(lambda x, start=0: None),  # Falcon's, None where its config has no ALiBi
}
