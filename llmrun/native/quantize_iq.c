/* Quantizing f32 rows to the i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
 * IQ3_S, IQ4_NL, IQ4_XS) and the ternary types (TQ1_0, TQ2_0), byte-identical to ggml's
 * ggml_quantize_chunk (ggml-quants.c: quantize_iq*, quantize_tq*), with or without an
 * importance row, for `llmrun quantize` (llmrun/quant/quantize_iq.py).
 *
 * Bit-exactness needs the same float operations in the same order: this file is built with
 * -ffp-contract=off (build.py's FLAGS), and every sum runs in ggml's order, its quirks
 * included (IQ3_S's packing cursor stays put over an all-zero sub-block; IQ1's sorts are
 * libc's qsort with ggml's comparator, so ties fall as they fall there).
 *
 * The lattice types pick each group of 8 (or 4) weights from a grid of points. The grids
 * come from llmrun_quantize_iq_grids as ggml's kgrid tables (each point's coordinates as
 * 2- or 3-bit indices), which llmrun derives from gguf's decoding grids; from them each
 * type's lattice (point coordinates 2l+1, the map from any coordinates to its grid point,
 * and for the coordinates off the grid the grid points nearest to them) is built once, under
 * a lock, before the first rows of that type (ggml's iq2xs_init_impl, iq3xs_init_impl).
 *
 * llmrun_quantize_iq(type, src, dst, rows, n_per_row, imatrix, threads) quantizes rows of
 * f32 on `threads` OpenMP threads, each row with the importance row `imatrix` (n_per_row
 * values, NULL for none), and returns the bytes written, or -1 for a type, row length or
 * missing grid or importance row it cannot take.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum {
    T_IQ2_XXS = 16,
    T_IQ2_XS = 17,
    T_IQ3_XXS = 18,
    T_IQ1_S = 19,
    T_IQ4_NL = 20,
    T_IQ3_S = 21,
    T_IQ2_S = 22,
    T_IQ4_XS = 23,
    T_IQ1_M = 29,
    T_TQ1_0 = 34,
    T_TQ2_0 = 35
};

#define QK_K 256
#define QK4_NL 32
#define EPS 1e-15f
#define EPS_IQ3_XXS 1e-8f
#define EPS_IQ2_S 1e-8f
#define EPS_IQ1_M 1e-7f
#define EPS_IQ1_S 1e-12f
#define IQ1_DELTA 0.125f

static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1,    13,   25,  38,  53,  69,  89,  113};

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

/* f32 -> f16 as ggml converts (round to nearest even; the same code as quantize.c's) */
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

static inline void put_f16(uint8_t *p, float f) {
    const uint16_t h = to_f16(f);
    memcpy(p, &h, 2);
}

/* round to nearest (ties to even) for |v| < 2^22: ggml's nearest_int */
static inline int nearest(float v) {
    const uint32_t u = bits_of(v + 12582912.f);
    return (int)(u & 0x007fffffu) - 0x00400000;
}

static inline int imin(int a, int b) { return a < b ? a : b; }
static inline int imax(int a, int b) { return a > b ? a : b; }
static inline float larger(float a, float b) { return a > b ? a : b; } /* ggml's MAX */

/* ---- the lattices ---- */

typedef struct {
    int width; /* coordinates per point: 8 (IQ1, IQ2) or 4 (IQ3) */
    int bits; /* bits per coordinate index in the kgrid table and the map's key */
    int size; /* grid points */
    int nwant; /* distinct distances whose points make a neighbour list */
    int map_size; /* keys of the map */
    int8_t *grid; /* [size][width]: 2l+1 per coordinate */
    int *map; /* key -> grid point, or -(offset + 1) of its neighbour list */
    uint16_t *neighbours; /* per key off the grid: a count, then the points */
} lattice_t;

enum { L_IQ2_XXS, L_IQ2_XS, L_IQ2_S, L_IQ1, L_IQ3_XXS, L_IQ3_S, N_LATTICES };
/* each lattice's shape, its tables built at its first use */
static const lattice_t LATTICE_SHAPE[N_LATTICES] = {
    {8, 2, 256, 2, 43692, NULL, NULL, NULL},  {8, 2, 512, 2, 43692, NULL, NULL, NULL},
    {8, 2, 1024, 1, 43692, NULL, NULL, NULL}, {8, 2, 2048, 3, 43692, NULL, NULL, NULL},
    {4, 3, 256, 2, 4096, NULL, NULL, NULL},   {4, 3, 512, 3, 4096, NULL, NULL, NULL},
};
static const uint16_t *kgrids[N_LATTICES];
static lattice_t lattices[N_LATTICES];
static pthread_mutex_t lattice_lock = PTHREAD_MUTEX_INITIALIZER;

/* The kgrid tables (which must outlive the first use of each type), in the enum's order. */
void llmrun_quantize_iq_grids(const uint16_t *iq2xxs, const uint16_t *iq2xs, const uint16_t *iq2s,
                              const uint16_t *iq1s, const uint16_t *iq3xxs, const uint16_t *iq3s) {
    pthread_mutex_lock(&lattice_lock);
    const uint16_t *given[N_LATTICES] = {iq2xxs, iq2xs, iq2s, iq1s, iq3xxs, iq3s};
    memcpy(kgrids, given, sizeof(given));
    pthread_mutex_unlock(&lattice_lock);
}

/* The grid points of the key's `nwant` smallest squared distances, by distance then index
 * (the order of ggml's sorted list), into `out` (room for 3 * size); returns how many.
 * `columns` holds the grid's coordinates a coordinate at a time, so the distances vectorize. */
static int nearest_points(const lattice_t *g, const int16_t *columns, int key, int *distance,
                          uint16_t *out) {
    const int mask = (1 << g->bits) - 1;
    for (int j = 0; j < g->size; j++) distance[j] = 0;
    for (int k = 0; k < g->width; k++) {
        const int16_t *column = columns + k * g->size;
        const int pos = 2 * ((key >> g->bits * k) & mask) + 1;
        for (int j = 0; j < g->size; j++) distance[j] += (column[j] - pos) * (column[j] - pos);
    }
    int levels[3], nlevels = 0; /* the smallest distinct distances, ascending */
    for (int j = 0; j < g->size; j++) {
        const int d2 = distance[j];
        int at = nlevels;
        while (at > 0 && levels[at - 1] > d2) at--;
        if ((at > 0 && levels[at - 1] == d2) || at == g->nwant) continue;
        for (int m = imin(nlevels, g->nwant - 1); m > at; m--) levels[m] = levels[m - 1];
        levels[at] = d2;
        nlevels = imin(nlevels + 1, g->nwant);
    }
    /* by level, each in index order: the first level straight into out, the others beside */
    uint16_t *at_level[3] = {out, out + g->size, out + 2 * g->size};
    int count[3] = {0, 0, 0};
    for (int j = 0; j < g->size; j++) {
        const int d2 = distance[j];
        if (d2 > levels[nlevels - 1]) continue;
        const int level = d2 == levels[0] ? 0 : d2 == levels[1] ? 1 : 2;
        at_level[level][count[level]++] = (uint16_t)j;
    }
    for (int level = 1; level < nlevels; level++) {
        memmove(out + count[0], at_level[level], count[level] * sizeof(uint16_t));
        count[0] += count[level];
    }
    return count[0];
}

