// _C.structured.FastFill: the StructuredOutputManager's whole per-call fast path, in C++.
//
// The manager assigns `FastFill.fill` (a bound method) to its instance attribute `fill_bitmask`, so
// `mgr.fill_bitmask(batch)` enters here without a Python frame of ours. One call:
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
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>
#include <structmember.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <utility>
#include <vector>

#include "structured/fastfill.h"
#include "structured/scan.h"

namespace nb = nanobind;

namespace di_structured {
namespace {

using di_structured::clear_tail;
using di_structured::first_nonzero;
using di_structured::only_eos;

enum Kind : int { kXGrammar = 0, kLLGuidance = 1 };

struct Names {
  PyObject *accept_token, *rollback, *m, *terminated, *compute, *is_error, *try_consume, *history, *recover,
      *fast_view, *same_mask, *fast_dead, *drafts_tail, *fill_general;
};
Names N{};

PyObject* intern(const char* s) {
  PyObject* o = PyUnicode_InternFromString(s);
  if (o == nullptr) throw nb::python_error();
  return o;  // kept for the life of the process, like CPython's own identifiers
}

inline nb::object own(PyObject* o) {
  if (o == nullptr) throw nb::python_error();
  return nb::steal(o);
}

inline bool truthy(PyObject* o) {
  if (o == Py_True) return true;
  if (o == Py_False || o == Py_None) return false;
  const int t = PyObject_IsTrue(o);
  if (t < 0) throw nb::python_error();
  return t != 0;
}

// The error the Python fast path answered by taking the general path (it raised these before changing
// state, or after rolling every matcher back).
inline bool general_path_error() {
  return PyErr_ExceptionMatches(PyExc_RuntimeError) || PyErr_ExceptionMatches(PyExc_TypeError);
}

// Per call site caches of what the interpreter's specialising instructions cache for Python code
// (measured: ~40 ns per llguidance row without them, ~5% of a byte-vocabulary row).
//
// A slot of a __slots__ class read by offset, for objects of exactly the type seen first (another
// type, a non-object slot or an unset one goes through PyObject_GetAttr, which also raises properly).
struct SlotCache {
  PyTypeObject* type = nullptr;
  Py_ssize_t offset = -1;
  nb::object keep;  // the type: its address must not be reused by another while cached

  PyObject* get(PyObject* obj, PyObject* name) {  // new reference, nullptr with an error set
    PyTypeObject* t = Py_TYPE(obj);
    if (t != type) {
      type = t;
      offset = -1;
      keep = nb::borrow(reinterpret_cast<PyObject*>(t));
      PyObject* raw = _PyType_Lookup(t, name);  // borrowed, no descriptor call
      if (raw != nullptr && Py_TYPE(raw) == &PyMemberDescr_Type) {
        PyMemberDef* def = reinterpret_cast<PyMemberDescrObject*>(raw)->d_member;
        if (def->type == T_OBJECT_EX && !(def->flags & READ_RESTRICTED)) offset = def->offset;
      }
    }
    if (offset >= 0) {
      PyObject* v = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + offset);
      if (v != nullptr) {
        Py_INCREF(v);
        return v;
      }
    }
    return PyObject_GetAttr(obj, name);
  }
};

// obj.name(*args) with the unbound function cached per type when the type's attribute is a method
// descriptor (Py_TPFLAGS_METHOD_DESCRIPTOR: the rule by which CPython itself calls it unbound);
// argv[0] is obj.
struct MethodCache {
  PyTypeObject* type = nullptr;
  PyObject* func = nullptr;  // borrowed from the type's dict; the type is kept alive below
  nb::object keep;

  PyObject* call(PyObject* name, PyObject* const* argv, size_t nargs) {
    PyTypeObject* t = Py_TYPE(argv[0]);
    if (t != type) {
      type = t;
      func = nullptr;
      keep = nb::borrow(reinterpret_cast<PyObject*>(t));
      PyObject* raw = _PyType_Lookup(t, name);
      if (raw != nullptr && PyType_HasFeature(Py_TYPE(raw), Py_TPFLAGS_METHOD_DESCRIPTOR)) {
        func = raw;
        keep = nb::make_tuple(nb::handle(reinterpret_cast<PyObject*>(t)), nb::handle(raw));
      }
    }
    if (func != nullptr) return PyObject_Vectorcall(func, argv, nargs, nullptr);
    return PyObject_VectorcallMethod(name, argv, nargs, nullptr);
  }
};

struct View {
  nb::object entry;  // (tensor, address, cached BatchMask | None), the manager's _fast_views[rows]
  PyObject* tensor = nullptr;
  uint32_t* data = nullptr;
  PyObject* same = nullptr;
};

class FastFill {
 public:
  FastFill(int kind, nb::dict keys, nb::dict views, nb::handle manager, nb::object fallback, nb::object fill_keys,
           nb::object accept_key, nb::object batch_mask_type, nb::object np_empty, nb::object np_zeros,
           nb::object dt_int64, nb::object dt_bool, int64_t words, int64_t vocab, int64_t tail_keep, int64_t eos,
           const std::vector<int64_t>& refuse)
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

