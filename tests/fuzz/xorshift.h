/* The standalone fuzz drivers' random source (-DKV_STANDALONE, without libFuzzer): xorshift64,
 * seeded alike in every run, so that a run that fails fails again. */
#ifndef KV_XORSHIFT_H
#define KV_XORSHIFT_H

#include <stdint.h>

static uint64_t rng = 88172645463325252ull;

static uint64_t next_random(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

#endif
