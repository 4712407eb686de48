/* The decode forward of a Qwen3.5 dense backbone (Gated DeltaNet and gated-attention layers, SwiGLU MLPs, int8, int4
 * or bf16 linears on qmatmul.c) as one C call, and the draft chain of its MTP as another (`qwen35_draft`), built and
 * loaded by native.py and called by step.py. A plain step of the shipped model
 * made ~400 tensor operations, ~80 module calls and ~45 ctypes calls for ~1 ms of arithmetic; here the layers run
 * back to back without returning to Python.
 *
 * It computes what the eager forward computes, bit for bit: every piece is either one of the eager path's own C
 * kernels, called through the function pointers step.py passes (`Kernels`: the same machine code the eager step
 * runs), or an exact operation (a copy, an index, a bf16 sum or product rounded once, as torch rounds one). So greedy
 * decoding through it is the eager decoding, and row invariance carries over from the kernels. A prompt's chunk
 * (`Step.prompt`, step.py `prefill`) runs the same program with prompt kernels: attention by attend_prompt (the
 * layers' prompt reads use SDPA: either way other bits than decoding's, the same for every path that reads the
 * prompt) and int8/int4 products on the bf16 tiles, as the layers' are. Built with -ffp-contract=off. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

typedef struct { /* the eager kernels (their own files say what each computes) */
    int (*q8_linear)(const uint16_t*, int64_t, int64_t, const int8_t*, const float*, const float*, int64_t, uint16_t*,
                     int);
    int (*q4_linear)(const uint16_t*, int64_t, int64_t, const uint8_t*, const float*, const float*, int64_t,
                     const float*, int64_t, uint16_t*, int);
    void (*rmsnorm)(int64_t, int64_t, const void*, int64_t, const void*, int, float, int, void*, int);
    int (*deltanet_decode)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, const void*,
                           const void*, const void*, int64_t, int64_t, const void*, int64_t, int64_t, const float*,
                           const float*, const void*, int64_t, int64_t, const void*, float, const float*, float*,
                           void*, int);
    int (*attend_decode)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, const void*, int64_t,
                         int64_t, int64_t, const void*, const void*, const int64_t*, float, void*, int);
    void (*silu_mul)(int64_t, int64_t, const uint16_t*, int64_t, const uint16_t*, int64_t, uint16_t*, int);
    void (*sigmoid_mul)(int64_t, int64_t, const uint16_t*, int64_t, const uint16_t*, int64_t, uint16_t*, int);
    int (*bf16_linear)(const uint16_t*, int64_t, int64_t, const uint16_t*, const float*, int64_t, uint16_t*, int);
    void (*argmax_rows)(int64_t, int64_t, const void*, int64_t, int, int64_t*, int);
    int (*top_p_rows)(int64_t, int64_t, float*, int64_t, const float*);
    /* a prompt's int8 / int4 products on the bf16 tiles (qmatmul.c `q8_linear_wide`; NULL where the build has none) */
    int (*q8_linear_wide)(const uint16_t*, int64_t, int64_t, const int8_t*, const float*, const float*, int64_t,
                          uint16_t*, int);
    int (*q4_linear_wide)(const uint16_t*, int64_t, int64_t, const uint8_t*, const float*, const float*, int64_t,
                          const float*, int64_t, uint16_t*, int);
    int (*attend_prompt)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, const void*, int64_t,
                         int64_t, int64_t, const void*, const void*, const int64_t*, float, void*, int);
    /* the tile products fused with what follows them (qmatmul.c `bf16_linear_fused`, native.h Fuse; NULL where the
     * build has none) */
    int (*bf16_linear_fused)(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, uint16_t*, const Fuse*, int);
    int (*q8_linear_wide_fused)(const uint16_t*, int64_t, int64_t, const int8_t*, const float*, int64_t, uint16_t*,
                                const Fuse*, int);
    int (*q4_linear_wide_fused)(const uint16_t*, int64_t, int64_t, const uint8_t*, const float*, const float*, int64_t,
                                int64_t, uint16_t*, const Fuse*, int);
} Kernels;

typedef struct { /* a prepared linear layer without bias (linear.FastLinear on qmatmul.c): bf16 [M, K] -> [M, N] */
    int64_t bits, N, K, G; /* bits 8: w int8 [N, K], scale [N]; 4: w packed [N, K/2], scale and low [N, K/G];
                              16: w bf16 in pack_bf16's layout ("bf16-native") */
    const void* w;
    const float* scale;
    const float* low;
} Linear;

typedef struct {
    int64_t kind; /* 0: Gated DeltaNet (`linear_attn`), 1: gated attention (`self_attn`) */
    const uint16_t *norm1, *norm2; /* input_layernorm, post_attention_layernorm (zero-centred) */
    Linear in[4];                  /* the mixer's input projections: one fused layer, or n_in parts side by side */
    int64_t n_in, Nin;             /* how many; the width of their outputs y (a fused layer's: with its group pads) */
    int64_t off[4];                /* where each projection's outputs start in a row of y */
    Linear out, gate_up, down;     /* the mixer's output projection; the MLP's (gate and up fused) */
    int64_t I, up;                 /* the MLP's width; where up's outputs start in gate_up's */
    int64_t Hk, Hv, Kd, Vd, kernel; /* DeltaNet: heads and their widths, the conv's taps; attention: Hk, Hv = heads */
    const uint16_t* taps;           /* DeltaNet [C, kernel] */
    const float *A_log, *dt_bias;   /* DeltaNet [Hv] fp32 */
    const uint16_t* gnorm;          /* DeltaNet's gated norm [Vd]; attention: q_norm [Kd] */
    const uint16_t* knorm;          /* attention: k_norm [Kd] */
    float geps, scale;              /* the gated norm's eps (attention: the q/k norms'); attention's softmax scale */
    uint16_t* conv;                 /* DeltaNet cache: conv inputs [B, C, kernel-1]; attention: keys [B, Hk, S, Kd] */
    float* ssm;                     /* DeltaNet cache: state [B, Hv, Kd, Vd] */
    uint16_t* values;               /* attention: values [B, Hk, S, Vd] */
    uint16_t* window;               /* DeltaNet out: [B, C, kernel-1+T] */
    float* updates;                 /* DeltaNet out: [B, Hv, T, Kd + Vd + 1], each token's update of the state; NULL: a
                                     * kept step, the cache updated in place */
} Layer;

