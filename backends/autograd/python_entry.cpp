// The ops' Python entry points: what `opreg.get(op)` returns for the ops listed below.
//
// Why: `torch.ops.opreg.<op>.default(...)` converts its arguments by walking the schema into a
// stack of IValues (the boxed call), which costs more host time than the op's whole GEMM path
// adds to eager: 1.3 us more than `torch.cat`'s own binding for two parts on the 2-core dev
// box, 2.7 us for 32 (`torch.ops.aten.cat.default` vs `torch.cat`), and on the H200's host the
// cat_linear op lost 4-10 us per call to eager's `cat` + `F.linear` where it runs those very
// kernels (bench/sweep.py, 2026-12-02). These functions parse their arguments the way torch's
// own bindings do (PythonArgParser) and call the op through a typed dispatcher handle: the
// same dispatch (every key, opreg's `use()` router, the C++ or Python autograd), without the
// boxing.
//
// Anything beyond plain tensors in eager mode goes through the OpOverload instead, so its
// meaning is the dispatcher's own: a `__torch_function__` (subclass or mode), a
// `__torch_dispatch__` mode or a tensor with the Python key (fake, functional and proxy tensors
// while tracing), or the Python dispatcher. The OpOverloads are handed over by
// opreg/_entry.py (set_fallback) before any entry is returned.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/PythonDispatcherTLS.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/utils/python_arg_parser.h>

#include <optional>

