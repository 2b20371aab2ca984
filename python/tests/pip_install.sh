#!/usr/bin/env bash
# pip_install.sh BUILD_DIR: `pip install ./python` into a fresh virtual environment, offline
# (--no-index: nothing may be downloaded), reusing BUILD_DIR's configured tree; then the
# installed package, imported away from the source tree, must answer as zero-plan does.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=$(cd "$1" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3=${ZP_PYTHON3:-/usr/bin/python3}
unset PYTHONPATH  # the installed package, not the build tree's
# --system-site-packages: Debian's setuptools and wheel build the package (pip's isolated
# build would download them).
"$python3" -m venv --system-site-packages "$work/venv"
ZEROPLAN_BUILD_DIR="$build" "$work/venv/bin/pip" install --no-index --quiet --disable-pip-version-check \
  "$root/python"
cd "$work"
"$work/venv/bin/python" - "$build/bin/zero-plan" <<'PY'
import json, subprocess, sys
import zeroplan
assert zeroplan.__file__.startswith(sys.prefix), zeroplan.__file__  # the installed copy
want = json.loads(subprocess.run([sys.argv[1], "estimate", "--model", "llama-2-7b", "--stage", "3",
                                  "--dp", "8", "--format", "json"], check=True,
                                 capture_output=True, text=True).stdout)
assert zeroplan.estimate("llama-2-7b", stage=3, dp=8) == want
print("pip install ./python: zeroplan", zeroplan.__file__, "answers as zero-plan")
PY
"$work/venv/bin/python" -m zeroplan table --params 7.5e9 --dp 64 --format json >"$work/py.json"
"$build/bin/zero-plan" table --params 7.5e9 --dp 64 --format json >"$work/cpp.json"
cmp "$work/py.json" "$work/cpp.json"
"$work/venv/bin/pip" uninstall --yes --quiet zeroplan
