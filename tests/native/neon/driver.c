/* Runs the NEON kernel family (llmrun/native/kernels_neon.c with decode_ops.c) on the
 * test vectors that vectors.py writes, and prints one line per case: "ok KIND NAME"
 * or "FAIL KIND NAME: why". tests/native/test_neon.py cross-compiles it for aarch64
 * with the family's flags and runs it under qemu-user, so x86 machines test the
 * family too.
 *
 * usage: driver FOLDER (FOLDER/cases.txt lists the cases, FOLDER/I.bin holds the
 * arrays of the case on line I); exit status 0 when every case passes, 1 when one
 * fails, 2 when the vectors cannot be read.
 */
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The library's C API, as llmrun/native/__init__.py declares it */
int llmrun_available(void);
int llmrun_block(int type);
int llmrun_matvec(int type, const uint8_t *w, int64_t stride, int64_t rows, const float *x,
                  int64_t m, int64_t n, float *y, const float *bias);
int llmrun_matvec_experts(int type, const int64_t *ws, int64_t stride, int64_t rows,
                          const float *x, int64_t x_step, int64_t n, float *y, int64_t count);
int llmrun_dequantize(int type, const uint8_t *w, int64_t stride, int64_t rows, int64_t n,
                      float *out);
void llmrun_rms_norm(const float *x, const float *weight, float eps, int64_t rows, int64_t n,
                     float *y);
void llmrun_rms_norm_offset(const float *x, const float *weight, float offset, float eps,
                            int64_t rows, int64_t n, float *y);
void llmrun_rotary(const float *x, int64_t rows, int64_t dim, const float *cos,
                   const float *sin, int64_t rot, float *y);
void llmrun_silu_mul(const float *gate, const float *up, int64_t n, float *y);
void llmrun_gelu_tanh_mul(const float *gate, const float *up, int64_t n, float *y);
void llmrun_attend_one(const float *q, const float *k, const float *v, int64_t heads,
                       int64_t kv_heads, int64_t length, int64_t dim, int64_t head_stride,
                       float scale, float *y);
void llmrun_attend_one_capped(const float *q, const float *k, const float *v, int64_t heads,
                              int64_t kv_heads, int64_t length, int64_t dim,
                              int64_t head_stride, float scale, float softcap, float *y);
int llmrun_attend_one_stored(int kind, const float *q, const void *k, const void *v,
                             int64_t heads, int64_t kv_heads, int64_t length, int64_t dim,
                             int64_t head_bytes, float scale, float softcap, float *y);

static void die(const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vfprintf(stderr, fmt, args);
    va_end(args);
    fputc('\n', stderr);
    exit(2);
}

/* Why the current case failed; empty while it has not. */
static char failure[512];

static void fail(const char *fmt, ...) {
    if (failure[0]) return; /* the first reason is the one to read */
    va_list args;
    va_start(args, fmt);
    vsnprintf(failure, sizeof failure, fmt, args);
    va_end(args);
}

/* A case's data file, whose arrays take() hands out in order. */
typedef struct {
    uint8_t *data;
    size_t size, at;
    const char *path;
} blob_t;

static blob_t open_blob(const char *path) {
    FILE *f = fopen(path, "rb");
    if (f == NULL || fseek(f, 0, SEEK_END) != 0) die("cannot read %s", path);
    blob_t b = {NULL, (size_t)ftell(f), 0, path};
    rewind(f);
    b.data = malloc(b.size ? b.size : 1);
    if (b.data == NULL || fread(b.data, 1, b.size, f) != b.size) die("cannot read %s", path);
    fclose(f);
    return b;
}

static void *take(blob_t *b, int64_t bytes) {
    if (bytes < 0 || b->at + (size_t)bytes > b->size) die("%s is too short", b->path);
    void *p = b->data + b->at;
    b->at += (size_t)bytes;
    return p;
}

static void close_blob(blob_t *b) {
    if (b->at != b->size) die("%s is longer than its case", b->path);
    free(b->data);
}

static float *floats(int64_t count) {
    float *p = malloc(sizeof(float) * (size_t)(count ? count : 1));
    if (p == NULL) die("out of memory");
    return p;
}

