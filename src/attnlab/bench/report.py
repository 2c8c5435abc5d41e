"""Terminal tables and JSON for the benchmark reports (rich draws the tables)."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from attnlab.bench.decode import DecodeReport


def print_decode(report: DecodeReport, console: Console | None = None) -> None:
    """The decoding figures as two tables: per context, then per head layout."""
    console = console or Console()
    console.print(
        f"Decoding, batch 1, {report.dtype}, d_model {report.d_model}, {report.num_heads} heads, "
        f"{report.threads} threads; times per attention layer, measured through a stack of "
        f"{report.layers}; floor = (weights + cache read) / read bandwidth (GB/s, measured "
        f"beside each row); weights {report.weight_bytes / 2**20:.1f} MiB per layer"
    )
    steps = Table(title="Next token: KV cache against recomputing the prefix")
    columns = ("context", "cached ms", "tok/s", "recomp. ms", "tok/s", "speedup", "GB/s")
    columns = (*columns, "floor ms")
    for column in (*columns, "x floor"):
        steps.add_column(column, justify="right")
    for row in report.rows:
        steps.add_row(
            str(row.context),
            f"{row.cached_s * 1e3:.3f}",
            f"{1 / row.cached_s:,.0f}",
            f"{row.recompute_s * 1e3:.2f}",
            f"{1 / row.recompute_s:,.0f}",
            f"{row.speedup:.1f}x",
            f"{row.read_bytes_per_s / 1e9:.1f}",
            f"{row.floor_s * 1e3:.3f}",
            f"{row.over_floor:.2f}",
        )
    console.print(steps)
    longest = report.rows[-1].context if report.rows else 0
    caches = Table(title=f"Cache size by head layout (decode step at context {longest})")
    for column in ("layout", "kv heads", "bytes/token", "cached ms", "GB/s", "floor ms", "x floor"):
        caches.add_column(column, justify="right")
    for row in report.cache_rows:
        caches.add_row(
            row.layout,
            str(row.num_kv_heads),
            f"{row.bytes_per_token:,}",
            f"{row.cached_s * 1e3:.3f}",
            f"{row.read_bytes_per_s / 1e9:.1f}",
            f"{row.floor_s * 1e3:.3f}",
            f"{row.cached_s / row.floor_s:.2f}",
        )
    console.print(caches)


def write_json(data: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(data, indent=2) + "\n")
