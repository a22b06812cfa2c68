#!/usr/bin/env bash
# Fails if a control plane started by the tests is still running, or its
# directory is still there, a few seconds after the tests ended (each server's
# supervisor stops it once the test process has exited).
set -euo pipefail
for _ in $(seq 1 50); do
  procs=$(pgrep -a -f '_out/bin/(etcd|kube-apiserver) ' || true)
  dirs=$(find "${TMPDIR:-/tmp}" -maxdepth 1 -name 'flux-plunger-cp-*' 2>/dev/null || true)
  if [ -z "$procs" ] && [ -z "$dirs" ]; then
    echo ">> no control plane process or directory left behind"
    exit 0
  fi
  sleep 0.2
done
echo "left behind after the tests:" >&2
[ -n "$procs" ] && echo "$procs" >&2
[ -n "$dirs" ] && echo "$dirs" >&2
exit 1
