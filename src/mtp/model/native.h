/* What every C kernel of native.py shares: bfloat16 <-> float as torch converts (round to nearest even, NaN kept a
 * NaN). A header beside the sources: native.py keys each build on it too. */

#ifndef MTP_NATIVE_H
#define MTP_NATIVE_H

#include <stdint.h>
#include <string.h>

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

static inline float round_bf16(float f) { return bf16_to_f(to_bf16(f)); } /* float rounded to bfloat16, as a float */

#endif
