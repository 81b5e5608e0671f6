/* Quantizing f32 rows to GGML blocks, bit-identical to ggml's quantizers (ggml-quants.c:
 * quantize_row_*_ref, what llama-quantize writes without an imatrix; with an importance
 * row, the quantize_row_*_impl paths that weigh each column by it) and its f16/bf16
 * conversions, for `llmrun quantize` (llmrun/quantize.py).
 *
 * Bit-exactness needs the same float operations in the same order: this file is built
 * with -ffp-contract=off (build.py's FLAGS), so no multiply-add is fused, and every sum
 * below runs in ggml's order. The K-quants pick each sub-block's scale by ggml's searches:
 * a weighted least-squares scale and min over 16-21 trial scales (Q2_K, Q4_K, Q5_K), an
 * iterative least-squares scale (Q3_K), and the best of 19 trial scales (Q6_K).
 *
 * With an importance row (an imatrix: a weight per column, the mean squared activation
 * it meets), each weight's error counts by imatrix[column] * sqrt(sigma2 + x^2) (sigma2:
 * the mean x^2 of the row, or twice that of the super-block for Q3_K..Q5_K): Q4_0 and
 * Q5_0 take the weighted best of 19 trial scales, Q4_1, Q5_1, Q2_K, Q4_K and Q5_K the
 * weighted scale-and-min search over 37 trial scales, Q3_K and Q6_K the weighted trial
 * scales per 16 weights, and the K-quants' sub-block scales are themselves quantized by
 * a weighted search (Q3_K's as signed values, the others' by make_qp_quants). Q8_0 and the
 * float types ignore it.
 *
 * llmrun_quantize(type, src, dst, rows, n_per_row, imatrix, threads) quantizes rows of f32
 * (on `threads` OpenMP threads, over rows), each with the same importance row of
 * n_per_row values (NULL: none), and returns the bytes written, or -1 for a type or row
 * length it does not take.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
       T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30 };

#define QK 32    /* weights in a Q4_0..Q8_0 block */
#define QK_K 256 /* weights in a K-quant super-block */
#define ZERO_GROUP 1e-15f /* a group whose largest |weight| is below this is all zero */

