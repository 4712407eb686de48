/* The Gated DeltaNet decode step of Qwen3.5 / Qwen3-Next for CPU decoding, built and loaded by native.py and called
 * by deltanet.py (`GatedDeltaNet.decode`). One call does, for T tokens of B rows, what the eager step does in ~60
 * tensor operations per layer: the causal short conv over the window, SiLU, the q/k L2 norms, beta and the decay, the
 * delta-rule recurrence keeping each token's update of the state (for `deltanet_keep`), and the gated RMSNorm of the
 * output.
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
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, silu8(_mm256_loadu_ps(x + i)));
    if (i < n) {
        float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        memcpy(tail, x + i, sizeof(float) * (size_t)(n - i));
        silu_n(tail, 8);
        memcpy(x + i, tail, sizeof(float) * (size_t)(n - i));
    }
}

static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); } /* torch's threshold 20 */

/* The conv of one (row, token) for channels [c0, c1), one channel at a time: window [C, kernel-1+T] of this row, taps
 * [C, kernel] -> out, rounded to the model dtype (the taps in order from 0, a multiply then an add). */
static void conv_sums(const Shape* s, const void* window, const void* taps, int64_t t, int64_t c0, int64_t c1,
                      float* out) {
    const int64_t W = s->kernel - 1 + s->T;
    for (int64_t c = c0; c < c1; c++) {
        float acc = 0.0f;
        for (int64_t j = 0; j < s->kernel; j++)
            acc += load(window, c * W + t + j, s->bf16) * load(taps, c * s->kernel + j, s->bf16);
        out[c - c0] = s->bf16 ? round_bf16(acc) : acc;
    }
}

/* an 8 x 8 block of floats, rows at stride ss, -> its transpose, rows at stride ds (data movement only) */
static inline void transpose8(const float* src, int64_t ss, float* dst, int64_t ds) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * ss);
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        r[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        r[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + i * ds, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * ds, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
}

#if defined(__AVX512F__)
/* a 16 x 16 block of floats, rows at stride ss, -> its transpose, rows at stride ds (native.h's, the bits moved) */
static inline void transpose16(const float* src, int64_t ss, float* dst, int64_t ds) {
    transpose_words16(src, ss, dst, ds);
}
#endif

/* Conv, SiLU and (norm: q and k) the L2 norm of L consecutive tokens t0..t0+L-1 of one row, channels [c0, c0 + n) (one
 * head), a vector holding one channel of the L tokens: conv_block_8 (__m256), and in AVX-512 builds conv_block_16
 * (__m512, a chunk's blocks of 16 tokens: its lanes do the same arithmetic). Each lane does conv_sums', silu_n's and l2norm's
 * arithmetic for its token in their order (the conv's taps in order from 0, the norm's sum over channels in order,
 * IEEE sqrt and division), so the values are bit for bit the token-at-a-time path's, which short forwards (a plain
 * step, a verify) and a chunk's last T % 8 tokens take. A prompt's chunk spent much of a layer's time in that path's
 * scalar per-channel sums. dst: the first token's channel c0 in qkv (rows of C floats); cm: scratch [n][L], written
 * out to dst a block of L x L at a time (`transpose8`, `transpose16`: the scalar copy was an eighth of a prompt's
 * DeltaNet time). */
#define CONV_BLOCK(L, V, P, LOAD_BF16, ROUND, SILU)                                                                 \
    static void conv_block_##L(const Shape* s, const void* window, const void* taps, int64_t t0, int64_t c0,        \
                               int64_t n, int norm, float scale, float* dst, int64_t C, float* cm) {               \
        const int64_t W = s->kernel - 1 + s->T;                                                                     \
        for (int64_t c = c0; c < c0 + n; c++) {                                                                     \
            V acc = P##_setzero_ps();                                                                               \
            for (int64_t j = 0; j < s->kernel; j++) {                                                               \
                const int64_t at = c * W + t0 + j;                                                                  \
                const V w = s->bf16 ? LOAD_BF16((const uint16_t*)window + at) : P##_loadu_ps((const float*)window + at); \
                acc = P##_add_ps(acc, P##_mul_ps(w, P##_set1_ps(load(taps, c * s->kernel + j, s->bf16))));         \
            }                                                                                                       \
            if (s->bf16) acc = ROUND(acc);                                                                          \
            acc = SILU(acc);                                                                                        \
            if (s->bf16) acc = ROUND(acc);                                                                          \
            P##_storeu_ps(cm + (c - c0) * L, acc);                                                                  \
        }                                                                                                           \
        if (norm) {                                                                                                 \
            V ss = P##_setzero_ps();                                                                                \
            for (int64_t i = 0; i < n; i++) {                                                                       \
                const V x = P##_loadu_ps(cm + i * L);                                                               \
                ss = P##_add_ps(ss, P##_mul_ps(x, x));                                                              \
            }                                                                                                       \
            const V r = P##_div_ps(P##_set1_ps(1.0f), P##_sqrt_ps(P##_add_ps(ss, P##_set1_ps(1e-6f))));            \
            for (int64_t i = 0; i < n; i++) {                                                                       \
                V x = P##_mul_ps(P##_loadu_ps(cm + i * L), r);                                                      \
                if (scale != 1.0f) x = P##_mul_ps(x, P##_set1_ps(scale));                                           \
                P##_storeu_ps(cm + i * L, x);                                                                       \
            }                                                                                                       \
        }                                                                                                           \
        int64_t i = 0; /* cm [n][L] -> the L tokens' rows of dst, L channels a transpose */                          \
        for (; i + L <= n; i += L) transpose##L(cm + i * L, L, dst + i, C);                                         \
        for (; i < n; i++)                                                                                          \
            for (int64_t l = 0; l < L; l++) dst[l * C + i] = cm[i * L + l];                                         \
    }
