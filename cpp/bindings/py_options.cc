// Python classes of the typed options: TcpOptions, ShmOptions (each transport's,
// pdkv/options/*.h), AgentConfig (pdkv/config.h) and a transfer's PlanOptions,
// XferOptions and StreamOptions (pdkv/kv_layout.h, agent.h, stream.h), bound once,
// field by field; and the conversion of a list of transport options
// (AgentConfig.options) both ways: a native options class is copied, a Python
// transport's options object is held.
//
// Each class is built from one table of fields: a read-write attribute per field, a
// keyword-only constructor (`TcpOptions(spin_us=5)`) whose signature is written from
// the same table (so generated stubs are typed), equality, repr and pickling. A wrong
// type, an unknown keyword or an out-of-range value is pdkv's InvalidArgument naming
// the field, never pybind11's TypeError; constructors validate() at once, and
// Agent::create validates the whole config again (attributes may change in between).
#include "py_options.h"

#include <pybind11/stl.h>

#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "pdkv/agent.h"
#include "pdkv/config.h"
#include "pdkv/kv_layout.h"
#include "pdkv/stream.h"
#include "pdkv/options/shm.h"
#include "pdkv/options/tcp.h"
#include "py_common.h"
#include "py_transport.h"

namespace py = pybind11;

namespace pdkv {
namespace {

using bindings::raise_status;


[[noreturn]] void raise_invalid(const std::string& msg) { raise_status(InvalidArgument(msg)); }

std::string describe(py::handle v) {
  std::string r = py::repr(v);
  if (r.size() > 60) r = r.substr(0, 57) + "...";
  return std::string(py::str(py::type::handle_of(v).attr("__name__"))) + " " + r;
}

// ---- Python value -> field value, with the type rules of pdkv._validate: integers
// are ints or numpy integers (never bools or floats), numbers may be either, names
// are str.
template <typename T>
struct FieldType;

template <typename T>
T integer_field(py::handle v, const std::string& where) {
  const auto max = std::numeric_limits<T>::max();
  const std::string want = " must be an integer in 0.." + std::to_string(max) + ", got ";
  if (PyBool_Check(v.ptr()) || py::str(py::type::handle_of(v).attr("__name__")).cast<std::string>() == "bool_" ||
      !PyIndex_Check(v.ptr()))
    raise_invalid(where + want + describe(v));
  py::int_ i = py::reinterpret_steal<py::int_>(PyNumber_Index(v.ptr()));
  if (!i) throw py::error_already_set();
  const unsigned long long x = PyLong_AsUnsignedLongLong(i.ptr());
  if (PyErr_Occurred()) {  // negative, or beyond 64 bits
    PyErr_Clear();
    raise_invalid(where + want + std::string(py::repr(i)));
  }
  if (x > max) raise_invalid(where + want + std::to_string(x));
  return static_cast<T>(x);
}

template <>
struct FieldType<uint16_t> {
  static constexpr const char* kPyType = "int";
  static uint16_t from(py::handle v, const std::string& where) { return integer_field<uint16_t>(v, where); }
};
template <>
struct FieldType<uint32_t> {
  static constexpr const char* kPyType = "int";
  static uint32_t from(py::handle v, const std::string& where) { return integer_field<uint32_t>(v, where); }
};
template <>
struct FieldType<uint64_t> {
  static constexpr const char* kPyType = "int";
  static uint64_t from(py::handle v, const std::string& where) { return integer_field<uint64_t>(v, where); }
};
template <>
struct FieldType<double> {
  static constexpr const char* kPyType = "float";
  static double from(py::handle v, const std::string& where) {
    const bool numeric = PyFloat_Check(v.ptr()) || (PyIndex_Check(v.ptr()) && !PyBool_Check(v.ptr()));
    const bool numpy_float = py::str(py::type::handle_of(v).attr("__module__")).cast<std::string>() == "numpy" &&
                             py::hasattr(v, "__float__") && !py::hasattr(v, "__index__");
    if (!numeric && !numpy_float) raise_invalid(where + " must be a number of seconds, got " + describe(v));
    const double d = PyFloat_AsDouble(v.ptr());
    if (PyErr_Occurred()) throw py::error_already_set();
    return d;
  }
};
template <>
struct FieldType<bool> {
  static constexpr const char* kPyType = "bool";
  static bool from(py::handle v, const std::string& where) {
    if (!PyBool_Check(v.ptr())) raise_invalid(where + " must be a bool, got " + describe(v));
    return v.cast<bool>();
  }
};
template <>
struct FieldType<std::string> {
  static constexpr const char* kPyType = "str";
  static std::string from(py::handle v, const std::string& where) {
    if (!py::isinstance<py::str>(v)) raise_invalid(where + " must be a str, got " + describe(v));
    return v.cast<std::string>();
  }
};
template <>
struct FieldType<std::vector<std::string>> {
  static constexpr const char* kPyType = "list[str]";
  static std::vector<std::string> from(py::handle v, const std::string& where) {
    if (!py::isinstance<py::list>(v) && !py::isinstance<py::tuple>(v))
      raise_invalid(where + " must be a list of str, got " + describe(v));
    std::vector<std::string> out;
    for (py::handle item : v) out.push_back(FieldType<std::string>::from(item, where + " item"));
    return out;
  }
};
template <>
struct FieldType<std::vector<uint32_t>> {
  static constexpr const char* kPyType = "list[int]";
  static std::vector<uint32_t> from(py::handle v, const std::string& where) {
    if (!py::isinstance<py::list>(v) && !py::isinstance<py::tuple>(v))
      raise_invalid(where + " must be a list of int, got " + describe(v));
    std::vector<uint32_t> out;
    for (py::handle item : v) out.push_back(integer_field<uint32_t>(item, where + " item"));
    return out;
  }
};
template <typename Opts>
struct NestedOptions {
  static Opts from(py::handle v, const std::string& where) {
    if (!py::isinstance<Opts>(v)) {
      const std::string name = py::str(py::type::of<Opts>().attr("__name__"));
      raise_invalid(where + " must be a " + name + ", got " + describe(v));
    }
    return v.cast<Opts>();
  }
};
template <>
struct FieldType<TcpCompression> : NestedOptions<TcpCompression> {
  static constexpr const char* kPyType = "TcpCompression";
};

// ---- transport options, both ways

// A Python transport's options object (its class names the transport in a `transport`
// class attribute), held as it is: a copy shares the object. Its validate() (when it
// has one) is called with the GIL taken.
class PyTransportOptions final : public TransportOptions {
 public:
  PyTransportOptions(py::object obj, std::string transport) : obj_(std::move(obj)), transport_(std::move(transport)) {}
  ~PyTransportOptions() override {
    if (!Py_IsInitialized()) {
      (void)obj_.release();  // the interpreter is gone: nothing to give back
      return;
    }
    py::gil_scoped_acquire gil;
    obj_ = py::object();
  }
  std::string_view transport() const override { return transport_; }
  Status validate() const override {
    py::gil_scoped_acquire gil;
    try {
      if (py::hasattr(obj_, "validate")) obj_.attr("validate")();
      return Status::Ok();
    } catch (py::error_already_set& e) {
      return bindings::status_from(e, transport_ + " options validate()");
    }
  }
  std::unique_ptr<TransportOptions> clone() const override {
    py::gil_scoped_acquire gil;
    return std::make_unique<PyTransportOptions>(obj_, transport_);
  }
  const py::object& object() const { return obj_; }

