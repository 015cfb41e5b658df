// InprocOptions: the options of the `inproc` example transport, registered with its
// factory (inproc_transport.cc, default_options_of<InprocOptions>). An agent gets them
// in AgentConfig::options (c.options.edit<InprocOptions>().max_extents = 64); without
// them the defaults apply. A transport others would configure from Python puts this
// struct in cpp/include/pdkv/options/<name>.h and binds it (cpp/bindings/py_options.cc),
// as tcp and shm do; the example keeps it private to its folder.
//
// Thread safety: a plain value.
#pragma once

#include <cstdint>
#include <string_view>

#include "pdkv/options/transport_options.h"
#include "pdkv/status.h"

namespace pdkv::inproc {

struct InprocOptions : TransportOptionsOf<InprocOptions> {
  static constexpr std::string_view kTransport = "inproc";

  // A transfer of more extents is refused by prepare (InvalidArgument): each extent
  // is one memcpy under the target's lock. 1..2^32-1.
  uint64_t max_extents = 1u << 20;
  // Posts queued on the copy thread beyond this many fail at once (ResourceExhausted)
  // instead of growing the queue without bound. 1..2^20.
  uint32_t max_queued = 4096;

  // OK, or InvalidArgument naming the field ("inproc.max_extents must be in ...").
  Status validate() const override;
};

}  // namespace pdkv::inproc
