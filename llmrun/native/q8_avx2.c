/* 8-bit-activation matvecs, AVX2 (q8.h says what they compute). 32 bytes of u8 weights
 * meet 32 activation quants in vpmaddubsw (u8 x s8 pairs to s16) and vpmaddwd (pairs
 * to s32); each dword lane of the sum holds one block's, so its float, times the
 * lane's weight scale and activation scale, goes into a float accumulator. The 16-bit
 * pair sums never saturate: Q4_0, Q5_0 and MXFP4 (u8 weights up to 31) add two of
 * them, at most 2 * 2 * 31 * 127; Q6_K's reach 2 * 63 * 127; Q8_0 and the i-quants
 * take |w| against x with w's sign (at most 2 * 128 * 127), as llama.cpp does.
 */
#include "common.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include "q8.h"

#define Q8_TYPES(X)                                                                      \
    X(Q4_0_PACKED, 128) X(Q5_0_PACKED, 128) X(Q8_0_PACKED, 32) X(Q4_0, 32) X(Q5_0, 32)      \
    X(Q8_0, 32) X(MXFP4, 32) X(Q4_K, 256) X(Q5_K, 256) X(Q6_K, 256) X(IQ4_NL, 32)        \
    X(IQ4_XS, 256) X(TQ1_0, 256) X(TQ2_0, 256) X(IQ2_XXS, 256) X(IQ2_XS, 256) X(IQ2_S, 256) \
    X(IQ3_XXS, 256) X(IQ3_S, 256) X(IQ1_S, 256) X(IQ1_M, 256)

ALWAYS_INLINE __m256i load256(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* Packed Q4_0 and Q5_0: q8.h's rows_q8_packed_256 */
DEFINE_Q8_MATVEC(Q4_0_PACKED, ORDER_QUADS, 8, rows_q8_packed_256, 0)
DEFINE_Q8_MATVEC(Q5_0_PACKED, ORDER_QUADS, 16, rows_q8_packed_256, 1)

/* Q8_0_PACKED (kernels_avx2.c's layout: a row's f16 scales, then its 32-byte quants),
 * a block a load: |w| against x with w's sign, scaled by d_w * d_x. */
ALWAYS_INLINE void rows_q8_q8_0(const uint8_t *w, int64_t stride, int64_t r0, int64_t r1,
                                const act_t *a, int64_t i0, const int m, float *y,
                                int64_t ldy, const float *bias) {
    const int64_t n = a->n, nb = n / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    const uint8_t *end = w + r1 * stride;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * stride, *qs = row + 2 * nb;
        __m256 acc[MAX_M];
        for (int i = 0; i < m; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t b0 = 0; b0 < nb; b0 += 8) {
            const int c = nb - b0 < 8 ? (int)(nb - b0) : 8;
            /* at the row's pace through all its bytes, scales too (34 a block) */
            const uint8_t *ahead = row + PREFETCH + 34 * b0;
            if (ahead + 8 * 34 <= end)
                for (int k = 0; k < 8 * 34 + 63; k += 64)
                    _mm_prefetch((const char *)ahead + k, _MM_HINT_T0);
            float dw[8];
            if (c == 8)
                _mm256_storeu_ps(dw, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * b0))));
            else
                for (int k = 0; k < c; k++) {
                    uint16_t h;
                    memcpy(&h, row + 2 * (b0 + k), 2);
                    dw[k] = _cvtsh_ss(h);
                }
            for (int k = 0; k < c; k++) {
                const __m256i v = load256(qs + 32 * (b0 + k));
                const __m256i u = _mm256_sign_epi8(v, v);
                for (int i = 0; i < m; i++) {
                    const __m256i xq = load256(a->q + (i0 + i) * a->q_step + 32 * (b0 + k));
                    const __m256i pairs = _mm256_maddubs_epi16(u, _mm256_sign_epi8(xq, v));
                    const __m256i sum = _mm256_madd_epi16(pairs, ones);
                    const __m256 scale = _mm256_set1_ps(dw[k] * a->d[(i0 + i) * a->d_step + b0 + k]);
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

DEFINE_Q8_MATVEC(Q8_0_PACKED, ORDER_NATURAL, 0, rows_q8_q8_0)

ALWAYS_INLINE float reduce_256(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

/* The integer sum of 32 u8 weights and 32 activation quants, per dword lane. */
ALWAYS_INLINE __m256i dot_u8(__m256i u, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
}

/* GGML's Q4_0 (18-byte blocks), Q5_0 (22), MXFP4 (17) and IQ4_NL (18), two blocks a
 * 32-byte vector, one 16-byte lane each (ORDER_QUADS, as the packed layouts): the low
 * nibbles meet the blocks' activations 0..15 and the high ones 16..31, their pair sums
 * added in 16 bits (at most 2 * 2 * 31 * 127; IQ4_NL's, up to 2 * 127 * 127, widened
 * apart), so one float scale and multiply-add per 64 weights. Q5_0's high bits spread to
 * bytes as in rows_q8_packed; MXFP4's codes look up their values plus 12 (so unsigned);
 * IQ4_NL's look up theirs, whose sizes meet the activations with their signs (q8.h).
 * The weights' offset (8, 16, 12; IQ4_NL's 0) is in the lanes' start.
 * A row's last quad may hold fewer blocks (rows of any multiple of 32): the lanes of the
 * missing ones have scale 0. */
/* The scales of c <= 8 blocks `bytes` apart, 0 past c: their fields gathered (a whole
 * group without branches), then converted at once (E8M0 as e8m0_half). */
ALWAYS_INLINE __m256 quad_scales(const uint8_t *src, int c, const int kind) {
    const int bytes = quad_bytes(kind);
    __m256 v;
    if (kind == QUAD_MXFP4) {
        uint64_t e8 = 0;
        if (c == 8)
            e8 = gather8(src, bytes, 1);
        else
            for (int k = 0; k < c; k++) e8 |= (uint64_t)src[k * bytes] << 8 * k;
        const __m256i e = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)e8));
        const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
        const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
        const __m256i low = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
        v = _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, low));
    } else {
        uint64_t h[2] = {0, 0};
        if (c == 8) {
            h[0] = gather8(src, bytes, 2), h[1] = gather8(src + 4 * bytes, bytes, 2);
        } else {
            for (int k = 0; k < c; k++) h[k / 4] |= (uint64_t)(u32_at(src + k * bytes) & 0xFFFF) << 16 * (k % 4);
        }
        v = _mm256_cvtph_ps(_mm_set_epi64x((long long)h[1], (long long)h[0]));
    }
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(c), lanes)));
}

