"""What the swaps of today's open models carry over, each where it shows (examples/llama32.py,
qwen3.py, gemma3.py; test_recipes.py runs them as the docs show them): Llama 3.2's scaled
rotary tables, the SDPA variant's call without a mask, Qwen3's norms per head and its heads
wider than the model, Gemma 3's windows, bases, scale and 1 + weight norms; and the layers
the swap refuses when it is called, by name, with the model left as it was."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnlab import MultiHeadAttention
from attnlab.interop import llama, make_caches
from tests.examples.test_recipes import load

l32, qw, gm = load("llama32"), load("qwen3"), load("gemma3")
L32, QW, GM = l32.LLAMA32_CONFIG_TINY, qw.QWEN3_CONFIG_TINY, gm.GEMMA3_CONFIG_TINY


def _swapped(example, model_class, cfg, noise=0.2):
    """(original, swapped) in eval, the original's norms moved off their start."""
    torch.manual_seed(0)
    original = model_class(cfg).eval()
    with torch.no_grad():
        for name, parameter in original.named_parameters():
            if "norm" in name:
                parameter.add_(noise * torch.randn_like(parameter))
    return original, example.swapped_copy(original, cfg).eval()


def _attnlab_layers(model) -> list:
    return [m for m in model.modules() if isinstance(m, MultiHeadAttention)]


def test_llama32_tables_are_scaled_and_a_swap_without_the_scaling_is_refused():
    head_dim = L32["emb_dim"] // L32["n_heads"]
    scaled, sin = l32.compute_rope_params(head_dim, L32["rope_base"], 64, L32["rope_freq"])
    _, plain = l32.compute_rope_params(head_dim, L32["rope_base"], 64)
    assert (sin - plain).abs().max() > 1e-2  # the scaling shows at these sizes
    torch.manual_seed(0)
    model = l32.Llama3Model(L32)
    with pytest.raises(ValueError, match="another base, a frequency scaling"):
        llama.swap(model, rope_base=L32["rope_base"])  # the freq_config left out
    assert not _attnlab_layers(model)  # nothing replaced
    assert llama.swap(model, rope_base=L32["rope_base"], rope_scaling=L32["rope_freq"]) == 2
    rope = model.trf_blocks[0].att.attention.rope
    torch.testing.assert_close(rope.cos, scaled, rtol=0, atol=1e-5)


def test_llama32_swaps_with_transformers_rope_scaling_dict_too():
    hf_form = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    original, _ = _swapped(l32, l32.Llama3Model, L32)
    model = l32.Llama3Model(L32).eval()
    llama.swap(model, rope_base=L32["rope_base"], rope_scaling=hf_form)
    model.load_state_dict(llama.from_llama_state(original.state_dict()))
    idx = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), original(idx), rtol=1e-5, atol=1e-5)


