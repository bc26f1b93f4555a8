#!/usr/bin/env bash
# The wall time of .ci/run on a clean clone, setup included, with pytest's durations kept for ci_durations.py.
#   sudo benchmarks/ci_wall.sh OUT.log [REV]      # REV: what to clone (default HEAD of this checkout)
# The clone goes to a temporary folder and is removed afterwards; OUT.log gets the whole output and a last
# line "rc=N wall=S". Caches outside the clone (the Debian base image under /var/cache/dzctl-test, the
# test dockerd's images under /var/lib/dzctl-test) are this machine's: remove them first to time a fresh machine.
set -uo pipefail
out=$(realpath -m "$1")
rev=${2:-HEAD}
src=$(cd "$(dirname "$0")/.." && pwd)
clone=$(mktemp -d /tmp/dzctl-ci-XXXXXX)
git clone -q --no-hardlinks "$src" "$clone" && git -C "$clone" checkout -q "$rev"
start=$(date +%s)
(cd "$clone" && .ci/run --durations=0) >"$out" 2>&1
rc=$?
echo "rc=$rc wall=$(( $(date +%s) - start ))" >>"$out"
rm -rf "$clone"
tail -n 1 "$out"
