/* Fuzzes the key index's compiled walk (kvserver/store/csrc/index.h): from the input's bytes, a
 * table of up to 64 entries (keys from a small alphabet, so that they collide), its buckets in any
 * state of a round of splits, each entry filed at the head of its bucket's chain as the index files
 * them; then, when the input says so, links overwritten with the input's values (out of the table,
 * into cycles). Whatever the table, every walk reads inside its arrays (exact-size allocations,
 * under AddressSanitizer) and ends (an alarm fails a walk that does not); a hit is always an
 * entry holding exactly the key asked for; on a table that is not corrupt, the walk finds every
 * filed entry and nothing else. A corrupt case may also give the walk fewer buckets than the
 * table's (a copy of the heads of exactly that many), so that a bucket past them is never read.
 * The batched walk (kv_index_find, its reads overlapped across keys) must give find_one's answers.
 * The expected answers are filed with the walk's own hash: that it is the numpy index's hash is
 * tests/test_store_index.py's to check.
 *
 * The same walk then serves a Get's hit (hit.h) over exact-size page tables of up to cap + 1 pages
 * (fewer than the entries too) and up to 4 slabs, their states and slabs from the input: the hit
 * reads only inside them, and is -1 (a page or slab outside them) or the leading keys that
 * find_one files with a committed page in its slab table, their ids and offsets.
 *
 * The same input also drives the changes (inserts, removals, splits: check_changes below) on
 * exact-size tables, against a model of which entries are live.
 *
 * The same input also names a request's keys (up to 70, of 1 to 64 bytes): kv_keys_words gives each
 * whole and zero-padded up to 32 bytes, else its digest zero-padded.
 *
 * The same input also names a batch of wide keys (up to 19, of 1 to 128 bytes: digest.h): each path
 * this CPU has (scalar, AVX2, AVX-512) digests them from an exact-size copy into an exact-size
 * output, and all give the same bytes (that they are hashlib's is tests/test_store_digest.py's to
 * check).
 *
 * With clang's libFuzzer (-fsanitize=fuzzer) LLVMFuzzerTestOneInput is its entry; built without it
 * (gcc, -DKV_STANDALONE), main() feeds random inputs for the given seconds. scripts/sanitize.sh
 * runs it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../../kvserver/store/csrc/digest.h"
#include "../../kvserver/store/csrc/hit.h"
#include "../../kvserver/store/csrc/index.h"

typedef struct {
    const uint8_t *p;
    size_t left;
} input;

static uint64_t take(input *in, int bytes) {
    uint64_t v = 0;
    for (int i = 0; i < bytes && in->left; i++, in->left--)
        v |= (uint64_t)*in->p++ << (8 * i);
    return v;
}

/* A key of the small alphabet the tables are filled from (so that keys collide), its four words
 * from one byte: every word takes part, the third and fourth as a 32-byte key's would. */
static void alphabet_key(uint64_t k, uint64_t w[KV_KEY_WORDS]) {
    w[0] = k % 7;
    w[1] = (k >> 3) % 3;
    w[2] = (k >> 5) & 1;
    w[3] = (k >> 6) & 1;
}

/* hit.h's walk over the index `ix`, for keys of one length from the entries' alphabet. */
static void check_hit(const kv_index *ix, input *in) {
    int64_t npages = (int64_t)(take(in, 1) % (uint64_t)(ix->cap + 2)), nslabs = (int64_t)(take(in, 1) % 5);
    int8_t *state = malloc(npages ? npages : 1);
    int64_t *offset = malloc(8 * (npages ? npages : 1));
    int32_t *slab = malloc(4 * (npages ? npages : 1));
    for (int64_t i = 0; i < npages; i++) {
        uint64_t v = take(in, 1);
        state[i] = (int8_t)(v % 4);
        slab[i] = (int32_t)((v >> 2) % 6) - 1; /* -1 to 4: some outside the slab table */
        offset[i] = (int64_t)i << 20;
    }
    kv_pages pg = {state, offset, slab, npages, nslabs};
    int64_t n = (int64_t)(take(in, 1) % 9);
    uint8_t len = (uint8_t)(1 + take(in, 1) % 3 * 21);
    int32_t o = (int32_t)(take(in, 1) % 3);
    uint64_t *words = malloc(8 * KV_KEY_WORDS * (n ? n : 1));
    int64_t *ids = malloc(8 * (n ? n : 1)), *offs = malloc(8 * (n ? n : 1));
    for (int64_t k = 0; k < n; k++)
        alphabet_key(take(in, 1), words + KV_KEY_WORDS * k);
    int64_t m = kv_hit_prefix(ix, &pg, words, len, n, o, ids, offs);
    if (m < -1 || m > n)
        abort();
    int64_t want = n, bad = 0;  /* the same walk, key by key */
    for (int64_t k = 0; k < n; k++) {
        int64_t id = kv_index_find_one(ix, words + KV_KEY_WORDS * k, len, o);
        if (id < 0) {
            want = k;
            break;
        }
        if (id >= npages || slab[id] < 0 || slab[id] >= nslabs) {
            bad = 1;
            break;
        }
        if (state[id] != KV_COMMITTED) {
            want = k;
            break;
        }
        if (m >= 0 && k < m && (ids[k] != id || offs[k] != offset[id]))
            abort();
    }
    if (bad ? m != -1 : m != want)
        abort();
    free(state), free(offset), free(slab), free(words), free(ids), free(offs);
}

