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
#include <omp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

/* The build: AVX-512 VNNI's vpdpbusd where native.py builds for it (the CPU has it), else AVX2's vpmaddubsw +
 * vpmaddwd; the kernels below give the same integers either way (Q8_DOT, Q4_DOT), so the int8 / int4 outputs of
 * every build are bit for bit the same. The AVX-512 BF16 build (VNNI too) also multiplies bf16 by `vdpbf16ps`: its
 * bf16 products have their own bits (bf16_linear). The AMX build (Intel since Sapphire Rapids: the AVX-512 BF16 build
 * plus tile registers) multiplies bf16 by `tdpbf16ps` instead, bits of its own again (bf16_linear below). */
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define QMATMUL_ISA "amx"
#elif defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define QMATMUL_ISA "avx512bf16"
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define QMATMUL_ISA "avx512vnni"
#else
#define QMATMUL_ISA "avx2"
#endif

const char* qmatmul_isa(void) { return QMATMUL_ISA; }

#if defined(__AMX_TILE__)
int qmatmul_ready(void) { return amx_permission(); } /* (native.h) */
#else
int qmatmul_ready(void) { return 0; }
#endif

/* One row of K bf16 values -> codes xq [K], and per block of A inputs (A % 32 == 0, K % A == 0) the scale dx [K/A] and
 * the sum of the codes xs [K/A]. int8 weights take blocks of 32 (llama.cpp's q8_0: int8 keeps its accuracy); int4
 * ones take blocks as wide as their groups allow, up to 128 (q4_act_block, as llama.cpp's k-quants take 256): a
 * block's products then stay integers over 128 inputs and leave the integer units once, not four times (the tiles'
 * stores of the sums were most of a few rows' cost; the vector kernels gain 10-18%). On code-small's activations the
 * products' relative error from the activations' rounding goes from 0.70% to 1.10%, small beside int4's own
 * (docs/decisions.md, 2026-12-06, fourth session). */
static void quantize_row(const uint16_t* x, int64_t K, int64_t A, int8_t* xq, float* dx, int32_t* xs) {
#if defined(__AVX512F__)
    if (A % 16 == 0) { /* 16 lanes a vector: each code rounded as below, the block's max and integer sum the same (for
                        * finite inputs: the same bits); 8 lanes took ~9 us of a plain int4 step, 4x that in a verify */
        for (int64_t b = 0; b < K / A; b++) {
            const uint16_t* xb = x + b * A;
            __m512 amax = _mm512_setzero_ps();
            for (int64_t i = 0; i < A; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(bf16x16_to_f(xb + i, 16)));
            const float a = _mm512_reduce_max_ps(amax);
            const __m512 id = _mm512_set1_ps(a > 0.0f ? 127.0f / a : 0.0f);
            __m512i s32 = _mm512_setzero_si512();
            for (int64_t c = 0; c < A; c += 16) {
                const __m512i q = _mm512_cvt_roundps_epi32(_mm512_mul_ps(bf16x16_to_f(xb + c, 16), id),
                                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                s32 = _mm512_add_epi32(s32, q);
                _mm_storeu_si128((__m128i*)(xq + b * A + c), _mm512_cvtsepi32_epi8(q));
            }
            dx[b] = a / 127.0f;
            xs[b] = _mm512_reduce_add_epi32(s32);
        }
        return;
    }
#endif
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < K / A; b++) {
        const uint16_t* xb = x + b * A;
        __m256 amax = _mm256_setzero_ps();
        for (int64_t i = 0; i < A; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, bf16x8_to_f(xb + i)));
        float a = 0.0f, lanes[8];
        _mm256_storeu_ps(lanes, amax);
        for (int i = 0; i < 8; i++) a = lanes[i] > a ? lanes[i] : a;
        const float d = a / 127.0f;
        const __m256 id = _mm256_set1_ps(a > 0.0f ? 127.0f / a : 0.0f);
        __m256i s32 = _mm256_setzero_si256();
        for (int64_t c = 0; c < A; c += 32) {
            __m256i q[4];
            for (int i = 0; i < 4; i++)
                q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(bf16x8_to_f(xb + c + i * 8), id),
                                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            s32 = _mm256_add_epi32(s32, _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
            /* int32 x 32 -> int8 x 32 in order: packs interleave 128-bit lanes, the permute puts them back */
            __m256i p16a = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
            __m256i p8 = _mm256_packs_epi16(p16a, p16b);
            p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i*)(xq + b * A + c), p8);
        }
        int32_t sl[8], s = 0;
        _mm256_storeu_si256((__m256i*)sl, s32);
        for (int i = 0; i < 8; i++) s += sl[i];
        dx[b] = d;
        xs[b] = s;
    }
}

/* rows quantized in blocks of A: codes xq [M][K], dx and xs [M][K/A] */
typedef struct {
    int8_t* xq;
    float* dx;
    int32_t* xs;
    int64_t A;
} QRows;

/* n bytes at a 64-byte boundary (free() frees them): the tiles load 64-byte rows, and a buffer where malloc put it
 * (16-byte aligned) split each row over two cache lines - a 256-row int4 prompt chunk took 18.4 or 24.7 ms from one
 * call to the next as malloc's address fell (docs/decisions.md, 2026-12-06 fifth session). */
static void* alloc64(size_t n) { return aligned_alloc(64, (n + 63) / 64 * 64); }

/* The calling thread's scratch for a product's quantized rows, kept from call to call up to SCRATCH_KEPT bytes (at a
 * 64-byte boundary; freed when the thread ends; a larger one - a long forward's rows - goes back after its call,
 * `scratch_done`): a product runs to its end before its thread starts another, and its four mallocs and frees were a
 * quarter of the allocator's 2.25% of an int4 speculative run (docs/decisions.md, 2026-12-06 sixth session). NULL when
 * out of memory. */
#define SCRATCH_KEPT ((size_t)4 << 20)
typedef struct {
    void* p;
    size_t cap;
} Scratch;
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static void scratch_free(void* s) {
    free(((Scratch*)s)->p);
    free(s);
}
static void scratch_init(void) { pthread_key_create(&scratch_key, scratch_free); }
static void* scratch(size_t n) {
    pthread_once(&scratch_once, scratch_init);
    Scratch* s = pthread_getspecific(scratch_key);
    if (!s) {
        if (!(s = calloc(1, sizeof *s))) return NULL;
        if (pthread_setspecific(scratch_key, s)) {
            free(s);
            return NULL;
        }
    }
    if (n > s->cap) {
        free(s->p);
        s->p = alloc64(n);
        s->cap = s->p ? n : 0;
    }
    return s->p;
}

static void scratch_done(void) {
    Scratch* s = pthread_getspecific(scratch_key);
    if (s && s->cap > SCRATCH_KEPT) {
        free(s->p);
        s->p = NULL;
        s->cap = 0;
    }
}

/* x's M rows quantized in blocks of A into q (the calling thread's scratch, with `extra` floats after it for the
 * caller: *more) */
static int quantize_rows(const uint16_t* x, int64_t M, int64_t K, int64_t A, int nthreads, QRows* q, int64_t extra,
                         float** more) {
    const int64_t na = K / A;
    const size_t codes = (size_t)(M * K + 63) / 64 * 64; /* (the tiles' rows of codes, at 64-byte boundaries) */
    uint8_t* buf = scratch(codes + sizeof(float) * (size_t)(2 * M * na + extra));
    if (!buf) return -1;
    q->A = A;
    q->xq = (int8_t*)buf;
    q->dx = (float*)(buf + codes);
    q->xs = (int32_t*)(q->dx + M * na);
    if (more) *more = (float*)(q->xs + M * na);
    PARALLEL_FOR(M > 1, m, M, { quantize_row(x + m * K, K, A, q->xq + m * K, q->dx + m * na, q->xs + m * na); });
    return 0;
}

/* the activation block of int4 weights in groups of G inputs: the widest of 128, 64, 32 dividing G */
static int64_t q4_act_block(int64_t G) { return G % 128 == 0 ? 128 : G % 64 == 0 ? 64 : 32; }

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

/* Rows a tile takes at once (one pass over the weights): 8 where AVX-512VL gives 32 vector registers (8 rows' sums
 * fit beside the weights), else 4. A verify of up to 8 tokens then reads each weight once. */
#if defined(__AVX512VL__)
#define TILE_ROWS 8
#else
#define TILE_ROWS 4
#endif

static inline __m256i bcast4(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
static inline __m512i bcast4z(const int8_t* p) { /* bcast4 on 16 lanes */
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* 16 outputs n.. of one row -> yr (bf16): v, times sw when given (rounded), plus bias when given (rounded), rounded
 * as to_bf16; outputs past N left out. What q8_store / sum_store do for 8 outputs, lane for lane the same operations:
 * the pair kernels store their sums this way, not through a float buffer (sum_store was 4% of an int4 k = 3 run: its
 * 32-byte loads of the kernel's 64-byte stores waited on them, docs/decisions.md 2026-12-06 sixth session). */
static inline void pair_store(uint16_t* yr, __m512 v, const float* sw, const float* bias, int64_t n, int64_t N) {
    const __mmask16 keep = lanes16(N - n);
    if (sw) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(keep, sw + n));
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, bias + n));
    f_to_bf16x16(yr, v, keep);
}
#endif

/* R rows (<= TILE_ROWS) x GS groups of 8 outputs from group g0: out [R][GS][8] floats (before the output scale). Two integer
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
            for (int g = 0; g < GS; g++) /* every line of the block: one in four left the stream waiting on memory */ \
                for (int l = 0; l < 4; l++)                                                                          \
                    _mm_prefetch((const char*)(w + ((g0 + g) * KC + b * 8) * 32 + PREFETCH + 64 * l), _MM_HINT_T0);  \
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
Q8_TILE(1, 1)
Q8_TILE(2, 1)
Q8_TILE(3, 1)
Q8_TILE(4, 1)
#if TILE_ROWS == 8
Q8_TILE(5, 1)
Q8_TILE(6, 1)
Q8_TILE(7, 1)
Q8_TILE(8, 1)
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q8_PAIRS 1
/* R rows x two groups of 8 outputs (g0, g0 + 1) -> y [R][N] (bf16, outputs 8 g0 .., pair_store): q8_tile_R_1's
 * arithmetic lane for lane, each 512-bit product over a chunk of both groups side by side (16 outputs x 4 inputs),
 * half the products of two 256-bit tiles and one conversion and multiply-add per row and block for 16 outputs. The
 * same exact integer block sums and the same float operations per output: the same bits as q8_tile. */