/* got[i] and expected[i] have the same bits, or are both NaN (conversions may quiet a
 * signalling NaN) */
static void same_bits(const char *what, const float *got, const float *expected, int64_t count) {
    for (int64_t i = 0; i < count; i++) {
        uint32_t a, b;
        memcpy(&a, got + i, 4);
        memcpy(&b, expected + i, 4);
        if (isnan(expected[i]) ? !isnan(got[i]) : a != b) {
            fail("%s[%lld] = %.9g (0x%08x), expected %.9g (0x%08x)", what, (long long)i, got[i],
                 a, expected[i], b);
            return;
        }
    }
}

/* |got[i] - expected[i]| <= bound[i] (false for NaN) */
static void within(const char *what, const float *got, const double *expected,
                   const double *bound, int64_t count) {
    for (int64_t i = 0; i < count; i++)
        if (!(fabs((double)got[i] - expected[i]) <= bound[i])) {
            fail("%s[%lld] = %.9g, expected %.9g within %.3g", what, (long long)i, got[i],
                 expected[i], bound[i]);
            return;
        }
}

static void args(const char *text, int want, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    const int got = vsscanf(text, fmt, ap);
    va_end(ap);
    if (got != want) die("bad case arguments: %s", text);
}

/* Rows of `type` that the kernels take: a row length their block divides. */
static void check_block(int type, long long n) {
    const int block = llmrun_block(type);
    if (block <= 0 || n % block != 0) fail("llmrun_block(%d) = %d, for rows of %lld", type, block, n);
}

static void dequantize_case(const char *path, const char *text) {
    int type;
    long long rows, n, stride;
    args(text, 4, "%d %lld %lld %lld", &type, &rows, &n, &stride);
    check_block(type, n);
    blob_t b = open_blob(path);
    const uint8_t *w = take(&b, rows * stride);
    const float *expected = take(&b, 4 * rows * n);
    float *out = floats(rows * n);
    if (llmrun_dequantize(type, w, stride, rows, n, out) != 0) fail("llmrun_dequantize failed");
    same_bits("w", out, expected, rows * n);
    free(out);
    close_blob(&b);
}

static void matvec_case(const char *path, const char *text) {
    int type, with_bias;
    long long rows, n, stride, m;
    args(text, 6, "%d %lld %lld %lld %lld %d", &type, &rows, &n, &stride, &m, &with_bias);
    check_block(type, n);
    blob_t b = open_blob(path);
    const uint8_t *w = take(&b, rows * stride);
    const float *x = take(&b, 4 * m * n);
    const float *bias = with_bias ? take(&b, 4 * rows) : NULL;
    const double *expected = take(&b, 8 * m * rows), *bound = take(&b, 8 * m * rows);
    float *y = floats(m * rows);
    if (llmrun_matvec(type, w, stride, rows, x, m, n, y, bias) != 0) fail("llmrun_matvec failed");
    within("y", y, expected, bound, m * rows);
    free(y);
    close_blob(&b);
}

/* `count` matrices in one call: within the bound of the exact product, and the same
 * bits as a matvec of each matrix alone (the same kernel rows). */
static void experts_case(const char *path, const char *text) {
    int type;
    long long rows, n, stride, count, x_step;
    args(text, 6, "%d %lld %lld %lld %lld %lld", &type, &rows, &n, &stride, &count, &x_step);
    check_block(type, n);
    blob_t b = open_blob(path);
    const uint8_t *w = take(&b, count * rows * stride);
    const float *x = take(&b, 4 * (x_step ? count : 1) * n);
    const double *expected = take(&b, 8 * count * rows), *bound = take(&b, 8 * count * rows);
    int64_t *ws = malloc(sizeof(int64_t) * (size_t)count);
    float *y = floats(count * rows), *alone = floats(count * rows);
    if (ws == NULL) die("out of memory");
    for (long long j = 0; j < count; j++) {
        ws[j] = (int64_t)(intptr_t)(w + j * rows * stride);
        llmrun_matvec(type, w + j * rows * stride, stride, rows, x + j * x_step, 1, n,
                      alone + j * rows, NULL);
    }
    if (llmrun_matvec_experts(type, ws, stride, rows, x, x_step, n, y, count) != 0)
        fail("llmrun_matvec_experts failed");
    within("y", y, expected, bound, count * rows);
    same_bits("y (against each matrix's matvec)", y, alone, count * rows);
    free(ws);
    free(y);
    free(alone);
    close_blob(&b);
}

