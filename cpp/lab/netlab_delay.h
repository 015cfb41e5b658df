// The delay line of `pdkv netlab` on kernels without sch_netem: a userspace bridge
// port that holds every frame for a fixed time.
//
// For each host link (a veth end in the lab's switch namespace, taken out of the
// bridge) it opens a TAP device "d-<link>" (that the lab plugs into the bridge
// instead) and a raw packet socket on the veth, and forwards frames both ways after
// `one_way_delay_s`. Both ends carry virtio-net headers, so TCP's 64 KiB GSO frames
// cross as one frame, with their checksum-offload state, instead of being cut into
// 1,514-byte packets. Each direction queues at most `queue_limit_bytes` (netem's
// `limit`); a frame that does not fit is dropped and counted, as a full router
// queue would. Rate limits stay in the kernel (htb on the veth ends).
//
// Linux only; needs CAP_NET_ADMIN and CAP_NET_RAW in the switch namespace.
// Thread safety: open() and run() from one thread; run() starts one thread per link
// and returns when `stop_fd` becomes readable (every thread joined).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <pybind11/pybind11.h>

namespace netlab {

struct LinkCounters {
  std::string link;
  uint64_t frames_to_host = 0, frames_from_host = 0;
  uint64_t bytes_to_host = 0, bytes_from_host = 0;
  uint64_t dropped = 0;  // queue full, a frame larger than the buffer, or a refused send
};

class DelayLine {
 public:
  // Opens the TAP devices and raw sockets (throws std::runtime_error naming what failed).
  DelayLine(const std::vector<std::string>& links, double one_way_delay_s, uint64_t queue_limit_bytes);
  ~DelayLine();
  DelayLine(const DelayLine&) = delete;
  DelayLine& operator=(const DelayLine&) = delete;

  // The TAP device of each link, in the order of `links`.
  std::vector<std::string> taps() const;
  // Forwards until `stop_fd` is readable.
  void run(int stop_fd);
  // Counters so far (safe once run() returned; approximate while it runs).
  std::vector<LinkCounters> counters() const;

 private:
  struct Port;
  std::vector<std::unique_ptr<Port>> ports_;
  int64_t delay_ns_;
  uint64_t limit_;
};

// Binds DelayLine into `m` (the `pdkv.lab._pdkv_lab.netlab` submodule).
void bind(pybind11::module_& m);

}  // namespace netlab
