/* GGML-quantized matrix x few-vectors products and row dequantization, AVX2.
 *
 * The same C API and the same exactness as kernels_avx512.c, for CPUs with AVX2,
 * FMA and F16C only (Intel since Haswell, AMD since Zen). Weights stay in GGML's
 * block layout, or for Q4_0 and Q5_0 the packed layouts (near the end; with
 * another in-register order, and rows of 64 weights).
 *
 * Each block is dequantized in registers to exactly the f32 values gguf's reference
 * dequantizer gives: the quants are unpacked to int8 with byte shuffles and masks,
 * widened to f32 (exact), then scaled with the reference's operations in its order
 * (d*q, d*q + m, dl*q - ml; built with -ffp-contract=off so none gets fused). Scale
 * products such as d*sc are computed in scalar f32, which rounds as the vector unit
 * does. The weights then go from registers into f32 multiply-adds with the
 * activations (sink_t), so a product differs from x @ dequantize(W).T only by the
 * order of the sums.
 *
 * Built at first use by llmrun/native/build.py (-march=haswell) and loaded with
 * ctypes; without AVX2, FMA and F16C this file compiles to llmrun_available() == 0.
 * common.h holds what it shares with kernels_avx512.c.
 * Block layouts: https://github.com/ggml-org/llama.cpp/blob/master/ggml/src/ggml-common.h
 */
/* Q4_K, Q5_K and Q6_K experts take the few-rows kernels of their matvec (DEFINE_FEW_ROWS) */
#define EXPERTS_FIRST                                                                    \
    if (type == Q4_K) return experts_Q4_K(ws, stride, rows, x, x_step, n, y, count);    \
    if (type == Q5_K) return experts_Q5_K(ws, stride, rows, x, x_step, n, y, count);    \
    if (type == Q6_K) return experts_Q6_K(ws, stride, rows, x, x_step, n, y, count);
#include "common.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

/* The types with kernels here: common.h's, the i-quants (iquants.h), and the packed
 * layouts of Q4_0, Q5_0 and Q8_0 (see below; not those of Q4_K and Q5_K). */
#define EXPERT_TYPES(X, A) GGML_TYPES(X, A) IQ_TYPES(X, A)
#define TYPE_READY(type) iq_ready(type)
#define KERNEL_TYPES(X, A) \
    EXPERT_TYPES(X, A) X(Q4_0_PACKED, A) X(Q5_0_PACKED, A) X(Q8_0_PACKED, A)

ALWAYS_INLINE float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* The f16 at p and the next, as f32 (lanes 0 and 1). Reads 8 bytes at p, so only for
 * scales at the start of a block of 18 bytes or more. Cheaper than f16_at's insert
 * and broadcast in shuffle-port uops, which the 32-weight blocks are short of. */
ALWAYS_INLINE __m128 f16x2_at(const uint8_t *p) {
    return _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)p));
}

/* lane 1 of v in all 8 lanes */
ALWAYS_INLINE __m256 lane1(__m128 v) {
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(v), _mm256_set1_epi32(1));
}

ALWAYS_INLINE __m128i load16(const uint8_t *p) { return _mm_loadu_si128((const __m128i *)p); }

ALWAYS_INLINE __m128i lo_nibbles(__m128i v) { return _mm_and_si128(v, _mm_set1_epi8(15)); }

/* 16-bit shifts, then the mask, keep each byte's own bits */
ALWAYS_INLINE __m128i hi_nibbles(__m128i v) {
    return _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(15));
}

/* The IQ4_NL/IQ4_XS codebook, as int8 for a byte shuffle */
ALWAYS_INLINE __m128i iq4_values(void) {
    return _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89,
                         113);
}

/* byte j (j < 16) = 0xFF where bit j of h is set, else 0 */
ALWAYS_INLINE __m128i bit_bytes(uint32_t h) {
    const __m128i sel = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m128i bit = _mm_set1_epi64x((long long)0x8040201008040201ULL);
    const __m128i v = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)h), sel);
    return _mm_cmpeq_epi8(_mm_and_si128(v, bit), bit);
}

/* Where a dequantizer sends its weights, 8 at a time: to memory (out, for
 * llmrun_dequantize), or straight into multiply-adds with m activation rows x
 * (x[i*n + off] for the weight at block offset off), into acc[i][(off/8) % a]:
 * 8/m independent accumulators per row (at most 4) hide the multiply-add latency
 * within the 16 registers. Everything inlines with constant m and offsets, so the
 * accumulators stay in registers and the weights never touch memory. */
typedef struct {
    float *out;
    const float *x;
    int64_t n;
    int m, base; /* base: the block's offset in a run of blocks (see rows_T) */
    __m256 (*acc)[4];
} sink_t;

ALWAYS_INLINE int lanes_per_row(const int m) { return m >= 8 ? 1 : m >= 4 ? 2 : 4; }

ALWAYS_INLINE void emit(sink_t s, int off, __m256 v) {
    if (s.out) {
        _mm256_storeu_ps(s.out + off, v);
        return;
    }
    const int k = s.base + off, j = (k / 8) % lanes_per_row(s.m);
    for (int i = 0; i < s.m; i++)
        s.acc[i][j] = _mm256_fmadd_ps(v, _mm256_loadu_ps(s.x + i * s.n + k), s.acc[i][j]);
}

/* int8 lanes 0..7 of v -> f32 (exact) */
ALWAYS_INLINE __m256 f32_lo(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }
ALWAYS_INLINE __m256 f32_hi(__m128i v) { return f32_lo(_mm_unpackhi_epi64(v, v)); }

/* weights off..off+15 = d * q for the 16 int8 q */
ALWAYS_INLINE void put_mul(sink_t s, int off, __m128i q, __m256 d) {
    emit(s, off, _mm256_mul_ps(d, f32_lo(q)));
    emit(s, off + 8, _mm256_mul_ps(d, f32_hi(q)));
}

/* weights off..off+15 = d * q + m */
ALWAYS_INLINE void put_mul_add(sink_t s, int off, __m128i q, __m256 d, __m256 m) {
    emit(s, off, _mm256_add_ps(_mm256_mul_ps(d, f32_lo(q)), m));
    emit(s, off + 8, _mm256_add_ps(_mm256_mul_ps(d, f32_hi(q)), m));
}

/* weights off..off+15 = d * q - m */
ALWAYS_INLINE void put_mul_sub(sink_t s, int off, __m128i q, __m256 d, __m256 m) {
    emit(s, off, _mm256_sub_ps(_mm256_mul_ps(d, f32_lo(q)), m));
    emit(s, off + 8, _mm256_sub_ps(_mm256_mul_ps(d, f32_hi(q)), m));
}

/* Each dequantizer sends one block's weights to a sink, in any order. */

#define F32_BLOCK 8
#define F32_BYTES 32
ALWAYS_INLINE void deq_F32(const uint8_t *src, sink_t s) {
    emit(s, 0, _mm256_loadu_ps((const float *)src));
}

#define F16_BLOCK 8
#define F16_BYTES 16
ALWAYS_INLINE void deq_F16(const uint8_t *src, sink_t s) {
    emit(s, 0, _mm256_cvtph_ps(load16(src)));
}

#define BF16_BLOCK 8
#define BF16_BYTES 16
ALWAYS_INLINE void deq_BF16(const uint8_t *src, sink_t s) {
    const __m256i v = _mm256_slli_epi32(_mm256_cvtepu16_epi32(load16(src)), 16);
    emit(s, 0, _mm256_castsi256_ps(v));
}

#define Q8_0_BLOCK 32
#define Q8_0_BYTES 34
ALWAYS_INLINE void deq_Q8_0(const uint8_t *src, sink_t s) {
    const __m256 d = _mm256_broadcastss_ps(f16x2_at(src));
    put_mul(s, 0, load16(src + 2), d);
    put_mul(s, 16, load16(src + 18), d);
}

/* Q4_0, Q4_1, IQ4_NL: low nibbles are weights 0..15, high nibbles 16..31. */
#define Q4_0_BLOCK 32
#define Q4_0_BYTES 18
/* d: the block's scale, in lane 0; qs: its 16 bytes of quants (also for the packed
 * layout, whose fields lie apart) */
