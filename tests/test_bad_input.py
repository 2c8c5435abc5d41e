"""One table over the public API: each argument of each public function and constructor,
given each kind of wrong value, raises a ValueError or TypeError whose message names the
argument; each value that means the same as a valid one (a numpy scalar for an int or a
float, an expanded or non-contiguous view of a tensor) gives the same result as the plain
value. A new argument without its check fails a row here.

Row ids read `<function>-<argument>-<kind>`. Checks are plain `if`s, not `assert`s, and the
file also runs under `python -O` (the last test), where asserts in the library vanish.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import attnlab
from attnlab import alibi, book, functional, interop, masks, rope
from attnlab._validate import MAX_SIZE
from attnlab.kv_cache import KVCache
from attnlab.parallel import ring_attention, shard_sequence, tensor_parallel
from attnlab.static_cache import StaticKVCache

ERROR, SAME, MISSING = "error", "same", "missing file"
D, HEADS, T = 8, 2, 4  # small sizes keep the whole table in seconds


def fail(message: str) -> None:
    """An `assert` that survives python -O."""
    pytest.fail(message, pytrace=False)


# --- the kinds of value ---------------------------------------------------------------------
# A case: (label, make(good value) -> the value under test, expectation, reference(good value)
# -> the value whose result it must equal, for SAME rows).


def int_cases(minimum: int = 1) -> list[tuple]:
    cases = [
        ("str", str, ERROR, None),
        ("float", float, ERROR, None),
        ("bool", lambda v: True, ERROR, None),
        ("numpy-int", np.int64, SAME, lambda v: v),
        ("nan", lambda v: math.nan, ERROR, None),
        ("inf", lambda v: math.inf, ERROR, None),
        ("negative", lambda v: -1, ERROR, None),
    ]
    if minimum >= 1:
        cases.append(("zero", lambda v: 0, ERROR, None))
    return cases


def size_cases(minimum: int = 1) -> list[tuple]:
    """int_cases, and values past attnlab's one bound on sizes and positions (MAX_SIZE):
    2**63 once overflowed inside torch or wrapped a position silently."""
    return [
        *int_cases(minimum),
        ("past-int64", lambda v: 2**63, ERROR, None),
        ("past-bound", lambda v: MAX_SIZE + 1, ERROR, None),
    ]


def float_cases(*, zero_ok: bool = True, one_ok: bool = True) -> list[tuple]:
    cases = [
        ("str", str, ERROR, None),
        ("bool", lambda v: True, ERROR, None),
        ("numpy-float32", np.float32, SAME, lambda v: v),  # values exact in float32
        ("nan", lambda v: math.nan, ERROR, None),
        ("inf", lambda v: math.inf, ERROR, None),
        ("negative", lambda v: -0.5, ERROR, None),
    ]
    if not zero_ok:
        cases.append(("zero", lambda v: 0.0, ERROR, None))
    if not one_ok:
        cases.append(("one", lambda v: 1.0, ERROR, None))
    return cases


BOOL_CASES = [
    ("str", lambda v: "False", ERROR, None),
    ("int", lambda v: 1, ERROR, None),
    ("none", lambda v: None, ERROR, None),
]


def expanded(t: torch.Tensor) -> torch.Tensor:
    """Stride 0 along the first axis longer than 1 (its first slice repeated)."""
    axis = next(i for i, n in enumerate(t.shape) if n > 1)
    return t.narrow(axis, 0, 1).expand(t.shape)


def stepped(t: torch.Tensor) -> torch.Tensor:
    """The same values at stride 2 in the last axis (a non-contiguous view)."""
    return torch.stack([t, t], dim=-1)[..., 0]


def contiguous_of(view: Callable) -> Callable:
    return lambda t: view(t).contiguous()


VIEW_CASES = [
    ("expanded", expanded, SAME, contiguous_of(expanded)),
    ("non-contiguous", stepped, SAME, contiguous_of(stepped)),
]


def tensor_cases(*, paired: bool = True, half: bool = True) -> list[tuple]:
    """A floating-point data tensor. paired: it must share dtype and device with others."""
    cases = [
        ("list", lambda t: t.tolist(), ERROR, None),
        ("rank", lambda t: t[0], ERROR, None),
        ("int-dtype", lambda t: t.long(), ERROR, None),
        ("bool-dtype", lambda t: t > 0, ERROR, None),
        *VIEW_CASES,
    ]
    if paired:
        cases.append(("meta-device", lambda t: t.to("meta"), ERROR, None))
        if half:
            cases.append(("float16", lambda t: t.half(), ERROR, None))
    return cases


def mask_cases(*, paired: bool = True, shape: bool = True) -> list[tuple]:
    """A bool mask (True = may attend)."""
    cases = [
        ("list", lambda m: m.tolist(), ERROR, None),
        ("int-dtype", lambda m: m.long(), ERROR, None),
        ("uint8-dtype", lambda m: m.to(torch.uint8), ERROR, None),
        *VIEW_CASES,
    ]
    if shape:
        cases.append(("shape", lambda m: torch.cat([m, m], dim=-1), ERROR, None))
    if paired:
        cases.append(("meta-device", lambda m: m.to("meta"), ERROR, None))
    return cases


def additive_cases() -> list[tuple]:
    """An additive float mask: finite, or -inf where blocked."""
    return [
        (
            "nan",
            lambda m: m.masked_fill(torch.ones_like(m, dtype=torch.bool), math.nan),
            ERROR,
            None,
        ),
        (
            "plus-inf",
            lambda m: m.masked_fill(torch.ones_like(m, dtype=torch.bool), math.inf),
            ERROR,
            None,
        ),
    ]


def index_cases(*, paired: bool = False) -> list[tuple]:
    """A 1-D integer tensor (positions, lengths)."""
    cases = [
        ("list", lambda t: t.tolist(), ERROR, None),
        ("numpy-array", lambda t: t.numpy(), ERROR, None),
        ("float-dtype", lambda t: t.float(), ERROR, None),
        ("bool-dtype", lambda t: t > 0, ERROR, None),
        ("2-D", lambda t: t.unsqueeze(0), ERROR, None),
        *VIEW_CASES,
    ]
    if paired:
        cases.append(("meta-device", lambda t: t.to("meta"), ERROR, None))
    return cases


def dtype_cases() -> list[tuple]:
    return [
        ("int64", lambda d: torch.int64, ERROR, None),
        ("bool", lambda d: torch.bool, ERROR, None),
        ("str", lambda d: "float32", ERROR, None),
    ]


def other_cases(*values: tuple[str, object]) -> list[tuple]:
    """Fixed wrong values (an object of the wrong class, an unknown name)."""
    return [(label, lambda v, value=value: value, ERROR, None) for label, value in values]


# --- the public API ---------------------------------------------------------------------------


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def seeded(build: Callable) -> Callable:
    """`build` with torch's seed fixed first, so that two calls make the same weights."""

    def call(**kwargs):
        torch.manual_seed(0)
        return build(**kwargs)

    return call


