#!/usr/bin/env bash
# compare_adam.sh: our fused CPU AdamW (bench_cpu_adam's fused_fp32: fp32 params, grads and
# moments, the same work as torch.optim.AdamW) against PyTorch's CPU AdamW, same size, same
# thread count; prints both and the speed-up (goal >= 6x).
#
# Both sides are memory-bound, and on a shared machine the memory bandwidth a VM gets drifts
# by 30% or more within a minute. So the two are timed in interleaved rounds (ours then torch
# in odd rounds, torch then ours in even ones, about 10 s a round), each round gives a ratio
# from two measurements taken seconds apart, and the speed-up reported is the median of the
# rounds' ratios; every round is printed, with the range.
# Not a build step: needs a built tree (ZP_BUILD_DIR, default build) and Debian's python3-torch
# (or another Python with torch: ZP_PYTHON).
# Usage: tools/bench/compare_adam.sh [threads [rounds]]
#        (default threads: OMP_NUM_THREADS or nproc; default rounds: 7)
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${ZP_BUILD_DIR:-build}
threads=${1:-${OMP_NUM_THREADS:-$(nproc)}}
rounds=${2:-7}
log2=${ZP_BENCH_ADAM_LOG2:-26}
for v in "$threads" "$rounds"; do
  [[ $v =~ ^[1-9][0-9]*$ ]] || { echo "error: threads and rounds must be positive integers, got '$v'" \
    "(usage: tools/bench/compare_adam.sh [threads [rounds]])" >&2; exit 2; }
done
[[ -x $build/bin/bench_cpu_adam ]] || { echo "error: $build/bin/bench_cpu_adam not found" \
  "(hint: build it first: ninja -C $build bench_cpu_adam)" >&2; exit 2; }
export OMP_NUM_THREADS=$threads ZP_BENCH_ADAM_LOG2=$log2
# The fused step on the best ISA this CPU has (the runtime's automatic choice: the last one
# bench_cpu_adam lists), with the stores the runtime picks at this size.
isa=$("$build/bin/bench_cpu_adam" --benchmark_list_tests --benchmark_filter='^fused_fp32/avx[0-9a-z]*/real_time$' 2>/dev/null |
  tail -1 | cut -d/ -f2)
[[ $isa == avx* ]] || { echo "error: this CPU has no AVX2 Adam kernel to compare with" >&2; exit 2; }
python=${ZP_PYTHON:-/usr/bin/python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

ours() {
  "$build/bin/bench_cpu_adam" --benchmark_filter="^fused_fp32/$isa/real_time\$" --benchmark_min_time=1 \
    --benchmark_out="$tmp/ours.$1.json" --benchmark_out_format=json >/dev/null 2>"$tmp/ours.err" ||
    { cat "$tmp/ours.err" >&2; exit 1; }
}
torch() {
  "$python" tools/bench/bench_torch_adamw.py --log2 "$log2" --threads "$threads" \
    --min-seconds 1 --json "$tmp/torch.$1.json" >/dev/null
}
for ((r = 1; r <= rounds; r++)); do
  printf 'round %d/%d ...\r' "$r" "$rounds" >&2
  if ((r % 2)); then ours "$r"; torch "$r"; else torch "$r"; ours "$r"; fi
done
printf '%*s\r' 20 '' >&2

"$python" - "$tmp" "$rounds" <<'EOF'
import json, os, statistics, sys
tmp, rounds = sys.argv[1], int(sys.argv[2])
rows = []
for r in range(1, rounds + 1):
    ours = json.load(open(os.path.join(tmp, f"ours.{r}.json")))
    torch = json.load(open(os.path.join(tmp, f"torch.{r}.json")))
    run = ours["benchmarks"][0]
    if run.get("error_occurred"):
        sys.exit(f"error: bench_cpu_adam fused_fp32 failed: {run.get('error_message')}")
    scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[run["time_unit"]]
    best = torch["variants"][torch["best"]]
    rows.append((run["real_time"] * scale, best["seconds_per_step"], torch["best"], run.get("label", "")))
n = torch["n"]
print(f"{n} fp32 params, {torch['threads']} threads, torch {torch['torch_version']}, "
      f"{rounds} interleaved rounds (28 bytes moved per parameter)")
print("  round   zeroplan fused AdamW          torch AdamW (best variant)            speed-up")
for i, (o, t, variant, isa) in enumerate(rows, 1):
    print(f"  {i:5d}   {o * 1e3:6.1f} ms  {n / o / 1e9:5.3f} Gparam/s   "
          f"{t * 1e3:6.1f} ms  {n / t / 1e9:5.3f} Gparam/s ({variant:13s})   {t / o:5.2f}x")
ratios = [t / o for o, t, _, _ in rows]
med = statistics.median(ratios)
o_med = statistics.median(o for o, _, _, _ in rows)
t_med = statistics.median(t for _, t, _, _ in rows)
print(f"  median  {o_med * 1e3:6.1f} ms  {n / o_med / 1e9:5.3f} Gparam/s  {28 * n / o_med / 1e9:5.1f} GB/s"
      f"   torch {t_med * 1e3:6.1f} ms  {n / t_med / 1e9:5.3f} Gparam/s  ({rows[0][3]} kernels)")
print(f"  speed-up over torch: median {med:.2f}x of the rounds (range {min(ratios):.2f}-{max(ratios):.2f}x); "
      f"goal >= 6x: {'met' if med >= 6 else 'NOT met'}")
EOF
