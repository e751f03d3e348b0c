/* The lane's binary Write and Load request (format 1), and the check that decides whether the
 * compiled data plane may serve one. Shared by the daemon's extension (kvlane.c) and the fuzzer
 * (tests/fuzz/fuzz_request.c). No Python here.
 *
 * Layout, little-endian, exactly `len` bytes (kvserver/protocol/lane_request.py, docs/lane.md):
 *   0  magic u32 = "KVR1"   4 version u16 = 1   6 kind u16 (1 Write, 2 Load)   8 flags u32
 *   12 n_pages u32   16 n_dev u32   20 n_layers u32   24 timeout_ms u32   28 event_slot u32
 *   32 ready_len u32   36 reserved u32 = 0
 *   40 host page starts i64[n_pages] (each the host index of a page's token 0: the page's
 *      page_size tokens follow it), device entries i64[n_dev], layer ids u32[n_layers], ready bytes
 * flags: KV_DEV_RUNS: each device entry is the first of page_size consecutive device tokens;
 * else each is one device token. No other bit may be set.
 * Every count is bounded by the request's length before anything past the header is read.
 *
 * kv_accept() answers only "certainly valid" (1) or "not for this path" (0): it never words an
 * error. A request it does not accept goes to the daemon's one validation in Python, which gives
 * the status and message the gRPC call would; so both paths answer alike by construction, and a
 * differential test (tests/test_dataplane.py) checks that kv_accept never accepts what that
 * validation refuses. */
#ifndef KVLANE_REQUEST_H
#define KVLANE_REQUEST_H

#include <stdint.h>
#include <string.h>

#define KV_REQ_MAGIC 0x3152564Bu /* "KVR1" */
#define KV_REQ_VERSION 1
#define KV_REQ_HEADER 40
#define KV_DEV_RUNS 1u
#define KV_KIND_WRITE 1
#define KV_KIND_LOAD 2
#define KV_EPOCH_SHIFT 36
#define KV_SLOT_MASK ((INT64_C(1) << KV_EPOCH_SHIFT) - 1)

typedef struct {
    uint32_t kind, flags, n_pages, n_dev, n_layers, timeout_ms, event_slot, ready_len;
    const unsigned char *host, *dev, *layers; /* unaligned little-endian arrays inside the request */
    const unsigned char *ready;               /* ready_len bytes: a CUDA IPC event handle */
} kv_request;

/* What the check needs of one registration. owned[p] != 0: page p is allocated to it. */
typedef struct {
    int64_t epoch, num_pages, page_size, dev_tokens, max_indices;
    int32_t start_layer, num_layers;
    const uint8_t *owned;
    uint32_t *page_mark, *dev_mark; /* scratch, num_pages and dev_tokens entries */
    uint32_t *generation;           /* bumped per check: marks of older checks read as unset */
    /* A CUDA pool's (0 for shared memory: no event slot but 0, no ready event): the highest event
     * slot a load may name, and the length a ready event must have if one is sent. */
    uint32_t max_event_slot, ready_len;
} kv_limits;

