// Bounds-checked little-endian byte writer/reader for metadata and wire frames.
// The reader never reads past its input; every failure names the field.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "pdkv/status.h"

namespace pdkv::util {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "pdkv's wire format assumes a little-endian host");

class ByteWriter {
 public:
  template <typename T>
  void put(T v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const char* p = reinterpret_cast<const char*>(&v);
    buf_.append(p, sizeof v);
  }
  void put_str(std::string_view s) {
    put<uint32_t>(static_cast<uint32_t>(s.size()));
    buf_.append(s.data(), s.size());
  }
  void put_raw(const void* p, size_t n) { buf_.append(static_cast<const char*>(p), n); }
  std::string& str() { return buf_; }
  std::string take() { return std::move(buf_); }

 private:
  std::string buf_;
};

class ByteReader {
 public:
  explicit ByteReader(std::string_view in) : in_(in) {}
  template <typename T>
  Status get(T* v, const char* field) {
    if (in_.size() - pos_ < sizeof(T)) return truncated(field);
    std::memcpy(v, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return Status::Ok();
  }
  Status get_str(std::string* s, const char* field, uint32_t max_len) {
    uint32_t n = 0;
    PDKV_RETURN_IF_ERROR(get(&n, field));
    if (n > max_len)
      return ProtocolError(std::string(field) + " is " + std::to_string(n) + " bytes long (limit " +
                           std::to_string(max_len) + ")");
    if (in_.size() - pos_ < n) return truncated(field);
    s->assign(in_.data() + pos_, n);
    pos_ += n;
    return Status::Ok();
  }
  // A count of items each at least `min_item` bytes: rejects counts the input cannot hold.
  Status get_count(uint32_t* n, const char* field, size_t min_item, uint32_t max_count) {
    PDKV_RETURN_IF_ERROR(get(n, field));
    if (*n > max_count || (min_item && *n > remaining() / min_item))
      return ProtocolError(std::string(field) + " claims " + std::to_string(*n) + " entries, more than the " +
                           std::to_string(remaining()) + " remaining bytes can hold");
    return Status::Ok();
  }
  // Fails unless every byte was read: "<what> has N trailing bytes".
  Status expect_end(const char* what) const {
    if (remaining() == 0) return Status::Ok();
    return ProtocolError(std::string(what) + " has " + std::to_string(remaining()) + " trailing bytes");
  }
  size_t remaining() const { return in_.size() - pos_; }
  size_t pos() const { return pos_; }

 private:
  Status truncated(const char* field) const {
    return ProtocolError("truncated input: " + std::string(field) + " at byte " + std::to_string(pos_) +
                         " runs past the end (" + std::to_string(in_.size()) + " bytes)");
  }
  std::string_view in_;
  size_t pos_ = 0;
};

}  // namespace pdkv::util
