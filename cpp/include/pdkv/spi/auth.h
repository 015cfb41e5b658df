// pdkv/spi/auth.h: the mutual challenge-response every transport's handshake runs.
// The secret never crosses the wire.
//
// Both ends know a cluster secret. Each handshake:
//
//   initiator -> target    hello      {names, wire version, nonce_i, pub_i}
//   target    -> initiator challenge  {its name and instance, nonce_t, pub_t}
//   initiator -> target    proof      mac_i = MAC(K, "initiator", transcript)
//   target    -> initiator accept     mac_t = MAC(K, "target", transcript)     (only if mac_i checked)
//
//   transcript = length-prefixed (label, transport, wire version, initiator name,
//                target name, target instance, nonce_i, nonce_t, pub_i, pub_t)
//   K          = HMAC-SHA256(key, "pdkv handshake v1" || X25519(priv, peer_pub))
//   key        = HMAC-SHA256(PBKDF2-HMAC-SHA256(secret, "pdkv cluster credential v1",
//                20000), "pdkv purpose v1\0transport")   (pdkv.credential's "transport" key)
//
// What that gives:
// - The wire never carries the secret, nor anything derived from it alone.
// - A replayed proof fails (the other end's nonce and ephemeral key are fresh);
//   a reflected one fails (the role is in the MAC); a proof for another agent,
//   instance, transport or version fails (all in the transcript).
// - An initiator that does not know the secret learns nothing: the target proves
//   itself only after the initiator's proof checked.
// - A passive capture of a successful exchange gives no offline guess: K needs the
//   ephemeral X25519 secret of one end. (A party that runs the exchange itself, e.g. a
//   fake target an initiator was made to dial, sees one MAC it can test guesses of a
//   weak secret against, at a PBKDF2 per guess: use a random 128-bit secret.)
// - Rotation: a target accepts a proof made with any of its accepted keys and proves
//   itself with the one that matched.
//
// Thread safety: Exchange is used by one thread at a time; derive_key() and the free
// functions are thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "pdkv/status.h"

namespace pdkv::auth {

inline constexpr size_t kNonceBytes = 32;
inline constexpr size_t kPubBytes = 32;  // X25519 public key
inline constexpr size_t kMacBytes = 32;  // HMAC-SHA256
using Nonce = std::array<uint8_t, kNonceBytes>;
using Pub = std::array<uint8_t, kPubBytes>;
using Mac = std::array<uint8_t, kMacBytes>;
using ChannelBinding = std::array<uint8_t, 32>;

// The handshake key of one secret (never the secret itself). Derived once per
// secret per process (~5 ms: PBKDF2), then cached.
struct Key {
  std::array<uint8_t, 32> bytes{};
};
Key derive_key(std::string_view secret);

enum class Role : uint8_t { kInitiator = 1, kTarget = 2 };

// What both proofs cover.
struct Transcript {
  std::string transport;  // "tcp", "shm", "cuda_ipc", "nixl"
  uint32_t version = 0;   // the transport's wire version
  std::string initiator;  // agent names
  std::string target;
  uint64_t target_instance = 0;
  Nonce nonce_i{}, nonce_t{};
  Pub pub_i{}, pub_t{};
  // The channel the exchange runs in, when it is a TLS session: its exporter keying
  // material (zeros: none). A machine in the middle of two TLS sessions sees two.
  ChannelBinding binding{};
};

// One end's ephemeral state for one handshake: a fresh nonce and X25519 key pair.
class Exchange {
 public:
  // Internal on failure of the system's random source or of OpenSSL.
  static Result<Exchange> start();
  Exchange(Exchange&&) noexcept;
  Exchange& operator=(Exchange&&) noexcept;
  Exchange(const Exchange&) = delete;
  Exchange& operator=(const Exchange&) = delete;
  ~Exchange();

  const Nonce& nonce() const { return nonce_; }
  const Pub& pub() const { return pub_; }

  // Agrees on the shared secret with the other end's public key. AuthFailed for a
  // key that gives none (a low-order point). Call once, before mac()/match().
  Status agree(const Pub& peer_pub);

  // The MAC `role` sends, under `key`.
  Mac mac(const Key& key, Role role, const Transcript& t) const;

  // The index in `keys` whose MAC for `role` equals `got` (every key is tried,
  // in constant time each), or -1.
  int match(const std::vector<Key>& keys, Role role, const Transcript& t, const Mac& got) const;

 private:
  Exchange() = default;
  void* priv_ = nullptr;  // EVP_PKEY*
  Nonce nonce_{};
  Pub pub_{};
  std::array<uint8_t, 32> shared_{};
  bool agreed_ = false;
};

// Constant-time equality.
bool equal(const Mac& a, const Mac& b);

// The target's challenge as every transport sends it: u64 instance, u32 length + name
// (1..128 printable ASCII), 32-byte nonce, 32-byte X25519 key, nothing after.
struct Challenge {
  uint64_t instance = 0;
  std::string name;
  Nonce nonce{};
  Pub pub{};
};
std::string encode_challenge(const Challenge& c);
// ProtocolError naming the field (truncated, a bad name, trailing bytes).
Result<Challenge> decode_challenge(std::string_view aux);

// A proof or a hello-ack's MAC on the wire: exactly its 32 bytes. `what` names it in errors.
std::string encode_mac(const Mac& m);
Result<Mac> decode_mac(std::string_view aux, const char* what);

// The initiator's half of one handshake. A transport puts nonce()/pub() in its hello,
// answer()s the target's challenge with a proof, then check_accept()s the target's MAC.
class InitiatorHandshake {
 public:
  // `binding`: the TLS session it runs in (Transcript::binding), zeros for none.
  static Result<InitiatorHandshake> begin(std::string transport, uint32_t version, std::string self_name,
                                          const ChannelBinding& binding = ChannelBinding{});
  const Nonce& nonce() const { return ex_.nonce(); }
  const Pub& pub() const { return ex_.pub(); }
  // The target's challenge: its name, instance, nonce and key. *proof: what to send.
  Status answer(std::string target, uint64_t target_instance, const Nonce& nonce_t, const Pub& pub_t, const Key& key,
                Mac* proof);
  // AuthFailed unless `got` is the target's MAC under the key we proved with.
  Status check_accept(const Mac& got) const;

 private:
  InitiatorHandshake(Exchange ex) : ex_(std::move(ex)) {}
  Exchange ex_;
  Transcript t_;  // filled by begin(), completed by answer()
  Key key_;
  bool answered_ = false;
};

// The target's half: begin() on a hello (its nonce()/pub() go into the challenge),
// check() on the proof.
class TargetHandshake {
 public:
  static Result<TargetHandshake> begin(std::string transport, uint32_t version, std::string initiator,
                                       std::string self_name, uint64_t self_instance, const Nonce& nonce_i,
                                       const Pub& pub_i, const ChannelBinding& binding = ChannelBinding{});
  const Nonce& nonce() const { return ex_.nonce(); }
  const Pub& pub() const { return ex_.pub(); }
  const std::string& initiator() const { return t_.initiator; }
  // The index in `keys` of the key the initiator proved (then *ack is our MAC under
  // it, to send), or AuthFailed naming the initiator.
  Result<size_t> check(const Mac& proof, const std::vector<Key>& keys, Mac* ack) const;

 private:
  TargetHandshake(Exchange ex) : ex_(std::move(ex)) {}
  Exchange ex_;
  Transcript t_;  // complete after begin()
};

}  // namespace pdkv::auth
