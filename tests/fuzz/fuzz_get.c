/* Fuzzes the data plane's reader and check of a lane Get, of an engine's Lookup, of a scheduler's
 * Lookup of a whole space and of a Put (kvserver/lane/csrc/get.h): whatever the bytes,
 * kv_get_parse/kv_get_accept, kv_lookup_parse/kv_lookup_accept/kv_space_lookup_accept and
 * kv_put_parse read only inside the request and the registration's marks, and
 * what the checks take is valid: this registration's client id (a space's Lookup: no client id,
 * the lane's space id), no pin, 1 to MAX_KEYS whole keys of 1 to 64 bytes; for a Get, a distinct
 * device page inside the pool for each and layers ascending inside the range. Built with AddressSanitizer and UndefinedBehaviorSanitizer by
 * scripts/sanitize.sh.
 *
 * With clang's libFuzzer (-fsanitize=fuzzer) LLVMFuzzerTestOneInput is its entry; built without
 * it (gcc, -DKV_STANDALONE), main() mutates well-formed GetRequests at random: bit flips, bytes
 * set to edge values, truncation and extension, a field's length or tag overwritten. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "../../kvserver/lane/csrc/get.h"

#define PAGE 4
#define DEV 256 /* tokens: 64 device pages */
#define LAYERS 6
#define START 3
#define MAX_KEYS 40
static const char ID[] = "client-0123456789abcdef";
static const char SID[] = "0123456789abcdef0123456789abcdef"; /* a space's lane's id */

static uint8_t owned[1];
static uint32_t page_mark[1], dev_mark[DEV], generation;

/* Whether [p, p + len) lies inside the input (or p is NULL: the field is absent). */
static int inside(const unsigned char *p, uint64_t len, const uint8_t *data, size_t size) {
    return !p || (p >= data && len <= (uint64_t)(data + size - p));
}

/* What an accepted call must be: this client's id, 1 to MAX_KEYS whole keys of 1 to 64 bytes. */
static void check_keys(const unsigned char *id, uint64_t id_len, uint64_t key_bytes, uint64_t keys_len, int64_t n) {
    if (id_len != sizeof ID - 1 || memcmp(id, ID, sizeof ID - 1) || key_bytes < 1 || key_bytes > KV_GET_MAX_KEY_BYTES ||
        n < 1 || n > MAX_KEYS || (uint64_t)n * key_bytes != keys_len)
        abort();
}

static void check_lookup(const uint8_t *data, size_t size) {
    kv_get_limits gl = {ID, sizeof ID - 1, MAX_KEYS};
    kv_lookup q;
    int64_t n = 0;
    if (!kv_lookup_parse(data, size, &q))
        return;
    if (!inside(q.keys, q.keys_len, data, size) || !inside(q.client_id, q.client_id_len, data, size) ||
        !inside(q.space_id, q.space_id_len, data, size))
        abort();
    if (kv_lookup_accept(&q, &gl, &n)) {
        check_keys(q.client_id, q.client_id_len, q.key_bytes, q.keys_len, n);
        if (q.space_id_len || q.whole_space || q.pin_ms)
            abort();
    }
    kv_get_limits sl = {SID, sizeof SID - 1, MAX_KEYS};
    if (kv_space_lookup_accept(&q, &sl, &n)) {
        check_keys((const unsigned char *)ID, sizeof ID - 1, q.key_bytes, q.keys_len, n);
        if (q.client_id_len || q.pin_ms || q.space_id_len != sizeof SID - 1 ||
            memcmp(q.space_id, SID, sizeof SID - 1))
            abort();
    }
}