/* Blocks b and (if two) b + 1 at src into acc[i][chain] for the m rows, their scales in
 * lanes 2h, 2h + 1 of d8 (chain constant: a variable index would keep acc in memory).
 * A missing second block's lane repeats the first block's quants. */
ALWAYS_INLINE void quad_step(const uint8_t *src, const int two, __m256 d8, int h,
                             const act_t *a, int64_t i0, const int m, int64_t b,
                             __m256 acc[][2], const int chain, const int kind) {
    const int bytes = quad_bytes(kind);
    const int qs = kind == QUAD_Q4_0 || kind == QUAD_IQ4_NL ? 2 : kind == QUAD_Q5_0 ? 6 : 1;
    const __m128i q0 = _mm_loadu_si128((const __m128i *)(src + qs));
    const __m256i v = _mm256_set_m128i(two ? _mm_loadu_si128((const __m128i *)(src + bytes + qs)) : q0, q0);
    const __m256i nibble = _mm256_set1_epi8(15);
    __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
    if (kind == QUAD_Q5_0) {
        /* bit j of a block's word: its weight j; low nibbles take bits 0..15 */
        const uint32_t w0 = u32_at(src + 2), w1 = two ? u32_at(src + bytes + 2) : 0;
        lo = _mm256_or_si256(lo, bit4_bytes((w0 & 0xFFFF) | w1 << 16));
        hi = _mm256_or_si256(hi, bit4_bytes(w0 >> 16 | (w1 & 0xFFFF0000u)));
    }
    if (kind == QUAD_MXFP4) {
        const __m128i values = _mm_loadu_si128((const __m128i *)MXFP4_VALUES);
        const __m256i table = _mm256_broadcastsi128_si256(_mm_add_epi8(values, _mm_set1_epi8(12)));
        lo = _mm256_shuffle_epi8(table, lo);
        hi = _mm256_shuffle_epi8(table, hi);
    }
    __m256i size_lo = lo, size_hi = hi; /* IQ4_NL: its values' sizes (lo, hi: the values) */
    if (kind == QUAD_IQ4_NL) {
        const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_NL_VALUES));
        lo = _mm256_shuffle_epi8(table, lo);
        hi = _mm256_shuffle_epi8(table, hi);
        size_lo = _mm256_abs_epi8(lo), size_hi = _mm256_abs_epi8(hi);
    }
    const __m256i pick = _mm256_setr_epi32(2 * h, 2 * h, 2 * h, 2 * h, 2 * h + 1, 2 * h + 1,
                                           2 * h + 1, 2 * h + 1);
    const __m256 dw = _mm256_permutevar8x32_ps(d8, pick);
    for (int i = 0; i < m; i++) {
        /* ORDER_QUADS: block b's values 0..15 at 128 (b / 4) + 16 (b % 4), 16..31 64 on */
        const int8_t *xq = a->q + (i0 + i) * a->q_step + 128 * (b / 4) + 16 * (b % 4);
        const int64_t l = (i0 + i) * a->lane_step + 16 * (b / 4) + 4 * (b % 4);
        __m256i sum;
        if (kind == QUAD_IQ4_NL) {
            const __m256i xlo = _mm256_sign_epi8(load256(xq), lo), xhi = _mm256_sign_epi8(load256(xq + 64), hi);
            sum = _mm256_add_epi32(dot_u8(size_lo, xlo), dot_u8(size_hi, xhi));
        } else {
            const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, load256(xq)),
                                                   _mm256_maddubs_epi16(hi, load256(xq + 64)));
            sum = _mm256_add_epi32(load256(a->lane + l), _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
        }
        const __m256 scale = _mm256_mul_ps(dw, _mm256_loadu_ps(a->dq + l));
        acc[i][chain] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc[i][chain]);
    }
}

ALWAYS_INLINE void rows_q8_quads(const uint8_t *w, int64_t stride, int64_t r0, int64_t r1,
                                 const act_t *a, int64_t i0, const int m, float *y,
                                 int64_t ldy, const float *bias, const int kind) {
    const int64_t nb = a->n / 32;
    const int bytes = quad_bytes(kind), odd = m <= 2 ? 1 : 0; /* odd pairs' chain */
    const uint8_t *end = w + r1 * stride;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * stride;
        __m256 acc[MAX_M][2];
        for (int i = 0; i < m; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
        for (int64_t b0 = 0; b0 < nb; b0 += 8) {
            const int c = nb - b0 < 8 ? (int)(nb - b0) : 8;
            const uint8_t *src = row + b0 * bytes;
            if (src + PREFETCH + c * bytes <= end)
                for (int l = 0; l < c * bytes; l += 64)
                    _mm_prefetch((const char *)src + PREFETCH + l, _MM_HINT_T0);
            const __m256 d8 = quad_scales(src, c, kind);
            if (c == 8) {
                for (int h = 0; h < 4; h += 2) {
                    quad_step(src + 2 * h * bytes, 1, d8, h, a, i0, m, b0 + 2 * h, acc, 0, kind);
                    quad_step(src + 2 * (h + 1) * bytes, 1, d8, h + 1, a, i0, m, b0 + 2 * h + 2,
                              acc, odd, kind);
                }
            } else {
                for (int h = 0; 2 * h < c; h++)
                    quad_step(src + 2 * h * bytes, 2 * h + 1 < c, d8, h, a, i0, m, b0 + 2 * h, acc,
                              0, kind);
            }
        }
        for (int i = 0; i < m; i++)
            y[i * ldy + r] = reduce_256(_mm256_add_ps(acc[i][0], acc[i][1])) + (bias ? bias[r] : 0.0f);
    }
}

