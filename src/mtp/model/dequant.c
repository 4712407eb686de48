/* Decoding a checkpoint's scaled 8-bit codes to the model's float weights at load, built and loaded by native.py and
 * called by dequant.py: one pass over the codes instead of the torch form's chunked passes (`packed.dequantize_scaled`:
 * the codes to fp32, the multiply by the scales, the cast), which spent ~4 s of a 10 s FP8 load at the Qwen3.5-0.8B
 * shape on one core (docs/decisions.md, 2026-12-06 eleventh session).
 *
 * The arithmetic is the torch form's: each code's fp32 value (float8 e4m3fn / e5m2 through fp16, int8 converted; the
 * 256-entry table of torch's own conversions for the scalar tail: tests/test_dequant.py checks every code of each
 * format against torch), times its scale in fp32 (one rounding), then rounded to bf16 as torch rounds (nearest even; a
 * NaN stays a NaN) or kept in fp32; the NaN / Inf written are counted on the way (the loader's check then need not read
 * the weight again). Built with -ffp-contract=off. Rows are independent: the threads' split does not change a bit.
 * The AVX-512 build (native.py's AVX512_VNNI) decodes 16 codes a vector with the same operations: the same bits.
 * The same packing takes bf16 weights as stored (kind 5: a bf16 load's), and count_nonfinite checks a weight the loader
 * keeps as stored. */

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "native.h"

/* 8 codes -> their fp32 values, as torch converts them. kind 1: float8 e4m3fn, through fp16 (its 4 exponent and 3
 * mantissa bits placed in fp16's, the value then 2^-8 of the code's: exact, subnormals included, times 256 exactly),
 * its NaN codes (s.1111.111) as torch writes them (0x7ff00000 with the sign); 2: float8 e5m2, fp16's top byte (exact,
 * infinities and NaNs included); 3: int8. */
static inline __m256 decode8(const uint8_t* p, int kind) {
    const __m128i c = _mm_loadl_epi64((const __m128i*)p);
    if (kind == 3) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c));
    const __m128i b = _mm_cvtepu8_epi16(c);
    if (kind == 2) return _mm256_cvtph_ps(_mm_slli_epi16(b, 8));
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8);
    const __m128i mag = _mm_and_si128(b, _mm_set1_epi16(0x7f));
    const __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(sign, _mm_slli_epi16(mag, 7))), _mm256_set1_ps(256.0f));
    const __m256i nan = _mm256_cvtepi16_epi32(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f)));
    const __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_cvtepi16_epi32(sign), 16), _mm256_set1_epi32(0x7ff00000));
    return _mm256_blendv_ps(v, _mm256_castsi256_ps(bits), _mm256_castsi256_ps(nan));
}

#if defined(__AVX512F__)
/* decode8 on 16 codes (the same operations lane for lane: the same bits) */
static inline __m512 decode16(const uint8_t* p, int kind) {
    const __m128i c = _mm_loadu_si128((const __m128i*)p);
    if (kind == 3) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c));
    const __m256i b = _mm256_cvtepu8_epi16(c);
    if (kind == 2) return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
    const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi16(0x7f));
    const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(sign, _mm256_slli_epi16(mag, 7))), _mm512_set1_ps(256.0f));
    const __mmask16 nan = _mm256_cmpeq_epi16_mask(mag, _mm256_set1_epi16(0x7f));
    const __m512i bits = _mm512_or_si512(_mm512_slli_epi32(_mm512_cvtepi16_epi32(sign), 16), _mm512_set1_epi32(0x7ff00000));
    return _mm512_mask_mov_ps(v, nan, _mm512_castsi512_ps(bits));
}
#endif

/* 8 decoded weights v -> o[k .. k + 8): bf16 (bf16 != 0) or fp32; returns how many are NaN or +-Inf (bf16: counted
 * on the rounded values, as a finite float can round to a bf16 infinity). */