 private:
  py::object obj_;
  std::string transport_;
};

// One bound native options class: how to copy a Python instance into C++ and back.
struct NativeOptionsType {
  py::handle type;
  std::function<std::unique_ptr<TransportOptions>(py::handle)> to_cpp;
  std::function<py::object(const TransportOptions&)> to_py;  // null object: not this type
};

// Filled once at module init (GIL held); never destroyed (module lifetime).
std::vector<NativeOptionsType>& native_options_types() {
  static auto* types = new std::vector<NativeOptionsType>();
  return *types;
}

template <typename T>
void add_native_options_type(py::handle type) {
  native_options_types().push_back(NativeOptionsType{
      type, [](py::handle v) -> std::unique_ptr<TransportOptions> { return std::make_unique<T>(v.cast<const T&>()); },
      [](const TransportOptions& o) -> py::object {
        if (const T* t = dynamic_cast<const T*>(&o)) return py::cast(T(*t));
        return py::object();
      }});
}

// The registry name a Python options object's class declares, or "" if it declares none.
std::string declared_transport(py::handle v) {
  py::handle cls = py::type::handle_of(v);
  if (!py::hasattr(cls, "transport")) return "";
  py::object t = cls.attr("transport");
  if (!py::isinstance<py::str>(t)) return "";
  return t.cast<std::string>();
}

// AgentConfig.options from a list of options objects (at most one per transport).
TransportOptionsSet options_set_from_py(py::handle v) {
  if (py::isinstance<py::str>(v) || py::isinstance<py::bytes>(v) || py::isinstance<py::dict>(v) ||
      !py::isinstance<py::sequence>(v))
    raise_invalid("AgentConfig.options must be a list of transport options (TcpOptions(...), ShmOptions(...), "
                  "...), got " + describe(v));
  TransportOptionsSet set;
  for (py::handle item : v) {
    std::unique_ptr<TransportOptions> o = options_from_py(item, "AgentConfig.options");
    if (set.find(o->transport()))
      raise_invalid("AgentConfig.options holds two options for transport '" + std::string(o->transport()) +
                    "' (give each transport's options once)");
    set.set(std::move(o));
  }
  return set;
}

py::list options_set_to_py(const TransportOptionsSet& set) {
  py::list out;
  for (const TransportOptions* o : set.all()) out.append(options_to_py(*o));
  return out;
}

// ---- one bound options class, built from its field table
template <typename C>
class OptionsClass {
 public:
  // `name` also prefixes error messages ("TcpOptions.spin_us must be ...").
  OptionsClass(py::module_& m, const char* name, const char* doc)
      : cls_(m, name, doc), name_(name), fields_(std::make_shared<std::vector<Field>>()) {}

