/* 8-bit-activation matvecs, AVX2 (q8.h says what they compute). 32 bytes of u8 weights
 * meet 32 activation quants in vpmaddubsw (u8 x s8 pairs to s16) and vpmaddwd (pairs
 * to s32); each dword lane of the sum holds one block's, so its float, times the
 * lane's weight scale and activation scale, goes into a float accumulator. The 16-bit
 * pair sums never saturate: packed Q4_0/Q5_0 add two of them, at most 2 * 2 * 31 *
 * 127; Q8_0 takes |w| against x with w's sign (at most 2 * 128 * 127), as llama.cpp
 * does.
 */
#include "common.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include "q8.h"

#define Q8_TYPES(X) X(Q4_0_PACKED, 128) X(Q5_0_PACKED, 128) X(Q8_0_PACKED, 32)

ALWAYS_INLINE __m256i load256(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* 0x10 in byte k where bit k of bits is set */
ALWAYS_INLINE __m256i bit4_bytes(uint32_t bits) {
    const __m256i select = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                              0x0303030303030303LL);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i b = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), select), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(b, bit), _mm256_set1_epi8(16));
}

/* Packed Q4_0 (five 0) and Q5_0 (five 1), the kernels' layout (scales, high-bit words,
 * 16-byte quants per block), four blocks at a time as two 32-byte loads: the low
 * nibbles of the pair hold their weights 0..15, the high nibbles 16..31, in
 * ORDER_QUADS (q8.h); the weights' offset (8 or 16) is in the lanes' start. */
ALWAYS_INLINE void rows_q8_packed(const uint8_t *w, int64_t stride, int64_t r0, int64_t r1,
                                  const act_t *a, int64_t i0, const int m, float *y,
                                  int64_t ldy, const float *bias, const int five) {
    const int64_t n = a->n, nb = n / 32, ng = nb / 4;
    const __m256i pair01 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const __m256i pair23 = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
    const __m256i nibble = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const uint8_t *end = w + r1 * stride;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * stride, *qh = row + 2 * nb;
        const uint8_t *qs = row + (five ? 6 : 2) * nb;
        __m256 acc[MAX_M];
        for (int i = 0; i < m; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t g = 0; g < ng; g++) {
            if (qs + 64 * g + PREFETCH + 64 <= end)
                _mm_prefetch((const char *)qs + 64 * g + PREFETCH, _MM_HINT_T0);
            __m256i lo[2], hi[2];
            for (int h = 0; h < 2; h++) {
                const __m256i v = load256(qs + 64 * g + 32 * h);
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
                    const __m256i pairs =
                        _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], load256(xq + 32 * h)),
                                         _mm256_maddubs_epi16(hi[h], load256(xq + 64 + 32 * h)));
                    const __m256i sum = _mm256_add_epi32(load256(a->lane + l + 8 * h),
                                                         _mm256_madd_epi16(pairs, ones));
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

DEFINE_Q8_MATVEC(Q4_0_PACKED, ORDER_QUADS, 8, rows_q8_packed, 0)
DEFINE_Q8_MATVEC(Q5_0_PACKED, ORDER_QUADS, 16, rows_q8_packed, 1)

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
            if (qs + 32 * b0 + PREFETCH + 256 <= end)
                for (int k = 0; k < 256; k += 64)
                    _mm_prefetch((const char *)qs + 32 * b0 + PREFETCH + k, _MM_HINT_T0);
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

DEFINE_Q8_API()

#endif
