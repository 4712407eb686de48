/* Round-to-nearest quantization of float weights into the int8 / int4 kernels' operands, built and loaded by
 * native.py and called by rtn.py: one pass over each weight row instead of the ~10 tensor passes (a float copy, a
 * min, a max, a division, a round, an add, a clamp, a cast, the nibble packing) of the torch form in linear.py.
 *
 * The arithmetic is the torch form's, operation for operation, in fp32 (IEEE division, round half to even, the same
 * clamps), so the codes, scales and zero points are bit for bit the torch form's (tests/test_rtn.py). Built with
 * -ffp-contract=off: no product or quotient is fused with anything. A row holding NaN or Inf is left to the torch
 * form (the functions return 1 before writing a row that holds one), whose NaN propagation is not reproduced here.
 * Rows are independent, so the threads' split does not change a bit. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "native.h"

/* 8 weights from row w at element i (bf16 or fp32) as floats. */
static inline __m256 load8(const void* w, int bf16, int64_t i) {
    if (bf16) {
        __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)w + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float*)w + i);
}

static inline float load1(const void* w, int bf16, int64_t i) {
    return bf16 ? bf16_to_f(((const uint16_t*)w)[i]) : ((const float*)w)[i];
}

static inline float hmin(__m256 v) {
    __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_min_ps(m, _mm_movehl_ps(m, m));
    m = _mm_min_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

static inline float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

/* Nonzero when any lane is NaN or +-Inf (x - x is NaN exactly then). */
static inline int nonfinite8(__m256 x) {
    return _mm256_movemask_ps(_mm256_cmp_ps(_mm256_sub_ps(x, x), _mm256_sub_ps(x, x), _CMP_UNORD_Q));
}

/* 16 int32 lanes (a: 0..7, b: 8..15), each in 0..255, -> 16 bytes in order. */
static inline __m128i narrow16(__m256i a, __m256i b) {
    __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);  /* 16 x u16, in order */
    return _mm_packus_epi16(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
}

/* 16 int32 lanes (a: 0..7, b: 8..15), each in -128..127, -> 16 signed bytes in order. */
static inline __m128i narrow16s(__m256i a, __m256i b) {
    __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);  /* 16 x i16, in order */
    return _mm_packs_epi16(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
}

/* int4, one group's scale and zero point (`linear.Int4Weight.quantize`) from row[k0 .. k0 + group):
 *   asymmetric: lo = min(min(g), 0), hi = max(max(g), 0), scale = max((hi - lo) / 15, 1e-10), zero = clamp(round(-lo /
 *   scale), 0, 15); symmetric: scale = max(max|g| / 7, 1e-10), zero = 8. Returns nonzero where the group holds NaN/Inf. */
static inline int q4_params(const char* row, int bf16, int64_t k0, int64_t group, int symmetric, float* s, float* z) {
    __m256 mn = load8(row, bf16, k0), mx = mn;
    int nf = 0;
    for (int64_t i = k0; i < k0 + group; i += 8) {
        __m256 x = load8(row, bf16, i);
        nf |= nonfinite8(x);
        mn = _mm256_min_ps(mn, x);
        mx = _mm256_max_ps(mx, x);
    }
    if (nf) return 1;
    if (symmetric) {
        const float a = fmaxf(-hmin(mn), hmax(mx));  /* max |g| */
        *s = a / 7.0f;
        *s = *s < 1e-10f ? 1e-10f : *s;
        *z = 8.0f;
    } else {
        float lo = hmin(mn), hi = hmax(mx);
        lo = lo > 0.0f ? 0.0f : lo;
        hi = hi < 0.0f ? 0.0f : hi;
        *s = (hi - lo) / 15.0f;
        *s = *s < 1e-10f ? 1e-10f : *s;
        *z = rintf(-lo / *s);
        *z = *z < 0.0f ? 0.0f : *z > 15.0f ? 15.0f : *z;
    }
    return 0;
}

/* int4 codes clamp(round(row[i..i+32) / s) + z, 0, 15), one a byte, in order (vs, vz: s and z on 8 lanes). */
static inline __m256i q4_codes32(const char* row, int bf16, int64_t i, __m256 vs, __m256 vz) {
    const __m256 v0 = _mm256_setzero_ps(), v15 = _mm256_set1_ps(15.0f);
    __m256i c[4];
    for (int j = 0; j < 4; j++) {
        __m256 q = _mm256_div_ps(load8(row, bf16, i + 8 * j), vs);
        q = _mm256_add_ps(_mm256_round_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), vz);
        q = _mm256_min_ps(_mm256_max_ps(q, v0), v15);
        c[j] = _mm256_cvtps_epi32(q);  /* an integer already: exact */
    }
    return _mm256_set_m128i(narrow16(c[2], c[3]), narrow16(c[0], c[1]));
}

/* int4, groups of `group` inputs (group % 32 == 0, K % group == 0), per row of w [N, K] (row stride sw elements), as
 * `q4_params` and `q4_codes32` -> codes uint8 [N, K], scale fp32 [N, K/group], zero uint8 [N, K/group]. Returns 0, or
 * 1 (a row holds NaN/Inf). */
