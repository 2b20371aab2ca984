#!/usr/bin/env bash
# tools/demo.sh: install what is missing, build, and run the main job on an embedded default:
# the ZeRO paper's table, then a memory estimate for a catalog model on a catalog GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
bin=${ZP_BUILD_DIR:-build}/bin
echo
echo "\$ zero-plan table"
"$bin/zero-plan" table
echo
echo "\$ zero-plan estimate --model llama-2-7b --stage 3 --dp 8 --hardware a100-80g"
"$bin/zero-plan" estimate --model llama-2-7b --stage 3 --dp 8 --hardware a100-80g
