/* The two elementwise gates of a decode step for CPU inference, built and loaded by native.py and called by act.py:
 * SwiGLU's `silu(gate) * up` (layer.py, `MLP`) and the gated attention's `out * sigmoid(gate)` (attention.py), in
 * bf16 with the eager forms' roundings (the activation rounded to bf16, then the product). One call instead of
 * three tensor operations each, and one exp for the eager step and for the one-call decode forward (step.c), so the
 * two give the same bits.
 *
 * Row-invariant by construction: every element goes through the same lane code (`exp8`, native.h; 16 lanes with
 * `exp16`, the same operations, in the AVX-512 build: the same bits), the tail of a row padded into a vector, whatever
 * the number of rows and however the threads split them. Built with -ffp-contract=off. */

#include <stdint.h>
#include <string.h>

#include "native.h"

/* 8 values of a bf16 row starting at p (n <= 8 of them; the rest zeros) as floats */
static inline __m256 load8(const uint16_t* p, int64_t n) {
    if (n == 8) return bf16x8_to_f(p);
    uint16_t h[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    memcpy(h, p, sizeof(uint16_t) * (size_t)n);
    return bf16x8_to_f(h);
}

static inline void store8(uint16_t* p, __m256 v, int64_t n) {
    if (n == 8) {
        f_to_bf16x8(p, v);
        return;
    }
    uint16_t h[8];
    f_to_bf16x8(h, v);
    memcpy(p, h, sizeof(uint16_t) * (size_t)n);
}

static inline __m256 sigmoid8(__m256 v) {
    const __m256 one = _mm256_set1_ps(1.0f);
    return _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), v))));
}

#if defined(__AVX512F__)
#define ACT_LANES 16
/* up to n = 16 elements of a row: the SwiGLU and attention gates, the 8-lane code below on 16 lanes */
static inline void silu_mul16(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t n) {
    const __m512 s = round_bf16x16(silu16(bf16x16_to_f(gate, n)));
    f_to_bf16x16(out, _mm512_mul_ps(s, bf16x16_to_f(up, n)), lanes16(n));
}
static inline void sigmoid_mul16(const uint16_t* x, const uint16_t* gate, uint16_t* out, int64_t n) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 s = round_bf16x16(_mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(),
                                                                                          bf16x16_to_f(gate, n))))));
    f_to_bf16x16(out, _mm512_mul_ps(bf16x16_to_f(x, n), s), lanes16(n));
}
#define SILU_MUL(g, u, o, n) silu_mul16(g, u, o, n)
#define SIGMOID_MUL(x, g, o, n) sigmoid_mul16(x, g, o, n)
#else
#define ACT_LANES 8
#define SILU_MUL(g, u, o, n) silu_mul8(g, u, o, n)
#define SIGMOID_MUL(x, g, o, n) sigmoid_mul8(x, g, o, n)
#endif

static inline void silu_mul8(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t n) {
    const __m256 s = round_bf16x8(silu8(load8(gate, n)));
    store8(out, _mm256_mul_ps(s, load8(up, n)), n);
}

static inline void sigmoid_mul8(const uint16_t* x, const uint16_t* gate, uint16_t* out, int64_t n) {
    const __m256 s = round_bf16x8(sigmoid8(load8(gate, n)));
    store8(out, _mm256_mul_ps(load8(x, n), s), n);
}

/* gate, up bf16 [rows, N] at row strides sg, su -> out bf16 [rows, N] contiguous:
 * out = round(round(silu(gate)) * up), silu(g) = g / (1 + exp(-g)). */
void silu_mul(int64_t rows, int64_t N, const uint16_t* gate, int64_t sg, const uint16_t* up, int64_t su, uint16_t* out,
              int nthreads) {
    PARALLEL_FOR(rows * N >= 65536, r, rows, {
        for (int64_t i = 0; i < N; i += ACT_LANES)
            SILU_MUL(gate + r * sg + i, up + r * su + i, out + r * N + i, N - i < ACT_LANES ? N - i : ACT_LANES);
    });
}

/* x, gate bf16 [rows, N] at row strides sx, sg -> out bf16 [rows, N] contiguous: out = round(x * round(sigmoid(gate))). */
void sigmoid_mul(int64_t rows, int64_t N, const uint16_t* x, int64_t sx, const uint16_t* gate, int64_t sg,
                 uint16_t* out, int nthreads) {
    PARALLEL_FOR(rows * N >= 65536, r, rows, {
        for (int64_t i = 0; i < N; i += ACT_LANES)
            SIGMOID_MUL(x + r * sx + i, gate + r * sg + i, out + r * N + i, N - i < ACT_LANES ? N - i : ACT_LANES);
    });
}
