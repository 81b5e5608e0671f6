/* llama.cpp's merging of a GGUF vocabulary's pieces into tokens (llmrun.gguf_bpe): byte-pair
 * encoding by merge rank (tokenizer.ggml.model "gpt2" and "gemma4") over words already
 * pre-tokenized, and SentencePiece merging by token score ("llama") over a whole text.
 *
 * The rules are llama.cpp's (src/llama-vocab.cpp, llm_tokenizer_bpe_session and
 * llm_tokenizer_spm_session): the pair with the lowest merge rank (BPE) or the highest score
 * (SPM) merges first, the leftmost on a tie; a piece left that is no token is spelled by its
 * bytes' tokens. Its own library, built without -march flags: it holds no kernels, and
 * `llmrun tokenize` should not wait for the kernel libraries' build.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    uint32_t tag; /* the text's hash, high bits; a probe reads the text only on a match */
    int32_t n;    /* the text's bytes; -1 for an empty slot */
    int32_t id;
    uint32_t at; /* where the text starts in `blob` */
} entry_t;

typedef struct {
    uint64_t key; /* (left id << 32 | right id) + 1; 0 for an empty slot */
    int32_t rank; /* the merge's place in the list */
    int32_t id;   /* the token it makes */
} pair_t;

typedef struct {
    char *blob;         /* every token's text */
    entry_t *entries;   /* the text table: open addressing, `mask` + 1 slots */
    uint64_t mask;
    int32_t n_ids;      /* the vocabulary's size (ids are below it) */
    float *scores;      /* by id, for SentencePiece; NULL for BPE */
    pair_t *pairs; /* the merge table, open addressing, `pair_mask` + 1 slots */
    uint64_t pair_mask;
    int32_t byte_token[256]; /* the token a lone byte falls back to, -1 for none */
    int32_t hex_token[256];  /* the "<0xXX>" token of each byte, -1 for none */
} vocab_t;

static uint64_t hash_bytes(const char *s, int64_t n) {
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a, then a final mix for the low bits */
    for (int64_t i = 0; i < n; i++) {
        h = (h ^ (uint8_t)s[i]) * 0x100000001b3ull;
    }
    h ^= h >> 29;
    h *= 0xbf58476d1ce4e5b9ull;
    return h ^ (h >> 32);
}

static uint64_t hash_pair(uint64_t key) {
    key *= 0x9e3779b97f4a7c15ull;
    return key ^ (key >> 29);
}

/* The id of the token spelled by these bytes, or -1. */
static int32_t lookup(const vocab_t *v, const char *s, int64_t n) {
    uint64_t h = hash_bytes(s, n);
    uint32_t tag = (uint32_t)(h >> 32);
    for (uint64_t slot = h & v->mask;; slot = (slot + 1) & v->mask) {
        const entry_t *e = &v->entries[slot];
        if (e->n < 0) {
            return -1;
        }
        if (e->tag == tag && e->n == n && memcmp(v->blob + e->at, s, (size_t)n) == 0) {
            return e->id;
        }
    }
}

