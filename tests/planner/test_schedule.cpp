// The step's memory schedule: model states placed as ZeRO places them, reduce buckets,
// stage-3 gathers and prefetch, offload tiers, the profile's extra buffers, and the timeline.
// Expected sizes come from GPT-2's parameter formula written out here (12C^2 + 13C per
// block), not from the graph, and from counting the model's structure by hand.
#include <doctest/doctest.h>

#include <map>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "zp/error.hpp"
#include "zp/models/graph.hpp"
#include "zp/models/model_spec.hpp"
#include "zp/planner/allocator.hpp"
#include "zp/planner/estimate.hpp"
#include "zp/planner/schedule.hpp"

using namespace zp::planner;
using zp::models::load_model;

namespace {

// gpt2-tiny: V=256, P=64, C=64, L=2, tied head.
constexpr uint64_t C = 64, V = 256, P = 64, L = 2;
constexpr uint64_t kEmbed = V * C + P * C;           // wte + wpe
constexpr uint64_t kBlock = 12 * C * C + 13 * C;     // qkv, proj, fc, fc2 (+ biases), 2 norms
constexpr uint64_t kHead = 2 * C;                    // final layernorm; the head is tied
constexpr uint64_t kPsi = kEmbed + L * kBlock + kHead;

uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

struct Run {
  MemorySchedule sched;
  MemoryReport rep;
};
Run run(Strategy s, PlanOptions o = {}) {
  const auto m = load_model("gpt2-tiny");
  if (s.seq == 0) s.seq = 64;
  const auto g = zp::models::build_training_graph(m, graph_options(m, s, o));
  Run r;
  r.sched = build_schedule(g, s, o);
  r.rep = replay(r.sched, o);
  return r;
}

}  // namespace

TEST_CASE("the schedule counts gpt2-tiny's parameters and partitions like ZeRO") {
  for (int64_t dp : {1, 2, 3, 4}) {
    for (int stage : {0, 1, 2, 3}) {
      Strategy s;
      s.stage = stage;
      s.dp = dp;
      const Run r = run(s);
      CAPTURE(dp);
      CAPTURE(stage);
      CHECK(r.sched.n_params == kPsi);
      const uint64_t d = static_cast<uint64_t>(dp);
      // Stages 1-2 split the flat buffer; stage 3 splits each gather group (embed, h.0, h.1,
      // head) so each all-gathers as equal blocks.
      const uint64_t part = stage == 0   ? 0
                            : stage < 3 ? ceil_div(kPsi, d)
                                        : ceil_div(kEmbed, d) + L * ceil_div(kBlock, d) +
                                              ceil_div(kHead, d);
      CHECK(r.sched.partition_elems == part);
      // bf16 + Adam: 2 (params) 2 (grads) 4 (master) 8 (moments, two buffers), each buffer
      // rounded to the arena's 256 bytes.
      const auto& gpu = r.rep.per_device[Tier::gpu];
      const uint64_t held_p = stage >= 3 ? part : kPsi;
      const uint64_t held_g = stage >= 2 ? part : kPsi;
      const uint64_t held_os = stage >= 1 ? part : kPsi;
      CHECK(gpu[Category::params] == round_up(2 * held_p, 256));
      CHECK(gpu[Category::grads] == round_up(2 * held_g, 256));
      CHECK(gpu[Category::master] == round_up(4 * held_os, 256));
      CHECK(gpu[Category::optimizer] == 2 * round_up(4 * held_os, 256));
    }
  }
}

TEST_CASE("stage 2: every gradient passes through a reduce bucket, flushed by size") {
  for (uint64_t bucket : {uint64_t{1'000'000'000}, uint64_t{30'000}, uint64_t{1}}) {
    Strategy s;
    s.stage = 2;
    s.dp = 2;
    s.buffers.reduce_bucket_size = bucket;
    const Run r = run(s);
    std::map<int32_t, uint64_t> freed_elems;  // position -> elements reduced there
    uint64_t total_bytes = 0;
    std::set<uint32_t> allocated, freed;
    for (const MemEvent& e : r.sched.events) {
      const MemBuffer& b = r.sched.buffers[e.buffer];
      if (b.name.rfind("bucket.", 0) != 0) continue;
      CHECK(b.category == Category::buffers);
      if (e.alloc) {
        CHECK(allocated.insert(e.buffer).second);
        total_bytes += b.bytes;
      } else {
        CHECK(freed.insert(e.buffer).second);
        freed_elems[e.pos] += b.bytes / 2;
      }
    }
    CAPTURE(bucket);
    CHECK(allocated == freed);
    CHECK(total_bytes == 2 * kPsi);  // all 16-bit gradients, the tied weight counted once
    REQUIRE(!freed_elems.empty());
    // Every flush but the one at the end of backward holds at least a bucket's worth.
    for (auto it = freed_elems.begin(); std::next(it) != freed_elems.end(); ++it)
      CHECK(it->second >= bucket);
    if (bucket >= kPsi) CHECK(freed_elems.size() == 1);
  }
}

