"""Terminal tables, JSON and charts for the benchmark reports (rich draws the tables,
matplotlib's object API the charts)."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from attnlab.bench.compare import (
    BACKWARD,
    CORE_TABLE,
    FORWARD,
    MODES,
    MODULE_TABLE,
    CompareReport,
    CompareRow,
)
from attnlab.bench.decode import CacheRow, DecodeReport, DecodeRow
from attnlab.bench.memory import MemoryReport, MemoryRow, format_bytes
from attnlab.bench.timing import MATMUL_SIZE

_MODE_TITLES = {FORWARD: "forward (no_grad)", BACKWARD: "forward + backward"}


_SHORT_LAYOUTS = {"multi-head": "MHA", "grouped-query": "GQA", "multi-query": "MQA"}


def print_decode(report: DecodeReport, console: Console | None = None) -> None:
    """The decoding figures as two tables: per context, then per head layout."""
    console = console or Console()
    probe = "a read" if report.device == "cpu" else "a device copy"
    console.print(
        f"Decoding on {report.device}, batch 1, {report.dtype}, d_model {report.d_model}, "
        f"{report.num_heads} heads, {report.threads} threads; times per attention layer, "
        f"measured through a stack of {report.layers}; floor = max((weights + cache read) / "
        f"memory bandwidth, flops / matmul rate) (GB/s: {probe}, GFLOP/s: a {MATMUL_SIZE}^3 "
        f"matmul, "
        f"measured beside each row); weights {report.weight_bytes / 2**20:.1f} MiB per layer"
    )
    steps = Table(title="Next token: KV cache against recomputing the prefix")
    columns = ("context", "cached ms", "tok/s", "recomp. ms", "tok/s", "speedup", "GB/s")
    columns = (*columns, "GFLOP/s", "memory ms", "compute ms")
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
            *_floor_cells(row),
            f"{row.over_floor:.2f}",
        )
    console.print(steps)
    caches = Table(
        title="Decode step by head layout (MHA multi-head, GQA grouped-query, MQA multi-query), "
        "batch and cache dtype"
    )
    columns = ("layout", "kv", "batch", "cache", "context", "B/token", "ms", "GB/s", "GFLOP/s")
    for column in (*columns, "memory ms", "compute ms", "binds", "x floor"):
        caches.add_column(column, justify="right", no_wrap=True)
    for row in report.cache_rows:
        caches.add_row(
            _SHORT_LAYOUTS.get(row.layout, row.layout),
            str(row.num_kv_heads),
            str(row.batch),
            row.cache_dtype,
            str(row.context),
            f"{row.bytes_per_token:,}",
            f"{row.cached_s * 1e3:.3f}",
            *_floor_cells(row),
            row.binds,
            f"{row.over_floor:.2f}",
        )
    console.print(caches)


def _floor_cells(row: DecodeRow | CacheRow) -> tuple[str, ...]:
    """A decode row's probes (GB/s, GFLOP/s) and its floor's two terms (ms)."""
    return (
        f"{row.read_bytes_per_s / 1e9:.1f}",
        f"{row.flops_per_s / 1e9:,.0f}",
        f"{row.memory_floor_s * 1e3:.3f}",
        f"{row.compute_floor_s * 1e3:.3f}",
    )


def print_compare(report: CompareReport, console: Console | None = None) -> None:
    """The comparison as three tables: the modules forward, forward + backward, the cores."""
    console = console or Console()
    console.print(_compare_title(report))
    console.print(f"FLOP model: {report.flop_model}")
    console.print(f"peak: memory one call adds above its inputs and weights ({report.peak_method})")
    for mode in MODES:
        rows = report.group(MODULE_TABLE, mode)
        title = f"Causal self-attention module, {_MODE_TITLES[mode]}"
        table = _compare_table(title + _matmul_note(report, MODULE_TABLE, mode), rows)
        console.print(table)
    core = Table(
        title=f"Causal attention core, (b, h, t, hd) = ({report.batch}, {report.num_heads}, "
        f"{report.tokens}, {report.d_model // report.num_heads})"
    )
    core.add_column("mode")
    for column in ("implementation", *_COMPARE_COLUMNS):
        core.add_column(column, justify="left" if column == "implementation" else "right")
    for mode in MODES:
        for row in report.group(CORE_TABLE, mode):
            core.add_row(_MODE_TITLES[mode], *_compare_cells(row))
    console.print(core)
    matmul = {mode: report.matmul_flops_per_s(CORE_TABLE, mode) for mode in MODES}
    console.print(
        "matmul beside the core rows: "
        + ", ".join(f"{_MODE_TITLES[m]} {_gflops(v)} GFLOP/s" for m, v in matmul.items())
    )


_COMPARE_COLUMNS = ("ms", "GFLOP/s", "% matmul", "x fastest", "peak MiB")


def _compare_title(report: CompareReport) -> str:
    return (
        f"{report.machine}, {report.device}, {report.threads} threads, torch "
        f"{report.torch_version}; batch {report.batch}, {report.tokens} tokens, d_model "
        f"{report.d_model}, {report.num_heads} heads, {report.dtype}, causal, dropout 0"
    )


def _matmul_note(report: CompareReport, table: str, mode: str) -> str:
    value = report.matmul_flops_per_s(table, mode)
    size = report.matmul_size
    return f" (matmul {size}x{size}: {_gflops(value)} GFLOP/s)"


def _compare_table(title: str, rows: list[CompareRow]) -> Table:
    table = Table(title=title)
    table.add_column("implementation", max_width=44)  # a skipped row's reason wraps
    for column in _COMPARE_COLUMNS:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*_compare_cells(row))
    return table


def _compare_cells(row: CompareRow) -> tuple[str, ...]:
    """name, ms, GFLOP/s, % of matmul, x fastest, peak MiB; a skipped row says why."""
    if row.seconds is None:
        return (f"{row.name}\n[dim]skipped: {row.skipped}[/dim]", *("-" * 5))
    return (
        row.name,
        f"{row.seconds * 1e3:.3f}" if row.seconds < 0.1 else f"{row.seconds * 1e3:.1f}",
        _gflops(row.flops_per_s),
        f"{row.of_matmul * 100:.0f}%" if row.of_matmul is not None else "-",
        f"{row.vs_fastest:.2f}",
        _mib(row.peak_bytes),
    )


def _gflops(flops_per_s: float | None) -> str:
    return "-" if flops_per_s is None else f"{flops_per_s / 1e9:,.1f}"


def _mib(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**20:,.1f}"


def print_memory(report: MemoryReport, console: Console | None = None) -> None:
    """The memory figures as one table: an implementation per row, a length per column;
    each cell is the peak in MiB and its ratio to the bytes of q, k, v and the output."""
    console = console or Console()
    console.print(
        f"{report.machine}, {report.device}, {report.dtype}; forward under no_grad (the "
        f"attention core also forward + backward, its last row), batch "
        f"{report.batch}, d_model {report.d_model}, {report.num_heads} heads; peak = memory one "
        f"call adds above its inputs and weights ({report.method}); (x) = peak / bytes of q, k, "
        f"v and the output; implementations holding (t x t) scores skipped above "
        f"{format_bytes(report.max_bytes)} of them"
    )
    table = Table(title="Peak memory by context length, MiB (x q,k,v,out)")
    table.add_column("implementation")
    lengths = report.lengths
    for tokens in lengths:
        table.add_column(f"{tokens:,}", justify="right")
    rows = {(row.name, row.tokens): row for row in report.rows}
    io_bytes = {row.tokens: row.io_bytes for row in report.rows}
    table.add_row("[dim]q, k, v, out[/dim]", *(f"[dim]{_mib(io_bytes[t])}[/dim]" for t in lengths))
    for name in report.names:
        table.add_row(name, *(_memory_cell(rows.get((name, t))) for t in lengths))
    console.print(table)


def _memory_cell(row: MemoryRow | None) -> str:
    if row is None:
        return ""
    if row.needs_bytes is not None:
        return f"[dim]skip: needs\n{format_bytes(row.needs_bytes)}[/dim]"
    if row.peak_bytes is None:
        return f"[dim]{row.skipped or 'n/a'}[/dim]"
    return f"{_mib(row.peak_bytes)}\n({row.ratio:.2f}x)"


def plot_compare(report: CompareReport, path: str | Path) -> Path:
    """A PNG chart of the comparison: horizontal bars of median ms per implementation, one
    panel per mode and one for the cores, the machine and shape in the title."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # loaded only when drawing
    from matplotlib.figure import Figure

    panels = [(f"module, {_MODE_TITLES[mode]}", report.group(MODULE_TABLE, mode)) for mode in MODES]
    core_rows = [row for mode in MODES for row in report.group(CORE_TABLE, mode)]
    panels.append(("attention core", core_rows))
    heights = [len(rows) for _, rows in panels]
    fig = Figure(figsize=(10, 1.2 + 0.32 * sum(heights) + 0.6 * len(panels)), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, gridspec_kw={"height_ratios": heights})
    for ax, (title, rows) in zip(axes, panels, strict=True):
        _bar_panel(ax, title, rows, label_mode=rows is core_rows)
    fig.suptitle(_compare_title(report), fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    return path


def _bar_panel(ax, title: str, rows: list[CompareRow], *, label_mode: bool) -> None:
    """One panel: a bar per row (median ms) in table order, top down; attnlab in blue."""
    labels = [
        f"{row.name} ({'fwd+bwd' if row.mode == BACKWARD else 'fwd'})" if label_mode else row.name
        for row in rows
    ]
    values = [row.seconds * 1e3 if row.seconds is not None else 0.0 for row in rows]
    positions = range(len(rows))
    bars = ax.barh(
        positions, values, color=["#4c72b0" if "attnlab" in r.name else "#999999" for r in rows]
    )
    ax.set_yticks(positions, labels=labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("median ms per call (lower is better)", fontsize=8)
    ax.set_title(title, fontsize=9, loc="left")
    longest = max(values, default=0.0) or 1.0
    for bar, row, value in zip(bars, rows, values, strict=True):
        text = "skipped" if row.seconds is None else f"{_ms(value)} ms, {row.vs_fastest:.2f}x"
        ax.text(
            value + 0.01 * longest,
            bar.get_y() + bar.get_height() / 2,
            text,
            va="center",
            fontsize=7,
        )
    ax.set_xlim(0, longest * 1.25)


def _ms(value: float) -> str:
    """A chart label for milliseconds: 1,431 / 66.9 / 0.242."""
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def write_json(data: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def print_parallel(report, console: Console | None = None) -> None:
    """A table per pass (forward, forward+backward), one row per process of each run, and
    each run's memory ratio to one process."""
    from attnlab.bench.parallel import CONFIGS, PASSES

    console = console or Console()
    for step in PASSES:
        table = Table(
            title=f"Ring attention, causal, {report.tokens} tokens, {report.heads} heads x "
            f"{report.head_dim}, {step}: one process against {report.world}"
        )
        columns = ("run", "rank", "inputs MiB", "call peak MiB", "total MiB", "sent MiB")
        for column in (*columns, "scores M", "s", "CPU s"):
            table.add_column(column, justify="left" if column == "run" else "right")
        for row in (r for r in report.rows if r.step == step):
            table.add_row(
                row.label if row.rank == 0 else "",
                str(row.rank),
                f"{row.input_bytes / 2**20:.1f}",
                f"{row.call_peak_bytes / 2**20:.1f}",
                f"{row.total_bytes / 2**20:.1f}",
                f"{row.sent_bytes / 2**20:.1f}",
                f"{row.scores / 1e6:,.0f}",
                f"{row.seconds:.2f}",
                f"{row.cpu_seconds:.2f}",
            )
        console.print(table)
        for label in CONFIGS:
            ratio = report.memory_ratio(label, step)
            console.print(f"{step}, {label}: largest rank's memory / one process's = {ratio:.2f}")
