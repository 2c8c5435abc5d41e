"""attnlab.interop: nn.MultiheadAttention converted both ways gives PyTorch's outputs, masks
in torch's polarity included; the book's module converts with its configuration."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from attnlab import MultiHeadAttention, book, interop, masks

seeds = st.integers(0, 2**31 - 1)


def torch_masks(kind, pad, b, tq, tk):
    """Random masks in torch's polarity (True = blocked, or additive float) that leave every
    row a key, since torch returns NaN for a row with none."""
    attn_mask = key_padding_mask = None
    if kind != "none":
        blocked = torch.rand(tq, tk) < 0.4
        blocked[:, 0] = False  # key 0 stays visible to every query
        attn_mask = blocked if kind == "bool" else torch.randn(tq, tk).masked_fill(blocked, -1e9)
    if pad:
        key_padding_mask = torch.arange(tk) >= torch.randint(1, tk + 1, (b, 1))  # (b, tk)
        if kind == "float":  # torch wants both masks of one type
            key_padding_mask = torch.zeros(b, tk).masked_fill(key_padding_mask, -torch.inf)
    return attn_mask, key_padding_mask


@st.composite
def torch_configs(draw):
    num_heads = draw(st.integers(1, 3))
    embed_dim = num_heads * draw(st.integers(1, 4))
    return dict(
        seed=draw(seeds),
        b=draw(st.integers(1, 3)),
        tq=draw(st.integers(1, 6)),
        tk=draw(st.integers(1, 6)),
        embed_dim=embed_dim,
        num_heads=num_heads,
        bias=draw(st.booleans()),
        kdim=draw(st.one_of(st.none(), st.integers(1, 6))),
        cross=draw(st.booleans()),
        mask_kind=draw(st.sampled_from(["none", "bool", "float"])),
        pad=draw(st.booleans()),
    )


@given(torch_configs())
def test_from_torch_gives_torchs_outputs_and_weights(c):
    torch.manual_seed(c["seed"])
    theirs = nn.MultiheadAttention(
        c["embed_dim"],
        c["num_heads"],
        bias=c["bias"],
        kdim=c["kdim"],
        vdim=c["kdim"],
        batch_first=True,
    ).eval()
    ours = interop.from_torch(theirs)
    x = torch.randn(c["b"], c["tq"], c["embed_dim"])
    cross = c["cross"] or c["kdim"] is not None
    tk = c["tk"] if cross else c["tq"]
    context = torch.randn(c["b"], tk, c["kdim"] or c["embed_dim"]) if cross else None
    attn_mask, key_padding_mask = torch_masks(c["mask_kind"], c["pad"], c["b"], c["tq"], tk)
    source = x if context is None else context
    with torch.no_grad():
        expected, expected_weights = theirs(
            x,
            source,
            source,
            attn_mask=attn_mask,
            key_padding_mask=key_padding_mask,
            average_attn_weights=False,
        )
        mask = interop.from_torch_masks(attn_mask, key_padding_mask)
        for backend in ("math", "sdpa"):
            ours.backend = backend
            torch.testing.assert_close(ours(x, context, mask=mask), expected, rtol=1e-5, atol=1e-5)
        ours.backend = "math"
        _, weights = ours(x, context, mask=mask, need_weights=True)
        torch.testing.assert_close(weights, expected_weights, rtol=1e-5, atol=1e-6)


@st.composite
def attnlab_configs(draw):
    num_kv_heads = draw(st.integers(1, 3))
    num_heads = num_kv_heads * draw(st.integers(1, 3))
    return dict(
        seed=draw(seeds),
        b=draw(st.integers(1, 3)),
        tokens=draw(st.integers(1, 6)),
        d=num_heads * draw(st.integers(1, 3)),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        bias=draw(st.booleans()),
        causal=draw(st.booleans()),
        context_dim=draw(st.one_of(st.none(), st.integers(1, 6))),
        context_tokens=draw(st.integers(1, 6)),
    )


@given(attnlab_configs())
def test_to_torch_gives_the_same_outputs(c):
    """Grouped-query heads become repeated key/value weights; causal becomes torch's mask."""
    torch.manual_seed(c["seed"])
    ours = MultiHeadAttention(
        c["d"],
        c["d"],
        8,
        0.0,
        c["num_heads"],
        qkv_bias=c["bias"],
        num_kv_heads=c["num_kv_heads"],
        causal=c["causal"],
        context_dim=c["context_dim"],
    )
    theirs = interop.to_torch(ours).eval()
    x = torch.randn(c["b"], c["tokens"], c["d"])
    with torch.no_grad():
        if c["context_dim"] is not None:  # cross-attention, never causal
            context = torch.randn(c["b"], c["context_tokens"], c["context_dim"])
            expected = theirs(x, context, context, need_weights=False)[0]
            torch.testing.assert_close(ours(x, context), expected, rtol=1e-5, atol=1e-5)
            return
        blocked = masks.to_torch_mask(masks.causal_mask(c["tokens"])) if c["causal"] else None
        expected = theirs(x, x, x, attn_mask=blocked, need_weights=False)[0]
        torch.testing.assert_close(ours(x), expected, rtol=1e-5, atol=1e-5)