/* A Get (put 0) or a Put (put 1, read as a Get of its keys with no layers). */
static void check_get(const uint8_t *data, size_t size, int put) {
    kv_limits lim = {0, 0, PAGE, DEV, 1 << 20, START, LAYERS, owned, page_mark, dev_mark, &generation};
    kv_get_limits gl = {ID, sizeof ID - 1, MAX_KEYS};
    kv_get q;
    int64_t dev[MAX_KEYS], n = 0;
    int32_t local[LAYERS];
    uint32_t nl = 0;
    if (!(put ? kv_put_parse(data, size, &q) : kv_get_parse(data, size, &q)))
        return;
    if ((put && q.layers) || !inside(q.keys, q.keys_len, data, size) || !inside(q.dev, q.dev_len, data, size) ||
        !inside(q.layers, q.layers_len, data, size) || !inside(q.client_id, q.client_id_len, data, size))
        abort();
    if (!kv_get_accept(&q, &lim, &gl, dev, local, &n, &nl))
        return;
    check_keys(q.client_id, q.client_id_len, q.key_bytes, q.keys_len, n);
    static uint8_t seen[DEV / PAGE];
    memset(seen, 0, sizeof seen);
    for (int64_t k = 0; k < n; k++)
        if (dev[k] < 0 || dev[k] >= DEV / PAGE || seen[dev[k]]++)
            abort();
    if (nl == 0 || nl > LAYERS || (put && nl != LAYERS))
        abort();
    for (uint32_t i = 0; i < nl; i++)
        if (local[i] < 0 || local[i] >= LAYERS || (i && local[i] <= local[i - 1]))
            abort();
}

static void check_one(const uint8_t *data, size_t size) {
    check_lookup(data, size);
    check_get(data, size, 1);
    check_get(data, size, 0);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    check_one(data, size);
    return 0;
}

#ifdef KV_STANDALONE
#include "xorshift.h"

static size_t put_varint(uint8_t *p, uint64_t v) {
    size_t n = 0;
    do {
        p[n++] = (uint8_t)((v & 0x7F) | (v > 0x7F ? 0x80 : 0));
        v >>= 7;
    } while (v);
    return n;
}

static size_t put_bytes(uint8_t *p, int field, const uint8_t *data, size_t len) {
    size_t n = put_varint(p, (uint64_t)field << 3 | 2);
    n += put_varint(p + n, len);
    memcpy(p + n, data, len);
    return n + len;
}

/* A LookupRequest as an engine sends it (client id, keys, key_bytes, timeout_ms, memory_only), or
 * as a scheduler sends it on its space's lane (its space id for the client id). */
static size_t seed_lookup(uint8_t *buf) {
    uint8_t keys[16 * 8];
    uint32_t nkeys = 1 + next_random() % 8, width = (uint32_t[]){1, 16, 32, 48, 64}[next_random() % 5];
    if (width * nkeys > sizeof keys)
        nkeys = sizeof keys / width;
    for (size_t i = 0; i < width * nkeys; i++)
        keys[i] = (uint8_t)next_random();
    size_t len = next_random() % 2 ? put_bytes(buf, 1, (const uint8_t *)ID, sizeof ID - 1)
                                   : put_bytes(buf, 2, (const uint8_t *)SID, sizeof SID - 1);
    len += put_bytes(buf + len, 3, keys, width * nkeys);
    len += put_varint(buf + len, 4 << 3);
    len += put_varint(buf + len, width);
    if (next_random() % 2) {
        len += put_varint(buf + len, 8 << 3);
        len += put_varint(buf + len, next_random() % 5000);
    }
    if (next_random() % 4 == 0) {
        len += put_varint(buf + len, 7 << 3);
        len += put_varint(buf + len, 1);
    }
    return len;
}

/* A PutRequest as the client sends it (client id, keys, key_bytes, device pages, timeout_ms). */
static size_t seed_put(uint8_t *buf) {
    uint8_t keys[16 * 8], devs[10 * 8];
    uint32_t nkeys = 1 + next_random() % 8, width = (uint32_t[]){1, 16, 32, 48, 64}[next_random() % 5];
    if (width * nkeys > sizeof keys)
        nkeys = sizeof keys / width;
    for (size_t i = 0; i < width * nkeys; i++)
        keys[i] = (uint8_t)next_random();
    size_t nd = 0;
    for (uint32_t k = 0; k < nkeys; k++)
        nd += put_varint(devs + nd, (next_random() % 4) * 16 + k);
    size_t len = put_bytes(buf, 1, (const uint8_t *)ID, sizeof ID - 1);
    len += put_bytes(buf + len, 2, keys, width * nkeys);
    len += put_varint(buf + len, 3 << 3);
    len += put_varint(buf + len, width);
    len += put_bytes(buf + len, 4, devs, nd);
    if (next_random() % 2) {
        len += put_varint(buf + len, 6 << 3);
        len += put_varint(buf + len, next_random() % 5000);
    }
    return len;
}

