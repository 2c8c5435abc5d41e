"""Where a 12-layer decode step's time goes on several threads (issue 39): the native step's
three parallel regions (the q/k/v projection, the attention over the cache, the output
projection), how long each takes, how far apart its threads finish, and the serial time
between them, in the stack of scripts/decode_gqa.py (GPT-2 small's sizes, float32).

decode_step.cpp is built with a clock around each parallel region (inserted at named
places in its text; a missing place is an error, not a silent miss) under a library name of
its own, so that it loads beside attnlab's. Per region and step:

- ms: from the region's start to its last thread's end (to the end of the function that
  holds it, which ends with it);
- spread: from its first thread's end to its last's, as a share of ms (the time the
  threads spend waiting for each other at its end);
- GB/s and GFLOP/s: the bytes it must read (its weights, or the cache) and its arithmetic
  over ms, beside the machine's limits measured in the same run (`read_bandwidth`,
  `matmul_rate` of attnlab.bench.decode_stack, on the same threads);
- serial: the time from one region's end to the next one's start, on the calling thread
  (inside the op: its set-up between the projection and the attention, and its return and
  the next call between the attention, whose function ends with the heads' merge, and the
  output projection; between layers: the op's tail, the Python loop and the next op's
  checks and allocations).

The steps run back to back (the last-level cache then keeps part of the stack's weights from
one step to the next), or with `--cold` each after a read that evicts the CPU's caches, as
`attnlab bench --decode` times its rows.

Usage: python scripts/decode_regions.py [--steps N] [--threads N] [--rows kv:batch:context,...]
    [--cache-dtype float32|bfloat16|int8] [--source decode_step.cpp] [--cold]
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
import time
from pathlib import Path

import torch
from decode_gqa import D_MODEL, DTYPES, HEADS, LAYERS, stack_step
from rich.console import Console
from rich.table import Table

from attnlab import _build, decode_cpu
from attnlab.bench import timing
from attnlab.bench.decode_stack import matmul_rate, read_bandwidth

SOURCE = Path(decode_cpu.__file__).with_name("csrc") / "decode_step.cpp"
REGIONS = ("q/k/v projection", "attention", "output projection")
GAPS = ("projection -> attention", "attention -> projection", "between layers")

CLOCK = r"""
#include <atomic>
#include <chrono>

// Inserted by scripts/decode_regions.py: a clock around each parallel region.
namespace region_clock {
inline double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
// per region kind (0 q/k/v projection, 1 attention, 2 output projection): calls, seconds
// to the last thread's end, seconds from the first thread's end to the last's; per gap
// kind (what ended before: 0, 1, 2): seconds
double totals[3][3] = {};
double gaps[3] = {};
double last_end = 0;
int last_kind = -1;
int projections = 0;  // projections so far: even ones are q/k/v, odd ones the output's

struct Timer {
  int kind;
  double start, first = 0, last = 0;
  int finished = 0;
  std::atomic_flag lock = ATOMIC_FLAG_INIT;  // over first, last and finished
  explicit Timer(int k) : kind(k), start(now()) {
    const int before = last_kind;
    if (before >= 0 && start - last_end < 1e-3) gaps[before] += start - last_end;
  }
  void done() {  // a thread's share ended
    const double t = now();
    while (lock.test_and_set(std::memory_order_acquire)) {
    }
    if (finished++ == 0) first = t;
    last = std::max(last, t);
    lock.clear(std::memory_order_release);
  }
  ~Timer() {  // the region's function ends with its parallel_for: the region is closed
    totals[kind][0] += 1;
    totals[kind][1] += last - start;
    totals[kind][2] += last - first;
    last_end = now();
    last_kind = kind;
  }
};
struct Done {
  Timer& timer;
  ~Done() { timer.done(); }
};
inline int projection_kind() { return (projections++ % 2) ? 2 : 0; }

at::Tensor take() {  // (3, 3) totals then (3,) gaps, flattened; reset
  auto out = at::empty({12}, at::kDouble);
  double* p = out.data_ptr<double>();
  for (int k = 0; k < 3; ++k) {
    for (int j = 0; j < 3; ++j) p[3 * k + j] = totals[k][j], totals[k][j] = 0;
  }
  for (int k = 0; k < 3; ++k) p[9 + k] = gaps[k], gaps[k] = 0;
  last_kind = -1;
  return out;
}
}  // namespace region_clock
"""

# (anchor in decode_step.cpp, what replaces it): each anchor must occur exactly once
PLACES = (
    ("#include <torch/library.h>\n", "#include <torch/library.h>\n" + CLOCK),
    (
        "  at::parallel_for(0, out, grain, [&](int64_t begin, int64_t end) {\n",
        "  region_clock::Timer timer(region_clock::projection_kind());\n"
        "  at::parallel_for(0, out, grain, [&](int64_t begin, int64_t end) {\n"
        "    region_clock::Done done{timer};\n",
    ),
    (
        "  at::parallel_for(0, batch * a.kv_heads * a.chunks, grain_for(item_floats), "
        "[&](int64_t begin,\n",
        "  region_clock::Timer timer(1);\n"
        "  at::parallel_for(0, batch * a.kv_heads * a.chunks, grain_for(item_floats), "
        "[&](int64_t begin,\n",
    ),
    (
        "    std::vector<float> scores(groups * a.chunk);\n",
        "    region_clock::Done done{timer};\n    std::vector<float> scores(groups * a.chunk);\n",
    ),
)


def clocked_text(text: str, name: str) -> str:
    """decode_step.cpp's text with the clock inserted, its library renamed `name`, and an op
    `name::take` returning the clock's totals."""
    for anchor, replacement in PLACES:
        if text.count(anchor) != 1:
            raise SystemExit(f"decode_step.cpp no longer has this place once: {anchor!r}")
        text = text.replace(anchor, replacement)
    text = text.replace("TORCH_LIBRARY(attnlab_decode,", f"TORCH_LIBRARY({name},")
    return text + (
        f'\nTORCH_LIBRARY_FRAGMENT({name}, m) {{\n  m.def("take() -> Tensor", '
        f"&region_clock::take);\n}}\n"
    )


