// _C.structured.FastFill: the StructuredOutputManager's whole per-call fast path, in C++.
//
// The manager installs `FastFill.fill_bitmask` (a METH_FASTCALL builtin bound to the object) as its
// instance attribute `fill_bitmask`, so `mgr.fill_bitmask(batch)` enters here without a Python frame of
// ours. One call:
//   1. walks the batch (a list / tuple of (request_id, drafts) pairs), looks every request id up in the
//      manager's `keys` dict (request id -> the backend's batch key; the same dict object the manager
//      keeps current) and copies the drafts (exact ints in [0, vocab)) into a C++ vector;
//   2. fills the rows through the library: xgrammar, one call of its BatchGrammarMatcher handle per draft
//      depth (drafts accepted inline on xgrammar's own matcher handles); llguidance, one
//      `unsafe_compute_mask_ptr` per row on the LLMatcher under our wrapper;
//   3. rolls the drafts back, copies unused draft rows, clears padding bits and finds dead rows (the
//      scans of scan.h) and returns the manager's cached draft-free BatchMask or a fresh one.
// Anything unusual returns the Python method's result instead (`fallback`): `out=`, a batch that is not
// a list / tuple of pairs, a request id without a key (unknown, compiling, finished), a draft that is
// not an int in range, and a library RuntimeError / TypeError (the Python path then raises the clear
// error or handles the case, as before). Rare outcomes (a dead row, an llguidance matcher in its error
// state or after EOS) are finished by small Python methods of the manager (`_fast_dead`,
// `_drafts_tail`), so their rules live in one place.
//
// References: FastFill holds the keys / views dicts, the library callables and a *weak* reference to
// the manager (the manager holds FastFill through its fill_bitmask attribute; a strong reference back
// would be a cycle the GC cannot see through a nanobind object).
#include "structured/fastfill.h"

#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <utility>
#include <vector>

#include "structured/scan.h"

