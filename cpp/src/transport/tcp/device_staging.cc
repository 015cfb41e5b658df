#include "transport/tcp/device_staging.h"

#include "transport/tcp/conn.h"
#include "transport/tcp/progress.h"
#include "transport/tcp/tcp_transport_impl.h"
#include "util/socket.h"
#include "util/thread_name.h"

namespace pdkv::tcp {
namespace {

constexpr double kStageWaitS = 60.0;  // a read responder waits this long for a staging buffer

}  // namespace

Result<std::shared_ptr<cuda::Stager>> DeviceStaging::stager() {
  std::lock_guard<std::mutex> lk(mu_);
  if (!stager_) {
    auto st = cuda::Stager::create(chunk_bytes_, buffers_);
    if (!st.ok()) return Status(st.status().code(), "tcp cannot stage device memory: " + st.status().message());
    stager_ = std::move(st).value();
  }
  return stager_;
}

void DeviceStaging::run(std::function<void()> f) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!stop_) {
      if (!th_.joinable()) th_ = std::thread([this] { loop(); });
      queue_.push_back(std::move(f));
      cv_.notify_one();
      return;
    }
  }
  f();  // shutting down: the task fails at once on this thread
}

void DeviceStaging::stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (th_.joinable()) th_.join();
}

void DeviceStaging::loop() {
  util::name_this_thread("pdkv-dev-stage");
  for (;;) {
    std::function<void()> f;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      f = std::move(queue_.front());
      queue_.pop_front();
    }
    f();
  }
}

Result<std::shared_ptr<cuda::PinnedBuffer>> DeviceStaging::gather(int device, const iovec* src, size_t n,
                                                                  Clock::time_point deadline,
                                                                  const std::function<bool()>& abandon) {
  PDKV_ASSIGN_OR_RETURN(auto st, stager());
  PDKV_ASSIGN_OR_RETURN(auto buf, st->acquire(device, deadline, abandon));
  Status g = st->gather(device, src, n, buf->data());
  if (!g.ok()) return g.with_context("copying device memory into the staging buffer");
  return buf;
}

void DeviceStaging::respond_read(const std::shared_ptr<TcpConn>& c, const FrameHeader& h, std::vector<iovec> src,
                                 std::vector<RegionPin> pins, GenPin gens, uint64_t bytes, int device) {
  struct Job {
    std::vector<iovec> src;
    std::vector<RegionPin> pins;
    GenPin gens;  // held until the bytes are gathered (the job ends)
  };
  auto job = std::make_shared<Job>(Job{std::move(src), std::move(pins), std::move(gens)});
  run([this, c, h, job, bytes, device] {
    auto fail = [&](const Status& st) {
      if (!c->owner()) return;
      auto rl = c->lock_rx();
      if (c->open())
        t_.fail_conn_locked(c, Status(st.code(), "read request from " + c->desc() + " failed: " + st.message()),
                            h.xfer_id, h.batch);
    };
    auto dead = [&] { return c->is_dead() || t_.shutting_down(); };
    if (dead()) return;
    auto st = stager();
    if (!st.ok()) return fail(st.status());
    // A response larger than a pooled chunk gets a buffer of its own.
    auto buf = bytes <= (*st)->chunk() ? (*st)->acquire(device, util::deadline_after(kStageWaitS), dead)
                                       : (*st)->allocate(device, bytes);
    if (!buf.ok()) return fail(buf.status());
    Status g = (*st)->gather(device, job->src.data(), job->src.size(), (*buf)->data());
    if (!g.ok()) return fail(g.with_context("copying device memory into the staging buffer"));
    auto m = std::make_unique<OutMsg>();
    m->hdr = make_hdr(FrameType::kReadResp, h.xfer_id, h.batch);
    m->hdr.payload = bytes;
    m->own_iov.push_back({(*buf)->data(), bytes});
    m->lease = std::move(buf).value();
    m->pins = std::move(job->pins);
    m->finalize();
    c->owner()->enqueue(c, std::move(m));
  });
}

}  // namespace pdkv::tcp