static void check_one(const uint8_t *data, size_t size) {
    input in = {data, size};
    int64_t cap = 1 + (int64_t)(take(&in, 1) % 64);
    uint64_t level = 1ull << (take(&in, 1) % 5);
    uint64_t split = take(&in, 1) % (level + 1);
    int corrupt = (int)(take(&in, 1) & 1);
    int64_t nhead = (int64_t)(level + split);
    uint64_t *words = malloc(8 * KV_KEY_WORDS * cap);
    uint8_t *lens = malloc(cap);
    int32_t *owner = malloc(4 * cap), *next = malloc(4 * cap), *head = malloc(4 * nhead);
    uint8_t *filed = calloc(cap, 1);
    kv_index ix = {words, lens, owner, next, head, cap, nhead, level, split,
                   {take(&in, 8), take(&in, 8), take(&in, 8), take(&in, 8), take(&in, 8) | 1}};
    for (int64_t b = 0; b < nhead; b++)
        head[b] = -1;
    for (int64_t i = 0; i < cap; i++) {
        uint64_t k = take(&in, 1), *wi = words + KV_KEY_WORDS * i;
        alphabet_key(k, wi);
        lens[i] = (uint8_t)(1 + take(&in, 1) % 3 * 21);
        owner[i] = (int32_t)(take(&in, 1) % 3);
        next[i] = -1;
        int dup = 0;  /* the index files a key once per owner */
        for (int64_t j = 0; j < i; j++)
            dup |= filed[j] && kv_same_key(words + KV_KEY_WORDS * j, wi) && lens[j] == lens[i] &&
                   owner[j] == owner[i];
        if (dup) {
            owner[i] = -1;  /* as a removed entry: its owner is -1 */
            continue;
        }
        int64_t b = kv_index_bucket(&ix, kv_index_hash(ix.s, wi, lens[i], owner[i]));
        if (b >= nhead)
            abort();  /* a filed key's bucket is always one in use */
        next[i] = head[b];
        head[b] = (int32_t)i;
        filed[i] = 1;
    }
    int32_t *heads = head;
    if (corrupt) {
        while (in.left >= 6) {
            uint64_t at = take(&in, 1), how = take(&in, 1);
            /* Half the links point inside the table (cycles, self-loops), half anywhere. */
            int32_t v = how & 1 ? (int32_t)(how >> 1) % (int32_t)(cap + 2) - 1 : (int32_t)take(&in, 4);
            if (at & 1)
                head[(at >> 1) % nhead] = v;
            else
                next[(at >> 1) % cap] = v;
        }
        if (in.left == 1 || in.left == 3) {  /* fewer buckets than the table's, in an exact copy */
            ix.nhead = (int64_t)(take(&in, 1) % (uint64_t)nhead);
            heads = malloc(4 * (ix.nhead ? ix.nhead : 1));
            memcpy(heads, head, 4 * ix.nhead);
            ix.head = heads;
        }
    }
    /* The batched walk (kv_index_find: reads overlapped across keys) answers as find_one does, with
     * a length per key and with one length for all. */
    int64_t nq = cap + 8;
    uint64_t *qwords = malloc(8 * KV_KEY_WORDS * nq);
    uint8_t *qlens = malloc(nq);
    int64_t *qout = malloc(8 * nq), *qsame = malloc(8 * nq);
    for (int64_t i = 0; i < nq; i++) {
        if (i < cap)
            memcpy(qwords + KV_KEY_WORDS * i, words + KV_KEY_WORDS * i, 8 * KV_KEY_WORDS);
        else
            alphabet_key((uint64_t)i * 37, qwords + KV_KEY_WORDS * i);
        qlens[i] = i < cap ? lens[i] : 1;
    }
    for (int32_t o = 0; o < 3; o++) {
        kv_index_find(&ix, qwords, qlens, 0, nq, o, qout);
        kv_index_find(&ix, qwords, NULL, 22, nq, o, qsame);
        for (int64_t i = 0; i < nq; i++)
            if (qout[i] != kv_index_find_one(&ix, qwords + KV_KEY_WORDS * i, qlens[i], o) ||
                qsame[i] != kv_index_find_one(&ix, qwords + KV_KEY_WORDS * i, 22, o))
                abort();
    }
    free(qwords), free(qlens), free(qout), free(qsame);
    for (int64_t i = 0; i < cap + 8; i++) {
        /* Every entry's key, under its owner and another, and keys of the alphabet beyond them. */
        uint64_t key[KV_KEY_WORDS];
        if (i < cap)
            memcpy(key, words + KV_KEY_WORDS * i, sizeof key);
        else
            alphabet_key((uint64_t)i * 37, key);
        uint8_t len = i < cap ? lens[i] : 1;
        for (int32_t o = 0; o < 3; o++) {
            int64_t got = kv_index_find_one(&ix, key, len, o);
            if (got != -1 && (got < 0 || got >= cap || !kv_same_key(words + KV_KEY_WORDS * got, key) ||
                              lens[got] != len || owner[got] != o))
                abort();
            if (!corrupt) {
                int64_t want = -1;
                for (int64_t j = 0; j < cap; j++)
                    if (filed[j] && kv_same_key(words + KV_KEY_WORDS * j, key) && lens[j] == len && owner[j] == o)
                        want = j;
                if (got != want)
                    abort();
            }
        }
    }
    /* The hit's own values from the input's start (the links above may have used up the rest). */
    input hit_in = {data + (size > 5 ? 5 : size), size > 5 ? size - 5 : 0};
    check_hit(&ix, &hit_in);
    if (heads != head)
        free(heads);
    free(words), free(lens), free(owner), free(next), free(head), free(filed);
}