static inline uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float float_of(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* f32 -> f16, rounding to nearest even, NaN -> 0x7e00 with its sign: ggml's conversion,
 * done with f32 arithmetic that scales the value so the rounding happens in the add. */
static uint16_t to_f16(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = bits_of(f);
    const uint32_t doubled = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = doubled & 0xff000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = float_of((bias >> 1) + 0x07800000u) + base;
    const uint32_t b = bits_of(base);
    const uint32_t magnitude = ((b >> 13) & 0x7c00u) + (b & 0x0fffu);
    return (uint16_t)((sign >> 16) | (doubled > 0xff000000u ? 0x7e00u : magnitude));
}

static float from_f16(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    if (exponent == 0) { /* zero or subnormal: mantissa * 2^-24, exact */
        const float v = (float)mantissa * 0x1.0p-24f;
        return sign ? -v : v;
    }
    if (exponent == 31) return float_of(sign | 0x7f800000u | (mantissa << 13));
    return float_of(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

static inline uint16_t to_bf16(float f) {
    const uint32_t u = bits_of(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 64); /* quiet NaN */
    return (uint16_t)((u + (0x7fffu + ((u >> 16) & 1))) >> 16);
}

static inline void put_f16(uint8_t *p, float f) {
    const uint16_t h = to_f16(f);
    memcpy(p, &h, 2);
}

/* f16 stored at p, as f32 */
static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return from_f16(h);
}

/* round to nearest (ties to even) for |v| < 2^22, by adding 1.5 * 2^23 so that the
 * integer lands in the low mantissa bits */
static inline int nearest(float v) {
    const uint32_t u = bits_of(v + 12582912.f);
    return (int)(u & 0x007fffffu) - 0x00400000;
}

static inline int clamp(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

/* ---- 32-weight blocks ---- */

/* the weight of largest magnitude (the first such), 0 for none */
static float signed_absmax(const float *x, int n) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < n; j++) {
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    }
    return max;
}

static void min_max(const float *x, int n, float *lo, float *hi) {
    float min = 3.40282347e+38f, max = -3.40282347e+38f;
    for (int j = 0; j < n; j++) {
        if (x[j] < min) min = x[j];
        if (x[j] > max) max = x[j];
    }
    *lo = min;
    *hi = max;
}

static void q4_0_block(const float *x, uint8_t *out) { /* d, 16 bytes of nibbles */
    const float d = signed_absmax(x, QK) / -8;
    const float id = d ? 1.0f / d : 0.0f;
    put_f16(out, d);
    for (int j = 0; j < QK / 2; j++) {
        const int lo = (int8_t)(x[j] * id + 8.5f), hi = (int8_t)(x[j + QK / 2] * id + 8.5f);
        out[2 + j] = (uint8_t)((lo < 15 ? lo : 15) | (hi < 15 ? hi : 15) << 4);
    }
}

static void q4_1_block(const float *x, uint8_t *out) { /* d, m, 16 bytes of nibbles */
    float min, max;
    min_max(x, QK, &min, &max);
    const float d = (max - min) / 15;
    const float id = d ? 1.0f / d : 0.0f;
    put_f16(out, d);
    put_f16(out + 2, min);
    for (int j = 0; j < QK / 2; j++) {
        const int lo = (int8_t)((x[j] - min) * id + 0.5f);
        const int hi = (int8_t)((x[j + QK / 2] - min) * id + 0.5f);
        out[4 + j] = (uint8_t)((lo < 15 ? lo : 15) | (hi < 15 ? hi : 15) << 4);
    }
}

/* the 5-bit codes' low nibbles into qs, their fifth bits into the 32-bit qh */
static void pack5(const uint8_t *codes, uint8_t *qh_at, uint8_t *qs) {
    uint32_t qh = 0;
    for (int j = 0; j < QK / 2; j++) {
        const uint8_t lo = codes[j], hi = codes[j + QK / 2];
        qs[j] = (uint8_t)((lo & 0x0f) | (hi & 0x0f) << 4);
        qh |= (uint32_t)((lo & 0x10u) >> 4) << j;
        qh |= (uint32_t)((hi & 0x10u) >> 4) << (j + QK / 2);
    }
    memcpy(qh_at, &qh, 4);
}

static void q5_0_block(const float *x, uint8_t *out) { /* d, qh, 16 bytes */
    const float d = signed_absmax(x, QK) / -16;
    const float id = d ? 1.0f / d : 0.0f;
    uint8_t codes[QK];
    put_f16(out, d);
    for (int j = 0; j < QK; j++) {
        const int q = (int8_t)(x[j] * id + 16.5f);
        codes[j] = (uint8_t)(q < 31 ? q : 31);
    }
    pack5(codes, out + 2, out + 6);
}

static void q5_1_block(const float *x, uint8_t *out) { /* d, m, qh, 16 bytes */
    float min, max;
    min_max(x, QK, &min, &max);
    const float d = (max - min) / 31;
    const float id = d ? 1.0f / d : 0.0f;
    uint8_t codes[QK];
    put_f16(out, d);
    put_f16(out + 2, min);
    for (int j = 0; j < QK; j++) codes[j] = (uint8_t)((x[j] - min) * id + 0.5f);
    pack5(codes, out + 4, out + 8);
}

static void q8_0_block(const float *x, uint8_t *out) { /* d, 32 int8 */
    float amax = 0.0f;
    for (int j = 0; j < QK; j++) amax = amax > fabsf(x[j]) ? amax : fabsf(x[j]);
    const float d = amax / 127;
    const float id = d ? 1.0f / d : 0.0f;
    put_f16(out, d);
    for (int j = 0; j < QK; j++) out[2 + j] = (uint8_t)(int8_t)roundf(x[j] * id);
}

/* ---- the K-quants' scale searches ---- */

/* Codes L in [0, nmax] and a scale and min (*neg_min = -min) for x ~ scale*L + min, min <= 0,
 * by weighted least squares over nstep + 1 trial scales (rmin + rdelta*is + nmax)/range
 * around the plain one; errors squared, or absolute with `absolute`. */
static float scale_and_min(int n, int nmax, const float *x, const float *w, uint8_t *L,
                           float *neg_min, float rmin, float rdelta, int nstep, int absolute) {
    float min = x[0], max = x[0];
    float sum_w = w[0];
    float sum_x = sum_w * x[0];
    for (int i = 1; i < n; i++) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (min > 0) min = 0;
    if (max == min) {
        memset(L, 0, (size_t)n);
        *neg_min = -min;
        return 0.f;
    }
    float iscale = nmax / (max - min);
    float scale = 1 / iscale;
    float best = 0;
    for (int i = 0; i < n; i++) {
        L[i] = (uint8_t)clamp(nearest(iscale * (x[i] - min)), 0, nmax);
        float diff = scale * L[i] + min - x[i];
        diff = absolute ? fabsf(diff) : diff * diff;
        best += w[i] * diff;
    }
    uint8_t trial[32];
    for (int is = 0; is <= nstep; is++) {
        iscale = (rmin + rdelta * is + nmax) / (max - min);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; i++) {
            const int l = clamp(nearest(iscale * (x[i] - min)), 0, nmax);
            trial[i] = (uint8_t)l;
            sum_l += w[i] * l;
            sum_l2 += w[i] * l * l;
            sum_xl += w[i] * l * x[i];
        }
        const float det = sum_w * sum_l2 - sum_l * sum_l;
        if (!(det > 0)) continue;
        float this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
        float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
        if (this_min > 0) {
            this_min = 0;
            this_scale = sum_xl / sum_l2;
        }
        float error = 0;
        for (int i = 0; i < n; i++) {
            float diff = this_scale * trial[i] + this_min - x[i];
            diff = absolute ? fabsf(diff) : diff * diff;
            error += w[i] * diff;
        }
        if (error < best) {
            memcpy(L, trial, (size_t)n);
            best = error;
            scale = this_scale;
            min = this_min;
        }
    }
    *neg_min = -min;
    return scale;
}

