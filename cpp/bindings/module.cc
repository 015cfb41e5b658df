// _pdkv: the native module behind `import pdkv`.
//
// Thin on purpose: python/pdkv wraps it with documented, typed classes. Every
// non-OK Status becomes the pdkv.errors exception of its code (one table, in
// errors.py). The GIL is released in every call that can block or does work
// proportional to its input.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <cstring>
#include <string>
#include <vector>

#include "util/bench_switches.h"
#include "py_common.h"
#include "py_async.h"
#include "py_auth.h"
#include "py_blocks.h"
#include "py_dlpack.h"
#include "py_options.h"
#include "py_codec.h"
#include "py_stream.h"
#include "py_transport.h"
#include "pdkv/agent.h"
#include "pdkv/kv_layout.h"
#include "pdkv/metadata.h"
#include "pdkv/spi/registry.h"
#include "pdkv/status.h"
#include "util/thread_cpus.h"

namespace py = pybind11;
using namespace pdkv;
using bindings::ids_from;
using bindings::region_dict;
using bindings::to_bytes;

namespace {

struct StatusError : std::exception {
  Status st;
  explicit StatusError(Status s) : st(std::move(s)) {}
  const char* what() const noexcept override { return st.message().c_str(); }
};

void check(const Status& st) {
  if (!st.ok()) throw StatusError(st);
}

template <typename T>
T unwrap(Result<T>&& r) {
  if (!r.ok()) throw StatusError(r.status());
  return std::move(r).value();
}

std::string type_name(const py::handle& o) { return py::str(py::type::handle_of(o).attr("__name__")); }

// A member of the bound XferState enum, handed out as the object py::enum_ made for
// it: Transfer.wait returns these very objects (pdkv.Transfer compares them with
// `is`) instead of casting a new enum instance per call, which costs as much as a
// small transfer's bookkeeping. Filled once at import; never released.
class XferStateObject : public py::object {
 public:
  explicit XferStateObject(XferState s) : py::object(py::reinterpret_borrow<py::object>(members()[int(s)])) {}
  static std::array<PyObject*, 4>& members() {
    static std::array<PyObject*, 4> m{};
    return m;
  }
};

}  // namespace

namespace pybind11::detail {
template <>
struct handle_type_name<XferStateObject> {
  static constexpr auto name = const_name("XferState");
};
}  // namespace pybind11::detail

