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


/* GGML: byte 32p + l holds weight l of sub-block 2p (low nibble) and of 2p + 1 (high). */
static inline uint8_t k_nibble(const uint8_t *qs, int sub, int weight) {
    const uint8_t byte = qs[32 * (sub / 2) + weight];
    return sub % 2 ? byte >> 4 : byte & 15;
}

static void k_quants(const uint8_t *qs, uint8_t *out) {
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 16; i++)
            for (int s = 0; s < 4; s++)
                out[64 * h + 4 * i + s] =
                    (uint8_t)(k_nibble(qs, 4 * h + s, i) | k_nibble(qs, 4 * h + s, 16 + i) << 4);
}

/* GGML: bit j of byte l is weight l of sub-block j. */
static void q5_k_high_bits(const uint8_t *qh, uint8_t *out) {
    for (int j = 0; j < 8; j++)
        for (int k = 0; k < 4; k++) { /* byte 4j + k: weights 8k .. 8k + 7 */
            uint8_t mask = 0;
            for (int b = 0; b < 8; b++) mask |= (uint8_t)(((qh[8 * k + b] >> j) & 1) << b);
            out[4 * j + k] = mask;
        }
}

/* rows of nb GGML blocks of `type` at src -> the packed layout at dst (as many bytes):
 * 0, or -1 for a type without one. */
int llmrun_pack(int type, const uint8_t *src, int64_t rows, int64_t nb, uint8_t *dst) {
    int sizes[5], fields;
    switch (type) {
    case Q4_0: fields = 2, sizes[0] = 2, sizes[1] = 16; break;
    case Q5_0: fields = 3, sizes[0] = 2, sizes[1] = 4, sizes[2] = 16; break;
    case Q8_0: fields = 2, sizes[0] = 2, sizes[1] = 32; break;
    case Q4_K: fields = 4, sizes[0] = 2, sizes[1] = 2, sizes[2] = 12, sizes[3] = 128; break;
    case Q5_K:
        fields = 5, sizes[0] = 2, sizes[1] = 2, sizes[2] = 12, sizes[3] = 32, sizes[4] = 128;
        break;
    default: return -1;
    }
    int bytes = 0;
    for (int f = 0; f < fields; f++) bytes += sizes[f];
    const int k_quant = type == Q4_K || type == Q5_K;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = src + r * nb * bytes;
        uint8_t *out = dst + r * nb * bytes;
        int start = 0; /* the field's offset in a block */
        for (int f = 0; f < fields; f++) {
            const int size = sizes[f];
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *from = row + b * bytes + start;
                if (k_quant && f == 2) { /* the scale fields, interleaved by groups */
                    const int64_t first = b - b % K_GROUP;
                    const int64_t c = nb - first < K_GROUP ? nb - first : K_GROUP;
                    for (int j = 0; j < 12; j++) out[12 * first + c * j + b - first] = from[j];
                } else if (k_quant && f == fields - 1) {
                    k_quants(from, out + 128 * b);
                } else if (type == Q5_K && f == 3) {
                    q5_k_high_bits(from, out + 32 * b);
                } else {
                    memcpy(out + size * b, from, (size_t)size);
                }
            }
            out += size * nb;
            start += size;
        }
    }
    return 0;
}
