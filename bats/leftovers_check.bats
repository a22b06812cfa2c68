#!/usr/bin/env bats
# hack/check-no-leftovers.sh, which ends every test tier: it judges only what
# the tier made since its `--mark`, so a directory a killed run left earlier
# on the machine does not fail a later run, and a leak of this run does.

bats_require_minimum_version 1.5.0

setup() {
  # A private temporary directory and _out/: the check sees nothing of the
  # suite's own control plane, nor of the machine's.
  export TMPDIR="$BATS_TEST_TMPDIR/tmp"
  export FLUX_PLUNGER_OUT="$BATS_TEST_TMPDIR/out"
  mkdir -p "$TMPDIR" "$FLUX_PLUNGER_OUT"
  check="$ROOT/hack/check-no-leftovers.sh"
}

# A control plane's directory, as a killed run leaves it: no process uses it.
stale_dir() {
  mkdir "$TMPDIR/$1"
  touch -d '1 hour ago' "$TMPDIR/$1"
}

@test "a directory left before the tier's mark is not this run's leak" {
  stale_dir flux-plunger-cp-killed
  "$check" --mark
  run --separate-stderr "$check"
  [ "$status" -eq 0 ] || { echo "$stderr"; false; }
  [ "$output" = ">> no test process or directory left behind" ]
}

@test "a directory made after the tier's mark fails the check, and is named" {
  stale_dir flux-plunger-cp-killed
  "$check" --mark
  mkdir "$TMPDIR/flux-plunger-e2e-leaked"
  run --separate-stderr "$check"
  [ "$status" -eq 1 ]
  [[ "$stderr" == *"$TMPDIR/flux-plunger-e2e-leaked"* ]]
  [[ "$stderr" != *flux-plunger-cp-killed* ]]
}

@test "without a mark, as run by hand, every directory is judged" {
  stale_dir flux-plunger-hc-killed
  run --separate-stderr "$check"
  [ "$status" -eq 1 ]
  [[ "$stderr" == *"$TMPDIR/flux-plunger-hc-killed"* ]]
}
