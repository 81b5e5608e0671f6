/* The small f32 ops of a decode step, each one call instead of several torch ops:
 * RMSNorm, rotary embedding, SiLU- and tanh-GELU-gated products, single-query
 * attention over a KV cache (stored as f32, f16, bf16 or Q8_0), soft-capped or not,
 * with attention sinks or not, and one token of a Gated DeltaNet layer (llmrun/ops.py).
 *
 * On one token's activations (a few thousand floats) a torch op costs 2-20 us of
 * dispatch and allocation, and a decode step of a 24-layer model runs ~45 of them
 * per layer, several ms a token; the elementwise ops here take about a microsecond.
 * Built into each kernel family's library (llmrun/native/build.py) with that
 * family's -march: the loops use AVX-512, AVX2 or NEON vectors through the few macros
 * below, or `omp simd` for the compiler to vectorize. Sums are in f32 in another
 * order than torch's, and exp is a polynomial (within 2 ulp of expf), so results
 * match the torch code to rounding, not bit for bit; the rotary embedding alone is
 * exact (the same products and sums).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Vectors of VW floats, by the family's instruction set (this file is compiled with
 * its -march): AVX-512, AVX2 with FMA, NEON, or one float at a time. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define VW 16
typedef __m512 vec;
typedef __m512i ivec;
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vadd _mm512_add_ps
#define vsub _mm512_sub_ps
#define vmul _mm512_mul_ps
#define vdiv _mm512_div_ps
#define vfma _mm512_fmadd_ps
#define vmin _mm512_min_ps
#define vmax _mm512_max_ps
#define vset1 _mm512_set1_ps
#define vzero _mm512_setzero_ps
#define vsum _mm512_reduce_add_ps
#define vround(x) _mm512_roundscale_ps((x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
/* (sum of a, sum of b, sum of c, sum of d) into out[0..3] */
static inline void vsum4(__m512 a, __m512 b, __m512 c, __m512 d, float *out) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    /* each 128-bit lane: a, b, c, d partial sums */
    const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
    const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1)));
}
#define vpow2i(n) /* 2^n for whole n in [-126, 127] */                                  \
    _mm512_castsi512_ps(_mm512_slli_epi32(                                               \
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23))
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VW 8
typedef __m256 vec;
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vadd _mm256_add_ps
#define vsub _mm256_sub_ps
#define vmul _mm256_mul_ps
#define vdiv _mm256_div_ps
#define vfma _mm256_fmadd_ps
#define vmin _mm256_min_ps
#define vmax _mm256_max_ps
#define vset1 _mm256_set1_ps
#define vzero _mm256_setzero_ps
#define vround(x) _mm256_round_ps((x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vpow2i(n)                                                                        \
    _mm256_castsi256_ps(_mm256_slli_epi32(                                               \
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23))
static inline void vsum4(__m256 a, __m256 b, __m256 c, __m256 d, float *out) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}
static inline float vsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define VW 4
typedef float32x4_t vec;
#define vload vld1q_f32
#define vstore vst1q_f32
#define vadd vaddq_f32
#define vsub vsubq_f32
#define vmul vmulq_f32
#define vdiv vdivq_f32
#define vfma(a, b, c) vfmaq_f32((c), (a), (b)) /* a * b + c, as x86's fmadd */
#define vmin vminq_f32
#define vmax vmaxq_f32
#define vset1 vdupq_n_f32
#define vzero() vdupq_n_f32(0.0f)
#define vsum vaddvq_f32
#define vround vrndnq_f32 /* to nearest, ties to even, as nearbyintf */
#define vpow2i(n)                                                                        \
    vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)), 23))
static inline void vsum4(vec a, vec b, vec c, vec d, float *out) {
    vst1q_f32(out, vpaddq_f32(vpaddq_f32(a, b), vpaddq_f32(c, d)));
}
#else
#define VW 1
#endif

/* exp(x) for x in [-87, 88] (clamped outside): Cody-Waite reduction to
 * r in [-ln2/2, ln2/2] and Cephes' degree-6 polynomial, scaled by 2^n through the
 * exponent bits; within 2 ulp of expf. */
static inline float exp_scalar(float x) {
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    const float n = nearbyintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union {
        int32_t i;
        float f;
    } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return p * scale.f;
}

#if VW > 1
/* exp_scalar on VW lanes, the same operations. */
static inline vec vexp(vec x) {
    x = vmax(vmin(x, vset1(88.0f)), vset1(-87.0f));
    const vec n = vround(vmul(x, vset1(1.44269504088896341f)));
    vec r = vsub(x, vmul(n, vset1(0.693359375f)));
    r = vsub(r, vmul(n, vset1(-2.12194440e-4f)));
    vec p = vset1(1.9875691500e-4f);
    p = vadd(vmul(p, r), vset1(1.3981999507e-3f));
    p = vadd(vmul(p, r), vset1(8.3334519073e-3f));
    p = vadd(vmul(p, r), vset1(4.1665795894e-2f));
    p = vadd(vmul(p, r), vset1(1.6666665459e-1f));
    p = vadd(vmul(p, r), vset1(5.0000001201e-1f));
    p = vadd(vadd(vmul(vmul(p, r), r), r), vset1(1.0f));
    return vmul(p, vpow2i(n));
}
#endif

/* y = x / sqrt(mean(x^2) + eps) * (weight + offset), per row of n values (torch's
 * rms_norm at offset 0; Gemma's norm, x * (1 + w), at offset 1). */
void llmrun_rms_norm_offset(const float *x, const float *weight, float offset, float eps,
                            int64_t rows, int64_t n, float *y) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; i++) sum += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(sum / (float)n + eps);
#pragma omp simd
        for (int64_t i = 0; i < n; i++) yr[i] = xr[i] * inv * (weight[i] + offset);
    }
}

