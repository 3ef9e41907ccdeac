"""Traces: OpenTelemetry spans of one request across the processes that serve it (the router, the
embedder, every shard replica), exported over OTLP/HTTP to a trace store (Jaeger, or any
OpenTelemetry collector), with W3C trace context in and out.

What it costs, and when:
- No endpoint configured: nothing. `Tracer.begin` returns None at once and no span object exists.
- An endpoint: the sampling decision is taken at the door, before any OpenTelemetry call: a request
  whose `traceparent` says sampled is always traced (the calling service asked for it), one that
  says not sampled never is, and one without is traced with probability `ratio`. An unsampled
  request then costs one header check and one random draw; its spans are never created.
- A sampled request's spans are queued for a background thread that exports them in batches. The
  queue is bounded (a trace store that is down or slow drops spans, never requests) and each
  export gives up after `EXPORT_TIMEOUT_S`.

Spans are recorded with explicit start and end times where the time was measured anyway (the
batch wait, a shard's queue wait and its FAISS time arrive as numbers), so tracing adds no clock
read of its own to the hot path.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, TraceFlags

from shardserve import settings
from shardserve.errors import BadArgument

# W3C Trace Context, version 00: 55 characters, lower-case hex, neither id all zeros.
TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
MAX_QUEUED_SPANS = 4096  # per process; past it spans are dropped
# Traced requests a process starts per second at most, whatever the callers' traceparents say: a
# client that marks every request sampled cannot make every request pay for its spans.
MAX_TRACED_PER_S = 100.0
EXPORT_BATCH = 512
EXPORT_EVERY_S = 1.0
EXPORT_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class TraceConfig:
    """Where a process sends its spans (`endpoint`: an OTLP/HTTP traces URL, None: tracing off), the
    share of requests without a `traceparent` it traces (`ratio`), and the service name spans carry."""

    endpoint: str | None = None
    ratio: float = 0.0
    service: str = "shardserve"
    max_per_s: float = MAX_TRACED_PER_S

    @classmethod
    def resolve(cls, endpoint: str | None, ratio: float | None, service: str) -> TraceConfig:
        """The configuration of a process on this node: what its app's arguments say, else this
        node's SHARDSERVE_TRACE_ENDPOINT and SHARDSERVE_TRACE_RATIO (shardserve.settings)."""
        return cls(endpoint or settings.trace_endpoint(),
                   settings.trace_ratio() if ratio is None else ratio, service)

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise BadArgument(f"a trace ratio is in [0, 1], got {self.ratio}")
        if self.endpoint is not None and not re.fullmatch(r"https?://[^\s/]+(/\S*)?", self.endpoint):
            raise BadArgument(f"a trace endpoint is an http(s) URL, got {self.endpoint!r}")


def parse_traceparent(value: str) -> SpanContext | None:
    """The remote parent a `traceparent` header names; None for anything not a valid version-00
    header (the W3C rule: an invalid header is ignored, and the request starts a trace of its own)."""
    match = TRACEPARENT.fullmatch(value) if len(value) == 55 else None
    if match is None:
        return None
    trace_id, span_id = int(match[1], 16), int(match[2], 16)
    if trace_id == 0 or span_id == 0:
        return None
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(int(match[3], 16)))


def traceparent(span: Span | SpanContext) -> str:
    """The `traceparent` header that makes `span` the parent of what the receiver records."""
    context = span if isinstance(span, SpanContext) else span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def trace_id(span: Span) -> str:
    return f"{span.get_span_context().trace_id:032x}"


def _ns(seconds: float) -> int:
    """A `time.time()` reading in the nanoseconds OpenTelemetry takes."""
    return int(seconds * 1e9)