DEFINE_Q8_MATVEC(Q4_0, ORDER_QUADS, 8, rows_q8_quads, QUAD_Q4_0)
DEFINE_Q8_MATVEC(Q5_0, ORDER_QUADS, 16, rows_q8_quads, QUAD_Q5_0)
DEFINE_Q8_MATVEC(MXFP4, ORDER_QUADS, 12, rows_q8_quads, QUAD_MXFP4)
DEFINE_Q8_MATVEC(IQ4_NL, ORDER_QUADS, 0, rows_q8_quads, QUAD_IQ4_NL)

/* GGML's Q8_0 (34-byte blocks), a block a 32-byte vector in x's order: |w| against x
 * with w's sign, scaled by d_w * d_x, into acc[i][chain] (constant, as quad_step's). */
ALWAYS_INLINE void q8_0_step(const uint8_t *src, const act_t *a, int64_t i0, const int m,
                             int64_t b, __m256 acc[][2], const int chain) {
    const __m256i v = load256(src + 2);
    const __m256i u = _mm256_sign_epi8(v, v);
    const float dw = f16_value(src);
    for (int i = 0; i < m; i++) {
        const __m256i xq = load256(a->q + (i0 + i) * a->q_step + 32 * b);
        const __m256i sum = dot_u8(u, _mm256_sign_epi8(xq, v));
        const __m256 scale = _mm256_set1_ps(dw * a->d[(i0 + i) * a->d_step + b]);
        acc[i][chain] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc[i][chain]);
    }
}

ALWAYS_INLINE void rows_q8_ggml_q8_0(const uint8_t *w, int64_t stride, int64_t r0, int64_t r1,
                                     const act_t *a, int64_t i0, const int m, float *y,
                                     int64_t ldy, const float *bias) {
    const int64_t nb = a->n / 32;
    const int odd = m <= 2 ? 1 : 0; /* odd blocks' chain */
    const uint8_t *end = w + r1 * stride;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * stride;
        __m256 acc[MAX_M][2];
        for (int i = 0; i < m; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b += 2) {
            const uint8_t *src = row + 34 * b;
            if (src + PREFETCH + 68 <= end) {
                _mm_prefetch((const char *)src + PREFETCH, _MM_HINT_T0);
                _mm_prefetch((const char *)src + PREFETCH + 64, _MM_HINT_T0);
            }
            q8_0_step(src, a, i0, m, b, acc, 0);
            if (b + 1 < nb) q8_0_step(src + 34, a, i0, m, b + 1, acc, odd);
        }
        for (int i = 0; i < m; i++)
            y[i * ldy + r] = reduce_256(_mm256_add_ps(acc[i][0], acc[i][1])) + (bias ? bias[r] : 0.0f);
    }
}

DEFINE_Q8_MATVEC(Q8_0, ORDER_NATURAL, 0, rows_q8_ggml_q8_0)

/* The K-quants against Q8_K activations (one scale per 256): vpmaddubsw's 16-bit pair
 * sums (at most 2 * 63 * 127) meet the weights' integer sub-block scales in vpmaddwd,
 * so a block's whole sum is one integer vector, converted and scaled by d * d_x once. */

/* GGML's Q4_K (144-byte blocks; five 0) and Q5_K (176; five 1) in ORDER_Q8_K: 32 bytes
 * of quants hold sub-block 2p in their low nibbles and 2p + 1 in their high ones; Q5_K's
 * bit j of byte l (weight l of sub-block j) moves to bit 4. The mins' part, dmin * d_x *
 * sum_j m_j * (the sum of sub-block j's activation quants), is an integer per block
 * too, taken in 128 bits. */
ALWAYS_INLINE void rows_q8k_k(const uint8_t *w, int64_t stride, int64_t r0, int64_t r1,
                              const act_t *a, int64_t i0, const int m, float *y, int64_t ldy,
                              const float *bias, const int five) {
    const int64_t nb = a->n / 256, bytes = five ? 176 : 144;
    const __m256i nibble = _mm256_set1_epi8(15), bit4 = _mm256_set1_epi8(16);
    const uint8_t *end = w + r1 * stride;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * stride;
        __m256 acc[MAX_M];
        __m128 accm[MAX_M];
        for (int i = 0; i < m; i++) acc[i] = _mm256_setzero_ps(), accm[i] = _mm_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + bytes * b;
            if (blk + PREFETCH + bytes <= end)
                for (int l = 0; l < bytes; l += 64)
                    _mm_prefetch((const char *)blk + PREFETCH + l, _MM_HINT_T0);
            const __m256i sm = _mm256_cvtepu8_epi16(k_scale_bytes(blk + 4));
            const __m256i scales = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sm));
            const __m128i mins = _mm256_extracti128_si256(sm, 1);
            const float d = f16_value(blk), dmin = f16_value(blk + 2);
            const uint8_t *qs = blk + (five ? 48 : 16);
            __m256i sum[MAX_M];
            for (int i = 0; i < m; i++) sum[i] = _mm256_setzero_si256();
            for (int p = 0; p < 4; p++) {
                const __m256i v = load256(qs + 32 * p);
                __m256i u[2] = {_mm256_and_si256(v, nibble),
                                _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble)};
                if (five) {
                    const __m256i qh = load256(blk + 16);
                    for (int h = 0; h < 2; h++) {
                        const int j = 2 * p + h;
                        const __m256i hb = j <= 4 ? _mm256_slli_epi16(qh, 4 - j) : _mm256_srli_epi16(qh, j - 4);
                        u[h] = _mm256_or_si256(u[h], _mm256_and_si256(hb, bit4));
                    }
                }
                __m256i sc[2]; /* sub-block 2p + h's scale in every 16-bit lane */
                for (int h = 0; h < 2; h++) {
                    const int j = 2 * p + h;
                    sc[h] = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)(2 * j | (2 * j + 1) << 8)));
                }
                for (int i = 0; i < m; i++) {
                    const int8_t *xq = a->q + (i0 + i) * a->q_step + 256 * b + 64 * p;
                    for (int h = 0; h < 2; h++)
                        sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(_mm256_maddubs_epi16(u[h], load256(xq + 32 * h)), sc[h]));
                }
            }
            for (int i = 0; i < m; i++) {
                const float dx = a->d[(i0 + i) * a->d_step + b];
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[i]), _mm256_set1_ps(d * dx), acc[i]);
                const __m128i bsum = _mm_loadu_si128((const __m128i *)(q8k_sums32(a, i0 + i) + 8 * b));
                accm[i] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_madd_epi16(mins, bsum)), _mm_set1_ps(dmin * dx), accm[i]);
            }
        }
        for (int i = 0; i < m; i++)
            y[i * ldy + r] = reduce_256(acc[i]) - reduce_128(accm[i]) + (bias ? bias[r] : 0.0f);
    }
}

