"""attnlab.interop.deepseek: MultiHeadLatentAttention from and to transformers'
DeepseekV3Attention, equal to the layer's eager forward with the position embeddings its
model's rotary embedding makes (queries low-rank or plain, interleaved rotary pairs or
halves, biases, YaRN with DeepSeek's mscale), by both attention paths, with its weights,
and cached in chunks as the layer decodes with transformers' own cache. Small configs with
random weights: nothing is downloaded."""

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is the optional extra attnlab[hf]"
)
from transformers import DeepseekV3Config, DynamicCache  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_deepseek  # noqa: E402

from attnlab import rope_scaling  # noqa: E402
from attnlab.interop.deepseek import (  # noqa: E402
    from_deepseek_v3_attention,
    to_deepseek_v3_attention,
)
from attnlab.mla import MultiHeadLatentAttention  # noqa: E402

D_MODEL, TOKENS = 64, 9
YARN = {  # DeepSeek-V3's own rope_scaling, its context shrunk to the test's
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
YARN_FACTOR = {**YARN, "mscale": 0.707, "mscale_all_dim": 0.5}  # a cos/sin factor != 1 too


def _layer(q_lora_rank=24, interleave=True, bias=False, scaling=None, seed=0):
    """A DeepseekV3Attention (eager) with random weights, biases and norm weights, and the
    rotary embedding of its model."""
    rope = {"rope_type": "default", "rope_theta": 10000.0} | (scaling or {})
    config = DeepseekV3Config(
        hidden_size=D_MODEL,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=6,  # de-interleaving (0, 2, 4, 1, 3, 5) is not its own inverse
        v_head_dim=12,
        max_position_embeddings=64,
        rope_interleave=interleave,
        attention_bias=bias,
        rope_parameters=rope,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    layer = hf_deepseek.DeepseekV3Attention(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return layer, hf_deepseek.DeepseekV3RotaryEmbedding(config)


def _causal(tq, tk):
    """transformers' additive causal mask (1, 1, tq, tk), the queries the newest tokens."""
    future = torch.ones(tq, tk, dtype=torch.bool).triu(tk - tq + 1)
    return torch.zeros(1, 1, tq, tk).masked_fill(future, torch.finfo(torch.float32).min)


def _eager(layer, rotary, x, start=0, cache=None):
    """The layer's eager forward of x at positions start.., with its model's rotary tables."""
    b, t, _ = x.shape
    positions = torch.arange(start, start + t)[None].expand(b, t)
    with torch.no_grad():
        return layer(x, rotary(x, positions), _causal(t, start + t), cache=cache)


CASES = {
    "q lora, interleaved": dict(q_lora_rank=24, interleave=True),
    "q lora, halves": dict(q_lora_rank=24, interleave=False),
    "plain q, interleaved": dict(q_lora_rank=None, interleave=True),
    "plain q, halves, biases": dict(q_lora_rank=None, interleave=False, bias=True),
    "q lora, interleaved, biases": dict(q_lora_rank=24, interleave=True, bias=True),
    "yarn": dict(scaling=YARN),
    "yarn, cos/sin factor": dict(scaling=YARN_FACTOR, interleave=False),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_outputs_and_weights_equal_the_layers_eager_forward(case):
    layer, rotary = _layer(**case)
    x = torch.randn(2, TOKENS, D_MODEL, generator=torch.Generator().manual_seed(1))
    expected, expected_weights = _eager(layer, rotary, x)
    module = from_deepseek_v3_attention(layer)
    assert module.scale == pytest.approx(layer.scaling, rel=1e-12)
    with torch.no_grad():
        for absorb in (False, True):
            out, weights = module(x, need_weights=True, absorb=absorb)
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(weights, expected_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "case", [CASES["q lora, interleaved"], CASES["yarn"]], ids=["plain", "yarn"]
)
def test_cached_chunks_equal_the_layer_decoding_with_its_own_cache(case):
    layer, rotary = _layer(**case)
    x = torch.randn(2, TOKENS, D_MODEL, generator=torch.Generator().manual_seed(2))
    module = from_deepseek_v3_attention(layer)
    theirs, ours = DynamicCache(), module.make_cache(2)
    with torch.no_grad():
        for start, end in ((0, 4), (4, 5), (5, 6), (6, TOKENS)):
            expected, _ = _eager(layer, rotary, x[:, start:end], start, theirs)
            got = module(x[:, start:end], cache=ours)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert ours.position == TOKENS == theirs.get_seq_length()


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_a_module_copied_into_a_layer_gives_the_modules_outputs(case):
    layer, rotary = _layer(**case)
    module = from_deepseek_v3_attention(layer)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    assert to_deepseek_v3_attention(module, layer) is layer
    x = torch.randn(1, TOKENS, D_MODEL, generator=torch.Generator().manual_seed(4))
    expected, _ = _eager(layer, rotary, x)
    with torch.no_grad():
        torch.testing.assert_close(module(x), expected, rtol=1e-5, atol=1e-5)
    twin = from_deepseek_v3_attention(layer)
    for (name, mine), theirs in zip(
        module.state_dict().items(), twin.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(theirs, mine, rtol=0, atol=0, msg=name)


def test_the_softmax_scale_is_transformers_yarn_apply_mscale():
    without = {k: v for k, v in YARN.items() if k != "mscale_all_dim"}
    for scaling in (None, YARN, YARN_FACTOR, {**YARN, "factor": 40.0}, without):
        parameters = scaling or {"rope_type": "default"}
        module = MultiHeadLatentAttention(8, 2, None, 6, 4, 4, 3, 64, rope_scaling=scaling)
        want = hf_deepseek.yarn_apply_mscale(parameters, 8**-0.5)
        assert module.scale == pytest.approx(want, rel=1e-12)
        assert (module.scale == 8**-0.5) == (scaling in (None, without))
        assert module.rope.scaling == rope_scaling.check_scaling(scaling)


def test_a_module_of_another_configuration_is_refused_naming_each_difference():
    layer, _ = _layer()
    module = MultiHeadLatentAttention(D_MODEL, 4, 24, 8, 8, 6, 12, 64, out_bias=True)
    with pytest.raises(ValueError, match=r"kv_lora_rank 8 \(layer: 16\), out_bias True \(layer"):
        to_deepseek_v3_attention(module, layer)
    with pytest.raises(TypeError, match=r"module must be an attnlab\.MultiHeadLatentAttention"):
        to_deepseek_v3_attention(torch.nn.Linear(2, 2), layer)


def test_what_is_not_a_deepseek_layer_is_refused_by_name():
    with pytest.raises(TypeError, match=r"DeepseekV3Attention \(q_proj.* got Linear without"):
        from_deepseek_v3_attention(torch.nn.Linear(2, 2))
    layer, _ = _layer()
    layer.config.num_key_value_heads = 2
    with pytest.raises(ValueError, match=r"num_key_value_heads \(2\) != num_attention_heads"):
        from_deepseek_v3_attention(layer)


def test_a_rotary_scaling_attnlab_does_not_compute_is_refused():
    layer, _ = _layer()
    layer.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    with pytest.raises(ValueError, match="rope_type 'dynamic'"):
        from_deepseek_v3_attention(layer)


def _model(q_lora_rank, scaling):
    """A small DeepseekV3ForCausalLM (a dense layer, then mixture-of-experts layers), eager,
    with its random initial weights."""
    rope = {"rope_type": "default", "rope_theta": 10000.0} | (scaling or {})
    config = DeepseekV3Config(
        vocab_size=100,
        hidden_size=D_MODEL,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=6,
        v_head_dim=12,
        max_position_embeddings=64,
        rope_parameters=rope,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.eval()


@pytest.mark.parametrize(
    ("q_lora_rank", "scaling"), [(None, None), (24, YARN_FACTOR)], ids=["plain-q", "lora-yarn"]
)
def test_a_model_with_every_attention_layer_converted_equals_its_eager_self(q_lora_rank, scaling):
    """hf.swap_attention puts a MultiHeadLatentAttention in every layer of a whole
    DeepSeek-V3 model; its logits equal the eager model's, left padding included."""
    import copy

    from attnlab.interop import hf

    eager = _model(q_lora_rank, scaling)
    ours = copy.deepcopy(eager)
    assert hf.swap_attention(ours) == 3
    assert all(
        isinstance(d.self_attn.attention, MultiHeadLatentAttention) for d in ours.model.layers
    )
    ids = torch.randint(1, 100, (3, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 24, dtype=torch.long)
    mask[1, :4], mask[2, :15] = 0, 0
    with torch.no_grad():
        plain = ours(ids, use_cache=False).logits, eager(ids, use_cache=False).logits
        padded = (
            ours(ids, attention_mask=mask, use_cache=False).logits,
            eager(ids, attention_mask=mask, use_cache=False).logits,
        )
    torch.testing.assert_close(*plain, atol=1e-5, rtol=1e-5)
    real = mask.bool()
    torch.testing.assert_close(padded[0][real], padded[1][real], atol=1e-5, rtol=1e-5)
