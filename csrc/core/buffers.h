// Small helpers shared by components that exchange numpy buffers with Python.
#pragma once

#include <nanobind/ndarray.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace di {

namespace nb = nanobind;

// Read-only 1-D C-contiguous numpy views, the form the core accepts from Python.
template <typename T>
using CArray1 = nb::ndarray<const T, nb::numpy, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
template <typename T>
using CArray2 = nb::ndarray<const T, nb::numpy, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

// A numpy array owning a fresh heap buffer (freed by a capsule when Python drops it).
template <typename T>
nb::ndarray<nb::numpy, T> new_array(std::initializer_list<size_t> shape_list) {
  size_t shape[4] = {0, 0, 0, 0};
  size_t n = 1, ndim = 0;
  for (size_t s : shape_list) {
    shape[ndim++] = s;
    n *= s;
  }
  T* data = new T[n > 0 ? n : 1]();
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<T*>(p); });
  return nb::ndarray<nb::numpy, T>(data, ndim, shape, owner);
}

inline void require(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument(msg);
}

}  // namespace di
