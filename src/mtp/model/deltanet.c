/* The Gated DeltaNet decode step of Qwen3.5 / Qwen3-Next for CPU decoding, built and loaded by native.py and called
 * by deltanet.py (`GatedDeltaNet.decode`). One call does, for T tokens of B rows, what the eager step does in ~60
 * tensor operations per layer: the causal short conv over the window, SiLU, the q/k L2 norms, beta and the decay, the
 * delta-rule recurrence keeping the state after every token, and the gated RMSNorm of the output.
 *
 * Row-invariant by construction: every output of a (row, token) is computed by the same code in the same order from
 * its own inputs and the state before it, whatever B and T are and however the threads split the work (they split
 * rows x heads), so a verified position and a batch row are bit for bit their plain step. Built with
 * -ffp-contract=off so that no loop fuses a multiply-add another does not. The vectorised loops (gcc -O3) run over
 * independent elements only, never reassociating a sum.
 *
 * Rounding follows the eager step (deltanet.py): the conv output and SiLU are rounded to the model dtype, as are the
 * gated norm's normalised value and weight product; the recurrence and everything between is fp32. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

typedef struct {
    int64_t B, T, Hk, Hv, Kd, Vd, kernel;
    int bf16; /* window, taps, b, a, z, norm weight and out in bf16 (else fp32) */
} Shape;

static inline float load(const void* p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

static inline void store(void* p, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t*)p)[i] = to_bf16(v);
    else ((float*)p)[i] = v;
}

/* x[i] := silu(x[i]) = x / (1 + exp(-x)) for n values, 8 at a time; the tail goes through the same vector code. */
static void silu_n(float* x, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        const __m256 d = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), v)));
        _mm256_storeu_ps(x + i, _mm256_div_ps(v, d));
    }
    if (i < n) {
        float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        memcpy(tail, x + i, sizeof(float) * (size_t)(n - i));
        silu_n(tail, 8);
        memcpy(x + i, tail, sizeof(float) * (size_t)(n - i));
    }
}

static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); } /* torch's threshold 20 */

/* Conv + SiLU of one (row, token) for channels [c0, c1): window [C, kernel-1+T] of this row, taps [C, kernel]. */
static void conv_silu(const Shape* s, const void* window, const void* taps, int64_t t, int64_t c0, int64_t c1,
                      float* out) {
    const int64_t W = s->kernel - 1 + s->T;
    for (int64_t c = c0; c < c1; c++) {
        float acc = 0.0f;
        for (int64_t j = 0; j < s->kernel; j++)
            acc += load(window, c * W + t + j, s->bf16) * load(taps, c * s->kernel + j, s->bf16);
        out[c - c0] = s->bf16 ? round_bf16(acc) : acc;
    }
    silu_n(out, c1 - c0);
    if (s->bf16)
        for (int64_t c = 0; c < c1 - c0; c++) out[c] = round_bf16(out[c]);
}

static void l2norm(float* x, int64_t n, float scale) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss + 1e-6f);
    for (int64_t i = 0; i < n; i++) x[i] = x[i] * r;
    if (scale != 1.0f)
        for (int64_t i = 0; i < n; i++) x[i] = x[i] * scale;
}

/* One token of one value head: S_in [Kd, Vd] -> S_out, o [Vd]. S_out may be S_in (a plain step that updates the
 * state in place): each element is read before it is written. */
