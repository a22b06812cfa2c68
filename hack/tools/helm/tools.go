//go:build tools

// Package tools records the commands this module builds.
package tools

import (
	_ "github.com/helm-unittest/helm-unittest/cmd/helm-unittest"
	_ "helm.sh/helm/v3/cmd/helm"
)
