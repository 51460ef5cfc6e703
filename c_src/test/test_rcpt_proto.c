/* test_rcpt_proto: the receptionist's protocol decoder (rcpt_proto.c), each
 * message and call of its header comment answered as it says, and every
 * malformed form of each refused: counted (stats `malformed'), nothing
 * sent, the registry unchanged. The process runs on a real node without a
 * connection (t_rcpt.h), messages delivered as the runtime delivers them. */
#include "t_helpers.h"

#define T_RCPT_CHECK(cond) assert_true(cond)
#include "t_rcpt.h"

#include "registry.h"

#define T_PEER "peer@host"
#define T_CALLER 900u /* the pid number of every call's caller */
#define T_BIG_LISTING (16u << 20)

/* ---- building messages ----------------------------------------------------- */

static ei_x_buff t_x;

static erlang_pid peer_pid(unsigned num) { return t_pid(T_PEER, num, 0, 5); }

static void m_begin(void) { assert_int_equal(ei_x_new_with_version(&t_x), 0); }
static void e_tuple(int n) { assert_int_equal(ei_x_encode_tuple_header(&t_x, n), 0); }
static void e_list(int n) { assert_int_equal(ei_x_encode_list_header(&t_x, n), 0); }
static void e_nil(void) { assert_int_equal(ei_x_encode_empty_list(&t_x), 0); }
static void e_atom(const char *a) { assert_int_equal(ei_x_encode_atom(&t_x, a), 0); }
static void e_bin(const void *b, size_t n) { assert_int_equal(ei_x_encode_binary(&t_x, b, (int)n), 0); }
static void e_key(const char *k) { e_bin(k, strlen(k)); }
static void e_long(long v) { assert_int_equal(ei_x_encode_long(&t_x, v), 0); }
static void e_string(const char *s) { assert_int_equal(ei_x_encode_string(&t_x, s), 0); }

static void e_pid(unsigned num)
{
	erlang_pid p = peer_pid(num);
	assert_int_equal(ei_x_encode_pid(&t_x, &p), 0);
}

static void e_ref(void)
{
	erlang_ref r;
	memset(&r, 0, sizeof r);
	strcpy(r.node, T_PEER);
	r.len = 3;
	r.n[0] = 1, r.n[1] = 2, r.n[2] = 3;
	r.creation = 5;
	assert_int_equal(ei_x_encode_ref(&t_x, &r), 0);
}

static void e_port(void)
{
	erlang_port p;
	memset(&p, 0, sizeof p);
	strcpy(p.node, T_PEER);
	p.id = 7;
	p.creation = 5;
	assert_int_equal(ei_x_encode_port(&t_x, &p), 0);
}

/* A pid of a node whose name is not UTF-8 (ATOM_UTF8_EXT "n\xc0@h"): ei
 * decodes it, and cannot encode it again. */
static void e_pid_bad_node(void)
{
	static const char b[] = { 88, 118, 0, 4, 'n', (char)0xc0, '@', 'h', 0, 0, 0, 10, 0, 0, 0, 0, 0, 0, 0, 5 };
	assert_int_equal(ei_x_append_buf(&t_x, b, (int)sizeof b), 0);
}

/* {'$gen_call', {Caller, Tag}, ...}: the request follows. */
static void m_call_begin(void)
{
	m_begin();
	e_tuple(3);
	e_atom("$gen_call");
	e_tuple(2);
	e_pid(T_CALLER);
	e_long(77);
}

/* Delivers the message built, which the runtime must take; returns its
 * kind. */
static int m_deliver(void)
{
	int kind = t_rcpt_deliver(t_x.buff, t_x.index);
	ei_x_free(&t_x);
	assert_true(kind >= 0);
	return kind;
}

/* The four-element messages: {Op, Key, Ref, ReplyTo} (reply_to 0: undefined). */
static void msg_reg(const char *op, const char *key, unsigned ref, unsigned reply_to)
{
	m_begin();
	e_tuple(4);
	e_atom(op);
	e_key(key);
	e_pid(ref);
	if (reply_to)
		e_pid(reply_to);
	else
		e_atom("undefined");
	assert_int_equal(m_deliver(), AP_MSG_INFO);
}

/* {rregister | rderegister, Origin, Key, Ref} */
static void msg_remote(const char *op, const char *origin, const char *key, unsigned ref)
{
	m_begin();
	e_tuple(4);
	e_atom(op);
	e_atom(origin);
	e_key(key);
	e_pid(ref);
	assert_int_equal(m_deliver(), AP_MSG_INFO);
}

/* {Op, Key, Pid}: find, subscribe, unsubscribe. */
static void msg_key_pid(const char *op, const char *key, unsigned pid)
{
	m_begin();
	e_tuple(3);
	e_atom(op);
	e_key(key);
	e_pid(pid);
	assert_int_equal(m_deliver(), AP_MSG_INFO);
}

/* ---- reading what was sent ------------------------------------------------- */

