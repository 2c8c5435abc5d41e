"""attnlab.interop.pytorch: nn.MultiheadAttention converted both ways gives PyTorch's
outputs, masks in torch's polarity included; the package shows only its functions."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from attnlab import MultiHeadAttention, interop, masks

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


def test_interop_shows_only_its_functions():
    public = {name for name in dir(interop) if not name.startswith("_")}
    assert not public & {"nn", "torch", "check_int", "masks", "MultiHeadAttention"}
    assert set(interop.__all__) <= public


def test_to_torch_refuses_rope_and_from_torch_masks_types_a_list():
    """torch's module has no rotary positions: converting a rope module would drop them
    (0.13 off); a list for a mask is a wrong type, not a wrong value."""
    with pytest.raises(ValueError, match=r"rope=True: nn\.MultiheadAttention has no rotary"):
        interop.to_torch(MultiHeadAttention(8, 8, 16, 0.0, 2, rope=True))
    with pytest.raises(TypeError, match=r"key_padding_mask must be a \(batch, keys\) tensor"):
        interop.from_torch_masks(None, [[0, 1]])
