/* Fuzzes the packed varint decoder (kvserver/api/csrc/varint.h), which reads a large request's
 * index lists from a peer's bytes: whatever the bytes, kv_varints reads only inside them and
 * writes only inside its output, and it agrees with a plain reading of the format (below, one byte
 * at a time) on every value and on every malformed list; kv_varint_count is exact for the lists it
 * accepts. Built with AddressSanitizer and UndefinedBehaviorSanitizer by scripts/sanitize.sh, which
 * runs it for a bounded time.
 *
 * With clang's libFuzzer (-fsanitize=fuzzer) LLVMFuzzerTestOneInput is its entry; built without
 * it (gcc, -DKV_STANDALONE), main() makes inputs at random: bytes biased towards the continuation
 * bit, so that long and cut varints are common, and output buffers of every size around the count. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../../kvserver/api/csrc/varint.h"

/* The format read plainly: -1 cut, -2 over ten bytes, -3 no room; else the count. */
static int64_t plain(const uint8_t *in, size_t n, uint64_t *out, size_t cap) {
    size_t k = 0, len = 0;
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++) {
        if (len == 10)
            return -2;
        v |= (uint64_t)(in[i] & 0x7F) << (len * 7); /* len <= 9: a shift of at most 63 */
        len++;
        if (in[i] < 0x80) {
            if (k >= cap)
                return -3;
            out[k++] = v;
            v = 0;
            len = 0;
        }
    }
    return len ? -1 : (int64_t)k;
}

static void check_one(const uint8_t *data, size_t size, size_t cap) {
    uint64_t *got = malloc(sizeof(uint64_t) * (cap ? cap : 1)); /* a write past cap is an overflow */
    uint64_t *want = malloc(sizeof(uint64_t) * (size + 1));
    int64_t g = kv_varints(data, size, got, cap);
    int64_t w = plain(data, size, want, cap);
    /* Both refuse, or both read the same count. Which fault a list with several is refused for
     * may differ (a tenth byte with the top bit at the list's end is over ten bytes to one, cut
     * short to the other). */
    if ((g < 0) != (w < 0) || (g >= 0 && g != w))
        abort();
    if (g == KV_VARINT_ROOM && w != -3)
        abort(); /* "no room" only where the plain reading runs out of room too */
    if (g >= 0) {
        if (memcmp(got, want, sizeof(uint64_t) * (size_t)g) != 0)
            abort();
        if (kv_varint_count(data, size) != (size_t)g)
            abort();
    }
    free(got);
    free(want);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    check_one(data, size, kv_varint_count(data, size));
    check_one(data, size, size);
    return 0;
}

#ifdef KV_STANDALONE
#include "xorshift.h"

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 10;
    static uint8_t buf[256];
    time_t end = time(NULL) + (time_t)seconds;
    uint64_t runs = 0;
    while (time(NULL) < end) {
        alarm(10);
        for (int k = 0; k < 1000; k++) {
            size_t len = next_random() % sizeof buf;
            unsigned bias = (unsigned)(next_random() % 100); /* percent of bytes with the top bit */
            for (size_t i = 0; i < len; i++) {
                uint8_t b = (uint8_t)next_random() & 0x7F;
                buf[i] = (next_random() % 100 < bias) ? (uint8_t)(b | 0x80) : b;
            }
            uint8_t *exact = malloc(len ? len : 1); /* a read past the input is a heap overflow */
            memcpy(exact, buf, len);
            size_t count = kv_varint_count(exact, len);
            check_one(exact, len, count);
            check_one(exact, len, count ? count - 1 : 0);
            check_one(exact, len, next_random() % (len + 2));
            free(exact);
            runs++;
        }
    }
    printf("fuzz_varint: %llu inputs in %.0f s, no fault\n", (unsigned long long)runs, seconds);
    return 0;
}
#endif
