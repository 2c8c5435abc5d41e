"""attnlab.check.audit on a zoo of modules: the book's correct classes, attnlab's own and
correct modules written the way readers write them pass every property (no false alarms);
each classic bug fails the property that catches it, with an explanation naming the cause."""

import pytest
import torch
from torch import nn

from attnlab import MultiHeadAttention, book
from attnlab.check import audit
from tests.book.leaky import LeakyCausalAttention
from tests.check import zoo


def _explanations(report, name):
    result = report[name]
    return " ".join([result.observed, *result.causes]).lower()


CORRECT = [
    ("zoo " + name, lambda name=name: getattr(zoo, name)(**zoo.CORRECT_KWARGS[name]), True)
    for name in zoo.CORRECT
] + [
    ("book CausalAttention", lambda: book.CausalAttention(8, 8, 6, 0.1), True),
    ("book MultiHeadAttention", lambda: book.MultiHeadAttention(8, 8, 6, 0.1, 2, True), True),
    ("book wrapper", lambda: book.MultiHeadAttentionWrapper(8, 4, 6, 0.0, 2), True),
    ("book SelfAttention_v1", lambda: book.SelfAttention_v1(8, 4), False),
    ("book SelfAttention_v2", lambda: book.SelfAttention_v2(8, 4, True), False),
    ("attnlab auto", lambda: MultiHeadAttention(8, 8, 6, 0.1, 2), True),
    ("attnlab grouped", lambda: MultiHeadAttention(8, 8, 6, 0.0, 4, num_kv_heads=2), True),
    ("attnlab math", lambda: MultiHeadAttention(8, 8, 6, 0.0, 2, backend="math"), True),
    ("attnlab rope", lambda: MultiHeadAttention(8, 8, 6, 0.0, 2, rope=True), True),
    (
        "torch MultiheadAttention",
        lambda: nn.MultiheadAttention(8, 2, batch_first=True, dropout=0.1),
        False,
    ),
]


@pytest.mark.parametrize(("name", "make", "causal"), CORRECT, ids=[c[0] for c in CORRECT])
def test_correct_modules_pass_every_property(name, make, causal):
    torch.manual_seed(0)
    report = audit(make(), causal=causal)
    assert report.ok, {r.name: (r.observed, r.causes) for r in report.results if r.failed}
    applicable = {r.name for r in report.results if r.status == "passed"}
    assert {"runs", "batch_independent", "finite_gradients", "follows_to"} <= applicable
    assert ("causal" in applicable) == causal


def test_the_reference_property_applies_to_known_layouts():
    torch.manual_seed(0)
    for module in (book.MultiHeadAttention(8, 8, 6, 0.0, 2), MultiHeadAttention(8, 8, 6, 0.0, 2)):
        assert audit(module)["reference"].status == "passed"
    wrapper = audit(book.MultiHeadAttentionWrapper(8, 4, 6, 0.0, 2))["reference"]
    assert wrapper.status == "passed" and "2 head modules" in wrapper.observed
    rope = audit(MultiHeadAttention(8, 8, 6, 0.0, 2, rope=True))["reference"]
    assert rope.status == "skipped" and "rope" in rope.observed


@pytest.mark.parametrize("name", sorted(zoo.BUGS))
def test_each_bug_fails_the_property_that_catches_it(name):
    kwargs, must_fail, word = zoo.BUGS[name]
    torch.manual_seed(0)
    report = audit(getattr(zoo, name)(**kwargs))
    assert not report.ok
    assert must_fail <= set(report.failed), report.failed
    explained = " ".join(_explanations(report, prop) for prop in must_fail)
    assert word in explained, explained


@pytest.mark.parametrize(
    ("name", "fits"),
    [
        ("MissingScale", "scale is missing"),
        ("WrongScale", "1/sqrt(d_out) instead of 1/sqrt(head_dim)"),
        ("SoftmaxWrongDim", "softmax over dim=1"),  # said once: where it is (zoo.py:N)
        ("ViewWithoutTranspose", "no transpose"),
        ("NoUnderscoreMaskedFill", "masked_fill without the trailing underscore"),
    ],
)
def test_the_reference_names_the_bug_that_fits(name, fits):
    kwargs = zoo.BUGS[name][0]
    torch.manual_seed(0)
    result = audit(getattr(zoo, name)(**kwargs))["reference"]
    assert result.failed and "equals the reference with the bug" in result.observed
    assert any(fits in cause for cause in result.causes), result.causes


