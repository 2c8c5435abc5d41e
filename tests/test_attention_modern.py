"""MultiHeadAttention with today's open models' options: scaled rotary (the book's Llama 3.2
freq_config), partial rotary, query/key norms per head (Qwen3, Gemma 3's 1 + weight) or
over the projection (OLMo 2), an explicit scale; against a float64 reference written out
here, decoding through both caches equal to the full forward, config and checkpoint round
trips, errors by name."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnlab
from attnlab import MultiHeadAttention
from tests.test_rope_scaling import compute_rope_params

FREQ_CONFIG = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_context_length": 16,
}


def _rms(y, weight, offset, eps):
    return y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight)


def _rotated(y, cos, sin, rotary_dim):
    """rotate-half over the first rotary_dim features, the rest passed through."""
    r, rest = y[..., :rotary_dim], y[..., rotary_dim:]
    half = rotary_dim // 2
    turned = torch.cat([-r[..., half:], r[..., :half]], dim=-1)
    return torch.cat([r * cos + turned * sin, rest], dim=-1)


def reference(m, x, options):
    """The layer in float64 from its weights: projections, norms, rotary positions (the
    book's compute_rope_params), grouped heads, causal softmax at the layer's scale."""
    w = {k: (v.double() if v is not None else None) for k, v in m.qkv_weights()._asdict().items()}
    b, t, _ = x.shape
    h, hkv, hd = m.num_heads, m.num_kv_heads, m.head_dim
    x = x.double()
    q, k, v = (x @ w[f"{n}_weight"].T for n in "qkv")  # (b, t, width)
    norm = options.get("qk_norm")
    eps, offset = options.get("qk_norm_eps", 1e-6), options.get("qk_norm_offset", 0.0)
    if norm == "projection":
        q = _rms(q, m.q_norm.weight.double(), offset, eps)
        k = _rms(k, m.k_norm.weight.double(), offset, eps)
    q, k, v = (y.view(b, t, -1, hd).transpose(1, 2) for y in (q, k, v))  # (b, heads, t, hd)
    if norm == "head":
        q = _rms(q, m.q_norm.weight.double(), offset, eps)
        k = _rms(k, m.k_norm.weight.double(), offset, eps)
    rotary_dim = options.get("rotary_dim") or hd
    cos, sin = compute_rope_params(rotary_dim, 10000.0, t, options.get("rope_scaling"))
    q, k = (
        _rotated(q, cos.double(), sin.double(), rotary_dim),
        _rotated(k, cos.double(), sin.double(), rotary_dim),
    )
    k, v = (y.repeat_interleave(h // hkv, dim=1) for y in (k, v))
    scale = options.get("scale") or 1 / math.sqrt(hd)
    scores = q @ k.transpose(-2, -1) * scale
    future = torch.ones(t, t, dtype=torch.bool).triu(1)
    heads = scores.masked_fill(future, -math.inf).softmax(-1) @ v  # (b, h, t, hd)
    out = heads.transpose(1, 2).reshape(b, t, h * hd)
    return out @ m.out_proj.weight.double().T + m.out_proj.bias.double()


OPTIONS = {
    "qwen3": {"qk_norm": "head"},
    "gemma 3": {"qk_norm": "head", "qk_norm_offset": 1.0, "scale": 0.125},
    "olmo 2": {"qk_norm": "projection", "qk_norm_eps": 1e-5},
    "llama 3.2": {"rope_scaling": FREQ_CONFIG},
    "partial rotary": {"rotary_dim": 8},
    "everything": {
        "qk_norm": "head",
        "rope_scaling": FREQ_CONFIG,
        "rotary_dim": 8,
        "scale": 0.3,
    },
}


def _module(options, kv_heads=2, seed=0):
    torch.manual_seed(seed)
    m = MultiHeadAttention(16, 64, 48, 0.0, 4, num_kv_heads=kv_heads, rope=True, **options)
    with torch.no_grad():  # norms away from their identity start
        for name in ("q_norm", "k_norm"):
            if hasattr(m, name):
                getattr(m, name).weight.normal_(0.5, 0.3)
    return m.eval()


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_the_layer_equals_the_float64_reference(name):
    options = OPTIONS[name]
    m = _module(options)
    x = torch.randn(2, 40, 16)
    with torch.no_grad():
        got = m(x)
    torch.testing.assert_close(got.double(), reference(m, x, options), atol=2e-5, rtol=1e-4)
    plain = _module({})
    with torch.no_grad():
        assert (got - plain(x)).abs().max() > 1e-3  # the option changes the output


@given(
    name=st.sampled_from(sorted(OPTIONS)),
    kv_heads=st.sampled_from([1, 2, 4]),
    chunks=st.lists(st.integers(1, 9), min_size=1, max_size=5),
    static=st.booleans(),
)
def test_decoding_equals_the_full_forward(name, kv_heads, chunks, static):
    m = _module(OPTIONS[name], kv_heads)
    tokens = sum(chunks)
    x = torch.randn(1, tokens, 16)
    with torch.no_grad():
        full = m(x)
        cache = m.make_cache(1, 48, static=static)
        outs, start = [], 0
        for n in chunks:
            outs.append(m(x[:, start : start + n], cache=cache))
            start += n
    torch.testing.assert_close(torch.cat(outs, dim=1), full, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_config_and_checkpoint_round_trips(name, tmp_path):
    m = _module(OPTIONS[name])
    twin = MultiHeadAttention(**m.config)
    twin.load_state_dict(m.state_dict())
    path = tmp_path / "layer.safetensors"
    attnlab.save(m, path)
    loaded = attnlab.load(path).eval()
    x = torch.randn(1, 7, 16)
    with torch.no_grad():
        want = m(x)
        torch.testing.assert_close(twin.eval()(x), want)
        torch.testing.assert_close(loaded(x), want)
    assert loaded.config == m.config


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"qk_norm": "heads"}, ValueError, "qk_norm must be None, 'head' or 'projection'"),
        ({"qk_norm": "head", "qk_norm_eps": 0.0}, ValueError, "qk_norm_eps"),
        ({"scale": -1.0}, ValueError, "scale"),
        ({"rope": False, "rope_scaling": FREQ_CONFIG}, ValueError, "need rope=True"),
        ({"rotary_dim": 7}, ValueError, "rotary_dim"),
        ({"rope_scaling": {"rope_type": "longrope"}}, ValueError, "longrope"),
    ],
)
def test_an_option_that_does_not_fit_is_refused_by_name(options, error, message):
    arguments = {"rope": True, **options}
    with pytest.raises(error, match=message):
        MultiHeadAttention(16, 64, 48, 0.0, 4, **arguments)
