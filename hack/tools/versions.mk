# Versions of the tools that are not built from a go.mod of their own.
# The commit Helm's tag of each pinned helm.sh/helm/v3 version points at, which
# its release build stamps into `helm version` (GitCommit). A module zip carries
# no VCS data and the module proxy's .info for it names no origin, so it is
# written here: 144ca65 is what the official v3.22.0 binary prints. A version
# without an entry builds with an empty GitCommit rather than a wrong one.
HELM_GIT_COMMIT_v3.22.0 := 144ca65f8501953fa8b41cd1d37c7223051c85b7
# Flux's helm-controller: its CRDs, and (for e2e) its binary, built from a copy
# of the downloaded module because its go.mod replaces ./api.
HELM_CONTROLLER_VERSION := v1.6.4
# Every helm-controller the e2e suite runs against, each built into
# _out/bin/helm-controller-<version> by hack/build-flux-controller.sh.
# The orphaning bug was reported on v1.5.x, but the module proxy serves no
# v1.5.x (v1.5.0 to v1.5.6 answer 403), and two v1.6.x cannot be built from it:
# v1.6.0 needs github.com/fluxcd/pkg/chartutil v1.27.0 and v1.6.3 Flux's Helm
# fork github.com/fluxcd/helm/v4 v4.2.4-flux.1, both refused. So v1.5.x is
# bracketed: v1.6.1, the oldest buildable v1.6 (Helm v4, the line v1.5.0
# started), and v1.4.0, the newest buildable v1.4 (Helm v3; v1.4.4 and v1.4.5
# answer 403).
HELM_CONTROLLER_E2E_VERSIONS := v1.6.4 v1.6.1 v1.4.0
# Flux's source-controller, run by the tests beside helm-controller (it serves
# charts from OCIRepositories), built into _out/bin/source-controller-<version>
# by hack/build-flux-controller.sh; its CRDs (HelmChart, OCIRepository and the
# other sources helm-controller watches) come from the same version's
# config/crd/bases (the api module carries no CRDs). helm-controller
# $(HELM_CONTROLLER_VERSION) was built against source-controller/api v1.9.0, so
# the pin stays on the v1.9 line (the Makefile checks it): v1.9.3 is its newest
# that builds from the module proxy. v1.9.4 to v1.9.6 need
# github.com/fluxcd/pkg/artifact v0.18.2 or v0.18.3, which the proxy refuses
# (403); v1.10.x declare go 1.27, newer than the Go here. With v1.9.3,
# testing/e2e/tests/oci_chart.rs passes on every helm-controller pinned above.
SOURCE_CONTROLLER_VERSION := v1.9.3
# Flux's notification-controller (Alerts and Providers: where flux-plunger's
# events go), built like source-controller, its CRDs from the same version.
# v1.6.0 is the newest the module proxy serves whole: v1.6.1 and v1.7.2 to
# v1.8.3 (as far as tried) answer 403, and v1.7.0 and v1.7.1 have an .info but
# no go.mod (403). Its Alert and Provider are notification.toolkit.fluxcd.io/v1beta3.
NOTIFICATION_CONTROLLER_VERSION := v1.6.0
# Flux's CLI, whose `flux logs` the node tier runs against flux-plunger's pod
# (hack/build-flux-cli.sh): v2.9.5, Flux's release of helm-controller v1.6
# and source-controller v1.9, the newest the module proxy serves.
FLUX_CLI_VERSION := v2.9.5
# The Flux builds in lanes (the binaries of _out/bin/ a lane builds one after
# another, the lanes side by side): a build after one that compiled the same
# packages at the same versions finds them in Go's build cache. Here
# source-controller v1.9.3 and helm-controller v1.6.1 (Kubernetes v0.36.2,
# fluxcd/pkg/runtime v0.110.1), helm-controller v1.6.4 and Flux's CLI v2.9.5
# (Kubernetes v0.36.4, runtime v0.110.3); then cosign (Kubernetes v0.36.2 and
# cosign's own packages, which source-controller links) and helm-controller
# v1.4.0, which shares nothing. A pin moved apart only loses the
# sharing; one in no lane builds beside them.
FLUX_BUILD_LANES := source-controller-$(SOURCE_CONTROLLER_VERSION),helm-controller-v1.6.1,cosign \
	helm-controller-v1.6.4,flux,helm-controller-v1.4.0
# The first release of flux-plunger: the first commit CI accepted whole (its
# chart 0.1.0, the fence without its label). The node tier upgrades an install
# of it to today's chart with fences held (hack/build-first-release.sh rebuilds
# its image from this commit's source).
FIRST_RELEASE_COMMIT := d74ce849f55cd22406f847b753e7c440134c77ec
# bats-core, from npm (package "bats"), for the bats suites in bats/.
BATS_VERSION := 1.13.0
# The node tier (make test-node) and `make image`: Debian's packages, named
# here and nowhere else. containerd, runc and the CNI plugins make the node (the
# kubelet drives them); buildah builds the images where no Docker engine runs;
# musl-tools is the C compiler of the static binaries' C code (ring);
# iptables only lets hack/check-no-leftovers.sh read the host's firewall (it
# never writes it). Tried here: containerd 1.6.20, runc 1.1.5,
# containernetworking-plugins 1.1.1, buildah 1.28.2, musl-tools 1.2.3,
# iptables 1.8.9 (Debian 12).
NODE_DEBIAN_PACKAGES := containerd runc containernetworking-plugins buildah musl-tools iptables
# The Rust target of the image's static binaries (installed by rustup).
IMAGE_RUST_TARGET := x86_64-unknown-linux-musl
# make dist (docs/releasing.md) and make image build the release binaries with
# cargo-auditable, which embeds each binary's crate graph (a zlib-compressed
# JSON in a `.dep-v0` section) so that scanners see the crates inside a FROM
# scratch image; rust-audit-info, by the same authors, reads it back: make
# dist's SBOM is made from what the binaries carry. Both from crates.io into
# _out/cargo (cargo install --locked).
CARGO_AUDITABLE_VERSION := 0.7.7
RUST_AUDIT_INFO_VERSION := 0.5.4
# The arm64 image's static target (installed by rustup), and make dist's
# Debian packages, named here and nowhere else: gcc-aarch64-linux-gnu is the
# linker of the arm64 binaries and the C compiler of ring's C code, with
# libc6-dev-arm64-cross's headers (its stdint.h; the binaries link Rust's own
# musl); qemu-user-static runs the arm64 binaries' --version on this amd64
# machine; jq writes the SBOM; buildah and musl-tools as for make image. Tried
# here: gcc-aarch64-linux-gnu 12.2.0-3, libc6-dev-arm64-cross 2.36-8cross1,
# qemu-user-static 7.2+dfsg-7+deb12u18, jq 1.6-2.1+deb12u3 (Debian 12).
DIST_ARM64_RUST_TARGET := aarch64-unknown-linux-musl
DIST_DEBIAN_PACKAGES := buildah musl-tools gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static jq