typedef struct {
    int64_t B, T, H, V, S, R; /* rows, tokens per row, hidden width, vocabulary, cache slots, rotary dims */
    float eps;                /* the layer norms' */
    const int64_t* ids;       /* [B, T], or NULL: */
    const uint16_t* x;        /* the layers' input [B, T, H] (the MTP's: its input projection's output) */
    const int64_t* index;     /* [B, T]: each token's position */
    const int64_t* starts;    /* [B]: each row's first position */
    const uint16_t *embed, *cos, *sin, *norm; /* [V, H]; [B*T, R] each; the final norm [H] */
    uint16_t* out;            /* [B, T, H]: the hidden state after the final norm */
    int64_t prompt;           /* 0, or a prompt's chunk within linear.py's `prompt_products` (step.py `prefill`):
                                 attention by attend_prompt, and the int8/int4 products of this many rows or more on
                                 the bf16 tiles (other bits than the decode kernels', as the layers' prompt reads) */
} Step;

/* wide_min: Step's `prompt` (0 for every product a decode step or a verify makes) */
static int linear(const Kernels* k, const Linear* l, const uint16_t* x, int64_t M, uint16_t* y, int64_t wide_min,
                  int nth) {
    const int wide = wide_min > 0 && M >= wide_min && k->q8_linear_wide && k->q4_linear_wide;
    if (l->bits == 16) return k->bf16_linear(x, M, l->K, l->w, NULL, l->N, y, nth);
    if (l->bits == 4)
        return (wide ? k->q4_linear_wide : k->q4_linear)(x, M, l->K, l->w, l->scale, l->low, l->G, NULL, l->N, y, nth);
    return (wide ? k->q8_linear_wide : k->q8_linear)(x, M, l->K, l->w, l->scale, NULL, l->N, y, nth);
}

static inline uint16_t add_bf16(uint16_t a, uint16_t b) { return to_bf16(bf16_to_f(a) + bf16_to_f(b)); }

static inline uint16_t mul_bf16(uint16_t a, uint16_t b) { return to_bf16(bf16_to_f(a) * bf16_to_f(b)); }

/* the residual x[j] := x[j] + h[j] for n values, each sum add_bf16's (exact widening, one fp32 add, to_bf16's
 * rounding), 8 at a time (a prompt's chunk adds 256 rows a layer twice) */
static void add_rows(uint16_t* x, const uint16_t* h, int64_t n) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) f_to_bf16x8(x + j, _mm256_add_ps(bf16x8_to_f(x + j), bf16x8_to_f(h + j)));
    for (; j < n; j++) x[j] = add_bf16(x[j], h[j]);
}

/* l's product of x [M, K] and what follows it (native.h Fuse, f->kind): FUSE_SWIGLU y [M, f->I] := silu_mul of its
 * gate and up, FUSE_ADD y [M, N] += its outputs. In one pass where l's kernel fuses them (the tile products: a bf16
 * layer, or a prompt's wide int8/int4 one), else the product into tmp [M, N] and then the step: the same bits. */
static int linear_fused(const Kernels* k, const Linear* l, const uint16_t* x, int64_t M, uint16_t* y, uint16_t* tmp,
                        const Fuse* f, int64_t wide_min, int nth) {
    const int wide = wide_min > 0 && M >= wide_min;
    int status = -2;
    if (l->bits == 16 && k->bf16_linear_fused) status = k->bf16_linear_fused(x, M, l->K, l->w, l->N, y, f, nth);
    else if (l->bits == 8 && wide && k->q8_linear_wide_fused)
        status = k->q8_linear_wide_fused(x, M, l->K, l->w, l->scale, l->N, y, f, nth);
    else if (l->bits == 4 && wide && k->q4_linear_wide_fused)
        status = k->q4_linear_wide_fused(x, M, l->K, l->w, l->scale, l->low, l->G, l->N, y, f, nth);
    if (status != -2) return status;
    if (linear(k, l, x, M, tmp, wide_min, nth)) return -1;
    if (f->kind == FUSE_SWIGLU) k->silu_mul(M, f->I, tmp, l->N, tmp + f->up, l->N, y, nth);
    else add_rows(y, tmp, M * l->N);
    return 0;
}

/* the mixer's input projections of h [M, K] -> y [M, Nin] (the parts' outputs side by side, as one fused layer
 * gives them: every output is its own row's dot product, so fused or not it has the same bits); tmp [M, widest] */
static int project(const Kernels* k, const Layer* l, const uint16_t* h, int64_t M, uint16_t* y, uint16_t* tmp,
                   int64_t wide_min, int nth) {
    if (l->n_in == 1) return linear(k, &l->in[0], h, M, y, wide_min, nth);
    for (int64_t j = 0; j < l->n_in; j++) {
        const int64_t N = l->in[j].N;
        if (linear(k, &l->in[j], h, M, tmp, wide_min, nth)) return -1;
        for (int64_t m = 0; m < M; m++) memcpy(y + m * l->Nin + l->off[j], tmp + m * N, sizeof(uint16_t) * (size_t)N);
    }
    return 0;
}

/* rotate-half RoPE on the first R dims of x [D] (rope.apply_rope in bf16): x1*c - x2*s | x2*c + x1*s, each product
 * and the sum rounded as torch rounds them */
static void rope(uint16_t* x, int64_t R, const uint16_t* c, const uint16_t* s) {
    const int64_t h = R / 2;
    for (int64_t i = 0; i < h; i++) {
        const uint16_t x1 = x[i], x2 = x[i + h];
        const uint16_t nx2 = x2 ^ 0x8000; /* -x2: exact */
        x[i] = add_bf16(mul_bf16(x1, c[i]), mul_bf16(nx2, s[i]));
        x[i + h] = add_bf16(mul_bf16(x2, c[i + h]), mul_bf16(x1, s[i + h]));
    }
}