void llmrun_rms_norm(const float *x, const float *weight, float eps, int64_t rows, int64_t n,
                     float *y) {
    llmrun_rms_norm_offset(x, weight, 0.0f, eps, rows, n, y);
}

/* Rotary embedding of rows of `dim` values, the first `rot` of them rotated in the
 * half-split layout: y[i] = x[i] * cos[i] + x[i +- rot/2] * sin[i], with sin's
 * signs folded in (llmrun/ops.py rotary); the same cos/sin for every row. */
void llmrun_rotary(const float *x, int64_t rows, int64_t dim, const float *cos,
                   const float *sin, int64_t rot, float *y) {
    const int64_t half = rot / 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *yr = y + r * dim;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) yr[i] = xr[i] * cos[i] + xr[i + half] * sin[i];
#pragma omp simd
        for (int64_t i = half; i < rot; i++) yr[i] = xr[i] * cos[i] + xr[i - half] * sin[i];
        memcpy(yr + rot, xr + rot, (size_t)(dim - rot) * sizeof(float));
    }
}

/* Elementwise products of a prompt's many rows go to the OpenMP team in runs of this
 * many values; a token's few thousand stay on the calling thread. */
#define PARALLEL_RUN 16384

/* F over n values, in runs of PARALLEL_RUN over the team when there are several. */
#define IN_RUNS(F, gate, up, n, y)                                                       \
    do {                                                                                 \
        _Pragma("omp parallel for schedule(static) if (n > PARALLEL_RUN)")               \
        for (int64_t r_ = 0; r_ < n; r_ += PARALLEL_RUN)                                 \
            F(gate + r_, up + r_, n - r_ < PARALLEL_RUN ? n - r_ : PARALLEL_RUN, y + r_); \
    } while (0)

/* y = silu(gate) * up = gate / (1 + exp(-gate)) * up, over n values. */
static void silu_mul_run(const float *gate, const float *up, int64_t n, float *y) {
    int64_t i = 0;
#if VW > 1
    for (; i + VW <= n; i += VW) {
        const vec g = vload(gate + i);
        const vec e = vexp(vsub(vzero(), g));
        vstore(y + i, vmul(vdiv(g, vadd(vset1(1.0f), e)), vload(up + i)));
    }
#endif
    for (; i < n; i++) y[i] = gate[i] / (1.0f + exp_scalar(-gate[i])) * up[i];
}

/* y = gelu_tanh(gate) * up over n values, GELU's tanh approximation (Gemma's GeGLU):
 * 0.5 g (1 + tanh(u)) with u = sqrt(2/pi) (g + 0.044715 g^3), computed as
 * g / (1 + exp(-2u)), the same function. */
#define GELU_C 0.7978845608028654f
#define GELU_A 0.044715f
static void gelu_tanh_mul_run(const float *gate, const float *up, int64_t n, float *y) {
    int64_t i = 0;
#if VW > 1
    for (; i + VW <= n; i += VW) {
        const vec g = vload(gate + i);
        const vec u = vmul(vset1(-2.0f * GELU_C), vfma(vmul(vset1(GELU_A), vmul(g, g)), g, g));
        vstore(y + i, vmul(vdiv(g, vadd(vset1(1.0f), vexp(u))), vload(up + i)));
    }
#endif
    for (; i < n; i++) {
        const float g = gate[i];
        const float u = -2.0f * GELU_C * (GELU_A * g * g * g + g);
        y[i] = g / (1.0f + exp_scalar(u)) * up[i];
    }
}

void llmrun_silu_mul(const float *gate, const float *up, int64_t n, float *y) {
    IN_RUNS(silu_mul_run, gate, up, n, y);
}

void llmrun_gelu_tanh_mul(const float *gate, const float *up, int64_t n, float *y) {
    IN_RUNS(gelu_tanh_mul_run, gate, up, n, y);
}

/* One token of a Gated DeltaNet layer (Qwen3.5, Qwen3-Next: llmrun/models/qwen3_5.py)
 * for each of `rows` sequences, on the layer's projections of the token, its state
 * updated in place (llmrun/ops.py gated_delta_step):
 *  - the depthwise causal convolution of the channels `mixed` [rows, channels] after
 *    their last kernel - 1 inputs conv_state [rows, channels, kernel - 1] (which then
 *    takes the token's), weights [channels, kernel], then SiLU: the queries and keys
 *    (k_heads heads of dk each) and the values (v_heads of dv);
 *  - queries and keys L2-normalised (x / sqrt(sum x^2 + l2_eps); queries also times
 *    dk^-1/2), each key head serving v_heads / k_heads value heads, grouped (value
 *    head h takes key head h / (v_heads / k_heads)) or tiled (h % k_heads);
 *  - per value head, g = neg_a * softplus(a + dt_bias) and beta = sigmoid(b), and the
 *    delta rule on its state S [dk, dv] (state: [rows, v_heads, dk, dv]):
 *    S = exp(g) S, S += k (beta (v - S^T k))^T, o = S^T q;
 *  - y = rms_norm(o) * norm_weight * silu(z) per head, into y [rows, v_heads * dv].
 * A row whose count is 0 (padding) keeps its states. The torch code's operations,
 * summed in another order. */
