"""Every attention mask attnlab builds, in one polarity: boolean True where a query MAY attend
to a key (the convention of F.scaled_dot_product_attention and Hugging Face).

The causal rule (p_k <= p_q, and p_q - p_k < window) is written once (`_key_bounds`) and
owned by one predicate, `position_mask`; every other mask and range here is built from them
(position_mask's docstring lists who relies on the rule, and how).

PyTorch's nn.MultiheadAttention uses the opposite polarity (True = blocked); convert at that
boundary with `from_torch_mask` / `to_torch_mask`, nowhere else. Shapes: (queries, keys) for
positional masks, (batch, 1, 1, keys) for padding, both broadcastable to the scores'
(batch, heads, queries, keys).
"""

from __future__ import annotations

import torch

from attnlab import debug
from attnlab._validate import (
    MAX_SIZE,
    check_additive_mask,
    check_float_dtype,
    check_index_tensor,
    check_int,
    check_mask_kind,
    check_same_device,
    check_size,
    check_tensor,
)

_WIDEST_WINDOW = 2**62  # wider than any position: the same as no window, and an int64


def _window(window: object) -> int:
    """A checked window (an int >= 1), at most _WIDEST_WINDOW so that int64 arithmetic on
    positions never overflows."""
    return min(check_int("window", window), _WIDEST_WINDOW)


def _key_bounds(query, window: int | None):
    """The causal rule, the one place it is written: a query at position `query` may attend
    to the keys at positions `first` through `last`, inclusive: last = query (no later key)
    and, with a window, first = query - window + 1 (the `window` most recent keys, itself
    included), None without one. `query` a Python int or an int64 tensor, `window` a
    checked int or None; returns (first, last)."""
    return (None if window is None else query - window + 1), query


