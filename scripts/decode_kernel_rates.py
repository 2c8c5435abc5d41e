"""How close the native decode step's kernels come to this machine's limits on one thread
(or N, `--threads`; issue 39), away from the stack's layers and Python: the grouped
attention kernels and the projection, each timed in a loop in C++, beside the two limits
measured in the same run on as many threads.

- attention: a group of 12 (multi-query) or 3 (grouped-query) query heads over 256 keys of
  64 features (a cache block), scores then values, with the op's prefetches. "L2": the same
  block every round. "memory": each round the next of 4,096 heads' blocks (512 MiB). Where
  the build has the bfloat16 products (AVX512_BF16), the same over an int8 cache with them
  ("memory": 16,384 heads' blocks, 512 MiB); its GFLOP/s count the float32 work it
  replaces, so it can pass torch.mm's rate.
- projection: 1 or 8 tokens through (896, 768) weights (a multi-query layer's q, k and v),
  each round the next of 256 copies (704 MB; the weights' 2.75 MB alone: "L3").
- limits: `torch.sum` over 1 GiB (the read bandwidth), a 1024^3 `torch.mm` (the matmul
  rate), best of 5 each.

A kernel's "x limit" is its time over max(bytes / bandwidth, flops / matmul rate): 1.00 is
the limit, and a kernel reading from L2 or L3 can pass the memory term.

The kernels are built from src/attnlab/csrc/decode_step.cpp as it is, with
scripts/decode_kernel_rates.cpp appended (its library renamed, so it loads beside attnlab's).
`--baseline BEFORE.cpp` builds another version of decode_step.cpp the same way and times
its kernels in turn with these, each loop's best of three runs, in one process:

    git show HEAD:src/attnlab/csrc/decode_step.cpp > /tmp/before.cpp
    python scripts/decode_kernel_rates.py --baseline /tmp/before.cpp

`--threads N` runs each loop on N threads at once (each its own buffers; the rate is their
sum) beside the limits on N threads: how the kernels share the memory system.

Usage: python scripts/decode_kernel_rates.py [--rounds N] [--baseline BEFORE.cpp] [--threads N]
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
import threading
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from attnlab import _build, decode_cpu
from attnlab.bench.decode_stack import matmul_rate, read_bandwidth

HEAD_DIM, KEYS = 64, 256
HERE = Path(__file__).resolve().parent
SOURCE = Path(decode_cpu.__file__).with_name("csrc") / "decode_step.cpp"


def appended_text(source: Path, harness: Path, library: str) -> str:
    """`source` (a decode_step.cpp, without its bindings) and the C++ file `harness` as one
    translation unit, its op library renamed `library` so that it loads beside attnlab's."""
    op_text = source.read_text()
    op_text = op_text[: op_text.index('#include "decode_plan.h"')]  # the bindings follow
    text = op_text + harness.read_text()
    return text.replace("TORCH_LIBRARY(attnlab_decode,", f"TORCH_LIBRARY({library},")


def build_appended(harness: Path, prefix: str, source: Path = SOURCE):
    """The extension of appended_text(source, harness, ...), named `prefix` and the text's
    digest (two versions load in one process), built once per text."""
    from torch.utils import cpp_extension

    digest = hashlib.sha256(appended_text(source, harness, prefix).encode()).hexdigest()[:12]
    name = f"{prefix}_{digest}"
    text = appended_text(source, harness, name)
    path = Path(tempfile.gettempdir()) / f"{name}.cpp"
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return cpp_extension.load(
        name,
        [str(path)],
        extra_cflags=_build.cflags(decode_cpu._WIDE),
        extra_ldflags=list(_build.LDFLAGS),
        extra_include_paths=[str(SOURCE.parent)],
    )


def kernels(source: Path = SOURCE):
    """`source` and decode_kernel_rates.cpp, built as one extension."""
    return build_appended(HERE / "decode_kernel_rates.cpp", "attnlab_kernel_rates", source)


def limits() -> tuple[float, float]:
    """(read bytes per second, matmul flops per second) on the calling thread: the decode
    stack's measures, over 1 GiB and 1024^3."""
    return read_bandwidth(1 << 30), matmul_rate(1024)


