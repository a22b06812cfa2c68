#!/usr/bin/env bash
# make dist: builds, offline, what a release of flux-plunger publishes, then
# publishes it to one OCI registry, signs it with cosign and verifies what was
# pushed (docs/releasing.md):
#
#   REGISTRY/flux-plunger:VERSION          the image, an OCI index of linux/amd64
#                                          and linux/arm64, FROM scratch around the
#                                          three static binaries, built with
#                                          cargo auditable (each carries its crate
#                                          graph in a .dep-v0 section)
#   oci://REGISTRY/charts/flux-plunger     the chart, tagged VERSION
#
# The index and each platform's image, and the chart, are signed with the
# cosign key; the index carries a CycloneDX SBOM of the binaries' crates as a
# signed attestation (predicate type cyclonedx). No transparency log and no
# timestamp authority are used, so nothing but the registry is reached: users
# verify with the public key alone (cosign verify --key cosign.pub
# --insecure-ignore-tlog).
#
# VERSION is the workspace's, [workspace.package] version in Cargo.toml, the
# one place it is written: chart/Chart.yaml's version and appVersion must say
# the same (a chart-contract test fails otherwise), and CHANGELOG.md must have
# its section.
#
# Environment (the Makefile passes its DIST_* variables):
#   DIST_REGISTRY       where to publish: HOST[/NAMESPACE] (required)
#   DIST_COSIGN_KEY     cosign private key: a file (its password in
#                       COSIGN_PASSWORD) or a KMS URI cosign takes (required)
#   DIST_COSIGN_PUB     the public key to verify with; default cosign.pub at the
#                       repository's root, else the key's own. The key must be
#                       its pair: a release signed with another key is refused
#                       before anything is built.
#   DIST_CA_FILE        PEM CA the registry's certificate chains to, trusted
#                       besides the system's roots (the tests' registry)
#   DIST_DOCKER_CONFIG  a directory holding the registry's credentials as a
#                       Docker config.json (cosign login, helm registry login
#                       --registry-config, buildah login --authfile write one);
#                       default: none, anonymous
#   DIST_DIR            where the artifacts go (default _out/dist)
#   COSIGN, HELM, CARGO_AUDITABLE, RUST_AUDIT_INFO: the tools (default: on
#                       PATH); CARGO_AUDITABLE_VERSION, RUST_AUDIT_INFO_VERSION:
#                       their pins, which the SBOM names
#
# hack/dist.sh --binaries builds and checks the binaries of both platforms
# alone, and stops there: nothing is pushed or signed, no registry or key is
# needed. make test runs it ahead of make test-dist, beside the tiers, so that
# make dist finds them built.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
binaries_only=false
case "${1:-}" in
  --binaries) binaries_only=true ;;
  "") ;;
  *) echo "usage: $0 [--binaries]" >&2; exit 2 ;;
esac
if $binaries_only; then
  registry='' key=''
else
  registry=${DIST_REGISTRY:?DIST_REGISTRY is required: where to publish, HOST[/NAMESPACE] (docs/releasing.md)}
  key=${DIST_COSIGN_KEY:?DIST_COSIGN_KEY is required: the cosign private key that signs the release (docs/releasing.md)}
fi
pub=${DIST_COSIGN_PUB:-}
ca=${DIST_CA_FILE:-}
docker_config=${DIST_DOCKER_CONFIG:-}
out=${DIST_DIR:-$root/_out/dist}
cosign=${COSIGN:-cosign}
helm=${HELM:-helm}
cargo_auditable=${CARGO_AUDITABLE:-cargo-auditable}
rust_audit_info=${RUST_AUDIT_INFO:-rust-audit-info}
# Neither tool prints its version; the SBOM names them with their pins.
auditable_version=${CARGO_AUDITABLE_VERSION:?CARGO_AUDITABLE_VERSION is required (make dist sets it)}
rust_audit_info_version=${RUST_AUDIT_INFO_VERSION:?RUST_AUDIT_INFO_VERSION is required (make dist sets it)}
binaries=(flux-plunger flux-plunger-drain flux-plunger-sweep)
# Each platform: the Rust target, readelf's name of its machine, and how its
# binaries run here (the arm64 ones under qemu's user-mode emulator).
platforms=(linux/amd64 linux/arm64)
declare -A rust_target=([linux/amd64]=x86_64-unknown-linux-musl [linux/arm64]=aarch64-unknown-linux-musl)
declare -A elf_machine=([linux/amd64]='Advanced Micro Devices X86-64' [linux/arm64]=AArch64)
declare -A runner=([linux/amd64]='' [linux/arm64]=qemu-aarch64-static)

