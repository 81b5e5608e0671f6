/* The packed row layouts (llmrun/quant/kernels.py: pack), written from GGML's blocks.
 * Built into every family's library, as plain C: a model's weights are repacked once at
 * load, and byte by byte in torch that took seconds for a 1B model.
 *
 * A packed row holds each block field of all its blocks in turn (all the d's, then ...,
 * then all the quants); Q4_K's and Q5_K's 12 bytes of scale fields go in groups of
 * K_GROUP blocks, byte j of the group's block i at c * j + i (c: the group's blocks),
 * their quants as two 64-byte groups h of four sub-blocks 4h + s, byte 4i + s holding
 * weights i (low nibble) and 16 + i (high), and Q5_K's high bits as u16 masks, bit b of
 * byte 4j + 2t + h being weight 16t + 8h + b of sub-block j. kernels.unpack, in torch,
 * reverses it.
 */
#include "common.h"


/* GGML: byte 32p + l holds weights l of sub-blocks 2p (low nibble) and 2p + 1 (high).
 * Packed: byte 64h + 4i + s holds weights i (low) and 16 + i (high) of sub-block 4h + s,
 * so its nibbles come from GGML's bytes 64h + 32(s / 2) + i and 16 after it: the low
 * nibbles for even s, the high ones for odd s. */
static inline void k_quants(const uint8_t *qs, uint8_t *out) {
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 16; i++) {
            const uint8_t *g = qs + 64 * h + i;
            out[64 * h + 4 * i + 0] = (uint8_t)((g[0] & 15) | g[16] << 4);
            out[64 * h + 4 * i + 1] = (uint8_t)((g[0] >> 4) | (g[16] & 0xF0));
            out[64 * h + 4 * i + 2] = (uint8_t)((g[32] & 15) | g[48] << 4);
            out[64 * h + 4 * i + 3] = (uint8_t)((g[32] >> 4) | (g[48] & 0xF0));
        }
}

/* GGML: bit j of byte l is weight l of sub-block j. Packed: bit b of byte 4j + k is
 * weight 8k + b of sub-block j, so each 8 bytes of GGML's make an 8 x 8 bit matrix
 * whose transpose (Hacker's Delight's, three exchanges of blocks) gives bytes k,
 * 4 + k, ..., 28 + k. */
static inline void q5_k_high_bits(const uint8_t *qh, uint8_t *out) {
    for (int k = 0; k < 4; k++) {
        uint64_t x, t;
        memcpy(&x, qh + 8 * k, 8);
        t = (x ^ (x >> 7)) & 0x00AA00AA00AA00AAull, x ^= t ^ (t << 7);
        t = (x ^ (x >> 14)) & 0x0000CCCC0000CCCCull, x ^= t ^ (t << 14);
        t = (x ^ (x >> 28)) & 0x00000000F0F0F0F0ull, x ^= t ^ (t << 28);
        for (int j = 0; j < 8; j++) out[4 * j + k] = (uint8_t)(x >> (8 * j));
    }
}

/* A field (`size` bytes from `start` in each block of `bytes`) of every block of a row,
 * one after another. Inlined where the sizes are constants, so each copy is a move or
 * two, not a call to memcpy: the calls were most of the repacking (a 0.5B Q4_0's
 * weights took 0.11 s with them, 0.03 s without; benchmarks/pack_ab.py). */
ALWAYS_INLINE void gather(const uint8_t *row, int64_t nb, int bytes, int start, int size,
                          uint8_t *out) {
    for (int64_t b = 0; b < nb; b++)
        memcpy(out + size * b, row + b * bytes + start, (size_t)size);
}

/* One row of nb blocks of `type` (`bytes` each, fields of `sizes` bytes) -> its packed
 * layout. Inlined into each type's loop, so the sizes are constants there. */
ALWAYS_INLINE void pack_row(const uint8_t *row, int64_t nb, uint8_t *out, const int type,
                            const int bytes, const int fields, const int *sizes) {
    const int k_quant = type == Q4_K || type == Q5_K;
    int start = 0; /* the field's offset in a block */
#pragma GCC unroll 8
    for (int f = 0; f < fields; f++) {
        if (k_quant && f == 2) { /* the scale fields, interleaved by groups */
            for (int64_t first = 0; first < nb; first += K_GROUP) {
                const int64_t c = nb - first < K_GROUP ? nb - first : K_GROUP;
                for (int64_t i = 0; i < c; i++)
                    for (int j = 0; j < 12; j++)
                        out[12 * first + c * j + i] = row[(first + i) * bytes + start + j];
            }
        } else if (k_quant && f == fields - 1) {
            for (int64_t b = 0; b < nb; b++) k_quants(row + b * bytes + start, out + 128 * b);
        } else if (type == Q5_K && f == 3) {
            for (int64_t b = 0; b < nb; b++) q5_k_high_bits(row + b * bytes + start, out + 32 * b);
        } else {
            gather(row, nb, bytes, start, sizes[f], out);
        }
        out += sizes[f] * nb;
        start += sizes[f];
    }
}

#define DEFINE_PACK(T, ...)                                                              \
    static void pack_##T(const uint8_t *src, int64_t rows, int64_t nb, uint8_t *dst) {  \
        static const int sizes[] = {__VA_ARGS__};                                        \
        const int fields = (int)(sizeof(sizes) / sizeof(sizes[0]));                      \
        int bytes = 0;                                                                   \
        for (int f = 0; f < fields; f++) bytes += sizes[f];                              \
        _Pragma("omp parallel for schedule(static)")                                     \
        for (int64_t r = 0; r < rows; r++)                                               \
            pack_row(src + r * nb * bytes, nb, dst + r * nb * bytes, T, bytes, fields,   \
                     sizes);                                                             \
    }

DEFINE_PACK(Q4_0, 2, 16)
DEFINE_PACK(Q5_0, 2, 4, 16)
DEFINE_PACK(Q8_0, 2, 32)
DEFINE_PACK(Q4_K, 2, 2, 12, 128)
DEFINE_PACK(Q5_K, 2, 2, 12, 32, 128)

/* rows of nb GGML blocks of `type` at src -> the packed layout at dst (as many bytes):
 * 0, or -1 for a type without one. */
int llmrun_pack(int type, const uint8_t *src, int64_t rows, int64_t nb, uint8_t *dst) {
    switch (type) {
    case Q4_0: pack_Q4_0(src, rows, nb, dst); return 0;
    case Q5_0: pack_Q5_0(src, rows, nb, dst); return 0;
    case Q8_0: pack_Q8_0(src, rows, nb, dst); return 0;
    case Q4_K: pack_Q4_K(src, rows, nb, dst); return 0;
    case Q5_K: pack_Q5_K(src, rows, nb, dst); return 0;
    default: return -1;
    }
}
