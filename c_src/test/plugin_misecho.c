/* plugin_misecho: an echo that fails on purpose, for the soak's own checks
 * (soak/ap_soak.erl, SOAK_INJECT). It echoes every message, but each
 * worker's every 50th ask goes wrong the way its Config (an atom) says:
 *
 *   wrong   it is answered with the message the worker ran before it (a
 *           crossed reply: a payload that is not the asker's);
 *   late    it is answered right, after 3.5 s.
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <ei.h>

#include "actor_pool_handler.h"

#define EVERY 50
#define LATE_MS 3500

struct misecho {
	int late;          /* else wrong */
	unsigned long asks;
	uint8_t *prev;     /* the message run before, and its form */
	size_t prev_len;
	int prev_binary;
};

static int misecho_init(void **state, const uint8_t *config, size_t config_len)
{
	char how[MAXATOMLEN];
	int i = 0, v;
	struct misecho *s = calloc(1, sizeof *s);
	if (!s)
		return 1;
	if (!config || config_len > 64 || ei_decode_version((const char *)config, &i, &v) ||
	    ei_decode_atom((const char *)config, &i, how) || (strcmp(how, "wrong") && strcmp(how, "late"))) {
		free(s);
		return 2;
	}
	s->late = !strcmp(how, "late");
	*state = s;
	return 0;
}

static actor_pool_reply_kind kind_of(int is_binary) { return is_binary ? AP_REPLY_BINARY : AP_REPLY_TERM; }

static actor_pool_status misecho_handle(void *state, const actor_pool_request *req, actor_pool_reply *reply)
{
	struct misecho *s = state;
	int odd = req->is_ask && ++s->asks % EVERY == 0;
	int r;
	if (odd && s->late) {
		struct timespec ts = { .tv_sec = LATE_MS / 1000, .tv_nsec = (LATE_MS % 1000) * 1000000L };
		nanosleep(&ts, NULL);
	}
	if (odd && !s->late && s->prev)
		r = actor_pool_reply_set(reply, kind_of(s->prev_binary), s->prev, s->prev_len);
	else
		r = actor_pool_reply_set(reply, kind_of(req->is_binary), req->data, req->len);
	if (r)
		return AP_HANDLER_CRASH;
	uint8_t *copy = malloc(req->len ? req->len : 1);
	if (!copy)
		return AP_HANDLER_CRASH;
	memcpy(copy, req->data, req->len);
	free(s->prev);
	s->prev = copy;
	s->prev_len = req->len;
	s->prev_binary = req->is_binary;
	return AP_HANDLER_OK;
}

static void misecho_terminate(void *state)
{
	struct misecho *s = state;
	free(s->prev);
	free(s);
}

static const actor_pool_handler misecho_handler = {
	.abi_version = ACTOR_POOL_HANDLER_ABI,
	.name = "plugin_misecho",
	.init = misecho_init,
	.handle = misecho_handle,
	.terminate = misecho_terminate,
};

__attribute__((visibility("default"))) const actor_pool_handler *actor_pool_handler_get(void)
{
	return &misecho_handler;
}
