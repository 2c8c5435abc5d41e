"""attention(q, k, v, ...): scaled dot-product attention with masks, grouped-query heads and
two backends that agree.

Shapes: q is (b, hq, tq, hd); k is (b, hkv, tk, hd) and v is (b, hkv, tk, hdv), where hkv
divides hq (grouped-query; hkv = 1 is multi-query) and query head h reads key/value head
h // (hq / hkv). Masks are bool, True where a query may attend (see attnlab.masks), or
additive float; either broadcasts to (b, hq, tq, tk). A query with no key it may attend to
gets zeros, never NaN, in forward and backward, on every backend.

Backends: "math" (explicit softmax in float32, the reference, the only one that can return
the weights), "sdpa" (torch.nn.functional.scaled_dot_product_attention) and "flash"
(attnlab.flash_cpu: float32 attention on the CPU without dropout; causal, it skips the
masked half).
"auto" takes math when the weights are asked for or a few queries read a CPU KV cache
(keys stored tokens-last, where its matrix products are faster), flash for causal float32
CPU attention without dropout from the measured crossover (96 queries when differentiated,
128 otherwise), and sdpa otherwise.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F

from attnlab import debug, flash_cpu, heads, masks, padded
from attnlab._validate import (
    check_additive_mask,
    check_bool,
    check_broadcasts_to,
    check_dropout,
    check_finite,
    check_finite_result,
    check_float,
    check_mask_kind,
    check_tensor,
    largest_magnitude,
)
from attnlab.strides import dense_rows

BACKENDS = ("auto", "math", "sdpa", "flash")
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    training: bool = False,
    need_weights: bool = False,
    backend: str = "auto",
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale + mask) v for each head.

    Args:
        q: queries (b, hq, tq, hd), floating point.
        k: keys (b, hkv, tk, hd), same dtype and device; hkv divides hq (query head h reads
            key/value head h // (hq / hkv)).
        v: values (b, hkv, tk, hdv).
        mask: bool (True where a query may attend) or additive float (finite, -inf where
            it may not; a relative-position bias such as T5's, or `attnlab.alibi.bias`),
            1-D (tk,), 2-D (tq, tk) or 4-D, broadcastable to (b, hq, tq, tk).
        causal: mask each query's future; query i is the (tk - tq + i)-th token, so with
            tq < tk the queries are the newest tokens (decoding).
        scale: multiplies the scores; default 1 / sqrt(hd).
        dropout_p: dropout on the weights, applied only when `training` is true.
        training: whether dropout applies.
        need_weights: also return the weights the output was computed with.
        backend: "auto", "math", "sdpa" or "flash" (see the module docstring).
        sinks: attention sinks (hq,): a learned logit per head added to each row's softmax
            denominator (gpt-oss), so a row's weights may sum to less than 1.
        softcap: bound the scores to (-softcap, softcap) by softcap * tanh(scores /
            softcap), before the mask (Gemma 2); math (and so "auto") only.

    Returns:
        The output (b, hq, tq, hdv) in q's dtype, or (output, weights (b, hq, tq, tk)) with
        need_weights. A query with no key it may attend to gets zeros, never NaN.

    Raises:
        TypeError: a non-tensor, a non-bool flag, an integer or mixed dtype.
        ValueError: shapes that do not fit, a non-finite input, a mask with NaN or +inf, a
            backend that cannot run the call (the message says why).
    """
    _check_qkv(q, k, v)
    causal = check_bool("causal", causal)
    need_weights = check_bool("need_weights", need_weights)
    dropout_p = check_dropout("dropout_p", dropout_p)  # checked even when it will not apply
    dropout_p = dropout_p if check_bool("training", training) else 0.0
    scale = _check_scale(scale, q.shape[-1], q.dtype)
    mask = check_mask(mask, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), q.device)
    sinks = check_sinks(sinks, q)
    softcap = None if softcap is None else _check_softcap(softcap, q.dtype)
    result = attend(
        q,
        k,
        v,
        mask=mask,
        causal=causal,
        scale=scale,
        dropout_p=dropout_p,
        need_weights=need_weights,
        backend=backend,
        sinks=sinks,
        softcap=softcap,
    )
    return check_finite_result(
        result,
        f"the output is past {q.dtype}'s largest value (the values v, weighted, at its edge)",
    )


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    dropout_p: float,
    need_weights: bool,
    backend: str,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    nonempty_rows: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """attention() for a caller that checked its arguments itself (MultiHeadAttention).

    The same result without re-checking q, k, v, the mask, scale and dropout_p, which
    decoding would pay per token.

    Args:
        q: queries (b, hq, tq, hd), checked by the caller.
        k: keys (b, hkv, tk, hd).
        v: values (b, hkv, tk, hdv).
        mask: a mask as check_mask returns it (4-D), or None.
        causal: mask each query's future (bottom-right aligned).
        scale: the score scale.
        dropout_p: dropout on the weights (0.0 when not training).
        need_weights: also return the weights.
        backend: "auto", "math", "sdpa" or "flash".
        sinks: checked (hq,) sink logits, or None.
        softcap: a checked positive float, or None.
        nonempty_rows: the caller knows that the mask lets every query see a key (a
            positional mask over a static cache): the zeroing of empty rows is skipped.

    Returns:
        As attention().

    Raises:
        ValueError: the backend cannot run the call (check_backend_call).
    """
    chosen = _choose_backend(
        backend, need_weights, (q, k, v), causal, dropout_p, (mask, sinks), softcap
    )
    if debug.reads_values(q) and _past_safe_scores(q, k, scale):
        options = {"mask": mask, "causal": causal, "scale": scale, "dropout_p": dropout_p}
        options |= {"need_weights": need_weights, "softcap": softcap}
        return _attend_in_float64(q, k, v, sinks, nonempty_rows=nonempty_rows, **options)
    plain = not need_weights and sinks is None and softcap is None and dropout_p == 0.0
    if backend in ("auto", "flash") and plain and not debug.under_transform():
        ranges = _padded_key_ranges((q, k, v), mask, causal, backend)
        if ranges is not None:  # causal & padding: the kernel on each sequence's real keys
            return padded.attention(q, k, v, ranges, scale)
    backend = chosen
    allowed, bias = _split_mask(mask, q, k)
    if sinks is None:
        masking = (allowed, bias, nonempty_rows)
        return _run(backend, q, k, v, masking, causal, scale, dropout_p, need_weights, softcap)
    if causal:  # explicit: the sink key would shift the bottom-right alignment
        allowed = masks.combine_masks(
            allowed, masks.causal_mask(q.shape[2], k.shape[2], device=q.device)
        )
    k_sunk, v_sunk, allowed, bias = _with_sink_key(k, v, allowed, bias, sinks, q.shape[2])
    masking = (allowed, bias, nonempty_rows)
    result = _run(
        backend, q, k_sunk, v_sunk, masking, False, scale, dropout_p, need_weights, softcap
    )
    if need_weights:
        out, weights = result
        result = out, weights[..., :-1]  # (b, hq, tq, tk): the sink's share is left out
    return result


