/* GGML-quantized matrix x few-vectors products and row dequantization, AVX-512.
 *
 * Weights stay in GGML's block layout (or, for Q4_0, Q5_0, Q4_K and Q5_K, the packed
 * layouts near the end). Each block is dequantized in registers to exactly the
 * f32 values gguf's reference dequantizer gives (same operations in the same order;
 * built with -ffp-contract=off so no multiply-add gets fused), then multiplied into
 * f32 accumulators; the Q4_0 and Q5_0 packed kernels apply each block's scale to
 * its partial sums, which is the same product since d*(q-8) is exact in f32. A
 * product therefore differs from x @ dequantize(W).T only by the order of the sums.
 *
 * Built at first use by llmrun/native/build.py and loaded with ctypes; on a CPU
 * without AVX-512 this file compiles to llmrun_available() == 0 and llmrun uses
 * its torch code instead. common.h holds what it shares with kernels_avx2.c.
 * Block layouts: https://github.com/ggml-org/llama.cpp/blob/master/ggml/src/ggml-common.h
 */
#include "common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__) && defined(__F16C__)
#include <immintrin.h>

#define QK_K 256

/* The types with kernels here: all of common.h's, in GGML's layout and packed, and the
 * i-quants (iquants.h). */
#define EXPERT_TYPES(X, A) GGML_TYPES(X, A) IQ_TYPES(X, A)
#define TYPE_READY(type) iq_ready(type)
#define KERNEL_TYPES(X, A)                                                               \
    EXPERT_TYPES(X, A) X(Q4_0_PACKED, A) X(Q5_0_PACKED, A) X(Q4_K_PACKED, A) X(Q5_K_PACKED, A)

static const float IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                     1,    13,   25,  38,  53,  69,  89,  113};

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline __m512 bcast_f16(const uint8_t *p) { return _mm512_set1_ps(f16_at(p)); }

/* 16 bytes -> 16 dword lanes, zero-extended */
static inline __m512i spread(const uint8_t *p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}

static inline __m512i iota16i(void) {
    return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

static inline __m512 iota16(void) {
    return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

/* table[k] = scale * (k + offset) for k < 16 */
static inline __m512 table(__m512 scale, float offset) {
    return _mm512_mul_ps(scale, _mm512_add_ps(iota16(), _mm512_set1_ps(offset)));
}

/* Each dequantizer writes the block's weights to out, 16 at a time through EMIT,
 * so a product can consume them from registers. */

#define F32_BLOCK 16
#define F32_BYTES 64
#define F32_DEQ(src, EMIT) EMIT(0, _mm512_loadu_ps((const float *)(src)))

#define F16_BLOCK 16
#define F16_BYTES 32
#define F16_DEQ(src, EMIT) EMIT(0, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src))))

#define BF16_BLOCK 16
#define BF16_BYTES 32
#define BF16_DEQ(src, EMIT)                                                              \
    EMIT(0, _mm512_castsi512_ps(_mm512_slli_epi32(                                       \
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src))), 16)))

#define Q8_0_BLOCK 32
#define Q8_0_BYTES 34
#define Q8_0_DEQ(src, EMIT)                                                              \
    do {                                                                                 \
        __m512 d_ = bcast_f16(src);                                                          \
        for (int h_ = 0; h_ < 2; h_++) {                                                 \
            __m128i q_ = _mm_loadu_si128((const __m128i *)((src) + 2 + 16 * h_));        \
            EMIT(16 * h_, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q_)), d_)); \
        }                                                                                \
    } while (0)

/* Low nibbles are weights 0..15, high nibbles 16..31; vpermps reads only the low
 * 4 bits of each index lane, so the low nibble needs no mask. */
#define NIBBLES(qs, t, EMIT, base)                                                       \
    do {                                                                                 \
        __m512i v_ = spread(qs);                                                         \
        EMIT((base), _mm512_permutexvar_ps(v_, t));                                      \
        EMIT((base) + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(v_, 4), t));          \
    } while (0)

#define Q4_0_BLOCK 32
#define Q4_0_BYTES 18
#define Q4_0_DEQ(src, EMIT)                                                              \
    do {                                                                                 \
        __m512 t4_ = table(bcast_f16(src), -8.0f);                                              \
        NIBBLES((src) + 2, t4_, EMIT, 0);                                                \
    } while (0)

#define Q4_1_BLOCK 32
#define Q4_1_BYTES 20
#define Q4_1_DEQ(src, EMIT)                                                              \
    do {                                                                                 \
        __m512 t4_ = _mm512_add_ps(_mm512_mul_ps(bcast_f16(src), iota16()), bcast_f16((src) + 2)); \
        NIBBLES((src) + 4, t4_, EMIT, 0);                                                \
    } while (0)

#define IQ4_NL_BLOCK 32
#define IQ4_NL_BYTES 18
#define IQ4_NL_DEQ(src, EMIT)                                                            \
    do {                                                                                 \
        __m512 t4_ = _mm512_mul_ps(bcast_f16(src), _mm512_loadu_ps(IQ4_VALUES));             \
        NIBBLES((src) + 2, t4_, EMIT, 0);                                                \
    } while (0)

/* 5-bit weights: bit 4 of weight j is bit j of the little-endian u32 qh. The
 * 32-entry table spans two registers; vpermt2ps picks by index bit 4, which a
 * per-lane rotate of qh supplies (bit j of lane j lands on bit 4). */
#define Q5_EMIT(qs, qh_ptr, lo, hi, EMIT)                                                \
    do {                                                                                 \
        const __m512i v_ = spread(qs), h_ = _mm512_set1_epi32((int)u32_at(qh_ptr));     \
        const __m512i rot0_ = _mm512_setr_epi32(4, 3, 2, 1, 0, 31, 30, 29, 28, 27, 26, 25, \
                                                24, 23, 22, 21);                         \
        const __m512i rot1_ = _mm512_setr_epi32(20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, \
                                                9, 8, 7, 6, 5);                          \
        const __m512i m_ = _mm512_set1_epi32(15);                                        \
        const __m512i i0_ = _mm512_ternarylogic_epi32(v_, _mm512_rolv_epi32(h_, rot0_), m_, 0xE4); \
        const __m512i i1_ = _mm512_ternarylogic_epi32(_mm512_srli_epi32(v_, 4),         \
                                                      _mm512_rolv_epi32(h_, rot1_), m_, 0xE4); \
        EMIT(0, _mm512_permutex2var_ps(lo, i0_, hi));                                    \
        EMIT(16, _mm512_permutex2var_ps(lo, i1_, hi));                                   \
    } while (0)

#define Q5_0_BLOCK 32
#define Q5_0_BYTES 22
#define Q5_0_DEQ(src, EMIT)                                                              \
    do {                                                                                 \
        __m512 d_ = bcast_f16(src);                                                          \
        __m512 lo_ = table(d_, -16.0f), hi_ = table(d_, 0.0f);                           \
        Q5_EMIT((src) + 6, (src) + 2, lo_, hi_, EMIT);                           \
    } while (0)

#define Q5_1_BLOCK 32
#define Q5_1_BYTES 24
#define Q5_1_DEQ(src, EMIT)                                                              \
    do {                                                                                 \
        __m512 d_ = bcast_f16(src), m_ = bcast_f16((src) + 2);                           \
        __m512 lo_ = _mm512_add_ps(_mm512_mul_ps(d_, iota16()), m_);                     \
        __m512 hi_ = _mm512_add_ps(table(d_, 16.0f), m_);                                \
        Q5_EMIT((src) + 8, (src) + 4, lo_, hi_, EMIT);                           \
    } while (0)

/* Q4_K/Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins packed in 12 bytes;
 * w = (d*sc)*q - dmin*m. From the f16 d and dmin and the 12 scale bytes, writes
 * ab = [d*sc[0..7], dmin*m[0..7]]. */
