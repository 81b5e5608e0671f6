/* 8-bit-activation matvecs, AVX-512 (q8.h says what they compute). Each 64 bytes of
 * u8 weights meet 64 activation quants in one vpdpbusd (VNNI), or, without VNNI, in
 * vpmaddubsw and vpmaddwd (whose 16-bit pair sums do not saturate for the u8 values
 * used here, at most 63 * 127 * 2: Q8_0 then takes |w| and x with w's sign instead of
 * w + 128). Each dword lane of an integer sum holds one block's, so its float, times
 * the lane's weight scale and activation scale, goes into a float accumulator. The
 * i-quants and ternary types take sizes and signs, as llama.cpp does (|w| <= 127).
 */
#include "common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__F16C__)
#include <immintrin.h>

#include "q8.h"

#ifdef __AVX512VNNI__
#define DPBUSD(acc, u, s) _mm512_dpbusd_epi32((acc), (u), (s))
#define Q8_0_OFFSET 128
#else
ALWAYS_INLINE __m512i dpbusd_bw(__m512i acc, __m512i u, __m512i s) {
    const __m512i pairs = _mm512_maddubs_epi16(u, s);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
}
#define DPBUSD(acc, u, s) dpbusd_bw((acc), (u), (s))
#define Q8_0_OFFSET 0
#endif

/* The packed K-quant layouts' kernels sort bytes with VBMI's vpermt2b (Ice Lake, Zen 4). */
#ifdef __AVX512VBMI__
#define Q8_K_PACKED_TYPES(X) X(Q4_K_PACKED, 256) X(Q5_K_PACKED, 256)
#else
#define Q8_K_PACKED_TYPES(X)
#endif

#define Q8_TYPES(X)                                                                      \
    X(Q4_0_PACKED, 128) X(Q5_0_PACKED, 128) X(Q8_0, 32) X(Q4_0, 32) X(Q5_0, 32) X(MXFP4, 32) \
    X(Q4_K, 256) X(Q5_K, 256) X(Q6_K, 256) X(IQ4_NL, 32) X(IQ4_XS, 256) X(TQ1_0, 256)       \
    X(TQ2_0, 256) X(IQ2_XXS, 256) X(IQ2_XS, 256) X(IQ2_S, 256) X(IQ3_XXS, 256) X(IQ3_S, 256)   \
    X(IQ1_S, 256) X(IQ1_M, 256) Q8_K_PACKED_TYPES(X)

ALWAYS_INLINE __m512i load512(const void *p) { return _mm512_loadu_si512(p); }

/* Packed Q4_0 (five 0) and Q5_0 (five 1), kernels_avx512.c's layout: a row's f16
 * scales, (Q5_0) its u32 high-bit words, then its blocks' 16-byte quants. A 64-byte
 * load holds four blocks: its low nibbles their weights 0..15, its high nibbles
 * 16..31 (ORDER_QUADS), and the weights' offset (8 or 16) is in the lanes' start. */
ALWAYS_INLINE void rows_q8_packed(const uint8_t *w, int64_t stride, int64_t r0, int64_t r1,
                                  const act_t *a, int64_t i0, const int m, float *y,
                                  int64_t ldy, const float *bias, const int five) {
    const int64_t n = a->n, nb = n / 32, ng = nb / 4, group = stride / ng; /* bytes of 4 blocks */
    const __m512i quad = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i nibble = _mm512_set1_epi8(15), bit4 = _mm512_set1_epi8(16);
    const uint8_t *end = w + r1 * stride;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * stride, *qh = row + 2 * nb;
        const uint8_t *qs = row + (five ? 6 : 2) * nb;
        __m512 acc[MAX_M];
        for (int i = 0; i < m; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t g = 0; g < ng; g++) {
            /* at the row's pace through all its bytes (scales and high bits too), so the
             * rows ahead come in whole */
            const uint8_t *ahead = row + PREFETCH + group * g;
            if (ahead + group <= end) {
                _mm_prefetch((const char *)ahead, _MM_HINT_T0);
                _mm_prefetch((const char *)ahead + group - 1, _MM_HINT_T0);
            }
            const __m512i v = load512(qs + 64 * g);
            __m512i lo = _mm512_and_si512(v, nibble);
            __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
            if (five) {
                /* bit j of block b's word: weight j; low nibbles take bits 0..15 */
                const uint64_t h01 = *(const uint64_t *)(qh + 16 * g);
                const uint64_t h23 = *(const uint64_t *)(qh + 16 * g + 8);
                const uint64_t low = 0x0000FFFF0000FFFFull, high = ~low;
                const __mmask64 mlo = _pext_u64(h01, low) | _pext_u64(h23, low) << 32;
                const __mmask64 mhi = _pext_u64(h01, high) | _pext_u64(h23, high) << 32;
                lo = _mm512_mask_add_epi8(lo, mlo, lo, bit4);
                hi = _mm512_mask_add_epi8(hi, mhi, hi, bit4);
            }
            const __m128 d4 = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(row + 8 * g)));
            const __m512 dw = _mm512_permutexvar_ps(quad, _mm512_castps128_ps512(d4));
            for (int i = 0; i < m; i++) {
                const int8_t *xq = a->q + (i0 + i) * a->q_step + 128 * g;
                const int64_t l = (i0 + i) * a->lane_step + 16 * g;
                __m512i sum = DPBUSD(load512(a->lane + l), lo, load512(xq));
                sum = DPBUSD(sum, hi, load512(xq + 64));
                const __m512 scale = _mm512_mul_ps(dw, _mm512_loadu_ps(a->dq + l));
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[i]);
            }
        }
        for (int i = 0; i < m; i++)
            y[i * ldy + r] = _mm512_reduce_add_ps(acc[i]) + (bias ? bias[r] : 0.0f);
    }
}

#ifdef __AVX512VNNI__ /* in 256-bit vectors (q8.h) */
DEFINE_Q8_MATVEC(Q4_0_PACKED, ORDER_QUADS, 8, rows_q8_packed_256, 0)
#else
DEFINE_Q8_MATVEC(Q4_0_PACKED, ORDER_QUADS, 8, rows_q8_packed, 0)
#endif
DEFINE_Q8_MATVEC(Q5_0_PACKED, ORDER_QUADS, 16, rows_q8_packed, 1)

/* Q8_0 in GGML's layout (34-byte blocks), two blocks a load pair: with VNNI the u8
 * weights w + 128 (w ^ 0x80, the 128 in the lanes' start), else |w| against x with
 * w's sign. An odd last block pairs with zeros (the activations are zero padded). */
ALWAYS_INLINE void rows_q8_q8_0(const uint8_t *w, int64_t stride, int64_t r0, int64_t r1,
                                const act_t *a, int64_t i0, const int m, float *y,
                                int64_t ldy, const float *bias) {
    const int64_t n = a->n, nb = n / 32;
    const uint8_t *end = w + r1 * stride;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * stride;
        __m512 acc[MAX_M];
        for (int i = 0; i < m; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b += 2) {
            const uint8_t *src = row + 34 * b;
            if (src + PREFETCH + 68 <= end) {
                _mm_prefetch((const char *)src + PREFETCH, _MM_HINT_T0);
                _mm_prefetch((const char *)src + PREFETCH + 64, _MM_HINT_T0);
            }
            const int two = b + 1 < nb;
            const __m256i q0 = _mm256_loadu_si256((const __m256i *)(src + 2));
            const __m256i q1 = two ? _mm256_loadu_si256((const __m256i *)(src + 36))
                                   : _mm256_setzero_si256();
            const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1);
            const __m512 dw = _mm512_insertf32x8(_mm512_set1_ps(f16_value(src)),
                                                 _mm256_set1_ps(two ? f16_value(src + 34) : 0.0f), 1);
#ifdef __AVX512VNNI__
            const __m512i u = _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80));
#else
            const __m512i u = _mm512_abs_epi8(v);
            const __mmask64 negative = _mm512_movepi8_mask(v);