namespace di_structured {

Names N{};

FastFill::FastFill(int kind, nb::dict keys, nb::dict views, nb::handle manager, nb::object fallback,
                   nb::object fill_keys, nb::object accept_key, nb::object batch_mask_type, nb::object np_empty,
                   nb::object np_zeros, nb::object dt_int64, nb::object dt_bool, int64_t words, int64_t vocab,
                   int64_t tail_keep, int64_t eos, const std::vector<int64_t>& refuse)
    : kind_(kind), keys_(std::move(keys)), views_(std::move(views)), fallback_(std::move(fallback)),
      fill_keys_(std::move(fill_keys)), accept_key_(std::move(accept_key)), bm_type_(std::move(batch_mask_type)),
      np_empty_(std::move(np_empty)), np_zeros_(std::move(np_zeros)), dt_int64_(std::move(dt_int64)),
      dt_bool_(std::move(dt_bool)), words_(words), vocab_(vocab), tail_keep_(tail_keep), eos_(eos) {
  if (kind != kXGrammar && kind != kLLGuidance) throw std::invalid_argument("kind: must be 0 (xgrammar) or 1 (llguidance)");
  if (words <= 0 || vocab <= 0 || vocab > words * 32) throw std::invalid_argument("words, vocab: need 0 < vocab <= 32 * words");
  if (tail_keep < -1 || tail_keep > 0xFFFFFFFFLL) throw std::invalid_argument("tail_keep: -1 or a 32-bit mask");
  if (eos < 0 || eos >= vocab) throw std::invalid_argument("eos: must be a token id in [0, vocab)");
  if (kind == kXGrammar && !PyCallable_Check(fill_keys_.ptr())) throw std::invalid_argument("fill_keys: must be callable for xgrammar");
  if (kind == kLLGuidance && !PyCallable_Check(accept_key_.ptr())) throw std::invalid_argument("accept_key: must be callable for llguidance");
  manager_ = own(PyWeakref_NewRef(manager.ptr(), nullptr));
  // A bound method (xgrammar's handle method) is called as function(self, ...): the interpreter
  // does the same for a method call, and going through the method object costs more from C.
  if (kind == kXGrammar && PyMethod_Check(fill_keys_.ptr())) {
    fill_self_ = nb::borrow(PyMethod_GET_SELF(fill_keys_.ptr()));
    fill_keys_ = nb::borrow(PyMethod_GET_FUNCTION(fill_keys_.ptr()));
  }
  refuse_.assign(static_cast<size_t>(vocab), 0);
  for (int64_t t : refuse) {
    if (t < 0 || t >= vocab) throw std::invalid_argument("refuse: token ids must be in [0, vocab)");
    refuse_[static_cast<size_t>(t)] = 1;
  }
  nbytes_ = own(PyLong_FromLongLong(words * 4));
  // BatchMask is an attrs frozen slots class: setting its four slots through their member descriptors
  // builds the same object as its __init__ (~0.1 us instead of ~1 us); any other class is called.
  const char* fields[4] = {"bitmask", "offsets", "num_drafts", "dead_end"};
  slots_ok_ = PyType_Check(bm_type_.ptr());
  for (int i = 0; i < 4; ++i) {
    slot_[i] = own(PyObject_GetAttrString(bm_type_.ptr(), fields[i]));
    slots_ok_ = slots_ok_ && Py_TYPE(slot_[i].ptr()) == &PyMemberDescr_Type;
  }
}

nb::object FastFill::fill(nb::handle batch, nb::handle out) {
  PyObject* b = batch.ptr();
  if (!out.is_none()) return fallback(batch, out);
  const bool is_list = PyList_CheckExact(b);
  if (!is_list && !PyTuple_CheckExact(b)) return fallback(batch, out);
  const Py_ssize_t n = Py_SIZE(b);
  if (n == 0) return fallback(batch, out);
  // A tuple: xgrammar converts it ~50 ns faster than a list at batch 1 (and it cannot change under us).
  nb::object keys = own(PyTuple_New(n));
  lens_.assign(static_cast<size_t>(n), 0);
  starts_.assign(static_cast<size_t>(n), 0);
  st_.assign(static_cast<size_t>(n), 0);
  toks_.clear();
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (i >= Py_SIZE(b)) return fallback(batch, out);  // mutated by a request id's __eq__: give up
    nb::object item = nb::borrow(is_list ? PyList_GET_ITEM(b, i) : PyTuple_GET_ITEM(b, i));
    PyObject *rid, *drafts;
    if (PyTuple_CheckExact(item.ptr()) && PyTuple_GET_SIZE(item.ptr()) == 2) {
      rid = PyTuple_GET_ITEM(item.ptr(), 0);
      drafts = PyTuple_GET_ITEM(item.ptr(), 1);
    } else if (PyList_CheckExact(item.ptr()) && PyList_GET_SIZE(item.ptr()) == 2) {
      rid = PyList_GET_ITEM(item.ptr(), 0);
      drafts = PyList_GET_ITEM(item.ptr(), 1);
    } else {
      return fallback(batch, out);
    }
    Py_INCREF(drafts);  // the item may be a list; keep what we read alive across the lookup
    nb::object d = nb::steal(drafts);
    PyObject* key = PyDict_GetItemWithError(keys_.ptr(), rid);
    if (key == nullptr) {
      if (PyErr_Occurred()) PyErr_Clear();  // e.g. an unhashable id: the Python path says what is wrong
      return fallback(batch, out);
    }
    Py_INCREF(key);
    PyTuple_SET_ITEM(keys.ptr(), i, key);
    if (u8_ != nullptr) {
      PyObject* sv = PyDict_GetItemWithError(u8_states_.ptr(), rid);
      if (sv == nullptr || !PyLong_CheckExact(sv)) {
        if (PyErr_Occurred()) PyErr_Clear();
        return fallback(batch, out);
      }
      const long s = PyLong_AsLong(sv);
      if (s < 0 || s >= ByteFilter::kStates) {
        if (PyErr_Occurred()) PyErr_Clear();
        return fallback(batch, out);
      }
      st_[static_cast<size_t>(i)] = static_cast<int>(s);
    }
    if (!read_drafts(d.ptr(), static_cast<size_t>(i))) return fallback(batch, out);
  }
  if (toks_.empty()) return draft_free(batch, keys, n);
  return drafted(batch, keys, n);
}

bool FastFill::read_drafts(PyObject* d, size_t i) {
  Py_ssize_t k;
  if (PyList_CheckExact(d)) {
    k = PyList_GET_SIZE(d);
  } else if (PyTuple_CheckExact(d)) {
    k = PyTuple_GET_SIZE(d);
  } else {
    return false;
  }
  starts_[i] = toks_.size();
  lens_[i] = k;
  for (Py_ssize_t j = 0; j < k; ++j) {
    PyObject* t = PyList_CheckExact(d) ? PyList_GET_ITEM(d, j) : PyTuple_GET_ITEM(d, j);
    if (!PyLong_CheckExact(t)) return false;
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(t, &overflow);
    if (overflow != 0 || v < 0 || v >= vocab_) return false;
    toks_.push_back(v);
  }
  return true;
}

