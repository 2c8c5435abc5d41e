"""attnlab.interop.llama on the from-scratch Llama (examples/llama.py): the layer's own call
(mask and rotary tables) is honoured, never ignored; the state maps; the refusals."""

import pytest
import torch
from torch import nn

from attnlab.interop import llama
from tests.examples.test_recipes import load

ex = load("llama")
CFG = ex.LLAMA_CONFIG_TINY


def _pair():
    torch.manual_seed(0)
    original = ex.Llama(CFG).eval()
    return original, ex.swapped_copy(original, CFG).eval()


def test_a_mask_other_than_the_causal_one_is_passed_on():
    """A block called with a mask that also hides key 2 from every query: the swapped layer
    hides it too (the from-scratch mask is True where hidden; attnlab's where allowed)."""
    original, model = _pair()
    x = torch.randn(2, 6, CFG["emb_dim"])
    mask = torch.triu(torch.ones(6, 6, dtype=torch.bool), diagonal=1)
    mask[3:, 2] = True
    want = original.trf_blocks[0].att(x, mask, original.cos, original.sin)
    got = model.trf_blocks[0].att(x, mask, model.cos, model.sin)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plain = model.trf_blocks[0].att(x, mask.triu(1), model.cos, model.sin)
    assert not torch.allclose(plain, got)


def test_rotary_tables_of_another_base_or_a_scaling_are_refused():
    _, model = _pair()
    cos, sin = ex.compute_rope_params(CFG["emb_dim"] // CFG["n_heads"], 10_000.0, 64)
    x = torch.randn(1, 4, CFG["emb_dim"])
    mask = torch.triu(torch.ones(4, 4, dtype=torch.bool), diagonal=1)
    with pytest.raises(ValueError, match="rotary cos table differs from attnlab's rope"):
        model.trf_blocks[0].att(x, mask, cos, sin)
    with pytest.raises(ValueError, match="another base, a frequency scaling"):
        llama.swap(ex.Llama(CFG), rope_base=10_000.0)
    with pytest.raises(ValueError, match="cos and sin come together"):
        model.trf_blocks[0].att(x, mask, model.cos, None)


def test_the_state_maps_are_inverse():
    original, _ = _pair()
    state = original.state_dict()
    mapped = llama.from_llama_state(state)
    assert "trf_blocks.0.att.attention.qkv_proj.weight" in mapped
    assert not any("W_query" in key for key in mapped)
    back = llama.to_llama_state(mapped)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[key], state[key]) for key in state)


def test_refusals_name_what_is_missing():
    with pytest.raises(ValueError, match="holds no from-scratch GroupedQueryAttention"):
        llama.swap(nn.Sequential(nn.Linear(2, 2)), rope_base=10_000.0, context_length=8)
    with pytest.raises(ValueError, match="pass context_length"):
        llama.swap(nn.Sequential(ex.GroupedQueryAttention(8, 8, 2, 1)), rope_base=10_000.0)
    layer = ex.GroupedQueryAttention(8, 8, 2, 1)
    del layer.num_kv_groups
    with pytest.raises(TypeError, match="'num_kv_groups'"):
        llama.from_llama_attention(layer, 8, 10_000.0)


class BiasedAttention(ex.GroupedQueryAttention):
    """Qwen2's layout: biases on the query, key and value projections."""

    def __init__(self, d_in, d_out, num_heads, num_kv_groups):
        super().__init__(d_in, d_out, num_heads, num_kv_groups)
        self.W_query = nn.Linear(d_in, d_out, bias=True)
        self.W_key = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=True)
        self.W_value = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=True)


class QKNormAttention(ex.GroupedQueryAttention):
    """Qwen3's norms held but never applied (the forward is the Llama layer's): the swap
    would apply them, so the probe refuses it."""

    def __init__(self, d_in, d_out, num_heads, num_kv_groups):
        super().__init__(d_in, d_out, num_heads, num_kv_groups)
        self.q_norm = nn.RMSNorm(self.head_dim)
        self.k_norm = nn.RMSNorm(self.head_dim)


