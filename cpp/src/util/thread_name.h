// Names the calling thread so that `top -H`, gdb, perf and /proc/<pid>/task/*/comm
// show which of pdkv's threads is which. Every thread pdkv starts calls this first;
// names start with "pdkv-" (tests/library/test_agent.py measures the idle CPU of exactly
// those threads). Linux limits a name to 15 bytes; a longer one is cut, never an error.
// It also moves the thread onto the CPUs pdkv.set_thread_cpus() chose, if any
// (util/thread_cpus.h).
#pragma once

#include <pthread.h>

#include <cstring>

#include "util/thread_cpus.h"

namespace pdkv::util {

inline void name_this_thread(const char* name) {
  char buf[16];
  std::strncpy(buf, name, sizeof(buf) - 1);
  buf[sizeof(buf) - 1] = '\0';
  pthread_setname_np(pthread_self(), buf);
  apply_thread_cpus();
}

}  // namespace pdkv::util
