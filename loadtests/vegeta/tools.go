//go:build tools

// Package tools pins the vegeta load generator; `make vegeta` builds it from this module's go.sum.
package tools

import _ "github.com/tsenart/vegeta/v12"