nb::object FastFill::manager() {
  nb::object m = own(PyObject_CallNoArgs(manager_.ptr()));
  if (m.is_none()) throw std::runtime_error("StructuredOutputManager: this fill_bitmask outlived its manager");
  return m;
}

nb::object FastFill::call_manager(PyObject* name, std::initializer_list<PyObject*> args) {
  nb::object m = manager();
  PyObject* argv[8];
  size_t k = 0;
  argv[k++] = m.ptr();
  for (PyObject* a : args) argv[k++] = a;
  return own(PyObject_VectorcallMethod(name, argv, k, nullptr));
}

nb::object FastFill::fallback(nb::handle batch, nb::handle out) {
  ++fallback_calls_;
  nb::object m = manager();
  PyObject* argv[3] = {m.ptr(), batch.ptr(), out.ptr()};
  return own(PyObject_Vectorcall(fallback_.ptr(), argv, 3, nullptr));
}

nb::object FastFill::general(nb::handle batch) {
  ++fallback_calls_;
  return call_manager(N.fill_general, {batch.ptr()});
}

const View& FastFill::view(int64_t rows) {
  if (rows < static_cast<int64_t>(views_cache_.size()) && views_cache_[rows].tensor != nullptr) {
    return views_cache_[rows];
  }
  View v = lookup_view(rows);
  if (rows >= static_cast<int64_t>(views_cache_.size())) views_cache_.resize(static_cast<size_t>(rows) + 1);
  views_cache_[rows] = std::move(v);
  return views_cache_[rows];
}

View FastFill::lookup_view(int64_t rows) {
  View v;
  nb::object k = own(PyLong_FromLongLong(rows));
  PyObject* e = PyDict_GetItemWithError(views_.ptr(), k.ptr());
  if (e != nullptr) {
    v.entry = nb::borrow(e);
  } else {
    if (PyErr_Occurred()) throw nb::python_error();
    v.entry = call_manager(N.fast_view, {k.ptr()});
  }
  PyObject* t = v.entry.ptr();
  if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) != 3) throw std::runtime_error("_fast_view: expected (tensor, ptr, mask)");
  v.tensor = PyTuple_GET_ITEM(t, 0);
  const unsigned long long p = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, 1));
  if (p == static_cast<unsigned long long>(-1) && PyErr_Occurred()) throw nb::python_error();
  v.data = reinterpret_cast<uint32_t*>(static_cast<uintptr_t>(p));
  v.same = PyTuple_GET_ITEM(t, 2);
  return v;
}