def _safe_score(dtype: torch.dtype) -> float:
    """The scores the kernels may compute for inputs of `dtype`: a quarter of the largest
    value of the dtype they compute in (float32; float64 for float64), so that no score,
    partial sum of one, score plus bias, or difference of two in a softmax overflows it."""
    return torch.finfo(torch.promote_types(dtype, torch.float32)).max / 4


def _past_safe_scores(q, k, scale: float) -> bool:
    """Whether |scale x q . k|, or a partial sum the kernels add up to it, may pass
    _safe_score: a bound in Python floats, hd max|q| max|k| max(scale, 1), from one pass
    over q and k (a bias is shifted per row before any kernel adds it: _row_shifted). False
    for a non-finite q or k (a module's projection overflowed: its output check names
    that)."""
    if not q.numel() or not k.numel():  # no score at all
        return False
    largest_q, largest_k = largest_magnitude(q), largest_magnitude(k)
    if not math.isfinite(largest_q) or not math.isfinite(largest_k):
        return False
    return q.shape[-1] * largest_q * largest_k * max(scale, 1.0) > _safe_score(q.dtype)


def _attend_in_float64(q, k, v, sinks, **options):
    """attend() computed by the math backend in float64 and returned in q's dtype: the exact
    answer where the float32 arithmetic of every kernel could overflow (scores past 3.4e38
    are finite in float64, and differ by their true amounts in the softmax). Float64
    inputs whose scores could overflow float64 itself are a ValueError."""
    if q.dtype == torch.float64:
        raise ValueError(
            f"the scores could overflow float64: head_dim ({q.shape[-1]}) x max |q| "
            f"({largest_magnitude(q):g}) x max |k| ({largest_magnitude(k):g}) x scale "
            f"({options['scale']:g}), is past a quarter of float64's "
            f"largest value; use a smaller scale or smaller q, k"
        )
    mask = options.pop("mask")
    wide_q, wide_k, wide_v, wide_sinks, wide_mask = (
        t if t is None or t.dtype == torch.bool else t.double() for t in (q, k, v, sinks, mask)
    )
    options |= {"mask": wide_mask, "sinks": wide_sinks, "backend": "math"}
    result = attend(wide_q, wide_k, wide_v, **options)
    if isinstance(result, tuple):  # (output, weights), each back in q's dtype
        return tuple(t.to(q.dtype) for t in result)
    return result.to(q.dtype)


