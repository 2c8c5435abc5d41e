"""Every attention mask attnlab builds, in one polarity: boolean True where a query MAY attend
to a key (the convention of F.scaled_dot_product_attention and Hugging Face).

PyTorch's nn.MultiheadAttention uses the opposite polarity (True = blocked); convert at that
boundary with `from_torch_mask` / `to_torch_mask`, nowhere else. Shapes: (queries, keys) for
positional masks, (batch, 1, 1, keys) for padding, both broadcastable to the scores'
(batch, heads, queries, keys).
"""

from __future__ import annotations

import torch

from attnlab._validate import (
    check_additive_mask,
    check_float_dtype,
    check_index_tensor,
    check_int,
    check_mask_kind,
    check_same_device,
    check_tensor,
)

_WIDEST_WINDOW = 2**62  # wider than any position: the same as no window, and an int64


def _window(window: object) -> int:
    """A checked window (an int >= 1), at most _WIDEST_WINDOW so that int64 arithmetic on
    positions never overflows."""
    return min(check_int("window", window), _WIDEST_WINDOW)


def _positions(
    num_queries: int, num_keys: int | None, offset: int | None, device: torch.device | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absolute positions of the queries (column) and keys (row)."""
    num_queries = check_int("num_queries", num_queries, minimum=0)
    num_keys = num_queries if num_keys is None else check_int("num_keys", num_keys, minimum=0)
    offset = num_keys - num_queries if offset is None else check_int("offset", offset, minimum=0)
    query_pos = torch.arange(num_queries, device=device).unsqueeze(1) + offset  # (q, 1)
    key_pos = torch.arange(num_keys, device=device).unsqueeze(0)  # (1, k)
    return query_pos, key_pos


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
        ValueError: a negative size or offset.

    Examples:
        >>> causal_mask(2, 3)
        tensor([[ True,  True, False],
                [ True,  True,  True]])
    """
    query_pos, key_pos = _positions(num_queries, num_keys, offset, device)
    return key_pos <= query_pos


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
        ValueError: a negative size or offset, or window < 1.

    Examples:
        >>> sliding_window_mask(3, window=2)
        tensor([[ True, False, False],
                [ True,  True, False],
                [False,  True,  True]])
    """
    window = _window(window)
    query_pos, key_pos = _positions(num_queries, num_keys, offset, device)
    return (key_pos <= query_pos) & (key_pos > query_pos - window)


def position_mask(
    query_positions: torch.Tensor, key_positions: torch.Tensor, *, window: int | None = None
) -> torch.Tensor:
    """(queries, keys) bool from absolute positions (1-D integer tensors, keys in any order):
    causal, and with `window` each query sees at most the `window` most recent keys.

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
    allowed = key_pos <= query_pos
    if window is not None:
        allowed = allowed & (key_pos > query_pos - window)
    return allowed


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
        ValueError: lengths is not 1-D, or a length lies outside [0, num_keys].

    Examples:
        >>> padding_mask_from_lengths(torch.tensor([3, 1]), num_keys=3)[:, 0, 0]
        tensor([[ True,  True,  True],
                [ True, False, False]])
    """
    num_keys = check_int("num_keys", num_keys)
    check_index_tensor("lengths", lengths)  # one length per sequence
    if ((lengths < 0) | (lengths > num_keys)).any():
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
    return bias if allowed is None else bias.masked_fill(~allowed, -torch.inf)


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
