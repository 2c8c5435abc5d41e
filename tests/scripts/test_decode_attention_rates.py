"""scripts/decode_attention_rates.py: the text it builds (decode_step.cpp without its
bindings, its op library renamed, by decode_kernel_rates.py's builder), the caches it times
and the float64 attention its harness is checked against before timing. Nothing is built
here (the script builds and checks its harness itself, against reference(), on every
run)."""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.scripts import script


@pytest.fixture(scope="module")
def rates():
    with script("decode_attention_rates") as module:
        yield module


def test_the_text_is_the_op_without_its_bindings_under_a_library_name_of_its_own(rates):
    kernel_rates = importlib.import_module("decode_kernel_rates")  # the builder it shares
    text = kernel_rates.appended_text(rates.SOURCE, rates.HARNESS, "attnlab_attention_rates_test")
    assert '#include "decode_plan.h"' not in text  # the bindings are cut
    assert "TORCH_LIBRARY(attnlab_decode," not in text
    assert "int64_t chunk_keys(" in text and "void append_and_attend(" in text
    assert text.rstrip().endswith("}")  # the harness's module, appended whole


@pytest.mark.parametrize("kv", [1, 4, 12])
def test_the_caches_hold_the_context_and_a_free_slot(rates, kv):
    qkv, caches = rates.layer_caches(kv, 2, 300, 2, 256)
    assert qkv.shape == (2, (rates.HEADS + 2 * kv) * rates.HEAD_DIM)
    assert len(caches) == 2 and caches[0] is not caches[1]
    for cache in caches:
        assert cache.num_tokens == 300 and cache.capacity == 301
        assert cache.keys_t.shape == (2, kv, rates.HEAD_DIM * 301)
    assert rates.cache_bytes(kv, 2, 300) == 2 * 2 * kv * 300 * rates.HEAD_DIM * 4


def _loop_attention(qkv, cache, kv, heads, hd):
    """Each head's softmax(q k / sqrt(hd)) v, one head and one sequence at a time."""
    out = torch.empty(qkv.shape[0], heads * hd, dtype=torch.float64)
    held = cache.num_tokens
    for b in range(qkv.shape[0]):
        for h in range(heads):
            q = qkv[b, h * hd : (h + 1) * hd].double()
            g = h // (heads // kv)
            k = cache.keys[b, g, :held].double()
            v = cache.values[b, g, :held].double()
            scores = (k @ q) / hd**0.5
            w = torch.exp(scores - scores.max())
            out[b, h * hd : (h + 1) * hd] = (w / w.sum()) @ v
    return out


@pytest.mark.parametrize("kv", [1, 4])
def test_the_reference_is_attention_head_by_head(rates, kv):
    qkv, (cache,) = rates.layer_caches(kv, 2, 37, 1, 16)
    expected = _loop_attention(qkv, cache, kv, rates.HEADS, rates.HEAD_DIM)
    torch.testing.assert_close(rates.reference(qkv, cache, kv), expected)


class _Harness:
    """A stand-in for the built harness: its attend returns the reference, shifted."""

    def __init__(self, rates, shift: float):
        self.rates, self.shift = rates, shift

    def attend(self, qkv, keys_t, values_t, heads, count, block):
        (cache,) = [c for c in self.caches if c.keys_t is keys_t]
        return self.rates.reference(qkv, cache, self.kv).float() + self.shift


@pytest.mark.parametrize("shift, stops", [(0.0, False), (1e-3, True)])
def test_the_check_stops_a_harness_that_is_off(rates, monkeypatch, shift, stops):
    harness = _Harness(rates, shift)
    real = rates.layer_caches

    def recorded(kv, batch, context, layers, block):
        qkv, caches = real(kv, batch, context, layers, block)
        harness.caches, harness.kv = caches, kv
        return qkv, caches

    monkeypatch.setattr(rates, "layer_caches", recorded)
    if stops:
        with pytest.raises(SystemExit, match="off float64 attention"):
            rates.check(harness, 4, 256)
    else:
        rates.check(harness, 4, 256)
