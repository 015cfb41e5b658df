// Python surface of the codecs: _pdkv.Codec (encode/decode one chunk) and
// codec_throughput (times encode/decode in C++, GIL released, for `bench/codec_*`).
// Wrapped by python/pdkv/codec.py; the data path itself never goes through Python.
#include "py_codec.h"

#include <chrono>
#include <ctime>
#include <string>
#include <vector>

#include "pdkv/codec.h"
#include "py_common.h"

namespace pdkv {

namespace py = pybind11;
using bindings::raise_status;

namespace {

template <typename T>
T unwrap_or_raise(Result<T> r) {
  if (!r.ok()) raise_status(r.status());
  return std::move(r).value();
}

void check_or_raise(const Status& st) {
  if (!st.ok()) raise_status(st);
}

// The bytes of a C-contiguous buffer-protocol object (bytes, bytearray, numpy, memoryview).
struct Bytes {
  py::buffer_info info;
  uint8_t* ptr;
  size_t len;
};

Bytes contiguous_bytes(const py::buffer& b, bool writable, const char* what) {
  py::buffer_info bi = b.request(writable);
  py::ssize_t expect = bi.itemsize;
  for (py::ssize_t d = bi.ndim - 1; d >= 0; --d) {
    if (bi.shape[d] != 1 && bi.strides[d] != expect)
      raise_status(InvalidArgument(std::string(what) + " must be C-contiguous"));
    expect *= bi.shape[d];
  }
  Bytes out{std::move(bi), nullptr, 0};
  out.ptr = static_cast<uint8_t*>(out.info.ptr);
  out.len = size_t(out.info.size) * size_t(out.info.itemsize);
  return out;
}

DType dtype_of(const std::string& name) { return unwrap_or_raise(parse_dtype(name)); }

py::dict frame_dict(const FrameInfo& f) {
  py::dict d;
  d["codec"] = std::string(codec_kind_name(f.kind));
  d["dtype"] = std::string(dtype_name(f.dtype));
  d["checksum"] = f.has_checksum;
  d["raw_len"] = f.raw_len;
  d["payload_len"] = f.payload_len;
  d["frame_len"] = f.frame_len;
  if (f.kind == CodecKind::kFp8) {
    d["heads"] = f.fp8.heads;
    d["head_dim"] = f.fp8.head_dim;
    d["rows_per_group"] = f.fp8.rows_per_group;
  }
  return d;
}

std::unique_ptr<Codec> make_codec(const std::string& kind, int level, bool checksum, uint32_t heads,
                                  uint32_t head_dim, uint32_t rows_per_group) {
  CodecOptions o;
  o.kind = unwrap_or_raise(parse_codec_kind(kind));
  o.level = level;
  o.checksum = checksum;
  o.fp8 = Fp8Grouping{heads, head_dim, rows_per_group};
  return unwrap_or_raise(Codec::create(o));
}

py::bytes encode(Codec& c, const py::buffer& src, const std::string& dtype) {
  const DType dt = dtype_of(dtype);
  Bytes in = contiguous_bytes(src, false, "codec input");
  std::vector<uint8_t> frame;
  Status st;
  {
    py::gil_scoped_release nogil;
    st = c.encode(in.ptr, in.len, dt, frame);
  }
  check_or_raise(st);
  return py::bytes(reinterpret_cast<const char*>(frame.data()), frame.size());
}

size_t decode_into(Codec& c, const py::buffer& frame, const py::buffer& out, const std::string& dtype) {
  const DType dt = dtype_of(dtype);
  Bytes f = contiguous_bytes(frame, false, "codec frame");
  Bytes o = contiguous_bytes(out, true, "codec output");
  size_t written = 0;
  Status st;
  {
    py::gil_scoped_release nogil;
    st = c.decode(f.ptr, f.len, dt, o.ptr, o.len, &written);
  }
  check_or_raise(st);
  return written;
}

py::bytes decode(Codec& c, const py::buffer& frame, const std::string& dtype) {
  Bytes f = contiguous_bytes(frame, false, "codec frame");
  const FrameInfo info = unwrap_or_raise(peek_frame(f.ptr, f.len));
  const DType dt = dtype.empty() ? info.dtype : dtype_of(dtype);
  const uint64_t n = unwrap_or_raise(decoded_size(info, dt));
  if (f.len != info.frame_len)  // before allocating what the header claims
    raise_status(ProtocolError("codec frame: " + std::to_string(f.len) + " bytes, header says " +
                               std::to_string(info.frame_len)));
  py::bytes out = py::reinterpret_steal<py::bytes>(PyBytes_FromStringAndSize(nullptr, py::ssize_t(n)));
  if (!out) throw py::error_already_set();
  uint8_t* dst = reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(out.ptr()));
  size_t written = 0;
  Status st;
  {
    py::gil_scoped_release nogil;
    st = c.decode(f.ptr, f.len, dt, dst, n, &written);
  }
  check_or_raise(st);
  return out;
}

double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

// Encodes `src` `repeats` times and decodes the frame `repeats` times on this thread,
// GIL released; returns seconds per encode and per decode and the frame size.
py::dict throughput(Codec& c, const py::buffer& src, const std::string& dtype, const std::string& out_dtype,
                    int repeats) {
  if (repeats < 1) raise_status(InvalidArgument("repeats must be >= 1"));
  const DType dt = dtype_of(dtype);
  const DType odt = out_dtype.empty() ? dt : dtype_of(out_dtype);
  Bytes in = contiguous_bytes(src, false, "codec input");
  std::vector<uint8_t> frame;
  std::vector<uint8_t> out(in.len / dtype_size(dt) * dtype_size(odt) + dtype_size(odt));
  double enc_s = 0, dec_s = 0, enc_cpu_s = 0, dec_cpu_s = 0;
  Status st;
  {
    py::gil_scoped_release nogil;
    using clock = std::chrono::steady_clock;
    const double c0 = thread_cpu_seconds();
    auto t0 = clock::now();
    for (int i = 0; i < repeats && st.ok(); ++i) st = c.encode(in.ptr, in.len, dt, frame);
    auto t1 = clock::now();
    const double c1 = thread_cpu_seconds();
    size_t written = 0;
    for (int i = 0; i < repeats && st.ok(); ++i) st = c.decode(frame.data(), frame.size(), odt, out.data(), out.size(), &written);
    auto t2 = clock::now();
    const double c2 = thread_cpu_seconds();
    enc_s = std::chrono::duration<double>(t1 - t0).count() / repeats;
    dec_s = std::chrono::duration<double>(t2 - t1).count() / repeats;
    enc_cpu_s = (c1 - c0) / repeats;
    dec_cpu_s = (c2 - c1) / repeats;
  }
  check_or_raise(st);
  py::dict d;
  d["encode_s"] = enc_s;
  d["decode_s"] = dec_s;
  d["encode_cpu_s"] = enc_cpu_s;  // this thread's CPU time: per-core rates on a shared machine
  d["decode_cpu_s"] = dec_cpu_s;
  d["raw_bytes"] = in.len;
  d["frame_bytes"] = frame.size();
  return d;
}

}  // namespace