/* The version-less term at out[k]: its start, as an index into it. */
static const char *out_term(size_t k, unsigned to_num, int reply)
{
	assert_true(k < t_r.nout);
	assert_int_equal(t_r.out[k].reply, reply);
	assert_int_equal(t_r.out[k].to.num, to_num);
	assert_string_equal(t_r.out[k].to.node, T_PEER);
	return t_r.out[k].term;
}

static void d_atom(const char *b, int *i, const char *want)
{
	char a[MAXATOMLEN_UTF8];
	assert_int_equal(ei_decode_atom(b, i, a), 0);
	assert_string_equal(a, want);
}

static void d_tuple(const char *b, int *i, int want)
{
	int n;
	assert_int_equal(ei_decode_tuple_header(b, i, &n), 0);
	assert_int_equal(n, want);
}

static void d_service_key(const char *b, int *i, const char *key)
{
	char k[REGISTRY_MAX_KEY];
	long kl;
	d_tuple(b, i, 2);
	d_atom(b, i, "service_key");
	assert_int_equal(ei_decode_binary(b, i, k, &kl), 0);
	assert_int_equal((size_t)kl, strlen(key));
	assert_memory_equal(k, key, (size_t)kl);
}

static unsigned d_pid(const char *b, int *i)
{
	erlang_pid p;
	assert_int_equal(ei_decode_pid(b, i, &p), 0);
	assert_string_equal(p.node, T_PEER);
	return p.num;
}

/* A list of pids (no version): their numbers, in order; the count. */
static int d_pids(const char *b, int *i, unsigned *nums, int cap)
{
	int n, type, size;
	assert_int_equal(ei_get_type(b, i, &type, &size), 0);
	assert_int_equal(ei_decode_list_header(b, i, &n), 0);
	assert_true(n <= cap);
	for (int k = 0; k < n; k++)
		nums[k] = d_pid(b, i);
	if (n)
		assert_int_equal(ei_decode_list_header(b, i, &size), 0), assert_int_equal(size, 0);
	return n;
}

/* out[k] is {Tag, {service_key, Key}, Ref} to pid `to`. */
static void expect_ack(size_t k, unsigned to, const char *tag, const char *key, unsigned ref)
{
	const char *b = out_term(k, to, 0);
	int i = 0;
	d_tuple(b, &i, 3);
	d_atom(b, &i, tag);
	d_service_key(b, &i, key);
	assert_int_equal(d_pid(b, &i), ref);
	assert_int_equal(i, t_r.out[k].len);
}

/* out[k] is {listing, {service_key, Key}, Refs} to pid `to`; the refs'
 * numbers, their count. */
static int expect_listing(size_t k, unsigned to, const char *key, unsigned *refs, int cap)
{
	const char *b = out_term(k, to, 0);
	int i = 0;
	d_tuple(b, &i, 3);
	d_atom(b, &i, "listing");
	d_service_key(b, &i, key);
	int n = d_pids(b, &i, refs, cap);
	assert_int_equal(i, t_r.out[k].len);
	return n;
}

/* The reply to the call just made (the only thing sent), after clearing. */
static const char *the_reply(void)
{
	assert_int_equal(t_r.nout, 1);
	return out_term(0, T_CALLER, 1);
}

/* {lookup, Key}: the refs' numbers, their count. Clears what was sent. */
static int lookup(const char *key, unsigned *refs, int cap)
{
	t_rcpt_clear();
	m_call_begin();
	e_tuple(2);
	e_atom("lookup");
	e_key(key);
	assert_int_equal(m_deliver(), AP_MSG_CALL);
	const char *b = the_reply();
	int i = 0;
	int n = d_pids(b, &i, refs, cap);
	assert_int_equal(i, t_r.out[0].len);
	t_rcpt_clear();
	return n;
}

/* One entry of the stats call. Clears what was sent. */
static unsigned long long stat_raw(const char *name)
{
	t_rcpt_clear();
	m_call_begin();
	e_atom("stats");
	assert_int_equal(m_deliver(), AP_MSG_CALL);
	const char *b = the_reply();
	int i = 0, n, found = 0;
	unsigned long long v = 0;
	assert_int_equal(ei_decode_map_header(b, &i, &n), 0);
	for (int k = 0; k < n; k++) {
		char a[MAXATOMLEN_UTF8];
		assert_int_equal(ei_decode_atom(b, &i, a), 0);
		if (!strcmp(a, name)) {
			assert_int_equal(ei_decode_ulonglong(b, &i, &v), 0);
			found = 1;
		} else {
			assert_int_equal(ei_skip_term(b, &i), 0);
		}
	}
	assert_true(found);
	t_rcpt_clear();
	return v;
}

/* The process's own counters outlive its registry (a node starts it once):
 * each test sees them from its start. */
static const char *const t_counters[] = { "registers", "deregisters", "finds",	    "subscribes", "unsubscribes",
					  "malformed", "refused",     "remote_ops", "origin_drops" };
#define T_NCOUNTERS (sizeof t_counters / sizeof t_counters[0])
static unsigned long long t_base[T_NCOUNTERS];

