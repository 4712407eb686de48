/* What every C kernel of native.py shares: bfloat16 <-> float as torch converts (round to nearest even, NaN kept a
 * NaN), and one vector exp (Gated DeltaNet's SiLU, SwiGLU's, the attention gate's sigmoid: act.c). A header beside
 * the sources: native.py keys each build on it too. */

#ifndef MTP_NATIVE_H
#define MTP_NATIVE_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* for (int64_t VAR = 0; VAR < N; VAR++) BODY, split over `nthreads` (a variable of that name in scope) OpenMP threads
 * (schedule(static)) where nthreads > 1 and `cond`, else a plain loop in the calling thread. Entering an OpenMP
 * parallel region costs ~170 ns even with one thread or a false `if` clause (libgomp sets a team up either way), and
 * one thread's int4 decode step of the shipped model entered ~120 of them, its speculative round ~260 (3% of either;
 * docs/decisions.md, 2026-12-06 seventh session). A kernel whose region holds more than one loop calls the region's
 * body as a function instead: inside `#pragma omp parallel` where threads pay, directly otherwise (its `omp for`
 * loops, orphaned, then run whole in the calling thread). */
#define PARALLEL_FOR(cond, VAR, N, ...)                                                                             \
    do {                                                                                                            \
        const int64_t VAR##_n = (N);                                                                                \
        if (nthreads > 1 && (cond)) {                                                                               \
            _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                                     \
            for (int64_t VAR = 0; VAR < VAR##_n; VAR++) __VA_ARGS__                                                 \
        } else                                                                                                      \
            for (int64_t VAR = 0; VAR < VAR##_n; VAR++) __VA_ARGS__                                                 \
    } while (0)

/* What a product's sums become (qmatmul.c's tile products; step.c fuses a layer's next elementwise step into its
 * product where the kernel can: the values it would compute from the product's bf16 outputs, the same bits, without
 * writing and reading those outputs again):
 *   FUSE_NONE:   y [M, N] = bias + sum, rounded once to bf16;
 *   FUSE_SWIGLU: the outputs are an MLP's gate (0..I-1) and up (up..up+I-1), each rounded to bf16 -> y [M, I] =
 *                act.c silu_mul's arithmetic over them;
 *   FUSE_ADD:    y [M, N] := y + the rounded output, step.c add_rows' arithmetic (the residual sum). */
enum { FUSE_NONE = 0, FUSE_SWIGLU = 1, FUSE_ADD = 2 };
typedef struct {
    int64_t kind, I, up; /* FUSE_*; FUSE_SWIGLU's width and where up starts */
} Fuse;

static inline float bf16_to_f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* 8 rows of 8 4-byte words -> their transpose (the words' bits moved as they are): dequant.c's packings, rtn.c's. */
static inline void transpose_words8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

/* exp on 8 lanes (Cody-Waite range reduction and a degree-6 polynomial, as Cephes' expf: ~1 ulp), the same
 * arithmetic for every lane: a value rounds alike wherever it sits in a vector. One body for exp8 and, in AVX-512
 * builds, exp16 (P: the intrinsics' prefix, V / VI: the float / integer vector, ROUND: to nearest), so the two compute
 * the same bits lane for lane. */
#define MTP_EXP(P, V, VI, ROUND, CAST)                                                                                \
    {                                                                                                                \
        x = P##_min_ps(P##_max_ps(x, P##_set1_ps(-87.3f)), P##_set1_ps(88.3f));                                      \
        const V n = ROUND(P##_mul_ps(x, P##_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); \
        V r = P##_fnmadd_ps(n, P##_set1_ps(0.693359375f), x);                                                        \
        r = P##_fnmadd_ps(n, P##_set1_ps(-2.12194440e-4f), r);                                                       \
        V p = P##_set1_ps(1.9875691500e-4f);                                                                         \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.3981999507e-3f));                                                       \
        p = P##_fmadd_ps(p, r, P##_set1_ps(8.3334519073e-3f));                                                       \
        p = P##_fmadd_ps(p, r, P##_set1_ps(4.1665795894e-2f));                                                       \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.6666665459e-1f));                                                       \
        p = P##_fmadd_ps(p, r, P##_set1_ps(5.0000001201e-1f));                                                       \
        const V y = P##_add_ps(P##_fmadd_ps(P##_mul_ps(p, r), r, r), P##_set1_ps(1.0f));                             \
        const VI e = P##_slli_epi32(P##_add_epi32(P##_cvtps_epi32(n), P##_set1_epi32(127)), 23);                     \
        return P##_mul_ps(y, CAST(e));                                                                              \
    }
static inline __m256 exp8(__m256 x) MTP_EXP(_mm256, __m256, __m256i, _mm256_round_ps, _mm256_castsi256_ps)

/* silu(x) = x / (1 + exp8(-x)) lane by lane, not rounded (act.c's SwiGLU, deltanet.c's conv and gate, qmatmul.c's
 * fused SwiGLU store: one arithmetic for all) */
static inline __m256 silu8(__m256 x) {
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

static inline float round_bf16(float f) { return bf16_to_f(to_bf16(f)); } /* float rounded to bfloat16, as a float */

/* 8 bf16 -> 8 floats (exact) */
static inline __m256 bf16x8_to_f(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

/* round_bf16 on 8 lanes (to_bf16's rule: nearest even, NaN kept a NaN) */
static inline __m256 round_bf16x8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i rounded = _mm256_and_si256(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)),
                         _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))),
        _mm256_set1_epi32((int)0xffff0000u));
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    const __m256i quiet = _mm256_or_si256(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u)), _mm256_set1_epi32(0x400000));
    return _mm256_castsi256_ps(_mm256_blendv_epi8(rounded, quiet, nan));
}