static int build_lattice(int which) {
    lattice_t g = LATTICE_SHAPE[which];
    const uint16_t *kgrid = kgrids[which];
    const int mask = (1 << g.bits) - 1;
    g.grid = malloc((size_t)g.size * g.width);
    g.map = malloc((size_t)g.map_size * sizeof(int));
    int16_t *columns = malloc((size_t)g.size * g.width * sizeof(int16_t));
    uint16_t **lists = calloc((size_t)g.map_size, sizeof(uint16_t *));
    int ok = g.grid && g.map && columns && lists;
    if (!ok) goto done;
    for (int j = 0; j < g.size; j++)
        for (int k = 0; k < g.width; k++) {
            g.grid[j * g.width + k] = (int8_t)(2 * ((kgrid[j] >> g.bits * k) & mask) + 1);
            columns[k * g.size + j] = g.grid[j * g.width + k];
        }
    for (int i = 0; i < g.map_size; i++) g.map[i] = -1;
    for (int j = 0; j < g.size && ok; j++) {
        ok = kgrid[j] < g.map_size;
        if (ok) g.map[kgrid[j]] = j;
    }
    if (!ok) goto done;
    /* each key off the grid: its list (a count, then the points), then all in key order */
#pragma omp parallel
    {
        int *distance = malloc((size_t)g.size * sizeof(int));
        uint16_t *found = malloc((size_t)(3 * g.size + 1) * sizeof(uint16_t));
#pragma omp for schedule(dynamic, 64)
        for (int i = 0; i < g.map_size; i++) {
            if (g.map[i] >= 0 || !distance || !found) continue;
            const int n = nearest_points(&g, columns, i, distance, found + 1);
            found[0] = (uint16_t)n;
            if ((lists[i] = malloc((size_t)(n + 1) * sizeof(uint16_t))))
                memcpy(lists[i], found, (size_t)(n + 1) * sizeof(uint16_t));
        }
        free(distance);
        free(found);
    }
    size_t total = 0;
    for (int i = 0; i < g.map_size && ok; i++) {
        if (g.map[i] >= 0) continue;
        ok = lists[i] != NULL;
        if (ok) total += 1 + lists[i][0];
    }
    if (ok) ok = (g.neighbours = malloc(total * sizeof(uint16_t))) != NULL;
    for (size_t offset = 0, i = 0; ok && i < (size_t)g.map_size; i++) {
        if (g.map[i] >= 0) continue;
        memcpy(g.neighbours + offset, lists[i], (1 + (size_t)lists[i][0]) * sizeof(uint16_t));
        g.map[i] = -(int)(offset + 1);
        offset += 1 + lists[i][0];
    }
done:
    if (lists)
        for (int i = 0; i < g.map_size; i++) free(lists[i]);
    free(lists);
    free(columns);
    if (ok) {
        lattices[which] = g;
    } else {
        free(g.grid);
        free(g.map);
        free(g.neighbours);
    }
    return ok;
}

/* the type's lattice, built at its first use; NULL before the grids are handed over */
static const lattice_t *lattice(int which) {
    pthread_mutex_lock(&lattice_lock);
    if (!lattices[which].grid && kgrids[which]) build_lattice(which);
    const lattice_t *g = lattices[which].grid ? &lattices[which] : NULL;
    pthread_mutex_unlock(&lattice_lock);
    return g;
}

static inline int key_of(const lattice_t *g, const int8_t *L) {
    int u = 0;
    for (int i = 0; i < g->width; i++) u |= L[i] << g->bits * i;
    return u;
}

/* The listed neighbour of an off-grid key nearest (by weighted distance) to xval at
 * `scale`; its coordinates into L (iq2_find_best_neighbour, iq3_find_best_neighbour). */
static int best_neighbour(const lattice_t *g, int key, const float *xval, const float *weight,
                          float scale, int8_t *L) {
    const uint16_t *list = g->neighbours - g->map[key] - 1;
    float best_d2 = FLT_MAX;
    int index = -1;
    for (int j = 1; j <= list[0]; j++) {
        const int8_t *pg = g->grid + list[j] * g->width;
        float d2 = 0;
        for (int i = 0; i < g->width; i++) {
            const float q = pg[i];
            const float diff = scale * q - xval[i];
            d2 += weight[i] * diff * diff;
        }
        if (d2 < best_d2) {
            best_d2 = d2;
            index = list[j];
        }
    }
    const int8_t *pg = g->grid + index * g->width;
    for (int i = 0; i < g->width; i++) L[i] = (int8_t)((pg[i] - 1) / 2);
    return index;
}

/* The grid point for the coordinates nearest xval/scale, its coordinates into L. */
static int grid_point(const lattice_t *g, int kmaxq, float id, const float *xval, const float *waux,
                      float scale, int8_t *L) {
    for (int i = 0; i < g->width; i++)
        L[i] = (int8_t)imax(0, imin(kmaxq - 1, nearest(0.5f * (id * xval[i] - 1))));
    const int key = key_of(g, L);
    return g->map[key] >= 0 ? g->map[key] : best_neighbour(g, key, xval, waux, scale, L);
}

static void weighted_sums(int n, const float *weight, const float *xval, const int8_t *L,
                          float *sumqx, float *sumq2) {
    float qx = 0, q2 = 0;
    for (int i = 0; i < n; i++) {
        const float w = weight[i];
        const float q = 2 * L[i] + 1;
        qx += w * xval[i] * q;
        q2 += w * q * q;
    }
    *sumqx = qx;
    *sumq2 = q2;
}

enum { REFIT_ALWAYS, REFIT_OFF_GRID, REFIT_ALL_IF_OFF_GRID };

/* The scale of n weights xval (|x|) on the lattice and their points' coordinates in L: the
 * best of the trial scales (2kmaxq-1 + is*step)/max for |is| <= trials, then the groups
 * off the grid (or all, by `refit`) placed again at that scale and the scale refitted.
 * `scale` and `on_grid` start as the caller's ggml function starts them. */
