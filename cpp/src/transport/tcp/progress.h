// An epoll thread that owns connections: accepts (thread 0 also owns the
// listener), reads them through its FrameReceiver, finishes their queued output,
// applies back-pressure and enforces their deadlines.
//
// Waking: a posting thread sends inline when a connection's queue is empty; the
// owner only hears about a connection again on EPOLLIN/EPOLLOUT, an eventfd wake()
// (kill requests, new handshakes) or its linger timer. After activity the thread
// keeps waking every 20 ms for a while (deadlines, cheap next post); a fully idle
// agent blocks in epoll_wait.
//
// Back-pressure: an inbound peer whose answers pile up (conn.h kMaxQueuedCost,
// kMaxQueuedFrames) is taken off EPOLLIN until its queue is half drained by flush().
//
// Deadlines (scan_deadlines, every 10 ms while anything is watched): an inbound
// connection must finish its hello by its deadline(); a half-received frame or stuck
// output must move within frame_timeout_s; a pending part must be answered by its
// transfer's deadline.
//
// Thread safety: start/stop from the transport's owner; add, wake, request_kill,
// enqueue, set_interest (by c, under its send lock) and watch from any thread; the
// rest runs on this thread, or on a thread holding the connection's receive lock (conn.h).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "pdkv/status.h"
#include "pdkv/transfer.h"
#include "transport/tcp/conn.h"
#include "transport/tcp/receiver.h"

namespace pdkv::tcp {

class TcpTransport;

class ProgressThread {
 public:
  ProgressThread(TcpTransport* t, uint32_t spin_us);
  ~ProgressThread();
  ProgressThread(const ProgressThread&) = delete;
  ProgressThread& operator=(const ProgressThread&) = delete;

  // `listen_fd` >= 0: this thread also accepts connections.
  Status start(int listen_fd);
  // Joins the thread, then kills every connection it owns.
  void stop();

  void wake();
  void wake_if_idle() {
    if (idle_.load(std::memory_order_acquire)) wake();
  }
  // Takes ownership of c's events. `handshake`: an inbound connection that must say
  // hello before c->deadline() (c was made with this thread as its owner).
  void add(const std::shared_ptr<TcpConn>& c, bool handshake);
  // Queues `m` on c (owned by this thread), sending at once when nothing is queued
  // (TcpConn::send); dropped if c is dead (its parts are resolved by kill()).
  void enqueue(const std::shared_ptr<TcpConn>& c, std::unique_ptr<OutMsg> m);
  // Asks this thread to kill c with c's kill_reason (or a generic one).
  void request_kill(const std::shared_ptr<TcpConn>& c);
  // Watches c for reading (`in`) and writing (`out`); called by c under its send lock.
  void set_interest(TcpConn& c, bool in, bool out);
  // Receives what c has, then records whether a frame is left half-read (its
  // deadline). Caller holds c's receive lock (TcpConn::lock_rx). `until`: see
  // FrameReceiver::receive.
  void on_readable(const std::shared_ptr<TcpConn>& c, const Transfer* until = nullptr);
  // Timeout if c has a half-read frame or stuck output that did not move for
  // frame_timeout_s; OK otherwise.
  Status frame_stalled(TcpConn& c, Clock::time_point now);
  // Sets a deadline flag of a connection (TcpConn keeps them), counting the set ones
  // so the thread keeps scanning deadlines while any is.
  void watch(std::atomic<bool>& flag, bool on) {
    if (flag.exchange(on, std::memory_order_acq_rel) != on) nwatch_.fetch_add(on ? 1 : -1, std::memory_order_acq_rel);
  }
  // Handshaking or draining connections keep the deadline scan going.
  void slow_begin() { nslow_.fetch_add(1, std::memory_order_acq_rel); }
  void slow_end() { nslow_.fetch_sub(1, std::memory_order_acq_rel); }

  // Parts pending on this thread's connections (TcpConn keeps it up to date).
  std::atomic<int64_t> npending{0};

 private:
  void run();
  // Kills the connections queued by request_kill().
  void kill_requested();
  void accept_all();
  // Out of file descriptors: accepts and closes one pending connection using the
  // spare descriptor. 1: shed one, 0: none pending, -1: no spare (or accept failed).
  int shed_one();
  void pause_listener(int err);
  void resume_listener();
  // Sends queued output until the socket is full; ends back-pressure once half drained.
  void flush(const std::shared_ptr<TcpConn>& c);
  void scan_deadlines();
  // Closes a killed connection for good once the peer stopped sending or its
  // linger time is over (caller holds c's receive lock).
  void drain(const std::shared_ptr<TcpConn>& c);

  TcpTransport* t_;
  uint32_t spin_us_;
  FrameReceiver frames_;
  int epfd_ = -1;
  int evfd_ = -1;
  int listen_fd_ = -1;
  int spare_fd_ = -1;  // held in reserve for shedding connections at the fd limit
  bool listen_paused_ = false;
  Clock::time_point listen_resume_{};
  std::thread th_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> idle_{false};
  std::mutex mu_;  // guards conns_, kill_q_, graveyard_ (a leaf lock: see conn.h)
  std::unordered_map<TcpConn*, std::shared_ptr<TcpConn>> conns_;
  std::vector<std::shared_ptr<TcpConn>> kill_q_;
  std::vector<std::shared_ptr<TcpConn>> graveyard_;  // closed this round; freed after the events loop
  std::atomic<int> nslow_{0};   // handshaking or draining connections
  std::atomic<int> nwatch_{0};  // connections with a half-read frame or stuck output
};

}  // namespace pdkv::tcp
