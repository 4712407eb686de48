/* Decode attention for CPU decoding, built and loaded by native.py and called by attention.py (`attend_decode`): each
 * query of a decode forward over exactly the cached keys at positions <= its own, softmax in fp32.
 *
 * Row-invariant by construction: a query's output is computed from its own row of q and the keys it sees, by the
 * same code in the same order whatever the batch, the width T and the cache length, so a verify row and a batch row
 * are bit for bit their plain step (eager SDPA over a slice of the cache did the same at ~1 ms a call at the 0.8B
 * shape: it is built for long queries). Dot products run in 8 fixed lanes, summed in a fixed tree; built with
 * -ffp-contract=off. The softmax's exp is native.h's vector exp (~1 ulp, as libm's).
 *
 * The work is split by (row, kv head): the G*T queries that read one kv head (its G query heads, at T positions) go
 * through its keys and values together, VBLOCK at a time, so each key and value is widened to fp32 once per call rather
 * than once per query; every query still reduces over its own keys in their order, so its arithmetic is the one-query
 * form's (8 rows x 4 tokens over ~400 keys, 6 heads over 2: 934 -> 545 us a call, one thread, AMX Xeon, the same bits;
 * docs/decisions.md, 2026-12-05 fourth session). In the AVX-512 build the values (64 a row) are widened in registers
 * as they are read, not copied first; a bf16 model's scores take fused multiply-adds (a product of two bf16 values is
 * exact in fp32, so the fused form rounds what mul + add rounds: the same bits unless a product falls below 2^-126);
 * a query's softmax total is summed as its weights are made, 8 lanes then a fixed tree (`exp_shifted`: an 8-row call
 * over 400 keys 153 -> 134 us against a total in order; docs/decisions.md, 2026-12-07 eighteenth session). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

/* n values (bf16 or fp32) -> fp32 (exact), 8 at a time (one at a time, the widening loop was ~10% of a verify's
 * attention in perf) */
static void widen(const void* src, int64_t n, int bf16, float* dst) {
    if (!bf16) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return;
    }
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, bf16x8_to_f((const uint16_t*)src + i));
    for (; i < n; i++) dst[i] = bf16_to_f(((const uint16_t*)src)[i]);
}

/* sum of a[i] * b[i] over D (% 8 == 0) in 8 lanes, lane l taking i = l mod 8 in order, then the lanes as
 * ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)) */
static inline float lanes8_sum(__m256 acc) {
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1)); /* l0+l4 .. l3+l7 */
    const __m128 h = _mm_hadd_ps(s4, s4); /* (l0+l4)+(l1+l5), (l2+l6)+(l3+l7) */
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

static inline float dot8(const float* a, const float* b, int64_t D) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 8) acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    return lanes8_sum(acc);
}

#if defined(__AVX512F__)
/* dot8 of one query against 8 keys as 4 pairs side by side: q2 holds the query's 8-value chunks twice ([c0 c0 c1 c1
 * ...], 2D floats), kp 4 pairs of keys, each pair's chunks side by side ([k c0, k' c0, k c1, k' c1, ...], 2D floats a
 * pair) -> the 8 scores. Each half of a pair's 16 lanes runs dot8's lanes for its key in dot8's order, then dot8's
 * tree: the same scores, bit for bit, in half the multiplies (and 4 chains in flight). */
static inline __m256 dot8_pairs4(const float* q2, const float* kp, int64_t D, int fma) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    if (fma) /* bf16 inputs: each product is exact in fp32, so the fused multiply-add rounds what mul + add rounds */
        for (int64_t i = 0; i < 2 * D; i += 16) {
            const __m512 qi = _mm512_loadu_ps(q2 + i);
            for (int u = 0; u < 4; u++) acc[u] = _mm512_fmadd_ps(qi, _mm512_loadu_ps(kp + u * 2 * D + i), acc[u]);
        }
    else
        for (int64_t i = 0; i < 2 * D; i += 16) {
            const __m512 qi = _mm512_loadu_ps(q2 + i);
            for (int u = 0; u < 4; u++) acc[u] = _mm512_add_ps(acc[u], _mm512_mul_ps(qi, _mm512_loadu_ps(kp + u * 2 * D + i)));
        }
    /* lanes8_sum's tree for the 8 keys at once, in vertical adds (the same adds of the same values: the same bits; the
     * 8 horizontal sums and their scalar stores were most of a verify's attention): acc[u] holds keys 2u, 2u + 1 as 128-bit
     * quarters [lo, hi, lo', hi'] */
    const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(acc[0], acc[1], 0x88), _mm512_shuffle_f32x4(acc[0], acc[1], 0xDD));
    const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2], acc[3], 0x88), _mm512_shuffle_f32x4(acc[2], acc[3], 0xDD));
    /* s01: quarter k (keys 0..3) = l0+l4, l1+l5, l2+l6, l3+l7 of key k; s23: keys 4..7 */
    const __m512 h = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x88), _mm512_shuffle_ps(s01, s23, 0xDD));
    /* h: quarter k = [(l0+l4)+(l1+l5), (l2+l6)+(l3+l7)] of key k, then the same of key k + 4 */
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(h, h, 0x88), _mm512_shuffle_ps(h, h, 0xDD));
    /* r: quarter k = [key k, key k + 4, key k, key k + 4]: lanes 0, 4, 8, 12, then 1, 5, 9, 13 are keys 0..7 */
    return _mm512_castps512_ps256(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0), r));
}

/* keys [n][D] (bf16 or fp32) -> kp in dot8_pairs4's layout, pairs (0, 1), (2, 3), ..., zeros past the last key up to
 * a multiple of 8 keys */
