#!/usr/bin/env bash
# tools/fuzz.sh: build the parsers' libFuzzer targets (tests/fuzz, clang, address and
# undefined-behaviour sanitizers) in build-fuzz/ and run each on its seed corpus.
#   tools/fuzz.sh                      every target for 20 s (what CI runs)
#   tools/fuzz.sh -runs=1000000        every target for 10^6 executions
#   tools/fuzz.sh -max_total_time=600 plan   one target, 10 minutes
# Arguments starting with '-' go to libFuzzer; others name targets. A crash, a hang (over
# 10 s on one input), a leak or a sanitizer report fails the run and leaves the input in
# build-fuzz/findings/. New inputs the fuzzer finds go to a scratch corpus, never the repo's.
set -euo pipefail
cd "$(dirname "$0")/.."
# The sanitized tree is shared with tools/sanitize.sh asan (the same libraries, configured once).
tools/sanitize.sh configure
build="${ZP_FUZZ_BUILD_DIR:-build-fuzz}"
all=(hf_config ds_config plan budgets hardware units accelerate megatron manifest)
args=() targets=()
for a in "$@"; do if [[ "$a" == -* ]]; then args+=("$a"); else targets+=("$a"); fi; done
[ ${#targets[@]} -gt 0 ] || targets=("${all[@]}")
[ ${#args[@]} -gt 0 ] || args=(-max_total_time=20)
ninja -C "$build" "${targets[@]/#/fuzz_}" >/dev/null
# The project's own files seed the targets that read them.
seeds() {
  case "$1" in
    hf_config) echo models/configs ;;
    budgets) echo tests/budgets ;;
    hardware) echo planner/hardware ;;
    *) echo "tests/fuzz/corpus/$1" ;;
  esac
}
mkdir -p "$build/findings"
# One target per core at a time; each writes its log, the summary is printed in order.
run_one() {
  local t=$1 scratch="$build/corpus/$1" log="$build/fuzz_$1.log"
  mkdir -p "$scratch"
  if "$build/bin/fuzz_$t" "${args[@]}" -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 \
       -artifact_prefix="$build/findings/$t-" "$scratch" "$(seeds "$t")" >"$log" 2>&1; then
    echo ok >"$log.status"
  else
    echo failed >"$log.status"
  fi
}
jobs_max=$(nproc)
for t in "${targets[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n || true; done
  run_one "$t" &
done
wait
status=0
for t in "${targets[@]}"; do
  log="$build/fuzz_$t.log"
  runs=$(grep -m1 'stat::number_of_executed_units' "$log" | awk '{print $2}')
  rate=$(grep -m1 'stat::average_exec_per_sec' "$log" | awk '{print $2}')
  if [ "$(cat "$log.status")" = ok ]; then
    echo "fuzz $t: ${runs:-?} inputs (${rate:-?}/s), no findings"
  else
    echo "fuzz $t: FAILED (log: $log; input: $build/findings/$t-*)"
    grep -E 'ERROR|what\(\)|SUMMARY|in zp::' "$log" | head -n 20
    status=1
  fi
done
exit $status
