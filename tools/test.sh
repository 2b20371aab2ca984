#!/usr/bin/env bash
# tools/test.sh: install what is missing, build, and run every test (ctest). What CI runs.
# Extra arguments go to ctest (e.g. tools/test.sh -R planner, or -L cli).
set -euo pipefail
cd "$(dirname "$0")/.."
# Test-only packages: the HTML report test drives a real browser (headless Chromium), the
# JUnit test reads the XML back with Python's xml.etree, the Python module's tests run under
# pytest and `pip install` it into a virtual environment, the serve page's test reads its
# screenshot with PIL and drives Chromium over DevTools (websocket), and CPack's Debian package
# needs dpkg-shlibdeps (dpkg-dev).
ZP_EXTRA_PACKAGES="${ZP_EXTRA_PACKAGES:-} chromium python3 python3-pytest python3-pil python3-websocket python3-venv python3-pip dpkg-dev" \
  tools/setup.sh
# Open MPI refuses root and more ranks than cores unless told; the mpirun tests need both.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
cd "${ZP_BUILD_DIR:-build}"
# The "long" label (60 kill trials of the checkpoint writer, ~4 minutes) runs when asked for:
# tools/test.sh -L long. Any argument replaces this default.
if [ $# -eq 0 ]; then set -- -LE long; fi
ctest --output-on-failure -j "$(nproc)" "$@"
# Then, unless ctest was given a selection, every parser under libFuzzer for 20 s and the
# models and reports tests under the address and undefined-behaviour sanitizers (clang; one
# build tree for both, build-fuzz/; tools/sanitize.sh says what runs only locally).
# ZP_SKIP_FUZZ=1 skips both.
cd - >/dev/null
if [ "$*" = "-LE long" ] && [ "${ZP_SKIP_FUZZ:-0}" != 1 ]; then
  tools/fuzz.sh
  tools/sanitize.sh asan
fi