/* Q6_K's symmetric search (make_qx_quants): codes L in [0, 2*nmax) (offset nmax) and a
 * scale, the best of 19 trial scales -(nmax + 0.1*is)/max by the least-squares fit
 * weighted by qw, or by x^2 where qw is NULL */
static float symmetric_scale(int n, int nmax, const float *x, int8_t *L, const float *qw) {
    const float max = signed_absmax(x, n);
    if (fabsf(max) < ZERO_GROUP) {
        memset(L, 0, (size_t)n);
        return 0.f;
    }
    float iscale = -nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        const int l = clamp(nearest(iscale * x[i]), -nmax, nmax - 1);
        L[i] = (int8_t)(l + nmax);
        const float w = qw ? qw[i] : x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    float scale = suml2 ? sumlx / suml2 : 0.0f;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; is++) {
        if (is == 0) continue;
        iscale = -(nmax + 0.1f * is) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; i++) {
            const int l = clamp(nearest(iscale * x[i]), -nmax, nmax - 1);
            const float w = qw ? qw[i] : x[i] * x[i];
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; i++) L[i] = (int8_t)(nmax + clamp(nearest(iscale * x[i]), -nmax, nmax - 1));
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

/* Q3_K's search: codes L in [0, 2*nmax) (offset nmax) and a scale, refined code by code
 * (up to 5 rounds) while the x^2-weighted fit improves */
static float refined_scale(int n, int nmax, const float *x, int8_t *L) {
    const float max = signed_absmax(x, n);
    if (fabsf(max) < ZERO_GROUP) {
        memset(L, 0, (size_t)n);
        return 0.f;
    }
    const float iscale = -nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        const int l = clamp(nearest(iscale * x[i]), -nmax, nmax - 1);
        L[i] = (int8_t)l;
        const float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    for (int round = 0; round < 5; round++) {
        int changed = 0;
        for (int i = 0; i < n; i++) {
            const float w = x[i] * x[i];
            float slx = sumlx - w * x[i] * L[i];
            if (!(slx > 0)) continue;
            float sl2 = suml2 - w * L[i] * L[i];
            const int l = clamp(nearest(x[i] * sl2 / slx), -nmax, nmax - 1);
            if (l == L[i]) continue;
            slx += w * x[i] * l;
            sl2 += w * l * l;
            if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
                L[i] = (int8_t)l;
                sumlx = slx;
                suml2 = sl2;
                changed++;
            }
        }
        if (!changed) break;
    }
    for (int i = 0; i < n; i++) L[i] = (int8_t)(L[i] + nmax);
    return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

/* four 2-bit codes a byte: byte 32h + l holds L[128h + l + 32s] in bits 2s..2s+1 */
static void pack2(const uint8_t *L, uint8_t *qs) {
    for (int h = 0; h < QK_K / 128; h++)
        for (int l = 0; l < 32; l++) {
            const uint8_t *c = L + 128 * h + l;
            qs[32 * h + l] = (uint8_t)(c[0] | c[32] << 2 | c[64] << 4 | c[96] << 6);
        }
}

/* ---- K-quant super-blocks ---- */

static void q2_k_block(const float *x, uint8_t *out) { /* scales[16], qs[64], d, dmin */
    uint8_t *scales = out, *qs = out + 16;
    uint8_t L[QK_K];
    float w[16], sub_scale[16], sub_min[16];
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < 16; j++) {
        for (int l = 0; l < 16; l++) w[l] = fabsf(x[16 * j + l]);
        sub_scale[j] = scale_and_min(16, 3, x + 16 * j, w, L + 16 * j, &sub_min[j], -0.5f, 0.1f, 15, 1);
        if (sub_scale[j] > max_scale) max_scale = sub_scale[j];
        if (sub_min[j] > max_min) max_min = sub_min[j];
    }
    if (max_scale > 0) {
        const float iscale = 15.f / max_scale;
        for (int j = 0; j < 16; j++) scales[j] = (uint8_t)nearest(iscale * sub_scale[j]);
        put_f16(out + 80, max_scale / 15.f);
    } else {
        memset(scales, 0, 16);
        put_f16(out + 80, 0.f);
    }
    if (max_min > 0) {
        const float iscale = 15.f / max_min;
        for (int j = 0; j < 16; j++) scales[j] |= (uint8_t)(nearest(iscale * sub_min[j]) << 4);
        put_f16(out + 82, max_min / 15.f);
    } else {
        put_f16(out + 82, 0.f);
    }
    for (int j = 0; j < 16; j++) {
        const float d = f16_at(out + 80) * (scales[j] & 0xf);
        if (!d) continue;
        const float dm = f16_at(out + 82) * (scales[j] >> 4);
        for (int i = 0; i < 16; i++) L[16 * j + i] = (uint8_t)clamp(nearest((x[16 * j + i] + dm) / d), 0, 3);
    }
    pack2(L, qs);
}