static inline int store8(__m256 v, int bf16, void* o, int64_t k) {
    if (bf16) {
        uint16_t* ob = (uint16_t*)o + k;
        f_to_bf16x8(ob, v);
        const __m128i e = _mm_and_si128(_mm_loadu_si128((const __m128i*)ob), _mm_set1_epi16(0x7f80));
        return __builtin_popcount(_mm_movemask_epi8(_mm_cmpeq_epi16(e, _mm_set1_epi16(0x7f80)))) / 2;
    }
    _mm256_storeu_ps((float*)o + k, v);
    const __m256 d = _mm256_sub_ps(v, v);  /* NaN exactly where v is NaN or infinite */
    return __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(d, d, _CMP_UNORD_Q)));
}

#if defined(__AVX512F__)
/* store8 on 16 weights (the same operations lane for lane: the same bits) */
static inline int store16(__m512 v, int bf16, void* o, int64_t k) {
    if (bf16) {
        uint16_t* ob = (uint16_t*)o + k;
        f_to_bf16x16(ob, v, 0xffff);
        const __m256i e = _mm256_and_si256(_mm256_loadu_si256((const __m256i*)ob), _mm256_set1_epi16(0x7f80));
        return __builtin_popcount(_mm256_cmpeq_epi16_mask(e, _mm256_set1_epi16(0x7f80)));
    }
    _mm512_storeu_ps((float*)o + k, v);
    const __m512 d = _mm512_sub_ps(v, v);
    return __builtin_popcount(_mm512_cmp_ps_mask(d, d, _CMP_UNORD_Q));
}
#endif

/* Row n of the codes q [N, K] (row stride K) of `kind` (decode8; lut [256]: each code's fp32 value as torch converts
 * it, for the scalar tail), scales s: column k takes sr[k / b1] -> o [K]: bf16 (bf16 != 0) or fp32. Returns how many of
 * the row's outputs are NaN or +-Inf (what the loader's check of the weight would count: it need not read it again). */
static int64_t decode_row(int64_t K, const uint8_t* qr, int kind, const float* lut, const float* sr, int64_t b1,
                          int bf16, void* o) {
    int64_t nonfinite = 0;
    for (int64_t k0 = 0; k0 < K; k0 += b1) {
        const int64_t k1 = k0 + b1 < K ? k0 + b1 : K;
        const float sc = sr[k0 / b1];
        const __m256 sv = _mm256_set1_ps(sc);
        int64_t k = k0;
#if defined(__AVX512F__)
        for (; k + 16 <= k1; k += 16) nonfinite += store16(_mm512_mul_ps(decode16(qr + k, kind), _mm512_set1_ps(sc)), bf16, o, k);
#endif
        for (; k + 8 <= k1; k += 8) nonfinite += store8(_mm256_mul_ps(decode8(qr + k, kind), sv), bf16, o, k);
        for (; k < k1; k++) {
            const float v = lut[qr[k]] * sc;
            if (bf16) {
                const uint16_t h = to_bf16(v);
                ((uint16_t*)o)[k] = h;
                nonfinite += (h & 0x7f80) == 0x7f80;
            } else {
                ((float*)o)[k] = v;
                nonfinite += v - v != 0.0f;  /* (false for finite v; true, unordered, for NaN and +-Inf) */
            }
        }
    }
    return nonfinite;
}

/* The codes of inputs k..k+7 (k % 8 == 0) of a row whose `bits`-bit codes (4 or 8) are packed 32 / bits a word, input
 * i in bits (i % per) * bits of the row's word i / per, at w[(i / per) * stride] -> 8 int32 lanes */
static inline __m256i codes8(const uint32_t* w, int64_t stride, int bits, int64_t k) {
    if (bits == 4)
        return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w[k / 8 * stride]),
                                                  _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)), _mm256_set1_epi32(15));
    const __m256i two = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi32((int)w[k / 4 * stride])),
                                                _mm_set1_epi32((int)w[(k / 4 + 1) * stride]), 1);
    return _mm256_and_si256(_mm256_srlv_epi32(two, _mm256_setr_epi32(0, 8, 16, 24, 0, 8, 16, 24)), _mm256_set1_epi32(255));
}

