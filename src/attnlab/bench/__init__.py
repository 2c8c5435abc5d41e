"""attnlab's benchmarks (no argument parsing here: that is attnlab.cli).

decode: tokens per second with a KV cache against recomputing, cache bytes per head layout,
and each step against its memory-bandwidth floor.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from attnlab.bench.decode import DecodeReport, run_decode
from attnlab.bench.report import print_decode, write_json

QUICK_DECODE = {"contexts": (32, 128), "layers": 2, "min_run_time": 0.02, "rounds": 1}

__all__ = ["DecodeReport", "decode_command", "run_decode"]


def decode_command(
    contexts: Sequence[int] | None = None,
    *,
    quick: bool = False,
    json_path: str | Path | None = None,
    console: Console | None = None,
) -> DecodeReport:
    """`attnlab bench --decode`: measure with a progress bar, print the tables, and write the
    figures as JSON when json_path is given. quick: tiny contexts and runs (a smoke test)."""
    console = console or Console()
    options = dict(QUICK_DECODE) if quick else {}
    if contexts:
        options["contexts"] = tuple(contexts)
    steps = 1 + len(options.get("contexts", (256, 1024, 4096))) + 3
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("decoding", total=steps)

        def advance(step: str) -> None:
            progress.update(task, advance=1, description=step)

        report = run_decode(progress=advance, **options)
    print_decode(report, console)
    if json_path is not None:
        write_json(report.to_dict(), json_path)
        console.print(f"figures written to {json_path}")
    return report
