// The call plan of attnlab's native decode step, read in C++ (included by decode_step.cpp,
// after the op and its direct binding; attnlab._build hashes it with that file) (issue 39's fixed cost): for a
// one-token cached call of a MultiHeadAttention, whether attnlab.plan.native_decode would
// take the native step and forward's checks would pass, and if so the step itself, in one
// call. The same questions asked in Python cost ~25 us per token and layer (a tiny layer's
// whole step is ~8); asked here, of the objects' own dictionaries and tensors, they cost
// about 2 us (a verdict with its binding, scripts/fixed_cost_parts.py).
//
// This is a stricter copy of the allow-list in attnlab/plan.py, which stays the reference:
// it takes a call only when every condition native_decode states holds and, beyond them,
// exact classes (no subclass of MultiHeadAttention or KVCache) and no gradient mode.
// Anything it does not take goes on to forward's Python checks and plan, unchanged. A rolling
// cache's slot is kept before the step overwrites it and put back if the step is refused, as
// KVCache.transaction does on the Python face. tests/test_plan_lane.py holds it to "taken here => taken there" on every
// condition, and to the Python path's outputs.
//
// What a class runs (its methods, properties and those of its bases) is read through the
// Python test plan.py reads (a tuple of attributes compared by identity), and then trusted
// while the class's type version tag is the one it was read at: CPython gives a class a new
// tag whenever it or any base class is changed (an attribute set or deleted, its bases
// reassigned), and never gives a tag twice; the interpreter's own method caches rely on
// that. A class without a valid tag (0) is read every call.

#pragma once

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <vector>
#include <limits>
#include <optional>


