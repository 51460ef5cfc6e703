/* plugin_bad: shared objects that load but are no plugin, one per T_BAD_* define. */
#include <stddef.h>

#include "actor_pool_handler.h"

#define T_EXPORT __attribute__((visibility("default")))

#if defined(T_BAD_NOSYM)
/* Close to the real name, to show the lookup is exact. */
T_EXPORT int actor_pool_handler_got(void)
{
	return 0;
}
#elif defined(T_BAD_NULL)
T_EXPORT const actor_pool_handler *actor_pool_handler_get(void)
{
	return NULL;
}
#elif defined(T_BAD_NOHANDLE)
static const actor_pool_handler nohandle_handler = {
	.abi_version = ACTOR_POOL_HANDLER_ABI,
	.name = "plugin_nohandle",
};

T_EXPORT const actor_pool_handler *actor_pool_handler_get(void)
{
	return &nohandle_handler;
}
#else
#error "define one of T_BAD_NOSYM, T_BAD_NULL, T_BAD_NOHANDLE"
#endif
