"""The one layout attention kernels are given: each token a row of contiguous features.

BLAS (attnlab's CPU kernel) and PyTorch's fused SDPA kernels read a head's tokens as rows a
token stride apart, with features next to each other. Views of other shapes reach them from
users' code: expanded (stride 0), overlapping (`unfold`: stride 1), features stepped by
`as_strided`. BLAS refuses a token stride below the row width (and MKL says so on stdout
while returning garbage); PyTorch's CPU flash kernel silently misreads overlapping rows.
dense_rows copies exactly those, before any kernel sees them.
"""

from __future__ import annotations

import torch

_MAX_LEADING = 2**31 - 1  # BLAS leading dimensions are 32-bit ints


def dense_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when its features are contiguous and its tokens at least d apart (at most
    INT_MAX), else a contiguous copy. Batch and head strides may be anything: kernels use
    them only as offsets.

    Args:
        t: (..., tokens, d), any layout.

    Returns:
        t, or a contiguous copy of it with the same values.
    """
    if t.stride(-1) == 1 and t.shape[-1] <= t.stride(-2) <= _MAX_LEADING:
        return t
    # not .contiguous(): it keeps any stride of a size-1 dimension, tokens included
    return t.clone(memory_format=torch.contiguous_format)
