/* Quantized matrix products for CPU decoding (x86-64 with AVX2 and FMA): int8 or int4 weights times int8
 * activations, built and loaded by qmatmul.py.
 *
 * y[m, n] = bias[n] + sum over k of x[m, k] * w[n, k], with
 *   - x: bf16 [M, K], quantized here per row in blocks of 32: x[m, 32b + j] ~ dx[m, b] * xq[m, 32b + j], xq in
 *     -127..127, dx = max |x| over the block / 127 (the activation scheme of llama.cpp's q8_0);
 *   - w: int8 codes [N, K] with one scale per output (w ~ sw[n] * q), or int4 codes 0..15 with a scale and an offset
 *     per group of G inputs (w ~ s[n, g] * q + lo[n, g]).
 * The block products are exact integer sums; their fp32 accumulation runs in one fixed order per (m, n) that depends
 * only on K, so row m of an M-row product is bit for bit the 1-row product of row m, at any M and any thread count
 * (threads split the outputs n). Lossless speculative decoding needs this: a verify row must be its plain step.
 * Built with -ffp-contract=off so that no code path fuses a multiply-add the others do not. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 load8_bf16(const uint16_t* p) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

/* The exact integer dot products of u8 x s8 byte pairs, summed in fours into eight int32 lanes. With AVX-512 VNNI one
 * vpdpbusd (the build native.py makes where the CPU has it); else vpmaddubsw + vpmaddwd, which give the same
 * integers (their int16 pair sums cannot saturate here: |w| * |x| <= 127 * 127 for int8 codes, 15 * 127 for int4), so
 * both builds' outputs are bit for bit the same. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define QMATMUL_ISA "avx512vnni"
static inline __m256i dot_u8s8(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }
#else
#define QMATMUL_ISA "avx2"
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
#endif

const char* qmatmul_isa(void) { return QMATMUL_ISA; }

/* One row of K bf16 values -> codes xq [K], block scales dx [K/32], block sums of the codes xs [K/32]. */
static void quantize_row(const uint16_t* x, int64_t K, int8_t* xq, float* dx, int32_t* xs) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < K / 32; b++) {
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = load8_bf16(x + b * 32 + i * 8);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        float a = 0.0f, lanes[8];
        _mm256_storeu_ps(lanes, amax);
        for (int i = 0; i < 8; i++) a = lanes[i] > a ? lanes[i] : a;
        const float d = a / 127.0f;
        const __m256 id = _mm256_set1_ps(a > 0.0f ? 127.0f / a : 0.0f);
        __m256i q[4];
        for (int i = 0; i < 4; i++)
            q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m256i s32 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        /* int32 x 32 -> int8 x 32 in order: packs interleave 128-bit lanes, the permute puts them back */
        __m256i p16a = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
        __m256i p8 = _mm256_packs_epi16(p16a, p16b);
        p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i*)(xq + b * 32), p8);
        int32_t sl[8], s = 0;
        _mm256_storeu_si256((__m256i*)sl, s32);
        for (int i = 0; i < 8; i++) s += sl[i];
        dx[b] = d;
        xs[b] = s;
    }
}

typedef struct {
    int8_t* xq;
    float* dx;
    int32_t* xs;
} QRows;

static int quantize_rows(const uint16_t* x, int64_t M, int64_t K, int nthreads, QRows* q) {
    const int64_t nb = K / 32;
    q->xq = malloc((size_t)(M * K));
    q->dx = malloc(sizeof(float) * (size_t)(M * nb));
    q->xs = malloc(sizeof(int32_t) * (size_t)(M * nb));
    if (!q->xq || !q->dx || !q->xs) return -1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M > 1)
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, K, q->xq + m * K, q->dx + m * nb, q->xs + m * nb);
    return 0;
}

static void free_rows(QRows* q) {
    free(q->xq);
    free(q->dx);
    free(q->xs);
}

#define PREFETCH 2048