/* Q3_K's 6-bit scale code l (offset 32) of sub-block j: low 4 bits in bytes 0-7, high 2 in 8-11 */
static void put_q3_scale(uint8_t *scales, int j, int l) {
    scales[j % 8] |= (uint8_t)((l & 0xf) << (j < 8 ? 0 : 4));
    scales[8 + j % 4] |= (uint8_t)((l >> 4) << (2 * (j / 4)));
}

/* Q3_K's codes under the block's packed scales and d (sub-blocks of scale 0 keep L), and
 * their bits: hmask[32], qs[64] */
static void q3_k_codes(const float *x, uint8_t *out, int8_t *L) {
    uint8_t *hmask = out, *qs = out + 32, *scales = out + 96;
    for (int j = 0; j < 16; j++) {
        const int low = j < 8 ? scales[j] & 0xf : scales[j - 8] >> 4;
        const int sc = (int8_t)((low | ((scales[8 + j % 4] >> (2 * (j / 4))) & 3) << 4) - 32);
        const float d = f16_at(out + 108) * sc;
        if (!d) continue;
        for (int i = 0; i < 16; i++) L[16 * j + i] = (int8_t)(clamp(nearest(x[16 * j + i] / d), -4, 3) + 4);
    }
    /* the third bit of weight j goes to bit j / 32 of hmask byte j % 32 */
    memset(hmask, 0, 32);
    uint8_t low2[QK_K];
    for (int j = 0; j < QK_K; j++) {
        low2[j] = (uint8_t)(L[j] & 3);
        if (L[j] > 3) hmask[j % 32] |= (uint8_t)(1u << (j / 32));
    }
    pack2(low2, qs);
}

static void q3_k_block(const float *x, uint8_t *out) { /* hmask[32], qs[64], scales[12], d */
    uint8_t *scales = out + 96;
    int8_t L[QK_K];
    float sub_scale[16];
    float max_scale = 0, amax = 0;
    for (int j = 0; j < 16; j++) {
        sub_scale[j] = refined_scale(16, 4, x + 16 * j, L + 16 * j);
        if (fabsf(sub_scale[j]) > amax) {
            amax = fabsf(sub_scale[j]);
            max_scale = sub_scale[j];
        }
    }
    memset(scales, 0, 12);
    if (max_scale) {
        const float iscale = -32.f / max_scale;
        for (int j = 0; j < 16; j++) {
            const int8_t q = (int8_t)nearest(iscale * sub_scale[j]);
            put_q3_scale(scales, j, clamp(q, -32, 31) + 32);
        }
        put_f16(out + 108, 1 / iscale);
    } else {
        put_f16(out + 108, 0.f);
    }
    q3_k_codes(x, out, L);
}

/* Q4_K's and Q5_K's 6-bit scales and mins of 8 sub-blocks in 12 bytes: bytes 0-3 scales
 * 0-3 (+ the high 2 bits of scales 4-7), 4-7 mins 0-3 (+ of mins 4-7), 8-11 the low
 * nibbles of scale and min 4-7 */
static void pack_k_scales(uint8_t *scales, const uint8_t *sc, const uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        scales[j] = sc[j];
        scales[j + 4] = mn[j];
    }
    for (int j = 4; j < 8; j++) {
        scales[j + 4] = (uint8_t)((sc[j] & 0xf) | (mn[j] & 0xf) << 4);
        scales[j - 4] |= (uint8_t)((sc[j] >> 4) << 6);
        scales[j] |= (uint8_t)((mn[j] >> 4) << 6);
    }
}

/* sub-block j's 6-bit scale and min from the 12 bytes (ggml's get_scale_min_k4) */
static void k_scale_min(int j, const uint8_t *q, uint8_t *sc, uint8_t *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4));
        *mn = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* Q4_K and Q5_K: 8 sub-blocks of 32, each with a 6-bit scale and min packed into 12
 * bytes; returns the codes in L */
