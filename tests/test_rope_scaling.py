"""attnlab.rope_scaling: Llama 3's, linear and YaRN frequencies equal transformers' own
rope initialisation for the same parameters, and the book's compute_rope_params with its
freq_config; partial rotary rotates only the first features; errors name the key."""

import math

import pytest
import torch

from attnlab import rope_scaling
from attnlab.rope import RotaryEmbedding, rotary_tables

transformers = pytest.importorskip("transformers", reason="the references are transformers'")
from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
LINEAR = {"rope_type": "linear", "factor": 4.0}
YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096}
YARN_DEEPSEEK = {**YARN, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
YARN_FACTOR = {**YARN, "attention_factor": 0.8, "beta_fast": 16.0, "truncate": False}
CASES = {
    "llama3": LLAMA3,
    "linear": LINEAR,
    "yarn": YARN,
    "yarn, deepseek": YARN_DEEPSEEK,
    "yarn, given factor": YARN_FACTOR,
}


def _transformers(scaling, head_dim, base, partial=1.0):
    config = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        max_position_embeddings=131072,
        rope_parameters={"rope_theta": base, "partial_rotary_factor": partial, **scaling},
    )
    return ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, torch.device("cpu"))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_frequencies_and_factor_equal_transformers(case, head_dim):
    scaling = CASES[case]
    base = 500000.0
    want, want_factor = _transformers(scaling, head_dim, base)
    got, factor = rope_scaling.inverse_frequencies(
        head_dim, base, rope_scaling.check_scaling(scaling)
    )
    torch.testing.assert_close(got.float(), want, rtol=2e-6, atol=0)
    assert factor == pytest.approx(want_factor, rel=1e-12)
    plain = base ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    assert not torch.allclose(got, plain)  # the scaling changes the frequencies


def test_the_tables_carry_the_factor_and_rotate_as_transformers_llama():
    """cos/sin at positions past the original context, as transformers' rotary embedding
    computes them (its forward, with attention_scaling)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=16384,
        rope_parameters={"rope_theta": 10000.0, **YARN},
    )
    theirs = LlamaRotaryEmbedding(config)
    positions = torch.tensor([[0, 1, 5000, 9000, 16383]])
    want_cos, want_sin = theirs(torch.zeros(1, 1, 64), positions)
    cos, sin = rotary_tables(64, 16384, 10000.0, scaling=YARN)
    torch.testing.assert_close(cos[positions[0]], want_cos[0], atol=2e-3, rtol=0)
    torch.testing.assert_close(sin[positions[0]], want_sin[0], atol=2e-3, rtol=0)


def compute_rope_params(head_dim, theta_base=10_000, context_length=4096, freq_config=None):
    """The book's Llama 3.2 rotary parameters (bonus chapter), rewritten from its text:
    inverse frequencies, adjusted by freq_config's smooth schedule, angles, cos and sin."""
    inv_freq = 1.0 / (
        theta_base ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim)
    )
    if freq_config is not None:
        low_wavelen = freq_config["original_context_length"] / freq_config["low_freq_factor"]
        high_wavelen = freq_config["original_context_length"] / freq_config["high_freq_factor"]
        wavelen = 2 * torch.pi / inv_freq
        adjusted = torch.where(wavelen > low_wavelen, inv_freq / freq_config["factor"], inv_freq)
        smooth = (
            freq_config["original_context_length"] / wavelen - freq_config["low_freq_factor"]
        ) / (freq_config["high_freq_factor"] - freq_config["low_freq_factor"])
        smoothed = (1 - smooth) * (inv_freq / freq_config["factor"]) + smooth * inv_freq
        medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv_freq = torch.where(medium, smoothed, adjusted)
    positions = torch.arange(context_length)
    angles = positions[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=1)
    return torch.cos(angles), torch.sin(angles)


def test_the_books_freq_config_gives_the_books_tables():
    freq_config = {
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_context_length": 8192,
    }
    want_cos, want_sin = compute_rope_params(64, 500_000.0, 2048, freq_config)
    rope = RotaryEmbedding(64, 2048, 500_000.0, scaling=freq_config)
    assert rope.scaling == {**LLAMA3}
    torch.testing.assert_close(rope.cos, want_cos, atol=2e-4, rtol=0)
    torch.testing.assert_close(rope.sin, want_sin, atol=2e-4, rtol=0)
    plain_cos, _ = compute_rope_params(64, 500_000.0, 2048)
    assert (rope.cos - plain_cos).abs().max() > 0.1  # the schedule changes the tables


def test_partial_rotary_rotates_the_first_features_as_transformers():
    """transformers' partial_rotary_factor: the first rotary_dim features rotated (its
    rotate-half over them), the rest passed through."""
    want, _ = _transformers(LINEAR, 64, 10000.0, partial=0.5)
    got, _ = rope_scaling.inverse_frequencies(32, 10000.0, rope_scaling.check_scaling(LINEAR))
    torch.testing.assert_close(got.float(), want, rtol=2e-6, atol=0)
    rope = RotaryEmbedding(64, 16, rotary_dim=32)
    x = torch.randn(1, 2, 5, 64)
    out = rope(x, 3)
    assert torch.equal(out[..., 32:], x[..., 32:])
    full = RotaryEmbedding(32, 16)
    torch.testing.assert_close(out[..., :32], full(x[..., :32].contiguous(), 3))
    angle = 3 * 1.0  # position 3, the first pair's frequency is base^0 = 1
    turned = x[..., 0, 0] * math.cos(angle) - x[..., 0, 16] * math.sin(angle)
    torch.testing.assert_close(out[..., 0, 0], turned, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("scaling", "error", "message"),
    [
        ({"rope_type": "dynamic", "factor": 2.0}, ValueError, "rope_type 'dynamic'"),
        ({"rope_type": "linear"}, ValueError, r"needs \['factor'\]"),
        (
            {"rope_type": "linear", "factor": 2.0, "fctor": 1},
            ValueError,
            r"unknown keys \['fctor'\]",
        ),
        ({"rope_type": "linear", "factor": -1.0}, ValueError, "positive finite"),
        ({"rope_type": "linear", "factor": "2"}, TypeError, "must be a number, got str"),
        ({**LLAMA3, "high_freq_factor": 1.0}, ValueError, "high_freq_factor"),
        ([("rope_type", "linear")], TypeError, "must be a dict or None, got list"),
    ],
)
def test_a_scaling_attnlab_does_not_compute_is_refused_by_name(scaling, error, message):
    with pytest.raises(error, match=message):
        RotaryEmbedding(64, 16, scaling=scaling)


def test_the_default_type_and_none_are_plain_rope():
    assert rope_scaling.check_scaling({"rope_type": "default", "rope_theta": 1e4}) is None
    plain, default = RotaryEmbedding(8, 4), RotaryEmbedding(8, 4, scaling={"type": "default"})
    assert torch.equal(plain.cos, default.cos)
    with pytest.raises(ValueError, match=r"rotary_dim \(10\) must be at most head_dim \(8\)"):
        RotaryEmbedding(8, 4, rotary_dim=10)


def test_a_zero_mscale_is_read_as_absent_as_transformers_reads_it():
    scaling = {**YARN, "mscale": 0, "mscale_all_dim": 0}
    assert rope_scaling.check_scaling(scaling) == rope_scaling.check_scaling(YARN)
    want, want_factor = _transformers(scaling, 64, 10000.0)
    got, factor = rope_scaling.inverse_frequencies(64, 10000.0, rope_scaling.check_scaling(scaling))
    torch.testing.assert_close(got.float(), want, rtol=2e-6, atol=0)
    assert factor == pytest.approx(want_factor)