#define Q8_PAIR(R)                                                                                                   \
    __attribute__((noinline)) static void q8_pair_##R(const uint8_t* w, int64_t g0, int64_t K, const int8_t* xq,    \
                                                      const float* dx, const int32_t* xs, int64_t nb, const float* sw, \
                                                      const float* bias, int64_t N, uint16_t* y) {                  \
        __m512 f[R];                                                                                                 \
        for (int r = 0; r < R; r++) f[r] = _mm512_setzero_ps();                                                      \
        const int64_t KC = K / 4;                                                                                    \
        const uint8_t *w0 = w + g0 * KC * 32, *w1 = w0 + KC * 32;                                                    \
        for (int64_t b = 0; b < nb; b++) {                                                                           \
            for (int l = 0; l < 4; l++) { /* this block of the next pair (the two groups after w1) */               \
                _mm_prefetch((const char*)(w1 + KC * 32 + b * 8 * 32 + 64 * l), _MM_HINT_T0);                        \
                _mm_prefetch((const char*)(w1 + 2 * KC * 32 + b * 8 * 32 + 64 * l), _MM_HINT_T0);                    \
            }                                                                                                        \
            __m512i wc[8]; /* the block's codes once, then every row through them */                                 \
            for (int c = 0; c < 8; c++)                                                                              \
                wc[c] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(w0 + (b * 8 + c) * 32))), \
                                           _mm256_loadu_si256((const __m256i*)(w1 + (b * 8 + c) * 32)), 1);          \
            for (int r = 0; r < R; r++) {                                                                            \
                const int8_t* x = xq + r * K + b * 32;                                                               \
                __m512i ia = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wc[0], bcast4z(x));                         \
                __m512i ib = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wc[1], bcast4z(x + 4));                     \
                for (int c = 2; c < 8; c += 2) {                                                                     \
                    ia = _mm512_dpbusd_epi32(ia, wc[c], bcast4z(x + c * 4));                                         \
                    ib = _mm512_dpbusd_epi32(ib, wc[c + 1], bcast4z(x + c * 4 + 4));                                 \
                }                                                                                                    \
                const __m512i p = _mm512_sub_epi32(_mm512_add_epi32(ia, ib), _mm512_set1_epi32(Q8_OFFSET * xs[r * nb + b])); \
                f[r] = _mm512_fmadd_ps(_mm512_set1_ps(dx[r * nb + b]), _mm512_cvtepi32_ps(p), f[r]);                \
            }                                                                                                        \
        }                                                                                                            \
        for (int r = 0; r < R; r++) pair_store(y + r * N + g0 * 8, f[r], sw, bias, g0 * 8, N);                       \
    }
Q8_PAIR(2)
Q8_PAIR(3)
Q8_PAIR(4)
Q8_PAIR(5)
Q8_PAIR(6)
Q8_PAIR(7)
Q8_PAIR(8)
#endif

/* R rows x W outputs (W % 8 == 0) of int8 sums o (row stride ldo) for outputs n0.. of rows m0.. -> y (bf16, the output
 * scale and bias applied once, the multiply and the add each rounded; outputs past N left out). 8 at a time in vectors
 * (a scalar loop made 4-8 rows 20% slower), as to_bf16 rounds. */
static void q8_store(const float* o, int64_t R, int64_t W, int64_t ldo, int64_t n0, int64_t m0, const float* sw,
                     const float* bias, int64_t N, uint16_t* y) {
    for (int64_t i = 0; i < R; i++)
        for (int64_t j = 0; j < W && n0 + j < N; j += 8) {
            const int64_t n = n0 + j;
            const float* v = o + i * ldo + j;
            uint16_t* yr = y + (m0 + i) * N + n;
            if (n + 8 <= N) {
                const __m256 t = _mm256_mul_ps(_mm256_loadu_ps(v), _mm256_loadu_ps(sw + n));
                f_to_bf16x8(yr, bias ? _mm256_add_ps(t, _mm256_loadu_ps(bias + n)) : t);
            } else
                for (int64_t k = 0; n + k < N; k++) yr[k] = to_bf16(bias ? v[k] * sw[n + k] + bias[n + k] : v[k] * sw[n + k]);
        }
}

typedef void (*Q8Rows)(const uint8_t*, int64_t, int64_t, const int8_t*, const float*, const int32_t*, int64_t, float*);
/* R rows (1..TILE_ROWS) of one group, and (VNNI builds) of a pair of groups from 2 rows on */
static const Q8Rows q8_tiles[TILE_ROWS] = {q8_tile_1_1, q8_tile_2_1, q8_tile_3_1, q8_tile_4_1,
#if TILE_ROWS == 8
                                          q8_tile_5_1, q8_tile_6_1, q8_tile_7_1, q8_tile_8_1
#endif
};
#ifdef Q8_PAIRS
typedef void (*Q8Pair)(const uint8_t*, int64_t, int64_t, const int8_t*, const float*, const int32_t*, int64_t,
                       const float*, const float*, int64_t, uint16_t*);
static const Q8Pair q8_pairs[TILE_ROWS] = {NULL, q8_pair_2, q8_pair_3, q8_pair_4, q8_pair_5, q8_pair_6, q8_pair_7, q8_pair_8};
#endif

/* rows m0..m0+R-1 against group g (pair: groups g and g + 1, through q8_pairs) -> y */
static void q8_tile(const uint8_t* w, int64_t g, int pair, int64_t K, const QRows* q, int64_t m0, int64_t R,
                    const float* sw, const float* bias, int64_t N, uint16_t* y) {
    const int64_t nb = K / 32;
#ifdef Q8_PAIRS
    if (pair) {
        q8_pairs[R - 1](w, g, K, q->xq + m0 * K, q->dx + m0 * nb, q->xs + m0 * nb, nb, sw, bias, N, y + m0 * N);
        return;
    }
#endif
    float o[TILE_ROWS * 8];
    q8_tiles[R - 1](w, g, K, q->xq + m0 * K, q->dx + m0 * nb, q->xs + m0 * nb, nb, o);
    q8_store(o, R, 8, 8, g * 8, m0, sw, bias, N, y);
}

/* int4 codes (pack_int4 in qmatmul.py), interleaved as the int8 ones: groups of 8 outputs, [N/8][K/8][8][4] bytes,
 * byte (g, c, j, i) = output 8g+j's code for input 8c+i in its low nibble and for input 8c+4+i in its high one, so
 * one 32-byte load, a mask and a shift give two chunks of 4 inputs x 8 outputs. Codes are 0..15 (unsigned): the
 * u8 x s8 products need no sign trick in either build (AVX2 pairs: 2 * 15 * 127 < 32768). Scales s and offsets lo
 * per (output, group of G inputs) are interleaved the same way, [N/8][K/G][8]. Per output: p[a] = the exact integer
 * sum over activation block a (A inputs, q4_act_block), gacc = fma(dx[a], p[a], gacc) over a group's blocks in
 * order, acc = fma(s[g], gacc, acc) and off += lo[g] * xg[g] over the groups in order (xg: the group's activation
 * sum, in float), y = acc + off: one order whatever the tile, rows and threads. */
/* The products per block of 32 inputs (an activation block's add up in int32). AVX2: vpmaddubsw into one int16
 * accumulator per (row, group), widened once per block by vpmaddwd (a pair of u8 x s8 products is at most 2 * 15 *
 * 127 = 3810, a block's 8 of them 30480 < 32768: exact).
 * The VNNI builds (AVX-512) take a chunk's two halves in one 512-bit vpdpbusd: 64-bit lane j holds output j's 4 low-
 * nibble codes (inputs 8c..8c+3) in its low word and its 4 high-nibble codes (8c+4..8c+7) in its high word, against
 * the row's 8 activation bytes broadcast to every lane; two chunks a step, each into its own accumulator (ia: chunks
 * 0 and 2, ib: 1 and 3). A block's sum folds the two words of each lane together. Either way Q4_SUM is the block's
 * exact integer dot product, so every build computes the same bits (4 and 8 rows ~15-20% faster than the 256-bit
 * vpdpbusd they replaced; 1 row level: it waits on each block's chain of products, fold and conversion). */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
typedef __m512i q4_acc;
#define Q4_ZERO _mm512_setzero_si512()
#define Q4_STEP 2
static inline __m512i q4_widen(const uint8_t* p) {
    const __m512i z = _mm512_cvtepu32_epi64(_mm256_loadu_si256((const __m256i*)p)); /* output j's 4 bytes in lane j */
    /* (z | z << 28) & 0x0F0F0F0F in each word: the low nibbles stay in the low word, the high ones land in the high */
    return _mm512_ternarylogic_epi64(z, _mm512_slli_epi64(z, 28), _mm512_set1_epi8(0x0F), 0xA8);
}
static inline __m512i bcast8(const int8_t* p) {
    int64_t v;
    memcpy(&v, p, 8);
    return _mm512_set1_epi64(v);
}
#define Q4_CHUNKS(p) const __m512i wa = q4_widen(p), wb = q4_widen((p) + 32)
#define Q4_ROW(a, b, x) (a = _mm512_dpbusd_epi32(a, wa, bcast8(x)), b = _mm512_dpbusd_epi32(b, wb, bcast8((x) + 8)))
static inline __m256i q4_fold(__m512i a, __m512i b) {
    const __m512i t = _mm512_add_epi32(a, b);
    return _mm512_cvtepi64_epi32(_mm512_add_epi32(t, _mm512_srli_epi64(t, 32)));
}
#define Q4_SUM(a, b) q4_fold(a, b)
#else
/* AVX2: one chunk a step, its low and high nibbles each a 256-bit product */
typedef __m256i q4_acc;
#define Q4_ZERO _mm256_setzero_si256()
#define Q4_STEP 1
#define Q4_CHUNKS(p)                                                                                                 \
    const __m256i v_ = _mm256_loadu_si256((const __m256i*)(p)), low_ = _mm256_set1_epi8(0x0F),                      \
                  w0 = _mm256_and_si256(v_, low_), w1 = _mm256_and_si256(_mm256_srli_epi16(v_, 4), low_)
#define Q4_ROW(a, b, x) (a = _mm256_add_epi16(a, _mm256_maddubs_epi16(w0, bcast4(x))),                              \
                         a = _mm256_add_epi16(a, _mm256_maddubs_epi16(w1, bcast4((x) + 4))))
#define Q4_SUM(a, b) _mm256_madd_epi16(a, _mm256_set1_epi16(1))
#endif