  // A read-write attribute over `member` (`py_type` for the signature: "int", "float", ...).
  template <typename T>
  OptionsClass& field(const char* name, T C::*member, const char* doc) {
    const std::string where = name_ + "." + name;
    return add_field(
        name, FieldType<T>::kPyType, [member](const C& c) { return py::cast(c.*member); },
        [member, where](C& c, py::handle v) { c.*member = FieldType<T>::from(v, where); }, doc,
        [member](C& c) -> T& { return c.*member; });
  }

  // A field whose Python value is not the C++ one (AgentConfig.secret: bytes).
  OptionsClass& property(const char* name, const char* py_type, std::function<py::object(const C&)> get,
                         std::function<void(C&, py::handle)> set, const char* doc) {
    return add_field(name, py_type, get, set, doc, get);
  }

  // Adds the keyword constructor, validate(), ==, repr and pickling; `transport`: the
  // registry name a transport's options class declares (its `transport` attribute).
  void finish(std::string_view transport = {}) {
    if (!transport.empty()) cls_.attr("transport") = py::str(std::string(transport));
    auto fields = fields_;
    const std::string cls_name = name_;
    auto apply = [fields, cls_name](C& c, const py::dict& kw) {
      for (auto item : kw) {
        const std::string key = py::str(item.first);
        const Field* f = find(*fields, key);
        if (!f) raise_invalid(cls_name + " has no option '" + key + "' (options: " + names(*fields) + ")");
        f->set(c, item.second);
      }
    };
    {
      // The signature line is ours (written from the table), so that stubs and
      // help() show typed keywords although the C++ side takes **kwargs.
      py::options sig;
      sig.disable_function_signatures();
      cls_.def(
          py::init([apply, cls_name](const py::args& args, const py::kwargs& kw) {
            if (!args.empty())
              raise_invalid(cls_name + "() takes keyword arguments only (" + cls_name + "(name=value, ...)), got " +
                            std::to_string(args.size()) + " positional");
            C c;
            apply(c, kw);
            Status st = c.validate();
            if (!st.ok()) raise_status(st);
            return c;
          }),
          init_doc().c_str());  // pybind11 copies docstrings
    }
    cls_.def("validate",
             [](const C& c) {
               Status st = c.validate();
               if (!st.ok()) raise_status(st);
             },
             "Raises InvalidArgument naming the first field out of range (constructors call it; "
             "call it again after changing attributes, or let Agent() do it).");
    cls_.def("__eq__", [fields](const C& a, py::object b) {
      if (!py::isinstance<C>(b)) return false;
      const C& other = b.cast<const C&>();
      for (const Field& f : *fields)
        if (!f.get(a).equal(f.get(other))) return false;
      return true;
    });
    cls_.attr("__hash__") = py::none();  // mutable, like a dataclass with eq
    cls_.def("__repr__", [fields, cls_name](const C& c) {
      std::string out = cls_name + "(";
      for (size_t i = 0; i < fields->size(); ++i)
        out += (i ? ", " : "") + (*fields)[i].name + "=" + std::string(py::repr((*fields)[i].get(c)));
      return out + ")";
    });
    cls_.def("__copy__", [](const C& c) { return C(c); });
    cls_.def("__deepcopy__", [](const C& c, py::handle) { return C(c); }, py::arg("memo"));
    cls_.def(py::pickle(
        [fields](const C& c) {
          py::dict state;
          for (const Field& f : *fields) state[py::str(f.name)] = f.get(c);
          return state;
        },
        [apply](const py::dict& state) {
          C c;
          apply(c, state);
          return c;
        }));
  }

