/* pool_opts: a pool's options and handler, decoded from the manager's
 * start_pool (pool_opts.c) or given by --pool (pool_node.c). */
#ifndef AP_POOL_OPTS_H
#define AP_POOL_OPTS_H

#include <ei.h>

#include "pool.h"
#include "pool_limits.h"

#define AP_POOL_HANDLER_DESC 64
#define AP_POOL_SPEC_MAX (AP_POOL_MAX_PATH + 1) /* a plugin's path with its NUL, or a built-in's name */

/* A bad option: {error, {badarg, {Key, Value}}}, Value copied as sent. */
struct ap_badarg {
	const char *key;
	const char *val;
	int val_len;
};

/* A routing's name, as the manager's options and --pool both give it. 0 or
 * -1. */
int ap_pool_parse_routing(const char *name, ap_routing *out);
/* The options map at b[*i] (b[0..len) is the request) into o (its
 * defaults set by the caller); 0, or -1 with what was bad in *ba. */
int ap_pool_parse_opts(const char *b, size_t len, int *i, ap_pool_opts *o, struct ap_badarg *ba);
/* Handler: echo | json_validate | {plugin, Path} | {plugin, Path, Config},
 * at b[*i]: the handler (a thread-mode plugin loaded here, *dl its handle;
 * process mode: checked only), its Config's bytes, a description (desc,
 * AP_POOL_HANDLER_DESC bytes) and its spec (spec, AP_POOL_SPEC_MAX bytes).
 * 0, or -1 with an error term appended to err. */
int ap_pool_resolve_handler(const char *b, size_t blen, int *i, int process, const actor_pool_handler **h,
			    void **dl, const char **config, int *config_len, char *desc, char *spec,
			    ei_x_buff *err);

#endif