/* Inputs [k0, k1) of one row of 4- or 8-bit codes in words read in place (codes8: a GPTQ release's qweight
 * [K * bits / 32, N], stride N, or a compressed-tensors pack-quantized weight_packed [N, K * bits / 32], stride 1),
 * zero points zr and scales sr per `group` inputs (group % 8 == 0, k0 and k1 multiples of 16 or k1 = K, K % 8 == 0)
 * -> o[k0 .. k1): (q - zero) * scale in fp32, as packed.py's dequantize_codes (GPTQ's, AWQ's and compressed-tensors'
 * decoders alike), stored and counted as decode_row does. */
static int64_t decode_row_words(int64_t k0, int64_t k1, const uint32_t* w, int64_t stride, int bits, const uint8_t* zr,
                                const float* sr, int64_t group, int bf16, void* o) {
    int64_t nonfinite = 0, k = k0;
#if defined(__AVX512F__)
    if (group % 16 == 0) /* 16 inputs a step, one group (the same operations lane for lane) */
        for (; k + 16 <= k1; k += 16) {
            const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(codes8(w, stride, bits, k)),
                                                 codes8(w, stride, bits, k + 8), 1);
            const __m512 v = _mm512_sub_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps((float)zr[k / group]));
            nonfinite += store16(_mm512_mul_ps(v, _mm512_set1_ps(sr[k / group])), bf16, o, k);
        }
#endif
    for (; k < k1; k += 8) {
        const __m256 v = _mm256_sub_ps(_mm256_cvtepi32_ps(codes8(w, stride, bits, k)), _mm256_set1_ps((float)zr[k / group]));
        nonfinite += store8(_mm256_mul_ps(v, _mm256_set1_ps(sr[k / group])), bf16, o, k);
    }
    return nonfinite;
}

/* output 8c + j of an AWQ word's eight: its nibble AWQ_REVERSE[j] (model/packed.py) */
static const int AWQ_REVERSE[8] = {0, 4, 1, 5, 2, 6, 3, 7};

/* The 8 rows of outputs 8c..8c+7 of an AWQ release's qweight [K, N/8] read in place (GEMM packing: word (k, c) holds
 * input k of those outputs, output 8c + j in nibble AWQ_REVERSE[j]): w = their column of words (word k at w[k * C]),
 * zr / sr the first row's zero points and scales (rows ss apart) -> o, rows `ostride` elements apart; each row decoded,
 * stored and counted as decode_row_words (bad[j]). The 8 words of 8 inputs are gathered once for the 8 rows (a gather
 * a row made the decode slower than moving the words to the q4 layout first). */
static void decode_rows_awq(int64_t K, const uint32_t* w, int64_t C, const uint8_t* zr, const float* sr, int64_t ss,
                            int64_t group, int bf16, void* o, int64_t ostride, int64_t* bad) {
    const __m256i low = _mm256_set1_epi32(15);
    const __m256i at = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)C));
    const size_t esize = bf16 ? 2 : 4;
    for (int j = 0; j < 8; j++) bad[j] = 0;
    int64_t k = 0;
#if defined(__AVX512F__)
    if (group % 16 == 0) { /* 16 inputs a step, one group (the same operations lane for lane) */
        const __m512i at16 = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                _mm512_set1_epi32((int)C));
        for (; k < K; k += 16) {
            const __m512i words = _mm512_i32gather_epi32(at16, (const int*)(w + k * C), 4);
            for (int j = 0; j < 8; j++) {
                const __m512i q = _mm512_and_si512(_mm512_srli_epi32(words, 4 * AWQ_REVERSE[j]), _mm512_set1_epi32(15));
                const __m512 v = _mm512_sub_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps((float)zr[j * ss + k / group]));
                bad[j] += store16(_mm512_mul_ps(v, _mm512_set1_ps(sr[j * ss + k / group])), bf16,
                                  (char*)o + (size_t)(j * ostride) * esize, k);
            }
        }
    }
#endif
    for (; k < K; k += 8) {
        const __m256i words = _mm256_i32gather_epi32((const int*)(w + k * C), at, 4);
        for (int j = 0; j < 8; j++) {
            const __m256i q = _mm256_and_si256(_mm256_srli_epi32(words, 4 * AWQ_REVERSE[j]), low);
            const __m256 v = _mm256_sub_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps((float)zr[j * ss + k / group]));
            bad[j] += store8(_mm256_mul_ps(v, _mm256_set1_ps(sr[j * ss + k / group])), bf16,
                             (char*)o + (size_t)(j * ostride) * esize, k);
        }
    }
}

