// The mdci pager's page ranking for every KV head of a layer in one call: per head, the query projections, one
// cumulative MIPS field-of-view descent of its DCI tree and the page ranking (docs/index.md, Query descent). The
// algorithm is icecache/indexes/_dci_kernels.py's `rank_pages` step for step (the same stamps, the same beam and
// coverage rules, the same tie orders); token scores are float64 sums of the float32 keys, as there, in the ISA
// table's fixed order (`group_dots_f64`). Compiled for the x86-64 baseline; heads run on OpenMP threads.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "kernels.h"

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// One head's tree and page table (addresses from Python; see library.py `DCI_TREE_FIELDS`).
struct Tree {
    const float* X;          // [cap, dim] keys by token id
    const float* Xr;         // [S, dim] keys in run-0 slab order
    const float* run_key;    // [M, S] projections, sorted per cluster
    const int32_t* run_id;   // [M, S] token id of each run entry
    const int64_t* cl_start; // [cap + 1] cluster c starts at run position cl_start[c]
    const int64_t* cl_size;  // [cap + 1]
    const int64_t* sub;      // [cap] descendants of each node
    const double* dirs;      // [M, dirs_stride] projection directions
    const int64_t* page_of;  // [>= num_points] page of each token
    const int64_t* page_sizes;  // [num_page_ids]
    int64_t S, dirs_stride, top_level, F, num_page_ids;
    double norm_c, scale;
};

// One head's search scratch (Python's `Scratch`: stamp-tagged, never cleared).
struct Work {
    int32_t* cnt;
    int64_t cnt_stride;
    int64_t* cnt_stamp;
    int64_t* cand_stamp;
    int64_t* eval_stamp;
    double* dist;
    int64_t* stamp;
    int64_t* pool;
    double* gsc;
    int64_t gsc_stride;
    double* page_best;
    int64_t* page_stamp;
    int64_t* page_list;
    int64_t* out_pages;
    double* out_scores;
};

struct Limits {
    int64_t L, m, num_to_visit;
    double prop_to_visit;
    int64_t num_to_retrieve;
    double prop_to_retrieve;
};

// Per-thread buffers, grown on demand and kept (no allocation per call once warm).
struct Local {
    std::vector<double> qd, qp, seg_d, prio;
    std::vector<int64_t> expand, next, order, lcur, rcur, cur, ivl, ivl_order;
    std::vector<char> chosen;
};

Local& local() {
    thread_local Local buffers;
    return buffers;
}

struct Search {
    const Tree& tree;
    Work& work;
    const Limits& lim;
    const IceIsaKernels& isa;
    const double* qd;  // [G, dim] the queries in float64
    const double* qp;  // [G, M] their projections
    int64_t G, dim, M;
    Local& buf;

    // Token at run row r of A: every query's <q_g, key> into gsc[row], and the distance -max_g.
    double evaluate(const float* A, int64_t r, int64_t row) const {
        return -isa.group_dots_f64(A + r * dim, qd, G, dim, work.gsc + row * work.gsc_stride);
    }

    int64_t visit_limit(int64_t c) const {
        const int64_t prop = lim.prop_to_visit >= 0 ? static_cast<int64_t>(std::ceil(lim.prop_to_visit * c * lim.m)) : -1;
        return std::max(lim.num_to_visit * lim.m, prop);
    }

    int64_t retrieve_limit(int64_t c) const {
        const int64_t prop = lim.prop_to_retrieve >= 0 ? static_cast<int64_t>(std::ceil(lim.prop_to_retrieve * c)) : -1;
        return std::max(lim.num_to_retrieve, prop);
    }

    // A search of a c-member cluster would end only with every member a candidate.
    bool takes_all(int64_t c, int64_t kk) const {
        if (kk >= c) return true;
        return retrieve_limit(c) >= c && visit_limit(c) >= c * lim.m;
    }

