"""The native decode step's time per token on grouped heads (issue 39): a 12-layer stack of
GPT-2 small's sizes (d_model 768, 12 query heads, float32 weights), multi-head (12 key/value
heads), grouped-query (4) and multi-query (1), batch 1 and 8, contexts 256, 1,024 and 4,096.

Each step calls the native op directly for every layer (decode_cpu's binding, no module
call, no plan) at the same slot, so the caches never move; it runs on one thread and is
timed in that thread's CPU time (time.thread_time), the least of `rounds` steps after one
warm-up: a figure that a loaded machine disturbs less than wall time (it still shares the
caches and memory bandwidth). With `--threads N` above 1 it runs on N threads, timed in wall
time (the other threads' work is not the calling thread's CPU time). Compare a change to
the kernel with the source before it, built beside it (its op registered under another
name) and timed in the same process, round by round in turn (`--baseline`), or with the
figures of an earlier run (`--compare`):

    git show HEAD:src/attnlab/csrc/decode_step.cpp > /tmp/before.cpp
    python scripts/decode_gqa.py --baseline /tmp/before.cpp
    python scripts/decode_gqa.py --json before.json   # then, after the change:
    python scripts/decode_gqa.py --compare before.json

A baseline from before the values became rows (2026-11-27) reads a copy of them laid out as
the keys: add `--baseline-values-like-keys`.

The steps run back to back, so that the last-level cache keeps part of the stack's weights
from one step to the next. `--cold` times each call after a read that evicts the CPU's
caches, the median wall time of `rounds` rounds of three calls, as `attnlab bench --decode`
times its rows.

Usage: python scripts/decode_gqa.py [--rounds N] [--cache-dtype float32|bfloat16|int8]
    [--contexts 256,1024,4096] [--batches 1,8] [--kv-heads 12,4,1] [--json OUT]
    [--compare BEFORE.json] [--baseline BEFORE.cpp [--baseline-values-like-keys]]
    [--threads N] [--block-tokens N] [--cold]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import time
from pathlib import Path

import torch

from attnlab import MultiHeadAttention, _build, decode_cpu, plan
from attnlab.bench import timing
from attnlab.kv_cache import KVCache

LAYERS, D_MODEL, HEADS = 12, 768, 12
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def baseline_op(source: str):
    """The decode_step of another version of decode_step.cpp, built under another name (its
    torch.ops library renamed, so that both load in one process)."""
    from torch.utils import cpp_extension

    text = (
        Path(source)
        .read_text()
        .replace("TORCH_LIBRARY(attnlab_decode,", "TORCH_LIBRARY(attnlab_decode_baseline,")
    )
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"attnlab_decode_baseline_{digest}.cpp"
    if not path.exists() or path.read_text() != text:  # rewritten, it would be rebuilt
        path.write_text(text)
    module = cpp_extension.load(
        f"attnlab_decode_baseline_{digest}",
        [str(path)],
        extra_cflags=_build.cflags(decode_cpu._WIDE),
        extra_ldflags=list(_build.LDFLAGS),
        extra_include_paths=[str(Path(decode_cpu.__file__).with_name("csrc"))],  # its headers
    )
    return module.decode_step


def stack_step(
    num_kv_heads: int,
    batch: int,
    context: int,
    cache_dtype: torch.dtype,
    ops,
    old_values=(),
    block_tokens: int | None = None,
):
    """Calls (one per op of `ops`) decoding one token at position context - 1 through 12
    layers whose caches hold context - 1 random tokens (each layer its own weights and
    cache). An op whose index is in `old_values` reads a copy of the values laid out as the
    keys, in blocks (hd, tokens): the layout of kernels before the values became rows
    (2026-11-27). With `block_tokens`, the first op's caches hold the keys in blocks of that
    many tokens instead of kv_cache.BLOCK_TOKENS (the others' keep it)."""
    torch.manual_seed(0)
    modules = [
        MultiHeadAttention(D_MODEL, D_MODEL, context, 0.0, HEADS, num_kv_heads=num_kv_heads).eval()
        for _ in range(LAYERS)
    ]
    shape = (batch, num_kv_heads, context - 1, D_MODEL // HEADS)  # (b, hkv, t, hd)
    keys, values = torch.randn(shape), torch.randn(shape)

    def caches_of(block: int | None) -> list[KVCache]:
        caches = [
            module.make_cache(batch, context, dtype=cache_dtype)
            if block is None
            else KVCache(
                batch,
                context,
                num_kv_heads,
                D_MODEL // HEADS,
                dtype=cache_dtype,
                block_tokens=block,
                tokens_last=True,
            )
            for module in modules
        ]
        with torch.no_grad():
            for cache in caches:
                cache.update(keys, values)
        return caches

    x = torch.randn(batch, 1, D_MODEL)  # (b, 1, d)
    built: dict[int | None, list[KVCache]] = {}  # per layout, built once, when first asked

    def calls_of(values_like_keys: bool, block: int | None):
        caches = built.get(block) or built.setdefault(block, caches_of(block))
        calls = []
        for module, cache in zip(modules, caches, strict=True):
            weights = plan.native_module(module)
            slot, first, count = cache.native_slots(context - 1, None)
            key_scales, value_scales = cache.scales
            scale = module.head_dim**-0.5
            values_t = _values_like_keys(cache) if values_like_keys else cache.values_t
            buffers = (cache.keys_t, values_t, key_scales, value_scales)
            calls.append(
                (weights, (*buffers, HEADS, context - 1, slot, first, count, cache.block, scale))
            )
        return calls

    def step_of(op, calls):
        def step() -> torch.Tensor:
            hidden = x
            for weights, arguments in calls:
                tensors, norms = weights[: decode_cpu._TENSORS], weights[decode_cpu._TENSORS :]
                hidden = op(hidden, *tensors, *arguments, *norms)  # the op's argument order
            return hidden

        return step

    return [
        step_of(op, calls_of(i in old_values, block_tokens if i == 0 else None))
        for i, op in enumerate(ops)
    ]


def _values_like_keys(cache) -> torch.Tensor:
    """A copy of the cache's values laid out as its keys (blocks of (hd, tokens))."""
    values_t = torch.zeros_like(cache.values_t)
    stored = cache.values.transpose(-2, -1)  # (b, hkv, hd, capacity) as stored
    cache._key_layout.copy_in(values_t, 0, stored)
    return values_t


def least_seconds(steps, rounds: int, clock=time.thread_time) -> list[float]:
    """Each step's least time by `clock` over `rounds`, the steps taken in turn each round."""
    for step in steps:
        step()  # warm-up
    best = [float("inf")] * len(steps)
    for _ in range(rounds):
        for i, step in enumerate(steps):
            start = clock()
            step()
            best[i] = min(best[i], clock() - start)
    return best


def median_cold_seconds(steps, rounds: int, flush=None) -> list[float]:
    """Each step's median wall time as `attnlab bench --decode` times its rows
    (timing.interleaved_medians, cold): `rounds` rounds of at least three calls each, every
    call after flush() (default: a read larger than the CPU's caches, so that the weights
    come from memory)."""
    flush = flush or timing.bandwidth_probe("cpu")[0]
    candidates = {str(i): step for i, step in enumerate(steps)}
    medians = timing.interleaved_medians(
        candidates, rounds=rounds, min_run_time=0.0, cold=set(candidates), flush=flush
    )
    return [medians[name] for name in candidates]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cache-dtype", choices=DTYPES, default="float32")
    parser.add_argument("--contexts", type=_ints, default=[256, 1024, 4096])
    parser.add_argument("--batches", type=_ints, default=[1, 8])
    parser.add_argument("--kv-heads", type=_ints, default=[12, 4, 1])
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--compare", help="figures of an earlier run (--json) to compare with")
    parser.add_argument("--baseline", help="another decode_step.cpp, timed in turn with this one")
    parser.add_argument(
        "--threads", type=int, default=1, help="threads; above 1, the step's wall time"
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="time each step after evicting the CPU's caches (median wall time), as the bench",
    )
    parser.add_argument(
        "--block-tokens",
        type=int,
        help="this version's caches hold the keys in blocks of this many tokens (the "
        "baseline's keep kv_cache.BLOCK_TOKENS)",
    )
    parser.add_argument(
        "--baseline-values-like-keys",
        action="store_true",
        help="the baseline reads the values laid out as the keys (kernels before 2026-11-27)",
    )
    args = parser.parse_args()
    if not decode_cpu.available():
        raise SystemExit(f"the native decode step is unavailable: {decode_cpu.load_error()}")
    torch.set_num_threads(args.threads)  # with one, the thread's CPU time is the step's
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    before = json.loads(Path(args.compare).read_text()) if args.compare else {}
    ops = [decode_cpu._op()] + ([baseline_op(args.baseline)] if args.baseline else [])
    figures = {}
    timed = "one thread's CPU time" if args.threads == 1 else f"{args.threads} threads' wall time"
    if args.cold:
        timed = "wall time after evicting the caches"
    which = f"median of {args.rounds} rounds of 3" if args.cold else f"least of {args.rounds}"
    flush = timing.bandwidth_probe("cpu")[0] if args.cold else None  # one buffer for all rows
    print(f"ms per step ({LAYERS} layers, {timed}, {which}), {args.cache_dtype} cache")
    for num_kv_heads in args.kv_heads:
        for batch in args.batches:
            for context in args.contexts:
                key = f"{args.cache_dtype} kv={num_kv_heads} b={batch} t={context}"
                old = (1,) if args.baseline_values_like_keys else ()
                steps = stack_step(
                    num_kv_heads,
                    batch,
                    context,
                    DTYPES[args.cache_dtype],
                    ops,
                    old,
                    args.block_tokens,
                )
                seconds = (
                    median_cold_seconds(steps, args.rounds, flush)
                    if args.cold
                    else least_seconds(steps, args.rounds, clock)
                )
                times = [s * 1e3 for s in seconds]
                ms = figures[key] = times[0]
                line = f"{key:<32} {ms:9.2f}"
                if len(times) > 1:
                    line += f"   baseline {times[1]:9.2f}   this/baseline {ms / times[1]:.2f}"
                if key in before:
                    line += f"   before {before[key]:9.2f}   after/before {ms / before[key]:.2f}"
                print(line, flush=True)
                del steps
    if args.json:
        with open(args.json, "w") as file:
            json.dump(figures, file, indent=1)


if __name__ == "__main__":
    main()
