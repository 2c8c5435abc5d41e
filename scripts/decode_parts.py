"""Where a cold decode step's time goes, per layer of a 12-layer stack (GPT-2 small's sizes):
the module's cached call, the native decode step called directly (no module call, no gate),
and PyTorch's F.linear on the layer's two weight matrices, beside the weights' and cache's
memory floor. Each call is timed cold, after a read larger than the CPU's caches, as
`attnlab bench --decode` times its steps.

Usage: python scripts/decode_parts.py NUM_KV_HEADS CONTEXT   (e.g. 1 2, or 4 256)
"""

from __future__ import annotations

import sys

import torch

from attnlab import decode_cpu
from attnlab.bench import decode
from attnlab.bench.timing import interleaved_medians, memory_read

LAYERS = 12


def main(num_kv_heads: int, context: int) -> None:
    if not decode_cpu.available():
        raise SystemExit(f"the native decode step is unavailable: {decode_cpu.load_error()}")
    read, read_bytes = memory_read()
    stack = decode._stack(768, 12, num_kv_heads, 4096, torch.float32, LAYERS)
    caches = [module.make_cache(1, 4096) for module in stack]
    held = torch.randn(1, num_kv_heads, context - 1, 64)  # (b, hkv, t, hd)
    with torch.no_grad():
        for cache in caches:
            cache.update(held, held)
    x = torch.randn(1, 1, 768)  # (b, 1, d)
    layers = [decode_cpu._layers(module) for module in stack]
    weights = [(m.qkv_proj.weight.detach(), m.out_proj.weight.detach()) for m in stack]

    def module_step():
        hidden = x
        with torch.no_grad():
            for module, cache in zip(stack, caches, strict=True):
                cache.crop(context - 1)
                hidden = module(hidden, cache=cache)

    def native_step():
        hidden = x
        with torch.no_grad():
            for module, cache, params in zip(stack, caches, layers, strict=True):
                cache.crop(context - 1)
                hidden = decode_cpu.step(module, hidden, cache, context - 1, params)

    def linear():
        row = x[:, 0]  # (b, d)
        for qkv, out in weights:
            torch.nn.functional.linear(row, qkv)
            row = torch.nn.functional.linear(row, out)

    candidates = {"module": module_step, "native": native_step, "linear": linear, "read": read}
    cold = {"module", "native", "linear"}
    times = interleaved_medians(candidates, rounds=3, min_run_time=0.3, cold=cold, flush=read)
    bandwidth = read_bytes / times["read"]
    step_bytes = decode._weight_bytes(stack[0]) + 2 * context * num_kv_heads * 64 * 4
    print(
        f"{num_kv_heads} key/value heads, context {context}, {bandwidth / 1e9:.1f} GB/s; "
        f"ms per layer: floor {step_bytes / bandwidth * 1e3:.3f}, "
        f"F.linear {times['linear'] / LAYERS * 1e3:.3f}, "
        f"native call {times['native'] / LAYERS * 1e3:.3f}, "
        f"module step {times['module'] / LAYERS * 1e3:.3f}"
    )


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
