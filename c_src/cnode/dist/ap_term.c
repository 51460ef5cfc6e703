/* ap_term: iterative, bounded validation of external-term-format data.
 *
 * Over 700 lines on purpose: the walk and its strict check (ap_term_check)
 * are one translation unit, so that the check's parts inline into the walk
 * that calls them per term (apart, ap_term_check took a quarter longer:
 * every handler's reply is checked with it). The format's tags and fixed
 * sizes are ap_term_ext.h's. */
#include "ap_term.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ap_term_ext.h"

/* No fixed end: a container whose extent is the sum of its elements. */
#define NO_END SIZE_MAX

/* ---- the strict check's parts (ap_term.h) --------------------------------- */

/* What each open level of the walk is, for the strict check. */
enum { L_TOP, L_TUPLE, L_LIST, L_MAP, L_FUN };

/* A map key's canonical form, as a stream of 64-bit tokens (kind in the
 * top byte), hashed as it goes: equal keys give equal streams whatever
 * their encoding. Each term's stream ends where it must (a count or a
 * length comes before what it counts), so a key's and its value's cannot
 * run into each other. */
enum { TK_INT = 1, TK_BIG, TK_FLOAT, TK_ATOM, TK_NIL, TK_CONS, TK_TUPLE, TK_MAP, TK_BIN, TK_PID, TK_PORT, TK_REF,
       TK_EXPORT };
#define TOKEN(k, v) ((uint64_t)(k) << 56 | ((uint64_t)(v) & 0xffffffffffffffull))
#define KEY_SEED 0x243f6a8885a308d3ull

/* An open map: its key hashes are keys[kbase, kbase + n). A map inside a
 * key (hashed) has its own canonical form, made of its entries' hashes
 * summed, so that key order does not count. */
struct ap_term_map {
	uint32_t n, seen;  /* keys; elements begun */
	size_t kbase;
	int hashed;        /* its form goes into the key around it */
	int sinking;       /* the element being walked feeds h */
	uint64_t h, sum;   /* the current entry's running hash; the entries' */
};

/* A bijection of h for each w and of w for each h: streams that differ in
 * one token never meet. */
static inline uint64_t h_mix(uint64_t h, uint64_t w)
{
	h = (h << 27 | h >> 37) ^ w;
	return h * 0x9e3779b97f4a7c15ull;
}

/* murmur3's fmix64 */
static inline uint64_t h_fin(uint64_t h)
{
	h ^= h >> 33;
	h *= 0xff51afd7ed558ccdull;
	h ^= h >> 33;
	h *= 0xc4ceb9fe1a85ec53ull;
	return h ^ h >> 33;
}

static inline void emit(ap_term_strict *st, uint64_t w)
{
	if (st->cur)
		*st->cur = h_mix(*st->cur, w);
}

static void emit_bytes(ap_term_strict *st, const uint8_t *p, size_t n)
{
	if (!st->cur)
		return;
	uint64_t h = *st->cur, w;
	size_t i = 0;
	for (; i + 8 <= n; i += 8) {
		memcpy(&w, p + i, 8);
		h = h_mix(h, w);
	}
	if (i < n) {
		w = 0;
		memcpy(&w, p + i, n - i);
		h = h_mix(h, w);
	}
	*st->cur = h;
}

const char ap_term_why_atom[] = "an atom past the budget of new atoms";

static int refuse(ap_term_strict *st, const char *why)
{
	st->why = why;
	return -1;
}

/* Characters of the UTF-8 text s[0, n), or -1 where the BEAM's atom check
 * (erts_analyze_utf8) finds it no UTF-8: a stray continuation byte, an
 * overlong form, a surrogate, past U+10FFFF, a sequence cut short. */
static long utf8_chars(const uint8_t *s, size_t n)
{
	size_t i = 0;
	long chars = 0;
	while (i < n) {
		uint8_t c = s[i];
		if (c < 0x80) {
			i++;
		} else if (c < 0xc2) {
			return -1;
		} else if (c < 0xe0) {
			if (n - i < 2 || (s[i + 1] & 0xc0) != 0x80)
				return -1;
			i += 2;
		} else if (c < 0xf0) {
			if (n - i < 3 || (s[i + 1] & 0xc0) != 0x80 || (s[i + 2] & 0xc0) != 0x80 ||
			    (c == 0xe0 && s[i + 1] < 0xa0) || (c == 0xed && s[i + 1] >= 0xa0))
				return -1;
			i += 3;
		} else if (c < 0xf5) {
			if (n - i < 4 || (s[i + 1] & 0xc0) != 0x80 || (s[i + 2] & 0xc0) != 0x80 ||
			    (s[i + 3] & 0xc0) != 0x80 || (c == 0xf0 && s[i + 1] < 0x90) || (c == 0xf4 && s[i + 1] >= 0x90))
				return -1;
			i += 4;
		} else {
			return -1;
		}
		chars++;
	}
	return chars;
}

