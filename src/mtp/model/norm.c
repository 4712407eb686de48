/* RMSNorm for CPU inference, built and loaded by native.py and called by norm.py: the zero-centred norm of Qwen3.5
 * (`rmsnorm(x) * (1 + w)`, fp32) and the plain one of DeepSeek-V3 / GLM / Qwen2 / MiMo (`w * rmsnorm(x)`, normalised
 * in fp32 and rounded to the model dtype before the weight), with the eager forms' roundings (norm.py).
 *
 * One call instead of the ~8 tensor operations of the eager form, each a pass and a dispatch. Row-invariant by
 * construction: each row's sum of squares runs in 8 fixed lanes summed in a fixed tree, whatever the number of rows
 * and however the threads split them. Built with -ffp-contract=off. */

#include <math.h>
#include <stdint.h>

#include "native.h"

/* 8 values of x (bf16 or fp32) at i, as floats */
static inline __m256 load8(const void* x, int64_t i, int bf16) {
    return bf16 ? bf16x8_to_f((const uint16_t*)x + i) : _mm256_loadu_ps((const float*)x + i);
}

#if defined(__AVX512F__)
/* 16 values of x (bf16 or fp32) at i, as floats */
static inline __m512 load16(const void* x, int64_t i, int bf16) {
    return bf16 ? bf16x16_to_f((const uint16_t*)x + i, 16) : _mm512_loadu_ps((const float*)x + i);
}
#endif

/* row r's sum of squares (lane l takes i = l mod 8 in order, the lanes summed in the fixed tree below) */
static inline float lanes_sum(__m256 acc) {
    float lane[8];
    _mm256_storeu_ps(lane, acc);
    return ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
}

/* rows r0 .. r0 + 3 (those below `rows`) of rmsnorm, below */
static void rmsnorm_rows(int64_t r0, int64_t rows, int64_t D, const void* x, int64_t sx, const void* w, int zero_centred,
                         float eps, int bf16, void* out) {
    const int64_t n = rows - r0 < 4 ? rows - r0 : 4;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < D; i += 8)
        for (int64_t u = 0; u < n; u++) {
            const __m256 v = load8(x, (r0 + u) * sx + i, bf16);
            acc[u] = _mm256_add_ps(acc[u], _mm256_mul_ps(v, v));
        }
    for (int64_t u = 0; u < n; u++) {
        const int64_t r = r0 + u;
        const float rr = 1.0f / sqrtf(lanes_sum(acc[u]) / (float)D + eps);
        const __m256 inv = _mm256_set1_ps(rr);
        int64_t i = 0;
#if defined(__AVX512F__)
        const __m512 inv16 = _mm512_set1_ps(rr);
        /* the 8-lane code below on 16 lanes (elementwise: the same bits); not for a single row (a decode step's
         * norm, 1.36 -> 1.44 us a call at D = 384 that way) */
        for (; rows > 1 && i + 16 <= D; i += 16) {
            const __m512 wi = load16(w, i, bf16);
            __m512 y = _mm512_mul_ps(load16(x, r * sx + i, bf16), inv16);
            if (zero_centred) y = _mm512_mul_ps(y, _mm512_add_ps(_mm512_set1_ps(1.0f), wi));
            else if (bf16) y = _mm512_mul_ps(wi, round_bf16x16(y));
            else y = _mm512_mul_ps(wi, y);
            if (bf16) f_to_bf16x16((uint16_t*)out + r * D + i, y, 0xffff);
            else _mm512_storeu_ps((float*)out + r * D + i, y);
        }
#endif
        for (; i < D; i += 8) {
            const __m256 wi = load8(w, i, bf16);
            __m256 y = _mm256_mul_ps(load8(x, r * sx + i, bf16), inv);
            if (zero_centred) y = _mm256_mul_ps(y, _mm256_add_ps(_mm256_set1_ps(1.0f), wi));
            else if (bf16) y = _mm256_mul_ps(wi, round_bf16x8(y));
            else y = _mm256_mul_ps(wi, y);
            if (bf16) f_to_bf16x8((uint16_t*)out + r * D + i, y);
            else _mm256_storeu_ps((float*)out + r * D + i, y);
        }
    }
}

/* x [rows, D] at row stride sx (elements), w [D] -> out [rows, D] contiguous; bf16 (else fp32) for x, w and out.
 * zero_centred: out = (x * r) * (1 + w) in fp32, rounded once; else out = w * round(x * r), rounded. D % 8 == 0.
 * Lane l of the sum of squares takes i = l mod 8 in order (a multiply, then an add), the lanes summed as
 * ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)); everything else is elementwise, 8 at a time. Four rows' sums
 * run side by side (each its own lanes, in its own order: the same bits): one row's is a chain of D / 8 dependent
 * adds. AVX-512 builds write the output 16 lanes at a time (elementwise: the same bits). */
void rmsnorm(int64_t rows, int64_t D, const void* x, int64_t sx, const void* w, int zero_centred, float eps, int bf16,
             void* out, int nthreads) {
    PARALLEL_FOR(rows * D >= 32768, g, (rows + 3) / 4, { rmsnorm_rows(4 * g, rows, D, x, sx, w, zero_centred, eps, bf16, out); });
}