static void widen_pairs(const void* src, int64_t n, int64_t D, int bf16, float* kp) {
    if (bf16) { /* a pair's two 8-value chunks as one 16-lane widening (8 at a time took a fifth of a short call) */
        const uint16_t* k = src;
        const __m128i zero = _mm_setzero_si128();
        for (int64_t j = 0; j < (n + 7) / 8 * 8; j += 2)
            for (int64_t c = 0; c < D; c += 8) {
                const __m128i a = j < n ? _mm_loadu_si128((const __m128i*)(k + j * D + c)) : zero;
                const __m128i b = j + 1 < n ? _mm_loadu_si128((const __m128i*)(k + (j + 1) * D + c)) : zero;
                const __m256i ab = _mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1);
                _mm512_storeu_ps(kp + j * D + 2 * c, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(ab), 16)));
            }
        return;
    }
    for (int64_t j = 0; j < (n + 7) / 8 * 8; j += 2)
        for (int64_t c = 0; c < D; c += 8)
            for (int u = 0; u < 2; u++) {
                float* dst = kp + j * D + 2 * c + 8 * u;
                if (j + u < n)
                    widen((const char*)src + (size_t)((j + u) * D + c) * (bf16 ? 2 : 4), 8, bf16, dst);
                else
                    memset(dst, 0, sizeof(float) * 8);
            }
}
#endif

/* p[j] := exp(p[j] - m) for j < n, 8 at a time (native.h's exp8: the same arithmetic for every lane, so a score's
 * weight does not depend on where it sits; the tail through the same vector code) -> their total: lane l adds the
 * weights j = l mod 8 in order, then lanes8_sum's tree (a fixed order for n weights, whatever the other queries; a
 * total in order, one add's latency a weight, took ~16% of an 8-row step's attention) */
static float exp_shifted(float* p, int64_t n, float m) {
    const __m256 mv = _mm256_set1_ps(m);
    __m256 total = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 w = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), mv));
        _mm256_storeu_ps(p + j, w);
        total = _mm256_add_ps(total, w);
    }
    if (j < n) {
        float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        memcpy(tail, p + j, sizeof(float) * (size_t)(n - j));
        _mm256_storeu_ps(tail, exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), mv)));
        memcpy(p + j, tail, sizeof(float) * (size_t)(n - j));
        memset(tail + (n - j), 0, sizeof(float) * (size_t)(8 - (n - j))); /* (the lanes past n add nothing) */
        total = _mm256_add_ps(total, _mm256_loadu_ps(tail));
    }
    return lanes8_sum(total);
}

/* Both kernels' arguments: q [B, A, T, D] at strides (sq0, sq1, sq2) (last 1), k [B, Hk, S, D] and v [B, Hk, S, Dv]
 * contiguous, starts [B] (row b's token t sits at position starts[b] + t) -> out [B, A, T, Dv] contiguous, in the model
 * dtype (bf16 or fp32). D % 8 == 0. Query head a reads kv head a / G, G = A / Hk; Q = G * T queries a kv head. */
typedef struct {
    int64_t B, A, T, Hk, S, D, Dv, G, Q, sq0, sq1, sq2;
    int bf16;
    const void *q, *k, *v;
    const int64_t* starts;
    float scale;
    void* out;
} Attn;

/* The Q queries that read kv head h of row b (its G query heads at T positions): each one's key count (0..its
 * position; 0 past the cache, which the caller checks) into n [Q] and its row widened into qf [Q][D] -> the most keys
 * any of them sees */
static int64_t head_queries(const Attn* a, int64_t b, int64_t h, int64_t* n, float* qf) {
    int64_t most = 0, nq = 0;
    for (int64_t g = 0; g < a->G; g++)
        for (int64_t t = 0; t < a->T; t++, nq++) {
            n[nq] = a->starts[b] + t + 1 > a->S ? 0 : a->starts[b] + t + 1;
            most = n[nq] > most ? n[nq] : most;
            const size_t at = (size_t)(b * a->sq0 + (h * a->G + g) * a->sq1 + t * a->sq2) * (a->bf16 ? 2 : 4);
            widen((const char*)a->q + at, a->D, a->bf16, qf + nq * a->D);
        }
    return most;
}

/* head(a, b, h, buf, n) for every row b and kv head h, threads splitting the pairs, each thread with its own scratch
 * buf of `floats` floats and key counts n [Q] -> 0, or -1 when a thread's scratch could not be allocated */
typedef void (*Head)(const Attn*, int64_t, int64_t, float*, int64_t*);
/* each_kv_head's work, run by every thread of its region (the `omp for` splits the pairs) or by the calling thread
 * alone (no region entered: native.h PARALLEL_FOR) */
static void kv_heads_work(const Attn* a, size_t floats, Head head, int* failed) {
    float* buf = malloc(sizeof(float) * floats);
    int64_t* n = malloc(sizeof(int64_t) * (size_t)a->Q);
    if (!buf || !n) {
#pragma omp atomic write
        *failed = 1;
    }
#pragma omp for schedule(static)
    for (int64_t w = 0; w < a->B * a->Hk; w++)
        if (buf && n) head(a, w / a->Hk, w % a->Hk, buf, n);
    free(buf);
    free(n);
}

static int each_kv_head(const Attn* a, size_t floats, Head head, int nthreads) {
    int failed = 0;
    if (nthreads > 1 && a->B * a->Hk > 1) {
#pragma omp parallel num_threads(nthreads)
        kv_heads_work(a, floats, head, &failed);
    } else
        kv_heads_work(a, floats, head, &failed);
    return failed ? -1 : 0;
}

/* acc[i] += p[j] * v[j][i] for j < n in order, i < Dv (v: n rows of Dv floats): each sum keeps its order over j (the
 * one-query form's), 64 of them in registers through the n values (they were loaded and stored again for every
 * value: at 8 rows x 4 tokens most of a call). */
