"""RMSNorm for queries and keys (QK-norm): Qwen3 and Gemma 3 normalise each head's queries
and keys before the rotation, OLMo 2 the whole projection.

y = x / sqrt(mean(x^2) + eps) * (offset + weight), computed in float32 (float64 for float64
x; each row first divided by its largest magnitude where that passes 1, so that no square
overflows) and returned in x's dtype; offset is 0 for Qwen3 and OLMo 2 (the weight starts at
ones) and 1 for Gemma, whose weight is stored as the difference from one (it starts at
zeros).
"""

from __future__ import annotations

import torch
from torch import nn

from attnlab import _own_code
from attnlab._validate import check_float, check_size


def check_offset(name: str, offset: float, dtype: torch.dtype | None) -> float:
    """`offset` if the weight's identity value, 1 - offset, is finite in `dtype` (None:
    torch's default), else a ValueError naming `name`."""
    weight_dtype = dtype or torch.get_default_dtype()
    if not abs(1.0 - offset) <= torch.finfo(weight_dtype).max:
        raise ValueError(
            f"{name} ({offset}) puts the weight's identity value, 1 - {name}, past "
            f"{weight_dtype}'s largest value"
        )
    return offset


class RMSNorm(nn.Module):
    """Root-mean-square normalisation over the last dimension with a learned scale.

    Args:
        dim: the features normalised (the last dimension of the input).
        eps: added to the mean square, a finite float > 0.
        offset: added to the weight when it scales (1.0 for Gemma's `1 + weight`).
        device: where the weight goes.
        dtype: the weight's dtype.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: dim < 1, eps not positive and finite, or 1 - offset past the weight
            dtype's largest value.

    Examples:
        >>> norm = RMSNorm(8)
        >>> torch.allclose(norm(torch.full((2, 8), 3.0)), torch.ones(2, 8))
        True
    """

    def __init__(
        self,
        dim: int,
        eps: float = 1e-6,
        *,
        offset: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.dim = check_size("dim", dim)
        self.eps = check_float("eps", eps, greater_than=0.0)
        self.offset = check_float("offset", offset)
        start = 1.0 - check_offset("offset", self.offset, dtype)  # the identity scale
        self.weight = nn.Parameter(torch.full((self.dim,), start, device=device, dtype=dtype))

    def extra_repr(self) -> str:
        """The sizes shown by repr(module)."""
        return f"{self.dim}, eps={self.eps}, offset={self.offset}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., dim) normalised and scaled, in x's dtype."""
        wide = x.to(torch.promote_types(x.dtype, torch.float32))  # float64 stays float64
        # x / s over mean((x / s)^2) + eps / s^2 is the same function for any s > 0: with
        # s = max(1, max |x|) per row no square overflows (x of 1e20 squared is inf in
        # float32, which made the row zeros), and rows within 1 compute as written above
        s = wide.abs().amax(-1, keepdim=True).clamp(min=1.0)  # (..., 1)
        unit = wide / s
        # an eps below the dtype's smallest normal value counts as that value: it would
        # round to 0, and a row of zeros would give 0 / 0
        eps = max(self.eps, torch.finfo(wide.dtype).tiny)
        normed = unit * torch.rsqrt(unit.pow(2).mean(-1, keepdim=True) + eps / (s * s))
        return (normed * (self.offset + self.weight.to(wide.dtype))).to(x.dtype)


# the native decode step stands for its forward: a class-level patch takes the Python path,
# which calls the norm
_AS_DEFINED = _own_code.as_defined(RMSNorm)


def code_as_written() -> bool:
    """True when RMSNorm's methods are the ones this file defines (no class patch)."""
    return _AS_DEFINED(RMSNorm)