namespace {

// the classes whose code the lanes stand for, in plan_setup's order (the last two are
// multi-head latent attention's: its lane, latent_plan.h)
enum Watched {
  kAttention, kLinear, kRope, kNorm, kCache, kLatentAttention, kLatentCache, kWatched
};
constexpr int64_t kLargest = int64_t{1} << 40;  // sizes past this are not a layer's
constexpr double kFloat32Max = std::numeric_limits<float>::max();

// What plan.py hands over once (plan_setup); references held for the process's life.
struct Spec {
  PyObject* classes[kWatched] = {};
  PyObject* as_written[kWatched] = {};  // Python tests: True while the class runs its own code
  unsigned int verified[kWatched] = {};  // the version tag each was last read at (0: none)
  PyObject* fresh[kWatched] = {};  // frozensets: the instance attributes a fresh one holds
  PyObject* parameter = nullptr;  // nn.Parameter
  PyObject* tensor = nullptr;  // torch.Tensor
  PyObject* global_hooks = nullptr;  // tuple of torch's global module hook dicts
  PyObject* functional = nullptr;  // torch.nn.functional
  PyObject* f_linear = nullptr;  // F.linear as torch defines it
  PyObject* forward_ad = nullptr;  // torch.autograd.forward_ad
  at::Tensor* empty = nullptr;  // the kernel's "none"
  bool ready = false;
};
Spec spec;

// interned attribute names, made once
struct Names {
  PyObject *d_in, *d_out, *num_heads, *num_kv_heads, *context_dim, *context_length, *backend,
      *causal, *training, *dropout, *window, *scale, *qk_norm, *modules, *parameters, *buffers,
      *qkv_proj, *out_proj, *rope, *q_norm, *k_norm, *weight, *bias, *cos, *sin, *eps, *offset,
      *hooks[4], *batch_size, *head_dim, *tokens_last, *keys_t, *values_t, *key_scales,
      *value_scales, *position, *capacity, *block, *current_level, *linear;
  // multi-head latent attention's (latent_plan.h)
  PyObject *d_model, *q_lora_rank, *kv_lora_rank, *qk_nope_head_dim, *qk_rope_head_dim,
      *v_head_dim, *q_proj, *q_a_proj, *q_a_layernorm, *q_b_proj, *kv_a_proj_with_mqa,
      *kv_a_layernorm, *kv_b_proj, *o_proj, *max_tokens, *rows, *softmax_scale;
};
Names names;

PyObject* intern(const char* name) { return PyUnicode_InternFromString(name); }

void make_names() {
  names = Names{intern("d_in"), intern("d_out"), intern("num_heads"), intern("num_kv_heads"),
                intern("context_dim"), intern("context_length"), intern("backend"),
                intern("causal"), intern("training"), intern("dropout"), intern("window"),
                intern("_scale"), intern("qk_norm"), intern("_modules"), intern("_parameters"),
                intern("_buffers"), intern("qkv_proj"), intern("out_proj"), intern("rope"),
                intern("q_norm"), intern("k_norm"), intern("weight"), intern("bias"),
                intern("cos"), intern("sin"), intern("eps"), intern("offset"),
                {intern("_forward_hooks"), intern("_forward_pre_hooks"),
                 intern("_backward_hooks"), intern("_backward_pre_hooks")},
                intern("batch_size"), intern("head_dim"), intern("tokens_last"),
                intern("_keys_t"), intern("_values_t"), intern("_key_scales"),
                intern("_value_scales"), intern("position"), intern("capacity"),
                intern("block"), intern("_current_level"), intern("linear")};
  names.d_model = intern("d_model");
  names.q_lora_rank = intern("q_lora_rank");
  names.kv_lora_rank = intern("kv_lora_rank");
  names.qk_nope_head_dim = intern("qk_nope_head_dim");
  names.qk_rope_head_dim = intern("qk_rope_head_dim");
  names.v_head_dim = intern("v_head_dim");
  names.q_proj = intern("q_proj");
  names.q_a_proj = intern("q_a_proj");
  names.q_a_layernorm = intern("q_a_layernorm");
  names.q_b_proj = intern("q_b_proj");
  names.kv_a_proj_with_mqa = intern("kv_a_proj_with_mqa");
  names.kv_a_layernorm = intern("kv_a_layernorm");
  names.kv_b_proj = intern("kv_b_proj");
  names.o_proj = intern("o_proj");
  names.max_tokens = intern("max_tokens");
  names.rows = intern("_rows");
  names.softmax_scale = intern("scale");
}

// An object's instance dictionary (a new reference), or null.
pybind11::object instance_dict(PyObject* obj) {
  PyObject* dict = PyObject_GenericGetDict(obj, nullptr);
  if (dict == nullptr || !PyDict_CheckExact(dict)) {
    PyErr_Clear();
    Py_XDECREF(dict);
    return {};
  }
  return pybind11::reinterpret_steal<pybind11::object>(dict);
}

// dict[name] (borrowed), or null when absent
PyObject* item(PyObject* dict, PyObject* name) {
  PyObject* value = PyDict_GetItemWithError(dict, name);
  if (value == nullptr) PyErr_Clear();
  return value;
}

// An exact int in [low, high] (a bool, a float or an int subclass is not one)
bool exact_int(PyObject* obj, int64_t low, int64_t high, int64_t& out) {
  if (obj == nullptr || !PyLong_CheckExact(obj)) return false;
  int overflow = 0;
  const long long value = PyLong_AsLongLongAndOverflow(obj, &overflow);
  if (overflow != 0 || (value == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  if (value < low || value > high) return false;
  out = value;
  return true;
}

bool int_item(PyObject* dict, PyObject* name, int64_t low, int64_t& out) {
  return exact_int(item(dict, name), low, kLargest, out);
}

// An exact float, finite
bool exact_float(PyObject* obj, double& out) {
  if (obj == nullptr || !PyFloat_CheckExact(obj)) return false;
  out = PyFloat_AS_DOUBLE(obj);
  return std::isfinite(out);
}

bool is_string(PyObject* obj, const char* text) {
  return obj != nullptr && PyUnicode_CheckExact(obj) &&
         PyUnicode_CompareWithASCIIString(obj, text) == 0;
}

// Every key of `dict` is a string a fresh instance holds (frozenset `fresh`)
bool keys_within(PyObject* dict, PyObject* fresh) {
  Py_ssize_t pos = 0;
  PyObject *key, *value;
  while (PyDict_Next(dict, &pos, &key, &value)) {
    if (!PyUnicode_CheckExact(key)) return false;  // no user __eq__ runs here
    const int found = PySet_Contains(fresh, key);
    if (found != 1) {
      if (found < 0) PyErr_Clear();
      return false;
    }
  }
  return true;
}

// No forward, pre-forward, backward or pre-backward hook in a module's dictionary
bool no_hooks(PyObject* dict) {
  for (PyObject* name : names.hooks) {
    PyObject* hooks = item(dict, name);
    if (hooks == nullptr || !PyDict_Check(hooks) || PyDict_GET_SIZE(hooks) != 0) return false;
  }
  return true;
}

// The tensors `holder` (a _parameters or _buffers dict) holds: exactly `count` entries
bool holds_exactly(PyObject* holder, Py_ssize_t count) {
  return holder != nullptr && PyDict_Check(holder) && PyDict_GET_SIZE(holder) == count;
}

// A tensor of exactly Python class `cls`, else null
const at::Tensor* tensor_of(PyObject* obj, PyObject* cls) {
  if (obj == nullptr || reinterpret_cast<PyObject*>(Py_TYPE(obj)) != cls) return nullptr;
  return &THPVariable_Unpack(obj);
}

// float32 strided CPU memory that is its values (no lazy negation or conjugate), any strides
bool float_memory(const at::Tensor& t) {
  return t.defined() && t.layout() == at::kStrided && t.device().is_cpu() &&
         t.scalar_type() == at::kFloat && !t.is_neg() && !t.is_conj() && storage_covers(t);
}

// float_memory, contiguous: what the kernel reads of a layer's tensors
bool plain_float(const at::Tensor& t) { return float_memory(t) && t.is_contiguous(); }

// The names the lane reads from instances of each watched class (their dictionaries), and
// what looking each up on the class gave at setup (null: nothing): a class attribute added
// since (a property, which Python's attribute reads would run instead) or a changed
// __getattribute__ is refused
std::vector<PyObject*> fields[kWatched];
std::vector<PyObject*> class_level[kWatched];

PyObject* class_lookup(PyObject* cls, PyObject* name) {  // a new reference, or null
  PyObject* found = PyObject_GetAttr(cls, name);
  if (found == nullptr) PyErr_Clear();
  return found;
}

bool fields_unshadowed(Watched which) {
  for (size_t i = 0; i < fields[which].size(); ++i) {
    PyObject* now = class_lookup(spec.classes[which], fields[which][i]);
    const bool same = now == class_level[which][i];
    Py_XDECREF(now);
    if (!same) return false;
  }
  return true;
}

// The class `which` runs the code plan.py stands for: its Python test, trusted while the
// class's version tag is unchanged since the test last passed
bool as_written(Watched which) {
  auto* type = reinterpret_cast<PyTypeObject*>(spec.classes[which]);
  const unsigned int tag = type->tp_version_tag;
  if (tag != 0 && tag == spec.verified[which]) return true;
  PyObject* result = PyObject_CallNoArgs(spec.as_written[which]);
  if (result == nullptr) PyErr_Clear();
  const bool written = result == Py_True && fields_unshadowed(which);
  Py_XDECREF(result);
  // trusted only for the tag read before the test, unchanged after it: a change made while
  // the test ran (another thread's patch) is read again on the next call
  const bool unchanged = tag != 0 && type->tp_version_tag == tag;
  spec.verified[which] = written && unchanged ? tag : 0;
  return written;
}

// Each class a lane reads runs its own code (as_written): asked before anything is read,
// since a class's test is Python, which could change what the lane holds references into
bool classes_as_written(std::initializer_list<Watched> read) {
  for (Watched which : read) {
    if (!as_written(which)) return false;
  }
  return true;
}

// The classes the decode lane reads
bool attention_classes_as_written() {
  return classes_as_written({kAttention, kLinear, kRope, kNorm, kCache});
}

// An instance of exactly `which`'s class (whose code classes_as_written vouched for) holding
// only what a fresh one holds, and no hook (for modules): its dictionary, else null
pybind11::object pristine(PyObject* obj, Watched which, bool module) {
  if (obj == nullptr || reinterpret_cast<PyObject*>(Py_TYPE(obj)) != spec.classes[which]) {
    return {};
  }
  pybind11::object dict = instance_dict(obj);
  if (!dict || !keys_within(dict.ptr(), spec.fresh[which])) return {};
  if (module && !no_hooks(dict.ptr())) return {};
  return dict;
}

// torch's state: nothing a native step would run beneath unseen (plan.native_decode's
// global conditions), and no gradient mode (the lane's own: its callers decode under
// no_grad or inference_mode)
bool quiet_state() {
  if (at::GradMode::is_enabled() || torch::jit::tracer::isTracing()) return false;
  if (at::impl::PythonTorchFunctionTLS::stack_len() > 0) return false;
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0) return false;
  // a torch.func transform: its layers' front key is included while any is active
  if (c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode)) {
    return false;
  }
  if (at::autocast::is_autocast_enabled(at::kCPU)) return false;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(spec.global_hooks); ++i) {
    PyObject* hooks = PyTuple_GET_ITEM(spec.global_hooks, i);
    if (PyDict_GET_SIZE(hooks) != 0) return false;
  }
  PyObject* linear = PyObject_GetAttr(spec.functional, names.linear);
  PyObject* level = PyObject_GetAttr(spec.forward_ad, names.current_level);
  int64_t depth = 0;
  const bool quiet = linear == spec.f_linear && exact_int(level, -1, -1, depth);
  if (linear == nullptr || level == nullptr) PyErr_Clear();
  Py_XDECREF(linear);
  Py_XDECREF(level);
  return quiet;
}