void bind_codec(py::module_& m) {
  m.def("codec_available", [](const std::string& kind) { return codec_available(unwrap_or_raise(parse_codec_kind(kind))); });
  m.def("codec_checksum_available", &checksum_available);
  m.def("codec_kernels", [] { return std::string(codec_kernels_name(codec_kernels())); });
  m.def("codec_kernels_available", [] {
    py::list out;
    for (CodecKernels k : codec_kernels_available()) out.append(py::str(std::string(codec_kernels_name(k))));
    return out;
  });
  m.def("set_codec_kernels", [](const std::string& name) {
    check_or_raise(set_codec_kernels(unwrap_or_raise(parse_codec_kernels(name))));
  }, py::arg("name"));
  m.attr("codec_header_bytes") = kCodecHeaderBytes;
  m.def("codec_peek_frame", [](const py::buffer& frame) {
    Bytes f = contiguous_bytes(frame, false, "codec frame");
    return frame_dict(unwrap_or_raise(peek_frame(f.ptr, f.len)));
  });
  py::class_<Codec>(m, "Codec")
      .def(py::init(&make_codec), py::arg("kind"), py::arg("level") = 1, py::arg("checksum") = false,
           py::arg("heads") = 1, py::arg("head_dim") = 1, py::arg("rows_per_group") = 128)
      .def_property_readonly("kind", [](const Codec& c) { return std::string(codec_kind_name(c.options().kind)); })
      .def_property_readonly("checksum", [](const Codec& c) { return c.options().checksum; })
      .def("max_frame_size", [](const Codec& c, size_t len, const std::string& dtype) {
        return c.max_frame_size(len, dtype_of(dtype));
      })
      .def("encode", &encode, py::arg("src"), py::arg("dtype"))
      .def("decode", &decode, py::arg("frame"), py::arg("dtype") = "")
      .def("decode_into", &decode_into, py::arg("frame"), py::arg("out"), py::arg("dtype"))
      .def("throughput", &throughput, py::arg("src"), py::arg("dtype"), py::arg("out_dtype") = "",
           py::arg("repeats") = 3);
}

}  // namespace pdkv
