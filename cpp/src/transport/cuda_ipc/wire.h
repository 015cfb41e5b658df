// cuda_ipc control protocol (Unix socket next to the exporter): frame layout,
// per-state limits and the hello codec.
//
// Pure functions (no sockets, no CUDA): the transport calls them on every frame and
// fuzz/targets/cuda_ipc_ctl_fuzz.cc on arbitrary bytes. Specification: docs/wire.md
// ("cuda_ipc control channel").
//
// Thread safety: stateless.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "pdkv/spi/auth.h"
#include "pdkv/status.h"

namespace pdkv::cuda_ipc {

constexpr uint32_t kCtlMagic = 0x434b4450;  // "PDKC"
// 2: challenge-response authentication (pdkv/spi/auth.h): the secret is never sent.
constexpr uint16_t kCtlVersion = 2;
constexpr uint32_t kMaxHelloAux = 4096;
constexpr uint32_t kMaxErrorAux = 4096;
constexpr double kCtlTimeoutS = 5.0;       // connect + handshake; and a started frame -> its last byte
constexpr double kRevokeTimeoutS = 10.0;   // deregistration waits this long for importers
constexpr size_t kMaxPendingConns = 64;    // unauthenticated control connections at once

enum class Ctl : uint16_t {
  kHello = 1,      // importer -> exporter; aux: Hello
  kHelloAck = 2,   // exporter -> importer, after a good proof; aux: the exporter's 32-byte MAC
  kRevoke = 3,     // exporter -> importer: stop using region `id`
  kRevokeAck = 4,  // importer -> exporter: region `id` is no longer mapped
  kError = 5,      // status: StatusCode, aux: message; the sender then closes
  kChallenge = 6,  // exporter -> importer, answering the hello; aux: Challenge
  kProof = 7,      // importer -> exporter; aux: the importer's 32-byte MAC
};

struct CtlHdr {
  uint32_t magic;
  uint16_t type;
  uint16_t reserved;  // 0
  uint64_t id;
  uint32_t aux_len;
  uint32_t status;  // a StatusCode in kError, else 0
};
static_assert(sizeof(CtlHdr) == 24, "control header must be 24 bytes");

enum class CtlSide : uint8_t {
  kExporterPreHello,  // accepted, nothing but a hello yet
  kExporter,          // accepted, authenticated
  kImporterHello,     // dialed, waiting for the challenge, then the hello-ack (or an error)
  kImporter,          // dialed, authenticated
  kExporterProof,     // accepted, hello answered with a challenge: only the proof may come
};

// OK when reading h.aux_len more bytes is allowed on `side`.
Status check_ctl_header(const CtlHdr& h, CtlSide side);

struct Hello {
  uint16_t version = 0;
  uint64_t expect_instance = 0;
  std::string from;
  auth::Nonce nonce{};
  auth::Pub pub{};
};
std::string encode_hello(const Hello& h);
Result<Hello> parse_hello(std::string_view aux);

// The challenge, and a kProof's or kHelloAck's aux (exactly one MAC): the handshake's
// bodies of every transport (pdkv/spi/auth.h).
using auth::Challenge;
using auth::encode_challenge;
using auth::encode_mac;
inline Result<Challenge> parse_challenge(std::string_view aux) { return auth::decode_challenge(aux); }
inline Result<auth::Mac> parse_mac(std::string_view aux) { return auth::decode_mac(aux, "mac"); }

// Header limits plus the body of types that have one.
Status validate_ctl_frame(const CtlHdr& h, std::string_view aux, CtlSide side);

}  // namespace pdkv::cuda_ipc
