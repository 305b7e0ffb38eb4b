// The SDPA drop-in's, sageattn's and the official-API alias's repeated calls in C++:
// sage_attn.fastpath compiles this file against the installed torch (the package itself has no
// torch ABI tie) and sage_attn._torch loads it when built.
//
// The Python drop-in decides every call's route once per signature (sage_attn._torch,
// _dropin_route_of) and hands the answers it can repeat here (remember); sageattn hands over the
// plan of an eager call (remember_sageattn); the alias (sage_attn.sageattention) its route to
// torch or to sageattn (remember_alias). A later call with the same key is then answered
// without Python: its key is read from the tensors' C++ objects and the arguments, looked up,
// and either torch's SDPA op is called (the drop-in's route to torch) or the library's run is
// launched on the plan's argument struct with this call's pointers (a direct run of sage).
// Whatever this module does not recognize returns None, and the Python path runs as before:
// masks, subclasses, non-strided tensors, other scalar types, and every call while a torch
// function mode, a dispatch mode or a torch.func transform is active (each can see or change
// the op).
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/python_variable.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <string>
#include <unordered_map>

namespace {

// A route: the drop-in's to torch (kTorch) or a direct run of sage (kSage); the official-API
// alias's to torch's SDPA on its layouts (kAliasTorch) or to sageattn (kAliasSage: the caller
// calls sageattn, which has its own plan here).
enum Kind : long { kTorch = 1, kSage = 2, kAliasTorch = 3, kAliasSage = 4 };
// Which entry point a key is of (its first word).
enum Entry : int64_t { kEntryDropin = 1, kEntrySageattn = 2, kEntryAlias = 3 };

struct Route {
  long kind = 0;
  std::string args;             // kSage: the plan's sage_attention_args, pointers unset
  int64_t workspace_alloc = 0;  // kSage: the workspace, in elements of the query's dtype
};

// Every input a route depends on, as the Python signature has it: per tensor its dims, sizes,
// strides, scalar type and device; the query's 16-byte alignment; dropout_p, is_causal, scale
// (with its Python type), enable_gqa; whether the call trains. (The crossover switch is not in
// it: setting it clears the table.)
constexpr int kMaxDims = 6;
constexpr int kKeyLen = 1 + 3 * (4 + 2 * kMaxDims) + 2 + 12;

struct Key {
  std::array<int64_t, kKeyLen> v{};
  int n = 0;
  void push(int64_t x) { v[n++] = x; }
  bool operator==(const Key& o) const {
    return n == o.n && std::memcmp(v.data(), o.v.data(), sizeof(int64_t) * n) == 0;
  }
};

struct KeyHash {
  size_t operator()(const Key& k) const {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the words
    for (int i = 0; i < k.n; ++i) {
      h ^= static_cast<uint64_t>(k.v[i]);
      h *= 1099511628211ull;
    }
    return static_cast<size_t>(h);
  }
};

std::unordered_map<Key, Route, KeyHash> g_routes;
constexpr size_t kMaxRoutes = 512;  // as the Python table: a model has a handful of shapes

// Set once by configure(): where sage_attention_args keeps each pointer (the ctypes binding's
// offsets, which the binding checks against the library), the library's sage_attention, and
// torch._C._cuda_getCurrentRawStream.
struct Config {
  bool set = false;
  Py_ssize_t q = 0, k = 0, v = 0, o = 0, stream = 0, workspace = 0, size = 0;
  int (*run)(void*) = nullptr;
  PyObject* raw_stream = nullptr;
} g;

int64_t double_bits(double x) {
  int64_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

// A Python scalar as key words (tag, value): float 1, int 2, None 0 (where allowed). false: a type
// the signature does not take here (the Python path keys or decides it).
bool push_scalar(Key& key, PyObject* x, bool none_ok) {
  if (x == Py_None && none_ok) {
    key.push(0);
    key.push(0);
    return true;
  }
  if (PyFloat_CheckExact(x)) {
    key.push(1);
    key.push(double_bits(PyFloat_AS_DOUBLE(x)));
    return true;
  }
  if (PyLong_CheckExact(x)) {
    int overflow = 0;
    long long value = PyLong_AsLongLongAndOverflow(x, &overflow);
    if (overflow != 0 || (value == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return false;
    }
    key.push(2);
    key.push(value);
    return true;
  }
  return false;
}

// The tensors' part of a key: every word the signature reads of q, k and v (plain, strided,
// on a CPU or CUDA device), the query's alignment, and whether the call trains. false: no key.
bool push_tensors(PyObject* const* args, Key& key) {
  const at::Tensor* t[3];
  for (int i = 0; i < 3; ++i) {
    if (!THPVariable_CheckExact(args[i])) return false;
    t[i] = &THPVariable_Unpack(args[i]);
    const at::Tensor& x = *t[i];
    if (x.layout() != c10::kStrided || x.is_nested()) return false;
    const c10::DeviceType dt = x.device().type();
    if (dt != c10::DeviceType::CUDA && dt != c10::DeviceType::CPU) return false;
    const int64_t dims = x.dim();
    if (dims > kMaxDims) return false;
    key.push(dims);
    for (int64_t s : x.sizes()) key.push(s);
    for (int64_t s : x.strides()) key.push(s);
    key.push(static_cast<int64_t>(x.scalar_type()));
    key.push(static_cast<int64_t>(dt) * 65536 + x.device().index());
  }
  const at::Tensor& q = *t[0];
  if (!q.has_storage()) return false;
  key.push(reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 == 0);
  key.push(at::GradMode::is_enabled() &&
           (q.requires_grad() || t[1]->requires_grad() || t[2]->requires_grad()));
  return true;
}

bool push_bool(Key& key, PyObject* x) {
  if (x != Py_True && x != Py_False) return false;
  key.push(x == Py_True);
  return true;
}

// A smoothing flag: None (the preset), True or False.
bool push_flag(Key& key, PyObject* x) {
  if (x != Py_None) return push_bool(key, x);
  key.push(2);
  return true;
}

// A string argument among `names`, as its index + 1 (0 for None where none_ok). false: anything
// else (the Python path names the error).
bool push_choice(Key& key, PyObject* x, std::initializer_list<const char*> names, bool none_ok) {
  if (x == Py_None && none_ok) {
    key.push(0);
    return true;
  }
  if (!PyUnicode_CheckExact(x)) return false;
  int64_t i = 1;
  for (const char* name : names) {
    if (PyUnicode_CompareWithASCIIString(x, name) == 0) {
      key.push(i);
      return true;
    }
    ++i;
  }
  return false;
}

// The drop-in's key. args: query, key, value, attn_mask, dropout_p, is_causal, scale,
// enable_gqa.
bool make_key(PyObject* const* args, Key& key) {
  if (args[3] != Py_None) return false;
  key.push(kEntryDropin);
  if (!push_tensors(args, key)) return false;
  return push_scalar(key, args[4], false) && push_bool(key, args[5]) &&
         push_scalar(key, args[6], true) && push_bool(key, args[7]);
}

// sageattn's key (without an LSE asked for). args: q, k, v, tensor_layout, is_causal, sm_scale,
// qk_bits, smooth_k, smooth_q, smooth_v, causal_align, kernel.
bool make_sageattn_key(PyObject* const* args, Key& key) {
  key.push(kEntrySageattn);
  if (!push_tensors(args, key)) return false;
  if (key.v[key.n - 1] != 0) return false;  // trains: the op's path, for autograd
  if (!push_choice(key, args[3], {"HND", "NHD"}, false)) return false;
  if (!push_bool(key, args[4])) return false;
  if (!push_scalar(key, args[5], true)) return false;
  if (!push_scalar(key, args[6], true)) return false;
  for (int i = 7; i < 10; ++i)
    if (!push_flag(key, args[i])) return false;
  if (!push_choice(key, args[10], {"bottom_right", "top_left"}, false)) return false;
  return push_choice(key, args[11], {"auto", "mma", "sm90"}, true);
}

// The official-API alias's key (sage_attn.sageattention._run without keywords or an LSE).
// args: q, k, v, tensor_layout, is_causal, sm_scale, smooth_k, smooth_v.
bool make_alias_key(PyObject* const* args, Key& key) {
  key.push(kEntryAlias);
  if (!push_tensors(args, key)) return false;
  if (!push_choice(key, args[3], {"HND", "NHD"}, false)) return false;
  if (!push_bool(key, args[4])) return false;
  if (!push_scalar(key, args[5], true)) return false;
  return push_flag(key, args[6]) && push_flag(key, args[7]);
}

bool modes_active() {
  return c10::impl::TorchDispatchModeTLS::stack_len() > 0 ||
         at::impl::torch_function_mode_enabled() ||
         // (functorch includes its front-mode key while any transform's layer is on the stack)
         c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode);
}

// A scale argument: None, or a float or int as a double (PyFloat_AsDouble takes both).
std::optional<double> scale_of(PyObject* x) {
  if (x == Py_None) return std::nullopt;
  return PyFloat_AsDouble(x);
}

// torch's SDPA, as torch.nn.functional.scaled_dot_product_attention runs it for plain tensors
// (the GIL released around the op, as torch's bindings do). nhd: [B, N, H, D] tensors, passed as
// [B, H, N, D] views and the output returned in their layout. None where the op raises (caught
// with the GIL released; the Python path runs the call again and raises torch's error).
PyObject* run_sdpa(PyObject* const* args, double dropout, bool causal, PyObject* scale_obj,
                   bool gqa, bool nhd) {
  at::Tensor q = THPVariable_Unpack(args[0]), k = THPVariable_Unpack(args[1]),
             v = THPVariable_Unpack(args[2]);
  const std::optional<double> scale = scale_of(scale_obj);
  if (PyErr_Occurred()) return nullptr;
  at::Tensor out;
  bool failed = false;
  Py_BEGIN_ALLOW_THREADS
  try {
    if (nhd) q = q.transpose(1, 2), k = k.transpose(1, 2), v = v.transpose(1, 2);
    out = at::scaled_dot_product_attention(q, k, v, std::nullopt, dropout, causal, scale, gqa);
    if (nhd) out = out.transpose(1, 2);
  } catch (const std::exception&) {
    failed = true;
  }
  Py_END_ALLOW_THREADS
  if (failed) Py_RETURN_NONE;
  return THPVariable_Wrap(std::move(out));
}

// The drop-in's route to torch: SDPA on the call's own arguments.
PyObject* run_torch(PyObject* const* args) {
  const double dropout = PyFloat_AsDouble(args[4]);
  if (PyErr_Occurred()) return nullptr;
  return run_sdpa(args, dropout, args[5] == Py_True, args[6], args[7] == Py_True, false);
}

// The alias's route to torch (sageattention._sdpa_fallback without a mask): GQA where the heads
// differ (dimension 2 of NHD tensors, 1 of HND ones).
PyObject* run_alias_torch(PyObject* const* args) {
  const bool nhd = PyUnicode_CompareWithASCIIString(args[3], "NHD") == 0;
  const int heads = nhd ? 2 : 1;
  const bool gqa =
      THPVariable_Unpack(args[0]).size(heads) != THPVariable_Unpack(args[1]).size(heads);
  return run_sdpa(args, 0.0, args[4] == Py_True, args[5], gqa, nhd);
}

void put_pointer(std::string& a, Py_ssize_t offset, const void* p) {
  std::memcpy(&a[offset], &p, sizeof p);
}

// The library's run of the planned call (the Python drop-in's _launch): the output in the
// query's shape, a workspace from torch's allocator, this call's stream. None where the
// query's device is not the current one (the Python path switches it) or the library refuses.
PyObject* run_sage(PyObject* const* args, const Route& r) {
  // (The route copied before anything that calls Python, which may let another thread clear
  // the table.)
  std::string a = r.args;
  const int64_t workspace_alloc = r.workspace_alloc;
  const at::Tensor& q = THPVariable_Unpack(args[0]);
  const at::Tensor& k = THPVariable_Unpack(args[1]);
  const at::Tensor& v = THPVariable_Unpack(args[2]);
  const c10::Device device = q.device();
  if (device.type() != c10::DeviceType::CUDA) Py_RETURN_NONE;
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  if (impl->getDevice().index() != device.index()) Py_RETURN_NONE;
  PyObject* index = PyLong_FromLong(device.index());
  PyObject* stream_obj = index ? PyObject_CallOneArg(g.raw_stream, index) : nullptr;
  Py_XDECREF(index);
  void* stream = stream_obj ? PyLong_AsVoidPtr(stream_obj) : nullptr;
  Py_XDECREF(stream_obj);
  if (PyErr_Occurred()) {  // (the Python path asks torch itself, and reports what fails)
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  at::Tensor o = at::empty(q.sizes(), q.options());
  // (Freed when this returns, the workspace goes only to work queued after the run on this
  // stream: torch's allocator reuses memory by stream.)
  at::Tensor workspace = at::empty({workspace_alloc}, q.options());
  put_pointer(a, g.q, q.data_ptr());
  put_pointer(a, g.k, k.data_ptr());
  put_pointer(a, g.v, v.data_ptr());
  put_pointer(a, g.o, o.data_ptr());
  put_pointer(a, g.stream, stream);
  put_pointer(a, g.workspace, workspace.data_ptr());
  int status;
  Py_BEGIN_ALLOW_THREADS
  status = g.run(&a[0]);
  Py_END_ALLOW_THREADS
  if (status != 0) Py_RETURN_NONE;  // the Python path runs it again and reports or falls back
  return THPVariable_Wrap(std::move(o));
}

using KeyFn = bool (*)(PyObject* const*, Key&);

// The route kept for this call's key, or nullptr: no key, none kept, or a mode active.
const Route* find(PyObject* const* args, KeyFn make) {
  Key key;
  if (!make(args, key)) return nullptr;
  const auto it = g_routes.find(key);
  if (it == g_routes.end() || modes_active()) return nullptr;
  return &it->second;
}

// What a kept route answers: torch's output (kTorch, kAliasTorch), sage's (kSage), or True
// (kAliasSage: the caller calls sageattn). The kinds a key's entry keeps are the entry's.
PyObject* run(PyObject* const* args, const Route& r) {
  switch (r.kind) {
    case kTorch: return run_torch(args);
    case kSage: return run_sage(args, r);
    case kAliasTorch: return run_alias_torch(args);
    default: Py_RETURN_TRUE;
  }
}

// An entry point's answer: its kept route's, or None (nothing kept for the key, a mode active,
// or any C++ exception, out of memory say: the Python path then runs the call and raises).
PyObject* answer(PyObject* const* args, Py_ssize_t nargs, Py_ssize_t want, const char* usage,
                 KeyFn make) {
  if (nargs != want) {
    PyErr_SetString(PyExc_TypeError, usage);
    return nullptr;
  }
  if (g_routes.empty()) Py_RETURN_NONE;
  try {
    const Route* r = find(args, make);
    if (r == nullptr) Py_RETURN_NONE;
    return run(args, *r);
  } catch (const std::exception&) {
    Py_RETURN_NONE;
  }
}

// call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa): a drop-in call.
PyObject* call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return answer(args, nargs, 8, "call takes the 8 arguments of the drop-in", make_key);
}

// sageattn(q, k, v, tensor_layout, is_causal, sm_scale, qk_bits, smooth_k, smooth_q, smooth_v,
// causal_align, kernel): an eager sageattn call without an LSE.
PyObject* sageattn(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return answer(args, nargs, 12, "sageattn takes 12 arguments", make_sageattn_key);
}

// alias(q, k, v, tensor_layout, is_causal, sm_scale, smooth_k, smooth_v): an official-API alias
// call (True: its route is sageattn, which the caller then calls).
PyObject* alias(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return answer(args, nargs, 8, "alias takes 8 arguments", make_alias_key);
}

// A route of `kind` from its args and workspace_alloc (kSage needs configure() first).
bool parse_route(long kind, PyObject* args_obj, PyObject* alloc_obj, Route& r) {
  r.kind = kind;
  if (kind == kSage) {
    char* data;
    Py_ssize_t size;
    if (!g.set || PyBytes_AsStringAndSize(args_obj, &data, &size) < 0) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "configure() first");
      return false;
    }
    if (size != g.size) {
      PyErr_SetString(PyExc_ValueError, "args: not a sage_attention_args of the configured size");
      return false;
    }
    r.args.assign(data, size);
    r.workspace_alloc = PyLong_AsLongLong(alloc_obj);
    if (r.workspace_alloc == -1 && PyErr_Occurred()) return false;
    if (r.workspace_alloc < 1) {
      PyErr_SetString(PyExc_ValueError, "workspace_alloc: at least one element");
      return false;
    }
  } else if (kind != kTorch) {
    PyErr_SetString(PyExc_ValueError, "kind: 1 (torch) or 2 (sage)");
    return false;
  }
  return true;
}

