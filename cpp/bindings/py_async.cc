// CompletionQueue: how `await transfer` waits without a thread per waiter.
//
// One queue per asyncio event loop (python/pdkv/agent.py keeps them). `watch(t)`
// hands out a ticket and asks the transfer to push it when terminal
// (Transfer::on_terminal); the push runs on whichever C++ thread completes the
// transfer, takes no GIL, and makes the queue's eventfd readable. The event loop
// watches that fd (loop.add_reader) and calls `take()`, which returns the tickets of
// the transfers finished since the last call and re-arms the fd.
#include "py_async.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <pybind11/stl.h>

#include "pdkv/spi/transfer_control.h"
#include "pdkv/transfer.h"

namespace py = pybind11;

namespace pdkv {
namespace {

class CompletionQueue : public std::enable_shared_from_this<CompletionQueue> {
 public:
  CompletionQueue() : fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
    if (fd_ < 0) throw std::runtime_error(std::string("eventfd: ") + std::strerror(errno));
  }
  ~CompletionQueue() { ::close(fd_); }
  CompletionQueue(const CompletionQueue&) = delete;
  CompletionQueue& operator=(const CompletionQueue&) = delete;

  int fd() const { return fd_; }

  // The ticket that take() returns once `t` is terminal (at the next take() if it
  // already is). The transfer holds the queue alive until then.
  uint64_t watch(Transfer& t) {
    uint64_t ticket;
    {
      std::lock_guard<std::mutex> lk(mu_);
      ticket = next_ticket_++;
    }
    spi::TransferControl(t).on_terminal([q = shared_from_this(), ticket] { q->push(ticket); });
    return ticket;
  }

  // Tickets finished since the last call; the fd stays readable only while some are queued.
  std::vector<uint64_t> take() {
    std::vector<uint64_t> out;
    std::lock_guard<std::mutex> lk(mu_);
    uint64_t counter;
    while (::read(fd_, &counter, sizeof counter) < 0 && errno == EINTR) {
    }
    out.swap(done_);
    return out;
  }

 private:
  void push(uint64_t ticket) {
    std::lock_guard<std::mutex> lk(mu_);
    done_.push_back(ticket);
    if (done_.size() == 1) {  // the first since take(): wake the loop
      const uint64_t one = 1;
      while (::write(fd_, &one, sizeof one) < 0 && errno == EINTR) {
      }
    }
  }

  const int fd_;
  std::mutex mu_;
  uint64_t next_ticket_ = 1;   // guarded by mu_
  std::vector<uint64_t> done_;  // guarded by mu_
};

}  // namespace

void bind_async(py::module_& m) {
  py::class_<CompletionQueue, std::shared_ptr<CompletionQueue>>(
      m, "CompletionQueue", "Wakes one asyncio event loop when watched transfers finish (see Transfer.wait_async).")
      .def(py::init<>())
      .def_property_readonly("fd", &CompletionQueue::fd, "eventfd, readable while finished tickets are queued.")
      .def("watch", [](CompletionQueue& q, Transfer& t) { return q.watch(t); }, py::arg("transfer"),
           "A ticket that take() returns once the transfer is terminal.")
      .def("take", &CompletionQueue::take, "Tickets of the watched transfers finished since the last call.");
}

}  // namespace pdkv
