/* What every family's 8-bit-activation kernels (q8_avx512.c, q8_avx2.c) share: the
 * quantization of the activations to Q8_0 (and Q8_K) blocks, their arrangement for each
 * weight layout, the passes over the weights, and a prompt's GEMM on decoded tiles of weights
 * (q8_gemm). A family's file includes common.h and this, then defines its rows_q8_T
 * kernels and its pass over a tile (gemm_tile), and ends with DEFINE_Q8_API().
 *
 * The activations are quantized as gguf.quants.quantize writes Q8_0 (and ggml's
 * quantize_row_q8_0_ref): per 32 values d = max|x| / 127, q = x * (1 / d) rounded
 * half away from zero, then d rounded to f16, with the same f32 operations (built with
 * -ffp-contract=off). A kernel then takes each block of weights against its block of
 * activation quants in exact integer arithmetic, as llama.cpp computes quantized
 * products, and scales the integer sums by the weight and activation scales in f32:
 * the result is sum over blocks of d_w * d_x * sum(q_w * q_x), to float rounding.
 *
 * The K-quants (Q4_K, Q5_K, Q6_K), the i-quants but IQ4_NL (which takes Q8_0) and the
 * ternary types take their activations as llama.cpp's vec_dot_type for them, Q8_K
 * (ggml's quantize_row_q8_K_ref): per 256 values one f32 scale d = -max / 127, max the
 * value of largest magnitude (the first such), q = x * (-127 / max) rounded half to
 * even. With one activation scale per 256, a kernel sums a whole block's products times
 * the weights' sub-block scales in integers and converts once per block.
 */
#include <math.h>

#include "common.h"

/* A call's quantized activations, m rows of n values. Per row: q, its n quants in the
 * order the weight type's kernel reads them (and zeros to the next 64); lane, per
 * dword lane of q (4 quants), the integer sum the kernel starts from (the weights'
 * offset times minus the lane's sum: the kernel's u8 weights are q_w + offset); dq,
 * per dword lane, the activation scale of its block; d and s, per block (natural
 * order), the scale and the scale times the sum of the block's quants.
 * Q8_K orders (q8_is_k): d per 256 values, and in lane's memory the int16 sums of the
 * quants per 16 values, then per 32 (q8k_sums16, q8k_sums32); dq and s unused. */
typedef struct {
    int8_t *q;
    int32_t *lane;
    float *dq;
    float *d;
    float *s;
    int64_t n, q_step, lane_step, d_step;
} act_t;

/* How a weight layout wants its activations: the quant order (and block format) and
 * the weights' offset. ORDER_NATURAL: x's own order (Q8_0). ORDER_Q8_K and
 * ORDER_Q8_K_PAIRS: Q8_K blocks of 256, in x's order (Q6_K, the packed K-quants; on
 * AVX2 also GGML's Q4_K and Q5_K, whose 32-byte loads hold one sub-block per nibble)
 * or as ORDER_K_PAIRS places them (AVX-512's GGML Q4_K and Q5_K). */
enum { ORDER_NATURAL, ORDER_QUADS, ORDER_K_PAIRS, ORDER_Q8_K, ORDER_Q8_K_PAIRS };

static inline int q8_is_k(int order) { return order == ORDER_Q8_K || order == ORDER_Q8_K_PAIRS; }

/* Row i's Q8_K sums of quants per 16 values and per 32 (q8_quantize_rows writes them). */
static inline const int16_t *q8k_sums16(const act_t *a, int64_t i) {
    return (const int16_t *)(a->lane + i * a->lane_step);
}

static inline const int16_t *q8k_sums32(const act_t *a, int64_t i) {
    return q8k_sums16(a, i) + a->n / 16;
}

/* One block of 32 values, as gguf.quants.quantize(Q8_0): q in natural order, and the sum
 * of q; returns d before its rounding to f16 (q8_f16 rounds it). */
static inline float q8_block_quantize(const float *x, int8_t *q, int32_t *sum) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) {
        const float a = fabsf(x[j]);
        amax = a > amax ? a : amax;
    }
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t s = 0;
    for (int j = 0; j < 32; j++) {
        const float v = x[j] * id, mag = fabsf(v), whole = floorf(mag);
        const int32_t r = (int32_t)(whole + floorf(2.0f * (mag - whole)));
        q[j] = (int8_t)(v < 0.0f ? -r : r);
        s += q[j];
    }
    *sum = s;
    return d;
}

static inline float q8_f16(float d) { return (float)(_Float16)d; }

/* One block of 256 values as ggml's quantize_row_q8_K_ref: q in natural order, the
 * sums of q per 16 values; returns d (f32). */
static inline float q8k_block_quantize_ref(const float *x, int8_t *q, int16_t sums16[16]) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < 256; j++) {
        const float a = fabsf(x[j]);
        if (a > amax) amax = a, max = x[j];
    }
    if (amax == 0.0f) {
        memset(q, 0, 256);
        memset(sums16, 0, 32);
        return 0.0f;
    }
    const float iscale = -127.0f / max;
    for (int j = 0; j < 256; j++) {
        const int v = (int)nearbyintf(iscale * x[j]); /* half to even, as nearest_int */
        q[j] = (int8_t)(v < 127 ? v : 127);
    }
    for (int k = 0; k < 16; k++) {
        int s = 0;
        for (int j = 0; j < 16; j++) s += q[16 * k + j];
        sums16[k] = (int16_t)s;
    }
    return 1.0f / iscale;
}

/* Where value j of block b (natural order) goes in q. ORDER_QUADS (Q4_0, Q5_0, MXFP4:
 * a 64-byte vector holds four blocks' 16-byte quants, low nibbles weights 0..15 and high
 * nibbles 16..31 of each): per four blocks, their values 0..15, then their 16..31 (a last
 * quad of fewer blocks leaves its other places as they are).
 * ORDER_K_PAIRS (Q4_K/Q5_K: per 256, 32 bytes hold sub-block 2p in the low nibbles and
 * 2p + 1 in the high ones): per 256, sub-blocks 0, 2, 1, 3, 4, 6, 5, 7. */
static inline int64_t q8_place(int order, int64_t b, int j) {
    switch (order) {
    case ORDER_QUADS:
        return 128 * (b / 4) + 64 * (j / 16) + 16 * (b % 4) + j % 16;
    case ORDER_K_PAIRS: case ORDER_Q8_K_PAIRS: {
        static const int8_t slot[8] = {0, 2, 1, 3, 4, 6, 5, 7};
        return 256 * (b / 8) + 32 * slot[b % 8] + j;
    }
    default:
        return 32 * b + j;
    }
}

/* The activation scale (block) of dword lane l of q: ORDER_QUADS pairs lanes l of the
 * low and high halves of each 128, so its lanes are 16 per 128 values. */
static inline int64_t q8_lane_block(int order, int64_t l) {
    switch (order) {
    case ORDER_QUADS:
        return 4 * (l / 16) + (l % 16) / 4;
    case ORDER_K_PAIRS: {
        static const int8_t block[8] = {0, 2, 1, 3, 4, 6, 5, 7};
        return 8 * (l / 64) + block[(l % 64) / 8];
    }
    default:
        return l / 8;
    }
}

/* The first value of block b's half h (values 16h .. 16h + 15) in q, for `order`. */
static inline int64_t q8_half_place(int order, int64_t b, int h) {
    return q8_place(order, b, 16 * h);
}

/* The GGML-layout types whose kernels take four blocks at a time (ORDER_QUADS), and the
 * bytes of their blocks (IQ4_NL's as Q4_0's: an f16 scale, then 16 bytes of nibbles). */
enum { QUAD_Q4_0, QUAD_Q5_0, QUAD_MXFP4, QUAD_IQ4_NL };

ALWAYS_INLINE int quad_bytes(const int kind) {
    return kind == QUAD_Q4_0 || kind == QUAD_IQ4_NL ? 18 : kind == QUAD_Q5_0 ? 22 : MXFP4_BYTES;
}

/* IQ4_NL's and IQ4_XS's codebook (kvalues_iq4nl, gguf's IQ4_NL.kvalues): a weight is its
 * block's scale times the value its nibble picks. Their kernels take the values' sizes
 * against the activation quants with the values' signs (llama.cpp's way: |w| <= 127, so
 * vpmaddubsw's pair sums stay below 2 * 127 * 127 and never saturate). */
static const int8_t IQ4_NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                         1,    13,   25,  38,  53,  69,  89,  113};
#define IQ4_NL_BYTES 18
#define IQ4_XS_BYTES 136

/* An IQ4_XS block's 8 sub-block scales less 32 (-32 .. 31), byte j sub-block j's: 4 low
 * bits from scales_l (bytes 4..7, nibble j), 2 high ones from scales_h (bytes 2..3, bits
 * 2j and 2j + 1). */
