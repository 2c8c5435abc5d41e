"""The chapter's six-token example, stage by stage, as explorer groups.

Scores of SelfAttention_v2 (seed 789, as in section 3.5.1): raw, scaled by sqrt(d_k), with
-inf above the diagonal; then the weights: softmax, and dropout p=0.5 (seed 123, section
3.5.2); then each head of the book's MultiHeadAttention (seed 123, section 3.6.2). The seeds
are applied inside torch.random.fork_rng: the caller's random state is left as it was.
"""

from __future__ import annotations

import torch

from attnlab import book
from attnlab.explore.data import Capture, Group

CAUSAL = book.causal_keep_mask(6).bool()  # (6, 6) True on and below the diagonal


def chapter_capture() -> Capture:
    """The chapter's example, stage by stage.

    Returns:
        Three groups: the scores (raw, scaled, causally masked), the weights (softmax,
        dropout) and the two heads of the multi-head layer.
    """
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(789)
        sa_v2 = book.SelfAttention_v2(3, 2)
        scores = sa_v2.W_query(book.INPUTS) @ sa_v2.W_key(book.INPUTS).T  # (6, 6)
        scaled = scores / sa_v2.d_out**0.5
        masked = book.mask_future_scores(scaled)  # -inf above the diagonal
        weights = book.causal_weights_neg_inf(scores, sa_v2.d_out)
        torch.manual_seed(123)
        dropped = torch.nn.Dropout(0.5)(weights)
        torch.manual_seed(123)
        mha = book.MultiHeadAttention(3, 2, 6, 0.0, num_heads=2)
        heads = mha.attention_weights(book.example_batch())[0]  # (h, t, t) of the first text
    tokens = tuple(book.TOKENS)
    everywhere = torch.ones(6, 6, dtype=torch.bool)
    score_mask = torch.stack([everywhere, everywhere, CAUSAL])[:, None]  # (3, 1, 6, 6)
    return Capture(
        title="The chapter's example: 'Your journey starts with one step'",
        groups=(
            Group(
                "1. scores (SelfAttention_v2, seed 789)",
                torch.stack([scores, scaled, masked])[:, None],  # (stages, 1, 6, 6)
                score_mask,
                tokens,
                tokens,
                ("queries @ keys.T", "scaled by 1/sqrt(d_k)", "causal mask: -inf above"),
                scores=True,
            ),
            Group(
                "2. weights",
                torch.stack([weights, dropped])[:, None],  # (stages, 1, 6, 6)
                CAUSAL,
                tokens,
                tokens,
                ("softmax", "dropout p=0.5 (seed 123)"),
            ),
            Group(
                "3. MultiHeadAttention, 2 heads (seed 123)",
                heads[None],  # (1, h, 6, 6)
                CAUSAL,
                tokens,
                tokens,
                ("MultiHeadAttention",),
            ),
        ),
        notes=(
            "Inputs: the chapter's hand-made 3-d embeddings of the six words.",
            "Dropout zeroes each weight with probability 0.5 and doubles the kept ones: a "
            "dropped weight is a zero, not a masked cell.",
        ),
    )
