/* test_registry: the receptionist's registry core: order, idempotency,
 * listings only on change, subscriptions, drops by origin and node, and a
 * snapshot (a real ap_shm writer over memory) that always equals it; its
 * interned origin names (origins.c) and its tables (ptab.c). */
#include "t_helpers.h"

#include "ap_shm.h"
#include "origins.h"
#include "ptab.h"
#include "registry.h"

/* ---- what the callbacks saw ----------------------------------------------- */

#define T_MAX_LISTINGS 4096

struct t_listing {
	erlang_pid to;
	char key[64];
	int nrefs;
	erlang_pid refs[8]; /* the first ones */
};

struct t_rec {
	uint64_t changes;          /* on_change calls */
	char last_key[REGISTRY_MAX_KEY + 1];
	uint8_t *last_val;         /* a copy of the last value */
	size_t last_vlen, last_nrefs;
	struct t_listing *listings; /* the first T_MAX_LISTINGS */
	size_t nlistings;
	ap_shm_writer *w;          /* when set, on_change writes it */
	int put_errors;
	/* When set: the last value reported for each key "key/<i>", i < nvals;
	 * every listing must carry that key's last value. */
	uint8_t **vals;
	size_t *vlens;
	unsigned nvals;
};

static int t_key_index(const struct t_rec *rec, const uint8_t *key, size_t klen)
{
	char kb[32];
	unsigned i;
	if (!rec->vals || klen >= sizeof kb)
		return -1;
	memcpy(kb, key, klen);
	kb[klen] = 0;
	if (sscanf(kb, "key/%u", &i) != 1 || i >= rec->nvals)
		return -1;
	return (int)i;
}

/* Decode a list of pids (no version byte) at b[*i]. */
static int t_decode_pids(const char *b, int *i, erlang_pid *out, int cap)
{
	int n, type, size;
	if (ei_get_type(b, i, &type, &size))
		return -1;
	if (type == ERL_NIL_EXT) {
		ei_decode_list_header(b, i, &n);
		return 0;
	}
	if (ei_decode_list_header(b, i, &n))
		return -1;
	for (int k = 0; k < n; k++) {
		erlang_pid p;
		if (ei_decode_pid(b, i, &p))
			return -1;
		if (k < cap)
			out[k] = p;
	}
	if (ei_decode_list_header(b, i, &type) || type != 0)
		return -1;
	return n;
}

static void t_on_change(void *arg, const uint8_t *key, size_t klen, const uint8_t *val, size_t vlen, size_t nrefs)
{
	struct t_rec *rec = arg;
	assert_non_null(val);
	rec->changes++;
	memcpy(rec->last_key, key, klen);
	rec->last_key[klen] = 0;
	free(rec->last_val);
	rec->last_val = t_dup(val, vlen);
	rec->last_vlen = vlen;
	rec->last_nrefs = nrefs;
	if (rec->w) {
		int rc = ap_shm_put(rec->w, key, klen, val, nrefs ? vlen : 0);
		if (rc)
			rec->put_errors++;
	}
	int ki = t_key_index(rec, key, klen);
	if (ki >= 0) {
		free(rec->vals[ki]);
		rec->vals[ki] = t_dup(val, vlen);
		rec->vlens[ki] = vlen;
	}
}

static void t_on_listing(void *arg, const erlang_pid *to, const uint8_t *key, size_t klen, const uint8_t *msg,
			 size_t mlen)
{
	struct t_rec *rec = arg;
	const char *b = (const char *)msg;
	int i = 0, v, arity;
	char atom[MAXATOMLEN_UTF8];
	assert_int_equal(ei_decode_version(b, &i, &v), 0);
	assert_int_equal(ei_decode_tuple_header(b, &i, &arity), 0);
	assert_int_equal(arity, 3);
	assert_int_equal(ei_decode_atom(b, &i, atom), 0);
	assert_string_equal(atom, "listing");
	assert_int_equal(ei_decode_tuple_header(b, &i, &arity), 0);
	assert_int_equal(arity, 2);
	assert_int_equal(ei_decode_atom(b, &i, atom), 0);
	assert_string_equal(atom, "service_key");
	char kb[REGISTRY_MAX_KEY + 1];
	long kl;
	assert_int_equal(ei_decode_binary(b, &i, kb, &kl), 0);
	assert_int_equal((size_t)kl, klen);
	assert_memory_equal(kb, key, klen);
	erlang_pid refs[8];
	int n = t_decode_pids(b, &i, refs, 8);
	assert_true(n >= 0);
	assert_int_equal((size_t)i, mlen);
	int ki = t_key_index(rec, key, klen);
	if (ki >= 0) {
		/* The list in the message is the key's value as last reported
		 * (or empty if it never had refs). */
		size_t ll = rec->vals[ki] ? rec->vlens[ki] - 1 : 1;
		const uint8_t *want = rec->vals[ki] ? rec->vals[ki] + 1 : (const uint8_t *)"j";
		assert_true(mlen >= ll);
		assert_memory_equal(msg + mlen - ll, want, ll);
	}
	if (rec->nlistings < T_MAX_LISTINGS) {
		if (!rec->listings)
			rec->listings = calloc(T_MAX_LISTINGS, sizeof *rec->listings);
		struct t_listing *l = &rec->listings[rec->nlistings];
		l->to = *to;
		snprintf(l->key, sizeof l->key, "%.*s", (int)klen, (const char *)key);
		l->nrefs = n;
		memcpy(l->refs, refs, sizeof(erlang_pid) * (size_t)(n < 8 ? n : 8));
	}
	rec->nlistings++;
}

static const registry_ops t_ops = { .on_change = t_on_change, .on_listing = t_on_listing };

static void t_rec_free(struct t_rec *rec)
{
	free(rec->last_val);
	free(rec->listings);
}

static void t_check(const registry *r)
{
	char why[256];
	if (registry_check(r, why, sizeof why))
		fail_msg("registry invariant broken: %s", why);
}

#define K(s) (s), strlen(s)

static erlang_pid P(unsigned num) { return t_pid("app@host", num, 0, 7); }

/* The refs under key, decoded from registry_value. */
static int t_refs(registry *r, const char *key, erlang_pid *out, int cap)
{
	const uint8_t *val;
	size_t vlen;
	assert_int_equal(registry_value(r, K(key), &val, &vlen), 0);
	int i = 0, v;
	assert_int_equal(ei_decode_version((const char *)val, &i, &v), 0);
	int n = t_decode_pids((const char *)val, &i, out, cap);
	assert_true(n >= 0);
	assert_int_equal((size_t)i, vlen);
	return n;
}

static void t_assert_refs(registry *r, const char *key, const erlang_pid *want, int n)
{
	erlang_pid got[64];
	assert_true(n <= 64);
	assert_int_equal(t_refs(r, key, got, 64), n);
	for (int i = 0; i < n; i++)
		t_assert_pid_eq(got[i], want[i]);
	assert_int_equal(registry_count(r, K(key)), (size_t)n);
}

/* ---- basics ------------------------------------------------------------------ */

static void test_register_lists_refs_in_registration_order(void **state)
{
	(void)state;
	struct t_rec rec = { 0 };
	registry *r = registry_new(&t_ops, &rec, 0);
	assert_non_null(r);
	erlang_pid a = P(1), b = t_pid("other@host", 2, 1, 9), c = P(3);
	assert_int_equal(registry_register(r, K("svc"), &a, REGISTRY_ORIGIN_LOCAL), 1);
	assert_int_equal(registry_register(r, K("svc"), &b, REGISTRY_ORIGIN_LOCAL), 1);
	assert_int_equal(registry_register(r, K("svc"), &c, REGISTRY_ORIGIN_LOCAL), 1);
	erlang_pid want[] = { a, b, c };
	t_assert_refs(r, "svc", want, 3);
	assert_int_equal(rec.changes, 3);
	assert_string_equal(rec.last_key, "svc");
	assert_int_equal(rec.last_nrefs, 3);
	/* The last on_change value is the current value. */
	const uint8_t *val;
	size_t vlen;
	assert_int_equal(registry_value(r, K("svc"), &val, &vlen), 0);
	assert_int_equal(vlen, rec.last_vlen);
	assert_memory_equal(val, rec.last_val, vlen);
	/* Unknown keys are empty lists. */
	assert_int_equal(registry_value(r, K("nope"), &val, &vlen), 0);
	assert_int_equal(vlen, 2);
	assert_int_equal(val[0], 131);
	assert_int_equal(val[1], 106);
	assert_int_equal(registry_count(r, K("nope")), 0);
	registry_stats st;
	registry_get_stats(r, &st);
	assert_int_equal(st.keys, 1);
	assert_int_equal(st.refs, 3);
	assert_int_equal(st.nodes, 2);
	t_check(r);
	registry_free(r);
	t_rec_free(&rec);
}

