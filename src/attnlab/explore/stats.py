"""Per-head statistics of attention weights, computed from the full-precision tensor.

For each (layer, head), averaged over the query rows that have at least one key to attend:
- entropy: -sum_j w_ij ln w_ij over the unmasked keys (nats; 0 = all on one key, ln(n) =
  spread evenly over n keys);
- distance: sum_j w_ij |i - j|, how far back (or ahead) a query looks, in tokens;
- first: w_i0, the share on the first token (a high share on the first token of every row
  is an attention sink).
"""

from __future__ import annotations

import torch

from attnlab.explore.data import Group


def head_stats(group: Group) -> list[dict[str, float]] | None:
    """The statistics of each map of `group`, in (layer, head) order; None for scores.

    Args:
        group: the maps.

    Returns:
        One {"entropy", "distance", "first"} per map, or None when the maps are scores.
    """
    if group.scores:
        return None
    allowed = group.full_mask().cpu()
    w = torch.where(allowed, group.weights.detach().to("cpu", torch.float64), 0.0).clamp_min(0)
    _, _, queries, keys = w.shape
    rows = allowed.any(dim=-1)  # (l, h, q): a query with a key to attend
    count = rows.sum(dim=-1).clamp_min(1)  # (l, h)
    plogp = torch.where(w > 0, w * torch.log(w.clamp_min(1e-300)), 0.0)
    entropy = -plogp.sum(dim=-1)  # (l, h, q)
    offsets = (torch.arange(queries)[:, None] - torch.arange(keys)[None, :]).abs()  # (q, k)
    distance = (w * offsets).sum(dim=-1)  # (l, h, q)
    first = w[..., 0]  # (l, h, q)
    means = [
        (torch.where(rows, x, 0.0).sum(dim=-1) / count).flatten().tolist()
        for x in (entropy, distance, first)
    ]
    return [{"entropy": e, "distance": d, "first": f} for e, d, f in zip(*means, strict=True)]
