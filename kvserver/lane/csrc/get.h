/* A lane Get (the protobuf GetRequest of rpc id 4, as the client sends it) read in C, and the check
 * that decides whether the data plane may serve it whole: walk the cache's index, hold the pages,
 * copy them and answer (docs/design.md, "A Get on the data plane"); likewise an engine's Lookup of
 * its own part (LookupRequest, rpc id 7), which walks and answers, and a scheduler's Lookup of a
 * whole space on its space's lane. Shared by the daemon's
 * extension (kvlane.c) and the fuzzer (tests/fuzz/fuzz_get.c). No Python here.
 *
 * The reader takes only the plainest form of the message: each field at most once, with its own
 * wire type, nothing it does not know, no event, ready event, lease or parts (a Get that names one
 * of those, or sends a field twice, or an unknown one, is the event loop's, whose protobuf parser
 * reads it as protobuf does). Every length is bounded by the bytes left before it is used.
 *
 * As with the binary Write and Load (request.h), kv_get_accept() answers only "certainly valid" (1)
 * or "not for this path" (0), never an error: what it refuses is handed to the event loop, whose one
 * validation answers as the gRPC call would. */
#ifndef KVLANE_GET_H
#define KVLANE_GET_H

#include <stdint.h>
#include <string.h>

#include "request.h"

#define KV_GET_MAX_KEY_BYTES 64 /* kvserver/store/keys.py MAX_KEY_BYTES */

typedef struct {
    const unsigned char *client_id, *keys, *dev, *layers; /* dev, layers: packed varints */
    uint64_t client_id_len, keys_len, dev_len, layers_len;
    uint64_t key_bytes, timeout_ms;
} kv_get;

/* One varint at *p (before end): 1 and *v, *p past it; 0 if it runs past end or past 64 bits. */
static inline int kv_varint(const unsigned char **p, const unsigned char *end, uint64_t *v) {
    uint64_t r = 0;
    for (int s = 0; s < 64 && *p < end; s += 7) {
        unsigned char b = *(*p)++;
        if (s == 63 && b > 1)
            return 0;
        r |= (uint64_t)(b & 0x7F) << s;
        if (!(b & 0x80)) {
            *v = r;
            return 1;
        }
    }
    return 0;
}

/* The count of varints in [p, p + len), or -1 if one runs past the end. */
static inline int64_t kv_varints(const unsigned char *p, uint64_t len) {
    const unsigned char *end = p + len;
    int64_t n = 0;
    uint64_t v;
    while (p < end) {
        if (!kv_varint(&p, end, &v))
            return -1;
        n++;
    }
    return n;
}

/* A message's fields as the readers below take them. */
typedef struct {
    const unsigned char *p; /* bytes: where they start (NULL: absent) */
    uint64_t v;             /* bytes: their length; varint: its value (0: absent) */
} kv_pb_field;

/* Reads `buf` as a message whose field f is kinds[f]: 'v' a varint, 'b' bytes, '-' none it takes
 * (kinds[0] too); fields past strlen(kinds) are not taken either. 1 if each comes at most once,
 * with a one-byte tag (every field here has one; protobuf refuses tags of over 5 bytes) and its
 * own wire type, every length inside the message and every varint at most UINT32_MAX (each is a
 * uint32 or a bool here); fields[f] (room for strlen(kinds)) then holds field f. */
static inline int kv_pb_read(const unsigned char *buf, uint64_t len, const char *kinds, kv_pb_field *fields) {
    const uint64_t nf = strlen(kinds);
    memset(fields, 0, sizeof *fields * (size_t)nf);
    const unsigned char *p = buf, *end = buf + len;
    uint32_t seen = 0;
    while (p < end) {
        uint64_t v, tag = *p++;
        if (tag & 0x80)
            return 0;
        uint64_t field = tag >> 3, wire = tag & 7;
        if (field < 1 || field >= nf || kinds[field] == '-' || (seen >> field & 1))
            return 0;
        seen |= 1u << field;
        int bytes = kinds[field] == 'b';
        if (wire != (bytes ? 2u : 0u) || !kv_varint(&p, end, &v))
            return 0;
        if (!bytes) {
            if (v > UINT32_MAX)
                return 0;
            fields[field].v = v;
            continue;
        }
        if (v > (uint64_t)(end - p))
            return 0;
        fields[field] = (kv_pb_field){p, v};
        p += v;
    }
    return 1;
}