/* Bytes as ei writes them: the snapshot's readers binary_to_term them, and
 * equal pids must be equal bytes. */
static void test_values_and_listings_are_what_ei_encodes(void **state)
{
	(void)state;
	registry *r = registry_new(NULL, NULL, 0);
	erlang_pid p[4] = { t_pid("app@host", 1, 0, 1),
			    t_pid("a_much_longer_node_name@some.host.example", 0x7fff, 0x1fff, 0xFFFFFFFF),
			    t_pid("x@y", 0xFFFFFFFF, 0xFFFFFFFF, 0), t_pid("app@host", 5, 6, 7) };
	ei_x_buff x;
	ei_x_new_with_version(&x);
	ei_x_encode_list_header(&x, 4);
	for (int i = 0; i < 4; i++) {
		assert_int_equal(registry_register(r, K("k"), &p[i], 0), 1);
		ei_x_encode_pid(&x, &p[i]);
	}
	ei_x_encode_empty_list(&x);
	const uint8_t *val, *msg;
	size_t vlen, mlen;
	assert_int_equal(registry_value(r, K("k"), &val, &vlen), 0);
	assert_int_equal(vlen, (size_t)x.index);
	assert_memory_equal(val, x.buff, vlen);

	ei_x_buff m;
	ei_x_new_with_version(&m);
	ei_x_encode_tuple_header(&m, 3);
	ei_x_encode_atom(&m, "listing");
	ei_x_encode_tuple_header(&m, 2);
	ei_x_encode_atom(&m, "service_key");
	ei_x_encode_binary(&m, "k", 1);
	ei_x_append_buf(&m, x.buff + 1, x.index - 1);
	assert_int_equal(registry_listing(r, K("k"), &msg, &mlen), 0);
	assert_int_equal(mlen, (size_t)m.index);
	assert_memory_equal(msg, m.buff, mlen);
	ei_x_free(&x);
	ei_x_free(&m);

	/* An empty listing, for an unknown key of the maximum length. */
	char big[REGISTRY_MAX_KEY];
	memset(big, 'z', sizeof big);
	ei_x_new_with_version(&m);
	ei_x_encode_tuple_header(&m, 3);
	ei_x_encode_atom(&m, "listing");
	ei_x_encode_tuple_header(&m, 2);
	ei_x_encode_atom(&m, "service_key");
	ei_x_encode_binary(&m, big, sizeof big);
	ei_x_encode_empty_list(&m);
	assert_int_equal(registry_listing(r, big, sizeof big, &msg, &mlen), 0);
	assert_int_equal(mlen, (size_t)m.index);
	assert_memory_equal(msg, m.buff, mlen);
	ei_x_free(&m);
	registry_free(r);
}

static void test_registering_twice_changes_nothing_and_reports_nothing(void **state)
{
	(void)state;
	struct t_rec rec = { 0 };
	registry *r = registry_new(&t_ops, &rec, 0);
	erlang_pid a = P(1), b = P(2), s = P(100);
	assert_int_equal(registry_subscribe(r, K("svc"), &s), 1);
	assert_int_equal(rec.nlistings, 1);
	assert_int_equal(registry_register(r, K("svc"), &a, 0), 1);
	assert_int_equal(registry_register(r, K("svc"), &b, 0), 1);
	uint64_t changes = rec.changes;
	size_t listings = rec.nlistings;
	assert_int_equal(registry_register(r, K("svc"), &a, 0), 0);
	assert_int_equal(registry_register(r, K("svc"), &b, 0), 0);
	/* The same pid through another origin is the same ref. */
	assert_int_equal(registry_register(r, K("svc"), &a, 3), 0);
	/* Equal pids are equal even when built separately. */
	erlang_pid a2 = t_pid("app@host", 1, 0, 7);
	assert_int_equal(registry_register(r, K("svc"), &a2, 0), 0);
	assert_int_equal(rec.changes, changes);
	assert_int_equal(rec.nlistings, listings);
	erlang_pid want[] = { a, b };
	t_assert_refs(r, "svc", want, 2);
	/* Pids differing in one field are different refs. */
	erlang_pid d1 = t_pid("app@host", 1, 1, 7), d2 = t_pid("app@host", 1, 0, 8), d3 = t_pid("app@hosu", 1, 0, 7);
	assert_int_equal(registry_register(r, K("svc"), &d1, 0), 1);
	assert_int_equal(registry_register(r, K("svc"), &d2, 0), 1);
	assert_int_equal(registry_register(r, K("svc"), &d3, 0), 1);
	assert_int_equal(registry_count(r, K("svc")), 5);
	registry_stats st;
	registry_get_stats(r, &st);
	assert_int_equal(st.groups, 2); /* app@host and app@hosu, origin 0; origin 3 left nothing */
	t_check(r);
	registry_free(r);
	t_rec_free(&rec);
}

static void test_deregister_removes_one_ref_and_keeps_the_order(void **state)
{
	(void)state;
	struct t_rec rec = { 0 };
	registry *r = registry_new(&t_ops, &rec, 0);
	erlang_pid p[5];
	for (int i = 0; i < 5; i++) {
		p[i] = P((unsigned)i + 1);
		assert_int_equal(registry_register(r, K("svc"), &p[i], 0), 1);
	}
	assert_int_equal(registry_deregister(r, K("svc"), &p[2]), 1);
	erlang_pid want[] = { p[0], p[1], p[3], p[4] };
	t_assert_refs(r, "svc", want, 4);
	uint64_t changes = rec.changes;
	/* Absent: a ref never there, a removed one, an unknown key, an unknown node. */
	erlang_pid stranger = t_pid("nobody@nowhere", 1, 0, 7);
	assert_int_equal(registry_deregister(r, K("svc"), &p[2]), 0);
	assert_int_equal(registry_deregister(r, K("other"), &p[0]), 0);
	assert_int_equal(registry_deregister(r, K("svc"), &stranger), 0);
	assert_int_equal(rec.changes, changes);
	/* Down to empty: the last change says so, and the key is gone. */
	for (int i = 0; i < 5; i++)
		if (i != 2)
			assert_int_equal(registry_deregister(r, K("svc"), &p[i]), 1);
	assert_int_equal(rec.last_nrefs, 0);
	assert_int_equal(rec.last_vlen, 2);
	assert_int_equal(rec.last_val[1], 106);
	registry_stats st;
	registry_get_stats(r, &st);
	assert_int_equal(st.keys, 0);
	assert_int_equal(st.entries, 0);
	assert_int_equal(st.refs, 0);
	assert_int_equal(st.nodes, 0);
	assert_int_equal(st.groups, 0);
	t_check(r);
	registry_free(r);
	t_rec_free(&rec);
}

static void test_bad_keys_are_refused(void **state)
{
	(void)state;
	struct t_rec rec = { 0 };
	registry *r = registry_new(&t_ops, &rec, 0);
	erlang_pid a = P(1);
	char big[REGISTRY_MAX_KEY + 1];
	memset(big, 'k', sizeof big);
	assert_int_equal(registry_register(r, "", 0, &a, 0), -EINVAL);
	assert_int_equal(registry_register(r, big, sizeof big, &a, 0), -EINVAL);
	assert_int_equal(registry_deregister(r, big, sizeof big, &a), -EINVAL);
	assert_int_equal(registry_subscribe(r, big, sizeof big, &a), -EINVAL);
	assert_int_equal(registry_unsubscribe(r, "", 0, &a), -EINVAL);
	assert_int_equal(registry_register(r, big, REGISTRY_MAX_KEY, &a, 0), 1);
	assert_int_equal(rec.changes, 1);
	assert_int_equal(rec.nlistings, 0);
	t_check(r);
	registry_free(r);
	t_rec_free(&rec);
}