ALWAYS_INLINE void deq_q4_0_fields(__m128 d1, const uint8_t *qs, sink_t s) {
    const __m256 d = _mm256_broadcastss_ps(d1);
    const __m128i v = load16(qs), eight = _mm_set1_epi8(8);
    put_mul(s, 0, _mm_sub_epi8(lo_nibbles(v), eight), d);
    put_mul(s, 16, _mm_sub_epi8(hi_nibbles(v), eight), d);
}
ALWAYS_INLINE void deq_Q4_0(const uint8_t *src, sink_t s) {
    deq_q4_0_fields(f16x2_at(src), src + 2, s);
}

#define Q4_1_BLOCK 32
#define Q4_1_BYTES 20
ALWAYS_INLINE void deq_Q4_1(const uint8_t *src, sink_t s) {
    const __m128 dm = f16x2_at(src);
    const __m256 d = _mm256_broadcastss_ps(dm), m = lane1(dm);
    const __m128i v = load16(src + 4);
    put_mul_add(s, 0, lo_nibbles(v), d, m);
    put_mul_add(s, 16, hi_nibbles(v), d, m);
}

#define IQ4_NL_BLOCK 32
#define IQ4_NL_BYTES 18
ALWAYS_INLINE void deq_IQ4_NL(const uint8_t *src, sink_t s) {
    const __m256 d = _mm256_broadcastss_ps(f16x2_at(src));
    const __m128i v = load16(src + 2), kv = iq4_values();
    put_mul(s, 0, _mm_shuffle_epi8(kv, lo_nibbles(v)), d);
    put_mul(s, 16, _mm_shuffle_epi8(kv, hi_nibbles(v)), d);
}

/* Q5_0/Q5_1: bit 4 of weight j is bit j of the little-endian u32 qh. */
#define Q5_0_BLOCK 32
#define Q5_0_BYTES 22
ALWAYS_INLINE void deq_q5_0_fields(__m128 d1, uint32_t qh, const uint8_t *qs, sink_t s) {
    const __m256 d = _mm256_broadcastss_ps(d1);
    const __m128i v = load16(qs), sixteen = _mm_set1_epi8(16);
    /* q - 16 = low 4 bits - (16 where bit 4 is clear) */
    put_mul(s, 0, _mm_sub_epi8(lo_nibbles(v), _mm_andnot_si128(bit_bytes(qh), sixteen)), d);
    put_mul(s, 16,
            _mm_sub_epi8(hi_nibbles(v), _mm_andnot_si128(bit_bytes(qh >> 16), sixteen)), d);
}

ALWAYS_INLINE void deq_Q5_0(const uint8_t *src, sink_t s) {
    deq_q5_0_fields(f16x2_at(src), u32_at(src + 2), src + 6, s);
}

#define Q5_1_BLOCK 32
#define Q5_1_BYTES 24
ALWAYS_INLINE void deq_Q5_1(const uint8_t *src, sink_t s) {
    const __m128 dm = f16x2_at(src);
    const __m256 d = _mm256_broadcastss_ps(dm), m = lane1(dm);
    const uint32_t qh = u32_at(src + 4);
    const __m128i v = load16(src + 8), sixteen = _mm_set1_epi8(16);
    put_mul_add(s, 0, _mm_or_si128(lo_nibbles(v), _mm_and_si128(bit_bytes(qh), sixteen)), d, m);
    put_mul_add(s, 16,
                _mm_or_si128(hi_nibbles(v), _mm_and_si128(bit_bytes(qh >> 16), sixteen)), d, m);
}

/* Q4_K/Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins packed in 12 bytes;
 * w = (d*sc)*q - dmin*m. Writes ab = [d*sc[0..7], dmin*m[0..7]]. The 6-bit fields are
 * gathered in vector registers (get_scale_min_k4 in gguf, four bytes a lane): built
 * with scalar stores, the 16-byte load of them could not be forwarded and stalled. */