static float lattice_fit(const lattice_t *g, int n, int kmaxq, const float *xval,
                         const float *weight, const float *waux, float max, float scale, int trials,
                         float step, bool on_grid, int refit, int8_t *L) {
    const int groups = n / g->width;
    int8_t Laux[32];
    bool is_on_grid[8] = {0}, is_on_grid_aux[8] = {0};
    for (int k = 0; k < groups; k++) is_on_grid[k] = on_grid;
    float best = 0;
    for (int is = -trials; is <= trials; is++) {
        const float id = (2 * kmaxq - 1 + is * step) / max;
        const float this_scale = 1 / id;
        for (int k = 0; k < groups; k++) {
            int8_t *Lk = Laux + g->width * k;
            for (int i = 0; i < g->width; i++)
                Lk[i] = (int8_t)imax(
                    0, imin(kmaxq - 1, nearest(0.5f * (id * xval[g->width * k + i] - 1))));
            const int key = key_of(g, Lk);
            is_on_grid_aux[k] = g->map[key] >= 0;
            if (!is_on_grid_aux[k])
                best_neighbour(g, key, xval + g->width * k, waux + g->width * k, this_scale, Lk);
        }
        float sumqx, sumq2;
        weighted_sums(n, weight, xval, Laux, &sumqx, &sumq2);
        if (sumq2 > 0 && sumqx * sumqx > best * sumq2) {
            scale = sumqx / sumq2;
            best = scale * sumqx;
            memcpy(L, Laux, n);
            memcpy(is_on_grid, is_on_grid_aux, sizeof(is_on_grid));
        }
    }
    int off_grid = 0;
    for (int k = 0; k < groups; k++) off_grid += !is_on_grid[k];
    if (scale > 0 && (refit == REFIT_ALWAYS || off_grid > 0)) {
        const float id = 1 / scale;
        for (int k = 0; k < groups; k++) {
            if (refit == REFIT_OFF_GRID && is_on_grid[k]) continue;
            grid_point(g, kmaxq, id, xval + g->width * k, waux + g->width * k, scale,
                       L + g->width * k);
        }
        float sumqx, sumq2;
        weighted_sums(n, weight, xval, L, &sumqx, &sumq2);
        if (sumq2 > 0) scale = sumqx / sumq2;
    }
    return scale;
}

/* |x| of 8 weights and their sign bits, one sign flipped (the least important weight's) to
 * make their count even, as the 7-bit sign codes of IQ2_XXS, IQ2_XS and IQ3_XXS need */
static uint8_t even_signs(const float *xb, const float *weight, float *xval) {
    int nflip = 0;
    uint8_t s = 0;
    for (int i = 0; i < 8; i++) {
        if (xb[i] >= 0) {
            xval[i] = xb[i];
        } else {
            xval[i] = -xb[i];
            nflip++;
            s |= (uint8_t)(1 << i);
        }
    }
    if (nflip % 2) {
        int at = 0;
        float min = weight[0] * xb[0] * xb[0];
        for (int i = 1; i < 8; i++) {
            const float ax = weight[i] * xb[i] * xb[i];
            if (ax < min) {
                min = ax;
                at = i;
            }
        }
        xval[at] = -xval[at];
        s ^= (uint8_t)(1 << at);
    }
    return s & 127;
}

static uint8_t plain_signs(const float *xb, float *xval) {
    uint8_t s = 0;
    for (int i = 0; i < 8; i++) {
        xval[i] = xb[i] >= 0 ? xb[i] : -xb[i];
        if (xb[i] < 0) s |= (uint8_t)(1 << i);
    }
    return s;
}

static float block_sigma2(const float *x, float factor) {
    float sumx2 = 0;
    for (int i = 0; i < QK_K; i++) sumx2 += x[i] * x[i];
    return factor * sumx2 / QK_K;
}

/* importance of each weight: the imatrix row scaled by sqrt(sigma2 + x^2), else x^2 */
static void importance(int n, const float *xb, const float *qw, float sigma2, float *weight) {
    for (int i = 0; i < n; i++)
        weight[i] = qw ? qw[i] * sqrtf(sigma2 + xb[i] * xb[i]) : xb[i] * xb[i];
}

static inline int scale_code(float id, float scale, int top) {
    return imax(0, imin(top, nearest(0.5f * (id * scale - 1))));
}

/* ggml's make_qp_quants: a scale for n non-negative values on nmax+1 levels (L wraps as
 * ggml's uint8 L does where a value is negative) */
static float make_qp_quants(int n, int nmax, const float *x, uint8_t *L, const float *w) {
    float max = 0;
    for (int i = 0; i < n; i++) max = larger(max, x[i]);
    if (max < EPS) {
        memset(L, 0, n);
        return 0.f;
    }
    float iscale = nmax / max;
    for (int i = 0; i < n; i++) L[i] = (uint8_t)nearest(iscale * x[i]);
    const float scale = 1 / iscale;
    float best_mse = 0;
    for (int i = 0; i < n; i++) {
        const float diff = x[i] - scale * L[i];
        best_mse += w[i] * diff * diff;
    }
    for (int is = -4; is <= 4; is++) {
        if (is == 0) continue;
        const float iscale_is = (0.1f * is + nmax) / max;
        const float scale_is = 1 / iscale_is;
        float mse = 0;
        for (int i = 0; i < n; i++) {
            const int l = imin(nmax, nearest(iscale_is * x[i]));
            const float diff = x[i] - scale_is * l;
            mse += w[i] * diff * diff;
        }
        if (mse < best_mse) {
            best_mse = mse;
            iscale = iscale_is;
        }
    }
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        const int l = imin(nmax, nearest(iscale * x[i]));
        L[i] = (uint8_t)l;
        sumlx += w[i] * x[i] * l;
        suml2 += w[i] * l * l;
    }
    for (int itry = 0; itry < 5; itry++) {
        int n_changed = 0;
        for (int i = 0; i < n; i++) {
            float slx = sumlx - w[i] * x[i] * L[i];
            float sl2 = suml2 - w[i] * L[i] * L[i];
            if (slx > 0 && sl2 > 0) {
                const int new_l = imin(nmax, nearest(x[i] * sl2 / slx));
                if (new_l != L[i]) {
                    slx += w[i] * x[i] * new_l;
                    sl2 += w[i] * new_l * new_l;
                    if (slx * slx * suml2 > sumlx * sumlx * sl2) {
                        L[i] = (uint8_t)new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed++;
                    }
                }
            }
        }
        if (!n_changed) break;
    }
    return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

/* ---- IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S ---- */

static void iq2_xxs_block(const lattice_t *g, const float *x, const float *qw, uint8_t *out) {
    /* d, 8 x (u32 of four grid indices, u32 of four 7-bit sign codes and a 4-bit scale) */
    float scales[8], weight[32], waux[32], xval[32];
    int8_t L[32];
    uint8_t signs[4];
    uint32_t q2[16] = {0};
    float max_scale = 0;
    const float sigma2 = block_sigma2(x, 1);
    for (int ib = 0; ib < 8; ib++) {
        const float *xb = x + 32 * ib;
        importance(32, xb, qw + 32 * ib, sigma2, weight);
        for (int i = 0; i < 32; i++) waux[i] = sqrtf(weight[i]);
        for (int k = 0; k < 4; k++) signs[k] = even_signs(xb + 8 * k, weight + 8 * k, xval + 8 * k);
        float max = xval[0];
        for (int i = 1; i < 32; i++) max = larger(max, xval[i]);
        scales[ib] = 0;
        if (max < EPS) continue;
        float scale = make_qp_quants(32, 4, xval, (uint8_t *)L, weight);
        const float eff_max = scale * 3;
        if (eff_max <= 0) continue;
        scale = lattice_fit(g, 32, 3, xval, weight, waux, eff_max, scale, 6, 0.1f, true,
                            REFIT_ALWAYS, L);
        if (scale < 0) {
            scale = -scale;
            for (int k = 0; k < 4; k++) signs[k] = (~signs[k]) & 127;
        }
        for (int k = 0; k < 4; k++) {
            q2[2 * ib] |= (uint32_t)g->map[key_of(g, L + 8 * k)] << 8 * k;
            q2[2 * ib + 1] |= (uint32_t)signs[k] << 7 * k;
        }
        scales[ib] = scale;
        max_scale = larger(max_scale, scale);
    }
    if (!max_scale) {
        put_f16(out, 0.f);
        memset(out + 2, 0, 64);
        return;
    }
    const float d = max_scale / 31;
    put_f16(out, d);
    const float id = 1 / d;
    for (int ib = 0; ib < 8; ib++) q2[2 * ib + 1] |= (uint32_t)scale_code(id, scales[ib], 15) << 28;
    memcpy(out + 2, q2, 64);
}

