// Binds TcpOptions, ShmOptions, AgentConfig and a transfer's PlanOptions, XferOptions
// and StreamOptions (py_options.cc) into the _pdkv module, and converts transport
// options between Python and C++.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <optional>
#include <string>

#include "pdkv/options/transport_options.h"
#include "pdkv/transfer.h"

namespace pdkv {

void bind_options(pybind11::module_& m);

// One transport options object from Python: a native options class (TcpOptions, ...)
// is copied; any other object whose class names its transport in a `transport` class
// attribute (a str) is held as it is (a Python transport's options). Raises
// InvalidArgument naming `where` otherwise. GIL held.
std::unique_ptr<TransportOptions> options_from_py(pybind11::handle v, const std::string& where);
// Back to Python: a copy of the native class, or the Python object held. GIL held.
pybind11::object options_to_py(const TransportOptions& o);
// Holds `obj` as the options of `transport` (a Python transport's defaults). GIL held.
std::unique_ptr<TransportOptions> python_options(pybind11::object obj, const std::string& transport);


}  // namespace pdkv