#endif
            for (int i = 0; i < m; i++) {
                const int64_t l = (i0 + i) * a->lane_step + 8 * b;
                __m512i xq = load512(a->q + (i0 + i) * a->q_step + 32 * b);
#ifndef __AVX512VNNI__
                xq = _mm512_mask_sub_epi8(xq, negative, _mm512_setzero_si512(), xq);
#endif
                const __m512i sum = DPBUSD(load512(a->lane + l), u, xq);
                const __m512 scale = _mm512_mul_ps(dw, _mm512_loadu_ps(a->dq + l));
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[i]);
            }
        }
        for (int i = 0; i < m; i++)
            y[i * ldy + r] = _mm512_reduce_add_ps(acc[i]) + (bias ? bias[r] : 0.0f);
    }
}

DEFINE_Q8_MATVEC(Q8_0, ORDER_NATURAL, Q8_0_OFFSET, rows_q8_q8_0)

ALWAYS_INLINE float reduce2(__m512 a, __m512 b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }

/* GGML's Q4_0 (18-byte blocks), Q5_0 (22), MXFP4 (17) and IQ4_NL (18), four blocks a
 * 64-byte vector, one 16-byte lane each (ORDER_QUADS, as the packed layouts): the low
 * nibbles meet the blocks' activations 0..15 and the high ones 16..31 in the same dword
 * lanes, so one float scale and multiply-add per 128 weights. Q5_0's high-bit words split
 * as in rows_q8_packed; MXFP4's codes look up their values plus 12 (so unsigned);
 * IQ4_NL's look up theirs, whose sizes meet the activations with their signs (q8.h). The
 * weights' offset (8, 16, 12; IQ4_NL's 0) is in the lanes' start. A row's last quad may
 * hold fewer blocks (rows of any multiple of 32): the lanes of the missing ones have
 * scale 0. */
/* The scales of c <= 16 blocks `bytes` apart, 0 past c: their fields gathered (a whole
 * group without branches), then converted at once (E8M0 as e8m0_half). */
ALWAYS_INLINE __m512 quad_scales(const uint8_t *src, int c, const int kind) {
    const int bytes = quad_bytes(kind);
    __m512 v;
    if (kind == QUAD_MXFP4) {
        __m128i e8;
        if (c == 16) {
            e8 = _mm_set_epi64x((long long)gather8(src + 8 * bytes, bytes, 1),
                                (long long)gather8(src, bytes, 1));
        } else {
            uint8_t t[16] = {0};
            for (int k = 0; k < c; k++) t[k] = src[k * bytes];
            e8 = _mm_loadu_si128((const __m128i *)t);
        }
        const __m512i e = _mm512_cvtepu8_epi32(e8);
        const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
        const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
        const __mmask16 low = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
        v = _mm512_castsi512_ps(_mm512_mask_blend_epi32(low, normal, tiny));
    } else {
        __m256i h16;
        if (c == 16) {
            h16 = _mm256_set_epi64x((long long)gather8(src + 12 * bytes, bytes, 2),
                                    (long long)gather8(src + 8 * bytes, bytes, 2),
                                    (long long)gather8(src + 4 * bytes, bytes, 2),
                                    (long long)gather8(src, bytes, 2));
        } else {
            uint16_t t[16] = {0};
            for (int k = 0; k < c; k++) memcpy(t + k, src + k * bytes, 2);
            h16 = _mm256_loadu_si256((const __m256i *)t);
        }
        v = _mm512_cvtph_ps(h16);
    }
    return _mm512_maskz_mov_ps((__mmask16)((1u << c) - 1), v);
}

/* Blocks b .. b + have - 1 (have <= 4) at src into acc[i][chain] for the m rows, their
 * scales in lanes 4q .. 4q + 3 of d16 (chain constant: a variable index would keep acc
 * in memory). A missing block's lane repeats the first block's quants. */
ALWAYS_INLINE void quad_step(const uint8_t *src, const int have, __m512 d16, int q,
                             const act_t *a, int64_t i0, const int m, int64_t b,
                             __m512 acc[][2], const int chain, const int kind) {
    const int bytes = quad_bytes(kind);
    const int qs = kind == QUAD_Q4_0 || kind == QUAD_IQ4_NL ? 2 : kind == QUAD_Q5_0 ? 6 : 1;
    __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(src + qs)));
    for (int k = 1; k < 4; k++)
        if (k < have) v = _mm512_mask_broadcast_i32x4(v, (__mmask16)(0xF << 4 * k),
                                                      _mm_loadu_si128((const __m128i *)(src + k * bytes + qs)));
    const __m512i nibble = _mm512_set1_epi8(15);
    __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    if (kind == QUAD_Q5_0) {
        /* bit j of block k's word: its weight j; low nibbles take bits 0..15 */
        uint64_t h01 = u32_at(src + 2), h23 = 0;
        if (have > 1) h01 |= (uint64_t)u32_at(src + bytes + 2) << 32;
        if (have > 2) h23 = u32_at(src + 2 * bytes + 2);
        if (have > 3) h23 |= (uint64_t)u32_at(src + 3 * bytes + 2) << 32;
        const uint64_t low = 0x0000FFFF0000FFFFull, high = ~low;
        const __mmask64 mlo = _pext_u64(h01, low) | _pext_u64(h23, low) << 32;
        const __mmask64 mhi = _pext_u64(h01, high) | _pext_u64(h23, high) << 32;
        lo = _mm512_mask_add_epi8(lo, mlo, lo, _mm512_set1_epi8(16));
        hi = _mm512_mask_add_epi8(hi, mhi, hi, _mm512_set1_epi8(16));
    }
    if (kind == QUAD_MXFP4) {
        const __m128i values = _mm_loadu_si128((const __m128i *)MXFP4_VALUES);
        const __m512i table = _mm512_broadcast_i32x4(_mm_add_epi8(values, _mm_set1_epi8(12)));
        lo = _mm512_shuffle_epi8(table, lo);
        hi = _mm512_shuffle_epi8(table, hi);
    }
    __mmask64 neg_lo = 0, neg_hi = 0; /* IQ4_NL: its values' signs, for the activations */
    if (kind == QUAD_IQ4_NL) {
        const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)IQ4_NL_VALUES));
        lo = _mm512_shuffle_epi8(table, lo);
        hi = _mm512_shuffle_epi8(table, hi);
        neg_lo = _mm512_movepi8_mask(lo), neg_hi = _mm512_movepi8_mask(hi);
        lo = _mm512_abs_epi8(lo), hi = _mm512_abs_epi8(hi);
    }
    const __m512i quad = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512 dw = _mm512_permutexvar_ps(_mm512_add_epi32(quad, _mm512_set1_epi32(4 * q)), d16);
    for (int i = 0; i < m; i++) {
        const int8_t *xq = a->q + (i0 + i) * a->q_step + 32 * b;
        const int64_t l = (i0 + i) * a->lane_step + 4 * b;
        __m512i xlo = load512(xq), xhi = load512(xq + 64);
        if (kind == QUAD_IQ4_NL) {
            xlo = _mm512_mask_sub_epi8(xlo, neg_lo, _mm512_setzero_si512(), xlo);
            xhi = _mm512_mask_sub_epi8(xhi, neg_hi, _mm512_setzero_si512(), xhi);
        }
        __m512i sum = DPBUSD(load512(a->lane + l), lo, xlo);
        sum = DPBUSD(sum, hi, xhi);
        const __m512 scale = _mm512_mul_ps(dw, _mm512_loadu_ps(a->dq + l));
        acc[i][chain] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[i][chain]);
    }
}