ALWAYS_INLINE void k_scales(const uint8_t *src, float *ab) {
    /* u = the 12 bytes as dwords u0 u1 u2 (and 4 bytes of quants, unused) */
    const __m128i u = _mm_loadu_si128((const __m128i *)(src + 4));
    /* lanes: u0 & 0x3f.., (u2 & 0x0f..) | (u0 >> 2 & 0x30..), u1 & 0x3f..,
     * (u2 >> 4 & 0x0f..) | (u1 >> 2 & 0x30..) */
    const __m128i u02 = _mm_shuffle_epi32(u, _MM_SHUFFLE(2, 1, 2, 0)); /* u0 u2 u1 u2 */
    const __m128i u01 = _mm_shuffle_epi32(u, _MM_SHUFFLE(1, 1, 0, 0)); /* u0 u0 u1 u1 */
    const __m128i low = _mm_and_si128(_mm_srlv_epi32(u02, _mm_setr_epi32(0, 0, 0, 4)),
                                      _mm_setr_epi32(0x3f3f3f3f, 0xf0f0f0f, 0x3f3f3f3f, 0xf0f0f0f));
    const __m128i high = _mm_and_si128(_mm_srli_epi32(u01, 2),
                                       _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    const __m128i v = _mm_or_si128(low, high);
    const __m128 dd = f16x2_at(src); /* d, dmin */
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
    _mm256_storeu_ps(ab, _mm256_mul_ps(_mm256_broadcastss_ps(dd), sc));
    _mm256_storeu_ps(ab + 8, _mm256_mul_ps(lane1(dd), f32_hi(v)));
}

/* Sub-blocks 2p and 2p+1 share qs[32p..32p+31]: low nibbles, then high. */
#define Q4_K_BLOCK 256
#define Q4_K_BYTES 144
ALWAYS_INLINE void deq_Q4_K(const uint8_t *src, sink_t s) {
    float ab[16];
    k_scales(src, ab);
    for (int p = 0; p < 4; p++) {
        const __m128i v0 = load16(src + 16 + 32 * p), v1 = load16(src + 32 + 32 * p);
        const __m256 d0 = _mm256_set1_ps(ab[2 * p]), m0 = _mm256_set1_ps(ab[8 + 2 * p]);
        const __m256 d1 = _mm256_set1_ps(ab[2 * p + 1]), m1 = _mm256_set1_ps(ab[9 + 2 * p]);
        put_mul_sub(s, 64 * p, lo_nibbles(v0), d0, m0);
        put_mul_sub(s, 64 * p + 16, lo_nibbles(v1), d0, m0);
        put_mul_sub(s, 64 * p + 32, hi_nibbles(v0), d1, m1);
        put_mul_sub(s, 64 * p + 48, hi_nibbles(v1), d1, m1);
    }
}

/* bit j of each byte of v, moved to bit 4 (the 16-bit shift keeps each byte's own
 * bit there: it moves bits by at most 4 within a byte) */
ALWAYS_INLINE __m128i bit_to_4(__m128i v, int j) {
    const __m128i s = j <= 4 ? _mm_slli_epi16(v, 4 - j) : _mm_srli_epi16(v, j - 4);
    return _mm_and_si128(s, _mm_set1_epi8(16));
}

/* Sub-block j: nibble j%2 of qs[32(j/2) + l], bit 4 from bit j of qh[l]. */
#define Q5_K_BLOCK 256
#define Q5_K_BYTES 176
ALWAYS_INLINE void deq_Q5_K(const uint8_t *src, sink_t s) {
    float ab[16];
    k_scales(src, ab);
    const __m128i h0 = load16(src + 16), h1 = load16(src + 32);
    for (int p = 0; p < 4; p++) {
        const __m128i v0 = load16(src + 48 + 32 * p), v1 = load16(src + 64 + 32 * p);
        for (int e = 0; e < 2; e++) {
            const int j = 2 * p + e;
            const __m256 d = _mm256_set1_ps(ab[j]), m = _mm256_set1_ps(ab[8 + j]);
            const __m128i q0 = e ? hi_nibbles(v0) : lo_nibbles(v0);
            const __m128i q1 = e ? hi_nibbles(v1) : lo_nibbles(v1);
            put_mul_sub(s, 32 * j, _mm_or_si128(q0, bit_to_4(h0, j)), d, m);
            put_mul_sub(s, 32 * j + 16, _mm_or_si128(q1, bit_to_4(h1, j)), d, m);
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
    const __m128i three0 = _mm_set1_epi8(0x30), bias = _mm_set1_epi8(32);
    for (int c = 0; c < 2; c++)
        for (int h = 0; h < 2; h++) {
            const __m128i qh = load16(src + 128 + 32 * c + 16 * h);
            /* bits 2t..2t+1 at bits 4..5, for t = 0..3 */
            const __m128i hb[4] = {
                _mm_and_si128(_mm_slli_epi16(qh, 4), three0),
                _mm_and_si128(_mm_slli_epi16(qh, 2), three0),
                _mm_and_si128(qh, three0),
                _mm_and_si128(_mm_srli_epi16(qh, 2), three0),
            };
            for (int t2 = 0; t2 < 2; t2++) {
                const __m128i ql = load16(src + 64 * c + 32 * t2 + 16 * h);
                for (int half = 0; half < 2; half++) {
                    const int t = 2 * half + t2;
                    const __m128i lo = half ? hi_nibbles(ql) : lo_nibbles(ql);
                    const __m128i q = _mm_sub_epi8(_mm_or_si128(lo, hb[t]), bias);
                    const int i = 128 * c + 32 * t + 16 * h;
                    put_mul(s, i, q, _mm256_set1_ps(dl[i / 16]));
                }
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
    const __m128i three = _mm_set1_epi8(3);
    for (int c = 0; c < 2; c++)
        for (int h = 0; h < 2; h++) {
            const __m128i v = load16(src + 16 + 32 * c + 16 * h);
            for (int u = 0; u < 4; u++) {
                const int i = c * 128 + u * 32 + 16 * h;
                const __m128i q = _mm_and_si128(_mm_srli_epi16(v, 2 * u), three);
                put_mul_sub(s, i, q, _mm256_set1_ps(dl[i / 16]), _mm256_set1_ps(ml[i / 16]));
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
    const __m128i three = _mm_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
        const __m128i hm = load16(src + 16 * h);
        for (int c = 0; c < 2; c++) {
            const __m128i v = load16(src + 32 + 32 * c + 16 * h);
            for (int u = 0; u < 4; u++) {
                const int i = c * 128 + u * 32 + 16 * h, bit = 4 * c + u;
                const __m128i lo = _mm_and_si128(_mm_srli_epi16(v, 2 * u), three);
                /* k - 4 = low bits - (4 where the hmask bit is clear) */
                const __m128i m = _mm_set1_epi8((char)(1 << bit));
                const __m128i set = _mm_cmpeq_epi8(_mm_and_si128(hm, m), m);
                const __m128i q = _mm_sub_epi8(lo, _mm_andnot_si128(set, _mm_set1_epi8(4)));
                put_mul(s, i, q, _mm256_set1_ps(dl[i / 16]));
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
    const __m128i kv = iq4_values();
    for (int j = 0; j < 8; j++) {
        const int low = (src[4 + j / 2] >> (4 * (j % 2))) & 15;
        const int sc = (low | ((high >> (2 * j)) & 3) << 4) - 32;
        const __m256 dl = _mm256_set1_ps(d * (float)sc);
        const __m128i v = load16(src + 8 + 16 * j);
        put_mul(s, 32 * j, _mm_shuffle_epi8(kv, lo_nibbles(v)), dl);
        put_mul(s, 32 * j + 16, _mm_shuffle_epi8(kv, hi_nibbles(v)), dl);
    }
}

/* MXFP4 (common.h; MXFP4_BLOCK, MXFP4_BYTES): the codes looked up as int8 in its
 * doubled e2m1 values, times the block's scale 2^(e - 128). */
ALWAYS_INLINE void deq_MXFP4(const uint8_t *src, sink_t s) {
    const __m256 d = _mm256_set1_ps(e8m0_half(src[0]));
    const __m128i v = load16(src + 1), kv = load16((const uint8_t *)MXFP4_VALUES);
    put_mul(s, 0, _mm_shuffle_epi8(kv, lo_nibbles(v)), d);
    put_mul(s, 16, _mm_shuffle_epi8(kv, hi_nibbles(v)), d);
}

/* The i-quants and ternary types (iquants.h, the block layouts and tables), 8 weights
 * at a time. IQ1_S to IQ3_S: a grid row of 8 (or two of 4) widened to f32 and scaled,
 * signs flipped by a mask (IQ1_S, IQ1_M: the delta added first); TQ1_0 and TQ2_0: table
 * lookups. The same operations as gguf's reference, so the same bits. */
#include "iquants.h"
ALWAYS_INLINE uint64_t u64_at(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* db * the 8 grid bytes of row, with the sign bit of lane j flipped where bit j of signs is set */
ALWAYS_INLINE __m256 iq_row8(__m256 db, uint64_t row, uint32_t signs) {
    const __m256 g = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)row)));
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i on = _mm256_and_si256(_mm256_set1_epi32((int)signs), bit);
    const __m256i set = _mm256_cmpeq_epi32(on, bit);
    const __m256i flip = _mm256_and_si256(set, _mm256_set1_epi32((int)0x80000000));
    return _mm256_xor_ps(_mm256_mul_ps(db, g), _mm256_castsi256_ps(flip));
}

/* grid rows a and b of 4 bytes, as one row of 8 */
ALWAYS_INLINE uint64_t rows4(const uint8_t *grid, int a, int b) {
    return u32_at(grid + 4 * a) | (uint64_t)u32_at(grid + 4 * b) << 32;
}

ALWAYS_INLINE void deq_IQ2_XXS(const uint8_t *src, sink_t s) {
    const float d = f16_at(src);
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *q = src + 2 + 8 * ib;
        const uint32_t aux = u32_at(q + 4);
        const __m256 db = _mm256_set1_ps(d * (0.5f + (float)(aux >> 28)) * 0.25f);
        for (int l = 0; l < 4; l++)
            emit(s, 32 * ib + 8 * l,
                 iq_row8(db, u64_at(iq2xxs_grid + 8 * q[l]), ksigns[(aux >> (7 * l)) & 127]));
    }
}

/* IQ2_XS: db[k] = d * (0.5f + sc) * 0.25f for the 16 4-bit scales (one per 16 weights)
 * of the 8 bytes at scales, converted together and broadcast from memory, where one
 * scalar chain per 8 weights held the vector code up. */
ALWAYS_INLINE void iq2_scales(float d, const uint8_t *scales, float *db) {
    const __m128i v = _mm_loadl_epi64((const __m128i *)scales), low4 = _mm_set1_epi8(15);
    const __m128i sc = _mm_unpacklo_epi8(_mm_and_si128(v, low4),
                                         _mm_and_si128(_mm_srli_epi16(v, 4), low4));
    const __m256 dv = _mm256_set1_ps(d), half = _mm256_set1_ps(0.5f), quarter = _mm256_set1_ps(0.25f);
    const __m256 f[2] = {_mm256_add_ps(half, f32_lo(sc)), _mm256_add_ps(half, f32_hi(sc))};
    for (int h = 0; h < 2; h++)
        _mm256_storeu_ps(db + 8 * h, _mm256_mul_ps(_mm256_mul_ps(dv, f[h]), quarter));
    __asm__ volatile("" ::: "memory"); /* broadcast db from memory, as k_scales */
}

ALWAYS_INLINE void deq_IQ2_XS(const uint8_t *src, sink_t s) {
    float db[16];
    iq2_scales(f16_at(src), src + 66, db);
    for (int e = 0; e < 32; e++) {
        const uint16_t q = u16_at(src + 2 + 2 * e);
        emit(s, 8 * e, iq_row8(_mm256_set1_ps(db[e / 2]), u64_at(iq2xs_grid + 8 * (q & 511)),
                               ksigns[q >> 9]));
    }
}

ALWAYS_INLINE void deq_IQ2_S(const uint8_t *src, sink_t s) {
    const float d = f16_at(src);
    const uint8_t *qs = src + 2, *signs = src + 34, *qh = src + 66, *scales = src + 74;
    for (int e = 0; e < 32; e++) {
        const int index = qs[e] | (((qh[e / 4] >> (2 * (e % 4))) & 3) << 8);
        const int sc = (scales[e / 4] >> (4 * ((e / 2) & 1))) & 15;
        const __m256 db = _mm256_set1_ps(d * (0.5f + (float)sc) * 0.25f);
        emit(s, 8 * e, iq_row8(db, u64_at(iq2s_grid + 8 * index), signs[e]));
    }
}

ALWAYS_INLINE void deq_IQ3_XXS(const uint8_t *src, sink_t s) {
    const float d = f16_at(src);
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *q = src + 2 + 8 * ib;
        const uint32_t aux = u32_at(src + 66 + 4 * ib);
        const __m256 db = _mm256_set1_ps(d * (0.5f + (float)(aux >> 28)) * 0.5f);
        for (int l = 0; l < 4; l++)
            emit(s, 32 * ib + 8 * l, iq_row8(db, rows4(iq3xxs_grid, q[2 * l], q[2 * l + 1]),
                                             ksigns[(aux >> (7 * l)) & 127]));
    }
}

ALWAYS_INLINE void deq_IQ3_S(const uint8_t *src, sink_t s) {
    const float d = f16_at(src);
    const uint8_t *qs = src + 2, *qh = src + 66, *signs = src + 74, *scales = src + 106;
    for (int ib = 0; ib < 8; ib++) {
        const int sc = (scales[ib / 2] >> (4 * (ib & 1))) & 15;
        const __m256 db = _mm256_set1_ps(d * (float)(1 + 2 * sc));
        for (int l = 0; l < 4; l++) {
            const int e = 8 * ib + 2 * l, h = qh[ib] >> (2 * l);
            const uint64_t row =
                rows4(iq3s_grid, qs[e] | (h & 1) << 8, qs[e + 1] | (h >> 1 & 1) << 8);
            emit(s, 32 * ib + 8 * l, iq_row8(db, row, signs[4 * ib + l]));
        }
    }
}

/* dl * (row + delta) for grid row `index` of IQ1_S/IQ1_M */
ALWAYS_INLINE __m256 iq1_row8(__m256 dl, int index, __m256 delta) {
    const uint64_t bytes = u64_at((const uint8_t *)iq1s_grid + 8 * index);
    const __m256 g = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128((long long)bytes)));
    return _mm256_mul_ps(dl, _mm256_add_ps(g, delta));
}

/* IQ1_DELTA, negated where `negate` (0 or 1): its sign bit set, without a branch on
 * random bits */
ALWAYS_INLINE __m256 iq1_delta(uint32_t negate) {
    return _mm256_castsi256_ps(_mm256_set1_epi32((int)(0x3E000000u | negate << 31)));
}

ALWAYS_INLINE void deq_IQ1_S(const uint8_t *src, sink_t s) {
    const float d = f16_at(src);
    for (int ib = 0; ib < 8; ib++) {
        const uint16_t h = u16_at(src + 34 + 2 * ib);
        const __m256 dl = _mm256_set1_ps(d * (float)(2 * ((h >> 12) & 7) + 1));
        const __m256 delta = iq1_delta(h >> 15);
        for (int l = 0; l < 4; l++)
            emit(s, 32 * ib + 8 * l,
                 iq1_row8(dl, src[2 + 4 * ib + l] | (((h >> (3 * l)) & 7) << 8), delta));
    }
}

ALWAYS_INLINE void deq_IQ1_M(const uint8_t *src, sink_t s) {
    uint16_t sc[4];
    memcpy(sc, src + 48, 8);
    const uint16_t bits = (uint16_t)((sc[0] >> 12) | ((sc[1] >> 8) & 0x00F0) |
                                     ((sc[2] >> 4) & 0x0F00) | (sc[3] & 0xF000));
    uint8_t d16[2];
    memcpy(d16, &bits, 2);
    const float d = f16_at(d16);
    for (int k = 0; k < 16; k++) {
        const int qh = src[32 + k];
        const __m256 dl = _mm256_set1_ps(d * (float)(2 * ((sc[k / 4] >> (3 * (k % 4))) & 7) + 1));
        emit(s, 16 * k, iq1_row8(dl, src[2 * k] | (qh & 7) << 8, iq1_delta(qh >> 3 & 1)));
        emit(s, 16 * k + 8, iq1_row8(dl, src[2 * k + 1] | (qh >> 4 & 7) << 8, iq1_delta(qh >> 7)));
    }
}

/* Ternary weights, 8 at a time: digit indices into a table of d * (k - 1) (lanes k and
 * k + 4 alike), read by vpermps from the index's low 3 bits, so a shift alone picks
 * TQ2_0's 2-bit digit. TQ1_0's digit k of byte q is the top of (q * 3^k mod 256) * 3
 * over 8 bits, per dword lane. */
ALWAYS_INLINE __m256 tq_table(const uint8_t *d16) {
    const __m256i k = _mm256_setr_epi32(-1, 0, 1, 2, -1, 0, 1, 2);
    return _mm256_mul_ps(_mm256_set1_ps(f16_at(d16)), _mm256_cvtepi32_ps(k));
}

/* 8 bytes -> 8 dword lanes, zero-extended */
ALWAYS_INLINE __m256i spread8(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

ALWAYS_INLINE __m256i tq1_digit(__m256i v, __m256i pow3) {
    const __m256i q = _mm256_and_si256(_mm256_mullo_epi32(v, pow3), _mm256_set1_epi32(255));
    return _mm256_srli_epi32(_mm256_add_epi32(q, _mm256_slli_epi32(q, 1)), 8);
}

ALWAYS_INLINE void deq_TQ1_0(const uint8_t *src, sink_t s) {
    static const int pow3[5] = {1, 3, 9, 27, 81};
    const __m256 t = tq_table(src + 52);
    __m256i v[6];
    for (int j = 0; j < 6; j++) v[j] = spread8(src + 8 * j);
    for (int p = 0; p < 5; p++) {
        const __m256i m = _mm256_set1_epi32(pow3[p]);
        for (int j = 0; j < 4; j++)
            emit(s, 32 * p + 8 * j, _mm256_permutevar8x32_ps(t, tq1_digit(v[j], m)));
        for (int j = 0; j < 2; j++)
            emit(s, 160 + 16 * p + 8 * j, _mm256_permutevar8x32_ps(t, tq1_digit(v[4 + j], m)));
    }
    /* the last 4 bytes' 4 digits: weight 240 + 4p + i from byte 48 + i */
    const __m256i v4 = _mm256_cvtepu8_epi32(_mm_set1_epi32((int)u32_at(src + 48)));
    emit(s, 240, _mm256_permutevar8x32_ps(
                     t, tq1_digit(v4, _mm256_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3))));
    emit(s, 248, _mm256_permutevar8x32_ps(
                     t, tq1_digit(v4, _mm256_setr_epi32(9, 9, 9, 9, 27, 27, 27, 27))));
}

ALWAYS_INLINE void deq_TQ2_0(const uint8_t *src, sink_t s) {
    const __m256 t = tq_table(src + 64);
    for (int c = 0; c < 2; c++)
        for (int j = 0; j < 4; j++) {
            const __m256i v = spread8(src + 32 * c + 8 * j);
            for (int l = 0; l < 4; l++)
                emit(s, 128 * c + 32 * l + 8 * j,
                     _mm256_permutevar8x32_ps(t, _mm256_srli_epi32(v, 2 * l)));
        }
}

/* Kernels per type: each block is dequantized into multiply-adds with up to MAX_M
 * activation rows (sink_t). */

ALWAYS_INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

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
            __m256 acc[MAX_M][4];                                                        \
            for (int i = 0; i < m; i++)                                                  \
                for (int j = 0; j < 4; j++) acc[i][j] = _mm256_setzero_ps();             \
            /* runs of RUN blocks (32 weights), so blocks of 8 use all accumulators */   \
            int64_t b = 0;                                                               \
            for (; b + RUN <= nb; b += RUN) {                                            \
                const uint8_t *src = row + b * T##_BYTES;                                \
                /* one prefetch per 64 bytes of blocks */                                \
                if (src + PREFETCH + RUN * T##_BYTES <= end &&                           \
                    (RUN * T##_BYTES >= 64 ||                                            \
                     ((uintptr_t)src ^ ((uintptr_t)src + RUN * T##_BYTES)) >= 64))       \
                    for (int l = 0; l < RUN * T##_BYTES; l += 64)                        \
                        _mm_prefetch((const char *)src + PREFETCH + l, _MM_HINT_T0);     \
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
                __m256 sum = acc[i][0];                                                  \
                for (int j = 1; j < a; j++) sum = _mm256_add_ps(sum, acc[i][j]);         \
                y[i * ldy + r] = hsum(sum) + (bias ? bias[r] : 0.0f);                    \
            }                                                                            \
        }                                                                                \
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

/* matvec_T: every row pass through rows_T (but for Q4_K, Q5_K and Q6_K, below) */
#define DEFINE_MATVEC(T)                                                                 \
    static void matvec_##T(const uint8_t *w, int64_t stride, int64_t rows, const float *x, \
                           int64_t m, int64_t n, float *y, const float *bias) {          \
        ROW_PASSES(x, rows_##T);                                                         \
    }

DEFINE_MATVEC(F32)
DEFINE_MATVEC(F16)
DEFINE_MATVEC(BF16)
DEFINE_MATVEC(Q4_0)
DEFINE_MATVEC(Q4_1)
DEFINE_MATVEC(Q5_0)
DEFINE_MATVEC(Q5_1)
DEFINE_MATVEC(Q8_0)
DEFINE_MATVEC(Q2_K)
DEFINE_MATVEC(Q3_K)
DEFINE_MATVEC(IQ4_NL)
DEFINE_MATVEC(IQ4_XS)
DEFINE_MATVEC(MXFP4)
#define DEFINE_IQ_KERNELS(T, _) DEFINE_KERNELS(T) DEFINE_MATVEC(T)
IQ_TYPES(DEFINE_IQ_KERNELS, _)

/* Q4_K and Q5_K for one or two activation rows (decoding), with factored scales:
 * y = sum_j (d*sc_j) S_j - sum_j (dmin*m_j) X_j over the sub-blocks j of 32 weights,
 * S_j = sum q x and X_j = sum x. The quants are not dequantized: each goes to a dword
 * whole (see permute_masked), is converted to f32 exactly, and takes one multiply-add
 * per 8 weights. x is reordered once per call to match (xp), and each sub-block's sum
 * X_j taken then (xs). More rows go through rows_T, which dequantizes each block once
 * for all. */

/* Q6_K: bytes 4k..4k+3 of each 128-bit lane to the top byte of each dword, zeros below
 * (for signed values) */
ALWAYS_INLINE __m256i high_byte_index(int k) {
    const int z = 0x808080;
    return _mm256_setr_epi32(4 * k << 24 | z, (4 * k + 1) << 24 | z, (4 * k + 2) << 24 | z,
                             (4 * k + 3) << 24 | z, 4 * k << 24 | z, (4 * k + 1) << 24 | z,
                             (4 * k + 2) << 24 | z, (4 * k + 3) << 24 | z);
}

/* the sum of x[0..31] */
ALWAYS_INLINE float sum32(const float *x) {
    const __m256 a = _mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8));
    const __m256 b = _mm256_add_ps(_mm256_loadu_ps(x + 16), _mm256_loadu_ps(x + 24));
    return hsum(_mm256_add_ps(a, b));
}

/* Q6_K's order (high_byte_index's): xp[32s + 8k + i] = x[32s + 4k + i] and
 * xp[32s + 8k + 4 + i] = x[32s + 16 + 4k + i] for i < 4. No sums: Q6_K has no mins. */
static void permute_q6_k(const float *x, int64_t n, float *xp, float *xs) {
    (void)xs;
    for (int64_t s = 0; s < n / 32; s++) {
        const float *src = x + 32 * s;
        float *dst = xp + 32 * s;
        for (int k = 0; k < 4; k++) {
            _mm_storeu_ps(dst + 8 * k, _mm_loadu_ps(src + 4 * k));
            _mm_storeu_ps(dst + 8 * k + 4, _mm_loadu_ps(src + 16 + 4 * k));
        }
    }
}

/* Q4_K and Q5_K without byte shuffles. The 32 bytes of quants of sub-blocks 2p and
 * 2p+1 are eight dwords. Q4_K: masking nibble e of each (e = 2k + h: byte k, low or high
 * nibble) leaves q * 2^(4e) of weight 4i + k of sub-block 2p + h in lane i (the top
 * nibble, which would be negative, is shifted down instead: e = 0 there). Q5_K: byte k
 * of the 5-bit values of sub-block j (deq_Q5_K's), masked, leaves q * 2^(8k). Either is
 * converted exactly (at most 5 significant bits). x is ordered and scaled to match:
 * xp[32s + 8k + i] = x[32s + 4i + k] * 2^-shift for sub-block s, so each product is
 * q * x itself. Scaling by a power of two is exact unless x * 2^-shift falls below
 * f32's normal range (|x| < 2^-102), where a product is off by less than 2^-120.
 * Shuffles and conversions share the CPU ports that bound this loop: without the
 * shuffles Q4_K runs 1.1-1.2x as fast on Zen 3 (Q5_K, bound by building its 5-bit
 * values, as fast as with them). */
ALWAYS_INLINE int mask_shift(int k, int h, const int five) {
    return five ? 8 * k : k == 3 && h ? 0 : 8 * k + 4 * h;
}

ALWAYS_INLINE void permute_masked(const float *x, int64_t n, float *xp, float *xs,
                                  const int five) {
    for (int64_t s = 0; s < n / 32; s++) {
        const float *src = x + 32 * s;
        __m128 r[8];
        for (int i = 0; i < 8; i++) r[i] = _mm_loadu_ps(src + 4 * i);
        _MM_TRANSPOSE4_PS(r[0], r[1], r[2], r[3]); /* r[k]: x[4i + k], i < 4 */
        _MM_TRANSPOSE4_PS(r[4], r[5], r[6], r[7]); /* r[4 + k]: x[4i + k], 4 <= i < 8 */
        for (int k = 0; k < 4; k++) {
            const int shift = mask_shift(k, (int)(s % 2), five);
            const __m256 scale = _mm256_set1_ps(1.0f / (float)(1 << shift));
            _mm256_storeu_ps(xp + 32 * s + 8 * k,
                             _mm256_mul_ps(_mm256_set_m128(r[4 + k], r[k]), scale));
        }
        xs[s] = sum32(src);
    }
}

static void permute_q4_k(const float *x, int64_t n, float *xp, float *xs) {
    permute_masked(x, n, xp, xs, 0);
}

static void permute_q5_k(const float *x, int64_t n, float *xp, float *xs) {
    permute_masked(x, n, xp, xs, 1);
}

ALWAYS_INLINE void rows_k_few(const uint8_t *w, int64_t stride, int64_t r0, int64_t r1,
                              const float *xp, const int m, int64_t n, float *y, int64_t ldy,
                              const float *bias, const float *xs, const int five) {
    const int bytes = five ? Q5_K_BYTES : Q4_K_BYTES;
    const int64_t nb = n / 256;
    const uint8_t *end = w + r1 * stride;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * stride;
        __m256 accd[MAX_M][2], accm[MAX_M]; /* m <= 2 here */
        for (int i = 0; i < m; i++) {
            accd[i][0] = accd[i][1] = accm[i] = _mm256_setzero_ps();
        }
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *src = row + b * bytes;
            if (src + PREFETCH + bytes <= end)
                for (int l = 0; l < bytes; l += 64)
                    _mm_prefetch((const char *)src + PREFETCH + l, _MM_HINT_T0);
            float ab[16];
            k_scales(src, ab);
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(src + 16));
            for (int p = 0; p < 4; p++) {
                const __m256i v =
                    _mm256_loadu_si256((const __m256i *)(src + (five ? 48 : 16) + 32 * p));
                for (int h = 0; h < 2; h++) {
                    const int j = 2 * p + h;
                    __m256i qj = v; /* Q4_K: masked as it is */
                    if (five) { /* nibble h, and bit j of each qh byte to bit 4 (16-bit
                                 * shifts move it by at most 4, within its byte) */
                        const __m256i sh = j <= 4 ? _mm256_slli_epi16(qh, 4 - j)
                                                  : _mm256_srli_epi16(qh, j - 4);
                        qj = _mm256_or_si256(
                            _mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(15)),
                            _mm256_and_si256(sh, _mm256_set1_epi8(16)));
                    }
                    __m256 q[4];
                    for (int k = 0; k < 4; k++) {
                        const int shift = mask_shift(k, h, five);
                        const __m256i bits = _mm256_set1_epi32((five ? 31 : 15) << shift);
                        q[k] = _mm256_cvtepi32_ps(shift || !k ? _mm256_and_si256(qj, bits)
                                                              : _mm256_srli_epi32(qj, 28));
                    }
                    const __m256 dsc = _mm256_broadcast_ss(ab + j);
                    for (int i = 0; i < m; i++) {
                        const float *xj = xp + i * n + 256 * b + 32 * j;
                        __m256 s0 = _mm256_mul_ps(q[0], _mm256_loadu_ps(xj));
                        __m256 s1 = _mm256_mul_ps(q[1], _mm256_loadu_ps(xj + 8));
                        s0 = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xj + 16), s0);
                        s1 = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xj + 24), s1);
                        accd[i][h] = _mm256_fmadd_ps(_mm256_add_ps(s0, s1), dsc, accd[i][h]);
                    }
                }
            }
            const __m256 dm = _mm256_loadu_ps(ab + 8);
            for (int i = 0; i < m; i++)
                accm[i] = _mm256_fmadd_ps(dm, _mm256_loadu_ps(xs + i * (n / 32) + 8 * b), accm[i]);
        }
        for (int i = 0; i < m; i++)
            y[i * ldy + r] = (hsum(_mm256_add_ps(accd[i][0], accd[i][1])) - hsum(accm[i])) +
                             (bias ? bias[r] : 0.0f);
    }
}

