// The call plan of multi-head latent attention's native decode step, read in C++ (included by
// decode_step.cpp after decode_plan.h, whose readers it shares; attnlab._build hashes it with
// that file) (issue 39: the Python around MultiHeadLatentAttention's step): for a one-token
// cached call, whether forward's checks would pass and its Python path would take the native
// step (mla.MultiHeadLatentAttention._native_tables, absorbed by the default rule), and if
// so the whole step, its projections included, in one call. Asked in Python, those questions
// and the step's tensor bookkeeping cost more than the step's reads at a few hundred tokens.
//
// A stricter copy of the module's own conditions, which stay the reference: it takes a call
// only where they hold and, beyond them, for exact classes (no subclass of
// MultiHeadLatentAttention or LatentCache), no gradient mode, absorb left to the rule, and
// layers whose sizes keep the rule's products within 64 bits. Anything it does not take goes
// on to forward's checks and Python path, unchanged. tests/test_latent_lane.py holds it to
// "taken here => taken there" and to the Python path's outputs.

#pragma once

namespace {

// The module's sizes, read from its dictionary (q_rank 0: no low-rank queries)
struct LatentShape {
  int64_t d_model = 0, heads = 0, q_rank = 0, r = 0, dn = 0, dr = 0, dv = 0;
  int64_t context_length = 0;
};

// Everything the step is called with
struct LatentCall {
  at::Tensor x, w_q, b_q, w_qa, b_qa, qa_norm, w_qb, b_qb, w_kva, b_kva, kv_norm, w_kvb, w_o,
      b_o, cos, sin, rows;
  int64_t heads = 0, position = 0;
  double scale = 0, qa_eps = 1e-6, qa_offset = 0, kv_eps = 1e-6, kv_offset = 0;
};

// the absorbed rule's products (MultiHeadLatentAttention.absorbs) and the layer's widths
// (heads x features) stay within int64 below these
constexpr int64_t kRuleWidth = int64_t{1} << 20;
constexpr int64_t kRuleKeys = int64_t{1} << 22;

bool read_latent_layer(PyObject* d, LatentShape& s) {
  if (!int_item(d, names.d_model, 1, s.d_model) || !int_item(d, names.num_heads, 1, s.heads) ||
      !int_item(d, names.kv_lora_rank, 1, s.r) ||
      !int_item(d, names.qk_nope_head_dim, 0, s.dn) ||
      !int_item(d, names.qk_rope_head_dim, 0, s.dr) || !int_item(d, names.v_head_dim, 1, s.dv) ||
      !int_item(d, names.context_length, 1, s.context_length)) {
    return false;
  }
  PyObject* rank = item(d, names.q_lora_rank);
  if (rank == nullptr || (rank != Py_None && !exact_int(rank, 1, kLargest, s.q_rank))) {
    return false;
  }
  if (s.dn + s.dr < 1 || s.dr % 2 != 0 || s.r >= kRuleWidth || s.dn + s.dv >= kRuleWidth ||
      s.heads >= kRuleWidth || s.dn + s.dr >= kRuleWidth) {
    return false;
  }
  if (item(d, names.causal) != Py_True) return false;
  PyObject* training = item(d, names.training);
  double dropout = 0;
  return training == Py_False ||
         (training == Py_True && exact_float(item(d, names.dropout), dropout) && dropout == 0);
}

// A submodule the module holds under `name`, where Python's attribute read finds it: None in
// its dictionary (a submodule never made: no low-rank queries, no latent norm, no rotary
// dims), else in its _modules. `none` says which; false for anything else (deleted: Python's
// read would raise; in both places; anything but None in the dictionary)
bool child(PyObject* d, PyObject* modules, PyObject* name, PyObject*& out, bool& none) {
  PyObject* own = item(d, name);
  out = item(modules, name);
  if (own != nullptr) {
    if (own != Py_None || out != nullptr) return false;
    out = own;
  }
  none = out == Py_None;
  return out != nullptr;
}

// Every submodule the module holds is one the lane reads for its layout: forward checks each
// child layer's dtype and device, the lane only those it reads
bool children_read(PyObject* modules, const LatentShape& s) {
  PyObject* const plain[] = {names.q_proj};
  PyObject* const low_rank[] = {names.q_a_proj, names.q_a_layernorm, names.q_b_proj};
  PyObject* const shared[] = {names.kv_a_proj_with_mqa, names.kv_a_layernorm, names.kv_b_proj,
                              names.o_proj, names.rope};
  Py_ssize_t pos = 0;
  PyObject *key, *value;
  while (PyDict_Next(modules, &pos, &key, &value)) {
    if (!PyUnicode_CheckExact(key)) return false;  // no user __eq__ runs here
    bool known = false;
    auto among = [&](auto& list) {
      for (PyObject* name : list) known = known || PyUnicode_Compare(key, name) == 0;
    };
    if (s.q_rank == 0) {
      among(plain);
    } else {
      among(low_rank);
    }
    among(shared);
    if (!known) return false;
  }
  return true;
}

// A latent norm (kv_a_layernorm, q_a_layernorm): None, or attnlab's RMSNorm over `dim`
bool latent_norm(PyObject* d, PyObject* modules, PyObject* name, int64_t dim, at::Tensor& weight,
                 double& eps, double& offset) {
  PyObject* norm = nullptr;
  bool none = false;
  if (!child(d, modules, name, norm, none)) return false;
  if (none) {
    weight = *spec.empty;
    return true;
  }
  return own_norm(norm, dim, weight, eps, offset);
}

bool linear_child(PyObject* modules, PyObject* name, int64_t out, int64_t in, at::Tensor& weight,
                  at::Tensor& bias) {
  return plain_linear(item(modules, name), out, in, weight, bias);
}

// The query path: q_proj, or q_a_proj, its norm and q_b_proj
bool read_queries(PyObject* d, PyObject* modules, const LatentShape& s, LatentCall& call) {
  const int64_t width = s.heads * (s.dn + s.dr);
  if (s.q_rank == 0) {
    return linear_child(modules, names.q_proj, width, s.d_model, call.w_q, call.b_q);
  }
  return linear_child(modules, names.q_a_proj, s.q_rank, s.d_model, call.w_qa, call.b_qa) &&
         latent_norm(d, modules, names.q_a_layernorm, s.q_rank, call.qa_norm, call.qa_eps,
                     call.qa_offset) &&
         linear_child(modules, names.q_b_proj, width, s.q_rank, call.w_qb, call.b_qb);
}

// The cache's rows and position: an attnlab LatentCache of the layer's widths and x's batch,
// float32 rows the step may write, with room for one more token within context_length
bool read_latent_cache(PyObject* cache, const LatentShape& s, int64_t batch, LatentCall& call) {
  pybind11::object dict = pristine(cache, kLatentCache, false);
  if (!dict) return false;
  PyObject* d = dict.ptr();
  int64_t size = 0, capacity = 0, r = 0, dr = 0;
  if (!int_item(d, names.batch_size, 1, size) || !int_item(d, names.max_tokens, 1, capacity) ||
      !int_item(d, names.kv_lora_rank, 1, r) || !int_item(d, names.qk_rope_head_dim, 0, dr) ||
      !int_item(d, names.position, 0, call.position)) {
    return false;
  }
  if (size != batch || r != s.r || dr != s.dr) return false;
  if (call.position >= capacity || call.position + 1 > s.context_length) return false;
  if (call.position >= kRuleKeys) return false;
  const at::Tensor* rows = tensor_of(item(d, names.rows), spec.tensor);
  if (rows == nullptr || !plain_float(*rows) || rows->requires_grad()) return false;
  if (rows->is_inference() && !c10::InferenceMode::is_enabled()) return false;  // locked
  if (rows->sizes() != std::vector<int64_t>{batch, capacity, s.r + s.dr}) return false;
  call.rows = *rows;
  return true;
}

// The module's `scale` property (the class's code where classes_as_written, asked after it,
// passes): a positive float32-sized float, else false. An error it raises is the Python path's to
// raise again, but one that is not an Exception (KeyboardInterrupt) goes on from here.
bool read_scale(PyObject* module, double& scale) {
  PyObject* value = PyObject_GetAttr(module, names.softmax_scale);
  if (value == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) throw pybind11::error_already_set();
    PyErr_Clear();
    return false;
  }
  const bool scaled = exact_float(value, scale) && scale > 0 && scale <= kFloat32Max;
  Py_DECREF(value);
  return scaled;
}

