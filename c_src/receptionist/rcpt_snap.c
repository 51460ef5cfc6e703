/* rcpt_snap: the receptionist's snapshot keeper (see rcpt_snap.h). */
#include "rcpt_snap.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ap_shm.h"
#include "ap_time.h"
#include "rcpt_log.h"

#define HEARTBEAT_MS 500 /* the header promises at least one a second */
#define REBUILD_MS 1000

static struct {
	ap_node *n;
	ap_proc *self;
	registry *reg;
	ap_shm_writer *w;
	char shm_name[RCPT_SNAP_NAME_MAX];
	size_t shm_bytes;
	int shm_full;      /* puts stopped: a rebuild is due */
	int rebuild_armed; /* its timer is pending */
	uint64_t shm_errors, rebuilds;
	/* A bulk drop: the snapshot is rebuilt once at the end instead of
	 * written per key, and the listings wait for it in `held`. */
	int bulk;
	struct held_listing {
		erlang_pid to;
		uint8_t *msg;
		size_t len;
	} *held;
	size_t nheld, capheld;
} sn;

/* ---- keeping it equal to the registry ---------------------------------------- */

static int iter_next(void *arg, const void **key, size_t *klen, const void **val, size_t *vlen)
{
	size_t *cursor = arg;
	const uint8_t *k, *v;
	int rc = registry_next(sn.reg, cursor, &k, klen, &v, vlen);
	*key = k;
	*val = v;
	return rc;
}

static int iter_fail(void *arg, const void **key, size_t *klen, const void **val, size_t *vlen)
{
	(void)arg, (void)key, (void)klen, (void)val, (void)vlen;
	return -ECANCELED;
}

static void rebuild_tick(ap_node *n, void *arg);

static void arm_rebuild(void)
{
	if (sn.rebuild_armed)
		return;
	if (ap_node_timer(sn.n, REBUILD_MS, rebuild_tick, NULL) == 0)
		sn.rebuild_armed = 1;
}

/* Readers must stop trusting the snapshot: a failed rebuild leaves it
 * STALE (gen unchanged), which is all this does. */
static void force_stale(void)
{
	ap_shm_rebuild(sn.w, iter_fail, NULL);
	sn.shm_full = 1;
	arm_rebuild();
}

static void rebuild_tick(ap_node *n, void *arg)
{
	(void)n, (void)arg;
	sn.rebuild_armed = 0;
	if (!sn.w || !sn.shm_full)
		return;
	size_t cursor = 0;
	sn.rebuilds++;
	int rc = ap_shm_rebuild(sn.w, iter_next, &cursor);
	if (rc == 0) {
		uint64_t keys, used;
		ap_shm_writer_stats(sn.w, &keys, &used, NULL);
		sn.shm_full = 0;
		ap_log(AP_LOG_NOTICE, "receptionist: snapshot %s rebuilt, live again (%llu keys, %llu bytes)",
		       sn.shm_name, (unsigned long long)keys, (unsigned long long)used);
		return;
	}
	RLOG(AP_LOG_DEBUG, "receptionist: snapshot rebuild failed (%s), retrying", strerror(-rc));
	arm_rebuild();
}

/* CLOCK_MONOTONIC ms, as the header says (the loop's cached clock is 0
 * before it runs). */
static uint64_t mono_ms(void)
{
	return (uint64_t)ap_mono_ms();
}

static void heartbeat_tick(ap_node *n, void *arg)
{
	(void)arg;
	if (!sn.w)
		return;
	ap_shm_heartbeat(sn.w, mono_ms());
	ap_node_timer(n, HEARTBEAT_MS, heartbeat_tick, NULL);
}

/* The registry's hook: a key's refs changed; runs before any listing or
 * reply about the change goes out. */
static void on_change(void *arg, const uint8_t *key, size_t klen, const uint8_t *val, size_t vlen, size_t nrefs)
{
	(void)arg;
	if (!sn.w || sn.shm_full || sn.bulk)
		return; /* no snapshot, or one a rebuild will rewrite whole */
	if (!val) {
		sn.shm_errors++;
		RLOG(AP_LOG_ERROR, "receptionist: no memory to encode a listing; snapshot marked stale");
		force_stale();
		return;
	}
	int rc = ap_shm_put(sn.w, key, klen, val, nrefs ? vlen : 0);
	if (rc == 0)
		return;
	sn.shm_errors++;
	if (rc == -ENOSPC) {
		/* Logged once per episode: the writer marked the segment STALE. */
		uint64_t keys, used;
		ap_shm_writer_stats(sn.w, &keys, &used, NULL);
		ap_log(AP_LOG_WARNING,
		       "receptionist: snapshot %s is full (%zu bytes, %llu keys): lookups go to the receptionist "
		       "until a rebuild fits (tried every %d ms)",
		       sn.shm_name, sn.shm_bytes, (unsigned long long)keys, REBUILD_MS);
		sn.shm_full = 1;
		arm_rebuild();
		return;
	}
	/* -E2BIG cannot happen (the registry caps keys and listings at the
	 * snapshot's limits); if it did, the key's old value would stay
	 * readable, which is wrong: readers must ask us until a rebuild. */
	RLOG(AP_LOG_ERROR, "receptionist: snapshot put failed (%s); snapshot marked stale", strerror(-rc));
	force_stale();
}

