/* ap_buf: a growable byte buffer, the unit every send and reassembly path writes into. */
#ifndef AP_BUF_H
#define AP_BUF_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct ap_buf {
	uint8_t *data;
	size_t len;
	size_t cap;
} ap_buf;

/* Grow the malloc'd block *data of *cap bytes to hold `need`: the capacity
 * doubles from `first` (when *cap is 0), but stops at `limit` when need
 * fits in it. Every growable buffer of the C nodes grows by this. Returns
 * 0, or -1 when out of memory (the block is unchanged then). */
static inline int ap_grow(uint8_t **data, size_t *cap, size_t need, size_t first, size_t limit)
{
	if (need <= *cap)
		return 0;
	size_t c = *cap ? *cap : first;
	while (c < need)
		c = c > SIZE_MAX / 2 ? need : c * 2;
	if (c > limit && need <= limit)
		c = limit;
	uint8_t *p = realloc(*data, c);
	if (!p)
		return -1;
	*data = p;
	*cap = c;
	return 0;
}

/* Make room for `more` bytes past len, doubling the capacity, but not past
 * `limit` when len + more fits in it: a buffer that collects one item of
 * known size grows with the bytes that arrived and ends at the item's size.
 * Returns 0, or -1 when out of memory (the buffer is unchanged then). */
static inline int ap_buf_reserve_upto(ap_buf *b, size_t more, size_t limit)
{
	if (more > SIZE_MAX - b->len)
		return -1;
	return ap_grow(&b->data, &b->cap, b->len + more, 256, limit);
}

static inline int ap_buf_reserve(ap_buf *b, size_t more)
{
	return ap_buf_reserve_upto(b, more, SIZE_MAX);
}

/* Append n bytes, growing at most to limit (see ap_buf_reserve_upto). */
static inline int ap_buf_append_upto(ap_buf *b, const void *src, size_t n, size_t limit)
{
	if (ap_buf_reserve_upto(b, n, limit))
		return -1;
	if (n)
		memcpy(b->data + b->len, src, n);
	b->len += n;
	return 0;
}

static inline int ap_buf_append(ap_buf *b, const void *src, size_t n)
{
	if (ap_buf_reserve(b, n))
		return -1;
	if (n)
		memcpy(b->data + b->len, src, n);
	b->len += n;
	return 0;
}

static inline void ap_buf_free(ap_buf *b)
{
	free(b->data);
	b->data = NULL;
	b->len = b->cap = 0;
}

static inline void ap_put32be(uint8_t *p, uint32_t v)
{
	p[0] = (uint8_t)(v >> 24);
	p[1] = (uint8_t)(v >> 16);
	p[2] = (uint8_t)(v >> 8);
	p[3] = (uint8_t)v;
}

static inline uint32_t ap_get32be(const uint8_t *p)
{
	return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static inline uint16_t ap_get16be(const uint8_t *p)
{
	return (uint16_t)((uint16_t)p[0] << 8 | p[1]);
}

#endif
