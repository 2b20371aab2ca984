#!/usr/bin/env bash
# tools/bench/compare_gpt2.sh: one GPT-2 forward + backward through our CPU kernels
# (bench_gpt2_cpu) and in PyTorch (bench_gpt2_torch.py), same shape and threads, in one
# invocation; prints both tokens/s (medians) and the ratio. Not a test: nothing is asserted.
#
#   tools/bench/compare_gpt2.sh [--model gpt2] [--B 1] [--T 256] [--threads N] [--min-time 5]
#                               [--torch-blas same|system] [--train]
# --train: whole training steps instead (bench_engine: the ZeRO engine's fp32 step with AdamW,
# against PyTorch's forward + backward + torch.optim.AdamW). --model also takes a config.json;
# a LLaMA-family one (tools/bench/llama-125m.json: 12 x 768, 12 heads over 4 KV heads) needs
# --train, as only the engine runs those blocks.
# The C++ binary comes from ${ZP_BUILD_DIR:-build}/bin (built here if missing). PyTorch loads
# the same OpenBLAS build as that binary (Debian's torch takes libblas.so.3 from the system
# alternatives, usually the pthread build) unless --torch-blas system.
set -euo pipefail
cd "$(dirname "$0")/../.."

model=gpt2 B=1 T=256 threads=$(nproc) min_time=5 torch_blas=same train=0
while [ $# -gt 0 ]; do
  if [ "$1" = --train ]; then train=1; shift; continue; fi
  case "$1" in
    --model) model=$2 ;; --B) B=$2 ;; --T) T=$2 ;; --threads) threads=$2 ;;
    --min-time) min_time=$2 ;; --torch-blas) torch_blas=$2 ;;
    *) echo "error: unknown argument $1" >&2
       echo "hint: --model --B --T --threads --min-time --torch-blas same|system --train" >&2; exit 2 ;;
  esac
  shift 2
done

if [ "$train" = 0 ] && [ -f "$model" ] && ! grep -q '"model_type": *"gpt2"' "$model"; then
  echo "error: --model $model: the kernel-only benchmark runs GPT-2; LLaMA-family configs need --train" >&2
  echo "hint: tools/bench/compare_gpt2.sh --train --model $model --T 512" >&2
  exit 2
fi
build=${ZP_BUILD_DIR:-build}
target=bench_gpt2_cpu torch_opt=none filter=.
# bench_engine's engine_step (the fp32 graph), not its engine_step_gpu_graph.
if [ "$train" = 1 ]; then target=bench_engine torch_opt=adamw filter='^engine_step/'; fi  # the name carries /real_time
bin="$build/bin/$target"
[ -x "$bin" ] || cmake --build "$build" --target "$target" >/dev/null

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Each side gets min_time seconds of steps; the C++ side as 3 repetitions (median).
ZP_GPT2_MODEL=$model ZP_GPT2_B=$B ZP_GPT2_T=$T ZP_GPT2_THREADS=$threads \
  ZP_ENGINE_MODEL=$model ZP_ENGINE_B=$B ZP_ENGINE_T=$T OMP_NUM_THREADS=$threads \
  "$bin" --benchmark_filter="$filter" --benchmark_min_time="$(awk "BEGIN{print $min_time/3}")" --benchmark_repetitions=3 \
  --benchmark_format=json >"$tmp/cpu.json" 2>"$tmp/cpu.err" || { cat "$tmp/cpu.err" >&2; exit 1; }
blas_dir=
if [ "$torch_blas" = same ]; then
  blas_dir=$(dirname "$(ldd "$bin" | awk '/libopenblas/ {print $3}')")
fi
LD_LIBRARY_PATH=${blas_dir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
  /usr/bin/python3 tools/bench/bench_gpt2_torch.py --model "$model" --B "$B" --T "$T" \
  --threads "$threads" --min-time "$min_time" --optimizer "$torch_opt" >"$tmp/torch.json"

/usr/bin/python3 - "$tmp/cpu.json" "$tmp/torch.json" "${blas_dir:-system default}" <<'EOF'
import json, sys
cpu = json.load(open(sys.argv[1]))
torch = json.load(open(sys.argv[2]))
runs = [b for b in cpu["benchmarks"] if b.get("run_type") == "iteration"]
if not runs or any(b.get("error_occurred") for b in runs):
    sys.exit("error: bench_gpt2_cpu failed: %s" % [b.get("error_message") for b in runs])
med = [b for b in cpu["benchmarks"] if b.get("aggregate_name") == "median"]
ours = med[0]["tokens_per_s"] if med else runs[0]["tokens_per_s"]
print("%s B=%d T=%d threads=%d, torch optimizer %s, OpenBLAS for PyTorch: %s (load avg %s)" % (
    torch["model"], torch["B"], torch["T"], torch["threads"], torch["optimizer"], sys.argv[3],
    " ".join("%.1f" % x for x in cpu["context"].get("load_avg", []))))
print("  zeroplan %-12s: %8.1f tokens/s  (%s, steps of %s ms)" % (
    "engine step" if runs[0]["name"].startswith("engine") else "CPU kernels", ours, runs[0]["name"], ", ".join("%.0f" % b["real_time"] for b in runs)))
steps = sorted(torch["step_ms"])
print("  PyTorch %-12s: %8.1f tokens/s  (%d steps, min %.0f / median %.0f / max %.0f ms)" % (
    torch["torch"], torch["tokens_per_s"], len(steps), steps[0], steps[len(steps) // 2], steps[-1]))
print("  ratio zeroplan / PyTorch: %.2f" % (ours / torch["tokens_per_s"]))
EOF