DEFINE_Q8_MATVEC(Q4_K, ORDER_Q8_K, 0, rows_q8k_k, 0)
DEFINE_Q8_MATVEC(Q5_K, ORDER_Q8_K, 0, rows_q8k_k, 1)

/* GGML's Q6_K (210-byte blocks: ql[128], qh[64], int8 scales[16], f16 d) in ORDER_Q8_K:
 * weights 128c + 32t + l (t < 4) take nibble t / 2 of ql[64c + 32(t % 2) + l] and bits
 * 2t, 2t + 1 of qh[32c + l], moved to bits 4, 5; u8 weights q + 32. A 32-weight vector
 * spans two scales (16 weights, one 128-bit half each). The offset comes off the block's
 * integer sum as 32 * sum_k sc_k * (the sum of the k-th 16 activation quants). */
ALWAYS_INLINE void rows_q8k_q6_k(const uint8_t *w, int64_t stride, int64_t r0, int64_t r1,
                                 const act_t *a, int64_t i0, const int m, float *y,
                                 int64_t ldy, const float *bias) {
    const int64_t nb = a->n / 256, bytes = 210;
    const __m256i nibble = _mm256_set1_epi8(15), bits45 = _mm256_set1_epi8(0x30);
    /* from a dword of two 16-bit scales: the first in the low half, the second in the high */
    const __m256i spread = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                            2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    const uint8_t *end = w + r1 * stride;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * stride;
        __m256 acc[MAX_M];
        for (int i = 0; i < m; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + bytes * b;
            if (blk + PREFETCH + bytes <= end)
                for (int l = 0; l < bytes + 63; l += 64)
                    _mm_prefetch((const char *)blk + PREFETCH + l, _MM_HINT_T0);
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
            const float d = f16_value(blk + 208);
            __m256i sum[MAX_M];
            for (int i = 0; i < m; i++) sum[i] = _mm256_setzero_si256();
            for (int c = 0; c < 2; c++) {
                const __m256i qh = load256(blk + 128 + 32 * c);
                for (int t = 0; t < 4; t++) {
                    const __m256i ql = load256(blk + 64 * c + 32 * (t % 2));
                    const __m256i lq = _mm256_and_si256(t < 2 ? ql : _mm256_srli_epi16(ql, 4), nibble);
                    const __m256i hs = t == 0 ? _mm256_slli_epi16(qh, 4) : t == 1 ? _mm256_slli_epi16(qh, 2)
                                     : t == 2 ? qh : _mm256_srli_epi16(qh, 2);
                    const __m256i u = _mm256_or_si256(lq, _mm256_and_si256(hs, bits45));
                    const int k = 4 * c + t; /* the block of 32 in the 256: scales 2k, 2k + 1 */
                    const __m256i sc = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(sc16, _mm256_set1_epi32(k)), spread);
                    for (int i = 0; i < m; i++) {
                        const int8_t *xq = a->q + (i0 + i) * a->q_step + 256 * b + 32 * k;
                        sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(_mm256_maddubs_epi16(u, load256(xq)), sc));
                    }
                }
            }
            for (int i = 0; i < m; i++) {
                const __m256i bsum = load256(q8k_sums16(a, i0 + i) + 16 * b);
                const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(sc16, bsum), 5);
                const float dx = a->d[(i0 + i) * a->d_step + b];
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sum[i], offset)), _mm256_set1_ps(d * dx), acc[i]);
            }
        }
        for (int i = 0; i < m; i++) y[i * ldy + r] = reduce_256(acc[i]) + (bias ? bias[r] : 0.0f);
    }
}

DEFINE_Q8_MATVEC(Q6_K, ORDER_Q8_K, 0, rows_q8k_q6_k)

/* GGML's IQ4_XS (136-byte blocks: f16 d, u16 scales_h, u8 scales_l[4], qs[128]) in
 * ORDER_Q8_K: 32 bytes of qs hold sub-blocks 2p and 2p + 1 of 32, one 16-byte lane each,
 * their weights 0..15 in the low nibbles and 16..31 in the high ones; vpshufb looks up
 * the values and vperm2i128 puts each sub-block's halves together in x's order. The
 * values' sizes meet the activations with their signs in vpmaddubsw, whose pair sums
 * meet the sub-block's scale less 32 in vpmaddwd, so a block's sum is one integer
 * vector, converted and scaled by d * d_x once. */
