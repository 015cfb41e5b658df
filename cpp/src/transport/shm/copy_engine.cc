#include "transport/shm/copy_engine.h"

#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "pdkv/spi/transfer_control.h"
#include "transport/shm/conn.h"
#include "util/piece_copy.h"
#include "util/socket.h"
#include "util/thread_name.h"

namespace pdkv::shm {

namespace {

// Every kCheckBytes copied, a running copy looks at its transfer: past the deadline it
// stops with a timeout, a cancelled transfer stops with Cancelled (a copy is not
// recalled: the bytes already written stay, as with tcp). One check costs a clock read.
constexpr uint64_t kCheckBytes = 4ull << 20;

class CopyClock {
 public:
  CopyClock(Transfer* xfer, uint64_t total) : xfer_(xfer), total_(total) {}
  // Counts `n` more bytes done; an error once the transfer should stop.
  Status advance(uint64_t n) {
    done_ += n;
    since_ += n;
    if (xfer_ == nullptr || since_ < kCheckBytes) return Status::Ok();
    since_ = 0;
    return check();
  }
  Status check() const {
    if (xfer_ == nullptr) return Status::Ok();
    if (spi::TransferControl(*xfer_).cancel_requested())
      return Cancelled("cancelled during the copy (" + std::to_string(done_) + " of " + std::to_string(total_) +
                       " bytes copied)");
    if (Clock::now() >= xfer_->deadline())
      return TimeoutError("transfer " + std::to_string(xfer_->id()) + " timed out during the copy (" +
                          std::to_string(done_) + " of " + std::to_string(total_) + " bytes copied)");
    return Status::Ok();
  }

 private:
  Transfer* xfer_;
  uint64_t total_;
  uint64_t done_ = 0;
  uint64_t since_ = 0;
};

// memcpy of one extent in kCheckBytes pieces, checking the clock between them.
Status copy_span(char* local, char* remote, uint64_t len, OpKind op, CopyClock& clk) {
  for (uint64_t off = 0; off < len;) {
    const uint64_t n = std::min<uint64_t>(len - off, kCheckBytes);
    if (op == OpKind::kWrite)
      std::memcpy(remote + off, local + off, n);
    else
      std::memcpy(local + off, remote + off, n);
    off += n;
    PDKV_RETURN_IF_ERROR(clk.advance(n));
  }
  return Status::Ok();
}

// The pieces of one level of a mapped op (`count` pieces from local/remote at the
// op's inner strides). A strided run's pieces are written with streaming stores
// (util/piece_copy.h: scattered small pieces copy 2-3x faster so), in groups of about
// kCheckBytes, so the clock is read as often as for a plain copy. No fence here:
// run_copies() fences once, before the transfer can complete.
Status copy_level(const CopyOp& o, char* local, char* remote, OpKind op, CopyClock& clk) {
  if (o.count == 1) return copy_span(local, remote, o.len, op, clk);
  const uint64_t group = std::max<uint64_t>(1, kCheckBytes / o.len);
  const util::PieceStores how = util::piece_stores();
  for (uint64_t i = 0; i < o.count;) {
    const uint64_t k = std::min(group, o.count - i);
    char* l = local + i * o.local_stride;
    char* r = remote + i * o.remote_stride;
    if (op == OpKind::kWrite)
      util::copy_strided_unfenced(how, r, o.remote_stride, l, o.local_stride, o.len, k);
    else
      util::copy_strided_unfenced(how, l, o.local_stride, r, o.remote_stride, o.len, k);
    i += k;
    PDKV_RETURN_IF_ERROR(clk.advance(k * o.len));
  }
  return Status::Ok();
}

}  // namespace

CopyOp source_order(const CopyOp& o, OpKind op) {
  const bool write = op == OpKind::kWrite;
  const uint64_t inner = write ? o.local_stride : o.remote_stride;
  const uint64_t outer = write ? o.local_stride2 : o.remote_stride2;
  if (o.count < 2 || o.count2 < 2 || outer >= inner) return o;
  CopyOp t = o;
  std::swap(t.count, t.count2);
  std::swap(t.local_stride, t.local_stride2);
  std::swap(t.remote_stride, t.remote_stride2);
  return t;
}

namespace {

// Every piece of a mapped op, repetition by repetition (the clock counts every piece,
// so a two-level run of small repetitions is checked every kCheckBytes too), in the
// order that reads the source forwards (source_order()).
Status copy_mapped(const CopyOp& op_as_planned, OpKind op, CopyClock& clk) {
  const CopyOp o = source_order(op_as_planned, op);
  char* remote = reinterpret_cast<char*>(o.remote);
  for (uint64_t j = 0; j < o.count2; ++j)
    PDKV_RETURN_IF_ERROR(copy_level(o, o.local + j * o.local_stride2, remote + j * o.remote_stride2, op, clk));
  return Status::Ok();
}

// Fences the streaming stores of a run_copies() however it ends (the bytes written
// before an error are the peer's to see as well).
struct FenceOnExit {
  ~FenceOnExit() { util::stream_fence(); }
};

}  // namespace

Status run_copies(const Binding& p, Transfer* xfer) {
  FenceOnExit fence;
  CopyClock clk(xfer, p.total);
  PDKV_RETURN_IF_ERROR(clk.check());  // the job may have waited in the queue past its deadline
  if (!p.cma) {
    for (const auto& o : p.ops) PDKV_RETURN_IF_ERROR(copy_mapped(o, p.op, clk));
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
      // The pid is the peer's only while its process lives: once it exited (pidfd
      // readable) the pid may be another process's, which must never be written.
      if (p.conn && p.conn->peer_exited())
        return ConnectionError("peer process " + std::to_string(p.pid) +
                               " exited; nothing more is copied to or from its pid (it may be reused)");
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
      PDKV_RETURN_IF_ERROR(clk.advance(static_cast<uint64_t>(got)));
    }
    liov.clear();
    riov.clear();
    return Status::Ok();
  };
  for (const auto& o : p.ops) {
    if (o.mapped) {
      PDKV_RETURN_IF_ERROR(copy_mapped(o, p.op, clk));
      continue;
    }
    for (uint64_t j = 0; j < o.count2; ++j) {
      char* l = o.local + j * o.local_stride2;
      const uint64_t r = o.remote + j * o.remote_stride2;
      for (uint64_t i = 0; i < o.count; ++i) {
        liov.push_back({l + i * o.local_stride, o.len});
        riov.push_back({reinterpret_cast<void*>(r + i * o.remote_stride), o.len});
        if (liov.size() == 1024) PDKV_RETURN_IF_ERROR(flush());
      }
    }
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
