/* Greedy token choice for CPU decoding, built and loaded by native.py and called by argmax_kernel.py: the argmax of
 * each row of logits, exactly as torch.argmax chooses it (the first index of the largest value; a row holding NaN:
 * its first NaN). torch's CPU argmax on bfloat16 logits runs ~10x slower than on fp32 (~3 ms for a 248,320-token
 * vocabulary on one core), and a decode round takes one per verified position and per draft.
 *
 * Exact: a maximum is an exact choice (no rounding), and the index is found by comparing against it. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "native.h"

static inline __m256 load8(const void* x, int64_t i, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float*)x + i);
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)((const uint16_t*)x + i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

static inline float value(const void* x, int64_t i, int bf16) {
    return bf16 ? bf16_to_f(((const uint16_t*)x)[i]) : ((const float*)x)[i];
}

/* One row of V values: the largest (with a NaN flag) in 8-lane passes, then the first index that holds it. */
static int64_t argmax_row(const void* x, int64_t V, int bf16) {
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= V; i += 16) {
        const __m256 a = load8(x, i, bf16), b = load8(x, i + 8, bf16);
        nan = _mm256_or_ps(nan, _mm256_or_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q), _mm256_cmp_ps(b, b, _CMP_UNORD_Q)));
        m0 = _mm256_max_ps(m0, a);
        m1 = _mm256_max_ps(m1, b);
    }
    float lanes[8], best = -INFINITY;
    int has_nan = _mm256_movemask_ps(nan) != 0;
    _mm256_storeu_ps(lanes, _mm256_max_ps(m0, m1));
    for (int l = 0; l < 8; l++) best = lanes[l] > best ? lanes[l] : best;
    for (int64_t j = i; j < V; j++) {
        const float v = value(x, j, bf16);
        has_nan |= v != v;
        best = v > best ? v : best;
    }
    const __m256 target = _mm256_set1_ps(best);
    int64_t j = 0;
    for (; j + 8 <= V; j += 8) {
        const __m256 a = load8(x, j, bf16);
        const int hit = _mm256_movemask_ps(has_nan ? _mm256_cmp_ps(a, a, _CMP_UNORD_Q) : _mm256_cmp_ps(a, target, _CMP_EQ_OQ));
        if (hit) return j + __builtin_ctz((unsigned)hit);
    }
    for (; j < V; j++) {
        const float v = value(x, j, bf16);
        if (has_nan ? v != v : v == best) return j;
    }
    return 0; /* V == 0 never reaches here (the caller refuses it) */
}

/* x [rows, V] at row stride sx (elements), bf16 or fp32 -> out int64 [rows]. */
void argmax_rows(int64_t rows, int64_t V, const void* x, int64_t sx, int bf16, int64_t* out, int nthreads) {
    const size_t esize = bf16 ? 2 : 4;
    PARALLEL_FOR(rows > 1 && rows * V >= 65536, r, rows, { out[r] = argmax_row((const char*)x + (size_t)(r * sx) * esize, V, bf16); });
}
