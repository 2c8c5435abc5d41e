// Causal flash attention for the CPU (float32), forward and backward, attnlab's "auto" backend.
//
// The online-softmax algorithm of FlashAttention-2: each task takes one block of query rows
// of one head, walks the key blocks it may see, and keeps a running max, sum and weighted
// value sum, so no tokens x tokens matrix is ever stored. What differs from PyTorch's CPU
// kernel is where the causal work stops: a query block reads keys only up to its own last
// row (PyTorch's reads whole 512-key blocks past the diagonal), so the work done is the
// causal half plus one small triangle per query block.
//
// Matrix products are BLAS sgemm calls (column-major; the row-major blocks are passed as
// their transposes). Fully masked rows give zeros and a logsumexp of 0 (PyTorch's flash
// convention); the backward (causal_flash_backward, below) recomputes each tile's
// probabilities from that logsumexp, over the same causal cut.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc);
// MKL only (weak: absent elsewhere): one thread inside our own parallel region.
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// C (rows x cols, row-major, leading dimension ldc) = alpha * A @ op(B) + beta * C, all
// row-major, expressed as the column-major product C^T = op(B)^T A^T.
// With a_transposed, A is stored (inner x rows) and op(A) is its transpose; likewise B.
void gemm_rowmajor(bool a_transposed, bool b_transposed, int rows, int cols, int inner,
                   float alpha, const float* a, int lda, const float* b, int ldb, float beta,
                   float* c, int ldc) {
  const char trans_a = a_transposed ? 'T' : 'N';
  const char trans_b = b_transposed ? 'T' : 'N';
  sgemm_(&trans_b, &trans_a, &cols, &rows, &inner, &alpha, b, &ldb, a, &lda, &beta, c, &ldc);
}

void gemm_rowmajor(bool b_transposed, int rows, int cols, int inner, float alpha, const float* a,
                   int lda, const float* b, int ldb, float beta, float* c, int ldc) {
  gemm_rowmajor(false, b_transposed, rows, cols, inner, alpha, a, lda, b, ldb, beta, c, ldc);
}

// row <- row (+ bias), columns past `last` (inclusive bound) set to -inf; returns the max.
// The scale is already applied by the product that wrote the row.
float mask_max(float* row, int cols, const float* bias, int64_t bias_stride, int last) {
  const int open = std::max(0, std::min(cols, last + 1));
  Vec vmax(kNegInf);
  int j = 0;
  if (bias == nullptr) {
    for (; j + Vec::size() <= open; j += Vec::size()) {
      vmax = at::vec::maximum(vmax, Vec::loadu(row + j));
    }
  } else if (bias_stride == 1) {
    for (; j + Vec::size() <= open; j += Vec::size()) {
      const Vec s = Vec::loadu(row + j) + Vec::loadu(bias + j);
      s.store(row + j);
      vmax = at::vec::maximum(vmax, s);
    }
  }
  float row_max = at::vec::vec_reduce_all<float>(
      [](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, vmax);
  for (; j < open; ++j) {
    if (bias != nullptr) row[j] += bias[j * bias_stride];
    row_max = std::max(row_max, row[j]);
  }
  std::fill(row + open, row + cols, kNegInf);
  return row_max;
}

// row <- exp(row - max); returns the sum (vectorised exp of ATen).
float exp_sum(float* row, int cols, float row_max) {
  const Vec vmax(row_max);
  Vec vsum(0.0f);
  int j = 0;
  for (; j + Vec::size() <= cols; j += Vec::size()) {
    Vec e = (Vec::loadu(row + j) - vmax).exp_u20();
    e.store(row + j);
    vsum += e;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, vsum);
  for (; j < cols; ++j) {
    row[j] = std::exp(row[j] - row_max);
    sum += row[j];
  }
  return sum;
}

struct Strides {
  int64_t b, h, t;  // batch, head, token; features are contiguous
};

Strides strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// One query block of one head: its rows, the keys and values of its key/value head, the
// mask rows, and the running softmax state (max, sum, weighted values) of every row.
struct QueryBlock {
  const float* q;  // first row; rows q_stride apart
  int64_t q_stride;
  const float* k;  // key 0 of the head; keys kv_stride apart
  int64_t k_stride;
  const float* v;
  int64_t v_stride;
  const float* mask;  // bias row of the first query (null: none); rows mask_row apart
  int64_t mask_row, mask_key;
  int64_t dim;
  float scale;
  float* scores;  // scratch, rows x kv_split
  float* acc;     // rows x dim
  float* row_max;
  float* row_sum;

  // Rows [r0, r0 + rows) against keys [n, n + cols); row r sees keys up to key index
  // last0 + (r - r0) (inclusive; pass a large value for no causal cut).
  void tile(int64_t r0, int rows, int64_t n, int cols, int64_t last0) {
    float* s = scores;
    gemm_rowmajor(true, rows, cols, static_cast<int>(dim), scale, q + r0 * q_stride,
                  static_cast<int>(q_stride), k + n * k_stride, static_cast<int>(k_stride), 0.0f,
                  s, cols);  // (rows, cols) = scale * q_rows @ k_block^T
    for (int r = 0; r < rows; ++r) {
      float* row = s + r * cols;
      const int64_t last = std::min<int64_t>(last0 + r - n, cols - 1);
      const float* bias = mask ? mask + (r0 + r) * mask_row + n * mask_key : nullptr;
      const float block_max = mask_max(row, cols, bias, mask_key, static_cast<int>(last));
      const float new_max = std::max(row_max[r0 + r], block_max);
      if (new_max == kNegInf) {  // nothing visible yet in this row
        std::fill(row, row + cols, 0.0f);
        continue;
      }
      const float sum = exp_sum(row, cols, new_max);
      const float correction = std::exp(row_max[r0 + r] - new_max);
      row_sum[r0 + r] = row_sum[r0 + r] * correction + sum;
      row_max[r0 + r] = new_max;
      if (correction != 1.0f) {
        float* acc_row = acc + (r0 + r) * dim;
        at::vec::map<float>([correction](Vec x) { return x * Vec(correction); }, acc_row,
                            acc_row, dim);
      }
    }
    gemm_rowmajor(false, rows, static_cast<int>(dim), cols, 1.0f, s, cols, v + n * v_stride,
                  static_cast<int>(v_stride), 1.0f, acc + r0 * dim,
                  static_cast<int>(dim));  // acc rows (rows, dim) += p (rows, cols) @ v_block
  }
};

}  // namespace