// MultiHeadLatentAttention.absorbs(1, keys): the absorbed path does fewer multiply-adds
bool absorbs_one(const LatentShape& s, int64_t keys) {
  return keys * (2 * s.r - s.dn - s.dv) < (keys - 1) * s.r * (s.dn + s.dv);
}

// No tensor the step writes (the rows) shares memory with one it reads
bool rows_apart(const LatentCall& call) {
  for (const at::Tensor* t : {&call.w_q, &call.b_q, &call.w_qa, &call.b_qa, &call.qa_norm,
                              &call.w_qb, &call.b_qb, &call.w_kva, &call.b_kva, &call.kv_norm,
                              &call.w_kvb, &call.w_o, &call.b_o, &call.cos, &call.sin}) {
    if (t->defined() && t->numel() && t->is_alias_of(call.rows)) return false;
  }
  return true;
}

// The call when the lane takes module(x, cache=cache), else nothing
std::optional<LatentCall> latent_plan_for(PyObject* module, PyObject* x, PyObject* cache) {
  if (!spec.ready) return std::nullopt;
  if (reinterpret_cast<PyObject*>(Py_TYPE(module)) != spec.classes[kLatentAttention]) {
    return std::nullopt;
  }
  // the softmax scale as the module's own property computes it (its rotary scaling's
  // mscale): Python, so asked first, before torch's state, the classes' code (a patched
  // property is refused there) and anything the lane reads
  double scale = 0;
  if (!read_scale(module, scale)) return std::nullopt;
  if (!quiet_state()) return std::nullopt;
  if (!classes_as_written({kLatentAttention, kLinear, kRope, kNorm, kLatentCache})) {
    return std::nullopt;
  }
  const at::Tensor* token = tensor_of(x, spec.tensor);
  if (token == nullptr || !float_memory(*token) || token->dim() != 3 || token->size(1) != 1) {
    return std::nullopt;
  }
  pybind11::object dict = pristine(module, kLatentAttention, false);  // hooks ran in __call__
  if (!dict) return std::nullopt;
  PyObject* d = dict.ptr();
  LatentShape s;
  if (!read_latent_layer(d, s) || token->size(2) != s.d_model) return std::nullopt;
  PyObject* modules = item(d, names.modules);
  if (modules == nullptr || !PyDict_Check(modules) || !children_read(modules, s)) {
    return std::nullopt;
  }
  LatentCall call;
  call.heads = s.heads;
  call.scale = scale;
  at::Tensor kvb_bias;
  if (!read_queries(d, modules, s, call) ||
      !linear_child(modules, names.kv_a_proj_with_mqa, s.r + s.dr, s.d_model, call.w_kva,
                    call.b_kva) ||
      !latent_norm(d, modules, names.kv_a_layernorm, s.r, call.kv_norm, call.kv_eps,
                   call.kv_offset) ||
      !linear_child(modules, names.kv_b_proj, s.heads * (s.dn + s.dv), s.r, call.w_kvb,
                    kvb_bias) ||
      kvb_bias.numel() ||  // a bias: the absorbed path reads the weight alone, so it expands
      !linear_child(modules, names.o_proj, s.d_model, s.heads * s.dv, call.w_o, call.b_o)) {
    return std::nullopt;
  }
  if (!read_latent_cache(cache, s, token->size(0), call)) return std::nullopt;
  if (!absorbs_one(s, call.position + 1)) return std::nullopt;
  PyObject* rope = nullptr;
  bool no_rope = false;
  if (!child(d, modules, names.rope, rope, no_rope)) return std::nullopt;
  if (no_rope) {
    call.cos = call.sin = *spec.empty;
  } else if (!own_rope(rope, s.dr, call.position, call.cos, call.sin)) {
    return std::nullopt;
  }
  if (!rows_apart(call)) return std::nullopt;
  call.x = token->contiguous();  // (b, 1, d_model): a step of a longer x is a strided view
  if (!all_finite(call.x.data_ptr<float>(), call.x.numel())) return std::nullopt;
  return call;
}