ALWAYS_INLINE void rows_q4_k_few(const uint8_t *w, int64_t stride, int64_t r0, int64_t r1,
                                 const float *xp, const int m, int64_t n, float *y,
                                 int64_t ldy, const float *bias, const float *xs) {
    rows_k_few(w, stride, r0, r1, xp, m, n, y, ldy, bias, xs, 0);
}

ALWAYS_INLINE void rows_q5_k_few(const uint8_t *w, int64_t stride, int64_t r0, int64_t r1,
                                 const float *xp, const int m, int64_t n, float *y,
                                 int64_t ldy, const float *bias, const float *xs) {
    rows_k_few(w, stride, r0, r1, xp, m, n, y, ldy, bias, xs, 1);
}

/* Q6_K for one or two activation rows, as Q4_K's: w = (d*sc) * (q - 32) for each 16
 * weights (deq_Q6_K), q - 32 put in the top byte of a dword by a byte shuffle, so the
 * dword is (q - 32) * 2^24, converted exactly; each 16 weights' sum is scaled once by
 * d*sc*2^-24 (a power of two away from the reference's scale: the same rounding). The
 * 32 weights c*128 + t*32 + l (l < 32) are one vector of bytes, l in byte order, so x
 * takes permute_q6_k's order. */
ALWAYS_INLINE void rows_q6_k_few(const uint8_t *w, int64_t stride, int64_t r0, int64_t r1,
                                 const float *xp, const int m, int64_t n, float *y,
                                 int64_t ldy, const float *bias, const float *xs) {
    (void)xs;
    const int64_t nb = n / 256;
    const uint8_t *end = w + r1 * stride;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * stride;
        __m256 acc[MAX_M][4]; /* m <= 2 here */
        for (int i = 0; i < m; i++)
            acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *src = row + b * Q6_K_BYTES;
            if (src + PREFETCH + Q6_K_BYTES <= end)
                for (int l = 0; l < Q6_K_BYTES; l += 64)
                    _mm_prefetch((const char *)src + PREFETCH + l, _MM_HINT_T0);
            /* dl[j] = d * sc[j] * 2^-24, as (d * 2^-24) * sc[j]: the power of two is exact */
            float dl[16] __attribute__((aligned(32)));
            const __m128i sc = load16(src + 192);
            const __m256 d24 = _mm256_set1_ps(f16_at(src + 208) * 0x1p-24f);
            _mm256_store_ps(dl, _mm256_mul_ps(d24, f32_lo(sc)));
            _mm256_store_ps(dl + 8, _mm256_mul_ps(d24, f32_hi(sc)));
            const __m256i nib = _mm256_set1_epi8(15), three0 = _mm256_set1_epi8(0x30);
            const __m256i bias32 = _mm256_set1_epi8(32);
            for (int c = 0; c < 2; c++) {
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(src + 128 + 32 * c));
                for (int t2 = 0; t2 < 2; t2++) {
                    const __m256i ql =
                        _mm256_loadu_si256((const __m256i *)(src + 64 * c + 32 * t2));
                    for (int half = 0; half < 2; half++) {
                        const int t = 2 * half + t2;
                        const __m256i lo =
                            half ? _mm256_and_si256(_mm256_srli_epi16(ql, 4), nib)
                                 : _mm256_and_si256(ql, nib);
                        /* bits 2t..2t+1 of qh at bits 4..5 */
                        const __m256i hb =
                            t == 0   ? _mm256_slli_epi16(qh, 4)
                            : t == 1 ? _mm256_slli_epi16(qh, 2)
                            : t == 2 ? qh
                                     : _mm256_srli_epi16(qh, 2);
                        const __m256i q = _mm256_sub_epi8(
                            _mm256_or_si256(lo, _mm256_and_si256(hb, three0)), bias32);
                        __m256 wv[4];
                        for (int k = 0; k < 4; k++)
                            wv[k] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(q, high_byte_index(k)));
                        const int g = 8 * c + 2 * t; /* the scales of lanes 0..3 and 4..7 */
                        const __m256 sc = _mm256_insertf128_ps(
                            _mm256_castps128_ps256(_mm_broadcast_ss(dl + g)),
                            _mm_broadcast_ss(dl + g + 1), 1);
                        for (int i = 0; i < m; i++) {
                            const float *xj = xp + i * n + 256 * b + 32 * (4 * c + t);
                            __m256 s0 = _mm256_mul_ps(wv[0], _mm256_loadu_ps(xj));
                            __m256 s1 = _mm256_mul_ps(wv[1], _mm256_loadu_ps(xj + 8));
                            s0 = _mm256_fmadd_ps(wv[2], _mm256_loadu_ps(xj + 16), s0);
                            s1 = _mm256_fmadd_ps(wv[3], _mm256_loadu_ps(xj + 24), s1);
                            acc[i][t] = _mm256_fmadd_ps(_mm256_add_ps(s0, s1), sc, acc[i][t]);
                        }
                    }
                }
            }
        }
        for (int i = 0; i < m; i++)
            y[i * ldy + r] = hsum(_mm256_add_ps(_mm256_add_ps(acc[i][0], acc[i][1]),
                                                _mm256_add_ps(acc[i][2], acc[i][3]))) +
                             (bias ? bias[r] : 0.0f);
    }
}

