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


def test_a_missing_scale_is_named_where_the_source_mentions_rotation():
    """x-transformers' Attention: its source rotates when given rotary frequencies (None
    here), so the rotary layouts lead; the plain layout is tried too, and the missing scale
    is named, not the inverted_attention flag that guards a masking line."""
    causes = _audit("XTransformersAttention", scale_bug=True)["reference"].causes
    assert "scale is missing" in causes[0], causes
    assert not any("inverted_attention" in cause for cause in causes), causes


class _HalvedValues(modern.XAttend):
    """A bug outside the catalogue (the output halved) behind x-transformers' flags."""

    def forward(self, q, k, v, mask=None):
        return super().forward(q, k, v, mask) * 0.5


def test_a_module_that_hides_the_future_is_not_blamed_on_its_masking_lines():
    """No classic bug fits; the masking suspects (a mask built only under a flag that is
    off) are left out of the causes, since the module leaks nothing."""
    torch.manual_seed(0)
    module = modern.XTransformersAttention().eval()
    module.attend = _HalvedValues(causal=True, scale=8**-0.5)
    report = audit(module, d_in=modern.D)
    assert report["causal"].status == "passed"
    reference = report["reference"]
    assert reference.status == "failed", reference.observed
    assert not any("inverted_attention" in cause for cause in reference.causes), reference
    assert "none of the classic bugs" in reference.causes[0], reference.causes


def test_the_swapped_convention_is_the_other_pairing_with_the_same_tables():
    """Rotary.apply(swapped=True), written out: a halves layout's tables (cat(freqs,
    freqs)) turning interleaved pairs, and a pairs layout's (repeat_interleave) turning
    halves; neither keeps the norm of a pair of features (no rotation)."""
    torch.manual_seed(0)
    x = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    angles = torch.arange(5, dtype=torch.float64)[:, None] * 100.0 ** (
        -torch.arange(0, 8, 2, dtype=torch.float64) / 8
    )
    halves_cos, halves_sin = torch.cat([angles] * 2, -1).cos(), torch.cat([angles] * 2, -1).sin()
    every_two = torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)
    expected = x * halves_cos + every_two * halves_sin
    torch.testing.assert_close(Rotary("halves", 8, 100.0).apply(x, swapped=True), expected)
    pairs_cos, pairs_sin = (
        angles.repeat_interleave(2, -1).cos(),
        angles.repeat_interleave(2, -1).sin(),
    )
    half = torch.cat((-x[..., 4:], x[..., :4]), -1)
    expected = x * pairs_cos + half * pairs_sin
    torch.testing.assert_close(Rotary("pairs", 8, 100.0).apply(x, swapped=True), expected)
    assert not torch.allclose(Rotary("halves", 8, 100.0).apply(x, swapped=True).norm(dim=-1),
                              x.norm(dim=-1))  # fmt: skip
