// One decoding step of attnlab's MultiHeadAttention on the CPU: the fused query/key/value
// projection of one token per sequence, rotary positions, the append of its key and value to
// the cache (float32, bfloat16, or int8 with a float32 scale per token and head), attention
// over the keys held, and the output projection, in one call.
//
// Producing a token reads every weight and the whole cache once, so the step is bound by
// memory reads: each weight row is streamed once for every sequence of the batch (the rows of
// x stay in L1), and each key/value head's cache is streamed once for all the query heads
// that share it. The keys are split into chunks, one work item per (sequence, key/value head,
// chunk), so that both cores stream even a single head's cache; the chunks' partial softmax
// sums are merged afterwards (split-K, as flash decoding does).
//
// Layouts (the Python side makes its inputs conform): x (b, 1, d_in) or (b, d_in); w_qkv
// (d_out + 2 kv_dim, d_in) with rows in query, key, value order; w_out (width, d_out);
// biases (out,) or empty; cos/sin (positions, hd) or empty; keys_t (b, hkv, hd * capacity):
// each head's tokens in blocks of `block` tokens, a block (hd, its tokens) row-major
// (Segment), so that a block's keys are one contiguous read and a query's scores a sum of
// rows; values_t (b, hkv, capacity * hd): each head's tokens as rows (capacity, hd), so that
// the output is a sum of rows too; key_scales/value_scales (b, hkv, capacity) float32 for
// int8 buffers, else empty. All float32 except
// the buffers, all contiguous. The new token goes to slot `slot` at position `position`;
// attention reads slots [first, first + count). The op checks every argument itself (the
// contract above decode_step): anything else is a RuntimeError, never a crash.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>  // the direct binding (PYBIND11_MODULE) below
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

// What scripts/decode_kernel_rates.cpp reads to call this version's kernels: the values are
// stored as rows (capacity, hd); grouped_scores takes a ScoreBounds; the prefetches tick
// once per tick_every<G>() rows (ticks_over<G>); Attend::each_block gives the blocks of
// query heads of either kind of product (ATTNLAB_BF16_PRODUCTS, below, where the build has
// the bfloat16 ones)
#define ATTNLAB_VALUE_ROWS 1
#define ATTNLAB_SCORE_BOUNDS 1
#define ATTNLAB_TICK_EVERY 1
#define ATTNLAB_EACH_BLOCK 1

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#define ATTNLAB_X86 1  // x86 intrinsics: prefetches and widening loads
#endif

// Loops over a tile's query heads and vectors, asked to be unrolled whole: the tile's sums
// are arrays indexed by the loops' counters, which stay in registers only once unrolled
// (not left to the compiler's heuristics for nested loops of up to 12 x 4).
#if defined(__clang__)
#define ATTNLAB_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define ATTNLAB_UNROLL _Pragma("GCC unroll 16")
#else
#define ATTNLAB_UNROLL
#endif

namespace {

// Vec: 8 floats in an AVX2 build, 16 in an AVX-512 one (attnlab._build picks by CPU).
using Vec = at::vec::Vectorized<float>;
// keys per attention work item, at least: each item pays a fixed cost (its partial sums and
// their merge, the prefetch of its first block before anything else hides it)
constexpr int64_t kMinChunk = 512;
constexpr int64_t kPrefetch = 1024;  // floats ahead of dot's read (4 KiB), prefetched into L2
constexpr int64_t kRows = 4;  // weight rows read side by side
constexpr int64_t kStreamAhead = 256;  // floats ahead of a weight row's read, prefetched (1 KiB)
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kRegisters = 32;  // vector registers
#else
constexpr int kRegisters = 16;
#endif
// floats a thread must have to read before a parallel region pays for itself: starting one
// (waking the other threads, joining them) costs microseconds, and a tiny layer's whole
// step is a few of them; below this, work items run on the calling thread, and the other
// threads stay asleep (they are not woken to spin at all)
constexpr int64_t kMinParallelFloats = 32768;

// the grain of a parallel_for whose items read `floats_per_item` floats each
int64_t grain_for(int64_t floats_per_item) {
  return std::max<int64_t>(1, kMinParallelFloats / std::max<int64_t>(1, floats_per_item));
}
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

float dot(const float* a, const float* b, int64_t n) {
  const int64_t w = Vec::size();
  Vec s0(0.0f), s1(0.0f), s2(0.0f), s3(0.0f);
  int64_t i = 0;
  for (; i + 4 * w <= n; i += 4 * w) {
#if defined(ATTNLAB_X86)
    for (int64_t line = 0; line < 4 * w; line += 16) {
      _mm_prefetch(reinterpret_cast<const char*>(b + i + kPrefetch + line), _MM_HINT_T1);
    }
#endif
    s0 = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), s0);
    s1 = at::vec::fmadd(Vec::loadu(a + i + w), Vec::loadu(b + i + w), s1);
    s2 = at::vec::fmadd(Vec::loadu(a + i + 2 * w), Vec::loadu(b + i + 2 * w), s2);
    s3 = at::vec::fmadd(Vec::loadu(a + i + 3 * w), Vec::loadu(b + i + 3 * w), s3);
  }
  for (; i + w <= n; i += w) s0 = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), s0);
  float lanes[Vec::size()];
  ((s0 + s1) + (s2 + s3)).store(lanes);
  float total = 0.0f;
  for (int64_t l = 0; l < w; ++l) total += lanes[l];
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

// Whether x[0..n) holds no NaN or infinity (x - x is 0 exactly for finite values).
bool all_finite(const float* x, int64_t n) {
  Vec acc(0.0f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec v = Vec::loadu(x + i);
    acc = acc + (v - v);
  }
  float total = 0.0f;
  for (; i < n; ++i) total += x[i] - x[i];
  float lanes[Vec::size()];
  acc.store(lanes);
  for (int64_t l = 0; l < Vec::size(); ++l) total += lanes[l];
  return total == 0.0f;
}

// Horizontal sum of a vector's lanes.
inline float lane_sum(const Vec& v) {
  float lanes[Vec::size()];
  v.store(lanes);
  float total = 0.0f;
  for (int64_t l = 0; l < Vec::size(); ++l) total += lanes[l];
  return total;
}

// out[0..4) = the lane sums of a0..a3, in a few shuffles (the lanes of one vector added one by
// one are a chain of 8 or 16 dependent additions, which at batch 8 cost more than the
// multiply-adds they reduce).
inline void sum4(const Vec& a0, const Vec& a1, const Vec& a2, const Vec& a3, float* out) {
#if defined(ATTNLAB_X86)
#if defined(CPU_CAPABILITY_AVX512)
  auto half = [](const Vec& v) {  // (16,) -> (8,): the two halves added
    const __m512 x = v;
    return _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
  };
  const __m256 v0 = half(a0), v1 = half(a1), v2 = half(a2), v3 = half(a3);
#else
  const __m256 v0 = a0, v1 = a1, v2 = a2, v3 = a3;
#endif
  // [v0 v1 v2 v3] pairwise: lanes 0..3 hold the low halves' sums, 4..7 the high halves'
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(v0, v1), _mm256_hadd_ps(v2, v3));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
#else
  out[0] = lane_sum(a0), out[1] = lane_sum(a1), out[2] = lane_sum(a2), out[3] = lane_sum(a3);
#endif
}

// sums[r * kRows + k] = x[r] . w[k * stride] for R rows of x (`in` apart) and kRows weight
// rows (`stride` apart) read side by side, 4 R sums in registers: R = 4 keeps 16 independent
// multiply-add chains in flight (two FMA units of latency 4 need 8) with a load per two
// multiply-adds. Each iteration prefetches each weight row's line `ahead` floats on into L2
// (past a row's end: the next row of the same stream).
template <int R>
void dot_rows(const float* x, const float* w, int64_t in, int64_t stride, float* sums,
              int64_t ahead) {
  const int64_t n = Vec::size();
  Vec a[R][kRows];
  ATTNLAB_UNROLL
  for (int r = 0; r < R; ++r) {
    ATTNLAB_UNROLL
    for (int k = 0; k < kRows; ++k) a[r][k] = Vec(0.0f);
  }
  int64_t i = 0;
  for (; i + n <= in; i += n) {
#if defined(ATTNLAB_X86)
    if (i % 16 == 0) {
      ATTNLAB_UNROLL
      for (int k = 0; k < kRows; ++k) {
        _mm_prefetch(reinterpret_cast<const char*>(w + k * stride + i + ahead), _MM_HINT_T1);
      }
    }
#endif
    Vec v[kRows];
    ATTNLAB_UNROLL
    for (int k = 0; k < kRows; ++k) v[k] = Vec::loadu(w + k * stride + i);
    ATTNLAB_UNROLL
    for (int r = 0; r < R; ++r) {
      const Vec xr = Vec::loadu(x + r * in + i);
      ATTNLAB_UNROLL
      for (int k = 0; k < kRows; ++k) a[r][k] = at::vec::fmadd(xr, v[k], a[r][k]);
    }
  }
  ATTNLAB_UNROLL
  for (int r = 0; r < R; ++r) sum4(a[r][0], a[r][1], a[r][2], a[r][3], sums + r * kRows);
  for (; i < in; ++i) {
    for (int r = 0; r < R; ++r) {
      for (int64_t k = 0; k < kRows; ++k) {
        sums[r * kRows + k] += x[r * in + i] * w[k * stride + i];
      }
    }
  }
}

// Rows of x per pass over a block of weight rows: their 4 R sums, the block's kRows vectors
// and one of x in registers.
constexpr int kXRows = 4 * 4 + kRows + 1 <= kRegisters ? 4 : 2;

// Rows of x the next pass takes, of `left`: kXRows, else 2, else 1.
inline int64_t pass_rows(int64_t left) { return left >= kXRows ? kXRows : (left >= 2 ? 2 : 1); }

// y (rows, out) = x (rows, in) @ w (out, in)^T + bias: each weight row read once from memory,
// four rows side by side that stay in L1 while every row of x (in L1 too) meets them. The
// four are a quarter of the thread's rows apart, so that each is a long sequential read
// through its quarter (rows j, j + 1, ... are contiguous), which the CPU's own prefetcher
// follows, helped by a prefetch `ahead`. Four adjacent rows instead, as before 2026-11-27,
// are streams of 3 KiB that it keeps losing: one thread on a 2-core Zen 4 reads 1 GiB that
// way at 20.5 GB/s, in quarters at 29.2, torch.sum 26.6 (scripts/read_patterns.py); a
// 12-layer step took 0.73-0.97 of the time before (scripts/decode_gqa.py --baseline).
void project(const float* x, int64_t rows, int64_t in, const float* w, const float* bias,
             int64_t out, float* y) {
  const int64_t grain = std::max<int64_t>(8 * kRows, grain_for(in));
  at::parallel_for(0, out, grain, [&](int64_t begin, int64_t end) {
    const int64_t quarter = (end - begin) / kRows;  // rows per stream
    // floats ahead of the reads, prefetched by every pass: further where several passes
    // take longer over each row (one pass: 1 KiB; two: 4 KiB, 0.81 of 1 KiB's time)
    const int64_t ahead = rows <= kXRows ? kStreamAhead : 4 * kStreamAhead;
    float sums[kXRows * kRows];
    for (int64_t j = begin; j < begin + quarter; ++j) {  // rows j + k quarter, k < kRows
      const float* block = w + j * in;
      for (int64_t r = 0; r < rows;) {
        const int64_t taken = pass_rows(rows - r);
        // (a prefetch past the weights' end is dropped, never read)
        auto pass_with = [&](auto R) {
          dot_rows<decltype(R)::value>(x + r * in, block, in, quarter * in, sums, ahead);
        };
        if (taken == kXRows) {
          pass_with(std::integral_constant<int, kXRows>{});
        } else if (taken == 2) {
          pass_with(std::integral_constant<int, 2>{});
        } else {
          pass_with(std::integral_constant<int, 1>{});
        }
        for (int64_t q = 0; q < taken; ++q) {
          for (int64_t k = 0; k < kRows; ++k) {
            const int64_t row = j + k * quarter;
            y[(r + q) * out + row] = sums[q * kRows + k] + (bias ? bias[row] : 0.0f);
          }
        }
        r += taken;
      }
    }
    for (int64_t j = begin + kRows * quarter; j < end; ++j) {  // the last, fewer than kRows
      const float b = bias ? bias[j] : 0.0f;
      for (int64_t r = 0; r < rows; ++r) y[r * out + j] = dot(x + r * in, w + j * in, in) + b;
    }
  });
}