/* The atom at p (which atom_size took) as the BEAM takes it: *name its
 * text as UTF-8 (a Latin-1 one converted into buf, 510 bytes), handed to
 * st->atom and to the key being hashed. 0, or -1. */
static int s_atom(ap_term_strict *st, const uint8_t *p, uint8_t *buf, const uint8_t **name, size_t *nlen)
{
	int wide = p[0] == T_ATOM || p[0] == T_ATOM_UTF8;
	size_t n = wide ? ap_get16be(p + 1) : p[1];
	const uint8_t *s = p + (wide ? 3 : 2);
	if (p[0] == T_ATOM_UTF8 || p[0] == T_SMALL_ATOM_UTF8) {
		long c = utf8_chars(s, n);
		if (c < 0)
			return refuse(st, "an atom that is not valid UTF-8");
		if (c > 255)
			return refuse(st, "an atom of over 255 characters");
		*name = s;
		*nlen = n;
	} else {
		/* atom_size took at most 255 bytes */
		size_t o = 0;
		for (size_t k = 0; k < n; k++) {
			if (s[k] < 0x80) {
				buf[o++] = s[k];
			} else {
				buf[o++] = (uint8_t)(0xc0 | s[k] >> 6);
				buf[o++] = (uint8_t)(0x80 | (s[k] & 0x3f));
			}
		}
		*name = buf;
		*nlen = o;
	}
	if (st->atom && st->atom(st->arg, *name, *nlen))
		return refuse(st, ap_term_why_atom);
	emit(st, TOKEN(TK_ATOM, *nlen));
	emit_bytes(st, *name, *nlen);
	return 0;
}

/* Whether the node atom checked into name/nlen is the receiving node. */
static int is_self(const ap_term_strict *st, const uint8_t *name, size_t nlen)
{
	return st->self_node && nlen == st->self_node_len && !memcmp(name, st->self_node, nlen);
}

/* An integer: its sign and magnitude (little-endian bytes, leading zeros
 * dropped), one form for every encoding of a value. */
static void s_int(ap_term_strict *st, int neg, const uint8_t *le, size_t n, uint64_t small)
{
	if (!st->cur)
		return;
	if (le) {
		while (n > 0 && le[n - 1] == 0)
			n--;
		if (n > 8) {
			emit(st, TOKEN(TK_BIG, neg));
			emit(st, n);
			emit_bytes(st, le, n);
			return;
		}
		small = 0;
		for (size_t k = n; k > 0; k--)
			small = small << 8 | le[k - 1];
	}
	emit(st, TOKEN(TK_INT, small ? neg : 0));
	emit(st, small);
}

/* PID_EXT or NEW_PID_EXT at p (pid_size took it). */
static int s_pid(ap_term_strict *st, const uint8_t *p)
{
	uint8_t buf[510];
	const uint8_t *name;
	size_t nlen;
	long a = atom_size(p + 1, SIZE_MAX);
	emit(st, TOKEN(TK_PID, 0));
	if (s_atom(st, p + 1, buf, &name, &nlen))
		return -1;
	const uint8_t *q = p + 1 + a;
	uint32_t num = ap_get32be(q), ser = ap_get32be(q + 4);
	if (p[0] == T_PID && q[8] > 3)
		return refuse(st, "a creation over 3 in an old pid, port or reference");
	if (is_self(st, name, nlen) && (num > 0x7fff || ser > 0x1fff))
		return refuse(st, "a pid of the receiving node with its number past 15 bits or serial past 13");
	emit(st, num);
	emit(st, ser);
	emit(st, p[0] == T_PID ? q[8] : ap_get32be(q + 8));
	return 0;
}

