// _C.structured.FastFill: the StructuredOutputManager's per-call fast path in C++ (fastfill.cpp: entry,
// lookups, draft-free fills; fastfill_drafts.cpp: the drafted path). Registered on the structured
// submodule by bitmask.cpp.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <initializer_list>
#include <vector>

#include "structured/pycall.h"
#include "structured/utf8.h"

namespace di_structured {

namespace nb = nanobind;

enum Kind : int { kXGrammar = 0, kLLGuidance = 1 };

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
           const std::vector<int64_t>& refuse);

  nb::object fill(nb::handle batch, nb::handle out);

  void invalidate() { views_cache_.clear(); }

  // The manager's byte filter (utf8.h) and its dict request id -> filter state: every row is ANDed
  // with its state's mask before the dead-row pass, and a draft the filter rejects cuts the draft.
  // A request id missing from the dict takes the Python path. None / None turns it off.
  void set_utf8(nb::object filter, nb::object states);

  uint64_t fast_calls() const { return fast_calls_; }
  uint64_t tail_calls() const { return tail_calls_; }
  uint64_t fallback_calls() const { return fallback_calls_; }

 private:
  // Drafts: a list / tuple of exact ints in [0, vocab); anything else is the Python path's business.
  bool read_drafts(PyObject* d, size_t i);

  nb::object manager();

  nb::object call_manager(PyObject* name, std::initializer_list<PyObject*> args);

  nb::object fallback(nb::handle batch, nb::handle out);

  nb::object general(nb::handle batch);

  // The manager's _fast_views[rows], cached here by row count: a dict lookup plus converting the
  // address back from a Python int cost ~0.1 us, a fifth of what this object adds at batch 1. The
  // manager calls invalidate() whenever it clears _fast_views (its buffer grew).
  const View& view(int64_t rows);

  View lookup_view(int64_t rows);

  // xgrammar: fill_keys(keys, bitmask, rows | None, False), the library's bound batch call.
  PyObject* xgr_fill(PyObject* keys, PyObject* tensor, PyObject* rows);

  // llguidance: key._m.unsafe_compute_mask_ptr(address of row, bytes per row).
  void llg_compute(PyObject* key, uintptr_t addr);

  bool llg_terminated(PyObject* key);

  bool llg_error(PyObject* key);

  // A row llguidance may have written from its error state (or after EOS): EOS-only or all-zero.
  bool suspicious(uint32_t* row);

  // llguidance, one row with the checks of LLGuidanceBackend.fill_rows: all-zero after EOS; in the
  // error state (a dead end) the wrapper's _recover zeroes the row and rebuilds the matcher. Only rows
  // that look like an error row (EOS-only or empty) are asked is_error().
  void llg_fill_row(PyObject* key, const View& v, int64_t row);

  nb::object draft_free(nb::handle batch, nb::handle keys, Py_ssize_t n);

  void invalidate_row(int64_t rows) {
    if (rows < static_cast<int64_t>(views_cache_.size())) views_cache_[rows] = View();
  }

  // Roll back what the drafts accepted (on success, or before re-raising / falling back).
  void rollback_all(PyObject* keys, Py_ssize_t n);

  // Draft step on one key: 0 rejected (state unchanged), 1 accepted, 2 accepted EOS; -1 with an error set.
  int accept(PyObject* key, int64_t t);

  // Accept-draft-then-fill, one draft depth at a time across the batch (the wavefront of the Python
  // path); returns false with a Python error set.
  bool wavefront(PyObject* keys, Py_ssize_t n, const View& v);

  nb::object drafted(nb::handle batch, nb::handle keys, Py_ssize_t n);

  nb::object int64_array(const int64_t* src, Py_ssize_t len);

  nb::object batch_mask(PyObject* bitmask, PyObject* offsets, PyObject* num_drafts, PyObject* dead_end);

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
  const ByteFilter* u8_ = nullptr;
  nb::object u8_keep_;
  nb::dict u8_states_;
  std::vector<int> st_, cur_, rowst_;
  SlotCache slot_m_, slot_terminated_, slot_history_;
  MethodCache m_compute_, m_is_error_, m_llg_rollback_, m_key_rollback_, m_accept_, m_try_consume_;
  uint64_t fast_calls_ = 0, tail_calls_ = 0, fallback_calls_ = 0;
};

void register_fastfill(nb::module_& m);
void register_utf8(nb::module_& m);

}  // namespace di_structured
