// One instruction set's kernels: the key scan (float32 and float16 keys) and the masked decode attention of one
// (row, KV head). Compiled three times by icecache/kernels/build.py:
//   ICE_ISA_GENERIC  no -m flags (x86-64 baseline, scalar loops)
//   ICE_ISA_AVX2     -mavx2 -mfma -mf16c     (the baseline of our machines: 8 lanes)
//   ICE_ISA_AVX512   -mavx512f -mavx512vl -mavx512bw -mavx2 -mfma -mf16c   (16-lane loads and FMAs)
// No -ffast-math: every key's score is summed in one fixed order (per dimension chunk an FMA, then one lane tree),
// the same for every row whether it is scanned in a block or alone, so a re-scored candidate gets the same float
// as in a full scan (the reduced-precision filter of dispatch.cpp relies on it).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels.h"

#if defined(ICE_ISA_AVX2) || defined(ICE_ISA_AVX512)
#include <immintrin.h>
#endif

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// IEEE half -> float, exactly (subnormals, infinities and NaN included).
inline float half_to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu;
    uint32_t mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0) {
        if (mantissa == 0) {
            bits = sign;
        } else {  // subnormal: normalise
            int shift = 0;
            while ((mantissa & 0x400u) == 0) {
                mantissa <<= 1;
                ++shift;
            }
            mantissa &= 0x3ffu;
            bits = sign | static_cast<uint32_t>(127 - 15 + 1 - shift) << 23 | mantissa << 13;
        }
    } else if (exponent == 31) {
        bits = sign | 0x7f800000u | mantissa << 13;
    } else {
        bits = sign | (exponent + 127 - 15) << 23 | mantissa << 13;
    }
    float out;
    std::memcpy(&out, &bits, sizeof out);
    return out;
}

// ---------------------------------------------------------------------------------------------- generic (scalar)
template <typename Load>
inline float dot_scalar(const float* q, int64_t dim, Load load) {
    float sum = 0.0f;
    for (int64_t i = 0; i < dim; ++i) sum += q[i] * load(i);
    return sum;
}

void scores_f32_scalar(const float* queries, int64_t groups, int64_t dim, const float* keys, int64_t n, float* out) {
    for (int64_t j = 0; j < n; ++j) {
        const float* key = keys + j * dim;
        float best = kNegInf;
        for (int64_t r = 0; r < groups; ++r) {
            const float s = dot_scalar(queries + r * dim, dim, [key](int64_t i) { return key[i]; });
            best = s > best ? s : best;
        }
        out[j] = best;
    }
}

void scores_f16_scalar(const float* queries, int64_t groups, int64_t dim, const uint16_t* keys, int64_t n, float* out) {
    for (int64_t j = 0; j < n; ++j) {
        const uint16_t* key = keys + j * dim;
        float best = kNegInf;
        for (int64_t r = 0; r < groups; ++r) {
            const float s = dot_scalar(queries + r * dim, dim, [key](int64_t i) { return half_to_float(key[i]); });
            best = s > best ? s : best;
        }
        out[j] = best;
    }
}

void attend_scalar(const float* queries, int64_t groups, int64_t dim, const float* keys, const float* values,
                   const uint8_t* valid, int64_t slots, float scale, float* out, float* weights) {
    for (int64_t r = 0; r < groups; ++r) {
        const float* q = queries + r * dim;
        float* o = out + r * dim;
        float top = kNegInf;
        for (int64_t s = 0; s < slots; ++s) {
            if (!valid[s]) continue;
            const float* key = keys + s * dim;
            weights[s] = scale * dot_scalar(q, dim, [key](int64_t i) { return key[i]; });
            top = weights[s] > top ? weights[s] : top;
        }
        for (int64_t i = 0; i < dim; ++i) o[i] = 0.0f;
        if (top == kNegInf) continue;  // no valid slot: zeros, as the numba kernel
        float total = 0.0f;
        for (int64_t s = 0; s < slots; ++s) {
            if (!valid[s]) continue;
            const float e = std::exp(weights[s] - top);
            total += e;
            const float* v = values + s * dim;
            for (int64_t i = 0; i < dim; ++i) o[i] += e * v[i];
        }
        const float inv = 1.0f / total;
        for (int64_t i = 0; i < dim; ++i) o[i] *= inv;
    }
}