// The op's contract (attnlab.flash_cpu._Flash.forward makes its inputs conform; the checks
// below refuse every other input with a RuntimeError naming the argument, so that no call
// through torch.ops can crash the process, read out of bounds or reach BLAS's own checks):
//   q           float32 on the CPU, (b, hq, tq, d), d >= 1: features contiguous (stride 1),
//               tokens a stride in [d, INT_MAX] apart (BLAS's leading dimension); batch and
//               head strides anything (offsets only)
//   k, v        the same dtype, device and row layout, each (b, hkv, tk, d) (one shape), with
//               q's b and d; hkv >= 1 dividing hq (query head h reads key/value head
//               h / (hq / hkv))
//   mask        no elements and not 4-D (no mask), or an additive float32 mask on the CPU, 4-D
//               and broadcastable to (b, hq, tq, tk) (any strides; read through an expanded
//               view)
//   key_start,  both without elements (every sequence reads all tk keys), or both int64 on
//   key_end     the CPU, contiguous, (b,), with 0 <= key_start[i] <= key_end[i] <= tk
//   scale       > 0 and finite in float32 (at most FLT_MAX: functional.attention's contract)
//   causal      any
//   q_split     query rows per block, in [1, kMaxSplit]
//   kv_split    keys per block, in [1, kMaxSplit]
//   diag_split  diagonal rows per sub-block, in [1, kv_split] (the diagonal's tiles then fit
//               the q_split x kv_split scratch)
// Every tensor is on q's device, the empty ones included. The tensors are only read (the
// outputs are new), so they may share memory (q is k in self-attention).
// Causal masking is bottom-right aligned: query i sees keys up to i + tk - tq. With key
// ranges, sequence i reads only keys [key_start[i], key_end[i]) (a padded batch), with the
// same causal alignment; a query before its sequence's first key gets zeros. Query blocks of
// q_split rows read keys in blocks of kv_split; the keys on a block's diagonal are read in
// row sub-blocks of diag_split, so that little work past the diagonal is done. Returns the
// output as (b, hq, tq, d) stored (b, tq, hq, d), and the logsumexp (b, hq, tq).