static void on_listing(void *arg, const erlang_pid *to, const uint8_t *key, size_t klen, const uint8_t *msg,
		       size_t mlen)
{
	(void)arg, (void)key, (void)klen;
	if (sn.bulk) {
		/* After the rebuild, like every listing after its snapshot write.
		 * Without memory for it, it goes now: early beats never. */
		if (sn.nheld == sn.capheld) {
			size_t cap = sn.capheld ? sn.capheld * 2 : 64;
			void *h = realloc(sn.held, cap * sizeof *sn.held);
			if (h) {
				sn.held = h;
				sn.capheld = cap;
			}
		}
		uint8_t *copy = sn.nheld < sn.capheld ? malloc(mlen) : NULL;
		if (copy) {
			memcpy(copy, msg, mlen);
			sn.held[sn.nheld++] = (struct held_listing){ *to, copy, mlen };
			return;
		}
	}
	ap_send(sn.n, sn.self, to, (const char *)msg, (int)mlen);
}

/* Drops at least this many refs, and at least a quarter of what stays, go
 * the bulk way: one rebuild, O(what stays), beats a snapshot write (a
 * probe, cache misses) per removed key. */
#define BULK_DROP_MIN 4096u

void rcpt_snap_drop_origin(uint32_t id)
{
	size_t n = registry_origin_refs(sn.reg, id);
	registry_stats rs;
	registry_get_stats(sn.reg, &rs);
	int bulk = sn.w && !sn.shm_full && n >= BULK_DROP_MIN && n >= (rs.refs - n) / 4;
	sn.bulk = bulk;
	registry_drop_origin(sn.reg, id);
	sn.bulk = 0;
	if (bulk) {
		size_t cursor = 0;
		sn.rebuilds++;
		int rc = ap_shm_rebuild(sn.w, iter_next, &cursor);
		if (rc) {
			/* Left STALE by the failed rebuild: lookups ask us until the
			 * periodic rebuild fits. */
			sn.shm_errors++;
			RLOG(AP_LOG_WARNING, "receptionist: snapshot rebuild after a drop failed (%s)", strerror(-rc));
			sn.shm_full = 1;
			arm_rebuild();
		}
	}
	for (size_t k = 0; k < sn.nheld; k++) {
		ap_send(sn.n, sn.self, &sn.held[k].to, (const char *)sn.held[k].msg, (int)sn.held[k].len);
		free(sn.held[k].msg);
	}
	sn.nheld = 0;
}

const char *rcpt_snap_state(void)
{
	if (!sn.w)
		return "none";
	switch (ap_shm_state(sn.w)) {
	case AP_SHM_STATE_LIVE: return "live";
	case AP_SHM_STATE_STALE: return "stale";
	case AP_SHM_STATE_CLOSED: return "closed";
	default: return "none";
	}
}

/* ---- orphaned snapshots, and the create ------------------------------------ */

#define SHM_DIR "/dev/shm"
#define SHM_PREFIX "actor_pool."
#define SHM_TAKEOVER_MS 3000    /* how long a start waits for the previous writer of its name */
#define SHM_TAKEOVER_POLL_MS 10
#define AP_STR_(x) #x
#define AP_STR(x) AP_STR_(x)

static void on_swept(void *arg, const struct ap_shm_swept *s)
{
	const struct ap_shm_verdict *v = &s->v;
	(void)arg;
	switch (v->fate) {
	case AP_SHM_FATE_LIVE:
		ap_log(AP_LOG_DEBUG, "receptionist: kept " SHM_DIR "/%s: its writer (pid %llu as stamped) holds it",
		       s->name, (unsigned long long)v->pid);
		break;
	case AP_SHM_FATE_GONE:
		if (s->removed)
			ap_log(AP_LOG_NOTICE,
			       "receptionist: removed orphaned snapshot " SHM_DIR "/%s: its writer (pid %llu as "
			       "stamped) is gone%s%s",
			       s->name, (unsigned long long)v->pid, v->why ? ": " : "", v->why ? v->why : "");
		else if (s->err != ENOENT) /* ENOENT: another sweeper was first */
			ap_log(AP_LOG_WARNING, "receptionist: cannot remove orphaned snapshot " SHM_DIR "/%s: %s",
			       s->name, s->err == ESTALE ? "replaced while judged" : strerror(s->err));
		break;
	case AP_SHM_FATE_UNKNOWN:
		break; /* layouts 3, 4: counted in the summary */
	case AP_SHM_FATE_UNREADABLE:
		ap_log(AP_LOG_WARNING, "receptionist: left " SHM_DIR "/%s alone: %s%s%s", s->name, v->why,
		       s->err ? ": " : "", s->err ? strerror(s->err) : "");
		break;
	}
}

