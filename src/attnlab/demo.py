"""`attnlab demo`: the chapter's walkthrough on the six-token example, with heatmaps.

`chapter_steps()` runs the chapter in its teaching order and returns each step's one-line
explanation and tensors (data, so tests can check them against the seeds' printouts);
`run_demo()` prints them and draws the attention heatmaps. The chapter's random seeds are
applied inside torch.random.fork_rng, so the caller's random state is left as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from attnlab import book, viz

TOKENS = list(book.TOKENS)
CAUSAL = book.causal_keep_mask(6).bool()  # (6, 6) True on and below the diagonal
DROPOUT_NOTE = (
    "Dropout zeroes each weight with probability p=0.5 and scales the kept ones by "
    "1/(1-p) = 2.00: the expected row sum stays 1, a row here need not sum to 1."
)


@dataclass(frozen=True)
class Heatmap:
    """One attention-weight matrix to draw, rows = queries, columns = keys.

    Attributes:
        filename: the PNG's name in the output folder.
        title: drawn above the map.
        weights: (tokens, tokens) floating-point weights.
        allowed: optional (tokens, tokens) bool, False where a cell is masked (drawn apart
            from a weight that is zero).
        note: a line drawn under the map.
    """

    filename: str
    title: str
    weights: torch.Tensor  # (tokens, tokens)
    allowed: torch.Tensor | None = None  # bool (tokens, tokens), False: masked, drawn apart
    note: str = ""  # drawn under the map


@dataclass(frozen=True)
class Step:
    """One step of the chapter: where it is, what it shows, and the values it prints.

    Attributes:
        section: the chapter's section, e.g. "3.5.1".
        title: the step's one-line title.
        explanation: one or two sentences saying what the step shows.
        values: the tensors (or numbers) the step prints, by name.
        heatmaps: the weight matrices it draws.
    """

    section: str
    title: str
    explanation: str
    values: dict[str, object]
    heatmaps: tuple[Heatmap, ...] = field(default=())


def chapter_steps() -> list[Step]:
    """Every step of sections 3.3-3.6 and of the self-attention blog post, in the order the
    chapter teaches them.

    The chapter's random seeds are applied inside torch.random.fork_rng, so the caller's
    random state is left as it was.

    Returns:
        The steps, each with its printed values and heatmaps.
    """
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        return [*_weight_free(), *_trainable(), *_causal(), *_multi_head(), *_per_head()]


def _weight_free() -> list[Step]:
    x = book.INPUTS
    query = x[1]
    scores_2 = book.attention_scores_for_query(x, query)
    weights_2 = torch.softmax(scores_2, dim=0)
    scores = book.attention_scores(x)
    weights = torch.softmax(scores, dim=-1)
    overflow = torch.tensor([100.0, 10.0])
    return [
        Step(
            "3.3.1",
            "The input",
            "Six tokens, each embedded as a 3-d vector.",
            {"tokens": TOKENS, "inputs": x},
        ),
        Step(
            "3.3.1",
            "Scores for the query 'journey'",
            "omega_2i = x(i) . x(2): a dot product measures how aligned two vectors are.",
            {
                "attn_scores_2": scores_2,
                "dot product by hand, x(1) . x(2)": book.dot_product_loop(x[0], query),
            },
        ),
        Step(
            "3.3.1",
            "Normalising the scores",
            "Dividing by the sum makes them sum to 1; softmax also keeps them positive.",
            {
                "scores / sum": book.normalize_by_sum(scores_2),
                "softmax_naive": book.softmax_naive(scores_2),
                "torch.softmax": weights_2,
            },
        ),
        Step(
            "3.3.1",
            "Why not the naive softmax",
            "exp(100) overflows float32 to inf and inf/inf is NaN; torch.softmax subtracts "
            "the maximum first.",
            {
                "softmax_naive([100, 10])": book.softmax_naive(overflow),
                "torch.softmax([100, 10])": torch.softmax(overflow, dim=0),
            },
        ),
        Step(
            "3.3.1",
            "The context vector z(2)",
            "z(2) = sum_i alpha_2i x(i): the inputs weighted by the attention weights.",
            {"context_vec_2": book.context_vector_loop(x, weights_2)},
        ),
        Step(
            "3.3.2",
            "Scores for every query",
            "Two nested loops, or one matrix product inputs @ inputs.T: the same numbers.",
            {
                "attn_scores (loops)": book.attention_scores_loop(x),
                "attn_scores (inputs @ inputs.T)": scores,
            },
        ),
        Step(
            "3.3.2",
            "Weights for every query",
            "A softmax over each row; every row sums to 1.",
            {"attn_weights": weights, "row sums": weights.sum(dim=-1)},
            (Heatmap("01_weight_free.png", "Weight-free self-attention", weights),),
        ),
        Step(
            "3.3.2",
            "Every context vector at once",
            "attn_weights @ inputs; the second row is z(2) again.",
            {"all_context_vecs": book.all_context_vectors(x)},
        ),
    ]


def _trainable() -> list[Step]:
    torch.manual_seed(123)
    sa_v1 = book.SelfAttention_v1(3, 2)  # W_query, W_key, W_value = torch.rand(3, 2) each
    step = book.attention_for_query(book.INPUTS, sa_v1.W_query, sa_v1.W_key, sa_v1.W_value)
    torch.manual_seed(789)
    sa_v2 = book.SelfAttention_v2(3, 2)
    copied = book.SelfAttention_v1(3, 2)
    book.copy_v2_weights_into_v1(sa_v2, copied)
    return [
        Step(
            "3.4.1",
            "Query, key and value of x(2)",
            "Trainable matrices W_q, W_k, W_v (seed 123) project 3-d inputs to 2-d.",
            {
                "query_2": step.query,
                "keys.shape": step.keys.shape,
                "values.shape": step.values.shape,
            },
        ),
        Step(
            "3.4.1",
            "Scaled scores, weights and context of x(2)",
            "omega = q(2) . k(i), softmax of omega / sqrt(d_k), then z(2) = weights @ values.",
            {
                "attn_score_22": step.own_score,
                "attn_scores_2": step.attn_scores,
                "attn_weights_2": step.attn_weights,
                "context_vec_2": step.context_vec,
            },
        ),
        Step(
            "3.4.2",
            "SelfAttention_v1 (seed 123)",
            "The same steps for all six tokens; its second row is z(2).",
            {"sa_v1(inputs)": sa_v1(book.INPUTS)},
        ),
        Step(
            "3.4.2",
            "SelfAttention_v2 (seed 789)",
            "nn.Linear layers: another initialisation, so other numbers.",
            {"sa_v2(inputs)": sa_v2(book.INPUTS)},
            (
                Heatmap(
                    "02_trainable.png",
                    "Trainable self-attention (SelfAttention_v2)",
                    sa_v2.attention_weights(book.INPUTS),
                ),
            ),
        ),
        Step(
            "3.4.2",
            "Exercise 3.1: v2's weights in a v1",
            "nn.Linear stores W transposed; copying W.T makes both classes agree.",
            {"max |v1 - v2| after copying": (copied(book.INPUTS) - sa_v2(book.INPUTS)).abs().max()},
        ),
    ]


def _causal() -> list[Step]:
    torch.manual_seed(789)
    sa_v2 = book.SelfAttention_v2(3, 2)
    scores = sa_v2.W_query(book.INPUTS) @ sa_v2.W_key(book.INPUTS).T  # (6, 6)
    d_k = sa_v2.d_out
    weights = book.scaled_softmax(scores, d_k)
    causal = book.causal_weights_neg_inf(scores, d_k)
    mask_simple = book.causal_keep_mask(6)
    renormalised = book.causal_weights_renormalised(scores, d_k)
    torch.manual_seed(123)
    dropout = torch.nn.Dropout(0.5)
    ones_dropped = dropout(torch.ones(6, 6))
    torch.manual_seed(123)
    dropped = dropout(causal)
    torch.manual_seed(123)
    ca = book.CausalAttention(3, 2, 6, 0.0)
    batch = book.example_batch()
    return [
        Step(
            "3.5.1",
            "Way 1: softmax, zero the future, renormalise",
            "sa_v2's weights times a lower-triangular mask, each row divided by its sum.",
            {
                "attn_weights": weights,
                "mask_simple": mask_simple,
                "masked_simple": weights * mask_simple,
                "masked_simple_norm": renormalised,
            },
        ),
        Step(
            "3.5.1",
            "Way 2: -inf above the diagonal, then softmax",
            "exp(-inf) = 0, so one softmax gives the same weights with no renormalising.",
            {"masked": book.mask_future_scores(scores), "attn_weights": causal},
            (Heatmap("03_causal.png", "Causal attention", causal, CAUSAL),),
        ),
        Step(
            "3.5.1",
            "Way 3: the blog post's additive mask M",
            "Add M (0 on and below the diagonal, -inf above) to the scores: the same again.",
            {
                "M": book.additive_causal_mask(6),
                "max |way 1 - way 2|": (renormalised - causal).abs().max(),
                "max |way 3 - way 2|": (book.causal_weights_additive(scores, d_k) - causal)
                .abs()
                .max(),
            },
        ),
        Step(
            "3.5.2",
            "Dropout on the attention weights",
            "p = 0.5 zeroes about half the weights and scales the rest by 1/(1-p) = 2 (training).",
            {"dropout(ones)": ones_dropped, "dropout(attn_weights)": dropped},
            (
                Heatmap(
                    "04_causal_dropout.png",
                    "Causal attention with dropout (p=0.5)",
                    dropped,
                    CAUSAL,
                    note=DROPOUT_NOTE,
                ),
            ),
        ),
        Step(
            "3.5.3",
            "CausalAttention on a batch of two (seed 123)",
            "Mask as a registered buffer, dropout, batched input (2, 6, 3).",
            {"batch.shape": batch.shape, "context_vecs": ca(batch)},
        ),
    ]


def _multi_head() -> list[Step]:
    batch = book.example_batch()
    torch.manual_seed(123)
    wrapper_out = book.MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2)(batch)
    a = torch.tensor(
        [
            [
                [
                    [0.2745, 0.6584, 0.2775, 0.8573],
                    [0.8993, 0.0390, 0.9268, 0.7388],
                    [0.7179, 0.7058, 0.9156, 0.4340],
                ],
                [
                    [0.0772, 0.3565, 0.1479, 0.5331],
                    [0.4066, 0.2318, 0.4545, 0.9737],
                    [0.4606, 0.5159, 0.4220, 0.5786],
                ],
            ]
        ]
    )  # (b, h, t, hd) = (1, 2, 3, 4)
    torch.manual_seed(123)
    mha = book.MultiHeadAttention(3, 2, 6, 0.0, num_heads=2)
    mha_out = mha(batch)
    head_weights = mha.attention_weights(batch)[0]  # (h, t, t) of the first text
    gpt2 = book.gpt2_small_attention()
    return [
        Step(
            "3.6.1",
            "MultiHeadAttentionWrapper (seed 123, two heads)",
            "Two CausalAttention heads run one after the other, outputs concatenated.",
            {"context_vecs": wrapper_out, "shape": wrapper_out.shape},
        ),
        Step(
            "3.6.1",
            "Exercise 3.2: two heads, 2-d output",
            "Give each head d_out=1 and the concatenation is 2-d.",
            {"shape": book.wrapper_with_2d_output()(batch).shape},
        ),
        Step(
            "3.6.2",
            "Batched matrix multiplication over heads",
            "a @ a.transpose(2, 3) multiplies every head's matrices at once.",
            {
                "a @ a.transpose(2, 3)": a @ a.transpose(2, 3),
                "first head": a[0, 0] @ a[0, 0].T,
                "second head": a[0, 1] @ a[0, 1].T,
            },
        ),
        Step(
            "3.6.2",
            "MultiHeadAttention with weight splits (seed 123)",
            "One projection per Q/K/V, split into heads by view + transpose, then out_proj.",
            {"context_vecs": mha_out, "shape": mha_out.shape},
            tuple(
                Heatmap(
                    f"05_multihead_head{h + 1}.png",
                    f"MultiHeadAttention, head {h + 1} of 2",
                    head_weights[h],
                    CAUSAL,
                )
                for h in range(2)
            ),
        ),
        Step(
            "3.6.2",
            "Exercise 3.3: GPT-2 small sized attention",
            "768 in and out, 12 heads, context 1024: 4 x 768^2 weights + 768 out_proj bias.",
            {"parameters": f"{book.count_parameters(gpt2):,}"},
        ),
    ]


def _per_head() -> list[Step]:
    torch.manual_seed(123)
    torch_mha = torch.nn.MultiheadAttention(6, 2, bias=False, batch_first=True).eval()
    x = torch.randn(2, 6, 6)  # (batch, tokens, embed_dim)
    mask = book.additive_causal_mask(6)
    expected, _ = torch_mha(x, x, x, attn_mask=mask, need_weights=False)
    layer = book.MultiHeadSelfAttention.from_torch(torch_mha)
    return [
        Step(
            "blog post",
            "PyTorch's nn.MultiheadAttention, head by head",
            "Its packed (3E, E) projection split into per-head matrices recomputes its output.",
            {"max |per-head layer - torch|": (layer(x, attn_mask=mask) - expected).abs().max()},
        ),
    ]


def run_demo(
    out_dir: str | Path = "attnlab-out", echo: Callable[[str], None] = print
) -> list[Path]:
    """Print the walkthrough and write its heatmaps into `out_dir`.

    Args:
        out_dir: the folder for the PNGs (created if missing).
        echo: where each printed line goes (default print).

    Returns:
        The paths of the PNGs written, in the chapter's order.
    """
    out_dir = Path(out_dir)
    written = []
    for step in chapter_steps():
        echo(f"\n== [{step.section}] {step.title}\n   {step.explanation}")
        for name, value in step.values.items():
            echo(f"{name}:\n{value!s}")
        for heatmap in step.heatmaps:
            written.append(
                viz.save_heatmap(
                    heatmap.weights,
                    TOKENS,
                    out_dir / heatmap.filename,
                    title=heatmap.title,
                    allowed=heatmap.allowed,
                    note=heatmap.note,
                )
            )
    echo(f"\nWrote {len(written)} heatmaps to {out_dir.resolve()}:")
    for path in written:
        echo(f"  {path.name}")
    echo(
        "\nTo explore these weights interactively (hover, heads side by side, any model): "
        "attnlab explore -o attnlab-out/explore.html (one HTML file, works offline)"
    )
    return written