/* matvec_T and experts_T (llmrun_matvec_experts' pass) for T's few-rows kernel ROWS:
 * one or two rows through ROWS on x in PERMUTE's order, more through rows_T. The
 * experts' x is permuted once per expert (once for all where x_step is 0). */
#define DEFINE_FEW_ROWS(T, ROWS, PERMUTE)                                                \
    static void matvec_##T(const uint8_t *w, int64_t stride, int64_t rows, const float *x, \
                           int64_t m, int64_t n, float *y, const float *bias) {          \
        if (m > 2) {                                                                     \
            ROW_PASSES(x, rows_##T);                                                     \
            return;                                                                      \
        }                                                                                \
        float *xp = malloc(sizeof(float) * (size_t)(m * n + m * (n / 32)));              \
        if (xp == NULL) return;                                                          \
        float *xs = xp + m * n;                                                          \
        for (int64_t i = 0; i < m; i++)                                                  \
            PERMUTE(x + i * n, n, xp + i * n, xs + i * (n / 32));                        \
        ROW_PASSES(xp, ROWS, xs);                                                        \
        free(xp);                                                                        \
    }                                                                                    \
    static int experts_##T(const int64_t *ws, int64_t stride, int64_t rows, const float *x, \
                           int64_t x_step, int64_t n, float *y, int64_t count) {         \
        const int64_t copies = x_step ? count : 1, sums = n / 32;                        \
        float *xp = malloc(sizeof(float) * (size_t)(copies * (n + sums)));               \
        if (xp == NULL) return 0;                                                        \
        float *xs = xp + copies * n;                                                     \
        for (int64_t c = 0; c < copies; c++)                                             \
            PERMUTE(x + c * x_step, n, xp + c * n, xs + c * sums);                       \
        const int64_t chunk = row_chunk(stride, rows);                                   \
        const int64_t pieces = (rows + chunk - 1) / chunk;                               \
        _Pragma("omp parallel for schedule(dynamic)")                                    \
        for (int64_t p = 0; p < count * pieces; p++) {                                   \
            const int64_t j = p / pieces, r0 = p % pieces * chunk, c = x_step ? j : 0;   \
            const int64_t r1 = r0 + chunk < rows ? r0 + chunk : rows;                    \
            ROWS((const uint8_t *)(intptr_t)ws[j], stride, r0, r1, xp + c * n, 1, n,     \
                 y + j * rows, rows, NULL, xs + c * sums);                               \
        }                                                                                \
        free(xp);                                                                        \
        return 0;                                                                        \
    }