step() { printf '>> %s\n' "$*"; }
fail() { echo "make dist: $*" >&2; exit 1; }
started=$SECONDS
cd "$root"

# --- what is released ------------------------------------------------------

version=$(cargo metadata --locked --no-deps --format-version 1 |
  jq -r --arg names "${binaries[*]}" \
    '[.packages[] | select(.name as $n | $names | split(" ") | index($n)) | .version] | unique | if length == 1 then .[0] else error("the binaries disagree on their version: \(.)") end')
chart_field() { sed -n "s/^$1: *\"\{0,1\}\([^\"]*\)\"\{0,1\}\$/\1/p" chart/Chart.yaml; }
for field in version appVersion; do
  [ "$(chart_field "$field")" = "$version" ] ||
    fail "chart/Chart.yaml's $field is '$(chart_field "$field")', the workspace's version (Cargo.toml) is $version: they are one version (docs/releasing.md)"
done
grep -q "^## \[$version\]" CHANGELOG.md || fail "CHANGELOG.md has no section '## [$version]'"
image=$registry/flux-plunger
chart_repository=$registry/charts
if ! $binaries_only; then
  step "releasing flux-plunger $version: the image $image:$version and the chart oci://$chart_repository/flux-plunger:$version"

  # The public key the release is verified with, and the check that the signing
  # key is its pair: cosign.pub is what users verify against.
  if [ -z "$pub" ] && [ -f cosign.pub ]; then pub=$root/cosign.pub; fi
  mkdir -p "$out"
  "$cosign" public-key --key "$key" > "$out/signing-key.pub"
  if [ -n "$pub" ]; then
    cmp -s "$out/signing-key.pub" "$pub" || fail "DIST_COSIGN_KEY is not the pair of $pub: a release must verify with the published public key"
  else
    echo "   no cosign.pub at the repository's root: verifying with the signing key's own public key"
    pub=$out/signing-key.pub
  fi
  cp "$pub" "$out/cosign.pub"
fi

hack/check-release-features.sh

# --- the binaries, for each platform ----------------------------------------

# The C compiler of ring's C code and the linker for arm64: Debian's cross gcc
# (gcc-aarch64-linux-gnu), linking Rust's self-contained musl; amd64 uses
# musl-gcc as make image does.
export CC_aarch64_unknown_linux_musl=aarch64-linux-gnu-gcc
export AR_aarch64_unknown_linux_musl=aarch64-linux-gnu-ar
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_MUSL_LINKER=aarch64-linux-gnu-gcc

