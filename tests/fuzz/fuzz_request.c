/* Fuzzes the lane's binary request reader and check (kvserver/lane/csrc/request.h): whatever the
 * bytes, kv_parse/kv_accept read only inside the request and the registration's tables, and what
 * kv_accept takes is valid: whole owned-range pages of this epoch, each once; device tokens in
 * the pool, each once; layers ascending inside the range. Built with AddressSanitizer and
 * UndefinedBehaviorSanitizer by scripts/sanitize.sh, which runs it for a bounded time.
 *
 * With clang's libFuzzer (-fsanitize=fuzzer) LLVMFuzzerTestOneInput is its entry; built without
 * it (gcc, -DKV_STANDALONE), main() mutates well-formed seeds at random: bit flips, overwritten
 * words with edge values, truncation and extension, counts changed without the arrays. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "../../kvserver/lane/csrc/request.h"

#define PAGES 64
#define PAGE 4
#define DEV 256
#define LAYERS 6
#define START 3
#define EPOCH 0x5A5

static uint8_t owned[PAGES];
static uint32_t page_mark[PAGES], dev_mark[DEV], generation;

#define CUDA_SLOTS 3 /* a CUDA pool's limits: event slots 0..2, a 64-byte ready event */

/* One request against a shared-memory pool's limits (cuda 0: no event slot but 0, no ready event)
 * or a CUDA pool's. */
static void check_with(const uint8_t *data, size_t size, int cuda) {
    kv_limits lim = {EPOCH, PAGES, PAGE, DEV, 1 << 20, START, LAYERS, owned, page_mark, dev_mark, &generation,
                     cuda ? CUDA_SLOTS - 1 : 0, cuda ? 64 : 0};
    kv_request r;
    if (!kv_parse(data, size, &r))
        return;
    if (KV_REQ_HEADER + 8 * (uint64_t)r.n_pages + 8 * (uint64_t)r.n_dev + 4 * (uint64_t)r.n_layers + r.ready_len != size)
        abort();
    int64_t *pages = malloc(sizeof(int64_t) * ((size_t)r.n_pages + 1));
    int32_t local[LAYERS];
    uint32_t nl = 0;
    if (kv_accept(&r, &lim, pages, local, &nl)) {
        uint64_t ntok = (uint64_t)r.n_pages * PAGE;
        if (r.n_pages == 0 || r.n_dev != ((r.flags & KV_DEV_RUNS) ? r.n_pages : ntok))
            abort();
        if (cuda ? ((r.ready_len && r.ready_len != 64) || r.event_slot >= CUDA_SLOTS) : (r.ready_len || r.event_slot))
            abort();
        if (r.ready + r.ready_len != data + size) /* the ready event is the request's last bytes */
            abort();
        for (uint32_t k = 0; k < r.n_pages; k++) {
            if (pages[k] < 0 || pages[k] >= PAGES)
                abort();
            for (uint32_t m = 0; m < k; m++)
                if (pages[m] == pages[k])
                    abort();
            int64_t h = kv_i64(r.host + 8 * k);
            if ((h >> KV_EPOCH_SHIFT) != EPOCH || (h & KV_SLOT_MASK) != pages[k] * PAGE)
                abort();
        }
        static uint8_t seen[DEV];
        memset(seen, 0, sizeof seen);
        for (uint64_t t = 0; t < ntok; t++) {
            int64_t d = kv_dev_token(&r, PAGE, (int64_t)t);
            if (d < 0 || d >= DEV || seen[d]++)
                abort();
        }
        if (nl == 0 || nl > LAYERS || (r.n_layers && nl != r.n_layers))
            abort();
        for (uint32_t i = 0; i < nl; i++)
            if (local[i] < 0 || local[i] >= LAYERS || (i && local[i] <= local[i - 1]))
                abort();
    }
    free(pages);
}

static void check_one(const uint8_t *data, size_t size) {
    check_with(data, size, 0);
    check_with(data, size, 1);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    for (int p = 0; p < PAGES; p++)
        owned[p] = p % 3 != 0;
    check_one(data, size);
    return 0;
}

#ifdef KV_STANDALONE
#include "xorshift.h"

