/* rcpt_snap: the receptionist's snapshot keeper: the shared-memory
 * segment (ap_shm) that lookups read without a message, kept equal to the
 * registry, and the sweep of segments whose writer is gone. Its state is
 * its own (the writer, its health, the listings held during a bulk drop);
 * the node hands it the registry and the process that sends. Loop thread
 * only, but for rcpt_snap_unlink.
 *
 * Ordering: a change reaches the snapshot (ap_shm_put, from the registry's
 * on_change) before any listing or reply about it is sent, so a lookup
 * from the snapshot reflects every registration whose `registered` has
 * been sent.
 *
 * Full or failing: when a put finds the segment full (-ENOSPC) the writer
 * marks it STALE (readers ask the receptionist instead); from then on puts
 * stop and a rebuild from the registry is tried once a second until it
 * fits. Any other put failure (none is expected: the registry refuses keys
 * and listings over the snapshot's limits) also forces STALE, never a
 * silently old value.
 *
 * Orphans: at start, before creating its own, the node sweeps the shm
 * directory for actor_pool.* segments whose writer is gone (nobody holds
 * the segment's lock: a writer holds flock(LOCK_SH) on it for its life,
 * see ap_shm.h) and unlinks them; every other one is kept. One line per
 * segment removed, one summary line for what was kept or passed over.
 * If the node's own name is still held (the previous incarnation of this
 * node has not exited yet: its owner died and the new one started this
 * node at once), the create is retried for up to SHM_TAKEOVER_MS: the
 * BEAM reaches this node only once it is published to epmd, after this
 * init, so it never attaches to the old incarnation's segment. The sweep
 * is here rather than in the
 * BEAM-side owner: the header's format and its hostile-input checks are
 * this C code's (one decoder, tested and fuzzed with it), and a node
 * started by hand or by another supervisor sweeps too. (The owner still
 * unlinks the segment of its own child when that dies: it knows the name.)
 */
#ifndef RCPT_SNAP_H
#define RCPT_SNAP_H

#include <ei.h>
#include <stddef.h>
#include <stdint.h>

#include "ap_node.h"
#include "registry.h"

#define RCPT_SNAP_NAME_MAX 256 /* the segment's name, its NUL included */

/* The registry's hooks (registry_new's ops): on_change writes the
 * snapshot, on_listing sends (or holds during a bulk drop). */
extern const registry_ops rcpt_snap_ops;

/* Who sends the listings and what the snapshot mirrors; before any
 * message, with or without a snapshot. */
void rcpt_snap_init(ap_node *n, ap_proc *self, registry *reg);
/* Remove the orphaned segments (see above); logs, never fails. */
void rcpt_snap_sweep(void);
/* Create the snapshot `name` of `bytes` (0: none) and start its heartbeat.
 * Without one (it cannot be created, or its name stays held), the node
 * runs on and lookups ask it: this logs why and returns nothing. */
void rcpt_snap_open(const char *name, size_t bytes, uint64_t incarnation);

/* registry_drop_origin, with the snapshot rebuilt once instead of written
 * per key when the drop is large against what stays. */
void rcpt_snap_drop_origin(uint32_t id);

/* The stats call's shm_* fields. */
struct rcpt_snap_stats {
	uint64_t keys, used, compactions, errors, rebuilds, size;
	const char *name; /* "" without a snapshot */
};
void rcpt_snap_get_stats(struct rcpt_snap_stats *s);
/* "live", "stale", "closed", or "none" without a snapshot. */
const char *rcpt_snap_state(void);

/* Any thread (the signal thread, when the loop is stuck): unlink the
 * segment's name if it is still ours. */
void rcpt_snap_unlink(void);
/* Mark the snapshot CLOSED and unlink its name; free what is held. */
void rcpt_snap_close(void);

#endif
