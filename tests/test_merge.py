"""merge_topk against brute force on seeded data."""

import numpy as np
import pytest

from shardserve.query.merge import merge_topk


@pytest.mark.parametrize("higher_is_better", [False, True])
def test_merge_of_shard_topk_equals_global_topk(higher_is_better: bool) -> None:
    rng = np.random.default_rng(7)
    scores = rng.normal(size=(50, 400)).astype(np.float32)  # 50 queries x 400 rows, 4 shards
    k = 10
    shard_d, shard_i = [], []
    for shard in range(4):
        cols = np.arange(shard, 400, 4)
        part = scores[:, cols]
        order = np.argsort(-part if higher_is_better else part, axis=1)[:, :k]
        shard_d.append(np.take_along_axis(part, order, axis=1))
        shard_i.append(cols[order])
    distances, ids = merge_topk(shard_d, shard_i, k, higher_is_better)
    expected = np.argsort(-scores if higher_is_better else scores, axis=1)[:, :k]
    np.testing.assert_array_equal(ids, expected)
    np.testing.assert_array_equal(distances, np.take_along_axis(scores, expected, axis=1))


def test_missing_results_sort_last_and_pad() -> None:
    d = [np.array([[0.5, np.inf]], np.float32), np.array([[0.1, np.inf]], np.float32)]
    i = [np.array([[3, -1]]), np.array([[8, -1]])]
    distances, ids = merge_topk(d, i, 3, higher_is_better=False)
    assert ids.tolist() == [[8, 3, -1]]
    assert distances[0, :2].tolist() == pytest.approx([0.1, 0.5])


def test_k_larger_than_candidates_pads() -> None:
    distances, ids = merge_topk([np.array([[1.0]], np.float32)], [np.array([[4]])], 3, False)
    assert ids.tolist() == [[4, -1, -1]]
    assert np.isinf(distances[0, 1:]).all()


def test_ties_keep_shard_order() -> None:
    d = [np.array([[1.0]], np.float32), np.array([[1.0]], np.float32)]
    _, ids = merge_topk(d, [np.array([[20]]), np.array([[10]])], 2, False)
    assert ids.tolist() == [[20, 10]]

@pytest.mark.parametrize("higher_is_better", [False, True])
def test_ties_by_id_order_equal_distances_as_faiss_does(higher_is_better: bool) -> None:
    """Default: equal distances keep shard order. `ties_by_id`: FAISS's heap order, id ascending
    for L2 and descending for inner product, checked against FAISS's own flat search."""
    import faiss

    base = np.array([[1.0], [1.0], [1.0], [0.0]], np.float32)  # ids 0-2 tie for any query
    index = faiss.IndexFlatIP(1) if higher_is_better else faiss.IndexFlatL2(1)
    index.add(base)
    faiss_d, faiss_i = index.search(np.array([[2.0]], np.float32), 3)
    d = [np.array([[2.0 if higher_is_better else 1.0]], np.float32)] * 3
    i = [np.array([[2]]), np.array([[0]]), np.array([[1]])]
    assert merge_topk(d, i, 3, higher_is_better)[1].tolist() == [[2, 0, 1]]
    by_id_d, by_id_i = merge_topk(d, i, 3, higher_is_better, ties_by_id=True)
    assert by_id_i.tolist() == faiss_i.tolist() and by_id_d.tolist() == faiss_d.tolist()


@pytest.mark.parametrize("higher_is_better", [False, True])
def test_an_id_in_parts_of_different_log_positions_keeps_its_newest_copy(higher_is_better: bool) -> None:
    """Shard 0 answered at position 5, before id 7 moved to shard 1 at position 6; shard 1 answered
    at 6 with its new vector. The merge keeps shard 1's copy, wherever the two rank."""
    worse = -1.0 if higher_is_better else 1.0
    old = [np.array([[0.0, 2 * worse]], np.float32), np.array([[3, 7]])]  # id 7's old copy: second
    new = [np.array([[worse, 3 * worse]], np.float32), np.array([[7, 9]])]
    distances, ids = merge_topk([old[0], new[0]], [old[1], new[1]], 4, higher_is_better, positions=[5, 6])
    assert ids.tolist() == [[3, 7, 9, -1]] and distances[0, 1] == worse
    _, reversed_ids = merge_topk([new[0], old[0]], [new[1], old[1]], 4, higher_is_better, positions=[6, 5])
    assert reversed_ids.tolist() == [[3, 7, 9, -1]]
    # at one position there is nothing to drop: the merge is the plain one
    plain = merge_topk([old[0], new[0]], [old[1], new[1]], 4, higher_is_better)
    same = merge_topk([old[0], new[0]], [old[1], new[1]], 4, higher_is_better, positions=[6, 6])
    assert plain[1].tolist() == same[1].tolist() == [[3, 7, 7, 9]]


def test_positions_drop_duplicates_row_by_row_against_brute_force() -> None:
    """Seeded: 3 parts at 3 positions with ids shared between them; each row keeps every id once,
    the copy of the part with the newest position, ranked as a merge of the kept copies."""
    rng = np.random.default_rng(11)
    nq, k = 40, 6
    parts_d = [np.sort(rng.random((nq, k)).astype(np.float32), axis=1) for _ in range(3)]
    parts_i = [rng.integers(0, 12, (nq, k)) for _ in range(3)]
    positions = [4, 9, 2]
    distances, ids = merge_topk(parts_d, parts_i, k, False, positions=positions)
    for row in range(nq):
        best: dict[int, tuple[int, float]] = {}
        for part in np.argsort(positions, kind="stable"):  # newer parts overwrite older copies
            for d, i in zip(parts_d[part][row], parts_i[part][row], strict=True):
                if int(i) not in best or best[int(i)][0] < positions[part]:
                    best[int(i)] = (positions[part], float(d))
        expected = sorted(best.items(), key=lambda item: item[1][1])[:k]
        got = [i for i in ids[row].tolist() if i >= 0]
        assert len(got) == len(set(got)) and got == [i for i, _ in expected]