static int utf8_len(uint8_t lead) {
    static const int lengths[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    return lengths[lead >> 4];
}

/* Bytes of the next `chars` characters of s (at most `left`), as llama.cpp steps through
 * UTF-8 by each lead byte. */
static int64_t utf8_bytes(const char *s, int64_t chars, int64_t left) {
    int64_t n = 0;
    for (int64_t c = 0; c < chars && n < left; c++) {
        n += utf8_len((uint8_t)s[n]);
    }
    return n < left ? n : left;
}

static uint64_t table_size(int64_t n) {
    uint64_t size = 16;
    while (size < (uint64_t)n * 2) {
        size <<= 1;
    }
    return size;
}

void llmrun_vocab_free(vocab_t *v) {
    if (v == NULL) {
        return;
    }
    free(v->blob);
    free(v->entries);
    free(v->scores);
    free(v->pairs);
    free(v);
}

/* A vocabulary of n distinct texts: their UTF-8 bytes one after another in `blob`
 * (`blob_size` bytes), each one's length in characters, and each one's id (below n_ids).
 * `scores` (n_ids of them) for SentencePiece, else NULL. NULL if out of memory or if the
 * lengths overrun the blob. */
vocab_t *llmrun_vocab_new(const char *blob, int64_t blob_size, const int32_t *chars,
                          const int32_t *ids, int64_t n, int32_t n_ids, const float *scores) {
    vocab_t *v = calloc(1, sizeof(vocab_t));
    if (v == NULL) {
        return NULL;
    }
    uint64_t size = table_size(n);
    v->mask = size - 1;
    v->n_ids = n_ids;
    v->blob = malloc((size_t)blob_size + 1);
    v->entries = malloc(sizeof(entry_t) * size);
    if (v->blob == NULL || v->entries == NULL || blob_size > UINT32_MAX) {
        llmrun_vocab_free(v);
        return NULL;
    }
    memcpy(v->blob, blob, (size_t)blob_size);
    for (uint64_t slot = 0; slot < size; slot++) {
        v->entries[slot].n = -1;
    }
    if (scores != NULL) {
        v->scores = malloc(sizeof(float) * (size_t)n_ids);
        if (v->scores == NULL) {
            llmrun_vocab_free(v);
            return NULL;
        }
        memcpy(v->scores, scores, sizeof(float) * (size_t)n_ids);
    }
    int64_t at = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t bytes = utf8_bytes(v->blob + at, chars[i], blob_size - at);
        if (ids[i] < 0 || ids[i] >= n_ids) {
            llmrun_vocab_free(v);
            return NULL;
        }
        uint64_t h = hash_bytes(v->blob + at, bytes);
        uint64_t slot = h & v->mask;
        while (v->entries[slot].n >= 0) {
            slot = (slot + 1) & v->mask;
        }
        v->entries[slot] = (entry_t){(uint32_t)(h >> 32), (int32_t)bytes, ids[i], (uint32_t)at};
        at += bytes;
    }
    if (at != blob_size) {
        llmrun_vocab_free(v);
        return NULL;
    }
    static const char hex[] = "0123456789ABCDEF";
    for (int b = 0; b < 256; b++) {
        char one = (char)b;
        char spelled[6] = {'<', '0', 'x', hex[b >> 4], hex[b & 15], '>'};
        v->byte_token[b] = lookup(v, &one, 1);
        v->hex_token[b] = lookup(v, spelled, 6);
    }
    return v;
}

/* The merges, each "left right" (cut at the first space after the first byte, as llama.cpp
 * cuts it; one without a space never applies and is skipped), their texts one after another
 * in `blob` with each one's length in characters. A repeated merge keeps its first rank.
 * Returns 0, -1 if out of memory or the lengths overrun the blob, or -(i + 2) where merge i
 * names a text, or joins to one, that is no token. */
int64_t llmrun_vocab_merges(vocab_t *v, const char *blob, int64_t blob_size, const int32_t *chars,
                            int64_t n) {
    uint64_t size = table_size(n);
    free(v->pairs);
    v->pair_mask = size - 1;
    v->pairs = calloc(size, sizeof(pair_t));
    char *joined = malloc((size_t)blob_size + 1);
    if (v->pairs == NULL || joined == NULL) {
        free(joined);
        return -1;
    }
    int64_t at = 0;
    for (int64_t i = 0; i < n; i++) {
        const char *merge = blob + at;
        int64_t bytes = utf8_bytes(merge, chars[i], blob_size - at);
        at += bytes;
        const char *space = bytes > 1 ? memchr(merge + 1, ' ', (size_t)(bytes - 1)) : NULL;
        if (space == NULL) {
            continue;
        }
        int64_t cut = space - merge;
        int32_t left = lookup(v, merge, cut);
        int32_t right = lookup(v, space + 1, bytes - cut - 1);
        memcpy(joined, merge, (size_t)cut);
        memcpy(joined + cut, space + 1, (size_t)(bytes - cut - 1));
        int32_t result = lookup(v, joined, bytes - 1);
        if (left < 0 || right < 0 || result < 0) {
            free(joined);
            return -(i + 2);
        }
        uint64_t key = ((uint64_t)(uint32_t)left << 32 | (uint32_t)right) + 1;
        uint64_t slot = hash_pair(key) & v->pair_mask;
        while (v->pairs[slot].key != 0 && v->pairs[slot].key != key) {
            slot = (slot + 1) & v->pair_mask;
        }
        if (v->pairs[slot].key == 0) {
            v->pairs[slot] = (pair_t){key, (int32_t)i, result};
        }
    }
    free(joined);
    return at == blob_size ? 0 : -1;
}

