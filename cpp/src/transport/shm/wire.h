// shm control protocol: frame layout, per-state limits and message codecs.
//
// Pure functions only (no sockets, no threads): the transport calls them on every
// frame and the fuzzer (fuzz/targets/shm_ctl_fuzz.cc) calls them on arbitrary bytes.
// docs/wire.md ("shm control channel") is the specification; keep the two in step.
//
// Thread safety: everything here is stateless and safe from any thread.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "pdkv/spi/auth.h"
#include "pdkv/spi/generations.h"
#include "pdkv/status.h"
#include "pdkv/types.h"

namespace pdkv::shm {

constexpr uint32_t kCtlMagic = 0x534b4450;  // "PDKS"
// 2: region confirmation (RegionReq/RegionResp for every region, not only memfd ones).
// 3: block generation leases (LeaseReq/LeaseResp/LeaseEnd).
// 4: RegionInfo names the memfd-backed window of a region (engine memory whose whole
//    pages were re-mapped onto a memfd at registration; docs/transports.md).
// 5: shared generation tables (GenReq/GenResp): reads validate block generations
//    against the target's published table, before and after the copy, without a lease.
// 6: challenge-response authentication (Challenge/Proof; pdkv/spi/auth.h): the hello
//    carries a nonce and an ephemeral key instead of the secret.
constexpr uint16_t kShmVersion = 6;

// Limits (bytes of aux), checked on the header before anything is allocated.
constexpr uint32_t kMaxHelloAux = 4096;   // hello, hello-ack
constexpr uint32_t kMaxErrorAux = 4096;   // error messages, RegionResp failures
constexpr uint32_t kMaxNameLen = 128;
constexpr uint32_t kRegionInfoLen = 40;   // RegionResp success body
constexpr uint32_t kGenRespLen = 4;       // GenResp success body: u32 block count
// Deadlines (seconds).
constexpr double kHandshakeTimeoutS = 5.0;  // accept -> authenticated hello
constexpr double kFrameTimeoutS = 5.0;      // first byte of a frame -> its last byte
constexpr double kRevokeTimeoutS = 10.0;    // deregistration waits this long per peer
// Block generation leases (docs/generations.md): a lease request carries a hold time
// and a claim; the target holds the pins at most hold + margin, then closes the
// connection (as for a revocation that is not acknowledged).
constexpr uint32_t kMaxLeaseHoldMs = 600000;
constexpr double kLeaseMarginS = 5.0;
constexpr uint32_t kMaxLeaseReqAux = 4 + kMaxClaimBytes;
constexpr size_t kMaxLeasesPerConn = 1024;         // granted and not yet ended
constexpr uint64_t kMaxLeasedBlocksPerConn = 1u << 22;  // claim entries over those leases
// At most this many accepted connections may be unauthenticated at once.
constexpr size_t kMaxPendingConns = 64;

enum class Ctl : uint16_t {
  kHello = 1,       // initiator -> target: aux = Hello
  kHelloAck = 2,    // target -> initiator: aux = HelloAck
  kRegionReq = 3,   // initiator -> target: id = region; confirm (and map) it
  kRegionResp = 4,  // target -> initiator: id = region; status 0: RegionInfo (+ memfd if shareable), else message
  kNotify = 5,      // initiator -> target: id = sequence, aux = notification
  kNotifyAck = 6,   // target -> initiator: id = sequence
  kRevoke = 7,      // target -> initiator: stop using region id
  kRevokeAck = 8,   // initiator -> target: region id no longer used
  kError = 9,       // either: status + message; the sender closes
  kLeaseReq = 10,   // initiator -> target: id = lease, aux = LeaseReq; check and pin block generations
  kLeaseResp = 11,  // target -> initiator: id = lease; status 0: granted (no aux), else message
  kLeaseEnd = 12,   // initiator -> target: id = lease; the copy is over, unpin
  kGenReq = 13,     // initiator -> target: id = request, aux = layout name; share its generation table
  kGenResp = 14,    // target -> initiator: id = request; status 0: u32 block count + the table's memfd, else message
  kChallenge = 15,  // target -> initiator, answering the hello: aux = Challenge
  kProof = 16,      // initiator -> target: aux = the initiator's 32-byte MAC
};

struct CtlHdr {
  uint32_t magic;
  uint16_t type;
  uint16_t flags;  // 0
  uint64_t id;
  uint32_t aux_len;
  uint32_t status;  // a StatusCode in RegionResp, LeaseResp, GenResp and Error, else 0
};
static_assert(sizeof(CtlHdr) == 24, "control header must be 24 bytes");

// Which end of a connection is reading, and how far its handshake got.
enum class CtlSide : uint8_t {
  kTargetPreHello,  // we accepted; nothing but a hello is allowed yet
  kTarget,          // we accepted; the initiator authenticated
  kInitiatorHello,  // we dialed; waiting for the challenge, then the hello-ack (or an error)
  kInitiator,       // we dialed; authenticated
  kTargetProof,     // we accepted and answered the hello with a challenge; only the proof may come
};

// Checks a received header against the limits of `side`; OK means reading
// h.aux_len bytes of aux is allowed. `max_notif` bounds notifications.
Status check_ctl_header(const CtlHdr& h, CtlSide side, uint32_t max_notif);

// No secret: the initiator proves it knows one (Proof; pdkv/spi/auth.h).
struct Hello {
  uint16_t version = 0;
  uint64_t expect_instance = 0;  // 0: any
  std::string from, to;          // to "": any
  auth::Nonce nonce{};
  auth::Pub pub{};
};
std::string encode_hello(const Hello& h);
Result<Hello> parse_hello(std::string_view aux);

// The target's answer to a hello (who it is, its half of the exchange) and the
// initiator's Proof (exactly one MAC): the handshake's bodies of every transport.
using auth::Challenge;
using auth::encode_challenge;
inline Result<Challenge> parse_challenge(std::string_view aux) { return auth::decode_challenge(aux); }
inline Result<auth::Mac> parse_proof(std::string_view aux) { return auth::decode_mac(aux, "proof"); }

// Sent only after the initiator's proof checked: the target's own MAC.
struct HelloAck {
  uint64_t instance = 0;
  uint32_t pid = 0;
  std::string name;
  auth::Mac mac{};
};
std::string encode_hello_ack(const HelloAck& a);
Result<HelloAck> parse_hello_ack(std::string_view aux);

// What the target confirms about one of its regions, from its region table now.
struct RegionInfo {
  uint64_t addr = 0;  // in the target's address space
  uint64_t len = 0;
  MemKind kind = MemKind::kHost;
  bool shareable = false;  // a memfd is attached to the response
  // Bytes [shared_offset, shared_offset + shared_len) of the region are the memfd's
  // bytes [0, shared_len): the whole region for Agent.alloc memory, the whole pages
  // inside it for shared engine memory. shared_len != 0 exactly when shareable.
  uint64_t shared_offset = 0;
  uint64_t shared_len = 0;
};
std::string encode_region_info(const RegionInfo& r);
Result<RegionInfo> parse_region_info(std::string_view aux);

// A request to check and pin block generations for one transfer's copy.
struct LeaseReq {
  uint32_t hold_ms = 0;  // 1..kMaxLeaseHoldMs: the initiator ends the lease within this
  GenClaim claim;
};
std::string encode_lease_req(const LeaseReq& r);
Result<LeaseReq> parse_lease_req(std::string_view aux);

// Validates one complete frame (header + aux) received on `side`: the header limits
// and the body of the types that have one. The transport calls it before acting.
Status validate_ctl_frame(const CtlHdr& h, std::string_view aux, CtlSide side, uint32_t max_notif);

}  // namespace pdkv::shm
