/* What every kernel family's file (kernels_avx512.c, kernels_avx2.c) shares: GGML's
 * type ids, the sizes a matvec works in, its passes over the weights (ROW_PASSES), the
 * matvec and dequantizer of the packed Q4_0 and Q5_0 layouts (DEFINE_PACKED) and the C
 * API that llmrun/native/__init__.py declares, dispatched by type (DEFINE_API).
 *
 * Macros, constants and plain C only: a family's file includes this first, then
 * defines its kernels with its own vector code (and, for the macros here, the names
 * they expect: its KERNEL_TYPES and EXPERT_TYPES, TYPE_READY(type), T##_BLOCK, matvec_T
 * and dequant_T per type, and for the packed layouts permute_x, rows_packed and
 * deq_packed), and ends with DEFINE_API().
 * A new family is one more such file.
 */
#ifndef LLMRUN_COMMON_H
#define LLMRUN_COMMON_H
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

#define MAX_M 8 /* most activation rows handled per pass over the weights */
#ifndef PREFETCH
#define PREFETCH 4096 /* bytes ahead of the current block, within a thread's rows */
#endif
/* Bytes of weights a thread takes at a time: it reads them as one stream, and longer
 * streams read faster from memory (on Zen 4, a decode step with 64 KB chunks took 5-10 %
 * longer than with 1 MB ones; huge pages make the difference larger). */
#define CHUNK (1 << 20)

/* GGMLQuantizationType values */
enum { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10,
       Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18,
       IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22, IQ4_XS = 23, IQ1_M = 29, BF16 = 30,
       TQ1_0 = 34, TQ2_0 = 35, MXFP4 = 39,
       /* llmrun's packed layouts (llmrun/quant/kernels.py repacks), 1000 + the type */
       Q4_0_PACKED = 1002, Q5_0_PACKED = 1006, Q8_0_PACKED = 1008, Q4_K_PACKED = 1012,
       Q5_K_PACKED = 1013 };
/* Q4_K_PACKED and Q5_K_PACKED hold their scale fields in groups of this many blocks
 * (layout.c) */
#define K_GROUP 16

/* The GGML types every family has kernels for, as X(T, A) for each; a family's
 * EXPERT_TYPES(X, A) lists these and the other GGML types it has (the x86 families: the
 * i-quants, iquants.h), its KERNEL_TYPES(X, A) those and its packed layouts. */
#define GGML_TYPES(X, A)                                                                 \
    X(F32, A) X(F16, A) X(BF16, A) X(Q4_0, A) X(Q4_1, A) X(Q5_0, A) X(Q5_1, A) X(Q8_0, A) \
    X(Q2_K, A) X(Q3_K, A) X(Q4_K, A) X(Q5_K, A) X(Q6_K, A) X(IQ4_NL, A) X(IQ4_XS, A)    \
    X(MXFP4, A)

