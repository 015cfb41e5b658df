// py_transport.cc: transports written in Python implement pdkv::Transport.
//
// PyTransport is the trampoline: the agent holds it like any native transport, and
// each virtual call takes the GIL and calls the method of the same name on the Python
// object (a subclass of pdkv.transport.Transport; see that class for the Python side
// of the contract). The core keeps doing routing, peer selection, bounds checks and
// the transfer state; the Python object gets resolved extents as ONE int64 array and
// completes the native Transfer through its transport-side methods bound here.
//
// GIL rules: every call from C++ into Python takes the GIL (gil_scoped_acquire is
// re-entrant, so calls that arrive with it held work too: Agent.post keeps the GIL
// for a Python transport, see is_python_transport). Transport-side Transfer
// methods never block, so they keep the GIL; hooks that may block (fetch_metadata)
// release it. Python callables stored in C++ objects that outlive a call (registry
// factories, cancel hooks, drivers) are destroyed with the GIL held, or never.
#include "py_transport.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstring>
#include <unordered_map>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "pdkv/spi/registry.h"
#include "py_common.h"
#include "py_options.h"

namespace py = pybind11;

namespace pdkv::bindings {

// The Status a Python exception stands for: a pdkv error keeps its code (its class's
// `code` attribute names the StatusCode); anything else is an Internal error naming
// the exception, so a bug in a Python transport never crosses into C++ as a throw.
Status status_from(const py::error_already_set& e, std::string_view what) {
  StatusCode code = StatusCode::kInternal;
  py::object type = e.type();
  if (py::hasattr(type, "code")) {
    const std::string name = py::str(type.attr("code"));
    for (int c = 0; c <= static_cast<int>(kLastStatusCode); ++c)
      if (status_code_name(static_cast<StatusCode>(c)) == name) code = static_cast<StatusCode>(c);
  }
  std::string msg = py::str(e.value());
  if (code == StatusCode::kInternal) msg = std::string(what) + " raised " + py::str(type.attr("__name__")).cast<std::string>() + ": " + msg;
  return Status(code == StatusCode::kOk ? StatusCode::kInternal : code, std::move(msg));
}

namespace {

// The Status for an exception object passed in by Python code (resolve_part(error=)).
Status status_from_object(const py::handle& err) {
  StatusCode code = StatusCode::kInternal;
  if (py::hasattr(err, "code")) {
    const std::string name = py::str(err.attr("code"));
    for (int c = 0; c <= static_cast<int>(kLastStatusCode); ++c)
      if (status_code_name(static_cast<StatusCode>(c)) == name) code = static_cast<StatusCode>(c);
  }
  if (code == StatusCode::kOk) code = StatusCode::kInternal;
  return Status(code, py::str(err));
}



// What prepare() returned, kept as the transport's PreparedOps.
struct PyPreparedOps final : PreparedOps {
  explicit PyPreparedOps(py::object o) : obj(std::move(o)) {}
  ~PyPreparedOps() override {
    py::gil_scoped_acquire gil;
    obj = py::object();
  }
  py::object obj;
};

// The names registered from Python (python_factory). Guarded by the GIL; never
// destroyed (the registry it mirrors outlives the interpreter).
std::set<std::string, std::less<>>& python_transport_names() {
  static auto* names = new std::set<std::string, std::less<>>();
  return *names;
}

// Keeps a Python object alive without ever destroying it: for callables stored in
// the process-wide registry, which outlives the interpreter.
py::handle leak(py::object o) { return o.release(); }

// A Python object owned from C++ code that may drop it without the GIL. Emptied (with
// the GIL held) by whoever knows it is no longer needed, it is dropped without taking
// the GIL again.
std::shared_ptr<py::object> shared_object(py::object o) {
  return std::shared_ptr<py::object>(new py::object(std::move(o)), [](py::object* p) {
    if (!*p) {
      delete p;
      return;
    }
    py::gil_scoped_acquire gil;
    delete p;
  });
}

// What Python sees of the agent (AgentHooks): a plain handle, so that pybind11 never
// presents the agent itself (whose most-derived type is bound too).
struct HooksRef {
  AgentHooks* h;
};

}  // namespace

// Columns of the extents array handed to a Python transport's prepare().
constexpr int kExtentColumns = 7;

PyTransport::PyTransport(py::object impl) : impl_(std::move(impl)) {
  name_ = py::str(impl_.attr("name"));
}

PyTransport::~PyTransport() {
  py::gil_scoped_acquire gil;
  post_ = notify_ = py::object();
  impl_ = py::object();
}

TransportCaps PyTransport::caps() const { return caps_; }

bool is_python_transport(std::string_view transport) {
  const auto& names = python_transport_names();
  return names.find(transport) != names.end();
}

Status PyTransport::start(AgentHooks* hooks) {
  py::gil_scoped_acquire gil;
  try {
    caps_ = impl_.attr("caps")().cast<TransportCaps>();
    post_ = impl_.attr("post");
    notify_ = impl_.attr("notify");
    impl_.attr("start")(HooksRef{hooks});
    return Status::Ok();
  } catch (py::error_already_set& e) {
    return status_from(e, name_ + ".start");
  } catch (const py::cast_error& e) {
    return Internal(name_ + ".caps() must return a pdkv.TransportCaps: " + e.what());
  }
}

void PyTransport::shutdown() {
  py::gil_scoped_acquire gil;
  try {
    impl_.attr("shutdown")();
  } catch (py::error_already_set& e) {
    e.discard_as_unraisable((name_ + ".shutdown").c_str());
  }
}

std::vector<Endpoint> PyTransport::endpoints() const {
  py::gil_scoped_acquire gil;
  std::vector<Endpoint> out;
  try {
    for (auto item : impl_.attr("endpoints")()) {
      auto pair = item.cast<std::pair<std::string, std::string>>();
      out.push_back(Endpoint{pair.first, pair.second});
    }
  } catch (py::error_already_set& e) {
    e.discard_as_unraisable((name_ + ".endpoints").c_str());
  }
  return out;
}

std::string PyTransport::metadata_extra() const {
  py::gil_scoped_acquire gil;
  try {
    return impl_.attr("metadata_extra")().cast<std::string>();
  } catch (py::error_already_set& e) {
    e.discard_as_unraisable((name_ + ".metadata_extra").c_str());
    return {};
  }
}

bool PyTransport::can_reach(const AgentMetadata& peer) const {
  py::gil_scoped_acquire gil;
  try {
    return impl_.attr("can_reach")(peer).cast<bool>();
  } catch (py::error_already_set& e) {
    e.discard_as_unraisable((name_ + ".can_reach").c_str());
    return false;
  }
}

Result<std::shared_ptr<const PreparedOps>> PyTransport::prepare(std::shared_ptr<const Peer> peer, OpKind op,
                                                                std::vector<ResolvedExtent> extents) {
  // Built without the GIL: plain memory, one row per extent.
  std::unordered_map<uint64_t, uint64_t> remote_base;
  for (const auto& r : peer->md.regions) remote_base[r.id] = r.addr;
  std::vector<int64_t> rows(extents.size() * kExtentColumns);
  int64_t* row = rows.data();
  for (const ResolvedExtent& x : extents) {
    row[0] = static_cast<int64_t>(x.local_addr);
    row[1] = static_cast<int64_t>(x.len);
    row[2] = static_cast<int64_t>(x.local_kind);
    row[3] = x.local_device;
    row[4] = static_cast<int64_t>(x.remote_region);
    row[5] = static_cast<int64_t>(x.remote_offset);
    row[6] = static_cast<int64_t>(remote_base[x.remote_region] + x.remote_offset);
    row += kExtentColumns;
  }
  py::gil_scoped_acquire gil;
  try {
    py::array_t<int64_t> arr({static_cast<py::ssize_t>(extents.size()), py::ssize_t(kExtentColumns)});
    std::memcpy(arr.mutable_data(), rows.data(), rows.size() * sizeof(int64_t));
    py::object ops = impl_.attr("prepare")(std::const_pointer_cast<Peer>(peer), op, arr);
    return std::shared_ptr<const PreparedOps>(std::make_shared<PyPreparedOps>(std::move(ops)));
  } catch (py::error_already_set& e) {
    return status_from(e, name_ + ".prepare");
  }
}

// A Python exception here means the transport broke its contract (errors go through
// the transfer); fail what is left of the transfer so that nobody waits forever.
void PyTransport::fail_unless_terminal(const std::shared_ptr<Transfer>& xfer, const Status& st) {
  if (!xfer->terminal()) spi::TransferControl(xfer).fail_now(st);
}

void PyTransport::post(const std::shared_ptr<const PreparedOps>& ops, const std::shared_ptr<Transfer>& xfer,
                       std::string notif) {
  py::gil_scoped_acquire gil;
  try {
    const auto& py_ops = static_cast<const PyPreparedOps&>(*ops);
    post_(py_ops.obj, xfer, to_bytes(notif));
  } catch (py::error_already_set& e) {
    fail_unless_terminal(xfer, status_from(e, name_ + ".post"));
  }
}

void PyTransport::notify(std::shared_ptr<const Peer> peer, const std::shared_ptr<Transfer>& xfer, std::string notif) {
  py::gil_scoped_acquire gil;
  try {
    notify_(std::const_pointer_cast<Peer>(peer), xfer, to_bytes(notif));
  } catch (py::error_already_set& e) {
    fail_unless_terminal(xfer, status_from(e, name_ + ".notify"));
  }
}

Status PyTransport::connect(std::shared_ptr<const Peer> peer, double timeout_s) {
  py::gil_scoped_acquire gil;
  try {
    impl_.attr("connect")(std::const_pointer_cast<Peer>(peer), timeout_s);
    return Status::Ok();
  } catch (py::error_already_set& e) {
    return status_from(e, name_ + ".connect");
  }
}

void PyTransport::drop_peer(const std::string& name) {
  py::gil_scoped_acquire gil;
  try {
    impl_.attr("drop_peer")(name);
  } catch (py::error_already_set& e) {
    e.discard_as_unraisable((name_ + ".drop_peer").c_str());
  }
}

Status PyTransport::region_added(const RegionDesc& region) {
  py::gil_scoped_acquire gil;
  try {
    impl_.attr("region_added")(region_dict(region));
    return Status::Ok();
  } catch (py::error_already_set& e) {
    return status_from(e, name_ + ".region_added");
  }
}

void PyTransport::region_removed(const RegionDesc& region) {
  py::gil_scoped_acquire gil;
  try {
    impl_.attr("region_removed")(region_dict(region));
  } catch (py::error_already_set& e) {
    e.discard_as_unraisable((name_ + ".region_removed").c_str());
  }
}

Result<std::string> PyTransport::fetch_metadata(const std::string& address, std::string_view secret,
                                                double timeout_s) {
  py::gil_scoped_acquire gil;
  try {
    return impl_.attr("fetch_metadata")(address, to_bytes(secret), timeout_s).cast<std::string>();
  } catch (py::error_already_set& e) {
    return status_from(e, name_ + ".fetch_metadata");
  }
}

// ---------------------------------------------------------------- bindings
namespace {

void bind_caps(py::module_& m) {
  py::class_<TransportCaps>(m, "TransportCaps", "What a transport can do (see cpp/include/pdkv/spi/transport.h).")
      .def(py::init([](bool write, bool read, bool notify, bool cross_host, uint32_t local_mem_kinds,
                       uint32_t remote_mem_kinds, bool generations, bool serves_metadata, bool direct_small_extents) {
             return TransportCaps{write, read, notify, cross_host, local_mem_kinds, remote_mem_kinds, generations,
                                  serves_metadata, direct_small_extents};
           }),
           py::kw_only(), py::arg("write") = true, py::arg("read") = true, py::arg("notify") = true,
           py::arg("cross_host") = true, py::arg("local_mem_kinds") = 1u, py::arg("remote_mem_kinds") = 1u,
           py::arg("generations") = false, py::arg("serves_metadata") = false, py::arg("direct_small_extents") = false)
      .def_readwrite("write", &TransportCaps::write)
      .def_readwrite("read", &TransportCaps::read)
      .def_readwrite("notify", &TransportCaps::notify)
      .def_readwrite("direct_small_extents", &TransportCaps::direct_small_extents)
      .def_readwrite("cross_host", &TransportCaps::cross_host)
      .def_readwrite("local_mem_kinds", &TransportCaps::local_mem_kinds)
      .def_readwrite("remote_mem_kinds", &TransportCaps::remote_mem_kinds)
      .def_readwrite("generations", &TransportCaps::generations)
      .def_readwrite("serves_metadata", &TransportCaps::serves_metadata);
}

py::list endpoint_list(const std::vector<Endpoint>& eps) {
  py::list out;
  for (auto& e : eps) out.append(py::make_tuple(e.transport, e.address));
  return out;
}

void bind_peer(py::module_& m) {
  py::class_<AgentMetadata>(m, "AgentMetadata", "A peer's decoded metadata, as a transport sees it.")
      .def_readonly("name", &AgentMetadata::name)
      .def_readonly("instance_id", &AgentMetadata::instance_id)
      .def_readonly("host_id", &AgentMetadata::host_id)
      .def_readonly("pid", &AgentMetadata::pid)
      .def_property_readonly("endpoints", [](const AgentMetadata& md) { return endpoint_list(md.endpoints); })
      .def_property_readonly("regions",
                             [](const AgentMetadata& md) {
                               py::list out;
                               for (auto& r : md.regions) out.append(region_dict(r));
                               return out;
                             })
      .def("extra", [](const AgentMetadata& md, const std::string& name) -> py::object {
        for (auto& [n, blob] : md.extras)
          if (n == name) return to_bytes(blob);
        return py::none();
      }, "The bytes transport `name` published (metadata_extra), or None.");

  py::class_<Peer, std::shared_ptr<Peer>>(m, "Peer", "A known peer: its metadata and the secret to prove knowledge of to it (never sent).")
      .def_property_readonly("name", [](const Peer& p) { return p.md.name; })
      .def_property_readonly("md", [](const Peer& p) -> const AgentMetadata& { return p.md; },
                             py::return_value_policy::reference_internal)
      .def_property_readonly("secret", [](const Peer& p) { return to_bytes(p.secret); });
}

void bind_hooks(py::module_& m) {
  py::class_<HooksRef>(m, "AgentHooks", "What a transport may ask of the agent that owns it (transport.h).")
      .def_property_readonly("agent_name", [](const HooksRef& r) { return r.h->agent_name(); })
      .def_property_readonly("instance_id", [](const HooksRef& r) { return r.h->instance_id(); })
      .def_property_readonly("host_id", [](const HooksRef& r) { return r.h->host_id(); })
      .def_property_readonly(
          "accepted_secrets",
          [](const HooksRef& r) {
            py::list out;
            for (const std::string& s : r.h->accepted_secrets()) out.append(to_bytes(s));
            return out;
          },
          "Every secret this agent accepts, its own first (derive keys from them; never send them).")
      .def_property_readonly("max_notif_bytes", [](const HooksRef& r) { return r.h->max_notif_bytes(); })
      .def("regions",
           [](const HooksRef& r) {
             py::list out;
             for (auto& d : r.h->region_table().list()) out.append(region_dict(d));
             return out;
           })
      .def("deliver_notification",
           [](const HooksRef& r, const std::string& peer, py::bytes data) {
             // Raises ResourceExhausted when the agent's queue is full (not queued).
             Status st = r.h->deliver_notification(Notification{peer, std::string(data)});
             if (!st.ok()) raise_status(st);
           },
           py::arg("peer"), py::arg("data"))
      .def("metadata_blob", [](const HooksRef& r) { return to_bytes(r.h->metadata_blob()); })
      .def("fetch_metadata",
           [](const HooksRef& r, const std::string& address, py::bytes secret, double timeout_s) {
             std::string s = secret;
             Result<std::string> res = Status();
             {
               py::gil_scoped_release rel;
               res = r.h->fetch_peer_metadata(address, s, timeout_s);
             }
             if (!res.ok()) raise_status(res.status());
             return to_bytes(*res);
           },
           py::arg("address"), py::arg("secret"), py::arg("timeout_s"));
}

// A registered Python factory: viable() -> None or a reason; create(config, options) ->
// transport, `options` an instance of `options_cls` (the config's, else options_cls())
// or None when options_cls is None. `priority`: an int, or a callable returning one (a
// priority that depends on the host).
TransportFactory python_factory(const std::string& name, const std::string& description, py::object priority,
                                py::object viable, py::object create, const std::string& metadata_via,
                                py::object options_cls) {
  py::handle v = leak(std::move(viable));
  py::handle c = leak(std::move(create));
  if (!options_cls.is_none()) {
    if (!py::isinstance<py::type>(options_cls))
      raise_status(InvalidArgument("options of transport '" + name + "' must be a class, got " +
                                   std::string(py::repr(options_cls))));
    py::object declared = py::getattr(options_cls, "transport", py::none());
    if (!py::isinstance<py::str>(declared) || declared.cast<std::string>() != name)
      raise_status(InvalidArgument("the options class of transport '" + name +
                                   "' must name it in a class attribute: transport = '" + name + "'"));
  }
  TransportFactory f;
  f.name = name;
  f.description = description;
  f.metadata_via = metadata_via;
  if (PyCallable_Check(priority.ptr())) {
    py::handle p = leak(std::move(priority));
    f.host_priority = [p, name]() -> int {
      py::gil_scoped_acquire gil;
      try {
        return p().cast<int>();
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable((name + " priority()").c_str());
        return 0;
      } catch (const py::cast_error&) {
        return 0;
      }
    };
  } else {
    f.priority = priority.cast<int>();
    if (f.priority < 0) raise_status(InvalidArgument("priority must be >= 0"));
  }
  f.viable = [v, name]() -> Status {
    py::gil_scoped_acquire gil;
    try {
      py::object why = v();
      if (why.is_none()) return Status::Ok();
      return NotSupported(py::str(why));
    } catch (py::error_already_set& e) {
      return status_from(e, name + " viable()");
    }
  };
  py::handle oc;
  if (!options_cls.is_none()) {
    // Borrowed: the module's `_transport_options` dict holds the class, so it is freed
    // with the module when the interpreter finalizes (after atexit handlers, when no
    // agent is created any more). Leaked from C++ instead, the class would never be
    // freed, and the code CPython compiled for it (a dataclass's __init__) would be
    // reported by LeakSanitizer in every process that imports the Python transports.
    py::module_ mod = py::module_::import("pdkv._pdkv");
    if (!py::hasattr(mod, "_transport_options")) mod.attr("_transport_options") = py::dict();
    mod.attr("_transport_options")[py::str(name)] = options_cls;
    oc = options_cls;
    f.default_options = [oc, name]() -> std::unique_ptr<TransportOptions> {
      py::gil_scoped_acquire gil;
      return python_options(oc(), name);
    };
  }
  f.create = [c, oc, name](const AgentConfig& cfg, const TransportOptions* options) -> Result<std::unique_ptr<Transport>> {
    py::gil_scoped_acquire gil;
    try {
      py::object opts = py::none();
      if (options != nullptr) {
        opts = options_to_py(*options);
        if (oc && !py::isinstance(opts, oc))
          return InvalidArgument("transport '" + name + "' takes " + py::str(oc.attr("__name__")).cast<std::string>() +
                                 " options, got " + py::str(py::type::handle_of(opts).attr("__name__")).cast<std::string>());
        Status st = options->validate();
        if (!st.ok()) return st;
      }
      py::object impl = c(py::cast(cfg), opts);
      if (!py::hasattr(impl, "name") || py::str(impl.attr("name")).cast<std::string>() != name)
        return Internal("the factory of transport '" + name + "' returned an object whose name is not '" + name + "'");
      return std::unique_ptr<Transport>(std::make_unique<PyTransport>(std::move(impl)));
    } catch (py::error_already_set& e) {
      return status_from(e, "creating transport '" + name + "'");
    }
  };
  return f;
}

}  // namespace

void bind_transport_sdk(py::module_& m, py::class_<Transfer, std::shared_ptr<Transfer>>& transfer) {
  bind_caps(m);
  bind_peer(m);
  bind_hooks(m);
  m.attr("EXTENT_COLUMNS") = py::make_tuple("local_addr", "len", "local_kind", "local_device", "remote_region",
                                            "remote_offset", "remote_addr");
  m.def("register_transport",
        [](const std::string& name, const std::string& description, py::object priority, py::object viable,
           py::object create, const std::string& metadata_via, py::object options) {
          if (name.empty()) raise_status(InvalidArgument("a transport needs a name"));
          if (!register_transport(python_factory(name, description, priority, std::move(viable), std::move(create),
                                                 metadata_via, std::move(options))))
            raise_status(AlreadyExists("a transport named '" + name + "' is registered already"));
          python_transport_names().insert(name);
        },
        py::arg("name"), py::arg("description"), py::arg("priority"), py::arg("viable"), py::arg("create"),
        py::arg("metadata_via") = "", py::arg("options") = py::none());
  m.def("default_transports", &default_transports);

  // The transport side of a Transfer (spi/transfer_control.h).
  transfer
      .def("set_parts", [](Transfer& t, uint32_t n) { spi::TransferControl(t).set_parts(n); }, py::arg("n"),
           "Declares how many parts will resolve (once, before any resolves).")
      .def("resolve_part",
           [](Transfer& t, uint64_t nbytes, py::object error) {
             const Status st = error.is_none() ? Status::Ok() : status_from_object(error);
             return spi::TransferControl(t).resolve_part(nbytes, st);
           },
           py::arg("nbytes"), py::arg("error") = py::none(),
           "Resolves one part: its bytes landed, or `error` (a pdkv.PdkvError; Cancelled for a dropped part). "
           "True when this made the transfer terminal.")
      .def(
          "fail_now", [](Transfer& t, py::object error) { spi::TransferControl(t).fail_now(status_from_object(error)); },
          py::arg("error"), "Fails a transfer none of whose parts was started.")
      .def_property_readonly("terminal", &Transfer::terminal)
      .def_property_readonly("cancel_requested",
                             [](Transfer& t) { return spi::TransferControl(t).cancel_requested(); })
      .def_property_readonly("remaining_s",
                             [](const Transfer& t) {
                               if (t.deadline() == Clock::time_point::max())
                                 return std::numeric_limits<double>::infinity();
                               return std::chrono::duration<double>(t.deadline() - Clock::now()).count();
                             },
                             "Seconds until the transfer's deadline (inf: none; negative: passed).")
      .def("set_cancel_hook",
           [](Transfer& t, py::object hook) {
             if (hook.is_none()) return spi::TransferControl(t).set_cancel_hook(nullptr);
             auto fn = shared_object(std::move(hook));
             spi::TransferControl(t).set_cancel_hook([fn] {
               py::gil_scoped_acquire gil;
               try {
                 (*fn)();
               } catch (py::error_already_set& e) {
                 e.discard_as_unraisable("pdkv transfer cancel hook");
               }
             });
           },
           "Called (from the thread that calls cancel()) when cancellation is requested.")
      .def("set_driver",
           [](Transfer& t, py::object drive) {
             if (drive.is_none()) return spi::TransferControl(t).set_driver(nullptr);
             auto fn = shared_object(std::move(drive));
             spi::TransferControl(t).set_driver([fn](Transfer& xfer, Clock::time_point until, uint32_t) {
               const double left = until == Clock::time_point::max()
                                       ? std::numeric_limits<double>::infinity()
                                       : std::chrono::duration<double>(until - Clock::now()).count();
               py::gil_scoped_acquire gil;
               if (!*fn) return;  // another waiter saw the transfer end
               py::object drive = *fn;  // (kept for the call: another waiter may empty *fn meanwhile)
               try {
                 drive(left);
               } catch (py::error_already_set& e) {
                 e.discard_as_unraisable("pdkv transfer driver");
               }
               // Terminal: the driver is never called again. Dropped here, under the GIL
               // this call holds anyway, instead of by wait() taking the GIL once more.
               if (xfer.terminal()) *fn = py::object();
             });
           },
           "drive(timeout_s) is called by wait() (GIL taken) to make progress itself until the transfer is "
           "terminal or timeout_s passes.");
}

}  // namespace pdkv::bindings