/* A key whose listing would outgrow the cap refuses more refs. */
static void test_listing_over_the_value_cap_is_refused(void **state)
{
	(void)state;
	struct t_rec rec = { 0 };
	/* Each app@host pid is 23 bytes; 131 + list header + nil = 7. */
	registry *r = registry_new(&t_ops, &rec, 7 + 4 * 23);
	for (unsigned i = 1; i <= 4; i++) {
		erlang_pid p = P(i);
		assert_int_equal(registry_register(r, K("svc"), &p, 0), 1);
	}
	erlang_pid p5 = P(5), p1 = P(1);
	uint64_t changes = rec.changes;
	assert_int_equal(registry_register(r, K("svc"), &p5, 0), -E2BIG);
	assert_int_equal(registry_register(r, K("svc"), &p1, 0), 0); /* idempotent still fine */
	assert_int_equal(rec.changes, changes);
	assert_int_equal(registry_count(r, K("svc")), 4);
	assert_int_equal(rec.last_vlen, 7 + 4 * 23);
	/* Room again after a deregister. */
	assert_int_equal(registry_deregister(r, K("svc"), &p1), 1);
	assert_int_equal(registry_register(r, K("svc"), &p5, 0), 1);
	/* Refused on a new key too, and that key is not left behind. */
	registry *tiny = registry_new(NULL, NULL, 10);
	assert_int_equal(registry_register(tiny, K("x"), &p1, 0), -E2BIG);
	registry_stats st;
	registry_get_stats(tiny, &st);
	assert_int_equal(st.entries, 0);
	assert_int_equal(st.nodes, 0);
	t_check(tiny);
	registry_free(tiny);
	t_check(r);
	registry_free(r);
	t_rec_free(&rec);
}

/* ---- subscriptions -------------------------------------------------------------- */

static void test_subscribers_get_a_listing_now_and_on_every_change_only(void **state)
{
	(void)state;
	struct t_rec rec = { 0 };
	registry *r = registry_new(&t_ops, &rec, 0);
	erlang_pid s1 = t_pid("app@host", 100, 0, 7), s2 = t_pid("sub@host", 101, 0, 7), a = P(1), b = P(2);
	assert_int_equal(registry_register(r, K("svc"), &a, 0), 1);
	assert_int_equal(registry_subscribe(r, K("svc"), &s1), 1);
	assert_int_equal(rec.nlistings, 1);
	t_assert_pid_eq(rec.listings[0].to, s1);
	assert_string_equal(rec.listings[0].key, "svc");
	assert_int_equal(rec.listings[0].nrefs, 1);
	t_assert_pid_eq(rec.listings[0].refs[0], a);
	/* A subscription to a key with nothing yet: an empty listing. */
	assert_int_equal(registry_subscribe(r, K("empty"), &s2), 1);
	assert_int_equal(rec.nlistings, 2);
	assert_int_equal(rec.listings[1].nrefs, 0);
	assert_int_equal(registry_subscribe(r, K("svc"), &s2), 1);
	assert_int_equal(rec.nlistings, 3);
	/* A change: one listing per subscriber, with the new refs. */
	assert_int_equal(registry_register(r, K("svc"), &b, 0), 1);
	assert_int_equal(rec.nlistings, 5);
	int seen1 = 0, seen2 = 0;
	for (int i = 3; i < 5; i++) {
		struct t_listing *l = &rec.listings[i];
		assert_string_equal(l->key, "svc");
		assert_int_equal(l->nrefs, 2);
		t_assert_pid_eq(l->refs[0], a);
		t_assert_pid_eq(l->refs[1], b);
		seen1 += l->to.num == 100;
		seen2 += l->to.num == 101 && !strcmp(l->to.node, "sub@host");
	}
	assert_int_equal(seen1, 1);
	assert_int_equal(seen2, 1);
	/* Non-changes: nothing. */
	assert_int_equal(registry_register(r, K("svc"), &b, 0), 0);
	erlang_pid c = P(3);
	assert_int_equal(registry_deregister(r, K("svc"), &c), 0);
	assert_int_equal(rec.nlistings, 5);
	/* Other keys' changes do not reach them. */
	assert_int_equal(registry_register(r, K("unrelated"), &c, 0), 1);
	assert_int_equal(rec.nlistings, 5);
	/* Subscribing again: no second subscription, but a fresh listing. */
	assert_int_equal(registry_subscribe(r, K("svc"), &s1), 0);
	assert_int_equal(rec.nlistings, 6);
	assert_int_equal(registry_deregister(r, K("svc"), &a), 1);
	assert_int_equal(rec.nlistings, 8);
	registry_stats st;
	registry_get_stats(r, &st);
	assert_int_equal(st.subscriptions, 3);
	assert_int_equal(st.subscribers, 2);
	assert_int_equal(st.listings_sent, 8);
	t_check(r);
	registry_free(r);
	t_rec_free(&rec);
}

static void test_unsubscribe_stops_listings_and_frees_empty_keys(void **state)
{
	(void)state;
	struct t_rec rec = { 0 };
	registry *r = registry_new(&t_ops, &rec, 0);
	erlang_pid s = P(100), s2 = P(101), a = P(1);
	assert_int_equal(registry_subscribe(r, K("svc"), &s), 1);
	assert_int_equal(registry_unsubscribe(r, K("svc"), &s2), 0);
	assert_int_equal(registry_unsubscribe(r, K("other"), &s), 0);
	assert_int_equal(registry_unsubscribe(r, K("svc"), &s), 1);
	assert_int_equal(registry_unsubscribe(r, K("svc"), &s), 0);
	registry_stats st;
	registry_get_stats(r, &st);
	assert_int_equal(st.entries, 0);
	assert_int_equal(st.subscribers, 0);
	assert_int_equal(st.nodes, 0);
	size_t listings = rec.nlistings;
	assert_int_equal(registry_register(r, K("svc"), &a, 0), 1);
	assert_int_equal(rec.nlistings, listings);
	/* A key with refs stays after its last subscriber leaves. */
	assert_int_equal(registry_subscribe(r, K("svc"), &s), 1);
	assert_int_equal(registry_unsubscribe(r, K("svc"), &s), 1);
	assert_int_equal(registry_count(r, K("svc")), 1);
	t_check(r);
	registry_free(r);
	t_rec_free(&rec);
}

static void test_unsubscribe_all_removes_every_subscription_of_a_pid(void **state)
{
	(void)state;
	struct t_rec rec = { 0 };
	registry *r = registry_new(&t_ops, &rec, 0);
	erlang_pid s = P(100), other = P(101), a = P(1);
	char key[32];
	for (int i = 0; i < 100; i++) {
		snprintf(key, sizeof key, "key-%d", i);
		assert_int_equal(registry_subscribe(r, K(key), &s), 1);
		if (i % 2)
			assert_int_equal(registry_register(r, K(key), &a, 0), 1);
		if (i % 3 == 0)
			assert_int_equal(registry_subscribe(r, K(key), &other), 1);
	}
	registry_stats st;
	registry_get_stats(r, &st);
	assert_int_equal(st.subscriptions, 134);
	assert_int_equal(registry_unsubscribe_all(r, &s), 100);
	assert_int_equal(registry_unsubscribe_all(r, &s), 0);
	registry_get_stats(r, &st);
	assert_int_equal(st.subscriptions, 34);
	assert_int_equal(st.subscribers, 1);
	/* Left: keys with refs (50) and keys only `other` watches (17 even ones). */
	assert_int_equal(st.entries, 50 + 17);
	t_check(r);
	size_t listings = rec.nlistings;
	for (int i = 0; i < 100; i++) {
		snprintf(key, sizeof key, "key-%d", i);
		erlang_pid b = P(2);
		assert_int_equal(registry_register(r, K(key), &b, 0), 1);
	}
	assert_int_equal(rec.nlistings, listings + 34); /* only `other` hears */
	for (size_t i = listings; i < rec.nlistings; i++)
		assert_int_equal(rec.listings[i].to.num, 101);
	t_check(r);
	registry_free(r);
	t_rec_free(&rec);
}

/* ---- drops ------------------------------------------------------------------------- */