  nb::object fill(nb::handle batch, nb::handle out) {
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
      if (!read_drafts(d.ptr(), static_cast<size_t>(i))) return fallback(batch, out);
    }
    if (toks_.empty()) return draft_free(batch, keys, n);
    return drafted(batch, keys, n);
  }

  void invalidate() { views_cache_.clear(); }

  uint64_t fast_calls() const { return fast_calls_; }
  uint64_t tail_calls() const { return tail_calls_; }
  uint64_t fallback_calls() const { return fallback_calls_; }

 private:
  // Drafts: a list / tuple of exact ints in [0, vocab); anything else is the Python path's business.
  bool read_drafts(PyObject* d, size_t i) {
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

  nb::object manager() {
    nb::object m = own(PyObject_CallNoArgs(manager_.ptr()));
    if (m.is_none()) throw std::runtime_error("StructuredOutputManager: this fill_bitmask outlived its manager");
    return m;
  }

  nb::object call_manager(PyObject* name, std::initializer_list<PyObject*> args) {
    nb::object m = manager();
    PyObject* argv[8];
    size_t k = 0;
    argv[k++] = m.ptr();
    for (PyObject* a : args) argv[k++] = a;
    return own(PyObject_VectorcallMethod(name, argv, k, nullptr));
  }

  nb::object fallback(nb::handle batch, nb::handle out) {
    ++fallback_calls_;
    nb::object m = manager();
    PyObject* argv[3] = {m.ptr(), batch.ptr(), out.ptr()};
    return own(PyObject_Vectorcall(fallback_.ptr(), argv, 3, nullptr));
  }

  nb::object general(nb::handle batch) {
    ++fallback_calls_;
    return call_manager(N.fill_general, {batch.ptr()});
  }

  // The manager's _fast_views[rows], cached here by row count: a dict lookup plus converting the
  // address back from a Python int cost ~0.1 us, a fifth of what this object adds at batch 1. The
  // manager calls invalidate() whenever it clears _fast_views (its buffer grew).
  const View& view(int64_t rows) {
    if (rows < static_cast<int64_t>(views_cache_.size()) && views_cache_[rows].tensor != nullptr) {
      return views_cache_[rows];
    }
    View v = lookup_view(rows);
    if (rows >= static_cast<int64_t>(views_cache_.size())) views_cache_.resize(static_cast<size_t>(rows) + 1);
    views_cache_[rows] = std::move(v);
    return views_cache_[rows];
  }

  View lookup_view(int64_t rows) {
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

  // xgrammar: fill_keys(keys, bitmask, rows | None, False), the library's bound batch call.
  PyObject* xgr_fill(PyObject* keys, PyObject* tensor, PyObject* rows) {
    PyObject* argv[5] = {fill_self_.ptr(), keys, tensor, rows, Py_False};
    if (fill_self_.is_valid()) return PyObject_Vectorcall(fill_keys_.ptr(), argv, 5, nullptr);
    return PyObject_Vectorcall(fill_keys_.ptr(), argv + 1, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
  }

  // llguidance: key._m.unsafe_compute_mask_ptr(address of row, bytes per row).
  void llg_compute(PyObject* key, uintptr_t addr) {
    nb::object m = own(slot_m_.get(key, N.m));
    nb::object p = own(PyLong_FromUnsignedLongLong(addr));
    PyObject* argv[3] = {m.ptr(), p.ptr(), nbytes_.ptr()};
    own(m_compute_.call(N.compute, argv, 3));
  }

  bool llg_terminated(PyObject* key) {
    nb::object t = own(slot_terminated_.get(key, N.terminated));
    return truthy(t.ptr());
  }

  bool llg_error(PyObject* key) {
    nb::object m = own(slot_m_.get(key, N.m));
    PyObject* argv[1] = {m.ptr()};
    return truthy(own(m_is_error_.call(N.is_error, argv, 1)).ptr());
  }

  // A row llguidance may have written from its error state (or after EOS): EOS-only or all-zero.
  bool suspicious(uint32_t* row) {
    clear_tail(row, words_, tail_keep_);
    const int64_t w = first_nonzero(row, words_);
    return w == words_ || (w == eos_ / 32 && only_eos(row, words_, eos_));
  }

  // llguidance, one row with the checks of LLGuidanceBackend.fill_rows: all-zero after EOS; in the
  // error state (a dead end) the wrapper's _recover zeroes the row and rebuilds the matcher. Only rows
  // that look like an error row (EOS-only or empty) are asked is_error().
  void llg_fill_row(PyObject* key, const View& v, int64_t row) {
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

  nb::object draft_free(nb::handle batch, nb::handle keys, Py_ssize_t n) {
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

  void invalidate_row(int64_t rows) {
    if (rows < static_cast<int64_t>(views_cache_.size())) views_cache_[rows] = View();
  }

  // Roll back what the drafts accepted (on success, or before re-raising / falling back).
  void rollback_all(PyObject* keys, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; ++i) {
      const int64_t a = accepted_[i];
      if (a == 0) continue;
      PyObject* key = PyTuple_GET_ITEM(keys, i);
      nb::object na = own(PyLong_FromLongLong(a));
      if (kind_ == kLLGuidance && !eos_at_[i] && !llg_terminated(key)) {
        // LLGuidanceMatcher.rollback without its frame: no EOS among the tokens, so llguidance's
        // history and ours both drop exactly `a` tokens.
        nb::object m = own(slot_m_.get(key, N.m));
        PyObject* argv[2] = {m.ptr(), na.ptr()};
        if (!truthy(own(m_llg_rollback_.call(N.rollback, argv, 2)).ptr())) {
          throw std::runtime_error("llguidance could not roll back the drafts");
        }
        nb::object h = own(slot_history_.get(key, N.history));
        const Py_ssize_t len = PyList_Size(h.ptr());
        if (len < a || PyList_SetSlice(h.ptr(), len - a, len, nullptr) < 0) throw nb::python_error();
        continue;
      }
      PyObject* argv[2] = {key, na.ptr()};
      own(m_key_rollback_.call(N.rollback, argv, 2));
    }
  }

  // Draft step on one key: 0 rejected (state unchanged), 1 accepted, 2 accepted EOS; -1 with an error set.
  int accept(PyObject* key, int64_t t) {
    if (kind_ == kXGrammar) {
      if (refuse_[static_cast<size_t>(t)]) return 0;
      nb::object tt = nb::steal(PyLong_FromLongLong(t));
      if (!tt.is_valid()) return -1;
      PyObject* argv[3] = {key, tt.ptr(), Py_False};
      PyObject* r = m_accept_.call(N.accept_token, argv, 3);
      if (r == nullptr) return -1;
      const int ok = PyObject_IsTrue(r);
      Py_DECREF(r);
      if (ok <= 0) return ok;
      return t == eos_ ? 2 : 1;
    }
    nb::object tt = nb::steal(PyLong_FromLongLong(t));
    if (!tt.is_valid()) return -1;
    PyObject* term = slot_terminated_.get(key, N.terminated);
    if (term == nullptr) return -1;
    const bool done = term == Py_True;
    Py_DECREF(term);
    if (t != eos_ && !done) {
      // LLGuidanceMatcher.accept_token for a non-EOS token on a live matcher, without its frame.
      nb::object m = nb::steal(slot_m_.get(key, N.m));
      nb::object lst = nb::steal(PyList_New(1));
      if (!m.is_valid() || !lst.is_valid()) return -1;
      Py_INCREF(tt.ptr());
      PyList_SET_ITEM(lst.ptr(), 0, tt.ptr());
      PyObject* argv[2] = {m.ptr(), lst.ptr()};
      PyObject* r = m_try_consume_.call(N.try_consume, argv, 2);
      if (r == nullptr) return -1;
      const long took = PyLong_AsLong(r);
      Py_DECREF(r);
      if (took == -1 && PyErr_Occurred()) return -1;
      if (took != 1) return 0;
      PyObject* h = slot_history_.get(key, N.history);
      if (h == nullptr) return -1;
      const int rc = PyList_Append(h, tt.ptr());
      Py_DECREF(h);
      return rc < 0 ? -1 : 1;
    }
    PyObject* argv[2] = {key, tt.ptr()};
    PyObject* r = PyObject_Vectorcall(accept_key_.ptr(), argv, 2, nullptr);
    if (r == nullptr) return -1;
    const long v = PyLong_AsLong(r);
    Py_DECREF(r);
    if (v == -1 && PyErr_Occurred()) return -1;
    return static_cast<int>(v);
  }

  // Accept-draft-then-fill, one draft depth at a time across the batch (the wavefront of the Python
  // path); returns false with a Python error set.
  bool wavefront(PyObject* keys, Py_ssize_t n, const View& v) {
    if (kind_ == kXGrammar) {
      nb::object rows = nb::steal(PyTuple_New(n));
      if (!rows.is_valid()) return false;
      for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* r = PyLong_FromLongLong(offs_[i]);
        if (r == nullptr) return false;
        PyTuple_SET_ITEM(rows.ptr(), i, r);
      }
      PyObject* r = xgr_fill(keys, v.tensor, rows.ptr());
      if (r == nullptr) return false;
      Py_DECREF(r);
    } else {
      for (Py_ssize_t i = 0; i < n; ++i) llg_fill_row(PyTuple_GET_ITEM(keys, i), v, offs_[i]);
    }
    active_.clear();
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (lens_[i] > 0) active_.push_back(i);
    }
    for (int64_t depth = 1; !active_.empty(); ++depth) {
      go_.clear();
      next_.clear();
      for (Py_ssize_t i : active_) {
        PyObject* key = PyTuple_GET_ITEM(keys, i);
        const int r = accept(key, toks_[starts_[i] + depth - 1]);
        if (r < 0) return false;
        if (r == 0) continue;
        accepted_[i] = depth;
        if (r == 2) {  // EOS: not filled; the copy pass repeats the previous row
          eos_at_[i] = 1;
          continue;
        }
        go_.push_back(i);
        if (lens_[i] > depth) next_.push_back(i);
      }
      if (!go_.empty()) {
        if (kind_ == kXGrammar) {
          nb::object gk = nb::steal(PyTuple_New(static_cast<Py_ssize_t>(go_.size())));
          nb::object gr = nb::steal(PyTuple_New(static_cast<Py_ssize_t>(go_.size())));
          if (!gk.is_valid() || !gr.is_valid()) return false;
          for (size_t j = 0; j < go_.size(); ++j) {
            PyObject* key = PyTuple_GET_ITEM(keys, go_[j]);
            Py_INCREF(key);
            PyTuple_SET_ITEM(gk.ptr(), j, key);
            PyObject* row = PyLong_FromLongLong(offs_[go_[j]] + depth);
            if (row == nullptr) return false;
            PyTuple_SET_ITEM(gr.ptr(), j, row);
          }
          PyObject* r = xgr_fill(gk.ptr(), v.tensor, gr.ptr());
          if (r == nullptr) return false;
          Py_DECREF(r);
        } else {
          for (Py_ssize_t i : go_) llg_fill_row(PyTuple_GET_ITEM(keys, i), v, offs_[i] + depth);
        }
      }
      active_.swap(next_);
    }
    return true;
  }

  nb::object drafted(nb::handle batch, nb::handle keys, Py_ssize_t n) {
    offs_.assign(static_cast<size_t>(n) + 1, 0);
    for (Py_ssize_t i = 0; i < n; ++i) offs_[i + 1] = offs_[i] + 1 + lens_[i];
    const int64_t total = offs_[n];
    const View v = view(total);
    accepted_.assign(static_cast<size_t>(n), 0);
    eos_at_.assign(static_cast<size_t>(n), 0);
    bool ok;
    try {
      ok = wavefront(keys.ptr(), n, v);
    } catch (nb::python_error& e) {
      e.restore();
      ok = false;
    }
    if (!ok) {
      // Leave every matcher where it was, then do what the Python path did with this error.
      PyObject *type, *value, *tb;
      PyErr_Fetch(&type, &value, &tb);
      try {
        rollback_all(keys.ptr(), n);
      } catch (...) {
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        throw;
      }
      PyErr_Restore(type, value, tb);
      if (general_path_error()) {
        PyErr_Clear();
        return general(batch);
      }
      throw nb::python_error();
    }
    rollback_all(keys.ptr(), n);
    // Rows after a request's last valid row repeat it; an accepted EOS draft's row repeats the one before.
    copies_.clear();
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (lens_[i] == 0) continue;
      const int64_t src = offs_[i] + accepted_[i], end = offs_[i + 1];
      if (eos_at_[i]) {
        copies_.push_back(src - 1);
        copies_.push_back(end);
      } else if (src + 1 < end) {
        copies_.push_back(src);
        copies_.push_back(end);
      }
    }
    dead_.clear();
    auto work = [&] {
      const size_t row_bytes = static_cast<size_t>(words_) * 4;
      for (size_t c = 0; c < copies_.size(); c += 2) {
        const uint32_t* src = v.data + copies_[c] * words_;
        for (int64_t r = copies_[c] + 1; r < copies_[c + 1]; ++r) std::memcpy(v.data + r * words_, src, row_bytes);
      }
      for (int64_t r = 0; r < total; ++r) {
        uint32_t* row = v.data + r * words_;
        clear_tail(row, words_, tail_keep_);
        if (first_nonzero(row, words_) == words_) dead_.push_back(r);
      }
    };
    if (total < 64 && copies_.empty()) {
      work();
    } else {
      nb::gil_scoped_release release;
      work();
    }
    if (!dead_.empty()) {
      ++tail_calls_;
      nb::object offs = nb::cast(offs_), acc = nb::cast(accepted_), dead = nb::cast(dead_);
      return call_manager(N.drafts_tail, {batch.ptr(), v.tensor, offs.ptr(), acc.ptr(), dead.ptr()});
    }
    ++fast_calls_;
    nb::object offsets = int64_array(offs_.data(), n + 1);
    nb::object num_drafts = int64_array(accepted_.data(), n);
    nb::object nn = own(PyLong_FromSsize_t(n));
    PyObject* zargv[2] = {nn.ptr(), dt_bool_.ptr()};
    nb::object dead_end = own(PyObject_Vectorcall(np_zeros_.ptr(), zargv, 2, nullptr));
    return batch_mask(v.tensor, offsets.ptr(), num_drafts.ptr(), dead_end.ptr());
  }

  nb::object int64_array(const int64_t* src, Py_ssize_t len) {
    nb::object nn = own(PyLong_FromSsize_t(len));
    PyObject* argv[2] = {nn.ptr(), dt_int64_.ptr()};
    nb::object a = own(PyObject_Vectorcall(np_empty_.ptr(), argv, 2, nullptr));
    Py_buffer buf;
    if (PyObject_GetBuffer(a.ptr(), &buf, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) throw nb::python_error();
    if (buf.len != static_cast<Py_ssize_t>(len * sizeof(int64_t))) {
      PyBuffer_Release(&buf);
      throw std::runtime_error("np.empty: unexpected buffer size");
    }
    std::memcpy(buf.buf, src, static_cast<size_t>(len) * sizeof(int64_t));
    PyBuffer_Release(&buf);
    return a;
  }

  nb::object batch_mask(PyObject* bitmask, PyObject* offsets, PyObject* num_drafts, PyObject* dead_end) {
    PyObject* vals[4] = {bitmask, offsets, num_drafts, dead_end};
    if (!slots_ok_) {
      return own(PyObject_Vectorcall(bm_type_.ptr(), vals, 4, nullptr));
    }
    auto* type = reinterpret_cast<PyTypeObject*>(bm_type_.ptr());
    nb::object empty = own(PyTuple_New(0));
    nb::object obj = own(type->tp_new(type, empty.ptr(), nullptr));
    for (int i = 0; i < 4; ++i) {
      PyObject* d = slot_[i].ptr();
      if (Py_TYPE(d)->tp_descr_set(d, obj.ptr(), vals[i]) < 0) throw nb::python_error();
    }
    return obj;
  }

  int kind_;
  nb::dict keys_, views_;
  nb::object manager_, fallback_, fill_keys_, accept_key_, bm_type_, np_empty_, np_zeros_, dt_int64_, dt_bool_;
  nb::object nbytes_, fill_self_;
  nb::object slot_[4];
  bool slots_ok_ = false;
  int64_t words_, vocab_, tail_keep_, eos_;
  std::vector<uint8_t> refuse_;
  // Per-call scratch, kept to avoid reallocating (the manager is used from one thread).
  std::vector<int64_t> lens_, offs_, accepted_, toks_, dead_, eos_only_, copies_;
  std::vector<size_t> starts_;
  std::vector<uint8_t> eos_at_;
  std::vector<Py_ssize_t> active_, next_, go_;
  std::vector<View> views_cache_;
  SlotCache slot_m_, slot_terminated_, slot_history_;
  MethodCache m_compute_, m_is_error_, m_llg_rollback_, m_key_rollback_, m_accept_, m_try_consume_;
  uint64_t fast_calls_ = 0, tail_calls_ = 0, fallback_calls_ = 0;
};

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
      .def("invalidate", &FastFill::invalidate, "Forget the cached buffer views (the manager's buffer changed).")
      .def_prop_ro("fast_calls", &FastFill::fast_calls, "Calls answered entirely here.")
      .def_prop_ro("tail_calls", &FastFill::tail_calls, "Calls finished by the manager's dead-row methods.")
      .def_prop_ro("fallback_calls", &FastFill::fallback_calls, "Calls handed to the Python path.");
}

}  // namespace di_structured
