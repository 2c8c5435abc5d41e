// Timing loops over the native decode step's kernels (scripts/decode_kernel_rates.py appends
// this file to a copy of src/attnlab/csrc/decode_step.cpp, whose anonymous namespace it
// reaches). Each loop runs on the calling thread and returns GFLOP per second.
#include <chrono>

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// A group of `groups` query heads attending to `keys` tokens of one key/value head, `rounds`
// times, each round on the next of `heads` heads' blocks (hd x keys keys, then as many
// values: rows (keys, hd) where decode_step.cpp defines ATTNLAB_VALUE_ROWS, else laid out as
// the keys; heads = 1: the same block every round, read from L2), with the op's prefetches:
// the block's values while its scores are summed, the next head's keys while its values are.
// This mirrors Attend::item's loop over blocks of query heads rather than calling it, so that
// --baseline also builds versions of decode_step.cpp from before a refactor of that loop.
double attention(int64_t groups, int64_t keys, int64_t heads, int64_t rounds) {
  const int64_t hd = 64, span = hd * keys;
  std::vector<float> k(heads * span, 0.01f), v(heads * span, 0.02f), q(groups * hd, 0.5f);
  std::vector<float> scores(groups * keys, 0.1f), out(groups * (hd + 2), 0.0f);
  Prefetcher ahead;
#if defined(ATTNLAB_SCORE_BOUNDS)  // the scores scaled and bounded as they are stored
  std::vector<Vec> bounds(2 * groups);
#endif
#if defined(ATTNLAB_TICK_EVERY)  // a tick per tick_every<G>() rows read
  auto ticked = [](auto G, int64_t rows) { return ticks_over<decltype(G)::value>(rows); };
#else  // a tick per row
  auto ticked = [](auto, int64_t rows) { return rows; };
#endif
  auto score_ticks = [&] {
    int64_t ticks = 0;
    for (int64_t i = 0; i < groups; i += kGroupBlock) {
      with_group_block(groups - i, [&](auto G) {
        ticks += ticked(G, hd) * std::max<int64_t>(1, keys / (key_vectors<decltype(G)::value>() * Vec::size()));
      });
    }
    return ticks;
  }();
  auto value_ticks = [&] {
    int64_t ticks = 0;
    for (int64_t i = 0; i < groups; i += kGroupBlock) {
      with_group_block(groups - i, [&](auto G) {
#if defined(ATTNLAB_VALUE_ROWS)
        ticks += ticked(G, keys) * row_value_calls<decltype(G)::value>(hd);
#else
        ticks += hd / value_rows<decltype(G)::value>() * std::max<int64_t>(1, keys / Vec::size());
#endif
      });
    }
    return ticks;
  }();
  const auto start = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < rounds; ++r) {
    const float* k_head = k.data() + (r % heads) * span;
    const float* v_head = v.data() + (r % heads) * span;
    ahead.start(v_head, heads > 1 ? span : 0, score_ticks);
    for (int64_t i = 0; i < groups; i += kGroupBlock) {
      with_group_block(groups - i, [&](auto G) {
#if defined(ATTNLAB_SCORE_BOUNDS)
        const ScoreBounds to{0.125f, nullptr, bounds.data() + i, bounds.data() + groups + i};
        grouped_scores<decltype(G)::value>(q.data() + i * hd, hd, k_head, keys, keys,
                                scores.data() + i * keys, keys, to, ahead);
#else
        grouped_scores<decltype(G)::value>(q.data() + i * hd, hd, k_head, keys, keys,
                                scores.data() + i * keys, keys, ahead);
#endif
      });
    }
    ahead.start(k.data() + ((r + 1) % heads) * span, heads > 1 ? span : 0, value_ticks);
    for (int64_t i = 0; i < groups; i += kGroupBlock) {
      with_group_block(groups - i, [&](auto G) {
#if defined(ATTNLAB_VALUE_ROWS)  // the values as rows (keys, hd), from 2026-11-27 on
        all_row_values<decltype(G)::value>(scores.data() + i * keys, keys, v_head, hd, keys,
                                           out.data() + i * (hd + 2), hd + 2, ahead);
#else  // before: the values laid out as the keys, (hd, keys)
        constexpr int R = value_rows<decltype(G)::value>();
        for (int64_t d = 0; d < hd; d += R) {
          grouped_values<decltype(G)::value>(scores.data() + i * keys, keys, v_head + d * keys, keys, keys,
                                  out.data() + i * (hd + 2) + d, hd + 2, ahead);
        }
#endif
      });
    }
  }
  return 4.0 * groups * hd * keys * rounds / seconds_since(start) / 1e9;
}