 private:
  struct Field {
    std::string name;
    std::string py_type;
    std::function<py::object(const C&)> get;
    std::function<void(C&, py::handle)> set;
  };

  template <typename Getter>
  OptionsClass& add_field(const char* name, const char* py_type, std::function<py::object(const C&)> get,
                         std::function<void(C&, py::handle)> set, const char* doc, Getter attr_get) {
    fields_->push_back(Field{name, py_type, get, set});
    // The setter takes any object (a wrong type is InvalidArgument, not TypeError), so
    // its signature line is written here, typed like the getter's result.
    py::cpp_function setter;
    {
      py::options sig;
      sig.disable_function_signatures();
      const std::string setter_doc = std::string(name) + "(self: " + qualified(name_) + ", value: " +
                                     qualified(py_type) + ") -> None\n";
      setter = py::cpp_function([set](C& c, py::object v) { set(c, v); }, py::is_method(cls_), py::is_setter(),
                                setter_doc.c_str());
    }
    // The getter returns a reference where it can, so `cfg.tcp.spin_us = 5` changes cfg.
    cls_.def_property(name, attr_get, setter, doc);
    return *this;
  }

  // "int", "list[str]" as they are; class names qualified by the module ("pdkv._pdkv.TcpOptions").
  std::string qualified(const std::string& py_type) const {
    static const char* const kBuiltins[] = {"int", "float", "str", "bytes", "bool"};
    for (const char* b : kBuiltins)
      if (py_type == b) return py_type;
    if (py_type.find('[') != std::string::npos || py_type.find('|') != std::string::npos) return py_type;
    return std::string(py::str(cls_.attr("__module__"))) + "." + py_type;
  }

  static const Field* find(const std::vector<Field>& fields, const std::string& key) {
    for (const Field& f : fields)
      if (f.name == key) return &f;
    return nullptr;
  }

  static std::string names(const std::vector<Field>& fields) {
    std::string out;
    for (const Field& f : fields) out += (out.empty() ? "" : ", ") + f.name;
    return out;
  }

  // "__init__(self: pdkv._pdkv.TcpOptions, *, spin_us: int = 0, ...) -> None", then the
  // class doc; defaults are those of a default-constructed C.
  std::string init_doc() const {
    std::string sig = "__init__(self: " + qualified(name_) + ", *";
    const C defaults;
    for (const Field& f : *fields_) {
      const py::object d = f.get(defaults);
      const bool literal = d.is_none() || py::isinstance<py::int_>(d) || py::isinstance<py::float_>(d) ||
                           py::isinstance<py::bool_>(d) ||
                           py::isinstance<py::str>(d) || py::isinstance<py::bytes>(d) ||
                           py::isinstance<py::list>(d);
      sig += ", " + f.name + ": " + qualified(f.py_type) + " = " +
             (literal ? std::string(py::repr(d)) : std::string("..."));
    }
    sig += ") -> None\n\nKeyword arguments are the attributes (defaults shown); validates at once.\n";
    return sig;
  }

