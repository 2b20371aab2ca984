// libFuzzer: a Hugging Face config.json (models::parse_hf_config), then what is built from an
// accepted one without a graph: the exact parameter inventory (overflow-checked sizes), which
// must agree with the sums the parser checked, and the config written back, which must parse
// to the same config. Seeds: models/configs.
//
// The named inventory costs a few formatted strings per tensor (~1 s a million in a release
// build, ten times that here under the sanitizers), so it is listed for configs of at most
// 2^16 tensors (DeepSeek-V3 has 45,337); the parser's sums run on every input, up to its
// limit of models::kMaxParamTensors.
#include "fuzz_target.hpp"
#include "zp/models/model_spec.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return zp::fuzz::refuse_or_accept(data, size, [](std::string_view t) {
    const zp::models::ModelSpec m = zp::models::parse_hf_config(t, "config.json");
    const zp::models::ParamInventory sums =
        zp::models::count_param_totals(m, zp::models::kMaxParamTensors, "config.json");
    if (sums.n_tensors <= (int64_t{1} << 16)) {
      const zp::models::ParamInventory inv = zp::models::count_params(m);
      if (inv.total != sums.total || inv.n_tensors != sums.n_tensors ||
          static_cast<int64_t>(inv.tensors.size()) != inv.n_tensors || inv.active != sums.active ||
          inv.experts != sums.experts)
        __builtin_trap();  // the listed inventory and the parser's sums disagree
    }
    const std::string back = zp::models::to_hf_config(m);
    if (zp::models::to_hf_config(zp::models::parse_hf_config(back, "back.json")) != back)
      __builtin_trap();  // written back, read again: not the same model
  });
}