// A pristine nn.Linear with a weight (out, in) (out < 0: any) and no bias or one of its
// output width, registered float32 contiguous CPU nn.Parameters
bool plain_linear(PyObject* layer, int64_t out, int64_t in, at::Tensor& weight,
                  at::Tensor& bias) {
  pybind11::object dict = pristine(layer, kLinear, true);
  if (!dict) return false;
  PyObject* parameters = item(dict.ptr(), names.parameters);
  if (!holds_exactly(parameters, 2)) return false;
  const at::Tensor* w = tensor_of(item(parameters, names.weight), spec.parameter);
  PyObject* b = item(parameters, names.bias);
  if (w == nullptr || b == nullptr || !plain_float(*w) || w->dim() != 2) return false;
  if (w->size(1) != in || (out >= 0 && w->size(0) != out)) return false;
  weight = *w;
  if (b == Py_None) {
    bias = *spec.empty;
    return true;
  }
  const at::Tensor* bt = tensor_of(b, spec.parameter);
  if (bt == nullptr || !plain_float(*bt) || bt->dim() != 1 || bt->size(0) != w->size(0)) {
    return false;
  }
  bias = *bt;
  return true;
}

// An attnlab RotaryEmbedding's (cos, sin) of head_dim columns covering `position`
bool own_rope(PyObject* rope, int64_t hd, int64_t position, at::Tensor& cos, at::Tensor& sin) {
  pybind11::object dict = pristine(rope, kRope, true);
  if (!dict) return false;
  PyObject* buffers = item(dict.ptr(), names.buffers);
  if (!holds_exactly(buffers, 2)) return false;
  const at::Tensor* c = tensor_of(item(buffers, names.cos), spec.tensor);
  const at::Tensor* s = tensor_of(item(buffers, names.sin), spec.tensor);
  if (c == nullptr || s == nullptr || !plain_float(*c) || !plain_float(*s)) return false;
  if (c->dim() != 2 || c->sizes() != s->sizes() || c->size(1) != hd) return false;
  if (position >= c->size(0)) return false;
  cos = *c;
  sin = *s;
  return true;
}