/* an 8 x 8 block of bf16, rows at stride ss (elements) -> its transpose, rows at stride ds (data movement only) */
static inline void transpose_bf16x8(const uint16_t* src, int64_t ss, uint16_t* dst, int64_t ds) {
    __m128i a[8], b[8], c[8];
    for (int i = 0; i < 8; i++) a[i] = _mm_loadu_si128((const __m128i*)(src + i * ss));
    for (int i = 0; i < 4; i++) { /* pairs of rows interleaved: columns 0-3, 4-7 */
        b[i] = _mm_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
        b[i + 4] = _mm_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
    }
    for (int h = 0; h < 8; h += 4) /* quads of rows: two columns each */
        for (int i = 0; i < 2; i++) {
            c[h + 2 * i] = _mm_unpacklo_epi32(b[h + 2 * i], b[h + 2 * i + 1]);
            c[h + 2 * i + 1] = _mm_unpackhi_epi32(b[h + 2 * i], b[h + 2 * i + 1]);
        }
    for (int i = 0; i < 4; i++) { /* rows 0-3 beside rows 4-7 */
        const int j = (i / 2) * 4 + i % 2; /* c[j]: rows 0-3's columns 2i, 2i+1 (as c[j + 2]: rows 4-7's) */
        _mm_storeu_si128((__m128i*)(dst + (2 * i) * ds), _mm_unpacklo_epi64(c[j], c[j + 2]));
        _mm_storeu_si128((__m128i*)(dst + (2 * i + 1) * ds), _mm_unpackhi_epi64(c[j], c[j + 2]));
    }
}

/* n bf16 values src -> dst: a channel's conv inputs (n = 3 for Qwen3.5's kernel of 4: an inline copy, where a memcpy
 * call per channel and row was ~4% of an 8-row decode step) */
static inline void copy_bf16(uint16_t* dst, const uint16_t* src, int64_t n) {
    if (n == 3) memcpy(dst, src, 6);
    else memcpy(dst, src, sizeof(uint16_t) * (size_t)n);
}

/* One row's window for a step of one token with Qwen3.5's conv of 4 taps: win [C][4] := its conv inputs conv [C][3],
 * then the token's qkv [C], two channels a shuffle (a copy of 6 bytes and one of 2 per channel and row were ~4% of an
 * 8-row decode step) */
static void window_step(uint16_t* win, const uint16_t* conv, const uint16_t* qkv, int64_t C) {
    const __m128i from_conv = _mm_setr_epi8(0, 1, 2, 3, 4, 5, -1, -1, 6, 7, 8, 9, 10, 11, -1, -1);
    const __m128i from_qkv = _mm_setr_epi8(-1, -1, -1, -1, -1, -1, 0, 1, -1, -1, -1, -1, -1, -1, 2, 3);
    int64_t c = 0;
    for (; c + 3 <= C; c += 2) { /* (16 bytes read from channel c's: c + 2 must be there) */
        int32_t pair;
        memcpy(&pair, qkv + c, sizeof pair);
        const __m128i a = _mm_loadu_si128((const __m128i*)(conv + 3 * c)), b = _mm_cvtsi32_si128(pair);
        _mm_storeu_si128((__m128i*)(win + 4 * c),
                         _mm_or_si128(_mm_shuffle_epi8(a, from_conv), _mm_shuffle_epi8(b, from_qkv)));
    }
    for (; c < C; c++) {
        copy_bf16(win + 4 * c, conv + 3 * c, 3);
        win[4 * c + 3] = qkv[c];
    }
}

/* ... and after it, the row's conv inputs conv [C][3] := each channel's last 3 of win [C][4] */
static void window_keep(uint16_t* conv, const uint16_t* win, int64_t C) {
    const __m128i last3 = _mm_setr_epi8(2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 14, 15, -1, -1, -1, -1);
    int64_t c = 0;
    for (; c + 2 <= C; c += 2) {
        const __m128i v = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i*)(win + 4 * c)), last3);
        const int32_t tail = _mm_extract_epi32(v, 2);
        _mm_storel_epi64((__m128i*)(conv + 3 * c), v);
        memcpy(conv + 3 * c + 4, &tail, sizeof tail);
    }
    for (; c < C; c++) copy_bf16(conv + 3 * c, win + 4 * c + 1, 3);
}

static int deltanet(const Kernels* k, const Step* s, const Layer* l, const uint16_t* h, uint16_t* y, uint16_t* o,
                    int nth) {
    const int64_t B = s->B, T = s->T, M = B * T, kw = l->kernel - 1, W = kw + T;
    const int64_t C = 2 * l->Hk * l->Kd + l->Hv * l->Vd, Nin = l->Nin;
    if (project(k, l, h, M, y, o, s->prompt, nth)) return -1;
    const int step3 = T == 1 && kw == 3; /* one token, 4 taps (window_step, window_keep); else the general copies */
    for (int64_t b = 0; b < B && step3; b++) window_step(l->window + b * C * W, l->conv + b * C * kw, y + b * Nin, C);
    for (int64_t b = 0; b < B && !step3; b++) { /* window = cat(conv, qkv^T) */
        for (int64_t c = 0; c < C; c++) copy_bf16(l->window + (b * C + c) * W, l->conv + (b * C + c) * kw, kw);
        int64_t t0 = 0;
        for (; t0 + 8 <= T; t0 += 8) { /* a prompt's chunk: 8 x 8 blocks (element by element it was ~3% of its time) */
            int64_t c = 0;
            for (; c + 8 <= C; c += 8)
                transpose_bf16x8(y + (b * T + t0) * Nin + c, Nin, l->window + (b * C + c) * W + kw + t0, W);
            for (; c < C; c++)
                for (int64_t t = t0; t < t0 + 8; t++) l->window[(b * C + c) * W + kw + t] = y[(b * T + t) * Nin + c];
        }
        for (int64_t c = 0; c < C; c++)
            for (int64_t t = t0; t < T; t++) l->window[(b * C + c) * W + kw + t] = y[(b * T + t) * Nin + c];
    }
    /* y per token: qkv [C] at 0, z [V], b [Hv], a [Hv] at their offsets */
    if (k->deltanet_decode(B, T, l->Hk, l->Hv, l->Kd, l->Vd, l->kernel, 1, l->window, l->taps, y + l->off[2], T * Nin, Nin,
                           y + l->off[3], T * Nin, Nin, l->A_log, l->dt_bias, y + l->off[1], T * Nin, Nin, l->gnorm,
                           l->geps, l->ssm, l->updates ? l->updates : l->ssm, o, nth))
        return -1;
    if (!l->updates && step3)
        for (int64_t b = 0; b < B; b++) window_keep(l->conv + b * C * kw, l->window + b * C * W, C);
    else if (!l->updates) /* kept in place (a plain step, a prompt's chunk): the conv inputs move on by the T tokens */
        for (int64_t b = 0; b < B; b++)
            for (int64_t c = 0; c < C; c++) copy_bf16(l->conv + (b * C + c) * kw, l->window + (b * C + c) * W + T, kw);
    return 0;
}