// x <- x * cos + rotate_half(x) * sin, one head of hd features.
void rotate(float* x, const float* cos, const float* sin, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] + (-b) * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// A norm's eps as rms_norm takes it: in float32, and one below float32's smallest normal
// value counts as that value, as in RMSNorm.
inline float norm_epsilon(double eps) {
  return std::max(static_cast<float>(eps), std::numeric_limits<float>::min());
}

// x <- RMSNorm(x) over n features as attnlab.norms.RMSNorm computes it: x / s over
// sqrt(mean((x / s)^2) + eps / s^2), s = max(1, max |x|) (no square overflows), times
// (offset + w).
void rms_norm(float* x, int64_t n, const float* w, float eps, float offset) {
  float s = 1.0f;
  for (int64_t i = 0; i < n; ++i) s = std::max(s, std::abs(x[i]));
  float squares = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    x[i] /= s;
    squares += x[i] * x[i];
  }
  const float r = 1.0f / std::sqrt(squares / static_cast<float>(n) + eps / (s * s));
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] * r * (offset + w[i]);
}

// Where token t of a head's cache lives: its buffer holds `cap` tokens in blocks of `block`
// tokens, each block (hd, length) row-major with length = min(block, cap - its first token),
// so that the keys of a block of tokens are one contiguous stretch of memory. `offset` is
// the element of row 0 at t, `stride` the distance from one row to the next there, `m` how
// many tokens from t on (at most `until` - t) are in that block.
struct Segment {
  int64_t offset, stride, m;
};

inline Segment segment(int64_t t, int64_t until, int64_t hd, int64_t cap, int64_t block) {
  const int64_t start = t / block * block;
  const int64_t length = std::min(block, cap - start);
  return {start * hd + (t - start), length, std::min(until, start + length) - t};
}

// Stores one head's vector (hd,) in slot `slot` of its buffer (`cap` tokens in blocks of
// `block`, see Segment).
inline int64_t slot_offset(int64_t slot, int64_t hd, int64_t cap, int64_t block, int64_t& stride) {
  const Segment s = segment(slot, slot + 1, hd, cap, block);
  stride = s.stride;
  return s.offset;
}

void store(const float* src, float* dst, float*, int64_t hd, int64_t cap, int64_t block,
           int64_t slot) {
  int64_t stride;
  dst += slot_offset(slot, hd, cap, block, stride);
  for (int64_t d = 0; d < hd; ++d) dst[d * stride] = src[d];
}

void store(const float* src, c10::BFloat16* dst, float*, int64_t hd, int64_t cap, int64_t block,
           int64_t slot) {
  int64_t stride;
  dst += slot_offset(slot, hd, cap, block, stride);
  for (int64_t d = 0; d < hd; ++d) dst[d * stride] = c10::BFloat16(src[d]);
}

// Symmetric int8: scale = max |x| / 127, q = round(x / scale) (round half to even).
void store(const float* src, int8_t* dst, float* scale, int64_t hd, int64_t cap, int64_t block,
           int64_t slot) {
  float amax = 0.0f;
  for (int64_t d = 0; d < hd; ++d) amax = std::max(amax, std::fabs(src[d]));
  const float s = amax / 127.0f;
  const float divisor = s > 0.0f ? s : 1.0f;
  int64_t stride;
  dst += slot_offset(slot, hd, cap, block, stride);
  for (int64_t d = 0; d < hd; ++d) {
    const float q = std::nearbyint(src[d] / divisor);
    dst[d * stride] = static_cast<int8_t>(std::clamp(q, -127.0f, 127.0f));
  }
  scale[slot] = s;
}

// A vector of cache values as float32: loaded and widened in registers (AVX2, AVX-512), or
// one by one.
inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }
inline float widen(int8_t x) { return static_cast<float>(x); }

#if defined(CPU_CAPABILITY_AVX512)
inline Vec load(const float* p) { return Vec::loadu(p); }
inline Vec load(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)));
}
inline Vec load(const int8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
}
#elif defined(CPU_CAPABILITY_AVX2)
inline Vec load(const float* p) { return Vec::loadu(p); }
inline Vec load(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16)));
}
inline Vec load(const int8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
}
#else
template <typename T>
inline Vec load(const T* p) {
  float lanes[Vec::size()];
  for (int64_t l = 0; l < Vec::size(); ++l) lanes[l] = widen(p[l]);
  return Vec::loadu(lanes);
}
#endif

// The first `count` (< Vec::size()) values at p widened, the other lanes 0: the last keys
// or values of a segment, fewer than a vector (AVX-512 reads float32 with a mask).
inline Vec load_part(const float* p, int64_t count) { return Vec::loadu(p, count); }
template <typename T>
inline Vec load_part(const T* p, int64_t count) {
  float lanes[Vec::size()] = {};
  for (int64_t l = 0; l < count; ++l) lanes[l] = widen(p[l]);
  return Vec::loadu(lanes);
}

// row <- exp(row - max); returns the sum (ATen's vectorised exp).
float exp_sum(float* row, int64_t n, float row_max) {
  const Vec vmax(row_max);
  Vec acc(0.0f);
  int64_t t = 0;
  for (; t + Vec::size() <= n; t += Vec::size()) {
    const Vec e = (Vec::loadu(row + t) - vmax).exp_u20();
    e.store(row + t);
    acc = acc + e;
  }
  float lanes[Vec::size()];
  acc.store(lanes);
  float sum = 0.0f;
  for (int64_t l = 0; l < Vec::size(); ++l) sum += lanes[l];
  for (; t < n; ++t) {
    row[t] = std::exp(row[t] - row_max);
    sum += row[t];
  }
  return sum;
}

// A stretch of memory prefetched a few lines at a time (`tick`), spread over the work done
// before it is read.
struct PrefetchStream {
  const char* begin = nullptr;
  int64_t lines = 0, done = 0, per_tick = 0;

  template <typename T>
  void start(const T* first, int64_t elements, int64_t ticks) {
    begin = reinterpret_cast<const char*>(first);
    lines = first ? (elements * static_cast<int64_t>(sizeof(T)) + 63) / 64 : 0;
    done = 0;
    per_tick = (lines + ticks - 1) / std::max<int64_t>(ticks, 1);
  }

  void tick() {
#if defined(ATTNLAB_X86)
    for (int64_t end = std::min(lines, done + per_tick); done < end; ++done) {
      _mm_prefetch(begin + done * 64, _MM_HINT_T1);
    }
#endif
  }
};

// The cache's blocks are long contiguous reads, prefetched into L2 (whose queue holds more
// misses in flight than L1's; measured 2% to 5% faster) while the block before is read: the
// next block of the same phase (start, `near`), and across the whole phase, the first block
// of the phase after it (start_far: an item's values while its keys are read, the next item's
// keys while these values are), so that a phase's last block, however short, never leaves
// the next phase's first reads unfetched.
struct Prefetcher {
  PrefetchStream near, far;

  template <typename T>
  void start(const T* first, int64_t elements, int64_t ticks) {
    near.start(first, elements, ticks);
  }

  template <typename T>
  void start_far(const T* first, int64_t elements, int64_t ticks) {
    far.start(first, elements, ticks);
  }

  void tick() {
    near.tick();
    far.tick();
  }

  void all() {  // the near stretch at once
    near.per_tick = near.lines;
    near.tick();
  }
};

// Query heads whose sums share the registers, at most: 2 G accumulators and 3 more vectors
// fit in 16 AVX2 registers for G = 6. AVX-512's 32 would hold G = 12 (a multi-query head's
// 12 query heads reading each key once), but blocks of 6 are faster there: 4 key vectors a
// step and 4 value rows (where 12 take 2 and 2), fewer query pointers than the general
// registers hold, and a segment's second read of the keys comes from L2
// (scripts/decode_gqa.py --baseline --threads 2, multi-query batch 8: 4% to 8% faster in
// float32, 7% to 13% in bfloat16, int8 within 3%).
constexpr int kGroupBlock = 6;
constexpr int64_t kMaxGroupedChunk = 512;  // keys per work item, at most, in registers

// Rows of keys or values a block of G query heads reads per tick of the prefetches: a
// tick's few scalar instructions once per row for fewer heads, once per 4 rows for a
// full block, whose 24 multiply-adds a row leave the prefetches time. Multi-query on two
// threads of a Zen 4 (scripts/decode_gqa.py --baseline): 0.97-0.99 of the time at batch 8.
// (An Intel Xeon's two threads ran multi-query attention from L2 at 65% of torch.mm, a
// Zen 4's at 100%; whether the ticks' scalar work, which shares the Xeon's vector ports,
// is why was not measured there.)
template <int G>
constexpr int64_t tick_every() {
  return G >= kGroupBlock ? 4 : 1;
}

// Ticks over `rows` rows read by a block of G query heads.
template <int G>
int64_t ticks_over(int64_t rows) {
  return (rows + tick_every<G>() - 1) / tick_every<G>();
}

// Key vectors per step of grouped_scores for G query heads: as many as fit in registers with
// their G x them sums and the broadcast query feature, up to 4 (so that a few query heads,
// as grouped-query layouts have, still keep 8 to 16 independent multiply-adds in flight:
// two FMA units of latency 4 need 8).
template <int G>
constexpr int key_vectors() {
  return std::max(1, std::min(4, (kRegisters - 1) / (G + 1)));
}

// What a block of query heads' scores are scaled by as they leave the registers, and the
// running bounds kept there: scores are stored as (q . k) x scale (x the key's scale for an
// int8 cache: key_scales[t], the segment's keys), and maxima[i] and minima[i] (a vector
// each, per query head of the block) take their lane-wise largest and least (NaN
// propagates), so that no pass over the stored scores is needed for the softmax's maximum
// or for the overflow check.
struct ScoreBounds {
  float scale;
  const float* key_scales;  // at the segment's first key, or nullptr
  Vec* maxima;
  Vec* minima;

  ScoreBounds at(int64_t t) const {
    return {scale, key_scales ? key_scales + t : nullptr, maxima, minima};
  }

  // sums (the lanes at keys t, `count` of them) scaled, and the bounds of query head i taken
  inline Vec finish(const Vec& sums, int i, int64_t t, int64_t count = Vec::size()) const {
    Vec scaled = key_scales ? sums * (Vec::loadu(key_scales + t, count) * Vec(scale))
                            : sums * Vec(scale);
    if (count == Vec::size()) {
      maxima[i] = at::vec::maximum(maxima[i], scaled);
      minima[i] = at::vec::minimum(minima[i], scaled);
    } else {  // the lanes past the keys leave the bounds as they are
      maxima[i] = at::vec::maximum(maxima[i], Vec::set(Vec(kNegInf), scaled, count));
      minima[i] = at::vec::minimum(minima[i], Vec::set(Vec(-kNegInf), scaled, count));
    }
    return scaled;
  }
};

// Grouped heads (several query heads per key/value head): the cache is read once for all of
// them, the group's scores one small matrix product whose tile of sums stays in registers.
// Scores of G query heads for the m keys at k (rows of hd features, cap apart; `ahead` ticks
// once per row read): scores[i * n + t] = q[i] . k[:, t], NV vectors of keys a step, each
// key vector loaded once for the G heads (NV loads and G broadcasts per NV G multiply-adds).
template <int G, int NV = key_vectors<G>(), typename T>
void grouped_scores(const float* q, int64_t hd, const T* k, int64_t cap, int64_t m,
                    float* scores, int64_t n, const ScoreBounds& bounds, Prefetcher& ahead) {
  constexpr int64_t w = Vec::size();
  int64_t t = 0;
  for (; t + NV * w <= m; t += NV * w) {
    Vec a[G][NV];
    ATTNLAB_UNROLL
    for (int i = 0; i < G; ++i) {
      ATTNLAB_UNROLL
      for (int j = 0; j < NV; ++j) a[i][j] = Vec(0.0f);
    }
    for (int64_t d = 0; d < hd; ++d) {
      const T* row = k + d * cap + t;
      if (d % tick_every<G>() == 0) ahead.tick();
      Vec kv[NV];
      ATTNLAB_UNROLL
      for (int j = 0; j < NV; ++j) kv[j] = load(row + j * w);
      ATTNLAB_UNROLL
      for (int i = 0; i < G; ++i) {
        const Vec qv(q[i * hd + d]);
        ATTNLAB_UNROLL
        for (int j = 0; j < NV; ++j) a[i][j] = at::vec::fmadd(qv, kv[j], a[i][j]);
      }
    }
    ATTNLAB_UNROLL
    for (int i = 0; i < G; ++i) {
      ATTNLAB_UNROLL
      for (int j = 0; j < NV; ++j) {
        bounds.finish(a[i][j], i, t + j * w).store(scores + i * n + t + j * w);
      }
    }
  }
  if constexpr (NV > 1) {  // the keys left, fewer than a step: one vector at a time
    if (t + w <= m) {
      const int64_t rest = (m - t) / w * w;
      grouped_scores<G, 1>(q, hd, k + t, cap, rest, scores + t, n, bounds.at(t), ahead);
      t += rest;
    }
  }
  if (t < m) {  // the last keys, fewer than a vector: one vector, its other lanes 0
    const int64_t rest = m - t;
    Vec a[G];
    ATTNLAB_UNROLL
    for (int i = 0; i < G; ++i) a[i] = Vec(0.0f);
    for (int64_t d = 0; d < hd; ++d) {
      const Vec kv = load_part(k + d * cap + t, rest);
      ATTNLAB_UNROLL
      for (int i = 0; i < G; ++i) a[i] = at::vec::fmadd(Vec(q[i * hd + d]), kv, a[i]);
    }
    ATTNLAB_UNROLL
    for (int i = 0; i < G; ++i) bounds.finish(a[i], i, t, rest).store(scores + i * n + t, rest);
  }
}

