// Self-registering submodules of deepinfer_core._C.
//
// Each component writes, in its own .cpp file:
//
//   DI_SUBMODULE(kv, "paged KV block pool and state pool bookkeeping") {
//     nb::class_<BlockPool>(m, "BlockPool") ...;   // `m` is the submodule _C.kv
//   }
//
// The macro registers a function at static-initialisation time; module.cpp creates one submodule
// per registration, sorted by name. Nothing shared has to be edited to add a component.
#pragma once

#include <nanobind/nanobind.h>

namespace di {

using RegisterFn = void (*)(nanobind::module_&);

struct Registrar {
  Registrar(const char* name, const char* doc, RegisterFn fn);
};

// Called once from NB_MODULE(_C, ...).
void register_all(nanobind::module_& root);

}  // namespace di

#define DI_SUBMODULE(NAME, DOC)                                                   \
  static void di_register_##NAME(nanobind::module_& m);                          \
  static ::di::Registrar di_registrar_##NAME(#NAME, DOC, &di_register_##NAME);   \
  static void di_register_##NAME(nanobind::module_& m)