const float* data_or_null(const at::Tensor& t) {
  return t.defined() && t.numel() ? t.data_ptr<float>() : nullptr;
}

// y (b, out) = x (b, in) through a layer's weight and bias, by the step's projection kernel
at::Tensor linear_of(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  auto y = at::empty({x.size(0), w.size(0)}, x.options());  // (b, out)
  project(x.data_ptr<float>(), x.size(0), x.size(1), w.data_ptr<float>(), data_or_null(bias),
          w.size(0), y.data_ptr<float>());
  return y;
}

// The whole step: the queries and the compressed row projected, latent_step, o_proj. An
// empty tensor where float32 overflowed (the row may be written; the position is not moved)
at::Tensor latent_decode(const LatentCall& call) {
  const int64_t heads = call.heads, batch = call.x.size(0);
  const at::Tensor x = call.x.view({batch, call.x.size(2)});  // (b, d_model)
  at::Tensor q;
  if (call.w_q.defined()) {
    q = linear_of(x, call.w_q, call.b_q);  // (b, h (dn + dr))
  } else {
    at::Tensor low = linear_of(x, call.w_qa, call.b_qa);  // (b, q_lora_rank)
    if (call.qa_norm.numel()) {
      const int64_t rank = low.size(1);
      for (int64_t b = 0; b < batch; ++b) {
        rms_norm(low.data_ptr<float>() + b * rank, rank, call.qa_norm.data_ptr<float>(),
                 norm_epsilon(call.qa_eps), static_cast<float>(call.qa_offset));
      }
    }
    q = linear_of(low, call.w_qb, call.b_qb);  // (b, h (dn + dr))
  }
  const at::Tensor compressed = linear_of(x, call.w_kva, call.b_kva);  // (b, r + dr)
  const at::Tensor out = latent_step(q.view({batch, heads, q.size(1) / heads}), compressed,
                                     call.kv_norm, call.kv_eps, call.kv_offset, call.cos,
                                     call.sin, call.position, call.rows, call.w_kvb, call.scale);
  if (!out.numel()) return out;
  at::Tensor y = linear_of(out.view({batch, out.size(1) * out.size(2)}), call.w_o, call.b_o);
  if (!all_finite(y.data_ptr<float>(), y.numel())) return at::empty({0}, y.options());
  return y.view({batch, 1, y.size(1)});  // (b, 1, d_model)
}

