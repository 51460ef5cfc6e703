/* handlers: the built-in echo and json_validate handlers, and .so plugin loading. */
#include "handlers.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ei.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* A reply that cannot be allocated is reported as a crash: an {error, ...}
 * without its reason would be a wrong answer, and the replacement worker
 * starts with a fresh reply buffer. */
static actor_pool_status reply_atom(actor_pool_reply *r, const char *atom, actor_pool_status st)
{
	if (actor_pool_reply_set(r, AP_REPLY_ATOM, atom, strlen(atom)))
		return AP_HANDLER_CRASH;
	return st;
}

/* ---- echo ------------------------------------------------------------------ */

static actor_pool_status echo_handle(void *state, const actor_pool_request *req, actor_pool_reply *reply)
{
	(void)state;
	if (!req->is_ask)
		return AP_HANDLER_OK;
	/* A term request already starts with 131, which AP_REPLY_TERM accepts:
	 * the asker gets back exactly the term it sent. */
	if (actor_pool_reply_set(reply, req->is_binary ? AP_REPLY_BINARY : AP_REPLY_TERM, req->data, req->len))
		return AP_HANDLER_CRASH;
	return AP_HANDLER_OK;
}

static const actor_pool_handler echo_handler = {
	.abi_version = ACTOR_POOL_HANDLER_ABI,
	.name = "echo",
	.handle = echo_handle,
};

/* ---- json_validate ---------------------------------------------------------- */

static const char *const json_reason_names[] = {
	[AP_JSON_OK] = "ok",
	[AP_JSON_UNEXPECTED_BYTE] = "unexpected_byte",
	[AP_JSON_UNEXPECTED_END] = "unexpected_end",
	[AP_JSON_INVALID_ESCAPE] = "invalid_escape",
	[AP_JSON_INVALID_UTF8] = "invalid_utf8",
	[AP_JSON_INVALID_NUMBER] = "invalid_number",
	[AP_JSON_TRAILING_DATA] = "trailing_data",
	[AP_JSON_TOO_DEEP] = "too_deep",
	[AP_JSON_INVALID_LITERAL] = "invalid_literal",
	[AP_JSON_CONTROL_CHAR_IN_STRING] = "control_char_in_string",
	[AP_JSON_LONE_SURROGATE] = "lone_surrogate",
};

const char *ap_json_reason_name(enum ap_json_result r)
{
	if ((unsigned)r >= sizeof json_reason_names / sizeof json_reason_names[0])
		return "unknown";
	return json_reason_names[r];
}

/* Bytes a string may hold as they are: everything from 0x20 to 0x7f but '"'
 * and '\'. The rest stops the scan: the end quote, an escape, a control
 * character (an error) or the first byte of a UTF-8 sequence. */
static const uint8_t str_plain[256] = {
	[0x20 ... '"' - 1] = 1,
	['"' + 1 ... '\\' - 1] = 1,
	['\\' + 1 ... 0x7f] = 1,
};

static inline int is_ws(uint8_t c)
{
	/* ' ', '\t', '\n', '\r': one compare and one bit test instead of four
	 * compares. 64 bits, as c may be 32. */
	return c <= ' ' && ((1ull << c) & (1ull << ' ' | 1ull << '\t' | 1ull << '\n' | 1ull << '\r'));
}

static inline size_t skip_ws(const uint8_t *p, size_t n, size_t i)
{
	while (i < n && is_ws(p[i]))
		i++;
	return i;
}

static inline int is_digit(uint8_t c)
{
	return (uint8_t)(c - '0') < 10;
}

static inline int hex_val(uint8_t c)
{
	if (is_digit(c))
		return c - '0';
	c |= 0x20;
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	return -1;
}

/* The four hex digits at p[i..i+4) as a code unit, or -1 with *bad at the
 * first byte that is not one (n when the input ends first). */
static inline int hex4(const uint8_t *p, size_t n, size_t i, size_t *bad)
{
	int v = 0;
	for (size_t k = 0; k < 4; k++) {
		if (i + k >= n) {
			*bad = n;
			return -1;
		}
		int h = hex_val(p[i + k]);
		if (h < 0) {
			*bad = i + k;
			return -1;
		}
		v = v << 4 | h;
	}
	return v;
}

