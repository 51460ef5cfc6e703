/* t_reserve: a handler reply's reserve callback for tests and fuzz targets
 * (no cmocka: t_reply.h builds on it for the unit tests). */
#ifndef T_RESERVE_H
#define T_RESERVE_H

#include <stdint.h>
#include <stdlib.h>

#include "actor_pool_handler.h"

/* Grows to exactly what was asked, never more: a handler that writes past
 * what it reserved overruns the block, and ASan says so. */
static inline int t_reserve(actor_pool_reply *r, size_t more)
{
	size_t need = r->len + more;
	if (need <= r->cap)
		return 0;
	uint8_t *d = realloc(r->data, need);
	if (!d)
		return -1;
	r->data = d;
	r->cap = need;
	return 0;
}

#endif