static inline void k_scales(const uint8_t *d16, const uint8_t *dmin16, const uint8_t *scales,
                            float *ab) {
    uint32_t u[3];
    memcpy(u, scales, 12);
    const uint32_t packed[4] = {
        u[0] & 0x3f3f3f3f,
        (u[2] & 0x0f0f0f0f) | ((u[0] >> 2) & 0x30303030),
        u[1] & 0x3f3f3f3f,
        ((u[2] >> 4) & 0x0f0f0f0f) | ((u[1] >> 2) & 0x30303030),
    };
    const __m512 v = _mm512_cvtepi32_ps(spread((const uint8_t *)packed));
    const __m512 d = _mm512_mask_blend_ps(0xFF00, bcast_f16(d16), bcast_f16(dmin16));
    _mm512_storeu_ps(ab, _mm512_mul_ps(d, v));
    /* Re-read from memory: broadcasting a loaded float costs no shuffle (vpermd). */
    __asm__ volatile("" ::: "memory");
}

static inline __m512 k_table(const float *ab, int j, __m512 q) {
    return _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(ab[j]), q), _mm512_set1_ps(ab[8 + j]));
}

/* Sub-blocks 2p and 2p+1 share qs[32p..32p+31]: low nibbles, then high. */
#define Q4_K_BLOCK 256
#define Q4_K_BYTES 144
#define Q4_K_DEQ(src, EMIT)                                                              \
    do {                                                                                 \
        float ab_[16];                                                                   \
        k_scales(src, (src) + 2, (src) + 4, ab_);                                        \
        for (int p_ = 0; p_ < 4; p_++) {                                                 \
            const __m512i v0_ = spread((src) + 16 + 32 * p_);                            \
            const __m512i v1_ = spread((src) + 32 + 32 * p_);                            \
            const __m512 t0_ = k_table(ab_, 2 * p_, iota16());                           \
            const __m512 t1_ = k_table(ab_, 2 * p_ + 1, iota16());                       \
            EMIT(64 * p_, _mm512_permutexvar_ps(v0_, t0_));                              \
            EMIT(64 * p_ + 16, _mm512_permutexvar_ps(v1_, t0_));                         \
            EMIT(64 * p_ + 32, _mm512_permutexvar_ps(_mm512_srli_epi32(v0_, 4), t1_));   \
            EMIT(64 * p_ + 48, _mm512_permutexvar_ps(_mm512_srli_epi32(v1_, 4), t1_));   \
        }                                                                                \
    } while (0)

#define Q5_K_BLOCK 256
#define Q5_K_BYTES 176
#define Q5_K_DEQ(src, EMIT)                                                              \
    do {                                                                                 \
        float ab_[16];                                                                   \
        k_scales(src, (src) + 2, (src) + 4, ab_);                                        \
        const __m512i h0_ = spread((src) + 16), h1_ = spread((src) + 32);                \
        for (int j_ = 0; j_ < 8; j_++) {                                                 \
            const uint8_t *qs_ = (src) + 48 + 32 * (j_ / 2);                             \
            const __m512 lo_ = k_table(ab_, j_, iota16());                               \
            const __m512 hi_ = k_table(ab_, j_, _mm512_add_ps(iota16(), _mm512_set1_ps(16))); \
            for (int h_ = 0; h_ < 2; h_++) {                                             \
                __m512i v_ = _mm512_srli_epi32(spread(qs_ + 16 * h_), 4 * (j_ & 1));     \
                __m512i hb_ = h_ ? h1_ : h0_;                                            \
                /* index bits 3:0 from the nibble, bit 4 from bit j of the qh byte */    \
                __m512i hs_ = j_ <= 4 ? _mm512_slli_epi32(hb_, 4 - j_)                   \
                                      : _mm512_srli_epi32(hb_, j_ - 4);                  \
                __m512i idx_ = _mm512_ternarylogic_epi32(v_, hs_, _mm512_set1_epi32(15), 0xE4); \
                EMIT(32 * j_ + 16 * h_, _mm512_permutex2var_ps(lo_, idx_, hi_));         \
            }                                                                            \
        }                                                                                \
    } while (0)

/* Q6_K: w = (d*sc) * (q - 32), q = 4 bits from ql | 2 bits from qh << 4; sixteen
 * int8 scales, one per 16 weights. Weight c*128 + t*32 + l takes the (t/2)
 * nibble of ql[64c + 32(t%2) + l] and bits 2t..2t+1 of qh[32c + l]; the six-bit
 * values are assembled 64 at a time in bytes. */
#define Q6_K_BLOCK 256
#define Q6_K_BYTES 210
#define Q6_K_DEQ(src, EMIT)                                                              \
    do {                                                                                 \
        float dl_[16];                                                                   \
        int8_t q_[256] __attribute__((aligned(64)));                                     \
        const __m512i sc_ = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((src) + 192))); \
        _mm512_storeu_ps(dl_, _mm512_mul_ps(bcast_f16((src) + 208), _mm512_cvtepi32_ps(sc_))); \
        __asm__ volatile("" ::: "memory"); /* broadcast dl_ from memory, as k_scales */  \
        const __m512i lo4_ = _mm512_set1_epi8(15), six_ = _mm512_set1_epi8(63);         \
        const __m512i shifts_ = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1); \
        for (int c_ = 0; c_ < 2; c_++) {                                                 \
            const __m512i l_ = _mm512_loadu_si512((src) + 64 * c_);                      \
            const __m512i h_ = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)((src) + 128 + 32 * c_))); \
            for (int u_ = 0; u_ < 2; u_++) {                                             \
                /* t = 2u (first 32 bytes) and t = 2u+1 (last 32): qh shifted by 2t */   \
                const __m512i hs_ =                                                      \
                    _mm512_srlv_epi16(h_, _mm512_add_epi16(shifts_, _mm512_set1_epi16(4 * u_))); \
                const __m512i lq_ = u_ ? _mm512_srli_epi16(l_, 4) : l_;                  \
                __m512i q6_ = _mm512_ternarylogic_epi32(lq_, _mm512_slli_epi16(hs_, 4), lo4_, 0xE4); \
                q6_ = _mm512_sub_epi8(_mm512_and_si512(q6_, six_), _mm512_set1_epi8(32)); \
                _mm512_store_si512(q_ + 128 * c_ + 64 * u_, q6_);                       \
            }                                                                            \
        }                                                                                \
        for (int k_ = 0; k_ < 16; k_++) {                                                \
            const __m512i qi_ = _mm512_cvtepi8_epi32(_mm_load_si128((const __m128i *)(q_ + 16 * k_))); \
            EMIT(16 * k_, _mm512_mul_ps(_mm512_set1_ps(dl_[k_]), _mm512_cvtepi32_ps(qi_))); \
        }                                                                                \
    } while (0)

/* Q2_K: w = d*(sc&15) * q - dmin*(sc>>4), q 2 bits; weight c*128 + s*32 + l takes
 * bits 2s..2s+1 of qs[32c + l]; one scale byte per 16 weights. */
#define Q2_K_BLOCK 256
#define Q2_K_BYTES 84
#define Q2_K_DEQ(src, EMIT)                                                              \
    do {                                                                                 \
        float dm_[32]; /* d*(sc&15) for the 16 sub-blocks, then dmin*(sc>>4) */         \
        const __m512i sc_ = spread(src);                                                 \
        _mm512_storeu_ps(dm_, _mm512_mul_ps(bcast_f16((src) + 80),                       \
            _mm512_cvtepi32_ps(_mm512_and_si512(sc_, _mm512_set1_epi32(15)))));          \
        _mm512_storeu_ps(dm_ + 16, _mm512_mul_ps(bcast_f16((src) + 82),                  \
            _mm512_cvtepi32_ps(_mm512_srli_epi32(sc_, 4))));                             \
        __asm__ volatile("" ::: "memory"); /* broadcast dm_ from memory, as k_scales */  \
        for (int c_ = 0; c_ < 2; c_++)                                                   \
            for (int s_ = 0; s_ < 4; s_++)                                               \
                for (int h_ = 0; h_ < 2; h_++) {                                         \
                    const int i_ = c_ * 128 + s_ * 32 + 16 * h_;                         \
                    __m512 t_ = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(dm_[i_ / 16]), iota16()), \
                                              _mm512_set1_ps(dm_[16 + i_ / 16]));        \
                    __m512i q_ = _mm512_and_si512(_mm512_srli_epi32(spread((src) + 16 + 32 * c_ + 16 * h_), 2 * s_), \
                                                  _mm512_set1_epi32(3));                 \
                    EMIT(i_, _mm512_permutexvar_ps(q_, t_));                             \
                }                                                                        \
    } while (0)

