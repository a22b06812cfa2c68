# One local control plane (etcd + kube-apiserver, testing/testkit) for the whole
# suite. bats runs the files one after another and the tests one at a time,
# which these tests need: every flux-plunger-sweep acts on all namespaces.

setup_suite() {
  local root
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  export ROOT=$root
  export FLUX_PLUNGER_OUT=${FLUX_PLUNGER_OUT:-$root/_out}
  local binary
  for binary in "$root/target/debug/local-control-plane" "$root/target/debug/flux-plunger-sweep" \
    "$FLUX_PLUNGER_OUT/bin/kubectl" "$FLUX_PLUNGER_OUT/bin/helm"; do
    if [ ! -x "$binary" ]; then
      echo "$binary is missing: run \`make build tools\` first (make test-bats does)" >&2
      return 1
    fi
  done

  local log="$BATS_SUITE_TMPDIR/control-plane.log"
  # fd 3 is bats' own: a background process holding it keeps bats waiting.
  "$root/target/debug/local-control-plane" >"$log" 2>&1 3>&- &
  export CONTROL_PLANE_PID=$!
  local kubeconfig=""
  for _ in $(seq 1 600); do
    kubeconfig=$(sed -n 's/^  kubeconfig: //p' "$log")
    [ -n "$kubeconfig" ] && break
    if ! kill -0 "$CONTROL_PLANE_PID" 2>/dev/null; then
      echo "the local control plane exited during its start:" >&2
      cat "$log" >&2
      return 1
    fi
    sleep 0.2
  done
  if [ -z "$kubeconfig" ]; then
    echo "the local control plane did not start in 120 s:" >&2
    cat "$log" >&2
    return 1
  fi
  export KUBECONFIG=$kubeconfig
  export CONTROL_PLANE_DIR=${kubeconfig%/admin.kubeconfig}
}

teardown_suite() {
  [ -n "${CONTROL_PLANE_PID:-}" ] || return 0
  # Its servers' supervisors stop them and remove their directory once it
  # has gone (testing/testkit/src/process.rs).
  kill -TERM "$CONTROL_PLANE_PID" 2>/dev/null || true
  wait "$CONTROL_PLANE_PID" 2>/dev/null || true
  for _ in $(seq 1 100); do
    [ -e "$CONTROL_PLANE_DIR" ] || return 0
    sleep 0.1
  done
  echo "the local control plane did not stop in 10 s" >&2
  return 1
}