def qkv() -> dict:
    return {
        "q": randn(2, HEADS, T, D),
        "k": randn(2, HEADS, T, D, seed=1),
        "v": randn(2, HEADS, T, D, seed=2),
    }


def causal_bool(b: int = 2) -> torch.Tensor:
    return masks.causal_mask(T).expand(b, HEADS, T, T).clone()  # (b, h, t, t)


def mha(**config) -> attnlab.MultiHeadAttention:
    torch.manual_seed(0)
    return attnlab.MultiHeadAttention(D, D, 16, 0.0, HEADS, **config)


def mha_forward(**kwargs):
    cross = kwargs.pop("cross", False)
    module = mha(context_dim=6, causal=False) if cross else mha()
    return module(**kwargs)


def mha_cached(**kwargs):
    module = mha()
    cache = kwargs.pop("cache", None)
    return module(kwargs.pop("x"), cache=module.make_cache(2) if cache == "own" else cache)


def mha_make_cache(**kwargs):
    cache = mha().make_cache(**kwargs)
    return cache.keys.shape, cache.dtype, cache.max_tokens


def kv_cache(**kwargs):
    return KVCache(**kwargs)


def kv_method(name: str):
    def call(**kwargs):
        cache = KVCache(2, 8, HEADS, D)
        cache.update(randn(2, HEADS, 4, D), randn(2, HEADS, 4, D, seed=1))
        result = getattr(cache, name)(**kwargs)
        return result, cache.position, cache.keys.clone()

    return call