static void k_scales_mins(const float *x, uint8_t *out, uint8_t *L, int nmax, float rmin, int nstep) {
    uint8_t *scales = out + 4;
    float w[32], sub_scale[8], sub_min[8];
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; j++) {
        const float *xs = x + 32 * j;
        float sum_x2 = 0;
        for (int l = 0; l < 32; l++) sum_x2 += xs[l] * xs[l];
        const float av_x = sqrtf(sum_x2 / 32);
        for (int l = 0; l < 32; l++) w[l] = av_x + fabsf(xs[l]);
        sub_scale[j] = scale_and_min(32, nmax, xs, w, L + 32 * j, &sub_min[j], rmin, 0.1f, nstep, 0);
        if (sub_scale[j] > max_scale) max_scale = sub_scale[j];
        if (sub_min[j] > max_min) max_min = sub_min[j];
    }
    const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
    const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    uint8_t sc[8], mn[8];
    for (int j = 0; j < 8; j++) {
        const uint8_t ls = (uint8_t)nearest(inv_scale * sub_scale[j]);
        const uint8_t lm = (uint8_t)nearest(inv_min * sub_min[j]);
        sc[j] = ls < 63 ? ls : 63;
        mn[j] = lm < 63 ? lm : 63;
    }
    pack_k_scales(scales, sc, mn);
    put_f16(out, max_scale / 63.f);
    put_f16(out + 2, max_min / 63.f);
    for (int j = 0; j < 8; j++) {
        const float d = f16_at(out) * sc[j];
        if (!d) continue;
        const float dm = f16_at(out + 2) * mn[j];
        for (int i = 0; i < 32; i++) L[32 * j + i] = (uint8_t)clamp(nearest((x[32 * j + i] + dm) / d), 0, nmax);
    }
}

/* Q4_K's codes: qs[128] at out + 16 */
static void q4_k_pack(const uint8_t *L, uint8_t *out) {
    uint8_t *qs = out + 16;
    for (int h = 0; h < QK_K / 64; h++)
        for (int l = 0; l < 32; l++) qs[32 * h + l] = (uint8_t)(L[64 * h + l] | L[64 * h + l + 32] << 4);
}

/* Q5_K's codes: qh[32] at out + 16, qs[128] at out + 48 */
static void q5_k_pack(const uint8_t *L, uint8_t *out) {
    uint8_t *qh = out + 16, *qs = out + 48;
    memset(qh, 0, 32);
    for (int h = 0; h < QK_K / 64; h++)
        for (int l = 0; l < 32; l++) {
            const uint8_t lo = L[64 * h + l], hi = L[64 * h + l + 32];
            qh[l] |= (uint8_t)((lo >> 4) << (2 * h) | (hi >> 4) << (2 * h + 1));
            qs[32 * h + l] = (uint8_t)((lo & 0xf) | (hi & 0xf) << 4);
        }
}

static void q4_k_block(const float *x, uint8_t *out) { /* d, dmin, scales[12], qs[128] */
    uint8_t L[QK_K];
    k_scales_mins(x, out, L, 15, -1.f, 20);
    q4_k_pack(L, out);
}

static void q5_k_block(const float *x, uint8_t *out) { /* d, dmin, scales[12], qh[32], qs[128] */
    uint8_t L[QK_K];
    k_scales_mins(x, out, L, 31, -0.5f, 15);
    q5_k_pack(L, out);
}

/* ql[128], qh[64], scales[16], d; each 16 weights' scale fit weighted by qw (NULL: x^2) */
static void q6_k_weighted(const float *x, uint8_t *out, const float *qw) {
    uint8_t *ql = out, *qh = out + 128;
    int8_t *scales = (int8_t *)(out + 192);
    int8_t L[QK_K];
    float sub_scale[16];
    float max_scale = 0, max_abs = 0;
    for (int j = 0; j < 16; j++) {
        sub_scale[j] = symmetric_scale(16, 32, x + 16 * j, L + 16 * j, qw ? qw + 16 * j : NULL);
        if (fabsf(sub_scale[j]) > max_abs) {
            max_abs = fabsf(sub_scale[j]);
            max_scale = sub_scale[j];
        }
    }
    if (max_abs < ZERO_GROUP) {
        memset(out, 0, 210);
        return;
    }
    const float iscale = -128.f / max_scale;
    put_f16(out + 208, 1 / iscale);
    for (int j = 0; j < 16; j++) {
        const int s = nearest(iscale * sub_scale[j]);
        scales[j] = (int8_t)(s < 127 ? s : 127);
    }
    for (int j = 0; j < 16; j++) {
        const float d = f16_at(out + 208) * scales[j];
        if (!d) continue;
        for (int i = 0; i < 16; i++) L[16 * j + i] = (int8_t)(clamp(nearest(x[16 * j + i] / d), -32, 31) + 32);
    }
    /* per 128 weights: ql bytes l and 32 + l hold the low nibbles of weights l, 64 + l and
     * 32 + l, 96 + l; qh byte l their high 2 bits */
    for (int h = 0; h < QK_K / 128; h++) {
        const int8_t *c = L + 128 * h;
        for (int l = 0; l < 32; l++) {
            ql[64 * h + l] = (uint8_t)((c[l] & 0xf) | (c[l + 64] & 0xf) << 4);
            ql[64 * h + l + 32] = (uint8_t)((c[l + 32] & 0xf) | (c[l + 96] & 0xf) << 4);
            qh[32 * h + l] = (uint8_t)(c[l] >> 4 | (c[l + 32] >> 4) << 2 | (c[l + 64] >> 4) << 4 | (c[l + 96] >> 4) << 6);
        }
    }
}

