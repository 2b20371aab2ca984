#!/usr/bin/env bash
# debian_package.sh BUILD_DIR: build the Debian package with CPack from the build tree, check
# its control fields, that apt can satisfy its dependencies (apt-get --simulate: nothing is
# installed), and that the packaged zero-plan runs from the unpacked files.
set -euo pipefail
build=$(cd "$1" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && cpack --config "$build/CPackConfig.cmake" -G DEB >"$work/cpack.log") ||
  { cat "$work/cpack.log"; exit 1; }
deb=$(ls "$work"/zeroplan_*.deb)
dpkg-deb --field "$deb" Package Version Depends | tee "$work/fields"
grep -q '^Depends:.*libfmt' "$work/fields"   # read off the binaries by dpkg-shlibdeps
grep -q '^Depends:.*openmpi-bin' "$work/fields"
dpkg-deb --contents "$deb" >"$work/contents"
grep -q '\./usr/bin/zero-plan$' "$work/contents"
grep -q '\./usr/bin/zero-run$' "$work/contents"
grep -q '\./usr/lib/.*cmake/zeroplan/zeroplanConfig.cmake$' "$work/contents"
apt-get install --simulate --no-install-recommends "$deb" >"$work/apt.log" 2>&1 ||
  { cat "$work/apt.log"; exit 1; }
dpkg-deb -x "$deb" "$work/root"
"$work/root/usr/bin/zero-plan" estimate --model gpt2-xl --stage 2 --dp 8 --hardware v100-32g \
  --format json >"$work/estimate.json"
grep -q '"fits": true' "$work/estimate.json"
echo "$(basename "$deb"): $(du -h "$deb" | cut -f1), dependencies satisfiable, zero-plan runs"
