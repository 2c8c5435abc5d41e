"""Property 9: the output equals the reference computation with the module's own weights,
in a layout the check finds itself.

The projections are the module's nn.Linear layers, GPT-2 Conv1D layers and 2-d parameters
used as x @ W (the book's SelfAttention_v1), whatever their names. The check tries role
assignments (query, key, value, output; one fused layer split in three, grouped-query widths
with any number of key/value heads; a query layer beside a fused key/value one; a latent
down-then-up projection; with or without an output projection; a list of head submodules
followed by an output projection) and head counts, and reports the one that reproduces the
output. Layer names (`W_query`, `to_k`, `wv`, `qkv`, `c_proj`, ...) say which assignment the
author meant: an output equal only under another (keys and values swapped, an output
projection never applied) is a bug. On no match the reference is recomputed with each
classic bug (a missing or wrong scale, softmax over the queries, heads split or merged
without a transpose, no mask, a mask off by one diagonal, an inverted mask) and the report
names the ones that reproduce the module, with the suspect line of its source. A sliding
window is detected and reported, not flagged. PyTorch's in_proj_weight and attnlab's own
MultiHeadAttention have fixed layouts.

Shapes: b batch, t tokens, h query heads, g key/value heads, hd head width, hv value width.
"""

from __future__ import annotations

import functools
import itertools
import re
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from attnlab.check import arguments, rotary
from attnlab.check import causes as source
from attnlab.check.probe import Probe, is_linear_like
from attnlab.check.properties import tolerances
from attnlab.check.report import PropertyResult, failed, joined, passed, skipped
from attnlab.check.rotary import Rotary
from attnlab.check.runner import describe
from attnlab.heads import repeat_kv

NAME, TITLE = "reference", "equals the reference computation with the same weights"
BUGS = {
    "no_scale": "the 1/sqrt(head_dim) scale is missing: divide the scores by "
    "keys.shape[-1] ** 0.5 before the softmax",
    "scale_d_out": "the scores are scaled by 1/sqrt(d_out) instead of 1/sqrt(head_dim) "
    "(keys.shape[-1] after the heads are split)",
    "scale_by_d_out": "the scores are scaled by 1/d_out (d_model) instead of 1/sqrt(head_dim)",
    "scale_by_head_dim": "the scores are scaled by 1/head_dim instead of 1/sqrt(head_dim) "
    "(the square root is missing)",
    "softmax_queries": "softmax runs over the queries (dim=1 or dim=-2) instead of the keys "
    "(dim=-1)",
    "view_no_transpose": "heads are split with view(b, num_heads, num_tokens, head_dim) and "
    "no transpose: use view(b, num_tokens, num_heads, head_dim).transpose(1, 2), and "
    "transpose back before merging",
    "merge_no_transpose": "heads are merged back with view(b, num_tokens, d_out) and no "
    "transpose(1, 2) first",
    "no_mask": "the causal mask is not applied: nothing hides the future",
    "mask_diagonal": "the mask also hides the diagonal: torch.triu(..., diagonal=1), not "
    "diagonal=0",
    "mask_offset": "the mask is one diagonal too high: each query sees the next token "
    "(torch.triu(..., diagonal=2) where diagonal=1 belongs)",
    "inverted_mask": "the mask is inverted: the past is masked and the future attended "
    "(tril instead of triu, or a boolean SDPA mask of the wrong polarity)",
    "scale_after_softmax": "the scale is applied after the softmax instead of to the scores",
    "keys_not_rotated": "the keys are not rotated: rotary positions are applied to the "
    "queries only (both must be rotated for the scores to depend on relative positions)",
    "queries_not_rotated": "the queries are not rotated: rotary positions are applied to the "
    "keys only",
    "kv_heads_tiled": "the key/value heads are shared in the wrong order: repeat(1, groups, "
    "1, 1) gives query head h the key/value head h % num_kv_heads; each group of adjacent "
    "query heads shares one (repeat_interleave(groups, dim=1), head h // groups)",
    "rotary_pairs_on_halves": "the rotary convention is swapped: the cos/sin tables are "
    "laid out for rotate_half (each frequency written twice, cat(freqs, freqs): feature i "
    "turns with feature i + head_dim/2, as in HF's Llama and the book's models) but the "
    "rotation pairs interleaved features (2i with 2i + 1, rotate_every_two): rotate with "
    "rotate_half, or lay the tables out per pair (repeat_interleave(freqs, 2))",
    "rotary_halves_on_pairs": "the rotary convention is swapped: the cos/sin tables are laid "
    "out per interleaved pair (repeat_interleave(freqs, 2): feature 2i turns with 2i + 1, as "
    "in GPT-J and Meta's Llama) but the rotation is rotate_half (feature i with feature i + "
    "head_dim/2): rotate each pair, or lay the tables out as cat(freqs, freqs)",
    "softcap_missing": "the scores are not capped: the config declares "
    "attn_logit_softcapping, and the layer never applies softcap * tanh(scores / softcap)",
}
_ROTARY_BUGS = ("keys_not_rotated", "queries_not_rotated")
# a convention swap, for a rotary layout of that style: the tables of the style, the turn
# of the other
_SWAPS = {"rotary_pairs_on_halves": "halves", "rotary_halves_on_pairs": "pairs"}
# masks that hide a whole row, tried with both fills (-inf, and a finite minimum: "_finite")
BUGS["inverted_mask_strict"] = BUGS["inverted_mask"]  # the diagonal hidden too
BUGS["mask_diagonal_finite"] = BUGS["mask_diagonal"]
BUGS["inverted_mask_strict_finite"] = BUGS["inverted_mask"]
# the source's suspect kinds that point at the line of each bug
_POINTERS = {
    "softmax_queries": ("softmax_dim",),
    "view_no_transpose": ("split_without_transpose", "merge_without_transpose"),
    "merge_no_transpose": ("merge_without_transpose",),
    "no_mask": ("masked_fill_discarded", "sdpa_not_causal"),
    "mask_offset": ("mask_offset",),
    "inverted_mask": ("sdpa_inverted_mask",),
}
# a bug whose source pointer names only part of it (the split, or the merge)
_BROADER_THAN_LINE = ("view_no_transpose",)
_MASK_BUGS = (
    "no_mask",
    "mask_diagonal",
    "mask_offset",
    "inverted_mask",
    "inverted_mask_strict",
    "mask_diagonal_finite",
    "inverted_mask_strict_finite",
)
_MAX_LAYOUTS = 512