// The DCI search's token scores in float64, summed in index order.
[[maybe_unused]] double group_dots_f64_scalar(const float* key, const double* queries, int64_t groups, int64_t dim,
                                             double* out) {
    double best = -std::numeric_limits<double>::infinity();
    for (int64_t g = 0; g < groups; ++g) {
        const double* q = queries + g * dim;
        double sum = 0.0;
        for (int64_t i = 0; i < dim; ++i) sum += static_cast<double>(key[i]) * q[i];
        out[g] = sum;
        best = sum > best ? sum : best;
    }
    return best;
}

// float -> IEEE half, round to nearest even (as numpy's astype(float16) and F16C's vcvtps2ph).
inline uint16_t float_to_half(float f) {
    uint32_t x;
    std::memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t absx = x & 0x7fffffffu;
    if (absx >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0u));
    if (absx >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to infinity
    if (absx < 0x38800000u) {  // below 2^-14: a subnormal half (or zero), in units of 2^-24
        float a;
        std::memcpy(&a, &absx, sizeof a);
        return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.0f)));
    }
    const uint32_t mantissa = absx & 0x7fffffu;
    uint32_t h = ((absx >> 23) - 127 + 15) << 10 | mantissa >> 13;
    const uint32_t rest = mantissa & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h += 1;  // a carry into the exponent is right too
    return static_cast<uint16_t>(sign | h);
}

// dst[i] = half(src[i]) for i < n; returns 1 when every value is finite in float16, 0 when one overflowed.
int to_half_scalar(const float* src, int64_t n, uint16_t* dst) {
    int finite = 1;
    for (int64_t i = 0; i < n; ++i) {
        dst[i] = float_to_half(src[i]);
        finite &= (dst[i] & 0x7c00u) != 0x7c00u;
    }
    return finite;
}

void quest_bounds_scalar(const float* queries, int64_t groups, int64_t dim, const float* lo, const float* hi, int64_t pages,
                         float* out) {
    for (int64_t p = 0; p < pages; ++p) {
        float best = kNegInf;
        for (int64_t r = 0; r < groups; ++r) {
            const float* q = queries + r * dim;
            float sum = 0.0f;
            for (int64_t c = 0; c < dim; ++c) {
                const float a = q[c] * lo[p * dim + c], b = q[c] * hi[p * dim + c];
                sum += a > b ? a : b;
            }
            best = sum > best ? sum : best;
        }
        out[p] = best;
    }
}

// Error allowance of each float16 score: err[j] = rel * norms[j] + absolute + ulp * |approx[j]| (a plain loop: the
// compiler vectorises it for this build's instruction set).
void half_errors(const float* approx, const float* norms, float rel, float absolute, float ulp, int64_t n, float* err) {
    for (int64_t j = 0; j < n; ++j) err[j] = rel * norms[j] + absolute + ulp * std::fabs(approx[j]);
}

