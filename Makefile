# flux-plunger: every entry point. `make help` lists them. The crates are
# where docs/architecture.md (Crates) says: crates/ the library, bins/ what
# ships, testing/ the test world.
#
# Tools are built from pinned Go modules into _out/ (git-ignored); nothing is
# downloaded from release pages. A second `make tools` is a no-op.

SHELL := /usr/bin/env bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

include hack/tools/versions.mk

OUT := $(CURDIR)/_out
BIN := $(OUT)/bin
CRDS := $(OUT)/crds
HELM_HOME := $(OUT)/helm
GO_BUILD := go build -trimpath -ldflags='-s -w'

# helm keeps its plugins, cache and config under _out/, never in $HOME.
export HELM_PLUGINS := $(HELM_HOME)/plugins
export HELM_CACHE_HOME := $(HELM_HOME)/cache
export HELM_CONFIG_HOME := $(HELM_HOME)/config
export HELM_DATA_HOME := $(HELM_HOME)/data
export FLUX_PLUNGER_OUT := $(OUT)
export PATH := $(BIN):$(PATH)

CARGO_TEST := cargo test --workspace --locked
# Every test tier appends its runner's output here; `make test` ends with one
# line that sums them up ("N passed, N failed").
TEST_LOG := $(CURDIR)/target/test-logs

# When the outermost make started (seconds since the epoch): every step says
# how far into the run it begins, and every built tool how far in it was
# done, so a cold run's log is its own timeline.
ifndef MAKE_STARTED
MAKE_STARTED := $(shell date +%s)
endif
export MAKE_STARTED
into_run = $$(t=$$(( $$(date +%s) - $(MAKE_STARTED) )); printf '%d:%02d' $$((t / 60)) $$((t % 60)))
step = @printf '\n\033[1m>> %s\033[0m (%s into the run)\n' "$(1)" "$(into_run)"
built = @printf '>> built %s (%s into the run)\n' "$(1)" "$(into_run)"

.PHONY: help
help: ## List the targets.
	@grep -hE '^[a-z][a-z-]*:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

##@ Tools

# The control plane's and the node's Kubernetes binaries (see below).
K8S_COMMANDS := kube-apiserver kubectl kubelet kube-controller-manager kube-scheduler
HELM_CONTROLLERS := $(foreach v,$(HELM_CONTROLLER_E2E_VERSIONS),$(BIN)/helm-controller-$(v))
# make e2e's tiers, one per helm-controller: e2e-VERSION.
E2E_TIERS := $(addprefix e2e-,$(HELM_CONTROLLER_E2E_VERSIONS))
SOURCE_CONTROLLER := $(BIN)/source-controller-$(SOURCE_CONTROLLER_VERSION)
NOTIFICATION_CONTROLLER := $(BIN)/notification-controller-$(NOTIFICATION_CONTROLLER_VERSION)
comma := ,
# chain: each of the targets $(1) waits for the one before it (order-only
# prerequisites: it does not make the one before it out of date).
chain = $(foreach i,$(shell seq 2 $(words $(1))),$(eval $(word $(i),$(1)): | $(word $(shell expr $(i) - 1),$(1))))

# What the tiers need, in groups, so that `make test` runs each tier as soon
# as its own tools are built and builds the rest beside the tiers before.
#
# The local control plane and what the envtest tier runs: the Kubernetes
# binaries, etcd, notification-controller, the OCI registry, helm and the CRDs.
ENVTEST_TOOLS := $(addprefix $(BIN)/,$(K8S_COMMANDS)) $(BIN)/etcd $(NOTIFICATION_CONTROLLER) $(BIN)/registry \
	$(BIN)/helm $(CRDS)/.done $(CRDS)/.source-controller.done $(CRDS)/.notification-controller.done
# And what the chart and bats tiers run besides: promtool, helm-unittest and
# helm-docs.
TIER_TOOLS := $(ENVTEST_TOOLS) $(BIN)/promtool $(HELM_PLUGINS)/unittest/plugin.yaml $(BIN)/helm-docs
# What only the e2e and node tiers run: source-controller, every pinned
# helm-controller and Flux's CLI. They build at the lowest CPU priority
# (NICE_BESIDE_TESTS, like the images only the node tier runs): beside the
# tiers before e2e they take the cores only when a tier leaves them idle,
# waiting on its servers.
FLUX_TOOLS := $(SOURCE_CONTROLLER) $(HELM_CONTROLLERS) $(BIN)/flux
NICE_BESIDE_TESTS := nice -n 19
TOOLS := $(TIER_TOOLS) $(FLUX_TOOLS)

# The builds run in lanes, one build at a time in each, the lanes side by
# side: two for the tier tools, the longest first in each (the Kubernetes
# binaries and notification-controller, 10 to 12 minutes cold), then the
# Flux builds' lanes (FLUX_BUILD_LANES in versions.mk). The lanes, not make's
# job count, bound how many builds run at once, so `make test` can give make
# jobs enough that a tier never waits for a free one.
$(call chain,$(BIN)/kube-apiserver $(BIN)/etcd $(BIN)/registry $(BIN)/helm $(HELM_PLUGINS)/unittest/plugin.yaml $(BIN)/helm-docs)
$(call chain,$(NOTIFICATION_CONTROLLER) $(BIN)/promtool)
$(foreach lane,$(FLUX_BUILD_LANES),$(call chain,$(addprefix $(BIN)/,$(subst $(comma), ,$(lane)))))

# `make tools` alone runs TOOLS_JOBS builds at a time.
TOOLS_JOBS ?= 3

.PHONY: tools
tools: ## Build the pinned tools (etcd, kube-apiserver, kubectl, kubelet, kube-controller-manager, kube-scheduler, helm, helm-unittest, helm-docs, Flux's helm-, source- and notification-controller, the OCI registry, promtool, Flux's CLI) and fetch the CRDs into _out/, TOOLS_JOBS at a time.
	@started=$$SECONDS; $(MAKE) --no-print-directory -j$(TOOLS_JOBS) tools-built; \
	  echo ">> tools ready in $(BIN) ($$((SECONDS - started))s)"

