/* Decode attention for CPU decoding, built and loaded by native.py and called by attention.py (`attend_decode`): each
 * query of a decode forward over exactly the cached keys at positions <= its own, softmax in fp32.
 *
 * Row-invariant by construction: a query's output is computed from its own row of q and the keys it sees, by the
 * same code in the same order whatever the batch, the width T and the cache length, so a verify row and a batch row
 * are bit for bit their plain step (eager SDPA over a slice of the cache did the same at ~1 ms a call at the 0.8B
 * shape: it is built for long queries). Dot products run in 8 fixed lanes, summed in a fixed tree; built with
 * -ffp-contract=off. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

static void widen(const void* src, int64_t n, int bf16, float* dst) {
    if (bf16)
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f(((const uint16_t*)src)[i]);
    else
        memcpy(dst, src, sizeof(float) * (size_t)n);
}

/* q [B, A, T, D] at strides (sq0, sq1, sq2) (last 1), k [B, Hk, S, D] and v [B, Hk, S, Dv] contiguous, starts [B]
 * (row b's token t sits at position starts[b] + t) -> out [B, A, T, Dv] contiguous, in the model dtype. D % 8 == 0.
 * Query head a reads kv head a / (A / Hk). 0, or -1 when out of memory. */
int attend_decode(int64_t B, int64_t A, int64_t T, int64_t Hk, int64_t S, int64_t D, int64_t Dv, int bf16,
                  const void* q, int64_t sq0, int64_t sq1, int64_t sq2, const void* k, const void* v,
                  const int64_t* starts, float scale, void* out, int nthreads) {
    const int64_t G = A / Hk;
    const size_t es = bf16 ? 2 : 4;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && B * A * T > 1)
    {
        float* buf = malloc(sizeof(float) * (size_t)(D + 2 * Dv + S + Dv));
        float *qf = buf, *kf = buf + D, *acc = kf + (D > Dv ? D : Dv), *p = acc + Dv;
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t w = 0; w < B * A * T; w++) {
            if (!buf) continue;
            const int64_t b = w / (A * T), a = (w / T) % A, t = w % T, h = a / G;
            const int64_t n = starts[b] + t + 1; /* keys 0..position */
            if (n > S) continue;
            widen((const char*)q + (size_t)(b * sq0 + a * sq1 + t * sq2) * es, D, bf16, qf);
            const char* kb = (const char*)k + (size_t)((b * Hk + h) * S * D) * es;
            const char* vb = (const char*)v + (size_t)((b * Hk + h) * S * Dv) * es;
            float m = -INFINITY;
            for (int64_t j = 0; j < n; j++) {
                widen(kb + (size_t)(j * D) * es, D, bf16, kf);
                float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                for (int64_t i = 0; i < D; i += 8)
                    for (int l = 0; l < 8; l++) lane[l] += qf[i + l] * kf[i + l];
                const float s = (((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]))) * scale;
                p[j] = s;
                m = s > m ? s : m;
            }
            float sum = 0.0f;
            for (int64_t j = 0; j < n; j++) {
                p[j] = expf(p[j] - m);
                sum += p[j];
            }
            for (int64_t i = 0; i < Dv; i++) acc[i] = 0.0f;
            for (int64_t j = 0; j < n; j++) {
                widen(vb + (size_t)(j * Dv) * es, Dv, bf16, kf);
                const float pj = p[j];
                for (int64_t i = 0; i < Dv; i++) acc[i] += pj * kf[i];
            }
            const float inv = 1.0f / sum;
            const int64_t o = ((b * A + a) * T + t) * Dv;
            if (bf16)
                for (int64_t i = 0; i < Dv; i++) ((uint16_t*)out)[o + i] = to_bf16(acc[i] * inv);
            else
                for (int64_t i = 0; i < Dv; i++) ((float*)out)[o + i] = acc[i] * inv;
        }
        free(buf);
    }
    return failed ? -1 : 0;
}