// An attnlab RMSNorm's weight over `dim` features, and its eps and offset
bool own_norm(PyObject* norm, int64_t dim, at::Tensor& weight, double& eps, double& offset) {
  pybind11::object dict = pristine(norm, kNorm, true);
  if (!dict) return false;
  PyObject* parameters = item(dict.ptr(), names.parameters);
  if (!holds_exactly(parameters, 1)) return false;
  const at::Tensor* w = tensor_of(item(parameters, names.weight), spec.parameter);
  if (w == nullptr || !plain_float(*w) || w->dim() != 1 || w->size(0) != dim) return false;
  if (!exact_float(item(dict.ptr(), names.eps), eps) || eps <= 0 || eps > kFloat32Max) {
    return false;
  }
  if (!exact_float(item(dict.ptr(), names.offset), offset) || std::abs(offset) > kFloat32Max) {
    return false;
  }
  weight = *w;
  return true;
}

// Everything the op is called with
struct Call {
  at::Tensor x, w_qkv, b_qkv, w_out, b_out, cos, sin, q_norm, k_norm, keys_t, values_t,
      key_scales, value_scales;
  int64_t heads = 0, position = 0, slot = 0, first = 0, count = 0, block = 0, capacity = 0;
  double scale = 0, norm_eps = 1e-6, norm_offset = 0;
  bool rolling = false;  // the slot written holds a token still attended to
};

// The module's layer shapes, read from its dictionary
struct Layer {
  int64_t d_in = 0, d_out = 0, heads = 0, kv_heads = 0, hd = 0, context_length = 0;
  int64_t window = 0;  // 0: none
  PyObject* qk_norm = nullptr;
};