static inline uint32_t kv_u32(const unsigned char *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline int64_t kv_i64(const unsigned char *p) {
    int64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* A new check's mark: marks of older checks read as unset (all cleared once when it wraps). */
static inline uint32_t kv_next_generation(const kv_limits *lim) {
    uint32_t gen = ++*lim->generation;
    if (gen == 0) {
        memset(lim->page_mark, 0, sizeof(uint32_t) * (size_t)lim->num_pages);
        memset(lim->dev_mark, 0, sizeof(uint32_t) * (size_t)lim->dev_tokens);
        gen = *lim->generation = 1;
    }
    return gen;
}

/* Parses the header and bounds every array by `len`. 1: well formed. */
static inline int kv_parse(const unsigned char *buf, uint64_t len, kv_request *r) {
    if (len < KV_REQ_HEADER || kv_u32(buf) != KV_REQ_MAGIC)
        return 0;
    uint16_t version, kind;
    memcpy(&version, buf + 4, 2);
    memcpy(&kind, buf + 6, 2);
    if (version != KV_REQ_VERSION || (kind != KV_KIND_WRITE && kind != KV_KIND_LOAD))
        return 0;
    r->kind = kind;
    r->flags = kv_u32(buf + 8);
    r->n_pages = kv_u32(buf + 12);
    r->n_dev = kv_u32(buf + 16);
    r->n_layers = kv_u32(buf + 20);
    r->timeout_ms = kv_u32(buf + 24);
    r->event_slot = kv_u32(buf + 28);
    r->ready_len = kv_u32(buf + 32);
    if ((r->flags & ~KV_DEV_RUNS) || kv_u32(buf + 36))
        return 0;
    uint64_t need = KV_REQ_HEADER + 8 * (uint64_t)r->n_pages + 8 * (uint64_t)r->n_dev +
                    4 * (uint64_t)r->n_layers + (uint64_t)r->ready_len;
    if (need != len)
        return 0;
    r->host = buf + KV_REQ_HEADER;
    r->dev = r->host + 8 * (uint64_t)r->n_pages;
    r->layers = r->dev + 8 * (uint64_t)r->n_dev;
    r->ready = r->layers + 4 * (uint64_t)r->n_layers;
    return 1;
}

/* Device token t (0 <= t < n_pages * page_size) of a parsed request. */
static inline int64_t kv_dev_token(const kv_request *r, int64_t ps, int64_t t) {
    if (r->flags & KV_DEV_RUNS)
        return kv_i64(r->dev + 8 * (uint64_t)(t / ps)) + t % ps;
    return kv_i64(r->dev + 8 * (uint64_t)t);
}

/* 1 if the request is certainly valid for `lim` (ownership aside: the caller checks it under the
 * registration's lock); fills pages[n_pages] and local[] (local layer ids; all layers when none
 * are named) and *n_local. */
static inline int kv_accept(const kv_request *r, const kv_limits *lim, int64_t *pages, int32_t *local,
                            uint32_t *n_local) {
    const int64_t ps = lim->page_size;
    if ((r->ready_len && r->ready_len != lim->ready_len) || r->event_slot > lim->max_event_slot ||
        r->n_pages == 0 || ps <= 0)
        return 0;
    const uint64_t ntok = (uint64_t)r->n_pages * (uint64_t)ps;
    if (r->n_dev != ((r->flags & KV_DEV_RUNS) ? (uint64_t)r->n_pages : ntok))
        return 0;
    if (ntok > (uint64_t)lim->max_indices || r->n_layers > (uint32_t)lim->num_layers)
        return 0;
    uint32_t gen = kv_next_generation(lim);
    for (uint32_t k = 0; k < r->n_pages; k++) {
        int64_t h = kv_i64(r->host + 8 * (uint64_t)k);
        if (h < 0 || (h >> KV_EPOCH_SHIFT) != lim->epoch)
            return 0;
        int64_t slot = h & KV_SLOT_MASK;
        if (slot % ps)
            return 0;
        int64_t page = slot / ps;
        if (page >= lim->num_pages || lim->page_mark[page] == gen)
            return 0;
        lim->page_mark[page] = gen;
        pages[k] = page;
    }
    if (r->flags & KV_DEV_RUNS) {
        for (uint32_t k = 0; k < r->n_dev; k++) {
            int64_t d = kv_i64(r->dev + 8 * (uint64_t)k);
            if (d < 0 || d > lim->dev_tokens - ps)
                return 0;
            for (int64_t t = d; t < d + ps; t++) {
                if (lim->dev_mark[t] == gen)
                    return 0;
                lim->dev_mark[t] = gen;
            }
        }
    } else {
        for (uint32_t i = 0; i < r->n_dev; i++) {
            int64_t d = kv_i64(r->dev + 8 * (uint64_t)i);
            if (d < 0 || d >= lim->dev_tokens || lim->dev_mark[d] == gen)
                return 0;
            lim->dev_mark[d] = gen;
        }
    }
    if (r->n_layers == 0) {
        for (int32_t i = 0; i < lim->num_layers; i++)
            local[i] = i;
        *n_local = (uint32_t)lim->num_layers;
    } else {
        int64_t prev = -1;
        for (uint32_t i = 0; i < r->n_layers; i++) {
            int64_t g = kv_u32(r->layers + 4 * (uint64_t)i);
            int64_t l = g - lim->start_layer;
            if (l < 0 || l >= lim->num_layers || l <= prev)
                return 0;
            local[i] = (int32_t)l;
            prev = l;
        }
        *n_local = r->n_layers;
    }
    return 1;
}

#endif
