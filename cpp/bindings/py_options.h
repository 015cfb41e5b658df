// Binds TcpOptions, ShmOptions, AgentConfig and a transfer's PlanOptions, XferOptions
// and StreamOptions (py_options.cc) into the _pdkv module.
#pragma once

#include <pybind11/pybind11.h>

namespace pdkv {

void bind_options(pybind11::module_& m);

}  // namespace pdkv