bool read_layer(PyObject* d, Layer& layer, double& scale) {
  int64_t context_dim = 0;
  if (!int_item(d, names.d_in, 1, layer.d_in) || !int_item(d, names.d_out, 1, layer.d_out) ||
      !int_item(d, names.num_heads, 1, layer.heads) ||
      !int_item(d, names.num_kv_heads, 1, layer.kv_heads) ||
      !int_item(d, names.context_dim, 1, context_dim) ||
      !int_item(d, names.context_length, 1, layer.context_length)) {
    return false;
  }
  if (context_dim != layer.d_in || layer.d_out % layer.heads != 0) return false;
  if (layer.heads % layer.kv_heads != 0) return false;
  layer.hd = layer.d_out / layer.heads;
  if (!is_string(item(d, names.backend), "auto") || item(d, names.causal) != Py_True) {
    return false;
  }
  PyObject* training = item(d, names.training);
  double dropout = 0;
  if (training != Py_False && !(training == Py_True &&
                                exact_float(item(d, names.dropout), dropout) && dropout == 0)) {
    return false;  // dropout would apply
  }
  PyObject* window = item(d, names.window);
  if (window == nullptr || (window != Py_None && !exact_int(window, 1, kLargest, layer.window))) {
    return false;
  }
  PyObject* given = item(d, names.scale);
  if (given == Py_None) {
    scale = 1.0 / std::sqrt(static_cast<double>(layer.hd));  // attention_scale's default
  } else if (!exact_float(given, scale) || scale <= 0 || scale > kFloat32Max) {
    return false;
  }
  layer.qk_norm = item(d, names.qk_norm);
  return layer.qk_norm == Py_None || is_string(layer.qk_norm, "head") ||
         is_string(layer.qk_norm, "projection");
}

// The cache's buffers and where the token goes: a non-rolling attnlab KVCache the kernel
// reads, of the layer's heads and x's batch, with room for one more token within the
// layer's context_length
bool read_cache(PyObject* cache, const Layer& layer, int64_t batch, Call& call) {
  pybind11::object dict = pristine(cache, kCache, false);
  if (!dict) return false;
  PyObject* d = dict.ptr();
  int64_t kv_heads = 0, hd = 0, size = 0, capacity = 0, window = 0;
  if (!int_item(d, names.num_kv_heads, 1, kv_heads) || !int_item(d, names.head_dim, 1, hd) ||
      !int_item(d, names.batch_size, 1, size) || !int_item(d, names.capacity, 1, capacity) ||
      !int_item(d, names.position, 0, call.position) ||
      !int_item(d, names.block, 1, call.block)) {
    return false;
  }
  if (kv_heads != layer.kv_heads || hd != layer.hd || size != batch) return false;
  if (item(d, names.tokens_last) != Py_True) return false;
  PyObject* kept = item(d, names.window);
  if (kept == nullptr || (kept != Py_None && !exact_int(kept, 1, kLargest, window))) {
    return false;
  }
  if (window != 0 && window != layer.window) return false;  // a wider window: Python's
  call.rolling = window != 0 && capacity == window;  // KVCache.rolling
  if ((!call.rolling && call.position >= capacity) || call.position + 1 > layer.context_length) {
    return false;  // full, or past the rotary positions forward allows
  }
  const at::Tensor* keys = tensor_of(item(d, names.keys_t), spec.tensor);
  const at::Tensor* values = tensor_of(item(d, names.values_t), spec.tensor);
  if (keys == nullptr || values == nullptr) return false;
  const auto dtype = keys->scalar_type();
  if (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kChar) return false;
  const std::vector<int64_t> shape = {batch, kv_heads, hd * capacity};
  for (const at::Tensor* t : {keys, values}) {
    if (!t->device().is_cpu() || t->scalar_type() != dtype || t->requires_grad()) return false;
    if (t->is_inference() && !c10::InferenceMode::is_enabled()) return false;  // locked
    if (t->sizes() != shape || !t->is_contiguous() || !storage_covers(*t)) return false;
  }
  if (keys->is_alias_of(*values)) return false;  // one storage: the kernel refuses it by name
  PyObject* key_scales = item(d, names.key_scales);
  PyObject* value_scales = item(d, names.value_scales);
  if (key_scales == Py_None && value_scales == Py_None) {
    call.key_scales = call.value_scales = *spec.empty;
  } else {
    const at::Tensor* ks = tensor_of(key_scales, spec.tensor);
    const at::Tensor* vs = tensor_of(value_scales, spec.tensor);
    if (ks == nullptr || vs == nullptr || dtype != at::kChar) return false;
    const std::vector<int64_t> per_token = {batch, kv_heads, capacity};
    for (const at::Tensor* t : {ks, vs}) {
      if (!plain_float(*t) || t->sizes() != per_token || t->requires_grad()) return false;
    }
    if (ks->is_alias_of(*vs) || ks->is_alias_of(*keys) || ks->is_alias_of(*values) ||
        vs->is_alias_of(*keys) || vs->is_alias_of(*values)) {
      return false;
    }
    call.key_scales = *ks;
    call.value_scales = *vs;
  }
  call.keys_t = *keys;
  call.values_t = *values;
  call.capacity = capacity;
  if (call.rolling) {  // KVCache.native_slots: the window's slots, from slot 0
    call.slot = call.position % capacity;
    call.first = 0;
    call.count = std::min(call.position + 1, capacity);
    return true;
  }
  call.slot = call.position;
  call.first = layer.window ? std::max<int64_t>(0, call.position + 1 - layer.window) : 0;
  call.count = call.position + 1 - call.first;
  return true;
}

