/* RMSNorm for CPU inference, built and loaded by native.py and called by norm.py: the zero-centred norm of Qwen3.5
 * (`rmsnorm(x) * (1 + w)`, fp32) and the plain one of DeepSeek-V3 / GLM / Qwen2 / MiMo (`w * rmsnorm(x)`, normalised
 * in fp32 and rounded to the model dtype before the weight), with the eager forms' roundings (norm.py).
 *
 * One call instead of the ~8 tensor operations of the eager form, each a pass and a dispatch. Row-invariant by
 * construction: each row's sum of squares runs in 8 fixed lanes summed in a fixed tree, whatever the number of rows
 * and however the threads split them. Built with -ffp-contract=off. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "native.h"

#define MAX_D 16384

/* x [rows, D] at row stride sx (elements), w [D] -> out [rows, D] contiguous; bf16 (else fp32) for x, w and out.
 * zero_centred: out = (x * r) * (1 + w) in fp32, rounded once; else out = w * round(x * r), rounded. D % 8 == 0,
 * D <= MAX_D. */
void rmsnorm(int64_t rows, int64_t D, const void* x, int64_t sx, const void* w, int zero_centred, float eps, int bf16,
             void* out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && rows * D >= 32768)
    for (int64_t r = 0; r < rows; r++) {
        float xf[MAX_D];
        if (bf16)
            for (int64_t i = 0; i < D; i++) xf[i] = bf16_to_f(((const uint16_t*)x)[r * sx + i]);
        else
            memcpy(xf, (const float*)x + r * sx, sizeof(float) * (size_t)D);
        float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t i = 0; i < D; i += 8)
            for (int l = 0; l < 8; l++) lane[l] += xf[i + l] * xf[i + l];
        const float ss = ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
        for (int64_t i = 0; i < D; i++) {
            const float wi = bf16 ? bf16_to_f(((const uint16_t*)w)[i]) : ((const float*)w)[i];
            float y = xf[i] * inv;
            if (zero_centred) y = y * (1.0f + wi);
            else if (bf16) y = wi * bf16_to_f(to_bf16(y));
            else y = wi * y;
            if (bf16) ((uint16_t*)out)[r * D + i] = to_bf16(y);
            else ((float*)out)[r * D + i] = y;
        }
    }
}
