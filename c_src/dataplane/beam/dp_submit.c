/* dp_submit: records into the request rings: submit/6,7 and
 * submit_encoded/6, what may be encoded on a scheduler, the tickets that
 * fence records across rings and the marks of consumed/2 (see actor_dp.c). */
#include <errno.h>
#include <string.h>

#include "actor_dp_int.h"
#include "ap_term.h"
#include "ap_time.h"

/* ---- submit --------------------------------------------------------------------- */

static atomic_uint g_next_slot;
static _Thread_local unsigned tl_slot; /* 0: none yet; else the thread's slot + 1 */
/* The last pool pid this thread encoded as a destination, and its bytes
 * (without the version byte): a stream of calls to one pool encodes its
 * pid once per scheduler, not per message (an allocation, an encode and a
 * free were 6% of a tell's BEAM CPU). The env lives as long as the
 * thread (a scheduler's: as long as the VM). */
struct pid_enc {
	ErlNifEnv *env;
	ERL_NIF_TERM pid;
	size_t len;
	uint8_t enc[1100]; /* a pid with a node name of 255 UTF-8 characters */
};
static _Thread_local struct pid_enc tl_pid;

/* The caller's ring: a slot per scheduler thread, handed out in order, so
 * that with one ring per scheduler each has its own. A dirty scheduler
 * (submit_encoded/6 of a large term) takes no slot: it would shift the
 * normal schedulers' slots onto each other's rings; it starts at ring 0
 * and takes the first free one. */
static uint32_t my_ring(const struct dp *s, int dirty)
{
	if (dirty)
		return 0;
	if (!tl_slot)
		tl_slot = atomic_fetch_add(&g_next_slot, 1) + 1;
	return (tl_slot - 1) % s->seg.n_req;
}

/* An atom's text as UTF-8 (names travel as UTF-8; OTP 25's API gives
 * Latin-1). 0 if it is not a Latin-1 atom or too long. */
static size_t atom_utf8(ErlNifEnv *env, ERL_NIF_TERM a, uint8_t *out, size_t cap)
{
	char l1[256];
	int n = enif_get_atom(env, a, l1, sizeof l1, ERL_NIF_LATIN1);
	size_t o = 0;

	if (n <= 1)
		return 0;
	for (int i = 0; i < n - 1; i++) {
		uint8_t c = (uint8_t)l1[i];
		if (o + 2 > cap)
			return 0;
		if (c < 0x80) {
			out[o++] = c;
		} else {
			out[o++] = (uint8_t)(0xc0 | c >> 6);
			out[o++] = (uint8_t)(0x80 | (c & 0x3f));
		}
	}
	return o;
}

/* A non-binary message is encoded inside submit/6 (enif_term_to_binary,
 * which cannot yield) only when a walk of at most DP_ENC_CELLS terms
 * shows it small: at most that many terms and conses, within
 * DP_ENC_BYTES by a bound of its encoded size. That encoding takes tens
 * of microseconds at most. Anything else is answered `encode`: the
 * caller encodes it with term_to_binary/1, which yields, and submits the
 * bytes with submit_encoded/6. Unbounded, the encoding of a 10M-element
 * list held the scheduler for 100 ms and more, only for the message to
 * be refused as too large. */
#define DP_ENC_CELLS 1024u /* also bounds the nesting below AP_TERM_MAX_DEPTH, which the pool node refuses past */
#define DP_ENC_BYTES (64u * 1024)
#define DP_ENC_STACK 256u  /* terms waiting in the walk: more siblings than this go to `encode` */
#define DP_ENC_ID 1100u    /* a bound of a pid, port or reference: a node name of 255 UTF-8 characters */
/* submit/7: the caller's own bound of the encoded size (actor_pool walks
 * every message before it sends it) stands for the walk when it is at
 * most this: such a term has at most twice as many terms as bytes, so its
 * encoding is as short. A caller that lies only holds its own scheduler. */