/* Length of the well-formed UTF-8 sequence led by p[i] (>= 0x80), or 0.
 * Table 3-7 of the Unicode standard: the second byte's range depends on the
 * lead, which is what rules out overlongs (C0, C1, E0 80..9F, F0 80..8F),
 * encoded surrogates (ED A0..BF) and code points above U+10FFFF (F4 90..,
 * F5..FF). */
static inline size_t utf8_seq(const uint8_t *p, size_t n, size_t i)
{
	uint8_t c = p[i];
	size_t avail = n - i;
	uint8_t lo = 0x80, hi = 0xbf;

	if (c < 0xc2)
		return 0;
	if (c < 0xe0) {
		if (avail < 2 || (p[i + 1] & 0xc0) != 0x80)
			return 0;
		return 2;
	}
	if (c < 0xf0) {
		if (c == 0xe0)
			lo = 0xa0;
		else if (c == 0xed)
			hi = 0x9f;
		if (avail < 3 || p[i + 1] < lo || p[i + 1] > hi || (p[i + 2] & 0xc0) != 0x80)
			return 0;
		return 3;
	}
	if (c < 0xf5) {
		if (c == 0xf0)
			lo = 0x90;
		else if (c == 0xf4)
			hi = 0x8f;
		if (avail < 4 || p[i + 1] < lo || p[i + 1] > hi || (p[i + 2] & 0xc0) != 0x80 ||
		    (p[i + 3] & 0xc0) != 0x80)
			return 0;
		return 4;
	}
	return 0;
}

/* The escape whose '\' is at p[*ip]. Advances *ip past it (past both halves
 * of a surrogate pair), or returns the reason with *ip at the offset. */
static enum ap_json_result scan_escape(const uint8_t *p, size_t n, size_t *ip)
{
	size_t start = *ip, i = start + 1, bad = n;
	int cu, lo;

	if (i >= n) {
		*ip = n;
		return AP_JSON_INVALID_ESCAPE;
	}
	switch (p[i]) {
	case '"': case '\\': case '/': case 'b': case 'f': case 'n': case 'r': case 't':
		*ip = i + 1;
		return AP_JSON_OK;
	case 'u':
		break;
	default:
		*ip = i;
		return AP_JSON_INVALID_ESCAPE;
	}
	cu = hex4(p, n, i + 1, &bad);
	if (cu < 0) {
		*ip = bad;
		return AP_JSON_INVALID_ESCAPE;
	}
	i += 5;
	if (cu < 0xd800 || cu > 0xdfff) {
		*ip = i;
		return AP_JSON_OK;
	}
	if (cu >= 0xdc00) {
		*ip = start;
		return AP_JSON_LONE_SURROGATE;
	}
	/* A high half: only a \u escape holding a low half may follow. The end
	 * of input here is a cut document, not a lone half. */
	if (i >= n) {
		*ip = n;
		return AP_JSON_UNEXPECTED_END;
	}
	if (p[i] != '\\') {
		*ip = start;
		return AP_JSON_LONE_SURROGATE;
	}
	if (i + 1 >= n) {
		*ip = n;
		return AP_JSON_INVALID_ESCAPE;
	}
	if (p[i + 1] != 'u') {
		*ip = start;
		return AP_JSON_LONE_SURROGATE;
	}
	/* A malformed second escape is reported as such: whether the first
	 * half was lone cannot be known. */
	lo = hex4(p, n, i + 2, &bad);
	if (lo < 0) {
		*ip = bad;
		return AP_JSON_INVALID_ESCAPE;
	}
	if (lo < 0xdc00 || lo > 0xdfff) {
		*ip = start;
		return AP_JSON_LONE_SURROGATE;
	}
	*ip = i + 6;
	return AP_JSON_OK;
}

/* The string whose opening quote is just before p[*ip]. Advances *ip past
 * the closing quote, or returns the reason with *ip at the offset. */
static enum ap_json_result scan_string(const uint8_t *p, size_t n, size_t *ip)
{
	size_t i = *ip;
	enum ap_json_result r;

	for (;;) {
#if defined(__SSE2__)
		/* 16 plain bytes at a time. A signed compare with 0x20 flags both
		 * the control characters and every byte >= 0x80 (negative). */
		const __m128i quote = _mm_set1_epi8('"'), bslash = _mm_set1_epi8('\\');
		const __m128i space = _mm_set1_epi8(0x20);
		while (n - i >= 16) {
			__m128i v = _mm_loadu_si128((const __m128i *)(const void *)(p + i));
			__m128i stop = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, quote), _mm_cmpeq_epi8(v, bslash)),
						    _mm_cmplt_epi8(v, space));
			unsigned m = (unsigned)_mm_movemask_epi8(stop);
			if (m) {
				i += (size_t)__builtin_ctz(m);
				goto special;
			}
			i += 16;
		}