/* One entry of the stats call, a counter since the test began. */
static unsigned long long stat_of(const char *name)
{
	unsigned long long v = stat_raw(name);
	for (size_t k = 0; k < T_NCOUNTERS; k++)
		if (!strcmp(name, t_counters[k]))
			return v - t_base[k];
	return v;
}

/* The reply to the call just made is {error, badarg}. */
static void expect_badarg_reply(void)
{
	const char *b = the_reply();
	int i = 0;
	d_tuple(b, &i, 2);
	d_atom(b, &i, "error");
	d_atom(b, &i, "badarg");
}

static void t_start(size_t max_listing)
{
	t_rcpt_start(max_listing);
	for (size_t k = 0; k < T_NCOUNTERS; k++)
		t_base[k] = stat_raw(t_counters[k]);
}

static int t_setup(void **state)
{
	(void)state;
	t_start(T_BIG_LISTING);
	return 0;
}

static int t_teardown(void **state)
{
	(void)state;
	t_rcpt_clear();
	return 0;
}

/* ---- registrations ---------------------------------------------------------- */

static void test_register_acks_to_reply_to_and_lists_the_ref(void **state)
{
	(void)state;
	unsigned refs[4];
	msg_reg("register", "svc", 10, 20);
	assert_int_equal(t_r.nout, 1);
	expect_ack(0, 20, "registered", "svc", 10);
	assert_int_equal(lookup("svc", refs, 4), 1);
	assert_int_equal(refs[0], 10);
	assert_int_equal(stat_of("registers"), 1);
	assert_int_equal(stat_of("keys"), 1);
	assert_int_equal(stat_of("malformed"), 0);
}

static void test_register_without_reply_to_sends_nothing(void **state)
{
	(void)state;
	unsigned refs[4];
	msg_reg("register", "svc", 10, 0);
	assert_int_equal(t_r.nout, 0);
	assert_int_equal(lookup("svc", refs, 4), 1);
	assert_int_equal(refs[0], 10);
}

static void test_register_twice_acks_twice_and_keeps_one(void **state)
{
	(void)state;
	unsigned refs[4];
	msg_reg("register", "svc", 10, 20);
	msg_reg("register", "svc", 10, 20);
	assert_int_equal(t_r.nout, 2);
	expect_ack(0, 20, "registered", "svc", 10);
	expect_ack(1, 20, "registered", "svc", 10);
	assert_int_equal(lookup("svc", refs, 4), 1);
}

static void test_refs_are_listed_in_registration_order(void **state)
{
	(void)state;
	unsigned refs[4];
	msg_reg("register", "svc", 12, 0);
	msg_reg("register", "svc", 10, 0);
	msg_reg("register", "svc", 11, 0);
	assert_int_equal(lookup("svc", refs, 4), 3);
	assert_int_equal(refs[0], 12);
	assert_int_equal(refs[1], 10);
	assert_int_equal(refs[2], 11);
}

static void test_deregister_acks_also_when_the_ref_is_not_there(void **state)
{
	(void)state;
	unsigned refs[4];
	msg_reg("register", "svc", 10, 0);
	msg_reg("deregister", "svc", 10, 20);
	msg_reg("deregister", "svc", 10, 20);
	msg_reg("deregister", "other", 11, 21);
	assert_int_equal(t_r.nout, 3);
	expect_ack(0, 20, "deregistered", "svc", 10);
	expect_ack(1, 20, "deregistered", "svc", 10);
	expect_ack(2, 21, "deregistered", "other", 11);
	assert_int_equal(lookup("svc", refs, 4), 0);
	assert_int_equal(stat_of("deregisters"), 3);
	assert_int_equal(stat_of("malformed"), 0);
}

static void test_keys_of_one_and_of_1024_bytes_are_taken(void **state)
{
	(void)state;
	unsigned refs[4];
	char big[REGISTRY_MAX_KEY + 1];
	memset(big, 'k', REGISTRY_MAX_KEY);
	big[REGISTRY_MAX_KEY] = 0;
	msg_reg("register", "k", 10, 20);
	msg_reg("register", big, 11, 20);
	assert_int_equal(t_r.nout, 2);
	expect_ack(0, 20, "registered", "k", 10);
	expect_ack(1, 20, "registered", big, 11);
	assert_int_equal(lookup(big, refs, 4), 1);
	assert_int_equal(refs[0], 11);
	assert_int_equal(stat_of("keys"), 2);
}

/* A listing of 131, a list header, two pids and nil, with nothing to spare:
 * the third register would exceed it. */
static void test_register_past_the_listing_limit_fails_too_many_refs(void **state)
{
	(void)state;
	unsigned refs[4];
	erlang_pid p = peer_pid(10);
	ei_x_buff v;
	ei_x_new_with_version(&v);
	ei_x_encode_list_header(&v, 2);
	ei_x_encode_pid(&v, &p);
	ei_x_encode_pid(&v, &p);
	ei_x_encode_empty_list(&v);
	t_start((size_t)v.index);
	ei_x_free(&v);
	msg_reg("register", "svc", 10, 20);
	msg_reg("register", "svc", 11, 20);
	msg_reg("register", "svc", 12, 20);
	assert_int_equal(t_r.nout, 3);
	expect_ack(0, 20, "registered", "svc", 10);
	expect_ack(1, 20, "registered", "svc", 11);
	const char *b = out_term(2, 20, 0);
	int i = 0;
	d_tuple(b, &i, 4);
	d_atom(b, &i, "register_failed");
	d_service_key(b, &i, "svc");
	assert_int_equal(d_pid(b, &i), 12);
	d_atom(b, &i, "too_many_refs");
	assert_int_equal(lookup("svc", refs, 4), 2);
	assert_int_equal(stat_of("refused"), 1);
	assert_int_equal(stat_of("malformed"), 0);
}

