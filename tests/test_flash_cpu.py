"""attnlab.flash_cpu, the causal CPU kernel behind the "auto" backend: equal to the math
backend (and a float64 reference) in forward and gradients, for any length, with padding
and float masks, grouped-query heads and more keys than queries; fully masked rows give
zeros and finite gradients; auto routes causal float32 CPU calls to it."""

import os
import platform
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnlab import _build, flash_cpu, functional, masks
from attnlab.functional import attention
from tests.definitions import reference

ATOL = 1e-5


def test_the_kernel_builds_here():
    """On Linux x86-64 with a C++ compiler (CI), a fallback would hide a broken build."""
    if platform.system() != "Linux" or shutil.which("c++") is None:
        pytest.skip("the kernel is built only where a C++ compiler is found")
    assert flash_cpu.available(), flash_cpu.load_error()


def _qkv(b, hq, hkv, tq, tk, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, tq, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, tk, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, tk, d, generator=g, dtype=dtype)
    return q, k, v


def _forward_and_grads(backend, q, k, v, mask, seed=0, causal=True):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = attention(q, k, v, mask=mask, causal=causal, backend=backend)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    grads = torch.autograd.grad(out, (q, k, v), grad_out.to(out.dtype))
    return out, grads


def _assert_matches_math(q, k, v, mask=None, causal=True):
    out, grads = _forward_and_grads("flash", q, k, v, mask, causal=causal)
    ref_out, ref_grads = _forward_and_grads("math", q, k, v, mask, causal=causal)
    torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=1e-5)
    for name, grad, ref in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref, atol=ATOL, rtol=1e-5, msg=f"d{name}")
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize(
    ("b", "hq", "hkv", "tq", "tk", "d"),
    [
        (2, 4, 4, 1024, 1024, 64),  # the benchmark's head size, several blocks
        (1, 3, 3, 1, 1, 8),  # one token
        (2, 2, 2, 33, 33, 16),  # just past a diagonal sub-block
        (1, 6, 2, 257, 257, 32),  # grouped-query, a block and one row
        (2, 4, 1, 700, 700, 64),  # multi-query, odd length
        (1, 2, 2, 40, 300, 16),  # fewer queries than keys: the newest tokens
        (1, 2, 2, 600, 1100, 8),  # more than one key block before the diagonal
    ],
)
def test_equals_the_math_backend(b, hq, hkv, tq, tk, d):
    _assert_matches_math(*_qkv(b, hq, hkv, tq, tk, d, seed=tq + tk))


@pytest.mark.parametrize(
    ("b", "hq", "hkv", "tq", "tk", "d"),
    [(1, 2, 2, 1, 1, 8), (2, 4, 2, 70, 70, 16), (1, 2, 1, 9, 600, 8), (1, 2, 2, 300, 40, 16)],
)
def test_non_causal_equals_the_math_backend(b, hq, hkv, tq, tk, d):
    """Without the causal cut the kernel reads every key (a window or a rolling cache passes
    its own mask); with a padding mask, rows with no key give zeros here too."""
    q, k, v = _qkv(b, hq, hkv, tq, tk, d, seed=tq * tk)
    _assert_matches_math(q, k, v, causal=False)
    keep = torch.ones(b, tk, dtype=torch.bool)
    keep[0, : tk // 2] = False
    _assert_matches_math(q, k, v, masks.padding_mask(keep), causal=False)


def test_left_padding_with_fully_masked_rows():
    q, k, v = _qkv(3, 4, 2, 150, 150, 16, seed=1)
    keep = torch.ones(3, 150, dtype=torch.bool)
    keep[0, :40], keep[1, :149] = False, False  # row 1: only the last token is real
    mask = masks.padding_mask(keep)  # (b, 1, 1, t)
    _assert_matches_math(q, k, v, mask)
    out = attention(q, k, v, mask=mask, causal=True, backend="flash")
    assert (out[0, :, :40] == 0).all() and (out[1, :, :149] == 0).all()


def test_additive_float_mask_with_minus_infinity():
    q, k, v = _qkv(2, 4, 4, 130, 130, 16, seed=2)
    g = torch.Generator().manual_seed(3)
    bias = torch.randn(2, 1, 130, 130, generator=g)
    bias[:, :, :, 5:9] = -torch.inf
    _assert_matches_math(q, k, v, bias)


def test_equals_a_float64_reference():
    q, k, v = _qkv(2, 6, 3, 300, 300, 32, seed=4)
    allowed = masks.causal_mask(300, 300)
    expected = reference(q.double(), k.double(), v.double(), allowed)
    out = attention(q, k, v, causal=True, backend="flash")
    torch.testing.assert_close(out.double(), expected, atol=ATOL, rtol=1e-5)


@given(
    b=st.integers(1, 2),
    hkv=st.integers(1, 2),
    groups=st.integers(1, 3),
    tq=st.integers(1, 90),
    extra_keys=st.integers(0, 40),
    d=st.sampled_from([1, 4, 8, 24]),
    seed=st.integers(0, 2**16),
)
def test_equals_math_for_any_shape(b, hkv, groups, tq, extra_keys, d, seed):
    _assert_matches_math(*_qkv(b, hkv * groups, hkv, tq, tq + extra_keys, d, seed))


def test_auto_uses_it_for_causal_float32_on_the_cpu():
    q, k, v = _qkv(1, 4, 4, 200, 200, 32, seed=5)
    auto = attention(q, k, v, causal=True)
    assert torch.equal(auto, attention(q, k, v, causal=True, backend="flash"))
    assert not torch.equal(auto, attention(q, k, v, causal=True, backend="sdpa"))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(dropout_p=0.1, training=True), "without dropout"),
        (dict(need_weights=True), "never materialises the weights"),
    ],
)
def test_flash_backend_refuses_what_it_cannot_do(kwargs, message):
    q, k, v = _qkv(1, 2, 2, 40, 40, 8, seed=6)
    options = dict(causal=True, backend="flash") | kwargs
    with pytest.raises(ValueError, match=message):
        attention(q, k, v, **options)


