"""torch.compile(MultiHeadAttention(...), fullgraph=True): no graph break, with and without
a KV cache, and the same outputs (and gradients) as eager mode. Most tests trace with the
aot_eager backend (no code generation, seconds); one compiles with inductor end to end."""

import pytest
import torch

from attnlab import MultiHeadAttention
from tests.definitions import decode

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.jit.script_method.*:DeprecationWarning")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled(module, backend="aot_eager"):
    return torch.compile(module, fullgraph=True, backend=backend)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(num_kv_heads=2, rope=True),
        dict(window=5),
        dict(causal=False, qkv_bias=True),
    ],
)
def test_forward_and_backward_equal_eager(kwargs):
    torch.manual_seed(0)
    module = MultiHeadAttention(32, 32, 64, 0.0, 4, **kwargs)
    compiled = _compiled(module)
    x = torch.randn(2, 40, 32, requires_grad=True)
    eager_out = module(x)
    eager_grads = torch.autograd.grad(eager_out.square().sum(), (x, *module.parameters()))
    out = compiled(x)
    grads = torch.autograd.grad(out.square().sum(), (x, *module.parameters()))
    torch.testing.assert_close(out, eager_out, atol=1e-5, rtol=1e-5)
    for grad, expected in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(grad, expected, atol=1e-4, rtol=1e-4)


def test_cross_attention_with_a_padding_mask():
    torch.manual_seed(0)
    module = MultiHeadAttention(16, 16, 32, 0.0, 2, context_dim=8).eval()
    x, context = torch.randn(2, 6, 16), torch.randn(2, 9, 8)
    keep = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    keep[1, ..., 5:] = False
    with torch.no_grad():
        expected = module(x, context, mask=keep)
        out = _compiled(module)(x, context, mask=keep)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kwargs", [dict(), dict(num_kv_heads=2, rope=True), dict(window=4)])
def test_decoding_with_a_kv_cache(kwargs):
    torch.manual_seed(0)
    module = MultiHeadAttention(32, 32, 64, 0.0, 4, **kwargs).eval()
    compiled = _compiled(module)
    x = torch.randn(2, 16, 32)
    with torch.no_grad():  # a 6-token prompt, then one token at a time (positions checked)
        expected, outs = (decode(m, x, None, chunks=[6, 1]) for m in (module, compiled))
    torch.testing.assert_close(outs, expected, atol=1e-6, rtol=1e-5)


def test_inductor_end_to_end():
    torch.manual_seed(0)
    module = MultiHeadAttention(32, 32, 64, 0.0, 4).eval()
    x = torch.randn(2, 40, 32)
    with torch.no_grad():
        torch.testing.assert_close(
            _compiled(module, "inductor")(x), module(x), atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_flash_backend_asked_by_name_compiles_whole(kv_heads):
    """backend="flash" under torch.compile(fullgraph=True): the kernel's availability is
    read once at trace time (it stats the build's files, which dynamo cannot trace), and
    the compiled forward and backward equal eager."""
    from attnlab.flash_cpu import available
    from attnlab.functional import attention

    if not available():
        pytest.skip("attnlab's C++ kernel is not built here")
    torch.manual_seed(0)
    q = torch.randn(1, 4, 40, 8, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, 40, 8, requires_grad=True) for _ in range(2))

    def call(q, k, v):
        return attention(q, k, v, causal=True, backend="flash")

    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True, backend="eager")(q, k, v)
    expected = call(q, k, v)
    torch.testing.assert_close(compiled, expected, atol=0, rtol=0)
    grads = torch.autograd.grad(compiled.sum(), (q, k, v))
    for got, want in zip(grads, torch.autograd.grad(expected.sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
