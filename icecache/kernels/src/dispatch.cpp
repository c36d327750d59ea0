// The exported C ABI of libicecache_kernels: the instruction set chosen at run time, the threads (OpenMP), the
// top-k selection and the per-layer calls (every KV head of a layer step in one call, the GIL released by ctypes).
// Compiled for the x86-64 baseline; the arithmetic lives in isa_kernels.cpp.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kernels.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

// ---------------------------------------------------------------------------------------------- instruction set
bool cpu_has(const char* isa) {
    __builtin_cpu_init();
    if (std::strcmp(isa, "generic") == 0) return true;
    if (std::strcmp(isa, "avx2") == 0)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (std::strcmp(isa, "avx512") == 0)
        return cpu_has("avx2") && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512bw");
    return false;
}

const IceIsaKernels* table_of(const char* isa) {
    if (std::strcmp(isa, "avx512") == 0) return ice_kernels_avx512 ? ice_kernels_avx512() : nullptr;
    if (std::strcmp(isa, "avx2") == 0) return ice_kernels_avx2 ? ice_kernels_avx2() : nullptr;
    if (std::strcmp(isa, "generic") == 0) return ice_kernels_generic();
    return nullptr;
}

// The default preference: AVX2 before AVX-512. On our 2-core Xeon (AVX-512 F/BW/VL) the 16-lane build's
// single-threaded scan of a decode step took 31.8 ms against AVX2's 24.2 (float32; 29.1 vs 19.5 with the float16
// pass; experiments/bench_runtime/native_kernels/): ICECACHE_ISA=avx512 selects it where it pays.
const IceIsaKernels* best_table() {
    for (const char* isa : {"avx2", "avx512"})
        if (cpu_has(isa) && table_of(isa) != nullptr) return table_of(isa);
    return ice_kernels_generic();
}

std::atomic<const IceIsaKernels*> g_kernels{nullptr};

const IceIsaKernels& kernels() {
    const IceIsaKernels* k = g_kernels.load(std::memory_order_acquire);
    if (k == nullptr) {
        k = best_table();
        g_kernels.store(k, std::memory_order_release);
    }
    return *k;
}

// ---------------------------------------------------------------------------------------------- threads
// Run fn(0..units) on up to `threads` threads, on the OpenMP runtime torch itself uses (its libgomp is loaded
// first, see library.py): the same team of worker threads, already awake after torch's own ops. A private
// std::thread pool, tried first, was slower inside a model step (its thread competed with torch's spinning
// OpenMP workers for the cores). Built without OpenMP, or inside a parallel region: serially.
void parallel_units(int64_t units, int64_t threads, const std::function<void(int64_t)>& fn) {
#ifdef _OPENMP
    if (threads > 1 && units > 1 && !omp_in_parallel()) {
        const int team = static_cast<int>(std::min(threads, units));
#pragma omp parallel for schedule(dynamic, 1) num_threads(team)
        for (int64_t u = 0; u < units; ++u) fn(u);
        return;
    }
#else
    (void)threads;
#endif
    for (int64_t u = 0; u < units; ++u) fn(u);
}