static inline uint32_t u32_at(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* MXFP4 (gpt-oss's experts): 32 weights a block, one E8M0 scale byte, then 16 bytes
 * of e2m1 codes (low nibbles weights 0..15, high nibbles 16..31). The codes' values,
 * doubled, and the scale halved to match: w = MXFP4_VALUES[q] * 2^(e - 128), exact in
 * f32 (or inf) for every byte. */
#define MXFP4_BLOCK 32
#define MXFP4_BYTES 17
static const int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* 2^(e - 128), from its bits as gguf's e8m0_to_fp32_half builds them (e < 2 subnormal) */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float d;
    memcpy(&d, &bits, 4);
    return d;
}

/* Rows of `stride` bytes a thread takes at a time out of `rows`: about CHUNK bytes, but
 * few enough that every thread of the team gets some. */
static inline int64_t row_chunk(int64_t stride, int64_t rows) {
    const int64_t threads = omp_in_parallel() ? 1 : omp_get_max_threads();
    const int64_t even = (rows + threads - 1) / threads;
    const int64_t by_bytes = stride >= CHUNK ? 1 : CHUNK / stride;
    return by_bytes < even ? by_bytes : even > 0 ? even : 1;
}

/* Bytes of weights a thread takes at a time when more activation rows than one pass
 * takes (a prompt's) go over them: few enough to stay in its L2 cache while every
 * pass goes by, so they are read from memory once. */
#define PASSES_CHUNK (128 << 10)

static inline int64_t passes_chunk(int64_t stride, int64_t rows) {
    const int64_t by_bytes = stride >= PASSES_CHUNK ? 1 : PASSES_CHUNK / stride;
    const int64_t chunk = row_chunk(stride, rows);
    return by_bytes < chunk ? by_bytes : chunk;
}

/* Every matvec's passes over the weights: 8, 4, 2 or 1 activation rows at a time, the
 * rows split over the threads in chunks of about CHUNK bytes (more rows than a pass
 * takes: PASSES_CHUNK bytes, every pass over a chunk before the next). PASS runs once
 * per chunk and pass, with r0_, r1_ (the chunk's rows), i0_ (the pass's first
 * activation row) and pass_m_ (its rows, a constant in each case, so that the kernel,
 * always inline, is specialized per count) in scope. Expects stride, rows and m. */
#define FOR_PASSES(PASS)                                                                 \
    do {                                                                                 \
        const int64_t chunk_ = m > MAX_M ? passes_chunk(stride, rows) : row_chunk(stride, rows); \
        _Pragma("omp parallel for schedule(dynamic)")                                    \
        for (int64_t r0_ = 0; r0_ < rows; r0_ += chunk_) {                               \
            const int64_t r1_ = r0_ + chunk_ < rows ? r0_ + chunk_ : rows;               \
            for (int64_t i0_ = 0; i0_ < m;) {                                            \
                const int mm_ = m - i0_ >= 8 ? 8 : m - i0_ >= 4 ? 4 : m - i0_ >= 2 ? 2 : 1; \
                switch (mm_) {                                                           \
                case 1: { const int pass_m_ = 1; PASS; } break;                          \
                case 2: { const int pass_m_ = 2; PASS; } break;                          \
                case 4: { const int pass_m_ = 4; PASS; } break;                          \
                default: { const int pass_m_ = 8; PASS; } break;                         \
                }                                                                        \
                i0_ += mm_;                                                              \
            }                                                                            \
        }                                                                                \
    } while (0)

/* FOR_PASSES over X [m, n]: ROWS(w, stride, r0, r1, x, m, n, y, ldy, bias, ...) for the
 * pass's rows of X. Expects w, stride, rows, m, n, y and bias in scope, as the matvec
 * functions name them. */
#define ROW_PASSES(X, ROWS, ...)                                                         \
    FOR_PASSES(ROWS(w, stride, r0_, r1_, (X) + i0_ * n, pass_m_, n, y + i0_ * rows, rows, bias, \
                    ##__VA_ARGS__))

/* The packed Q4_0 (FIVE 0) and Q5_0 (FIVE 1) layouts: each row stored field by field,
 * its f16 scales, (Q5_0) its u32 high-bit words, then its 16-byte quants in block
 * order. matvec_T permutes x once per call (the family's permute_x, to the order its
 * rows_packed takes the weights in); dequant_T goes block by block from the fields'
 * places through the family's deq_packed(d, qh, qs, out, five), which writes one
 * block's 32 weights to out. */
#define DEFINE_PACKED(T, FIVE)                                                           \
    static void matvec_##T(const uint8_t *w, int64_t stride, int64_t rows, const float *x, \
                           int64_t m, int64_t n, float *y, const float *bias) {          \
        float *xp = malloc(sizeof(float) * (size_t)(m * n));                             \
        if (xp == NULL) return;                                                          \
        for (int64_t i = 0; i < m; i++) permute_x(x + i * n, n, xp + i * n);             \
        ROW_PASSES(xp, rows_packed, FIVE);                                               \
        free(xp);                                                                        \
    }                                                                                    \
    static void dequant_##T(const uint8_t *w, int64_t stride, int64_t rows, int64_t n,   \
                            float *out) {                                                \
        const int64_t nb = n / 32;                                                       \
        _Pragma("omp parallel for schedule(static)")                                     \
        for (int64_t r = 0; r < rows; r++) {                                             \
            const uint8_t *row = w + r * stride;                                         \
            for (int64_t b = 0; b < nb; b++)                                             \
                deq_packed(row + 2 * b, row + 2 * nb + 4 * b, row + ((FIVE) ? 6 : 2) * nb + 16 * b, \
                           out + r * n + 32 * b, FIVE);                                  \
        }                                                                                \
    }

/* In a function of `type`: CALL(T) for each of the family's KERNEL_TYPES, then return
 * 0; -1 for any other type. */
#define DISPATCH_CASE(T, CALL)                                                           \
    case T: CALL(T); return 0;
#define DISPATCH(CALL)                                                                   \
    switch (type) {                                                                      \
    KERNEL_TYPES(DISPATCH_CASE, CALL)                                                    \
    default: return -1;                                                                  \
    }
#define BLOCK_CASE(T, _) case T: return T##_BLOCK;

/* One activation row through `count` matrices of one GGML type in one parallel region
 * (the experts a token chose): rows_T over every matrix's rows in chunks of about
 * CHUNK bytes. Expects ws, stride, rows, x, x_step, n, y and count in scope, as
 * llmrun_matvec_experts names them. */
#define EXPERTS_PASS(ROWS)                                                               \
    FOR_EXPERT_PIECES(ROWS((const uint8_t *)(intptr_t)ws[j_], stride, r0_, r1_,          \
                           x + j_ * x_step, 1, n, y + j_ * rows, rows, NULL))

/* CALL for every piece of about CHUNK bytes of rows r0_ .. r1_ - 1 of matrix j_ <
 * count, in one parallel region (stride, rows and count in scope). */
#define FOR_EXPERT_PIECES(CALL)                                                          \
    do {                                                                                 \
        const int64_t chunk_ = row_chunk(stride, rows);                                  \
        const int64_t pieces_ = (rows + chunk_ - 1) / chunk_;                            \
        _Pragma("omp parallel for schedule(dynamic)")                                    \
        for (int64_t p_ = 0; p_ < count * pieces_; p_++) {                               \
            const int64_t j_ = p_ / pieces_, r0_ = p_ % pieces_ * chunk_;                \
            const int64_t r1_ = r0_ + chunk_ < rows ? r0_ + chunk_ : rows;               \
            CALL;                                                                        \
        }                                                                                \
    } while (0)
#define EXPERTS_CASE(T, _) case T: EXPERTS_PASS(rows_##T); return 0;
/* What llmrun_matvec_experts does before the per-type passes: a family's own way for
 * some types (defined before this file is included), else nothing. */
#ifndef EXPERTS_FIRST
#define EXPERTS_FIRST
#endif
#define CALL_MATVEC(T) matvec_##T(w, stride, rows, x, m, n, y, bias)
#define CALL_DEQUANT(T) dequant_##T(w, stride, rows, n, out)

/* The library's C API, over the family's KERNEL_TYPES. Where the compiler targets a CPU
 * without the family's instructions, its file defines llmrun_available() == 0 alone.
 * TYPE_READY(type) is 0 for a type whose kernels wait for tables (the i-quants', until
 * llmrun_iq_tables): no kernel yet (block 0), and the calls return -1. */
#define DEFINE_API()                                                                     \
    int llmrun_available(void) { return 1; }                                             \
                                                                                         \
    /* Row lengths the kernels take for `type` are multiples of this; 0: no kernel. */  \
    int llmrun_block(int type) {                                                         \
        if (!TYPE_READY(type)) return 0;                                                 \
        switch (type) {                                                                  \
        KERNEL_TYPES(BLOCK_CASE, _)                                                      \
        default: return 0;                                                               \
        }                                                                                \
    }                                                                                    \
                                                                                         \
    /* y[i, r] = sum_k W[r, k] x[i, k] (+ bias[r], if bias is not NULL): W is `rows`    \
     * rows of n weights, `stride` bytes apart; x is [m, n] and y is [m, rows], both     \
     * contiguous f32. */                                                                \
    int llmrun_matvec(int type, const uint8_t *w, int64_t stride, int64_t rows,          \
                      const float *x, int64_t m, int64_t n, float *y, const float *bias) { \
        if (!TYPE_READY(type)) return -1;                                                \
        DISPATCH(CALL_MATVEC)                                                            \
    }                                                                                    \
                                                                                         \
    /* y[j, r] = sum_k W_j[r, k] x[j * x_step + k] for j < count: W_j is `rows` rows of \
     * n weights, `stride` bytes apart, at address ws[j], all of one GGML type (not a   \
     * packed layout); y is contiguous [count, rows]. A mixture-of-experts layer's       \
     * chosen experts for one token in one call (x_step 0: the same x for every one). */ \
    int llmrun_matvec_experts(int type, const int64_t *ws, int64_t stride, int64_t rows, \
                              const float *x, int64_t x_step, int64_t n, float *y,       \
                              int64_t count) {                                           \
        if (!TYPE_READY(type)) return -1;                                                \
        EXPERTS_FIRST                                                                    \
        switch (type) {                                                                  \
        EXPERT_TYPES(EXPERTS_CASE, _)                                                    \
        default: return -1;                                                              \
        }                                                                                \
    }                                                                                    \
                                                                                         \
    /* out[r, k] = W[r, k] as f32, out contiguous [rows, n]. */                          \
    int llmrun_dequantize(int type, const uint8_t *w, int64_t stride, int64_t rows,      \
                          int64_t n, float *out) {                                       \
        if (!TYPE_READY(type)) return -1;                                                \
        DISPATCH(CALL_DEQUANT)                                                           \
    }

#endif