namespace {

constexpr int64_t kMaxSplit = 4096;  // rows or keys per block: a scratch of at most 64 MiB

void check_qkv(const char* op, const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.dim() == 4, op, ": ", name,
              " must be 4-D (batch, heads, tokens, head_dim), got shape ", t.sizes());
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ",
              t.scalar_type());
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be on the CPU, got ", t.device());
  TORCH_CHECK(t.size(3) >= 1, op, ": ", name, "'s head_dim (", t.size(3), ") must be >= 1");
  TORCH_CHECK(t.stride(3) == 1, op, ": ", name,
              "'s features must be contiguous (stride(3) 1), got strides ", t.strides());
  // BLAS takes the token stride as its leading dimension: at least the row width, and an int.
  TORCH_CHECK(t.stride(2) >= t.size(3) && t.stride(2) <= std::numeric_limits<int>::max(), op,
              ": ", name, "'s token stride (", t.stride(2), ") must be in [head_dim (", t.size(3),
              "), INT_MAX]");
}

// Every tensor argument on q's device, an empty one (no mask, no key ranges) included: the
// dispatcher picks the kernel by all of them (a meta tensor among CPU ones reaches the fake
// kernel, attnlab.fake_ops, which refuses the call in the same words).
void check_device(const char* op, const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK(!t.defined() || !q.defined() || t.device() == q.device(), op, ": ", name,
              " is on ", t.device(), " but q is on ", q.device(),
              ": every tensor must be on one device");
}

// The scale is applied in float32: finite there (a double past FLT_MAX is inf once cast).
void check_scale(const char* op, double scale) {
  TORCH_CHECK(std::isfinite(scale) && scale > 0 && scale <= std::numeric_limits<float>::max(),
              op, ": scale (", scale, ") must be > 0 and finite in float32, the dtype the kernel "
              "computes in (at most ", std::numeric_limits<float>::max(), ")");
}

void check_range(const char* op, const at::Tensor& t, const char* name, int64_t batch) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.device().is_cpu() && t.dim() == 1 &&
                  t.size(0) == batch && t.is_contiguous(),
              op, ": ", name, " must be a contiguous int64 CPU tensor (batch ", batch,
              ",), got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
}

// The arguments both ops share, checked, and what the kernels read of them.
struct Call {
  int64_t batch, heads, tq, dim, kv_heads, tk, groups, offset;
  at::Tensor mask;  // undefined: none; else a (b, hq, tq, tk) view
  bool has_mask;
  const int64_t* range_start;  // null: every sequence reads all tk keys
  const int64_t* range_end;
};

Call check_call(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const at::Tensor& mask_in, const at::Tensor& key_start,
                const at::Tensor& key_end, double scale, int64_t q_split, int64_t kv_split,
                int64_t diag_split) {
  check_device(op, k, "k", q);
  check_device(op, v, "v", q);
  check_device(op, mask_in, "mask", q);
  check_device(op, key_start, "key_start", q);
  check_device(op, key_end, "key_end", q);
  check_qkv(op, q, "q");
  check_qkv(op, k, "k");
  check_qkv(op, v, "v");
  TORCH_CHECK(k.sizes() == v.sizes(), op, ": k ", k.sizes(), " and v ", v.sizes(),
              " must have the same shape");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(3) == q.size(3), op, ": k ", k.sizes(),
              " must have q's batch and head_dim, q is ", q.sizes());
  TORCH_CHECK(k.size(1) >= 1 && q.size(1) % k.size(1) == 0, op, ": k's heads (", k.size(1),
              ") must be >= 1 and divide q's heads (", q.size(1), ")");
  check_scale(op, scale);
  TORCH_CHECK(q_split >= 1 && q_split <= kMaxSplit, op, ": q_split (", q_split,
              ") must be in [1, ", kMaxSplit, "]");
  TORCH_CHECK(kv_split >= 1 && kv_split <= kMaxSplit, op, ": kv_split (", kv_split,
              ") must be in [1, ", kMaxSplit, "]");
  TORCH_CHECK(diag_split >= 1 && diag_split <= kv_split, op, ": diag_split (", diag_split,
              ") must be in [1, kv_split ", kv_split, "]");
  Call c;
  c.batch = q.size(0), c.heads = q.size(1), c.tq = q.size(2), c.dim = q.size(3);
  c.kv_heads = k.size(1), c.tk = k.size(2);
  c.groups = c.heads / c.kv_heads, c.offset = c.tk - c.tq;
  TORCH_CHECK(mask_in.defined(), op, ": mask is undefined");
  if (mask_in.dim() == 4) {
    TORCH_CHECK(mask_in.scalar_type() == at::kFloat && mask_in.device().is_cpu(), op,
                ": mask must be a float32 CPU tensor, got ", mask_in.scalar_type(), " on ",
                mask_in.device());
    const int64_t target[4] = {c.batch, c.heads, c.tq, c.tk};
    for (int64_t i = 0; i < 4; ++i) {
      TORCH_CHECK(mask_in.size(i) == target[i] || mask_in.size(i) == 1, op,
                  ": mask of shape ", mask_in.sizes(),
                  " does not broadcast to (b, hq, tq, tk) = ", at::IntArrayRef(target, 4));
    }
    c.mask = mask_in.expand({c.batch, c.heads, c.tq, c.tk});  // broadcast dimensions: stride 0
  } else {
    TORCH_CHECK(mask_in.numel() == 0, op, ": mask must be empty (no mask) or 4-D "
                "broadcastable to (b, hq, tq, tk), got shape ", mask_in.sizes());
  }
  c.has_mask = c.mask.defined() && c.mask.numel() > 0;
  TORCH_CHECK(key_start.defined() && key_end.defined(), op,
              ": key_start and key_end must be defined");
  const bool has_ranges = key_start.numel() > 0 || key_end.numel() > 0;
  c.range_start = c.range_end = nullptr;
  if (has_ranges) {
    check_range(op, key_start, "key_start", c.batch);
    check_range(op, key_end, "key_end", c.batch);
    const int64_t* starts = key_start.data_ptr<int64_t>();
    const int64_t* ends = key_end.data_ptr<int64_t>();
    for (int64_t i = 0; i < c.batch; ++i) {
      TORCH_CHECK(0 <= starts[i] && starts[i] <= ends[i] && ends[i] <= c.tk, op,
                  ": key range [key_start, key_end) = [", starts[i], ", ", ends[i],
                  ") of sequence ", i, " must satisfy 0 <= key_start <= key_end <= tk (", c.tk,
                  ")");
    }
    c.range_start = starts, c.range_end = ends;
  }
  return c;
}

}  // namespace