#define DP_ENC_VOUCHED (16u * 1024)
/* submit_encoded/6 checks the bytes it is given (one whole term, as the
 * pool node will): in the call up to this size, on a dirty CPU scheduler
 * above it (a walk of up to a ring record's size, half a megabyte by
 * default, is milliseconds of work). */
#define DP_ENC_INLINE (64u * 1024)

/* Whether t is small enough to encode here (see DP_ENC_CELLS). Terms a NIF
 * cannot size cheaply (funs, which may carry any environment, integers
 * over 64 bits, bitstrings that are not binaries) are left to the
 * caller. */
static int enc_small(ErlNifEnv *env, ERL_NIF_TERM t)
{
	ERL_NIF_TERM st[DP_ENC_STACK];
	unsigned n = 0, cells = 0;
	size_t bytes = 1;

	st[n++] = t;
	while (n) {
		ERL_NIF_TERM x = st[--n], h, tl, k, v;
		const ERL_NIF_TERM *el;
		ErlNifBinary b;
		ErlNifSInt64 i64;
		ErlNifUInt64 u64;
		ErlNifMapIterator it;
		unsigned len;
		size_t msz;
		int arity;

		if (++cells > DP_ENC_CELLS)
			return 0;
		switch (enif_term_type(env, x)) {
		case ERL_NIF_TERM_TYPE_ATOM:
			/* Latin-1 text becomes at most twice as many UTF-8 bytes. */
			bytes += enif_get_atom_length(env, x, &len, ERL_NIF_LATIN1) ? 3 + 2 * (size_t)len : 3 + 4 * 255;
			break;
		case ERL_NIF_TERM_TYPE_FLOAT:
			bytes += 9;
			break;
		case ERL_NIF_TERM_TYPE_INTEGER:
			if (!enif_get_int64(env, x, &i64) && !enif_get_uint64(env, x, &u64))
				return 0;
			bytes += 11;
			break;
		case ERL_NIF_TERM_TYPE_PID:
		case ERL_NIF_TERM_TYPE_PORT:
		case ERL_NIF_TERM_TYPE_REFERENCE:
			bytes += DP_ENC_ID;
			break;
		case ERL_NIF_TERM_TYPE_BITSTRING:
			if (!enif_inspect_binary(env, x, &b))
				return 0;
			bytes += 6 + b.size;
			break;
		case ERL_NIF_TERM_TYPE_LIST:
			/* One cons: its head waits on top of its tail, so a long
			 * list keeps the stack at one entry for its spine. */
			if (!enif_get_list_cell(env, x, &h, &tl)) {
				bytes += 1;
				break;
			}
			if (n + 2 > DP_ENC_STACK)
				return 0;
			bytes += 5;
			st[n++] = tl;
			st[n++] = h;
			break;
		case ERL_NIF_TERM_TYPE_TUPLE:
			if (!enif_get_tuple(env, x, &arity, &el) || (unsigned)arity > DP_ENC_STACK - n)
				return 0;
			bytes += 5;
			for (int j = arity - 1; j >= 0; j--)
				st[n++] = el[j];
			break;
		case ERL_NIF_TERM_TYPE_MAP:
			if (!enif_get_map_size(env, x, &msz) || msz > (DP_ENC_STACK - n) / 2)
				return 0;
			bytes += 5;
			if (!msz)
				break;
			if (!enif_map_iterator_create(env, x, &it, ERL_NIF_MAP_ITERATOR_FIRST))
				return 0;
			while (enif_map_iterator_get_pair(env, &it, &k, &v)) {
				st[n++] = v;
				st[n++] = k;
				enif_map_iterator_next(env, &it);
			}
			enif_map_iterator_destroy(env, &it);
			break;
		default:
			return 0;
		}
		if (bytes > DP_ENC_BYTES)
			return 0;
	}
	return 1;
}