def _row_shifted(allowed, bias, causal: bool, q: torch.Tensor, num_keys: int):
    """The bias (finite) less each row's largest value over the keys the query sees (the
    mask's and, with `causal`, the causal rule's), which the softmax does not see: those
    values then stay at most 0, the largest is 0, and what any kernel rounds (in q's dtype
    for SDPA, float32 for math) is their differences, computed in the wider of the bias's
    dtype and q's compute dtype. A float32 mask of 2000.3 and 2001.0 was 2000 and 2001 in
    float16 (weights 0.27/0.73 for 0.33/0.67); a row of finfo.min (transformers' eager
    mask) or of +1e5 in float16 was inf; a bias far below the row's largest may become
    -inf, whose weight, 0, is exact. A row that sees no key gets a bias of 0."""
    if bias is None:
        return None
    compute = torch.promote_types(q.dtype, torch.float32)
    bias = bias.to(torch.promote_types(bias.dtype, compute))
    if num_keys == 0:  # no key, no row to shift
        return bias
    seen_keys = allowed
    if causal:  # bottom-right aligned, as _run applies it
        rule = masks.causal_mask(q.shape[2], num_keys, device=bias.device)  # (tq, tk)
        seen_keys = rule if allowed is None else masks.combine_masks(allowed, rule)
    seen = bias if seen_keys is None else bias.masked_fill(seen_keys.logical_not(), -torch.inf)
    top = seen.amax(dim=-1, keepdim=True)  # (..., tq, 1): -inf where a row sees no key
    # such a row's bias is 0: SDPA opens it to every key before zeroing it, and an unshifted
    # 1e5 there was inf in float16 (NaN, then a false overflow error)
    return torch.where(top.isneginf(), 0.0, bias - top)  # (..., tq, tk)


def _run(backend, q, k, v, masking, causal, scale, dropout_p, need_weights, softcap):
    """One backend on split masks: masking is (allowed bool or None, bias float without -inf
    or None, whether every row is known to allow a key)."""
    allowed, bias, nonempty_rows = masking
    bias = _row_shifted(allowed, bias, causal, q, k.shape[2])
    masking = (allowed, bias, nonempty_rows)
    if backend == "flash":
        return flash_cpu.attention(q, k, v, _additive(allowed, bias), scale, causal)
    # SDPA's own is_causal is top-left aligned: use it only where that is the same (square).
    square = bool(q.shape[2] == k.shape[2])  # a plain bool under torch.export too
    unmasked = allowed is None and bias is None
    sdpa_is_causal = backend == "sdpa" and causal and unmasked and square
    # one query that is the newest token sees every key: nothing to mask
    single_newest_query = bool(q.shape[2] == 1 and k.shape[2] >= 1)
    if causal and not sdpa_is_causal and not single_newest_query:
        # bottom-right aligned; with tq > tk the first queries precede every key
        causal_allowed = masks.causal_mask(q.shape[2], k.shape[2], device=q.device)
        allowed = masks.combine_masks(allowed, causal_allowed)
    if backend == "math":
        masking = (allowed, bias, nonempty_rows)
        out, weights = _math(q, k, v, masking, scale, dropout_p, softcap)
        return (out, weights) if need_weights else out
    return _sdpa(q, k, v, (allowed, bias, nonempty_rows), scale, dropout_p, sdpa_is_causal)