DEFINE_FEW_ROWS(Q4_K, rows_q4_k_few, permute_q4_k)
DEFINE_FEW_ROWS(Q5_K, rows_q5_k_few, permute_q5_k)
DEFINE_FEW_ROWS(Q6_K, rows_q6_k_few, permute_q6_k)

/* Packed layouts (Q4_0_PACKED, Q5_0_PACKED; common.h and quant/kernels.py define
 * them): the same blocks, each row stored field by field: its f16 scales, (Q5_0) its
 * u32 high-bit words, then its 16-byte quants in block order. A 32-byte load holds the
 * quants of two blocks, one per 128-bit lane. Per lane, byte operations put each
 * weight's signed value q-8 (Q4_0) or q-16 (Q5_0) into the top bits of a byte, with
 * zeros below, and a byte shuffle moves byte j of each dword to the top byte of that
 * dword, zeroing the rest: the dword is then the integer (q-8)*2^28 (or
 * (q-16)*2^27), which converts to f32 exactly. Vector k = 2j+h (h: low or high
 * nibble) so holds, in lane i, weight 16h + 4(i%4) + j of block i/4 of the two; x is
 * permuted to match once per call (4x4 transposes). Each row's partial sum over the
 * two blocks is scaled once by [d0 x4, d1 x4], and the row's total by 2^-28 (2^-27):
 * every product w_int * x is exactly 2^28 (2^27) times (q-8) * x in f32, and every
 * sum of them 2^28 times the sum of those, so the result is the one the AVX-512
 * kernels' factored scales give (the power of two only overflows where |x| is beyond
 * ~1e28).
 * Per 8 weights a shuffle, a conversion and one multiply-add per activation row.
 * Rows are taken 64 weights at a time. */