CONV_BLOCK(8, __m256, _mm256, bf16x8_to_f, round_bf16x8, silu8)
#if defined(__AVX512F__)
#define BF16X16(p) bf16x16_to_f(p, 16)
CONV_BLOCK(16, __m512, _mm512, BF16X16, round_bf16x16, silu16)
#undef BF16X16
#define CONV_BLOCK_MAX 16
#else
#define CONV_BLOCK_MAX 8
#endif
#undef CONV_BLOCK

/* 8 channels' 4 values (bf16 or fp32, [8][4] as stored) -> v[j] = value j of the channels in lane order 0 2 4 6 1 3 5
 * 7 (data movement only) */
static inline void four_by_8(const void* src, int bf16, __m256* v) {
    __m256 r[4];
    for (int i = 0; i < 4; i++) /* r[i]: channels 2i, 2i + 1 */
        r[i] = bf16 ? bf16x8_to_f((const uint16_t*)src + 8 * i) : _mm256_loadu_ps((const float*)src + 8 * i);
    const __m256 lo01 = _mm256_unpacklo_ps(r[0], r[1]), hi01 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 lo23 = _mm256_unpacklo_ps(r[2], r[3]), hi23 = _mm256_unpackhi_ps(r[2], r[3]);
    v[0] = _mm256_shuffle_ps(lo01, lo23, 0x44);
    v[1] = _mm256_shuffle_ps(lo01, lo23, 0xEE);
    v[2] = _mm256_shuffle_ps(hi01, hi23, 0x44);
    v[3] = _mm256_shuffle_ps(hi01, hi23, 0xEE);
}

/* Conv and SiLU of tokens t0..T-1 of one row (the tokens a short forward has past its blocks of 8), channels
 * [c0, c0 + n): the conv 8 channels a vector, each lane conv_sums' arithmetic for its channel (channels past the last
 * multiple of 8: conv_sums itself), then SiLU over the token's n values (silu_n, rounded as the block path rounds).
 * conv_sums alone loaded and converted two bf16 values per multiply-add, half of a verify's DeltaNet time; here the 8
 * channels' window and taps are converted once for all the tokens. dst: token t0's channel c0 in qkv (rows of C
 * floats). */