def test_round_trip_keeps_the_weights():
    torch.manual_seed(1)
    theirs = nn.MultiheadAttention(6, 3, kdim=4, vdim=4, batch_first=True)
    back = interop.to_torch(interop.from_torch(theirs))
    for name, value in theirs.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], value, rtol=0, atol=0)


def test_torch_module_without_bias_converts():
    torch.manual_seed(2)
    theirs = nn.MultiheadAttention(4, 2, bias=False, batch_first=True)
    ours = interop.from_torch(theirs)
    assert not ours.qkv_bias and torch.all(ours.out_proj.bias == 0)
    x = torch.randn(2, 5, 4)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x, x, x)[0], rtol=1e-5, atol=1e-6)


def test_three_dimensional_torch_mask_is_per_head():
    torch.manual_seed(3)
    theirs = nn.MultiheadAttention(6, 3, batch_first=True).eval()
    ours = interop.from_torch(theirs)
    x = torch.randn(2, 4, 6)
    blocked = torch.rand(2 * 3, 4, 4) < 0.5
    blocked[..., 0] = False
    with torch.no_grad():
        expected = theirs(x, x, x, attn_mask=blocked, need_weights=False)[0]
        mask = interop.from_torch_masks(blocked, num_heads=3)
        torch.testing.assert_close(ours(x, mask=mask), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="pass num_heads"):
        interop.from_torch_masks(blocked)


def test_from_book_keeps_configuration_and_outputs():
    torch.manual_seed(4)
    oracle = book.MultiHeadAttention(3, 4, 6, 0.25, 2, qkv_bias=True).eval()
    ours = interop.from_book(oracle).eval()
    assert (ours.d_in, ours.d_out, ours.context_length, ours.dropout, ours.num_heads) == (
        3,
        4,
        6,
        0.25,
        2,
    )
    x = book.example_batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), oracle(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (
            lambda: interop.from_torch(nn.MultiheadAttention(4, 2, kdim=3, vdim=5)),
            ValueError,
            r"kdim \(3\) != value width vdim \(5\)",
        ),
        (
            lambda: interop.from_torch(nn.MultiheadAttention(4, 2, add_bias_kv=True)),
            ValueError,
            "add_bias_kv or add_zero_attn",
        ),
        (
            lambda: interop.from_torch(nn.MultiheadAttention(4, 2, add_zero_attn=True)),
            ValueError,
            "add_bias_kv or add_zero_attn",
        ),
        (lambda: interop.from_torch(nn.Linear(2, 2)), TypeError, "nn.MultiheadAttention"),
        (
            lambda: interop.to_torch(MultiHeadAttention(4, 6, 8, 0.0, 2)),
            ValueError,
            r"d_in \(4\) != d_out \(6\)",
        ),
        (lambda: interop.to_torch(nn.Linear(2, 2)), TypeError, "attnlab.MultiHeadAttention"),
        (lambda: interop.from_book(nn.Linear(2, 2)), TypeError, "not a book MultiHeadAttention"),
        (
            lambda: interop.from_torch_masks(key_padding_mask=torch.zeros(2, 3, 4, dtype=bool)),
            ValueError,
            r"key_padding_mask must be a \(batch, keys\) tensor",
        ),
        (
            lambda: interop.from_torch_masks(torch.zeros(5, 4, 4, dtype=bool), num_heads=2),
            ValueError,
            r"first dimension \(5\) is not batch \* num_heads",
        ),
    ],
)
def test_refusals(make, error, message):
    with pytest.raises(error, match=message):
        make()