#define VBLOCK 64
/* outputs i0.. of accumulate, 64 at a time in 64 / L vectors of L lanes (V, P: the vector type and intrinsics' prefix) */
#define ACCUMULATE64(V, P, L)                                                                                       \
    for (; i0 + 64 <= Dv; i0 += 64) {                                                                               \
        V a[64 / L];                                                                                                \
        for (int u = 0; u < 64 / L; u++) a[u] = P##_loadu_ps(acc + i0 + L * u);                                     \
        for (int64_t j = 0; j < n; j++) {                                                                           \
            const V pj = P##_set1_ps(p[j]);                                                                         \
            for (int u = 0; u < 64 / L; u++) a[u] = P##_add_ps(a[u], P##_mul_ps(pj, P##_loadu_ps(v + j * Dv + i0 + L * u))); \
        }                                                                                                           \
        for (int u = 0; u < 64 / L; u++) P##_storeu_ps(acc + i0 + L * u, a[u]);                                     \
    }
static void accumulate(float* acc, const float* p, const float* v, int64_t n, int64_t Dv) {
    int64_t i0 = 0;
#if defined(__AVX512F__) /* the same sums 16 lanes a vector (each output's own order over j: the same bits) */
    ACCUMULATE64(__m512, _mm512, 16)
#endif
    ACCUMULATE64(__m256, _mm256, 8)
    for (int64_t j = 0; j < n; j++)
        for (int64_t i = i0; i < Dv; i++) acc[i] += p[j] * v[j * Dv + i];
}

#if defined(__AVX512F__)
/* accumulate for R queries at once over their first n values (Dv == 64): acc[r] += p[r][j] * v[j] for j < n in order,
 * each query's sums in its own registers, so each keeps accumulate's order and bits; one query's 4 chains waited on
 * the add's latency at every value (a quarter of a verify's attention), R queries' 4R chains do not, and each value
 * row is loaded once for the R. */
#define ACCUMULATE_ROWS(R, NAME, E, LOAD16)                                                                         \
    static void NAME(float* const* acc, const float* const* p, const E* v, int64_t n) {                             \
        __m512 a[R][4];                                                                                             \
        for (int r = 0; r < R; r++)                                                                                 \
            for (int u = 0; u < 4; u++) a[r][u] = _mm512_loadu_ps(acc[r] + 16 * u);                                 \
        for (int64_t j = 0; j < n; j++) {                                                                           \
            __m512 vj[4];                                                                                           \
            for (int u = 0; u < 4; u++) vj[u] = LOAD16(v + j * 64 + 16 * u);                                       \
            for (int r = 0; r < R; r++) {                                                                           \
                const __m512 pj = _mm512_set1_ps(p[r][j]);                                                          \
                for (int u = 0; u < 4; u++) a[r][u] = _mm512_add_ps(a[r][u], _mm512_mul_ps(pj, vj[u]));            \
            }                                                                                                       \
        }                                                                                                           \
        for (int r = 0; r < R; r++)                                                                                 \
            for (int u = 0; u < 4; u++) _mm512_storeu_ps(acc[r] + 16 * u, a[r][u]);                                 \
    }
/* 16 values of a row, widened in the register (exact): the values are read where the cache holds them */
#define BF16X16(p) bf16x16_to_f(p, 16)
ACCUMULATE_ROWS(1, accumulate_1_bf16, uint16_t, BF16X16)
ACCUMULATE_ROWS(2, accumulate_2_bf16, uint16_t, BF16X16)
ACCUMULATE_ROWS(3, accumulate_3_bf16, uint16_t, BF16X16)
ACCUMULATE_ROWS(4, accumulate_4_bf16, uint16_t, BF16X16)
#undef BF16X16
ACCUMULATE_ROWS(1, accumulate_1_f32, float, _mm512_loadu_ps)
ACCUMULATE_ROWS(2, accumulate_2_f32, float, _mm512_loadu_ps)
ACCUMULATE_ROWS(3, accumulate_3_f32, float, _mm512_loadu_ps)
ACCUMULATE_ROWS(4, accumulate_4_f32, float, _mm512_loadu_ps)
/* acc[r] += p[r][j] * v[j] for R <= 4 queries over their first n values, v: rows of 64 values (bf16 or fp32) as the
 * cache holds them */
static void accumulate_rows(int R, float* const* acc, const float* const* p, const void* v, int bf16, int64_t n) {
    static void (*const b[4])(float* const*, const float* const*, const uint16_t*, int64_t) = {
        accumulate_1_bf16, accumulate_2_bf16, accumulate_3_bf16, accumulate_4_bf16};
    static void (*const f[4])(float* const*, const float* const*, const float*, int64_t) = {
        accumulate_1_f32, accumulate_2_f32, accumulate_3_f32, accumulate_4_f32};
    if (bf16) b[R - 1](acc, p, v, n);
    else f[R - 1](acc, p, v, n);
}
#undef ACCUMULATE_ROWS
#endif

