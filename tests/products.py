"""The native decode step's bfloat16 products, for the tests that compare it with something
else: where it multiplies in bfloat16 (an int8 or bfloat16 cache whose key/value heads each
serve several query heads, on a CPU with AVX512_BF16: decode_cpu.bfloat16_products), the
tolerance against a path that multiplies in float32, and float64 attention with the bound
of that rounding, for the tests that check the step against float64 attention."""

import torch

from attnlab import decode_cpu

PRODUCTS = decode_cpu.bfloat16_products()
# against a float32-product path (the Python path, another layout): each query and softmax
# weight rounded by up to 2^-9 of itself; measured differences up to 2.3e-3 on the tests'
# small random layers
TOLERANCE = 1e-2


def rounds(dtype, groups: int) -> bool:
    """Whether the native step multiplies in bfloat16 for this cache dtype and this many
    query heads per key/value head."""
    return PRODUCTS and dtype in (torch.bfloat16, torch.int8) and groups > 1


def tolerance(dtype, groups: int, otherwise: float) -> float:
    """The tolerance of a comparison of the native step with a float32-product path:
    TOLERANCE where the step rounds, else `otherwise`."""
    return TOLERANCE if rounds(dtype, groups) else otherwise


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 numbers at |x| (8 bits of significand), float64."""
    _, exponent = torch.frexp(x.double().abs().clamp_min(2.0**-126))
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), exponent - 8)


def _either_way(q: torch.Tensor) -> torch.Tensor:
    """Per element of float32 q: the spacing of bfloat16 there where a q computed a few
    float32 roundings away may round to the other neighbour (within 1e-5 of the largest |q|
    of its head of a midpoint between two bfloat16), else 0."""
    spacing = _ulp(q)
    off = (q.double() - q.bfloat16().double()).abs()
    near = (off - spacing / 2).abs() <= 1e-5 * q.double().abs().amax(-1, keepdim=True)
    return spacing * near


def attention64(q, keys, values, scale, allowed=None, rounded=False):
    """Attention in float64 and what the bfloat16 products may change of it.

    Args:
        q: (b, h, t, hd) float32 queries as the module computes them.
        keys, values: (b, h, s, hd) what the cache holds (dequantized), float64.
        scale: the scores' scale.
        allowed: (t, s) bool, the keys each query sees, or None for all.
        rounded: whether the step rounds (`rounds`): then q is rounded to bfloat16 as the
            step rounds it, and the bound covers the step's softmax weights rounded to
            bfloat16 (2^-9 of each, taken as 2^-8) and a query feature the step computed
            a few float32 roundings away and rounded to the other neighbour (`_either_way`).

    Returns:
        heads (b, h, t, hd) and the bound (same shape, 0 where not rounded) on how far the
        step's may be from them.
    """
    query = q.bfloat16().double() if rounded else q.double()
    scores = query @ keys.transpose(-2, -1) * scale  # (b, h, t, s)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    weights = scores.softmax(-1)
    heads = weights @ values
    if not rounded:
        return heads, torch.zeros_like(heads)
    # a score moved by at most `moved` moves each weight by a factor within exp(+-2 moved)
    moved = (_either_way(q) @ keys.abs().transpose(-2, -1) * scale).amax(-1, keepdim=True)
    spread = weights @ values.abs()  # (b, h, t, hd)
    return heads, (2.0**-8 + torch.expm1(2 * moved)) * spread
