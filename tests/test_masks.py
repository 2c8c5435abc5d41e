"""attnlab.masks: one polarity (True = may attend), checked against the book and PyTorch."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnlab import book, masks


@pytest.mark.parametrize("n", [1, 2, 6, 11])
def test_causal_mask_is_the_books_keep_mask(n):
    assert torch.equal(masks.causal_mask(n), book.causal_keep_mask(n).bool())
    assert torch.equal(masks.to_torch_mask(masks.causal_mask(n)), book.causal_future_mask(n).bool())
    assert torch.equal(masks.to_additive(masks.causal_mask(n)), book.additive_causal_mask(n))


@given(st.integers(1, 8), st.integers(0, 8))
def test_offset_causal_mask_is_the_bottom_rows_of_the_full_one(tq, extra):
    tk = tq + extra
    assert torch.equal(masks.causal_mask(tq, tk), masks.causal_mask(tk)[tk - tq :])
    assert torch.equal(masks.causal_mask(tq, tk, offset=0), masks.causal_mask(tk)[:tq])


@given(st.integers(1, 10), st.integers(1, 12))
def test_sliding_window_sees_at_most_window_keys_itself_included(n, window):
    m = masks.sliding_window_mask(n, window=window)
    assert torch.all(m.sum(-1) == torch.clamp(torch.arange(n) + 1, max=window))
    assert torch.all(m.diagonal()) and not torch.any(m & ~masks.causal_mask(n))
    if window >= n:
        assert torch.equal(m, masks.causal_mask(n))


def test_padding_from_lengths_equals_from_keep_mask():
    keep = torch.tensor([[True, True, True, False], [True, False, False, False]])
    from_lengths = masks.padding_mask_from_lengths(torch.tensor([3, 1]), 4)
    assert from_lengths.shape == (2, 1, 1, 4)
    assert torch.equal(from_lengths, masks.padding_mask(keep))


def test_combine_and_torch_polarity_round_trip():
    causal = masks.causal_mask(4)
    pad = masks.padding_mask_from_lengths(torch.tensor([4, 2]), 4)
    both = masks.combine_masks(causal, None, pad)
    assert both.shape == (2, 1, 4, 4)
    assert torch.equal(both[1, 0], causal & torch.tensor([True, True, False, False]))
    assert masks.combine_masks(None, None) is None
    assert torch.equal(masks.from_torch_mask(masks.to_torch_mask(both)), both)
    additive = masks.to_additive(causal)
    assert masks.from_torch_mask(additive) is additive  # float masks mean the same in both


def test_torch_mha_agrees_with_converted_masks():
    """nn.MultiheadAttention given to_torch_mask(m) equals it given the additive version."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 8)
    allowed = masks.sliding_window_mask(5, window=2)
    by_bool, _ = mha(x, x, x, attn_mask=masks.to_torch_mask(allowed), need_weights=False)
    by_float, _ = mha(x, x, x, attn_mask=masks.to_additive(allowed), need_weights=False)
    torch.testing.assert_close(by_bool, by_float, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: masks.causal_mask(-1), ValueError, "num_queries must be >= 0, got -1"),
        (lambda: masks.causal_mask(3, offset=-1), ValueError, "offset must be >= 0"),
        (lambda: masks.sliding_window_mask(3, window=0), ValueError, "window must be >= 1"),
        (
            lambda: masks.padding_mask_from_lengths(torch.tensor([5]), 4),
            ValueError,
            r"lengths must be in \[0, num_keys=4\], got \[5\]",
        ),
        (lambda: masks.padding_mask_from_lengths(torch.tensor([1.0]), 4), TypeError, "integer"),
        (lambda: masks.padding_mask(torch.ones(2, 3)), TypeError, "keep must be a .* bool tensor"),
        (
            lambda: masks.combine_masks(torch.ones(2, 2).long()),
            TypeError,
            r"masks\[0\] must be bool",
        ),
        (
            lambda: masks.combine_masks(masks.causal_mask(3), masks.causal_mask(4)),
            ValueError,
            "do not broadcast",
        ),
        (lambda: masks.to_torch_mask(torch.zeros(3, 3)), TypeError, "must be a bool tensor"),
        (lambda: masks.to_additive(torch.zeros(3, 3)), TypeError, "must be a bool tensor"),
        (
            lambda: masks.from_torch_mask(torch.zeros(3, 3, dtype=torch.long)),
            TypeError,
            "bool tensor or an additive float mask",
        ),
    ],
)
def test_bad_input(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_combine_masks_takes_bool_and_additive_masks_together():
    """One function for every combination (merge_masks is gone): bools AND together, float
    masks add, and a bool mask's blocked places become -inf in the additive result."""
    g = torch.Generator().manual_seed(0)
    bias, other = torch.randn(1, 2, 4, 4, generator=g), torch.randn(4, 4, generator=g)
    causal = masks.causal_mask(4)
    pad = masks.padding_mask_from_lengths(torch.tensor([4, 3]), 4)  # (2, 1, 1, 4)
    combined = masks.combine_masks(bias, causal, None, other, pad)
    expected = (bias + other).expand(2, 2, 4, 4).masked_fill(~(causal & pad), -torch.inf)
    assert torch.equal(combined, expected)
    assert torch.equal(masks.combine_masks(bias), bias)
    assert torch.equal(masks.combine_masks(causal, pad), (causal & pad).expand(2, 1, 4, 4))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32])
@pytest.mark.parametrize("window", [2, 200, 40000, 2**40, 2**70])
def test_position_mask_is_exact_for_narrow_integer_positions_and_huge_windows(dtype, window):
    """Positions in a narrow dtype once wrapped around (uint8: query 1 saw no key) and a
    window past int64 raised OverflowError: the arithmetic is int64, the window clamped."""
    positions = torch.arange(3, dtype=dtype)
    got = masks.position_mask(positions, positions, window=window)
    i, j = torch.arange(3)[:, None], torch.arange(3)[None, :]
    expected = (j <= i) & (i - j < min(window, 3))  # a window of 3 or more sees every key
    assert torch.equal(got, expected)
    assert torch.equal(masks.sliding_window_mask(3, window=window), expected)