int q4_quantize(int64_t N, int64_t K, const void* w, int64_t sw, int bf16, int64_t group, int symmetric,
                uint8_t* codes, float* scale, uint8_t* zero, int nthreads) {
    const int64_t G = K / group;
    int bad = 0;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && N * K >= (1 << 20)) reduction(| : bad)
    for (int64_t n = 0; n < N; n++) {
        if (bad) continue;
        const char* row = (const char*)w + n * sw * (bf16 ? 2 : 4);
        for (int64_t g = 0; g < G; g++) {
            float s, z;
            if (q4_params(row, bf16, g * group, group, symmetric, &s, &z)) { bad = 1; break; }
            scale[n * G + g] = s;
            zero[n * G + g] = (uint8_t)z;
            const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z);
            for (int64_t i = g * group; i < (g + 1) * group; i += 32)
                _mm256_storeu_si256((__m256i*)(codes + n * K + i), q4_codes32(row, bf16, i, vs, vz));
        }
    }
    return bad;
}

/* 32 codes (one a byte, in order) -> the q4 kernel's 4 words for their 4 runs of 8 inputs, in the low 128 bits: a run's
 * word holds bytes q[i] | q[4 + i] << 4 (codes < 16: the high half's shift stays in its byte). */
static inline __m128i q4_words(__m256i c) {
    const __m256i w = _mm256_or_si256(c, _mm256_slli_epi64(_mm256_srli_epi64(c, 32), 4));
    return _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6)));
}

/* q4_quantize's codes, scales and zero points written straight into the q4 kernel's operands (N % 8 == 0; linear.py
 * `_native_int4`): packed uint8 [N/8][4K] as qmatmul.py's `pack_int4` (per 8 outputs and 8 inputs, output j's word
 * of `q4_words`), scale and low = -zero * scale fp32 [N/8][K/group * 8] as its `pack_int4_groups`. A group of 8 rows
 * goes 64 inputs at a time: each row's 8 words, then one 8 x 8 transpose of the words into the group's 256 bytes for
 * those inputs (the separate packing was most of a `--quantize int4` load's copying: docs/decisions.md, 2026-12-07).
 * Returns 0, or 1 (a row holds NaN/Inf). */
int q4_quantize_packed(int64_t N, int64_t K, const void* w, int64_t sw, int bf16, int64_t group, int symmetric,
                       uint8_t* packed, float* scale, float* low, int nthreads) {
    const int64_t G = K / group;
    int bad = 0;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && N * K >= (1 << 20)) reduction(| : bad)
    for (int64_t g = 0; g < N / 8; g++) {
        if (bad) continue;
        const char* row[8];
        float* sg = scale + g * G * 8;  /* [K/group][8]: the group's 8 rows' scales, zero points below */
        float* lg = low + g * G * 8;
        for (int j = 0; j < 8; j++) {
            row[j] = (const char*)w + (8 * g + j) * sw * (bf16 ? 2 : 4);
            for (int64_t q = 0; q < G && !bad; q++) {
                float s, z;
                if (q4_params(row[j], bf16, q * group, group, symmetric, &s, &z)) bad = 1;
                sg[q * 8 + j] = s;
                lg[q * 8 + j] = (float)(uint8_t)z;  /* the stored zero point (-0 -> 0) for now; low once coded */
            }
        }
        if (bad) continue;
        uint8_t* o = packed + g * 4 * K;
        for (int64_t i = 0; i < K; i += 64) {
            const int halves = i + 64 <= K ? 2 : 1;  /* (K % 64 == 32: the last 32 inputs alone) */
            __m256 r[8];
            for (int j = 0; j < 8; j++) {
                __m128i h[2] = {_mm_setzero_si128(), _mm_setzero_si128()};
                for (int t = 0; t < halves; t++) {
                    const int64_t q = (i + 32 * t) / group;
                    h[t] = q4_words(q4_codes32(row[j], bf16, i + 32 * t, _mm256_set1_ps(sg[q * 8 + j]),
                                               _mm256_set1_ps(lg[q * 8 + j])));
                }
                r[j] = _mm256_castsi256_ps(_mm256_set_m128i(h[1], h[0]));
            }
            transpose_words8(r);
            for (int c = 0; c < 4 * halves; c++) _mm256_storeu_ps((float*)(o + (i / 8 + c) * 32), r[c]);
        }
        for (int64_t k = 0; k < G * 8; k++) lg[k] = -lg[k] * sg[k];
    }
    return bad;
}

/* int8, one row's scale (`linear.quantize_int8`): max(max|row| / 127, 1e-12) into *s. Returns nonzero where the row
 * holds NaN/Inf (*s then unset). */
static inline int q8_scale(const char* row, int bf16, int64_t K, float* s) {
    const int64_t K8 = K - K % 8;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 mx = _mm256_setzero_ps();
    int nf = 0;
    for (int64_t i = 0; i < K8; i += 8) {
        __m256 x = load8(row, bf16, i);
        nf |= nonfinite8(x);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, x));
    }
    float a = hmax(mx);
    for (int64_t i = K8; i < K; i++) {
        const float x = load1(row, bf16, i);
        nf |= !isfinite(x);
        a = fabsf(x) > a ? fabsf(x) : a;
    }
    if (nf) return 1;
    const float q = a / 127.0f;
    *s = q < 1e-12f ? 1e-12f : q;
    return 0;
}