/* one (row b, kv head h) of attend_decode; buf: its scratch (attend_decode says what it holds) */
static void decode_head(const Attn* a, int64_t b, int64_t h, float* buf, int64_t* n) {
    const int64_t A = a->A, T = a->T, Hk = a->Hk, S = a->S, D = a->D, Dv = a->Dv, G = a->G, Q = a->Q;
    const int bf16 = a->bf16;
    const size_t es = bf16 ? 2 : 4;
    const float scale = a->scale;
    float *qf = buf, *p = qf + Q * D, *acc = p + Q * S, *m = acc + Q * Dv, *sum = m + Q, *vf = sum + Q;
    const int64_t most = head_queries(a, b, h, n, qf);
    for (int64_t i_q = 0; i_q < Q; i_q++) m[i_q] = -INFINITY;
    const char* kb = (const char*)a->k + (size_t)((b * Hk + h) * S * D) * es;
    const char* vb = (const char*)a->v + (size_t)((b * Hk + h) * S * Dv) * es;
#if defined(__AVX512F__)
    float* q2 = vf + (D > Dv ? D : Dv) * VBLOCK;
    for (int64_t i_q = 0; i_q < Q; i_q++)
        for (int64_t c = 0; c < D; c += 8) {
            memcpy(q2 + i_q * 2 * D + 2 * c, qf + i_q * D + c, sizeof(float) * 8);
            memcpy(q2 + i_q * 2 * D + 2 * c + 8, qf + i_q * D + c, sizeof(float) * 8);
        }
#endif
    for (int64_t j0 = 0; j0 < most; j0 += VBLOCK) { /* VBLOCK keys widened, then each query's scores over them */
        const int64_t nj = most - j0 < VBLOCK ? most - j0 : VBLOCK;
#if defined(__AVX512F__)
        widen_pairs(kb + (size_t)(j0 * D) * es, nj, D, bf16, vf);
#else
        widen(kb + (size_t)(j0 * D) * es, nj * D, bf16, vf);
#endif
        for (int64_t i_q = 0; i_q < Q; i_q++) {
            const int64_t last = n[i_q] - j0 < nj ? n[i_q] - j0 : nj;
            float* pq = p + i_q * S + j0;
            float mq = m[i_q];
#if defined(__AVX512F__)
            __m256 mv = _mm256_set1_ps(mq);
            for (int64_t j = 0; j < last; j += 8) { /* (scores past `last`: of the zero padding, or unused) */
                const __m256 s = _mm256_mul_ps(dot8_pairs4(q2 + i_q * 2 * D, vf + j * D, D, bf16), _mm256_set1_ps(scale));
                const __mmask8 in = last - j >= 8 ? (__mmask8)0xff : (__mmask8)((1u << (last - j)) - 1);
                _mm256_mask_storeu_ps(pq + j, in, s);
                mv = _mm256_mask_max_ps(mv, in, mv, s); /* (the max of the same scores, whatever the order) */
            }
            float lanes[8];
            _mm256_storeu_ps(lanes, mv);
            for (int u = 0; u < 8; u++) mq = lanes[u] > mq ? lanes[u] : mq;
#else
            for (int64_t j = 0; j < last; j++) {
                const float s = dot8(qf + i_q * D, vf + j * D, D) * scale;
                pq[j] = s;
                mq = s > mq ? s : mq;
            }
#endif
            m[i_q] = mq;
        }
    }
    for (int64_t i_q = 0; i_q < Q; i_q++) {
        sum[i_q] = exp_shifted(p + i_q * S, n[i_q], m[i_q]);
        for (int64_t i = 0; i < Dv; i++) acc[i_q * Dv + i] = 0.0f;
    }
    for (int64_t j0 = 0; j0 < most; j0 += VBLOCK) { /* VBLOCK values, then each query's sums over them (read in place
                                                    * at Dv = 64 in the AVX-512 build, else widened first) */
        const int64_t nj = most - j0 < VBLOCK ? most - j0 : VBLOCK;
        int64_t i_q = 0;
#if defined(__AVX512F__)
        for (; Dv == 64 && i_q < Q; i_q += 4) { /* up to 4 queries at once over the values they all see */
            const int64_t R = Q - i_q < 4 ? Q - i_q : 4;
            float* accs[4];
            const float* ps[4];
            int64_t common = nj;
            for (int64_t r = 0; r < R; r++) {
                const int64_t last = n[i_q + r] - j0 < nj ? n[i_q + r] - j0 : nj;
                common = last < common ? last : common;
                accs[r] = acc + (i_q + r) * Dv;
                ps[r] = p + (i_q + r) * S + j0;
            }
            common = common > 0 ? common : 0;
            const char* vj = vb + (size_t)(j0 * Dv) * es;
            if (common > 0) accumulate_rows((int)R, accs, ps, vj, bf16, common);
            for (int64_t r = 0; r < R; r++) { /* a query's values past the common ones, in their order */
                const int64_t last = n[i_q + r] - j0 < nj ? n[i_q + r] - j0 : nj;
                const float* pr = ps[r] + common;
                if (last > common) accumulate_rows(1, accs + r, &pr, vj + (size_t)(common * Dv) * es, bf16, last - common);
            }
        }
        if (i_q < Q)
#endif
            widen(vb + (size_t)(j0 * Dv) * es, nj * Dv, bf16, vf);
        for (; i_q < Q; i_q++) {
            const int64_t last = n[i_q] - j0 < nj ? n[i_q] - j0 : nj;
            if (last > 0) accumulate(acc + i_q * Dv, p + i_q * S + j0, vf, last, Dv);
        }
    }
    for (int64_t g = 0, nq = 0; g < G; g++)
        for (int64_t t = 0; t < T; t++, nq++) {
            if (!n[nq]) continue;
            const float inv = 1.0f / sum[nq];
            const int64_t o = ((b * A + h * G + g) * T + t) * Dv;
            const float* aq = acc + nq * Dv;
            if (bf16)
                for (int64_t i = 0; i < Dv; i++) ((uint16_t*)a->out)[o + i] = to_bf16(aq[i] * inv);
            else
                for (int64_t i = 0; i < Dv; i++) ((float*)a->out)[o + i] = aq[i] * inv;
        }
}