@dataclass
class Layer:
    """A projection: (out, in) weight and bias in float64, and its path in the module."""

    name: str
    weight: torch.Tensor
    bias: torch.Tensor | None

    @property
    def width(self) -> int:
        return self.weight.shape[0]

    @property
    def fan_in(self) -> int:
        return self.weight.shape[1]


@dataclass
class Projections:
    """One attention computation: query, key and value projections and head counts."""

    q: Layer
    k: Layer
    v: Layer
    num_heads: int
    num_kv_heads: int


@dataclass
class Layout:
    """Attention groups whose outputs are concatenated, then an optional output layer."""

    groups: list[Projections]
    out: Layer | None
    what: str
    consistent: bool = True  # the layer names agree with the roles
    window: int | None = None
    misnamed: list[str] = field(default_factory=list)  # why the names disagree
    unused: int = 0  # projection layers the layout leaves out
    rotary: Rotary | None = None  # rotary positions on queries and keys (check.rotary)
    scale: float | None = None  # a declared score scale other than 1/sqrt(head_dim)
    softcap: float | None = None  # scores capped as softcap * tanh(scores / softcap)
    norms: dict[str, nn.Module] = field(default_factory=dict)  # "q"/"k": the module's norms


def check_reference(probe: Probe, tokens: int, seed: int, causal: bool) -> PropertyResult:
    """Property 9, on the probe's module in eval mode.

    Args:
        probe: the audited module and how to call it.
        tokens: an input length the module runs on.
        seed: the seed of the input.
        causal: whether the reference is causal.

    Returns:
        passed (with the layout found), failed (with the bugs that reproduce the output)
        or skipped (no layout found, and why).
    """
    layouts, certain, why = candidate_layouts(probe.module, probe.d_in)
    if not layouts:
        return skipped(NAME, TITLE, why)
    layouts = [replace(layout, **_declared_scores(probe.module)) for layout in layouts]
    suspects = source.find_suspects(probe.module)
    positions = source.explain(suspects, ("uses_positions",))
    if arguments.ROTARY_NAMES & set(probe.extra):
        positions.append("the rotary tables the check gives its forward")
    x = probe.inputs(2, tokens, seed)
    with torch.no_grad():
        out = probe(x).double()
    continued = _continued(probe, x, out)
    x, tol = x.double(), tolerances(probe.dtype)
    named = sorted(layouts, key=lambda layout: (not layout.consistent, layout.unused))
    rotated, owned = _rotary_layouts(probe.module, named, positions)
    if rotated:  # rotary tables or positions: the rotary layouts first
        certain = _accounted(probe.module, layouts, owned)
        layouts, named = rotated + layouts, rotated + named
    elif positions and certain:  # other positions computed without state
        certain, why = False, f"{why}; positions applied in the forward: {positions[0]}"
    match = _first_match(out, x, layouts, causal, tol)
    if match is not None and match.consistent and continued is not None:
        split, gap, how = continued
        if isinstance(gap, Exception) or not _close(out[:, split:], gap, tol):
            return failed(NAME, TITLE, *_offset_finding(out[:, split:], gap, split, how))
    if match is not None and match.consistent and match.softcap is not None:
        capped = _cap_seen(probe, x, match, causal, tol)
        if capped is not None and not capped[0]:
            return failed(NAME, TITLE, capped[1], [BUGS["softcap_missing"]])
        note = capped[1] if capped else "; the cap changes nothing at inputs up to 64x: unverified"
        return passed(NAME, TITLE, f"equal to the reference ({_describe(match)}){note}")
    if match is not None and match.consistent:
        return passed(NAME, TITLE, f"equal to the reference ({_describe(match)})")
    if match is not None:
        observed = (
            f"equal to the reference only with {match.what}; it equals the reference with the bug"
        )
        return failed(NAME, TITLE, observed, match.misnamed)
    fits, fitted = _fitting_bugs(out, x, _tried(named, certain), causal, tol, suspects)
    closest = fitted or named[0]
    gap = _gap(out, reference(x, closest, causal))
    observed = f"differs from the reference ({_describe(closest)}) by up to {gap:.3g}"
    if fits:
        return failed(NAME, TITLE, f"{observed}; it equals the reference with the bug", fits)
    if not certain:
        return skipped(
            NAME,
            TITLE,
            f"{why}; no role assignment of its projections reproduces "
            f"the output (tried {len(layouts)})",
        )
    # a mask suspect (a flag that leaves the mask unbuilt, ...) explains only a module that
    # leaks: one that keeps the future hidden is not blamed on its masking lines
    leaks = causal and _leaks(probe, x, out, tol)
    kinds = [kind for kind in source.BUG_KINDS if leaks or kind not in source.MASK_KINDS]
    causes = source.explain(suspects, tuple(kinds)) or [
        "none of the classic bugs reproduces it (missing or wrong scale, softmax over the "
        "queries, heads split without a transpose, no mask): compare the forward with the "
        "book's listing line by line"
    ]
    return failed(NAME, TITLE, observed, causes)


def _tried(named: list[Layout], certain: bool) -> list[Layout]:
    """The layouts the classic bugs are tried in: the best-named first, fewer when state
    outside the projections leaves few fits possible; the layouts without rotary positions
    too when rotary ones lead (a module whose source mentions rotation may not rotate: its
    bug must still be found in the plain layout)."""
    limit = 64 if certain else 16
    rotated = [layout for layout in named if layout.rotary is not None]
    plain = [layout for layout in named if layout.rotary is None]
    return rotated[:limit] + plain[: limit if not rotated else 16]


