"""functional.attention's scale: finite in every dtype it is used in (q's, and float32 that
the kernels compute in), checked from metadata alone. A scale finite as a Python float and
infinite once cast (1e39 for float32 queries, 1e5 for float16 ones) made NaN scores, each
backend its own; now it is a ValueError naming the scale and the dtype."""

import math
import re

import pytest
import torch

from attnlab import MultiHeadAttention, debug, flash_cpu
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


# --- a finite scale whose products overflow: the values' matter, named where values are read


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_scores_that_overflow_are_a_value_error_not_nan(backend, causal):
    """scale=1e38 is finite in float32, but 1e38 x q . k is not: every backend's result
    held NaN (issue 37, case 4); where values are read (the CPU by default) it is a
    ValueError naming the overflow, and with the checks off the NaN is what SDPA gives."""
    if not _runs(backend, torch.float32):
        pytest.skip("the flash kernel is unavailable here")
    q, k, v = _qkv(torch.float32)
    overflowed = r"the scores overflowed torch\.float32: scale \(1e\+38\)|scores past float32"
    with pytest.raises(ValueError, match=overflowed):
        attention(q, k, v, scale=1e38, causal=causal, backend=backend)
    with debug.checks(False):
        out = attention(q, k, v, scale=1e38, causal=causal, backend=backend)
    assert not torch.isfinite(out).all()


def test_a_modules_scale_is_checked_in_the_dtypes_it_is_used_in():
    """MultiHeadAttention(scale=) finite in float32 at construction (a checkpoint claiming
    another is refused the same way: tests/test_checkpoint.py), and in the input's dtype at
    each call (float16: 65504)."""
    with pytest.raises(ValueError, match=r"scale \(1e\+39\) is not finite in torch\.float32"):
        MultiHeadAttention(8, 8, 16, 0.0, 2, scale=1e39)
    module = MultiHeadAttention(8, 8, 16, 0.0, 2, scale=1e38).half()
    with pytest.raises(ValueError, match=r"scale \(1e\+38\) is not finite in torch\.float16"):
        module(torch.randn(1, 3, 8, dtype=torch.float16))


@pytest.mark.parametrize("rolling", [False, True])
@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("store", ["float32", "float16", "static"])
def test_a_module_whose_arithmetic_overflows_names_it_and_keeps_its_cache(rolling, tokens, store):
    """Finite x of 1e25: the projections and scores overflow float32. The full forward and
    a cached call of 1 token (the native step where it runs) or 2 (the Python path) raise a
    ValueError, and the cache keeps its position and what it held: the next step equals
    that of a twin cache that never saw the call (was: the Python path's tokens stayed)."""
    if store == "static" and rolling:
        pytest.skip("a static cache holds every position: no rolling window")
    torch.manual_seed(0)
    module = MultiHeadAttention(8, 8, 16, 0.0, 2, window=2 if rolling else None).eval()
    prompt, big, after = torch.randn(1, 3, 8), torch.randn(1, 1, 8) * 1e25, torch.randn(1, 1, 8)
    big = big.expand(1, tokens, 8)  # its score with itself overflows to +inf: NaN weights

    def make():
        if store == "static":
            return module.make_cache(1, 8, static=True)
        return module.make_cache(1, 8, dtype=getattr(torch, store))

    with torch.no_grad():
        with pytest.raises(ValueError, match=r"overflowed|scores past float32"):
            module(torch.cat([prompt, big], dim=1))
        cache, twin = make(), make()
        module(prompt, cache=cache)
        module(prompt, cache=twin)
        with pytest.raises(ValueError, match=r"overflowed|scores past float32"):
            module(big, cache=cache)
        held = cache.tokens if store == "static" else cache.position
        assert held == 3
        torch.testing.assert_close(module(after, cache=cache), module(after, cache=twin))


@pytest.mark.parametrize("backend", BACKENDS)
def test_scores_that_overflow_to_minus_infinity_on_every_key_are_a_value_error(backend):
    """q . k of about -1e40 on every key: each kernel reads the row as having no key and
    gives zeros, where the softmax's answer is the one key's value. A ValueError instead
    (was zeros on auto, sdpa and flash); a row left with no key by the mask still gives
    zeros, with no error."""
    if not _runs(backend, torch.float32):
        pytest.skip("the flash kernel is unavailable here")
    q = torch.full((1, 1, 1, 8), 1e20)
    k, v = -q, torch.ones(1, 1, 1, 8)
    with pytest.raises(ValueError, match=r"scores past float32's largest value|overflowed"):
        attention(q, k, v, backend=backend)
    masked = attention(q, k, v, mask=torch.zeros(1, 1, dtype=torch.bool), backend=backend)
    assert torch.equal(masked, torch.zeros_like(masked))


@pytest.mark.parametrize("cache", [None, "static"])
def test_a_module_whose_scores_overflow_to_minus_infinity_names_it(cache):
    torch.manual_seed(0)
    d = 16
    m = MultiHeadAttention(d, d, 8, 0.0, 2).eval()
    with torch.no_grad():
        weight = m.qkv_proj.weight
        weight[:d] = -weight[d : 2 * d]  # q = -k
        weight[2 * d :] *= 1e-20  # tiny values
        x = torch.full((1, 1, d), 3e19)
        x[..., ::2] *= -1
        made = None if cache is None else m.make_cache(1, 4, static=True)
        with pytest.raises(ValueError, match="scores past float32's largest value"):
            m(x, cache=made)
    if made is not None:
        assert made.tokens == 0


def test_bfloat16_scores_past_float32_are_named_and_float64_ones_are_computed():
    """The zero-row check's bound is a Python float (a bfloat16 bound overflowed to inf and
    the check was skipped: zeros) and its limit the compute dtype's (float64 scores of 1e40
    are finite: the exact answer, not an error)."""
    q = torch.full((1, 1, 1, 8), 100.0, dtype=torch.bfloat16)
    v = torch.ones(1, 1, 1, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="scores past float32's largest value"):
        attention(q, -q, v, scale=1e36, backend="sdpa")
    q64 = torch.full((1, 1, 1, 8), 1e20, dtype=torch.float64)
    out = attention(q64, -q64, torch.zeros_like(q64), backend="sdpa")
    assert torch.equal(out, torch.zeros_like(out))


def test_a_windowed_module_whose_scores_overflow_names_it():
    """A window makes the module pass a 2-D mask: the check reads it (was an IndexError)."""
    torch.manual_seed(0)
    d = 16
    m = MultiHeadAttention(d, d, 8, 0.0, 2, window=2).eval()
    with torch.no_grad():
        weight = m.qkv_proj.weight
        weight[:d] = -weight[d : 2 * d]  # q = -k
        weight[2 * d :] *= 1e-20
        x = torch.full((1, 2, d), 3e19)
        x[..., ::2] *= -1
        with pytest.raises(ValueError, match="scores past float32's largest value"):
            m(x)
