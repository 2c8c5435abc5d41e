"""attnlab.rope: equal to the complex-number formulation, q.k depends only on the distance
between positions, tables stay float32 whatever the module's dtype."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnlab.rope import RotaryEmbedding, rotary_tables
from tests.definitions import rope_reference

seeds = st.integers(0, 2**31 - 1)


@given(seeds, st.integers(1, 8), st.integers(1, 9), st.integers(0, 40), st.sampled_from([1e4, 5e5]))
def test_equals_the_complex_formulation(seed, half_dim, tokens, start, base):
    torch.manual_seed(seed)
    rope = RotaryEmbedding(2 * half_dim, 64, base)
    x = torch.randn(2, 3, tokens, 2 * half_dim)
    expected = rope_reference(x, torch.arange(start, start + tokens), base)
    torch.testing.assert_close(rope(x, start).double(), expected, rtol=1e-5, atol=1e-5)


@given(seeds, st.integers(0, 500), st.integers(0, 500), st.integers(0, 500))
def test_scores_depend_only_on_the_distance(seed, m, n, shift):
    torch.manual_seed(seed)
    rope = RotaryEmbedding(16, 1024)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(i, j):
        return (rope(q, i) * rope(k, j)).sum()

    torch.testing.assert_close(score(m + shift, n + shift), score(m, n), rtol=1e-4, atol=1e-4)


def test_position_zero_is_identity_and_norms_are_kept():
    torch.manual_seed(1)
    rope = RotaryEmbedding(8, 32)
    x = torch.randn(2, 2, 5, 8)
    torch.testing.assert_close(rope(x[..., :1, :], 0), x[..., :1, :], rtol=0, atol=0)
    torch.testing.assert_close(rope(x, 7).norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_tables_stay_float32_when_the_module_moves(dtype):
    rope = RotaryEmbedding(8, 4096).to(dtype)
    cos, sin = rotary_tables(8, 4096, 10000.0)
    assert rope.cos.dtype == rope.sin.dtype == torch.float32
    torch.testing.assert_close(rope.cos, cos, rtol=0, atol=0)
    torch.testing.assert_close(rope.sin, sin, rtol=0, atol=0)
    assert "cos" not in rope.state_dict()  # rebuilt from the arguments, not saved


def test_half_precision_input_rotated_in_float32():
    torch.manual_seed(2)
    rope = RotaryEmbedding(8, 4096)
    x = torch.randn(1, 1, 3, 8)
    got = rope(x.bfloat16(), 4000)
    assert got.dtype == torch.bfloat16
    expected = rope_reference(x.bfloat16().float(), torch.arange(4000, 4003)).float()
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: RotaryEmbedding(7, 8), ValueError, "even head_dim, got 7"),
        (lambda: RotaryEmbedding(8, 8, base=1.0), ValueError, "base must be > 1"),
        (lambda: RotaryEmbedding(8, 8, base="big"), TypeError, "base must be a float"),
        (lambda: RotaryEmbedding(8, 0), ValueError, "max_positions must be >= 1"),
        (
            lambda: RotaryEmbedding(8, 8)(torch.randn(1, 1, 3, 8), 6),
            ValueError,
            r"start \(6\) \+ x's 3 tokens reach position 8, outside the rotary tables \(0\.\.7",
        ),
    ],
)
def test_bad_input(make, error, message):
    with pytest.raises(error, match=message):
        make()


BOUND = r"must be at most 1,099,511,627,776 \(2\*\*40, attnlab's bound on any size or position\)"


@pytest.mark.parametrize(
    ("make", "product"),
    [
        (lambda: RotaryEmbedding(64, 2**35), r"max_positions x head_dim \(34359738368 x 64\)"),
        (
            lambda: rotary_tables(2**21, 2**20, 1e4),
            r"num_positions x head_dim \(1048576 x 2097152\)",
        ),
    ],
    ids=["RotaryEmbedding", "rotary_tables"],
)
def test_tables_of_more_entries_than_the_bound_are_refused_before_they_are_built(make, product):
    """Sizes each within the bound whose tables would hold terabytes: named, before torch
    tries to allocate them."""
    with pytest.raises(ValueError, match=rf"{product} {BOUND}"):
        make()
