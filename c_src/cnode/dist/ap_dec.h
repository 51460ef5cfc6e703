/* ap_dec: the small decoders every C node's message handling shares.
 *
 * They run ei's decoders, which take no buffer length: only over a term
 * that a walk (ap_term_skip, ap_ctrl_decode) has proved lies inside the
 * buffer. */
#ifndef AP_DEC_H
#define AP_DEC_H

#include <ei.h>
#include <stddef.h>
#include <string.h>

/* The atom at b[*i] into out (cap bytes, its NUL included), as UTF-8, and
 * *i past it. 0; -1 for anything but an atom, or an atom that does not fit
 * (*i is left alone then). */
static inline int ap_get_atom(const char *b, int *i, char *out, size_t cap)
{
	int type, size;
	if (ei_get_type(b, i, &type, &size) || type != ERL_ATOM_EXT || (size_t)size >= cap)
		return -1;
	return ei_decode_atom_as(b, i, out, (int)cap, ERLANG_UTF8, NULL, NULL) ? -1 : 0;
}

/* Whether the term at b[i] is the atom `want`. */
static inline int ap_is_atom(const char *b, int i, const char *want)
{
	char a[MAXATOMLEN_UTF8];
	return ap_get_atom(b, &i, a, sizeof a) == 0 && strcmp(a, want) == 0;
}

#endif