static void test_drop_origin_removes_its_refs_and_reports_each_key_once(void **state)
{
	(void)state;
	struct t_rec rec = { 0 };
	registry *r = registry_new(&t_ops, &rec, 0);
	erlang_pid s = t_pid("app@host", 100, 0, 7);
	char key[32];
	/* 50 keys; key i gets local refs, and refs of origin 1 (nodes b, c)
	 * and origin 2 (node d) interleaved. */
	for (int i = 0; i < 50; i++) {
		snprintf(key, sizeof key, "k%d", i);
		if (i < 10)
			assert_int_equal(registry_subscribe(r, K(key), &s), 1);
		for (unsigned j = 0; j < 6; j++) {
			erlang_pid p;
			uint32_t origin;
			switch (j % 3) {
			case 0: p = t_pid("app@host", 1000 + j, 0, 7), origin = 0; break;
			case 1: p = t_pid(j < 3 ? "b@host" : "c@host", 2000 + j, 0, 7), origin = 1; break;
			default: p = t_pid("d@host", 3000 + j, 0, 7), origin = 2; break;
			}
			if (i % 5 == 0 && origin == 1)
				continue; /* some keys have nothing of origin 1 */
			assert_int_equal(registry_register(r, K(key), &p, origin), 1);
		}
	}
	t_check(r);
	uint64_t changes = rec.changes;
	size_t listings = rec.nlistings;
	assert_int_equal(registry_drop_origin(r, 1), 40 * 2);
	assert_int_equal(rec.changes, changes + 40);
	assert_int_equal(rec.nlistings, listings + 8); /* keys 1..9 but 5 are watched */
	t_check(r);
	for (int i = 0; i < 50; i++) {
		snprintf(key, sizeof key, "k%d", i);
		erlang_pid want[] = { t_pid("app@host", 1000, 0, 7), t_pid("d@host", 3002, 0, 7),
				      t_pid("app@host", 1003, 0, 7), t_pid("d@host", 3005, 0, 7) };
		t_assert_refs(r, key, want, 4);
	}
	assert_int_equal(registry_drop_origin(r, 1), 0);
	assert_int_equal(registry_drop_origin(r, 77), 0);
	registry_stats st;
	registry_get_stats(r, &st);
	assert_int_equal(st.groups, 2);
	assert_int_equal(st.nodes, 2); /* b and c are forgotten */
	/* Dropping everything leaves the watched keys only. */
	assert_int_equal(registry_drop_origin(r, 0), 100);
	assert_int_equal(registry_drop_origin(r, 2), 100);
	registry_get_stats(r, &st);
	assert_int_equal(st.refs, 0);
	assert_int_equal(st.keys, 0);
	assert_int_equal(st.entries, 10);
	t_check(r);
	registry_free(r);
	t_rec_free(&rec);
}

/* The cluster layer moves a ref held by two origins to the one that still
 * holds it: no report, order kept, and the next drop_origin follows the new
 * tag. */
static void test_set_origin_moves_a_ref_to_another_origin_silently(void **state)
{
	(void)state;
	struct t_rec rec = { 0 };
	registry *r = registry_new(&t_ops, &rec, 0);
	erlang_pid s = t_pid("app@host", 100, 0, 7);
	erlang_pid a = t_pid("b@host", 1, 0, 7), b = t_pid("b@host", 2, 0, 7), c = P(3);
	assert_int_equal(registry_subscribe(r, K("k"), &s), 1);
	assert_int_equal(registry_register(r, K("k"), &a, 1), 1);
	assert_int_equal(registry_register(r, K("k"), &b, 1), 1);
	assert_int_equal(registry_register(r, K("k"), &c, 0), 1);
	assert_int_equal(registry_register(r, K("other"), &a, 1), 1);
	uint64_t changes = rec.changes;
	size_t listings = rec.nlistings;
	/* a under k: origin 1 -> 2; the same origin again is a no-op. */
	assert_int_equal(registry_set_origin(r, K("k"), &a, 2), 1);
	assert_int_equal(registry_set_origin(r, K("k"), &a, 2), 0);
	/* Unknown key, ref or node: nothing. */
	assert_int_equal(registry_set_origin(r, K("nokey"), &a, 2), 0);
	erlang_pid stranger = t_pid("z@host", 9, 0, 7);
	assert_int_equal(registry_set_origin(r, K("k"), &stranger, 2), 0);
	assert_int_equal(registry_set_origin(r, "", 0, &a, 2), -EINVAL);
	assert_int_equal(rec.changes, changes);
	assert_int_equal(rec.nlistings, listings);
	t_check(r);
	{
		erlang_pid want[] = { a, b, c };
		t_assert_refs(r, "k", want, 3);
	}
	/* Origin 1 leaves: a stays under k (now origin 2), b goes, and a under
	 * "other" (still origin 1) goes. */
	assert_int_equal(registry_drop_origin(r, 1), 2);
	t_check(r);
	{
		erlang_pid want[] = { a, c };
		t_assert_refs(r, "k", want, 2);
	}
	assert_int_equal(registry_count(r, K("other")), 0);
	/* To the local origin and back out with origin 0. */
	assert_int_equal(registry_set_origin(r, K("k"), &a, 0), 1);
	assert_int_equal(registry_drop_origin(r, 2), 0);
	t_check(r);
	registry_stats st;
	registry_get_stats(r, &st);
	assert_int_equal(st.groups, 2); /* (0, app) and (0, b) */
	assert_int_equal(registry_drop_origin(r, 0), 2);
	registry_get_stats(r, &st);
	assert_int_equal(st.refs, 0);
	assert_int_equal(st.groups, 0);
	t_check(r);
	registry_free(r);
	t_rec_free(&rec);
}

/* ---- deferred reports ------------------------------------------------------- */

static void test_deferred_changes_are_reported_once_per_key_at_the_flush(void **state)
{
	(void)state;
	struct t_rec rec = { 0 };
	registry *r = registry_new(&t_ops, &rec, 0);
	erlang_pid s = t_pid("app@host", 100, 0, 7);
	erlang_pid a = P(1), b = P(2), c = P(3), d = P(4);
	assert_int_equal(registry_register(r, K("k"), &a, 0), 1);
	uint64_t changes = rec.changes;
	registry_defer(r, 1);
	/* Three changes to k (no subscribers): none reported yet, but the
	 * registry answers with them at once. */
	assert_int_equal(registry_register(r, K("k"), &b, 0), 1);
	assert_int_equal(registry_register(r, K("k"), &c, 1), 1);
	assert_int_equal(registry_deregister(r, K("k"), &a), 1);
	assert_int_equal(rec.changes, changes);
	{
		erlang_pid want[] = { b, c };
		t_assert_refs(r, "k", want, 2);
	}
	assert_int_equal(registry_deferring(r), 1);
	registry_flush(r);
	assert_int_equal(registry_deferring(r), 1);
	/* One report, with its refs as they are now. */
	assert_int_equal(rec.changes, changes + 1);
	assert_string_equal(rec.last_key, "k");
	assert_int_equal(rec.last_nrefs, 2);
	assert_int_equal(registry_register(r, K("j"), &d, 0), 1);
	registry_flush(r);
	assert_int_equal(rec.changes, changes + 2);
	assert_string_equal(rec.last_key, "j");
	t_check(r);
	/* Changes undone before the flush are no change: nothing reported,
	 * and a key that came and went is gone. */
	changes = rec.changes;
	assert_int_equal(registry_register(r, K("k"), &a, 0), 1);
	assert_int_equal(registry_deregister(r, K("k"), &a), 1);
	assert_int_equal(registry_deregister(r, K("k"), &b), 1);
	assert_int_equal(registry_register(r, K("k"), &b, 2), 1); /* back, but last: k is c, b */
	assert_int_equal(registry_register(r, K("new"), &d, 0), 1);
	assert_int_equal(registry_deregister(r, K("new"), &d), 1);
	registry_defer(r, 0);
	assert_int_equal(rec.changes, changes + 1);
	assert_string_equal(rec.last_key, "k");
	assert_int_equal(rec.last_nrefs, 2);
	assert_int_equal(registry_count(r, K("new")), 0);
	registry_stats st;
	registry_get_stats(r, &st);
	assert_int_equal(st.entries, 2); /* k and j */
	changes = rec.changes;
	registry_defer(r, 1);
	assert_int_equal(registry_deregister(r, K("k"), &b), 1);
	assert_int_equal(registry_register(r, K("k"), &b, 0), 1); /* the same place, another origin */
	registry_flush(r);
	assert_int_equal(rec.changes, changes);
	/* A key with a subscriber is reported at every change, and the
	 * deferred ones go first (the snapshot has them before that listing). */
	assert_int_equal(registry_subscribe(r, K("s"), &s), 1);
	size_t listings = rec.nlistings;
	assert_int_equal(registry_register(r, K("j"), &a, 0), 1);
	assert_int_equal(registry_register(r, K("s"), &a, 0), 1);
	assert_int_equal(rec.changes, changes + 2);
	assert_string_equal(rec.last_key, "s");
	assert_int_equal(registry_register(r, K("s"), &b, 0), 1);
	assert_int_equal(rec.changes, changes + 3);
	assert_int_equal(rec.nlistings, listings + 2);
	assert_int_equal(rec.listings[listings].nrefs, 1);
	assert_int_equal(rec.listings[listings + 1].nrefs, 2);
	t_check(r);
	/* Subscribing to a deferred key reports it first: the subscriber's
	 * first listing follows the snapshot, and its next changes reach it.
	 * (j holds d and a.) */
	erlang_pid s2 = t_pid("app@host", 101, 0, 7);
	changes = rec.changes;
	listings = rec.nlistings;
	assert_int_equal(registry_deregister(r, K("j"), &d), 1);
	assert_int_equal(rec.changes, changes);
	assert_int_equal(registry_subscribe(r, K("j"), &s2), 1);
	assert_int_equal(rec.changes, changes + 1);
	assert_int_equal(rec.nlistings, listings + 1);
	assert_int_equal(rec.listings[listings].nrefs, 1);
	assert_int_equal(registry_register(r, K("j"), &d, 0), 1);
	assert_int_equal(rec.nlistings, listings + 2);
	assert_int_equal(rec.listings[listings + 1].nrefs, 2);
	registry_flush(r);
	assert_int_equal(rec.nlistings, listings + 2);
	t_check(r);
	/* Freed with changes still deferred: nothing leaks (ASan). */
	assert_int_equal(registry_register(r, K("x"), &a, 0), 1);
	registry_free(r);
	t_rec_free(&rec);
}