/* Reads a GetRequest (fields: 1 client_id, 2 keys, 3 key_bytes, 4 device_pages, 5 layers,
 * 6 event_slot, 7 ready_event, 8 timeout_ms, 9 lease_id, 10 parts). 1: it is in the plain form
 * above (event_slot, ready_event and lease_id absent or empty, no parts). */
static inline int kv_get_parse(const unsigned char *buf, uint64_t len, kv_get *q) {
    kv_pb_field f[10];
    memset(q, 0, sizeof *q);
    if (!kv_pb_read(buf, len, "-bbvbbvbvb", f) || f[6].v || f[7].v || f[9].v)
        return 0;
    *q = (kv_get){f[1].p, f[2].p, f[4].p, f[5].p, f[1].v, f[2].v, f[4].v, f[5].v, f[3].v, f[8].v};
    return 1;
}

typedef struct {
    const unsigned char *client_id, *space_id, *keys;
    uint64_t client_id_len, space_id_len, keys_len, key_bytes;
    uint64_t pin_ms, whole_space;
    uint64_t memory_only; /* host memory's pages only: its end makes no tier's copies recent */
} kv_lookup;

/* Reads a LookupRequest (fields: 1 client_id, 2 space_id, 3 keys, 4 key_bytes, 5 pin_ms,
 * 6 whole_space, 7 memory_only, 8 timeout_ms) in the plain form above. Whose it is, an engine's
 * or a scheduler's, the accepts below decide. (timeout_ms changes nothing for a walk of host memory
 * that runs at once: read, not kept. memory_only changes only the end: kept.) */
static inline int kv_lookup_parse(const unsigned char *buf, uint64_t len, kv_lookup *q) {
    kv_pb_field f[9];
    memset(q, 0, sizeof *q);
    if (!kv_pb_read(buf, len, "-bbbvvvvv", f))
        return 0;
    *q = (kv_lookup){f[1].p, f[2].p, f[3].p, f[1].v, f[2].v, f[3].v, f[4].v, f[5].v, f[6].v, f[7].v};
    return 1;
}

/* Reads a PutRequest (fields: 1 client_id, 2 keys, 3 key_bytes, 4 device_pages, 5 ready_event,
 * 6 timeout_ms) into a kv_get with no layers, so that kv_get_accept checks it as a Get of its keys
 * into its device pages: 1 if it is in the plain form (no ready event). */
static inline int kv_put_parse(const unsigned char *buf, uint64_t len, kv_get *q) {
    kv_pb_field f[7];
    memset(q, 0, sizeof *q);
    if (!kv_pb_read(buf, len, "-bbvbbv", f) || f[5].v)
        return 0;
    *q = (kv_get){f[1].p, f[2].p, f[4].p, NULL, f[1].v, f[2].v, f[4].v, 0, f[3].v, f[6].v};
    return 1;
}

/* What the check needs of the registration beyond kv_limits (its marks, layers, pool): */
typedef struct {
    const char *client_id; /* the lane's registration: a Get must name it */
    uint64_t client_id_len;
    int64_t max_keys;      /* keys the plane takes in one Get (the loop's step, the daemon's limit) */
} kv_get_limits;

/* 1 if the Get is certainly valid for the registration: its own client id, whole keys of 1 to
 * KV_GET_MAX_KEY_BYTES bytes, 1 to max_keys of them, a device page for each (distinct, inside
 * the pool's whole pages), layers inside the range and ascending. Fills dev[n] (device pages),
 * local[] (local layer ids; all when none are named), *n_keys and *n_local. dev must have room for
 * max_keys entries, local for lim->num_layers. */
