"""attnlab.masks: one polarity (True = may attend), checked against the book and PyTorch."""

import contextlib
import math
import signal

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnlab import alibi, book, masks
from attnlab._validate import MAX_SIZE


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


# --- the shared size bound (_validate.MAX_SIZE) ------------------------------------------

BOUND = r"must be at most 1,099,511,627,776 \(2\*\*40, attnlab's bound on any size or position\)"


@contextlib.contextmanager
def _within(seconds: float):
    """Fail (instead of hanging the suite) if the block runs longer than `seconds`: the
    alarm interrupts a Python loop such as the one that built 2**63 slopes."""

    def late(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, late)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("offset", [2**63 - 1, 2**63, 2**62, MAX_SIZE + 1])
@pytest.mark.parametrize(
    "build",
    [
        lambda offset: masks.aligned_positions(2, 3, offset=offset),
        lambda offset: masks.causal_mask(2, 3, offset=offset),
        lambda offset: masks.sliding_window_mask(2, 3, window=2, offset=offset),
    ],
    ids=["aligned_positions", "causal_mask", "sliding_window_mask"],
)
def test_an_offset_past_the_bound_is_refused_by_name(build, offset):
    """offset 2**63 - 1 once wrapped to a negative position, 2**63 gave an all-False mask and
    2**62 an all-True one, silently."""
    with pytest.raises(ValueError, match=rf"offset {BOUND}, got {offset:,}"):
        build(offset)


def test_positions_up_to_the_bound_are_exact():
    """At the bound itself nothing wraps: the positions are offset + i, and the mask is the
    rule's (queries far past every key see all of them)."""
    query_pos, key_pos = masks.aligned_positions(2, 3, offset=MAX_SIZE)
    assert query_pos.tolist() == [MAX_SIZE, MAX_SIZE + 1] and key_pos.tolist() == [0, 1, 2]
    assert masks.causal_mask(2, 3, offset=MAX_SIZE).all()
    window = masks.sliding_window_mask(2, 3, window=2, offset=MAX_SIZE)
    assert not window.any()  # every key is further back than the window
    assert masks.visible_keys(MAX_SIZE, window=2) == range(MAX_SIZE - 1, MAX_SIZE + 1)


@pytest.mark.parametrize("size", [2**63, 2**62, MAX_SIZE + 1])
@pytest.mark.parametrize(
    ("build", "name"),
    [
        (lambda n: masks.causal_mask(n), "num_queries"),
        (lambda n: masks.causal_mask(2, n), "num_keys"),
        (lambda n: masks.aligned_positions(n), "num_queries"),
        (lambda n: masks.aligned_positions(1, n), "num_keys"),
        (lambda n: masks.sliding_window_mask(n, window=2), "num_queries"),
        (lambda n: masks.visible_keys(n), "query_position"),
        (lambda n: masks.padding_mask_from_lengths(torch.tensor([1]), n), "num_keys"),
        (lambda n: alibi.bias(alibi.slopes(2), n), "num_queries"),
        (lambda n: alibi.bias(alibi.slopes(2), 1, n), "num_keys"),
    ],
    ids=[
        "causal_mask-q",
        "causal_mask-k",
        "aligned_positions-q",
        "aligned_positions-k",
        "sliding_window_mask",
        "visible_keys",
        "padding_mask_from_lengths",
        "alibi.bias-q",
        "alibi.bias-k",
    ],
)
def test_a_size_past_the_bound_is_refused_by_name(build, name, size):
    """Once torch's overflow RuntimeErrors (or a silently wrong range)."""
    with pytest.raises(ValueError, match=rf"{name} {BOUND}, got {size:,}"):
        build(size)


@pytest.mark.parametrize(
    ("build", "product"),
    [
        (lambda: masks.causal_mask(2**21), r"num_queries x num_keys \(2097152 x 2097152\)"),
        (
            lambda: masks.sliding_window_mask(2**20, 2**21, window=4),
            r"num_queries x num_keys \(1048576 x 2097152\)",
        ),
        (
            lambda: masks.padding_mask_from_lengths(torch.zeros(2**11, dtype=torch.long), 2**30),
            r"batch x num_keys \(2048 x 1073741824\)",
        ),
        (
            lambda: alibi.bias(alibi.slopes(4), 2**20, 2**19),
            r"heads x num_queries x num_keys \(4 x 1048576 x 524288\)",
        ),
    ],
    ids=["causal_mask", "sliding_window_mask", "padding_mask_from_lengths", "alibi.bias"],
)
def test_a_mask_of_more_elements_than_the_bound_is_refused_before_it_is_built(build, product):
    """Sizes each within the bound whose mask would hold terabytes: named, not torch's
    allocation failure."""
    with pytest.raises(ValueError, match=rf"{product} {BOUND}"):
        build()


@pytest.mark.parametrize("num_heads", [2**63, 2**62, MAX_SIZE + 1])
def test_alibi_slopes_past_the_bound_are_refused_at_once(num_heads):
    """alibi.slopes(2**63) once built a Python list of 2**63 floats (a hang)."""
    with _within(5.0), pytest.raises(ValueError, match=rf"num_heads {BOUND}, got {num_heads:,}"):
        alibi.slopes(num_heads)


def _paper_slopes(n: int) -> list[float]:
    """The ALiBi paper's get_slopes, as BLOOM and the paper's code write it (Python floats)."""

    def powers(m: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(m) - 3)))
        return [start * start**i for i in range(m)]

    below = 2 ** math.floor(math.log2(n))
    return powers(below) + (powers(2 * below)[0::2][: n - below] if below < n else [])


@pytest.mark.parametrize("num_heads", [*range(1, 70), 96, 100, 128, 255, 256, 257, 1000, 4097])
def test_alibi_slopes_in_one_tensor_op_equal_the_papers_list(num_heads):
    """The slopes are now one tensor op (no Python loop over the heads); in float32 they equal
    the paper's Python-float formula exactly."""
    expected = torch.tensor(_paper_slopes(num_heads), dtype=torch.float64).float()
    got = alibi.slopes(num_heads)
    assert got.dtype == torch.float32 and torch.equal(got, expected)
