#!/usr/bin/env bash
# The extended set (tests/conftest.py: EXTENDED): slow integration tests that `./dev test` deselects to keep CI
# within 30 minutes on a 2-core machine. Runs them as CI runs the rest (root, integration required, random
# order), from this checkout's venv (make it with ./dev test first), and keeps the whole output.
#   sudo benchmarks/extended_tests.sh OUT.log
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-benchmarks/results/extended-tests.log}")
start=$(date +%s)
DZCTL_EXTENDED=only DZCTL_REQUIRE_INTEGRATION=1 .venv/bin/python -m pytest -p randomly -p no:cacheprovider \
    --durations=0 >"$out" 2>&1
rc=$?
echo "rc=$rc wall=$(( $(date +%s) - start ))" >>"$out"
tail -n 2 "$out"
exit $rc
