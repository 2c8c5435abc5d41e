"""The maps stored compactly in the page: quantised, deflated, base64.

Each (queries, keys) map is quantised linearly between its own lowest and highest unmasked
value (0 and the highest for weights, so that a zero stays exactly zero) to 8 or 16 bits:
codes 0 .. N are values, N + 1 marks a masked cell. A group's codes, (layers, heads,
queries, keys) in C order, are deflated (zlib) and base64-encoded; the page inflates them
with the browser's own DecompressionStream. A value reads back as lo + code * (hi - lo) / N,
within half a step, (hi - lo) / (2 N), of the tensor's: the stated precision of that map.
"""

from __future__ import annotations

import base64
import math
import zlib

import numpy as np
import torch

from attnlab.explore.data import Group

LEVELS = {8: 254, 16: 65534}  # the highest value code; the next one marks a masked cell
AUTO_16_BITS_UP_TO = 4_000_000  # cells in the page: 16 bits at most this many, else 8


def choose_bits(precision: object, cells: int) -> int:
    """The bits per cell for `precision` ("auto", 8 or 16) and a page of `cells` cells.

    Raises:
        ValueError: a precision other than "auto", 8 or 16.
    """
    if precision == "auto":
        return 16 if cells <= AUTO_16_BITS_UP_TO else 8
    if isinstance(precision, bool) or precision not in LEVELS:
        raise ValueError(f"precision must be 'auto', 8 or 16, got {precision!r}")
    return int(precision)


def encode_group(group: Group, bits: int) -> dict:
    """The group's maps as the page stores them.

    Args:
        group: the maps.
        bits: 8 or 16 bits per cell.

    Returns:
        {"bits", "lo", "hi", "data"}: lo and hi per map, (layers * heads) floats in
        (layer, head) order, and the codes deflated and base64-encoded.

    Raises:
        ValueError: an unmasked cell that is NaN or infinite.
    """
    values = group.weights.detach().to("cpu", torch.float64)  # (l, h, q, k)
    allowed = group.full_mask().cpu()
    _check_finite(group, values, allowed)
    lo, hi = _ranges(values, allowed, group.scores)  # (l, h, 1, 1) each
    top = LEVELS[bits]
    span = torch.where(hi > lo, hi - lo, torch.ones_like(hi))
    codes = torch.round((values - lo) / span * top).clamp(0, top)
    codes = torch.where(allowed, codes, torch.full_like(codes, top + 1))
    dtype = np.uint8 if bits == 8 else np.dtype("<u2")
    raw = codes.numpy().astype(dtype).tobytes()
    return {
        "bits": bits,
        "lo": lo.flatten().tolist(),
        "hi": hi.flatten().tolist(),
        "data": base64.b64encode(zlib.compress(raw, 6)).decode("ascii"),
    }


def decode_group(
    stored: dict, shape: tuple[int, int, int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the page reads back from `encode_group`'s output (the page's own arithmetic).

    Args:
        stored: encode_group's dict.
        shape: (layers, heads, queries, keys).

    Returns:
        (values float64, allowed bool), both of `shape`; a masked cell's value is NaN.
    """
    top = LEVELS[stored["bits"]]
    dtype = np.uint8 if stored["bits"] == 8 else np.dtype("<u2")
    raw = zlib.decompress(base64.b64decode(stored["data"]))
    codes = torch.from_numpy(np.frombuffer(raw, dtype=dtype).astype(np.int64)).reshape(shape)
    lo = torch.tensor(stored["lo"], dtype=torch.float64).reshape(*shape[:2], 1, 1)
    hi = torch.tensor(stored["hi"], dtype=torch.float64).reshape(*shape[:2], 1, 1)
    values = lo + codes * ((hi - lo) / top)
    allowed = codes <= top
    return torch.where(allowed, values, torch.nan), allowed


def half_steps(stored: dict) -> list[float]:
    """Each map's stated precision: half a quantisation step, (hi - lo) / (2 N)."""
    top = LEVELS[stored["bits"]]
    return [(hi - lo) / (2 * top) for lo, hi in zip(stored["lo"], stored["hi"], strict=True)]


def decimals_for(half_step: float) -> int:
    """Decimals the page prints a value with: one past the step, so that the display's
    rounding adds at most a twentieth of it (explore.js's decimals)."""
    if half_step <= 0:
        return 4
    return max(2, min(9, math.ceil(-math.log10(half_step)) + 1))


def shown_precision(half_step: float) -> float:
    """What a value the page shows is within: half a step plus the display's rounding
    (explore.js's shownPrecision)."""
    return half_step + 0.5 * 10 ** -decimals_for(half_step)


def _ranges(
    values: torch.Tensor, allowed: torch.Tensor, scores: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each map's (lo, hi) over its unmasked cells, (l, h, 1, 1) each; lo is 0 for
    weights that are all >= 0, so that a zero weight is stored exactly."""
    big = torch.finfo(torch.float64).max
    hi = torch.where(allowed, values, -big).amax(dim=(-2, -1), keepdim=True)  # (l, h, 1, 1)
    lo = torch.where(allowed, values, big).amin(dim=(-2, -1), keepdim=True)
    empty = ~allowed.any(dim=-1, keepdim=True).any(dim=-2, keepdim=True)
    hi = torch.where(empty, 0.0, hi)
    lo = torch.where(empty, 0.0, lo)
    if not scores:
        lo = torch.minimum(lo, torch.zeros_like(lo))
    return lo, hi


def _check_finite(group: Group, values: torch.Tensor, allowed: torch.Tensor) -> None:
    bad = allowed & ~torch.isfinite(values)
    if bad.any():
        layer, head, query, key = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"group {group.name!r}: layer {group.layer_names[layer]!r} head {head} holds "
            f"{values[layer, head, query, key].item()} at unmasked cell ({query}, {key})"
        )
