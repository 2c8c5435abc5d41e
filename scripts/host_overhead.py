"""The host's cost of one call, where a GPU waits on it: attnlab's module and
`functional.attention` against nanoGPT's SDPA module and `F.scaled_dot_product_attention`,
on CPU tensors a few elements wide (the kernels take next to nothing), one thread, value
checks off as on a GPU by default (`attnlab.debug.checks(False)`). Best of 5 rounds of
3,000 calls each, microseconds per call.

Usage: python scripts/host_overhead.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

import attnlab
from attnlab import MultiHeadAttention, functional
from attnlab.bench.peers import NanoGPTAttention, Shape, make_weights


def microseconds(call, calls: int = 3000, rounds: int = 5) -> float:
    """The best round's microseconds per call, after 200 warm-up calls."""
    for _ in range(200):
        call()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    x = torch.randn(1, 4, 64)  # (b, t, d_model)
    q = torch.randn(1, 4, 4, 16)  # (b, h, t, hd)
    shape = Shape(1, 4, 64, 4, torch.float32, torch.device("cpu"))
    nano = NanoGPTAttention(shape, make_weights(shape))  # the bench's nanoGPT peer
    module = MultiHeadAttention(64, 64, 64, 0.0, 4)
    sdpa = F.scaled_dot_product_attention
    rows = [
        ("nanoGPT's SDPA module", lambda: nano(x)),
        ("attnlab MultiHeadAttention", lambda: module(x)),
        ("F.scaled_dot_product_attention", lambda: sdpa(q, q, q, is_causal=True)),
        ("attnlab functional.attention", lambda: functional.attention(q, q, q, causal=True)),
    ]  # fmt: skip

    with torch.no_grad(), attnlab.debug.checks(False):
        for name, call in rows:
            print(f"{name:32s} {microseconds(call):7.1f} us")


if __name__ == "__main__":
    main()
