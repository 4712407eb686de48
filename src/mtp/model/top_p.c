/* The top-p (nucleus) cut of sampling on the CPU, built and loaded by native.py: decode/sampling.py's `shape_logits`
 * calls it (top_p_kernel.py) for its rows, and step.c's one-call round calls the same machine code through its kernel
 * table, so a round shaped by top-p gives the same bits either way (tests/test_round_kernel.py).
 *
 * The rule is sampling.py's: over a row's tokens in descending order of their (shaped) logits, a token is cut when the
 * probability mass before it reaches p (the first token always stays). Here the order among equal logits is the
 * lower token id first, the masses are exp(x - max) (native.h's exp8) summed in double, and "reaches p" is mass
 * before >= p x total: one fixed computation, which torch's softmax and cumulative sum round differently (a cut may
 * fall apart only where the mass before a token is within rounding of p). Only the tokens that can be kept are
 * ordered: those whose mass alone exceeds a threshold, lowered until they hold p of the total. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "native.h"

/* token a comes before token b: a larger logit, or the same and a lower id */
static inline int before(const float* x, int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); }

static void sift_down(const float* x, int32_t* h, int64_t n, int64_t i) {
    const int32_t v = h[i];
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && before(x, h[c + 1], h[c])) c++;
        if (!before(x, h[c], v)) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = v;
}

/* the tokens with a finite logit and mass e in (lo, hi] into a heap h (the first in order at its root) -> their count */
static int64_t heap_of(const float* x, const float* e, int64_t N, float lo, float hi, int32_t* h) {
    int64_t n = 0;
    for (int64_t i = 0; i < N; i++)
        if (e[i] > lo && e[i] <= hi && x[i] != -INFINITY) h[n++] = (int32_t)i;
    for (int64_t i = n / 2 - 1; i >= 0; i--) sift_down(x, h, n, i);
    return n;
}

/* One row x [N] (fp32 logits after temperature and top-k, -inf where already cut) -> -inf on every token cut by top-p
 * p in (0, 1] (p >= 1, or a row with no finite logit: nothing cut). e, h: scratch [N]. */
static void top_p_row(float* x, int64_t N, float p, float* e, int32_t* h) {
    if (!(p < 1.0f)) return;
    float m = -INFINITY;
    for (int64_t i = 0; i < N; i++) m = x[i] > m ? x[i] : m;
    if (m == -INFINITY) return;
    const __m256 vm = _mm256_set1_ps(m), ninf = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= N; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        _mm256_storeu_ps(e + i, _mm256_andnot_ps(_mm256_cmp_ps(v, ninf, _CMP_EQ_OQ), exp8(_mm256_sub_ps(v, vm))));
    }
    for (; i < N; i++) e[i] = x[i] == -INFINITY ? 0.0f : expf(x[i] - m);
    double total = 0.0;
    for (i = 0; i < N; i++) total += e[i];
    const double limit = (double)p * total;
    /* the candidates: mass above a threshold that leaves p of the total above it (every token below it has at least
     * that mass before it: cut); lowered 2^-12 at a time, down to every token (a finite logit's mass may be 0) */
    float lo = 1.0f;
    do {
        lo = lo > 0x1p-120f ? lo * 0x1p-12f : -1.0f;
        double above = 0.0;
        for (i = 0; i < N; i++) above += e[i] > lo ? e[i] : 0.0f;
        if (above >= limit) break;
    } while (lo >= 0.0f);
    float hi = INFINITY;
    int64_t n = heap_of(x, e, N, lo, hi, h);
    double mass = 0.0;
    int32_t last = -1; /* the last token kept */
    while (mass < limit) {
        if (n == 0) { /* (rounding: the candidates' mass fell short of the limit) the rest, below them */
            if (lo < 0.0f) break;
            hi = lo;
            lo = -1.0f;
            if ((n = heap_of(x, e, N, lo, hi, h)) == 0) break;
        }
        last = h[0];
        mass += e[last];
        h[0] = h[--n];
        sift_down(x, h, n, 0);
    }
    for (i = 0; i < N; i++)
        if (x[i] != -INFINITY && last >= 0 && before(x, last, (int32_t)i)) x[i] = -INFINITY;
}

/* rows x [R, N] at row stride sx (floats), top-p p [R] -> x with -inf where cut, in place. 0, or -1 (memory). One
 * thread: a round cuts a few rows (its verify positions). */
int top_p_rows(int64_t R, int64_t N, float* x, int64_t sx, const float* p) {
    float* e = malloc(sizeof(float) * (size_t)N);
    int32_t* h = malloc(sizeof(int32_t) * (size_t)N);
    if (e && h)
        for (int64_t r = 0; r < R; r++) top_p_row(x + r * sx, N, p[r], e, h);
    const int failed = !e || !h;
    free(e);
    free(h);
    return failed ? -1 : 0;
}