def loops(rounds: int, modules):
    """(kernel, source, bytes per flop, call of a module) for each timed loop; the int8 rows
    only where every module has the bfloat16 products (attention_int8)."""
    out = []
    for groups, name in ((12, "multi-query"), (3, "grouped-query")):
        bytes_per_flop = (2 * HEAD_DIM * KEYS * 4) / (4 * groups * HEAD_DIM * KEYS)
        for heads, where in ((1, "L2"), (4096, "memory")):

            def call(module, groups=groups, heads=heads):
                return module.attention(groups, KEYS, heads, rounds)

            out.append((f"attention, {name} ({groups} heads)", where, bytes_per_flop, call))
    if all(hasattr(module, "attention_int8") for module in modules):
        for groups, name in ((12, "multi-query"), (3, "grouped-query")):
            # an int8 key and value per feature, and a float32 scale each per key
            bytes_per_flop = (2 * HEAD_DIM * KEYS + 2 * KEYS * 4) / (4 * groups * HEAD_DIM * KEYS)
            for heads, where in ((1, "L2"), (16384, "memory")):

                def call(module, groups=groups, heads=heads):
                    return module.attention_int8(groups, KEYS, heads, rounds)

                kernel = f"attention, {name} ({groups} heads), int8, bfloat16 products"
                out.append((kernel, where, bytes_per_flop, call))
    for tokens in (1, 8):
        bytes_per_flop = 4 / (2 * tokens)
        for copies, where in ((1, "L3"), (256, "memory")):

            def call(module, tokens=tokens, copies=copies):
                return module.projection(tokens, 768, 896, copies, rounds // 4)

            out.append((f"projection, {tokens} token(s)", where, bytes_per_flop, call))
    return out


def rates(modules, call, threads: int = 1) -> list[float]:
    """Each module's GFLOP/s on one loop, the best of three runs taken in turn; with
    `threads` above 1, the loop runs on that many threads at once (each its own buffers,
    the GIL released) and the rate is their sum."""
    best_rates = [0.0] * len(modules)
    for _ in range(3):
        for i, module in enumerate(modules):
            best_rates[i] = max(best_rates[i], _at_once(call, module, threads))
    return best_rates


def _at_once(call, module, threads: int) -> float:
    """The sum of `threads` concurrent runs' GFLOP/s of call(module)."""
    if threads == 1:
        return call(module)
    results = [0.0] * threads

    def run(k: int) -> None:
        results[k] = call(module)

    workers = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return sum(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4096)
    parser.add_argument("--baseline", help="another decode_step.cpp, timed in turn with this one")
    parser.add_argument(
        "--threads", type=int, default=1, help="threads running each loop at once (limits too)"
    )
    args = parser.parse_args()
    if not decode_cpu.available():
        raise SystemExit(f"the native decode step is unavailable: {decode_cpu.load_error()}")
    torch.set_num_threads(args.threads)
    modules = [kernels()] + ([kernels(Path(args.baseline))] if args.baseline else [])
    bandwidth, matmul = limits()
    measured = [
        (*row[:3], rates(modules, row[3], args.threads)) for row in loops(args.rounds, modules)
    ]
    bandwidth_after, matmul_after = limits()
    bandwidth, matmul = max(bandwidth, bandwidth_after), max(matmul, matmul_after)
    table = Table(
        title=f"{args.threads} thread(s): torch.sum {bandwidth / 1e9:.1f} GB/s, torch.mm "
        f"{matmul / 1e9:.0f} GFLOP/s (best of before and after the kernels)"
    )
    columns = ["kernel", "from", "GFLOP/s", "GB/s", "x limit"]
    columns += ["baseline GFLOP/s", "this/baseline time"] if args.baseline else []
    for column in columns:
        table.add_column(column, justify="left" if column in ("kernel", "from") else "right")
    for kernel, where, bytes_per_flop, (rate, *baseline) in measured:
        limit = min(bandwidth / 1e9 / bytes_per_flop, matmul / 1e9)  # GFLOP/s at the floor
        row = [kernel, where, f"{rate:.1f}", f"{rate * bytes_per_flop:.1f}", f"{limit / rate:.2f}"]
        row += [f"{baseline[0]:.1f}", f"{baseline[0] / rate:.2f}"] if baseline else []
        table.add_row(*row)
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
