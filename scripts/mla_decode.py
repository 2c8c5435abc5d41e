"""MultiHeadLatentAttention's cached one-token step on the CPU three ways, side by side in
one process: "lane", as forward runs it (plan.latent_lane: the plan read in C++, then the
projections, decode_cpu.latent_step and o_proj in one call); "kernels", the same kernels
called from the module's Python path (the lane off: forward's checks, decode_cpu.linear_rows
per projection, decode_cpu.latent_step); "without" them (decode_cpu.loaded() made False:
the blocked batched products and the Python absorbed path).

The stack is the bench's latent one (attnlab.bench.decode_stack.LATENT: d_model 768, 12
heads, kv_lora_rank 256, float32, 12 layers), batch 1, its cache cropped back after every
step; each arm's figure is the median ms per 12-layer step over interleaved rounds
(attnlab.bench.timing.interleaved_medians, back to back, 2 threads).

Usage: python scripts/mla_decode.py [--contexts 256,1024,4096] [--rounds 5]
"""

from __future__ import annotations

import argparse
from unittest import mock

import torch

from attnlab import decode_cpu, plan
from attnlab.bench import timing
from attnlab.bench.decode_stack import latent_stack

D_MODEL, HEADS, LAYERS = 768, 12, 12


def _step(layers: list, caches: list, context: int):
    x = torch.randn(1, 1, D_MODEL)

    def step() -> None:
        for cache in caches:
            cache.position = context  # the same step every call
        h = x
        for layer, cache in zip(layers, caches, strict=True):
            h = layer(h, cache=cache)

    return step


def _patched(step, owner, name, value):
    def call() -> None:
        with mock.patch.object(owner, name, value):
            step()

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="256,1024,4096")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    contexts = [int(c) for c in args.contexts.split(",")]
    layers = latent_stack(D_MODEL, HEADS, LAYERS, max(contexts) + 1)
    if not decode_cpu.available():
        raise SystemExit(f"the native kernels are unavailable: {decode_cpu.load_error()}")
    print("context | lane ms | kernels ms | without ms | kernels / lane | without / lane")
    with torch.no_grad():
        for context in contexts:
            caches = [layer.make_cache(1, context + 1) for layer in layers]
            for layer, cache in zip(layers, caches, strict=True):
                layer(torch.randn(1, context, D_MODEL), cache=cache)
            step = _step(layers, caches, context)
            arms = {
                "lane": step,
                "kernels": _patched(step, plan, "latent_lane", lambda *args: None),
                "without": _patched(step, decode_cpu, "loaded", lambda: False),
            }
            medians = timing.interleaved_medians(arms, rounds=args.rounds)
            lane, kernels, without = (medians[arm] * 1e3 for arm in arms)
            print(
                f"{context} | {lane:.2f} | {kernels:.2f} | {without:.2f} | "
                f"{kernels / lane:.2f} | {without / lane:.2f}"
            )


if __name__ == "__main__":
    main()