/* int8 codes, interleaved (pack_int8 in qmatmul.py): groups of 8 outputs, [N/8][K/4][8][4] bytes - byte (g, c, j, i)
 * is output 8g+j's code for input 4c+i, the last group padded with zero codes - so one 32-byte load holds 4 inputs of
 * 8 outputs, and one u8 x s8 product against the row's 4 activations broadcast gives the 8 outputs' partial sums in
 * their own lanes: the integer block sums come out per output with no horizontal sum, and the float work (one
 * conversion and one multiply-add per block) is shared by 8 outputs.
 *
 * The VNNI build stores code + 128 (u8) and multiplies it by the activation codes (s8) with vpdpbusd, then subtracts
 * 128 x the block's activation sum; the AVX2 build stores the codes (s8) and takes |w| and x with w's sign into
 * vpmaddubsw (pairs cannot saturate: 127 * 127 * 2 < 32768). Both give each block's exact integer dot product, so
 * the two builds compute the same bits. Per output, the float accumulation is acc = fma(dx[b], p[b], acc) over the
 * blocks in order, whatever the tile, the row count and the threads: row-invariant by construction. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q8_DOT(acc, w, x) _mm256_dpbusd_epi32(acc, w, x)
#define Q8_OFFSET 128
#else
static inline __m256i q8_dot_avx2(__m256i acc, __m256i w, __m256i x) {
    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
#define Q8_DOT(acc, w, x) q8_dot_avx2(acc, w, x)
#define Q8_OFFSET 0
#endif

static inline __m256i bcast4(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* R rows (<= 4) x GS groups of 8 outputs from group g0: out [R][GS][8] floats (before the output scale). Two integer
 * accumulators per (row, group) - even and odd chunks of a block - halve the chains of dependent products. */
#define Q8_TILE(R, GS)                                                                                               \
    static void q8_tile_##R##_##GS(const uint8_t* w, int64_t g0, int64_t K, const int8_t* xq, const float* dx,       \
                                   const int32_t* xs, int64_t nb, float* out) {                                     \
        __m256 f[R][GS];                                                                                             \
        for (int r = 0; r < R; r++)                                                                                  \
            for (int g = 0; g < GS; g++) f[r][g] = _mm256_setzero_ps();                                              \
        const int64_t KC = K / 4;                                                                                    \
        for (int64_t b = 0; b < nb; b++) {                                                                           \
            __m256i ia[R][GS], ib[R][GS];                                                                            \
            for (int r = 0; r < R; r++)                                                                              \
                for (int g = 0; g < GS; g++) ia[r][g] = ib[r][g] = _mm256_setzero_si256();                           \
            for (int g = 0; g < GS; g++) _mm_prefetch((const char*)(w + ((g0 + g) * KC + b * 8) * 32 + PREFETCH), _MM_HINT_T0); \
            for (int c = 0; c < 8; c += 2) {                                                                         \
                __m256i w0[GS], w1[GS];                                                                              \
                for (int g = 0; g < GS; g++) {                                                                       \
                    const uint8_t* wp = w + ((g0 + g) * KC + b * 8 + c) * 32;                                        \
                    w0[g] = _mm256_loadu_si256((const __m256i*)wp);                                                  \
                    w1[g] = _mm256_loadu_si256((const __m256i*)(wp + 32));                                           \
                }                                                                                                    \
                for (int r = 0; r < R; r++) {                                                                        \
                    const __m256i x0 = bcast4(xq + r * K + b * 32 + c * 4), x1 = bcast4(xq + r * K + b * 32 + c * 4 + 4); \
                    for (int g = 0; g < GS; g++) {                                                                   \
                        ia[r][g] = Q8_DOT(ia[r][g], w0[g], x0);                                                      \
                        ib[r][g] = Q8_DOT(ib[r][g], w1[g], x1);                                                      \
                    }                                                                                                \
                }                                                                                                    \
            }                                                                                                        \
            for (int r = 0; r < R; r++) {                                                                            \
                const __m256 d = _mm256_set1_ps(dx[r * nb + b]);                                                     \
                const __m256i corr = _mm256_set1_epi32(Q8_OFFSET * xs[r * nb + b]);                                  \
                for (int g = 0; g < GS; g++) {                                                                       \
                    const __m256i p = _mm256_sub_epi32(_mm256_add_epi32(ia[r][g], ib[r][g]), corr);                  \
                    f[r][g] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(p), f[r][g]);                                     \
                }                                                                                                    \
            }                                                                                                        \
        }                                                                                                            \
        for (int r = 0; r < R; r++)                                                                                  \
            for (int g = 0; g < GS; g++) _mm256_storeu_ps(out + (r * GS + g) * 8, f[r][g]);                          \
    }
Q8_TILE(1, 2)
Q8_TILE(2, 2)
Q8_TILE(3, 2)
Q8_TILE(4, 2)
Q8_TILE(1, 1)
Q8_TILE(2, 1)
Q8_TILE(3, 1)
Q8_TILE(4, 1)