/* R rows x one group of 8 outputs (group g0) -> out [R][8] floats (bias not added). The block and group sums stay in
 * registers; the running sums over groups (acc, off) live in out and a second buffer, touched once per group. Two
 * things the compiler must not do, or 4 rows cost 3.3 x one instead of 2.2 x (docs/decisions.md, 2026-12-03, int4):
 * keep acc and off in registers (4 rows x 2 groups needed 40 of AVX2's 16), and unroll the chunks of a block for more
 * than one row (GCC then computes all 32 products first and spills them); one row unrolls (1.1x). */
#define Q4_TILE(R, UNROLL)                                                                                           \
    __attribute__((noinline)) static void q4_tile_##R(const uint8_t* w, const float* s, const float* lo, int64_t g0, \
                                                      int64_t K, int64_t G, int64_t A, const int8_t* xq,            \
                                                      const float* dx, const float* xg, float* out) {               \
        const int64_t ng = K / G, na = K / A, apg = G / A, bpa = A / 32, KP = K / 8;                                 \
        const uint8_t* wg = w + g0 * KP * 32;                                                                        \
        float offs[R * 8];                                                                                           \
        for (int i = 0; i < R * 8; i++) out[i] = offs[i] = 0.0f;                                                     \
        for (int64_t q = 0; q < ng; q++) {                                                                           \
            __m256 ga[R];                                                                                            \
            for (int r = 0; r < R; r++) ga[r] = _mm256_setzero_ps();                                                 \
            for (int64_t a = q * apg; a < (q + 1) * apg; a++) {                                                      \
                __m256i is[R];                                                                                       \
                for (int r = 0; r < R; r++) is[r] = _mm256_setzero_si256();                                          \
                for (int64_t b = a * bpa; b < (a + 1) * bpa; b++) {                                                  \
                    q4_acc ia[R], ib[R];                                                                             \
                    for (int r = 0; r < R; r++) ia[r] = ib[r] = Q4_ZERO;                                             \
                    _mm_prefetch((const char*)(wg + b * 4 * 32 + PREFETCH), _MM_HINT_T0); /* both lines of the block */ \
                    _mm_prefetch((const char*)(wg + b * 4 * 32 + PREFETCH + 64), _MM_HINT_T0);                       \
                    _Pragma(UNROLL) for (int c = 0; c < 4; c += Q4_STEP) {                                           \
                        Q4_CHUNKS(wg + (b * 4 + c) * 32);                                                            \
                        for (int r = 0; r < R; r++) Q4_ROW(ia[r], ib[r], xq + r * K + b * 32 + c * 8);               \
                    }                                                                                                \
                    for (int r = 0; r < R; r++) is[r] = _mm256_add_epi32(is[r], Q4_SUM(ia[r], ib[r]));               \
                }                                                                                                    \
                for (int r = 0; r < R; r++)                                                                          \
                    ga[r] = _mm256_fmadd_ps(_mm256_set1_ps(dx[r * na + a]), _mm256_cvtepi32_ps(is[r]), ga[r]);       \
            }                                                                                                        \
            const __m256 sv = _mm256_loadu_ps(s + (g0 * ng + q) * 8), lv = _mm256_loadu_ps(lo + (g0 * ng + q) * 8);  \
            for (int r = 0; r < R; r++) {                                                                            \
                _mm256_storeu_ps(out + r * 8, _mm256_fmadd_ps(sv, ga[r], _mm256_loadu_ps(out + r * 8)));             \
                _mm256_storeu_ps(offs + r * 8, _mm256_add_ps(_mm256_loadu_ps(offs + r * 8),                          \
                                                             _mm256_mul_ps(lv, _mm256_set1_ps(xg[r * ng + q]))));   \
            }                                                                                                        \
        }                                                                                                            \
        for (int i = 0; i < R * 8; i += 8)                                                                           \
            _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_loadu_ps(out + i), _mm256_loadu_ps(offs + i)));           \
    }
Q4_TILE(1, "GCC unroll 4")
Q4_TILE(2, "GCC unroll 1")
Q4_TILE(3, "GCC unroll 1")
Q4_TILE(4, "GCC unroll 1")
#if TILE_ROWS == 8
Q4_TILE(5, "GCC unroll 1")
Q4_TILE(6, "GCC unroll 1")
Q4_TILE(7, "GCC unroll 1")
Q4_TILE(8, "GCC unroll 1")
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q4_PAIRS 1
/* R rows x two groups of 8 outputs (g0, g0 + 1) -> y [R][N] (bf16, outputs 8 g0 .., pair_store): q4_tile_R's
 * arithmetic lane for lane, with lane j of a 512-bit vector one output. A 32-byte chunk of each group side by side holds 4 inputs of 16 outputs in
 * its low nibbles and the next 4 in its high ones, so the block sums need no fold (the two words of q4_widen's lanes:
 * add, shift, add, narrowing, 6 operations a row and block for 8 outputs, as many as the products at 4 rows) and the
 * conversion and multiply-add of each block serve 16 outputs. The same exact integer block sums and the same float
 * operations per output in the same order: the same bits as q4_tile. */
static inline __m512 load8x2(const float* a, const float* b) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(a))),
                                               _mm256_castps_pd(_mm256_loadu_ps(b)), 1));
}
#define Q4_PAIR(R)                                                                                           \
    __attribute__((noinline)) static void q4_pair_##R(const uint8_t* w, const float* s, const float* lo, int64_t g0, \
                                                      int64_t K, int64_t G, int64_t A, const int8_t* xq,            \
                                                      const float* dx, const float* xg, const float* bias,          \
                                                      int64_t N, uint16_t* y) {                                     \
        const int64_t ng = K / G, na = K / A, apg = G / A, bpa = A / 32, KP = K / 8;                                 \
        const uint8_t *w0 = w + g0 * KP * 32, *w1 = w0 + KP * 32;                                                    \
        const __m512i low = _mm512_set1_epi8(0x0F);                                                                  \
        float out[R * 16], offs[R * 16];                                                                             \
        for (int i = 0; i < R * 16; i++) out[i] = offs[i] = 0.0f;                                                    \
        for (int64_t q = 0; q < ng; q++) {                                                                           \
            __m512 ga[R];                                                                                            \
            for (int r = 0; r < R; r++) ga[r] = _mm512_setzero_ps();                                                 \
            for (int64_t a = q * apg; a < (q + 1) * apg; a++) {                                                       \
                __m512i is[R];                                                                                        \
                for (int r = 0; r < R; r++) is[r] = _mm512_setzero_si512();                                           \
                for (int64_t b = a * bpa; b < (a + 1) * bpa; b++) {                                                   \
                    _mm_prefetch((const char*)(w1 + KP * 32 + b * 4 * 32), _MM_HINT_T0); /* the next pair's block */  \
                    _mm_prefetch((const char*)(w1 + KP * 32 + b * 4 * 32 + 64), _MM_HINT_T0);                         \
                    _mm_prefetch((const char*)(w1 + 2 * KP * 32 + b * 4 * 32), _MM_HINT_T0);                          \
                    _mm_prefetch((const char*)(w1 + 2 * KP * 32 + b * 4 * 32 + 64), _MM_HINT_T0);                     \
                    __m512i wl[4], wh[4]; /* the block's codes once, then every row through them */                   \
                    for (int c = 0; c < 4; c++) {                                                                     \
                        const __m512i v = _mm512_inserti64x4(                                                         \
                            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(w0 + (b * 4 + c) * 32))),      \
                            _mm256_loadu_si256((const __m256i*)(w1 + (b * 4 + c) * 32)), 1);                          \
                        wl[c] = _mm512_and_si512(v, low);                                                             \
                        wh[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);                                       \
                    }                                                                                                 \
                    for (int r = 0; r < R; r++) {                                                                     \
                        const int8_t* x = xq + r * K + b * 32;                                                        \
                        __m512i ia = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wl[0], bcast4z(x));                  \
                        __m512i ib = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wh[0], bcast4z(x + 4));              \
                        for (int c = 1; c < 4; c++) {                                                                 \
                            ia = _mm512_dpbusd_epi32(ia, wl[c], bcast4z(x + c * 8));                                  \
                            ib = _mm512_dpbusd_epi32(ib, wh[c], bcast4z(x + c * 8 + 4));                              \
                        }                                                                                             \
                        is[r] = _mm512_add_epi32(is[r], _mm512_add_epi32(ia, ib));                                    \
                    }                                                                                                 \
                }                                                                                                     \
                for (int r = 0; r < R; r++)                                                                           \
                    ga[r] = _mm512_fmadd_ps(_mm512_set1_ps(dx[r * na + a]), _mm512_cvtepi32_ps(is[r]), ga[r]);        \
            }                                                                                                         \
            const __m512 sv = load8x2(s + (g0 * ng + q) * 8, s + ((g0 + 1) * ng + q) * 8);                          \
            const __m512 lv = load8x2(lo + (g0 * ng + q) * 8, lo + ((g0 + 1) * ng + q) * 8);                        \
            for (int r = 0; r < R; r++) {                                                                            \
                _mm512_storeu_ps(out + r * 16, _mm512_fmadd_ps(sv, ga[r], _mm512_loadu_ps(out + r * 16)));           \
                _mm512_storeu_ps(offs + r * 16, _mm512_add_ps(_mm512_loadu_ps(offs + r * 16),                        \
                                                              _mm512_mul_ps(lv, _mm512_set1_ps(xg[r * ng + q]))));  \
            }                                                                                                        \
        }                                                                                                            \
        for (int r = 0; r < R; r++)                                                                                  \
            pair_store(y + r * N + g0 * 8, _mm512_add_ps(_mm512_loadu_ps(out + r * 16), _mm512_loadu_ps(offs + r * 16)), \
                       NULL, bias, g0 * 8, N);                                                                       \
    }
Q4_PAIR(1)
Q4_PAIR(2)
Q4_PAIR(3)
Q4_PAIR(4)
Q4_PAIR(5)
Q4_PAIR(6)
Q4_PAIR(7)
Q4_PAIR(8)
#endif

/* R rows x W outputs (W % 8 == 0) of float sums o (row stride ldo) for outputs n0.. of rows m0.. -> y (bf16, bias added
 * once; outputs past N left out), 8 at a time as q8_store: the int4 products' store, and the bf16 products' */
