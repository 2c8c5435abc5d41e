"""attnlab.check.audit on modern attention (tests/check/modern.py): rotary positions in both
conventions, partial rotary widths and bases read from the module are in the reference, so
every correct family passes it (not skipped) and each planted bug, a wrong rotation
included, fails it with its cause named; PyTorch's MultiheadAttention followed by a Linear
(the book's bonus MHAPyTorchClass) raises no false alarm."""

import warnings

import pytest
import torch

from attnlab.check import audit
from attnlab.check.rotary import Rotary, candidates
from tests.check import modern


def _audit(name: str, **kwargs):
    torch.manual_seed(0)
    cls = getattr(modern, name.split("-")[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # casting a complex buffer in follows_to
        causal = cls.__name__ not in modern.NON_CAUSAL
        return audit(cls(**kwargs).eval(), d_in=modern.D, causal=causal)


@pytest.mark.parametrize("name", sorted(modern.CORRECT))
def test_correct_families_give_no_failure(name):
    report = _audit(name, **modern.CORRECT[name])
    assert report.ok, {r.name: (r.observed, r.causes) for r in report.results if r.failed}
    if name != "MHAPyTorchClass-bias":  # add_bias_kv's learned key/value: not modelled
        assert report["reference"].status == "passed", report["reference"].observed


@pytest.mark.parametrize("name", sorted(modern.BUGS))
def test_each_planted_bug_fails_the_reference_with_its_cause_first(name):
    kwargs, words = modern.BUGS[name]
    report = _audit(name, **kwargs)
    assert report["reference"].status == "failed", report["reference"].observed
    assert words in report["reference"].causes[0], report["reference"].causes


def test_keys_left_unrotated_are_named():
    report = _audit("LlamaStyleAttention", rotate_bug=True)
    assert report["reference"].status == "failed"
    assert "keys are not rotated" in report["reference"].causes[0], report["reference"].causes


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("LlamaStyleAttention", Rotary("halves", 8, 10000.0)),  # an inv_freq buffer
        ("NeoXStyleAttention", Rotary("halves", 4, 10000.0)),  # cos/sin tables, partial
        ("GPTJStyleAttention", Rotary("pairs", 4, 10000.0)),  # attributes rotary_dim, base
        ("MetaLlamaStyleAttention", Rotary("pairs", 8, 500000.0)),  # a complex freqs_cis
    ],
)
def test_the_module_says_its_rotary_width_and_base(name, expected):
    specs, _ = candidates(getattr(modern, name)(), 8)
    assert expected in specs[:2], specs[:4]  # the module's own values come first


def test_both_conventions_rotate_by_position_and_keep_the_norm():
    """Against a written-out rotation: halves pair i with i + dim/2, pairs 2i with 2i + 1;
    position 0 is unrotated and the features past dim pass through."""
    x = torch.randn(1, 1, 5, 8, dtype=torch.float64)
    for style in ("halves", "pairs"):
        y = Rotary(style, 4, 100.0).apply(x)
        torch.testing.assert_close(y[..., 0, :], x[..., 0, :])
        torch.testing.assert_close(y[..., 4:], x[..., 4:])
        torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    p, i = 3, 1  # position 3, frequency 1 of 2: angle 3 * 100^(-2/4)
    angle = torch.tensor(p * 100.0 ** (-2 * i / 4), dtype=torch.float64)
    halves = Rotary("halves", 4, 100.0).apply(x)[0, 0, p]
    a, b = x[0, 0, p, i], x[0, 0, p, i + 2]
    torch.testing.assert_close(halves[i], a * angle.cos() - b * angle.sin())
    pairs = Rotary("pairs", 4, 100.0).apply(x)[0, 0, p]
    a, b = x[0, 0, p, 2 * i], x[0, 0, p, 2 * i + 1]
    torch.testing.assert_close(pairs[2 * i + 1], b * angle.cos() + a * angle.sin())


def test_a_cut_list_says_how_many_it_left_out_and_each_cause_is_given_once():
    from attnlab.check.report import failed, joined, listed

    assert listed(list(range(9))) == "[0, 1, 2, 3, 4, 5] and 3 more (9 in all)"
    assert listed([1, 2]) == "[1, 2]"
    assert joined(["a", "b", "c"], 2) == "a, b and 1 more"
    assert failed("x", "t", "o", ["one", "two", "one"]).causes == ["one", "two"]


def test_a_leak_into_every_position_lists_them_with_the_count():
    """NeoX's inverted mask: changing the last token moves every earlier output; the
    observation lists six positions and says how many more there are."""
    report = _audit("NeoXStyleAttention", mask_bug=True)
    assert "and 9 more (15 in all)" in report["causal"].observed, report["causal"].observed