// Keeps r under this call's key: True, or False where the call has no key.
PyObject* keep(PyObject* const* args, KeyFn make, Route&& r) {
  try {
    Key key;
    if (!make(args, key)) Py_RETURN_FALSE;
    if (g_routes.size() >= kMaxRoutes) g_routes.clear();
    g_routes[key] = std::move(r);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  Py_RETURN_TRUE;
}

// remember(query, ..., enable_gqa, kind, args, workspace_alloc): keep the route the Python
// drop-in chose for this call's signature. True where kept.
PyObject* remember(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 11) {
    PyErr_SetString(PyExc_TypeError, "remember takes the call's 8 arguments and its route's 3");
    return nullptr;
  }
  const long kind = PyLong_AsLong(args[8]);
  if (kind == -1 && PyErr_Occurred()) return nullptr;
  Route r;
  if (!parse_route(kind, args[9], args[10], r)) return nullptr;
  return keep(args, make_key, std::move(r));
}

// remember_alias(q, k, v, tensor_layout, is_causal, sm_scale, smooth_k, smooth_v, kind): keep the
// alias's route (kAliasTorch or kAliasSage) for the call's key. True where kept.
PyObject* remember_alias(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 9) {
    PyErr_SetString(PyExc_TypeError, "remember_alias takes the alias's 8 arguments and a kind");
    return nullptr;
  }
  const long kind = PyLong_AsLong(args[8]);
  if (kind == -1 && PyErr_Occurred()) return nullptr;
  if (kind != kAliasTorch && kind != kAliasSage) {
    PyErr_SetString(PyExc_ValueError, "kind: 3 (torch) or 4 (sageattn)");
    return nullptr;
  }
  Route r;
  r.kind = kind;
  return keep(args, make_alias_key, std::move(r));
}

