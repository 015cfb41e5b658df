// Binds CompletionQueue (py_async.cc): awaiting transfers without a thread per waiter.
#pragma once

#include <pybind11/pybind11.h>

namespace pdkv {

void bind_async(pybind11::module_& m);

}  // namespace pdkv
