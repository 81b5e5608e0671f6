/* The i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) and the ternary
 * types (TQ1_0, TQ2_0): one block of 256 weights dequantized to f32 by plain scalar
 * code, to exactly the values gguf's reference gives (the same operations in the same
 * order; the kernels are built with -ffp-contract=off). A family's kernels (the x86
 * ones) include this after defining f16_at, and emit the block from memory, or have
 * vector code of their own for a type (all but TQ1_0 and TQ2_0, and on AVX2 IQ1_M).
 *
 * The grids (rows of 8 or 4 weights picked by the quants) and the sign table (7 sign
 * bits -> 8 with even parity) are gguf's tables, the data of llama.cpp's ggml-common.h,
 * handed over once by llmrun_iq_tables (llmrun/quant/kernels.py) rather than copied here.
 * Block layouts: https://github.com/ggml-org/llama.cpp/blob/master/ggml/src/ggml-common.h
 */
#ifndef LLMRUN_IQUANTS_H
#define LLMRUN_IQUANTS_H
#include <stdint.h>
#include <string.h>

#define IQ_TYPES(X, A)                                                                   \
    X(IQ2_XXS, A) X(IQ2_XS, A) X(IQ2_S, A) X(IQ3_XXS, A) X(IQ3_S, A) X(IQ1_S, A)         \
    X(IQ1_M, A) X(TQ1_0, A) X(TQ2_0, A)

#define IQ2_XXS_BLOCK 256
#define IQ2_XXS_BYTES 66
#define IQ2_XS_BLOCK 256
#define IQ2_XS_BYTES 74
#define IQ2_S_BLOCK 256
#define IQ2_S_BYTES 82
#define IQ3_XXS_BLOCK 256
#define IQ3_XXS_BYTES 98
#define IQ3_S_BLOCK 256
#define IQ3_S_BYTES 110
#define IQ1_S_BLOCK 256
#define IQ1_S_BYTES 50
#define IQ1_M_BLOCK 256
#define IQ1_M_BYTES 56
#define TQ1_0_BLOCK 256
#define TQ1_0_BYTES 54
#define TQ2_0_BLOCK 256
#define TQ2_0_BYTES 66

#define IQ1_DELTA 0.125f

static const uint8_t *ksigns;                                /* [128] */
static const uint8_t *iq2xxs_grid, *iq2xs_grid, *iq2s_grid; /* [256], [512], [1024] x 8 */
static const uint8_t *iq3xxs_grid, *iq3s_grid;               /* [256], [512] x 4 */
static const int8_t *iq1s_grid;                              /* [2048] x 8, for IQ1_S and IQ1_M */

/* The tables, which must outlive the library's use of these types. */
void llmrun_iq_tables(const uint8_t *signs, const uint8_t *iq2xxs, const uint8_t *iq2xs,
                      const uint8_t *iq2s, const uint8_t *iq3xxs, const uint8_t *iq3s,
                      const int8_t *iq1s) {
    ksigns = signs;
    iq2xxs_grid = iq2xxs;
    iq2xs_grid = iq2xs;
    iq2s_grid = iq2s;
    iq3xxs_grid = iq3xxs;
    iq3s_grid = iq3s;
    iq1s_grid = iq1s;
}

#define IQ_CASE(T, _) case T:
/* 0 for the types here until llmrun_iq_tables, 1 for every other type */
static inline int iq_ready(int type) {
    switch (type) {
    IQ_TYPES(IQ_CASE, _)
        return ksigns != NULL;
    default:
        return 1;
    }
}

