"""Where a cached decode step of a tiny layer spends its time (issue 39's fixed cost), one
piece at a time: the module's call, its forward, plan.decode_lane, the extension's lane
alone, and its plan's verdict alone (lane_takes), each the best of seven `timeit` runs of
50,000 calls on one token (d_model 64, 4 heads, 16 tokens held), under no_grad. Each
difference is a layer of the call: nn.Module.__call__, forward's test of the call's form,
decode_lane's Python frame, the kernel (the lane less its plan).

Usage: python scripts/fixed_cost_parts.py
"""

from __future__ import annotations

import timeit

import torch

from attnlab import decode_cpu, plan
from attnlab.attention import MultiHeadAttention

D_MODEL, HEADS, HELD = 64, 4, 16


def best_us(call, number: int = 50_000, repeat: int = 7) -> float:
    """The least microseconds per call over `repeat` runs of `number` calls."""
    for _ in range(3):
        call()
    return min(timeit.repeat(call, number=number, repeat=repeat)) / number * 1e6


def main() -> None:
    torch.manual_seed(0)
    module = MultiHeadAttention(D_MODEL, D_MODEL, 4 * HELD, 0.0, HEADS).eval()
    x = torch.randn(1, 1, D_MODEL)  # (b, 1, d)
    cache = module.make_cache(1)
    torch.set_grad_enabled(False)
    module(torch.randn(1, HELD, D_MODEL), cache=cache)
    lane = plan._lane()
    if lane is None:
        raise SystemExit("the native decode step is unavailable here")
    takes = decode_cpu.binding().lane_takes

    def at_held(call):
        def step():
            cache.position = HELD  # the same slot every time: the cache never moves
            return call()

        return step

    rows = {
        "module(x, cache=cache)": at_held(lambda: module(x, cache=cache)),
        "module.forward(x, cache=cache)": at_held(lambda: module.forward(x, cache=cache)),
        "plan.decode_lane": at_held(lambda: plan.decode_lane(module, x, cache)),
        "the extension's decode_lane": at_held(lambda: lane(module, x, cache)),
        "lane_takes (the plan's verdict alone)": lambda: takes(module, x, cache),
    }
    for name, call in rows.items():
        print(f"{name:40s} {best_us(call):7.2f} us")


if __name__ == "__main__":
    main()