// Values are stored as rows (a token's hd features contiguous), so that out = p v is a sum
// of rows scaled by their weights: no sums across lanes, and a head's values are one
// contiguous read from its first token on. out[i * stride + f] += sum_t p[i][t] v[t][f] for
// G query heads (p[i] is p + i * n) over the m rows at v (hd apart) and the NV vectors of
// features from f = 0 (Part: one vector of `part` < Vec::size() features), each row's
// vectors loaded once for the G heads (NV loads and G broadcasts per NV G multiply-adds).
template <int G, int NV, bool Part = false, typename T>
void row_values(const float* p, int64_t n, const T* v, int64_t hd, int64_t m, float* out,
                int64_t stride, int64_t part, Prefetcher& ahead) {
  constexpr int64_t w = Vec::size();
  Vec a[G][NV];
  ATTNLAB_UNROLL
  for (int i = 0; i < G; ++i) {
    ATTNLAB_UNROLL
    for (int j = 0; j < NV; ++j) {
      a[i][j] = Part ? Vec::loadu(out + i * stride, part) : Vec::loadu(out + i * stride + j * w);
    }
  }
  for (int64_t t = 0; t < m; ++t) {
    const T* row = v + t * hd;
    if (t % tick_every<G>() == 0) ahead.tick();
    Vec x[NV];
    ATTNLAB_UNROLL
    for (int j = 0; j < NV; ++j) x[j] = Part ? load_part(row, part) : load(row + j * w);
    ATTNLAB_UNROLL
    for (int i = 0; i < G; ++i) {
      const Vec pv(p[i * n + t]);
      ATTNLAB_UNROLL
      for (int j = 0; j < NV; ++j) a[i][j] = at::vec::fmadd(pv, x[j], a[i][j]);
    }
  }
  ATTNLAB_UNROLL
  for (int i = 0; i < G; ++i) {
    ATTNLAB_UNROLL
    for (int j = 0; j < NV; ++j) {
      if constexpr (Part) {
        a[i][j].store(out + i * stride, part);
      } else {
        a[i][j].store(out + i * stride + j * w);
      }
    }
  }
}

// Calls of row_values a block of G query heads takes to cover hd features: NV vectors at a
// time (as many as key_vectors allows), then single vectors, then the features past the
// last whole vector.
template <int G>
int64_t row_value_calls(int64_t hd) {
  constexpr int64_t w = Vec::size();
  constexpr int NV = key_vectors<G>();
  const int64_t vectors = hd / w;
  return vectors / NV + vectors % NV + (hd % w ? 1 : 0);
}

// row_values over every feature of the rows, for one block of G query heads.
template <int G, typename T>
void all_row_values(const float* p, int64_t n, const T* v, int64_t hd, int64_t m, float* out,
                    int64_t stride, Prefetcher& ahead) {
  constexpr int64_t w = Vec::size();
  constexpr int NV = key_vectors<G>();
  int64_t f = 0;
  for (; f + NV * w <= hd; f += NV * w) {
    row_values<G, NV>(p, n, v + f, hd, m, out + f, stride, 0, ahead);
  }
  if constexpr (NV > 1) {
    for (; f + w <= hd; f += w) row_values<G, 1>(p, n, v + f, hd, m, out + f, stride, 0, ahead);
  }
  if (f < hd) row_values<G, 1, true>(p, n, v + f, hd, m, out + f, stride, hd - f, ahead);
}

// f(std::integral_constant<int, G>) for G = min(remaining, Max).
template <int Max = kGroupBlock, int G = 1, typename F>
void with_group_block(int64_t remaining, F&& f) {
  if constexpr (G < Max) {
    if (remaining > G) return with_group_block<Max, G + 1>(remaining, f);
  }
  f(std::integral_constant<int, G>{});
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#define ATTNLAB_BF16_PRODUCTS 1
// bfloat16 products, for an int8 or a bfloat16 cache on a CPU with AVX512_BF16 (attnlab._build
// adds -mavx512bf16 there). vdpbf16ps multiplies the two bfloat16 of each 32-bit lane by two
// others and adds both products to the lane's float32 sum: twice the multiply-adds of an FMA
// per instruction. The cache's values are exact in bfloat16 (int8's -128..127 need 8 bits of
// significand, bfloat16 has 8); the queries and the softmax weights are rounded to it (a
// relative 2^-9, as SDPA on bfloat16 tensors rounds them), the sums are float32. Multi-query
// attention over an int8 cache is arithmetic-bound, so this halves its arithmetic
// (scripts/decode_regions.py --cache-dtype int8 --rows 1:1:4096 on a 2-core Zen 4: the
// attention from 0.94 to 0.66 ms of a 12-layer step, 229 "GFLOP/s" counted as float32 work,
// above torch.mm's 194). A float32 cache keeps float32 products, and so does a key/value head
// read by one query head (multi-head attention, memory-bound: the products would only add
// the conversions and the rounding; scripts/decode_gqa.py --baseline, 1.00-1.07 of the time).
template <typename T>
constexpr bool kPairs = std::is_same_v<T, int8_t> || std::is_same_v<T, c10::BFloat16>;
// Query heads per block with bfloat16 products: all 12 of a multi-query head in registers at
// once (2 vectors of keys a step), so that each key is widened and paired once for them all;
// the conversions, not the products, bound the blocks of 6 (decode_regions.py).
constexpr int kPairBlock = 12;

// Word order that interleaves two vectors' lanes: a[l] to word 2l, b[l] to word 2l + 1.
alignas(64) constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                                  21, 6, 22, 7, 23, 8,  24, 9,  25, 10, 26,
                                                  11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// Lane l holds the bfloat16 pair (a[l], b[l]), each rounded to nearest even.
inline __m512bh pair(const Vec& a, const Vec& b) {
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // words 0-15: a, 16-31: b
  return (__m512bh)_mm512_permutexvar_epi16(_mm512_load_si512(kInterleave), both);
}

// Every lane holds the bfloat16 pair (p[0], p[1]).
inline __m512bh pair_at(const uint16_t* p) {
  int32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return (__m512bh)_mm512_set1_epi32(bits);
}

// out[0..n) = x[0..n) rounded to bfloat16, out[n] = 0 (the second word of an odd count's last
// pair).
void to_bfloat16(const float* x, int64_t n, uint16_t* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
  }
  if (i < n) {
    const __mmask16 lanes = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m256i words = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(lanes, x + i));
    _mm256_mask_storeu_epi16(out + i, lanes, words);
  }
  out[n] = 0;
}

// The ticks of rows r and, where `two`, r + 1, read by a block of G query heads.
template <int G>
inline void tick_pair(Prefetcher& ahead, int64_t r, bool two) {
  if (r % tick_every<G>() == 0) ahead.tick();
  if (two && (r + 1) % tick_every<G>() == 0) ahead.tick();
}

// 16 bfloat16 at p (the first `part` where Part, the other words 0), as they are.
template <bool Part>
inline __m256i words_at(const c10::BFloat16* p, int64_t part) {
  if constexpr (Part) {
    return _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << part) - 1), p);
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
}

// NV vectors (Part: one of `part` lanes) of rows r and r + 1 (`next` elements on; a zero row
// where not `two`), as pairs: a bfloat16 cache's words interleaved as they are.
template <int NV, bool Part>
inline void row_pairs(const c10::BFloat16* row, int64_t next, bool two, int64_t part,
                      __m512bh* out) {
  constexpr int64_t w = Vec::size();
  ATTNLAB_UNROLL
  for (int j = 0; j < NV; ++j) {
    const __m256i a = words_at<Part>(row + j * w, part);
    const __m256i b = two ? words_at<Part>(row + next + j * w, part) : _mm256_setzero_si256();
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
    out[j] = (__m512bh)_mm512_permutexvar_epi16(_mm512_load_si512(kInterleave), both);
  }
}

// The same of an int8 cache: widened to float32, then rounded (exactly) to bfloat16.
template <int NV, bool Part>
inline void row_pairs(const int8_t* row, int64_t next, bool two, int64_t part, __m512bh* out) {
  constexpr int64_t w = Vec::size();
  ATTNLAB_UNROLL
  for (int j = 0; j < NV; ++j) {
    const Vec a = Part ? load_part(row, part) : load(row + j * w);
    const Vec b = !two ? Vec(0.0f) : (Part ? load_part(row + next, part) : load(row + next + j * w));
    out[j] = pair(a, b);
  }
}

// grouped_scores with bfloat16 products: q (G heads, `q_stride` words apart) rounded to
// bfloat16 with a zero word past each head's hd (to_bfloat16), two rows of keys a step. NV
// vectors of keys from t = 0 (Part: one vector of `part` keys).
template <int G, int NV, bool Part = false, typename T>
void pair_score_step(const uint16_t* q, int64_t q_stride, int64_t hd, const T* k, int64_t cap,
                     int64_t t, int64_t part, float* scores, int64_t n,
                     const ScoreBounds& bounds, Prefetcher& ahead) {
  constexpr int64_t w = Vec::size();
  __m512 a[G][NV];
  ATTNLAB_UNROLL
  for (int i = 0; i < G; ++i) {
    ATTNLAB_UNROLL
    for (int j = 0; j < NV; ++j) a[i][j] = _mm512_setzero_ps();
  }
  for (int64_t d = 0; d < hd; d += 2) {
    const bool two = d + 1 < hd;
    tick_pair<G>(ahead, d, two);
    __m512bh kv[NV];
    row_pairs<NV, Part>(k + d * cap + t, cap, two, part, kv);
    ATTNLAB_UNROLL
    for (int i = 0; i < G; ++i) {
      const __m512bh qv = pair_at(q + i * q_stride + d);
      ATTNLAB_UNROLL
      for (int j = 0; j < NV; ++j) a[i][j] = _mm512_dpbf16_ps(a[i][j], qv, kv[j]);
    }
  }
  ATTNLAB_UNROLL
  for (int i = 0; i < G; ++i) {
    ATTNLAB_UNROLL
    for (int j = 0; j < NV; ++j) {
      if constexpr (Part) {
        bounds.finish(Vec(a[i][j]), i, t, part).store(scores + i * n + t, part);
      } else {
        bounds.finish(Vec(a[i][j]), i, t + j * w).store(scores + i * n + t + j * w);
      }
    }
  }
}

// grouped_scores' loop (the same steps and remainders) with bfloat16 products.
template <int G, typename T>
void pair_scores(const uint16_t* q, int64_t q_stride, int64_t hd, const T* k, int64_t cap,
                 int64_t m, float* scores, int64_t n, const ScoreBounds& bounds,
                 Prefetcher& ahead) {
  constexpr int64_t w = Vec::size();
  constexpr int NV = key_vectors<G>();
  int64_t t = 0;
  for (; t + NV * w <= m; t += NV * w) {
    pair_score_step<G, NV>(q, q_stride, hd, k, cap, t, 0, scores, n, bounds, ahead);
  }
  for (; t + w <= m; t += w) {
    pair_score_step<G, 1>(q, q_stride, hd, k, cap, t, 0, scores, n, bounds, ahead);
  }
  if (t < m) pair_score_step<G, 1, true>(q, q_stride, hd, k, cap, t, m - t, scores, n, bounds, ahead);
}

