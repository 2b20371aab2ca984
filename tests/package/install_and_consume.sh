#!/usr/bin/env bash
# install_and_consume.sh BUILD_DIR: `cmake --install` the build into a fresh prefix, build the
# consumer project (consumer/) against it with find_package(zeroplan), and run it; then run
# the installed zero-plan. Nothing outside a temporary folder is touched.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=$(cd "$1" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >"$work/install.log"
test -f "$work/prefix/lib/cmake/zeroplan/zeroplanConfig.cmake"
test -f "$work/prefix/include/zp/planner/estimate.hpp"
cmake -S "$here/consumer" -B "$work/consumer" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix" >"$work/configure.log"
cmake --build "$work/consumer" >"$work/build.log" || { cat "$work/build.log"; exit 1; }
"$work/consumer/consumer"
"$work/prefix/bin/zero-plan" table --params 7.5e9 --dp 64 --format csv | grep -qx '7500000000,64,3,1875000000,1.88'
echo "installed zero-plan and find_package(zeroplan) work from $work/prefix"