static void iq2_xs_s_block(int type, const lattice_t *g, const float *x, const float *qw,
                           uint8_t *out) {
    /* IQ2_XS: d, 32 u16 (9-bit index, 7-bit sign code), 8 bytes of 4-bit scales.
     * IQ2_S: d, 32 index low bytes, 32 sign bytes, 8 bytes of 2-bit index highs, scales. */
    const bool xs = type == T_IQ2_XS;
    float scales[16], weight[16], waux[16], xval[16];
    int8_t L[16];
    uint8_t signs[2];
    uint16_t q2[32] = {0};
    uint8_t block[82] = {0};
    float max_scale = 0;
    const float sigma2 = block_sigma2(x, xs ? 1 : 2);
    for (int ib = 0; ib < 16; ib++) {
        const float *xb = x + 16 * ib;
        if (xs || qw)
            importance(16, xb, qw + 16 * ib, sigma2, weight);
        else
            for (int i = 0; i < 16; i++) weight[i] = 0.25f * sigma2 + xb[i] * xb[i];
        for (int i = 0; i < 16; i++) waux[i] = sqrtf(weight[i]);
        for (int k = 0; k < 2; k++)
            signs[k] = xs ? even_signs(xb + 8 * k, weight + 8 * k, xval + 8 * k)
                          : plain_signs(xb + 8 * k, xval + 8 * k);
        float max = xval[0];
        for (int i = 1; i < 16; i++) max = larger(max, xval[i]);
        memset(L, 0, 16);
        scales[ib] = 0;
        if (max < (xs ? EPS : EPS_IQ2_S)) continue;
        float scale = lattice_fit(g, 16, 3, xval, weight, waux, max, max / 5, 9, 0.1f, true,
                                  REFIT_OFF_GRID, L);
        if (scale < 0) {
            scale = -scale;
            for (int k = 0; k < 2; k++) signs[k] = xs ? (~signs[k]) & 127 : (uint8_t)~signs[k];
        }
        for (int k = 0; k < 2; k++) {
            const int index = g->map[key_of(g, L + 8 * k)], i8 = 2 * ib + k;
            if (xs) {
                q2[i8] = (uint16_t)(index | signs[k] << 9);
            } else {
                block[2 + i8] = index & 255;
                block[2 + 64 + i8 / 4] |= (uint8_t)((index >> 8) << 2 * (i8 % 4));
                block[2 + 32 + i8] = signs[k];
            }
        }
        scales[ib] = scale;
        max_scale = larger(max_scale, scale);
    }
    if (max_scale) {
        const float d = max_scale / 31;
        put_f16(block, xs ? d : d * 0.9875f);
        const float id = 1 / d;
        uint8_t *sc = block + (xs ? 66 : 74);
        for (int ib = 0; ib < 16; ib++)
            sc[ib / 2] |= (uint8_t)(scale_code(id, scales[ib], 15) << 4 * (ib % 2));
        if (xs) memcpy(block + 2, q2, 64);
    }
    memcpy(out, block, xs ? 74 : 82);
}

static void iq3_xxs_block(const lattice_t *g, const float *x, const float *qw, uint8_t *out) {
    /* d, 64 grid indices, 8 u32 of four 7-bit sign codes and a 4-bit scale */
    float scales[8], weight[32], waux[32], xval[32];
    int8_t L[32];
    uint8_t signs[4];
    uint8_t q3[64] = {0};
    uint32_t codes[8] = {0};
    float max_scale = 0;
    const float sigma2 = block_sigma2(x, 2);
    for (int ib = 0; ib < 8; ib++) {
        const float *xb = x + 32 * ib;
        importance(32, xb, qw ? qw + 32 * ib : NULL, sigma2, weight);
        for (int i = 0; i < 32; i++) waux[i] = sqrtf(weight[i]);
        for (int k = 0; k < 4; k++) signs[k] = even_signs(xb + 8 * k, weight + 8 * k, xval + 8 * k);
        float max = xval[0];
        for (int i = 1; i < 32; i++) max = larger(max, xval[i]);
        memset(L, 0, 32);
        scales[ib] = 0;
        if (max < EPS_IQ3_XXS) continue;
        float scale = lattice_fit(g, 32, 8, xval, weight, waux, max, max / 15, 15, 0.2f, true,
                                  REFIT_OFF_GRID, L);
        if (scale < 0) {
            scale = -scale;
            for (int k = 0; k < 4; k++) signs[k] = (~signs[k]) & 127;
        }
        for (int k = 0; k < 8; k++) q3[8 * ib + k] = (uint8_t)g->map[key_of(g, L + 4 * k)];
        codes[ib] = signs[0] | (uint32_t)signs[1] << 7 | (uint32_t)signs[2] << 14 |
                    (uint32_t)signs[3] << 21;
        scales[ib] = scale;
        max_scale = larger(max_scale, scale);
    }
    if (!max_scale) {
        memset(out, 0, 98);
        return;
    }
    const float d = max_scale / 31;
    put_f16(out, d * 1.0125f);
    const float id = 1 / d;
    for (int ib = 0; ib < 8; ib++) codes[ib] |= (uint32_t)scale_code(id, scales[ib], 15) << 28;
    memcpy(out + 2, q3, 64);
    memcpy(out + 66, codes, 32);
}