std::vector<at::Tensor> causal_flash_forward(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v, const at::Tensor& mask_in,
                                             const at::Tensor& key_start,
                                             const at::Tensor& key_end, double scale,
                                             bool causal, int64_t q_split, int64_t kv_split,
                                             int64_t diag_split) {
  const Call c = check_call("causal_flash_forward", q, k, v, mask_in, key_start, key_end, scale,
                            q_split, kv_split, diag_split);
  const int64_t batch = c.batch, heads = c.heads, tq = c.tq, dim = c.dim, tk = c.tk;
  const int64_t groups = c.groups, offset = c.offset;
  const at::Tensor& mask = c.mask;
  const bool has_mask = c.has_mask, has_ranges = c.range_start != nullptr;
  const int64_t* range_start = c.range_start;
  const int64_t* range_end = c.range_end;

  auto out = at::empty({batch, tq, heads, dim}, q.options()).transpose(1, 2);
  auto lse = at::empty({batch, heads, tq}, q.options());
  const Strides qs = strides_of(q), ks = strides_of(k), vs = strides_of(v), os = strides_of(out);
  const Strides ms = has_mask ? strides_of(mask) : Strides{0, 0, 0};
  const int64_t mask_key = has_mask ? mask.stride(3) : 0;
  const float* q_data = q.data_ptr<float>();
  const float* k_data = k.data_ptr<float>();
  const float* v_data = v.data_ptr<float>();
  const float* mask_data = has_mask ? mask.data_ptr<float>() : nullptr;
  float* out_data = out.data_ptr<float>();
  float* lse_data = lse.data_ptr<float>();
  const int64_t q_blocks = (tq + q_split - 1) / q_split;
  const int64_t no_cut = std::numeric_limits<int32_t>::max();

  at::parallel_for(0, batch * heads * q_blocks, 1, [&](int64_t begin, int64_t end) {
    const int mkl_threads = MKL_Set_Num_Threads_Local ? MKL_Set_Num_Threads_Local(1) : 0;
    std::vector<float> scores(q_split * kv_split), acc(q_split * dim);
    std::vector<float> row_max(q_split), row_sum(q_split);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t block = task % q_blocks, h = (task / q_blocks) % heads;
      const int64_t b = task / (q_blocks * heads), hk = h / groups;
      const int64_t m = block * q_split, rows = std::min(q_split, tq - m);
      // this sequence's keys: [k0, k0 + tk_b) of the tk (all of them without ranges)
      const int64_t k0 = has_ranges ? std::clamp<int64_t>(range_start[b], 0, tk) : 0;
      const int64_t tk_b = has_ranges ? std::clamp<int64_t>(range_end[b], k0, tk) - k0 : tk;
      QueryBlock qb{q_data + b * qs.b + h * qs.h + m * qs.t,
                    qs.t,
                    k_data + b * ks.b + hk * ks.h + k0 * ks.t,
                    ks.t,
                    v_data + b * vs.b + hk * vs.h + k0 * vs.t,
                    vs.t,
                    has_mask ? mask_data + b * ms.b + h * ms.h + m * ms.t + k0 * mask_key
                             : nullptr,
                    ms.t,
                    mask_key,
                    dim,
                    static_cast<float>(scale),
                    scores.data(),
                    acc.data(),
                    row_max.data(),
                    row_sum.data()};
      std::fill(row_max.begin(), row_max.begin() + rows, kNegInf);
      std::fill(row_sum.begin(), row_sum.begin() + rows, 0.0f);
      std::fill(acc.begin(), acc.begin() + rows * dim, 0.0f);
      // keys every row sees in full, then (causal) the diagonal band [shared, keys)
      const int64_t first_last = m + offset - k0;  // the first row's last visible key
      const int64_t keys = causal ? std::clamp<int64_t>(first_last + rows, 0, tk_b) : tk_b;
      const int64_t shared = causal ? std::clamp<int64_t>(first_last + 1, 0, keys) : keys;
      for (int64_t n = 0; n < shared; n += kv_split) {
        qb.tile(0, static_cast<int>(rows), n, static_cast<int>(std::min(kv_split, shared - n)),
                no_cut);
      }
      for (int64_t r = 0; r < rows && shared < keys; r += diag_split) {
        const int64_t sub = std::min(diag_split, rows - r);
        const int64_t sub_keys = std::clamp<int64_t>(first_last + r + sub, shared, keys);
        if (sub_keys > shared) {
          qb.tile(r, static_cast<int>(sub), shared, static_cast<int>(sub_keys - shared),
                  first_last + r);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const bool empty = row_sum[r] == 0.0f;
        const float inverse = empty ? 0.0f : 1.0f / row_sum[r];
        float* out_row = out_data + b * os.b + h * os.h + (m + r) * os.t;
        at::vec::map<float>([inverse](Vec x) { return x * Vec(inverse); }, out_row,
                            acc.data() + r * dim, dim);
        lse_data[(b * heads + h) * tq + m + r] = empty ? 0.0f : row_max[r] + std::log(row_sum[r]);
      }
    }
    if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(mkl_threads);
  });
  return {out, lse};
}

