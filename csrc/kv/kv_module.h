// Registration hooks of the _C.kv submodule, one per translation unit.
#pragma once

#include <nanobind/nanobind.h>

namespace di::kv {
void register_block_pool(nanobind::module_& m);
void register_state_pool(nanobind::module_& m);
}  // namespace di::kv