/* Q3_K: w = d*(sc-32) * (k-4) with k = 2 low bits | hmask bit << 2; weight
 * c*128 + s*32 + l takes bits 2s.. of qs[32c + l] and bit 4c+s of hmask[l]. */
static inline void q3_scales(const uint8_t *s, float d, float *dl) {
    int64_t low8;
    int32_t high4;
    memcpy(&low8, s, 8);
    memcpy(&high4, s + 8, 4);
    /* scale j: low nibble of s[j] (j < 8) or high nibble of s[j-8]; bits 2(j/4).. of s[8+j%4] */
    const __m512i low = _mm512_and_si512(
        _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_set1_epi64x(low8)),
                          _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4)),
        _mm512_set1_epi32(15));
    const __m512i high = _mm512_and_si512(
        _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_set1_epi32(high4)),
                          _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6)),
        _mm512_set1_epi32(3));
    const __m512i sc = _mm512_sub_epi32(_mm512_or_si512(low, _mm512_slli_epi32(high, 4)),
                                        _mm512_set1_epi32(32));
    _mm512_storeu_ps(dl, _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(sc)));
    __asm__ volatile("" ::: "memory"); /* broadcast dl from memory, as k_scales */
}

#define Q3_K_BLOCK 256
#define Q3_K_BYTES 110
#define Q3_K_DEQ(src, EMIT)                                                              \
    do {                                                                                 \
        float dl_[16];                                                                   \
        q3_scales((src) + 96, f16_at((src) + 108), dl_);                                 \
        for (int c_ = 0; c_ < 2; c_++)                                                   \
            for (int s_ = 0; s_ < 4; s_++)                                               \
                for (int h_ = 0; h_ < 2; h_++) {                                         \
                    const int i_ = c_ * 128 + s_ * 32 + 16 * h_, bit_ = 4 * c_ + s_;     \
                    __m512 t_ = table(_mm512_set1_ps(dl_[i_ / 16]), -4.0f);              \
                    __m512i lo_ = _mm512_srli_epi32(spread((src) + 32 + 32 * c_ + 16 * h_), 2 * s_); \
                    __m512i hm_ = spread((src) + 16 * h_);                               \
                    hm_ = bit_ >= 2 ? _mm512_srli_epi32(hm_, bit_ - 2) : _mm512_slli_epi32(hm_, 2 - bit_); \
                    __m512i k_ = _mm512_ternarylogic_epi32(lo_, hm_, _mm512_set1_epi32(3), 0xE4); \
                    k_ = _mm512_and_si512(k_, _mm512_set1_epi32(7));                     \
                    EMIT(i_, _mm512_permutexvar_ps(k_, t_));                             \
                }                                                                        \
    } while (0)

/* IQ4_XS: 8 sub-blocks of 32, w = d*(sc-32) * IQ4_VALUES[q], 6-bit scales split in
 * a u16 of high bits and 4 bytes of low nibbles; sub-block j reads qs[16j..16j+15]. */
#define IQ4_XS_BLOCK 256
static inline void iq4_xs_scales(const uint8_t *src, float *dl) {
    int32_t low4;
    uint16_t high;
    memcpy(&low4, src + 4, 4);
    memcpy(&high, src + 2, 2);
    const __m512i lanes = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i low = _mm512_and_si512(
        _mm512_srlv_epi32(_mm512_permutexvar_epi32(lanes, _mm512_cvtepu8_epi32(_mm_set1_epi32(low4))),
                          _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0)),
        _mm512_set1_epi32(15));
    const __m512i hi = _mm512_and_si512(
        _mm512_srlv_epi32(_mm512_set1_epi32(high),
                          _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0)),
        _mm512_set1_epi32(3));
    const __m512i sc = _mm512_sub_epi32(_mm512_or_si512(low, _mm512_slli_epi32(hi, 4)),
                                        _mm512_set1_epi32(32));
    _mm512_storeu_ps(dl, _mm512_mul_ps(bcast_f16(src), _mm512_cvtepi32_ps(sc)));
    __asm__ volatile("" ::: "memory"); /* broadcast dl from memory, as k_scales */
}
#define IQ4_XS_BYTES 136
#define IQ4_XS_DEQ(src, EMIT)                                                            \
    do {                                                                                 \
        float dl_[16];                                                                   \
        iq4_xs_scales(src, dl_);                                                         \
        const __m512 kv_ = _mm512_loadu_ps(IQ4_VALUES);                                  \
        for (int j_ = 0; j_ < 8; j_++) {                                                 \
            const __m512 t_ = _mm512_mul_ps(_mm512_set1_ps(dl_[j_]), kv_);               \
            NIBBLES((src) + 8 + 16 * j_, t_, EMIT, 32 * j_);                             \
        }                                                                                \
    } while (0)

/* The i-quants and ternary types (iquants.h, the tables; block layouts in ggml-common.h),
 * 16 weights at a time. IQ1_S to IQ3_S: two (IQ1, IQ2) or four (IQ3) grid rows widened
 * to f32 and scaled, signs flipped by a mask (IQ1: the delta added first); TQ1_0 and
 * TQ2_0: table lookups. The same operations as gguf's reference, so the same bits. */
#include "iquants.h"
static inline uint64_t u64_at(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* db * rows, with the sign bit of lane j flipped where bit j of signs is set */
static inline __m512 iq_vec(__m512 db, __m128i rows, uint32_t signs) {
    const __m512 g = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(rows));
    const __m512i w = _mm512_castps_si512(_mm512_mul_ps(db, g));
    const __m512i sign = _mm512_set1_epi32((int)0x80000000);
    return _mm512_castsi512_ps(_mm512_mask_xor_epi32(w, (__mmask16)signs, w, sign));
}

static inline __m128i rows8(const uint8_t *grid, int a, int b) {
    return _mm_set_epi64x((long long)u64_at(grid + 8 * b), (long long)u64_at(grid + 8 * a));
}

static inline __m128i rows4(const uint8_t *grid, int a, int b, int c, int d) {
    return _mm_setr_epi32((int)u32_at(grid + 4 * a), (int)u32_at(grid + 4 * b),
                          (int)u32_at(grid + 4 * c), (int)u32_at(grid + 4 * d));
}

#define IQ2_XXS_DEQ(src, EMIT)                                                           \
    do {                                                                                 \
        const float d_ = f16_at(src);                                                    \
        for (int ib_ = 0; ib_ < 8; ib_++) {                                              \
            const uint8_t *q_ = (src) + 2 + 8 * ib_;                                     \
            const uint32_t aux_ = u32_at(q_ + 4);                                        \
            const __m512 db_ = _mm512_set1_ps(d_ * (0.5f + (float)(aux_ >> 28)) * 0.25f); \
            for (int h_ = 0; h_ < 2; h_++) {                                             \
                const uint32_t s_ = ksigns[(aux_ >> (14 * h_)) & 127] |                  \
                                    (uint32_t)ksigns[(aux_ >> (14 * h_ + 7)) & 127] << 8; \
                EMIT(32 * ib_ + 16 * h_,                                                 \
                     iq_vec(db_, rows8(iq2xxs_grid, q_[2 * h_], q_[2 * h_ + 1]), s_));   \
            }                                                                            \
        }                                                                                \
    } while (0)

/* IQ2_XS: db[k] = d * (0.5f + sc) * 0.25f for the 16 4-bit scales (one per 16 weights)
 * of the 8 bytes at scales, converted together and broadcast from memory, where one
 * scalar chain per 16 weights held the vector code up (IQ2_S, measured alike either
 * way, keeps its chain). */
static inline void iq2_scales(float d, const uint8_t *scales, float *db) {
    const __m128i v = _mm_loadl_epi64((const __m128i *)scales), low4 = _mm_set1_epi8(15);
    const __m128i sc = _mm_unpacklo_epi8(_mm_and_si128(v, low4),
                                         _mm_and_si128(_mm_srli_epi16(v, 4), low4));
    const __m512 f = _mm512_add_ps(_mm512_set1_ps(0.5f), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)));
    _mm512_storeu_ps(db, _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(d), f), _mm512_set1_ps(0.25f)));
    __asm__ volatile("" ::: "memory"); /* broadcast db from memory, as k_scales */
}

