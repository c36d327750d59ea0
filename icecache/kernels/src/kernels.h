// IceCache's native kernels: the C ABI shared by the ISA builds (isa_kernels.cpp, compiled once per instruction
// set) and the dispatcher (dispatch.cpp, compiled for the baseline). Python loads the library with ctypes
// (icecache/kernels/library.py); every exported function releases nothing and allocates nothing the caller
// must free.
#pragma once
#include <cstdint>

// One instruction set's scan and attention kernels. Scores: out[j] = max_r q[r] . keys[j] for j in [0, n), with
// one fixed summation order per key (the same for every j, so a row scanned alone or in a block gets the same
// float). Keys are rows of `d` values; `d` any positive width.
struct IceIsaKernels {
    const char* name;
    // Whether the float16 first pass pays here (hardware conversion); the generic build converts in software and
    // scans float32 instead (2.5x slower with the pass, experiments/bench_runtime/native_kernels/).
    bool fast_half;
    void (*scores_f32)(const float* queries, int64_t groups, int64_t dim, const float* keys, int64_t n, float* out);
    void (*scores_f16)(const float* queries, int64_t groups, int64_t dim, const uint16_t* keys, int64_t n, float* out);
    // Masked attention of one (row, KV head): queries [groups, dim] over slots [slots, dim] where valid[s] != 0;
    // out [groups, dim]; weights: scratch of `groups * (slots + 8)` floats.
    void (*attend)(const float* queries, int64_t groups, int64_t dim, const float* keys, const float* values,
                   const uint8_t* valid, int64_t slots, float scale, float* out, float* weights);
    // err[j] = rel * norms[j] + absolute + ulp * |approx[j]|: the float16 scores' error allowance.
    void (*half_errors)(const float* approx, const float* norms, float rel, float absolute, float ulp, int64_t n, float* err);
    // dst[i] = the float16 bits of src[i], rounded to nearest even; returns 0 when a value overflowed (else 1).
    int (*to_half)(const float* src, int64_t n, uint16_t* dst);
    // Quest's page bound: out[p] = max_r sum_c max(q_rc lo[p, c], q_rc hi[p, c]) for p < pages.
    void (*quest_bounds)(const float* queries, int64_t groups, int64_t dim, const float* lo, const float* hi, int64_t pages,
                         float* out);
    // The DCI search's token score: out[g] = sum_i double(key[i]) * queries[g, i] in float64 (one fixed order per
    // ISA) for g < groups; returns max_g out[g].
    double (*group_dots_f64)(const float* key, const double* queries, int64_t groups, int64_t dim, double* out);
};

#include <functional>

// Shared by the baseline-compiled sources (dispatch.cpp defines them): the ISA table in use and the thread runner.
const IceIsaKernels& ice_active_kernels();
void ice_parallel_units(int64_t units, int64_t threads, const std::function<void(int64_t)>& fn);

// Weak: a compiler without an instruction set's flags builds the library without it (the address is then null).
extern "C" {
const IceIsaKernels* ice_kernels_generic();
__attribute__((weak)) const IceIsaKernels* ice_kernels_avx2();
__attribute__((weak)) const IceIsaKernels* ice_kernels_avx512();
}
