// A list-by-list IVF-Flat (L2) scan blocked for the cache, measured against FAISS's own in
// lab/blocked_scan.py. Not product code: it did not beat FAISS (docs/experiments.md).
//
// Each list is read in blocks of `block` vectors; every (query, list) pair of the batch that probes
// the list scans a block while it is in L1, so a list is read from memory once per batch. Distances
// are first computed with a 4-accumulator AVX2 loop; only a vector whose approximate distance could
// beat the pair's heap top is measured again with FAISS's own fvec_L2sqr (passed in as `exact`) and
// offered to a copy of FAISS's heap, so every pair keeps exactly what FAISS keeps.
//
// Why the filter is exact: both sums add the same d non-negative squares of the same rounded
// differences, in different orders and with or without FMA, so each is within gamma_{d+1} * s of the
// true sum s (u = 2^-24, gamma_n = n u / (1 - n u)); REL below bounds their difference, with room.
#include <cfloat>
#include <cstddef>
#include <cstdint>

typedef float (*distance_fn)(const float*, const float*, size_t);
typedef float v8 __attribute__((vector_size(32)));
#define LOAD(p) ({ v8 v_; __builtin_memcpy(&v_, (p), sizeof v_); v_; })
#define HSUM(v) ((((v)[0] + (v)[4]) + ((v)[1] + (v)[5])) + (((v)[2] + (v)[6]) + ((v)[3] + (v)[7])))

namespace {

// faiss/utils/Heap.h's max-heap (CMax<float, int64_t>): the top is the worst kept.
inline bool worse(float a1, float b1, int64_t a2, int64_t b2) { return a1 > b1 || (a1 == b1 && a2 > b2); }

void replace_top(size_t k, float* bv, int64_t* bi, float val, int64_t id) {
    bv--; bi--;
    size_t i = 1;
    for (;;) {
        size_t i1 = i << 1, i2 = i1 + 1;
        if (i1 > k) break;
        if (i2 == k + 1 || worse(bv[i1], bv[i2], bi[i1], bi[i2])) {
            if (worse(val, bv[i1], id, bi[i1])) break;
            bv[i] = bv[i1]; bi[i] = bi[i1]; i = i1;
        } else {
            if (worse(val, bv[i2], id, bi[i2])) break;
            bv[i] = bv[i2]; bi[i] = bi[i2]; i = i2;
        }
    }
    bv[i] = val; bi[i] = id;
}

void reorder(size_t k, float* bv, int64_t* bi) {  // faiss::heap_reorder: best first, missing last
    size_t kept = 0;
    for (size_t i = 0; i < k; i++) {
        float val = bv[0]; int64_t id = bi[0];
        replace_top(k - i - 1, bv, bi, bv[k - i - 1], bi[k - i - 1]);
        bv[k - kept - 1] = val; bi[k - kept - 1] = id;
        if (id != -1) kept++;
    }
    for (size_t i = 0; i < kept; i++) { bv[i] = bv[k - kept + i]; bi[i] = bi[k - kept + i]; }
    for (size_t i = kept; i < k; i++) { bv[i] = FLT_MAX; bi[i] = -1; }
}

__attribute__((target("avx2,fma"))) float approx(const float* q, const float* y, int64_t d) {
    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int64_t i = 0;
    for (; i + 32 <= d; i += 32) {
        v8 t0 = LOAD(q + i) - LOAD(y + i), t1 = LOAD(q + i + 8) - LOAD(y + i + 8);
        v8 t2 = LOAD(q + i + 16) - LOAD(y + i + 16), t3 = LOAD(q + i + 24) - LOAD(y + i + 24);
        a0 += t0 * t0; a1 += t1 * t1; a2 += t2 * t2; a3 += t3 * t3;
    }
    for (; i < d; i += 8) { v8 t = LOAD(q + i) - LOAD(y + i); a0 += t * t; }
    v8 a = (a0 + a1) + (a2 + a3);
    return HSUM(a);
}

}  // namespace

// Pairs sorted by list: group g is list group_list[g], pairs group_start[g] .. group_start[g+1]-1,
// pair p the query row pair_row[p]. Lists are (codes, ids, size) by list number. Writes each pair's
// k best (distance, id), FAISS's order, and returns how many vectors were measured exactly.
extern "C" __attribute__((target("avx2,fma"))) int64_t blocked_scan_l2(int64_t groups, const int64_t* group_list, const int64_t* group_start,
                                   const int64_t* pair_row, const float* queries, int64_t d,
                                   const uint64_t* codes, const uint64_t* ids, const int64_t* sizes,
                                   int64_t k, distance_fn exact, int64_t block, float* out_d, int64_t* out_i) {
    if (d % 8 != 0) return -1;
    const float rel = (float)(4.0 * (double)(d + 2) / 16777216.0), tiny = (float)(d + 2) * FLT_MIN * 4;
    int64_t measured = 0;
    for (int64_t g = 0; g < groups; g++) {
        const int64_t list = group_list[g], p0 = group_start[g], p1 = group_start[g + 1], size = sizes[list];
        const float* vectors = reinterpret_cast<const float*>(codes[list]);
        const int64_t* list_ids = reinterpret_cast<const int64_t*>(ids[list]);
        for (int64_t p = p0 * k; p < p1 * k; p++) { out_d[p] = FLT_MAX; out_i[p] = -1; }
        for (int64_t j0 = 0; j0 < size; j0 += block) {
            const int64_t j1 = j0 + block < size ? j0 + block : size;
            for (int64_t p = p0; p < p1; p++) {
                const float* q = queries + pair_row[p] * d;
                float* top_d = out_d + p * k;
                int64_t* top_i = out_i + p * k;
                for (int64_t j = j0; j < j1; j++) {
                    const float a = approx(q, vectors + j * d, d);
                    if (a - (a * rel + tiny) < top_d[0]) {  // FAISS's value may beat the top: measure it
                        const float dis = exact(q, vectors + j * d, (size_t)d);
                        measured++;
                        if (top_d[0] > dis) replace_top((size_t)k, top_d, top_i, dis, list_ids[j]);
                    }
                }
            }
        }
        for (int64_t p = p0; p < p1; p++) reorder((size_t)k, out_d + p * k, out_i + p * k);
    }
    return measured;
}
