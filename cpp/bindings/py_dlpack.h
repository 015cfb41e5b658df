// Binds dlpack_memory (py_dlpack.cc): registration of any DLPack exporter.
#pragma once

#include <pybind11/pybind11.h>

namespace pdkv {

void bind_dlpack(pybind11::module_& m);

}  // namespace pdkv
