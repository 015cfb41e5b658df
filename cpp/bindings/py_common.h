// Helpers every binding file shares: Status -> the pdkv.errors exception, bytes, and
// the dict form of a region. Call them with the GIL held.
#pragma once

#include <pybind11/pybind11.h>

#include <string>
#include <string_view>

#include "pdkv/region.h"
#include "pdkv/status.h"
#include "pdkv/types.h"

namespace pdkv::bindings {

namespace py = pybind11;

// The pdkv.errors exception instance for a non-OK Status (one class per code, looked up
// in errors.error_class, the one code -> exception table). Messages may echo bytes a
// peer sent: invalid UTF-8 is replaced, never an error of its own.
inline py::object status_exception(const Status& st) {
  py::object cls = py::module_::import("pdkv.errors").attr("error_class")(std::string(status_code_name(st.code())));
  const std::string& m = st.message();
  py::object msg = py::reinterpret_steal<py::object>(PyUnicode_DecodeUTF8(m.data(), py::ssize_t(m.size()), "replace"));
  return cls(msg);
}

// Sets the Python error of a non-OK Status and throws it through pybind11.
[[noreturn]] inline void raise_status(const Status& st) {
  py::object exc = status_exception(st);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  throw py::error_already_set();
}

inline py::bytes to_bytes(std::string_view s) { return py::bytes(s.data(), s.size()); }

inline py::dict region_dict(const RegionDesc& d) {
  py::dict o;
  o["id"] = d.id;
  o["addr"] = d.addr;
  o["len"] = d.len;
  o["kind"] = std::string(mem_kind_name(d.kind));
  o["device"] = d.device;
  o["remote_access"] = d.remote_access;
  o["shareable"] = d.shareable;
  o["shared_offset"] = d.shared_offset;
  o["shared_len"] = d.shared_len;
  return o;
}

}  // namespace pdkv::bindings