/* rows m0..m0+R-1 against groups g0..g0+GS-1 -> y (bf16, the output scale and bias applied once) */
static void q8_tile(const uint8_t* w, int64_t g0, int64_t GS, int64_t K, const QRows* q, int64_t m0, int64_t R,
                    const float* sw, const float* bias, int64_t N, uint16_t* y) {
    const int64_t nb = K / 32;
    const int8_t* xq = q->xq + m0 * K;
    const float* dx = q->dx + m0 * nb;
    const int32_t* xs = q->xs + m0 * nb;
    float o[4 * 2 * 8];
    switch (GS * 8 + R) {
        case 17: q8_tile_1_2(w, g0, K, xq, dx, xs, nb, o); break;
        case 18: q8_tile_2_2(w, g0, K, xq, dx, xs, nb, o); break;
        case 19: q8_tile_3_2(w, g0, K, xq, dx, xs, nb, o); break;
        case 20: q8_tile_4_2(w, g0, K, xq, dx, xs, nb, o); break;
        case 9: q8_tile_1_1(w, g0, K, xq, dx, xs, nb, o); break;
        case 10: q8_tile_2_1(w, g0, K, xq, dx, xs, nb, o); break;
        case 11: q8_tile_3_1(w, g0, K, xq, dx, xs, nb, o); break;
        default: q8_tile_4_1(w, g0, K, xq, dx, xs, nb, o);
    }
    for (int64_t i = 0; i < R; i++)
        for (int64_t j = 0; j < GS * 8; j++) {
            const int64_t n = g0 * 8 + j;
            if (n < N) y[(m0 + i) * N + n] = to_bf16(bias ? o[i * GS * 8 + j] * sw[n] + bias[n] : o[i * GS * 8 + j] * sw[n]);
        }
}

/* int4 codes (pack_int4 in qmatmul.py): blocks of 32 codes in pairs, 32 bytes a pair, byte j = q[j] | q[32 + j] << 4
 * (one load, one shift and two masks widen both blocks); an odd last block alone in 16 bytes, byte j = q[j] |
 * q[16 + j] << 4. */
static inline __m256i q4_block(const uint8_t* w, int64_t b, int64_t nb) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    if ((b | 1) < nb) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(w + (b & ~(int64_t)1) * 16));
        return _mm256_and_si256(b & 1 ? _mm256_srli_epi16(v, 4) : v, low);
    }
    const __m128i t = _mm_loadu_si128((const __m128i*)(w + b * 16));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), low);
}

/* One group's products for R rows, dx * (block's integer product) summed per row in block order: groups of an even
 * number of blocks run their even and odd blocks in two chains (added at the group's end), which halves the chain
 * of dependent multiply-adds; the order depends only on K and the group size, never on R. */
#define Q4_STEP(R, ACC, Q, B)                                                                                          \
    _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {                                                              \
        const __m256i p = dot_u8s8(Q, _mm256_loadu_si256((const __m256i*)(xq + i * K + (B) * 32)));                    \
        ACC[i] = _mm256_fmadd_ps(_mm256_set1_ps(dx[i * nb + (B)]), _mm256_cvtepi32_ps(p), ACC[i]);                    \
    }

/* The offset term of a group, lo * sum_k x[k], uses the block sums of the activation codes (xg: per group, sum of
 * dx * xs). */