void llmrun_gated_delta_step(int64_t rows, const int64_t *counts, const float *mixed,
                             float *conv_state, const float *conv_weight, int64_t channels,
                             int64_t kernel, const float *a, const float *b,
                             const float *neg_a, const float *dt_bias, float *state,
                             int64_t k_heads, int64_t v_heads, int64_t dk, int64_t dv,
                             int tiled, float l2_eps, const float *z,
                             const float *norm_weight, float eps, float *y) {
    float *conv = malloc(sizeof(float) * rows * channels);
    if (conv == NULL) return;
    const int64_t taps = kernel - 1, key_width = k_heads * dk;
    for (int64_t i = 0; i < rows * channels; i++) {
        const int64_t r = i / channels;
        float *inputs = conv_state + i * taps;
        const float *w = conv_weight + (i % channels) * kernel;
        float acc = mixed[i] * w[taps];
        for (int64_t j = 0; j < taps; j++) acc += inputs[j] * w[j];
        conv[i] = acc / (1.0f + exp_scalar(-acc));
        if (counts[r] > 0 && taps > 0) {
            memmove(inputs, inputs + 1, sizeof(float) * (taps - 1));
            inputs[taps - 1] = mixed[i];
        }
    }
    const float q_scale = 1.0f / sqrtf((float)dk);
    for (int64_t i = 0; i < rows * 2 * k_heads; i++) {
        float *x = conv + (i / (2 * k_heads)) * channels + (i % (2 * k_heads)) * dk;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t d = 0; d < dk; d++) sum += x[d] * x[d];
        const float inv = 1.0f / sqrtf(sum + l2_eps) * (i % (2 * k_heads) < k_heads ? q_scale : 1.0f);
#pragma omp simd
        for (int64_t d = 0; d < dk; d++) x[d] *= inv;
    }
#pragma omp parallel for schedule(static) if (rows * v_heads * dk * dv >= (1 << 15))
    for (int64_t i = 0; i < rows * v_heads; i++) {
        const int64_t r = i / v_heads, h = i % v_heads;
        const int64_t kh = tiled ? h % k_heads : h / (v_heads / k_heads);
        const float *q = conv + r * channels + kh * dk;
        const float *k = q + key_width;
        const float *v = conv + r * channels + 2 * key_width + h * dv;
        const float x = a[i] + dt_bias[h];
        const int real = counts[r] > 0;
        const float decay = real ? expf(neg_a[h] * (x > 20.0f ? x : log1pf(expf(x)))) : 1.0f;
        const float beta = real ? 1.0f / (1.0f + expf(-b[i])) : 0.0f;
        float *s = state + i * dk * dv, *o = y + i * dv;
        float recalled[dv];
        memset(recalled, 0, sizeof(recalled));
        for (int64_t d = 0; d < dk; d++) {
            float *row = s + d * dv;
            const float kd = k[d];
#pragma omp simd
            for (int64_t j = 0; j < dv; j++) {
                row[j] *= decay;
                recalled[j] += kd * row[j];
            }
        }
        for (int64_t j = 0; j < dv; j++) recalled[j] = (v[j] - recalled[j]) * beta;
        memset(o, 0, sizeof(float) * dv);
        for (int64_t d = 0; d < dk; d++) {
            float *row = s + d * dv;
            const float kd = k[d], qd = q[d];
#pragma omp simd
            for (int64_t j = 0; j < dv; j++) {
                row[j] += kd * recalled[j];
                o[j] += qd * row[j];
            }
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < dv; j++) sum += o[j] * o[j];
        const float inv = 1.0f / sqrtf(sum / (float)dv + eps);
#pragma omp simd
        for (int64_t j = 0; j < dv; j++) o[j] *= inv * norm_weight[j];
        silu_mul_run(z + i * dv, o, dv, o);
    }
    free(conv);
}

#if VW > 1
/* s = cap * tanh(s / cap) over n scores (Gemma 2's soft-capping), in place:
 * tanh(a) = (1 - e) / (1 + e) with e = exp(-2a), which exp's clamping keeps finite. */
static void softcap_scores(float *s, int64_t n, float cap) {
    int64_t j = 0;
    for (; j + VW <= n; j += VW) {
        const vec e = vexp(vmul(vset1(-2.0f), vdiv(vload(s + j), vset1(cap))));
        const vec one = vset1(1.0f);
        vstore(s + j, vmul(vset1(cap), vdiv(vsub(one, e), vadd(one, e))));
    }
    for (; j < n; j++) {
        const float e = exp_scalar(-2.0f * (s[j] / cap));
        s[j] = cap * ((1.0f - e) / (1.0f + e));
    }
}

/* KV cache storage types (llmrun/models/cache.py), by their GGML type ids: f32, f16,
 * bf16, and Q8_0 rows of blocks of 32 values (an f16 scale d, then 32 int8 q; value
 * d * q). Every stored value converts exactly to f32 (an f16 or bf16 is an f32 with
 * fewer bits; d * q needs 11 + 7 bits), so attending over a stored cache is the f32
 * kernel's arithmetic on the dequantized cache, to the bit. */
enum { KV_F32 = 0, KV_F16 = 1, KV_Q8_0 = 8, KV_BF16 = 30 };
#define KV_BLOCK 32
#define KV_BLOCK_BYTES 34

static inline int64_t kv_row_bytes(int kind, int64_t dim) {
    return kind == KV_F32 ? 4 * dim : kind == KV_Q8_0 ? dim / KV_BLOCK * KV_BLOCK_BYTES : 2 * dim;
}

/* VW stored values from p as f32: f16 by the conversion instruction (F16C, NEON's
 * fcvtl), bf16 by a shift into the high half, int8 by a widening conversion. */
#if defined(__AVX512F__)
static inline float f16_scalar(uint16_t h) { return _cvtsh_ss(h); }
static inline vec load_f16(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
static inline vec load_bf16(const uint8_t *p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
static inline vec load_i8(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline float f16_scalar(uint16_t h) { return _cvtsh_ss(h); }
static inline vec load_f16(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
static inline vec load_bf16(const uint8_t *p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
static inline vec load_i8(const uint8_t *p) { /* 8 bytes: never past a block's end */
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#elif defined(__aarch64__) && defined(__ARM_NEON)
static inline float f16_scalar(uint16_t h) {
    return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0);
}
static inline vec load_f16(const uint8_t *p) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)p)));
}
static inline vec load_bf16(const uint8_t *p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t *)p), 16));
}
static inline vec load_i8(const uint8_t *p) { /* 4 bytes: never past a block's end */
    int32_t w;
    memcpy(&w, p, 4);
    const int16x8_t h = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(w)));
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(h)));
}
#endif