/* A ticket: the ring a submit's record went to, a small integer the
 * caller keeps per pool node and passes back with its next submit. When
 * that one goes to another ring, its fence is that ring's tail now: the
 * ticket's record was committed before, so it lies before the tail, and
 * the reader reads that ring up to there first (others' records among
 * them, which only come sooner). The caller's ticket so changes only when
 * it moves between rings: no dictionary write per record, no tuple built
 * and nothing deep compared (a {Seg, {Ring, Pos}} kept per record took
 * 7% of a tell's samples, its write and the map update 5% more). A ticket
 * of another segment (a lane replaced) makes a fence at that ring's tail
 * too, one more read the reader would do anyway.
 *
 * A mark: a ticket with the tail it had then (mark/2), for consumed/2,
 * which must wait for a place that does not move: the ring in the low
 * TK_RING_BITS bits, the position's low TK_POS_BITS bits above, its high
 * bits read back from the ring's tail (the mark lies less than 2^49 bytes
 * behind it). */
#define TK_RING_BITS 10
#define TK_POS_BITS 49
#define TK_RING_MASK ((1u << TK_RING_BITS) - 1)
#define TK_POS_MASK ((UINT64_C(1) << TK_POS_BITS) - 1)
_Static_assert(AP_SEG_MAX_REQ <= (1u << TK_RING_BITS), "a ring index fits in a ticket");
_Static_assert(TK_RING_BITS + TK_POS_BITS <= 59, "a mark is a small integer");

/* Ring i's committed tail: our own word, published by its writers; a
 * hostile value only makes a fence or a mark wrong, never memory. */
static uint64_t req_tail(const struct dp *s, uint32_t i)
{
	return __atomic_load_n(&s->req[i].r.hdr->tail, __ATOMIC_ACQUIRE);
}

/* 1 and *ring, *pos from mark t; 0 if t is not one of this segment. */
static int get_mark(ErlNifEnv *env, const struct dp *s, ERL_NIF_TERM t, uint32_t *ring, uint64_t *pos)
{
	ErlNifUInt64 v;

	if (!enif_get_uint64(env, t, &v) || v >> (TK_RING_BITS + TK_POS_BITS) || (v & TK_RING_MASK) >= s->seg.n_req)
		return 0;
	*ring = (uint32_t)(v & TK_RING_MASK);
	uint64_t now = req_tail(s, *ring), p = (now & ~TK_POS_MASK) | (v >> TK_RING_BITS);
	if (p > now) /* the window below the tail; past it: no mark of ours, the tail */
		p = now > TK_POS_MASK ? p - (TK_POS_MASK + 1) : now;
	*pos = p;
	return 1;
}

/* An ask's reference, and its timeout when this library keeps it. */
struct ask_tag {
	ERL_NIF_TERM ref;
	uint32_t timeout_ms; /* 0: none */
	struct dp_hist *hist; /* NULL: none */
};

/* Under mu: h, kept by the segment until it goes (NULL past
 * DP_MAX_HISTS, or without memory: the ask goes unmeasured). */
static struct dp_hist *pin_hist(struct dp *s, struct dp_hist *h)
{
	if (!h || h == s->last_hist)
		return h;
	for (uint32_t i = 0; i < s->n_hists; i++)
		if (s->hists[i] == h) {
			s->last_hist = h;
			return h;
		}
	if (s->n_hists == s->cap_hists) {
		uint32_t cap = s->cap_hists ? 2 * s->cap_hists : 8;
		struct dp_hist **n;
		if (cap > DP_MAX_HISTS || !(n = enif_realloc(s->hists, cap * sizeof *n)))
			return NULL;
		s->hists = n;
		s->cap_hists = cap;
	}
	enif_keep_resource(h);
	s->hists[s->n_hists++] = h;
	s->last_hist = h;
	return h;
}

/* What submit/6 and submit_encoded/6 share: Seg, Kind, Dest, Ref (or
 * {Ref, TimeoutMs}) and Ticket (argv[0..2], [4], [5]) read into *s, *q and
 * *tag. 0, or -1 for a
 * badarg. The destination may be in name[] or in *dest_bin (then
 * *own_dest is set: the caller releases it). */
