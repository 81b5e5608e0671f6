/* One decode step of a whole stack of decoder layers, for one sequence, in one call
 * (llmrun/quant/decode_step.py builds its description and calls it).
 *
 * Driven op by op from Python, a token of a 24-layer model makes ~170 matvec calls and
 * ~300 small ops, each paying Python, ctypes and an OpenMP fork and join: ~6 ms of a
 * ~25 ms token measured on a 0.5B model. Here one OpenMP team runs the whole step: per
 * layer, RMSNorm (Gemma's offset form; none before OLMo's sublayers), the q/k/v
 * matvecs as one pool of row ranges, the q/k norms (per head, or OLMo's over the
 * whole projection), the rotary embedding (none in SmolLM3's NoPE layers), Granite's
 * query scale, the write of the new key and value into the cache as it stores them,
 * attention per KV head (with gpt-oss's sinks), the output matvec (Gemma 2/3 and
 * OLMo: its post-norm; Granite: times its residual multiplier), the residual; then the
 * feed-forward: the gate and up matvecs with the SiLU, tanh-GELU or gpt-oss's clamped
 * SwiGLU product of each row range, the down matvec (its post-norm, its residual
 * multiplier, as attention's) and the residual; or, in a mixture-of-experts layer,
 * the router, the choice of experts (softmax then top-k, renormalized or not; or
 * gpt-oss's top-k then softmax), the chosen experts' gate/up and down matvecs (and
 * Qwen2-MoE's shared expert with its sigmoid gate) as pools of row ranges, and their
 * weighted sum. The threads meet at a barrier between phases and never leave the team.
 * Where the caller asks (step_t.head), the model's final norm and its output matrix
 * follow as one more phase, so a token's logits come out of the same call: between
 * two calls, Python and torch run with caches the weights have just swept.
 *
 * It takes one row, or (where the feed-forwards are dense) several sequences at once,
 * each at its own position, as serve's scheduler decodes them: their matvecs share
 * each read of the weights, and each row attends to its own keys, in a contiguous
 * cache (one row: Gemma's windowed rings too) or through the block tables of a paged
 * one (sliding-window layers in a pool of their own, with tables of their own), within
 * its layer's sliding window.
 *
 * The arithmetic is the ops' own: llmrun_matvec or, where a matrix asks for 8-bit
 * activations, llmrun_q8_rows on activations quantized once per phase (q8.h); the
 * ops of decode_ops.c. So the step computes what the op-by-op path computes, to the
 * order of float sums. Where a router's k-th and next choice tie (to 1e-6), the step
 * stops before that layer and says so: the caller's layers take it from there, as
 * torch.topk breaks ties in its own way.
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
                          const int32_t *table, int64_t block_rows, int64_t block_bytes,
                          int64_t first, int64_t length, int64_t heads, int64_t kv_heads,
                          int64_t dim, int64_t head_bytes, float scale, float softcap,
                          const float *sinks, float *y);
/* The 8-bit-activation kernels, where the family has them (q8_*.c; not NEON). */
int llmrun_q8_layout(int type, int *order, int *offset) __attribute__((weak));
int llmrun_q8_rows(int type, const uint8_t *w, int64_t stride, int64_t r0, int64_t r1,
                   const act_t *a, float *y, const float *bias) __attribute__((weak));

/* One weight matrix: `rows` rows of `cols` weights of kernel type `type`, `stride` bytes
 * apart; q8: through the 8-bit-activation kernel. w NULL: no such matrix. */
typedef struct {
    const uint8_t *w;
    const float *bias; /* NULL: none */
    int64_t stride, rows, cols;
    int32_t type, q8;
} step_mat_t;

enum { MAT_Q, MAT_K, MAT_V, MAT_O, MAT_GATE, MAT_UP, MAT_DOWN, MATS };
enum { ACT_SILU = 0, ACT_GELU_TANH = 1, ACT_CLAMPED_SWIGLU = 2 };
enum { ROUTE_SOFTMAX_TOPK = 0, ROUTE_TOPK_SOFTMAX = 1 };
enum { KV_F32 = 0, KV_F16 = 1, KV_Q8_0 = 8, KV_BF16 = 30 };
enum { PROJ_GATE, PROJ_UP, PROJ_DOWN };
#define MAX_TOP_K 32
#define MAX_ROWS 64 /* sequences a step takes at once */

/* A mixture-of-experts feed-forward (decode_step.py: Moe, the same fields in order):
 * per projection (gate, up, down) every expert's weight address, one type, stride and
 * shape; the router; Qwen2-MoE's shared expert's gate (a 1-row matrix; the layer's
 * gate/up/down matrices are then the shared expert). */
typedef struct {
    const int64_t *addr[3];
    const float *bias[3]; /* [experts, rows] each, or NULL */
    int64_t stride[3];
    int32_t type[3], q8[3];
    step_mat_t router, shared_gate;
    int64_t width; /* an expert's gate and up rows */
    int32_t experts, top_k, route, normalize;
} step_moe_t;

