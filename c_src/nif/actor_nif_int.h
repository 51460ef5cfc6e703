/* actor_nif_int: what the parts of the snapshot reader share (actor_nif.c
 * says which part is where and the rule they keep): the mapping, the
 * atoms, each part's calls into the others. Internal to actor_nif.so. */
#ifndef ACTOR_NIF_INT_H
#define ACTOR_NIF_INT_H

#include <stdatomic.h>
#include <stdint.h>

#include <erl_nif.h>

#include "ap_shm.h"

#define NAME_MAX_LEN 255u

struct mapping {
	const unsigned char *base;
	size_t len;
	uint64_t id;             /* never reused while the library is loaded; 0 is no mapping */
	struct mapping *next;    /* the retired list, oldest first */
	int has_region;          /* base..len still mapped by us (shared, or zero pages once retired) */
	uint64_t retired_ms;     /* CLOCK_MONOTONIC */
	size_t path_len, node_len;
	char path[NAME_MAX_LEN + 1];
	char node[sizeof ((struct ap_shm_hdr *)0)->node];
};

/* The atoms the NIFs answer with, made at load (actor_nif.c). */
#define NIF_ATOMS(X)                                                                                             \
	X(ok) X(error) X(true) X(false) X(unmapped) X(stale) X(busy) X(bad_segment) X(too_big) X(enoent)         \
	X(eacces) X(wrong_node) X(too_small) X(errno) X(enomem) X(not_ours) X(not_a_snapshot) X(replaced)        \
	X(mapped) X(path) X(node) X(gen) X(state) X(live) X(closed) X(unknown) X(writer_pid) X(incarnation)      \
	X(heartbeat_ms) X(retired)
#define NIF_ATOM_DECL(name) extern ERL_NIF_TERM a_##name;
NIF_ATOMS(NIF_ATOM_DECL)
#undef NIF_ATOM_DECL

/* The current mapping (actor_nif.c): swapped under a mutex, loaded by
 * readers with acquire. */
extern _Atomic(struct mapping *) g_cur;
/* This image's instance (load): a thread's cache of another is not used. */
extern _Atomic uint64_t g_instance;

static inline ERL_NIF_TERM error_tuple(ErlNifEnv *env, ERL_NIF_TERM reason)
{
	return enif_make_tuple2(env, a_error, reason);
}

/* actor_nif_lookup.c: lookup/1 and the per-thread caches. */
ERL_NIF_TERM nif_lookup(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[]);
void free_caches(void);

#endif