class Tracer:
    """One process's tracer. Arguments:
    config: the endpoint, the ratio and the service name.
    attributes: resource attributes every span of this process carries (its replica, its shard).
    exporter: the span exporter (default: OTLP over HTTP to `config.endpoint`).
    """

    def __init__(self, config: TraceConfig, attributes: Mapping[str, Any] | None = None,
                 exporter: SpanExporter | None = None):
        self.config = config
        self.on = config.endpoint is not None or exporter is not None
        self._budget, self._refilled = config.max_per_s, time.monotonic()  # a token bucket of 1 s
        self._provider: TracerProvider | None = None
        self._tracer: trace.Tracer | None = None
        if not self.on:
            return
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=config.endpoint, timeout=EXPORT_TIMEOUT_S)
        resource = Resource.create({"service.name": config.service, **(attributes or {})})
        # sampled at the door (begin): a span this tracer is asked for is always recorded
        self._provider = TracerProvider(resource=resource, sampler=ALWAYS_ON)
        self._provider.add_span_processor(self._processor(exporter))
        self._tracer = self._provider.get_tracer("shardserve")

    @staticmethod
    def _processor(exporter: SpanExporter) -> SpanProcessor:
        return BatchSpanProcessor(exporter, max_queue_size=MAX_QUEUED_SPANS,
                                  schedule_delay_millis=EXPORT_EVERY_S * 1000,
                                  max_export_batch_size=EXPORT_BATCH,
                                  export_timeout_millis=EXPORT_TIMEOUT_S * 1000)

    def begin(self, name: str, header: str = "", start: float | None = None,
              kind: SpanKind = SpanKind.SERVER, attributes: Mapping[str, Any] | None = None) -> Span | None:
        """The span of a request arriving with `header` (its `traceparent`, or ""), or None when the
        request is not traced (tracing off, the caller said not sampled, or the draw said no)."""
        if self._tracer is None:
            return None
        parent = parse_traceparent(header) if header else None
        if parent is not None:
            if not parent.trace_flags.sampled:
                return None
        elif self.config.ratio <= 0.0 or random.random() >= self.config.ratio:
            return None
        if not self._take():
            return None
        context = trace.set_span_in_context(NonRecordingSpan(parent)) if parent is not None else None
        return self._tracer.start_span(name, context, kind, attributes,  # type: ignore[return-value]
                                       start_time=None if start is None else _ns(start))

    def allow(self) -> bool:
        """Whether a span of work not begun at a door (a replica's apply of a traced write) may be
        recorded now: tracing on and the per-second budget not spent."""
        return self._tracer is not None and self._take()

    def _take(self) -> bool:
        """One traced request from the bucket (refilled at `max_per_s`, holding at most a second's)."""
        clock = time.monotonic()
        rate = self.config.max_per_s
        self._budget = min(rate, self._budget + (clock - self._refilled) * rate)
        self._refilled = clock
        if self._budget < 1.0:
            return False
        self._budget -= 1.0
        return True

    def child(self, parent: Span | SpanContext, name: str, start: float | None = None,
              end: float | None = None, attributes: Mapping[str, Any] | None = None,
              links: Sequence[Span] = (), kind: SpanKind = SpanKind.INTERNAL) -> Span:
        """A span under `parent` (a span of this process, or a remote parent's context), from
        `start` (`time.time()` seconds; now if None), ended at `end` when given (a span recorded
        after the fact), else left open for the caller to end. `links`: other requests' spans a
        shared piece of work (one batch) also belongs to."""
        assert self._tracer is not None
        parent_span = parent if isinstance(parent, Span) else NonRecordingSpan(parent)
        span: Span = self._tracer.start_span(  # type: ignore[assignment]
            name, trace.set_span_in_context(parent_span), kind, attributes,
            [Link(other.get_span_context()) for other in links],
            start_time=None if start is None else _ns(start))
        if end is not None:
            span.end(_ns(end))
        return span

    def children(self, parent: Span, parts: Iterable[tuple[str, float, float]]) -> None:
        """Spans measured elsewhere, recorded after the fact: (name, start, end) each."""
        for name, start, end in parts:
            self.child(parent, name, start, end)

    def flush(self, timeout_s: float = 5.0) -> bool:
        return self._provider is None or self._provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()


@dataclass
class Traced:
    """A sampled request on its way through a process: the tracer, the request's span, and when it
    joined a batch's queue (`time.time()`; 0 before)."""

    tracer: Tracer
    span: Span
    queued: float = 0.0


def end(span: Span | None, at: float | None = None, **attributes: Any) -> None:
    """End `span` (if any), with `attributes` set first."""
    if span is not None:
        if attributes:
            span.set_attributes(attributes)
        span.end(None if at is None else _ns(at))


def now() -> float:
    """The wall clock spans are stamped with (OpenTelemetry wants epoch time)."""
    return time.time()
