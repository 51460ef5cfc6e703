/* plugin_badabi: a test plugin built for an ABI the pool does not speak (999): loading it must be refused. */
#include "actor_pool_handler.h"

static actor_pool_status badabi_handle(void *state, const actor_pool_request *req, actor_pool_reply *reply)
{
	(void)state;
	(void)req;
	(void)reply;
	return AP_HANDLER_CRASH; /* never called: the pool refuses the ABI first */
}

static const actor_pool_handler badabi_handler = {
	.abi_version = 999,
	.name = "plugin_badabi",
	.handle = badabi_handle,
};

__attribute__((visibility("default"))) const actor_pool_handler *actor_pool_handler_get(void)
{
	return &badabi_handler;
}
