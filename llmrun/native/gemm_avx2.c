/* The exact f32 GEMM for a prompt's rows, AVX2: y = x W^T (+ bias) with W in any type
 * the family dequantizes, for more activation rows than a matvec pass takes.
 *
 * The layout of a register-blocked GEMM (as BLIS and GotoBLAS lay it out): a 6 x 16
 * tile of y is 12 accumulators of 8 floats, and each step over k loads 16 weights (two
 * vectors) and broadcasts 6 activations, 12 multiply-adds for 8 loads, so the two FMA
 * units run without waiting on the load ports. The activations are copied once per
 * call into panels of 6 rows, k-major; the weights, GEMM_NB rows at a time per
 * thread, into panels of 16 rows, k-major, in blocks of GEMM_KC columns (a panel of
 * 16 KB that stays in L1 while every activation panel goes by). F16, BF16 and F32
 * weights are converted as they are copied; any other type is dequantized first, 16
 * rows at a time, by the family's llmrun_dequantize (in its scalar part of the team:
 * a nested parallel region runs on the calling thread). Each weight is read from
 * memory and converted once per call; before this, a prompt dequantized tiles of
 * 4M weights to f32 in memory and handed them to torch's GEMM (MKL), which copied them
 * into its own panels; on Zen 3 this ran the Qwen2.5-0.5B shapes at 1.0-1.5x MKL's speed,
 * near the cores' multiply-add peak (benchmarks/README.md).
 *
 * The sums are f32 multiply-adds in k order within a block of GEMM_KC columns, the
 * blocks added in order: the same products as the matvec, summed in another order.
 */
#include "common.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#define GEMM_MR 6    /* activation rows of a tile */
#define GEMM_NR 16   /* weight rows of a tile */
#define GEMM_KC 256  /* columns of a block: a weight panel of 16 KB */
#define GEMM_MC 16   /* activation panels (of GEMM_MR rows) per pass over a weight block */
#define GEMM_NB 128  /* weight rows a thread takes at a time, at most */

int llmrun_block(int type);
int llmrun_dequantize(int type, const uint8_t *w, int64_t stride, int64_t rows, int64_t n,
                      float *out);

/* The 6 x 16 tile of y at c (rows ldc apart) from an activation panel a and a weight
 * panel b, kc columns each: y += their products with `add`, else y = them. */
ALWAYS_INLINE void tile(int64_t kc, const float *a, const float *b, float *c, int64_t ldc,
                        int add) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
           c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (int64_t k = 0; k < kc; k++, a += GEMM_MR, b += GEMM_NR) {
        const __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
        __m256 a0 = _mm256_broadcast_ss(a), a1 = _mm256_broadcast_ss(a + 1);
        c00 = _mm256_fmadd_ps(a0, b0, c00);
        c01 = _mm256_fmadd_ps(a0, b1, c01);
        c10 = _mm256_fmadd_ps(a1, b0, c10);
        c11 = _mm256_fmadd_ps(a1, b1, c11);
        a0 = _mm256_broadcast_ss(a + 2);
        a1 = _mm256_broadcast_ss(a + 3);
        c20 = _mm256_fmadd_ps(a0, b0, c20);
        c21 = _mm256_fmadd_ps(a0, b1, c21);
        c30 = _mm256_fmadd_ps(a1, b0, c30);
        c31 = _mm256_fmadd_ps(a1, b1, c31);
        a0 = _mm256_broadcast_ss(a + 4);
        a1 = _mm256_broadcast_ss(a + 5);
        c40 = _mm256_fmadd_ps(a0, b0, c40);
        c41 = _mm256_fmadd_ps(a0, b1, c41);
        c50 = _mm256_fmadd_ps(a1, b0, c50);
        c51 = _mm256_fmadd_ps(a1, b1, c51);
    }
    __m256 out[12] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
    for (int i = 0; i < GEMM_MR; i++) {
        float *p = c + i * ldc;
        if (add) {
            out[2 * i] = _mm256_add_ps(out[2 * i], _mm256_loadu_ps(p));
            out[2 * i + 1] = _mm256_add_ps(out[2 * i + 1], _mm256_loadu_ps(p + 8));
        }
        _mm256_storeu_ps(p, out[2 * i]);
        _mm256_storeu_ps(p + 8, out[2 * i + 1]);
    }
}