static void iq3_s_block(const lattice_t *g, const float *x, const float *qw, uint8_t *out) {
    /* d, 64 index low bytes, 8 bytes of index high bits, 32 sign bytes, 4 bytes of scales */
    float scales[8], weight[32], waux[32], xval[32];
    int8_t L[32];
    uint8_t signs[4];
    memset(out, 0, 110);
    uint8_t *qs = out + 2, *qh = out + 66, *sg = out + 74;
    float max_scale = 0;
    const float sigma2 = block_sigma2(x, 2);
    for (int ib = 0; ib < 8; ib++) {
        const float *xb = x + 32 * ib;
        importance(32, xb, qw ? qw + 32 * ib : NULL, sigma2, weight);
        for (int i = 0; i < 32; i++) waux[i] = sqrtf(weight[i]);
        for (int k = 0; k < 4; k++) signs[k] = plain_signs(xb + 8 * k, xval + 8 * k);
        float max = xval[0];
        for (int i = 1; i < 32; i++) max = larger(max, xval[i]);
        memset(L, 0, 32);
        scales[ib] = 0;
        if (!max) continue; /* and, as in ggml, the qs and signs cursors stay where they are */
        float scale = lattice_fit(g, 32, 8, xval, weight, waux, max, max / 15, 9, 0.2f, false,
                                  REFIT_ALL_IF_OFF_GRID, L);
        if (scale < 0) {
            scale = -scale;
            for (int k = 0; k < 4; k++) signs[k] = (uint8_t)~signs[k];
        }
        for (int k = 0; k < 8; k++) {
            const int index = g->map[key_of(g, L + 4 * k)];
            qs[k] = index & 255;
            qh[(ib * 8 + k) / 8] |= (uint8_t)((index >> 8) << ((ib * 8 + k) % 8));
        }
        qs += 8;
        memcpy(sg, signs, 4);
        sg += 4;
        scales[ib] = scale;
        max_scale = larger(max_scale, scale);
    }
    if (!max_scale) return;
    const float d = max_scale / 31;
    put_f16(out, d * 1.033f);
    const float id = 1 / d;
    for (int ib = 0; ib < 8; ib += 2)
        out[106 + ib / 2] =
            (uint8_t)(scale_code(id, scales[ib], 15) | scale_code(id, scales[ib + 1], 15) << 4);
}

/* ---- IQ1_S, IQ1_M ---- */

static int by_value(const void *left, const void *right) { /* ggml's iq1_sort_helper */
    const float *l = left, *r = right;
    return *l < *r ? -1 : *l > *r ? 1 : 0;
}

/* the weights' order by value, as ggml sorts (value, index) pairs with qsort */
static void sort_pairs(int n, const float *xb, float *pairs) {
    int *idx = (int *)(pairs + 1);
    for (int j = 0; j < n; j++) {
        pairs[2 * j] = xb[j];
        idx[2 * j] = j;
    }
    qsort(pairs, n, 2 * sizeof(float), by_value);
}

/* iq1_find_best_neighbour2: the listed neighbour (or, failing those, grid point) nearest
 * xb at `scale` with the values xx, its coordinates into L */
static int iq1_neighbour(const lattice_t *g, int key, const float *xval, const float *weight,
                         float scale, const float *xx, int8_t *L) {
    const uint16_t *list = g->neighbours - g->map[key] - 1;
    float best = FLT_MAX;
    int index = -1;
    for (int j = 1; j <= list[0]; j++) {
        const int8_t *pg = g->grid + 8 * list[j];
        float d2 = 0;
        for (int i = 0; i < 8; i++) {
            const float q = xx[(pg[i] - 1) / 2];
            const float diff = scale * q - xval[i];
            d2 += weight[i] * diff * diff;
        }
        if (d2 < best) {
            best = d2;
            index = list[j];
        }
    }
    if (index < 0) { /* only for sums that overflow; ggml reads past xval here, not xval[j] */
        for (int i = 0; i < g->size; i++) {
            const int8_t *pg = g->grid + 8 * i;
            float d2 = 0;
            for (int j = 0; j < 8; j++) {
                const float q = xx[(pg[j] - 1) / 2];
                const float diff = scale * q - xval[j];
                d2 += weight[j] * diff * diff;
            }
            if (d2 < best) {
                best = d2;
                index = i;
            }
        }
    }
    if (index < 0) index = 0;
    const int8_t *pg = g->grid + 8 * index;
    for (int i = 0; i < 8; i++) L[i] = (int8_t)((pg[i] - 1) / 2);
    return index;
}

static void iq1_s_block(const lattice_t *g, const float *x, const float *qw, uint8_t *out) {
    /* d, 32 index low bytes, 8 u16 of four 3-bit index highs, a 3-bit scale, a shift bit */
    const float x_p[3] = {-1 + IQ1_DELTA, IQ1_DELTA, 1 + IQ1_DELTA};
    const float x_m[3] = {-1 - IQ1_DELTA, -IQ1_DELTA, 1 - IQ1_DELTA};
    float scales[8], weight[32], sumx[33], sumw[33], pairs[64];
    int8_t L[32], shifts[8];
    uint16_t index[4], qh[8] = {0};
    const int *idx = (const int *)(pairs + 1);
    memset(out, 0, 50);
    float max_scale = 0;
    const float sigma2 = block_sigma2(x, 2);
    for (int ib = 0; ib < 8; ib++) {
        const float *xb = x + 32 * ib;
        importance(32, xb, qw + 32 * ib, sigma2, weight);
        float max = fabsf(xb[0]);
        for (int i = 1; i < 32; i++) max = larger(max, fabsf(xb[i]));
        scales[ib] = 0;
        shifts[ib] = 1;
        if (max < EPS_IQ1_S) continue;
        sort_pairs(32, xb, pairs);
        sumx[0] = sumw[0] = 0;
        for (int j = 0; j < 32; j++) {
            const int i = idx[2 * j];
            sumx[j + 1] = sumx[j] + weight[i] * xb[i];
            sumw[j + 1] = sumw[j] + weight[i];
        }
        float best_score = -FLT_MAX, scale = max;
        int besti1 = -1, besti2 = -1, best_shift = 0;
        for (int i1 = 0; i1 <= 32; i1++) {
            for (int i2 = i1; i2 <= 32; i2++) {
                float sumqx = (sumx[i1] - sumx[0]) * x_p[0] + (sumx[i2] - sumx[i1]) * x_p[1] +
                              (sumx[32] - sumx[i2]) * x_p[2];
                float sumq2 = (sumw[i1] - sumw[0]) * x_p[0] * x_p[0] +
                              (sumw[i2] - sumw[i1]) * x_p[1] * x_p[1] +
                              (sumw[32] - sumw[i2]) * x_p[2] * x_p[2];
                if (sumq2 > 0 && sumqx * sumqx > best_score * sumq2) {
                    scale = sumqx / sumq2;
                    best_score = scale * sumqx;
                    besti1 = i1, besti2 = i2, best_shift = 1;
                }
                sumqx = (sumx[i1] - sumx[0]) * x_m[0] + (sumx[i2] - sumx[i1]) * x_m[1] +
                        (sumx[32] - sumx[i2]) * x_m[2];
                sumq2 = (sumw[i1] - sumw[0]) * x_m[0] * x_m[0] +
                        (sumw[i2] - sumw[i1]) * x_m[1] * x_m[1] +
                        (sumw[32] - sumw[i2]) * x_m[2] * x_m[2];
                if (sumq2 > 0 && sumqx * sumqx > best_score * sumq2) {
                    scale = sumqx / sumq2;
                    best_score = scale * sumqx;
                    besti1 = i1, besti2 = i2, best_shift = -1;
                }
            }
        }
        if (besti1 < 0 || besti2 < 0 || best_shift == 0) continue;
        for (int j = 0; j < besti1; j++) L[idx[2 * j]] = 0;
        for (int j = besti1; j < besti2; j++) L[idx[2 * j]] = 1;
        for (int j = besti2; j < 32; j++) L[idx[2 * j]] = 2;
        if (scale < 0) {
            for (int j = 0; j < 32; j++) L[j] = (int8_t)(2 - L[j]);
            scale = -scale;
            best_shift = -best_shift;
        }
        bool all_on_grid = true;
        const float *xx = best_shift == 1 ? x_p : x_m;
        for (int k = 0; k < 4; k++) {
            const int key = key_of(g, L + 8 * k);
            int found = g->map[key];
            if (found < 0) {
                all_on_grid = false;
                found = iq1_neighbour(g, key, xb + 8 * k, weight + 8 * k, scale, xx, L + 8 * k);
            }
            index[k] = (uint16_t)found;
        }
        if (!all_on_grid) {
            float sumqx = 0, sumq2 = 0;
            for (int k = 0; k < 4; k++) {
                const int8_t *pg = g->grid + 8 * index[k];
                for (int j = 0; j < 8; j++) {
                    const float w = weight[8 * k + j];
                    const float q = xx[(pg[j] - 1) / 2];
                    sumqx += w * q * xb[8 * k + j];
                    sumq2 += w * q * q;
                }
            }
            if (sumqx > 0 && sumq2 > 0) scale = sumqx / sumq2;
        }
        uint16_t h = 0;
        for (int k = 0; k < 4; k++) {
            out[2 + 4 * ib + k] = index[k] & 255;
            h |= (uint16_t)((index[k] >> 8) << 3 * k);
        }
        qh[ib] = h;
        scales[ib] = scale;
        shifts[ib] = (int8_t)best_shift;
        max_scale = larger(max_scale, scale);
    }
    if (max_scale) {
        const float d = max_scale / 15;
        put_f16(out, d * 1.125f);
        const float id = 1 / d;
        for (int ib = 0; ib < 8; ib++) {
            int l = scale_code(id, scales[ib], 7);
            if (shifts[ib] == -1) l |= 8;
            qh[ib] |= (uint16_t)(l << 12);
        }
    }
    memcpy(out + 34, qh, 16);
}

