"""How fast memory is read in the patterns the native decode step reads its weights and its
cache in (issue 39): the evidence behind csrc/decode_step.cpp's `project`, which reads four
weight rows side by side, each a quarter of the thread's rows from the next, and behind
what its keys' reads can gain.

A float32 buffer of 1 GiB (rows of 768 floats, GPT-2 small's width) is summed in each
pattern, best of 4, beside `torch.sum` over the same buffer, on one thread or, with
`--threads N`, on N threads each reading its own 1/N of the buffer in that pattern (as the
step's threads read their shares of the weights and of the cache):

- one stream: the rows one after another (what the CPU's own prefetcher follows best);
- adjacent rows: four neighbouring rows side by side, a line of each in turn, the block of
  four two blocks on prefetched into L2 (the projection before 2026-11-27);
- quarters: four rows side by side, each from its own quarter of a span of rows (448, as a
  thread's share of a 896-row projection on two threads), each row's line 1 KiB on
  prefetched into L2 (the projection since);
- key blocks: as the step reads a head's keys, blocks of 64 feature rows of 256 tokens, a
  strip of tokens of every row in turn, the next block prefetched into L2 over the block's
  reads (strips of 64 floats, as grouped-query's scores read them; of 256, each row whole),
  and the same without the prefetch; and blocks of 64 tokens, whose strips of 64 are whole
  rows, so that a block is read front to back;
- key rows: blocks of 64 rows of 256 tokens read whole, front to back, with 1, 2 or 4 rows
  side by side (a line of each in turn), each line 1 KiB on prefetched or none.

Usage: python scripts/read_patterns.py [--rounds N] [--threads N]
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
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <chrono>
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define PREFETCH(p) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1)
#else
#define PREFETCH(p)
#endif
using Vec = at::vec::Vectorized<float>;

// Four running sums, added to by each pattern; their total keeps the reads from being
// optimised away.
struct Sums {
  Vec a0{0.0f}, a1{0.0f}, a2{0.0f}, a3{0.0f};

  void add4(const float* x) {  // four vectors from x
    a0 = a0 + Vec::loadu(x);
    a1 = a1 + Vec::loadu(x + Vec::size());
    a2 = a2 + Vec::loadu(x + 2 * Vec::size());
    a3 = a3 + Vec::loadu(x + 3 * Vec::size());
  }

  float total() const {
    float lanes[Vec::size()];
    ((a0 + a1) + (a2 + a3)).store(lanes);
    return lanes[0];
  }
};

// n floats from p as one stream, four vectors a step.
float one_stream(const float* p, int64_t n) {
  Sums s;
  for (int64_t i = 0; i + 4 * Vec::size() <= n; i += 4 * Vec::size()) s.add4(p + i);
  return s.total();
}

// Spans of `span` rows of `row` floats: four rows side by side, row k of a group at
// first + k * stride (stride 1: adjacent rows; span / 4: quarters); each line of row k
// prefetched `ahead` floats on (0: none) or, with `block_ahead`, the same line of the group
// `block_ahead` groups on.
float four_rows(const float* p, int64_t n, int64_t row, int64_t span, bool quarters,
                int64_t ahead, int64_t block_ahead) {
  Sums s;
  const int64_t rows = n / row, stride = quarters ? span / 4 : 1, groups = span / 4;
  for (int64_t base = 0; base + span <= rows; base += span) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* w = p + (base + (quarters ? g : 4 * g)) * row;
      const float* next = block_ahead ? w + block_ahead * 4 * row : nullptr;
      for (int64_t i = 0; i + Vec::size() <= row; i += Vec::size()) {
        if (i % 16 == 0) {
          for (int64_t k = 0; k < 4; ++k) {
            if (ahead) PREFETCH(w + k * stride * row + i + ahead);
            if (next && next + 4 * row <= p + n) PREFETCH(next + k * row + i);
          }
        }
        s.a0 = s.a0 + Vec::loadu(w + i);
        s.a1 = s.a1 + Vec::loadu(w + stride * row + i);
        s.a2 = s.a2 + Vec::loadu(w + 2 * stride * row + i);
        s.a3 = s.a3 + Vec::loadu(w + 3 * stride * row + i);
      }
    }
  }
  return s.total();
}

// Blocks of `rows` feature rows of `tokens` floats, as the decode step reads a head's keys:
// a strip of `strip` floats of every row in turn, then the next strip; with `prefetch`, the
// next block prefetched front to back over the block's reads, as evenly as its strips' rows
// allow.
float key_blocks(const float* p, int64_t n, int64_t rows, int64_t tokens, int64_t strip,
                 bool prefetch) {
  Sums s;
  const int64_t block = rows * tokens, blocks = n / block;
  const int64_t ticks = rows * (tokens / strip), lines = block / 16;
  const int64_t per_tick = (lines + ticks - 1) / ticks;
  for (int64_t b = 0; b < blocks; ++b) {
    const float* k = p + b * block;
    const float* next = prefetch && b + 1 < blocks ? k + block : nullptr;
    int64_t done = 0;
    for (int64_t from = 0; from < tokens; from += strip) {
      for (int64_t d = 0; d < rows; ++d) {
        for (int64_t l = 0; next && l < per_tick && done < lines; ++l, ++done) {
          PREFETCH(next + done * 16);
        }
        const float* r = k + d * tokens + from;
        for (int64_t i = 0; i < strip; i += 4 * Vec::size()) s.add4(r + i);
      }
    }
  }
  return s.total();
}

// Blocks of `rows` feature rows of `tokens` floats read whole, front to back, `together`
// rows side by side (four vectors of each in turn, across the block's width, then the next
// rows); each row's line `ahead` floats on prefetched (0: none).
float key_rows(const float* p, int64_t n, int64_t rows, int64_t tokens, int64_t together,
               int64_t ahead) {
  Sums s;
  const int64_t block = rows * tokens, blocks = n / block;
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t d = 0; d < rows; d += together) {
      const float* r = p + b * block + d * tokens;
      for (int64_t i = 0; i < tokens; i += 4 * Vec::size()) {
        for (int64_t j = 0; j < together; ++j) {
          if (ahead) PREFETCH(r + j * tokens + i + ahead);
          s.add4(r + j * tokens + i);
        }
      }
    }
  }
  return s.total();
}

// Seconds for `threads` threads to read the buffer in `pattern`, each its own 1/threads of
// it (whole units of `unit` floats): 0 one stream; 1 four rows (a = row, b = span,
// c = quarters, d = ahead, e = block_ahead); 2 key blocks (a = rows, b = tokens, c = strip,
// d = prefetch); 3 key rows (a = rows, b = tokens, c = together, d = ahead).
double seconds(const torch::Tensor& t, int64_t pattern, int64_t unit, int64_t threads,
               int64_t a, int64_t b, int64_t c, int64_t d, int64_t e) {
  TORCH_CHECK(t.is_contiguous() && t.scalar_type() == at::kFloat, "a contiguous float32 buffer");
  TORCH_CHECK(pattern >= 0 && pattern <= 3, "pattern is 0 to 3, not ", pattern);
  TORCH_CHECK(unit > 0 && threads > 0 && t.numel() / unit >= threads,
              "a unit per thread at least");
  TORCH_CHECK(pattern != 2 || (c % (4 * Vec::size()) == 0 && b % c == 0), "strips of 4 vectors");
  TORCH_CHECK(pattern != 3 || (a % c == 0 && b % (4 * Vec::size()) == 0), "whole row groups");
  const float* p = t.data_ptr<float>();
  const int64_t share = t.numel() / unit / threads * unit;  // floats per thread
  std::vector<float> totals(threads);
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* q = p + i * share;
      switch (pattern) {
        case 0: totals[i] = one_stream(q, share); break;
        case 1: totals[i] = four_rows(q, share, a, b, c != 0, d, e); break;
        case 2: totals[i] = key_blocks(q, share, a, b, c, d != 0); break;
        default: totals[i] = key_rows(q, share, a, b, c, d); break;
      }
    }
  });
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  volatile float sink = totals[0];
  (void)sink;
  return elapsed;
}
"""