TEST_CASE("stage 3: each group gathered per use, padded to dp blocks; prefetch bounds") {
  Strategy s;
  s.stage = 3;
  s.dp = 3;
  s.buffers.prefetch_bucket_size = 1;  // no prefetch: one gathered group at a time
  const Run r = run(s);
  std::map<std::string, int> gathers;
  int live = 0, max_live = 0;
  for (const MemEvent& e : r.sched.events) {
    const MemBuffer& b = r.sched.buffers[e.buffer];
    if (b.name.rfind("gathered.", 0) != 0) continue;
    if (e.alloc) {
      ++gathers[b.name];
      ++live;
      const std::string grp = b.name.substr(9);
      const uint64_t elems = grp == "embed" ? kEmbed : grp == "head" ? kHead : kBlock;
      CHECK(b.bytes == 2 * 3 * ceil_div(elems, 3));
    } else {
      --live;
    }
    max_live = std::max(max_live, live);
  }
  CHECK(live == 0);
  CHECK(max_live == 1);
  // Forward: embed, h.0, h.1, head (final norm), embed again (the tied LM head, whose
  // backward follows at once past the weightless cross-entropy); backward: head (final
  // norm), h.1, h.0. The embedding's backward only scatters into its gradient and reads no
  // weight, so it needs no gather: embed 2x, every other group 2x.
  CHECK(gathers["gathered.embed"] == 2);
  CHECK(gathers["gathered.head"] == 2);
  CHECK(gathers["gathered.h.0"] == 2);
  CHECK(gathers["gathered.h.1"] == 2);

  // Prefetch: what is gathered at one position beyond the run's own group stays within
  // stage3_prefetch_bucket_size, and what is live within stage3_max_live_parameters plus the
  // group being used.
  for (uint64_t live_cap : {uint64_t{1'000'000}, kBlock + kEmbed}) {
    s.buffers.prefetch_bucket_size = kBlock;
    s.buffers.max_live_parameters = live_cap;
    const Run p = run(s);
    auto elems_of = [](const std::string& name) {
      const std::string grp = name.substr(9);
      return grp == "embed" ? kEmbed : grp == "head" ? kHead : kBlock;
    };
    std::map<int32_t, uint64_t> new_at;
    uint64_t live_elems = 0, max_live_elems = 0;
    int n_gathers = 0;
    for (const MemEvent& e : p.sched.events) {
      const MemBuffer& b = p.sched.buffers[e.buffer];
      if (b.name.rfind("gathered.", 0) != 0) continue;
      const uint64_t n = elems_of(b.name);
      if (e.alloc) {
        new_at[e.pos] += n;
        live_elems += n;
        ++n_gathers;
      } else {
        live_elems -= n;
      }
      max_live_elems = std::max(max_live_elems, live_elems);
    }
    CAPTURE(live_cap);
    for (const auto& [pos, n] : new_at) CHECK(n <= kBlock + kBlock);  // own group + prefetch
    CHECK(max_live_elems <= live_cap + kBlock);
    CHECK(max_live_elems > kBlock);  // something was prefetched
    CHECK(n_gathers <= 8);           // prefetched groups are kept for their next use
  }
}

