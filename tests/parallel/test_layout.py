"""attnlab.parallel.layout without processes: the blocks that the ranks compute cover every
(query, key) pair that attention needs exactly once, in both layouts, and the score counts
say how the work is spread."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from attnlab.parallel.layout import LAYOUTS, block_for, check_layout, scores_per_rank


def positions(rank: int, world: int, local: int, layout: str) -> list[int]:
    """Global positions of a rank's local tokens, written out from the layout's definition."""
    if layout == "contiguous":
        return list(range(rank * local, (rank + 1) * local))
    piece = local // 2
    tail = 2 * world - 1 - rank
    return [*range(rank * piece, (rank + 1) * piece), *range(tail * piece, (tail + 1) * piece)]


def pairs_computed(world: int, local: int, causal: bool, layout: str) -> list[tuple[int, int]]:
    """Every (query position, key position) scored by some rank, with repeats."""
    pairs = []
    for rank in range(world):
        mine = positions(rank, world, local, layout)
        for source in range(world):
            block = block_for(rank, source, local, causal=causal, layout=layout)
            if block is None:
                continue
            theirs = positions(source, world, local, layout)
            rows, cols = range(local)[block.rows], range(local)[block.cols]
            for i in rows:
                for j in cols:
                    if not block.causal or j <= i:
                        pairs.append((mine[i], theirs[j]))
    return pairs


@given(
    world=st.integers(1, 6),
    pieces=st.integers(1, 4),
    causal=st.booleans(),
    layout=st.sampled_from(LAYOUTS),
)
def test_blocks_cover_each_needed_pair_once(world, pieces, causal, layout):
    local = 2 * pieces  # even, as the zigzag layout needs
    tokens = world * local
    needed = [(i, j) for i in range(tokens) for j in range(tokens) if not causal or j <= i]
    assert sorted(pairs_computed(world, local, causal, layout)) == needed
    counts = scores_per_rank(world, tokens, causal=causal, layout=layout)
    assert sum(counts) == len(needed)
    if causal and layout == "zigzag":
        assert len(set(counts)) == 1  # balanced


def test_contiguous_causal_work_grows_with_the_rank():
    local = 16
    counts = scores_per_rank(4, 4 * local, causal=True, layout="contiguous")
    diagonal = local * (local + 1) // 2  # its own block, causal
    assert counts == [rank * local**2 + diagonal for rank in range(4)]


@pytest.mark.parametrize("layout", ["ring", None, 2])
def test_unknown_layouts_are_refused(layout):
    with pytest.raises(ValueError, match="layout must be one of"):
        check_layout(layout)
