// Input errors of the scheduler core: std::invalid_argument, which nanobind turns into ValueError.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace di::sched {

[[noreturn]] inline void bad(const std::string& msg) { throw std::invalid_argument(msg); }

inline std::string s(int64_t v) { return std::to_string(v); }

}  // namespace di::sched
