// dlpack_memory(obj): the memory of any DLPack exporter (numpy >= 1.22, torch, jax,
// cupy, ...), read from the exported capsule itself, so that Agent.register needs
// neither numpy nor torch to understand it.
//
// The DLPack structs below are declared from the DLPack specification (an ABI shared
// by every exporter): the legacy DLManagedTensor ("dltensor" capsules) and, when the
// exporter accepts max_version, DLManagedTensorVersioned ("dltensor_versioned").
// The capsule is consumed (renamed "used_...") only after every check passed; its
// deleter runs when the returned owner object dies, which the Region keeps alive
// together with the exporter.
#include "py_dlpack.h"

#include <cstdint>
#include <string>

#include "pdkv/status.h"

namespace py = pybind11;

namespace pdkv {
namespace {

// ---- the DLPack ABI (specification v1.x; the legacy struct is its v0.x layout)
struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;    // [ndim]
  int64_t* strides;  // [ndim] in elements; null: compact row-major
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};
struct DLPackVersion {
  uint32_t major;
  uint32_t minor;
};
struct DLManagedTensorVersioned {
  DLPackVersion version;
  void* manager_ctx;
  void (*deleter)(DLManagedTensorVersioned* self);
  uint64_t flags;
  DLTensor dl_tensor;
};
constexpr uint64_t kDLFlagReadOnly = 1;
constexpr int32_t kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3;
constexpr const char* kOwnerLegacy = "pdkv.dlpack.legacy";
constexpr const char* kOwnerVersioned = "pdkv.dlpack.versioned";

[[noreturn]] void raise_invalid(const std::string& msg) {
  py::object cls = py::module_::import("pdkv.errors").attr("InvalidArgument");
  PyErr_SetObject(cls.ptr(), cls(msg).ptr());
  throw py::error_already_set();
}

std::string type_name(py::handle o) { return py::str(py::type::handle_of(o).attr("__name__")); }

std::string device_name(int32_t type) {
  switch (type) {
    case kDLCPU: return "CPU";
    case kDLCUDA: return "CUDA";
    case kDLCUDAHost: return "CUDA host (pinned)";
    default: return "type " + std::to_string(type);
  }
}

// (device_type, device_id) from __dlpack_device__(), before asking for a capsule.
DLDevice exporter_device(const py::handle& obj, const std::string& what) {
  try {
    py::tuple dev = obj.attr("__dlpack_device__")();
    return DLDevice{dev[0].cast<int32_t>(), dev[1].cast<int32_t>()};
  } catch (py::error_already_set& e) {
    raise_invalid(what + ".__dlpack_device__() failed: " + e.what());
  } catch (py::cast_error&) {
    raise_invalid(what + ".__dlpack_device__() did not return (device_type, device_id)");
  }
}

// The exporter's capsule: versioned when it understands max_version, else legacy.
py::capsule export_capsule(const py::handle& obj, const std::string& what) {
  py::object cap;
  try {
    try {
      cap = obj.attr("__dlpack__")(py::arg("max_version") = py::make_tuple(1, 0));
    } catch (py::error_already_set& e) {
      if (!e.matches(PyExc_TypeError)) throw;
      cap = obj.attr("__dlpack__")();  // an exporter older than DLPack 1.0
    }
  } catch (py::error_already_set& e) {
    raise_invalid("cannot export " + what + " through DLPack: " + e.what());
  }
  if (!PyCapsule_CheckExact(cap.ptr())) raise_invalid(what + ".__dlpack__() returned a " + type_name(cap));
  return py::reinterpret_borrow<py::capsule>(cap);
}

// Bytes covered by a compact row-major tensor; InvalidArgument otherwise.
uint64_t contiguous_bytes(const DLTensor& t, const std::string& what) {
  const uint32_t bits = uint32_t(t.dtype.bits) * t.dtype.lanes;
  if (bits == 0 || bits % 8 != 0)
    raise_invalid("cannot register " + what + ": elements of " + std::to_string(bits) +
                  " bits are not whole bytes");
  if (t.ndim < 0 || (t.ndim > 0 && !t.shape)) raise_invalid(what + " exports a malformed DLPack shape");
  uint64_t elements = 1;
  for (int32_t d = 0; d < t.ndim; ++d) {
    const int64_t n = t.shape[d];
    if (n < 0) raise_invalid(what + " exports a negative DLPack dimension");
    if (n != 0 && elements > UINT64_MAX / uint64_t(n)) raise_invalid(what + " is too large");
    elements *= uint64_t(n);
  }
  if (elements == 0) raise_invalid("cannot use an empty " + what);
  int64_t expect = 1;  // the stride, in elements, of a compact row-major layout
  for (int32_t d = t.ndim - 1; d >= 0; --d) {
    const int64_t n = t.shape[d];
    if (t.strides && n != 1 && t.strides[d] != expect)
      raise_invalid("cannot register " + what + ": not contiguous (dimension " + std::to_string(d) + " has stride " +
                    std::to_string(t.strides[d]) + " elements, a compact layout has " + std::to_string(expect) +
                    "); register a contiguous copy or its base tensor");
    expect *= n;
  }
  return elements * (bits / 8);
}

template <typename Managed>
void delete_managed(PyObject* owner, const char* name) {
  auto* m = static_cast<Managed*>(PyCapsule_GetPointer(owner, name));
  if (m && m->deleter) m->deleter(m);
}

}  // namespace

