#!/usr/bin/env bash
# Fails if a process started by this checkout's tests (etcd, kube-apiserver,
# helm-controller, flux-plunger's binaries) is still running, or its directory
# is still there, a few seconds after the tests ended (each server's
# supervisor stops it once the test process has exited).
#
# Only this checkout's servers are judged: another worktree on the same
# machine may be running its own tests right now, from its own _out/ (the
# Makefile exports FLUX_PLUNGER_OUT, and testkit starts the servers from it).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out="${FLUX_PLUNGER_OUT:-$root/_out}"
for _ in $(seq 1 50); do
  procs=$(pgrep -a -f "^(${out}/bin/(etcd|kube-apiserver|helm-controller-[^ ]+)|${root}/target/[^/ ]+/flux-plunger(-drain|-sweep)?)( |$)" || true)
  dirs=""
  for dir in $(find "${TMPDIR:-/tmp}" -maxdepth 1 \( -name 'flux-plunger-cp-*' -o -name 'flux-plunger-hc-*' -o -name 'flux-plunger-e2e-*' \) 2>/dev/null); do
    # A directory still in use by a server of another checkout is theirs.
    users=$(pgrep -a -f -- "$dir" || true)
    if grep -qE '/(_out/bin|target/[^/ ]+)/' <<<"$users" && ! grep -qF -e "${out}/bin/" -e "${root}/target/" <<<"$users"; then
      continue
    fi
    dirs="${dirs}${dir}"$'\n'
  done
  if [ -z "$procs" ] && [ -z "$dirs" ]; then
    echo ">> no test process or directory left behind"
    exit 0
  fi
  sleep 0.2
done
echo "left behind after the tests:" >&2
[ -n "$procs" ] && echo "$procs" >&2
[ -n "$dirs" ] && echo "$dirs" >&2
exit 1