/* token m's (row b, position pos) cache entries: its normed key kn [Hk, D] rotated, and its value from its
 * projections' row ym, written at pos */
static void store_kv(const Step* s, const Layer* l, const uint16_t* ym, int64_t m, int64_t b, int64_t pos, uint16_t* kn) {
    const int64_t Hk = l->Hk, D = l->Kd, S = s->S;
    for (int64_t j = 0; j < Hk; j++) {
        rope(kn + j * D, s->R, s->cos + m * s->R, s->sin + m * s->R);
        memcpy(l->conv + ((b * Hk + j) * S + pos) * D, kn + j * D, sizeof(uint16_t) * (size_t)D);
        memcpy(l->values + ((b * Hk + j) * S + pos) * D, ym + l->off[2] + j * D, sizeof(uint16_t) * (size_t)D);
    }
}

static int attention(const Kernels* k, const Step* s, const Layer* l, const uint16_t* h, uint16_t* y, uint16_t* o,
                     uint16_t* scratch, int nth) {
    const int64_t B = s->B, T = s->T, M = B * T, A = l->Hv, Hk = l->Hk, D = l->Kd, S = s->S;
    const int64_t Nq = l->Nin, AD = A * D;
    if (project(k, l, h, M, y, o, s->prompt, nth)) return -1;
    /* scratch: q [B, T, A, D] normed and rotated, gate [M, A*D], attention output [B, A, T, D], k [Hk, D] */
    uint16_t *q = scratch, *gate = q + M * AD, *att = gate + M * AD, *kn = att + M * AD;
    for (int64_t m = 0; m < M; m++) {
        const uint16_t* ym = y + m * Nq; /* per head [query D, gate D] at 0, then k [Hk, D], v [Hk, D] at their offsets */
        const int64_t b = m / T, pos = s->index[m];
        k->rmsnorm(A, D, ym, 2 * D, l->gnorm, 1, l->geps, 1, q + m * AD, 1);
        k->rmsnorm(Hk, D, ym + l->off[1], D, l->knorm, 1, l->geps, 1, kn, 1);
        for (int64_t a = 0; a < A; a++) {
            memcpy(gate + m * AD + a * D, ym + a * 2 * D + D, sizeof(uint16_t) * (size_t)D);
            rope(q + m * AD + a * D, s->R, s->cos + m * s->R, s->sin + m * s->R);
        }
        store_kv(s, l, ym, m, b, pos, kn);
    }
    if ((s->prompt ? k->attend_prompt : k->attend_decode)(B, A, T, Hk, S, D, D, 1, q, T * AD, D, AD, l->conv, l->values,
                                                           s->starts, l->scale, att, nth))
        return -1;
    for (int64_t b = 0; b < B; b++) /* [B, A, T, D] -> [B, T, A*D] */
        for (int64_t a = 0; a < A; a++)
            for (int64_t t = 0; t < T; t++)
                memcpy(q + ((b * T + t) * A + a) * D, att + ((b * A + a) * T + t) * D, sizeof(uint16_t) * (size_t)D);
    k->sigmoid_mul(M, AD, q, AD, gate, AD, o, nth);
    return 0;
}

static int layer(const Kernels* k, const Step* s, const Layer* l, uint16_t* x, uint16_t* h, uint16_t* y, uint16_t* o,
                 uint16_t* scratch, int nth) {
    const int64_t M = s->B * s->T, H = s->H;
    const Fuse add = {FUSE_ADD, 0, 0}, swiglu = {FUSE_SWIGLU, l->I, l->up};
    k->rmsnorm(M, H, x, H, l->norm1, 1, s->eps, 1, h, nth);
    if (l->kind == 0 ? deltanet(k, s, l, h, y, o, nth) : attention(k, s, l, h, y, o, scratch, nth)) return -1;
    if (linear_fused(k, &l->out, o, M, x, h, &add, s->prompt, nth)) return -1; /* x += out(o) */
    k->rmsnorm(M, H, x, H, l->norm2, 1, s->eps, 1, h, nth);
    if (linear_fused(k, &l->gate_up, h, M, o, y, &swiglu, s->prompt, nth)) return -1; /* o = silu(gate) * up */
    return linear_fused(k, &l->down, o, M, x, h, &add, s->prompt, nth) ? -1 : 0;    /* x += down(o) */
}

/* The decode forward of T tokens per row through L layers (`Step`, `Layer`): embedding (or the given input), layers,
 * final norm. Writes
 * keys/values at the tokens' positions, each DeltaNet layer's window and updates (or, kept in place, its cache).
 * 0; -1 out of memory; -2 a token id outside the vocabulary; -3 a position outside the cache (nothing written). */
int qwen35_decode(const Kernels* k, const Step* s, const Layer* layers, int64_t L, int nth) {
    const int64_t M = s->B * s->T, H = s->H;
    for (int64_t m = 0; m < M; m++) {
        if (s->ids && (s->ids[m] < 0 || s->ids[m] >= s->V)) return -2;
        if (s->index[m] < 0 || s->index[m] >= s->S) return -3;
    }
    int64_t widest = 0, scratch_n = 0; /* the widest projection output, the attention scratch */
    for (int64_t i = 0; i < L; i++) {
        const Layer* l = layers + i;
        const int64_t n[4] = {l->Nin, l->out.K, l->gate_up.N, l->down.K};
        for (int j = 0; j < 4; j++) widest = n[j] > widest ? n[j] : widest;
        if (l->kind == 1) {
            const int64_t need = 3 * l->Hv * l->Kd + l->Hk * l->Kd;
            scratch_n = need > scratch_n ? need : scratch_n;
        }
    }
    uint16_t* buf = malloc(sizeof(uint16_t) * (size_t)(M * (2 * H + 2 * widest + scratch_n)));
    if (!buf) return -1;
    uint16_t *x = buf, *h = x + M * H, *y = h + M * H, *o = y + M * widest, *scratch = o + M * widest;
    if (s->ids)
        for (int64_t m = 0; m < M; m++) memcpy(x + m * H, s->embed + s->ids[m] * H, sizeof(uint16_t) * (size_t)H);
    else
        memcpy(x, s->x, sizeof(uint16_t) * (size_t)(M * H));
    int failed = 0;
    for (int64_t i = 0; i < L && !failed; i++) failed = layer(k, s, layers + i, x, h, y, o, scratch, nth);
    if (!failed) k->rmsnorm(M, H, x, H, s->norm, 1, s->eps, 1, s->out, nth);
    free(buf);
    return failed ? -1 : 0;
}