static void conv_tokens(const Shape* s, const void* window, const void* taps, int64_t t0, int64_t c0, int64_t n,
                        float* dst, int64_t C) {
    const int64_t W = s->kernel - 1 + s->T, K = s->kernel, n8 = n / 8 * 8;
    if (W == 4 && K == 4 && t0 == 0) { /* one token (a plain step), 4 taps: shuffled, not gathered (the gathers were
                                         * ~40% of an 8-row decode step's DeltaNet) */
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* (acc's lane l: channel 2 (l % 4) + l / 4) */
        const size_t es = s->bf16 ? 2 : 4;
        for (int64_t c = c0; c < c0 + n8; c += 8) {
            __m256 win[4], tap[4];
            four_by_8((const char*)window + (size_t)(c * 4) * es, s->bf16, win);
            four_by_8((const char*)taps + (size_t)(c * 4) * es, s->bf16, tap);
            __m256 acc = _mm256_setzero_ps();
            for (int j = 0; j < 4; j++) acc = _mm256_add_ps(acc, _mm256_mul_ps(win[j], tap[j]));
            acc = _mm256_permutevar8x32_ps(acc, order);
            _mm256_storeu_ps(dst + (c - c0), s->bf16 ? round_bf16x8(acc) : acc);
        }
    } else {
        /* the 8 channels' window and taps in fp32 as stored (channel-major), then channel-minor ([W][8], [K][8]): one
         * gather a column, not two a tap and token (those were 8% of a verify's DeltaNet) */
        float cm[(W + K) * 8], win[W * 8], tap[K * 8];
        const __m256i wi = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)W));
        const __m256i ki = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)K));
        for (int64_t c = c0; c < c0 + n8; c += 8) {
            for (int64_t i = 0; i < W * 8; i += 8) /* (8W and 8K values: whole vectors) */
                _mm256_storeu_ps(cm + i, s->bf16 ? bf16x8_to_f((const uint16_t*)window + c * W + i)
                                                 : _mm256_loadu_ps((const float*)window + c * W + i));
            for (int64_t i = 0; i < K * 8; i += 8)
                _mm256_storeu_ps(cm + W * 8 + i, s->bf16 ? bf16x8_to_f((const uint16_t*)taps + c * K + i)
                                                         : _mm256_loadu_ps((const float*)taps + c * K + i));
            for (int64_t w = 0; w < W; w++) _mm256_storeu_ps(win + w * 8, _mm256_i32gather_ps(cm + w, wi, 4));
            for (int64_t j = 0; j < K; j++) _mm256_storeu_ps(tap + j * 8, _mm256_i32gather_ps(cm + W * 8 + j, ki, 4));
            for (int64_t t = t0; t < s->T; t++) {
                __m256 acc = _mm256_setzero_ps();
                for (int64_t j = 0; j < K; j++) /* lane i: channel c + i's window at t + j, and its tap j */
                    acc = _mm256_add_ps(acc,
                                        _mm256_mul_ps(_mm256_loadu_ps(win + (t + j) * 8), _mm256_loadu_ps(tap + j * 8)));
                _mm256_storeu_ps(dst + (t - t0) * C + (c - c0), s->bf16 ? round_bf16x8(acc) : acc);
            }
        }
    }
    for (int64_t t = t0; t < s->T; t++) {
        float* out = dst + (t - t0) * C;
        conv_sums(s, window, taps, t, c0 + n8, c0 + n, out + n8);
        silu_n(out, n);
        if (s->bf16)
            for (int64_t c = 0; c < n; c++) out[c] = round_bf16(out[c]);
    }
}

static void l2norm(float* x, int64_t n, float scale) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss + 1e-6f);
    for (int64_t i = 0; i < n; i++) x[i] = x[i] * r;
    if (scale != 1.0f)
        for (int64_t i = 0; i < n; i++) x[i] = x[i] * scale;
}

/* The recurrence of one value head over its T tokens, per token t (the delta rule, as a plain step computes it):
 *   kv[j] = sum over i, in order, of k_t[i] * (S[i][j] * g_t)        (k_t^T of the decayed state)
 *   d[j]  = (v_t[j] - kv[j]) * beta_t                                  (the delta)
 *   S'[i][j] = S[i][j] * g_t + k_t[i] * d[j]                           (the state after token t)
 *   o_t[j] = sum over i, in order, of q_t[i] * S'[i][j],
 * each "a * b + c" (a sum's step, the last add of S') one fused multiply-add (fma: rounded once), the other products
 * rounded as written: 5 operations an element and token where separate multiplies and adds took 8 (8 rows x 4 tokens
 * 262-273 -> 225-231 us a layer, one thread, AMX Xeon; docs/decisions.md, 2026-12-05 fourth session).
 * Column j of every quantity depends on column j of S only, so the head runs up to DN_COLS columns at a time through
 * all T tokens: the columns' state stays in a scratch of Kd x DN_COLS floats (8 KB, 32 in AVX-512 builds, at Kd = 128:
 * L1) between tokens, the state before is read once, and the pass that writes S' also sums the next token's kv (the
 * same products in the same order); the scratch keeps S' already decayed for the next token (S' * g_{t+1}, the one
 * product both its kv and its S' read), a multiply an element fewer per token after the first. Every output has the
 * arithmetic above whatever T and the column split: a verified token is its plain step, bit for bit (the fmas are
 * explicit; -ffp-contract=off keeps the compiler from fusing others).
 *
 * What it leaves (`Rec`): the state after the last token (into `last`, which may be S itself: a step every row keeps),
 * or nothing; each token's update (k_t, d, g_t) into `upd` [T][Kd + Vd + 1] (a verify: `deltanet_keep` replays the
 * first n of them onto the state); o [T][Vd]. */
#if defined(__AVX512F__)
#define DN_COLS 64
#else
#define DN_COLS 16
#endif

typedef struct {
    int64_t T, Kd, Vd;
    const float* S;               /* [Kd, Vd]: the state before the tokens */
    float* last;                  /* [Kd, Vd] or NULL */
    const float* const* q;        /* per token: q_t [Kd], k_t [Kd], v_t [Vd] */
    const float* const* k;
    const float* const* v;
    const float* g;               /* [T] decays, [T] betas */
    const float* beta;
    float* upd;                   /* [T][Kd + Vd + 1] or NULL */
    float* o;                     /* [T][Vd] */
    float* scratch;               /* [Kd][DN_COLS] */
} Rec;

