// _C.structured: the per-step pass over a batch of grammar bitmasks after the engines filled them.
//
// Every step the manager must (1) clear the padding bits past vocab_size in each row's last word (the
// engines disagree on them) and (2) find rows that allow no token at all (dead ends). numpy can only
// scan every word of every row (~2 us per 128k-token row); here each row stops at its first non-zero
// word, which for a live row is almost always within the first few words, and the GIL is released.
//
// finish_rows_ptr is the manager's hot-path form: it takes the buffer as an address (the manager owns
// and has validated the buffer), so a call costs a few integer conversions instead of building an
// ndarray view (~1 us of the per-step overhead the manager is measured on), and it also does the draft
// row copies (rows past a request's surviving drafts repeat its last valid row) in the same pass.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "core/buffers.h"
#include "core/registry.h"
#include "structured/fastfill.h"
#include "structured/scan.h"

namespace nb = nanobind;

namespace {

using di_structured::first_nonzero;
using di_structured::only_eos;

using Bitmask = nb::ndarray<int32_t, nb::numpy, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

// di::require takes a std::string, built on every call even when the check passes; the per-step
// entry points check with literals instead (a few hundred ns per call otherwise).
inline void need(bool ok, const char* msg) {
  if (!ok) throw std::invalid_argument(msg);
}

void check_keep(int64_t tail_keep) {
  need(tail_keep >= -1 && tail_keep <= 0xFFFFFFFFLL,
              "tail_keep: must be -1 (no padding) or a 32-bit mask of the valid bits of the last word");
}

// Clear padding, collect all-zero rows; caller holds no GIL.
void scan_rows(int32_t* data, int64_t rows, int64_t words, int64_t tail_keep, std::vector<int64_t>& dead) {
  const bool clear_tail = tail_keep != -1;
  const auto keep = static_cast<uint32_t>(tail_keep & 0xFFFFFFFFLL);
  for (int64_t r = 0; r < rows; ++r) {
    auto* row = reinterpret_cast<uint32_t*>(data + r * words);
    if (clear_tail) row[words - 1] &= keep;
    const int64_t w = first_nonzero(row, words);
    if (w == words) dead.push_back(r);
  }
}

std::vector<int64_t> finish_rows(Bitmask bm, int64_t tail_keep) {
  const int64_t rows = static_cast<int64_t>(bm.shape(0));
  const int64_t words = static_cast<int64_t>(bm.shape(1));
  di::require(words > 0, "bitmask: needs at least one word per row");
  check_keep(tail_keep);
  std::vector<int64_t> dead;
  int32_t* data = bm.data();
  {
    nb::gil_scoped_release release;
    scan_rows(data, rows, words, tail_keep, dead);
  }
  return dead;
}

std::vector<int64_t> finish_rows_ptr(uintptr_t ptr, int64_t rows, int64_t words, int64_t tail_keep,
                                     const std::vector<int64_t>& copies) {
  need(ptr != 0, "ptr: must be the address of a live int32 buffer");
  need(rows >= 0, "rows: must be >= 0");
  need(words > 0, "words: needs at least one word per row");
  check_keep(tail_keep);
  need(copies.size() % 2 == 0, "copies: must be flat (src, end) pairs");
  for (size_t i = 0; i < copies.size(); i += 2) {
    need(copies[i] >= 0 && copies[i] < copies[i + 1] && copies[i + 1] <= rows,
                "copies: each (src, end) needs 0 <= src < end <= rows");
  }
  std::vector<int64_t> dead;
  auto* data = reinterpret_cast<int32_t*>(ptr);
  auto work = [&] {
    const size_t row_bytes = static_cast<size_t>(words) * sizeof(int32_t);
    for (size_t i = 0; i < copies.size(); i += 2) {
      const int32_t* src = data + copies[i] * words;
      for (int64_t r = copies[i] + 1; r < copies[i + 1]; ++r) std::memcpy(data + r * words, src, row_bytes);
    }
    scan_rows(data, rows, words, tail_keep, dead);
  };
  // A live row costs a few word reads, so a small batch is done in well under a microsecond; releasing
  // and retaking the GIL would cost about as much as the work (measured on the manager's batch-1 step).
  if (rows < 64 && copies.empty()) {
    work();
  } else {
    nb::gil_scoped_release release;
    work();
  }
  return dead;
}

// The draft-free step's form: no copies, and only a count comes back (building the vector and the
// Python list costs ~0.25 us, most of a small batch's pass); the manager asks finish_rows_ptr for the
// rows only when the count is non-zero (clearing the padding twice is harmless). With eos >= 0 a row
// whose only allowed token is eos counts too: llguidance writes such a row for a matcher in its error
// state (and after EOS), so the manager checks those matchers only when one shows up, instead of
// asking every matcher every step.
int64_t count_dead_ptr(uintptr_t ptr, int64_t rows, int64_t words, int64_t tail_keep, int64_t eos) {
  need(ptr != 0, "ptr: must be the address of a live int32 buffer");
  need(rows >= 0, "rows: must be >= 0");
  need(words > 0, "words: needs at least one word per row");
  check_keep(tail_keep);
  auto* data = reinterpret_cast<int32_t*>(ptr);
  const bool clear_tail = tail_keep != -1;
  const auto keep = static_cast<uint32_t>(tail_keep & 0xFFFFFFFFLL);
  int64_t found = 0;
  auto work = [&] {
    for (int64_t r = 0; r < rows; ++r) {
      auto* row = reinterpret_cast<uint32_t*>(data + r * words);
      if (clear_tail) row[words - 1] &= keep;
      const int64_t w = first_nonzero(row, words);
      if (w == words) {
        ++found;
      } else if (eos >= 0 && w == eos / 32 && only_eos(row, words, eos)) {
        ++found;
      }
    }
  };
  if (rows < 64) {
    work();
  } else {
    nb::gil_scoped_release release;
    work();
  }
  return found;
}

std::vector<int64_t> eos_only_rows_ptr(uintptr_t ptr, int64_t rows, int64_t words, int64_t eos) {
  need(ptr != 0, "ptr: must be the address of a live int32 buffer");
  need(rows >= 0 && words > 0 && eos >= 0, "rows, words, eos: must be >= 0, > 0, >= 0");
  const auto* data = reinterpret_cast<const uint32_t*>(ptr);
  std::vector<int64_t> out;
  for (int64_t r = 0; r < rows; ++r) {
    if (only_eos(data + r * words, words, eos)) out.push_back(r);
  }
  return out;
}

}  // namespace

