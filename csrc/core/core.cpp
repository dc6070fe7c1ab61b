// _C.core: build facts, used by tests to prove the extension was compiled from this tree.
#include "core/registry.h"

namespace nb = nanobind;

DI_SUBMODULE(core, "build information") {
  m.def("build_info", []() {
    nb::dict d;
#ifdef DI_CXX_COMPILER
    d["compiler"] = nb::str(DI_CXX_COMPILER);
#endif
    d["cplusplus"] = static_cast<long>(__cplusplus);
#ifdef NDEBUG
    d["ndebug"] = true;
#else
    d["ndebug"] = false;
#endif
    return d;
  }, "Compiler, language level and NDEBUG of the build.");
  m.def("add_i64", [](int64_t a, int64_t b) { return a + b; }, "Trivial call used to time the binding overhead.");
}