ALWAYS_INLINE void rows_q8_quads(const uint8_t *w, int64_t stride, int64_t r0, int64_t r1,
                                 const act_t *a, int64_t i0, const int m, float *y,
                                 int64_t ldy, const float *bias, const int kind) {
    const int64_t nb = a->n / 32;
    const int bytes = quad_bytes(kind), odd = m <= 2 ? 1 : 0; /* odd quads' chain */
    const uint8_t *end = w + r1 * stride;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * stride;
        __m512 acc[MAX_M][2];
        for (int i = 0; i < m; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
        int64_t b0 = 0;
        for (; b0 + 16 <= nb; b0 += 16) {
            const uint8_t *src = row + b0 * bytes;
            if (src + PREFETCH + 16 * bytes <= end)
                for (int l = 0; l < 16 * bytes; l += 64)
                    _mm_prefetch((const char *)src + PREFETCH + l, _MM_HINT_T0);
            const __m512 d16 = quad_scales(src, 16, kind);
            for (int q = 0; q < 4; q += 2) {
                quad_step(src + 4 * q * bytes, 4, d16, q, a, i0, m, b0 + 4 * q, acc, 0, kind);
                quad_step(src + 4 * (q + 1) * bytes, 4, d16, q + 1, a, i0, m, b0 + 4 * q + 4, acc,
                          odd, kind);
            }
        }
        if (b0 < nb) { /* the last c < 16 blocks */
            const int c = (int)(nb - b0);
            const uint8_t *src = row + b0 * bytes;
            const __m512 d16 = quad_scales(src, c, kind);
            for (int q = 0; 4 * q < c; q++) {
                const int have = c - 4 * q < 4 ? c - 4 * q : 4;
                quad_step(src + 4 * q * bytes, have, d16, q, a, i0, m, b0 + 4 * q, acc, 0, kind);
            }
        }
        for (int i = 0; i < m; i++)
            y[i * ldy + r] = reduce2(acc[i][0], acc[i][1]) + (bias ? bias[r] : 0.0f);
    }
}

DEFINE_Q8_MATVEC(Q4_0, ORDER_QUADS, 8, rows_q8_quads, QUAD_Q4_0)
DEFINE_Q8_MATVEC(Q5_0, ORDER_QUADS, 16, rows_q8_quads, QUAD_Q5_0)
DEFINE_Q8_MATVEC(MXFP4, ORDER_QUADS, 12, rows_q8_quads, QUAD_MXFP4)
DEFINE_Q8_MATVEC(IQ4_NL, ORDER_QUADS, 0, rows_q8_quads, QUAD_IQ4_NL)

/* a in the low 256 bits, b in the high 256 */
ALWAYS_INLINE __m512i halves_epi16(int a, int b) {
    return _mm512_inserti64x4(_mm512_set1_epi16((short)a), _mm256_set1_epi16((short)b), 1);
}

ALWAYS_INLINE __m512i halves_epi8(int a, int b) {
    return _mm512_inserti64x4(_mm512_set1_epi8((char)a), _mm256_set1_epi8((char)b), 1);
}

/* The K-quants against Q8_K activations (one scale per 256): vpmaddubsw's 16-bit pair
 * sums (at most 2 * 63 * 127) meet the weights' integer sub-block scales in vpdpwssd
 * (VNNI; else vpmaddwd and an add), so a block's whole sum is one integer vector,
 * converted and scaled by d * d_x once. */
#ifdef __AVX512VNNI__
#define DPWSSD(acc, p, s) _mm512_dpwssd_epi32((acc), (p), (s))
#else
#define DPWSSD(acc, p, s) _mm512_add_epi32((acc), _mm512_madd_epi16((p), (s)))
#endif

/* vpshufb indices: in the low 256 bits 16-bit word a of each 128-bit lane, in the high
 * 256 word b */
ALWAYS_INLINE __m512i scale_pick(int a, int b) {
    return halves_epi16(2 * a | (2 * a + 1) << 8, 2 * b | (2 * b + 1) << 8);
}

/* The block sum of four 64-byte vectors of u8 weights u against x's quants xq, each
 * pair sum times its 16-bit lane's scale in sc. */
ALWAYS_INLINE __m512i q8k_block_sum(const __m512i u[4], const __m512i sc[4], const int8_t *xq) {
    __m512i sum = _mm512_setzero_si512();
    for (int t = 0; t < 4; t++) sum = DPWSSD(sum, _mm512_maddubs_epi16(u[t], load512(xq + 64 * t)), sc[t]);
    return sum;
}

/* GGML's Q4_K (144-byte blocks; five 0) and Q5_K (176; five 1), in ORDER_Q8_K_PAIRS: a
 * 64-byte load of quants holds sub-blocks 4h and 4h + 2 in its low nibbles and 4h + 1
 * and 4h + 3 in its high ones; Q5_K's high bits (bit j of byte l: weight l of sub-block
 * j) are a byte test of its 32 bytes, doubled, against each vector's two sub-blocks'
 * bits. The mins' part, dmin * d_x * sum_j m_j * (the sum of sub-block j's activation
 * quants), is an integer per block too, taken in 128 bits. */
ALWAYS_INLINE void rows_q8k_k(const uint8_t *w, int64_t stride, int64_t r0, int64_t r1,
                              const act_t *a, int64_t i0, const int m, float *y, int64_t ldy,
                              const float *bias, const int five) {
    const int64_t nb = a->n / 256, bytes = five ? 176 : 144;
    /* vector t's sub-blocks (low, high 32 bytes): 0 2, 1 3, 4 6, 5 7, as vpshufb picks
     * their 16-bit scales from the 8 in every 128-bit lane */
    const __m512i sub[4] = {scale_pick(0, 2), scale_pick(1, 3), scale_pick(4, 6), scale_pick(5, 7)};
    const __m512i bit[4] = {halves_epi8(1, 4), halves_epi8(2, 8), halves_epi8(16, 64),
                            halves_epi8(32, 128)};
    const __m512i nibble = _mm512_set1_epi8(15);
    const uint8_t *end = w + r1 * stride;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * stride;
        __m512 acc[MAX_M];
        __m128 accm[MAX_M];
        for (int i = 0; i < m; i++) acc[i] = _mm512_setzero_ps(), accm[i] = _mm_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + bytes * b;
            if (blk + PREFETCH + bytes <= end)
                for (int l = 0; l < bytes; l += 64)
                    _mm_prefetch((const char *)blk + PREFETCH + l, _MM_HINT_T0);
            const __m256i sm = _mm256_cvtepu8_epi16(k_scale_bytes(blk + 4));
            const __m512i scales = _mm512_broadcast_i32x4(_mm256_castsi256_si128(sm));
            __m512i sc[4];
            for (int t = 0; t < 4; t++) sc[t] = _mm512_shuffle_epi8(scales, sub[t]);
            const __m128i mins = _mm256_extracti128_si256(sm, 1);
            const float d = f16_value(blk), dmin = f16_value(blk + 2);
            const uint8_t *qs = blk + (five ? 48 : 16);
            __m512i u[4];
            for (int h = 0; h < 2; h++) {
                const __m512i v = load512(qs + 64 * h);
                u[2 * h] = _mm512_and_si512(v, nibble);
                u[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
            }
            if (five) {
                const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16)));
                for (int t = 0; t < 4; t++)
                    u[t] = _mm512_mask_add_epi8(u[t], _mm512_test_epi8_mask(qh, bit[t]), u[t],
                                                _mm512_set1_epi8(16));
            }
            for (int i = 0; i < m; i++) {
                const __m512i sum = q8k_block_sum(u, sc, a->q + (i0 + i) * a->q_step + 256 * b);
                const float dx = a->d[(i0 + i) * a->d_step + b];
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(d * dx), acc[i]);
                const __m128i bsum = _mm_loadu_si128((const __m128i *)(q8k_sums32(a, i0 + i) + 8 * b));
                accm[i] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_madd_epi16(mins, bsum)), _mm_set1_ps(dmin * dx), accm[i]);
            }
        }
        for (int i = 0; i < m; i++)
            y[i * ldy + r] = _mm512_reduce_add_ps(acc[i]) - reduce_128(accm[i]) + (bias ? bias[r] : 0.0f);
    }
}

DEFINE_Q8_MATVEC(Q4_K, ORDER_Q8_K_PAIRS, 0, rows_q8k_k, 0)
DEFINE_Q8_MATVEC(Q5_K, ORDER_Q8_K_PAIRS, 0, rows_q8k_k, 1)

/* GGML's Q6_K (210-byte blocks: ql[128], qh[64], int8 scales[16], f16 d), in ORDER_Q8_K:
 * a 64-byte load of ql holds weights 128c .. 128c + 63 in its low nibbles and the next 64
 * in its high ones, and qh's 32 bytes of that half, doubled, shifted per 16-bit half,
 * give their two high bits (as Q6_K_DEQ in kernels_avx512.c). The u8 weights are q + 32;
 * the offset comes off the block's integer sum as 32 * sum_k sc_k * (the sum of the
 * k-th 16 activation quants). */