static inline uint64_t iq4_xs_scales(const uint8_t *blk) {
    const uint64_t low = u32_at(blk + 4), high = (uint64_t)blk[2] | (uint64_t)blk[3] << 8;
    uint64_t v = 0;
    for (int j = 0; j < 8; j++) {
        const uint64_t ls = (low >> 4 * j & 15) | (high >> 2 * j & 3) << 4;
        v |= (uint64_t)(uint8_t)((int)ls - 32) << 8 * j;
    }
    return v;
}

/* Bytes (size 1) or u16s (size 2) k < 8 of the fields `bytes` apart at src, packed into
 * a u64 in registers (stored one by one and reloaded as a vector, they would wait on
 * store forwarding). */
ALWAYS_INLINE uint64_t gather8(const uint8_t *src, int bytes, const int size) {
    uint64_t v = 0;
    for (int k = 0; k < 8 / size; k++) {
        uint16_t h = 0;
        memcpy(&h, src + k * bytes, size);
        v |= (uint64_t)h << (8 * size * k);
    }
    return v;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* The f16 at p, as f32 (F16C: every family that includes this has it). */
ALWAYS_INLINE float f16_value(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* q8_block_quantize, eight values at a time with the same f32 operations; q's two
 * halves go to q0 and q1. */
static inline float q8_block_quantize_split(const float *x, int8_t *q0, int8_t *q1, int32_t *sum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int k = 0; k < 4; k++) {
        v[k] = _mm256_loadu_ps(x + 8 * k);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[k]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float d = _mm_cvtss_f32(m4) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    __m256i r[4];
    for (int k = 0; k < 4; k++) {
        const __m256 scaled = _mm256_mul_ps(v[k], _mm256_set1_ps(id));
        const __m256 mag = _mm256_andnot_ps(sign, scaled), whole = _mm256_floor_ps(mag);
        const __m256 twice = _mm256_mul_ps(_mm256_set1_ps(2.0f), _mm256_sub_ps(mag, whole));
        const __m256i n = _mm256_cvttps_epi32(_mm256_add_ps(whole, _mm256_floor_ps(twice)));
        /* the sign of scaled: negate where it is negative */
        r[k] = _mm256_sign_epi32(n, _mm256_or_si256(_mm256_castps_si256(scaled), _mm256_set1_epi32(1)));
    }
    /* int32 -> int8, values 0..31 in order */
    const __m256i w01 = _mm256_packs_epi32(r[0], r[1]), w23 = _mm256_packs_epi32(r[2], r[3]);
    const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23),
                                                  _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm_storeu_si128((__m128i *)q0, _mm256_castsi256_si128(b));
    _mm_storeu_si128((__m128i *)q1, _mm256_extracti128_si256(b, 1));
    const __m256i s16 = _mm256_maddubs_epi16(_mm256_set1_epi8(1), b);
    const __m256i s32 = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    *sum = _mm_cvtsi128_si32(t);
    return d;
}

ALWAYS_INLINE float reduce_128(__m128 s) {
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

/* A GGML Q4_K/Q5_K block's 6-bit scales (bytes 0..7) and mins (8..15), from its 12
 * bytes of scale fields, unpacked as get_scale_min_k4. */
ALWAYS_INLINE __m128i k_scale_bytes(const uint8_t *fields) {
    uint32_t u[3];
    memcpy(u, fields, 12);
    return _mm_setr_epi32((int)(u[0] & 0x3f3f3f3f),
                          (int)((u[2] & 0x0f0f0f0f) | ((u[0] >> 2) & 0x30303030)),
                          (int)(u[1] & 0x3f3f3f3f),
                          (int)(((u[2] >> 4) & 0x0f0f0f0f) | ((u[1] >> 2) & 0x30303030)));
}

/* The ternary types (TQ1_0: 54-byte blocks, TQ2_0: 66), whose weights are d (t - 1) for
 * trits t: a block's trits as u8 0..2, its 256 in x's order as 8 vectors of 32 (their
 * offset of 1 comes off each block's sum as the sum of its activation quants). */
#define TQ1_0_BYTES 54
#define TQ2_0_BYTES 66

/* TQ2_0 (qs[64], f16 d): weight 128h + 32l + k is bits 2l, 2l + 1 of qs[32h + k]. */
ALWAYS_INLINE void tq2_0_trits(const uint8_t *blk, __m256i u[8]) {
    for (int h = 0; h < 2; h++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 32 * h));
        for (int l = 0; l < 4; l++) u[4 * h + l] = _mm256_and_si256(_mm256_srli_epi16(v, 2 * l), _mm256_set1_epi8(3));
    }
}

/* (q * 3) >> 8 per byte: the leading trit of a byte that holds trits in base 3 (scaled to
 * 256 / 243), 1 from 86 on, 2 from 171 on */
ALWAYS_INLINE __m256i tq1_0_top_trit(__m256i q) {
    const __m256i one = _mm256_set1_epi8(1);
    return _mm256_add_epi8(_mm256_min_epu8(_mm256_subs_epu8(q, _mm256_set1_epi8(85)), one),
                           _mm256_min_epu8(_mm256_subs_epu8(q, _mm256_set1_epi8((char)170)), one));
}

/* q * 3 per byte, mod 256: the next trit to the top */
ALWAYS_INLINE __m256i times3(__m256i q) { return _mm256_add_epi8(_mm256_add_epi8(q, q), q); }

/* TQ1_0 (qs[48], qh[4], f16 d), as ggml's dequantize_row_tq1_0: weight 32l + m (l < 5)
 * is trit l of qs[m], 160 + 16l + m trit l of qs[32 + m], 240 + 4l + j trit l of qh[j]
 * (l < 4), trit l of byte q the top trit of q * 3^l mod 256. */
ALWAYS_INLINE void tq1_0_trits(const uint8_t *blk, __m256i u[8]) {
    __m256i q = _mm256_loadu_si256((const __m256i *)blk);
    for (int l = 0; l < 5; l++, q = times3(q)) u[l] = tq1_0_top_trit(q);
    /* qs[32..47] times 3^l for l < 5, in both halves */
    __m256i r[5];
    r[0] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(blk + 32)));
    for (int l = 1; l < 5; l++) r[l] = times3(r[l - 1]);
    /* qh times 3^l in dword l */
    __m128i h[4] = {_mm_set1_epi32((int)u32_at(blk + 48))};
    for (int l = 1; l < 4; l++) h[l] = _mm_add_epi8(_mm_add_epi8(h[l - 1], h[l - 1]), h[l - 1]);
    const __m128i hs = _mm_blend_epi32(_mm_blend_epi32(h[0], h[1], 2), _mm_blend_epi32(h[2], h[3], 8), 12);
    u[5] = tq1_0_top_trit(_mm256_blend_epi32(r[0], r[1], 0xF0));
    u[6] = tq1_0_top_trit(_mm256_blend_epi32(r[2], r[3], 0xF0));
    u[7] = tq1_0_top_trit(_mm256_inserti128_si256(r[4], hs, 1));
}

/* ---- The i-quants on grids (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) ----
 * A block's weights are its f16 d times a factor (1/8, 1/4 or 1) times an odd integer
 * scale per 16 or 32 weights times a signed grid value. iq_grid_block decodes a block's
 * 256 as those int8 values' sizes and signs (+-1), x's order, 8 vectors of 32 each (IQ2's
 * and IQ3's grids hold the sizes, their sign bits the signs), and its 16 scales, one per
 * 16 weights, returning d times the factor; the families then take the sizes against the
 * activation quants with the signs (as IQ4's, at most 62 * 127 per product) and the pair
 * sums times the scales in integers. IQ1_S's and IQ1_M's weights, grid values -1..1 plus
 * a delta of +-1/8, are 8 g +- 1 times 1/8. Layouts: iquants.h (the exact kernels'
 * dequantizers read the same fields). Both families' prompt tiles and the AVX2 matvec's
 * IQ3s decode with iq_grid_block; AVX-512's matvec decodes 64 weights a vector in
 * q8_avx512.c (grid_block), the AVX2 matvec the IQ2s and IQ1s 32 at a time in
 * q8_avx2.c (grid_group). */
#define IQ2_XXS_BYTES 66
#define IQ2_XS_BYTES 74
#define IQ2_S_BYTES 82
#define IQ3_XXS_BYTES 98
#define IQ3_S_BYTES 110
#define IQ1_S_BYTES 50
#define IQ1_M_BYTES 56

/* iquants.h's tables, which the family's kernel file holds (llmrun_iq_tables) */
extern __attribute__((visibility("hidden"))) const uint8_t *ksigns, *iq2xxs_grid, *iq2xs_grid,
    *iq2s_grid, *iq3xxs_grid, *iq3s_grid;
extern __attribute__((visibility("hidden"))) const int8_t *iq1s_grid;

ALWAYS_INLINE uint64_t grid_row(const void *grid, int index) {
    uint64_t v;
    memcpy(&v, (const uint8_t *)grid + 8 * index, 8);
    return v;
}