int built_with_openmp() {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

// ---------------------------------------------------------------------------------------------- top-k
// The k-th largest of vals[0, n) (1 <= k <= n). A strided sample of an eighth gives a cut that is at or below the
// k-th value with high probability; only the values at or above it are partitioned (all of them otherwise).
float kth_largest(const float* vals, int64_t n, int64_t k, std::vector<float>& tmp) {
    if (n >= 4 * k && n >= 1024) {
        const int64_t m = (n + 7) / 8;
        tmp.resize(m);
        for (int64_t i = 0; i < m; ++i) tmp[i] = vals[8 * i];
        const int64_t rank = std::min<int64_t>(m, static_cast<int64_t>(1.5 * k * m / n) + 16);
        std::nth_element(tmp.begin(), tmp.begin() + (m - rank), tmp.end());
        const float cut = tmp[m - rank];
        tmp.resize(n + 1);
        int64_t count = 0;
        for (int64_t j = 0; j < n; ++j) {  // branch-free compaction of the values at or above the cut
            tmp[count] = vals[j];
            count += (vals[j] >= cut);
        }
        tmp.resize(count);
        if (count >= k) {
            std::nth_element(tmp.begin(), tmp.begin() + (count - k), tmp.end());
            return tmp[count - k];
        }
    }
    tmp.assign(vals, vals + n);
    std::nth_element(tmp.begin(), tmp.begin() + (n - k), tmp.end());
    return tmp[n - k];
}

// The best min(k, n) of scores[0, n) (scores[i] belongs to position ids[i], or i when ids is null), best first,
// ties by position. Returns the count.
int64_t top_k(const float* scores, const int64_t* ids, int64_t n, int64_t k, int64_t* out_pos, float* out_scores,
              std::vector<float>& tmp, std::vector<std::pair<float, int64_t>>& picked) {
    k = std::min(k, n);
    if (k <= 0) return 0;
    const float kth = kth_largest(scores, n, k, tmp);
    picked.clear();
    for (int64_t j = 0; j < n; ++j)
        if (scores[j] > kth) picked.emplace_back(scores[j], ids ? ids[j] : j);
    for (int64_t j = 0; j < n && static_cast<int64_t>(picked.size()) < k; ++j)
        if (scores[j] == kth) picked.emplace_back(scores[j], ids ? ids[j] : j);
    std::sort(picked.begin(), picked.end(), [](const auto& a, const auto& b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    for (int64_t t = 0; t < k; ++t) {
        out_pos[t] = picked[t].second;
        out_scores[t] = picked[t].first;
    }
    return k;
}

// Per-thread scratch: grown once, reused by every later call (no allocation per step once warm).
struct Scratch {
    std::vector<float> scores, bounds, tmp, rows;
    std::vector<int64_t> cands;
    std::vector<std::pair<float, int64_t>> picked;
};

Scratch& scratch() {
    thread_local Scratch s;
    return s;
}

// Upper bound of |score from float16 keys - score from float32 keys| for one key: both sums carry float32
// rounding (gamma_dim each) and the key's float16 rounding (2^-11 relative, 2^-25 absolute below 2^-14).
struct HalfErrorBound {
    float relative;   // times |q| |k|
    float absolute;   // times |q|
};

HalfErrorBound half_error_bound(int64_t dim) {
    const double u = std::ldexp(1.0, -24);
    const double gamma = dim * u / (1.0 - dim * u);
    const double margin = 1.01;  // the norms' own float32 rounding and the bound's arithmetic
    return {static_cast<float>(margin * (std::ldexp(1.0, -11) * (1.0 + gamma) + 2.0 * gamma * (1.0 + std::ldexp(1.0, -11)))),
            static_cast<float>(margin * std::sqrt(static_cast<double>(dim)) * std::ldexp(1.0, -25) * (1.0 + gamma))};
}

float largest_query_norm(const float* queries, int64_t groups, int64_t dim) {
    double best = 0.0;
    for (int64_t r = 0; r < groups; ++r) {
        double s = 0.0;
        for (int64_t i = 0; i < dim; ++i) s += static_cast<double>(queries[r * dim + i]) * queries[r * dim + i];
        best = std::max(best, std::sqrt(s));
    }
    return static_cast<float>(best);
}

// Top min(k, n) positions of one head by max_r q_r . key, best first, ties by position; float32 scores of the
// float32 keys. With `keys16` (the keys in float16) and `norms` (|key|, float32): a first pass over the half-size
// copy, then only the keys whose score could reach the top k re-scored from `keys32`: the same result as the
// float32 scan, read from about half the bytes. Returns the count and (via `rescored`) how many keys the second
// pass read (-1: the float32 scan ran).
// Bring the float16 copy up to row n: rows [*done, n) of keys32 converted and their norms computed. *done = -1
// (the copy is off for good) when a key overflows float16.
void extend_half(const float* keys32, uint16_t* keys16, float* norms, int64_t dim, int64_t n, int64_t* done) {
    if (*done < 0 || *done >= n) return;
    const int64_t from = *done;
    if (!kernels().to_half(keys32 + from * dim, (n - from) * dim, keys16 + from * dim)) {
        *done = -1;
        return;
    }
    for (int64_t j = from; j < n; ++j) {
        double sum = 0.0;
        for (int64_t i = 0; i < dim; ++i) sum += static_cast<double>(keys32[j * dim + i]) * keys32[j * dim + i];
        norms[j] = static_cast<float>(std::sqrt(sum));
    }
    *done = n;
}

// One head of a layer's top-k: its keys, its outputs, and (shared by the threads scanning its chunks) its scores.
struct HeadTask {
    const float* queries;
    const float* keys32;
    const uint16_t* keys16;  // null: scan float32
    const float* norms;
    int64_t n, k;
    int64_t* out_pos;
    float* out_scores;
    int64_t* found;
    int64_t* rescored;
    float* scores;  // [n]: the scan's output (float16 first pass, or float32)
    std::atomic<int64_t> chunks_left;
};

// Scan keys [lo, hi) of one head into its scores (float16 copy when it has one).
void scan_chunk(const HeadTask& t, int64_t groups, int64_t dim, int64_t lo, int64_t hi) {
    const IceIsaKernels& isa = kernels();
    if (t.keys16 != nullptr) isa.scores_f16(t.queries, groups, dim, t.keys16 + lo * dim, hi - lo, t.scores + lo);
    else isa.scores_f32(t.queries, groups, dim, t.keys32 + lo * dim, hi - lo, t.scores + lo);
}

// The top k of one head once its scan is complete. After a float16 first pass: each key's score is bounded from
// both sides (`half_error_bound`), the k-th best lower bound is a threshold at least k keys reach, and only the keys
// whose upper bound reaches it are re-scored in float32 (the same summation as a full float32 scan, so the same
// floats): the result equals the float32 scan's.
void finish_head(const HeadTask& t, int64_t groups, int64_t dim) {
    const IceIsaKernels& isa = kernels();
    Scratch& s = scratch();
    *t.rescored = -1;
    if (t.keys16 == nullptr) {
        *t.found = top_k(t.scores, nullptr, t.n, t.k, t.out_pos, t.out_scores, s.tmp, s.picked);
        return;
    }
    const int64_t n = t.n;
    s.bounds.resize(n);
    const HalfErrorBound bound = half_error_bound(dim);
    const float qn = largest_query_norm(t.queries, groups, dim);
    isa.half_errors(t.scores, t.norms, bound.relative * qn, bound.absolute * qn, std::ldexp(1.0f, -23), n, s.bounds.data());
    s.rows.resize(n);
    for (int64_t j = 0; j < n; ++j) s.rows[j] = t.scores[j] - s.bounds[j];  // lower bounds of the float32 scores
    const float threshold = kth_largest(s.rows.data(), n, t.k, s.tmp);    // k keys score at least this
    s.cands.resize(n);
    int64_t m = 0;
    for (int64_t j = 0; j < n; ++j) {  // branch-free: every key written, the count advanced when it may qualify
        s.cands[m] = j;
        m += (t.scores[j] + s.bounds[j] >= threshold);
    }
    if (2 * m > n) {  // the filter kept most keys: one float32 scan is cheaper
        isa.scores_f32(t.queries, groups, dim, t.keys32, n, t.scores);
        *t.found = top_k(t.scores, nullptr, n, t.k, t.out_pos, t.out_scores, s.tmp, s.picked);
        return;
    }
    s.rows.resize(m * dim);
    for (int64_t c = 0; c < m; ++c) std::memcpy(&s.rows[c * dim], t.keys32 + s.cands[c] * dim, sizeof(float) * dim);
    isa.scores_f32(t.queries, groups, dim, s.rows.data(), m, s.bounds.data());
    *t.rescored = m;
    *t.found = top_k(s.bounds.data(), s.cands.data(), m, t.k, t.out_pos, t.out_scores, s.tmp, s.picked);
}

//: fewest keys per chunk for which a second thread pays for its wake-up (the numba path's rule too)
constexpr int64_t kMinKeysPerChunk = 2048;

}  // namespace

const IceIsaKernels& ice_active_kernels() { return kernels(); }

void ice_parallel_units(int64_t units, int64_t threads, const std::function<void(int64_t)>& fn) {
    parallel_units(units, threads, fn);
}

extern "C" {

int ice_abi_version() { return 2; }

// 1 when parallel calls run on OpenMP (torch's runtime), 0 when they run serially (built without OpenMP).
int ice_openmp() { return built_with_openmp(); }

const char* ice_isa() { return kernels().name; }

// 1 when the CPU runs `isa` ("generic", "avx2", "avx512").
int ice_cpu_has(const char* isa) { return cpu_has(isa) ? 1 : 0; }

// 1 when the library was built with `isa`'s kernels.
int ice_built_with(const char* isa) { return table_of(isa) != nullptr ? 1 : 0; }

// Use `isa` from now on: 0 done, -1 unknown name or not built, -2 not supported by this CPU.
int ice_set_isa(const char* isa) {
    const IceIsaKernels* table = table_of(isa);
    if (table == nullptr) return -1;
    if (!cpu_has(isa)) return -2;
    g_kernels.store(table, std::memory_order_release);
    return 0;
}

// dst[i] = float16 bits of src[i] (nearest even); returns 0 when a value overflowed.
int ice_to_half(const float* src, int64_t n, uint16_t* dst) { return kernels().to_half(src, n, dst); }

// out[j] = max_r q_r . keys[j] for j < n; keys float32 (half16 = 0) or float16 bits (half16 = 1).
void ice_scores(const float* queries, int64_t groups, int64_t dim, const void* keys, int half16, int64_t n, float* out) {
    if (half16) kernels().scores_f16(queries, groups, dim, static_cast<const uint16_t*>(keys), n, out);
    else kernels().scores_f32(queries, groups, dim, static_cast<const float*>(keys), n, out);
}

// The top min(k, counts[h]) positions of every head h < heads: queries [heads, groups, dim] float32; keys32[h],
// keys16[h] (0: none) and norms[h] the addresses of each head's rows; out_pos / out_scores [heads, k];
// out_counts[h] the positions found; out_rescored[h] the keys the exact pass re-read (-1: full float32 scan).
//
// keys16[h] / norms[h] (capacity >= counts[h] rows) hold a float16 copy of the first half_done[h] rows: the call
// first converts the rows up to counts[h] (the decode step's inserted keys: no Python work per insert) and
// advances half_done[h]; -1 there means the copy is off for that head (a key overflowed float16; set by the call).
void ice_layer_top_tokens(int64_t heads, const float* queries, int64_t groups, int64_t dim, const int64_t* keys32,
                          const int64_t* keys16, const int64_t* norms, int64_t* half_done, const int64_t* counts, int64_t k,
                          int64_t* out_pos, float* out_scores, int64_t* out_counts, int64_t* out_rescored, int64_t threads) {
    thread_local std::vector<std::vector<float>> head_scores;
    thread_local std::vector<HeadTask> tasks;
    if (static_cast<int64_t>(head_scores.size()) < heads) head_scores.resize(heads);
    if (static_cast<int64_t>(tasks.size()) < heads) tasks = std::vector<HeadTask>(heads);  // grown once, then reused
    int64_t chunks = 1;
    for (int64_t h = 0; h < heads; ++h) {
        HeadTask& t = tasks[h];
        t.queries = queries + h * groups * dim;
        t.keys32 = reinterpret_cast<const float*>(keys32[h]);
        t.n = std::max<int64_t>(counts[h], 0);
        t.k = std::max<int64_t>(std::min(k, t.n), 0);
        t.out_pos = out_pos + h * k;
        t.out_scores = out_scores + h * k;
        t.found = out_counts + h;
        t.rescored = out_rescored + h;
        *t.found = 0;
        *t.rescored = -1;
        t.keys16 = nullptr;
        t.norms = reinterpret_cast<const float*>(norms[h]);
        if (keys16[h] != 0 && norms[h] != 0 && half_done != nullptr && t.k < t.n && kernels().fast_half) {
            extend_half(t.keys32, reinterpret_cast<uint16_t*>(keys16[h]), reinterpret_cast<float*>(norms[h]), dim, t.n,
                        half_done + h);
            if (half_done[h] >= 0) t.keys16 = reinterpret_cast<const uint16_t*>(keys16[h]);
        }
        head_scores[h].resize(t.n);
        t.scores = head_scores[h].data();
        chunks = std::max<int64_t>(chunks, std::min<int64_t>(threads, t.n / kMinKeysPerChunk));
    }
    for (auto& t : tasks) t.chunks_left.store(chunks);
    // Units: (head, chunk) scans; the thread finishing a head's last chunk picks that head's top k.
    // The pool's threads see their own thread_locals: hand them this thread's task list by pointer.
    HeadTask* const shared = tasks.data();
    const std::function<void(int64_t)> one = [shared, chunks, groups, dim](int64_t u) {
        HeadTask& t = shared[u / chunks];
        const int64_t part = u % chunks;
        if (t.k > 0) scan_chunk(t, groups, dim, t.n * part / chunks, t.n * (part + 1) / chunks);
        if (t.chunks_left.fetch_sub(1) == 1 && t.k > 0) finish_head(t, groups, dim);
    };
    parallel_units(heads * chunks, threads, one);
}

// Quest pages of every head: queries [heads, groups, dim]; lo[h] / hi[h] the addresses of each head's page minima /
// maxima [counts[h], dim] float32; the top min(k, counts[h]) pages by the bound, best first, ties by page row, in
// out_pages / out_scores [heads, k]; out_counts[h] how many.
void ice_layer_quest_pages(int64_t heads, const float* queries, int64_t groups, int64_t dim, const int64_t* lo,
                           const int64_t* hi, const int64_t* counts, int64_t k, int64_t* out_pages, float* out_scores,
                           int64_t* out_counts, int64_t threads) {
    const std::function<void(int64_t)> one = [&](int64_t h) {
        Scratch& s = scratch();
        const int64_t n = std::max<int64_t>(counts[h], 0);
        s.scores.resize(n);
        kernels().quest_bounds(queries + h * groups * dim, groups, dim, reinterpret_cast<const float*>(lo[h]),
                               reinterpret_cast<const float*>(hi[h]), n, s.scores.data());
        out_counts[h] = top_k(s.scores.data(), nullptr, n, k, out_pages + h * k, out_scores + h * k, s.tmp, s.picked);
    };
    parallel_units(heads, threads, one);
}

// Masked decode attention of `units` (row, KV head) pairs: queries [units, groups, dim], keys / values
// [units, slots, dim], valid [units, slots] (bytes, 0 = masked) -> out [units, groups, dim].
void ice_layer_attend(int64_t units, const float* queries, int64_t groups, int64_t dim, const float* keys,
                      const float* values, const uint8_t* valid, int64_t slots, float scale, float* out, int64_t threads) {
    const std::function<void(int64_t)> one = [&](int64_t u) {
        Scratch& s = scratch();
        s.tmp.resize(groups * (slots + 8));  // the vector kernels pad the slots to a multiple of 8
        kernels().attend(queries + u * groups * dim, groups, dim, keys + u * slots * dim, values + u * slots * dim,
                         valid + u * slots, slots, scale, out + u * groups * dim, s.tmp.data());
    };
    parallel_units(units, threads, one);
}

}  // extern "C"
