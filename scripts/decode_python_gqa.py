"""The Python path's attention for one decoded token over a grouped-query cache (issue 39:
"the same for the Python path's grouped SDPA call where it is faster"): what a cached step
computes when the native step is not taken (another dtype, a subclass, hooks), timed three
ways side by side on the keys and values a KVCache hands it (tokens last, views of its
buffers):

- "math (attnlab)": functional.attention(backend="math"), which the "auto" backend takes
  there (_reads_cache_faster): the group's queries as the rows of one product against
  their shared key head, no copy;
- "SDPA enable_gqa": F.scaled_dot_product_attention(..., enable_gqa=True) on the same views;
- "SDPA repeated": SDPA after repeat_interleave of the key/value heads (what a layer
  without enable_gqa writes).

One thread, float32, 12 query heads of 64, batch 1 and 8, 4 and 1 key/value heads, 256 to
4,096 cached tokens; median microseconds over interleaved rounds (torch.utils.benchmark).

Usage: python scripts/decode_python_gqa.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils import benchmark

from attnlab import KVCache, functional

HEADS, HEAD_DIM = 12, 64


def cached_views(batch: int, kv_heads: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values a KVCache holding `tokens` random tokens returns, (b, hkv, t, hd)."""
    cache = KVCache(batch, tokens, kv_heads, HEAD_DIM)
    k = torch.randn(batch, kv_heads, tokens, HEAD_DIM)
    return cache.append(k, torch.randn_like(k))[:2]


def grouped_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict:
    """The three ways, each a call of no arguments on these q (b, hq, 1, hd), k and v."""
    groups = q.shape[1] // k.shape[1]
    return {
        "math": lambda: functional.attention(q, k, v, causal=True, backend="math"),
        "gqa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        "repeated": lambda: F.scaled_dot_product_attention(
            q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        ),
    }


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    print(
        "| batch | kv heads | tokens | math (attnlab) us | SDPA enable_gqa us | SDPA repeated us |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for batch in (1, 8):
        for kv_heads in (4, 1):
            for tokens in (256, 1024, 4096):
                k, v = cached_views(batch, kv_heads, tokens)
                q = torch.randn(batch, HEADS, 1, HEAD_DIM)
                calls = grouped_calls(q, k, v)
                torch.testing.assert_close(calls["math"](), calls["gqa"](), rtol=1e-4, atol=1e-5)
                medians = {name: [] for name in calls}
                with torch.no_grad():
                    for _ in range(3):  # interleaved rounds
                        for name, call in calls.items():
                            timer = benchmark.Timer("call()", globals={"call": call})
                            medians[name].append(timer.blocked_autorange(min_run_time=0.2).median)
                row = [sorted(times)[1] * 1e6 for times in medians.values()]
                print(
                    f"| {batch} | {kv_heads} | {tokens} | "
                    + " | ".join(f"{t:.1f}" for t in row)
                    + " |"
                )


if __name__ == "__main__":
    main()
