/* plugin_crash: a test plugin whose requests choose the outcome: crash, sleep, fail or echo.
 *
 *   <<"crash">>      AP_HANDLER_CRASH (the worker is replaced)
 *   <<"whoami">>     replies the index of the worker that ran it
 *   {sleep, Ms}      sleeps Ms milliseconds, then replies ok (tells sleep too,
 *                    which is how a test fills a worker's mailbox)
 *   {fail, Reason}   AP_HANDLER_ERROR with the atom Reason
 *   anything else    echoed: a binary as a binary, a term as the same term
 */
#include <errno.h>
#include <string.h>
#include <time.h>

#include <ei.h>

#include "actor_pool_handler.h"

static void sleep_ms(long ms)
{
	struct timespec ts = { .tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L };

	while (nanosleep(&ts, &ts) && errno == EINTR)
		;
}

static actor_pool_status crash_handle(void *state, const actor_pool_request *req, actor_pool_reply *reply)
{
	/* The pool validated the message before handing it over, so ei's
	 * decoders, which take no length, stay inside it. */
	const char *d = (const char *)req->data;
	char tag[MAXATOMLEN_UTF8], reason[MAXATOMLEN_UTF8];
	int idx = 0, ver, arity;
	long ms;

	(void)state;
	if (req->is_binary) {
		if (req->len == 5 && !memcmp(req->data, "crash", 5))
			return AP_HANDLER_CRASH;
		if (req->len == 6 && !memcmp(req->data, "whoami", 6)) {
			/* The worker's index as an integer term: reply routing tests. */
			char t[16];
			int ti = 0;
			ei_encode_version(t, &ti);
			ei_encode_ulong(t, &ti, req->worker);
			return actor_pool_reply_set(reply, AP_REPLY_TERM, t, (size_t)ti) ? AP_HANDLER_CRASH : AP_HANDLER_OK;
		}
		goto echo;
	}
	if (ei_decode_version(d, &idx, &ver) || ei_decode_tuple_header(d, &idx, &arity) || arity != 2 ||
	    ei_decode_atom_as(d, &idx, tag, sizeof tag, ERLANG_UTF8, NULL, NULL))
		goto echo;
	if (!strcmp(tag, "sleep") && !ei_decode_long(d, &idx, &ms) && ms >= 0) {
		sleep_ms(ms);
		if (actor_pool_reply_set(reply, AP_REPLY_ATOM, "ok", 2))
			return AP_HANDLER_CRASH;
		return AP_HANDLER_OK;
	}
	if (!strcmp(tag, "fail") && !ei_decode_atom_as(d, &idx, reason, sizeof reason, ERLANG_UTF8, NULL, NULL)) {
		if (actor_pool_reply_set(reply, AP_REPLY_ATOM, reason, strlen(reason)))
			return AP_HANDLER_CRASH;
		return AP_HANDLER_ERROR;
	}
echo:
	if (!req->is_ask)
		return AP_HANDLER_OK;
	if (actor_pool_reply_set(reply, req->is_binary ? AP_REPLY_BINARY : AP_REPLY_TERM, req->data, req->len))
		return AP_HANDLER_CRASH;
	return AP_HANDLER_OK;
}

static const actor_pool_handler crash_handler = {
	.abi_version = ACTOR_POOL_HANDLER_ABI,
	.name = "plugin_crash",
	.handle = crash_handle,
};

__attribute__((visibility("default"))) const actor_pool_handler *actor_pool_handler_get(void)
{
	return &crash_handler;
}