static void sum_store(const float* o, int64_t R, int64_t W, int64_t ldo, int64_t n0, int64_t m0, const float* bias,
                     int64_t N, uint16_t* y) {
    for (int64_t i = 0; i < R; i++)
        for (int64_t j = 0; j < W && n0 + j < N; j += 8) {
            const int64_t n = n0 + j;
            const float* v = o + i * ldo + j;
            uint16_t* yr = y + (m0 + i) * N + n;
            if (n + 8 <= N)
                f_to_bf16x8(yr, bias ? _mm256_add_ps(_mm256_loadu_ps(v), _mm256_loadu_ps(bias + n)) : _mm256_loadu_ps(v));
            else
                for (int64_t k = 0; n + k < N; k++) yr[k] = to_bf16(bias ? v[k] + bias[n + k] : v[k]);
        }
}

typedef void (*Q4Rows)(const uint8_t*, const float*, const float*, int64_t, int64_t, int64_t, int64_t, const int8_t*,
                       const float*, const float*, float*);
/* R rows (1..TILE_ROWS) of one group, and (VNNI builds) of a pair of groups */
static const Q4Rows q4_tiles[TILE_ROWS] = {q4_tile_1, q4_tile_2, q4_tile_3, q4_tile_4,
#if TILE_ROWS == 8
                                          q4_tile_5, q4_tile_6, q4_tile_7, q4_tile_8
#endif
};
#ifdef Q4_PAIRS
typedef void (*Q4Pair)(const uint8_t*, const float*, const float*, int64_t, int64_t, int64_t, int64_t, const int8_t*,
                       const float*, const float*, const float*, int64_t, uint16_t*);
static const Q4Pair q4_pairs[TILE_ROWS] = {q4_pair_1, q4_pair_2, q4_pair_3, q4_pair_4, q4_pair_5, q4_pair_6, q4_pair_7, q4_pair_8};
#endif

/* rows m0..m0+R-1 against group g (pair: groups g and g + 1, through q4_pairs) -> y */
static void q4_tile(const uint8_t* w, const float* s, const float* lo, int64_t G, int64_t g, int pair, int64_t K,
                    const QRows* q, const float* xg, int64_t m0, int64_t R, const float* bias, int64_t N, uint16_t* y) {
    const int64_t na = K / q->A, ng = K / G;
#ifdef Q4_PAIRS
    if (pair) {
        q4_pairs[R - 1](w, s, lo, g, K, G, q->A, q->xq + m0 * K, q->dx + m0 * na, xg + m0 * ng, bias, N, y + m0 * N);
        return;
    }
#endif
    float o[TILE_ROWS * 8];
    q4_tiles[R - 1](w, s, lo, g, K, G, q->A, q->xq + m0 * K, q->dx + m0 * na, xg + m0 * ng, o);
    sum_store(o, R, 8, 8, g * 8, m0, bias, N, y);
}

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#define QMATMUL_AMX_INT 1
/* The int8 and int4 products of several rows on the AMX tiles, bit for bit the vector kernels' above: `tdpbsud` (s8
 * activations x u8 weight codes) gives an activation block's exact integer sums for up to 16 rows at once, kept in
 * the tiles over the block (int4: up to 128 inputs, 64 a product; int8: 32); the float work after it is the vector
 * kernels' own, lane for lane in the same order (q8: acc = fma(dx[b], p[b], acc) over the blocks; q4: the group sums,
 * scales and offsets as q4_tile), 16 lanes a vector. Threads split sets of groups of outputs; a set takes every row
 * through it, 16 at a time.
 * - int8 (q8_amx): the tiles read the codes where they are stored, a group of 8 outputs a tile, 4 groups a set.
 * - int4 (q4_amx): a set of AMX_SET groups; one activation block at a time, its codes are unpacked to a byte each,
 *   two groups side by side (amx_unpack4: 8 KB, read back from L1 at once).
 * What a few rows cost is moving the codes, not multiplying them: the tiles load 64 bytes a cycle, and int4's
 * unpacked codes must be stored first, each about as long as a 1-row vector product whatever the row count. With the
 * weights coming from L3 as in a decode step (code-small's widths, one thread), the tiles are faster from 6 int4 rows
 * and 12 int8 ones (blocks of 32: a store of the sums every 32 inputs), the vector kernels below
 * (docs/decisions.md, 2026-12-06, fourth session).
 * Tiles: 0-3 sums [rows][16 or 8] int32, 4 the rows' inputs [rows][kb] s8, 5-7 weights [kb/4][64 or 32] u8 (4 inputs
 * x 16 or 8 outputs a row). */
#ifndef Q4_AMX_MIN_ROWS
#define Q4_AMX_MIN_ROWS 6
#endif
#ifndef Q8_AMX_MIN_ROWS
#define Q8_AMX_MIN_ROWS 12
#endif
#define AMX_SET 8 /* groups of 8 outputs a thread takes through the tiles at once (4 sum tiles of 16 outputs) */

/* rows of activations, kb inputs (bytes) a product (64, or 32 for blocks of 32), ob outputs' bytes a tile (64: 16
 * outputs of two groups side by side, int4's unpacked codes; 32: one group of 8, int8 codes as they are stored) */
static void amx_configure_int(int rows, int kb, int ob) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 4; t++) c.rows[t] = (uint8_t)rows, c.colsb[t] = (uint16_t)ob;
    c.rows[4] = (uint8_t)rows, c.colsb[4] = (uint16_t)kb;
    for (int t = 5; t < 8; t++) c.rows[t] = (uint8_t)(kb / 4), c.colsb[t] = (uint16_t)ob;
    _tile_loadconfig(&c);
}

/* The int4 codes ([N/8][K/8][8][4], two a byte) of inputs k0..k0+A-1 of a set as the tiles take them, one a byte:
 * u [AMX_SET/2][A/4][64], groups 2p and 2p+1 side by side in pair p's rows, input quad i's 16 outputs x 4 codes in
 * row i, so one product's 16 rows are contiguous. Groups past ng: whatever (a lone last group's pair is read with
 * it, its sums not used). 64-byte stores: 32-byte ones took twice as long. */
static void amx_unpack4(const uint8_t* w, int64_t g0, int64_t ng, int64_t K, int64_t k0, int64_t A, uint8_t* u) {
    const int64_t KP = K / 8;
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t t = 0; t < ng; t += 2) {
        const uint8_t *w0 = w + ((g0 + t) * KP + k0 / 8) * 32, *w1 = t + 1 < ng ? w0 + KP * 32 : w0;
        uint8_t* o = u + (t / 2) * (A / 4) * 64;
        for (int64_t c = 0; c < A / 8; c++) { /* inputs 8c..8c+3 in the low nibbles, 8c+4..8c+7 in the high ones */
            const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(w0 + c * 32))),
                                                 _mm256_loadu_si256((const __m256i*)(w1 + c * 32)), 1);
            _mm512_store_si512((__m512i*)(o + 2 * c * 64), _mm512_and_si512(v, low));
            _mm512_store_si512((__m512i*)(o + 2 * c * 64 + 64), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
        }
    }
}

#define Q4_PRODUCT(p, t) do { _tile_loadd(t, u + ((p) * (A / 4) + k / 4) * 64, 64); _tile_dpbsud(p, 4, t); } while (0)

/* The configured rows of xq (row stride K) over inputs k0..k0+A-1 times the set's codes in u (amx_unpack4's layout)
 * -> the exact integer sums c [rows][8 ng] (columns past ng groups: whatever) */
static void q4_sums(const uint8_t* u, int64_t ng, const int8_t* xq, int64_t K, int64_t k0, int64_t A,
                     int32_t c[16][AMX_SET * 8]) {
    const int64_t kb = A < 64 ? A : 64;
    _tile_zero(0);
    if (ng > 2) _tile_zero(1);
    if (ng > 4) _tile_zero(2);
    if (ng > 6) _tile_zero(3);
    for (int64_t k = 0; k < A; k += kb) {
        _tile_loadd(4, xq + k0 + k, K);
        Q4_PRODUCT(0, 5);
        if (ng > 2) Q4_PRODUCT(1, 6);
        if (ng > 4) Q4_PRODUCT(2, 7);
        if (ng > 6) Q4_PRODUCT(3, 5);
    }
    _tile_stored(0, c[0], AMX_SET * 32);
    if (ng > 2) _tile_stored(1, c[0] + 16, AMX_SET * 32);
    if (ng > 4) _tile_stored(2, c[0] + 32, AMX_SET * 32);
    if (ng > 6) _tile_stored(3, c[0] + 48, AMX_SET * 32);
}
#undef Q4_PRODUCT

/* acc[0..8 ng) = fma(d, float(c - corr), acc), 16 lanes a vector */
static inline void amx_accumulate(float* acc, const int32_t* c, int64_t ng, float d, int32_t corr) {
    const __m512 dv = _mm512_set1_ps(d);
    const __m512i cv = _mm512_set1_epi32(corr);
    for (int64_t j = 0; j < ng * 8; j += 16)
        _mm512_storeu_ps(acc + j, _mm512_fmadd_ps(dv, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(c + j), cv)),
                                                  _mm512_loadu_ps(acc + j)));
}

#define Q8_PRODUCT(t, b) do { _tile_loadd(b, w + ((g0 + (t)) * KC + (a * A + k) / 4) * 32, 32); _tile_dpbsud(t, 4, b); } while (0)

/* rows m0..m0+rows-1 (<= 16) x groups g0..g0+ng-1 (ng <= 4) of int8 codes w -> y, as q8_tile computes them. The tiles
 * read the codes where they are ([N/8][K/4][8][4]: a group's 8 quads of a block's inputs are 8 rows of 32 bytes), a
 * group a tile: no copy (the copy into 16-output tiles cost 5-10% more). */
static void q8_amx(const uint8_t* w, int64_t g0, int64_t ng, int64_t K, const QRows* q, int64_t m0, int rows,
                   const float* sw, const float* bias, int64_t N, uint16_t* y) {
    const int64_t A = q->A, na = K / A, kb = A < 64 ? A : 64, KC = K / 4;
    const int8_t* xq = q->xq + m0 * K;
    float acc[16][32];
    int32_t c[16][32] __attribute__((aligned(64)));
    memset(acc, 0, sizeof acc[0] * (size_t)rows); /* (the rows there are: all 16 were most of a few rows' time) */
    for (int64_t a = 0; a < na; a++) {
        _tile_zero(0);
        if (ng > 1) _tile_zero(1);
        if (ng > 2) _tile_zero(2);
        if (ng > 3) _tile_zero(3);
        for (int64_t k = 0; k < A; k += kb) {
            _tile_loadd(4, xq + a * A + k, K);
            Q8_PRODUCT(0, 5);
            if (ng > 1) Q8_PRODUCT(1, 6);
            if (ng > 2) Q8_PRODUCT(2, 7);
            if (ng > 3) Q8_PRODUCT(3, 5);
        }
        _tile_stored(0, c[0], 128);
        if (ng > 1) _tile_stored(1, c[0] + 8, 128);
        if (ng > 2) _tile_stored(2, c[0] + 16, 128);
        if (ng > 3) _tile_stored(3, c[0] + 24, 128);
        for (int r = 0; r < rows; r++)
            amx_accumulate(acc[r], c[r], ng, q->dx[(m0 + r) * na + a], Q8_OFFSET * q->xs[(m0 + r) * na + a]);
    }
    q8_store(acc[0], rows, ng * 8, 32, g0 * 8, m0, sw, bias, N, y);
}
#undef Q8_PRODUCT

