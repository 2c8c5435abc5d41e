"""Decoding as a model runs it: a stack of layers back to back, warm, against the floor of
both limits a step can meet.

A stack of `layers` MultiHeadAttention layers (each its own weights and cache, float32,
no_grad) takes a prompt of `context` tokens, then `steps` single-token steps, each through
the whole stack (each layer's output is the next one's input); a row's figure is the median
step. Within a step the layers run back to back as in a user's model, each layer's weights
and cache read with whatever the layers before left in the CPU's caches (the cold figures of
attnlab.bench.decode flush them before each step instead).

The floor of a step is max(bytes / bandwidth, flops / matmul rate):

- bytes: every weight of the stack and every cache byte held (keys, values and an int8
  cache's scales), read once per step;
- flops: per sequence, 2 x parameters + 4 x heads x head_dim x tokens held, per layer;
- bandwidth: a 256 MiB `torch.sum` (the faster of two) before every fifth step, the row's
  figure their median, so that the steps are judged by the memory system as it was while
  they ran: a shared host's bandwidth moves under a virtual machine within seconds (seen on
  the 2-core machine of 2026-11-27: a 256 MiB read at 31-35 GB/s, then for 1 to 5 s at
  50-62, then back; docs/guide/benchmarks.md), and one probe after the row, as before,
  judged the row by whichever it met. A probe evicts the last-level cache, so the step
  after it (4 of 20, above the median) finds nothing of the step before there;
- matmul rate: a 1024^3 float32 matmul, best of 5, right after each row.

Which of the two terms is larger (binds) is reported per row. A profile (`profile_layer`)
splits one layer's step into what can be timed apart: the two projections (F.linear), the
native op (projections, rotary, cache append, attention over the cache, output projection,
in one C++ call), and the module call around it (checks, plan, Python); the attention over
the cache is the op less its projections (the scores, softmax and values are one fused
pass over the keys and cannot be timed apart).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from attnlab import decode_cpu, plan
from attnlab.attention import MultiHeadAttention
from attnlab.bench import decode, timing
from attnlab.mla import MultiHeadLatentAttention

MODEL = {"d_model": 768, "num_heads": 12, "layers": 12}
BANDWIDTH_BYTES = 256 * 2**20
MATMUL_SIZE = timing.MATMUL_SIZE
BEST_OF = 5
PROBE_EVERY = 5  # steps between two probes of the bandwidth
PROBE_READS = 2  # reads of the bandwidth buffer per probe, the faster one kept


@dataclass(frozen=True)
class StackSpec:
    """One row to measure: key/value heads, batch, cache dtype and context; latent: the
    stack is MultiHeadLatentAttention (LATENT's shape) with its latent cache instead."""

    num_kv_heads: int
    batch: int
    cache_dtype: str
    context: int
    latent: bool = False


# Multi-head latent attention beside the others at the same width and query heads: head_dim
# 64 split as DeepSeek-V3 splits its 192 (nope, rope) and its 128-wide values, and a latent
# 4 value heads wide (V3: 512 = 4 x 128); no low-rank queries. Per token and layer it holds
# kv_lora_rank + qk_rope_head_dim = 288 values, between multi-query's 128 and 4-head
# grouped-query's 512 (multi-head: 1536).
LATENT = {"q_lora_rank": None, "kv_lora_rank": 256, "qk_nope_head_dim": 32}
LATENT |= {"qk_rope_head_dim": 32, "v_head_dim": 64}


def default_specs(num_heads: int = 12, contexts: Sequence[int] = (256, 1024, 4096)):
    """The rows of the outside harness: every layout at batch 1 and every context (float32),
    latent attention (LATENT) at batch 1 and every context, multi-head at batch 8 and the
    middle context, grouped-query and multi-query at batch 8 and every context, and
    multi-head with int8 and float32 caches at the longest (the int8 row's speed-up is read
    against the float32 one)."""
    layouts = [num_heads, num_heads // 3, 1] if num_heads % 3 == 0 else [num_heads, 1]
    specs = [StackSpec(h, 1, "float32", c) for h in layouts for c in contexts]
    specs += [StackSpec(num_heads, 1, "float32", c, latent=True) for c in contexts]
    specs.append(StackSpec(num_heads, 8, "float32", contexts[len(contexts) // 2]))
    specs += [StackSpec(h, 8, "float32", c) for h in layouts[1:] for c in contexts]
    specs.append(StackSpec(num_heads, 1, "int8", contexts[-1]))
    return specs


@dataclass
class StackRow(decode.Floor):
    """One measured row: the median step through the whole stack and its floor's terms."""

    layout: str
    num_kv_heads: int
    batch: int
    cache_dtype: str
    context: int
    step_s: float
    steps_s: list[float]
    weight_bytes: int
    cache_bytes: int
    flops: float
    read_bytes_per_s: float
    flops_per_s: float

    @property
    def memory_floor_s(self) -> float:
        return (self.weight_bytes + self.cache_bytes) / self.read_bytes_per_s

    @property
    def compute_floor_s(self) -> float:
        return self.flops / self.flops_per_s

    @property
    def over_floor(self) -> float:
        return self.step_s / self.floor_s


@dataclass
class StackReport:
    d_model: int
    num_heads: int
    layers: int
    steps: int
    threads: int
    rows: list[StackRow] = field(default_factory=list)

    def to_dict(self) -> dict:
        out = asdict(self)
        for row, raw in zip(self.rows, out["rows"], strict=True):
            raw.update(
                memory_floor_s=row.memory_floor_s,
                compute_floor_s=row.compute_floor_s,
                floor_s=row.floor_s,
                binds=row.binds,
                over_floor=row.over_floor,
            )
        return out


def run_stack_decode(
    specs: Sequence[StackSpec] | None = None,
    *,
    d_model: int = MODEL["d_model"],
    num_heads: int = MODEL["num_heads"],
    layers: int = MODEL["layers"],
    steps: int = 20,
    bandwidth_bytes: int = BANDWIDTH_BYTES,
    matmul_size: int = MATMUL_SIZE,
    progress: Callable[[str], None] = lambda step: None,
) -> StackReport:
    """Measure each spec's row (see the module docstring).

    Args:
        specs: the rows (default default_specs(num_heads)).
        d_model: model width (d_in = d_out).
        num_heads: query heads.
        layers: layers in the stack.
        steps: single-token steps after the prompt; the row's figure is their median.
        bandwidth_bytes: the buffer summed to measure the read bandwidth.
        matmul_size: the square matmul that measures the arithmetic rate.
        progress: called with a description before each row.

    Returns:
        The StackReport.
    """
    specs = list(specs or default_specs(num_heads))
    report = StackReport(d_model, num_heads, layers, steps, torch.get_num_threads())
    stacks: dict[tuple[int, bool], list[nn.Module]] = {}
    context_length = max(spec.context for spec in specs) + steps
    for spec in specs:
        progress(_describe(spec))
        key = (spec.num_kv_heads, spec.latent)
        if key not in stacks:
            stacks.clear()  # one stack's weights at a time
            torch.manual_seed(spec.num_kv_heads)
            build = latent_stack if spec.latent else stack
            kv_heads = () if spec.latent else (spec.num_kv_heads,)
            stacks[key] = build(d_model, num_heads, *kv_heads, layers, context_length)
        report.rows.append(_row(stacks[key], spec, steps, bandwidth_bytes, matmul_size))
    return report


def stack(d_model: int, num_heads: int, num_kv_heads: int, layers: int, context_length: int):
    """`layers` float32 attention layers in eval mode, each with its own weights."""
    return [
        MultiHeadAttention(
            d_model, d_model, context_length, 0.0, num_heads, num_kv_heads=num_kv_heads
        ).eval()
        for _ in range(layers)
    ]


def latent_stack(d_model: int, num_heads: int, layers: int, context_length: int):
    """`layers` float32 MultiHeadLatentAttention layers (LATENT) in eval mode."""
    return [
        MultiHeadLatentAttention(d_model, num_heads, **LATENT, context_length=context_length).eval()
        for _ in range(layers)
    ]


def _describe(spec: StackSpec) -> str:
    heads = "latent attention" if spec.latent else f"{spec.num_kv_heads} key/value heads"
    return f"{heads}, batch {spec.batch}, {spec.cache_dtype}, context {spec.context}"


def _width(module: nn.Module) -> int:
    """The model width a layer reads: MultiHeadAttention's d_in, latent attention's d_model."""
    return module.d_model if isinstance(module, MultiHeadLatentAttention) else module.d_in


def _layout(module: nn.Module) -> str:
    return "latent" if isinstance(module, MultiHeadLatentAttention) else decode.layout(module)


def prompted(modules, spec: StackSpec, steps: int):
    """Caches with room for the prompt and the steps, the prompt run through the stack."""
    dtype = getattr(torch, spec.cache_dtype)
    caches = [m.make_cache(spec.batch, spec.context + steps, dtype=dtype) for m in modules]
    hidden = torch.randn(spec.batch, spec.context, _width(modules[0]))  # (b, t, d)
    with torch.no_grad():
        for module, cache in zip(modules, caches, strict=True):
            hidden = module(hidden, cache=cache)
    return caches


def _row(modules, spec: StackSpec, steps: int, bandwidth_bytes: int, matmul_size: int):
    caches = prompted(modules, spec, steps)
    probe = torch.ones(bandwidth_bytes // 4)
    times, rates = [], []
    with torch.no_grad():
        for step in range(steps):
            if step % PROBE_EVERY == 0:
                rates.append(_read_rate(probe, PROBE_READS))
            hidden = torch.randn(spec.batch, 1, _width(modules[0]))  # (b, 1, d)
            start = time.perf_counter()
            for module, cache in zip(modules, caches, strict=True):
                hidden = module(hidden, cache=cache)
            times.append(time.perf_counter() - start)
    del probe
    held = spec.context + steps // 2  # tokens held at the median step
    cache_bytes = sum(_held_bytes(cache, held) for cache in caches)
    del caches
    first = modules[0]
    return StackRow(
        layout=_layout(first),
        num_kv_heads=spec.num_kv_heads,
        batch=spec.batch,
        cache_dtype=spec.cache_dtype,
        context=spec.context,
        step_s=statistics.median(times),
        steps_s=times,
        weight_bytes=sum(p.nbytes for m in modules for p in m.parameters()),
        cache_bytes=cache_bytes,
        flops=len(modules) * spec.batch * decode.flops_per_sequence(first, held),
        read_bytes_per_s=statistics.median(rates),
        flops_per_s=matmul_rate(matmul_size),
    )


def _held_bytes(cache, tokens: int) -> int:
    """Bytes of `tokens` positions of a cache: keys, values and int8 scales."""
    return tokens * cache.nbytes // cache.capacity


def read_bandwidth(nbytes: int = BANDWIDTH_BYTES) -> float:
    """Bytes per second of a `torch.sum` over a float32 buffer of `nbytes`, best of 5."""
    buffer = torch.ones(nbytes // 4)
    buffer.sum()
    return _read_rate(buffer)


def _read_rate(buffer: torch.Tensor, calls: int = BEST_OF) -> float:
    """Bytes per second of `buffer.sum()`, the fastest of `calls`."""
    return buffer.nbytes / _best(buffer.sum, calls)


def matmul_rate(size: int = MATMUL_SIZE) -> float:
    """FLOP per second of a float32 size^3 matmul on the CPU, best of 5."""
    product, flops = timing.matmul_probe(size=size)
    product()
    return flops / _best(product)


def _best(fn: Callable[[], object], calls: int = BEST_OF) -> float:
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@dataclass
class LayerProfile:
    """Median seconds per layer, back to back through the stack, of each part of a step."""

    num_kv_heads: int
    context: int
    module_s: float  # module(x, cache=cache): checks, plan, the op
    native_op_s: float  # the op through its Python face (decode_cpu.step)
    weights_only_s: float  # the op with one token held: projections, next to no attention
    linear_s: float  # PyTorch's F.linear on the layer's two weights, for scale
    weight_floor_s: float
    cache_floor_s: float

    @property
    def attention_s(self) -> float:
        """The op less the op with one token held: the attention over the cache (scores,
        softmax and values, one fused pass over the keys), and the cache append."""
        return self.native_op_s - self.weights_only_s

    @property
    def fixed_s(self) -> float:
        """The module call less the op: forward's checks and the call plan."""
        return self.module_s - self.native_op_s


def profile_layer(
    num_kv_heads: int,
    context: int,
    *,
    d_model: int = MODEL["d_model"],
    num_heads: int = MODEL["num_heads"],
    layers: int = MODEL["layers"],
    steps: int = 20,
    bandwidth_bytes: int = BANDWIDTH_BYTES,
) -> LayerProfile | None:
    """Time, back to back through a stack, the parts of one layer's step (LayerProfile);
    None where the native decode step is unavailable."""
    if not decode_cpu.available():
        return None
    torch.manual_seed(num_kv_heads)
    modules = stack(d_model, num_heads, num_kv_heads, layers, context + 1)
    caches = prompted(modules, StackSpec(num_kv_heads, 1, "float32", context), 1)
    weights = [plan.native_module(m) for m in modules]
    x = torch.randn(1, 1, d_model)  # (b, 1, d)
    scale = modules[0].head_dim ** -0.5

    def module_step():
        for module, cache in zip(modules, caches, strict=True):
            cache.crop(context)
            module(x, cache=cache)

    def op_step(held: int):
        def run():
            for module, cache, tensors in zip(modules, caches, weights, strict=True):
                cache.crop(held)
                decode_cpu.step(x, tensors, module.num_heads, scale, cache, None)

        return run

    def linear():
        row = x[:, 0]  # (b, d)
        for tensors in weights:
            torch.nn.functional.linear(row, tensors.qkv)
            torch.nn.functional.linear(row, tensors.out)

    calls = {"module": module_step, "op": op_step(context), "one": op_step(0), "linear": linear}
    with torch.no_grad():
        parts = {name: _median_of(fn, steps) / layers for name, fn in calls.items()}
    bandwidth = read_bandwidth(bandwidth_bytes)
    return LayerProfile(
        num_kv_heads,
        context,
        parts["module"],
        parts["op"],
        parts["one"],
        parts["linear"],
        sum(p.nbytes for p in modules[0].parameters()) / bandwidth,
        _held_bytes(caches[0], context) / bandwidth,
    )


def _median_of(fn: Callable[[], object], calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def print_stack_decode(report: StackReport, console: Console) -> None:
    """The back-to-back table: each row's median step, both floor terms, which binds."""
    table = Table(
        title=f"Decoding back to back: {report.layers} layers, d_model {report.d_model}, "
        f"{report.num_heads} heads, float32, median of {report.steps} steps through the "
        f"stack, {report.threads} threads; floor = max(bytes / bandwidth, flops / matmul "
        f"rate), both measured after each row"
    )
    columns = ("layout", "kv", "batch", "cache", "context", "step ms", "GB/s", "GFLOP/s")
    for column in (*columns, "memory ms", "compute ms", "binds", "x floor", "spread"):
        table.add_column(column, justify="right", no_wrap=True)
    for row in report.rows:
        table.add_row(
            row.layout,
            str(row.num_kv_heads),
            str(row.batch),
            row.cache_dtype,
            str(row.context),
            f"{row.step_s * 1e3:.2f}",
            f"{row.read_bytes_per_s / 1e9:.1f}",
            f"{row.flops_per_s / 1e9:.0f}",
            f"{row.memory_floor_s * 1e3:.2f}",
            f"{row.compute_floor_s * 1e3:.2f}",
            row.binds,
            f"{row.over_floor:.2f}",
            f"{min(row.steps_s) * 1e3:.2f}-{max(row.steps_s) * 1e3:.2f}",
        )
    console.print(table)


def print_profiles(profiles: Sequence[LayerProfile], console: Console) -> None:
    """One layer's step split into the parts that can be timed apart (microseconds)."""
    table = Table(
        title="One layer's step, back to back through the stack, us per layer: the module "
        "call; its checks and plan (module - op); the op; the op with one token held (its "
        "projections); attention over the cache (op - that); PyTorch's F.linear on the two "
        "weights; the floors of the weights' and the cache's reads"
    )
    columns = ("kv", "context", "module", "checks+plan", "op", "projections", "attention")
    for column in (*columns, "F.linear", "weights floor", "cache floor"):
        table.add_column(column, justify="right", no_wrap=True)
    for p in profiles:
        table.add_row(
            str(p.num_kv_heads),
            str(p.context),
            *(
                f"{seconds * 1e6:.0f}"
                for seconds in (
                    p.module_s,
                    p.fixed_s,
                    p.native_op_s,
                    p.weights_only_s,
                    p.attention_s,
                    p.linear_s,
                    p.weight_floor_s,
                    p.cache_floor_s,
                )
            ),
        )
    console.print(table)
