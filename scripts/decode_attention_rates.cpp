// Timing loops over the native decode step's attention as the op runs it, and over the read
// patterns it is measured against (scripts/decode_attention_rates.py appends this file to a
// copy of src/attnlab/csrc/decode_step.cpp, whose anonymous namespace it reaches).
#include <chrono>
#include <thread>

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The op's Attend over one layer's float32 cache (keys_t, values_t: (b, hkv, hd * capacity)
// as KVCache lays them out for the native step, in blocks of `block` tokens) for the queries
// in qkv (b, d_qkv: queries, keys, values), attending to tokens [0, count) and storing the
// token's key and value in slot `count`; partial must hold (b, heads, chunks, hd + 2).
Attend attend_of(const at::Tensor& qkv, const at::Tensor& keys_t, int64_t heads, int64_t count,
                 int64_t block, at::Tensor& partial) {
  const int64_t batch = qkv.size(0), kv_heads = keys_t.size(1);
  const int64_t d_qkv = qkv.size(1), hd = d_qkv / (heads + 2 * kv_heads);
  const int64_t cap = keys_t.size(2) / hd;
  TORCH_CHECK(cap > count, "the cache must hold a slot past the tokens attended to");
  const int64_t chunk = chunk_keys(batch, heads, kv_heads, count, at::get_num_threads());
  const int64_t chunks = (count + chunk - 1) / chunk;
  partial = at::empty({batch * heads * chunks * (hd + 2)});
  return Attend{qkv.data_ptr<float>(), d_qkv, heads, kv_heads, hd, cap, block, 0, count,
                chunk, chunks, 1.0f / std::sqrt(static_cast<float>(hd)),
                partial.data_ptr<float>()};
}

// The heads' outputs (b, heads * hd) of one call over layer 0's cache.
at::Tensor attend(const at::Tensor& qkv, const at::Tensor& keys_t, at::Tensor values_t,
                  int64_t heads, int64_t count, int64_t block) {
  at::Tensor partial, keys = keys_t, none = at::empty({0});
  const Attend a = attend_of(qkv, keys_t, heads, count, block, partial);
  at::Tensor out = at::empty({qkv.size(0), heads * a.hd});
  append_and_attend<float>(a, qkv.size(0), keys, values_t, none, none, count,
                           out.data_ptr<float>());
  return out;
}

// GFLOP per second of `rounds` calls of step (one decoding step's attention over every
// layer), after one call to warm up; `flops` per call.
template <typename F>
double rate_of(F&& step, int64_t rounds, double flops) {
  step();
  const auto start = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < rounds; ++r) step();
  return flops * static_cast<double>(rounds) / seconds_since(start) / 1e9;
}

// share(t) for every t < threads, on as many std::threads (t = 0 on the calling one).
template <typename F>
void on_threads(int64_t threads, F&& share) {
  std::vector<std::thread> workers;
  for (int64_t t = 1; t < threads; ++t) workers.emplace_back(share, t);
  share(0);
  for (auto& worker : workers) worker.join();
}

// GFLOP per second of `rounds` calls per layer, the layers' caches taken in turn (one
// decoding step's attention per round, as the stack runs it).
double attention(const at::Tensor& qkv, std::vector<at::Tensor> keys,
                 std::vector<at::Tensor> values, int64_t heads, int64_t count, int64_t block,
                 int64_t rounds) {
  at::Tensor partial, none = at::empty({0});
  const Attend a = attend_of(qkv, keys[0], heads, count, block, partial);
  at::Tensor out = at::empty({qkv.size(0), heads * a.hd});
  auto step = [&] {
    for (size_t l = 0; l < keys.size(); ++l) {
      append_and_attend<float>(a, qkv.size(0), keys[l], values[l], none, none, count,
                               out.data_ptr<float>());
    }
  };
  return rate_of(step, rounds, 4.0 * heads * a.hd * count * qkv.size(0) * keys.size());
}

