/* actor_pool_handler.h: the C ABI between actor_pool's pool node and the
 * handlers its workers run (built-ins and .so plugins).
 *
 * A handler is a set of callbacks run by workers. Each worker calls init
 * once (its own state), then handle once per message, then terminate.
 * Handlers are stateless across workers: a pool may run any message on any
 * worker. A pool's `isolation` says where a worker runs: a thread of the
 * pool node (thread: handlers must be thread-safe with respect to each
 * other, no unguarded globals, and must not crash, exit() or abort(), which
 * would take the pool node down), or a child process of its own (process,
 * the default for plugins: a crash, exit() or abort() costs that worker
 * only; init, handle and terminate all run in that process). Either way a
 * handler should not block for long (see handler_timeout_ms).
 *
 * A plugin is a shared object exporting
 *
 *     const actor_pool_handler *actor_pool_handler_get(void);
 *
 * whose result's abi_version must equal ACTOR_POOL_HANDLER_ABI, or the pool
 * refuses to start ({error, {abi_mismatch, Got, Want}}).
 *
 * Versioning: the ABI number changes whenever a struct below changes shape
 * or meaning. Fields are only ever added at the end, behind a new number.
 */
#ifndef ACTOR_POOL_HANDLER_H
#define ACTOR_POOL_HANDLER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define ACTOR_POOL_HANDLER_ABI 1

typedef enum actor_pool_status {
	AP_HANDLER_OK = 0,    /* the asker gets {ok, Reply} */
	AP_HANDLER_ERROR = 1, /* the asker gets {error, Reply}: the message was refused */
	AP_HANDLER_CRASH = 2, /* the worker dies and is replaced after a backoff; the
			       * asker gets {error, worker_crashed} */
} actor_pool_status;

typedef struct actor_pool_request {
	/* The message. When is_binary is 1 these are the binary's bytes; else
	 * the whole message in the external term format, from its 131 byte
	 * (decode it with ei). Valid only during the call. */
	const uint8_t *data;
	size_t len;
	int is_binary;
	int is_ask;      /* 1 when someone waits for the reply; 0 for a tell */
	uint32_t worker; /* the index (0..workers-1) of the worker running it */
} actor_pool_request;

typedef enum actor_pool_reply_kind {
	AP_REPLY_BINARY = 0, /* the bytes become an Erlang binary */
	AP_REPLY_TERM = 1,   /* the bytes are one encoded term (with or without 131) */
	AP_REPLY_ATOM = 2,   /* the bytes are an atom's UTF-8 name (e.g. "ok") */
} actor_pool_reply_kind;

/* Where a handler writes its reply. Before each call the pool presets it to
 * the atom ok (kind AP_REPLY_ATOM, data "ok", len 2): a handler that writes
 * nothing replies ok, and one that writes its own reply starts again from
 * len 0 (actor_pool_reply_set does). The buffer belongs to the worker and
 * is reused: keep no pointer into it after the call. */
typedef struct actor_pool_reply {
	actor_pool_reply_kind kind;
	uint8_t *data;
	size_t len;
	size_t cap;
	/* Make room for `more` bytes after len; data may move. 0 or -1. */
	int (*reserve)(struct actor_pool_reply *r, size_t more);
} actor_pool_reply;

typedef struct actor_pool_handler {
	uint32_t abi_version; /* ACTOR_POOL_HANDLER_ABI */
	const char *name;
	/* On the worker's thread, before its first message. config/config_len
	 * is the Config of {plugin, Path, Config} in the external term format
	 * (NULL/0 when there is none). Set *state; return 0, or non-zero when
	 * the worker cannot run (the pool start fails with
	 * {error, {handler_init_failed, Code}}). May be NULL. */
	int (*init)(void **state, const uint8_t *config, size_t config_len);
	/* One message. Required. */
	actor_pool_status (*handle)(void *state, const actor_pool_request *req, actor_pool_reply *reply);
	/* The worker is stopping (pool stopped, or after a crash). May be NULL. */
	void (*terminate)(void *state);
} actor_pool_handler;

typedef const actor_pool_handler *(*actor_pool_handler_get_fn)(void);
#define ACTOR_POOL_HANDLER_SYMBOL "actor_pool_handler_get"

/* Helpers for handlers, header-only so plugins need no library. */
static inline int actor_pool_reply_set(actor_pool_reply *r, actor_pool_reply_kind kind, const void *p, size_t n)
{
	r->kind = kind;
	r->len = 0;
	if (r->reserve(r, n))
		return -1;
	for (size_t i = 0; i < n; i++)
		r->data[i] = ((const uint8_t *)p)[i];
	r->len = n;
	return 0;
}

#ifdef __cplusplus
}
#endif

#endif
