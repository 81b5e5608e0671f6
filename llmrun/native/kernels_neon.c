/* GGML-quantized matrix x few-vectors products and row dequantization, ARM NEON.
 *
 * The same C API and the same exactness as kernels_avx2.c, whose structure this file
 * follows, for 64-bit ARM CPUs (all of them have NEON, "asimd"). Weights stay in
 * GGML's block layout: llmrun_block is 0 for the packed layouts' ids, so llmrun never
 * repacks for this family.
 *
 * Each block is dequantized in registers to exactly the f32 values gguf's reference
 * dequantizer gives: the quants are unpacked to int8 with byte shifts, masks and table
 * lookups, widened to f32 (exact), then scaled with the reference's operations in its
 * order (d*q, d*q + m, dl*q - ml; built with -ffp-contract=off so none gets fused).
 * Scale products such as d*sc are computed in scalar f32, which rounds as the vector
 * unit does. The weights then go from registers into f32 multiply-adds with the
 * activations (sink_t), so a product differs from x @ dequantize(W).T only by the
 * order of the sums.
 *
 * No dot-product instructions (SDOT/UDOT, the `dotprod` extension): they multiply
 * int8 by int8 into int32, and the activations are f32. Quantizing the activations to
 * int8, as llama.cpp does, changes the results, and no exact split of f32 activations
 * into int8 parts is cheaper than the f32 multiply-adds. So the family needs only
 * ARMv8.0 NEON and runs on every AArch64 CPU.
 *
 * Built at first use by llmrun/native/build.py (-march=armv8-a) and loaded with
 * ctypes; elsewhere this file compiles to llmrun_available() == 0. Its speed is
 * unmeasured: it is tested under qemu-user (tests/native/test_neon.py).
 * Block layouts: https://github.com/ggml-org/llama.cpp/blob/master/ggml/src/ggml-common.h
 */
#include "common.h"

#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>

#define EXPERT_TYPES(X, A) GGML_TYPES(X, A)
#define KERNEL_TYPES(X, A) EXPERT_TYPES(X, A)
#define TYPE_READY(type) 1

ALWAYS_INLINE float f16_at(const uint8_t *p) {
    __fp16 h;
    memcpy(&h, p, 2);
    return (float)h;
}

ALWAYS_INLINE uint8x16_t load16(const uint8_t *p) { return vld1q_u8(p); }

ALWAYS_INLINE int8x16_t s8(uint8x16_t v) { return vreinterpretq_s8_u8(v); }

ALWAYS_INLINE uint8x16_t lo_nibbles(uint8x16_t v) { return vandq_u8(v, vdupq_n_u8(15)); }

ALWAYS_INLINE uint8x16_t hi_nibbles(uint8x16_t v) { return vshrq_n_u8(v, 4); }

/* each byte of v shifted left by k, right where k < 0 (the _n_ shifts need a constant) */
ALWAYS_INLINE uint8x16_t shift(uint8x16_t v, int k) { return vshlq_u8(v, vdupq_n_s8((int8_t)k)); }

/* 0xFF in each byte of v with bit `bit` set, else 0 */
ALWAYS_INLINE uint8x16_t bit_set(uint8x16_t v, int bit) {
    return vtstq_u8(v, vdupq_n_u8((uint8_t)(1 << bit)));
}

/* byte j (j < 16) = 0xFF where bit j of h is set, else 0 */
ALWAYS_INLINE uint8x16_t bit_bytes(uint32_t h) {
    const uint8x16_t bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    return vtstq_u8(vcombine_u8(vdup_n_u8((uint8_t)h), vdup_n_u8((uint8_t)(h >> 8))), bit);
}

/* The IQ4_NL/IQ4_XS codebook, for a byte table lookup */
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1,    13,   25,  38,  53,  69,  89,  113};

ALWAYS_INLINE int8x16_t iq4_lookup(uint8x16_t q) { return vqtbl1q_s8(vld1q_s8(IQ4_VALUES), q); }

/* Where a dequantizer sends its weights, 4 at a time: to memory (out, for
 * llmrun_dequantize), or straight into multiply-adds with m activation rows x
 * (x[i*n + off] for the weight at block offset off), into acc[i][(off/4) % a]:
 * a = 8, 8, 4 or 2 independent accumulators per row (m = 1, 2, 4, 8) hide the
 * multiply-add latency within the 32 registers. Everything inlines with constant m
 * and offsets, so the accumulators stay in registers and the weights never touch
 * memory. */
