"""How fast one thread reads memory in the patterns a projection can read weight rows in
(issue 39): the evidence behind csrc/decode_step.cpp's `project`, which reads four weight
rows side by side, each a quarter of the thread's rows from the next.

A float32 buffer of 1 GiB (rows of 768 floats, GPT-2 small's width) is summed on one thread
in each pattern, best of 4, beside `torch.sum` over the same buffer:

- one stream: the rows one after another (what the CPU's own prefetcher follows best);
- adjacent rows: four neighbouring rows side by side, a line of each in turn, the block of
  four two blocks on prefetched into L2 (the projection before 2026-11-27);
- quarters: four rows side by side, each from its own quarter of a span of rows (448, as a
  thread's share of a 896-row projection on two threads), each row's line 1 KiB on
  prefetched into L2 (the projection since);
- key blocks: as the step reads a head's keys, blocks of 64 feature rows of 256 tokens, a
  strip of tokens of every row in turn, the next block prefetched into L2 over the block's
  reads (strips of 64 floats, as grouped-query's scores read them; of 256, each row whole),
  and the same without the prefetch.

Usage: python scripts/read_patterns.py [--rounds N]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils import cpp_extension

from attnlab import _build

ROW = 768  # floats per row
SPAN = 448  # rows a thread reads in quarters

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/cpu/vec/vec.h>
#include <chrono>
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define PREFETCH(p) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1)
#else
#define PREFETCH(p)
#endif
using Vec = at::vec::Vectorized<float>;

// Seconds to sum the buffer: four rows side by side, row k of a group at first + k * stride,
// groups `step` rows apart; each line of row k prefetched `ahead` floats on (0: none) or,
// with `block_ahead`, the same line of the group `block_ahead` groups on.
double four_rows(const torch::Tensor& t, int64_t row, int64_t span, bool quarters,
                 int64_t ahead, int64_t block_ahead) {
  TORCH_CHECK(t.is_contiguous() && t.scalar_type() == at::kFloat, "a contiguous float32 buffer");
  const float* p = t.data_ptr<float>();
  const int64_t rows = t.numel() / row;
  const auto start = std::chrono::steady_clock::now();
  Vec a0(0.0f), a1(0.0f), a2(0.0f), a3(0.0f);
  for (int64_t base = 0; base + span <= rows; base += span) {
    const int64_t stride = quarters ? span / 4 : 1;  // rows between the four
    const int64_t groups = span / 4;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t first = base + (quarters ? g : 4 * g);
      const float* w = p + first * row;
      const float* next = block_ahead ? w + block_ahead * 4 * row : nullptr;
      for (int64_t i = 0; i + Vec::size() <= row; i += Vec::size()) {
        if (i % 16 == 0) {
          for (int64_t k = 0; k < 4; ++k) {
            if (ahead) PREFETCH(w + k * stride * row + i + ahead);
            if (next && next + 4 * row <= p + t.numel()) PREFETCH(next + k * row + i);
          }
        }
        a0 = a0 + Vec::loadu(w + i);
        a1 = a1 + Vec::loadu(w + stride * row + i);
        a2 = a2 + Vec::loadu(w + 2 * stride * row + i);
        a3 = a3 + Vec::loadu(w + 3 * stride * row + i);
      }
    }
  }
  float lanes[Vec::size()];
  ((a0 + a1) + (a2 + a3)).store(lanes);
  volatile float sink = lanes[0];
  (void)sink;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Seconds to sum the buffer read as the decode step reads a key/value head's keys: blocks of
// `rows` feature rows of `tokens` floats, a strip of `strip` floats of every row in turn, then
// the next strip; the next block prefetched front to back over the block's reads, as evenly
// as its strips' rows allow.
double key_blocks(const torch::Tensor& t, int64_t rows, int64_t tokens, int64_t strip,
                  bool prefetch) {
  TORCH_CHECK(t.is_contiguous() && t.scalar_type() == at::kFloat, "a contiguous float32 buffer");
  TORCH_CHECK(strip % (4 * Vec::size()) == 0 && tokens % strip == 0, "strips of 4 vectors");
  const float* p = t.data_ptr<float>();
  const int64_t block = rows * tokens, blocks = t.numel() / block;
  const int64_t ticks = rows * (tokens / strip), lines = block / 16;
  const int64_t per_tick = (lines + ticks - 1) / ticks;
  const auto start = std::chrono::steady_clock::now();
  Vec a0(0.0f), a1(0.0f), a2(0.0f), a3(0.0f);
  for (int64_t b = 0; b < blocks; ++b) {
    const float* k = p + b * block;
    const float* next = prefetch && b + 1 < blocks ? k + block : nullptr;
    int64_t done = 0;
    for (int64_t s = 0; s < tokens; s += strip) {
      for (int64_t d = 0; d < rows; ++d) {
        for (int64_t l = 0; next && l < per_tick && done < lines; ++l, ++done) {
          PREFETCH(next + done * 16);
        }
        const float* r = k + d * tokens + s;
        for (int64_t i = 0; i < strip; i += 4 * Vec::size()) {
          a0 = a0 + Vec::loadu(r + i);
          a1 = a1 + Vec::loadu(r + i + Vec::size());
          a2 = a2 + Vec::loadu(r + i + 2 * Vec::size());
          a3 = a3 + Vec::loadu(r + i + 3 * Vec::size());
        }
      }
    }
  }
  float lanes[Vec::size()];
  ((a0 + a1) + (a2 + a3)).store(lanes);
  volatile float sink = lanes[0];
  (void)sink;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Seconds to sum the buffer as one stream, four vectors a step.
double one_stream(const torch::Tensor& t) {
  TORCH_CHECK(t.is_contiguous() && t.scalar_type() == at::kFloat, "a contiguous float32 buffer");
  const float* p = t.data_ptr<float>();
  const int64_t n = t.numel(), w = Vec::size();
  const auto start = std::chrono::steady_clock::now();
  Vec a0(0.0f), a1(0.0f), a2(0.0f), a3(0.0f);
  for (int64_t i = 0; i + 4 * w <= n; i += 4 * w) {
    a0 = a0 + Vec::loadu(p + i);
    a1 = a1 + Vec::loadu(p + i + w);
    a2 = a2 + Vec::loadu(p + i + 2 * w);
    a3 = a3 + Vec::loadu(p + i + 3 * w);
  }
  float lanes[Vec::size()];
  ((a0 + a1) + (a2 + a3)).store(lanes);
  volatile float sink = lanes[0];
  (void)sink;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="each pattern's best of")
    args = parser.parse_args()
    module = cpp_extension.load_inline(
        "attnlab_read_patterns",
        SOURCE,
        functions=["four_rows", "one_stream", "key_blocks"],
        extra_cflags=_build.cflags(wide=True),
    )
    torch.set_num_threads(1)
    buffer = torch.ones(2**28)  # 1 GiB: (rows, ROW) and a few floats

    def best(read) -> float:
        return buffer.nbytes / min(read() for _ in range(args.rounds)) / 1e9

    def timed_sum() -> float:
        start = time.perf_counter()
        buffer.sum()
        return time.perf_counter() - start

    patterns = {
        "torch.sum": timed_sum,
        "one stream": lambda: module.one_stream(buffer),
        "adjacent rows, two blocks on prefetched": lambda: module.four_rows(
            buffer, ROW, SPAN, False, 0, 2
        ),
        "adjacent rows, no prefetch": lambda: module.four_rows(buffer, ROW, SPAN, False, 0, 0),
        "quarters, 1 KiB on prefetched": lambda: module.four_rows(buffer, ROW, SPAN, True, 256, 0),
        "quarters, no prefetch": lambda: module.four_rows(buffer, ROW, SPAN, True, 0, 0),
        "key blocks (64 x 256), strips of 64 floats": lambda: module.key_blocks(
            buffer, 64, 256, 64, True
        ),
        "key blocks (64 x 256), strips of 256 floats": lambda: module.key_blocks(
            buffer, 64, 256, 256, True
        ),
        "key blocks, strips of 64 floats, no prefetch": lambda: module.key_blocks(
            buffer, 64, 256, 64, False
        ),
        "key blocks, strips of 256 floats, no prefetch": lambda: module.key_blocks(
            buffer, 64, 256, 256, False
        ),
    }
    print(f"one thread, {buffer.nbytes >> 20} MiB, rows of {ROW} floats, best of {args.rounds}")
    for name, read in patterns.items():
        print(f"{name:<42} {best(read):6.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
