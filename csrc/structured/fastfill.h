// _C.structured.FastFill (fastfill.cpp), registered on the structured submodule by bitmask.cpp.
#pragma once

#include <nanobind/nanobind.h>

namespace di_structured {

void register_fastfill(nanobind::module_& m);

}  // namespace di_structured