/* One layer (decode_step.py: Layer, the same fields in this order). */
typedef struct {
    step_mat_t mat[MATS];
    const float *input_norm, *post_attn_norm, *pre_ffn_norm, *post_ffn_norm; /* NULL: none */
    const float *q_norm, *k_norm; /* per-head RMSNorm of queries and keys; NULL: none */
    const float *sinks;           /* gpt-oss: a logit per query head; NULL: none */
    const step_moe_t *moe;        /* NULL: a dense feed-forward */
    uint8_t *k_cache, *v_cache; /* row 0's position 0 (a ring: slot 0), KV head 0; paged:
                                   the layer's block 0 */
    int64_t head_bytes;         /* from one KV head's run of positions to the next */
    int64_t ring;               /* a sliding-window ring's slots; 0: a full layer */
    int64_t window;             /* keys it attends to at most (a sliding window); 0: all */
    float norm_offset, eps, scale, softcap; /* softcap 0: none */
    float alpha, limit;                     /* ACT_CLAMPED_SWIGLU */
    int32_t heads, kv_heads, head_dim, act, rope, kv_kind;
    int32_t kv_group; /* a paged cache: which of the step's tables (a pool of its own) */
    /* the values each q_norm and k_norm spans: head_dim (a norm per head), or all the
       heads' (OLMo's norm of the whole projection) */
    int32_t q_norm_width, k_norm_width;
    int32_t nope;      /* 1: no RoPE in this layer (SmolLM3's NoPE layers) */
    float query_scale; /* the rotated queries times this (Granite); 1: none */
    float residual;    /* each sublayer's output times this before the sum (Granite); 1: none */
} step_layer_t;

/* The tokens, one per row (decode_step.py: Step). */
typedef struct {
    const float *cos[2], *sin[2]; /* [rows, rotary_dim] each, per kind of layer (.rope) */
    const int64_t *positions;     /* [rows] */
    const int32_t *tables[2];     /* a paged cache's block tables [rows, table_width] per
                                     group of layers (.kv_group); NULL: a contiguous cache */
    int64_t table_width[2], block_bytes[2];
    int64_t pool_blocks[2]; /* a paged cache: the blocks of each group's pool */
    int64_t block_rows;
    int64_t row_bytes; /* a contiguous cache: from one row's keys to the next's */
    int64_t capacity;  /* a contiguous cache: the positions a row holds */
    int64_t rows, rotary_dim, hidden, layers;
    int64_t ring_keys; /* one row: the slots of a ring that hold keys, after the write */
    /* the final norm (weight + offset, eps) and output matrix into logits [rows,
     * head.rows]; head.w NULL: none (exact heads take one row only) */
    const float *final_norm;
    float final_offset, final_eps;
    step_mat_t head;
    float *logits;
} step_t;

/* A phase's matrices (jobs) and their pieces of rows. A job multiplies its matrix by
 * m rows of `in` ([m, cols]) into `out` ([m, out_width], by absolute row). A gate's
 * job names its up job: each piece of the gate takes the same rows of the up matrix
 * and writes the layer's product of the two to prod. */
#define MAX_JOBS 320
#define MAX_PIECES 4096
#define ACT_SLOTS (MAX_JOBS / 2 + 8) /* every job of a phase its own input */
typedef struct {
    step_mat_t mat;
    const float *in;
    const act_t *act; /* in's quantized form, for a q8 matrix */
    float *out, *prod;
    int64_t m, out_width;
    int up; /* -1: none */
} job_t;

