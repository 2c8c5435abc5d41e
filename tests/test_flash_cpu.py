"""attnlab.flash_cpu, the causal CPU kernel behind the "auto" backend: equal to the math
backend (and a float64 reference) in forward and gradients, for any length, with padding
and float masks, grouped-query heads and more keys than queries; fully masked rows give
zeros and finite gradients; auto routes causal float32 CPU calls to it."""

import ast
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import _build, flash_cpu, functional, masks, padded
from attnlab.functional import attention
from tests.definitions import reference

ATOL = 1e-5


def test_available_is_marked_constant_as_torchs_decorator_marks():
    """available() carries what torch.compiler.assume_constant_result sets on a function,
    set by hand so that importing attnlab does not import torch._dynamo."""

    def probe() -> bool:
        return True

    marked = torch.compiler.assume_constant_result(probe)
    assert vars(marked), "torch's decorator no longer marks the function itself"
    for name, value in vars(marked).items():
        assert getattr(flash_cpu.available, name, None) == value, name


def test_importing_attnlab_leaves_torch_dynamo_unimported():
    """torch._dynamo took 1.4 s of `import attnlab` (and of every `attnlab check`)."""
    code = "import sys, attnlab, attnlab.cli, attnlab.check; print('torch._dynamo' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == "False"


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
        "q = torch.randn(1, 2, 128, 8);"
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


# ---------------------------------------------------------------------------------------------
# the kernel's own backward (causal_flash_backward): gradients against a float64 reference.
# The kernel is float32 only (so no gradcheck in float64): its float32 gradients are compared
# with the math backend's in float64 on the same values, with explicit tolerances.

GRAD_ATOL, GRAD_RTOL = 2e-5, 1e-4


def _float64_grads(q, k, v, grad_out, **kwargs):
    """Output and gradients of the math backend in float64 (the reference)."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    mask = kwargs.pop("mask", None)
    mask = mask.double() if mask is not None and mask.is_floating_point() else mask
    out = attention(*leaves, mask=mask, backend="math", **kwargs)
    return out, torch.autograd.grad(out, leaves, grad_out.double())


def _kernel_grads(q, k, v, grad_out, **kwargs):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, backend="flash", **kwargs)
    return out, torch.autograd.grad(out, leaves, grad_out)


def _assert_grads_match_float64(q, k, v, seed=0, **kwargs):
    shape = (q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    out, grads = _kernel_grads(q, k, v, grad_out, **kwargs)
    ref_out, ref_grads = _float64_grads(q, k, v, grad_out, **kwargs)
    torch.testing.assert_close(out.double(), ref_out, atol=GRAD_ATOL, rtol=GRAD_RTOL)
    for name, grad, ref in zip("qkv", grads, ref_grads, strict=True):
        assert grad.dtype == torch.float32 and grad.shape == ref.shape
        torch.testing.assert_close(
            grad.double(), ref, atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=lambda m, n=name: f"d{n}: {m}"
        )
    return grads


@pytest.mark.parametrize(
    ("b", "hq", "hkv", "tq", "tk", "d"),
    [
        (2, 4, 4, 300, 300, 64),  # several backward blocks and diagonal sub-blocks
        (1, 12, 4, 257, 257, 32),  # grouped-query, a block and one row
        (2, 6, 1, 130, 130, 16),  # multi-query
        (1, 2, 2, 40, 300, 16),  # fewer queries than keys: the newest tokens
        (1, 2, 2, 300, 40, 8),  # more queries than keys: the first see none
        (1, 3, 3, 1, 1, 8),  # one token
    ],
)
def test_backward_equals_a_float64_reference(b, hq, hkv, tq, tk, d):
    _assert_grads_match_float64(*_qkv(b, hq, hkv, tq, tk, d, seed=tq * 7 + tk), causal=True)


def test_backward_non_causal_with_a_float_mask():
    q, k, v = _qkv(2, 4, 2, 150, 170, 16, seed=11)
    bias = torch.randn(2, 1, 150, 170, generator=torch.Generator().manual_seed(12))
    bias[0, :, :, 3:40] = -torch.inf
    bias[1, :, 7] = -torch.inf  # a row with no key: zero gradients, never NaN
    grads = _assert_grads_match_float64(q, k, v, mask=bias, causal=False)
    assert (grads[0][1, :, 7] == 0).all()


def test_backward_with_sinks_through_the_kernel():
    """Sinks reach the kernel as one more key with a bias (functional._with_sink_key); the
    kernel's gradients for q, k, v equal the reference's."""
    q, k, v = _qkv(1, 4, 2, 90, 90, 16, seed=13)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(14))
    grad_out = torch.randn(1, 4, 90, 16, generator=torch.Generator().manual_seed(15))
    calls = []
    with pytest.MonkeyPatch.context() as patch:
        kernel = flash_cpu.attention
        patch.setattr(flash_cpu, "attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
        out, grads = _kernel_grads(q, k, v, grad_out, causal=True, sinks=sinks)
    assert calls
    ref_out, ref_grads = _float64_grads(q, k, v, grad_out, causal=True, sinks=sinks.double())
    torch.testing.assert_close(out.double(), ref_out, atol=GRAD_ATOL, rtol=GRAD_RTOL)
    for grad, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad.double(), ref, atol=GRAD_ATOL, rtol=GRAD_RTOL)


@pytest.mark.parametrize(("q_split", "kv_split", "diag_split"), [(3, 5, 2), (7, 7, 7), (1, 1, 1)])
def test_backward_any_block_sizes(q_split, kv_split, diag_split, monkeypatch):
    """Blocks that do not divide the tokens, and one-row / one-key blocks."""
    monkeypatch.setattr(flash_cpu, "_BACKWARD_Q_SPLIT", q_split)
    monkeypatch.setattr(flash_cpu, "_BACKWARD_KV_SPLIT", kv_split)
    monkeypatch.setattr(flash_cpu, "_BACKWARD_DIAG_SPLIT", diag_split)
    q, k, v = _qkv(2, 4, 2, 23, 29, 8, seed=16)
    _assert_grads_match_float64(q, k, v, causal=True)
    keep = torch.ones(2, 29, dtype=torch.bool)
    keep[0, :6] = False
    _assert_grads_match_float64(q, k, v, mask=masks.padding_mask(keep), causal=False)


@pytest.mark.parametrize("threads", [3, 8, 12])
def test_backward_with_more_threads_than_kv_heads(threads):
    """Fewer (batch, kv head) pairs than threads: each pair's keys are shared between tasks
    (as many as threads, at most 8, at most one per 128-key block: 9 blocks here), each with
    its own query-gradient buffer, added up at the end."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _assert_grads_match_float64(*_qkv(1, 4, 1, 1100, 1100, 16, seed=17), causal=True)
    finally:
        torch.set_num_threads(before)


