"""attnlab.check.audit on attention code in the shapes the world writes it (tests/check/
world.py): every correct module gives no failure (its loud limits are warnings), every
planted bug fails with its cause named; the source reading points at the line; train mode is
checked statistically; the reference finds windows and grouped-query layouts itself."""

import warnings

import pytest
import torch
from torch import nn

from attnlab.check import audit
from attnlab.check.causes import BUG_KINDS, find_suspects
from tests.check import world, zoo


def _audit(module, **kwargs):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' and flex's notices
        return audit(module, d_in=world.D, **kwargs)


@pytest.mark.parametrize("name", sorted(world.CORRECT))
def test_correct_modules_give_no_failure(name):
    kwargs, causal, statuses = world.CORRECT[name]
    report = _audit(getattr(world, name)(**kwargs), causal=causal)
    assert report.ok, {r.name: (r.observed, r.causes) for r in report.results if r.failed}
    assert {n: report[n].status for n in statuses} == statuses, report[next(iter(statuses))]


@pytest.mark.parametrize("name", sorted(world.BUGS))
def test_each_bug_fails_with_its_cause_named(name):
    kwargs, must_fail, words = world.BUGS[name]
    report = _audit(getattr(world, name)(**kwargs))
    assert must_fail <= set(report.failed), report.failed
    explained = " ".join(" ".join([report[n].observed, *report[n].causes]) for n in must_fail)
    assert words in explained, explained


@pytest.mark.parametrize("batch_first", [True, False])
def test_torch_multihead_attention_in_both_layouts(batch_first):
    """PyTorch's module, wrapped the usual way for (batch, tokens, d) with a causal mask."""

    class Causal(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(8, 2, dropout=0.1, batch_first=batch_first)
            self.context_length = 6

        def forward(self, x):
            t = x.shape[1]
            blocked = torch.ones(t, t, dtype=torch.bool).triu(1)  # True = may NOT attend
            x = x if batch_first else x.transpose(0, 1)  # (t, b, d) when not batch_first
            out = self.mha(x, x, x, attn_mask=blocked, need_weights=False)[0]
            return out if batch_first else out.transpose(0, 1)

    report = _audit(Causal())
    assert report.ok, report.failed
    assert report["reference"].status == "passed", report["reference"].observed


def test_the_window_is_detected_and_reported():
    result = _audit(world.SlidingWindow(8, 2, window=3))["reference"]
    assert result.status == "passed"
    assert "sliding window: each query sees itself and 2 keys before" in result.observed


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_grouped_query_heads_are_found(kv_heads):
    result = _audit(world.GroupedQuery(8, 4, kv_heads))["reference"]
    assert result.status == "passed" and f"{kv_heads} key/value heads" in result.observed


def test_the_unbatched_chapter_classes_are_audited_row_by_row():
    report = _audit(world.PrintedSelfAttentionV2(8, 4), causal=False)
    assert report["runs"].status == "warning" and "unbatched" in report["runs"].observed
    assert report["batch_independent"].status == "passed"
    assert report["reference"].status == "passed"


# --------------------------------------------------------------------------- the source


def _line_of(cls, marker):
    """The file line of the first line of cls's source holding `marker` (the planted bug)."""
    import inspect

    lines, start = inspect.getsourcelines(cls)
    return start + next(i for i, line in enumerate(lines) if marker in line)


@pytest.mark.parametrize(
    ("cls", "kwargs", "kind", "marker"),
    [
        (zoo.NoUnderscoreMaskedFill, zoo.SINGLE, "masked_fill_discarded", "# bug: no _"),
        (zoo.SoftmaxWrongDim, zoo.SINGLE, "softmax_dim", "# bug: dim=1"),
        (zoo.InvertedSdpaMask, zoo.MULTI, "sdpa_inverted_mask", "scaled_dot_product_attention"),
        (world.MaskOneDiagonalHigh, world.BUGS["MaskOneDiagonalHigh"][0], "mask_offset", "# bug"),
        (world.DropoutBeforeSoftmax, world.BUGS["DropoutBeforeSoftmax"][0],
         "dropout_before_softmax", "# bug"),
        (world.NanoGPTNoIsCausal, world.BUGS["NanoGPTNoIsCausal"][0], "sdpa_not_causal", "# bug"),
        (world.NanoGPTMergeWithoutTranspose, world.BUGS["NanoGPTMergeWithoutTranspose"][0],
         "merge_without_transpose", "# bug"),
        (zoo.ViewWithoutTranspose, zoo.MULTI, "split_without_transpose", "# bug"),
    ],
)  # fmt: skip
def test_the_source_reading_points_at_the_line(cls, kwargs, kind, marker):
    found = [s for s in find_suspects(cls(**kwargs)) if s.kind == kind]
    assert found, [s.kind for s in find_suspects(cls(**kwargs))]
    assert found[0].line == _line_of(cls, marker) and found[0].file.endswith(".py")


def test_correct_sources_have_no_suspects():
    for name in ("PrintedMultiHeadAttention", "NanoGPTStyle", "GroupedQuery2", "MinGPTStyle"):
        kwargs = world.CORRECT[name][0]
        kinds = {s.kind for s in find_suspects(getattr(world, name)(**kwargs))}
        assert not kinds & {*BUG_KINDS, "sdpa_dropout_always"}, (name, kinds)


def test_no_masked_fill_advice_for_a_module_without_one():
    causes = " ".join(_audit(world.NanoGPTNoIsCausal(8, 2, 6))["causal"].causes)
    assert "is_causal" in causes and "masked_fill" not in causes


# --------------------------------------------------------------------------- train mode


class _UnscaledDropout(zoo.BookCausalAttention):
    """A hand-made dropout that keeps weights without the 1/(1 - p) rescaling."""

    def forward(self, x):
        t = x.shape[1]
        scores = self.W_query(x) @ self.W_key(x).transpose(1, 2)
        scores = scores.masked_fill(self.mask.bool()[:t, :t], -torch.inf)
        weights = torch.softmax(scores / self.d_out**0.5, dim=-1)
        if self.training:
            weights = weights * (torch.rand_like(weights) > self.dropout.p)
        return weights @ self.W_value(x)


def test_train_mode_catches_expected_weights_that_do_not_sum_to_one():
    result = _audit(_UnscaledDropout(**dict(zoo.SINGLE, dropout=0.2)))["dropout_modes"]
    assert result.failed and "do not sum to 1" in result.observed


@pytest.mark.parametrize("seed", range(3))
def test_train_mode_is_no_false_alarm_for_right_dropout(seed):
    torch.manual_seed(seed)
    module = world.PrintedMultiHeadAttention(8, 8, 6, 0.3, 2)
    result = audit(module)["dropout_modes"]
    assert result.status == "passed" and "equals eval" in result.observed, result.observed


def test_train_mode_raises_a_zero_rate_on_a_copy():
    module = world.DropoutBeforeSoftmax(8, 4, 6, 0.0)
    result = _audit(module)["dropout_modes"]
    assert result.failed and "raised from 0" in result.observed
    assert module.dropout.p == 0.0  # the user's module keeps its rate
