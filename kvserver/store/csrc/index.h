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

#endif