/* The k-th largest of x [n] (k <= n), counting equal values apart: as the k-th of x sorted in descending order. A
 * min-heap of the k largest so far. */
static float kth_largest(const float* x, int64_t n, int64_t k, float* heap) {
    for (int64_t i = 0; i < n; i++) {
        float v = x[i];
        int64_t c = i < k ? i : 0; /* the slot to fill: the next one while filling, else the root (if v beats it) */
        if (i < k) { /* sift up */
            while (c > 0 && heap[(c - 1) / 2] > v) {
                heap[c] = heap[(c - 1) / 2];
                c = (c - 1) / 2;
            }
            heap[c] = v;
            continue;
        }
        if (!(v > heap[0])) continue;
        for (;;) { /* sift down from the root */
            int64_t m = 2 * c + 1;
            if (m >= k) break;
            if (m + 1 < k && heap[m + 1] < heap[m]) m++;
            if (!(heap[m] < v)) break;
            heap[c] = heap[m];
            c = m;
        }
        heap[c] = v;
    }
    return heap[0];
}

/* A row's shaped logits (sampling.py `shape_logits` with the repetition penalty, temperature and top-k): head logits
 * l [N] (token ids[i], or i) of a vocabulary of V (N < V: a reduced one, the others -inf) -> x [N]: the logit in fp32,
 * for a token `mark` [V] flags (NULL: none) divided by r where positive and multiplied by r where not, then / T, -inf
 * below the top_k-th largest (top_k >= V, or < 1, keeps all). A greedy row passes T = 1 and top_k = V: x is then its
 * penalised logits as they are. The same fp32 operations and comparisons as torch's. heap: scratch [min(top_k, N)]. */
static void shaped(const uint16_t* l, int64_t N, int64_t V, const int64_t* ids, const uint8_t* mark, float r, float T,
                   int64_t top_k, float* x, float* heap) {
    for (int64_t i = 0; i < N; i++) {
        float v = bf16_to_f(l[i]);
        if (mark && mark[ids ? ids[i] : i]) v = v > 0.0f ? v / r : v * r;
        x[i] = v / T;
    }
    const float kth = top_k >= 1 && top_k < V && top_k <= N ? kth_largest(x, N, top_k, heap) : -INFINITY;
    for (int64_t i = 0; i < N; i++)
        if (x[i] < kth) x[i] = -INFINITY;
}

/* The token a row's shaped logits x [N] (token ids[i], or i) pick: argmax over tokens of x + g (g [V]: a sampled
 * row's noise, NULL for a greedy row: x alone), lowest token id first among equals, as torch.argmax over the full
 * vocabulary; writes x at each token of q [V] (NULL: none). The same fp32 addition as round.py's and accept.py's, so
 * the same token. */
static int64_t picked(const float* x, int64_t N, const int64_t* ids, const float* g, float* q) {
    int64_t best_id = -1;
    float best = 0.0f;
    for (int64_t i = 0; i < N; i++) {
        const int64_t t = ids ? ids[i] : i;
        const float xi = x[i], v = g ? xi + g[t] : xi;
        if (q) q[t] = xi;
        if (best_id < 0 || v > best || (v == best && t < best_id)) {
            best = v;
            best_id = t;
        }
    }
    return best_id;
}

/* A row's token from its head logits l [N]: `shaped` (penalty `mark`, r; T, top_k) then `picked`. x, heap: scratch
 * [N], [min(top_k, N)]. */
static int64_t pick(const uint16_t* l, int64_t N, int64_t V, const int64_t* ids, const uint8_t* mark, float r, float T,
                    int64_t top_k, const float* g, float* q, float* x, float* heap) {
    shaped(l, N, V, ids, mark, r, T, top_k, x, heap);
    return picked(x, N, ids, g, q);
}

/* The target's pick in a round with shaped rows (round.py's `verify` with accept.py's `accept_rows`; the repetition
 * penalty, temperature, top-k and top-p): per row b a temperature, top-k, top-p, greedy flag and penalty, and noise
 * [B, T, V] for each of its T tokens. A greedy row with a penalty takes the argmax of its penalised logits; a
 * seeded row, and any sampled row in a plain step (T = 1), argmax(x + noise) at each position; a row with `unseeded`
 * set and drafts Leviathan et al.'s rule (`unseeded_row`). Position j's penalty counts the tokens seen before the
 * round and the drafts d_1..d_j (round.py `seen_before`). */
typedef struct {
    const float* temp;
    const uint8_t* greedy;
    const int64_t* top_k;
    const float* noise;      /* [B, T, V], or NULL where every row is greedy */
    const uint8_t* unseeded; /* [B] or NULL */
    const float* q;          /* [B, T-1, V]: the drafts' x (their rule's logits, the draft chain's q) */
    const float* u;          /* [B, T-1]: uniforms for the ratio tests */
    const int64_t* drafts;   /* [B, T-1] */
    int64_t* limit;          /* [B]: the drafts each row may use; an unseeded row's becomes the count it accepted */
    const float* penalty;    /* [B] each row's repetition penalty (1: none), or NULL: no row has one */
    const uint8_t* seen;     /* [B, V] bool: the tokens each row has seen before the round (with penalty) */
    const float* top_p;      /* [B] each row's top-p (1: none), or NULL: no row has one */
} Pick;

/* A target position's shaped logits: `shaped`, then row b's top-p cut (top_p.c, through the kernel table: the code
 * sampling.py's `shape_logits` runs). 0, or -1 (memory). */
static int shaped_target(const Kernels* k, const Pick* p, int64_t b, const uint16_t* l, int64_t N, const uint8_t* mark,
                         float* x, float* heap) {
    shaped(l, N, N, NULL, mark, mark ? p->penalty[b] : 1.0f, p->temp[b], p->top_k[b], x, heap);
    return p->top_p && p->top_p[b] < 1.0f ? k->top_p_rows(1, N, x, N, p->top_p + b) : 0;
}

/* A row's penalty marks at verify position n: seen before the round, then the drafts d_1..d_n (marked counts those
 * already in; marks only grow with n) */
static void mark_upto(uint8_t* mark, const int64_t* d, int64_t n, int64_t* marked) {
    for (; *marked < n; (*marked)++) mark[d[*marked]] = 1;
}