  py::class_<C> cls_;
  std::string name_;
  std::shared_ptr<std::vector<Field>> fields_;
};

}  // namespace

std::unique_ptr<TransportOptions> options_from_py(py::handle v, const std::string& where) {
  for (const NativeOptionsType& t : native_options_types())
    if (py::isinstance(v, t.type)) return t.to_cpp(v);
  const std::string transport = declared_transport(v);
  if (transport.empty() || py::isinstance<py::type>(v))
    raise_invalid(where + " entries must be transport options (TcpOptions(...), ShmOptions(...), or the options "
                  "class a transport registered, which names it in a `transport` class attribute), got " +
                  describe(v));
  return std::make_unique<PyTransportOptions>(py::reinterpret_borrow<py::object>(v), transport);
}

py::object options_to_py(const TransportOptions& o) {
  if (auto* p = dynamic_cast<const PyTransportOptions*>(&o)) return p->object();
  for (const NativeOptionsType& t : native_options_types()) {
    py::object r = t.to_py(o);
    if (r) return r;
  }
  raise_status(Internal("options of transport '" + std::string(o.transport()) + "' have no Python class"));
  return py::none();
}

std::unique_ptr<TransportOptions> python_options(py::object obj, const std::string& transport) {
  return std::make_unique<PyTransportOptions>(std::move(obj), transport);
}

// A str option parsed into its enum once, here (`parse` returns Result<E>).
template <typename E>
std::function<void(TcpCompression&, py::handle)> enum_setter(E TcpCompression::*member, Result<E> (*parse)(std::string_view),
                                                             std::string where) {
  return [member, parse, where](TcpCompression& c, py::handle v) {
    auto e = parse(FieldType<std::string>::from(v, where));
    if (!e.ok()) raise_status(e.status());
    c.*member = *e;
  };
}

Result<CodecKind> parse_lossless_codec(std::string_view s) { return parse_codec_kind(s); }

void bind_compression(py::module_& m) {
  using C = TcpCompression;
  auto u32 = [](uint32_t Fp8Grouping::*member, const char* where) {
    return std::make_pair(
        std::function<py::object(const C&)>([member](const C& c) { return py::cast(c.fp8.*member); }),
        std::function<void(C&, py::handle)>(
            [member, where](C& c, py::handle v) { c.fp8.*member = FieldType<uint32_t>::from(v, where); }));
  };
  auto heads = u32(&Fp8Grouping::heads, "TcpCompression.fp8_heads");
  auto head_dim = u32(&Fp8Grouping::head_dim, "TcpCompression.fp8_head_dim");
  auto rows = u32(&Fp8Grouping::rows_per_group, "TcpCompression.fp8_rows_per_group");
  OptionsClass<C>(m, "TcpCompression",
                  "Compression of tcp writes and reads (docs/compression.md, 'On the wire'). Off by default; "
                  "a transfer may override the mode (compress=).")
      .property("mode", "str", [](const C& c) -> py::object { return py::str(std::string(compress_mode_name(c.mode))); },
                enum_setter(&C::mode, +[](std::string_view v) { return parse_compress_mode(v); }, "TcpCompression.mode"),
                "str: 'off', 'lossless' (bit-exact), 'fp8' (lossy, opt-in) or 'auto' (per peer and direction, from "
                "the measured link and codec throughput; see policy).")
      .property("policy", "str",
                [](const C& c) -> py::object { return py::str(std::string(compress_policy_name(c.policy))); },
                enum_setter(&C::policy, &parse_compress_policy, "TcpCompression.policy"),
                "str: what mode 'auto' may choose besides plain: 'lossless' or 'lossy-allowed' (fp8).")
      .property("codec", "str", [](const C& c) -> py::object { return py::str(std::string(codec_kind_name(c.codec))); },
                enum_setter(&C::codec, &parse_lossless_codec, "TcpCompression.codec"),
                "str: the lossless codec, 'zstd' or 'lz4'.")
      .property("level", "int", [](const C& c) -> py::object { return py::int_(c.level); },
                [](C& c, py::handle v) {
                  if (PyBool_Check(v.ptr()) || !PyLong_Check(v.ptr()))
                    raise_invalid("TcpCompression.level must be an int, got " + describe(v));
                  const long long x = v.cast<long long>();
                  if (x < -7 || x > 9) raise_invalid("TcpCompression.level must be in -7..9, got " + std::to_string(x));
                  c.level = static_cast<int32_t>(x);
                },
                "int (-7..9): zstd level (1: fast; negative: faster still).")
      .property("checksum", "bool", [](const C& c) -> py::object { return py::bool_(c.checksum); },
                [](C& c, py::handle v) {
                  if (!PyBool_Check(v.ptr())) raise_invalid("TcpCompression.checksum must be a bool, got " + describe(v));
                  c.checksum = v.cast<bool>();
                },
                "bool: XXH3-64 of every chunk's uncompressed bytes, verified by the receiver (DataCorrupted).")
      .field("chunk_bytes", &C::chunk_bytes,
             "int, bytes (4096..2**26): raw bytes per codec frame, the pipeline unit (chunk i+1 is encoded while "
             "chunk i is on the wire).")
      .field("threads", &C::threads, "int (0..16): encoder threads per agent (0: min(4, hardware threads)).")
      .property("dtype", "str", [](const C& c) -> py::object { return py::str(std::string(dtype_name(c.dtype))); },
                enum_setter(&C::dtype, &parse_dtype, "TcpCompression.dtype"),
                "str: element type of the KV sent ('bfloat16', 'float16', 'float32', ...): byte planes, fp8.")
      .property("fp8_heads", "int", heads.first, heads.second, "int: fp8 rows are fp8_heads x fp8_head_dim elements.")
      .property("fp8_head_dim", "int", head_dim.first, head_dim.second, "int: elements per head.")
      .property("fp8_rows_per_group", "int", rows.first, rows.second,
                "int: rows per fp8 scale (tokens per block: per-block-per-head scales).")
      .finish();
}

// A transfer's PlanOptions, XferOptions and StreamOptions: what Agent.write, read,
// prepare and open_stream take besides the blocks (python/pdkv/agent.py documents the
// calls; the field docs here are the reference).
void bind_transfer_options(py::module_& m) {
  OptionsClass<PlanOptions>(m, "PlanOptions",
                            "What a block transfer moves of layouts of different shape (block size, NHD/HND, a "
                            "tensor-parallel head split) and which layers: pdkv/kv_layout.h. 0 means 'all'.")
      .field("num_tokens", &PlanOptions::num_tokens,
             "int: tokens to move, counted from the start of the first block; 0: all of them, accepted only when "
             "both block lists hold the same number of tokens (a plan never moves part of the data unless asked).")
      .field("num_heads", &PlanOptions::num_heads,
             "int: kv heads to move; 0: all, accepted only when both layouts hold the same number of kv heads.")
      .field("local_head_offset", &PlanOptions::local_head_offset,
             "int: first head moved on this agent's side (tensor-parallel splits).")
      .field("remote_head_offset", &PlanOptions::remote_head_offset, "int: first head moved on the peer's side.")
      .field("first_layer", &PlanOptions::first_layer,
             "int: first layer moved; the layers are [first_layer, first_layer + num_layers). A range beyond the "
             "layouts' layers raises OutOfRange.")
      .field("num_layers", &PlanOptions::num_layers, "int: layers moved; 0: every layer from first_layer on.")
      .finish();

  OptionsClass<XferOptions>(m, "XferOptions", "How a transfer travels: pdkv/agent.h.")
      .property(
          "transport", "str | None",
          [](const XferOptions& o) -> py::object {
            return o.transport.empty() ? py::object(py::none()) : py::object(py::str(o.transport));
          },
          [](XferOptions& o, py::handle v) {
            if (v.is_none()) o.transport.clear();
            else if (py::isinstance<py::str>(v)) o.transport = v.cast<std::string>();
            else raise_invalid("XferOptions.transport must be a str or None, got " + describe(v));
          },
          "str or None: the transport to use ('tcp', 'shm', ...; it must reach the peer); None: the peer's "
          "(Agent.peer_transport).")
      .property(
          "compress", "str | None",
          [](const XferOptions& o) -> py::object {
            return o.compress ? py::object(py::str(std::string(compress_mode_name(*o.compress))))
                              : py::object(py::none());
          },
          [](XferOptions& o, py::handle v) {
            if (v.is_none()) {
              o.compress.reset();
              return;
            }
            if (!py::isinstance<py::str>(v))
              raise_invalid("XferOptions.compress must be one of 'off', 'lossless', 'fp8', 'auto' or None, got " +
                            describe(v));
            auto mode = parse_compress_mode(v.cast<std::string>(), "XferOptions.compress");
            if (!mode.ok()) raise_status(mode.status());
            o.compress = *mode;
          },
          "str or None: how this transfer's payload travels on a tcp wire, overriding the agent's "
          "TcpOptions.compress.mode for it only ('off', 'lossless', 'fp8', 'auto'; its codec, dtype and fp8 "
          "grouping apply as they are); None: the agent's mode. 'fp8' (or 'auto' with policy 'lossy-allowed') "
          "allows lossy KV for this transfer; reads ask the peer for compressed responses. Other transports move "
          "the bytes exactly (docs/compression.md).")
      .finish();

  OptionsClass<StreamOptions>(m, "StreamOptions", "How a layer-wise stream batches its layers: pdkv/stream.h.")
      .field("min_batch_bytes", &StreamOptions::min_batch_bytes,
             "int, bytes: posted layers holding fewer bytes than this wait for more (or for close); 0: send "
             "whatever is ready.")
      .field("max_inflight_batches", &StreamOptions::max_inflight_batches,
             "int (>= 1): most transfers of the stream in flight; layers posted meanwhile leave together when one "
             "completes.")
      .property(
          "progress_prefix", "bytes", [](const StreamOptions& o) -> py::object { return py::bytes(o.progress_prefix); },
          [](StreamOptions& o, py::handle v) {
            if (py::isinstance<py::bytes>(v) || py::isinstance<py::str>(v)) o.progress_prefix = v.cast<std::string>();
            else if (PyByteArray_Check(v.ptr()) || PyMemoryView_Check(v.ptr()))
              o.progress_prefix = py::bytes(py::reinterpret_borrow<py::object>(v)).cast<std::string>();
            else raise_invalid("StreamOptions.progress_prefix must be bytes or str, got " + describe(v));
          },
          "bytes (str: UTF-8): when not empty, every batch also delivers the notification progress_prefix + "
          "b'<first>-<end>' (its layer range) once it landed, for a receiver that starts on early layers.")
      .finish();
}

void bind_options(py::module_& m) {
  bind_compression(m);
  bind_transfer_options(m);
  OptionsClass<TcpOptions>(m, "TcpOptions", "Options of the tcp transport (any host). Units are in the names.")
      .field("listen_host", &TcpOptions::listen_host,
             "str: address to bind and publish (Agent(listen='host:port') sets it).")
      .field("listen_port", &TcpOptions::listen_port, "int: port to bind; 0 picks a free one.")
      .field("conns_per_peer", &TcpOptions::conns_per_peer,
             "int (1..64): parallel connections to each peer; batches are spread over them.")
      .field("progress_threads", &TcpOptions::progress_threads,
             "int (1..64): native epoll threads; connections are spread over them.")
      .field("spin_us", &TcpOptions::spin_us,
             "int, microseconds: progress threads poll this long after activity before sleeping. Off by "
             "default: on small machines a spinning thread competes with the peer and the waiter.")
      .field("batch_bytes", &TcpOptions::batch_bytes, "int, bytes (1..2**30): max payload per wire batch.")
      .field("batch_extents", &TcpOptions::batch_extents,
             "int (1..1020): max extents per batch (one sendmsg, bounded by IOV_MAX).")
      .field("rcvlowat_bytes", &TcpOptions::rcvlowat_bytes,
             "int, bytes: receiver SO_RCVLOWAT cap while a large payload arrives (0 disables).")
      .field("connect_timeout_s", &TcpOptions::connect_timeout_s,
             "float, seconds (0, 86400]: TCP connect plus handshake.")
      .field("tls", &TcpOptions::tls,
             "bool: encrypt every connection with TLS 1.3; the handshake inside is bound to the session. "
             "Every agent of a cluster must agree (an agent with it on speaks only TLS). Off by default.")
      .field("handshake_timeout_s", &TcpOptions::handshake_timeout_s,
             "float, seconds (0, 86400]: inbound connections that do not authenticate within this are closed.")
      .field("frame_timeout_s", &TcpOptions::frame_timeout_s,
             "float, seconds (0, 86400]: a frame that stops arriving half-way, or output the peer stops "
             "reading, closes that connection after this long without progress (releasing its regions).")
      .field("stage_chunk_bytes", &TcpOptions::stage_chunk_bytes,
             "int, bytes (4096..2**30): device memory travels through pinned host chunks of this size, also "
             "the batch size of device transfers.")
      .field("stage_buffers", &TcpOptions::stage_buffers,
             "int (2..1024): pinned chunks per agent for sending device memory (allocated on first use); "
             "each connection receiving into device memory holds two more.")
      .field("max_inbound_conns", &TcpOptions::max_inbound_conns,
             "int (1..65536): inbound connections open at once, authenticated or not; one more is refused at "
             "accept with ResourceExhausted.")
      .field("max_inbound_per_peer", &TcpOptions::max_inbound_per_peer,
             "int (1..65536): inbound connections one authenticated peer (agent name) may hold; one more is "
             "refused with ResourceExhausted naming the peer (its first request fails with it).")
      .field("compress", &TcpOptions::compress, "TcpCompression: compression of writes and reads (off by default).")
      .field("gather_below_bytes", &TcpOptions::gather_below_bytes,
             "int, bytes (0..2**30): a batch whose extents average fewer bytes is gathered by the sender into "
             "staging chunks and sent as one segment (0: never). Measurements: docs/transports.md.")
      .field("land_below_bytes", &TcpOptions::land_below_bytes,
             "int, bytes (0..2**30): a payload whose extents average fewer bytes is landed by the receiver in a "
             "buffer, then scattered with streaming stores (0: never).")
      .field("congestion_control", &TcpOptions::congestion_control,
             "str: TCP congestion control of every connection this agent opens or accepts (\"cubic\", "
             "\"reno\", \"bbr\", ...); \"\" keeps the system's. On a host whose default is bbr, loopback "
             "transfers measured ~30% faster with cubic or reno (docs/benchmarks.md). A name the kernel "
             "refuses fails the agent's start, naming what is allowed.")
      .finish(TcpOptions::kTransport);
  add_native_options_type<TcpOptions>(m.attr("TcpOptions"));

  OptionsClass<ShmOptions>(m, "ShmOptions", "Options of the shm transport (same host, one copy).")
      .field("copy_threads", &ShmOptions::copy_threads, "int (1..64): threads that copy large transfers.")
      .field("inline_bytes", &ShmOptions::inline_bytes,
             "int, bytes: transfers up to this size are copied by the posting thread itself (lowest "
             "latency); larger ones go to the copy threads (post returns at once).")
      .field("share_pages_min_bytes", &ShmOptions::share_pages_min_bytes,
             "int, bytes: exported host memory registered from the engine (numpy, torch) whose whole pages "
             "span at least this much is re-mapped onto shareable memory at registration, so same-host peers "
             "copy into it as into Agent.alloc memory; 0 turns it off (cross-memory attach).")
      .property("notify_on_send", "bool", [](const ShmOptions& c) -> py::object { return py::bool_(c.notify_on_send); },
                [](ShmOptions& c, py::handle v) {
                  if (!PyBool_Check(v.ptr())) raise_invalid("ShmOptions.notify_on_send must be a bool, got " + describe(v));
                  c.notify_on_send = v.cast<bool>();
                },
             "bool: a transfer's notification completes it once sent (after every byte landed) instead of "
             "on the peer's acknowledgement; one never acknowledged is counted in "
             "Agent.notifications_unacknowledged and logged, not raised (docs/api.md, Notifications).")
      .field("allowed_peer_uids", &ShmOptions::allowed_peer_uids,
             "list[int] (at most 64): uids besides this process's own whose processes may be shm peers, in "
             "either direction; the kernel says who the peer is (SO_PEERCRED). Empty: same uid only.")
      .field("connect_timeout_s", &ShmOptions::connect_timeout_s,
             "float, seconds (0, 86400]: dialing a same-host peer's control socket plus its handshake.")
      .finish(ShmOptions::kTransport);
  add_native_options_type<ShmOptions>(m.attr("ShmOptions"));

  OptionsClass<AgentConfig>(m, "AgentConfig", "Everything an agent is created with (pdkv/config.h).")
      .field("name", &AgentConfig::name, "str: unique among peers; printable ASCII, no spaces.")
      .property(
          "secret", "bytes", [](const AgentConfig& c) -> py::object { return py::bytes(c.secret); },
          [](AgentConfig& c, py::handle v) {
            if (py::isinstance<py::bytes>(v)) c.secret = v.cast<std::string>();
            else if (py::isinstance<py::str>(v)) c.secret = v.cast<std::string>();  // UTF-8
            else raise_invalid("AgentConfig.secret must be bytes or str, got " + describe(v));
          },
          "bytes (at most 1024): the cluster secret this agent proves knowledge of in every handshake "
          "(never sent); empty: a random one.")
      .property(
          "accepted_secrets", "list[bytes]",
          [](const AgentConfig& c) -> py::object {
            py::list out;
            for (const std::string& s : c.accepted_secrets) out.append(py::bytes(s));
            return out;
          },
          [](AgentConfig& c, py::handle v) {
            if (py::isinstance<py::str>(v) || py::isinstance<py::bytes>(v) || !py::isinstance<py::sequence>(v))
              raise_invalid("AgentConfig.accepted_secrets must be a list of bytes or str, got " + describe(v));
            std::vector<std::string> out;
            for (py::handle s : v) {
              if (py::isinstance<py::bytes>(s) || py::isinstance<py::str>(s)) out.push_back(s.cast<std::string>());
              else raise_invalid("AgentConfig.accepted_secrets entries must be bytes or str, got " + describe(s));
            }
            c.accepted_secrets = std::move(out);
          },
          "list[bytes] (at most 7, each 1..1024 bytes): further secrets whose proofs this agent accepts "
          "(rotation: docs/security.md).")
      .field("transports", &AgentConfig::transports, "list[str]: native transports in order of preference.")
      .property(
          "options", "list[object]", [](const AgentConfig& c) -> py::object { return options_set_to_py(c.options); },
          [](AgentConfig& c, py::handle v) { c.options = options_set_from_py(v); },
          "list: options of transports, at most one per transport (TcpOptions(...), ShmOptions(...), a Python "
          "transport's options); a transport without any gets its defaults. The getter returns copies.")
      .field("default_timeout_s", &AgentConfig::default_timeout_s,
             "float, seconds (>= 0): deadline of transfers posted without one (0: none).")
      .field("max_notif_bytes", &AgentConfig::max_notif_bytes,
             "int, bytes (>= 1): largest notification sent or received.")
      .field("max_queued_notifs", &AgentConfig::max_queued_notifs,
             "int (>= 1): received notifications not yet taken by the application; one more is refused "
             "before it is accepted (the sender's transfer fails with ResourceExhausted).")
      .field("max_queued_notif_bytes", &AgentConfig::max_queued_notif_bytes,
             "int, bytes (>= 1): payload and sender-name bytes of the notifications not yet taken; one more "
             "that does not fit is refused as above (an empty queue takes any one).")
      .field("wait_spin_us", &AgentConfig::wait_spin_us,
             "int, microseconds: Transfer.wait spins this long before sleeping.")
      .finish();
}

}  // namespace pdkv
