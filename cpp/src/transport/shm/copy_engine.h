// The copies of the shm transport: a transfer bound to a connection (Binding) is a
// list of CopyOps, each one memcpy into or out of a region the peer mapped for us,
// or a cross-memory attach (process_vm_writev/readv) batch for a region it could
// not share. Small transfers run inline in the posting thread; larger ones are Jobs
// queued for the copy threads (CopyEngine).
//
// Thread safety: run_copies is reentrant; CopyEngine's methods may be called from
// any thread.
#pragma once

#include <sys/types.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "pdkv/status.h"
#include "pdkv/transfer.h"
#include "transport/shm/conn.h"

namespace pdkv::shm {

// `count2` x `count` copies of `len` bytes, copy (j, i) between
// local + j * local_stride2 + i * local_stride and remote + j * remote_stride2 +
// i * remote_stride (a strided run of a heterogeneous transfer, one or two levels:
// one op per run, not per piece; count 1 and count2 1 is one plain copy).
struct CopyOp {
  char* local;
  uint64_t remote;  // mapped pointer (mapped) or the peer's address
  uint64_t len;
  uint32_t region;  // index into Binding::regions
  bool mapped;      // memcpy through our mapping, else cross-memory attach
  uint64_t count = 1;
  uint64_t local_stride = 0;
  uint64_t remote_stride = 0;
  uint64_t count2 = 1;
  uint64_t local_stride2 = 0;
  uint64_t remote_stride2 = 0;
};

// `o` with its two levels swapped when its outer level steps through the source
// (local for a write, remote for a read) by less than its inner level, so the copy
// reads the source in address order: an NHD -> HND copy of a block (a piece per token
// per head) as planned walks one head's 16 tokens at the token stride, then the next
// head 256 B further; swapped, it reads the block front to back and writes 8
// destination streams. The same pieces either way. Measured on the 2-core dev VM
// (AMD EPYC, Zen 4), 16 tokens x 8 heads x 256 B blocks, 64 MiB and 1 GiB, 64-byte
// streaming stores, one fence per block: 1.36x the homogeneous memcpy's CPU as
// planned, 0.95-1.07x swapped.
CopyOp source_order(const CopyOp& o, OpKind op);

// A prepared transfer bound to one connection and the regions confirmed on it.
struct Binding {
  std::shared_ptr<ShmConn> conn;
  OpKind op = OpKind::kWrite;
  std::vector<CopyOp> ops;
  std::vector<std::shared_ptr<RemoteRegion>> regions;
  bool cma = false;  // some op is a cross-memory attach
  pid_t pid = 0;     // the peer, for cross-memory attach
  uint64_t total = 0;
};

// One posted transfer waiting for, or in, its copy.
struct Job {
  std::shared_ptr<const Binding> b;
  std::shared_ptr<Transfer> xfer;
  std::string notif;
  uint64_t lease = 0;  // a granted block generation lease to end after the copy, 0: none
};

// Copies every byte of `b` (the regions are pinned by the caller). With `xfer`, the
// copy stops early, with TimeoutError or Cancelled, once the transfer's deadline has
// passed or it was cancelled (checked every few MiB; bytes already copied stay).
Status run_copies(const Binding& b, Transfer* xfer = nullptr);

// A queue of Jobs and the threads that take them in order.
class CopyEngine {
 public:
  // `run` handles one job on a copy thread (copies it, or fails a cancelled one).
  explicit CopyEngine(std::function<void(Job&)> run) : run_(std::move(run)) {}
  ~CopyEngine() { stop(); }
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  void start(uint32_t threads);
  void submit(Job job);
  // Lets the threads finish the queue and joins them; returns the jobs submitted
  // too late for them (the caller fails those).
  std::deque<Job> stop();

 private:
  void loop();

  std::function<void(Job&)> run_;
  std::mutex mu_;  // guards queue_ and stop_
  std::condition_variable cv_;
  std::deque<Job> queue_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace pdkv::shm