def test_seed_001s_class_fails_causality_and_names_masked_fill():
    torch.manual_seed(0)
    report = audit(LeakyCausalAttention(3, 2, 6, 0.0))
    assert {"causal", "reference"} <= set(report.failed)
    assert "masked_fill" in report["causal"].causes[0]


def test_plain_attribute_is_named():
    report = audit(zoo.PlainAttributeMask(**zoo.SINGLE))
    assert "mask" in report["follows_to"].observed


def test_the_users_module_is_left_unchanged():
    torch.manual_seed(0)
    module = book.MultiHeadAttention(8, 8, 6, 0.1, 2).train()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    audit(module)
    assert module.training
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert all(p.grad is None for p in module.parameters())


def test_module_that_never_runs_skips_the_rest():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.W_query = nn.Linear(4, 4)

        def forward(self, x):
            raise RuntimeError("boom")

    report = audit(Broken())
    assert report.failed == ["runs"]
    assert all(r.status == "skipped" for r in report.results[1:])


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: audit("not a module"), TypeError, "module must be a torch.nn.Module"),
        (lambda: audit(nn.Identity()), ValueError, "pass --d-in N .* or d_in=N"),
        (lambda: audit(book.CausalAttention(4, 4, 6, 0.0), causal=1), TypeError, "causal"),
    ],
)
def test_bad_arguments(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("seed", range(5))
def test_a_small_dropout_rate_is_no_false_alarm(seed):
    """With p = 0.01 and three tokens, two train calls often drop nothing: the check
    compares enough weights, several times, before calling dropout unused."""
    torch.manual_seed(seed)
    report = audit(book.CausalAttention(4, 4, 3, 0.01))
    assert report["dropout_modes"].status == "passed", report["dropout_modes"].observed


def test_fused_layouts_get_the_reference_check():
    torch.manual_seed(0)
    report = audit(zoo.SdpaMultiHeadAttention(**zoo.MULTI))
    assert report["reference"].status == "passed"
    assert "fused" in report["reference"].observed


class _DiagonalMasked(zoo.BookCausalAttention):
    """The book's class with the mask built with diagonal=0: a token cannot see itself."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mask = torch.triu(torch.ones_like(self.mask), diagonal=0)


def test_a_mask_hiding_the_diagonal_is_named():
    torch.manual_seed(0)
    report = audit(_DiagonalMasked(**zoo.SINGLE))
    assert "diagonal" in " ".join(report["causal"].causes)


def test_half_precision_is_no_false_alarm():
    torch.manual_seed(0)
    report = audit(book.MultiHeadAttention(8, 8, 6, 0.0, 2).to(torch.bfloat16))
    assert report.ok, report.failed


class _WithBias(zoo.BookCausalAttention):
    """A learned relative bias added to the scores: no projection layout reproduces it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rel_bias = nn.Parameter(torch.randn(6, 6))

    def forward(self, x):
        t = x.shape[1]
        scores = self.W_query(x) @ self.W_key(x).transpose(1, 2) / self.d_out**0.5
        scores = scores + self.rel_bias[:t, :t]
        scores = scores.masked_fill(self.mask.bool()[:t, :t], -torch.inf)
        return torch.softmax(scores, dim=-1) @ self.W_value(x)


def test_unknown_state_skips_the_reference():
    result = audit(_WithBias(**zoo.SINGLE))["reference"]
    assert result.status == "skipped" and "rel_bias" in result.observed


def test_unused_state_does_not_hide_the_reference():
    """A parameter the forward never uses (zero effect): the layout is still found."""
    module = _WithBias(**zoo.SINGLE)
    with torch.no_grad():
        module.rel_bias.zero_()
    assert audit(module)["reference"].status == "passed"


@pytest.mark.parametrize("name", sorted(zoo.LOUD_LIMITS))
def test_a_loud_limit_is_a_warning_not_a_failure(name):
    kwargs, warned = zoo.LOUD_LIMITS[name]
    report = audit(getattr(zoo, name)(**kwargs))
    assert report.ok, report.failed
    assert report[warned].status == "warning" and "context_length" in report[warned].observed
