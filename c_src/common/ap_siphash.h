/* ap_siphash: SipHash-1-3, the keyed hash of every table whose keys come
 * from users: the snapshot's index (ap_shm_hash, part of its format) and
 * the receptionist's own tables (registry.c). One copy, so the two cannot
 * drift apart and the registry needs nothing of the snapshot's.
 *
 * SipHash-1-3 is Aumasson and Bernstein's SipHash with c = 1, d = 3, as in
 * CPython and Rust's std: a keyed PRF, so without the key nobody can pick
 * keys that collide (see "Hashing" in ap_shm.h). Keys are short: the cost
 * is one round per 8 bytes plus four, ~20 ns for 16 bytes. Inline: the
 * NIF's lookups hash every key they look up.
 */
#ifndef AP_SIPHASH_H
#define AP_SIPHASH_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define AP_SIP_ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))
#define AP_SIP_ROUND                                \
	do {                                        \
		v0 += v1;                           \
		v1 = AP_SIP_ROTL(v1, 13);           \
		v1 ^= v0;                           \
		v0 = AP_SIP_ROTL(v0, 32);           \
		v2 += v3;                           \
		v3 = AP_SIP_ROTL(v3, 16);           \
		v3 ^= v2;                           \
		v0 += v3;                           \
		v3 = AP_SIP_ROTL(v3, 21);           \
		v3 ^= v0;                           \
		v2 += v1;                           \
		v1 = AP_SIP_ROTL(v1, 17);           \
		v1 ^= v2;                           \
		v2 = AP_SIP_ROTL(v2, 32);           \
	} while (0)

static inline uint64_t ap_sip_ld_le64(const uint8_t *p)
{
	uint64_t v;
	memcpy(&v, p, 8);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
	v = __builtin_bswap64(v);
#endif
	return v;
}

/* SipHash-1-3 of in[0..len) with the 128-bit key (k0, k1); the message is
 * read as little-endian 64-bit words, whatever the host's endianness. */
static inline uint64_t ap_siphash13(uint64_t k0, uint64_t k1, const void *in, size_t klen)
{
	const uint8_t *p = in;
	uint64_t v0 = k0 ^ 0x736f6d6570736575ull, v1 = k1 ^ 0x646f72616e646f6dull;
	uint64_t v2 = k0 ^ 0x6c7967656e657261ull, v3 = k1 ^ 0x7465646279746573ull;
	uint64_t b = (uint64_t)klen << 56;
	size_t i = 0, tail = klen & 7;

	for (; i + 8 <= klen; i += 8) {
		uint64_t m = ap_sip_ld_le64(p + i);
		v3 ^= m;
		AP_SIP_ROUND;
		v0 ^= m;
	}
	for (size_t j = 0; j < tail; j++)
		b |= (uint64_t)p[i + j] << (8 * j);
	v3 ^= b;
	AP_SIP_ROUND;
	v0 ^= b;
	v2 ^= 0xff;
	AP_SIP_ROUND;
	AP_SIP_ROUND;
	AP_SIP_ROUND;
	return v0 ^ v1 ^ v2 ^ v3;
}

#undef AP_SIP_ROUND
#undef AP_SIP_ROTL

#endif
