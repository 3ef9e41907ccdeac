"""How a shard searches under a metadata filter, by the share of its rows that match: the plan
(`plan_filter`), and the selector that keeps what two selectors both keep."""

from __future__ import annotations

from dataclasses import dataclass

import faiss
import numpy as np

from shardserve.index.assigner import EXACT_SHARE, FILTER_WIDEN, filtered_nprobe
from shardserve.index.indexes import unwrap_id_map
from shardserve.transport.shard_wire import ShardQuery

MAX_FILTERED_EF = 4096  # the widest HNSW search a selective filter may ask for


@dataclass(frozen=True)
class FilterPlan:
    """How a shard searches under a filter that `share` of its rows match (`answer_filtered`):
    "exact" (compare with each matching row), "routed" (the first `probe` lists of the router's
    ranking) or "search" (the index's own search at the widened `params`)."""

    kind: str
    params: dict
    probe: int = 0


def plan_filter(index: faiss.Index, plain_ivf: bool, query: ShardQuery, params: dict, share: float
                ) -> FilterPlan:
    """How a shard whose index is `index` (`plain_ivf`: a plain IVF index, one that takes the
    router's list assignments) searches a batch under a filter that `share` of its rows match.

    Up to EXACT_SHARE, the matching rows are compared one by one (their vectors gathered once
    per filter): exact, and a filter that follows the data's clusters, such as a class label,
    leaves a query's nearest lists with no match at all, so probing more of them would not be
    enough. Above it, IVF probes FILTER_WIDEN x nprobe / s lists and HNSW widens efSearch the
    same way (capped). A plain IVF shard takes those lists from the front of the router's
    ranking (CoarseAssigner.query ranks as many as any shard may take): the quantizer runs
    once per batch, in the router, as unfiltered; without one it runs its own (the same lists)."""
    params = dict(params)
    ivf = faiss.try_extract_index_ivf(unwrap_id_map(index))
    packed = _reconstructs_packed(index, ivf)
    if share <= EXACT_SHARE and not packed:  # compare with each matching row: none is missed
        return FilterPlan("exact", params)
    if ivf is not None:
        # fast-scan lists hold their codes packed in blocks, and FAISS's reconstruct of a loaded
        # one crashes the process (1.15): its matching rows are found by probing every list instead
        probe = (int(ivf.nlist) if packed and share <= EXACT_SHARE
                 else filtered_nprobe(params.get("nprobe", int(ivf.nprobe)), share, int(ivf.nlist)))
        params["nprobe"] = probe
        if (plain_ivf and query.assign is not None and query.coarse is not None
                and query.assign.shape[1] >= probe):
            return FilterPlan("routed", params, probe)
    elif isinstance(unwrap_id_map(index), faiss.IndexHNSW):
        wanted = params.get("efSearch", int(unwrap_id_map(index).hnsw.efSearch))  # type: ignore[attr-defined]
        params["efSearch"] = min(MAX_FILTERED_EF, int(np.ceil(FILTER_WIDEN * wanted / share)))
    return FilterPlan("search", params)


def both_selected(first: faiss.IDSelector, second: faiss.IDSelector) -> faiss.IDSelector:
    """What both selectors keep. FAISS's IDSelectorAnd holds raw pointers to the two: the Python
    object references them, so they live at least as long as it does."""
    both = faiss.IDSelectorAnd(first, second)
    both.referenced_objects = [first, second]  # type: ignore[attr-defined]
    return both


def _reconstructs_packed(index: faiss.Index, ivf: faiss.IndexIVF | None) -> bool:
    """Would reading a row's vector back (reconstruct) decode fast-scan lists? A refine step reads
    its own stored vectors instead; any other index holding fast-scan lists decodes them."""
    if ivf is None or not isinstance(faiss.downcast_index(ivf), faiss.IndexIVFFastScan):
        return False
    return not isinstance(faiss.downcast_index(unwrap_id_map(index)), faiss.IndexRefine)
