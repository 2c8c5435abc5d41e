"""functional.attention's scale: finite in every dtype it is used in (q's, and float32 that
the kernels compute in), checked from metadata alone. A scale finite as a Python float and
infinite once cast (1e39 for float32 queries, 1e5 for float16 ones) made NaN scores, each
backend its own; now it is a ValueError naming the scale and the dtype."""

import math
import re

import pytest
import torch

from attnlab import MultiHeadAttention, flash_cpu
from attnlab.functional import attention

FLOAT32_MAX = torch.finfo(torch.float32).max
BACKENDS = ["auto", "math", "sdpa", "flash"]


def _qkv(dtype, device="cpu"):
    g = torch.Generator().manual_seed(0)
    q, k, v = [torch.randn(1, 2, 6, 8, generator=g) for _ in range(3)]
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)]


def _runs(backend, dtype):
    if backend != "flash":
        return True
    return dtype == torch.float32 and flash_cpu.available()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("dtype", "scale", "named"),
    [
        (torch.float32, 1e39, "torch.float32"),
        (torch.float32, math.nextafter(FLOAT32_MAX, math.inf), "torch.float32"),
        (torch.float32, 1e300, "torch.float32"),
        (torch.bfloat16, 3.39e38, "torch.bfloat16"),  # finite in float32, not in bfloat16
        (torch.float16, 1e38, "torch.float16"),
        (torch.float16, 1e5, "torch.float16"),
    ],
)
def test_a_scale_infinite_in_the_dtype_it_is_used_in_is_a_value_error(backend, dtype, scale, named):
    if not _runs(backend, dtype):
        pytest.skip(f"backend {backend!r} does not take {dtype}")
    q, k, v = _qkv(dtype)
    with pytest.raises(
        ValueError, match="^" + re.escape(f"scale ({scale:g}) is not finite in {named}")
    ):
        attention(q, k, v, causal=True, scale=scale, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("dtype", "scale"),
    [
        (torch.float32, 1e30),
        (torch.float32, FLOAT32_MAX),  # the largest float32 is finite
        (torch.float16, 65504.0),  # the largest float16
        (torch.bfloat16, 3.38e38),
        (torch.float64, 1e300),  # float64 computes in float64
    ],
)
def test_a_scale_finite_in_every_dtype_it_is_used_in_is_taken(backend, dtype, scale):
    if not _runs(backend, dtype):
        pytest.skip(f"backend {backend!r} does not take {dtype}")
    q, k, v = _qkv(dtype)
    shrink = scale**-0.5  # q . k x scale stays of order one: no product overflows
    q, k = (q.double() * shrink).to(dtype), (k.double() * shrink).to(dtype)
    out = attention(q, k, v, causal=True, scale=scale, backend=backend)
    assert out.shape == q.shape and out.dtype == dtype and torch.isfinite(out).all()


def test_the_check_reads_no_value():
    """Meta tensors have no values: the check refuses and takes scales on metadata alone."""
    q, k, v = _qkv(torch.float16, device="meta")
    with pytest.raises(ValueError, match="scale"):
        attention(q, k, v, scale=1e5, backend="math")
    assert attention(q, k, v, scale=100.0, backend="math").device.type == "meta"


def test_a_modules_scale_is_checked_in_the_dtypes_it_is_used_in():
    """MultiHeadAttention(scale=) finite in float32 at construction (a checkpoint claiming
    another is refused the same way: tests/test_checkpoint.py), and in the input's dtype at
    each call (float16: 65504)."""
    with pytest.raises(ValueError, match=r"scale \(1e\+39\) is not finite in torch\.float32"):
        MultiHeadAttention(8, 8, 16, 0.0, 2, scale=1e39)
    module = MultiHeadAttention(8, 8, 16, 0.0, 2, scale=1e38).half()
    with pytest.raises(ValueError, match=r"scale \(1e\+38\) is not finite in torch\.float16"):
        module(torch.randn(1, 3, 8, dtype=torch.float16))