def test_backward_padded_key_ranges():
    """Key ranges (a padded batch run as each sequence's real keys): left, right, none."""
    q, k, v = _qkv(3, 4, 2, 100, 100, 16, seed=18)
    grad_out = torch.randn(3, 4, 100, 16, generator=torch.Generator().manual_seed(19))
    starts, ends = torch.tensor([0, 30, 100]), torch.tensor([100, 80, 100])
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = flash_cpu.attention(*leaves, None, 0.25, True, key_ranges=(starts, ends))
    grads = torch.autograd.grad(out, leaves, grad_out)
    keys = torch.arange(100)
    keep = (keys >= starts[:, None]) & (keys < ends[:, None])  # (b, t)
    allowed = masks.padding_mask(keep) & masks.causal_mask(100, 100)
    ref_out, ref_grads = _float64_grads(q, k, v, grad_out, mask=allowed, scale=0.25)
    torch.testing.assert_close(out.double(), ref_out, atol=GRAD_ATOL, rtol=GRAD_RTOL)
    for grad, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad.double(), ref, atol=GRAD_ATOL, rtol=GRAD_RTOL)
    assert (grads[0][2] == 0).all() and (grads[1][2] == 0).all()  # no real key: no gradient


def _layout(t: torch.Tensor, how: str) -> torch.Tensor:
    """The same values as `t` (b, h, n, d), stored another way."""
    if how == "tokens_first":  # (b, n, h, d) storage, as a projection's output is
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if how == "padded_rows":  # each token row inside a wider row
        wide = torch.zeros(*t.shape[:-1], t.shape[-1] + 5)
        wide[..., : t.shape[-1]] = t
        return wide[..., : t.shape[-1]]
    if how == "features_stepped":  # copied by dense_rows before the kernel reads it
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1])
        wide[..., ::2] = t
        return wide[..., ::2]
    return t


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 2),
    hkv=st.integers(1, 3),
    groups=st.integers(1, 3),
    tq=st.integers(1, 80),
    extra_keys=st.integers(-20, 40),
    d=st.sampled_from([1, 3, 8, 16]),
    causal=st.booleans(),
    mask_kind=st.sampled_from(["none", "bias", "padding", "bias_per_head"]),
    layout=st.sampled_from(["contiguous", "tokens_first", "padded_rows", "features_stepped"]),
    seed=st.integers(0, 2**16),
)
def test_backward_equals_float64_for_any_shape_mask_and_layout(
    b, hkv, groups, tq, extra_keys, d, causal, mask_kind, layout, seed
):
    tk = max(1, tq + extra_keys)
    q, k, v = _qkv(b, hkv * groups, hkv, tq, tk, d, seed)
    q, k, v = (_layout(t, layout) for t in (q, k, v))
    g = torch.Generator().manual_seed(seed + 1)
    mask = None
    if mask_kind == "bias":
        mask = torch.randn(b, 1, tq, tk, generator=g)
    elif mask_kind == "bias_per_head":
        mask = torch.randn(1, hkv * groups, tq, tk, generator=g)
        mask[..., : tk // 3] = -torch.inf
    elif mask_kind == "padding":
        keep = torch.rand(b, tk, generator=g) > 0.3
        mask = masks.padding_mask(keep)
    _assert_grads_match_float64(q, k, v, seed=seed, mask=mask, causal=causal)


def test_dropout_is_routed_to_sdpa_with_the_same_mask_per_seed(monkeypatch):
    """The kernel has no dropout (forward or backward): "auto" sends a training call with
    dropout to PyTorch's SDPA (the named fallback), whose gradients under one seed are the
    gradients of the output that seed gave; the kernel is never called."""
    monkeypatch.setattr(flash_cpu, "attention", lambda *a, **kw: pytest.fail("kernel called"))
    q, k, v = _qkv(1, 4, 2, 64, 64, 16, seed=20)

    def run():
        torch.manual_seed(21)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = attention(*leaves, causal=True, dropout_p=0.3, training=True)
        return out, torch.autograd.grad(out.square().sum(), leaves)

    (out, grads), (again, grads_again) = run(), run()
    assert torch.equal(out, again)
    for grad, same in zip(grads, grads_again, strict=True):
        assert torch.equal(grad, same)
    no_dropout = attention(q, k, v, causal=True, backend="math")
    assert not torch.allclose(out, no_dropout, atol=1e-3)  # dropout did apply


@pytest.mark.parametrize(
    ("tokens", "requires_grad", "kernel"),
    [
        (functional._FLASH_MIN_QUERIES, False, True),
        (functional._FLASH_MIN_QUERIES - 1, False, False),
        (functional._FLASH_MIN_QUERIES_TRAINING, True, True),
        (functional._FLASH_MIN_QUERIES_TRAINING - 1, True, False),
    ],
)
def test_auto_takes_the_kernel_from_the_measured_crossover(tokens, requires_grad, kernel):
    """Fewer queries than the crossover go to SDPA, forward only or differentiated."""
    if not flash_cpu.preferred():
        pytest.skip("auto does not take the kernel on this machine")
    q, k, v = (t.requires_grad_(requires_grad) for t in _qkv(1, 4, 2, tokens, tokens, 16, seed=22))
    assert functional._flash_helps((q, k, v), True, 0.0) is kernel
    with torch.no_grad():  # no graph recorded: the forward's threshold
        assert functional._flash_helps((q, k, v), True, 0.0) is (
            tokens >= functional._FLASH_MIN_QUERIES
        )


def test_the_kernel_and_its_backward_trace_under_compile():
    """flash_cpu.attention (the autograd.Function over both ops, their fake kernels) traces
    under torch.compile(fullgraph=True), forward and backward equal to eager, grouped heads
    and a bias included."""
    if not flash_cpu.available():
        pytest.skip("the CPU kernel is not built here")
    q, k, v = (t.requires_grad_() for t in _qkv(1, 4, 2, 150, 150, 16, seed=23))
    bias = torch.randn(1, 1, 150, 150, generator=torch.Generator().manual_seed(24))

    def run(q, k, v):
        return flash_cpu.attention(q, k, v, bias, 0.25, True)

    compiled = torch.compile(run, fullgraph=True, backend="aot_eager")
    out, expected = compiled(q, k, v), run(q, k, v)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    for grad, ref in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, ref, atol=0, rtol=0)