#define IQ2_XS_DEQ(src, EMIT)                                                            \
    do {                                                                                 \
        float db_[16];                                                                   \
        iq2_scales(f16_at(src), (src) + 66, db_);                                        \
        for (int k_ = 0; k_ < 16; k_++) {                                                \
            const uint16_t a_ = u16_at((src) + 2 + 4 * k_), b_ = u16_at((src) + 4 + 4 * k_); \
            const uint32_t s_ = ksigns[a_ >> 9] | (uint32_t)ksigns[b_ >> 9] << 8;        \
            EMIT(16 * k_, iq_vec(_mm512_set1_ps(db_[k_]),                                \
                                 rows8(iq2xs_grid, a_ & 511, b_ & 511), s_));            \
        }                                                                                \
    } while (0)

#define IQ2_S_DEQ(src, EMIT)                                                             \
    do {                                                                                 \
        const float d_ = f16_at(src);                                                    \
        const uint8_t *qs_ = (src) + 2, *sg_ = (src) + 34, *qh_ = (src) + 66;            \
        for (int k_ = 0; k_ < 16; k_++) {                                                \
            const int e_ = 2 * k_, h_ = qh_[e_ / 4] >> (2 * (e_ % 4));                   \
            const int sc_ = ((src)[74 + k_ / 2] >> (4 * (k_ & 1))) & 15;                 \
            const __m512 db_ = _mm512_set1_ps(d_ * (0.5f + (float)sc_) * 0.25f);         \
            const __m128i g_ = rows8(iq2s_grid, qs_[e_] | (h_ & 3) << 8,                 \
                                     qs_[e_ + 1] | (h_ >> 2 & 3) << 8);                  \
            EMIT(16 * k_, iq_vec(db_, g_, u16_at(sg_ + e_)));                            \
        }                                                                                \
    } while (0)

#define IQ3_XXS_DEQ(src, EMIT)                                                           \
    do {                                                                                 \
        const float d_ = f16_at(src);                                                    \
        for (int ib_ = 0; ib_ < 8; ib_++) {                                              \
            const uint8_t *q_ = (src) + 2 + 8 * ib_;                                     \
            const uint32_t aux_ = u32_at((src) + 66 + 4 * ib_);                          \
            const __m512 db_ = _mm512_set1_ps(d_ * (0.5f + (float)(aux_ >> 28)) * 0.5f);  \
            for (int h_ = 0; h_ < 2; h_++) {                                             \
                const uint8_t *r_ = q_ + 4 * h_;                                         \
                const uint32_t s_ = ksigns[(aux_ >> (14 * h_)) & 127] |                  \
                                    (uint32_t)ksigns[(aux_ >> (14 * h_ + 7)) & 127] << 8; \
                EMIT(32 * ib_ + 16 * h_,                                                 \
                     iq_vec(db_, rows4(iq3xxs_grid, r_[0], r_[1], r_[2], r_[3]), s_));   \
            }                                                                            \
        }                                                                                \
    } while (0)

#define IQ3_S_DEQ(src, EMIT)                                                             \
    do {                                                                                 \
        const float d_ = f16_at(src);                                                    \
        const uint8_t *qs_ = (src) + 2, *qh_ = (src) + 66, *sg_ = (src) + 74;            \
        for (int ib_ = 0; ib_ < 8; ib_++) {                                              \
            const int sc_ = ((src)[106 + ib_ / 2] >> (4 * (ib_ & 1))) & 15;              \
            const __m512 db_ = _mm512_set1_ps(d_ * (float)(1 + 2 * sc_));                \
            for (int h_ = 0; h_ < 2; h_++) {                                             \
                const int e_ = 8 * ib_ + 4 * h_, hb_ = qh_[ib_] >> (4 * h_);             \
                const __m128i g_ = rows4(iq3s_grid, qs_[e_] | (hb_ & 1) << 8,            \
                                         qs_[e_ + 1] | (hb_ >> 1 & 1) << 8,              \
                                         qs_[e_ + 2] | (hb_ >> 2 & 1) << 8,              \
                                         qs_[e_ + 3] | (hb_ >> 3 & 1) << 8);             \
                EMIT(32 * ib_ + 16 * h_, iq_vec(db_, g_, u16_at(sg_ + 4 * ib_ + 2 * h_))); \
            }                                                                            \
        }                                                                                \
    } while (0)

/* dl * (rows + delta) for 16 weights of IQ1_S/IQ1_M: two int8 grid rows widened to f32 */
static inline __m512 iq1_vec(__m512 dl, int a, int b, __m512 delta) {
    const __m128i rows = rows8((const uint8_t *)iq1s_grid, a, b);
    const __m512 g = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(rows));
    return _mm512_mul_ps(dl, _mm512_add_ps(g, delta));
}

#define IQ1_S_DEQ(src, EMIT)                                                             \
    do {                                                                                 \
        const float d_ = f16_at(src);                                                    \
        for (int ib_ = 0; ib_ < 8; ib_++) {                                              \
            const uint16_t h_ = u16_at((src) + 34 + 2 * ib_);                            \
            const __m512 dl_ = _mm512_set1_ps(d_ * (float)(2 * ((h_ >> 12) & 7) + 1));  \
            /* IQ1_DELTA's bits (0.125f), negative where bit 15 is set: no branch */     \
            const __m512 delta_ = _mm512_castsi512_ps(                                   \
                _mm512_set1_epi32((int)(0x3E000000u | (uint32_t)(h_ >> 15) << 31)));     \
            const uint8_t *q_ = (src) + 2 + 4 * ib_;                                     \
            EMIT(32 * ib_, iq1_vec(dl_, q_[0] | (h_ & 7) << 8, q_[1] | (h_ >> 3 & 7) << 8, delta_)); \
            EMIT(32 * ib_ + 16,                                                          \
                 iq1_vec(dl_, q_[2] | (h_ >> 6 & 7) << 8, q_[3] | (h_ >> 9 & 7) << 8, delta_)); \
        }                                                                                \
    } while (0)

/* 16 weights (two grid rows) a step, each row's delta from its nibble's bit 3: the
 * sign bit of 0.125f flipped under a lane mask, without a branch on random bits. The
 * 16 sub-block scales d * (2s + 1) converted together, then broadcast from memory. */
#define IQ1_M_DEQ(src, EMIT)                                                             \
    do {                                                                                 \
        uint16_t sc_[4];                                                                 \
        memcpy(sc_, (src) + 48, 8);                                                      \
        const uint16_t bits_ = (uint16_t)((sc_[0] >> 12) | ((sc_[1] >> 8) & 0x00F0) |    \
                                          ((sc_[2] >> 4) & 0x0F00) | (sc_[3] & 0xF000)); \
        uint8_t d16_[2];                                                                 \
        memcpy(d16_, &bits_, 2);                                                         \
        float dl_[16] __attribute__((aligned(64)));                                      \
        const __m512i s_ = _mm512_srlv_epi32(                                            \
            _mm512_cvtepu16_epi32(_mm256_setr_epi64x(                                    \
                (long long)(0x0001000100010001ULL * sc_[0]),                             \
                (long long)(0x0001000100010001ULL * sc_[1]),                             \
                (long long)(0x0001000100010001ULL * sc_[2]),                             \
                (long long)(0x0001000100010001ULL * sc_[3]))),                           \
            _mm512_setr_epi32(0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9));          \
        const __m512i odd_ = _mm512_or_si512(                                            \
            _mm512_slli_epi32(_mm512_and_si512(s_, _mm512_set1_epi32(7)), 1),            \
            _mm512_set1_epi32(1));                                                       \
        _mm512_store_ps(dl_, _mm512_mul_ps(_mm512_set1_ps(f16_at(d16_)),                  \
                                           _mm512_cvtepi32_ps(odd_)));                   \
        __asm__ volatile("" ::: "memory"); /* broadcast dl_ from memory, as k_scales */  \
        const __m512 delta_ = _mm512_set1_ps(IQ1_DELTA);                                 \
        const __m512i sign_ = _mm512_set1_epi32((int)0x80000000);                        \
        for (int k_ = 0; k_ < 16; k_++) {                                                \
            const int qh_ = (src)[32 + k_];                                              \
            const __mmask16 neg_ = (__mmask16)((0u - (qh_ >> 3 & 1)) & 0x00FF) |        \
                                   (__mmask16)((0u - (qh_ >> 7 & 1)) & 0xFF00);          \
            const __m512 dk_ = _mm512_castsi512_ps(_mm512_mask_xor_epi32(                \
                _mm512_castps_si512(delta_), neg_, _mm512_castps_si512(delta_), sign_));  \
            EMIT(16 * k_, iq1_vec(_mm512_set1_ps(dl_[k_]), (src)[2 * k_] | (qh_ & 7) << 8, \
                                  (src)[2 * k_ + 1] | (qh_ >> 4 & 7) << 8, dk_));        \
        }                                                                                \
    } while (0)

