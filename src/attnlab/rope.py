"""Rotary position embeddings (RoPE): each pair of features (i, i + hd/2) of a query or key
at position m is rotated by the angle m * base^(-2i/hd), so that q.k depends only on the
distance between the two positions. The pairing is the "rotate half" layout of GPT-NeoX and
Hugging Face's Llama.

Shapes: x is (b, heads, t, hd); the cos/sin tables are (positions, hd), kept in float32
whatever the module's dtype, and the rotation is computed in float32.
"""

from __future__ import annotations

import numbers

import torch
from torch import nn

from attnlab._validate import check_int


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables for positions 0 .. max_positions - 1; forward(x, start)
    rotates x's tokens as positions start, start + 1, ..."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        base: float = 10000.0,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = check_int("head_dim", head_dim)
        if head_dim % 2 != 0:
            raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
        self.max_positions = check_int("max_positions", max_positions)
        self.base = check_base(base)
        cos, sin = rotary_tables(head_dim, max_positions, self.base, device=device)
        self.register_buffer("cos", cos, persistent=False)  # (positions, hd), float32
        self.register_buffer("sin", sin, persistent=False)

    def _apply(self, fn, recurse=True):
        """After .to()/.cuda()/.half(): tables rebuilt in float32 on the new device, never
        rounded to the module's dtype."""
        super()._apply(fn, recurse)
        self.cos, self.sin = rotary_tables(
            self.head_dim, self.max_positions, self.base, device=self.cos.device
        )
        return self

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_positions={self.max_positions}, base={self.base}"

    def forward(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """(b, heads, t, hd) -> the same, token j rotated as position start + j."""
        end = start + x.shape[-2]
        if start < 0 or end > self.max_positions:
            raise ValueError(
                f"positions {start}..{end - 1} are outside the rotary tables "
                f"(0..{self.max_positions - 1})"
            )
        return apply_rotary(x, self.cos[start:end], self.sin[start:end])


def rotary_tables(
    head_dim: int, num_positions: int, base: float, *, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * base^(-2i/hd), each (positions, hd) in float32, the half
    of the frequencies repeated so that feature i and i + hd/2 share an angle."""
    # float64 on the CPU for exact angles at large positions (not every device has float64)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    inv_freq = base**-exponents  # (hd/2,)
    positions = torch.arange(num_positions, dtype=torch.float64)
    angles = torch.outer(positions, inv_freq)  # (positions, hd/2)
    angles = torch.cat([angles, angles], dim=-1)  # (positions, hd)
    return angles.cos().float().to(device), angles.sin().float().to(device)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin in float32, returned in x's dtype; cos/sin (t, hd)."""
    x32 = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)  # rotate_half
    return (x32 * cos + rotated * sin).to(x.dtype)


def check_base(base: object) -> float:
    """Return `base` as a float if it is a real number > 1."""
    if isinstance(base, bool) or not isinstance(base, numbers.Real):
        raise TypeError(f"rope_base must be a float, got {type(base).__name__} ({base!r})")
    if not float(base) > 1.0:
        raise ValueError(f"rope_base must be > 1, got {base}")
    return float(base)