def test_flash_backend_refuses_float64():
    q, k, v = _qkv(1, 2, 2, 40, 40, 8, seed=7, dtype=torch.float64)
    with pytest.raises(ValueError, match="float32 CPU tensors"):
        attention(q, k, v, causal=True, backend="flash")


def test_turned_off_it_falls_back_to_pytorch():
    code = (
        "import torch; from attnlab import flash_cpu; from attnlab.functional import attention;"
        "q = torch.randn(1, 2, 64, 8);"
        "out = attention(q, q, q, causal=True);"
        "ref = attention(q, q, q, causal=True, backend='math');"
        "print(flash_cpu.available(), torch.allclose(out, ref, atol=1e-5));"
        "print(flash_cpu.load_error())"
    )
    env = os.environ | {"ATTNLAB_NO_EXTENSION": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    verdict, reason = result.stdout.splitlines()
    assert verdict.split() == ["False", "True"]
    assert "ATTNLAB_NO_EXTENSION=1" in reason


def test_a_mask_that_requires_grad_keeps_its_gradient():
    """The kernel gives no gradient to the mask: auto uses SDPA for a learned bias."""
    q, k, v = _qkv(1, 2, 2, 64, 64, 8, seed=8)
    bias = torch.zeros(1, 2, 64, 64, requires_grad=True)
    out = attention(q, k, v, mask=bias, causal=True)
    (grad,) = torch.autograd.grad(out.square().sum(), bias)
    ref_bias = bias.detach().clone().requires_grad_()
    ref = attention(q, k, v, mask=ref_bias, causal=True, backend="math")
    (expected,) = torch.autograd.grad(ref.square().sum(), ref_bias)
    torch.testing.assert_close(grad, expected, atol=ATOL, rtol=1e-4)
    with pytest.raises(ValueError, match="no gradient to the mask"):
        attention(q, k, v, mask=bias, causal=True, backend="flash")


@pytest.mark.parametrize("vectorised", [True, False])
def test_auto_takes_the_kernel_only_for_its_vectorised_build(vectorised, monkeypatch):
    """The portable build (CPU_CAPABILITY=DEFAULT) is slower than SDPA: auto takes SDPA there
    without building the kernel at all."""
    monkeypatch.setattr(_build, "vectorised", lambda: vectorised)
    if not vectorised:
        monkeypatch.setattr(flash_cpu, "available", lambda: pytest.fail("built for nothing"))
    elif not flash_cpu.available():
        pytest.skip("the CPU kernel is not built here")
    q, k, v = _qkv(1, 4, 4, 200, 200, 32, seed=9)
    assert functional._flash_helps((q, k, v), True, 0.0) is vectorised
    expected = attention(q, k, v, causal=True, backend="flash" if vectorised else "sdpa")
    assert torch.equal(attention(q, k, v, causal=True), expected)


def test_auto_takes_sdpa_on_macos_without_building(monkeypatch):
    monkeypatch.setattr(_build, "vectorised", lambda: True)
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    monkeypatch.setattr(flash_cpu, "available", lambda: pytest.fail("built on macOS"))
    assert not flash_cpu.preferred()


@pytest.mark.skipif(
    platform.system() != "Linux" or not _build.vectorised(), reason="auto builds it only there"
)
def test_without_a_compiler_one_warning_line_and_pytorch(tmp_path):
    code = (
        "import torch; from attnlab.functional import attention;"
        "q = torch.randn(1, 2, 64, 8);"
        "out = attention(q, q, q, causal=True, backend='auto');"
        "print(torch.allclose(out, attention(q, q, q, causal=True, backend='math'), atol=1e-5))"
    )
    env = os.environ | {"CXX": "attnlab-no-such-compiler", "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    env.pop("ATTNLAB_NO_EXTENSION", None)
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["True"]
    warned = [line for line in result.stderr.splitlines() if "RuntimeWarning" in line]
    assert len(warned) == 1, result.stderr
    assert "no C++ compiler" in warned[0] and "ATTNLAB_NO_EXTENSION=1" in warned[0]
    assert "ninja" not in result.stderr and list(tmp_path.iterdir()) == []
