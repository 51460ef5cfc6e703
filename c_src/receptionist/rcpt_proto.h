/* rcpt_proto: the receptionist's protocol, served by the process
 * `actor_receptionist` (the messages and calls: rcpt_proto.c). */
#ifndef RCPT_PROTO_H
#define RCPT_PROTO_H

#include <stddef.h>

#include "ap_node.h"

/* Make the registry (listings up to max_listing bytes, its changes going
 * to the snapshot keeper) and spawn the process that serves it, handing
 * both to rcpt_snap. NULL when out of memory. */
ap_proc *rcpt_proto_start(ap_node *n, size_t max_listing);
/* Free the registry and the rest (the loop has stopped). */
void rcpt_proto_free(void);

#endif