static void q6_k_block(const float *x, uint8_t *out) { q6_k_weighted(x, out, NULL); }

/* ---- with an importance row qw (ggml's quantize_row_*_impl) ---- */

/* make_qp_quants: codes L in [0, nmax] and a scale for x >= 0 (the K-quants' sub-block
 * scales or mins) ~ scale*L: the best of 9 trial scales by the qw-weighted squared error,
 * then refined code by code (up to 5 rounds) while the weighted fit improves. Codes are
 * bytes as ggml keeps them, a negative one wrapped. */
static float positive_scale(int n, int nmax, const float *x, uint8_t *L, const float *qw) {
    float max = 0;
    for (int i = 0; i < n; i++) max = max > x[i] ? max : x[i];
    if (max < ZERO_GROUP) {
        memset(L, 0, (size_t)n);
        return 0.f;
    }
    float iscale = nmax / max;
    for (int i = 0; i < n; i++) L[i] = (uint8_t)nearest(iscale * x[i]);
    const float scale = 1 / iscale;
    float best = 0;
    for (int i = 0; i < n; i++) {
        const float diff = x[i] - scale * L[i];
        best += qw[i] * diff * diff;
    }
    for (int is = -4; is <= 4; is++) {
        if (is == 0) continue;
        const float iscale_is = (0.1f * is + nmax) / max;
        const float scale_is = 1 / iscale_is;
        float error = 0;
        for (int i = 0; i < n; i++) {
            int l = nearest(iscale_is * x[i]);
            l = nmax < l ? nmax : l;
            const float diff = x[i] - scale_is * l;
            error += qw[i] * diff * diff;
        }
        if (error < best) {
            best = error;
            iscale = iscale_is;
        }
    }
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        int l = nearest(iscale * x[i]);
        l = nmax < l ? nmax : l;
        L[i] = (uint8_t)l;
        sumlx += qw[i] * x[i] * l;
        suml2 += qw[i] * l * l;
    }
    for (int round = 0; round < 5; round++) {
        int changed = 0;
        for (int i = 0; i < n; i++) {
            const float w = qw[i];
            float slx = sumlx - w * x[i] * L[i];
            float sl2 = suml2 - w * L[i] * L[i];
            if (!(slx > 0 && sl2 > 0)) continue;
            int l = nearest(x[i] * sl2 / slx);
            l = nmax < l ? nmax : l;
            if (l == L[i]) continue;
            slx += w * x[i] * l;
            sl2 += w * l * l;
            if (slx * slx * suml2 > sumlx * sumlx * sl2) {
                L[i] = (uint8_t)l;
                sumlx = slx;
                suml2 = sl2;
                changed++;
            }
        }
        if (!changed) break;
    }
    return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

/* each weight's importance: qw[j] * sqrt(sigma2 + x[j]^2) */
static void importance(const float *x, const float *qw, float sigma2, int n, float *w) {
    for (int j = 0; j < n; j++) w[j] = qw[j] * sqrtf(sigma2 + x[j] * x[j]);
}

static float sum_squares(const float *x, int64_t n) {
    float sum = 0;
    for (int64_t j = 0; j < n; j++) sum += x[j] * x[j];
    return sum;
}

static float sum_of(const float *w, int n) {
    float sum = 0;
    for (int j = 0; j < n; j++) sum += w[j];
    return sum;
}

/* A block with its importance row qw; row_sigma2 is the mean x^2 of the whole row, which
 * the 32-weight types read (the K-quants take their super-block's). */
typedef void (*weighted_fn)(const float *x, uint8_t *out, const float *qw, float row_sigma2);

static void q4_0_weighted(const float *x, uint8_t *out, const float *qw, float row_sigma2) {
    float w[QK];
    int8_t L[QK];
    importance(x, qw, row_sigma2, QK, w);
    put_f16(out, symmetric_scale(QK, 8, x, L, w));
    for (int j = 0; j < QK / 2; j++) out[2 + j] = (uint8_t)(L[j] | L[j + QK / 2] << 4);
}