/* rows a, b, c, e of an 8-byte grid, in that order */
ALWAYS_INLINE __m256i grid8(const void *grid, int a, int b, int c, int e) {
    return _mm256_setr_epi64x((long long)grid_row(grid, a), (long long)grid_row(grid, b),
                              (long long)grid_row(grid, c), (long long)grid_row(grid, e));
}

/* rows of a 4-byte grid, two per 8 weights, by the indices in idx's dwords (one gather:
 * faster than eight loads put in place one by one) */
ALWAYS_INLINE __m256i grid4(const uint8_t *grid, __m256i idx) {
    return _mm256_i32gather_epi32((const int *)grid, idx, 4);
}

/* the 8 bytes at p, one a dword */
ALWAYS_INLINE __m256i bytes_epi32(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

/* Signs as vpsignb takes them, 8 bytes of +1, or -1 where bit j of the byte is set: by
 * sign byte, and by 7-bit index into ksigns (whose byte adds an eighth bit for even
 * parity), filled when the library loads. */
static uint64_t iq_signs[256], iq_ksigns[128];

__attribute__((constructor)) static void iq_sign_tables(void) {
    for (int b = 0; b < 256; b++) {
        uint64_t v = 0;
        for (int j = 0; j < 8; j++) v |= (uint64_t)(b >> j & 1 ? 0xFF : 0x01) << 8 * j;
        iq_signs[b] = v;
    }
    for (int i = 0; i < 128; i++) iq_ksigns[i] = iq_signs[i | (__builtin_popcount(i) & 1) << 7];
}

/* the signs of 4 sign bytes, in order */
ALWAYS_INLINE __m256i signs_of_bytes(uint32_t bytes) {
    return _mm256_setr_epi64x((long long)iq_signs[bytes & 255], (long long)iq_signs[bytes >> 8 & 255],
                              (long long)iq_signs[bytes >> 16 & 255], (long long)iq_signs[bytes >> 24]);
}

/* the signs of 4 7-bit ksigns indices, in order */
ALWAYS_INLINE __m256i signs_of_indices(int a, int b, int c, int e) {
    return _mm256_setr_epi64x((long long)iq_ksigns[a], (long long)iq_ksigns[b],
                              (long long)iq_ksigns[c], (long long)iq_ksigns[e]);
}

/* signs_of_indices of the 7-bit fields k < 4 of aux */
ALWAYS_INLINE __m256i signs_of_aux(uint32_t aux) {
    return signs_of_indices(aux & 127, aux >> 7 & 127, aux >> 14 & 127, aux >> 21 & 127);
}

/* IQ1's 8 g + delta (g -1, 0, 1 from the grid, delta +-1 per 8: bytes of deltas), as its
 * size and its sign (the value: never 0) */
ALWAYS_INLINE void iq1_values(__m256i g, __m256i deltas, __m256i *size, __m256i *sign) {
    *sign = _mm256_add_epi8(_mm256_sign_epi8(_mm256_set1_epi8(8), g), deltas);
    *size = _mm256_abs_epi8(*sign);
}

/* +1 in each of 8 bytes, or -1 where negative */
ALWAYS_INLINE long long iq1_delta8(int negative) {
    return negative ? -1LL : 0x0101010101010101LL;
}

ALWAYS_INLINE float iq_grid_block(const int type, const uint8_t *blk, __m256i size[8], __m256i sign[8],
                                  int16_t sc[16]) {
    switch (type) {
    case IQ2_XXS: /* per 32: 4 grid indices, then a u32 of 4 7-bit sign indices and the scale */
        for (int ib = 0; ib < 8; ib++) {
            const uint8_t *q = blk + 2 + 8 * ib;
            const uint32_t aux = u32_at(q + 4);
            size[ib] = grid8(iq2xxs_grid, q[0], q[1], q[2], q[3]);
            sign[ib] = signs_of_aux(aux);
            sc[2 * ib] = sc[2 * ib + 1] = (int16_t)(2 * (aux >> 28) + 1);
        }
        return f16_value(blk) * 0.125f;
    case IQ2_XS: { /* per 8: a u16 of a 9-bit grid index and a 7-bit sign index; scales per 16 */
        for (int ib = 0; ib < 8; ib++) {
            uint16_t q[4];
            memcpy(q, blk + 2 + 8 * ib, 8);
            size[ib] = grid8(iq2xs_grid, q[0] & 511, q[1] & 511, q[2] & 511, q[3] & 511);
            sign[ib] = signs_of_indices(q[0] >> 9, q[1] >> 9, q[2] >> 9, q[3] >> 9);
            sc[2 * ib] = (int16_t)(2 * (blk[66 + ib] & 15) + 1);
            sc[2 * ib + 1] = (int16_t)(2 * (blk[66 + ib] >> 4) + 1);
        }
        return f16_value(blk) * 0.125f;
    }
    case IQ2_S: { /* qs[32] (low 8 bits of the indices), signs[32], qh[8] (2 high bits each), scales[8] */
        const uint8_t *qs = blk + 2, *signs = blk + 34, *qh = blk + 66, *scales = blk + 74;
        for (int ib = 0; ib < 8; ib++) {
            int idx[4];
            for (int l = 0; l < 4; l++) idx[l] = qs[4 * ib + l] | (qh[ib] >> 2 * l & 3) << 8;
            size[ib] = grid8(iq2s_grid, idx[0], idx[1], idx[2], idx[3]);
            sign[ib] = signs_of_bytes(u32_at(signs + 4 * ib));
            sc[2 * ib] = (int16_t)(2 * (scales[ib] & 15) + 1);
            sc[2 * ib + 1] = (int16_t)(2 * (scales[ib] >> 4) + 1);
        }
        return f16_value(blk) * 0.125f;
    }
    case IQ3_XXS: /* per 32: 8 indices of 4-byte grid rows; u32s of sign indices and scale after */
        for (int ib = 0; ib < 8; ib++) {
            const uint8_t *q = blk + 2 + 8 * ib;
            const uint32_t aux = u32_at(blk + 66 + 4 * ib);
            size[ib] = grid4(iq3xxs_grid, bytes_epi32(q));
            sign[ib] = signs_of_aux(aux);
            sc[2 * ib] = sc[2 * ib + 1] = (int16_t)(2 * (aux >> 28) + 1);
        }
        return f16_value(blk) * 0.25f;
    case IQ3_S: { /* qs[64] (low 8 bits of the indices), qh[8] (bit 8), signs[32], scales[4] */
        const uint8_t *qs = blk + 2, *qh = blk + 66, *signs = blk + 74, *scales = blk + 106;
        const __m256i shifts = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        for (int ib = 0; ib < 8; ib++) {
            /* index j: qs[8 ib + j], plus 256 where bit j of qh[ib] is set */
            const __m256i high = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(qh[ib]), shifts), _mm256_set1_epi32(1));
            size[ib] = grid4(iq3s_grid, _mm256_or_si256(bytes_epi32(qs + 8 * ib), _mm256_slli_epi32(high, 8)));
            sign[ib] = signs_of_bytes(u32_at(signs + 4 * ib));
            sc[2 * ib] = sc[2 * ib + 1] = (int16_t)(2 * (scales[ib / 2] >> 4 * (ib % 2) & 15) + 1);
        }
        return f16_value(blk);
    }
    case IQ1_S: /* qs[32] (low 8 bits of the indices), per 32 a u16: 3 high bits per 8, scale, delta sign */
        for (int ib = 0; ib < 8; ib++) {
            const uint16_t h = (uint16_t)(blk[34 + 2 * ib] | blk[35 + 2 * ib] << 8);
            const uint8_t *q = blk + 2 + 4 * ib;
            const __m256i g = grid8(iq1s_grid, q[0] | (h & 7) << 8, q[1] | (h >> 3 & 7) << 8,
                                    q[2] | (h >> 6 & 7) << 8, q[3] | (h >> 9 & 7) << 8);
            iq1_values(g, _mm256_set1_epi64x(iq1_delta8(h >> 15)), size + ib, sign + ib);
            sc[2 * ib] = sc[2 * ib + 1] = (int16_t)(2 * (h >> 12 & 7) + 1);
        }
        return f16_value(blk) * 0.125f;
    default: { /* IQ1_M: qs[32], qh[16] (per 8: 3 high index bits, delta sign), u16 scales[4] (3 bits per 16; d in their top nibbles) */
        uint16_t s4[4];
        memcpy(s4, blk + 48, 8);
        const uint16_t bits = (uint16_t)((s4[0] >> 12) | ((s4[1] >> 8) & 0x00F0) |
                                         ((s4[2] >> 4) & 0x0F00) | (s4[3] & 0xF000));
        for (int ib = 0; ib < 8; ib++) {
            const int h0 = blk[32 + 2 * ib], h1 = blk[33 + 2 * ib];
            const uint8_t *q = blk + 4 * ib;
            const __m256i g = grid8(iq1s_grid, q[0] | (h0 & 7) << 8, q[1] | (h0 >> 4 & 7) << 8,
                                    q[2] | (h1 & 7) << 8, q[3] | (h1 >> 4 & 7) << 8);
            const __m256i deltas = _mm256_setr_epi64x(iq1_delta8(h0 >> 3 & 1), iq1_delta8(h0 >> 7),
                                                      iq1_delta8(h1 >> 3 & 1), iq1_delta8(h1 >> 7));
            iq1_values(g, deltas, size + ib, sign + ib);
            for (int k = 0; k < 2; k++) {
                const int j = 2 * ib + k;
                sc[j] = (int16_t)(2 * (s4[j / 4] >> 3 * (j % 4) & 7) + 1);
            }
        }
        return _cvtsh_ss(bits) * 0.125f;
    }
    }
}

