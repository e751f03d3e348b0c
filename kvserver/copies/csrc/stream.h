/* Row copies for large jobs with non-temporal ("streaming") stores.
 *
 * A plain memcpy of a 32 KiB row writes through the caches: each destination line is first read
 * for ownership, then written back when it is evicted, and a 16 MiB job leaves the last-level
 * cache full of lines nobody will read soon (the event loop's own data is evicted with them).
 * glibc streams only single copies above about 3/4 of the cache; a job is thousands of rows, each
 * under that. Streaming stores skip the read for ownership and bypass the caches: on a 2-core EPYC
 * VM scattered 32 KiB rows copied at 1.13-2.15x the speed of memcpy, from 1 MiB to 256 MiB, in one
 * process (benchmarks/bench_stream.py); through the daemon, whose data plane copied at that machine's
 * copy bandwidth already, nothing changed measurably (docs/performance.md, "Streaming stores").
 *
 * Which jobs stream (kv_streams): every write (device -> host: nothing reads the host copy until a
 * later load), and loads of KV_STREAM_MIN_JOB bytes or more (a smaller load may still be in the
 * cache when the engine reads it; a larger one would not be).
 *
 * kv_copy(d, s, n, stream) copies n bytes; with stream set and n >= KV_STREAM_MIN_ROW it streams
 * whole 64-byte lines of the destination and memcpys the unaligned head and tail. Streaming stores
 * are weakly ordered: kv_copy_fence(stream) must run before anything tells another thread or
 * process that the bytes are there (a progress word, an eventfd, a completion). Elsewhere than
 * x86-64 both are memcpy and nothing. */
#ifndef KV_STREAM_H
#define KV_STREAM_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define KV_STREAM_MIN_JOB ((int64_t)8 << 20) /* a quarter of a 32 MiB last-level cache */
#define KV_STREAM_MIN_ROW 256

/* A build with CFLAGS=-DKV_NO_STREAM never streams: what the streaming stores give is measured
 * against it (docs/performance.md). */
static inline int kv_streams(int load, int64_t job_bytes) {
#ifdef KV_NO_STREAM
    (void)load, (void)job_bytes;
    return 0;
#else
    return !load || job_bytes >= KV_STREAM_MIN_JOB;
#endif
}

#if defined(__x86_64__)
#include <emmintrin.h>

static inline void kv_copy(void *dst, const void *src, size_t n, int stream) {
    if (!stream || n < KV_STREAM_MIN_ROW) {
        memcpy(dst, src, n);
        return;
    }
    char *d = (char *)dst;
    const char *s = (const char *)src;
    size_t head = (size_t)(-(uintptr_t)d & 63); /* to the next 64-byte line of the destination */
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    for (; n >= 64; d += 64, s += 64, n -= 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)s);
        __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
    }
    memcpy(d, s, n);
}

static inline void kv_copy_fence(int stream) {
    if (stream)
        _mm_sfence();
}
#else
static inline void kv_copy(void *dst, const void *src, size_t n, int stream) {
    (void)stream;
    memcpy(dst, src, n);
}

static inline void kv_copy_fence(int stream) { (void)stream; }
#endif

#endif