/* ---- what gossip brings ------------------------------------------------------- */

static void test_remote_register_and_deregister_send_nothing(void **state)
{
	(void)state;
	unsigned refs[4];
	msg_remote("rregister", "n1@h", "svc", 10);
	assert_int_equal(t_r.nout, 0);
	assert_int_equal(lookup("svc", refs, 4), 1);
	assert_int_equal(refs[0], 10);
	assert_int_equal(stat_of("origins"), 1);
	msg_remote("rderegister", "n2@h", "svc", 10); /* whatever its origin */
	assert_int_equal(t_r.nout, 0);
	assert_int_equal(lookup("svc", refs, 4), 0);
	assert_int_equal(stat_of("remote_ops"), 2);
	assert_int_equal(stat_of("malformed"), 0);
}

static void test_drop_origin_removes_its_refs_and_lists_once(void **state)
{
	(void)state;
	unsigned refs[4];
	msg_reg("register", "svc", 10, 0);
	msg_remote("rregister", "n1@h", "svc", 11);
	msg_remote("rregister", "n1@h", "svc", 12);
	msg_remote("rregister", "n2@h", "svc", 13);
	msg_key_pid("subscribe", "svc", 30);
	t_rcpt_clear();
	m_begin();
	e_tuple(2);
	e_atom("drop_origin");
	e_atom("n1@h");
	m_deliver();
	assert_int_equal(t_r.nout, 1);
	assert_int_equal(expect_listing(0, 30, "svc", refs, 4), 2);
	assert_int_equal(refs[0], 10);
	assert_int_equal(refs[1], 13);
	assert_int_equal(stat_of("origin_drops"), 1);
	assert_int_equal(stat_of("origins"), 1); /* n1's id is free again */
	/* An origin it never heard of: counted, nothing changes. */
	m_begin();
	e_tuple(2);
	e_atom("drop_origin");
	e_atom("n9@h");
	m_deliver();
	assert_int_equal(t_r.nout, 0);
	assert_int_equal(lookup("svc", refs, 4), 2);
	assert_int_equal(stat_of("origin_drops"), 2);
	assert_int_equal(stat_of("malformed"), 0);
}

static void retag(const char *key, unsigned ref, const char *origin)
{
	m_begin();
	e_tuple(4);
	e_atom("retag");
	e_key(key);
	e_pid(ref);
	e_atom(origin);
	assert_int_equal(m_deliver(), AP_MSG_INFO);
}

static void drop_origin(const char *origin)
{
	m_begin();
	e_tuple(2);
	e_atom("drop_origin");
	e_atom(origin);
	m_deliver();
}

static void test_retag_moves_a_ref_to_another_origin(void **state)
{
	(void)state;
	unsigned refs[4];
	msg_remote("rregister", "n1@h", "svc", 10);
	msg_remote("rregister", "n1@h", "svc", 11);
	retag("svc", 10, "undefined"); /* held for this node's own BEAM now */
	retag("svc", 11, "n2@h");
	assert_int_equal(t_r.nout, 0);
	drop_origin("n1@h");
	assert_int_equal(lookup("svc", refs, 4), 2);
	drop_origin("n2@h");
	assert_int_equal(lookup("svc", refs, 4), 1);
	assert_int_equal(refs[0], 10);
	assert_int_equal(stat_of("malformed"), 0);
}

/* ---- finds, subscriptions, sends --------------------------------------------------- */

static void test_find_sends_the_listing_to_reply_to(void **state)
{
	(void)state;
	unsigned refs[4];
	msg_key_pid("find", "svc", 30);
	assert_int_equal(t_r.nout, 1);
	assert_int_equal(expect_listing(0, 30, "svc", refs, 4), 0);
	msg_reg("register", "svc", 10, 0);
	t_rcpt_clear();
	msg_key_pid("find", "svc", 30);
	assert_int_equal(expect_listing(0, 30, "svc", refs, 4), 1);
	assert_int_equal(refs[0], 10);
	assert_int_equal(stat_of("finds"), 2);
}

static void test_subscribe_lists_now_and_on_each_change_until_unsubscribe(void **state)
{
	(void)state;
	unsigned refs[4];
	msg_key_pid("subscribe", "svc", 30);
	assert_int_equal(t_r.nout, 1);
	assert_int_equal(expect_listing(0, 30, "svc", refs, 4), 0);
	t_rcpt_clear();
	msg_reg("register", "svc", 10, 20);
	/* The listing, then the ack. */
	assert_int_equal(t_r.nout, 2);
	assert_int_equal(expect_listing(0, 30, "svc", refs, 4), 1);
	expect_ack(1, 20, "registered", "svc", 10);
	t_rcpt_clear();
	msg_key_pid("unsubscribe", "svc", 30);
	msg_reg("register", "svc", 11, 0);
	assert_int_equal(t_r.nout, 0);
	assert_int_equal(stat_of("subscriptions"), 0);
}