ALWAYS_INLINE void rows_q8k_iq4_xs(const uint8_t *w, int64_t stride, int64_t r0, int64_t r1,
                                   const act_t *a, int64_t i0, const int m, float *y,
                                   int64_t ldy, const float *bias) {
    const int64_t nb = a->n / 256;
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_NL_VALUES));
    const __m256i nibble = _mm256_set1_epi8(15);
    const uint8_t *end = w + r1 * stride;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * stride;
        __m256 acc[MAX_M];
        for (int i = 0; i < m; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + IQ4_XS_BYTES * b;
            if (blk + PREFETCH + IQ4_XS_BYTES <= end)
                for (int l = 0; l < IQ4_XS_BYTES + 63; l += 64)
                    _mm_prefetch((const char *)blk + PREFETCH + l, _MM_HINT_T0);
            const uint64_t scales = iq4_xs_scales(blk);
            __m256i sum[MAX_M];
            for (int i = 0; i < m; i++) sum[i] = _mm256_setzero_si256();
            for (int p = 0; p < 4; p++) {
                const __m256i v = load256(blk + 8 + 32 * p);
                const __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(v, nibble));
                const __m256i hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble));
                const __m256i values[2] = {_mm256_permute2x128_si256(lo, hi, 0x20),
                                           _mm256_permute2x128_si256(lo, hi, 0x31)};
                __m256i size[2], sc[2];
                for (int h = 0; h < 2; h++) {
                    size[h] = _mm256_abs_epi8(values[h]);
                    sc[h] = _mm256_set1_epi16((int8_t)(scales >> 8 * (2 * p + h)));
                }
                for (int i = 0; i < m; i++) {
                    const int8_t *xq = a->q + (i0 + i) * a->q_step + 256 * b + 64 * p;
                    for (int h = 0; h < 2; h++) {
                        const __m256i x = _mm256_sign_epi8(load256(xq + 32 * h), values[h]);
                        sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(_mm256_maddubs_epi16(size[h], x), sc[h]));
                    }
                }
            }
            const float d = f16_value(blk);
            for (int i = 0; i < m; i++) {
                const float dx = a->d[(i0 + i) * a->d_step + b];
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[i]), _mm256_set1_ps(d * dx), acc[i]);
            }
        }
        for (int i = 0; i < m; i++) y[i * ldy + r] = reduce_256(acc[i]) + (bias ? bias[r] : 0.0f);
    }
}

DEFINE_Q8_MATVEC(IQ4_XS, ORDER_Q8_K, 0, rows_q8k_iq4_xs)

/* GGML's TQ1_0 (one 1) and TQ2_0 (one 0) in ORDER_Q8_K, a block's trits as q8.h decodes
 * them: their pair sums with the activation quants (at most 2 * 2 * 127) add up over the
 * whole block in 16 bits, less the sum of the block's activation quants (the trits'
 * offset of 1), times d * d_x. */
ALWAYS_INLINE void rows_q8k_ternary(const uint8_t *w, int64_t stride, int64_t r0, int64_t r1,
                                    const act_t *a, int64_t i0, const int m, float *y,
                                    int64_t ldy, const float *bias, const int one) {
    const int64_t nb = a->n / 256, bytes = one ? TQ1_0_BYTES : TQ2_0_BYTES;
    const __m256i ones = _mm256_set1_epi16(1);
    const uint8_t *end = w + r1 * stride;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * stride;
        __m256 acc[MAX_M];
        for (int i = 0; i < m; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + bytes * b;
            if (blk + PREFETCH + bytes <= end)
                for (int l = 0; l < bytes + 63; l += 64)
                    _mm_prefetch((const char *)blk + PREFETCH + l, _MM_HINT_T0);
            __m256i u[8];
            if (one) tq1_0_trits(blk, u);
            else tq2_0_trits(blk, u);
            const float d = f16_value(blk + bytes - 2);
            for (int i = 0; i < m; i++) {
                const int8_t *xq = a->q + (i0 + i) * a->q_step + 256 * b;
                __m256i pairs = _mm256_setzero_si256();
                for (int k = 0; k < 8; k++) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(u[k], load256(xq + 32 * k)));
                const __m256i xsum = _mm256_madd_epi16(load256(q8k_sums16(a, i0 + i) + 16 * b), ones);
                const __m256i sum = _mm256_sub_epi32(_mm256_madd_epi16(pairs, ones), xsum);
                const float dx = a->d[(i0 + i) * a->d_step + b];
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(d * dx), acc[i]);
            }
        }
        for (int i = 0; i < m; i++) y[i * ldy + r] = reduce_256(acc[i]) + (bias ? bias[r] : 0.0f);
    }
}

DEFINE_Q8_MATVEC(TQ1_0, ORDER_Q8_K, 0, rows_q8k_ternary, 1)
DEFINE_Q8_MATVEC(TQ2_0, ORDER_Q8_K, 0, rows_q8k_ternary, 0)

/* ---- The IQ2s' and IQ1s' decode for the matvec, 32 weights at a time: iq_grid_block's
 * sizes, signs and scales, with the signs from the sign bits in registers (vpshufb
 * spreads each sign byte over its 8 weights, vpcmpeqb tests each its bit) instead of
 * table lookups, the scales built in registers, and IQ2_S's and the IQ1s' grid rows by
 * one vpgatherdq, their indices' high bits by a vector shift. IQ2_XXS's and IQ2_XS's
 * rows come by four loads as before: faster than the gather there (Zen 4, kernel_ab.py,
 * 2.7 -> 3.0 GB/s and 2.8 -> 3.1), the same for the others. IQ3_XXS and IQ3_S decode
 * with iq_grid_block (it gathers their 4-byte rows). ---- */

/* +1 per byte, or -1 where byte j's bit j % 8 of sign byte j / 8 of `bytes` is set */
ALWAYS_INLINE __m256i sign_bits(uint32_t bytes) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)bytes),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                         2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    return _mm256_or_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(1));
}

/* The sign bytes of four 7-bit ksigns indices (the bytes of v, bit 7 clear): each index
 * with its parity in bit 7, as ksigns holds them. */
ALWAYS_INLINE uint32_t ksigns4(uint32_t v) {
    uint32_t p = v ^ v >> 4; /* bit 0 of each byte ends up as the parity of the byte */
    p ^= p >> 2;
    p ^= p >> 1;
    return v | (p & 0x01010101u) << 7;
}

/* The low 28 bits of v as four bytes of 7 bits each (shifts, not pdep: pdep is microcoded and
 * slow on AMD before Zen 3, which run this family) */
ALWAYS_INLINE uint32_t seven_bit_bytes(uint32_t v) {
    return (v & 0x7F) | (v >> 7 & 0x7F) << 8 | (v >> 14 & 0x7F) << 16 | (v >> 21 & 0x7F) << 24;
}