void rcpt_snap_sweep(void)
{
	struct ap_shm_sweep_sum sum;
	int rc = ap_shm_sweep(SHM_DIR, SHM_PREFIX, NULL, on_swept, NULL, &sum);
	if (rc < 0) {
		ap_log(AP_LOG_WARNING, "receptionist: cannot look for orphaned snapshots in " SHM_DIR ": %s",
		       strerror(-rc));
		return;
	}
	/* One line for everything left alone, never one per entry: the
	 * directory may be anyone's. */
	if (sum.v3_kept || sum.foreign || sum.capped)
		ap_log(AP_LOG_NOTICE,
		       "receptionist: snapshot sweep of " SHM_DIR "/" SHM_PREFIX "*: removed %u; left alone %u of "
		       "layout 3 or 4 whose writer pid a process here has (remove by hand once those nodes are "
		       "gone), %u live, %u not ours (another user's or not regular files)%s",
		       sum.removed, sum.v3_kept, sum.live, sum.foreign,
		       sum.capped ? "; stopped at " AP_STR(AP_SHM_SWEEP_MAX) " of ours" : "");
}

/* The previous incarnation of this node may still be exiting (the BEAM
 * restarted it at once): wait for its lock to go, bounded. The polling is
 * on a lock with a deadline; nothing else announces it. */
static int create_writer(uint64_t incarnation)
{
	int64_t deadline = ap_mono_ms() + SHM_TAKEOVER_MS;
	for (;;) {
		int rc = ap_shm_writer_create(&sn.w, sn.shm_name, sn.shm_bytes, ap_node_name(sn.n), incarnation);
		if (rc != -EEXIST || ap_mono_ms() >= deadline)
			return rc;
		nanosleep(&(struct timespec){ .tv_nsec = SHM_TAKEOVER_POLL_MS * 1000000L }, NULL);
	}
}

/* ---- the node's calls ----------------------------------------------------------- */

const registry_ops rcpt_snap_ops = { .on_change = on_change, .on_listing = on_listing };

void rcpt_snap_init(ap_node *n, ap_proc *self, registry *reg)
{
	sn.n = n;
	sn.self = self;
	sn.reg = reg;
}

void rcpt_snap_open(const char *name, size_t bytes, uint64_t incarnation)
{
	if (!bytes)
		return;
	snprintf(sn.shm_name, sizeof sn.shm_name, "%s", name);
	sn.shm_bytes = bytes;
	int rc = create_writer(incarnation);
	if (rc == -EEXIST) {
		/* Held after SHM_TAKEOVER_MS: never taken from a writer. */
		ap_log(AP_LOG_ERROR,
		       "receptionist: snapshot %s is still held by its writer after %d ms (a node of this "
		       "name runs, or an old one has not exited); running without (lookups ask the "
		       "receptionist)",
		       sn.shm_name, SHM_TAKEOVER_MS);
		sn.w = NULL;
	} else if (rc) {
		/* Lookups still work, through the receptionist. */
		ap_log(AP_LOG_ERROR, "receptionist: cannot create snapshot %s (%zu bytes): %s%s; running without",
		       sn.shm_name, sn.shm_bytes, strerror(-rc),
		       rc == -EPERM ? " (another user's object, or no regular file, has the name)" : "");
		sn.w = NULL;
	} else {
		ap_shm_heartbeat(sn.w, mono_ms());
		ap_node_timer(sn.n, HEARTBEAT_MS, heartbeat_tick, NULL);
		ap_log(AP_LOG_INFO, "receptionist: snapshot %s, %zu MiB", sn.shm_name, sn.shm_bytes >> 20);
	}
}

void rcpt_snap_get_stats(struct rcpt_snap_stats *s)
{
	memset(s, 0, sizeof *s);
	if (sn.w) {
		ap_shm_writer_stats(sn.w, &s->keys, &s->used, &s->compactions);
		s->size = sn.shm_bytes;
	}
	s->errors = sn.shm_errors;
	s->rebuilds = sn.rebuilds;
	s->name = sn.w ? sn.shm_name : "";
}

void rcpt_snap_unlink(void)
{
	if (sn.w)
		ap_shm_writer_unlink(sn.w); /* only if the name is still ours */
}

void rcpt_snap_close(void)
{
	if (sn.w) {
		ap_shm_writer_close(sn.w, 1);
		sn.w = NULL;
	}
	free(sn.held);
	sn.held = NULL;
	sn.nheld = sn.capheld = 0;
}