/* rows m0..m0+rows-1 (<= 16) x groups g0..g0+ng-1 (ng <= AMX_SET) of int4 codes w -> y, as q4_tile computes them */
static void q4_amx(const uint8_t* w, const float* s, const float* lo, int64_t g0, int64_t ng, int64_t K, int64_t G,
                   const QRows* q, const float* xg, int64_t m0, int rows, const float* bias, int64_t N, uint16_t* y) {
    const int64_t A = q->A, na = K / A, apg = G / A, nq = K / G;
    float out[16][AMX_SET * 8], offs[16][AMX_SET * 8], ga[16][AMX_SET * 8], sv[AMX_SET * 8], lv[AMX_SET * 8];
    int32_t c[16][AMX_SET * 8] __attribute__((aligned(64)));
    uint8_t u[AMX_SET / 2 * 128 / 4 * 64] __attribute__((aligned(64))); /* a block's codes (A <= 128) */
    memset(out, 0, sizeof out[0] * (size_t)rows);
    memset(offs, 0, sizeof offs[0] * (size_t)rows);
    memset(sv, 0, sizeof sv);
    memset(lv, 0, sizeof lv);
    for (int64_t qg = 0; qg < nq; qg++) {
        memset(ga, 0, sizeof ga[0] * (size_t)rows);
        for (int64_t a = qg * apg; a < (qg + 1) * apg; a++) {
            amx_unpack4(w, g0, ng, K, a * A, A, u);
            q4_sums(u, ng, q->xq + m0 * K, K, a * A, A, c);
            for (int r = 0; r < rows; r++) amx_accumulate(ga[r], c[r], ng, q->dx[(m0 + r) * na + a], 0);
        }
        for (int64_t t = 0; t < ng; t++) {
            memcpy(sv + t * 8, s + ((g0 + t) * nq + qg) * 8, 32);
            memcpy(lv + t * 8, lo + ((g0 + t) * nq + qg) * 8, 32);
        }
        for (int r = 0; r < rows; r++) {
            const __m512 x = _mm512_set1_ps(xg[(m0 + r) * nq + qg]);
            for (int64_t j = 0; j < ng * 8; j += 16) {
                _mm512_storeu_ps(out[r] + j, _mm512_fmadd_ps(_mm512_loadu_ps(sv + j), _mm512_loadu_ps(ga[r] + j), _mm512_loadu_ps(out[r] + j)));
                _mm512_storeu_ps(offs[r] + j, _mm512_add_ps(_mm512_loadu_ps(offs[r] + j), _mm512_mul_ps(_mm512_loadu_ps(lv + j), x)));
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int64_t j = 0; j < ng * 8; j += 16)
            _mm512_storeu_ps(out[r] + j, _mm512_add_ps(_mm512_loadu_ps(out[r] + j), _mm512_loadu_ps(offs[r] + j)));
    sum_store(out[0], rows, ng * 8, AMX_SET * 8, g0 * 8, m0, bias, N, y);
}

/* every row through the tiles: threads split the sets of SET groups (of NG), each set taking every row 16 at a time
 * (CALL, with g0, ng, m0 and rows), tiles configured for products of kb inputs and ob bytes of outputs */
#define AMX_SETS_WORK(NG, SET, kb, ob, CALL)                                                                        \
    {                                                                                                               \
        int configured = 0;                                                                                         \
        _Pragma("omp for schedule(static)") for (int64_t set = 0; set < ((NG) + (SET) - 1) / (SET); set++) {         \
            const int64_t g0 = set * (SET), ng = (NG) - g0 < (SET) ? (NG) - g0 : (SET);                             \
            for (int64_t m0 = 0; m0 < M; m0 += 16) {                                                                \
                const int rows = (int)(M - m0 < 16 ? M - m0 : 16);                                                  \
                if (rows != configured) amx_configure_int(configured = rows, kb, ob);                               \
                CALL;                                                                                               \
            }                                                                                                       \
        }                                                                                                           \
        if (configured) _tile_release();                                                                            \
    }
/* (the work in a region where threads pay, else in the calling thread: its `omp for`, orphaned, runs whole; native.h
 * PARALLEL_FOR) */
#define AMX_SETS(NG, SET, kb, ob, CALL)                                                                             \
    do {                                                                                                            \
        if (nthreads > 1) {                                                                                         \
            _Pragma("omp parallel num_threads(nthreads)") AMX_SETS_WORK(NG, SET, kb, ob, CALL)                      \
        } else                                                                                                      \
            AMX_SETS_WORK(NG, SET, kb, ob, CALL)                                                                    \
    } while (0)
#endif

/* x bf16 [M, K], w int8 codes interleaved as above ([ceil(N/8)][K/4][8][4]), sw fp32 [N], bias fp32 [N] or NULL ->
 * y bf16 [M, N]. K % 32 == 0. 0 or -1 (memory). Threads split the output groups, one group at a time (one weight
 * stream: the prefetcher keeps up best; at the shipped model's widths 1.4x two or four streams, and two groups x 4 rows
 * ran out of registers, docs/decisions.md 2026-12-02), every row through it TILE_ROWS at a time. */
int q8_linear(const uint16_t* x, int64_t M, int64_t K, const uint8_t* w, const float* sw, const float* bias, int64_t N,
              uint16_t* y, int nthreads) {
    QRows q;
    if (quantize_rows(x, M, K, 32, nthreads, &q, 0, NULL)) return -1; /* (blocks of 32, q8_0's: int8 keeps its accuracy) */
    const int64_t G = (N + 7) / 8;
#ifdef QMATMUL_AMX_INT
    if (M >= Q8_AMX_MIN_ROWS) {
        AMX_SETS(G, 4, 32, 32, q8_amx(w, g0, ng, K, &q, m0, rows, sw, bias, N, y));
        scratch_done();
        return 0;
    }
#endif
#ifdef Q8_PAIRS
    PARALLEL_FOR(1, u, (G + 1) / 2, { /* pairs of groups, a last one alone */
        for (int64_t m0 = 0; m0 < M; m0 += TILE_ROWS) {
            const int64_t R = M - m0 < TILE_ROWS ? M - m0 : TILE_ROWS;
            if (R > 1 && 2 * u + 1 < G) q8_tile(w, 2 * u, 1, K, &q, m0, R, sw, bias, N, y);
            else /* one row: the 256-bit tiles (the pair measured 5-10% slower at code-small widths) */
                for (int64_t g = 2 * u; g < 2 * u + 2 && g < G; g++) q8_tile(w, g, 0, K, &q, m0, R, sw, bias, N, y);
        }
    });
#else
    PARALLEL_FOR(1, g, G, {
        for (int64_t m0 = 0; m0 < M; m0 += TILE_ROWS)
            q8_tile(w, g, 0, K, &q, m0, M - m0 < TILE_ROWS ? M - m0 : TILE_ROWS, sw, bias, N, y);
    });
#endif
    scratch_done();
    return 0;
}

/* x bf16 [M, K], w int4 codes interleaved as above ([ceil(N/8)][K/8][8][4], the last group padded), s and lo fp32
 * [ceil(N/8)][K/G][8], bias fp32 [N] or NULL -> y bf16 [M, N]. G % 32 == 0, K % G == 0. 0 or -1 (memory). Threads split the output groups
 * (one at a time, every row through it TILE_ROWS at a time, as q8_linear). */
int q4_linear(const uint16_t* x, int64_t M, int64_t K, const uint8_t* w, const float* s, const float* lo, int64_t G,
              const float* bias, int64_t N, uint16_t* y, int nthreads) {
    QRows q;
    const int64_t A = q4_act_block(G), na = K / A, apg = G / A, ng = K / G;
    float* xg;
    if (quantize_rows(x, M, K, A, nthreads, &q, M * ng, &xg)) return -1;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < ng; g++) {
            float t = 0.0f;
            for (int64_t a = g * apg; a < (g + 1) * apg; a++) t += q.dx[m * na + a] * (float)q.xs[m * na + a];
            xg[m * ng + g] = t;
        }
    const int64_t NG = (N + 7) / 8;
#ifdef QMATMUL_AMX_INT
    if (M >= Q4_AMX_MIN_ROWS) {
        AMX_SETS(NG, AMX_SET, (int)(A < 64 ? A : 64), 64, q4_amx(w, s, lo, g0, ng, K, G, &q, xg, m0, rows, bias, N, y));
        scratch_done();
        return 0;
    }
#endif
#ifdef Q4_PAIRS
    PARALLEL_FOR(1, u, (NG + 1) / 2, { /* pairs of groups, a last one alone */
        for (int64_t m0 = 0; m0 < M; m0 += TILE_ROWS) {
            const int64_t R = M - m0 < TILE_ROWS ? M - m0 : TILE_ROWS;
            q4_tile(w, s, lo, G, 2 * u, 2 * u + 1 < NG, K, &q, xg, m0, R, bias, N, y);
        }
    });
#else
    PARALLEL_FOR(1, g, NG, {
        for (int64_t m0 = 0; m0 < M; m0 += TILE_ROWS)
            q4_tile(w, s, lo, G, g, 0, K, &q, xg, m0, M - m0 < TILE_ROWS ? M - m0 : TILE_ROWS, bias, N, y);
    });
#endif
    scratch_done();
    return 0;
}

/* bf16 weights times bf16 activations with fp32 sums (linear.py's "bf16-native": every bf16 layer where qmatmul runs,
 * and the kept bf16 layers a one-call draft reads). w is interleaved by groups of 8 outputs and pairs of inputs
 * ([ceil(N/8)][ceil(K/2)][8][2] bf16, pack_bf16 in qmatmul.py, an odd K padded with a zero input): one 32-byte load
 * holds inputs 2p and 2p+1 of 8 outputs, each output's two weights side by side.
 *
 * The arithmetic per output, one fixed order whatever the tile, the rows and the threads (row-invariant), then
 * bias + (a + b) rounded once to bf16:
 *   - AVX2 build (and AVX-512 VNNI: the same 8-lane FMAs, the same bits): a = the even inputs' products, b = the odd
 *     inputs', each one fused multiply-add per input in order (inputs widened to fp32, exact);
 *   - AVX-512 BF16 build: a = the even pairs', b = the odd pairs', each one `vdpbf16ps` per pair in order (per lane:
 *     the pair's two exact products added to the sum one after the other, round to nearest, denormals as zero): half
 *     the instructions, and its own bits (close to the others', not equal; every row of a machine computes them
 *     alike, which is what exactness needs).
 * One row: bf_row, 4 groups with both sums in flight (8 independent chains). Several rows: bf_rows, up to 4 rows x GS
 * groups, the a sums in one pass over the inputs and the b sums in a second (R x GS chains each, one weight load
 * serving R rows): at 4 rows x 3 groups 1.1-1.9x the 4 x 1 tile with both sums at once, which ran out of registers
 * for more than one group (docs/decisions.md, 2026-12-03). The second pass runs from cache and prefetches the next
 * groups' weights, so their first pass does not wait on memory (3-8 rows over weights streamed from memory: 5-16%
 * faster; `ahead`: the last rows of these groups, so a prompt's many rows do not prefetch again and again).
 * -> out [R][GS][8] floats. */
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
/* activations: bf16 pairs as one 32-bit word each, rows of KP = ceil(K/2) words (an odd K's last pair ends in a 0) */
typedef uint32_t bf_act;
#define BF_ROW_LEN(K) (((K) + 1) / 2)
/* pass 0 takes the even pairs, pass 1 the odd ones */
#define BF_FIRST(pass) (pass)
#define BF_END(pass, K) (((K) + 1) / 2)
#define BF_STEP 2
#define BF_W(v, pass) ((__m256bh)(v))
#define BF_X(x, pass, p) ((__m256bh)_mm256_set1_epi32((int)(x)[p]))
#define BF_MAC(s, xv, wv) _mm256_dpbf16_ps(s, wv, xv)
#else
/* activations: fp32, rows of K */
typedef float bf_act;
#define BF_ROW_LEN(K) (K)
/* pass 0 takes every pair's even input, pass 1 its odd one (none in an odd K's last pair) */
#define BF_FIRST(pass) 0
#define BF_END(pass, K) ((pass) ? (K) / 2 : ((K) + 1) / 2)
#define BF_STEP 1
#define BF_W(v, pass) ((pass) ? bf_odd(v) : bf_even(v))
#define BF_X(x, pass, p) _mm256_broadcast_ss((x) + 2 * (p) + (pass))
#define BF_MAC(s, xv, wv) _mm256_fmadd_ps(xv, wv, s)
#endif

/* a pair block's even / odd inputs of its 8 outputs as fp32 (a bf16 is the top half of its float: exact) */
static inline __m256 bf_even(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
static inline __m256 bf_odd(__m256i v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u))); }
/* the pair block of group g, pair p */
static inline __m256i bf_pair(const uint16_t* w, int64_t g, int64_t KP, int64_t p) {
    return _mm256_loadu_si256((const __m256i*)(w + (g * KP + p) * 16));
}

