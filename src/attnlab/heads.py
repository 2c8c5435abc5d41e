"""Grouped-query heads: key/value head j serves query heads j * groups .. (j + 1) * groups - 1
(groups = hq / hkv; hkv = 1 is multi-query). Kernels that want one key/value head per query
head get them repeated here, and the gradient of the repeated heads is summed back here.

Shapes: key/value tensors (b, hkv, n, d); repeated (b, hkv * groups, n, d).
"""

from __future__ import annotations

import torch


def repeat_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Each key/value head repeated for the `groups` query heads it serves (t itself for 1)."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)  # (b, hkv * groups, n, d)


def sum_groups(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of repeat_kv's output summed back onto each key/value head."""
    if groups == 1:
        return grad
    b, hq, n, d = grad.shape
    return grad.view(b, hq // groups, groups, n, d).sum(2)  # (b, hkv, n, d)