/* columns [c0, c0 + L * NV) with NV vectors of L lanes (NV = 1, 2; 4 in AVX-512 builds: a key's and a query's
 * broadcasts then serve 64 columns, 8 rows x 4 tokens 200-203 -> 178-185 us a layer, AMX Xeon): rec_cols_8 (__m256), and
 * in AVX-512 builds rec_cols_16 (__m512, whose lanes do the same arithmetic: every sum runs over i within its own
 * column, so the width changes no bit). */
#define REC_COLS(L, V, P)                                                                                           \
    static inline void rec_cols_##L(const Rec* r, int64_t c0, int NV) {                                             \
        const int64_t Kd = r->Kd, Vd = r->Vd, T = r->T, R = Kd + Vd + 1;                                            \
        V kv[4], nk[4], d[4], o[4];                                                                                 \
        for (int u = 0; u < NV; u++) kv[u] = P##_setzero_ps();                                                      \
        const V g0 = P##_set1_ps(r->g[0]);                                                                          \
        for (int64_t i = 0; i < Kd; i++) {                                                                          \
            const V ki = P##_set1_ps(r->k[0][i]);                                                                   \
            for (int u = 0; u < NV; u++)                                                                            \
                kv[u] = P##_fmadd_ps(ki, P##_mul_ps(P##_loadu_ps(r->S + i * Vd + c0 + L * u), g0), kv[u]);         \
        }                                                                                                           \
        for (int64_t t = 0; t < T; t++) {                                                                           \
            const float* Sp = t == 0 ? r->S + c0 : r->scratch; /* the state before token t, these columns */       \
            const int64_t sp = t == 0 ? Vd : DN_COLS;                                                               \
            float* Sn = t + 1 < T ? r->scratch : r->last ? r->last + c0 : NULL;                                     \
            const int64_t sn = t + 1 < T ? DN_COLS : Vd;                                                            \
            const V gt = P##_set1_ps(r->g[t]), bt = P##_set1_ps(r->beta[t]);                                       \
            for (int u = 0; u < NV; u++) {                                                                          \
                d[u] = P##_mul_ps(P##_sub_ps(P##_loadu_ps(r->v[t] + c0 + L * u), kv[u]), bt);                       \
                o[u] = nk[u] = P##_setzero_ps();                                                                    \
                if (r->upd) P##_storeu_ps(r->upd + t * R + Kd + c0 + L * u, d[u]);                                  \
            }                                                                                                       \
            const float *qt = r->q[t], *kt = r->k[t];                                                               \
            if (t + 1 < T) {                                                                                        \
                const float* kn = r->k[t + 1];                                                                      \
                const V gn = P##_set1_ps(r->g[t + 1]);                                                              \
                for (int64_t i = 0; i < Kd; i++) {                                                                  \
                    const V ki = P##_set1_ps(kt[i]), qi = P##_set1_ps(qt[i]), ni = P##_set1_ps(kn[i]);              \
                    for (int u = 0; u < NV; u++) {                                                                  \
                        const V s = P##_loadu_ps(Sp + i * sp + L * u);                                              \
                        const V x = P##_fmadd_ps(ki, d[u], t == 0 ? P##_mul_ps(s, gt) : s);                         \
                        const V xg = P##_mul_ps(x, gn); /* S' decayed for token t + 1: the scratch keeps it */      \
                        P##_storeu_ps(Sn + i * sn + L * u, xg);                                                     \
                        o[u] = P##_fmadd_ps(qi, x, o[u]);                                                           \
                        nk[u] = P##_fmadd_ps(ni, xg, nk[u]);                                                        \
                    }                                                                                               \
                }                                                                                                   \
            } else                                                                                                  \
                for (int64_t i = 0; i < Kd; i++) {                                                                  \
                    const V ki = P##_set1_ps(kt[i]), qi = P##_set1_ps(qt[i]);                                       \
                    for (int u = 0; u < NV; u++) {                                                                  \
                        const V s = P##_loadu_ps(Sp + i * sp + L * u);                                              \
                        const V x = P##_fmadd_ps(ki, d[u], t == 0 ? P##_mul_ps(s, gt) : s);                         \
                        if (Sn) P##_storeu_ps(Sn + i * sn + L * u, x);                                              \
                        o[u] = P##_fmadd_ps(qi, x, o[u]);                                                           \
                    }                                                                                               \
                }                                                                                                   \
            for (int u = 0; u < NV; u++) {                                                                          \
                P##_storeu_ps(r->o + t * Vd + c0 + L * u, o[u]);                                                    \
                kv[u] = nk[u];                                                                                      \
            }                                                                                                       \
        }                                                                                                           \
    }
