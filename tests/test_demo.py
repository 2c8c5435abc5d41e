"""The demo walks the chapter in order, prints the seeds' numbers and draws its heatmaps."""

import matplotlib.image
import pytest
import torch

from attnlab import demo, viz
from tests.book import printed
from tests.book.test_golden import assert_printed


@pytest.fixture(scope="module")
def steps():
    return demo.chapter_steps()


def value(steps, title, name):
    matches = [s.values[name] for s in steps if s.title == title and name in s.values]
    assert len(matches) == 1, f"{title!r} / {name!r} found {len(matches)} times"
    return matches[0]


@pytest.mark.parametrize(
    ("title", "name", "expected"),
    [
        ("Scores for the query 'journey'", "attn_scores_2", printed.ATTN_SCORES_2),
        ("Normalising the scores", "scores / sum", printed.ATTN_WEIGHTS_2_TMP),
        ("Normalising the scores", "softmax_naive", printed.ATTN_WEIGHTS_2_SOFTMAX),
        ("The context vector z(2)", "context_vec_2", printed.CONTEXT_VEC_2),
        ("Scores for every query", "attn_scores (loops)", printed.ATTN_SCORES),
        ("Weights for every query", "attn_weights", printed.ATTN_WEIGHTS),
        ("Every context vector at once", "all_context_vecs", printed.ALL_CONTEXT_VECS),
        ("Query, key and value of x(2)", "query_2", printed.QUERY_2),
        (
            "Scaled scores, weights and context of x(2)",
            "attn_weights_2",
            printed.TRAINABLE_ATTN_WEIGHTS_2,
        ),
        ("SelfAttention_v1 (seed 123)", "sa_v1(inputs)", printed.SA_V1_OUT),
        ("SelfAttention_v2 (seed 789)", "sa_v2(inputs)", printed.SA_V2_OUT),
        (
            "Way 1: softmax, zero the future, renormalise",
            "masked_simple_norm",
            printed.CAUSAL_WEIGHTS,
        ),
        ("Way 2: -inf above the diagonal, then softmax", "attn_weights", printed.CAUSAL_WEIGHTS),
        ("Dropout on the attention weights", "dropout(ones)", printed.DROPOUT_ONES_LINUX),
        (
            "Dropout on the attention weights",
            "dropout(attn_weights)",
            printed.DROPOUT_WEIGHTS_LINUX,
        ),
        (
            "Batched matrix multiplication over heads",
            "a @ a.transpose(2, 3)",
            printed.BATCHED_MATMUL_OUT,
        ),
    ],
)
def test_printed_values_match_the_seeds(steps, title, name, expected):
    assert_printed(value(steps, title, name), expected)


def test_multi_head_outputs_match_the_seeds(steps):
    for row in value(steps, "MultiHeadAttentionWrapper (seed 123, two heads)", "context_vecs"):
        assert_printed(row, printed.WRAPPER_OUT_ROWS)
    for row in value(steps, "MultiHeadAttention with weight splits (seed 123)", "context_vecs"):
        assert_printed(row, printed.MHA_OUT_ROWS)


def test_equalities_the_demo_claims_hold(steps):
    for title, name in [
        ("Exercise 3.1: v2's weights in a v1", "max |v1 - v2| after copying"),
        ("Way 3: the blog post's additive mask M", "max |way 1 - way 2|"),
        ("Way 3: the blog post's additive mask M", "max |way 3 - way 2|"),
        ("PyTorch's nn.MultiheadAttention, head by head", "max |per-head layer - torch|"),
    ]:
        assert value(steps, title, name) < 1e-6


def test_steps_follow_the_chapter_order(steps):
    sections = [s.section for s in steps if s.section != "blog post"]
    assert sections == sorted(sections, key=lambda s: [int(p) for p in s.split(".")])
    assert steps[-1].section == "blog post"


def test_demo_leaves_the_callers_random_state_alone():
    torch.manual_seed(5)
    demo.chapter_steps()
    after = torch.rand(4)
    torch.manual_seed(5)
    torch.testing.assert_close(after, torch.rand(4), rtol=0, atol=0)


def test_run_demo_writes_the_heatmaps(tmp_path):
    lines = []
    paths = demo.run_demo(tmp_path / "out", echo=lines.append)
    names = sorted(p.name for p in paths)
    assert names == [
        "01_weight_free.png",
        "02_trainable.png",
        "03_causal.png",
        "04_causal_dropout.png",
        "05_multihead_head1.png",
        "05_multihead_head2.png",
    ]
    for path in paths:
        image = matplotlib.image.imread(path)
        assert image.shape[0] > 200 and image.shape[1] > 200
    text = "\n".join(lines)
    assert str((tmp_path / "out").resolve()) in text
    assert "tensor([0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865])" in text
    assert "2,360,064" in text


def test_causal_heatmaps_mark_the_masked_cells(steps):
    heatmaps = {h.filename: h for s in steps for h in s.heatmaps}
    causal = torch.tril(torch.ones(6, 6, dtype=torch.bool))
    for name in ("03_causal.png", "04_causal_dropout.png", "05_multihead_head1.png"):
        assert torch.equal(heatmaps[name].allowed, causal), name
    assert heatmaps["01_weight_free.png"].allowed is None
    dropped = heatmaps["04_causal_dropout.png"]
    _, texts = viz.cells(dropped.weights, dropped.allowed)
    zero_kept = (dropped.weights == 0) & causal  # weights dropout zeroed, not masked ones
    assert zero_kept.any() and set(texts[zero_kept.numpy()]) == {"0.00"}
    assert set(texts[~causal.numpy()]) == {viz.MASKED_TEXT}


def test_the_dropout_heatmap_says_what_dropout_does_to_the_scale(steps):
    (dropped,) = [h for s in steps for h in s.heatmaps if h.filename == "04_causal_dropout.png"]
    assert "1/(1-p) = 2.00" in dropped.note
    assert dropped.weights.max() == 2.0  # the 2.00 the note explains
