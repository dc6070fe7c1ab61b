// _C.structured.FastFill, the drafted path: accept-draft-then-fill depth by depth across the batch,
// rollback, copies of unused rows, the row pass and a fresh BatchMask (see fastfill.cpp for the whole).
#include <nanobind/stl/vector.h>  // nb::cast of the row lists handed to _drafts_tail

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "structured/fastfill.h"
#include "structured/scan.h"

namespace di_structured {

void FastFill::rollback_all(PyObject* keys, Py_ssize_t n) {
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

int FastFill::accept(PyObject* key, int64_t t) {
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

bool FastFill::wavefront(PyObject* keys, Py_ssize_t n, const View& v) {
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
      const int64_t t = toks_[starts_[i] + depth - 1];
      int ns = 0;
      if (u8_ != nullptr) {  // bytes the filter rejects cut the draft before the grammar sees them
        ns = u8_->step(cur_[i], t);
        if (ns == ByteFilter::kReject) continue;
      }
      const int r = accept(key, t);
      if (r < 0) return false;
      if (r == 0) continue;
      accepted_[i] = depth;
      if (u8_ != nullptr) {
        cur_[i] = ns;
        rowst_[static_cast<size_t>(offs_[i] + depth)] = ns;
      }
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

nb::object FastFill::drafted(nb::handle batch, nb::handle keys, Py_ssize_t n) {
  offs_.assign(static_cast<size_t>(n) + 1, 0);
  for (Py_ssize_t i = 0; i < n; ++i) offs_[i + 1] = offs_[i] + 1 + lens_[i];
  const int64_t total = offs_[n];
  const View v = view(total);
  accepted_.assign(static_cast<size_t>(n), 0);
  eos_at_.assign(static_cast<size_t>(n), 0);
  if (u8_ != nullptr) {
    cur_ = st_;
    rowst_.assign(static_cast<size_t>(total), 0);
    for (Py_ssize_t i = 0; i < n; ++i) rowst_[static_cast<size_t>(offs_[i])] = st_[static_cast<size_t>(i)];
  }
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
    if (u8_ != nullptr) {  // the filled rows (an accepted EOS draft's row is a copy, not filled)
      for (Py_ssize_t i = 0; i < n; ++i) {
        const int64_t last = accepted_[i] - (eos_at_[i] ? 1 : 0);
        for (int64_t j = 0; j <= last; ++j) {
          const int64_t r = offs_[i] + j;
          u8_->apply_row(v.data + r * words_, rowst_[static_cast<size_t>(r)]);
        }
      }
    }
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

nb::object FastFill::int64_array(const int64_t* src, Py_ssize_t len) {
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

nb::object FastFill::batch_mask(PyObject* bitmask, PyObject* offsets, PyObject* num_drafts, PyObject* dead_end) {
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

}  // namespace di_structured