__attribute__((noinline)) static void bf_row(const uint16_t* w, int64_t g0, int64_t K, const bf_act* x, float* out) {
    const int64_t KP = (K + 1) / 2;
    __m256 a[4], b[4];
    for (int g = 0; g < 4; g++) a[g] = b[g] = _mm256_setzero_ps();
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    int64_t p = 0;
    for (; p + 1 < KP; p += 2) {
        const __m256bh x0 = BF_X(x, 0, p), x1 = BF_X(x, 1, p + 1);
        for (int g = 0; g < 4; g++) {
            _mm_prefetch((const char*)(w + ((g0 + g) * KP + p) * 16) + PREFETCH, _MM_HINT_T0);
            a[g] = BF_MAC(a[g], x0, BF_W(bf_pair(w, g0 + g, KP, p), 0));
            b[g] = BF_MAC(b[g], x1, BF_W(bf_pair(w, g0 + g, KP, p + 1), 1));
        }
    }
    if (p < KP)
        for (int g = 0; g < 4; g++) a[g] = BF_MAC(a[g], BF_X(x, 0, p), BF_W(bf_pair(w, g0 + g, KP, p), 0));
#else
    for (int64_t p = 0; p < K / 2; p++) {
        const __m256 x0 = BF_X(x, 0, p), x1 = BF_X(x, 1, p);
        for (int g = 0; g < 4; g++) {
            _mm_prefetch((const char*)(w + ((g0 + g) * KP + p) * 16) + PREFETCH, _MM_HINT_T0);
            const __m256i v = bf_pair(w, g0 + g, KP, p);
            a[g] = BF_MAC(a[g], x0, bf_even(v));
            b[g] = BF_MAC(b[g], x1, bf_odd(v));
        }
    }
    if (K % 2)
        for (int g = 0; g < 4; g++) a[g] = BF_MAC(a[g], BF_X(x, 0, K / 2), bf_even(bf_pair(w, g0 + g, KP, K / 2)));
#endif
    for (int g = 0; g < 4; g++) _mm256_storeu_ps(out + g * 8, _mm256_add_ps(a[g], b[g]));
}

/* (noinline: inlined into bf16_linear's loop beside the others, GCC 12 ran the 4 x 3 tile 1.5x slower) */
#define BF_ROWS(R, GS)                                                                                               \
    __attribute__((noinline)) static void bf_rows_##R##_##GS(const uint16_t* w, int64_t g0, int64_t K, const bf_act* x, \
                                                             float* out, int ahead) {                                  \
        const int64_t KP = (K + 1) / 2, XS = BF_ROW_LEN(K);                                                           \
        __m256 s[R][GS];                                                                                             \
        for (int pass = 0; pass < 2; pass++) {                                                                       \
            for (int r = 0; r < R; r++)                                                                              \
                for (int g = 0; g < GS; g++) s[r][g] = _mm256_setzero_ps();                                          \
            for (int64_t p = BF_FIRST(pass); p < BF_END(pass, K); p += BF_STEP) {                                    \
                __m256i wv[GS];                                                                                      \
                for (int g = 0; g < GS; g++) {                                                                       \
                    if (pass && ahead) /* the next groups' weights, into L2 while this pass runs from cache */       \
                        _mm_prefetch((const char*)(w + ((g0 + GS + g) * KP + p) * 16), _MM_HINT_T1);                 \
                    wv[g] = bf_pair(w, g0 + g, KP, p);                                                               \
                }                                                                                                    \
                for (int r = 0; r < R; r++) {                                                                        \
                    const __typeof__(BF_X(x, pass, p)) xv = BF_X(x + r * XS, pass, p);                               \
                    for (int g = 0; g < GS; g++) s[r][g] = BF_MAC(s[r][g], xv, BF_W(wv[g], pass));                   \
                }                                                                                                    \
            }                                                                                                        \
            for (int r = 0; r < R; r++)                                                                              \
                for (int g = 0; g < GS; g++) {                                                                       \
                    float* o = out + (r * GS + g) * 8;                                                               \
                    _mm256_storeu_ps(o, pass ? _mm256_add_ps(_mm256_loadu_ps(o), s[r][g]) : s[r][g]);                \
                }                                                                                                    \
        }                                                                                                            \
    }
BF_ROWS(1, 3)
BF_ROWS(2, 3)
BF_ROWS(3, 3)
BF_ROWS(4, 3)
BF_ROWS(1, 1)
BF_ROWS(2, 1)
BF_ROWS(3, 1)
BF_ROWS(4, 1)
#if TILE_ROWS == 8
BF_ROWS(5, 3)
BF_ROWS(6, 3)
BF_ROWS(7, 3)
BF_ROWS(8, 3)
BF_ROWS(5, 1)
BF_ROWS(6, 1)
BF_ROWS(7, 1)
BF_ROWS(8, 1)
#endif

/* the R-row tiles (R <= TILE_ROWS) of GS = 3 or 1 groups */
static void bf_rows(int64_t R, int64_t GS, const uint16_t* w, int64_t g0, int64_t K, const bf_act* x, float* out, int ahead) {
#if TILE_ROWS == 8
#define BF_MORE(GS) case 4: bf_rows_4_##GS(w, g0, K, x, out, ahead); return; case 5: bf_rows_5_##GS(w, g0, K, x, out, ahead); \
    return; case 6: bf_rows_6_##GS(w, g0, K, x, out, ahead); return; case 7: bf_rows_7_##GS(w, g0, K, x, out, ahead); return; \
    default: bf_rows_8_##GS(w, g0, K, x, out, ahead);
#else
#define BF_MORE(GS) default: bf_rows_4_##GS(w, g0, K, x, out, ahead);
#endif
    if (GS == 3)
        switch (R) {
            case 1: bf_rows_1_3(w, g0, K, x, out, ahead); return;
            case 2: bf_rows_2_3(w, g0, K, x, out, ahead); return;
            case 3: bf_rows_3_3(w, g0, K, x, out, ahead); return;
            BF_MORE(3)
        }
    else
        switch (R) {
            case 1: bf_rows_1_1(w, g0, K, x, out, ahead); return;
            case 2: bf_rows_2_1(w, g0, K, x, out, ahead); return;
            case 3: bf_rows_3_1(w, g0, K, x, out, ahead); return;
            BF_MORE(1)
        }
#undef BF_MORE
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
/* bf16 products on the AMX tiles. w in pack_bf16's AMX layout: [ceil(N/16)][ceil(K/32)][16][16][2] bf16, one 1 KiB
 * tile per 16 outputs x 32 inputs, element (b, c, p, j, e) = output 16b+j's weight for input 32c+2p+e (zeros past N
 * and K). Per output, one fixed order whatever the rows and the threads (row-invariant): `tdpbf16ps` adds the 16 pairs
 * of a 32-input chunk to the fp32 sum in order (each pair's two exact products, round to nearest, denormals as zero),
 * chunk after chunk; then bias + sum rounded once to bf16. A row's outputs do not depend on the other rows of its tile
 * (each element of the result tile reads its own row of A only), so 1 row and 16 rows give the same bits.
 * Tiles: 0-3 the sums of 4 x 16 outputs for up to 16 rows, 4 the rows' 32-input chunk, 5-7 the weights' tiles.
 * A 1-row product streams the weights at memory speed as the vector kernels do; several rows cost about what one row
 * does (a verify block, decode batches), and a prompt's rows run at the tiles' rate. */

/* o [rows][16 nb] floats (tile sums of a set's nb output blocks) -> y rows m0.. (f: what they become; b0: the set's
 * first output block, for FUSE_SWIGLU its first gate block, the set's first nb / 2 blocks gates and the rest their
 * ups), 16 outputs at a time (the tiles' 1 KiB blocks are cheap to fill, so a 384-input product spent more time here
 * than in `tdpbf16ps` at 8 outputs a step). FUSE_NONE: sum_store's arithmetic; FUSE_SWIGLU: silu_mul16's (act.c) on
 * the rounded sums; FUSE_ADD: add_rows' (step.c) on the rounded sum. */
static void amx_store(const float* o, int rows, int64_t nb, int64_t b0, int64_t m0, const float* bias, int64_t N,
                      uint16_t* y, const Fuse* f) {
    const int64_t kind = f ? f->kind : FUSE_NONE;
    if (kind == FUSE_SWIGLU) {
        const int64_t h = nb / 2, I = f->I;
        for (int r = 0; r < rows; r++)
            for (int64_t j = 0; j < h; j++) {
                const __m512 g = round_bf16x16(_mm512_loadu_ps(o + (r * nb + j) * 16));
                const __m512 u = round_bf16x16(_mm512_loadu_ps(o + (r * nb + h + j) * 16));
                const __m512 sg = round_bf16x16(silu16(g));
                f_to_bf16x16(y + (m0 + r) * I + (b0 + j) * 16, _mm512_mul_ps(sg, u), 0xffff);
            }
        return;
    }
    for (int r = 0; r < rows; r++)
        for (int64_t j = 0; j < nb; j++) {
            const int64_t n = (b0 + j) * 16, left = N - n;
            const __mmask16 keep = lanes16(left);
            __m512 v = _mm512_loadu_ps(o + (r * nb + j) * 16);
            if (bias) v = _mm512_add_ps(_mm512_maskz_loadu_ps(keep, bias + n), v);
            uint16_t* yr = y + (m0 + r) * N + n;
            if (kind == FUSE_ADD) v = _mm512_add_ps(bf16x16_to_f(yr, left), round_bf16x16(v));
            f_to_bf16x16(yr, v, keep);
        }
}

static void amx_configure(int rows) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 5; t++) c.rows[t] = (uint8_t)rows, c.colsb[t] = 64; /* sums [rows][16] fp32, chunk [rows][32] bf16 */
    for (int t = 5; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;             /* weights [16 pairs][16 outputs][2] */
    _tile_loadconfig(&c);
}