#if defined(ICE_ISA_AVX2) || defined(ICE_ISA_AVX512)
// ---------------------------------------------------------------------------------------------- 8-lane helpers
// [sum(v0), ..., sum(v7)]: every lane summed as ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)).
inline __m256 reduce8(__m256 v0, __m256 v1, __m256 v2, __m256 v3, __m256 v4, __m256 v5, __m256 v6, __m256 v7) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v0, v1), _mm256_hadd_ps(v2, v3));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v4, v5), _mm256_hadd_ps(v6, v7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float hsum8(__m256 v) {  // the same lane order as reduce8
    const __m256 z = _mm256_setzero_ps();
    return _mm256_cvtss_f32(reduce8(v, z, z, z, z, z, z, z));
}

#if defined(ICE_ISA_AVX512)
constexpr int64_t kLanes = 16;
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vbroadcast(float x) { return _mm512_set1_ps(x); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline __m256 fold(Vec v) {  // 16 lanes -> 8: lane i + lane i+8
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#else
constexpr int64_t kLanes = 8;
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vbroadcast(float x) { return _mm256_set1_ps(x); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline __m256 fold(Vec v) { return v; }
#endif

// Scores of 8 consecutive keys ``keys[0..8)`` (rows of ``dim``, a multiple of kLanes) into out[0..8).
inline void block8(const float* queries, int64_t groups, int64_t dim, const float* keys, float* out) {
    __m256 best = _mm256_set1_ps(kNegInf);
    for (int64_t r = 0; r < groups; ++r) {
        const float* q = queries + r * dim;
        Vec acc[8];
        for (auto& a : acc) a = vzero();
        for (int64_t c = 0; c < dim; c += kLanes) {
            const Vec qc = vload(q + c);
            for (int t = 0; t < 8; ++t) acc[t] = vfma(qc, vload(keys + t * dim + c), acc[t]);
        }
        const __m256 s = reduce8(fold(acc[0]), fold(acc[1]), fold(acc[2]), fold(acc[3]), fold(acc[4]), fold(acc[5]),
                                 fold(acc[6]), fold(acc[7]));
        best = _mm256_max_ps(s, best);
    }
    _mm256_storeu_ps(out, best);
}

// Float16 keys: the block converted once into a float tile, then scored as float32 (the same lane order).
inline void block8(const float* queries, int64_t groups, int64_t dim, const uint16_t* keys, float* out) {
    alignas(64) float tile[8 * 512];
    for (int64_t c = 0; c < 8 * dim; c += 8)
        _mm256_store_ps(tile + c, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(keys + c))));
    block8(queries, groups, dim, static_cast<const float*>(tile), out);
}

template <typename T>
void scores_vector(const float* queries, int64_t groups, int64_t dim, const T* keys, int64_t n, float* out) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) block8(queries, groups, dim, keys + j * dim, out + j);
    if (j == n) return;
    // The tail: copied into a zero-padded block, so its rows get the block's summation order.
    alignas(64) T tail[8 * 512];
    alignas(32) float tail_out[8];
    const int64_t rest = n - j;
    std::memset(tail, 0, sizeof(T) * 8 * dim);
    std::memcpy(tail, keys + j * dim, sizeof(T) * rest * dim);
    block8(queries, groups, dim, tail, tail_out);
    std::memcpy(out + j, tail_out, sizeof(float) * rest);
}

// exp(x) for 8 lanes: x = n ln2 + r (|r| <= ln2 / 2), exp(r) by its Taylor polynomial to degree 7 (relative error
// below 1e-8 on that range), times 2^n through the exponent bits; 0 below -87 (float32 underflow).
inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);  // ln2 in two parts: exact first product
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

// Logits of 8 consecutive slots for every query of the group: out[r * stride + t] = q_r . keys[t] (the block's
// keys stay in L1 across the queries, so K is read once).
inline void block8_each(const float* queries, int64_t groups, int64_t dim, const float* keys, float* out, int64_t stride) {
    for (int64_t r = 0; r < groups; ++r) {
        const float* q = queries + r * dim;
        Vec acc[8];
        for (auto& a : acc) a = vzero();
        for (int64_t c = 0; c < dim; c += kLanes) {
            const Vec qc = vload(q + c);
            for (int t = 0; t < 8; ++t) acc[t] = vfma(qc, vload(keys + t * dim + c), acc[t]);
        }
        _mm256_storeu_ps(out + r * stride, reduce8(fold(acc[0]), fold(acc[1]), fold(acc[2]), fold(acc[3]), fold(acc[4]),
                                                   fold(acc[5]), fold(acc[6]), fold(acc[7])));
    }
}