// As attention, without the parallel regions and the merge: the layers' work items walked on
// `threads` std::threads, each its share of every layer's items in turn (as at::parallel_for
// splits them), with Attend::item's prefetches, softmax and set-up.
double attention_items(const at::Tensor& qkv, std::vector<at::Tensor> keys,
                       std::vector<at::Tensor> values, int64_t heads, int64_t count,
                       int64_t block, int64_t rounds, int64_t threads) {
  at::Tensor partial;
  const Attend a = attend_of(qkv, keys[0], heads, count, block, partial);
  const int64_t items = qkv.size(0) * a.kv_heads * a.chunks, groups = heads / a.kv_heads;
  auto share = [&](int64_t t) {
    std::vector<float> scores(groups * a.chunk);
    std::vector<Vec> bounds(2 * groups);
    std::vector<uint16_t> words;  // float32 caches take no bfloat16 products
    const int64_t begin = t * items / threads, end = (t + 1) * items / threads;
    for (size_t l = 0; l < keys.size(); ++l) {
      float* k = keys[l].data_ptr<float>();
      float* v = values[l].data_ptr<float>();
      for (int64_t i = begin; i < end; ++i) {
        a.item<float>(i, k, v, nullptr, nullptr, -1, i + 1 < end ? i + 1 : -1, i == begin,
                      scores, bounds, words);
      }
    }
  };
  const double flops = 4.0 * heads * a.hd * count * qkv.size(0) * keys.size();
  return rate_of([&] { on_threads(threads, share); }, rounds, flops);
}

// A multi-query tile's arithmetic on one row of 64 float32 (256 bytes, 4 lines): 6 query
// heads' multiply-adds with its 4 vectors (the op's blocks of 6 heads, 24 sums in registers).
inline void six_heads(const float* row, __m512* sums, const float* q) {
  const __m512 x0 = _mm512_loadu_ps(row), x1 = _mm512_loadu_ps(row + 16);
  const __m512 x2 = _mm512_loadu_ps(row + 32), x3 = _mm512_loadu_ps(row + 48);
  ATTNLAB_UNROLL
  for (int i = 0; i < 6; ++i) {
    const __m512 b = _mm512_set1_ps(q[i]);
    sums[4 * i] = _mm512_fmadd_ps(b, x0, sums[4 * i]);
    sums[4 * i + 1] = _mm512_fmadd_ps(b, x1, sums[4 * i + 1]);
    sums[4 * i + 2] = _mm512_fmadd_ps(b, x2, sums[4 * i + 2]);
    sums[4 * i + 3] = _mm512_fmadd_ps(b, x3, sums[4 * i + 3]);
  }
}

constexpr int64_t kTileRows = 64;  // a tile: 64 rows, 16 KiB (a multi-query key block of 64)

// The lines of `next` (a tile) prefetched 2 per row visited: a tile's two passes visit 128
// rows, so the next tile is fetched once over both.
inline void two_lines(const char* next, int64_t& line) {
  _mm_prefetch(next + line * 64, _MM_HINT_T1);
  _mm_prefetch(next + line * 64 + 64, _MM_HINT_T1);
  line += 2;
}

// The one pass over keys the registers allow for a multi-query head's 12 query heads: one
// tile of 32 keys stored feature-major (64 rows of 32 floats, 8 KiB), 2 vectors of keys a
// row against all 12 heads, their 24 sums in registers, stored to out (heads out_stride
// apart) at the end. Fixed: each head's multiplier the same number for every row and known
// when this is compiled, as in patterns 0 to 6 (the compiler folds them into the
// multiply-adds' operands); else q[i * 64 + d], a broadcast per head and row as the op's
// kernels load them.
template <bool Fixed>
__attribute__((noinline)) void tile_of_keys(const float* q, const float* tile, float* out,
                                            int64_t out_stride) {
  float fixed[12];
  for (int i = 0; i < 12; ++i) fixed[i] = 0.001f * static_cast<float>(i);
  __m512 sums[12][2];
  for (auto& head : sums) head[0] = head[1] = _mm512_setzero_ps();
  for (int64_t d = 0; d < 64; ++d) {
    const __m512 k0 = _mm512_loadu_ps(tile + d * 32), k1 = _mm512_loadu_ps(tile + d * 32 + 16);
    ATTNLAB_UNROLL
    for (int i = 0; i < 12; ++i) {
      const __m512 b = _mm512_set1_ps(Fixed ? fixed[i] : q[i * 64 + d]);
      sums[i][0] = _mm512_fmadd_ps(b, k0, sums[i][0]);
      sums[i][1] = _mm512_fmadd_ps(b, k1, sums[i][1]);
    }
  }
  for (int i = 0; i < 12; ++i) {
    _mm512_storeu_ps(out + out_stride * i, sums[i][0]);
    _mm512_storeu_ps(out + out_stride * i + 16, sums[i][1]);
  }
}