typedef struct {
    float *out;
    const float *x;
    int64_t n;
    int m, base; /* base: the block's offset in a run of blocks (see rows_T) */
    float32x4_t (*acc)[8];
} sink_t;

ALWAYS_INLINE int lanes_per_row(const int m) { return m >= 8 ? 2 : m >= 4 ? 4 : 8; }

ALWAYS_INLINE void emit(sink_t s, int off, float32x4_t v) {
    if (s.out) {
        vst1q_f32(s.out + off, v);
        return;
    }
    const int k = s.base + off, j = (k / 4) % lanes_per_row(s.m);
    for (int i = 0; i < s.m; i++)
        s.acc[i][j] = vfmaq_f32(s.acc[i][j], v, vld1q_f32(s.x + i * s.n + k));
}

/* the 16 int8 lanes of q as f32 (exact), lanes 4j..4j+3 in f[j] */
ALWAYS_INLINE void to_f32(int8x16_t q, float32x4_t f[4]) {
    const int16x8_t lo = vmovl_s8(vget_low_s8(q)), hi = vmovl_high_s8(q);
    f[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo)));
    f[1] = vcvtq_f32_s32(vmovl_high_s16(lo));
    f[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi)));
    f[3] = vcvtq_f32_s32(vmovl_high_s16(hi));
}

/* weights off..off+15 = d * q for the 16 int8 q */
ALWAYS_INLINE void put_mul(sink_t s, int off, int8x16_t q, float32x4_t d) {
    float32x4_t f[4];
    to_f32(q, f);
    for (int j = 0; j < 4; j++) emit(s, off + 4 * j, vmulq_f32(d, f[j]));
}

/* weights off..off+15 = d * q + m */
ALWAYS_INLINE void put_mul_add(sink_t s, int off, int8x16_t q, float32x4_t d, float32x4_t m) {
    float32x4_t f[4];
    to_f32(q, f);
    for (int j = 0; j < 4; j++) emit(s, off + 4 * j, vaddq_f32(vmulq_f32(d, f[j]), m));
}

/* weights off..off+15 = d * q - m */
ALWAYS_INLINE void put_mul_sub(sink_t s, int off, int8x16_t q, float32x4_t d, float32x4_t m) {
    float32x4_t f[4];
    to_f32(q, f);
    for (int j = 0; j < 4; j++) emit(s, off + 4 * j, vsubq_f32(vmulq_f32(d, f[j]), m));
}

/* Each dequantizer sends one block's weights to a sink, in any order. */

#define F32_BLOCK 8
#define F32_BYTES 32
ALWAYS_INLINE void deq_F32(const uint8_t *src, sink_t s) {
    emit(s, 0, vreinterpretq_f32_u8(load16(src)));
    emit(s, 4, vreinterpretq_f32_u8(load16(src + 16)));
}

#define F16_BLOCK 8
#define F16_BYTES 16
ALWAYS_INLINE void deq_F16(const uint8_t *src, sink_t s) {
    const float16x8_t h = vreinterpretq_f16_u8(load16(src));
    emit(s, 0, vcvt_f32_f16(vget_low_f16(h)));
    emit(s, 4, vcvt_high_f32_f16(h));
}

/* a bf16 is the top half of the f32 with the same bits */
#define BF16_BLOCK 8
#define BF16_BYTES 16
ALWAYS_INLINE void deq_BF16(const uint8_t *src, sink_t s) {
    const uint16x8_t v = vreinterpretq_u16_u8(load16(src));
    emit(s, 0, vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(v), 16)));
    emit(s, 4, vreinterpretq_f32_u32(vshll_high_n_u16(v, 16)));
}

#define Q8_0_BLOCK 32
#define Q8_0_BYTES 34
ALWAYS_INLINE void deq_Q8_0(const uint8_t *src, sink_t s) {
    const float32x4_t d = vdupq_n_f32(f16_at(src));
    put_mul(s, 0, s8(load16(src + 2)), d);
    put_mul(s, 16, s8(load16(src + 18)), d);
}

/* Q4_0, Q4_1, IQ4_NL: low nibbles are weights 0..15, high nibbles 16..31. */
#define Q4_0_BLOCK 32
#define Q4_0_BYTES 18
ALWAYS_INLINE void deq_Q4_0(const uint8_t *src, sink_t s) {
    const float32x4_t d = vdupq_n_f32(f16_at(src));
    const uint8x16_t v = load16(src + 2);
    const int8x16_t eight = vdupq_n_s8(8);
    put_mul(s, 0, vsubq_s8(s8(lo_nibbles(v)), eight), d);
    put_mul(s, 16, vsubq_s8(s8(hi_nibbles(v)), eight), d);
}

