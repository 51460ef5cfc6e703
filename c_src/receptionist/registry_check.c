/* registry_check: the registry's invariants, all of them at once (tests
 * call it after every step). */
#include "registry_int.h"

#include <stdio.h>

/* ---- invariants ------------------------------------------------------------------ */

#define CHECK(cond, ...)                                                                           \
	do {                                                                                       \
		if (!(cond)) {                                                                     \
			snprintf(why, cap, __VA_ARGS__);                                           \
			rc = -1;                                                                   \
			goto done;                                                                 \
		}                                                                                  \
	} while (0)

int registry_check(const registry *r, char *why, size_t cap)
{
	int rc = 0;
	uint64_t *gcount = calloc(r->groups.n + 1, sizeof *gcount); /* refs per group, whole registry */
	uint32_t *kcount = calloc(r->groups.n + 1, sizeof *kcount); /* refs per group, one key */
	uint64_t *nrefs = calloc(r->nodes.n + 1, sizeof *nrefs);    /* expected node refcounts */
	uint64_t keys = 0, refs = 0, subns = 0;
	snprintf(why, cap, "ok");
	CHECK(gcount && kcount && nrefs, "out of memory");
	CHECK(ptab_count(&r->keys) == r->keys.n, "key table count");
	CHECK(ptab_count(&r->subs) == r->subs.n, "subscriber table count");
	CHECK(ptab_count(&r->subns) == r->subns.n, "subscription table count");
	CHECK(ptab_count(&r->node_tab) == r->node_tab.n, "node table count");
	CHECK(ptab_count(&r->group_tab) == r->group_tab.n, "group table count");
	for (size_t i = 0; i < r->keys.cap; i++) {
		struct rkey *k = r->keys.s[i].e;
		if (!k)
			continue;
		CHECK(k->klen >= 1 && k->klen <= REGISTRY_MAX_KEY, "key length %u", k->klen);
		CHECK(ptab_hit(&r->keys.s[i], key_hash(r, k->key, k->klen)), "key hash");
		CHECK(key_find(r, k->key, k->klen, key_hash(r, k->key, k->klen)) == k, "key not findable");
		CHECK(k->nrefs || k->subs, "empty key kept");
		CHECK(k->cap >= 1 && !(k->cap & (k->cap - 1)) && k->nrefs <= k->cap, "key cap %u nrefs %u", k->cap,
		      k->nrefs);
		CHECK(k->cap == 1 || k->nrefs > k->cap / 8, "key cap %u too big for %u refs", k->cap, k->nrefs);
		keys += k->nrefs > 0;
		refs += k->nrefs;
		struct rref *v = refs_of(k);
		size_t vsize = 0;
		for (uint32_t j = 0; j < k->nrefs; j++) {
			CHECK(v[j].grp < r->groups.n && GROUP(r, v[j].grp), "ref of a dead group");
			const struct rgroup *g = GROUP(r, v[j].grp);
			CHECK(g->node < r->nodes.n && NODE(r, g->node), "group of a dead node");
			vsize += NODE(r, g->node)->plen + PID_SUFFIX;
			gcount[v[j].grp]++;
			kcount[v[j].grp]++;
			erlang_pid p;
			p.num = v[j].num;
			p.serial = v[j].serial;
			p.creation = v[j].creation;
			CHECK(ref_find(r, k, g->node, &p) == (long)j, "ref %u not found at its place (dup or index)", j);
		}
		CHECK(vsize == k->vsize, "vsize %u, refs say %zu", k->vsize, vsize);
		uint32_t *set = rset_of(k);
		if (set) {
			uint32_t used = 0;
			for (uint32_t j = 0; j < 2 * k->cap; j++) {
				CHECK(set[j] <= k->nrefs, "set entry out of range");
				used += set[j] != 0;
			}
			CHECK(used == k->nrefs, "set holds %u of %u refs", used, k->nrefs);
		}
		for (uint32_t j = 0; j < k->nrefs; j++) {
			uint32_t gid = v[j].grp;
			if (!kcount[gid])
				continue; /* already checked */
			const struct pslot *s = kset_find(r, GROUP(r, gid), k);
			CHECK(s && s->v == kcount[gid], "group %u counts %u refs in a key, it has %u", gid, s ? s->v : 0,
			      kcount[gid]);
			kcount[gid] = 0;
		}
		uint32_t nsub = 0;
		for (const struct rsubn *sn = k->subs; sn; sn = sn->knext, nsub++) {
			CHECK(sn->k == k, "subscription in the wrong key list");
			CHECK(!sn->knext || sn->knext->kprev == sn, "key list links");
			CHECK(ptab_has(&r->subns, sn->hash, sn), "subscription not in its table");
			CHECK(subn_find(r, k, sn->s) == sn, "subscription not findable");
			CHECK(nsub <= r->subns.n, "key list loops");
		}
		subns += nsub;
	}
	CHECK(keys == r->nkeys, "nkeys %llu, counted %llu", (unsigned long long)r->nkeys, (unsigned long long)keys);
	CHECK(refs == r->nrefs, "nrefs %llu, counted %llu", (unsigned long long)r->nrefs, (unsigned long long)refs);
	CHECK(subns == r->nsubscriptions && subns == r->subns.n, "subscriptions: %llu counted, %llu, %zu",
	      (unsigned long long)subns, (unsigned long long)r->nsubscriptions, r->subns.n);
	size_t ngroups = 0;
	for (uint32_t id = 0; id < r->groups.n; id++) {
		const struct rgroup *g = GROUP(r, id);
		if (!g)
			continue;
		ngroups++;
		CHECK(g->id == id && ptab_has(&r->group_tab, g->hash, g), "group %u indexing", id);
		CHECK(!g->draining, "group %u left draining", id);
		CHECK(g->nrefs && g->nrefs == gcount[id], "group %u: %llu refs, counted %llu", id,
		      (unsigned long long)g->nrefs, (unsigned long long)gcount[id]);
		uint64_t inks = 0, kn = 0;
		for (size_t j = 0; j < g->kset.cap; j++) {
			const struct rkey *k = g->kset.s[j].e;
			if (!k)
				continue;
			CHECK(ptab_has(&r->keys, key_hash(r, k->key, k->klen), k), "group %u names a dead key", id);
			CHECK(ptab_has(&g->kset, ptr_hash(r, k), k), "group %u: a key out of place", id);
			inks += g->kset.s[j].v;
			kn++;
		}
		CHECK(kn == g->kset.n && inks == g->nrefs, "group %u key set: %llu keys (%zu), %llu refs", id,
		      (unsigned long long)kn, g->kset.n, (unsigned long long)inks);
		CHECK(g->node < r->nodes.n && NODE(r, g->node), "group %u of a dead node", id);
		nrefs[g->node]++;
	}
	CHECK(ngroups == r->group_tab.n, "groups: %zu by id, %zu by pair", ngroups, r->group_tab.n);
	/* Each group in its origin's list once, each list of that origin's
	 * groups only, and no origin without a group. */
	CHECK(ptab_count(&r->orig_tab) == r->orig_tab.n, "origin table count");
	size_t listed = 0;
	for (size_t i = 0; i < r->orig_tab.cap; i++) {
		const struct rorig *o = r->orig_tab.s[i].e;
		if (!o)
			continue;
		CHECK(o->head != NO_GROUP && ptab_has(&r->orig_tab, o->hash, o) && orig_find(r, o->origin) == o,
		      "origin %u: empty or badly indexed", o->origin);
		uint32_t prev = NO_GROUP;
		for (uint32_t id = o->head; id != NO_GROUP; id = GROUP(r, id)->onext) {
			CHECK(id < r->groups.n && GROUP(r, id), "origin %u lists a dead group", o->origin);
			CHECK(GROUP(r, id)->origin == o->origin && GROUP(r, id)->oprev == prev,
			      "origin %u: group %u misplaced or badly linked", o->origin, id);
			CHECK(++listed <= ngroups, "origin lists too long");
			prev = id;
		}
	}
	CHECK(listed == ngroups, "origin lists hold %zu of %zu groups", listed, ngroups);
	uint64_t subns2 = 0;
	for (size_t i = 0; i < r->subs.cap; i++) {
		const struct rsub *s = r->subs.s[i].e;
		if (!s)
			continue;
		CHECK(s->keys, "subscriber without subscriptions kept");
		CHECK(s->node < r->nodes.n && NODE(r, s->node), "subscriber on a dead node");
		nrefs[s->node]++;
		for (const struct rsubn *sn = s->keys; sn; sn = sn->snext) {
			CHECK(sn->s == s && (!sn->snext || sn->snext->sprev == sn), "subscriber list links");
			CHECK(++subns2 <= r->subns.n, "subscriber lists too long");
		}
	}
	CHECK(subns2 == r->subns.n, "subscriber lists hold %llu of %zu", (unsigned long long)subns2, r->subns.n);
	size_t nnodes = 0;
	for (uint32_t id = 0; id < r->nodes.n; id++) {
		const struct rnode *nd = NODE(r, id);
		if (!nd)
			continue;
		nnodes++;
		CHECK(nd->id == id && ptab_has(&r->node_tab, nd->hash, nd), "node %u indexing", id);
		CHECK(nd->refs && nd->refs == nrefs[id], "node %u: refs %u, counted %llu", id, nd->refs,
		      (unsigned long long)nrefs[id]);
	}
	CHECK(nnodes == r->node_tab.n, "nodes: %zu by id, %zu by name", nnodes, r->node_tab.n);
done:
	free(gcount);
	free(kcount);
	free(nrefs);
	return rc;
}
