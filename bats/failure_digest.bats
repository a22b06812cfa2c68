#!/usr/bin/env bats
# hack/failure-digest.sh, which ends a failed test tier: it brings what failed
# (panics, violating seeds, failing test names) from under the backtraces and
# logs of a long run to the end of the output, where CI shows it.

bats_require_minimum_version 1.5.0

setup() {
  digest="$ROOT/hack/failure-digest.sh"
  log="$BATS_TEST_TMPDIR/envtest.log"
}

@test "a violating seed is named with its scenario and violations, a planned panic is not" {
  cat > "$log" <<'LOG'
running 2 tests
thread 'tokio-rt-worker' (13297) panicked at crates/plunger/src/test_hooks.rs:342:21:
test build: FLUX_PLUNGER_TEST_PANIC_AT=planned
stack backtrace:
   0: __rustc::rust_begin_unwind
failures:

---- recoveries_raced stdout ----
=== seed 17 VIOLATED ===
scenario: Scenario { seed: 17 }
violations:
  - left Terminating after helm-controller answered
faults: 34 requests
timeline:
   206 ms  step     Planned
  - not a violation: part of the timeline
thread 'recoveries_raced' (16466) panicked at crates/plunger/tests/interleavings.rs:254:9:
1 of 48 seeds violated an invariant; replay with FLUX_PLUNGER_SEEDS=17 cargo test
stack backtrace:
   0: __rustc::rust_begin_unwind

failures:
    recoveries_raced

test result: FAILED. 1 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 38.64s
LOG
  run --separate-stderr "$digest" "$log"
  [ "$status" -eq 0 ]
  [[ "$output" == *"=== seed 17 VIOLATED ==="* ]]
  [[ "$output" == *"scenario: Scenario { seed: 17 }"* ]]
  [[ "$output" == *"  - left Terminating after helm-controller answered"* ]]
  [[ "$output" == *"replay with FLUX_PLUNGER_SEEDS=17"* ]]
  [[ "$output" == *"failed:    recoveries_raced"* ]]
  [[ "$output" != *"FLUX_PLUNGER_TEST_PANIC_AT"* ]]
  [[ "$output" != *"not a violation"* ]]
  [[ "$output" != *"rust_begin_unwind"* ]]
}

@test "an error a test returned is shown with its first causes" {
  cat > "$log" <<'LOG'
---- a_delete_while_paused stdout ----
Error: flux-plunger's log:


Caused by:
    timed out after 90s waiting for flux-plunger's /readyz
    helm-controller log tail:
    a line of helm-controller's log, not wanted

failures:
    a_delete_while_paused
LOG
  run --separate-stderr "$digest" "$log"
  [ "$status" -eq 0 ]
  [[ "$output" == *"Error: flux-plunger's log:"* ]]
  [[ "$output" == *"timed out after 90s waiting for flux-plunger's /readyz"* ]]
  [[ "$output" != *"not wanted"* ]]
  [[ "$output" == *"failed:    a_delete_while_paused"* ]]
}

@test "a log that is not there is no second failure" {
  run "$digest" "$BATS_TEST_TMPDIR/missing.log"
  [ "$status" -eq 0 ]
}