    // Number of keys of run j in [start, start + c) strictly below qp.
    int64_t lower_bound(int64_t j, int64_t start, int64_t c, double qp_j) const {
        const float* keys = tree.run_key + j * tree.S + start;
        int64_t lo = 0, hi = c;
        while (lo < hi) {
            const int64_t mid = (lo + hi) >> 1;
            if (static_cast<double>(keys[mid]) < qp_j) lo = mid + 1;
            else hi = mid;
        }
        return lo;
    }

    // Offer the next element of simple index j: the closer of the two cursor neighbours (ties left).
    void choose(int64_t j, int64_t start, int64_t c, double qp_j) const {
        int64_t* lcur = buf.lcur.data();
        int64_t* rcur = buf.rcur.data();
        const bool have_l = lcur[j] >= 0;
        const bool have_r = rcur[j] < c;
        if (!have_l && !have_r) {
            buf.cur[j] = -1;
            buf.prio[j] = kInf;
            return;
        }
        const float* keys = tree.run_key + j * tree.S + start;
        const double gl = have_l ? std::fabs(qp_j - static_cast<double>(keys[lcur[j]])) : kInf;
        const double gr = have_r ? std::fabs(static_cast<double>(keys[rcur[j]]) - qp_j) : kInf;
        if (gr < gl) {
            buf.cur[j] = rcur[j]++;
            buf.prio[j] = gr;
        } else {
            buf.cur[j] = lcur[j]--;
            buf.prio[j] = gl;
        }
    }

    // Prioritized search of cluster cidx (a partial one: the caller scores clusters it would take whole).
    int64_t search_cluster(int64_t cidx, int64_t kk, int64_t cover, int64_t desc_stamp, int64_t pool_n) const {
        const int64_t start = tree.cl_start[cidx];
        const int64_t c = tree.cl_size[cidx];
        if (c == 0) return pool_n;
        const int64_t vlimit = visit_limit(c);
        const int64_t rlimit = retrieve_limit(c);
        const int64_t kk_eff = kk < c ? kk : c;
        if (M == 1) {
            // Every visited point is a candidate: each query's candidates are an interval of run 0.
            int64_t take = std::min(vlimit, rlimit);
            if (take < kk_eff) take = kk_eff;
            if (take > c) take = c;
            buf.ivl.resize(2 * G);
            const float* keys = tree.run_key + start;
            const int32_t* ids = tree.run_id + start;
            for (int64_t g = 0; g < G; ++g) {
                const double q = qp[g * M];
                const int64_t lo = lower_bound(0, start, c, q);
                int64_t left = lo - 1, right = lo, taken = 0, covered = 0;
                while (taken < c && (taken < take || covered < cover)) {
                    if (right >= c || (left >= 0 && !(std::fabs(static_cast<double>(keys[right]) - q) <
                                                      std::fabs(q - static_cast<double>(keys[left]))))) {
                        covered += tree.sub[ids[left]];
                        --left;
                    } else {
                        covered += tree.sub[ids[right]];
                        ++right;
                    }
                    ++taken;
                }
                buf.ivl[2 * g] = left + 1;
                buf.ivl[2 * g + 1] = right;
            }
            // The union of the intervals, scored once in run order (equal starts: either order gives the union).
            buf.ivl_order.resize(G);
            std::iota(buf.ivl_order.begin(), buf.ivl_order.end(), 0);
            std::sort(buf.ivl_order.begin(), buf.ivl_order.end(),
                      [&](int64_t a, int64_t b) { return buf.ivl[2 * a] < buf.ivl[2 * b]; });
            int64_t reach = 0;
            for (int64_t oi = 0; oi < G; ++oi) {
                int64_t a = buf.ivl[2 * buf.ivl_order[oi]];
                const int64_t b = buf.ivl[2 * buf.ivl_order[oi] + 1];
                if (a < reach) a = reach;
                for (int64_t i = a; i < b; ++i) {
                    work.pool[pool_n] = ids[i];
                    work.dist[pool_n] = evaluate(tree.Xr, start + i, pool_n);
                    ++pool_n;
                }
                if (b > reach) reach = b;
            }
            return pool_n;
        }
        buf.lcur.resize(M);
        buf.rcur.resize(M);
        buf.cur.resize(M);
        buf.prio.resize(M);
        const int64_t L = lim.L, m = lim.m;
        for (int64_t g = 0; g < G; ++g) {
            const int64_t s = ++work.stamp[0];
            for (int64_t j = 0; j < M; ++j) {
                const int64_t lo = lower_bound(j, start, c, qp[g * M + j]);
                buf.lcur[j] = lo - 1;
                buf.rcur[j] = lo;
                choose(j, start, c, qp[g * M + j]);
            }
            int64_t ncand = 0, covered = 0;
            for (int64_t r = 0; r < c * m; ++r) {
                for (int64_t comp = 0; comp < L; ++comp) {
                    int64_t h = -1;
                    double best = kInf;
                    for (int64_t jj = 0; jj < m; ++jj) {
                        const int64_t j = comp * m + jj;
                        if (buf.prio[j] < best) {
                            best = buf.prio[j];
                            h = j;
                        }
                    }
                    if (h < 0) continue;
                    const int64_t t = tree.run_id[h * tree.S + start + buf.cur[h]];
                    int32_t* counts = work.cnt + t * work.cnt_stride;
                    if (work.cnt_stamp[t] != s) {
                        work.cnt_stamp[t] = s;
                        for (int64_t cc = 0; cc < L; ++cc) counts[cc] = 0;
                    }
                    counts[comp] += 1;
                    if (counts[comp] == m && work.cand_stamp[t] != s) {
                        work.cand_stamp[t] = s;
                        ++ncand;
                        covered += tree.sub[t];
                        if (work.eval_stamp[t] != desc_stamp) {
                            work.eval_stamp[t] = desc_stamp;
                            work.pool[pool_n] = t;
                            work.dist[pool_n] = evaluate(tree.X, t, pool_n);
                            ++pool_n;
                        }
                    }
                    choose(h, start, c, qp[g * M + h]);
                }
                if (ncand >= kk_eff && covered >= cover && (r + 1 >= vlimit || ncand >= rlimit)) break;
            }
        }
        return pool_n;
    }

