"""Embedder deployment: one Serve deployment per index version built from text, each replica holding
the model that index was built with (checked by content: shardserve.embed.model.Embedder.check).

Routers call `embed` with the texts their cache does not hold. Whatever calls are queued when the
replica's one model run frees are one batch (shardserve.query.batcher.AdaptiveBatcher, the router's
own batcher): one text alone at low load, everything waiting under load, sorted by token length and
cut into runs that pad little inside `Embedder.embed_batch`. One run at a time, on one ONNX thread:
replicas, not threads, share the cores, and the deployment scales on its own queue (Serve's handle
counters) with the knee policy (deployments.autoscaling), apart from the shards.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext

import numpy as np
from ray import serve

from deployments.metrics import BATCH_BOUNDARIES, LATENCY_MS_BOUNDARIES, ExportedHistogram, export_every
from shardserve.data.text import encodable
from shardserve.embed.model_files import EmbedderError
from shardserve.index.manifest import ModelIdentity
from shardserve.query.batcher import AdaptiveBatcher
from shardserve.runtime.heap import settled
from shardserve.runtime.procfs import idle_while, lower_priority
from shardserve.tracing import SpanContext, SpanKind, TraceConfig, Tracer, end, now, parse_traceparent

logger = logging.getLogger("ray.serve")
# A call's answer: its vectors and truncated positions, or the error its own texts met
Answer = tuple[np.ndarray, tuple[int, ...]] | Exception


@serve.deployment(max_ongoing_requests=64, health_check_period_s=5)
class EmbedderDeployment:
    """Thin: loads an Embedder (its identity checked against the manifest's), answers `embed`."""

    async def __init__(self, model: str, identity: dict, *, max_batch_texts: int = 64,  # type: ignore[misc]
                       max_texts: int = 256, max_text_chars: int = 2000, nice: int = 0,
                       providers: tuple[str, ...] = ("CPUExecutionProvider",), idle: bool = True,
                       trace_endpoint: str | None = None, trace_ratio: float | None = None):
        """`model`: where this replica finds the model (a known name or a folder, AppArgs.embedder);
        `identity`: the manifest's (ModelIdentity), which it must match byte for byte.
        `max_batch_texts`: texts per batch (calls are never split); `max_texts`, `max_text_chars`:
        what one call may carry (the router checked already; refused here again, since only Ray
        callers reach this and the router is not the only one). `idle`: the model runs at the
        idle scheduling class (AppArgs.embedder_idle_priority). `trace_endpoint`, `trace_ratio`:
        AppArgs' (a traced call is a span of this replica, with its batch wait and model run)."""
        from shardserve.embed.model import Embedder  # ONNX Runtime: in this replica only, not in the
        # other deployments of the app, which import this module too

        expected = ModelIdentity.model_validate(identity)
        # Each model run (ONNX Runtime runs a one-thread session on its caller, without the GIL)
        # takes only the CPU nothing else on the node wants: vector searches preempt it.
        self.embedder = await asyncio.to_thread(Embedder, model, intra_op_threads=1, providers=providers,
                                                around_run=idle_while if idle else nullcontext)
        self.embedder.check(expected)
        self.max_texts, self.max_text_chars = max_texts, max_text_chars
        self.tracer = Tracer(TraceConfig.resolve(trace_endpoint, trace_ratio, "shardserve-embedder"),
                             {"shardserve.replica": serve.get_replica_context().replica_id.unique_id})
        # a traced call (by id, while it waits) -> (its batch's start, the model run's end)
        self._run_times: dict[int, tuple[float, float] | None] = {}
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="onnx")
        self.batcher: AdaptiveBatcher[list[str], Answer] = AdaptiveBatcher(self._run, max_batch_texts, 1,
                                                                           size_of=len)
        app = {"application": serve.get_replica_context().app_name}
        self.batch_texts = ExportedHistogram(
            "shardserve_embed_batch_texts", "Texts per model batch in an embedder replica", BATCH_BOUNDARIES,
            default_tags=app)
        self.batch_ms = ExportedHistogram(
            "shardserve_embed_batch_ms", "Model time per batch in an embedder replica",
            LATENCY_MS_BOUNDARIES, default_tags=app)
        self._exporter = asyncio.get_running_loop().create_task(
            export_every((self.batch_texts, self.batch_ms)))
        lower_priority(nice)
        self.pauses = settled(logger)

    async def embed(self, texts: list[str], traceparent: str = "") -> tuple[np.ndarray, tuple[int, ...]]:
        """float32 (len(texts), dim) and the positions of the texts cut at the model's token limit.
        `traceparent`: the router's embed span, when the request is traced."""
        if not isinstance(texts, list) or not 0 < len(texts) <= self.max_texts or not all(
                isinstance(text, str) and 0 < len(text) <= self.max_text_chars and encodable(text)
                for text in texts):
            raise EmbedderError(f"embed takes 1 to {self.max_texts} strings of 1 to {self.max_text_chars} "
                                f"characters")
        parent = parse_traceparent(traceparent) if traceparent and self.tracer.on else None
        arrived = now() if parent is not None else 0.0
        if parent is not None:
            self._run_times[id(texts)] = None
        try:
            answer = await self.batcher.submit(texts)
        finally:
            times = self._run_times.pop(id(texts), None) if parent is not None else None
        if parent is not None:
            self._trace(parent, texts, arrived, times)
        if isinstance(answer, Exception):  # its own texts failed, run apart from the batch's others
            raise answer
        return answer

    def _trace(self, parent: SpanContext, call: list[str], arrived: float,
               times: tuple[float, float] | None) -> None:
        """This replica's part of a traced request: the call, its wait for a batch, its batch's model run."""
        span = self.tracer.child(parent, "embedder", arrived, kind=SpanKind.SERVER,
                                 attributes={"texts": len(call)})
        if times is not None:
            batch_started, model_ended = times
            self.tracer.child(span, "batch wait", arrived, batch_started)
            self.tracer.child(span, "model", batch_started, model_ended)
        end(span, now())

    def identity(self) -> dict:
        return self.embedder.identity.model_dump()

    async def _run(self, calls: list[list[str]]) -> list[Answer]:
        """One model batch for every call queued: the texts of all, embedded once, split back."""
        texts = [text for call in calls for text in call]
        started, batch_started = time.perf_counter(), now() if self.tracer.on else 0.0
        loop = asyncio.get_running_loop()
        try:
            embedded = await loop.run_in_executor(self.executor, self.embedder.embed_batch, texts)
        except Exception:
            if len(calls) == 1:
                raise
            # one call's texts failed the model: each call again on its own, so only it fails
            alone: list[Answer] = []
            for call in calls:
                try:
                    alone.extend(await self._run([call]))
                except Exception as exc:
                    alone.append(exc)
            return alone
        self.batch_ms.observe((time.perf_counter() - started) * 1000.0)
        if self._run_times:  # a traced call is in this batch
            model_ended = now()
            for call in calls:
                if id(call) in self._run_times:
                    self._run_times[id(call)] = (batch_started, model_ended)
        self.batch_texts.observe(float(len(texts)))
        answers: list[Answer] = []
        start = 0
        cut = np.asarray(embedded.truncated, np.int64)
        for call in calls:
            end = start + len(call)
            inside = cut[(cut >= start) & (cut < end)] - start
            answers.append((embedded.vectors[start:end], tuple(int(i) for i in inside)))
            start = end
        return answers

