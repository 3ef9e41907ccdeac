"""`shardserve` command line: maps each subcommand to a function in its own module, nothing more."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from shardserve import settings
from shardserve.errors import ShardserveError
from shardserve.index.auto_index import DEFAULT_MEMORY_BUDGET, parse_bytes

if TYPE_CHECKING:
    from shardserve.index.manifest import Published


def _build(args: argparse.Namespace) -> None:
    from index_build.job import build_index

    manifest = build_index(args.dataset, args.shards, args.index, args.out, metric=args.metric,
                           limit=args.limit, backend=args.backend, force=args.force,
                           train_size=args.train_size, seed=args.seed,
                           vector_column=args.vector_column, id_column=args.id_column,
                           metadata_columns=args.metadata_columns, memory_budget=args.memory_budget,
                           discard_writes=args.discard_writes, text_column=args.text_column,
                           embedder=args.embedder)
    print(f"built {manifest.index_factory} index {manifest.index_version}: {manifest.num_vectors} "
          f"vectors in {len(manifest.shards)} shards at {args.out} ({manifest.build.seconds:.1f} s)")
    if manifest.embedder is not None:
        print(f"embedded with {manifest.embedder.name} (dim {manifest.embedder.dim}, cosine); the vectors "
              f"are kept at {manifest.dataset.name} (eval and the swap gate read them)")


def _eval(args: argparse.Namespace) -> None:
    from serving.evaluate import evaluate, search_params_from_flags

    result = evaluate(args.index_dir, args.dataset, k=args.k,
                      params=search_params_from_flags(args.nprobe, args.ef_search), url=args.url,
                      limit=args.limit, compare_unsharded=args.compare_unsharded,
                      where=_filter_arg(args.filter))
    if args.json:
        print(json.dumps(result))
        return
    print(f"recall@{result['k']} = {result['recall']:.4f}  ({result['queries']} queries, "
          f"{result['qps']:.0f} QPS, {result['shards']} shards, {result['mode']}, params {result['params']})")
    if "unsharded" in result:
        u = result["unsharded"]
        print(f"unsharded recall@{result['k']} = {u['recall']:.4f}  ({u['qps']:.0f} QPS)")


def _filter_arg(text: str | None) -> dict | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ShardserveError(f"--filter is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ShardserveError("--filter must be a JSON object, e.g. '{\"label\": 3}'")
    return value


def _serve(args: argparse.Namespace) -> None:
    from shardserve.runtime.ray_session import apply_serving_node_env

    apply_serving_node_env()  # before anything imports ray.serve: it reads these flags at import
    from deployments.run import absolute
    from serving.local_server import serve_blocking
    from shardserve.index.manifest import Published

    published = Published.open(absolute(args.index_dir))  # a bad index: one line, before Ray starts
    base = _index_admission(published)

    api_key = _api_key()
    # Read once, then out of the environment before Ray starts: Ray's processes (every Serve
    # replica) and the edge inherit this process's environment, and the key is the edge's alone.
    settings.forget_api_key()
    admission = _admission(args, base)
    serve_blocking(published, host=args.host, port=args.port,
                   replicas_per_shard=args.replicas_per_shard, num_cpus=args.num_cpus,
                   edge=not args.no_edge, admission=admission, api_key=api_key,
                   access_log=args.access_log, address=args.address, compact_at=args.compact_at,
                   app_args=_traced(args, _serve_app_args(args.arg)), prometheus_port=args.prometheus_port)


def _deploy(args: argparse.Namespace) -> None:
    """Deploy onto a running cluster and return (Serve keeps the apps after this driver exits)."""
    from shardserve.runtime.ray_session import apply_serving_node_env

    apply_serving_node_env()
    from deployments.run import absolute, deploy
    from shardserve.index.manifest import Published

    overrides = _traced(args, _app_args(args.arg))
    published = Published.open(absolute(args.index_dir))  # a bad index: one line, before connecting
    _connect(args.address)
    url = deploy(published, host=args.host, port=args.port,
                 replicas_per_shard=args.replicas_per_shard, **overrides)
    print(f"deployed {args.index_dir} at {url}")


def _serve_config(args: argparse.Namespace) -> None:
    from deployments.config import serve_config_yaml

    sys.stdout.write(serve_config_yaml(args.index_dir, host=args.host, port=args.port,
                                       replicas_per_shard=args.replicas_per_shard,
                                       **_traced(args, _app_args(args.arg))))


_FLAG_ARGS = {"index": "INDEX_DIR", "replicas_per_shard": "--replicas-per-shard"}  # set by flags


def _connect(address: str | None) -> None:
    """Join a running cluster; an address nothing listens on fails in seconds with one line
    (ray.init would retry for minutes)."""
    import socket

    import ray

    if not address and not os.environ.get("RAY_ADDRESS"):
        from shardserve.runtime.ray_private import local_gcs_addresses

        running = local_gcs_addresses()
        if len(running) > 1:  # e.g. two `shardserve serve`, each with its own Ray: say which
            raise ShardserveError(f"{len(running)} Ray clusters run on this machine ({', '.join(running)}): "
                                  "pick one with --address (each `shardserve serve` prints its own)")
    if address and address != "auto" and "://" not in address:
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=5).close()
        except (OSError, ValueError) as exc:
            raise ShardserveError(f"no Ray cluster at {address} ({exc})") from None
    ray.init(address=address or "auto", log_to_driver=False, configure_logging=False)


def _traced(args: argparse.Namespace, overrides: dict) -> dict:
    """The `--arg`s with `--trace-endpoint` and `--trace-ratio` given."""
    flags = {"trace_endpoint": args.trace_endpoint, "trace_ratio": args.trace_ratio}
    return {**overrides, **{key: value for key, value in flags.items() if value is not None}}


def _serve_app_args(pairs: list[str]) -> dict:
    """`serve`'s `--arg`s: any AppArgs field but the router's door, which `serve` places itself."""
    overrides = _app_args(pairs)
    if placed := sorted({"front_port", "front_host"} & set(overrides)):
        raise ShardserveError(f"--arg {placed[0]}: `serve` sets it (its edge reaches the router there)")
    return overrides


def _app_args(pairs: list[str]) -> dict:
    """`--arg shard_resources='{"shard_host": 1}'` → AppArgs overrides (values are JSON, else str)."""
    from pydantic import ValidationError

    from deployments.config import AppArgs

    overrides: dict = {}
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        if not sep:
            raise ShardserveError(f"--arg {pair!r}: expected KEY=VALUE")
        if key in _FLAG_ARGS:
            raise ShardserveError(f"--arg {key}: use {_FLAG_ARGS[key]} instead")
        try:
            overrides[key] = json.loads(raw)
        except ValueError:
            overrides[key] = raw
    try:
        AppArgs(index="-", **overrides)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ShardserveError(f"--arg {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    return overrides


def _swap(args: argparse.Namespace) -> None:
    from shardserve.runtime.ray_session import apply_serving_node_env

    apply_serving_node_env()  # before ray.serve is imported (it reads these flags at import)

    from deployments.swap import rollback, swap_index

    if not args.rollback and not args.index_dir:
        raise ShardserveError("swap needs NEW_INDEX_DIR (or --rollback)")
    if args.index_dir:
        from shardserve.index.manifest import read_manifest
        from shardserve.index.storage import Location

        read_manifest(Location.parse(args.index_dir))  # a bad index: one line, before connecting
    _connect(args.address)
    report = (rollback(args.app) if args.rollback else
              swap_index(args.index_dir, args.app, args.dataset, args.min_recall, args.keep_previous))
    gate = (f"recall@{report['k']} {report['recall']:.4f} >= {report['min_recall']}"
            if report["recall"] is not None else "no gate (rollback)")
    print(f"swapped {args.app}: {report['old_version']} -> {report['new_version']} "
          f"(generation {report['generation']}, {gate}, {report['seconds']})")


def _compact(args: argparse.Namespace) -> None:
    from index_build.compact import compact

    manifest = compact(args.index_dir)
    print(f"compacted {args.index_dir}: version {manifest.index_version} folds the write log up to "
          f"position {manifest.log_position} ({manifest.num_vectors} vectors); a running server moves "
          f"to it with: shardserve swap {args.index_dir} --address ADDRESS")


# `shardserve plan`'s record when none is given: the one a checkout carries (an installed wheel has none).
CHECKOUT_LAYOUTS = Path(__file__).resolve().parent.parent / "loadtests" / "records" / "layouts.json"


def _plan(args: argparse.Namespace) -> None:
    from serving.capacity import plan_from_record

    if args.record is None:
        if not CHECKOUT_LAYOUTS.exists():
            raise ShardserveError("give a layouts record: `python -m lab.layouts` (in a checkout) measures "
                                  "one into loadtests/records/layouts.json")
        args.record = os.path.relpath(CHECKOUT_LAYOUTS)  # as the docs show it, run from the checkout
    result = plan_from_record(args.record, args.target_qps, args.cores_per_node, args.memory_per_node_gb,
                              args.vectors, args.index_dir, args.bytes_per_vector, args.top)
    model, cores = result.model, result.record["machine"]["cores"]
    print(f"model: cpu_ms(S) = {model.fixed_ms:.3f} + {model.per_shard_ms:.3f} x S  "
          f"(fitted on {result.fitted} one-replica layouts of {args.record}, {cores} cores)")
    print(f"{'layout':>7} {'measured':>9} {'predicted':>10} {'error':>7}  role   p99@knee")
    for row, layout in result.checks:
        print(f"{row['layout']:>7} {row['measured_qps']:>9.0f} {row['predicted_qps']:>10.0f} "
              f"{row['error']:>+7.1%}  {row['role']:<5}  {layout.p99_ms:.1f} ms")
    if not args.target_qps:
        return
    share = (f"FAISS {result.faiss_ms:.3f} ms/query/shard measured in-process on {args.index_dir}"
             if result.faiss_ms is not None else "whole per-shard cost scaled (no --index-dir: upper bound)")
    print(f"\nfor {args.target_qps:.0f} req/s at {result.vectors} vectors on {args.cores_per_node:g}-core "
          f"{args.memory_per_node_gb:g} GB nodes, 80% of the knee; {share}:")
    for option in result.options:
        nodes = "does not fit" if option["nodes"] is None else f"{option['nodes']:>4} nodes"
        print(f"  {option['shards']:>3} shards x {option['replicas_per_shard']:>4} replicas: "
              f"{option['cores']:>8.1f} cores, {option['gb_per_replica']:>6.2f} GB/replica, {nodes}"
              f"  ({option['cpu_ms_per_request']:.2f} CPU-ms/request)")
    if args.embedder:
        from serving.capacity import embed_ms_per_text, embedding_stage

        stage = embedding_stage(embed_ms_per_text(args.embedder), args.target_qps, args.text_share,
                                args.cores_per_node)
        print(f"embedding stage ({args.embedder}, {stage['embed_ms_per_text']:.2f} CPU-ms a text measured "
              f"here, {stage['text_share']:.0%} of requests embedded): {stage['replicas']} embedder replicas "
              f"({stage['cores']:.1f} cores), {stage['nodes']} embedding node(s) of {args.cores_per_node:g} "
              f"cores; set embedder_autoscaling max_replicas >= {stage['replicas']}")


def _edge_config(args: argparse.Namespace) -> None:
    from pathlib import Path

    from serving.edge import write_edge
    from shardserve.index.manifest import Published

    # as `serve` would take it
    base = None if args.index is None else _index_admission(Published.open(args.index))
    config = write_edge(Path(args.dir), args.backend, args.listen, _admission(args, base), _api_key())
    print(f"wrote {config} (run: haproxy -f {config})")


def _index_admission(published: Published):  # type: ignore[no-untyped-def]
    """The edge's defaults for this index (serving.edge.default_admission), from its manifest."""
    from serving.edge import default_admission
    from shardserve.query.scan_choice import shares_scan

    return default_admission(shares_scan(published.manifest))