/* How many of the n 16-bit floats at h have every bit of the exponent mask m set (NaN or +-Inf) */
static int64_t count16(const uint16_t* h, int64_t n, uint16_t m) {
    int64_t i = 0, c = 0;
#if defined(__AVX512F__)
    const __m512i vm = _mm512_set1_epi16((short)m);
    for (; i + 32 <= n; i += 32)
        c += __builtin_popcount(_mm512_cmpeq_epi16_mask(_mm512_and_si512(_mm512_loadu_si512(h + i), vm), vm));
#else
    const __m256i vm = _mm256_set1_epi16((short)m);
    for (; i + 16 <= n; i += 16)
        c += __builtin_popcount(_mm256_movemask_epi8(
                 _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_loadu_si256((const __m256i*)(h + i)), vm), vm))) / 2;
#endif
    for (; i < n; i++) c += (h[i] & m) == m;
    return c;
}

/* Row n of scaled_decode's codes (its arguments) -> o; its NaN / Inf count. kind 5: bf16 weights as stored (q [N, K]
 * bf16, copied; s, lut, b0, b1 unused). */
static inline int64_t decode_nth(int64_t n, int64_t N, int64_t K, const uint8_t* q, int kind, const float* lut,
                                 const float* s, const uint8_t* zero, int64_t b0, int64_t b1, int64_t ss, int bf16,
                                 void* o) {
    const uint32_t* w = (const uint32_t*)q;
    if (kind == 5) {
        const uint16_t* r = (const uint16_t*)q + n * K;
        memcpy(o, r, K * 2);
        return count16(r, K, 0x7f80);
    }
    if (kind == 7 || kind == 9) { /* compressed-tensors' words, 4 or 8 bits (GPTQ's: decode_block) */
        const int bits = kind == 7 ? 4 : 8;
        return decode_row_words(0, K, w + n * (K * bits / 32), 1, bits, zero + n * ss, s + n * ss, b1, bf16, o);
    }
    return decode_row(K, q + n * K, kind, lut, s + (n / b0) * ss, b1, bf16, o);
}

/* rows n0..n0+rows-1 of scaled_decode's codes -> o (rows ostride elements apart), their counts into bad: GPTQ's words
 * (kinds 4, 8) KT inputs of every row in turn, AWQ's (kind 6, rows a multiple of 8 from a multiple of 8) 8 rows a
 * call, the others a row at a time */
static void decode_block(int64_t n0, int64_t rows, int64_t N, int64_t K, const uint8_t* q, int kind, const float* lut,
                         const float* s, const uint8_t* zero, int64_t b0, int64_t b1, int64_t ss, int bf16, void* o,
                         int64_t ostride, int64_t* bad) {
    const size_t esize = bf16 ? 2 : 4;
    if (kind == 4 || kind == 8) { /* GPTQ: the rows' words of an input block share cache lines (the rows side by side):
                                    * the rows take KT inputs in turn, so each line is read while it is in L1, not once a
                                    * row from L2 (8-bit words a row at a time: 1.1-1.7 ns a weight against 0.3-0.6) */
        enum { KT = 512 };
        for (int64_t j = 0; j < rows; j++) bad[n0 + j] = 0;
        for (int64_t k0 = 0; k0 < K; k0 += KT)
            for (int64_t j = 0; j < rows; j++) {
                const int64_t n = n0 + j;
                bad[n] += decode_row_words(k0, k0 + KT < K ? k0 + KT : K, (const uint32_t*)q + n, N, kind == 4 ? 4 : 8,
                                           zero + n * ss, s + n * ss, b1, bf16, (char*)o + (size_t)(j * ostride) * esize);
            }
        return;
    }
    for (int64_t j = 0; j < rows; j += kind == 6 ? 8 : 1) {
        const int64_t n = n0 + j;
        void* oj = (char*)o + (size_t)(j * ostride) * esize;
        if (kind == 6) decode_rows_awq(K, (const uint32_t*)q + n / 8, N / 8, zero + n * ss, s + n * ss, ss, b1, bf16, oj, ostride, bad + n);
        else bad[n] = decode_nth(n, N, K, q, kind, lut, s, zero, b0, b1, ss, bf16, oj);
    }
}