def _allowed(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """The predicate (position_mask without its checks): True where the key lies within
    the query's bounds (_key_bounds). int64 position tensors that broadcast together, e.g.
    (q, 1) against (1, k)."""
    first, last = _key_bounds(query_pos, window)
    allowed = key_pos <= last
    if first is not None:
        allowed = allowed & (key_pos >= first)
    return allowed


def aligned_positions(
    num_queries: int,
    num_keys: int | None = None,
    *,
    offset: int | None = None,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absolute positions of `num_queries` queries against `num_keys` keys laid in order:
    key j is at position j, query i at offset + i. offset defaults to num_keys -
    num_queries: the queries are the newest tokens (bottom-right aligned), as in decoding
    with a cache; with more queries than keys the first ones then precede every key.

    Args:
        num_queries: queries (>= 0).
        num_keys: keys (>= 0; default num_queries).
        offset: absolute position of the first query (>= 0; default num_keys - num_queries).
        device: where to build the positions (default the CPU).

    Returns:
        (query positions (num_queries,), key positions (num_keys,)), int64.

    Raises:
        TypeError: a size that is not an int.
        ValueError: a negative size or offset, or one past MAX_SIZE (2**40).

    Examples:
        >>> aligned_positions(2, 3)
        (tensor([1, 2]), tensor([0, 1, 2]))
    """
    num_queries, num_keys, offset = _aligned(num_queries, num_keys, offset)
    query_pos = torch.arange(num_queries, device=device) + offset  # (q,)
    return query_pos, torch.arange(num_keys, device=device)  # (q,), (k,)


def _aligned(num_queries: object, num_keys: object, offset: object) -> tuple[int, int, int]:
    """aligned_positions' checked arguments: (num_queries, num_keys, offset), each an int in
    [0, MAX_SIZE], so that offset + num_queries stays an exact int64."""
    num_queries = check_size("num_queries", num_queries, minimum=0)
    num_keys = num_queries if num_keys is None else check_size("num_keys", num_keys, minimum=0)
    offset = num_keys - num_queries if offset is None else check_size("offset", offset, minimum=0)
    return num_queries, num_keys, offset


def _check_mask_size(num_queries: object, num_keys: object, offset: object) -> None:
    """aligned_positions' checks, and a (num_queries, num_keys) mask of at most MAX_SIZE
    elements: before anything is allocated."""
    num_queries, num_keys, _ = _aligned(num_queries, num_keys, offset)
    if isinstance(num_queries, torch.SymInt) or isinstance(num_keys, torch.SymInt):
        return  # traced sizes: a tensor's, and formatting them would specialise the trace
    check_size(
        f"num_queries x num_keys ({num_queries} x {num_keys})",
        num_queries * num_keys,
        minimum=0,
    )


def visible_keys(query_position: int, window: int | None = None) -> range:
    """The key positions a query at `query_position` may attend to, among keys at positions
    0, 1, 2, ...: those position_mask allows it (both read the rule's bounds), for callers
    that need a range rather than a mask and cannot pay for a tensor (KVCache.native_slots,
    the slots the native decode step reads each token; the keys transformers' top-left
    causal calls can reach).

    Args:
        query_position: an int >= 0.
        window: an int >= 1, or None for plain causal.

    Returns:
        range(max(0, query_position + 1 - window), query_position + 1).

    Raises:
        TypeError: a non-int position or window.
        ValueError: a negative position or one past MAX_SIZE (2**40), or window < 1.

    Examples:
        >>> visible_keys(5, window=3)
        range(3, 6)
    """
    if type(query_position) is not int or not 0 <= query_position <= MAX_SIZE:  # decoding:
        query_position = check_size("query_position", query_position, minimum=0)  # cheap
    if window is not None and (type(window) is not int or window < 1):
        window = _window(window)
    first, last = _key_bounds(query_position, window)
    return range(first if first is not None and first > 0 else 0, last + 1)


def causal_mask(
    num_queries: int,
    num_keys: int | None = None,
    *,
    offset: int | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The causal mask: query i, at absolute position offset + i, may see keys <= it.

    offset defaults to num_keys - num_queries: the queries are the newest tokens, as in
    decoding with a cache (for a square mask it is 0, the usual lower triangle).

    Args:
        num_queries: queries (>= 0).
        num_keys: keys (>= 0; default num_queries).
        offset: absolute position of the first query (>= 0; default num_keys - num_queries).
        device: where to build the mask (default the CPU).

    Returns:
        (num_queries, num_keys) bool, True where the query may attend to the key.

    Raises:
        TypeError: a size that is not an int.
        ValueError: a negative size or offset, a size or offset past MAX_SIZE (2**40), or
            num_queries x num_keys past it.

    Examples:
        >>> causal_mask(2, 3)
        tensor([[ True,  True, False],
                [ True,  True,  True]])
    """
    _check_mask_size(num_queries, num_keys, offset)
    query_pos, key_pos = aligned_positions(num_queries, num_keys, offset=offset, device=device)
    return _allowed(query_pos.unsqueeze(1), key_pos.unsqueeze(0), None)  # (q, k)


def sliding_window_mask(
    num_queries: int,
    num_keys: int | None = None,
    *,
    window: int,
    offset: int | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """A sliding-window mask: causal, and each query sees at most the `window` most recent
    keys, itself included (Mistral's sliding window).

    Args:
        num_queries: queries (>= 0).
        num_keys: keys (>= 0; default num_queries).
        window: keys each query may see (>= 1), itself included.
        offset: absolute position of the first query (default num_keys - num_queries, as in
            `causal_mask`).
        device: where to build the mask (default the CPU).

    Returns:
        (num_queries, num_keys) bool, True where the query may attend to the key.

    Raises:
        TypeError: a size or window that is not an int.
        ValueError: a negative size or offset, a size or offset past MAX_SIZE (2**40),
            num_queries x num_keys past it, or window < 1.

    Examples:
        >>> sliding_window_mask(3, window=2)
        tensor([[ True, False, False],
                [ True,  True, False],
                [False,  True,  True]])
    """
    window = _window(window)
    _check_mask_size(num_queries, num_keys, offset)
    query_pos, key_pos = aligned_positions(num_queries, num_keys, offset=offset, device=device)
    return _allowed(query_pos.unsqueeze(1), key_pos.unsqueeze(0), window)  # (q, k)


def position_mask(
    query_positions: torch.Tensor, key_positions: torch.Tensor, *, window: int | None = None
) -> torch.Tensor:
    """(queries, keys) bool from absolute positions (1-D integer tensors, keys in any order):
    causal, and with `window` each query sees at most the `window` most recent keys.

    This is attnlab's causal rule, its one owner: a query at position p_q may attend to a key
    at position p_k iff p_k <= p_q and, with a window w, p_q - p_k < w. Queries laid against
    keys in order are bottom-right aligned (aligned_positions). Built from it here:
    causal_mask and sliding_window_mask (the square mask with an offset, the window mask),
    and visible_keys (the same bounds as a range of keys). Every Python path takes one of
    these: MultiHeadAttention's positional mask (this, with a cache's slot positions, or
    sliding_window_mask), functional.attention's bottom-right mask (more keys than queries,
    a user mask, sinks, the math backend), padded's key ranges, the ring's explicit diagonal
    blocks, KVCache.native_slots (visible_keys, the slots the native decode step reads),
    interop.hf's top-left calls (visible_keys), alibi.bias (aligned_positions).

    Places that rely on another implementation of the rule, each proven equal to it in
    tests/test_causal_rule.py (the keys attended to, read off one-hot values and one-hot
    gradients): PyTorch's top-left is_causal, used only where it is the same mask (square:
    functional's "sdpa" backend without a mask, the ring's fused diagonal blocks); the C++
    causal kernel behind flash_cpu, forward and backward (offset tk - tq, with and without
    key ranges); the C++ decode step over KVCache.native_slots'
    slots, plain and rolling; parallel.layout's blocks (block_for, scores_per_rank), both
    layouts; functional's single newest query, left unmasked (it sees every key). The
    "torch" ring engine (PyTorch's context parallel, is_causal) is held to it by
    tests/parallel/test_ring.py (equal to the math backend on the whole sequence).

    Args:
        query_positions: (queries,) integer tensor.
        key_positions: (keys,) integer tensor on the same device.
        window: an int >= 1, or None for plain causal.

    Returns:
        (queries, keys) bool, True where the query may attend to the key.

    Raises:
        TypeError: a position argument that is not an integer tensor, or a non-int window.
        ValueError: a position tensor that is not 1-D, tensors on two devices, window < 1.
    """
    check_index_tensor("query_positions", query_positions)
    check_index_tensor("key_positions", key_positions)
    check_same_device(query_positions=query_positions, key_positions=key_positions)
    window = None if window is None else _window(window)
    query_pos = query_positions.long().unsqueeze(1)  # (q, 1): int64, no narrow wrap-around
    key_pos = key_positions.long().unsqueeze(0)  # (1, k)
    return _allowed(query_pos, key_pos, window)


def padding_mask_from_lengths(lengths: torch.Tensor, num_keys: int) -> torch.Tensor:
    """A padding mask from each sequence's true length: keys at or past it are padding
    (right padding).

    Args:
        lengths: (batch,) integer tensor, each in [0, num_keys].
        num_keys: the padded length (>= 1).

    Returns:
        (batch, 1, 1, num_keys) bool on lengths' device, True for real keys; it broadcasts
        against the scores' (batch, heads, queries, keys).

    Raises:
        TypeError: lengths is not an integer tensor, or num_keys not an int.
        ValueError: lengths is not 1-D, a length lies outside [0, num_keys], or num_keys
            (or batch x num_keys) is past MAX_SIZE (2**40).

    Examples:
        >>> padding_mask_from_lengths(torch.tensor([3, 1]), num_keys=3)[:, 0, 0]
        tensor([[ True,  True,  True],
                [ True, False, False]])
    """
    num_keys = check_size("num_keys", num_keys)
    check_index_tensor("lengths", lengths)  # one length per sequence
    check_size(
        f"batch x num_keys ({len(lengths)} x {num_keys})", len(lengths) * num_keys, minimum=0
    )
    if debug.reads_values(lengths) and ((lengths < 0) | (lengths > num_keys)).any():
        raise ValueError(f"lengths must be in [0, num_keys={num_keys}], got {lengths.tolist()}")
    keep = torch.arange(num_keys, device=lengths.device) < lengths.unsqueeze(1)  # (b, k)
    return keep[:, None, None, :]  # (b, 1, 1, k)


def padding_mask(keep: torch.Tensor) -> torch.Tensor:
    """A padding mask from a keep-mask, such as a tokenizer's attention_mask as bool; any
    padding side.

    Args:
        keep: (batch, tokens) bool, True for a real token.

    Returns:
        (batch, 1, 1, tokens) bool, a view of keep, broadcastable to the scores'
        (batch, heads, queries, keys).

    Raises:
        TypeError: keep is not a 2-D bool tensor.
    """
    if not isinstance(keep, torch.Tensor) or keep.dim() != 2 or keep.dtype != torch.bool:
        got = (
            f"dtype {keep.dtype}, shape {tuple(keep.shape)}"
            if isinstance(keep, torch.Tensor)
            else type(keep).__name__
        )
        raise TypeError(f"keep must be a (batch, tokens) bool tensor, got {got}")
    return keep[:, None, None, :]  # (b, 1, 1, k)


def combine_masks(*masks: torch.Tensor | None) -> torch.Tensor | None:
    """Masks applied together: a query may attend where every mask allows it.

    Args:
        *masks: bool masks (True = may attend) and additive float masks (-inf where a query
            may not attend), of shapes that broadcast together, on one device; None entries
            are skipped.

    Returns:
        None if every entry is None; the logical AND of the bool masks when all are bool;
        otherwise one additive float mask: the float masks summed, -inf where a bool mask
        blocks.

    Raises:
        TypeError: an entry that is neither a bool nor a floating-point tensor.
        ValueError: shapes that do not broadcast together, or masks on two devices.
    """
    present = [m for m in masks if m is not None]
    for i, m in enumerate(present):
        check_additive_mask(f"masks[{i}]", check_mask_kind(f"masks[{i}]", m))
    if not present:
        return None
    check_same_device(**{f"masks[{i}]": m for i, m in enumerate(present)})
    try:
        shape = torch.broadcast_shapes(*(m.shape for m in present))
    except RuntimeError as error:
        shapes = [tuple(m.shape) for m in present]
        raise ValueError(f"masks of shapes {shapes} do not broadcast together") from error
    allowed = None
    for m in (m for m in present if m.dtype == torch.bool):
        allowed = m if allowed is None else allowed & m
    floats = [m for m in present if m.dtype != torch.bool]
    if not floats:
        return allowed.expand(shape) if allowed.shape != shape else allowed
    bias = floats[0]
    for m in floats[1:]:
        bias = bias + m
    bias = bias.expand(shape) if bias.shape != shape else bias
    return bias if allowed is None else bias.masked_fill(allowed.logical_not(), -torch.inf)


def _check_mask(mask: object, *, bool_only: bool, name: str = "mask") -> torch.Tensor:
    """A (..., queries, keys) bool mask, or (unless bool_only) an additive float one."""
    mask = check_tensor(name, mask, ndims=(2, 3, 4), layout="(..., queries, keys)", floating=False)
    if mask.dtype != torch.bool and (bool_only or not mask.is_floating_point()):
        kinds = "a bool tensor" if bool_only else "a bool tensor or an additive float mask"
        raise TypeError(f"{name} must be {kinds}, got dtype {mask.dtype}")
    return mask


def from_torch_mask(mask: torch.Tensor, *, name: str = "mask") -> torch.Tensor:
    """nn.MultiheadAttention's mask to attnlab's: a bool mask is inverted (True = blocked
    becomes True = may attend); a float additive mask is returned unchanged.

    Args:
        mask: (..., queries, keys), 2-D to 4-D, bool (True = blocked) or additive float.
        name: the caller's name for it in error messages (e.g. "key_padding_mask").

    Returns:
        The mask in attnlab's polarity (True = may attend), or the float mask.

    Raises:
        TypeError: not a tensor, or neither bool nor floating.
        ValueError: fewer than 2 or more than 4 dimensions.
    """
    mask = _check_mask(mask, bool_only=False, name=name)
    return ~mask if mask.dtype == torch.bool else mask


def to_torch_mask(mask: torch.Tensor) -> torch.Tensor:
    """attnlab's bool mask in nn.MultiheadAttention's polarity (True = blocked).

    Args:
        mask: (..., queries, keys) bool, 2-D to 4-D, True where a query may attend.

    Returns:
        The inverted mask, True where a query may not attend.

    Raises:
        TypeError: not a bool tensor.
        ValueError: fewer than 2 or more than 4 dimensions.
    """
    return ~_check_mask(mask, bool_only=True)


def to_additive(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A bool mask as an additive float mask: 0 where attending is allowed, -inf elsewhere.

    Args:
        mask: (..., queries, keys) bool, 2-D to 4-D.
        dtype: a floating-point dtype for the result.

    Returns:
        The additive mask, of mask's shape and device.

    Raises:
        TypeError: mask is not a bool tensor, or dtype not floating point.
        ValueError: fewer than 2 or more than 4 dimensions.
    """
    mask = _check_mask(mask, bool_only=True)
    dtype = check_float_dtype("dtype", dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, -torch.inf)
