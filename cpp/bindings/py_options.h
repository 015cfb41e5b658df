// Binds TcpOptions, ShmOptions and AgentConfig (py_options.cc) into the _pdkv module.
#pragma once

#include <pybind11/pybind11.h>

#include <optional>
#include <string>

#include "pdkv/transfer.h"

namespace pdkv {

void bind_options(pybind11::module_& m);

// A transfer's `compress=` argument (XferOptions::compress): None -> nullopt, else
// "off" / "lossless" / "fp8" / "auto"; raises InvalidArgument naming the value.
std::optional<CompressMode> transfer_compress(const std::optional<std::string>& s);

}  // namespace pdkv