// module(x, cache=cache) through the native step when the lane takes it: the output (b, 1,
// d_model) with the cache's position moved on; else None, the position unmoved (a call the
// lane does not take, an x that is not finite, a step whose float32 arithmetic overflowed:
// forward then runs its own checks and path)
pybind11::object latent_lane(pybind11::handle module, pybind11::handle x,
                             pybind11::handle cache) {
  std::optional<LatentCall> call = latent_plan_for(module.ptr(), x.ptr(), cache.ptr());
  if (!call) return pybind11::none();
  at::Tensor out;
  try {
    pybind11::gil_scoped_release released;
    out = latent_decode(*call);
  } catch (const c10::Error& error) {
    throw std::runtime_error(error.what_without_backtrace());
  }
  bump_version(call->rows);  // written, even where the step then overflowed
  if (!out.numel()) return pybind11::none();
  pybind11::object next = pybind11::int_(call->position + 1);
  if (PyObject_SetAttr(cache.ptr(), names.position, next.ptr()) != 0) {
    throw pybind11::error_already_set();
  }
  return pybind11::reinterpret_steal<pybind11::object>(THPVariable_Wrap(out));
}

// Whether latent_lane would take the call (nothing run or written): for the tests
bool latent_lane_takes(pybind11::handle module, pybind11::handle x, pybind11::handle cache) {
  return latent_plan_for(module.ptr(), x.ptr(), cache.ptr()).has_value();
}

void bind_latent_plan(pybind11::module_& m) {
  m.def("latent_lane", &latent_lane,
        "a MultiHeadLatentAttention's module(x, cache=cache) by the native step, or None",
        pybind11::arg("module"), pybind11::arg("x"), pybind11::arg("cache"));
  m.def("latent_lane_takes", &latent_lane_takes, "whether latent_lane would take the call",
        pybind11::arg("module"), pybind11::arg("x"), pybind11::arg("cache"));
}

}  // namespace