static int s_port(ap_term_strict *st, const uint8_t *p)
{
	uint8_t buf[510];
	const uint8_t *name;
	size_t nlen;
	long a = atom_size(p + 1, SIZE_MAX);
	emit(st, TOKEN(TK_PORT, 0));
	if (s_atom(st, p + 1, buf, &name, &nlen))
		return -1;
	const uint8_t *q = p + 1 + a;
	uint64_t num = p[0] == T_V4_PORT ? (uint64_t)ap_get32be(q) << 32 | ap_get32be(q + 4) : ap_get32be(q);
	if (p[0] == T_PORT && q[4] > 3)
		return refuse(st, "a creation over 3 in an old pid, port or reference");
	if (is_self(st, name, nlen) && num > 0xfffffff)
		return refuse(st, "a port of the receiving node with its number past 28 bits");
	emit(st, num);
	emit(st, p[0] == T_PORT ? q[4] : ap_get32be(q + (p[0] == T_V4_PORT ? 8 : 4)));
	return 0;
}

/* REFERENCE_EXT, NEW_REFERENCE_EXT or NEWER_REFERENCE_EXT at p. */
static int s_ref(ap_term_strict *st, const uint8_t *p)
{
	uint8_t buf[510];
	const uint8_t *name;
	size_t nlen;
	const uint8_t *at = p + (p[0] == T_REF ? 1 : 3);
	size_t words = p[0] == T_REF ? 1 : ap_get16be(p + 1);
	long a = atom_size(at, SIZE_MAX);
	emit(st, TOKEN(TK_REF, 0));
	if (s_atom(st, at, buf, &name, &nlen))
		return -1;
	const uint8_t *q = at + a;
	const uint8_t *id = q + (p[0] == T_NEWER_REF ? 4 : p[0] == T_REF ? 0 : 1);
	uint32_t w0 = ap_get32be(id);
	if (p[0] == T_REF) {
		if (q[4] > 3)
			return refuse(st, "a creation over 3 in an old pid, port or reference");
	} else if (p[0] == T_NEW_REF && q[0] > 3) {
		return refuse(st, "a creation over 3 in an old pid, port or reference");
	}
	if (p[0] != T_NEWER_REF && w0 > 0x3ffff)
		return refuse(st, "an old reference with its first word past 18 bits");
	if (is_self(st, name, nlen) && (words > 3 || w0 > 0x3ffff))
		return refuse(st, "a reference of the receiving node of over 3 words or its first past 18 bits");
	emit(st, p[0] == T_NEWER_REF ? ap_get32be(q) : q[p[0] == T_REF ? 4 : 0]);
	/* Trailing zero words do not tell two references apart. */
	while (words > 0 && ap_get32be(id + 4 * (words - 1)) == 0)
		words--;
	emit(st, words);
	for (size_t k = 0; k < words; k++)
		emit(st, ap_get32be(id + 4 * k));
	return 0;
}

static int s_export(ap_term_strict *st, const uint8_t *p)
{
	uint8_t buf[510];
	const uint8_t *name;
	size_t nlen;
	long a = atom_size(p + 1, SIZE_MAX);
	emit(st, TOKEN(TK_EXPORT, 0));
	if (s_atom(st, p + 1, buf, &name, &nlen))
		return -1;
	long b = atom_size(p + 1 + a, SIZE_MAX);
	if (s_atom(st, p + 1 + a, buf, &name, &nlen))
		return -1;
	emit(st, p[1 + a + b + 1]); /* the arity, a SMALL_INTEGER_EXT (int_size) */
	return 0;
}

static void set_cur(ap_term_strict *st)
{
	struct ap_term_map *m = st->nmaps ? &st->maps[st->nmaps - 1] : NULL;
	st->cur = m && m->sinking ? &m->h : NULL;
}

/* A map of n keys opens (its level is the walk's newest). */
static int map_open(ap_term_strict *st, uint32_t n)
{
	if (st->nmaps == st->maps_cap) {
		size_t cap = st->maps_cap ? 2 * st->maps_cap : 8;
		struct ap_term_map *m = realloc(st->maps, cap * sizeof *m);
		if (!m)
			return refuse(st, "out of memory");
		st->maps = m;
		st->maps_cap = cap;
	}
	if (st->keys_used + n > st->keys_cap) {
		size_t cap = st->keys_cap ? st->keys_cap : 64;
		while (cap < st->keys_used + n)
			cap *= 2;
		uint64_t *k = realloc(st->keys, cap * sizeof *k);
		if (!k)
			return refuse(st, "out of memory");
		st->keys = k;
		st->keys_cap = cap;
	}
	struct ap_term_map *m = &st->maps[st->nmaps++];
	m->n = n;
	m->seen = 0;
	m->kbase = st->keys_used;
	st->keys_used += n;
	m->hashed = st->cur != NULL;
	m->sinking = 0;
	m->h = 0;
	m->sum = 0;
	st->cur = NULL;
	return 0;
}