static void test_drop_node_removes_refs_on_that_node_from_every_origin(void **state)
{
	(void)state;
	struct t_rec rec = { 0 };
	registry *r = registry_new(&t_ops, &rec, 0);
	erlang_pid s = t_pid("gone@host", 100, 0, 7); /* a subscriber on the node */
	char key[32];
	for (int i = 0; i < 30; i++) {
		snprintf(key, sizeof key, "k%d", i);
		erlang_pid a = t_pid("app@host", (unsigned)i, 0, 7), g1 = t_pid("gone@host", (unsigned)i, 0, 7),
			   g2 = t_pid("gone@host", 1000u + (unsigned)i, 0, 7);
		assert_int_equal(registry_register(r, K(key), &g1, 0), 1);
		assert_int_equal(registry_register(r, K(key), &a, 0), 1);
		if (i % 2)
			assert_int_equal(registry_register(r, K(key), &g2, 4), 1);
		assert_int_equal(registry_subscribe(r, K(key), &s), 1);
	}
	uint64_t changes = rec.changes;
	assert_int_equal(registry_drop_node(r, "gone@host"), 30 + 15);
	assert_int_equal(rec.changes, changes + 30); /* once per key, whatever the origins */
	t_check(r);
	for (int i = 0; i < 30; i++) {
		snprintf(key, sizeof key, "k%d", i);
		erlang_pid want = t_pid("app@host", (unsigned)i, 0, 7);
		t_assert_refs(r, key, &want, 1);
	}
	assert_int_equal(registry_drop_node(r, "gone@host"), 0);
	assert_int_equal(registry_drop_node(r, "never@host"), 0);
	registry_stats st;
	registry_get_stats(r, &st);
	assert_int_equal(st.groups, 1);
	assert_int_equal(st.nodes, 2); /* gone@host stays: it has a subscriber */
	assert_int_equal(registry_unsubscribe_all(r, &s), 30);
	registry_get_stats(r, &st);
	assert_int_equal(st.nodes, 1);
	t_check(r);
	registry_free(r);
	t_rec_free(&rec);
}

/* ---- scale -------------------------------------------------------------------------- */

static double t_secs(struct timespec a, struct timespec b)
{
	return (double)(b.tv_sec - a.tv_sec) + (double)(b.tv_nsec - a.tv_nsec) / 1e9;
}

static void test_100k_keys(void **state)
{
	(void)state;
	struct t_rec rec = { 0 };
	registry *r = registry_new(&t_ops, &rec, 0);
	size_t base = registry_mem_bytes(r);
	char key[32];
	enum { N = 100000 };
	struct timespec t0, t1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (unsigned i = 0; i < N; i++) {
		snprintf(key, sizeof key, "service-%u", i);
		erlang_pid p = t_pid("app@host", i, 0, 7);
		assert_int_equal(registry_register(r, K(key), &p, 0), 1);
	}
	clock_gettime(CLOCK_MONOTONIC, &t1);
	size_t mem = registry_mem_bytes(r) - base;
	print_message("[ info     ] 100K keys x 1 ref: %.0f ns/register (sanitized), %zu bytes/registration "
		      "(structures, keys ~14 bytes)\n",
		      t_secs(t0, t1) * 1e9 / N, mem / N);
	assert_true(mem / N < 200);
	registry_stats st;
	registry_get_stats(r, &st);
	assert_int_equal(st.keys, N);
	assert_int_equal(st.refs, N);
	t_check(r);
	for (unsigned i = 0; i < N; i++) {
		snprintf(key, sizeof key, "service-%u", i);
		erlang_pid p = t_pid("app@host", i, 0, 7), q = t_pid("app@host", i + 1, 0, 7);
		assert_int_equal(registry_register(r, K(key), &p, 0), 0);
		assert_int_equal(registry_count(r, K(key)), 1);
		assert_int_equal(registry_deregister(r, K(key), &q), 0);
	}
	assert_int_equal(rec.changes, N);
	/* registry_next visits each key once. */
	size_t cur = 0, n = 0;
	const uint8_t *kp, *val;
	size_t kl, vl;
	while (registry_next(r, &cur, &kp, &kl, &val, &vl) == 1) {
		assert_true(kl > 8 && !memcmp(kp, "service-", 8));
		assert_int_equal(vl, 7 + 23);
		n++;
	}
	assert_int_equal(n, N);
	for (unsigned i = 0; i < N; i++) {
		snprintf(key, sizeof key, "service-%u", i);
		erlang_pid p = t_pid("app@host", i, 0, 7);
		assert_int_equal(registry_deregister(r, K(key), &p), 1);
	}
	registry_get_stats(r, &st);
	assert_int_equal(st.entries, 0);
	/* Everything given back (tables shrink too). */
	assert_true(registry_mem_bytes(r) - base < 64 * 1024);
	t_check(r);
	registry_free(r);
	t_rec_free(&rec);
}