#define Q4_1_BLOCK 32
#define Q4_1_BYTES 20
ALWAYS_INLINE void deq_Q4_1(const uint8_t *src, sink_t s) {
    const float32x4_t d = vdupq_n_f32(f16_at(src)), m = vdupq_n_f32(f16_at(src + 2));
    const uint8x16_t v = load16(src + 4);
    put_mul_add(s, 0, s8(lo_nibbles(v)), d, m);
    put_mul_add(s, 16, s8(hi_nibbles(v)), d, m);
}

#define IQ4_NL_BLOCK 32
#define IQ4_NL_BYTES 18
ALWAYS_INLINE void deq_IQ4_NL(const uint8_t *src, sink_t s) {
    const float32x4_t d = vdupq_n_f32(f16_at(src));
    const uint8x16_t v = load16(src + 2);
    put_mul(s, 0, iq4_lookup(lo_nibbles(v)), d);
    put_mul(s, 16, iq4_lookup(hi_nibbles(v)), d);
}

/* MXFP4 (common.h; MXFP4_BLOCK, MXFP4_BYTES): the codes looked up as int8 in its
 * doubled e2m1 values, times the block's scale 2^(e - 128). */
ALWAYS_INLINE void deq_MXFP4(const uint8_t *src, sink_t s) {
    const float32x4_t d = vdupq_n_f32(e8m0_half(src[0]));
    const uint8x16_t v = load16(src + 1);
    const int8x16_t kv = vld1q_s8(MXFP4_VALUES);
    put_mul(s, 0, vqtbl1q_s8(kv, lo_nibbles(v)), d);
    put_mul(s, 16, vqtbl1q_s8(kv, hi_nibbles(v)), d);
}

/* Q5_0/Q5_1: bit 4 of weight j is bit j of the little-endian u32 qh. */
#define Q5_0_BLOCK 32
#define Q5_0_BYTES 22
ALWAYS_INLINE void deq_Q5_0(const uint8_t *src, sink_t s) {
    const float32x4_t d = vdupq_n_f32(f16_at(src));
    const uint32_t qh = u32_at(src + 2);
    const uint8x16_t v = load16(src + 6), sixteen = vdupq_n_u8(16);
    /* q - 16 = low 4 bits - (16 where bit 4 is clear) */
    put_mul(s, 0, vsubq_s8(s8(lo_nibbles(v)), s8(vbicq_u8(sixteen, bit_bytes(qh)))), d);
    put_mul(s, 16, vsubq_s8(s8(hi_nibbles(v)), s8(vbicq_u8(sixteen, bit_bytes(qh >> 16)))), d);
}

#define Q5_1_BLOCK 32
#define Q5_1_BYTES 24
ALWAYS_INLINE void deq_Q5_1(const uint8_t *src, sink_t s) {
    const float32x4_t d = vdupq_n_f32(f16_at(src)), m = vdupq_n_f32(f16_at(src + 2));
    const uint32_t qh = u32_at(src + 4);
    const uint8x16_t v = load16(src + 8), sixteen = vdupq_n_u8(16);
    put_mul_add(s, 0, s8(vorrq_u8(lo_nibbles(v), vandq_u8(bit_bytes(qh), sixteen))), d, m);
    put_mul_add(s, 16, s8(vorrq_u8(hi_nibbles(v), vandq_u8(bit_bytes(qh >> 16), sixteen))), d,
                m);
}

/* Q4_K/Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins packed in 12 bytes;
 * w = (d*sc)*q - dmin*m. Writes ab = [d*sc[0..7], dmin*m[0..7]]. */
ALWAYS_INLINE void k_scales(const uint8_t *src, float *ab) {
    uint32_t u[3];
    memcpy(u, src + 4, 12);
    const uint32_t packed[4] = {
        u[0] & 0x3f3f3f3f,
        (u[2] & 0x0f0f0f0f) | ((u[0] >> 2) & 0x30303030),
        u[1] & 0x3f3f3f3f,
        ((u[2] >> 4) & 0x0f0f0f0f) | ((u[1] >> 2) & 0x30303030),
    };
    const float32x4_t d = vdupq_n_f32(f16_at(src)), dmin = vdupq_n_f32(f16_at(src + 2));
    float32x4_t f[4];
    to_f32(s8(vld1q_u8((const uint8_t *)packed)), f); /* 6-bit values: int8 holds them */
    vst1q_f32(ab, vmulq_f32(d, f[0]));
    vst1q_f32(ab + 4, vmulq_f32(d, f[1]));
    vst1q_f32(ab + 8, vmulq_f32(dmin, f[2]));
    vst1q_f32(ab + 12, vmulq_f32(dmin, f[3]));
}

