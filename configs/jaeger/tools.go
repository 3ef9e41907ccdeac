//go:build tools

// Package tools pins Jaeger (all-in-one: OTLP receiver, in-memory store, query API and UI), the trace
// store `make jaeger` builds from this module's go.sum and the traced tests read spans back from.
package tools

import _ "github.com/jaegertracing/jaeger/cmd/jaeger"
