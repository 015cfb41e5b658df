// pdkv.Blocks and the block-id reader every binding shares (py_blocks.cc).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <vector>

namespace pdkv::bindings {

// Block ids (or generations), validated once for every public entry point: a 1-D
// integer buffer (numpy array), or an iterable of ints (Python or numpy integer
// scalars). Bools, floats, strings and other objects are InvalidArgument naming `what`
// and the position; negative or > 2^32-1 ids are OutOfRange. Call with the GIL held.
std::vector<uint32_t> ids_from(const pybind11::object& o, const char* what);

// Binds pdkv::Blocks as _pdkv.Blocks.
void bind_blocks(pybind11::module_& m);

}  // namespace pdkv::bindings
