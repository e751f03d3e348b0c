/* The read side of a Get in C: the leading keys of a request stored in one part of the cache, as
 * KVCache.prepare_get finds them (kvserver/store/cache.py), from the keys' bytes as the request
 * packs them. Shared by the extension (index.c) and the fuzzer (tests/fuzz/fuzz_index.c).
 *
 * A key of up to 32 bytes is its four words, zero-padded (keys.py); a wider one its 16-byte
 * digest (digest.h), zero-padded alike. Each key is looked up under the part (index.h); the hit
 * runs while the key is filed and its page committed. Every page id the index gives is checked inside the page tables, and its
 * slab inside the slab table, before it is read: a page out of them ends the walk as a corrupt
 * table (-1), never a read outside them. */
#ifndef KV_HIT_H
#define KV_HIT_H

#include <stdint.h>
#include <string.h>

#include "digest.h"
#include "index.h"

#define KV_WORD_BYTES (8 * KV_KEY_WORDS)
#define KV_COMMITTED 3 /* pages.py: a stored page, visible to a Get */

typedef struct {
    const int8_t *state;   /* per page: pages.py's UNUSED, FREE, WRITING, COMMITTED */
    const int64_t *offset; /* per page: its bytes' offset in the arena */
    const int32_t *slab;   /* per page: its slab id */
    int64_t npages;        /* entries in each of the three */
    int64_t nslabs;        /* entries in the per-slab tables */
} kv_pages;

/* The words of the key of `key_bytes` (1 to KV_WORD_BYTES) bytes at `key`, zero-padded. */
static inline void kv_key_words(const uint8_t *key, int64_t key_bytes, uint64_t w[KV_KEY_WORDS]) {
    w[0] = w[1] = w[2] = w[3] = 0;
    memcpy(w, key, (size_t)key_bytes); /* x86: little endian, as numpy's view of the bytes */
}

/* The index's words of n keys of `key_bytes` (1 to 128) bytes each, packed back to back at `keys`:
 * KV_KEY_WORDS words a key into `words`, each key zero-padded, or past KV_WORD_BYTES its digest
 * (digest.h), zero-padded alike. */
static inline void kv_keys_words(const uint8_t *keys, int64_t key_bytes, int64_t n, uint64_t *words) {
    if (key_bytes == KV_WORD_BYTES) { /* SGLang's and vLLM's: the keys are the words */
        memcpy(words, keys, (size_t)n * KV_WORD_BYTES);
        return;
    }
    if (key_bytes == 16) { /* kvclient's page_keys: two words each, two of zeros */
        for (int64_t k = 0; k < n; k++) {
            uint64_t *w = words + KV_KEY_WORDS * k;
            memcpy(w, keys + 16 * k, 16);
            w[2] = w[3] = 0;
        }
        return;
    }
    if (key_bytes < KV_WORD_BYTES) {
        for (int64_t k = 0; k < n; k++)
            kv_key_words(keys + k * key_bytes, key_bytes, words + KV_KEY_WORDS * k);
        return;
    }
    enum { BLOCK = 64 }; /* digests a step, on the stack */
    uint8_t digests[BLOCK * KV_DIGEST_BYTES];
    for (int64_t at = 0; at < n; at += BLOCK) {
        int64_t m = n - at < BLOCK ? n - at : BLOCK;
        kv_digests(keys + at * key_bytes, (size_t)key_bytes, (size_t)m, digests, 0);
        for (int64_t j = 0; j < m; j++) {
            uint64_t *w = words + KV_KEY_WORDS * (at + j);
            memset(w, 0, KV_WORD_BYTES);
            memcpy(w, digests + KV_DIGEST_BYTES * j, KV_DIGEST_BYTES);
        }
    }
}

/* How many leading keys of the n in `words` (KV_KEY_WORDS words each, all `len` bytes long) are filed
 * under `owner` with a committed page: their page ids into ids[0..m) and their offsets into
 * offsets[0..m). -1 if the index names a page outside the tables, or one whose slab is outside
 * the slab table (a corrupt table: what was written before it means nothing). All n keys are
 * looked up at once (kv_index_find, into ids); ids[m..n) hold what is left of that. */
static inline int64_t kv_hit_prefix(const kv_index *ix, const kv_pages *pg, const uint64_t *words, uint8_t len,
                                    int64_t n, int32_t owner, int64_t *ids, int64_t *offsets) {
    kv_index_find(ix, words, NULL, len, n, owner, ids);
    for (int64_t k = 0; k < n; k++) {
        int64_t id = ids[k];
        if (id < 0)
            return k;
        if (id >= pg->npages || pg->slab[id] < 0 || pg->slab[id] >= pg->nslabs)
            return -1;
        if (pg->state[id] != KV_COMMITTED)
            return k;
        offsets[k] = pg->offset[id];
    }
    return n;
}

/* Pages ids[0..n) used, in key order: the first made the most recent. The recency tick (ticks[0])
 * is raised by n at once and the pages stamped tick + n .. tick + 1, each page's slab raised to its
 * page's stamp (PageTable.touch). The loop's touch and the data plane's (a Lookup it walks, under
 * the cache's lock, which a touch of the loop's need not hold) may run at once: the tick is taken
 * atomically, so no two touches share a stamp, and a stamp or a slab's raise lost to the other's
 * (the same page, at the same moment) costs only the order of two equally recent pages, which
 * eviction reads under the lock. Every id and its slab checked inside the tables by the caller
 * (slab_stamp: nslabs entries). */
static inline void kv_touch(int64_t *stamp, const int32_t *slab, int64_t *slab_stamp, const int64_t *ids,
                            int64_t n, int64_t *ticks) {
    int64_t tick = __atomic_fetch_add(ticks, n, __ATOMIC_RELAXED);
    for (int64_t k = 0; k < n; k++) {
        int64_t t = tick + (n - k), *s = &slab_stamp[slab[ids[k]]];
        __atomic_store_n(&stamp[ids[k]], t, __ATOMIC_RELAXED);
        int64_t old = __atomic_load_n(s, __ATOMIC_RELAXED);
        while (old < t && !__atomic_compare_exchange_n(s, &old, t, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            ;
    }
}

#endif