/* words src[j * stride + i] for j, i < 8 -> dst[i * dstride + j] */
static inline void move8x8(const uint32_t* src, int64_t stride, uint32_t* dst, int64_t dstride) {
    __m256 r[8];
    for (int j = 0; j < 8; j++) r[j] = _mm256_loadu_ps((const float*)(src + j * stride));
    transpose_words8(r);
    for (int i = 0; i < 8; i++) _mm256_storeu_ps((float*)(dst + i * dstride), r[i]);
}

/* codes q [N, K] (kinds 1-3: decode8's 8-bit codes; 4, 6 and 7: int4 codes as a release stores them, GPTQ's qweight
 * [K/8, N], AWQ's [K, N/8], compressed-tensors' weight_packed [N, K/8] (N % 8 == 0); 8 and 9: GPTQ's and
 * compressed-tensors' 8-bit words, 4 codes a word, [K/4, N] / [N, K/4]; with zero points zero [N, K/b1] beside the
 * scales, b0 = 1; kind 5: bf16 weights, copied, bf16 = 1), scales s (row n, column k takes s[(n / b0) * ss + k / b1])
 * -> out: group 0, [N, K] bf16 (bf16 != 0) or fp32; group 8 / 16, bf16 in qmatmul.py's pack_bf16 layout of that output
 * group ([ceil(N/8)][ceil(K/2)][8][2], or the AMX tiles' [ceil(N/16)][ceil(K/32)][16][16][2], pads zero): a group's rows are decoded to a scratch block (rows
 * past N and inputs past K zero), whose input pairs then move as 4-byte words, 8 x 8 transposes of them. bad [N]: each
 * row's NaN / Inf count. Returns 0, or -1 where a scratch block could not be allocated (nothing is then complete). */
int scaled_decode(int64_t N, int64_t K, const uint8_t* q, int kind, const float* lut, const float* s, int64_t b0,
                   int64_t b1, int64_t ss, int bf16, void* out, int64_t* bad, int group, int nthreads,
                   const uint8_t* zero) {
    if (group == 0) {
        PARALLEL_FOR(N * K >= (1 << 20), b, (N + 7) / 8, {
            void* o = (char*)out + (size_t)(b * 8 * K) * (bf16 ? 2 : 4);
            decode_block(b * 8, N - b * 8 < 8 ? N - b * 8 : 8, N, K, q, kind, lut, s, zero, b0, b1, ss, bf16, o, K, bad);
        });
        return 0;
    }
    /* input pairs a packed row holds (whole tiles in the AMX layout), and the scratch's row stride in words (whole
     * 8-word chunks: the transposes' tails read zeros) */
    const int64_t pairs = group == 16 ? (K + 31) / 32 * 16 : (K + 1) / 2;
    const int64_t stride = (pairs + 7) / 8 * 8;
    const int64_t blocks = (N + group - 1) / group;
    int failed = 0;
    PARALLEL_FOR(N * K >= (1 << 20), b, blocks, {
        uint32_t* scr = (uint32_t*)calloc(group * stride, 4);
        if (!scr) {
            failed = 1;
            continue;
        }
        uint32_t* o = (uint32_t*)out + b * group * pairs;
        decode_block(b * group, N - b * group < group ? N - b * group : group, N, K, q, kind, lut, s, zero, b0, b1, ss,
                     1, scr, 2 * stride, bad);
        if (group == 16) {  /* tile c, its row p (pair c * 16 + p), column j: o[c * 256 + p * 16 + j] */
            for (int64_t c = 0; c < pairs / 16; c++)
                for (int pb = 0; pb < 2; pb++)
                    for (int jb = 0; jb < 2; jb++)
                        move8x8(scr + jb * 8 * stride + c * 16 + pb * 8, stride, o + c * 256 + pb * 8 * 16 + jb * 8, 16);
        } else {  /* pair p of output j: o[p * 8 + j] */
            int64_t p = 0;
            for (; p + 8 <= pairs; p += 8) move8x8(scr + p, stride, o + p * 8, 8);
            for (; p < pairs; p++)
                for (int j = 0; j < 8; j++) o[p * 8 + j] = scr[j * stride + p];
        }
        free(scr);
    });
    return failed ? -1 : 0;
}