#define Q4_0_PACKED_BLOCK 64
#define Q5_0_PACKED_BLOCK 64

/* xp[64g + 8k + 4b + r] = x[64g + 32b + 16(k%2) + 4r + k/2] */
static void permute_x(const float *x, int64_t n, float *xp) {
    for (int64_t g = 0; g < n / 64; g++)
        for (int b = 0; b < 2; b++)
            for (int h = 0; h < 2; h++) {
                const float *src = x + 64 * g + 32 * b + 16 * h;
                __m128 r0 = _mm_loadu_ps(src), r1 = _mm_loadu_ps(src + 4);
                __m128 r2 = _mm_loadu_ps(src + 8), r3 = _mm_loadu_ps(src + 12);
                _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
                float *dst = xp + 64 * g + 4 * b + 8 * h;
                _mm_storeu_ps(dst, r0);
                _mm_storeu_ps(dst + 16, r1);
                _mm_storeu_ps(dst + 32, r2);
                _mm_storeu_ps(dst + 48, r3);
            }
}

/* byte j of each dword to its top byte, zeros below */
ALWAYS_INLINE __m256i top_byte_index(int j) {
    const int z = 0x808080;
    return _mm256_setr_epi32(j << 24 | z, (4 + j) << 24 | z, (8 + j) << 24 | z,
                             (12 + j) << 24 | z, j << 24 | z, (4 + j) << 24 | z,
                             (8 + j) << 24 | z, (12 + j) << 24 | z);
}

/* 0xFF in byte p of lane l where bit p (hi: bit 16 + p) of block l's u32 is clear;
 * qh holds the two blocks' words in each lane */
ALWAYS_INLINE __m256i clear_bytes(__m256i qh, int hi) {
    const long long a = 0x0101010101010101LL, lo0 = hi ? 2 * a : 0, lo1 = 4 * a + lo0;
    const __m256i sel = _mm256_setr_epi64x(lo0, lo0 + a, lo1, lo1 + a);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i b = _mm256_and_si256(_mm256_shuffle_epi8(qh, sel), bit);
    return _mm256_cmpeq_epi8(b, _mm256_setzero_si256());
}

/* Group g of a row (blocks 2g and 2g+1) into acc[i] for the m rows of xp; dv holds
 * [d0 x4, d1 x4] (the rows' sums lose the 2^28 or 2^27 at the end). */
ALWAYS_INLINE void group(const uint8_t *qh, const uint8_t *qs, int64_t g, __m256 dv,
                         const float *xp, const int m, int64_t n, __m256 *acc, const int five) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * g));
    __m256i lo, hi; /* the signed values at the top of each byte */
    if (five) {
        const __m256i h = _mm256_set1_epi64x((long long)u64_at(qh + 8 * g));
        const __m256i nib = _mm256_set1_epi8(0x78), sign = _mm256_set1_epi8((char)0x80);
        lo = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(v, 3), nib),
                             _mm256_and_si256(clear_bytes(h, 0), sign));
        hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 1), nib),
                             _mm256_and_si256(clear_bytes(h, 1), sign));
    } else {
        const __m256i t = _mm256_xor_si256(v, _mm256_set1_epi8((char)0x88));
        const __m256i top = _mm256_set1_epi8((char)0xF0);
        lo = _mm256_and_si256(_mm256_slli_epi16(t, 4), top);
        hi = _mm256_and_si256(t, top);
    }
    __m256 wv[8];
    for (int k = 0; k < 8; k++)
        wv[k] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(k & 1 ? hi : lo, top_byte_index(k >> 1)));
    /* each row's sum over the group (one chain: the rows and groups overlap), then
     * its scales */
    for (int i = 0; i < m; i++) {
        const float *xg = xp + i * n + 64 * g;
        if (m <= 2) {
            __m256 s0 = _mm256_mul_ps(wv[0], _mm256_loadu_ps(xg));
            __m256 s1 = _mm256_mul_ps(wv[1], _mm256_loadu_ps(xg + 8));
            for (int k = 2; k < 8; k += 2) {
                s0 = _mm256_fmadd_ps(wv[k], _mm256_loadu_ps(xg + 8 * k), s0);
                s1 = _mm256_fmadd_ps(wv[k + 1], _mm256_loadu_ps(xg + 8 * k + 8), s1);
            }
            acc[i] = _mm256_fmadd_ps(_mm256_add_ps(s0, s1), dv, acc[i]);
        } else {
            __m256 s = _mm256_mul_ps(wv[0], _mm256_loadu_ps(xg));
            for (int k = 1; k < 8; k++) s = _mm256_fmadd_ps(wv[k], _mm256_loadu_ps(xg + 8 * k), s);
            acc[i] = _mm256_fmadd_ps(s, dv, acc[i]);
        }
    }
}

