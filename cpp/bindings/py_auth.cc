#include "py_auth.h"

#include <pybind11/stl.h>

#include <cstring>
#include <string>
#include <vector>

#include "py_common.h"
#include "pdkv/spi/auth.h"

namespace pdkv {
namespace {

namespace py = pybind11;
using bindings::raise_status;
using bindings::to_bytes;

template <size_t N>
std::array<uint8_t, N> fixed(const py::bytes& b, const char* what) {
  const std::string s = b;
  if (s.size() != N) raise_status(InvalidArgument(std::string(what) + " must be " + std::to_string(N) + " bytes, got " +
                                                  std::to_string(s.size())));
  std::array<uint8_t, N> out{};
  std::memcpy(out.data(), s.data(), N);
  return out;
}

template <size_t N>
py::bytes bytes_of(const std::array<uint8_t, N>& a) {
  return to_bytes(std::string_view(reinterpret_cast<const char*>(a.data()), N));
}

}  // namespace

void bind_auth(py::module_& m) {
  py::class_<auth::InitiatorHandshake>(m, "InitiatorHandshake",
                                       "The initiator's half of one handshake (pdkv/spi/auth.h).")
      .def(py::init([](const std::string& transport, uint32_t version, const std::string& self_name) {
             auto r = auth::InitiatorHandshake::begin(transport, version, self_name);
             if (!r.ok()) raise_status(r.status());
             return std::move(r).value();
           }),
           py::arg("transport"), py::arg("version"), py::arg("self_name"))
      .def_property_readonly("nonce", [](const auth::InitiatorHandshake& h) { return bytes_of(h.nonce()); })
      .def_property_readonly("pub", [](const auth::InitiatorHandshake& h) { return bytes_of(h.pub()); })
      .def(
          "answer",
          [](auth::InitiatorHandshake& h, const std::string& target, uint64_t instance, const py::bytes& nonce,
             const py::bytes& pub, const py::bytes& secret) {
            auth::Mac proof{};
            const auth::Key key = auth::derive_key(std::string(secret));
            Status st = h.answer(target, instance, fixed<auth::kNonceBytes>(nonce, "nonce"),
                                 fixed<auth::kPubBytes>(pub, "pub"), key, &proof);
            if (!st.ok()) raise_status(st);
            return bytes_of(proof);
          },
          py::arg("target"), py::arg("target_instance"), py::arg("nonce"), py::arg("pub"), py::arg("secret"),
          "The target's challenge -> our proof (32 bytes), made with `secret`.")
      .def(
          "check_accept",
          [](const auth::InitiatorHandshake& h, const py::bytes& mac) {
            Status st = h.check_accept(fixed<auth::kMacBytes>(mac, "mac"));
            if (!st.ok()) raise_status(st);
          },
          py::arg("mac"), "AuthFailed unless `mac` is the target's MAC under the secret we proved.");

  py::class_<auth::TargetHandshake>(m, "TargetHandshake", "The target's half of one handshake (pdkv/spi/auth.h).")
      .def(py::init([](const std::string& transport, uint32_t version, const std::string& initiator,
                       const std::string& self_name, uint64_t self_instance, const py::bytes& nonce,
                       const py::bytes& pub) {
             auto r = auth::TargetHandshake::begin(transport, version, initiator, self_name, self_instance,
                                                   fixed<auth::kNonceBytes>(nonce, "nonce"),
                                                   fixed<auth::kPubBytes>(pub, "pub"));
             if (!r.ok()) raise_status(r.status());
             return std::move(r).value();
           }),
           py::arg("transport"), py::arg("version"), py::arg("initiator"), py::arg("self_name"),
           py::arg("self_instance"), py::arg("nonce"), py::arg("pub"))
      .def_property_readonly("nonce", [](const auth::TargetHandshake& h) { return bytes_of(h.nonce()); })
      .def_property_readonly("pub", [](const auth::TargetHandshake& h) { return bytes_of(h.pub()); })
      .def(
          "check",
          [](const auth::TargetHandshake& h, const py::bytes& proof, const std::vector<std::string>& secrets) {
            std::vector<auth::Key> keys;
            for (const auto& s : secrets) keys.push_back(auth::derive_key(s));
            auth::Mac ack{};
            auto r = h.check(fixed<auth::kMacBytes>(proof, "proof"), keys, &ack);
            if (!r.ok()) raise_status(r.status());
            return py::make_tuple(*r, bytes_of(ack));
          },
          py::arg("proof"), py::arg("secrets"),
          "(index of the secret the initiator proved, our MAC to send back), or AuthFailed.");
}

}  // namespace pdkv
