#!/usr/bin/env bash
# Runs a command (the node tier's tests, the demo) in a sandbox of its own, in
# which testkit starts a real node (testing/testkit/src/node.rs):
#
# - a network namespace holding only its loopback device: testkit adds the
#   node's addresses and the pod bridge there, so the host's interfaces,
#   addresses, routes and firewall are never touched, and no packet can leave
#   the machine (the namespace has no device that leads out);
# - a mount namespace: what the kubelet and containerd mount (pod volumes,
#   container root filesystems, the pods' network namespace handles) is private
#   to the sandbox and goes with it, and /run, /var/log and /var/lib are
#   tmpfs of its own: containerd 1.6 keeps its shim sockets and runc state
#   under /run/containerd, the kubelet its log links under /var/log/containers
#   and the CNI library its cache under /var/lib/cni, whatever their
#   configuration says;
# - a PID namespace: when the command ends, whatever it left running (a
#   container's shim outlives containerd by design) is stopped, and the kernel
#   kills anything left when the sandbox's first process exits.
#
# Afterwards, outside: the node's cgroups (cgroupfs is not namespaced) and the
# sandbox's temporary directory (TMPDIR inside) are removed. The exit status is
# the command's. Needs root (namespaces, mounts, cgroups); runs as
# `hack/node-sandbox.sh COMMAND [ARGS...]`; `hack/node-sandbox.sh --prefix`
# prints the prefix of this checkout's sandbox names.
set -euo pipefail

if [ "${1:-}" = "--inside" ]; then
  shift
  # The first process of the sandbox (PID 1): it prepares the namespaces, runs
  # the command, then stops whatever is left.
  for dir in /run /var/log /var/lib; do
    # -n: no record in /run/mount/utab, which is still the host's here.
    mount -n -t tmpfs -o mode=0755 "flux-plunger-node" "$dir"
  done
  ip link set lo up
  "$@" &
  command_pid=$!
  # PID 1 gets only the signals it handles: hand Ctrl-C and a TERM on.
  trap 'kill -TERM "$command_pid" 2>/dev/null || true' INT TERM
  status=0
  wait "$command_pid" || status=$?
  # A trapped signal interrupts `wait`: wait again for the real exit.
  while kill -0 "$command_pid" 2>/dev/null; do wait "$command_pid" || status=$?; done
  others() { for p in /proc/[0-9]*; do [ "${p#/proc/}" != $$ ] && [ "$(cut -d' ' -f3 "$p/stat" 2>/dev/null)" != Z ] && echo "${p#/proc/}"; done; true; }
  if [ -n "$(others)" ]; then
    kill -TERM -1 2>/dev/null || true
    for _ in $(seq 1 50); do [ -z "$(others)" ] && break; sleep 0.2; done
    kill -KILL -1 2>/dev/null || true
  fi
  exit "$status"
fi

root=$(cd "$(dirname "$0")/.." && pwd)
# The sandbox's name: this checkout (so that hack/check-no-leftovers.sh judges
# only its own) and this run. testkit names the node's cgroup root after it.
prefix="flux-plunger-node-$(printf %s "$root" | sha256sum | cut -c1-8)"
if [ "${1:-}" = "--prefix" ]; then
  # What every sandbox of this checkout is named with (for the leftovers check).
  echo "$prefix"
  exit 0
fi
[ "$#" -gt 0 ] || { echo "usage: $0 COMMAND [ARGS...] | --prefix" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "$0: the node sandbox needs root (namespaces, mounts, cgroups)" >&2; exit 1; }
id="$prefix-$$"
tmp="${TMPDIR:-/tmp}/$id"
mkdir -p "$tmp"

remove_cgroups() {
  # Once the sandbox's processes are gone their cgroups are empty; the kernel
  # may take a moment to release them.
  for _ in $(seq 1 50); do
    left=0
    for tree in /sys/fs/cgroup/*/"$id"; do
      [ -d "$tree" ] || continue
      find "$tree" -depth -type d -exec rmdir {} + 2>/dev/null || left=1
    done
    [ "$left" = 0 ] && return 0
    sleep 0.2
  done
  echo "$0: could not remove the cgroups /sys/fs/cgroup/*/$id" >&2
  return 1
}

status=0
FLUX_PLUNGER_NODE_SANDBOX="$id" TMPDIR="$tmp" \
  unshare --net --mount --pid --fork --kill-child --mount-proc --propagation private \
  -- "$root/hack/node-sandbox.sh" --inside "$@" || status=$?
if ! remove_cgroups && [ "$status" = 0 ]; then status=1; fi
# Nothing is mounted here any more (the mounts were the sandbox's own), but
# never follow a mount out of the directory.
rm -rf --one-file-system "$tmp"
exit "$status"