// remember_sageattn(q, ..., kernel, args, workspace_alloc): keep the plan of an eager sageattn
// call. True where kept.
PyObject* remember_sageattn(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 14) {
    PyErr_SetString(PyExc_TypeError, "remember_sageattn takes sageattn's 12 arguments and 2");
    return nullptr;
  }
  Route r;
  if (!parse_route(kSage, args[12], args[13], r)) return nullptr;
  return keep(args, make_sageattn_key, std::move(r));
}

// configure(offsets, run, raw_stream): offsets of q, k, v, o, stream, workspace in
// sage_attention_args and its size; the address of the library's sage_attention; the raw stream
// getter.
PyObject* configure(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || !PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) != 7 ||
      !PyCallable_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError, "configure(offsets: 7-tuple, run: int, raw_stream)");
    return nullptr;
  }
  Py_ssize_t off[7];
  for (int i = 0; i < 7; ++i) {
    off[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(args[0], i));
    if (off[i] == -1 && PyErr_Occurred()) return nullptr;
  }
  for (int i = 0; i < 6; ++i) {
    if (off[i] < 0 || off[i] + static_cast<Py_ssize_t>(sizeof(void*)) > off[6]) {
      PyErr_SetString(PyExc_ValueError, "offsets: a pointer outside the struct");
      return nullptr;
    }
  }
  void* run = PyLong_AsVoidPtr(args[1]);
  if (run == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "run: a null address");
    return nullptr;
  }
  g.q = off[0], g.k = off[1], g.v = off[2], g.o = off[3], g.stream = off[4];
  g.workspace = off[5], g.size = off[6];
  g.run = reinterpret_cast<int (*)(void*)>(run);
  Py_INCREF(args[2]);
  Py_XDECREF(g.raw_stream);
  g.raw_stream = args[2];
  g.set = true;
  g_routes.clear();
  Py_RETURN_NONE;
}

