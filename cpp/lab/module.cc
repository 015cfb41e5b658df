// _pdkv_lab: the lab's native helpers (pdkv.lab), apart from the library's module.
//
// `import pdkv` never loads it: only `pdkv bench transfer` (the raw-socket and memcpy
// ceilings) and `pdkv netlab` (the userspace delay line) do, through
// python/pdkv/lab/_native.py.
#include <pybind11/pybind11.h>

#include <string>

#include "bench.h"
#include "netlab_delay.h"

namespace py = pybind11;

PYBIND11_MODULE(_pdkv_lab, m) {
  m.doc() = "pdkv's lab helpers: benchmark ceilings and the netlab delay line (not part of `import pdkv`)";
  m.attr("pybind11_version") = std::to_string(PYBIND11_VERSION_MAJOR) + "." + std::to_string(PYBIND11_VERSION_MINOR) +
                               "." + std::to_string(PYBIND11_VERSION_PATCH);

  // Raw-socket and memcpy ceilings measured with the same code path quality as the
  // transport (C++, no Python in the loop).
  py::module_ bench = m.def_submodule("bench", "ceilings for `pdkv bench transfer`");
  bench::bind(bench);
  py::module_ lab = m.def_submodule("netlab", "the delay line of `pdkv netlab` (kernels without sch_netem)");
  netlab::bind(lab);
}
