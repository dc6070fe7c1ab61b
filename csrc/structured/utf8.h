// _C.structured.ByteFilter: a byte-level validity automaton over a token vocabulary, intersected with the
// grammar engines' masks so that no constrained request can emit bytes that are not valid UTF-8 (or, for
// JSON, raw control characters), whatever the engine's approximation allows.
//
// State = variant * 8 + u, u the UTF-8 decoder state:
//   0 between characters; 1 / 2 / 3 continuation bytes (80..BF) still needed;
//   4 after E0 (next A0..BF), 5 after ED (next 80..9F: no UTF-16 surrogates), 6 after F0 (next 90..BF),
//   7 after F4 (next 80..8F: nothing above U+10FFFF);
// variant 0: UTF-8 only; 1: also no byte 00..1F (compact JSON: no raw control character anywhere);
// 2: no 00..1F except tab, LF, CR (JSON with whitespace between tokens).
// A token is allowed in a state iff all its bytes are accepted from it; the state after a token is the
// state after its last byte. Control tokens (empty bytes, EOS among them) are allowed only between
// characters, so a document never ends (or is cut by a control token) inside a character.
// Per state the filter keeps a dense mask and the list of its words that are not all-ones: applying the
// state-0 mask of the byte vocabulary touches 5 of its 16 words, and of a BPE vocabulary only the words
// holding tokens that start with a continuation byte.
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace di_structured {

class ByteFilter {
 public:
  static constexpr int kReject = 255;
  static constexpr int kVariants = 3;
  static constexpr int kStates = kVariants * 8;

  ByteFilter(const std::vector<std::vector<uint8_t>>& tokens, int64_t words);

  int64_t vocab() const { return vocab_; }
  int64_t words() const { return words_; }

  // The state after token t from state s (kReject: not allowed). s and t are trusted (checked by callers).
  int step(int s, int64_t t) const { return next_[static_cast<size_t>(s) * vocab_ + t]; }

  // AND one row with state s's mask (kReject or an out-of-range state: the row allows nothing).
  void apply_row(uint32_t* row, int s) const {
    if (s < 0 || s >= kStates) {
      std::memset(row, 0, static_cast<size_t>(words_) * 4);
      return;
    }
    const auto& sp = sparse_[s];
    if (sp.size() * 2 < static_cast<size_t>(words_)) {
      for (const auto& [w, m] : sp) row[w] &= m;
    } else {
      const uint32_t* m = masks_.data() + static_cast<size_t>(s) * words_;
      for (int64_t w = 0; w < words_; ++w) row[w] &= m[w];
    }
  }

  const std::vector<uint8_t>& next_table() const { return next_; }
  const uint32_t* mask(int s) const { return masks_.data() + static_cast<size_t>(s) * words_; }

 private:
  int64_t vocab_, words_;
  std::vector<uint8_t> next_;    // [kStates][vocab]
  std::vector<uint32_t> masks_;  // [kStates][words], padding bits set
  std::vector<std::vector<std::pair<int32_t, uint32_t>>> sparse_;
};

// One byte from UTF-8 state u (0..7): the next u, or -1.
inline int utf8_byte(int u, uint8_t b) {
  switch (u) {
    case 0:
      if (b < 0x80) return 0;
      if (b >= 0xC2 && b <= 0xDF) return 1;
      if (b == 0xE0) return 4;
      if (b == 0xED) return 5;
      if (b >= 0xE1 && b <= 0xEF) return 2;
      if (b == 0xF0) return 6;
      if (b >= 0xF1 && b <= 0xF3) return 3;
      if (b == 0xF4) return 7;
      return -1;
    case 1:
    case 2:
    case 3:
      return (b >= 0x80 && b <= 0xBF) ? u - 1 : -1;
    case 4:
      return (b >= 0xA0 && b <= 0xBF) ? 1 : -1;
    case 5:
      return (b >= 0x80 && b <= 0x9F) ? 1 : -1;
    case 6:
      return (b >= 0x90 && b <= 0xBF) ? 2 : -1;
    case 7:
      return (b >= 0x80 && b <= 0x8F) ? 2 : -1;
    default:
      return -1;
  }
}

inline bool byte_forbidden(int variant, uint8_t b) {
  if (variant == 0 || b >= 0x20) return false;
  return variant == 1 || !(b == 0x09 || b == 0x0A || b == 0x0D);
}

}  // namespace di_structured
