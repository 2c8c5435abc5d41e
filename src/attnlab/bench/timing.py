"""Timing and machine figures shared by the benchmarks: medians from torch.utils.benchmark
with every thread torch uses (its default is one), measured in interleaved rounds so that
drift on a shared machine hits every candidate alike; calls whose figure must come from
memory are timed cold, one at a time after a read larger than the CPU's caches.

On a CUDA device torch.utils.benchmark's timer synchronises before every reading, so that a
median counts the kernels a call launched, not only their launch; the device's bandwidth is
a copy between two buffers much larger than its L2 cache (bandwidth_probe)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

import torch

_MIN_READ_BYTES = 256 * 2**20  # the read buffer's size, at least
DEVICE_COPY_BYTES = 512 * 2**20  # each buffer of the device's copy: ~10x an H100's L2
_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def last_level_cache_bytes() -> int:
    """The largest CPU cache Linux reports for cpu0 (its last level, shared by the cores and,
    on a virtual machine, by its neighbours), or 0 where it reports none."""
    sizes = []
    for path in _CACHES.glob("index*/size"):
        text = path.read_text().strip()  # e.g. "491520K"
        if text[:-1].isdigit() and text[-1] in _UNITS:
            sizes.append(int(text[:-1]) * _UNITS[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes, default=0)


def read_bytes() -> int:
    """Bytes a read must span to come from memory: twice the last-level cache, at least
    256 MiB."""
    return max(_MIN_READ_BYTES, 2 * last_level_cache_bytes())


def interleaved_medians(
    candidates: Mapping[str, Callable[[], object]],
    *,
    rounds: int = 3,
    min_run_time: float = 0.2,
    warmup: int = 1,
    cold: Collection[str] = (),
    flush: Callable[[], object] | None = None,
) -> dict[str, float]:
    """Median seconds per call of each candidate, measured round-robin `rounds` times
    (warm-up calls excluded). The candidates named in `cold` are timed one call at a time,
    each after `flush` (a read of more memory than the CPU's caches hold) has evicted what
    the call before left in them: their figures are from memory, however small their data."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    for _ in range(rounds):
        for name, fn in candidates.items():
            if name in cold:
                times[name].extend(_cold_times(fn, flush, min_run_time))
                continue
            timer = _timer_class()(
                stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()
            )
            times[name].extend(timer.blocked_autorange(min_run_time=min_run_time).times)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _cold_times(fn: Callable[[], object], flush, min_run_time: float) -> list[float]:
    """Seconds of single calls, each after flush(), until they add up to min_run_time (three
    calls at least)."""
    times: list[float] = []
    while sum(times) < min_run_time or len(times) < 3:
        flush()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def memory_read(
    device: str | torch.device = "cpu", nbytes: int | None = None
) -> tuple[Callable[[], object], int]:
    """A call that reads a buffer from memory (a sum), and the bytes it reads: time it beside
    other candidates to get the read bandwidth under the same conditions; on the CPU it also
    evicts the caches (interleaved_medians' flush).

    Args:
        device: where the buffer lives.
        nbytes: its size (default read_bytes(): twice the last-level cache, at least
            256 MiB).
    """
    nbytes = read_bytes() if nbytes is None else nbytes
    buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    return buffer.sum, buffer.nbytes


def read_bandwidth(*, min_run_time: float = 0.2, device: str | torch.device = "cpu") -> float:
    """Bytes per second this machine reads from memory, measured on its own."""
    read, nbytes = memory_read(device)
    seconds = interleaved_medians({"read": read}, rounds=1, min_run_time=min_run_time)["read"]
    return nbytes / seconds


def device_copy(
    device: str | torch.device, nbytes: int = DEVICE_COPY_BYTES
) -> tuple[Callable[[], object], int]:
    """A call that copies one buffer of `nbytes` into another on `device`, and the bytes it
    moves (2 x nbytes: every byte read once and written once): its bytes per second are
    the device memory's copy bandwidth, the rate a step that reads its weights and cache
    once can reach at best. Time it beside the calls it bounds (interleaved_medians; on
    CUDA the timer synchronises)."""
    source = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)

    def copy() -> torch.Tensor:
        return target.copy_(source)

    return copy, 2 * source.nbytes


def bandwidth_probe(
    device: str | torch.device = "cpu", nbytes: int | None = None
) -> tuple[Callable[[], object], int]:
    """What measures the memory bandwidth where a benchmark runs: on the CPU memory_read (a
    sum that also evicts the caches), elsewhere device_copy. Returns (call, bytes it moves).

    Args:
        device: where the benchmark runs.
        nbytes: the buffer's size (default read_bytes() on the CPU, DEVICE_COPY_BYTES on a
            device).
    """
    if torch.device(device).type == "cpu":
        return memory_read(device, nbytes)
    return device_copy(device, DEVICE_COPY_BYTES if nbytes is None else nbytes)


MATMUL_SIZE = 1024  # the matmul probe's square matrices


def matmul_probe(
    device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, size: int = MATMUL_SIZE
) -> tuple[Callable[[], object], float]:
    """What measures the matmul rate where a benchmark runs: a product of two random
    size x size matrices in `dtype` on `device`. Returns (call, flops it does)."""
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    return (lambda: torch.mm(a, b)), 2.0 * size**3


def _timer_class() -> type:
    """torch.utils.benchmark.Timer, imported on first use: its module imports
    torch.utils.cpp_extension, which the CUDA wheels make print "No CUDA runtime is found"
    (attnlab --help and every command that times nothing stay quiet)."""
    from torch.utils import benchmark

    return benchmark.Timer
