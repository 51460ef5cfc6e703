/* registry: the receptionist's registry core, free of sockets and of the
 * snapshot, so it can be tested alone.
 *
 * A key (1..REGISTRY_MAX_KEY bytes) has an ordered list of refs (pids, in
 * registration order, no duplicates) and a set of subscribers (pids). Every
 * ref carries an `origin` (REGISTRY_ORIGIN_LOCAL: registered through this
 * node's BEAM; others: learnt from another receptionist by gossip).
 *
 * Costs: register, deregister, subscribe, unsubscribe and the lookups are
 * O(1) in the number of keys. A change to a key costs O(refs of that key)
 * (its value is re-encoded for the snapshot and the listings), never
 * O(all registrations). unsubscribe_all is O(keys of that subscriber);
 * drop_origin / drop_node are O(refs of the keys holding refs of that
 * origin / node), through a per-(origin, node) index of keys; drop_origin
 * finds that origin's (origin, node) pairs through a list per origin, so
 * it costs nothing more with many origins (drop_node visits every pair).
 *
 * Storage: a ref is 16 bytes (its group: the (origin, node) pair, interned,
 * and the pid's num, serial and creation); a key with one ref holds it
 * inline. Pids are encoded back exactly as ei_encode_pid would (NEW_PID_EXT,
 * node atom as ei encodes it), from a per-node cached prefix.
 *
 * Events go through registry_ops, synchronously, from inside the call that
 * caused them: for a change to a key's refs, on_change first (the snapshot
 * writer hooks in there), then on_listing once per subscriber of the key.
 * Callbacks must not call back into the registry.
 *
 * Not thread-safe: one thread (the node's loop) owns a registry.
 */
#ifndef REGISTRY_H
#define REGISTRY_H

#include <ei.h>
#include <stddef.h>
#include <stdint.h>

#define REGISTRY_MAX_KEY 1024u           /* bytes; the same as AP_SHM_MAX_KEY */
#define REGISTRY_DEFAULT_MAX_VAL (16u << 20) /* the same as AP_SHM_MAX_VAL */
#define REGISTRY_ORIGIN_LOCAL 0u

typedef struct registry registry;

typedef struct registry_ops {
	/* key's ref list changed. val/vlen: the external term format of the
	 * new list of pids, 131 included (an empty list is {131, 106}, vlen
	 * 2); nrefs: its length. Called before any on_listing about the
	 * change. val is NULL (vlen 0) only if the registry could not get
	 * memory to encode it: the caller's copy of this key is then unknown. */
	void (*on_change)(void *arg, const uint8_t *key, size_t klen, const uint8_t *val, size_t vlen,
			  size_t nrefs);
	/* Send msg ({listing, {service_key, Key}, [Pid...]}, 131 included) to
	 * the subscriber `to`. */
	void (*on_listing)(void *arg, const erlang_pid *to, const uint8_t *key, size_t klen, const uint8_t *msg,
			   size_t mlen);
} registry_ops;

typedef struct registry_stats {
	uint64_t keys;          /* keys with at least one ref */
	uint64_t entries;       /* keys held: with refs or subscribers */
	uint64_t refs;          /* registrations */
	uint64_t subscriptions; /* (key, subscriber) pairs */
	uint64_t subscribers;   /* distinct subscriber pids */
	uint64_t listings_sent; /* on_listing calls */
	uint64_t nodes;         /* distinct node names interned (refs' and subscribers') */
	uint64_t groups;        /* distinct (origin, node) pairs with refs */
} registry_stats;

/* A new, empty registry. ops are copied; either callback may be NULL.
 * max_value: the largest encoded listing value (131 included) a key may
 * reach; a register that would exceed it is refused (-E2BIG). 0: the
 * default, REGISTRY_DEFAULT_MAX_VAL. NULL when out of memory. */
registry *registry_new(const registry_ops *ops, void *arg, size_t max_value);
void registry_free(registry *r);