/* `n` consecutive stored rows of `dim` values as f32: the rows themselves for f32,
 * else converted into buf. */
static inline const float *kv_rows(int kind, const uint8_t *src, int64_t n, int64_t dim,
                                   float *buf) {
    if (kind == KV_F32) return (const float *)src;
    const int64_t row = kv_row_bytes(kind, dim);
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *s = src + r * row;
        float *out = buf + r * dim;
        if (kind == KV_F16)
            for (int64_t d = 0; d < dim; d += VW) vstore(out + d, load_f16(s + 2 * d));
        else if (kind == KV_BF16)
            for (int64_t d = 0; d < dim; d += VW) vstore(out + d, load_bf16(s + 2 * d));
        else
            for (int64_t b = 0; b < dim / KV_BLOCK; b++) {
                const uint8_t *block = s + b * KV_BLOCK_BYTES;
                uint16_t h;
                memcpy(&h, block, 2);
                const vec scale = vset1(f16_scalar(h));
                for (int64_t i = 0; i < KV_BLOCK; i += VW)
                    vstore(out + b * KV_BLOCK + i, vmul(load_i8(block + 2 + i), scale));
            }
    }
    return buf;
}

/* y[0 .. dim) += sum over r < n of w[r] * rows[r][0 .. dim): VW * ADD_VECS values of y
 * at a time held in registers over the n rows (a store and a reload of y per row would
 * chain each row's sums through memory), in the order of the rows, so each value of y
 * is summed as one fma after another. */
#define ADD_VECS 8
#define VALUE_ROWS 32
static inline void add_rows(const float *w, const float *rows, int64_t n, int64_t dim,
                            float *y) {
    int64_t d = 0;
    for (; d + ADD_VECS * VW <= dim; d += ADD_VECS * VW) {
        vec acc[ADD_VECS];
        for (int c = 0; c < ADD_VECS; c++) acc[c] = vload(y + d + c * VW);
        for (int64_t r = 0; r < n; r++) {
            const vec wr = vset1(w[r]);
            const float *x = rows + r * dim + d;
            for (int c = 0; c < ADD_VECS; c++) acc[c] = vfma(wr, vload(x + c * VW), acc[c]);
        }
        for (int c = 0; c < ADD_VECS; c++) vstore(y + d + c * VW, acc[c]);
    }
    for (; d < dim; d += VW) {
        vec acc = vload(y + d);
        for (int64_t r = 0; r < n; r++) acc = vfma(vset1(w[r]), vload(rows + r * dim + d), acc);
        vstore(y + d, acc);
    }
}

/* 1 / (sum + exp(sink - top)): a row's softmax denominator with an attention sink's
 * logit joining it (gpt-oss), its terms taken relative to top; computed over the larger
 * of sink and top, so nothing overflows. */
static inline float sink_inverse(float sum, float top, float sink) {
    if (sink > top) {
        const float r = exp_scalar(top - sink);
        return r / (sum * r + 1.0f);
    }
    return 1.0f / (sum + exp_scalar(sink - top));
}

/* One query per head against the first `length` cached keys and values:
 * y[h] = softmax(cap(scale * q[h] . k[g])) . v[g], with g = h / (heads / kv_heads)
 * (GQA) and cap(s) = softcap * tanh(s / softcap), or s where softcap is 0.
 * q and y are [heads, dim] (dim a multiple of VW); k and v hold kv_heads runs of
 * `head_bytes` bytes, each `length` rows of dim values stored as `kind`.
 * The query heads that share a KV head are done together, so each cached row is
 * read from memory once per call, not once per query head (reading the rows is what
 * this costs); a stored type other than f32 is converted once per row, four keys or
 * VALUE_ROWS values at a time, into a buffer that stays in L1. Keys are taken in tiles
 * with a running maximum per head (online softmax), so no scratch grows with the length.
 * This is KV head g's share; the callers run KV heads on the OpenMP team when there
 * is enough work to pay for waking it, each with a constant `kind`. */