def _with_sink_key(k, v, allowed, bias, sinks, tq):
    """Keys and values with one more key per head, scored exactly `sinks` (a zero key plus a
    bias of the sink logit) and worth a zero value: the softmax's denominator gains
    exp(sink) and the output nothing. The sink key is always allowed."""
    b, hkv, tk, _ = k.shape
    k = torch.cat([k, k.new_zeros(b, hkv, 1, k.shape[-1])], dim=2)  # (b, hkv, tk + 1, hd)
    v = torch.cat([v, v.new_zeros(b, hkv, 1, v.shape[-1])], dim=2)  # (b, hkv, tk + 1, hdv)
    if allowed is not None:
        allowed = _as_4d(allowed)
        rows = (allowed.shape[0], allowed.shape[1], tq)
        allowed = torch.cat(
            [allowed.expand(*rows, tk), allowed.new_ones(*rows, 1)], dim=-1
        )  # (b|1, h|1, tq, tk + 1)
    bb = 1 if bias is None else bias.shape[0]
    hq = sinks.shape[0]
    real = bias.expand(bb, hq, tq, tk) if bias is not None else sinks.new_zeros(1, hq, tq, tk)
    sink = sinks.view(1, hq, 1, 1).expand(real.shape[0], hq, tq, 1)
    wide = torch.promote_types(real.dtype, sinks.dtype)  # a float32 mask keeps its digits
    return k, v, allowed, torch.cat([real.to(wide), sink.to(wide)], dim=-1)  # (.., tq, tk + 1)