def kv_update(**kwargs):
    cache = KVCache(2, 8, HEADS, D)
    keys, values, positions = cache.update(**kwargs)
    return keys.clone(), values.clone(), positions, cache.position


def rope_forward(**kwargs):
    return rope.RotaryEmbedding(D, 16)(**kwargs)


def apply_rotary_args() -> dict:
    cos, sin = rope.rotary_tables(D, T, 10000.0)
    return {"x": randn(2, HEADS, T, D), "cos": cos, "sin": sin}


def world1() -> None:
    """A one-process gloo group for the parallel rows (created once, kept for the file)."""
    if not dist.is_initialized():
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)


@pytest.fixture(autouse=True, scope="module")
def _destroy_the_group_after_the_file():
    """world1's group must not outlive this file: later tests (the README's and docs'
    scale-out examples) initialise their own."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def shard(**kwargs):
    world1()
    return shard_sequence(**kwargs)


def ring(**kwargs):
    world1()
    return ring_attention(**kwargs)


def torch_mha() -> nn.MultiheadAttention:
    torch.manual_seed(0)
    return nn.MultiheadAttention(D, HEADS, batch_first=True)


def torch_masks_args() -> dict:
    return {
        "attn_mask": ~masks.causal_mask(T).expand(2 * HEADS, T, T).clone(),  # (b*h, t, t)
        "key_padding_mask": torch.tensor([[False] * T, [False] * (T - 1) + [True]]),
        "num_heads": HEADS,
    }


def _audit(**kwargs):
    from attnlab.check import audit

    return audit(**kwargs)


def _save(**kwargs):
    return attnlab.save(**kwargs)


# (row id prefix, function called with keyword arguments, good arguments, {argument: cases},
#  {argument: name its message must contain} where that differs from the argument)
TABLE: list[tuple[str, Callable, Callable[[], dict], dict, dict]] = [
    (
        "functional.attention",
        functional.attention,
        lambda: {**qkv(), "mask": causal_bool(), "causal": False},
        {
            "q": tensor_cases(),
            "k": tensor_cases(),
            "v": tensor_cases(),
            "mask": mask_cases(),
            "causal": BOOL_CASES,
            "need_weights": BOOL_CASES,
            "training": BOOL_CASES,
            "backend": other_cases(("unknown", "fast"), ("int", 3)),
        },
        {},
    ),
    (
        "functional.attention[additive]",
        functional.attention,
        lambda: {**qkv(), "mask": masks.to_additive(causal_bool())},
        {"mask": additive_cases()},
        {},
    ),
    (
        "functional.attention[scale]",
        functional.attention,
        lambda: {**qkv(), "scale": 0.5},
        {"scale": float_cases(zero_ok=False)},
        {},
    ),
    (
        "functional.attention[dropout]",
        functional.attention,
        lambda: {**qkv(), "dropout_p": 0.0, "training": False},
        {"dropout_p": float_cases()},
        {},
    ),
    (
        "MultiHeadAttention",
        seeded(attnlab.MultiHeadAttention),
        lambda: {"d_in": D, "d_out": D, "context_length": 16, "dropout": 0.0, "num_heads": HEADS},
        {
            "d_in": size_cases(),
            "d_out": size_cases(),
            "context_length": size_cases(),
            "num_heads": size_cases(),
            "dropout": float_cases(),
            "qkv_bias": BOOL_CASES,
            "causal": BOOL_CASES,
            "rope": BOOL_CASES,
            "backend": other_cases(("unknown", "fast"), ("int", 3)),
            "dtype": dtype_cases(),
            "device": other_cases(("unknown", "nowhere"), ("int", 3.5)),
        },
        {},
    ),
    (
        "MultiHeadAttention[options]",
        seeded(attnlab.MultiHeadAttention),
        lambda: {
            "d_in": D,
            "d_out": D,
            "context_length": 16,
            "dropout": 0.0,
            "num_heads": HEADS,
            "num_kv_heads": 1,
            "context_dim": 6,
            "window": 4,
        },
        {"num_kv_heads": size_cases(), "context_dim": size_cases(), "window": int_cases()},
        {},
    ),
    (
        "MultiHeadAttention[rope]",
        seeded(attnlab.MultiHeadAttention),
        lambda: {
            "d_in": D,
            "d_out": D,
            "context_length": 16,
            "dropout": 0.0,
            "num_heads": HEADS,
            "rope": True,
            "rope_base": 10000.0,
        },
        {"rope_base": float_cases(zero_ok=False, one_ok=False)},
        {},
    ),
    (
        "MultiHeadAttention[rope-off]",
        seeded(attnlab.MultiHeadAttention),
        lambda: {
            "d_in": D,
            "d_out": D,
            "context_length": 16,
            "dropout": 0.0,
            "num_heads": HEADS,
            "rope_base": 10000.0,
        },
        {"rope_base": [c for c in float_cases(one_ok=False) if c[2] == ERROR]},
        {},
    ),
    (
        "MultiHeadAttention.forward",
        mha_forward,
        lambda: {"x": randn(2, T, D), "mask": causal_bool()},
        {"x": tensor_cases(), "mask": mask_cases(), "need_weights": BOOL_CASES},
        {},
    ),
    (
        "MultiHeadAttention.forward[cross]",
        mha_forward,
        lambda: {"x": randn(2, T, D), "context": randn(2, 5, 6), "cross": True},
        {"context": tensor_cases()},
        {},
    ),
    (
        "MultiHeadAttention.forward[cache]",
        mha_cached,
        lambda: {"x": randn(2, T, D), "cache": "own"},
        {
            "cache": other_cases(
                ("dict", {}),
                ("batch", KVCache(3, 16, HEADS, D // HEADS)),
                ("dtype", KVCache(2, 16, HEADS, D // HEADS, dtype=torch.float64)),
                ("head_dim", KVCache(2, 16, HEADS, 2)),
            )
        },
        {},
    ),
    (
        "MultiHeadAttention.make_cache",
        mha_make_cache,
        lambda: {"batch_size": 2, "max_tokens": 8},
        {"batch_size": size_cases(), "max_tokens": size_cases(), "dtype": dtype_cases()},
        {},
    ),
    (
        "KVCache",
        kv_cache,
        lambda: {
            "batch_size": 2,
            "max_tokens": 8,
            "num_kv_heads": HEADS,
            "head_dim": D,
            "window": 4,
        },
        {
            "batch_size": size_cases(),
            "max_tokens": size_cases(),
            "num_kv_heads": size_cases(),
            "head_dim": size_cases(),
            "window": int_cases(),
            "dtype": dtype_cases(),
            "device": other_cases(("unknown", "nowhere")),
        },
        {},
    ),
    (
        "KVCache.crop",
        kv_method("crop"),
        lambda: {"num_tokens": 2},
        {"num_tokens": size_cases(0)},
        {},
    ),
    (
        "KVCache.check_room",
        kv_method("check_room"),
        lambda: {"num_new": 2},
        {"num_new": size_cases()},
        {},
    ),
    (
        "KVCache.update",
        kv_update,
        lambda: {"k": randn(2, HEADS, 3, D), "v": randn(2, HEADS, 3, D, seed=1)},
        {"k": tensor_cases(), "v": tensor_cases()},
        {},
    ),
    (
        "RotaryEmbedding",
        lambda **kw: rope.RotaryEmbedding(**kw).cos,
        lambda: {"head_dim": D, "max_positions": 16, "base": 10000.0},
        {
            "head_dim": [*size_cases(), ("odd", lambda v: 3, ERROR, None)],
            "max_positions": size_cases(),
            "base": float_cases(zero_ok=False, one_ok=False),
        },
        {},
    ),
    (
        "RotaryEmbedding.forward",
        rope_forward,
        lambda: {"x": randn(2, HEADS, T, D), "start": 1},
        {
            "x": [
                *tensor_cases(half=False),
                ("head_dim", lambda t: t[..., :6], ERROR, None),
                ("too-long", lambda t: torch.cat([t] * 5, dim=2), ERROR, None),
            ],
            "start": size_cases(0),
        },
        {},
    ),
    (
        "rope.rotary_tables",
        rope.rotary_tables,
        lambda: {"head_dim": D, "num_positions": T, "base": 10000.0},
        {
            "head_dim": size_cases(),
            "num_positions": size_cases(),
            "base": float_cases(zero_ok=False, one_ok=False),
        },
        {},
    ),
    (
        "rope.apply_rotary",
        rope.apply_rotary,
        apply_rotary_args,
        {
            "x": [
                *[c for c in tensor_cases(half=False) if c[0] != "rank"],
                ("1-D", lambda t: t[0, 0, 0], ERROR, None),
                ("3-D", lambda t: t[0], SAME, lambda t: t[0]),
                ("odd-head_dim", lambda t: t[..., :5], ERROR, None),
            ],
            "cos": [*tensor_cases(half=False), ("positions", lambda t: t[:-1], ERROR, None)],
            "sin": [*tensor_cases(half=False), ("positions", lambda t: t[:-1], ERROR, None)],
        },
        {},
    ),
    (
        "rope.check_base",
        rope.check_base,
        lambda: {"base": 10000.0},
        {"base": float_cases(one_ok=False)},
        {"base": "rope_base"},
    ),
    (
        "alibi.slopes",
        alibi.slopes,
        lambda: {"num_heads": 6},
        # past the bound: tests/test_masks.py, under an alarm (the old code's hang)
        {"num_heads": size_cases()},
        {},
    ),
    (
        "alibi.bias",
        alibi.bias,
        lambda: {"head_slopes": alibi.slopes(HEADS), "num_queries": 3, "num_keys": 5},
        {
            "head_slopes": tensor_cases(paired=False),
            "num_queries": size_cases(0),
            "num_keys": size_cases(0),
        },
        {},
    ),
    (
        "masks.causal_mask",
        masks.causal_mask,
        lambda: {"num_queries": 3, "num_keys": 5, "offset": 1},
        {"num_queries": size_cases(0), "num_keys": size_cases(0), "offset": size_cases(0)},
        {},
    ),
    (
        "masks.sliding_window_mask",
        masks.sliding_window_mask,
        lambda: {"num_queries": 3, "num_keys": 5, "window": 2},
        {"num_queries": size_cases(0), "num_keys": size_cases(0), "window": int_cases()},
        {},
    ),
    (
        "masks.aligned_positions",
        masks.aligned_positions,
        lambda: {"num_queries": 3, "num_keys": 5, "offset": 1},
        {"num_queries": size_cases(0), "num_keys": size_cases(0), "offset": size_cases(0)},
        {},
    ),
    (
        "masks.visible_keys",
        masks.visible_keys,
        lambda: {"query_position": 5, "window": 3},
        {"query_position": size_cases(0), "window": int_cases()},
        {},
    ),
    (
        "masks.position_mask",
        masks.position_mask,
        lambda: {
            "query_positions": torch.tensor([3, 4]),
            "key_positions": torch.tensor([4, 0, 1, 2, 3]),
            "window": 3,
        },
        {
            "query_positions": index_cases(paired=True),
            "key_positions": index_cases(paired=True),
            "window": int_cases(),
        },
        {},
    ),
    (
        "masks.padding_mask_from_lengths",
        masks.padding_mask_from_lengths,
        lambda: {"lengths": torch.tensor([2, 4]), "num_keys": 4},
        {
            "lengths": [*index_cases(), ("negative", lambda t: -t, ERROR, None)],
            "num_keys": size_cases(),
        },
        {},
    ),
    (
        "masks.padding_mask",
        masks.padding_mask,
        lambda: {"keep": torch.tensor([[True, True, False], [True, False, False]])},
        {
            "keep": [c for c in mask_cases(paired=False, shape=False)]
            + [("3-D", lambda m: m[None], ERROR, None)]
        },
        {},
    ),
    (
        "masks.combine_masks",
        lambda masks_0: masks.combine_masks(masks_0, masks.causal_mask(T)),
        lambda: {"masks_0": causal_bool()},
        {"masks_0": mask_cases(paired=False)},
        {"masks_0": "masks"},
    ),
    (
        "masks.combine_masks",
        lambda masks_0, masks_1: masks.combine_masks(masks_0, masks_1),
        lambda: {"masks_0": masks.to_additive(causal_bool()), "masks_1": masks.causal_mask(T)},
        {"masks_0": additive_cases(), "masks_1": mask_cases()},
        {"masks_0": "masks", "masks_1": "masks"},
    ),
    (
        "masks.from_torch_mask",
        masks.from_torch_mask,
        lambda: {"mask": ~causal_bool()},
        {"mask": [c for c in mask_cases(paired=False, shape=False) if c[0] != "uint8-dtype"]},
        {},
    ),
    (
        "masks.to_torch_mask",
        masks.to_torch_mask,
        lambda: {"mask": causal_bool()},
        {"mask": mask_cases(paired=False, shape=False)},
        {},
    ),
    (
        "masks.to_additive",
        masks.to_additive,
        lambda: {"mask": causal_bool(), "dtype": torch.float32},
        {"mask": mask_cases(paired=False, shape=False), "dtype": dtype_cases()},
        {},
    ),
    (
        "parallel.shard_sequence",
        shard,
        lambda: {"x": randn(2, HEADS, T, D), "dim": 2, "layout": "zigzag"},
        {
            "x": [
                ("list", lambda t: t.tolist(), ERROR, None),
                ("numpy-array", lambda t: t.numpy(), ERROR, None),
                ("0-D", lambda t: t.sum(), ERROR, None),
                *VIEW_CASES,
            ],
            "dim": [
                ("str", str, ERROR, None),
                ("float", float, ERROR, None),
                ("bool", lambda v: True, ERROR, None),
                ("numpy-int", np.int64, SAME, lambda v: v),
                ("out-of-range", lambda v: 4, ERROR, None),
                ("out-of-range-negative", lambda v: -5, ERROR, None),
                ("numpy-array", lambda v: np.array([v]), ERROR, None),
            ],
            "layout": other_cases(("unknown", "spiral"), ("int", 1)),
        },
        {},
    ),
    (
        "parallel.ring_attention",
        ring,
        lambda: {**qkv(), "causal": True},
        {
            "q": tensor_cases(),
            "k": tensor_cases(),
            "v": tensor_cases(),
            "causal": BOOL_CASES,
            "layout": other_cases(("unknown", "spiral")),
            "backend": other_cases(("unknown", "fast")),
        },
        {},
    ),
    (
        "parallel.tensor_parallel",
        tensor_parallel,
        lambda: {"module": mha(), "mesh": None},
        {"module": other_cases(("linear", nn.Linear(2, 2)))},
        {},
    ),
    (
        "interop.from_torch",
        interop.from_torch,
        lambda: {"m": torch_mha(), "context_length": 16},
        {"m": other_cases(("linear", nn.Linear(2, 2))), "context_length": size_cases()},
        {},
    ),
    (
        "interop.to_torch",
        interop.to_torch,
        lambda: {"m": mha()},
        {"m": other_cases(("torch-mha", nn.MultiheadAttention(4, 2)))},
        {},
    ),
    (
        "interop.from_book",
        interop.from_book,
        lambda: {"m": mha()},
        {"m": other_cases(("linear", nn.Linear(2, 2)))},
        {},
    ),
    (
        "interop.from_torch_masks",
        interop.from_torch_masks,
        torch_masks_args,
        {
            "attn_mask": mask_cases(paired=False, shape=False),
            "key_padding_mask": [
                ("list", lambda m: m.tolist(), ERROR, None),
                ("uint8-dtype", lambda m: m.to(torch.uint8), ERROR, None),
                ("int-dtype", lambda m: m.long(), ERROR, None),
                ("3-D", lambda m: m[None], ERROR, None),
                *VIEW_CASES,
            ],
            "num_heads": size_cases(),
        },
        {},
    ),
    (
        "book.CausalAttention",
        seeded(book.CausalAttention),
        lambda: {"d_in": 3, "d_out": 2, "context_length": 6, "dropout": 0.0, "qkv_bias": False},
        {
            "d_in": size_cases(),
            "d_out": size_cases(),
            "context_length": size_cases(),
            "dropout": float_cases(),
            "qkv_bias": BOOL_CASES,
        },
        {},
    ),
    (
        "book.MultiHeadAttention",
        seeded(book.MultiHeadAttention),
        lambda: {"d_in": 3, "d_out": 4, "context_length": 6, "dropout": 0.0, "num_heads": 2},
        {
            "d_in": size_cases(),
            "d_out": size_cases(),
            "num_heads": size_cases(),
            "dropout": float_cases(),
        },
        {},
    ),
    (
        "book.MultiHeadAttentionWrapper",
        seeded(book.MultiHeadAttentionWrapper),
        lambda: {"d_in": 3, "d_out": 2, "context_length": 6, "dropout": 0.0, "num_heads": 2},
        {"d_in": size_cases(), "num_heads": size_cases(), "dropout": float_cases()},
        {},
    ),
    (
        "book.SelfAttention_v1",
        seeded(book.SelfAttention_v1),
        lambda: {"d_in": 3, "d_out": 2},
        {"d_in": size_cases(), "d_out": size_cases()},
        {},
    ),
    (
        "book.SelfAttention_v2",
        seeded(book.SelfAttention_v2),
        lambda: {"d_in": 3, "d_out": 2, "qkv_bias": False},
        {"d_in": int_cases(), "d_out": int_cases(), "qkv_bias": BOOL_CASES},
        {},
    ),
    (
        "book.MultiHeadSelfAttention",
        seeded(book.MultiHeadSelfAttention),
        lambda: {"D": 4, "heads": 2},
        {"D": int_cases(), "heads": int_cases()},
        {},
    ),
    (  # attnlab.check is another module's: a few rows
        "check.audit",
        _audit,
        lambda: {"module": mha(), "context_length": 8},
        {
            "module": other_cases(("str", "module")),
            "context_length": [("negative", lambda v: -3, ERROR, None)],
        },
        {},
    ),
    (  # attnlab.save / load are another module's: a few rows
        "save",
        _save,
        lambda: {"module": mha(), "path": "unused.safetensors"},
        {"module": other_cases(("linear", nn.Linear(2, 2)))},
        {},
    ),
    ("load", attnlab.load, lambda: {"path": "x"}, {"path": other_cases(("int", 123))}, {}),
]


def _rows():
    for prefix, fn, good, arguments, names in TABLE:
        for argument, cases in arguments.items():
            for label, make, expect, reference in cases:
                yield pytest.param(
                    fn,
                    good,
                    argument,
                    make,
                    expect,
                    reference,
                    names.get(argument, argument),
                    id=f"{prefix}-{argument}-{label}",
                )


# --- the test -------------------------------------------------------------------------------


def same(got: object, want: object, where: str = "result") -> None:
    """Equal results: tensors close (views may take another kernel path), numbers of the same
    type (a numpy integer kept in a config is a bug), modules in config, attributes, weights."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            fail(f"{where}: {type(got).__name__} instead of a tensor")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {m}")
    elif isinstance(want, (tuple, list)):
        if type(got) is not type(want) or len(got) != len(want):
            fail(f"{where}: {got!r} != {want!r}")
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            same(a, b, f"{where}[{i}]")
    elif isinstance(want, nn.Module):
        same(_attributes(got), _attributes(want), f"{where} attributes")
        same(list(got.state_dict().values()), list(want.state_dict().values()), f"{where} weights")
    elif isinstance(want, KVCache):
        same(_attributes(got), _attributes(want), f"{where} attributes")
        same((got.keys, got.values), (want.keys, want.values), f"{where} contents")
    elif type(got) is not type(want) or got != want:
        fail(f"{where}: {got!r} ({type(got).__name__}) != {want!r} ({type(want).__name__})")


