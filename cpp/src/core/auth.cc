// The handshake's cryptography (pdkv/spi/auth.h), on OpenSSL's libcrypto.
#include "pdkv/spi/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstring>
#include <map>
#include <mutex>

#include "pdkv/metadata.h"
#include "util/bytes.h"

namespace pdkv::auth {
namespace {

constexpr char kSalt[] = "pdkv cluster credential v1";
constexpr int kRounds = 20000;  // the same as pdkv.credential
constexpr char kPurpose[] = "pdkv purpose v1\0transport";  // sizeof - 1 keeps the NUL

std::array<uint8_t, 32> hmac(const uint8_t* key, size_t key_len, const std::string& data) {
  std::array<uint8_t, 32> out{};
  unsigned int n = 0;
  HMAC(EVP_sha256(), key, static_cast<int>(key_len), reinterpret_cast<const unsigned char*>(data.data()), data.size(),
       out.data(), &n);
  return out;
}

// Length-prefixed fields: no two transcripts encode alike.
void put(std::string* s, const void* p, size_t n) {
  uint64_t len = n;
  s->append(reinterpret_cast<const char*>(&len), sizeof len);
  s->append(reinterpret_cast<const char*>(p), n);
}
void put(std::string* s, std::string_view v) { put(s, v.data(), v.size()); }
void put_u64(std::string* s, uint64_t v) { put(s, &v, sizeof v); }

std::string encode(Role role, const Transcript& t) {
  std::string s;
  s.reserve(256);
  put(&s, "pdkv handshake transcript v1");
  put(&s, role == Role::kInitiator ? std::string_view("initiator") : std::string_view("target"));
  put(&s, t.transport);
  put_u64(&s, t.version);
  put(&s, t.initiator);
  put(&s, t.target);
  put_u64(&s, t.target_instance);
  put(&s, t.nonce_i.data(), t.nonce_i.size());
  put(&s, t.nonce_t.data(), t.nonce_t.size());
  put(&s, t.pub_i.data(), t.pub_i.size());
  put(&s, t.pub_t.data(), t.pub_t.size());
  put(&s, t.binding.data(), t.binding.size());
  return s;
}

}  // namespace

Key derive_key(std::string_view secret) {
  static std::mutex mu;
  static std::map<std::string, Key, std::less<>> cache;  // a process knows a few secrets
  {
    std::lock_guard<std::mutex> lk(mu);
    auto it = cache.find(secret);
    if (it != cache.end()) return it->second;
  }
  std::array<uint8_t, 32> master{};
  PKCS5_PBKDF2_HMAC(secret.data(), static_cast<int>(secret.size()), reinterpret_cast<const unsigned char*>(kSalt),
                    sizeof kSalt - 1, kRounds, EVP_sha256(), static_cast<int>(master.size()), master.data());
  Key k;
  k.bytes = hmac(master.data(), master.size(), std::string(kPurpose, sizeof kPurpose - 1));
  OPENSSL_cleanse(master.data(), master.size());
  std::lock_guard<std::mutex> lk(mu);
  if (cache.size() >= 64) cache.clear();  // bounded: a process is never handed thousands of secrets
  cache.emplace(std::string(secret), k);
  return k;
}

Result<Exchange> Exchange::start() {
  Exchange e;
  if (RAND_bytes(e.nonce_.data(), static_cast<int>(e.nonce_.size())) != 1)
    return Internal("handshake: the random source failed");
  EVP_PKEY_CTX* ctx = EVP_PKEY_CTX_new_id(EVP_PKEY_X25519, nullptr);
  EVP_PKEY* pk = nullptr;
  const bool ok = ctx && EVP_PKEY_keygen_init(ctx) == 1 && EVP_PKEY_keygen(ctx, &pk) == 1;
  EVP_PKEY_CTX_free(ctx);
  if (!ok) return Internal("handshake: X25519 key generation failed");
  e.priv_ = pk;
  size_t n = e.pub_.size();
  if (EVP_PKEY_get_raw_public_key(pk, e.pub_.data(), &n) != 1 || n != e.pub_.size())
    return Internal("handshake: reading the X25519 public key failed");
  return e;
}

Exchange::Exchange(Exchange&& o) noexcept
    : priv_(o.priv_), nonce_(o.nonce_), pub_(o.pub_), shared_(o.shared_), agreed_(o.agreed_) {
  o.priv_ = nullptr;
  OPENSSL_cleanse(o.shared_.data(), o.shared_.size());
}

Exchange& Exchange::operator=(Exchange&& o) noexcept {
  if (this != &o) {
    EVP_PKEY_free(static_cast<EVP_PKEY*>(priv_));
    priv_ = o.priv_;
    o.priv_ = nullptr;
    nonce_ = o.nonce_;
    pub_ = o.pub_;
    shared_ = o.shared_;
    agreed_ = o.agreed_;
    OPENSSL_cleanse(o.shared_.data(), o.shared_.size());
  }
  return *this;
}

Exchange::~Exchange() {
  EVP_PKEY_free(static_cast<EVP_PKEY*>(priv_));
  OPENSSL_cleanse(shared_.data(), shared_.size());
}

Status Exchange::agree(const Pub& peer_pub) {
  if (!priv_ || agreed_) return Internal("handshake: agree() called twice or on a moved-from exchange");
  EVP_PKEY* peer = EVP_PKEY_new_raw_public_key(EVP_PKEY_X25519, nullptr, peer_pub.data(), peer_pub.size());
  if (!peer) return AuthFailed("handshake: the peer's ephemeral key is not an X25519 key");
  EVP_PKEY_CTX* ctx = EVP_PKEY_CTX_new(static_cast<EVP_PKEY*>(priv_), nullptr);
  size_t n = shared_.size();
  // OpenSSL refuses an all-zero result (a low-order peer key) in derive.
  const bool ok = ctx && EVP_PKEY_derive_init(ctx) == 1 && EVP_PKEY_derive_set_peer(ctx, peer) == 1 &&
                  EVP_PKEY_derive(ctx, shared_.data(), &n) == 1 && n == shared_.size();
  EVP_PKEY_CTX_free(ctx);
  EVP_PKEY_free(peer);
  if (!ok) return AuthFailed("handshake: the peer's ephemeral key gives no shared secret");
  agreed_ = true;
  return Status();
}

Mac Exchange::mac(const Key& key, Role role, const Transcript& t) const {
  if (!agreed_) return Mac{};  // never equal to a real MAC's check: match() refuses first
  std::string k_in = "pdkv handshake v1";
  k_in.append(reinterpret_cast<const char*>(shared_.data()), shared_.size());
  std::array<uint8_t, 32> k = hmac(key.bytes.data(), key.bytes.size(), k_in);
  OPENSSL_cleanse(k_in.data(), k_in.size());
  Mac m = hmac(k.data(), k.size(), encode(role, t));
  OPENSSL_cleanse(k.data(), k.size());
  return m;
}

int Exchange::match(const std::vector<Key>& keys, Role role, const Transcript& t, const Mac& got) const {
  if (!agreed_) return -1;
  int found = -1;
  for (size_t i = 0; i < keys.size(); ++i)
    if (equal(mac(keys[i], role, t), got) && found < 0) found = static_cast<int>(i);
  return found;
}

bool equal(const Mac& a, const Mac& b) { return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0; }

// ---- the wire bodies

std::string encode_challenge(const Challenge& c) {
  util::ByteWriter w;
  w.put<uint64_t>(c.instance);
  w.put_str(c.name);
  w.put_raw(c.nonce.data(), c.nonce.size());
  w.put_raw(c.pub.data(), c.pub.size());
  return w.take();
}

Result<Challenge> decode_challenge(std::string_view aux) {
  util::ByteReader r(aux);
  Challenge c;
  PDKV_RETURN_IF_ERROR(r.get(&c.instance, "challenge instance"));
  PDKV_RETURN_IF_ERROR(r.get_str(&c.name, "challenge name", 128));
  PDKV_RETURN_IF_ERROR(r.get(&c.nonce, "challenge nonce"));
  PDKV_RETURN_IF_ERROR(r.get(&c.pub, "challenge key"));
  PDKV_RETURN_IF_ERROR(r.expect_end("challenge"));
  Status st = validate_name("target name", c.name);
  if (!st.ok()) return ProtocolError(st.message());
  return c;
}

std::string encode_mac(const Mac& m) { return std::string(reinterpret_cast<const char*>(m.data()), m.size()); }

Result<Mac> decode_mac(std::string_view aux, const char* what) {
  util::ByteReader r(aux);
  Mac m{};
  PDKV_RETURN_IF_ERROR(r.get(&m, what));
  PDKV_RETURN_IF_ERROR(r.expect_end(what));
  return m;
}

// ---- the two halves

Result<InitiatorHandshake> InitiatorHandshake::begin(std::string transport, uint32_t version, std::string self_name,
                                                     const ChannelBinding& binding) {
  PDKV_ASSIGN_OR_RETURN(Exchange ex, Exchange::start());
  InitiatorHandshake h(std::move(ex));
  h.t_.transport = std::move(transport);
  h.t_.version = version;
  h.t_.initiator = std::move(self_name);
  h.t_.nonce_i = h.ex_.nonce();
  h.t_.pub_i = h.ex_.pub();
  h.t_.binding = binding;
  return h;
}

Status InitiatorHandshake::answer(std::string target, uint64_t target_instance, const Nonce& nonce_t,
                                  const Pub& pub_t, const Key& key, Mac* proof) {
  if (answered_) return Internal("handshake: answer() called twice");
  PDKV_RETURN_IF_ERROR(ex_.agree(pub_t));
  t_.target = std::move(target);
  t_.target_instance = target_instance;
  t_.nonce_t = nonce_t;
  t_.pub_t = pub_t;
  key_ = key;
  answered_ = true;
  *proof = ex_.mac(key_, Role::kInitiator, t_);
  return Status::Ok();
}

Status InitiatorHandshake::check_accept(const Mac& got) const {
  if (answered_ && ex_.match({key_}, Role::kTarget, t_, got) == 0) return Status::Ok();
  return AuthFailed("agent '" + t_.target + "' accepted our proof but could not prove it knows the secret");
}

Result<TargetHandshake> TargetHandshake::begin(std::string transport, uint32_t version, std::string initiator,
                                               std::string self_name, uint64_t self_instance, const Nonce& nonce_i,
                                               const Pub& pub_i, const ChannelBinding& binding) {
  PDKV_ASSIGN_OR_RETURN(Exchange ex, Exchange::start());
  PDKV_RETURN_IF_ERROR(ex.agree(pub_i));
  TargetHandshake h(std::move(ex));
  h.t_ = Transcript{std::move(transport), version, std::move(initiator), std::move(self_name), self_instance,
                    nonce_i, h.ex_.nonce(), pub_i, h.ex_.pub(), binding};
  return h;
}

Result<size_t> TargetHandshake::check(const Mac& proof, const std::vector<Key>& keys, Mac* ack) const {
  const int i = ex_.match(keys, Role::kInitiator, t_, proof);
  if (i < 0)
    return AuthFailed("agent '" + t_.initiator + "' proved a wrong secret to agent '" + t_.target +
                      "' (its proof matches none of the accepted secrets)");
  *ack = ex_.mac(keys[static_cast<size_t>(i)], Role::kTarget, t_);
  return static_cast<size_t>(i);
}

}  // namespace pdkv::auth
