#!/usr/bin/env bash
# Sums the test counts of every tier's log in $1 into one closing line,
# "N passed, N failed", so that a reader (or CI) sees the whole run at once.
set -euo pipefail
dir=${1:?usage: test-summary.sh LOG_DIR}
passed=0 failed=0
while read -r p f; do
  passed=$((passed + p)); failed=$((failed + f))
done < <(
  cat "$dir"/*.log 2>/dev/null | sed -nE \
    -e 's/^test result: [a-zA-Z]+\. ([0-9]+) passed; ([0-9]+) failed.*/\1 \2/p' \
    -e 's/^ok ([0-9]+) .*/1 0/p' -e 's/^not ok ([0-9]+) .*/0 1/p' \
    -e 's/^Tests:[[:space:]]+([0-9]+) passed, ([0-9]+) total.*/\1 0/p' \
    -e 's/^Tests:[[:space:]]+([0-9]+) failed, ([0-9]+) passed, ([0-9]+) total.*/\2 \1/p'
)
echo "${passed} passed, ${failed} failed"
[ "$failed" -eq 0 ] && [ "$passed" -gt 0 ]