static void test_unsubscribe_all_ends_every_subscription_of_a_pid(void **state)
{
	(void)state;
	msg_key_pid("subscribe", "a", 30);
	msg_key_pid("subscribe", "b", 30);
	msg_key_pid("subscribe", "b", 31);
	assert_int_equal(stat_of("subscriptions"), 3);
	m_begin();
	e_tuple(2);
	e_atom("unsubscribe_all");
	e_pid(30);
	m_deliver();
	assert_int_equal(stat_of("subscriptions"), 1);
	t_rcpt_clear();
	msg_reg("register", "a", 10, 0);
	msg_reg("register", "b", 10, 0);
	assert_int_equal(t_r.nout, 1);
	unsigned refs[4];
	assert_int_equal(expect_listing(0, 31, "b", refs, 4), 1);
}

static void test_send_forwards_the_term_as_it_came(void **state)
{
	(void)state;
	m_begin();
	e_tuple(3);
	e_atom("send");
	e_pid(30);
	int t0 = t_x.index;
	e_tuple(2);
	e_atom("rejected");
	e_bin("xyz", 3);
	size_t tlen = (size_t)(t_x.index - t0);
	char term[64];
	memcpy(term, t_x.buff + t0, tlen);
	m_deliver();
	assert_int_equal(t_r.nout, 1);
	out_term(0, 30, 0);
	assert_int_equal((size_t)t_r.out[0].len, tlen);
	assert_memory_equal(t_r.out[0].term, term, tlen);
}

/* ---- batches ----------------------------------------------------------------------- */

static void test_batch_runs_each_message_in_order(void **state)
{
	(void)state;
	unsigned refs[4];
	m_begin();
	e_tuple(2);
	e_atom("batch");
	e_list(3);
	e_tuple(4), e_atom("register"), e_key("svc"), e_pid(10), e_pid(20);
	e_tuple(3), e_atom("find"), e_key("svc"), e_pid(30);
	e_tuple(4), e_atom("deregister"), e_key("svc"), e_pid(10), e_atom("undefined");
	e_nil();
	m_deliver();
	assert_int_equal(t_r.nout, 2);
	expect_ack(0, 20, "registered", "svc", 10);
	assert_int_equal(expect_listing(1, 30, "svc", refs, 4), 1);
	assert_int_equal(lookup("svc", refs, 4), 0);
	assert_int_equal(stat_of("malformed"), 0);
}

static void test_an_empty_batch_is_nothing(void **state)
{
	(void)state;
	m_begin();
	e_tuple(2);
	e_atom("batch");
	e_nil();
	m_deliver();
	assert_int_equal(t_r.nout, 0);
	assert_int_equal(stat_of("malformed"), 0);
}

static void test_a_bad_message_in_a_batch_leaves_the_rest(void **state)
{
	(void)state;
	unsigned refs[4];
	m_begin();
	e_tuple(2);
	e_atom("batch");
	e_list(3);
	e_tuple(4), e_atom("register"), e_key("svc"), e_pid(10), e_atom("undefined");
	e_tuple(4), e_atom("register"), e_atom("not_a_key"), e_pid(11), e_atom("undefined");
	e_tuple(4), e_atom("register"), e_key("svc"), e_pid(12), e_atom("undefined");
	e_nil();
	m_deliver();
	assert_int_equal(lookup("svc", refs, 4), 2);
	assert_int_equal(refs[0], 10);
	assert_int_equal(refs[1], 12);
	assert_int_equal(stat_of("malformed"), 1);
}

/* A register inside `depth` batches, one in another. */
static void nested_register(int depth, unsigned ref)
{
	m_begin();
	for (int d = 0; d < depth; d++) {
		e_tuple(2);
		e_atom("batch");
		e_list(1);
	}
	e_tuple(4), e_atom("register"), e_key("svc"), e_pid(ref), e_atom("undefined");
	for (int d = 0; d < depth; d++)
		e_nil();
	m_deliver();
}

static void test_batches_nest_four_deep_and_no_deeper(void **state)
{
	(void)state;
	unsigned refs[4];
	nested_register(4, 10);
	assert_int_equal(lookup("svc", refs, 4), 1);
	assert_int_equal(stat_of("malformed"), 0);
	nested_register(5, 11);
	assert_int_equal(lookup("svc", refs, 4), 1);
	assert_int_equal(stat_of("malformed"), 1);
}

static void test_a_gen_cast_is_a_message(void **state)
{
	(void)state;
	unsigned refs[4];
	m_begin();
	e_tuple(2);
	e_atom("$gen_cast");
	e_tuple(4), e_atom("register"), e_key("svc"), e_pid(10), e_pid(20);
	assert_int_equal(m_deliver(), AP_MSG_CAST);
	expect_ack(0, 20, "registered", "svc", 10);
	assert_int_equal(lookup("svc", refs, 4), 1);
}