/* Ternary weights, 16 at a time: digit indices into a table of d * (k - 1), read by
 * vpermps from the index's low 4 bits. TQ2_0's table repeats every 4 lanes, so a shift
 * alone picks a 2-bit digit. TQ1_0's digit k of byte q is the top of (q * 3^k mod 256)
 * * 3 over 8 bits, per dword lane. */
static inline __m512 tq_table(const uint8_t *d16, __m512i k) {
    return _mm512_mul_ps(bcast_f16(d16), _mm512_cvtepi32_ps(_mm512_sub_epi32(k, _mm512_set1_epi32(1))));
}

static inline __m512i tq1_digit(__m512i v, __m512i pow3) {
    const __m512i q = _mm512_and_si512(_mm512_mullo_epi32(v, pow3), _mm512_set1_epi32(255));
    return _mm512_srli_epi32(_mm512_add_epi32(q, _mm512_slli_epi32(q, 1)), 8);
}

#define TQ1_0_DEQ(src, EMIT)                                                             \
    do {                                                                                 \
        const __m512 t_ = tq_table((src) + 52, _mm512_and_si512(iota16i(), _mm512_set1_epi32(3))); \
        const __m512i v0_ = spread(src), v1_ = spread((src) + 16), v2_ = spread((src) + 32); \
        static const int pow3_[5] = {1, 3, 9, 27, 81};                                   \
        for (int p_ = 0; p_ < 5; p_++) {                                                 \
            const __m512i m_ = _mm512_set1_epi32(pow3_[p_]);                             \
            EMIT(32 * p_, _mm512_permutexvar_ps(tq1_digit(v0_, m_), t_));                \
            EMIT(32 * p_ + 16, _mm512_permutexvar_ps(tq1_digit(v1_, m_), t_));           \
            EMIT(160 + 16 * p_, _mm512_permutexvar_ps(tq1_digit(v2_, m_), t_));          \
        }                                                                                \
        const __m512i v3_ = _mm512_cvtepu8_epi32(_mm_set1_epi32((int)u32_at((src) + 48))); \
        const __m512i m3_ = _mm512_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3, 9, 9, 9, 9, 27, 27, 27, 27); \
        EMIT(240, _mm512_permutexvar_ps(tq1_digit(v3_, m3_), t_));                       \
    } while (0)

#define TQ2_0_DEQ(src, EMIT)                                                             \
    do {                                                                                 \
        const __m512 t_ = tq_table((src) + 64, _mm512_and_si512(iota16i(), _mm512_set1_epi32(3))); \
        for (int c_ = 0; c_ < 2; c_++) {                                                 \
            const __m512i v0_ = spread((src) + 32 * c_), v1_ = spread((src) + 32 * c_ + 16); \
            for (int l_ = 0; l_ < 4; l_++) {                                             \
                EMIT(128 * c_ + 32 * l_, _mm512_permutexvar_ps(_mm512_srli_epi32(v0_, 2 * l_), t_)); \
                EMIT(128 * c_ + 32 * l_ + 16,                                            \
                     _mm512_permutexvar_ps(_mm512_srli_epi32(v1_, 2 * l_), t_));          \
            }                                                                            \
        }                                                                                \
    } while (0)

/* Kernels per type. A matvec dequantizes a group of blocks (up to GROUP weights)
 * into an L1-resident buffer, then takes its dot products with up to MAX_M
 * activation rows; independent accumulators hide the multiply-add latency. */

#define GROUP 256
#define STORE_EMIT(off, val) _mm512_storeu_ps(out_ + (off), (val))

/* acc[i] += buf . x_i over len weights (a multiple of 16), for m activation rows */
ALWAYS_INLINE void dot_group(const float *buf, const float *x, int64_t n, int64_t len,
                             const int m, __m512 acc[][4]) {
    int64_t k = 0;
    for (; k + 64 <= len; k += 64) {
        const __m512 w0 = _mm512_loadu_ps(buf + k), w1 = _mm512_loadu_ps(buf + k + 16);
        const __m512 w2 = _mm512_loadu_ps(buf + k + 32), w3 = _mm512_loadu_ps(buf + k + 48);
        for (int i = 0; i < m; i++) {
            const float *xi = x + i * n + k;
            acc[i][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xi), acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xi + 16), acc[i][1]);
            acc[i][2] = _mm512_fmadd_ps(w2, _mm512_loadu_ps(xi + 32), acc[i][2]);
            acc[i][3] = _mm512_fmadd_ps(w3, _mm512_loadu_ps(xi + 48), acc[i][3]);
        }
    }
    if (k + 32 <= len) {
        const __m512 w0 = _mm512_loadu_ps(buf + k), w1 = _mm512_loadu_ps(buf + k + 16);
        for (int i = 0; i < m; i++) {
            const float *xi = x + i * n + k;
            acc[i][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xi), acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xi + 16), acc[i][1]);
        }
        k += 32;
    }
    if (k < len) { /* 16 left: float rows come in blocks of 16 */
        const __m512 w0 = _mm512_loadu_ps(buf + k);
        for (int i = 0; i < m; i++)
            acc[i][2] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + i * n + k), acc[i][2]);
    }
}

