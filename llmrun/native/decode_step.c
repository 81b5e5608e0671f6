/* One decode step of a whole stack of decoder layers, for one sequence, in one call
 * (llmrun/quant/decode_step.py builds its description and calls it).
 *
 * Driven op by op from Python, a token of a 24-layer model makes ~170 matvec calls and
 * ~300 small ops, each paying Python, ctypes and an OpenMP fork and join: ~6 ms of a
 * ~25 ms token measured on a 0.5B model. Here one OpenMP team runs the whole step: per
 * layer, RMSNorm (Gemma's offset form), the q/k/v matvecs as one pool of row ranges,
 * the per-head q/k norms, the rotary embedding, the write of the new key and value
 * into the cache as it stores them, attention per KV head, the output matvec
 * (Gemma 2/3: its post-norm), the residual, the gate and up matvecs with the SiLU or
 * tanh-GELU product of each row range, the down matvec, the residual. The threads
 * meet at a barrier between phases and never leave the team within the step.
 *
 * The arithmetic is the ops' own: llmrun_matvec or, where a matrix asks for 8-bit
 * activations, llmrun_q8_rows on activations quantized once per phase (q8.h); the
 * ops of decode_ops.c. So the step computes what the op-by-op path computes, to the
 * order of float sums in the row ranges' split.
 */
#include <math.h>
#include <omp.h>

#include "q8.h"

int llmrun_matvec(int type, const uint8_t *w, int64_t stride, int64_t rows, const float *x,
                  int64_t m, int64_t n, float *y, const float *bias);
void llmrun_rms_norm_offset(const float *x, const float *weight, float offset, float eps,
                            int64_t rows, int64_t n, float *y);
void llmrun_rotary(const float *x, int64_t rows, int64_t dim, const float *cos,
                   const float *sin, int64_t rot, float *y);
void llmrun_silu_mul(const float *gate, const float *up, int64_t n, float *y);
void llmrun_gelu_tanh_mul(const float *gate, const float *up, int64_t n, float *y);
int llmrun_attend_kv_head(int kind, int64_t g, const float *q, const void *k, const void *v,
                          int64_t heads, int64_t kv_heads, int64_t length, int64_t dim,
                          int64_t head_bytes, float scale, float softcap, const float *sinks,
                          float *y);
/* The 8-bit-activation kernels, where the family has them (q8_*.c; not NEON). */
int llmrun_q8_layout(int type, int *order, int *offset) __attribute__((weak));
int llmrun_q8_rows(int type, const uint8_t *w, int64_t stride, int64_t r0, int64_t r1,
                   const act_t *a, float *y, const float *bias) __attribute__((weak));

/* One weight matrix: `rows` rows of `cols` weights of kernel type `type`, `stride` bytes
 * apart; q8: through the 8-bit-activation kernel. */
typedef struct {
    const uint8_t *w;
    const float *bias; /* NULL: none */
    int64_t stride, rows, cols;
    int32_t type, q8;
} step_mat_t;

enum { MAT_Q, MAT_K, MAT_V, MAT_O, MAT_GATE, MAT_UP, MAT_DOWN, MATS };
enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };
enum { KV_F32 = 0, KV_F16 = 1, KV_Q8_0 = 8, KV_BF16 = 30 };

/* One layer (llmrun/quant/decode_step.py: Layer, the same fields in this order). */
typedef struct {
    step_mat_t mat[MATS];
    const float *input_norm, *post_attn_norm, *pre_ffn_norm, *post_ffn_norm; /* NULL: none */
    const float *q_norm, *k_norm; /* per-head RMSNorm of queries and keys; NULL: none */
    uint8_t *k_cache, *v_cache; /* the sequence's position 0 (a ring: slot 0), KV head 0 */
    int64_t head_bytes;         /* from one KV head's run of positions to the next */
    int64_t ring;               /* a sliding-window ring's slots; 0: a full layer */
    float norm_offset, eps, scale, softcap; /* softcap 0: none */
    int32_t heads, kv_heads, head_dim, act, rope, kv_kind;
} step_layer_t;

/* The token (decode_step.py: Step). */
typedef struct {
    const float *cos[2], *sin[2]; /* rotary_dim each, per kind of layer (step_layer_t.rope) */
    int64_t position, rotary_dim, hidden, layers;
    int64_t ring_keys; /* the slots of a ring that hold keys, after this token's write */
} step_t;

#define ACT_SLOTS 4

