"""Property 9: the output equals the reference computation with the module's own weights,
when they follow a known layout: the book's W_query/W_key/W_value (nn.Linear, or
nn.Parameter used as x @ W) with an optional out_proj and num_heads, the book's wrapper (a
`heads` list of such modules), PyTorch's in_proj_weight, or attnlab's MultiHeadAttention.

On a mismatch the reference is recomputed with each classic bug (no 1/sqrt(d) scale, the
scale of d_out instead of head_dim, softmax over the queries, heads split with view and no
transpose, no mask) and the report names the ones that reproduce what the module computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from attnlab.check.probe import Probe
from attnlab.check.properties import tolerances
from attnlab.check.report import PropertyResult, failed, passed, skipped

NAME, TITLE = "reference", "equals the reference computation with the same weights"
BUGS = {
    "no_scale": "the 1/sqrt(head_dim) scale is missing: divide the scores by "
    "keys.shape[-1] ** 0.5 before the softmax",
    "scale_d_out": "the scores are scaled by sqrt(d_out) instead of sqrt(head_dim) "
    "(keys.shape[-1] after the heads are split)",
    "softmax_queries": "softmax runs over the queries (dim=1 or dim=-2) instead of the keys "
    "(dim=-1)",
    "view_no_transpose": "heads are split with view(b, num_heads, num_tokens, head_dim) and "
    "no transpose: use view(b, num_tokens, num_heads, head_dim).transpose(1, 2), and "
    "transpose back before merging",
    "merge_no_transpose": "heads are merged back with view(b, num_tokens, d_out) and no "
    "transpose(1, 2) first",
    "no_mask": "the causal mask is not applied (masked_fill without the trailing "
    "underscore throws its result away, or SDPA without is_causal=True)",
    "mask_diagonal": "the mask also hides the diagonal: torch.triu(..., diagonal=1), not "
    "diagonal=0",
    "inverted_mask": "the mask is inverted: the past is masked and the future attended "
    "(tril instead of triu, or a boolean SDPA mask of the wrong polarity)",
    "scale_after_softmax": "the scale is applied after the softmax instead of to the scores",
    "qk_swapped": "the scores are keys @ queries.T instead of queries @ keys.T",
}


@dataclass
class Projections:
    """One attention computation's weights in nn.Linear's (out, in) layout, float64."""

    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    bq: torch.Tensor | None
    bk: torch.Tensor | None
    bv: torch.Tensor | None
    num_heads: int
    num_kv_heads: int
    out_w: torch.Tensor | None = None
    out_b: torch.Tensor | None = None


def check_reference(probe: Probe, tokens: int, seed: int, causal: bool) -> PropertyResult:
    """Property 9, on the probe's module in eval mode."""
    layout, what = find_layout(probe.module)
    if layout is None:
        return skipped(NAME, TITLE, what)
    x = probe.inputs(2, tokens, seed)
    with torch.no_grad():
        out = probe(x).double()
    expected = reference(x.double(), layout, causal)
    if out.shape != expected.shape:
        observed = f"output {tuple(out.shape)}, the reference {tuple(expected.shape)}"
        return failed(NAME, TITLE, observed, ["the heads are merged into the wrong width"])
    tol = tolerances(probe.dtype)
    if _close(out, expected, tol):
        return passed(NAME, TITLE, f"equal to the reference ({what})")
    observed = f"differs from the reference ({what}) by up to {_gap(out, expected):.3g}"
    fits = _fitting_bugs(out, x.double(), layout, causal, expected, tol)
    if fits:
        return failed(NAME, TITLE, f"{observed}; it equals the reference with the bug", fits)
    causes = [
        "none of the classic bugs reproduces it (missing or wrong scale, softmax over the "
        "queries, heads split without a transpose, no mask): compare the forward with the "
        "book's listing line by line"
    ]
    return failed(NAME, TITLE, observed, causes)


def _fitting_bugs(out, x, layout, causal, expected, tol) -> list[str]:
    """Explanations of the variants that match the module's output and differ from the
    correct reference (a variant equal to it, e.g. no transpose with one head, proves
    nothing)."""
    fits = []
    for variant, explanation in BUGS.items():
        if variant in _MASK_BUGS and not causal:
            continue
        candidate = reference(x, layout, causal, variant)
        if not _close(candidate, expected, tol) and _close(out, candidate, tol):
            fits.append(explanation)
    return fits


_MASK_BUGS = ("no_mask", "mask_diagonal", "inverted_mask")


def _close(a: torch.Tensor, b: torch.Tensor, tol: tuple[float, float]) -> bool:
    atol, rtol = max(tol[0], 1e-4), max(tol[1], 1e-4)  # float32 against float64
    return a.shape == b.shape and torch.allclose(a, b, atol=atol, rtol=rtol, equal_nan=True)


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().nan_to_num(torch.inf).max().item()


