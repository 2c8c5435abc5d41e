"""Every backend of attnlab.functional.attention on tensors laid out as other people's code
makes them: expanded (stride 0), transposed, stepped slices, overlapping unfold windows,
as_strided views, channels-last-like permutes and non-contiguous heads; forward and
backward against a float64 reference on a contiguous copy. (The flash kernel once read
such views with the wrong token stride: outputs off by 1.9, a BLAS error on stdout.)"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import flash_cpu, masks
from attnlab.functional import attention
from attnlab.strides import dense_rows
from tests.definitions import reference

LAYOUTS = ("contiguous", "expand", "transpose", "step", "unfold", "as_strided", "permute")


def laid_out(data: torch.Tensor, layout: str) -> torch.Tensor:
    """A tensor equal to `data` (b, h, t, d) in `layout` (its storage shared where it can)."""
    b, h, t, d = data.shape
    if layout == "contiguous":
        return data.clone()
    if layout == "expand":  # one token (and head) repeated: stride 0 on both
        return data[:, :1, :1].expand(b, h, t, d)
    if layout == "transpose":  # stored (b, t, h, d), as a projection's heads are
        return data.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "step":  # every second token of a twice-longer tensor
        longer = torch.zeros(b, h, 2 * t, d, dtype=data.dtype)
        longer[:, :, ::2] = data
        return longer[:, :, ::2]
    if layout == "unfold":  # overlapping windows: token stride 1 < d
        return _overlapping(data)
    if layout == "as_strided":  # features stepped by 2 inside a wider buffer
        wide = torch.zeros(b, h, t, 2 * d, dtype=data.dtype)
        wide[..., ::2] = data
        return wide.as_strided((b, h, t, d), (h * t * 2 * d, t * 2 * d, 2 * d, 2))
    if layout == "permute":  # stored (b, d, t, h): channels-last-like
        return data.permute(0, 3, 2, 1).contiguous().permute(0, 3, 2, 1)
    raise AssertionError(layout)


def _overlapping(data: torch.Tensor) -> torch.Tensor:
    """Token i's features are the window [i, i + d) of one row, as x.unfold(-1, d, 1) makes
    them: the token stride is 1 (windows overlap). Its values come from data's first ones."""
    b, h, t, d = data.shape
    line = data.reshape(b, h, t * d)[..., : t + d - 1].contiguous()  # (b, h, t + d - 1)
    return line.unfold(-1, d, 1)  # (b, h, t, d), strides (.., 1, 1)


@st.composite
def calls(draw):
    hkv = draw(st.integers(1, 2))
    tq = draw(st.sampled_from([1, 5, 40, 70]))
    return dict(
        b=draw(st.integers(1, 2)),
        hq=hkv * draw(st.integers(1, 2)),
        hkv=hkv,
        tq=tq,
        tk=tq + draw(st.sampled_from([0, 0, 3])),
        d=draw(st.sampled_from([4, 8, 16])),
        layouts=[draw(st.sampled_from(LAYOUTS)) for _ in "qkv"],
        causal=draw(st.booleans()),
        padded=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def _backends():
    return ["math", "sdpa", "auto"] + (["flash"] if flash_cpu.available() else [])


@settings(max_examples=40, deadline=None)
@given(c=calls(), backend=st.sampled_from(_backends()))
def test_every_layout_gives_the_reference_forward_and_backward(c, backend):
    g = torch.Generator().manual_seed(c["seed"])
    shapes = [
        (c["b"], c["hq"], c["tq"], c["d"]),
        (c["b"], c["hkv"], c["tk"], c["d"]),
        (c["b"], c["hkv"], c["tk"], c["d"]),
    ]
    data = [laid_out(torch.randn(s, generator=g), "contiguous") for s in shapes]
    views = [laid_out(t, layout) for t, layout in zip(data, c["layouts"], strict=True)]
    plain = [v.detach().clone().contiguous() for v in views]  # the same values, contiguous
    leaves = [v.detach().requires_grad_() for v in views]
    mask = None
    if c["padded"]:
        keep = torch.ones(c["b"], c["tk"], dtype=torch.bool)
        keep[0, : c["tk"] // 3] = False
        mask = masks.padding_mask(keep)
    out = attention(*leaves, mask=mask, causal=c["causal"], backend=backend)
    allowed = mask
    if c["causal"]:
        allowed = masks.combine_masks(mask, masks.causal_mask(c["tq"], c["tk"]))
    expected = reference(*(p.double() for p in plain), allowed).double()
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-5)

    grad_out = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, leaves, grad_out)
    refs = [p.double().requires_grad_() for p in plain]
    ref_out = _float64_attention(*refs, allowed)
    ref_grads = torch.autograd.grad(ref_out, refs, grad_out.double())
    for name, grad, view, ref in zip("qkv", grads, views, ref_grads, strict=True):
        # a leaf's gradient has the view's shape; the view's elements may share storage,
        # so compare through the same view of the reference gradient's values
        assert grad.shape == view.shape, name
        torch.testing.assert_close(grad.double(), ref, atol=5e-5, rtol=1e-4, msg=f"d{name}")


def _float64_attention(q, k, v, allowed):
    """Differentiable float64 attention from the definition (grouped heads repeated)."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if allowed is not None:
        scores = scores.masked_fill(~allowed, -torch.inf)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return weights @ v


@pytest.mark.skipif(not flash_cpu.available(), reason="the CPU kernel is not built here")
def test_flash_kernel_never_sees_a_token_stride_blas_refuses(capfd):
    """The layouts that made MKL print 'Parameter 8 was incorrect on entry to SGEMM' and
    return garbage: now copied into the kernel's layout first; nothing on stdout."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 1, 16, generator=g).expand(1, 2, 64, 16)  # token stride 0
    k = _overlapping(torch.randn(1, 2, 64, 16, generator=g))  # token stride 1 < head_dim
    v = torch.randn(1, 2, 64, 16, generator=g)
    out = attention(q, k, v, causal=True, backend="flash")
    ref = attention(q.contiguous(), k.contiguous(), v, causal=True, backend="math")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert "SGEMM" not in capfd.readouterr().out
    assert dense_rows(k).stride(-2) == 16