def test_the_fast_variants_call_without_a_mask_is_wrapped():
    original, model = _swapped(l32, l32.Llama3ModelFast, L32)
    att, theirs = model.trf_blocks[0].att, original.trf_blocks[0].att
    assert att.call == ("cos", "sin")
    x = torch.randn(2, 9, L32["emb_dim"], generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = theirs(x, original.cos, original.sin)
        torch.testing.assert_close(att(x, model.cos, model.sin), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(att(x, cos=model.cos, sin=model.sin), want, rtol=1e-5, atol=1e-5)
        mask = torch.ones(9, 9, dtype=torch.bool).triu(1)
        with pytest.raises(TypeError, match=r"takes x and 2 more arguments \(cos, sin\)"):
            att(x, mask, model.cos, model.sin)  # the book's other call: not this layer's
        with pytest.raises(TypeError, match="unexpected argument 'mask'"):
            att(x, model.cos, model.sin, mask=mask)


class Positions(l32.GroupedQueryAttention):
    def forward(self, x, mask, cos, sin, positions):
        return super().forward(x, mask, cos, sin)


class Variadic(l32.GroupedQueryAttention):
    def forward(self, x, *args):
        return super().forward(x, *args)


class NoTables(l32.GroupedQueryAttention):
    def forward(self, x, mask):
        raise AssertionError("never called")


@pytest.mark.parametrize(
    ("layer_class", "named"),
    [
        (Positions, r"Positions.forward\(x, mask, cos, sin, positions\).*'positions' unknown"),
        (Variadic, r"Variadic.forward\(x, \*args\) takes \*args"),
        (NoTables, r"NoTables.forward\(x, mask\) takes \(x, mask\)"),
    ],
)
def test_a_call_the_swap_does_not_wrap_is_refused_at_swap_time_by_name(layer_class, named):
    torch.manual_seed(0)
    model = l32.Llama3Model(L32)
    model.trf_blocks[1].att = layer_class(L32["emb_dim"], L32["emb_dim"], 4, 2)
    before = model.trf_blocks[0].att
    with pytest.raises(ValueError, match=named):
        llama.swap(model, rope_base=L32["rope_base"], rope_scaling=L32["rope_freq"])
    assert model.trf_blocks[0].att is before and not _attnlab_layers(model)


def test_qwen3_norms_are_carried_per_head_with_their_weights_and_wide_heads():
    original, model = _swapped(qw, qw.Qwen3Model, QW)
    for block, theirs in zip(model.trf_blocks, original.trf_blocks, strict=True):
        attention = block.att.attention
        assert (attention.qk_norm, attention.qk_norm_offset) == ("head", 0.0)
        assert attention.qk_norm_eps == 1e-6
        assert torch.equal(attention.q_norm.weight, theirs.att.q_norm.scale)
        assert torch.equal(attention.k_norm.weight, theirs.att.k_norm.scale)
        assert attention.out_proj.weight.shape == (QW["emb_dim"], 4 * QW["head_dim"])
    x = torch.randn(2, 9, QW["emb_dim"], generator=torch.Generator().manual_seed(2))
    mask = torch.ones(9, 9, dtype=torch.bool).triu(1)
    with torch.no_grad():
        want = original.trf_blocks[1].att(x, mask, original.cos, original.sin)
        got = model.trf_blocks[1].att(x, mask, model.cos, model.sin)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_qwen3_without_qk_norm_swaps_as_a_llama():
    cfg = {**QW, "qk_norm": False}
    original, model = _swapped(qw, qw.Qwen3Model, cfg)
    assert all(layer.qk_norm is None for layer in _attnlab_layers(model))
    idx = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), original(idx), rtol=1e-5, atol=1e-5)


def test_a_norm_holding_a_shift_is_refused_by_name():
    layer = qw.GroupedQueryAttention(32, 4, 2, head_dim=16, qk_norm=True)
    layer.q_norm = qw.RMSNorm(16, bias=True)
    with pytest.raises(ValueError, match=r"submodule q_norm \(RMSNorm\) holds parameter shift"):
        llama.from_llama_attention(layer, 64, QW["rope_base"])


def test_gemma3_layers_keep_their_window_base_scale_and_norm_convention():
    _, model = _swapped(gm, gm.Gemma3Model, GM)
    for block, kind in zip(model.blocks, GM["layer_types"], strict=True):
        attention = block.att.attention
        local = kind == "sliding_attention"
        assert attention.window == (GM["sliding_window"] if local else None)
        assert attention.rope_base == (GM["rope_local_base"] if local else GM["rope_base"])
        assert attention.scale == pytest.approx(GM["query_pre_attn_scalar"] ** -0.5, rel=1e-12)
        assert (attention.qk_norm, attention.qk_norm_offset) == ("head", 1.0)
    caches = make_caches(model, 1, 40)
    assert [cache.window for cache in caches] == [4, 4, None]  # the sliding layers roll


