#!/usr/bin/env bash
# tools/sanitize.sh: the tests under the compilers' sanitizers, each in a build tree of its own.
#   tools/sanitize.sh asan      address + undefined-behaviour sanitizers (clang, build-fuzz/, the
#                               tree tools/fuzz.sh fuzzes in): the models and reports tests (the
#                               config readers, the inventory, budgets). What CI runs.
#   tools/sanitize.sh asan-all  the same with the planner's tests (DeepSpeed, accelerate and
#                               Megatron inputs, every strategy): local, ~5 minutes more on 2
#                               cores than CI's 25 have room for.
#   tools/sanitize.sh tsan      thread sanitizer (gcc, build-tsan/): the threaded parts, the
#                               delayed parameter update, the asynchronous offload tiles, the NVMe
#                               swapper, the threaded fit search, checkpoints of runs with them.
#                               Local only (a build of 7 minutes on 2 cores, then the runs).
#   tools/sanitize.sh configure the asan tree only (tools/fuzz.sh uses it)
# Extra arguments go to ctest. Any sanitizer report fails its test.
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-asan}"
[ $# -gt 0 ] && shift
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1

configure_asan() {
  ZP_EXTRA_PACKAGES="${ZP_EXTRA_PACKAGES:-} clang" tools/setup.sh --no-build
  asan="${ZP_FUZZ_BUILD_DIR:-build-fuzz}"
  if [ ! -f "$asan/build.ninja" ] || ! grep -q "ZP_BUILD_TESTS:BOOL=ON" "$asan/CMakeCache.txt"; then
    cmake -S . -B "$asan" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang \
      -DCMAKE_CXX_COMPILER=clang++ -DZP_FUZZ=ON -DZP_BUILD_TESTS=ON -DZP_BUILD_BENCH=OFF \
      -DZP_ENABLE_CUDA=OFF >/dev/null
  fi
}

case "$mode" in
  configure)
    configure_asan
    ;;
  asan|asan-all)
    configure_asan
    tests=(test_models test_reports test_reports_budgets)
    [ "$mode" = asan-all ] && tests+=(test_planner)
    ninja --quiet -C "$asan" "${tests[@]}"
    # halt_on_error: the first report fails the test; detect_leaks: a leak is a report too.
    export ASAN_OPTIONS=halt_on_error=1:detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
    regex="^($(IFS='|'; echo "${tests[*]}"))\$"
    ctest --test-dir "$asan" --output-on-failure -j "$(nproc)" -R "$regex" "$@"
    ;;
  tsan)
    tsan="${ZP_TSAN_BUILD_DIR:-build-tsan}"
    if [ ! -f "$tsan/build.ninja" ]; then
      cmake -S . -B "$tsan" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DZP_TSAN=ON \
        -DZP_BUILD_BENCH=OFF -DZP_ENABLE_CUDA=OFF >/dev/null
    fi
    tests=(test_offload test_swapper test_nvme test_checkpoint test_overlap)
    ninja --quiet -C "$tsan" "${tests[@]}" test_fit
    # Our own threads are what it checks: the delayed update's, the asynchronous tile copier,
    # the swapper's pipeline, the fit search's pool. libgomp is not built with the sanitizer,
    # so its barriers are invisible and every parallel region would read as a race: a new
    # thread's OpenMP regions (the delayed update's CPU Adam) run on that thread alone.
    export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1" OMP_NUM_THREADS=1
    regex="^($(IFS='|'; echo "${tests[*]}"))\$"
    ctest --test-dir "$tsan" --output-on-failure -j 1 -R "$regex" --timeout 3600 "$@"
    # The fit search's pool: the threaded search against one thread (the rest of test_fit
    # runs one thread, and takes over 40 minutes under the sanitizer).
    "$tsan/bin/test_fit" -tc="fit: the threaded search*"
    ;;
  *)
    echo "usage: tools/sanitize.sh [asan|asan-all|tsan|configure] [ctest arguments]" >&2
    exit 2
    ;;
esac
