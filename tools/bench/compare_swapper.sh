#!/usr/bin/env bash
# tools/bench/compare_swapper.sh: the swapper's sequential write and read GB/s against fio's,
# same directory, file size, block size and queue depth (direct=1, ioengine=io_uring), in one
# run, alternating which goes first; prints medians and our % of fio. Not a tuning tool.
#
# Usage: tools/bench/compare_swapper.sh [--dir DIR] [--size BYTES] [--bs BYTES] [--qd N]
#                                       [--reps N] [--bin build/bin/bench_swapper]
set -euo pipefail
cd "$(dirname "$0")/../.."

dir=/var/tmp size=1073741824 bs=1048576 qd=8 reps=3 bin=build/bin/bench_swapper
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) dir=$2; shift 2 ;;
    --size) size=$2; shift 2 ;;
    --bs) bs=$2; shift 2 ;;
    --qd) qd=$2; shift 2 ;;
    --reps) reps=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    *) echo "error: unknown argument $1" >&2
       echo "hint: see the usage line at the top of $0" >&2; exit 2 ;;
  esac
done
[ -x "$bin" ] || { echo "error: $bin not built" >&2; echo "hint: cmake --build build --target bench_swapper" >&2; exit 2; }
if ! command -v fio >/dev/null; then
  echo "compare_swapper: installing fio" >&2
  sudo_cmd=(); [ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq fio >/dev/null
fi
python=$(command -v python3)

work=$(mktemp -d "$dir/zp-compare-XXXXXX")
trap 'rm -rf "$work"' EXIT
results="$work/results.txt"  # lines: <what> <GB/s>

run_fio() {  # $1: write|read
  fio --name=zp-compare --filename="$work/fio.dat" --size="$size" --bs="$bs" --iodepth="$qd" \
      --direct=1 --ioengine=io_uring --rw="$1" --numjobs=1 --output-format=json >"$work/fio.json"
  "$python" - "$1" "$work/fio.json" >>"$results" <<'EOF'
import json, sys
op, path = sys.argv[1], sys.argv[2]
print(f"fio_{op}", json.load(open(path))["jobs"][0][op]["bw_bytes"] / 1e9)
EOF
}
run_fio_both() { run_fio write; run_fio read; rm -f "$work/fio.dat"; }

run_ours() {
  ZP_SWAP_BENCH_DIR="$work" ZP_SWAP_BENCH_BYTES="$size" ZP_SWAP_BENCH_BLOCK="$bs" \
    ZP_SWAP_BENCH_QD="$qd" "$bin" --benchmark_filter='BM_Swap(Write|Read)/' \
    --benchmark_format=json >"$work/ours.json" 2>/dev/null
  "$python" - "$work/ours.json" >>"$results" <<'EOF'
import json, sys
for b in json.load(open(sys.argv[1]))["benchmarks"]:
    if b.get("error_occurred"):
        sys.exit(f"error: {b['name']}: {b.get('error_message')}")
    op = "write" if "Write" in b["name"] else "read"
    backend = "io_uring" if "/io_uring" in b["name"] else "thread_pool"
    print(f"{backend}_{op}", b["GB"])
EOF
}

echo "compare_swapper: $reps x (fio, zeroplan) on $dir, $size bytes, bs $bs, qd $qd" >&2
for rep in $(seq "$reps"); do
  if [ $((rep % 2)) -eq 1 ]; then run_fio_both; run_ours; else run_ours; run_fio_both; fi
done

"$python" - "$results" <<'EOF'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    what, gbps = line.split()
    runs.setdefault(what, []).append(float(gbps))
med = {k: statistics.median(v) for k, v in runs.items()}
print(f"{'':8} {'fio GB/s':>9} {'io_uring GB/s':>14} {'% of fio':>9} {'thread_pool GB/s':>17} {'% of fio':>9}   (median of {len(runs['fio_write'])})")
for op in ("write", "read"):
    f, u, t = med[f"fio_{op}"], med[f"io_uring_{op}"], med[f"thread_pool_{op}"]
    print(f"{op:8} {f:9.3f} {u:14.3f} {100*u/f:8.1f}% {t:17.3f} {100*t/f:8.1f}%")
for k in sorted(runs):
    print(f"  {k}: " + " ".join(f"{x:.3f}" for x in runs[k]))
EOF