/* 0 for the grid types until llmrun_iq_tables has handed their tables over, else 1 */
static inline int q8_ready(int type) {
    switch (type) {
    case IQ2_XXS: case IQ2_XS: case IQ2_S: case IQ3_XXS: case IQ3_S: case IQ1_S: case IQ1_M:
        return ksigns != NULL;
    default:
        return 1;
    }
}

/* The largest |value| iq_grid_block gives for the type (IQ2's grids hold 8, 25 and 43,
 * IQ3_XXS's 4 .. 62, IQ3_S's 1 .. 15) */
ALWAYS_INLINE int iq_grid_largest(const int type) {
    switch (type) {
    case IQ3_XXS: return 62;
    case IQ3_S: return 15;
    case IQ1_S: case IQ1_M: return 9;
    default: return 43;
    }
}

ALWAYS_INLINE int iq_grid_bytes(const int type) {
    switch (type) {
    case IQ2_XXS: return IQ2_XXS_BYTES;
    case IQ2_XS: return IQ2_XS_BYTES;
    case IQ2_S: return IQ2_S_BYTES;
    case IQ3_XXS: return IQ3_XXS_BYTES;
    case IQ3_S: return IQ3_S_BYTES;
    case IQ1_S: return IQ1_S_BYTES;
    default: return IQ1_M_BYTES;
    }
}

/* q8k_block_quantize_ref, eight values at a time with the same f32 operations (the
 * first value of largest magnitude found by a compare per vector; vcvtps2dq rounds
 * half to even as nearest_int does). */
static inline float q8k_block_quantize(const float *x, int8_t *q, int16_t sums16[16]) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax8 = _mm256_setzero_ps();
    for (int k = 0; k < 32; k++) amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * k)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    if (amax == 0.0f) {
        memset(q, 0, 256);
        memset(sums16, 0, 32);
        return 0.0f;
    }
    float max = 0.0f;
    for (int k = 0; k < 32; k++) {
        const __m256 abs = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * k));
        const int hits = _mm256_movemask_ps(_mm256_cmp_ps(abs, _mm256_set1_ps(amax), _CMP_EQ_OQ));
        if (hits) {
            max = x[8 * k + __builtin_ctz((unsigned)hits)];
            break;
        }
    }
    const float iscale = -127.0f / max;
    const __m256 scale = _mm256_set1_ps(iscale);
    for (int g = 0; g < 8; g++) { /* 32 values */
        __m256i r[4];
        for (int k = 0; k < 4; k++)
            r[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 32 * g + 8 * k), scale));
        const __m256i w01 = _mm256_packs_epi32(r[0], r[1]), w23 = _mm256_packs_epi32(r[2], r[3]);
        const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23),
                                                      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + 32 * g), b);
        /* per 8 bytes, the sum of q + 128 */
        const __m256i sad = _mm256_sad_epu8(_mm256_xor_si256(b, _mm256_set1_epi8((char)0x80)),
                                            _mm256_setzero_si256());
        int64_t e[4];
        _mm256_storeu_si256((__m256i *)e, sad);
        sums16[2 * g] = (int16_t)(e[0] + e[1] - 16 * 128);
        sums16[2 * g + 1] = (int16_t)(e[2] + e[3] - 16 * 128);
    }
    return 1.0f / iscale;
}
#else
static inline float q8_block_quantize_split(const float *x, int8_t *q0, int8_t *q1, int32_t *sum) {
    int8_t q[32];
    const float d = q8_block_quantize(x, q, sum);
    memcpy(q0, q, 16);
    memcpy(q1, q + 16, 16);
    return d;
}

static inline float q8k_block_quantize(const float *x, int8_t *q, int16_t sums16[16]) {
    return q8k_block_quantize_ref(x, q, sums16);
}
#endif

/* x [m, n] (n a multiple of 256, rows x_step floats apart) as Q8_K rows into a, for
 * ORDER_Q8_K or ORDER_Q8_K_PAIRS. */
static inline void q8k_quantize_rows(const float *x, int64_t x_step, int64_t m, int64_t n,
                                     int order, act_t *a) {
    for (int64_t i = 0; i < m; i++) {
        int8_t *q = a->q + i * a->q_step;
        int16_t *s16 = (int16_t *)(a->lane + i * a->lane_step), *s32 = s16 + n / 16;
        for (int64_t b = 0; b < n / 256; b++) {
            int8_t sorted[256];
            int8_t *qb = order == ORDER_Q8_K ? q + 256 * b : sorted;
            a->d[i * a->d_step + b] = q8k_block_quantize(x + i * x_step + 256 * b, qb, s16 + 16 * b);
            if (order == ORDER_Q8_K_PAIRS)
                for (int s = 0; s < 8; s++) memcpy(q + q8_place(order, 8 * b + s, 0), sorted + 32 * s, 32);
            for (int s = 0; s < 8; s++) s32[8 * b + s] = (int16_t)(s16[16 * b + 2 * s] + s16[16 * b + 2 * s + 1]);
        }
    }
}

/* lane[k] = -offset times the sum of quants 4k .. 4k + 3 at p (plus those at p2, if not
 * NULL), for k < 8. */
static inline void q8_lane_sums(const int8_t *p, const int8_t *p2, int offset, int32_t *lane) {
#if defined(__AVX2__)
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    __m256i sum = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, _mm256_loadu_si256((const __m256i *)p)), ones16);
    if (p2)
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, _mm256_loadu_si256((const __m256i *)p2)), ones16));
    _mm256_storeu_si256((__m256i *)lane, _mm256_mullo_epi32(sum, _mm256_set1_epi32(-offset)));
#else
    for (int k = 0; k < 8; k++) {
        int32_t sum = p[4 * k] + p[4 * k + 1] + p[4 * k + 2] + p[4 * k + 3];
        if (p2) sum += p2[4 * k] + p2[4 * k + 1] + p2[4 * k + 2] + p2[4 * k + 3];
        lane[k] = -offset * sum;
    }
#endif
}

/* x [m, n] (rows x_step floats apart) -> a (buffers from q8_alloc) for a layout of
 * `order` whose u8 weights are q_w + offset. */
static inline void q8_quantize_rows(const float *x, int64_t x_step, int64_t m, int64_t n,
                                    int order, int offset, act_t *a) {
    if (q8_is_k(order)) {
        q8k_quantize_rows(x, x_step, m, n, order, a);
        return;
    }
    const int64_t nb = n / 32, lanes = order == ORDER_QUADS ? n / 8 : n / 4;
    for (int64_t i = 0; i < m; i++) {
        int8_t *q = a->q + i * a->q_step;
        float *d = a->d + i * a->d_step, *s = a->s + i * a->d_step;
        for (int64_t b = 0; b < nb; b++) {
            int32_t sum;
            d[b] = q8_f16(q8_block_quantize_split(x + i * x_step + 32 * b, q + q8_half_place(order, b, 0),
                                                  q + q8_half_place(order, b, 1), &sum));
            s[b] = d[b] * (float)sum;
        }
        int32_t *lane = a->lane + i * a->lane_step;
        float *dq = a->dq + i * a->lane_step;
        int64_t l = 0;
        if (order == ORDER_NATURAL) /* a block's 8 lanes at a time */
            for (; l + 8 <= lanes; l += 8) {
                q8_lane_sums(q + 4 * l, NULL, offset, lane + l);
                for (int k = 0; k < 8; k++) dq[l + k] = d[l / 8];
            }
        else if (order == ORDER_QUADS) /* a whole quad's 16 at a time */
            for (; l + 16 <= lanes; l += 16) {
                const int8_t *p = q + 8 * l;
                q8_lane_sums(p, p + 64, offset, lane + l);
                q8_lane_sums(p + 32, p + 96, offset, lane + l + 8);
                for (int k = 0; k < 16; k++) dq[l + k] = d[l / 4 + k / 4];
            }
        for (; l < lanes; l++) {
            /* ORDER_QUADS: lane l of the low and the high half of its 128 */
            const int8_t *p = order == ORDER_QUADS ? q + 128 * (l / 16) + 4 * (l % 16) : q + 4 * l;
            int32_t sum = p[0] + p[1] + p[2] + p[3];
            if (order == ORDER_QUADS) sum += p[64] + p[65] + p[66] + p[67];
            lane[l] = -offset * sum;
            dq[l] = d[q8_lane_block(order, l)];
        }
        /* the lanes of a vector past the row's last block (a short last quad, an odd
         * Q8_0 block) meet weight scales of 0: zeros here, whatever the buffer held */
        for (int64_t l = lanes; l < (lanes + 15) / 16 * 16 && l < a->lane_step; l++)
            lane[l] = 0, dq[l] = 0.0f;
    }
}

