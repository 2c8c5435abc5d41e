"""Rotary positions in the reference: the layouts modern attention code uses, and what the
audited module says about its own.

Two conventions rotate a head's first `dim` features by position x base^(-2i/dim):
"halves" pairs feature i with i + dim/2 (rotate_half: GPT-NeoX, HF Llama) and "pairs" pairs
2i with 2i + 1 (rotate_every_two, complex multiplication by freqs_cis: GPT-J, Meta's
Llama). The features past `dim` pass unrotated (partial rotary: GPT-NeoX's rotary_pct,
GPT-J's rotary_dim).

`candidates(module, head_dim)` reads the base and the rotated width from the module where
it keeps them: an inv_freq buffer (its length and first ratio), cos/sin tables or a
complex freqs_cis (their width and the angle at position 1), attributes named like a base
(rope_theta, rotary_emb_base, base) or a rotated width (rotary_dim, rotary_ndims,
rotary_pct, partial_rotary_factor). Where nothing says, the usual bases (10000, 500000,
1e6) and widths (head_dim, half, a quarter) are tried. Shapes: x (b, h, t, hd).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

STYLES = ("halves", "pairs")
_USUAL_BASES = (10000.0, 500000.0, 1000000.0)
_BASE_NAMES = ("rope_theta", "rotary_emb_base", "rotary_base", "rope_base", "theta", "base")
_DIM_NAMES = ("rotary_dim", "rotary_ndims", "rot_dim", "rope_dim")
_FRACTION_NAMES = ("rotary_pct", "partial_rotary_factor")
_TABLE_NAMES = ("inv_freq", "freqs_cis", "cos_cached", "cos", "_cos_cached", "cos_table")


@dataclass(frozen=True)
class Rotary:
    """One rotary layout: the convention, the rotated features per head, the base."""

    style: str
    dim: int
    base: float

    def __str__(self) -> str:
        return f"rotary ({self.style}, {self.dim} features, base {self.base:g})"

    def apply(self, x: torch.Tensor, swapped: bool = False) -> torch.Tensor:
        """x (b, h, t, hd), position p = index along t, rotated; features past dim unchanged.
        swapped: the classic convention swap, the tables laid out for this style and the
        features paired the other way (halves tables cat(freqs, freqs) with interleaved
        pairs rotated, or repeat_interleave tables with rotate_half): no rotation at all
        (the two features of a pair turn by different angles)."""
        t = x.shape[-2]
        exponents = torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim
        angles = torch.arange(t, dtype=torch.float64)[:, None] * self.base**-exponents  # (t, dim/2)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        rot, rest = x[..., : self.dim], x[..., self.dim :]
        if swapped:
            rotated = _swapped(rot, cos, sin, self.style)
        elif self.style == "halves":
            first, second = rot[..., : self.dim // 2], rot[..., self.dim // 2 :]
            rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), -1)
        else:
            even, odd = rot[..., 0::2], rot[..., 1::2]
            pairs = (even * cos - odd * sin, odd * cos + even * sin)
            rotated = torch.stack(pairs, dim=-1).flatten(-2)  # (.., dim/2, 2) -> (.., dim)
        return torch.cat((rotated, rest), dim=-1)


def _swapped(rot: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str):
    """rot * cos + turned(rot) * sin with tables of `style`'s layout and the other style's
    turn: cos, sin (t, dim/2)."""
    if style == "halves":  # tables cat(freqs, freqs), turned in interleaved pairs
        cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
        even, odd = rot[..., 0::2], rot[..., 1::2]
        turned = torch.stack((-odd, even), dim=-1).flatten(-2)
    else:  # tables repeat_interleave(freqs, 2), turned in halves
        cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
        half = rot.shape[-1] // 2
        turned = torch.cat((-rot[..., half:], rot[..., :half]), -1)
    return rot * cos + turned * sin


def candidates(module: nn.Module, head_dim: int) -> tuple[list[Rotary], list[str]]:
    """(rotary layouts to try, the module's state they account for): what the module keeps
    first, then the usual values; empty when head_dim is odd."""
    if head_dim % 2:
        return [], []
    dims, bases, owned = _read(module, head_dim)
    read = bool(dims or bases)
    dims = dims or [head_dim, head_dim // 2, head_dim // 4]
    bases = bases or list(_USUAL_BASES)
    dims = [d for d in dict.fromkeys(dims) if d >= 2 and d % 2 == 0 and d <= head_dim]
    specs = [Rotary(style, d, b) for b in dict.fromkeys(bases) for d in dims for style in STYLES]
    if read:  # the usual values after the module's own, in case a read was misleading
        specs += [Rotary(s, head_dim, b) for b in _USUAL_BASES for s in STYLES]
    return list(dict.fromkeys(specs)), owned


def _read(module: nn.Module, head_dim: int) -> tuple[list[int], list[float], list[str]]:
    dims: list[int] = []
    bases: list[float] = []
    owned: list[str] = []
    for name, tensor in [*module.named_buffers(), *module.named_parameters()]:
        leaf = name.rpartition(".")[2]
        if leaf not in _TABLE_NAMES or tensor.dim() == 0:
            continue
        found = _from_table(leaf, tensor.detach())
        if found is not None:
            dims.append(found[0])
            bases.append(found[1])
            owned.append(name)
        if leaf == "cos" or leaf.startswith(("cos", "_cos")):
            owned.append(name.replace("cos", "sin"))  # its sine twin
    owners = [*module.modules(), *(getattr(m, "config", None) for m in module.modules())]
    for sub in owners:
        fields = sub if isinstance(sub, dict) else getattr(sub, "__dict__", {})
        nested = [v for v in fields.values() if isinstance(v, dict)]  # rope_parameters
        for attribute, value in [*fields.items(), *(i for d in nested for i in d.items())]:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if attribute in _BASE_NAMES and value > 1:
                bases.append(float(value))
            elif attribute in _DIM_NAMES and 2 <= value <= head_dim:
                dims.append(int(value))
            elif attribute in _FRACTION_NAMES and 0 < value <= 1:
                dims.append(int(head_dim * value))
    return dims, bases, owned


def _from_table(leaf: str, table: torch.Tensor) -> tuple[int, float] | None:
    """(rotated width, base) of an inv_freq (dim/2,), a complex freqs_cis (positions,
    dim/2) or a cos table (positions, dim) whose second row holds the angles at position 1;
    None when it does not read as one."""
    if leaf == "inv_freq" and table.dim() == 1 and table.numel() >= 2:
        ratio = table[1].double().item()  # base^(-2/dim)
        return 2 * table.numel(), _base(ratio, 2 * table.numel())
    if table.is_complex() and table.dim() == 2 and table.shape[0] >= 2 and table.shape[1] >= 2:
        angle = torch.angle(table[1, 1]).double().item()
        return 2 * table.shape[1], _base(angle, 2 * table.shape[1])
    if table.is_floating_point() and table.dim() >= 2 and table.shape[-2] >= 2:
        row = table.reshape(-1, *table.shape[-2:])[0, 1].double().clamp(-1, 1)  # position 1
        dim = row.numel()
        if dim < 4 or dim % 2:
            return None
        # halves repeat the frequencies as [f0 .. f(d/2-1), f0 ..]: frequency 1 at index 1;
        # pairs as [f0, f0, f1, f1, ..]: at index 2
        index = (
            1 if torch.isclose(row[0], row[dim // 2]) and not torch.isclose(row[0], row[1]) else 2
        )
        return dim, _base(row[index].acos().item(), dim)
    return None


def _base(ratio: float, dim: int) -> float:
    """The base whose frequency 1 (of dim/2) is `ratio` (ratio = base^(-2/dim)), to three
    significant digits."""
    if not 0 < ratio < 1:
        return 10000.0
    return float(f"{ratio ** (-dim / 2):.3g}")  # a float32 table's rounding off: 1e4, 5e5