/* The next element of the innermost map begins: the one before it ended. */
static void map_next(ap_term_strict *st)
{
	struct ap_term_map *m = &st->maps[st->nmaps - 1];
	uint32_t k = m->seen++;
	if (k > 0) {
		if ((k - 1) % 2 == 0) {
			st->keys[m->kbase + (k - 1) / 2] = h_fin(m->h);
			m->sinking = m->hashed;
		} else if (m->hashed) {
			m->sum += h_fin(m->h);
		}
	}
	if (k % 2 == 0) {
		m->h = KEY_SEED;
		m->sinking = 1;
	}
	set_cur(st);
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

/* The innermost map closes: its keys must differ. */
static int map_close(ap_term_strict *st)
{
	struct ap_term_map *m = &st->maps[st->nmaps - 1];
	uint64_t *k = st->keys + m->kbase;
	if (m->hashed)
		m->sum += h_fin(m->h);
	qsort(k, m->n, sizeof *k, cmp_u64);
	for (uint32_t j = 1; j < m->n; j++)
		if (k[j] == k[j - 1])
			return refuse(st, "a map with a duplicate key");
	st->keys_used = m->kbase;
	uint32_t n = m->n;
	uint64_t sum = m->sum;
	int hashed = m->hashed;
	st->nmaps--;
	set_cur(st);
	if (hashed) {
		emit(st, TOKEN(TK_MAP, n));
		emit(st, sum);
	}
	return 0;
}

/* One element of the container at level d begins (left: elements after it). */
static inline void s_element(ap_term_strict *st, int d, uint64_t left)
{
	if (st->kind[d] == L_LIST && left > 0)
		emit(st, TOKEN(TK_CONS, 0)); /* not the tail */
	else if (st->kind[d] == L_MAP)
		map_next(st);
}

/* The strict checks of the term at p, which the walk found well formed
 * (all its fixed fields inside the buffer). */
static int s_term(ap_term_strict *st, const uint8_t *p)
{
	uint64_t n;
	switch (p[0]) {
	case T_SMALL_INT:
		s_int(st, 0, NULL, 0, p[1]);
		return 0;
	case T_INT: {
		int32_t v = (int32_t)ap_get32be(p + 1);
		s_int(st, v < 0, NULL, 0, v < 0 ? (uint64_t)0 - (uint64_t)(int64_t)v : (uint64_t)v);
		return 0;
	}
	case T_SMALL_BIG:
		s_int(st, p[2] != 0, p + 3, p[1], 0);
		return 0;
	case T_LARGE_BIG:
		n = ap_get32be(p + 1);
		if (n > 524287 * 8)
			return refuse(st, "an integer of over 4194296 bytes");
		s_int(st, p[5] != 0, p + 6, n, 0);
		return 0;
	case T_NEW_FLOAT: {
		uint64_t bits = (uint64_t)ap_get32be(p + 1) << 32 | ap_get32be(p + 5);
		if ((bits >> 52 & 0x7ff) == 0x7ff)
			return refuse(st, "a NaN or infinite float");
		emit(st, TOKEN(TK_FLOAT, 0));
		emit(st, bits == 1ull << 63 ? 0 : bits); /* -0.0 =:= 0.0 on OTP 25 */
		return 0;
	}
	case T_ATOM: case T_ATOM_UTF8: case T_SMALL_ATOM: case T_SMALL_ATOM_UTF8: {
		uint8_t buf[510];
		const uint8_t *name;
		size_t nlen;
		return s_atom(st, p, buf, &name, &nlen);
	}
	case T_NIL:
		emit(st, TOKEN(TK_NIL, 0));
		return 0;
	case T_STRING:
		n = ap_get16be(p + 1);
		if (st->cur) {
			for (uint64_t k = 0; k < n; k++) {
				emit(st, TOKEN(TK_CONS, 0));
				s_int(st, 0, NULL, 0, p[3 + k]);
			}
			emit(st, TOKEN(TK_NIL, 0));
		}
		return 0;
	case T_BINARY:
		n = ap_get32be(p + 1);
		emit(st, TOKEN(TK_BIN, 0));
		emit(st, 8 * n);
		emit_bytes(st, p + 5, n);
		return 0;
	case T_BIT_BINARY: {
		/* Only the last byte's first `bits' count: 8 is a binary. */
		n = ap_get32be(p + 1);
		uint8_t bits = p[5];
		emit(st, TOKEN(TK_BIN, 0));
		emit(st, n ? 8 * (n - 1) + bits : 0);
		if (n == 0 || bits == 8) {
			emit_bytes(st, p + 6, n);
		} else {
			emit_bytes(st, p + 6, n - 1);
			emit(st, p[6 + n - 1] & (0xff00u >> bits));
		}
		return 0;
	}
	case T_SMALL_TUPLE:
		emit(st, TOKEN(TK_TUPLE, p[1]));
		return 0;
	case T_LARGE_TUPLE:
		emit(st, TOKEN(TK_TUPLE, ap_get32be(p + 1)));
		return 0;
	case T_LIST:
		return 0; /* its elements say CONS, its tail ends it */
	case T_MAP:
		if (ap_get32be(p + 1) == 0) {
			emit(st, TOKEN(TK_MAP, 0));
			emit(st, 0);
		}
		return 0; /* else the walk opens it (map_open) */
	case T_PID: case T_NEW_PID:
		return s_pid(st, p);
	case T_PORT: case T_NEW_PORT: case T_V4_PORT:
		return s_port(st, p);
	case T_REF: case T_NEW_REF: case T_NEWER_REF:
		return s_ref(st, p);
	case T_EXPORT:
		return s_export(st, p);
	case T_NEW_FUN:
		return refuse(st, "a fun");
	}
	return refuse(st, "malformed");
}

/* The walk (ap_term_skip), with the strict check when st is set: inlined
 * into each entry point, so that the inbound walk carries none of it. */
static inline __attribute__((always_inline)) int skip(const char *cbuf, size_t len, int *idx, uint64_t *max_map,
						      ap_term_strict *st);

int ap_term_skip(const char *cbuf, size_t len, int *idx)
{
	return skip(cbuf, len, idx, NULL, NULL);
}

int ap_term_scan(const char *cbuf, size_t len, int *idx, uint64_t *max_map)
{
	*max_map = 0;
	return skip(cbuf, len, idx, max_map, NULL);
}

int ap_term_check(const char *cbuf, size_t len, int *idx, ap_term_strict *st)
{
	st->why = NULL;
	st->nmaps = 0;
	st->keys_used = 0;
	st->cur = NULL;
	st->kind[0] = L_TOP;
	if (skip(cbuf, len, idx, NULL, st)) {
		if (!st->why)
			st->why = "malformed";
		return -1;
	}
	return 0;
}

void ap_term_strict_free(ap_term_strict *st)
{
	free(st->keys);
	free(st->maps);
	st->keys = NULL;
	st->maps = NULL;
	st->keys_cap = st->maps_cap = 0;
}

static inline __attribute__((always_inline)) int skip(const char *cbuf, size_t len, int *idx, uint64_t *max_map,
						      ap_term_strict *st)
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
			if (st && st->kind[depth] == L_MAP && map_close(st))
				return -1;
			depth--;
		}
		left_in[depth]--;
		if (st)
			s_element(st, depth, left_in[depth]);
		uint64_t before = pending;
		size_t end = NO_END;
		const uint8_t *p = buf + i;
		size_t left = len - i;
		uint64_t n;
		long a;
		uint8_t opens = L_TUPLE;

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
			opens = L_LIST;
			i += 5;
			break;
		case T_MAP:
			if (left < 5) return -1;
			pending += 2 * (uint64_t)ap_get32be(p + 1);
			opens = L_MAP;
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
			opens = L_FUN;
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
		if (st && s_term(st, p))
			return -1;
		if (pending > before) {
			if (depth == AP_TERM_MAX_DEPTH)
				return -1;
			depth++;
			left_in[depth] = pending - before;
			end_at[depth] = end;
			if (st) {
				/* Checked now, not at the next term: map_open
				 * takes room for the keys it claims. */
				if (pending > len - i)
					return -1;
				st->kind[depth] = opens;
				if (opens == L_MAP && map_open(st, (uint32_t)((pending - before) / 2)))
					return -1;
			}
		}
	}
	/* The containers still open all ended with the last term. */
	for (; depth > 0; depth--) {
		if (end_at[depth] != NO_END && end_at[depth] != i)
			return -1;
		if (st && st->kind[depth] == L_MAP && map_close(st))
			return -1;
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
