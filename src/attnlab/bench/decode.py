"""Decoding figures: tokens per second with a KV cache against recomputing the prefix, cache
bytes per token for multi-head, grouped-query and multi-query heads, and each per-token time
against its floor.

Decoding one token reads every projection weight and the whole cache once, and multiplies
each weight by every sequence of the batch and each cached key and value by every query
head that shares it. Its floor is max(bytes / bandwidth, flops / matmul rate), the two
limits a step cannot beat:

- bytes: the layer's weights and the keys and values it holds (and an int8 cache's scales);
- flops: per sequence, 2 x parameters + 4 x heads x head_dim x tokens held (the
  projections, then each head's scores and values);
- bandwidth: on the CPU a sum over a buffer of twice the last-level cache (at least 256 MiB),
  and each timed step starts after that read has evicted the CPU's caches, so that its bytes
  come from memory too (a 12-layer stack of grouped or multi-query heads, 60 to 80 MB,
  otherwise runs partly from a large last-level cache and beats the memory floor). On a
  CUDA device it is a copy between two 512 MiB buffers (the HBM's copy bandwidth,
  timing.device_copy), and steps run back to back, timed with the device synchronised;
- matmul rate: a 1024^3 product in the modules' dtype on their device (timing.matmul_probe).

Both are measured in the same interleaved rounds as the step they bound, so that a busy
neighbour on a shared machine slows all three alike. Memory binds most rows; the arithmetic
binds where many query heads share each key (multi-query at batch 8, whose 12 heads
multiply each key and value read: 6 flops per float32 byte).

The steps table has a row per head layout (multi-head, grouped-query, multi-query), batch
(1 and 8: the weights are read once for the whole batch, the cache once per sequence),
cache dtype (float32; bfloat16 and int8 at batch 1) and context, each with its own floor.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from attnlab.attention import MultiHeadAttention
from attnlab.bench.timing import bandwidth_probe, interleaved_medians, matmul_probe
from attnlab.mla import MultiHeadLatentAttention

GPT2_SMALL = {"d_model": 768, "num_heads": 12, "layers": 12}


class Floor:
    """A step's floor from its two terms, memory_floor_s and compute_floor_s (fields or
    properties of the row): the larger one, and which it is."""

    memory_floor_s: float
    compute_floor_s: float

    @property
    def floor_s(self) -> float:
        return max(self.memory_floor_s, self.compute_floor_s)

    @property
    def binds(self) -> str:
        """Which term of the floor is larger: "memory" or "compute"."""
        return "memory" if self.memory_floor_s >= self.compute_floor_s else "compute"


@dataclass
class DecodeRow(Floor):
    """One context length: the time to produce the next token, cached and recomputed."""

    context: int
    cached_s: float
    recompute_s: float
    read_bytes_per_s: float
    memory_floor_s: float
    compute_floor_s: float
    flops_per_s: float

    @property
    def speedup(self) -> float:
        return self.recompute_s / self.cached_s

    @property
    def over_floor(self) -> float:
        return self.cached_s / self.floor_s


@dataclass
class CacheRow(Floor):
    """One decode step: head layout, batch, cache dtype and context, its time per layer and
    its floor."""

    layout: str
    num_kv_heads: int
    bytes_per_token: int
    cached_s: float
    read_bytes_per_s: float
    memory_floor_s: float
    compute_floor_s: float
    flops_per_s: float
    batch: int = 1
    cache_dtype: str = "float32"
    context: int = 0

    @property
    def over_floor(self) -> float:
        return self.cached_s / self.floor_s


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
    device: str = "cpu"

    @property
    def read_bytes_per_s(self) -> float:
        """Median read bandwidth over every measured row."""
        rows = [*self.rows, *self.cache_rows]
        return statistics.median(row.read_bytes_per_s for row in rows) if rows else float("nan")

    def to_dict(self) -> dict:
        """Plain numbers for --json, derived ratios included."""
        out = asdict(self)
        for row, raw in zip(self.rows, out["rows"], strict=True):
            raw.update(speedup=row.speedup, floor_s=row.floor_s, over_floor=row.over_floor)
        for row, raw in zip(self.cache_rows, out["cache_rows"], strict=True):
            raw.update(floor_s=row.floor_s, binds=row.binds, over_floor=row.over_floor)
        out["read_bytes_per_s"] = self.read_bytes_per_s
        return out


def run_decode(
    contexts: Sequence[int] = (256, 1024, 4096),
    *,
    d_model: int = GPT2_SMALL["d_model"],
    num_heads: int = GPT2_SMALL["num_heads"],
    layers: int = GPT2_SMALL["layers"],
    kv_heads: Sequence[int] = (),
    batches: Sequence[int] = (1, 8),
    cache_dtypes: Sequence[torch.dtype] = (torch.bfloat16, torch.int8),
    dtype: torch.dtype = torch.float32,
    min_run_time: float = 0.2,
    rounds: int = 3,
    read_bytes: int | None = None,
    device: str | torch.device = "cpu",
    progress: Callable[[str], None] = lambda step: None,
) -> DecodeReport:
    """Measure decoding at each context length: the caches hold context - 1 tokens and the
    step appends one. The step runs through `layers` attention layers, each with its own
    weights and cache, as in a model, so that one layer's data is not still in the CPU's
    cache when it is read again; times are per layer.

    Args:
        contexts: context lengths.
        d_model: model width (d_in = d_out).
        num_heads: query heads.
        layers: layers in the stack.
        kv_heads: the head layouts of the steps table (default num_heads, num_heads / 3
            when it divides, and 1).
        batches: batch sizes of the steps table (float32 caches).
        cache_dtypes: narrower cache dtypes, measured at batch 1 for every layout.
        dtype: the modules' dtype.
        min_run_time: seconds per timing.
        rounds: interleaved rounds per row.
        read_bytes: the buffer read to measure the bandwidth and, on the CPU, before each
            timed step to evict the CPU's caches (default timing.bandwidth_probe's: twice
            the last-level cache, at least 256 MiB, on the CPU; 512 MiB copied on a device).
            The matmul rate is timed beside it (timing.matmul_probe, in `dtype`).
        device: where the layers, caches and inputs live ("cpu" or "cuda").
        progress: called with a description before each row.

    Returns:
        The report: rows (multi-head, batch 1, against recomputing) and cache_rows (every
        layout, batch and cache dtype).
    """
    torch.manual_seed(0)
    device = torch.device(device)
    kv_heads = list(kv_heads) or _default_kv_heads(num_heads)
    probes = bandwidth_probe(device, read_bytes), matmul_probe(device, dtype)
    stack = _stack(d_model, num_heads, num_heads, max(contexts), dtype, layers, device)
    report = DecodeReport(
        d_model,
        num_heads,
        layers,
        str(dtype).removeprefix("torch."),
        torch.get_num_threads(),
        _weight_bytes(stack[0]),
        device=str(device),
    )
    for context in contexts:
        progress(f"context {context}")
        report.rows.append(_decode_row(stack, context, probes, min_run_time, rounds))
    # per layout: the narrower caches, then the module's dtype by batch, batch 1 last (the
    # row the reference table compares with)
    narrow = [(1, d) for d in cache_dtypes if d != dtype]
    kinds = narrow + [(b, dtype) for b in sorted(batches, reverse=True)]
    for heads in kv_heads:
        grouped = stack if heads == num_heads else None
        grouped = grouped or _stack(d_model, num_heads, heads, max(contexts), dtype, layers, device)
        for batch, cache_dtype in kinds:
            progress(f"{heads} key/value heads, batch {batch}, {cache_dtype}")
            rows = layout_rows(grouped, batch, cache_dtype, contexts, probes, min_run_time, rounds)
            report.cache_rows.extend(sorted(rows, key=lambda row: row.context))
    return report


def layout_rows(modules, batch, cache_dtype, contexts, probes, min_run_time, rounds):
    """Yield the steps table's row of each context for one stack, batch and cache dtype,
    longest first (the caches are filled once and cropped back: crop() only goes back)."""
    caches = _filled_caches(modules, batch, max(contexts), cache_dtype)
    for context in sorted(contexts, reverse=True):
        yield _cache_row(modules, caches, context, probes, min_run_time, rounds)


def _default_kv_heads(num_heads: int) -> list[int]:
    grouped = [num_heads // 3] if num_heads % 3 == 0 and num_heads > 3 else []
    return [num_heads, *grouped, 1]


def _stack(d_model, num_heads, num_kv_heads, max_tokens, dtype, layers, device=None):
    """`layers` attention layers in eval mode, each with its own weights."""
    return [
        MultiHeadAttention(
            d_model,
            d_model,
            max_tokens,
            0.0,
            num_heads,
            num_kv_heads=num_kv_heads,
            dtype=dtype,
            device=device,
        ).eval()
        for _ in range(layers)
    ]


def factory(module: MultiHeadAttention) -> dict:
    """The module's dtype and device, for the tensors fed to it."""
    weight = module.out_proj.weight
    return {"dtype": weight.dtype, "device": weight.device}