def _kernel_or_skip() -> None:
    if not flash_cpu.available():
        pytest.skip(f"attnlab's kernel is not built here: {flash_cpu.load_error()}")


@pytest.mark.parametrize("backend", ["flash", "auto"])
def test_a_second_derivative_raises_instead_of_coming_back_zero(backend):
    """The kernel's backward has no derivative of its own: differentiating it again is a
    RuntimeError (once_differentiable), never zeros (which it gave silently before)."""
    _kernel_or_skip()
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 2, 128, 128, 16, seed=0))
    out = attention(q, k, v, causal=True, backend=backend)  # auto: the kernel at 128 queries
    (grad_q,) = torch.autograd.grad((out**2).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        (grad_q**2).sum().backward()


def test_torch_func_grad_runs_the_kernel_and_equals_the_reference():
    """torch.func.grad (and jacrev) need an autograd.Function with setup_context: the
    kernel's gradient through it equals the math backend's in float64."""
    _kernel_or_skip()
    q, k, v = _qkv(1, 4, 2, 128, 128, 16, seed=1)
    grads = torch.func.grad(
        lambda q, k, v: attention(q, k, v, causal=True, backend="flash").square().sum(),
        argnums=(0, 1, 2),
    )(q, k, v)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    expected = torch.autograd.grad(
        attention(*leaves, causal=True, backend="math").square().sum(), leaves
    )
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tokens", [64, 128])
def test_auto_under_cpu_autocast_gives_sdpas_dtype_at_every_length(tokens):
    """Under CPU bfloat16 autocast SDPA computes (and returns) bfloat16; "auto" gave
    float32 from 96/128 queries on, where it took the float32 kernel. It now leaves the
    kernel alone under autocast, so its dtype does not depend on the length."""
    q, k, v = _qkv(1, 2, 2, tokens, tokens, 16, seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = attention(q, k, v, causal=True, backend="auto")
        padded = torch.ones(1, 1, tokens, tokens, dtype=torch.bool).tril()
        out_masked = attention(q, k, v, mask=padded, causal=True, backend="auto")
    assert out.dtype == out_masked.dtype == expected.dtype == torch.bfloat16


def test_compiled_flash_attention_with_grad_is_one_graph_equal_to_eager():
    """torch.compile(fullgraph=True) of attention(..., backend="flash") on inputs that
    require grad: one graph, forward and backward equal to eager (on torch 2.14 and 2.15
    Dynamo failed on the generator expressions flash_cpu unpacked: "generator already
    executing"; scripts/newest_torch.sh runs this on the newest torch)."""
    _kernel_or_skip()
    q, k, v = [t.requires_grad_() for t in _qkv(2, 4, 2, 96, 96, 16, seed=31)]

    def run(q, k, v):
        return attention(q, k, v, causal=True, backend="flash")

    compiled = torch.compile(run, fullgraph=True, backend="aot_eager")
    out, expected = compiled(q, k, v), run(q, k, v)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.sum(), (q, k, v))
    for grad, ref in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, ref, atol=0, rtol=0)