def test_qwen2_style_biases_are_swapped_and_norms_the_forward_skips_are_refused():
    torch.manual_seed(0)
    cos, sin = ex.compute_rope_params(8, CFG["rope_base"], 16)
    layer = BiasedAttention(32, 32, 4, 2)
    nn.init.normal_(layer.W_key.bias)
    x = torch.randn(2, 6, 32)
    mask = torch.triu(torch.ones(6, 6, dtype=torch.bool), diagonal=1)
    swapped = llama.from_llama_attention(layer, 16, CFG["rope_base"])
    torch.testing.assert_close(swapped(x, mask, cos, sin), layer(x, mask, cos, sin))
    back = llama.to_llama_state(llama.from_llama_state(layer.state_dict()))
    assert all(torch.equal(back[k], v) for k, v in layer.state_dict().items())
    with pytest.raises(ValueError, match=r"QKNormAttention and its swap differ by .* on a probe"):
        llama.from_llama_attention(QKNormAttention(32, 32, 4, 2), 16, CFG["rope_base"])


class UnparametrizedNorm(ex.GroupedQueryAttention):
    """q_norm without a weight, its own rotary tables, a learned sink: nothing the swap may
    drop silently, parameters or not."""

    def __init__(self, kind):
        super().__init__(32, 32, 4, 2)
        if kind == "norm":
            self.q_norm = nn.RMSNorm(self.head_dim, elementwise_affine=False)
        elif kind == "tables":
            cos, sin = ex.compute_rope_params(self.head_dim, 10_000.0, 16)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)
        else:
            self.sinks = nn.Parameter(torch.zeros(4))


@pytest.mark.parametrize(
    ("kind", "named"),
    [("norm", "submodule q_norm"), ("tables", "buffer cos"), ("sink", "parameter sinks")],
)
def test_anything_else_a_layer_holds_is_refused_by_name(kind, named):
    with pytest.raises(ValueError, match=named):
        llama.from_llama_attention(UnparametrizedNorm(kind), 16, CFG["rope_base"])


def test_a_bias_on_some_projections_only_is_refused_by_name():
    layer = ex.GroupedQueryAttention(32, 32, 4, 2)
    layer.W_key = nn.Linear(32, 16, bias=True)
    with pytest.raises(ValueError, match="W_key have a bias and the other"):
        llama.from_llama_attention(layer, 16, CFG["rope_base"])


def test_a_bfloat16_model_swaps_and_runs_its_rounded_tables():
    """Tables rounded to bfloat16 are the same rope; the swapped model equals the original
    in bfloat16 within its rounding."""
    torch.manual_seed(0)
    original = ex.Llama(CFG).to(torch.bfloat16).eval()
    model = ex.swapped_copy(ex.Llama(CFG).eval(), CFG)
    model.load_state_dict(llama.from_llama_state(original.state_dict()))
    model = model.to(torch.bfloat16)
    idx = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), original(idx), rtol=0.05, atol=0.05)


def test_a_full_size_mask_buffer_is_sliced_as_the_layer_slices_it():
    """Many from-scratch models pass one (context, context) mask buffer to every call."""
    _, model = _pair()
    x = torch.randn(2, 10, CFG["emb_dim"])
    full = torch.triu(torch.ones(64, 64, dtype=torch.bool), diagonal=1)
    sliced = full[:10, :10]
    att = model.trf_blocks[0].att
    torch.testing.assert_close(
        att(x, full, model.cos, model.sin), att(x, sliced, model.cos, model.sin)
    )


def test_no_layer_to_swap_is_said_before_anything_else():
    with pytest.raises(ValueError, match="holds no from-scratch GroupedQueryAttention"):
        llama.swap(nn.Sequential(nn.Linear(4, 4)), rope_base=10_000.0)