/* Deferring (off at first): while on, a key without subscribers whose refs
 * change is reported (on_change) once, at registry_flush or when deferring
 * is turned off, with its refs as they are then, and not at all if they
 * are back to what they were. A run of changes to one key then costs one
 * encoding of its listing instead of one per change, which for a key with
 * n refs is O(n) each. A key with subscribers is still reported at every
 * change (each gets a listing per change), after the deferred ones, and
 * subscribing to a deferred key reports it first. Queries (registry_value,
 * registry_listing) see the current refs at once; flush before sending
 * anything that must follow the reports (a reply, a find's listing). */
void registry_defer(registry *r, int on);
int registry_deferring(const registry *r);
void registry_flush(registry *r);

/* Add ref under key (origin: where it came from). Returns 1 when added (and
 * reported: on_change, listings), 0 when the ref was already there (nothing
 * reported, its origin unchanged), -EINVAL for an empty or too long key,
 * -E2BIG when the key's listing would exceed max_value, -ENOMEM. On an
 * error nothing changed. */
int registry_register(registry *r, const void *key, size_t klen, const erlang_pid *ref, uint32_t origin);
/* Remove ref from key, whatever its origin. 1 removed (and reported), 0
 * not there (nothing reported), -EINVAL bad key. */
int registry_deregister(registry *r, const void *key, size_t klen, const erlang_pid *ref);

/* Make origin the origin of ref under key (the cluster layer keeps a ref
 * that several origins registered under one origin that still holds it).
 * Nothing is reported: the listing is the same. 1 changed, 0 not there or
 * already that origin, -EINVAL, -ENOMEM (nothing changed). */
int registry_set_origin(registry *r, const void *key, size_t klen, const erlang_pid *ref, uint32_t origin);

/* Subscribe sub to key and send it the current listing (also when it was
 * already subscribed). 1 new, 0 already subscribed, -EINVAL, -ENOMEM. */
int registry_subscribe(registry *r, const void *key, size_t klen, const erlang_pid *sub);
/* 1 removed, 0 was not subscribed, -EINVAL. Sends nothing. */
int registry_unsubscribe(registry *r, const void *key, size_t klen, const erlang_pid *sub);
/* Remove every subscription of sub; returns how many. Sends nothing. */
size_t registry_unsubscribe_all(registry *r, const erlang_pid *sub);

/* Remove every ref of that origin / every ref whose pid lives on node;
 * each changed key is reported once. Return the number of refs removed.
 * They allocate nothing, so they cannot fail. */
size_t registry_drop_origin(registry *r, uint32_t origin);
/* Refs of that origin (O(its (origin, node) pairs), no walk over the refs). */
size_t registry_origin_refs(const registry *r, uint32_t origin);
size_t registry_drop_node(registry *r, const char *node);

/* Read side. The views returned point into a buffer of the registry, valid
 * until the next call on it. */

/* Number of refs under key (0 for an unknown key). */
size_t registry_count(const registry *r, const void *key, size_t klen);
/* The key's listing value (131 + list of pids; {131, 106} for an unknown
 * key). 0, or -EINVAL / -ENOMEM. */
int registry_value(registry *r, const void *key, size_t klen, const uint8_t **val, size_t *vlen);
/* The whole listing message {listing, {service_key, Key}, Refs}, 131
 * included. 0, or -EINVAL / -ENOMEM. */
int registry_listing(registry *r, const void *key, size_t klen, const uint8_t **msg, size_t *mlen);
/* Iterate over the keys that have refs: *cursor starts at 0; returns 1
 * with the key and its value (as registry_value), 0 at the end, -ENOMEM.
 * The registry must not change during an iteration. */
int registry_next(registry *r, size_t *cursor, const uint8_t **key, size_t *klen, const uint8_t **val,
		  size_t *vlen);

void registry_get_stats(const registry *r, registry_stats *s);
/* Heap bytes held by the registry's own structures (requested sizes, no
 * allocator overhead). */
size_t registry_mem_bytes(const registry *r);

/* Check every internal invariant (tests, debugging): 0, or -1 with a line
 * saying what is wrong in why. O(everything). */
int registry_check(const registry *r, char *why, size_t cap);

#endif
