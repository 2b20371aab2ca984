#!/usr/bin/env bash
# compare_adam.sh: our fused CPU AdamW (bench_cpu_adam's fused_fp32: fp32 params, grads and
# moments, the same work as torch.optim.AdamW) against PyTorch's CPU AdamW, same size, same
# thread count, in one invocation; prints both and the speed-up (goal >= 6x).
# Not a build step: needs a built tree (ZP_BUILD_DIR, default build) and Debian's python3-torch.
# Usage: tools/bench/compare_adam.sh [threads]   (default: OMP_NUM_THREADS or nproc)
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${ZP_BUILD_DIR:-build}
threads=${1:-${OMP_NUM_THREADS:-$(nproc)}}
log2=${ZP_BENCH_ADAM_LOG2:-26}
export OMP_NUM_THREADS=$threads ZP_BENCH_ADAM_LOG2=$log2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$build/bin/bench_cpu_adam" --benchmark_filter='^fused_fp32/' --benchmark_min_time=3 \
  --benchmark_out="$tmp/ours.json" --benchmark_out_format=json --benchmark_color=false
/usr/bin/python3 tools/bench/bench_torch_adamw.py --log2 "$log2" --threads "$threads" \
  --json "$tmp/torch.json"

/usr/bin/python3 - "$tmp/ours.json" "$tmp/torch.json" <<'EOF'
import json, sys
ours = json.load(open(sys.argv[1]))
torch = json.load(open(sys.argv[2]))
run = next(b for b in ours["benchmarks"] if b["name"].startswith("fused_fp32/"))
if run.get("error_occurred"):
    sys.exit(f"error: bench_cpu_adam fused_fp32 failed: {run.get('error_message')}")
scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[run["time_unit"]]
ours_s = run["real_time"] * scale
best = torch["variants"][torch["best"]]
n = torch["n"]
print(f"\n{n} fp32 params, {torch['threads']} threads, torch {torch['torch_version']}")
print(f"  zeroplan fused AdamW ({run.get('label', '')}): {ours_s * 1e3:8.1f} ms/step  "
      f"{n / ours_s / 1e9:.3f} Gparam/s  {28 * n / ours_s / 1e9:.2f} GB/s")
print(f"  torch AdamW ({torch['best']}):    {best['seconds_per_step'] * 1e3:8.1f} ms/step  "
      f"{best['gparams_per_s']:.3f} Gparam/s  {best['gbytes_per_s']:.2f} GB/s")
ratio = best["seconds_per_step"] / ours_s
print(f"  speed-up over torch: {ratio:.2f}x (goal >= 6x: {'met' if ratio >= 6 else 'NOT met'})")
EOF
