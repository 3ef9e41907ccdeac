"""`shardserve build --index auto`: pick a FAISS factory from the number of vectors, their dimension
and a memory budget, the way autofaiss does (coarse lists ~4·sqrt(N), codes sized to the budget).

The rule, first that fits (bytes per vector = budget / N, ids included):
  1. N <= 20,000: `Flat` (exact; a scan of that many is cheap);
  2. N < 1M and 4·d + 8 bytes fit: `IVF{nlist},Flat` (exact codes, only the lists are approximate);
  3. d + M/2 + 8 bytes fit: `IVF{nlist},PQ{M}x4fs,Refine(SQ8)` (4-bit fast-scan codes searched with
     SIMD, the top candidates re-ranked on 8-bit scalar codes: the millions-of-vectors recipe);
  4. M/2 + 8 bytes fit: `IVF{nlist},PQ{M}x4fs` (no refine: lower recall);
  otherwise the budget is refused, saying what the data needs.
nlist = the power of two nearest 4·sqrt(N), within [16, 65536] and at most N / 39 (k-means wants
39+ training points per list); M = the largest even divisor of d that is at most d / 4.
Plain Python: unit-tested without FAISS searching anything.
"""

from __future__ import annotations

import math
import re

from shardserve.errors import ShardserveError

DEFAULT_MEMORY_BUDGET = 4 * 2**30  # bytes the whole index may take, when the user says nothing
ID_BYTES = 8
FLAT_MAX = 20_000
IVF_FLAT_MAX = 1_000_000
HEADROOM = 1.1  # lists, quantizer and allocator slack on top of the codes


def parse_bytes(text: str) -> int:
    """`4GB`, `512MiB`, `1e9` → bytes (powers of 1024 for every unit)."""
    match = re.fullmatch(r"\s*([0-9.e+]+)\s*([kmgt]?i?b?)?\s*", text.lower())
    units = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    try:
        value = float(match.group(1)) if match else -1.0
    except ValueError:
        value = -1.0
    unit = (match.group(2) or "").rstrip("b").rstrip("i") if match else ""
    if value <= 0 or unit not in units:
        raise ShardserveError(f"--memory-budget: cannot read {text!r} (e.g. 4GB, 512MB)")
    return int(value * units[unit])


def nlist_for(num_vectors: int) -> int:
    target = 4 * math.sqrt(num_vectors)
    nlist = 2 ** round(math.log2(max(target, 1)))
    return max(16, min(nlist, 65536, 2 ** int(math.log2(max(num_vectors // 39, 1)))))


def pq_m_for(dim: int) -> int:
    candidates = [m for m in range(2, dim // 4 + 1, 2) if dim % m == 0]
    if not candidates:
        raise ShardserveError(f"dim {dim} has no even divisor <= dim/4 for PQ codes: give --index yourself")
    return candidates[-1]


def choose_factory(num_vectors: int, dim: int, memory_bytes: int) -> tuple[str, str]:
    """(factory, why) for N vectors of `dim` floats within `memory_bytes` for the whole index."""
    per_vector = memory_bytes / HEADROOM / max(num_vectors, 1)
    flat = 4 * dim + ID_BYTES
    if num_vectors <= FLAT_MAX and flat <= per_vector:
        return "Flat", f"{num_vectors} vectors: an exact scan is cheap"
    nlist = nlist_for(num_vectors)
    if num_vectors < IVF_FLAT_MAX and flat <= per_vector:
        return f"IVF{nlist},Flat", f"float codes fit ({flat} of {per_vector:.0f} bytes per vector)"
    m = pq_m_for(dim)
    refined = dim + m / 2 + ID_BYTES
    if refined <= per_vector:
        return (f"IVF{nlist},PQ{m}x4fs,Refine(SQ8)",
                f"fast-scan codes + 8-bit refine ({refined:.0f} of {per_vector:.0f} bytes per vector)")
    codes = m / 2 + ID_BYTES
    if codes <= per_vector:
        return (f"IVF{nlist},PQ{m}x4fs",
                f"only 4-bit codes fit ({codes:.0f} of {per_vector:.0f} bytes per vector): lower recall")
    need = codes * HEADROOM * num_vectors
    raise ShardserveError(f"--memory-budget {memory_bytes} bytes is too small for {num_vectors} vectors "
                          f"of dim {dim}: the smallest codes need about {need / 2**30:.2f} GiB")
