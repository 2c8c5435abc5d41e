"""attnlab.padded: a causal & padding mask runs as the causal kernel over each sequence's
real keys, equal to the masked math backend forward and backward; other masks fall back."""

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import flash_cpu, masks, padded
from attnlab.functional import attention

pytestmark = pytest.mark.skipif(not flash_cpu.available(), reason="the CPU kernel is not built")


def _grads(q, k, v, **kwargs):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, **kwargs)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    return out, torch.autograd.grad(out, leaves, grad_out)


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 3),
    hkv=st.integers(1, 2),
    groups=st.integers(1, 2),
    tokens=st.integers(33, 90),
    side=st.sampled_from(["left", "right", "both"]),
    as_hf=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_padded_batches_equal_the_masked_math_backend(b, hkv, groups, tokens, side, as_hf, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv * groups, tokens, 16, generator=g)
    k, v = (torch.randn(b, hkv, tokens, 16, generator=g) for _ in range(2))
    lengths = torch.randint(0, tokens + 1, (b,), generator=g)
    positions = torch.arange(tokens)
    if side == "left":
        keep = positions >= (tokens - lengths)[:, None]  # (b, t)
    elif side == "right":
        keep = positions < lengths[:, None]
    else:  # a run in the middle
        keep = (positions >= lengths[:, None] // 2) & (positions < (lengths[:, None] + tokens) // 2)
    pad = masks.padding_mask(keep)  # (b, 1, 1, t)
    if as_hf:  # transformers hands over causal & padding in one mask, not causal
        kwargs = dict(mask=pad & masks.causal_mask(tokens, tokens), causal=False)
    else:
        kwargs = dict(mask=pad, causal=True)
    calls = []
    spy = padded.attention
    padded_attention = lambda *args: calls.append(1) or spy(*args)  # noqa: E731
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(padded, "attention", padded_attention)
        out, grads = _grads(q, k, v, **kwargs)
    assert calls, "the padded path was not taken"
    ref_out, ref_grads = _grads(q, k, v, backend="math", **kwargs)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    for grad, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref, atol=1e-5, rtol=1e-5)


def test_a_mask_that_is_not_causal_and_padding_is_not_taken_for_one():
    tokens = 40
    keep = torch.ones(2, tokens, dtype=torch.bool)
    keep[0, 10:20] = False  # a hole: not one range
    assert padded.key_ranges(masks.padding_mask(keep), causal=True) is None
    window = masks.sliding_window_mask(tokens, window=5)[None, None]  # (1, 1, t, t)
    assert padded.key_ranges(window, causal=True) is None
    full = torch.ones(1, 1, tokens, tokens, dtype=torch.bool)
    assert padded.key_ranges(full, causal=False) is None  # not causal at all
    starts, ends = padded.key_ranges(full, causal=True)
    assert starts.tolist() == [0] and ends.tolist() == [tokens]


@pytest.mark.parametrize("causal", [False, True])
def test_a_mask_without_a_batch_dimension_serves_every_sequence(causal):
    """A causal (t, t) mask, or a (1, 1, 1, t) padding mask, for a batch of 3: one range
    for all (it once reached the kernel with one range for three sequences)."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(3, 2, 40, 8, generator=g) for _ in range(3))
    keep = torch.arange(40) >= 5
    for mask in (masks.causal_mask(40), masks.padding_mask(keep[None])):
        out = attention(q, k, v, mask=mask, causal=causal)
        ref = attention(q, k, v, mask=mask, causal=causal, backend="math")
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "mask",
    [
        torch.tensor(True),
        torch.ones(1, dtype=torch.bool),
        torch.ones(2, 1, 1, 1, dtype=torch.bool),
        torch.tensor([True, False]).view(2, 1, 1, 1),
    ],
)
@pytest.mark.parametrize("causal", [False, True])
def test_a_mask_broadcast_over_the_keys_is_not_a_range(mask, causal):
    """A keys axis of 1 says nothing about ranges (it once ran as 'key 0 only', 2.7 off)."""
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 2, 33, 8, generator=g) for _ in range(3))
    out = attention(q, k, v, mask=mask, causal=causal)
    ref = attention(q, k, v, mask=mask, causal=causal, backend="math")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_padded_attention_in_a_fresh_process_loads_the_kernel_itself():
    """padded.attention called first thing in a process (no attention call before it to
    load the op) builds or loads the kernel and equals the masked math backend."""
    code = (
        "import torch\n"
        "from attnlab import masks, padded\n"
        "from attnlab.functional import attention\n"
        "g = torch.Generator().manual_seed(3)\n"
        "q, k, v = [torch.randn(2, 2, 40, 8, generator=g) for _ in range(3)]\n"
        "starts, ends = torch.tensor([0, 10]), torch.tensor([40, 40])\n"
        "out = padded.attention(q, k, v, (starts, ends), 8 ** -0.5)\n"
        "keep = (torch.arange(40) >= starts[:, None]) & (torch.arange(40) < ends[:, None])\n"
        "ref = attention(q, k, v, mask=masks.padding_mask(keep), causal=True, backend='math')\n"
        "torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)\n"
        "print('equal')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["equal"]


def test_padded_attention_refuses_key_ranges_on_another_device():
    """Key ranges on meta for CPU queries: a RuntimeError naming them (the op's fake kernel
    once answered the call with uninitialised outputs)."""
    g = torch.Generator().manual_seed(5)
    q, k, v = [torch.randn(2, 2, 16, 8, generator=g) for _ in range(3)]
    ranges = (torch.tensor([0, 4], device="meta"), torch.tensor([16, 16], device="meta"))
    with pytest.raises(RuntimeError, match="key_start is on meta but q is on cpu"):
        padded.attention(q, k, v, ranges, 8**-0.5)