/* x [m, n], contiguous -> a, as q8_quantize_rows. */
static inline void q8_quantize(const float *x, int64_t m, int64_t n, int order, int offset,
                               act_t *a) {
    q8_quantize_rows(x, n, m, n, order, offset, a);
}

/* Buffers for m rows of n (zero padded to whole 128s: ORDER_QUADS's last four blocks may
 * be fewer), in one allocation: a->q is what to free; NULL if it failed. */
static inline void *q8_alloc(int64_t m, int64_t n, act_t *a) {
    a->n = n;
    a->q_step = (n + 127) / 128 * 128;
    a->lane_step = a->q_step / 4;
    a->d_step = a->q_step / 32;
    const size_t bytes = (size_t)(m * (a->q_step + 8 * a->lane_step + 8 * a->d_step)) + 64;
    uint8_t *p = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (p == NULL) return NULL;
    memset(p, 0, bytes);
    a->q = (int8_t *)p;
    a->lane = (int32_t *)(p + m * a->q_step);
    a->dq = (float *)(a->lane + m * a->lane_step);
    a->d = a->dq + m * a->lane_step;
    a->s = a->d + m * a->d_step;
    return p;
}

#if defined(__AVX2__) && defined(__FMA__) /* every family that includes this has AVX2 */
/* ---- A prompt's rows (many activation rows): a GEMM on tiles of weights ----
 *
 * The matvec kernels decode each run of weights once for up to 8 activation rows, then
 * spend a scale, a conversion and a multiply-add per row and block; with a prompt's
 * hundreds of rows that float work is most of the time. A family's GEMM (its
 * llmrun_gemm_q8, through q8_gemm below) first decodes a tile of TILE weight rows once
 * into u8 quants (w = a q + c per half-block of 16, a the scale, c the offset's
 * coefficient: Q4_0's -8 d, a K-quant's -dmin m, ...), laid out as 4 consecutive quants
 * of each of the tile's rows per dword lane, so one vector load meets 4 quants of one
 * activation row (broadcast) for many weight rows at once. The integer sums cover a
 * block of 32 (two for Q6_K's halves of 16 with their own scales) before one
 * conversion and multiply-add per vector of outputs; the offsets meet each activation
 * block's sum (d_x times the sum of its quants). */

/* A prompt's rows, quantized as q8_block_quantize (K-quants: q8k_block_quantize, each
 * block of 32 with its 256's d): q [m, n] in order, d [m, nb], and per block d times
 * the sum of the quants of its halves (s2 [m, nb, 2]) and of all of it (s [m, nb]). */
typedef struct {
    int8_t *q;
    float *d, *s, *s2;
    int64_t m, n, nb;
} prompt_t;

/* A family's pass of all m activation rows over one decoded tile (q, a, c as
 * q8_fill_tile writes them) into y[i, r0 + j] for j < nr (+ bias). */
typedef void (*gemm_tile_fn)(int type, const uint8_t *q, const float *a, const float *c,
                             const prompt_t *x, float *y, int64_t ldy, int64_t r0, int64_t nr,
                             const float *bias);

/* 0x10 in byte k where bit k of bits is set */
static inline __m256i bit4_bytes(uint32_t bits) {
    const __m256i select = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                              0x0303030303030303LL);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i b = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), select), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(b, bit), _mm256_set1_epi8(16));
}

/* (v >> k) & mask in each byte, for a k known only at run time */
static inline __m256i q8_bits_at(__m256i v, int k, int mask) {
    return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(k)), _mm256_set1_epi8((char)mask));
}

/* The 6-bit scale and min of sub-block j from a K-quant block's 12 scale bytes, byte k
 * at sc[step * k] (GGML's: step 1; kernels.pack's groups: the group's block count). */
static inline void k_scale_min(const uint8_t *sc, int64_t step, int j, int *scale, int *min) {
#define SC(k) sc[step * (k)]
    if (j < 4) *scale = SC(j) & 63, *min = SC(j + 4) & 63;
    else *scale = (SC(j + 4) & 15) | ((SC(j - 4) >> 6) << 4), *min = (SC(j + 4) >> 4) | ((SC(j) >> 6) << 4);
#undef SC
}

/* One weight row as quants in order (q[n]) and each half-block's a and c ([2 nb]): u8
 * values, except Q8_0's and the i-quants' and ternary types' with `q8_signed` (their s8
 * values as they are, c 0: for a family whose u8 x s8 products saturate past 2 * 128 *
 * 127). 0, or -1 for a type without a decoder here. */
