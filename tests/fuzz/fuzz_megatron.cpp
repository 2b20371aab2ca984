// libFuzzer: a Megatron-LM command line (planner::parse_megatron_args).
#include "fuzz_target.hpp"
#include "zp/planner/megatron_args.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return zp::fuzz::refuse_or_accept(data, size, [](std::string_view t) {
    (void)zp::planner::parse_megatron_args(t);
  });
}