TEST_CASE("offload moves the optimizer states to the cpu tier, exactly") {
  Strategy s;
  s.stage = 2;
  s.dp = 2;
  s.offload_optimizer = Offload::cpu;
  const Run r = run(s);
  const uint64_t part = ceil_div(kPsi, 2);
  const auto& gpu = r.rep.per_device[Tier::gpu];
  const auto& cpu = r.rep.per_device[Tier::cpu];
  CHECK(gpu[Category::master] == 0);
  CHECK(gpu[Category::optimizer] == 0);
  CHECK(gpu[Category::grads] == 0);  // no gradient stays on the gpu beyond the buckets
  CHECK(cpu[Category::master] == 4 * part);
  CHECK(cpu[Category::optimizer] == 8 * part);
  CHECK(cpu[Category::grads] == 4 * part);  // the fp32 gradient partition
  // Two bf16 tiles carry the updated parameters back to the device (DeepSpeed's CPU Adam
  // double buffer of TILE = 128 Mi elements, or the whole partition when smaller).
  const uint64_t tile = std::min<uint64_t>(uint64_t{128} << 20, part);
  CHECK(cpu[Category::buffers] == 2 * 2 * tile);
  CHECK(r.rep.per_device.peak(Tier::cpu) == 16 * part + 4 * tile);
  // A smaller tile (buffers.offload_tile_size) is what the plan holds instead.
  s.buffers.offload_tile_size = 1024;
  const Run small = run(s);
  CHECK(small.rep.per_device[Tier::cpu][Category::buffers] == 2 * 2 * 1024);
  CHECK(small.rep.per_device.peak(Tier::cpu) == 16 * part + 4 * 1024);
  s.buffers.offload_tile_size = uint64_t{128} << 20;

  // The delayed update double-buffers the fp32 gradient partition and keeps a host copy of
  // the bf16 parameter partition instead of the tiles.
  s.dpu = true;
  const Run d = run(s);
  const auto& dcpu = d.rep.per_device[Tier::cpu];
  CHECK(dcpu[Category::grads] == 8 * part);
  CHECK(dcpu[Category::params] == 2 * part);
  CHECK(dcpu[Category::buffers] == 0);
  CHECK(d.rep.per_device.peak(Tier::cpu) == 22 * part);
}

TEST_CASE("profile deepspeed adds the fp32 gradient partition and uses the caching allocator") {
  Strategy s;
  s.stage = 1;
  s.dp = 2;
  const Run ours = run(s, {Profile::zeroplan, Backend::cuda});
  const Run ds = run(s, {Profile::deepspeed, Backend::cuda});
  const uint64_t part = ceil_div(kPsi, 2);
  CHECK(ours.rep.per_device[Tier::gpu][Category::workspace] == 0);
  // The step flattens the 16-bit gradient partition (2 bytes each) and converts the flat
  // copy to fp32 (4 bytes each) before dropping it: both are alive at once.
  CHECK(ds.rep.per_device[Tier::gpu][Category::workspace] ==
        CachingAllocatorModel::round_size(2 * part) + CachingAllocatorModel::round_size(4 * part));
  // On top of the caching allocator, the CUDA context and PyTorch's kernels: 1343 MiB, what
  // nvidia-smi shows after torch.ones((1, 1)).to("cuda") on a V100 (Hugging Face
  // transformers docs, "Model training anatomy"), 1343 x 1048576 bytes; cuBLAS's 32 MiB
  // workspace; and with two ranks NCCL's 1.45 GiB measured after the first barrier
  // (ml-engineering, "torch.distributed memory usage"): 1.45 x 2^30 bytes, rounded down.
  const uint64_t context = 1'408'237'568, cublas = 33'554'432, nccl = 1'556'925'644;
  // The caching allocator reserves whole segments (2 MiB small, 20 MiB large): the reserved
  // peak is a multiple of 2 MiB and above the bytes in use; the overhead is the rest of the
  // segments and what is outside the allocator; the peak is the device total.
  const uint64_t reserved = ds.rep.peak_reserved[0];
  CHECK(reserved % (2u << 20) == 0);
  CHECK(reserved >= ds.rep.peak_allocated[0]);
  CHECK(ds.rep.device.reserved == reserved);
  CHECK(ds.rep.device.context == context);
  CHECK(ds.rep.device.cublas_workspace == cublas);
  CHECK(ds.rep.device.nccl == nccl);
  CHECK(ds.rep.per_device.peak(Tier::gpu) == reserved + context + cublas + nccl);
  CHECK(ds.rep.per_device[Tier::gpu][Category::overhead] ==
        reserved - ds.rep.peak_allocated[0] + context + cublas + nccl);
  // One rank has no NCCL communicator to pay for.
  s.dp = 1;
  CHECK(run(s, {Profile::deepspeed, Backend::cuda}).rep.device.nccl == 0);
  // The zeroplan profile predicts the cpu backend's arena: no CUDA context there.
  CHECK(ours.rep.per_device[Tier::gpu][Category::overhead] ==
        ours.rep.per_device.peak(Tier::gpu) - ours.rep.peak_allocated[0]);
  CHECK(ours.rep.per_device[Tier::gpu][Category::overhead] < context);
}

