/* ap_rand: a random 64-bit seed that never blocks.
 *
 * getrandom(2) without waiting (this runs at start-up, maybe early in
 * boot); without the entropy pool, the clock, the pid and an address
 * (ASLR) through splitmix64's finaliser: differs per process and per
 * object, which is all a seed or nonce here must do (none is a secret a
 * peer could not get round anyway). */
#ifndef AP_RAND_H
#define AP_RAND_H

#include <stdint.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

static inline uint64_t ap_rand_seed(const void *salt)
{
	uint64_t x;
	struct timespec ts;

	if (getrandom(&x, sizeof x, GRND_NONBLOCK) == (ssize_t)sizeof x)
		return x;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	x = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
	x ^= (uint64_t)getpid() << 32 ^ (uint64_t)(uintptr_t)salt;
	x = (x ^ x >> 30) * 0xbf58476d1ce4e5b9ULL;
	x = (x ^ x >> 27) * 0x94d049bb133111ebULL;
	return x ^ x >> 31;
}

#endif