.PHONY: tools-built
tools-built: $(TOOLS)

K8S_MOD := hack/tools/kubernetes/go.mod hack/tools/kubernetes/go.sum
# The version the binaries report: helm checks a chart's kubeVersion against it.
K8S_VERSION = $(shell cd hack/tools/kubernetes && go list -m -f '{{.Version}}' k8s.io/kubernetes)
K8S_LDFLAGS = -X k8s.io/component-base/version.gitVersion=$(K8S_VERSION) \
	-X k8s.io/component-base/version.gitMajor=$(word 2,$(subst ., ,$(subst v,v ,$(K8S_VERSION)))) \
	-X k8s.io/component-base/version.gitMinor=$(word 2,$(subst ., ,$(K8S_VERSION))) \
	-X k8s.io/component-base/version.gitTreeState=clean \
	-X k8s.io/client-go/pkg/version.gitVersion=$(K8S_VERSION)
# The control plane's and the node's Kubernetes binaries, in one `go build`:
# one invocation shares the analysis and compilation of the packages they have
# in common (most of them). Cold, on 2 busy cores: about 12 minutes; warm
# (go.mod unchanged, cache kept): seconds.
$(addprefix $(BIN)/,$(K8S_COMMANDS)) &: $(K8S_MOD) hack/tools/kubernetes/tools.go
	$(call step,building $(K8S_COMMANDS) from k8s.io/kubernetes (one go build; cold: about 12 minutes on 2 cores))
	mkdir -p $(BIN)
	cd hack/tools/kubernetes && go build -trimpath -ldflags='-s -w $(K8S_LDFLAGS)' -o $(BIN)/ \
	  $(addprefix k8s.io/kubernetes/cmd/,$(K8S_COMMANDS))
	touch $(addprefix $(BIN)/,$(K8S_COMMANDS))
	$(call built,the Kubernetes binaries)

$(BIN)/etcd: hack/tools/etcd/go.mod hack/tools/etcd/go.sum hack/tools/etcd/main.go
	$(call step,building etcd)
	cd hack/tools/etcd && $(GO_BUILD) -o $@ .
	$(call built,$(notdir $@))

HELM_MOD := hack/tools/helm/go.mod hack/tools/helm/go.sum
# helm as Helm's own release build makes it: the -X flags of the Makefile in
# the module (`go list -m -f '{{.Dir}}' helm.sh/helm/v3`) for a tagged, clean
# tree. Its default Kubernetes version (what `helm template` and `helm lint`
# assume, asking no cluster, and check a chart's kubeVersion against) comes, as
# there, from the k8s.io/client-go of helm's own go.mod: major + 1, minor
# (v0.37.0: Kubernetes 1.37). Without these flags helm assumes 1.20.
HELM_VERSION = $(shell cd hack/tools/helm && go list -m -f '{{.Version}}' helm.sh/helm/v3)
HELM_CLIENT_GO = $(subst ., ,$(subst v,,$(shell awk '$$1 == "k8s.io/client-go" { print $$2 }' \
	"$$(cd hack/tools/helm && go list -m -f '{{.GoMod}}' helm.sh/helm/v3)")))
HELM_K8S_MAJOR = $(shell echo $$(( $(firstword $(HELM_CLIENT_GO)) + 1 )))
HELM_K8S_MINOR = $(word 2,$(HELM_CLIENT_GO))
HELM_LDFLAGS = -s -w \
	-X helm.sh/helm/v3/internal/version.version=$(HELM_VERSION) \
	-X helm.sh/helm/v3/internal/version.metadata= \
	-X helm.sh/helm/v3/internal/version.gitCommit=$(HELM_GIT_COMMIT_$(HELM_VERSION)) \
	-X helm.sh/helm/v3/internal/version.gitTreeState=clean \
	-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=$(HELM_K8S_MAJOR) \
	-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$(HELM_K8S_MINOR) \
	-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=$(HELM_K8S_MAJOR) \
	-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$(HELM_K8S_MINOR)
