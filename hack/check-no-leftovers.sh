#!/usr/bin/env bash
# Fails if a server started by the tests (etcd, kube-apiserver, helm-controller)
# is still running, or its directory is still there, a few seconds after the
# tests ended (each server's supervisor stops it once the test process has
# exited).
#
# Only this checkout's servers count: they run this checkout's _out/bin/
# binaries. Other checkouts on the same machine may be running their own tests;
# a directory in use by one of their servers is theirs, not a leftover.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
servers="$root/_out/bin/(etcd|kube-apiserver|helm-controller-[^ ]+) "

leftover_dirs() {
  local dir users
  for dir in $(find "${TMPDIR:-/tmp}" -maxdepth 1 \( -name 'flux-plunger-cp-*' -o -name 'flux-plunger-hc-*' \) 2>/dev/null); do
    users=$(pgrep -a -f -- "$dir" || true)
    # Nobody uses it (a leftover), or one of our servers does.
    if [ -z "$users" ] || grep -qE "$servers" <<<"$users"; then
      echo "$dir"
    fi
  done
}

for _ in $(seq 1 50); do
  procs=$(pgrep -a -f -- "$servers" || true)
  dirs=$(leftover_dirs)
  if [ -z "$procs" ] && [ -z "$dirs" ]; then
    echo ">> no control plane or helm-controller process or directory left behind"
    exit 0
  fi
  sleep 0.2
done
echo "left behind after the tests:" >&2
[ -n "$procs" ] && echo "$procs" >&2
[ -n "$dirs" ] && echo "$dirs" >&2
exit 1