int attend_decode(int64_t B, int64_t A, int64_t T, int64_t Hk, int64_t S, int64_t D, int64_t Dv, int bf16,
                  const void* q, int64_t sq0, int64_t sq1, int64_t sq2, const void* k, const void* v,
                  const int64_t* starts, float scale, void* out, int nthreads) {
    const Attn a = {B, A, T, Hk, S, D, Dv, A / Hk, A / Hk * T, sq0, sq1, sq2, bf16, q, k, v, starts, scale, out};
    const int64_t Q = a.Q;
#if defined(__AVX512F__)
    const int64_t Q2 = 2 * Q; /* each query's chunks twice (dot8_pairs4) */
#else
    const int64_t Q2 = 0;
#endif
    /* per query: its row (D), its scores over the keys (S), its running output (Dv), max and sum; then VBLOCK keys or
     * values widened, and (AVX-512) the queries' chunks twice */
    return each_kv_head(&a, (size_t)(Q * (D + S + Dv + 2) + (D > Dv ? D : Dv) * VBLOCK + Q2 * D), decode_head, nthreads);
}

/* Attention of a prompt's chunk (step.c, a prompt read in one call within linear.py's `prompt_products`): attend_decode's
 * arguments and result, for the many queries of a chunk, as blocked products: per (row, kv head) the keys are widened
 * once into blocks of L keys transposed ([D][L]), each query's scores come L keys a vector from fused multiply-adds
 * (4 queries x 2 blocks in flight), the softmax is fp32 (exp8 / exp16, masked past each query's own position), and the
 * values are summed Dv outputs a pass, L a vector. Other bits than attend_decode's (its sums run in other orders), so
 * only a prompt's chunks take it - every path reads a prompt with the same chunks - never a decode step or a verify.
 * attend_decode spends ~20 cycles on a (query, key) pair: a 2,048-token prompt read through it took 1.4x the layers'
 * SDPA prefill (docs/decisions.md, 2026-12-06 second session). L = 8 (AVX2) or, in AVX-512 builds, 16. */
#define PROMPT_QUERIES 4
/* outputs c0 .. c0 + W*L of the group's queries (prompt_head's variables), W a constant: every sum in a register */
#define PROMPT_VALUES(L, W, V, P)                                                                                  \
    {                                                                                                              \
        V r[PROMPT_QUERIES][W];                                                                                    \
        for (int u = 0; u < PROMPT_QUERIES; u++)                                                                   \
            for (int w = 0; w < W; w++) r[u][w] = P##_setzero_ps();                                               \
        const float* pq[PROMPT_QUERIES];                                                                           \
        for (int u = 0; u < PROMPT_QUERIES; u++) pq[u] = p + (u < nq ? u : 0) * pstride;                           \
        for (int64_t j = 0; j < most; j++) {                                                                       \
            V vj[W];                                                                                               \
            for (int w = 0; w < W; w++) vj[w] = P##_loadu_ps(vf + j * Dv + c0 + w * L);                            \
            for (int u = 0; u < PROMPT_QUERIES; u++) {                                                             \
                const V pj = P##_set1_ps(pq[u][j]);                                                                \
                for (int w = 0; w < W; w++) r[u][w] = P##_fmadd_ps(pj, vj[w], r[u][w]);                           \
            }                                                                                                      \
        }                                                                                                          \
        for (int u = 0; u < nq; u++) {                                                                             \
            const V inv = P##_set1_ps(1.0f / total[u]);                                                            \
            for (int w = 0; w < W; w++) P##_storeu_ps(o + (i0 + u) * Dv + c0 + w * L, P##_mul_ps(r[u][w], inv));   \
        }                                                                                                          \
    }
