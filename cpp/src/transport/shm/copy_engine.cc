#include "transport/shm/copy_engine.h"

#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "util/socket.h"
#include "util/thread_name.h"

namespace pdkv::shm {

Status run_copies(const Binding& p) {
  if (!p.cma) {
    if (p.op == OpKind::kWrite) {
      for (const auto& o : p.ops) std::memcpy(reinterpret_cast<void*>(o.remote), o.local, o.len);
    } else {
      for (const auto& o : p.ops) std::memcpy(o.local, reinterpret_cast<const void*>(o.remote), o.len);
    }
    return Status::Ok();
  }
  // Mixed: mapped extents by memcpy, the rest by process_vm_{write,read}v in batches.
  std::vector<iovec> liov, riov;
  liov.reserve(1024);
  riov.reserve(1024);
  auto flush = [&]() -> Status {
    size_t i = 0;
    while (i < liov.size()) {
      size_t n = std::min<size_t>(liov.size() - i, 1024);
      ssize_t got = p.op == OpKind::kWrite ? ::process_vm_writev(p.pid, &liov[i], n, &riov[i], n, 0)
                                           : ::process_vm_readv(p.pid, &liov[i], n, &riov[i], n, 0);
      if (got < 0) {
        const int err = errno;
        if (err == EINTR) continue;
        if (err == ESRCH) return ConnectionError("peer process " + std::to_string(p.pid) + " is gone");
        return ConnectionError("cross-memory " + std::string(p.op == OpKind::kWrite ? "write" : "read") +
                               " to pid " + std::to_string(p.pid) + " failed: " + util::errno_str(err));
      }
      // Advance over fully copied entries; a partial one is retried from its tail.
      size_t left = static_cast<size_t>(got);
      while (left > 0 && i < liov.size()) {
        if (left >= liov[i].iov_len) {
          left -= liov[i].iov_len;
          ++i;
        } else {
          liov[i].iov_base = static_cast<char*>(liov[i].iov_base) + left;
          riov[i].iov_base = static_cast<char*>(riov[i].iov_base) + left;
          liov[i].iov_len -= left;
          riov[i].iov_len -= left;
          left = 0;
        }
      }
      if (got == 0) return ConnectionError("cross-memory copy made no progress");
    }
    liov.clear();
    riov.clear();
    return Status::Ok();
  };
  for (const auto& o : p.ops) {
    if (o.mapped) {
      if (p.op == OpKind::kWrite)
        std::memcpy(reinterpret_cast<void*>(o.remote), o.local, o.len);
      else
        std::memcpy(o.local, reinterpret_cast<const void*>(o.remote), o.len);
      continue;
    }
    liov.push_back({o.local, o.len});
    riov.push_back({reinterpret_cast<void*>(o.remote), o.len});
    if (liov.size() == 1024) PDKV_RETURN_IF_ERROR(flush());
  }
  return flush();
}

void CopyEngine::start(uint32_t threads) {
  for (uint32_t i = 0; i < threads; ++i) threads_.emplace_back([this] { loop(); });
}

void CopyEngine::submit(Job job) {
  std::lock_guard<std::mutex> lk(mu_);
  queue_.push_back(std::move(job));
  cv_.notify_one();
}

std::deque<Job> CopyEngine::stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    cv_.notify_all();
  }
  for (auto& t : threads_) t.join();
  threads_.clear();
  std::deque<Job> left;
  std::lock_guard<std::mutex> lk(mu_);
  left.swap(queue_);
  return left;
}

void CopyEngine::loop() {
  util::name_this_thread("pdkv-shm-copy");
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    run_(job);
  }
}

}  // namespace pdkv::shm