def clocked_op(source_path: Path = SOURCE):
    """The clocked decode_step of `source_path` (its direct face, as decode_gqa.py's
    baseline) and `take`."""
    from torch.utils import cpp_extension

    source = source_path.read_text()
    digest = hashlib.sha256((source + CLOCK).encode()).hexdigest()[:12]
    name = f"attnlab_decode_regions_{digest}"
    text = clocked_text(source, name)
    path = Path(tempfile.gettempdir()) / f"{name}.cpp"
    if not path.exists() or path.read_text() != text:  # rewritten, it would be rebuilt
        path.write_text(text)
    module = cpp_extension.load(
        name,
        [str(path)],
        extra_cflags=_build.cflags(decode_cpu._WIDE),
        extra_ldflags=list(_build.LDFLAGS),
        extra_include_paths=[str(SOURCE.parent)],
    )
    return module.decode_step, getattr(torch.ops, name).take


def timed_steps(step, steps: int, flush=None, clock=time.perf_counter) -> float:
    """Seconds per step over `steps` steps back to back, or each after flush() (a read that
    evicts the CPU's caches, outside the time)."""
    total = 0.0
    for _ in range(steps):
        if flush is not None:
            flush()
        start = clock()
        step()
        total += clock() - start
    return total / steps


def _row(text: str) -> tuple[int, int, int]:
    kv, batch, context = (int(part) for part in text.split(":"))
    return kv, batch, context


def region_loads(
    kv: int, batch: int, context: int, cache_dtype: torch.dtype = torch.float32
) -> list[tuple[float, float]]:
    """(bytes read, flops) per step of each region, over the stack's layers."""
    hd = D_MODEL // HEADS
    d_qkv = D_MODEL + 2 * kv * hd
    qkv = (4.0 * d_qkv * D_MODEL, 2.0 * batch * d_qkv * D_MODEL)
    # a token's key or value: hd elements, and an int8 cache's float32 scale
    per_vector = hd * cache_dtype.itemsize + (4 if cache_dtype == torch.int8 else 0)
    cache = (2.0 * batch * kv * context * per_vector, 4.0 * batch * HEADS * hd * context)
    out = (4.0 * D_MODEL * D_MODEL, 2.0 * batch * D_MODEL * D_MODEL)
    return [(LAYERS * b, LAYERS * f) for b, f in (qkv, cache, out)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="steps timed per row")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--source", type=Path, default=SOURCE, help="another decode_step.cpp (e.g. HEAD's)"
    )
    parser.add_argument(
        "--rows",
        type=lambda text: [_row(part) for part in text.split(",")],
        default=[(1, 8, 256), (1, 8, 1024), (1, 8, 4096), (4, 8, 4096)],
        help="key/value heads:batch:context, comma-separated",
    )
    parser.add_argument("--cache-dtype", choices=DTYPES, default="float32")
    parser.add_argument(
        "--cold",
        action="store_true",
        help="each step after evicting the CPU's caches (as attnlab bench --decode times it)",
    )
    args = parser.parse_args()
    cache_dtype = DTYPES[args.cache_dtype]
    if not decode_cpu.available():
        raise SystemExit(f"the native decode step is unavailable: {decode_cpu.load_error()}")
    torch.set_num_threads(args.threads)
    op, take = clocked_op(args.source)
    flush = timing.bandwidth_probe("cpu")[0] if args.cold else None  # its buffer: 256 MiB+
    bandwidth, rate = read_bandwidth(), matmul_rate()
    console = Console(width=150)
    table = Table(
        title=f"{LAYERS}-layer step, {args.cache_dtype} cache, {args.threads} threads, "
        f"{args.steps} steps per row{', each from memory' if args.cold else ''}; "
        f"limits {bandwidth / 1e9:.1f} GB/s (torch.sum), {rate / 1e9:.0f} GFLOP/s (torch.mm)"
    )
    for column in ("kv", "batch", "context", "step ms", "part", "ms", "share", "spread"):
        table.add_column(column, justify="right")
    table.add_column("GB/s", justify="right")
    table.add_column("GFLOP/s", justify="right")
    for kv, batch, context in args.rows:
        (step,) = stack_step(kv, batch, context, cache_dtype, [op])
        step()
        take()
        step_s = timed_steps(step, args.steps, flush)
        figures = take().tolist()
        loads = region_loads(kv, batch, context, cache_dtype)
        first = True
        for k, name in enumerate(REGIONS):
            _, wall, spread = figures[3 * k : 3 * k + 3]
            seconds = wall / args.steps
            read, flops = loads[k]
            table.add_row(
                *(
                    (str(kv), str(batch), str(context), f"{step_s * 1e3:.2f}")
                    if first
                    else ("",) * 4
                ),
                name,
                f"{seconds * 1e3:.2f}",
                f"{seconds / step_s:.0%}",
                f"{spread / wall:.1%}",
                f"{read / seconds / 1e9:.1f}",
                f"{flops / seconds / 1e9:.0f}",
            )
            first = False
        for k, name in enumerate(GAPS):
            seconds = figures[9 + k] / args.steps
            table.add_row(
                "", "", "", "", f"serial, {name}", f"{seconds * 1e3:.2f}", f"{seconds / step_s:.0%}"
            )
        del step
    console.print(table)


if __name__ == "__main__":
    main()