def timing_options(device: torch.device, read: Callable[[], object]) -> dict:
    """interleaved_medians' options for a step on `device`: on the CPU the step is timed cold
    (after `read` has evicted the caches), on a device back to back."""
    return {"cold": {"cached"}, "flush": read} if device.type == "cpu" else {}


def tolerance(dtype: torch.dtype) -> float:
    """atol = rtol between two ways of computing one decode step's output in `dtype`."""
    return 1e-4 if dtype.itemsize >= 4 else 5e-2


def _weight_bytes(module: MultiHeadAttention) -> int:
    return sum(p.nbytes for p in module.parameters())


def flops_per_sequence(module: nn.Module, tokens: int) -> float:
    """A layer's arithmetic for one sequence's token: 2 x parameters, and the attention over
    `tokens` keys: per head and key, scores and values over head_dim each; latent attention's
    absorbed step, over the latent (r) and rotary (dr) scores and the latent values (its
    up-projections are in the parameters)."""
    parameters = sum(p.numel() for p in module.parameters())
    if isinstance(module, MultiHeadLatentAttention):
        per_key = 2 * module.kv_lora_rank + module.qk_rope_head_dim
        return 2 * parameters + 2 * module.num_heads * per_key * tokens
    return 2 * parameters + 4 * module.num_heads * module.head_dim * tokens


