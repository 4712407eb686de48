/* Decoding a checkpoint's scaled 8-bit codes to the model's float weights at load, built and loaded by native.py and
 * called by dequant.py: one pass over the codes instead of the torch form's chunked passes (`packed.dequantize_scaled`:
 * the codes to fp32, the multiply by the scales, the cast), which spent ~4 s of a 10 s FP8 load at the Qwen3.5-0.8B
 * shape on one core (docs/decisions.md, 2026-12-06 eleventh session).
 *
 * The arithmetic is the torch form's: each code's fp32 value (a 256-entry table made by torch's own conversion of every
 * bit pattern, so float8 e4m3fn / e5m2 and int8 codes decode exactly as torch decodes them), times its scale in fp32
 * (one rounding), then rounded to bf16 as torch rounds (nearest even; a NaN stays a NaN) or kept in fp32. Built with
 * -ffp-contract=off. Rows are independent, so the threads' split does not change a bit. */

#include <immintrin.h>
#include <stdint.h>

#include "native.h"

/* codes q [N, K] (row stride K), lut [256] (each code's fp32 value), scales s: row n, column k takes
 * s[(n / b0) * ss + k / b1] -> out [N, K]: bf16 (bf16 != 0) or fp32. */
void scaled_decode(int64_t N, int64_t K, const uint8_t* q, const float* lut, const float* s, int64_t b0, int64_t b1,
                   int64_t ss, int bf16, void* out, int nthreads) {
    PARALLEL_FOR(N * K >= (1 << 20), n, N, {
        const uint8_t* qr = q + n * K;
        const float* sr = s + (n / b0) * ss;
        for (int64_t k0 = 0; k0 < K; k0 += b1) {
            const int64_t k1 = k0 + b1 < K ? k0 + b1 : K;
            const float sc = sr[k0 / b1];
            const __m256 sv = _mm256_set1_ps(sc);
            int64_t k = k0;
            for (; k + 8 <= k1; k += 8) {
                const __m128i c = _mm_loadl_epi64((const __m128i*)(qr + k));
                const __m256 v = _mm256_mul_ps(_mm256_i32gather_ps(lut, _mm256_cvtepu8_epi32(c), 4), sv);
                if (bf16)
                    f_to_bf16x8((uint16_t*)out + n * K + k, v);
                else
                    _mm256_storeu_ps((float*)out + n * K + k, v);
            }
            for (; k < k1; k++) {
                const float v = lut[qr[k]] * sc;
                if (bf16)
                    ((uint16_t*)out)[n * K + k] = to_bf16(v);
                else
                    ((float*)out)[n * K + k] = v;
            }
        }
    });
}
