"""The rows of `attnlab bench --decode`'s layout table, each printed the moment it is
measured (issue 39), for a machine lent for minutes: the host CPU of a lent GPU machine,
where a whole bench run may not finish in one call. A bench run prints its tables at the
end, so a run stopped by a time limit prints nothing; on 2026-11-28 two such runs on a
16-core Xeon host (its 300 MiB last-level cache makes each cold step's eviction read 600
MiB) ran past 190 s each and printed nothing.

The rows are the bench's own: attnlab.bench.decode's stack, caches, probes and row function
(each step timed cold, after a read that evicts the CPU's caches, beside the read bandwidth
and matmul rate), in the order of --rows, the rows issue 39 names first by default.

Usage, on such a machine (two cores on distinct physical cores, build first):
    python -m attnlab build
    OMP_NUM_THREADS=2 taskset -c 1,2 python scripts/decode_rows.py [--rows kv:batch:cache,...]
        [--contexts N,...]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch
from decode_gqa import DTYPES, _ints

from attnlab.bench import decode
from attnlab.bench.decode import GPT2_SMALL

# multi-query at batch 8 over float32 and at batch 1 over int8, then grouped-query's, then
# the narrower caches and float32 at batch 1
DEFAULT_ROWS = "1:8:float32,1:1:int8,4:8:float32,4:1:int8,1:1:bfloat16,4:1:bfloat16"
DEFAULT_ROWS += ",1:1:float32,4:1:float32"


def parse_rows(text: str) -> list[tuple[int, int, torch.dtype]]:
    """'kv:batch:cache,...' as (key/value heads, batch, cache dtype) triples."""
    rows = []
    for item in text.split(","):
        kv, batch, cache = item.split(":")
        if cache not in DTYPES:
            raise SystemExit(f"--rows: cache dtype {cache!r} is not one of {list(DTYPES)}")
        rows.append((int(kv), int(batch), DTYPES[cache]))
    return rows


def measure(
    rows: Sequence[tuple[int, int, torch.dtype]],
    contexts: Sequence[int],
    *,
    d_model: int = GPT2_SMALL["d_model"],
    num_heads: int = GPT2_SMALL["num_heads"],
    layers: int = GPT2_SMALL["layers"],
    min_run_time: float = 0.2,
    rounds: int = 3,
    read_bytes: int | None = None,
):
    """Yield each row's CacheRow per context (longest first, as the bench measures them)."""
    cpu = torch.device("cpu")
    probes = decode.bandwidth_probe(cpu, read_bytes), decode.matmul_probe(cpu, torch.float32)
    stack, stack_kv = None, None
    for kv, batch, cache_dtype in rows:
        if kv != stack_kv:
            stack = None  # one stack's weights at a time
            torch.manual_seed(0)
            stack = decode._stack(d_model, num_heads, kv, max(contexts), torch.float32, layers)
            stack_kv = kv
        yield from decode.layout_rows(
            stack, batch, cache_dtype, contexts, probes, min_run_time, rounds
        )


def describe(row: decode.CacheRow) -> str:
    """One row as a line: what it is, ms per layer, both probes, both floor terms, x floor."""
    return (
        f"{row.layout}, kv {row.num_kv_heads}, batch {row.batch}, {row.cache_dtype}, "
        f"context {row.context}: {row.cached_s * 1e3:.3f} ms per layer, "
        f"{row.read_bytes_per_s / 1e9:.1f} GB/s, {row.flops_per_s / 1e9:.0f} GFLOP/s, "
        f"memory {row.memory_floor_s * 1e3:.3f} ms, compute {row.compute_floor_s * 1e3:.3f} ms, "
        f"{row.binds}, x floor {row.over_floor:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=DEFAULT_ROWS, help="kv:batch:cache,... in order")
    parser.add_argument("--contexts", type=_ints, default=[256, 1024, 4096])
    args = parser.parse_args()
    start = time.perf_counter()
    print(f"threads {torch.get_num_threads()}, torch {torch.__version__}", flush=True)
    for row in measure(parse_rows(args.rows), args.contexts):
        print(f"{describe(row)} [{time.perf_counter() - start:.0f} s]", flush=True)


if __name__ == "__main__":
    main()