/* Sub-blocks 2p and 2p+1 share qs[32p..32p+31]: low nibbles, then high. */
#define Q4_K_BLOCK 256
#define Q4_K_BYTES 144
ALWAYS_INLINE void deq_Q4_K(const uint8_t *src, sink_t s) {
    float ab[16];
    k_scales(src, ab);
    for (int p = 0; p < 4; p++) {
        const uint8x16_t v0 = load16(src + 16 + 32 * p), v1 = load16(src + 32 + 32 * p);
        const float32x4_t d0 = vdupq_n_f32(ab[2 * p]), m0 = vdupq_n_f32(ab[8 + 2 * p]);
        const float32x4_t d1 = vdupq_n_f32(ab[2 * p + 1]), m1 = vdupq_n_f32(ab[9 + 2 * p]);
        put_mul_sub(s, 64 * p, s8(lo_nibbles(v0)), d0, m0);
        put_mul_sub(s, 64 * p + 16, s8(lo_nibbles(v1)), d0, m0);
        put_mul_sub(s, 64 * p + 32, s8(hi_nibbles(v0)), d1, m1);
        put_mul_sub(s, 64 * p + 48, s8(hi_nibbles(v1)), d1, m1);
    }
}

/* Sub-block j: nibble j%2 of qs[32(j/2) + l], bit 4 from bit j of qh[l]. */
#define Q5_K_BLOCK 256
#define Q5_K_BYTES 176
ALWAYS_INLINE void deq_Q5_K(const uint8_t *src, sink_t s) {
    float ab[16];
    k_scales(src, ab);
    const uint8x16_t h0 = load16(src + 16), h1 = load16(src + 32), sixteen = vdupq_n_u8(16);
    for (int p = 0; p < 4; p++) {
        const uint8x16_t v0 = load16(src + 48 + 32 * p), v1 = load16(src + 64 + 32 * p);
        for (int e = 0; e < 2; e++) {
            const int j = 2 * p + e;
            const float32x4_t d = vdupq_n_f32(ab[j]), m = vdupq_n_f32(ab[8 + j]);
            const uint8x16_t q0 = e ? hi_nibbles(v0) : lo_nibbles(v0);
            const uint8x16_t q1 = e ? hi_nibbles(v1) : lo_nibbles(v1);
            put_mul_sub(s, 32 * j, s8(vorrq_u8(q0, vandq_u8(bit_set(h0, j), sixteen))), d, m);
            put_mul_sub(s, 32 * j + 16, s8(vorrq_u8(q1, vandq_u8(bit_set(h1, j), sixteen))), d,
                        m);
        }
    }
}

/* Q6_K: w = (d*sc) * (q - 32), q = 4 bits from ql | 2 bits from qh << 4; sixteen
 * int8 scales, one per 16 weights. Weight c*128 + t*32 + l takes the (t/2)
 * nibble of ql[64c + 32(t%2) + l] and bits 2t..2t+1 of qh[32c + l]. */
#define Q6_K_BLOCK 256
#define Q6_K_BYTES 210
ALWAYS_INLINE void deq_Q6_K(const uint8_t *src, sink_t s) {
    float dl[16];
    const float d = f16_at(src + 208);
    for (int j = 0; j < 16; j++) dl[j] = d * (float)(int8_t)src[192 + j];
    const uint8x16_t three0 = vdupq_n_u8(0x30);
    const int8x16_t bias = vdupq_n_s8(32);
    for (int c = 0; c < 2; c++)
        for (int h = 0; h < 2; h++) {
            const uint8x16_t qh = load16(src + 128 + 32 * c + 16 * h);
            for (int t = 0; t < 4; t++) {
                const uint8x16_t ql = load16(src + 64 * c + 32 * (t % 2) + 16 * h);
                const uint8x16_t lo = t >= 2 ? hi_nibbles(ql) : lo_nibbles(ql);
                /* bits 2t..2t+1 of qh at bits 4..5 */
                const uint8x16_t hb = vandq_u8(shift(qh, 4 - 2 * t), three0);
                const int i = 128 * c + 32 * t + 16 * h;
                put_mul(s, i, vsubq_s8(s8(vorrq_u8(lo, hb)), bias), vdupq_n_f32(dl[i / 16]));
            }
        }
}

