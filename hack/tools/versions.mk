# Versions of the tools that are not built from a go.mod of their own.
# Flux's helm-controller: its CRDs, and (for e2e) its binary, built from a copy
# of the downloaded module because its go.mod replaces ./api.
HELM_CONTROLLER_VERSION := v1.6.4
# bats-core, from npm (package "bats"), for the bats suites in bats/.
BATS_VERSION := 1.13.0