class ProjectionNorms(ex.GroupedQueryAttention):
    """OLMo 2's layout: torch RMSNorms over the whole query and key projections."""

    def __init__(self):
        super().__init__(32, 32, 4, 2)
        self.q_norm = nn.RMSNorm(32, eps=1e-6)
        self.k_norm = nn.RMSNorm(16, eps=1e-6)
        with torch.no_grad():
            self.q_norm.weight.normal_(1.0, 0.3)
            self.k_norm.weight.normal_(1.0, 0.3)

    def forward(self, x, mask, cos, sin):
        b, t, _ = x.shape
        queries = self.q_norm(self.W_query(x)).view(b, t, 4, 8).transpose(1, 2)
        keys = self.k_norm(self.W_key(x)).view(b, t, 2, 8).transpose(1, 2)
        values = self.W_value(x).view(b, t, 2, 8).transpose(1, 2)
        queries, keys = ex.apply_rope(queries, cos, sin), ex.apply_rope(keys, cos, sin)
        keys, values = keys.repeat_interleave(2, dim=1), values.repeat_interleave(2, dim=1)
        scores = (queries @ keys.transpose(2, 3)).masked_fill(mask[:t, :t], -torch.inf)
        context = (torch.softmax(scores / 8**0.5, dim=-1) @ values).transpose(1, 2)
        return self.out_proj(context.reshape(b, t, 32))


def test_norms_over_the_whole_projection_are_swapped_as_olmo2s():
    torch.manual_seed(0)
    layer = ProjectionNorms()
    swapped = llama.from_llama_attention(layer, 16, CFG["rope_base"])
    attention = swapped.attention
    assert attention.qk_norm == "projection" and attention.qk_norm_offset == 0.0
    assert attention.q_norm.weight.shape == (32,) and attention.k_norm.weight.shape == (16,)
    cos, sin = ex.compute_rope_params(8, CFG["rope_base"], 16)
    x = torch.randn(2, 7, 32)
    mask = torch.triu(torch.ones(7, 7, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        torch.testing.assert_close(swapped(x, mask, cos, sin), layer(x, mask, cos, sin))
    state = layer.state_dict()
    back = llama.to_llama_state(llama.from_llama_state(state), norm_weight="weight")
    assert back.keys() == state.keys() and all(torch.equal(back[k], v) for k, v in state.items())


def test_a_query_norm_without_a_key_norm_and_a_bad_norm_name_are_refused():
    layer = ProjectionNorms()
    del layer.k_norm
    with pytest.raises(ValueError, match=r"submodule q_norm \(RMSNorm\) without k_norm"):
        llama.from_llama_attention(layer, 16, CFG["rope_base"])
    with pytest.raises(ValueError, match="norm_weight must be one of"):
        llama.to_llama_state({}, norm_weight="gamma")


def test_a_wrapper_refuses_a_call_form_it_cannot_read():
    _, model = _pair()
    with pytest.raises(ValueError, match=r"'freqs' unknown"):
        llama.GroupedQueryAttention(model.trf_blocks[0].att.attention, ("mask", "freqs"))
    with pytest.raises(ValueError, match="rotary tables cos and sin"):
        llama.GroupedQueryAttention(model.trf_blocks[0].att.attention, ("mask", "cos", "cos"))


def test_a_mask_that_is_not_causal_is_refused_not_made_causal():
    """The from-scratch layer attends wherever its mask lets it; attnlab's is causal
    always: a mask showing the future would give other outputs, so it is refused."""
    _, model = _pair()
    x = torch.randn(1, 5, CFG["emb_dim"])
    nothing_hidden = torch.zeros(5, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="outside its causal mask"):
        model.trf_blocks[0].att(x, nothing_hidden, model.cos, model.sin)


def test_a_masked_call_off_the_cpu_reads_no_value_of_the_mask(monkeypatch):
    """The swap's layer compares a given mask with its own causal one only where value
    checks run (the CPU by default); off it (meta: any read raises), the mask is combined
    unread, no host sync; with the reads forced back on, meta raises."""
    from attnlab import MultiHeadAttention, debug

    layer = MultiHeadAttention(16, 16, 8, 0.0, 2, rope=True, device="meta")
    wrapped = llama.GroupedQueryAttention(layer)
    mask = torch.ones(5, 5, dtype=torch.bool, device="meta").triu(1)  # the book's: True hides
    assert wrapped._allowed(mask, 5).shape == (5, 5)
    monkeypatch.setattr(debug, "reads_values", lambda t: True)
    with pytest.raises(RuntimeError, match=r"(?i)meta"):  # aten::equal reads values
        wrapped._allowed(mask, 5)