// The backward of causal_flash_forward (FlashAttention-2's): the probabilities of each tile
// are recomputed from the forward's logsumexp, P = exp(scale q k^T + bias - lse), and
//   dV += P^T dO,  dP = dO V^T,  dS = P * (dP - rowsum(dO * O)),
//   dK += scale dS^T Q,  dQ += scale dS K,
// so nothing of tokens x tokens is stored. A task owns one key/value head of one sequence
// (and, when there are fewer of those than threads, a share of its keys): it walks its key
// blocks, and for each, every query head of its group (read in place: no expanded keys or
// values) and the query rows that see the block, the diagonal band in sub-blocks of
// diag_split rows cut to the keys they see, so the work above the diagonal is skipped as in
// the forward. dK and dV of a block are summed over the group's heads where they are
// written; dQ is summed over key blocks in the output, or, for a task with a share of the
// keys, in a buffer of its own (tasks x q), added up at the end.
//
// The op's contract: q, k, v, mask, key_start, key_end, scale, causal and the splits as
// causal_flash_forward's (the call being differentiated), every tensor on q's device, and
//   grad_out,      float32 CPU, q's shape and row layout (features contiguous, token stride in
//   output         [d, INT_MAX]); output is what the forward returned for this call (named
//                  so: torch.compile takes an argument named `out` for an out= tensor)
//   lse            float32 CPU, contiguous, (b, hq, tq), what the forward returned
// Returns [dq (b, hq, tq, d), dk (b, hkv, tk, d), dv (b, hkv, tk, d)], contiguous. A row the
// forward gave zeros (no key visible) gets zero gradients, and gives none to the keys.