#define KEY_TILE 128
static inline __attribute__((always_inline)) void attend_head(
    const int kind, int64_t g, const float *q, const uint8_t *k, const uint8_t *v,
    int64_t heads, int64_t kv_heads, int64_t length, int64_t dim, int64_t head_bytes,
    float scale, float softcap, const float *sinks, float *y, const int32_t *table,
    int64_t block_rows, int64_t block_bytes, int64_t first) {
    const int64_t group = heads / kv_heads, row = kv_row_bytes(kind, dim);
    const uint8_t *kg = k + g * head_bytes, *vg = v + g * head_bytes;
    float *yg = y + g * group * dim;
    float qs[group * dim], p[group][KEY_TILE], top[group], sum[group];
    float kbuf[kind == KV_F32 ? 1 : 4 * dim], vbuf[kind == KV_F32 ? 1 : VALUE_ROWS * dim];
    for (int64_t i = 0; i < group * dim; i++) qs[i] = q[g * group * dim + i] * scale;
    memset(yg, 0, (size_t)(group * dim) * sizeof(float));
    for (int64_t h = 0; h < group; h++) top[h] = -INFINITY, sum[h] = 0.0f;
    for (int64_t j0 = first, tile; j0 < length; j0 += tile) {
        const uint8_t *kt, *vt;
        if (table) { /* paged: a tile is the rest of the block holding position j0 */
            const int64_t in = j0 % block_rows, at = table[j0 / block_rows] * block_bytes;
            tile = length - j0 < block_rows - in ? length - j0 : block_rows - in;
            kt = kg + at + in * row, vt = vg + at + in * row;
        } else {
            tile = length - j0 < KEY_TILE ? length - j0 : KEY_TILE;
            kt = kg + j0 * row, vt = vg + j0 * row;
        }
        int64_t j = 0;
        for (; j + 4 <= tile; j += 4) { /* four keys at a time, summed together */
            const float *k0 = kv_rows(kind, kt + j * row, 4, dim, kbuf);
            for (int64_t h = 0; h < group; h++) {
                const float *qh = qs + h * dim;
                vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
                for (int64_t d = 0; d < dim; d += VW) {
                    const vec qd = vload(qh + d);
                    a0 = vfma(qd, vload(k0 + d), a0);
                    a1 = vfma(qd, vload(k0 + dim + d), a1);
                    a2 = vfma(qd, vload(k0 + 2 * dim + d), a2);
                    a3 = vfma(qd, vload(k0 + 3 * dim + d), a3);
                }
                vsum4(a0, a1, a2, a3, p[h] + j);
            }
        }
        for (; j < tile; j++) {
            const float *kj = kv_rows(kind, kt + j * row, 1, dim, kbuf);
            for (int64_t h = 0; h < group; h++) {
                vec a0 = vzero();
                for (int64_t d = 0; d < dim; d += VW)
                    a0 = vfma(vload(qs + h * dim + d), vload(kj + d), a0);
                p[h][j] = vsum(a0);
            }
        }
        if (softcap > 0.0f)
            for (int64_t h = 0; h < group; h++) softcap_scores(p[h], tile, softcap);
        for (int64_t h = 0; h < group; h++) {
            float *ph = p[h], *yh = yg + h * dim, tile_top = top[h];
            vec most = vset1(tile_top);
            for (j = 0; j + VW <= tile; j += VW) most = vmax(vload(ph + j), most);
            float lanes[VW];
            vstore(lanes, most);
            for (int l = 0; l < VW; l++) tile_top = lanes[l] > tile_top ? lanes[l] : tile_top;
            for (; j < tile; j++) tile_top = ph[j] > tile_top ? ph[j] : tile_top;
            if (tile_top > top[h]) { /* a new maximum: rescale what is summed so far */
                const float rescale = exp_scalar(top[h] - tile_top);
                sum[h] *= rescale;
                for (int64_t d = 0; d < dim; d++) yh[d] *= rescale;
                top[h] = tile_top;
            }
            vec s = vzero();
            for (j = 0; j + VW <= tile; j += VW) {
                const vec e = vexp(vsub(vload(ph + j), vset1(top[h])));
                vstore(ph + j, e);
                s = vadd(s, e);
            }
            sum[h] += vsum(s);
            for (; j < tile; j++) {
                ph[j] = exp_scalar(ph[j] - top[h]);
                sum[h] += ph[j];
            }
        }
        /* y[h] += p[h] . v, VALUE_ROWS value rows at a time (converted once for the
         * group); each head's y in registers over them (add_rows). */
        for (j = 0; j < tile; j += VALUE_ROWS) {
            const int64_t n = tile - j < VALUE_ROWS ? tile - j : VALUE_ROWS;
            const float *vj = kv_rows(kind, vt + j * row, n, dim, vbuf);
            for (int64_t h = 0; h < group; h++) add_rows(p[h] + j, vj, n, dim, yg + h * dim);
        }
    }
    for (int64_t h = 0; h < group; h++) {
        const float inv =
            sinks ? sink_inverse(sum[h], top[h], sinks[g * group + h]) : 1.0f / sum[h];
        for (int64_t d = 0; d < dim; d++) yg[h * dim + d] *= inv;
    }
}

#define ATTEND_HEADS(KIND)                                                               \
    _Pragma("omp parallel for schedule(static) if (heads * length * dim >= (1 << 15))")  \
    for (int64_t g = 0; g < kv_heads; g++)                                               \
        attend_head(KIND, g, q, (const uint8_t *)k, (const uint8_t *)v, heads, kv_heads,   \
                    length, dim, head_bytes, scale, softcap, sinks, y, NULL, 0, 0, 0)

/* head_stride in floats */
void llmrun_attend_one_capped(const float *q, const float *k, const float *v, int64_t heads,
                              int64_t kv_heads, int64_t length, int64_t dim,
                              int64_t head_stride, float scale, float softcap, float *y) {
    const int64_t head_bytes = 4 * head_stride;
    const float *sinks = NULL;
    ATTEND_HEADS(KV_F32);
}

void llmrun_attend_one(const float *q, const float *k, const float *v, int64_t heads,
                       int64_t kv_heads, int64_t length, int64_t dim, int64_t head_stride,
                       float scale, float *y) {
    llmrun_attend_one_capped(q, k, v, heads, kv_heads, length, dim, head_stride, scale, 0.0f, y);
}

/* llmrun_attend_one_capped over a cache stored as `kind` (KV_*), head_bytes apart, and
 * with attention sinks (gpt-oss): sinks[h], a logit of query head h, joins that head's
 * softmax denominator and nothing else (as one more key would, with a value of zeros);
 * NULL for none. -1 for a kind it does not know or a dim it cannot take (Q8_0: a
 * multiple of 32). */
int llmrun_attend_one_sinks(int kind, const float *q, const void *k, const void *v,
                            int64_t heads, int64_t kv_heads, int64_t length, int64_t dim,
                            int64_t head_bytes, float scale, float softcap, const float *sinks,
                            float *y) {
    if (dim % VW != 0 || (kind == KV_Q8_0 && dim % KV_BLOCK != 0)) return -1;
    switch (kind) {
    case KV_F32: ATTEND_HEADS(KV_F32); return 0;
    case KV_F16: ATTEND_HEADS(KV_F16); return 0;
    case KV_BF16: ATTEND_HEADS(KV_BF16); return 0;
    case KV_Q8_0: ATTEND_HEADS(KV_Q8_0); return 0;
    default: return -1;
    }
}