static inline int q8_decode_row(int type, const uint8_t *row, int64_t n, uint8_t *q, float *a,
                                float *c, int q8_signed) {
    const int64_t nb = n / 32;
    const __m128i low4 = _mm_set1_epi8(15);
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *qb = q + 32 * b;
        float d, off;
        switch (type) {
        case Q4_0: case Q4_0_PACKED: case Q5_0: case Q5_0_PACKED: {
            const int five = type == Q5_0 || type == Q5_0_PACKED;
            const uint8_t *qs;
            uint32_t qh = 0;
            if (type == Q4_0) d = f16_value(row + 18 * b), qs = row + 18 * b + 2;
            else if (type == Q5_0) d = f16_value(row + 22 * b), qh = u32_at(row + 22 * b + 2), qs = row + 22 * b + 6;
            else if (type == Q4_0_PACKED) d = f16_value(row + 2 * b), qs = row + 2 * nb + 16 * b;
            else d = f16_value(row + 2 * b), qh = u32_at(row + 2 * nb + 4 * b), qs = row + 6 * nb + 16 * b;
            const __m128i v = _mm_loadu_si128((const __m128i *)qs);
            const __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
            __m256i t = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
            if (five) t = _mm256_or_si256(t, bit4_bytes(qh)); /* bit j of qh: weight j's fifth bit */
            _mm256_storeu_si256((__m256i *)qb, t);
            off = five ? -16.0f * d : -8.0f * d;
            break;
        }
        case Q8_0: case Q8_0_PACKED: {
            const uint8_t *qs = type == Q8_0 ? row + 34 * b + 2 : row + 2 * nb + 32 * b;
            d = f16_value(type == Q8_0 ? row + 34 * b : row + 2 * b);
            const __m256i v = _mm256_loadu_si256((const __m256i *)qs);
            _mm256_storeu_si256((__m256i *)qb, q8_signed ? v : _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)));
            off = q8_signed ? 0.0f : -128.0f * d;
            break;
        }
        case IQ4_NL: case IQ4_XS: {
            /* IQ4_XS: sub-block j of block b / 8, its scale d (ls_j - 32) */
            const uint8_t *blk = row + (type == IQ4_NL ? IQ4_NL_BYTES * b : IQ4_XS_BYTES * (b / 8));
            const uint8_t *qs = type == IQ4_NL ? blk + 2 : blk + 8 + 16 * (b % 8);
            d = f16_value(blk);
            if (type == IQ4_XS) d *= (float)(int8_t)(iq4_xs_scales(blk) >> 8 * (b % 8));
            const __m128i values = _mm_add_epi8(_mm_loadu_si128((const __m128i *)IQ4_NL_VALUES),
                                                _mm_set1_epi8(q8_signed ? 0 : (char)0x80));
            const __m128i v = _mm_loadu_si128((const __m128i *)qs);
            _mm_storeu_si128((__m128i *)qb, _mm_shuffle_epi8(values, _mm_and_si128(v, low4)));
            _mm_storeu_si128((__m128i *)(qb + 16), _mm_shuffle_epi8(values, _mm_and_si128(_mm_srli_epi16(v, 4), low4)));
            off = q8_signed ? 0.0f : -128.0f * d;
            break;
        }
        case IQ2_XXS: case IQ2_XS: case IQ2_S: case IQ3_XXS: case IQ3_S: case IQ1_S: case IQ1_M:
        case TQ1_0: case TQ2_0: {
            /* a whole block of 256 at its first 32: its values (trits less 1), a scale per 16;
             * unsigned, the values plus their largest size (a small offset, whose part
             * cancels in floats, the smaller the less rounding) */
            if (b % 8) continue;
            __m256i v[8];
            int16_t sc[16];
            float f;
            const int offset = type == TQ1_0 || type == TQ2_0 ? 1 : iq_grid_largest(type);
            if (type == TQ1_0 || type == TQ2_0) {
                const uint8_t *blk = row + (type == TQ1_0 ? TQ1_0_BYTES : TQ2_0_BYTES) * (b / 8);
                if (type == TQ1_0) tq1_0_trits(blk, v);
                else tq2_0_trits(blk, v);
                for (int k = 0; k < 8; k++) v[k] = _mm256_sub_epi8(v[k], _mm256_set1_epi8(1));
                for (int j = 0; j < 16; j++) sc[j] = 1;
                f = f16_value(blk + (type == TQ1_0 ? TQ1_0_BYTES : TQ2_0_BYTES) - 2);
            } else {
                __m256i size[8], sign[8];
                f = iq_grid_block(type, row + iq_grid_bytes(type) * (b / 8), size, sign, sc);
                for (int k = 0; k < 8; k++) v[k] = _mm256_sign_epi8(size[k], sign[k]);
            }
            for (int k = 0; k < 8; k++)
                _mm256_storeu_si256((__m256i *)(qb + 32 * k),
                                    q8_signed ? v[k] : _mm256_add_epi8(v[k], _mm256_set1_epi8((char)offset)));
            for (int j = 0; j < 16; j++) {
                a[2 * b + j] = f * (float)sc[j];
                c[2 * b + j] = q8_signed ? 0.0f : -(float)offset * a[2 * b + j];
            }
            continue;
        }
        case MXFP4: {
            d = e8m0_half(row[17 * b]);
            const __m128i values = _mm_add_epi8(_mm_loadu_si128((const __m128i *)MXFP4_VALUES), _mm_set1_epi8(12));
            const __m128i v = _mm_loadu_si128((const __m128i *)(row + 17 * b + 1));
            _mm_storeu_si128((__m128i *)qb, _mm_shuffle_epi8(values, _mm_and_si128(v, low4)));
            _mm_storeu_si128((__m128i *)(qb + 16), _mm_shuffle_epi8(values, _mm_and_si128(_mm_srli_epi16(v, 4), low4)));
            off = -12.0f * d;
            break;
        }
        case Q4_K: case Q5_K: {
            /* sub-block j of super-block b / 8: (d sc_j) q - dmin m_j */
            const int five = type == Q5_K, j = (int)(b % 8);
            const uint8_t *blk = row + (b / 8) * (five ? 176 : 144);
            int scale, min;
            k_scale_min(blk + 4, 1, j, &scale, &min);
            const uint8_t *quants = blk + (five ? 48 : 16) + 32 * (j / 2);
            __m256i t = q8_bits_at(_mm256_loadu_si256((const __m256i *)quants), 4 * (j % 2), 15);
            if (five) { /* bit j of qh[l]: weight l's fifth bit */
                const __m256i h = q8_bits_at(_mm256_loadu_si256((const __m256i *)(blk + 16)), j, 1);
                t = _mm256_or_si256(t, _mm256_slli_epi16(h, 4));
            }
            _mm256_storeu_si256((__m256i *)qb, t);
            d = f16_value(blk) * (float)scale;
            off = -(f16_value(blk + 2) * (float)min);
            break;
        }
        case Q4_K_PACKED: case Q5_K_PACKED: {
            /* kernels.pack's layout (layout.c): the row's d's, dmin's, scale fields (by
             * groups of K_GROUP super-blocks), Q5_K's high-bit masks, then the quants,
             * byte 64h + 4i + s holding weights i (low nibble) and 16 + i (high) of
             * sub-block 4h + s */
            const int five = type == Q5_K_PACKED, j = (int)(b % 8), s = j % 4;
            const int64_t blocks = nb / 8, sb = b / 8, first = sb - sb % K_GROUP;
            const int64_t group = blocks - first < K_GROUP ? blocks - first : K_GROUP;
            int scale, min;
            k_scale_min(row + 4 * blocks + 12 * first + (sb - first), group, j, &scale, &min);
            const uint8_t *quants = row + (five ? 48 : 16) * blocks + 128 * sb + 64 * (j / 4);
            /* byte s of each of the 16 words: four from each 16-byte load */
            const __m128i pick = _mm_add_epi8(
                _mm_setr_epi8(0, 4, 8, 12, -128, -128, -128, -128, -128, -128, -128, -128, -128,
                              -128, -128, -128),
                _mm_set1_epi8((char)s));
            __m128i part[4];
            for (int k = 0; k < 4; k++)
                part[k] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(quants + 16 * k)), pick);
            const __m128i v = _mm_unpacklo_epi64(_mm_unpacklo_epi32(part[0], part[1]),
                                                 _mm_unpacklo_epi32(part[2], part[3]));
            const __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
            __m256i t = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
            if (five) /* bit w of the sub-block's word: weight w's fifth bit */
                t = _mm256_or_si256(t, bit4_bytes(u32_at(row + 16 * blocks + 32 * sb + 4 * j)));
            _mm256_storeu_si256((__m256i *)qb, t);
            d = f16_value(row + 2 * sb) * (float)scale;
            off = -(f16_value(row + 2 * blocks + 2 * sb) * (float)min);
            break;
        }
        case Q6_K: { /* weight 32t + l of half h: ql nibble and 2 bits of qh; -32 */
            const uint8_t *blk = row + (b / 8) * 210;
            const int h = (int)(b % 8) / 4, t = (int)(b % 4);
            const uint8_t *ql = blk + 64 * h + 32 * (t % 2), *qh = blk + 128 + 32 * h;
            const __m256i lq = q8_bits_at(_mm256_loadu_si256((const __m256i *)ql), 4 * (t / 2), 15);
            const __m256i hq = q8_bits_at(_mm256_loadu_si256((const __m256i *)qh), 2 * t, 3);
            _mm256_storeu_si256((__m256i *)qb, _mm256_or_si256(lq, _mm256_slli_epi16(hq, 4)));
            const float dd = f16_value(blk + 208);
            const int8_t *scales = (const int8_t *)blk + 192 + 2 * (b % 8);
            a[2 * b] = dd * (float)scales[0], a[2 * b + 1] = dd * (float)scales[1];
            c[2 * b] = -32.0f * a[2 * b], c[2 * b + 1] = -32.0f * a[2 * b + 1];
            continue;
        }
        default:
            return -1;
        }
        a[2 * b] = a[2 * b + 1] = d;
        c[2 * b] = c[2 * b + 1] = off;
    }
    return 0;
}

/* Rows r0 .. r0 + nr - 1 (nr <= tile) into the tile: q [nb][8][tile][4] (rows past nr
 * zero), a and c [nb][2][tile]; rows is scratch for tile rows of n, ra and rc for their
 * [2 nb] a and c. */
static inline int q8_fill_tile(int type, const uint8_t *w, int64_t stride, int64_t r0, int64_t nr,
                               int64_t n, int tile, int q8_signed, uint8_t *rows, float *ra,
                               float *rc, uint8_t *q, float *a, float *c) {
    const int64_t nb = n / 32;
    for (int64_t r = 0; r < tile; r++) {
        if (r < nr) {
            if (q8_decode_row(type, w + (r0 + r) * stride, n, rows + r * n, ra + r * 2 * nb,
                              rc + r * 2 * nb, q8_signed))
                return -1;
        } else {
            memset(rows + r * n, 0, (size_t)n);
            memset(ra + r * 2 * nb, 0, sizeof(float) * (size_t)(2 * nb));
            memset(rc + r * 2 * nb, 0, sizeof(float) * (size_t)(2 * nb));
        }
    }
    uint32_t *q32 = (uint32_t *)q;
    for (int64_t g = 0; g < n / 4; g++) /* 4 quants of every row: dword g of each */
        for (int64_t r = 0; r < tile; r++) q32[g * tile + r] = u32_at(rows + r * n + 4 * g);
    for (int64_t b = 0; b < 2 * nb; b++)
        for (int64_t r = 0; r < tile; r++) {
            a[b * tile + r] = ra[r * 2 * nb + b];
            c[b * tile + r] = rc[r * 2 * nb + b];
        }
    return 0;
}

/* y [m, rows] = x [m, n] W^T (+ bias) with x quantized to Q8_0 rows (K-quants: Q8_K), tile rows of W at a
 * time through the family's pass: 0, or -1 for a type the tiles cannot take (or memory
 * running out); the caller then takes the matvec. */
