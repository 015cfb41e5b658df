// ShmOptions::validate (pdkv/options/shm.h).
#include "pdkv/options/shm.h"

#include "util/option_check.h"

namespace pdkv {

namespace {
constexpr uint32_t kMaxCopyThreads = 64;
}  // namespace

Status ShmOptions::validate() const {
  return util::check_in_range<uint32_t>("shm.copy_threads", copy_threads, 1, kMaxCopyThreads);
}

}  // namespace pdkv