/* A prompt's queries against the cache, causal (flash attention): query row t of
 * `tokens` (at position p = start + t) attends to keys 0 .. p, or with a sliding
 * `window` (0: none) to keys p - window + 1 .. p, query head h to KV head h / (heads /
 * kv_heads), as llmrun_attend_one_stored would take each row alone (sinks: NULL, or an
 * attention sink's logit per query head, gpt-oss's); q and y are [tokens, heads, dim].
 * The rows of a block of tokens times a KV head's query heads (PROMPT_ROWS of them, or a
 * few less) go together against tiles of PROMPT_KEYS keys: both products
 * register-blocked (tile6: 6 rows by 2 vectors, as a GEMM's, for the FMA units), the
 * softmax online and vectorized over the rows (the scores kept transposed, key-major).
 * torch's flash attention ran Qwen2.5-0.5B's heads at about half this speed on Zen 3.
 * Each (block, KV head) is a task of the OpenMP team, the longest first. */
#define PROMPT_KEYS 48       /* keys per tile: a multiple of 6 */
#define PROMPT_ROWS (6 * VW) /* rows of a task: a multiple of 6 and of 2 VW */

/* c[i][0 .. 2 VW) (+)= sum over k < kc of a[i * a_row + k * a_k] * b[k * ldb + 0 .. 2 VW),
 * for i < 6 (add: onto c, else over it) */
static inline __attribute__((always_inline)) void tile6(int64_t kc, const float *a,
                                                        int64_t a_row, int64_t a_k,
                                                        const float *b, int64_t ldb, float *c,
                                                        int64_t ldc, int add) {
    /* named accumulators: with an array, GCC split the loop into one pass per vector */
    vec c00 = vzero(), c01 = vzero(), c10 = vzero(), c11 = vzero(), c20 = vzero(),
        c21 = vzero(), c30 = vzero(), c31 = vzero(), c40 = vzero(), c41 = vzero(),
        c50 = vzero(), c51 = vzero();
    for (int64_t k = 0; k < kc; k++) {
        const vec b0 = vload(b + k * ldb), b1 = vload(b + k * ldb + VW);
        const float *ak = a + k * a_k;
        vec ai = vset1(ak[0]);
        c00 = vfma(ai, b0, c00), c01 = vfma(ai, b1, c01);
        ai = vset1(ak[a_row]);
        c10 = vfma(ai, b0, c10), c11 = vfma(ai, b1, c11);
        ai = vset1(ak[2 * a_row]);
        c20 = vfma(ai, b0, c20), c21 = vfma(ai, b1, c21);
        ai = vset1(ak[3 * a_row]);
        c30 = vfma(ai, b0, c30), c31 = vfma(ai, b1, c31);
        ai = vset1(ak[4 * a_row]);
        c40 = vfma(ai, b0, c40), c41 = vfma(ai, b1, c41);
        ai = vset1(ak[5 * a_row]);
        c50 = vfma(ai, b0, c50), c51 = vfma(ai, b1, c51);
    }
    const vec out[12] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
    for (int i = 0; i < 6; i++) {
        vec lo = out[2 * i], hi = out[2 * i + 1];
        if (add) {
            lo = vadd(lo, vload(c + i * ldc));
            hi = vadd(hi, vload(c + i * ldc + VW));
        }
        vstore(c + i * ldc, lo);
        vstore(c + i * ldc + VW, hi);
    }
}

/* One thread's scratch: qt [dim][rp] (a block's queries, scaled, transposed), o
 * [rp][dim], st [PROMPT_KEYS][rp] (a tile's scores, transposed), top, sum and alpha
 * [rp], kbuf and vbuf [PROMPT_KEYS][dim] (a tile's keys and values as f32). */
typedef struct {
    float *qt, *o, *st, *top, *sum, *alpha, *kbuf, *vbuf;
} prompt_scratch;

/* st[j][r] = value for the keys j0 + j of the tile (nk of them) that row r does not
 * see: past its position, or (window > 0) window or more before it */
static void mask_tile(float *st, int64_t rp, int64_t rows, int64_t group, int64_t first,
                      int64_t window, int64_t j0, int64_t nk, float value) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t past = first + r / group + 1 - j0; /* the row's first hidden key */
        for (int64_t j = past > 0 ? past : 0; j < nk; j++) st[j * rp + r] = value;
        const int64_t seen = window ? past - window : 0; /* its first key in view */
        for (int64_t j = 0; j < (seen < nk ? seen : nk); j++) st[j * rp + r] = value;
    }
}

