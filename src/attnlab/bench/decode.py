"""Decoding figures: tokens per second with a KV cache against recomputing the prefix, cache
bytes per token for multi-head, grouped-query and multi-query heads, and each per-token time
against its memory-bandwidth floor.

Decoding one token reads every projection weight and the whole cache once and does little
arithmetic with them, so it is bound by memory traffic: (weight bytes + cache bytes read) /
read bandwidth is the physical limit a step cannot beat. The bandwidth is measured in the
same interleaved rounds as the step it bounds, so that a busy neighbour on a shared machine
slows both alike.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from attnlab.attention import MultiHeadAttention
from attnlab.bench.timing import interleaved_medians, memory_read

GPT2_SMALL = {"d_model": 768, "num_heads": 12, "layers": 12}


@dataclass
class DecodeRow:
    """One context length: the time to produce the next token, cached and recomputed."""

    context: int
    cached_s: float
    recompute_s: float
    read_bytes_per_s: float
    floor_s: float

    @property
    def speedup(self) -> float:
        return self.recompute_s / self.cached_s

    @property
    def over_floor(self) -> float:
        return self.cached_s / self.floor_s


@dataclass
class CacheRow:
    """Cache size per token for one head layout, and its decode step at the longest context."""

    layout: str
    num_kv_heads: int
    bytes_per_token: int
    cached_s: float
    read_bytes_per_s: float
    floor_s: float


@dataclass
class DecodeReport:
    d_model: int
    num_heads: int
    layers: int
    dtype: str
    threads: int
    weight_bytes: int
    rows: list[DecodeRow] = field(default_factory=list)
    cache_rows: list[CacheRow] = field(default_factory=list)

    @property
    def read_bytes_per_s(self) -> float:
        """Median read bandwidth over every measured row."""
        rows = [*self.rows, *self.cache_rows]
        return statistics.median(row.read_bytes_per_s for row in rows) if rows else float("nan")

    def to_dict(self) -> dict:
        """Plain numbers for --json, derived ratios included."""
        out = asdict(self)
        for row, raw in zip(self.rows, out["rows"], strict=True):
            raw.update(speedup=row.speedup, over_floor=row.over_floor)
        out["read_bytes_per_s"] = self.read_bytes_per_s
        return out


def run_decode(
    contexts: Sequence[int] = (256, 1024, 4096),
    *,
    d_model: int = GPT2_SMALL["d_model"],
    num_heads: int = GPT2_SMALL["num_heads"],
    layers: int = GPT2_SMALL["layers"],
    kv_heads: Sequence[int] = (),
    dtype: torch.dtype = torch.float32,
    min_run_time: float = 0.2,
    rounds: int = 3,
    progress: Callable[[str], None] = lambda step: None,
) -> DecodeReport:
    """Measure batch-1 decoding at each context length: the caches hold context - 1 tokens
    and the step appends one. The step runs through `layers` attention layers, each with its
    own weights and cache, as in a model, so that one layer's data is not still in the CPU's
    cache when it is read again; times are per layer. kv_heads: the layouts of the cache
    table (default num_heads, num_heads / 3 when it divides, and 1)."""
    torch.manual_seed(0)
    kv_heads = list(kv_heads) or _default_kv_heads(num_heads)
    reader = memory_read()
    stack = _stack(d_model, num_heads, num_heads, max(contexts), dtype, layers)
    report = DecodeReport(
        d_model,
        num_heads,
        layers,
        str(dtype).removeprefix("torch."),
        torch.get_num_threads(),
        _weight_bytes(stack[0]),
    )
    for context in contexts:
        progress(f"context {context}")
        report.rows.append(_decode_row(stack, context, reader, min_run_time, rounds))
    for heads in kv_heads:
        progress(f"{heads} key/value heads")
        grouped = _stack(d_model, num_heads, heads, max(contexts), dtype, layers)
        report.cache_rows.append(_cache_row(grouped, max(contexts), reader, min_run_time, rounds))
    return report


def _default_kv_heads(num_heads: int) -> list[int]:
    grouped = [num_heads // 3] if num_heads % 3 == 0 and num_heads > 3 else []
    return [num_heads, *grouped, 1]


def _stack(d_model, num_heads, num_kv_heads, max_tokens, dtype, layers):
    """`layers` attention layers in eval mode, each with its own weights."""
    return [
        MultiHeadAttention(
            d_model, d_model, max_tokens, 0.0, num_heads, num_kv_heads=num_kv_heads, dtype=dtype
        ).eval()
        for _ in range(layers)
    ]


def _weight_bytes(module: MultiHeadAttention) -> int:
    return sum(p.nbytes for p in module.parameters())


def _cache_bytes_read(module: MultiHeadAttention, tokens: int, dtype: torch.dtype) -> int:
    """Keys and values of `tokens` positions, read once by a decode step."""
    return 2 * tokens * module.kv_dim * dtype.itemsize


def _decode_steps(modules: Sequence[MultiHeadAttention], context: int):
    """Appending token `context` - 1 to caches holding the tokens before it: through the
    first layer alone, through every layer (the timed step), and the first layer's output
    for that token recomputed from scratch over the whole prefix."""
    first = modules[0]
    x = torch.randn(1, context, first.d_in, dtype=first.out_proj.weight.dtype)  # (b, t, d)
    caches = [module.make_cache(1, context) for module in modules]
    with torch.no_grad():
        first(x[:, :-1], cache=caches[0])  # a real prefill, for the check against recompute
        for cache in caches[1:]:  # the other layers read as many bytes from random keys
            filler = torch.randn(1, cache.num_kv_heads, context - 1, cache.head_dim)
            cache.update(filler, filler)

    def first_layer():
        with torch.no_grad():
            caches[0].crop(context - 1)
            return first(x[:, -1:], cache=caches[0])

    def every_layer():
        hidden = x[:, -1:]  # (b, 1, d)
        with torch.no_grad():
            for module, cache in zip(modules, caches, strict=True):
                cache.crop(context - 1)
                hidden = module(hidden, cache=cache)
        return hidden

    def recompute():
        with torch.no_grad():
            return first(x)[:, -1:]

    return first_layer, every_layer, recompute


def _decode_row(modules, context, reader, min_run_time, rounds) -> DecodeRow:
    first_layer, every_layer, recompute = _decode_steps(modules, context)
    cached, recomputed = first_layer(), recompute()
    if not torch.allclose(cached, recomputed, atol=1e-4, rtol=1e-4):  # the same token, or no race
        error = (cached - recomputed).abs().max().item()
        raise RuntimeError(f"cached decoding differs from recomputing by {error} at {context}")
    read, read_bytes = reader
    times = interleaved_medians(
        {"cached": every_layer, "recompute": recompute, "read": read},
        rounds=rounds,
        min_run_time=min_run_time,
    )
    bandwidth = read_bytes / times["read"]
    per_layer = times["cached"] / len(modules)
    floor = _floor(modules[0], context, bandwidth)
    return DecodeRow(context, per_layer, times["recompute"], bandwidth, floor)


def _cache_row(modules, context, reader, min_run_time, rounds) -> CacheRow:
    _, every_layer, _ = _decode_steps(modules, context)
    read, read_bytes = reader
    times = interleaved_medians(
        {"cached": every_layer, "read": read}, rounds=rounds, min_run_time=min_run_time
    )
    bandwidth = read_bytes / times["read"]
    module = modules[0]
    return CacheRow(
        _layout(module),
        module.num_kv_heads,
        module.make_cache(1, 1).nbytes,
        times["cached"] / len(modules),
        bandwidth,
        _floor(module, context, bandwidth),
    )


def _floor(module: MultiHeadAttention, context: int, bandwidth: float) -> float:
    dtype = module.out_proj.weight.dtype
    return (_weight_bytes(module) + _cache_bytes_read(module, context, dtype)) / bandwidth


def _layout(module: MultiHeadAttention) -> str:
    if module.num_kv_heads == module.num_heads:
        return "multi-head"
    return "multi-query" if module.num_kv_heads == 1 else "grouped-query"
