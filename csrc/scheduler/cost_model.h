// Quadratic step-time model of a prefill step and the chunk-size solver built on it.
//
// A prefill step that computes chunks (q_i new tokens of a request with c_i tokens already computed)
// is predicted to take
//     base_ns + sum_i ( token_ns * q_i + quad_ns * q_i^2 + ctx_ns * q_i * c_i )
// base_ns is paid once per step (launch, sampling, MoE all-to-all set-up); token_ns covers the linear
// per-token work (GEMMs); quad_ns the attention of the chunk to itself; ctx_ns the attention of the
// chunk to the request's already computed prefix. All coefficients must be >= 0, which makes the
// predicted cost non-decreasing in q and lets the solver answer "largest q that fits" in closed form.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

namespace di::sched {

// DeepInfer's hard cap on tokens in one step (deployment Q&A: "a 32,768-token cap").
constexpr int64_t kMaxStepTokens = 32768;

struct CostModel {
  double base_ns = 0.0;
  double token_ns = 0.0;
  double quad_ns = 0.0;
  double ctx_ns = 0.0;

  void validate() const {
    const double v[4] = {base_ns, token_ns, quad_ns, ctx_ns};
    const char* names[4] = {"base_ns", "token_ns", "quad_ns", "ctx_ns"};
    for (int i = 0; i < 4; ++i) {
      if (!(v[i] >= 0.0) || !std::isfinite(v[i]))
        throw std::invalid_argument(std::string("CostModel.") + names[i] + "=" + std::to_string(v[i]) +
                                    ": must be finite and >= 0 (the solver relies on cost growing with q)");
    }
  }

  // Variable cost of one chunk (no per-step base). The evaluation order is fixed so that Python's
  // float64 reimplementation in tests reproduces it.
  double chunk_ns(int64_t q, int64_t c) const {
    const double qd = static_cast<double>(q);
    return token_ns * qd + quad_ns * qd * qd + ctx_ns * qd * static_cast<double>(c);
  }

  // Largest q in [0, cap] with spent + chunk_ns(q, c) <= budget (spent already includes base_ns when
  // the step has started). Closed form from the quadratic, then an exact integer fix-up so that
  // rounding in sqrt never lets a chunk exceed the budget.
  int64_t max_chunk(int64_t c, double spent, double budget, int64_t cap) const {
    if (cap <= 0 || !(spent + chunk_ns(1, c) <= budget)) return 0;
    if (std::isinf(budget)) return cap;
    const double left = budget - spent;
    const double a = quad_ns;
    const double b = token_ns + ctx_ns * static_cast<double>(c);
    double qf;
    if (a > 0.0) {
      qf = (-b + std::sqrt(b * b + 4.0 * a * left)) / (2.0 * a);
    } else if (b > 0.0) {
      qf = left / b;
    } else {
      return cap;  // a chunk costs nothing: only the token cap binds
    }
    int64_t q = qf >= static_cast<double>(cap) ? cap : static_cast<int64_t>(std::floor(std::max(qf, 0.0)));
    while (q < cap && spent + chunk_ns(q + 1, c) <= budget) ++q;
    while (q > 0 && !(spent + chunk_ns(q, c) <= budget)) --q;
    return q;
  }
};

}  // namespace di::sched