ALWAYS_INLINE uint64_t u64_at(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* rows idx[0..3] of an 8-byte grid */
ALWAYS_INLINE __m256i grid8_gather(const uint8_t *grid, __m128i idx) {
    return _mm256_i32gather_epi64((const long long *)grid, idx, 8);
}

/* the 4 bytes at p, one a dword */
ALWAYS_INLINE __m128i bytes4_epi32(const uint8_t *p) {
    return _mm_cvtepu8_epi32(_mm_cvtsi32_si128((int)u32_at(p)));
}

/* bits shift[l] .. of v, masked, times 256: the high bits of 4 grid indices */
ALWAYS_INLINE __m128i high_bits(uint32_t v, __m128i shift, int mask) {
    return _mm_slli_epi32(_mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32((int)v), shift), _mm_set1_epi32(mask)), 8);
}

/* 2 s + 1 in each word, s the bits of v from `low` in the low lane and from `low` +
 * `step` in the high one, `mask` of them */
ALWAYS_INLINE __m256i lane_scales(uint32_t v, int low, int step, int mask) {
    const __m256i shift = _mm256_setr_epi32(low, low, low, low, low + step, low + step, low + step, low + step);
    const __m256i s = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)(v * 0x10001u)), shift),
                                       _mm256_set1_epi16((short)mask));
    return _mm256_add_epi16(_mm256_add_epi16(s, s), _mm256_set1_epi16(1));
}

/* The block's d times the type's factor */
ALWAYS_INLINE float grid_d(const int type, const uint8_t *blk) {
    if (type == IQ1_M) {
        const uint64_t s4 = u64_at(blk + 48);
        return _cvtsh_ss((uint16_t)((s4 >> 12 & 0x000F) | (s4 >> 24 & 0x00F0) | (s4 >> 36 & 0x0F00) |
                                    (s4 >> 48 & 0xF000))) * 0.125f;
    }
    return f16_value(blk) * 0.125f;
}

/* Weights 32 ib .. 32 ib + 31 of the block: their sizes, signs and scales (the low
 * lane's 16 values' in the low lane, as iq_grid_block's sc) */
ALWAYS_INLINE void grid_group(const int type, const uint8_t *blk, int ib, __m256i *size, __m256i *sign,
                              __m256i *scale) {
    switch (type) {
    case IQ2_XXS: {
        const uint8_t *q = blk + 2 + 8 * ib;
        const uint32_t aux = u32_at(q + 4);
        *size = grid8(iq2xxs_grid, q[0], q[1], q[2], q[3]);
        *sign = sign_bits(ksigns4(_pdep_u32(aux, 0x7F7F7F7Fu)));
        *scale = _mm256_set1_epi16((short)(2 * (aux >> 28) + 1));
        return;
    }
    case IQ2_XS: {
        const uint8_t *q = blk + 2 + 8 * ib;
        uint16_t f[4];
        memcpy(f, q, 8);
        *size = grid8(iq2xs_grid, f[0] & 511, f[1] & 511, f[2] & 511, f[3] & 511);
        /* each index's top 7 bits: its 8 weights' signs, the 8th by parity */
        const uint32_t signs = (uint32_t)_pext_u64(u64_at(q), 0xFE00FE00FE00FE00ull);
        *sign = sign_bits(ksigns4(_pdep_u32(signs, 0x7F7F7F7Fu)));
        *scale = lane_scales(blk[66 + ib], 0, 4, 15);
        return;
    }
    case IQ2_S: { /* qs[32], signs[32], qh[8], scales[8] */
        const __m128i idx = _mm_or_si128(bytes4_epi32(blk + 2 + 4 * ib), high_bits(blk[66 + ib], _mm_setr_epi32(0, 2, 4, 6), 3));
        *size = grid8_gather(iq2s_grid, idx);
        *sign = sign_bits(u32_at(blk + 34 + 4 * ib));
        *scale = lane_scales(blk[74 + ib], 0, 4, 15);
        return;
    }
    case IQ1_S: { /* qs[32], per 32 a u16: 3 high bits per 8, scale, delta sign */
        const uint32_t h = (uint32_t)(blk[34 + 2 * ib] | blk[35 + 2 * ib] << 8);
        const __m128i idx = _mm_or_si128(bytes4_epi32(blk + 2 + 4 * ib), high_bits(h, _mm_setr_epi32(0, 3, 6, 9), 7));
        iq1_values(grid8_gather((const uint8_t *)iq1s_grid, idx), _mm256_set1_epi64x(iq1_delta8(h >> 15)), size, sign);
        *scale = _mm256_set1_epi16((short)(2 * (h >> 12 & 7) + 1));
        return;
    }
    default: { /* IQ1_M: qs[32], qh[16] (per 8: 3 high index bits, delta sign), u16 scales[4] */
        const uint32_t h = (uint32_t)(blk[32 + 2 * ib] | blk[33 + 2 * ib] << 8);
        const __m128i idx = _mm_or_si128(bytes4_epi32(blk + 4 * ib), high_bits(h, _mm_setr_epi32(0, 4, 8, 12), 7));
        /* a byte of all ones per 8 weights whose delta is negative: -1 in all 8 of them */
        const uint32_t minus = _pdep_u32(_pext_u32(h, 0x8888u), 0x01010101u) * 0xFF;
        const __m256i deltas = sign_bits(minus);
        iq1_values(grid8_gather((const uint8_t *)iq1s_grid, idx), deltas, size, sign);
        const uint32_t s = (uint32_t)(blk[48 + 2 * (ib / 2)] | blk[49 + 2 * (ib / 2)] << 8);
        *scale = lane_scales(s, 6 * (ib % 2), 3, 7);
        return;
    }
    }
}

/* IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S and IQ1_M in ORDER_Q8_K as rows_q8k_grid takes them,
 * each 32 weights decoded by grid_group and taken against the activations at once. */
