"""attnlab.interop.nanogpt on nanoGPT's model (examples/nanogpt.py, written in its style):
what the swap keeps, the state maps both ways, and what it refuses."""

import math
from dataclasses import replace

import pytest
import torch
from torch import nn

from attnlab.interop import nanogpt
from tests.examples.test_recipes import load

ex = load("nanogpt")


def test_the_swap_keeps_the_scaled_init_of_c_proj_and_the_residual_dropout():
    torch.manual_seed(0)
    config = replace(ex.GPTConfig(), n_layer=8, n_embd=64, dropout=0.2)
    model = ex.GPT(config)
    c_proj = [block.attn.c_proj.weight.detach().clone() for block in model.transformer.h]
    nanogpt.swap(model)
    for block, weight in zip(model.transformer.h, c_proj, strict=True):
        assert torch.equal(block.attn.attention.out_proj.weight, weight)
        assert block.attn.resid_dropout.p == 0.2 and block.attn.attention.dropout == 0.2
    std = torch.cat([w.flatten() for w in c_proj]).std().item()
    assert std == pytest.approx(0.02 / math.sqrt(2 * config.n_layer), rel=0.1)  # not 0.02


def test_without_biases_the_projections_have_none_and_the_checkpoint_loads_strictly():
    torch.manual_seed(0)
    original = ex.GPT(replace(ex.GPTConfig(), bias=False))
    model = ex.swapped_copy(original)
    attention = model.transformer.h[0].attn.attention
    assert attention.qkv_proj.bias is None and attention.out_proj.bias is None
    idx = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(idx)[0], original.eval()(idx)[0])


def test_the_state_maps_are_inverse_and_drop_the_mask_buffer():
    torch.manual_seed(0)
    state = ex.GPT(ex.GPTConfig()).state_dict()
    with_mask = {**state, "transformer.h.0.attn.bias": torch.ones(1, 1, 64, 64).tril()}
    mapped = nanogpt.from_nanogpt_state(with_mask)
    assert "transformer.h.0.attn.attention.qkv_proj.weight" in mapped
    assert not any(key.endswith("attn.bias") for key in mapped)
    back = nanogpt.to_nanogpt_state(mapped)
    assert back.keys() == state.keys()
    assert all(back[key] is state[key] for key in state)


def test_refusals_name_what_is_missing():
    with pytest.raises(ValueError, match="holds no nanoGPT CausalSelfAttention"):
        nanogpt.swap(nn.Sequential(nn.Linear(2, 2)), block_size=8)
    model = ex.GPT(ex.GPTConfig())
    del model.config
    with pytest.raises(ValueError, match="pass block_size"):
        nanogpt.swap(model)
    with pytest.raises(TypeError, match="'resid_dropout'"):
        layer = ex.CausalSelfAttention(ex.GPTConfig())
        del layer.resid_dropout
        nanogpt.from_nanogpt_attention(layer, 64)


def test_a_variant_with_layers_of_its_own_is_refused_not_dropped():
    layer = ex.CausalSelfAttention(ex.GPTConfig())
    layer.q_norm = nn.LayerNorm(8)  # a variant's own layer, which attnlab would not compute
    with pytest.raises(
        ValueError, match=r"holds submodule q_norm \(LayerNorm\) besides c_attn, c_proj"
    ):
        nanogpt.from_nanogpt_attention(layer, 64)


def test_a_variant_with_parameterless_rotary_or_its_own_parameter_is_refused():
    layer = ex.CausalSelfAttention(ex.GPTConfig())
    layer.register_buffer("inv_freq", torch.ones(4), persistent=False)  # rotary positions
    with pytest.raises(ValueError, match="buffer inv_freq"):
        nanogpt.from_nanogpt_attention(layer, 64)
    layer = ex.CausalSelfAttention(ex.GPTConfig())
    layer.temperature = nn.Parameter(torch.ones(1))
    with pytest.raises(ValueError, match="parameter temperature"):
        nanogpt.from_nanogpt_attention(layer, 64)


def test_no_layer_to_swap_is_said_before_the_missing_config():
    with pytest.raises(ValueError, match="holds no nanoGPT CausalSelfAttention"):
        nanogpt.swap(nn.Sequential(nn.Linear(4, 4)))