// row_values with bfloat16 products: p (G heads' weights, `p_stride` words apart) rounded to
// bfloat16 (to_bfloat16), two rows of values a step (the second word of an odd m's last pair
// meets a zero row).
template <int G, int NV, bool Part = false, typename T>
void pair_values(const uint16_t* p, int64_t p_stride, const T* v, int64_t hd, int64_t m,
                 float* out, int64_t stride, int64_t part, Prefetcher& ahead) {
  constexpr int64_t w = Vec::size();
  __m512 a[G][NV];
  ATTNLAB_UNROLL
  for (int i = 0; i < G; ++i) {
    ATTNLAB_UNROLL
    for (int j = 0; j < NV; ++j) {
      a[i][j] = Part ? Vec::loadu(out + i * stride, part) : Vec::loadu(out + i * stride + j * w);
    }
  }
  for (int64_t t = 0; t < m; t += 2) {
    const bool two = t + 1 < m;
    tick_pair<G>(ahead, t, two);
    __m512bh x[NV];
    row_pairs<NV, Part>(v + t * hd, hd, two, part, x);
    ATTNLAB_UNROLL
    for (int i = 0; i < G; ++i) {
      const __m512bh pv = pair_at(p + i * p_stride + t);
      ATTNLAB_UNROLL
      for (int j = 0; j < NV; ++j) a[i][j] = _mm512_dpbf16_ps(a[i][j], pv, x[j]);
    }
  }
  ATTNLAB_UNROLL
  for (int i = 0; i < G; ++i) {
    ATTNLAB_UNROLL
    for (int j = 0; j < NV; ++j) {
      if constexpr (Part) {
        Vec(a[i][j]).store(out + i * stride, part);
      } else {
        Vec(a[i][j]).store(out + i * stride + j * w);
      }
    }
  }
}

// all_row_values' calls (the same features, the same ticks) with bfloat16 products.
template <int G, typename T>
void all_pair_values(const uint16_t* p, int64_t p_stride, const T* v, int64_t hd, int64_t m,
                     float* out, int64_t stride, Prefetcher& ahead) {
  constexpr int64_t w = Vec::size();
  constexpr int NV = key_vectors<G>();
  int64_t f = 0;
  for (; f + NV * w <= hd; f += NV * w) {
    pair_values<G, NV>(p, p_stride, v + f, hd, m, out + f, stride, 0, ahead);
  }
  for (; f + w <= hd; f += w) pair_values<G, 1>(p, p_stride, v + f, hd, m, out + f, stride, 0, ahead);
  if (f < hd) pair_values<G, 1, true>(p, p_stride, v + f, hd, m, out + f, stride, hd - f, ahead);
}
#else
template <typename T>
constexpr bool kPairs = false;
constexpr int kPairBlock = kGroupBlock;
// declared only, for the branches `if constexpr (kPairs<T>)` discards
void to_bfloat16(const float* x, int64_t n, uint16_t* out);
template <int G, typename T>
void pair_scores(const uint16_t*, int64_t, int64_t, const T*, int64_t, int64_t, float*, int64_t,
                 const ScoreBounds&, Prefetcher&);
template <int G, typename T>
void all_pair_values(const uint16_t*, int64_t, const T*, int64_t, int64_t, float*, int64_t,
                     Prefetcher&);
#endif

// Whether `groups` query heads per key/value head over a cache of T multiply in bfloat16:
// where the build has the products, for int8 and bfloat16, and only for several heads.
template <typename T>
bool takes_pairs(int64_t groups) {
  return kPairs<T> && groups > 1;
}

struct Attend {
  const float* qkv;  // (b, d_qkv): queries (rotated) then keys then values
  int64_t d_qkv, heads, kv_heads, hd, cap, block, first, count, chunk, chunks;
  float scale;
  float* partial;  // (b, heads, chunks, hd + 2): unnormalised output, max, sum

  // The item's (sequence, key/value head, first key, number of keys).
  void locate(int64_t index, int64_t& b, int64_t& g, int64_t& t0, int64_t& n) const {
    const int64_t c = index % chunks;
    g = (index / chunks) % kv_heads, b = index / (chunks * kv_heads);
    t0 = first + c * chunk, n = std::min(chunk, first + count - t0);
  }

  // The segments of keys [t0, t0 + n) of one head's buffer `base`, block by block:
  // f(segment, offset u of its first key in the item, the next segment's start or nullptr,
  // that segment's elements); after the last, `then` (its start and elements) is next.
  template <typename T, typename F>
  void for_segments(const T* base, int64_t t0, int64_t n, const T* then, int64_t then_elements,
                    F&& f) const {
    Segment s = segment(t0, t0 + n, hd, cap, block);
    for (int64_t u = 0; u < n;) {
      const int64_t after = u + s.m;
      const Segment next = after < n ? segment(t0 + after, t0 + n, hd, cap, block) : s;
      f(s, u, after < n ? base + next.offset : then, after < n ? span(next) : then_elements);
      u = after;
      s = next;
    }
  }

  // f(the block's first query head, std::integral_constant<int, G>) for each block of G of
  // the `groups` query heads: blocks of kPairBlock with bfloat16 products, else kGroupBlock.
  template <typename T, typename F>
  static void each_block(int64_t groups, bool pairs, F&& f) {
    if constexpr (kPairs<T>) {
      if (pairs) {
        for (int64_t i = 0; i < groups; i += kPairBlock) {
          with_group_block<kPairBlock>(groups - i, [&](auto G) { f(i, G); });
        }
        return;
      }
    }
    for (int64_t i = 0; i < groups; i += kGroupBlock) {
      with_group_block<kGroupBlock>(groups - i, [&](auto G) { f(i, G); });
    }
  }

  // Elements from a segment's row 0 to the end of its last row.
  int64_t span(const Segment& s) const { return (hd - 1) * s.stride + s.m; }

  // One (sequence, key/value head, chunk of keys) for the `groups` query heads sharing it.
  template <typename T>
  void item(int64_t index, T* keys_t, T* values_t, float* key_scales, float* value_scales,
            int64_t slot, int64_t next, bool first_item, std::vector<float>& scores,
            std::vector<Vec>& bounds, std::vector<uint16_t>& words) const {
    const int64_t c = index % chunks;
    int64_t b, g, t0, n;
    locate(index, b, g, t0, n);
    const int64_t groups = heads / kv_heads;
    const int64_t head = (b * kv_heads + g);
    const T* k_head = keys_t + head * hd * cap;
    const T* v_head = values_t + head * hd * cap;
    if (slot >= t0 && slot < t0 + n) {  // this chunk holds the new token's slot: store it first
      const float* row = qkv + b * d_qkv + heads * hd + g * hd;  // its key, then kv_dim on its value
      store(row, keys_t + head * hd * cap, key_scales ? key_scales + head * cap : nullptr, hd, cap,
            block, slot);
      store(row + kv_heads * hd, values_t + head * hd * cap,
            value_scales ? value_scales + head * cap : nullptr, hd, cap, 1, slot);  // a row
    }
    // what follows this item's keys: its values (rows: one stretch from its first token on,
    // read a block of tokens at a time); what follows its values: the keys of the item this
    // thread takes next (`next`, or none: -1)
    const Segment first_keys = segment(t0, t0 + n, hd, cap, block);
    const T* values_start = v_head + t0 * hd;
    const int64_t value_block = std::min(block, n);
    const T* next_keys = nullptr;
    int64_t next_elements = 0;
    if (next >= 0) {
      int64_t nb, ng, nt0, nn;
      locate(next, nb, ng, nt0, nn);
      const Segment s = segment(nt0, nt0 + nn, hd, cap, block);
      next_keys = keys_t + (nb * kv_heads + ng) * hd * cap + s.offset;
      next_elements = span(s);
    }
    Prefetcher ahead;
    if (first_item) {  // the others' first keys were prefetched by the item before
      ahead.start(k_head + first_keys.offset, span(first_keys), 1);
      ahead.all();
    }
    const float* q = qkv + b * d_qkv + g * groups * hd;  // (groups, hd)
    // bfloat16 products (kPairs): the queries rounded, and the weights after the softmax
    const int64_t q_stride = hd + 1, p_stride = n + 1;  // words per head: a zero pad each
    uint16_t* q_words = words.data();
    uint16_t* p_words = q_words + groups * q_stride;
    const bool pairs = takes_pairs<T>(groups);
    if constexpr (kPairs<T>) {
      if (pairs) {
        for (int64_t i = 0; i < groups; ++i) to_bfloat16(q + i * hd, hd, q_words + i * q_stride);
      }
    }
    // The group's scores one small matrix product, each key read once for a block of up to
    // kGroupBlock query heads with their sums in registers (grouped_scores), scaled there and
    // bounded (ScoreBounds: per query head, the largest score and the least, vectors)
    Vec* maxima = bounds.data();
    Vec* minima = maxima + groups;
    std::fill_n(maxima, groups, Vec(kNegInf));
    std::fill_n(minima, groups, Vec(-kNegInf));
    const float* ks = key_scales ? key_scales + head * cap + t0 : nullptr;
    auto score_ticks = [&](int64_t m) {  // rows grouped_scores reads, block by block
      int64_t ticks = 0;
      each_block<T>(groups, pairs, [&](int64_t, auto G) {
        constexpr int64_t step = key_vectors<decltype(G)::value>() * Vec::size();
        ticks += ticks_over<decltype(G)::value>(hd) * std::max<int64_t>(1, m / step);
      });
      return ticks;
    };
    int64_t key_ticks = 0;
    for_segments(k_head, t0, n, k_head, 0, [&](const Segment& s, int64_t, const T*, int64_t) {
      key_ticks += score_ticks(s.m);
    });
    ahead.start_far(values_start, value_block * hd, key_ticks);
    for_segments(k_head, t0, n, static_cast<const T*>(nullptr), 0,
                 [&](const Segment& s, int64_t u, const T* after, int64_t after_elements) {
      ahead.start(after, after_elements, score_ticks(s.m));
      each_block<T>(groups, pairs, [&](int64_t i, auto G) {
        constexpr int G_ = decltype(G)::value;
        const ScoreBounds to{scale, ks ? ks + u : nullptr, maxima + i, minima + i};
        if constexpr (kPairs<T>) {
          if (pairs) {
            return pair_scores<G_>(q_words + i * q_stride, q_stride, hd, k_head + s.offset,
                                   s.stride, s.m, scores.data() + i * n + u, n, to, ahead);
          }
        }
        if constexpr (G_ <= kGroupBlock) {
          grouped_scores<G_>(q + i * hd, hd, k_head + s.offset, s.stride, s.m,
                             scores.data() + i * n + u, n, to, ahead);
        }
      });
    });
    for (int64_t i = 0; i < groups; ++i) {
      float* s = scores.data() + i * n;
      float lanes[Vec::size()];
      maxima[i].store(lanes);
      const float m = *std::max_element(lanes, lanes + Vec::size());
      // a score that overflowed to -inf would silently weigh 0 (to +inf: NaN anyway): the
      // sum made NaN makes the output NaN, which the step refuses
      minima[i].store(lanes);
      const bool overflowed = !std::all_of(lanes, lanes + Vec::size(),
                                           [](float x) { return x > kNegInf; });
      const float sum = overflowed ? std::numeric_limits<float>::quiet_NaN() : exp_sum(s, n, m);
      if (value_scales) {  // the value scales folded into the weights
        const float* vs = value_scales + head * cap + t0;
        for (int64_t t = 0; t < n; ++t) s[t] *= vs[t];
      }
      if constexpr (kPairs<T>) {
        if (pairs) to_bfloat16(s, n, p_words + i * p_stride);
      }
      float* p = partial + ((b * heads + g * groups + i) * chunks + c) * (hd + 2);
      p[hd] = m;
      p[hd + 1] = sum;
    }
    for (int64_t i = 0; i < groups; ++i) {
      std::fill_n(partial + ((b * heads + g * groups + i) * chunks + c) * (hd + 2), hd, 0.0f);
    }
    // out[i, f] = sum_t p[i, t] v[t, f]: a block of query heads against the rows of a block
    // of tokens at a time, while the next block (or the next item's keys) is prefetched
    float* out0 = partial + ((b * heads + g * groups) * chunks + c) * (hd + 2);
    const int64_t stride = chunks * (hd + 2);  // from one query head's partial to the next
    auto value_ticks = [&](int64_t m) {  // over m rows of values, block by block
      int64_t ticks = 0;
      each_block<T>(groups, pairs, [&](int64_t, auto G) {
        constexpr int G_ = decltype(G)::value;
        ticks += ticks_over<G_>(m) * row_value_calls<G_>(hd);
      });
      return ticks;
    };
    ahead.start_far(next_keys, next_elements, value_ticks(n));
    for (int64_t u = 0; u < n; u += value_block) {
      const int64_t m = std::min(value_block, n - u);
      const bool last = u + m >= n;
      ahead.start(last ? nullptr : values_start + (u + m) * hd,
                  last ? 0 : std::min(value_block, n - u - m) * hd, value_ticks(m));
      each_block<T>(groups, pairs, [&](int64_t i, auto G) {
        constexpr int G_ = decltype(G)::value;
        if constexpr (kPairs<T>) {
          if (pairs) {
            return all_pair_values<G_>(p_words + i * p_stride + u, p_stride,
                                       values_start + u * hd, hd, m, out0 + i * stride, stride,
                                       ahead);
          }
        }
        if constexpr (G_ <= kGroupBlock) {
          all_row_values<G_>(scores.data() + i * n + u, n, values_start + u * hd, hd, m,
                             out0 + i * stride, stride, ahead);
        }
      });
    }
  }

