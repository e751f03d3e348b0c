/* The read side of the cache's key index (kvserver/store/index.py) in C: the same hash, the same
 * buckets (linear hashing: `level` buckets a round, the first `split` of them split), the same
 * chains. Shared by the extension (index.c) and the fuzzer (tests/fuzz/fuzz_index.c).
 *
 * The tables are the index's numpy arrays, read as they are: words (KV_KEY_WORDS a key), lens, owner
 * and next per entry (`cap` of each), head per bucket (`nhead`). A walk never trusts a link: an entry id out of
 * [0, cap) or a chain longer than `cap` links ends it as a miss, so even a corrupt table is read
 * only inside its arrays and every walk ends. */
#ifndef KV_INDEX_H
#define KV_INDEX_H

#include <stdint.h>

#define KV_M1 0xFF51AFD7ED558CCDULL
#define KV_M2 0xC4CEB9FE1A85EC53ULL
#define KV_KEY_WORDS 4 /* a key as the index keeps it: 32 bytes (keys.py's WORD_BYTES) */

typedef struct {
    const uint64_t *words; /* KV_KEY_WORDS an entry */
    const uint8_t *lens;
    const int32_t *owner, *next, *head;
    int64_t cap, nhead;
    uint64_t level, split, s[5];
} kv_index;

static inline uint64_t kv_index_hash(const uint64_t s[5], const uint64_t *w, uint8_t len, int32_t owner) {
    uint64_t h = (w[0] ^ s[0]) * KV_M1;
    h ^= h >> 31;
    h += (w[1] ^ s[1]) * KV_M2;
    h ^= h >> 29;
    h += (w[2] ^ s[2]) * KV_M1;
    h ^= h >> 31;
    h += (w[3] ^ s[3]) * KV_M2;
    h ^= h >> 29;
    h += (((uint64_t)(int64_t)owner << 8) | len) * s[4];
    h ^= h >> 32;
    h *= KV_M1;
    h ^= h >> 33;
    return h;
}

static inline int64_t kv_index_bucket(const kv_index *ix, uint64_t h) {
    uint64_t b = h & (ix->level - 1);
    if (b < ix->split)
        b = h & (2 * ix->level - 1);
    return (int64_t)b;
}

static inline int kv_same_key(const uint64_t *a, const uint64_t *b) {
    return ((a[0] ^ b[0]) | (a[1] ^ b[1]) | (a[2] ^ b[2]) | (a[3] ^ b[3])) == 0;
}

/* The entry of the chain starting at `cur` holding the key (w, len) under `owner`, or -1. */
static inline int64_t kv_index_walk(const kv_index *ix, int64_t cur, const uint64_t *w, uint8_t len,
                                    int32_t owner) {
    for (int64_t steps = 0; cur >= 0 && cur < ix->cap && steps < ix->cap; steps++) {
        if (kv_same_key(ix->words + KV_KEY_WORDS * cur, w) && ix->lens[cur] == len && ix->owner[cur] == owner)
            return cur;
        cur = ix->next[cur];
    }
    return -1;
}

/* The entry id of the key (its KV_KEY_WORDS words at w, len) under `owner`, or -1. */
static inline int64_t kv_index_find_one(const kv_index *ix, const uint64_t *w, uint8_t len, int32_t owner) {
    int64_t b = kv_index_bucket(ix, kv_index_hash(ix->s, w, len, owner));
    if (b < 0 || b >= ix->nhead)
        return -1;
    return kv_index_walk(ix, ix->head[b], w, len, owner);
}

/* kv_index_find_one for n keys (words: n rows of KV_KEY_WORDS words; lens: their lengths, or NULL
 * where all are `len` bytes long), into out: the same answers,
 * its table reads (each a cache miss in a large index) overlapped across keys: key i + 2D's bucket
 * head is fetched ahead, then key i + D's first chain entry, while key i's chain is walked. Only
 * addresses inside the tables are fetched. */
static inline void kv_index_find(const kv_index *ix, const uint64_t *words, const uint8_t *lens, uint8_t len,
                                 int64_t n, int32_t owner, int64_t *out) {
    enum { D = 8, RING = 32 }; /* RING > 2D, a power of two */
    int64_t slot[RING];        /* per key ahead: its bucket, then its chain's first entry (-1: none) */
    for (int64_t i = -2 * D; i < n; i++) {
        int64_t k = i + 2 * D;
        if (k < n) {
            int64_t b = kv_index_bucket(ix, kv_index_hash(ix->s, words + KV_KEY_WORDS * k, lens ? lens[k] : len,
                                                          owner));
            slot[k % RING] = b >= 0 && b < ix->nhead ? b : -1;
            if (slot[k % RING] >= 0)
                __builtin_prefetch(ix->head + b);
        }
        k = i + D;
        if (k >= 0 && k < n) {
            int64_t cur = slot[k % RING] >= 0 ? ix->head[slot[k % RING]] : -1;
            slot[k % RING] = cur;
            if (cur >= 0 && cur < ix->cap) {
                __builtin_prefetch(ix->words + KV_KEY_WORDS * cur);
                __builtin_prefetch(ix->lens + cur);
                __builtin_prefetch(ix->owner + cur);
            }
        }
        if (i >= 0)
            out[i] = kv_index_walk(ix, slot[i % RING], words + KV_KEY_WORDS * i, lens ? lens[i] : len, owner);
    }
}