/* The merge of two tokens: its rank, and the token it makes in *result; -1 if none. */
static int32_t merge_rank(const vocab_t *v, int32_t left, int32_t right, int32_t *result) {
    if (left < 0 || right < 0 || v->pairs == NULL) {
        return -1;
    }
    uint64_t key = ((uint64_t)(uint32_t)left << 32 | (uint32_t)right) + 1;
    for (uint64_t slot = hash_pair(key) & v->pair_mask;; slot = (slot + 1) & v->pair_mask) {
        const pair_t *pair = &v->pairs[slot];
        if (pair->key == 0) {
            return -1;
        }
        if (pair->key == key) {
            *result = pair->id;
            return pair->rank;
        }
    }
}

typedef struct {
    int64_t start; /* in the word */
    int32_t n;     /* bytes; 0 once merged into its left neighbour */
    int32_t id;    /* the token it spells, -1 if none */
    int64_t prev, next;
} symbol_t;

/* A candidate merge of two neighbours. `order` ranks it: the BPE rank, or the SPM score's
 * bits made to sort ascending with the best first. */
typedef struct {
    int64_t order;
    int64_t left, right;
    int32_t id;            /* the token the two make */
    int32_t size;          /* their bytes together (SPM tells a stale candidate by it) */
    int32_t left_id, right_id; /* the two tokens (BPE tells a stale candidate by them) */
} bigram_t;

typedef struct {
    bigram_t *items;
    int64_t n, cap;
} heap_t;

static int before(const bigram_t *a, const bigram_t *b) {
    return a->order < b->order || (a->order == b->order && a->left < b->left);
}

static int heap_push(heap_t *h, bigram_t item) {
    if (h->n == h->cap) {
        int64_t cap = h->cap ? h->cap * 2 : 64;
        bigram_t *items = realloc(h->items, sizeof(bigram_t) * (size_t)cap);
        if (items == NULL) {
            return -1;
        }
        h->items = items;
        h->cap = cap;
    }
    int64_t i = h->n++;
    while (i > 0) {
        int64_t parent = (i - 1) / 2;
        if (!before(&item, &h->items[parent])) {
            break;
        }
        h->items[i] = h->items[parent];
        i = parent;
    }
    h->items[i] = item;
    return 0;
}

static bigram_t heap_pop(heap_t *h) {
    bigram_t top = h->items[0];
    bigram_t last = h->items[--h->n];
    int64_t i = 0;
    for (;;) {
        int64_t child = 2 * i + 1;
        if (child >= h->n) {
            break;
        }
        if (child + 1 < h->n && before(&h->items[child + 1], &h->items[child])) {
            child++;
        }
        if (!before(&h->items[child], &last)) {
            break;
        }
        h->items[i] = h->items[child];
        i = child;
    }
    if (h->n > 0) {
        h->items[i] = last;
    }
    return top;
}

typedef struct {
    symbol_t *symbols;
    int64_t cap;
    heap_t heap;
} work_t;

static int split_chars(work_t *w, const char *word, int64_t bytes, const vocab_t *v,
                       int64_t *count) {
    if (bytes > w->cap) {
        symbol_t *symbols = realloc(w->symbols, sizeof(symbol_t) * (size_t)bytes);
        if (symbols == NULL) {
            return -1;
        }
        w->symbols = symbols;
        w->cap = bytes;
    }
    int64_t n = 0;
    for (int64_t at = 0; at < bytes; n++) {
        int64_t len = utf8_len((uint8_t)word[at]);
        len = len < bytes - at ? len : bytes - at;
        w->symbols[n] = (symbol_t){at, (int32_t)len, lookup(v, word + at, len), n - 1, -1};
        if (n > 0) {
            w->symbols[n - 1].next = n;
        }
        at += len;
    }
    *count = n;
    w->heap.n = 0;
    return 0;
}