  // attn (b, heads * hd): each head's chunks merged and normalised.
  void merge(int64_t batch, float* attn) const {
    for (int64_t bh = 0; bh < batch * heads; ++bh) {  // little work: no parallel region
      {
        const float* p = partial + bh * chunks * (hd + 2);
        float m = kNegInf;
        for (int64_t c = 0; c < chunks; ++c) m = std::max(m, p[c * (hd + 2) + hd]);
        float* o = attn + bh * hd;  // (b, h, hd) is (b, heads * hd)
        std::fill(o, o + hd, 0.0f);
        float total = 0.0f;
        for (int64_t c = 0; c < chunks; ++c) {
          const float* pc = p + c * (hd + 2);
          const float weight = std::exp(pc[hd] - m);
          total += weight * pc[hd + 1];
          for (int64_t d = 0; d < hd; ++d) o[d] += weight * pc[d];
        }
        const float inverse = 1.0f / total;
        for (int64_t d = 0; d < hd; ++d) o[d] *= inverse;
      }
    }
  }
};

// Keys per attention work item: enough items for every thread twice over, each of at least
// kMinChunk keys; with several query heads per key/value head (their sums in registers), at
// most kMaxGroupedChunk, so that the scores of all of them stay in L1 for the values' pass.
int64_t chunk_keys(int64_t batch, int64_t heads, int64_t kv_heads, int64_t count,
                   int64_t threads) {
  const int64_t heads_total = batch * kv_heads;
  const int64_t parts = std::max<int64_t>(1, (2 * threads + heads_total - 1) / heads_total);
  const int64_t chunk = std::max(kMinChunk, (count + parts - 1) / parts);
  return heads > kv_heads ? std::min(chunk, kMaxGroupedChunk) : chunk;
}

template <typename T>
void append_and_attend(const Attend& a, int64_t batch, at::Tensor& keys_t, at::Tensor& values_t,
                       at::Tensor& key_scales, at::Tensor& value_scales, int64_t slot,
                       float* attn) {
  T* keys = keys_t.data_ptr<T>();
  T* values = values_t.data_ptr<T>();
  float* ks = key_scales.numel() ? key_scales.data_ptr<float>() : nullptr;
  float* vs = value_scales.numel() ? value_scales.data_ptr<float>() : nullptr;
  const int64_t d_out = a.heads * a.hd, kv_dim = a.kv_heads * a.hd;
  const bool stored_by_items = slot >= a.first && slot < a.first + a.count;
  for (int64_t b = 0; b < batch && !stored_by_items; ++b) {
    for (int64_t g = 0; g < a.kv_heads; ++g) {
      const int64_t head = b * a.kv_heads + g;
      const float* row = a.qkv + b * a.d_qkv + d_out + g * a.hd;
      store(row, keys + head * a.hd * a.cap, ks ? ks + head * a.cap : nullptr, a.hd, a.cap,
            a.block, slot);
      store(row + kv_dim, values + head * a.hd * a.cap, vs ? vs + head * a.cap : nullptr, a.hd,
            a.cap, 1, slot);  // a row
    }
  }
  const int64_t groups = a.heads / a.kv_heads;
  const int64_t item_floats = 2 * std::min(a.chunk, a.count) * a.hd;  // its keys and values
  at::parallel_for(0, batch * a.kv_heads * a.chunks, grain_for(item_floats), [&](int64_t begin,
                                                                                  int64_t end) {
    std::vector<float> scores(groups * a.chunk);
    std::vector<Vec> bounds(2 * groups);  // per query head: the largest and least scores
    // bfloat16 queries and weights, each head's with a zero pad (Attend::item)
    std::vector<uint16_t> words(takes_pairs<T>(groups) ? groups * (a.hd + 1 + a.chunk + 1) : 0);
    for (int64_t index = begin; index < end; ++index) {
      a.item<T>(index, keys, values, ks, vs, stored_by_items ? slot : -1,
                index + 1 < end ? index + 1 : -1, index == begin, scores, bounds, words);
    }
  });
  a.merge(batch, attn);
}

// The bytes a strided tensor's elements reach in its storage (its offset to its last
// element), 0 for no elements.
int64_t reach(const at::Tensor& t) {
  if (t.numel() == 0) return 0;
  int64_t last = t.storage_offset();
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return (last + 1) * static_cast<int64_t>(t.element_size());
}

// The tensor's storage holds every element its shape reaches (a storage resized in place,
// untyped_storage().resize_(n), can hold fewer).
bool storage_covers(const at::Tensor& t) {
  return t.has_storage() && static_cast<int64_t>(t.storage().nbytes()) >= reach(t);
}

// The checks of decode_step's contract: a RuntimeError naming the argument and its values.
// Each check names the op it guards (`op`): the step's, or linear_rows' (below).
void check_tensor(const at::Tensor& t, const char* name, const char* op = "decode_step") {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be on the CPU, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous, got shape ", t.sizes(),
              " with strides ", t.strides());
  TORCH_CHECK(storage_covers(t), op, ": ", name, " of shape ", t.sizes(),
              " reaches past its storage (", t.has_storage() ? t.storage().nbytes() : 0,
              " bytes): its storage was resized in place");
  // a lazily negated (torch._neg_view) or conjugated view: its memory is not its values
  TORCH_CHECK(!t.is_neg() && !t.is_conj(), op, ": ", name, " is a lazily negated or "
              "conjugated view: pass t.resolve_neg() / t.resolve_conj()");
}

void check_float(const at::Tensor& t, const char* name, const char* op = "decode_step") {
  check_tensor(t, name, op);
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ",
              t.scalar_type());
}

void check_shape(const at::Tensor& t, const char* name, at::IntArrayRef shape,
                 const char* op = "decode_step") {
  TORCH_CHECK(t.sizes() == shape, op, ": ", name, " must be of shape ", shape, ", got ",
              t.sizes());
}

// An optional float32 vector: empty (none), or contiguous float32 (n,).
void check_bias(const at::Tensor& t, const char* name, int64_t n,
                const char* op = "decode_step") {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  if (t.numel() == 0) return;
  check_float(t, name, op);
  check_shape(t, name, {n}, op);
}

// Every tensor argument on x's device, an empty one (no bias, no rotary tables, no scales)
// included: the dispatcher picks the kernel by all of them (a meta tensor among CPU ones
// reaches the fake kernel, attnlab.fake_ops, which refuses the call in the same words).
void check_device(const at::Tensor& t, const char* name, const at::Tensor& x,
                  const char* op = "decode_step") {
  TORCH_CHECK(!t.defined() || !x.defined() || t.device() == x.device(), op, ": ", name,
              " is on ", t.device(), " but x is on ", x.device(),
              ": every tensor must be on one device");
}

// A float the kernel computes with in float32 (a scale, a norm's eps): > 0 and finite there.
void check_positive_float32(double value, const char* name, const char* op = "decode_step") {
  TORCH_CHECK(std::isfinite(value) && value > 0 && value <= std::numeric_limits<float>::max(), op,
              ": ", name, " (", value, ") must be > 0 and finite in float32, the dtype the "
              "kernel computes in (at most ", std::numeric_limits<float>::max(), ")");
}

// A float the kernel adds in float32 (a norm's offset): finite there.
void check_finite_float32(double value, const char* name, const char* op = "decode_step") {
  TORCH_CHECK(std::isfinite(value) && std::abs(value) <= std::numeric_limits<float>::max(), op,
              ": ", name, " (", value, ") must be finite in float32");
}