/* the 8 x 8 floats r[0..7] transposed in place */
ALWAYS_INLINE void transpose8(__m256 *r) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
    r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
    r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
    r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
    r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

/* 8 values of a row of `type` (F16, BF16 or F32) from column k on, as f32 */
ALWAYS_INLINE __m256 load8(int type, const uint8_t *row, int64_t k) {
    if (type == F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * k)));
    if (type == BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 2 * k))), 16));
    return _mm256_loadu_ps((const float *)(row + 4 * k));
}

/* out[k, r] = W[r, k0 + k] for a panel of `rows` (<= 16) weight rows `ld` bytes apart,
 * k < kc (a multiple of 8); rows past `rows` are zeros. */
static void pack_weights(int type, const uint8_t *w, int64_t ld, int64_t rows, int64_t k0,
                         int64_t kc, float *out) {
    for (int half = 0; half < 2; half++)
        for (int64_t k = 0; k < kc; k += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++) {
                const int64_t row = half * 8 + i;
                r[i] = row < rows ? load8(type, w + row * ld, k0 + k) : _mm256_setzero_ps();
            }
            transpose8(r);
            for (int i = 0; i < 8; i++) _mm256_store_ps(out + (k + i) * GEMM_NR + half * 8, r[i]);
        }
}

/* out[k, i] = x[i, k0 + k] for a panel of `rows` (<= 6) activation rows of length n,
 * k < kc (a multiple of 8); rows past `rows` are zeros. */
static void pack_activations(const float *x, int64_t n, int64_t rows, int64_t k0, int64_t kc,
                             float *out) {
    for (int64_t k = 0; k < kc; k += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; i++)
            r[i] = i < rows ? _mm256_loadu_ps(x + i * n + k0 + k) : _mm256_setzero_ps();
        transpose8(r);
        /* 4 + 2 floats: AMD's masked stores are microcoded, several times slower */
        for (int i = 0; i < 8; i++) {
            float *dst = out + (k + i) * GEMM_MR;
            _mm_storeu_ps(dst, _mm256_castps256_ps128(r[i]));
            _mm_storel_pi((__m64 *)(dst + 4), _mm256_extractf128_ps(r[i], 1));
        }
    }
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* One thread's block of weight rows j0 .. j0 + nb - 1: packed into bp (nb rounded up to
 * 16 rows, times n), then every activation panel against it. */