/* log sum exp of x [n] (-inf entries count 0; all -inf: -inf), 8 lanes at a time (native.h's exp8) */
static float logsumexp(const float* x, int64_t n) {
    float m = -INFINITY;
    for (int64_t i = 0; i < n; i++) m = x[i] > m ? x[i] : m;
    if (m == -INFINITY) return m;
    const __m256 vm = _mm256_set1_ps(m), ninf = _mm256_set1_ps(-INFINITY);
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_add_ps(acc, _mm256_andnot_ps(_mm256_cmp_ps(v, ninf, _CMP_EQ_OQ), exp8(_mm256_sub_ps(v, vm))));
    }
    float lanes[8], s = 0.0f;
    _mm256_storeu_ps(lanes, acc);
    for (int j = 0; j < 8; j++) s += lanes[j];
    for (; i < n; i++) s += x[i] == -INFINITY ? 0.0f : expf(x[i] - m);
    return m + logf(s);
}

/* An unseeded row with drafts (accept.py `accept_rows`): with p_j = softmax(x_j) of the verify's shaped logits at
 * position j and q_j = softmax of the drafts' x, accept draft d_j while u_j q_j(d_j) < p_j(d_j) (within the row's
 * limit); at the first rejection n the next token is a sample from norm(max(0, p_n - q_n)) (p_n where that is all
 * zero), after all were accepted one from p_n (argmax(x_n + noise)): an exact sample from the target whatever was
 * drafted. Writes the row's T target tokens as the greedy accept reads them (the accepted drafts, then the next
 * token) and its limit as the accepted count. The same rule as accept.py's; torch's softmax rounds differently, so
 * the two agree in law, and in tokens except where a ratio or a residual's argmax sits within rounding of a tie.
 * mark: scratch [N] holding the row's seen tokens (NULL: no penalty); x, heap: scratch [N], [N]. 0, or -1 (memory). */
static int unseeded_row(const Kernels* k, const Pick* p, int64_t b, int64_t T, const uint16_t* logits, int64_t N,
                        int64_t* target, uint8_t* mark, float* x, float* heap) {
    const int64_t K = T - 1, lim = p->limit[b] < K ? p->limit[b] : K;
    const float* q = p->q + b * K * N;
    const int64_t* d = p->drafts + b * K;
    int64_t n = 0, marked = 0;
    float lp = 0.0f, lq = 0.0f; /* log-normalisers of x and q at the rejected position (where one was rejected) */
    for (; n < lim; n++) {
        if (mark) mark_upto(mark, d, n, &marked);
        if (shaped_target(k, p, b, logits + (b * T + n) * N, N, mark, x, heap)) return -1;
        const float* qn = q + n * N;
        lp = logsumexp(x, N);
        lq = logsumexp(qn, N);
        const float pd = expf(x[d[n]] - lp), qd = qn[d[n]] == -INFINITY ? 0.0f : expf(qn[d[n]] - lq);
        if (!(qd > 0.0f && p->u[b * K + n] * qd < pd)) break;
    }
    const int rejected = n < lim; /* x is then position n's already */
    if (!rejected) {
        if (mark) mark_upto(mark, d, n, &marked);
        if (shaped_target(k, p, b, logits + (b * T + n) * N, N, mark, x, heap)) return -1;
    }
    const float* g = p->noise + (b * T + n) * N;
    int64_t next = -1;
    float best = 0.0f;
    if (rejected) { /* the residual max(0, p_n - q_n), sampled by argmax(log r + g) over where it is positive */
        const float* qn = q + n * N;
        for (int64_t t = 0; t < N; t++) {
            const float pt = x[t] == -INFINITY ? 0.0f : expf(x[t] - lp), qt = qn[t] == -INFINITY ? 0.0f : expf(qn[t] - lq);
            const float r = pt - qt;
            if (!(r > 0.0f)) continue;
            const float v = logf(r) + g[t];
            if (next < 0 || v > best) {
                best = v;
                next = t;
            }
        }
    }
    if (next < 0) /* after all were accepted (or p_n - q_n nowhere positive): a sample from p_n */
        for (int64_t t = 0; t < N; t++) {
            const float v = x[t] + g[t];
            if (next < 0 || v > best) {
                best = v;
                next = t;
            }
        }
    for (int64_t j = 0; j < n; j++) target[b * T + j] = d[j];
    target[b * T + n] = next;
    p->limit[b] = n;
    return 0;
}

/* A round's verify (decode/round.c `greedy_round`): the decode forward, then the head over every token and each
 * one's argmax (a shaped row's: `shaped_target` then `picked`, where `p` is given), as round.py's `verify` runs them
 * (model.head, then argmax over [B, T, V], or accept.py's over the shaped logits plus the noise): target [B*T].
 * qwen35_decode's codes. */
int qwen35_verify(const Kernels* k, const Step* s, const Layer* layers, int64_t L, const Linear* head, uint16_t* logits,
                  int64_t* target, const Pick* p, int nth) {
    const int status = qwen35_decode(k, s, layers, L, nth);
    if (status) return status;
    const int64_t M = s->B * s->T, N = head->N;
    if (linear(k, head, s->out, M, logits, 0, nth)) return -1;
    k->argmax_rows(M, N, logits, N, 1, target, nth);
    if (!p) return 0;
    const int64_t T = s->T;
    float* xs = malloc(sizeof(float) * (size_t)(2 * N));
    uint8_t* mark = p->penalty ? malloc((size_t)N) : NULL;
    if (!xs || (p->penalty && !mark)) {
        free(xs);
        free(mark);
        return -1;
    }
    int failed = 0;
    for (int64_t b = 0; b < s->B && !failed; b++) {
        const int pen = p->penalty && p->penalty[b] != 1.0f; /* (a penalty of 1 changes nothing) */
        if (p->greedy[b] && !pen) continue;
        if (pen) memcpy(mark, p->seen + b * N, (size_t)N);
        if (p->unseeded && p->unseeded[b] && T > 1) {
            failed = unseeded_row(k, p, b, T, logits, N, target, pen ? mark : NULL, xs, xs + N);
            continue;
        }
        int64_t marked = 0;
        for (int64_t t = 0; t < T && !failed; t++) {
            const int64_t m = b * T + t;
            if (pen) mark_upto(mark, p->drafts + b * (T - 1), t, &marked);
            if (!(failed = shaped_target(k, p, b, logits + m * N, N, pen ? mark : NULL, xs, xs + N)))
                target[m] = picked(xs, N, NULL, p->greedy[b] ? NULL : p->noise + m * N, NULL);
        }
    }
    free(xs);
    free(mark);
    return failed ? -1 : 0;
}