#define DEFINE_KERNELS(T)                                                                \
    ALWAYS_INLINE void rows_##T(const uint8_t *w, int64_t stride, int64_t r0, int64_t r1, \
                                const float *x, const int m, int64_t n, float *y,        \
                                int64_t ldy, const float *bias) {                        \
        enum { PER_GROUP = T##_BLOCK >= GROUP ? 1 : GROUP / T##_BLOCK };                 \
        float buf[PER_GROUP * T##_BLOCK] __attribute__((aligned(64)));                   \
        const int64_t nb = n / T##_BLOCK;                                                \
        const uint8_t *end = w + r1 * stride;                                            \
        for (int64_t r = r0; r < r1; r++) {                                              \
            const uint8_t *row = w + r * stride;                                         \
            __m512 acc[MAX_M][4];                                                        \
            for (int i = 0; i < m; i++)                                                  \
                acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = _mm512_setzero_ps();     \
            for (int64_t b0 = 0; b0 < nb; b0 += PER_GROUP) {                             \
                const int64_t g = nb - b0 < PER_GROUP ? nb - b0 : PER_GROUP;             \
                const uint8_t *gsrc = row + b0 * T##_BYTES;                              \
                if (gsrc + PREFETCH + g * T##_BYTES <= end)                              \
                    for (int64_t l = 0; l < g * T##_BYTES; l += 64)                      \
                        _mm_prefetch((const char *)gsrc + PREFETCH + l, _MM_HINT_T0);    \
                for (int64_t b = 0; b < g; b++) {                                        \
                    float *out_ = buf + b * T##_BLOCK;                                   \
                    const uint8_t *src = gsrc + b * T##_BYTES;                           \
                    T##_DEQ(src, STORE_EMIT);                                            \
                }                                                                        \
                dot_group(buf, x + b0 * T##_BLOCK, n, g * T##_BLOCK, m, acc);            \
            }                                                                            \
            for (int i = 0; i < m; i++)                                                  \
                y[i * ldy + r] = _mm512_reduce_add_ps(_mm512_add_ps(                     \
                    _mm512_add_ps(acc[i][0], acc[i][1]), _mm512_add_ps(acc[i][2], acc[i][3]))) \
                    + (bias ? bias[r] : 0.0f);                                                   \
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
            for (int64_t b = 0; b < nb; b++) {                                           \
                float *out_ = out + r * n + b * T##_BLOCK;                               \
                const uint8_t *src = w + r * stride + b * T##_BYTES;                     \
                T##_DEQ(src, STORE_EMIT);                                                \
            }                                                                            \
    }

DEFINE_KERNELS(F32)
DEFINE_KERNELS(BF16)

/* F16 in 256-bit vectors, each converted half-vector of weights straight into the
 * multiply-adds (4 chains): on Zen 4 this reads cold F16 rows ~20 % faster (24.5-30 GB/s
 * against 20-24.6, 2 threads) than the 512-bit DEFINE_KERNELS form, which is bound by
 * memory-level parallelism, not by arithmetic (warm, both run at ~40 GB/s). */
#define F16_YMM_BYTES 64 /* 32 weights: one cache line, one prefetch */
ALWAYS_INLINE void rows_F16(const uint8_t *w, int64_t stride, int64_t r0, int64_t r1,
                            const float *x, const int m, int64_t n, float *y, int64_t ldy,
                            const float *bias) {
    const uint8_t *end = w + r1 * stride;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * stride;
        __m256 acc[MAX_M][4];
        for (int i = 0; i < m; i++)
            acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 32 <= n; k += 32) {
            const uint8_t *src = row + 2 * k;
            if (src + PREFETCH + F16_YMM_BYTES <= end)
                _mm_prefetch((const char *)src + PREFETCH, _MM_HINT_T0);
            for (int j = 0; j < 4; j++) {
                const __m256 wv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 16 * j)));
                for (int i = 0; i < m; i++)
                    acc[i][j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i * n + k + 8 * j), acc[i][j]);
            }
        }
        for (; k < n; k += 8) { /* rows are whole 16s: at most three 8s left */
            const __m256 wv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * k)));
            for (int i = 0; i < m; i++)
                acc[i][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i * n + k), acc[i][0]);
        }
        for (int i = 0; i < m; i++) {
            const __m256 sum = _mm256_add_ps(_mm256_add_ps(acc[i][0], acc[i][1]),
                                             _mm256_add_ps(acc[i][2], acc[i][3]));
            const __m128 h = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
            const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
            y[i * ldy + r] = _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q))) + (bias ? bias[r] : 0.0f);
        }
    }
}

static void matvec_F16(const uint8_t *w, int64_t stride, int64_t rows, const float *x, int64_t m,
                       int64_t n, float *y, const float *bias) {
    ROW_PASSES(x, rows_F16);
}

static void dequant_F16(const uint8_t *w, int64_t stride, int64_t rows, int64_t n, float *out) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < n / F16_BLOCK; b++) {
            float *out_ = out + r * n + b * F16_BLOCK;
            const uint8_t *src = w + r * stride + b * F16_BYTES;
            F16_DEQ(src, STORE_EMIT);
        }
}
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
#define DEFINE_IQ_KERNELS(T, _) DEFINE_KERNELS(T)
IQ_TYPES(DEFINE_IQ_KERNELS, _)

/* MXFP4 (common.h), without DEFINE_KERNELS' buffer of dequantized weights: a block's
 * 16 code bytes, spread to dwords, index a table of its 16 exact weights (the codes'
 * values times the block's scale: one multiply), and the two lookups go straight into
 * multiply-adds with the activations. The scales of 16 blocks at a time are decoded
 * into floats on the stack first, so each block broadcasts its own from memory. */
ALWAYS_INLINE __m512 mxfp4_values(void) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)MXFP4_VALUES)));
}

/* The block at src (its scale d) into acc[i][j] and acc[i][j + 1] for the m rows of x
 * (x at the block's first weight); or, with out, its weights to out. */
ALWAYS_INLINE void mxfp4_block(const uint8_t *src, float d, __m512 kv, const float *x,
                               const int m, int64_t n, __m512 acc[][4], const int j,
                               float *out) {
    const __m512i v = spread(src + 1);
    const __m512 t = _mm512_mul_ps(kv, _mm512_set1_ps(d));
    const __m512 w0 = _mm512_permutexvar_ps(v, t);
    const __m512 w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), t);
    if (out) {
        _mm512_storeu_ps(out, w0);
        _mm512_storeu_ps(out + 16, w1);
        return;
    }
    for (int i = 0; i < m; i++) {
        acc[i][j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + i * n), acc[i][j]);
        acc[i][j + 1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + i * n + 16), acc[i][j + 1]);
    }
}

/* d[k] = the scale of block k < c of the 17-byte blocks at src */
ALWAYS_INLINE void mxfp4_scales(const uint8_t *src, int c, float *d) {
    for (int k = 0; k < c; k++) d[k] = e8m0_half(src[k * MXFP4_BYTES]);
    __asm__ volatile("" ::: "memory"); /* broadcast d from memory, as k_scales */
}

ALWAYS_INLINE void rows_MXFP4(const uint8_t *w, int64_t stride, int64_t r0, int64_t r1,
                              const float *x, const int m, int64_t n, float *y, int64_t ldy,
                              const float *bias) {
    const int64_t nb = n / MXFP4_BLOCK;
    const __m512 kv = mxfp4_values();
    float d[16] __attribute__((aligned(64)));
    const uint8_t *end = w + r1 * stride;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * stride;
        __m512 acc[MAX_M][4];
        for (int i = 0; i < m; i++)
            acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = _mm512_setzero_ps();
        for (int64_t b0 = 0; b0 < nb; b0 += 16) {
            const int c = nb - b0 < 16 ? (int)(nb - b0) : 16;
            const uint8_t *src = row + b0 * MXFP4_BYTES;
            if (src + PREFETCH + c * MXFP4_BYTES <= end)
                for (int l = 0; l < c * MXFP4_BYTES; l += 64)
                    _mm_prefetch((const char *)src + PREFETCH + l, _MM_HINT_T0);
            mxfp4_scales(src, c, d);
            const float *xb = x + b0 * MXFP4_BLOCK;
            int k = 0;
            /* two blocks at a time into four chains per row (two for more rows) */
            for (; k + 2 <= c; k += 2) {
                mxfp4_block(src + k * MXFP4_BYTES, d[k], kv, xb + 32 * k, m, n, acc, 0, NULL);
                mxfp4_block(src + (k + 1) * MXFP4_BYTES, d[k + 1], kv, xb + 32 * k + 32, m, n,
                            acc, m <= 2 ? 2 : 0, NULL);
            }
            if (k < c)
                mxfp4_block(src + k * MXFP4_BYTES, d[k], kv, xb + 32 * k, m, n, acc, 0, NULL);
        }
        for (int i = 0; i < m; i++)
            y[i * ldy + r] = _mm512_reduce_add_ps(_mm512_add_ps(
                                 _mm512_add_ps(acc[i][0], acc[i][1]),
                                 _mm512_add_ps(acc[i][2], acc[i][3]))) +
                             (bias ? bias[r] : 0.0f);
    }
}

static void matvec_MXFP4(const uint8_t *w, int64_t stride, int64_t rows, const float *x,
                         int64_t m, int64_t n, float *y, const float *bias) {
    ROW_PASSES(x, rows_MXFP4);
}

static void dequant_MXFP4(const uint8_t *w, int64_t stride, int64_t rows, int64_t n,
                          float *out) {
    const int64_t nb = n / MXFP4_BLOCK;
    const __m512 kv = mxfp4_values();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *src = w + r * stride + b * MXFP4_BYTES;
            mxfp4_block(src, e8m0_half(src[0]), kv, NULL, 0, 0, NULL, 0, out + r * n + 32 * b);
        }
}

