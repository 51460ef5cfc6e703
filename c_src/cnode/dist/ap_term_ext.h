/* ap_term_ext: the external term format as ap_term reads it: its tags
 * (erts/emulator/beam/external.h), the atom lengths ei takes, and the
 * sizes of the fixed parts the walk and the strict check step over. Each
 * size is bounded by `left` (the bytes that follow): -1 past it. Private to
 * ap_term. */
#ifndef AP_TERM_EXT_H
#define AP_TERM_EXT_H

#include <stddef.h>
#include <stdint.h>

#include "ap_buf.h"

/* Tags of the external term format (erts/emulator/beam/external.h). */
enum {
	T_NEW_FLOAT = 70, T_BIT_BINARY = 77, T_NEW_PID = 88, T_NEW_PORT = 89,
	T_NEWER_REF = 90, T_SMALL_INT = 97, T_INT = 98, T_FLOAT = 99, T_ATOM = 100,
	T_REF = 101, T_PORT = 102, T_PID = 103, T_SMALL_TUPLE = 104,
	T_LARGE_TUPLE = 105, T_NIL = 106, T_STRING = 107, T_LIST = 108,
	T_BINARY = 109, T_SMALL_BIG = 110, T_LARGE_BIG = 111, T_NEW_FUN = 112,
	T_EXPORT = 113, T_NEW_REF = 114, T_SMALL_ATOM = 115, T_MAP = 116,
	T_ATOM_UTF8 = 118, T_SMALL_ATOM_UTF8 = 119, T_V4_PORT = 120,
};

/* ei decodes atoms into MAXATOMLEN_UTF8 (1021) byte buffers, and atoms that
 * name a module or node as UTF-8, converting a Latin-1 one (each byte above
 * 127 doubles). The BEAM caps atoms at 255 characters, so these limits refuse
 * nothing it sends and keep every atom inside what ei reads in every place. */
#define LATIN1_ATOM_MAX 255
#define UTF8_ATOM_MAX (4 * 255)

/* Bytes of the atom at p (tag included), or -1. */
static inline long atom_size(const uint8_t *p, size_t left)
{
	long n;
	if (left < 1)
		return -1;
	switch (p[0]) {
	case T_ATOM:
	case T_ATOM_UTF8:
		if (left < 3)
			return -1;
		n = ap_get16be(p + 1);
		if (n > (p[0] == T_ATOM ? LATIN1_ATOM_MAX : UTF8_ATOM_MAX))
			return -1;
		n += 3;
		break;
	case T_SMALL_ATOM:
	case T_SMALL_ATOM_UTF8:
		if (left < 2)
			return -1;
		n = 2 + (long)p[1]; /* at most 255 bytes either way */
		break;
	default:
		return -1;
	}
	return (size_t)n <= left ? n : -1;
}

/* Bytes of the pid at p (PID_EXT or NEW_PID_EXT), or -1. */
static inline long pid_size(const uint8_t *p, size_t left)
{
	if (left < 1 || (p[0] != T_PID && p[0] != T_NEW_PID))
		return -1;
	long a = atom_size(p + 1, left - 1);
	if (a < 0)
		return -1;
	long n = 1 + a + (p[0] == T_NEW_PID ? 12 : 9);
	return (size_t)n <= left ? n : -1;
}

/* Bytes of a SMALL_INTEGER_EXT (or INTEGER_EXT if `wide`) at p, or -1.
 * ei_decode_long also takes bigs; nothing the BEAM encodes in these places
 * is one, so they are refused. */
static inline long int_size(const uint8_t *p, size_t left, int wide)
{
	if (left >= 2 && p[0] == T_SMALL_INT)
		return 2;
	if (wide && left >= 5 && p[0] == T_INT)
		return 5;
	return -1;
}

/* A fun's fixed fields after its 30-byte header, as ei_decode_fun reads them:
 * Module (atom), OldIndex and OldUniq (integers), Pid. Bytes, or -1. */
static inline long fun_fields_size(const uint8_t *p, size_t left)
{
	long n = 0, a;
	if ((a = atom_size(p, left)) < 0)
		return -1;
	n += a;
	for (int k = 0; k < 2; k++) {
		if ((a = int_size(p + n, left - (size_t)n, 1)) < 0)
			return -1;
		n += a;
	}
	if ((a = pid_size(p + n, left - (size_t)n)) < 0)
		return -1;
	return n + a;
}

/* EXPORT_EXT's Module, Function (atoms) and Arity (small integer). */
static inline long export_size(const uint8_t *p, size_t left)
{
	long n = 0, a;
	for (int k = 0; k < 2; k++) {
		if ((a = atom_size(p + n, left - (size_t)n)) < 0)
			return -1;
		n += a;
	}
	if ((a = int_size(p + n, left - (size_t)n, 0)) < 0)
		return -1;
	return n + a;
}

#endif
