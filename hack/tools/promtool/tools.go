//go:build tools

// Package tools records the command this module builds.
package tools

import (
	_ "github.com/prometheus/prometheus/cmd/promtool"
)