REC_COLS(8, __m256, _mm256)
#if defined(__AVX512F__)
REC_COLS(16, __m512, _mm512)
#endif
#undef REC_COLS

/* one column j (the tail past the vectors), the same arithmetic */
static void rec_col(const Rec* r, int64_t j) {
    const int64_t Kd = r->Kd, Vd = r->Vd, T = r->T, R = Kd + Vd + 1;
    float kv = 0.0f;
    for (int64_t i = 0; i < Kd; i++) kv = fmaf(r->k[0][i], r->S[i * Vd + j] * r->g[0], kv);
    for (int64_t t = 0; t < T; t++) {
        const float* Sp = t == 0 ? r->S + j : r->scratch;
        const int64_t sp = t == 0 ? Vd : DN_COLS;
        float* Sn = t + 1 < T ? r->scratch : r->last ? r->last + j : NULL;
        const int64_t sn = t + 1 < T ? DN_COLS : Vd;
        const float d = (r->v[t][j] - kv) * r->beta[t];
        if (r->upd) r->upd[t * R + Kd + j] = d;
        float o = 0.0f, nk = 0.0f;
        for (int64_t i = 0; i < Kd; i++) {
            const float x = fmaf(r->k[t][i], d, t == 0 ? Sp[i * sp] * r->g[t] : Sp[i * sp]);
            const float xg = t + 1 < T ? x * r->g[t + 1] : x; /* (as rec_cols: the scratch keeps S' decayed) */
            if (Sn) Sn[i * sn] = t + 1 < T ? xg : x;
            o = fmaf(r->q[t][i], x, o);
            if (t + 1 < T) nk = fmaf(r->k[t + 1][i], xg, nk);
        }
        r->o[t * Vd + j] = o;
        kv = nk;
    }
}

static void recurrence(const Rec* r) {
    const int64_t Kd = r->Kd, Vd = r->Vd, R = Kd + Vd + 1;
    if (r->upd)
        for (int64_t t = 0; t < r->T; t++) { /* each token's key and decay beside its delta */
            memcpy(r->upd + t * R, r->k[t], sizeof(float) * (size_t)Kd);
            r->upd[t * R + Kd + Vd] = r->g[t];
        }
    int64_t c = 0;
#if defined(__AVX512F__)
    for (; c + 64 <= Vd; c += 64) rec_cols_16(r, c, 4);
    for (; c + 32 <= Vd; c += 32) rec_cols_16(r, c, 2);
    for (; c + 16 <= Vd; c += 16) rec_cols_16(r, c, 1);
#endif
    for (; c + 16 <= Vd; c += 16) rec_cols_8(r, c, 2);
    for (; c + 8 <= Vd; c += 8) rec_cols_8(r, c, 1);
    for (; c < Vd; c++) rec_col(r, c);
}

/* deltanet_decode's arguments and what it derives from them, for `decode_work` */
typedef struct {
    Shape s;
    int64_t C, W, rep, sb0, sb1, sa0, sa1, sz0, sz1;
    size_t esize;
    float qscale, eps;
    int in_place;
    const void *window, *taps, *b, *a, *z, *norm_w;
    const float *A_log, *dt_bias, *ssm;
    float *qkv, *updates;
    void* out;
    int* failed;
} Decode;

/* deltanet_decode's work, run by every thread of its parallel region (the `omp for` loops split it), or by the calling
 * thread alone (the loops run whole: no region entered, native.h PARALLEL_FOR) */
