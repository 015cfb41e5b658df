// pdkv/options/transport_options.h: the base of every transport's options type, and
// the collection of them an agent is created with (AgentConfig::options).
//
// Each transport declares its own options type (pdkv/options/tcp.h, shm.h; a Python
// transport's class in Python) deriving from TransportOptionsOf<T> with a
// `static constexpr std::string_view kTransport` naming the transport, and registers
// it with its factory (pdkv/spi/registry.h, TransportFactory::default_options). The
// agent hands each transport factory the options held under its name (or the
// factory's defaults); nothing else in the core knows any transport's options.
// Thread safety: plain values (a TransportOptionsSet copies deeply).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "pdkv/status.h"

namespace pdkv {

class TransportOptions {
 public:
  virtual ~TransportOptions() = default;
  // The registry name of the transport these options configure ("tcp").
  virtual std::string_view transport() const = 0;
  // OK, or InvalidArgument naming the first field out of range and its value
  // ("tcp.conns_per_peer must be in 1..64, got 0").
  virtual Status validate() const = 0;
  // A deep copy (AgentConfig copies its options).
  virtual std::unique_ptr<TransportOptions> clone() const = 0;

 protected:
  TransportOptions() = default;
  TransportOptions(const TransportOptions&) = default;
  TransportOptions& operator=(const TransportOptions&) = default;
};

// The base of a concrete options type T (CRTP): T names its transport in
// `static constexpr std::string_view kTransport` and implements validate().
template <typename T>
class TransportOptionsOf : public TransportOptions {
 public:
  std::string_view transport() const override { return T::kTransport; }
  std::unique_ptr<TransportOptions> clone() const override {
    return std::make_unique<T>(static_cast<const T&>(*this));
  }
};

// `opts` as the options type T its transport declared, or InvalidArgument when it is
// another type (options registered under T's name by someone else).
template <typename T>
Result<const T*> options_as(const TransportOptions& opts) {
  if (const T* t = dynamic_cast<const T*>(&opts)) return t;
  return InvalidArgument("transport '" + std::string(T::kTransport) + "' got options of another type (for '" +
                         std::string(opts.transport()) + "')");
}

// At most one options object per transport, held by the transport's name, in the
// order they were set. Copies are deep.
class TransportOptionsSet {
 public:
  TransportOptionsSet() = default;
  TransportOptionsSet(const TransportOptionsSet& o) { *this = o; }
  TransportOptionsSet& operator=(const TransportOptionsSet& o) {
    if (this == &o) return *this;
    std::vector<std::unique_ptr<TransportOptions>> copy;
    copy.reserve(o.items_.size());
    for (const auto& i : o.items_) copy.push_back(i->clone());
    items_ = std::move(copy);
    return *this;
  }
  TransportOptionsSet(TransportOptionsSet&&) noexcept = default;
  TransportOptionsSet& operator=(TransportOptionsSet&&) noexcept = default;

  // Sets the options of opts.transport(), replacing any held for it. Null is ignored.
  void set(std::unique_ptr<TransportOptions> opts) {
    if (!opts) return;
    for (auto& i : items_)
      if (i->transport() == opts->transport()) {
        i = std::move(opts);
        return;
      }
    items_.push_back(std::move(opts));
  }
  void set(const TransportOptions& opts) { set(opts.clone()); }

  // The options held for `transport`, or null.
  const TransportOptions* find(std::string_view transport) const {
    for (const auto& i : items_)
      if (i->transport() == transport) return i.get();
    return nullptr;
  }
  // The options held for T's transport as a T, or null (none, or of another type).
  template <typename T>
  const T* get() const {
    return dynamic_cast<const T*>(find(T::kTransport));
  }
  // T's options to change in place: those held (a T), else new defaults added.
  template <typename T>
  T& edit() {
    for (auto& i : items_)
      if (i->transport() == T::kTransport) {
        if (T* t = dynamic_cast<T*>(i.get())) return *t;
        i = std::make_unique<T>();
        return static_cast<T&>(*i);
      }
    items_.push_back(std::make_unique<T>());
    return static_cast<T&>(*items_.back());
  }
  // Removes the options of `transport`; false if none were held.
  bool erase(std::string_view transport) {
    for (auto it = items_.begin(); it != items_.end(); ++it)
      if ((*it)->transport() == transport) {
        items_.erase(it);
        return true;
      }
    return false;
  }
  void clear() { items_.clear(); }
  size_t size() const { return items_.size(); }
  bool empty() const { return items_.empty(); }
  // The held options in order (never null).
  std::vector<const TransportOptions*> all() const {
    std::vector<const TransportOptions*> out;
    out.reserve(items_.size());
    for (const auto& i : items_) out.push_back(i.get());
    return out;
  }

 private:
  std::vector<std::unique_ptr<TransportOptions>> items_;
};

}  // namespace pdkv
