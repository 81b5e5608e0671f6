/* The i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) and the ternary
 * types (TQ1_0, TQ2_0): their block sizes and tables, shared by the x86 families'
 * kernels (kernels_avx512.c, kernels_avx2.c), which dequantize each block in vector code
 * to exactly the values gguf's reference gives (the same operations in the same order;
 * built with -ffp-contract=off).
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

/* Not static: the family's 8-bit-activation kernels (q8.h, another file of its library)
 * read them too. */
#define IQ_TABLE __attribute__((visibility("hidden")))
IQ_TABLE const uint8_t *ksigns;                                /* [128] */
IQ_TABLE const uint8_t *iq2xxs_grid, *iq2xs_grid, *iq2s_grid; /* [256], [512], [1024] x 8 */
IQ_TABLE const uint8_t *iq3xxs_grid, *iq3s_grid;               /* [256], [512] x 4 */
IQ_TABLE const int8_t *iq1s_grid;                              /* [2048] x 8, for IQ1_S and IQ1_M */

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

#endif