/* A layout the family leaves out: no block size, and every call refuses it. */
static void unsupported_case(const char *path, const char *text) {
    (void)path; /* no data */
    int type;
    args(text, 1, "%d", &type);
    if (llmrun_block(type) != 0) fail("llmrun_block(%d) = %d", type, llmrun_block(type));
    if (llmrun_matvec(type, NULL, 0, 0, NULL, 0, 0, NULL, NULL) != -1)
        fail("llmrun_matvec took type %d", type);
    if (llmrun_matvec_experts(type, NULL, 0, 0, NULL, 0, 0, NULL, 0) != -1)
        fail("llmrun_matvec_experts took type %d", type);
    if (llmrun_dequantize(type, NULL, 0, 0, 0, NULL) != -1)
        fail("llmrun_dequantize took type %d", type);
}

/* rms_norm at offset 0, rms_norm_offset at any */
static void norm(const char *path, const char *text, int with_offset) {
    long long rows, n;
    double eps, offset;
    args(text, 4, "%lld %lld %lf %lf", &rows, &n, &eps, &offset);
    blob_t b = open_blob(path);
    const float *x = take(&b, 4 * rows * n), *weight = take(&b, 4 * n);
    const double *expected = take(&b, 8 * rows * n), *bound = take(&b, 8 * rows * n);
    float *y = floats(rows * n);
    if (with_offset) llmrun_rms_norm_offset(x, weight, (float)offset, (float)eps, rows, n, y);
    else llmrun_rms_norm(x, weight, (float)eps, rows, n, y);
    within("y", y, expected, bound, rows * n);
    free(y);
    close_blob(&b);
}

static void rms_norm_case(const char *path, const char *text) { norm(path, text, 0); }

static void rms_norm_offset_case(const char *path, const char *text) { norm(path, text, 1); }

static void rotary_case(const char *path, const char *text) {
    long long rows, dim, rot;
    args(text, 3, "%lld %lld %lld", &rows, &dim, &rot);
    blob_t b = open_blob(path);
    const float *x = take(&b, 4 * rows * dim), *cos = take(&b, 4 * rot), *sin = take(&b, 4 * rot);
    const float *expected = take(&b, 4 * rows * dim);
    float *y = floats(rows * dim);
    llmrun_rotary(x, rows, dim, cos, sin, rot, y);
    same_bits("y", y, expected, rows * dim);
    free(y);
    close_blob(&b);
}

/* the gated products: y = act(gate) * up */
static void gated(const char *path, const char *text,
                  void (*product)(const float *, const float *, int64_t, float *)) {
    long long n;
    args(text, 1, "%lld", &n);
    blob_t b = open_blob(path);
    const float *gate = take(&b, 4 * n), *up = take(&b, 4 * n);
    const double *expected = take(&b, 8 * n), *bound = take(&b, 8 * n);
    float *y = floats(n);
    product(gate, up, n, y);
    within("y", y, expected, bound, n);
    free(y);
    close_blob(&b);
}

static void silu_mul_case(const char *path, const char *text) {
    gated(path, text, llmrun_silu_mul);
}

static void gelu_tanh_mul_case(const char *path, const char *text) {
    gated(path, text, llmrun_gelu_tanh_mul);
}

/* attend_one without a cap, attend_one_capped with any */
static void attend(const char *path, const char *text, int capped) {
    long long heads, kv_heads, length, dim, head_stride;
    double scale, softcap;
    args(text, 7, "%lld %lld %lld %lld %lld %lf %lf", &heads, &kv_heads, &length, &dim,
         &head_stride, &scale, &softcap);
    blob_t b = open_blob(path);
    const float *q = take(&b, 4 * heads * dim);
    const float *k = take(&b, 4 * kv_heads * head_stride), *v = take(&b, 4 * kv_heads * head_stride);
    const double *expected = take(&b, 8 * heads * dim), *bound = take(&b, 8 * heads * dim);
    float *y = floats(heads * dim);
    if (capped)
        llmrun_attend_one_capped(q, k, v, heads, kv_heads, length, dim, head_stride, (float)scale,
                                 (float)softcap, y);
    else llmrun_attend_one(q, k, v, heads, kv_heads, length, dim, head_stride, (float)scale, y);
    within("y", y, expected, bound, heads * dim);
    free(y);
    close_blob(&b);
}