/* A GetRequest as the client sends it, its fields in a random order. */
static size_t seed(uint8_t *buf) {
    uint32_t which = next_random() % 4;
    if (which == 0)
        return seed_lookup(buf);
    if (which == 1)
        return seed_put(buf);
    uint8_t keys[16 * 8], devs[10 * 8], lays[8];
    uint32_t nkeys = 1 + next_random() % 8, width = (uint32_t[]){1, 16, 32, 48, 64}[next_random() % 5];
    if (width * nkeys > sizeof keys)
        nkeys = sizeof keys / width;
    for (size_t i = 0; i < width * nkeys; i++)
        keys[i] = (uint8_t)next_random();
    size_t nd = 0, nlay = 0;
    for (uint32_t k = 0; k < nkeys; k++)
        nd += put_varint(devs + nd, (next_random() % 4) * 16 + k);
    uint32_t layers = next_random() % 3;
    for (uint32_t i = 0; i < layers; i++)
        nlay += put_varint(lays + nlay, START + 2 * i);
    size_t len = 0;
    int order = (int)(next_random() % 2);
    if (order)
        len += put_bytes(buf + len, 2, keys, width * nkeys);
    len += put_bytes(buf + len, 1, (const uint8_t *)ID, sizeof ID - 1);
    if (!order)
        len += put_bytes(buf + len, 2, keys, width * nkeys);
    len += put_varint(buf + len, 3 << 3);
    len += put_varint(buf + len, width);
    len += put_bytes(buf + len, 4, devs, nd);
    if (layers)
        len += put_bytes(buf + len, 5, lays, nlay);
    if (next_random() % 2) {
        len += put_varint(buf + len, 8 << 3);
        len += put_varint(buf + len, next_random() % 5000);
    }
    return len;
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 10;
    static uint8_t buf[1 << 12];
    static const uint8_t edges[] = {0, 1, 0x7F, 0x80, 0xFF, 0x0A, 0x12, 0x1A, 0x22, 0x2A, 0x30, 0x3A, 0x4A, 0x52, 64};
    time_t end = time(NULL) + (time_t)seconds;
    uint64_t runs = 0, accepted = 0;
    while (time(NULL) < end) {
        for (int k = 0; k < 1000; k++) {
            size_t len = seed(buf);
            int muts = (int)(next_random() % 4);
            for (int m = 0; m < muts && len; m++) {
                switch (next_random() % 4) {
                case 0: buf[next_random() % len] ^= (uint8_t)(1u << (next_random() % 8)); break;
                case 1: buf[next_random() % len] = edges[next_random() % sizeof edges]; break;
                case 2: len = next_random() % (len + 1); break;
                default: {
                    size_t more = next_random() % 32;
                    if (len + more <= sizeof buf) {
                        for (size_t i = 0; i < more; i++)
                            buf[len + i] = (uint8_t)next_random();
                        len += more;
                    }
                }
                }
            }
            /* An exact-size copy, so that a read past the request is a heap overflow. */
            uint8_t *exact = malloc(len ? len : 1);
            memcpy(exact, buf, len);
            kv_limits lim = {0, 0, PAGE, DEV, 1 << 20, START, LAYERS, owned, page_mark, dev_mark, &generation};
            kv_get_limits gl = {ID, sizeof ID - 1, MAX_KEYS};
            kv_get q;
            int64_t dev[MAX_KEYS], n;
            int32_t local[LAYERS];
            uint32_t nl;
            kv_get_limits sl = {SID, sizeof SID - 1, MAX_KEYS};
            kv_lookup lq;
            if ((kv_get_parse(exact, len, &q) && kv_get_accept(&q, &lim, &gl, dev, local, &n, &nl)) ||
                (kv_lookup_parse(exact, len, &lq) &&
                 (kv_lookup_accept(&lq, &gl, &n) || kv_space_lookup_accept(&lq, &sl, &n))) ||
                (kv_put_parse(exact, len, &q) && kv_get_accept(&q, &lim, &gl, dev, local, &n, &nl)))
                accepted++;
            check_one(exact, len);
            free(exact);
            runs++;
        }
    }
    printf("fuzz_get: %llu inputs in %.0f s, %llu accepted, no fault\n", (unsigned long long)runs, seconds,
           (unsigned long long)accepted);
    return 0;
}
#endif
