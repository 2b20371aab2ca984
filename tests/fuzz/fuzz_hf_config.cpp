// libFuzzer: a Hugging Face config.json (models::parse_hf_config), then what is built from an
// accepted one without a graph: the exact parameter inventory (overflow-checked sizes) and the
// config written back, which must parse to the same config. Seeds: models/configs.
#include "fuzz_target.hpp"
#include "zp/models/model_spec.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return zp::fuzz::refuse_or_accept(data, size, [](std::string_view t) {
    const zp::models::ModelSpec m = zp::models::parse_hf_config(t, "config.json");
    (void)zp::models::count_params(m);
    const std::string back = zp::models::to_hf_config(m);
    if (zp::models::to_hf_config(zp::models::parse_hf_config(back, "back.json")) != back)
      __builtin_trap();  // written back, read again: not the same model
  });
}