ALWAYS_INLINE void rows_q8k_q6_k(const uint8_t *w, int64_t stride, int64_t r0, int64_t r1,
                                 const act_t *a, int64_t i0, const int m, float *y,
                                 int64_t ldy, const float *bias) {
    const int64_t nb = a->n / 256, bytes = 210;
    /* vector t's 128-bit lane l: weights 64t + 16l .. + 15, of scale 4t + l; vpshufb
     * picks it from a broadcast of scales 0..7 (t < 2) or 8..15 */
    __m512i sub[2];
    for (int t = 0; t < 2; t++) {
        int16_t idx[32];
        for (int j = 0; j < 32; j++) idx[j] = (int16_t)(2 * (4 * t + j / 8) | (2 * (4 * t + j / 8) + 1) << 8);
        sub[t] = _mm512_loadu_si512(idx);
    }
    const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const uint8_t *end = w + r1 * stride;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * stride;
        __m512 acc[MAX_M];
        for (int i = 0; i < m; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + bytes * b;
            if (blk + PREFETCH + bytes <= end)
                for (int l = 0; l < bytes + 63; l += 64)
                    _mm_prefetch((const char *)blk + PREFETCH + l, _MM_HINT_T0);
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
            const __m512i low = _mm512_broadcast_i32x4(_mm256_castsi256_si128(sc16));
            const __m512i high = _mm512_broadcast_i32x4(_mm256_extracti128_si256(sc16, 1));
            const __m512i sc[4] = {_mm512_shuffle_epi8(low, sub[0]), _mm512_shuffle_epi8(low, sub[1]),
                                   _mm512_shuffle_epi8(high, sub[0]), _mm512_shuffle_epi8(high, sub[1])};
            const float d = f16_value(blk + 208);
            __m512i u[4];
            for (int c = 0; c < 2; c++) {
                const __m512i ql = load512(blk + 64 * c);
                const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * c)));
                for (int h = 0; h < 2; h++) {
                    /* bits 2t, 2t + 1 of qh for t = 2h (low 32 bytes), 2h + 1 (high) */
                    const __m512i hs = _mm512_srlv_epi16(qh, _mm512_add_epi16(shifts, _mm512_set1_epi16(4 * h)));
                    const __m512i lq = h ? _mm512_srli_epi16(ql, 4) : ql;
                    const __m512i q6 = _mm512_ternarylogic_epi32(lq, _mm512_slli_epi16(hs, 4), _mm512_set1_epi8(15), 0xE4);
                    u[2 * c + h] = _mm512_and_si512(q6, _mm512_set1_epi8(63));
                }
            }
            for (int i = 0; i < m; i++) {
                __m512i sum = q8k_block_sum(u, sc, a->q + (i0 + i) * a->q_step + 256 * b);
                const __m256i bsum = _mm256_loadu_si256((const __m256i *)(q8k_sums16(a, i0 + i) + 16 * b));
                const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(sc16, bsum), 5);
                sum = _mm512_sub_epi32(sum, _mm512_zextsi256_si512(offset));
                const float dx = a->d[(i0 + i) * a->d_step + b];
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(d * dx), acc[i]);
            }
        }
        for (int i = 0; i < m; i++) y[i * ldy + r] = _mm512_reduce_add_ps(acc[i]) + (bias ? bias[r] : 0.0f);
    }
}

DEFINE_Q8_MATVEC(Q6_K, ORDER_Q8_K, 0, rows_q8k_q6_k)

/* GGML's IQ4_XS (136-byte blocks: f16 d, u16 scales_h, u8 scales_l[4], qs[128]) in
 * ORDER_Q8_K: a 64-byte load of qs holds sub-blocks 4h .. 4h + 3 of 32, one 16-byte lane
 * each, their weights 0..15 in the low nibbles and 16..31 in the high ones; vpshufb looks
 * up the values and vpermt2q puts the lanes in x's order (sub-blocks 4h, 4h + 1, then
 * 4h + 2, 4h + 3). The values' sizes meet the activations with their signs in vpmaddubsw,
 * whose pair sums meet the sub-blocks' scales less 32 in vpdpwssd, so a block's sum is
 * one integer vector, converted and scaled by d * d_x once (llama.cpp's vec_dot scales
 * each sub-block's sum in floats: the same to float rounding). */
ALWAYS_INLINE void rows_q8k_iq4_xs(const uint8_t *w, int64_t stride, int64_t r0, int64_t r1,
                                   const act_t *a, int64_t i0, const int m, float *y,
                                   int64_t ldy, const float *bias) {
    const int64_t nb = a->n / 256;
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)IQ4_NL_VALUES));
    const __m512i nibble = _mm512_set1_epi8(15);
    const __m512i order[2] = {_mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11),
                              _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15)};
    __m512i pick[4]; /* vector t's scales: sub-block 2t's in the low 256 bits, 2t + 1's high */
    for (int t = 0; t < 4; t++) pick[t] = halves_epi16(2 * t, 2 * t + 1);
    const uint8_t *end = w + r1 * stride;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * stride;
        __m512 acc[MAX_M];
        for (int i = 0; i < m; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + IQ4_XS_BYTES * b;
            if (blk + PREFETCH + IQ4_XS_BYTES <= end)
                for (int l = 0; l < IQ4_XS_BYTES + 63; l += 64)
                    _mm_prefetch((const char *)blk + PREFETCH + l, _MM_HINT_T0);
            const __m128i s8 = _mm_cvtsi64_si128((long long)iq4_xs_scales(blk));
            const __m512i s16 = _mm512_zextsi128_si512(_mm_cvtepi8_epi16(s8));
            __m512i sc[4], u[4];
            __mmask64 neg[4];
            for (int t = 0; t < 4; t++) sc[t] = _mm512_permutexvar_epi16(pick[t], s16);
            for (int h = 0; h < 2; h++) {
                const __m512i v = load512(blk + 8 + 64 * h);
                const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(v, nibble));
                const __m512i hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble));
                for (int e = 0; e < 2; e++) {
                    const __m512i values = _mm512_permutex2var_epi64(lo, order[e], hi);
                    neg[2 * h + e] = _mm512_movepi8_mask(values);
                    u[2 * h + e] = _mm512_abs_epi8(values);
                }
            }
            const float d = f16_value(blk);
            for (int i = 0; i < m; i++) {
                const int8_t *xq = a->q + (i0 + i) * a->q_step + 256 * b;
                __m512i sum = _mm512_setzero_si512();
                for (int t = 0; t < 4; t++) {
                    const __m512i x = load512(xq + 64 * t);
                    const __m512i signed_x = _mm512_mask_sub_epi8(x, neg[t], _mm512_setzero_si512(), x);
                    sum = DPWSSD(sum, _mm512_maddubs_epi16(u[t], signed_x), sc[t]);
                }
                const float dx = a->d[(i0 + i) * a->d_step + b];
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(d * dx), acc[i]);
            }
        }
        for (int i = 0; i < m; i++) y[i * ldy + r] = _mm512_reduce_add_ps(acc[i]) + (bias ? bias[r] : 0.0f);
    }
}

DEFINE_Q8_MATVEC(IQ4_XS, ORDER_Q8_K, 0, rows_q8k_iq4_xs)

/* GGML's TQ1_0 (one 1) and TQ2_0 (one 0) in ORDER_Q8_K, a block's trits as q8.h decodes
 * them, two vectors of 32 to one of 64: against the activation quants in vpdpbusd, less
 * the sum of the block's activation quants (the trits' offset of 1), times d * d_x. */
