/* fuzz_json: libFuzzer target over the built-in json_validate handler
 * (pool/handlers.c): ap_json_validate, and the reply the handler builds,
 * on whatever bytes a caller of such a pool sends.
 *
 * The input is the document. Each document is validated from an
 * exact-size copy (ASan sees a read past it). Checked:
 *  - the result is a reason ap_json_reason_name names, and an error's
 *    offset is at most the length;
 *  - one pass: the first error is where the bytes stop being the start of
 *    some valid document. Validating only the bytes before an error at
 *    off < len gives ok, or an error at off itself (the document cut
 *    there), never one before it;
 *  - whitespace is not content: " doc\n" is valid when doc is; an error at
 *    off < len is the same error one byte later; an error at the end (cut
 *    short) stays an error, at or after the end of doc (a lone surrogate
 *    excepted: it is named at its '\', and "\ud800 then the end" is
 *    unexpected_end, the low half being due);
 *  - the handler, asked, answers the atom ok (status ok) for a valid
 *    document, and {Offset, Reason} with the validator's offset and reason
 *    (status error) for another; told, ok or error alike, no reply.
 */
#include <ei.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "handlers.h"
#include "t_reserve.h"

#include "t_fuzz.h"

/* ap_json_validate over an exact-size copy of p[0..n). */
static enum ap_json_result t_validate(const uint8_t *p, size_t n, size_t *off)
{
	uint8_t *c = malloc(n ? n : 1);
	t_check(c != NULL);
	memcpy(c, p, n);
	*off = (size_t)-1;
	enum ap_json_result r = ap_json_validate(c, n, off);
	free(c);
	t_check(ap_json_reason_name(r) != NULL);
	if (r == AP_JSON_OK)
		t_check(*off == (size_t)-1); /* untouched */
	else
		t_check(*off <= n);
	return r;
}

/* The handler's answer to an ask (and to a tell) of p[0..n). */
static void t_handler(const uint8_t *p, size_t n, enum ap_json_result r, size_t off)
{
	const actor_pool_handler *h = ap_builtin_handler("json_validate");
	t_check(h && h->handle);
	uint8_t *c = malloc(n ? n : 1);
	t_check(c != NULL);
	memcpy(c, p, n);
	actor_pool_reply rep = { .kind = AP_REPLY_ATOM, .reserve = t_reserve };
	t_check(t_reserve(&rep, 2) == 0);
	memcpy(rep.data, "ok", 2);
	rep.len = 2;
	actor_pool_request q = { .data = c, .len = n, .is_binary = 1, .is_ask = 1 };
	actor_pool_status st = h->handle(NULL, &q, &rep);
	if (r == AP_JSON_OK) {
		t_check(st == AP_HANDLER_OK && rep.kind == AP_REPLY_ATOM && rep.len == 2 && !memcmp(rep.data, "ok", 2));
	} else {
		t_check(st == AP_HANDLER_ERROR && rep.kind == AP_REPLY_TERM && rep.len <= rep.cap);
		const char *b = (const char *)rep.data;
		int i = 0, v, arity;
		unsigned long long o;
		char atom[MAXATOMLEN_UTF8];
		t_check(ei_decode_version(b, &i, &v) == 0 && ei_decode_tuple_header(b, &i, &arity) == 0 && arity == 2);
		t_check(ei_decode_ulonglong(b, &i, &o) == 0 && o == off);
		t_check(ei_decode_atom(b, &i, atom) == 0 && strcmp(atom, ap_json_reason_name(r)) == 0);
		t_check((size_t)i == rep.len);
	}
	q.is_ask = 0;
	st = h->handle(NULL, &q, &rep);
	t_check(st == (r == AP_JSON_OK ? AP_HANDLER_OK : AP_HANDLER_ERROR));
	free(rep.data);
	free(c);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	size_t off, off2;
	enum ap_json_result r = t_validate(data, size, &off);

	if (r != AP_JSON_OK && off < size) {
		enum ap_json_result r2 = t_validate(data, off, &off2);
		t_check(r2 == AP_JSON_OK || off2 == off);
	}

	uint8_t *w = malloc(size + 2);
	t_check(w != NULL);
	w[0] = ' ';
	memcpy(w + 1, data, size);
	w[size + 1] = '\n';
	enum ap_json_result rw = t_validate(w, size + 2, &off2);
	free(w);
	if (r == AP_JSON_OK)
		t_check(rw == AP_JSON_OK);
	else if (off < size)
		t_check(rw == r && off2 == off + 1);
	else /* but a lone surrogate is named at its own '\', before what made it lone */
		t_check(rw != AP_JSON_OK && (off2 >= size + 1 || rw == AP_JSON_LONE_SURROGATE));

	t_handler(data, size, r, off);
	return 0;
}
