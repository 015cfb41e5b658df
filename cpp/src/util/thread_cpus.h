// The CPUs pdkv's own threads run on (process-wide; pdkv.set_thread_cpus).
//
// By default a thread inherits the affinity of the thread that starts it, so an engine
// that binds its worker thread to one core (vLLM's CPU backend, OpenMP pinning) gets
// pdkv's progress, copy and codec threads on that same core, competing with its
// compute. set_thread_cpus() gives them their own set instead, like the cores
// NixlConnector reserves for KV transfer; every thread pdkv starts afterwards applies
// it first (name_this_thread). Threads already running keep their affinity.
#pragma once

#include <vector>

#include "pdkv/status.h"

namespace pdkv::util {

// `cpus` empty: inherit again (the default). Otherwise every CPU must be in
// [0, CPU_SETSIZE) and the set must be one the kernel lets a thread of this process
// use (checked by applying it on a short-lived thread): InvalidArgument names the
// problem, and nothing changes.
Status set_thread_cpus(const std::vector<int>& cpus);
// The set in force (sorted, no duplicates), empty when threads inherit.
std::vector<int> thread_cpus();
// Applies the set to the calling thread (no-op when empty). A refusal (the process's
// cpuset shrank since) is logged once as a warning and the thread keeps running.
void apply_thread_cpus();

}  // namespace pdkv::util