/* Packed layouts (Q4_0_PACKED, Q5_0_PACKED): the same blocks, each row stored field
 * by field: its f16 scales, (Q5_0) its u32 high-bit words, then its 16-byte quants in
 * block order (same size; quant/kernels.py repacks). A 64-byte load then holds four
 * blocks whose nibbles shifts alone turn into eight table-lookup indices, where the
 * GGML layout needs a byte-to-dword spread per 16 weights, and four scales convert
 * at once. Weights keep their exact values d*(q-8) or d*(q-16); the scale multiplies
 * each block's partial sums instead of each weight (exact: those products are exact
 * in f32). Lane i of the 64 bytes holds bytes 4(i%4)..4(i%4)+3 of block i/4, so
 * index vector k (shift 4k) holds weight 4(i%4) + k/2 + 16(k%2) of that block; x is
 * permuted to match once per call, and for Q5_0 a per-lane rotate brings that
 * weight's high bit to index bit 4. */
#define Q4_0_PACKED_BLOCK 128
#define Q5_0_PACKED_BLOCK 128

static inline int x4_source(int k, int i) { return 4 * (i % 4) + k / 2 + 16 * (k % 2); }

static void permute_x(const float *x, int64_t n, float *xp) {
    int src[128];
    for (int k = 0; k < 8; k++)
        for (int i = 0; i < 16; i++) src[16 * k + i] = 32 * (i / 4) + x4_source(k, i);
    for (int64_t g = 0; g < n / 128; g++)
        for (int j = 0; j < 128; j++) xp[128 * g + j] = x[128 * g + src[j]];
}

ALWAYS_INLINE void rows_packed(
    const uint8_t *w, int64_t stride, int64_t r0, int64_t r1, const float *xp, const int m,
    int64_t n, float *y, int64_t ldy, const float *bias, const int five) {
    const int64_t nb = n / 32, ng = nb / 4, group = stride / ng; /* bytes of 4 blocks */
    const __m512 t0 = table(_mm512_set1_ps(1.0f), five ? -16.0f : -8.0f);
    const __m512 t1 = table(_mm512_set1_ps(1.0f), 0.0f);
    const __m512i quad = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    int32_t rot[8][16] __attribute__((aligned(64)));
    for (int k = 0; k < 8; k++)
        for (int i = 0; i < 16; i++) rot[k][i] = (4 - x4_source(k, i)) & 31;
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
            const __m512i v = _mm512_loadu_si512(qs + 64 * g);
            __m512 wv[8];
            if (five) {
                const __m512i h = _mm512_permutexvar_epi32(
                    quad, _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(qh + 16 * g))));
                for (int k = 0; k < 8; k++) {
                    const __m512i hb = _mm512_rolv_epi32(h, _mm512_load_si512(rot[k]));
                    const __m512i idx = _mm512_ternarylogic_epi32(
                        _mm512_srli_epi32(v, 4 * k), hb, _mm512_set1_epi32(15), 0xE4);
                    wv[k] = _mm512_permutex2var_ps(t0, idx, t1);
                }
            } else {
                for (int k = 0; k < 8; k++)
                    wv[k] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4 * k), t0);
            }
            const __m128 d4 = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(row + 8 * g)));
            const __m512 dv = _mm512_permutexvar_ps(quad, _mm512_castps128_ps512(d4));
            for (int i = 0; i < m; i++) {
                const float *xg = xp + i * n + 128 * g;
                __m512 s0 = _mm512_mul_ps(wv[0], _mm512_loadu_ps(xg));
                __m512 s1 = _mm512_mul_ps(wv[1], _mm512_loadu_ps(xg + 16));
                for (int k = 2; k < 8; k += 2) {
                    s0 = _mm512_fmadd_ps(wv[k], _mm512_loadu_ps(xg + 16 * k), s0);
                    s1 = _mm512_fmadd_ps(wv[k + 1], _mm512_loadu_ps(xg + 16 * k + 16), s1);
                }
                acc[i] = _mm512_fmadd_ps(_mm512_add_ps(s0, s1), dv, acc[i]);
            }
        }
        for (int i = 0; i < m; i++)
            y[i * ldy + r] = _mm512_reduce_add_ps(acc[i]) + (bias ? bias[r] : 0.0f);
    }
}

/* One block of a packed row, from its fields' places (common.h: DEFINE_PACKED). */
ALWAYS_INLINE void deq_packed(const uint8_t *d, const uint8_t *qh, const uint8_t *qs,
                              float *out_, const int five) {
    if (five) {
        const __m512 d_ = bcast_f16(d);
        const __m512 lo_ = table(d_, -16.0f), hi_ = table(d_, 0.0f);
        Q5_EMIT(qs, qh, lo_, hi_, STORE_EMIT);
    } else {
        const __m512 t4_ = table(bcast_f16(d), -8.0f);
        NIBBLES(qs, t4_, STORE_EMIT, 0);
    }
}

DEFINE_PACKED(Q4_0_PACKED, 0)
DEFINE_PACKED(Q5_0_PACKED, 1)

/* Q4_K_PACKED: each row stored as its blocks' f16 d's, then their f16 dmins, then
 * their 12-byte scale fields, then their quants (same size; quant/kernels.py
 * repacks). The scale fields come in groups of K_GROUP blocks (the last group holds
 * the c <= K_GROUP blocks left): a group of c blocks holds byte j of block i at c*j + i,
 * so one load gives byte j of each block of the group and GGML's 6-bit scales and
 * mins decode lane-wise, a group at a time (decoding them block by block costs as
 * much as the block's weights). Each block's 128 quant bytes are rearranged into
 * two 64-byte groups of four sub-blocks: byte s of lane i of group h holds weights
 * i (low nibble) and 16 + i (high) of sub-block 4h + s. Index vector k (shift 4k)
 * of a group then holds weights 16k..16k+15 of its 128, in x's own order (x is not
 * permuted), and reads one sub-block's table: per 128 weights one load, shifts,
 * eight lookups and four tables, where the GGML layout spreads bytes to dwords per
 * 16 weights. Weights keep their exact values (d*sc)*q - dmin*m, as Q4_K_DEQ makes
 * them.
 *
 * Q5_K_PACKED: the same, with the blocks' 32-byte high-bit fields between the scale
 * fields and the quants, each rearranged into sixteen u16 masks: bit i of mask k is
 * the high bit of lane i of index vector k. Each lookup picks from the low table and,
 * under its mask, from the high one: one more shuffle per 16 weights, where moving
 * each bit to index bit 4 for vpermt2ps costs a shift and a ternary logic op. */
#define Q4_K_PACKED_BLOCK 256
#define Q5_K_PACKED_BLOCK 256

/* sc[s] and mins[s], one block i < c <= K_GROUP of a scale group a lane: the 6-bit
 * scale and min of sub-block s, from the group's scale bytes (k_scales' decode,
 * get_scale_min_k4 in gguf). */
ALWAYS_INLINE void group_fields(const uint8_t *scales, int c, __m512i sc[8], __m512i mins[8]) {
    const __mmask16 k = (__mmask16)((1u << c) - 1);
    __m512i q[12];
    for (int j = 0; j < 12; j++)
        q[j] = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, scales + c * j));
    const __m512i low6 = _mm512_set1_epi32(63), low4 = _mm512_set1_epi32(15);
    const __m512i bits45 = _mm512_set1_epi32(0x30);
    for (int s = 0; s < 4; s++) {
        /* Sub-block s: the low 6 bits of bytes s and 4 + s. Sub-block 4 + s: the
         * nibbles of byte 8 + s, with bits 6-7 of those bytes as bits 4-5. */
        sc[s] = _mm512_and_si512(q[s], low6);
        mins[s] = _mm512_and_si512(q[s + 4], low6);
        sc[s + 4] = _mm512_ternarylogic_epi32(_mm512_and_si512(q[s + 8], low4),
                                              _mm512_srli_epi32(q[s], 2), bits45, 0xF8);
        mins[s + 4] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(q[s + 8], 4),
                                                _mm512_srli_epi32(q[s + 4], 2), bits45, 0xF8);
    }
}

/* group_fields for q8_avx512.c's packed K-quants (a call per group of blocks). */
__attribute__((visibility("hidden")))
void k_group_fields(const uint8_t *scales, int c, __m512i sc[8], __m512i mins[8]) {
    group_fields(scales, c, sc, mins);
}