def _leaks(probe: Probe, x: torch.Tensor, out: torch.Tensor, tol) -> bool:
    """Whether the output before the middle of x changes when the tokens after it do (x in
    float64, out the module's output for it)."""
    split = x.shape[1] // 2
    if split < 1:
        return False
    changed = x.clone()
    changed[:, split:] = x[:, split:].flip(1) + 1.0
    with torch.no_grad():
        other = probe(changed.to(probe.dtype)).double()
    return not _close(out[:, :split], other[:, :split], tol)


_CAP_FACTORS = (4.0, 16.0, 64.0)  # input scales at which a score cap starts to matter


def _cap_seen(probe: Probe, x: torch.Tensor, layout: Layout, causal: bool, tol):
    """(whether the module caps its scores, what was seen) at the first input scale where
    the cap changes the reference (a cap of 50 changes nothing at unit inputs); None when
    none does. x is the float64 input."""
    for factor in _CAP_FACTORS:
        scaled = x * factor
        capped = reference(scaled, layout, causal)
        uncapped = reference(scaled, layout, causal, "softcap_missing")
        if _close(capped, uncapped, tol):
            continue
        with torch.no_grad():
            out = probe(scaled.to(probe.dtype)).double()
        seen = f"inputs scaled {factor:g}x, where the cap changes the reference by up to "
        seen += f"{_gap(capped, uncapped):.3g}"
        if _close(out, capped, tol):
            return True, f"; the cap seen at {seen}"
        gap_capped, gap_uncapped = _gap(out, capped), _gap(out, uncapped)
        return gap_uncapped >= gap_capped, (
            f"at {seen}, the output differs from the capped reference by up to "
            f"{gap_capped:.3g} and from the uncapped one by {gap_uncapped:.3g}"
        )
    return None


def _continued(probe: Probe, x: torch.Tensor, out: torch.Tensor):
    """For a module that continues from a position: (split, its output for x's tokens from
    split on, called after a call on the tokens before, how it was continued); else None.
    Two kinds continue: a layer keeping its own cache and taking the position it continues
    from (forward(x, start_pos, ...), Meta's Llama), and a transformers attention class
    given a cache object (its forward's cache parameter, found by probing the signature:
    `cache` in transformers 5.24, `past_key_values` before), a new DynamicCache."""
    if probe.unbatched or probe.seq_first or x.shape[1] < 2:
        return None
    cache_name = _transformers_cache_argument(probe.module)
    if "start_pos" not in probe.extra and cache_name is None:
        return None
    split = x.shape[1] // 2
    given, how = {}, "start_pos"
    if cache_name is not None:
        given, how = {cache_name: _new_cache(probe.module)}, f"a DynamicCache as {cache_name}"
    with torch.no_grad():
        probe.call(x[:, :split].contiguous(), 0, **given)
        try:
            continued = probe.call(x[:, split:].contiguous(), split, **given).double()
        except Exception as error:  # a continuation the layer cannot run is the finding
            continued = error
    return split, continued, how


def _transformers_cache_argument(module: nn.Module) -> str | None:
    """The cache parameter of a transformers attention class's forward, else None."""
    from attnlab.check.model import find_cache_argument  # the whole-model audit's probe

    return find_cache_argument(module) if _from_transformers(module) else None


def _from_transformers(module: nn.Module) -> bool:
    """Whether the module's class is transformers' own or a subclass of one."""
    return any(c.__module__.startswith("transformers.") for c in type(module).__mro__)


def _new_cache(module: nn.Module) -> object:
    from transformers import DynamicCache  # a transformers class's own: installed

    try:
        return DynamicCache(config=module.config)
    except (TypeError, AttributeError):  # releases whose DynamicCache takes no config
        return DynamicCache()


def _offset_finding(full: torch.Tensor, continued, split: int, how: str):
    """(observed, causes) for a continuation that differs from the full forward, or raised
    (continued is then the exception)."""
    if how == "start_pos":
        observed = f"continuing from position {split} (start_pos={split}"
        cause = (
            "the positions do not continue from start_pos: the rotary tables, the cache "
            "write or the cache read start at 0 instead of start_pos (cache_k[:, start_pos "
            ": start_pos + seqlen] = xk, then keys = cache_k[:, : start_pos + seqlen])"
        )
    else:
        observed = f"continuing from position {split} ({how}"
        cause = (
            "the cached keys and values are not attended: the layer does not pass its keys "
            "and values through the cache's update() and attend to what it returns"
        )
    observed += ", after a call on the tokens before) "
    if isinstance(continued, Exception):
        observed += f"raised {describe(continued)}"
    else:
        observed += f"differs from the full forward by up to {_gap(continued, full):.3g}"
    return observed, [cause]


_ROTARY_LAYOUTS = 4  # the best-named layouts tried with each rotary candidate