def reference(
    x: torch.Tensor, layout: list[Projections], causal: bool, variant: str = "correct"
) -> torch.Tensor:
    """The attention of x (b, t, d_in) with each Projections, outputs side by side."""
    return torch.cat([_attend(x, p, causal, variant) for p in layout], dim=-1)


def _attend(x: torch.Tensor, p: Projections, causal: bool, variant: str) -> torch.Tensor:
    b, t, _ = x.shape
    q, k, v = (_linear(x, w, bias) for w, bias in ((p.wq, p.bq), (p.wk, p.bk), (p.wv, p.bv)))
    d_out = q.shape[-1]
    head_dim = d_out // p.num_heads
    q, k, v = (
        _heads(y, n, head_dim, variant)
        for y, n in ((q, p.num_heads), (k, p.num_kv_heads), (v, p.num_kv_heads))
    )
    groups = p.num_heads // p.num_kv_heads
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (b, h, t, hd)
    scale = {"no_scale": 1.0, "scale_d_out": d_out**-0.5}.get(variant, head_dim**-0.5)
    if variant == "qk_swapped":
        q, k = k, q
    scores = q @ k.transpose(-2, -1)  # (b, h, t, t)
    if variant != "scale_after_softmax":
        scores = scores * scale
    if causal and variant != "no_mask":
        scores = scores.masked_fill(_masked(t, variant), -torch.inf)
    weights = torch.softmax(scores, dim=-2 if variant == "softmax_queries" else -1)
    if variant == "scale_after_softmax":
        weights = weights * scale
    out = weights.nan_to_num(0.0) @ v  # (b, h, t, hd)
    if variant in ("view_no_transpose", "merge_no_transpose"):
        out = out.reshape(b, t, d_out)  # merged without the transpose back
    else:
        out = out.transpose(1, 2).reshape(b, t, d_out)  # (b, h, t, hd) -> (b, t, d_out)
    return out if p.out_w is None else _linear(out, p.out_w, p.out_b)


def _masked(t: int, variant: str) -> torch.Tensor:
    """(t, t) bool, True where the scores are masked: the future, or a bug's version."""
    ones = torch.ones(t, t, dtype=torch.bool)
    if variant == "mask_diagonal":
        return ones.triu(0)
    if variant == "inverted_mask":
        return ones.tril(-1)
    return ones.triu(1)


def _heads(y: torch.Tensor, heads: int, head_dim: int, variant: str) -> torch.Tensor:
    b, t, _ = y.shape
    if variant == "view_no_transpose":
        return y.reshape(b, heads, t, head_dim)  # the bug: (b, t, d) read as (b, h, t, hd)
    return y.view(b, t, heads, head_dim).transpose(1, 2)  # (b, t, d) -> (b, h, t, hd)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x @ weight.T if bias is None else x @ weight.T + bias


def find_layout(module: nn.Module) -> tuple[list[Projections] | None, str]:
    """The module's weights as Projections, and the layout's name (or why none fits)."""
    from attnlab.attention import MultiHeadAttention  # the production layer, imported late

    if isinstance(module, MultiHeadAttention):
        return _attnlab_layout(module)
    if isinstance(getattr(module, "in_proj_weight", None), torch.Tensor):
        return _torch_layout(module)
    extra = _unknown_state(module)
    if extra:
        return None, (
            f"the module has state the known layouts do not use ({', '.join(extra[:4])}): "
            f"a positional bias or rotation the reference cannot reproduce"
        )
    fused = _fused_projections(module)
    if fused is not None:
        return [fused], f"fused query/key/value projection, {fused.num_heads} heads"
    if _book_projections(module) is not None:
        heads = _heads_of(module)
        what = f"book W_query/W_key/W_value, {heads} head{'s' if heads > 1 else ''}"
        return [_book_projections(module)], what
    heads = getattr(module, "heads", None)
    if isinstance(heads, nn.ModuleList) and heads:
        layout = [_book_projections(head) for head in heads]
        if all(p is not None and p.num_heads == 1 for p in layout):
            return layout, f"the book's wrapper, {len(layout)} single-head modules"
    return None, (
        "no known parameter layout (the book's W_query/W_key/W_value, a `heads` list of them, "
        "a fused qkv/c_attn projection, PyTorch's in_proj_weight, attnlab's module)"
    )


_KNOWN = ("W_query", "W_key", "W_value", "out_proj", "qkv", "qkv_proj", "c_attn", "c_proj")
_MASKS = ("mask", "bias", "causal_mask")


