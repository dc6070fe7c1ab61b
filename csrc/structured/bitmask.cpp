// _C.structured: the per-step pass over a batch of grammar bitmasks after the engines filled them.
//
// Every step the manager must (1) clear the padding bits past vocab_size in each row's last word (the
// engines disagree on them) and (2) find rows that allow no token at all (dead ends). numpy can only
// scan every word of every row (~2 us per 128k-token row); here each row stops at its first non-zero
// word, which for a live row is almost always within the first few words, and the GIL is released.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <vector>

#include "core/buffers.h"
#include "core/registry.h"

namespace nb = nanobind;

namespace {

using Bitmask = nb::ndarray<int32_t, nb::numpy, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

std::vector<int64_t> finish_rows(Bitmask bm, int64_t tail_keep) {
  const int64_t rows = static_cast<int64_t>(bm.shape(0));
  const int64_t words = static_cast<int64_t>(bm.shape(1));
  di::require(words > 0, "bitmask: needs at least one word per row");
  di::require(tail_keep >= -1 && tail_keep <= 0xFFFFFFFFLL,
              "tail_keep: must be -1 (no padding) or a 32-bit mask of the valid bits of the last word");
  std::vector<int64_t> dead;
  int32_t* data = bm.data();
  {
    nb::gil_scoped_release release;
    const bool clear_tail = tail_keep != -1;
    const auto keep = static_cast<uint32_t>(tail_keep & 0xFFFFFFFFLL);
    for (int64_t r = 0; r < rows; ++r) {
      auto* row = reinterpret_cast<uint32_t*>(data + r * words);
      if (clear_tail) row[words - 1] &= keep;
      int64_t w = 0;
      while (w < words && row[w] == 0) ++w;
      if (w == words) dead.push_back(r);
    }
  }
  return dead;
}

}  // namespace

DI_SUBMODULE(structured, "grammar bitmask post-processing for structured outputs") {
  // noconvert: an implicit copy (wrong dtype, strided view) would clear the tail bits of the copy only.
  m.def("finish_rows", &finish_rows, nb::arg("bitmask").noconvert(), nb::arg("tail_keep"),
        "Clear padding bits of each row's last word (tail_keep = valid-bit mask, -1 for none) and return "
        "the indices of rows that allow no token.");
}
