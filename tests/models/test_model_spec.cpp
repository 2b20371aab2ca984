// Model catalog and parameter counts against the counts the checkpoints' publishers give,
// and the HF config reader's handling of bad input.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

#include "error_of.hpp"
#include "zp/error.hpp"
#include "zp/models/model_spec.hpp"

using namespace zp::models;

namespace {
int64_t params_of(const std::string& name) { return count_params(load_model(name)).total; }

using zp::test::error_of;
}  // namespace

TEST_CASE("catalog counts equal the published Hugging Face parameter counts") {
  // Published: the model cards / sum(p.numel()) of the HF checkpoints (issue 2 quotes the first
  // three); tied GPT-2 heads are counted once, untied LLaMA heads separately.
  CHECK(params_of("gpt2") == 124'439'808);
  CHECK(params_of("gpt2-xl") == 1'557'611'200);
  CHECK(params_of("llama-2-7b") == 6'738'415'616);
  CHECK(params_of("gpt2-medium") == 354'823'168);
  CHECK(params_of("gpt2-large") == 774'030'080);
  CHECK(params_of("llama-2-13b") == 13'015'864'320);
  CHECK(params_of("llama-2-70b") == 68'976'648'192);
  for (const auto& e : catalog()) {
    if (e.published_params == 0) continue;
    CAPTURE(e.name);
    CHECK(params_of(e.name) == e.published_params);
  }
}

TEST_CASE("papers' models land on their nominal sizes") {
  // Nominal sizes as the papers state them (rounded there, so within 1%).
  auto near = [](const std::string& n, double nominal) {
    const double got = static_cast<double>(params_of(n));
    CAPTURE(n);
    CHECK(std::fabs(got - nominal) / nominal < 0.01);
  };
  near("megatron-8.3b", 8.3e9);
  near("turing-nlg-17b", 17.2e9);
  near("gpt3-175b", 175e9);
  // DeepSeek-V3's report: 671B total (the MTP module apart), 37B activated per token.
  near("deepseek-v3", 671e9);
  const auto ds = count_params(load_model("deepseek-v3"));
  CHECK(std::fabs(double(ds.active) - 37e9) / 37e9 < 0.02);
  // Its MTP module (V3 report sec. 2.2), counted by hand from the config: one MoE block (MLA:
  // q_a, q_a_norm, q_b, kv_a, kv_a_norm, kv_b, o; two norms; router; 256 routed and one shared
  // expert of 3 x 2048 x 7168), enorm and hnorm, eh_proj (7168 x 14336), the head's norm.
  const int64_t C = 7168;
  const int64_t mla = 1536 * C + 1536 + 24576 * 1536 + 576 * C + 512 + 32768 * 512 + C * 16384;
  const int64_t moe_block = mla + 2 * C + 256 * C + 257 * 3 * 2048 * C;
  CHECK(ds.mtp == moe_block + 3 * C + 2 * C * C);
  // The published "671B + 14B MTP" counts the MTP's own copies of the embedding and head.
  CHECK(std::fabs(double(ds.mtp + 2 * 129280 * C) - 14e9) / 14e9 < 0.05);
}

TEST_CASE("published totals of families outside the catalog") {
  // GPT-NeoX-20B (Black et al. 2022; HF EleutherAI/gpt-neox-20b): 20,554,567,680 parameters,
  // from a config written here from the published shape.
  const auto m = parse_hf_config(R"({"model_type":"gpt_neox","hidden_size":6144,
      "intermediate_size":24576,"num_hidden_layers":44,"num_attention_heads":64,
      "max_position_embeddings":2048,"rotary_pct":0.25,"vocab_size":50432,
      "use_parallel_residual":true,"tie_word_embeddings":false})", "neox");
  CHECK(count_params(m).total == 20'554'567'680);
  // facebook/opt-350m, post-LN (do_layer_norm_before false, so no final LayerNorm), its
  // 512-wide embeddings projected in and out: 331,196,416 parameters (the checkpoint's
  // sum of numel). By hand: 50272 x 512 embeddings, (2048 + 2) x 1024 positions, 2 x 512 x
  // 1024 projections without bias, 24 x (4 x (1024^2 + 1024) + 2 x 2048 + 1024 x 4096 + 4096
  // + 4096 x 1024 + 1024).
  const auto opt = parse_hf_config(R"({"model_type":"opt","hidden_size":1024,"ffn_dim":4096,
      "num_hidden_layers":24,"num_attention_heads":16,"max_position_embeddings":2048,
      "word_embed_proj_dim":512,"do_layer_norm_before":false,"vocab_size":50272})", "opt-350m");
  const int64_t by_hand = 50272LL * 512 + 2050LL * 1024 + 2LL * 512 * 1024 +
                          24LL * (4 * (1024LL * 1024 + 1024) + 2 * 2048 + 1024LL * 4096 + 4096 +
                                  4096LL * 1024 + 1024);
  CHECK(by_hand == 331'196'416);
  CHECK(count_params(opt).total == 331'196'416);
  // Mixture of experts: active = total minus the (E - k) of E routed experts a token skips.
  const auto q = count_params(load_model("qwen3-30b-a3b"));
  CHECK(q.experts == 48LL * 128 * 3 * 2048 * 768);
  CHECK(q.active == q.total - q.experts / 128 * (128 - 8));
}

TEST_CASE("per-tensor inventory: shapes as Hugging Face stores them") {
  const auto inv = count_params(load_model("gpt2"));
  auto find = [&](const std::string& name) -> const ParamTensor& {
    for (const auto& t : inv.tensors)
      if (t.name == name) return t;
    FAIL("missing tensor " << name);
    throw;
  };
  CHECK(find("transformer.wte.weight").shape == std::vector<int64_t>{50257, 768});
  CHECK(find("transformer.wpe.weight").shape == std::vector<int64_t>{1024, 768});
  CHECK(find("transformer.h.0.attn.c_attn.weight").shape == std::vector<int64_t>{768, 2304});
  CHECK(find("transformer.h.11.mlp.c_proj.weight").shape == std::vector<int64_t>{3072, 768});
  CHECK(find("transformer.ln_f.bias").numel == 768);
  // 2 embeddings + 12 blocks of 12 tensors + 2 for ln_f, as in the HF state dict (no lm_head).
  CHECK(inv.tensors.size() == 2 + 12 * 12 + 2);
  CHECK(inv.largest_module == "transformer.wte");
  CHECK(inv.largest_module_params == 50257 * 768);
  CHECK(inv.head == 0);

  const auto l70 = count_params(load_model("llama-2-70b"));
  const ParamTensor* k = nullptr;
  for (const auto& t : l70.tensors)
    if (t.name == "model.layers.0.self_attn.k_proj.weight") k = &t;
  REQUIRE(k != nullptr);
  CHECK(k->shape == std::vector<int64_t>{1024, 8192});  // 8 KV heads x 128
  CHECK(l70.tensors.size() == 1 + 80 * 9 + 1 + 1);
  CHECK(l70.head == 32000 * 8192);
}

TEST_CASE("inventory parts add up") {
  for (const auto& e : catalog()) {
    const auto m = parse_hf_config(e.config, e.name);
    const auto inv = count_params(m);
    int64_t sum = 0;
    for (const auto& t : inv.tensors) sum += t.numel;
    CAPTURE(e.name);
    CHECK(sum == inv.total);
    // Blocks summed by their layer index; identical blocks (no MoE, no encoder-decoder) are
    // n_layer times the last one.
    int64_t blocks = 0, outside = 0;
    for (const auto& t : inv.tensors)
      (t.layer >= 0 && t.layer < m.n_blocks() ? blocks : outside) += t.numel;
    CHECK(blocks + outside == inv.total);
    if (!m.is_moe() && !m.encoder_decoder()) {
      CHECK(blocks == m.n_layer * inv.per_layer);
      CHECK(inv.embedding + inv.final_norm + inv.head == outside);
    }
    // The sums without the list (what the parser checks) are the listed inventory's.
    const auto sums = count_param_totals(m, kMaxParamTensors, e.name);
    CHECK(sums.tensors.empty());
    CHECK(sums.n_tensors == static_cast<int64_t>(inv.tensors.size()));
    CHECK(inv.n_tensors == sums.n_tensors);
    CHECK(sums.total == inv.total);
    CHECK(sums.per_layer == inv.per_layer);
    CHECK(sums.embedding == inv.embedding);
    CHECK(sums.head == inv.head);
    CHECK(sums.final_norm == inv.final_norm);
    CHECK(sums.experts == inv.experts);
    CHECK(sums.active == inv.active);
    CHECK(sums.mtp == inv.mtp);
  }
}

TEST_CASE("a config of more parameter tensors than kMaxParamTensors is refused at once") {
  // DeepSeek-V3 by hand: 3 dense layers of 12 tensors (MLA's q_a, q_a_norm, q_b, kv_a,
  // kv_a_norm, kv_b, o; two norms; gate, up, down) and 58 MoE layers of 7 + 2 + the router +
  // 256 experts x 3 + the shared expert's 3 = 781; the embedding, final norm and untied head.
  const auto v3 = load_model("deepseek-v3");
  CHECK(count_param_totals(v3, kMaxParamTensors, "v3").n_tensors == 3 * 12 + 58 * 781 + 3);
  CHECK(count_params(v3).tensors.size() == 3 * 12 + 58 * 781 + 3);
  // One tensor over a limit is refused; exactly at it is not.
  CHECK(count_param_totals(v3, 45337, "v3").n_tensors == 45337);
  CHECK(error_of([&] { count_param_totals(v3, 45336, "v3"); })
            .find("v3: 61 layers of 256 experts make more than 45336 parameter tensors") == 0);
  // A gpt2 config of 10^8 layers would list 1.2e9 tensors (minutes, then out of memory): the
  // parser stops at the limit, naming the field to check.
  const std::string gpt2_deep = R"({"model_type":"gpt2","n_embd":64,"n_head":4,"n_layer":100000000,
      "vocab_size":100,"n_positions":64})";
  auto parse = [&] { parse_hf_config(gpt2_deep, "deep.json"); };
  CHECK(error_of(parse).find("deep.json: 100000000 layers make more than 1048576 parameter tensors") == 0);
  CHECK(zp::test::hint_of(parse).find("check the layer count (num_hidden_layers, n_layer):") == 0);
}

TEST_CASE("config reader: families and fields") {
  const auto m = parse_hf_config(R"({"model_type":"llama","hidden_size":64,"intermediate_size":176,
      "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100,
      "tie_word_embeddings":true,"attention_bias":true})", "cfg");
  CHECK(m.model_type == "llama");
  CHECK(m.n_kv_head == 2);
  CHECK(m.head_dim == 16);
  const auto inv = count_params(m);
  // Independent count: embed 100*64; per block q,o 64*64+64, k,v 64*32+32, gate/up/down
  // 3*64*176, two norms 2*64; final norm 64; tied head.
  const int64_t block = 2 * (64 * 64 + 64) + 2 * (64 * 32 + 32) + 3 * 64 * 176 + 2 * 64;
  CHECK(inv.total == 100 * 64 + 2 * block + 64);

  const auto g = parse_hf_config(R"({"model_type":"gpt2","n_embd":8,"n_layer":1,"n_head":2,
      "n_positions":16,"vocab_size":10,"n_inner":null})", "cfg");
  CHECK(g.n_inner == 32);
}