// The call when the lane takes module(x, cache=cache), else nothing
std::optional<Call> plan_for(PyObject* module, PyObject* x, PyObject* cache) {
  if (!spec.ready || !quiet_state() || !attention_classes_as_written()) return std::nullopt;
  const at::Tensor* token = tensor_of(x, spec.tensor);
  if (token == nullptr || !float_memory(*token) || token->dim() != 3 || token->size(1) != 1) {
    return std::nullopt;
  }
  pybind11::object dict = pristine(module, kAttention, false);  // its hooks ran in __call__
  if (!dict) return std::nullopt;
  PyObject* d = dict.ptr();
  Layer layer;
  Call call;
  if (!read_layer(d, layer, call.scale) || token->size(2) != layer.d_in) return std::nullopt;
  call.x = token->contiguous();  // (b, 1, d_in): a step of a longer x is a strided view
  call.heads = layer.heads;
  PyObject* modules = item(d, names.modules);
  if (modules == nullptr || !PyDict_Check(modules)) return std::nullopt;
  const int64_t kv_dim = layer.kv_heads * layer.hd;
  if (!plain_linear(item(modules, names.qkv_proj), layer.d_out + 2 * kv_dim, layer.d_in,
                    call.w_qkv, call.b_qkv) ||
      !plain_linear(item(modules, names.out_proj), -1, layer.d_out, call.w_out, call.b_out)) {
    return std::nullopt;
  }
  if (!read_cache(cache, layer, token->size(0), call)) return std::nullopt;
  PyObject* rope = item(modules, names.rope);
  if (rope == nullptr) {  // none: the module's own None (deleted, Python's read would raise)
    if (item(d, names.rope) != Py_None) return std::nullopt;
    call.cos = call.sin = *spec.empty;
  } else if (rope == Py_None) {
    call.cos = call.sin = *spec.empty;
  } else if (!own_rope(rope, layer.hd, call.position, call.cos, call.sin)) {
    return std::nullopt;
  }
  if (layer.qk_norm == Py_None) {
    call.q_norm = call.k_norm = *spec.empty;
    return call;
  }
  const bool per_head = is_string(layer.qk_norm, "head");
  double k_eps = 0, k_offset = 0;
  if (!own_norm(item(modules, names.q_norm), per_head ? layer.hd : layer.d_out, call.q_norm,
                call.norm_eps, call.norm_offset) ||
      !own_norm(item(modules, names.k_norm), per_head ? layer.hd : kv_dim, call.k_norm, k_eps,
                k_offset) ||
      k_eps != call.norm_eps || k_offset != call.norm_offset) {
    return std::nullopt;  // the kernel takes one eps and one offset for both
  }
  return call;
}

constexpr const char* kOverflow = "decode_step: the output is not finite";

// A rolling cache's slot as it was before the step (each head's features in the keys and
// the values, then an int8 cache's two scales), kept to be put back when the step is
// refused, as KVCache.transaction does on the Python face
class SlotKept {
 public:
  explicit SlotKept(const Call& call) : call_(call) { each([](char* held, char* kept, int64_t n) {
    std::memcpy(kept, held, n);
  }); }
  void put_back() { each([](char* held, char* kept, int64_t n) { std::memcpy(held, kept, n); }); }