#endif
		while (i < n && str_plain[p[i]])
			i++;
#if defined(__SSE2__)
special:
#endif
		if (i >= n) {
			*ip = n;
			return AP_JSON_UNEXPECTED_END;
		}
		uint8_t c = p[i];
		if (c == '"') {
			*ip = i + 1;
			return AP_JSON_OK;
		}
		if (c == '\\') {
			r = scan_escape(p, n, &i);
			if (r) {
				*ip = i;
				return r;
			}
		} else if (c < 0x20) {
			*ip = i;
			return AP_JSON_CONTROL_CHAR_IN_STRING;
		} else {
			size_t k = utf8_seq(p, n, i);
			if (!k) {
				*ip = i;
				return AP_JSON_INVALID_UTF8;
			}
			i += k;
		}
	}
}

/* -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)? starting at p[*ip] ('-' or
 * a digit). The number ends at the first byte that cannot continue it;
 * whatever that is, the caller judges it. */
static enum ap_json_result scan_number(const uint8_t *p, size_t n, size_t *ip)
{
	size_t i = *ip;

	if (p[i] == '-')
		i++;
	if (i >= n || !is_digit(p[i]))
		goto bad;
	if (p[i] == '0') {
		i++;
		/* "01" is not a 0 followed by trailing data: it is a number
		 * written wrong. */
		if (i < n && is_digit(p[i]))
			goto bad;
	} else {
		while (i < n && is_digit(p[i]))
			i++;
	}
	if (i < n && p[i] == '.') {
		i++;
		if (i >= n || !is_digit(p[i]))
			goto bad;
		while (i < n && is_digit(p[i]))
			i++;
	}
	if (i < n && (p[i] | 0x20) == 'e') {
		i++;
		if (i < n && (p[i] == '+' || p[i] == '-'))
			i++;
		if (i >= n || !is_digit(p[i]))
			goto bad;
		while (i < n && is_digit(p[i]))
			i++;
	}
	*ip = i;
	return AP_JSON_OK;
bad:
	*ip = i < n ? i : n;
	return AP_JSON_INVALID_NUMBER;
}

/* The literal `lit` (length len) whose first byte matched at p[*ip]. */
static inline enum ap_json_result scan_literal(const uint8_t *p, size_t n, size_t *ip, const char *lit, size_t len)
{
	size_t i = *ip;
	for (size_t k = 1; k < len; k++) {
		if (i + k >= n) {
			*ip = n;
			return AP_JSON_INVALID_LITERAL;
		}
		if (p[i + k] != (uint8_t)lit[k]) {
			*ip = i + k;
			return AP_JSON_INVALID_LITERAL;
		}
	}
	*ip = i + len;
	return AP_JSON_OK;
}

/* One pass, a goto state machine instead of recursion: the only memory is
 * one bit per open bracket (set: object) on this stack frame, so a hostile
 * document can neither exhaust the stack nor make us allocate. */
