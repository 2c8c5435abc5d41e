"""attnlab's registered C++ ops are public (anyone can call torch.ops): each checks every
argument itself. Each op is called with valid arguments, then with one argument at a time
pushed out of its contract (wrong dtype, rank, size, layout; negative, zero, huge values;
NaN and infinite scales), in a subprocess, and every refused call must be a RuntimeError
from the op's own check naming the argument: never a signal, a hang, a word on stdout or
stderr (BLAS's parameter errors print there), a returned result, or a changed argument.
The fake kernels (attnlab.fake_ops) pass torch.library.opcheck and trace under
torch.compile(fullgraph=True).

The subprocess runs all of an op's cases in order and reports each one (begun, then its
outcome) on a file; one that dies or hangs is blamed on the case it had begun, and a new
subprocess resumes after it. Run as a module (python -m tests.test_ops_fuzz), this file is
that subprocess. What torch itself prints there (tests.torch_logs) is not the op's.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from attnlab import decode_cpu, flash_cpu
from tests.torch_logs import without_torch_logs

CASE_TIMEOUT = 20.0  # seconds one case may run (each takes milliseconds)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository

# ---------------------------------------------------------------------------------------------
# decode_step: x (b, 1, d_in), w_qkv (d_out + 2 hkv hd, d_in), w_out (d_out, d_out), cos/sin
# (rows, hd), keys_t/values_t (b, hkv, hd * capacity), int8 scales (b, hkv, capacity)

B, D_IN, HEADS, KV_HEADS, HD, CAP, ROWS = 2, 6, 4, 2, 8, 64, 100
D_OUT = HEADS * HD
D_QKV = D_OUT + 2 * KV_HEADS * HD


def decode_args(dtype: torch.dtype = torch.float32, bias: bool = True) -> dict:
    """Valid arguments: position 3 written to slot 3, attending to slots 0..3 (a cache of
    CAP slots in blocks of 16)."""
    g = torch.Generator().manual_seed(0)
    cache = (B, KV_HEADS, HD * CAP)
    scales = (B, KV_HEADS, CAP) if dtype == torch.int8 else (0,)
    return dict(
        x=torch.randn(B, 1, D_IN, generator=g),
        w_qkv=torch.randn(D_QKV, D_IN, generator=g),
        b_qkv=torch.randn(D_QKV, generator=g) if bias else torch.empty(0),
        w_out=torch.randn(D_OUT, D_OUT, generator=g),
        b_out=torch.randn(D_OUT, generator=g) if bias else torch.empty(0),
        cos=torch.randn(ROWS, HD, generator=g),
        sin=torch.randn(ROWS, HD, generator=g),
        q_norm=torch.empty(0),
        k_norm=torch.empty(0),
        keys_t=torch.zeros(cache, dtype=dtype),
        values_t=torch.zeros(cache, dtype=dtype),
        key_scales=torch.zeros(scales),
        value_scales=torch.zeros(scales),
        heads=HEADS,
        position=3,
        slot=3,
        first=0,
        count=4,
        block=16,
        scale=1 / math.sqrt(HD),
        norm_eps=1e-6,
        norm_offset=0.0,
    )


def _every_other(shape, dtype=torch.float32):
    """A non-contiguous tensor of `shape` (every other element of its last dimension)."""
    *lead, last = shape
    return torch.zeros(*lead, 2 * last, dtype=dtype)[..., ::2]


def _int8(**changes):
    """An int8 cache (with its scales), then `changes`."""
    return lambda a: {**decode_args(torch.int8), **changes}


def _cache(*shape, dtype=torch.float32):
    """keys_t and values_t of this shape and dtype."""
    return {"keys_t": torch.zeros(shape, dtype=dtype), "values_t": torch.zeros(shape, dtype=dtype)}


def _head_dim(hd: int, rope: bool) -> dict:
    """Arguments consistent with heads of hd features (not a multiple of 4): the fused
    projection, the rotary tables (or none), the cache and the scale."""
    d_out, d_qkv = HEADS * hd, (HEADS + 2 * KV_HEADS) * hd
    return {
        "w_qkv": torch.randn(d_qkv, D_IN),
        "b_qkv": torch.randn(d_qkv),
        "w_out": torch.randn(D_OUT, d_out),
        "cos": torch.randn(ROWS, hd) if rope else torch.empty(0),
        "sin": torch.randn(ROWS, hd) if rope else torch.empty(0),
        **_cache(B, KV_HEADS, hd * CAP),
        "scale": 1 / math.sqrt(hd),
    }


NO_ROPE = {"cos": torch.empty(0), "sin": torch.empty(0)}
HEAD_NORMS = {"q_norm": torch.randn(HD), "k_norm": torch.randn(HD)}  # Qwen3's, per head
PROJECTION_NORMS = {"q_norm": torch.randn(D_OUT), "k_norm": torch.randn(KV_HEADS * HD)}  # OLMo 2
CACHE = (B, KV_HEADS, HD * CAP)  # keys_t, values_t
SCALES = (B, KV_HEADS, CAP)  # an int8 cache's scales


def _meta(value):
    """`value` on the meta device if it is a tensor."""
    return value.to("meta") if isinstance(value, torch.Tensor) else value


def _sharing(buffer: str, other: str, shape: tuple[int, ...], args: dict) -> dict:
    """`other` (of `shape`) made a view of the first elements of the cache buffer `buffer`."""
    size = math.prod(shape)
    return {other: args[buffer].view(-1)[:size].view(shape)}


def _overlapping_cache() -> dict:
    """keys_t and values_t, each of the cache's shape, overlapping by half of each."""
    size = math.prod(CACHE)
    storage = torch.zeros(size + size // 2)
    return {"keys_t": storage[:size].view(CACHE), "values_t": storage[size // 2 :].view(CACHE)}


def _halves_of_one_buffer() -> dict:
    """keys_t and values_t, the two halves of one buffer: apart, valid."""
    size = math.prod(CACHE)
    storage = torch.zeros(2 * size)
    return {"keys_t": storage[:size].view(CACHE), "values_t": storage[size:].view(CACHE)}


def _int8_scales_aliased(args: dict) -> dict:
    int8 = decode_args(torch.int8)
    return {**int8, "value_scales": int8["key_scales"]}


def _scales_inside_keys() -> dict:
    """An int8 cache whose key scales (float32) are bytes of its keys_t."""
    int8 = decode_args(torch.int8)
    scale_bytes = 4 * math.prod(SCALES)
    inside = int8["keys_t"].view(-1)[:scale_bytes].view(torch.float32).view(SCALES)
    return {**int8, "key_scales": inside}


I8 = torch.int8
# a scale finite as a double and infinite in float32, which the kernels compute in; and the
# largest float32, the largest scale they take
FLOAT32_MAX = torch.finfo(torch.float32).max
SCALE_PAST_FLOAT32 = [
    ("scale_past_float32", "scale", lambda a: {"scale": 1e39}),
    (
        "scale_just_past_float32",
        "scale",
        lambda a: {"scale": math.nextafter(FLOAT32_MAX, math.inf)},
    ),
    ("valid_scale_float32_max", None, lambda a: {"scale": FLOAT32_MAX, **_tiny_token(a)}),
]


def _tiny_token(a: dict) -> dict:
    """decode_step's x and qkv bias made small enough that FLOAT32_MAX x q . k does not
    overflow (the op refuses a score or an output that is not finite); the flash ops'
    arguments as they are."""
    if "x" not in a:
        return {}
    return {"x": a["x"] * 1e-20, "b_qkv": a["b_qkv"] * 1e-20}


# (case, the argument its error must name, the arguments it changes: a -> {name: value}).
# A case named "valid..." must return a result.
DECODE_CASES = [
    ("valid", None, lambda a: {}),
    ("valid_no_bias_no_rope", None, lambda a: {**decode_args(bias=False), **NO_ROPE}),
    ("valid_bfloat16", None, lambda a: decode_args(torch.bfloat16)),
    ("valid_int8", None, lambda a: decode_args(I8)),
    ("valid_rolling_window", None, lambda a: {"position": 99, "slot": 35, "count": CAP}),
    ("valid_block_over_capacity", None, lambda a: {"block": 10**9}),
    ("valid_slot_outside_attended", None, lambda a: {"slot": 40}),
    ("valid_2d_x", None, lambda a: {"x": a["x"][:, 0]}),
    # x
    ("x_batch_8_against_batch_1_cache", "keys_t", lambda a: {"x": torch.randn(8, 1, D_IN)}),
    ("x_batch_0", "x", lambda a: {"x": torch.randn(0, 1, D_IN)}),
    ("x_no_features", "x", lambda a: {"x": torch.randn(B, 1, 0)}),
    ("x_rank_1", "x", lambda a: {"x": torch.randn(D_IN)}),
    ("x_rank_4", "x", lambda a: {"x": torch.randn(B, 1, 1, D_IN)}),
    ("x_two_tokens", "x", lambda a: {"x": torch.randn(B, 2, D_IN)}),
    ("x_float64", "x", lambda a: {"x": a["x"].double()}),
    ("x_bfloat16", "x", lambda a: {"x": a["x"].bfloat16()}),
    ("x_non_contiguous", "x", lambda a: {"x": _every_other((B, 1, D_IN))}),
    ("x_expanded", "x", lambda a: {"x": torch.randn(1, 1, D_IN).expand(B, 1, D_IN)}),
    ("x_wrong_d_in", "w_qkv", lambda a: {"x": torch.randn(B, 1, D_IN + 1)}),
    # w_qkv
    ("w_qkv_rows_short", "w_qkv", lambda a: {"w_qkv": a["w_qkv"][:-1].contiguous()}),
    ("w_qkv_rows_long", "w_qkv", lambda a: {"w_qkv": torch.randn(D_QKV + 4, D_IN)}),
    ("w_qkv_rank_1", "w_qkv", lambda a: {"w_qkv": a["w_qkv"].flatten()}),
    ("w_qkv_float64", "w_qkv", lambda a: {"w_qkv": a["w_qkv"].double()}),
    ("w_qkv_transposed", "w_qkv", lambda a: {"w_qkv": torch.randn(D_IN, D_QKV).t()}),
    # b_qkv
    ("b_qkv_short", "b_qkv", lambda a: {"b_qkv": torch.randn(D_QKV - 1)}),
    ("b_qkv_rank_2", "b_qkv", lambda a: {"b_qkv": torch.randn(1, D_QKV)}),
    ("b_qkv_float64", "b_qkv", lambda a: {"b_qkv": a["b_qkv"].double()}),
    ("b_qkv_non_contiguous", "b_qkv", lambda a: {"b_qkv": _every_other((D_QKV,))}),
    # w_out
    ("w_out_columns_not_heads_x_hd", "w_out", lambda a: {"w_out": torch.randn(D_OUT, D_OUT + 1)}),
    ("w_out_no_rows", "w_out", lambda a: {"w_out": torch.randn(0, D_OUT)}),
    (
        "b_out_of_d_out_for_a_wider_w_out",
        "b_out",
        lambda a: {"w_out": torch.randn(D_OUT + 4, D_OUT)},
    ),
    ("w_out_rank_3", "w_out", lambda a: {"w_out": torch.randn(1, D_OUT, D_OUT)}),
    ("w_out_empty", "w_out", lambda a: {"w_out": torch.randn(0, 0)}),
    ("w_out_float64", "w_out", lambda a: {"w_out": a["w_out"].double()}),
    ("w_out_transposed", "w_out", lambda a: {"w_out": a["w_out"].t()}),
    ("w_out_wider_layer", "w_qkv", lambda a: {"w_out": torch.randn(2 * D_OUT, 2 * D_OUT)}),
    # b_out
    ("b_out_long", "b_out", lambda a: {"b_out": torch.randn(D_OUT + 1)}),
    ("b_out_rank_2", "b_out", lambda a: {"b_out": torch.randn(D_OUT, 1)}),
    ("b_out_float64", "b_out", lambda a: {"b_out": a["b_out"].double()}),
    # cos / sin
    ("cos_without_sin", "sin", lambda a: {"sin": torch.empty(0)}),
    ("sin_without_cos", "cos", lambda a: {"cos": torch.empty(0)}),
    ("cos_wrong_head_dim", "cos", lambda a: {"cos": torch.randn(ROWS, HD + 4)}),
    ("cos_rank_1", "cos", lambda a: {"cos": torch.randn(ROWS * HD)}),
    ("cos_float64", "cos", lambda a: {"cos": a["cos"].double()}),
    ("cos_transposed", "cos", lambda a: {"cos": torch.randn(HD, ROWS).t()}),
    ("sin_fewer_rows", "sin", lambda a: {"sin": torch.randn(ROWS // 2, HD)}),
    ("sin_bfloat16", "sin", lambda a: {"sin": a["sin"].bfloat16()}),
    # q_norm / k_norm, norm_eps / norm_offset
    ("valid_norms_per_head", None, lambda a: {**HEAD_NORMS, "norm_offset": 1.0}),
    ("valid_norms_over_the_projections", None, lambda a: PROJECTION_NORMS),
    ("q_norm_without_k_norm", "k_norm", lambda a: {"q_norm": torch.randn(HD)}),
    ("k_norm_without_q_norm", "q_norm", lambda a: {"k_norm": torch.randn(HD)}),
    ("q_norm_wrong_width", "q_norm", lambda a: {**HEAD_NORMS, "q_norm": torch.randn(HD + 4)}),
    (
        "k_norm_projection_width_per_head",
        "k_norm",
        lambda a: {**HEAD_NORMS, "k_norm": torch.randn(KV_HEADS * HD)},
    ),
    (
        "k_norm_head_width_over_projection",
        "k_norm",
        lambda a: {**PROJECTION_NORMS, "k_norm": torch.randn(HD)},
    ),
    ("q_norm_rank_2", "q_norm", lambda a: {**HEAD_NORMS, "q_norm": torch.randn(1, HD)}),
    ("q_norm_float64", "q_norm", lambda a: {**HEAD_NORMS, "q_norm": torch.randn(HD).double()}),
    ("k_norm_bfloat16", "k_norm", lambda a: {**HEAD_NORMS, "k_norm": torch.randn(HD).bfloat16()}),
    ("k_norm_non_contiguous", "k_norm", lambda a: {**HEAD_NORMS, "k_norm": _every_other((HD,))}),
    ("norm_eps_0", "norm_eps", lambda a: {**HEAD_NORMS, "norm_eps": 0.0}),
    ("norm_eps_negative", "norm_eps", lambda a: {**HEAD_NORMS, "norm_eps": -1e-6}),
    ("norm_eps_nan", "norm_eps", lambda a: {**HEAD_NORMS, "norm_eps": math.nan}),
    ("norm_eps_past_float32", "norm_eps", lambda a: {**HEAD_NORMS, "norm_eps": 1e39}),
    ("norm_offset_inf", "norm_offset", lambda a: {**HEAD_NORMS, "norm_offset": math.inf}),
    ("norm_offset_past_float32", "norm_offset", lambda a: {**HEAD_NORMS, "norm_offset": -1e39}),
    (
        "q_norm_on_meta",
        "q_norm",
        lambda a: {**HEAD_NORMS, "q_norm": torch.randn(HD, device="meta")},
    ),
    (
        "keys_t_shares_k_norm",
        "k_norm",
        lambda a: {**HEAD_NORMS, **_sharing("keys_t", "k_norm", (HD,), a)},
    ),
    # position
    ("position_past_rope_table", "position", lambda a: {"position": ROWS}),
    ("position_huge", "position", lambda a: {"position": 10**12}),
    ("position_negative", "position", lambda a: {"position": -1}),
    ("position_negative_no_rope", "position", lambda a: {"position": -1, **NO_ROPE}),
    # keys_t / values_t
    ("cache_float64", "keys_t", lambda a: {"keys_t": a["keys_t"].double()}),
    ("cache_float16", "keys_t", lambda a: _cache(*CACHE, dtype=torch.float16)),
    ("cache_int32", "keys_t", lambda a: _cache(*CACHE, dtype=torch.int32)),
    ("values_t_other_dtype", "values_t", lambda a: {"values_t": a["values_t"].bfloat16()}),
    ("cache_batch_1", "keys_t", lambda a: _cache(1, KV_HEADS, HD * CAP)),
    ("cache_rank_4", "keys_t", lambda a: _cache(B, KV_HEADS, CAP, HD)),
    ("kv_heads_0", "kv_heads", lambda a: _cache(B, 0, HD * CAP)),
    ("kv_heads_3", "kv_heads", lambda a: _cache(B, 3, HD * CAP)),
    ("kv_heads_8", "kv_heads", lambda a: _cache(B, 8, HD * CAP)),
    ("cache_ragged_row", "keys_t", lambda a: _cache(B, KV_HEADS, HD * CAP + 3)),
    ("cache_no_slots", "keys_t", lambda a: _cache(B, KV_HEADS, 0)),
    ("values_t_shorter", "values_t", lambda a: {"values_t": torch.zeros(B, 2, HD * (CAP - 1))}),
    ("keys_t_non_contiguous", "keys_t", lambda a: {"keys_t": _every_other(CACHE)}),
    ("values_t_non_contiguous", "values_t", lambda a: {"values_t": _every_other(CACHE)}),
    ("keys_t_expanded", "keys_t", lambda a: {"keys_t": torch.zeros(1, 2, HD * CAP).expand(CACHE)}),
    # key_scales / value_scales
    ("int8_without_scales", "key_scales", _int8(key_scales=torch.empty(0))),
    ("int8_without_value_scales", "value_scales", _int8(value_scales=torch.empty(0))),
    ("int8_scales_short", "key_scales", _int8(key_scales=torch.zeros(B, 2, CAP - 1))),
    ("int8_scales_rank_2", "value_scales", _int8(value_scales=torch.zeros(B * 2, CAP))),
    ("int8_scales_float64", "key_scales", _int8(key_scales=torch.zeros(B, 2, CAP).double())),
    ("int8_scales_non_contiguous", "key_scales", _int8(key_scales=_every_other((B, 2, CAP)))),
    ("int8_scales_int8", "value_scales", _int8(value_scales=torch.zeros(B, 2, CAP, dtype=I8))),
    ("float32_cache_with_scales", "key_scales", lambda a: {"key_scales": torch.zeros(B, 2, CAP)}),
    (
        "bfloat16_cache_with_scales",
        "value_scales",
        lambda a: {**decode_args(torch.bfloat16), "value_scales": torch.zeros(B, 2, CAP)},
    ),
    # heads
    ("heads_0", "heads", lambda a: {"heads": 0}),
    ("heads_negative", "heads", lambda a: {"heads": -4}),
    ("heads_3_not_dividing", "heads", lambda a: {"heads": 3}),
    ("heads_5_not_dividing", "heads", lambda a: {"heads": 5}),
    ("heads_64_more_than_d_out", "heads", lambda a: {"heads": 64}),
    ("heads_huge", "heads", lambda a: {"heads": 2**62}),
    ("heads_16_another_w_qkv", "w_qkv", lambda a: {"heads": 16}),  # head_dim 2: 40 rows
    ("valid_head_dim_3_without_rope", None, lambda a: _head_dim(3, rope=False)),
    ("valid_head_dim_6", None, lambda a: _head_dim(6, rope=True)),
    ("head_dim_3_with_rope", "head_dim", lambda a: _head_dim(3, rope=True)),
    ("heads_8_other_layout", "w_qkv", lambda a: {"heads": 8}),
    ("heads_1_fewer_than_kv_heads", "kv_heads", lambda a: {"heads": 1}),
    # slot
    ("slot_10_000_000", "slot", lambda a: {"slot": 10_000_000}),
    ("slot_negative", "slot", lambda a: {"slot": -5}),
    ("slot_capacity", "slot", lambda a: {"slot": CAP}),
    ("slot_most_negative", "slot", lambda a: {"slot": -(2**63)}),
    # first / count
    ("first_negative", "first", lambda a: {"first": -1}),
    ("first_capacity", "first", lambda a: {"first": CAP, "count": 1}),
    ("first_huge", "first", lambda a: {"first": 2**62}),
    ("count_0", "count", lambda a: {"count": 0}),
    ("count_negative", "count", lambda a: {"count": -1}),
    ("count_10_000_000", "count", lambda a: {"count": 10_000_000}),
    ("count_past_capacity", "count", lambda a: {"first": 60, "count": 5}),
    ("count_overflowing_first", "count", lambda a: {"first": 1, "count": 2**63 - 1}),
    # block
    ("block_0", "block", lambda a: {"block": 0}),
    ("block_negative", "block", lambda a: {"block": -16}),
    ("block_most_negative", "block", lambda a: {"block": -(2**63)}),
    # scale
    ("scale_nan", "scale", lambda a: {"scale": math.nan}),
    ("scale_inf", "scale", lambda a: {"scale": math.inf}),
    ("scale_minus_inf", "scale", lambda a: {"scale": -math.inf}),
    ("scale_0", "scale", lambda a: {"scale": 0.0}),
    ("scale_negative", "scale", lambda a: {"scale": -0.5}),
    *SCALE_PAST_FLOAT32,
    # devices: a meta tensor among CPU ones (the dispatcher sends the call to the fake kernel)
    ("x_on_meta", "x", lambda a: {"x": a["x"].to("meta")}),
    ("w_out_on_meta", "w_out", lambda a: {"w_out": a["w_out"].to("meta")}),
    ("keys_t_on_meta", "keys_t", lambda a: {"keys_t": a["keys_t"].to("meta")}),
    ("b_qkv_empty_on_meta", "b_qkv", lambda a: {"b_qkv": torch.empty(0, device="meta")}),
    (
        "int8_value_scales_on_meta",
        "value_scales",
        _int8(value_scales=torch.zeros(SCALES, device="meta")),
    ),
    ("all_but_x_on_meta", "x", lambda a: {k: _meta(v) for k, v in a.items() if k != "x"}),
    # memory the op writes shared with another argument
    ("values_t_is_keys_t", "values_t", lambda a: {"values_t": a["keys_t"]}),
    ("values_t_overlaps_keys_t", "values_t", lambda a: _overlapping_cache()),
    ("keys_t_shares_w_out", "w_out", lambda a: _sharing("keys_t", "w_out", (D_OUT, D_OUT), a)),
    ("values_t_shares_x", "x", lambda a: _sharing("values_t", "x", (B, 1, D_IN), a)),
    ("keys_t_shares_cos", "cos", lambda a: _sharing("keys_t", "cos", (ROWS, HD), a)),
    ("int8_value_scales_is_key_scales", "value_scales", _int8_scales_aliased),
    ("int8_key_scales_inside_keys_t", "key_scales", lambda a: _scales_inside_keys()),
    ("valid_inputs_share_memory", None, lambda a: {"sin": a["cos"], "b_out": a["b_qkv"][:D_OUT]}),
    ("valid_buffers_halves_of_one", None, lambda a: _halves_of_one_buffer()),
]

# ---------------------------------------------------------------------------------------------
# causal_flash_forward: q (b, hq, tq, d), k/v (b, hkv, tk, d), mask broadcastable to
# (b, hq, tq, tk), key ranges int64 (b,)

FB, HQ, HKV, TQ, TK, D = 2, 4, 2, 12, 16, 8
LONG = torch.int64


def flash_args() -> dict:
    g = torch.Generator().manual_seed(0)
    return dict(
        q=torch.randn(FB, HQ, TQ, D, generator=g),
        k=torch.randn(FB, HKV, TK, D, generator=g),
        v=torch.randn(FB, HKV, TK, D, generator=g),
        mask=torch.empty(0),
        key_start=torch.empty(0, dtype=LONG),
        key_end=torch.empty(0, dtype=LONG),
        scale=1 / math.sqrt(D),
        causal=True,
        q_split=128,
        kv_split=512,
        diag_split=32,
    )


def _kv(*shape, dtype=torch.float32):
    return {"k": torch.randn(*shape, dtype=dtype), "v": torch.randn(*shape, dtype=dtype)}


def _ranges(starts, ends, dtype=LONG):
    return {
        "key_start": torch.tensor(starts, dtype=dtype),
        "key_end": torch.tensor(ends, dtype=dtype),
    }


FLASH_CASES = [
    ("valid", None, lambda a: {}),
    ("valid_not_causal", None, lambda a: {"causal": False}),
    ("valid_broadcast_mask", None, lambda a: {"mask": torch.zeros(1, 1, TQ, TK)}),
    ("valid_full_mask", None, lambda a: {"mask": torch.zeros(FB, HQ, TQ, TK)}),
    ("valid_key_ranges", None, lambda a: _ranges([0, 3], [TK, 10])),
    ("valid_empty_ranges", None, lambda a: _ranges([TK, 0], [TK, 0])),
    ("valid_small_blocks", None, lambda a: {"q_split": 5, "kv_split": 3, "diag_split": 2}),
    ("valid_token_stride", None, lambda a: {"q": torch.randn(FB, HQ, TQ, 2 * D)[..., :D]}),
    # q / k / v
    ("q_rank_3", "q", lambda a: {"q": torch.randn(HQ, TQ, D)}),
    ("k_rank_5", "k", lambda a: _kv(1, FB, HKV, TK, D)),
    ("v_rank_3", "v", lambda a: {"v": torch.randn(HKV, TK, D)}),
    ("q_float64", "q", lambda a: {"q": a["q"].double()}),
    ("k_bfloat16", "k", lambda a: _kv(FB, HKV, TK, D, dtype=torch.bfloat16)),
    ("v_float16", "v", lambda a: {"v": a["v"].half()}),
    ("q_features_strided", "q", lambda a: {"q": torch.randn(FB, HQ, TQ, 2 * D)[..., ::2]}),
    (
        "k_tokens_overlapping",
        "k",
        lambda a: {
            "k": torch.randn(FB * HKV * TK * D).as_strided((FB, HKV, TK, D), (64, 32, 1, 1))
        },
    ),
    (
        "q_token_stride_past_int_max",
        "q",
        lambda a: {"q": torch.randn(FB * HQ * D).as_strided((FB, HQ, 1, D), (HQ * D, D, 2**40, 1))},
    ),
    ("head_dim_0", "q", lambda a: {"q": torch.randn(FB, HQ, TQ, 0), **_kv(FB, HKV, TK, 0)}),
    ("k_head_dim_4_q_8", "k", lambda a: _kv(FB, HKV, TK, 4)),
    ("q_head_dim_4_k_8", "k", lambda a: {"q": torch.randn(FB, HQ, TQ, 4)}),
    ("v_shorter_than_k", "v", lambda a: {"v": torch.randn(FB, HKV, TK - 4, D)}),
    ("v_fewer_heads", "v", lambda a: {"v": torch.randn(FB, 1, TK, D)}),
    ("v_other_head_dim", "v", lambda a: {"v": torch.randn(FB, HKV, TK, 2 * D)}),
    ("kv_batch_1", "k", lambda a: _kv(1, HKV, TK, D)),
    ("kv_heads_0", "heads", lambda a: _kv(FB, 0, TK, D)),
    ("kv_heads_3", "heads", lambda a: _kv(FB, 3, TK, D)),
    ("kv_heads_8", "heads", lambda a: _kv(FB, 8, TK, D)),
    # mask
    ("mask_float64", "mask", lambda a: {"mask": torch.zeros(FB, HQ, TQ, TK).double()}),
    ("mask_bool", "mask", lambda a: {"mask": torch.ones(FB, HQ, TQ, TK, dtype=torch.bool)}),
    ("mask_rank_2", "mask", lambda a: {"mask": torch.zeros(TQ, TK)}),
    ("mask_rank_5", "mask", lambda a: {"mask": torch.zeros(1, FB, HQ, TQ, TK)}),
    ("mask_fewer_keys", "mask", lambda a: {"mask": torch.zeros(FB, HQ, TQ, TK - 1)}),
    ("mask_more_queries", "mask", lambda a: {"mask": torch.zeros(1, 1, TQ + 1, TK)}),
    ("mask_batch_3", "mask", lambda a: {"mask": torch.zeros(3, 1, TQ, TK)}),
    ("mask_4d_empty", "mask", lambda a: {"mask": torch.zeros(FB, HQ, TQ, 0)}),
    # key ranges
    ("key_start_without_key_end", "key_end", lambda a: {"key_start": torch.zeros(FB, dtype=LONG)}),
    ("key_end_without_key_start", "key_start", lambda a: {"key_end": torch.zeros(FB, dtype=LONG)}),
    ("key_ranges_int32", "key_start", lambda a: _ranges([0, 0], [TK, TK], torch.int32)),
    ("key_ranges_float", "key_start", lambda a: _ranges([0, 0], [TK, TK], torch.float32)),
    ("key_ranges_batch_3", "key_start", lambda a: _ranges([0, 0, 0], [TK, TK, TK])),
    ("key_ranges_rank_2", "key_start", lambda a: _ranges([[0], [0]], [[TK], [TK]])),
    (
        "key_start_non_contiguous",
        "key_start",
        lambda a: {**_ranges([0, 0], [TK, TK]), "key_start": torch.zeros(2 * FB, dtype=LONG)[::2]},
    ),
    ("key_start_negative", "key range", lambda a: _ranges([-1, 0], [TK, TK])),
    ("key_end_past_keys", "key range", lambda a: _ranges([0, 0], [TK, TK + 1])),
    ("key_end_10_pow_9", "key range", lambda a: _ranges([0, 0], [10**9, TK])),
    ("key_start_after_key_end", "key range", lambda a: _ranges([0, 9], [TK, 8])),
    ("key_start_most_negative", "key range", lambda a: _ranges([0, -(2**63)], [TK, TK])),
    # scale
    ("scale_nan", "scale", lambda a: {"scale": math.nan}),
    ("scale_inf", "scale", lambda a: {"scale": math.inf}),
    ("scale_minus_inf", "scale", lambda a: {"scale": -math.inf}),
    ("scale_0", "scale", lambda a: {"scale": 0.0}),
    ("scale_negative", "scale", lambda a: {"scale": -0.5}),
    *SCALE_PAST_FLOAT32,
    # devices: a meta tensor among CPU ones (the dispatcher sends the call to the fake kernel)
    ("k_on_meta", "k", lambda a: {"k": a["k"].to("meta")}),
    ("q_on_meta", "q", lambda a: {"q": a["q"].to("meta")}),
    ("mask_on_meta", "mask", lambda a: {"mask": torch.zeros(1, 1, TQ, TK, device="meta")}),
    ("mask_empty_on_meta", "mask", lambda a: {"mask": torch.empty(0, device="meta")}),
    (
        "key_ranges_on_meta",
        "key_start",
        lambda a: {k: _meta(v) for k, v in _ranges([0, 3], [TK, 10]).items()},
    ),
    ("all_but_q_on_meta", "q", lambda a: {k: _meta(v) for k, v in a.items() if k != "q"}),
    ("valid_all_on_meta", None, lambda a: {k: _meta(v) for k, v in a.items()}),
    ("valid_v_is_k", None, lambda a: {"v": a["k"]}),
    # block sizes
    ("q_split_0", "q_split", lambda a: {"q_split": 0}),
    ("q_split_negative", "q_split", lambda a: {"q_split": -128}),
    ("q_split_huge", "q_split", lambda a: {"q_split": 2**40}),
    ("kv_split_0", "kv_split", lambda a: {"kv_split": 0, "diag_split": 0}),
    ("kv_split_huge", "kv_split", lambda a: {"kv_split": 2**40}),
    ("diag_split_0", "diag_split", lambda a: {"diag_split": 0}),
    ("diag_split_negative", "diag_split", lambda a: {"diag_split": -32}),
    ("diag_split_past_kv_split", "diag_split", lambda a: {"diag_split": 513}),
]

# ---------------------------------------------------------------------------------------------
# causal_flash_backward: the forward's arguments (each case of FLASH_CASES again) and grad_out,
# output (q's shape and row layout), lse (b, hq, tq) contiguous


def flash_backward_args() -> dict:
    forward = flash_args()
    g = torch.Generator().manual_seed(1)
    out = torch.randn(FB, TQ, HQ, D, generator=g).transpose(1, 2)  # as the forward stores it
    return dict(
        grad_out=torch.randn(FB, HQ, TQ, D, generator=g),
        q=forward["q"],
        k=forward["k"],
        v=forward["v"],
        output=out,
        lse=torch.randn(FB, HQ, TQ, generator=g),
        **{name: forward[name] for name in ("mask", "key_start", "key_end", "scale", "causal")},
        q_split=128,
        kv_split=128,
        diag_split=32,
    )


def _expanded(*shape):
    """Random values of `shape` expanded to (FB, HQ, TQ, D) (stride 0 where shape has 1)."""
    return torch.randn(*shape).expand(FB, HQ, TQ, D)


def _stepped(*shape):
    """Random values of `shape` whose features are every other element of a wider row."""
    *lead, last = shape
    return torch.randn(*lead, 2 * last)[..., ::2]


FLASH_BACKWARD_CASES = [
    *FLASH_CASES,
    ("valid_non_square_blocks", None, lambda a: {"q_split": 3, "kv_split": 7, "diag_split": 7}),
    ("valid_grad_out_expanded_batch", None, lambda a: {"grad_out": _expanded(1, HQ, TQ, D)}),
    ("grad_out_rank_3", "grad_out", lambda a: {"grad_out": torch.randn(HQ, TQ, D)}),
    ("grad_out_float64", "grad_out", lambda a: {"grad_out": a["grad_out"].double()}),
    ("grad_out_more_tokens", "grad_out", lambda a: {"grad_out": torch.randn(FB, HQ, TQ + 1, D)}),
    ("grad_out_fewer_heads", "grad_out", lambda a: {"grad_out": torch.randn(FB, HKV, TQ, D)}),
    ("grad_out_features_strided", "grad_out", lambda a: {"grad_out": _stepped(FB, HQ, TQ, D)}),
    ("grad_out_tokens_expanded", "grad_out", lambda a: {"grad_out": _expanded(FB, HQ, 1, D)}),
    ("output_bfloat16", "output", lambda a: {"output": a["output"].bfloat16()}),
    ("output_batch_1", "output", lambda a: {"output": torch.randn(1, HQ, TQ, D)}),
    ("output_head_dim_4", "output", lambda a: {"output": torch.randn(FB, HQ, TQ, 4)}),
    ("output_features_strided", "output", lambda a: {"output": _stepped(FB, HQ, TQ, D)}),
    ("lse_rank_4", "lse", lambda a: {"lse": torch.randn(FB, HQ, TQ, 1)}),
    ("lse_float64", "lse", lambda a: {"lse": a["lse"].double()}),
    ("lse_fewer_tokens", "lse", lambda a: {"lse": torch.randn(FB, HQ, TQ - 1)}),
    ("lse_kv_heads", "lse", lambda a: {"lse": torch.randn(FB, HKV, TQ)}),
    ("lse_non_contiguous", "lse", lambda a: {"lse": torch.randn(FB, HQ, 2 * TQ)[..., ::2]}),
    ("lse_empty", "lse", lambda a: {"lse": torch.empty(0)}),
]

OPS = {
    "decode_step": ("attnlab_decode", decode_cpu, decode_args, DECODE_CASES),
    "causal_flash_forward": ("attnlab", flash_cpu, flash_args, FLASH_CASES),
    "causal_flash_backward": ("attnlab", flash_cpu, flash_backward_args, FLASH_BACKWARD_CASES),
    "decode_step_direct": (None, decode_cpu, decode_args, DECODE_CASES),
}
# a face of an op bound directly for Python (pybind11, as the module calls it) -> the op whose
# checked function it binds; it must refuse every case as the registered op does
DIRECT = {"decode_step_direct": "decode_step"}
REGISTERED = [name for name in OPS if name not in DIRECT]
VALID_SHAPES = {  # what a valid call returns: shapes of its tensors
    "decode_step": [[B, 1, D_OUT]],
    "decode_step_direct": [[B, 1, D_OUT]],
    "causal_flash_forward": [[FB, HQ, TQ, D], [FB, HQ, TQ]],
    "causal_flash_backward": [[FB, HQ, TQ, D], [FB, HKV, TK, D], [FB, HKV, TK, D]],
}


# ---------------------------------------------------------------------------------------------
# the subprocess


def _child(op_name: str, start: int, report_path: str) -> None:
    """Run cases start.. of `op_name`, each with fd 1 and 2 sent to a file of its own, and
    report each (begun, then its outcome and anything printed) as JSON lines."""
    namespace, module, make_args, cases = OPS[op_name]
    if module.load_error() is not None:  # built by the parent: loaded silently here
        raise SystemExit(module.load_error())
    op = (
        decode_cpu._op()
        if op_name in DIRECT
        else getattr(getattr(torch.ops, namespace), op_name).default
    )
    libc = ctypes.CDLL(None)
    saved = os.dup(1), os.dup(2)
    with open(report_path, "a") as report:
        for index in range(start, len(cases)):
            report.write(json.dumps({"begin": index}) + "\n")
            report.flush()
            args = make_args()
            args.update(cases[index][2](args))
            before = {k: t.clone() for k, t in args.items() if isinstance(t, torch.Tensor)}
            with tempfile.TemporaryFile() as printed:
                sys.stdout.flush(), sys.stderr.flush()
                os.dup2(printed.fileno(), 1), os.dup2(printed.fileno(), 2)
                try:
                    result = op(**args)
                    outcome = {"returned": _shapes(result)}
                except Exception as error:
                    outcome = {"raised": type(error).__name__, "message": str(error)}
                finally:
                    sys.stdout.flush(), sys.stderr.flush()
                    libc.fflush(None)  # C's stdio buffers (BLAS's messages)
                    os.dup2(saved[0], 1), os.dup2(saved[1], 2)
                printed.seek(0)
                outcome["printed"] = without_torch_logs(printed.read().decode(errors="replace"))
            if "raised" in outcome:
                outcome["changed"] = [k for k, t in before.items() if not _same(t, args[k])]
            report.write(json.dumps({"end": index, **outcome}) + "\n")
            report.flush()


def _shapes(result) -> list[list[int]]:
    tensors = result if isinstance(result, (list, tuple)) else [result]
    return [list(t.shape) for t in tensors]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device:
        return False
    if a.device.type == "meta":  # no values to compare
        return a.shape == b.shape and a.dtype == b.dtype
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def _differs(a, b) -> bool:
    """Whether a case's value differs from the valid one (values, dtype, shape or strides)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return not (_same(a, b) and a.stride() == b.stride())
    return type(a) is not type(b) or a != b


# ---------------------------------------------------------------------------------------------
# the parent


def _run_cases(op_name: str, tmp_dir: str) -> tuple[dict[int, dict], list[str]]:
    """Every case's outcome (a case that killed or hung its subprocess: {"died": returncode}
    or {"hung": seconds}), and what the subprocesses themselves printed or returned wrong."""
    cases = OPS[op_name][3]
    outcomes: dict[int, dict] = {}
    problems: list[str] = []
    start, run = 0, 0
    while start < len(cases):
        report = os.path.join(tmp_dir, f"{op_name}-{run}.jsonl")
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            process = subprocess.Popen(  # run as a module: it imports tests.torch_logs
                [sys.executable, "-m", "tests.test_ops_fuzz", op_name, str(start), report],
                stdout=out,
                stderr=err,
                cwd=ROOT,
            )
            begun, since, hung = None, time.monotonic(), False
            while process.poll() is None:
                time.sleep(0.02)
                events = _read(report)
                last = events[-1] if events else None
                if last is not None and "begin" in last and last["begin"] != begun:
                    begun, since = last["begin"], time.monotonic()
                if time.monotonic() - since > CASE_TIMEOUT:
                    process.kill()
                    process.wait()
                    hung = True
            events = _read(report)
            for event in events:
                if "end" in event:
                    outcomes[event.pop("end")] = event
            unfinished = [e["begin"] for e in events if "begin" in e and e["begin"] not in outcomes]
            if unfinished:  # the case it had begun killed it, or hung
                index = unfinished[0]
                outcomes[index] = {"hung": CASE_TIMEOUT} if hung else {"died": process.returncode}
                start = index + 1
            else:
                if process.returncode != 0 or len(outcomes) < len(cases):
                    problems.append(f"run {run} exited {process.returncode} after case {start}")
                start = len(cases)
            for stream, what in ((out, "stdout"), (err, "stderr")):
                stream.seek(0)
                text = without_torch_logs(stream.read().decode(errors="replace"))
                if text and not unfinished:
                    problems.append(f"run {run} printed on {what}: {text[-2000:]}")
        run += 1
    return outcomes, problems


def _read(path: str) -> list[dict]:
    try:
        with open(path) as report:
            lines = report.read().splitlines()
    except FileNotFoundError:
        return []
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:  # a line still being written
            break
    return events


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Each op's outcomes and problems, run once per module."""
    done: dict[str, tuple[dict[int, dict], list[str]]] = {}

    def get(op_name):
        if op_name not in done:
            module = OPS[op_name][1]
            if not module.available():
                pytest.skip(f"{op_name}'s extension is unavailable: {module.load_error()}")
            done[op_name] = _run_cases(op_name, str(tmp_path_factory.mktemp(op_name)))
        return done[op_name]

    return get


CASES = [(op, index, case[0]) for op, spec in OPS.items() for index, case in enumerate(spec[3])]


@pytest.mark.parametrize(("op_name", "index", "case"), CASES, ids=[f"{o}-{c}" for o, _, c in CASES])
def test_every_out_of_range_argument_is_a_runtime_error(op_name, index, case, results):
    outcomes, problems = results(op_name)
    assert not problems, problems
    outcome = outcomes.get(index)
    assert outcome is not None, f"{case}: no outcome reported"
    assert "died" not in outcome, f"{case}: the process died (returncode {outcome['died']})"
    assert "hung" not in outcome, f"{case}: the call hung (> {outcome['hung']} s)"
    assert outcome["printed"] == "", f"{case} printed: {outcome['printed']!r}"
    name = OPS[op_name][3][index][1]
    if name is None:  # a valid call
        assert "raised" not in outcome, f"{case} raised {outcome}"
        assert outcome["returned"] == VALID_SHAPES[op_name]
        return
    assert "returned" not in outcome, f"{case} returned a result {outcome['returned']}"
    assert outcome["raised"] == "RuntimeError", outcome
    message = outcome["message"]
    assert message.startswith(f"{DIRECT.get(op_name, op_name)}: "), (
        message
    )  # the op's own check, not torch's
    assert re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", message), (name, message)
    assert outcome["changed"] == [], f"{case} changed {outcome['changed']} before raising"


def test_the_fuzz_cases_cover_every_argument():
    """Each argument of each op's schema is pushed out of range by at least one case."""
    for op_name in REGISTERED:
        namespace, module, make_args, cases = OPS[op_name]
        if not module.available():
            continue
        schema = getattr(getattr(torch.ops, namespace), op_name).default._schema
        valid = make_args()
        changed = set()
        for _, name, change in cases:
            if name is not None:
                changed |= {k for k, v in change(valid).items() if _differs(v, valid[k])}
        arguments = {a.name for a in schema.arguments} - {"causal"}  # any bool is valid
        assert arguments <= changed, (op_name, arguments - changed)


# ---------------------------------------------------------------------------------------------
# fake kernels


def _op_and_args(op_name):
    namespace, module, make_args, _ = OPS[op_name]
    if not module.available():
        pytest.skip(f"{op_name}'s extension is unavailable: {module.load_error()}")
    return getattr(getattr(torch.ops, namespace), op_name).default, make_args()


@pytest.mark.parametrize("op_name", REGISTERED)
def test_fake_kernels_pass_opcheck(op_name):
    op, args = _op_and_args(op_name)
    torch.library.opcheck(op, (), args)


@pytest.mark.parametrize("op_name", REGISTERED)
def test_fake_kernel_matches_the_real_outputs(op_name):
    """Shapes, strides and dtypes of the fake kernel's outputs equal the real op's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    op, args = _op_and_args(op_name)
    real = op(**args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
                     for k, v in args.items()}  # fmt: skip
        fake = op(**fake_args)
    real, fake = (r if isinstance(r, list) else [r] for r in (real, fake))
    assert [(t.shape, t.stride(), t.dtype) for t in fake] == [
        (t.shape, t.stride(), t.dtype) for t in real
    ]


def test_the_fake_decode_step_refuses_what_it_writes_shared_with_another_argument():
    """All on meta (the fake kernel's call): the buffers the op writes are refused where
    they share memory with another argument, as the real op refuses them; apart, valid."""
    op, args = _op_and_args("decode_step")
    meta = {k: _meta(v) for k, v in args.items()}
    assert op(**meta).shape == (B, 1, D_OUT)
    shared = [
        ({"values_t": meta["keys_t"]}, "keys_t and values_t"),
        (_sharing("keys_t", "w_out", (D_OUT, D_OUT), meta), "keys_t and w_out"),
        (_sharing("values_t", "x", (B, 1, D_IN), meta), "values_t and x"),
    ]
    int8 = {k: _meta(v) for k, v in decode_args(torch.int8).items()}
    shared.append(({**int8, "value_scales": int8["key_scales"]}, "key_scales and value_scales"))
    for change, names in shared:
        with pytest.raises(RuntimeError, match=f"^decode_step: {names} overlap in memory"):
            op(**{**meta, **change})
    storage = torch.empty(2 * math.prod(CACHE), device="meta")
    halves = {"keys_t": storage[: math.prod(CACHE)].view(CACHE),
              "values_t": storage[math.prod(CACHE) :].view(CACHE)}  # fmt: skip
    assert op(**{**meta, **halves}).shape == (B, 1, D_OUT)


@pytest.mark.parametrize("op_name", REGISTERED)
def test_the_fake_kernels_refuse_tensors_on_two_devices_under_fake_tensor_mode(op_name):
    """Under FakeTensorMode (torch.compile's tracing), a CPU tensor among meta ones is
    refused by the fake kernel, naming it, as the real op would refuse it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    op, args = _op_and_args(op_name)
    first = next(name for name, value in args.items() if isinstance(value, torch.Tensor))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = {k: mode.from_tensor(_meta(v)) if isinstance(v, torch.Tensor) else v
                for k, v in args.items()}  # fmt: skip
        fake[first] = mode.from_tensor(args[first])  # on the CPU
        with pytest.raises(RuntimeError, match=rf"^{op_name}: .*\b{first} is on cpu"):
            op(**fake)


def test_compile_traces_both_ops_in_one_graph():
    """torch.compile(fullgraph=True) traces calls to both ops (their fake kernels), with
    the same results as eager calls, the decode step's cache writes included."""
    decode, decode_kwargs = _op_and_args("decode_step")
    flash, flash_kwargs = _op_and_args("causal_flash_forward")

    def both(decode_kwargs, flash_kwargs):
        y = decode(**decode_kwargs)
        out, lse = flash(**flash_kwargs)
        return y + 1, out * 2, lse

    compiled = torch.compile(both, fullgraph=True, backend="aot_eager")
    eager_decode = {k: v.clone() if isinstance(v, torch.Tensor) else v
                    for k, v in decode_kwargs.items()}  # fmt: skip
    expected = both(eager_decode, flash_kwargs)
    got = compiled(decode_kwargs, flash_kwargs)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    torch.testing.assert_close(decode_kwargs["keys_t"], eager_decode["keys_t"], atol=0, rtol=0)
    assert decode_kwargs["keys_t"].abs().sum() > 0  # the compiled call wrote the cache


def test_compile_traces_the_backward_op():
    """The backward op traces under torch.compile(fullgraph=True) (its fake kernel) with the
    eager call's results."""
    backward, kwargs = _op_and_args("causal_flash_backward")

    def grads(kwargs):
        dq, dk, dv = backward(**kwargs)
        return dq * 2, dk + 1, dv

    compiled = torch.compile(grads, fullgraph=True, backend="aot_eager")
    for got, expected in zip(compiled(kwargs), grads(kwargs), strict=True):
        torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_torch_s_own_log_lines_on_the_subprocess_stderr_are_not_the_op_s(tmp_path, monkeypatch):
    """A subprocess that prints torch's own start-up line (as the CUDA wheels do when
    torch.utils.cpp_extension is imported: "No CUDA runtime is found") reports no problem
    and no case printing: they fail on what the op prints, not on what torch does."""
    if not decode_cpu.available():
        pytest.skip(f"the decode step is unavailable: {decode_cpu.load_error()}")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(  # as torch 2.14 logs it, and as 2.13 printed it
        "import sys\n"
        "print('W1126 08:05:38.917000 14272 torch/utils/cpp_extension.py:183] No CUDA runtime "
        "is found, using CUDA_HOME=/usr/local', file=sys.stderr)\n"
        "print('No CUDA runtime is found, using CUDA_HOME=/usr/local/cuda', file=sys.stderr)\n"
        # as CI logged it, torch installed in a virtual environment under the working folder
        "print('W1126 13:32:42.612000 7218 .venv-newest/lib/python3.11/site-packages/torch/utils/"
        "cpp_extension.py:183] No CUDA runtime is found, using CUDA_HOME=/usr/local', "
        "file=sys.stderr)\n"
    )
    paths = [str(site), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    outcomes, problems = _run_cases("decode_step", str(tmp_path))
    assert problems == []
    assert len(outcomes) == len(DECODE_CASES)
    assert all(outcome.get("printed") == "" for outcome in outcomes.values())


if __name__ == "__main__":  # the subprocess of _run_cases
    _child(sys.argv[1], int(sys.argv[2]), sys.argv[3])