// Reads `bytes` at buf with 12 query heads' multiply-adds per row (6 FLOP per byte, as
// multi-query attention over a float32 cache does), in one of these patterns:
// 0: one stream, each row's 12 heads at once (the second 6 from L1), no prefetch;
// 1: tiles, two passes of 6 heads over each (the second from L1), no prefetch;
// 2: tiles, two passes, the next tile prefetched over both;
// 3: as 2, in work items: 8 tiles from the first half of the buffer (keys), then 8 from the
//    second (values), the next tile in that order prefetched;
// 4: as 3, the next tile prefetched in the first pass alone, 16 lines per 4 rows;
// 5: blocks of 256 rows of 256 bytes (64 KiB) read as the op reads a block of 256 keys: in
//    4 strips of 64 rows 1 KiB apart, each strip's 256 bytes of a row, two passes per strip,
//    the next block prefetched over the block's 512 row visits;
// 6: the op's work item (Attend::item) without its softmax: 512 keys in 2 blocks of 256 as 5
//    reads them, but each block of 6 heads over the whole block (the second from L2), the
//    next block prefetched over both blocks of heads and the values' first block over the
//    whole of the keys; then 512 value rows in 2 blocks of 256, each block of heads over
//    the whole block, the next block, and over all of them the next item's keys;
// 7: 6 with the op's kernels (op_kernels_rate); 8: 7 on the op's threads (at::parallel_for);
// 9 to 11: tile_rate's. Patterns 0 to 6 multiply every row by the same 12 numbers, known
// when this is compiled. Returns bytes per second.
double pattern_rate(int pattern, const float* buf, int64_t bytes) {
  __m512 sums[24];
  for (auto& s : sums) s = _mm512_setzero_ps();
  float q[12];
  for (int i = 0; i < 12; ++i) q[i] = 0.001f * static_cast<float>(i);
  const int64_t rows = bytes / 256, half = rows / 2, tiles = rows / kTileRows;
  const char* base = reinterpret_cast<const char*>(buf);
  auto item_tile = [&](int64_t k) {  // patterns 3, 4: tile k's first row in item order
    const int64_t item = k / 16, j = k % 16;
    return j < 8 ? item * 512 + j * kTileRows : half + item * 512 + (j - 8) * kTileRows;
  };
  const auto start = std::chrono::steady_clock::now();
  if (pattern == 6) {
    // per item: keys at item * 512 (rows of 256 bytes: 2 blocks of 256), values at half + ...
    auto stream_start = [](PrefetchStream& p, const char* first, int64_t lines, int64_t ticks) {
      p.start(first, lines * 64, ticks);  // `lines` lines of 64 bytes
    };
    PrefetchStream near, far;
    auto tick = [&] { near.tick(), far.tick(); };
    const int64_t items = half / 512;
    for (int64_t item = 0; item < items; ++item) {
      const int64_t k0 = item * 512, v0 = half + item * 512;
      const int64_t next_k0 = item + 1 < items ? k0 + 512 : 0;
      stream_start(far, base + v0 * 256, 1024, 2 * 2 * 4 * 16);  // values' first block
      for (int64_t blk = 0; blk < 2; ++blk) {
        const int64_t b0 = k0 + blk * 256;
        stream_start(near, blk == 0 ? base + (b0 + 256) * 256 : nullptr, blk == 0 ? 1024 : 0,
                     2 * 4 * 16);
        for (int pass = 0; pass < 2; ++pass) {
          for (int64_t strip = 0; strip < 4; ++strip) {
            for (int64_t r = 0; r < 64; ++r) {
              if (r % 4 == 0) tick();
              six_heads(buf + (b0 + r * 4 + strip) * 64, sums, q + 6 * pass);
            }
          }
        }
      }
      stream_start(far, base + next_k0 * 256, 1024, 2 * 2 * 64);  // the next item's keys
      for (int64_t blk = 0; blk < 2; ++blk) {
        const int64_t b0 = v0 + blk * 256;
        stream_start(near, blk == 0 ? base + (b0 + 256) * 256 : nullptr, blk == 0 ? 1024 : 0,
                     2 * 64);
        for (int pass = 0; pass < 2; ++pass) {
          for (int64_t r = 0; r < 256; ++r) {
            if (r % 4 == 0) tick();
            six_heads(buf + (b0 + r) * 64, sums, q + 6 * pass);
          }
        }
      }
    }
  } else if (pattern == 5) {
    for (int64_t b0 = 0; b0 + 256 <= rows; b0 += 256) {
      const char* next = base + (b0 + 256 < rows ? b0 + 256 : 0) * 256;
      int64_t line = 0;
      for (int64_t strip = 0; strip < 4; ++strip) {
        for (int pass = 0; pass < 2; ++pass) {
          for (int64_t r = 0; r < 64; ++r) {
            two_lines(next, line);
            six_heads(buf + (b0 + r * 4 + strip) * 64, sums, q + 6 * pass);
          }
        }
      }
    }
  } else if (pattern == 0) {
    for (int64_t r = 0; r < rows; ++r) {
      six_heads(buf + r * 64, sums, q);
      six_heads(buf + r * 64, sums, q + 6);
    }
  } else {
    for (int64_t k = 0; k < tiles; ++k) {
      const int64_t r0 = pattern >= 3 ? item_tile(k) : k * kTileRows;
      const int64_t after = k + 1 < tiles ? (pattern >= 3 ? item_tile(k + 1) : r0 + kTileRows) : 0;
      const char* next = base + after * 256;
      int64_t line = 0;
      for (int pass = 0; pass < 2; ++pass) {
        for (int64_t r = r0; r < r0 + kTileRows; ++r) {
          if (pattern == 2 || pattern == 3) two_lines(next, line);
          if (pattern == 4 && r % 4 == 0 && line < 256) {
            for (int z = 0; z < 16; ++z) _mm_prefetch(next + (line + z) * 64, _MM_HINT_T1);
            line += 16;
          }
          six_heads(buf + r * 64, sums, q + 6 * pass);
        }
      }
    }
  }
  const double seconds = seconds_since(start);
  volatile float sink = 0;
  for (auto& s : sums) sink = sink + _mm512_reduce_add_ps(s);
  return static_cast<double>(rows * 256) / seconds;
}