/* Tokens t0 .. t0 + tb - 1 and KV head g: y of their rows. */
static inline __attribute__((always_inline)) void attend_prompt_block(
    const int kind, int64_t g, int64_t t0, int64_t tb, const float *q, const uint8_t *k,
    const uint8_t *v, int64_t start, int64_t heads, int64_t kv_heads, int64_t dim,
    int64_t head_bytes, float scale, float softcap, int64_t window, const float *sinks,
    int64_t rp, prompt_scratch s, float *y) {
    const int64_t group = heads / kv_heads, rows = tb * group, row = kv_row_bytes(kind, dim);
    const uint8_t *kg = k + g * head_bytes, *vg = v + g * head_bytes;
    memset(s.qt, 0, sizeof(float) * (size_t)(dim * rp)); /* padding rows: finite scores */
    memset(s.o, 0, sizeof(float) * (size_t)(rp * dim));
    for (int64_t r = 0; r < rp; r++) s.top[r] = -INFINITY, s.sum[r] = 0.0f;
    for (int64_t r = 0; r < rows; r++) {
        const float *qr = q + ((t0 + r / group) * heads + g * group + r % group) * dim;
        for (int64_t d = 0; d < dim; d++) s.qt[d * rp + r] = qr[d] * scale;
    }
    /* row r sees keys to first + r / group, from first + r / group - window + 1 on */
    const int64_t first = start + t0, length = first + tb;
    const int64_t from = window && first - window + 1 > 0 ? first - window + 1 : 0;
    for (int64_t j0 = from; j0 < length; j0 += PROMPT_KEYS) {
        const int64_t nk = length - j0 < PROMPT_KEYS ? length - j0 : PROMPT_KEYS;
        const int64_t nk6 = (nk + 5) / 6 * 6;
        const float *kt = (const float *)(kg + j0 * row), *vt = (const float *)(vg + j0 * row);
        if (kind != KV_F32 || nk6 != nk) { /* keys as f32, in whole tiles of 6 */
            kt = kv_rows(kind, kg + j0 * row, nk, dim, s.kbuf);
            if (kt != s.kbuf) memcpy(s.kbuf, kt, sizeof(float) * (size_t)(nk * dim));
            memset(s.kbuf + nk * dim, 0, sizeof(float) * (size_t)((nk6 - nk) * dim));
            kt = s.kbuf;
        }
        if (kind != KV_F32) vt = kv_rows(kind, vg + j0 * row, nk, dim, s.vbuf);
        for (int64_t j = 0; j < nk6; j += 6) /* st[j][r] = k_j . q_r */
            for (int64_t r = 0; r < rp; r += 2 * VW)
                tile6(dim, kt + j * dim, dim, 1, s.qt + r, rp, s.st + j * rp + r, rp, 0);
        if (softcap > 0.0f) softcap_scores(s.st, nk * rp, softcap);
        /* the tile reaches past some row's position, or before some row's window */
        const int past = j0 + nk - 1 > first || (window && j0 < length - window);
        if (past) mask_tile(s.st, rp, rows, group, first, window, j0, nk, -INFINITY);
        for (int64_t r = 0; r < rp; r += VW) {
            vec most = vset1(-INFINITY);
            for (int64_t j = 0; j < nk; j++) most = vmax(most, vload(s.st + j * rp + r));
            /* every row sees a key of the first tile (a window starts within the block's
             * first tb keys from `from`): top is finite from the first tile on */
            const vec before = vload(s.top + r), now = vmax(before, most);
            const vec alpha = j0 == from ? vzero() : vexp(vsub(before, now));
            vec sum = vmul(vload(s.sum + r), alpha);
            for (int64_t j = 0; j < nk; j++) {
                const vec p = vexp(vsub(vload(s.st + j * rp + r), now));
                vstore(s.st + j * rp + r, p);
                sum = vadd(sum, p);
            }
            vstore(s.top + r, now);
            vstore(s.sum + r, sum);
            vstore(s.alpha + r, alpha);
        }
        /* vexp clamps: a masked score's exp(-87) joined the sum (below its last bit: a
         * row's sum is at least 1), and is 0 for the values */
        if (past) mask_tile(s.st, rp, rows, group, first, window, j0, nk, 0.0f);
        if (j0 > from)
            for (int64_t r = 0; r < rp; r++) {
                if (s.alpha[r] == 1.0f) continue; /* the row's maximum stayed */
                const vec alpha = vset1(s.alpha[r]);
                for (int64_t d = 0; d < dim; d += VW)
                    vstore(s.o + r * dim + d, vmul(vload(s.o + r * dim + d), alpha));
            }
        for (int64_t r = 0; r < rp; r += 6) /* o[r] += sum over j of p[j][r] v_j */
            for (int64_t d = 0; d < dim; d += 2 * VW)
                tile6(nk, s.st + r, 1, rp, vt + d, dim, s.o + r * dim + d, dim, 1);
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t h = g * group + r % group;
        float *yr = y + ((t0 + r / group) * heads + h) * dim;
        const float scale_r = sinks ? sink_inverse(s.sum[r], s.top[r], sinks[h]) : 1.0f / s.sum[r];
        const vec inv = vset1(scale_r);
        for (int64_t d = 0; d < dim; d += VW) vstore(yr + d, vmul(vload(s.o + r * dim + d), inv));
    }
}

#define PROMPT_BLOCK(KIND)                                                               \
    attend_prompt_block(KIND, g, t0, n, q, (const uint8_t *)k, (const uint8_t *)v, start, \
                        heads, kv_heads, dim, head_bytes, scale, softcap, window, sinks, rp, \
                        s, y)

/* -1, computing nothing, for a kind it does not know, a dim it cannot take (a multiple
 * of 2 VW; Q8_0: of 32 too), a negative window or no memory for its scratch. */