ALWAYS_INLINE void rows_q8k_ternary(const uint8_t *w, int64_t stride, int64_t r0, int64_t r1,
                                    const act_t *a, int64_t i0, const int m, float *y,
                                    int64_t ldy, const float *bias, const int one) {
    const int64_t nb = a->n / 256, bytes = one ? TQ1_0_BYTES : TQ2_0_BYTES;
    const uint8_t *end = w + r1 * stride;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * stride;
        __m512 acc[MAX_M];
        for (int i = 0; i < m; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + bytes * b;
            if (blk + PREFETCH + bytes <= end)
                for (int l = 0; l < bytes + 63; l += 64)
                    _mm_prefetch((const char *)blk + PREFETCH + l, _MM_HINT_T0);
            __m256i t[8];
            if (one) tq1_0_trits(blk, t);
            else tq2_0_trits(blk, t);
            __m512i u[4];
            for (int k = 0; k < 4; k++) u[k] = _mm512_inserti64x4(_mm512_castsi256_si512(t[2 * k]), t[2 * k + 1], 1);
            const float d = f16_value(blk + bytes - 2);
            for (int i = 0; i < m; i++) {
                const int8_t *xq = a->q + (i0 + i) * a->q_step + 256 * b;
                __m512i sum = _mm512_setzero_si512();
                for (int k = 0; k < 4; k++) sum = DPBUSD(sum, u[k], load512(xq + 64 * k));
                const __m256i bsum = _mm256_loadu_si256((const __m256i *)(q8k_sums16(a, i0 + i) + 16 * b));
                const __m256i xsum = _mm256_madd_epi16(bsum, _mm256_set1_epi16(1));
                sum = _mm512_sub_epi32(sum, _mm512_zextsi256_si512(xsum));
                const float dx = a->d[(i0 + i) * a->d_step + b];
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(d * dx), acc[i]);
            }
        }
        for (int i = 0; i < m; i++) y[i * ldy + r] = _mm512_reduce_add_ps(acc[i]) + (bias ? bias[r] : 0.0f);
    }
}

DEFINE_Q8_MATVEC(TQ1_0, ORDER_Q8_K, 0, rows_q8k_ternary, 1)
DEFINE_Q8_MATVEC(TQ2_0, ORDER_Q8_K, 0, rows_q8k_ternary, 0)

/* The i-quants on grids in ORDER_Q8_K, each block decoded straight into four vectors of
 * 64 weights (64k .. 64k + 63): their grid rows fetched by one gather (eight 8-byte rows,
 * or sixteen 4-byte ones; on Zen 4 faster than as many loads put in place one by one),
 * their signs as the vector's byte mask (IQ2_S's and IQ3_S's
 * sign bytes are that mask as they stand; ksigns indices gain their parity bit in
 * registers), and the block's scales as 16-bit words of one vector, where the type's
 * fields put them (grid_scale_word). The values' sizes meet the activation quants with
 * the values' signs in vpmaddubsw, the pair sums times their 16 values' scale (vpermw to
 * one per 128-bit lane) in vpdpwssd, so a block's sum is one integer vector, times
 * d * factor * d_x (q8.h: the block's meaning; iq_grid_block the AVX2 family's decoder). */
typedef struct {
    __m512i size[4];
    __mmask64 neg[4];
    __m512i scales; /* 2 s + 1, the scale of weights 16j .. 16j + 15 in word grid_scale_word(j) */
    float d;
} grid_block_t;

/* The word of grid_block_t.scales that holds the scale of weights 16j .. 16j + 15 */
static int grid_scale_word(const int type, int j) {
    switch (type) {
    case IQ2_XXS: return 4 * (j / 2); /* the low word of each 8-byte group's qword */
    case IQ3_XXS: return 2 * (j / 2); /* the low word of each aux dword */
    case IQ3_S: case IQ1_S: return j / 2; /* one per 32 */
    default: return j; /* IQ2_XS, IQ2_S, IQ1_M: one per 16 */
    }
}

/* The sign bytes of eight 7-bit ksigns indices (the bytes of v, bit 7 clear): each index
 * with its parity in bit 7, as ksigns holds them. */
ALWAYS_INLINE uint64_t ksigns8(uint64_t v) {
    uint64_t p = v ^ v >> 4; /* bit 0 of each byte ends up as the parity of the byte */
    p ^= p >> 2;
    p ^= p >> 1;
    return v | (p & 0x0101010101010101ull) << 7;
}

/* The sign bytes of the 7-bit ksigns indices in bits 0..27 of the aux words at p, p + 4
 * (IQ2_XXS, IQ3_XXS) */
ALWAYS_INLINE __mmask64 aux_signs(const uint8_t *p0, const uint8_t *p1) {
    return ksigns8(_pdep_u64(u32_at(p0), 0x7F7F7F7Full) | _pdep_u64(u32_at(p1), 0x7F7F7F7Full) << 32);
}

/* 2 s + 1 for the scale nibbles (low first) of the 8 bytes at p, one a word in order
 * (IQ2_XS, IQ2_S) */
ALWAYS_INLINE __m512i nibble_scales(const uint8_t *p) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const __m128i lo = _mm_and_si128(b, _mm_set1_epi16(15)), hi = _mm_srli_epi16(b, 4);
    const __m256i s = _mm256_set_m128i(_mm_unpackhi_epi16(lo, hi), _mm_unpacklo_epi16(lo, hi));
    return _mm512_zextsi256_si512(_mm256_add_epi16(_mm256_add_epi16(s, s), _mm256_set1_epi16(1)));
}

/* 2 s + 1 per word */
ALWAYS_INLINE __m512i odd_scales(__m512i s) {
    return _mm512_add_epi16(_mm512_add_epi16(s, s), _mm512_set1_epi16(1));
}