static void decode_work(const Decode* d) {
    const Shape s = d->s;
    const int64_t B = s.B, T = s.T, Hk = s.Hk, Hv = s.Hv, Kd = s.Kd, Vd = s.Vd, C = d->C, W = d->W, rep = d->rep;
    const int64_t sb0 = d->sb0, sb1 = d->sb1, sa0 = d->sa0, sa1 = d->sa1, sz0 = d->sz0, sz1 = d->sz1;
    const int bf16 = s.bf16, in_place = d->in_place;
    const size_t esize = d->esize;
    const float qscale = d->qscale, eps = d->eps;
    const void *window = d->window, *taps = d->taps, *b = d->b, *a = d->a, *z = d->z, *norm_w = d->norm_w;
    const float *A_log = d->A_log, *dt_bias = d->dt_bias, *ssm = d->ssm;
    float *qkv = d->qkv, *updates = d->updates;
    void* out = d->out;
    int* failed = d->failed;
    /* 1: conv, SiLU and norms, split over (row, token, head): blocks of CONV_BLOCK_MAX tokens, then (AVX-512) a
     * block of 8, then the rest one by one */
    const int64_t parts = 2 * Hk + Hv, TB = T / CONV_BLOCK_MAX, T8 = (T - CONV_BLOCK_MAX * TB) / 8;
    const int64_t tail = T - CONV_BLOCK_MAX * TB - 8 * T8;
#pragma omp for schedule(static)
    for (int64_t w = 0; w < B * (TB + T8) * parts; w++) {
        const int64_t rb = w / parts, p = w % parts, r = rb / (TB + T8), b = rb % (TB + T8);
        const int64_t t0 = b < TB ? b * CONV_BLOCK_MAX : TB * CONV_BLOCK_MAX;
        const int64_t c0 = p < 2 * Hk ? p * Kd : 2 * Hk * Kd + (p - 2 * Hk) * Vd;
        const int64_t n = p < 2 * Hk ? Kd : Vd;
        float cm[n * CONV_BLOCK_MAX];
        const void* wr = (const char*)window + (size_t)(r * C * W) * esize;
        float* dst = qkv + (r * T + t0) * C + c0;
#if CONV_BLOCK_MAX == 16
        if (b < TB) conv_block_16(&s, wr, taps, t0, c0, n, p < 2 * Hk, p < Hk ? qscale : 1.0f, dst, C, cm);
        else
#endif
            conv_block_8(&s, wr, taps, t0, c0, n, p < 2 * Hk, p < Hk ? qscale : 1.0f, dst, C, cm);
    }
#pragma omp for schedule(static)
    for (int64_t w = 0; w < (tail ? B * parts : 0); w++) {
        const int64_t r = w / parts, p = w % parts, t0 = T - tail;
        const int64_t c0 = p < 2 * Hk ? p * Kd : 2 * Hk * Kd + (p - 2 * Hk) * Vd;
        const int64_t n = p < 2 * Hk ? Kd : Vd;
        float* dst = qkv + (r * T + t0) * C + c0;
        conv_tokens(&s, (const char*)window + (size_t)(r * C * W) * esize, taps, t0, c0, n, dst, C);
        if (p < 2 * Hk)
            for (int64_t t = 0; t < tail; t++) l2norm(dst + t * C, n, p < Hk ? qscale : 1.0f);
    }
    /* 2: the recurrence and the gated norm, split over (row, value head) */
    /* per thread: q, k, v of each token (3T pointers, first: aligned as malloc aligns), then the floats */
    const float** ptrs = malloc(3 * sizeof(float*) * (size_t)T + sizeof(float) * (size_t)(Kd * DN_COLS + T * Vd + Vd + 2 * T));
    float* scratch = ptrs ? (float*)(ptrs + 3 * T) : NULL;
    if (!scratch) {
#pragma omp atomic write
        *failed = 1;
    }
#pragma omp for schedule(static)
    for (int64_t w = 0; w < B * Hv; w++) {
        if (!scratch) continue;
        const int64_t r = w / Hv, h = w % Hv, hk = h / rep;
        float *o = scratch + Kd * DN_COLS, *gate = o + T * Vd, *g = gate + Vd, *beta = g + T;
        const float neg_A = -expf(A_log[h]);
        for (int64_t t = 0; t < T; t++) {
            const float* x = qkv + (r * T + t) * C;
            ptrs[t] = x + hk * Kd;
            ptrs[T + t] = x + Hk * Kd + hk * Kd;
            ptrs[2 * T + t] = x + 2 * Hk * Kd + h * Vd;
            beta[t] = 1.0f / (1.0f + expf(-load(b, r * sb0 + t * sb1 + h, bf16)));
            g[t] = expf(neg_A * softplus(load(a, r * sa0 + t * sa1 + h, bf16) + dt_bias[h]));
        }
        const Rec rec = {T, Kd, Vd, ssm + w * Kd * Vd, in_place ? updates + w * Kd * Vd : NULL, ptrs, ptrs + T,
                         ptrs + 2 * T, g, beta, in_place ? NULL : updates + w * T * (Kd + Vd + 1), o, scratch};
        recurrence(&rec);
        for (int64_t t = 0; t < T; t++) { /* gated RMSNorm: w * rmsnorm(o) * silu(z), with the eager step's roundings */
            float* ot = o + t * Vd;
            const int64_t zo = r * sz0 + t * sz1 + h * Vd, oo = (r * T + t) * Hv * Vd + h * Vd, V8 = Vd / 8 * 8;
            if (bf16) {
                for (int64_t j = 0; j < V8; j += 8) _mm256_storeu_ps(ot + j, round_bf16x8(_mm256_loadu_ps(ot + j)));
                for (int64_t j = V8; j < Vd; j++) ot[j] = round_bf16(ot[j]);
            }
            float ss = 0.0f; /* (in order: the eager step's sum) */
            for (int64_t j = 0; j < Vd; j++) ss += ot[j] * ot[j];
            const float rr = 1.0f / sqrtf(ss / (float)Vd + eps);
            if (bf16) {
                for (int64_t j = 0; j < V8; j += 8) _mm256_storeu_ps(gate + j, bf16x8_to_f((const uint16_t*)z + zo + j));
                for (int64_t j = V8; j < Vd; j++) gate[j] = load(z, zo + j, 1);
            } else
                memcpy(gate, (const float*)z + zo, sizeof(float) * (size_t)Vd);
            silu_n(gate, Vd);
            const __m256 r8 = _mm256_set1_ps(rr);
            for (int64_t j = 0; j < V8; j += 8) { /* the scalar loop's arithmetic, 8 lanes at a time */
                __m256 y = _mm256_mul_ps(_mm256_loadu_ps(ot + j), r8);
                if (bf16) {
                    y = round_bf16x8(_mm256_mul_ps(round_bf16x8(y), bf16x8_to_f((const uint16_t*)norm_w + j)));
                    f_to_bf16x8((uint16_t*)out + oo + j, _mm256_mul_ps(y, _mm256_loadu_ps(gate + j)));
                } else
                    _mm256_storeu_ps((float*)out + oo + j,
                                     _mm256_mul_ps(_mm256_mul_ps(y, _mm256_loadu_ps((const float*)norm_w + j)),
                                                   _mm256_loadu_ps(gate + j)));
            }
            for (int64_t j = V8; j < Vd; j++) {
                float y = ot[j] * rr;
                if (bf16) y = round_bf16(round_bf16(y) * load(norm_w, j, 1));
                else y = y * load(norm_w, j, 0);
                store(out, oo + j, y * gate[j], bf16);
            }
        }
    }
    free(ptrs);
}