static void iq1_m_block(const lattice_t *g, const float *x, const float *qw, uint8_t *out) {
    /* 32 index low bytes, 16 bytes of (3-bit index high, shift bit) x 2, 8 bytes of 3-bit
     * scales holding the f16 super-block scale in their top nibbles */
    const float x_p[3] = {-1 + IQ1_DELTA, IQ1_DELTA, 1 + IQ1_DELTA};
    const float x_m[3] = {-1 - IQ1_DELTA, -IQ1_DELTA, 1 - IQ1_DELTA};
    const uint8_t masks[4] = {0x00, 0x80, 0x08, 0x88};
    float scales[16], weight[16], pairs[32];
    int8_t L[16], shifts[16];
    uint16_t index[2], sc[4] = {0};
    uint8_t *qs = out, *qh = out + 32;
    const int *idx = (const int *)(pairs + 1);
    const float *xx;
    memset(out, 0, 56);
    float max_scale = 0;
    const float sigma2 = block_sigma2(x, 2);
    for (int ib = 0; ib < 16; ib++) {
        const float *xb = x + 16 * ib;
        importance(16, xb, qw ? qw + 16 * ib : NULL, sigma2, weight);
        float max = fabsf(xb[0]);
        for (int i = 1; i < 16; i++) max = larger(max, fabsf(xb[i]));
        scales[ib] = 0;
        shifts[ib] = 0;
        if (max < EPS_IQ1_M) continue;
        sort_pairs(16, xb, pairs);
        float best_score = -FLT_MAX, scale = max;
        int besti1 = -1, besti2 = -1, best_k = -1;
        /* k: the signs of the two halves' shifts, + + / + - / - + / - - */
        float px[2][17], pw[2][17];
        px[0][0] = px[1][0] = 0;
        pw[0][0] = pw[1][0] = 0;
        for (int j = 0; j < 16; j++) {
            const int i = idx[2 * j];
            const int h = i < 8 ? 0 : 1;
            px[h][j + 1] = px[h][j] + weight[i] * xb[i];
            px[1 - h][j + 1] = px[1 - h][j];
            pw[h][j + 1] = pw[h][j] + weight[i];
            pw[1 - h][j + 1] = pw[1 - h][j];
        }
        const float txs[2] = {px[0][16], px[1][16]}, tws[2] = {pw[0][16], pw[1][16]};
        const float p2 = x_p[2], m2 = x_m[2];
        const float cp1 = x_p[0] * x_p[0] - x_p[1] * x_p[1],
                    cp2 = x_p[1] * x_p[1] - x_p[2] * x_p[2];
        const float cm1 = x_m[0] * x_m[0] - x_m[1] * x_m[1],
                    cm2 = x_m[1] * x_m[1] - x_m[2] * x_m[2];
        for (int i1 = 0; i1 <= 16; i1++) {
            for (int i2 = i1; i2 <= 16; i2++) {
                float qx_p[2], qx_m[2], q2_p[2], q2_m[2], sumqx[4], sumq2[4];
                for (int h = 0; h < 2; h++) {
                    const float sx = px[h][i1] + px[h][i2];
                    qx_p[h] = txs[h] * p2 - sx;
                    qx_m[h] = txs[h] * m2 - sx;
                    q2_p[h] = tws[h] * p2 * p2 + pw[h][i1] * cp1 + pw[h][i2] * cp2;
                    q2_m[h] = tws[h] * m2 * m2 + pw[h][i1] * cm1 + pw[h][i2] * cm2;
                }
                sumqx[0] = qx_p[0] + qx_p[1];
                sumqx[1] = qx_p[0] + qx_m[1];
                sumqx[2] = qx_m[0] + qx_p[1];
                sumqx[3] = qx_m[0] + qx_m[1];
                sumq2[0] = q2_p[0] + q2_p[1];
                sumq2[1] = q2_p[0] + q2_m[1];
                sumq2[2] = q2_m[0] + q2_p[1];
                sumq2[3] = q2_m[0] + q2_m[1];
                for (int k = 0; k < 4; k++) {
                    if (sumq2[k] > 0 && sumqx[k] * sumqx[k] > best_score * sumq2[k]) {
                        scale = sumqx[k] / sumq2[k];
                        best_score = scale * sumqx[k];
                        besti1 = i1, besti2 = i2, best_k = k;
                    }
                }
            }
        }
        if (besti1 < 0 || besti2 < 0 || best_k < 0) continue;
        for (int j = 0; j < besti1; j++) L[idx[2 * j]] = 0;
        for (int j = besti1; j < besti2; j++) L[idx[2 * j]] = 1;
        for (int j = besti2; j < 16; j++) L[idx[2 * j]] = 2;
        if (scale < 0) {
            for (int j = 0; j < 16; j++) L[j] = (int8_t)(2 - L[j]);
            scale = -scale;
            best_k = 3 - best_k;
        }
        bool all_on_grid = true;
        for (int k = 0; k < 2; k++) {
            xx = (k == 0 ? best_k < 2 : best_k % 2 == 0) ? x_p : x_m;
            const int key = key_of(g, L + 8 * k);
            int found = g->map[key];
            if (found < 0) {
                all_on_grid = false;
                found = iq1_neighbour(g, key, xb + 8 * k, weight + 8 * k, scale, xx, L + 8 * k);
            }
            index[k] = (uint16_t)found;
        }
        if (!all_on_grid) {
            float sumqx = 0, sumq2 = 0;
            for (int k = 0; k < 2; k++) {
                xx = (k == 0 ? best_k < 2 : best_k % 2 == 0) ? x_p : x_m;
                const int8_t *pg = g->grid + 8 * index[k];
                for (int j = 0; j < 8; j++) {
                    const float w = weight[8 * k + j];
                    const float q = xx[(pg[j] - 1) / 2];
                    sumqx += w * q * xb[8 * k + j];
                    sumq2 += w * q * q;
                }
            }
            if (sumqx > 0 && sumq2 > 0) scale = sumqx / sumq2;
        }
        qs[2 * ib] = index[0] & 255;
        qs[2 * ib + 1] = index[1] & 255;
        qh[ib] = (uint8_t)((index[0] >> 8) | ((index[1] >> 8) << 4));
        scales[ib] = scale;
        shifts[ib] = (int8_t)best_k;
        max_scale = larger(max_scale, scale);
    }
    if (!max_scale) return;
    float d = max_scale / 15;
    const float id = 1 / d;
    float sumqx = 0, sumq2 = 0;
    for (int ib = 0; ib < 16; ib++) {
        const int l = scale_code(id, scales[ib], 7);
        sc[ib / 4] |= (uint16_t)(l << 3 * (ib % 4));
        qh[ib] |= masks[shifts[ib]];
        const float *xb = x + 16 * ib;
        importance(16, xb, qw ? qw + 16 * ib : NULL, sigma2, weight);
        for (int k = 0; k < 2; k++) {
            xx = (k == 0 ? shifts[ib] < 2 : shifts[ib] % 2 == 0) ? x_p : x_m;
            const int8_t *pg = g->grid + 8 * (qs[2 * ib + k] + ((qh[ib] << (8 - 4 * k)) & 0x700));
            for (int j = 0; j < 8; j++) {
                const float w = weight[8 * k + j];
                const float q = xx[(pg[j] - 1) / 2] * (2 * l + 1);
                sumqx += w * q * xb[8 * k + j];
                sumq2 += w * q * q;
            }
        }
    }
    if (sumq2 > 0) d = sumqx / sumq2;
    const uint16_t s = to_f16(d * 1.1125f);
    sc[0] |= (uint16_t)((s & 0x000f) << 12);
    sc[1] |= (uint16_t)((s & 0x00f0) << 8);
    sc[2] |= (uint16_t)((s & 0x0f00) << 4);
    sc[3] |= (uint16_t)(s & 0xf000);
    memcpy(out + 48, sc, 8);
}