TEST_CASE("deepspeed stage 3: persistent parameters, optimizer sub-groups and ZeRO++ hpZ") {
  // gpt2-tiny's torch tensors per block: two LayerNorms (2 x 2C), c_attn (C x 3C + 3C),
  // attn.c_proj (C x C + C), c_fc (C x 4C + 4C), mlp.c_proj (4C x C + C); ln_f (2C); wte
  // (V x C) and wpe (P x C). The tensors of at most 1000 elements are the biases and
  // LayerNorms: 13C per block, 2C for ln_f.
  auto buffer = [](const Run& r, const std::string& name) {
    uint64_t n = 0;
    for (const MemBuffer& b : r.sched.buffers)
      if (b.name == name) n += b.bytes;
    return n;
  };
  Strategy s;
  s.stage = 3;
  s.dp = 2;
  s.buffers.param_persistence_threshold = 1000;
  const Run r = run(s, {Profile::deepspeed, Backend::cuda});
  const uint64_t small_block = 13 * C;
  CHECK(buffer(r, "persistent_params") == 2 * (L * small_block + kHead));
  // Persistent parameters are not gathered again: a block gathers its weights alone.
  for (const MemBuffer& b : r.sched.buffers)
    if (b.name == "gathered.h.0") CHECK(b.bytes == 2 * ceil_div(kBlock - small_block, 2) * 2);
  // DeepSpeed's default threshold (1e5) keeps every tensor of gpt2-tiny whole: no gathers.
  s.buffers.param_persistence_threshold = 100'000;
  const Run all = run(s, {Profile::deepspeed, Backend::cuda});
  CHECK(buffer(all, "persistent_params") == 2 * kPsi);
  // The step converts one optimizer sub-group's gradient at a time: with sub_group_size 1
  // every tensor is a sub-group, the largest being wte, c_fc and mlp.c_proj (V x C = 4C x C
  // = 16384 elements), ceil(16384 / 2) of them on this rank.
  s.buffers.sub_group_size = 1;
  CHECK(buffer(run(s, {Profile::deepspeed, Backend::cuda}), "fp32_grad_partition") == 4 * 8192);
  // One sub-group holding everything: the whole partition.
  s.buffers.sub_group_size = 1'000'000'000;
  CHECK(buffer(run(s, {Profile::deepspeed, Backend::cuda}), "fp32_grad_partition") ==
        4 * run(s, {Profile::deepspeed, Backend::cuda}).sched.partition_elems);
  // hpZ over 2 of 4 ranks: a second copy of each gather group's 16-bit parameters,
  // partitioned over 2: ceil(group / 2) elements each.
  s.dp = 4;
  s.hpz_partition_size = 2;
  const uint64_t sec = ceil_div(kEmbed, 2) + L * ceil_div(kBlock, 2) + ceil_div(kHead, 2);
  CHECK(buffer(run(s, {Profile::deepspeed, Backend::cuda}), "hpz_secondary") == 2 * sec);
  s.hpz_partition_size = 3;
  CHECK_THROWS_AS(validate(s), zp::Error);
}

