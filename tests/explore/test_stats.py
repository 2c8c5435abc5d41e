"""Per-head statistics against their definitions on maps whose values are known."""

from __future__ import annotations

import math

import torch

from attnlab.explore import Group
from attnlab.explore.stats import head_stats


def _group(weights, allowed, scores=False):
    q, k = weights.shape[-2:]
    return Group(
        "g",
        weights,
        allowed,
        tuple(map(str, range(q))),
        tuple(map(str, range(k))),
        tuple(f"l{i}" for i in range(weights.shape[0])),
        scores=scores,
    )


def test_uniform_causal_attention():
    """Query i spreads evenly over keys 0..i: entropy ln(i+1), distance i/2, first 1/(i+1)."""
    n = 5
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    weights = (causal / causal.sum(-1, keepdim=True))[None, None]  # (1, 1, n, n)
    (stats,) = head_stats(_group(weights, causal))
    rows = range(n)
    assert math.isclose(
        stats["entropy"], sum(math.log(i + 1) for i in rows) / n, rel_tol=1e-6
    )  # float32 weights
    assert math.isclose(
        stats["distance"], sum(i / 2 for i in rows) / n, rel_tol=1e-6
    )  # float32 weights
    assert math.isclose(
        stats["first"], sum(1 / (i + 1) for i in rows) / n, rel_tol=1e-6
    )  # float32 weights


def test_a_sink_head_and_a_fully_masked_row():
    """Every row on the first token: entropy 0, first-token share 1; a row with no key
    allowed (padding) is left out of the means."""
    weights = torch.zeros(1, 2, 3, 3)  # (l, h, q, k)
    weights[..., 0] = 1.0
    allowed = torch.ones(3, 3, dtype=torch.bool)
    allowed[2] = False  # query 2 attends to nothing
    weights[..., 2, :] = 0.0
    stats = head_stats(_group(weights, allowed))
    assert len(stats) == 2
    for head in stats:
        assert head == {"entropy": 0.0, "distance": 0.5, "first": 1.0}  # rows 0 and 1


def test_scores_have_no_statistics():
    weights = torch.randn(1, 1, 2, 2)
    assert head_stats(_group(weights, torch.tensor(True), scores=True)) is None
