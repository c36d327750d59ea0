// The mdci pager's common decode insert for every KV head of a layer in one call: per head, icecache/indexes/
// dci_decode_insert.py `_leaf_stored` step for step. MD's level schedule advances by one; a level-0 point whose
// squared norm is within the tree's msq gets `dci_update._insert_leaf`'s edits (its rows and lift, the brute-force
// MIPS parent among level 1, its entries in the parent cluster's sorted runs, the descendant counts up the path,
// and a slot in its run-0 neighbour's page when that page has room); when the page has a host block, the token's
// K and V rows are written into the store. Every other outcome stops where the numba kernel stops, and the caller
// finishes it in Python. Compiled for the x86-64 baseline; heads run one after the other (each is a few us).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels.h"

namespace {

constexpr int64_t kLeafDone = 0, kLeafNeedsCluster = 1, kLeafPageFull = 2;  // dci_update's outcomes
constexpr int64_t kLeafStored = 3, kNotALeaf = 4;                              // dci_decode_insert's

template <typename T>
T* at(int64_t address) {
    return reinterpret_cast<T*>(address);
}

// MD's deterministic level schedule for one more point (_dci_edit_kernels.md_schedule with n = 1).
void md_schedule(int64_t* counts, int64_t* nxt, double p0, double p1, int64_t cap0, int64_t cap1, int64_t& level,
                 bool& new_top) {
    const int64_t t = nxt[0];
    const int64_t h = counts[63];
    if (t == h) {
        counts[t] = 1;
        counts[63] = h + 1;
        nxt[0] = 0;
        level = t;
        new_top = true;
        return;
    }
    counts[t] += 1;
    level = t;
    new_top = false;
    if (t == h - 1) {
        const int64_t cap = t == 0 ? cap0 : cap1;
        nxt[0] = counts[t] == cap ? t + 1 : 0;
    } else {
        const double p = t == 0 ? p0 : p1;
        nxt[0] = static_cast<double>(counts[t]) >= static_cast<double>(counts[t + 1]) / p ? t + 1 : 0;
    }
}

}  // namespace