/* ds[s][i] = d*sc[s] and ms[s][i] = dmin*m[s] for blocks i < c <= K_GROUP of a scale
 * group, from their consecutive d's, dmins and the group's scale bytes. */
__attribute__((visibility("hidden"))) void k_scales_group(const uint8_t *d16, const uint8_t *dmin16,
                                                          const uint8_t *scales, int c,
                                                          float ds[8][K_GROUP], float ms[8][K_GROUP]) {
    const __mmask16 k = (__mmask16)((1u << c) - 1);
    __m512i sc[8], mins[8];
    group_fields(scales, c, sc, mins);
    const __m512 d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, d16));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, dmin16));
    for (int s = 0; s < 8; s++) {
        _mm512_store_ps(ds[s], _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc[s])));
        _mm512_store_ps(ms[s], _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mins[s])));
    }
    __asm__ volatile("" ::: "memory"); /* broadcast ds and ms from memory, as k_scales */
}

/* wv[k] = weights 16k..16k+15 of block i of a scale group, from its quants q and (if
 * five, else NULL) its high-bit masks qh. A table is one fused multiply-subtract, yet
 * rounds as gguf's d*q - dm does: d*sc (11 by 6 significant bits) times q (5 bits)
 * is exact in f32, so only the subtraction rounds either way. */
ALWAYS_INLINE void k_packed_weights(
    const uint8_t *q, const uint8_t *qh, const float ds[8][K_GROUP],
    const float ms[8][K_GROUP], int i, __m512 wv[16], const int five) {
    const __m512i v0 = _mm512_loadu_si512(q), v1 = _mm512_loadu_si512(q + 64);
    for (int s = 0; s < 8; s++) {
        const __m512 d = _mm512_set1_ps(ds[s][i]), dm = _mm512_set1_ps(ms[s][i]);
        const __m512 t = _mm512_fmsub_ps(d, iota16(), dm);
        const __m512 t16 =
            five ? _mm512_fmsub_ps(d, _mm512_add_ps(iota16(), _mm512_set1_ps(16.0f)), dm) : t;
        const __m512i v = s < 4 ? v0 : v1;
        for (int h = 0; h < 2; h++) {
            const __m512i idx = _mm512_srli_epi32(v, 8 * (s % 4) + 4 * h);
            wv[2 * s + h] = _mm512_permutexvar_ps(idx, t);
            if (five) {
                uint16_t bits;
                memcpy(&bits, qh + 4 * s + 2 * h, 2);
                wv[2 * s + h] = _mm512_mask_permutexvar_ps(wv[2 * s + h], _cvtu32_mask16(bits),
                                                           idx, t16);
            }
        }
    }
}

ALWAYS_INLINE void rows_k_packed(
    const uint8_t *w, int64_t stride, int64_t r0, int64_t r1, const float *x, const int m,
    int64_t n, float *y, int64_t ldy, const float *bias, const int five) {
    const int64_t nb = n / QK_K, bytes = five ? Q5_K_BYTES : Q4_K_BYTES;
    const uint8_t *end = w + r1 * stride;
    float ds[8][K_GROUP] __attribute__((aligned(64)));
    float ms[8][K_GROUP] __attribute__((aligned(64)));
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * stride, *qh = row + 16 * nb;
        const uint8_t *qs = row + (five ? 48 : 16) * nb;
        __m512 acc[MAX_M][4];
        for (int i = 0; i < m; i++)
            acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = _mm512_setzero_ps();
        for (int64_t b0 = 0; b0 < nb; b0 += K_GROUP) {
            const int c = nb - b0 < K_GROUP ? (int)(nb - b0) : K_GROUP;
            k_scales_group(row + 2 * b0, row + 2 * nb + 2 * b0, row + 4 * nb + 12 * b0, c, ds,
                           ms);
            for (int j = 0; j < c; j++) {
                const int64_t b = b0 + j;
                /* At a GGML block's pace through the bytes, so that the rows ahead come
                 * in whole (their d, dmin and scale fields too), not only their quants. */
                const uint8_t *ahead = row + PREFETCH + bytes * b;
                if (ahead + bytes <= end) {
                    _mm_prefetch((const char *)ahead, _MM_HINT_T0);
                    _mm_prefetch((const char *)ahead + 64, _MM_HINT_T0);
                    if (five) _mm_prefetch((const char *)ahead + 128, _MM_HINT_T0);
                    _mm_prefetch((const char *)ahead + bytes - 1, _MM_HINT_T0);
                }
                __m512 wv[16];
                k_packed_weights(qs + 128 * b, five ? qh + 32 * b : NULL, ds, ms, j, wv, five);
                for (int i = 0; i < m; i++) {
                    /* Up to two rows: four running sums each. More would not fit the
                     * registers with wv: their block sums go in four chains, then add. */
                    const float *xg = x + i * n + 256 * b;
                    __m512 sum[4];
                    for (int k = 0; k < 4; k++)
                        sum[k] = m <= 2 ? _mm512_fmadd_ps(wv[k], _mm512_loadu_ps(xg + 16 * k),
                                                          acc[i][k])
                                        : _mm512_mul_ps(wv[k], _mm512_loadu_ps(xg + 16 * k));
                    for (int k = 4; k < 16; k++)
                        sum[k % 4] =
                            _mm512_fmadd_ps(wv[k], _mm512_loadu_ps(xg + 16 * k), sum[k % 4]);
                    if (m <= 2)
                        for (int k = 0; k < 4; k++) acc[i][k] = sum[k];
                    else
                        acc[i][0] = _mm512_add_ps(acc[i][0],
                                                  _mm512_add_ps(_mm512_add_ps(sum[0], sum[1]),
                                                                _mm512_add_ps(sum[2], sum[3])));
                }
            }
        }
        for (int i = 0; i < m; i++)
            y[i * ldy + r] = _mm512_reduce_add_ps(_mm512_add_ps(
                                 _mm512_add_ps(acc[i][0], acc[i][1]),
                                 _mm512_add_ps(acc[i][2], acc[i][3]))) +
                             (bias ? bias[r] : 0.0f);
    }
}

ALWAYS_INLINE void dequant_k_packed(
    const uint8_t *w, int64_t stride, int64_t rows, int64_t n, float *out, const int five) {
    const int64_t nb = n / QK_K;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = w + r * stride, *qh = row + 16 * nb;
        const uint8_t *qs = row + (five ? 48 : 16) * nb;
        float ds[8][K_GROUP] __attribute__((aligned(64)));
        float ms[8][K_GROUP] __attribute__((aligned(64)));
        for (int64_t b0 = 0; b0 < nb; b0 += K_GROUP) {
            const int c = nb - b0 < K_GROUP ? (int)(nb - b0) : K_GROUP;
            k_scales_group(row + 2 * b0, row + 2 * nb + 2 * b0, row + 4 * nb + 12 * b0, c, ds,
                           ms);
            for (int j = 0; j < c; j++) {
                __m512 wv[16];
                const int64_t b = b0 + j;
                k_packed_weights(qs + 128 * b, five ? qh + 32 * b : NULL, ds, ms, j, wv, five);
                for (int k = 0; k < 16; k++)
                    _mm512_storeu_ps(out + r * n + 256 * b + 16 * k, wv[k]);
            }
        }
    }
}

#define DEFINE_K_PACKED(T, FIVE)                                                         \
    static void matvec_##T(const uint8_t *w, int64_t stride, int64_t rows, const float *x, \
                           int64_t m, int64_t n, float *y, const float *bias) {          \
        ROW_PASSES(x, rows_k_packed, FIVE);                                              \
    }                                                                                    \
    static void dequant_##T(const uint8_t *w, int64_t stride, int64_t rows, int64_t n,   \
                            float *out) {                                                \
        dequant_k_packed(w, stride, rows, n, out, FIVE);                                 \
    }

DEFINE_K_PACKED(Q4_K_PACKED, 0)
DEFINE_K_PACKED(Q5_K_PACKED, 1)

DEFINE_API()

#else

int llmrun_available(void) { return 0; }

#endif
