/* origins: the nodes whose registrations the receptionist holds by
 * gossip (its origins), interned to the small ids the registry tags refs
 * with (1..max; REGISTRY_ORIGIN_LOCAL, 0, is this node's own BEAM).
 *
 * Every gossiped registration names its origin, so finding the id costs
 * one lookup in a hash table (SipHash-1-3 with a random key: the names
 * come from other nodes), however many origins there are. The id of an
 * origin that left is given back (origins_release) and is the next one
 * handed out, so the ids held stay as many as the origins held.
 *
 * Not thread-safe: the node's loop owns it.
 */
#ifndef ORIGINS_H
#define ORIGINS_H

#include <stddef.h>
#include <stdint.h>

typedef struct origins origins;

/* At most max names at once. NULL when out of memory. */
origins *origins_new(uint32_t max);
void origins_free(origins *o);

/* The id of node `name` (a C string), interned first if add. 0: not held
 * (add 0), a name of MAXATOMLEN_UTF8 bytes or more, max names held
 * already, or no memory. */
uint32_t origins_get(origins *o, const char *name, int add);
/* The name with that id; NULL if none. */
const char *origins_name(const origins *o, uint32_t id);
/* Forget id's name; the id is free for the next new name. No-op for an id
 * not held. */
void origins_release(origins *o, uint32_t id);

/* Names held. */
uint32_t origins_count(const origins *o);
/* Table slots visited by lookups so far: the work they did (tests). */
uint64_t origins_probes(const origins *o);
/* Heap bytes held. */
size_t origins_mem_bytes(const origins *o);

#endif