/* window [B, C, kernel-1+T], taps [C, kernel]; b and a [B, T, Hv] at row strides (sb0, sb1) and (sa0, sa1); A_log and
 * dt_bias fp32 [Hv]; z [B, T, Hv*Vd] at strides (sz0, sz1); norm_w [Vd]; ssm fp32 [B, Hv, Kd, Vd] (read only) ->
 * updates fp32 [B, Hv, T, Kd + Vd + 1] (each token's update of the state: its key, delta and decay, `recurrence`;
 * `deltanet_keep` applies the first n), out [B, T, Hv*Vd] (the gated norm's output). updates may be ssm: the state is
 * then updated in place to the state after the last token, with the same arithmetic, and no update is kept (a plain
 * step, T = 1, or a prompt's chunk: the prefill then computes what T plain steps would).
 * C = 2*Hk*Kd + Hv*Vd (all q heads, all k heads, all v heads); Hv a multiple of Hk. 0, or -1 when out of memory. */
int deltanet_decode(int64_t B, int64_t T, int64_t Hk, int64_t Hv, int64_t Kd, int64_t Vd, int64_t kernel, int bf16,
                    const void* window, const void* taps, const void* b, int64_t sb0, int64_t sb1, const void* a,
                    int64_t sa0, int64_t sa1, const float* A_log, const float* dt_bias, const void* z, int64_t sz0,
                    int64_t sz1, const void* norm_w, float eps, const float* ssm, float* updates, void* out,
                    int nthreads) {
    const Shape s = {B, T, Hk, Hv, Kd, Vd, kernel, bf16};
    const int64_t C = 2 * Hk * Kd + Hv * Vd, W = kernel - 1 + T, rep = Hv / Hk;
    const size_t esize = bf16 ? 2 : 4;
    const float qscale = 1.0f / sqrtf((float)Kd);
    /* conv outputs of every (row, token): q [Hk, Kd], k [Hk, Kd], v [Hv, Vd], normalised in place */
    float* qkv = malloc(sizeof(float) * (size_t)(B * T * C));
    if (!qkv) return -1;
    int failed = 0;
    const int in_place = updates == ssm;
    const Decode d = {s, C, W, rep, sb0, sb1, sa0, sa1, sz0, sz1, esize, qscale, eps, in_place, window, taps, b, a, z,
                      norm_w, A_log, dt_bias, ssm, qkv, updates, out, &failed};
    if (nthreads > 1) {
#pragma omp parallel num_threads(nthreads)
        decode_work(&d);
    } else
        decode_work(&d);
    free(qkv);
    return failed ? -1 : 0;
}

/* keep_head's columns j.., 64 at a time in registers through every update (V, P: the vector type and intrinsics' prefix,
 * L lanes) */