@given(
    num_kv_heads=st.sampled_from([1, 2, 4]),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_to_book_gives_the_same_outputs_and_round_trips(num_kv_heads, bias, seed):
    """to_book is from_book's inverse: the book's class (grouped-query heads repeated)
    gives the production module's outputs, and from_book of it gives them again."""
    torch.manual_seed(seed)
    ours = MultiHeadAttention(6, 8, 10, 0.0, 4, qkv_bias=bias, num_kv_heads=num_kv_heads).eval()
    theirs = interop.to_book(ours).eval()
    assert isinstance(theirs, book.MultiHeadAttention)
    x = torch.randn(2, 7, 6)
    with torch.no_grad():
        torch.testing.assert_close(theirs(x), ours(x), atol=1e-6, rtol=1e-5)
        back = interop.from_book(theirs).eval()
        torch.testing.assert_close(back(x), ours(x), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        (dict(causal=False), "causal=False"),
        (dict(rope=True), "rope=True"),
        (dict(window=3), "window=3"),
        (dict(context_dim=5), "context_dim=5 != d_in=6"),
    ],
)
def test_to_book_refuses_what_the_book_cannot_hold(kwargs, named):
    with pytest.raises(ValueError, match=named):
        interop.to_book(MultiHeadAttention(6, 8, 10, 0.0, 4, **kwargs))
    with pytest.raises(TypeError, match=r"m must be an attnlab\.MultiHeadAttention"):
        interop.to_book(nn.Linear(2, 2))


@pytest.mark.parametrize("context_dim", [None, 5])
def test_qkv_weights_read_and_write_either_layout(context_dim):
    """The module's one public way to the query/key/value weights: views of the fused or
    the split layout, and load_qkv_weights writes them back (shapes checked first)."""
    torch.manual_seed(2)
    m = MultiHeadAttention(6, 8, 10, 0.0, 4, qkv_bias=True, num_kv_heads=2, context_dim=context_dim)
    w = m.qkv_weights()
    width = 6 if context_dim is None else context_dim
    assert w.q_weight.shape == (8, 6) and w.k_weight.shape == w.v_weight.shape == (4, width)
    assert w.q_bias.shape == (8,) and w.v_bias.shape == (4,)
    fresh = [torch.randn_like(t) for t in w]
    m.load_qkv_weights(type(w)(*fresh))
    for new, now in zip(fresh, m.qkv_weights(), strict=True):
        assert torch.equal(new, now)
    with pytest.raises(ValueError, match=r"weights.k_weight has shape \(3, 6\)"):
        m.load_qkv_weights(w._replace(k_weight=torch.zeros(3, 6)))
    with pytest.raises(ValueError, match=r"weights\.q_bias has shape None"):
        m.load_qkv_weights(w._replace(q_bias=None))


def test_interop_shows_only_its_functions():
    public = {name for name in dir(interop) if not name.startswith("_")}
    assert not public & {"nn", "torch", "check_int", "masks", "MultiHeadAttention"}
    assert set(interop.__all__) <= public
