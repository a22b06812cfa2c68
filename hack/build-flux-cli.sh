#!/usr/bin/env bash
# Builds Flux's CLI, github.com/fluxcd/flux2/v2 at VERSION, from its published
# Go module into OUT: the tests run its `flux logs` against the node tier's
# pods.
#
#   hack/build-flux-cli.sh v2.7.5 _out/bin/flux
#
# cmd/flux embeds `manifests/*.yaml`, which flux2's own build generates (the
# install manifests `flux install` writes) and the module zip does not carry.
# The build runs in a copy of the module with one placeholder file there: the
# binary is Flux's CLI in every command the tests use, and its `flux install`
# has nothing to install.
#
# Idempotent: an OUT newer than this script and hack/module-copy.sh is left
# as it is. Cold, on 2 shared cores, several minutes (the git providers' and
# cloud SDKs); warm, a link.
set -euo pipefail
# shellcheck source=hack/module-copy.sh
source "$(dirname "$0")/module-copy.sh"

if [ $# -ne 2 ]; then
  echo "usage: $0 VERSION OUT" >&2
  exit 2
fi
version=$1
# Absolute: the build runs in another directory.
out=$(realpath -ms "$2")
module=github.com/fluxcd/flux2/v2

say() { printf '>> flux CLI %s: %s\n' "$version" "$*"; }

if up_to_date "$out"; then
  say "up to date ($out)"
  exit 0
fi

started=$(date +%s)
module_copy "$module" "$version"
mkdir -p "$work/cmd/flux/manifests"
echo "# flux-plunger's test build: no install manifests" >"$work/cmd/flux/manifests/placeholder.yaml"

tmp_out="$out.tmp.$$"
mkdir -p "$(dirname "$out")"
say "compiling (cold: several minutes on 2 cores; warm: seconds)"
cd "$work"
CGO_ENABLED=0 go build -trimpath -ldflags="-s -w -X main.VERSION=${version#v}" -o "$tmp_out" ./cmd/flux
mv -f "$tmp_out" "$out"
say "built $out in $(( $(date +%s) - started ))s"