ALWAYS_INLINE void rows_q8k_grid_groups(const uint8_t *w, int64_t stride, int64_t r0, int64_t r1,
                                        const act_t *a, int64_t i0, const int m, float *y,
                                        int64_t ldy, const float *bias, const int type) {
    const int64_t nb = a->n / 256, bytes = iq_grid_bytes(type);
    const uint8_t *end = w + r1 * stride;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * stride;
        __m256 acc[MAX_M];
        for (int i = 0; i < m; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + bytes * b;
            if (blk + PREFETCH + bytes <= end)
                for (int l = 0; l < bytes + 63; l += 64)
                    _mm_prefetch((const char *)blk + PREFETCH + l, _MM_HINT_T0);
            __m256i sum[MAX_M];
            for (int i = 0; i < m; i++) sum[i] = _mm256_setzero_si256();
            for (int ib = 0; ib < 8; ib++) {
                __m256i size, sign, scale;
                grid_group(type, blk, ib, &size, &sign, &scale);
                for (int i = 0; i < m; i++) {
                    const int8_t *xq = a->q + (i0 + i) * a->q_step + 256 * b + 32 * ib;
                    const __m256i x = _mm256_sign_epi8(load256(xq), sign);
                    sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(_mm256_maddubs_epi16(size, x), scale));
                }
            }
            const float d = grid_d(type, blk);
            for (int i = 0; i < m; i++) {
                const float dx = a->d[(i0 + i) * a->d_step + b];
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[i]), _mm256_set1_ps(d * dx), acc[i]);
            }
        }
        for (int i = 0; i < m; i++) y[i * ldy + r] = reduce_256(acc[i]) + (bias ? bias[r] : 0.0f);
    }
}

/* The i-quants on grids in ORDER_Q8_K, a block's values and scales as q8.h decodes them:
 * each 32 values' sizes against the activation quants with the values' signs in
 * vpmaddubsw, the pair sums times their 16 values' scale (one per 128-bit half) in
 * vpmaddwd, so a block's sum is one integer vector, times d * factor * d_x. */
ALWAYS_INLINE void rows_q8k_grid(const uint8_t *w, int64_t stride, int64_t r0, int64_t r1,
                                 const act_t *a, int64_t i0, const int m, float *y,
                                 int64_t ldy, const float *bias, const int type) {
    const int64_t nb = a->n / 256, bytes = iq_grid_bytes(type);
    const uint8_t *end = w + r1 * stride;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * stride;
        __m256 acc[MAX_M];
        for (int i = 0; i < m; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + bytes * b;
            if (blk + PREFETCH + bytes <= end)
                for (int l = 0; l < bytes + 63; l += 64)
                    _mm_prefetch((const char *)blk + PREFETCH + l, _MM_HINT_T0);
            __m256i size[8], sign[8], scale[8];
            int16_t sc[16];
            const float d = iq_grid_block(type, blk, size, sign, sc);
            for (int k = 0; k < 8; k++)
                scale[k] = _mm256_set_m128i(_mm_set1_epi16(sc[2 * k + 1]), _mm_set1_epi16(sc[2 * k]));
            for (int i = 0; i < m; i++) {
                const int8_t *xq = a->q + (i0 + i) * a->q_step + 256 * b;
                __m256i sum = _mm256_setzero_si256();
                for (int k = 0; k < 8; k++) {
                    const __m256i x = _mm256_sign_epi8(load256(xq + 32 * k), sign[k]);
                    sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(size[k], x), scale[k]));
                }
                const float dx = a->d[(i0 + i) * a->d_step + b];
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(d * dx), acc[i]);
            }
        }
        for (int i = 0; i < m; i++) y[i * ldy + r] = reduce_256(acc[i]) + (bias ? bias[r] : 0.0f);
    }
}

DEFINE_Q8_MATVEC(IQ2_XXS, ORDER_Q8_K, 0, rows_q8k_grid_groups, IQ2_XXS)
DEFINE_Q8_MATVEC(IQ2_XS, ORDER_Q8_K, 0, rows_q8k_grid_groups, IQ2_XS)
DEFINE_Q8_MATVEC(IQ2_S, ORDER_Q8_K, 0, rows_q8k_grid_groups, IQ2_S)
DEFINE_Q8_MATVEC(IQ3_XXS, ORDER_Q8_K, 0, rows_q8k_grid, IQ3_XXS)
DEFINE_Q8_MATVEC(IQ3_S, ORDER_Q8_K, 0, rows_q8k_grid, IQ3_S)
DEFINE_Q8_MATVEC(IQ1_S, ORDER_Q8_K, 0, rows_q8k_grid_groups, IQ1_S)
DEFINE_Q8_MATVEC(IQ1_M, ORDER_Q8_K, 0, rows_q8k_grid_groups, IQ1_M)

/* ---- A prompt's rows: q8.h's GEMM on tiles of 16 weight rows (two vectors of outputs).
 * A 32-byte load of the tile holds 4 quants of each of 8 rows; against 4 quants of an
 * activation row (broadcast), vpmaddubsw gives each row's two pair sums in 16 bits.
 * Those add up in 16 bits over `group` loads before vpmaddwd widens them: a group
 * never saturates (at most 2 * group * max u8 * 127: Q4_0/Q4_K's 15 over 8 loads,
 * Q5's 31 and MXFP4's 24 over 4, Q6_K's 63 over 2), and Q8_0, the i-quants and the
 * ternary types take |w| against x with w's sign, one load at a time (2 * 128 * 127).
 * Three activation rows share each load of the tile. ---- */
#define TILE 16 /* weight rows a tile holds */
#define GEMM_MR 3 /* activation rows a pass takes (with four, accumulators spill) */

