/* The read side of the cache's key index (kvserver/store/index.py) in C: the same hash, the same
 * buckets (linear hashing: `level` buckets a round, the first `split` of them split), the same
 * chains. Shared by the extension (index.c) and the fuzzer (tests/fuzz/fuzz_index.c).
 *
 * The tables are the index's numpy arrays, read as they are: w0, w1, lens, owner and next per
 * entry (`cap` of each), head per bucket (`nhead`). A walk never trusts a link: an entry id out of
 * [0, cap) or a chain longer than `cap` links ends it as a miss, so even a corrupt table is read
 * only inside its arrays and every walk ends. */
#ifndef KV_INDEX_H
#define KV_INDEX_H

#include <stdint.h>

#define KV_M1 0xFF51AFD7ED558CCDULL
#define KV_M2 0xC4CEB9FE1A85EC53ULL

typedef struct {
    const uint64_t *w0, *w1;
    const uint8_t *lens;
    const int32_t *owner, *next, *head;
    int64_t cap, nhead;
    uint64_t level, split, s0, s1, s2;
} kv_index;

static inline uint64_t kv_index_hash(const kv_index *ix, uint64_t w0, uint64_t w1, uint8_t len,
                                     int32_t owner) {
    uint64_t h = (w0 ^ ix->s0) * KV_M1;
    h ^= h >> 31;
    h += (w1 ^ ix->s1) * KV_M2;
    h ^= h >> 29;
    h += (((uint64_t)(int64_t)owner << 8) | len) * ix->s2;
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

/* The entry id of the key (w0, w1, len) under `owner`, or -1. */
static inline int64_t kv_index_find_one(const kv_index *ix, uint64_t w0, uint64_t w1, uint8_t len,
                                        int32_t owner) {
    int64_t b = kv_index_bucket(ix, kv_index_hash(ix, w0, w1, len, owner));
    if (b < 0 || b >= ix->nhead)
        return -1;
    int64_t cur = ix->head[b];
    for (int64_t steps = 0; cur >= 0 && cur < ix->cap && steps < ix->cap; steps++) {
        if (ix->w0[cur] == w0 && ix->w1[cur] == w1 && ix->lens[cur] == len && ix->owner[cur] == owner)
            return cur;
        cur = ix->next[cur];
    }
    return -1;
}

/* kv_index_find_one for n keys (words: n rows of two words), into out. */
static inline void kv_index_find(const kv_index *ix, const uint64_t *words, const uint8_t *lens,
                                 int64_t n, int32_t owner, int64_t *out) {
    for (int64_t i = 0; i < n; i++)
        out[i] = kv_index_find_one(ix, words[2 * i], words[2 * i + 1], lens[i], owner);
}

/* ---- Changes: index.py's insert, remove and split, on the same tables -------------------------
 * The loop's (never concurrent with a walk of the same tables). An id or a bucket out of its table
 * is never written: the caller checks ids against `cap` first, and every link followed is checked
 * as a walk checks it. */

typedef struct {
    uint64_t *w0, *w1;
    uint8_t *lens;
    int32_t *owner, *next, *head;
    int64_t cap;      /* entries in each entry table */
    int64_t nhead;    /* buckets in use: level + split */
    int64_t head_cap; /* buckets the head table has room for */
    uint64_t level, split, s0, s1, s2;
} kv_index_rw;

static inline kv_index kv_index_ro(const kv_index_rw *w) {
    kv_index r = {w->w0, w->w1, w->lens, w->owner, w->next, w->head, w->cap, w->nhead,
                  w->level, w->split, w->s0, w->s1, w->s2};
    return r;
}

static inline int64_t kv_index_entry_bucket(const kv_index_rw *w, int64_t id) {
    kv_index r = kv_index_ro(w);
    return kv_index_bucket(&r, kv_index_hash(&r, w->w0[id], w->w1[id], w->lens[id], w->owner[id]));
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