static void test_10k_refs_in_one_key(void **state)
{
	(void)state;
	registry *r = registry_new(NULL, NULL, 0); /* no snapshot: the listing encodes would dominate */
	enum { N = 10000 };
	struct timespec t0, t1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (unsigned i = 0; i < N; i++) {
		erlang_pid p = t_pid(i % 2 ? "app@host" : "b@host", i, 0, 7);
		assert_int_equal(registry_register(r, K("pool"), &p, 0), 1);
	}
	/* Idempotency checks do not scan: 10K more are quick. */
	for (int round = 0; round < 10; round++)
		for (unsigned i = 0; i < N; i++) {
			erlang_pid p = t_pid(i % 2 ? "app@host" : "b@host", i, 0, 7);
			assert_int_equal(registry_register(r, K("pool"), &p, 0), 0);
		}
	clock_gettime(CLOCK_MONOTONIC, &t1);
	print_message("[ info     ] 10K refs + 100K idempotent registers in one key: %.3f s (sanitized)\n",
		      t_secs(t0, t1));
	t_check(r);
	/* Take every other one out, from the front. */
	for (unsigned i = 0; i < N; i += 2) {
		erlang_pid p = t_pid("b@host", i, 0, 7);
		assert_int_equal(registry_deregister(r, K("pool"), &p), 1);
		if (i % 1000 == 0)
			t_check(r);
	}
	assert_int_equal(registry_count(r, K("pool")), N / 2);
	const uint8_t *val;
	size_t vlen;
	assert_int_equal(registry_value(r, K("pool"), &val, &vlen), 0);
	const char *b = (const char *)val;
	int i = 1, n;
	assert_int_equal(ei_decode_list_header(b, &i, &n), 0);
	assert_int_equal(n, N / 2);
	for (unsigned k = 0; k < N / 2; k++) {
		erlang_pid p;
		assert_int_equal(ei_decode_pid(b, &i, &p), 0);
		assert_int_equal(p.num, 2 * k + 1);
		assert_string_equal(p.node, "app@host");
	}
	assert_int_equal(registry_drop_node(r, "app@host"), N / 2);
	assert_int_equal(registry_count(r, K("pool")), 0);
	t_check(r);
	registry_free(r);
}

/* ---- the snapshot ---------------------------------------------------------------------- */

#define T_SEG (64u << 20)

static void *t_seg(size_t len)
{
	void *m = NULL;
	assert_int_equal(posix_memalign(&m, 4096, len), 0);
	memset(m, 0, len);
	return m;
}

/* The snapshot's value for key equals the registry's. */
static void t_assert_snapshot_key(registry *r, const void *seg, size_t len, const char *key, uint8_t *buf,
				  size_t cap)
{
	const uint8_t *val;
	size_t vlen;
	assert_int_equal(registry_value(r, K(key), &val, &vlen), 0);
	uint32_t got = 0;
	int rc = ap_shm_lookup(seg, len, K(key), buf, cap, &got);
	if (vlen == 2) {
		if (rc != AP_SHM_ENOTFOUND)
			fail_msg("key %s: empty in the registry, snapshot says %d (%u bytes)", key, rc, got);
		return;
	}
	if (rc != AP_SHM_OK)
		fail_msg("key %s: %zu bytes in the registry, snapshot says %d", key, vlen, rc);
	assert_int_equal(got, vlen);
	assert_memory_equal(buf, val, vlen);
}

/* A model to check the registry against: refs per key in order. */
struct t_model_key {
	int n;
	uint16_t refs[64];
	uint8_t subs[4]; /* subscribed? */
};

static size_t t_nsubs(const struct t_model_key *mk)
{
	return (size_t)mk->subs[0] + mk->subs[1] + mk->subs[2] + mk->subs[3];
}

static erlang_pid t_model_pid(unsigned id)
{
	static const char *nodes[] = { "app@host", "b@host", "c@host" };
	return t_pid(nodes[id % 3], id, 0, 7);
}

static void test_snapshot_equals_registry_after_random_operations(void **state)
{
	(void)state;
	enum { KEYS = 1000, PIDS = 200, OPS = 200000 };
	void *seg = t_seg(T_SEG);
	struct t_rec rec = { 0 };
	assert_int_equal(ap_shm_writer_init_mem(&rec.w, seg, T_SEG, "rcpt@host", 42), 0);
	registry *r = registry_new(&t_ops, &rec, 0);
	struct t_model_key *model = calloc(KEYS, sizeof *model);
	t_rng rng;
	t_rng_seed(&rng, t_seed("random ops"));
	size_t cap = 1 << 16;
	uint8_t *buf = malloc(cap);
	char key[32];
	erlang_pid subs[4];
	for (int s = 0; s < 4; s++)
		subs[s] = t_pid("app@host", 90000u + (unsigned)s, 0, 7);
	rec.vals = calloc(KEYS, sizeof *rec.vals);
	rec.vlens = calloc(KEYS, sizeof *rec.vlens);
	rec.nvals = KEYS;
	size_t want_listings = 0;
	int deferring = 0;
	for (int op = 0; op < OPS; op++) {
		/* Runs of ops with deferred reports, as the C node does within a
		 * batch: flushed before subscriptions, drops and checks. */
		if (op % 8 == 0) {
			deferring = (int)(t_rand32(&rng) % 2);
			registry_defer(r, deferring);
		}
		unsigned ki = (unsigned)t_rand_range(&rng, 0, KEYS - 1);
		/* Skewed: a few keys get most of the refs. */
		if (ki >= 10 && t_rand32(&rng) % 4 == 0)
			ki %= 10;
		struct t_model_key *mk = &model[ki];
		snprintf(key, sizeof key, "key/%u", ki);
		unsigned pid = (unsigned)t_rand_range(&rng, 0, PIDS - 1);
		erlang_pid p = t_model_pid(pid);
		int at = -1;
		for (int i = 0; i < mk->n; i++)
			if (mk->refs[i] == pid)
				at = i;
		uint32_t dice = t_rand32(&rng) % 100;
		if (dice < 55) {
			if (mk->n == 64 && at < 0)
				continue;
			int rc = registry_register(r, K(key), &p, pid % 4 == 0 ? 1 : 0);
			assert_int_equal(rc, at < 0 ? 1 : 0);
			if (at < 0) {
				mk->refs[mk->n++] = (uint16_t)pid;
				want_listings += t_nsubs(mk);
			}
		} else if (dice < 95) {
			int rc = registry_deregister(r, K(key), &p);
			assert_int_equal(rc, at >= 0 ? 1 : 0);
			if (at >= 0) {
				memmove(&mk->refs[at], &mk->refs[at + 1], (size_t)(mk->n - at - 1) * sizeof mk->refs[0]);
				mk->n--;
				want_listings += t_nsubs(mk);
			}
		} else if (dice < 98) {
			int s = (int)(pid % 4);
			registry_flush(r);
			assert_int_equal(registry_subscribe(r, K(key), &subs[s]), mk->subs[s] ? 0 : 1);
			mk->subs[s] = 1;
			want_listings++;
		} else if (dice < 99) {
			int s = (int)(pid % 4);
			registry_flush(r);
			assert_int_equal(registry_unsubscribe(r, K(key), &subs[s]), mk->subs[s] ? 1 : 0);
			mk->subs[s] = 0;
		} else if (t_rand32(&rng) % 50 == 0) {
			/* Now and then origin 1 leaves (every pid % 4 == 0 ref
			 * goes), or node c@host does (pid % 3 == 2). */
			int by_node = t_rand32(&rng) % 2;
			registry_defer(r, 0);
			size_t dropped = by_node ? registry_drop_node(r, "c@host") : registry_drop_origin(r, 1), want = 0;
			for (int k = 0; k < KEYS; k++) {
				int w = 0;
				for (int i = 0; i < model[k].n; i++)
					if (by_node ? model[k].refs[i] % 3 != 2 : model[k].refs[i] % 4 != 0)
						model[k].refs[w++] = model[k].refs[i];
				if (w != model[k].n)
					want_listings += t_nsubs(&model[k]);
				want += (size_t)(model[k].n - w);
				model[k].n = w;
			}
			assert_int_equal(dropped, want);
			t_check(r);
			registry_defer(r, deferring);
		}
		assert_int_equal(rec.nlistings, want_listings);
		if (op % 1000 == 0) {
			registry_flush(r);
			t_assert_snapshot_key(r, seg, T_SEG, key, buf, cap);
			snprintf(key, sizeof key, "key/%u", (unsigned)t_rand_range(&rng, 0, KEYS - 1));
			t_assert_snapshot_key(r, seg, T_SEG, key, buf, cap);
		}
		if (op % 50000 == 0) {
			registry_flush(r);
			t_check(r);
		}
	}
	registry_defer(r, 0);
	assert_int_equal(rec.put_errors, 0);
	t_check(r);
	size_t refs = 0, keys = 0;
	for (unsigned ki = 0; ki < KEYS; ki++) {
		snprintf(key, sizeof key, "key/%u", ki);
		erlang_pid got[64];
		int n = t_refs(r, key, got, 64);
		assert_int_equal(n, model[ki].n);
		for (int i = 0; i < n; i++) {
			erlang_pid want = t_model_pid(model[ki].refs[i]);
			t_assert_pid_eq(got[i], want);
		}
		t_assert_snapshot_key(r, seg, T_SEG, key, buf, cap);
		refs += (size_t)n;
		keys += n > 0;
	}
	registry_stats st;
	registry_get_stats(r, &st);
	assert_int_equal(st.refs, refs);
	assert_int_equal(st.keys, keys);
	uint64_t skeys, used, compactions;
	ap_shm_writer_stats(rec.w, &skeys, &used, &compactions);
	assert_int_equal(skeys, keys);
	print_message("[ info     ] %d ops: %zu keys, %zu refs, %llu listings, %llu compactions\n", OPS, keys, refs,
		      (unsigned long long)st.listings_sent, (unsigned long long)compactions);
	ap_shm_writer_close(rec.w, 0);
	registry_free(r);
	for (unsigned k = 0; k < KEYS; k++)
		free(rec.vals[k]);
	free(rec.vals);
	free(rec.vlens);
	t_rec_free(&rec);
	free(model);
	free(buf);
	free(seg);
}

