"""Timing and machine figures shared by the benchmarks: medians from torch.utils.benchmark
with every thread torch uses (its default is one), measured in interleaved rounds so that
drift on a shared machine hits every candidate alike."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping

import torch
from torch.utils import benchmark

_READ_BYTES = 256 * 2**20  # larger than any last-level cache, so reads come from memory


def interleaved_medians(
    candidates: Mapping[str, Callable[[], object]],
    *,
    rounds: int = 3,
    min_run_time: float = 0.2,
    warmup: int = 1,
) -> dict[str, float]:
    """Median seconds per call of each candidate, measured round-robin `rounds` times
    (warm-up calls excluded)."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    for _ in range(rounds):
        for name, fn in candidates.items():
            timer = benchmark.Timer(
                stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()
            )
            times[name].extend(timer.blocked_autorange(min_run_time=min_run_time).times)
    return {name: statistics.median(ts) for name, ts in times.items()}


def memory_read(device: str | torch.device = "cpu") -> tuple[Callable[[], object], int]:
    """A call that reads a 256 MiB buffer from memory (a sum), and the bytes it reads: time it
    beside other candidates to get the read bandwidth under the same conditions."""
    buffer = torch.ones(_READ_BYTES // 4, dtype=torch.float32, device=device)
    return buffer.sum, buffer.nbytes


def read_bandwidth(*, min_run_time: float = 0.2, device: str | torch.device = "cpu") -> float:
    """Bytes per second this machine reads from memory, measured on its own."""
    read, nbytes = memory_read(device)
    seconds = interleaved_medians({"read": read}, rounds=1, min_run_time=min_run_time)["read"]
    return nbytes / seconds
