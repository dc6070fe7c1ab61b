// _C.structured.ByteFilter (see utf8.h): construction and the Python bindings.
#include "structured/utf8.h"

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>

namespace nb = nanobind;

namespace di_structured {

ByteFilter::ByteFilter(const std::vector<std::vector<uint8_t>>& tokens, int64_t words)
    : vocab_(static_cast<int64_t>(tokens.size())), words_(words) {
  if (vocab_ == 0) throw std::invalid_argument("token_bytes: must not be empty");
  if (words <= 0 || vocab_ > words * 32) throw std::invalid_argument("words: need vocab <= 32 * words");
  next_.assign(static_cast<size_t>(kStates) * vocab_, kReject);
  masks_.assign(static_cast<size_t>(kStates) * words_, 0);
  for (int s = 0; s < kStates; ++s) {
    const int variant = s / 8, u0 = s % 8;
    uint32_t* m = masks_.data() + static_cast<size_t>(s) * words_;
    for (int64_t t = 0; t < vocab_; ++t) {
      const auto& b = tokens[static_cast<size_t>(t)];
      int u = u0;
      if (b.empty()) {
        u = u0 == 0 ? 0 : -1;  // a control token only between characters
      } else {
        for (uint8_t c : b) {
          if (byte_forbidden(variant, c)) {
            u = -1;
            break;
          }
          u = utf8_byte(u, c);
          if (u < 0) break;
        }
      }
      if (u < 0) continue;
      next_[static_cast<size_t>(s) * vocab_ + t] = static_cast<uint8_t>(variant * 8 + u);
      m[t / 32] |= 1u << (t % 32);
    }
    for (int64_t t = vocab_; t < words_ * 32; ++t) m[t / 32] |= 1u << (t % 32);  // padding: the manager's
  }
  sparse_.resize(kStates);
  for (int s = 0; s < kStates; ++s) {
    const uint32_t* m = masks_.data() + static_cast<size_t>(s) * words_;
    for (int64_t w = 0; w < words_; ++w) {
      if (m[w] != 0xFFFFFFFFu) sparse_[s].emplace_back(static_cast<int32_t>(w), m[w]);
    }
  }
}

namespace {

std::vector<std::vector<uint8_t>> token_list(nb::list tokens) {
  std::vector<std::vector<uint8_t>> out;
  out.reserve(nb::len(tokens));
  for (nb::handle h : tokens) {
    if (!PyBytes_Check(h.ptr())) throw std::invalid_argument("token_bytes: every entry must be bytes");
    const auto* p = reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(h.ptr()));
    out.emplace_back(p, p + PyBytes_GET_SIZE(h.ptr()));
  }
  return out;
}

void check_state(int s) {
  if (s < 0 || s >= ByteFilter::kStates) {
    throw std::invalid_argument("state: must be in [0, " + std::to_string(ByteFilter::kStates) + ")");
  }
}

}  // namespace

void register_utf8(nb::module_& m) {
  nb::class_<ByteFilter>(m, "ByteFilter",
                         "UTF-8 (and JSON control-character) validity automaton over a token vocabulary "
                         "(see csrc/structured/utf8.h for the states).")
      .def("__init__",
           [](ByteFilter* self, nb::list tokens, int64_t words) { new (self) ByteFilter(token_list(tokens), words); },
           nb::arg("token_bytes"), nb::arg("words"),
           "token_bytes: per token id its bytes (empty for control tokens); words: mask words per row.")
      .def_ro_static("REJECT", &ByteFilter::kReject)
      .def_ro_static("NUM_STATES", &ByteFilter::kStates)
      .def_prop_ro("vocab", &ByteFilter::vocab)
      .def(
          "step",
          [](const ByteFilter& f, int s, int64_t t) {
            check_state(s);
            if (t < 0 || t >= f.vocab()) throw std::invalid_argument("token: must be in [0, vocab)");
            return f.step(s, t);
          },
          nb::arg("state"), nb::arg("token"), "The state after token from state (REJECT: not allowed).")
      .def(
          "table",
          [](const ByteFilter& f, int s) {
            check_state(s);
            const auto& n = f.next_table();
            return nb::bytes(reinterpret_cast<const char*>(n.data() + static_cast<size_t>(s) * f.vocab()),
                             static_cast<size_t>(f.vocab()));
          },
          nb::arg("state"), "step(state, t) for every token t, as bytes (index it by token id).")
      .def(
          "mask",
          [](const ByteFilter& f, int s) {
            check_state(s);
            std::vector<uint32_t> out(f.mask(s), f.mask(s) + f.words());
            return out;
          },
          nb::arg("state"), "The state's allowed-token mask as words (padding bits set).")
      .def(
          "apply_ptr",
          [](const ByteFilter& f, uintptr_t ptr, int64_t words, const std::vector<int64_t>& states) {
            if (ptr == 0) throw std::invalid_argument("ptr: must be the address of a live int32 buffer");
            if (words != f.words()) throw std::invalid_argument("words: must match the filter's");
            auto* data = reinterpret_cast<uint32_t*>(ptr);
            nb::gil_scoped_release release;
            for (size_t r = 0; r < states.size(); ++r) {
              f.apply_row(data + r * static_cast<size_t>(words), static_cast<int>(states[r]));
            }
          },
          nb::arg("ptr"), nb::arg("words"), nb::arg("states"),
          "AND row r of the rows x words int32 buffer at ptr with the mask of states[r] (rows = len(states); "
          "a state out of range, e.g. REJECT, empties the row).");
}

}  // namespace di_structured
