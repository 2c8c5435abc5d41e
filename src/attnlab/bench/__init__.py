"""attnlab's benchmarks (argument parsing is attnlab.bench.cli).

compare: attnlab's module and attention core against their peers (the book's classes,
nn.MultiheadAttention, a nanoGPT-style module, FlexAttention), forward and forward +
backward: time, FLOP/s against the machine's matmul throughput, peak memory.
memory: forward peak memory from 1k to 32k tokens, against the bytes of q, k, v and output
(attnlab's attention core also forward + backward).
kernel: attnlab's causal CPU kernel against SDPA by length and head layout, forward and
forward + backward.
decode: tokens per second with a KV cache against recomputing, cache bytes per head layout,
each step against its floor (memory bandwidth, matmul rate), and a decode step against a
gpt-fast-style static-cache SDPA layer (decode_peers), eager and compiled.
hf: transformers models with attn_implementation="attnlab" against "sdpa" (hf).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.console import Console
from rich.progress import Progress

from attnlab.bench.compare import CompareReport, compare_steps, run_compare
from attnlab.bench.decode import DecodeReport, run_decode
from attnlab.bench.decode_peers import (
    QUICK_PEERS,
    PeerDecodeReport,
    peer_steps,
    print_decode_peers,
    run_decode_peers,
)
from attnlab.bench.decode_stack import (
    MODEL,
    default_specs,
    print_profiles,
    print_stack_decode,
    profile_layer,
    run_stack_decode,
)
from attnlab.bench.fixed_cost import print_fixed_cost, run_fixed_cost
from attnlab.bench.memory import MemoryReport, memory_steps, run_memory
from attnlab.bench.printing import (
    plot_compare,
    print_compare,
    print_decode,
    print_memory,
    write_json,
)

if TYPE_CHECKING:  # attnlab.parallel (torch.distributed) loads only for --parallel
    from attnlab.bench.parallel import ParallelReport

QUICK_FIXED_COST = {"rounds": 1, "min_run_time": 0.01}
QUICK_PROFILE = {"layers": 2, "steps": 3, "bandwidth_bytes": 8 * 2**20}
QUICK_STACK = {**QUICK_PROFILE, "matmul_size": 128}
QUICK_DECODE = {
    "contexts": (32, 128),
    "layers": 2,
    "min_run_time": 0.02,
    "rounds": 1,
    "read_bytes": 8 * 2**20,
}

__all__ = [
    "CompareReport",
    "DecodeReport",
    "MemoryReport",
    "PeerDecodeReport",
    "compare_command",
    "decode_command",
    "hf_command",
    "memory_command",
    "plot_compare",
    "run_compare",
    "run_decode",
    "run_decode_peers",
    "run_memory",
]


def compare_command(
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    tokens: int | None = None,
    batch: int | None = None,
    quick: bool = False,
    flex: bool = False,
    json_path: str | Path | None = None,
    plot_path: str | Path | None = None,
    console: Console | None = None,
) -> CompareReport:
    """`attnlab bench`: compare the peers with a progress bar, print the tables, and write
    the figures as JSON and the chart as PNG when the paths are given."""
    console = console or Console()
    options = {"tokens": tokens, "batch": batch, "quick": quick, "flex": flex}
    run = partial(run_compare, device=device, dtype=dtype, **options)
    report = _with_progress(console, "comparing", compare_steps(flex=flex), run)
    print_compare(report, console)
    _write_figures(report.to_dict(), json_path, console)
    if plot_path is not None:
        plot_compare(report, plot_path)
        console.print(f"chart written to {plot_path}")
    return report


def memory_command(
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    quick: bool = False,
    json_path: str | Path | None = None,
    console: Console | None = None,
) -> MemoryReport:
    """`attnlab bench --memory`: peak memory by context length with a progress bar, the
    table, and the figures as JSON when json_path is given. quick: 256 and 512 tokens."""
    console = console or Console()
    run = partial(run_memory, device=device, dtype=dtype, quick=quick)
    report = _with_progress(console, "peak memory", memory_steps(quick=quick), run)
    print_memory(report, console)
    _write_figures(report.to_dict(), json_path, console)
    return report


def decode_command(
    contexts: Sequence[int] | None = None,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    compile: bool = False,
    quick: bool = False,
    json_path: str | Path | None = None,
    console: Console | None = None,
) -> DecodeReport:
    """`attnlab bench --decode`: measure with a progress bar, print the tables, and write the
    figures as JSON when json_path is given. quick: tiny contexts and runs (a smoke test).
    compile: the static-cache peers' table also compiled (decode_peers). The back-to-back,
    per-part and fixed-cost tables time attnlab's native CPU step: on the CPU only."""
    console = console or Console()
    options = dict(QUICK_DECODE) if quick else {}
    if contexts:
        options["contexts"] = tuple(contexts)
    contexts = options.get("contexts", (256, 1024, 4096))
    steps = 1 + len(contexts) + 3 * 4  # 3 head layouts x (bf16, int8, batch 8, batch 1)
    run = partial(run_decode, device=device, dtype=dtype, **options)
    report = _with_progress(console, "decoding", steps, run)
    print_decode(report, console)
    figures = report.to_dict()
    _keep_figures(figures, json_path)  # what a run stopped midway has measured
    peers = _against_peers(contexts, device, dtype, compile, quick, console)
    figures["static_peers"] = peers.to_dict()
    _keep_figures(figures, json_path)
    if torch.device(device).type == "cpu":
        figures.update(_cpu_only(contexts, quick, console))
    else:
        console.print(
            "Note: the back-to-back, per-part and fixed-cost tables time attnlab's native CPU "
            "decode step: run with --device cpu for them."
        )
    _write_figures(figures, json_path, console)
    return report