static int bpe_candidate(work_t *w, const vocab_t *v, int64_t left, int64_t right) {
    if (left < 0 || right < 0) {
        return 0;
    }
    int32_t id;
    int32_t rank = merge_rank(v, w->symbols[left].id, w->symbols[right].id, &id);
    if (rank < 0) {
        return 0;
    }
    bigram_t b = {rank, left, right, id, 0, w->symbols[left].id, w->symbols[right].id};
    return heap_push(&w->heap, b);
}

/* Emits a leftover piece that is no token by its bytes: each byte's own token where the
 * vocabulary is byte-level (llama.cpp looks each byte up as a text), else its "<0xXX>" token;
 * a byte without one is left out. */
static int64_t spell_bytes(const vocab_t *v, const char *s, int64_t n, int byte_level,
                           int32_t *out) {
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++) {
        int32_t id = byte_level ? v->byte_token[(uint8_t)s[i]] : v->hex_token[(uint8_t)s[i]];
        if (id >= 0) {
            out[k++] = id;
        }
    }
    return k;
}

enum {
    BPE_IGNORE_MERGES = 1, /* a word that is a token is taken whole */
    BPE_NEWLINE_WORDS = 2, /* Gemma 4: a word of newlines that is a token is taken whole */
    BPE_BYTE_LEVEL = 4,    /* GPT-2's byte alphabet: lone bytes fall back to their own token */
};

/* The ids of n words, their UTF-8 bytes one after another in `blob` with each one's length
 * in characters; `out` holds at least blob_size ids. Returns how many, or -1. */
int64_t llmrun_bpe_encode(const vocab_t *v, const char *blob, int64_t blob_size,
                          const int32_t *chars, int64_t n, int flags, int32_t *out) {
    work_t w = {0};
    int64_t emitted = 0, at = 0;
    for (int64_t i = 0; i < n; i++) {
        const char *word = blob + at;
        int64_t bytes = utf8_bytes(word, chars[i], blob_size - at);
        at += bytes;
        if (bytes == 0) {
            continue;
        }
        int whole = flags & BPE_IGNORE_MERGES;
        if (!whole && (flags & BPE_NEWLINE_WORDS)) {
            whole = 1;
            for (int64_t k = 0; k < bytes; k++) {
                whole &= word[k] == '\n';
            }
        }
        int32_t id = whole ? lookup(v, word, bytes) : -1;
        if (id >= 0) {
            out[emitted++] = id;
            continue;
        }
        int64_t count;
        if (split_chars(&w, word, bytes, v, &count) != 0) {
            emitted = -1;
            break;
        }
        int failed = 0;
        for (int64_t k = 1; k < count && !failed; k++) {
            failed = bpe_candidate(&w, v, k - 1, k);
        }
        while (w.heap.n > 0 && !failed) {
            bigram_t b = heap_pop(&w.heap);
            symbol_t *left = &w.symbols[b.left], *right = &w.symbols[b.right];
            /* Stale: a side merged away since, or grown into another token. */
            if (left->n == 0 || right->n == 0 || left->id != b.left_id ||
                right->id != b.right_id) {
                continue;
            }
            left->n += right->n;
            left->id = b.id;
            right->n = 0;
            left->next = right->next;
            if (right->next >= 0) {
                w.symbols[right->next].prev = b.left;
            }
            failed = bpe_candidate(&w, v, left->prev, b.left) ||
                     bpe_candidate(&w, v, b.left, left->next);
        }
        if (failed) {
            emitted = -1;
            break;
        }
        for (int64_t k = 0; k >= 0; k = w.symbols[k].next) {
            const symbol_t *s = &w.symbols[k];
            if (s->id >= 0) {
                out[emitted++] = s->id;
            } else {
                emitted += spell_bytes(v, word + s->start, s->n, flags & BPE_BYTE_LEVEL,
                                       out + emitted);
            }
        }
    }
    free(w.symbols);
    free(w.heap.items);
    return emitted;
}