 private:
  template <typename F>
  void each(F&& copy) {
    const int64_t hd = call_.keys_t.size(2) / call_.capacity;
    const int64_t heads = call_.keys_t.size(0) * call_.keys_t.size(1);
    bytes_.resize(2 * heads * (hd * call_.keys_t.element_size() + sizeof(float)));
    char* kept = bytes_.data();
    // the keys in blocks of call_.block tokens, the values as rows (blocks of one token)
    for (const auto& [buffer, block] : {std::pair{&call_.keys_t, call_.block},
                                        std::pair{&call_.values_t, int64_t{1}}}) {
      int64_t stride = 0;
      const int64_t offset = slot_offset(call_.slot, hd, call_.capacity, block, stride);
      const int64_t size = buffer->element_size();
      char* base = static_cast<char*>(buffer->data_ptr());
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t d = 0; d < hd; ++d, kept += size) {
          copy(base + (h * hd * call_.capacity + offset + d * stride) * size, kept, size);
        }
      }
    }
    for (const at::Tensor* scales : {&call_.key_scales, &call_.value_scales}) {
      if (!scales->numel()) continue;
      char* base = static_cast<char*>(scales->data_ptr());
      for (int64_t h = 0; h < heads; ++h, kept += sizeof(float)) {
        copy(base + (h * call_.capacity + call_.slot) * sizeof(float), kept, sizeof(float));
      }
    }
  }

  const Call& call_;
  std::vector<char> bytes_;
};

// module(x, cache=cache) through the native step when the lane takes it: the output (b, 1,
// width) with the cache's position moved on; else None with nothing written (a call the lane
// does not take, an x that is not finite, a step whose float32 arithmetic overflowed: forward
// then runs its own checks and plan)
pybind11::object decode_lane(pybind11::handle module, pybind11::handle x,
                             pybind11::handle cache) {
  std::optional<Call> call = plan_for(module.ptr(), x.ptr(), cache.ptr());
  if (!call) return pybind11::none();
  std::optional<SlotKept> kept;
  if (call->rolling) kept.emplace(*call);  // the step overwrites a held token
  at::Tensor out;
  try {
    pybind11::gil_scoped_release released;
    out = decode_step(
        call->x, call->w_qkv, call->b_qkv, call->w_out, call->b_out, call->cos, call->sin,
        call->q_norm, call->k_norm, call->keys_t, call->values_t, call->key_scales,
        call->value_scales, call->heads, call->position, call->slot, call->first, call->count,
        call->block, call->scale, call->norm_eps, call->norm_offset);
  } catch (const c10::Error& error) {
    if (kept) kept->put_back();
    const std::string message = error.what_without_backtrace();
    if (message.rfind(kOverflow, 0) == 0) return pybind11::none();
    throw std::runtime_error(message);
  }
  if (!out.numel()) return pybind11::none();
  for (const at::Tensor* written :
       {&call->keys_t, &call->values_t, &call->key_scales, &call->value_scales}) {
    bump_version(*written);
  }
  pybind11::object next = pybind11::int_(call->position + 1);
  if (PyObject_SetAttr(cache.ptr(), names.position, next.ptr()) != 0) {
    throw pybind11::error_already_set();
  }
  return pybind11::reinterpret_steal<pybind11::object>(THPVariable_Wrap(out));
}

// Whether decode_lane would take the call (nothing run or written): for the tests
bool lane_takes(pybind11::handle module, pybind11::handle x, pybind11::handle cache) {
  return plan_for(module.ptr(), x.ptr(), cache.ptr()).has_value();
}

PyObject* kept(pybind11::handle obj) {
  PyObject* ptr = obj.ptr();
  Py_INCREF(ptr);  // held for the process's life
  return ptr;
}