ALWAYS_INLINE uint64_t u64_at(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* IQ1's 8 g + delta (grid values g -1, 0, 1; delta +1, or -1 in the bytes of `minus`):
 * its size and sign into g */
ALWAYS_INLINE void iq1_vector(__m512i grid, __mmask64 minus, grid_block_t *g, int k) {
    const __m512i eight_g = _mm512_and_si512(_mm512_slli_epi16(grid, 3), _mm512_set1_epi8((char)0xF8));
    const __m512i delta = _mm512_mask_blend_epi8(minus, _mm512_set1_epi8(1), _mm512_set1_epi8(-1));
    const __m512i value = _mm512_add_epi8(eight_g, delta);
    g->neg[k] = _mm512_movepi8_mask(value);
    g->size[k] = _mm512_abs_epi8(value);
}

ALWAYS_INLINE void grid_block(const int type, const uint8_t *blk, grid_block_t *g) {
    switch (type) {
    case IQ2_XXS: { /* per 32: 4 grid indices, then a u32 of 4 7-bit sign indices and the scale */
        const __m128i pick = _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, -1, -1, -1, -1, -1, -1, -1, -1);
        for (int k = 0; k < 4; k++) {
            const uint8_t *q = blk + 2 + 16 * k;
            const __m128i idx = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)q), pick);
            g->size[k] = _mm512_i32gather_epi64(_mm256_cvtepu8_epi32(idx), iq2xxs_grid, 8);
            g->neg[k] = aux_signs(q + 4, q + 12);
        }
        g->scales = odd_scales(_mm512_srli_epi64(_mm512_loadu_si512(blk + 2), 60));
        g->d = f16_value(blk) * 0.125f;
        return;
    }
    case IQ2_XS: { /* per 8: a u16 of a 9-bit grid index and a 7-bit sign index; scales per 16 */
        const uint64_t top = 0xFE00FE00FE00FE00ull; /* the sign indices of four u16s */
        for (int k = 0; k < 4; k++) {
            const uint8_t *q = blk + 2 + 16 * k;
            const __m256i idx = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)q));
            g->size[k] = _mm512_i32gather_epi64(_mm256_and_si256(idx, _mm256_set1_epi32(511)), iq2xs_grid, 8);
            const uint64_t signs = _pext_u64(u64_at(q), top) | _pext_u64(u64_at(q + 8), top) << 28;
            g->neg[k] = ksigns8(_pdep_u64(signs, 0x7F7F7F7F7F7F7F7Full));
        }
        g->scales = nibble_scales(blk + 66);
        g->d = f16_value(blk) * 0.125f;
        return;
    }
    case IQ2_S: { /* qs[32] (low 8 bits of the indices), signs[32], qh[8] (2 high bits each), scales[8] */
        const __m256i shifts = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
        for (int k = 0; k < 4; k++) {
            const __m256i qh = _mm256_srlv_epi32(_mm256_set1_epi32((int)(u32_at(blk + 66 + 2 * k) & 0xFFFF)), shifts);
            const __m256i high = _mm256_slli_epi32(_mm256_and_si256(qh, _mm256_set1_epi32(3)), 8);
            const __m256i low = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * k)));
            g->size[k] = _mm512_i32gather_epi64(_mm256_or_si256(low, high), iq2s_grid, 8);
            g->neg[k] = u64_at(blk + 34 + 8 * k);
        }
        g->scales = nibble_scales(blk + 74);
        g->d = f16_value(blk) * 0.125f;
        return;
    }
    case IQ3_XXS: /* per 32: 8 indices of 4-byte grid rows; u32s of sign indices and scale after */
        for (int k = 0; k < 4; k++) {
            const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2 + 16 * k)));
            g->size[k] = _mm512_i32gather_epi32(idx, iq3xxs_grid, 4);
            g->neg[k] = aux_signs(blk + 66 + 8 * k, blk + 70 + 8 * k);
        }
        g->scales = odd_scales(_mm512_zextsi256_si512(_mm256_srli_epi32(_mm256_loadu_si256((const __m256i *)(blk + 66)), 28)));
        g->d = f16_value(blk) * 0.25f;
        return;
    case IQ3_S: { /* qs[64] (low 8 bits of the indices), qh[8] (bit 8), signs[32], scales[4] */
        for (int k = 0; k < 4; k++) {
            const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2 + 16 * k)));
            const __mmask16 high = (__mmask16)u32_at(blk + 66 + 2 * k);
            g->size[k] = _mm512_i32gather_epi32(_mm512_mask_add_epi32(idx, high, idx, _mm512_set1_epi32(256)), iq3s_grid, 4);
            g->neg[k] = u64_at(blk + 74 + 8 * k);
        }
        const __m128i b = _mm_cvtepu8_epi16(_mm_cvtsi32_si128((int)u32_at(blk + 106)));
        const __m128i s = _mm_unpacklo_epi16(_mm_and_si128(b, _mm_set1_epi16(15)), _mm_srli_epi16(b, 4));
        g->scales = odd_scales(_mm512_zextsi128_si512(s));
        g->d = f16_value(blk);
        return;
    }
    case IQ1_S: { /* qs[32] (low 8 bits of the indices), per 32 a u16: 3 high bits per 8, scale, delta sign */
        const __m256i shifts = _mm256_setr_epi32(0, 3, 6, 9, 16, 19, 22, 25);
        for (int k = 0; k < 4; k++) {
            const uint32_t h = u32_at(blk + 34 + 4 * k); /* groups 2k, 2k + 1 */
            const __m256i qh = _mm256_srlv_epi32(_mm256_set1_epi32((int)h), shifts);
            const __m256i high = _mm256_slli_epi32(_mm256_and_si256(qh, _mm256_set1_epi32(7)), 8);
            const __m256i low = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * k)));
            const __m512i grid = _mm512_i32gather_epi64(_mm256_or_si256(low, high), iq1s_grid, 8);
            const __mmask64 minus = (h >> 15 & 1 ? 0xFFFFFFFFull : 0) | (h >> 31 ? 0xFFFFFFFF00000000ull : 0);
            iq1_vector(grid, minus, g, k);
        }
        const __m512i h = _mm512_zextsi128_si512(_mm_loadu_si128((const __m128i *)(blk + 34)));
        g->scales = odd_scales(_mm512_and_si512(_mm512_srli_epi16(h, 12), _mm512_set1_epi16(7)));
        g->d = f16_value(blk) * 0.125f;
        return;
    }
    default: { /* IQ1_M: qs[32], qh[16] (per 8: 3 high index bits, delta sign), u16 scales[4] (3 bits per 16; d in their top nibbles) */
        const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        for (int k = 0; k < 4; k++) {
            const uint32_t h = u32_at(blk + 32 + 4 * k); /* a nibble per 8 weights */
            const __m256i qh = _mm256_srlv_epi32(_mm256_set1_epi32((int)h), shifts);
            const __m256i high = _mm256_slli_epi32(_mm256_and_si256(qh, _mm256_set1_epi32(7)), 8);
            const __m256i low = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 8 * k)));
            const __m512i grid = _mm512_i32gather_epi64(_mm256_or_si256(low, high), iq1s_grid, 8);
            const uint64_t minus = _pdep_u64(_pext_u64(h, 0x88888888u), 0x0101010101010101ull) * 0xFF;
            iq1_vector(grid, minus, g, k);
        }
        const uint64_t s4 = u64_at(blk + 48);
        const __m512i words = _mm512_permutexvar_epi16(
            _mm512_setr_epi32(0, 0, 0x10001, 0x10001, 0x20002, 0x20002, 0x30003, 0x30003,
                              0, 0, 0, 0, 0, 0, 0, 0),
            _mm512_castsi128_si512(_mm_cvtsi64_si128((long long)s4)));
        const __m512i shift = _mm512_setr_epi32(0x30000, 0x90006, 0x30000, 0x90006, 0x30000, 0x90006,
                                                0x30000, 0x90006, 0, 0, 0, 0, 0, 0, 0, 0);
        g->scales = odd_scales(_mm512_and_si512(_mm512_srlv_epi16(words, shift), _mm512_set1_epi16(7)));
        const uint16_t bits = (uint16_t)((s4 >> 12 & 0x000F) | (s4 >> 24 & 0x00F0) | (s4 >> 36 & 0x0F00) | (s4 >> 48 & 0xF000));
        g->d = _cvtsh_ss(bits) * 0.125f;
        return;
    }
    }
}

ALWAYS_INLINE void rows_q8k_grid(const uint8_t *w, int64_t stride, int64_t r0, int64_t r1,
                                 const act_t *a, int64_t i0, const int m, float *y,
                                 int64_t ldy, const float *bias, const int type) {
    const int64_t nb = a->n / 256, bytes = iq_grid_bytes(type);
    __m512i pick[4]; /* vector k's 128-bit lane j: the scale of weights 64k + 16j .. + 15 */
    for (int k = 0; k < 4; k++) {
        int16_t idx[32];
        for (int j = 0; j < 32; j++) idx[j] = (int16_t)grid_scale_word(type, 4 * k + j / 8);
        pick[k] = _mm512_loadu_si512(idx);
    }
    const uint8_t *end = w + r1 * stride;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * stride;
        __m512 acc[MAX_M];
        for (int i = 0; i < m; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + bytes * b;
            if (blk + PREFETCH + bytes <= end)
                for (int l = 0; l < bytes + 63; l += 64)
                    _mm_prefetch((const char *)blk + PREFETCH + l, _MM_HINT_T0);
            grid_block_t g;
            grid_block(type, blk, &g);
            __m512i scale[4];
            for (int k = 0; k < 4; k++) scale[k] = _mm512_permutexvar_epi16(pick[k], g.scales);
            for (int i = 0; i < m; i++) {
                const int8_t *xq = a->q + (i0 + i) * a->q_step + 256 * b;
                __m512i sum = _mm512_setzero_si512();
                for (int k = 0; k < 4; k++) {
                    const __m512i x = load512(xq + 64 * k);
                    const __m512i signed_x = _mm512_mask_sub_epi8(x, g.neg[k], _mm512_setzero_si512(), x);
                    sum = DPWSSD(sum, _mm512_maddubs_epi16(g.size[k], signed_x), scale[k]);
                }
                const float dx = a->d[(i0 + i) * a->d_step + b];
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(g.d * dx), acc[i]);
            }
        }
        for (int i = 0; i < m; i++) y[i * ldy + r] = _mm512_reduce_add_ps(acc[i]) + (bias ? bias[r] : 0.0f);
    }
}

