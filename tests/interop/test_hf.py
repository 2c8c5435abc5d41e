"""attnlab.interop.hf: attnlab as transformers' attention implementation (same logits as
"eager" for GPT-2 and a Llama-family model, left padding, generate() with its cache,
output_attentions), and weight conversion with GPT2Attention and Llama attention layers.
Small configs with random weights: nothing is downloaded."""

import warnings

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is the optional extra attnlab[hf]"
)
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig  # noqa: E402

from attnlab import MultiHeadAttention, functional  # noqa: E402
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
    """An eager model and an attnlab one with the same random weights, each built from its
    own config (transformers 5.24 writes attn_implementation into the config it is given),
    each checked to run the implementation asked for."""
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(CONFIGS[kind](), attn_implementation="eager")
    ours = AutoModelForCausalLM.from_config(CONFIGS[kind](), attn_implementation="attnlab")
    ours.load_state_dict(eager.state_dict())
    assert _implementations(eager) == {"eager"} and _implementations(ours) == {"attnlab"}
    assert _attnlab_calls(eager) == 0 < _attnlab_calls(ours)
    return eager.eval(), ours.eval()


def _implementations(model) -> set:
    """The attn_implementation of every config object the model's modules hold."""
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    return {c._attn_implementation for c in configs.values()}


def _attnlab_calls(model) -> int:
    """How many times one forward of 3 tokens calls attnlab.functional.attention."""
    from attnlab.interop import coverage

    with coverage._count_calls() as calls, torch.no_grad():
        model(torch.tensor([[3, 4, 5]]))
    return len(calls)