namespace opreg {
namespace {

using OptTensor = std::optional<at::Tensor>;

enum Entry { kCatLinear, kCatLinearStacked, kScatterCombine, kEntries };
constexpr const char* kNames[kEntries] = {"cat_linear", "cat_linear_stacked", "scatter_combine"};
PyObject* fallback[kEntries] = {};  // the OpOverloads (strong references, for good)

bool plain(const at::Tensor& t) {
  return !t.defined() || !t.key_set().has(c10::DispatchKey::Python);
}

// May this call skip the OpOverload? (The parser has already seen __torch_function__.)
bool plain_call(torch::PythonArgs& r, std::initializer_list<const at::Tensor*> ts,
                at::TensorList more = {}) {
  if (r.has_torch_function() || c10::impl::TorchDispatchModeTLS::any_modes_set() ||
      c10::impl::PythonDispatcherTLS::get_state() != nullptr) {
    return false;
  }
  for (const at::Tensor* t : ts) {
    if (!plain(*t)) return false;
  }
  for (const at::Tensor& t : more) {
    if (!plain(t)) return false;
  }
  return true;
}

PyObject* call_fallback(Entry e, PyObject* args, PyObject* kwargs) {
  TORCH_CHECK(fallback[e] != nullptr, "opreg: the entry for ", kNames[e], " has no fallback set");
  return PyObject_Call(fallback[e], args, kwargs);
}

template <typename Sig>
c10::TypedOperatorHandle<Sig> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// The op called without the GIL (as torch's own bindings call theirs), its result wrapped.
template <typename Op, typename... Args>
PyObject* call_released(const Op& op, Args&&... args) {
  at::Tensor out;
  {
    pybind11::gil_scoped_release no_gil;
    out = op.call(std::forward<Args>(args)...);
  }
  return THPVariable_Wrap(std::move(out));
}

PyObject* cat_linear(PyObject*, PyObject* args, PyObject* kwargs) {
  HANDLE_TH_ERRORS
  static torch::PythonArgParser parser({"cat_linear(TensorList parts, Tensor weight, Tensor? bias)"});
  static const auto op =
      handle<at::Tensor(at::TensorList, const at::Tensor&, const OptTensor&)>("opreg::cat_linear");
  torch::ParsedArgs<3> parsed;
  torch::PythonArgs r = parser.parse(args, kwargs, parsed);
  const std::vector<at::Tensor> parts = r.tensorlist(0);
  const at::Tensor weight = r.tensor(1);
  const OptTensor bias = r.optionalTensor(2);
  const at::Tensor none;
  if (!plain_call(r, {&weight, bias ? &*bias : &none}, parts)) {
    return call_fallback(kCatLinear, args, kwargs);
  }
  return call_released(op, parts, weight, bias);
  END_HANDLE_TH_ERRORS
}

PyObject* cat_linear_stacked(PyObject*, PyObject* args, PyObject* kwargs) {
  HANDLE_TH_ERRORS
  static torch::PythonArgParser parser(
      {"cat_linear_stacked(Tensor x, int64_t dim, Tensor weight, Tensor? bias)"});
  static const auto op =
      handle<at::Tensor(const at::Tensor&, int64_t, const at::Tensor&, const OptTensor&)>(
          "opreg::cat_linear_stacked");
  torch::ParsedArgs<4> parsed;
  torch::PythonArgs r = parser.parse(args, kwargs, parsed);
  const at::Tensor x = r.tensor(0), weight = r.tensor(2);
  const OptTensor bias = r.optionalTensor(3);
  const at::Tensor none;
  if (!plain_call(r, {&x, &weight, bias ? &*bias : &none})) {
    return call_fallback(kCatLinearStacked, args, kwargs);
  }
  return call_released(op, x, r.toInt64(1), weight, bias);
  END_HANDLE_TH_ERRORS
}

PyObject* scatter_combine(PyObject*, PyObject* args, PyObject* kwargs) {
  HANDLE_TH_ERRORS
  static torch::PythonArgParser parser(
      {"scatter_combine(Tensor expert_hidden, Tensor token_idx, Tensor gates, SymInt num_tokens)"});
  static const auto op =
      handle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::SymInt)>(
          "opreg::scatter_combine");
  torch::ParsedArgs<4> parsed;
  torch::PythonArgs r = parser.parse(args, kwargs, parsed);
  const at::Tensor h = r.tensor(0), idx = r.tensor(1), g = r.tensor(2);
  if (!plain_call(r, {&h, &idx, &g})) {
    return call_fallback(kScatterCombine, args, kwargs);
  }
  return call_released(op, h, idx, g, r.toSymInt(3));
  END_HANDLE_TH_ERRORS
}

// set_fallback(name, op): the callable that takes the calls `plain_call` refuses.
PyObject* set_fallback(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  const char* name = nullptr;
  PyObject* fn = nullptr;
  if (!PyArg_ParseTuple(args, "sO:set_fallback", &name, &fn)) return nullptr;
  for (int e = 0; e < kEntries; ++e) {
    if (std::string(name) == kNames[e]) {
      Py_INCREF(fn);
      Py_XDECREF(fallback[e]);
      fallback[e] = fn;
      Py_RETURN_NONE;
    }
  }
  TORCH_CHECK_VALUE(false, "opreg: no Python entry is named ", name);
  END_HANDLE_TH_ERRORS
}

#define OPREG_ENTRY(fn, doc) \
  {#fn, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fn)), METH_VARARGS | METH_KEYWORDS, doc}

PyMethodDef methods[] = {
    OPREG_ENTRY(cat_linear, "cat_linear(parts, weight, bias) -> Tensor: torch.ops.opreg.cat_linear"),
    OPREG_ENTRY(cat_linear_stacked,
                "cat_linear_stacked(x, dim, weight, bias) -> Tensor: torch.ops.opreg.cat_linear_stacked"),
    OPREG_ENTRY(scatter_combine,
                "scatter_combine(expert_hidden, token_idx, gates, num_tokens) -> Tensor: "
                "torch.ops.opreg.scatter_combine"),
    {"set_fallback", set_fallback, METH_VARARGS, "set_fallback(name, op): where non-plain calls go"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace
}  // namespace opreg

// The library is loaded with torch.ops.load_library (its TORCH_LIBRARY_IMPL registrations)
// and then imported as this module by opreg/_entry.py.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  TORCH_CHECK(PyModule_AddFunctions(m.ptr(), opreg::methods) == 0, "opreg: adding the entries failed");
}