DEFINE_Q8_MATVEC(IQ2_XXS, ORDER_Q8_K, 0, rows_q8k_grid, IQ2_XXS)
DEFINE_Q8_MATVEC(IQ2_XS, ORDER_Q8_K, 0, rows_q8k_grid, IQ2_XS)
DEFINE_Q8_MATVEC(IQ2_S, ORDER_Q8_K, 0, rows_q8k_grid, IQ2_S)
DEFINE_Q8_MATVEC(IQ3_XXS, ORDER_Q8_K, 0, rows_q8k_grid, IQ3_XXS)
DEFINE_Q8_MATVEC(IQ3_S, ORDER_Q8_K, 0, rows_q8k_grid, IQ3_S)
DEFINE_Q8_MATVEC(IQ1_S, ORDER_Q8_K, 0, rows_q8k_grid, IQ1_S)
DEFINE_Q8_MATVEC(IQ1_M, ORDER_Q8_K, 0, rows_q8k_grid, IQ1_M)

#ifdef __AVX512VBMI__
/* Q4_K_PACKED and Q5_K_PACKED (kernels_avx512.c's layouts: a row's f16 d's, dmins, scale
 * fields interleaved by groups of K_GROUP blocks (byte k of block j of a group of c at
 * k * c + j), (Q5_K) high bits, then each block's quants as two 64-byte groups h of
 * four sub-blocks 4h + s, byte 4i + s holding weights i (low nibble) and 16 + i
 * (high)), in ORDER_Q8_K. Two vpermt2b sort each load's nibbles into x's order,
 * sub-blocks 4h, 4h + 1 and 4h + 2, 4h + 3; Q5_K's high bits of sub-blocks 2t, 2t + 1
 * (in its u16 masks, bit k of u32 j: weight k of sub-block j) are then the byte mask of
 * vector t as they stand. The scales and mins decode a group at a time, one block a
 * lane: the scales of sub-blocks 2t and 2t + 1 as the two 16-bit halves of one vector,
 * from which one vpermw per block takes vector t's; the mins' part is taken per group,
 * blocks in lanes, against the activations' sums per 32 transposed to match. */
#define K_GROUP 16

/* vpermt2b indices: byte k of sub-blocks (s0 + k / 32) from lo (weights < 16) or hi */
ALWAYS_INLINE __m512i k_packed_sort(int s0) {
    uint8_t idx[64] __attribute__((aligned(64)));
    for (int k = 0; k < 64; k++) {
        const int s = s0 + k / 32, i = k % 32;
        idx[k] = (uint8_t)(i < 16 ? 4 * i + s : 64 + 4 * (i - 16) + s);
    }
    return _mm512_load_si512(idx);
}

/* kernels_avx512.c's: a group's 6-bit scales and mins, one block a lane. */
void k_group_fields(const uint8_t *scales, int c, __m512i sc[8], __m512i mins[8]);

/* A group of c blocks' scales and mins (k_group_fields), the scales of sub-blocks 2t
 * (low half) and 2t + 1 (high) as the 16-bit halves of pairs[t]. */
ALWAYS_INLINE void k_group_scales(const uint8_t *fields, int c, __m512i pairs[4], __m512i mins[8]) {
    __m512i sc[8];
    k_group_fields(fields, c, sc, mins);
    for (int t = 0; t < 4; t++)
        pairs[t] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(sc[2 * t])),
                                      _mm512_cvtepi32_epi16(sc[2 * t + 1]), 1);
}

ALWAYS_INLINE void rows_q8k_k_packed(const uint8_t *w, int64_t stride, int64_t r0, int64_t r1,
                                     const act_t *a, int64_t i0, const int m, float *y,
                                     int64_t ldy, const float *bias, const int five) {
    const int64_t nb = a->n / 256, bytes = five ? 176 : 144;
    const __m512i sort[2] = {k_packed_sort(0), k_packed_sort(2)};
    const __m512i nibble = _mm512_set1_epi8(15);
    const __m512i halves = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(16), 1);
    /* st[i][s * nb + b]: the sum of sub-block s's quants of activation block b, row i0 + i */
    int32_t st[m][8 * nb];
    for (int i = 0; i < m; i++)
        for (int64_t b = 0; b < nb; b++)
            for (int s = 0; s < 8; s++) st[i][s * nb + b] = q8k_sums32(a, i0 + i)[8 * b + s];
    const uint8_t *end = w + r1 * stride;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * stride, *qh = row + 16 * nb;
        const uint8_t *qs = row + (five ? 48 : 16) * nb;
        __m512 acc[MAX_M], accm[MAX_M];
        for (int i = 0; i < m; i++) acc[i] = accm[i] = _mm512_setzero_ps();
        for (int64_t b0 = 0; b0 < nb; b0 += K_GROUP) {
            const int c = nb - b0 < K_GROUP ? (int)(nb - b0) : K_GROUP;
            __m512i pairs[4], mins[8];
            k_group_scales(row + 4 * nb + 12 * b0, c, pairs, mins);
            for (int j = 0; j < c; j++) {
                const int64_t b = b0 + j;
                /* at a GGML block's pace through the bytes, as rows_k_packed */
                const uint8_t *ahead = row + PREFETCH + bytes * b;
                if (ahead + bytes <= end)
                    for (int l = 0; l < bytes + 63; l += 64)
                        _mm_prefetch((const char *)ahead + l, _MM_HINT_T0);
                const __m512i pick = _mm512_add_epi16(halves, _mm512_set1_epi16((short)j));
                __m512i sc[4];
                for (int t = 0; t < 4; t++) sc[t] = _mm512_permutexvar_epi16(pick, pairs[t]);
                __m512i u[4];
                for (int h = 0; h < 2; h++) {
                    const __m512i v = load512(qs + 128 * b + 64 * h);
                    const __m512i lo = _mm512_and_si512(v, nibble);
                    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
                    for (int e = 0; e < 2; e++) {
                        __m512i ut = _mm512_permutex2var_epi8(lo, sort[e], hi);
                        if (five) {
                            uint64_t bits;
                            memcpy(&bits, qh + 32 * b + 8 * (2 * h + e), 8);
                            ut = _mm512_mask_add_epi8(ut, _cvtu64_mask64(bits), ut, _mm512_set1_epi8(16));
                        }
                        u[2 * h + e] = ut;
                    }
                }
                const float d = f16_value(row + 2 * b);
                for (int i = 0; i < m; i++) {
                    const __m512i sum = q8k_block_sum(u, sc, a->q + (i0 + i) * a->q_step + 256 * b);
                    const float dx = a->d[(i0 + i) * a->d_step + b];
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(d * dx), acc[i]);
                }
            }
            const __mmask16 k = (__mmask16)((1u << c) - 1);
            const __m512 dmin = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, row + 2 * nb + 2 * b0));
            for (int i = 0; i < m; i++) {
                __m512i msum = _mm512_setzero_si512();
                for (int s = 0; s < 8; s++)
                    msum = _mm512_add_epi32(msum, _mm512_mullo_epi32(mins[s], _mm512_maskz_loadu_epi32(k, &st[i][s * nb + b0])));
                const __m512 dx = _mm512_maskz_loadu_ps(k, a->d + (i0 + i) * a->d_step + b0);
                accm[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dmin, dx), accm[i]);
            }
        }
        for (int i = 0; i < m; i++)
            y[i * ldy + r] = _mm512_reduce_add_ps(acc[i]) - _mm512_reduce_add_ps(accm[i]) + (bias ? bias[r] : 0.0f);
    }
}

DEFINE_Q8_MATVEC(Q4_K_PACKED, ORDER_Q8_K, 0, rows_q8k_k_packed, 0)
DEFINE_Q8_MATVEC(Q5_K_PACKED, ORDER_Q8_K, 0, rows_q8k_k_packed, 1)
#endif

/* ---- A prompt's rows: q8.h's GEMM on tiles of 32 weight rows (two vectors of outputs),
 * each 64-byte load of the tile meeting 4 quants of an activation row (broadcast): in
 * vpdpbusd with VNNI; without it in vpmaddubsw, whose 16-bit pair sums add up over
 * `group` loads before vpmaddwd widens them, as in q8_avx2.c (a group never saturates;
 * Q8_0, the i-quants and the ternary types take |w| against x negated where w is
 * negative, one load at a time). Four activation rows share each load. ---- */
#define TILE 32 /* weight rows a tile holds */
#define GEMM_MR 4 /* activation rows a pass takes */
#ifdef __AVX512VNNI__
#define GEMM_SIGNED 0 /* Q8_0's tiles hold w + 128 (the i-quants', ternary types': q8.h) */
#else
#define GEMM_SIGNED 1 /* Q8_0's (the i-quants', ternary types') tiles hold w */
#endif