ALWAYS_INLINE void rows_packed(const uint8_t *w, int64_t stride, int64_t r0, int64_t r1,
                               const float *xp, const int m, int64_t n, float *y,
                               int64_t ldy, const float *bias, const int five) {
    const int64_t nb = n / 32, ng = nb / 2, pair_bytes = stride / ng; /* of 2 blocks */
    const float unit = five ? 0x1p-27f : 0x1p-28f;
    const __m256i pair = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const uint8_t *end = w + r1 * stride;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * stride, *qh = row + 2 * nb;
        const uint8_t *qs = row + (five ? 6 : 2) * nb;
        __m256 acc[MAX_M];
        for (int i = 0; i < m; i++) acc[i] = _mm256_setzero_ps();
        int64_t g = 0;
        /* four groups at a time, their eight scales converted at once */
        for (; g + 4 <= ng; g += 4) {
            /* at the row's pace through all its bytes (scales and high bits too), so the
             * rows ahead come in whole */
            const uint8_t *ahead = row + PREFETCH + pair_bytes * g;
            if (ahead + 4 * pair_bytes <= end) {
                for (int64_t l = 0; l < 4 * pair_bytes; l += 64)
                    _mm_prefetch((const char *)ahead + l, _MM_HINT_T0);
                _mm_prefetch((const char *)ahead + 4 * pair_bytes - 1, _MM_HINT_T0);
            }
            const __m256 d8 = _mm256_cvtph_ps(load16(row + 4 * g));
            for (int u = 0; u < 4; u++) {
                const __m256i pick = _mm256_add_epi32(pair, _mm256_set1_epi32(2 * u));
                group(qh, qs, g + u, _mm256_permutevar8x32_ps(d8, pick), xp, m, n, acc, five);
            }
        }
        for (; g < ng; g++) {
            const __m128 d2 = _mm_cvtph_ps(_mm_cvtsi32_si128((int)u32_at(row + 4 * g)));
            group(qh, qs, g, _mm256_permutevar8x32_ps(_mm256_castps128_ps256(d2), pair), xp, m,
                  n, acc, five);
        }
        /* exact: a power of two (sums this large would be infinite anyway) */
        for (int i = 0; i < m; i++)
            y[i * ldy + r] = hsum(acc[i]) * unit + (bias ? bias[r] : 0.0f);
    }
}

/* One block of a packed row, from its fields' places (common.h: DEFINE_PACKED), weight
 * by weight as the GGML layout's dequantizers. */
ALWAYS_INLINE void deq_packed(const uint8_t *d, const uint8_t *qh, const uint8_t *qs,
                              float *out, const int five) {
    if (five)
        deq_q5_0_fields(_mm_set_ss(f16_at(d)), u32_at(qh), qs, (sink_t){.out = out});
    else
        deq_q4_0_fields(_mm_set_ss(f16_at(d)), qs, (sink_t){.out = out});
}

DEFINE_PACKED(Q4_0_PACKED, 0)
DEFINE_PACKED(Q5_0_PACKED, 1)

/* Q8_0_PACKED (this family's alone): a row's f16 scales, then its 32-byte quants in
 * block order. Each block's 32 int8 are sign-extended straight from memory and
 * converted (exact); each row's sum over the block is scaled once by d, as the packed
 * Q4_0 kernel scales its groups. Per 8 weights one load-extend, one conversion and one
 * multiply-add per activation row (the GGML layout's kernel also shuffles the upper
 * halves down and multiplies by d, and converts every block's scale alone). */
#define Q8_0_PACKED_BLOCK 32

ALWAYS_INLINE __m256 q8_at(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* One block (quants at qs, scale d in every lane) into acc[i] for the m rows of x
 * (xb: the block's first activation). Few rows: each row's sum over the block in two
 * chains (hiding the multiply-add latency), scaled once by d. More rows: the weights
 * d * q once (as deq_Q8_0 computes them), then multiply-adds into every row, whose
 * independent chains hide the latency themselves. */
ALWAYS_INLINE void q8_block(const uint8_t *qs, __m256 d, const float *xb, const int m,
                            int64_t n, __m256 *acc) {
    __m256 w[4];
    for (int k = 0; k < 4; k++) w[k] = q8_at(qs + 8 * k);
    if (m <= 2) {
        for (int i = 0; i < m; i++) {
            const float *xi = xb + i * n;
            __m256 s0 = _mm256_mul_ps(w[0], _mm256_loadu_ps(xi));
            __m256 s1 = _mm256_mul_ps(w[1], _mm256_loadu_ps(xi + 8));
            s0 = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xi + 16), s0);
            s1 = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xi + 24), s1);
            acc[i] = _mm256_fmadd_ps(_mm256_add_ps(s0, s1), d, acc[i]);
        }
        return;
    }
    for (int k = 0; k < 4; k++) w[k] = _mm256_mul_ps(d, w[k]);
    for (int i = 0; i < m; i++)
        for (int k = 0; k < 4; k++)
            acc[i] = _mm256_fmadd_ps(w[k], _mm256_loadu_ps(xb + i * n + 8 * k), acc[i]);
}

ALWAYS_INLINE void rows_q8_packed(const uint8_t *w, int64_t stride, int64_t r0, int64_t r1,
                                  const float *x, const int m, int64_t n, float *y,
                                  int64_t ldy, const float *bias) {
    const int64_t nb = n / 32;
    const uint8_t *end = w + r1 * stride;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * stride, *qs = row + 2 * nb;
        /* odd blocks go to acc1 where few rows leave the chains short */
        __m256 acc0[MAX_M], acc1[MAX_M];
        for (int i = 0; i < m; i++) acc0[i] = acc1[i] = _mm256_setzero_ps();
        int64_t b = 0;
        /* eight blocks at a time, their scales converted at once */
        for (; b + 8 <= nb; b += 8) {
            /* at the row's pace through all its bytes, scales too (34 a block) */
            const uint8_t *ahead = row + PREFETCH + 34 * b;
            if (ahead + 8 * 34 <= end)
                for (int l = 0; l < 8 * 34 + 63; l += 64)
                    _mm_prefetch((const char *)ahead + l, _MM_HINT_T0);
            float d[8];
            _mm256_storeu_ps(d, _mm256_cvtph_ps(load16(row + 2 * b)));
            for (int u = 0; u < 8; u++)
                q8_block(qs + 32 * (b + u), _mm256_broadcast_ss(d + u), x + 32 * (b + u), m, n,
                         m <= 2 && u % 2 ? acc1 : acc0);
        }
        for (; b < nb; b++)
            q8_block(qs + 32 * b, _mm256_set1_ps(f16_at(row + 2 * b)), x + 32 * b, m, n, acc0);
        for (int i = 0; i < m; i++) {
            const __m256 sum = m <= 2 ? _mm256_add_ps(acc0[i], acc1[i]) : acc0[i];
            y[i * ldy + r] = hsum(sum) + (bias ? bias[r] : 0.0f);
        }
    }
}

static void matvec_Q8_0_PACKED(const uint8_t *w, int64_t stride, int64_t rows, const float *x,
                               int64_t m, int64_t n, float *y, const float *bias) {
    ROW_PASSES(x, rows_q8_packed);
}

/* weight by weight as deq_Q8_0: d * q */
static void dequant_Q8_0_PACKED(const uint8_t *w, int64_t stride, int64_t rows, int64_t n,
                                float *out) {
    const int64_t nb = n / 32;
    _Pragma("omp parallel for schedule(static)")
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = w + r * stride;
        for (int64_t b = 0; b < nb; b++) {
            const sink_t s = {.out = out + r * n + 32 * b};
            const __m256 d = _mm256_set1_ps(f16_at(row + 2 * b));
            put_mul(s, 0, load16(row + 2 * nb + 32 * b), d);
            put_mul(s, 16, load16(row + 2 * nb + 32 * b + 16), d);
        }
    }
}

DEFINE_API()

#else

int llmrun_available(void) { return 0; }

#endif
