/* 8-bit-activation matvecs, AVX-512 (q8.h says what they compute). Each 64 bytes of
 * u8 weights meet 64 activation quants in one vpdpbusd (VNNI), or, without VNNI, in
 * vpmaddubsw and vpmaddwd (whose 16-bit pair sums do not saturate for the u8 values
 * used here, at most 63 * 127 * 2: Q8_0 then takes |w| and x with w's sign instead of
 * w + 128). Each dword lane of an integer sum holds one block's, so its float, times
 * the lane's weight scale and activation scale, goes into a float accumulator.
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

#define Q8_TYPES(X) X(Q4_0_PACKED, 128) X(Q5_0_PACKED, 128) X(Q8_0, 32)

ALWAYS_INLINE __m512i load512(const void *p) { return _mm512_loadu_si512(p); }

ALWAYS_INLINE float f16_value(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* Packed Q4_0 (five 0) and Q5_0 (five 1), kernels_avx512.c's layout: a row's f16
 * scales, (Q5_0) its u32 high-bit words, then its blocks' 16-byte quants. A 64-byte
 * load holds four blocks: its low nibbles their weights 0..15, its high nibbles
 * 16..31 (ORDER_QUADS), and the weights' offset (8 or 16) is in the lanes' start. */
ALWAYS_INLINE void rows_q8_packed(const uint8_t *w, int64_t stride, int64_t r0, int64_t r1,
                                  const act_t *a, int64_t i0, const int m, float *y,
                                  int64_t ldy, const float *bias, const int five) {
    const int64_t n = a->n, nb = n / 32, ng = nb / 4;
    const __m512i quad = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i nibble = _mm512_set1_epi8(15), bit4 = _mm512_set1_epi8(16);
    const uint8_t *end = w + r1 * stride;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * stride, *qh = row + 2 * nb;
        const uint8_t *qs = row + (five ? 6 : 2) * nb;
        __m512 acc[MAX_M];
        for (int i = 0; i < m; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t g = 0; g < ng; g++) {
            if (qs + 64 * g + PREFETCH + 64 <= end)
                _mm_prefetch((const char *)qs + 64 * g + PREFETCH, _MM_HINT_T0);
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

DEFINE_Q8_MATVEC(Q4_0_PACKED, ORDER_QUADS, 8, rows_q8_packed, 0)
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

DEFINE_Q8_API()

#endif