#define PROMPT_ATTEND(L, NV, V, P, EXP, MASK_LT)                                                                         \
    static void prompt_head_##L(const float* qf, int64_t Q, int64_t D, int64_t Dv, const int64_t* n,                \
                                const float* kt, const float* vf, float scale, float* p, int64_t pstride, float* o) { \
        for (int64_t i0 = 0; i0 < Q; i0 += PROMPT_QUERIES) {                                                        \
            const int nq = (int)(Q - i0 < PROMPT_QUERIES ? Q - i0 : PROMPT_QUERIES);                                \
            int64_t most = 0;                                                                                       \
            for (int u = 0; u < nq; u++) most = n[i0 + u] > most ? n[i0 + u] : most;                                \
            const int64_t nb = (most + L - 1) / L;                                                                  \
            V mx[PROMPT_QUERIES];                                                                                   \
            for (int u = 0; u < PROMPT_QUERIES; u++) mx[u] = P##_set1_ps(-INFINITY);                                \
            for (int64_t b = 0; b < nb; b += 2) { /* (kt holds an even number of blocks) */                         \
                V acc[PROMPT_QUERIES][2];                                                                           \
                for (int u = 0; u < PROMPT_QUERIES; u++) acc[u][0] = acc[u][1] = P##_setzero_ps();                  \
                const float* k0 = kt + b * D * L;                                                                   \
                for (int64_t d = 0; d < D; d++) {                                                                   \
                    const V a = P##_loadu_ps(k0 + d * L), c = P##_loadu_ps(k0 + (D + d) * L);                       \
                    for (int u = 0; u < PROMPT_QUERIES; u++) {                                                      \
                        const V qd = P##_set1_ps(qf[(i0 + (u < nq ? u : 0)) * D + d]);                              \
                        acc[u][0] = P##_fmadd_ps(qd, a, acc[u][0]);                                                 \
                        acc[u][1] = P##_fmadd_ps(qd, c, acc[u][1]);                                                 \
                    }                                                                                               \
                }                                                                                                   \
                for (int u = 0; u < nq; u++)                                                                        \
                    for (int h = 0; h < 2 && b + h < nb; h++) {                                                     \
                        V s = P##_mul_ps(acc[u][h], P##_set1_ps(scale));                                            \
                        s = MASK_LT(s, n[i0 + u] - (b + h) * L); /* keys past the query's position: -inf */        \
                        P##_storeu_ps(p + u * pstride + (b + h) * L, s);                                            \
                        mx[u] = P##_max_ps(mx[u], s);                                                               \
                    }                                                                                               \
            }                                                                                                       \
            float total[PROMPT_QUERIES] = {1.0f, 1.0f, 1.0f, 1.0f};                                                  \
            for (int u = 0; u < nq; u++) {                                                                          \
                float lanes[L], m = -INFINITY;                                                                      \
                P##_storeu_ps(lanes, mx[u]);                                                                        \
                for (int l = 0; l < L; l++) m = lanes[l] > m ? lanes[l] : m;                                        \
                float* pu = p + u * pstride;                                                                        \
                const int64_t nk = n[i0 + u], full = nk / L * L;                                                    \
                V sum = P##_setzero_ps();                                                                           \
                for (int64_t j = 0; j < nk; j += L) {                                                               \
                    V e = EXP(P##_sub_ps(P##_loadu_ps(pu + j), P##_set1_ps(m)));                                    \
                    if (j >= full) e = P##_max_ps(MASK_LT(e, nk - j), P##_setzero_ps()); /* (exp(-inf) is not 0) */ \
                    P##_storeu_ps(pu + j, e);                                                                       \
                    sum = P##_add_ps(sum, e);                                                                       \
                }                                                                                                   \
                for (int64_t j = (nk + L - 1) / L * L; j < most; j++) pu[j] = 0.0f; /* the group's later keys */    \
                P##_storeu_ps(lanes, sum);                                                                          \
                total[u] = 0.0f;                                                                                    \
                for (int l = 0; l < L; l++) total[u] += lanes[l];                                                   \
            }                                                                                                       \
            /* the values: the group's queries together, NV vectors of outputs a pass (then single vectors) */      \
            int64_t c0 = 0;                                                                                         \
            for (; c0 + NV * L <= Dv; c0 += NV * L) PROMPT_VALUES(L, NV, V, P);                                     \
            for (; c0 + L <= Dv; c0 += L) PROMPT_VALUES(L, 1, V, P);                                                \
            for (int u = 0; u < nq; u++)                                                                            \
                for (int64_t c = Dv / L * L; c < Dv; c++) { /* outputs past the last whole vector */               \
                    float r = 0.0f;                                                                                 \
                    for (int64_t j = 0; j < most; j++) r += p[u * pstride + j] * vf[j * Dv + c];                   \
                    o[(i0 + u) * Dv + c] = r / total[u];                                                            \
                }                                                                                                   \
        }                                                                                                           \
    }

/* lanes l >= n (n may be <= 0 or >= L) set to -inf */
#if defined(__AVX512F__)
static inline __m512 mask_lt16(__m512 s, int64_t n) {
    return _mm512_mask_blend_ps(lanes16(n < 0 ? 0 : n), _mm512_set1_ps(-INFINITY), s);
}
PROMPT_ATTEND(16, 4, __m512, _mm512, exp16, mask_lt16)
#define PROMPT_L 16
#define prompt_head prompt_head_16
#else
static inline __m256 mask_lt8(__m256 s, int64_t n) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 0 ? 0 : n > 8 ? 8 : n)), lane);
    return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, _mm256_castsi256_ps(keep));
}
PROMPT_ATTEND(8, 2, __m256, _mm256, exp8, mask_lt8)
#define PROMPT_L 8
#define prompt_head prompt_head_8
#endif
#undef PROMPT_ATTEND

/* attend_prompt's key blocks for S keys: an even number (prompt_head takes two at a time) */
static int64_t prompt_blocks(int64_t S) { return ((S + PROMPT_L - 1) / PROMPT_L + 1) / 2 * 2; }