enum ap_json_result ap_json_validate(const uint8_t *p, size_t n, size_t *err_off)
{
	uint64_t is_obj[AP_JSON_MAX_DEPTH / 64] = { 0 };
	unsigned depth = 0;
	size_t i = 0;
	enum ap_json_result r;

value:
	i = skip_ws(p, n, i);
	if (i >= n) {
		r = AP_JSON_UNEXPECTED_END;
		goto fail;
	}
value_here: /* p[i] is the first byte of a value */
	switch (p[i]) {
	case '{':
		if (depth == AP_JSON_MAX_DEPTH) {
			r = AP_JSON_TOO_DEEP;
			goto fail;
		}
		is_obj[depth >> 6] |= 1ull << (depth & 63);
		depth++;
		i = skip_ws(p, n, i + 1);
		if (i >= n) {
			r = AP_JSON_UNEXPECTED_END;
			goto fail;
		}
		if (p[i] == '}') {
			i++;
			depth--;
			goto after_value;
		}
		if (p[i] != '"') {
			r = AP_JSON_UNEXPECTED_BYTE;
			goto fail;
		}
		goto key;
	case '[':
		if (depth == AP_JSON_MAX_DEPTH) {
			r = AP_JSON_TOO_DEEP;
			goto fail;
		}
		is_obj[depth >> 6] &= ~(1ull << (depth & 63));
		depth++;
		i = skip_ws(p, n, i + 1);
		if (i >= n) {
			r = AP_JSON_UNEXPECTED_END;
			goto fail;
		}
		if (p[i] == ']') {
			i++;
			depth--;
			goto after_value;
		}
		goto value_here;
	case '"':
		i++;
		r = scan_string(p, n, &i);
		break;
	case '-':
	case '0' ... '9':
		r = scan_number(p, n, &i);
		break;
	case 't':
		r = scan_literal(p, n, &i, "true", 4);
		break;
	case 'f':
		r = scan_literal(p, n, &i, "false", 5);
		break;
	case 'n':
		r = scan_literal(p, n, &i, "null", 4);
		break;
	default:
		r = AP_JSON_UNEXPECTED_BYTE;
		goto fail;
	}
	if (r)
		goto fail;

after_value:
	i = skip_ws(p, n, i);
	if (depth == 0) {
		if (i < n) {
			r = AP_JSON_TRAILING_DATA;
			goto fail;
		}
		return AP_JSON_OK;
	}
	if (i >= n) {
		r = AP_JSON_UNEXPECTED_END;
		goto fail;
	}
	if (is_obj[(depth - 1) >> 6] & 1ull << ((depth - 1) & 63)) {
		if (p[i] == '}') {
			i++;
			depth--;
			goto after_value;
		}
		if (p[i] != ',') {
			r = AP_JSON_UNEXPECTED_BYTE;
			goto fail;
		}
		i = skip_ws(p, n, i + 1);
		if (i >= n) {
			r = AP_JSON_UNEXPECTED_END;
			goto fail;
		}
		if (p[i] != '"') {
			r = AP_JSON_UNEXPECTED_BYTE;
			goto fail;
		}
		goto key;
	}
	if (p[i] == ']') {
		i++;
		depth--;
		goto after_value;
	}
	if (p[i] != ',') {
		r = AP_JSON_UNEXPECTED_BYTE;
		goto fail;
	}
	i++;
	goto value;

key: /* p[i] is a key's opening quote */
	i++;
	r = scan_string(p, n, &i);
	if (r)
		goto fail;
	i = skip_ws(p, n, i);
	if (i >= n) {
		r = AP_JSON_UNEXPECTED_END;
		goto fail;
	}
	if (p[i] != ':') {
		r = AP_JSON_UNEXPECTED_BYTE;
		goto fail;
	}
	i++;
	goto value;

fail:
	*err_off = i < n ? i : n;
	return r;
}

/* {Offset, Reason}, so the asker gets {error, {Offset, Reason}}. */
static actor_pool_status json_reply_error(actor_pool_reply *reply, size_t off, enum ap_json_result r)
{
	/* 131, tuple header, a ulonglong (at most a small big: 11 bytes) and
	 * an atom of at most 22 characters fit with room to spare. */
	enum { MAX_REPLY = 64 };
	int idx = 0;

	reply->kind = AP_REPLY_TERM;
	reply->len = 0;
	if (reply->reserve(reply, MAX_REPLY))
		return AP_HANDLER_CRASH;
	char *b = (char *)reply->data;
	if (ei_encode_version(b, &idx) || ei_encode_tuple_header(b, &idx, 2) ||
	    ei_encode_ulonglong(b, &idx, (unsigned long long)off) || ei_encode_atom(b, &idx, ap_json_reason_name(r)))
		return AP_HANDLER_CRASH;
	reply->len = (size_t)idx;
	return AP_HANDLER_ERROR;
}

static actor_pool_status json_validate_handle(void *state, const actor_pool_request *req, actor_pool_reply *reply)
{
	size_t off = 0;
	enum ap_json_result r;

	(void)state;
	if (!req->is_binary)
		return reply_atom(reply, "not_a_binary", AP_HANDLER_ERROR);
	r = ap_json_validate(req->data, req->len, &off);
	/* A tell still counts as refused when invalid (the pool's `errors`),
	 * but nobody would read the reason. */
	if (!req->is_ask)
		return r ? AP_HANDLER_ERROR : AP_HANDLER_OK;
	if (r)
		return json_reply_error(reply, off, r);
	return reply_atom(reply, "ok", AP_HANDLER_OK);
}