def _unknown_state(module: nn.Module) -> list[str]:
    """Parameters and float buffers outside the known projections and masks."""
    names = [n for n, _ in module.named_parameters()]
    names += [n for n, b in module.named_buffers() if b.is_floating_point()]
    return [
        n
        for n in names
        if not n.startswith(_KNOWN)
        and n not in _MASKS
        and not n.startswith("heads.")
        and n.split(".")[-1] not in _MASKS
    ]


def _fused_projections(module: nn.Module) -> Projections | None:
    """nanoGPT / GPT-2 style: one (d_in -> 3 d_out) projection (nn.Linear, or a Conv1D
    with an (in, out) weight) split into query, key, value; an optional output projection."""
    qkv = next(
        (getattr(module, n) for n in ("qkv", "qkv_proj", "c_attn") if hasattr(module, n)), None
    )
    weight = _linear_or_conv1d(qkv)
    heads = next(
        (getattr(module, n) for n in ("num_heads", "n_head", "n_heads") if hasattr(module, n)),
        None,
    )
    if weight is None or not isinstance(heads, int) or weight[0].shape[0] % 3:
        return None
    wq, wk, wv = weight[0].chunk(3)
    bq, bk, bv = (None,) * 3 if weight[1] is None else weight[1].chunk(3)
    out = next((getattr(module, n) for n in ("out_proj", "c_proj") if hasattr(module, n)), None)
    out_w, out_b = _linear_or_conv1d(out) or (None, None)
    return Projections(wq, wk, wv, bq, bk, bv, heads, heads, out_w, out_b)


def _linear_or_conv1d(layer: object) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight (out, in), bias) in float64 from an nn.Linear or a GPT-2 Conv1D."""
    if isinstance(layer, nn.Linear):
        return _weight(layer)
    weight = getattr(layer, "weight", None)
    if isinstance(layer, nn.Module) and isinstance(weight, torch.Tensor) and weight.dim() == 2:
        bias = getattr(layer, "bias", None)
        bias = bias.detach().double() if isinstance(bias, torch.Tensor) else None
        return weight.detach().double().T, bias  # Conv1D stores (in, out)
    return None


def _book_projections(module: nn.Module) -> Projections | None:
    parts = [_weight(getattr(module, name, None)) for name in ("W_query", "W_key", "W_value")]
    if any(part is None for part in parts):
        return None
    (wq, bq), (wk, bk), (wv, bv) = parts
    heads = _heads_of(module)
    out = getattr(module, "out_proj", None)
    out_w, out_b = _weight(out) if isinstance(out, nn.Linear) else (None, None)
    return Projections(wq, wk, wv, bq, bk, bv, heads, heads, out_w, out_b)


def _heads_of(module: nn.Module) -> int:
    heads = getattr(module, "num_heads", 1)
    return heads if isinstance(heads, int) and heads > 0 else 1


def _weight(layer: object) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight in (out, in) layout, bias) as float64, for an nn.Linear or a (in, out)
    nn.Parameter used as x @ W."""
    if isinstance(layer, nn.Linear):
        bias = None if layer.bias is None else layer.bias.detach().double()
        return layer.weight.detach().double(), bias
    if isinstance(layer, nn.Parameter) and layer.dim() == 2:
        return layer.detach().double().T, None
    return None


def _torch_layout(module: nn.Module) -> tuple[list[Projections] | None, str]:
    if not getattr(module, "batch_first", True):
        return None, "nn.MultiheadAttention with batch_first=False: inputs are (tokens, batch, d)"
    wq, wk, wv = module.in_proj_weight.detach().double().chunk(3)
    bias = getattr(module, "in_proj_bias", None)
    bq, bk, bv = (None,) * 3 if bias is None else bias.detach().double().chunk(3)
    out_w, out_b = _weight(module.out_proj)
    heads = module.num_heads
    return [Projections(wq, wk, wv, bq, bk, bv, heads, heads, out_w, out_b)], "in_proj_weight"


def _attnlab_layout(module) -> tuple[list[Projections] | None, str]:
    if module.rope is not None or module.window is not None or not module.fused:
        return None, "attnlab module with rope, a window or cross-attention: not in the layouts"
    weight = module.qkv_proj.weight.detach().double()
    sizes = [module.d_out, module.kv_dim, module.kv_dim]
    wq, wk, wv = weight.split(sizes)
    bias = module.qkv_proj.bias
    bq, bk, bv = (None,) * 3 if bias is None else bias.detach().double().split(sizes)
    out_w, out_b = _weight(module.out_proj)
    projections = Projections(
        wq, wk, wv, bq, bk, bv, module.num_heads, module.num_kv_heads, out_w, out_b
    )
    return [projections], f"attnlab qkv_proj, {module.num_heads} heads"
