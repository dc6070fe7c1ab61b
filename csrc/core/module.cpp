// The extension module deepinfer_core._C: a root that holds the self-registered component submodules.
#include <algorithm>
#include <string>
#include <vector>

#include "core/registry.h"

namespace nb = nanobind;

namespace di {
namespace {

struct Entry {
  std::string name;
  std::string doc;
  RegisterFn fn;
};

// A function-local static avoids the static-initialisation-order problem: registrars in other
// translation units may run before this file's globals are constructed.
std::vector<Entry>& entries() {
  static std::vector<Entry> e;
  return e;
}

}  // namespace

Registrar::Registrar(const char* name, const char* doc, RegisterFn fn) {
  entries().push_back({name, doc, fn});
}

void register_all(nb::module_& root) {
  auto& e = entries();
  std::sort(e.begin(), e.end(), [](const Entry& a, const Entry& b) { return a.name < b.name; });
  nb::list names;
  for (const auto& entry : e) {
    nb::module_ sub = root.def_submodule(entry.name.c_str(), entry.doc.c_str());
    entry.fn(sub);
    names.append(nb::str(entry.name.c_str()));
  }
  root.attr("submodules") = names;
}

}  // namespace di

NB_MODULE(_C, m) {
  m.doc() = "deepinfer_core C++ core: scheduler, block bookkeeping and verify greedy (no torch).";
  m.attr("__version__") = nb::str("0.1.0");
#ifdef DI_CXX_COMPILER
  m.attr("compiler") = nb::str(DI_CXX_COMPILER);
#endif
  m.attr("cxx_standard") = static_cast<long>(__cplusplus);
  di::register_all(m);
}