static inline uint16_t u16_at(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* out[j] = db * grid[j] * (-1 where bit j of signs is set, else 1), j < width. The
 * product by -1 as a flip of the sign bit: the same bits (a NaN's sign aside, from a NaN
 * scale), and code the compiler vectorizes. */
static inline void iq_signed(float db, const uint8_t *grid, unsigned signs, int width, float *out) {
    for (int j = 0; j < width; j++) {
        const float v = db * (float)grid[j];
        uint32_t bits;
        memcpy(&bits, &v, 4);
        bits ^= ((signs >> j) & 1u) << 31;
        memcpy(out + j, &bits, 4);
    }
}

/* 8 sub-blocks of 32: 4 grid indices (bytes), then a u32 of four 7-bit sign indices and
 * the 4-bit scale (bits 28..31). */
static inline void iq_IQ2_XXS(const uint8_t *src, float *out) {
    const float d = f16_at(src);
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *q = src + 2 + 8 * ib;
        const uint32_t aux = u32_at(q + 4);
        const float db = d * (0.5f + (float)(aux >> 28)) * 0.25f;
        for (int l = 0; l < 4; l++)
            iq_signed(db, iq2xxs_grid + 8 * q[l], ksigns[(aux >> (7 * l)) & 127], 8,
                      out + 32 * ib + 8 * l);
    }
}

/* 32 u16: a 9-bit grid index and a 7-bit sign index; 16 4-bit scales, one per 16 weights. */
static inline void iq_IQ2_XS(const uint8_t *src, float *out) {
    const float d = f16_at(src);
    for (int e = 0; e < 32; e++) {
        const uint16_t q = u16_at(src + 2 + 2 * e);
        const int sc = (src[66 + e / 4] >> (4 * ((e / 2) & 1))) & 15;
        const float db = d * (0.5f + (float)sc) * 0.25f;
        iq_signed(db, iq2xs_grid + 8 * (q & 511), ksigns[q >> 9], 8, out + 8 * e);
    }
}

/* 32 grid indices: low bytes, then 2 high bits each (qh byte j: indices 4j..4j+3); a
 * byte of sign bits per 8 weights; 16 4-bit scales. */
static inline void iq_IQ2_S(const uint8_t *src, float *out) {
    const float d = f16_at(src);
    const uint8_t *qs = src + 2, *signs = src + 34, *qh = src + 66, *scales = src + 74;
    for (int e = 0; e < 32; e++) {
        const int index = qs[e] | (((qh[e / 4] >> (2 * (e % 4))) & 3) << 8);
        const float db = d * (0.5f + (float)((scales[e / 4] >> (4 * ((e / 2) & 1))) & 15)) * 0.25f;
        iq_signed(db, iq2s_grid + 8 * index, signs[e], 8, out + 8 * e);
    }
}

/* 64 grid indices of 4 weights, then per sub-block of 32 a u32 as IQ2_XXS's. */
static inline void iq_IQ3_XXS(const uint8_t *src, float *out) {
    const float d = f16_at(src);
    for (int ib = 0; ib < 8; ib++) {
        const uint32_t aux = u32_at(src + 66 + 4 * ib);
        const float db = d * (0.5f + (float)(aux >> 28)) * 0.5f;
        for (int l = 0; l < 4; l++) {
            const unsigned signs = ksigns[(aux >> (7 * l)) & 127];
            const uint8_t *q = src + 2 + 8 * ib + 2 * l;
            float *o = out + 32 * ib + 8 * l;
            iq_signed(db, iq3xxs_grid + 4 * q[0], signs, 4, o);
            iq_signed(db, iq3xxs_grid + 4 * q[1], signs >> 4, 4, o + 4);
        }
    }
}

/* 64 grid indices: low bytes, then a high bit each (bit j of qh byte i: index 8i + j);
 * sign bits; 8 4-bit scales, w = d * (1 + 2 * scale) * grid * sign. */
static inline void iq_IQ3_S(const uint8_t *src, float *out) {
    const float d = f16_at(src);
    const uint8_t *qs = src + 2, *qh = src + 66, *signs = src + 74, *scales = src + 106;
    for (int e = 0; e < 64; e++) {
        const int ib = e / 8, index = qs[e] | (((qh[ib] >> (e % 8)) & 1) << 8);
        const float db = d * (float)(1 + 2 * ((scales[ib / 2] >> (4 * (ib & 1))) & 15));
        iq_signed(db, iq3s_grid + 4 * index, signs[e / 2] >> (4 * (e & 1)), 4, out + 4 * e);
    }
}