/* A higher score first: the float's bits, made to order as the floats do, negated. */
static int64_t score_order(float score) {
    uint32_t bits;
    memcpy(&bits, &score, sizeof(bits));
    int64_t ordered = (bits & 0x80000000u) ? -(int64_t)(bits & 0x7fffffffu) : (int64_t)bits;
    return -ordered;
}

static int spm_candidate(work_t *w, const vocab_t *v, const char *text, int64_t left,
                         int64_t right) {
    if (left < 0 || right < 0) {
        return 0;
    }
    const symbol_t *l = &w->symbols[left], *r = &w->symbols[right];
    int32_t id = lookup(v, text + l->start, l->n + r->n);
    if (id < 0) {
        return 0;
    }
    bigram_t b = {score_order(v->scores[id]), left, right, id, l->n + r->n, l->id, r->id};
    return heap_push(&w->heap, b);
}

/* The ids of one text by SentencePiece merging (its spaces already escaped); a piece left
 * that is no token takes its bytes' "<0xXX>" tokens, or `unk` (if >= 0) when one is
 * missing. `out` holds at least `bytes` ids. Returns how many, or -1. */
int64_t llmrun_spm_encode(const vocab_t *v, const char *text, int64_t bytes, int32_t unk,
                          int32_t *out) {
    work_t w = {0};
    int64_t count, emitted = 0;
    if (v->scores == NULL || split_chars(&w, text, bytes, v, &count) != 0) {
        return -1;
    }
    int failed = 0;
    for (int64_t k = 1; k < count && !failed; k++) {
        failed = spm_candidate(&w, v, text, k - 1, k);
    }
    while (w.heap.n > 0 && !failed) {
        bigram_t b = heap_pop(&w.heap);
        symbol_t *left = &w.symbols[b.left], *right = &w.symbols[b.right];
        if (left->n == 0 || right->n == 0 || left->n + right->n != b.size) {
            continue;
        }
        left->n += right->n;
        left->id = b.id;
        right->n = 0;
        left->next = right->next;
        if (right->next >= 0) {
            w.symbols[right->next].prev = b.left;
        }
        failed = spm_candidate(&w, v, text, left->prev, b.left) ||
                 spm_candidate(&w, v, text, b.left, left->next);
    }
    for (int64_t k = 0; k >= 0 && count > 0 && !failed; k = w.symbols[k].next) {
        const symbol_t *s = &w.symbols[k];
        int spellable = 1;
        for (int32_t i = 0; i < s->n; i++) {
            spellable &= v->hex_token[(uint8_t)text[s->start + i]] >= 0;
        }
        if (s->id >= 0) {
            out[emitted++] = s->id;
        } else if (spellable) {
            emitted += spell_bytes(v, text + s->start, s->n, 0, out + emitted);
        } else if (unk >= 0) {
            out[emitted++] = unk;
        }
    }
    free(w.symbols);
    free(w.heap.items);
    return failed ? -1 : emitted;
}

/* Where each of `count` strings of a GGUF string array begins, from `pos` in a buffer of
 * `size` bytes: a string is its length (u64, little-endian) and then its bytes. Each
 * string's first byte goes to starts; the position after the last is returned, or -1
 * where a length runs past the end. llmrun.loading.gguf_io reads a vocabulary's tokens and
 * merges with it (its loop in Python took ~0.1 s for each 150k-entry array). */
int64_t llmrun_gguf_strings(const uint8_t *buf, int64_t size, int64_t pos, int64_t count,
                            int64_t *starts) {
    for (int64_t i = 0; i < count; i++) {
        if (pos < 0 || size - pos < 8) {
            return -1;
        }
        uint64_t n = 0;
        for (int b = 7; b >= 0; b--) {
            n = n << 8 | buf[pos + b];
        }
        pos += 8;
        if (n > (uint64_t)(size - pos)) {
            return -1;
        }
        starts[i] = pos;
        pos += (int64_t)n;
    }
    return pos;
}