// One stream of 8 KiB key tiles, each read once by all 12 heads (tile_of_keys): 9, each
// row's multipliers broadcast, the sums stored to 1.5 KiB that stay in L1; 10, 9 with the
// multipliers fixed as in patterns 0 to 6; 11, 9 with each tile's sums stored where the op's
// work item stores a block's scores, across 12 rows of 512 (24 KiB, 2 KiB apart: each tile
// writes lines the stream has evicted since). Returns bytes per second.
double tile_rate(int pattern, const float* buf, int64_t bytes) {
  std::vector<float> q(12 * 64, 0.01f), scores(12 * 512);
  const int64_t tiles = bytes / 8192;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t k = 0; k < tiles; ++k) {
    const float* tile = buf + k * 2048;
    if (pattern == 9) {
      tile_of_keys<false>(q.data(), tile, scores.data(), 32);
    } else if (pattern == 10) {
      tile_of_keys<true>(q.data(), tile, scores.data(), 32);
    } else {
      tile_of_keys<false>(q.data(), tile, scores.data() + (k % 16) * 32, 512);
    }
  }
  const double seconds = seconds_since(start);
  volatile float sink = 0;
  for (float x : scores) sink = sink + x;
  return static_cast<double>(tiles * 8192) / seconds;
}

// The op's kernels and prefetcher (grouped_scores, all_row_values, Prefetcher) on one
// multi-query work item, as Attend::item calls them for 12 query heads over 512 keys of 64
// features in 2 blocks of 256 (keys at k0 in the op's blocks, values as rows at v0), without
// the item's set-up and softmax; next_keys: where the next item's keys start.
struct ItemKernels {
  static constexpr int64_t hd = 64, keys = 512, block = 256, heads = 12, stride = 8 * (hd + 2);
  static constexpr int64_t block_floats = block * hd;
  static constexpr int64_t score_ticks = 2 * 4 * 16;  // per block: 2 blocks of heads, 4 x 16
  static constexpr int64_t value_ticks = 2 * 64;      // per block: 2 blocks of heads, 256 / 4
  std::vector<float> q = std::vector<float>(heads * hd, 0.01f);
  std::vector<float> scores = std::vector<float>(heads * keys);
  std::vector<float> out = std::vector<float>(heads * stride);
  std::vector<Vec> bounds = std::vector<Vec>(2 * heads, Vec(0.0f));
  Prefetcher ahead;

