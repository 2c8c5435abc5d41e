"""attnlab.debug: the value checks run on CPU tensors by default, everywhere with the switch
on, nowhere with it off; the GPU's path reads no value (proved on fake CUDA tensors, where
any read raises, and on meta tensors, which take the same path and have no values)."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from attnlab import MultiHeadAttention, debug, functional
from attnlab.interop import hf

NAN_AT = (0, 1, 2, 3)


def _qkv(device="cpu", dtype=torch.float32, kv_heads=2):
    q = torch.randn(2, 4, 6, 8, device=device, dtype=dtype)
    k = torch.randn(2, kv_heads, 6, 8, device=device, dtype=dtype)
    return q, k, torch.randn(2, kv_heads, 6, 8, device=device, dtype=dtype)


def test_by_default_a_cpu_input_with_nan_is_refused_by_name():
    q, k, v = _qkv()
    q[NAN_AT] = torch.nan
    with pytest.raises(ValueError, match=r"q has a non-finite value \(nan\) at index"):
        functional.attention(q, k, v, causal=True)
    module = MultiHeadAttention(8, 8, 8, 0.0, 2)
    with pytest.raises(ValueError, match="x has a non-finite value"):
        module(torch.full((1, 3, 8), torch.inf))


def test_with_the_checks_off_nan_propagates_as_through_sdpa():
    q, k, v = _qkv(kv_heads=4)
    v[NAN_AT] = torch.nan  # every query that sees key 2 reads it
    with debug.checks(False):
        got = functional.attention(q, k, v, causal=True)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(got.isnan(), expected.isnan()) and got.isnan().any()
    torch.testing.assert_close(got.nan_to_num(), expected.nan_to_num(), atol=1e-6, rtol=1e-5)


def test_a_fully_masked_row_still_gives_zeros_with_the_checks_off():
    q, k, v = _qkv()
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[2] = False
    with debug.checks(False):
        out = functional.attention(q, k, v, mask=mask)
    assert not out.isnan().any() and not out[:, :, 2].any()


def test_the_switch_is_restored_after_the_block_even_when_it_raises():
    assert debug.enabled() is None
    with pytest.raises(RuntimeError), debug.checks():
        assert debug.enabled() is True
        raise RuntimeError
    assert debug.enabled() is None
    with pytest.raises(TypeError, match="on must be a bool, got str"), debug.checks("yes"):
        pass


def test_an_additive_mask_with_nan_is_refused_only_where_values_are_read():
    q, k, v = _qkv()
    mask = torch.zeros(6, 6)
    mask[1, 1] = torch.nan
    with pytest.raises(ValueError, match="mask holds nan"):
        functional.attention(q, k, v, mask=mask)
    with debug.checks(False):
        functional.attention(q, k, v, mask=mask)


def test_the_environment_variable_turns_the_checks_on_for_every_device():
    code = "import torch, attnlab; print(attnlab.debug.enabled())"
    env = {**os.environ, debug.ENV_VAR: "1"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.stdout.strip() == "True", result.stderr


# --- the GPU's path reads no value -------------------------------------------------------


def _fake_cuda(module, dtype):
    """`module` with fake CUDA parameters and buffers (its own initialisation draws random
    numbers, which a fake CUDA tensor cannot do in a CPU build of torch)."""
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                fake = torch.randn(p.shape, device="cuda", dtype=dtype)
                sub._parameters[name] = nn.Parameter(fake, requires_grad=False)
        for name, b in list(sub._buffers.items()):
            if b is not None:
                sub._buffers[name] = torch.randn(b.shape, device="cuda", dtype=b.dtype)
    return module


FUNCTIONAL_CALLS = {
    "causal": lambda q, k, v: functional.attention(q, k, v, causal=True),
    "decode": lambda q, k, v: functional.attention(q.narrow(2, 5, 1), k, v, causal=True),
    "bool mask": lambda q, k, v: functional.attention(
        q, k, v, mask=torch.ones(6, 6, dtype=torch.bool, device="cuda").tril()
    ),
    "float mask": lambda q, k, v: functional.attention(
        q, k, v, mask=torch.zeros(2, 1, 6, 6, dtype=q.dtype, device="cuda")
    ),
    "math, weights": lambda q, k, v: functional.attention(
        q, k, v, causal=True, backend="math", need_weights=True
    ),
    "sdpa": lambda q, k, v: functional.attention(q, k, v, causal=True, backend="sdpa"),
    "sinks": lambda q, k, v: functional.attention(
        q, k, v, causal=True, sinks=torch.zeros(4, device="cuda")
    ),
    "softcap": lambda q, k, v: functional.attention(q, k, v, causal=True, softcap=30.0),
}


@pytest.mark.parametrize("call", FUNCTIONAL_CALLS.values(), ids=FUNCTIONAL_CALLS.keys())
def test_functional_attention_on_cuda_reads_no_value(call):
    with FakeTensorMode(), torch.no_grad():
        result = call(*_qkv("cuda", torch.bfloat16))
    out = result[0] if isinstance(result, tuple) else result
    assert out.device.type == "cuda" and out.dtype == torch.bfloat16


MODULES = {
    "mha": {},
    "gqa, rope": {"num_kv_heads": 2, "rope": True},
    "mqa, window": {"num_kv_heads": 1, "window": 3},
}


@pytest.mark.parametrize("storage", [None, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("options", MODULES.values(), ids=MODULES.keys())
def test_the_module_and_a_static_cache_decode_on_cuda_read_no_value(options, storage):
    with FakeTensorMode(), torch.no_grad():
        module = _fake_cuda(MultiHeadAttention(32, 32, 16, 0.0, 4, **options), torch.bfloat16)
        x = torch.randn(2, 5, 32, device="cuda", dtype=torch.bfloat16)
        assert module(x).shape == (2, 5, 32)
        assert module(x, need_weights=True)[1].shape == (2, 4, 5, 5)
        cache = module.make_cache(2, 16, static=True, dtype=storage)
        module(x, cache=cache)
        for _ in range(3):
            out = module(x.narrow(1, 0, 1), cache=cache)
    assert out.shape == (2, 1, 32) and out.device.type == "cuda"
    assert cache.tokens == 8


def test_cross_attention_on_cuda_reads_no_value():
    with FakeTensorMode(), torch.no_grad():
        module = MultiHeadAttention(32, 32, 16, 0.0, 4, causal=False, context_dim=24)
        module = _fake_cuda(module, torch.float16)
        x = torch.randn(2, 5, 32, device="cuda", dtype=torch.float16)
        context = torch.randn(2, 7, 24, device="cuda", dtype=torch.float16)
        assert module(x, context).shape == (2, 5, 32)


def test_transformers_attention_forward_on_cuda_reads_no_value():
    class Layer(nn.Module):
        is_causal = True

    with FakeTensorMode(), torch.no_grad():
        q, k, v = _qkv("cuda", torch.bfloat16)
        mask = torch.ones(2, 1, 6, 6, dtype=torch.bool, device="cuda")
        for attention_mask in (None, mask):
            out, weights = hf.attention_forward(Layer(), q, k, v, attention_mask, scaling=0.3)
            assert out.shape == (2, 6, 4, 8) and weights is None


@pytest.mark.parametrize("options", MODULES.values(), ids=MODULES.keys())
def test_forward_backward_and_a_cached_decode_off_the_cpu_read_no_value(options):
    """Meta tensors take the GPU's path (every device but the CPU does) and raise on any
    read; autograd runs on them where fake CUDA tensors cannot in a CPU build of torch."""
    module = MultiHeadAttention(32, 32, 16, 0.0, 4, **options, device="meta")
    x = torch.randn(2, 5, 32, device="meta", requires_grad=True)
    module(x).sum().backward()
    assert x.grad.shape == x.shape and module.out_proj.weight.grad.device.type == "meta"
    q, k, v = (t.requires_grad_() for t in _qkv("meta"))
    functional.attention(q, k, v, causal=True).sum().backward()
    with torch.no_grad():
        cache = module.make_cache(2, 16)
        module(x, cache=cache)
        module(x.narrow(1, 0, 1), cache=cache)
        cache.reset()
    assert cache.position == 0


def test_a_value_read_added_back_fails_these_tests(monkeypatch):
    """The proofs can fail: with the value checks forced on for every tensor (as a read put
    back on the path would be), the fake CUDA and the meta calls raise."""
    monkeypatch.setattr(debug, "reads_values", lambda t: True)
    with pytest.raises(DataDependentOutputException):
        test_functional_attention_on_cuda_reads_no_value(FUNCTIONAL_CALLS["causal"])
    with pytest.raises(RuntimeError, match="meta"):
        test_forward_backward_and_a_cached_decode_off_the_cpu_read_no_value({})


def test_padding_mask_from_lengths_off_the_cpu_reads_no_value():
    from attnlab import masks

    keep = masks.padding_mask_from_lengths(torch.tensor([3, 1], device="meta"), 4)
    assert keep.shape == (2, 1, 1, 4)
    with pytest.raises(ValueError, match="lengths must be in"):
        masks.padding_mask_from_lengths(torch.tensor([5, 1]), 4)  # the CPU's default: checked