/* The changes (index.h's link, unlink and split): from the input's bytes, a sequence of inserts and
 * removals of entries (keys from a small alphabet, three owners) on exact-size tables, each
 * insert followed by the splits it calls for, the head table sometimes one bucket short of them
 * (then the split is refused and nothing moves). After every change: every live entry is on its
 * bucket's chain once, no chain holds a removed entry or loops, and a walk finds exactly the live
 * entries. */
static void check_changes(const uint8_t *data, size_t size) {
    input in = {data, size};
    int64_t cap = 1 + (int64_t)(take(&in, 1) % 64);
    int64_t load = 1 + (int64_t)(take(&in, 1) % 3);
    int64_t first = 1 + (int64_t)(take(&in, 1) % 4); /* a power of two: 1, 2, 4 or 8 buckets */
    first = 1LL << (first - 1);
    int64_t head_cap = first + cap / load + 1 - (int64_t)(take(&in, 1) % 2);
    uint64_t *words = calloc(cap, 8 * KV_KEY_WORDS);
    uint8_t *lens = calloc(cap, 1);
    int32_t *owner = malloc(4 * cap), *next = malloc(4 * cap), *head = malloc(4 * head_cap);
    uint8_t *live = calloc(cap, 1);
    int64_t count = 0;
    for (int64_t i = 0; i < cap; i++)
        owner[i] = -1, next[i] = -1;
    for (int64_t b = 0; b < head_cap; b++)
        head[b] = -1;
    kv_index_rw w = {words, lens, owner, next, head, cap, first, head_cap, (uint64_t)first, 0,
                     {take(&in, 8), take(&in, 8), take(&in, 8), take(&in, 8), take(&in, 8) | 1}};
    while (in.left >= 2) {
        int64_t id = (int64_t)(take(&in, 1) % (uint64_t)cap);
        uint64_t k = take(&in, 1);
        if (live[id]) {
            if (!kv_index_unlink(&w, id))
                abort(); /* a live entry is always on its chain */
            live[id] = 0;
            count--;
        } else {
            uint64_t *wi = words + KV_KEY_WORDS * id;
            alphabet_key(k, wi);
            lens[id] = (uint8_t)(1 + (k >> 4) % 2 * 15);
            owner[id] = (int32_t)((k >> 5) % 3);
            int dup = 0; /* a key is filed once per owner */
            for (int64_t j = 0; j < cap; j++)
                dup |= live[j] && kv_same_key(words + KV_KEY_WORDS * j, wi) && lens[j] == lens[id] &&
                       owner[j] == owner[id];
            if (dup) {
                owner[id] = -1;
                continue;
            }
            if (!kv_index_link(&w, id))
                abort(); /* the state is consistent: its bucket is in use */
            live[id] = 1;
            count++;
            kv_index_rw before = w;
            if (!kv_index_split_to(&w, count, load)) {
                if (w.nhead != before.nhead || w.level != before.level || w.split != before.split)
                    abort(); /* a refused split moves nothing */
                if (w.nhead + 1 <= w.head_cap && count <= load * (w.nhead + 1))
                    abort(); /* refused only when the table is too short */
            }
        }
        if ((uint64_t)w.nhead != w.level + w.split || w.nhead > head_cap)
            abort();
        /* Every chain ends, within the table, and holds only live entries, each once. */
        uint8_t *seen = calloc(cap, 1);
        int64_t reached = 0;
        for (int64_t b = 0; b < w.nhead; b++)
            for (int32_t cur = head[b]; cur >= 0; cur = next[cur]) {
                if (cur >= cap || seen[cur] || !live[cur] || kv_index_entry_bucket(&w, cur) != b)
                    abort();
                seen[cur] = 1;
                reached++;
            }
        if (reached != count)
            abort();
        free(seen);
        kv_index r = kv_index_ro(&w);
        for (int64_t i = 0; i < cap; i++) {
            int64_t got = kv_index_find_one(&r, words + KV_KEY_WORDS * i, lens[i], owner[i] < 0 ? 0 : owner[i]);
            if (live[i] ? got != i : (got >= 0 && !live[got]))
                abort();
        }
    }
    free(words), free(lens), free(owner), free(next), free(head), free(live);
}

