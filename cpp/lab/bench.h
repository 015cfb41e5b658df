// Ceilings for `pdkv bench transfer`: a plain socket pair and memcpy, in C++ so they
// are measured at the same code quality as the transport.
#pragma once

#include <pybind11/pybind11.h>

namespace bench {
void bind(pybind11::module_& m);
}
