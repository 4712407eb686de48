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

/* x [rows, D] at row stride sx (elements), w [D] -> out [rows, D] contiguous; bf16 (else fp32) for x, w and out.
 * zero_centred: out = (x * r) * (1 + w) in fp32, rounded once; else out = w * round(x * r), rounded. D % 8 == 0.
 * Lane l of the sum of squares takes i = l mod 8 in order (a multiply, then an add), the lanes summed as
 * ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)); everything else is elementwise, 8 at a time. */
void rmsnorm(int64_t rows, int64_t D, const void* x, int64_t sx, const void* w, int zero_centred, float eps, int bf16,
             void* out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && rows * D >= 32768)
    for (int64_t r = 0; r < rows; r++) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < D; i += 8) {
            const __m256 v = load8(x, r * sx + i, bf16);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
        }
        float lane[8];
        _mm256_storeu_ps(lane, acc);
        const float ss = ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
        const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(ss / (float)D + eps));
        for (int64_t i = 0; i < D; i += 8) {
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