DI_SUBMODULE(structured, "grammar bitmask post-processing for structured outputs") {
  // noconvert: an implicit copy (wrong dtype, strided view) would clear the tail bits of the copy only.
  m.def("finish_rows", &finish_rows, nb::arg("bitmask").noconvert(), nb::arg("tail_keep"),
        "Clear padding bits of each row's last word (tail_keep = valid-bit mask, -1 for none) and return "
        "the indices of rows that allow no token.");
  m.def("finish_rows_ptr", &finish_rows_ptr, nb::arg("ptr"), nb::arg("rows"), nb::arg("words"),
        nb::arg("tail_keep"), nb::arg("copies") = std::vector<int64_t>(),
        "finish_rows over rows x words int32 at address ptr (contiguous; the caller guarantees it is "
        "live and large enough), after copying row src over rows src+1..end-1 for each flat (src, end) "
        "pair in copies.");
  m.def("count_dead_ptr", &count_dead_ptr, nb::arg("ptr"), nb::arg("rows"), nb::arg("words"), nb::arg("tail_keep"),
        nb::arg("eos") = -1,
        "finish_rows_ptr without copies, returning only the number of rows that allow no token (or, with "
        "eos >= 0, only token eos).");
  m.def("eos_only_rows_ptr", &eos_only_rows_ptr, nb::arg("ptr"), nb::arg("rows"), nb::arg("words"), nb::arg("eos"),
        "Indices of the rows whose only allowed token is eos.");
  di_structured::register_fastfill(m);
  di_structured::register_utf8(m);
}