def _left_padded(batch=3, tokens=40):
    """Ids (batch, tokens) and a left-padding mask: row 1 loses a sixth of its tokens, row
    2 five eighths; every row keeps real tokens (a row of padding only has no key to attend
    to, where eager averages the padding and attnlab gives zeros: no model reads it)."""
    ids = torch.randint(1, 100, (batch, tokens), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(batch, tokens, dtype=torch.long)
    mask[1, : tokens // 6], mask[2, : tokens * 5 // 8] = 0, 0
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


def test_generate_with_a_static_cache_equals_eager():
    """A StaticCache prefill hands attention more keys than queries and no mask (transformers
    relies on SDPA's top-left causal alignment there)."""
    eager, ours = _pair("llama")
    ids, _ = _left_padded(tokens=12)
    options = dict(max_new_tokens=6, do_sample=False, cache_implementation="static")
    options |= dict(output_scores=True, return_dict_in_generate=True)
    expected, got = eager.generate(ids, **options), ours.generate(ids, **options)
    assert torch.equal(got.sequences, expected.sequences)
    for ours_step, eager_step in zip(got.scores, expected.scores, strict=True):
        torch.testing.assert_close(ours_step, eager_step, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_compiled_generate_with_a_static_cache_equals_sdpa_and_compiles_as_often(kind):
    """generate(cache_implementation="static") with the model's forward compiled whole
    (fullgraph): the same ids as sdpa's, and no more graphs (a prefill, then one decode
    graph for every position)."""
    from torch._dynamo.testing import CompileCounter

    results, graphs = {}, {}
    for implementation in ("sdpa", "attnlab"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            CONFIGS[kind](), attn_implementation=implementation
        ).eval()
        torch._dynamo.reset()
        counter = CompileCounter()
        model.forward = torch.compile(model.forward, fullgraph=True, backend=counter)
        ids = torch.randint(1, 100, (2, 7), generator=torch.Generator().manual_seed(1))
        options = dict(max_new_tokens=20, do_sample=False, cache_implementation="static")
        results[implementation] = model.generate(
            ids, attention_mask=torch.ones_like(ids), **options
        )
        graphs[implementation] = counter.frame_count
    assert torch.equal(results["attnlab"], results["sdpa"])
    assert graphs["attnlab"] == graphs["sdpa"] == 2


def test_conversions_refuse_a_wrong_module_with_type_error():
    eager, _ = _pair("llama")
    layer, linear = eager.model.layers[0].self_attn, torch.nn.Linear(64, 64)
    with pytest.raises(TypeError, match=r"layer must be a Llama-style attention layer.*Linear"):
        hf.from_llama_attention(linear)
    with pytest.raises(TypeError, match=r"module must be an attnlab.MultiHeadAttention"):
        hf.to_llama_attention(linear, layer)
    with pytest.raises(TypeError, match="layer must be a Llama-style"):
        hf.to_llama_attention(MultiHeadAttention(64, 64, 16, 0.0, 4), linear)
    with pytest.raises(TypeError, match=r"layer must be a GPT2Attention.*LlamaAttention"):
        hf.from_gpt2_attention(layer)
    with pytest.raises(TypeError, match=r"module must be an attnlab.MultiHeadAttention"):
        hf.to_gpt2_attention(linear, _pair("gpt2")[0].transformer.h[0].attn)


# No keyword ignored: implemented, carried elsewhere (hf.CARRIED) or refused by name.


def _llama_inputs(tokens=9):
    """A Llama attention layer, q (2, 4, t, 16), k and v (2, 2, t, 16), a causal bool mask."""
    eager, _ = _pair("llama")
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, tokens, 16, generator=generator)
    k, v = (torch.randn(2, 2, tokens, 16, generator=generator) for _ in range(2))
    mask = torch.ones(tokens, tokens, dtype=torch.bool).tril()[None, None]
    return eager.model.layers[0].self_attn, q, k, v, mask


CARRIED_VALUES = {
    "position_ids": torch.arange(9)[None],
    "sliding_window": 4,
    "use_cache": True,
    "cache_position": torch.arange(9),
    "cu_seq_lens_q": torch.tensor([0, 9]),
    "cu_seq_lens_k": torch.tensor([0, 9]),
    "max_length_q": 9,
    "max_length_k": 9,
    "deterministic": True,
    "output_hidden_states": True,
    "output_router_logits": True,
    "past_key_values": None,
    "encoder_hidden_states": torch.randn(2, 5, 64),
}


@pytest.mark.parametrize("name", sorted(hf.CARRIED))
def test_a_carried_keyword_changes_nothing_and_eager_ignores_it_too(name):
    from transformers.models.llama.modeling_llama import eager_attention_forward

    layer, q, k, v, mask = _llama_inputs()
    extra = {name: CARRIED_VALUES[name]}
    float_mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    expected, _ = eager_attention_forward(layer, q, k, v, float_mask, scaling=0.25, **extra)
    got, _ = hf.attention_forward(layer, q, k, v, mask, scaling=0.25, **extra)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    without, _ = hf.attention_forward(layer, q, k, v, mask, scaling=0.25)
    assert torch.equal(got, without)


@pytest.mark.parametrize("name", sorted(hf.NOT_YET))
def test_a_keyword_not_supported_yet_is_refused_by_name_unless_none(name):
    layer, q, k, v, mask = _llama_inputs()
    with pytest.raises(ValueError, match=rf"LlamaAttention \(model type llama\) passes {name} "):
        hf.attention_forward(layer, q, k, v, mask, **{name: torch.zeros(4)})
    got, _ = hf.attention_forward(layer, q, k, v, mask, **{name: None})
    torch.testing.assert_close(got, hf.attention_forward(layer, q, k, v, mask)[0])


def test_an_unknown_keyword_is_refused_by_name():
    layer, q, k, v, mask = _llama_inputs()
    with pytest.raises(ValueError, match=r"LlamaAttention.*'future_keyword'.*refused"):
        hf.attention_forward(layer, q, k, v, mask, future_keyword=None)


def test_every_keyword_the_installed_models_pass_is_known():
    """Each keyword an installed modeling file passes by name to its attention interface
    is one attention_forward names, carries or refuses (**kwargs are covered by the
    coverage tests: an unknown one raises there)."""
    import ast
    import re
    from pathlib import Path

    named = {"query", "key", "value", "attention_mask", "dropout", "scaling", "is_causal"}
    known = named | set(hf.CARRIED) | set(hf.NOT_YET) | set(hf.IMPLEMENTED)
    passed = set()
    for path in Path(transformers.__file__).parent.glob("models/*/modeling_*.py"):
        source = path.read_text()
        for start in (m.start() for m in re.finditer(r"\battention_interface\(", source)):
            call = ast.parse(_balanced_call(source, start), mode="eval").body
            passed |= {keyword.arg for keyword in call.keywords if keyword.arg}
    assert len(passed) > 10
    assert passed <= known, sorted(passed - known)


def _balanced_call(source: str, start: int) -> str:
    """The text of the call that starts at `start`, up to its matching parenthesis."""
    depth = 0
    for end in range(source.index("(", start), len(source)):
        depth += {"(": 1, ")": -1}.get(source[end], 0)
        if depth == 0:
            return source[start : end + 1]
    raise ValueError(f"unbalanced call at {start}")


# Models that bypass the interface: refused when built or switched, never silently changed.


# Which models bypass the interface is probed on the installed transformers, independently of
# hf's reading of the modeling source: one forward of the model built with a spying
# implementation, watching for attention computed outside it.

BYPASS_CANDIDATES = ("bloom", "codegen", "falcon", "gpt_neox", "gptj", "opt", "xglm")
TOKENS = 7  # no config dimension of the small models is 7: a softmax over 7 keys is attention


def _attention_outside_the_interface(model_type: str) -> bool:
    """True when one forward of the small model runs a softmax or SDPA over the tokens
    outside transformers' attention interface (built with a spying implementation that
    delegates to SDPA; a model that cannot be built with a registered implementation at all
    is watched under "eager")."""
    from torch.overrides import TorchFunctionMode
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    inside, outside = [False], []

    def spy(*args, **kwargs):
        inside[0] = True
        try:
            return sdpa_attention_forward(*args, **kwargs)
        finally:
            inside[0] = False

    attention = {torch.softmax, torch.Tensor.softmax, torch.nn.functional.softmax}
    attention.add(torch.nn.functional.scaled_dot_product_attention)

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in attention and not inside[0] and args[0].shape[-1] == TOKENS:
                outside.append(func)
            return func(*args, **(kwargs or {}))

    AttentionInterface.register("spy", spy)
    AttentionMaskInterface.register("spy", sdpa_mask)
    try:
        model = _build(model_type, "spy")
    except KeyError:  # Falcon: no registered implementation at all, only its own paths
        model = _build(model_type, "eager")
    with torch.no_grad(), Watch():
        model(torch.arange(3, 3 + TOKENS)[None])
    return bool(outside)


def _build(model_type: str, implementation: str):
    from attnlab.interop import coverage

    config = coverage.small_config(model_type)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=implementation)
    return model.eval()


@pytest.mark.parametrize("model_type", BYPASS_CANDIDATES)
def test_attnlab_refuses_exactly_the_models_that_compute_attention_outside_the_interface(
    model_type,
):
    if _attention_outside_the_interface(model_type):
        with pytest.raises(ValueError, match=r"ForCausalLM computes attention in .* without"):
            _build(model_type, "attnlab")
        eager = _build(model_type, "eager")
        assert hf.bypassing_classes(eager)
        with pytest.raises(ValueError, match="without transformers' attention interface"):
            eager.set_attn_implementation("attnlab")
        assert _implementations(eager) == {"eager"}
    else:
        model = _build(model_type, "attnlab")
        assert hf.bypassing_classes(model) == [] and _implementations(model) == {"attnlab"}
        assert _attnlab_calls(model) > 0


@pytest.mark.parametrize("model_type", ["bloom", "xglm", "falcon"])
def test_a_refusal_suggests_only_implementations_the_model_supports(model_type):
    """Bloom and XGLM declare no SDPA support: 'eager' alone is suggested; Falcon has it."""
    with pytest.raises(ValueError, match="use 'eager'") as refused:
        _build(model_type, "attnlab")
    model_class = type(_build(model_type, "eager"))
    supports_sdpa = getattr(model_class, "_supports_sdpa", True) is not False
    assert ("'sdpa'" in str(refused.value)) is supports_sdpa
    assert model_type == "falcon" or not supports_sdpa  # the test covers both kinds


def test_output_attentions_with_sinks_notes_the_convention_once_per_class():
    class Layer(torch.nn.Module):
        is_causal = True
        training = False

    q = torch.randn(1, 4, 5, 8)
    sinks = torch.zeros(4)
    hf._NOTED_SINK_WEIGHTS.discard(Layer)
    with pytest.warns(UserWarning, match="sink's share out.*GraniteSWA"):
        _, weights = hf.attention_forward(
            Layer(), q, q, q, None, s_aux=sinks, output_attentions=True
        )
    assert (weights.sum(-1) < 1).all()  # attnlab's convention, as the note says
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call notes nothing
        hf.attention_forward(Layer(), q, q, q, None, s_aux=sinks, output_attentions=True)


def test_the_probe_sees_a_bypassing_model_and_one_on_the_interface():
    """The probe itself can tell the two apart on the installed transformers (else the test
    above would check one side only)."""
    seen = {_attention_outside_the_interface(t) for t in BYPASS_CANDIDATES}
    if seen != {True, False}:
        pytest.skip(
            f"on transformers {transformers.__version__} every candidate is on one side "
            f"(bypasses: {seen == {True}}): add a model of the other side to BYPASS_CANDIDATES"
        )


@pytest.mark.parametrize("how", ["plain", "wraps", "partial", "marker"])
def test_a_wrapper_of_attnlabs_function_under_another_name_is_refused_too(how):
    """A logging wrapper registered under its own name still runs attnlab: Bloom built with it
    is refused, as with "attnlab"."""
    import functools

    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    forward = hf.attention_forward

    def logged(*args, **kwargs):  # a closure over attnlab's function, no functools.wraps
        return forward(*args, **kwargs)

    def marked(*args, **kwargs):
        return hf.functional.attention(*args, **kwargs)

    marked.__attnlab_attention__ = True
    wrappers = {
        "plain": logged,
        "wraps": functools.wraps(forward)(lambda *a, **k: forward(*a, **k)),
        "partial": functools.partial(forward, dropout=0.0),
        "marker": marked,
    }
    AttentionInterface.register(f"logged_{how}", wrappers[how])
    AttentionMaskInterface.register(f"logged_{how}", sdpa_mask)
    with pytest.raises(ValueError, match="BloomForCausalLM computes attention in BloomAttention"):
        _build("bloom", f"logged_{how}")
    assert hf.is_attnlab_attention(wrappers[how])


def test_a_function_that_is_not_attnlabs_is_not_taken_for_it():
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    assert not hf.is_attnlab_attention(sdpa_attention_forward)
    assert not hf.is_attnlab_attention(lambda *a, **k: functional.attention(*a, **k))

    def logged_sdpa(*args, **kwargs):
        return sdpa_attention_forward(*args, **kwargs)

    AttentionInterface.register("logged_other", logged_sdpa)
    AttentionMaskInterface.register("logged_other", sdpa_mask)
    _build("bloom", "logged_other")  # built: not attnlab's ("sdpa" in a name meets HF's check)


def test_models_on_the_interface_have_no_bypassing_classes_and_the_guard_is_installed_once():
    eager, _ = _pair("llama")
    assert hf.bypassing_classes(eager) == hf.bypassing_classes(_pair("gpt2")[0]) == []
    hf.register()
    post_init = transformers.PreTrainedModel.post_init
    assert post_init._attnlab_guard and not hasattr(post_init.__wrapped__, "_attnlab_guard")
    eager.set_attn_implementation("attnlab")  # allowed: llama uses the interface
    assert eager.config._attn_implementation == "attnlab"


# Implemented keywords against the eager function of a model that passes each: outputs and
# gradients (queries, keys, values and the sinks or bias), with a left-padding mask.

EAGER_KEYWORDS = {  # keyword: (model type, key/value heads of 4, the keyword's value)
    "s_aux": ("gpt_oss", 2, lambda g: torch.randn(4, generator=g)),
    "position_bias": ("t5", 4, lambda g: torch.randn(1, 4, 9, 9, generator=g)),
    "softcap": ("gemma2", 2, lambda g: 0.7),
}


class _Layer(torch.nn.Module):
    """What the eager functions read from their module: groups, head_dim, gpt-oss's sinks."""

    def __init__(self, groups, sinks):
        super().__init__()
        self.num_key_value_groups, self.head_dim, self.sinks = groups, 16, sinks


@pytest.mark.parametrize("name", sorted(EAGER_KEYWORDS))
def test_an_implemented_keyword_equals_the_models_eager_function(name):
    import importlib

    model_type, kv_heads, make = EAGER_KEYWORDS[name]
    eager_forward = importlib.import_module(
        f"transformers.models.{model_type}.modeling_{model_type}"
    ).eager_attention_forward
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 9, 16, generator=g) * (8 if name == "softcap" else 1)  # cap bites
    k, v = (torch.randn(2, kv_heads, 9, 16, generator=g) for _ in range(2))
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[1, :3] = False  # left padding in the second sequence
    mask = torch.ones(9, 9, dtype=torch.bool).tril() & keep[:, None, None, :]  # (2, 1, 9, 9)
    float_mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    value = make(g)
    tensors = [q, k, v] + ([value] if torch.is_tensor(value) else [])
    ours_in = [t.clone().requires_grad_() for t in tensors]
    theirs_in = [t.clone().requires_grad_() for t in tensors]
    sinks = theirs_in[3] if name == "s_aux" else None  # gpt-oss's eager reads module.sinks
    keyword = ours_in[3] if torch.is_tensor(value) else value
    their_keyword = theirs_in[3] if torch.is_tensor(value) else value
    got, _ = hf.attention_forward(
        _Layer(4 // kv_heads, None).eval(), *ours_in[:3], mask, scaling=0.25, **{name: keyword}
    )
    expected, _ = eager_forward(
        _Layer(4 // kv_heads, sinks).eval(),
        *theirs_in[:3],
        float_mask,
        scaling=0.25,
        **({} if name == "s_aux" else {name: their_keyword}),
    )
    # rows with no key (left padding's first queries) are zeros here, eager's are arbitrary
    # (a softmax over min-valued scores); models never read them: compare the others
    real = keep[:, :, None, None]  # (b, tq, 1, 1): query i of a left-padded row sees keys <= i
    torch.testing.assert_close(got * real, expected * real, atol=1e-5, rtol=1e-5)
    without, _ = hf.attention_forward(_Layer(1, None).eval(), q, k, v, mask, scaling=0.25)
    assert not torch.allclose(got, without, atol=1e-3)  # the keyword changes the result
    grad = torch.randn(got.shape, generator=g) * real
    for ours, theirs in zip(
        torch.autograd.grad(got, ours_in, grad),
        torch.autograd.grad(expected, theirs_in, grad),
        strict=True,
    ):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


# The equality tests above can fail: each one run against a sabotaged attnlab (its attention
# output, and the weights it returns, times 3) must fail.

SABOTAGED = [
    *(
        pytest.param(test, (kind,), id=f"{test.__name__}[{kind}]")
        for test, kind in [
            (test_logits_equal_eager, "gpt2"),
            (test_logits_equal_eager, "llama"),
            (test_left_padded_batch_equals_eager_on_real_tokens, "gpt2"),
            (test_left_padded_batch_equals_eager_on_real_tokens, "llama"),
            (test_generate_with_its_cache_equals_eager, "gpt2"),
            (test_generate_with_its_cache_equals_eager, "llama"),
            (test_output_attentions, "gpt2"),
            (test_output_attentions, "llama"),
            (test_a_carried_keyword_changes_nothing_and_eager_ignores_it_too, "sliding_window"),
            (test_an_implemented_keyword_equals_the_models_eager_function, "softcap"),
        ]
    ),
    pytest.param(test_generate_with_a_static_cache_equals_eager, (), id="static_cache"),
    pytest.param(
        test_compiled_generate_with_a_static_cache_equals_sdpa_and_compiles_as_often,
        ("llama",),
        id="compiled_static_cache",
    ),
]


@pytest.mark.parametrize(("test", "arguments"), SABOTAGED)
def test_each_equality_test_fails_on_a_sabotaged_attnlab(test, arguments, monkeypatch):
    original = functional.attention

    def times_three(*args, **kwargs):
        result = original(*args, **kwargs)
        if isinstance(result, tuple):  # (output, weights)
            return tuple(part * 3 if part is not None else None for part in result)
        return result * 3

    monkeypatch.setattr(functional, "attention", times_three)
    with pytest.raises(AssertionError):
        test(*arguments)


# today's open models' attention layers converted (issue 38): each layer equals the model's
# eager layer given the same inputs, and the whole model with every layer converted equals
# its eager self

_SMALL = dict(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)
_ROPE_SCALINGS = {
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
}


def _open_config(kind: str):
    if kind in _ROPE_SCALINGS:
        return LlamaConfig(**_SMALL, rope_scaling=_ROPE_SCALINGS[kind])
    if kind == "qwen3":
        return transformers.Qwen3Config(**_SMALL, head_dim=32)  # heads wider than the model
    if kind == "olmo2":
        return transformers.Olmo2Config(**_SMALL)
    assert kind == "gemma3"
    local = {"rope_type": "default", "rope_theta": 10_000.0}
    full = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}  # as Gemma 3 27B
    return transformers.Gemma3TextConfig(
        **{**_SMALL, "num_hidden_layers": 3},
        head_dim=32,
        sliding_window=4,
        query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": local, "full_attention": full},
    )


OPEN = [*_ROPE_SCALINGS, "qwen3", "gemma3", "olmo2"]


def _open_model(kind: str):
    """An eager model of `kind`, its norms' weights moved off their start (ones, or zeros
    for Gemma's 1 + weight), so a weight left behind shows."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_open_config(kind), attn_implementation="eager")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(0.3 * torch.randn_like(parameter))
    return model.eval()


def _rotary(model, layer, x, positions):
    rotary = model.model.rotary_emb
    if getattr(layer, "layer_type", None) is not None and hasattr(rotary, "layer_types"):
        return rotary(x, positions, layer.layer_type)
    return rotary(x, positions)


def _eager_mask(tokens, window=None):
    """transformers' eager mask: 0 where a query may attend, the minimum elsewhere."""
    hidden = torch.ones(tokens, tokens, dtype=torch.bool).triu(1)
    if window is not None:
        hidden |= torch.ones(tokens, tokens, dtype=torch.bool).tril(-window)
    return torch.zeros(1, 1, tokens, tokens).masked_fill(hidden, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("kind", OPEN)
def test_each_converted_layer_equals_the_models_eager_layer(kind):
    model = _open_model(kind)
    x = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(12).expand(2, 12)
    for decoder in model.model.layers:
        layer = decoder.self_attn
        module = hf.from_llama_attention(layer).eval()
        window = getattr(layer, "sliding_window", None)
        assert module.window == window
        with torch.no_grad():
            expected, _ = layer(
                x,
                position_embeddings=_rotary(model, layer, x, positions),
                attention_mask=_eager_mask(12, window),
            )
            torch.testing.assert_close(module(x), expected, atol=1e-5, rtol=1e-5)


def test_the_conversions_carry_what_each_model_computes():
    """What makes the layers equal, as the modules state it."""
    layers = {kind: _open_model(kind).model.layers for kind in OPEN}
    llama3 = hf.from_llama_attention(layers["llama3"][0].self_attn)
    assert llama3.rope_scaling["rope_type"] == "llama3" and llama3.qk_norm is None
    qwen3 = hf.from_llama_attention(layers["qwen3"][0].self_attn)
    assert (qwen3.qk_norm, qwen3.qk_norm_offset, qwen3.head_dim) == ("head", 0.0, 32)
    assert qwen3.out_proj.weight.shape == (64, 128)
    olmo2 = hf.from_llama_attention(layers["olmo2"][0].self_attn)
    assert olmo2.qk_norm == "projection" and olmo2.k_norm.weight.shape == (32,)
    sliding, _, full = (hf.from_llama_attention(d.self_attn) for d in layers["gemma3"])
    assert (sliding.qk_norm_offset, sliding.scale) == (1.0, pytest.approx(24**-0.5))
    assert (sliding.window, sliding.rope_base, sliding.rope_scaling) == (4, 10_000.0, None)
    assert (full.window, full.rope_base) == (None, 1_000_000.0)
    assert full.rope_scaling == {"rope_type": "linear", "factor": 8.0}


@pytest.mark.parametrize("kind", OPEN)
def test_a_model_with_every_attention_layer_converted_equals_its_eager_self(kind):
    import copy

    eager = _open_model(kind)
    ours = copy.deepcopy(eager)
    assert hf.swap_attention(ours) == eager.config.num_hidden_layers
    assert all(isinstance(d.self_attn, hf.SwappedAttention) for d in ours.model.layers)
    ids, mask = _left_padded(tokens=24)
    with torch.no_grad():
        torch.testing.assert_close(
            ours(ids, use_cache=False).logits,
            eager(ids, use_cache=False).logits,
            atol=1e-5,
            rtol=1e-5,
        )
        got = ours(ids, attention_mask=mask, use_cache=False).logits
        want = eager(ids, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", OPEN)
def test_open_layers_convert_back_to_the_same_weights(kind):
    model = _open_model(kind)
    layer, other = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    hf.to_llama_attention(hf.from_llama_attention(layer), other)
    for name, tensor in layer.state_dict().items():
        torch.testing.assert_close(other.state_dict()[name], tensor, rtol=0, atol=0, msg=name)


def test_a_swapped_model_refuses_transformers_cache_and_other_positions_by_name():
    import copy

    ours = copy.deepcopy(_open_model("qwen3"))
    hf.swap_attention(ours)
    ids = torch.randint(1, 100, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), pytest.raises(ValueError, match="use_cache=False"):
        ours(ids)  # transformers makes a DynamicCache by default
    with torch.no_grad(), pytest.raises(ValueError, match=r"positions 0 \.\. t - 1"):
        ours(ids, position_ids=torch.arange(3, 9)[None], use_cache=False)


def test_what_attnlabs_layer_does_not_compute_is_refused_by_name():
    config = transformers.Gemma3TextConfig(**_SMALL, head_dim=16, attn_logit_softcapping=50.0)
    torch.manual_seed(0)
    gemma = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    layer = gemma.model.layers[0].self_attn
    with pytest.raises(ValueError, match=r"Gemma3Attention has attn_logit_softcapping \(50.0\)"):
        hf.from_llama_attention(layer)
    dynamic = LlamaConfig(**_SMALL, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    llama = AutoModelForCausalLM.from_config(dynamic, attn_implementation="eager")
    with pytest.raises(ValueError, match="rope_type 'dynamic'"):
        hf.from_llama_attention(llama.model.layers[0].self_attn)
    with pytest.raises(ValueError, match="holds no Llama-style or DeepSeek-V3 attention layer"):
        hf.swap_attention(torch.nn.Linear(2, 2))


def test_a_module_that_computes_otherwise_does_not_go_back_into_a_layer():
    model = _open_model("gemma3")
    sliding, full = model.model.layers[0].self_attn, model.model.layers[2].self_attn
    module = hf.from_llama_attention(sliding)
    with pytest.raises(
        ValueError,
        match=r"rope_base 10000.0 != 1000000.0, rope_scaling None != .*, window 4 != None",
    ):
        hf.to_llama_attention(module, full)
    qwen3 = _open_model("qwen3").model.layers[0].self_attn
    with pytest.raises(ValueError, match=r"qk_norm_offset 0\.0 != 1\.0"):
        hf.to_llama_attention(hf.from_llama_attention(qwen3), model.model.layers[1].self_attn)


def test_a_layer_the_conversion_would_not_equal_is_refused_by_the_probe():
    """A layer whose forward computes what its attributes do not say (its scaling read
    elsewhere): the probe sees it."""
    model = _open_model("qwen3")
    layer = model.model.layers[0].self_attn
    layer.scaling = layer.scaling * 2  # the attribute the conversion reads...
    original_forward = type(layer).forward

    def forward(self, *args, **kwargs):  # ...but this forward computes with the old one
        self.scaling, saved = self.scaling / 2, self.scaling
        try:
            return original_forward(self, *args, **kwargs)
        finally:
            self.scaling = saved

    layer.forward = forward.__get__(layer)
    with pytest.raises(ValueError, match="Qwen3Attention and its conversion differ by"):
        hf.from_llama_attention(layer)