static const actor_pool_handler json_validate_handler = {
	.abi_version = ACTOR_POOL_HANDLER_ABI,
	.name = "json_validate",
	.handle = json_validate_handle,
};

const actor_pool_handler *ap_builtin_handler(const char *name)
{
	if (!name)
		return NULL;
	if (!strcmp(name, "echo"))
		return &echo_handler;
	if (!strcmp(name, "json_validate"))
		return &json_validate_handler;
	return NULL;
}

int ap_handler_may_inline(const actor_pool_handler *h)
{
	return h == &echo_handler || h == &json_validate_handler;
}

/* ---- plugins ----------------------------------------------------------------- */

static void set_why(char *why, size_t why_len, const char *s)
{
	if (why_len)
		snprintf(why, why_len, "%s", s ? s : "unknown error");
}

/* The file a plugin's Path names, or NULL (why set): dlopen(NULL) is the
 * program itself, and a bare name would be looked for in the library path,
 * so a name without '/' is a file here. local: PATH_MAX bytes. */
static const char *plugin_file(const char *path, char local[PATH_MAX], char *why, size_t why_len)
{
	if (!path || !*path) {
		set_why(why, why_len, "empty path");
		return NULL;
	}
	if (strchr(path, '/'))
		return path;
	if ((size_t)snprintf(local, PATH_MAX, "./%s", path) >= PATH_MAX) {
		set_why(why, why_len, "path too long");
		return NULL;
	}
	return local;
}

int ap_plugin_load(const char *path, const actor_pool_handler **out, void **dl_handle, uint32_t *got, char *why,
		   size_t why_len)
{
	char local[PATH_MAX];
	const actor_pool_handler *h;
	actor_pool_handler_get_fn get;
	void *dl, *sym;

	*out = NULL;
	*dl_handle = NULL;
	if (got)
		*got = 0;
	if (why_len)
		why[0] = '\0';
	path = plugin_file(path, local, why, why_len);
	if (!path)
		return -1;
	dl = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!dl) {
		set_why(why, why_len, dlerror());
		return -1;
	}
	/* A NULL from dlsym is an error only if dlerror says so; a symbol whose
	 * value is NULL is refused all the same. */
	dlerror();
	sym = dlsym(dl, ACTOR_POOL_HANDLER_SYMBOL);
	if (!sym) {
		const char *e = dlerror();
		set_why(why, why_len, e ? e : ACTOR_POOL_HANDLER_SYMBOL " is NULL");
		goto err;
	}
	get = (actor_pool_handler_get_fn)sym;
	h = get();
	if (!h) {
		set_why(why, why_len, ACTOR_POOL_HANDLER_SYMBOL " returned NULL");
		goto err;
	}
	/* abi_version is the first field in every version of the struct: read
	 * nothing else before it matches. */
	if (h->abi_version != ACTOR_POOL_HANDLER_ABI) {
		if (got)
			*got = h->abi_version;
		if (why_len)
			snprintf(why, why_len, "abi_version %u, want %u", (unsigned)h->abi_version,
				 (unsigned)ACTOR_POOL_HANDLER_ABI);
		dlclose(dl);
		return -2;
	}
	if (!h->handle) {
		set_why(why, why_len, "the handler has no handle callback");
		goto err;
	}
	*out = h;
	*dl_handle = dl;
	return 0;
err:
	dlclose(dl);
	return -1;
}

int ap_plugin_check(const char *path, char *why, size_t why_len)
{
	char local[PATH_MAX];
	struct stat st;

	if (why_len)
		why[0] = '\0';
	const char *at = plugin_file(path, local, why, why_len);
	if (!at)
		return -1;
	/* O_NONBLOCK: a FIFO under that name must not hold up the caller. */
	int fd = open(at, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
	if (fd < 0) {
		if (why_len)
			snprintf(why, why_len, "%s: %s", path, strerror(errno));
		return -1;
	}
	int regular = fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
	close(fd);
	if (!regular) {
		if (why_len)
			snprintf(why, why_len, "%s: not a regular file", path);
		return -1;
	}
	return 0;
}

void ap_plugin_unload(void *dl_handle)
{
	if (dl_handle)
		dlclose(dl_handle);
}
