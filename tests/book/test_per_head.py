"""Seed 003: the per-head layer against the blog's own code, and the head-by-head recovery
of PyTorch's nn.MultiheadAttention."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnlab import book


class BlogMultiHeadSelfAttention(torch.nn.Module):
    """Seed 003's class verbatim (unbatched): the reference for the batch-capable one."""

    def __init__(self, D, kdim=None, vdim=None, heads=1):
        super().__init__()
        self._D = D
        self._heads = heads
        self._kdim = kdim if kdim is not None else D // heads
        self._vdim = vdim if vdim is not None else D // heads
        for h in range(self._heads):
            wq_name = f"_wq_h{h}"
            wk_name = f"_wk_h{h}"
            wv_name = f"_wv_h{h}"
            wq = torch.randn(self._D, self._kdim)
            wk = torch.randn(self._D, self._kdim)
            wv = torch.randn(self._D, self._vdim)
            setattr(self, wq_name, torch.nn.Parameter(wq))
            setattr(self, wk_name, torch.nn.Parameter(wk))
            setattr(self, wv_name, torch.nn.Parameter(wv))
        wo = torch.randn(self._heads * self._vdim, self._D)
        self._wo = torch.nn.Parameter(wo)

    def forward(self, X):
        for h in range(self._heads):
            wq_name = f"_wq_h{h}"
            wk_name = f"_wk_h{h}"
            wv_name = f"_wv_h{h}"
            Q = X @ getattr(self, wq_name)
            K = X @ getattr(self, wk_name)
            V = X @ getattr(self, wv_name)
            head = Q @ K.t() / math.sqrt(float(self._kdim))
            head = torch.softmax(head, dim=-1)
            head = head @ V
            if 0 == h:  # noqa: SIM300
                out = head
            else:
                out = torch.cat([out, head], dim=1)
        return out @ self._wo


seeds = st.integers(0, 2**31 - 1)


@given(
    seeds,
    st.integers(1, 8),
    st.integers(1, 4),
    st.one_of(st.none(), st.integers(1, 5)),
    st.one_of(st.none(), st.integers(1, 5)),
)
def test_equals_the_blogs_code_and_batches(seed, d, heads, kdim, vdim):
    D = d * heads
    torch.manual_seed(seed)
    blog = BlogMultiHeadSelfAttention(D, kdim, vdim, heads)
    torch.manual_seed(seed)
    ours = book.MultiHeadSelfAttention(D, kdim, vdim, heads)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in blog.named_parameters()]
    for a, b in zip(ours.parameters(), blog.parameters(), strict=True):
        assert torch.equal(a, b)  # same draws in the same order
    # float64: the blog's unscaled randn weights give large scores that float32 rounds coarsely
    ours, blog = ours.double(), blog.double()
    X = torch.randn(3, 5, D, dtype=torch.float64)
    out = ours(X)
    assert out.shape == (3, 5, D)
    for i in range(3):
        torch.testing.assert_close(ours(X[i]), blog(X[i]), rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(out[i], blog(X[i]), rtol=1e-9, atol=1e-9)


def test_kdim_and_vdim_are_per_head_widths():
    layer = book.MultiHeadSelfAttention(6, kdim=4, vdim=5, heads=3)
    wq, wk, wv = layer.head_weights(2)
    assert wq.shape == wk.shape == (6, 4) and wv.shape == (6, 5)
    assert layer._wo.shape == (15, 6)
    assert layer(torch.randn(2, 7, 6)).shape == (2, 7, 6)


def test_parameter_count_argument():
    """3 x D x d_head x heads = 3 D^2 when d_head * heads = D: PyTorch packs one (3D, D)."""
    D, heads = 12, 4
    layer = book.MultiHeadSelfAttention(D, heads=heads)
    qkv = sum(p.numel() for n, p in layer.named_parameters() if n != "_wo")
    assert qkv == 3 * D * D == torch.nn.MultiheadAttention(D, heads).in_proj_weight.numel()


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_from_torch_recomputes_torch_output(batch_first, causal):
    torch.manual_seed(7)
    mha = torch.nn.MultiheadAttention(8, 2, bias=False, batch_first=batch_first).eval()
    x = torch.randn(3, 5, 8)  # (batch, tokens, E)
    mask = book.additive_causal_mask(5) if causal else None
    x_torch = x if batch_first else x.transpose(0, 1)
    expected, _ = mha(x_torch, x_torch, x_torch, attn_mask=mask, need_weights=False)
    expected = expected if batch_first else expected.transpose(0, 1)
    layer = book.MultiHeadSelfAttention.from_torch(mha)
    torch.testing.assert_close(layer(x, attn_mask=mask), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_by_heads_with_biases_and_masks(mask_kind):
    torch.manual_seed(3)
    mha = torch.nn.MultiheadAttention(12, 3, bias=True, batch_first=True).eval()
    x = torch.randn(2, 6, 12)
    mask = {
        None: None,
        "bool": book.causal_future_mask(6).bool(),
        "float": book.additive_causal_mask(6),
    }[mask_kind]
    expected, _ = mha(x, x, x, attn_mask=mask, need_weights=False)
    torch.testing.assert_close(
        book.torch_attention_by_heads(mha, x, attn_mask=mask), expected, rtol=1e-5, atol=1e-6
    )


def test_by_heads_with_separate_key_and_value_widths():
    torch.manual_seed(4)
    mha = torch.nn.MultiheadAttention(8, 4, kdim=5, vdim=3, batch_first=True).eval()
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 7, 5), torch.randn(2, 7, 3)
    expected, _ = mha(q, k, v, need_weights=False)
    torch.testing.assert_close(
        book.torch_attention_by_heads(mha, q, k, v), expected, rtol=1e-5, atol=1e-6
    )
    heads = book.heads_from_torch(mha)
    assert heads.wk[0].shape == (5, 2) and heads.wv[3].shape == (3, 2)


def test_from_torch_refuses_what_the_blog_layer_cannot_hold():
    with pytest.raises(ValueError, match="bias=True"):
        book.MultiHeadSelfAttention.from_torch(torch.nn.MultiheadAttention(8, 2))
    with pytest.raises(ValueError, match="add_bias_kv"):
        book.heads_from_torch(torch.nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(TypeError, match=r"nn\.MultiheadAttention"):
        book.heads_from_torch(torch.nn.Linear(2, 2))


def test_from_torch_leaves_the_global_random_state_alone():
    mha = torch.nn.MultiheadAttention(8, 2, bias=False)
    torch.manual_seed(11)
    book.MultiHeadSelfAttention.from_torch(mha)
    after = torch.rand(3)
    torch.manual_seed(11)
    torch.testing.assert_close(after, torch.rand(3), rtol=0, atol=0)