// Whether two contiguous tensors' bytes overlap (an empty tensor overlaps nothing).
bool overlap(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const char* a0 = static_cast<const char*>(a.data_ptr());
  const char* b0 = static_cast<const char*>(b.data_ptr());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

// A tensor the op writes (`written`) shares no byte with another argument (`other`): the
// op would write an input its schema declares read-only, or one buffer through another.
void check_apart(const at::Tensor& written, const char* written_name, const at::Tensor& other,
                 const char* other_name, const char* op = "decode_step") {
  TORCH_CHECK(!overlap(written, other), op, ": ", written_name, " and ", other_name,
              " overlap in memory: the op writes ", written_name,
              ", which may share no memory with another argument");
}

// The op's contract. attnlab.decode_cpu.step builds every argument from a MultiHeadAttention
// and its KVCache (KVCache.keys_t, scales, block, native_slots); the checks below refuse
// every other input with a RuntimeError naming the argument, before anything is read or
// written, so that no call through torch.ops can crash the process or read or write out of
// bounds. All tensors on the CPU; "empty": no elements.
//   x             float32, contiguous, (b, 1, d_in) or (b, d_in), b >= 1, d_in >= 1
//   w_qkv         float32, contiguous, (d_qkv, d_in), d_qkv = d_out + 2 * kv_heads * hd: the
//                 fused projection's rows, queries then keys then values
//   b_qkv         empty (no bias) or float32 contiguous (d_qkv,)
//   w_out         float32, contiguous, (width, d_out), width >= 1, d_out >= 1: the output
//                 projection, any width (square in the book's layer; Qwen3's and Gemma 3's
//                 heads are wider or narrower than the model)
//   b_out         empty or float32 contiguous (width,)
//   cos, sin      both empty (no rotary positions) or both float32 contiguous (rows, hd)
//   q_norm,       both empty (no query/key norm) or float32 contiguous: (hd,) each, every
//   k_norm        head normalised (Qwen3, Gemma 3), or (d_out,) and (kv_heads * hd,), the
//                 projections normalised whole (OLMo 2); before the rotation
//   keys_t,       one dtype (float32, bfloat16 or int8), contiguous, each (b, kv_heads,
//   values_t      hd * capacity): kv_heads >= 1 dividing heads, capacity >= 1 (written);
//                 keys_t in blocks of `block` tokens, values_t as rows (capacity, hd)
//   key_scales,   an int8 cache's scales: float32 contiguous (b, kv_heads, capacity) each
//   value_scales  (written); empty for a float32 or bfloat16 cache
//   heads         >= 1 dividing d_out; hd = d_out / heads (even with cos and sin)
//   position      the new token's position: >= 0, and < rows when cos/sin are given
//   slot          where the new key and value are written: in [0, capacity)
//   first, count  the slots attended to, [first, first + count): 0 <= first, 1 <= count,
//                 first + count <= capacity (KVCache.native_slots: [start + 1 - window or 0,
//                 start] without rolling, [0, min(start + 1, capacity)) when rolling; the
//                 new slot is usually among them, else it is written apart)
//   block         tokens per block of the keys' layout, >= 1 (the last block may hold
//                 fewer; a block of more than the capacity is one block of the capacity)
//   scale         the scores' scale, > 0 and finite in float32 (at most FLT_MAX; 1 / sqrt(hd))
//   norm_eps,     the query/key norms' eps (> 0, finite in float32) and the offset added to
//   norm_offset   their weights (finite; 1 for Gemma's 1 + weight); read only with norms
// Every tensor is on x's device, the empty ones included; the tensors the op writes (keys_t,
// values_t, key_scales, value_scales) share no memory with each other or with any input
// (the inputs may share memory with each other: they are only read).
// Returns the layer's output (b, 1, width); an empty tensor, with nothing written, when x holds
// a NaN or an infinity (the caller's own path then raises its error). A finite x whose float32
// arithmetic overflows (a projection, a score, or a partial sum of one that makes it -inf) is
// a RuntimeError "decode_step: the output is not finite ..." with the slot written and nothing
// else: attnlab.decode_cpu then leaves the step to the Python path, which computes in float64.
at::Tensor decode_step(const at::Tensor& x, const at::Tensor& w_qkv, const at::Tensor& b_qkv,
                       const at::Tensor& w_out, const at::Tensor& b_out, const at::Tensor& cos,
                       const at::Tensor& sin, const at::Tensor& q_norm,
                       const at::Tensor& k_norm, at::Tensor keys_t, at::Tensor values_t,
                       at::Tensor key_scales, at::Tensor value_scales, int64_t heads,
                       int64_t position, int64_t slot, int64_t first, int64_t count,
                       int64_t block, double scale, double norm_eps, double norm_offset) {
  const std::pair<const at::Tensor*, const char*> others[] = {
      {&w_qkv, "w_qkv"}, {&b_qkv, "b_qkv"}, {&w_out, "w_out"}, {&b_out, "b_out"},
      {&cos, "cos"},     {&sin, "sin"},     {&q_norm, "q_norm"}, {&k_norm, "k_norm"},
      {&keys_t, "keys_t"}, {&values_t, "values_t"}, {&key_scales, "key_scales"},
      {&value_scales, "value_scales"}};
  for (const auto& [t, name] : others) check_device(*t, name, x);
  check_float(x, "x");
  TORCH_CHECK((x.dim() == 3 && x.size(1) == 1) || x.dim() == 2,
              "decode_step: x must be (b, 1, d_in) or (b, d_in), got shape ", x.sizes());
  const int64_t batch = x.size(0), d_in = x.size(-1);
  TORCH_CHECK(batch >= 1 && d_in >= 1, "decode_step: x of shape ", x.sizes(),
              " must hold b >= 1 rows of d_in >= 1 features");
  check_float(w_out, "w_out");
  TORCH_CHECK(w_out.dim() == 2 && w_out.size(0) >= 1 && w_out.size(1) >= 1,
              "decode_step: w_out must be (width, d_out) with width >= 1 and d_out >= 1, got "
              "shape ", w_out.sizes());
  const int64_t d_out = w_out.size(1), width = w_out.size(0);
  TORCH_CHECK(heads >= 1 && d_out % heads == 0, "decode_step: heads (", heads,
              ") must be >= 1 and divide d_out (", d_out, ", w_out's columns)");
  const int64_t hd = d_out / heads;
  check_tensor(keys_t, "keys_t");
  const auto cache_dtype = keys_t.scalar_type();
  TORCH_CHECK(cache_dtype == at::kFloat || cache_dtype == at::kBFloat16 ||
                  cache_dtype == at::kChar,
              "decode_step: keys_t must be float32, bfloat16 or int8, got ", cache_dtype);
  TORCH_CHECK(keys_t.dim() == 3 && keys_t.size(0) == batch,
              "decode_step: keys_t must be (b, kv_heads, hd * capacity) with x's b (", batch,
              "), got shape ", keys_t.sizes());
  const int64_t kv_heads = keys_t.size(1);
  TORCH_CHECK(kv_heads >= 1 && heads % kv_heads == 0, "decode_step: kv_heads (", kv_heads,
              ", keys_t's dimension 1) must be >= 1 and divide heads (", heads, ")");
  TORCH_CHECK(keys_t.size(2) >= hd && keys_t.size(2) % hd == 0, "decode_step: keys_t's last "
              "dimension (", keys_t.size(2), ") must be hd (", hd, ") x capacity >= 1");
  const int64_t cap = keys_t.size(2) / hd;
  check_tensor(values_t, "values_t");
  TORCH_CHECK(values_t.scalar_type() == cache_dtype, "decode_step: values_t (",
              values_t.scalar_type(), ") must have keys_t's dtype (", cache_dtype, ")");
  check_shape(values_t, "values_t", keys_t.sizes());
  if (cache_dtype == at::kChar) {
    check_float(key_scales, "key_scales");
    check_shape(key_scales, "key_scales", {batch, kv_heads, cap});
    check_float(value_scales, "value_scales");
    check_shape(value_scales, "value_scales", {batch, kv_heads, cap});
  } else {
    TORCH_CHECK(key_scales.defined() && value_scales.defined() && key_scales.numel() == 0 &&
                    value_scales.numel() == 0,
                "decode_step: key_scales and value_scales must be empty for a ", cache_dtype,
                " cache (only an int8 cache has scales)");
  }
  const int64_t d_qkv = d_out + 2 * kv_heads * hd;
  check_float(w_qkv, "w_qkv");
  check_shape(w_qkv, "w_qkv", {d_qkv, d_in});
  check_bias(b_qkv, "b_qkv", d_qkv);
  check_bias(b_out, "b_out", width);
  TORCH_CHECK(position >= 0, "decode_step: position (", position, ") must be >= 0");
  TORCH_CHECK(cos.defined() && sin.defined(), "decode_step: cos and sin must be defined");
  if (cos.numel() || sin.numel()) {
    check_float(cos, "cos");
    check_float(sin, "sin");
    TORCH_CHECK(cos.dim() == 2 && cos.size(1) == hd, "decode_step: cos must be (rows, hd ", hd,
                "), got shape ", cos.sizes());
    TORCH_CHECK(hd % 2 == 0, "decode_step: rotary positions rotate pairs of features: head_dim (",
                hd, ") must be even with cos and sin");
    check_shape(sin, "sin", cos.sizes());
    TORCH_CHECK(position < cos.size(0), "decode_step: position (", position,
                ") must be in [0, rotary rows ", cos.size(0), ")");
  }
  TORCH_CHECK(slot >= 0 && slot < cap, "decode_step: slot (", slot, ") must be in [0, capacity ",
              cap, ")");
  TORCH_CHECK(first >= 0 && first < cap, "decode_step: first (", first,
              ") must be in [0, capacity ", cap, ")");
  TORCH_CHECK(count >= 1 && count <= cap - first, "decode_step: count (", count,
              ") must be in [1, capacity ", cap, " - first ", first, "]");
  TORCH_CHECK(block >= 1, "decode_step: block (", block, ") must be >= 1");
  check_positive_float32(scale, "scale");
  // query/key norms: both or neither; per head (hd each) or over the projections (d_out
  // for the queries, kv_heads * hd for the keys)
  TORCH_CHECK(q_norm.defined() && k_norm.defined(), "decode_step: q_norm and k_norm must be "
              "defined (empty for no query/key norm)");
  const bool normed = q_norm.numel() > 0;
  TORCH_CHECK(normed == (k_norm.numel() > 0), "decode_step: q_norm (", q_norm.numel(),
              " elements) and k_norm (", k_norm.numel(), ") come together: both or neither");
  const bool norm_per_head = normed && q_norm.numel() == hd;
  if (normed) {
    check_float(q_norm, "q_norm");
    check_float(k_norm, "k_norm");
    TORCH_CHECK(q_norm.dim() == 1 && (q_norm.numel() == hd || q_norm.numel() == d_out),
                "decode_step: q_norm must be (hd ", hd, ",) per head or (d_out ", d_out,
                ",) over the projection, got shape ", q_norm.sizes());
    check_shape(k_norm, "k_norm", {norm_per_head ? hd : kv_heads * hd});
    check_positive_float32(norm_eps, "norm_eps");
    check_finite_float32(norm_offset, "norm_offset");
  }
  // the written buffers against each other and every input, before anything is written
  const std::pair<const at::Tensor*, const char*> written[] = {
      {&keys_t, "keys_t"}, {&values_t, "values_t"}, {&key_scales, "key_scales"},
      {&value_scales, "value_scales"}};
  const std::pair<const at::Tensor*, const char*> inputs[] = {
      {&x, "x"},         {&w_qkv, "w_qkv"}, {&b_qkv, "b_qkv"}, {&w_out, "w_out"},
      {&b_out, "b_out"}, {&cos, "cos"},     {&sin, "sin"},     {&q_norm, "q_norm"},
      {&k_norm, "k_norm"}};
  for (size_t i = 0; i < std::size(written); ++i) {
    for (size_t j = i + 1; j < std::size(written); ++j) {
      check_apart(*written[i].first, written[i].second, *written[j].first, written[j].second);
    }
    for (const auto& [t, name] : inputs) {
      check_apart(*written[i].first, written[i].second, *t, name);
    }
  }
  if (!all_finite(x.data_ptr<float>(), batch * d_in)) return at::empty({0}, x.options());
  // the output allocated before the cache is written, and then, once the chunks are known,
  // one scratch buffer for the projected token, the chunks' partial sums and the heads'
  // outputs (one allocation: a tiny layer's step is a few microseconds, each costs ~0.2)
  auto out = at::empty({batch, 1, width}, x.options());  // (b, 1, width), as the module's
  const int64_t chunk = chunk_keys(batch, heads, kv_heads, count, at::get_num_threads());
  const int64_t chunks = (count + chunk - 1) / chunk;
  const int64_t qkv_floats = batch * d_qkv, partial_floats = batch * heads * chunks * (hd + 2);
  auto scratch = at::empty({qkv_floats + partial_floats + batch * d_out}, x.options());
  float* q = scratch.data_ptr<float>();         // (b, d_qkv): the projected token
  float* partial = q + qkv_floats;              // (b, heads, chunks, hd + 2)
  float* attn = partial + partial_floats;       // (b, d_out): the heads' outputs, merged
  project(x.data_ptr<float>(), batch, d_in, w_qkv.data_ptr<float>(),
          b_qkv.numel() ? b_qkv.data_ptr<float>() : nullptr, d_qkv, q);
  if (normed) {  // each head's (or the whole projection's) queries and keys, before rotation
    const float* qw = q_norm.data_ptr<float>();
    const float* kw = k_norm.data_ptr<float>();
    const float eps = norm_epsilon(norm_eps);
    const float offset = static_cast<float>(norm_offset);
    for (int64_t b = 0; b < batch; ++b) {
      float* row = q + b * d_qkv;  // (heads * hd queries, kv_heads * hd keys, values)
      if (norm_per_head) {
        for (int64_t h = 0; h < heads; ++h) rms_norm(row + h * hd, hd, qw, eps, offset);
        for (int64_t h = 0; h < kv_heads; ++h) {
          rms_norm(row + d_out + h * hd, hd, kw, eps, offset);
        }
      } else {
        rms_norm(row, d_out, qw, eps, offset);
        rms_norm(row + d_out, kv_heads * hd, kw, eps, offset);
      }
    }
  }
  if (cos.numel()) {
    const float* c = cos.data_ptr<float>() + position * hd;
    const float* s = sin.data_ptr<float>() + position * hd;
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t h = 0; h < heads + kv_heads; ++h) rotate(q + b * d_qkv + h * hd, c, s, hd);
    }
  }
  Attend a{q, d_qkv, heads, kv_heads, hd, cap, block, first, count, chunk, chunks,
           static_cast<float>(scale), partial};
  switch (keys_t.scalar_type()) {
    case at::kFloat:
      append_and_attend<float>(a, batch, keys_t, values_t, key_scales, value_scales, slot,
                               attn);
      break;
    case at::kBFloat16:
      append_and_attend<c10::BFloat16>(a, batch, keys_t, values_t, key_scales, value_scales, slot,
                                       attn);
      break;
    case at::kChar:
      append_and_attend<int8_t>(a, batch, keys_t, values_t, key_scales, value_scales, slot,
                                attn);
      break;
    default:
      TORCH_CHECK(false, "decode_step: cache dtype ", keys_t.scalar_type(), " is not handled");
  }
  project(attn, batch, d_out, w_out.data_ptr<float>(),
          b_out.numel() ? b_out.data_ptr<float>() : nullptr, width, out.data_ptr<float>());
  // x was finite: a non-finite output is float32 overflowing (x times the weights, or the
  // scale times q . k); refused, not returned (attnlab.decode_cpu names it a ValueError)
  TORCH_CHECK(all_finite(out.data_ptr<float>(), batch * width),
              "decode_step: the output is not finite though x is: the projections or the "
              "scores overflowed float32 (x's values times the weights, or the scale times "
              "q . k, past 3.4e38)");
  return out;
}

// y[0..n) += a * x[0..n).
inline void axpy(float a, const float* x, float* y, int64_t n) {
  const Vec va(a);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    at::vec::fmadd(va, Vec::loadu(x + i), Vec::loadu(y + i)).store(y + i);
  }
  for (; i < n; ++i) y[i] += a * x[i];
}

// out[0..4) = row . q[k * n] for k < 4: one read of the row for four queries.
inline void dot4(const float* row, const float* q, int64_t n, float* out) {
  Vec s0(0.0f), s1(0.0f), s2(0.0f), s3(0.0f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec v = Vec::loadu(row + i);
    s0 = at::vec::fmadd(v, Vec::loadu(q + i), s0);
    s1 = at::vec::fmadd(v, Vec::loadu(q + n + i), s1);
    s2 = at::vec::fmadd(v, Vec::loadu(q + 2 * n + i), s2);
    s3 = at::vec::fmadd(v, Vec::loadu(q + 3 * n + i), s3);
  }
  sum4(s0, s1, s2, s3, out);
  for (; i < n; ++i) {
    for (int64_t k = 0; k < 4; ++k) out[k] += row[i] * q[k * n + i];
  }
}

