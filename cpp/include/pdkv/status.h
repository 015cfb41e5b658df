// pdkv/status.h: the only error vocabulary of the pdkv core.
//
// Every fallible core function returns `Status` or `Result<T>`; the core never
// throws and never returns -1. The Python bindings map each StatusCode to one
// exception class (see python/pdkv/errors.py).
//
// Thread safety: Status and Result are plain values; copies are independent.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace pdkv {

// Error codes. kOk is the only success value. Keep in sync with errors.py.
enum class StatusCode : uint8_t {
  kOk = 0,
  kInvalidArgument,   // the caller passed something malformed or inconsistent
  kNotFound,          // unknown region, layout, peer or transport
  kAlreadyExists,     // duplicate name, overlapping registration
  kOutOfRange,        // offset/length outside a region or layout
  kAuthFailed,        // wrong secret or wrong target agent
  kProtocolError,     // malformed frame or metadata on the wire
  kVersionMismatch,   // metadata or wire protocol of an unknown version
  kStalePeer,         // the peer restarted; its metadata must be fetched again
  kConnectionError,   // peer unreachable, connection reset or closed
  kTimeout,           // a deadline passed
  kCancelled,         // the caller cancelled
  kNotSupported,      // the transport or build lacks this capability
  kResourceExhausted, // queue or memory limit hit
  kInternal,          // a bug in pdkv; please report
  kStaleBlock,        // a block's generation changed: it was freed or reused since it was handed out
  kDataCorrupted,     // bytes arrived but their end-to-end checksum does not match
};
// The largest code (codes are numbered densely from kOk; new codes go last, so the
// numbers on the wire never change).
constexpr StatusCode kLastStatusCode = StatusCode::kDataCorrupted;

// Human-readable name of a code, e.g. "ConnectionError".
std::string_view status_code_name(StatusCode code);
// A code received from a peer: unknown values (and OK, where an error was announced)
// become kProtocolError.
StatusCode status_code_from_wire(uint32_t v);

// A code plus a message that names the cause. Cheap to copy when OK.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  [[nodiscard]] bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "<CodeName>: <message>"
  std::string to_string() const;

  // Returns a copy whose message is "<prefix>: <message>".
  Status with_context(std::string_view prefix) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// Convenience constructors.
Status InvalidArgument(std::string msg);
Status NotFound(std::string msg);
Status AlreadyExists(std::string msg);
Status OutOfRange(std::string msg);
Status AuthFailed(std::string msg);
Status ProtocolError(std::string msg);
Status VersionMismatch(std::string msg);
Status StalePeer(std::string msg);
Status ConnectionError(std::string msg);
Status TimeoutError(std::string msg);
Status Cancelled(std::string msg);
Status NotSupported(std::string msg);
Status ResourceExhausted(std::string msg);
Status Internal(std::string msg);
Status StaleBlock(std::string msg);
Status DataCorrupted(std::string msg);

// Either a value or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}             // NOLINT(implicit)
  Result(Status status) : v_(std::move(status)) {}      // NOLINT(implicit); must not be OK

  [[nodiscard]] bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOkStatus;
    return ok() ? kOkStatus : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace pdkv

// Early-return helpers for implementation files.
#define PDKV_RETURN_IF_ERROR(expr)          \
  do {                                      \
    ::pdkv::Status _pdkv_st = (expr);       \
    if (!_pdkv_st.ok()) return _pdkv_st;    \
  } while (0)

#define PDKV_CONCAT_INNER(a, b) a##b
#define PDKV_CONCAT(a, b) PDKV_CONCAT_INNER(a, b)
#define PDKV_ASSIGN_OR_RETURN(lhs, expr)                         \
  auto PDKV_CONCAT(_pdkv_res_, __LINE__) = (expr);               \
  if (!PDKV_CONCAT(_pdkv_res_, __LINE__).ok())                   \
    return PDKV_CONCAT(_pdkv_res_, __LINE__).status();           \
  lhs = std::move(PDKV_CONCAT(_pdkv_res_, __LINE__)).value()
