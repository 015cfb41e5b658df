// pdkv.Blocks (pdkv::Blocks, pdkv/agent.h): one side of a block transfer, a layout
// name and block ids (with the owner's generations of them), and the one reader of
// block ids from Python that every entry point shares.
#include "py_blocks.h"

#include <pybind11/stl.h>

#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "py_common.h"
#include "pdkv/agent.h"

namespace py = pybind11;

namespace pdkv::bindings {
namespace {

std::string type_name(const py::handle& o) { return py::str(py::type::handle_of(o).attr("__name__")); }

[[noreturn]] void raise_invalid(const std::string& msg) { raise_status(InvalidArgument(msg)); }

// "block ids", or "block generations" for an argument of generations.
std::string id_kind(const char* what) {
  return std::string_view(what).find("generation") != std::string_view::npos ? "block generations" : "block ids";
}

[[noreturn]] void bad_ids(const char* what, const std::string& why) {
  raise_status(InvalidArgument(std::string(what) + " must be a sequence of integer " + id_kind(what) + ": " + why));
}

// Appends one id, rejecting negatives and ids that do not fit 32 bits.
void push_id(std::vector<uint32_t>& v, const char* what, size_t pos, long long x, bool overflow = false) {
  if (overflow || x < 0 || x > 0xFFFFFFFFll)
    raise_status(OutOfRange(std::string(what) + "[" + std::to_string(pos) + "] = " +
                                 (overflow ? std::string("a huge integer") : std::to_string(x)) +
                                 " is not a 32-bit unsigned integer (" + id_kind(what) + " are 0..2^32-1)"));
  v.push_back(static_cast<uint32_t>(x));
}

// Block ids from a 1-D integer buffer (numpy array of any integer dtype).
std::vector<uint32_t> ids_from_buffer(const py::buffer& b, const char* what) {
  py::buffer_info bi = b.request();
  if (bi.ndim != 1) bad_ids(what, "got a " + std::to_string(bi.ndim) + "-dimensional array");
  std::string f = bi.format;
  if (!f.empty() && (f[0] == '=' || f[0] == '<' || f[0] == '@')) f = f.substr(1);
  const bool is_signed = f == "b" || f == "h" || f == "i" || f == "l" || f == "q";
  const bool is_unsigned = f == "B" || f == "H" || f == "I" || f == "L" || f == "Q";
  if (f.size() != 1 || (!is_signed && !is_unsigned) || (bi.itemsize != 1 && bi.itemsize != 2 && bi.itemsize != 4 &&
                                                         bi.itemsize != 8))
    bad_ids(what, "got an array of element format '" + bi.format + "' (" +
                      (f == "?" ? "booleans" : f == "e" || f == "f" || f == "d" || f == "g" ? "floats" : "not integers") +
                      ")");
  std::vector<uint32_t> v;
  v.reserve(static_cast<size_t>(bi.shape[0]));
  const char* base = static_cast<const char*>(bi.ptr);
  for (py::ssize_t i = 0; i < bi.shape[0]; ++i) {
    const char* p = base + i * bi.strides[0];
    long long x = 0;
    bool overflow = false;
    if (is_signed) {
      int64_t t = 0;
      switch (bi.itemsize) {
        case 1: { int8_t y; std::memcpy(&y, p, 1); t = y; break; }
        case 2: { int16_t y; std::memcpy(&y, p, 2); t = y; break; }
        case 4: { int32_t y; std::memcpy(&y, p, 4); t = y; break; }
        default: std::memcpy(&t, p, 8);
      }
      x = t;
    } else {
      uint64_t t = 0;
      switch (bi.itemsize) {
        case 1: { uint8_t y; std::memcpy(&y, p, 1); t = y; break; }
        case 2: { uint16_t y; std::memcpy(&y, p, 2); t = y; break; }
        case 4: { uint32_t y; std::memcpy(&y, p, 4); t = y; break; }
        default: std::memcpy(&t, p, 8);
      }
      overflow = t > 0xFFFFFFFFull;
      x = overflow ? 0 : static_cast<long long>(t);
    }
    push_id(v, what, static_cast<size_t>(i), x, overflow);
  }
  return v;
}

}  // namespace

std::vector<uint32_t> ids_from(const py::object& o, const char* what) {
  if (py::isinstance<py::str>(o) || py::isinstance<py::bytes>(o) || PyByteArray_Check(o.ptr()))
    bad_ids(what, "got " + type_name(o));
  if (py::isinstance<py::buffer>(o)) return ids_from_buffer(py::reinterpret_borrow<py::buffer>(o), what);
  PyObject* it = PyObject_GetIter(o.ptr());
  if (!it) {
    PyErr_Clear();
    bad_ids(what, "got " + type_name(o));
  }
  py::iterator iter = py::reinterpret_steal<py::iterator>(it);
  std::vector<uint32_t> v;
  if (PyObject_HasAttrString(o.ptr(), "__len__")) {
    const Py_ssize_t n = PyObject_Length(o.ptr());
    if (n < 0) PyErr_Clear();
    else v.reserve(static_cast<size_t>(n));
  }
  for (py::handle item : iter) {
    const size_t pos = v.size();
    int overflow = 0;
    if (PyLong_CheckExact(item.ptr())) {  // the common case: a plain int
      const long long x = PyLong_AsLongLongAndOverflow(item.ptr(), &overflow);
      push_id(v, what, pos, x, overflow != 0);
      continue;
    }
    const std::string tn = type_name(item);
    if (PyBool_Check(item.ptr()) || tn == "bool_" || tn == "bool" || !PyIndex_Check(item.ptr()))
      bad_ids(what, "position " + std::to_string(pos) + " holds " + tn + " " + std::string(py::repr(item)));
    PyObject* idx = PyNumber_Index(item.ptr());
    if (!idx) {
      PyErr_Clear();
      bad_ids(what, "position " + std::to_string(pos) + " holds " + tn + " " + std::string(py::repr(item)));
    }
    const long long x = PyLong_AsLongLongAndOverflow(idx, &overflow);
    Py_DECREF(idx);
    push_id(v, what, pos, x, overflow != 0);
  }
  return v;
}


namespace {

std::string describe(py::handle v) {
  std::string r = py::repr(v);
  if (r.size() > 60) r = r.substr(0, 57) + "...";
  return type_name(v) + " " + r;
}

// "[0, 1, 2]", or "[0, 1, ..., 99] (100 ids)" past 16 ids: a repr stays one line.
std::string list_repr(const std::vector<uint32_t>& v) {
  std::string out = "[";
  const size_t shown = v.size() > 16 ? 8 : v.size();
  for (size_t i = 0; i < shown; ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  if (shown < v.size()) out += ", ..., " + std::to_string(v.back()) + "] (" + std::to_string(v.size()) + " ids)";
  else out += "]";
  return out;
}

void set_generations(Blocks& b, py::handle gens) {
  if (gens.is_none()) {
    b.generations.clear();
    return;
  }
  b.generations = ids_from(py::reinterpret_borrow<py::object>(gens), "Blocks.generations");
  if (b.generations.empty()) raise_invalid("Blocks.generations is empty (give one per block, or None)");
}

Blocks make_blocks(py::handle layout, py::handle ids, py::handle generations) {
  if (!py::isinstance<py::str>(layout)) raise_invalid("Blocks.layout must be a str, got " + describe(layout));
  Blocks b;
  b.layout = layout.cast<std::string>();
  b.ids = ids_from(py::reinterpret_borrow<py::object>(ids), "Blocks.ids");
  set_generations(b, generations);
  Status st = b.validate();
  if (!st.ok()) raise_status(st);
  return b;
}

py::object generations_of(const Blocks& b) {
  return b.generations.empty() ? py::object(py::none()) : py::object(py::cast(b.generations));
}

}  // namespace

void bind_blocks(py::module_& m) {
  py::class_<Blocks> cls(m, "Blocks",
                         "One side of a block transfer: blocks of a KV layout, by id (pdkv/agent.h). Immutable.");
  {
    // Our own signature line: the C++ side takes *args/**kwargs so that any wrong call is
    // InvalidArgument naming the argument, never pybind11's TypeError.
    py::options sig;
    sig.disable_function_signatures();
    cls.def(py::init([](const py::args& args, const py::kwargs& kw) {
              static const char* const kNames[] = {"layout", "ids", "generations"};
              if (args.size() > 2)
                raise_invalid("Blocks() takes a layout and block ids (generations= by keyword), got " +
                              std::to_string(args.size()) + " positional arguments");
              py::object given[3];
              for (size_t i = 0; i < args.size(); ++i) given[i] = args[i];
              for (auto item : kw) {
                const std::string key = py::str(item.first);
                size_t i = 0;
                while (i < 3 && key != kNames[i]) ++i;
                if (i == 3) raise_invalid("Blocks() has no argument '" + key + "' (layout, ids, generations)");
                if (given[i]) raise_invalid("Blocks() got '" + key + "' twice");
                given[i] = py::reinterpret_borrow<py::object>(item.second);
              }
              if (!given[0] || !given[1]) raise_invalid("Blocks() needs a layout and block ids: Blocks('kv', [0, 1])");
              return make_blocks(given[0], given[1], given[2] ? py::handle(given[2]) : py::handle(py::none()));
            }),
            "__init__(self: pdkv._pdkv.Blocks, layout: str, ids: typing.Any, *, generations: typing.Any = None) "
            "-> None\n\n"
            "layout: a layout name (this agent's on the local side, the peer's on the remote side). ids: block ids, "
            "integers only (a numpy integer array, a list, a range); position i on one side maps to position i on "
            "the other. generations: the owner's generations of these blocks (Agent.generations), one per id, as "
            "the owner handed them out with the ids; only the remote side's are checked: every post then has the "
            "peer check them before any byte lands (write) or is sent (read), and a block freed or reused since "
            "fails the transfer with StaleBlock (docs/generations.md). tcp and shm only. Validates at once "
            "(InvalidArgument naming the field; OutOfRange for ids beyond 32 bits).");
  }
  cls.def_property_readonly("layout", [](const Blocks& b) { return b.layout; }, "str: the layout's name.")
      .def_property_readonly("ids", [](const Blocks& b) { return b.ids; }, "list[int]: the block ids.")
      .def_property_readonly("generations", &generations_of,
                             "list[int] or None: the owner's generations of the blocks (None: unchecked).")
      .def("__len__", [](const Blocks& b) { return b.ids.size(); })
      .def("__eq__",
           [](const Blocks& a, py::object other) {
             if (!py::isinstance<Blocks>(other)) return false;
             const Blocks& b = other.cast<const Blocks&>();
             return a.layout == b.layout && a.ids == b.ids && a.generations == b.generations;
           })
      .def("__hash__",
           [](const Blocks& b) {
             return py::hash(py::make_tuple(b.layout, py::tuple(py::cast(b.ids)), py::tuple(py::cast(b.generations))));
           })
      .def("__repr__",
           [](const Blocks& b) {
             std::string out = "Blocks(" + std::string(py::repr(py::str(b.layout))) + ", " + list_repr(b.ids);
             if (!b.generations.empty()) out += ", generations=" + list_repr(b.generations);
             return out + ")";
           })
      .def("__copy__", [](const Blocks& b) { return b; })
      .def("__deepcopy__", [](const Blocks& b, py::handle) { return b; }, py::arg("memo"))
      .def(py::pickle([](const Blocks& b) { return py::make_tuple(b.layout, b.ids, generations_of(b)); },
                      [](const py::tuple& t) {
                        if (t.size() != 3) raise_invalid("Blocks: bad pickled state");
                        return make_blocks(t[0], t[1], t[2]);
                      }));
}

}  // namespace pdkv::bindings
