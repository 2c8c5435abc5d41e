"""attnlab.interop.hf: attnlab as transformers' attention implementation (same logits as
"eager" for GPT-2 and a Llama-family model, left padding, generate() with its cache,
output_attentions), and weight conversion with GPT2Attention and Llama attention layers.
Small configs with random weights: nothing is downloaded."""

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is the optional extra attnlab[hf]"
)
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig  # noqa: E402

from attnlab import MultiHeadAttention  # noqa: E402
from attnlab.interop import hf  # noqa: E402

hf.register()

CONFIGS = {
    "gpt2": lambda: GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=100,
        n_positions=128,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    ),
    "llama": lambda: LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    ),
}


def _pair(kind):
    """An eager model and an attnlab one with the same random weights."""
    torch.manual_seed(0)
    config = CONFIGS[kind]()
    eager = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    ours = AutoModelForCausalLM.from_config(config, attn_implementation="attnlab").eval()
    ours.load_state_dict(eager.state_dict())
    assert ours.config._attn_implementation == "attnlab"
    return eager, ours


def _left_padded(batch=3, tokens=40):
    ids = torch.randint(1, 100, (batch, tokens), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(batch, tokens, dtype=torch.long)
    mask[1, :7], mask[2, :25] = 0, 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_logits_equal_eager(kind):
    eager, ours = _pair(kind)
    ids, _ = _left_padded()
    with torch.no_grad():  # 40 tokens, no mask: attnlab's causal kernel on the CPU
        torch.testing.assert_close(ours(ids).logits, eager(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_left_padded_batch_equals_eager_on_real_tokens(kind):
    eager, ours = _pair(kind)
    ids, mask = _left_padded()
    with torch.no_grad():
        expected = eager(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_generate_with_its_cache_equals_eager(kind):
    eager, ours = _pair(kind)
    ids, mask = _left_padded(tokens=12)
    options = dict(attention_mask=mask, max_new_tokens=10, do_sample=False)
    options |= dict(output_scores=True, return_dict_in_generate=True)
    expected, got = eager.generate(ids, **options), ours.generate(ids, **options)
    assert torch.equal(got.sequences, expected.sequences)
    for ours_step, eager_step in zip(got.scores, expected.scores, strict=True):
        torch.testing.assert_close(ours_step, eager_step, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_output_attentions(kind):
    eager, ours = _pair(kind)
    ids, mask = _left_padded(tokens=20)
    with torch.no_grad():
        expected = eager(ids, attention_mask=mask, output_attentions=True).attentions
        got = ours(ids, attention_mask=mask, output_attentions=True).attentions
    assert len(got) == len(expected) == 2
    real = mask.bool()[:, None, :, None]  # rows of real query tokens
    for layer, reference in zip(got, expected, strict=True):
        assert layer.shape == (3, 4, 20, 20)
        torch.testing.assert_close(
            layer.masked_fill(~real, 0), reference.masked_fill(~real, 0), atol=1e-5, rtol=1e-5
        )


def _causal_float_mask(tokens):
    future = torch.ones(tokens, tokens, dtype=torch.bool).triu(1)
    return torch.zeros(1, 1, tokens, tokens).masked_fill(future, torch.finfo(torch.float32).min)


def test_gpt2_attention_converts_both_ways():
    eager, _ = _pair("gpt2")
    layer = eager.transformer.h[0].attn
    module = hf.from_gpt2_attention(layer).eval()
    x = torch.randn(2, 9, 64)
    with torch.no_grad():
        expected, _ = layer(x, attention_mask=_causal_float_mask(9))
        torch.testing.assert_close(module(x), expected, atol=1e-5, rtol=1e-5)
    other = eager.transformer.h[1].attn
    hf.to_gpt2_attention(module, other)
    for name in ("c_attn", "c_proj"):
        assert torch.equal(getattr(other, name).weight, getattr(layer, name).weight)
        assert torch.equal(getattr(other, name).bias, getattr(layer, name).bias)


def test_llama_attention_converts_both_ways():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    eager, _ = _pair("llama")
    layer = eager.model.layers[0].self_attn
    module = hf.from_llama_attention(layer).eval()
    assert (module.num_heads, module.num_kv_heads) == (4, 2) and module.rope is not None
    x = torch.randn(2, 9, 64)
    positions = torch.arange(9).expand(2, 9)
    cos_sin = LlamaRotaryEmbedding(eager.config)(x, positions)
    with torch.no_grad():
        expected, _ = layer(x, position_embeddings=cos_sin, attention_mask=_causal_float_mask(9))
        torch.testing.assert_close(module(x), expected, atol=1e-5, rtol=1e-5)
    other = eager.model.layers[1].self_attn
    hf.to_llama_attention(module, other)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert torch.equal(getattr(other, name).weight, getattr(layer, name).weight)


def test_conversion_errors():
    eager, _ = _pair("gpt2")
    with pytest.raises(TypeError, match="GPT2Attention"):
        hf.from_gpt2_attention(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="GPT2Attention has 4 heads"):
        hf.to_gpt2_attention(MultiHeadAttention(64, 64, 16, 0.0, 2), eager.transformer.h[0].attn)
    llama, _ = _pair("llama")
    with pytest.raises(ValueError, match="does not fit this Llama"):
        hf.to_llama_attention(
            MultiHeadAttention(64, 64, 16, 0.0, 4), llama.model.layers[0].self_attn
        )
