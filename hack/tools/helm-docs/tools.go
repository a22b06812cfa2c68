//go:build tools

// Package tools records the command this module builds.
package tools

import (
	_ "github.com/norwoodj/helm-docs/cmd/helm-docs"
)
