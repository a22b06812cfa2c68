//go:build tools

// Package tools records the command this module builds.
package tools

import (
	_ "github.com/sigstore/cosign/v3/cmd/cosign"
)
