"""What other architectures add to attention, in attnlab.functional.attention on every
backend, forward and backward, with masks and grouped heads, against float64 definitions:
attention sinks (gpt-oss), an additive bias (T5's relative positions, ALiBi) and logit
softcapping (Gemma 2)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import alibi, flash_cpu, masks
from attnlab.functional import attention

BACKENDS = ["math", "sdpa", "auto"] + (["flash"] if flash_cpu.available() else [])


def definition(q, k, v, allowed=None, bias=None, sinks=None, softcap=None):
    """float64, from the papers' formulas: scores, softcap, bias, mask; a sink's exp(s_h)
    joins each row's denominator; rows with no key (and no sink) are zero."""
    q, k, v = (t.double() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias.double()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, -math.inf)
    row_max = scores.amax(dim=-1, keepdim=True)
    if sinks is not None:
        sink = sinks.double().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        row_max = torch.maximum(row_max, sink)
    row_max = row_max.nan_to_num(0.0, neginf=0.0)
    exp = torch.exp(scores - row_max)
    denominator = exp.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denominator = denominator + torch.exp(sink - row_max)
    weights = (exp / denominator).nan_to_num(0.0)
    return weights @ v


@st.composite
def calls(draw):
    hkv = draw(st.integers(1, 2))
    tq = draw(st.sampled_from([1, 6, 40]))
    return dict(
        b=draw(st.integers(1, 2)),
        hq=hkv * draw(st.integers(1, 3)),
        hkv=hkv,
        tq=tq,
        tk=tq + draw(st.sampled_from([0, 4])),
        d=draw(st.sampled_from([4, 8])),
        causal=draw(st.booleans()),
        padded=draw(st.booleans()),
        sinks=draw(st.booleans()),
        bias=draw(st.sampled_from([None, "random", "alibi"])),
        seed=draw(st.integers(0, 2**16)),
    )


def _inputs(c):
    g = torch.Generator().manual_seed(c["seed"])
    q = torch.randn(c["b"], c["hq"], c["tq"], c["d"], generator=g)
    k = torch.randn(c["b"], c["hkv"], c["tk"], c["d"], generator=g)
    v = torch.randn(c["b"], c["hkv"], c["tk"], c["d"], generator=g)
    sinks = torch.randn(c["hq"], generator=g) if c["sinks"] else None
    bias = None
    if c["bias"] == "random":  # a relative-position bias as T5 hands it: (1, h, tq, tk)
        bias = torch.randn(1, c["hq"], c["tq"], c["tk"], generator=g)
    elif c["bias"] == "alibi":
        bias = alibi.bias(alibi.slopes(c["hq"]), c["tq"], c["tk"])
    allowed = None
    if c["padded"]:
        keep = torch.ones(c["b"], c["tk"], dtype=torch.bool)
        keep[0, : c["tk"] // 2 + 1] = False
        allowed = masks.padding_mask(keep)
    return q, k, v, sinks, bias, allowed


def _mask(allowed, bias):
    """The one mask attention takes: the bias, -inf where not allowed."""
    if bias is None:
        return allowed
    return bias if allowed is None else bias.masked_fill(~allowed, -torch.inf)


@settings(max_examples=40, deadline=None)
@given(c=calls(), backend=st.sampled_from(BACKENDS))
def test_sinks_and_bias_equal_the_definition_forward_and_backward(c, backend):
    q, k, v, sinks, bias, allowed = _inputs(c)
    if c["causal"]:
        allowed = masks.combine_masks(allowed, masks.causal_mask(c["tq"], c["tk"]))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sink_leaf = None if sinks is None else sinks.clone().requires_grad_(backend != "flash")
    mask = _mask(allowed if not c["causal"] else _padding_only(c, allowed), bias)
    out = attention(*leaves, mask=mask, causal=c["causal"], sinks=sink_leaf, backend=backend)
    refs = [t.double().requires_grad_() for t in (q, k, v)]
    ref_sinks = None if sinks is None else sinks.double().requires_grad_()
    expected = definition(*refs, allowed, bias, ref_sinks)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-5)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    wrt = leaves + ([sink_leaf] if sink_leaf is not None and sink_leaf.requires_grad else [])
    ref_wrt = refs + ([ref_sinks] if len(wrt) == 4 else [])
    grads = torch.autograd.grad(out, wrt, grad_out)
    ref_grads = torch.autograd.grad(expected, ref_wrt, grad_out.double())
    for grad, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad.double(), ref, atol=5e-5, rtol=1e-4)