/* w = dl * (grid + delta) for the 8 weights of a grid row */
static inline void iq1_row(float dl, const int8_t *grid, float delta, float *out) {
    for (int j = 0; j < 8; j++) out[j] = dl * ((float)grid[j] + delta);
}

/* 32 grid indices of 8 weights in -1, 0, 1: low bytes, then per sub-block of 32 a u16
 * with 3 high bits for each of its 4 indices, its 3-bit scale and the delta's sign. */
static inline void iq_IQ1_S(const uint8_t *src, float *out) {
    const float d = f16_at(src);
    for (int ib = 0; ib < 8; ib++) {
        const uint16_t h = u16_at(src + 34 + 2 * ib);
        const float dl = d * (float)(2 * ((h >> 12) & 7) + 1);
        const float delta = h & 0x8000 ? -IQ1_DELTA : IQ1_DELTA;
        for (int l = 0; l < 4; l++) {
            const int index = src[2 + 4 * ib + l] | (((h >> (3 * l)) & 7) << 8);
            iq1_row(dl, iq1s_grid + 8 * index, delta, out + 32 * ib + 8 * l);
        }
    }
}

/* 32 grid indices: low bytes, then a nibble each (3 high bits and the delta's sign);
 * four u16 of 3-bit scales (one per 16 weights) whose top nibbles hold the f16 scale. */
static inline void iq_IQ1_M(const uint8_t *src, float *out) {
    uint16_t sc[4];
    memcpy(sc, src + 48, 8);
    const uint16_t bits = (uint16_t)((sc[0] >> 12) | ((sc[1] >> 8) & 0x00F0) |
                                     ((sc[2] >> 4) & 0x0F00) | (sc[3] & 0xF000));
    uint8_t d16[2];
    memcpy(d16, &bits, 2);
    const float d = f16_at(d16);
    for (int e = 0; e < 32; e++) {
        const int s = e / 2, nib = (src[32 + e / 2] >> (4 * (e & 1))) & 15;
        const float dl = d * (float)(2 * ((sc[s / 4] >> (3 * (s % 4))) & 7) + 1);
        const int index = src[e] | ((nib & 7) << 8);
        iq1_row(dl, iq1s_grid + 8 * index, nib & 8 ? -IQ1_DELTA : IQ1_DELTA, out + 8 * e);
    }
}

/* Base-3 digits, 5 a byte (4 in the last 4 bytes) as fixed point: digit k of byte q is
 * the top of (q * 3^k mod 256) * 3, over 8 bits. Order: the first 32 bytes' first
 * digits, their second digits, ..., then the next 16 bytes' likewise, then the last 4. */
static inline void iq_TQ1_0(const uint8_t *src, float *out) {
    static const uint8_t pow3[5] = {1, 3, 9, 27, 81};
    static const int start[3] = {0, 32, 48}, count[3] = {32, 16, 4}, digits[3] = {5, 5, 4};
    const float d = f16_at(src + 52);
    int k = 0;
    for (int part = 0; part < 3; part++)
        for (int p = 0; p < digits[part]; p++)
            for (int i = 0; i < count[part]; i++) {
                const uint8_t q = (uint8_t)(src[start[part] + i] * pow3[p]);
                out[k++] = d * (float)(((q * 3) >> 8) - 1);
            }
}

/* 2-bit digits: byte 32c + i holds weights 128c + 32l + i at bits 2l. */
static inline void iq_TQ2_0(const uint8_t *src, float *out) {
    const float d = f16_at(src + 64);
    for (int c = 0; c < 2; c++)
        for (int l = 0; l < 4; l++)
            for (int i = 0; i < 32; i++)
                out[128 * c + 32 * l + i] = d * (float)(((src[32 * c + i] >> (2 * l)) & 3) - 1);
}

#endif
