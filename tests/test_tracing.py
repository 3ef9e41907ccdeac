"""shardserve.tracing without a trace store: W3C trace context in and out, the sampling decision taken
at the door, spans recorded after the fact, the batch's fan-out in the first traced request's trace,
shard frames carrying the fan-out's context, and an export that never holds a request.
(The spans of a served request, read back from a real Jaeger: tests/test_traces_served.py.)"""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import numpy as np
import pytest
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shardserve.errors import BadArgument, WireError
from shardserve.query.api import ParsedQuery
from shardserve.query.fanout import search_batch
from shardserve.tracing import (
    MAX_QUEUED_SPANS,
    TraceConfig,
    Traced,
    Tracer,
    now,
    parse_traceparent,
    traceparent,
)
from shardserve.transport.shard_wire import QueryBounds, ShardQuery
from tests.shared import shards

SAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
UNSAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"


_made: list[Tracer] = []


@pytest.fixture(autouse=True)
def _shut_down_tracers():
    """Each tracer's export thread ends with its test: none lives on into another test of this
    process (one that counts the objects the garbage collector holds, say)."""
    yield
    while _made:
        _made.pop().shutdown()


def _tracer(ratio: float = 0.0, **config: float) -> tuple[Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracer = Tracer(TraceConfig(ratio=ratio, **config), {"shardserve.replica": "r1"}, exporter)
    _made.append(tracer)
    return tracer, exporter


def _finished(tracer: Tracer, exporter: InMemorySpanExporter) -> dict[str, object]:
    assert tracer.flush()
    return {span.name: span for span in exporter.get_finished_spans()}


@pytest.mark.parametrize("header", [
    "", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-1",  # a cut flag
    "00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01",  # upper case
    "00-00000000000000000000000000000000-b7ad6b7169203331-01",  # an all-zero trace id
    "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",  # an all-zero parent id
    "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # version ff is invalid
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
    "00_0af7651916cd43dd8448eb211c80319c_b7ad6b7169203331_01",
])
def test_an_invalid_traceparent_is_ignored(header: str) -> None:
    assert parse_traceparent(header) is None


def test_a_valid_traceparent_round_trips() -> None:
    context = parse_traceparent(SAMPLED)
    assert context is not None and context.is_remote and context.trace_flags.sampled
    assert traceparent(context) == SAMPLED


def test_without_an_endpoint_nothing_is_traced_or_created() -> None:
    tracer = Tracer(TraceConfig(ratio=1.0))
    assert not tracer.on and tracer.begin("search", SAMPLED) is None
    assert tracer.flush()


def test_the_callers_decision_wins_and_the_ratio_decides_for_the_rest() -> None:
    tracer, exporter = _tracer(ratio=0.0)
    assert tracer.begin("search") is None  # no header, ratio 0
    assert tracer.begin("search", UNSAMPLED) is None  # the caller said not sampled
    span = tracer.begin("search", SAMPLED)  # the caller said sampled: always
    assert span is not None
    span.end()
    (finished,) = exporter.get_finished_spans() if tracer.flush() else ()
    assert f"{finished.context.trace_id:032x}" == SAMPLED.split("-")[1]  # the caller's trace, continued
    assert finished.parent is not None and f"{finished.parent.span_id:016x}" == SAMPLED.split("-")[2]
    assert finished.resource.attributes["shardserve.replica"] == "r1"
    everyone, _ = _tracer(ratio=1.0)
    root = everyone.begin("search")
    assert root is not None and root.parent is None  # a trace of its own
    some, _ = _tracer(ratio=0.5)  # 400 draws, within the budget of a second
    drawn = [some.begin("search") is not None for _ in range(400)]
    assert 0 < sum(drawn) < 400


@pytest.mark.parametrize("ratio", [-0.1, 1.5])
def test_a_ratio_outside_0_1_is_refused(ratio: float) -> None:
    with pytest.raises(BadArgument, match="ratio"):
        TraceConfig(ratio=ratio)


def test_an_endpoint_must_be_an_http_url() -> None:
    with pytest.raises(BadArgument, match="endpoint"):
        TraceConfig(endpoint="127.0.0.1:4318")
    assert TraceConfig(endpoint="http://127.0.0.1:4318/v1/traces").endpoint


def test_spans_recorded_after_the_fact_keep_their_times_and_parents() -> None:
    tracer, exporter = _tracer()
    root = tracer.begin("search", SAMPLED)
    assert root is not None
    start = now()
    tracer.child(root, "batch wait", start, start + 0.25)
    remote = parse_traceparent(traceparent(root))
    assert remote is not None
    tracer.child(remote, "shard 0", start + 0.25, start + 0.5)  # as a shard records it
    root.end()
    spans = _finished(tracer, exporter)
    wait, shard = spans["batch wait"], spans["shard 0"]
    assert wait.parent.span_id == root.get_span_context().span_id  # type: ignore[attr-defined]
    assert shard.parent.span_id == root.get_span_context().span_id  # type: ignore[attr-defined]
    assert wait.end_time - wait.start_time == pytest.approx(0.25e9, abs=1e3)  # type: ignore[attr-defined]


def test_shard_frames_carry_the_fan_outs_context_checked() -> None:
    bounds = QueryBounds(dim=4, nlist=0, max_rows=8, max_k=10, params=frozenset({"efSearch"}))
    query = ShardQuery(np.ones((2, 4), np.float32), 5, {"efSearch": 16}, trace=SAMPLED)
    decoded = ShardQuery.decode(query.encode(), bounds)
    assert decoded.trace == SAMPLED and decoded.params == {"efSearch": 16}
    assert ShardQuery.decode(ShardQuery(np.ones((2, 4), np.float32), 5, {}).encode(), bounds).trace == ""
    forged = ShardQuery(np.ones((2, 4), np.float32), 5, {}, trace="00-zz")
    with pytest.raises(WireError, match="traceparent"):
        ShardQuery.decode(forged.encode(), bounds)


def test_a_traced_batch_fans_out_in_the_first_traced_requests_trace() -> None:
    """Two traced requests and one not, in one batch sharing one scan: one fan-out span, in the
    first's trace and linked to the second's; every shard call carries its context; the merge follows."""
    tracer, exporter = _tracer()
    data, searchers = shards()
    seen: list[str] = []

    async def call(shard: int, query: ShardQuery):
        seen.append(query.trace)
        return searchers[shard].answer(query)

    first, second = tracer.begin("search", SAMPLED), tracer.begin("search", SAMPLED.replace("b7ad", "c7ad"))
    assert first is not None and second is not None
    plain = ParsedQuery(matrix=data.queries[:1], k=5, params=(), single=True, require_full=False)
    queries = [dataclasses.replace(plain, trace=Traced(tracer, first)), plain,
               dataclasses.replace(plain, matrix=data.queries[1:2], trace=Traced(tracer, second))]
    results = asyncio.run(search_batch(queries, call, 3, False, 5.0))
    assert [r.answered for r in results] == [3, 3, 3]
    first.end(), second.end()
    spans = exporter.get_finished_spans() if tracer.flush() else ()
    (fan,) = [s for s in spans if s.name == "fan-out"]
    (merge,) = [s for s in spans if s.name == "merge"]
    assert fan.parent.span_id == first.get_span_context().span_id  # type: ignore[union-attr]
    assert [link.context.span_id for link in fan.links] == [second.get_span_context().span_id]
    assert seen == [traceparent(fan.get_span_context())] * 3  # type: ignore[arg-type]
    assert fan.attributes["shards.answered"] == 3 and fan.attributes["requests.traced"] == 2
    assert merge.parent.span_id == first.get_span_context().span_id  # type: ignore[union-attr]
    assert fan.end_time <= merge.start_time  # type: ignore[operator]


def test_an_untraced_batch_sends_no_context() -> None:
    data, searchers = shards()
    seen: list[str] = []

    async def call(shard: int, query: ShardQuery):
        seen.append(query.trace)
        return searchers[shard].answer(query)

    asyncio.run(search_batch([ParsedQuery(matrix=data.queries[:1], k=5, params=(), single=True,
                                          require_full=False)], call, 3, False, 5.0))
    assert seen == ["", "", ""]


class _Stuck(SpanExporter):
    """A trace store that never answers: each export waits until the test lets it go."""

    def __init__(self) -> None:
        self.release, self.calls = threading.Event(), 0

    def export(self, spans):  # type: ignore[no-untyped-def]
        self.calls += 1
        self.release.wait()
        return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self.release.set()


def test_a_stuck_trace_store_never_holds_a_request() -> None:
    """Spans past the bounded queue are dropped while the export waits: ending them never waits
    for the store (were it to, this thread would block for good and the join below would fail)."""
    stuck = _Stuck()
    tracer = Tracer(TraceConfig(ratio=1.0, max_per_s=1e9), exporter=stuck)
    done = threading.Event()

    def requests() -> None:
        for _ in range(3 * MAX_QUEUED_SPANS):
            span = tracer.begin("search")
            assert span is not None
            span.end()
        done.set()

    worker = threading.Thread(target=requests, daemon=True)
    worker.start()
    worker.join(timeout=120)
    try:
        assert done.is_set(), "ending a span waited for the trace store"
        assert stuck.calls <= 1  # the first export is still waiting: everything else queued or dropped
    finally:
        stuck.release.set()
        tracer.shutdown()


def test_callers_cannot_make_every_request_pay_for_spans() -> None:
    """A flood of requests all marked sampled: past the per-process budget they go untraced (and are
    answered as any other), then the budget refills."""
    tracer, _ = _tracer(max_per_s=50.0)
    traced = [tracer.begin("search", SAMPLED) is not None for _ in range(500)]
    assert 50 <= sum(traced) < 500 and traced[:50] == [True] * 50 and not traced[-1]
    tracer._refilled -= 1.0  # a second later, as the clock would have it
    assert tracer.begin("search", SAMPLED) is not None