void bind_dlpack(py::module_& m) {
  m.def(
      "dlpack_memory",
      [](py::object obj) {
        const std::string what = type_name(obj);
        const DLDevice dev = exporter_device(obj, what);
        if (dev.device_type != kDLCPU && dev.device_type != kDLCUDA && dev.device_type != kDLCUDAHost)
          raise_invalid("cannot register a " + what + " on DLPack device " + device_name(dev.device_type) +
                        ": pdkv registers CPU and CUDA memory");
        py::capsule cap = export_capsule(obj, what);
        const std::string name = cap.name() ? cap.name() : "";
        const bool versioned = name == "dltensor_versioned";
        if (!versioned && name != "dltensor")
          raise_invalid(what + ".__dlpack__() returned a capsule named '" + name +
                        "' (already consumed, or not DLPack)");
        void* ptr = PyCapsule_GetPointer(cap.ptr(), name.c_str());
        if (!ptr) throw py::error_already_set();
        const DLTensor& t = versioned ? static_cast<DLManagedTensorVersioned*>(ptr)->dl_tensor
                                      : static_cast<DLManagedTensor*>(ptr)->dl_tensor;
        if (versioned && static_cast<DLManagedTensorVersioned*>(ptr)->version.major != 1)
          raise_invalid(what + " exports DLPack " +
                        std::to_string(static_cast<DLManagedTensorVersioned*>(ptr)->version.major) +
                        ".x; pdkv reads 1.x");
        if (t.device.device_type != dev.device_type || t.device.device_id != dev.device_id)
          raise_invalid(what + "'s DLPack tensor is on another device than its __dlpack_device__() says");
        const uint64_t nbytes = contiguous_bytes(t, what);
        const uint64_t addr = reinterpret_cast<uint64_t>(t.data) + t.byte_offset;
        if (addr == 0) raise_invalid(what + " exports a null DLPack data pointer");
        const bool readonly = versioned && (static_cast<DLManagedTensorVersioned*>(ptr)->flags & kDLFlagReadOnly);
        const bool cuda = dev.device_type == kDLCUDA;

        // Every check passed: consume the capsule; the owner runs the exporter's deleter.
        py::capsule owner;
        if (versioned) {
          owner = py::capsule(ptr, kOwnerVersioned, [](PyObject* o) {
            delete_managed<DLManagedTensorVersioned>(o, kOwnerVersioned);
          });
        } else {
          owner = py::capsule(ptr, kOwnerLegacy, [](PyObject* o) { delete_managed<DLManagedTensor>(o, kOwnerLegacy); });
        }
        if (PyCapsule_SetName(cap.ptr(), versioned ? "used_dltensor_versioned" : "used_dltensor") != 0)
          throw py::error_already_set();
        return py::make_tuple(addr, nbytes, cuda ? "cuda" : "host", cuda ? dev.device_id : -1, readonly,
                              py::make_tuple(owner, obj));
      },
      py::arg("obj"),
      "(addr, nbytes, kind, device, readonly, keepalive) of a DLPack exporter's memory; InvalidArgument "
      "when it is not contiguous, empty, or on a device other than CPU or CUDA. Keep `keepalive` while "
      "the memory is in use.");
}

}  // namespace pdkv