TEST_CASE("deepspeed versions: 0.4.0's stage-3 offload buffers, 0.14-0.16's fp32 partition copy") {
  auto buffer = [](const Run& r, const std::string& name) {
    uint64_t n = 0, count = 0;
    for (const MemBuffer& b : r.sched.buffers)
      if (b.name == name) n += b.bytes, ++count;
    return std::pair{n, count};
  };
  Strategy s;
  s.stage = 3;
  s.dp = 2;
  s.offload_optimizer = Offload::cpu;
  s.buffers.param_persistence_threshold = 0;
  // Up to 0.4.0: two 16-bit buffers of the (then default, whole) partition, from init.
  s.deepspeed_version = 400;
  Run old = run(s, {Profile::deepspeed, Backend::cuda});
  const uint64_t part = old.sched.partition_elems;
  CHECK(buffer(old, "temp_grad_buffer_for_gpu_offload") == std::pair{2 * part, uint64_t{1}});
  CHECK(buffer(old, "temp_grad_gpu_buffer") == std::pair{2 * part, uint64_t{1}});
  s.deepspeed_version = 0;
  CHECK(buffer(run(s, {Profile::deepspeed, Backend::cuda}), "temp_grad_gpu_buffer").second == 0);
  // 0.14.1-0.16.x, stage 2 offload: the fp32 partition on the GPU at the step.
  s.stage = 2;
  s.deepspeed_version = 1603;
  const Run mid = run(s, {Profile::deepspeed, Backend::cuda});
  CHECK(buffer(mid, "fp32_partition_on_gpu") == std::pair{4 * mid.sched.partition_elems, uint64_t{1}});
  s.deepspeed_version = 1700;
  CHECK(buffer(run(s, {Profile::deepspeed, Backend::cuda}), "fp32_partition_on_gpu").second == 0);
}

TEST_CASE("deepspeed cpu_checkpointing: checkpoints on the host between forward and recomputation") {
  // ZeRO-R Pa+cpu with one model-parallel rank: each block's input, B x T x C in bf16, goes to
  // the host after the block's forward and comes back when the block is recomputed; at the
  // end of forward the host holds all L of them and the device none.
  Strategy s;
  s.checkpointing = Checkpointing::full;
  s.partition_activations = true;
  const Run dev = run(s, {Profile::deepspeed, Backend::cuda});
  s.cpu_checkpointing = true;
  const Run host = run(s, {Profile::deepspeed, Backend::cuda});
  const uint64_t ckpt = 1 * 64 * C * 2;  // B=1, T=64, bf16
  CHECK(host.rep.per_device[Tier::cpu][Category::activations] == L * ckpt);
  CHECK(dev.rep.per_device[Tier::cpu][Category::activations] == 0);
  uint64_t host_copies = 0;
  for (const MemBuffer& b : host.sched.buffers)
    if (b.name.rfind("ckpt_cpu.", 0) == 0) {
      CHECK(b.bytes == ckpt);
      ++host_copies;
    }
  CHECK(host_copies == L);
  CHECK(host.rep.peak_allocated[0] <= dev.rep.peak_allocated[0]);
  // It needs P_a, and DeepSpeed.
  Strategy bad;
  bad.checkpointing = Checkpointing::full;
  bad.cpu_checkpointing = true;
  CHECK_THROWS_AS(validate(bad), zp::Error);
}

namespace {
// Where each buffer whose name starts with `prefix` is allocated and freed: op names (""
// where never freed), in buffer order.
struct Life {
  std::string name;
  Tier tier;
  uint64_t bytes;
  std::string from, to;
};
std::vector<Life> lives(const Run& r, const std::string& prefix) {
  std::vector<Life> out;
  std::map<uint32_t, std::size_t> at;
  for (const MemEvent& e : r.sched.events) {
    const MemBuffer& b = r.sched.buffers[e.buffer];
    if (b.name.rfind(prefix, 0) != 0) continue;
    const std::string op = e.pos < 0 ? "" : r.sched.op_names[static_cast<std::size_t>(e.pos)];
    if (e.alloc) {
      at[e.buffer] = out.size();
      out.push_back({b.name, b.tier, b.bytes, op, ""});
    } else {
      out[at.at(e.buffer)].to = op;
    }
  }
  return out;
}
// Bytes of `tier` in use just after position `pos` (its frees done).
uint64_t live_after(const Run& r, Tier tier, int32_t pos) {
  uint64_t n = 0;
  for (const MemEvent& e : r.sched.events) {
    if (e.pos > pos) break;
    const MemBuffer& b = r.sched.buffers[e.buffer];
    if (b.tier != tier) continue;
    n = e.alloc ? n + b.bytes : n - b.bytes;
  }
  return n;
}
int32_t position_of(const Run& r, const std::string& op) {
  for (std::size_t i = 0; i < r.sched.op_names.size(); ++i)
    if (r.sched.op_names[i] == op) return static_cast<int32_t>(i);
  return -1;
}
}  // namespace