PyObject* FastFill::xgr_fill(PyObject* keys, PyObject* tensor, PyObject* rows) {
  PyObject* argv[5] = {fill_self_.ptr(), keys, tensor, rows, Py_False};
  if (fill_self_.is_valid()) return PyObject_Vectorcall(fill_keys_.ptr(), argv, 5, nullptr);
  return PyObject_Vectorcall(fill_keys_.ptr(), argv + 1, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
}

void FastFill::llg_compute(PyObject* key, uintptr_t addr) {
  nb::object m = own(slot_m_.get(key, N.m));
  nb::object p = own(PyLong_FromUnsignedLongLong(addr));
  PyObject* argv[3] = {m.ptr(), p.ptr(), nbytes_.ptr()};
  own(m_compute_.call(N.compute, argv, 3));
}

bool FastFill::llg_terminated(PyObject* key) {
  nb::object t = own(slot_terminated_.get(key, N.terminated));
  return truthy(t.ptr());
}

bool FastFill::llg_error(PyObject* key) {
  nb::object m = own(slot_m_.get(key, N.m));
  PyObject* argv[1] = {m.ptr()};
  return truthy(own(m_is_error_.call(N.is_error, argv, 1)).ptr());
}

bool FastFill::suspicious(uint32_t* row) {
  clear_tail(row, words_, tail_keep_);
  const int64_t w = first_nonzero(row, words_);
  return w == words_ || (w == eos_ / 32 && only_eos(row, words_, eos_));
}

void FastFill::llg_fill_row(PyObject* key, const View& v, int64_t row) {
  uint32_t* r = v.data + row * words_;
  if (llg_terminated(key)) {
    std::memset(r, 0, static_cast<size_t>(words_) * 4);
    return;
  }
  llg_compute(key, reinterpret_cast<uintptr_t>(r));
  if (suspicious(r) && llg_error(key)) {
    nb::object rr = own(PyLong_FromLongLong(row));
    PyObject* argv[3] = {key, v.tensor, rr.ptr()};
    own(PyObject_VectorcallMethod(N.recover, argv, 3, nullptr));
  }
}

nb::object FastFill::draft_free(nb::handle batch, nb::handle keys, Py_ssize_t n) {
  const View v = view(n);  // a copy: Python called below may invalidate the cache
  if (kind_ == kXGrammar) {
    PyObject* r = xgr_fill(keys.ptr(), v.tensor, Py_None);
    if (r == nullptr) {
      // A matcher past EOS (stepped outside the manager): xgrammar raises before changing state.
      if (PyErr_ExceptionMatches(PyExc_RuntimeError)) {
        PyErr_Clear();
        return general(batch);
      }
      throw nb::python_error();
    }
    Py_DECREF(r);
  } else {
    // The bare library loop: no per-row checks; suspicious rows are checked after the scan.
    uintptr_t p = reinterpret_cast<uintptr_t>(v.data);
    for (Py_ssize_t i = 0; i < n; ++i, p += static_cast<uintptr_t>(words_) * 4) {
      llg_compute(PyTuple_GET_ITEM(keys.ptr(), i), p);
    }
  }
  dead_.clear();
  eos_only_.clear();
  const int64_t check_eos = kind_ == kLLGuidance ? eos_ : -1;
  auto scan = [&] {
    for (Py_ssize_t r = 0; r < n; ++r) {
      uint32_t* row = v.data + r * words_;
      if (u8_ != nullptr) u8_->apply_row(row, st_[static_cast<size_t>(r)]);
      clear_tail(row, words_, tail_keep_);
      const int64_t w = first_nonzero(row, words_);
      if (w == words_) {
        dead_.push_back(r);
      } else if (check_eos >= 0 && w == check_eos / 32 && only_eos(row, words_, check_eos)) {
        eos_only_.push_back(r);
      }
    }
  };
  // A live row costs a few word reads: for a small batch releasing the GIL costs about as much.
  if (n < 64) {
    scan();
  } else {
    nb::gil_scoped_release release;
    scan();
  }
  bool tail = !dead_.empty();
  for (size_t j = 0; j < eos_only_.size() && !tail; ++j) {
    // Only EOS allowed: legitimate at a grammar's end; an error state or EOS taken needs the tail.
    PyObject* key = PyTuple_GET_ITEM(keys.ptr(), eos_only_[j]);
    tail = llg_terminated(key) || llg_error(key);
  }
  if (tail) {
    ++tail_calls_;
    nb::object p = own(PyLong_FromUnsignedLongLong(reinterpret_cast<uintptr_t>(v.data)));
    nb::object nn = own(PyLong_FromSsize_t(n));
    return call_manager(N.fast_dead, {batch.ptr(), keys.ptr(), v.tensor, p.ptr(), nn.ptr()});
  }
  ++fast_calls_;
  if (v.same != Py_None) return nb::borrow(v.same);
  nb::object nn = own(PyLong_FromSsize_t(n));
  nb::object same = call_manager(N.same_mask, {nn.ptr()});
  invalidate_row(n);  // its _fast_views entry now holds the mask: read it again next time
  return same;
}

namespace {

// fill as a METH_FASTCALL builtin bound to the FastFill instance: the interpreter calls it directly,
// without nanobind's overload dispatch (~40 ns of the batch-1 call).
PyObject* fill_fastcall(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  PyObject* argv[2] = {nullptr, Py_None};
  const Py_ssize_t nkw = kwnames == nullptr ? 0 : PyTuple_GET_SIZE(kwnames);
  if (nargs > 2) {
    PyErr_Format(PyExc_TypeError, "fill_bitmask() takes at most 2 positional arguments (%zd given)", nargs);
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < nargs; ++i) argv[i] = args[i];
  for (Py_ssize_t k = 0; k < nkw; ++k) {
    PyObject* name = PyTuple_GET_ITEM(kwnames, k);
    const int slot = PyUnicode_CompareWithASCIIString(name, "batch") == 0 ? 0
                     : PyUnicode_CompareWithASCIIString(name, "out") == 0 ? 1 : -1;
    if (slot < 0 || (slot < nargs)) {
      PyErr_Format(PyExc_TypeError, "fill_bitmask() got an unexpected or repeated keyword argument %R", name);
      return nullptr;
    }
    argv[slot] = args[nargs + k];
  }
  if (argv[0] == nullptr) {
    PyErr_SetString(PyExc_TypeError, "fill_bitmask() missing required argument 'batch'");
    return nullptr;
  }
  try {
    return nb::inst_ptr<FastFill>(self)->fill(argv[0], argv[1]).release().ptr();
  } catch (nb::python_error& e) {
    e.restore();
  } catch (const std::invalid_argument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

PyMethodDef fill_def = {"fill_bitmask", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fill_fastcall)),
                        METH_FASTCALL | METH_KEYWORDS,
                        "fill_bitmask(batch, out=None): StructuredOutputManager.fill_bitmask in C++."};

}  // namespace

void FastFill::set_utf8(nb::object filter, nb::object states) {
  if (filter.is_none()) {
    u8_ = nullptr;
    u8_keep_ = nb::object();
    u8_states_ = nb::dict();
    return;
  }
  const ByteFilter* f = nb::cast<const ByteFilter*>(filter);
  if (f->vocab() != vocab_ || f->words() != words_) throw std::invalid_argument("filter: vocab / words differ from this FastFill's");
  if (!PyDict_CheckExact(states.ptr())) throw std::invalid_argument("states: must be a dict (request id -> state)");
  u8_keep_ = filter;
  u8_states_ = nb::borrow<nb::dict>(states);
  u8_ = f;
}

void register_fastfill(nb::module_& m) {
  N = Names{intern("accept_token"), intern("rollback"), intern("_m"), intern("_terminated"),
            intern("unsafe_compute_mask_ptr"), intern("is_error"), intern("try_consume_tokens"), intern("_history"),
            intern("_recover"), intern("_fast_view"), intern("_same_mask"), intern("_fast_dead"),
            intern("_drafts_tail"), intern("_fill_general")};
  nb::class_<FastFill>(m, "FastFill",
                       "The StructuredOutputManager's per-call fast path (built by the manager; see manager.py).")
      .def(nb::init<int, nb::dict, nb::dict, nb::handle, nb::object, nb::object, nb::object, nb::object, nb::object,
                    nb::object, nb::object, nb::object, int64_t, int64_t, int64_t, int64_t, const std::vector<int64_t>&>(),
           nb::arg("kind"), nb::arg("keys"), nb::arg("views"), nb::arg("manager"), nb::arg("fallback"),
           nb::arg("fill_keys").none(), nb::arg("accept_key").none(), nb::arg("batch_mask_type"), nb::arg("np_empty"),
           nb::arg("np_zeros"), nb::arg("dt_int64"), nb::arg("dt_bool"), nb::arg("words"), nb::arg("vocab"),
           nb::arg("tail_keep"), nb::arg("eos"), nb::arg("refuse"))
      .def("fill", &FastFill::fill, nb::arg("batch"), nb::arg("out").none() = nb::none(),
           "StructuredOutputManager.fill_bitmask(batch, out=None).")
      .def_prop_ro(
          "fill_bitmask",
          [](nb::handle self) { return nb::steal(PyCFunction_NewEx(&fill_def, self.ptr(), nullptr)); },
          "fill as a plain builtin bound to this object (what the manager installs as its fill_bitmask).")
      .def("set_utf8", &FastFill::set_utf8, nb::arg("filter").none(), nb::arg("states").none(),
           "Intersect every row with the byte filter's mask of its request's state (states: the manager's "
           "dict request id -> state); None, None turns it off.")
      .def("invalidate", &FastFill::invalidate, "Forget the cached buffer views (the manager's buffer changed).")
      .def_prop_ro("fast_calls", &FastFill::fast_calls, "Calls answered entirely here.")
      .def_prop_ro("tail_calls", &FastFill::tail_calls, "Calls finished by the manager's dead-row methods.")
      .def_prop_ro("fallback_calls", &FastFill::fallback_calls, "Calls handed to the Python path.");
}

}  // namespace di_structured
