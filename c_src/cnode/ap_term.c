/* ap_term: iterative, bounded validation of external-term-format data. */
#include "ap_term.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>

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

/* Bytes that follow an atom tag at p, or -1. Only atoms may name a node. */
static long atom_size(const uint8_t *p, size_t left)
{
	if (left < 1)
		return -1;
	switch (p[0]) {
	case T_ATOM:
	case T_ATOM_UTF8:
		if (left < 3)
			return -1;
		return 3 + (long)ap_get16be(p + 1);
	case T_SMALL_ATOM:
	case T_SMALL_ATOM_UTF8:
		if (left < 2)
			return -1;
		return 2 + (long)p[1];
	default:
		return -1;
	}
}

int ap_term_skip(const char *cbuf, size_t len, int *idx)
{
	const uint8_t *buf = (const uint8_t *)cbuf;
	if (*idx < 0 || (size_t)*idx > len || len > INT32_MAX)
		return -1;
	size_t i = (size_t)*idx;
	/* Terms still to read. Every term needs at least one byte, so a count
	 * larger than the bytes left can be rejected at once; that also bounds
	 * the count and keeps it from overflowing. */
	uint64_t pending = 1;
	/* Elements left in each open container: ei's skip and decoders recurse
	 * once per level, so the nesting depth must be bounded as well. */
	uint64_t left_in[AP_TERM_MAX_DEPTH + 1];
	int depth = 0;
	left_in[0] = 1;

	while (pending > 0) {
		if (pending > len - i)
			return -1;
		pending--;
		while (left_in[depth] == 0)
			depth--; /* pending > 0: some open container has elements left */
		left_in[depth]--;
		uint64_t before = pending;
		const uint8_t *p = buf + i;
		size_t left = len - i;
		uint64_t n;
		long a;

		switch (p[0]) {
		case T_SMALL_INT:
			if (left < 2) return -1;
			i += 2;
			break;
		case T_INT:
			if (left < 5) return -1;
			i += 5;
			break;
		case T_NEW_FLOAT:
			if (left < 9) return -1;
			i += 9;
			break;
		case T_FLOAT: {
			/* Old text floats: ei rejects text sscanf cannot read, and
			 * the walk must agree with ei on every term it passes. */
			char txt[32];
			double d;
			if (left < 32) return -1;
			memcpy(txt, p + 1, 31);
			txt[31] = 0;
			if (sscanf(txt, "%lf", &d) != 1) return -1;
			i += 32;
			break;
		}
		case T_ATOM: case T_ATOM_UTF8: case T_SMALL_ATOM: case T_SMALL_ATOM_UTF8:
			a = atom_size(p, left);
			if (a < 0 || (size_t)a > left) return -1;
			i += (size_t)a;
			break;
		case T_NIL:
			i += 1;
			break;
		case T_STRING:
			if (left < 3) return -1;
			n = 3 + (uint64_t)ap_get16be(p + 1);
			if (n > left) return -1;
			i += n;
			break;
		case T_BINARY:
			if (left < 5) return -1;
			n = 5 + (uint64_t)ap_get32be(p + 1);
			if (n > left) return -1;
			i += n;
			break;
		case T_BIT_BINARY:
			if (left < 6) return -1;
			n = 6 + (uint64_t)ap_get32be(p + 1);
			if (n > left || p[5] < 1 || p[5] > 8) return -1;
			i += n;
			break;
		case T_SMALL_BIG:
			if (left < 3) return -1;
			n = 3 + (uint64_t)p[1];
			if (n > left || p[2] > 1) return -1;
			i += n;
			break;
		case T_LARGE_BIG:
			if (left < 6) return -1;
			n = 6 + (uint64_t)ap_get32be(p + 1);
			if (n > left || p[5] > 1) return -1;
			i += n;
			break;
		case T_SMALL_TUPLE:
			if (left < 2) return -1;
			pending += p[1];
			i += 2;
			break;
		case T_LARGE_TUPLE:
			if (left < 5) return -1;
			pending += ap_get32be(p + 1);
			i += 5;
			break;
		case T_LIST:
			if (left < 5) return -1;
			pending += (uint64_t)ap_get32be(p + 1) + 1; /* elements and tail */
			i += 5;
			break;
		case T_MAP:
			if (left < 5) return -1;
			pending += 2 * (uint64_t)ap_get32be(p + 1);
			i += 5;
			break;
		case T_PID: case T_NEW_PID:
			a = atom_size(p + 1, left - 1);
			if (a < 0) return -1;
			n = 1 + (uint64_t)a + (p[0] == T_NEW_PID ? 12 : 9);
			if (n > left) return -1;
			i += n;
			break;
		case T_PORT: case T_NEW_PORT: case T_V4_PORT:
			a = atom_size(p + 1, left - 1);
			if (a < 0) return -1;
			n = 1 + (uint64_t)a + (p[0] == T_PORT ? 5 : p[0] == T_NEW_PORT ? 8 : 12);
			if (n > left) return -1;
			i += n;
			break;
		case T_REF:
			a = atom_size(p + 1, left - 1);
			if (a < 0) return -1;
			n = 1 + (uint64_t)a + 5;
			if (n > left) return -1;
			i += n;
			break;
		case T_NEW_REF: case T_NEWER_REF: {
			if (left < 3) return -1;
			uint16_t words = ap_get16be(p + 1);
			if (words < 1 || words > 5) return -1;
			a = atom_size(p + 3, left - 3);
			if (a < 0) return -1;
			n = 3 + (uint64_t)a + (p[0] == T_NEW_REF ? 1 : 4) + 4 * (uint64_t)words;
			if (n > left) return -1;
			i += n;
			break;
		}
		case T_EXPORT:
			pending += 3;
			i += 1;
			break;
		case T_NEW_FUN: {
			/* Tag, Size(4) Arity(1) Uniq(16) Index(4) NumFree(4), then
			 * Module, OldIndex, OldUniq, Pid and NumFree free variables:
			 * walked like any other terms. ei trusts Size to find the
			 * free variables, so Size must stay inside the buffer too. */
			if (left < 30) return -1;
			uint64_t size = ap_get32be(p + 1);
			if (size < 29 || 1 + size > left) return -1;
			pending += 4 + (uint64_t)ap_get32be(p + 26);
			i += 30;
			break;
		}
		default:
			/* Atom cache refs, LOCAL_EXT, compressed and unknown terms:
			 * none is negotiated with an ei node. Old FUN_EXT closures
			 * are refused: no OTP since R8 sends them. */
			return -1;
		}
		if (pending > before) {
			if (depth == AP_TERM_MAX_DEPTH)
				return -1;
			left_in[++depth] = pending - before;
		}
	}
	*idx = (int)i;
	return 0;
}

int ap_term_validate_msg(const char *buf, size_t len)
{
	int idx = 1;
	if (len < 2 || (uint8_t)buf[0] != 131)
		return -1;
	if (ap_term_skip(buf, len, &idx))
		return -1;
	return (size_t)idx == len ? 0 : -1;
}
