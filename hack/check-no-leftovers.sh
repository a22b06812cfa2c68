#!/usr/bin/env bash
# Fails if a server started by this checkout's tests (etcd, kube-apiserver,
# helm-controller) is still running, or its directory is still there, a few
# seconds after the tests ended (each server's supervisor stops it once the
# test process has exited).
#
# Only this checkout's servers are judged: another worktree on the same
# machine may be running its own tests right now, from its own _out/ (the
# Makefile exports FLUX_PLUNGER_OUT, and testkit starts the servers from it).
set -euo pipefail
out="${FLUX_PLUNGER_OUT:-$(cd "$(dirname "$0")/.." && pwd)/_out}"
for _ in $(seq 1 50); do
  procs=$(pgrep -a -f "^${out}/bin/(etcd|kube-apiserver|helm-controller-[^ ]+) " || true)
  dirs=""
  for dir in $(find "${TMPDIR:-/tmp}" -maxdepth 1 \( -name 'flux-plunger-cp-*' -o -name 'flux-plunger-hc-*' \) 2>/dev/null); do
    # A directory still in use by a server of another checkout is theirs.
    if pgrep -a -f -- "$dir" | grep -q '/_out/bin/' && ! pgrep -a -f -- "$dir" | grep -qF "${out}/bin/"; then
      continue
    fi
    dirs="${dirs}${dir}"$'\n'
  done
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
