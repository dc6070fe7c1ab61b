// Calling Python from the structured fast path (fastfill*.cpp): reference helpers and the per call site
// caches that stand in for what CPython's specialising interpreter caches for Python code.
#pragma once

#include <nanobind/nanobind.h>
#include <structmember.h>

namespace di_structured {

namespace nb = nanobind;

struct Names {
  PyObject *accept_token, *rollback, *m, *terminated, *compute, *is_error, *try_consume, *history, *recover,
      *fast_view, *same_mask, *fast_dead, *drafts_tail, *fill_general;
};
extern Names N;  // defined in fastfill.cpp, filled by register_fastfill

inline PyObject* intern(const char* s) {
  PyObject* o = PyUnicode_InternFromString(s);
  if (o == nullptr) throw nb::python_error();
  return o;  // kept for the life of the process, like CPython's own identifiers
}

inline nb::object own(PyObject* o) {
  if (o == nullptr) throw nb::python_error();
  return nb::steal(o);
}

inline bool truthy(PyObject* o) {
  if (o == Py_True) return true;
  if (o == Py_False || o == Py_None) return false;
  const int t = PyObject_IsTrue(o);
  if (t < 0) throw nb::python_error();
  return t != 0;
}

// The error the Python fast path answered by taking the general path (it raised these before changing
// state, or after rolling every matcher back).
inline bool general_path_error() {
  return PyErr_ExceptionMatches(PyExc_RuntimeError) || PyErr_ExceptionMatches(PyExc_TypeError);
}

// Per call site caches of what the interpreter's specialising instructions cache for Python code
// (measured: ~40 ns per llguidance row without them, ~5% of a byte-vocabulary row).
//
// A slot of a __slots__ class read by offset, for objects of exactly the type seen first (another
// type, a non-object slot or an unset one goes through PyObject_GetAttr, which also raises properly).
struct SlotCache {
  PyTypeObject* type = nullptr;
  Py_ssize_t offset = -1;
  nb::object keep;  // the type: its address must not be reused by another while cached

  PyObject* get(PyObject* obj, PyObject* name) {  // new reference, nullptr with an error set
    PyTypeObject* t = Py_TYPE(obj);
    if (t != type) {
      type = t;
      offset = -1;
      keep = nb::borrow(reinterpret_cast<PyObject*>(t));
      PyObject* raw = _PyType_Lookup(t, name);  // borrowed, no descriptor call
      if (raw != nullptr && Py_TYPE(raw) == &PyMemberDescr_Type) {
        PyMemberDef* def = reinterpret_cast<PyMemberDescrObject*>(raw)->d_member;
        if (def->type == T_OBJECT_EX && !(def->flags & READ_RESTRICTED)) offset = def->offset;
      }
    }
    if (offset >= 0) {
      PyObject* v = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + offset);
      if (v != nullptr) {
        Py_INCREF(v);
        return v;
      }
    }
    return PyObject_GetAttr(obj, name);
  }
};

// obj.name(*args) with the unbound function cached per type when the type's attribute is a method
// descriptor (Py_TPFLAGS_METHOD_DESCRIPTOR: the rule by which CPython itself calls it unbound);
// argv[0] is obj.
struct MethodCache {
  PyTypeObject* type = nullptr;
  PyObject* func = nullptr;  // borrowed from the type's dict; the type is kept alive below
  nb::object keep;

  PyObject* call(PyObject* name, PyObject* const* argv, size_t nargs) {
    PyTypeObject* t = Py_TYPE(argv[0]);
    if (t != type) {
      type = t;
      func = nullptr;
      keep = nb::borrow(reinterpret_cast<PyObject*>(t));
      PyObject* raw = _PyType_Lookup(t, name);
      if (raw != nullptr && PyType_HasFeature(Py_TYPE(raw), Py_TPFLAGS_METHOD_DESCRIPTOR)) {
        func = raw;
        keep = nb::make_tuple(nb::handle(reinterpret_cast<PyObject*>(t)), nb::handle(raw));
      }
    }
    if (func != nullptr) return PyObject_Vectorcall(func, argv, nargs, nullptr);
    return PyObject_VectorcallMethod(name, argv, nargs, nullptr);
  }
};

}  // namespace di_structured