// Multi-head latent attention's absorbed step for one token per sequence (attnlab.mla): the
// sizes, with DeepSeek's names (r kv_lora_rank, dn/dr the query's features without and with
// rotary positions, dv each head's values), the held rows, the softmax scale, and the split
// of each sequence's rows into chunks (one work item each, both cores reading one sequence).
struct Latent {
  int64_t heads, dn, dr, dv, r, capacity, count, chunk, chunks;
  float scale;
  int64_t width() const { return r + dr; }  // a held row: its latent, then its rotary key
  int64_t per_head() const { return (dn + dv) * r; }  // kv_b_proj's rows of one head
};

constexpr int64_t kLatentTokens = 128;  // rows per block of a chunk's value pass (L2)
constexpr int64_t kLatentAhead = 6;  // rows ahead of the score pass's read, prefetched

// q (heads, r + dr) <- head h's [q_nope W_UK, q_rope] for one sequence, from its query
// (heads, dn + dr) as projected, the rotary part rotated here (cos, sin: the position's
// table rows, or null for none).
void latent_query(const Latent& L, const float* query, const float* cos, const float* sin,
                  const float* w, int64_t h, float* q) {
  const float* own = query + h * (L.dn + L.dr);  // [q_nope (dn), q_rope (dr)]
  float* qh = q + h * L.width();
  std::fill(qh, qh + L.r, 0.0f);
  for (int64_t d = 0; d < L.dn; ++d) {  // W_UK: the head's dn key rows (dn, r)
    axpy(own[d], w + h * L.per_head() + d * L.r, qh, L.r);
  }
  std::copy(own + L.dn, own + L.dn + L.dr, qh + L.r);
  if (cos != nullptr) rotate(qh + L.r, cos, sin, L.dr);
}

// out[j * 4 + k] = row_j . q_k for 4 rows and 4 queries (each `n` floats, `width` apart):
// 16 independent multiply-add chains where a single row's dot4 has 4, whose latency bounds
// it, and 8 loads per 16 multiply-adds where dot4 has 5 per 4.
inline void dot4x4(const float* rows, const float* q, int64_t n, int64_t width, float* out) {
  constexpr int64_t w = Vec::size();
  Vec s[4][4];
  ATTNLAB_UNROLL
  for (int j = 0; j < 4; ++j) {
    ATTNLAB_UNROLL
    for (int k = 0; k < 4; ++k) s[j][k] = Vec(0.0f);
  }
  int64_t i = 0;
  for (; i + w <= n; i += w) {
    Vec qv[4];
    ATTNLAB_UNROLL
    for (int k = 0; k < 4; ++k) qv[k] = Vec::loadu(q + k * width + i);
    ATTNLAB_UNROLL
    for (int j = 0; j < 4; ++j) {
      const Vec v = Vec::loadu(rows + j * width + i);
      ATTNLAB_UNROLL
      for (int k = 0; k < 4; ++k) s[j][k] = at::vec::fmadd(v, qv[k], s[j][k]);
    }
  }
  ATTNLAB_UNROLL
  for (int j = 0; j < 4; ++j) sum4(s[j][0], s[j][1], s[j][2], s[j][3], out + j * 4);
  for (; i < n; ++i) {
    for (int64_t j = 0; j < 4; ++j) {
      for (int64_t k = 0; k < 4; ++k) out[j * 4 + k] += rows[j * width + i] * q[k * width + i];
    }
  }
}

// The `count` rows kLatentAhead on from `first` (each `width` floats) into L2, while those
// rows are multiplied (past the rows: dropped, never read).
inline void prefetch_ahead(const float* first, int64_t count, int64_t width) {
#if defined(ATTNLAB_X86)
  const char* ahead = reinterpret_cast<const char*>(first + kLatentAhead * width);
  const int64_t bytes = count * width * static_cast<int64_t>(sizeof(float));
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T1);
#endif
}

// Scores of every head for the m rows of a block (p: heads x kLatentTokens): four rows at a
// time against four heads (dot4x4), the rest a row at a time (dot4, dot), the rows
// `kLatentAhead` on prefetched into L2.
void latent_scores(const Latent& L, const float* q, const float* rows, int64_t m, float* p) {
  const int64_t width = L.width(), heads = L.heads;
  int64_t t = 0;
  for (; t + 4 <= m && heads >= 4; t += 4) {
    const float* four = rows + t * width;
    prefetch_ahead(four, 4, width);
    int64_t k = 0;
    for (; k + 4 <= heads; k += 4) {
      float s[16];
      dot4x4(four, q + k * width, width, width, s);
      for (int64_t j = 0; j < 4; ++j) {
        for (int64_t i = 0; i < 4; ++i) p[(k + i) * kLatentTokens + t + j] = s[j * 4 + i] * L.scale;
      }
    }
    for (; k < heads; ++k) {
      for (int64_t j = 0; j < 4; ++j) {
        p[k * kLatentTokens + t + j] = dot(q + k * width, four + j * width, width) * L.scale;
      }
    }
  }
  for (; t < m; ++t) {
    const float* row = rows + t * width;
    prefetch_ahead(row, 1, width);
    int64_t k = 0;
    for (; k + 4 <= heads; k += 4) {
      float s[4];
      dot4(row, q + k * width, width, s);
      for (int64_t j = 0; j < 4; ++j) p[(k + j) * kLatentTokens + t] = s[j] * L.scale;
    }
    for (; k < heads; ++k) p[k * kLatentTokens + t] = dot(q + k * width, row, width) * L.scale;
  }
}

// a[j] (latents of 4 heads, `stride` apart) += sum_t p[j][t] row_t for the m rows of a block,
// NV vectors of features from the first: 4 NV sums in registers, each row's vectors loaded
// once for the 4 heads (NV loads and 4 broadcasts per 4 NV multiply-adds, 4 NV chains).
template <int NV>
void latent_values4(const float* p, const float* rows, int64_t width, int64_t m, float* a,
                    int64_t stride) {
  constexpr int64_t w = Vec::size();
  Vec sums[4][NV];
  ATTNLAB_UNROLL
  for (int j = 0; j < 4; ++j) {
    ATTNLAB_UNROLL
    for (int i = 0; i < NV; ++i) sums[j][i] = Vec::loadu(a + j * stride + i * w);
  }
  for (int64_t t = 0; t < m; ++t) {
    Vec v[NV];
    ATTNLAB_UNROLL
    for (int i = 0; i < NV; ++i) v[i] = Vec::loadu(rows + t * width + i * w);
    ATTNLAB_UNROLL
    for (int j = 0; j < 4; ++j) {
      const Vec pv(p[j * kLatentTokens + t]);
      ATTNLAB_UNROLL
      for (int i = 0; i < NV; ++i) sums[j][i] = at::vec::fmadd(pv, v[i], sums[j][i]);
    }
  }
  ATTNLAB_UNROLL
  for (int j = 0; j < 4; ++j) {
    ATTNLAB_UNROLL
    for (int i = 0; i < NV; ++i) sums[j][i].store(a + j * stride + i * w);
  }
}

// part[k][0..r) += sum_t p[k][t] latent_t over the m rows of a block, for every head k.
void latent_values(const Latent& L, const float* p, const float* rows, int64_t m, float* part) {
  const int64_t w = Vec::size(), width = L.width(), stride = L.r + 2;
  int64_t k = 0;
  for (; k + 4 <= L.heads; k += 4) {  // four heads' sums in registers
    const float* pk = p + k * kLatentTokens;
    float* a = part + k * stride;
    int64_t c = 0;
    for (; c + 4 * w <= L.r; c += 4 * w) latent_values4<4>(pk, rows + c, width, m, a + c, stride);
    for (; c + w <= L.r; c += w) latent_values4<1>(pk, rows + c, width, m, a + c, stride);
    for (; c < L.r; ++c) {
      for (int64_t t = 0; t < m; ++t) {
        for (int64_t j = 0; j < 4; ++j) {
          a[j * stride + c] += pk[j * kLatentTokens + t] * rows[t * width + c];
        }
      }
    }
  }
  for (; k < L.heads; ++k) {
    for (int64_t t = 0; t < m; ++t) {
      axpy(p[k * kLatentTokens + t], rows + t * width, part + k * stride, L.r);
    }
  }
}

// One chunk of one sequence's rows (n rows from `rows`) for every head, in blocks of
// kLatentTokens rows read once from memory: each block's scores, their softmax weights
// against the chunk's running maximum (the sums so far rescaled where it grows, as flash
// attention does), then the block's weighted latents while its rows are in L2. part
// (heads, r + 2): each head's weighted latents, then the maximum and the weights' sum
// (merged by latent_merge); p: heads x kLatentTokens scratch.
void latent_chunk(const Latent& L, const float* q, const float* rows, int64_t n, float* p,
                  float* part) {
  const int64_t width = L.width(), stride = L.r + 2;
  for (int64_t k = 0; k < L.heads; ++k) {
    float* tail = part + k * stride;  // [latents (r), maximum, sum]
    std::fill(tail, tail + L.r, 0.0f);
    tail[L.r] = kNegInf;
    tail[L.r + 1] = 0.0f;
  }
  for (int64_t t0 = 0; t0 < n; t0 += kLatentTokens) {
    const int64_t m = std::min(kLatentTokens, n - t0);
    const float* block = rows + t0 * width;
    latent_scores(L, q, block, m, p);
    for (int64_t k = 0; k < L.heads; ++k) {
      float* pk = p + k * kLatentTokens;
      float* tail = part + k * stride;
      const float top = std::max(tail[L.r], *std::max_element(pk, pk + m));
      if (t0 > 0 && top > tail[L.r]) {  // a larger maximum: the sums so far rescaled to it
        const float factor = std::exp(tail[L.r] - top);
        for (int64_t c = 0; c < L.r; ++c) tail[c] *= factor;
        tail[L.r + 1] *= factor;
      }
      tail[L.r] = top;
      tail[L.r + 1] += exp_sum(pk, m, top);
    }
    latent_values(L, p, block, m, part);
  }
}

// out (dv,) for head h of one sequence: its chunks' parts merged (each rescaled to the
// largest maximum, as flash decoding merges split keys) into latent (r,), then W_UV.
void latent_merge(const Latent& L, const float* parts, const float* w, int64_t h,
                  float* latent, float* out) {
  const int64_t stride = L.heads * (L.r + 2);  // from one chunk's part to the next
  const float* head = parts + h * (L.r + 2);
  float top = kNegInf;
  for (int64_t c = 0; c < L.chunks; ++c) top = std::max(top, head[c * stride + L.r]);
  float sum = 0.0f;
  std::fill(latent, latent + L.r, 0.0f);
  for (int64_t c = 0; c < L.chunks; ++c) {
    const float* part = head + c * stride;
    const float factor = std::exp(part[L.r] - top);
    sum += factor * part[L.r + 1];
    axpy(factor, part, latent, L.r);
  }
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < L.r; ++i) latent[i] *= inv;
  const float* w_uv = w + h * L.per_head() + L.dn * L.r;  // the head's dv value rows (dv, r)
  int64_t j = 0;  // four value rows per read of the latent, their sums reduced in shuffles
  for (; j + 4 <= L.dv; j += 4) dot4(latent, w_uv + j * L.r, L.r, out + j);
  for (; j < L.dv; ++j) out[j] = dot(latent, w_uv + j * L.r, L.r);
}

