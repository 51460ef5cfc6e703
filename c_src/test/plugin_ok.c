/* plugin_ok: a well-formed test plugin that counts each worker's messages and replies with the count. */
#include <stdio.h>
#include <stdlib.h>

#include "actor_pool_handler.h"

struct ok_state {
	unsigned long seen;
	size_t config_len; /* so a test can see the config reached init */
};

static int ok_init(void **state, const uint8_t *config, size_t config_len)
{
	struct ok_state *s = calloc(1, sizeof *s);

	(void)config;
	if (!s)
		return 1;
	s->config_len = config_len;
	*state = s;
	return 0;
}

static actor_pool_status ok_handle(void *state, const actor_pool_request *req, actor_pool_reply *reply)
{
	struct ok_state *s = state;
	char b[64];
	int n;

	s->seen++;
	if (!req->is_ask)
		return AP_HANDLER_OK;
	n = snprintf(b, sizeof b, "seen %lu config %zu", s->seen, s->config_len);
	if (actor_pool_reply_set(reply, AP_REPLY_BINARY, b, (size_t)n))
		return AP_HANDLER_CRASH;
	return AP_HANDLER_OK;
}

static void ok_terminate(void *state)
{
	free(state);
}

static const actor_pool_handler ok_handler = {
	.abi_version = ACTOR_POOL_HANDLER_ABI,
	.name = "plugin_ok",
	.init = ok_init,
	.handle = ok_handle,
	.terminate = ok_terminate,
};

__attribute__((visibility("default"))) const actor_pool_handler *actor_pool_handler_get(void)
{
	return &ok_handler;
}