/* ap_shm_rebuild fed by registry_next reproduces the registry. */
struct t_iter {
	registry *r;
	size_t cursor;
};

static int t_iter_next(void *arg, const void **key, size_t *klen, const void **val, size_t *vlen)
{
	struct t_iter *it = arg;
	const uint8_t *k, *v;
	int rc = registry_next(it->r, &it->cursor, &k, klen, &v, vlen);
	assert_true(rc >= 0);
	*key = k;
	*val = v;
	return rc;
}

static void test_rebuild_from_the_registry_reproduces_it(void **state)
{
	(void)state;
	registry *r = registry_new(NULL, NULL, 0);
	char key[32];
	for (unsigned i = 0; i < 5000; i++) {
		snprintf(key, sizeof key, "k%u", i % 1234);
		erlang_pid p = t_model_pid(i);
		assert_int_equal(registry_register(r, K(key), &p, 0), 1);
	}
	void *seg = t_seg(T_SEG);
	ap_shm_writer *w;
	assert_int_equal(ap_shm_writer_init_mem(&w, seg, T_SEG, "rcpt@host", 1), 0);
	/* Something stale in it first: the rebuild replaces it all. */
	assert_int_equal(ap_shm_put(w, K("stale"), "\x83j", 2), 0);
	struct t_iter it = { r, 0 };
	assert_int_equal(ap_shm_rebuild(w, t_iter_next, &it), 0);
	assert_int_equal(ap_shm_state(w), AP_SHM_STATE_LIVE);
	uint8_t buf[4096];
	uint32_t vl;
	assert_int_equal(ap_shm_lookup(seg, T_SEG, K("stale"), buf, sizeof buf, &vl), AP_SHM_ENOTFOUND);
	for (unsigned i = 0; i < 1234; i++) {
		snprintf(key, sizeof key, "k%u", i);
		t_assert_snapshot_key(r, seg, T_SEG, key, buf, sizeof buf);
	}
	uint64_t skeys, used, compactions;
	ap_shm_writer_stats(w, &skeys, &used, &compactions);
	assert_int_equal(skeys, 1234);
	ap_shm_writer_close(w, 0);
	free(seg);
	registry_free(r);
}

/* The node's hot path, registry + snapshot put, timed: 1M registers over
 * 100K keys (10 refs each), then 1M deregisters. */
static void test_cost_of_a_register_with_its_snapshot_put(void **state)
{
	(void)state;
	enum { KEYS = 100000, PER = 10 };
	size_t len = 256u << 20;
	void *seg = t_seg(len);
	struct t_rec rec = { 0 };
	assert_int_equal(ap_shm_writer_init_mem(&rec.w, seg, len, "rcpt@host", 42), 0);
	registry_ops ops = { .on_change = t_on_change };
	registry *r = registry_new(&ops, &rec, 0);
	char key[32];
	struct timespec t0, t1, t2;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (unsigned j = 0; j < PER; j++)
		for (unsigned i = 0; i < KEYS; i++) {
			snprintf(key, sizeof key, "service-%u", i);
			erlang_pid p = t_pid("app@host", i * PER + j, 0, 7);
			if (registry_register(r, K(key), &p, 0) != 1)
				fail_msg("register %u/%u", j, i);
		}
	clock_gettime(CLOCK_MONOTONIC, &t1);
	assert_int_equal(rec.put_errors, 0);
	uint64_t skeys, used, compactions;
	ap_shm_writer_stats(rec.w, &skeys, &used, &compactions);
	assert_int_equal(skeys, KEYS);
	for (unsigned j = 0; j < PER; j++)
		for (unsigned i = 0; i < KEYS; i++) {
			snprintf(key, sizeof key, "service-%u", i);
			erlang_pid p = t_pid("app@host", i * PER + j, 0, 7);
			if (registry_deregister(r, K(key), &p) != 1)
				fail_msg("deregister %u/%u", j, i);
		}
	clock_gettime(CLOCK_MONOTONIC, &t2);
	assert_int_equal(rec.put_errors, 0);
	ap_shm_writer_stats(rec.w, &skeys, &used, &compactions);
	assert_int_equal(skeys, 0);
	print_message("[ info     ] 1M registers: %.0f ns each, 1M deregisters: %.0f ns each, registry + shm put "
		      "(%llu compactions)\n",
		      t_secs(t0, t1) * 1e9 / (KEYS * PER), t_secs(t1, t2) * 1e9 / (KEYS * PER),
		      (unsigned long long)compactions);
	ap_shm_writer_close(rec.w, 0);
	registry_free(r);
	t_rec_free(&rec);
	free(seg);
}

/* Many origins, each with refs on several nodes (a group per pair) under
 * shared keys, retagged now and then, dropped in random order: each drop
 * takes exactly that origin's refs (its count beforehand), the others'
 * stay, and the index of groups by origin stays whole (t_check). */
static void test_many_origins_drop_one_by_one(void **state)
{
	(void)state;
	enum { ORIGINS = 300, NODES = 4, KEYS = 40, PER = 6 };
	struct t_rec rec = { 0 };
	registry *r = registry_new(&t_ops, &rec, 0);
	char key[32], node[32];
	uint64_t held[ORIGINS + 1] = { 0 };
	t_rng rng;
	t_rng_seed(&rng, 6);
	unsigned num = 1;
	for (uint32_t o = 1; o <= ORIGINS; o++)
		for (unsigned j = 0; j < PER; j++) {
			snprintf(key, sizeof key, "k%u", (unsigned)(t_rand64(&rng) % KEYS));
			snprintf(node, sizeof node, "n%u@host", (unsigned)(t_rand64(&rng) % NODES));
			erlang_pid p = t_pid(node, num++, 0, 7);
			assert_int_equal(registry_register(r, K(key), &p, o), 1);
			held[o]++;
			if (j == 0 && o > 1) {
				/* Held for the origin before it from now on. */
				assert_int_equal(registry_set_origin(r, K(key), &p, o - 1), 1);
				held[o]--;
				held[o - 1]++;
			}
		}
	t_check(r);
	uint32_t order[ORIGINS];
	for (uint32_t i = 0; i < ORIGINS; i++)
		order[i] = i + 1;
	for (uint32_t i = ORIGINS - 1; i > 0; i--) {
		uint32_t j = (uint32_t)(t_rand64(&rng) % (i + 1)), x = order[i];
		order[i] = order[j];
		order[j] = x;
	}
	registry_stats st;
	for (uint32_t i = 0; i < ORIGINS; i++) {
		uint32_t o = order[i];
		registry_get_stats(r, &st);
		uint64_t before = st.refs;
		assert_int_equal(registry_origin_refs(r, o), held[o]);
		assert_int_equal(registry_drop_origin(r, o), held[o]);
		assert_int_equal(registry_origin_refs(r, o), 0);
		assert_int_equal(registry_drop_origin(r, o), 0);
		registry_get_stats(r, &st);
		assert_int_equal(st.refs, before - held[o]);
		if (i % 37 == 0)
			t_check(r);
	}
	registry_get_stats(r, &st);
	assert_int_equal(st.refs, 0);
	assert_int_equal(st.groups, 0);
	t_check(r);
	registry_free(r);
	t_rec_free(&rec);
}