TEST_CASE("deepspeed contiguous_memory_optimization: the checkpoints' preallocated buffers") {
  // DeepSpeed's checkpointing.py (partition_activations, CheckpointFunction): the first
  // checkpoint of a forward allocates number_checkpoints buffers of one partition each; every
  // checkpoint copies its partition (a clone of its slice of the block input) into the next
  // one and drops the clone; the first backward drops the list, which frees the buffers no
  // checkpoint filled; buffer k goes when checkpoint k's backward returns. gpt2-tiny, B=1,
  // T=64, C=64, bf16: a partition is 64 x 64 x 2 = 8192 bytes over one model-parallel rank.
  const uint64_t part = 1 * 64 * C * 2;
  Strategy s;
  s.checkpointing = Checkpointing::full;
  s.partition_activations = true;
  const PlanOptions ds{Profile::deepspeed, Backend::cuda};
  const Run plain = run(s, ds);
  s.contiguous_memory_optimization = true;
  s.number_checkpoints = L + 3;
  const Run contig = run(s, ds);
  const std::vector<Life> bufs = lives(contig, "ckpt_contiguous.");
  REQUIRE(bufs.size() == L + 3);
  for (std::size_t k = 0; k < bufs.size(); ++k) {
    CAPTURE(k);
    CHECK(bufs[k].tier == Tier::gpu);
    CHECK(bufs[k].bytes == part);
    CHECK(bufs[k].from == "h.0.ckpt.partition");  // all at the first checkpoint
    // Filled ones: to the end of their block's backward (GPT-2's last backward op of a block
    // is its first layernorm's); the spare ones: the first backward, where block L-1 is
    // recomputed from its checkpoint.
    CHECK(bufs[k].to == (k < L ? fmt::format("h.{}.norm1.bwd", k) : std::string("h.1.norm1.re")));
  }
  // Each clone lives only within its checkpoint op.
  for (const Life& c : lives(contig, "h.1.ckpt.part")) {
    CHECK(c.from == "h.1.ckpt.partition");
    CHECK(c.to == "h.1.ckpt.partition");
  }
  // At the end of the forward: the L + 3 buffers where P_a alone keeps the L clones.
  const int32_t end_fwd = position_of(contig, "h.1.out");
  REQUIRE(end_fwd == position_of(plain, "h.1.out"));
  CHECK(live_after(contig, Tier::gpu, end_fwd) - live_after(plain, Tier::gpu, end_fwd) == 3 * part);

  // With cpu_checkpointing the buffers are host memory; checkpoint k comes back to the device
  // when its block is recomputed (its host buffer freed there) and the copy lives to the end
  // of the block's backward.
  s.cpu_checkpointing = true;
  const Run host = run(s, ds);
  const std::vector<Life> hb = lives(host, "ckpt_contiguous.");
  REQUIRE(hb.size() == L + 3);
  for (std::size_t k = 0; k < hb.size(); ++k) {
    CAPTURE(k);
    CHECK(hb[k].tier == Tier::cpu);
    CHECK(hb[k].from == "h.0.ckpt.partition");
    CHECK(hb[k].to == (k < L ? fmt::format("h.{}.norm1.re", k) : std::string("h.1.norm1.re")));
  }
  const std::vector<Life> back = lives(host, "h.0.ckpt.part");
  REQUIRE(back.size() == 2);  // the clone, then the copy back
  CHECK(back[1].from == "h.0.norm1.re");
  CHECK(back[1].to == "h.0.norm1.bwd");
  CHECK(lives(host, "ckpt_cpu.").empty());  // no per-checkpoint host copies beside them
  CHECK(host.rep.per_device[Tier::cpu][Category::activations] == (L + 3) * part);

  // Two model-parallel ranks: half a block input per buffer.
  Strategy t = s;
  t.cpu_checkpointing = false;
  t.mp = 2;
  for (const Life& b : lives(run(t, ds), "ckpt_contiguous.")) CHECK(b.bytes == part / 2);
}

TEST_CASE("contiguous_memory_optimization is refused where DeepSpeed refuses or fails") {
  Strategy s;
  s.checkpointing = Checkpointing::full;
  s.contiguous_memory_optimization = true;
  s.number_checkpoints = 2;
  CHECK_THROWS_AS(validate(s), zp::Error);  // checkpointing.configure: needs partition_activations
  s.partition_activations = true;
  s.number_checkpoints = 0;
  CHECK_THROWS_AS(validate(s), zp::Error);  // and number_checkpoints
  s.number_checkpoints = 1;
  validate(s);
  // gpt2-tiny checkpoints two blocks: a second checkpoint finds no buffer (IndexError).
  CHECK_THROWS_AS(resolve_for_model(s, load_model("gpt2-tiny")), zp::Error);
}