static void check_digests(const uint8_t *data, size_t size) {
    input in = {data, size};
    size_t len = 1 + (size_t)(take(&in, 1) % KV_DIGEST_MAX_INPUT);
    size_t n = (size_t)(take(&in, 1) % 20);
    uint8_t *keys = malloc(n * len > 0 ? n * len : 1);
    for (size_t i = 0; i < n * len; i++)
        keys[i] = (uint8_t)take(&in, 1); /* zeros once the input runs out */
    uint8_t *want = malloc(n ? n * KV_DIGEST_BYTES : 1), *got = malloc(n ? n * KV_DIGEST_BYTES : 1);
    kv_digests(keys, len, n, want, 1);
    int have = kv_digest_lanes();
    for (int lanes = 4; lanes <= 8; lanes *= 2) {
        if (!(have & lanes))
            continue;
        kv_digests(keys, len, n, got, lanes);
        if (n && memcmp(want, got, n * KV_DIGEST_BYTES))
            abort();
    }
    free(keys), free(want), free(got);
}

/* A request's keys as the index keeps them (hit.h's kv_keys_words), up to 70 keys of 1 to 64
 * bytes (more than one block of digests), from an exact-size copy into an exact-size output: each
 * key whole and zero-padded up to 32 bytes, else its digest (one key at a time) zero-padded. */
static void check_words(const uint8_t *data, size_t size) {
    input in = {data, size};
    int64_t len = 1 + (int64_t)(take(&in, 1) % 64), n = (int64_t)(take(&in, 1) % 71);
    uint8_t *keys = malloc(n * len > 0 ? (size_t)(n * len) : 1);
    for (int64_t i = 0; i < n * len; i++)
        keys[i] = (uint8_t)take(&in, 1);
    uint64_t *words = malloc(n ? (size_t)n * KV_WORD_BYTES : 1);
    kv_keys_words(keys, len, n, words);
    for (int64_t k = 0; k < n; k++) {
        uint8_t want[KV_WORD_BYTES] = {0};
        if (len <= KV_WORD_BYTES)
            memcpy(want, keys + k * len, (size_t)len);
        else
            kv_digests(keys + k * len, (size_t)len, 1, want, 1);
        if (memcmp(want, words + KV_KEY_WORDS * k, KV_WORD_BYTES))
            abort();
    }
    free(keys), free(words);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    check_one(data, size);
    check_changes(data, size);
    check_digests(data, size);
    check_words(data, size);
    return 0;
}

#ifdef KV_STANDALONE
#include "xorshift.h"

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 10;
    static uint8_t buf[512];
    time_t end = time(NULL) + (time_t)seconds;
    uint64_t runs = 0;
    while (time(NULL) < end) {
        alarm(10); /* a thousand inputs take milliseconds: a walk that never ends is killed */
        for (int k = 0; k < 1000; k++) {
            size_t len = next_random() % sizeof buf;
            for (size_t i = 0; i < len; i++)
                buf[i] = (uint8_t)next_random();
            uint8_t *exact = malloc(len ? len : 1); /* a read past the input is a heap overflow */
            memcpy(exact, buf, len);
            check_one(exact, len);
            check_changes(exact, len);
            check_digests(exact, len);
            check_words(exact, len);
            free(exact);
            runs++;
        }
    }
    printf("fuzz_index: %llu inputs in %.0f s, no fault\n", (unsigned long long)runs, seconds);
    return 0;
}
#endif