TEST_CASE("config reader: bad input names the field") {
  CHECK(error_of([] { parse_hf_config(R"({"model_type":"mamba"})", "c.json"); })
            .find("unknown model_type 'mamba'") != std::string::npos);
  CHECK(error_of([] { parse_hf_config(R"({"model_type":"gpt2","n_embd":"768","n_layer":1,
                                        "n_head":1})", "c.json"); })
            .find("field 'n_embd' must be a positive integer, got \"768\"") != std::string::npos);
  CHECK(error_of([] { parse_hf_config(R"({"model_type":"gpt2","n_embd":10,"n_layer":1,
                                        "n_head":3})", "c.json"); })
            .find("n_embd 10 is not divisible by n_head 3") != std::string::npos);
  CHECK(error_of([] { parse_hf_config(R"({"model_type":"llama","hidden_size":64,
      "intermediate_size":1,"num_hidden_layers":1,"num_attention_heads":4,
      "num_key_value_heads":3})", "c.json"); })
            .find("not divisible by num_key_value_heads 3") != std::string::npos);
  CHECK(error_of([] { parse_hf_config(R"({"model_type":"gpt2","n_embd":8,"n_layer":1,
                                        "n_head":1,"num_experts":8})", "c.json"); })
            .find("unknown field 'num_experts'") != std::string::npos);
  CHECK(error_of([] { parse_hf_config(R"({"model_type":"gpt2","n_embd":8,)", "c.json"); })
            .find("c.json: invalid JSON") != std::string::npos);
  CHECK(error_of([] { parse_hf_config(R"({"n_embd":8})", "c.json"); })
            .find("missing field 'model_type'") != std::string::npos);
  CHECK(error_of([] { parse_hf_config(R"({"model_type":"gpt2","n_layer":1,"n_head":1})",
                                      "c.json"); })
            .find("missing field 'n_embd'") != std::string::npos);
  CHECK(error_of([] { parse_hf_config(R"({"model_type":"gpt2","n_embd":8,"n_layer":-2,
                                        "n_head":1})", "c.json"); })
            .find("field 'n_layer' must be a positive integer, got -2") != std::string::npos);
  // Sizes whose counts overflow 64 bits are refused at the door.
  CHECK(error_of([] { parse_hf_config(R"({"model_type":"gpt2","n_embd":4294967296,
      "n_layer":1,"n_head":1,"vocab_size":4294967296})", "c.json"); })
            .find("overflows 64 bits") != std::string::npos);
}

TEST_CASE("config reader: bad shapes of the new families name the field") {
  // Heads that do not divide, key/value heads that do not divide heads, more experts per token
  // than experts, negative and overflowing sizes: one error naming the field.
  CHECK(error_of([] { parse_hf_config(R"({"model_type":"qwen2","hidden_size":100,
      "intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":3})", "c.json"); })
            .find("hidden_size 100 is not divisible by num_attention_heads 3") != std::string::npos);
  CHECK(error_of([] { parse_hf_config(R"({"model_type":"mistral","hidden_size":64,
      "intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":8,
      "num_key_value_heads":3})", "c.json"); })
            .find("num_attention_heads 8 is not divisible by num_key_value_heads 3") !=
        std::string::npos);
  CHECK(error_of([] { parse_hf_config(R"({"model_type":"mixtral","hidden_size":64,
      "intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":8,
      "num_local_experts":4,"num_experts_per_tok":5})", "c.json"); })
            .find("num_experts_per_tok 5 is larger than num_local_experts 4") != std::string::npos);
  CHECK(error_of([] { parse_hf_config(R"({"model_type":"deepseek_v3","hidden_size":64,
      "intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":8,
      "n_routed_experts":2,"num_experts_per_tok":3,"moe_intermediate_size":8})", "c.json"); })
            .find("num_experts_per_tok 3 is larger than n_routed_experts 2") != std::string::npos);
  CHECK(error_of([] { parse_hf_config(R"({"model_type":"t5","d_model":-512})", "c.json"); })
            .find("field 'd_model' must be a positive integer, got -512") != std::string::npos);
  CHECK(error_of([] { parse_hf_config(R"({"model_type":"qwen3_moe","hidden_size":4294967296,
      "intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":1,"head_dim":1,
      "num_experts":4294967296,"moe_intermediate_size":4294967296,"num_experts_per_tok":1})",
                                      "c.json"); })
            .find("overflows 64 bits") != std::string::npos);
  // An unknown field that could change the size is refused; one that cannot is noted.
  CHECK(error_of([] { parse_hf_config(R"({"model_type":"llama","hidden_size":64,
      "intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":8,
      "num_vision_layers":4})", "c.json"); })
            .find("unknown field 'num_vision_layers' for model_type 'llama'") != std::string::npos);
  const ModelSpec m = parse_hf_config(R"({"model_type":"llama","hidden_size":64,
      "intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":8,
      "my_tokenizer_note":"x","quantization_config":{"quant_method":"fp8"}})", "c.json");
  REQUIRE(m.notes.size() == 2);
  CHECK(m.notes[0].find("quantization_config (fp8) ignored") != std::string::npos);
  CHECK(m.notes[1].find("my_tokenizer_note") != std::string::npos);
  // Multimodal wrappers say what to do.
  CHECK(error_of([] { parse_hf_config(R"({"model_type":"gemma3","text_config":{},
      "vision_config":{}})", "c.json"); })
            .find("multimodal") != std::string::npos);
}

TEST_CASE("--model DIR reads DIR/config.json, as save_pretrained writes it") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / "zp_test_model_dir";
  fs::create_directories(dir);
  {
    std::ofstream f(dir / "config.json");
    for (const auto& e : catalog())
      if (e.name == "gpt2") f << e.config;
  }
  CHECK(count_params(load_model(dir.string())).total == 124'439'808);
  fs::remove(dir / "config.json");
  CHECK(error_of([&] { load_model(dir.string()); }).find("holds no config.json") !=
        std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("unknown names suggest the closest catalog names") {
  zp::Error err("");
  try {
    load_model("lama-2-7b");
    FAIL("expected an error");
  } catch (const zp::Error& e) {
    CHECK(std::string(e.what()).find("unknown model 'lama-2-7b'") != std::string::npos);
    CHECK(e.hint().find("llama-2-7b") != std::string::npos);
  }
  CHECK(closest_catalog_names("gpt-2", 1) == std::vector<std::string>{"gpt2"});
  CHECK(error_of([] { load_model("/no/such/config.json"); }).find("no such file") !=
        std::string::npos);
}

namespace {
// bert-base-uncased's published config.json (google-bert/bert-base-uncased): BertForMaskedLM.
constexpr const char* kBertBase = R"({"architectures":["BertForMaskedLM"],
    "attention_probs_dropout_prob":0.1,"gradient_checkpointing":false,"hidden_act":"gelu",
    "hidden_dropout_prob":0.1,"hidden_size":768,"initializer_range":0.02,"intermediate_size":3072,
    "layer_norm_eps":1e-12,"max_position_embeddings":512,"model_type":"bert",
    "num_attention_heads":12,"num_hidden_layers":12,"pad_token_id":0,
    "position_embedding_type":"absolute","transformers_version":"4.6.0.dev0","type_vocab_size":2,
    "use_cache":true,"vocab_size":30522})";

// The config with more fields, or with another head.
std::string with(std::string base, const std::string& fields) {
  return base.insert(1, fields + ",");
}
std::string swap(const std::string& from, const std::string& to) {
  std::string s = kBertBase;
  return s.replace(s.find(from), from.size(), to);
}
std::string head(const std::string& arch) { return swap("BertForMaskedLM", arch); }
}  // namespace

TEST_CASE("BERT: published totals, counted from the shapes") {
  // bert-large-uncased fine-tuned with AutoModelForSequenceClassification (2 labels), as the
  // Hugging Face docs' "Model training anatomy" trains it. From the shapes: embeddings
  // 30522*1024 + 512*1024 + 2*1024 + LayerNorm 2*1024; per layer q, k, v, o 4*(1024^2 + 1024),
  // two LayerNorms 4*1024, intermediate 4096*1024 + 4096, output 1024*4096 + 1024; pooler
  // 1024^2 + 1024; classifier 2*1024 + 2.
  const int64_t C = 1024, F = 4096;
  const int64_t layer = 4 * (C * C + C) + 4 * C + (F * C + F) + (C * F + C);
  const int64_t large = 30522 * C + 512 * C + 2 * C + 2 * C + 24 * layer + (C * C + C) + (2 * C + 2);
  CHECK(large == 335'143'938);
  const ModelSpec m = load_model(std::string(ZP_SOURCE_DIR) +
                                 "/tests/data/published/bert-large-uncased-seqcls.json");
  CHECK(m.head == Head::seq_cls);
  CHECK(m.n_labels == 2);
  CHECK(m.cls_dropout == 0.1);  // classifier_dropout null: hidden_dropout_prob
  const ParamInventory inv = count_params(m);
  CHECK(inv.total == 335'143'938);
  CHECK(inv.per_layer == layer);
  CHECK(inv.head == (C * C + C) + (2 * C + 2));
  CHECK(inv.final_norm == 0);
  CHECK(inv.tensors.back().name == "classifier.bias");
  // bert-base-uncased with its masked-LM head (BertForMaskedLM: no pooler; the transform's
  // dense and LayerNorm and the decoder's bias; the decoder's weight is the word embedding):
  // 109,482,240 for BertModel, less the pooler's 590,592, plus 590,592 + 1,536 + 30,522.
  const ParamInventory base = count_params(parse_hf_config(kBertBase, "bert-base-uncased"));
  CHECK(base.total == 109'514'298);
  auto has = [&](const std::string& n) {
    for (const auto& t : base.tensors)
      if (t.name == n) return true;
    return false;
  };
  CHECK(has("cls.predictions.bias"));
  CHECK(has("cls.predictions.transform.LayerNorm.weight"));
  CHECK_FALSE(has("cls.predictions.decoder.weight"));  // tied
  CHECK_FALSE(has("bert.pooler.dense.weight"));
  // BertForPreTraining: + the pooler and the next-sentence classifier (2 classes).
  const ParamInventory pre = count_params(parse_hf_config(head("BertForPreTraining"), "pre"));
  CHECK(pre.total == base.total + (768 * 768 + 768) + (2 * 768 + 2));
  // An untied decoder is listed under its own name.
  CHECK(count_params(parse_hf_config(with(kBertBase, R"("tie_word_embeddings":false)"), "u"))
            .total == base.total + 30522 * 768);
}

TEST_CASE("BERT reader: the head, the labels and what it refuses") {
  auto seqcls = [](const std::string& fields) {
    return parse_hf_config(with(head("BertForSequenceClassification"), fields), "c");
  };
  // PretrainedConfig: id2label decides (num_labels ignored), else num_labels, else 2.
  CHECK(seqcls(R"("id2label":{"0":"a","1":"b","2":"c"},"num_labels":7)").n_labels == 3);
  CHECK(seqcls(R"("num_labels":5)").n_labels == 5);
  CHECK(seqcls(R"("label2id":{"a":0,"b":1,"c":2})").n_labels == 2);
  CHECK(seqcls(R"("classifier_dropout":0.3)").cls_dropout == 0.3);
  CHECK(seqcls(R"("num_labels":1)").notes.back().find("regression") != std::string::npos);
  // Google's original config keys (multilingual and Chinese checkpoints) are accepted.
  CHECK_NOTHROW(seqcls(R"("directionality":"bidi","pooler_fc_size":768,
      "pooler_num_attention_heads":12,"pooler_num_fc_layers":3,"pooler_size_per_head":128,
      "pooler_type":"first_token_transform")"));
  // No architectures: the masked-LM head, noted.
  std::string plain = kBertBase;
  const std::string arch = R"("architectures":["BertForMaskedLM"],)";
  plain.erase(plain.find(arch), arch.size());
  const ModelSpec none = parse_hf_config(plain, "c");
  CHECK(none.head == Head::mlm);
  CHECK(none.notes.front().find("BertForMaskedLM") != std::string::npos);
  // Refused, naming the field.
  CHECK(error_of([&] { parse_hf_config(swap(R"("absolute")", R"("relative_key")"), "c"); })
            .find("field 'position_embedding_type': 'relative_key'") != std::string::npos);
  CHECK(error_of([&] { parse_hf_config(with(kBertBase, R"("is_decoder":true)"), "c"); })
            .find("field 'is_decoder'") != std::string::npos);
  CHECK(error_of([&] { parse_hf_config(with(kBertBase, R"("add_cross_attention":true)"), "c"); })
            .find("field 'add_cross_attention'") != std::string::npos);
  CHECK(error_of([&] { parse_hf_config(swap(R"("gelu")", R"("mish")"), "c"); })
            .find("field 'hidden_act': 'mish'") != std::string::npos);
  CHECK(error_of([&] { seqcls(R"("id2label":{})"); }).find("field 'id2label'") !=
        std::string::npos);
  CHECK(error_of([&] { parse_hf_config(head("BertForQuestionAnswering"), "c"); })
            .find("field 'architectures': 'BertForQuestionAnswering'") != std::string::npos);
}

namespace {
// Levenshtein's full table, the textbook way: the reference for the pruned search.
std::size_t levenshtein(std::string_view a, std::string_view b) {
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i)
    for (std::size_t j = 1; j <= b.size(); ++j)
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1])});
  return d[a.size()][b.size()];
}
}  // namespace

TEST_CASE("closest_names: the n best of a stable sort by edit distance, found with pruning") {
  CHECK(edit_distance("kitten", "sitting") == 3);
  CHECK(edit_distance("", "abc") == 3);
  CHECK(edit_distance("GPT2", "gpt2", true) == 0);
  CHECK(closest_catalog_names("GPT2-XXL", 1) == std::vector<std::string>{"gpt2-xl"});
  // Random names over a small alphabet (many ties) against every catalog name and against
  // each other: the same list as sorting all the textbook distances stably.
  std::vector<std::string> pool;
  for (const auto& e : catalog()) pool.push_back(e.name);
  uint64_t x = 12345;
  auto next = [&] { return x = x * 6364136223846793005ull + 1442695040888963407ull, x >> 33; };
  for (int i = 0; i < 200; ++i) {
    std::string s;
    for (uint64_t k = next() % 14; k > 0; --k) s.push_back("ab-1l"[next() % 5]);
    pool.push_back(s);
  }
  std::vector<std::string_view> cands(pool.begin(), pool.end());
  for (int q = 0; q < 300; ++q) {
    const std::string& name = pool[next() % pool.size()];
    const std::size_t n = 1 + next() % 5;
    std::vector<std::pair<std::size_t, std::string_view>> all;
    for (std::string_view c : cands) all.emplace_back(levenshtein(name, c), c);
    std::stable_sort(all.begin(), all.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<std::string_view> want;
    for (std::size_t i = 0; i < n; ++i) want.push_back(all[i].second);
    CAPTURE(name);
    CHECK(closest_names(name, cands, n) == want);
    for (std::string_view c : cands) CHECK(edit_distance(name, c) == levenshtein(name, c));
  }
}