def _padding_only(c, causal_and_padding):
    """The padding part alone (attention adds the causal part itself)."""
    if not c["padded"]:
        return None
    keep = torch.ones(c["b"], c["tk"], dtype=torch.bool)
    keep[0, : c["tk"] // 2 + 1] = False
    return masks.padding_mask(keep)


@pytest.mark.parametrize("backend", ["math", "auto"])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap_equals_the_definition_forward_and_backward(backend, causal):
    g = torch.Generator().manual_seed(3)
    q = (5 * torch.randn(2, 4, 9, 8, generator=g)).requires_grad_()  # large scores: capped
    k = torch.randn(2, 2, 9, 8, generator=g).requires_grad_()
    v = torch.randn(2, 2, 9, 8, generator=g).requires_grad_()
    allowed = masks.causal_mask(9, 9) if causal else None
    out = attention(q, k, v, causal=causal, softcap=2.0, backend=backend)
    expected = definition(q, k, v, allowed, softcap=2.0)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, attention(q, k, v, causal=causal), atol=1e-3)  # it bites
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref_grads = torch.autograd.grad(expected.sum(), (q, k, v))
    for grad, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad.double(), ref.double(), atol=1e-5, rtol=1e-4)


def test_need_weights_with_sinks_sum_to_less_than_one_and_reproduce_the_output():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g) for _ in range(3))
    sinks = torch.tensor([0.0, 3.0])
    out, weights = attention(q, k, v, causal=True, sinks=sinks, need_weights=True)
    assert weights.shape == (1, 2, 5, 5)
    assert (weights.sum(-1) < 1).all()  # the sink takes its share of every row
    torch.testing.assert_close(out, weights @ v, atol=1e-6, rtol=1e-5)


def test_a_row_with_only_the_sink_is_zero():
    q, k, v = (torch.randn(1, 1, 3, 4) for _ in range(3))
    mask = torch.zeros(3, 3, dtype=torch.bool)
    for backend in BACKENDS:
        out = attention(q, k, v, mask=mask, sinks=torch.tensor([1.0]), backend=backend)
        assert torch.equal(out, torch.zeros_like(out)), backend


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(sinks=torch.zeros(3)), ValueError, "sinks has 3 logits but q has 2 heads"),
        (dict(sinks=torch.zeros(2, 1)), ValueError, r"sinks must have shape \(query heads,\)"),
        (dict(sinks=torch.zeros(2, dtype=torch.long)), TypeError, "sinks must be a floating"),
        (dict(sinks=torch.tensor([0.0, math.nan])), ValueError, "sinks has a non-finite"),
        (dict(sinks=[0.0, 1.0]), TypeError, "sinks must be a torch.Tensor"),
        (dict(softcap=0.0), ValueError, "softcap must be > 0.0, got 0.0"),
        (dict(softcap=math.inf), ValueError, "softcap must be finite, got inf"),
        (dict(softcap=True), TypeError, "softcap must be a float, got bool"),
        (dict(softcap=30.0, backend="sdpa"), ValueError, "softcap=30.0 needs backend 'math'"),
        (dict(softcap=30.0, backend="flash"), ValueError, "softcap=30.0 needs backend 'math'"),
    ],
)
def test_bad_sinks_and_softcap(kwargs, error, message):
    q, k, v = (torch.randn(1, 2, 3, 4) for _ in range(3))
    with pytest.raises(error, match=message):
        attention(q, k, v, **kwargs)


def test_alibi_slopes_follow_the_paper():
    """Powers of 2^(-8/n) for n a power of two; the paper's interleaving otherwise."""
    torch.testing.assert_close(alibi.slopes(8), 2.0 ** -torch.arange(1.0, 9.0))
    twelve = alibi.slopes(12)
    torch.testing.assert_close(twelve[:8], alibi.slopes(8))
    torch.testing.assert_close(twelve[8:], alibi.slopes(16)[0::2][:4])
    b = alibi.bias(torch.tensor([0.5]), 2, 4)  # queries at positions 2 and 3
    torch.testing.assert_close(b[0, 0], 0.5 * torch.tensor([[-2.0, -1, 0, 1], [-3, -2, -1, 0]]))
