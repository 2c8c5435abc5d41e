"""Where a cold decode step's time goes, per layer of a 12-layer stack (GPT-2 small's sizes):
the module's cached call, the native decode step called directly (no module call, no gate),
and PyTorch's F.linear on the layer's two weight matrices, beside the weights' and cache's
memory floor. Each call is timed cold, after a read larger than the CPU's caches, as
`attnlab bench --decode` times its steps.

Usage: python scripts/decode_parts.py NUM_KV_HEADS CONTEXT [BATCH]   (e.g. 1 2, 4 256, 1 256 8)
"""

from __future__ import annotations

import sys

import torch

from attnlab import decode_cpu, plan
from attnlab.bench import decode
from attnlab.bench.timing import interleaved_medians, memory_read

LAYERS = 12


def main(num_kv_heads: int, context: int, batch: int = 1) -> None:
    if not decode_cpu.available():
        raise SystemExit(f"the native decode step is unavailable: {decode_cpu.load_error()}")
    read, read_bytes = memory_read()
    stack = decode._stack(768, 12, num_kv_heads, 4096, torch.float32, LAYERS)
    caches = decode._filled_caches(stack, batch, 4096, torch.float32)  # cropped by each step
    x = torch.randn(batch, 1, 768)  # (b, 1, d)
    weights_of = {id(module): plan.native_module(module) for module in stack}
    weights = [(m.qkv_proj.weight.detach(), m.out_proj.weight.detach()) for m in stack]
    module_step = decode.stack_step(stack, caches, x, context)

    def native_call(module, hidden, cache):  # no module call, no checks, no plan
        tensors = weights_of[id(module)]  # the cache is at position context - 1 (stack_step)
        scale = module.head_dim**-0.5
        return decode_cpu.step(hidden, tensors, module.num_heads, scale, cache, None)

    native_step = decode.stack_step(stack, caches, x, context, layer=native_call)

    def linear():
        row = x[:, 0]  # (b, d)
        for qkv, out in weights:
            torch.nn.functional.linear(row, qkv)
            row = torch.nn.functional.linear(row, out)

    candidates = {"module": module_step, "native": native_step, "linear": linear, "read": read}
    cold = {"module", "native", "linear"}
    times = interleaved_medians(candidates, rounds=3, min_run_time=0.3, cold=cold, flush=read)
    bandwidth = read_bytes / times["read"]
    floor = decode._floor(stack[0], context, bandwidth, batch)
    print(
        f"{num_kv_heads} key/value heads, batch {batch}, context {context}, "
        f"{bandwidth / 1e9:.1f} GB/s; "
        f"ms per layer: memory floor {floor * 1e3:.3f}, "
        f"F.linear {times['linear'] / LAYERS * 1e3:.3f}, "
        f"native call {times['native'] / LAYERS * 1e3:.3f}, "
        f"module step {times['module'] / LAYERS * 1e3:.3f}"
    )


if __name__ == "__main__":
    main(*(int(arg) for arg in sys.argv[1:4]))