/* 4-bit words of 8 inputs (input 8r+i of output n in nibble i of word (r, n), at w[r * rs + n * ns]: GPTQ's qweight
 * [R][N], rs = N, ns = 1; compressed-tensors' pack-quantized weight_packed [N][R], rs = 1, ns = R) -> the q4 kernel's
 * codes (qmatmul.py's pack_int4) as words out [ceil(N/8)][R][8]: word (g, r, j) holds output 8g+j's inputs 8r..8r+7
 * as bytes i = q[8r+i] | q[8r+4+i] << 4, a permutation of the stored word's nibbles (0,4,1,5,2,6,3,7 from 0..7);
 * outputs past N are zero codes. */
static inline uint32_t q4_word(uint32_t w) {
    return (w & 0xF000000Fu) | ((w << 4) & 0x00000F00u) | ((w << 8) & 0x000F0000u) | ((w << 12) & 0x0F000000u) |
           ((w >> 12) & 0x000000F0u) | ((w >> 8) & 0x0000F000u) | ((w >> 4) & 0x00F00000u);
}

/* q4_word on 8 words */
static inline __m256i q4_words8(__m256i x) {
#define Q4_TERM(op, s, m) _mm256_and_si256(op(x, s), _mm256_set1_epi32((int)(m)))
    return _mm256_or_si256(
        _mm256_or_si256(_mm256_or_si256(_mm256_and_si256(x, _mm256_set1_epi32((int)0xF000000Fu)),
                                        Q4_TERM(_mm256_slli_epi32, 4, 0x00000F00u)),
                        _mm256_or_si256(Q4_TERM(_mm256_slli_epi32, 8, 0x000F0000u), Q4_TERM(_mm256_slli_epi32, 12, 0x0F000000u))),
        _mm256_or_si256(_mm256_or_si256(Q4_TERM(_mm256_srli_epi32, 12, 0x000000F0u), Q4_TERM(_mm256_srli_epi32, 8, 0x0000F000u)),
                        Q4_TERM(_mm256_srli_epi32, 4, 0x00F00000u)));
#undef Q4_TERM
}

void int4_words_pack(int64_t R, int64_t N, const uint32_t* w, int64_t rs, int64_t ns, uint32_t* out, int nthreads) {
    const int64_t groups = (N + 7) / 8;
    PARALLEL_FOR(R * N >= (1 << 18), g, groups, {
        uint32_t* o = out + g * R * 8;
        const int64_t n0 = g * 8, n = N - n0 < 8 ? N - n0 : 8;
        int64_t r = 0;
        if (n == 8 && ns == 1) /* the group's 8 words of input block r side by side */
            for (; r < R; r++)
                _mm256_storeu_si256((__m256i*)(o + r * 8), q4_words8(_mm256_loadu_si256((const __m256i*)(w + r * rs + n0))));
        else if (n == 8 && rs == 1) /* each output's words side by side: 8 blocks at a time, an 8 x 8 transpose */
            for (; r + 8 <= R; r += 8) {
                __m256 t[8];
                for (int j = 0; j < 8; j++) t[j] = _mm256_loadu_ps((const float*)(w + (n0 + j) * ns + r));
                transpose_words8(t); /* t[i]: block r + i's 8 outputs */
                for (int i = 0; i < 8; i++)
                    _mm256_storeu_si256((__m256i*)(o + (r + i) * 8), q4_words8(_mm256_castps_si256(t[i])));
            }
        for (; r < R; r++)
            for (int64_t j = 0; j < 8; j++) o[r * 8 + j] = j < n ? q4_word(w[r * rs + (n0 + j) * ns]) : 0;
    });
}

