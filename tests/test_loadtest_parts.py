"""Knee finder on recorded curves; reporter on vegeta-encoded lines; targets decode to valid bodies."""

import base64
import json
import math
from pathlib import Path

import numpy as np
import orjson
import pytest

from loadtests.report import find_knee, summarize
from loadtests.vegeta_run import make_targets
from shardserve.query.parse import parse_npy_request, parse_search_request

SAMPLE = Path(__file__).resolve().parent.parent / "loadtests" / "records" / "sample"


def _levels(pairs):
    return [{"value": c, "qps": q, "p50_ms": c / q * 1000, "p99_ms": 2 * c / q * 1000} for c, q in pairs]


def test_knee_on_a_saturating_curve() -> None:
    knee = find_knee(_levels([(1, 100), (2, 190), (4, 350), (8, 600), (16, 640), (32, 650), (64, 645)]))
    assert knee["value"] == 8 and knee["saturated"]
    assert knee["latency_growth"] > 7  # 64 clients: latency is queueing past the knee


def test_knee_when_throughput_never_saturates() -> None:
    knee = find_knee(_levels([(1, 100), (2, 200), (4, 400)]))
    assert knee["value"] == 4 and not knee["saturated"]


def test_knee_needs_three_levels() -> None:
    assert find_knee(_levels([(1, 100), (2, 200)])) is None


def test_knee_on_committed_sweep_record() -> None:
    record = json.loads((SAMPLE / "sweep-sample.json").read_text())
    knee = find_knee(record["levels"])
    assert knee["value"] == record["knee"]["value"]


def _hit(code: int, latency_ms: float, compute: float | None, t: str) -> str:
    body = base64.b64encode(orjson.dumps({"timing_ms": {"total": 1.0, "compute": compute}})).decode() \
        if compute is not None else ""
    return json.dumps({"code": code, "latency": int(latency_ms * 1e6), "timestamp": t, "error": "",
                       "body": body})


def test_summarize_splits_compute_and_interface() -> None:
    lines = [_hit(200, 3.0, 1.0, "2026-11-22T04:00:00.000000000Z"),
             _hit(200, 5.0, 2.0, "2026-11-22T04:00:00.500000000Z"),
             _hit(503, 0.5, None, "2026-11-22T04:00:00.999000000Z")]
    level = summarize(lines, "concurrency", 2, 1.0)
    assert level["requests"] == 3 and level["status_codes"] == {"200": 2, "503": 1}
    assert level["success_ratio"] == round(2 / 3, 4)
    assert level["compute_p50_ms"] == 1.5 and level["queue_p50_ms"] == 2.5
    assert level["qps"] > 0 and level["max_ms"] == 5.0
    assert level["p99_ms_by_status"]["503"] == 0.5


def test_targets_are_valid_requests() -> None:
    queries = np.random.default_rng(0).random((5, 8)).astype(np.float32)
    for batch in (0, 3):
        lines = make_targets(queries, "http://127.0.0.1:1", k=4, params={"nprobe": 2}, batch=batch, count=7)
        assert len(lines) == 7
        for line in lines:
            target = json.loads(line)
            assert target["url"] == "http://127.0.0.1:1/v1/search"
            parsed = parse_search_request(base64.b64decode(target["body"]), 8, 100, 10)
            assert parsed.k == 4 and parsed.matrix.shape == (1 if batch == 0 else 3, 8)
        for json_line, npy_line in zip(lines, make_targets(queries, "http://127.0.0.1:1", k=4,
                                                           params={"nprobe": 2}, batch=batch, count=7,
                                                           npy=True), strict=True):
            target = json.loads(npy_line)
            assert target["header"]["Content-Type"] == ["application/x-npy"]
            path, _, query = target["url"].partition("?")
            parsed = parse_npy_request(base64.b64decode(target["body"]), query, 8, 100, 10)
            same = parse_search_request(base64.b64decode(json.loads(json_line)["body"]), 8, 100, 10)
            assert path == "http://127.0.0.1:1/v1/search" and np.array_equal(parsed.matrix, same.matrix)
            assert (parsed.k, parsed.params, parsed.single) == (same.k, same.params, same.single)