/* int8 codes clamp(round(row[i..i+32) / s), -127, 127), in order (vs: s on 8 lanes). */
static inline __m256i q8_codes32(const char* row, int bf16, int64_t i, __m256 vs) {
    const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    __m256i c[4];
    for (int j = 0; j < 4; j++) {
        __m256 q = _mm256_div_ps(load8(row, bf16, i + 8 * j), vs);
        q = _mm256_round_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        c[j] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(q, lo), hi));
    }
    return _mm256_set_m128i(narrow16s(c[2], c[3]), narrow16s(c[0], c[1]));
}

static inline int8_t q8_code1(const char* row, int bf16, int64_t i, float s) {
    float q = rintf(load1(row, bf16, i) / s);
    q = q < -127.0f ? -127.0f : q > 127.0f ? 127.0f : q;
    return (int8_t)q;
}

/* int8, symmetric per output row of w [N, K] (row stride sw elements): scale = max(max|row| / 127, 1e-12), codes =
 * clamp(round(row / scale), -127, 127) (`linear.quantize_int8`) -> codes int8 [N, K], scale fp32 [N]. Returns 0, or
 * 1 (a row holds NaN/Inf). */
int q8_quantize(int64_t N, int64_t K, const void* w, int64_t sw, int bf16, int8_t* codes, float* scale, int nthreads) {
    int bad = 0;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && N * K >= (1 << 20)) reduction(| : bad)
    for (int64_t n = 0; n < N; n++) {
        if (bad) continue;
        const char* row = (const char*)w + n * sw * (bf16 ? 2 : 4);
        if (q8_scale(row, bf16, K, &scale[n])) { bad = 1; continue; }
        const float s = scale[n];
        int8_t* out = codes + n * K;
        const __m256 vs = _mm256_set1_ps(s);
        int64_t i = 0;
        for (; i + 32 <= K; i += 32) _mm256_storeu_si256((__m256i*)(out + i), q8_codes32(row, bf16, i, vs));
        for (; i < K; i++) out[i] = q8_code1(row, bf16, i, s);
    }
    return bad;
}

/* q8_quantize's codes and scales written straight into qmatmul.py's `pack_int8` layout, out uint8
 * [ceil(N/8)][Kp/4][8][4]: byte (g, c, j, i) is row 8g+j's code for input 4c+i, + 128 where `flip` (the AVX-512
 * builds' unsigned form); inputs past K (Kp >= K, Kp % 32 == 0) and rows past N get zero codes. scale fp32 [N]. A
 * group of 8 rows goes 32 inputs at a time: each row's 8 words of 4 codes, then one 8 x 8 transpose of the words
 * into the group's 256 bytes for those inputs (the separate pack was most of a `--quantize int8` load's copying:
 * docs/decisions.md, 2026-12-07). Returns 0, or 1 (a row holds NaN/Inf). */
int q8_quantize_packed(int64_t N, int64_t K, int64_t Kp, const void* w, int64_t sw, int bf16, int flip, uint8_t* out,
                       float* scale, int nthreads) {
    const int64_t G = (N + 7) / 8;
    int bad = 0;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && N * K >= (1 << 20)) reduction(| : bad)
    for (int64_t g = 0; g < G; g++) {
        if (bad) continue;
        const int rows = N - 8 * g < 8 ? (int)(N - 8 * g) : 8;
        const char* row[8];
        __m256 vs[8];
        for (int j = 0; j < rows; j++) {
            row[j] = (const char*)w + (8 * g + j) * sw * (bf16 ? 2 : 4);
            if (q8_scale(row[j], bf16, K, &scale[8 * g + j])) bad = 1;
            vs[j] = _mm256_set1_ps(scale[8 * g + j]);
        }
        if (bad) continue;
        const __m256i top = _mm256_set1_epi8(flip ? (char)0x80 : 0);
        uint8_t* o = out + g * (Kp / 4) * 32;
        for (int64_t i = 0; i < Kp; i += 32) {
            __m256 r[8];
            for (int j = 0; j < 8; j++) {
                if (j >= rows || i >= K) {
                    r[j] = _mm256_setzero_ps();
                } else if (i + 32 <= K) {
                    r[j] = _mm256_castsi256_ps(q8_codes32(row[j], bf16, i, vs[j]));
                } else {  /* the last inputs, then zeros */
                    int8_t tail[32] = {0};
                    for (int64_t k = i; k < K; k++) tail[k - i] = q8_code1(row[j], bf16, k, scale[8 * g + j]);
                    r[j] = _mm256_loadu_ps((const float*)tail);
                }
            }
            transpose_words8(r);
            for (int c = 0; c < 8; c++)
                _mm256_storeu_si256((__m256i*)(o + (i / 4 + c) * 32), _mm256_xor_si256(_mm256_castps_si256(r[c]), top));
        }
    }
    return bad;
}