    // The cumulative descent from the root to level 0; returns the pool length (every evaluated token).
    int64_t descend(int64_t kk, int64_t cover, bool per_query_beam) const {
        const int64_t desc_stamp = ++work.stamp[0];
        buf.expand.assign(1, -1);
        int64_t pool_n = 0;
        for (int64_t lev = tree.top_level; lev >= 0; --lev) {
            const int64_t seg0 = pool_n;
            const int64_t k_here = lev == 0 ? kk : tree.F;
            const int64_t cover_here = lev != 0 ? cover : 0;
            for (const int64_t node : buf.expand) {
                const int64_t cidx = node + 1;
                const int64_t c = tree.cl_size[cidx];
                if (takes_all(c, k_here)) {
                    const int64_t start = tree.cl_start[cidx];
                    for (int64_t i = 0; i < c; ++i) {
                        work.pool[pool_n] = tree.run_id[start + i];
                        work.dist[pool_n] = evaluate(tree.Xr, start + i, pool_n);
                        ++pool_n;
                    }
                    continue;
                }
                pool_n = search_cluster(cidx, k_here, cover_here, desc_stamp, pool_n);
            }
            if (lev == 0) break;
            const int64_t n_seg = pool_n - seg0;
            if (n_seg == 0) break;
            // Each query keeps its own beam (per_query_beam) or the group keeps one; the union is expanded.
            const int64_t beams = per_query_beam ? G : 1;
            const int64_t keep_f = tree.F < n_seg ? tree.F : n_seg;
            buf.chosen.assign(n_seg, 0);
            buf.seg_d.resize(n_seg);
            buf.order.resize(n_seg);
            for (int64_t g = 0; g < beams; ++g) {
                for (int64_t i = 0; i < n_seg; ++i)
                    buf.seg_d[i] = beams == 1 ? work.dist[seg0 + i] : -work.gsc[(seg0 + i) * work.gsc_stride + g];
                std::iota(buf.order.begin(), buf.order.end(), 0);
                std::stable_sort(buf.order.begin(), buf.order.end(),
                                 [&](int64_t a, int64_t b) { return buf.seg_d[a] < buf.seg_d[b]; });
                int64_t covered = 0;
                for (int64_t i = 0; i < n_seg; ++i) {
                    if (i >= keep_f && covered >= cover) break;
                    buf.chosen[buf.order[i]] = 1;
                    covered += tree.sub[work.pool[seg0 + buf.order[i]]];
                }
            }
            buf.next.clear();
            for (int64_t i = 0; i < n_seg; ++i)
                if (buf.chosen[i]) buf.next.push_back(work.pool[seg0 + i]);
            buf.expand.swap(buf.next);
        }
        return pool_n;
    }
};