/* A vector's quantized forms, one per kernel layout that a phase's matrices want. */
typedef struct {
    act_t a[ACT_SLOTS];
    int order[ACT_SLOTS], offset[ACT_SLOTS], used;
    void *buf[ACT_SLOTS];
} acts_t;

/* The phase's work: a piece is rows r0 .. r1 - 1 of matrix `mat`. */
#define MAX_PIECES 4096
typedef struct {
    int32_t mat[MAX_PIECES];
    int64_t r0[MAX_PIECES], r1[MAX_PIECES];
    const act_t *act[MATS];
    int count;
} work_t;

static int64_t kv_row_bytes(int kind, int64_t dim) {
    return kind == KV_F32 ? 4 * dim : kind == KV_Q8_0 ? dim / 32 * 34 : 2 * dim;
}

/* f32 -> bf16, rounded to nearest even as torch converts (NaN stays NaN) */
static uint16_t bf16_bits(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* n values (n a multiple of 32 for Q8_0) as the cache stores them */
static void kv_store(int kind, const float *x, int64_t n, uint8_t *out) {
    if (kind == KV_F32) {
        memcpy(out, x, (size_t)n * sizeof(float));
    } else if (kind == KV_F16) {
        for (int64_t i = 0; i < n; i++) {
            const _Float16 h = (_Float16)x[i];
            memcpy(out + 2 * i, &h, 2);
        }
    } else if (kind == KV_BF16) {
        for (int64_t i = 0; i < n; i++) {
            const uint16_t h = bf16_bits(x[i]);
            memcpy(out + 2 * i, &h, 2);
        }
    } else { /* Q8_0 blocks, as gguf.quants.quantize writes them */
        for (int64_t b = 0; b < n / 32; b++) {
            int32_t sum;
            const _Float16 d = (_Float16)q8_block_quantize(x + 32 * b, (int8_t *)out + 34 * b + 2, &sum);
            memcpy(out + 34 * b, &d, 2);
        }
    }
}

static void quantize_for(int order, int offset, const float *x, int64_t n, act_t *a) {
    a->n = n; /* the buffers are sized for the widest vector; one row of them is used */
    switch (order) {
    case ORDER_QUADS: q8_quantize(x, 1, n, ORDER_QUADS, offset, a); break;
    case ORDER_K_PAIRS: q8_quantize(x, 1, n, ORDER_K_PAIRS, offset, a); break;
    default: q8_quantize(x, 1, n, ORDER_NATURAL, offset, a); break;
    }
}

/* x's quantized form for `mat`'s kernel, made once per phase and layout. */
static const act_t *act_for(acts_t *acts, const step_mat_t *mat, const float *x) {
    int order, offset;
    if (llmrun_q8_layout(mat->type, &order, &offset)) return NULL;
    for (int i = 0; i < acts->used; i++)
        if (acts->order[i] == order && acts->offset[i] == offset) return &acts->a[i];
    if (acts->used == ACT_SLOTS) return NULL;
    const int i = acts->used++;
    acts->order[i] = order, acts->offset[i] = offset;
    quantize_for(order, offset, x, mat->cols, &acts->a[i]);
    return &acts->a[i];
}

/* Split `count` matrices (indices `which`) into pieces: 8-bit ones into runs of about
 * CHUNK bytes (row_chunk, with `threads`), the others into one piece per thread (each
 * call prepares its activations). Run on one thread; x's quantized forms are made here. */
static void plan(work_t *work, const step_layer_t *layer, const int *which, int count,
                 const float *x, acts_t *acts, int threads) {
    work->count = 0;
    acts->used = 0;
    for (int j = 0; j < count; j++) {
        const step_mat_t *mat = &layer->mat[which[j]];
        const act_t *a = mat->q8 && llmrun_q8_rows ? act_for(acts, mat, x) : NULL;
        work->act[which[j]] = a;
        const int64_t even = (mat->rows + threads - 1) / threads;
        const int64_t by_bytes = mat->stride >= CHUNK ? 1 : CHUNK / mat->stride;
        int64_t per = a && by_bytes < even ? by_bytes : even;
        if (per < 1) per = 1;
        if ((mat->rows + per - 1) / per > MAX_PIECES - work->count)
            per = (mat->rows + (MAX_PIECES - work->count) - 1) / (MAX_PIECES - work->count);
        for (int64_t r0 = 0; r0 < mat->rows && work->count < MAX_PIECES; r0 += per) {
            work->mat[work->count] = which[j];
            work->r0[work->count] = r0;
            work->r1[work->count] = r0 + per < mat->rows ? r0 + per : mat->rows;
            work->count++;
        }
    }
}

static void piece(const step_mat_t *mat, const act_t *a, int64_t r0, int64_t r1,
                  const float *x, float *y) {
    const float *bias = mat->bias;
    if (a) {
        llmrun_q8_rows(mat->type, mat->w, mat->stride, r0, r1, a, y, bias);
    } else {
        /* inside the step's team this call's own parallel loop runs on this thread */
        llmrun_matvec(mat->type, mat->w + r0 * mat->stride, mat->stride, r1 - r0, x, 1,
                      mat->cols, y + r0, bias ? bias + r0 : NULL);
    }
}

static void rms_norm(const step_layer_t *layer, const float *x, const float *weight, int64_t n,
                     float *y) {
    llmrun_rms_norm_offset(x, weight, layer->norm_offset, layer->eps, 1, n, y);
}

/* Scratch: every vector a layer makes, sized for the largest layer. */
typedef struct {
    float *h, *q, *k, *v, *qr, *kr, *att, *y, *gate, *up, *prod;
    acts_t acts;
    work_t work;
} scratch_t;

static void scratch_free(scratch_t *s) {
    free(s->h);
    for (int i = 0; i < ACT_SLOTS; i++) free(s->acts.buf[i]);
    free(s);
}

static scratch_t *scratch_new(const step_layer_t *layers, const step_t *step) {
    int64_t heads = 0, kv = 0, inter = 0;
    for (int64_t l = 0; l < step->layers; l++) {
        const step_layer_t *L = &layers[l];
        if ((int64_t)L->heads * L->head_dim > heads) heads = (int64_t)L->heads * L->head_dim;
        if ((int64_t)L->kv_heads * L->head_dim > kv) kv = (int64_t)L->kv_heads * L->head_dim;
        if (L->mat[MAT_GATE].rows > inter) inter = L->mat[MAT_GATE].rows;
    }
    scratch_t *s = calloc(1, sizeof(scratch_t));
    if (s == NULL) return NULL;
    const int64_t hidden = step->hidden;
    float *p = malloc(sizeof(float) * (size_t)(2 * hidden + 4 * heads + 3 * kv + 3 * inter));
    if (p == NULL) {
        free(s);
        return NULL;
    }
    s->h = p, p += hidden;
    s->y = p, p += hidden;
    s->q = p, p += heads;
    s->qr = p, p += heads;
    s->att = p, p += heads;
    p += heads;
    s->k = p, p += kv;
    s->kr = p, p += kv;
    s->v = p, p += kv;
    s->gate = p, p += inter;
    s->up = p, p += inter;
    s->prod = p;
    int64_t widest = hidden > heads ? hidden : heads;
    widest = widest > inter ? widest : inter;
    for (int i = 0; i < ACT_SLOTS; i++) {
        s->acts.buf[i] = q8_alloc(1, widest, &s->acts.a[i]);
        if (s->acts.buf[i] == NULL) {
            scratch_free(s);
            return NULL;
        }
    }
    return s;
}

/* The step: x [hidden] in, the last layer's output out. 0, or -1 where memory ran out
 * or a layer asks for what the kernels lack (nothing is written then). */
int llmrun_decode_layers(const step_layer_t *layers, const step_t *step, float *x) {
    for (int64_t l = 0; l < step->layers; l++) {
        const step_layer_t *L = &layers[l];
        if (L->head_dim % 16 || (L->kv_kind == KV_Q8_0 && L->head_dim % 32) ||
            L->rope < 0 || L->rope > 1)
            return -1;
        for (int j = 0; j < MATS; j++)
            if (L->mat[j].q8 && (!llmrun_q8_layout || !llmrun_q8_rows)) return -1;
    }
    scratch_t *s = scratch_new(layers, step);
    if (s == NULL) return -1;
    const int64_t hidden = step->hidden, pos = step->position;
    static const int QKV[3] = {MAT_Q, MAT_K, MAT_V}, O[1] = {MAT_O};
    static const int GATE_UP[2] = {MAT_GATE, MAT_UP}, DOWN[1] = {MAT_DOWN};
#pragma omp parallel
    {
        const int threads = omp_get_num_threads();
        work_t *work = &s->work;
        for (int64_t l = 0; l < step->layers; l++) {
            const step_layer_t *L = &layers[l];
            const int64_t hd = L->head_dim;
            const int64_t row = kv_row_bytes(L->kv_kind, hd);
            const int64_t slot = L->ring ? pos % L->ring : pos;
            const int64_t length = L->ring ? step->ring_keys : pos + 1;
#pragma omp single
            {
                rms_norm(L, x, L->input_norm, hidden, s->h);
                plan(work, L, QKV, 3, s->h, &s->acts, threads);
            }
            float *qkv_out[3] = {s->q, s->k, s->v};
#pragma omp for schedule(dynamic)
            for (int i = 0; i < work->count; i++) {
                const int j = work->mat[i];
                piece(&L->mat[j], work->act[j], work->r0[i], work->r1[i], s->h, qkv_out[j - MAT_Q]);
            }
#pragma omp single
            {
                if (L->q_norm) llmrun_rms_norm_offset(s->q, L->q_norm, L->norm_offset, L->eps, L->heads, hd, s->q);
                if (L->k_norm) llmrun_rms_norm_offset(s->k, L->k_norm, L->norm_offset, L->eps, L->kv_heads, hd, s->k);
                llmrun_rotary(s->q, L->heads, hd, step->cos[L->rope], step->sin[L->rope], step->rotary_dim, s->qr);
                llmrun_rotary(s->k, L->kv_heads, hd, step->cos[L->rope], step->sin[L->rope], step->rotary_dim, s->kr);
                for (int64_t g = 0; g < L->kv_heads; g++) {
                    kv_store(L->kv_kind, s->kr + g * hd, hd, L->k_cache + g * L->head_bytes + slot * row);
                    kv_store(L->kv_kind, s->v + g * hd, hd, L->v_cache + g * L->head_bytes + slot * row);
                }
            }
#pragma omp for schedule(static)
            for (int64_t g = 0; g < L->kv_heads; g++)
                llmrun_attend_kv_head(L->kv_kind, g, s->qr, L->k_cache, L->v_cache, L->heads,
                                      L->kv_heads, length, hd, L->head_bytes, L->scale,
                                      L->softcap, NULL, s->att);
#pragma omp single
            plan(work, L, O, 1, s->att, &s->acts, threads);
#pragma omp for schedule(dynamic)
            for (int i = 0; i < work->count; i++)
                piece(&L->mat[MAT_O], work->act[MAT_O], work->r0[i], work->r1[i], s->att, s->y);
#pragma omp single
            {
                if (L->post_attn_norm) rms_norm(L, s->y, L->post_attn_norm, hidden, s->y);
                for (int64_t i = 0; i < hidden; i++) x[i] += s->y[i];
                rms_norm(L, x, L->pre_ffn_norm, hidden, s->h);
                /* pieces of the gate only: each takes the same rows of the up matrix too */
                plan(work, L, GATE_UP, 2, s->h, &s->acts, threads);
                int kept = 0;
                for (int i = 0; i < work->count; i++)
                    if (work->mat[i] == MAT_GATE) {
                        work->r0[kept] = work->r0[i], work->r1[kept] = work->r1[i];
                        work->mat[kept++] = MAT_GATE;
                    }
                work->count = kept;
            }
#pragma omp for schedule(dynamic)
            for (int i = 0; i < work->count; i++) {
                const int64_t r0 = work->r0[i], r1 = work->r1[i];
                piece(&L->mat[MAT_GATE], work->act[MAT_GATE], r0, r1, s->h, s->gate);
                piece(&L->mat[MAT_UP], work->act[MAT_UP], r0, r1, s->h, s->up);
                if (L->act == ACT_GELU_TANH)
                    llmrun_gelu_tanh_mul(s->gate + r0, s->up + r0, r1 - r0, s->prod + r0);
                else
                    llmrun_silu_mul(s->gate + r0, s->up + r0, r1 - r0, s->prod + r0);
            }
#pragma omp single
            plan(work, L, DOWN, 1, s->prod, &s->acts, threads);
#pragma omp for schedule(dynamic)
            for (int i = 0; i < work->count; i++)
                piece(&L->mat[MAT_DOWN], work->act[MAT_DOWN], work->r0[i], work->r1[i], s->prod, s->y);
#pragma omp single
            {
                if (L->post_ffn_norm) rms_norm(L, s->y, L->post_ffn_norm, hidden, s->y);
                for (int64_t i = 0; i < hidden; i++) x[i] += s->y[i];
            }
        }
    }
    scratch_free(s);
    return 0;
}
