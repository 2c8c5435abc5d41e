"""Fake (meta) kernels of attnlab's registered C++ ops, so that torch.compile, torch.export
and FakeTensorMode can trace a call to them: each gives the real op's outputs' shapes,
dtypes and strides without reading or writing data.

The ops live in extensions built on first use (attnlab._build); `register` is called once
an extension has loaded and registers the fake kernel of every op loaded so far that has
none yet. The real kernels check their arguments (TORCH_CHECK); a fake kernel assumes a
valid call and only states what it returns.

Shapes: decode_step x (b, 1, d_in) or (b, d_in), w_out (d_out, d_out) -> (b, 1, d_out)
float32 (the real op returns an empty tensor instead when x holds a NaN or an infinity; the
fake gives the normal shape); causal_flash_forward q (b, hq, tq, d) -> [out (b, hq, tq, d)
stored (b, tq, hq, d), lse (b, hq, tq)], float32; causal_flash_backward grad_out, q (b, hq,
tq, d), k, v (b, hkv, tk, d) -> [dq (b, hq, tq, d), dk, dv (b, hkv, tk, d)], contiguous
float32.
"""

from __future__ import annotations

import torch

_registered: set[str] = set()


def _decode_step(
    x, w_qkv, b_qkv, w_out, b_out, cos, sin, keys_t, values_t, key_scales, value_scales,
    heads, position, slot, first, count, block, scale,
):  # fmt: skip
    return x.new_empty((x.shape[0], 1, w_out.shape[0]), dtype=torch.float32)  # (b, 1, d_out)


def _causal_flash_forward(
    q, k, v, mask, key_start, key_end, scale, causal, q_split, kv_split, diag_split
):
    batch, heads, tokens, dim = q.shape
    out = q.new_empty((batch, tokens, heads, dim), dtype=torch.float32)  # (b, tq, hq, d)
    lse = q.new_empty((batch, heads, tokens), dtype=torch.float32)  # (b, hq, tq)
    return [out.transpose(1, 2), lse]  # (b, hq, tq, d) stored (b, tq, hq, d)


def _causal_flash_backward(
    grad_out, q, k, v, output, lse, mask, key_start, key_end, scale, causal, q_split, kv_split,
    diag_split,
):  # fmt: skip
    return [
        q.new_empty(q.shape, dtype=torch.float32),  # (b, hq, tq, d)
        k.new_empty(k.shape, dtype=torch.float32),  # (b, hkv, tk, d)
        v.new_empty(v.shape, dtype=torch.float32),
    ]


# (namespace, op name) -> its fake kernel
_FAKES = {
    ("attnlab_decode", "decode_step"): _decode_step,
    ("attnlab", "causal_flash_forward"): _causal_flash_forward,
    ("attnlab", "causal_flash_backward"): _causal_flash_backward,
}


def register() -> None:
    """Register the fake kernel of each op of _FAKES that is loaded and has none yet (each
    once per process)."""
    for (namespace, name), fake in _FAKES.items():
        qualname = f"{namespace}::{name}"
        if qualname in _registered or not hasattr(getattr(torch.ops, namespace), name):
            continue
        torch.library.register_fake(qualname, fake)
        _registered.add(qualname)
