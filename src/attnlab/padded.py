"""Causal attention over a padded batch at the speed of an unpadded one.

A batch of sequences of different lengths is padded on the left (generation) or the right
(training), and its boolean mask is causal & "key j is real in sequence b". Handed over as a
mask, every query block reads every key up to its diagonal, padding included, through the
masked path. Here each sequence's real keys are one range [start, end), so its attention is
the causal kernel on that range (no mask at all), plus, after the range (right padding),
queries that see the whole range; queries before it see no key and get zeros.

Shapes: q, k, v (b, h, t, d) with as many queries as keys; the mask (b|1, 1, t|1, t) bool.
"""

from __future__ import annotations

import torch

from attnlab import flash_cpu, masks


def key_ranges(allowed: torch.Tensor, causal: bool) -> tuple[list[int], list[int]] | None:
    """Each sequence's real keys [start, end), when `allowed` (with the causal mask if
    `causal`) is exactly causal & (start_b <= key < end_b); else None.

    Args:
        allowed: bool (b|1, 1, tq|1, tk) with tq == tk (checked by the caller).
        causal: whether the causal mask is to be applied on top of `allowed`.

    Returns:
        (starts, ends), one int per sequence each, or None when the mask is anything else
        (the caller then takes the masked path).
    """
    tokens = allowed.shape[-1]
    causal_allowed = masks.causal_mask(tokens, tokens, device=allowed.device)  # (t, t)
    combined = allowed & causal_allowed if causal else allowed
    keep = combined[:, 0, -1, :]  # (b, t): the last query sees every real key
    positions = torch.arange(tokens, device=allowed.device)
    starts = torch.where(keep, positions, tokens).amin(dim=-1)  # (b,)
    ends = torch.where(keep, positions + 1, 0).amax(dim=-1)
    in_range = (positions >= starts[:, None]) & (positions < ends[:, None])  # (b, t)
    if not torch.equal(keep, in_range):
        return None
    if not torch.equal(combined, causal_allowed & in_range[:, None, None, :]):
        return None
    return starts.tolist(), ends.tolist()


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ranges: tuple[list[int], list[int]],
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence over its keys [start, end) with attnlab's kernel,
    differentiable; rows before `start` are zero.

    Args:
        q: (b, hq, t, hd) float32 CPU queries (as many as keys).
        k: (b, hkv, t, hd) keys.
        v: (b, hkv, t, hd) values.
        ranges: (starts, ends) from `key_ranges`.
        scale: multiplies the scores.

    Returns:
        (b, hq, t, hd), equal to the masked math backend's output.
    """
    outputs = [
        _one_sequence(q[i : i + 1], k[i : i + 1], v[i : i + 1], start, end, scale)
        for i, (start, end) in enumerate(zip(*ranges, strict=True))
    ]
    return torch.cat(outputs, dim=0)  # (b, hq, t, hdv)


def _one_sequence(q, k, v, start: int, end: int, scale: float) -> torch.Tensor:
    """(1, hq, t, hdv): zeros before start, causal over [start, end), then the queries past
    the range over the whole range. Every piece stays in the graph (zero gradients)."""
    if end <= start:  # no real key: the kernel's empty rows, zeros with zero gradients
        blocked = q.new_full((1, 1, 1, k.shape[2]), -torch.inf)
        return flash_cpu.attention(q, k, v, blocked, scale, True)
    keys, values = k[:, :, start:end], v[:, :, start:end]  # (1, hkv, end - start, d)
    pieces = [
        q[:, :, :start] * 0.0,  # (1, hq, start, hdv): no key to see (hdv == hd here)
        flash_cpu.attention(q[:, :, start:end], keys, values, None, scale, True),
    ]
    if end < q.shape[2]:
        pieces.append(flash_cpu.attention(q[:, :, end:], keys, values, None, scale, False))
    return torch.cat(pieces, dim=2)  # (1, hq, t, hdv)