def _rotary_layouts(module, named, positions) -> tuple[list[Layout], list[str]]:
    """Each of the first layouts with each rotary candidate the module suggests (rotary
    tables among its state, or positions computed in its forward), and the state names the
    candidates account for; nothing when it suggests none."""
    rotated, owned = [], []
    for layout in named[:_ROTARY_LAYOUTS]:
        group = layout.groups[0]
        specs, found = rotary.candidates(module, group.q.width // group.num_heads)
        owned += found
        rotated += [replace(layout, rotary=spec) for spec in specs]
    if not (owned or positions):
        return [], []
    return rotated, owned


def _accounted(module: nn.Module, layouts: list[Layout], owned: list[str]) -> bool:
    """Whether every piece of state outside the projections is a rotary table the rotary
    candidates read (then a rotary layout that fits is certain)."""
    layers = {name for layout in layouts for name in _layer_names(layout)}
    return all(name in owned for name in _unknown_state(module, layers))


def _layer_names(layout: Layout) -> list[str]:
    names = [layer.name for g in layout.groups for layer in (g.q, g.k, g.v)]
    names += [] if layout.out is None else [layout.out.name]
    return [part.split("[")[0] for name in names for part in name.split("+")]


def _declared_scores(module: nn.Module) -> dict:
    """The score scale and softcap a transformers attention class's config declares (Gemma
    2's query_pre_attn_scalar, Granite's attention_multiplier, attn_logit_softcapping),
    taken as the model's design. Read from the config, not the layer's own `scaling`, so
    that a copy setting a wrong one is still a bug; other modules are held to
    1/sqrt(head_dim) with no cap."""
    if not _from_transformers(module):
        return {}
    config = getattr(module, "config", None)
    declared = {}
    scalar = _positive(config, "query_pre_attn_scalar")
    multiplier = _positive(config, "attention_multiplier")
    if scalar is not None:
        declared["scale"] = scalar**-0.5
    elif multiplier is not None:
        declared["scale"] = multiplier
    softcap = _positive(config, "attn_logit_softcapping")
    if softcap is not None:
        declared["softcap"] = softcap
    return declared


def _positive(config: object, name: str) -> float | None:
    value = getattr(config, name, None)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    return float(value) if ok else None


def _describe(layout: Layout) -> str:
    what = layout.what if layout.rotary is None else f"{layout.what}, {layout.rotary}"
    if layout.norms:
        what += ", queries and keys normed by the module's own norms"
    group = layout.groups[0]
    if layout.scale is not None and layout.scale != (group.q.width // group.num_heads) ** -0.5:
        what += f", scale {layout.scale:.4g} as its config declares"
    if layout.softcap is not None:
        what += f", scores capped at {layout.softcap:g} (its config's attn_logit_softcapping)"
    if layout.window is None:
        return what
    keys = layout.window - 1
    return f"{what}, a sliding window: each query sees itself and {keys} keys before"


def _first_match(out, x, layouts, causal, tol) -> Layout | None:
    """The first layout (name-consistent ones first) that reproduces out, trying sliding
    windows after full attention."""
    ordered = sorted(layouts, key=lambda layout: (not layout.consistent, layout.unused))
    shaped = [layout for layout in ordered if _width(layout) == out.shape[-1]]
    for layout in shaped:
        if _close(out, reference(x, layout, causal), tol):
            return layout
    if not causal:
        return None
    for layout in [layout for layout in shaped if layout.consistent][:64]:
        for window in range(1, x.shape[1] - 1 + 1):
            windowed = replace(layout, window=window)
            if window < x.shape[1] and _close(out, reference(x, windowed, causal), tol):
                return windowed
    return None


def _width(layout: Layout) -> int:
    if layout.out is not None:
        return layout.out.width
    return sum(g.v.width // g.num_kv_heads * g.num_heads for g in layout.groups)


def _fitting_bugs(out, x, layouts, causal, tol, suspects) -> tuple[list[str], Layout | None]:
    """Explanations of the variants that match the module's output and differ from the
    correct reference (a variant equal to it, e.g. no transpose with one head, proves
    nothing), each with the suspect line of the source when there is one; and the layout
    they fit in (None when none fits)."""
    fits: list[str] = []
    for layout in layouts:
        if _width(layout) != out.shape[-1]:
            continue
        expected = reference(x, layout, causal)
        for variant, explanation in BUGS.items():
            if (variant in _MASK_BUGS and not causal) or explanation in fits:
                continue
            if variant in _ROTARY_BUGS and layout.rotary is None:
                continue
            if variant in _SWAPS and getattr(layout.rotary, "style", None) != _SWAPS[variant]:
                continue
            if variant == "softcap_missing" and layout.softcap is None:
                continue
            try:
                candidate = reference(x, layout, causal, variant)
            except RuntimeError:  # a variant that does not fit these shapes
                continue
            if not _close(candidate, expected, tol) and _close(out, candidate, tol):
                located = source.explain(suspects, _POINTERS.get(_family(variant), ()))
                fits += located  # the line first: the same cause, where it is
                if not located or _family(variant) in _BROADER_THAN_LINE:
                    fits.append(explanation)
        if fits:
            return fits, layout
    return fits, None


def _family(variant: str) -> str:
    """The bug a variant is a form of (inverted_mask_strict_finite -> inverted_mask)."""
    return variant.removesuffix("_finite").removesuffix("_strict")


def _close(a: torch.Tensor, b: torch.Tensor, tol: tuple[float, float]) -> bool:
    """Equal within the tolerance relative to the output's scale (GPT-2's 0.02-std weights
    give outputs near 1e-3: an absolute 1e-4 would call any layout equal)."""
    if a.shape != b.shape:
        return False
    scale = b.abs().nan_to_num(0.0, 0.0, 0.0).max().clamp_min(1e-30).item()
    atol, rtol = max(tol[0], 1e-4) * min(scale, 1.0), max(tol[1], 1e-4)  # float32 vs 64
    return torch.allclose(a, b, atol=atol, rtol=rtol, equal_nan=True)


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return (a - b).abs().nan_to_num(torch.inf).max().item()


# --------------------------------------------------------------------------- the computation


def reference(
    x: torch.Tensor, layout: Layout, causal: bool, variant: str = "correct"
) -> torch.Tensor:
    """The attention of x (b, t, d_in) in `layout`, with one classic bug when `variant`
    names one (a key of BUGS)."""
    out = torch.cat([_attend(x, group, causal, variant, layout) for group in layout.groups], -1)
    return out if layout.out is None else _linear(out, layout.out)


def _attend(x, p: Projections, causal: bool, variant: str, layout: Layout) -> torch.Tensor:
    b, t, _ = x.shape
    rope, window = layout.rotary, layout.window
    q, k, v = _linear(x, p.q), _linear(x, p.k), _linear(x, p.v)  # (b, t, width)
    head_dim = q.shape[-1] // p.num_heads
    q, k = _normed(q, layout.norms.get("q")), _normed(k, layout.norms.get("k"))
    q = _heads(q, p.num_heads, variant)  # (b, h, t, hd)
    k, v = _heads(k, p.num_kv_heads, variant), _heads(v, p.num_kv_heads, variant)  # (b, g, t, .)
    q = _normed(q, layout.norms.get("q"), whole=p.q.width)
    k = _normed(k, layout.norms.get("k"), whole=p.k.width)
    if rope is not None:
        swapped = variant in _SWAPS
        q = q if variant == "queries_not_rotated" else rope.apply(q, swapped)
        k = k if variant == "keys_not_rotated" else rope.apply(k, swapped)
    groups = p.num_heads // p.num_kv_heads
    if variant == "kv_heads_tiled":  # query head h reads key/value head h % num_kv_heads
        k, v = k.repeat(1, groups, 1, 1), v.repeat(1, groups, 1, 1)  # (b, h, t, .)
    else:
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)  # (b, h, t, .)
    scale = {
        "no_scale": 1.0,
        "scale_d_out": (head_dim * p.num_heads) ** -0.5,
        "scale_by_d_out": 1.0 / (head_dim * p.num_heads),
        "scale_by_head_dim": 1.0 / head_dim,
    }.get(variant, head_dim**-0.5 if layout.scale is None else layout.scale)
    scores = q @ k.transpose(-2, -1)  # (b, h, t, t)
    if variant != "scale_after_softmax":
        scores = scores * scale
    if layout.softcap is not None and variant != "softcap_missing":
        scores = layout.softcap * torch.tanh(scores / layout.softcap)
    if causal and variant != "no_mask":
        # a row masked whole: -inf gives NaN (attnlab's reference: zeros), a finite minimum
        # (torch.finfo(dtype).min, as GPT-NeoX and HF write the mask) a uniform row
        fill = torch.finfo(scores.dtype).min if variant.endswith("_finite") else -torch.inf
        scores = scores.masked_fill(_masked(t, variant.removesuffix("_finite"), window), fill)
    weights = torch.softmax(scores, dim=-2 if variant == "softmax_queries" else -1)
    if variant == "scale_after_softmax":
        weights = weights * scale
    out = weights.nan_to_num(0.0) @ v  # (b, h, t, hv)
    if variant in ("view_no_transpose", "merge_no_transpose"):
        return out.reshape(b, t, -1)  # merged without the transpose back
    return out.transpose(1, 2).reshape(b, t, -1)  # (b, h, t, hv) -> (b, t, h * hv)


@functools.lru_cache(maxsize=64)  # read only: masked_fill returns a new tensor
def _masked(t: int, variant: str, window: int | None) -> torch.Tensor:
    """(t, t) bool, True where the scores are masked: the future, or a bug's version."""
    ones = torch.ones(t, t, dtype=torch.bool)
    if variant == "mask_diagonal":
        return ones.triu(0)
    if variant == "mask_offset":
        return ones.triu(2)
    if variant == "inverted_mask":
        return ones.tril(-1)
    if variant == "inverted_mask_strict":  # the diagonal hidden too: only later keys seen
        return ones.tril(0)
    if window is not None:
        return ones.triu(1) | ones.tril(-window)  # the future, and keys window or more back
    return ones.triu(1)


def _heads(y: torch.Tensor, heads: int, variant: str) -> torch.Tensor:
    b, t, width = y.shape
    if variant == "view_no_transpose":
        return y.reshape(b, heads, t, width // heads)  # the bug: (b, t, d) read as (b, h, t, hd)
    return y.view(b, t, heads, width // heads).transpose(1, 2)  # (b, t, d) -> (b, h, t, hd)


def _normed(t: torch.Tensor, norm: nn.Module | None, whole: int | None = None) -> torch.Tensor:
    """t through the module's own norm where the norm's width is t's last dimension: the
    whole projection (b, t, width) before the heads are split (whole None), or each head
    (b, h, t, hd) after, when the norm is not as wide as the whole projection; t unchanged
    otherwise."""
    width = None if norm is None else next(norm.parameters()).numel()
    if width != t.shape[-1] or width == whole:
        return t
    return norm(t).to(t.dtype)


def _linear(x: torch.Tensor, layer: Layer) -> torch.Tensor:
    out = x @ layer.weight.T
    return out if layer.bias is None else out + layer.bias


# --------------------------------------------------------------------------- the layouts


def candidate_layouts(module: nn.Module, d_in: int) -> tuple[list[Layout], bool, str]:
    """(layouts to try, whether the layout is certain, what was found or why none)."""
    from attnlab.attention import MultiHeadAttention  # the production layer, imported late

    if isinstance(module, MultiHeadAttention):
        return _attnlab_layout(module)
    weight = getattr(module, "in_proj_weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] % 3 == 0:
        return _torch_layout(module)
    layers = collect_layers(module, d_in)
    if not layers:
        return [], False, "no nn.Linear, Conv1D or 2-d weight parameter to take as projections"
    norms = _query_key_norms(module)
    extra = _unknown_state(module, {layer.name for layer in layers} | set(norms))
    layouts = _wrapper_layouts(module, layers, d_in) + _flat_layouts(module, layers, d_in)
    if not layouts:
        return [], False, f"no assignment of its {len(layers)} projections fits the widths"
    if norms:
        layouts = [replace(layout, norms=_frozen(norms)) for layout in layouts]
    informative = any(layout.consistent for layout in layouts) and _named(layers)
    why = f"{len(layers)} projection layers"
    if extra:
        why += f"; state outside them ({joined(extra, 4)}): a positional bias or rotation?"
    return layouts[:_MAX_LAYOUTS], informative and not extra, why


def _query_key_norms(module: nn.Module) -> dict[str, nn.Module]:
    """{path: norm} of the module's query and key norms, the query's first (Qwen3's, OLMo
    2's, Gemma 3's: per head or over the whole projection), when it has both: a
    normalisation (a class or a name saying norm, or a name ending in _ln) at any depth,
    whose name says queries or keys (q_norm, query_layernorm, norm_q, qnorm, k_ln), holding
    one 1-d scale under any name (weight, scale, gamma) and at most a 1-d bias; else {}."""
    found: dict[str, tuple[str, nn.Module]] = {}
    for path, sub in module.named_modules():
        leaf = path.rpartition(".")[2]
        role = _norm_role(leaf)
        if path and role is not None and role not in found and _is_norm(sub, leaf):
            found[role] = (path, sub)
    if len(found) < 2:
        return {}
    return dict((found["q"], found["k"]))


def _norm_role(leaf: str) -> str | None:
    """'q' or 'k' when a norm's name says queries or keys, else None."""
    name = leaf.lower()
    for word in ("layernorm", "rmsnorm", "norm", "ln", "_"):
        name = name.replace(word, "")
    if name in ("q", "query", "queries"):
        return "q"
    return "k" if name in ("k", "key", "keys") else None


def _is_norm(sub: nn.Module, leaf: str) -> bool:
    """A normalisation holding one 1-d scale (and at most a 1-d bias of the same width)."""
    named = "norm" in type(sub).__name__.lower() or "norm" in leaf.lower()
    named = named or leaf.lower().endswith("ln")
    weights = list(sub.parameters())
    widths = {w.numel() for w in weights}
    return (
        named and len(weights) in (1, 2) and all(w.dim() == 1 for w in weights) and len(widths) == 1
    )


def _frozen(norms: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """{"q": norm, "k": norm}: float64 copies in eval mode, for the reference."""
    import copy

    copies = [copy.deepcopy(norm).double().eval() for norm in norms.values()]
    return dict(zip(("q", "k"), copies, strict=True))


def collect_layers(module: nn.Module, d_in: int) -> list[Layer]:
    """Every nn.Linear (or module computing one: probe.is_linear_like), Conv1D ((in, out)
    weight) and 2-d parameter (used as x @ W) in registration order, as (out, in) float64 layers."""
    layers = []
    for path, sub in module.named_modules():
        if isinstance(sub, nn.Linear) or is_linear_like(sub):
            layers.append(_layer(path, sub.weight, getattr(sub, "bias", None)))
        elif type(sub).__name__ == "Conv1D" and getattr(sub, "weight", None) is not None:
            layers.append(_layer(path, sub.weight.T, getattr(sub, "bias", None)))
        else:
            for name, p in sub.named_parameters(recurse=False):
                if p.dim() == 2 and d_in in p.shape and not isinstance(sub, nn.Embedding):
                    weight = p.T if p.shape[0] == d_in else p  # x @ W: W is (in, out)
                    layers.append(_layer(f"{path}.{name}" if path else name, weight, None))
    return layers


def _layer(path: str, weight: torch.Tensor, bias: torch.Tensor | None) -> Layer:
    bias = bias.detach().double() if isinstance(bias, torch.Tensor) else None
    return Layer(path, weight.detach().double(), bias)


_MASK_NAMES = ("mask", "bias", "masked_bias", "causal_mask", "attn_mask", "tril", "triu")


def _unknown_state(module: nn.Module, owned: set[str]) -> list[str]:
    """Parameters and float buffers outside the projections named `owned` and outside mask
    buffers."""
    names = [n for n, _ in module.named_parameters()]
    names += [n for n, b in module.named_buffers() if b.is_floating_point()]
    return [n for n in names if not _owned(n, owned) and n.split(".")[-1] not in _MASK_NAMES]


def _owned(name: str, owned: set[str]) -> bool:
    parent = name.rpartition(".")[0]
    return name in owned or parent in owned


_ROLE_PATTERNS = {
    "qkv": r".*(qkv|c_attn|in_proj).*",
    "kv": r"(w_?|to_)?kv(_proj|_linear|_lin)?",
    "q": r"(w_?|to_)?q(uery|ueries)?(_proj|_linear|_lin|_up)?",
    "k": r"(w_?|to_)?k(ey|eys)?(_proj|_linear|_lin|_up)?",
    "v": r"(w_?|to_)?v(alue|alues)?(_proj|_linear|_lin|_up)?",
    "o": r"(w_?|to_)?o(ut|utput)?(_proj|_linear|_lin)?|(c_)?proj|dense|wo",
}


def role_hint(name: str) -> str | None:
    """The role a layer's name claims ('q', 'k', 'v', 'o', 'qkv', 'kv') or None."""
    parts = [p for p in name.lower().split(".") if not p.isdigit() and p not in ("weight",)]
    for part in reversed(parts):
        for role, pattern in _ROLE_PATTERNS.items():
            if re.fullmatch(pattern, part):
                return role
    return None


def _named(layers: list[Layer]) -> bool:
    hints = {role_hint(layer.name) for layer in layers}
    return {"q", "k", "v"} <= hints or "qkv" in hints or {"q", "kv"} <= hints


_HEAD_ATTRIBUTES = ("num_heads", "n_head", "n_heads", "num_attention_heads", "nhead", "heads")
_KV_ATTRIBUTES = ("num_kv_heads", "n_kv_heads", "num_key_value_heads", "n_kv_head", "kv_heads")


def _int_attribute(module: nn.Module, names: tuple[str, ...]) -> int | None:
    """The first positive int attribute of those names, on the module or a submodule
    (a wrapper around GPT-2's attention), or on its config (transformers' attention
    classes keep the head counts there)."""
    owners = [*module.modules(), getattr(module, "config", None)]
    for sub in owners:
        for name in names:
            value = getattr(sub, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _flat_layouts(module: nn.Module, layers: list[Layer], d_in: int) -> list[Layout]:
    """One attention over the module's layers: every (q, k, v, out) assignment."""
    heads = _int_attribute(module, _HEAD_ATTRIBUTES)
    kv_heads = _int_attribute(module, _KV_ATTRIBUTES)
    layouts = []
    for (q, k, v), used, shape, laid_out in _qkv_sources(layers, d_in):
        widths = (q.width, k.width, v.width)
        # a declared count the widths refuse (a config field the layer ignores: GPT-2 built
        # from a config naming num_key_value_heads) is dropped, the key/value count first
        counts = (
            _head_counts(*widths, heads, kv_heads)
            or _head_counts(*widths, heads, None)
            or _head_counts(*widths, None, None)
        )
        for h, g in counts:
            if laid_out is not None and (h, g) != (laid_out, laid_out):
                continue  # rows laid out per head: only that head count
            width = v.width // g * h
            outs = [None, *_outputs(layers, used, width)]
            for out in outs:
                groups = [Projections(q, k, v, h, g)]
                layouts.append(_named_layout(groups, out, shape, layers, used))
    return layouts


def _outputs(layers: list[Layer], used: set[str], width: int) -> list[Layer]:
    """Output layers the heads' concatenation (width) may go through: each unused layer
    taking that width, then each such layer followed by a later one taking its output (an
    attention module's own output projection, then the wrapper's: nn.MultiheadAttention
    followed by a Linear, as in the book's bonus MHAPyTorchClass)."""
    free = [layer for layer in layers if layer.name not in used]
    singles = [layer for layer in free if layer.fan_in == width]
    chains = [
        _chain(first, then)
        for i, first in enumerate(free)
        if first.fan_in == width
        for then in free[i + 1 :]
        if then.fan_in == first.width
    ]
    return singles + chains


def _qkv_sources(layers: list[Layer], d_in: int):
    """((q, k, v), names of the layers used, the shape's name, the head count its rows are
    laid out for or None) for every assignment."""
    inputs = [layer for layer in layers if layer.fan_in == d_in]
    chains = [
        _chain(down, up)
        for down in inputs
        for up in layers
        if up.fan_in == down.width and up.fan_in != d_in and up is not down
    ]
    for fused in [layer for layer in inputs if role_hint(layer.name) in (None, "qkv")]:
        for sizes in _fused_splits(fused.width):
            q, k, v = _split(fused, sizes)
            yield (q, k, v), {fused.name}, "fused query/key/value projection", None
        if fused.width % 3 == 0:
            for heads in _divisors(fused.width // 3):
                q, k, v = _split_per_head(fused, heads)
                shape = f"fused query/key/value projection laid out per head ({heads} heads)"
                yield (q, k, v), {fused.name}, shape, heads
    for q, kv in itertools.permutations(inputs + chains, 2):
        hints = role_hint(q.name.split("+")[-1]), role_hint(kv.name.split("+")[-1])
        named = hints[0] in (None, "q") and hints[1] in (None, "kv")
        if named and kv.width % 2 == 0 and set(_parts(q)).isdisjoint(_parts(kv)):
            k, v = _split(kv, (kv.width // 2, kv.width // 2))
            shape = "a query and a fused key/value projection"
            yield (q, k, v), {*_parts(q), *_parts(kv)}, shape, None
    for q, k, v in itertools.permutations(inputs + chains, 3):
        names = [_parts(q), _parts(k), _parts(v)]
        ups = [n[-1] for n in names]
        if len(set(ups)) == 3 and not set(names[0]) & (set(names[1]) | set(names[2])):
            yield (q, k, v), {*names[0], *names[1], *names[2]}, "separate projections", None


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]  # one head: the plain split's layout


def _split_per_head(fused: Layer, heads: int) -> list[Layer]:
    """Query, key and value rows of a fused layer laid out head by head (GPT-NeoX's
    query_key_value: head 0's query, key and value rows, then head 1's, ...)."""
    hd = fused.width // (3 * heads)
    names = ["[query]", "[key]", "[value]"]

    def rows(t: torch.Tensor | None, part: int) -> torch.Tensor | None:
        if t is None:
            return None
        per_head = t.reshape(heads, 3, hd, *t.shape[1:])  # (heads, q|k|v, hd, ...)
        return per_head[:, part].reshape(heads * hd, *t.shape[1:])

    return [
        Layer(fused.name + n, rows(fused.weight, i), rows(fused.bias, i))
        for i, n in enumerate(names)
    ]


def _parts(layer: Layer) -> list[str]:
    return layer.name.split("+")


def _chain(down: Layer, up: Layer) -> Layer:
    """x -> down -> up as one layer (a latent projection)."""
    bias = None if down.bias is None else up.weight @ down.bias
    if up.bias is not None:
        bias = up.bias if bias is None else bias + up.bias
    return Layer(f"{down.name}+{up.name}", up.weight @ down.weight, bias)


def _fused_splits(width: int) -> list[tuple[int, int, int]]:
    """(query, key, value) widths of a fused width: equal thirds, or
    grouped-query widths h * hd + 2 * g * hd."""
    splits = []
    for hd in range(1, width + 1):
        for h in range(1, width // hd + 1):
            rest = width - h * hd
            if rest > 0 and rest % (2 * hd) == 0 and h % (rest // (2 * hd)) == 0:
                splits.append((h * hd, rest // 2, rest // 2))
    return sorted(set(splits), key=lambda s: s[0] != s[1])  # equal thirds first


def _split(fused: Layer, sizes: tuple[int, ...]) -> list[Layer]:
    """The fused layer's rows cut into consecutive layers of `sizes` (query, key, value
    rows, or key and value rows)."""
    names = ["[query]", "[key]", "[value]"][-len(sizes) :]
    weights = fused.weight.split(list(sizes))
    biases = fused.bias.split(list(sizes)) if fused.bias is not None else [None] * len(sizes)
    return [Layer(fused.name + n, w, b) for n, w, b in zip(names, weights, biases, strict=True)]


def _head_counts(q_width, k_width, v_width, heads, kv_heads) -> list[tuple[int, int]]:
    """(h, g) head counts that fit the widths, the module's own counts when it has them."""
    counts = []
    for h in [heads] if heads else [d for d in range(1, q_width + 1) if q_width % d == 0]:
        if q_width % h:
            continue
        hd = q_width // h
        if k_width % hd:
            continue
        g = k_width // hd
        if g < 1 or h % g or v_width % g or (kv_heads and g != kv_heads):
            continue
        counts.append((h, g))
    return counts


def _named_layout(groups, out, shape, layers, used) -> Layout:
    """A Layout, marked inconsistent (with why) when the names claim other roles."""
    group = groups[0]
    misnamed = _misnamed_roles({"q": group.q, "k": group.k, "v": group.v})
    if out is not None and role_hint(out.name) not in (None, "o"):
        misnamed.append(f"the output goes through `{out.name}`, named for another role")
    misnamed += _unapplied_output(layers, used, out)
    heads = group.num_heads
    what = f"{shape}, {heads} head{'s' if heads > 1 else ''}"
    if group.num_kv_heads != heads:
        what += f", {group.num_kv_heads} key/value heads"
    if out is not None:
        what += f", output {out.name}"
    unused = len([n for n in layers if n.name not in used and (out is None or n is not out)])
    return Layout(groups, out, what, not misnamed, None, misnamed, unused)


def _misnamed_roles(roles: dict[str, Layer]) -> list[str]:
    """Why the roles contradict the layers' names (none for fused splits)."""
    hints = {
        role: None if "[" in layer.name else role_hint(layer.name.split("+")[-1])
        for role, layer in roles.items()
    }
    if hints["k"] == "v" and hints["v"] == "k":
        return [
            f"keys and values are swapped: the keys are computed with `{roles['v'].name}` and "
            f"the values with `{roles['k'].name}`"
        ]
    if hints["q"] == "k" and hints["k"] == "q":
        return [
            "queries and keys are swapped: the scores are keys @ queries.T instead of "
            "queries @ keys.T"
        ]
    return [
        f"{_ROLE_WORDS[role]} come from `{roles[role].name}`, named for {_ROLE_WORDS[hint]}"
        for role, hint in hints.items()
        if hint not in (None, role)
    ]


def _unapplied_output(layers: list[Layer], used: set[str], out: Layer | None) -> list[str]:
    """The output projection is missing when a layer named like one is left unused."""
    if out is not None:
        return []
    unused = [n.name for n in layers if n.name not in used and role_hint(n.name) == "o"]
    if not unused:
        return []
    return [
        f"the output projection `{unused[0]}` is missing: it is defined but the output "
        f"equals the merged heads without it (return self.{unused[0]}(context_vec))"
    ]


_ROLE_WORDS = {
    "q": "the queries",
    "k": "the keys",
    "v": "the values",
    "o": "output",
    "qkv": "fused query/key/value",
    "kv": "fused key/value",
}


def _wrapper_layouts(module: nn.Module, layers: list[Layer], d_in: int) -> list[Layout]:
    """A list of head submodules (each one attention over its own layers) whose outputs are
    concatenated, then an optional output layer outside the list."""
    layouts = []
    for list_name, heads in module.named_children():
        if not isinstance(heads, nn.ModuleList) or not heads:
            continue
        per_head = [_flat_layouts(head, collect_layers(head, d_in), d_in) for head in heads]
        if not all(per_head) or len({len(options) for options in per_head}) != 1:
            continue
        inside = {f"{list_name}.{layer.name}" for layer in collect_layers(heads, d_in)}
        for options in zip(*per_head, strict=True):
            if any(option.out is not None for option in options):
                continue
            groups = [group for option in options for group in option.groups]
            width = sum(_width(option) for option in options)
            outs = [None] + [o for o in layers if o.name not in inside and o.fan_in == width]
            for out in outs:
                misnamed = [m for option in options for m in option.misnamed]
                misnamed += _unapplied_output(layers, inside, out)
                what = f"{len(heads)} head modules in `{list_name}`"
                what += f", output {out.name}" if out is not None else ""
                layouts.append(Layout(groups, out, what, not misnamed, None, misnamed))
    return layouts


def _torch_layout(module: nn.Module) -> tuple[list[Layout], bool, str]:
    fused = _layer("in_proj_weight", module.in_proj_weight, getattr(module, "in_proj_bias", None))
    d = fused.width // 3
    q, k, v = _split(fused, (d, d, d))
    out_proj = getattr(module, "out_proj", None)
    if isinstance(out_proj, nn.Linear):
        out = _layer("out_proj", out_proj.weight, out_proj.bias)
    elif isinstance(getattr(module, "out_proj_weight", None), torch.Tensor):  # F.mha_forward's
        bias = getattr(module, "out_proj_bias", None)
        out = _layer("out_proj_weight", module.out_proj_weight, bias)
    else:
        out = None
    heads = module.num_heads
    layout = Layout([Projections(q, k, v, heads, heads)], out, f"in_proj_weight, {heads} heads")
    return [layout], True, "in_proj_weight"


def _attnlab_layout(module) -> tuple[list[Layout], bool, str]:
    if module.rope is not None or module.window is not None or not module.fused:
        return (
            [],
            False,
            "attnlab module with rope, a window or cross-attention: not in the layouts",
        )
    w = module.qkv_weights()  # attnlab's own accessor: the fused layout is known there
    q, k, v = (
        _layer(f"qkv_proj[{role}]", weight, bias)
        for role, weight, bias in zip(("query", "key", "value"), w.weights, w.biases, strict=True)
    )
    out = _layer("out_proj", module.out_proj.weight, module.out_proj.bias)
    groups = [Projections(q, k, v, module.num_heads, module.num_kv_heads)]
    return [Layout(groups, out, f"attnlab qkv_proj, {module.num_heads} heads")], True, "attnlab"