def _admission(args: argparse.Namespace, base=None):  # type: ignore[no-untyped-def]
    """The edge's admission: `base` (default: serving.edge's defaults) with the flags given."""
    from dataclasses import replace

    from serving.edge import Admission

    burst = args.edge_burst
    if burst is None and args.edge_queue is not None:  # a queue alone still admits the default's clients
        burst = max((base or Admission()).max_burst, args.edge_queue)
    given = {"max_in_flight": args.edge_in_flight, "max_burst": burst, "max_queue": args.edge_queue,
             "queue_timeout_ms": args.edge_queue_timeout_ms, "delay_ms": args.edge_delay_ms,
             "burst_ms": args.edge_burst_ms, "text_in_flight": args.edge_text_in_flight,
             "text_queue": args.edge_text_queue, "text_queue_shedding": args.edge_text_queue_shedding}
    try:
        return replace(base or Admission(), **{key: value for key, value in given.items()
                                               if value is not None})
    except ValueError as exc:
        raise ShardserveError(f"edge admission: {exc}") from None


def _api_key() -> str | None:
    """SHARDSERVE_API_KEY, when set: the edge then wants it on every request but the health check."""
    from serving.edge import check_api_key

    key = settings.api_key()
    return check_api_key(key) if key else None


def _edge_options(cmd: argparse.ArgumentParser) -> None:
    from serving.edge import (
        DEFAULT_BURST,
        DEFAULT_BURST_MS,
        DEFAULT_DELAY_MS,
        DEFAULT_IN_FLIGHT,
        DEFAULT_QUEUE,
        DEFAULT_QUEUE_TIMEOUT_MS,
        DEFAULT_TEXT_IN_FLIGHT,
        DEFAULT_TEXT_QUEUE,
        DEFAULT_TEXT_QUEUE_SHEDDING,
        SHARED_SCAN_DELAY_MS,
        SHARED_SCAN_IN_FLIGHT,
    )

    cmd.add_argument("--edge-in-flight", type=_POSITIVE, help="requests inside the router at once "
                     f"(default {DEFAULT_IN_FLIGHT}, {SHARED_SCAN_IN_FLIGHT} where a batch shares the "
                     "shards' scan; `shardserve tune` writes a measured one)")
    cmd.add_argument("--edge-burst", type=_at_least(0), help="requests that may wait at the edge while it "
                     "sheds nothing: waiting clients, bursts; one more starts the shedding "
                     f"(default {DEFAULT_BURST}, or --edge-queue if larger)")
    cmd.add_argument("--edge-burst-ms", type=_at_least(0), help="while the edge sheds nothing, as many may "
                     "wait as the router answers in this long, when more than --edge-burst: a stall this "
                     f"short is absorbed, not shed (default {DEFAULT_BURST_MS}; 0: --edge-burst alone)")
    cmd.add_argument("--edge-queue", type=_at_least(0), help="requests that may wait at the edge while it "
                     "is shedding (shed within 1 s); a new one that finds more gets 503 at once "
                     f"(default {DEFAULT_QUEUE})")
    cmd.add_argument("--edge-queue-timeout-ms", type=_POSITIVE, help="an admitted request still queued "
                     f"after this gets 503 (default {DEFAULT_QUEUE_TIMEOUT_MS})")
    cmd.add_argument("--edge-delay-ms", type=_at_least(0), help="while shedding, a new request that finds "
                     "more inside (router + queue) than the router answers in this long, and more than "
                     f"--edge-queue, gets 503 at once (default {DEFAULT_DELAY_MS}, {SHARED_SCAN_DELAY_MS} "
                     "where a batch shares the shards' scan; 0: the counts alone)")
    cmd.add_argument("--edge-text-in-flight", type=_POSITIVE, help="requests carrying text inside the "
                     f"router at once, in a lane of their own (default {DEFAULT_TEXT_IN_FLIGHT})")
    cmd.add_argument("--edge-text-queue", type=_at_least(0), help="text requests that may wait at the "
                     f"edge; one more gets 503 at once (default {DEFAULT_TEXT_QUEUE})")
    cmd.add_argument("--edge-text-queue-shedding", type=_at_least(0), help="while the text lane sheds "
                     f"(within 1 s), text requests that may wait (default {DEFAULT_TEXT_QUEUE_SHEDDING})")