/* the weights tile of the set's block b, chunk c, times the rows' chunk (tile 4), into sums tile s via tile t */
#define AMX_MAC(s, t, b, c) do { _tile_loadd(t, wb[b] + (c) * 512, 64); _tile_dpbf16ps(s, 4, t); } while (0)

/* Every row (x: M rows at stride XS, KC chunks of 32 inputs) times one set of nb <= 4 output blocks, block i's tiles
 * at wb[i] ([KC][512]), 16 rows at a time -> y (amx_store: b0, f); `configured`: the rows the thread's tiles are
 * configured for (updated). */
static void amx_set_rows(const uint16_t* x, int64_t XS, int64_t M, const uint16_t* const* wb, int64_t KC, int64_t b0,
                         int64_t nb, const float* bias, int64_t N, uint16_t* y, const Fuse* f, int* configured) {
    float o[16 * 64]; /* [rows][nb x 16] floats, amx_store's input */
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
        const int rows = (int)(M - m0 < 16 ? M - m0 : 16);
        if (rows != *configured) amx_configure(*configured = rows);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c < KC; c++) {
            _tile_loadd(4, x + m0 * XS + c * 32, XS * 2);
            AMX_MAC(0, 5, 0, c);
            if (nb > 1) AMX_MAC(1, 6, 1, c);
            if (nb > 2) AMX_MAC(2, 7, 2, c);
            if (nb > 3) AMX_MAC(3, 5, 3, c);
        }
        _tile_stored(0, o, nb * 64);
        if (nb > 1) _tile_stored(1, o + 16, nb * 64);
        if (nb > 2) _tile_stored(2, o + 32, nb * 64);
        if (nb > 3) _tile_stored(3, o + 48, nb * 64);
        amx_store(o, rows, nb, b0, m0, bias, N, y, f);
    }
}

/* the codes a wide product decodes (int8: w, s = the per-output scales; int4: w, s, lo, G) */
typedef struct {
    const uint8_t* w;
    const float *s, *lo;
    int64_t K, G, N;
} Codes;

/* Every row (x: M rows at stride XS) times the NB output blocks, in sets of 4 blocks split over a region's threads by
 * the `omp for` (or all in the calling thread: no region entered, native.h PARALLEL_FOR); FUSE_SWIGLU's sets are 2
 * gate blocks and their 2 up blocks. The weights: w in the tiles' layout, or (decode, q) writing a set's tiles into
 * the thread's part of ub (`wide_rows`; w NULL). */
static void amx_sets(const uint16_t* x, int64_t XS, int64_t M, const uint16_t* w, uint16_t* ub, int64_t KC, int64_t NB,
                     void (*decode)(const Codes*, int64_t, int64_t, uint16_t*), const Codes* q, const float* bias,
                     int64_t N, uint16_t* y, const Fuse* f) {
    int configured = 0; /* rows the tiles are configured for (each thread configures its own) */
    uint16_t* u = decode ? ub + (size_t)(4 * KC * 512) * (size_t)omp_get_thread_num() : NULL;
    const int swiglu = f && f->kind == FUSE_SWIGLU;
    const int64_t per = swiglu ? 2 : 4, blocks = swiglu ? f->I / 16 : NB; /* a set's (gate) blocks; how many */
#pragma omp for schedule(static)
    for (int64_t set = 0; set < (blocks + per - 1) / per; set++) {
        const int64_t b0 = set * per, n = blocks - b0 < per ? blocks - b0 : per;
        const int64_t first[2] = {b0, swiglu ? f->up / 16 + b0 : 0}; /* the set's runs of n blocks: 1, or 2 */
        const uint16_t* wb[4];
        for (int run = 0; run < 1 + swiglu; run++) {
            if (decode) decode(q, first[run], n, u + run * n * KC * 512);
            for (int64_t i = 0; i < n; i++)
                wb[run * n + i] = decode ? u + (run * n + i) * KC * 512 : w + (first[run] + i) * KC * 512;
        }
        amx_set_rows(x, XS, M, wb, KC, b0, n * (1 + swiglu), bias, N, y, f, &configured);
    }
    if (configured) _tile_release();
}

/* x bf16 [M, K] times w (pack_bf16's AMX layout, N outputs), bias fp32 [N] or NULL -> y as f says (NULL: FUSE_NONE);
 * 0 or -1 (memory) */
static int bf16_product(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, const float* bias, int64_t N,
                        uint16_t* y, const Fuse* f, int nthreads) {
    const int64_t KC = (K + 31) / 32, XS = KC * 32, NB = (N + 15) / 16;
    uint16_t* xp = NULL; /* rows padded to whole chunks with zeros (only when K is not a multiple of 32) */
    if (K % 32) {
        if (!(xp = alloc64(sizeof(uint16_t) * (size_t)(M * XS)))) return -1;
        memset(xp, 0, sizeof(uint16_t) * (size_t)(M * XS));
        for (int64_t m = 0; m < M; m++) memcpy(xp + m * XS, x + m * K, sizeof(uint16_t) * (size_t)K);
    }
    const uint16_t* xa = xp ? xp : x;
    if (nthreads > 1) {
#pragma omp parallel num_threads(nthreads)
        amx_sets(xa, XS, M, w, NULL, KC, NB, NULL, NULL, bias, N, y, f);
    } else
        amx_sets(xa, XS, M, w, NULL, KC, NB, NULL, NULL, bias, N, y, f);
    free(xp);
    return 0;
}

int bf16_linear(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, const float* bias, int64_t N, uint16_t* y,
                int nthreads) {
    return bf16_product(x, M, K, w, bias, N, y, NULL, nthreads);
}

/* FUSE_SWIGLU's shape: I and up multiples of 16, gate and up apart and within the N outputs */
static int fusable(const Fuse* f, int64_t N) {
    return f->kind != FUSE_SWIGLU || (f->I > 0 && f->I % 16 == 0 && f->up % 16 == 0 && f->up >= f->I && f->up + f->I <= N);
}

/* bf16_linear fused with what follows it (step.c): y as f says (Fuse, no bias); 0, -1 (memory), or -2 where f's
 * shape does not fit (`fusable`: nothing written) */
int bf16_linear_fused(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, uint16_t* y, const Fuse* f,
                      int nthreads) {
    return fusable(f, N) ? bf16_product(x, M, K, w, NULL, N, y, f, nthreads) : -2;
}

/* Prompt products of int8 / int4 layers (`q8_linear_wide`, `q4_linear_wide`): the codes are decoded to bf16 weights
 * (w = scale * code, or scale * code + low per int4 group, each rounded once to bf16) into the tiles' layout and
 * multiplied by the bf16 rows on `tdpbf16ps`, as bf16_linear multiplies. Not the integer products' bits - the rows
 * are not quantized to int8 - so only a prompt's chunks take them (every path reads a prompt with the same chunks
 * through the same products, so greedy decoding stays exact; linear.py `prompt_products`), never a decode step or a
 * verify. What it buys: the integer tiles ran a 256-row chunk at 195-250 GMAC/s (the per-block float work after every
 * 32-input dot product), the bf16 tiles at ~550, and decoding 64 outputs' codes costs a few % of their rows' products
 * (docs/decisions.md, 2026-12-05, fourth session).
 * Both take their codes 64 outputs at a time (a set of 4 output blocks), decoded into the thread's buffer
 * u [4][KC][16][16][2] (pack_bf16's AMX layout for those outputs); the set then takes every row 16 at a time. */

/* 16 lanes of fp32 pairs (a: input 2p, b: input 2p+1) -> 16 lanes of two bf16 each (a low, b high), rounded to nearest
 * even as to_bf16 rounds (the codes' weights are finite) */
static inline __m512i bf16_pairs(__m512 a, __m512 b) {
    const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(b, a); /* words 0..15: a's lanes, 16..31: b's */
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                            21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(order, halves);
}

/* int8 codes of output blocks b0..b0+nb-1 (pack_int8's layout, stored + Q8_OFFSET) -> u. Lane j of a 64-byte load of
 * groups 2b, 2b+1 at input quad kc: output 16b + j's codes for inputs 4kc..4kc+3. */