static int submit_args(ErlNifEnv *env, const ERL_NIF_TERM argv[], struct dp **s, struct dp_req_parts *q,
		       uint8_t name[DP_MAX_DEST_NAME], ErlNifBinary *dest_bin, int *own_dest, struct ask_tag *tag)
{
	ErlNifUInt64 tr;
	const ERL_NIF_TERM *el;
	int arity;
	unsigned t;

	if (!get_dp(env, argv[0], s))
		return -1;
	if (enif_is_identical(argv[1], a_tell))
		q->kind = AP_DP_TELL;
	else if (enif_is_identical(argv[1], a_ask))
		q->kind = AP_DP_ASK;
	else if (enif_is_identical(argv[1], a_stats))
		q->kind = AP_DP_STATS;
	else
		return -1;
	/* An ask's tag: Ref, or {Ref, TimeoutMs} for a timeout kept here,
	 * or {Ref, TimeoutMs, Hist} (TimeoutMs 0: none) to time it into Hist. */
	tag->ref = argv[4];
	tag->timeout_ms = 0;
	tag->hist = NULL;
	if (q->kind != AP_DP_TELL && enif_get_tuple(env, argv[4], &arity, &el)) {
		void *h;
		if (arity == 2 && enif_get_uint(env, el[1], &t) && t > 0) {
			tag->ref = el[0];
			tag->timeout_ms = t;
		} else if (arity == 3 && enif_get_uint(env, el[1], &t) && enif_get_resource(env, el[2], g_hist_type, &h)) {
			tag->ref = el[0];
			tag->timeout_ms = t;
			tag->hist = h;
		}
	}
	if (q->kind != AP_DP_TELL && !enif_is_ref(env, tag->ref))
		return -1;
	if (enif_get_uint64(env, argv[5], &tr)) {
		/* A ticket of another segment's geometry is no fence; the
		 * fence's place is taken when the record's ring is known. */
		if (tr < (*s)->seg.n_req)
			q->fence_ring = (uint32_t)tr;
	} else if (!enif_is_identical(argv[5], a_undefined)) {
		return -1;
	}
	if (enif_is_atom(env, argv[2])) {
		q->dest_kind = AP_DP_DEST_NAME;
		q->dest_len = atom_utf8(env, argv[2], name, DP_MAX_DEST_NAME);
		q->dest = name;
		if (!q->dest_len)
			return -1;
	} else if (enif_is_pid(env, argv[2])) {
		struct pid_enc *pc = &tl_pid;
		q->dest_kind = AP_DP_DEST_PID;
		if (pc->env && enif_is_identical(argv[2], pc->pid)) {
			q->dest = pc->enc;
			q->dest_len = pc->len;
			return 0;
		}
		if (!enif_term_to_binary(env, argv[2], dest_bin))
			return -1;
		*own_dest = 1;
		q->dest = dest_bin->data + 1;
		q->dest_len = dest_bin->size - 1;
		if (q->dest_len <= sizeof pc->enc && (pc->env || (pc->env = enif_alloc_env()))) {
			enif_clear_env(pc->env);
			pc->pid = enif_make_copy(pc->env, argv[2]);
			memcpy(pc->enc, q->dest, q->dest_len);
			pc->len = q->dest_len;
		}
	} else {
		return -1;
	}
	return 0;
}

/* Writes the record q into a request ring and answers as submit/6 does.
 * tag: the ask's Ref and timeout (argv[4]); dirty: on a dirty scheduler. *published:
 * whether the record went in. */