/* one (row b, kv head h) of attend_prompt; buf: its scratch (attend_prompt says what it holds) */
static void prompt_kv_head(const Attn* a, int64_t b, int64_t h, float* buf, int64_t* n) {
    const int64_t A = a->A, T = a->T, Hk = a->Hk, S = a->S, D = a->D, Dv = a->Dv, G = a->G, Q = a->Q, L = PROMPT_L;
    const int64_t NB = prompt_blocks(S);
    const int bf16 = a->bf16;
    const size_t es = bf16 ? 2 : 4;
    const float scale = a->scale;
    float *qf = buf, *kt = qf + Q * D, *vf = kt + NB * D * L, *p = vf + S * Dv, *o = p + PROMPT_QUERIES * NB * L;
    const int64_t most = head_queries(a, b, h, n, qf);
    const char* kb = (const char*)a->k + (size_t)((b * Hk + h) * S * D) * es;
    const int64_t nb = prompt_blocks(most);
    const int64_t whole = most / L; /* blocks every lane of which a key fills; the others zeroed first */
    memset(kt + whole * D * L, 0, sizeof(float) * (size_t)((nb - whole) * D * L));
    for (int64_t j = 0; j < most; j++) /* key j -> block j / L, lane j % L */
        for (int64_t d = 0; d < D; d++)
            kt[((j / L) * D + d) * L + j % L] =
                bf16 ? bf16_to_f(((const uint16_t*)kb)[j * D + d]) : ((const float*)kb)[j * D + d];
    widen((const char*)a->v + (size_t)((b * Hk + h) * S * Dv) * es, most * Dv, bf16, vf);
    prompt_head(qf, Q, D, Dv, n, kt, vf, scale, p, NB * L, o);
    for (int64_t g = 0, nq = 0; g < G; g++)
        for (int64_t t = 0; t < T; t++, nq++) {
            const int64_t at = ((b * A + h * G + g) * T + t) * Dv;
            for (int64_t i = 0; i < Dv; i++) {
                const float x = n[nq] ? o[nq * Dv + i] : 0.0f;
                if (bf16) ((uint16_t*)a->out)[at + i] = to_bf16(x);
                else ((float*)a->out)[at + i] = x;
            }
        }
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
/* the tiles' state for this process (native.h; as qmatmul.c's qmatmul_ready): 0 when granted (attention_kernel.py loads
 * the next build otherwise) */
int attention_ready(void) { return amx_permission(); }

/* sums tiles 0..n-1 (n <= 4) := 0 (tile numbers are constants in the instruction) */
static inline void zero_tiles(int n) {
    _tile_zero(0);
    if (n > 1) _tile_zero(1);
    if (n > 2) _tile_zero(2);
    if (n > 3) _tile_zero(3);
}

/* sums tiles 0..n-1 (n <= 4) += the A tile at a (16 rows at stride as bytes) times the B tiles b[0..n-1], through
 * tiles 4 (A) and 5-7 (B) */
static inline void tiles_mac(int n, const uint16_t* a, int64_t as, const uint16_t* const* b) {
    _tile_loadd(4, a, as);
    _tile_loadd(5, b[0], 64);
    _tile_dpbf16ps(0, 4, 5);
    if (n > 1) { _tile_loadd(6, b[1], 64); _tile_dpbf16ps(1, 4, 6); }
    if (n > 2) { _tile_loadd(7, b[2], 64); _tile_dpbf16ps(2, 4, 7); }
    if (n > 3) { _tile_loadd(5, b[3], 64); _tile_dpbf16ps(3, 4, 5); }
}

/* The AMX build's attend_prompt of a bf16 model (D a multiple of 32, Dv of 16): one (row b, kv head h) on the tiles,
 * as flash attention on GPUs computes it - the scores of 16 queries x 16 keys a tile (`tdpbf16ps`: exact products,
 * fp32 sums), the softmax in fp32 (masked past each query's position), its weights rounded to bf16 and multiplied by
 * the values on the tiles (fp32 sums), divided by the weights' total. Other bits than the vector kernel's (the
 * weights' rounding; PyTorch's CPU flash attention rounds them alike for bf16), for prompts only as it is. The vector
 * kernel took 25% of a 3,072-token prompt's read, behind SDPA. buf (attend_prompt sizes it, SP = S rounded up to 32):
 * queries qb [Q rounded up to 16][D], keys kb [SP/16][D/32][16][16][2], values vb [SP/32][Dv/16][16][16][2], weights
 * pb [16][SP] (bf16), then scores sc [16][SP] and outputs o [16][Dv] (fp32). */
static void prompt_kv_head_amx(const Attn* a, int64_t b, int64_t h, float* buf, int64_t* n) {
    const int64_t A = a->A, T = a->T, G = a->G, Q = a->Q, S = a->S, D = a->D, Dv = a->Dv, Hk = a->Hk;
    const int64_t QP = (Q + 15) / 16 * 16, SP = (S + 31) / 32 * 32, DC = D / 32, DB = Dv / 16;
    uint16_t *qb = (uint16_t*)buf, *kb = qb + QP * D, *vb = kb + SP * D, *pb = vb + SP * Dv;
    float *sc = (float*)(pb + 16 * SP), *o = sc + 16 * SP;
    int64_t most = 0;
    for (int64_t g = 0, nq = 0; g < G; g++)
        for (int64_t t = 0; t < T; t++, nq++) {
            n[nq] = a->starts[b] + t + 1 > S ? 0 : a->starts[b] + t + 1;
            most = n[nq] > most ? n[nq] : most;
            memcpy(qb + nq * D, (const uint16_t*)a->q + b * a->sq0 + (h * G + g) * a->sq1 + t * a->sq2,
                   sizeof(uint16_t) * (size_t)D);
        }
    memset(qb + Q * D, 0, sizeof(uint16_t) * (size_t)((QP - Q) * D));
    const int64_t KB = (most + 15) / 16, KC = (most + 31) / 32, KP = KC * 32;
    const uint16_t* kh = (const uint16_t*)a->k + (b * Hk + h) * S * D;
    const uint16_t* vh = (const uint16_t*)a->v + (b * Hk + h) * S * Dv;
    for (int64_t kb0 = 0; kb0 < KB; kb0++) /* keys: 16 at a time, each 32 dimensions a tile of [pair][key] words */
        for (int64_t c = 0; c < DC; c++) {
            uint32_t* dst = (uint32_t*)(kb + (kb0 * DC + c) * 512);
            if (kb0 * 16 + 16 <= most) transpose_words16(kh + kb0 * 16 * D + c * 32, D / 2, dst, 16); /* (native.h) */
            else { /* the last block, partly filled: zeros past the keys */
                memset(dst, 0, 1024);
                for (int64_t j = kb0 * 16; j < most; j++)
                    for (int p = 0; p < 16; p++) dst[p * 16 + j % 16] = ((const uint32_t*)(kh + j * D + c * 32))[p];
            }
        }
    /* values: pairs of keys interleaved, [pair][output][2] (key 2p's value, key 2p + 1's) */
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t kc = 0; kc < KC; kc++)
        for (int64_t db = 0; db < DB; db++)
            for (int p = 0; p < 16; p++) {
                const int64_t j = kc * 32 + 2 * p;
                const __m256i v0 = j < most ? _mm256_loadu_si256((const __m256i*)(vh + j * Dv + db * 16))
                                            : _mm256_setzero_si256();
                const __m256i v1 = j + 1 < most ? _mm256_loadu_si256((const __m256i*)(vh + (j + 1) * Dv + db * 16))
                                                : _mm256_setzero_si256();
                _mm512_storeu_si512(vb + (kc * DB + db) * 512 + p * 32,
                                    _mm512_permutexvar_epi16(order, _mm512_inserti64x4(_mm512_castsi256_si512(v0), v1, 1)));
            }
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    for (int64_t q0 = 0; q0 < Q; q0 += 16) {
        const int rows = (int)(Q - q0 < 16 ? Q - q0 : 16);
        int64_t mq = 0;
        for (int r = 0; r < rows; r++) mq = n[q0 + r] > mq ? n[q0 + r] : mq;
        const int64_t kbn = (mq + 15) / 16, kcn = (mq + 31) / 32;
        float total[16];
        for (int64_t k0 = 0; k0 < kbn; k0 += 4) { /* scores: 4 key blocks a pass */
            const int nb = (int)(kbn - k0 < 4 ? kbn - k0 : 4);
            zero_tiles(nb);
            for (int64_t c = 0; c < DC; c++) {
                const uint16_t* bt[4];
                for (int i = 0; i < nb; i++) bt[i] = kb + ((k0 + i) * DC + c) * 512;
                tiles_mac(nb, qb + q0 * D + c * 32, D * 2, bt);
            }
            _tile_stored(0, sc + k0 * 16, KP * 4);
            if (nb > 1) _tile_stored(1, sc + (k0 + 1) * 16, KP * 4);
            if (nb > 2) _tile_stored(2, sc + (k0 + 2) * 16, KP * 4);
            if (nb > 3) _tile_stored(3, sc + (k0 + 3) * 16, KP * 4);
        }
        for (int r = 0; r < 16; r++) { /* the softmax of each query's keys; its weights in bf16, zeros past them */
            const int64_t ni = r < rows ? n[q0 + r] : 0;
            float* sr = sc + r * KP;
            uint16_t* pr = pb + r * KP;
            __m512 mx = _mm512_set1_ps(-INFINITY);
            for (int64_t j = 0; j < ni; j += 16)
                mx = _mm512_max_ps(mx, mask_lt16(_mm512_mul_ps(_mm512_loadu_ps(sr + j), _mm512_set1_ps(a->scale)), ni - j));
            const float m = _mm512_reduce_max_ps(mx);
            __m512 sum = _mm512_setzero_ps();
            for (int64_t j = 0; j < kcn * 32; j += 16) {
                __m512 e = _mm512_setzero_ps();
                if (j < ni) {
                    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(sr + j), _mm512_set1_ps(a->scale));
                    e = _mm512_maskz_mov_ps(lanes16(ni - j), round_bf16x16(exp16(_mm512_sub_ps(x, _mm512_set1_ps(m)))));
                }
                sum = _mm512_add_ps(sum, e);
                f_to_bf16x16(pr + j, e, 0xffff);
            }
            total[r] = _mm512_reduce_add_ps(sum);
        }
        for (int64_t d0 = 0; d0 < DB; d0 += 4) { /* outputs: 4 blocks of 16 a pass */
            const int nd = (int)(DB - d0 < 4 ? DB - d0 : 4);
            zero_tiles(nd);
            for (int64_t kc = 0; kc < kcn; kc++) {
                const uint16_t* bt[4];
                for (int i = 0; i < nd; i++) bt[i] = vb + (kc * DB + d0 + i) * 512;
                tiles_mac(nd, pb + kc * 32, KP * 2, bt);
            }
            _tile_stored(0, o + d0 * 16, Dv * 4);
            if (nd > 1) _tile_stored(1, o + (d0 + 1) * 16, Dv * 4);
            if (nd > 2) _tile_stored(2, o + (d0 + 2) * 16, Dv * 4);
            if (nd > 3) _tile_stored(3, o + (d0 + 3) * 16, Dv * 4);
        }
        for (int r = 0; r < rows; r++) {
            const int64_t nq = q0 + r, g = nq / T, t = nq % T;
            uint16_t* dst = (uint16_t*)a->out + ((b * A + h * G + g) * T + t) * Dv;
            const __m512 inv = _mm512_set1_ps(n[nq] ? 1.0f / total[r] : 0.0f);
            for (int64_t i = 0; i < Dv; i += 16)
                f_to_bf16x16(dst + i, _mm512_mul_ps(_mm512_loadu_ps(o + r * Dv + i), inv), 0xffff);
        }
    }
    _tile_release();
}
#endif

