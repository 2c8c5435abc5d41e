"""Fake (meta) kernels of attnlab's registered C++ ops, so that torch.compile, torch.export
and FakeTensorMode can trace a call to them: each gives the real op's outputs' shapes,
dtypes and strides without reading or writing data.

The ops live in extensions built on first use (attnlab._build); `register` is called once
an extension has loaded and registers the fake kernel of every op loaded so far that has
none yet. The real kernels check their arguments (TORCH_CHECK); a fake kernel states what
it returns, after the checks that need no value and that the dispatcher would otherwise
skip: a meta tensor among CPU ones sends a call here, not to the real kernel, so each
refuses tensors on different devices (empty ones included), and the decode step refuses
buffers it writes that share memory with another argument, with the real op's words (a
RuntimeError naming the arguments).

Shapes: decode_step x (b, 1, d_in) or (b, d_in), w_out (width, d_out) -> (b, 1, width)
float32 (the real op returns an empty tensor instead when x holds a NaN or an infinity; the
fake gives the normal shape); causal_flash_forward q (b, hq, tq, d) -> [out (b, hq, tq, d)
stored (b, tq, hq, d), lse (b, hq, tq)], float32; causal_flash_backward grad_out, q (b, hq,
tq, d), k, v (b, hkv, tk, d) -> [dq (b, hq, tq, d), dk, dv (b, hkv, tk, d)], contiguous
float32.
"""

from __future__ import annotations

import torch

_registered: set[str] = set()


def _check_device(op: str, first: str, tensors: dict[str, torch.Tensor]) -> None:
    """Every tensor of `tensors` on the device of the one named `first` (the real ops'
    check_device)."""
    device = tensors[first].device
    for name, tensor in tensors.items():
        if tensor.device != device:
            raise RuntimeError(
                f"{op}: {name} is on {tensor.device} but {first} is on {device}: every "
                "tensor must be on one device"
            )


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) bytes of t's storage that t's elements may occupy (non-negative
    strides)."""
    start = t.storage_offset() * t.element_size()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b (neither empty) may share a byte: one storage, spans that meet."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage()._cdata != b.untyped_storage()._cdata:
        return False
    (a0, a1), (b0, b1) = _byte_span(a), _byte_span(b)
    return a0 < b1 and b0 < a1


_DECODE_WRITES = ("keys_t", "values_t", "key_scales", "value_scales")


def _decode_step(
    x, w_qkv, b_qkv, w_out, b_out, cos, sin, q_norm, k_norm, keys_t, values_t, key_scales,
    value_scales, heads, position, slot, first, count, block, scale, norm_eps, norm_offset,
):  # fmt: skip
    tensors = {
        "x": x, "w_qkv": w_qkv, "b_qkv": b_qkv, "w_out": w_out, "b_out": b_out, "cos": cos,
        "sin": sin, "q_norm": q_norm, "k_norm": k_norm, "keys_t": keys_t, "values_t": values_t,
        "key_scales": key_scales, "value_scales": value_scales,
    }  # fmt: skip
    _check_device("decode_step", "x", tensors)
    inputs = [name for name in tensors if name not in _DECODE_WRITES]
    for i, written in enumerate(_DECODE_WRITES):  # each against the later buffers and inputs
        for other in [*_DECODE_WRITES[i + 1 :], *inputs]:
            if _overlap(tensors[written], tensors[other]):
                raise RuntimeError(
                    f"decode_step: {written} and {other} overlap in memory: the op writes "
                    f"{written}, which may share no memory with another argument"
                )
    return x.new_empty((x.shape[0], 1, w_out.shape[0]), dtype=torch.float32)  # (b, 1, width)


def _causal_flash_forward(
    q, k, v, mask, key_start, key_end, scale, causal, q_split, kv_split, diag_split
):
    tensors = {"q": q, "k": k, "v": v, "mask": mask, "key_start": key_start, "key_end": key_end}
    _check_device("causal_flash_forward", "q", tensors)
    batch, heads, tokens, dim = q.shape
    out = q.new_empty((batch, tokens, heads, dim), dtype=torch.float32)  # (b, tq, hq, d)
    lse = q.new_empty((batch, heads, tokens), dtype=torch.float32)  # (b, hq, tq)
    return [out.transpose(1, 2), lse]  # (b, hq, tq, d) stored (b, tq, hq, d)


def _causal_flash_backward(
    grad_out, q, k, v, output, lse, mask, key_start, key_end, scale, causal, q_split, kv_split,
    diag_split,
):  # fmt: skip
    tensors = {
        "grad_out": grad_out, "q": q, "k": k, "v": v, "output": output, "lse": lse, "mask": mask,
        "key_start": key_start, "key_end": key_end,
    }  # fmt: skip
    _check_device("causal_flash_backward", "q", tensors)
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