// The attention of one (row, KV head), the group's queries together: logits in blocks of 8 slots (K read once),
// masked, exp8, then the weighted sums of up to 4 queries x 4 vectors in registers per pass over V.
// weights: scratch of groups * (slots + 8) floats.
void attend_vector(const float* queries, int64_t groups, int64_t dim, const float* keys, const float* values,
                   const uint8_t* valid, int64_t slots, float scale, float* out, float* weights) {
    const int64_t padded = (slots + 7) / 8 * 8;
    alignas(64) float tail[8 * 512];
    for (int64_t s = 0; s < padded; s += 8) {
        const float* block = keys + s * dim;
        if (s + 8 > slots) {  // the last, partial block: zero-padded copy
            std::memset(tail, 0, sizeof(float) * 8 * dim);
            std::memcpy(tail, keys + s * dim, sizeof(float) * (slots - s) * dim);
            block = tail;
        }
        block8_each(queries, groups, dim, block, weights + s, padded);
    }
    std::vector<float> inv(groups, 0.0f);
    for (int64_t r = 0; r < groups; ++r) {
        float* w = weights + r * padded;
        float top = kNegInf;
        for (int64_t s = 0; s < padded; ++s) {
            w[s] = (s < slots && valid[s]) ? scale * w[s] : kNegInf;
            top = w[s] > top ? w[s] : top;
        }
        if (top == kNegInf) {  // no valid slot: zeros (inv stays 0)
            for (int64_t s = 0; s < padded; ++s) w[s] = 0.0f;
            continue;
        }
        const __m256 shift = _mm256_set1_ps(top);
        __m256 total8 = _mm256_setzero_ps();
        for (int64_t s = 0; s < padded; s += 8) {  // masked slots: exp(-inf) -> 0 (clamped, then zeroed)
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(w + s), shift));
            _mm256_storeu_ps(w + s, e);
            total8 = _mm256_add_ps(total8, e);
        }
        inv[r] = 1.0f / hsum8(total8);
    }
    for (int64_t r0 = 0; r0 < groups; r0 += 4) {
        const int64_t rows = std::min<int64_t>(4, groups - r0);
        for (int64_t c0 = 0; c0 < dim; c0 += 4 * kLanes) {
            const int64_t width = std::min<int64_t>(4, (dim - c0) / kLanes);
            Vec acc[4][4];
            for (auto& row : acc)
                for (auto& a : row) a = vzero();
            for (int64_t s = 0; s < slots; ++s) {
                const float* v = values + s * dim + c0;
                Vec vv[4];
                for (int64_t t = 0; t < width; ++t) vv[t] = vload(v + t * kLanes);
                for (int64_t r = 0; r < rows; ++r) {
                    const Vec e = vbroadcast(weights[(r0 + r) * padded + s]);
                    for (int64_t t = 0; t < width; ++t) acc[r][t] = vfma(e, vv[t], acc[r][t]);
                }
            }
            for (int64_t r = 0; r < rows; ++r) {
                const Vec iv = vbroadcast(inv[r0 + r]);
                for (int64_t t = 0; t < width; ++t) vstore(out + (r0 + r) * dim + c0 + t * kLanes, vmul(acc[r][t], iv));
            }
        }
    }
}

// Quest's bound for 8 pages at a time (the scan's block structure: one accumulator per page, one lane tree).
void quest_bounds_isa(const float* queries, int64_t groups, int64_t dim, const float* lo, const float* hi, int64_t pages,
                      float* out) {
    if (!(dim % kLanes == 0 && dim <= 512)) {
        quest_bounds_scalar(queries, groups, dim, lo, hi, pages, out);
        return;
    }
    int64_t p = 0;
    for (; p + 8 <= pages; p += 8) {
        __m256 best = _mm256_set1_ps(kNegInf);
        for (int64_t r = 0; r < groups; ++r) {
            const float* q = queries + r * dim;
            Vec acc[8];
            for (auto& a : acc) a = vzero();
            for (int64_t c = 0; c < dim; c += kLanes) {
                const Vec qc = vload(q + c);
                for (int t = 0; t < 8; ++t) {
                    const float* row = lo + (p + t) * dim + c;
                    acc[t] = vadd(acc[t], vmax(vmul(qc, vload(row)), vmul(qc, vload(hi + (row - lo)))));
                }
            }
            best = _mm256_max_ps(best, reduce8(fold(acc[0]), fold(acc[1]), fold(acc[2]), fold(acc[3]), fold(acc[4]),
                                               fold(acc[5]), fold(acc[6]), fold(acc[7])));
        }
        _mm256_storeu_ps(out + p, best);
    }
    if (p < pages) quest_bounds_scalar(queries, groups, dim, lo + p * dim, hi + p * dim, pages - p, out + p);
}

// to_half_scalar with F16C, 8 values at a time.
int to_half_isa(const float* src, int64_t n, uint16_t* dst) {
    int64_t i = 0;
    __m128i seen = _mm_setzero_si128();
    const __m128i exponent = _mm_set1_epi16(0x7c00);
    for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
        seen = _mm_or_si128(seen, _mm_cmpeq_epi16(_mm_and_si128(h, exponent), exponent));
    }
    const int finite = _mm_testz_si128(seen, seen);
    return to_half_scalar(src + i, n - i, dst + i) & finite;
}

// Widths the vector kernels take: a multiple of the lane count, at most 512 (the tail block's size).
inline bool vector_width(int64_t dim) { return dim % kLanes == 0 && dim <= 512; }