  void run(const float* k0, const float* v0, const float* next_keys) {
    const float* none = nullptr;
    ahead.start_far(v0, block_floats, 2 * score_ticks);  // the values' first block
    for (int64_t b = 0; b < keys / block; ++b) {
      const float* k = k0 + b * block_floats;
      ahead.start(b == 0 ? k + block_floats : none, b == 0 ? block_floats : 0, score_ticks);
      for (int64_t i = 0; i < heads; i += 6) {
        const ScoreBounds to{0.125f, nullptr, bounds.data() + i, bounds.data() + heads + i};
        grouped_scores<6>(q.data() + i * hd, hd, k, block, block,
                          scores.data() + i * keys + b * block, keys, to, ahead);
      }
    }
    ahead.start_far(next_keys, block_floats, 2 * value_ticks);
    for (int64_t b = 0; b < keys / block; ++b) {
      const float* v = v0 + b * block_floats;
      ahead.start(b == 0 ? v + block_floats : none, b == 0 ? block_floats : 0, value_ticks);
      for (int64_t i = 0; i < heads; i += 6) {
        all_row_values<6>(scores.data() + i * keys + b * block, keys, v, hd, block,
                          out.data() + i * stride, stride, ahead);
      }
    }
  }
};

// Pattern 6 with the op's kernels (ItemKernels): items of 512 keys from the first half of
// the buffer and 512 value rows from the second: bytes per second.
double op_kernels_rate(const float* buf, int64_t bytes) {
  const int64_t rows = bytes / 256, half = rows / 2, items = half / ItemKernels::keys;
  const int64_t item_floats = ItemKernels::keys * ItemKernels::hd;
  ItemKernels kernels;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t item = 0; item < items; ++item) {
    kernels.run(buf + item * item_floats, buf + half * 64 + item * item_floats,
                buf + (item + 1 < items ? item + 1 : 0) * item_floats);
  }
  return static_cast<double>(rows * 256) / seconds_since(start);
}

// ItemKernels over the layers' own multi-query caches (one key/value head, blocks of 256,
// contexts a multiple of 512: every item whole), each layer's items split over `threads`
// std::threads as at::parallel_for splits them: GFLOP per second. Without the items'
// set-up, softmax and merge, beside attention_items.
double kernels_alone(std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                     int64_t count, int64_t rounds, int64_t threads) {
  const int64_t batch = keys[0].size(0), hd = ItemKernels::hd, chunk = ItemKernels::keys;
  const int64_t cap = keys[0].size(2) / hd, chunks = count / chunk, items = batch * chunks;
  TORCH_CHECK(keys[0].size(1) == 1 && count % chunk == 0 && count >= chunk,
              "kernels_alone takes one key/value head and a multiple of 512 keys");
  auto share = [&](int64_t t) {
    ItemKernels kernels;
    const int64_t begin = t * items / threads, end = (t + 1) * items / threads;
    auto at = [&](const at::Tensor& buffer, int64_t i) {  // item i's first key or value row
      return buffer.data_ptr<float>() + (i / chunks) * hd * cap + (i % chunks) * chunk * hd;
    };
    for (size_t l = 0; l < keys.size(); ++l) {
      for (int64_t i = begin; i < end; ++i) {
        kernels.run(at(keys[l], i), at(values[l], i), at(keys[l], i + 1 < end ? i + 1 : i));
      }
    }
  };
  const double flops = 4.0 * ItemKernels::heads * hd * count * batch * keys.size();
  return rate_of([&] { on_threads(threads, share); }, rounds, flops);
}

// The sum of `threads` concurrent pattern_rate runs' bytes per second, each over its own
// buffer of `bytes`.
double patterns(int64_t pattern, int64_t threads, int64_t bytes) {
  std::vector<std::vector<float>> buffers(threads, std::vector<float>(bytes / 4, 0.5f));
  std::vector<double> rates(threads);
  auto share = [&](int64_t t) {
    if (pattern >= 9) {
      rates[t] = tile_rate(static_cast<int>(pattern), buffers[t].data(), bytes);
    } else if (pattern >= 7) {
      rates[t] = op_kernels_rate(buffers[t].data(), bytes);
    } else {
      rates[t] = pattern_rate(static_cast<int>(pattern), buffers[t].data(), bytes);
    }
  };
  if (pattern == 8) {  // pattern 7 on the op's threads (at::parallel_for)
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) share(t);
    });
  } else {
    on_threads(threads, share);
  }
  double total = 0;
  for (double rate : rates) total += rate;
  return total;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend);
  m.def("attention", &attention, py::call_guard<py::gil_scoped_release>());
  m.def("attention_items", &attention_items, py::call_guard<py::gil_scoped_release>());
  m.def("kernels_alone", &kernels_alone, py::call_guard<py::gil_scoped_release>());
  m.def("patterns", &patterns, py::call_guard<py::gil_scoped_release>());
}
