// Binds StreamingWrite and Agent.open_stream (py_stream.cc): layer-wise streaming writes.
#pragma once

#include <pybind11/pybind11.h>

namespace pdkv {

void bind_stream(pybind11::module_& m);

}  // namespace pdkv