// Page p ranks before page q: higher score, ties by smaller id.
inline bool page_before(int64_t p, int64_t q, const double* best) {
    return best[p] > best[q] || (best[p] == best[q] && p < q);
}

void sift_down(int64_t* heap, int64_t i, int64_t k, const double* best) {
    while (true) {
        int64_t w = i;
        const int64_t a = 2 * i + 1, b = a + 1;
        if (a < k && page_before(heap[a], heap[w], best)) w = a;
        if (b < k && page_before(heap[b], heap[w], best)) w = b;
        if (w == i) return;
        std::swap(heap[i], heap[w]);
        i = w;
    }
}

// One head: projections, descent, page scores, then pages best first while they fit in `budget`.
int64_t rank_head(const Tree& tree, Work& work, const Limits& lim, const float* queries, int64_t G, int64_t dim,
                  int64_t kk, int64_t cover, bool per_query_beam, int64_t budget, bool mass) {
    Local& buf = local();
    const int64_t M = lim.L * lim.m;
    buf.qd.resize(G * dim);
    buf.qp.resize(G * M);
    for (int64_t g = 0; g < G; ++g) {
        const float* q = queries + g * dim;
        double norm = 0.0;
        for (int64_t i = 0; i < dim; ++i) {
            buf.qd[g * dim + i] = static_cast<double>(q[i]);
            norm += static_cast<double>(q[i]) * static_cast<double>(q[i]);
        }
        norm = std::sqrt(norm);
        const double sc = norm > 0.0 ? tree.norm_c / norm : 0.0;
        for (int64_t j = 0; j < M; ++j) {
            const double* dir = tree.dirs + j * tree.dirs_stride;
            double v = 0.0;
            for (int64_t i = 0; i < dim; ++i) v += static_cast<double>(q[i]) * dir[i];
            buf.qp[g * M + j] = v * sc;
        }
    }
    const Search search{tree, work, lim, ice_active_kernels(), buf.qd.data(), buf.qp.data(), G, dim, M, buf};
    const int64_t hi = search.descend(kk, cover, per_query_beam);
    double best_g[64];
    std::vector<double> best_big;
    double* top = best_g;
    if (G > 64) {
        best_big.resize(G);
        top = best_big.data();
    }
    for (int64_t g = 0; g < G; ++g) top[g] = -kInf;
    if (mass)
        for (int64_t i = 0; i < hi; ++i)
            for (int64_t g = 0; g < G; ++g) top[g] = std::max(top[g], work.gsc[i * work.gsc_stride + g]);
    const int64_t s = ++work.stamp[0];
    int64_t npg = 0;
    for (int64_t i = 0; i < hi; ++i) {
        const int64_t p = tree.page_of[work.pool[i]];
        double sc;
        if (mass) {
            sc = 0.0;
            for (int64_t g = 0; g < G; ++g) sc += std::exp(tree.scale * (work.gsc[i * work.gsc_stride + g] - top[g]));
        } else {
            sc = -work.dist[i];
        }
        if (work.page_stamp[p] != s) {
            work.page_stamp[p] = s;
            work.page_best[p] = sc;
            work.page_list[npg++] = p;
        } else if (mass) {
            work.page_best[p] += sc;
        } else if (sc > work.page_best[p]) {
            work.page_best[p] = sc;
        }
    }
    int64_t* heap = work.page_list;
    for (int64_t i = npg / 2 - 1; i >= 0; --i) sift_down(heap, i, npg, work.page_best);
    int64_t total = 0, k = 0, left = npg;
    while (left > 0) {
        const int64_t p = heap[0];
        const int64_t size = tree.page_sizes[p];
        if (total + size > budget) return k;
        heap[0] = heap[left - 1];
        sift_down(heap, 0, left - 1, work.page_best);
        --left;
        total += size;
        work.out_pages[k] = p;
        work.out_scores[k] = work.page_best[p];
        ++k;
    }
    // Every scored page fits: the pages the descent did not reach follow, by id, with score -inf.
    for (int64_t p = 0; p < tree.num_page_ids; ++p) {
        const int64_t size = tree.page_sizes[p];
        if (size <= 0 || work.page_stamp[p] == s) continue;
        if (total + size > budget) break;
        total += size;
        work.out_pages[k] = p;
        work.out_scores[k] = -kInf;
        ++k;
    }
    return k;
}

