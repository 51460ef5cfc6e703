/* plugin_crash: a test plugin whose requests choose the outcome: crash, sleep,
 * fail, echo, or misbehave the ways a real handler can (for the isolation tests).
 *
 *   <<"crash">>      AP_HANDLER_CRASH (the worker is replaced)
 *   <<"whoami">>     replies the index of the worker that ran it
 *   <<"os_pid">>     replies getpid() of the process that ran it
 *   <<"segv">>       writes through a NULL pointer (SIGSEGV)
 *   <<"abort">>      abort() (SIGABRT)
 *   {exit, Code}     exit(Code)
 *   {sleep, Ms}      sleeps Ms milliseconds, then replies ok (tells sleep too,
 *                    which is how a test fills a worker's mailbox)
 *   {spin, Ms}       busy-loops Ms milliseconds on the CPU, then replies ok;
 *                    {spin, infinity} never returns
 *   {alloc, Mb}      mallocs 1 MiB blocks and touches every page until Mb MiB
 *                    are held, frees them and replies {ok, Mb}; a malloc that
 *                    fails first abort()s (a runaway allocation under a limit)
 *   {fail, Reason}   AP_HANDLER_ERROR with the atom Reason
 *   anything else    echoed: a binary as a binary, a term as the same term
 *
 * Config {init_sleep, Ms}: each worker's init sleeps Ms milliseconds first
 * (a pool that is still starting, for a test to stop). Config {delay_us, Us}:
 * every message (ask or tell) waits Us microseconds before it is handled as
 * above (a slow host among fast ones, for the routing tests and bench).
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <ei.h>

#include "actor_pool_handler.h"

static void sleep_ms(long ms)
{
	struct timespec ts = { .tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L };

	while (nanosleep(&ts, &ts) && errno == EINTR)
		;
}

static void sleep_us(long us)
{
	struct timespec ts = { .tv_sec = us / 1000000, .tv_nsec = (us % 1000000) * 1000L };

	while (nanosleep(&ts, &ts) && errno == EINTR)
		;
}

static long long now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* On the CPU, not asleep: a handler stuck in a loop, which no signal but a
 * fatal one ends. ms < 0: forever. */
static void spin_ms(long ms)
{
	long long end = now_ms() + ms;
	volatile unsigned long n = 0;

	while (ms < 0 || now_ms() < end)
		n++;
}

#define ALLOC_BLOCK (1024 * 1024)

/* Holds mb MiB at once, every page written so that it is resident, then
 * frees it all. Each block links to the previous one through its first
 * bytes: no bookkeeping allocation that could fail on its own. A malloc
 * that fails aborts, as a handler that does not check would crash. */
static void alloc_mb(long mb)
{
	long page = sysconf(_SC_PAGESIZE);
	void *head = NULL;

	if (page <= 0)
		page = 4096;
	for (long k = 0; k < mb; k++) {
		volatile char *b = malloc(ALLOC_BLOCK);

		if (!b)
			abort();
		for (long off = 0; off < ALLOC_BLOCK; off += page)
			b[off] = (char)k;
		memcpy((void *)b, &head, sizeof head);
		head = (void *)b;
	}
	while (head) {
		void *prev;

		memcpy(&prev, head, sizeof prev);
		free(head);
		head = prev;
	}
}

static actor_pool_status reply_long(actor_pool_reply *reply, long v)
{
	char t[16];
	int ti = 0;

	ei_encode_version(t, &ti);
	ei_encode_long(t, &ti, v);
	return actor_pool_reply_set(reply, AP_REPLY_TERM, t, (size_t)ti) ? AP_HANDLER_CRASH : AP_HANDLER_OK;
}

static actor_pool_status crash_handle(void *state, const actor_pool_request *req, actor_pool_reply *reply)
{
	/* The pool validated the message before handing it over, so ei's
	 * decoders, which take no length, stay inside it. */
	const char *d = (const char *)req->data;
	char tag[MAXATOMLEN_UTF8], reason[MAXATOMLEN_UTF8];
	int idx = 0, ver, arity, type, size;
	long ms;

	/* The state is the delay itself (see crash_init): nothing to free. */
	if (state)
		sleep_us((long)(intptr_t)state);
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
		if (req->len == 6 && !memcmp(req->data, "os_pid", 6))
			return reply_long(reply, (long)getpid());
		if (req->len == 4 && !memcmp(req->data, "segv", 4)) {
			/* volatile: the store must happen, not be folded into a trap
			 * the compiler chooses. */
			volatile int *volatile null = NULL;
			*null = 1;
			return AP_HANDLER_CRASH;
		}
		if (req->len == 5 && !memcmp(req->data, "abort", 5))
			abort();
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
	if (!strcmp(tag, "exit") && !ei_decode_long(d, &idx, &ms))
		exit((int)ms);
	if (!strcmp(tag, "spin") && !ei_get_type(d, &idx, &type, &size)) {
		if (type == ERL_ATOM_EXT || type == ERL_SMALL_ATOM_EXT || type == ERL_ATOM_UTF8_EXT ||
		    type == ERL_SMALL_ATOM_UTF8_EXT) {
			if (ei_decode_atom_as(d, &idx, reason, sizeof reason, ERLANG_UTF8, NULL, NULL) ||
			    strcmp(reason, "infinity"))
				goto echo;
			spin_ms(-1);
		}
		if (ei_decode_long(d, &idx, &ms) || ms < 0)
			goto echo;
		spin_ms(ms);
		return actor_pool_reply_set(reply, AP_REPLY_ATOM, "ok", 2) ? AP_HANDLER_CRASH : AP_HANDLER_OK;
	}
	if (!strcmp(tag, "alloc") && !ei_decode_long(d, &idx, &ms) && ms >= 0 && ms <= 1048576) {
		char t[32];
		int ti = 0;

		alloc_mb(ms);
		ei_encode_version(t, &ti);
		ei_encode_tuple_header(t, &ti, 2);
		ei_encode_atom(t, &ti, "ok");
		ei_encode_long(t, &ti, ms);
		return actor_pool_reply_set(reply, AP_REPLY_TERM, t, (size_t)ti) ? AP_HANDLER_CRASH : AP_HANDLER_OK;
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

static int crash_init(void **state, const uint8_t *config, size_t config_len)
{
	/* The config is term_to_binary of the test's own term. */
	const char *d = (const char *)config;
	char tag[MAXATOMLEN_UTF8];
	int idx = 0, ver, arity;
	long ms;

	*state = NULL;
	if (config_len && !ei_decode_version(d, &idx, &ver) && !ei_decode_tuple_header(d, &idx, &arity) &&
	    arity == 2 && !ei_decode_atom_as(d, &idx, tag, sizeof tag, ERLANG_UTF8, NULL, NULL) &&
	    !ei_decode_long(d, &idx, &ms) && ms >= 0) {
		if (!strcmp(tag, "init_sleep"))
			sleep_ms(ms);
		else if (!strcmp(tag, "delay_us") && ms <= 60000000)
			*state = (void *)(intptr_t)ms;
	}
	return 0;
}

static const actor_pool_handler crash_handler = {
	.abi_version = ACTOR_POOL_HANDLER_ABI,
	.name = "plugin_crash",
	.init = crash_init,
	.handle = crash_handle,
};

__attribute__((visibility("default"))) const actor_pool_handler *actor_pool_handler_get(void)
{
	return &crash_handler;
}
