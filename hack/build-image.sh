#!/usr/bin/env bash
# Builds, offline, the project's image (Dockerfile) and the node tier's pod
# sandbox image (testing/pause/Dockerfile), each FROM scratch around static
# binaries built here for the musl target: with Docker where an engine
# answers, else with buildah (its storage private to OUT_DIR, so no host image
# store is touched). Each image is checked (every binary runs `--version` in
# it, as the image's user), its size printed, and written as an OCI archive
# NAME.oci.tar beside a file NAME.ref naming its reference: the node tier
# pushes the project's to the test world's registry (`registry push`), whence
# its containerd pulls it by digest, and imports the pause image.
#
# Usage: hack/build-image.sh IMAGE_REF OUT_DIR
set -euo pipefail
image=${1:?usage: build-image.sh IMAGE_REF OUT_DIR}
out=${2:?usage: build-image.sh IMAGE_REF OUT_DIR}
root=$(cd "$(dirname "$0")/.." && pwd)
target=${IMAGE_RUST_TARGET:-x86_64-unknown-linux-musl}
binaries=(flux-plunger flux-plunger-drain flux-plunger-sweep)
pause_image=localhost/flux-plunger/pause:latest

step() { printf '>> %s\n' "$*"; }

# FLUX_PLUNGER_BINARIES=DIR: the three binaries are built already, in DIR
# (the first release's, hack/build-first-release.sh): only the project's image
# is made, around them.
prebuilt=${FLUX_PLUNGER_BINARIES:-}
if [ -n "$prebuilt" ]; then
  built=$prebuilt
  static=("${binaries[@]}")
else
  # cargo auditable, as make dist builds the released binaries: this is the
  # same build (pause changes no feature), so a release after the node tier
  # compiles nothing again for amd64.
  step "static binaries (cargo auditable build --release --target $target; cold: several minutes on 2 cores)"
  "${CARGO_AUDITABLE:-cargo-auditable}" auditable build --locked --release --target "$target" \
    -p flux-plunger -p flux-plunger-drain -p flux-plunger-sweep -p pause
  built="$root/target/$target/release"
  static=("${binaries[@]}" pause)
fi
for binary in "${static[@]}"; do
  # A scratch image has no loader: refuse anything dynamically linked.
  if readelf -l "$built/$binary" | grep -q 'Requesting program interpreter'; then
    echo "$built/$binary is dynamically linked; the image has no libc" >&2
    exit 1
  fi
done

if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
  engine=docker
elif command -v buildah >/dev/null 2>&1; then
  engine=buildah
  storage=(--root "$out/containers/storage" --runroot "$out/containers/run" --storage-driver vfs)
else
  echo "make image: neither a Docker engine (docker info failed) nor buildah is available; no image was built" >&2
  exit 1
fi
step "building with $engine, nothing pulled"

# build NAME REF DOCKERFILE FILES...: a context of exactly FILES, the image,
# its archive and its .ref.
build() {
  local name=$1 ref=$2 dockerfile=$3; shift 3
  local context="$out/context/$name"
  rm -rf "$context"; mkdir -p "$context"
  cp "$@" "$context/"
  rm -f "$out/$name.oci.tar"
  case $engine in
    docker)
      docker build --quiet --pull=false --network none -f "$dockerfile" -t "$ref" "$context" >/dev/null
      docker save -o "$out/$name.oci.tar" "$ref"
      ;;
    buildah)
      buildah "${storage[@]}" build --quiet --pull-never --network none --layers=false \
        -f "$dockerfile" -t "$ref" "$context" >/dev/null
      buildah "${storage[@]}" push --quiet "$ref" "oci-archive:$out/$name.oci.tar:$ref"
      ;;
  esac
  printf '%s\n' "$ref" > "$out/$name.ref"
}

# run REF USER PROGRAM ARGS...: PROGRAM of the image run in the image's root
# filesystem as USER, with the image's PATH and nothing else in its
# environment.
run() {
  local ref=$1 user=$2; shift 2
  case $engine in
    docker) docker run --rm --network none --user "$user" --entrypoint "$1" "$ref" "${@:2}" ;;
    buildah)
      # The container's root filesystem, chrooted into as USER: no OCI
      # runtime, no cgroup, nothing left behind. (`buildah run` re-executes
      # itself from a sealed memfd copy, which fails now and then with EBUSY
      # on this kind of host: "sealing memfd copy: Device or resource busy".)
      local container mnt status=0
      container=$(buildah "${storage[@]}" from --pull-never --quiet "$ref")
      mnt=$(buildah "${storage[@]}" mount "$container")
      env -i PATH=/usr/local/bin "$(command -v chroot)" --userspec="$user" "$mnt" "$@" || status=$?
      buildah "${storage[@]}" umount "$container" >/dev/null
      buildah "${storage[@]}" rm "$container" >/dev/null
      return "$status"
      ;;
  esac
}

size() {
  case $engine in
    docker) docker image inspect --format '{{.Size}}' "$1" | awk '{printf "%.1f MiB\n", $1 / 1048576}' ;;
    buildah) buildah "${storage[@]}" images --format '{{.Size}}' "$1" ;;
  esac
}

mkdir -p "$out"
build flux-plunger "$image" "$root/Dockerfile" "${binaries[@]/#/$built/}"
case $engine in
  docker) user=$(docker image inspect --format '{{.Config.User}}' "$image") ;;
  buildah) user=$(buildah "${storage[@]}" inspect --format '{{.OCIv1.Config.User}}' "$image") ;;
esac
[ "$user" = 65532:65532 ] || { echo "the image runs as '$user', not 65532:65532" >&2; exit 1; }
echo "   runs as $user"
for binary in "${binaries[@]}"; do
  printf '   %-20s ' "$binary:"
  run "$image" "$user" "$binary" --version
done
step "image $image: $(size "$image") ($out/flux-plunger.oci.tar)"

[ -z "$prebuilt" ] || exit 0
build pause "$pause_image" "$root/testing/pause/Dockerfile" "$built/pause"
step "pod sandbox image $pause_image: $(size "$pause_image") ($out/pause.oci.tar)"
