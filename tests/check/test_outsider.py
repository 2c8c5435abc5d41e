"""attnlab.check.audit on attention modules written the way other people write them
(tests/check/outsider.py): no false alarm on the correct ones, each planted bug named; and
the probe's own reach: nn.MultiheadAttention audited directly in both batch layouts, widths
found without d_in, huge context lengths sized down, hints with the real option spellings."""

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnlab.check import audit
from attnlab.check.causes import BUG_KINDS, find_suspects
from attnlab.check.probe import make_probe
from attnlab.check.properties import MAX_TOKENS
from tests.check import outsider, world


def _audit(module, **kwargs):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notices
        return audit(module, **kwargs)


@functools.cache
def _outsider_report(name):
    """One audit per zoo module, shared by the tests that read its report."""
    kwargs, causal = outsider.CORRECT.get(name) or (outsider.BUGS[name][0], True)
    return _audit(getattr(outsider, name)(**kwargs), causal=causal)


@pytest.mark.parametrize("name", sorted(outsider.CORRECT))
def test_correct_outsider_modules_give_no_failure(name):
    report = _outsider_report(name)
    assert report.ok, {r.name: (r.observed, r.causes) for r in report.results if r.failed}


@pytest.mark.parametrize("name", sorted(outsider.BUGS))
def test_each_outsider_bug_fails_with_its_cause_named(name):
    _, must_fail, words = outsider.BUGS[name]
    report = _outsider_report(name)
    assert must_fail <= set(report.failed), report.failed
    explained = " ".join(" ".join([report[n].observed, *report[n].causes]) for n in must_fail)
    assert words in explained, explained


@pytest.mark.parametrize("name", sorted(outsider.CORRECT))
def test_correct_outsider_sources_have_no_suspects(name):
    kinds = {s.kind for s in find_suspects(getattr(outsider, name)(**outsider.CORRECT[name][0]))}
    assert "source_read" in kinds and not kinds & {*BUG_KINDS, "sdpa_dropout_always"}, kinds


def test_random_eval_output_is_reported_once():
    """A module random in eval mode fails dropout_modes, naming the line; the properties
    that compare two calls are left undecided instead of failing with unrelated causes."""
    report = _outsider_report("SdpaDropoutAlways")
    assert report.failed == ["dropout_modes"], report.failed
    assert "outsider.py:" in report["dropout_modes"].causes[0]
    assert report["causal"].status == "skipped"


def test_the_condition_that_turns_the_mask_off_is_named():
    causes = _outsider_report("T5EncoderAsDecoder")["causal"].causes
    assert "`if self.is_decoder:`" in causes[0] and "is_decoder=True" in causes[0], causes


def test_rotary_positions_are_in_the_reference():
    """Rotary positions computed in the forward (no state) are found by the reference's
    rotary layouts (check.rotary), no longer left undecided."""
    result = _outsider_report("LlamaAttention")["reference"]
    assert result.status == "passed" and "rotary (halves" in result.observed, result.observed


def test_a_leak_from_a_sequence_statistic_names_the_reduction():
    causes = _outsider_report("QKNormOverTokens")["causal"].causes
    assert "k.mean(dim=2" in causes[0], causes
    assert not any("is_causal" in c or "masked_fill" in c for c in causes), causes


def test_a_mask_buffer_of_any_name_gives_the_context_length():
    report = _outsider_report("CausalBufferNotSliced")
    assert report.context_length == 6
    assert "runs" in report.failed and "sliced" in " ".join(report["runs"].causes)


class CausalMHA(nn.MultiheadAttention):
    """nn.MultiheadAttention itself, forward(x) with a causal mask, in its own layout."""

    def forward(self, x):
        t = x.shape[1] if self.batch_first else x.shape[0]
        blocked = torch.ones(t, t, dtype=torch.bool).triu(1)  # True = may NOT attend
        return super().forward(x, x, x, attn_mask=blocked, need_weights=False)[0]


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_subclass_in_both_layouts(batch_first):
    report = _audit(CausalMHA(8, 2, dropout=0.1, batch_first=batch_first))
    assert report.ok, {r.name: r.observed for r in report.results if r.failed}
    assert report["reference"].status == "passed", report["reference"].observed
    assert ("batch_first=False" in report["runs"].observed) == (not batch_first)


@pytest.mark.parametrize("batch_first", [True, False])
def test_plain_multihead_attention_is_right_and_not_causal(batch_first):
    module = nn.MultiheadAttention(8, 2, batch_first=batch_first)
    assert _audit(module, causal=False).ok
    report = _audit(module)
    assert report.failed == ["causal", "reference"] or "causal" in report.failed
    assert "--no-causal" in report["causal"].observed


def test_widths_are_found_in_submodules_and_conv1d():
    assert make_probe(world.GPT2AttentionBlock(), None, None).d_in == 8

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.MultiheadAttention(12, 3, batch_first=True)

        def forward(self, x):
            return self.inner(x, x, x, need_weights=False)[0]

    assert make_probe(Wrapper(), None, None).d_in == 12


_SEEN = []


class HugeContext(nn.Module):
    """A correct SDPA module announcing a 131072-token context; records the lengths seen."""

    def __init__(self, dim=8, heads=2, max_position_embeddings=131072):
        super().__init__()
        self.heads, self.max_position_embeddings = heads, max_position_embeddings
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        _SEEN.append(t)  # a global: the audit's copies share it
        q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in self.qkv(x).chunk(3, -1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, h, t, hd)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


def test_huge_context_lengths_are_sized_down():
    _SEEN.clear()
    report = audit(HugeContext())
    assert report.ok and report.context_length == 131072
    assert report["long_input"].status == "skipped"
    assert "131073 x 131073" in report["long_input"].observed
    assert 0 < max(_SEEN) <= MAX_TOKENS, max(_SEEN)


def test_hints_name_the_real_option_spellings():
    class NoLength(HugeContext):
        def __init__(self):
            super().__init__(max_position_embeddings=None)

    result = _audit(NoLength())["long_input"]
    assert result.status == "skipped"
    assert "--context-length N" in result.observed and "context_length=N" in result.observed