typedef struct {
    int64_t B, W, K, H, V, S, R, P; /* rows, pending positions read, drafts, hidden, vocabulary, MTP cache slots,
                                       rotary dims, rotary table rows */
    float eps;                      /* the pre-fc norms' */
    const uint16_t *embed, *norm_e, *norm_h; /* the embedding the MTP reads [V, H]; pre_fc_norm_embedding, _hidden [H] */
    const uint16_t* norm;           /* the MTP's final norm [H] */
    Linear fc;                      /* the input projection [2H] -> [H] (bf16-native, or int8 / int4 drafts) */
    Linear head;                    /* the output head the drafts take: [H] -> [N] (N = V, or a reduced vocabulary) */
    const int64_t* vocab_ids;       /* [N] the token of each head output (a reduced vocabulary), or NULL: N = V */
    const uint16_t *cos, *sin;      /* rotary tables [P, R] */
    const uint16_t* pend_h;         /* [B, PR, H]: the kept positions the MTP reads first */
    const int64_t* pend_next;       /* [B, PR]: the token after each */
    int64_t PR;                     /* pending slots per row */
    const int64_t *pend_n, *mtp_pos; /* [B]: pending positions per row (1..W), the MTP slots filled */
    int64_t* drafts;                /* out [B, K] */
    /* The drafts' rule (round.py's `draft`: the repetition penalty, temperature and top-k), or temp NULL: every
       row's argmax */
    const float* temp;              /* [B] each row's temperature (1 for a greedy row) */
    const uint8_t* greedy;          /* [B] bool: the row drafts the argmax of its (penalised) logits */
    const int64_t* top_k;           /* [B] each row's top-k (V: none) */
    const float* noise;             /* [B, K, V] the Gumbel noise of each sampled row's drafts (NULL: none sampled) */
    float* q;                       /* out [B, K, V] or NULL: every row's x (`shaped`; a greedy row's logits; -inf
                                       outside a reduced vocabulary), the unseeded rule's draft distribution */
    const float* penalty;           /* [B] each row's repetition penalty (1: none), or NULL: no row has one; draft j
                                       counts the tokens seen and the drafts d_1..d_{j-1} */
    const uint8_t* seen;            /* [B, V] bool: the tokens each row has seen (with penalty) */
} Draft;

/* fc(cat(norm_e(embed[ids]), norm_h(hid))) for M rows: hid [M, H] -> x [M, H]; cat [M, 2H] and e [M, H] scratch */
static int mtp_input(const Kernels* k, const Draft* d, const int64_t* ids, const uint16_t* hid, int64_t M, uint16_t* cat,
                     uint16_t* e, uint16_t* x, int nth) {
    const size_t row = sizeof(uint16_t) * (size_t)d->H;
    const int64_t H = d->H;
    for (int64_t m = 0; m < M; m++) memcpy(e + m * H, d->embed + ids[m] * H, row);
    k->rmsnorm(M, H, e, H, d->norm_e, 1, d->eps, 1, x, nth);
    for (int64_t m = 0; m < M; m++) memcpy(cat + m * 2 * H, x + m * H, row);
    k->rmsnorm(M, H, hid, H, d->norm_h, 1, d->eps, 1, e, nth);
    for (int64_t m = 0; m < M; m++) memcpy(cat + m * 2 * H + H, e + m * H, row);
    return linear(k, &d->fc, cat, M, x, 0, nth);
}

/* What an attention layer's forward over T tokens per row leaves in its cache, and nothing more: input norm, the
 * input projections, each token's normed, rotated key and its value written at its position (`attention`'s own
 * steps, so the same bits). The draft chain's depth 1 reads positions whose outputs it never uses. 0; -1 memory. */
static int attention_kv(const Kernels* k, const Step* s, const Layer* l, int nth) {
    const int64_t M = s->B * s->T, H = s->H, Nq = l->Nin;
    int64_t widest = 0;
    for (int64_t j = 0; j < l->n_in; j++) widest = l->in[j].N > widest ? l->in[j].N : widest;
    uint16_t* buf = malloc(sizeof(uint16_t) * (size_t)(M * (H + Nq + widest) + l->Hk * l->Kd));
    if (!buf) return -1;
    uint16_t *h = buf, *y = h + M * H, *tmp = y + M * Nq, *kn = tmp + M * widest;
    k->rmsnorm(M, H, s->x, H, l->norm1, 1, s->eps, 1, h, nth);
    int failed = project(k, l, h, M, y, tmp, s->prompt, nth);
    for (int64_t m = 0; m < M && !failed; m++) {
        const uint16_t* ym = y + m * Nq;
        k->rmsnorm(l->Hk, l->Kd, ym + l->off[1], l->Kd, l->knorm, 1, l->geps, 1, kn, 1);
        store_kv(s, l, ym, m, m / s->T, s->index[m], kn);
    }
    free(buf);
    return failed;
}

/* The greedy draft chain of a sequential MTP (round.py's `draft` with no sampling rule and the full head), as one
 * call: depth 1 reads each row's W pending positions (MTP slots mtp_pos + 0..W-1) and drafts token 1 from the output
 * at its last pending one; depth j reads draft j-1 at slot mtp_pos + pend_n - 2 + j. Depth j runs MTP layer (j-1) % L
 * with its cache. Each piece is the eager path's kernel (fc: its linear, the layer and norm: qwen35_decode, the head,
 * argmax_rows) or an exact copy, so the drafts and the caches written are the eager ones bit for bit; at depth 1 an
 * attention layer writes every pending position's key and value (`attention_kv`) and runs whole only at the last.
 * 0; -1 out of memory; -2 a token outside the vocabulary; -3 a position outside the cache or the rotary table;
 * -4 a pending count outside 0..W (nothing written). A row with none pending (0: a row not decoding) drafts from
 * its last pending slot, as the round's index -1 does: its drafts are never used. K = 0 (round.py's `catch_up`): depth 1
 * reads the W positions into the MTP's cache and nothing is drafted. */