#define Q4_TILE(R)                                                                                                    \
    static inline void q4_tile_##R(const uint8_t* w, const float* s, const float* lo, const int8_t* xq,             \
                                   const float* dx, const float* xg, int64_t K, int64_t nb, int64_t bpg, int64_t ng, \
                                   float* out) {                                                                     \
        const __m256i low = _mm256_set1_epi8(0x0F);                                                                  \
        __m256 acc[R];                                                                                               \
        float off[R];                                                                                                \
        _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {                                                          \
            acc[i] = _mm256_setzero_ps();                                                                            \
            off[i] = 0.0f;                                                                                           \
        }                                                                                                            \
        for (int64_t g = 0; g < ng; g++) {                                                                           \
            __m256 ge[R], go[R];                                                                                     \
            _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) ge[i] = go[i] = _mm256_setzero_ps();                   \
            _mm_prefetch((const char*)(w + g * bpg * 16 + PREFETCH / 2), _MM_HINT_T0);                               \
            if (bpg % 2 == 0) {                                                                                      \
                for (int64_t b = g * bpg; b < (g + 1) * bpg; b += 2) {                                               \
                    const __m256i v = _mm256_loadu_si256((const __m256i*)(w + b * 16));                              \
                    const __m256i qe = _mm256_and_si256(v, low), qo = _mm256_and_si256(_mm256_srli_epi16(v, 4), low); \
                    Q4_STEP(R, ge, qe, b)                                                                              \
                    Q4_STEP(R, go, qo, b + 1)                                                                          \
                }                                                                                                    \
            } else {                                                                                                 \
                for (int64_t b = g * bpg; b < (g + 1) * bpg; b++) {                                                  \
                    const __m256i q = q4_block(w, b, nb);                                                            \
                    Q4_STEP(R, ge, q, b)                                                                               \
                }                                                                                                    \
            }                                                                                                        \
            const __m256 sg = _mm256_set1_ps(s[g]);                                                                  \
            _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {                                                      \
                acc[i] = _mm256_fmadd_ps(sg, _mm256_add_ps(ge[i], go[i]), acc[i]);                                   \
                off[i] += lo[g] * xg[i * ng + g];                                                                    \
            }                                                                                                        \
        }                                                                                                            \
        _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) out[i] = hsum(acc[i]) + off[i];                            \
    }
Q4_TILE(1)
Q4_TILE(2)
Q4_TILE(3)
Q4_TILE(4)

/* One row against two weight rows a and b (groups of an even number of blocks): q4_tile_1's arithmetic for each,
 * interleaved, so that one output's tail (the horizontal sum, the offset, the store) overlaps the other's products:
 * at the shipped model's widths that tail was half of a 1-row product. Each output's bits are q4_tile_1's. */
static inline void q4_pair_1(const uint8_t* wa, const uint8_t* wb, const float* sa, const float* sb, const float* la,
                             const float* lb, const int8_t* xq, const float* dx, const float* xg, int64_t bpg,
                             int64_t ng, float* oa, float* ob) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256 acc_a = _mm256_setzero_ps(), acc_b = _mm256_setzero_ps();
    float off_a = 0.0f, off_b = 0.0f;
    for (int64_t g = 0; g < ng; g++) {
        __m256 ea = _mm256_setzero_ps(), oda = _mm256_setzero_ps(), eb = _mm256_setzero_ps(), odb = _mm256_setzero_ps();
        _mm_prefetch((const char*)(wa + g * bpg * 16 + PREFETCH / 2), _MM_HINT_T0);
        _mm_prefetch((const char*)(wb + g * bpg * 16 + PREFETCH / 2), _MM_HINT_T0);
        for (int64_t b = g * bpg; b < (g + 1) * bpg; b += 2) {
            const __m256i x0 = _mm256_loadu_si256((const __m256i*)(xq + b * 32));
            const __m256i x1 = _mm256_loadu_si256((const __m256i*)(xq + (b + 1) * 32));
            const __m256 d0 = _mm256_set1_ps(dx[b]), d1 = _mm256_set1_ps(dx[b + 1]);
            const __m256i va = _mm256_loadu_si256((const __m256i*)(wa + b * 16));
            const __m256i vb = _mm256_loadu_si256((const __m256i*)(wb + b * 16));
            ea = _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(dot_u8s8(_mm256_and_si256(va, low), x0)), ea);
            eb = _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(dot_u8s8(_mm256_and_si256(vb, low), x0)), eb);
            oda = _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(dot_u8s8(_mm256_and_si256(_mm256_srli_epi16(va, 4), low), x1)), oda);
            odb = _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(dot_u8s8(_mm256_and_si256(_mm256_srli_epi16(vb, 4), low), x1)), odb);
        }
        acc_a = _mm256_fmadd_ps(_mm256_set1_ps(sa[g]), _mm256_add_ps(ea, oda), acc_a);
        acc_b = _mm256_fmadd_ps(_mm256_set1_ps(sb[g]), _mm256_add_ps(eb, odb), acc_b);
        off_a += la[g] * xg[g];
        off_b += lb[g] * xg[g];
    }
    *oa = hsum(acc_a) + off_a;
    *ob = hsum(acc_b) + off_b;
}