static inline int q8_gemm(int type, const uint8_t *w, int64_t stride, int64_t rows, const float *x,
                          int64_t m, int64_t n, float *y, const float *bias, int tile,
                          int q8_signed, gemm_tile_fn pass) {
    /* the types in blocks of 256 (K-quants, i-quants but IQ4_NL, ternary) take their rows as
     * Q8_K blocks: each block of 32 takes its 256's scale */
    int k_quant = 0;
    if (!q8_ready(type)) return -1;
    switch (type) { /* the types q8_decode_row takes, in rows it takes */
    case Q4_0: case Q5_0: case Q8_0: case Q8_0_PACKED: case MXFP4: case IQ4_NL:
        if (n % 32) return -1;
        break;
    case Q4_0_PACKED: case Q5_0_PACKED:
        if (n % 128) return -1;
        break;
    case Q4_K: case Q5_K: case Q6_K: case Q4_K_PACKED: case Q5_K_PACKED: case IQ4_XS:
    case IQ2_XXS: case IQ2_XS: case IQ2_S: case IQ3_XXS: case IQ3_S: case IQ1_S: case IQ1_M:
    case TQ1_0: case TQ2_0:
        if (n % 256) return -1;
        k_quant = 1;
        break;
    default:
        return -1;
    }
    const int64_t nb = n / 32;
    prompt_t p = {.m = m, .n = n, .nb = nb};
    p.q = malloc((size_t)(m * n));
    p.d = malloc(sizeof(float) * (size_t)(4 * m * nb));
    if (p.q == NULL || p.d == NULL) {
        free(p.q), free(p.d);
        return -1;
    }
    p.s = p.d + m * nb, p.s2 = p.s + m * nb;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < m; i++)
        for (int64_t b = 0; k_quant && b < nb; b += 8) {
            int16_t s16[16];
            const float d = q8k_block_quantize(x + i * n + 32 * b, p.q + i * n + 32 * b, s16);
            for (int s = 0; s < 8; s++) {
                const int64_t at = i * nb + b + s;
                p.d[at] = d;
                p.s[at] = d * (float)(s16[2 * s] + s16[2 * s + 1]);
                p.s2[2 * at] = d * (float)s16[2 * s];
                p.s2[2 * at + 1] = d * (float)s16[2 * s + 1];
            }
        }
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < m; i++)
        for (int64_t b = 0; !k_quant && b < nb; b++) {
            int8_t *qb = p.q + i * n + 32 * b;
            int32_t sum;
            const float d = q8_f16(q8_block_quantize_split(x + i * n + 32 * b, qb, qb + 16, &sum));
            int32_t lo = 0;
            for (int j = 0; j < 16; j++) lo += qb[j];
            p.d[i * nb + b] = d;
            p.s[i * nb + b] = d * (float)sum;
            p.s2[2 * (i * nb + b)] = d * (float)lo;
            p.s2[2 * (i * nb + b) + 1] = d * (float)(sum - lo);
        }
    int failed = 0;
#pragma omp parallel
    {
        uint8_t *rows_buf = malloc((size_t)(tile * n) * 2);
        float *f = malloc(sizeof(float) * (size_t)(8 * tile * nb));
        if (rows_buf == NULL || f == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        uint8_t *tq = rows_buf + tile * n;
        float *ra = f, *rc = f + 2 * tile * nb, *ta = f + 4 * tile * nb, *tc = f + 6 * tile * nb;
#pragma omp for schedule(dynamic)
        for (int64_t r0 = 0; r0 < rows; r0 += tile) {
            if (rows_buf == NULL || f == NULL) continue;
            const int64_t nr = rows - r0 < tile ? rows - r0 : tile;
            if (q8_fill_tile(type, w, stride, r0, nr, n, tile, q8_signed, rows_buf, ra, rc, tq, ta, tc)) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            pass(type, tq, ta, tc, &p, y, rows, r0, nr, bias);
        }
        free(rows_buf);
        free(f);
    }
    free(p.q), free(p.d);
    return failed ? -1 : 0;
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* ---- Packed Q4_0 and Q5_0 in 256-bit vectors, for both families ---- */

/* u8 weights lo and hi against activation quants xlo and xhi, added to start per dword
 * lane: in vpdpbusd where the CPU has it for 256 bits (AVX-512 VNNI), else vpmaddubsw
 * (pair sums added in 16 bits, at most 2 * 2 * 31 * 127) and vpmaddwd. */
ALWAYS_INLINE __m256i q8_dot2_256(__m256i start, __m256i lo, __m256i xlo, __m256i hi, __m256i xhi) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(start, lo, xlo), hi, xhi);
#else
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
    return _mm256_add_epi32(start, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

/* rows_q8_packed_256 (below) for one activation row, two weight rows at a time: the
 * activations' loads serve both, and each row's sum is a chain of its own (Zen 4, one
 * thread, from the caches: 23.0 -> 28.0 GB/s). Its own function, not a row count in
 * the other: gcc then loads the activations once for both rows (folded into one, it
 * lost 5 % of that). */
ALWAYS_INLINE void rows_q8_packed_256_pair(const uint8_t *w, int64_t stride, int64_t r,
                                           const uint8_t *end, const act_t *a, int64_t i0,
                                           float *y, const float *bias, const int five) {
    const int64_t n = a->n, nb = n / 32, ng = nb / 4, group = stride / ng;
    const __m256i pair01 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const __m256i pair23 = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
    const __m256i nibble = _mm256_set1_epi8(15);
    const int8_t *xq = a->q + i0 * a->q_step;
    const int32_t *lane = a->lane + i0 * a->lane_step;
    const float *dq = a->dq + i0 * a->lane_step;
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t g = 0; g < ng; g++) {
        __m256i x[4], start[2];
        __m256 dx[2];
        for (int h = 0; h < 2; h++) {
            x[2 * h] = _mm256_loadu_si256((const __m256i *)(xq + 128 * g + 32 * h));
            x[2 * h + 1] = _mm256_loadu_si256((const __m256i *)(xq + 128 * g + 64 + 32 * h));
            start[h] = _mm256_loadu_si256((const __m256i *)(lane + 16 * g + 8 * h));
            dx[h] = _mm256_loadu_ps(dq + 16 * g + 8 * h);
        }
        /* both rows' bytes, at their pace, from the second row's start on */
        const uint8_t *ahead = w + (r + 1) * stride + PREFETCH + 2 * group * g;
        if (ahead + 2 * group <= end) {
            _mm_prefetch((const char *)ahead, _MM_HINT_T0);
            _mm_prefetch((const char *)ahead + group, _MM_HINT_T0);
            _mm_prefetch((const char *)ahead + 2 * group - 1, _MM_HINT_T0);
        }
        for (int k = 0; k < 2; k++) {
            const uint8_t *row = w + (r + k) * stride, *qh = row + 2 * nb;
            const uint8_t *qs = row + (five ? 6 : 2) * nb;
            const __m128 d4 = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(row + 8 * g)));
            const __m256 dw[2] = {_mm256_permutevar8x32_ps(_mm256_castps128_ps256(d4), pair01),
                                  _mm256_permutevar8x32_ps(_mm256_castps128_ps256(d4), pair23)};
            for (int h = 0; h < 2; h++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 64 * g + 32 * h));
                __m256i lo = _mm256_and_si256(v, nibble);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
                if (five) {
                    const uint32_t q0 = u32_at(qh + 16 * g + 8 * h), q1 = u32_at(qh + 16 * g + 8 * h + 4);
                    lo = _mm256_or_si256(lo, bit4_bytes((q0 & 0xFFFF) | q1 << 16));
                    hi = _mm256_or_si256(hi, bit4_bytes(q0 >> 16 | (q1 & 0xFFFF0000u)));
                }
                const __m256i sum = q8_dot2_256(start[h], lo, x[2 * h], hi, x[2 * h + 1]);
                acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(dw[h], dx[h]), acc[k]);
            }
        }
    }
    for (int k = 0; k < 2; k++) {
        const __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[k]), _mm256_extractf128_ps(acc[k], 1));
        const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
        y[r + k] = _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t))) + (bias ? bias[r + k] : 0.0f);
    }
}

/* Packed Q4_0 (five 0) and Q5_0 (five 1), the kernels' layout (scales, high-bit words,
 * 16-byte quants per block), four blocks at a time as two 32-byte loads: the low
 * nibbles of the pair hold their weights 0..15, the high nibbles 16..31, in
 * ORDER_QUADS; the weights' offset (8 or 16) is in the lanes' start. The AVX2 family's
 * kernel, and AVX-512's for Q4_0 with VNNI: on Zen 4 these 256-bit loads stream from
 * memory faster than 512-bit loads (22.3-22.7 -> 24.9-25.2 GB/s with 2 threads,
 * benchmarks/kernel_ab.py). */
