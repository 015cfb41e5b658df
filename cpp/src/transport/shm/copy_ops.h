// Building a Binding's CopyOps from the resolved runs of a prepared transfer: each
// run is checked whole against the region the peer confirmed (first byte to the end
// of its last piece, overflow-safe), then becomes one op where it can: a plain
// extent, a one-level strided run or a two-level run lying wholly inside the peer's
// mapped window is one memcpy op, one lying wholly outside it one cross-memory
// attach op; only a run that straddles the window's edge is cut: into its
// repetitions, and a repetition that straddles it into its pieces. The work is per
// run, never per piece, except for such a straddling repetition.
//
// Thread safety: pure functions of their arguments (the Binding is the caller's).
#pragma once

#include <cstdint>
#include <string>

#include "pdkv/spi/transport.h"
#include "pdkv/status.h"
#include "transport/shm/copy_engine.h"

namespace pdkv::shm {

// Appends the copies of run `e` of the peer's region `r` (index `idx` in
// b.regions) to b; OutOfRange naming `peer` when any byte of the run falls outside
// r as confirmed, NotSupported when a byte outside r's mapped window needs
// cross-memory attach and the kernel refuses it.
Status add_run_ops(Binding& b, const RemoteRegion& r, uint32_t idx, const ResolvedExtent& e, const std::string& peer);

}  // namespace pdkv::shm
