// engine.cpp: the ZeRO engine: layout and partitioning, the graph walk with liveness, ZeRO's
// buckets and gathers, and the optimizer step. The order of allocations within an op is
// part of the contract with the planner (planner/src/schedule.cpp builds its prediction in
// the same order): gathers for a new ZeRO-3 run, then the op's inputs and outputs seen for
// the first time, its scratch, the gradient buckets it starts; then the scratch is freed,
// the tensors whose last use it was, full reduce buckets (with overlap_comm: the bucket
// flushed before, whose reductions were in flight), and finished ZeRO-3 groups.
#include "zp/runtime/engine.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <utility>

#include <fmt/format.h>

#include "zp/checked.hpp"
#include "zp/error.hpp"
#include "zp/planner/schedule.hpp"
#include "zp/runtime/cpu_kernels.hpp"
#include "zp/runtime/rng.hpp"
#include "engine_internal.hpp"

namespace zp::runtime {

using models::Op;
using models::OpKind;
using models::Phase;
using models::Tensor;
using models::TensorId;
using models::TensorKind;
using planner::Precision;

namespace {
// A tensor's elements.
uint64_t elems_of(const models::Tensor& x) { return x.bytes / x.elem_bytes; }
}  // namespace

namespace {

DType dtype_of(Precision p) {
  return p == Precision::fp32 ? DType::fp32 : (p == Precision::fp16 ? DType::fp16 : DType::bf16);
}

using detail::at;

// Qwen3's per-head RMSNorm of q and k (graph.cpp names it h.L.attn.qk_norm).
bool is_qk_norm(const Op& op) { return op.name.find(".attn.qk_norm") != std::string::npos; }

// A routed expert's GEMM (graph.cpp dense_mlp with rows: h.L.moe.experts.gate_up / .proj).
bool is_expert_op(const Op& op) { return op.name.find(".moe.experts.") != std::string::npos; }

// Why a non-GPT-2 model is not one of the dense LLaMA-family decoders this engine runs
// (pre-RMSNorm blocks of rotary grouped-query attention and a SwiGLU MLP, no biases but
// Qwen2's on q, k and v, an untied or tied head); "" when it is.
std::string llama_refusal(const models::ModelSpec& m) {
  using namespace models;
  const std::string& t = m.model_type;
  if (m.moe.n_experts > 0 && (t != "mixtral" && t != "qwen2_moe" && t != "qwen3_moe"))
    return "Mixture-of-Experts layers other than Mixtral's and Qwen-MoE's";
  if (m.moe.router_bias || m.moe.expert_bias || m.moe.score_bias)
    return "a router or expert bias (gpt-oss, DeepSeek-V3)";
  if (m.moe.n_experts > cpu::kMaxExperts)
    return fmt::format("{} experts (the kernels take at most {})", m.moe.n_experts, cpu::kMaxExperts);
  if (m.norm != Norm::rmsnorm || m.norm_place != NormPlace::pre) return "not pre-RMSNorm blocks";
  if (m.residual != Residual::sequential) return "a parallel residual";
  if (m.mlp != Mlp::swiglu) return "not a SwiGLU MLP";
  if (m.positions != Positions::rotary) return "not rotary positions";
  if (m.attention != Attention::standard || m.attn_sinks) return "an attention variant (MLA or sinks)";
  if (m.qk_norm == QkNorm::full) return "q/k norms over the whole projection (OLMo2's)";
  if (m.activation != "silu") return "a gated MLP with " + m.activation + ", not SiLU";
  if (m.out_bias || m.mlp_bias || m.head_bias) return "biases beyond q, k and v";
  if (m.attn_softcap > 0 || m.final_softcap > 0) return "logit softcapping";
  if (m.head != Head::lm || !m.final_norm || m.embed_norm || m.embed_proj_dim > 0)
    return "a head or embedding variant";
  if (m.attn_dropout > 0) return "attention dropout";
  // Families with the same recipe but their own details (Gemma's scaled embeddings and 1 + w
  // norms, OLMo2's norm placement, ...) are checked model_type by model_type.
  if (t != "llama" && t != "mistral" && t != "qwen2" && t != "qwen3" && t != "mixtral" &&
      t != "qwen2_moe" && t != "qwen3_moe")
    return "not a llama, mistral, qwen2, qwen3, mixtral, qwen2_moe or qwen3_moe";
  try {
    (void)rope_table(m.rope, m.rotary_dim, m.n_positions);
  } catch (const Error& e) {
    return e.what();
  }
  return {};
}

}  // namespace

// What this engine cannot run is refused before anything is allocated.
void Engine::check(const planner::Plan& plan, std::string_view device, int ranks) {
  const auto& s = plan.strategy;
  const auto& m = plan.model;
  const int dp_ = ranks;
  if (s.dp != dp_)
    throw Error(fmt::format("the plan is for --dp {}, but {} rank{} running", s.dp, dp_,
                            dp_ == 1 ? " is" : "s are"),
                fmt::format("run it with mpirun -np {}, or make a plan with --dp {}", s.dp, dp_));
  if (!m.is_gpt2_block()) {
    const std::string why = llama_refusal(m);
    if (!why.empty())
      throw Error(fmt::format("zero-run trains GPT-2 and LLaMA-family models (llama, mistral, qwen2, "
                              "qwen3, and the MoE mixtral, qwen2_moe, qwen3_moe); {} is {}: {}",
                              m.name, m.family_name(), why),
                  "plan other architectures with zero-plan; run a GPT-2 or LLaMA-style config here");
    // Both backends run them with fp32 or 16-bit activations (the planner's cpu or cuda graph):
    // cpu_kernels.cpp, cpu_flash.cpp, cpu_moe.cpp; kernels_llama.cu, kernels_moe.cu. The GPU's
    // combine takes at most 16 experts per token (it holds a token's rows in registers).
    if (m.is_moe() && device == "cuda" && m.moe.top_k > 16)
      throw Error(fmt::format("{}: {} experts per token; zero-run's cuda backend takes at most 16",
                              m.name, m.moe.top_k),
                  "run this plan with --device cpu");
  }
  if (m.is_moe() && s.moe_capacity_factor > 0)
    throw Error(fmt::format("{}: zero-run runs Mixture-of-Experts layers dropless so far; "
                            "--moe-capacity-factor is planned, not executed", m.name),
                "plan capacity-factor routing with zero-plan; run without it here");
  // Expert parallelism: MPI's all-to-all (each rank E/ep experts, their gradients reduced and
  // their states and, at stage 3, parameters partitioned over the expert-data-parallel group),
  // with the optimizer and the parameters where the plan puts them (device, host or NVMe).
  if (s.ep > 1) {
    if (device != "cpu")
      throw Error(fmt::format("--ep {}: zero-run runs expert parallelism on the cpu backend so far "
                              "(MPI's all-to-all); NCCL's is not written yet", s.ep),
                  "run --ep > 1 with --device cpu, or --ep 1 on GPUs");
  }
  if (s.mp != 1 || s.partition_activations)
    throw Error("zero-run has no tensor parallelism: --tp must be 1",
                "plan model parallelism with zero-plan; run data parallelism here");
  if (s.grad_precision && *s.grad_precision != s.precision)
    throw Error(fmt::format("--grad-precision {}: zero-run keeps gradients in the training "
                            "precision ({})", planner::to_string(*s.grad_precision),
                            planner::to_string(s.precision)),
                "plan Megatron's fp32 main_grad with zero-plan; run without --grad-precision");
  if (s.pp != 1 || s.cp != 1)
    throw Error(fmt::format("zero-run has no {} parallelism: --{} must be 1",
                            s.pp != 1 ? "pipeline" : "context", s.pp != 1 ? "pp" : "cp"),
                "plan pipeline and context parallelism with zero-plan; run data and expert "
                "parallelism here");
  // The optimizer step (cpu_adam.hpp and the devices' fused kernels) is Adam/AdamW or SGD
  // with momentum; the other optimizers are planned only.
  if (s.optimizer != planner::OptimizerKind::adam && s.optimizer != planner::OptimizerKind::adamw &&
      s.optimizer != planner::OptimizerKind::sgd)
    throw Error(fmt::format("--optimizer {} is planned but not executed by zero-run",
                            planner::to_string(s.optimizer)),
                "zero-run's optimizer step is adam, adamw or sgd (with momentum); plan the others "
                "with zero-plan");
  if (s.offload_param != planner::Offload::none && s.offload_optimizer == planner::Offload::none)
    throw Error(fmt::format("--offload-param {}: zero-run needs the optimizer offloaded too",
                            planner::to_string(s.offload_param)),
                "add --offload-optimizer cpu or nvme (the optimizer then updates the offloaded "
                "partition)");
  if (plan.options.profile != planner::Profile::zeroplan)
    throw Error(fmt::format("the plan predicts {} (--profile {}); zero-run executes zeroplan plans",
                            plan.options.profile == planner::Profile::fsdp ? "PyTorch FSDP" : "DeepSpeed",
                            planner::to_string(plan.options.profile)),
                "make the plan with --profile zeroplan");
  if (plan.options.model_code != planner::ModelCode::fused)
    throw Error("the plan predicts Hugging Face's modeling code (--model-code transformers); "
                "zero-run executes its fused kernels",
                "make the plan with --model-code fused (the zeroplan profile's default)");
  // With expert parallelism the plan holds this rank's E/ep experts.
  const models::ParamInventory inv = models::count_params(m);
  const uint64_t n = static_cast<uint64_t>(inv.total - inv.experts + inv.experts / std::max<int64_t>(1, s.ep));
  if (plan.n_params != 0 && plan.n_params != n)
    throw Error(fmt::format("the plan was made for a model of {} parameters; its config has {}",
                            plan.n_params, n),
                "the plan file was edited or belongs to another model; make it again");
}

namespace {

models::TrainingGraph checked_graph(const planner::Plan& plan, const Device& dev, const Comm& comm) {
  Engine::check(plan, dev.name(), comm.size());
  return models::build_training_graph(plan.model,
                                      planner::graph_options(plan.model, plan.strategy, plan.options));
}

}  // namespace

Engine::Engine(const planner::Plan& plan, Device& dev, Comm& comm, TokenData data,
               EngineOptions opt)
    : plan_(plan), dev_(dev), comm_(comm), data_(std::move(data)), opt_(opt),
      g_(checked_graph(plan, dev, comm)), lv_(models::liveness(g_)) {
  rank_ = comm.rank();
  dp_ = comm.size();
  stage_ = plan.strategy.stage;
  pdt_ = dtype_of(plan.strategy.precision);
  pbytes_ = dtype_bytes(pdt_);
  // The kernels' storage type: fp32 in the planner's cpu graph (fp32 activations, weights
  // converted into fp32 scratch per op), the training precision in its cuda graph (16-bit
  // activations, the 16-bit weights and gradients as they are).
  adt_ = g_.options.act_bytes == 4 ? DType::fp32 : pdt_;
  loss_scale_ = plan.strategy.precision == Precision::fp16 ? opt.initial_loss_scale : 1.0f;
  B_ = g_.options.batch;
  T_ = g_.options.seq;
  C_ = plan.model.n_embd;
  NH_ = plan.model.n_head;
  llama_ = !plan.model.is_gpt2_block();
  norm_eps_ = static_cast<float>(plan.model.norm_eps);
  heads_ = {NH_, NH_, C_ / NH_};
  if (llama_) {
    heads_ = {plan.model.n_head, plan.model.n_kv_head, plan.model.head_dim};
    rot_ = plan.model.rotary_dim;
    rope_ = rope_table(plan.model.rope, rot_, plan.model.n_positions);
  }
  if (plan.model.is_moe()) {
    n_experts_ = plan.model.moe.n_experts;
    top_k_ = plan.model.moe.top_k;
    moe_renorm_ = models::hf_topk_renorm(plan.model);
    aux_coef_ = models::moe_aux_loss_coef(plan.model);
    for (int64_t l = 0; l < plan.model.n_layer; ++l) n_moe_layers_ += plan.model.moe.is_moe_layer(l) ? 1 : 0;
    expert_off_.assign(static_cast<std::size_t>(plan.model.n_layer),
                       std::vector<int64_t>(static_cast<std::size_t>(n_experts_ + 1), 0));
    aux_counts_.assign(static_cast<std::size_t>(n_experts_), 0.0);
    aux_psum_.assign(static_cast<std::size_t>(n_experts_), 0.0);
    aux_dprob_.assign(static_cast<std::size_t>(n_experts_), 0.0f);
    local_experts_ = n_experts_;
    if (plan.strategy.ep > 1) {
      ep_ = static_cast<int>(plan.strategy.ep);
      local_experts_ = n_experts_ / ep_;
      ep_comm_ = comm.split(rank_ / ep_, rank_);
      edp_comm_ = comm.split(rank_ % ep_, rank_);
      ep_rank_ = ep_comm_->rank();
    }
    const auto L = static_cast<std::size_t>(plan.model.n_layer);
    expert_segs_.assign(L, {});
    ep_send_.assign(L, std::vector<uint64_t>(static_cast<std::size_t>(ep_), 0));
    ep_recv_.assign(L, std::vector<uint64_t>(static_cast<std::size_t>(ep_), 0));
  }
  n_pos_ = static_cast<int32_t>(g_.order.size());
  for (int32_t i = 0; i < n_pos_; ++i) {
    const Op& op = g_.op(g_.order[static_cast<std::size_t>(i)]);
    if (op.phase == Phase::backward) last_bwd_ = i;
    if (op.phase == Phase::optimizer) opt_pos_ = i;
  }
  offload_ = plan.strategy.offload_optimizer != planner::Offload::none;
  overlap_ = stage_ >= 2 && planner::overlaps_comm(plan.strategy);
  collectives_ = dp_ > 1 || opt_.collectives_at_one_rank;
  buckets_in_flight_ = planner::holds_buckets_in_flight(plan.strategy);
  dpu_ = offload_ && plan.strategy.dpu;
  nvme_ = plan.strategy.offload_optimizer == planner::Offload::nvme;
  param_nvme_ = stage_ == 3 && plan.strategy.offload_param == planner::Offload::nvme;
  if (nvme_ || param_nvme_) {
    if (opt_.nvme_path.empty())
      throw Error(
          fmt::format("--offload-{} nvme needs --nvme-path DIR (a directory on the NVMe drive)",
                      nvme_ ? "optimizer" : "param"),
          "e.g. --nvme-path /local_nvme; each rank keeps its swap files there");
    const SwapperOptions so{.dir = opt_.nvme_path, .rank = rank_, .aio = opt_.aio};
    if (nvme_) swapper_ = std::make_unique<Swapper>(so);
    if (param_nvme_) param_swapper_ = std::make_unique<Swapper>(so);
  }
  layout();
  if (stage_ == 3) find_runs();
  if (param_nvme_) plan_param_reads();
  buf_.assign(g_.tensors.size(), nullptr);
  allocate_states();
  init_weights();
  dev_.loss_take();  // a loss total left on the device by an engine before this one
}

Engine::~Engine() {
  // Collectives still in flight (after an error) finish before their buffers go back.
  in_flight_reqs_.clear();
  gathering_.clear();
  if (dpu_thread_.joinable()) dpu_thread_.join();
  if (param_nvme_) drain_param_io();  // no I/O into the buffers once they go back
  // Model states go back to their arenas (in reverse); step tensors were freed by the step.
  for (auto it = held_.rbegin(); it != held_.rend(); ++it) dev_.arena(it->first).free(it->second);
}

// ---- layout --------------------------------------------------------------------------------

void Engine::layout() {
  flat_off_.assign(g_.tensors.size(), 0);
  const uint64_t dp = static_cast<uint64_t>(dp_);
  // Flat order: the graph's param tensors in creation order (embed, h.0 .. h.L-1, head); with
  // expert parallelism the dense tensors first, then the experts', so each of the two
  // partitions (over all ranks, over the expert-data-parallel group) is one flat range.
  std::map<std::string, std::pair<uint64_t, uint64_t>> by_group;  // group -> (offset, elems)
  // At stage 3 each gather group's dense tensors come first, then its experts'.
  uint64_t dense_elems = 0;
  std::map<std::string, uint64_t> group_experts;  // stage 3: a group's expert elements
  auto place = [&](std::size_t t) {
    const Tensor& x = g_.tensors[t];
    const uint64_t n = x.bytes / x.elem_bytes;
    flat_off_[t] = n_params_;
    auto [it, fresh] = by_group.try_emplace(x.group, n_params_, 0);
    it->second.second += n;
    if (planner::is_expert_tensor(x)) group_experts[x.group] += n;
    n_params_ = checked_add(n_params_, n, "parameters");
  };
  if (ep_ > 1 && stage_ == 3) {
    for (const std::string& grp : g_.groups)
      for (int pass = 0; pass < 2; ++pass)
        for (std::size_t t = 0; t < g_.tensors.size(); ++t) {
          const Tensor& x = g_.tensors[t];
          if (x.kind == TensorKind::param && x.group == grp && planner::is_expert_tensor(x) == (pass == 1))
            place(t);
        }
  } else {
    for (int pass = 0; pass < (ep_ > 1 ? 2 : 1); ++pass)
      for (std::size_t t = 0; t < g_.tensors.size(); ++t) {
        const Tensor& x = g_.tensors[t];
        if (x.kind != TensorKind::param) continue;
        if (ep_ > 1 && planner::is_expert_tensor(x) != (pass == 1)) continue;
        place(t);
        if (pass == 0) dense_elems = n_params_;
      }
  }
  // Each grad shares its param's offset (the graph creates them as pairs).
  for (std::size_t t = 0; t < g_.tensors.size(); ++t)
    if (g_.tensors[t].kind == TensorKind::grad) flat_off_[t] = flat_off_[t - 1];
  for (std::size_t t = 0; t < g_.tensors.size(); ++t)
    if (g_.tensors[t].kind == TensorKind::param) param_ids_.push_back(static_cast<TensorId>(t));
  std::sort(param_ids_.begin(), param_ids_.end(), [&](TensorId a, TensorId b) {
    return flat_off_[static_cast<std::size_t>(a)] < flat_off_[static_cast<std::size_t>(b)];
  });
  // The canonical places: the flat order of the graph with every expert (ep 1), where this
  // rank's expert tensors are the slices of its experts, ep_rank_ E/ep on (param_inventory
  // stacks a layer's experts along the first dimension).
  canon_off_ = flat_off_;
  canon_params_ = n_params_;
  if (ep_ > 1) {
    planner::Strategy s1 = plan_.strategy;
    s1.ep = 1;
    const models::TrainingGraph g1 =
        models::build_training_graph(plan_.model, planner::graph_options(plan_.model, s1, plan_.options));
    std::map<std::string, uint64_t> off1;
    uint64_t n1 = 0;
    for (const Tensor& x : g1.tensors)
      if (x.kind == TensorKind::param) {
        off1[x.name] = n1;
        n1 = checked_add(n1, x.bytes / x.elem_bytes, "parameters");
      }
    canon_params_ = n1;
    for (TensorId t : param_ids_) {
      const Tensor& x = g_.tensor(t);
      const auto it = off1.find(x.name);
      if (it == off1.end())
        throw Error(fmt::format("expert parallelism: parameter {} has no place in the full model", x.name));
      canon_off_[static_cast<std::size_t>(t)] =
          it->second + (planner::is_expert_tensor(x) ? static_cast<uint64_t>(ep_rank_) * (x.bytes / x.elem_bytes) : 0);
    }
  }

  auto whole = [&](std::string name, uint64_t off, uint64_t elems, uint64_t shard, uint64_t part) {
    return Group{std::move(name), off, elems, shard, part, &comm_, rank_, dp_, false};
  };
  if (stage_ < 3 && ep_ > 1) {
    // DeepSpeed-MoE's grouping: dense parameters partitioned over every rank, the experts'
    // over the dp/ep ranks holding the same experts (schedule.cpp partition_elems).
    const uint64_t x = n_params_ - dense_elems;
    const uint64_t edp = static_cast<uint64_t>(edp_comm_->size());
    groups_.push_back(whole("dense", 0, dense_elems,
                            stage_ == 0 ? dense_elems : zp::partition_elems(dense_elems, dp), 0));
    groups_.push_back({"experts", dense_elems, x, stage_ == 0 ? x : zp::partition_elems(x, edp),
                       groups_.back().shard, edp_comm_.get(), edp_comm_->rank(), edp_comm_->size(), true});
    part_ = groups_[0].shard + groups_[1].shard;
  } else if (stage_ < 3) {
    groups_.push_back(whole("all", 0, n_params_, stage_ == 0 ? n_params_ : zp::partition_elems(n_params_, dp), 0));
    part_ = groups_.back().shard;
  } else {
    for (const std::string& name : g_.groups) {
      const auto [off, elems] = by_group.at(name);
      const uint64_t x = ep_ > 1 ? group_experts[name] : 0, d = elems - x;
      group_index_[name] = groups_.size();
      groups_.push_back(whole(name, off, d, zp::partition_elems(d, dp), part_));
      part_ += groups_.back().shard;
      if (x == 0) continue;
      const uint64_t edp = static_cast<uint64_t>(edp_comm_->size());
      expert_group_index_[name] = groups_.size();
      groups_.push_back({name + "#experts", off + d, x, zp::partition_elems(x, edp), part_,
                         edp_comm_.get(), edp_comm_->rank(), edp_comm_->size(), true});
      part_ += groups_.back().shard;
    }
    return;
  }
  for (std::size_t i = 0; i < groups_.size(); ++i) group_index_[groups_[i].name] = i;
}

const Engine::Group* Engine::expert_part(const std::string& grp) const {
  const auto it = expert_group_index_.find(grp);
  return it == expert_group_index_.end() ? nullptr : &groups_[it->second];
}

uint64_t Engine::gather_elems(const std::string& grp) const {
  const Group* x = expert_part(grp);
  return groups_[group_index_.at(grp)].elems + (x != nullptr ? x->elems : 0);
}

const Engine::Group& Engine::group_of(TensorId t) const {
  if (stage_ >= 3) {
    const Tensor& x = g_.tensor(t);
    if (ep_ > 1 && planner::is_expert_tensor(x)) return *expert_part(x.group);
    return groups_[group_index_.at(x.group)];
  }
  return groups_[ep_ > 1 && planner::is_expert_tensor(g_.tensor(t)) ? 1 : 0];
}

std::pair<uint64_t, uint64_t> Engine::owned(const Group& gr) const {
  if (stage_ == 0) return {0, gr.elems};
  const uint64_t lo = std::min(gr.elems, static_cast<uint64_t>(gr.grank) * gr.shard);
  return {lo, std::min(gr.elems, lo + gr.shard)};
}

void* Engine::alloc(Tier t, uint64_t bytes, Category c, const std::string& name) {
  return dev_.arena(t).alloc(bytes, c, name);
}

// Model states, before the first op, in the planner's order (schedule.cpp model_states):
// per tier params, grads, master, moments; then the delayed update's second gradient
// partition and host parameter copy.
void Engine::allocate_states() {
  const bool mixed = pdt_ != DType::fp32;
  const uint64_t held_p = stage_ >= 3 ? part_ : n_params_;
  const uint64_t held_g = stage_ >= 2 ? part_ : n_params_;
  const uint64_t held_os = stage_ >= 1 ? part_ : n_params_;
  auto state = [&](Tier t, uint64_t elems, uint64_t eb, Category c, const char* name) -> void* {
    const uint64_t bytes = checked_mul(elems, eb, name);
    if (bytes == 0) return nullptr;
    void* p = alloc(t, bytes, c, name);
    dev_.zero(p, bytes);
    held_.emplace_back(t, p);
    return p;
  };
  // ZeRO-Offload keeps master weights (also in fp32 training), moments and an fp32 gradient
  // partition in the host tier; the device keeps 16-bit gradients only under stage 1.
  const Tier os = offload_ ? Tier::cpu : Tier::gpu;
  // Swap files first: a drive too small fails before any memory is touched.
  if (nvme_) open_swap_files();
  if (param_nvme_) open_param_file();  // the 16-bit partition (engine_nvme.cpp)
  // offload_param=cpu (stage 3): the 16-bit partition in the host tier, staged per gather.
  const Tier pt = plan_.strategy.offload_param == planner::Offload::cpu ? Tier::cpu : Tier::gpu;
  if (!param_nvme_) params_ = state(pt, held_p, pbytes_, Category::params, "params");
  if (!offload_ || stage_ < 2) grads_ = state(Tier::gpu, held_g, pbytes_, Category::grads, "grads");
  if (offload_) host_grads_[0] = static_cast<float*>(state(Tier::cpu, part_, 4, Category::grads, "grads"));
  if (!nvme_) {  // else master and moments are in the swap files (engine_nvme.cpp)
    if (mixed || offload_) master_ = static_cast<float*>(state(os, held_os, 4, Category::master, "master"));
    if (plan_.strategy.optimizer == planner::OptimizerKind::sgd) {
      exp_avg_ = static_cast<float*>(state(os, held_os, 4, Category::optimizer, "momentum"));
    } else {
      exp_avg_ = static_cast<float*>(state(os, held_os, 4, Category::optimizer, "exp_avg"));
      exp_avg_sq_ = static_cast<float*>(state(os, held_os, 4, Category::optimizer, "exp_avg_sq"));
    }
  }
  if (dpu_) {
    host_grads_[1] = static_cast<float*>(state(Tier::cpu, part_, 4, Category::grads, "grads.dpu"));
    if (mixed || nvme_) dpu_params_ = state(Tier::cpu, part_, pbytes_, Category::params, "params.dpu");
    if (nvme_) {  // the CPU step's swap buffers, held for the run (schedule.cpp)
      void* block = alloc(Tier::cpu, planner::optimizer_swap_buffer_bytes(plan_.strategy, part_),
                          Category::buffers, "swap_buffers");
      held_.emplace_back(Tier::cpu, block);
      carve_swap_buffers(block, dpu_swap_buffers_);
    }
  }
  if (param_nvme_) alloc_param_buffers();  // engine_nvme.cpp
}

// GPT-2's initialisation (Radford et al. 2019, as in llm.c and Hugging Face): weights
// N(0, 0.02), the two residual projections N(0, 0.02 / sqrt(2 L)), biases 0, norms 1 and 0.
// The value of flat element i depends only on (seed, i), so the elements are filled in parallel.
void Engine::init_range(uint64_t lo, uint64_t hi, float* out) const {
  const uint64_t C = static_cast<uint64_t>(C_);
  for (std::size_t t = 0; t < g_.tensors.size(); ++t) {
    const Tensor& x = g_.tensors[t];
    if (x.kind != TensorKind::param) continue;
    const uint64_t off = flat_off_[t], numel = x.bytes / x.elem_bytes;
    const uint64_t a = std::max(lo, off), b = std::min(hi, off + numel);
    if (a >= b) continue;
    const std::string& n = x.name;
    auto ends = [&](std::string_view suf) {
      return n.size() >= suf.size() && n.compare(n.size() - suf.size(), suf.size(), suf) == 0;
    };
    const bool norm = ends("norm1") || ends("norm2") || ends("norm_f");
    const bool qk_norm = ends(".attn.qk_norm");  // Qwen3's q_norm and k_norm weights: all 1
    const bool proj = ends(".attn.proj") || ends(".mlp.proj");
    // LLaMA-family (transformers' LlamaPreTrainedModel._init_weights): every linear and
    // embedding weight N(0, 0.02), biases 0, RMSNorm weights 1; no residual scaling.
    const double sd = proj && !llama_ ? 0.02 / std::sqrt(2.0 * static_cast<double>(plan_.model.n_layer)) : 0.02;
    // A linear module is weight (OC, in) then bias (OC); embeddings are all weight. LLaMA-family:
    // only Qwen2's q|k|v projection has a bias.
    const uint64_t in = ends(".mlp.proj") ? static_cast<uint64_t>(plan_.model.n_inner) : C;
    const bool embedding = n == "wte" || n == "wpe";
    uint64_t weight_elems = embedding ? numel : (numel % (in + 1) == 0 ? numel / (in + 1) * in : numel);
    if (llama_)
      weight_elems = ends(".attn.qkv") && plan_.model.qkv_bias ? numel / (C + 1) * C : numel;
    const auto n_here = static_cast<int64_t>(b - a);
#pragma omp parallel for schedule(static) if (n_here > 65536)
    for (int64_t j = 0; j < n_here; ++j) {
      const uint64_t i = a + static_cast<uint64_t>(j);
      const uint64_t local = i - off;
      float v;
      if (qk_norm) v = 1.0f;
      else if (norm) v = local < C ? 1.0f : 0.0f;
      else if (local >= weight_elems) v = 0.0f;
      else v = static_cast<float>(sd * normal_at(plan_.seed, canon_off_[t] + local));
      out[i - lo] = v;
    }
  }
}

// Values are computed on the host in blocks of kStage elements and copied into place with
// Device::copy, so the same code fills a GPU's memory. The two staging blocks (2 MiB of
// pageable host memory, outside the arenas: start-up and --save-weights only, gone before the
// first step and after the last) keep a GPU's copies few: 124 copies for GPT-2's 124 M
// parameters, each a synchronous PCIe transfer, where 1 Ki-element blocks took 242 K.
namespace {
constexpr uint64_t kStage = uint64_t{1} << 18;
}

void Engine::init_weights() {
  std::vector<float> vals_block(kStage);
  std::vector<std::byte> raw_block(kStage * 4);
  float* vals = vals_block.data();
  std::byte* raw = raw_block.data();
  // Fill dst[0, hi - lo) (elements of dtype t) with the initial values of flat [lo, hi).
  auto fill = [&](void* dst, DType t, uint64_t lo, uint64_t hi) {
    const uint64_t eb = dtype_bytes(t);
    for (uint64_t c = lo; c < hi; c += kStage) {
      const uint64_t m = std::min(kStage, hi - c);
      init_range(c, c + m, vals);
      for (uint64_t j = 0; j < m; ++j) store_from_f32(raw, j, t, vals[j]);
      dev_.copy(at(dst, c - lo, eb), raw, m * eb);
    }
  };
  // Each rank fills only what it holds: its owned master/partition, and the full params
  // below stage 3.
  for (const Group& gr : groups_) {
    const auto [lo, hi] = owned(gr);
    const uint64_t k = stage_ == 0 ? gr.flat_off + lo : gr.part_off;
    if (master_) fill(master_ + k, DType::fp32, gr.flat_off + lo, gr.flat_off + hi);
    if (stage_ == 3 && !param_nvme_)
      fill(at(params_, k, pbytes_), pdt_, gr.flat_off + lo, gr.flat_off + hi);
  }
  // offload_param=nvme: the owned partition, in partition order, to its swap file.
  if (param_nvme_) {
    for (const Group& gr : groups_) {
      const auto [lo, hi] = owned(gr);
      for (uint64_t c = lo; c < hi; c += kStage) {
        const uint64_t m = std::min(kStage, hi - c);
        init_range(gr.flat_off + c, gr.flat_off + c + m, vals);
        for (uint64_t j = 0; j < m; ++j) store_from_f32(raw, j, pdt_, vals[j]);
        put_params(gr.part_off + (c - lo), raw, m);
      }
    }
    end_param_write();  // an error here is the constructor's: zero-run ends every rank
  }
  if (stage_ < 3) fill(params_, pdt_, 0, n_params_);
  if (nvme_) init_swapped_states();
}

void Engine::find_runs() {
  run_at_.assign(static_cast<std::size_t>(n_pos_), -1);
  for (int32_t i = 0; i < n_pos_; ++i) {
    const Op& op = g_.op(g_.order[static_cast<std::size_t>(i)]);
    if (op.phase == Phase::optimizer || op.params.empty()) continue;
    const std::string& grp = g_.tensor(op.params.front()).group;
    if (runs_.empty() || runs_.back().group != grp) runs_.push_back({grp, i, i});
    runs_.back().end = i;
  }
  for (std::size_t r = 0; r < runs_.size(); ++r)
    for (int32_t i = runs_[r].start; i <= runs_[r].end; ++i)
      run_at_[static_cast<std::size_t>(i)] = static_cast<int32_t>(r);
}

// ---- the walk ------------------------------------------------------------------------------

void Engine::touch(TensorId t) {
  const Tensor& x = g_.tensor(t);
  if (buf_[static_cast<std::size_t>(t)] != nullptr || !models::is_dynamic(x.kind)) return;
  const Category c = x.kind == TensorKind::workspace ? Category::workspace
                     : (x.kind == TensorKind::logits || x.kind == TensorKind::input)
                         ? Category::buffers
                         : Category::activations;
  void* p = alloc(Tier::gpu, x.bytes, c, x.name);
  buf_[static_cast<std::size_t>(t)] = p;
  if (x.kind == TensorKind::act_grad) dev_.zero(p, x.bytes);
  if (x.kind == TensorKind::input) {
    // tokens (first used by the embedding) or targets (by the loss), made on the host and
    // uploaded (Device::upload: in order with the device's work, no host wait for it).
    const bool is_tokens = x.name == "tokens";
    std::vector<int32_t> host(static_cast<std::size_t>(B_ * T_));
    data_.fill(is_tokens ? host.data() : nullptr, is_tokens ? nullptr : host.data(), B_, T_,
               plan_.seed, step_, micro_, static_cast<int64_t>(rank_) * B_);
    dev_.upload(p, host.data(), std::min<uint64_t>(x.bytes, host.size() * sizeof(int32_t)));
  }
}

void* Engine::ptr(TensorId t) const {
  const Tensor& x = g_.tensor(t);
  if (x.kind == TensorKind::param) {
    if (stage_ < 3) return at(params_, flat_off_[static_cast<std::size_t>(t)], pbytes_);
    const Group& gr = group_of(t);
    if (gathering_.contains(x.group))
      throw Error(fmt::format("internal: {} read before its all-gather was waited for", x.name));
    // An expert part sits after the dense part's shards in the gathered buffer.
    const uint64_t base = gr.expert ? groups_[group_index_.at(x.group)].shard * static_cast<uint64_t>(dp_) : 0;
    return at(gathered_.at(x.group), base + flat_off_[static_cast<std::size_t>(t)] - gr.flat_off, pbytes_);
  }
  if (x.kind == TensorKind::grad && stage_ < 2)
    return at(grads_, flat_off_[static_cast<std::size_t>(t)], pbytes_);
  void* p = buf_[static_cast<std::size_t>(t)];
  if (p == nullptr) throw Error(fmt::format("internal: tensor {} used before it exists", x.name));
  return p;
}

// Stages 2-3: a weight gradient lives in its own bucket buffer from its first accumulation
// until the bucket is reduced into its owners' partitions.
void Engine::alloc_grad(TensorId gt) {
  if (buf_[static_cast<std::size_t>(gt)] != nullptr) return;
  const Tensor& x = g_.tensor(gt);
  void* p = alloc(Tier::gpu, x.bytes, Category::buffers, "bucket." + x.name);
  dev_.zero(p, x.bytes);
  buf_[static_cast<std::size_t>(gt)] = p;
}

// The part of gradient gt's bucket buffer owned by `owner`: [lo, hi) in group-local elements
// (empty when lo >= hi), and a, where the bucket starts.
struct Engine::Segment {
  uint64_t a = 0, lo = 0, hi = 0;
};
Engine::Segment Engine::segment(TensorId gt, int owner) const {
  const Tensor& x = g_.tensor(gt);
  const Group& gr = group_of(gt);
  const uint64_t n = x.bytes / x.elem_bytes;
  const uint64_t a = flat_off_[static_cast<std::size_t>(gt)] - gr.flat_off;
  const auto r = static_cast<uint64_t>(owner);
  return {a, std::max(a, r * gr.shard), std::min({a + n, (r + 1) * gr.shard, gr.elems})};
}

// Each owner's segment of gradient gt's bucket buffer, to be reduced to its owner.
void Engine::reduce_segments(TensorId gt, std::vector<ReduceSegment>& segs) const {
  void* bucket = buf_[static_cast<std::size_t>(gt)];
  for (int r = 0; r < group_of(gt).gsize; ++r) {
    const Segment sg = segment(gt, r);
    if (sg.lo >= sg.hi) continue;
    segs.push_back({at(bucket, sg.lo - sg.a, pbytes_), sg.hi - sg.lo, r});
  }
}

// Once its reductions are waited for: this rank's reduced segment is added into its gradient
// partition. Offloaded: it streams into the host fp32 partition.
void Engine::add_reduced(TensorId gt) {
  const Group& gr = group_of(gt);
  const Segment sg = segment(gt, gr.grank);
  if (sg.lo >= sg.hi) return;
  const void* seg = at(buf_[static_cast<std::size_t>(gt)], sg.lo - sg.a, pbytes_);
  const uint64_t k = gr.part_off + (sg.lo - static_cast<uint64_t>(gr.grank) * gr.shard);
  const auto count = static_cast<int64_t>(sg.hi - sg.lo);
  if (offload_) dev_.add_f32(host_grads_[cur_] + k, seg, pdt_, count);
  else dev_.add(at(grads_, k, pbytes_), seg, pdt_, count);
}

// The bucket in flight: wait for its reductions, add them in, free its buffers (in the
// order they were pending, as schedule.cpp frees them).
void Engine::complete_in_flight() {
  for (CommRequest& r : in_flight_reqs_) r.wait();
  in_flight_reqs_.clear();
  for (TensorId gt : in_flight_) add_reduced(gt);
  for (TensorId gt : in_flight_) {
    dev_.arena(Tier::gpu).free(buf_[static_cast<std::size_t>(gt)]);
    buf_[static_cast<std::size_t>(gt)] = nullptr;
  }
  in_flight_.clear();
}

// Final gradients are reduced together once they reach reduce_bucket_size elements, and
// whatever remains at the end of the backward pass. Without overlap_comm a flushed bucket is
// reduced, added and freed at once. With it (DeepSpeed's overlap_comm: "attempts to overlap
// the reduction of the gradients with backward computation", docs/config-json), a flushed
// bucket's reductions are issued and the bucket stays in flight while backward goes on; it is
// completed when the next bucket is issued, and the last one at the end of the backward pass,
// so at most two buckets are alive (schedule.cpp predicts exactly these lifetimes). On one
// data-parallel rank nothing is reduced, and the bucket is freed at once as without. Each
// gradient element is in one bucket, added once per micro-step: the bits do not depend on
// when the add happens.
void Engine::flush_if_full(bool end_of_backward) {
  uint64_t elems = 0;
  for (TensorId gt : pending_) elems += g_.tensor(gt).bytes / g_.tensor(gt).elem_bytes;
  const bool full = !pending_.empty() &&
                    (elems >= plan_.strategy.buffers.reduce_bucket_size || end_of_backward);
  if (full) {
    // The bucket's segments go out as one group (NCCL: one launch and one event, not one
    // per tensor and owner).
    // With expert parallelism the experts' segments go to their owners in the
    // expert-data-parallel group, after the dense ones (the same order on every rank).
    std::vector<CommRequest> reqs;
    if (collectives_) {
      std::vector<ReduceSegment> dense, expert;
      for (TensorId gt : pending_) reduce_segments(gt, group_of(gt).expert ? expert : dense);
      if (!dense.empty()) reqs.push_back(comm_.ireduce_sum_group(dense, pdt_));
      if (!expert.empty()) reqs.push_back(edp_comm_->ireduce_sum_group(expert, pdt_));
    }
    complete_in_flight();  // the previous bucket, if any
    in_flight_ = std::move(pending_);
    in_flight_reqs_ = std::move(reqs);
    pending_.clear();
  }
  if (!buckets_in_flight_ || end_of_backward) complete_in_flight();
}

void Engine::gather(const std::string& grp, int32_t hold_until) {
  auto it = holder_.find(grp);
  if (it != holder_.end()) {
    it->second = std::max(it->second, hold_until);
    return;
  }
  const Group& gr = groups_[group_index_.at(grp)];
  const Group* xp = expert_part(grp);
  holder_[grp] = hold_until;
  live_gathered_elems_ += gather_elems(grp);
  if (planning_gathers_) {  // plan_param_reads' dry run: the order only
    gather_order_.push_back(group_index_.at(grp));
    return;
  }
  const uint64_t dense_total = checked_mul(gr.shard, static_cast<uint64_t>(dp_), "gathered elements");
  const uint64_t total = xp == nullptr ? dense_total
                                       : checked_add(dense_total, checked_mul(xp->shard, static_cast<uint64_t>(xp->gsize),
                                                                              "gathered elements"),
                                                     "gathered elements");
  void* p = alloc(Tier::gpu, checked_mul(total, pbytes_, "gathered bytes"), Category::buffers,
                  "gathered." + grp);
  const void* src = params_ != nullptr ? at(params_, gr.part_off, pbytes_) : nullptr;
  void* stage = nullptr;
  const void* xsrc = xp != nullptr && params_ != nullptr ? at(params_, xp->part_off, pbytes_) : nullptr;
  if (plan_.strategy.offload_param != planner::Offload::none) {  // schedule.cpp gather
    // The rank's dense shard, then its experts' shard (with expert parallelism): the planner's
    // shard_bytes.
    const uint64_t xshard = xp != nullptr ? xp->shard : 0;
    stage = alloc(Tier::gpu, checked_mul(gr.shard + xshard, pbytes_, "staging bytes"),
                  Category::buffers, "param_stage." + grp);
    if (param_nvme_) {
      read_shard(group_index_.at(grp), stage);  // from the swap file
    } else {
      // From the host tier. On a GPU this copy waits for the compute stream's queued work, so
      // a prefetched gather of offloaded parameters does not overlap compute yet (review
      // finding 10); an asynchronous copy the comm stream waits on would, and is the next
      // step once a GPU can measure it.
      dev_.copy(stage, src, gr.shard * pbytes_);
      if (xp != nullptr) dev_.copy(at(stage, gr.shard, pbytes_), xsrc, xshard * pbytes_);
    }
    src = stage;
    xsrc = at(stage, gr.shard, pbytes_);
  }
  gathered_[grp] = p;
  // With overlap_comm the all-gather is left in flight, to be waited for when a run that
  // uses the group starts (start_run); an offloaded group's staging buffer, the all-gather's
  // source, lives until the end of that op. Without, the all-gather is waited for now and
  // the staging buffer freed at this op's end (schedule.cpp gather predicts both).
  CommRequest req = comm_.iall_gather(src, p, gr.shard, pdt_);
  if (xp != nullptr) {  // the experts' shards, over the expert-data-parallel group
    auto dense = std::make_shared<CommRequest>(std::move(req));
    auto experts = std::make_shared<CommRequest>(
        xp->comm->iall_gather(xsrc, at(p, dense_total, pbytes_), xp->shard, pdt_));
    req = CommRequest([dense, experts] {
      dense->wait();
      experts->wait();
    });
  }
  if (overlap_) {
    gathering_[grp] = Gathering{std::move(req), stage};
    return;
  }
  req.wait();
  if (stage != nullptr) staged_.push_back(stage);
}

// ZeRO-3: gather the run's group, then prefetch the groups of the following runs while the
// newly gathered elements stay within stage3_prefetch_bucket_size and everything gathered
// within stage3_max_live_parameters.
void Engine::start_run(int32_t r) {
  gather(runs_[static_cast<std::size_t>(r)].group, r);
  uint64_t prefetched = 0;
  for (std::size_t j = static_cast<std::size_t>(r) + 1; j < runs_.size(); ++j) {
    const std::string& grp = runs_[j].group;
    auto it = holder_.find(grp);
    if (it != holder_.end()) {
      it->second = std::max(it->second, static_cast<int32_t>(j));
      continue;
    }
    const uint64_t e = gather_elems(grp);
    if (prefetched + e > plan_.strategy.buffers.prefetch_bucket_size) break;
    if (live_gathered_elems_ + e > plan_.strategy.buffers.max_live_parameters) break;
    prefetched += e;
    gather(grp, static_cast<int32_t>(j));
  }
  wait_gathered(runs_[static_cast<std::size_t>(r)].group);  // this run's, once all are issued
}

void Engine::wait_gathered(const std::string& grp) {
  auto it = gathering_.find(grp);
  if (it == gathering_.end()) return;
  it->second.req.wait();
  // The staging buffer goes back with this op's frees (a position allocates before it frees).
  if (it->second.stage != nullptr) staged_.push_back(it->second.stage);
  gathering_.erase(it);
}

void Engine::end_run(int32_t r) {
  for (auto it = holder_.begin(); it != holder_.end();) {
    if (it->second <= r) {
      wait_gathered(it->first);  // never in flight here (its run has started); kept safe
      if (!planning_gathers_) dev_.arena(Tier::gpu).free(gathered_.at(it->first));
      live_gathered_elems_ -= gather_elems(it->first);
      gathered_.erase(it->first);
      it = holder_.erase(it);
    } else {
      ++it;
    }
  }
}

void Engine::sample(int32_t pos) {
  planner::TimelineSample t;
  t.pos = pos;
  for (Tier tier : planner::kTiers)
    for (Category c : planner::kCategories)
      t.bytes[static_cast<std::size_t>(tier)][static_cast<std::size_t>(c)] = dev_.arena(tier).in_use(c);
  timeline_.push_back(t);
}

void Engine::micro_step() {
  const bool record = step_ == first_step_ && micro_ == 0;
  sac_reused_.clear();
  std::fill(aux_counts_.begin(), aux_counts_.end(), 0.0);
  std::fill(aux_psum_.begin(), aux_psum_.end(), 0.0);
  if (record) sample(-1);
  if (param_nvme_) {  // this micro-step's shard reads, the first ones issued now
    next_read_ = next_use_ = entry_ = 0;
    issue_param_reads();
  }
  for (int32_t i = 0; i < n_pos_; ++i) {
    const Op& op = g_.op(g_.order[static_cast<std::size_t>(i)]);
    if (op.phase == Phase::optimizer) continue;  // after the last micro-step only
    const int32_t run = stage_ == 3 ? run_at_[static_cast<std::size_t>(i)] : -1;
    if (run >= 0 && runs_[static_cast<std::size_t>(run)].start == i) start_run(run);
    for (TensorId t : op.inputs) touch(t);
    for (TensorId t : op.outputs) touch(t);
    // Scratch: fp32 copies of 16-bit weights (filled) and fp32 weight gradients (zeroed).
    std::vector<float*>& w32 = w32_;
    std::vector<std::pair<TensorId, float*>>& dw32 = dw32_;
    w32.assign(op.params.size(), nullptr);
    dw32.clear();
    for (TensorId s : op.scratch) {
      touch(s);
      const Tensor& x = g_.tensor(s);
      float* p = static_cast<float*>(buf_[static_cast<std::size_t>(s)]);
      if (x.source < 0) continue;
      if (g_.tensor(x.source).kind == TensorKind::param) {
        const auto k = std::find(op.params.begin(), op.params.end(), x.source) - op.params.begin();
        w32[static_cast<std::size_t>(k)] = p;  // filled below, once the grads are in place
      } else {
        dev_.zero(p, x.bytes);
        dw32.emplace_back(x.source, p);
      }
    }
    // Expert parallelism's all-to-all buffer, where the planner's schedule puts it.
    if (const uint64_t b = a2a_bytes(op); b > 0)
      a2a_ = dev_.arena(Tier::gpu).alloc(b, Category::buffers, "a2a." + op.name);
    if (stage_ >= 2)
      for (TensorId gt : op.grads) alloc_grad(gt);
    for (std::size_t k = 0; k < op.params.size(); ++k)
      if (w32[k] != nullptr) {
        const Tensor& w = g_.tensor(op.params[k]);
        dev_.to_f32(w32[k], ptr(op.params[k]), pdt_, static_cast<int64_t>(w.bytes / w.elem_bytes));
      }

    if (record) sample(i);
    run_op(op, w32);

    for (auto& [gt, p] : dw32) {
      const Tensor& gx = g_.tensor(gt);
      dev_.accumulate_to(ptr(gt), p, pdt_, static_cast<int64_t>(gx.bytes / gx.elem_bytes));
    }
    for (TensorId s : op.scratch) {
      dev_.arena(Tier::gpu).free(buf_[static_cast<std::size_t>(s)]);
      buf_[static_cast<std::size_t>(s)] = nullptr;
    }
    if (a2a_ != nullptr) dev_.arena(Tier::gpu).free(std::exchange(a2a_, nullptr));
    for (void* p : staged_) dev_.arena(Tier::gpu).free(p);
    staged_.clear();
    for (TensorId t : lv_.dies_at[static_cast<std::size_t>(i)]) {
      dev_.arena(Tier::gpu).free(buf_[static_cast<std::size_t>(t)]);
      buf_[static_cast<std::size_t>(t)] = nullptr;
    }
    if (stage_ >= 2) {
      for (TensorId gt : op.grads)
        if (lv_.last_grad_write[static_cast<std::size_t>(gt)] == i) pending_.push_back(gt);
      flush_if_full(i == last_bwd_);
    }
    if (run >= 0 && runs_[static_cast<std::size_t>(run)].end == i) end_run(run);
  }
}

// The key of a dropout site's mask in one micro-step: from the seed, the site (its mask
// tensor's name, which a recomputed forward shares with the first), the step and the
// micro-step. Each rank's micro-batch holds the global batch's rows from rank * B, so rank r
// starts its mask at element r * n: the masks are those of one rank running the global batch.
uint64_t Engine::dropout_key(uint64_t seed, std::string_view site, int64_t step, int64_t micro) {
  uint64_t h = 0xcbf29ce484222325ULL;  // FNV-1a of the site name
  for (char c : site) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ULL;
  uint64_t k = mix64(seed ^ 0x64726f706f7574ULL);  // "dropout"
  k = mix64(k ^ h);
  k = mix64(k ^ static_cast<uint64_t>(step));
  return mix64(k ^ static_cast<uint64_t>(micro));
}

// Attention dropout inside a flash op (forward, its recomputation and its backward): the
// probability, and the key of the mask the three-step attention's dropout op of the same
// layer would draw (its site h.L.attn.drop.mask), so both paths drop the same entries.
std::pair<float, uint64_t> Engine::flash_dropout(const Op& op) const {
  const double p = g_.options.dropout ? plan_.model.attn_dropout : 0.0;
  if (p <= 0) return {0.0f, 0};
  const std::size_t at = op.name.rfind(".attn.flash");
  const std::string site = op.name.substr(0, at) + ".attn.drop.mask";
  const uint64_t n = static_cast<uint64_t>(B_) * static_cast<uint64_t>(NH_) *
                     static_cast<uint64_t>(T_) * static_cast<uint64_t>(T_);
  return {static_cast<float>(p),
          dropout_key(plan_.seed, site, step_, micro_) + static_cast<uint64_t>(rank_) * n};
}

// ---- Mixture of experts -----------------------------------------------------------------------

// The experts' weights are expert after expert: gate_up's (2 Fe, C) blocks (gate rows, then
// up), proj's (C, Fe). Each expert multiplies its block of dispatched rows (Engine::expert_off_,
// set by the layer's dispatch); an expert that got no rows does nothing.
void Engine::expert_matmul(const Op& op, void* w) {
  const auto dim = [&](TensorId x) { return g_.tensor(x).shape.back(); };
  const int64_t in = dim(op.inputs[0]), out = dim(op.outputs[0]);
  const bool gate_up = op.outputs.size() == 2;
  const int64_t block = (gate_up ? 2 : 1) * in * out;  // one expert's weights
  const uint64_t eb = dtype_bytes(adt_);
  for (const ExpertSegment& sg : expert_segs_[static_cast<std::size_t>(op.layer)]) {
    const int64_t r0 = sg.row, rows = sg.rows;
    if (rows == 0) continue;
    const void* x = at(ptr(op.inputs[0]), static_cast<uint64_t>(r0 * in), eb);
    std::byte* we = at(w, static_cast<uint64_t>(sg.expert * block), eb);
    for (std::size_t o = 0; o < op.outputs.size(); ++o)
      dev_.matmul_forward(at(ptr(op.outputs[o]), static_cast<uint64_t>(r0 * out), eb), adt_, x,
                          we + o * static_cast<uint64_t>(in * out) * eb, nullptr, adt_, rows, in, out);
  }
}

// Backward: inputs {d_out, x}, outputs {d_x}; d_out's rows are (d gate | d up) for gate_up,
// whose (2 Fe, C) block takes them in one GEMM.
void Engine::expert_matmul_backward(const Op& op, void* w, void* dw) {
  const auto dim = [&](TensorId x) { return g_.tensor(x).shape.back(); };
  const int64_t in = dim(op.inputs[1]), out = dim(op.inputs[0]);
  const uint64_t eb = dtype_bytes(adt_);
  for (const ExpertSegment& sg : expert_segs_[static_cast<std::size_t>(op.layer)]) {
    const int64_t r0 = sg.row, rows = sg.rows;
    if (rows == 0) continue;
    const uint64_t wo = static_cast<uint64_t>(sg.expert * in * out);
    dev_.matmul_backward(at(ptr(op.outputs[0]), static_cast<uint64_t>(r0 * in), eb), at(dw, wo, eb), nullptr,
                         at(ptr(op.inputs[0]), static_cast<uint64_t>(r0 * out), eb),
                         at(ptr(op.inputs[1]), static_cast<uint64_t>(r0 * in), eb), at(w, wo, eb), adt_,
                         rows, in, out);
  }
}

// After a MoE layer's forward routing (not its recomputation): its top-k choices and
// probability sums join the micro-step's load-balancing loss (transformers'
// load_balancing_loss_func over every MoE layer at once). Once the last MoE layer has routed,
// the loss's gradient on each probability is known (aux_dprob_):
//   d(coef E sum_e c_e P_e / Ntot^2) / d p = coef E c_e / Ntot^2 per expert,
// scaled as the cross-entropy's (the mean over the global batch of every micro-step, times
// the loss scale).
void Engine::moe_route_done(const Op& op) {
  if (aux_coef_ <= 0 || op.phase != Phase::forward) return;
  const int64_t N = B_ * T_;
  std::vector<int64_t> off(static_cast<std::size_t>(n_experts_ + 1));
  std::vector<double> psum(static_cast<std::size_t>(n_experts_));
  dev_.moe_route_stats(expert_idx(op.outputs[1]), static_cast<const float*>(ptr(op.outputs[0])), N,
                       n_experts_, top_k_, off.data(), psum.data());
  for (int64_t e = 0; e < n_experts_; ++e) {
    const auto k = static_cast<std::size_t>(e);
    aux_counts_[k] += static_cast<double>(off[k + 1] - off[k]);
    aux_psum_[k] += psum[k];
  }
  const double ntot = static_cast<double>(N * n_moe_layers_);
  const double denom = ntot * ntot * dp_ * static_cast<double>(plan_.strategy.grad_accum);
  for (int64_t e = 0; e < n_experts_; ++e)
    aux_dprob_[static_cast<std::size_t>(e)] = static_cast<float>(
        loss_scale_ * aux_coef_ * static_cast<double>(n_experts_) * aux_counts_[static_cast<std::size_t>(e)] / denom);
}

// ---- expert parallelism ----------------------------------------------------------------------
// The ep ranks of a group exchange tokens: expert e lives on group position e / (E/ep). A
// rank's dispatch writes its k B T routed rows grouped by expert (then token, then slot), which
// is also grouped by destination: the block for position d is experts [d E/ep, (d+1) E/ep).
// Each position receives, from every source in rank order, that source's rows for its experts,
// grouped by expert: its expert GEMMs run per (source, expert) segment. Everything coming back
// (the experts' outputs, the gradients of their inputs) returns in the order it came, so it
// lands in the sender's dispatch order and the dispatch's own kernels take it from there.

// The planner's all-to-all buffer (schedule.cpp alltoall_buffer_bytes): the k rows of each of
// the op's tokens, in the tokens' storage.
uint64_t Engine::a2a_bytes(const Op& op) const {
  if (ep_ <= 1) return 0;
  TensorId tokens = -1;
  switch (op.kind) {
    case OpKind::moe_dispatch: tokens = op.inputs.front(); break;
    case OpKind::moe_combine: tokens = op.outputs.front(); break;
    case OpKind::moe_combine_bwd: tokens = op.inputs.front(); break;
    case OpKind::moe_dispatch_bwd: tokens = op.outputs.front(); break;
    default: return 0;
  }
  const Tensor& x = g_.tensor(tokens);
  const int64_t n_tokens = x.shape[0] * x.shape[1];
  return checked_mul(x.bytes / static_cast<uint64_t>(n_tokens), static_cast<uint64_t>(top_k_ * n_tokens),
                     "all-to-all buffer bytes");
}

void Engine::moe_dispatch_ep(const Op& op) {
  const auto L = static_cast<std::size_t>(op.layer);
  const int64_t N = B_ * T_, El = local_experts_;
  const ExpertIdx idx = expert_idx(op.inputs[1]);
  dev_.moe_dispatch(a2a_, ptr(op.inputs[0]), idx, adt_, N, top_k_, n_experts_, C_);
  std::vector<int64_t>& off = expert_off_[L];
  dev_.moe_route_stats(idx, nullptr, N, n_experts_, top_k_, off.data(), nullptr);
  // Rows per (destination, its expert), exchanged: recv[s El + e] from source s for expert e.
  std::vector<uint64_t> send(static_cast<std::size_t>(n_experts_)), recv(send.size());
  for (int64_t e = 0; e < n_experts_; ++e)
    send[static_cast<std::size_t>(e)] = static_cast<uint64_t>(off[static_cast<std::size_t>(e) + 1] - off[static_cast<std::size_t>(e)]);
  ep_comm_->all_to_all_u64(send.data(), recv.data(), static_cast<int>(El));
  std::vector<ExpertSegment>& segs = expert_segs_[L];
  segs.clear();
  int64_t row = 0;
  for (int s = 0; s < ep_; ++s) {
    uint64_t sent = 0, got = 0;
    for (int64_t e = 0; e < El; ++e) {
      const auto k = static_cast<std::size_t>(s * El + e);
      sent += send[k];
      got += recv[k];
      segs.push_back({row, static_cast<int64_t>(recv[k]), e});
      row += static_cast<int64_t>(recv[k]);
    }
    ep_send_[L][static_cast<std::size_t>(s)] = sent;
    ep_recv_[L][static_cast<std::size_t>(s)] = got;
  }
  // The rows the plan made room for (balanced routing: k B T; --moe-routing worst: all the ep
  // group's tokens on this rank's experts). Every rank learns of an overflow anywhere, and
  // every rank stops, before anything is sent.
  // (Host values through all_to_all_u64: every rank learns every rank's rows.)
  const auto planned = static_cast<uint64_t>(g_.tensor(op.outputs[0]).shape[0]);
  const std::vector<uint64_t> mine(static_cast<std::size_t>(dp_), static_cast<uint64_t>(row));
  std::vector<uint64_t> rows(mine.size());
  comm_.all_to_all_u64(mine.data(), rows.data(), 1);
  const auto most = std::max_element(rows.begin(), rows.end());
  if (*most > planned)  // every rank stops together; the most loaded one says why
    throw StepFailed(fmt::format("{}: {} routed rows arrived, the plan holds {}: the routing is not "
                                 "balanced", op.name, *most, planned),
                     "plan with --moe-routing worst (room for every token of the ep group on one "
                     "rank's experts), or a smaller --ep",
                     most - rows.begin() == rank_);
  ep_exchange(a2a_, ptr(op.outputs[0]), op.layer, true);
}

// Rows between this rank's dispatch order and its experts' ranks, by the layer's dispatch
// counts: out to the experts (source-major where they land), or back from them (into dispatch
// order).
void Engine::ep_exchange(const void* src, void* dst, int layer, bool to_experts) {
  const auto L = static_cast<std::size_t>(layer);
  const std::vector<uint64_t>& out = to_experts ? ep_send_[L] : ep_recv_[L];
  const std::vector<uint64_t>& in = to_experts ? ep_recv_[L] : ep_send_[L];
  std::vector<uint64_t> sc(out.size()), rc(in.size());
  for (std::size_t s = 0; s < sc.size(); ++s) {
    sc[s] = out[s] * static_cast<uint64_t>(C_);
    rc[s] = in[s] * static_cast<uint64_t>(C_);
  }
  ep_comm_->all_to_all_v(src, sc, dst, rc, adt_);
}

// Expert-side rows in this rank's dispatch order: as they are without expert parallelism,
// else brought back into the op's all-to-all buffer.
const void* Engine::rows_home(const void* expert_rows, int layer) {
  if (ep_ == 1) return expert_rows;
  ep_exchange(expert_rows, a2a_, layer, false);
  return a2a_;
}

// Where an op reads q, k and v, from its input `first` on: Qwen3's normed q|k (then v from
// what follows: the fused rows or the v projection), three projections (torchtitan's per-op
// recomputation: h.L.attn.q, .k, .v), or the fused rows; and how many inputs that took. The
// values' ops and the q/k norms read no normed q|k: they start at the fused rows or q.
std::pair<Device::QkvIn, std::size_t> Engine::qkv_in(const Op& op, std::size_t first) const {
  const auto id = [&](std::size_t i) { return op.inputs.at(first + i); };
  const auto is = [&](std::size_t i, std::string_view suffix) { return g_.tensor(id(i)).name.ends_with(suffix); };
  const int64_t NH = heads_.NH, KVH = heads_.KVH, HS = heads_.HS, R = (NH + 2 * KVH) * HS;
  const uint64_t eb = dtype_bytes(adt_);
  const auto at_elem = [&](TensorId x, int64_t e) {
    return static_cast<std::byte*>(ptr(x)) + static_cast<uint64_t>(e) * eb;
  };
  if (is(0, ".attn.qk_norm.out")) {
    std::byte* qk = at_elem(id(0), 0);
    const int64_t QK = (NH + KVH) * HS;
    if (is(1, ".attn.q")) return {{qk, qk + static_cast<uint64_t>(NH * HS) * eb, ptr(id(3)), QK, QK, KVH * HS}, 4};
    return {{qk, qk + static_cast<uint64_t>(NH * HS) * eb, at_elem(id(1), (NH + KVH) * HS), QK, QK, R}, 2};
  }
  if (is(0, ".attn.q")) return {{ptr(id(0)), ptr(id(1)), ptr(id(2)), NH * HS, KVH * HS, KVH * HS}, 3};
  return {{at_elem(id(0), 0), at_elem(id(0), NH * HS), at_elem(id(0), (NH + KVH) * HS), R, R, R}, 1};
}

// A projection torchtitan's per-op recomputation runs apart from its fused weight: its first
// row and the weight's rows (q, k, v of the q|k|v weight; gate, up of the gate|up weight);
// {0, 0} for any other matmul.
std::pair<int64_t, int64_t> Engine::projection_rows(const Op& op) const {
  const std::string_view n = std::string_view(op.name).substr(0, op.name.size() - (op.name.ends_with(".re") ? 3 : 0));
  const int64_t Q = heads_.NH * heads_.HS, KV = heads_.KVH * heads_.HS, F = plan_.model.n_inner;
  if (n.ends_with(".attn.q")) return {0, Q + 2 * KV};
  if (n.ends_with(".attn.k")) return {Q, Q + 2 * KV};
  if (n.ends_with(".attn.v")) return {Q + KV, Q + 2 * KV};
  if (n.ends_with(".mlp.gate") && op.outputs.size() == 1) return {0, 2 * F};
  if (n.ends_with(".mlp.up")) return {F, 2 * F};
  return {0, 0};
}

// A router's top-k indices: int32, or int64 (torch.topk's, which torchtitan's per-op
// recomputation keeps).
ExpertIdx Engine::expert_idx(TensorId t) const {
  return g_.tensor(t).elem_bytes == 8 ? ExpertIdx(static_cast<int64_t*>(ptr(t)))
                                      : ExpertIdx(static_cast<int32_t*>(ptr(t)));
}

// This micro-step's load-balancing loss times its coefficient (0 without one).
double Engine::aux_loss() const {
  if (aux_coef_ <= 0) return 0.0;
  const double ntot = static_cast<double>(B_ * T_ * n_moe_layers_);
  double s = 0.0;
  for (int64_t e = 0; e < n_experts_; ++e)
    s += aux_counts_[static_cast<std::size_t>(e)] / ntot * (aux_psum_[static_cast<std::size_t>(e)] / ntot);
  return aux_coef_ * static_cast<double>(n_experts_) * s;
}

void Engine::run_op(const Op& op, const std::vector<float*>& w32) {
  auto v = [&](TensorId t) { return ptr(t); };
  auto f = [&](TensorId t) { return static_cast<float*>(ptr(t)); };
  auto i32 = [&](TensorId t) { return static_cast<const int32_t*>(ptr(t)); };
  auto eidx = [&](TensorId t) { return expert_idx(t); };
  auto u8 = [&](TensorId t) { return static_cast<uint8_t*>(ptr(t)); };
  const DType t = adt_;
  auto weight = [&](std::size_t k) -> void* { return w32[k] != nullptr ? w32[k] : v(op.params[k]); };
  // The gradient an op accumulates into: its fp32 scratch, or the gradient itself.
  auto dweight = [&](std::size_t k) -> void* {
    const TensorId gt = op.grads[k];
    for (TensorId s : op.scratch)
      if (g_.tensor(s).source == gt) return buf_[static_cast<std::size_t>(s)];
    return v(gt);
  };
  // The bias after a module's weight (in, out): weight elements in, then the bias, as t.
  auto after = [&](void* p, int64_t elems) -> void* {
    return p == nullptr ? nullptr : at(p, static_cast<uint64_t>(elems), dtype_bytes(t));
  };
  auto last_dim = [&](TensorId x) { return g_.tensor(x).shape.back(); };
  // The attention heads of this op's layer: its sliding window, if it has one.
  auto heads = [&](const Op& o) {
    Device::Heads h = heads_;
    h.window = plan_.model.window.window_of(o.layer);
    return h;
  };
  auto numel = [&](TensorId x) {
    const Tensor& tx = g_.tensor(x);
    return static_cast<int64_t>(tx.bytes / tx.elem_bytes);
  };
  // The storage type of a tensor: float where the graph stores 4 bytes, else t.
  auto dtype = [&](TensorId x) { return g_.tensor(x).elem_bytes == 4 ? DType::fp32 : t; };
  const int64_t N = B_ * T_;
  switch (op.kind) {
    case OpKind::embedding:
      dev_.embedding_forward(v(op.outputs[0]), i32(op.inputs[0]), weight(0),
                             op.params.size() > 1 ? weight(1) : nullptr, t, B_, T_, C_);
      break;
    case OpKind::layernorm: {
      void* w = weight(0);
      dev_.layernorm_forward(v(op.outputs[0]), f(op.outputs[1]), v(op.inputs[0]), w, after(w, C_),
                             t, N, C_);
      break;
    }
    case OpKind::rmsnorm:
      if (is_qk_norm(op)) {  // inputs {q|k|v sources}, outputs {qk, stats}
        dev_.head_rmsnorm_forward(v(op.outputs[0]), f(op.outputs[1]), qkv_in(op, 0).first, weight(0),
                                  norm_eps_, t, N, heads_);
        break;
      }
      dev_.rmsnorm_forward(v(op.outputs[0]), f(op.outputs[1]), v(op.inputs[0]), weight(0), norm_eps_, t,
                           N, C_);
      break;
    case OpKind::rope:
      // q and k in place: one tensor holding both, or (torchtitan's per-op recomputation) q and
      // k apart. A recomputation skips a tensor it reads back from SAC's storage: the forward
      // rotated that one already.
      for (std::size_t i = 0; i < op.outputs.size(); ++i) {
        const TensorId x = op.outputs[i];
        if (op.phase == Phase::recompute && sac_reused_.contains(x)) continue;
        const int64_t n_heads = op.outputs.size() == 1 ? heads_.NH + heads_.KVH : i == 0 ? heads_.NH : heads_.KVH;
        dev_.rope_forward(v(x), rope_.inv_freq.data(), rope_.attention_factor, t, B_, T_, last_dim(x),
                          n_heads, heads_.HS, rot_);
      }
      break;
    case OpKind::swiglu:
      dev_.swiglu_forward(v(op.outputs[0]), v(op.inputs[0]), v(op.inputs[1]), t, numel(op.outputs[0]));
      break;
    case OpKind::matmul: {
      const int64_t in = last_dim(op.inputs[0]), out = last_dim(op.outputs[0]);
      void* w = weight(0);
      if (is_expert_op(op)) {
        expert_matmul(op, w);
        break;
      }
      if (const auto [r0, rows] = projection_rows(op); rows > 0) {
        // One projection of a fused weight (torchtitan's per-op recomputation counts q, k, v
        // and gate, up as matmuls of their own): rows [r0, r0 + out) of its (rows, in) weight
        // and bias.
        const bool bias = numel(op.params[0]) == rows * in + rows;
        dev_.matmul_forward(v(op.outputs[0]), dtype(op.outputs[0]), v(op.inputs[0]), after(w, r0 * in),
                            bias ? after(w, rows * in + r0) : nullptr, t, N, in, out);
        break;
      }
      if (op.outputs.size() == 2) {  // a fused gate|up weight (2F, in): its halves, one GEMM each
        dev_.matmul_forward(v(op.outputs[0]), dtype(op.outputs[0]), v(op.inputs[0]), w, nullptr, t, N, in, out);
        dev_.matmul_forward(v(op.outputs[1]), dtype(op.outputs[1]), v(op.inputs[0]), after(w, in * out),
                            nullptr, t, N, in, out);
        break;
      }
      const bool bias = numel(op.params[0]) == in * out + out;
      dev_.matmul_forward(v(op.outputs[0]), dtype(op.outputs[0]), v(op.inputs[0]), w,
                          bias ? after(w, in * out) : nullptr, t, N, in, out);
      break;
    }
    case OpKind::attn_scores:  // inputs {q|k|v sources}
      if (llama_) dev_.gqa_scores(v(op.outputs[0]), qkv_in(op, 0).first, t, B_, T_, heads(op));
      else dev_.attention_scores(v(op.outputs[0]), v(op.inputs[0]), t, B_, T_, C_, NH_);
      break;
    case OpKind::softmax:
      if (llama_) dev_.gqa_softmax(v(op.outputs[0]), v(op.inputs[0]), t, B_, T_, heads(op));
      else dev_.attention_softmax(v(op.outputs[0]), v(op.inputs[0]), t, B_, NH_, T_);
      break;
    case OpKind::dropout: {
      // Element offset rank * n (see dropout_key): the key advanced by that much.
      const int64_t n = numel(op.outputs[0]);
      const uint64_t key = dropout_key(plan_.seed, g_.tensor(op.outputs[1]).name, step_, micro_) +
                           static_cast<uint64_t>(rank_) * static_cast<uint64_t>(n);
      dev_.dropout_forward(v(op.outputs[0]), u8(op.outputs[1]), v(op.inputs[0]), t,
                           static_cast<float>(op.dropout_p), key, n);
      break;
    }
    case OpKind::attn_values:  // inputs {probs, q|k|v sources}
      if (llama_) dev_.gqa_values(v(op.outputs[0]), v(op.inputs[0]), qkv_in(op, 1).first, t, B_, T_, heads(op));
      else dev_.attention_values(v(op.outputs[0]), v(op.inputs[0]), v(op.inputs[1]), t, B_, T_, C_, NH_);
      break;
    case OpKind::flash_attention: {
      // inputs {q|k|v sources}, outputs {out, lse}.
      const auto [p, key] = flash_dropout(op);
      dev_.flash_attention_forward(v(op.outputs[0]), f(op.outputs[1]), qkv_in(op, 0).first, t, B_, T_,
                                   heads(op), p, key);
      break;
    }
    case OpKind::flash_attention_bwd: {
      // inputs {d_out, q|k|v sources, out, lse}, outputs {d_qkv}, scratch {dq_accum, dsum}.
      const auto [p, key] = flash_dropout(op);
      const auto [in, n] = qkv_in(op, 1);
      dev_.flash_attention_backward(v(op.outputs[0]), f(op.scratch[0]), f(op.scratch[1]),
                                    v(op.inputs[0]), in, v(op.inputs[1 + n]), f(op.inputs[2 + n]), t,
                                    B_, T_, heads(op), p, key);
      break;
    }
    case OpKind::sac_reuse:  // torchtitan's SAC: the forward's saved output is read where it is
      sac_reused_.insert(op.inputs.begin(), op.inputs.end());
      break;
    case OpKind::residual:
      dev_.residual_forward(v(op.outputs[0]), v(op.inputs[0]), v(op.inputs[1]), t, numel(op.outputs[0]));
      break;
    case OpKind::gelu:
      dev_.gelu_forward(v(op.outputs[0]), v(op.inputs[0]), t, numel(op.outputs[0]));
      break;
    case OpKind::cross_entropy: {
      const int64_t V = last_dim(op.inputs[0]);
      dev_.crossentropy_forward(f(op.inputs[0]), f(op.outputs[1]), i32(op.inputs[1]), N, V);
      dev_.loss_accumulate(f(op.outputs[1]), N);  // read once per step (step())
      break;
    }
    case OpKind::cross_entropy_bwd: {
      const int64_t V = last_dim(op.inputs[0]);
      // d(mean loss over the global batch of every micro-step), times the loss scale.
      const double denom = static_cast<double>(N) * dp_ * static_cast<double>(plan_.strategy.grad_accum);
      dev_.crossentropy_backward(v(op.outputs[0]), dtype(op.outputs[0]), f(op.inputs[0]),
                                 i32(op.inputs[1]), static_cast<float>(loss_scale_ / denom), N, V);
      break;
    }
    case OpKind::matmul_bwd: {
      const int64_t in = last_dim(op.inputs[1]), out = last_dim(op.inputs[0]);
      void* dw = dweight(0);
      if (is_expert_op(op)) {
        expert_matmul_backward(op, weight(0), dw);
        break;
      }
      const bool bias = numel(op.params[0]) == in * out + out;
      dev_.matmul_backward(v(op.outputs[0]), dw, bias ? after(dw, in * out) : nullptr,
                           v(op.inputs[0]), v(op.inputs[1]), weight(0), t, N, in, out);
      break;
    }
    case OpKind::layernorm_bwd: {
      void* dw = dweight(0);
      dev_.layernorm_backward(v(op.outputs[0]), dw, after(dw, C_), v(op.inputs[0]), v(op.inputs[1]),
                              weight(0), f(op.inputs[2]), t, N, C_);
      break;
    }
    case OpKind::gelu_bwd:
      dev_.gelu_backward(v(op.outputs[0]), v(op.inputs[1]), v(op.inputs[0]), t, numel(op.outputs[0]));
      break;
    case OpKind::dropout_bwd:
      dev_.dropout_backward(v(op.outputs[0]), v(op.inputs[0]), u8(op.inputs[1]), t,
                            static_cast<float>(op.dropout_p), numel(op.outputs[0]));
      break;
    case OpKind::attn_values_bwd:
      if (llama_)
        dev_.gqa_values_backward(v(op.outputs[0]), v(op.outputs[1]), v(op.inputs[0]), v(op.inputs[1]),
                                 qkv_in(op, 2).first, t, B_, T_, heads(op));
      else
        dev_.attention_values_backward(v(op.outputs[0]), v(op.outputs[1]), v(op.inputs[0]),
                                       v(op.inputs[1]), v(op.inputs[2]), t, B_, T_, C_, NH_);
      break;
    case OpKind::softmax_bwd:
      if (llama_)
        dev_.gqa_softmax_backward(v(op.outputs[0]), v(op.inputs[0]), v(op.inputs[1]), t, B_, T_, heads(op));
      else
        dev_.attention_softmax_backward(v(op.outputs[0]), v(op.inputs[0]), v(op.inputs[1]), t, B_, NH_, T_);
      break;
    case OpKind::attn_scores_bwd:
      if (llama_)
        dev_.gqa_scores_backward(v(op.outputs[0]), v(op.inputs[0]), qkv_in(op, 1).first, t, B_, T_, heads(op));
      else
        dev_.attention_scores_backward(v(op.outputs[0]), v(op.inputs[0]), v(op.inputs[1]), t, B_, T_, C_, NH_);
      break;
    case OpKind::rmsnorm_bwd:
      if (is_qk_norm(op)) {  // inputs {d_qkv, q|k|v sources, stats}, outputs {d_qkv} (in place)
        const auto [in, n] = qkv_in(op, 1);
        dev_.head_rmsnorm_backward(v(op.outputs[0]), dweight(0), in, weight(0), f(op.inputs[1 + n]), t, N,
                                   heads_);
        break;
      }
      dev_.rmsnorm_backward(v(op.outputs[0]), dweight(0), v(op.inputs[0]), v(op.inputs[1]), weight(0),
                            f(op.inputs[2]), t, N, C_);
      break;
    case OpKind::rope_bwd:
      dev_.rope_backward(v(op.outputs[0]), rope_.inv_freq.data(), rope_.attention_factor, t, B_, T_,
                         last_dim(op.outputs[0]), heads_.NH + heads_.KVH, heads_.HS, rot_);
      break;
    case OpKind::swiglu_bwd:  // N rows: B*T, or a MoE layer's dispatched rows
      dev_.swiglu_backward(v(op.outputs[0]), v(op.inputs[0]), v(op.inputs[1]), v(op.inputs[2]), t,
                           numel(op.inputs[1]) / last_dim(op.inputs[1]), last_dim(op.inputs[1]));
      break;
    case OpKind::moe_route:  // {logits} -> {probs, idx, weights}
      if (op.outputs.size() == 1) {  // per-op recomputation reads the top-k back: -> {probs}
        dev_.moe_route_forward(f(op.outputs[0]), ExpertIdx(), nullptr, v(op.inputs[0]), t, N, n_experts_,
                               top_k_, moe_renorm_);
        break;
      }
      dev_.moe_route_forward(f(op.outputs[0]), eidx(op.outputs[1]), f(op.outputs[2]), v(op.inputs[0]),
                             t, N, n_experts_, top_k_, moe_renorm_);
      moe_route_done(op);
      break;
    case OpKind::moe_dispatch: {  // {in, idx} -> {xe}; the layer's expert segments
      if (ep_ > 1) {
        moe_dispatch_ep(op);
        break;
      }
      dev_.moe_dispatch(v(op.outputs[0]), v(op.inputs[0]), eidx(op.inputs[1]), t, N, top_k_, n_experts_, C_);
      std::vector<int64_t>& off = expert_off_[static_cast<std::size_t>(op.layer)];
      dev_.moe_route_stats(eidx(op.inputs[1]), nullptr, N, n_experts_, top_k_, off.data(), nullptr);
      std::vector<ExpertSegment>& segs = expert_segs_[static_cast<std::size_t>(op.layer)];
      segs.clear();
      for (int64_t e = 0; e < n_experts_; ++e)
        segs.push_back({off[static_cast<std::size_t>(e)],
                        off[static_cast<std::size_t>(e) + 1] - off[static_cast<std::size_t>(e)], e});
      break;
    }
    case OpKind::moe_combine:  // {ye, weights, idx} -> {out}; the experts' rows come home
      dev_.moe_combine(v(op.outputs[0]), rows_home(v(op.inputs[0]), op.layer), f(op.inputs[1]),
                       eidx(op.inputs[2]), t, N, top_k_, n_experts_, C_);
      break;
    case OpKind::moe_combine_bwd: {  // {d_out, ye, weights, idx} -> {d_ye, d_weights}
      // With expert parallelism: ye home (into the buffer), the gradients of this rank's rows
      // into d_ye (k B T of its rows, in dispatch order), then those out to their experts
      // through the buffer (ye is done with), into d_ye in the order the experts hold them.
      dev_.moe_combine_backward(v(op.outputs[0]), f(op.outputs[1]), v(op.inputs[0]),
                                rows_home(v(op.inputs[1]), op.layer), f(op.inputs[2]),
                                eidx(op.inputs[3]), t, N, top_k_, n_experts_, C_);
      if (ep_ > 1) {
        dev_.copy(a2a_, v(op.outputs[0]), static_cast<uint64_t>(N * top_k_ * C_) * dtype_bytes(t));
        ep_exchange(a2a_, v(op.outputs[0]), op.layer, true);
      }
      break;
    }
    case OpKind::moe_dispatch_bwd:  // {d_xe, idx} -> {d_in} (accumulated), d_xe brought home
      dev_.moe_dispatch_backward(v(op.outputs[0]), rows_home(v(op.inputs[0]), op.layer),
                                 eidx(op.inputs[1]), t, N, top_k_, n_experts_, C_);
      break;
    case OpKind::moe_route_bwd:  // {d_weights, probs, idx} -> {d_logits}
      dev_.moe_route_backward(v(op.outputs[0]), dtype(op.outputs[0]), f(op.inputs[0]), f(op.inputs[1]),
                              eidx(op.inputs[2]), aux_coef_ > 0 ? aux_dprob_.data() : nullptr, N,
                              n_experts_, top_k_, moe_renorm_);
      break;
    case OpKind::gate_mul:  // {x, g} -> {out}
      dev_.gate_mul_forward(v(op.outputs[0]), v(op.inputs[0]), v(op.inputs[1]), t, N, C_);
      break;
    case OpKind::gate_mul_bwd:  // {d_out, x, g} -> {d_x, d_g}
      dev_.gate_mul_backward(v(op.outputs[0]), v(op.outputs[1]), v(op.inputs[0]), v(op.inputs[1]),
                             v(op.inputs[2]), t, N, C_);
      break;
    case OpKind::embedding_bwd:
      dev_.embedding_backward(dweight(0), op.grads.size() > 1 ? dweight(1) : nullptr,
                              v(op.inputs[0]), i32(op.inputs[1]), t, B_, T_, C_);
      break;
    default:
      throw Error(fmt::format("zero-run cannot execute op {} ({})", op.name, models::to_string(op.kind)),
                  "this op belongs to a feature the runtime does not execute");
  }
}

// ---- the optimizer -------------------------------------------------------------------------

Engine::OwnedGrads Engine::owned_grads(const Group& gr) const {
  const auto [lo, hi] = owned(gr);
  // Offloaded: the host fp32 partition the backward pass filled (stage 1 converts into it).
  if (offload_) return {host_grads_[cur_] + gr.part_off, hi - lo, DType::fp32};
  const uint64_t k = stage_ >= 2 ? gr.part_off : gr.flat_off + lo;
  return {at(grads_, k, pbytes_), hi - lo, pdt_};
}

// Stages 1-2: every rank updated its slice of the flat params; share them, in place.
void Engine::gather_params() {
  if ((stage_ != 1 && stage_ != 2) || !collectives_) return;
  for (const Group& gr : groups_) {
    std::vector<uint64_t> counts(static_cast<std::size_t>(gr.gsize), 0);
    for (int r = 0; r < gr.gsize; ++r) {
      const uint64_t rlo = std::min(gr.elems, static_cast<uint64_t>(r) * gr.shard);
      counts[static_cast<std::size_t>(r)] = std::min(gr.elems, rlo + gr.shard) - rlo;
    }
    gr.comm->all_gather_in_place(at(params_, gr.flat_off, pbytes_), counts, pdt_);
  }
}

// The host partition of updated parameters (16-bit, partition layout; or the fp32 master
// when training in fp32) goes to the device's params.
void Engine::apply_host_params(const void* host_params) {
  std::string failure, hint;
  try {
    for (const Group& gr : groups_) {
      const auto [lo, hi] = owned(gr);
      const uint64_t p0 = stage_ >= 3 ? gr.part_off : gr.flat_off + lo;
      to_params(p0, at(const_cast<void*>(host_params), gr.part_off, pbytes_), hi - lo);
    }
    if (param_nvme_) end_param_write();
  } catch (const Error& e) {
    failure = e.what();
    hint = e.hint();
    drain_param_io();
  }
  if (param_nvme_) fail_together(failure, hint, "the parameter write-back");
  gather_params();
}

void Engine::to_params(uint64_t part_elem, const void* src, uint64_t n) {
  if (param_nvme_)
    put_params(part_elem, src, n);
  else
    dev_.copy(at(params_, part_elem, pbytes_), src, n * pbytes_);
}

// The CPU Adam (or SGD) over the owned partition in the host tier, reading host_grads_[g_buf],
// which it zeroes afterwards. With `to_device` the new parameters return to the device now:
// 16-bit ones through two alternating tiles of buffers.offload_tile_size elements, fp32 ones
// straight from the master weights. The tiles are double-buffered: tile k's copy to the
// device is asynchronous (copy slot = tile index) and runs while the CPU computes tile k+1
// into the other tile; before the CPU writes a tile again it waits for that tile's previous
// copy, and before the tiles are freed it waits for both (which also orders the device's
// later work after the copies). With offload_param=nvme the tiles go to the swap file's
// write-back instead, synchronously. Without `to_device` (the delayed update), the 16-bit
// parameters go to the host copy dpu_params_ and nothing touches the device or an arena:
// safe on the delayed update's thread.
void Engine::offload_update(int g_buf, double inv_scale, double clip, int64_t t, bool to_device) {
  if (nvme_) return nvme_update(g_buf, inv_scale, clip, t, to_device);
  const auto kind = plan_.strategy.optimizer;
  const AdamConfig adam{.lr = opt_.lr, .beta1 = opt_.beta1, .beta2 = opt_.beta2, .eps = opt_.eps,
                        .weight_decay = opt_.weight_decay,
                        .adamw = kind == planner::OptimizerKind::adamw};
  const AdamStepArgs args{.step = t, .inv_loss_scale = inv_scale, .clip_coef = clip};
  float* grads = host_grads_[g_buf];
  const bool mixed = pdt_ != DType::fp32;
  const uint64_t tile = std::min(plan_.strategy.buffers.offload_tile_size, part_);
  void* tiles[2] = {nullptr, nullptr};
  void* param_out = to_device ? nullptr : dpu_params_;
  const bool async = to_device && mixed && !param_nvme_;  // tiles copied by copy_to_device_async
  if (to_device && mixed) {
    tiles[0] = alloc(Tier::cpu, tile * pbytes_, Category::buffers, "param_tile.0");
    tiles[1] = alloc(Tier::cpu, tile * pbytes_, Category::buffers, "param_tile.1");
    if (t == first_step_ + 1) sample(opt_pos_);  // t: step_ may be moving (delayed update)
  }
  // Before the tiles go back to the arena, their copies must be done (on an error path too: a
  // GPU's h2d stream may still be reading them); a failing wait adds nothing to the error in
  // hand.
  auto free_tiles = [&] {
    if (tiles[0] == nullptr) return;
    for (int slot = 0; slot < Device::kCopySlots; ++slot) {
      try {
        dev_.wait_copy(slot);
      } catch (const Error&) {
      }
    }
    dev_.arena(Tier::cpu).free(tiles[0]);
    dev_.arena(Tier::cpu).free(tiles[1]);
  };
  int next = 0;
  std::string failure, hint;  // writing the parameters back to their swap file
  try {
    for (const Group& gr : groups_) {
      const auto [lo, hi] = owned(gr);
      const uint64_t n = hi - lo, k0 = gr.part_off;
      const uint64_t p0 = stage_ >= 3 ? gr.part_off : gr.flat_off + lo;
      for (uint64_t c = 0; c < n; c += tile) {
        const uint64_t m = std::min(tile, n - c);
        if (async) dev_.wait_copy(next);  // the tile's previous copy has read it
        void* out = param_out != nullptr ? at(param_out, k0 + c, pbytes_) : tiles[next];
        if (!mixed) out = nullptr;  // fp32: the master weights are the parameters
        if (kind == planner::OptimizerKind::sgd) {
          cpu::sgd_step(master_ + k0 + c, exp_avg_ + k0 + c, grads + k0 + c, DType::fp32, out, pdt_,
                        opt_.lr, opt_.momentum, opt_.weight_decay,
                        static_cast<float>(inv_scale * clip), static_cast<int64_t>(m));
        } else {
          cpu_adam_step(adam, args,
                        AdamTensors{.n = m,
                                    .master = master_ + k0 + c,
                                    .exp_avg = exp_avg_ + k0 + c,
                                    .exp_avg_sq = exp_avg_sq_ + k0 + c,
                                    .grads = grads + k0 + c,
                                    .grad_dtype = DType::fp32,
                                    .param_out = out,
                                    .param_out_dtype = pdt_});
        }
        if (async) {
          dev_.copy_to_device_async(at(params_, p0 + c, pbytes_), tiles[next], m * pbytes_, next);
          next ^= 1;
        } else if (to_device) {
          const void* src = mixed ? tiles[next] : static_cast<const void*>(master_ + k0 + c);
          to_params(p0 + c, src, m);
          next ^= 1;
        }
      }
    }
    if (async)
      for (int slot = 0; slot < Device::kCopySlots; ++slot) dev_.wait_copy(slot);
    if (to_device && param_nvme_) end_param_write();
  } catch (const Error& e) {
    if (!(to_device && param_nvme_)) {  // a device error: nothing to agree on with the ranks
      free_tiles();
      throw;
    }
    failure = e.what();  // the swap file's write-back
    hint = e.hint();
    drain_param_io();
  }
  free_tiles();
  std::memset(grads, 0, part_ * 4);
  // On the main thread (to_device) every rank is here together.
  if (to_device && param_nvme_) fail_together(failure, hint, "the parameter write-back");
}

void Engine::flush() {
  if (!dpu_pending_) return;
  join_dpu();
  dpu_pending_ = false;
  apply_host_params(dpu_params_ != nullptr ? dpu_params_ : static_cast<const void*>(master_));
}

StepStats Engine::optimizer_step() {
  StepStats st;
  // offload_param=nvme: a shard read that failed in this step's forward or backward (its
  // gather went on with zeros) fails the step on every rank before anything is updated.
  if (param_nvme_) {
    const std::string failure = std::exchange(param_failure_, {});
    fail_together(failure, std::exchange(param_hint_, {}), "reading the parameters");
  }
  const bool replicated = stage_ == 0;
  // Stages 0-1 hold whole gradients: sum them over the ranks (the loss gradient already
  // carries 1/dp). Stages 2-3 reduced them to their owners during backward.
  if (stage_ <= 1 && collectives_)
    for (const Group& gr : groups_)
      gr.comm->all_reduce_sum(at(grads_, gr.flat_off, pbytes_), gr.elems, pdt_);
  // The host reads the offloaded gradients below: the device's queued writes into them (a GPU
  // streams reduced segments into pinned memory) must be done.
  if (offload_) dev_.synchronize();
  // Stage 1 offloaded: the owned part of the summed 16-bit gradients goes to the host in fp32.
  if (offload_ && stage_ == 1) {
    dev_.zero(host_grads_[cur_], part_ * 4);
    for (const Group& gr : groups_) {
      const auto [lo, hi] = owned(gr);
      dev_.add_f32(host_grads_[cur_] + gr.part_off, at(grads_, gr.flat_off + lo, pbytes_), pdt_,
                   static_cast<int64_t>(hi - lo));
    }
    dev_.synchronize();
  }
  const double inv_scale = 1.0 / static_cast<double>(loss_scale_);
  // Global norm: the sum of squares of the raw (loss-scaled) gradients each rank owns, summed
  // over the ranks; an inf or NaN anywhere is fp16 overflow.
  double sq = 0;
  bool finite = true;
  // Stage 0 with expert parallelism: the dense gradients are every rank's, the experts'
  // those of the rank's ep-group position: their squares are summed over the ep group.
  double sq_x = 0;
  for (const Group& gr : groups_) {
    const OwnedGrads g = owned_grads(gr);
    const GradSumSquares ss = offload_ ? grad_sum_squares(g.ptr, g.dtype, g.n)
                                       : dev_.grad_sum_squares(g.ptr, g.dtype, g.n);
    (replicated && gr.expert ? sq_x : sq) += ss.sum_sq;
    finite = finite && ss.finite;
  }
  if (replicated && ep_ > 1) {
    sq += ep_comm_->all_reduce_sum(finite ? sq_x : std::numeric_limits<double>::infinity());
    finite = std::isfinite(sq);
  }
  if (!finite) sq = std::numeric_limits<double>::infinity();
  if (!replicated && collectives_) sq = comm_.all_reduce_sum(sq);
  st.grad_norm = std::sqrt(sq) * inv_scale;
  st.loss_scale = loss_scale_;
  auto zero_grads = [&] {
    if (grads_ != nullptr) dev_.zero(grads_, (stage_ >= 2 ? part_ : n_params_) * pbytes_);
    if (offload_) std::memset(host_grads_[cur_], 0, part_ * 4);
  };
  // The delayed update of the previous step is applied now, after this step's backward ran on
  // the parameters it had not yet changed (ZeRO-Offload paper sec. 5.2).
  flush();
  if (!std::isfinite(sq)) {
    st.skipped = true;
    loss_scale_ = std::max(1.0f, loss_scale_ / 2);
    good_steps_ = 0;
    zero_grads();
    if (step_ == first_step_) sample(opt_pos_);
    return st;
  }
  const double clip = opt_.grad_clip > 0 ? clip_coefficient(sq, inv_scale, opt_.grad_clip) : 1.0;
  const int64_t t = step_ + 1;
  if (offload_) {
    if (grads_ != nullptr) dev_.zero(grads_, n_params_ * pbytes_);  // stage 1: read out above
    if (dpu_ && step_ >= opt_.dpu_warmup_steps) {
      // Launch this step's update; its parameters are applied after the next backward.
      const int g_buf = cur_;
      cur_ ^= 1;
      dpu_pending_ = true;
      if (step_ == first_step_) sample(opt_pos_);
      if (opt_.dpu_threaded)
        dpu_thread_ = std::thread([this, g_buf, inv_scale, clip, t] {
          offload_update(g_buf, inv_scale, clip, t, false);
        });
      else
        offload_update(g_buf, inv_scale, clip, t, false);
    } else {
      if (step_ == first_step_ && (dpu_ || (pdt_ == DType::fp32 && !nvme_))) sample(opt_pos_);
      offload_update(cur_, inv_scale, clip, t, !dpu_);
      if (dpu_ && nvme_)
        fail_together(std::exchange(dpu_failure_, {}), std::exchange(dpu_hint_, {}),
                      "the swapped optimizer step");
      if (dpu_) apply_host_params(dpu_params_ != nullptr ? dpu_params_ : static_cast<const void*>(master_));
      else gather_params();
    }
  } else {
    if (step_ == first_step_) sample(opt_pos_);
    const auto kind = plan_.strategy.optimizer;
    const AdamConfig adam{.lr = opt_.lr, .beta1 = opt_.beta1, .beta2 = opt_.beta2, .eps = opt_.eps,
                          .weight_decay = opt_.weight_decay,
                          .adamw = kind == planner::OptimizerKind::adamw};
    const AdamStepArgs args{.step = t, .inv_loss_scale = inv_scale, .clip_coef = clip};
    for (const Group& gr : groups_) {
      const OwnedGrads g = owned_grads(gr);
      const uint64_t k0 = replicated ? gr.flat_off : gr.part_off;  // state index of lo
      // Where the updated 16-bit (or fp32) parameter goes: without fp32 master weights (fp32
      // training) the parameters are the weights the optimizer updates.
      const uint64_t p0 = stage_ >= 3 ? gr.part_off : gr.flat_off + owned(gr).first;
      std::byte* param = at(params_, p0, pbytes_);
      float* w = master_ ? master_ + k0 : reinterpret_cast<float*>(param);
      void* out = master_ ? param : nullptr;
      if (kind == planner::OptimizerKind::sgd) {
        dev_.sgd_step(w, exp_avg_ + k0, g.ptr, pdt_, out, pdt_, opt_.lr, opt_.momentum,
                      opt_.weight_decay, static_cast<float>(inv_scale * clip), g.n);
      } else {
        dev_.adam_step(adam, args,
                       AdamTensors{.n = g.n, .master = w, .exp_avg = exp_avg_ + k0,
                                   .exp_avg_sq = exp_avg_sq_ + k0, .grads = g.ptr,
                                   .grad_dtype = pdt_, .param_out = out, .param_out_dtype = pdt_});
      }
    }
    gather_params();
    zero_grads();
  }
  if (pdt_ == DType::fp16 && ++good_steps_ >= opt_.loss_scale_window) {
    loss_scale_ *= 2;
    good_steps_ = 0;
  }
  return st;
}

StepStats Engine::step() {
  const auto t0 = std::chrono::steady_clock::now();
  aux_sum_ = 0;
  for (micro_ = 0; micro_ < plan_.strategy.grad_accum; ++micro_) {
    micro_step();
    aux_sum_ += aux_loss();
  }
  // The load-balancing loss joins the mean as transformers adds it to each forward's loss.
  loss_sum_ = dev_.loss_take() + aux_sum_ * static_cast<double>(B_ * T_);
  StepStats st = optimizer_step();
  ++step_;
  st.step = step_;
  const double tokens = static_cast<double>(B_ * T_ * plan_.strategy.grad_accum);
  st.loss = (collectives_ ? comm_.all_reduce_sum(loss_sum_) : loss_sum_) / (tokens * dp_);
  dev_.synchronize();
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

void Engine::save_weights(const std::string& path) {
  flush();
  const std::string tmp = path + ".tmp";
  if (rank_ == 0) {
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(canon_params_ * 4)) != 0) {
      if (fd >= 0) ::close(fd);
      throw Error(fmt::format("cannot write {}: {}", tmp, std::strerror(errno)));
    }
    ::close(fd);
  }
  comm_.barrier();
  const int fd = ::open(tmp.c_str(), O_WRONLY);
  if (fd < 0) throw Error(fmt::format("cannot open {}: {}", tmp, std::strerror(errno)));
  // Replicated (stage 0): rank 0 writes, and with expert parallelism the first rank of each
  // expert-data-parallel group its experts; partitioned: every rank its own part.
  auto writer = [&](const Group& gr) { return stage_ > 0 || (gr.expert ? gr.grank : rank_) == 0; };
  auto write_at = [&](const float* x, uint64_t m, uint64_t file_elem) {
    if (::pwrite(fd, x, m * 4, static_cast<off_t>(file_elem * 4)) != static_cast<ssize_t>(m * 4)) {
      ::close(fd);
      throw Error(fmt::format("write {}: {}", tmp, std::strerror(errno)));
    }
  };
  // Values of flat elements [flat, flat + m) go to their tensors' places in the full model
  // (the flat order itself without expert parallelism).
  auto put = [&](const float* x, uint64_t m, uint64_t flat) {
    if (ep_ == 1) return write_at(x, m, flat);
    while (m > 0) {
      const auto it = std::upper_bound(param_ids_.begin(), param_ids_.end(), flat, [&](uint64_t f, TensorId t) {
        return f < flat_off_[static_cast<std::size_t>(t)];
      });
      const TensorId t = *(it - 1);
      const uint64_t in = flat - flat_off_[static_cast<std::size_t>(t)];
      const uint64_t k = std::min(m, elems_of(g_.tensor(t)) - in);
      write_at(x, k, canon_off_[static_cast<std::size_t>(t)] + in);
      x += k;
      flat += k;
      m -= k;
    }
  };
  // Swapped master weights: each chunk of the partition to the flat places of its groups.
  if (nvme_)
    read_swapped_master([&](uint64_t flat, uint64_t m, const std::byte* x) {
      put(reinterpret_cast<const float*>(x), m, flat);
    });
  for (const Group& gr : groups_) {
    if (!writer(gr) || nvme_) continue;
    const auto [lo, hi] = owned(gr);
    const uint64_t k0 = stage_ == 0 ? gr.flat_off : gr.part_off;
    const uint64_t p0 = stage_ >= 3 ? gr.part_off : gr.flat_off + lo;
    // Through the staging blocks, so the file gets fp32 whatever the storage.
    std::vector<float> block_v(kStage);
    std::vector<std::byte> raw_v(kStage * 4);
    float* block = block_v.data();
    std::byte* raw = raw_v.data();
    for (uint64_t i = 0; i < hi - lo; i += kStage) {
      const uint64_t m = std::min<uint64_t>(kStage, hi - lo - i);
      if (master_) {
        dev_.copy(block, master_ + k0 + i, m * 4);
      } else {
        dev_.copy(raw, at(params_, p0 + i, pbytes_), m * pbytes_);
        for (uint64_t j = 0; j < m; ++j) block[j] = load_as_f32(raw, j, pdt_);
      }
      put(block, m, gr.flat_off + lo + i);
    }
  }
  ::close(fd);
  comm_.barrier();
  if (rank_ == 0 && std::rename(tmp.c_str(), path.c_str()) != 0)
    throw Error(fmt::format("rename {} to {}: {}", tmp, path, std::strerror(errno)));
  comm_.barrier();
}

}  // namespace zp::runtime