/* ---- calls ---------------------------------------------------------------------------- */

static void test_calls_sync_pid_and_stats(void **state)
{
	(void)state;
	m_call_begin();
	e_atom("sync");
	assert_int_equal(m_deliver(), AP_MSG_CALL);
	const char *b = the_reply();
	int i = 0;
	d_atom(b, &i, "ok");
	t_rcpt_clear();

	m_call_begin();
	e_atom("pid");
	m_deliver();
	b = the_reply();
	i = 0;
	erlang_pid p;
	assert_int_equal(ei_decode_pid(b, &i, &p), 0);
	assert_int_equal(p.num, t_r.self->pid.num);
	assert_string_equal(p.node, "rcpt@localhost");
	t_rcpt_clear();

	m_call_begin();
	e_atom("stats");
	m_deliver();
	b = the_reply();
	i = 0;
	int n;
	assert_int_equal(ei_decode_map_header(b, &i, &n), 0);
	assert_int_equal(n, 28);
	t_rcpt_clear();
	assert_int_equal(stat_of("malformed"), 0);
}

static void test_dump_lists_at_most_max_keys(void **state)
{
	(void)state;
	msg_reg("register", "a", 10, 0);
	msg_reg("register", "b", 11, 0);
	msg_reg("register", "b", 12, 0);
	for (long max = 0; max <= 3; max++) {
		t_rcpt_clear();
		m_call_begin();
		e_tuple(2);
		e_atom("dump");
		e_long(max);
		m_deliver();
		const char *b = the_reply();
		int i = 0, n, type, size;
		assert_int_equal(ei_get_type(b, &i, &type, &size), 0);
		assert_int_equal(ei_decode_list_header(b, &i, &n), 0);
		assert_int_equal(n, max < 2 ? max : 2);
		int refs_seen = 0;
		for (int k = 0; k < n; k++) {
			char key[8];
			long kl;
			unsigned refs[4];
			d_tuple(b, &i, 2);
			assert_int_equal(ei_decode_binary(b, &i, key, &kl), 0);
			assert_int_equal(kl, 1);
			int nr = d_pids(b, &i, refs, 4);
			assert_int_equal(nr, key[0] == 'a' ? 1 : 2);
			refs_seen += nr;
		}
		if (n) {
			assert_int_equal(ei_decode_list_header(b, &i, &size), 0);
			assert_int_equal(size, 0);
		}
		assert_int_equal(i, t_r.out[0].len);
		if (max >= 2)
			assert_int_equal(refs_seen, 3);
	}
}

/* Each request builder makes one call that must be answered {error, badarg}
 * and counted. */
static void c_unknown_atom(void) { e_atom("hello"); }
static void c_long_atom(void) { e_atom("a_call_name_far_too_long"); }
static void c_not_atom_or_tuple(void) { e_long(3); }
static void c_lookup_empty_key(void) { e_tuple(2), e_atom("lookup"), e_key(""); }
static void c_lookup_atom_key(void) { e_tuple(2), e_atom("lookup"), e_atom("svc"); }
static void c_lookup_three(void) { e_tuple(3), e_atom("lookup"), e_key("svc"), e_key("svc"); }
static void c_dump_negative(void) { e_tuple(2), e_atom("dump"), e_long(-1); }
static void c_dump_not_integer(void) { e_tuple(2), e_atom("dump"), e_atom("all"); }
static void c_unknown_tuple(void) { e_tuple(2), e_atom("forget"), e_key("svc"); }
static void c_tuple_tag_binary(void) { e_tuple(2), e_key("lookup"), e_key("svc"); }

static void test_bad_calls_are_answered_badarg(void **state)
{
	(void)state;
	void (*calls[])(void) = { c_unknown_atom,    c_long_atom,	  c_not_atom_or_tuple, c_lookup_empty_key,
				  c_lookup_atom_key, c_lookup_three,	  c_dump_negative,     c_dump_not_integer,
				  c_unknown_tuple,   c_tuple_tag_binary };
	size_t n = sizeof calls / sizeof calls[0];
	for (size_t k = 0; k < n; k++) {
		t_rcpt_clear();
		m_call_begin();
		calls[k]();
		assert_int_equal(m_deliver(), AP_MSG_CALL);
		expect_badarg_reply();
	}
	assert_int_equal(stat_of("malformed"), n);
}

/* ---- malformed messages ----------------------------------------------------------------- */

static char t_key_1025[REGISTRY_MAX_KEY + 2];