/* ---- Changes: index.py's insert, remove and split, on the same tables -------------------------
 * The loop's (never concurrent with a walk of the same tables). An id or a bucket out of its table
 * is never written: the caller checks ids against `cap` first, and every link followed is checked
 * as a walk checks it. */

typedef struct {
    uint64_t *words;  /* KV_KEY_WORDS an entry */
    uint8_t *lens;
    int32_t *owner, *next, *head;
    int64_t cap;      /* entries in each entry table */
    int64_t nhead;    /* buckets in use: level + split */
    int64_t head_cap; /* buckets the head table has room for */
    uint64_t level, split, s[5];
} kv_index_rw;

static inline kv_index kv_index_ro(const kv_index_rw *w) {
    kv_index r = {w->words, w->lens, w->owner, w->next, w->head, w->cap, w->nhead, w->level, w->split,
                  {w->s[0], w->s[1], w->s[2], w->s[3], w->s[4]}};
    return r;
}

static inline int64_t kv_index_entry_bucket(const kv_index_rw *w, int64_t id) {
    kv_index r = kv_index_ro(w);
    return kv_index_bucket(&r, kv_index_hash(w->s, w->words + KV_KEY_WORDS * id, w->lens[id], w->owner[id]));
}

/* Files entry `id` (its key and owner already in the tables) at the head of its bucket's chain.
 * 0 if its bucket is not one in use (nothing written). */
static inline int kv_index_link(kv_index_rw *w, int64_t id) {
    int64_t b = kv_index_entry_bucket(w, id);
    if (b < 0 || b >= w->nhead)
        return 0;
    w->next[id] = w->head[b];
    w->head[b] = (int32_t)id;
    return 1;
}

/* Takes entry `id` out of its bucket's chain and marks it gone (owner -1). 0 if the chain did not
 * hold it (it is marked gone all the same). */
static inline int kv_index_unlink(kv_index_rw *w, int64_t id) {
    int64_t b = kv_index_entry_bucket(w, id);
    int found = 0;
    if (b >= 0 && b < w->nhead) {
        int32_t *link = &w->head[b];
        for (int64_t steps = 0; *link >= 0 && *link < w->cap && steps < w->cap; steps++) {
            if (*link == id) {
                *link = w->next[id];
                w->next[id] = -1;
                found = 1;
                break;
            }
            link = &w->next[*link];
        }
    }
    w->owner[id] = -1;
    return found;
}

/* Splits buckets, in order, until `count` entries average at most `load` a bucket (index.py's
 * _split_to_load): each split bucket's chain is refiled under the new state, into itself or its
 * new sibling. 0 if the head table has no room for the buckets that takes (nothing changed). */
static inline int kv_index_split_to(kv_index_rw *w, int64_t count, int64_t load) {
    int64_t need = w->nhead;
    uint64_t level = w->level, split = w->split;
    while (count > load * need) { /* the room it takes, checked before anything moves */
        int64_t k = (count + load - 1) / load - need;
        if (k > (int64_t)(level - split))
            k = (int64_t)(level - split);
        need += k;
        split += (uint64_t)k;
        if (split == level) {
            level *= 2;
            split = 0;
        }
    }
    if (need > w->head_cap)
        return 0;
    while (count > load * w->nhead) {
        int64_t k = (count + load - 1) / load - w->nhead;
        if (k > (int64_t)(w->level - w->split))
            k = (int64_t)(w->level - w->split);
        int64_t lo = (int64_t)w->split;
        for (int64_t b = w->nhead; b < w->nhead + k; b++)
            w->head[b] = -1;
        w->nhead += k; /* the state moves first: each chain below is refiled under the new one */
        w->split += (uint64_t)k;
        if (w->split == w->level) {
            w->level *= 2;
            w->split = 0;
        }
        for (int64_t b = lo; b < lo + k; b++) {
            int32_t cur = w->head[b];
            w->head[b] = -1;
            for (int64_t steps = 0; cur >= 0 && cur < w->cap && steps < w->cap; steps++) {
                int32_t after = w->next[cur];
                if (!kv_index_link(w, cur))
                    w->next[cur] = -1; /* not reachable: a consistent table never has one */
                cur = after;
            }
        }
    }
    return 1;
}

#endif