def _attributes(obj: object) -> list:
    plain = (int, float, bool, str, type(None), np.generic)
    return [(k, v) for k, v in sorted(vars(obj).items()) if isinstance(v, plain)]


@pytest.mark.parametrize(
    ("fn", "good", "argument", "make", "expect", "reference", "name"), list(_rows())
)
def test_bad_input(fn, good, argument, make, expect, reference, name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # save/load rows write nowhere else
    kwargs = good()
    value = make(kwargs.get(argument))
    if expect == SAME:
        got = fn(**{**kwargs, argument: value})
        fresh = good()
        same(got, fn(**{**fresh, argument: reference(fresh[argument])}))
        return
    try:
        fn(**{**kwargs, argument: value})
    except (TypeError, ValueError) as error:
        if name not in str(error):
            fail(f"the {type(error).__name__} does not name {name!r}: {error}")
    except Exception as error:  # the row fails with what was raised
        fail(f"{type(error).__name__} instead of a ValueError/TypeError naming {name!r}: {error}")
    else:
        fail(f"no error for {argument}={value!r}")


def test_load_of_a_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        attnlab.load(tmp_path / "absent.safetensors")


def test_numpy_sizes_are_plain_ints_in_the_config():
    """A numpy integer for a size is normalised to int where it is kept (save then works)."""
    module = attnlab.MultiHeadAttention(
        np.int64(D), np.int64(D), np.int64(16), 0.0, np.int64(HEADS)
    )
    kinds = {key: type(value) for key, value in module.config.items() if key != "dropout"}
    wrong = {key: kind for key, kind in kinds.items() if kind is np.int64}
    if wrong:
        fail(f"numpy integers kept in the config: {wrong}")


@pytest.mark.skipif(bool(os.environ.get("ATTNLAB_BAD_INPUT_UNDER_O")), reason="the -O run itself")
def test_the_table_holds_under_python_dash_o():
    """The same rows with asserts stripped: no check may be an `assert`."""
    env = {**os.environ, "ATTNLAB_BAD_INPUT_UNDER_O": "1"}
    result = subprocess.run(
        [sys.executable, "-O", "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-x"],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).parents[1],
        timeout=300,
    )
    if result.returncode != 0:
        fail(f"under python -O:\n{result.stdout[-4000:]}{result.stderr[-2000:]}")


