#!/usr/bin/env bash
# tools/setup.sh: install the Debian packages zeroplan builds with, then configure and build.
# Idempotent and quiet: apt-get runs only when a package is missing; the build is incremental.
# Not a place for anything but packages and the build (tests live in tools/test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  cmake ninja-build g++ pkg-config
  libboost-graph-dev libfmt-dev nlohmann-json3-dev libcli11-dev doctest-dev
  libbenchmark-dev libopenmpi-dev openmpi-bin libopenblas-dev libopenblas-openmp-dev
  liburing-dev libyaml-cpp-dev zlib1g-dev
  pybind11-dev python3-dev libcpp-httplib-dev
)
# Extra packages a caller may ask for (tools/test.sh adds the browser for the HTML test).
if [ -n "${ZP_EXTRA_PACKAGES:-}" ]; then read -r -a extra <<<"$ZP_EXTRA_PACKAGES"; packages+=("${extra[@]}"); fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=(); [ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq >/dev/null
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# --no-build: the packages only (tools/fuzz.sh builds its own tree).
[ "${1:-}" = "--no-build" ] && exit 0

build=${ZP_BUILD_DIR:-build}
if [ ! -f "$build/build.ninja" ]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE="${ZP_BUILD_TYPE:-Release}" ${ZP_CMAKE_ARGS:-} >/dev/null
fi
# Quiet on success; the whole log on failure.
log="$build/build.log"
if ! cmake --build "$build" ${ZP_BUILD_TARGETS:+--target $ZP_BUILD_TARGETS} >"$log" 2>&1; then
  grep -vE '^\[[0-9]+/[0-9]+\] ' "$log" >&2 || cat "$log" >&2
  echo "setup: build failed (full log: $log)" >&2
  exit 1
fi
grep -E 'warning:' "$log" >&2 || true