/* The tile against activation rows i0 .. i0 + mr - 1, into y[i, r0 + j] for j < nr. */
ALWAYS_INLINE void gemm_pass(const uint8_t *q, const float *a, const float *c, const prompt_t *x,
                             int64_t i0, const int mr, float *y, int64_t ldy, int64_t r0,
                             int64_t nr, const float *bias, const int group, const int split,
                             const int sign) {
    const int64_t nb = x->nb;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[GEMM_MR][2];
    for (int i = 0; i < mr; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i s[GEMM_MR][2][2];
        for (int h = 0; h < 1 + split; h++) {
            for (int i = 0; i < mr; i++) s[i][0][h] = s[i][1][h] = _mm256_setzero_si256();
            for (int g0 = split ? 4 * h : 0; g0 < (split ? 4 * h + 4 : 8); g0 += group) {
                __m256i p[GEMM_MR][2];
                for (int i = 0; i < mr; i++) p[i][0] = p[i][1] = _mm256_setzero_si256();
                /* by two: rolled, gcc copies each sum to another register per load (1.2x
                 * slower); wholly unrolled, it spills the products to reorder the adds */
#pragma GCC unroll 2
                for (int g = g0; g < g0 + group; g++) {
                    const uint8_t *wq = q + (b * 8 + g) * TILE * 4;
                    const __m256i w0 = load256(wq), w1 = load256(wq + 32);
                    const __m256i u0 = sign ? _mm256_abs_epi8(w0) : w0;
                    const __m256i u1 = sign ? _mm256_abs_epi8(w1) : w1;
                    for (int i = 0; i < mr; i++) {
                        int32_t four;
                        memcpy(&four, x->q + (i0 + i) * x->n + 32 * b + 4 * g, 4);
                        const __m256i xv = _mm256_set1_epi32(four);
                        const __m256i x0 = sign ? _mm256_sign_epi8(xv, w0) : xv;
                        const __m256i x1 = sign ? _mm256_sign_epi8(xv, w1) : xv;
                        p[i][0] = _mm256_add_epi16(p[i][0], _mm256_maddubs_epi16(u0, x0));
                        p[i][1] = _mm256_add_epi16(p[i][1], _mm256_maddubs_epi16(u1, x1));
                    }
                }
                for (int i = 0; i < mr; i++)
                    for (int v = 0; v < 2; v++)
                        s[i][v][h] = _mm256_add_epi32(s[i][v][h], _mm256_madd_epi16(p[i][v], ones));
            }
        }
        for (int v = 0; v < 2; v++) {
            const __m256 a0 = _mm256_loadu_ps(a + (2 * b) * TILE + 8 * v);
            const __m256 c0 = _mm256_loadu_ps(c + (2 * b) * TILE + 8 * v);
            for (int i = 0; i < mr; i++) {
                const int64_t at = (i0 + i) * nb + b;
                const __m256 dx = _mm256_set1_ps(x->d[at]);
                if (split) {
                    const __m256 a1 = _mm256_loadu_ps(a + (2 * b + 1) * TILE + 8 * v);
                    const __m256 c1 = _mm256_loadu_ps(c + (2 * b + 1) * TILE + 8 * v);
                    acc[i][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i][v][0]), _mm256_mul_ps(a0, dx), acc[i][v]);
                    acc[i][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i][v][1]), _mm256_mul_ps(a1, dx), acc[i][v]);
                    acc[i][v] = _mm256_fmadd_ps(c0, _mm256_set1_ps(x->s2[2 * at]), acc[i][v]);
                    acc[i][v] = _mm256_fmadd_ps(c1, _mm256_set1_ps(x->s2[2 * at + 1]), acc[i][v]);
                } else {
                    acc[i][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i][v][0]), _mm256_mul_ps(a0, dx), acc[i][v]);
                    acc[i][v] = _mm256_fmadd_ps(c0, _mm256_set1_ps(x->s[at]), acc[i][v]);
                }
            }
        }
    }
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < 2; v++) {
            const int64_t left = nr - 8 * v;
            if (left <= 0) continue;
            const __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32(left >= 8 ? 8 : (int)left), lane);
            __m256 out = acc[i][v];
            if (bias) out = _mm256_add_ps(out, _mm256_maskload_ps(bias + r0 + 8 * v, k));
            _mm256_maskstore_ps(y + (i0 + i) * ldy + r0 + 8 * v, k, out);
        }
}

#define GEMM_ROWS(GROUP, SPLIT, SIGN)                                                    \
    do {                                                                                 \
        int64_t i0 = 0;                                                                  \
        for (; i0 + GEMM_MR <= x->m; i0 += GEMM_MR)                                      \
            gemm_pass(q, a, c, x, i0, GEMM_MR, y, ldy, r0, nr, bias, GROUP, SPLIT, SIGN); \
        for (; i0 < x->m; i0++) gemm_pass(q, a, c, x, i0, 1, y, ldy, r0, nr, bias, GROUP, SPLIT, SIGN); \
    } while (0)

/* Every activation row against one tile (q8.h's gemm_tile_fn), with the type's group. */
static void gemm_tile(int type, const uint8_t *q, const float *a, const float *c, const prompt_t *x,
                      float *y, int64_t ldy, int64_t r0, int64_t nr, const float *bias) {
    switch (type) {
    case Q4_0: case Q4_0_PACKED: case Q4_K: GEMM_ROWS(8, 0, 0); break;
    case Q6_K: GEMM_ROWS(2, 1, 0); break;
    case Q8_0: case Q8_0_PACKED: case IQ4_NL: case IQ4_XS: case IQ2_XXS: case IQ3_XXS: case IQ3_S:
    case IQ1_S: case TQ1_0: case TQ2_0:
        GEMM_ROWS(1, 0, 1);
        break;
    case IQ2_XS: case IQ2_S: case IQ1_M: GEMM_ROWS(1, 1, 1); break; /* a scale per 16 */
    default: GEMM_ROWS(4, 0, 0); break; /* Q5_0, Q5_K, MXFP4 */
    }
}

/* y [m, rows] = x [m, n] W^T (+ bias) with x quantized to Q8_0 (Q8_K) rows: 0, or -1 for a type
 * the tiles cannot take (or memory running out); the caller then takes the matvec. */
int llmrun_gemm_q8(int type, const uint8_t *w, int64_t stride, int64_t rows, const float *x,
                   int64_t m, int64_t n, float *y, const float *bias) {
    return q8_gemm(type, w, stride, rows, x, m, n, y, bias, TILE, 1, gemm_tile);
}

DEFINE_Q8_API()

#endif