static inline int kv_get_accept(const kv_get *q, const kv_limits *lim, const kv_get_limits *gl, int64_t *dev,
                                int32_t *local, int64_t *n_keys, uint32_t *n_local) {
    const int64_t ps = lim->page_size;
    if (ps <= 0 || q->client_id_len != gl->client_id_len ||
        (gl->client_id_len && memcmp(q->client_id, gl->client_id, (size_t)gl->client_id_len)))
        return 0;
    if (q->key_bytes < 1 || q->key_bytes > KV_GET_MAX_KEY_BYTES || q->keys_len % q->key_bytes)
        return 0;
    int64_t n = (int64_t)(q->keys_len / q->key_bytes);
    if (n < 1 || n > gl->max_keys || kv_varints(q->dev, q->dev_len) != n)
        return 0;
    int64_t nl = q->layers_len ? kv_varints(q->layers, q->layers_len) : 0;
    if (nl < 0 || nl > lim->num_layers)
        return 0;
    uint32_t gen = kv_next_generation(lim);
    const int64_t dev_pages = lim->dev_tokens / ps;
    const unsigned char *p = q->dev, *end = q->dev + q->dev_len;
    for (int64_t k = 0; k < n; k++) {
        uint64_t v;
        if (!kv_varint(&p, end, &v) || v >= (uint64_t)dev_pages || lim->dev_mark[v] == gen)
            return 0; /* (a negative page is a varint of 2^63 or more) */
        lim->dev_mark[v] = gen; /* marks by page: dev_tokens >= dev_pages entries */
        dev[k] = (int64_t)v;
    }
    if (nl == 0) {
        for (int32_t i = 0; i < lim->num_layers; i++)
            local[i] = i;
        *n_local = (uint32_t)lim->num_layers;
    } else {
        p = q->layers;
        end = q->layers + q->layers_len;
        int64_t prev = -1;
        for (int64_t i = 0; i < nl; i++) {
            uint64_t v;
            if (!kv_varint(&p, end, &v) || v > UINT32_MAX)
                return 0;
            int64_t l = (int64_t)v - lim->start_layer;
            if (l < 0 || l >= lim->num_layers || l <= prev)
                return 0;
            local[i] = (int32_t)l;
            prev = l;
        }
        *n_local = (uint32_t)nl;
    }
    *n_keys = n;
    return 1;
}

/* 1 to max_keys whole keys of 1 to KV_GET_MAX_KEY_BYTES bytes (*n_keys of them), no pin. */
static inline int kv_lookup_keys(const kv_lookup *q, int64_t max_keys, int64_t *n_keys) {
    if (q->pin_ms || q->key_bytes < 1 || q->key_bytes > KV_GET_MAX_KEY_BYTES || q->keys_len % q->key_bytes)
        return 0;
    int64_t n = (int64_t)(q->keys_len / q->key_bytes);
    if (n < 1 || n > max_keys)
        return 0;
    *n_keys = n;
    return 1;
}

/* 1 if the Lookup is certainly valid for the registration: an engine's Lookup of its own part
 * (its own client id, no space id, not the whole space, no pin), with kv_lookup_keys' keys. */
static inline int kv_lookup_accept(const kv_lookup *q, const kv_get_limits *gl, int64_t *n_keys) {
    if (q->client_id_len != gl->client_id_len || q->space_id_len || q->whole_space ||
        (gl->client_id_len && memcmp(q->client_id, gl->client_id, (size_t)gl->client_id_len)))
        return 0;
    return kv_lookup_keys(q, gl->max_keys, n_keys);
}

/* 1 if the Lookup is certainly valid on a space's lane (a scheduler's Lookup of the whole space):
 * no client id, the lane's space id (gl's client_id), no pin (whole_space changes nothing for a
 * space), with kv_lookup_keys' keys. */
static inline int kv_space_lookup_accept(const kv_lookup *q, const kv_get_limits *gl, int64_t *n_keys) {
    if (q->client_id_len || !gl->client_id_len || q->space_id_len != gl->client_id_len ||
        memcmp(q->space_id, gl->client_id, (size_t)gl->client_id_len))
        return 0;
    return kv_lookup_keys(q, gl->max_keys, n_keys);
}

#endif
