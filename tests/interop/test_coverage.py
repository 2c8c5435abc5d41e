"""attnlab.interop.coverage (scripts/hf_coverage.py writes docs/hf-coverage.md): a slice of
the installed transformers' architectures, built small with eager and with attnlab."""

import pytest

pytest.importorskip("transformers", reason="transformers is the optional extra attnlab[hf]")

from attnlab import functional
from attnlab.interop import coverage, hf

hf.register()

# The coverage tool (scripts/hf_coverage.py writes docs/hf-coverage.md) on a slice: model
# type -> (kind, status, a piece of the detail).

SLICE = {
    "gpt2": ("causal", "equal", ""),
    "llama": ("causal", "equal", ""),
    "mistral": ("causal", "equal", ""),
    "gptj": ("causal", None, ""),  # moved onto the interface in 5.24: status probed
    "bert": ("masked", "equal", ""),
    "modernbert": ("masked", "equal", ""),
    "bart": ("seq2seq", "equal", ""),  # the encoder-decoder, not BartForCausalLM
    "t5": ("seq2seq", "equal", ""),  # position_bias, added to the mask
    "whisper": ("speech", "equal", ""),  # input_features, not WhisperForCausalLM
    "vit": ("image", "equal", ""),
    "dinov2": ("image", "equal", ""),
    "deit": ("image", "equal", ""),  # two classes in the auto mapping
    "levit": ("image", "refused", "LevitAttention"),  # with its default patch size
    "poolformer": ("image", "refused", "_supports_sdpa is False"),  # no attention at all
    "clip": ("image-text", "equal", ""),  # causal text tower with padding
    "siglip": ("image-text", "equal", ""),
    "bloom": ("causal", "refused", "BloomAttention"),
    "gpt_oss": ("causal", "equal", ""),  # s_aux: attention sinks
    "gemma2": ("causal", "equal", ""),  # softcap
    "nllb-moe": ("seq2seq", "refused", "_supports_sdpa is False"),  # decoder not causal
    "deepseek_v4": ("causal", "refused", "_supports_sdpa is False"),  # float bias padding
}


@pytest.mark.parametrize("model_type", sorted(SLICE))
def test_coverage_slice(model_type):
    row = coverage.compare(model_type)
    kind, status, reason = SLICE[model_type]
    if status is None:  # what the installed transformers does, found by watching a forward
        from tests.interop.test_hf import _attention_outside_the_interface

        bypasses = _attention_outside_the_interface(model_type)
        status, reason = ("refused", "without") if bypasses else ("equal", "")
    assert (row.architecture, row.kind, row.status) == (model_type, kind, status), row
    assert reason in row.detail
    if status == "equal":
        assert row.max_diff <= coverage.TOLERANCE and row.detail == ""
    assert f"| {model_type} | {kind} | {status}" in coverage.table([row])


def test_the_architectures_cover_each_kind():
    """Every kind of head has architectures, each of the slice is listed once, and an
    architecture in several auto mappings is tried with its most complete model first."""
    types = coverage.architectures()
    assert len(types) == len(set(types)) and set(SLICE) <= set(types)
    assert {coverage.kinds_of(t)[0] for t in types} == set(coverage.KINDS)
    assert coverage.kinds_of("whisper") == ["speech", "causal"]
    assert coverage.kinds_of("bart") == ["seq2seq", "masked", "causal"]
    assert coverage.kinds_of("clip") == ["image-text", "image"]
    with pytest.raises(ValueError, match=r"model_type \('no-such-model'\)"):
        coverage.kinds_of("no-such-model")
    with pytest.raises(ValueError, match=r"kind \('image'\) must be one of"):
        coverage.compare("gpt2", "image")


def test_a_kind_that_cannot_build_gives_way_to_the_next(monkeypatch):
    """Whisper without speech features to give is compared as its next kind (its decoder, a
    causal LM); a kind asked for is the one compared."""

    def no_features(config):
        raise AttributeError("no features")

    monkeypatch.setattr(coverage, "_features", no_features)
    row = coverage.compare("whisper", "speech")
    assert (row.kind, row.status, row.detail) == (
        "speech",
        "cannot build",
        "AttributeError: no features",
    )
    row = coverage.compare("whisper")
    assert (row.kind, row.status) == ("causal", "equal"), row


def test_a_model_without_attention_on_the_interface_is_not_called(monkeypatch):
    """A model attnlab never runs is "not called", not "equal": PoolFormer, let past the
    refusal of models without SDPA support."""
    monkeypatch.setattr(hf, "_refuse_without_sdpa", lambda model_class: None)
    row = coverage.compare("poolformer")
    assert (row.status, row.detail) == ("not called", "no attention on transformers' interface")
    assert row.max_diff <= coverage.TOLERANCE


def test_coverage_catches_a_wrong_attention(monkeypatch):
    """The comparison can fail: attnlab losing its mask differs from eager."""
    arguments = hf.attention_arguments

    def no_mask(*args):
        return arguments(*args) | {"mask": None}

    monkeypatch.setattr(hf, "attention_arguments", no_mask)
    row = coverage.compare("gpt2")
    assert row.status == "differs" and "left padding" in row.detail, row


@pytest.mark.parametrize(
    ("model_type", "compared"),
    [("vit", "logits"), ("clip", "logits"), ("whisper", "logits"), ("modernbert", "logits")],
)
def test_coverage_catches_a_wrong_output(monkeypatch, model_type, compared):
    """A vision, a vision-text, a speech and an encoder-only row differ when attnlab's
    attention output is three times what it should be."""
    attention = functional.attention

    def tripled(*args, **kwargs):
        result = attention(*args, **kwargs)
        if isinstance(result, tuple):  # (output, weights)
            return result[0] * 3, result[1]
        return result * 3

    monkeypatch.setattr(functional, "attention", tripled)
    row = coverage.compare(model_type)
    assert row.status == "differs" and compared in row.detail, row


def test_a_model_built_with_another_implementation_differs(monkeypatch):
    """A model built with attnlab that runs another implementation (here from_config
    swapping it for SDPA) is a difference with its reason, never an equal row."""
    import transformers

    build = transformers.AutoModelForImageClassification.from_config

    def sdpa_instead(config, **kwargs):
        if kwargs.get("attn_implementation") == "attnlab":
            kwargs["attn_implementation"] = "sdpa"
        return build(config, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForImageClassification, "from_config", sdpa_instead)
    row = coverage.compare("vit")
    assert row.status == "differs" and "'sdpa'" in row.detail, row


def test_each_model_gets_its_own_config(monkeypatch):
    """from_config writes the implementation into the config it is given: without a copy
    per model, building the attnlab model turns the reference into an attnlab model too."""
    monkeypatch.setattr(coverage, "deepcopy", lambda config: config)
    row = coverage.compare("gpt2")
    assert row.status == "error" and "the reference" in row.detail, row
    assert "GPT2Config: 'attnlab'" in row.detail
