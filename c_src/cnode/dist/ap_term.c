/* ap_term: iterative, bounded validation of external-term-format data. */
#include "ap_term.h"

#include <stdint.h>
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

/* ei decodes atoms into MAXATOMLEN_UTF8 (1021) byte buffers, and atoms that
 * name a module or node as UTF-8, converting a Latin-1 one (each byte above
 * 127 doubles). The BEAM caps atoms at 255 characters, so these limits refuse
 * nothing it sends and keep every atom inside what ei reads in every place. */
#define LATIN1_ATOM_MAX 255
#define UTF8_ATOM_MAX (4 * 255)

/* Bytes of the atom at p (tag included), or -1. */
static long atom_size(const uint8_t *p, size_t left)
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
static long pid_size(const uint8_t *p, size_t left)
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
static long int_size(const uint8_t *p, size_t left, int wide)
{
	if (left >= 2 && p[0] == T_SMALL_INT)
		return 2;
	if (wide && left >= 5 && p[0] == T_INT)
		return 5;
	return -1;
}

/* A fun's fixed fields after its 30-byte header, as ei_decode_fun reads them:
 * Module (atom), OldIndex and OldUniq (integers), Pid. Bytes, or -1. */
static long fun_fields_size(const uint8_t *p, size_t left)
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
static long export_size(const uint8_t *p, size_t left)
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

/* No fixed end: a container whose extent is the sum of its elements. */
#define NO_END SIZE_MAX

static int skip(const char *cbuf, size_t len, int *idx, uint64_t *max_map);

int ap_term_skip(const char *cbuf, size_t len, int *idx)
{
	return skip(cbuf, len, idx, NULL);
}

int ap_term_scan(const char *cbuf, size_t len, int *idx, uint64_t *max_map)
{
	*max_map = 0;
	return skip(cbuf, len, idx, max_map);
}

static int skip(const char *cbuf, size_t len, int *idx, uint64_t *max_map)
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
	 * once per level, so the nesting depth must be bounded as well. A fun's
	 * free variables are a level that must end exactly where the fun's Size
	 * says: ei skips them by Size, and a walk that ends anywhere else would
	 * leave ei and every consumer in bytes this walk never vouched for. */
	uint64_t left_in[AP_TERM_MAX_DEPTH + 1];
	size_t end_at[AP_TERM_MAX_DEPTH + 1];
	int depth = 0;
	left_in[0] = 1;
	end_at[0] = NO_END;

	while (pending > 0) {
		if (pending > len - i)
			return -1;
		pending--;
		while (left_in[depth] == 0) {
			/* pending > 0: some open container has elements left */
			if (end_at[depth] != NO_END && end_at[depth] != i)
				return -1;
			depth--;
		}
		left_in[depth]--;
		uint64_t before = pending;
		size_t end = NO_END;
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
		case T_ATOM: case T_ATOM_UTF8: case T_SMALL_ATOM: case T_SMALL_ATOM_UTF8:
			if ((a = atom_size(p, left)) < 0) return -1;
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
			/* ei: an empty one has 0 bits in its last byte, any other
			 * 1 to 8. */
			if (left < 6) return -1;
			n = 6 + (uint64_t)ap_get32be(p + 1);
			if (n > left) return -1;
			if (n == 6 ? p[5] != 0 : (p[5] < 1 || p[5] > 8)) return -1;
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
			if (max_map && ap_get32be(p + 1) > *max_map)
				*max_map = ap_get32be(p + 1);
			i += 5;
			break;
		case T_PID: case T_NEW_PID:
			if ((a = pid_size(p, left)) < 0) return -1;
			i += (size_t)a;
			break;
		case T_PORT: case T_NEW_PORT: case T_V4_PORT:
			if ((a = atom_size(p + 1, left - 1)) < 0) return -1;
			n = 1 + (uint64_t)a + (p[0] == T_PORT ? 5 : p[0] == T_NEW_PORT ? 8 : 12);
			if (n > left) return -1;
			i += n;
			break;
		case T_REF:
			if ((a = atom_size(p + 1, left - 1)) < 0) return -1;
			n = 1 + (uint64_t)a + 5;
			if (n > left) return -1;
			i += n;
			break;
		case T_NEW_REF: case T_NEWER_REF: {
			if (left < 3) return -1;
			uint16_t words = ap_get16be(p + 1);
			if (words < 1 || words > 5) return -1;
			if ((a = atom_size(p + 3, left - 3)) < 0) return -1;
			n = 3 + (uint64_t)a + (p[0] == T_NEW_REF ? 1 : 4) + 4 * (uint64_t)words;
			if (n > left) return -1;
			i += n;
			break;
		}
		case T_EXPORT:
			if ((a = export_size(p + 1, left - 1)) < 0) return -1;
			i += 1 + (size_t)a;
			break;
		case T_NEW_FUN: {
			/* Tag, Size(4) Arity(1) Uniq(16) Index(4) NumFree(4), the
			 * fixed fields, then NumFree free variables. ei reads the
			 * fixed fields and then skips to 1 + Size without looking:
			 * the fields are checked here as ei reads them, and the
			 * free variables (walked as a container) must end exactly
			 * there. */
			if (left < 30) return -1;
			uint64_t size = ap_get32be(p + 1);
			uint64_t nfree = ap_get32be(p + 26);
			if (size < 29 || 1 + size > left) return -1;
			if ((a = fun_fields_size(p + 30, (size_t)size - 29)) < 0)
				return -1;
			end = i + 1 + (size_t)size;
			i += 30 + (size_t)a;
			if (nfree == 0) {
				if (i != end) return -1;
				end = NO_END;
			} else {
				pending += nfree;
			}
			break;
		}
		default:
			/* Atom cache refs, LOCAL_EXT, compressed and unknown terms:
			 * none is negotiated with an ei node. Old FUN_EXT closures
			 * are refused: no OTP since R8 sends them; so are FLOAT_EXT
			 * text floats (NEW_FLOATS is always negotiated), which ei
			 * reads with sscanf, not bounded by the 31 bytes. */
			return -1;
		}
		if (pending > before) {
			if (depth == AP_TERM_MAX_DEPTH)
				return -1;
			depth++;
			left_in[depth] = pending - before;
			end_at[depth] = end;
		}
	}
	/* The containers still open all ended with the last term. */
	for (; depth > 0; depth--)
		if (end_at[depth] != NO_END && end_at[depth] != i)
			return -1;
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