static void dq8_tiles(const uint8_t* w, const float* sw, int64_t K, int64_t N, int64_t b0, int64_t nb, uint16_t* u) {
    const int64_t KQ = K / 4, KC = K / 32;
    for (int64_t i = 0; i < nb; i++) {
        const int64_t b = b0 + i;
        const __m512 sc = _mm512_maskz_loadu_ps(lanes16(N - 16 * b), sw + 16 * b); /* (pad outputs: 0) */
        const uint8_t *g0 = w + 2 * b * KQ * 32, *g1 = g0 + KQ * 32;
        const int two = 2 * b + 1 < (N + 7) / 8; /* group 2b + 1 exists */
        for (int64_t kc = 0; kc < KQ; kc++) {
            const __m256i lo = _mm256_loadu_si256((const __m256i*)(g0 + kc * 32));
            const __m256i hi = two ? _mm256_loadu_si256((const __m256i*)(g1 + kc * 32)) : _mm256_set1_epi8((char)Q8_OFFSET);
            const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            __m512 f[4];
            for (int e = 0; e < 4; e++) {
                const __m512i c = _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(v, 8 * e), _mm512_set1_epi32(0xff)),
                                                   _mm512_set1_epi32(Q8_OFFSET));
                f[e] = _mm512_mul_ps(_mm512_cvtepi32_ps(c), sc);
            }
            const int64_t c = kc / 8, p = (kc % 8) * 2; /* inputs 4kc.. are pairs p, p + 1 of chunk c */
            uint16_t* t = u + (i * KC + c) * 512 + p * 32;
            _mm512_storeu_si512(t, bf16_pairs(f[0], f[1]));
            _mm512_storeu_si512(t + 32, bf16_pairs(f[2], f[3]));
        }
    }
}

/* [a, b] (without AVX-512 DQ's _mm512_insertf32x8) */
static inline __m512 join8(__m256 a, __m256 b) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(a)), _mm256_castps_pd(b), 1));
}

/* int4 codes of output blocks b0..b0+nb-1 (pack_int4's layout: per group of 8 outputs and 8 inputs, 4 bytes an output,
 * byte i = input i | input 4 + i << 4), scales s and offsets lo (pack_int4_groups: [groups][K/G][8]) -> u */
static void dq4_tiles(const uint8_t* w, const float* s, const float* lo, int64_t K, int64_t G, int64_t N, int64_t b0,
                      int64_t nb, uint16_t* u) {
    const int64_t KO = K / 8, KC = K / 32, nq = K / G, NG = (N + 7) / 8, GO = G / 8;
    const __m512i nib = _mm512_set1_epi32(0xf);
    for (int64_t i = 0; i < nb; i++) {
        const int64_t b = b0 + i;
        const int two = 2 * b + 1 < NG;
        const uint8_t *g0 = w + 2 * b * KO * 32, *g1 = g0 + KO * 32;
        for (int64_t qg = 0; qg < nq; qg++) { /* a group's scales and offsets once (no division an input octet: it was
                                                * a fifth of the decode) */
            const __m256 s0 = _mm256_loadu_ps(s + (2 * b * nq + qg) * 8), l0 = _mm256_loadu_ps(lo + (2 * b * nq + qg) * 8);
            const __m256 s1 = two ? _mm256_loadu_ps(s + ((2 * b + 1) * nq + qg) * 8) : _mm256_setzero_ps();
            const __m256 l1 = two ? _mm256_loadu_ps(lo + ((2 * b + 1) * nq + qg) * 8) : _mm256_setzero_ps();
            const __m512 sc = join8(s0, s1);
            const __m512 lw = join8(l0, l1);
            for (int64_t ko = qg * GO; ko < (qg + 1) * GO; ko++) {
                _mm_prefetch((const char*)(g0 + ko * 32 + 512), _MM_HINT_T0); /* the codes stream from L3 */
                if (two) _mm_prefetch((const char*)(g1 + ko * 32 + 512), _MM_HINT_T0);
                const __m256i a = _mm256_loadu_si256((const __m256i*)(g0 + ko * 32));
                const __m256i c1 = two ? _mm256_loadu_si256((const __m256i*)(g1 + ko * 32)) : _mm256_setzero_si256();
                const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(a), c1, 1);
                __m512 f[8]; /* inputs 8ko + e: byte e % 4, low nibble for e < 4 */
                for (int e = 0; e < 8; e++) {
                    const __m512i c = _mm512_and_si512(_mm512_srli_epi32(v, 8 * (e % 4) + 4 * (e / 4)), nib);
                    f[e] = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(c), sc), lw);
                }
                const int64_t c = ko / 4, p = (ko % 4) * 4; /* inputs 8ko.. are pairs p..p+3 of chunk c */
                uint16_t* t = u + (i * KC + c) * 512 + p * 32;
                for (int e = 0; e < 4; e++) _mm512_storeu_si512(t + e * 32, bf16_pairs(f[2 * e], f[2 * e + 1]));
            }
        }
    }
}

static void dq8_set(const Codes* q, int64_t b0, int64_t nb, uint16_t* u) { dq8_tiles(q->w, q->s, q->K, q->N, b0, nb, u); }
static void dq4_set(const Codes* q, int64_t b0, int64_t nb, uint16_t* u) {
    dq4_tiles(q->w, q->s, q->lo, q->K, q->G, q->N, b0, nb, u);
}

/* x bf16 [M, K] (K % 32 == 0) times the weights `decode` writes set by set, bias fp32 [N] or NULL -> y bf16 [M, N];
 * 0 or -1 (memory) */
static int wide_rows(const uint16_t* x, int64_t M, const Codes* q, void (*decode)(const Codes*, int64_t, int64_t, uint16_t*),
                     const float* bias, uint16_t* y, const Fuse* f, int nthreads) {
    const int64_t K = q->K, N = q->N, KC = K / 32, NB = (N + 15) / 16;
    uint16_t* ub = alloc64(sizeof(uint16_t) * (size_t)(4 * KC * 512 * nthreads)); /* a set's tiles, per thread */
    if (!ub) return -1;
    if (nthreads > 1) {
#pragma omp parallel num_threads(nthreads)
        amx_sets(x, K, M, NULL, ub, KC, NB, decode, q, bias, N, y, f);
    } else
        amx_sets(x, K, M, NULL, ub, KC, NB, decode, q, bias, N, y, f);
    free(ub);
    return 0;
}

/* as q8_linear's arguments */
int q8_linear_wide(const uint16_t* x, int64_t M, int64_t K, const uint8_t* wq, const float* sw, const float* bias,
                   int64_t N, uint16_t* y, int nthreads) {
    const Codes q = {wq, sw, NULL, K, 0, N};
    return wide_rows(x, M, &q, dq8_set, bias, y, NULL, nthreads);
}

/* as q4_linear's arguments */
int q4_linear_wide(const uint16_t* x, int64_t M, int64_t K, const uint8_t* wq, const float* s, const float* lo,
                   int64_t G, const float* bias, int64_t N, uint16_t* y, int nthreads) {
    const Codes q = {wq, s, lo, K, G, N};
    return wide_rows(x, M, &q, dq4_set, bias, y, NULL, nthreads);
}

/* q8_linear_wide, q4_linear_wide fused with what follows them, as bf16_linear_fused (no bias) */
int q8_linear_wide_fused(const uint16_t* x, int64_t M, int64_t K, const uint8_t* wq, const float* sw, int64_t N,
                         uint16_t* y, const Fuse* f, int nthreads) {
    const Codes q = {wq, sw, NULL, K, 0, N};
    return fusable(f, N) ? wide_rows(x, M, &q, dq8_set, NULL, y, f, nthreads) : -2;
}

int q4_linear_wide_fused(const uint16_t* x, int64_t M, int64_t K, const uint8_t* wq, const float* s, const float* lo,
                         int64_t G, int64_t N, uint16_t* y, const Fuse* f, int nthreads) {
    const Codes q = {wq, s, lo, K, G, N};
    return fusable(f, N) ? wide_rows(x, M, &q, dq4_set, NULL, y, f, nthreads) : -2;
}
#undef AMX_MAC

#else
/* x bf16 [M, K], w bf16 interleaved as above, bias fp32 [N] or NULL -> y bf16 [M, N]; 0 or -1 (memory). Threads split the
 * output groups, 4 at a time for one row, 3 for more (each set taking every row, TILE_ROWS at a time). */
int bf16_linear(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, const float* bias, int64_t N, uint16_t* y,
                int nthreads) {
    const int64_t XS = BF_ROW_LEN(K);
    bf_act* xf = malloc(sizeof(bf_act) * (size_t)(M * XS)); /* the rows once, in the form the build multiplies */
    if (!xf) return -1;
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    for (int64_t m = 0; m < M; m++) { /* bf16 pairs, an odd K's last one padded with a zero */
        xf[m * XS + XS - 1] = 0;
        memcpy(xf + m * XS, x + m * K, sizeof(uint16_t) * (size_t)K);
    }
#else
    for (int64_t i = 0; i < M * K; i++) xf[i] = bf16_to_f(x[i]); /* widened (exact) */
#endif
    const int64_t G = (N + 7) / 8, GS = M == 1 ? 4 : 3, sets = (G + GS - 1) / GS;
    PARALLEL_FOR(1, set, sets, {
        const int64_t g0 = set * GS, gs = G - g0 < GS ? G - g0 : GS;
        float o[TILE_ROWS * 4 * 8];
        for (int64_t m0 = 0; m0 < M; m0 += TILE_ROWS) {
            const int64_t R = M - m0 < TILE_ROWS ? M - m0 : TILE_ROWS;
            const bf_act* xm = xf + m0 * XS;
            if (M == 1 && gs == 4) bf_row(w, g0, K, xm, o);
            else if (M == 1) /* the last groups of one row */
                for (int64_t g = 0; g < gs; g++) bf_rows_1_1(w, g0 + g, K, xm, o + g * 8, 0);
            else if (gs == 3)
                bf_rows(R, 3, w, g0, K, xm, o, m0 + TILE_ROWS >= M);
            else { /* the last one or two groups: [R][gs][8] as the 3-group tile writes it */
                float t[TILE_ROWS * 8];
                for (int64_t g = 0; g < gs; g++) {
                    bf_rows(R, 1, w, g0 + g, K, xm, t, 0);
                    for (int64_t r = 0; r < R; r++) memcpy(o + (r * gs + g) * 8, t + r * 8, sizeof(float) * 8);
                }
            }
            sum_store(o, R, gs * 8, gs * 8, g0 * 8, m0, bias, N, y);
        }
    });
    free(xf);
    return 0;
}
#endif