/* ---- IQ4_NL, IQ4_XS ---- */

static int best_index(float x) { /* ggml's best_index_int8 over the 16 IQ4 values */
    if (x <= IQ4_VALUES[0]) return 0;
    if (x >= IQ4_VALUES[15]) return 15;
    int ml = 0, mu = 15;
    while (mu - ml > 1) {
        const int mav = (ml + mu) / 2;
        if (x < IQ4_VALUES[mav])
            mu = mav;
        else
            ml = mav;
    }
    return x - IQ4_VALUES[mu - 1] < IQ4_VALUES[mu] - x ? mu - 1 : mu;
}

/* ggml's quantize_row_iq4_nl_impl with ntry 7: n weights (32 for IQ4_NL, 256 for IQ4_XS)
 * in sub-blocks of 32, writing d and the nibbles, and for IQ4_XS the 6-bit scales */
static void iq4_block(int n, const float *x, const float *qw, uint8_t *dh, uint8_t *scales_h,
                      uint8_t *scales_l, uint8_t *q4) {
    float scales[8], weight[32];
    uint8_t L[QK_K];
    float sigma2 = 0;
    for (int j = 0; j < n; j++) sigma2 += x[j] * x[j];
    sigma2 *= 2.f / n;
    memset(q4, 0, n / 2);
    put_f16(dh, 0.f);
    float max_scale = 0, amax_scale = 0;
    for (int ib = 0; ib < n / 32; ib++) {
        const float *xb = x + 32 * ib;
        uint8_t *Lb = L + 32 * ib;
        importance(32, xb, qw ? qw + 32 * ib : NULL, sigma2, weight);
        float amax = 0, max = 0;
        for (int j = 0; j < 32; j++) {
            const float ax = fabsf(xb[j]);
            if (ax > amax) {
                amax = ax;
                max = xb[j];
            }
        }
        if (amax < EPS) {
            scales[ib] = 0;
            memset(Lb, 0, 32); /* ggml leaves them stale; every path below rewrites them */
            continue;
        }
        float d = -max / IQ4_VALUES[0];
        float id = 1 / d;
        float sumqx = 0, sumq2 = 0;
        for (int j = 0; j < 32; j++) {
            const int l = best_index(id * xb[j]);
            Lb[j] = (uint8_t)l;
            const float q = IQ4_VALUES[l];
            const float w = weight[j];
            sumqx += w * q * xb[j];
            sumq2 += w * q * q;
        }
        d = sumq2 > 0 ? sumqx / sumq2 : 0.f;
        float best = d * sumqx;
        for (int itry = -7; itry <= 7; itry++) {
            id = (itry + IQ4_VALUES[0]) / max;
            sumqx = sumq2 = 0;
            for (int j = 0; j < 32; j++) {
                const float q = IQ4_VALUES[best_index(id * xb[j])];
                const float w = weight[j];
                sumqx += w * q * xb[j];
                sumq2 += w * q * q;
            }
            if (sumq2 > 0 && sumqx * sumqx > best * sumq2) {
                d = sumqx / sumq2;
                best = d * sumqx;
            }
        }
        scales[ib] = d;
        const float abs_d = fabsf(d);
        if (abs_d > amax_scale) {
            amax_scale = abs_d;
            max_scale = d;
        }
    }
    if (n > 32) {
        uint16_t high = 0;
        const float d = -max_scale / 32;
        put_f16(dh, d);
        const float id = d ? 1 / d : 0.f;
        for (int ib = 0; ib < n / 32; ib++) {
            int l = imax(-32, imin(31, nearest(id * scales[ib])));
            const float dl = d * l;
            const float idl = dl ? 1 / dl : 0.f;
            for (int j = 0; j < 32; j++) L[32 * ib + j] = (uint8_t)best_index(idl * x[32 * ib + j]);
            l += 32;
            if (ib % 2 == 0)
                scales_l[ib / 2] = l & 0xf;
            else
                scales_l[ib / 2] |= (uint8_t)((l & 0xf) << 4);
            high |= (uint16_t)((l >> 4) << 2 * (ib % 8));
        }
        memcpy(scales_h, &high, 2);
    } else {
        put_f16(dh, scales[0]);
        const float id = scales[0] ? 1 / scales[0] : 0;
        for (int j = 0; j < n; j++) L[j] = (uint8_t)best_index(id * x[j]);
    }
    for (int i = 0; i < n / 32; i++)
        for (int j = 0; j < 16; j++)
            q4[16 * i + j] = (uint8_t)(L[32 * i + j] | L[32 * i + 16 + j] << 4);
}