def _math(q, k, v, masking, scale, dropout_p, softcap=None):
    allowed, bias, nonempty_rows = masking
    b, hq, tq, hd = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    groups = hq // hkv
    compute = torch.promote_types(q.dtype, torch.float32)  # softmax in float32 at least
    # a group's queries stacked as rows against their shared key head: no copy of k or v
    qg = (_as(q, compute) * scale).reshape(b, hkv, groups * tq, hd)  # (b, hkv, g*tq, hd)
    scores = qg @ _as(k, compute).transpose(-2, -1)  # (b, hkv, g*tq, tk)
    scores = scores.view(b, hq, tq, tk)  # (b, hq, tq, tk)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias.to(compute)
    row_has_key = None
    if allowed is not None:
        scores = scores.masked_fill(allowed.logical_not(), -torch.inf)
    if allowed is not None and not nonempty_rows:
        row_has_key = allowed.any(dim=-1, keepdim=True)  # (..., tq, 1)
        # A row with no allowed key gets constant scores: finite softmax, zero gradient.
        scores = scores.masked_fill(row_has_key.logical_not(), 0.0)
    weights = torch.softmax(scores, dim=-1)
    if row_has_key is not None:
        weights = weights * row_has_key
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p, training=True)
    out = weights.view(b, hkv, groups * tq, tk) @ _as(v, compute)  # (b, hkv, g*tq, hdv)
    out = out.view(b, hq, tq, v.shape[-1])  # (b, hq, tq, hdv)
    return _as(out, q.dtype), _as(weights, q.dtype)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in `dtype`, with no call when it already is (decoding pays for every call)."""
    return t if t.dtype == dtype else t.to(dtype)


def _sdpa(q, k, v, masking, scale, dropout_p, is_causal):
    allowed, bias, nonempty_rows = masking
    hq, hkv = q.shape[1], k.shape[1]
    # tokens-last (KV cache), expanded, overlapping views: rows of features for SDPA's kernels
    q, k, v = dense_rows(q), dense_rows(k), dense_rows(v)
    gqa = {}
    if hq != hkv and _SDPA_HAS_GQA:
        gqa = {"enable_gqa": True}
    elif hq != hkv:  # older torch: repeat the key/value heads
        k, v = heads.repeat_kv(k, hq // hkv), heads.repeat_kv(v, hq // hkv)  # (b, hq, tk, .)
    if allowed is None and bias is None:  # nothing can empty a row: no mask tensor needed
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, scale=scale, is_causal=is_causal, **gqa
        )
    row_has_key = None
    attn_mask = bias.to(q.dtype) if bias is not None else None  # SDPA takes q's dtype
    if allowed is not None and nonempty_rows:
        attn_mask = (
            allowed
            if attn_mask is None
            else attn_mask.masked_fill(allowed.logical_not(), -torch.inf)
        )
    elif allowed is not None:
        row_has_key = allowed.any(dim=-1, keepdim=True)  # (..., tq, 1)
        open_rows = allowed | row_has_key.logical_not()  # empty rows attend to all, then are zeroed
        attn_mask = (
            open_rows
            if attn_mask is None
            else attn_mask.masked_fill(open_rows.logical_not(), -torch.inf)
        )
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale, **gqa
    )
    return out if row_has_key is None else out * row_has_key.to(out.dtype)


def check_mask(
    mask: object,
    scores_shape: tuple[int, int, int, int],
    device: torch.device,
    what: str = "(batch, heads, queries, keys)",
) -> torch.Tensor | None:
    """The user's mask, checked, as a 4-D view broadcastable to `scores_shape`.

    Args:
        mask: None, a bool tensor (True where a query may attend) or an additive float
            one (finite, -inf where a query may not attend); 1-D (keys), 2-D (queries,
            keys) or 4-D. 3-D is refused as ambiguous.
        scores_shape: the scores' shape (batch, heads, queries, keys).
        device: the device of the queries.
        what: the names of the scores' axes, for the message.

    Raises:
        TypeError: not a tensor, or neither bool nor floating point.
        ValueError: 3-D, not broadcastable, on another device, or NaN / +inf values.
    """
    if mask is None:
        return None
    check_mask_kind("mask", mask)
    if mask.dim() == 3:
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} is 3-D, which could mean (batch, queries, keys) "
            f"or (heads, queries, keys): give (queries, keys) or 4-D (batch, heads, queries, "
            f"keys) with 1 for a dimension it does not vary over"
        )
    check_broadcasts_to("mask", mask, scores_shape, what)
    if mask.device != device:
        raise ValueError(f"mask is on {mask.device} but q is on {device}")
    check_additive_mask("mask", mask)
    return _as_4d(mask)


def _as_4d(mask: torch.Tensor) -> torch.Tensor:
    """A mask of rank <= 4 as a 4-D view, with 1 for the leading dimensions it lacks."""
    return mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))  # (.., queries, keys)


def _split_mask(mask, q, k):
    """(allowed bool or None, additive float bias with no -inf, or None) from a checked mask."""
    if mask is None:
        return None, None
    if mask.dtype == torch.bool:
        return mask, None
    allowed = mask > -torch.inf
    return allowed, mask.masked_fill(allowed.logical_not(), 0.0)


def _check_qkv(q: object, k: object, v: object) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndims=(4,), layout="(batch, heads, tokens, head_dim)")
        if t.shape[1] == 0 or t.shape[3] == 0:
            raise ValueError(f"{name} of shape {tuple(t.shape)} has no heads or no features")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError(f"q, k, v batch sizes differ: {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree in batch, heads and tokens"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q head_dim ({q.shape[-1]}) must equal k head_dim ({k.shape[-1]})")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"key/value heads ({k.shape[1]}) must divide query heads ({q.shape[1]})")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_finite(name, t)


def check_sinks(sinks: object, q: torch.Tensor) -> torch.Tensor | None:
    """`sinks` if it is None or a finite floating-point (hq,) tensor on q's device.

    Args:
        sinks: the argument to check.
        q: the queries (b, hq, tq, hd) it goes with.

    Returns:
        `sinks`.

    Raises:
        TypeError: not a floating-point tensor.
        ValueError: another shape or device, or a non-finite value.
    """
    if sinks is None:
        return None
    check_tensor("sinks", sinks, ndims=(1,), layout="(query heads,)")
    if sinks.shape[0] != q.shape[1]:
        raise ValueError(f"sinks has {sinks.shape[0]} logits but q has {q.shape[1]} heads")
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {q.device}")
    return check_finite("sinks", sinks)


def _check_scale(scale: object, head_dim: int, dtype: torch.dtype) -> float:
    """The scores' scale: 1 / sqrt(head_dim) for None, else `scale` as a float, positive and
    finite in each dtype it is used in: q's `dtype`, and float32, which the kernels compute
    q's narrower dtypes and their own in (a scale finite as a Python float but infinite once
    cast, 1e39 for float32 or 1e5 for float16, made the scores NaN). Metadata only: no
    tensor value is read (that scale * q @ k^T may still overflow is the values' matter)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite float, got {scale}")
    scale = float(scale)
    for used_in in (dtype, torch.float32) if dtype.itemsize <= 4 else (dtype,):
        check_scale_in(scale, used_in, f"q's dtype {dtype}; the scores in float32 at least")
    return scale


def _check_softcap(softcap: object, dtype: torch.dtype) -> float:
    """softcap as a positive float, finite in the dtype the math backend computes the
    scores in (float32 for q's narrower dtypes: 1e39 became inf, and inf x tanh(s / inf) is
    NaN)."""
    softcap = check_float("softcap", softcap, greater_than=0.0)
    check_scale_in(softcap, torch.promote_types(dtype, torch.float32), "the scores", "softcap")
    return softcap


def check_scale_in(scale: float, dtype: torch.dtype, where: str = "", name: str = "scale") -> None:
    """Raise a ValueError unless the positive float `scale` (or the argument `name`) is
    finite once cast to `dtype` (a dtype it is used in; `where` says why, for the message)."""
    largest = torch.finfo(dtype).max
    if scale > largest:
        why = f" ({where})" if where else ""
        raise ValueError(
            f"{name} ({scale:g}) is not finite in {dtype}, a dtype it is used in{why}: it "
            f"must be at most {largest:g}, {dtype}'s largest finite value"
        )


def check_backend(backend: object) -> str:
    """Return `backend` if it names one of BACKENDS.

    Args:
        backend: the argument to check.

    Returns:
        `backend`.

    Raises:
        ValueError: anything else.
    """
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def check_backend_call(
    backend: object,
    *,
    need_weights: bool,
    dropout_p: float,
    dtype: torch.dtype,
    device: torch.device,
    head_dims: tuple[int, ...],
    mask: torch.Tensor | None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> str:
    """Return `backend` if it can run a call of this kind, else raise ValueError saying why.

    Reads only the call's description (no tensor data), so a caller with state to change
    (a KV cache) checks before it changes anything.

    Args:
        backend: the backend asked for.
        need_weights: whether the weights are asked for.
        dropout_p: the dropout that will apply.
        dtype: the inputs' dtype.
        device: the inputs' device.
        head_dims: the head_dim of q, k and v.
        mask: the mask (only whether it requires grad is read), or None.
        sinks: the sinks (likewise), or None.
        softcap: the softcap, or None.

    Returns:
        `backend`.

    Raises:
        ValueError: not a backend, or one that cannot run this call (the message says why).
    """
    backend = check_backend(backend)
    if backend in ("sdpa", "flash") and torch.autograd.forward_ad._current_level >= 0:
        raise ValueError(
            f"the {backend!r} backend has no forward-mode AD (a forward_ad.dual_level is "
            f"active): use backend 'math' or 'auto'"
        )
    if need_weights and backend in ("sdpa", "flash"):
        raise ValueError(
            f"need_weights=True needs backend 'math' or 'auto': the {backend!r} backend "
            f"never materialises the weights"
        )
    if softcap is not None and backend in ("sdpa", "flash"):
        raise ValueError(
            f"softcap={softcap} needs backend 'math' or 'auto': the {backend!r} backend's "
            f"kernel cannot bound the scores before its softmax"
        )
    if backend != "flash":
        return backend
    if dropout_p > 0.0:
        raise ValueError(f"backend 'flash' runs without dropout, got dropout_p={dropout_p}")
    if not flash_cpu.supports(dtype, device, head_dims):
        raise ValueError(
            f"backend 'flash' takes float32 CPU tensors with one head_dim for q, k and v, got "
            f"{dtype} on {device}, head_dims {list(head_dims)}: use 'auto'"
        )
    if _trained(mask, sinks):
        raise ValueError(
            "backend 'flash' gives no gradient to the mask or the sinks, which require grad: "
            "use 'auto'"
        )
    if not flash_cpu.available():
        raise ValueError(f"backend 'flash' is unavailable here: {flash_cpu.load_error()}")
    return backend


def _trained(mask: torch.Tensor | None, sinks: torch.Tensor | None) -> bool:
    return any(t is not None and t.requires_grad for t in (mask, sinks))


def _choose_backend(
    backend: object,
    need_weights: bool,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    causal: bool,
    dropout_p: float,
    mask_and_sinks: tuple[torch.Tensor | None, torch.Tensor | None],
    softcap: float | None,
) -> str:
    q, k, _ = qkv
    mask, sinks = mask_and_sinks
    backend = check_backend_call(
        backend,
        need_weights=need_weights,
        dropout_p=dropout_p,
        dtype=q.dtype,
        device=q.device,
        head_dims=tuple(t.shape[-1] for t in qkv),
        mask=mask,
        sinks=sinks,
        softcap=softcap,
    )
    if backend != "auto":
        return backend
    if need_weights or softcap is not None or _reads_cache_faster(q, k):
        return "math"
    if debug.under_transform():  # forward-mode AD: only math's ops carry tangents
        return "math"
    causal_flash = not _trained(mask, sinks) and _flash_helps(qkv, causal, dropout_p)
    return "flash" if causal_flash else "sdpa"


def _padded_key_ranges(qkv, mask, causal, backend) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each sequence's real keys when the mask is causal & padding only (padded.key_ranges)
    and the kernel runs the call: square, more than a few queries, float32 CPU, and for
    "auto" only where the kernel wins (flash_cpu.preferred)."""
    if mask is None or mask.dtype != torch.bool or mask.shape[1] != 1:
        return None
    q, k, _ = qkv
    if mask.shape[-1] != k.shape[2]:  # a keys axis broadcast from 1 holds no ranges
        return None
    if q.shape[2] != k.shape[2] or q.shape[2] <= 32 or torch.compiler.is_compiling():
        return None
    head_dims = tuple(t.shape[-1] for t in qkv)
    if backend == "auto":  # under CPU autocast SDPA computes in its dtype: not the kernel
        runs = flash_cpu.preferred() and not torch.is_autocast_enabled("cpu")
    else:
        runs = flash_cpu.available()
    if not (flash_cpu.supports(q.dtype, q.device, head_dims) and runs):
        return None
    return padded.key_ranges(mask, causal)


# Queries from which "auto" takes the kernel over SDPA: the measured crossover of
# attention(backend="flash") against attention(backend="sdpa"), causal float32, (b, 12, t,
# 64) with 12 and 1 key/value heads, b 1 and 2, least single-thread CPU time of 9 interleaved
# rounds, AMD EPYC (Zen 4), torch 2.13, measured with
#   python scripts/kernel_crossover.py 33,64,96,128,160,192,256 9 1   (and ... 9 2)
# forward under no_grad: 0.67-0.80x at 33-64 queries, 0.89-0.96x at 96, 1.01-1.05x at 128,
# 1.02-1.16x at 160-192, 1.11-1.26x at 256; forward + backward (a call that records a graph):
# 0.96-1.01x at 64 queries, 1.13-1.18x at 96, 1.27-1.29x at 128, 1.47-1.53x at 256. Above
# 256 queries the kernel led at every length measured (attnlab bench --kernel).
_FLASH_MIN_QUERIES = 128
_FLASH_MIN_QUERIES_TRAINING = 96


def _flash_helps(qkv: tuple[torch.Tensor, ...], causal: bool, dropout_p: float) -> bool:
    """Causal float32 attention on the CPU with enough queries that attnlab's kernel wins
    (the measured crossover above: fewer when the call will be differentiated, where the
    kernel's backward leads by more), in its vectorised build, loaded
    (flash_cpu.preferred): it skips the masked half that PyTorch's computes in part. Not
    under torch.compile, which traces SDPA into its own graph instead, nor under CPU
    autocast, where SDPA computes in autocast's dtype as the call would without attnlab."""
    q, k, _ = qkv
    training = torch.is_grad_enabled() and any(t.requires_grad for t in qkv)
    least = _FLASH_MIN_QUERIES_TRAINING if training else _FLASH_MIN_QUERIES
    return (
        causal
        and not torch.compiler.is_compiling()
        and not torch.is_autocast_enabled(
            "cpu"
        )  # SDPA follows autocast's dtype; the kernel would not
        and dropout_p == 0.0
        and q.shape[2] >= least
        and k.shape[2] > 0
        and flash_cpu.supports(q.dtype, q.device, tuple(t.shape[-1] for t in qkv))
        and flash_cpu.preferred()
    )


def _additive(allowed: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor | None:
    """One additive float mask from the split ones: bias, -inf where not allowed."""
    if allowed is None:
        return bias
    base = torch.zeros(allowed.shape, device=allowed.device) if bias is None else bias
    return base.masked_fill(allowed.logical_not(), -torch.inf)


def _reads_cache_faster(q: torch.Tensor, k: torch.Tensor) -> bool:
    """True for a few queries against CPU keys stored tokens-last (the KVCache layout):
    there the math path's matrix products stream the cache at full memory bandwidth, while
    SDPA's CPU kernel would copy it first (measured: about 2x faster at 1 query x 4096
    keys, and no slower up to 32 queries)."""
    tokens_last = k.stride(-2) == 1 < k.shape[-1]  # first: no shape guard under compile
    return tokens_last and q.device.type == "cpu" and q.shape[2] <= 32
