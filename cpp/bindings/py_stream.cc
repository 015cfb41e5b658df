// StreamingWrite (pdkv/stream.h) for python/pdkv/agent.py: the native handle and the
// module function that opens one. Every call that may post releases the GIL; the data
// path stays in C++ (python/pdkv only calls post_layers/close).
#include "py_stream.h"

#include <pybind11/stl.h>

#include <optional>
#include <string>

#include "py_common.h"
#include "pdkv/agent.h"
#include "pdkv/stream.h"

namespace py = pybind11;

namespace pdkv {
namespace {

void check(const Status& st) {
  if (!st.ok()) bindings::raise_status(st);
}

std::shared_ptr<StreamingWrite> open_stream(Agent& a, const std::string& peer, const Blocks& local,
                                            const Blocks& remote, const PlanOptions& plan, const XferOptions& xfer,
                                            py::bytes notif, double timeout_s, const StreamOptions& stream) {
  std::string n = notif;
  Result<std::shared_ptr<StreamingWrite>> r = Status();
  {
    py::gil_scoped_release rel;
    r = a.open_stream(peer, local, remote, plan, xfer, std::move(n), timeout_s, stream);
  }
  if (!r.ok()) bindings::raise_status(r.status());
  return std::move(r).value();
}

}  // namespace

void bind_stream(py::module_& m) {
  py::class_<StreamingWrite, std::shared_ptr<StreamingWrite>>(m, "StreamingWrite")
      .def("post_layers",
           [](StreamingWrite& s, uint32_t first, uint32_t count) {
             Status st;
             {
               py::gil_scoped_release rel;
               st = s.post_layers(first, count);
             }
             check(st);
           },
           py::arg("first"), py::arg("count"))
      .def("close",
           [](StreamingWrite& s, std::optional<py::bytes> notif) {
             std::optional<std::string> n;
             if (notif) n = std::string(*notif);
             Status st;
             {
               py::gil_scoped_release rel;
               st = n ? s.close(std::move(*n)) : s.close();
             }
             check(st);
           },
           py::arg("notif") = py::none())
      .def("cancel", &StreamingWrite::cancel, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("transfer", &StreamingWrite::transfer)
      .def_property_readonly("first_layer", &StreamingWrite::first_layer)
      .def_property_readonly("num_layers", &StreamingWrite::num_layers)
      .def_property_readonly("layer_bytes", &StreamingWrite::layer_bytes)
      .def_property_readonly("layers_posted", &StreamingWrite::layers_posted)
      .def_property_readonly("layers_landed", &StreamingWrite::layers_landed)
      .def_property_readonly("batches_posted", &StreamingWrite::batches_posted)
      .def_property_readonly("wire_s", &StreamingWrite::wire_s)
      .def_property_readonly("tail_s", &StreamingWrite::tail_s)
      .def_property_readonly("closed", &StreamingWrite::closed);
  m.def("open_stream", &open_stream, py::arg("agent"), py::arg("peer"), py::arg("local"), py::arg("remote"),
        py::arg("plan"), py::arg("options"), py::arg("notif"), py::arg("timeout_s"), py::arg("stream"),
        "Opens a layer-wise streaming write (Agent::open_stream); python/pdkv/agent.py documents it.");
}

}  // namespace pdkv
