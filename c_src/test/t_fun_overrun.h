/* t_fun_overrun: the crafted fun of issue 12, shared by the C tests. */
#ifndef T_FUN_OVERRUN_H
#define T_FUN_OVERRUN_H

#include <ei.h>
#include <stdint.h>
#include <string.h>

/* Appends two terms, Fun then Pad. Fun is a NEW_FUN_EXT with one free
 * variable whose Size claims 5 bytes more than it spans, so ei, which skips
 * a fun by its Size, lands inside Pad: Pad is a binary whose first 5 bytes
 * are a BINARY_EXT header claiming `claim` bytes. A walk over the fields
 * finds both terms well formed; ei_skip_term over {Fun, Pad} ends `claim`
 * bytes past the buffer. Returns 0, or -1 if an encoder failed. */
static inline int t_fun_overrun(ei_x_buff *x, uint32_t claim)
{
	static const uint8_t head[] = {
		112, 0, 0, 0, 0, /* NEW_FUN_EXT, Size (patched below) */
		1,               /* Arity */
		0xab, 0xab, 0xab, 0xab, 0xab, 0xab, 0xab, 0xab,
		0xab, 0xab, 0xab, 0xab, 0xab, 0xab, 0xab, 0xab, /* Uniq */
		0, 0, 0, 5,      /* Index */
		0, 0, 0, 1,      /* NumFree */
		119, 1, 'm',     /* Module */
		97, 5,           /* OldIndex */
		98, 0, 0, 4, 210, /* OldUniq */
		88, 119, 3, 'n', '@', 'h', 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, /* Pid */
		97, 7,           /* the free variable */
	};
	uint8_t f[sizeof head], pad[5 + 8];
	memcpy(f, head, sizeof f);
	uint32_t size = (uint32_t)sizeof f - 1 + 5;
	f[1] = (uint8_t)(size >> 24);
	f[2] = (uint8_t)(size >> 16);
	f[3] = (uint8_t)(size >> 8);
	f[4] = (uint8_t)size;
	pad[0] = 109;
	pad[1] = (uint8_t)(claim >> 24);
	pad[2] = (uint8_t)(claim >> 16);
	pad[3] = (uint8_t)(claim >> 8);
	pad[4] = (uint8_t)claim;
	memset(pad + 5, 0x5a, 8);
	if (ei_x_append_buf(x, (const char *)f, (int)sizeof f))
		return -1;
	return ei_x_encode_binary(x, pad, (long)sizeof pad) ? -1 : 0;
}

#endif