#define KEEP64(V, P, L)                                                                                             \
    for (; j + 64 <= Vd; j += 64) {                                                                                 \
        V x[64 / L];                                                                                                \
        for (int u = 0; u < 64 / L; u++) x[u] = P##_loadu_ps(row + j + L * u);                                     \
        for (int64_t t = 0; t < keep; t++) {                                                                        \
            const float* up = U + t * R;                                                                            \
            const V g = P##_set1_ps(up[Kd + Vd]), k = P##_set1_ps(up[i]);                                           \
            for (int u = 0; u < 64 / L; u++)                                                                        \
                x[u] = P##_fmadd_ps(k, P##_loadu_ps(up + Kd + j + L * u), P##_mul_ps(x[u], g));                     \
        }                                                                                                           \
        for (int u = 0; u < 64 / L; u++) P##_storeu_ps(row + j + L * u, x[u]);                                      \
    }
/* deltanet_keep (below) of row w / Hv, value head w % Hv */
static void keep_head(int64_t w, int64_t Hv, int64_t T, int64_t Kd, int64_t Vd, const int64_t* n, const float* updates,
                      float* ssm, int64_t C, int64_t kernel, int64_t esize, const void* window, void* conv) {
    const int64_t W = kernel - 1 + T, keep_w = (kernel - 1) * esize, R = Kd + Vd + 1;
    const int64_t r = w / Hv, h = w % Hv, keep = n[r];
    if (keep <= 0 || keep > T) return;
    const float* U = updates + w * T * R;
    for (int64_t i = 0; i < Kd; i++) {
        float* row = ssm + (w * Kd + i) * Vd;
        int64_t j = 0;
#if defined(__AVX512F__) /* 16 lanes a vector: each element's operations as the 8-lane code's (the same bits; 8 lanes
                          * took 40-50 us of a 4-token verify's round on the shipped model, int4) */
        KEEP64(__m512, _mm512, 16)
#endif
        KEEP64(__m256, _mm256, 8)
        for (; j + 8 <= Vd; j += 8) {
            __m256 x = _mm256_loadu_ps(row + j);
            for (int64_t t = 0; t < keep; t++) {
                const float* up = U + t * R;
                x = _mm256_fmadd_ps(_mm256_set1_ps(up[i]), _mm256_loadu_ps(up + Kd + j),
                                    _mm256_mul_ps(x, _mm256_set1_ps(up[Kd + Vd])));
            }
            _mm256_storeu_ps(row + j, x);
        }
        for (; j < Vd; j++) {
            float x = row[j];
            for (int64_t t = 0; t < keep; t++) x = fmaf(U[t * R + i], U[t * R + Kd + j], x * U[t * R + Kd + Vd]);
            row[j] = x;
        }
    }
    for (int64_t c = h * C / Hv; c < (h + 1) * C / Hv; c++) /* this row's conv channels, split over its heads */
        memcpy((char*)conv + (r * C + c) * keep_w, (const char*)window + ((r * C + c) * W + keep) * esize, (size_t)keep_w);
}
#undef KEEP64

/* keep_at: row r of ssm [B, Hv, Kd, Vd] := its state after the first n[r] tokens of updates [B, Hv, T, Kd + Vd + 1]
 * (`deltanet_decode`'s: S[i][j] = fma(k_t[i], d_t[j], S[i][j] * g_t) for t < n[r], the step's own arithmetic, so the
 * state is the plain steps' bit for bit; row by row, every update applied while the row is in registers: the state is
 * read and written once) and row r of the conv inputs conv [B, C, kernel-1] := window[r, :, n[r] : n[r] + kernel-1]
 * (window [B, C, kernel-1+T], esize bytes an element) where n[r] > 0; a row with n[r] = 0 keeps its own. */
void deltanet_keep(int64_t B, int64_t Hv, int64_t T, int64_t Kd, int64_t Vd, const int64_t* n, const float* updates,
                   float* ssm, int64_t C, int64_t kernel, int64_t esize, const void* window, void* conv, int nthreads) {
    PARALLEL_FOR(1, w, B * Hv, { keep_head(w, Hv, T, Kd, Vd, n, updates, ssm, C, kernel, esize, window, conv); });
}

typedef struct { /* one layer's deltanet_keep: the cache's state and conv inputs, the forward's steps */
    int64_t B, Hv, T, Kd, Vd, C, kernel, esize;
    const float* updates;
    float* ssm;
    const void* window;
    void* conv;
} Keep;

/* deltanet_keep for L layers at once (Cache.keep_at after a decode forward: one call, not one per layer). */
void deltanet_keep_layers(int64_t L, const Keep* k, const int64_t* n, int nthreads) {
    for (int64_t i = 0; i < L; i++)
        deltanet_keep(k[i].B, k[i].Hv, k[i].T, k[i].Kd, k[i].Vd, n, k[i].updates, k[i].ssm, k[i].C, k[i].kernel, k[i].esize,
                      k[i].window, k[i].conv, nthreads);
}