static ERL_NIF_TERM submit_record(ErlNifEnv *env, struct dp *s, struct dp_req_parts *q, const struct ask_tag *tag,
				  int dirty, int *published)
{
	uint32_t ring, k;
	struct req_ring *rr = NULL;
	struct ask *a = NULL;
	void *p;
	int rc, lone = 0, solo = 0, kick = 0;

	*published = 0;
	if ((rc = dp_req_check(q)))
		return rc == -EMSGSIZE ? a_too_large : enif_make_badarg(env);
	if (dp_req_len(q->dest_len, q->pre_len + q->msg_len) > ap_ring_max_payload(s->seg.req_cap)) {
		cnt(&s->n_too_large);
		return a_too_large;
	}
	if (atomic_load(&s->closed))
		return a_closed;
	if (q->kind != AP_DP_TELL) {
		/* Registered before the record is visible: the reply may come
		 * back before we return. */
		mu_lock(s);
		if (atomic_load(&s->closed) || !(a = ask_new(s))) {
			mu_unlock(s);
			return a_closed; /* or no memory for the entry: the caller falls back */
		}
		a->id = atomic_fetch_add(&s->next_id, 1);
		a->ref = enif_make_copy(a->env, tag->ref);
		enif_self(env, &a->pid);
		a->crowded = 0;
		a->deadline_ms = 0;
		a->hist = q->kind == AP_DP_ASK ? pin_hist(s, tag->hist) : NULL;
		/* One clock read for both uses (a read was 0.7% of the
		 * schedulers' samples under 64 callers). */
		int64_t now = q->kind == AP_DP_ASK || tag->timeout_ms ? ap_mono_ns() : 0;
		if (tag->timeout_ms) {
			/* +1: the clock's milliseconds are truncated, and a
			 * timeout is never early (as `after' is not). */
			a->deadline_ms = now / 1000000 + tag->timeout_ms + 1;
			if (a->deadline_ms < atomic_load_explicit(&s->next_deadline_ms, memory_order_relaxed)) {
				atomic_store(&s->next_deadline_ms, a->deadline_ms);
				/* Sooner than the reply thread's wake-up: wake it
				 * (a short timeout while it sleeps its longest). */
				kick = a->deadline_ms < atomic_load(&s->wake_ms);
			}
		}
		a->t0 = now;
		if (q->kind == AP_DP_ASK) {
			a->crowded = s->last_ns && now - s->last_ns < DP_CROWD_NS &&
				     enif_compare_pids(&s->last_pid, &a->pid) != 0;
			s->last_pid = a->pid;
			s->last_ns = now;
		}
		ask_put(s, a);
		/* Worth an await/2 (decided here, under the lock we hold
		 * anyway: the other asks never make that call). */
		if (q->kind == AP_DP_ASK && s->n_asks == 1 && !a->crowded) {
			solo = 1;
			lone = ap_skip_wait(&s->await_skip);
		}
		/* Read under the lock: once it is dropped the entry may be
		 * answered (a timeout, a close), freed and reused by another
		 * submit. */
		q->ask_id = a->id;
		mu_unlock(s);
		if (kick)
			ap_seg_kick(s->seg.hdr, AP_SEG_BELL_REP);
	}
	/* The loop's hint (ap_seg.h), before the record shows: it reads it
	 * with the record. Its line is the bell's, which the notify below
	 * reads anyway; written only when it changes. */
	if (__atomic_load_n(&s->seg.hdr->req_lone, __ATOMIC_RELAXED) != (uint32_t)solo)
		__atomic_store_n(&s->seg.hdr->req_lone, (uint32_t)solo, __ATOMIC_RELAXED);
	/* Our scheduler's ring, or the next free one: another thread may share
	 * it (dirty schedulers, more schedulers than rings). */
	ring = my_ring(s, dirty);
	for (k = 0; k < s->seg.n_req; k++) {
		uint32_t i = (ring + k) % s->seg.n_req;
		int expect = 0;
		if (atomic_compare_exchange_strong_explicit(&s->req[i].busy, &expect, 1, memory_order_acquire,
							    memory_order_relaxed)) {
			rr = &s->req[i];
			ring = i;
			break;
		}
	}
	rc = -EAGAIN;
	if (rr) {
		rc = ap_ring_reserve(&rr->r, dp_req_len(q->dest_len, q->pre_len + q->msg_len), &p);
		if (rc == 0) {
			if (q->fence_ring == ring)
				q->fence_ring = AP_DP_NO_FENCE;
			else if (q->fence_ring != AP_DP_NO_FENCE)
				q->fence_pos = req_tail(s, q->fence_ring);
			dp_req_write(p, q);
			rc = ap_ring_publish(&rr->r);
			if (rc == 0) {
				atomic_uint_fast64_t *c =
					&rr->n[q->kind == AP_DP_TELL ? RC_TELLS : q->kind == AP_DP_ASK ? RC_ASKS : RC_STATS];
				atomic_store_explicit(c, atomic_load_explicit(c, memory_order_relaxed) + 1,
						      memory_order_relaxed);
			}
		} else {
			ap_ring_abort(&rr->r);
		}
		atomic_store_explicit(&rr->busy, 0, memory_order_release);
	}
	if (rc == 0) {
		*published = 1;
		ap_seg_notify_fd(s->seg.hdr, AP_SEG_BELL_REQ, s->bell_fd);
	} else if (rc == -EPROTO) {
		/* The pool node moved our ring's head where it cannot be. */
		dp_shut(s, env, a_bad_segment, 1);
	} else {
		cnt(&s->n_full);
	}
	if (rc && a) {
		struct ask *back;
		mu_lock(s);
		back = ask_take(s, q->ask_id);
		if (back)
			ask_free(s, back); /* unanswered: it goes by distribution, timed there */
		mu_unlock(s);
		/* A close answered the ask meanwhile ({Ref, {error, R}} is on
		 * its way): the caller must wait for it as for any answer. */
		if (!back)
			return enif_make_tuple3(env, a_ok,
						enif_make_uint(env, ring),
						enif_make_uint64(env, q->ask_id));
	}
	if (rc == -EPROTO)
		return a_closed;
	if (rc)
		return a_full;
	if (q->kind == AP_DP_TELL)
		return enif_make_tuple2(env, a_ok,
					enif_make_uint(env, ring));
	if (lone)
		return enif_make_tuple4(env, a_ok,
					enif_make_uint(env, ring),
					enif_make_uint64(env, q->ask_id), a_await);
	return enif_make_tuple3(env, a_ok, enif_make_uint(env, ring),
				enif_make_uint64(env, q->ask_id));
}