typedef struct {
    job_t job[MAX_JOBS];
    int jobs, pieces;
    int64_t rows; /* of activations, the step's */
    int32_t piece_job[MAX_PIECES];
    int64_t r0[MAX_PIECES], r1[MAX_PIECES];
    /* quantized activations: per slot, the vectors and layout it holds, and the rows
     * its buffers have room for (kept from call to call) */
    act_t a[ACT_SLOTS];
    const float *a_in[ACT_SLOTS];
    int64_t a_rows[ACT_SLOTS]; /* of in, quantized */
    int a_order[ACT_SLOTS], a_offset[ACT_SLOTS], a_used;
    void *a_buf[ACT_SLOTS];
    int64_t a_room[ACT_SLOTS];
    int64_t a_width;
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

/* The m rows of in, quantized for `mat`'s kernel: made once per phase, input and
 * layout; NULL where there is no room (the job then takes the exact kernel). */
static const act_t *act_for(work_t *work, const step_mat_t *mat, const float *in, int64_t m) {
    int order, offset;
    if (llmrun_q8_layout(mat->type, &order, &offset)) return NULL;
    for (int i = 0; i < work->a_used; i++)
        if (work->a_in[i] == in && work->a_rows[i] >= m && work->a_order[i] == order &&
            work->a_offset[i] == offset)
            return &work->a[i];
    if (work->a_used == ACT_SLOTS) return NULL;
    const int i = work->a_used;
    act_t *a = &work->a[i];
    if (work->a_room[i] < m) {
        free(work->a_buf[i]);
        work->a_buf[i] = q8_alloc(m, work->a_width, a);
        work->a_room[i] = work->a_buf[i] ? m : 0;
        if (work->a_buf[i] == NULL) return NULL;
    }
    work->a_used++;
    work->a_in[i] = in, work->a_rows[i] = m, work->a_order[i] = order, work->a_offset[i] = offset;
    /* the buffers' rows are laid out for the widest vector: x's rows, then q8_quantize's */
    a->n = mat->cols;
    for (int64_t b = 0; b < m; b++) {
        act_t row = *a;
        row.q += b * a->q_step, row.lane += b * a->lane_step, row.dq += b * a->lane_step;
        row.d += b * a->d_step, row.s += b * a->d_step;
        const float *x = in + b * mat->cols;
        switch (order) {
        case ORDER_QUADS: q8_quantize(x, 1, mat->cols, ORDER_QUADS, offset, &row); break;
        case ORDER_K_PAIRS: q8_quantize(x, 1, mat->cols, ORDER_K_PAIRS, offset, &row); break;
        case ORDER_Q8_K: q8_quantize(x, 1, mat->cols, ORDER_Q8_K, offset, &row); break;
        case ORDER_Q8_K_PAIRS: q8_quantize(x, 1, mat->cols, ORDER_Q8_K_PAIRS, offset, &row); break;
        default: q8_quantize(x, 1, mat->cols, ORDER_NATURAL, offset, &row); break;
        }
    }
    return a;
}

static void begin(work_t *work) { work->jobs = work->pieces = work->a_used = 0; }

/* A job: mat against m rows of `in` into `out` ([m, out_width]); its index. */
static int add_job(work_t *work, const step_mat_t *mat, const float *in, int64_t m, float *out,
                   int64_t out_width) {
    job_t *job = &work->job[work->jobs];
    job->mat = *mat;
    job->in = in, job->m = m, job->out = out, job->out_width = out_width;
    job->prod = NULL, job->up = -1;
    job->act = mat->q8 && llmrun_q8_rows ? act_for(work, mat, in, m) : NULL;
    return work->jobs++;
}

/* A gate job and its up job, whose pieces write act(gate, up) to prod (all three
 * [m, the gate's rows]). */
static void add_gate_up(work_t *work, const step_mat_t *gate, const step_mat_t *up,
                        const float *in, int64_t m, float *gate_out, float *up_out, float *prod) {
    const int g = add_job(work, gate, in, m, gate_out, gate->rows);
    const int u = add_job(work, up, in, m, up_out, gate->rows);
    work->job[g].up = u, work->job[g].prod = prod;
}

/* Pieces of every job but the up jobs (their gates take them): 8-bit ones in runs of
 * about CHUNK bytes (as row_chunk, for `threads`), the others one per thread (each
 * call prepares its activations). */
static void split(work_t *work, int threads) {
    char is_up[MAX_JOBS] = {0};
    for (int j = 0; j < work->jobs; j++)
        if (work->job[j].up >= 0) is_up[work->job[j].up] = 1;
    for (int j = 0; j < work->jobs; j++) {
        if (is_up[j]) continue;
        const step_mat_t *mat = &work->job[j].mat;
        const int64_t even = (mat->rows + threads - 1) / threads;
        const int64_t by_bytes = mat->stride >= CHUNK ? 1 : CHUNK / mat->stride;
        int64_t per = work->job[j].act && by_bytes < even ? by_bytes : even;
        const int64_t room = MAX_PIECES - work->pieces;
        if (per < 1) per = 1;
        if ((mat->rows + per - 1) / per > room) per = (mat->rows + room - 1) / room;
        for (int64_t r0 = 0; r0 < mat->rows && work->pieces < MAX_PIECES; r0 += per) {
            work->piece_job[work->pieces] = j;
            work->r0[work->pieces] = r0;
            work->r1[work->pieces] = r0 + per < mat->rows ? r0 + per : mat->rows;
            work->pieces++;
        }
    }
}

/* Rows r0 .. r1 - 1 of a job's matrix for each of its rows of activations; tmp holds
 * rows x (r1 - r0) floats. */
static void rows_of(const job_t *job, int64_t r0, int64_t r1, float *tmp) {
    const int64_t rows = job->m;
    const step_mat_t *mat = &job->mat;
    const float *bias = mat->bias;
    if (job->act) {
        const act_t *a = job->act;
        for (int64_t b = 0; b < rows; b++) {
            act_t row = *a;
            row.q += b * a->q_step, row.lane += b * a->lane_step, row.dq += b * a->lane_step;
            row.d += b * a->d_step, row.s += b * a->d_step;
            llmrun_q8_rows(mat->type, mat->w, mat->stride, r0, r1, &row,
                           job->out + b * job->out_width, bias);
        }
        return;
    }
    /* inside the step's team this call's own parallel loop runs on this thread */
    const uint8_t *w = mat->w + r0 * mat->stride;
    const float *b0 = bias ? bias + r0 : NULL;
    if (rows == 1) {
        llmrun_matvec(mat->type, w, mat->stride, r1 - r0, job->in, 1, mat->cols, job->out + r0, b0);
        return;
    }
    llmrun_matvec(mat->type, w, mat->stride, r1 - r0, job->in, rows, mat->cols, tmp, b0);
    for (int64_t b = 0; b < rows; b++)
        memcpy(job->out + b * job->out_width + r0, tmp + b * (r1 - r0),
               sizeof(float) * (size_t)(r1 - r0));
}

/* gpt-oss's clamped SwiGLU: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g),
 * g = min(gate, limit), in transformers' order of operations */
static void clamped_swiglu(const float *gate, const float *up, int64_t n, float alpha,
                           float limit, float *y) {
    for (int64_t i = 0; i < n; i++) {
        const float g = gate[i] < limit ? gate[i] : limit;
        const float u = up[i] < -limit ? -limit : up[i] > limit ? limit : up[i];
        y[i] = (u + 1.0f) * (g * (1.0f / (1.0f + expf(-(g * alpha)))));
    }
}

static void run_piece(const work_t *work, int i, const step_layer_t *layer, float *tmp) {
    const job_t *job = &work->job[work->piece_job[i]];
    const int64_t r0 = work->r0[i], r1 = work->r1[i];
    rows_of(job, r0, r1, tmp);
    if (job->up < 0) return;
    const job_t *up = &work->job[job->up];
    rows_of(up, r0, r1, tmp);
    for (int64_t b = 0; b < job->m; b++) {
        const float *g = job->out + b * job->out_width + r0, *u = up->out + b * up->out_width + r0;
        float *y = job->prod + b * job->out_width + r0;
        if (layer->act == ACT_GELU_TANH)
            llmrun_gelu_tanh_mul(g, u, r1 - r0, y);
        else if (layer->act == ACT_CLAMPED_SWIGLU)
            clamped_swiglu(g, u, r1 - r0, layer->alpha, layer->limit, y);
        else
            llmrun_silu_mul(g, u, r1 - r0, y);
    }
}

/* The layer's RMSNorm of rows of x into y; weight NULL: no norm there (OLMo has none
 * before its sublayers), y a copy of x. */
static void rms_norm(const step_layer_t *layer, const float *x, const float *weight, int64_t rows,
                     int64_t n, float *y) {
    if (weight)
        llmrun_rms_norm_offset(x, weight, layer->norm_offset, layer->eps, rows, n, y);
    else if (y != x)
        memcpy(y, x, sizeof(float) * (size_t)(rows * n));
}

/* n values of y times the layer's residual multiplier, where it has one. */
static void scale_residual(const step_layer_t *layer, float *y, int64_t n) {
    if (layer->residual != 1.0f)
        for (int64_t i = 0; i < n; i++) y[i] *= layer->residual;
}

/* The router's choice from its logits: top_k experts and their weights; 0, or -1 where
 * the k-th and the next tie to 1e-6 (torch.topk would break the tie its own way). */
static int route(const step_moe_t *moe, const float *logits, int32_t *chosen, float *weight) {
    const int n = moe->experts, k = moe->top_k;
    if (n < 1 || k < 1 || k > n) return -1;
    float p[n];
    if (moe->route == ROUTE_SOFTMAX_TOPK) {
        float top = -INFINITY, sum = 0.0f;
        for (int e = 0; e < n; e++) top = logits[e] > top ? logits[e] : top;
        for (int e = 0; e < n; e++) sum += p[e] = expf(logits[e] - top);
        for (int e = 0; e < n; e++) p[e] /= sum;
    } else {
        memcpy(p, logits, sizeof(float) * (size_t)n);
    }
    char taken[n];
    memset(taken, 0, (size_t)n);
    for (int j = 0; j <= k && j < n; j++) {
        int best = -1;
        for (int e = 0; e < n; e++)
            if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
        if (j == k) { /* the first one left out */
            const float a = p[chosen[k - 1]], b = p[best];
            if (fabsf(a - b) <= 1e-6f * fmaxf(fabsf(a), fabsf(b))) return -1;
            break;
        }
        taken[best] = 1;
        chosen[j] = best;
        weight[j] = p[best];
    }
    if (moe->route == ROUTE_TOPK_SOFTMAX) {
        float sum = 0.0f;
        for (int j = 0; j < k; j++) sum += weight[j] = expf(weight[j] - p[chosen[0]]);
        for (int j = 0; j < k; j++) weight[j] /= sum;
    } else if (moe->normalize) {
        float sum = 0.0f;
        for (int j = 0; j < k; j++) sum += weight[j];
        for (int j = 0; j < k; j++) weight[j] /= sum;
    }
    return 0;
}

/* Expert e's projection as a matrix. */
static step_mat_t expert(const step_moe_t *moe, int proj, int e, int64_t hidden) {
    const int64_t rows = proj == PROJ_DOWN ? hidden : moe->width;
    const step_mat_t mat = {
        .w = (const uint8_t *)(intptr_t)moe->addr[proj][e],
        .bias = moe->bias[proj] ? moe->bias[proj] + e * rows : NULL,
        .stride = moe->stride[proj],
        .rows = rows,
        .cols = proj == PROJ_DOWN ? moe->width : hidden,
        .type = moe->type[proj],
        .q8 = moe->q8[proj],
    };
    return mat;
}

/* The rows' chosen experts (s->chosen, n pairs), each expert once: the pairs that chose
 * it take consecutive slots, so that one job per expert and matrix reads its weights
 * once for all those rows (serve's batched step; the rows' experts of different rows
 * overlap most where a model has few experts, as Mixtral's 2 of 8). */
static void group_experts(int32_t *chosen, int64_t n, int32_t *slot, int32_t *pair,
                          int32_t *first, int32_t *groups) {
    char placed[MAX_TOP_K * MAX_ROWS] = {0};
    int32_t next = 0, g = 0;
    for (int64_t p = 0; p < n; p++) {
        if (placed[p]) continue;
        first[g++] = next;
        for (int64_t q = p; q < n; q++)
            if (!placed[q] && chosen[q] == chosen[p]) {
                placed[q] = 1;
                pair[next] = (int32_t)q;
                slot[q] = next++;
            }
    }
    first[g] = next;
    *groups = g;
}

/* Where row b's keys (or values) of KV head g at position p go. */
static uint8_t *kv_at(const step_t *step, const step_layer_t *L, uint8_t *base, int64_t b,
                      int64_t p, int64_t g) {
    const int64_t row = kv_row_bytes(L->kv_kind, L->head_dim);
    const int32_t *tables = step->tables[L->kv_group];
    if (tables) {
        const int64_t block = tables[b * step->table_width[L->kv_group] + p / step->block_rows];
        return base + block * step->block_bytes[L->kv_group] + g * L->head_bytes +
               p % step->block_rows * row;
    }
    const int64_t slot = L->ring ? p % L->ring : p;
    return base + b * step->row_bytes + g * L->head_bytes + slot * row;
}

/* Scratch: every vector a layer makes, for every row, sized for the largest layer; kept
 * by the calling thread from one step to the next, so a token maps no new memory. */
typedef struct {
    float *h, *q, *k, *v, *qr, *kr, *att, *y, *gate, *up, *prod, *x_in, *logits, *shared_logit;
    /* the chosen experts' slots (grouped by expert: see group_experts): their input
       [rows * k, hidden], gate, up, product [rows * k, width] and down [rows * k, hidden] */
    float *eh, *eg, *eu, *ep, *ey;
    float *tmp; /* per thread: a piece's rows of every activation row */
    int64_t tmp_size, floats;
    int32_t chosen[MAX_TOP_K * MAX_ROWS];
    float weight[MAX_TOP_K * MAX_ROWS];
    /* pair b * k + j (row b's j-th expert) -> its slot, and back; group g of the
       experts chosen (each once): slots first[g] .. first[g + 1] - 1 */
    int32_t slot[MAX_TOP_K * MAX_ROWS], pair[MAX_TOP_K * MAX_ROWS];
    int32_t first[MAX_TOP_K * MAX_ROWS + 1], groups;
    int stop;
    work_t work;
} scratch_t;

static _Thread_local scratch_t *kept;

static scratch_t *scratch_for(const step_layer_t *layers, const step_t *step, int threads) {
    int64_t heads = 0, kv = 0, inter = 0, experts = 1, width = 1, top_k = 1;
    for (int64_t l = 0; l < step->layers; l++) {
        const step_layer_t *L = &layers[l];
        if ((int64_t)L->heads * L->head_dim > heads) heads = (int64_t)L->heads * L->head_dim;
        if ((int64_t)L->kv_heads * L->head_dim > kv) kv = (int64_t)L->kv_heads * L->head_dim;
        if (L->mat[MAT_GATE].w && L->mat[MAT_GATE].rows > inter) inter = L->mat[MAT_GATE].rows;
        if (L->moe) {
            if (L->moe->experts > experts) experts = L->moe->experts;
            if (L->moe->width > width) width = L->moe->width;
            if (L->moe->top_k > top_k) top_k = L->moe->top_k;
        }
    }
    const int64_t hidden = step->hidden, rows = step->rows, pairs = rows * top_k;
    int64_t widest = hidden > heads ? hidden : heads;
    widest = widest > inter ? widest : inter;
    widest = widest > width ? widest : width;
    /* a piece of an exact matrix is at most its rows over the threads, plus one */
    const int64_t tmp_size = rows > 1 ? rows * (widest / threads + 1) : 0;
    const int64_t floats = rows * (3 * hidden + 4 * heads + 3 * kv + 3 * inter + experts + 1) +
                           pairs * (3 * width + 2 * hidden) + threads * tmp_size;
    scratch_t *s = kept;
    if (s == NULL) {
        if ((s = calloc(1, sizeof(scratch_t))) == NULL) return NULL;
        kept = s;
    }
    if (s->work.a_width < widest) { /* the quantized activations' rows grow too */
        for (int i = 0; i < ACT_SLOTS; i++) {
            free(s->work.a_buf[i]);
            s->work.a_buf[i] = NULL, s->work.a_room[i] = 0;
        }
        s->work.a_width = widest;
    }
    if (s->floats < floats) {
        free(s->h);
        s->floats = 0;
        if ((s->h = malloc(sizeof(float) * (size_t)floats)) == NULL) return NULL;
        s->floats = floats;
    }
    float *p = s->h + rows * hidden;
    s->y = p, p += rows * hidden;
    s->x_in = p, p += rows * hidden;
    s->q = p, p += rows * heads;
    s->qr = p, p += rows * heads;
    s->att = p, p += rows * heads;
    p += rows * heads;
    s->k = p, p += rows * kv;
    s->kr = p, p += rows * kv;
    s->v = p, p += rows * kv;
    s->gate = p, p += rows * inter;
    s->up = p, p += rows * inter;
    s->prod = p, p += rows * inter;
    s->logits = p, p += rows * experts;
    s->shared_logit = p, p += rows;
    s->eh = p, p += pairs * hidden;
    s->eg = p, p += pairs * width;
    s->eu = p, p += pairs * width;
    s->ep = p, p += pairs * width;
    s->ey = p, p += pairs * hidden;
    s->tmp = p;
    s->tmp_size = tmp_size;
    return s;
}

#define PIECES(LAYER)                                                                    \
    _Pragma("omp for schedule(dynamic)")                                                 \
    for (int i = 0; i < work->pieces; i++)                                               \
        run_piece(work, i, (LAYER), s->tmp + omp_get_thread_num() * s->tmp_size)

/* A q or k norm's span: one head's values or all of them. */
static int norm_width_ok(int64_t width, int64_t heads, int64_t head_dim) {
    return width == head_dim || width == heads * head_dim;
}

/* The step: x [rows, hidden] in, the output of the layers it ran out (and with a head,
 * the logits, where it ran every layer). Returns how many layers it ran (all, or fewer
 * where a router tied: x is then the next layer's input), or -1 where memory ran out or
 * a layer asks for what it cannot do (nothing written). */
int llmrun_decode_layers(const step_layer_t *layers, const step_t *step, float *x) {
    const int64_t rows = step->rows;
    if (rows < 1 || rows > MAX_ROWS || (rows > 1 && step->tables[0] == NULL && step->ring_keys))
        return -1;
    /* A position the cache has no room for, or a table entry up to it outside its pool,
     * is the caller's layers' to refuse (the step would write or read outside the
     * cache; torch's indexing checks). */
    for (int64_t b = 0; b < rows; b++) {
        const int64_t p = step->positions[b];
        if (p < 0 || (!step->tables[0] && p >= step->capacity)) return -1;
        for (int g = 0; g < 2 && step->tables[0]; g++) {
            if (!step->tables[g]) continue;
            const int64_t at = p / step->block_rows, width = step->table_width[g];
            if (at >= width) return -1;
            const int32_t *table = step->tables[g] + b * width;
            for (int64_t j = 0; j <= at; j++)
                if (table[j] < 0 || table[j] >= step->pool_blocks[g]) return -1;
        }
    }
    for (int64_t l = 0; l < step->layers; l++) {
        const step_layer_t *L = &layers[l];
        if (L->head_dim % 16 || (L->kv_kind == KV_Q8_0 && L->head_dim % 32) ||
            L->rope < 0 || L->rope > 1 || L->kv_group < 0 || L->kv_group > 1 ||
            (L->ring && (rows > 1 || step->tables[0])) || (step->tables[0] && !step->tables[L->kv_group]) ||
            (L->q_norm && !norm_width_ok(L->q_norm_width, L->heads, L->head_dim)) ||
            (L->k_norm && !norm_width_ok(L->k_norm_width, L->kv_heads, L->head_dim)) ||
            (L->moe && L->residual != 1.0f) ||
            (L->moe && (L->moe->top_k > MAX_TOP_K || L->moe->top_k > L->moe->experts ||
                        2 * rows * L->moe->top_k + 3 > MAX_JOBS)))
            return -1;
        int q8 = 0;
        for (int j = 0; j < MATS; j++) q8 |= L->mat[j].q8;
        if (L->moe) q8 |= L->moe->q8[0] | L->moe->q8[1] | L->moe->q8[2] | L->moe->router.q8;
        if (q8 && (!llmrun_q8_layout || !llmrun_q8_rows)) return -1;
    }
    if (step->head.w && (step->head.cols != step->hidden || (!step->head.q8 && rows > 1) ||
                         (step->head.q8 && (!llmrun_q8_layout || !llmrun_q8_rows))))
        return -1;
    scratch_t *s = scratch_for(layers, step, omp_get_max_threads());
    if (s == NULL) return -1;
    s->stop = 0;
    const int64_t hidden = step->hidden;
    int64_t done = step->layers;
#pragma omp parallel
    {
        const int threads = omp_get_num_threads();
        work_t *work = &s->work;
        for (int64_t l = 0; l < step->layers; l++) {
            const step_layer_t *L = &layers[l];
            const step_moe_t *moe = L->moe;
            const int64_t hd = L->head_dim, qn = L->heads * hd, kn = L->kv_heads * hd;
#pragma omp single
            {
                memcpy(s->x_in, x, sizeof(float) * (size_t)(rows * hidden));
                rms_norm(L, x, L->input_norm, rows, hidden, s->h);
                begin(work);
                add_job(work, &L->mat[MAT_Q], s->h, rows, s->q, qn);
                add_job(work, &L->mat[MAT_K], s->h, rows, s->k, kn);
                add_job(work, &L->mat[MAT_V], s->h, rows, s->v, kn);
                split(work, threads);
            }
            PIECES(L);
#pragma omp single
            {
                if (L->q_norm) rms_norm(L, s->q, L->q_norm, rows * qn / L->q_norm_width, L->q_norm_width, s->q);
                if (L->k_norm) rms_norm(L, s->k, L->k_norm, rows * kn / L->k_norm_width, L->k_norm_width, s->k);
                for (int64_t b = 0; b < rows; b++) {
                    const float *cos = step->cos[L->rope] + b * step->rotary_dim;
                    const float *sin = step->sin[L->rope] + b * step->rotary_dim;
                    if (L->nope) {
                        memcpy(s->qr + b * qn, s->q + b * qn, sizeof(float) * (size_t)qn);
                        memcpy(s->kr + b * kn, s->k + b * kn, sizeof(float) * (size_t)kn);
                    } else {
                        llmrun_rotary(s->q + b * qn, L->heads, hd, cos, sin, step->rotary_dim, s->qr + b * qn);
                        llmrun_rotary(s->k + b * kn, L->kv_heads, hd, cos, sin, step->rotary_dim, s->kr + b * kn);
                    }
                    if (L->query_scale != 1.0f)
                        for (int64_t i = 0; i < qn; i++) s->qr[b * qn + i] *= L->query_scale;
                    const int64_t p = step->positions[b];
                    for (int64_t g = 0; g < L->kv_heads; g++) {
                        kv_store(L->kv_kind, s->kr + b * kn + g * hd, hd, kv_at(step, L, L->k_cache, b, p, g));
                        kv_store(L->kv_kind, s->v + b * kn + g * hd, hd, kv_at(step, L, L->v_cache, b, p, g));
                    }
                }
            }
#pragma omp for schedule(dynamic)
            for (int64_t i = 0; i < rows * L->kv_heads; i++) {
                const int64_t b = i / L->kv_heads, g = i % L->kv_heads, p = step->positions[b];
                int64_t first = 0, length = p + 1;
                if (L->ring) {
                    length = step->ring_keys;
                } else if (L->window && p + 1 > L->window) {
                    first = p + 1 - L->window;
                }
                const int32_t *tables = step->tables[L->kv_group];
                const int32_t *table = tables ? tables + b * step->table_width[L->kv_group] : NULL;
                const int64_t at = table ? 0 : b * step->row_bytes;
                llmrun_attend_kv_head(L->kv_kind, g, s->qr + b * qn, L->k_cache + at, L->v_cache + at,
                                      table, step->block_rows, step->block_bytes[L->kv_group], first, length,
                                      L->heads, L->kv_heads, hd, L->head_bytes, L->scale,
                                      L->softcap, L->sinks, s->att + b * qn);
            }
#pragma omp single
            {
                begin(work);
                add_job(work, &L->mat[MAT_O], s->att, rows, s->y, hidden);
                split(work, threads);
            }
            PIECES(L);
#pragma omp single
            {
                if (L->post_attn_norm) rms_norm(L, s->y, L->post_attn_norm, rows, hidden, s->y);
                scale_residual(L, s->y, rows * hidden);
                for (int64_t i = 0; i < rows * hidden; i++) x[i] += s->y[i];
                rms_norm(L, x, L->pre_ffn_norm, rows, hidden, s->h);
                begin(work);
                if (moe) {
                    add_job(work, &moe->router, s->h, rows, s->logits, moe->experts);
                    if (moe->shared_gate.w) add_job(work, &moe->shared_gate, s->h, rows, s->shared_logit, 1);
                } else {
                    add_gate_up(work, &L->mat[MAT_GATE], &L->mat[MAT_UP], s->h, rows, s->gate, s->up, s->prod);
                }
                split(work, threads);
            }
            PIECES(L);
            if (moe) {
                const int64_t k = moe->top_k, width = moe->width;
#pragma omp single
                {
                    s->stop = 0;
                    for (int64_t b = 0; b < rows && !s->stop; b++)
                        s->stop = route(moe, s->logits + b * moe->experts, s->chosen + b * k, s->weight + b * k) != 0;
                    if (s->stop) { /* the caller's layers take this one from its input */
                        memcpy(x, s->x_in, sizeof(float) * (size_t)(rows * hidden));
                        done = l;
                    } else {
                        /* each expert chosen once, with the rows that chose it: a lone
                         * row takes its own input (quantized once for all its experts),
                         * more rows a copy of theirs in slot order */
                        begin(work);
                        group_experts(s->chosen, rows * k, s->slot, s->pair, s->first, &s->groups);
                        for (int g = 0; g < s->groups; g++) {
                            const int64_t at = s->first[g], m = s->first[g + 1] - at;
                            const int e = s->chosen[s->pair[at]];
                            const float *in = s->h + s->pair[at] / k * hidden;
                            if (m > 1) {
                                for (int64_t i = at; i < at + m; i++)
                                    memcpy(s->eh + i * hidden, s->h + s->pair[i] / k * hidden,
                                           sizeof(float) * (size_t)hidden);
                                in = s->eh + at * hidden;
                            }
                            const step_mat_t gm = expert(moe, PROJ_GATE, e, hidden);
                            const step_mat_t um = expert(moe, PROJ_UP, e, hidden);
                            add_gate_up(work, &gm, &um, in, m, s->eg + at * width, s->eu + at * width,
                                        s->ep + at * width);
                        }
                        if (L->mat[MAT_GATE].w) /* the shared expert */
                            add_gate_up(work, &L->mat[MAT_GATE], &L->mat[MAT_UP], s->h, rows, s->gate, s->up, s->prod);
                        split(work, threads);
                    }
                }
                if (s->stop) break;
                PIECES(L);
#pragma omp single
                {
                    begin(work);
                    for (int g = 0; g < s->groups; g++) {
                        const int64_t at = s->first[g], m = s->first[g + 1] - at;
                        const step_mat_t d = expert(moe, PROJ_DOWN, s->chosen[s->pair[at]], hidden);
                        add_job(work, &d, s->ep + at * width, m, s->ey + at * hidden, hidden);
                    }
                    if (L->mat[MAT_DOWN].w) add_job(work, &L->mat[MAT_DOWN], s->prod, rows, s->y, hidden);
                    split(work, threads);
                }
                PIECES(L);
#pragma omp single
                for (int64_t b = 0; b < rows; b++) {
                    float *xb = x + b * hidden;
                    for (int64_t j = 0; j < k; j++) {
                        const float w = s->weight[b * k + j], *ey = s->ey + s->slot[b * k + j] * hidden;
                        for (int64_t i = 0; i < hidden; i++) xb[i] += w * ey[i];
                    }
                    if (L->mat[MAT_DOWN].w) {
                        const float gate = 1.0f / (1.0f + expf(-s->shared_logit[b]));
                        for (int64_t i = 0; i < hidden; i++) xb[i] += gate * s->y[b * hidden + i];
                    }
                }
            } else {
#pragma omp single
                {
                    begin(work);
                    add_job(work, &L->mat[MAT_DOWN], s->prod, rows, s->y, hidden);
                    split(work, threads);
                }
                PIECES(L);
#pragma omp single
                {
                    if (L->post_ffn_norm) rms_norm(L, s->y, L->post_ffn_norm, rows, hidden, s->y);
                    scale_residual(L, s->y, rows * hidden);
                    for (int64_t i = 0; i < rows * hidden; i++) x[i] += s->y[i];
                }
            }
        }
        if (step->head.w && !s->stop) {
#pragma omp single
            {
                llmrun_rms_norm_offset(x, step->final_norm, step->final_offset, step->final_eps, rows,
                                       hidden, s->h);
                begin(work);
                add_job(work, &step->head, s->h, rows, step->logits, step->head.rows);
                split(work, threads);
            }
            PIECES(layers);
        }
    }
    return (int)done;
}
