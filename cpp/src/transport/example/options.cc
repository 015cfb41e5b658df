// InprocOptions::validate (options.h).
#include "transport/example/options.h"

#include "util/option_check.h"

namespace pdkv::inproc {

Status InprocOptions::validate() const {
  PDKV_RETURN_IF_ERROR(util::check_in_range<uint64_t>("inproc.max_extents", max_extents, 1, (1ull << 32) - 1));
  PDKV_RETURN_IF_ERROR(util::check_in_range<uint32_t>("inproc.max_queued", max_queued, 1, 1u << 20));
  return Status::Ok();
}

}  // namespace pdkv::inproc