int attend_prompt(int64_t B, int64_t A, int64_t T, int64_t Hk, int64_t S, int64_t D, int64_t Dv, int bf16,
                  const void* q, int64_t sq0, int64_t sq1, int64_t sq2, const void* k, const void* v,
                  const int64_t* starts, float scale, void* out, int nthreads) {
    const Attn a = {B, A, T, Hk, S, D, Dv, A / Hk, A / Hk * T, sq0, sq1, sq2, bf16, q, k, v, starts, scale, out};
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    if (bf16 && D % 32 == 0 && Dv % 16 == 0) { /* bf16 halves, counted in floats (prompt_kv_head_amx's buf) */
        const int64_t QP = (a.Q + 15) / 16 * 16, SP = (S + 31) / 32 * 32;
        return each_kv_head(&a, (size_t)((QP * D + SP * D + SP * Dv + 16 * SP) / 2 + 16 * SP + 16 * Dv), prompt_kv_head_amx,
                            nthreads);
    }
#endif
    const int64_t Q = a.Q, L = PROMPT_L, NB = prompt_blocks(S);
    /* queries [Q][D]; keys [NB][D][L]; values [S][Dv]; PROMPT_QUERIES rows of scores [NB * L]; outputs [Q][Dv] */
    return each_kv_head(&a, (size_t)(Q * D + NB * D * L + S * Dv + PROMPT_QUERIES * NB * L + Q * Dv), prompt_kv_head,
                        nthreads);
}