namespace {

// One (query rows x key block) tile of the backward, for one query head.
struct BackwardHead {
  const float* q;  // row 0 of the head; rows q_stride apart (likewise every pointer below)
  int64_t q_stride;
  const float* grad_out;
  int64_t go_stride;
  const float* lse;    // (tq,)
  const float* delta;  // (tq,): rowsum(dO * O)
  float* grad_q;       // rows dim apart
  const float* mask;   // row 0's bias at key 0 of the sequence (null: none)
  int64_t mask_row, mask_key;
};

struct BackwardTile {
  const float* k;  // key 0 of the sequence's keys of the kv head; keys kv_stride apart
  int64_t k_stride;
  const float* v;
  int64_t v_stride;
  float* grad_k;  // key 0, rows dim apart
  float* grad_v;
  int64_t dim;
  float scale;
  float* p;   // scratch rows x cols
  float* dp;  // scratch rows x cols

  // rows [r0, r0 + rows) of head `hd` against keys [n, n + cols); row r sees keys up to
  // key index last0 + (r - r0) (inclusive; a large value for no cut).
  void run(const BackwardHead& hd, int64_t r0, int rows, int64_t n, int cols, int64_t last0) {
    const int d = static_cast<int>(dim);
    // p = scale * q_rows @ k_block^T  (rows, cols)
    gemm_rowmajor(true, rows, cols, d, scale, hd.q + r0 * hd.q_stride,
                  static_cast<int>(hd.q_stride), k + n * k_stride, static_cast<int>(k_stride),
                  0.0f, p, cols);
    // dp = dO_rows @ v_block^T  (rows, cols)
    gemm_rowmajor(true, rows, cols, d, 1.0f, hd.grad_out + r0 * hd.go_stride,
                  static_cast<int>(hd.go_stride), v + n * v_stride, static_cast<int>(v_stride),
                  0.0f, dp, cols);
    for (int r = 0; r < rows; ++r) {
      float* prow = p + r * cols;
      float* dprow = dp + r * cols;
      const int64_t last = std::min<int64_t>(last0 + r - n, cols - 1);
      const int open = static_cast<int>(std::max<int64_t>(0, last + 1));
      const Vec lse(hd.lse[r0 + r]);
      const float delta = hd.delta[r0 + r];
      const Vec vdelta(delta);
      const float* bias =
          hd.mask ? hd.mask + (r0 + r) * hd.mask_row + n * hd.mask_key : nullptr;
      int j = 0;
      if (bias == nullptr || hd.mask_key == 1) {
        for (; j + Vec::size() <= open; j += Vec::size()) {
          Vec sc = Vec::loadu(prow + j);
          if (bias != nullptr) sc = sc + Vec::loadu(bias + j);
          const Vec pr = (sc - lse).exp_u20();
          pr.store(prow + j);
          (pr * (Vec::loadu(dprow + j) - vdelta)).store(dprow + j);
        }
      }
      const float row_lse = hd.lse[r0 + r];
      for (; j < open; ++j) {
        float sc = prow[j];
        if (bias != nullptr) sc += bias[j * hd.mask_key];
        const float pr = std::exp(sc - row_lse);
        prow[j] = pr;
        dprow[j] = pr * (dprow[j] - delta);
      }
      for (; j < cols; ++j) prow[j] = 0.0f, dprow[j] = 0.0f;  // past the cut
    }
    // dv_block += p^T @ dO_rows  (cols, dim)
    gemm_rowmajor(true, false, cols, d, rows, 1.0f, p, cols, hd.grad_out + r0 * hd.go_stride,
                  static_cast<int>(hd.go_stride), 1.0f, grad_v + n * dim, d);
    // dk_block += scale * ds^T @ q_rows  (cols, dim)
    gemm_rowmajor(true, false, cols, d, rows, scale, dp, cols, hd.q + r0 * hd.q_stride,
                  static_cast<int>(hd.q_stride), 1.0f, grad_k + n * dim, d);
    // dq_rows += scale * ds @ k_block  (rows, dim)
    gemm_rowmajor(false, false, rows, d, cols, scale, dp, cols, k + n * k_stride,
                  static_cast<int>(k_stride), 1.0f, hd.grad_q + r0 * dim, d);
  }
};

void check_like_q(const char* op, const at::Tensor& t, const char* name, const at::Tensor& q) {
  check_qkv(op, t, name);
  TORCH_CHECK(t.sizes() == q.sizes(), op, ": ", name, " ", t.sizes(), " must have q's shape ",
              q.sizes());
}

}  // namespace

