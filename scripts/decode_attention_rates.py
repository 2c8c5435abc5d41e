"""The native decode step's attention alone, as the op runs it (issue 39): its parallel
region over a 12-layer stack's float32 caches (`append_and_attend`, the op's own work items,
prefetches, softmax and merge), without the projections, timed in C++ on N threads; and
the read patterns it is measured against, with the same arithmetic.

- attention: per row (key/value heads, batch, context), one call per layer per round over
  each layer's cache, laid out by KVCache as the op reads it (keys in blocks of
  kv_cache.BLOCK_TOKENS, values as rows). Its GFLOP/s and the cache's GB/s sit beside
  `torch.sum`'s and `torch.mm`'s on the same threads. Before timing, one call's heads'
  outputs are checked against float64 attention over the same cache (a wrong harness
  stops the script). It reproduces the attention region of scripts/decode_regions.py
  without the rest of the stack, in a minute. Beside it, "items alone": the same work items
  walked on as many std::threads, each its share of every layer's items in turn, without the
  parallel regions and the heads' merge; and for multi-query rows (one key/value head,
  contexts a multiple of 512, blocks of 256), "kernels alone": the op's kernels and
  prefetcher at the same items' addresses, without the items' set-up, softmax and merge.
- `--patterns`: reads of 512 MiB per thread with multi-query attention's arithmetic over a
  float32 cache (12 query heads' multiply-adds per row of 64 floats: 6 FLOP per byte, in
  blocks of 6 heads as the op does them, or the 12 at once), in the patterns named in the
  table: how many bytes per second this machine's cores pull while they compute that way.
  The first seven multiply every row by the same 12 numbers, known when the harness is
  compiled, which the compiler folds into the multiply-adds; the op's kernels and the
  tiles with broadcast multipliers load a query feature (keys) or a weight (values) per
  row and head.

`--baseline BEFORE.cpp` builds another decode_step.cpp the same way (one that defines
`chunk_keys` and `append_and_attend` as this one does, from 2026-11-27 night on) and times
it in turn with this one, in one process, best of three each.

Usage: python scripts/decode_attention_rates.py [--threads N] [--rounds N] [--layers N]
    [--rows kv:batch:context,...] [--block-tokens N] [--baseline BEFORE.cpp] [--patterns]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from decode_kernel_rates import SOURCE, build_appended
from rich.console import Console
from rich.table import Table

from attnlab.bench.decode_stack import matmul_rate, read_bandwidth
from attnlab.kv_cache import BLOCK_TOKENS, KVCache

HEAD_DIM, HEADS = 64, 12
HARNESS = Path(__file__).resolve().with_name("decode_attention_rates.cpp")
ROWS = "1:8:1024,1:8:4096,4:8:4096,12:1:4096"
PATTERNS = (
    "one stream, a row's 12 heads at once, no prefetch",
    "tiles of 16 KiB, two passes of 6 heads, no prefetch",
    "tiles, two passes, the next tile prefetched over both",
    "items of 8 key tiles then 8 value tiles, the next tile prefetched over both passes",
    "items, the next tile prefetched in the first pass alone, 16 lines per 4 rows",
    "blocks of 64 KiB in 4 strips of 64 rows 1 KiB apart (the op's keys), the next block "
    "prefetched over both passes",
    "the op's work item without its softmax: each block of 6 heads over a whole 64 KiB "
    "block, the op's two prefetch streams",
    "the same with the op's kernels",
    "the same on the op's threads (at::parallel_for)",
    "one stream of 8 KiB key tiles, each read once by all 12 heads (24 sums in registers), "
    "each row's multipliers broadcast",
    "the same, the multipliers fixed as in the first seven",
    "the tiles with broadcast multipliers, each tile's sums stored where the op's item "
    "stores a block's scores (12 rows of 512, 24 KiB)",
)


def build(source: Path = SOURCE):
    """`source` and decode_attention_rates.cpp, built as one extension."""
    return build_appended(HARNESS, "attnlab_attention_rates", source)


def layer_caches(kv: int, batch: int, context: int, layers: int, block: int):
    """(qkv (b, d_qkv), [KVCache] per layer): `context` random tokens held by each layer's
    float32 cache, with one free slot past them, laid out for the native step."""
    torch.manual_seed(0)
    qkv = torch.randn(batch, (HEADS + 2 * kv) * HEAD_DIM)  # (b, queries | keys | values)
    caches = []
    for _ in range(layers):
        cache = KVCache(batch, context + 1, kv, HEAD_DIM, block_tokens=block, tokens_last=True)
        shape = (batch, kv, context, HEAD_DIM)  # (b, hkv, t, hd)
        cache.update(torch.randn(shape), torch.randn(shape))
        caches.append(cache)
    return qkv, caches


def reference(qkv: torch.Tensor, cache: KVCache, kv: int) -> torch.Tensor:
    """float64 attention of qkv's queries over the cache's tokens: (b, heads * hd)."""
    batch, held = qkv.shape[0], cache.num_tokens
    q = qkv[:, : HEADS * HEAD_DIM].double().view(batch, HEADS, 1, HEAD_DIM)  # (b, h, 1, hd)
    keys = cache.keys[:, :, :held].double().repeat_interleave(HEADS // kv, dim=1)
    values = cache.values[:, :, :held].double().repeat_interleave(HEADS // kv, dim=1)
    weights = torch.softmax(q @ keys.transpose(-2, -1) / math.sqrt(HEAD_DIM), dim=-1)
    return (weights @ values).reshape(batch, HEADS * HEAD_DIM)  # (b, h * hd)


def check(module, kv: int, block: int) -> None:
    """Stops the script unless one call's outputs are float64 attention's, to 1e-4."""
    qkv, (cache,) = layer_caches(kv, 3, 700, 1, block)
    out = module.attend(qkv, cache.keys_t, cache.values_t, HEADS, cache.num_tokens, block)
    error = (out.double() - reference(qkv, cache, kv)).abs().max().item()
    if not error < 1e-4:
        raise SystemExit(f"the harness's attention is {error:.2e} off float64 attention")


def cache_bytes(kv: int, batch: int, context: int) -> int:
    """Bytes of keys and values one layer's attention reads."""
    return 2 * batch * kv * context * HEAD_DIM * 4


