#!/usr/bin/env bash
# Fails if a process started by this checkout's tests (etcd, kube-apiserver,
# Flux's helm-, source- and notification-controller, the OCI registry,
# flux-plunger's binaries) is still running, or its directory
# is still there, a few seconds after the tests ended (each server's
# supervisor stops it once the test process has exited).
#
# Only this checkout's servers are judged: another worktree on the same
# machine may be running its own tests right now, from its own _out/ (the
# Makefile exports FLUX_PLUNGER_OUT, and testkit starts the servers from it).
# And only directories made since the tier began (`--mark`, its first step):
# one a killed run left earlier on this machine (a bench stopped by hand) is
# not this run's leak, and must not fail it.
#
# The node tier's sandboxes (hack/node-sandbox.sh) are named after the
# checkout: none of this checkout's may leave a process (the node's servers,
# containerd's shims, the containers in its cgroups), a cgroup, a directory or
# a mount behind; and the host's network must show nothing of a node: no pod
# bridge or veth, none of the node's addresses, no network namespace, no
# Kubernetes or CNI firewall rule.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out="${FLUX_PLUNGER_OUT:-$root/_out}"
sandbox=$("$root/hack/node-sandbox.sh" --prefix)
mark="$out/leftovers-since"

if [ "${1:-}" = "--mark" ]; then
  # A second in the past: file times come from a coarse clock, so a
  # directory made a moment after the mark may carry the mark's very time,
  # which `find -newer` would not count.
  mkdir -p "$out" && touch -d "@$(($(date +%s) - 1))" "$mark"
  exit 0
fi
# Without a mark (run by hand), every directory is judged.
newer=()
[ -e "$mark" ] && newer=(-newer "$mark")

# What a node may have left on the host, one line each.
node_leftovers() {
  pgrep -a -f -- "$sandbox|${root}/hack/node-sandbox.sh|${out}/bin/(kubelet|kube-controller-manager|kube-scheduler)( |$)" || true
  ls -d /sys/fs/cgroup/*/"$sandbox"-* "${TMPDIR:-/tmp}/$sandbox"-* 2>/dev/null || true
  grep -F "$sandbox" /proc/self/mountinfo || true
  ip -o link show 2>/dev/null | grep -E ': (fp-pods0|veth[^:]*)[:@]' || true
  ip -o addr show 2>/dev/null | grep -E ' (10\.254\.0\.1|10\.96\.0\.1|10\.244\.0\.[0-9]+)/' || true
  ip route show 2>/dev/null | grep -E '10\.(254\.0|96\.0|244\.0)\.' || true
  ip netns list 2>/dev/null | grep -E '^(cni-|flux-plunger)' || true
  # Read, never written: every table kubelet, kube-proxy or a CNI plugin
  # could have touched, both families.
  for tool in iptables ip6tables; do
    command -v "$tool" >/dev/null 2>&1 || continue
    for table in filter nat mangle; do
      "$tool" -t "$table" -S 2>/dev/null | grep -E 'KUBE-|CNI-' | sed "s/^/$tool -t $table: /" || true
    done
  done
}
for _ in $(seq 1 50); do
  procs=$(pgrep -a -f "^(${out}/bin/(etcd|kube-apiserver|registry|(helm|source|notification)-controller-[^ ]+)|${root}/target/[^/ ]+/flux-plunger(-drain|-sweep)?)( |$)" || true)
  dirs=""
  for dir in $(find "${TMPDIR:-/tmp}" -maxdepth 1 \( -name 'flux-plunger-cp-*' -o -name 'flux-plunger-hc-*' -o -name 'flux-plunger-sc-*' \
    -o -name 'flux-plunger-nc-*' -o -name 'flux-plunger-registry-*' -o -name 'flux-plunger-e2e-*' \) "${newer[@]}" 2>/dev/null); do
    # A directory still in use by a server of another checkout is theirs.
    users=$(pgrep -a -f -- "$dir" || true)
    if grep -qE '/(_out/bin|target/[^/ ]+)/' <<<"$users" && ! grep -qF -e "${out}/bin/" -e "${root}/target/" <<<"$users"; then
      continue
    fi
    dirs="${dirs}${dir}"$'\n'
  done
  node=$(node_leftovers)
  if [ -z "$procs" ] && [ -z "$dirs" ] && [ -z "$node" ]; then
    echo ">> no test process or directory left behind"
    exit 0
  fi
  sleep 0.2
done
echo "left behind after the tests:" >&2
[ -n "$procs" ] && echo "$procs" >&2
[ -n "$dirs" ] && echo "$dirs" >&2
[ -n "$node" ] && echo "$node" >&2
exit 1