HUGE = 2**30  # each factor within MAX_SIZE; their product is not


@pytest.mark.parametrize(
    ("build", "names"),
    [
        (lambda: attnlab.MultiHeadAttention(HUGE, HUGE, 16, 0.0, 2), "d_in x d_out"),
        (
            lambda: attnlab.MultiHeadAttention(8, HUGE, 16, 0.0, 2, context_dim=HUGE),
            "context_dim x d_out",
        ),
        (lambda: attnlab.KVCache(HUGE, HUGE, 2, 4), "batch_size x num_kv_heads"),
        (lambda: attnlab.KVCache(2, HUGE, HUGE, 4, window=2**62), "x capacity x"),
        (lambda: StaticKVCache(HUGE, HUGE, 2, 4), "batch_size x num_kv_heads"),
        (lambda: book.CausalAttention(3, 2, HUGE, 0.0), "context_length x context_length"),
        (lambda: book.MultiHeadAttention(3, 2, HUGE, 0.0, 1), "context_length x context_length"),
        (lambda: book.SelfAttention_v2(HUGE, HUGE), "d_in x d_out"),
        (lambda: book.causal_future_mask(HUGE), "num_tokens x num_tokens"),
        (lambda: book.additive_causal_mask(HUGE), "num_tokens x num_tokens"),
    ],
)
def test_a_product_of_sizes_past_the_bound_is_named(build, names):
    """Sizes each within MAX_SIZE whose tensor would hold more than MAX_SIZE elements: a
    ValueError naming the factors, before torch's "Storage size calculation overflowed"."""
    with pytest.raises(ValueError, match=re.escape(names)):
        build()