/* x bf16 [M, K], w int8 codes interleaved as above ([ceil(N/8)][K/4][8][4]), sw fp32 [N], bias fp32 [N] or NULL ->
 * y bf16 [M, N]. K % 32 == 0. 0 or -1 (memory). Threads split the output groups; one row takes a group at a time (one
 * weight stream: the prefetcher keeps up best; at the shipped model's widths 1.4x two or four streams), more rows two
 * (4 rows x 2 groups share each weight load). */
int q8_linear(const uint16_t* x, int64_t M, int64_t K, const uint8_t* w, const float* sw, const float* bias, int64_t N,
              uint16_t* y, int nthreads) {
    QRows q = {0}; /* free_rows frees it whatever failed */
    if (quantize_rows(x, M, K, nthreads, &q)) {
        free_rows(&q);
        return -1;
    }
    const int64_t G = (N + 7) / 8, GS = M == 1 ? 1 : 2, sets = (G + GS - 1) / GS;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t set = 0; set < sets; set++) {
        const int64_t g0 = set * GS, gs = G - g0 < GS ? G - g0 : GS;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int64_t r = M - m0 < 4 ? M - m0 : 4;
            if (gs == GS) q8_tile(w, g0, GS, K, &q, m0, r, sw, bias, N, y);
            else
                for (int64_t g = g0; g < G; g++) q8_tile(w, g, 1, K, &q, m0, r, sw, bias, N, y);
        }
    }
    free_rows(&q);
    return 0;
}

/* x bf16 [M, K], w uint8 [N, K/2] (int4 codes as above), s and lo fp32 [N, K/G], bias fp32 [N] or NULL -> y bf16
 * [M, N]. G % 32 == 0, K % G == 0. 0 or -1 (memory). */
int q4_linear(const uint16_t* x, int64_t M, int64_t K, const uint8_t* w, const float* s, const float* lo, int64_t G,
              const float* bias, int64_t N, uint16_t* y, int nthreads) {
    QRows q = {0}; /* free_rows frees it whatever failed */
    const int64_t nb = K / 32, bpg = G / 32, ng = K / G;
    float* xg = malloc(sizeof(float) * (size_t)(M * ng));
    if (!xg || quantize_rows(x, M, K, nthreads, &q)) {
        free(xg);
        free_rows(&q);
        return -1;
    }
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < ng; g++) {
            float t = 0.0f;
            for (int64_t b = g * bpg; b < (g + 1) * bpg; b++) t += q.dx[m * nb + b] * (float)q.xs[m * nb + b];
            xg[m * ng + g] = t;
        }
    const int paired = M == 1 && bpg % 2 == 0; /* a plain step: outputs in pairs (q4_pair_1), the bits of one by one */
    if (paired) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int64_t p = 0; p < N / 2; p++) {
            const int64_t n = 2 * p;
            float o[2];
            q4_pair_1(w + n * (K / 2), w + (n + 1) * (K / 2), s + n * ng, s + (n + 1) * ng, lo + n * ng,
                      lo + (n + 1) * ng, q.xq, q.dx, xg, bpg, ng, o, o + 1);
            for (int i = 0; i < 2; i++) y[n + i] = to_bf16(bias ? o[i] + bias[n + i] : o[i]);
        }
    }
    /* every output of more rows, or the ones left: the odd last output, or all where groups have odd block counts */
    const int64_t first = paired ? N / 2 * 2 : 0;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = first; n < N; n++) {
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int64_t r = M - m0 < 4 ? M - m0 : 4;
            const uint8_t* wr = w + n * (K / 2);
            const float *sn = s + n * ng, *ln = lo + n * ng, *d = q.dx + m0 * nb, *g = xg + m0 * ng;
            const int8_t* xr = q.xq + m0 * K;
            float o[4];
            switch (r) {
                case 1: q4_tile_1(wr, sn, ln, xr, d, g, K, nb, bpg, ng, o); break;
                case 2: q4_tile_2(wr, sn, ln, xr, d, g, K, nb, bpg, ng, o); break;
                case 3: q4_tile_3(wr, sn, ln, xr, d, g, K, nb, bpg, ng, o); break;
                default: q4_tile_4(wr, sn, ln, xr, d, g, K, nb, bpg, ng, o);
            }
            for (int64_t i = 0; i < r; i++) y[(m0 + i) * N + n] = to_bf16(bias ? o[i] + bias[n] : o[i]);
        }
    }
    free(xg);
    free_rows(&q);
    return 0;
}