PyObject* clear(PyObject*, PyObject*) {
  g_routes.clear();
  Py_RETURN_NONE;
}

PyObject* size(PyObject*, PyObject*) { return PyLong_FromSize_t(g_routes.size()); }

PyMethodDef methods[] = {
    {"call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call)), METH_FASTCALL,
     "The output of a call whose route is remembered, or None."},
    {"remember", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(remember)),
     METH_FASTCALL, "Keep a route for the call's signature."},
    {"sageattn", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(sageattn)),
     METH_FASTCALL, "The output of an eager sageattn call whose plan is remembered, or None."},
    {"alias", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(alias)), METH_FASTCALL,
     "For a kept call of the official-API alias: torch's output, True (sageattn), or None."},
    {"remember_alias",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(remember_alias)), METH_FASTCALL,
     "Keep the official-API alias's route for the call."},
    {"remember_sageattn",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(remember_sageattn)),
     METH_FASTCALL, "Keep the plan of an eager sageattn call."},
    {"configure", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(configure)),
     METH_FASTCALL, "The library's struct offsets, run entry point and stream getter."},
    {"clear", clear, METH_NOARGS, "Forget every route."},
    {"size", size, METH_NOARGS, "Routes kept."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_dropin_fast", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__dropin_fast() { return PyModule_Create(&module); }