def row_rates(modules, args, kv: int, batch: int, context: int):
    """(each module's GFLOP/s, items alone's, kernels alone's or None) for one row, each the
    best of three taken in turn."""
    qkv, caches = layer_caches(kv, batch, context, args.layers, args.block_tokens)
    keys, values = [c.keys_t for c in caches], [c.values_t for c in caches]
    block, rounds, threads = args.block_tokens, args.rounds, args.threads
    whole_items = kv == 1 and context % 512 == 0 and block == 256  # kernels_alone's items
    best, items_alone, kernels = [0.0] * len(modules), 0.0, 0.0
    for _ in range(3):
        for i, module in enumerate(modules):
            rate = module.attention(qkv, keys, values, HEADS, context, block, rounds)
            best[i] = max(best[i], rate)
        rate = modules[0].attention_items(qkv, keys, values, HEADS, context, block, rounds, threads)
        items_alone = max(items_alone, rate)
        if whole_items:
            kernels = max(kernels, modules[0].kernels_alone(keys, values, context, rounds, threads))
    return best, items_alone, kernels if whole_items else None


def attention_table(modules, args, bandwidth: float, matmul: float) -> Table:
    """The rows' rates beside the limits (GB/s: the cache's bytes over the time)."""
    table = Table(
        title=f"attention alone, float32 cache, {args.layers} layers, {args.threads} "
        f"thread(s); torch.sum {bandwidth / 1e9:.1f} GB/s, torch.mm {matmul / 1e9:.0f} GFLOP/s"
    )
    columns = ["kv", "batch", "context", "GFLOP/s", "GB/s", "x limit", "items alone GB/s"]
    columns += ["kernels alone GB/s"]
    columns += ["baseline GFLOP/s", "this/baseline time"] if args.baseline else []
    for column in columns:
        table.add_column(column, justify="right")
    for row in args.rows.split(","):
        kv, batch, context = (int(part) for part in row.split(":"))
        best, items_alone, kernels = row_rates(modules, args, kv, batch, context)
        bytes_per_flop = cache_bytes(kv, batch, context) / (4 * HEADS * HEAD_DIM * context * batch)
        limit = min(bandwidth / 1e9 / bytes_per_flop, matmul / 1e9)  # GFLOP/s at the floor
        cells = [kv, batch, context, f"{best[0]:.1f}", f"{best[0] * bytes_per_flop:.1f}"]
        cells += [f"{limit / best[0]:.2f}", f"{items_alone * bytes_per_flop:.1f}"]
        cells += [f"{kernels * bytes_per_flop:.1f}" if kernels is not None else ""]
        cells += [f"{best[1]:.1f}", f"{best[1] / best[0]:.2f}"] if args.baseline else []
        table.add_row(*(str(cell) for cell in cells))
    return table


def pattern_table(module, threads: int) -> Table:
    """Each read pattern's bytes per second on `threads` threads, best of three."""
    table = Table(
        title=f"512 MiB per thread, {threads} thread(s), with multi-query arithmetic (6 FLOP "
        "per byte), best of 3"
    )
    for column in ("pattern", "GB/s", "GFLOP/s"):
        table.add_column(column, justify="left" if column == "pattern" else "right")
    for index, name in enumerate(PATTERNS):
        rate = max(module.patterns(index, threads, 1 << 29) for _ in range(3))
        table.add_row(name, f"{rate / 1e9:.1f}", f"{rate * 6 / 1e9:.0f}")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10, help="steps timed, best of 3")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rows", default=ROWS, help="kv:batch:context,...")
    parser.add_argument("--block-tokens", type=int, default=BLOCK_TOKENS)
    parser.add_argument("--baseline", help="another decode_step.cpp, timed in turn")
    parser.add_argument("--patterns", action="store_true", help="also time the read patterns")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    modules = [build()] + ([build(Path(args.baseline))] if args.baseline else [])
    for module in modules:
        for kv in (1, 4):
            check(module, kv, args.block_tokens)
    bandwidth, matmul = read_bandwidth(1 << 30), matmul_rate()
    console = Console(width=140)
    console.print(attention_table(modules, args, bandwidth, matmul))
    if args.patterns:
        console.print(pattern_table(modules[0], args.threads))


if __name__ == "__main__":
    main()