/* The tile against activation rows i0 .. i0 + mr - 1, into y[i, r0 + j] for j < nr. */
ALWAYS_INLINE void gemm_pass(const uint8_t *q, const float *a, const float *c, const prompt_t *x,
                             int64_t i0, const int mr, float *y, int64_t ldy, int64_t r0,
                             int64_t nr, const float *bias, const int split, const int group,
                             const int sign) {
    const int64_t nb = x->nb;
    __m512 acc[GEMM_MR][2];
    for (int i = 0; i < mr; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i s[GEMM_MR][2][2];
        for (int h = 0; h < 1 + split; h++) {
            for (int i = 0; i < mr; i++) s[i][0][h] = s[i][1][h] = _mm512_setzero_si512();
            const int g1 = split ? 4 * h + 4 : 8;
            for (int g0 = split ? 4 * h : 0; g0 < g1; g0 += group) {
#ifdef __AVX512VNNI__
                (void)sign;
                for (int g = g0; g < g0 + group && g < g1; g++) {
                    const uint8_t *wq = q + (b * 8 + g) * TILE * 4;
                    const __m512i w0 = load512(wq), w1 = load512(wq + 64);
                    for (int i = 0; i < mr; i++) {
                        int32_t four;
                        memcpy(&four, x->q + (i0 + i) * x->n + 32 * b + 4 * g, 4);
                        const __m512i xv = _mm512_set1_epi32(four);
                        s[i][0][h] = _mm512_dpbusd_epi32(s[i][0][h], w0, xv);
                        s[i][1][h] = _mm512_dpbusd_epi32(s[i][1][h], w1, xv);
                    }
                }
#else
                __m512i p[GEMM_MR][2];
                for (int i = 0; i < mr; i++) p[i][0] = p[i][1] = _mm512_setzero_si512();
                /* rolled: unrolled, gcc spills each product to reorder the 16-bit adds */
#pragma GCC unroll 1
                for (int g = g0; g < g0 + group; g++) {
                    const uint8_t *wq = q + (b * 8 + g) * TILE * 4;
                    const __m512i w0 = load512(wq), w1 = load512(wq + 64);
                    const __mmask64 n0 = sign ? _mm512_movepi8_mask(w0) : 0;
                    const __mmask64 n1 = sign ? _mm512_movepi8_mask(w1) : 0;
                    const __m512i u0 = sign ? _mm512_abs_epi8(w0) : w0;
                    const __m512i u1 = sign ? _mm512_abs_epi8(w1) : w1;
                    for (int i = 0; i < mr; i++) {
                        int32_t four;
                        memcpy(&four, x->q + (i0 + i) * x->n + 32 * b + 4 * g, 4);
                        const __m512i xv = _mm512_set1_epi32(four);
                        const __m512i x0 = sign ? _mm512_mask_sub_epi8(xv, n0, _mm512_setzero_si512(), xv) : xv;
                        const __m512i x1 = sign ? _mm512_mask_sub_epi8(xv, n1, _mm512_setzero_si512(), xv) : xv;
                        p[i][0] = _mm512_add_epi16(p[i][0], _mm512_maddubs_epi16(u0, x0));
                        p[i][1] = _mm512_add_epi16(p[i][1], _mm512_maddubs_epi16(u1, x1));
                    }
                }
                for (int i = 0; i < mr; i++)
                    for (int v = 0; v < 2; v++)
                        s[i][v][h] = _mm512_add_epi32(s[i][v][h], _mm512_madd_epi16(p[i][v], _mm512_set1_epi16(1)));
#endif
            }
        }
        for (int v = 0; v < 2; v++) {
            const __m512 a0 = _mm512_loadu_ps(a + (2 * b) * TILE + 16 * v);
            const __m512 c0 = _mm512_loadu_ps(c + (2 * b) * TILE + 16 * v);
            for (int i = 0; i < mr; i++) {
                const int64_t at = (i0 + i) * nb + b;
                const __m512 dx = _mm512_set1_ps(x->d[at]);
                if (split) {
                    const __m512 a1 = _mm512_loadu_ps(a + (2 * b + 1) * TILE + 16 * v);
                    const __m512 c1 = _mm512_loadu_ps(c + (2 * b + 1) * TILE + 16 * v);
                    acc[i][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i][v][0]), _mm512_mul_ps(a0, dx), acc[i][v]);
                    acc[i][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i][v][1]), _mm512_mul_ps(a1, dx), acc[i][v]);
                    acc[i][v] = _mm512_fmadd_ps(c0, _mm512_set1_ps(x->s2[2 * at]), acc[i][v]);
                    acc[i][v] = _mm512_fmadd_ps(c1, _mm512_set1_ps(x->s2[2 * at + 1]), acc[i][v]);
                } else {
                    acc[i][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i][v][0]), _mm512_mul_ps(a0, dx), acc[i][v]);
                    acc[i][v] = _mm512_fmadd_ps(c0, _mm512_set1_ps(x->s[at]), acc[i][v]);
                }
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < 2; v++) {
            const int64_t left = nr - 16 * v;
            if (left <= 0) continue;
            const __mmask16 k = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
            __m512 out = acc[i][v];
            if (bias) out = _mm512_add_ps(out, _mm512_maskz_loadu_ps(k, bias + r0 + 16 * v));
            _mm512_mask_storeu_ps(y + (i0 + i) * ldy + r0 + 16 * v, k, out);
        }
}

#define GEMM_ROWS(SPLIT, GROUP, SIGN)                                                    \
    do {                                                                                 \
        int64_t i0 = 0;                                                                  \
        for (; i0 + GEMM_MR <= x->m; i0 += GEMM_MR)                                      \
            gemm_pass(q, a, c, x, i0, GEMM_MR, y, ldy, r0, nr, bias, SPLIT, GROUP, SIGN); \
        for (; i0 < x->m; i0++) gemm_pass(q, a, c, x, i0, 1, y, ldy, r0, nr, bias, SPLIT, GROUP, SIGN); \
    } while (0)

/* Every activation row against one tile (q8.h's gemm_tile_fn). With VNNI a group is the
 * whole block; without it, as many loads as cannot saturate for the type. */
static void gemm_tile(int type, const uint8_t *q, const float *a, const float *c, const prompt_t *x,
                      float *y, int64_t ldy, int64_t r0, int64_t nr, const float *bias) {
#ifdef __AVX512VNNI__
    /* split: a scale per 16 weights */
    if (type == Q6_K || type == IQ2_XS || type == IQ2_S || type == IQ1_M) GEMM_ROWS(1, 8, 0);
    else GEMM_ROWS(0, 8, 0);
#else
    switch (type) {
    case Q4_0: case Q4_0_PACKED: case Q4_K: case Q4_K_PACKED: GEMM_ROWS(0, 8, 0); break;
    case Q6_K: GEMM_ROWS(1, 2, 0); break;
    case Q8_0: case Q8_0_PACKED: case IQ4_NL: case IQ4_XS: case IQ2_XXS: case IQ3_XXS: case IQ3_S:
    case IQ1_S: case TQ1_0: case TQ2_0:
        GEMM_ROWS(0, 1, 1);
        break;
    case IQ2_XS: case IQ2_S: case IQ1_M: GEMM_ROWS(1, 1, 1); break; /* a scale per 16 */
    default: GEMM_ROWS(0, 4, 0); break; /* Q5_0, Q5_K (packed too), MXFP4 */
    }
#endif
}

/* y [m, rows] = x [m, n] W^T (+ bias) with x quantized to Q8_0 (Q8_K) rows: 0, or -1 for a type
 * the tiles cannot take (or memory running out); the caller then takes the matvec. */
int llmrun_gemm_q8(int type, const uint8_t *w, int64_t stride, int64_t rows, const float *x,
                   int64_t m, int64_t n, float *y, const float *bias) {
    return q8_gemm(type, w, stride, rows, x, m, n, y, bias, TILE, GEMM_SIGNED, gemm_tile);
}

DEFINE_Q8_API()

#endif