def _against_peers(contexts, device, dtype, compile: bool, quick: bool, console: Console):
    """The decode step against a static-cache SDPA layer (decode_peers), printed."""
    options = dict(QUICK_PEERS) if quick else {}
    options.update(device=device, dtype=dtype, compile=compile)
    run = partial(run_decode_peers, contexts, **options)
    report = _with_progress(console, "static-cache peers", peer_steps(contexts), run)
    print_decode_peers(report, console)
    return report


def _cpu_only(contexts: Sequence[int], quick: bool, console: Console) -> dict:
    """The tables of attnlab's native CPU step, printed; their figures for the JSON."""
    stacked, profiles = _back_to_back(contexts, quick, console)
    with console.status("the fixed cost of a step per layer"):
        fixed = run_fixed_cost(**(QUICK_FIXED_COST if quick else {}))
    print_fixed_cost(fixed, console)
    return {
        "fixed_cost": fixed.to_dict(),
        "back_to_back": stacked.to_dict(),
        "profiles": [asdict(profile) for profile in profiles],
    }


def hf_command(
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    batch: int | None = None,
    tokens: int | None = None,
    compile: bool = False,
    quick: bool = False,
    json_path: str | Path | None = None,
    console: Console | None = None,
):
    """`attnlab bench --hf`: transformers models through attnlab against sdpa (bench.hf),
    with a progress bar; the table; JSON if asked."""
    from attnlab.bench.hf import hf_steps, print_hf, run_hf

    console = console or Console()
    sizes = {"batch": batch, "tokens": tokens, "compile": compile, "quick": quick}
    keep = partial(_keep_figures, json_path=json_path)  # each row as it comes
    run = partial(run_hf, device=device, dtype=dtype, on_row=keep, **sizes)
    report = _with_progress(console, "transformers models", hf_steps(compile=compile), run)
    print_hf(report, console)
    _write_figures(report.to_dict(), json_path, console)
    return report


def _back_to_back(contexts: Sequence[int], quick: bool, console: Console):
    """The back-to-back rows (decode_stack: layers run as a model runs them, warm, against
    both floor terms) and the per-layer profile of four of them: multi-head at the shortest
    and longest context, grouped-query and multi-query at the longest."""
    heads = MODEL["num_heads"]
    specs = default_specs(heads, tuple(sorted(contexts)))
    run = partial(run_stack_decode, specs, **(QUICK_STACK if quick else {}))
    stacked = _with_progress(console, "back to back", len(specs), run)
    print_stack_decode(stacked, console)
    shortest, longest = min(contexts), max(contexts)
    profiled = ((heads, shortest), (heads, longest), (heads // 3, longest), (1, longest))
    with console.status("one layer's step, part by part"):
        profiles = [
            profile_layer(kv, context, **(QUICK_PROFILE if quick else {}))
            for kv, context in profiled
        ]
    profiles = [profile for profile in profiles if profile is not None]
    if profiles:
        print_profiles(profiles, console)
    return stacked, profiles


def padded_command(
    *, quick: bool = False, json_path: str | Path | None = None, console: Console | None = None
):
    """`attnlab bench --padded`: time, print the table and ratios, write JSON if asked."""
    from attnlab.bench.padded import print_padded, run_padded

    console = console or Console()
    with console.status("a padded batch against an unpadded one"):
        report = run_padded(quick=quick)
    print_padded(report, console)
    _write_figures(report.to_dict(), json_path, console)
    return report


def kernel_command(
    *, quick: bool = False, json_path: str | Path | None = None, console: Console | None = None
):
    """`attnlab bench --kernel`: the causal kernel against SDPA by length and head layout,
    forward and forward + backward, with a progress bar; the table; JSON if asked."""
    from attnlab.bench.kernel import kernel_steps, print_kernel, run_kernel

    console = console or Console()
    run = partial(run_kernel, quick=quick)
    report = _with_progress(console, "kernel against SDPA", kernel_steps(quick), run)
    print_kernel(report, console)
    _write_figures(report.to_dict(), json_path, console)
    return report


def _write_figures(figures: dict, json_path: str | Path | None, console: Console) -> None:
    """--json: the figures written to json_path, and said so (nothing when it is None)."""
    if json_path is not None:
        write_json(figures, json_path)
        console.print(f"figures written to {json_path}")


def _keep_figures(figures: dict | object, json_path: str | Path | None) -> None:
    """The figures so far written to json_path (a report's to_dict() for a report), without
    a word: a long run that is stopped keeps what it measured."""
    if json_path is not None:
        write_json(figures if isinstance(figures, dict) else figures.to_dict(), json_path)


def _with_progress(console: Console, description: str, total: int, run: Callable):
    """run(progress=...) under a transient progress bar of `total` steps, which the progress
    callback advances; what run returns."""
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(description, total=total)
        return run(progress=_advance(progress, task))


def _advance(progress: Progress, task) -> Callable[[str], None]:
    """A run_* progress callback: one step forward, described."""

    def advance(step: str) -> None:
        progress.update(task, advance=1, description=step)

    return advance


def parallel_command(
    world: int,
    *,
    tokens: int,
    json_path: str | Path | None = None,
    console: Console | None = None,
) -> ParallelReport:
    """`attnlab bench --parallel N`: one process, then N, print the table, write JSON."""
    from attnlab.bench.parallel import run_parallel
    from attnlab.bench.printing import print_parallel

    console = console or Console()
    with console.status(f"ring attention, {tokens} tokens, 1 then {world} processes"):
        report = run_parallel(world, tokens=tokens)
    print_parallel(report, console)
    _write_figures(report.to_dict(), json_path, console)
    return report