static void m_atom(void) { e_atom("register"); }
static void m_integer(void) { e_long(42); }
static void m_binary(void) { e_key("register"); }
static void m_list(void) { e_list(1), e_atom("register"), e_nil(); }
static void m_empty_tuple(void) { e_tuple(0); }
static void m_tag_alone(void) { e_tuple(1), e_atom("register"); }
static void m_tag_binary(void) { e_tuple(4), e_key("register"), e_key("svc"), e_pid(10), e_atom("undefined"); }
static void m_tag_integer(void) { e_tuple(2), e_long(1), e_long(2); }
static void m_tag_unknown(void) { e_tuple(2), e_atom("registre"), e_key("svc"); }
static void m_tag_too_long(void) { e_tuple(2), e_atom("unsubscribe_all_and_more"), e_pid(10); }
static void m_register_short(void) { e_tuple(3), e_atom("register"), e_key("svc"), e_pid(10); }
static void m_register_long(void)
{
	e_tuple(5), e_atom("register"), e_key("svc"), e_pid(10), e_atom("undefined"), e_atom("x");
}
static void m_key_atom(void) { e_tuple(4), e_atom("register"), e_atom("svc"), e_pid(10), e_atom("undefined"); }
static void m_key_string(void) { e_tuple(4), e_atom("register"), e_string("svc"), e_pid(10), e_atom("undefined"); }
static void m_key_integer(void) { e_tuple(4), e_atom("register"), e_long(7), e_pid(10), e_atom("undefined"); }
static void m_key_empty(void) { e_tuple(4), e_atom("register"), e_key(""), e_pid(10), e_atom("undefined"); }
static void m_key_1025(void) { e_tuple(4), e_atom("register"), e_key(t_key_1025), e_pid(10), e_atom("undefined"); }
static void m_key_bitstring(void)
{
	e_tuple(4), e_atom("register");
	assert_int_equal(ei_x_encode_bitstring(&t_x, "svc", 0, 21), 0);
	e_pid(10), e_atom("undefined");
}
static void m_ref_atom(void) { e_tuple(4), e_atom("register"), e_key("svc"), e_atom("me"), e_atom("undefined"); }
static void m_ref_reference(void) { e_tuple(4), e_atom("register"), e_key("svc"), e_ref(), e_atom("undefined"); }
static void m_ref_port(void) { e_tuple(4), e_atom("register"), e_key("svc"), e_port(), e_atom("undefined"); }
static void m_reply_to_atom(void) { e_tuple(4), e_atom("register"), e_key("svc"), e_pid(10), e_atom("nobody"); }
static void m_reply_to_integer(void) { e_tuple(4), e_atom("deregister"), e_key("svc"), e_pid(10), e_long(0); }
static void m_ref_bad_node(void) { e_tuple(4), e_atom("register"), e_key("svc"), e_pid_bad_node(), e_pid(20); }
static void m_deref_bad_node(void) { e_tuple(4), e_atom("deregister"), e_key("svc"), e_pid_bad_node(), e_pid(20); }
static void m_reply_to_bad_node(void) { e_tuple(4), e_atom("deregister"), e_key("svc"), e_pid(10), e_pid_bad_node(); }
static void m_subscribe_bad_node(void) { e_tuple(3), e_atom("subscribe"), e_key("svc"), e_pid_bad_node(); }
static void m_rregister_origin_binary(void)
{
	e_tuple(4), e_atom("rregister"), e_key("n1@h"), e_key("svc"), e_pid(10);
}
static void m_rregister_ref_atom(void) { e_tuple(4), e_atom("rregister"), e_atom("n1@h"), e_key("svc"), e_atom("r"); }
static void m_rderegister_key_empty(void)
{
	e_tuple(4), e_atom("rderegister"), e_atom("n1@h"), e_key(""), e_pid(10);
}
static void m_retag_origin_binary(void) { e_tuple(4), e_atom("retag"), e_key("svc"), e_pid(10), e_key("n1@h"); }
static void m_retag_ref_integer(void) { e_tuple(4), e_atom("retag"), e_key("svc"), e_long(10), e_atom("n1@h"); }
static void m_drop_origin_binary(void) { e_tuple(2), e_atom("drop_origin"), e_key("n1@h"); }
static void m_find_reply_to_atom(void) { e_tuple(3), e_atom("find"), e_key("svc"), e_atom("undefined"); }
static void m_find_key_1025(void) { e_tuple(3), e_atom("find"), e_key(t_key_1025), e_pid(30); }
static void m_subscribe_pid_ref(void) { e_tuple(3), e_atom("subscribe"), e_key("svc"), e_ref(); }
static void m_unsubscribe_key_empty(void) { e_tuple(3), e_atom("unsubscribe"), e_key(""), e_pid(30); }
static void m_unsubscribe_all_atom(void) { e_tuple(2), e_atom("unsubscribe_all"), e_atom("all"); }
static void m_send_to_atom(void) { e_tuple(3), e_atom("send"), e_atom("someone"), e_atom("hi"); }
static void m_batch_tuple(void) { e_tuple(2), e_atom("batch"), e_tuple(1), e_atom("x"); }
static void m_batch_binary(void) { e_tuple(2), e_atom("batch"), e_key("x"); }
static void m_batch_string(void) { e_tuple(2), e_atom("batch"), e_string("abc"); }
static void m_cast_of_atom(void) { e_tuple(2), e_atom("$gen_cast"), e_atom("register"); }