PYBIND11_MODULE(_pdkv, m) {
  m.doc() = "pdkv native core (use the `pdkv` package, not this module)";
  // The pybind11 this module was built with: its generated stubs depend on it (scripts/gen_stubs.py).
  m.attr("pybind11_version") = std::to_string(PYBIND11_VERSION_MAJOR) + "." + std::to_string(PYBIND11_VERSION_MINOR) +
                               "." + std::to_string(PYBIND11_VERSION_PATCH);

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      py::gil_scoped_acquire gil;
      py::object exc = bindings::status_exception(e.st);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });

  py::enum_<XferState>(m, "XferState")
      .value("PENDING", XferState::kPending)
      .value("DONE", XferState::kDone)
      .value("FAILED", XferState::kFailed)
      .value("CANCELLED", XferState::kCancelled);
  for (XferState st : {XferState::kPending, XferState::kDone, XferState::kFailed, XferState::kCancelled})
    XferStateObject::members()[int(st)] = py::object(m.attr("XferState").attr(py::cast(st).attr("name"))).release().ptr();
  py::enum_<OpKind>(m, "OpKind").value("WRITE", OpKind::kWrite).value("READ", OpKind::kRead);
  py::enum_<MemKind>(m, "MemKind").value("HOST", MemKind::kHost).value("CUDA", MemKind::kCuda);
  py::enum_<TokenOrder>(m, "TokenOrder").value("NHD", TokenOrder::kNHD).value("HND", TokenOrder::kHND);

  m.def("dtype_size", [](const std::string& name) { return dtype_size(unwrap(parse_dtype(name))); });
  m.def("dtype_name", [](const std::string& name) { return std::string(dtype_name(unwrap(parse_dtype(name)))); });
  m.def("set_thread_cpus", [](const std::vector<int>& cpus) { check(util::set_thread_cpus(cpus)); });
  m.def("thread_cpus", &util::thread_cpus);
  m.def("registered_transports", &registered_transports);
  m.def("available_transports", &available_transports);
  m.def(
      "bench_switches",
      [] {
        py::list out;
        const auto& values = util::bench_switch_values();
        for (size_t i = 0; i < util::kBenchSwitches.size(); ++i) {
          const util::BenchSwitchInfo& s = util::kBenchSwitches[i];
          py::dict d;
          d["name"] = s.name;
          d["values"] = s.values;
          d["meaning"] = s.meaning;
          d["default"] = s.dflt;
          d["value"] = values[i];
          out.append(d);
        }
        return out;
      },
      "The benchmark switches (cpp/src/util/bench_switches.h): dicts of name, values, meaning, default and "
      "the value in force ('' when unset), read once per process.");
  m.def("status_code_names", [] {
    std::vector<std::string> out;
    for (int c = 0; c <= static_cast<int>(kLastStatusCode); ++c)
      out.emplace_back(status_code_name(static_cast<StatusCode>(c)));
    return out;
  });
  m.def("buffer_info", [](py::object o) {
    if (!py::isinstance<py::buffer>(o))
      throw StatusError(InvalidArgument("expected an object with a pointer and a length (numpy array, torch tensor, "
                                        "buffer-protocol object), got " + type_name(o)));
    py::buffer_info bi = py::reinterpret_borrow<py::buffer>(o).request();
    // Contiguity: a C-contiguous view covers itemsize * size bytes from ptr.
    py::ssize_t expect = bi.itemsize;
    bool contiguous = true;
    for (py::ssize_t d = bi.ndim - 1; d >= 0; --d) {
      if (bi.shape[d] != 1 && bi.strides[d] != expect) contiguous = false;
      expect *= bi.shape[d];
    }
    return py::make_tuple(reinterpret_cast<uintptr_t>(bi.ptr), bi.itemsize * bi.size, bi.readonly, contiguous);
  });

  py::class_<KVGeometry>(m, "KVGeometry")
      .def(py::init([](uint32_t layers, uint32_t blocks, uint32_t block_tokens, uint32_t kv_heads, uint32_t head_dim,
                       const std::string& dtype, uint32_t kv_parts, TokenOrder order) {
             KVGeometry g;
             g.num_layers = layers;
             g.num_blocks = blocks;
             g.block_tokens = block_tokens;
             g.kv_heads = kv_heads;
             g.head_dim = head_dim;
             g.kv_parts = kv_parts;
             g.dtype = unwrap(parse_dtype(dtype));
             g.order = order;
             check(g.validate());
             return g;
           }),
           py::arg("num_layers"), py::arg("num_blocks"), py::arg("block_tokens"), py::arg("kv_heads"),
           py::arg("head_dim"), py::arg("dtype"), py::arg("kv_parts"), py::arg("order"))
      .def_readonly("num_layers", &KVGeometry::num_layers)
      .def_readonly("num_blocks", &KVGeometry::num_blocks)
      .def_readonly("block_tokens", &KVGeometry::block_tokens)
      .def_readonly("kv_heads", &KVGeometry::kv_heads)
      .def_readonly("head_dim", &KVGeometry::head_dim)
      .def_readonly("kv_parts", &KVGeometry::kv_parts)
      .def_readonly("order", &KVGeometry::order)
      .def_property_readonly("dtype", [](const KVGeometry& g) { return std::string(dtype_name(g.dtype)); })
      .def_property_readonly("block_half_bytes", &KVGeometry::block_half_bytes)
      .def("__eq__", [](const KVGeometry& a, const KVGeometry& b) { return a == b; });

  py::class_<KVLayout>(m, "KVLayout")
      .def_static("make",
                  [](const KVGeometry& g, const std::vector<std::pair<uint64_t, uint64_t>>& segs) {
                    std::vector<KVSegment> s;
                    for (auto& [a, st] : segs) s.push_back(KVSegment{a, st});
                    return unwrap(KVLayout::make(g, std::move(s)));
                  })
      .def_static("make_strided",
                  [](const KVGeometry& g, const std::vector<std::array<uint64_t, 4>>& segs) {
                    std::vector<KVSegment> s;
                    for (auto& [a, bs, ts, hs] : segs) {
                      KVSegment x{a, bs};
                      x.token_stride = ts;
                      x.head_stride = hs;
                      s.push_back(x);
                    }
                    return unwrap(KVLayout::make(g, std::move(s)));
                  },
                  py::arg("geometry"), py::arg("segments"),
                  "segments[layer * kv_parts + part] = (addr, block_stride, token_stride, head_stride), bytes")
      .def_static("contiguous", [](const KVGeometry& g, uint64_t base, bool interleaved) {
        return unwrap(KVLayout::contiguous(g, base, interleaved));
      })
      .def_static("contiguous_bytes", &KVLayout::contiguous_bytes)
      .def_property_readonly("geometry", &KVLayout::geometry)
      .def_property_readonly("segments",
                             [](const KVLayout& l) {
                               py::list out;
                               for (auto& s : l.segments()) {
                                 py::dict d;
                                 d["addr"] = s.addr;
                                 d["block_stride"] = s.block_stride;
                                 d["token_stride"] = s.token_stride;
                                 d["head_stride"] = s.head_stride;
                                 d["region_id"] = s.region_id == KVSegment::kUnbound ? py::object(py::none())
                                                                                       : py::object(py::int_(s.region_id));
                                 d["region_offset"] = s.region_offset;
                                 out.append(d);
                               }
                               return out;
                             })
      .def_property_readonly("bound", &KVLayout::bound)
      .def_property_readonly("min_addr", &KVLayout::min_addr)
      .def_property_readonly("end_addr", &KVLayout::end_addr);

  m.def(
      "plan_blocks",
      [](const KVLayout& local, py::object lids, const KVLayout& remote, py::object rids, py::object plan,
         const std::string& distinct_side) {
        auto l = ids_from(lids, "local_blocks");
        auto r = ids_from(rids, "remote_blocks");
        // None: move everything (the class is bound after this function, so no typed default).
        if (!plan.is_none() && !py::isinstance<PlanOptions>(plan))
          throw StatusError(InvalidArgument("plan must be a PlanOptions or None, got " + type_name(plan)));
        const PlanOptions o = plan.is_none() ? PlanOptions{} : plan.cast<PlanOptions>();
        std::vector<Extent> ex;
        {
          py::gil_scoped_release rel;
          Status distinct = distinct_side == "local"    ? check_distinct_blocks(l, "local")
                            : distinct_side == "remote" ? check_distinct_blocks(r, "remote")
                                                        : Status::Ok();
          auto res = distinct.ok() ? plan_blocks(local, l, remote, r, o) : Result<std::vector<Extent>>(distinct);
          if (!res.ok()) {
            py::gil_scoped_acquire acq;
            throw StatusError(res.status());
          }
          ex = std::move(res).value();
        }
        py::list out;
        for (auto& e : ex) out.append(py::make_tuple(e.local_region, e.local_offset, e.remote_region, e.remote_offset, e.len));
        return out;
      },
      py::arg("local"), py::arg("local_ids"), py::arg("remote"), py::arg("remote_ids"), py::arg("plan") = py::none(),
      py::arg("distinct") = "");

  m.def("decode_metadata", [](py::bytes blob) {
    std::string b = blob;
    AgentMetadata md = unwrap(decode_metadata(b));
    py::dict d;
    d["version"] = kMetadataVersion;  // the version this pdkv writes (older blobs decode into the same form)
    d["name"] = md.name;
    d["instance_id"] = md.instance_id;
    d["host_id"] = md.host_id;
    d["pid"] = md.pid;
    py::list eps;
    for (auto& e : md.endpoints) eps.append(py::make_tuple(e.transport, e.address));
    d["endpoints"] = eps;
    py::list regs;
    for (auto& r : md.regions) regs.append(region_dict(r));
    d["regions"] = regs;
    py::dict lays;
    for (auto& [n, l] : md.layouts) lays[py::str(n)] = l;
    d["layouts"] = lays;
    py::dict extras;
    for (auto& [n, b] : md.extras) extras[py::str(n)] = to_bytes(b);
    d["extras"] = extras;
    return d;
  });

  py::class_<Transfer, std::shared_ptr<Transfer>> transfer(m, "Transfer");
  transfer.def_property_readonly("id", &Transfer::id)
      .def_property_readonly("op", &Transfer::op)
      .def_property_readonly("peer", &Transfer::peer)
      .def_property_readonly("transport", &Transfer::transport)
      .def_property_readonly("state", &Transfer::state)
      .def_property_readonly("bytes_total", &Transfer::bytes_total)
      .def_property_readonly("bytes_done", &Transfer::bytes_done)
      .def_property_readonly("elapsed_s", &Transfer::elapsed_s)
      .def_property_readonly("compression", [](const Transfer& t) { return std::string(t.compression()); })
      .def_property_readonly("wire_bytes", &Transfer::wire_bytes)
      .def("error_info",
           [](const Transfer& t) -> py::object {
             Status st = t.error();
             if (st.ok()) return py::none();
             return py::make_tuple(std::string(status_code_name(st.code())), st.message());
           })
      .def("wait",
           [](const Transfer& t, double timeout_s) {
             // Terminal already (a small write over a Python transport often ends inside
             // post): no GIL hand-off for nothing.
             XferState st = t.state();
             if (st == XferState::kPending) {
               py::gil_scoped_release rel;
               st = t.wait(timeout_s);
             }
             return XferStateObject(st);
           },
           py::arg("timeout_s"))
      .def("cancel", &Transfer::cancel, py::call_guard<py::gil_scoped_release>());
  // Transports written in Python: the trampoline and what they may call.
  bindings::bind_transport_sdk(m, transfer);

  py::class_<PreparedTransfer, std::shared_ptr<PreparedTransfer>>(m, "PreparedTransfer")
      .def_readonly("peer", &PreparedTransfer::peer)
      .def_readonly("transport", &PreparedTransfer::transport)
      .def_readonly("op", &PreparedTransfer::op)
      .def_readonly("bytes", &PreparedTransfer::bytes)
      .def_readonly("num_extents", &PreparedTransfer::num_extents)
      .def_readonly("checked", &PreparedTransfer::checked);

  bind_options(m);
  bindings::bind_blocks(m);
  bind_async(m);
  bind_dlpack(m);
  py::class_<Agent>(m, "Agent")
      .def(py::init([](AgentConfig config) {
             std::unique_ptr<Agent> a;
             {
               py::gil_scoped_release rel;
               auto r = Agent::create(std::move(config));
               if (!r.ok()) {
                 py::gil_scoped_acquire acq;
                 throw StatusError(r.status());
               }
               a = std::move(r).value();
             }
             return a;
           }),
           py::arg("config"), "Validates `config` and starts the agent's transports.")
      .def_property_readonly("name", &Agent::name)
      .def_property_readonly("secret", [](const Agent& a) { return to_bytes(a.secret()); })
      .def_property_readonly("instance_id", &Agent::instance_id)
      .def_property_readonly("transports", &Agent::transports)
      .def_property_readonly("endpoints",
                             [](const Agent& a) {
                               py::list out;
                               for (auto& e : a.endpoints()) out.append(py::make_tuple(e.transport, e.address));
                               return out;
                             })
      .def("register_memory",
           [](Agent& a, uint64_t addr, uint64_t len, MemKind kind, int32_t device, bool remote, int shm_fd) {
             return region_dict(unwrap(a.register_memory(addr, len, kind, device, remote, shm_fd)));
           },
           py::arg("addr"), py::arg("len"), py::arg("kind"), py::arg("device"), py::arg("remote_access"),
           py::arg("shm_fd") = -1)
      .def("deregister_memory",
           [](Agent& a, uint64_t id) {
             Status st;
             {
               py::gil_scoped_release rel;
               st = a.deregister_memory(id);
             }
             check(st);
           })
      .def("regions",
           [](const Agent& a) {
             py::list out;
             for (auto& r : a.regions()) out.append(region_dict(r));
             return out;
           })
      .def("add_layout", [](Agent& a, const std::string& n, const KVLayout& l) { check(a.add_layout(n, l)); })
      .def("remove_layout", [](Agent& a, const std::string& n) { check(a.remove_layout(n)); })
      .def("layout", [](const Agent& a, const std::string& n) { return unwrap(a.layout(n)); })
      .def("layout_names", &Agent::layout_names)
      .def("metadata", [](Agent& a) { return to_bytes(a.metadata()); })
      .def("add_peer",
           [](Agent& a, py::bytes blob, py::bytes secret, const std::string& transport, const std::string& via_host) {
             return unwrap(a.add_peer(std::string(blob), std::string(secret), transport, via_host));
           },
           py::arg("blob"), py::arg("secret"), py::arg("transport"), py::arg("via_host") = "")
      .def("remove_peer",
           [](Agent& a, const std::string& n) {
             Status st;
             {
               py::gil_scoped_release rel;
               st = a.remove_peer(n);
             }
             check(st);
           })
      .def("peer_names", &Agent::peer_names)
      .def("peer_transport", [](const Agent& a, const std::string& n) { return unwrap(a.peer_transport(n)); })
      .def("peer_metadata", [](const Agent& a, const std::string& n) {
        auto p = unwrap(a.peer(n));
        return to_bytes(encode_metadata(p->md));
      })
      .def("fetch_metadata",
           [](Agent& a, const std::string& addr, py::bytes secret, double timeout_s) {
             std::string s = secret;
             Result<std::string> r = Status();
             {
               py::gil_scoped_release rel;
               r = a.fetch_metadata(addr, s, timeout_s);
             }
             return to_bytes(unwrap(std::move(r)));
           })
      .def("connect",
           [](Agent& a, const std::string& n, double timeout_s) {
             Status st;
             {
               py::gil_scoped_release rel;
               st = a.connect(n, timeout_s);
             }
             check(st);
           })
      .def("prepare_blocks",
           [](Agent& a, const std::string& peer, OpKind op, const Blocks& local, const Blocks& remote,
              const PlanOptions& plan, const XferOptions& opts) {
             Result<std::shared_ptr<PreparedTransfer>> res = Status();
             {
               py::gil_scoped_release rel;
               res = a.prepare_blocks(peer, op, local, remote, plan, opts);
             }
             return unwrap(std::move(res));
           },
           py::arg("peer"), py::arg("op"), py::arg("local"), py::arg("remote"), py::arg("plan"), py::arg("options"))
      .def("generations",
           [](const Agent& a, const std::string& layout, py::object ids) {
             return unwrap(a.generations(layout, ids_from(ids, "block_ids")));
           })
      .def("bump_generations",
           [](Agent& a, const std::string& layout, py::object ids, double timeout_s) {
             auto v = ids_from(ids, "block_ids");
             Result<std::vector<uint32_t>> res = Status();
             {
               py::gil_scoped_release rel;
               res = a.bump_generations(layout, v, timeout_s);
             }
             return unwrap(std::move(res));
           })
      .def("prepare_extents",
           [](Agent& a, const std::string& peer, OpKind op,
              const std::vector<std::tuple<uint64_t, uint64_t, uint64_t, uint64_t, uint64_t>>& ex,
              const XferOptions& xo) {
             std::vector<Extent> v;
             v.reserve(ex.size());
             for (auto& [lr, lo, rr, ro, len] : ex) v.push_back(Extent{lr, lo, rr, ro, len});
             Result<std::shared_ptr<PreparedTransfer>> res = Status();
             {
               py::gil_scoped_release rel;
               res = a.prepare_extents(peer, op, v, xo);
             }
             return unwrap(std::move(res));
           },
           py::arg("peer"), py::arg("op"), py::arg("extents"), py::arg("options"))
      .def("post",
           [](Agent& a, const PreparedTransfer& p, py::bytes notif, double timeout_s) {
             std::string n = notif;
             Result<std::shared_ptr<Transfer>> res = Status();
             if (bindings::is_python_transport(p.transport)) {
               // Its post takes the GIL anyway: releasing it here would cost two hand-offs
               // per transfer. Agent::post blocks on nothing but short core locks whose
               // holders never wait for the GIL.
               res = a.post(p, std::move(n), timeout_s);
             } else {
               py::gil_scoped_release rel;
               res = a.post(p, std::move(n), timeout_s);
             }
             return unwrap(std::move(res));
           })
      .def("send_notification",
           [](Agent& a, const std::string& peer, py::bytes notif, double timeout_s) {
             std::string n = notif;
             Result<std::shared_ptr<Transfer>> res = Status();
             {
               py::gil_scoped_release rel;
               res = a.send_notification(peer, std::move(n), timeout_s);
             }
             return unwrap(std::move(res));
           })
      .def("take_notifications",
           [](Agent& a, size_t max) {
             auto v = a.notifications().take(max);
             py::list out;
             for (auto& n : v) out.append(py::make_tuple(n.peer, to_bytes(n.data)));
             return out;
           })
      .def("wait_notifications",
           [](Agent& a, double timeout_s, size_t max) {
             std::vector<Notification> v;
             {
               py::gil_scoped_release rel;
               v = a.notifications().wait(timeout_s, max);
             }
             py::list out;
             for (auto& n : v) out.append(py::make_tuple(n.peer, to_bytes(n.data)));
             return out;
           })
      .def_property_readonly("notification_fd", [](Agent& a) { return a.notifications().fd(); })
      .def_property_readonly("notifications_unacknowledged", &Agent::notifications_unacknowledged);

  bind_stream(m);  // after Agent: its signatures name the class
  bind_codec(m);
  bind_auth(m);
  // The lab's helpers (benchmark ceilings, netlab's delay line) are a module of their
  // own: cpp/lab/module.cc (pdkv.lab._pdkv_lab).
}
