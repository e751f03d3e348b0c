/* Packed protobuf varints (a `repeated int64` field's payload), read as protobuf reads them: each
 * value is its 7-bit groups, low first, a set top bit meaning another byte follows; bits past 64
 * (a tenth byte's upper bits) are dropped. Shared by the extension (packed.c) and the fuzzer
 * (tests/fuzz/fuzz_varint.c). Header only; reads only in[0, n) and writes only out[0, cap). */
#ifndef KV_VARINT_H
#define KV_VARINT_H

#include <stddef.h>
#include <stdint.h>

#define KV_VARINT_CUT (-1)  /* the payload ends inside a varint */
#define KV_VARINT_LONG (-2) /* a varint longer than ten bytes */
#define KV_VARINT_ROOM (-3) /* more values than out has room for */

/* How many varints the payload holds if it is well formed: its bytes without a top bit. */
static inline size_t kv_varint_count(const uint8_t *in, size_t n) {
    size_t count = 0;
    for (size_t i = 0; i < n; i++)
        count += in[i] < 0x80;
    return count;
}

/* Decodes the payload in[0, n) into out[0, cap): how many values, or a KV_VARINT_ code. */
static inline int64_t kv_varints(const uint8_t *in, size_t n, uint64_t *out, size_t cap) {
    size_t i = 0, k = 0;
    while (i < n) {
        uint64_t v = 0;
        unsigned shift = 0;
        for (;;) {
            if (i >= n)
                return KV_VARINT_CUT;
            uint8_t b = in[i++];
            v |= (uint64_t)(b & 0x7F) << shift; /* shift <= 63 here: the tenth byte is the last */
            if (b < 0x80)
                break;
            if (shift == 63)
                return KV_VARINT_LONG;
            shift += 7;
        }
        if (k >= cap)
            return KV_VARINT_ROOM;
        out[k++] = v;
    }
    return (int64_t)k;
}

#endif
