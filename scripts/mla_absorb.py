"""Where MultiHeadLatentAttention's absorbed decode (attention in the latent space) beats
expanding every cached latent into per-head keys and values: one cached call of `tq` new
tokens after `tk - tq` held ones, forward under no_grad, absorb=True against absorb=False
(the rule it sets is MultiHeadLatentAttention.absorbs).

DeepSeek-V3's head shapes (kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128, q_lora_rank
1536) at d_model 2048 and 16 heads, batch 1, float32 on the CPU.

Each figure is the least CPU time of one call over REPS interleaved rounds (time.thread_time,
one torch thread), as scripts/kernel_crossover.py measures: on a shared machine, CPU time is
what time-slicing leaves alone, where wall-clock medians swing by 2x. Pass --threads N for
torch.utils.benchmark medians with N threads instead (a quiet machine).

Usage: python scripts/mla_absorb.py [--keys 256,1024,4096] [--queries 1,2,4,...] [--reps 7]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils import benchmark

from attnlab.mla import MultiHeadLatentAttention

D_MODEL = 2048


def _least_cpu_time(calls: dict, reps: int) -> dict:
    """The least thread CPU time of each call over `reps` rounds, the calls interleaved."""
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(reps):
        for name, call in calls.items():
            start = time.thread_time()
            call()
            best[name] = min(best[name], time.thread_time() - start)
    return best


def _medians(calls: dict, threads: int) -> dict:
    """torch.utils.benchmark medians with `threads` threads."""
    return {
        name: benchmark.Timer(stmt="call()", globals={"call": call}, num_threads=threads)
        .blocked_autorange(min_run_time=0.5)
        .median
        for name, call in calls.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", default="256,1024,4096")
    parser.add_argument("--queries", default="1,2,4,8,16,32,64,128")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="0: CPU time, one thread")
    args = parser.parse_args()
    keys = [int(k) for k in args.keys.split(",")]
    queries = [int(q) for q in args.queries.split(",")]
    if not args.threads:
        torch.set_num_threads(1)
    torch.manual_seed(0)
    module = MultiHeadLatentAttention(D_MODEL, args.heads, 1536, 512, 128, 64, 128, max(keys))
    module.eval()
    how = f"{args.threads} threads, medians" if args.threads else "1 thread, least CPU time"
    print(f"{args.heads} heads, float32 CPU, {how}")
    print(f"{'keys':>6} {'queries':>7} {'absorbed ms':>12} {'expanded ms':>12} {'speedup':>8}")
    for tk in keys:
        cache = module.make_cache(1, tk)
        for tq in (q for q in queries if q < tk):
            held = tk - tq
            with torch.no_grad():
                cache.reset()
                module(torch.randn(1, held, D_MODEL), cache=cache)
            x = torch.randn(1, tq, D_MODEL)

            def step(absorb: bool, x=x, cache=cache, held=held) -> None:
                with torch.no_grad():
                    cache.crop(held)
                    module(x, cache=cache, absorb=absorb)

            calls = {True: lambda: step(True), False: lambda: step(False)}
            step(True), step(False)  # warm-up
            times = (
                _medians(calls, args.threads) if args.threads else _least_cpu_time(calls, args.reps)
            )
            print(
                f"{tk:>6} {tq:>7} {times[True] * 1e3:>12.3f} {times[False] * 1e3:>12.3f} "
                f"{times[False] / times[True]:>7.2f}x"
            )


if __name__ == "__main__":
    main()