// The projection of `rows` tokens through (out, in) weights, `rounds` times, each round on
// the next of `copies` copies of the weights.
double projection(int64_t rows, int64_t in, int64_t out, int64_t copies, int64_t rounds) {
  std::vector<float> w(copies * out * in, 0.01f), x(rows * in, 0.5f), y(rows * out);
  const auto start = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < rounds; ++r) {
    project(x.data(), rows, in, w.data() + (r % copies) * out * in, nullptr, out, y.data());
  }
  return 2.0 * rows * in * out * rounds / seconds_since(start) / 1e9;
}

#if defined(ATTNLAB_BF16_PRODUCTS) && defined(ATTNLAB_EACH_BLOCK)
// attention's loop over an int8 cache with the bfloat16 products (versions of
// decode_step.cpp from 2026-11-27 late on, built with AVX512_BF16): the queries rounded once,
// the weights rounded as the op rounds them, in the op's blocks of query heads
// (Attend::each_block), with its prefetches; the keys' scales 1.
double attention_int8(int64_t groups, int64_t keys, int64_t heads, int64_t rounds) {
  const int64_t hd = 64, span = hd * keys;
  std::vector<int8_t> k(heads * span), v(heads * span);
  for (int64_t i = 0; i < heads * span; ++i) {
    k[i] = static_cast<int8_t>(i % 7 - 3), v[i] = static_cast<int8_t>(i % 5 - 2);
  }
  std::vector<float> q(groups * hd, 0.05f), scores(groups * keys, 0.1f), out(groups * (hd + 2));
  std::vector<float> key_scales(keys, 1.0f);
  std::vector<uint16_t> q_words(groups * (hd + 1)), p_words(groups * (keys + 1));
  for (int64_t i = 0; i < groups; ++i) to_bfloat16(q.data() + i * hd, hd, q_words.data() + i * (hd + 1));
  for (int64_t i = 0; i < groups; ++i) {
    to_bfloat16(scores.data() + i * keys, keys, p_words.data() + i * (keys + 1));
  }
  std::vector<Vec> bounds(2 * groups);
  Prefetcher ahead;
  int64_t score_ticks = 0, value_ticks = 0;
  Attend::each_block<int8_t>(groups, true, [&](int64_t, auto G) {
    constexpr int G_ = decltype(G)::value;
    score_ticks += ticks_over<G_>(hd) * std::max<int64_t>(1, keys / (key_vectors<G_>() * Vec::size()));
    value_ticks += ticks_over<G_>(keys) * row_value_calls<G_>(hd);
  });
  const auto start = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < rounds; ++r) {
    const int8_t* k_head = k.data() + (r % heads) * span;
    const int8_t* v_head = v.data() + (r % heads) * span;
    ahead.start(v_head, heads > 1 ? span : 0, score_ticks);
    Attend::each_block<int8_t>(groups, true, [&](int64_t i, auto G) {
      const ScoreBounds to{0.125f, key_scales.data(), bounds.data() + i, bounds.data() + groups + i};
      pair_scores<decltype(G)::value>(q_words.data() + i * (hd + 1), hd + 1, hd, k_head, keys,
                                      keys, scores.data() + i * keys, keys, to, ahead);
    });
    ahead.start(k.data() + ((r + 1) % heads) * span, heads > 1 ? span : 0, value_ticks);
    Attend::each_block<int8_t>(groups, true, [&](int64_t i, auto G) {
      all_pair_values<decltype(G)::value>(p_words.data() + i * (keys + 1), keys + 1, v_head, hd,
                                          keys, out.data() + i * (hd + 2), hd + 2, ahead);
    });
  }
  return 4.0 * groups * hd * keys * rounds / seconds_since(start) / 1e9;
}
#endif

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attention", &attention, py::call_guard<py::gil_scoped_release>());
#if defined(ATTNLAB_BF16_PRODUCTS) && defined(ATTNLAB_EACH_BLOCK)
  m.def("attention_int8", &attention_int8, py::call_guard<py::gil_scoped_release>());
#endif
  m.def("projection", &projection, py::call_guard<py::gil_scoped_release>());
}