static void q4_1_weighted(const float *x, uint8_t *out, const float *qw, float row_sigma2) {
    float w[QK], neg_min;
    uint8_t L[QK];
    importance(x, qw, row_sigma2, QK, w);
    put_f16(out, scale_and_min(QK, 15, x, w, L, &neg_min, -0.9f, 0.05f, 36, 0));
    put_f16(out + 2, -neg_min);
    for (int j = 0; j < QK / 2; j++) out[4 + j] = (uint8_t)(L[j] | L[j + QK / 2] << 4);
}

static void q5_0_weighted(const float *x, uint8_t *out, const float *qw, float row_sigma2) {
    float w[QK];
    int8_t L[QK];
    importance(x, qw, row_sigma2, QK, w);
    put_f16(out, symmetric_scale(QK, 16, x, L, w));
    pack5((const uint8_t *)L, out + 2, out + 6);
}

static void q5_1_weighted(const float *x, uint8_t *out, const float *qw, float row_sigma2) {
    float w[QK], neg_min;
    uint8_t L[QK];
    importance(x, qw, row_sigma2, QK, w);
    put_f16(out, scale_and_min(QK, 31, x, w, L, &neg_min, -0.9f, 0.05f, 36, 0));
    put_f16(out + 2, -neg_min);
    pack5(L, out + 4, out + 8);
}

static void q2_k_weighted(const float *x, uint8_t *out, const float *qw, float row_sigma2) {
    (void)row_sigma2;
    uint8_t *scales = out;
    uint8_t L[QK_K], Ls[16], Lm[16];
    float w[16], sw[16], sub_scale[16], sub_min[16];
    const float sigma2 = sum_squares(x, QK_K) / QK_K;
    for (int j = 0; j < 16; j++) {
        importance(x + 16 * j, qw + 16 * j, sigma2, 16, w);
        sw[j] = sum_of(w, 16);
        sub_scale[j] = scale_and_min(16, 3, x + 16 * j, w, L + 16 * j, &sub_min[j], -0.9f, 0.05f, 36, 0);
    }
    put_f16(out + 80, positive_scale(16, 15, sub_scale, Ls, sw));
    put_f16(out + 82, positive_scale(16, 15, sub_min, Lm, sw));
    for (int j = 0; j < 16; j++) scales[j] = (uint8_t)(Ls[j] | Lm[j] << 4);
    for (int j = 0; j < 16; j++) {
        const float d = f16_at(out + 80) * (scales[j] & 0xf);
        if (!d) continue;
        const float m = f16_at(out + 82) * (scales[j] >> 4);
        for (int i = 0; i < 16; i++) L[16 * j + i] = (uint8_t)clamp(nearest((x[16 * j + i] + m) / d), 0, 3);
    }
    pack2(L, out + 16);
}

static void q3_k_weighted(const float *x, uint8_t *out, const float *qw, float row_sigma2) {
    (void)row_sigma2;
    int8_t L[QK_K], Ls[16];
    float w[16], sw[16], sub_scale[16];
    const float sigma2 = 2 * sum_squares(x, QK_K) / QK_K;
    for (int j = 0; j < 16; j++) {
        importance(x + 16 * j, qw + 16 * j, sigma2, 16, w);
        sw[j] = sum_of(w, 16);
        sub_scale[j] = symmetric_scale(16, 4, x + 16 * j, L + 16 * j, w);
    }
    memset(out + 96, 0, 12);
    const float d = symmetric_scale(16, 32, sub_scale, Ls, sw);
    for (int j = 0; j < 16; j++) put_q3_scale(out + 96, j, Ls[j]);
    put_f16(out + 108, d);
    q3_k_codes(x, out, L);
}

/* Q4_K's and Q5_K's weighted scales and mins (codes up to nmax) and the codes under them;
 * Q5_K (`cap`) keeps the scale codes at 63 */
static void k_weighted(const float *x, uint8_t *out, const float *qw, uint8_t *L, int nmax, int cap) {
    float w[32], sw[8], sub_scale[8], sub_min[8];
    uint8_t Ls[8], Lm[8];
    const float sigma2 = 2 * sum_squares(x, QK_K) / QK_K;
    for (int j = 0; j < 8; j++) {
        importance(x + 32 * j, qw + 32 * j, sigma2, 32, w);
        sw[j] = sum_of(w, 32);
        sub_scale[j] = scale_and_min(32, nmax, x + 32 * j, w, L + 32 * j, &sub_min[j], -0.9f, 0.05f, 36, 0);
    }
    const float d = positive_scale(8, 63, sub_scale, Ls, sw);
    const float dmin = positive_scale(8, 63, sub_min, Lm, sw);
    for (int j = 0; j < 8 && cap; j++) {
        Ls[j] = Ls[j] < 63 ? Ls[j] : 63;
        Lm[j] = Lm[j] < 63 ? Lm[j] : 63;
    }
    pack_k_scales(out + 4, Ls, Lm);
    put_f16(out, d);
    put_f16(out + 2, dmin);
    for (int j = 0; j < 8; j++) {
        uint8_t sc, mn;
        k_scale_min(j, out + 4, &sc, &mn);
        const float dj = f16_at(out) * sc;
        if (!dj) continue;
        const float mj = f16_at(out + 2) * mn;
        for (int i = 0; i < 32; i++) L[32 * j + i] = (uint8_t)clamp(nearest((x[32 * j + i] + mj) / dj), 0, nmax);
    }
}