$(BIN)/helm: $(HELM_MOD) hack/tools/versions.mk
	$(call step,building helm $(HELM_VERSION) as Helm's release build does (Kubernetes $(HELM_K8S_MAJOR).$(HELM_K8S_MINOR) by default))
	@test -n "$(HELM_K8S_MINOR)" || { echo "no k8s.io/client-go requirement in helm's go.mod" >&2; exit 1; }
	cd hack/tools/helm && CGO_ENABLED=0 go build -trimpath -ldflags='$(HELM_LDFLAGS)' -o $@ helm.sh/helm/v3/cmd/helm
	$(call built,$(notdir $@))

$(HELM_PLUGINS)/unittest/plugin.yaml: $(HELM_MOD) hack/tools/helm/unittest-plugin.yaml
	$(call step,building the helm-unittest plugin)
	mkdir -p $(HELM_PLUGINS)/unittest
	cd hack/tools/helm && $(GO_BUILD) -o $(HELM_PLUGINS)/unittest/untt github.com/helm-unittest/helm-unittest/cmd/helm-unittest
	cp hack/tools/helm/unittest-plugin.yaml $@
	$(call built,the helm-unittest plugin)

# helm-docs, which writes chart/README.md's values table (make chart-docs), as
# its release build (goreleaser's defaults) makes it: the version without its v.
HELM_DOCS_MOD := hack/tools/helm-docs/go.mod hack/tools/helm-docs/go.sum
$(BIN)/helm-docs: $(HELM_DOCS_MOD) hack/tools/helm-docs/tools.go
	$(call step,building helm-docs)
	cd hack/tools/helm-docs && CGO_ENABLED=0 go build -trimpath \
	  -ldflags="-s -w -X main.version=$$(go list -m -f '{{.Version}}' github.com/norwoodj/helm-docs | sed 's/^v//')" \
	  -o $@ github.com/norwoodj/helm-docs/cmd/helm-docs
	$(call built,$(notdir $@))

# The directory of a downloaded module: $(call module_dir,path@version).
module_dir = $$(go mod download -json $(1) | sed -n 's/^\t"Dir": "\(.*\)",$$/\1/p')
# Copies CRD files into _out/crds only when they differ: a control plane
# starting elsewhere may be reading them.
install_crds = for f in $(1); do cmp -s "$$f" $(CRDS)/$$(basename "$$f") || install -m 0644 "$$f" $(CRDS)/; done

$(CRDS)/.done: hack/tools/versions.mk
	$(call step,taking the HelmRelease CRD from github.com/fluxcd/helm-controller@$(HELM_CONTROLLER_VERSION))
	mkdir -p $(CRDS)
	dir=$(call module_dir,github.com/fluxcd/helm-controller@$(HELM_CONTROLLER_VERSION)); \
	  test -n "$$dir" || { echo "could not download github.com/fluxcd/helm-controller@$(HELM_CONTROLLER_VERSION)"; exit 1; }; \
	  $(call install_crds,"$$dir"/config/crd/bases/helm.toolkit.fluxcd.io_helmreleases.yaml)
	touch $@

# source-controller's CRDs come from the version that runs, which must be of
# the minor line helm-controller@$(HELM_CONTROLLER_VERSION) was built against
# (the source API it reads): a pin of another line fails here.
$(CRDS)/.source-controller.done: hack/tools/versions.mk
	$(call step,taking source-controller's CRDs from github.com/fluxcd/source-controller@$(SOURCE_CONTROLLER_VERSION))
	mkdir -p $(CRDS)
	hc=$(call module_dir,github.com/fluxcd/helm-controller@$(HELM_CONTROLLER_VERSION)); \
	  required=$$(awk '$$1 == "github.com/fluxcd/source-controller/api" { print $$2 }' "$$hc"/go.mod); \
	  test -n "$$required" || { echo "no source-controller/api requirement in helm-controller's go.mod"; exit 1; }; \
	  test "$${required%.*}" = "$(basename $(SOURCE_CONTROLLER_VERSION))" || { \
	    echo "helm-controller $(HELM_CONTROLLER_VERSION) reads source-controller/api $$required; SOURCE_CONTROLLER_VERSION $(SOURCE_CONTROLLER_VERSION) is another minor line"; exit 1; }; \
	  sc=$(call module_dir,github.com/fluxcd/source-controller@$(SOURCE_CONTROLLER_VERSION)); \
	  test -n "$$sc" || { echo "could not download github.com/fluxcd/source-controller@$(SOURCE_CONTROLLER_VERSION)"; exit 1; }; \
	  $(call install_crds,"$$sc"/config/crd/bases/source.toolkit.fluxcd.io_*.yaml)
	touch $@

# notification-controller's CRDs (Alert, Provider, Receiver), from the version
# that runs.
$(CRDS)/.notification-controller.done: hack/tools/versions.mk
	$(call step,taking notification-controller's CRDs from github.com/fluxcd/notification-controller@$(NOTIFICATION_CONTROLLER_VERSION))
	mkdir -p $(CRDS)
	nc=$(call module_dir,github.com/fluxcd/notification-controller@$(NOTIFICATION_CONTROLLER_VERSION)); \
	  test -n "$$nc" || { echo "could not download github.com/fluxcd/notification-controller@$(NOTIFICATION_CONTROLLER_VERSION)"; exit 1; }; \
	  $(call install_crds,"$$nc"/config/crd/bases/notification.toolkit.fluxcd.io_*.yaml)
	touch $@

# Flux's helm-controller at each version of HELM_CONTROLLER_E2E_VERSIONS
# (cold, on 2 cores: about 3.5 minutes for v1.6.4, 2 for v1.6.1 after
# source-controller, whose packages it shares, and 4.5 for v1.4.0, on Helm v3;
# warm: seconds).
$(BIN)/helm-controller-%: hack/build-flux-controller.sh hack/module-copy.sh
	$(call step,building helm-controller $* from github.com/fluxcd/helm-controller@$*)
	$(NICE_BESIDE_TESTS) hack/build-flux-controller.sh github.com/fluxcd/helm-controller $* $@
	$(call built,$(notdir $@))

# Flux's source-controller (OCIRepository and the other sources, its artifact
# server) and notification-controller (events to Alerts' Providers), at the
# pins of versions.mk. Cold (empty module and build caches), side by side on 2
# cores that cargo builds shared: about 13 minutes for source-controller (its
# cloud SDKs, cosign and notation make it the largest; a 100 MB binary) and 12
# for notification-controller; warm: seconds.
$(BIN)/source-controller-%: hack/build-flux-controller.sh hack/module-copy.sh
	$(call step,building source-controller $* from github.com/fluxcd/source-controller@$* (cold: about 13 minutes))
	$(NICE_BESIDE_TESTS) hack/build-flux-controller.sh github.com/fluxcd/source-controller $* $@
	$(call built,$(notdir $@))

$(BIN)/notification-controller-%: hack/build-flux-controller.sh hack/module-copy.sh
	$(call step,building notification-controller $* from github.com/fluxcd/notification-controller@$* (cold: about 12 minutes))
	hack/build-flux-controller.sh github.com/fluxcd/notification-controller $* $@
	$(call built,$(notdir $@))

# The tests' OCI registry: go-containerregistry's pkg/registry behind TLS, in a
# main of ours (hack/tools/registry; cold: seconds, its only dependency is the
# registry package).
REGISTRY_MOD := hack/tools/registry/go.mod hack/tools/registry/go.sum
$(BIN)/registry: $(REGISTRY_MOD) hack/tools/registry/main.go
	$(call step,building the OCI registry (go-containerregistry's pkg/registry, hack/tools/registry))
	cd hack/tools/registry && CGO_ENABLED=0 $(GO_BUILD) -o $@ .
	$(call built,$(notdir $@))

# promtool, Prometheus's own rule checker and tester (`promtool test rules` runs
# the chart's PrometheusRule in make test-chart), from the pinned
# github.com/prometheus/prometheus module (v0.316.0 is Prometheus 3.16.0), with
# the version its release build stamps (promu's ldflags, from the module's
# VERSION file) and its netgo tag, less Prometheus's service discovery plugins
# (its own remove_all_sd tag: `promtool test rules` discovers nothing, and the
# plugins' cloud SDKs were a fifth of its packages). Cold (its modules
# downloaded, its build cache empty), on 2 cores other builds shared: about 8
# minutes; warm: seconds.
PROMTOOL_MOD := hack/tools/promtool/go.mod hack/tools/promtool/go.sum
$(BIN)/promtool: $(PROMTOOL_MOD) hack/tools/promtool/tools.go
	$(call step,building promtool from github.com/prometheus/prometheus (hack/tools/promtool; cold: about 8 minutes))
	cd hack/tools/promtool && dir=$$(go list -m -f '{{.Dir}}' github.com/prometheus/prometheus) && \
	  CGO_ENABLED=0 go build -trimpath -tags netgo,remove_all_sd \
	  -ldflags="-s -w -X github.com/prometheus/common/version.Version=$$(cat "$$dir/VERSION")" \
	  -o $@ github.com/prometheus/prometheus/cmd/promtool
	$(call built,$(notdir $@))

# cosign, which signs what `make dist` publishes and verifies it there and in
# make test-dist, from the pinned github.com/sigstore/cosign/v3 module
# (hack/tools/cosign), without CGO and stamped as its release build stamps it
# (the -X flags of the LDFLAGS in the module's Makefile): the version, tree
# state `clean`, and as the build date the tag's commit time, which the module
# proxy records. The commit itself is in no module file, so `cosign version`
# says GitCommit unknown rather than a wrong one. Cold (its modules
# downloaded, its build cache empty), on 2 cores other builds shared (load
# about 9): 519 s, about 9 minutes, its cloud KMS SDKs most of it; warm:
# seconds.
COSIGN_MODULE := github.com/sigstore/cosign/v3
COSIGN_MOD := hack/tools/cosign/go.mod hack/tools/cosign/go.sum
$(BIN)/cosign: $(COSIGN_MOD) hack/tools/cosign/tools.go
	$(call step,building cosign from $(COSIGN_MODULE) (hack/tools/cosign; cold: about 9 minutes))
	cd hack/tools/cosign && version=$$(go list -m -f '{{.Version}}' $(COSIGN_MODULE)) && \
	  date=$$(go list -m -f '{{.Time.UTC.Format "2006-01-02T15:04:05Z"}}' $(COSIGN_MODULE)) && \
	  CGO_ENABLED=0 $(NICE_BESIDE_TESTS) go build -trimpath -ldflags="-s -w -buildid= \
	    -X sigs.k8s.io/release-utils/version.gitVersion=$$version \
	    -X sigs.k8s.io/release-utils/version.gitTreeState=clean \
	    -X sigs.k8s.io/release-utils/version.buildDate=$$date" \
	  -o $@ $(COSIGN_MODULE)/cmd/cosign
	$(call built,$(notdir $@))

# Flux's CLI (its `flux logs` reads flux-plunger's pods in the node tier),
# from github.com/fluxcd/flux2/v2 at FLUX_CLI_VERSION.
$(BIN)/flux: hack/build-flux-cli.sh hack/module-copy.sh hack/tools/versions.mk
	$(call step,building Flux's CLI $(FLUX_CLI_VERSION) from github.com/fluxcd/flux2/v2 (cold: several minutes))
	$(NICE_BESIDE_TESTS) hack/build-flux-cli.sh $(FLUX_CLI_VERSION) $@
	$(call built,$(notdir $@))

# bats-core from npm into _out/npm, at the version pinned in versions.mk; the
# stamp names the version, so a new pin installs again.
NPM_PREFIX := $(OUT)/npm
BATS := $(NPM_PREFIX)/node_modules/bats/bin/bats
BATS_STAMP := $(NPM_PREFIX)/.bats-$(BATS_VERSION)
$(BATS_STAMP):
	$(call step,installing bats $(BATS_VERSION) from npm into $(NPM_PREFIX))
	@command -v npm >/dev/null 2>&1 || { echo "npm is missing: bats is installed with it (Node.js 18 or later)" >&2; exit 1; }
	mkdir -p $(NPM_PREFIX)
	npm install --prefix $(NPM_PREFIX) --no-audit --no-fund --save-exact bats@$(BATS_VERSION)
	touch $@

# cargo-auditable (make image and make dist build the release binaries with
# it) and rust-audit-info (make dist's SBOM reads the binaries with it), from
# crates.io into _out/cargo at the pins of versions.mk; the stamps name the
# versions, so a new pin installs again. Cold, on 2 busy cores: about 2
# minutes and 30 seconds.
CARGO_ROOT := $(OUT)/cargo
CARGO_AUDITABLE := $(CARGO_ROOT)/bin/cargo-auditable
CARGO_AUDITABLE_STAMP := $(CARGO_ROOT)/.cargo-auditable-$(CARGO_AUDITABLE_VERSION)
RUST_AUDIT_INFO := $(CARGO_ROOT)/bin/rust-audit-info
RUST_AUDIT_INFO_STAMP := $(CARGO_ROOT)/.rust-audit-info-$(RUST_AUDIT_INFO_VERSION)
$(CARGO_AUDITABLE_STAMP):
	$(call step,installing cargo-auditable $(CARGO_AUDITABLE_VERSION) into $(CARGO_ROOT))
	$(NICE_BESIDE_TESTS) cargo install --locked cargo-auditable@$(CARGO_AUDITABLE_VERSION) --root $(CARGO_ROOT)
	rm -f $(CARGO_ROOT)/.cargo-auditable-* && touch $@
$(RUST_AUDIT_INFO_STAMP):
	$(call step,installing rust-audit-info $(RUST_AUDIT_INFO_VERSION) into $(CARGO_ROOT))
	$(NICE_BESIDE_TESTS) cargo install --locked rust-audit-info@$(RUST_AUDIT_INFO_VERSION) --root $(CARGO_ROOT)
	rm -f $(CARGO_ROOT)/.rust-audit-info-* && touch $@

# Debian packages installed by name with apt-get when one is missing, a no-op
# once they are there: $(1) the packages, then each printed with its version.
# apt-get refuses to run while another holds its lock, and make runs the
# node's and make dist's installs side by side on a fresh machine: each takes
# APT_LOCK first, so the second waits for the first (and finds less to do).
APT_LOCK := /var/lock/flux-plunger-apt.lock
define debian_packages
	@missing=$$(for p in $(1); do \
	  dpkg-query -W -f='$${Status}' "$$p" 2>/dev/null | grep -q 'install ok installed' || echo "$$p"; done); \
	missing=$$(echo $$missing); \
	if [ -n "$$missing" ]; then \
	  printf '\n\033[1m>> %s\033[0m\n' "installing Debian packages: $$missing (apt-get; about a minute)"; \
	  command -v apt-get >/dev/null || { echo "apt-get is missing: install $$missing by hand" >&2; exit 1; }; \
	  flock --timeout 900 $(APT_LOCK) sh -c 'apt-get update -q && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends -o DPkg::Lock::Timeout=300 "$$@"' \
	    apt-get $$missing; \
	fi
	@dpkg-query -W -f='   $${Package} $${Version}\n' $(1)
endef

# A Rust standard library of target $(1), added by rustup when missing.
# Two rustup installs side by side (make runs the image's and make dist's
# targets so on a fresh machine) each rewrite the toolchain's record of its
# components, and one of them is lost: its files stay, and every later
# `rustup target add` of it fails on them. RUSTUP_LOCK keeps them one at a
# time, and the check runs again once it is held.
RUSTUP_LOCK := $${RUSTUP_HOME:-$$HOME/.rustup}/flux-plunger-target.lock
define rust_target
	@rustup target list --installed | grep -qx '$(1)' || \
	  flock --timeout 900 "$(RUSTUP_LOCK)" sh -c ' \
	    rustup target list --installed | grep -qx "$(1)" && exit 0; \
	    printf "\n\033[1m>> %s\033[0m\n" "rustup target add $(1)"; \
	    rustup target add $(1)'
endef

# The node's Debian packages (NODE_DEBIAN_PACKAGES in versions.mk).
.PHONY: node-packages
node-packages: ## Install the Debian packages of the node tier and of `make image` (apt-get; needs root).
	$(call debian_packages,$(NODE_DEBIAN_PACKAGES))

# The Rust standard library for the image's static target.
.PHONY: rust-image-target
rust-image-target:
	$(call rust_target,$(IMAGE_RUST_TARGET))

# make dist's Debian packages (DIST_DEBIAN_PACKAGES in versions.mk).
.PHONY: dist-packages
dist-packages: ## Install the Debian packages of `make dist` (apt-get; needs root).
	$(call debian_packages,$(DIST_DEBIAN_PACKAGES))

# The Rust standard library for the arm64 image's static target.
.PHONY: rust-dist-target
rust-dist-target:
	$(call rust_target,$(DIST_ARM64_RUST_TARGET))

##@ Build

.PHONY: build
build: ## Build the three binaries (debug).
	cargo build --workspace --locked --bins

.PHONY: release
release: ## Build the three binaries (release, stripped).
	cargo build --locked --release -p flux-plunger -p flux-plunger-drain -p flux-plunger-sweep

# The image the chart runs by default: repository and tag as in chart/.
IMAGE ?= ghcr.io/flux-plunger/flux-plunger
IMAGE_TAG ?= $(shell sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$$/\1/p' chart/Chart.yaml)
IMAGE_DIR := $(OUT)/image

.PHONY: image
image: node-packages rust-image-target $(CARGO_AUDITABLE_STAMP) ## Build the image offline (static musl binaries FROM scratch, built with cargo auditable; Docker if an engine runs, else buildah) and the node's pause image into _out/image/.
	$(call step,image $(IMAGE):$(IMAGE_TAG) from the Dockerfile (offline))
	IMAGE_RUST_TARGET=$(IMAGE_RUST_TARGET) CARGO_AUDITABLE=$(CARGO_AUDITABLE) $(NICE_BESIDE_TESTS) hack/build-image.sh $(IMAGE):$(IMAGE_TAG) $(IMAGE_DIR)

# make dist (hack/dist.sh, docs/releasing.md): where a release is published
# and with which key. A release names ghcr.io/flux-plunger and the
# maintainers' key; make test-dist the test world's registry, its CA and a
# throwaway key pair. Set on the command line or in the environment.
DIST_REGISTRY ?=
DIST_COSIGN_KEY ?=
DIST_COSIGN_PUB ?=
DIST_CA_FILE ?=
DIST_DOCKER_CONFIG ?=
DIST_DIR ?= $(OUT)/dist
export DIST_REGISTRY DIST_COSIGN_KEY DIST_COSIGN_PUB DIST_CA_FILE DIST_DOCKER_CONFIG DIST_DIR
# What building the binaries of both platforms needs, and what make dist
# needs besides.
DIST_BUILD_PREREQUISITES := $(CARGO_AUDITABLE_STAMP) dist-packages rust-image-target rust-dist-target
DIST_PREREQUISITES := $(DIST_BUILD_PREREQUISITES) $(BIN)/cosign $(BIN)/helm $(RUST_AUDIT_INFO_STAMP)

# make dist's binaries for both platforms, built and checked ahead of it
# (hack/dist.sh --binaries): make test builds them beside its tiers, at
# NICE_BESIDE_TESTS, for make test-dist, whose make dist then finds them built.
.PHONY: dist-binaries
dist-binaries: image $(DIST_BUILD_PREREQUISITES)
	$(call step,make dist's binaries for linux/amd64 and linux/arm64 (hack/dist.sh --binaries; cold: the arm64 build about 7 minutes on 2 cores))
	CARGO_AUDITABLE=$(CARGO_AUDITABLE) CARGO_AUDITABLE_VERSION=$(CARGO_AUDITABLE_VERSION) \
	  RUST_AUDIT_INFO_VERSION=$(RUST_AUDIT_INFO_VERSION) $(NICE_BESIDE_TESTS) hack/dist.sh --binaries

.PHONY: dist
dist: $(DIST_PREREQUISITES) ## Build a release offline (the image for linux/amd64 and linux/arm64 as one OCI index, its SBOM, the chart), push it to DIST_REGISTRY, sign it with DIST_COSIGN_KEY and verify it (docs/releasing.md).
	$(call step,make dist: a release to $(DIST_REGISTRY) (hack/dist.sh; cold: the arm64 build about 15 minutes on 2 busy cores))
	COSIGN=$(BIN)/cosign HELM=$(BIN)/helm CARGO_AUDITABLE=$(CARGO_AUDITABLE) RUST_AUDIT_INFO=$(RUST_AUDIT_INFO) \
	  CARGO_AUDITABLE_VERSION=$(CARGO_AUDITABLE_VERSION) RUST_AUDIT_INFO_VERSION=$(RUST_AUDIT_INFO_VERSION) \
	  hack/dist.sh

##@ Test

# The tiers of make test, in the order they run.
TEST_TIERS := lint test-unit test-envtest test-chart test-bats e2e-build $(E2E_TIERS) test-node test-dist
# make test runs its tiers one after another and, beside them, the builds of
# what later tiers need: the tools in their lanes, and `make image`, `make
# first-release` then `make dist-binaries` (for the node and dist tiers, at
# NICE_BESIDE_TESTS). The lanes bound
# the builds; TEST_JOBS only has to be more than everything that may run at
# once, so that no tier waits for a job.
TEST_JOBS ?= 16

.PHONY: test
test: ## Run every test tier CI runs, make test-dist the last (docs/testing.md).
	@started=$$SECONDS; \
	  $(MAKE) --no-print-directory -j$(TEST_JOBS) TEST_TIERS_IN_ORDER=1 test-log-reset $(TEST_TIERS); \
	  echo ">> every test tier passed ($$(( (SECONDS - started) / 60 )) min $$(( (SECONDS - started) % 60 )) s)"
	@hack/test-summary.sh $(TEST_LOG)

# Under make test, each tier waits for the one before it: they share the
# cores, and the leftovers check judges one tier at a time. A tier's own
# prerequisites (its tools, the images) are not in that order: they build in
# their lanes as soon as they can.
ifdef TEST_TIERS_IN_ORDER
$(call chain,test-log-reset $(TEST_TIERS))
$(call chain,image first-release dist-binaries)
endif

.PHONY: test-log-reset
test-log-reset:
	@rm -rf $(TEST_LOG) && mkdir -p $(TEST_LOG)

.PHONY: test-unit
test-unit: ## Unit tests: pure, no control plane.
	$(call step,unit tests)
	@mkdir -p $(TEST_LOG)
	$(CARGO_TEST) --lib --bins 2>&1 | tee $(TEST_LOG)/unit.log || { hack/failure-digest.sh $(TEST_LOG)/unit.log; exit 1; }

.PHONY: test-envtest
test-envtest: $(ENVTEST_TOOLS) ## Integration tests against the local control plane.
	@hack/check-no-leftovers.sh --mark
	$(call step,integration tests against the local control plane)
	@# Tests run the binaries of other packages (testkit::workspace_binary):
	@# `cargo test` builds a package's binaries only for its own tests.
	cargo build --workspace --locked --bins
	@mkdir -p $(TEST_LOG)
	$(CARGO_TEST) --test '*' --exclude chart-contract --exclude e2e --exclude real-node --exclude dist 2>&1 | tee $(TEST_LOG)/envtest.log \
	  || { hack/failure-digest.sh $(TEST_LOG)/envtest.log; exit 1; }
	@hack/check-no-leftovers.sh

# The chart's suites live in chart-tests/, beside the chart rather than inside
# it (so they are never packaged); helm-unittest resolves -f relative to the chart.
CHART := chart
CHART_TESTS := chart-tests
CHART_LINT_VALUES = $(wildcard $(CHART_TESTS)/values/*.yaml)

# helm-docs renders chart/README.md from chart/README.md.gotmpl, its values
# table from the `# --` comments of values.yaml, in the file's order. It logs a
# failure and still exits 0, so any line it logs at warn or above fails here.
HELM_DOCS = $(BIN)/helm-docs --chart-search-root $(CHART) --template-files README.md.gotmpl \
	--output-file README.md --sort-values-order file --log-level warn
run_helm_docs = log=$$($(HELM_DOCS) $(1) 2>&1 >$(2)) && test -z "$$log" || { echo "$$log" >&2; exit 1; }

.PHONY: chart-docs
chart-docs: $(BIN)/helm-docs $(CHART)/README.md.gotmpl ## Write chart/README.md with helm-docs (from chart/README.md.gotmpl and the `# --` comments of values.yaml).
	$(call step,chart: $(CHART)/README.md from $(CHART)/README.md.gotmpl and $(CHART)/values.yaml (helm-docs))
	@$(call run_helm_docs,,/dev/null)

.PHONY: chart-docs-check
chart-docs-check: $(BIN)/helm-docs $(CHART)/README.md.gotmpl ## Fail when chart/README.md is not what `make chart-docs` writes (part of test-chart).
	$(call step,chart: $(CHART)/README.md is what helm-docs writes (make chart-docs))
	@generated=$$(mktemp) && trap 'rm -f "$$generated"' EXIT && \
	  $(call run_helm_docs,--dry-run,"$$generated") && \
	  diff -u --label '$(CHART)/README.md (committed)' --label 'helm-docs' $(CHART)/README.md "$$generated" \
	  || { echo "$(CHART)/README.md is not what helm-docs writes: edit $(CHART)/README.md.gotmpl or $(CHART)/values.yaml, then run make chart-docs" >&2; exit 1; }

.PHONY: test-chart
test-chart: $(TIER_TOOLS) build chart-docs-check ## The chart: README.md as helm-docs writes it, helm lint --strict, helm-unittest (chart-tests/), contract and install tests (testing/chart-contract).
	@hack/check-no-leftovers.sh --mark
	$(call step,chart: helm lint --strict with the default values)
	@# helm lint takes no --api-versions: it renders in lint mode, where the
	@# chart's `fail` on a cluster without ValidatingAdmissionPolicy is only
	@# logged and the guard's templates are rendered and linted all the same.
	helm lint --strict $(CHART)
	$(call step,chart: helm lint --strict with each value set in $(CHART_TESTS)/values/)
	for values in $(CHART_LINT_VALUES); do \
	  echo "-- $$values"; helm lint --strict -f "$$values" $(CHART); \
	done
	$(call step,chart: helm-unittest suites in $(CHART_TESTS)/)
	@# helm unittest passes when its glob matches nothing: make sure it does not.
	@ls $(CHART_TESTS)/*_test.yaml $(CHART_TESTS)/without-schema/*_test.yaml >/dev/null
	@mkdir -p $(TEST_LOG)
	helm unittest --strict -f '../$(CHART_TESTS)/*_test.yaml' $(CHART) 2>&1 | tee $(TEST_LOG)/chart-unittest.log
	$(call step,chart: helm-unittest suites in $(CHART_TESTS)/without-schema/ with --skip-schema-validation)
	helm unittest --strict --skip-schema-validation -f '../$(CHART_TESTS)/without-schema/*_test.yaml' $(CHART) 2>&1 | tee $(TEST_LOG)/chart-unittest-noschema.log
	$(call step,chart: contract tests (testing/chart-contract): the binaries' flags and timings against helm template; helm install and uninstall (its hook run for real) in the local control plane)
	cargo test --locked -p chart-contract --tests 2>&1 | tee $(TEST_LOG)/chart-contract.log
	@hack/check-no-leftovers.sh

# The e2e tests mostly wait on helm-controller, so they run many at a time.
E2E_THREADS ?= 8

# One e2e tier per pinned helm-controller (E2E_TIERS), one after another:
# each starts once its own helm-controller is built, so the first runs while
# the last still builds beside it.
$(call chain,e2e-build $(E2E_TIERS))

.PHONY: e2e e2e-build $(E2E_TIERS)
e2e: $(E2E_TIERS) ## End-to-end tests against Flux's real helm-controller, once per version in HELM_CONTROLLER_E2E_VERSIONS (make e2e-VERSION: one).

e2e-build:
	$(call step,building flux-plunger and the e2e tests)
	@# A workspace build: testkit turns plunger's test-hooks feature on, which
	@# the e2e races need (pause points); `-p flux-plunger` alone would not.
	cargo build --locked --workspace --bins
	cargo test --locked -p e2e --no-run

$(E2E_TIERS): e2e-%: e2e-build $(ENVTEST_TOOLS) $(SOURCE_CONTROLLER) $(BIN)/helm-controller-%
	@hack/check-no-leftovers.sh --mark
	$(call step,e2e against the real helm-controller $*)
	@mkdir -p $(TEST_LOG)
	@started=$$SECONDS; \
	  FLUX_PLUNGER_HELM_CONTROLLER_VERSION=$* cargo test --locked -p e2e --tests -- --test-threads=$(E2E_THREADS) 2>&1 \
	    | tee $(TEST_LOG)/e2e-$*.log || { hack/failure-digest.sh $(TEST_LOG)/e2e-$*.log; exit 1; }; \
	  echo ">> helm-controller $*: e2e passed in $$(( SECONDS - started ))s"
	@hack/check-no-leftovers.sh

# The node tier's tests in one binary share one node; each installs a
# cluster-wide flux-plunger, so they take turns whatever the thread count.
NODE_THREADS ?= 4
# Each node test binary runs in a sandbox (a node, a control plane) of its own:
# the Flux test's real helm-controller must not meet the others' releases.
NODE_TEST_BINARIES := on_node as_flux_helmrelease

# The first release, rebuilt from its commit (FIRST_RELEASE_COMMIT in
# versions.mk) for the node tier's upgrade from it: its chart and its image in
# _out/first-release/ (cold: about 5 minutes of cargo build; then a no-op).
FIRST_RELEASE_DIR := $(OUT)/first-release

.PHONY: first-release
first-release: node-packages rust-image-target $(BIN)/helm ## Rebuild the first release's chart and image (FIRST_RELEASE_COMMIT) into _out/first-release/, for the node tier's upgrade test.
	$(call step,the first release ($(FIRST_RELEASE_COMMIT)): its chart and image into $(FIRST_RELEASE_DIR))
	IMAGE_RUST_TARGET=$(IMAGE_RUST_TARGET) $(NICE_BESIDE_TESTS) hack/build-first-release.sh $(FIRST_RELEASE_COMMIT) $(FIRST_RELEASE_DIR)

.PHONY: test-node
test-node: $(TOOLS) node-packages image first-release ## The chart on a real node (kubelet, containerd, controller-manager, scheduler) in hack/node-sandbox.sh: its pods, sidecar and hook Job run for real; helm and the real helm-controller install it.
	@hack/check-no-leftovers.sh --mark
	$(call step,building the node tier's tests)
	cargo test --locked -p real-node --no-run
	$(call step,node tier: the chart on a real node in hack/node-sandbox.sh (about 5 minutes warm))
	@mkdir -p $(TEST_LOG)
	@rm -f $(TEST_LOG)/node.log
	@# --offline: the sandbox has no network, and everything is built already.
	@for binary in $(NODE_TEST_BINARIES); do \
	  echo ">> node tier: $$binary (a sandbox of its own)"; \
	  hack/node-sandbox.sh cargo test --locked --offline -p real-node --test $$binary -- \
	    --test-threads=$(NODE_THREADS) 2>&1 | tee -a $(TEST_LOG)/node.log || { hack/failure-digest.sh $(TEST_LOG)/node.log; exit 1; }; \
	done
	@hack/check-no-leftovers.sh

# make dist run for real, as a release runs it, into the test world's registry
# (testing/dist/tests/dist.rs), then checked as a user checks a release: the
# last tier of make test. Its slow parts, cosign's build and the arm64 release
# build (cold: about 9 and 7 minutes on 2 cores), run beside the tiers before
# it (cosign in a Flux lane, make dist-binaries after make first-release),
# so make dist finds them built and takes about two minutes.
.PHONY: test-dist
test-dist: $(ENVTEST_TOOLS) $(SOURCE_CONTROLLER) $(DIST_PREREQUISITES) dist-binaries ## make dist into the test world's registry with a throwaway key pair, then cosign verify (and with another key, refused), verify-attestation of the SBOM, both platforms of the index, the binaries' crate graphs, the chart pulled back, and the chart verified by the real source-controller's OCIRepository spec.verify (testing/dist).
	@hack/check-no-leftovers.sh --mark
	$(call step,building the dist test)
	cargo test --locked -p dist --no-run
	$(call step,dist: make dist into the test world's registry; what it pushed verified as a user verifies a release)
	@mkdir -p $(TEST_LOG)
	cargo test --locked -p dist --tests 2>&1 | tee $(TEST_LOG)/dist.log || { hack/failure-digest.sh $(TEST_LOG)/dist.log; exit 1; }
	@hack/check-no-leftovers.sh

# Seeds of the randomized interleavings (crates/plunger/tests/interleavings.rs)
# a soak runs; SOAK_SEED_BASE picks where they start (default: a new base each
# run, printed, so every soak explores new seeds and any one replays).
SOAK_SEEDS ?= 500
SOAK_SEED_BASE ?=
SOAK_PARALLEL ?= 4

.PHONY: soak
soak: tools ## Many more seeds of the randomized interleavings than CI runs (SOAK_SEEDS, default 500; a few seconds each, SOAK_PARALLEL at a time); not part of make test.
	@hack/check-no-leftovers.sh --mark
	$(call step,soak: $(SOAK_SEEDS) seeded recoveries raced by deletes, foreign suspensions and the fault proxy)
	cargo build --workspace --locked --bins
	FLUX_PLUNGER_SEED_COUNT=$(SOAK_SEEDS) FLUX_PLUNGER_SEED_BASE=$(SOAK_SEED_BASE) \
	  FLUX_PLUNGER_INTERLEAVINGS_PARALLEL=$(SOAK_PARALLEL) \
	  cargo test --locked -p plunger --test interleavings recoveries_raced -- --nocapture
	@hack/check-no-leftovers.sh

CARGO_MUTANTS_VERSION := 27.1.0
CARGO_MUTANTS := $(OUT)/cargo/bin/cargo-mutants

$(CARGO_MUTANTS):
	$(call step,installing cargo-mutants $(CARGO_MUTANTS_VERSION) into $(OUT)/cargo)
	cargo install --locked cargo-mutants@$(CARGO_MUTANTS_VERSION) --root $(OUT)/cargo

.PHONY: mutants
mutants: $(CARGO_MUTANTS) ## Mutation testing of the decision code (.cargo/mutants.toml); not part of make test.
	$(call step,cargo mutants over crates/plunger's decision code)
	$(CARGO_MUTANTS) mutants --package plunger --test-package plunger --output $(OUT)

.PHONY: test-bats
test-bats: $(TIER_TOOLS) build $(BATS_STAMP) ## bats suites (bats/): flux-plunger-sweep as a process against the local control plane; hack/check-no-leftovers.sh.
	@hack/check-no-leftovers.sh --mark
	$(call step,bats: flux-plunger-sweep as a process against the local control plane; the leftovers check (bats/; about two minutes))
	@mkdir -p $(TEST_LOG)
	$(BATS) --tap --timing bats/ 2>&1 | tee $(TEST_LOG)/bats.log
	@hack/check-no-leftovers.sh

.PHONY: lint
lint: ## cargo fmt --check, clippy with warnings denied, and no test hooks in release builds.
	$(call step,lint)
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets --locked -- -D warnings
	@hack/check-release-features.sh

##@ Run

.PHONY: demo
demo: tools node-packages image ## Show flux-plunger at work as a user runs it: installed on a real node as the README says (the chart from an OCI registry through the real source-controller, the real helm-controller), its pod recovering a release left stuck, the fence holding a delete until the uninstall, the uninstall's hook Job (two minutes warm; Ctrl-C stops it).
	@hack/check-no-leftovers.sh --mark
	$(call step,building the demo)
	cargo build --locked -p e2e --bin demo
	$(call step,running the demo in the node sandbox (hack/node-sandbox.sh))
	hack/node-sandbox.sh cargo run --locked --offline -q -p e2e --bin demo
	@hack/check-no-leftovers.sh

.PHONY: bench
bench: tools ## Figures (not tests), release builds on the local control plane: sizes, memory, start-up, a burst of recoveries, apiserver requests, drain, handover, sweep; writes _out/bench/bench.json.
	$(call step,building release binaries)
	cargo build --locked --release -p flux-plunger -p flux-plunger-drain -p flux-plunger-sweep
	$(call step,running the benchmark (about ten minutes on 2 cores))
	cargo run --locked --release -q -p bench

.PHONY: clean
clean: ## Remove build output and tools.
	cargo clean
	rm -rf $(OUT)