/* ---- origins ------------------------------------------------------------------ */

/* Names get ids 1, 2, ...; a name is found again, not interned twice; a
 * released id goes to the next new name; the cap and bad names give 0. */
static void test_origins_intern_find_release_reuse(void **state)
{
	(void)state;
	origins *o = origins_new(3);
	assert_non_null(o);
	assert_int_equal(origins_get(o, "a@h", 0), 0);
	assert_int_equal(origins_get(o, "a@h", 1), 1);
	assert_int_equal(origins_get(o, "b@h", 1), 2);
	assert_int_equal(origins_get(o, "a@h", 1), 1);
	assert_int_equal(origins_get(o, "a@h", 0), 1);
	assert_string_equal(origins_name(o, 2), "b@h");
	assert_null(origins_name(o, 3));
	assert_null(origins_name(o, 0));
	assert_int_equal(origins_count(o), 2);
	origins_release(o, 1);
	origins_release(o, 1); /* not held: nothing */
	origins_release(o, 77);
	assert_int_equal(origins_count(o), 1);
	assert_int_equal(origins_get(o, "a@h", 0), 0);
	assert_null(origins_name(o, 1));
	assert_int_equal(origins_get(o, "c@h", 1), 1);
	assert_string_equal(origins_name(o, 1), "c@h");
	assert_int_equal(origins_get(o, "d@h", 1), 3);
	assert_int_equal(origins_get(o, "e@h", 1), 0); /* 3 held: the cap */
	assert_int_equal(origins_get(o, "b@h", 1), 2);
	char longname[MAXATOMLEN_UTF8 + 8];
	memset(longname, 'x', sizeof longname - 1);
	longname[sizeof longname - 1] = 0;
	origins_release(o, 3);
	assert_int_equal(origins_get(o, longname, 1), 0);
	assert_int_equal(origins_count(o), 2);
	origins_free(o);
}

/* A lookup visits a few slots of the table however many origins are held
 * (a walk over them, as before, visited half of them on average), and
 * origins that come and go keep the ids dense: never more ids in use than
 * origins held. Work is counted, not timed. */
static void test_origins_lookup_work_does_not_grow_and_ids_are_reused(void **state)
{
	(void)state;
	enum { N = 60000, CHURN = 200000 };
	origins *o = origins_new(65536);
	char name[64];
	for (unsigned i = 0; i < N; i++) {
		snprintf(name, sizeof name, "member%u@host%u", i, i % 7);
		assert_int_equal(origins_get(o, name, 1), i + 1);
	}
	uint64_t p0 = origins_probes(o);
	for (unsigned i = 0; i < N; i++) {
		snprintf(name, sizeof name, "member%u@host%u", i, i % 7);
		assert_int_equal(origins_get(o, name, 0), i + 1);
	}
	uint64_t per = (origins_probes(o) - p0) / N;
	print_message("[ info     ] %u origins: %llu slots visited per lookup\n", N, (unsigned long long)per);
	assert_true(per <= 4);
	/* Misses cost as little. */
	p0 = origins_probes(o);
	for (unsigned i = 0; i < N; i++) {
		snprintf(name, sizeof name, "stranger%u@host", i);
		assert_int_equal(origins_get(o, name, 0), 0);
	}
	assert_true((origins_probes(o) - p0) / N <= 8);
	/* Churn: one leaves, a new one comes, many times over. */
	t_rng rng;
	t_rng_seed(&rng, 45);
	for (unsigned k = 0; k < CHURN; k++) {
		uint32_t id = 1 + (uint32_t)(t_rand64(&rng) % N);
		origins_release(o, id);
		snprintf(name, sizeof name, "late%u@host", k);
		assert_int_equal(origins_get(o, name, 1), id);
	}
	assert_int_equal(origins_count(o), N);
	p0 = origins_probes(o);
	for (unsigned k = CHURN - 1000; k < CHURN; k++) {
		snprintf(name, sizeof name, "late%u@host", k);
		origins_get(o, name, 0);
	}
	assert_true((origins_probes(o) - p0) / 1000 <= 8);
	origins_free(o);
}

/* A slot's value (a group's count of refs per key) stays with its entry
 * while the table grows, shifts entries back over a deletion and shrinks;
 * entries whose hashes differ only above the 32 bits kept, or share a home
 * slot, are all found; the table gives back every byte it counted. */
static void test_ptab_values_move_with_their_entries(void **state)
{
	(void)state;
	enum { N = 5000 };
	static int obj[N];
	size_t mem = 0;
	ptab t = { 0 };
	/* Long probe runs: 64 home slots at most, and hashes that are equal
	 * once cut to 32 bits. */
	uint64_t h[N];
	for (unsigned i = 0; i < N; i++) {
		h[i] = (uint64_t)(i % 64) | (uint64_t)i << 40;
		assert_int_equal(ptab_reserve(&mem, &t), 0);
		struct pslot *s = ptab_put(&t, h[i], &obj[i]);
		assert_ptr_equal(s->e, &obj[i]);
		assert_int_equal(s->v, 0);
		s->v = i * 7 + 1;
	}
	assert_int_equal(t.n, N);
	for (int round = 0; round < 2; round++) {
		/* Round 0: every third goes; round 1: all but every tenth of
		 * those left, which shrinks the table. */
		for (unsigned i = 0; i < N; i++) {
			int gone = round == 0 ? i % 3 == 0 : i % 3 != 0 && i % 10 != 0;
			if (gone)
				ptab_del(&mem, &t, h[i], &obj[i]);
		}
		for (unsigned i = 0; i < N; i++) {
			int kept = i % 3 != 0 && (round == 0 || i % 10 == 0);
			assert_int_equal(ptab_has(&t, h[i], &obj[i]), kept);
			if (!kept)
				continue;
			const struct pslot *found = NULL;
			size_t m = t.cap - 1;
			for (size_t j = h[i] & m; t.s[j].e; j = (j + 1) & m)
				if (ptab_hit(&t.s[j], h[i]) && t.s[j].e == &obj[i])
					found = &t.s[j];
			assert_non_null(found);
			assert_int_equal(found->v, i * 7 + 1);
		}
		assert_int_equal(ptab_count(&t), t.n);
	}
	assert_true(t.cap < 8192 && t.n * 8 >= t.cap / 2); /* shrunk as it emptied */
	ptab_free(&mem, &t);
	assert_int_equal(mem, 0);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_register_lists_refs_in_registration_order),
		cmocka_unit_test(test_values_and_listings_are_what_ei_encodes),
		cmocka_unit_test(test_registering_twice_changes_nothing_and_reports_nothing),
		cmocka_unit_test(test_deregister_removes_one_ref_and_keeps_the_order),
		cmocka_unit_test(test_bad_keys_are_refused),
		cmocka_unit_test(test_listing_over_the_value_cap_is_refused),
		cmocka_unit_test(test_subscribers_get_a_listing_now_and_on_every_change_only),
		cmocka_unit_test(test_unsubscribe_stops_listings_and_frees_empty_keys),
		cmocka_unit_test(test_unsubscribe_all_removes_every_subscription_of_a_pid),
		cmocka_unit_test(test_drop_origin_removes_its_refs_and_reports_each_key_once),
		cmocka_unit_test(test_set_origin_moves_a_ref_to_another_origin_silently),
		cmocka_unit_test(test_drop_node_removes_refs_on_that_node_from_every_origin),
		cmocka_unit_test(test_many_origins_drop_one_by_one),
		cmocka_unit_test(test_deferred_changes_are_reported_once_per_key_at_the_flush),
		cmocka_unit_test(test_100k_keys),
		cmocka_unit_test(test_10k_refs_in_one_key),
		cmocka_unit_test(test_snapshot_equals_registry_after_random_operations),
		cmocka_unit_test(test_rebuild_from_the_registry_reproduces_it),
		cmocka_unit_test(test_cost_of_a_register_with_its_snapshot_put),
		cmocka_unit_test(test_origins_intern_find_release_reuse),
		cmocka_unit_test(test_origins_lookup_work_does_not_grow_and_ids_are_reused),
		cmocka_unit_test(test_ptab_values_move_with_their_entries),
	};
	ei_init();
	return cmocka_run_group_tests(tests, NULL, NULL);
}