static void attend_one_case(const char *path, const char *text) { attend(path, text, 0); }

static void attend_one_capped_case(const char *path, const char *text) {
    attend(path, text, 1);
}

/* A cache stored as f16, bf16 or Q8_0: within the bound of the float64 reference,
 * and the same bits as the f32 kernel on the dequantized cache. */
static void attend_one_stored_case(const char *path, const char *text) {
    int kind;
    long long heads, kv_heads, length, dim, capacity, head_bytes;
    double scale, softcap;
    args(text, 9, "%d %lld %lld %lld %lld %lld %lld %lf %lf", &kind, &heads, &kv_heads, &length,
         &dim, &capacity, &head_bytes, &scale, &softcap);
    blob_t b = open_blob(path);
    const float *q = take(&b, 4 * heads * dim);
    const void *k = take(&b, kv_heads * head_bytes), *v = take(&b, kv_heads * head_bytes);
    /* the same cache dequantized, f32 */
    const float *kf = take(&b, 4 * kv_heads * capacity * dim);
    const float *vf = take(&b, 4 * kv_heads * capacity * dim);
    const double *expected = take(&b, 8 * heads * dim), *bound = take(&b, 8 * heads * dim);
    float *y = floats(heads * dim), *f32 = floats(heads * dim);
    if (llmrun_attend_one_stored(kind, q, k, v, heads, kv_heads, length, dim, head_bytes,
                                 (float)scale, (float)softcap, y) != 0)
        fail("llmrun_attend_one_stored refused kind %d", kind);
    llmrun_attend_one_capped(q, kf, vf, heads, kv_heads, length, dim, capacity * dim,
                             (float)scale, (float)softcap, f32);
    within("y", y, expected, bound, heads * dim);
    same_bits("y (against the f32 kernel on the dequantized cache)", y, f32, heads * dim);
    free(y);
    free(f32);
    close_blob(&b);
}

static const struct {
    const char *kind;
    void (*run)(const char *path, const char *text);
} KINDS[] = {
    {"dequantize", dequantize_case},
    {"matvec", matvec_case},
    {"experts", experts_case},
    {"unsupported", unsupported_case},
    {"rms_norm", rms_norm_case},
    {"rms_norm_offset", rms_norm_offset_case},
    {"rotary", rotary_case},
    {"silu_mul", silu_mul_case},
    {"gelu_tanh_mul", gelu_tanh_mul_case},
    {"attend_one", attend_one_case},
    {"attend_one_capped", attend_one_capped_case},
    {"attend_one_stored", attend_one_stored_case},
};

int main(int argc, char **argv) {
    if (argc != 2) die("usage: %s FOLDER", argv[0]);
    if (!llmrun_available()) {
        puts("FAIL available: llmrun_available() == 0");
        return 1;
    }
    char path[1024], line[1024];
    snprintf(path, sizeof path, "%s/cases.txt", argv[1]);
    FILE *f = fopen(path, "r");
    if (f == NULL) die("cannot read %s", path);
    int failed = 0;
    for (int number = 1; fgets(line, sizeof line, f); number++) {
        char kind[32], name[256];
        int used = 0;
        if (sscanf(line, "%31s %255s %n", kind, name, &used) < 2) die("bad case: %s", line);
        size_t k = 0;
        while (k < sizeof KINDS / sizeof KINDS[0] && strcmp(KINDS[k].kind, kind) != 0) k++;
        if (k == sizeof KINDS / sizeof KINDS[0]) die("unknown case kind: %s", kind);
        snprintf(path, sizeof path, "%s/%d.bin", argv[1], number);
        failure[0] = '\0';
        KINDS[k].run(path, line + used);
        if (failure[0]) printf("FAIL %s %s: %s\n", kind, name, failure);
        else printf("ok %s %s\n", kind, name);
        failed += failure[0] != '\0';
    }
    fclose(f);
    return failed ? 1 : 0;
}