ALWAYS_INLINE void rows_q8_packed_256(const uint8_t *w, int64_t stride, int64_t r0, int64_t r1,
                                      const act_t *a, int64_t i0, const int m, float *y,
                                      int64_t ldy, const float *bias, const int five) {
    const int64_t n = a->n, nb = n / 32, ng = nb / 4, group = stride / ng; /* bytes of 4 blocks */
    const __m256i pair01 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const __m256i pair23 = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
    const __m256i nibble = _mm256_set1_epi8(15);
    const uint8_t *end = w + r1 * stride;
    int64_t r = r0;
    if (m == 1)
        for (; r + 1 < r1; r += 2) rows_q8_packed_256_pair(w, stride, r, end, a, i0, y, bias, five);
    for (; r < r1; r++) {
        const uint8_t *row = w + r * stride, *qh = row + 2 * nb;
        const uint8_t *qs = row + (five ? 6 : 2) * nb;
        __m256 acc[MAX_M];
        for (int i = 0; i < m; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t g = 0; g < ng; g++) {
            /* at the row's pace through all its bytes (scales and high bits too), so the
             * rows ahead come in whole */
            const uint8_t *ahead = row + PREFETCH + group * g;
            if (ahead + group <= end) {
                _mm_prefetch((const char *)ahead, _MM_HINT_T0);
                _mm_prefetch((const char *)ahead + group - 1, _MM_HINT_T0);
            }
            __m256i lo[2], hi[2];
            for (int h = 0; h < 2; h++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 64 * g + 32 * h));
                lo[h] = _mm256_and_si256(v, nibble);
                hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
                if (five) {
                    /* bit j of a block's word: its weight j; low nibbles take bits 0..15 */
                    const uint32_t q0 = u32_at(qh + 16 * g + 8 * h), q1 = u32_at(qh + 16 * g + 8 * h + 4);
                    lo[h] = _mm256_or_si256(lo[h], bit4_bytes((q0 & 0xFFFF) | q1 << 16));
                    hi[h] = _mm256_or_si256(hi[h], bit4_bytes(q0 >> 16 | (q1 & 0xFFFF0000u)));
                }
            }
            const __m128 d4 = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(row + 8 * g)));
            const __m256 dw[2] = {_mm256_permutevar8x32_ps(_mm256_castps128_ps256(d4), pair01),
                                  _mm256_permutevar8x32_ps(_mm256_castps128_ps256(d4), pair23)};
            for (int i = 0; i < m; i++) {
                const int8_t *xq = a->q + (i0 + i) * a->q_step + 128 * g;
                const int64_t l = (i0 + i) * a->lane_step + 16 * g;
                for (int h = 0; h < 2; h++) {
                    const __m256i sum = q8_dot2_256(
                        _mm256_loadu_si256((const __m256i *)(a->lane + l + 8 * h)), lo[h],
                        _mm256_loadu_si256((const __m256i *)(xq + 32 * h)), hi[h],
                        _mm256_loadu_si256((const __m256i *)(xq + 64 + 32 * h)));
                    const __m256 scale = _mm256_mul_ps(dw[h], _mm256_loadu_ps(a->dq + l + 8 * h));
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc[i]);
                }
            }
        }
        for (int i = 0; i < m; i++) {
            const __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1));
            const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
            y[i * ldy + r] = _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t))) + (bias ? bias[r] : 0.0f);
        }
    }
}

#endif

/* As ROW_PASSES (common.h), over the quantized activations: ROWS(w, stride, r0, r1,
 * a, i0, m, y, ldy, bias, ...) for the activation rows i0 .. i0 + m - 1. */
#define Q8_PASSES(A, ROWS, ...)                                                          \
    FOR_PASSES(ROWS(w, stride, r0_, r1_, A, i0_, pass_m_, y + i0_ * rows, rows, bias, ##__VA_ARGS__))

/* As EXPERTS_PASS (common.h), over the quantized activations: one activation row, or
 * (PER_EXPERT) row j of A for matrix j, through `count` matrices at addresses ws[j]. */
#define Q8_EXPERTS_PASS(A, PER_EXPERT, ROWS, ...)                                        \
    FOR_EXPERT_PIECES(ROWS((const uint8_t *)(intptr_t)ws[j_], stride, r0_, r1_, A,       \
                           (PER_EXPERT) ? j_ : 0, 1, y + j_ * rows, rows, NULL, ##__VA_ARGS__))

/* A type's 8-bit-activation matvec (quantize x for its layout, then its passes), the
 * same over a token's experts (q8_experts_T: x quantized once, or once per expert's
 * row), its rows r0 .. r1 - 1 for one prepared activation row (q8_rows_T, on the
 * calling thread), and its layout (q8_order_T, q8_offset_T). */
#define DEFINE_Q8_MATVEC(T, ORDER, OFFSET, ROWS, ...)                                    \
    enum { q8_order_##T = ORDER, q8_offset_##T = OFFSET };                               \
    static void q8_rows_##T(const uint8_t *w, int64_t stride, int64_t r0, int64_t r1,    \
                            const act_t *a, float *y, const float *bias) {               \
        ROWS(w, stride, r0, r1, a, 0, 1, y, 0, bias, ##__VA_ARGS__);                     \
    }                                                                                    \
    static int q8_matvec_##T(const uint8_t *w, int64_t stride, int64_t rows, const float *x, \
                             int64_t m, int64_t n, float *y, const float *bias) {        \
        act_t a;                                                                         \
        void *buf = q8_alloc(m, n, &a);                                                  \
        if (buf == NULL) return -1;                                                      \
        q8_quantize(x, m, n, ORDER, OFFSET, &a);                                         \
        Q8_PASSES(&a, ROWS, ##__VA_ARGS__);                                              \
        free(buf);                                                                       \
        return 0;                                                                        \
    }                                                                                    \
    static int q8_experts_##T(const int64_t *ws, int64_t stride, int64_t rows, const float *x, \
                              int64_t x_step, int64_t n, float *y, int64_t count) {      \
        act_t a;                                                                         \
        const int64_t m = x_step ? count : 1;                                            \
        void *buf = q8_alloc(m, n, &a);                                                  \
        if (buf == NULL) return -1;                                                      \
        q8_quantize_rows(x, x_step, m, n, ORDER, OFFSET, &a);                            \
        Q8_EXPERTS_PASS(&a, x_step != 0, ROWS, ##__VA_ARGS__);                           \
        free(buf);                                                                       \
        return 0;                                                                        \
    }

#define Q8_BLOCK_CASE(T, BLOCK) case T: return BLOCK;
#define Q8_CALL_CASE(T, BLOCK) case T: return q8_matvec_##T(w, stride, rows, x, m, n, y, bias);
#define Q8_LAYOUT_CASE(T, BLOCK) case T: *order = q8_order_##T; *offset = q8_offset_##T; return 0;
#define Q8_ROWS_CASE(T, BLOCK) case T: q8_rows_##T(w, stride, r0, r1, a, y, bias); return 0;
#define Q8_EXPERTS_CASE(T, BLOCK)                                                        \
    case T: return n % (BLOCK) ? -1 : q8_experts_##T(ws, stride, rows, x, x_step, n, y, count);

/* The C API of the family's Q8_TYPES(X) list (X(T, row multiple) per type). */
#define DEFINE_Q8_API()                                                                  \
    /* Row lengths the 8-bit-activation kernel takes for `type` are multiples of this; \
     * 0: none for that type. */                                                         \
    int llmrun_q8_block(int type) {                                                      \
        if (!q8_ready(type)) return 0;                                                   \
        switch (type) {                                                                  \
        Q8_TYPES(Q8_BLOCK_CASE)                                                          \
        default: return 0;                                                               \
        }                                                                                \
    }                                                                                    \
                                                                                         \
    /* As llmrun_matvec, with each row of x quantized to Q8_0 (Q8_K) blocks first (q8.h); \
     * -1 where the type has no such kernel (or memory ran out). */                      \
    int llmrun_matvec_q8(int type, const uint8_t *w, int64_t stride, int64_t rows,       \
                         const float *x, int64_t m, int64_t n, float *y, const float *bias) { \
        if (!q8_ready(type)) return -1;                                                  \
        switch (type) {                                                                  \
        Q8_TYPES(Q8_CALL_CASE)                                                           \
        default: return -1;                                                              \
        }                                                                                \
    }                                                                                    \
                                                                                         \
    /* How `type`'s kernel wants its activations (q8_quantize's order and offset). */    \
    int llmrun_q8_layout(int type, int *order, int *offset) {                            \
        switch (type) {                                                                  \
        Q8_TYPES(Q8_LAYOUT_CASE)                                                         \
        default: return -1;                                                              \
        }                                                                                \
    }                                                                                    \
                                                                                         \
    /* As llmrun_matvec_experts (common.h), with x quantized (Q8_0, Q8_K) first: once     \
     * (x_step 0), or each expert's row; -1 where the type has no such kernel for rows   \
     * of n (or memory ran out). */                                                      \
    int llmrun_matvec_experts_q8(int type, const int64_t *ws, int64_t stride, int64_t rows, \
                                 const float *x, int64_t x_step, int64_t n, float *y,    \
                                 int64_t count) {                                        \
        if (!q8_ready(type)) return -1;                                                  \
        switch (type) {                                                                  \
        Q8_TYPES(Q8_EXPERTS_CASE)                                                        \
        default: return -1;                                                              \
        }                                                                                \
    }                                                                                    \
                                                                                         \
    /* y[r] for rows r0 .. r1 - 1 against one row of activations quantized for the      \
     * type's layout, on the calling thread (the decode step's share of a matvec). */   \
    int llmrun_q8_rows(int type, const uint8_t *w, int64_t stride, int64_t r0, int64_t r1, \
                       const act_t *a, float *y, const float *bias) {                    \
        if (!q8_ready(type)) return -1;                                                  \
        switch (type) {                                                                  \
        Q8_TYPES(Q8_ROWS_CASE)                                                           \
        default: return -1;                                                              \
        }                                                                                \
    }