/* Q2_K: w = d*(sc&15) * q - dmin*(sc>>4), q 2 bits; weight c*128 + u*32 + l takes
 * bits 2u..2u+1 of qs[32c + l]; one scale byte per 16 weights. */
#define Q2_K_BLOCK 256
#define Q2_K_BYTES 84
ALWAYS_INLINE void deq_Q2_K(const uint8_t *src, sink_t s) {
    float dl[16], ml[16];
    const float d = f16_at(src + 80), dmin = f16_at(src + 82);
    for (int j = 0; j < 16; j++) {
        dl[j] = d * (float)(src[j] & 15);
        ml[j] = dmin * (float)(src[j] >> 4);
    }
    const uint8x16_t three = vdupq_n_u8(3);
    for (int c = 0; c < 2; c++)
        for (int h = 0; h < 2; h++) {
            const uint8x16_t v = load16(src + 16 + 32 * c + 16 * h);
            for (int u = 0; u < 4; u++) {
                const int i = c * 128 + u * 32 + 16 * h;
                const uint8x16_t q = vandq_u8(shift(v, -2 * u), three);
                put_mul_sub(s, i, s8(q), vdupq_n_f32(dl[i / 16]), vdupq_n_f32(ml[i / 16]));
            }
        }
}

/* Q3_K: w = d*(sc-32) * (k-4) with k = 2 low bits | hmask bit << 2; weight
 * c*128 + u*32 + l takes bits 2u.. of qs[32c + l] and bit 4c+u of hmask[l]. Scale j:
 * its low nibble from byte j%8 (high nibble for j >= 8), its bits 4..5 from bits
 * 2(j/4).. of byte 8 + j%4. */
#define Q3_K_BLOCK 256
#define Q3_K_BYTES 110
ALWAYS_INLINE void deq_Q3_K(const uint8_t *src, sink_t s) {
    float dl[16];
    const uint8_t *sc = src + 96;
    const float d = f16_at(src + 108);
    for (int j = 0; j < 16; j++) {
        const int low = (sc[j % 8] >> (j >= 8 ? 4 : 0)) & 15;
        const int high = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
        dl[j] = d * (float)((low | high << 4) - 32);
    }
    const uint8x16_t three = vdupq_n_u8(3), four = vdupq_n_u8(4);
    for (int h = 0; h < 2; h++) {
        const uint8x16_t hm = load16(src + 16 * h);
        for (int c = 0; c < 2; c++) {
            const uint8x16_t v = load16(src + 32 + 32 * c + 16 * h);
            for (int u = 0; u < 4; u++) {
                const int i = c * 128 + u * 32 + 16 * h;
                const uint8x16_t lo = vandq_u8(shift(v, -2 * u), three);
                /* k - 4 = low bits - (4 where the hmask bit is clear) */
                const uint8x16_t clear = vbicq_u8(four, bit_set(hm, 4 * c + u));
                put_mul(s, i, vsubq_s8(s8(lo), s8(clear)), vdupq_n_f32(dl[i / 16]));
            }
        }
    }
}

/* IQ4_XS: 8 sub-blocks of 32, w = d*(sc-32) * IQ4_VALUES[q], 6-bit scales split in
 * a u16 of high bits and 4 bytes of low nibbles; sub-block j reads qs[16j..16j+15]. */
#define IQ4_XS_BLOCK 256
#define IQ4_XS_BYTES 136
ALWAYS_INLINE void deq_IQ4_XS(const uint8_t *src, sink_t s) {
    const float d = f16_at(src);
    uint16_t high;
    memcpy(&high, src + 2, 2);
    for (int j = 0; j < 8; j++) {
        const int low = (src[4 + j / 2] >> (4 * (j % 2))) & 15;
        const int sc = (low | ((high >> (2 * j)) & 3) << 4) - 32;
        const float32x4_t dl = vdupq_n_f32(d * (float)sc);
        const uint8x16_t v = load16(src + 8 + 16 * j);
        put_mul(s, 32 * j, iq4_lookup(lo_nibbles(v)), dl);
        put_mul(s, 32 * j + 16, iq4_lookup(hi_nibbles(v)), dl);
    }
}

