// Row scans shared by the structured-output passes (bitmask.cpp: the numpy / address forms the Python
// manager calls; fastfill.cpp: the manager's whole per-call fast path).
#pragma once

#include <cstdint>
#include <cstring>

namespace di_structured {

// Index of the first non-zero word of a row (words if none). A 128k-token row is 4000 words, and a
// state that allows only, say, digits has its first set bit far in; OR-ing 16 words at a time (a loop
// the compiler vectorises) makes that prefix ~10x cheaper than a word-by-word early-exit loop.
inline int64_t first_nonzero(const uint32_t* row, int64_t words) {
  int64_t w = 0;
  for (; w + 16 <= words; w += 16) {
    uint64_t part[8];
    std::memcpy(part, row + w, sizeof(part));  // 64-bit lanes without aliasing trouble
    const uint64_t acc = (part[0] | part[1]) | (part[2] | part[3]) | (part[4] | part[5]) | (part[6] | part[7]);
    if (acc != 0) break;
  }
  while (w < words && row[w] == 0) ++w;
  return w;
}

// True when the only allowed token of the row is eos (llguidance writes such a row for a matcher in
// its error state and after EOS, and, legitimately, when only EOS can follow).
inline bool only_eos(const uint32_t* row, int64_t words, int64_t eos) {
  const int64_t ew = eos / 32;
  if (ew >= words || row[ew] != (1u << (eos % 32))) return false;
  for (int64_t w = 0; w < words; ++w) {
    if (w != ew && row[w] != 0) return false;
  }
  return true;
}

// tail_keep: the valid-bit mask of the last word, -1 when the vocabulary fills it.
inline void clear_tail(uint32_t* row, int64_t words, int64_t tail_keep) {
  if (tail_keep != -1) row[words - 1] &= static_cast<uint32_t>(tail_keep & 0xFFFFFFFFLL);
}

}  // namespace di_structured