static size_t seed(uint8_t *buf, size_t cap) {
    uint32_t pages = 1 + next_random() % 4, layers = next_random() % 3, runs = next_random() % 2;
    uint32_t kind = 1 + next_random() % 2, ndev = runs ? pages : pages * PAGE;
    /* A CUDA pool's requests: an event slot, and a ready event (its 64 bytes last). */
    uint32_t slot = next_random() % 4 == 0 ? next_random() % 4 : 0, ready = next_random() % 3 == 0 ? 64 : 0;
    size_t len = KV_REQ_HEADER + 8 * (size_t)pages + 8 * (size_t)ndev + 4 * layers + ready;
    if (len > cap)
        return 0;
    uint32_t h[10] = {KV_REQ_MAGIC, KV_REQ_VERSION | (kind << 16), runs ? KV_DEV_RUNS : 0, pages, ndev, layers,
                      0, slot, ready, 0};
    memcpy(buf, h, sizeof h);
    uint8_t *p = buf + KV_REQ_HEADER;
    for (uint32_t k = 0; k < pages; k++) {
        int64_t v = ((int64_t)EPOCH << KV_EPOCH_SHIFT) | ((1 + 3 * k) * PAGE);
        memcpy(p, &v, 8);
        p += 8;
    }
    for (uint32_t i = 0; i < ndev; i++) {
        int64_t v = runs ? (int64_t)(next_random() % 4) * 64 + i * PAGE : (int64_t)(next_random() % 8) * 32 + i;
        memcpy(p, &v, 8);
        p += 8;
    }
    for (uint32_t i = 0; i < layers; i++) {
        uint32_t v = START + i * 2;
        memcpy(p, &v, 4);
        p += 4;
    }
    for (uint32_t i = 0; i < ready; i++)
        *p++ = (uint8_t)next_random();
    return len;
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 10;
    static uint8_t buf[1 << 16];
    static const int64_t edges[] = {0, -1, 1, INT64_MAX, INT64_MIN, 0xFFFFFFFF, PAGES, DEV, (int64_t)EPOCH << 36};
    time_t end = time(NULL) + (time_t)seconds;
    uint64_t runs = 0, accepted = 0;
    while (time(NULL) < end) {
        for (int k = 0; k < 1000; k++) {
            size_t len = seed(buf, sizeof buf);
            int muts = (int)(next_random() % 4);
            for (int m = 0; m < muts && len; m++) {
                switch (next_random() % 5) {
                case 0: buf[next_random() % len] ^= (uint8_t)(1u << (next_random() % 8)); break;
                case 1: {
                    size_t at = next_random() % len;
                    int64_t v = edges[next_random() % (sizeof edges / sizeof *edges)];
                    memcpy(buf + at, &v, at + 8 <= len ? 8 : len - at);
                    break;
                }
                case 2: len = next_random() % (len + 1); break;
                case 3: {
                    size_t more = next_random() % 64;
                    if (len + more <= sizeof buf) {
                        for (size_t i = 0; i < more; i++)
                            buf[len + i] = (uint8_t)next_random();
                        len += more;
                    }
                    break;
                }
                default: {
                    uint32_t v = (uint32_t)next_random() % 32;
                    memcpy(buf + 8 + 4 * (next_random() % 8), &v, 4);
                }
                }
            }
            /* An exact-size copy, so that a read past the request is a heap overflow. */
            uint8_t *exact = malloc(len ? len : 1);
            memcpy(exact, buf, len);
            for (int p = 0; p < PAGES; p++)
                owned[p] = p % 3 != 0;
            kv_request r;
            kv_limits lim = {EPOCH, PAGES, PAGE, DEV, 1 << 20, START, LAYERS, owned, page_mark, dev_mark, &generation};
            int64_t pages[1 << 12];
            int32_t local[LAYERS];
            uint32_t nl;
            if (kv_parse(exact, len, &r) && r.n_pages < (1 << 12) && kv_accept(&r, &lim, pages, local, &nl))
                accepted++;
            check_one(exact, len);
            free(exact);
            runs++;
        }
    }
    printf("fuzz_request: %llu inputs in %.0f s, %llu accepted, no fault\n", (unsigned long long)runs, seconds,
           (unsigned long long)accepted);
    return 0;
}
#endif
