"""The capacity model on constructed layouts (no Ray): fit recovers known costs, predictions scale."""

from __future__ import annotations

import pytest

from serving.capacity import CapacityModel, Layout, check, fit, ivf_work, plan, scaled_cpu_ms


def _measured(model: CapacityModel, shards: int, replicas: int, cores: float = 2) -> Layout:
    return Layout(shards, replicas, cores, model.knee_qps(Layout(shards, replicas, cores)))


def test_fit_recovers_fixed_and_per_shard_cost() -> None:
    truth = CapacityModel(fixed_ms=1.2, per_shard_ms=0.4)
    model = fit([_measured(truth, s, 1) for s in (1, 2, 4)])
    assert model.fixed_ms == pytest.approx(1.2) and model.per_shard_ms == pytest.approx(0.4)
    rows = check(model, [_measured(truth, 2, 2)], fitted=set())
    assert rows[0]["role"] == "test" and abs(rows[0]["error"]) < 1e-9


def test_fit_needs_two_shard_counts() -> None:
    with pytest.raises(ValueError, match="two different shard counts"):
        fit([Layout(4, 1, 2, 600.0), Layout(4, 1, 2, 620.0)])


def test_usable_cores_are_capped_by_replicas_then_by_the_machine() -> None:
    model = CapacityModel(1.0, 0.5)
    assert model.usable_cores(Layout(1, 1, 64)) == 2  # one shard replica + the router
    assert model.usable_cores(Layout(4, 4, 8)) == 8
    assert model.knee_qps(Layout(4, 4, 8)) == pytest.approx(8 * 1000 / 3.0)


def test_plan_needs_more_cores_for_more_traffic_and_more_data() -> None:
    model = CapacityModel(1.0, 0.5)
    small = plan(model.cpu_ms, 1000, cores_per_node=16, index_bytes=1e9)
    big = plan(model.cpu_ms, 10_000, cores_per_node=16, index_bytes=1e9)
    assert small[0]["cores"] * 10 == pytest.approx(big[0]["cores"], rel=0.02)  # cores rounded to 0.1
    more_data = scaled_cpu_ms(model, faiss_ms_per_shard=0.3, measured_vectors=60_000,
                              vectors=6_000_000, nlist=1024, nprobe=16)
    same_data = scaled_cpu_ms(model, 0.3, 60_000, 60_000, 1024, 16)
    assert more_data(4) > model.cpu_ms(4) == pytest.approx(same_data(4))
    assert ivf_work(1e6, 4000, 16, 100) > ivf_work(1e4, 400, 16, 100)


def test_model_against_the_committed_layouts_record() -> None:
    """The committed measurement (loadtests/records/layouts.json, one run on this machine): fitted on
    the one-replica layouts, the model must predict every layout's knee within 20%."""
    import json

    from tests.conftest import REPO

    record = json.loads((REPO / "loadtests" / "records" / "layouts.json").read_text())
    layouts = [Layout(lay["shards"], lay["replicas_per_shard"], record["machine"]["cores"],
                      lay["knee"]["qps"]) for lay in record["layouts"]]
    assert {(lay.shards, lay.replicas_per_shard) for lay in layouts} >= {(1, 1), (4, 1), (2, 2)}
    fitted = [lay for lay in layouts if lay.replicas_per_shard == 1]
    rows = check(fit(fitted), layouts, {(lay.shards, 1) for lay in fitted})
    assert any(row["role"] == "test" for row in rows)
    assert all(abs(row["error"]) <= 0.20 for row in rows), rows


def test_plan_from_the_committed_record_reaches_the_target(tmp_path) -> None:
    """`shardserve plan`'s logic, without the CLI: every option offered reaches the target at 80% of
    its knee, cheapest first; a file that is not a layouts record is one clear error."""
    from serving.capacity import plan_from_record
    from shardserve.errors import ShardserveError
    from tests.conftest import REPO

    result = plan_from_record(str(REPO / "loadtests" / "records" / "layouts.json"), target_qps=5000,
                              cores_per_node=16, memory_per_node_gb=64, vectors=1_000_000)
    assert result.vectors == 1_000_000 and result.faiss_ms is None and result.options
    assert all(row["layout"] for row, _ in result.checks)
    cores = [option["cores"] for option in result.options]
    assert cores == sorted(cores)
    for option in result.options:
        knee = option["cores"] * 1000.0 / option["cpu_ms_per_request"]
        assert 0.8 * knee >= 5000 * 0.999
    bad = tmp_path / "not-a-record.json"
    bad.write_text("{}")
    with pytest.raises(ShardserveError, match="not a layouts record"):
        plan_from_record(str(bad))


def test_the_embedding_stage_is_sized_by_the_cpu_a_text_costs() -> None:
    from serving.capacity import embedding_stage

    stage = embedding_stage(16.0, 500, 0.5, cores_per_node=4)  # 500 x 0.5 x 16 ms / 0.8 = 5 cores
    assert (stage["cores"], stage["replicas"], stage["nodes"]) == (5.0, 5, 2)
    assert embedding_stage(16.0, 500, 0.0, cores_per_node=4)["replicas"] == 1  # never none
