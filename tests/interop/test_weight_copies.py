"""Every weight copy of the swaps and conversions, seen by its outputs (issue 37, item 17):
an in-place swap, without reloading the state dict afterwards, keeps the model's logits
(a reload overwrites whatever the swap copied, right or wrong); conversions with
transformers' layers carry every bias, set non-zero here (transformers initialises them to
zero, so a bias left behind would otherwise go unseen). scripts/mutants.py reorders, drops
and transposes each copy and runs these tests against it."""

from dataclasses import replace

import pytest
import torch
from torch import nn

from attnlab.interop import llama, nanogpt
from tests.examples.test_recipes import load


def _random_biases(model: nn.Module) -> None:
    """Every bias of every Linear drawn from N(0, 0.5) (nanoGPT and transformers start them
    at zero)."""
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, nn.Linear) and layer.bias is not None:
                layer.bias.normal_(0.0, 0.5)


@pytest.mark.parametrize("bias", [True, False])
def test_an_in_place_nanogpt_swap_keeps_the_models_logits(bias):
    ex = load("nanogpt")
    torch.manual_seed(0)
    config = replace(ex.GPTConfig(), bias=bias)
    model = ex.GPT(config).eval()
    _random_biases(model)
    idx = torch.randint(0, config.vocab_size, (2, 9))
    with torch.no_grad():
        want, _ = model(idx, idx)  # with targets: the logits of every position
        assert nanogpt.swap(model) == config.n_layer
        got, _ = model(idx, idx)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_an_in_place_llama_swap_keeps_the_models_logits():
    ex = load("llama")
    torch.manual_seed(0)
    cfg = ex.LLAMA_CONFIG_TINY
    model = ex.Llama(cfg).eval()
    idx = torch.randint(0, cfg["vocab_size"], (2, 9))
    with torch.no_grad():
        want = model(idx)
        assert llama.swap(model, rope_base=cfg["rope_base"]) == cfg["n_layers"]
        got = model(idx)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _transformers_layers(kind, **options):
    """Two attention layers (eval mode) of a small transformers model of tests/interop/
    test_hf.py's config `kind`, with `options` set, the first one's biases random."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from tests.interop.test_hf import CONFIGS

    config = CONFIGS[kind]()
    for name, value in options.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    blocks = model.transformer.h if kind == "gpt2" else model.model.layers
    layers = [block.attn if kind == "gpt2" else block.self_attn for block in blocks]
    with torch.no_grad():  # GPT-2's Conv1D and Llama's Linear projections alike
        for name, tensor in layers[0].named_parameters():
            if name.endswith("bias"):
                tensor.normal_(0.0, 0.5)
    return model, *layers


def _assert_same_state(got: nn.Module, want: nn.Module) -> None:
    for name, tensor in want.state_dict().items():
        torch.testing.assert_close(got.state_dict()[name], tensor, rtol=0, atol=0, msg=name)


def test_gpt2_attention_converts_both_ways_with_every_bias():
    from attnlab.interop import hf
    from tests.interop.test_hf import _causal_float_mask

    _, layer, other = _transformers_layers("gpt2")
    module = hf.from_gpt2_attention(layer).eval()
    x = torch.randn(2, 9, 64)
    with torch.no_grad():
        expected, _ = layer(x, attention_mask=_causal_float_mask(9))
        torch.testing.assert_close(module(x), expected, atol=1e-5, rtol=1e-5)
    hf.to_gpt2_attention(module, other)
    _assert_same_state(other, layer)


def test_llama_attention_with_biases_converts_both_ways():
    """Llama's attention_bias=True: q, k, v and o projections with biases."""
    from attnlab.interop import hf
    from tests.interop.test_hf import _causal_float_mask

    model, layer, other = _transformers_layers("llama", attention_bias=True)
    assert layer.o_proj.bias is not None
    module = hf.from_llama_attention(layer).eval()
    x = torch.randn(2, 9, 64)
    rotary = type(model.model.rotary_emb)(model.config)
    cos_sin = rotary(x, torch.arange(9).expand(2, 9))
    with torch.no_grad():
        expected, _ = layer(x, position_embeddings=cos_sin, attention_mask=_causal_float_mask(9))
        torch.testing.assert_close(module(x), expected, atol=1e-5, rtol=1e-5)
    hf.to_llama_attention(module, other)
    _assert_same_state(other, layer)