def _measured(candidates: dict, probes, min_run_time: float, rounds: int, device):
    """interleaved_medians of the candidates beside both probes: (medians, bytes per
    second read, flops per second)."""
    (read, read_bytes), (matmul, matmul_flops) = probes
    times = interleaved_medians(
        {**candidates, "read": read, "matmul": matmul},
        rounds=rounds,
        min_run_time=min_run_time,
        **timing_options(device, read),
    )
    return times, read_bytes / times["read"], matmul_flops / times["matmul"]


def stack_step(modules, caches, x: torch.Tensor, context: int, layer=None):
    """A call that decodes x (b, 1, d) at position context - 1 through every layer of the
    stack, each cache cropped to context - 1 tokens first (the timed step); `layer(module,
    hidden, cache)` is the call per layer (default module(hidden, cache=cache))."""
    layer = layer or _cached_call

    def every_layer():
        hidden = x
        with torch.no_grad():
            for module, cache in zip(modules, caches, strict=True):
                cache.crop(context - 1)
                hidden = layer(module, hidden, cache)
        return hidden

    return every_layer


def _cached_call(module: MultiHeadAttention, hidden: torch.Tensor, cache) -> torch.Tensor:
    return module(hidden, cache=cache)


def _decode_steps(modules: Sequence[MultiHeadAttention], context: int):
    """Appending token `context` - 1 to caches holding the tokens before it: through the
    first layer alone, through every layer (the timed step), and the first layer's output
    for that token recomputed from scratch over the whole prefix."""
    first = modules[0]
    x = torch.randn(1, context, first.d_in, **factory(first))  # (b, t, d)
    caches = [module.make_cache(1, context) for module in modules]
    with torch.no_grad():
        first(x[:, :-1], cache=caches[0])  # a real prefill, for the check against recompute
        for cache in caches[1:]:  # the other layers read as many bytes from random keys
            shape = (1, cache.num_kv_heads, context - 1, cache.head_dim)
            filler = torch.randn(shape, **factory(first))  # (b, hkv, t, hd)
            cache.update(filler, filler)

    def first_layer():
        with torch.no_grad():
            caches[0].crop(context - 1)
            return first(x[:, -1:], cache=caches[0])

    every_layer = stack_step(modules, caches, x[:, -1:], context)

    def recompute():
        with torch.no_grad():
            return first(x)[:, -1:]

    return first_layer, every_layer, recompute