static void delta_step(int64_t Kd, int64_t Vd, const float* S_in, float* S_out, const float* q, const float* k,
                       const float* v, float decay, float beta, float* restrict kv, float* restrict o) {
    for (int64_t j = 0; j < Vd; j++) kv[j] = 0.0f;
    for (int64_t i = 0; i < Kd; i++) {
        const float* row = S_in + i * Vd;
        const float ki = k[i];
        for (int64_t j = 0; j < Vd; j++) kv[j] += ki * (row[j] * decay);
    }
    for (int64_t j = 0; j < Vd; j++) kv[j] = (v[j] - kv[j]) * beta; /* delta */
    for (int64_t j = 0; j < Vd; j++) o[j] = 0.0f;
    for (int64_t i = 0; i < Kd; i++) {
        const float* row = S_in + i * Vd;
        float* dst = S_out + i * Vd;
        const float ki = k[i], qi = q[i];
#pragma GCC ivdep /* row and dst are the same memory in place, element for element: no dependence across j */
        for (int64_t j = 0; j < Vd; j++) {
            const float x = row[j] * decay + ki * kv[j];
            dst[j] = x;
            o[j] += qi * x;
        }
    }
}

/* window [B, C, kernel-1+T], taps [C, kernel]; b and a [B, T, Hv] at row strides (sb0, sb1) and (sa0, sa1); A_log and
 * dt_bias fp32 [Hv]; z [B, T, Hv*Vd] at strides (sz0, sz1); norm_w [Vd]; ssm fp32 [B, Hv, Kd, Vd] (read only) ->
 * states fp32 [B, Hv, T, Kd, Vd] (the state after each token), out [B, T, Hv*Vd] (the gated norm's output). states
 * may be ssm: the state is then updated in place token after token, with the same arithmetic, and only the last one
 * is kept (a plain step, T = 1, or a prompt's chunk: the prefill then computes what T plain steps would).
 * C = 2*Hk*Kd + Hv*Vd (all q heads, all k heads, all v heads); Hv a multiple of Hk. 0, or -1 when out of memory. */
int deltanet_decode(int64_t B, int64_t T, int64_t Hk, int64_t Hv, int64_t Kd, int64_t Vd, int64_t kernel, int bf16,
                    const void* window, const void* taps, const void* b, int64_t sb0, int64_t sb1, const void* a,
                    int64_t sa0, int64_t sa1, const float* A_log, const float* dt_bias, const void* z, int64_t sz0,
                    int64_t sz1, const void* norm_w, float eps, const float* ssm, float* states, void* out,
                    int nthreads) {
    const Shape s = {B, T, Hk, Hv, Kd, Vd, kernel, bf16};
    const int64_t C = 2 * Hk * Kd + Hv * Vd, W = kernel - 1 + T, rep = Hv / Hk;
    const size_t esize = bf16 ? 2 : 4;
    const float qscale = 1.0f / sqrtf((float)Kd);
    /* conv outputs of every (row, token): q [Hk, Kd], k [Hk, Kd], v [Hv, Vd], normalised in place */
    float* qkv = malloc(sizeof(float) * (size_t)(B * T * C));
    if (!qkv) return -1;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        /* 1: conv, SiLU and norms, split over (row, token, head) */
        const int64_t parts = 2 * Hk + Hv;
#pragma omp for schedule(static)
        for (int64_t w = 0; w < B * T * parts; w++) {
            const int64_t bt = w / parts, p = w % parts, r = bt / T, t = bt % T;
            const int64_t c0 = p < 2 * Hk ? p * Kd : 2 * Hk * Kd + (p - 2 * Hk) * Vd;
            const int64_t n = p < 2 * Hk ? Kd : Vd;
            float* dst = qkv + bt * C + c0;
            conv_silu(&s, (const char*)window + (size_t)(r * C * W) * esize, taps, t, c0, c0 + n, dst);
            if (p < 2 * Hk) l2norm(dst, n, p < Hk ? qscale : 1.0f);
        }
        /* 2: the recurrence and the gated norm, split over (row, value head); tokens in order */
        float* scratch = malloc(sizeof(float) * (size_t)(2 * Vd));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t w = 0; w < B * Hv; w++) {
            if (!scratch) continue;
            const int64_t r = w / Hv, h = w % Hv, hk = h / rep;
            float *kv = scratch, *o = scratch + Vd;
            const float neg_A = -expf(A_log[h]);
            const float* S = ssm + w * Kd * Vd;
            const int in_place = states == ssm;
            for (int64_t t = 0; t < T; t++) {
                const float* x = qkv + (r * T + t) * C;
                const float beta = 1.0f / (1.0f + expf(-load(b, r * sb0 + t * sb1 + h, bf16)));
                const float g = neg_A * softplus(load(a, r * sa0 + t * sa1 + h, bf16) + dt_bias[h]);
                float* S_next = in_place ? states + w * Kd * Vd : states + ((w * T + t) * Kd) * Vd;
                delta_step(Kd, Vd, S, S_next, x + hk * Kd, x + Hk * Kd + hk * Kd, x + 2 * Hk * Kd + h * Vd, expf(g),
                           beta, kv, o);
                S = S_next;
                /* gated RMSNorm: w * rmsnorm(o) * silu(z), with the eager step's roundings */
                float ss = 0.0f;
                if (bf16)
                    for (int64_t j = 0; j < Vd; j++) o[j] = round_bf16(o[j]);
                for (int64_t j = 0; j < Vd; j++) ss += o[j] * o[j];
                const float rr = 1.0f / sqrtf(ss / (float)Vd + eps);
                const int64_t zo = r * sz0 + t * sz1 + h * Vd, oo = (r * T + t) * Hv * Vd + h * Vd;
                for (int64_t j = 0; j < Vd; j++) kv[j] = load(z, zo + j, bf16); /* kv: free again, holds the gate */
                silu_n(kv, Vd);
                for (int64_t j = 0; j < Vd; j++) {
                    float y = o[j] * rr;
                    if (bf16) y = round_bf16(round_bf16(y) * load(norm_w, j, 1));
                    else y = y * load(norm_w, j, 0);
                    store(out, oo + j, y * kv[j], bf16);
                }
            }
        }
        free(scratch);
    }
    free(qkv);
    return failed ? -1 : 0;
}

