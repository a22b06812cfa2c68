#!/usr/bin/env bash
# Builds one of Flux's controllers, MODULE at VERSION, from its published Go
# module into OUT.
#
#   hack/build-flux-controller.sh github.com/fluxcd/helm-controller v1.6.4 _out/bin/helm-controller-v1.6.4
#   hack/build-flux-controller.sh github.com/fluxcd/source-controller v1.9.3 _out/bin/source-controller-v1.9.3
#
# Every Flux controller's go.mod says `replace <module>/api => ./api`, but a
# module zip never holds a nested module, so ./api is missing from the
# download. The build runs in a copy of the module with that one replace
# dropped: the api module is published on its own at the same version. Every
# other replace (go-digest, kustomize, a Helm fork on some versions) is kept.
# Without CGO, as Flux's own Dockerfiles build them: static binaries that need
# no C toolchain, and one build configuration for every controller, so those
# of the same dependency versions share Go's build cache. The rest of the
# environment passes through to `go build` (GOFLAGS).
#
# Idempotent: an OUT newer than this script and hack/module-copy.sh is left
# as it is (OUT names the version, so a new pin is a new OUT). A rebuild is cheap once the Go build
# cache is warm (a link, some seconds).
set -euo pipefail
# shellcheck source=hack/module-copy.sh
source "$(dirname "$0")/module-copy.sh"

if [ $# -ne 3 ]; then
  echo "usage: $0 MODULE VERSION OUT" >&2
  exit 2
fi
module=$1
version=$2
# Absolute: the build runs in another directory.
out=$(realpath -ms "$3")
name=${module##*/}

say() { printf '>> %s %s: %s\n' "$name" "$version" "$*"; }

if up_to_date "$out"; then
  say "up to date ($out)"
  exit 0
fi

started=$(date +%s)
module_copy "$module" "$version"

cd "$work"
say "dropping the ./api replace; requiring $module/api@$version from the proxy"
go mod edit -dropreplace="$module/api" -require="$module/api@$version"
# Records the api module's checksums in the copy's go.sum (verified against
# the checksum database like any other module).
go mod download "$module/api"

tmp_out="$out.tmp.$$"
mkdir -p "$(dirname "$out")"
say "compiling (cold: several minutes on 2 cores; warm: seconds)"
CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o "$tmp_out" .
mv -f "$tmp_out" "$out"
say "built $out in $(( $(date +%s) - started ))s"
