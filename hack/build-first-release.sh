#!/usr/bin/env bash
# The first release of flux-plunger as its users run it, rebuilt offline from
# its commit for the node tier's upgrade test (an upgrade from it to today's
# chart, fences held): that commit's chart packaged as it was, and its three
# binaries built static from that commit's source, in the image today's
# Dockerfile makes around them. (That commit's Dockerfile built in a Rust
# image and ran on a distroless one, both pulled from the internet; the
# binaries, their paths and their user are the same.) The binaries are built
# without LTO in a target directory of their own: a test build, whose
# behaviour is the release's, in half the time.
#
# Writes into OUT_DIR: flux-plunger.oci.tar and .ref (the image), the chart's
# flux-plunger-VERSION.tgz, and a stamp naming COMMIT (a second run is a
# no-op).
#
# Usage: hack/build-first-release.sh COMMIT OUT_DIR
set -euo pipefail
commit=${1:?usage: build-first-release.sh COMMIT OUT_DIR}
out=${2:?usage: build-first-release.sh COMMIT OUT_DIR}
root=$(cd "$(dirname "$0")/.." && pwd)
target=${IMAGE_RUST_TARGET:-x86_64-unknown-linux-musl}
stamp="$out/.built-$commit"

step() { printf '>> %s\n' "$*"; }

if [ -f "$stamp" ]; then
  step "the first release ($commit) is built already in $out"
  exit 0
fi
if ! git -C "$root" cat-file -e "$commit^{commit}" 2>/dev/null; then
  step "the first release's commit $commit is not in this clone (a shallow one?): fetching it"
  git -C "$root" fetch --quiet origin "$commit" || {
    echo "cannot fetch $commit: the node tier builds the first release from the repository's history (git fetch --unshallow)" >&2
    exit 1
  }
fi
mkdir -p "$out"
rm -f "$out"/.built-* "$out"/flux-plunger-*.tgz
src="$out/src"
rm -rf "$src" && mkdir -p "$src"
git -C "$root" archive "$commit" | tar -x -C "$src"

step "the first release's binaries from $commit (cargo build --release --target $target, no LTO; cold: about 5 minutes on 2 cores)"
(cd "$src" && cargo build --locked --release --target "$target" \
  -p flux-plunger -p flux-plunger-drain -p flux-plunger-sweep \
  --config profile.release.lto=false --config profile.release.codegen-units=16 \
  --target-dir "$out/target")

version=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$src/chart/Chart.yaml")
FLUX_PLUNGER_BINARIES="$out/target/$target/release" IMAGE_RUST_TARGET="$target" \
  "$root/hack/build-image.sh" "localhost/flux-plunger/first-release:$version" "$out"

step "the first release's chart, packaged"
helm package "$src/chart" --destination "$out"
touch "$stamp"
