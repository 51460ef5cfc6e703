/* registry_report: what the registry tells: a key's value and listing
 * (encoded as ei would), sent to subscribers and to the snapshot hook, at
 * once or, while deferring, once per key at the flush (see registry.c). */
#include "registry_int.h"

#include "ap_buf.h"

#include <errno.h>

/* ---- encoding ---------------------------------------------------------------- */

int scratch_reserve(registry *r, size_t list)
{
	size_t before = r->bufcap;
	if (ap_grow(&r->buf, &r->bufcap, LIST_AT + list, 4096, SIZE_MAX))
		return -1;
	r->mem += r->bufcap - before;
	return 0;
}

/* k's value (131 + list) into the scratch buffer; k may be NULL (unknown key). */
int encode_value(registry *r, struct rkey *k, const uint8_t **val, size_t *vlen)
{
	size_t ls = k ? list_size(k->nrefs, k->vsize) : 1;
	if (scratch_reserve(r, ls))
		return -ENOMEM;
	uint8_t *p = r->buf + LIST_AT;
	if (k && k->nrefs) {
		const struct rref *v = refs_of(k);
		*p++ = 108; /* LIST_EXT */
		put32be(p, k->nrefs);
		p += 4;
		for (uint32_t i = 0; i < k->nrefs; i++) {
			const struct rnode *nd = NODE(r, ref_node(r, &v[i]));
			memcpy(p, nd->data, nd->plen);
			p += nd->plen;
			put32be(p, v[i].num);
			put32be(p + 4, v[i].serial);
			put32be(p + 8, v[i].creation);
			p += PID_SUFFIX;
		}
	}
	*p = 106; /* NIL_EXT */
	r->buf[LIST_AT - 1] = 131;
	*val = r->buf + LIST_AT - 1;
	*vlen = ls + 1;
	return 0;
}

/* The message head in front of the list encode_value left (overwriting its
 * 131): {listing, {service_key, <<Key>>}, List}. */
void encode_head(registry *r, const void *key, size_t klen, size_t vlen, const uint8_t **msg, size_t *mlen)
{
	uint8_t *p = r->buf + LIST_AT - HEAD_LEN(klen);
	*msg = p;
	*mlen = HEAD_LEN(klen) + vlen - 1;
	static const uint8_t h1[] = { 131, 104, 3, 119, 7, 'l', 'i', 's', 't', 'i', 'n', 'g', 104, 2, 119, 11,
				      's', 'e', 'r', 'v', 'i', 'c', 'e', '_', 'k', 'e', 'y', 109 };
	memcpy(p, h1, sizeof h1);
	p += sizeof h1;
	put32be(p, (uint32_t)klen);
	memcpy(p + 4, key, klen);
}

void send_to(registry *r, const struct rsub *s, const struct rkey *k, const uint8_t *msg, size_t mlen)
{
	const struct rnode *nd = NODE(r, s->node);
	memcpy(r->to.node, NODE_NAME(nd), nd->nlen + 1);
	r->to.num = s->num;
	r->to.serial = s->serial;
	r->to.creation = s->creation;
	r->listings++;
	if (r->ops.on_listing)
		r->ops.on_listing(r->arg, &r->to, k->key, k->klen, msg, mlen);
}

/* ---- deferred reports (registry_defer) ---------------------------------------- */

static struct lref lref_of(const registry *r, const struct rref *x)
{
	return (struct lref){ NODE(r, GROUP(r, x->grp)->node)->hash, x->num, x->serial, x->creation, 0 };
}

/* Before k's refs change: while deferring, the first time, note them and
 * mark k dirty, so that changed() leaves the report to the flush. Only for
 * keys without subscribers: a subscriber gets a listing per change. If
 * that takes memory there is none of, k is left clean and reported at
 * once. */
void pre_change(registry *r, struct rkey *k)
{
	if (!r->defer || k->dirty || k->subs || !r->ops.on_change)
		return;
	if (r->ndirty == r->capdirty) {
		size_t cap = r->capdirty ? r->capdirty * 2 : 64;
		struct dirty *grown = realloc(r->dirty, cap * sizeof *grown);
		if (!grown)
			return;
		r->dirty = grown;
		r->capdirty = cap;
	}
	struct dirty *d = &r->dirty[r->ndirty++];
	*d = (struct dirty){ k, k->nrefs, NULL };
	if (k->nrefs) {
		d->was = malloc((size_t)k->nrefs * sizeof *d->was);
		if (d->was) {
			const struct rref *v = refs_of(k);
			for (uint32_t i = 0; i < k->nrefs; i++)
				d->was[i] = lref_of(r, &v[i]);
		} else {
			d->n0 = UINT32_MAX; /* unknown: report it whatever it is */
		}
	}
	k->dirty = 1;
}

/* Whether k's listing differs from the one it had when first changed. */
static int listing_changed(const registry *r, const struct dirty *d)
{
	struct rkey *k = d->k;
	if (d->n0 == UINT32_MAX || d->n0 != k->nrefs)
		return 1;
	const struct rref *v = refs_of(k);
	for (uint32_t i = 0; i < k->nrefs; i++) {
		struct lref now = lref_of(r, &v[i]);
		if (memcmp(&now, &d->was[i], sizeof now))
			return 1;
	}
	return 0;
}

/* k's refs changed: the snapshot hook, then every subscriber. */
void changed(registry *r, struct rkey *k)
{
	const uint8_t *val, *msg;
	size_t vlen, mlen;
	if (k->dirty)
		return; /* deferred: reported at the flush */
	/* Reported now: the deferred ones first, so that whoever gets this
	 * listing finds every earlier change in the snapshot. */
	if (r->ndirty && (r->ops.on_change || k->subs))
		registry_flush(r);
	if (!r->ops.on_change && !k->subs)
		return;
	if (encode_value(r, k, &val, &vlen)) {
		if (r->ops.on_change)
			r->ops.on_change(r->arg, k->key, k->klen, NULL, 0, k->nrefs);
		return;
	}
	if (r->ops.on_change)
		r->ops.on_change(r->arg, k->key, k->klen, val, vlen, k->nrefs);
	if (!k->subs)
		return;
	encode_head(r, k->key, k->klen, vlen, &msg, &mlen);
	for (const struct rsubn *sn = k->subs; sn; sn = sn->knext)
		send_to(r, sn->s, k, msg, mlen);
}

void registry_defer(registry *r, int on)
{
	if (!on)
		registry_flush(r);
	r->defer = on;
}

int registry_deferring(const registry *r)
{
	return r->defer;
}

void registry_flush(registry *r)
{
	int was_deferring = r->defer;
	r->defer = 0;
	/* Taken off first: changed() below must not flush again. Callbacks do
	 * not call back in and deferring is off, so nothing is added. */
	size_t n = r->ndirty;
	r->ndirty = 0;
	for (size_t i = 0; i < n; i++) {
		struct dirty *d = &r->dirty[i];
		struct rkey *k = d->k;
		int report = listing_changed(r, d);
		free(d->was);
		k->dirty = 0;
		if (report)
			changed(r, k);
		key_gc(r, k);
	}
	r->defer = was_deferring;
}