TEST_CASE("timeline: one sample per op at its high point; the trace opens in Perfetto") {
  for (int stage : {0, 2, 3}) {
    Strategy s;
    s.stage = stage;
    s.dp = 2;
    const Run r = run(s);
    uint64_t max_gpu = 0;
    std::set<int32_t> positions;
    for (const TimelineSample& t : r.rep.timeline) {
      uint64_t sum = 0;
      for (uint64_t b : t.bytes[0]) sum += b;
      max_gpu = std::max(max_gpu, sum);
      CHECK(positions.insert(t.pos).second);
    }
    CAPTURE(stage);
    CHECK(max_gpu == r.rep.peak_allocated[0]);
    CHECK(positions.size() == r.sched.op_names.size() + 1);  // every op, and "before" (-1)
    const nlohmann::json trace = timeline_trace(r.sched, r.rep);
    int counters = 0, ops = 0;
    for (const auto& ev : trace["traceEvents"]) {
      if (ev["ph"] == "C") {
        ++counters;
        for (const char* c : {"params", "grads", "master", "optimizer", "activations",
                              "buffers", "workspace", "overhead"})
          CHECK(ev["args"].contains(c));
      }
      if (ev["ph"] == "X") ++ops;
    }
    CHECK(counters >= static_cast<int>(r.sched.op_names.size()));
    CHECK(ops == static_cast<int>(r.sched.op_names.size()));
  }
}

TEST_CASE("recomputation lowers the peak: none > selective > full") {
  auto peak = [](Checkpointing c) {
    Strategy s;
    s.checkpointing = c;
    return run(s).rep.per_device.peak(Tier::gpu);
  };
  const uint64_t none = peak(Checkpointing::none), sel = peak(Checkpointing::selective),
                 full = peak(Checkpointing::full);
  CHECK(none > sel);
  CHECK(sel > full);
}

TEST_CASE("the bound on GPU memory outside the arena: context, cuBLAS workspace, NCCL buffers") {
  // By hand from the cited sizes: a connection's buffers 4 MiB + 512 KiB + 4,915,200 B =
  // 9,633,792 B; 64 channels; the context 1343 MiB = 1,408,237,568 B and cuBLAS's 32 MiB.
  Strategy s;
  s.stage = 2;
  // One rank: 1343 MiB + 32 MiB, no NCCL peers.
  s.dp = 1;
  CHECK(cuda_outside_arena_bound(s).total() == 1'441'792'000);
  CHECK(cuda_outside_arena_bound(s).nccl_buffers == 0);
  // Four ranks at stage 2 (reduce and all-gather: rings): 64 x 2 x 9,633,792.
  s.dp = 4;
  CHECK(cuda_outside_arena_bound(s).nccl_buffers == 1'233'125'376);
  CHECK(cuda_outside_arena_bound(s).total() == 2'674'917'376);
  // Stage 0 all-reduces, which may pick trees: 64 x (2 + 8) x 9,633,792.
  s.stage = 0;
  CHECK(cuda_outside_arena_bound(s).nccl_buffers == 6'165'626'880);
  // NVLS: a Hopper node of 8 ranks binds 32 x 2 x 1 MiB x 8 = 512 MiB; two ranks, or an Ampere
  // GPU, none.
  s.stage = 3;
  s.dp = 8;
  CHECK(cuda_outside_arena_bound(s, {.local_ranks = 8, .nvls_capable = true}).nccl_nvls == 536'870'912);
  CHECK(cuda_outside_arena_bound(s, {.local_ranks = 2, .nvls_capable = true}).nccl_nvls == 0);
  CHECK(cuda_outside_arena_bound(s, {.local_ranks = 8, .nvls_capable = false}).nccl_nvls == 0);
  CHECK(cuda_outside_arena_bound(s, {.local_ranks = 8, .nvls_capable = true}).total() ==
        1'441'792'000ULL + 1'233'125'376ULL + 536'870'912ULL);
}
