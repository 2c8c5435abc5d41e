"""Causal attention over a padded batch at the speed of an unpadded one.

A batch of sequences of different lengths is padded on the left (generation) or the right
(training), and its boolean mask is causal & "key j is real in sequence b". Handed over as a
mask, every query block would read every key up to its diagonal, padding included, through
the masked path. Here each sequence's real keys are one range [start, end), and attnlab's
kernel reads only that range for that sequence (flash_cpu.attention's key_ranges), with no
mask at all: queries before the range see no key and get zeros, queries after it (right
padding) see the whole range.

Shapes: q, k, v (b, h, t, d) with as many queries as keys; the mask (b|1, 1, t|1, t) bool.
"""

from __future__ import annotations

import torch

from attnlab import flash_cpu, masks


def key_ranges(allowed: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each sequence's real keys [start, end) as int64 (b,) tensors, when `allowed` (with
    the causal mask if `causal`) is exactly causal & (start_b <= key < end_b); else None.

    Args:
        allowed: bool (b|1, 1, tq|1, tk) with tq == tk (checked by the caller).
        causal: whether the causal mask is to be applied on top of `allowed`.
    """
    tokens = allowed.shape[-1]
    keep = allowed[:, 0, -1, :]  # (b, t): the last query sees every real key
    positions = torch.arange(tokens, device=allowed.device)
    starts = torch.where(keep, positions, tokens).amin(dim=-1)  # (b,)
    ends = torch.where(keep, positions + 1, 0).amax(dim=-1).clamp(min=starts)
    in_range = (positions >= starts[:, None]) & (positions < ends[:, None])  # (b, t)
    if not torch.equal(keep, in_range):
        return None
    if not (causal and allowed.shape[2] == 1):  # a full mask: every row must be the range
        causal_allowed = masks.causal_mask(tokens, tokens, device=allowed.device)  # (t, t)
        combined = allowed & causal_allowed if causal else allowed
        if not torch.equal(combined, causal_allowed & in_range[:, None, None, :]):
            return None
    return starts.contiguous(), ends.contiguous()


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ranges: tuple[torch.Tensor, torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence over its keys [start, end) with attnlab's kernel,
    in one call, differentiable; rows before `start` are zero. (b, hq, t, hdv)."""
    batch = q.shape[0]  # a mask without a batch dimension gives one range for all
    starts, ends = ranges[0].expand(batch).contiguous(), ranges[1].expand(batch).contiguous()
    return flash_cpu.attention(q, k, v, None, scale, True, key_ranges=(starts, ends))