static void q4_k_weighted(const float *x, uint8_t *out, const float *qw, float row_sigma2) {
    (void)row_sigma2;
    uint8_t L[QK_K];
    k_weighted(x, out, qw, L, 15, 0);
    q4_k_pack(L, out);
}

static void q5_k_weighted(const float *x, uint8_t *out, const float *qw, float row_sigma2) {
    (void)row_sigma2;
    uint8_t L[QK_K];
    k_weighted(x, out, qw, L, 31, 1);
    q5_k_pack(L, out);
}

static void q6_k_weighted_block(const float *x, uint8_t *out, const float *qw, float row_sigma2) {
    (void)row_sigma2;
    q6_k_weighted(x, out, qw);
}

/* a type's quantizer with an importance row; 0 for types that ignore it */
static int weighted_of(int type, weighted_fn *fn) {
    switch (type) {
    case T_Q4_0: *fn = q4_0_weighted; return 1;
    case T_Q4_1: *fn = q4_1_weighted; return 1;
    case T_Q5_0: *fn = q5_0_weighted; return 1;
    case T_Q5_1: *fn = q5_1_weighted; return 1;
    case T_Q2_K: *fn = q2_k_weighted; return 1;
    case T_Q3_K: *fn = q3_k_weighted; return 1;
    case T_Q4_K: *fn = q4_k_weighted; return 1;
    case T_Q5_K: *fn = q5_k_weighted; return 1;
    case T_Q6_K: *fn = q6_k_weighted_block; return 1;
    default: return 0;
    }
}

typedef void (*block_fn)(const float *, uint8_t *);

/* a type's quantizer, weights and bytes per block; 0 for types without one */
static int block_of(int type, block_fn *fn, int *weights, int *bytes) {
    switch (type) {
    case T_Q4_0: *fn = q4_0_block, *weights = QK, *bytes = 18; return 1;
    case T_Q4_1: *fn = q4_1_block, *weights = QK, *bytes = 20; return 1;
    case T_Q5_0: *fn = q5_0_block, *weights = QK, *bytes = 22; return 1;
    case T_Q5_1: *fn = q5_1_block, *weights = QK, *bytes = 24; return 1;
    case T_Q8_0: *fn = q8_0_block, *weights = QK, *bytes = 34; return 1;
    case T_Q2_K: *fn = q2_k_block, *weights = QK_K, *bytes = 84; return 1;
    case T_Q3_K: *fn = q3_k_block, *weights = QK_K, *bytes = 110; return 1;
    case T_Q4_K: *fn = q4_k_block, *weights = QK_K, *bytes = 144; return 1;
    case T_Q5_K: *fn = q5_k_block, *weights = QK_K, *bytes = 176; return 1;
    case T_Q6_K: *fn = q6_k_block, *weights = QK_K, *bytes = 210; return 1;
    default: return 0;
    }
}

int64_t llmrun_quantize(int type, const float *src, void *dst, int64_t rows, int64_t n_per_row,
                        const float *imatrix, int threads) {
    uint8_t *out = (uint8_t *)dst;
    const int64_t n = rows * n_per_row;
    if (rows < 0 || n_per_row <= 0 || threads < 1) return -1;
    if (type == T_F32) {
        memcpy(out, src, (size_t)n * 4);
        return n * 4;
    }
    if (type == T_F16 || type == T_BF16) {
        uint16_t *half = (uint16_t *)dst;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t i = 0; i < n; i++) half[i] = type == T_F16 ? to_f16(src[i]) : to_bf16(src[i]);
        return n * 2;
    }
    block_fn fn;
    int weights, bytes;
    if (!block_of(type, &fn, &weights, &bytes) || n_per_row % weights) return -1;
    const int64_t blocks = n_per_row / weights;
    weighted_fn weighted;
    if (imatrix && weighted_of(type, &weighted)) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
        for (int64_t r = 0; r < rows; r++) {
            const float *x = src + r * n_per_row;
            const float sigma2 = sum_squares(x, n_per_row) / n_per_row;
            for (int64_t b = 0; b < blocks; b++)
                weighted(x + b * weights, out + (r * blocks + b) * bytes, imatrix + b * weights, sigma2);
        }
        return rows * blocks * bytes;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < blocks; b++)
            fn(src + r * n_per_row + b * weights, out + (r * blocks + b) * bytes);
    return rows * blocks * bytes;
}
