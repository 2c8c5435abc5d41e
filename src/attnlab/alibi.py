"""ALiBi (Press et al., "Train short, test long"): no position embeddings; each head adds
to a score a penalty proportional to the distance between query and key, with a slope per
head from a fixed geometric sequence. The bias is an additive float mask for
attnlab.functional.attention (or MultiHeadAttention's `mask`).

Shapes: slopes (h,); bias (1, h, tq, tk).
"""

from __future__ import annotations

import torch

from attnlab import masks
from attnlab._validate import check_size


def slopes(num_heads: int) -> torch.Tensor:
    """The heads' slopes: 2^(-8/n), its powers up to n for n a power of two; otherwise those
    of the power of two below, then every second one of the power above (as BLOOM and the
    paper's code take them).

    Args:
        num_heads: number of heads (>= 1).

    Returns:
        (num_heads,) float32 slopes, largest first.

    Raises:
        TypeError: num_heads is not an int.
        ValueError: num_heads < 1, or past MAX_SIZE (2**40).

    Examples:
        >>> slopes(4)
        tensor([0.2500, 0.0625, 0.0156, 0.0039])
    """
    num_heads = check_size("num_heads", num_heads)
    below = 1 << (num_heads.bit_length() - 1)  # the power of two at or below, exactly
    head_slopes = _powers(below, below)
    if below < num_heads:  # every second power of 2 * below: its exponents 1, 3, 5, ...
        head_slopes = torch.cat([head_slopes, _powers(2 * below, num_heads - below, step=2)])
    return head_slopes.float()


def _powers(n: int, count: int, step: int = 1) -> torch.Tensor:
    """(2^(-8/n))^e for e = 1, 1 + step, ..., `count` of them, float64 (one tensor op, not a
    Python loop: a large count fails at once on memory instead of running for hours)."""
    exponents = torch.arange(1, 1 + step * count, step, dtype=torch.float64)
    return torch.full((), 2.0 ** (-8.0 / n), dtype=torch.float64) ** exponents


def bias(
    head_slopes: torch.Tensor,
    num_queries: int,
    num_keys: int | None = None,
) -> torch.Tensor:
    """slope_h * (key position - query position), the queries being the newest tokens
    (query i is at position num_keys - num_queries + i, as attention's causal mask has it).

    Args:
        head_slopes: (h,) floating-point slopes, e.g. `slopes(h)`.
        num_queries: tq, an int >= 0.
        num_keys: tk, an int >= 0 (default tq).

    Returns:
        (1, h, tq, tk) additive bias in the slopes' dtype and device: 0 on the diagonal,
        negative for earlier keys (and positive for later ones, which causal masks away).
        Pass it as the `mask` of attnlab.functional.attention, with causal=True.

    Raises:
        TypeError: head_slopes is not a 1-D floating-point tensor, or a size not an int.
        ValueError: a negative size, or a size or heads x num_queries x num_keys past
            MAX_SIZE (2**40).

    Examples:
        >>> bias(torch.tensor([0.5]), num_queries=2, num_keys=3)
        tensor([[[[-0.5000,  0.0000,  0.5000],
                  [-1.0000, -0.5000,  0.0000]]]])
    """
    if not isinstance(head_slopes, torch.Tensor) or head_slopes.dim() != 1:
        raise TypeError(f"head_slopes must be a 1-D tensor (heads,), got {head_slopes!r:.60}")
    if not head_slopes.is_floating_point():
        raise TypeError(f"head_slopes must be floating point, got {head_slopes.dtype}")
    tq = check_size("num_queries", num_queries, minimum=0)
    tk = tq if num_keys is None else check_size("num_keys", num_keys, minimum=0)
    heads = head_slopes.shape[0]
    check_size(
        f"heads x num_queries x num_keys ({heads} x {tq} x {tk})", heads * tq * tk, minimum=0
    )
    device = head_slopes.device
    query_positions, key_positions = masks.aligned_positions(tq, tk, device=device)  # (tq,), (tk,)
    distance = key_positions[None, :] - query_positions[:, None]  # (tq, tk)
    return head_slopes[None, :, None, None] * distance.to(head_slopes.dtype)  # (1, h, tq, tk)