static void test_malformed_messages_are_counted_and_change_nothing(void **state)
{
	(void)state;
	void (*msgs[])(void) = {
		m_atom,		       m_integer,	      m_binary,		     m_list,
		m_empty_tuple,	       m_tag_alone,	      m_tag_binary,	     m_tag_integer,
		m_tag_unknown,	       m_tag_too_long,	      m_register_short,	     m_register_long,
		m_key_atom,	       m_key_string,	      m_key_integer,	     m_key_empty,
		m_key_1025,	       m_key_bitstring,	      m_ref_atom,	     m_ref_reference,
		m_ref_port,	       m_ref_bad_node,	      m_deref_bad_node,	     m_reply_to_bad_node,
		m_subscribe_bad_node,  m_reply_to_atom,	      m_reply_to_integer,    m_rregister_origin_binary,
		m_rregister_ref_atom,  m_rderegister_key_empty, m_retag_origin_binary, m_retag_ref_integer,
		m_drop_origin_binary,  m_find_reply_to_atom,  m_find_key_1025,	     m_subscribe_pid_ref,
		m_unsubscribe_key_empty, m_unsubscribe_all_atom, m_send_to_atom,	     m_batch_tuple,
		m_batch_binary,	       m_batch_string,	      m_cast_of_atom,
	};
	size_t n = sizeof msgs / sizeof msgs[0];
	memset(t_key_1025, 'k', REGISTRY_MAX_KEY + 1);
	t_key_1025[REGISTRY_MAX_KEY + 1] = 0;
	/* Something to keep: a ref and a subscriber that must hear nothing. */
	msg_reg("register", "svc", 10, 0);
	msg_key_pid("subscribe", "svc", 30);
	for (size_t k = 0; k < n; k++) {
		t_rcpt_clear();
		m_begin();
		msgs[k]();
		m_deliver();
		if (t_r.nout)
			fail_msg("malformed message %zu sent something", k);
		unsigned long long bad = stat_of("malformed");
		if (bad != k + 1)
			fail_msg("malformed message %zu: malformed is %llu", k, bad);
	}
	unsigned refs[4];
	assert_int_equal(lookup("svc", refs, 4), 1);
	assert_int_equal(refs[0], 10);
	assert_int_equal(stat_of("keys"), 1);
	assert_int_equal(stat_of("refs"), 1);
	assert_int_equal(stat_of("subscriptions"), 1);
	assert_int_equal(stat_of("registers"), 1);
	assert_int_equal(stat_of("origins"), 0);
}

/* The runtime refuses what is not one whole term before any process sees
 * it: the decoder is never handed such bytes. */
static void test_the_runtime_refuses_what_is_not_one_term(void **state)
{
	(void)state;
	m_begin();
	e_tuple(4), e_atom("register"), e_key("svc"), e_pid(10), e_atom("undefined");
	assert_int_equal(t_rcpt_deliver(t_x.buff, t_x.index - 1), -1); /* cut short */
	e_atom("more");
	assert_int_equal(t_rcpt_deliver(t_x.buff, t_x.index), -1); /* two terms */
	assert_int_equal(t_rcpt_deliver(t_x.buff + 1, t_x.index - 1), -1); /* no version byte */
	ei_x_free(&t_x);
	assert_int_equal(stat_of("malformed"), 0);
	assert_int_equal(stat_of("keys"), 0);
}

static int t_group_teardown(void **state)
{
	(void)state;
	t_rcpt_stop();
	return 0;
}

int main(void)
{
	const struct CMUnitTest tests[] = {
#define T(f) cmocka_unit_test_setup_teardown(f, t_setup, t_teardown)
		T(test_register_acks_to_reply_to_and_lists_the_ref),
		T(test_register_without_reply_to_sends_nothing),
		T(test_register_twice_acks_twice_and_keeps_one),
		T(test_refs_are_listed_in_registration_order),
		T(test_deregister_acks_also_when_the_ref_is_not_there),
		T(test_keys_of_one_and_of_1024_bytes_are_taken),
		T(test_register_past_the_listing_limit_fails_too_many_refs),
		T(test_remote_register_and_deregister_send_nothing),
		T(test_drop_origin_removes_its_refs_and_lists_once),
		T(test_retag_moves_a_ref_to_another_origin),
		T(test_find_sends_the_listing_to_reply_to),
		T(test_subscribe_lists_now_and_on_each_change_until_unsubscribe),
		T(test_unsubscribe_all_ends_every_subscription_of_a_pid),
		T(test_send_forwards_the_term_as_it_came),
		T(test_batch_runs_each_message_in_order),
		T(test_an_empty_batch_is_nothing),
		T(test_a_bad_message_in_a_batch_leaves_the_rest),
		T(test_batches_nest_four_deep_and_no_deeper),
		T(test_a_gen_cast_is_a_message),
		T(test_calls_sync_pid_and_stats),
		T(test_dump_lists_at_most_max_keys),
		T(test_bad_calls_are_answered_badarg),
		T(test_malformed_messages_are_counted_and_change_nothing),
		T(test_the_runtime_refuses_what_is_not_one_term),
#undef T
	};
	return cmocka_run_group_tests(tests, NULL, t_group_teardown);
}