def _unpacked_generators(path: Path) -> list[int]:
    """Lines of `path` that unpack a generator expression into names (`a, b = (f(t) for t
    in ...)`)."""
    tree = ast.parse(path.read_text())
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.GeneratorExp)
        and any(isinstance(target, (ast.Tuple, ast.List)) for target in node.targets)
    ]


@pytest.mark.parametrize("module", [flash_cpu, padded])
def test_the_kernel_s_python_faces_unpack_no_generator(module):
    """The code Dynamo traces around the kernel unpacks lists or tuples, never a generator
    expression: Dynamo of torch 2.14 and 2.15 fails on that inside the autograd.Function
    ("generator already executing"), so the compiled flash backend failed with grad."""
    assert _unpacked_generators(Path(module.__file__)) == []


@pytest.mark.parametrize(
    ("on_meta", "named"),
    [
        ("k", "k is on meta but q is on cpu"),
        ("q", "k is on cpu but q is on meta"),
        ("bias", "mask is on meta but q is on cpu"),
        ("ranges", "key_start is on meta but q is on cpu"),
    ],
)
def test_the_python_face_refuses_tensors_on_two_devices(on_meta, named):
    """flash_cpu.attention with a meta tensor among CPU ones (the op's fake kernel would
    answer it, once with uninitialised or meta outputs) is a RuntimeError naming the
    arguments; all on meta, it states the output's shape."""
    _kernel_or_skip()
    q, k, v = _qkv(2, 2, 2, 8, 8, 4, seed=41)
    bias = torch.zeros(1, 1, 8, 8)
    ranges = (torch.tensor([0, 2]), torch.tensor([8, 8]))
    call = {"q": q, "k": k, "v": v, "bias": bias, "ranges": ranges}
    moved = torch.utils._pytree.tree_map(lambda t: t.to("meta"), call[on_meta])
    call[on_meta] = moved
    with pytest.raises(RuntimeError, match=f"^causal_flash_forward: {named}"):
        flash_cpu.attention(
            call["q"], call["k"], call["v"], call["bias"], 0.5, True, key_ranges=call["ranges"]
        )
    meta = torch.utils._pytree.tree_map(lambda t: t.to("meta"), (q, k, v, bias, ranges))
    out = flash_cpu.attention(*meta[:4], 0.5, True, key_ranges=meta[4])
    assert out.device.type == "meta" and out.shape == q.shape