/* Kernels per type: each block is dequantized into multiply-adds with up to MAX_M
 * activation rows (sink_t). */

#define DEFINE_KERNELS(T)                                                                \
    ALWAYS_INLINE void rows_##T(const uint8_t *w, int64_t stride, int64_t r0, int64_t r1, \
                                const float *x, const int m, int64_t n, float *y,        \
                                int64_t ldy, const float *bias) {                        \
        enum { RUN = T##_BLOCK >= 32 ? 1 : 32 / T##_BLOCK };                             \
        const int64_t nb = n / T##_BLOCK;                                                \
        const int a = lanes_per_row(m);                                                  \
        const uint8_t *end = w + r1 * stride;                                            \
        for (int64_t r = r0; r < r1; r++) {                                              \
            const uint8_t *row = w + r * stride;                                         \
            float32x4_t acc[MAX_M][8];                                                   \
            for (int i = 0; i < m; i++)                                                  \
                for (int j = 0; j < 8; j++) acc[i][j] = vdupq_n_f32(0.0f);               \
            /* runs of RUN blocks (32 weights), so blocks of 8 use all accumulators */   \
            int64_t b = 0;                                                               \
            for (; b + RUN <= nb; b += RUN) {                                            \
                const uint8_t *src = row + b * T##_BYTES;                                \
                /* one prefetch per 64 bytes of blocks */                                \
                if (src + PREFETCH + RUN * T##_BYTES <= end &&                           \
                    (RUN * T##_BYTES >= 64 ||                                            \
                     ((uintptr_t)src ^ ((uintptr_t)src + RUN * T##_BYTES)) >= 64))       \
                    for (int l = 0; l < RUN * T##_BYTES; l += 64)                        \
                        __builtin_prefetch(src + PREFETCH + l);                          \
                for (int u = 0; u < RUN; u++) {                                          \
                    const sink_t s = {NULL, x + b * T##_BLOCK, n, m, u * T##_BLOCK, acc}; \
                    deq_##T(src + u * T##_BYTES, s);                                     \
                }                                                                        \
            }                                                                            \
            for (; b < nb; b++) {                                                        \
                const sink_t s = {NULL, x + b * T##_BLOCK, n, m, 0, acc};                \
                deq_##T(row + b * T##_BYTES, s);                                         \
            }                                                                            \
            for (int i = 0; i < m; i++) {                                                \
                float32x4_t sum = acc[i][0];                                             \
                for (int j = 1; j < a; j++) sum = vaddq_f32(sum, acc[i][j]);             \
                y[i * ldy + r] = vaddvq_f32(sum) + (bias ? bias[r] : 0.0f);              \
            }                                                                            \
        }                                                                                \
    }                                                                                    \
    static void matvec_##T(const uint8_t *w, int64_t stride, int64_t rows, const float *x, \
                           int64_t m, int64_t n, float *y, const float *bias) {          \
        ROW_PASSES(x, rows_##T);                                                         \
    }                                                                                    \
    static void dequant_##T(const uint8_t *w, int64_t stride, int64_t rows, int64_t n,   \
                            float *out) {                                                \
        const int64_t nb = n / T##_BLOCK;                                                \
        _Pragma("omp parallel for schedule(static)")                                     \
        for (int64_t r = 0; r < rows; r++)                                               \
            for (int64_t b = 0; b < nb; b++)                                             \
                deq_##T(w + r * stride + b * T##_BYTES, (sink_t){.out = out + r * n + b * T##_BLOCK}); \
    }

DEFINE_KERNELS(F32)
DEFINE_KERNELS(F16)
DEFINE_KERNELS(BF16)
DEFINE_KERNELS(Q4_0)
DEFINE_KERNELS(Q4_1)
DEFINE_KERNELS(Q5_0)
DEFINE_KERNELS(Q5_1)
DEFINE_KERNELS(Q8_0)
DEFINE_KERNELS(Q2_K)
DEFINE_KERNELS(Q3_K)
DEFINE_KERNELS(Q4_K)
DEFINE_KERNELS(Q5_K)
DEFINE_KERNELS(Q6_K)
DEFINE_KERNELS(IQ4_NL)
DEFINE_KERNELS(IQ4_XS)
DEFINE_KERNELS(MXFP4)

DEFINE_API()

#else

int llmrun_available(void) { return 0; }

#endif