static void iq4_nl_block(const float *x, const float *qw, uint8_t *out) { /* d, 16 bytes */
    iq4_block(32, x, qw, out, NULL, NULL, out + 2);
}

static void iq4_xs_block(const float *x, const float *qw, uint8_t *out) {
    /* d, u16 of 2-bit scale highs, 4 bytes of scale lows, 128 bytes of nibbles */
    iq4_block(QK_K, x, qw, out, out + 2, out + 4, out + 8);
}

/* ---- TQ1_0, TQ2_0 (no importance) ---- */

static float ternary_scale(const float *x) {
    float amax = 0.0f;
    for (int j = 0; j < QK_K; j++) amax = larger(amax, fabsf(x[j]));
    return amax;
}

static inline int trit(float v, float id) {
    return (int)lroundf(v * id) + 1;
} /* -1, 0, 1 -> 0, 1, 2 */

static void tq1_0_block(const float *x, uint8_t *out) { /* 48 bytes of 5 trits, 4 of 4, d */
    const float d = ternary_scale(x);
    const float id = d ? 1.0f / d : 0.0f;
    uint8_t *qs = out, *qh = out + 48;
    for (int m = 0; m < 32; m++) { /* the first 32 bytes: 5 trits 32 weights apart */
        uint8_t q = 0;
        for (int n = 0; n < 5; n++) q = (uint8_t)(q * 3 + trit(x[m + 32 * n], id));
        qs[m] = (uint8_t)(((uint16_t)q * 256 + 242) / 243);
    }
    x += 160;
    for (int m = 0; m < 16; m++) { /* the next 16: 5 trits 16 apart */
        uint8_t q = 0;
        for (int n = 0; n < 5; n++) q = (uint8_t)(q * 3 + trit(x[m + 16 * n], id));
        qs[32 + m] = (uint8_t)(((uint16_t)q * 256 + 242) / 243);
    }
    x += 80;
    for (int j = 0; j < 4; j++) { /* the last 16 weights: 4 trits 4 apart, shifted up one */
        uint8_t q = 0;
        for (int m = 0; m < 4; m++) q = (uint8_t)(q * 3 + trit(x[j + 4 * m], id));
        q = (uint8_t)(q * 3);
        qh[j] = (uint8_t)(((uint16_t)q * 256 + 242) / 243);
    }
    put_f16(out + 52, d);
}

static void tq2_0_block(const float *x, uint8_t *out) { /* 64 bytes of 4 2-bit codes, d */
    const float d = ternary_scale(x);
    const float id = d ? 1.0f / d : 0.0f;
    for (int j = 0; j < 64; j += 32) {
        for (int m = 0; m < 32; m++) {
            uint8_t q = 0;
            for (int n = 0; n < 4; n++) q = (uint8_t)(q + ((trit(x[m + 32 * n], id) & 3) << 2 * n));
            out[j + m] = q;
        }
        x += 128;
    }
    put_f16(out + 64, d);
}

/* ---- the entry ---- */

static void quantize_block(int type, const lattice_t *g, const float *x, const float *qw,
                           uint8_t *out) {
    switch (type) {
    case T_IQ2_XXS: iq2_xxs_block(g, x, qw, out); break;
    case T_IQ2_XS:
    case T_IQ2_S: iq2_xs_s_block(type, g, x, qw, out); break;
    case T_IQ3_XXS: iq3_xxs_block(g, x, qw, out); break;
    case T_IQ3_S: iq3_s_block(g, x, qw, out); break;
    case T_IQ1_S: iq1_s_block(g, x, qw, out); break;
    case T_IQ1_M: iq1_m_block(g, x, qw, out); break;
    case T_IQ4_NL: iq4_nl_block(x, qw, out); break;
    case T_IQ4_XS: iq4_xs_block(x, qw, out); break;
    case T_TQ1_0: tq1_0_block(x, out); break;
    case T_TQ2_0: tq2_0_block(x, out); break;
    }
}

/* a type's weights and bytes per block, its lattice (-1 for none) and whether it needs an
 * importance row (ggml_quantize_requires_imatrix); 0 for types not here */
static int iq_type(int type, int *weights, int *bytes, int *which, int *needs_imatrix) {
    *weights = QK_K, *which = -1, *needs_imatrix = 0;
    switch (type) {
    case T_IQ2_XXS: *bytes = 66, *which = L_IQ2_XXS, *needs_imatrix = 1; return 1;
    case T_IQ2_XS: *bytes = 74, *which = L_IQ2_XS, *needs_imatrix = 1; return 1;
    case T_IQ2_S: *bytes = 82, *which = L_IQ2_S; return 1;
    case T_IQ3_XXS: *bytes = 98, *which = L_IQ3_XXS; return 1;
    case T_IQ3_S: *bytes = 110, *which = L_IQ3_S; return 1;
    case T_IQ1_S: *bytes = 50, *which = L_IQ1, *needs_imatrix = 1; return 1;
    case T_IQ1_M: *bytes = 56, *which = L_IQ1; return 1;
    case T_IQ4_NL: *weights = QK4_NL, *bytes = 18; return 1;
    case T_IQ4_XS: *bytes = 136; return 1;
    case T_TQ1_0: *bytes = 54; return 1;
    case T_TQ2_0: *bytes = 66; return 1;
    default: return 0;
    }
}

int64_t llmrun_quantize_iq(int type, const float *src, void *dst, int64_t rows, int64_t n_per_row,
                           const float *imatrix, int threads) {
    int weights, bytes, which, needs_imatrix;
    if (!iq_type(type, &weights, &bytes, &which, &needs_imatrix)) return -1;
    if (rows < 0 || n_per_row <= 0 || n_per_row % weights || threads < 1) return -1;
    if (needs_imatrix && !imatrix) return -1;
    const lattice_t *g = NULL;
    if (which >= 0 && !(g = lattice(which))) return -1;
    const int64_t blocks = n_per_row / weights;
    uint8_t *out = (uint8_t *)dst;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < blocks; b++)
            quantize_block(type, g, src + r * n_per_row + b * weights,
                           imatrix ? imatrix + b * weights : NULL, out + (r * blocks + b) * bytes);
    return rows * blocks * bytes;
}