def test_tune_turns_the_committed_knee_into_a_valid_serve_config(tmp_path: Path) -> None:
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from deployments.config import AppArgs
    from deployments.tune import tune_from_record

    text = tune_from_record(str(SAMPLE / "sweep-sample.json"), str(tmp_path))
    config = yaml.safe_load(text)
    ServeDeploySchema.model_validate(config)
    args = AppArgs.model_validate(config["applications"][0]["args"])
    sweep_knee = json.loads((SAMPLE / "sweep-sample.json").read_text())["knee"]
    knee = int(sweep_knee["value"])
    # the edge admits 2 x the knee concurrency and, shedding, queues so that in flight + queued is
    # ~35 ms of the peak; 64 waiting clients (or Q) while it sheds nothing; the router behind it
    # takes every request the edge admits (a smaller max_in_flight would refuse waiting clients)
    edge_in_flight = max(8, 2 * knee)
    edge_queue = max(1, math.ceil(sweep_knee["peak_qps"] * 0.035) - edge_in_flight)
    edge_burst = max(64, edge_queue)
    from deployments.tune import DELAY_TARGET_S, MIN_BURST
    from serving.edge import DEFAULT_BURST, DEFAULT_DELAY_MS

    assert MIN_BURST == DEFAULT_BURST and round(2 * DELAY_TARGET_S * 1000) == DEFAULT_DELAY_MS
    assert (f"--edge-in-flight {edge_in_flight} --edge-burst {edge_burst} --edge-queue {edge_queue} "
            f"--edge-delay-ms 70") in text
    assert args.max_in_flight == edge_in_flight and args.router_max_queued_requests == knee
    assert args.router_max_ongoing_requests >= args.max_in_flight
    assert args.shard_autoscaling["max_replicas"] >= args.shard_autoscaling["min_replicas"] == 1
    # half the router's concurrent batches, at least 1 (the default: 2 batches -> 1)
    assert args.shard_autoscaling["target_ongoing_requests"] == max(1, args.batching()[0] // 2)
    from ray.serve.config import AutoscalingConfig

    scaling = AutoscalingConfig.model_validate(args.shard_autoscaling)  # what Serve will accept
    assert scaling.policy.policy_function == "deployments.autoscaling:knee_policy"
    assert args.max_batch_size * args.batching()[0] >= knee


def test_readme_and_docs_results_are_rendered_from_the_records() -> None:
    """Every figure in the generated tables of README.md and docs/ comes from a committed record."""
    from loadtests.readme_tables import blocks, render_all

    stale = [path.name for path, (current, wanted) in render_all(blocks()).items() if current != wanted]
    assert stale == [], "run: python -m loadtests.readme_tables"


def test_admission_verdict_needs_every_part_of_the_goal() -> None:
    """Closed loops all answered (>= 99 % at 128), overload only 200/503, every 503 with Retry-After
    and under 10 ms at p99, 200 p99 within max(3x the c=32 p99, 50 ms), goodput >= 0.8x c=32."""
    from loadtests.shedding import verdict

    def hits(*kinds: tuple[int, int, float], retry_after: bool = True) -> list[str]:
        """(count, code, latency ms) groups, sent 10 ms apart: 100 requests span ~1 s."""
        out = []
        for count, code, ms in kinds:
            for _ in range(count):
                at = f"2026-11-22T04:00:{len(out) // 100:02d}.{len(out) % 100:02d}0000000Z"
                line = json.loads(_hit(code, ms, 1.0 if code == 200 else None, at))
                line["headers"] = {"Retry-After": ["1"]} if code == 503 and retry_after else {}
                out.append(json.dumps(line))
        return out

    def level(*kinds: tuple[int, int, float], retry_after: bool = True) -> dict:
        return summarize(hits(*kinds, retry_after=retry_after), "rate", 200, 1.0)

    closed = {c: summarize(hits((100, 200, 20.0)), "concurrency", c, 1.0) for c in (8, 32, 128)}
    good = level((90, 200, 55.0), (10, 503, 3.0))
    assert verdict(closed, good)["met"]
    slow_admitted = level((90, 200, 70.0), (10, 503, 3.0))
    slow_shed = level((90, 200, 50.0), (10, 503, 12.0))
    no_retry = level((90, 200, 50.0), (10, 503, 3.0), retry_after=False)
    lost = level((90, 200, 50.0), (10, 0, 100.0))
    starved = level((60, 200, 50.0), (40, 503, 3.0))  # 60 200s a second < 0.8 x the 100 of c=32
    for bad in (slow_admitted, slow_shed, no_retry, lost, starved):
        assert not verdict(closed, bad)["met"]
    refused = {**closed, 8: summarize(hits((99, 200, 20.0), (1, 503, 1.0)), "concurrency", 8, 1.0)}
    assert not verdict(refused, good)["met"]  # a closed-loop client refused once is a miss
    assert verdict(closed, lost)["checks"]["only_200_or_503"] is False


def test_the_sweep_script_gets_the_same_vegeta_flags() -> None:
    """loadtests/sweep.sh asks vegeta_run for its attack flags: one spelling for Python and shell."""
    import subprocess
    import sys

    from loadtests.vegeta_run import attack_flags

    for mode, value, expected in (("concurrency", "32", attack_flags(Path("t.jsonl"), 10, concurrency=32)),
                                  ("rate", "500", attack_flags(Path("t.jsonl"), 10, rate=500))):
        printed = subprocess.run([sys.executable, "-m", "loadtests.vegeta_run", "flags", "--targets",
                                  "t.jsonl", "--duration", "10", "--mode", mode, "--value", value],
                                 capture_output=True, text=True, check=True).stdout.split()
        assert printed == expected
    script = (Path(__file__).parent.parent / "loadtests" / "sweep.sh").read_text()
    assert "loadtests.vegeta_run flags" in script and "loadtests.vegeta_run targets" in script


def test_knee_reactions_run_from_the_first_crossing() -> None:
    from loadtests.autoscale import knee_reactions

    samples = [{"t": 100.0 + t, "replicas": {"shard-000": 1 if t < 9 else 2, "shard-001": 1}}
               for t in range(12)]
    crossings = {"shard-000": [{"t": 102.0, "depth": 1.2, "replicas": 1},
                               {"t": 106.5, "depth": 1.4, "replicas": 1}],  # a second one: still from 102
                 "shard-001": [{"t": 90.0, "depth": 3.0, "replicas": 1}]}   # before the run
    reactions = knee_reactions(samples, crossings, since=100.0)
    assert reactions["shard-000"] == {"crossings": 2, "passed_knee_s": 2.0, "reaction_s": 7.0,
                                      "depth_at_knee": 1.2, "replicas_then": 2}
    assert reactions["shard-001"] == {"crossings": 0, "passed_knee_s": None, "reaction_s": None}


def test_knee_reactions_say_whether_the_new_replica_ran_in_a_warm_worker() -> None:
    from loadtests.autoscale import knee_reactions

    samples = [{"t": 100.0 + t, "replicas": {"a": 1 if t < 4 else 2, "b": 1 if t < 6 else 2}}
               for t in range(8)]
    crossings = {"a": [{"t": 102.0, "depth": 1.2, "replicas": 1}],
                 "b": [{"t": 102.0, "depth": 1.2, "replicas": 1}]}
    started = {"a": [{"ready_at": 50.0, "process_age_s": 1.0},  # the first replica, long before
                     {"ready_at": 103.5, "process_age_s": 30.0, "constructor_s": 0.2}],  # pool's
               "b": [{"ready_at": 105.5, "process_age_s": 3.0, "constructor_s": 2.5}]}  # spawned
    reactions = knee_reactions(samples, crossings, since=100.0, started=started)
    assert reactions["a"]["warm_worker"] is True and reactions["a"]["constructor_s"] == 0.2
    assert reactions["b"]["warm_worker"] is False and reactions["b"]["reaction_s"] == 4.0


def test_the_bench_headline_pools_its_alternating_rounds_side_by_side() -> None:
    from loadtests.bench import headline

    def level(label: str, clients: int, qps: float, cpu: float, requests: int, p50: float) -> dict:
        return {"label": label, "value": clients, "qps": qps, "requests": requests, "p50_ms": p50,
                "p99_ms": 2 * p50, "success_ratio": 1.0, "cpu_ms_per_request": {"total (servers)": cpu}}

    levels = [  # round 0: the monolith first; round 1: the serve command first
        level("headline-uvicorn-0", 1, 1000, 0.7, 8000, 0.70),
        level("headline-uvicorn-0", 32, 2000, 0.60, 16000, 15),
        level("headline-served-0", 1, 500, 2.0, 4000, 1.50),
        level("headline-served-0", 32, 1800, 0.80, 14400, 17),
        level("headline-served-1", 1, 600, 2.0, 4800, 1.30),
        level("headline-served-1", 32, 2400, 0.70, 19200, 13),
        level("headline-uvicorn-1", 1, 1100, 0.7, 8800, 0.60),
        level("headline-uvicorn-1", 32, 3000, 0.50, 24000, 10)]
    summary = headline(levels)
    served, monolith = summary["headline-served"], summary["headline-uvicorn"]
    assert served["rounds"] == monolith["rounds"] == 2
    assert served["qps_c32"] == 2100 and monolith["qps_c32"] == 2500  # mean over the rounds
    # CPU per request over every request of a side, not a mean of the rounds' ratios
    assert served["cpu_ms_per_request_c32"] == round((0.80 * 14400 + 0.70 * 19200) / 33600, 3)
    assert served["p50_ms_c1"] == 1.4 and monolith["p50_ms_c1"] == 0.65
    # each round against its own monolith, paired by round
    assert [r["qps_c32_vs_uvicorn"] for r in summary["per_round"]] == [0.9, 0.8]
    assert summary["ratios"]["qps_c32_vs_uvicorn"] == 0.84
    assert summary["ratios"]["c1_p50_minus_uvicorn_c1_p50_ms"] == 0.75


def test_a_harness_without_vegeta_says_what_to_run(tmp_path, monkeypatch) -> None:
    from loadtests import vegeta_run

    monkeypatch.setattr(vegeta_run, "VEGETA", tmp_path / "vegeta")
    with pytest.raises(SystemExit, match="run `make vegeta` first") as stopped:
        vegeta_run.vegeta()
    assert "\n" not in str(stopped.value)


def test_tune_turns_a_text_sweeps_knee_into_the_embedders_settings(tmp_path: Path) -> None:
    """A text sweep's knee is the embedder's: its knee depth per replica and the text admission,
    leaving the edge, the router and the shards as they are."""
    import yaml

    from deployments.config import AppArgs
    from deployments.tune import tune_from_record

    record = json.loads((SAMPLE / "sweep-sample.json").read_text())
    record["queries"] = "text"
    (tmp_path / "text.json").write_text(json.dumps(record))
    config = yaml.safe_load(tune_from_record(str(tmp_path / "text.json"), str(tmp_path)))
    args = AppArgs.model_validate(config["applications"][0]["args"])
    knee = int(record["knee"]["value"])
    assert args.embedder_autoscaling["target_ongoing_requests"] == knee
    assert args.max_texts_in_flight == 2 * knee * args.embedder_autoscaling["max_replicas"]
    defaults = AppArgs(index=str(tmp_path))
    assert args.max_in_flight == defaults.max_in_flight
    assert args.shard_autoscaling == defaults.shard_autoscaling