def _tune(args: argparse.Namespace) -> None:
    from deployments.tune import tune_from_record

    sys.stdout.write(tune_from_record(args.record, args.index_dir))


class _Parser(argparse.ArgumentParser):
    """Usage errors in the CLI's one-line form (`shardserve: error: ...`, exit 2), like every other
    error; `-h` still prints the full usage."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"shardserve: error: {self.prog.removeprefix('shardserve ')}: {message}\n")


def _at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    parse.__name__ = f"integer >= {minimum}"
    return parse


_POSITIVE = _at_least(1)


def _port(text: str) -> int:
    value = _POSITIVE(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is at most 65535, got {value}")
    return value


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def _bytes(text: str) -> int:
    try:
        return parse_bytes(text)
    except ShardserveError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parser() -> argparse.ArgumentParser:
    root = _Parser(prog="shardserve", description=__doc__)
    root.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = root.add_subparsers(dest="command", required=True, parser_class=_Parser)

    build = sub.add_parser("build", help="build a sharded FAISS index with a Ray Data job")
    build.add_argument("--dataset", required=True,
                       help="fashion-mnist | synthetic:NxD | glove-50 | a file | a directory or glob "
                            "of parquet files; with --embedder, a text corpus: parquet, JSON lines "
                            "(.jsonl, .json) or .txt files (a text a line)")
    build.add_argument("--shards", type=_POSITIVE, required=True)
    build.add_argument("--index", required=True, help="FAISS factory string, e.g. IVF1024,Flat, or `auto`: "
                                                       "picked from the data's size and --memory-budget")
    build.add_argument("--memory-budget", type=_bytes, default=DEFAULT_MEMORY_BUDGET,
                       help="--index auto: memory the whole index may take, e.g. 4GB (default)")
    build.add_argument("--out", required=True, help="local dir or pyarrow URI (s3://bucket/idx)")
    build.add_argument("--metric", choices=["l2", "ip", "cosine"], help="default: the dataset's")
    build.add_argument("--limit", type=_POSITIVE, help="index only the first N base vectors")
    build.add_argument("--train-size", type=_at_least(0), default=0, help="training sample size (0 = auto)")
    build.add_argument("--seed", type=int, default=1234)
    build.add_argument("--vector-column", help="parquet: the list<float> column (default: the first one)")
    build.add_argument("--id-column", help="parquet (or JSON lines with --embedder): int64 ids returned "
                                           "in answers instead of row numbers (unique, >= 0)")
    build.add_argument("--metadata-columns", type=lambda text: [c for c in text.split(",") if c],
                       help="parquet (or JSON lines with --embedder): columns a,b stored per shard and "
                            "returned on request (`include` in /v1/search)")
    build.add_argument("--text-column", help="with --embedder: the column of the texts to embed (a .txt "
                                             "dataset's is `text`)")
    build.add_argument("--embedder", metavar="MODEL", help="build from text: embed --text-column with this "
                       "model (all-MiniLM-L6-v2, or a model folder) on a Ray Data actor pool; cosine")
    build.add_argument("--backend", choices=["ray", "local"], default="ray",
                       help="ray: Ray Data job (default); local: single-process reference")
    build.add_argument("--force", action="store_true", help="replace an index already at --out")
    build.add_argument("--discard-writes", action="store_true",
                       help="--out took writes (upserts, deletes): leave them out of the new version")
    build.set_defaults(func=_build)

    ev = sub.add_parser("eval", help="recall@k and QPS, in-process or over HTTP")
    ev.add_argument("index_dir")
    ev.add_argument("--dataset", required=True)
    ev.add_argument("--k", type=_POSITIVE, default=10)
    ev.add_argument("--nprobe", type=_POSITIVE)
    ev.add_argument("--ef-search", type=_POSITIVE)
    ev.add_argument("--url", help="evaluate a running server, e.g. http://127.0.0.1:8000")
    ev.add_argument("--limit", type=int, help="the --limit the index was built with")
    ev.add_argument("--compare-unsharded", action="store_true")
    ev.add_argument("--filter", help="grade a filtered search (Chroma where JSON, e.g. '{\"label\": 3}') "
                    "against exact ground truth over the matching rows")
    ev.add_argument("--json", action="store_true", help="print one JSON object")
    ev.set_defaults(func=_eval)

    for name, func, text in (("serve", _serve, "serve an index over HTTP on a local Ray"),
                             ("deploy", _deploy, "deploy onto a running Ray cluster and exit"),
                             ("serve-config", _serve_config, "print a Ray Serve config YAML")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("index_dir")
        cmd.add_argument("--host", default="127.0.0.1")
        cmd.add_argument("--port", type=int, default=8000)
        cmd.add_argument("--replicas-per-shard", type=_POSITIVE, default=1)
        cmd.set_defaults(func=func)
        if name == "deploy":
            cmd.add_argument("--address", help="Ray address (default: RAY_ADDRESS or the local cluster)")
        if name == "serve":
            cmd.add_argument("--address", help="join this Ray cluster (default: RAY_ADDRESS, else a Ray of "
                             "its own, even beside another `shardserve serve` on this machine)")
        if name in ("deploy", "serve-config", "serve"):
            cmd.add_argument("--arg", action="append", metavar="KEY=JSON",
                             help="an application setting (deployments/config.py AppArgs), repeatable")
            cmd.add_argument("--trace-endpoint", metavar="URL",
                             help="export OpenTelemetry spans over OTLP/HTTP to this traces URL, e.g. "
                                  "http://127.0.0.1:4318/v1/traces (default: each node's "
                                  "SHARDSERVE_TRACE_ENDPOINT; unset: no tracing)")
            cmd.add_argument("--trace-ratio", type=_ratio, metavar="R",
                             help="share of requests without a sampled traceparent that are traced "
                                  "(default: SHARDSERVE_TRACE_RATIO, else 0: only those a caller's "
                                  "traceparent says sampled)")
        if name == "serve":
            cmd.add_argument("--num-cpus", type=float, help="logical CPUs of the local Ray it starts "
                             "(default: the cores, or room for two index versions if more: a swap "
                             "runs both until the switch)")
            cmd.add_argument("--compact-at", type=_at_least(0), metavar="OPS",
                             help="compact the write log into a new index version and swap to it once "
                                  "this many operations wait (default: a quarter of the write backlog "
                                  "bound, 50000; 0: only `shardserve compact` by hand)")
            _edge_options(cmd)
            cmd.add_argument("--access-log", metavar="FILE", help="the edge appends a line per request "
                             "(HAProxy's HTTP log format: time queued at the edge, the router's, the total)")
            cmd.add_argument("--no-edge", action="store_true", help="no HAProxy edge in front of Serve "
                             "(overload is then shed by the router, later and slower)")
            cmd.add_argument("--prometheus-port", type=_port, metavar="PORT",
                             help="run Debian's Prometheus on 127.0.0.1:PORT with the scrape configuration "
                                  "of the Ray this command starts, and point Ray's dashboard at it "
                                  "(e.g. 9090; default: none)")

    swap = sub.add_parser("swap", help="replace the served index with no downtime (recall-gated)")
    swap.add_argument("index_dir", nargs="?", help="the new index directory or URI")
    swap.add_argument("--app", default="shardserve", help="Serve application of the router")
    swap.add_argument("--address", help="Ray address (default: RAY_ADDRESS or the local cluster)")
    swap.add_argument("--dataset", help="dataset the index was built from (default: the manifest's)")
    swap.add_argument("--min-recall", type=float, help="gate threshold (default: the app's config)")
    swap.add_argument("--keep-previous", action="store_true", help="keep the old version deployed")
    swap.add_argument("--rollback", action="store_true", help="serve the previous index again")
    swap.set_defaults(func=_swap)

    cp = sub.add_parser("compact", help="fold the write log (upserts, deletes) into a new index version")
    cp.add_argument("index_dir", help="the index directory the server writes to")
    cp.set_defaults(func=_compact)

    pl = sub.add_parser("plan", help="capacity model from a layouts record: knee QPS per layout, "
                                     "layout for a target QPS")
    pl.add_argument("record", nargs="?", help="a layouts record (default: the checkout's "
                                              "loadtests/records/layouts.json)")
    pl.add_argument("--target-qps", type=float)
    pl.add_argument("--vectors", type=int, help="plan for this many vectors (default: the record's)")
    pl.add_argument("--index-dir", help="the record's largest-layout index: measure its FAISS share")
    pl.add_argument("--memory-per-node-gb", type=float, default=64)
    pl.add_argument("--bytes-per-vector", type=float, default=784 * 4 + 8,
                    help="index bytes per vector (IVF,Flat: 4 x dim + 8 for the id)")
    pl.add_argument("--top", type=int, default=4, help="how many layouts to print")
    pl.add_argument("--cores-per-node", type=float, default=16)
    pl.add_argument("--embedder", help="an index built from text: plan its embedding stage too, this "
                    "model's CPU per text measured here (a known model's name or a model folder)")
    pl.add_argument("--text-share", type=float, default=1.0, help="with --embedder: the share of "
                    "requests that are texts the embedding cache misses (1: every request)")
    pl.set_defaults(func=_plan)

    edge = sub.add_parser("edge-config", help="HAProxy config that sheds load with a fast 503 "
                                               "before Serve (max in flight = the knee concurrency)")
    edge.add_argument("--backend", default="127.0.0.1:8000", help="Serve's HTTP host:port")
    edge.add_argument("--listen", default="127.0.0.1:8080")
    edge.add_argument("--index", help="the index served: its defaults, as `shardserve serve` takes them "
                                      "(K and D where a batch shares the shards' scan)")
    _edge_options(edge)
    edge.add_argument("--dir", default="configs/edge", help="where to write the config + 503 body")
    edge.set_defaults(func=_edge_config)

    tune = sub.add_parser("tune", help="knee of a sweep record → autoscaling settings in a serve config")
    tune.add_argument("record")
    tune.add_argument("--index-dir", help="index for the emitted config (default: the record's)")
    tune.set_defaults(func=_tune)
    return root


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)
    if not args.verbose:  # a line per request (`serve` polls its health at start-up): debug output
        logging.getLogger("httpx").setLevel(logging.WARNING)
    if os.environ.get("RAY_AUTH_TOKEN") or (Path.home() / ".ray" / "auth_token").exists():
        # Ray starts local clusters (`shardserve serve`'s own among them) with token auth, and a
        # driver that joins one sends the token only in token mode: set before Ray is imported
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    try:
        args.func(args)
    except KeyboardInterrupt:
        print("shardserve: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # one line for the user; the traceback with -v
        if args.verbose:
            raise
        print(f"shardserve: error: {one_line(exc)}", file=sys.stderr)
        return 2
    return 0


def one_line(exc: BaseException) -> str:
    """What went wrong, in one line: our own errors as they are; a Ray task's error by its cause
    (not its remote traceback); pydantic's first complaint; anything else with its type."""
    from pydantic import ValidationError

    if isinstance(exc, ShardserveError):
        return str(exc)
    cause = getattr(exc, "cause", None)  # ray.exceptions.RayTaskError wraps the task's exception
    if isinstance(cause, BaseException) and cause is not exc:
        return one_line(cause)
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        return f"{'.'.join(map(str, first['loc'])) or 'value'}: {first['msg']}"
    if isinstance(exc, OSError) and exc.strerror:
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{exc.strerror}{where}"
    text = " ".join(str(exc).split())[:300]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