void scores_f32_isa(const float* queries, int64_t groups, int64_t dim, const float* keys, int64_t n, float* out) {
    if (vector_width(dim)) scores_vector(queries, groups, dim, keys, n, out);
    else scores_f32_scalar(queries, groups, dim, keys, n, out);
}

void scores_f16_isa(const float* queries, int64_t groups, int64_t dim, const uint16_t* keys, int64_t n, float* out) {
    if (vector_width(dim)) scores_vector(queries, groups, dim, keys, n, out);
    else scores_f16_scalar(queries, groups, dim, keys, n, out);
}

void attend_isa(const float* queries, int64_t groups, int64_t dim, const float* keys, const float* values,
                const uint8_t* valid, int64_t slots, float scale, float* out, float* weights) {
    if (vector_width(dim)) attend_vector(queries, groups, dim, keys, values, valid, slots, scale, out, weights);
    else attend_scalar(queries, groups, dim, keys, values, valid, slots, scale, out, weights);
}
// The DCI search's token scores in float64. Per query, two 4-lane accumulators (key floats 0-3 and 4-7 of each
// chunk of 8, widened), then one lane tree and the scalar tail. Up to four queries share each widened chunk, so
// their eight accumulator chains run side by side (one query at a time waited on each FMA's latency: 3x slower).
template <int Queries>
inline void dots_tile(const float* key, const double* queries, int64_t dim, double* out) {
    __m256d lo[Queries], hi[Queries];
    for (int t = 0; t < Queries; ++t) lo[t] = hi[t] = _mm256_setzero_pd();
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8) {
        const __m256 k = _mm256_loadu_ps(key + i);
        const __m256d klo = _mm256_cvtps_pd(_mm256_castps256_ps128(k));
        const __m256d khi = _mm256_cvtps_pd(_mm256_extractf128_ps(k, 1));
        for (int t = 0; t < Queries; ++t) {
            lo[t] = _mm256_fmadd_pd(klo, _mm256_loadu_pd(queries + t * dim + i), lo[t]);
            hi[t] = _mm256_fmadd_pd(khi, _mm256_loadu_pd(queries + t * dim + i + 4), hi[t]);
        }
    }
    for (int t = 0; t < Queries; ++t) {
        const __m256d acc = _mm256_add_pd(lo[t], hi[t]);
        const __m128d pair = _mm_add_pd(_mm256_castpd256_pd128(acc), _mm256_extractf128_pd(acc, 1));
        double sum = _mm_cvtsd_f64(_mm_add_sd(pair, _mm_unpackhi_pd(pair, pair)));
        for (int64_t j = i; j < dim; ++j) sum += static_cast<double>(key[j]) * queries[t * dim + j];
        out[t] = sum;
    }
}

double group_dots_f64_isa(const float* key, const double* queries, int64_t groups, int64_t dim, double* out) {
    for (int64_t g = 0; g < groups; g += 4) {
        const double* q = queries + g * dim;
        switch (std::min<int64_t>(4, groups - g)) {
            case 4: dots_tile<4>(key, q, dim, out + g); break;
            case 3: dots_tile<3>(key, q, dim, out + g); break;
            case 2: dots_tile<2>(key, q, dim, out + g); break;
            default: dots_tile<1>(key, q, dim, out + g); break;
        }
    }
    double best = -std::numeric_limits<double>::infinity();
    for (int64_t g = 0; g < groups; ++g) best = out[g] > best ? out[g] : best;
    return best;
}
#endif

}  // namespace

#if defined(ICE_ISA_AVX512)
extern "C" const IceIsaKernels* ice_kernels_avx512() {
    static const IceIsaKernels table{"avx512", true, scores_f32_isa, scores_f16_isa, attend_isa, half_errors, to_half_isa, quest_bounds_isa, group_dots_f64_isa};
    return &table;
}
#elif defined(ICE_ISA_AVX2)
extern "C" const IceIsaKernels* ice_kernels_avx2() {
    static const IceIsaKernels table{"avx2", true, scores_f32_isa, scores_f16_isa, attend_isa, half_errors, to_half_isa, quest_bounds_isa, group_dots_f64_isa};
    return &table;
}
#else
extern "C" const IceIsaKernels* ice_kernels_generic() {
    static const IceIsaKernels table{"generic", false, scores_f32_scalar, scores_f16_scalar, attend_scalar, half_errors, to_half_scalar, quest_bounds_scalar, group_dots_f64_scalar};
    return &table;
}
#endif