def patterns() -> dict[str, tuple[int, int, tuple[int, ...]]]:
    """Each pattern's (id, unit of a thread's share in floats, arguments) for `seconds`."""
    span = ROW * SPAN  # a thread's share is whole spans of rows
    named = {  # four rows: (row, span, quarters, ahead, block_ahead)
        "one stream": (0, 64, ()),
        "adjacent rows, two blocks on prefetched": (1, span, (ROW, SPAN, 0, 0, 2)),
        "adjacent rows, no prefetch": (1, span, (ROW, SPAN, 0, 0, 0)),
        "quarters, 1 KiB on prefetched": (1, span, (ROW, SPAN, 1, 256, 0)),
        "quarters, no prefetch": (1, span, (ROW, SPAN, 1, 0, 0)),
    }
    for tokens, strips in ((256, (64, 256)), (64, (64,))):
        for strip in strips:
            for prefetch in (1, 0):
                how = "next block prefetched" if prefetch else "no prefetch"
                name = f"key blocks of {tokens} tokens, strips of {strip}, {how}"
                named[name] = (2, 64 * tokens, (64, tokens, strip, prefetch))
    for together in (1, 2, 4):
        for ahead in (0, 256):
            how = "1 KiB on prefetched" if ahead else "no prefetch"
            name = f"key rows, {together} side by side, {how}"
            named[name] = (3, 64 * 256, (64, 256, together, ahead))
    return named


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\\n\\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="each pattern's best of")
    parser.add_argument("--threads", type=int, default=1, help="threads, each reading 1/N")
    args = parser.parse_args()
    module = cpp_extension.load_inline(
        "attnlab_read_patterns",
        SOURCE,
        functions=["seconds"],
        extra_cflags=_build.cflags(wide=True),
    )
    torch.set_num_threads(args.threads)
    buffer = torch.ones(2**28)  # 1 GiB: (rows, ROW) and a few floats

    def best(read) -> float:
        return buffer.nbytes / min(read() for _ in range(args.rounds)) / 1e9

    def timed_sum() -> float:
        start = time.perf_counter()
        buffer.sum()
        return time.perf_counter() - start

    print(f"{args.threads} thread(s), {buffer.nbytes >> 20} MiB, best of {args.rounds}")
    print(f"{'torch.sum':<62} {best(timed_sum):6.1f} GB/s", flush=True)
    for name, (pattern, unit, arguments) in patterns().items():
        padded = (*arguments, *(0,) * (5 - len(arguments)))

        def read(pattern=pattern, unit=unit, padded=padded) -> float:
            return module.seconds(buffer, pattern, unit, args.threads, *padded)

        print(f"{name:<62} {best(read):6.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
