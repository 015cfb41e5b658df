// Binds pdkv/codec.h (py_codec.cc): the chunk codecs, for tests, tooling and benchmarks.
#pragma once

#include <pybind11/pybind11.h>

namespace pdkv {

void bind_codec(pybind11::module_& m);

}  // namespace pdkv
