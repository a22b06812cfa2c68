// The tests' OCI registry: a small main around go-containerregistry's
// pkg/registry, served with TLS (main.go).
module github.com/flux-plunger/hack/tools/registry

go 1.26.0

require github.com/google/go-containerregistry v0.22.1