static void weight_block(int type, const uint8_t *w, int64_t stride, int64_t rows,
                         const float *ap, int64_t m, int64_t n, float *y, const float *bias,
                         int64_t j0, int64_t nb, float *bp, float *deq) {
    const int direct = type == F16 || type == BF16 || type == F32;
    const int64_t nbp = (nb + GEMM_NR - 1) / GEMM_NR * GEMM_NR, panels = (m + GEMM_MR - 1) / GEMM_MR;
    for (int64_t r = 0; r < nb; r += GEMM_NR) {
        const int64_t pr = min64(GEMM_NR, nb - r);
        const uint8_t *src = w + (j0 + r) * stride;
        int64_t ld = stride;
        if (!direct) {
            llmrun_dequantize(type, src, stride, pr, n, deq);
            src = (const uint8_t *)deq;
            ld = 4 * n;
        }
        for (int64_t k0 = 0; k0 < n; k0 += GEMM_KC)
            pack_weights(direct ? type : F32, src, ld, pr, k0, min64(GEMM_KC, n - k0),
                         bp + k0 * nbp + r * min64(GEMM_KC, n - k0));
    }
    float part[GEMM_MR * GEMM_NR] __attribute__((aligned(32)));
    for (int64_t k0 = 0; k0 < n; k0 += GEMM_KC) {
        const int64_t kc = min64(GEMM_KC, n - k0);
        const float *apk = ap + k0 * panels * GEMM_MR, *bpk = bp + k0 * nbp;
        for (int64_t i0 = 0; i0 < panels; i0 += GEMM_MC)
            for (int64_t jr = 0; jr < nb; jr += GEMM_NR)
                for (int64_t i = i0; i < min64(i0 + GEMM_MC, panels); i++) {
                    float *c = y + i * GEMM_MR * rows + j0 + jr;
                    const int64_t tr = min64(GEMM_MR, m - i * GEMM_MR), tc = min64(GEMM_NR, nb - jr);
                    if (tr == GEMM_MR && tc == GEMM_NR) {
                        tile(kc, apk + i * kc * GEMM_MR, bpk + jr * kc, c, rows, k0 > 0);
                        continue;
                    }
                    tile(kc, apk + i * kc * GEMM_MR, bpk + jr * kc, part, GEMM_NR, 0);
                    for (int64_t a = 0; a < tr; a++)
                        for (int64_t b = 0; b < tc; b++)
                            c[a * rows + b] = (k0 > 0 ? c[a * rows + b] : 0.0f) + part[a * GEMM_NR + b];
                }
    }
    if (bias != NULL)
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = j0; j < j0 + nb; j++) y[i * rows + j] += bias[j];
}

/* y[i, r] = sum_k W[r, k] x[i, k] (+ bias[r]), as llmrun_matvec, for any m. Returns -1,
 * computing nothing, for a type it cannot dequantize, n not a multiple of 8, or no
 * memory for its panels. */
int llmrun_gemm_f32(int type, const uint8_t *w, int64_t stride, int64_t rows, const float *x,
                    int64_t m, int64_t n, float *y, const float *bias) {
    const int direct = type == F16 || type == BF16 || type == F32;
    if (n % 8 != 0 || m <= 0 || rows <= 0 || (!direct && llmrun_block(type) == 0)) return -1;
    const int64_t panels = (m + GEMM_MR - 1) / GEMM_MR;
    float *ap = aligned_alloc(32, sizeof(float) * (size_t)(panels * GEMM_MR * n));
    if (ap == NULL) return -1;
    const int64_t blocks_k = (n + GEMM_KC - 1) / GEMM_KC;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t p = 0; p < blocks_k; p++)
        for (int64_t i = 0; i < panels; i++) {
            const int64_t k0 = p * GEMM_KC, kc = min64(GEMM_KC, n - k0);
            pack_activations(x + i * GEMM_MR * n, n, min64(GEMM_MR, m - i * GEMM_MR), k0, kc,
                             ap + k0 * panels * GEMM_MR + i * kc * GEMM_MR);
        }
    /* blocks of weight rows, a multiple of the threads in number, of equal size */
    const int64_t threads = omp_get_max_threads();
    int64_t blocks = (rows + GEMM_NB - 1) / GEMM_NB;
    blocks = (blocks + threads - 1) / threads * threads;
    const int64_t nb = ((rows + blocks - 1) / blocks + GEMM_NR - 1) / GEMM_NR * GEMM_NR;
    blocks = (rows + nb - 1) / nb;
    int failed = 0;
#pragma omp parallel
    {
        float *bp = aligned_alloc(32, sizeof(float) * (size_t)(nb * n));
        float *deq = direct ? NULL : malloc(sizeof(float) * (size_t)(GEMM_NR * n));
        if (bp == NULL || (!direct && deq == NULL)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        int stop;
#pragma omp atomic read
        stop = failed;
        if (!stop) {
#pragma omp for schedule(dynamic)
            for (int64_t j = 0; j < blocks; j++)
                weight_block(type, w, stride, rows, ap, m, n, y, bias, j * nb,
                             min64(nb, rows - j * nb), bp, deq);
        }
        free(bp);
        free(deq);
    }
    free(ap);
    return failed ? -1 : 0;
}
#endif