std::vector<at::Tensor> causal_flash_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& output, const at::Tensor& lse, const at::Tensor& mask_in,
    const at::Tensor& key_start, const at::Tensor& key_end, double scale, bool causal,
    int64_t q_split, int64_t kv_split, int64_t diag_split) {
  const char* op = "causal_flash_backward";
  check_device(op, grad_out, "grad_out", q);
  check_device(op, output, "output", q);
  check_device(op, lse, "lse", q);
  const Call c = check_call(op, q, k, v, mask_in, key_start, key_end, scale, q_split, kv_split,
                            diag_split);
  check_like_q(op, grad_out, "grad_out", q);
  check_like_q(op, output, "output", q);
  TORCH_CHECK(lse.defined(), op, ": lse is undefined");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.device().is_cpu() && lse.dim() == 3 &&
                  lse.size(0) == c.batch && lse.size(1) == c.heads && lse.size(2) == c.tq &&
                  lse.is_contiguous(),
              op, ": lse must be a contiguous float32 CPU tensor (b, hq, tq) = (", c.batch, ", ",
              c.heads, ", ", c.tq, "), got ", lse.scalar_type(), " ", lse.sizes(), " on ",
              lse.device());
  const int64_t batch = c.batch, heads = c.heads, tq = c.tq, dim = c.dim, tk = c.tk;
  const int64_t kv_heads = c.kv_heads, groups = c.groups, offset = c.offset;
  const float fscale = static_cast<float>(scale);

  auto grad_q = at::zeros({batch, heads, tq, dim}, q.options());
  auto grad_k = at::zeros({batch, kv_heads, tk, dim}, q.options());
  auto grad_v = at::zeros({batch, kv_heads, tk, dim}, q.options());
  if (batch == 0 || heads == 0 || tq == 0 || tk == 0) return {grad_q, grad_k, grad_v};

  // delta = rowsum(dO * O), (b, hq, tq)
  auto delta = at::empty({batch, heads, tq}, q.options());
  {
    const Strides gs = strides_of(grad_out), os = strides_of(output);
    const float* go_data = grad_out.data_ptr<float>();
    const float* out_data = output.data_ptr<float>();
    float* delta_data = delta.data_ptr<float>();
    at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / heads, h = bh % heads;
        for (int64_t r = 0; r < tq; ++r) {
          const float* g = go_data + b * gs.b + h * gs.h + r * gs.t;
          const float* o = out_data + b * os.b + h * os.h + r * os.t;
          Vec acc(0.0f);
          int64_t j = 0;
          for (; j + Vec::size() <= dim; j += Vec::size()) {
            acc = at::vec::fmadd(Vec::loadu(g + j), Vec::loadu(o + j), acc);
          }
          float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
          for (; j < dim; ++j) sum += g[j] * o[j];
          delta_data[bh * tq + r] = sum;
        }
      }
    });
  }

  // Tasks: (b, kv head, share of keys). One share unless there are fewer (b, kv head) pairs
  // than threads; each extra share has its own dQ buffer, so at most kMaxShares of them
  // (the extra memory is at most kMaxShares - 1 times q's; more threads than pairs x
  // kMaxShares leave some idle).
  constexpr int64_t kMaxShares = 8;
  const int64_t pairs = batch * kv_heads;
  const int64_t kv_blocks = (tk + kv_split - 1) / kv_split;
  const int64_t threads = at::get_num_threads();
  const int64_t wanted = pairs >= threads ? 1 : (threads + pairs - 1) / pairs;
  const int64_t shares = std::clamp<int64_t>(std::min(wanted, kMaxShares), 1, kv_blocks);
  at::Tensor partial_q;  // (shares - 1, b, hq, tq, d): the dQ of shares 1.. of each pair
  if (shares > 1) partial_q = at::zeros({shares - 1, batch, heads, tq, dim}, q.options());
  float* partial_data = shares > 1 ? partial_q.data_ptr<float>() : nullptr;

  const Strides qs = strides_of(q), ks = strides_of(k), vs = strides_of(v);
  const Strides gs = strides_of(grad_out);
  const Strides ms = c.has_mask ? strides_of(c.mask) : Strides{0, 0, 0};
  const int64_t mask_key = c.has_mask ? c.mask.stride(3) : 0;
  const float* q_data = q.data_ptr<float>();
  const float* k_data = k.data_ptr<float>();
  const float* v_data = v.data_ptr<float>();
  const float* go_data = grad_out.data_ptr<float>();
  const float* lse_data = lse.data_ptr<float>();
  const float* delta_data = delta.data_ptr<float>();
  const float* mask_data = c.has_mask ? c.mask.data_ptr<float>() : nullptr;
  float* gq_data = grad_q.data_ptr<float>();
  float* gk_data = grad_k.data_ptr<float>();
  float* gv_data = grad_v.data_ptr<float>();
  const int64_t no_cut = std::numeric_limits<int32_t>::max();
  const int64_t tile = std::max(q_split, diag_split);

  at::parallel_for(0, pairs * shares, 1, [&](int64_t begin, int64_t end) {
    const int mkl_threads = MKL_Set_Num_Threads_Local ? MKL_Set_Num_Threads_Local(1) : 0;
    std::vector<float> p(tile * kv_split), dp(tile * kv_split);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t share = task % shares, pair = task / shares;
      const int64_t b = pair / kv_heads, hk = pair % kv_heads;
      const int64_t k0 = c.range_start ? c.range_start[b] : 0;
      const int64_t tk_b = c.range_start ? c.range_end[b] - k0 : tk;
      // this share's key blocks: an equal split of the blocks (the causal work of a block
      // falls with its position, so the shares interleave: share s takes blocks s, s + shares..)
      BackwardTile bt{k_data + b * ks.b + hk * ks.h + k0 * ks.t,
                      ks.t,
                      v_data + b * vs.b + hk * vs.h + k0 * vs.t,
                      vs.t,
                      gk_data + ((b * kv_heads + hk) * tk + k0) * dim,
                      gv_data + ((b * kv_heads + hk) * tk + k0) * dim,
                      dim,
                      fscale,
                      p.data(),
                      dp.data()};
      float* dq_base = share == 0 ? gq_data : partial_data + (share - 1) * batch * heads * tq * dim;
      for (int64_t n = share * kv_split; n < tk_b; n += shares * kv_split) {
        const int64_t cols = std::min(kv_split, tk_b - n);
        const int64_t first = k0 + n;  // the block's first key, as an index of all tk keys
        // rows that see some key of the block, and rows that see all of it
        const int64_t r_first = causal ? std::clamp<int64_t>(first - offset, 0, tq) : 0;
        const int64_t r_full = causal ? std::clamp<int64_t>(first + cols - 1 - offset, 0, tq) : 0;
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t h = hk * groups + g;
          const BackwardHead hd{
              q_data + b * qs.b + h * qs.h,
              qs.t,
              go_data + b * gs.b + h * gs.h,
              gs.t,
              lse_data + (b * heads + h) * tq,
              delta_data + (b * heads + h) * tq,
              dq_base + (b * heads + h) * tq * dim,
              c.has_mask ? mask_data + b * ms.b + h * ms.h + k0 * mask_key : nullptr,
              ms.t,
              mask_key};
          // the diagonal band: sub-blocks of diag_split rows, each cut to the keys it sees
          for (int64_t r = r_first; r < r_full; r += diag_split) {
            const int64_t sub = std::min(diag_split, r_full - r);
            const int64_t last0 = r + offset - first;  // row r's last key, in the block
            const int64_t sub_cols = std::min(cols, last0 + sub);
            bt.run(hd, r, static_cast<int>(sub), n, static_cast<int>(sub_cols), n + last0);
          }
          // rows that see the whole block
          for (int64_t r = std::max(r_first, r_full); r < tq; r += q_split) {
            const int64_t rows = std::min(q_split, tq - r);
            bt.run(hd, r, static_cast<int>(rows), n, static_cast<int>(cols), no_cut);
          }
        }
      }
    }
    if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(mkl_threads);
  });
  if (shares > 1) grad_q.add_(partial_q.sum(0));
  return {grad_q, grad_k, grad_v};
}

TORCH_LIBRARY(attnlab, m) {
  m.def(
      "causal_flash_forward(Tensor q, Tensor k, Tensor v, Tensor mask, Tensor key_start, "
      "Tensor key_end, float scale, bool causal, int q_split, int kv_split, int diag_split) "
      "-> Tensor[]");
  m.impl("causal_flash_forward", c10::DispatchKey::CPU, TORCH_FN(causal_flash_forward));
  m.def(
      "causal_flash_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor output, "
      "Tensor lse, Tensor mask, Tensor key_start, Tensor key_end, float scale, bool causal, "
      "int q_split, int kv_split, int diag_split) -> Tensor[]");
  m.impl("causal_flash_backward", c10::DispatchKey::CPU, TORCH_FN(causal_flash_backward));
}
