"""Where attnlab's causal CPU kernel starts beating SDPA, the crossover "auto" reads
(attnlab.functional's _FLASH_MIN_QUERIES*): attention(backend="flash") against
attention(backend="sdpa"), both through attnlab's checks, forward under no_grad and forward
+ backward, at (batch, 12, tokens, 64) with 12 and 1 key/value heads, float32, causal.

Each figure is the least CPU time of one call over REPS interleaved rounds (time.thread_time,
one torch thread): on a shared machine, CPU time is what time-slicing leaves alone, where
wall-clock medians of a few milliseconds swing by 2x.

Usage: python scripts/kernel_crossover.py TOKENS,TOKENS,... REPS BATCH
       (e.g. 33,64,96,128,160,192,256 9 1)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch

from attnlab import flash_cpu
from attnlab.functional import attention


def _forward(q, k, v, backend: str) -> Callable[[], None]:
    def call() -> None:
        with torch.no_grad():
            attention(q, k, v, causal=True, backend=backend)

    return call


def _forward_backward(leaves, backend: str) -> Callable[[], None]:
    def call() -> None:
        attention(*leaves, causal=True, backend=backend).sum().backward()
        for t in leaves:
            t.grad = None

    return call


def _cpu_seconds(fn: Callable[[], None]) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def main(lengths: list[int], reps: int, batch: int) -> None:
    if not flash_cpu.available():
        raise SystemExit(f"the causal kernel is unavailable: {flash_cpu.load_error()}")
    torch.set_num_threads(1)
    for tokens in lengths:
        for kv_heads in (12, 1):
            g = torch.Generator().manual_seed(0)
            q = torch.randn(batch, 12, tokens, 64, generator=g)  # (b, hq, t, hd)
            k, v = (torch.randn(batch, kv_heads, tokens, 64, generator=g) for _ in "kv")
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            calls = {
                "fwd flash": _forward(q, k, v, "flash"),
                "fwd sdpa": _forward(q, k, v, "sdpa"),
                "f+b flash": _forward_backward(leaves, "flash"),
                "f+b sdpa": _forward_backward(leaves, "sdpa"),
            }
            for fn in calls.values():
                fn()  # warm-up
            best = dict.fromkeys(calls, float("inf"))
            for _ in range(reps):
                for name, fn in calls.items():
                    best[name] = min(best[name], _cpu_seconds(fn))
            cells = [
                f"{mode} flash {best[f'{mode} flash'] * 1e3:6.2f} sdpa "
                f"{best[f'{mode} sdpa'] * 1e3:6.2f} ms "
                f"({best[f'{mode} sdpa'] / best[f'{mode} flash']:.2f}x)"
                for mode in ("fwd", "f+b")
            ]
            print(f"T={tokens:5d} b={batch} 12/{kv_heads:2d}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main([int(t) for t in sys.argv[1].split(",")], int(sys.argv[2]), int(sys.argv[3]))
