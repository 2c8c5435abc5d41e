"""A cached decode step of a Qwen3-style layer (d_model 768, 12 query and 4 key/value heads,
rotary positions, RMSNorm on each head's queries and keys) at 1,024 cached tokens, one
thread: the native CPU step against the module's Python path (a copy holding one extra
attribute, which the call plan sends there), alternating, best of 5 rounds of 50 steps.

Usage: python scripts/qk_norm_decode.py
"""

from __future__ import annotations

import copy
import time

import torch

from attnlab import MultiHeadAttention, plan


def microseconds_per_step(module: MultiHeadAttention, context: int = 1024) -> float:
    """The best round's microseconds per one-token step after `context` cached tokens."""
    cache = module.make_cache(1, max_tokens=2 * context)
    token = torch.randn(1, 1, module.d_in)
    with torch.no_grad():
        module(torch.randn(1, context, module.d_in), cache=cache)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(50):
                module(token, cache=cache)
                cache.crop(context)  # the same context for every step
            best = min(best, (time.perf_counter() - start) / 50)
    return best * 1e6


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    native = MultiHeadAttention(
        768, 768, 2048, 0.0, 12, num_kv_heads=4, rope=True, qk_norm="head"
    ).eval()
    python = copy.deepcopy(native)
    python.python_path = True  # an attribute a fresh module does not hold: the Python path
    with torch.no_grad():
        token = torch.randn(1, 1, 768)
        assert plan.native_decode(native, token, native.make_cache(1)) is not None
        assert plan.native_decode(python, token, python.make_cache(1)) is None
    for _ in range(2):
        print(f"native step {microseconds_per_step(native):8.1f} us", end="   ")
        print(f"Python path {microseconds_per_step(python):8.1f} us")


if __name__ == "__main__":
    main()