/* AWQ's 4-bit words qweight [K][C] (GEMM packing, C = N/8: word (k, c) holds input k of outputs 8c..8c+7, output 8c+j
 * in nibble AWQ_REVERSE[j], model/packed.py) -> the q4 kernel's codes as int4_words_pack writes them, out [C][K/8][8]
 * (K % 8 == 0): output group c is one column of words, and its word (r, j) gathers nibble AWQ_REVERSE[j] of the 8
 * words of inputs 8r..8r+7 (input 8r+i to bits 8i, 8r+4+i to bits 8i+4): an 8 x 8 transpose of nibbles, done on 8
 * columns at once and then moved to their groups by an 8 x 8 transpose of words. */
static inline uint32_t awq_word(const uint32_t* src, int64_t C, int j) {
    uint32_t o = 0;
    for (int k = 0; k < 8; k++) o |= ((src[k * C] >> (4 * AWQ_REVERSE[j])) & 15u) << (8 * (k & 3) + 4 * (k >> 2));
    return o;
}

void awq_int4_pack(int64_t K, int64_t C, const uint32_t* w, uint32_t* out, int nthreads) {
    const int64_t R = K / 8, C8 = C - C % 8;
    PARALLEL_FOR(K * C >= (1 << 15), r, R, {
        const uint32_t* src = w + r * 8 * C;
        for (int64_t c = 0; c < C8; c += 8) {
            __m256i a[8];
            __m256 o[8];
            for (int k = 0; k < 8; k++) a[k] = _mm256_loadu_si256((const __m256i*)(src + k * C + c));
            for (int j = 0; j < 8; j++) {
                __m256i x = _mm256_setzero_si256();
                for (int k = 0; k < 8; k++)
                    x = _mm256_or_si256(x, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(a[k], 4 * AWQ_REVERSE[j]),
                                                                              _mm256_set1_epi32(15)),
                                                             8 * (k & 3) + 4 * (k >> 2)));
                o[j] = _mm256_castsi256_ps(x);
            }
            transpose_words8(o);  /* o[t]: column c + t's 8 words */
            for (int t = 0; t < 8; t++) _mm256_storeu_ps((float*)(out + ((c + t) * R + r) * 8), o[t]);
        }
        for (int64_t c = C8; c < C; c++)
            for (int j = 0; j < 8; j++) out[(c * R + r) * 8 + j] = awq_word(src + c, C, j);
    });
}

/* How many of the n floats at p are NaN or +-Inf (every bit of the exponent set): width 2 with emask 0x7f80 (bf16) or
 * 0x7c00 (fp16), width 4 with 0x7f800000 (fp32). The loader's check of a weight it keeps as stored (checkpoint.py's
 * non_finite), one pass at memory speed: torch's aminmax, which widened each bf16 to fp32 first, took twice as long
 * (docs/decisions.md, 2026-12-07 fourteenth session). Blocks of 2^16 elements are split over the threads. */
int64_t count_nonfinite(const void* p, int64_t n, int width, uint32_t emask, int nthreads) {
    const int64_t BLOCK = 1 << 16, blocks = (n + BLOCK - 1) / BLOCK;
    int64_t total = 0;
#pragma omp parallel for num_threads(nthreads) schedule(static) reduction(+ : total) if (nthreads > 1 && n >= (1 << 22))
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t i0 = b * BLOCK, i1 = i0 + BLOCK < n ? i0 + BLOCK : n;
        if (width == 2) {
            total += count16((const uint16_t*)p + i0, i1 - i0, (uint16_t)emask);
            continue;
        }
        const uint32_t* w = (const uint32_t*)p;
        int64_t i = i0, c = 0;
#if defined(__AVX512F__)
        const __m512i vm = _mm512_set1_epi32((int)emask);
        for (; i + 16 <= i1; i += 16)
            c += __builtin_popcount(_mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_loadu_si512(w + i), vm), vm));
#else
        const __m256i vm = _mm256_set1_epi32((int)emask);
        for (; i + 8 <= i1; i += 8)
            c += __builtin_popcount(_mm256_movemask_ps(_mm256_castsi256_ps(
                     _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_loadu_si256((const __m256i*)(w + i)), vm), vm))));
#endif
        for (; i < i1; i++) c += (w[i] & emask) == emask;
        total += c;
    }
    return total;
}