for platform in "${platforms[@]}"; do
  target=${rust_target[$platform]}
  step "$platform: cargo auditable build --release --target $target (cold: several minutes on 2 cores)"
  # Exactly the release selection (hack/check-release-features.sh). For amd64
  # this is make image's build less the pause binary, which changes no
  # feature: what the node tier built is reused, not compiled again.
  "$cargo_auditable" auditable build --locked --release --target "$target" \
    -p flux-plunger -p flux-plunger-drain -p flux-plunger-sweep
  dir=$out/bin/${platform/\//-}
  rm -rf "$dir" && mkdir -p "$dir"
  for binary in "${binaries[@]}"; do
    file=$root/target/$target/release/$binary
    headers=$(readelf -h -l -S -W "$file")
    # A scratch image has no loader: refuse anything dynamically linked.
    ! grep -q 'Requesting program interpreter' <<<"$headers" || fail "$file is dynamically linked; the image has no libc"
    grep -q "Machine: *${elf_machine[$platform]}\$" <<<"$headers" || fail "$file is not a ${elf_machine[$platform]} binary"
    grep -q ' \.dep-v0 ' <<<"$headers" || fail "$file has no .dep-v0 section: not built by cargo auditable"
    said=$(env -i ${runner[$platform]} "$file" --version)
    [ "$said" = "$binary $version" ] || fail "$file --version says '$said', not '$binary $version'"
    printf '   %-20s %s, static, .dep-v0, --version: %s\n' "$binary:" "${elf_machine[$platform]}" "$said"
    cp "$file" "$dir/"
  done
done
if $binaries_only; then
  step "the binaries of ${platforms[*]} are built and checked (${SECONDS}s); make dist finds them in target/"
  exit 0
fi

# --- the image: one index of both platforms ---------------------------------

storage=(--root "$out/containers/storage" --runroot "$out/containers/run" --storage-driver vfs)
list=localhost/flux-plunger-dist:$version
rm -rf "$out/containers" "$out/context"
labels=(--label "org.opencontainers.image.version=$version")
revision=$(git rev-parse HEAD 2>/dev/null) && labels+=(--label "org.opencontainers.image.revision=$revision")
# The last commit's time as every file's and the image's creation time: the
# same binaries make the same image, digest for digest.
epoch=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 0)}
for platform in "${platforms[@]}"; do
  step "$platform: the image, FROM scratch (buildah, nothing pulled)"
  context=$out/context/${platform/\//-}
  mkdir -p "$context"
  cp "$out/bin/${platform/\//-}"/* "$context/"
  ref=localhost/flux-plunger-dist-${platform/\//-}:$version
  buildah "${storage[@]}" build --quiet --pull-never --network none --layers=false \
    --platform "$platform" --timestamp "$epoch" "${labels[@]}" \
    --manifest "$list" -t "$ref" -f Dockerfile "$context" >/dev/null
  config=$(buildah "${storage[@]}" inspect --format '{{.OCIv1.Architecture}} {{.OCIv1.Config.User}}' "$ref")
  read -r arch user <<<"$config"
  [ "linux/$arch" = "$platform" ] || fail "the $platform image's config says architecture $arch"
  [ "$user" = 65532:65532 ] || fail "the $platform image runs as '$user', not 65532:65532"
  # Each binary run from the image's own root filesystem, as the image's user.
  container=$(buildah "${storage[@]}" from --pull-never --quiet --platform "$platform" "$ref")
  mnt=$(buildah "${storage[@]}" mount "$container")
  for binary in "${binaries[@]}"; do
    if [ -n "${runner[$platform]}" ]; then
      # The emulator is not in the image: it runs the image's file from outside.
      said=$(env -i "${runner[$platform]}" "$mnt/usr/local/bin/$binary" --version)
    else
      said=$(env -i PATH=/usr/local/bin "$(command -v chroot)" --userspec="$user" "$mnt" "$binary" --version)
    fi
    [ "$said" = "$binary $version" ] || fail "$binary in the $platform image says '$said'"
  done
  buildah "${storage[@]}" umount "$container" >/dev/null
  buildah "${storage[@]}" rm "$container" >/dev/null
  echo "   $ref: $arch, runs as $user, $(buildah "${storage[@]}" images --format '{{.Size}}' "$ref")"
done
buildah "${storage[@]}" manifest inspect "$list" |
  jq -e '[.manifests[].platform | "\(.os)/\(.architecture)"] | sort == ["linux/amd64", "linux/arm64"]' >/dev/null ||
  fail "the index does not list exactly linux/amd64 and linux/arm64"

# --- the chart and the SBOM --------------------------------------------------

step "the chart, version and appVersion $version"
"$helm" package chart --version "$version" --app-version "$version" --destination "$out" >/dev/null
chart=$out/flux-plunger-$version.tgz
[ -f "$chart" ] || fail "helm package wrote no $chart"

step "the SBOM: CycloneDX, from the crate graphs the binaries carry"
sbom=$out/flux-plunger-$version.cdx.json
for platform in "${platforms[@]}"; do
  for binary in "${binaries[@]}"; do
    "$rust_audit_info" "$out/bin/${platform/\//-}/$binary" |
      jq --arg binary "$binary" --arg platform "$platform" '{binary: $binary, platform: $platform, packages}'
  done
done | jq -s --arg version "$version" \
  --arg auditable "$auditable_version" --arg rust_audit_info "$rust_audit_info_version" '
  def ref: "\(.name)@\(.version)";
  # Only crates.io crates get a purl: the workspace'"'"'s own crates are not
  # published, and pkg:cargo/NAME would name another crate of that name.
  def purl: if .source == "crates.io" then {purl: "pkg:cargo/\(.name)@\(.version)"} else {} end;
  [.[] | .packages as $packages | .platform as $platform | $packages[] |
    {name, version, source, platform: $platform, root: (.root // false), runtime: ((.kind // "runtime") == "runtime"),
     depends: [(.dependencies // [])[] | $packages[.] | ref]}]
  | group_by(ref)
  | map({name: .[0].name, version: .[0].version, source: .[0].source, root: any(.[]; .root),
         runtime: any(.[]; .runtime), platforms: ([.[].platform] | unique), depends: ([.[].depends[]] | unique)}) as $crates
  | {
      bomFormat: "CycloneDX", specVersion: "1.5", version: 1,
      metadata: {
        tools: {components: [
          {type: "application", name: "cargo-auditable", version: $auditable},
          {type: "application", name: "rust-audit-info", version: $rust_audit_info}]},
        component: {type: "container", "bom-ref": "flux-plunger-image", name: "flux-plunger", version: $version,
          properties: [{name: "platforms", value: "linux/amd64,linux/arm64"}]}
      },
      components: [$crates[] |
        {type: (if .root then "application" else "library" end), "bom-ref": ref, name, version,
         # A crate compiled only into a build script or a proc macro is not in
         # the binary itself.
         scope: (if .runtime then "required" else "excluded" end)}
        + purl
        + (if (.platforms | length) < 2 then {properties: [{name: "platforms", value: (.platforms | join(","))}]} else {} end)],
      dependencies: ([{ref: "flux-plunger-image", dependsOn: [$crates[] | select(.root) | ref]}]
        + [$crates[] | {ref: ref, dependsOn: .depends}])
    }' > "$sbom"
jq -e --arg version "$version" '[.components[] | select(.type == "application") | .name] | sort == ["flux-plunger", "flux-plunger-drain", "flux-plunger-sweep"]' "$sbom" >/dev/null ||
  fail "$sbom does not name the three binaries"
echo "   $(jq '.components | length' "$sbom") crates ($sbom)"

# --- publish, sign, verify ---------------------------------------------------

# What every client is given to reach the registry: its CA (never an insecure
# switch) and the credentials, if any.
cert_dir=$out/registry-certs
rm -rf "$cert_dir" && mkdir -p "$cert_dir"
buildah_tls=(--cert-dir "$cert_dir") helm_tls=() cosign_tls=()
if [ -n "$ca" ]; then
  cp "$ca" "$cert_dir/ca.crt"
  helm_tls=(--ca-file "$ca") cosign_tls=(--registry-cacert "$ca")
fi
if [ -n "$docker_config" ]; then
  buildah_tls+=(--authfile "$docker_config/config.json")
  helm_tls+=(--registry-config "$docker_config/config.json")
  export DOCKER_CONFIG=$docker_config
else
  # No credentials, and none of $HOME's: a config of its own, empty.
  export DOCKER_CONFIG=$out/docker-config
  mkdir -p "$DOCKER_CONFIG" && echo '{}' > "$DOCKER_CONFIG/config.json"
fi
# cosign keeps Sigstore's TUF metadata here rather than under $HOME; with the
# files below it has no reason to fetch any.
export TUF_ROOT=$out/cosign/tuf
mkdir -p "$out/cosign"
# A signing config naming no service and a trusted root trusting none: a
# signature by the key alone, no transparency log, no timestamp authority.
"$cosign" signing-config create --out "$out/cosign/signing-config.json" >/dev/null
"$cosign" trusted-root create --out "$out/cosign/trusted-root.json" >/dev/null
signing=(--key "$key" --signing-config "$out/cosign/signing-config.json" --trusted-root "$out/cosign/trusted-root.json" --yes)

step "pushing the image index (both platforms) to $image:$version"
buildah "${storage[@]}" manifest push --quiet --all --format oci "${buildah_tls[@]}" \
  --digestfile "$out/image.digest" "$list" "docker://$image:$version"
image_digest=$(cat "$out/image.digest")
echo "   $image@$image_digest"

step "pushing the chart to oci://$chart_repository"
pushed=$("$helm" push "$chart" "oci://$chart_repository" "${helm_tls[@]}" 2>&1) || fail "helm push: $pushed"
chart_digest=$(sed -n 's/^Digest: *//p' <<<"$pushed")
[ -n "$chart_digest" ] || fail "helm push printed no digest: $pushed"
echo "   $chart_repository/flux-plunger@$chart_digest"

step "signing the index and each platform's image, the chart, and the SBOM as an attestation (cosign $("$cosign" version --json 2>/dev/null | jq -r .gitVersion))"
"$cosign" sign "${signing[@]}" "${cosign_tls[@]}" --recursive "$image@$image_digest"
"$cosign" sign "${signing[@]}" "${cosign_tls[@]}" "$chart_repository/flux-plunger@$chart_digest"
"$cosign" attest "${signing[@]}" "${cosign_tls[@]}" --type cyclonedx --predicate "$sbom" "$image@$image_digest"

step "verifying what was pushed with $pub"
verify=(--key "$out/cosign.pub" --insecure-ignore-tlog "${cosign_tls[@]}")
"$cosign" verify "${verify[@]}" "$image:$version" >/dev/null
"$cosign" verify "${verify[@]}" "$chart_repository/flux-plunger:$version" >/dev/null
"$cosign" verify-attestation "${verify[@]}" --type cyclonedx "$image:$version" >/dev/null

cat > "$out/published" <<EOF
image=$image:$version@$image_digest
chart=oci://$chart_repository/flux-plunger:$version@$chart_digest
EOF
step "flux-plunger $version published in $((SECONDS - started))s:"
sed 's/^/   /' "$out/published"