/* keep_at: row r of ssm [B, Hv, Kd, Vd] := states[r, :, n[r] - 1] (states [B, Hv, T, Kd, Vd]) and row r of the conv
 * inputs conv [B, C, kernel-1] := window[r, :, n[r] : n[r] + kernel-1] (window [B, C, kernel-1+T], esize bytes an
 * element) where n[r] > 0; a row with n[r] = 0 keeps its own. */
void deltanet_keep(int64_t B, int64_t Hv, int64_t T, int64_t KV, const int64_t* n, const float* states, float* ssm,
                   int64_t C, int64_t kernel, int64_t esize, const void* window, void* conv, int nthreads) {
    const int64_t W = kernel - 1 + T, keep_w = (kernel - 1) * esize;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int64_t w = 0; w < B * Hv; w++) {
        const int64_t r = w / Hv, h = w % Hv, keep = n[r];
        if (keep <= 0 || keep > T) continue;
        memcpy(ssm + w * KV, states + (w * T + keep - 1) * KV, sizeof(float) * (size_t)KV);
        for (int64_t c = h * C / Hv; c < (h + 1) * C / Hv; c++) /* this row's conv channels, split over its heads */
            memcpy((char*)conv + (r * C + c) * keep_w, (const char*)window + ((r * C + c) * W + keep) * esize, (size_t)keep_w);
    }
}

typedef struct { /* one layer's deltanet_keep: the cache's state and conv inputs, the forward's steps */
    int64_t B, Hv, T, KV, C, kernel, esize;
    const float* states;
    float* ssm;
    const void* window;
    void* conv;
} Keep;

/* deltanet_keep for L layers at once (Cache.keep_at after a decode forward: one call, not one per layer). */
void deltanet_keep_layers(int64_t L, const Keep* k, const int64_t* n, int nthreads) {
    for (int64_t i = 0; i < L; i++)
        deltanet_keep(k[i].B, k[i].Hv, k[i].T, k[i].KV, n, k[i].states, k[i].ssm, k[i].C, k[i].kernel, k[i].esize,
                      k[i].window, k[i].conv, nthreads);
}