/* submit(Seg, Kind, Dest, Msg, Ref, Ticket), and submit/7 with the
 * caller's Bound of Msg's encoded size. */
ERL_NIF_TERM nif_submit(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
{
	struct dp *s;
	struct dp_req_parts q = { .fence_ring = AP_DP_NO_FENCE };
	uint8_t name[DP_MAX_DEST_NAME], prefix[5];
	ErlNifBinary dest_bin = { 0 }, msg_bin = { 0 }, mbin;
	int own_dest = 0, own_msg = 0, published;
	ErlNifUInt64 bound = UINT64_MAX;
	struct ask_tag tag;
	ERL_NIF_TERM ret;

	if ((argc == 7 && !enif_get_uint64(env, argv[6], &bound)) ||
	    submit_args(env, argv, &s, &q, name, &dest_bin, &own_dest, &tag)) {
		ret = enif_make_badarg(env);
		goto done;
	}
	if (q.kind != AP_DP_STATS) {
		if (enif_inspect_binary(env, argv[3], &mbin)) {
			/* Refused by its size alone: a binary is never encoded. */
			if (mbin.size > UINT32_MAX - 64) {
				ret = a_too_large;
				goto done;
			}
			dp_binary_prefix(prefix, (uint32_t)mbin.size);
			q.msg_pre = prefix;
			q.pre_len = sizeof prefix;
			q.msg = mbin.data;
			q.msg_len = mbin.size;
		} else {
			if (bound > DP_ENC_VOUCHED && !enc_small(env, argv[3])) {
				ret = a_encode;
				goto done;
			}
			if (!enif_term_to_binary(env, argv[3], &msg_bin)) {
				ret = enif_make_badarg(env);
				goto done;
			}
			own_msg = 1;
			q.msg = msg_bin.data + 1;
			q.msg_len = msg_bin.size - 1;
		}
	}
	ret = submit_record(env, s, &q, &tag, 0, &published);
done:
	if (own_dest)
		enif_release_binary(&dest_bin);
	if (own_msg)
		enif_release_binary(&msg_bin);
	return ret;
}

/* submit_encoded(Seg, Kind, Dest, Bin, Ref, Ticket): as submit/6 with Msg
 * already encoded (Bin: term_to_binary/1's bytes). Bytes that are not one
 * whole external term (as the pool node checks each message) are a
 * badarg: written, they would be skipped by the pool node, an ask never
 * answered. The size is checked first, so a Bin too large for a record
 * is too_large however its bytes look. */
static ERL_NIF_TERM submit_encoded(ErlNifEnv *env, const ERL_NIF_TERM argv[], int dirty)
{
	struct dp *s;
	struct dp_req_parts q = { .fence_ring = AP_DP_NO_FENCE };
	uint8_t name[DP_MAX_DEST_NAME];
	ErlNifBinary dest_bin = { 0 }, mbin;
	int own_dest = 0, published;
	ERL_NIF_TERM ret;
	struct ask_tag tag;

	if (submit_args(env, argv, &s, &q, name, &dest_bin, &own_dest, &tag) || q.kind == AP_DP_STATS ||
	    !enif_inspect_binary(env, argv[3], &mbin) || mbin.size < 2 || mbin.data[0] != 131) {
		ret = enif_make_badarg(env);
		goto done;
	}
	q.msg = mbin.data + 1;
	q.msg_len = mbin.size - 1;
	if (dp_req_len(q.dest_len, q.msg_len) > ap_ring_max_payload(s->seg.req_cap)) {
		cnt(&s->n_too_large);
		ret = a_too_large;
		goto done;
	}
	if (ap_term_validate_msg((const char *)mbin.data, mbin.size)) {
		ret = enif_make_badarg(env);
		goto done;
	}
	ret = submit_record(env, s, &q, &tag, dirty, &published);
	if (published)
		cnt(&s->n_encoded);
done:
	if (own_dest)
		enif_release_binary(&dest_bin);
	return ret;
}

static ERL_NIF_TERM nif_submit_encoded_dirty(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
{
	(void)argc;
	return submit_encoded(env, argv, 1);
}

ERL_NIF_TERM nif_submit_encoded(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
{
	ErlNifBinary b;

	struct dp *s;

	/* One that cannot fit is refused in the call, on its size. */
	if (enif_inspect_binary(env, argv[3], &b) && b.size > DP_ENC_INLINE && get_dp(env, argv[0], &s) &&
	    b.size - 1 <= ap_ring_max_payload(s->seg.req_cap))
		return enif_schedule_nif(env, "submit_encoded", ERL_NIF_DIRTY_JOB_CPU_BOUND, nif_submit_encoded_dirty,
					 argc, argv);
	return submit_encoded(env, argv, 0);
}

/* ---- marks ---------------------------------------------------------------------- */

/* consumed(Seg, Mark): whether the pool node has read the mark's ring up
 * to the mark. */
ERL_NIF_TERM nif_consumed(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
{
	struct dp *s;
	uint32_t ring;
	uint64_t pos, head;

	(void)argc;
	if (!get_dp(env, argv[0], &s) || !get_mark(env, s, argv[1], &ring, &pos))
		return enif_make_badarg(env);
	if (atomic_load(&s->closed))
		return a_closed;
	/* The peer's head, read once; a hostile value only makes the answer
	 * wrong, which costs the caller ordering, never memory. */
	head = __atomic_load_n(&s->req[ring].r.hdr->head, __ATOMIC_ACQUIRE);
	return head >= pos ? a_true : a_false;
}

/* mark(Seg, Ticket): where the ticket's ring ends now, for consumed/2. */
ERL_NIF_TERM nif_mark(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
{
	struct dp *s;
	unsigned ring;

	(void)argc;
	if (!get_dp(env, argv[0], &s) || !enif_get_uint(env, argv[1], &ring) || ring >= s->seg.n_req)
		return enif_make_badarg(env);
	if (atomic_load(&s->closed))
		return a_closed;
	return enif_make_uint64(env, ((req_tail(s, ring) & TK_POS_MASK) << TK_RING_BITS) | ring);
}
