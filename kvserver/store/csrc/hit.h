/* The read side of a Get in C: the leading keys of a request stored in one part of the cache, as
 * KVCache.prepare_get finds them (kvserver/store/cache.py), from the keys' bytes as the request
 * packs them. Shared by the extension (index.c) and the fuzzer (tests/fuzz/fuzz_index.c).
 *
 * A key of up to 16 bytes is its two words, zero-padded (keys.py); a wider one its digest
 * (digest.h). Each key is looked up under the part (index.h); the hit runs while the key is filed
 * and its page committed. Every page id the index gives is checked inside the page tables, and its
 * slab inside the slab table, before it is read: a page out of them ends the walk as a corrupt
 * table (-1), never a read outside them. */
#ifndef KV_HIT_H
#define KV_HIT_H

#include <stdint.h>
#include <string.h>

#include "index.h"

#define KV_WORD_BYTES 16
#define KV_COMMITTED 3 /* pages.py: a stored page, visible to a Get */

typedef struct {
    const int8_t *state;   /* per page: pages.py's UNUSED, FREE, WRITING, COMMITTED */
    const int64_t *offset; /* per page: its bytes' offset in the arena */
    const int32_t *slab;   /* per page: its slab id */
    int64_t npages;        /* entries in each of the three */
    int64_t nslabs;        /* entries in the per-slab tables */
} kv_pages;

/* The two words of the key of `key_bytes` (1 to 16) bytes at `key`, zero-padded. */
static inline void kv_key_words(const uint8_t *key, int64_t key_bytes, uint64_t w[2]) {
    uint8_t padded[KV_WORD_BYTES] = {0};
    memcpy(padded, key, (size_t)key_bytes);
    memcpy(w, padded, KV_WORD_BYTES); /* x86: little endian, as numpy's view of the bytes */
}

/* How many leading keys of the n in `words` (two words each, all `len` bytes long) are filed
 * under `owner` with a committed page: their page ids into ids[0..m) and their offsets into
 * offsets[0..m). -1 if the index names a page outside the tables, or one whose slab is outside
 * the slab table (a corrupt table: what was written before it means nothing). */
static inline int64_t kv_hit_prefix(const kv_index *ix, const kv_pages *pg, const uint64_t *words, uint8_t len,
                                    int64_t n, int32_t owner, int64_t *ids, int64_t *offsets) {
    for (int64_t k = 0; k < n; k++) {
        int64_t id = kv_index_find_one(ix, words[2 * k], words[2 * k + 1], len, owner);
        if (id < 0)
            return k;
        if (id >= pg->npages || pg->slab[id] < 0 || pg->slab[id] >= pg->nslabs)
            return -1;
        if (pg->state[id] != KV_COMMITTED)
            return k;
        ids[k] = id;
        offsets[k] = pg->offset[id];
    }
    return n;
}

#endif
