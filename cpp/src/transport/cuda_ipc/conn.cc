// cuda_ipc's control connections: writing a frame, dialing an exporter (conn.h).
#include "transport/cuda_ipc/conn.h"

#include <mutex>

namespace pdkv::cuda_ipc {

Status send_ctl(CtlConn& c, Ctl type, uint64_t id, std::string_view aux, uint32_t status) {
  CtlHdr h{kCtlMagic, static_cast<uint16_t>(type), 0, id, static_cast<uint32_t>(aux.size()), status};
  std::string frame(reinterpret_cast<const char*>(&h), sizeof h);
  frame.append(aux);
  std::lock_guard<std::mutex> lk(c.wmu);
  return util::send_all(c.fd.get(), frame.data(), frame.size(), util::deadline_after(kCtlTimeoutS));
}

Result<util::ScopedFd> dial_ctl(const std::string& path, Clock::time_point deadline) {
  // The path comes from the peer's metadata: a bad one is the peer's protocol error.
  if (path.empty() || path.size() >= sizeof(sockaddr_un{}.sun_path))
    return ProtocolError("bad control socket path '" + path + "'");
  return util::connect_unix(path, deadline);
}

}  // namespace pdkv::cuda_ipc