extern "C" {

// desc [heads, 34] int64 per head (addresses unless said): 0 schedule counts (int64 [64]), 1 schedule next
// (int64 [1]), 2 cap0, 3 cap1 (values), 4 the point's id (value), 5 level-1 ids (int64), 6 their count (value),
// 7 level-1 keys (f32 [m, dim]), 8 level-1 lifts (f32), 9 X (f32 [cap, dim]), 10 ext (f32), 11 proj (f32 [cap, M]),
// 12 dirs (f64 [M, dp]), 13 M, 14 dp (values), 15 level_of (int32), 16 parent_of (int64), 17 parent_dist (f64),
// 18 num_descendants, 19 cluster_start, 20 cluster_size, 21 cluster_cap (int64), 22 run_key (f32 [M, S]),
// 23 run_id (int32 [M, S]), 24 S (value), 25 Xr (f32 [S, dim]), 26 page_of, 27 slot_of (int64), 28 members
// (int64 [ids, page_size]), 29 sizes (int64), 30 page_size (value), 31 the store's rows ([R, 2] rows of row_bytes),
// 32 block_of (int64), 33 its length (value).
// reals [heads, 4]: p0, p1, the key's squared norm (float64, as numpy sums it), msq.
// keys [heads, dim] float32; new_k / new_v [heads, row_bytes] (the store's element type).
// out [heads, 7] int64: status, level, new_top, parent, page, slot, neighbour (dci_decode_insert's `_leaf_stored`).
void ice_layer_dci_leaf_insert(int64_t heads, const int64_t* desc, const double* reals, const float* keys, int64_t dim,
                               const uint8_t* new_k, const uint8_t* new_v, int64_t row_bytes, int64_t* out) {
    const IceIsaKernels& isa = ice_active_kernels();
    thread_local std::vector<double> xd;
    xd.resize(dim);
    for (int64_t h = 0; h < heads; ++h) {
        const int64_t* d = desc + 34 * h;
        const double* r = reals + 4 * h;
        int64_t* o = out + 7 * h;
        const int64_t point = d[4];
        int64_t level = 0;
        bool new_top = false;
        md_schedule(at<int64_t>(d[0]), at<int64_t>(d[1]), r[0], r[1], d[2], d[3], level, new_top);
        const double msq = r[3];
        o[1] = level;
        o[2] = new_top;
        o[3] = o[4] = o[5] = o[6] = -1;
        if (level != 0 || new_top || r[2] > msq) {
            o[0] = kNotALeaf;
            continue;
        }
        // ---- the point's rows and lift (DCITree.lift_point: float64 sums in index order, stored float32)
        float* X = at<float>(d[9]);
        float* ext = at<float>(d[10]);
        float* proj = at<float>(d[11]);
        const double* dirs = at<const double>(d[12]);
        const int64_t M = d[13], dp = d[14];
        const float* key = keys + h * dim;
        float* x = X + point * dim;
        std::memcpy(x, key, dim * sizeof(float));
        at<int32_t>(d[15])[point] = 0;
        int64_t* parent_of = at<int64_t>(d[16]);
        double* parent_dist = at<double>(d[17]);
        int64_t* num_desc = at<int64_t>(d[18]);
        int64_t* cl_start = at<int64_t>(d[19]);
        int64_t* cl_size = at<int64_t>(d[20]);
        int64_t* cl_cap = at<int64_t>(d[21]);
        parent_of[point] = -1;
        parent_dist[point] = std::numeric_limits<double>::infinity();
        num_desc[point] = 0;
        cl_start[point + 1] = cl_size[point + 1] = cl_cap[point + 1] = 0;
        double sq = 0.0;
        for (int64_t i = 0; i < dim; ++i) sq += static_cast<double>(x[i]) * static_cast<double>(x[i]);
        const double lifted = std::sqrt(std::max(msq - sq, 0.0));
        ext[point] = static_cast<float>(lifted);
        float* point_proj = proj + point * M;
        for (int64_t m = 0; m < M; ++m) {
            double s = 0.0;
            for (int64_t i = 0; i < dim; ++i) s += static_cast<double>(x[i]) * dirs[m * dp + i];
            s += lifted * dirs[m * dp + dim];
            point_proj[m] = static_cast<float>(s);
        }
        // ---- the brute-force MIPS parent among level 1 (mips_distance: msq - <x, u> - ext_x ext_u, clamped at 0)
        const int64_t* upper = at<const int64_t>(d[5]);
        const int64_t m1 = d[6];
        const float* upper_x = at<const float>(d[7]);
        const float* upper_ext = at<const float>(d[8]);
        for (int64_t i = 0; i < dim; ++i) xd[i] = static_cast<double>(x[i]);
        const double ext_x = static_cast<double>(ext[point]);
        int64_t parent = -1;
        double best = std::numeric_limits<double>::infinity();
        double dot = 0.0;
        for (int64_t i = 0; i < m1; ++i) {
            isa.group_dots_f64(upper_x + i * dim, xd.data(), 1, dim, &dot);
            double s = msq - dot - ext_x * static_cast<double>(upper_ext[i]);
            if (s < 0.0) s = 0.0;
            if (s < best) {
                best = s;
                parent = upper[i];
            }
        }
        parent_dist[point] = best;
        parent_of[point] = parent;
        o[3] = parent;
        const int64_t cid = parent + 1;
        const int64_t size = cl_size[cid];
        if (size == 0 || size == cl_cap[cid]) {
            o[0] = kLeafNeedsCluster;
            continue;
        }
        // ---- the parent cluster's sorted runs (by (key, id)) and Xr in run-0 order (cluster_insert)
        const int64_t start = cl_start[cid];
        float* run_key = at<float>(d[22]);
        int32_t* run_id = at<int32_t>(d[23]);
        const int64_t S = d[24];
        float* Xr = at<float>(d[25]);
        int64_t pos0 = 0;
        for (int64_t j = 0; j < M; ++j) {
            float* rk = run_key + j * S + start;
            int32_t* ri = run_id + j * S + start;
            const float kv = point_proj[j];
            int64_t lo = 0, hi = size;
            while (lo < hi) {
                const int64_t mid = (lo + hi) >> 1;
                if (rk[mid] < kv || (rk[mid] == kv && ri[mid] < point)) lo = mid + 1;
                else hi = mid;
            }
            for (int64_t a = size; a > lo; --a) {
                rk[a] = rk[a - 1];
                ri[a] = ri[a - 1];
            }
            rk[lo] = kv;
            ri[lo] = static_cast<int32_t>(point);
            if (j == 0) {
                pos0 = lo;
                float* xr = Xr + start * dim;
                std::memmove(xr + (lo + 1) * dim, xr + lo * dim, (size - lo) * dim * sizeof(float));
                std::memcpy(xr + lo * dim, x, dim * sizeof(float));
            }
        }
        cl_size[cid] = size + 1;
        for (int64_t node = parent; node >= 0; node = parent_of[node]) num_desc[node] += 1;
        // ---- a slot in the run-0 neighbour's page
        const int64_t neighbour = pos0 > 0 ? run_id[start + pos0 - 1] : run_id[start + 1];
        o[6] = neighbour;
        int64_t* page_of = at<int64_t>(d[26]);
        int64_t* slot_of = at<int64_t>(d[27]);
        int64_t* members = at<int64_t>(d[28]);
        int64_t* sizes = at<int64_t>(d[29]);
        const int64_t page_size = d[30];
        const int64_t page = page_of[neighbour];
        const int64_t slot = sizes[page];
        o[4] = page;
        if (slot >= page_size) {
            o[0] = kLeafPageFull;
            continue;
        }
        members[page * page_size + slot] = point;
        sizes[page] = slot + 1;
        page_of[point] = page;
        slot_of[point] = slot;
        o[5] = slot;
        o[0] = kLeafDone;
        // ---- the host store's rows, when the page has a block
        const int64_t* block_of = at<const int64_t>(d[32]);
        if (page < d[33] && block_of[page] >= 0) {
            uint8_t* rows = at<uint8_t>(d[31]);
            const int64_t row = block_of[page] * page_size + slot;
            std::memcpy(rows + (2 * row) * row_bytes, new_k + h * row_bytes, row_bytes);
            std::memcpy(rows + (2 * row + 1) * row_bytes, new_v + h * row_bytes, row_bytes);
            o[0] = kLeafStored;
        }
    }
}

}  // extern "C"