// plan.py's references, once per process
void plan_setup(pybind11::tuple classes, pybind11::tuple as_written, pybind11::tuple fresh,
                pybind11::handle parameter, pybind11::handle tensor,
                pybind11::tuple global_hooks, pybind11::handle functional,
                pybind11::handle f_linear, pybind11::handle forward_ad) {
  TORCH_CHECK(classes.size() == kWatched && as_written.size() == kWatched &&
                  fresh.size() == kWatched,
              "plan_setup: ", kWatched, " classes, tests and fresh sets");
  for (pybind11::handle hooks : global_hooks) {
    TORCH_CHECK(PyDict_Check(hooks.ptr()), "plan_setup: global hooks must be dicts");
  }
  for (int i = 0; i < kWatched; ++i) {
    TORCH_CHECK(PyType_Check(classes[i].ptr()) && PyFrozenSet_Check(fresh[i].ptr()) &&
                    PyCallable_Check(as_written[i].ptr()),
                "plan_setup: a class, a callable and a frozenset each");
    spec.classes[i] = kept(classes[i]);
    spec.as_written[i] = kept(as_written[i]);
    spec.fresh[i] = kept(fresh[i]);
    spec.verified[i] = 0;
  }
  spec.parameter = kept(parameter);
  spec.tensor = kept(tensor);
  spec.global_hooks = kept(global_hooks);
  spec.functional = kept(functional);
  spec.f_linear = kept(f_linear);
  spec.forward_ad = kept(forward_ad);
  if (spec.empty == nullptr) spec.empty = new at::Tensor(at::empty({0}));  // never freed
  if (names.d_in == nullptr) make_names();
  // also the names Python reads through nn.Module.__getattr__ (submodules, parameters,
  // buffers), which a class attribute of that name would take the place of
  PyObject* getattribute = intern("__getattribute__");
  PyObject* getattr = intern("__getattr__");
  PyObject* const* hooks = names.hooks;
  fields[kAttention] = {names.d_in, names.d_out, names.num_heads, names.num_kv_heads,
                        names.context_dim, names.context_length, names.backend, names.causal,
                        names.training, names.dropout, names.window, names.scale,
                        names.qk_norm, names.modules, names.rope, names.qkv_proj,
                        names.out_proj, names.q_norm, names.k_norm, getattribute, getattr};
  fields[kLinear] = {names.parameters, names.weight, names.bias, hooks[0], hooks[1], hooks[2],
                     hooks[3], getattribute, getattr};
  fields[kRope] = {names.buffers, names.cos, names.sin, hooks[0], hooks[1], hooks[2], hooks[3],
                   getattribute, getattr};
  fields[kNorm] = {names.parameters, names.weight, names.eps, names.offset, hooks[0], hooks[1],
                   hooks[2], hooks[3], getattribute, getattr};
  fields[kCache] = {names.num_kv_heads, names.head_dim, names.batch_size, names.capacity,
                    names.position, names.block, names.tokens_last, names.window,
                    names.keys_t, names.values_t, names.key_scales, names.value_scales,
                    getattribute, intern("__setattr__")};
  fields[kLatentAttention] = {
      names.d_model, names.num_heads, names.q_lora_rank, names.kv_lora_rank,
      names.qk_nope_head_dim, names.qk_rope_head_dim, names.v_head_dim, names.context_length,
      names.causal, names.training, names.dropout, names.modules, names.rope, names.q_proj,
      names.q_a_proj, names.q_a_layernorm, names.q_b_proj, names.kv_a_proj_with_mqa,
      names.kv_a_layernorm, names.kv_b_proj, names.o_proj, getattribute, getattr};
  fields[kLatentCache] = {names.batch_size, names.max_tokens, names.kv_lora_rank,
                          names.qk_rope_head_dim, names.position, names.rows, getattribute,
                          intern("__setattr__")};
  for (int i = 0; i < kWatched; ++i) {
    class_level[i].clear();
    for (PyObject* name : fields[i]) class_level[i].push_back(class_lookup(spec.classes[i], name));
  }
  spec.ready = true;
}

// classes_as_written for plan.py's own native step (the reference reads the same fields
// from instances' dictionaries): False before plan_setup
bool watched_classes_as_written() { return spec.ready && attention_classes_as_written(); }

void bind_plan(pybind11::module_& m) {
  m.def("classes_as_written", &watched_classes_as_written,
        "every watched class runs its own code, no class attribute over a field read");
  m.def("plan_setup", &plan_setup, "plan.py's references for the lane, once per process");
  m.def("decode_lane", &decode_lane, "module(x, cache=cache) by the native step, or None",
        pybind11::arg("module"), pybind11::arg("x"), pybind11::arg("cache"));
  m.def("lane_takes", &lane_takes, "whether decode_lane would take the call",
        pybind11::arg("module"), pybind11::arg("x"), pybind11::arg("cache"));
}

}  // namespace
