"""Rotary position embeddings (RoPE): each pair of features (i, i + hd/2) of a query or key
at position m is rotated by the angle m * base^(-2i/hd), so that q.k depends only on the
distance between the two positions. The pairing is the "rotate half" layout of GPT-NeoX and
Hugging Face's Llama. A scaling (attnlab.rope_scaling: Llama 3's, linear, YaRN) changes the
angles for long contexts; a rotary_dim below head_dim rotates only the first rotary_dim
features and passes the rest through (partial rotary, as GPT-NeoX and Phi).

Shapes: x is (b, heads, t, hd); the cos/sin tables are (positions, hd), kept in float32
whatever the module's dtype, and the rotation is computed in float32 (in float64 for float64
x, whose values past float32's largest it would make infinite).
"""

from __future__ import annotations

import torch
from torch import nn

from attnlab import _own_code, debug, rope_scaling
from attnlab._validate import (
    check_float,
    check_same_device,
    check_size,
    check_tensor,
)


class RotaryEmbedding(nn.Module):
    """Rotary embeddings with precomputed cos/sin tables for positions 0 .. max_positions - 1;
    forward(x, start) rotates x's tokens as positions start, start + 1, ...

    The tables are float32 buffers (not saved in the state_dict) and stay float32 on the
    module's device after `.to()`, whatever its dtype.

    Args:
        head_dim: features per head, an even int >= 2.
        max_positions: positions the tables cover, an int >= 1.
        base: the frequency base, a finite float > 1 (10000 in RoFormer and Llama).
        scaling: a rotary scaling, transformers' rope_scaling / rope_parameters dict or the
            book's freq_config (attnlab.rope_scaling.check_scaling), or None.
        rotary_dim: the features rotated (even, at most head_dim; default head_dim).
        device: where the tables go (default the CPU).

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: an odd or non-positive head_dim, max_positions < 1, base <= 1 or not
            finite, or head_dim, max_positions or their product past MAX_SIZE (2**40), a
            scaling attnlab does not compute, or an odd rotary_dim or one past head_dim.

    Examples:
        >>> rope = RotaryEmbedding(head_dim=8, max_positions=16)
        >>> q = torch.randn(1, 2, 4, 8)  # (b, heads, t, hd)
        >>> rope(q, start=3).shape  # rotated as positions 3..6
        torch.Size([1, 2, 4, 8])
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        base: float = 10000.0,
        *,
        scaling: dict | None = None,
        rotary_dim: int | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        head_dim = _check_head_dim(head_dim)
        max_positions = _check_positions("max_positions", max_positions, head_dim)
        self.head_dim, self.max_positions = head_dim, max_positions
        self.base = check_base(base, "base")
        self.scaling = rope_scaling.check_scaling(scaling, "scaling")
        self.rotary_dim = check_rotary_dim(rotary_dim, head_dim)
        cos, sin = self._tables(device)
        self.register_buffer("cos", cos, persistent=False)  # (positions, rotary_dim), float32
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, device: torch.device | str | None) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_tables(
            self.head_dim,
            self.max_positions,
            self.base,
            scaling=self.scaling,
            rotary_dim=self.rotary_dim,
            device=device,
        )

    def _apply(self, fn, recurse=True):
        """After .to()/.cuda()/.half(): tables rebuilt in float32 on the new device, never
        rounded to the module's dtype."""
        super()._apply(fn, recurse)
        self.cos, self.sin = self._tables(self.cos.device)
        return self

    def extra_repr(self) -> str:
        """The sizes shown by repr(module)."""
        extra = "" if self.rotary_dim == self.head_dim else f", rotary_dim={self.rotary_dim}"
        extra += "" if self.scaling is None else f", scaling={self.scaling}"
        return (
            f"head_dim={self.head_dim}, max_positions={self.max_positions}, base={self.base}"
            + extra
        )

    def forward(self, x: torch.Tensor, start: int | torch.Tensor = 0) -> torch.Tensor:
        """Rotate each token of `x` by its position. MultiHeadAttention calls its rope this
        way (so the rope's hooks and a subclass's forward run on its Python path).

        Args:
            x: (b, heads, t, head_dim) floating-point, on the tables' device.
            start: the position of x's first token (an int >= 0), or each token's position
                as an integer tensor (t,) on the tables' device (a StaticKVCache's, read
                on the device; its values are checked where attnlab.debug lets a check
                read them: on the CPU by default).

        Returns:
            x rotated, token j as position start + j (or start[j]), in x's dtype.

        Raises:
            TypeError: x is not a floating-point tensor, or start neither an int nor an
                integer tensor.
            ValueError: x's shape or device does not fit the tables, or the positions
                run past max_positions.
        """
        x = check_tensor(
            "x",
            x,
            ndims=(4,),
            layout="(batch, heads, tokens, head_dim)",
            last_dim=self.head_dim,
            last_dim_name="head_dim",
        )
        check_same_device(x=x, rotary_tables=self.cos)
        if isinstance(start, torch.Tensor):
            return self.rotate_at(x, self._checked_positions(start, x.shape[-2]))
        start = check_size("start", start, minimum=0)
        end = start + x.shape[-2]
        if end > self.max_positions:
            raise ValueError(
                f"start ({start}) + x's {x.shape[-2]} tokens reach position {end - 1}, outside "
                f"the rotary tables (0..{self.max_positions - 1}, max_positions "
                f"{self.max_positions})"
            )
        return self.rotate(x, start)

    def _checked_positions(self, positions: torch.Tensor, tokens: int) -> torch.Tensor:
        if positions.dtype.is_floating_point or positions.dtype.is_complex:
            raise TypeError(f"start as a tensor must hold integers, got {positions.dtype}")
        if positions.shape != (tokens,):
            raise ValueError(
                f"start as a tensor must hold one position per token, ({tokens},); got "
                f"{tuple(positions.shape)}"
            )
        check_same_device(start=positions, rotary_tables=self.cos)
        if tokens and debug.reads_values(positions):
            low, high = int(positions.min()), int(positions.max())
            if low < 0 or high >= self.max_positions:
                raise ValueError(
                    f"start holds positions {low}..{high}, outside the rotary tables "
                    f"(0..{self.max_positions - 1}, max_positions {self.max_positions})"
                )
        return positions

    def rotate(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """forward() for a caller that checked x and start itself (MultiHeadAttention checks
        its whole call, positions included, before any of it runs).

        Args:
            x: (b, heads, t, head_dim) on the tables' device, start + t <= max_positions.
            start: the position of x's first token.

        Returns:
            x rotated, in x's dtype.
        """
        tokens = x.shape[-2]
        return _rotate(x, self.cos.narrow(0, start, tokens), self.sin.narrow(0, start, tokens))

    def rotate_at(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """rotate() at positions held on the device (a StaticKVCache's), read by index.

        Args:
            x: (b, heads, t, head_dim) on the tables' device.
            positions: (t,) integer positions, each < max_positions (the caller's check).

        Returns:
            x rotated, token j as positions[j], in x's dtype.
        """
        return _rotate(x, self.cos.index_select(0, positions), self.sin.index_select(0, positions))


# the native decode step stands for its forward: a class-level patch takes the Python path,
# which calls the rope
_AS_DEFINED = _own_code.as_defined(RotaryEmbedding)


def code_as_written() -> bool:
    """True when RotaryEmbedding's methods are the ones this file defines (no class patch)."""
    return _AS_DEFINED(RotaryEmbedding)


def rotary_tables(
    head_dim: int,
    num_positions: int,
    base: float,
    *,
    scaling: dict | None = None,
    rotary_dim: int | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * inv_freq_i (base^(-2i/rd), or a scaling's schedule), each
    (positions, rotary_dim) in float32 and multiplied by the scaling's attention factor, the
    half of the frequencies repeated so that feature i and i + rd/2 share an angle.

    Args:
        head_dim: an even int >= 2.
        num_positions: an int >= 1.
        base: a finite float > 1.
        scaling: a rotary scaling (attnlab.rope_scaling.check_scaling), or None.
        rotary_dim: the features rotated (even, at most head_dim; default head_dim).
        device: where the tables go.

    Returns:
        (cos, sin), each (num_positions, rotary_dim) float32.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: an odd or non-positive head_dim, num_positions < 1, base <= 1 or not
            finite, or head_dim, num_positions or their product past MAX_SIZE (2**40), a
            scaling attnlab does not compute, an odd rotary_dim or one past head_dim.
    """
    head_dim = _check_head_dim(head_dim)
    num_positions = _check_positions("num_positions", num_positions, head_dim)
    base = check_base(base, "base")
    scaling = rope_scaling.check_scaling(scaling, "scaling")
    rotary_dim = check_rotary_dim(rotary_dim, head_dim)
    # float64 on the CPU for exact angles at large positions (not every device has float64)
    inv_freq, factor = rope_scaling.inverse_frequencies(rotary_dim, base, scaling)  # (rd/2,)
    positions = torch.arange(num_positions, dtype=torch.float64)
    angles = torch.outer(positions, inv_freq)  # (positions, rd/2)
    angles = torch.cat([angles, angles], dim=-1)  # (positions, rd)
    cos, sin = angles.cos() * factor, angles.sin() * factor
    return cos.float().to(device), sin.float().to(device)


def check_rotary_dim(rotary_dim: object, head_dim: int) -> int:
    """`rotary_dim` (default head_dim) if it is an even int in [2, head_dim].

    Raises:
        TypeError: not an int.
        ValueError: odd, < 2 or past head_dim.
    """
    if rotary_dim is None:
        return head_dim
    rotary_dim = _check_head_dim(rotary_dim, "rotary_dim")
    if rotary_dim > head_dim:
        raise ValueError(f"rotary_dim ({rotary_dim}) must be at most head_dim ({head_dim})")
    return rotary_dim


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin in float32 (float64 for float64 x), returned in x's
    dtype.

    Args:
        x: (..., t, hd) floating-point, at least 2-D, with an even hd.
        cos: (t, hd) floating-point, on x's device (rotary_tables, rows for x's positions).
        sin: the same for the sines.

    Returns:
        x rotated, in x's dtype.

    Raises:
        TypeError: a non-tensor or a non-floating tensor.
        ValueError: cos or sin not (t, hd) for x's last two dimensions, an odd hd, or
            tensors on different devices.
    """
    x = check_tensor("x", x, ndims=range(2, 9), layout="(..., tokens, head_dim)")
    _check_head_dim(x.shape[-1], "x's last dimension (head_dim)")
    for name, table in (("cos", cos), ("sin", sin)):
        check_tensor(name, table, ndims=(2,), layout="(tokens, head_dim)")
        if table.shape != x.shape[-2:]:
            raise ValueError(
                f"{name} has shape {tuple(table.shape)} but x's tokens and head_dim are "
                f"{tuple(x.shape[-2:])}: take the table's rows for x's positions"
            )
    check_same_device(x=x, cos=cos, sin=sin)
    return _rotate(x, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary without the checks; with tables narrower than x (partial rotary), the
    first cos.shape[-1] features rotated and the rest passed through."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        passed = x.narrow(-1, rotary_dim, x.shape[-1] - rotary_dim)
        rotated = _rotate(x.narrow(-1, 0, rotary_dim), cos, sin)
        return torch.cat([rotated, passed], dim=-1)  # (..., t, hd)
    wide = x.to(torch.promote_types(x.dtype, torch.float32))  # float64 stays float64
    half = x.shape[-1] // 2
    rotated = torch.cat(
        [-wide.narrow(-1, half, half), wide.narrow(-1, 0, half)], dim=-1
    )  # rotate_half
    return (wide * cos + rotated * sin).to(x.dtype)


def check_base(base: object, name: str = "rope_base") -> float:
    """Return `base` as a float if it is a finite real number > 1.

    Args:
        base: the rotary base (a numpy float or integer is accepted).
        name: the argument's name in the message ("rope_base" for MultiHeadAttention,
            "base" for RotaryEmbedding).

    Returns:
        `base` as a Python float.

    Raises:
        TypeError: not a real number (a bool included).
        ValueError: NaN, infinite or <= 1.
    """
    return check_float(name, base, greater_than=1.0)


def _check_head_dim(head_dim: object, name: str = "head_dim") -> int:
    """An even int in [2, MAX_SIZE] (rotate-half pairs feature i with i + hd/2)."""
    head_dim = check_size(name, head_dim)
    if head_dim % 2 != 0:
        raise ValueError(f"rotary embeddings need an even {name}, got {head_dim}")
    return head_dim


def _check_positions(name: str, num_positions: object, head_dim: int) -> int:
    """An int in [1, MAX_SIZE] whose (positions, head_dim) tables hold at most MAX_SIZE
    entries each."""
    num_positions = check_size(name, num_positions)
    check_size(f"{name} x head_dim ({num_positions} x {head_dim})", num_positions * head_dim)
    return num_positions