def _decode_row(modules, context, probes, min_run_time, rounds) -> DecodeRow:
    first_layer, every_layer, recompute = _decode_steps(modules, context)
    cached, recomputed = first_layer(), recompute()
    close = tolerance(cached.dtype)
    if not torch.allclose(cached, recomputed, atol=close, rtol=close):  # the same token
        error = (cached - recomputed).abs().max().item()
        raise RuntimeError(f"cached decoding differs from recomputing by {error} at {context}")
    candidates = {"cached": every_layer, "recompute": recompute}
    times, bandwidth, rate = _measured(candidates, probes, min_run_time, rounds, cached.device)
    return DecodeRow(
        context,
        cached_s=times["cached"] / len(modules),
        recompute_s=times["recompute"],
        read_bytes_per_s=bandwidth,
        memory_floor_s=_floor(modules[0], context, bandwidth),
        compute_floor_s=flops_per_sequence(modules[0], context) / rate,
        flops_per_s=rate,
    )


def _filled_caches(modules, batch: int, max_tokens: int, cache_dtype: torch.dtype):
    """One cache per layer of `max_tokens` positions holding max_tokens - 1 random tokens
    (the same values in each layer, in its own memory)."""
    first = modules[0]
    shape = (batch, first.num_kv_heads, max_tokens - 1, first.head_dim)
    keys = torch.randn(shape, **factory(first))  # (b, hkv, t, hd)
    values = torch.randn(shape, **factory(first))
    caches = [module.make_cache(batch, max_tokens, dtype=cache_dtype) for module in modules]
    with torch.no_grad():
        for cache in caches:
            cache.update(keys, values)
    return caches


def _cache_row(modules, caches, context, probes, min_run_time, rounds) -> CacheRow:
    """The step of one token at position context - 1 through every layer (the caches are
    cropped to context - 1 tokens before each layer's call)."""
    first, batch = modules[0], caches[0].batch_size
    x = torch.randn(batch, 1, first.d_in, **factory(first))  # (b, 1, d)
    every_layer = stack_step(modules, caches, x, context)
    times, bandwidth, rate = _measured(
        {"cached": every_layer}, probes, min_run_time, rounds, x.device
    )
    cache_dtype = caches[0].dtype
    return CacheRow(
        layout(first),
        first.num_kv_heads,
        _cache_bytes_per_token(first, cache_dtype),
        cached_s=times["cached"] / len(modules),
        read_bytes_per_s=bandwidth,
        memory_floor_s=_floor(first, context, bandwidth, batch, cache_dtype),
        compute_floor_s=batch * flops_per_sequence(first, context) / rate,
        flops_per_s=rate,
        batch=batch,
        cache_dtype=str(cache_dtype).removeprefix("torch."),
        context=context,
    )


def _cache_bytes_per_token(module: MultiHeadAttention, dtype: torch.dtype | None) -> int:
    """A cached position's keys and values (and an int8 cache's scales), in bytes."""
    return module.make_cache(1, 1, dtype=dtype).nbytes


def _floor(
    module: MultiHeadAttention,
    context: int,
    bandwidth: float,
    batch: int = 1,
    cache_dtype: torch.dtype | None = None,
) -> float:
    """A step's memory floor: the weights read once, each sequence's `context` cached
    positions once (a cache in the module's dtype unless `cache_dtype`)."""
    cache_bytes = batch * context * _cache_bytes_per_token(module, cache_dtype)
    return (_weight_bytes(module) + cache_bytes) / bandwidth


def layout(module: MultiHeadAttention) -> str:
    """ "multi-head", "grouped-query" or "multi-query": the module's key/value heads."""
    if module.num_kv_heads == module.num_heads:
        return "multi-head"
    return "multi-query" if module.num_kv_heads == 1 else "grouped-query"