// Returns (b, heads, dv): each head's output before o_proj, as the module's absorbed path
// computes it (attnlab.mla): the token's row (its latent normalised by the latent norm, its
// rotary key rotated) written to row `position` of each sequence's rows, then attention over
// rows [0, position] in the latent space. An empty tensor where the output is not finite
// (a projection, q_nope W_UK or a score past float32): the row is written, and the module's
// own path then computes the step, writing the row again, or names the overflow.
// Three parallel passes: the queries folded (sequence, head), the rows in chunks (sequence,
// chunk; each row read once for all heads), the chunks merged and W_UV (sequence, head).
at::Tensor latent_step(const at::Tensor& query, const at::Tensor& compressed,
                       const at::Tensor& norm, double norm_eps, double norm_offset,
                       const at::Tensor& cos, const at::Tensor& sin, int64_t position,
                       at::Tensor rows, const at::Tensor& w, double scale) {
  constexpr const char* op = "latent_step";
  const std::pair<const at::Tensor*, const char*> tensors[] = {
      {&query, "query"}, {&compressed, "compressed"}, {&norm, "norm"}, {&cos, "cos"},
      {&sin, "sin"},     {&rows, "rows"},             {&w, "w"}};
  for (const auto& [t, name] : tensors) check_device(*t, name, query, op);
  check_float(query, "query", op);
  check_float(rows, "rows", op);
  check_float(compressed, "compressed", op);
  check_float(w, "w", op);
  TORCH_CHECK(rows.dim() == 3 && rows.size(0) >= 1 && rows.size(1) >= 1 && rows.size(2) >= 1, op,
              ": rows must be (b >= 1, capacity >= 1, r + dr), got shape ", rows.sizes());
  const int64_t batch = rows.size(0), capacity = rows.size(1), width = rows.size(2);
  TORCH_CHECK(compressed.dim() == 2 && compressed.size(0) == batch && compressed.size(1) == width,
              op, ": compressed must be (b ", batch, ", r + dr ", width, "), rows' widths, got "
              "shape ", compressed.sizes());
  TORCH_CHECK(w.dim() == 2 && w.size(0) >= 1 && w.size(1) >= 1 && w.size(1) <= width, op,
              ": w must be (heads (dn + dv), r) with 1 <= r <= rows' width (", width, "), got "
              "shape ", w.sizes());
  const int64_t r = w.size(1), dr = width - r;
  TORCH_CHECK(query.dim() == 3 && query.size(0) == batch && query.size(1) >= 1 &&
                  query.size(2) >= dr, op, ": query must be (b ", batch, ", heads >= 1, dn + dr ",
              "with dr ", dr, "), got shape ", query.sizes());
  const int64_t heads = query.size(1), dn = query.size(2) - dr;
  TORCH_CHECK(w.size(0) % heads == 0 && w.size(0) / heads > dn, op, ": w's rows (", w.size(0),
              ") must be heads (", heads, ") x (dn ", dn, " + dv >= 1)");
  TORCH_CHECK(position >= 0 && position < capacity, op, ": position (", position,
              ") must be in [0, capacity ", capacity, ")");
  check_positive_float32(scale, "scale", op);
  check_bias(norm, "norm", r, op);  // empty: no latent norm
  if (norm.numel()) {
    check_positive_float32(norm_eps, "norm_eps", op);
    check_finite_float32(norm_offset, "norm_offset", op);
  }
  TORCH_CHECK(cos.defined() && sin.defined(), op, ": cos and sin must be defined");
  const bool rotary = cos.numel() > 0 || sin.numel() > 0;
  if (rotary) {
    check_float(cos, "cos", op);
    check_float(sin, "sin", op);
    TORCH_CHECK(dr % 2 == 0 && dr > 0, op, ": rotary positions rotate pairs of features: dr (",
                dr, ") must be even and > 0 with cos and sin");
    TORCH_CHECK(cos.dim() == 2 && cos.size(1) == dr && position < cos.size(0), op,
                ": cos must be (rows > position ", position, ", dr ", dr, "), got shape ",
                cos.sizes());
    check_shape(sin, "sin", cos.sizes(), op);
  }
  for (const auto& [t, name] : tensors) {  // rows is written: it may share no memory
    if (t != &rows) check_apart(rows, "rows", *t, name, op);
  }
  const int64_t count = position + 1;
  const int64_t threads = at::get_num_threads();
  const int64_t split = std::max<int64_t>(1, std::min(threads / batch, count / kLatentTokens));
  const int64_t chunk = (count + split - 1) / split, chunks = (count + chunk - 1) / chunk;
  const Latent L{heads, dn, dr, w.size(0) / heads - dn, r, capacity, count, chunk, chunks,
                 static_cast<float>(scale)};
  auto out = at::empty({batch, heads, L.dv}, query.options());  // (b, heads, dv)
  // one allocation: the folded queries (b, heads, r + dr), each item's scores (heads,
  // kLatentTokens) and part (heads, r + 2), and a latent (r,) per (sequence, head) for the merge
  const int64_t query_floats = batch * heads * width, items = batch * chunks;
  const int64_t score_floats = heads * kLatentTokens, part_floats = heads * (r + 2);
  auto scratch = at::empty({query_floats + items * (score_floats + part_floats) +
                            batch * heads * r}, query.options());
  float* q = scratch.data_ptr<float>();
  float* scores = q + query_floats;
  float* parts = scores + items * score_floats;
  float* latents = parts + items * part_floats;
  const float* c = rotary ? cos.data_ptr<float>() + position * dr : nullptr;
  const float* sn = rotary ? sin.data_ptr<float>() + position * dr : nullptr;
  float* held = rows.data_ptr<float>();
  for (int64_t b = 0; b < batch; ++b) {  // the token's row: [latent normalised, key rotated]
    float* row = held + (b * capacity + position) * width;
    std::copy_n(compressed.data_ptr<float>() + b * width, width, row);
    if (norm.numel()) {
      rms_norm(row, r, norm.data_ptr<float>(), norm_epsilon(norm_eps),
               static_cast<float>(norm_offset));
    }
    if (rotary) rotate(row + r, c, sn, dr);
  }
  const float* qp = query.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  at::parallel_for(0, batch * heads, grain_for(dn * r), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / heads;
      latent_query(L, qp + b * heads * (dn + dr), c, sn, wp, i % heads, q + b * heads * width);
    }
  });
  at::parallel_for(0, items, grain_for(chunk * width), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / chunks, t0 = (item % chunks) * chunk;
      latent_chunk(L, q + b * heads * width, held + (b * capacity + t0) * width,
                   std::min(chunk, count - t0), scores + item * score_floats,
                   parts + item * part_floats);
    }
  });
  float* o = out.data_ptr<float>();
  at::parallel_for(0, batch * heads, grain_for(L.dv * r), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / heads;
      latent_merge(L, parts + b * chunks * part_floats, wp, i % heads, latents + i * r,
                   o + i * L.dv);
    }
  });
  if (!all_finite(o, out.numel())) return at::empty({0}, query.options());
  return out;
}

// y (rows, out) = x (rows, in) @ w (out, in)^T + bias through the step's projection kernel
// (project): attnlab.matvec.linear's native face for a few rows outside the step (multi-head
// latent attention's projections, a call of several tokens). Every argument is checked as
// the step checks its own, before anything is read: float32, contiguous, on the CPU; bias
// empty or (out,). No rows give an empty (0, out). Values are not checked: a NaN or an
// infinity comes out as F.linear's would.
at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  constexpr const char* op = "linear_rows";
  check_device(w, "w", x, op);
  check_device(bias, "bias", x, op);
  check_float(x, "x", op);
  check_float(w, "w", op);
  TORCH_CHECK(x.dim() == 2, op, ": x must be (rows, in), got shape ", x.sizes());
  TORCH_CHECK(w.dim() == 2 && w.size(0) >= 1 && w.size(1) >= 1, op,
              ": w must be (out, in) with out >= 1 and in >= 1, got shape ", w.sizes());
  TORCH_CHECK(x.size(1) == w.size(1), op, ": x's last dimension (", x.size(1),
              ") must be w's in (", w.size(1), ")");
  check_bias(bias, "bias", w.size(0), op);
  auto y = at::empty({x.size(0), w.size(0)}, x.options());  // (rows, out)
  if (x.size(0) == 0) return y;
  project(x.data_ptr<float>(), x.size(0), x.size(1), w.data_ptr<float>(),
          bias.numel() ? bias.data_ptr<float>() : nullptr, w.size(0), y.data_ptr<float>());
  return y;
}

}  // namespace

TORCH_LIBRARY(attnlab_decode, m) {
  m.def(
      "decode_step(Tensor x, Tensor w_qkv, Tensor b_qkv, Tensor w_out, Tensor b_out, "
      "Tensor cos, Tensor sin, Tensor q_norm, Tensor k_norm, Tensor(a!) keys_t, "
      "Tensor(b!) values_t, Tensor(c!) key_scales, Tensor(d!) value_scales, int heads, "
      "int position, int slot, int first, int count, int block, float scale, float norm_eps, "
      "float norm_offset) -> Tensor");
  m.impl("decode_step", c10::DispatchKey::CPU, TORCH_FN(decode_step));
}

// The same op bound directly for Python (attnlab.decode_cpu calls this face in eager mode):
// a call through torch.ops parses its 22 arguments against the schema (~2.5 us, as much as
// a tiny layer's whole step); pybind11 converts them in ~0.4 us. The checks are the op's
// own; the cache buffers' version counters are bumped as the dispatcher does for Tensor(a!)
// arguments, so that autograd still sees them written; errors carry the message without
// the C++ backtrace, as torch.ops gives them.
namespace {

void bump_version(const at::Tensor& written) {
  if (written.defined() && !written.is_inference()) torch::autograd::impl::bump_version(written);
}

at::Tensor decode_step_direct(const at::Tensor& x, const at::Tensor& w_qkv,
                              const at::Tensor& b_qkv, const at::Tensor& w_out,
                              const at::Tensor& b_out, const at::Tensor& cos,
                              const at::Tensor& sin, const at::Tensor& q_norm,
                              const at::Tensor& k_norm, at::Tensor keys_t, at::Tensor values_t,
                              at::Tensor key_scales, at::Tensor value_scales, int64_t heads,
                              int64_t position, int64_t slot, int64_t first, int64_t count,
                              int64_t block, double scale, double norm_eps,
                              double norm_offset) {
  try {
    auto out = decode_step(x, w_qkv, b_qkv, w_out, b_out, cos, sin, q_norm, k_norm, keys_t,
                           values_t, key_scales, value_scales, heads, position, slot, first,
                           count, block, scale, norm_eps, norm_offset);
    if (out.numel()) {
      for (const auto* written : {&keys_t, &values_t, &key_scales, &value_scales}) {
        bump_version(*written);
      }
    }
    return out;
  } catch (const c10::Error& error) {
    throw std::runtime_error(error.what_without_backtrace());
  }
}

at::Tensor linear_rows_direct(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  try {
    return linear_rows(x, w, bias);
  } catch (const c10::Error& error) {
    throw std::runtime_error(error.what_without_backtrace());
  }
}

at::Tensor latent_step_direct(const at::Tensor& query, const at::Tensor& compressed,
                              const at::Tensor& norm, double norm_eps, double norm_offset,
                              const at::Tensor& cos, const at::Tensor& sin, int64_t position,
                              at::Tensor rows, const at::Tensor& w, double scale) {
  try {
    auto out = latent_step(query, compressed, norm, norm_eps, norm_offset, cos, sin, position,
                           rows, w, scale);
    bump_version(rows);  // written, as the dispatcher marks a Tensor(a!) argument
    return out;
  } catch (const c10::Error& error) {
    throw std::runtime_error(error.what_without_backtrace());
  }
}

}  // namespace

// the call plan's lane (forward's one-token cached calls: the plan read in C++, then the op)
#include "decode_plan.h"
// multi-head latent attention's lane (its plan read in C++, then the whole step)
#include "latent_plan.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_step", &decode_step_direct, "attnlab_decode::decode_step, bound directly",
        py::arg("x"), py::arg("w_qkv"), py::arg("b_qkv"), py::arg("w_out"), py::arg("b_out"),
        py::arg("cos"), py::arg("sin"), py::arg("q_norm"), py::arg("k_norm"), py::arg("keys_t"),
        py::arg("values_t"), py::arg("key_scales"), py::arg("value_scales"), py::arg("heads"),
        py::arg("position"), py::arg("slot"), py::arg("first"), py::arg("count"),
        py::arg("block"), py::arg("scale"), py::arg("norm_eps"), py::arg("norm_offset"),
        py::call_guard<py::gil_scoped_release>());
  m.def("linear_rows", &linear_rows_direct,
        "x (rows, in) @ w (out, in)^T + bias (or empty) through the step's projection kernel",
        py::arg("x"), py::arg("w"), py::arg("bias"), py::call_guard<py::gil_scoped_release>());
  m.def("latent_step", &latent_step_direct,
        "multi-head latent attention's absorbed step: (b, heads, dv) before o_proj",
        py::arg("query"), py::arg("compressed"), py::arg("norm"), py::arg("norm_eps"),
        py::arg("norm_offset"), py::arg("cos"), py::arg("sin"), py::arg("position"),
        py::arg("rows"), py::arg("w"), py::arg("scale"), py::call_guard<py::gil_scoped_release>());
  m.def("bfloat16_products", [] { return kPairs<int8_t>; },
        "Whether an int8 or bfloat16 cache read by several query heads per key/value head "
        "multiplies in bfloat16 (AVX512_BF16), else float32");
  bind_plan(m);
  bind_latent_plan(m);
}