template <typename T>
T* at(int64_t address) {
    return reinterpret_cast<T*>(address);
}

}  // namespace

extern "C" {

// Page ranking of every head of a layer (icecache/indexes/_dci_kernels.py `rank_pages`, one head per unit).
// trees [heads, 16] int64: X, Xr, run_key, run_id, cl_start, cl_size, sub, dirs, page_of, page_sizes (addresses),
// then S, dirs_stride, top_level, F, num_page_ids; tree_reals [heads, 2]: norm_c, scale.
// works [heads, 16] int64: cnt, cnt_stamp, cand_stamp, eval_stamp, dist, stamp, pool, gsc, page_best, page_stamp,
// page_list, out_pages, out_scores (addresses), then cnt_stride, gsc_stride.
// limits [6]: L, m, num_to_visit, num_to_retrieve, kk, cover; props [2]: prop_to_visit, prop_to_retrieve.
// queries [heads, groups, dim] float32. counts[h] = the pages written to head h's out_pages / out_scores.
void ice_layer_dci_rank_pages(int64_t heads, const int64_t* trees, const double* tree_reals, const int64_t* works,
                              const int64_t* limits, const double* props, const float* queries, int64_t groups,
                              int64_t dim, int per_query_beam, int64_t budget, int mass, int64_t* counts,
                              int64_t threads) {
    const Limits lim{limits[0], limits[1], limits[2], props[0], limits[3], props[1]};
    const int64_t kk = limits[4], cover = limits[5];
    const std::function<void(int64_t)> one = [&](int64_t h) {
        const int64_t* t = trees + 16 * h;
        const Tree tree{at<const float>(t[0]),   at<const float>(t[1]),   at<const float>(t[2]),
                        at<const int32_t>(t[3]), at<const int64_t>(t[4]), at<const int64_t>(t[5]),
                        at<const int64_t>(t[6]), at<const double>(t[7]),  at<const int64_t>(t[8]),
                        at<const int64_t>(t[9]), t[10], t[11], t[12], t[13], t[14], tree_reals[2 * h],
                        tree_reals[2 * h + 1]};
        const int64_t* w = works + 16 * h;
        Work work{at<int32_t>(w[0]), w[13],           at<int64_t>(w[1]),  at<int64_t>(w[2]),  at<int64_t>(w[3]),
                  at<double>(w[4]),  at<int64_t>(w[5]), at<int64_t>(w[6]), at<double>(w[7]),  w[14],
                  at<double>(w[8]),  at<int64_t>(w[9]), at<int64_t>(w[10]), at<int64_t>(w[11]), at<double>(w[12])};
        counts[h] = rank_head(tree, work, lim, queries + h * groups * dim, groups, dim, kk, cover, per_query_beam != 0,
                              budget, mass != 0);
    };
    ice_parallel_units(heads, threads, one);
}

}  // extern "C"
