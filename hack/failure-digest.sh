#!/usr/bin/env bash
# Prints, at the end of a failed tier, what failed in its log $1: each panic's
# place and message, each error a test returned with its first causes, and
# each violating interleavings seed with its scenario and violations. A long
# run's backtraces and logs bury them; CI shows the end.
set -uo pipefail
log=${1:?usage: failure-digest.sh LOG}
[ -f "$log" ] || exit 0
echo
echo ">> what failed, from $log:"
awk '
  # Panics the test builds raise on purpose (FLUX_PLUNGER_TEST_PANIC_AT).
  /panicked at/ { panic = $0; next_lines = 2; next }
  next_lines > 0 {
    if ($0 ~ /FLUX_PLUNGER_TEST_PANIC_AT/) { next_lines = 0; next }
    if ($0 ~ /^stack backtrace:/) { next_lines = 0; next }
    if (panic != "") { print panic; panic = "" }
    print "   " $0; next_lines--; next
  }
  # A test that returned an error: its message and the first of its causes.
  /^Error: / { print; cause_lines = 0; next }
  /^Caused by:$/ { print; cause_lines = 2; next }
  cause_lines > 0 && /^    / { print; cause_lines--; next }
  /^=== seed .* VIOLATED ===/ { print; in_seed = 1; next }
  in_seed && /^(scenario|violations):/ { print; next }
  in_seed && /^  - / { print; next }
  in_seed && /^timeline:/ { in_seed = 0 }
  /^---- .* stdout ----$/ { in_failures = 0; print }
  /^failures:$/ { in_failures = 1; next }
  in_failures && /^    [^ ]/ { print "failed:" $0 }
  in_failures && /^test result:/ { in_failures = 0 }
' "$log"