def test_a_sliding_layer_refuses_a_mask_past_its_window_and_the_global_tables():
    original, model = _swapped(gm, gm.Gemma3Model, GM)
    att, theirs = model.blocks[0].att, original.blocks[0].att
    x = torch.randn(2, 9, GM["emb_dim"], generator=torch.Generator().manual_seed(2))
    mask_global, mask_local = model._create_masks(9, x.device)
    with torch.no_grad():
        want = theirs(x, mask_local, original.cos_local, original.sin_local)
        got = att(x, mask_local, model.cos_local, model.sin_local)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="outside its window of 4 keys"):
            att(x, mask_global, model.cos_local, model.sin_local)
        with pytest.raises(ValueError, match="rotary cos table differs"):
            att(x, mask_local, model.cos_global, model.sin_global)


def test_a_scale_other_than_the_layers_is_refused_by_the_probe():
    torch.manual_seed(0)
    layer = gm.GroupedQueryAttention(32, 4, 2, head_dim=16, qk_norm=True, query_pre_attn_scalar=24)
    with pytest.raises(ValueError, match=r"GroupedQueryAttention and its swap differ by .* probe"):
        llama.from_llama_attention(layer, 64, GM["rope_base"], scale=16**-0.5)
    swapped = llama.from_llama_attention(layer, 64, GM["rope_base"])
    assert swapped.attention.scale == pytest.approx(24**-0.5, rel=1e-12)


class _Halved(nn.Module):
    """A norm with one weight that computes neither convention."""

    def __init__(self, dim):
        super().__init__()
        self.eps = 1e-6
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return 0.5 * x * self.weight


def test_a_norm_of_another_computation_is_refused_by_name():
    layer = gm.GroupedQueryAttention(32, 4, 2, head_dim=16, qk_norm=True)
    layer.k_norm = _Halved(16)
    with pytest.raises(ValueError, match=r"submodule k_norm \(_Halved\) computes neither"):
        llama.from_llama_attention(layer, 64, GM["rope_base"])


ml = load("mla")
ML = ml.MLA_CONFIG_TINY


def test_the_mla_cache_holds_the_books_latents_and_nothing_per_head():
    """attnlab's LatentCache after a cached generation holds, per token and layer, the
    latent_dim values the book's own cache holds: the same values."""
    original, model = _swapped(ml, ml.GPTModel, ML)
    idx = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    want = ml.generate_text_simple_cached(original, idx, 9)  # the book's cache
    caches = ml.make_caches(model, 2, 16)
    with torch.no_grad():
        ml.forward_cached(model, want, caches)  # the tokens the book's loop fed, at once
    for cache, block in zip(caches, original.trf_blocks, strict=True):
        assert cache.width == ML["latent_dim"]  # no rotary key, no head
        assert cache.bytes_per_token == ML["latent_dim"] * 4 * 2  # float32, 2 sequences
        torch.testing.assert_close(cache.latents, block.att.cache_c_kv, rtol=1e-5, atol=1e-5)


def test_the_books_own_cached_generation_runs_on_the_swapped_model():
    original, model = _swapped(ml, ml.GPTModel, ML)
    idx = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    want = ml.generate_text_simple_cached(original, idx, 12)
    assert torch.equal(ml.generate_text_simple_cached(model, idx, 12), want)
    assert torch.equal(ml.generate_text_simple_cached(model, idx, 12), want)  # reset


def test_the_mla_state_maps_are_inverse_and_a_biased_up_projection_is_refused():
    original, _ = _swapped(ml, ml.GPTModel, ML)
    state = original.state_dict()
    back = ml.to_mla_state(ml.from_mla_state(state, ML["n_heads"]), ML["n_heads"])
    assert back.keys() == state.keys() and all(torch.equal(back[k], v) for k, v in state.items())
    layer = ml.MultiHeadLatentAttention(32, 32, 0.0, 4, qkv_bias=True, latent_dim=8)
    with pytest.raises(ValueError, match="qkv_bias: attnlab's MLA"):
        ml.from_book_mla(layer, 64)