int llmrun_attend_prompt(int kind, const float *q, const void *k, const void *v,
                         int64_t tokens, int64_t start, int64_t heads, int64_t kv_heads,
                         int64_t dim, int64_t head_bytes, float scale, float softcap,
                         int64_t window, const float *sinks, float *y) {
    if (dim % (2 * VW) != 0 || (kind == KV_Q8_0 && dim % KV_BLOCK != 0) || tokens < 1 ||
        start < 0 || kv_heads < 1 || heads % kv_heads != 0 || window < 0)
        return -1;
    if (kind != KV_F32 && kind != KV_F16 && kind != KV_BF16 && kind != KV_Q8_0) return -1;
    const int64_t group = heads / kv_heads;
    const int64_t tb = PROMPT_ROWS / group > 0 ? PROMPT_ROWS / group : 1;
    const int64_t rp = (tb * group + PROMPT_ROWS - 1) / PROMPT_ROWS * PROMPT_ROWS;
    const int64_t blocks = (tokens + tb - 1) / tb, tasks = blocks * kv_heads;
    const size_t floats = (size_t)(2 * dim * rp + PROMPT_KEYS * rp + 3 * rp + 2 * PROMPT_KEYS * dim);
    int failed = 0;
#pragma omp parallel
    {
        float *mem = malloc(sizeof(float) * floats);
        if (mem == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        int stop;
#pragma omp atomic read
        stop = failed;
        if (!stop) {
            prompt_scratch s;
            s.qt = mem, s.o = s.qt + dim * rp, s.st = s.o + rp * dim;
            s.top = s.st + PROMPT_KEYS * rp, s.sum = s.top + rp, s.alpha = s.sum + rp;
            s.kbuf = s.alpha + rp, s.vbuf = s.kbuf + PROMPT_KEYS * dim;
#pragma omp for schedule(dynamic)
            for (int64_t i = 0; i < tasks; i++) {
                const int64_t b = blocks - 1 - i / kv_heads, g = i % kv_heads; /* longest first */
                const int64_t t0 = b * tb, n = tokens - t0 < tb ? tokens - t0 : tb;
                switch (kind) {
                case KV_F32: PROMPT_BLOCK(KV_F32); break;
                case KV_F16: PROMPT_BLOCK(KV_F16); break;
                case KV_BF16: PROMPT_BLOCK(KV_BF16); break;
                default: PROMPT_BLOCK(KV_Q8_0); break;
                }
            }
        }
        free(mem);
    }
    return failed ? -1 : 0;
}

/* KV head g's share of llmrun_attend_one_sinks over keys first .. length - 1, on the
 * calling thread (the decode step runs the heads on its own team); with a block table
 * (not NULL), of a paged cache as llmrun_attend_paged reads it. -1 as there. */
int llmrun_attend_kv_head(int kind, int64_t g, const float *q, const void *k, const void *v,
                          const int32_t *table, int64_t block_rows, int64_t block_bytes,
                          int64_t first, int64_t length, int64_t heads, int64_t kv_heads,
                          int64_t dim, int64_t head_bytes, float scale, float softcap,
                          const float *sinks, float *y) {
    if (dim % VW != 0 || (kind == KV_Q8_0 && dim % KV_BLOCK != 0)) return -1;
    if (first < 0 || first >= length || (table && (block_rows < 1 || block_rows > KEY_TILE)))
        return -1;
#define ATTEND_ONE_HEAD(KIND)                                                            \
    attend_head(KIND, g, q, (const uint8_t *)k, (const uint8_t *)v, heads, kv_heads, length, \
                dim, head_bytes, scale, softcap, sinks, y, table, block_rows, block_bytes, first)
    switch (kind) {
    case KV_F32: ATTEND_ONE_HEAD(KV_F32); return 0;
    case KV_F16: ATTEND_ONE_HEAD(KV_F16); return 0;
    case KV_BF16: ATTEND_ONE_HEAD(KV_BF16); return 0;
    case KV_Q8_0: ATTEND_ONE_HEAD(KV_Q8_0); return 0;
    default: return -1;
    }
#undef ATTEND_ONE_HEAD
}

/* llmrun_attend_one_sinks without sinks. */
int llmrun_attend_one_stored(int kind, const float *q, const void *k, const void *v,
                             int64_t heads, int64_t kv_heads, int64_t length, int64_t dim,
                             int64_t head_bytes, float scale, float softcap, float *y) {
    return llmrun_attend_one_sinks(kind, q, k, v, heads, kv_heads, length, dim, head_bytes,
                                   scale, softcap, NULL, y);
}

/* llmrun_attend_one_stored over a paged cache: keys first .. length - 1 (first > 0: a
 * sliding window), position p in row p % block_rows of pool block table[p / block_rows].
 * k and v are one layer's pool of `blocks` blocks, block_bytes apart, each kv_heads runs
 * of head_bytes bytes (block_rows rows as `kind`). -1 as llmrun_attend_one_stored, or
 * for block_rows over KEY_TILE, an empty range or a table entry it reads outside the
 * pool. */
#define ATTEND_PAGED(KIND)                                                               \
    _Pragma("omp parallel for schedule(static) if (heads * (length - first) * dim >= (1 << 15))") \
    for (int64_t g = 0; g < kv_heads; g++)                                               \
        attend_head(KIND, g, q, (const uint8_t *)k, (const uint8_t *)v, heads, kv_heads,   \
                    length, dim, head_bytes, scale, softcap, NULL, y, table, block_rows, \
                    block_bytes, first)

int llmrun_attend_paged(int kind, const float *q, const void *k, const void *v,
                        const int32_t *table, int64_t blocks, int64_t block_rows,
                        int64_t block_bytes, int64_t first, int64_t length, int64_t heads,
                        int64_t kv_heads, int64_t dim, int64_t head_bytes, float scale,
                        float softcap, float *y) {
    if (dim % VW != 0 || (kind == KV_Q8_0 && dim % KV_BLOCK != 0)) return -1;
    if (block_rows < 1 || block_rows > KEY_TILE || first < 0 || first >= length) return -1;
    for (int64_t j = first / block_rows; j <= (length - 1) / block_rows; j++)
        if (table[j] < 0 || table[j] >= blocks) return -1;
    switch (kind) {
    case KV_F32: ATTEND_PAGED(KV_F32); return 0;
    case KV_F16: ATTEND_PAGED(KV_F16); return 0;
    case KV_BF16: ATTEND_PAGED(KV_BF16); return 0;
    case KV_Q8_0: ATTEND_PAGED(KV_Q8_0); return 0;
    default: return -1;
    }
}
#endif /* without vectors, the kernel files report llmrun_available() == 0 */
