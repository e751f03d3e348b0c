/* The digest a wide cache key (33 to 64 bytes) is kept as: BLAKE2b (RFC 7693) with a 16-byte
 * output, no key, and the personalization "kvserver-key", the same bytes as Python's
 * hashlib.blake2b(key, digest_size=16, person=b"kvserver-key") (kvserver/store/keys.py).
 *
 * A key of at most 64 bytes fits one 128-byte block, so a digest is one compression. Header only,
 * no allocation, no Python: the extension and a fuzzer can include it alike. */
#ifndef KV_DIGEST_H
#define KV_DIGEST_H

#include <stdint.h>
#include <string.h>

#define KV_DIGEST_BYTES 16
#define KV_DIGEST_MAX_INPUT 128 /* one block */

static const uint64_t kv_blake2b_iv[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static const uint8_t kv_blake2b_sigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static inline uint64_t kv_load64(const uint8_t *p) {
    uint64_t x;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(&x, p, 8);
#else
    x = 0;
    for (int i = 7; i >= 0; i--)
        x = (x << 8) | p[i];
#endif
    return x;
}

/* The compression of one (last) block, on v[16] and m[16] of one key each (uint64_t) or of a
 * vector of keys each, ROT(x, n) rotating right by n. Macros, not functions: inside a vector path
 * below everything must be that path's own code. */
#define KV_ROT(x, n) (((x) >> (n)) | ((x) << (64 - (n))))
#define KV_G(ROT, a, b, c, d, x, y)    \
    do {                               \
        v[a] = v[a] + v[b] + (x);      \
        v[d] = ROT(v[d] ^ v[a], 32);   \
        v[c] = v[c] + v[d];            \
        v[b] = ROT(v[b] ^ v[c], 24);   \
        v[a] = v[a] + v[b] + (y);      \
        v[d] = ROT(v[d] ^ v[a], 16);   \
        v[c] = v[c] + v[d];            \
        v[b] = ROT(v[b] ^ v[c], 63);   \
    } while (0)
#define KV_ROUNDS(ROT)                                             \
    for (int r = 0; r < 12; r++) {                                 \
        const uint8_t *s = kv_blake2b_sigma[r];                    \
        KV_G(ROT, 0, 4, 8, 12, m[s[0]], m[s[1]]);                  \
        KV_G(ROT, 1, 5, 9, 13, m[s[2]], m[s[3]]);                  \
        KV_G(ROT, 2, 6, 10, 14, m[s[4]], m[s[5]]);                 \
        KV_G(ROT, 3, 7, 11, 15, m[s[6]], m[s[7]]);                 \
        KV_G(ROT, 0, 5, 10, 15, m[s[8]], m[s[9]]);                 \
        KV_G(ROT, 1, 6, 11, 12, m[s[10]], m[s[11]]);               \
        KV_G(ROT, 2, 7, 8, 13, m[s[12]], m[s[13]]);                \
        KV_G(ROT, 3, 4, 9, 14, m[s[14]], m[s[15]]);                \
    }

/* The state after the parameter block: 16-byte digest, no key, fanout and depth 1, and the
 * personalization (16 bytes, zero-padded). The same for every key. */
static inline void kv_digest_init(uint64_t h[8]) {
    static const uint8_t person[16] = {'k', 'v', 's', 'e', 'r', 'v', 'e', 'r', '-', 'k', 'e', 'y'};
    for (int i = 0; i < 8; i++)
        h[i] = kv_blake2b_iv[i];
    h[0] ^= 0x01010000ULL ^ KV_DIGEST_BYTES;
    h[6] ^= kv_load64(person);
    h[7] ^= kv_load64(person + 8);
}

/* out[0..15] = the digest of in[0..len), len <= KV_DIGEST_MAX_INPUT (the caller checks). The
 * digest's bytes are written as two little-endian words, as numpy reads them on this machine. */
static inline void kv_digest(const uint64_t init[8], const uint8_t *in, size_t len, uint8_t out[16]) {
    uint8_t block[128] = {0};
    memcpy(block, in, len);
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++)
        m[i] = kv_load64(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = init[i];
        v[i + 8] = kv_blake2b_iv[i];
    }
    v[12] ^= (uint64_t)len; /* bytes compressed so far (the high counter word stays 0) */
    v[14] = ~v[14];         /* the last block */
    KV_ROUNDS(KV_ROT)
    for (int i = 0; i < 2; i++) {
        uint64_t w = init[i] ^ v[i] ^ v[i + 8];
        for (int b = 0; b < 8; b++)
            out[8 * i + b] = (uint8_t)(w >> (8 * b));
    }
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KV_DIGEST_VECTORS 1
/* Where the CPU has them, N keys of one length are digested at once with vector instructions,
 * one key a lane (GCC's vector extensions): kv_digest's steps on vectors of type VT. Each path is
 * compiled alone for its instruction set (chosen when called). */
#define KV_DIGEST_VECTOR(NAME, TARGET, VT, N, ROT)                                                     \
    __attribute__((target(TARGET))) static void NAME(const uint64_t init[8], const uint8_t *in,       \
                                                     size_t len, uint8_t *out) {                       \
        VT m[16], v[16];                                                                               \
        uint8_t block[N][128] = {{0}};                                                                 \
        for (int k = 0; k < N; k++)                                                                    \
            memcpy(block[k], in + k * len, len);                                                       \
        for (int i = 0; i < 16; i++) {                                                                 \
            uint64_t w[N];                                                                             \
            for (int k = 0; k < N; k++)                                                                \
                w[k] = kv_load64(block[k] + 8 * i);                                                    \
            memcpy(&m[i], w, sizeof w);                                                                \
        }                                                                                              \
        for (int i = 0; i < 8; i++) {                                                                  \
            v[i] = (VT){0} + init[i];                                                                  \
            v[i + 8] = (VT){0} + kv_blake2b_iv[i];                                                     \
        }                                                                                              \
        v[12] ^= (uint64_t)len;                                                                        \
        v[14] = ~v[14];                                                                                \
        KV_ROUNDS(ROT)                                                                                 \
        for (int i = 0; i < 2; i++) {                                                                  \
            VT w = v[i] ^ v[i + 8] ^ init[i];                                                          \
            for (int k = 0; k < N; k++) {                                                              \
                uint64_t x = w[k];                                                                     \
                memcpy(out + KV_DIGEST_BYTES * k + 8 * i, &x, 8); /* x86: little endian */             \
            }                                                                                          \
        }                                                                                              \
    }

/* AVX2, four keys in 256-bit vectors (about twice the scalar rate): its rotations by whole bytes
 * are byte shuffles within each lane, faster there than two shifts. */
typedef uint64_t kv_v4 __attribute__((vector_size(32)));
typedef uint8_t kv_b32 __attribute__((vector_size(32)));
#define KV_LANE(n, o) (o) + (n) % 8, (o) + ((n) + 1) % 8, (o) + ((n) + 2) % 8, (o) + ((n) + 3) % 8, \
                      (o) + ((n) + 4) % 8, (o) + ((n) + 5) % 8, (o) + ((n) + 6) % 8, (o) + ((n) + 7) % 8
#define KV_ROT4(x, n)                                                                                   \
    ((n) % 8 ? KV_ROT(x, n)                                                                             \
             : (kv_v4)__builtin_shuffle((kv_b32)(x), (kv_b32){KV_LANE((n) / 8, 0), KV_LANE((n) / 8, 8), \
                                                              KV_LANE((n) / 8, 16), KV_LANE((n) / 8, 24)}))
KV_DIGEST_VECTOR(kv_digest4, "avx2", kv_v4, 4, KV_ROT4)

/* AVX-512F, eight keys in 512-bit vectors (about three times the scalar rate): its rotate
 * instruction does each rotation in one step. */
typedef uint64_t kv_v8 __attribute__((vector_size(64)));
KV_DIGEST_VECTOR(kv_digest8, "avx512f", kv_v8, 8, KV_ROT)

#undef KV_LANE
#undef KV_ROT4
#undef KV_DIGEST_VECTOR
#endif

/* The paths this CPU has, as a mask of their widths in keys: 1 (scalar), 4 (AVX2), 8 (AVX-512F). */
static inline int kv_digest_lanes(void) {
    int lanes = 1;
#ifdef KV_DIGEST_VECTORS
    if (__builtin_cpu_supports("avx2"))
        lanes |= 4;
    if (__builtin_cpu_supports("avx512f"))
        lanes |= 8;
#endif
    return lanes;
}

/* n keys of len bytes each, back to back; out: n digests, back to back. lanes: 0, the widest
 * path the CPU has; else that path (1, 4 or 8; the caller checked the CPU has it). */
static inline void kv_digests(const uint8_t *in, size_t len, size_t n, uint8_t *out, int lanes) {
    uint64_t init[8];
    kv_digest_init(init);
    int have = kv_digest_lanes();
    if (!lanes)
        lanes = have & 8 ? 8 : have & 4 ? 4 : 1;
    size_t i = 0;
#ifdef KV_DIGEST_VECTORS
    if (lanes == 8 && (have & 8))
        for (; i + 8 <= n; i += 8)
            kv_digest8(init, in + i * len, len, out + i * KV_DIGEST_BYTES);
    if (lanes >= 4 && (have & 4))
        for (; i + 4 <= n; i += 4)
            kv_digest4(init, in + i * len, len, out + i * KV_DIGEST_BYTES);
#endif
    for (; i < n; i++)
        kv_digest(init, in + i * len, len, out + i * KV_DIGEST_BYTES);
}

#undef KV_G
#undef KV_ROT
#undef KV_ROUNDS

#endif