int qwen35_draft(const Kernels* k, const Draft* d, const Layer* layers, int64_t L, int nth) {
    const int64_t B = d->B, W = d->W, H = d->H, R = d->R, M = B * W;
    for (int64_t b = 0; b < B; b++) {
        if (d->pend_n[b] < 0 || d->pend_n[b] > W) return -4; /* 0: a row with nothing pending (not decoding) */
        if (d->mtp_pos[b] < 0 || d->mtp_pos[b] + d->pend_n[b] - 2 + d->K >= d->S || d->mtp_pos[b] + W > d->S
            || d->mtp_pos[b] + W > d->P || d->mtp_pos[b] + d->pend_n[b] - 2 + d->K >= d->P)
            return -3;
        for (int64_t t = 0; t < W; t++)
            if (d->pend_next[b * d->PR + t] < 0 || d->pend_next[b * d->PR + t] >= d->V) return -2;
    }
    if (d->head.N > d->V) return -4;
    uint16_t* buf = malloc(sizeof(uint16_t) * (size_t)(M * (6 * H + 2 * R) + B * d->V));
    int64_t* ints = malloc(sizeof(int64_t) * (size_t)(3 * M + B));
    float* xs = d->temp ? malloc(sizeof(float) * (size_t)(2 * d->head.N)) : NULL; /* pick's scratch */
    uint8_t* marks = d->temp && d->penalty && d->K ? malloc((size_t)(B * d->V)) : NULL; /* seen, then the drafts */
    if (!buf || !ints || (d->temp && !xs) || (d->temp && d->penalty && d->K && !marks)) {
        free(buf);
        free(ints);
        free(xs);
        free(marks);
        return -1;
    }
    if (marks) memcpy(marks, d->seen, (size_t)(B * d->V));
    uint16_t *hid = buf, *cat = hid + M * H, *e = cat + 2 * M * H, *x = e + M * H, *out = x + M * H;
    uint16_t *cos = out + M * H, *sin = cos + M * R, *logits = sin + M * R, *h = hid; /* h: depth j's input [B, H] */
    int64_t *ids = ints, *index = ids + M, *starts = index + M, *tok = starts + M;
    for (int64_t b = 0; b < B; b++) {
        starts[b] = d->mtp_pos[b];
        for (int64_t t = 0; t < W; t++) {
            const int64_t m = b * W + t;
            memcpy(hid + m * H, d->pend_h + (b * d->PR + t) * H, sizeof(uint16_t) * (size_t)H);
            ids[m] = d->pend_next[b * d->PR + t];
            index[m] = d->mtp_pos[b] + t;
        }
    }
    int failed = 0;
    for (int64_t j = 1; j <= (d->K ? d->K : 1) && !failed; j++) { /* K = 0: depth 1 reads the positions, no draft */
        const int64_t T = j == 1 ? W : 1, rows = B * T;
        if (j > 1)
            for (int64_t b = 0; b < B; b++) {
                ids[b] = d->drafts[b * d->K + j - 2];
                index[b] = starts[b] = d->mtp_pos[b] + d->pend_n[b] - 2 + j;
            }
        for (int64_t m = 0; m < rows; m++) {
            memcpy(cos + m * R, d->cos + index[m] * R, sizeof(uint16_t) * (size_t)R);
            memcpy(sin + m * R, d->sin + index[m] * R, sizeof(uint16_t) * (size_t)R);
        }
        if ((failed = mtp_input(k, d, ids, h, rows, cat, e, x, nth))) break;
        if (j == 1 && layers[0].kind == 1) {
            /* Depth 1 of an attention layer: every pending position's key and value (all the cache needs of them),
             * then the layer's whole forward only at each row's last pending position, the one that drafts. Its
             * query attends the same keys, and every kernel is row-invariant, so its output and the cache are the
             * forward over all W's, bit for bit, without the others' attention, output projection and MLP (what
             * `catch_up` and a round's first depth spent for nothing). */
            const Step all = {B, W, H, d->V, d->S, R, d->eps, NULL, x, index, starts, NULL, cos, sin, d->norm, out, 0};
            if ((failed = attention_kv(k, &all, layers, nth)) || !d->K) break;
            for (int64_t b = 0; b < B; b++) { /* row b's last pending token to row b (no source is written before read) */
                const int64_t m = b * W + (d->pend_n[b] + W - 1) % W;
                memmove(x + b * H, x + m * H, sizeof(uint16_t) * (size_t)H);
                memmove(cos + b * R, cos + m * R, sizeof(uint16_t) * (size_t)R);
                memmove(sin + b * R, sin + m * R, sizeof(uint16_t) * (size_t)R);
                index[b] = starts[b] = index[m];
            }
        }
        const int64_t T1 = j == 1 && layers[0].kind == 1 ? 1 : T;
        const Step s = {B, T1, H, d->V, d->S, R, d->eps, NULL, x, index, starts, NULL, cos, sin, d->norm, out, 0};
        if ((failed = qwen35_decode(k, &s, layers + (j - 1) % L, 1, nth)) || !d->K) break;
        for (int64_t b = 0; b < B; b++) /* the output at the last pending position (depth 1), else the one */
            memcpy(h + b * H, out + (b * T1 + (T1 > 1 ? (d->pend_n[b] + W - 1) % W : 0)) * H, sizeof(uint16_t) * (size_t)H);
        if ((failed = linear(k, &d->head, h, B, logits, 0, nth))) break;
        k->argmax_rows(B, d->head.N, logits, d->head.N, 1, tok, nth);
        for (int64_t b = 0; b < B; b++) {
            const int64_t at = b * d->K + j - 1, N = d->head.N;
            d->drafts[at] = d->vocab_ids ? d->vocab_ids[tok[b]] : tok[b];
            float* q = d->q ? d->q + at * d->V : NULL;
            if (q && d->vocab_ids)
                for (int64_t t = 0; t < d->V; t++) q[t] = -INFINITY;
            const int pen = marks && d->penalty[b] != 1.0f; /* (a penalty of 1 changes nothing) */
            if (d->temp && (!d->greedy[b] || pen))
                d->drafts[at] = pick(logits + b * N, N, d->V, d->vocab_ids, pen ? marks + b * d->V : NULL,
                                     pen ? d->penalty[b] : 1.0f, d->temp[b], d->top_k[b],
                                     d->greedy[b] ? NULL : d->noise + at * d->V, q, xs, xs + N);
            else if (q) /* a greedy row: its logits as they are (temperature 1), for a q nobody reads but defined */
                for (int64_t i = 0; i < N; i++) q[d->vocab_ids ? d->vocab_ids[i] : i] = bf16_to_f(logits[b * N + i]);
            if (pen) marks[b * d->V + d->drafts[at]] = 1;
        }
    }
    free(buf);
    free(ints);
    free(xs);
    free(marks);
    return failed ? -1 : 0;
}