/* 8 floats -> 8 bf16 as to_bf16 rounds them (nearest even, NaN kept a NaN) */
static inline void f_to_bf16x8(uint16_t* p, __m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)),
                         _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i h = _mm256_blendv_epi8(rounded, quiet, nan); /* 8 x 32 bits, each < 2^16 */
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    _mm_storeu_si128((__m128i*)p, packed);
}

#if defined(__AVX512F__)
/* exp8 on 16 lanes (MTP_EXP: the same operations, the same bits) */
static inline __m512 exp16(__m512 x) MTP_EXP(_mm512, __m512, __m512i, _mm512_roundscale_ps, _mm512_castsi512_ps)

/* silu8 on 16 lanes */
static inline __m512 silu16(__m512 x) {
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

/* the mask of the first n (<= 16 taken) of 16 lanes */
static inline __mmask16 lanes16(int64_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }

/* round_bf16x8 on 16 lanes */
static inline __m512 round_bf16x16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i rounded = _mm512_and_si512(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                         _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))),
        _mm512_set1_epi32((int)0xffff0000u));
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i quiet = _mm512_or_si512(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)), _mm512_set1_epi32(0x400000));
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(rounded, nan, quiet));
}

/* the first n (<= 16) bf16 at p as floats, the other lanes 0 (nothing past p + n read) */
static inline __m512 bf16x16_to_f(const uint16_t* p, int64_t n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes16(n), p)), 16));
}

/* 16 floats -> 16 bf16 as to_bf16 rounds them, the lanes not in `keep` left unwritten (f_to_bf16x8 on 16 lanes) */
static inline void f_to_bf16x16(uint16_t* p, __m512 v, __mmask16 keep) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                         _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i h = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    _mm512_mask_cvtepi32_storeu_epi16(p, keep, h);
}
#endif


#if defined(__AVX512F__)
/* a 16 x 16 block of 32-bit words, rows at stride ss (words) -> its transpose, rows at stride ds (data movement only:
 * deltanet.c's conv outputs, attention.c's keys' pairs of bf16 dimensions into the tiles' layout) */
static inline void transpose_words16(const void* src, int64_t ss, void* dst, int64_t ds) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512((const uint32_t*)src + i * ss);
    for (int i = 0; i < 8; i++) { /* pairs of rows interleaved within each 128-bit quarter */
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* quads of rows: each quarter holds one column of 4 rows */
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 2; i++) /* then the quarters across 8 and 16 rows */
        for (int j = 0; j < 4; j++) {
            t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
            t[8 * i + j + 4] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0xDD);
        }
    for (int j = 0; j < 8; j++) {
        _mm512_storeu_si512((uint32_t*)dst + j * ds, _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88));
        _mm512_storeu_si512((uint32_t*)dst + (j + 8) * ds, _mm512_shuffle_i32x4(t[j], t[j + 8], 0xDD));
    }
}
#endif

#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>

/* Linux hands a process the tile registers' state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA): 0
 * when granted (each AMX build's `*_ready`: native.py loads another build otherwise) */
static inline int amx_permission(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 0 : -1; }

/* a tile configuration (palette 1): rows and bytes per row of tiles 0-7 */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) amx_config;
#endif

#endif
