/* test_frame: ap_frame_rx_feed reassembles the same frames, in order, however the stream is split. */
#include "t_helpers.h"

#include "ap_frame.h"

/* What the callback saw: every frame copied, one after another. */
struct t_seen {
	ap_buf bytes;     /* frame bodies back to back */
	size_t lens[4096];
	size_t nframes;
	int stop_at;      /* return stop_rc for this frame index (0-based); -1: never */
	int stop_rc;
	const uint8_t *in_lo, *in_hi; /* the buffer being fed, to spot copies */
	size_t zero_copy;             /* frames delivered straight from it */
	/* Oversized frames: their heads back to back, head and frame lengths. */
	ap_buf heads;
	size_t head_lens[512], over_lens[512];
	size_t nover;
	char order[4096];             /* 'f' a frame, 'o' an oversized head, as seen */
	size_t nevents;
};

static void t_seen_init(struct t_seen *s)
{
	memset(s, 0, sizeof *s);
	s->stop_at = -1;
}

static int t_on_frame(void *arg, const uint8_t *f, size_t len)
{
	struct t_seen *s = arg;
	assert_true(s->nframes < sizeof s->lens / sizeof s->lens[0]);
	if (len)
		assert_non_null(f);
	if (len && f >= s->in_lo && f + len <= s->in_hi)
		s->zero_copy++;
	s->lens[s->nframes] = len;
	assert_int_equal(ap_buf_append(&s->bytes, f, len), 0);
	assert_true(s->nevents < sizeof s->order);
	s->order[s->nevents++] = 'f';
	if ((int)s->nframes++ == s->stop_at)
		return s->stop_rc;
	return 0;
}

static int t_on_over(void *arg, const uint8_t *head, size_t hl, uint32_t flen)
{
	struct t_seen *s = arg;
	assert_true(s->nover < sizeof s->over_lens / sizeof s->over_lens[0]);
	assert_true(hl <= flen);
	if (hl)
		assert_non_null(head);
	s->head_lens[s->nover] = hl;
	s->over_lens[s->nover++] = flen;
	assert_int_equal(ap_buf_append(&s->heads, head, hl), 0);
	assert_true(s->nevents < sizeof s->order);
	s->order[s->nevents++] = 'o';
	if (s->stop_at == -2)
		return s->stop_rc; /* stop at the first oversized frame */
	return 0;
}

static void t_seen_free(struct t_seen *s)
{
	ap_buf_free(&s->bytes);
	ap_buf_free(&s->heads);
}

/* A stream of frames of the given lengths; the bodies are the test stream
 * pattern, so each frame's bytes also say where they belong. */
static ap_buf t_stream(const size_t *lens, size_t n)
{
	ap_buf b = { 0 };
	uint64_t off = 0;
	for (size_t i = 0; i < n; i++) {
		uint8_t h[4];
		ap_put32be(h, (uint32_t)lens[i]);
		assert_int_equal(ap_buf_append(&b, h, 4), 0);
		assert_int_equal(ap_buf_reserve(&b, lens[i]), 0);
		t_stream_fill(b.data + b.len, lens[i], off);
		b.len += lens[i];
		off += lens[i];
	}
	return b;
}

static void t_assert_frames(const struct t_seen *s, const size_t *lens, size_t n)
{
	assert_int_equal(s->nframes, n);
	size_t total = 0;
	for (size_t i = 0; i < n; i++) {
		if (s->lens[i] != lens[i])
			fail_msg("frame %zu: length %zu, sent %zu", i, s->lens[i], lens[i]);
		total += lens[i];
	}
	assert_int_equal(s->bytes.len, total);
	size_t bad = t_stream_check(s->bytes.data, total, 0);
	if (bad != total)
		fail_msg("frame bytes differ at offset %zu of %zu", bad, total);
}

/* Feed the stream cut at each offset in cuts[] (ascending). */
static int t_feed_cut(ap_frame_rx *rx, struct t_seen *s, const ap_buf *st, const size_t *cuts, size_t ncuts)
{
	size_t at = 0;
	for (size_t i = 0; i <= ncuts; i++) {
		size_t end = i < ncuts ? cuts[i] : st->len;
		/* Each piece in its own exact-size block, as a read would leave it. */
		uint8_t *piece = t_dup(st->data + at, end - at);
		s->in_lo = piece;
		s->in_hi = piece + (end - at);
		int r = ap_frame_rx_feed(rx, piece, end - at, t_on_frame, s);
		free(piece);
		if (r)
			return r;
		at = end;
	}
	return 0;
}

/* Data frames and ticks, some shorter than a header, one spanning many reads. */
static const size_t mix[] = { 0, 1, 5, 300, 0, 0, 4, 3, 1000, 0, 2, 7 };
#define NMIX (sizeof mix / sizeof mix[0])

static void test_frames_survive_every_single_split(void **state)
{
	(void)state;
	ap_buf st = t_stream(mix, NMIX);
	for (size_t cut = 0; cut <= st.len; cut++) {
		ap_frame_rx rx;
		struct t_seen s;
		t_seen_init(&s);
		ap_frame_rx_init(&rx, 4096);
		if (t_feed_cut(&rx, &s, &st, &cut, 1) != 0)
			fail_msg("split at %zu: feed failed", cut);
		t_assert_frames(&s, mix, NMIX);
		assert_int_equal(rx.part.len, 0);
		ap_frame_rx_free(&rx);
		t_seen_free(&s);
	}
	ap_buf_free(&st);
}

static void test_frames_survive_byte_by_byte(void **state)
{
	(void)state;
	static const size_t lens[] = { 0, 70000, 0, 1, 0, 65536, 9 };
	ap_buf st = t_stream(lens, 7);
	size_t *cuts = malloc(st.len * sizeof *cuts);
	assert_non_null(cuts);
	for (size_t i = 0; i < st.len - 1; i++)
		cuts[i] = i + 1;
	ap_frame_rx rx;
	struct t_seen s;
	t_seen_init(&s);
	ap_frame_rx_init(&rx, 0);
	assert_int_equal(t_feed_cut(&rx, &s, &st, cuts, st.len - 1), 0);
	t_assert_frames(&s, lens, 7);
	assert_int_equal(s.zero_copy, 0); /* nothing fit in one byte */
	ap_frame_rx_free(&rx);
	t_seen_free(&s);
	free(cuts);
	ap_buf_free(&st);
}

static void test_frames_survive_random_splits(void **state)
{
	(void)state;
	t_rng r;
	t_rng_seed(&r, t_seed("random splits"));
	ap_buf st = t_stream(mix, NMIX);
	size_t cuts[64];
	for (int iter = 0; iter < 2000; iter++) {
		size_t n = t_rand_range(&r, 1, 63);
		for (size_t i = 0; i < n; i++)
			cuts[i] = t_rand_range(&r, 0, st.len);
		/* ascending; repeated cuts make empty reads, which must be harmless */
		for (size_t i = 1; i < n; i++)
			for (size_t j = i; j > 0 && cuts[j - 1] > cuts[j]; j--) {
				size_t t = cuts[j];
				cuts[j] = cuts[j - 1];
				cuts[j - 1] = t;
			}
		ap_frame_rx rx;
		struct t_seen s;
		t_seen_init(&s);
		ap_frame_rx_init(&rx, 4096);
		assert_int_equal(t_feed_cut(&rx, &s, &st, cuts, n), 0);
		t_assert_frames(&s, mix, NMIX);
		ap_frame_rx_free(&rx);
		t_seen_free(&s);
	}
	ap_buf_free(&st);
}

static void test_whole_frames_in_one_buffer_are_passed_without_copy(void **state)
{
	(void)state;
	ap_buf st = t_stream(mix, NMIX);
	ap_frame_rx rx;
	struct t_seen s;
	t_seen_init(&s);
	ap_frame_rx_init(&rx, 4096);
	assert_int_equal(t_feed_cut(&rx, &s, &st, NULL, 0), 0);
	t_assert_frames(&s, mix, NMIX);
	size_t data_frames = 0;
	for (size_t i = 0; i < NMIX; i++)
		data_frames += mix[i] > 0;
	assert_int_equal(s.zero_copy, data_frames);
	assert_int_equal(rx.part.len, 0);
	ap_frame_rx_free(&rx);
	t_seen_free(&s);
	ap_buf_free(&st);
}

static void test_ticks_are_delivered_as_zero_length(void **state)
{
	(void)state;
	static const uint8_t ticks[12] = { 0 };
	for (size_t cut = 0; cut <= sizeof ticks; cut++) {
		ap_frame_rx rx;
		struct t_seen s;
		t_seen_init(&s);
		ap_frame_rx_init(&rx, 16);
		assert_int_equal(ap_frame_rx_feed(&rx, ticks, cut, t_on_frame, &s), 0);
		assert_int_equal(ap_frame_rx_feed(&rx, ticks + cut, sizeof ticks - cut, t_on_frame, &s), 0);
		assert_int_equal(s.nframes, 3);
		for (int i = 0; i < 3; i++)
			assert_int_equal(s.lens[i], 0);
		ap_frame_rx_free(&rx);
		t_seen_free(&s);
	}
}

static void test_frame_over_max_is_emsgsize(void **state)
{
	(void)state;
	/* Two good frames (one exactly max_frame long), then one a byte over. */
	static const size_t lens[] = { 3, 100, 101, 5 };
	ap_buf st = t_stream(lens, 4);
	size_t bad_at = 4 + 3 + 4 + 100; /* where the oversized header starts */
	for (size_t cut = 0; cut <= st.len; cut++) {
		ap_frame_rx rx;
		struct t_seen s;
		t_seen_init(&s);
		ap_frame_rx_init(&rx, 100);
		int r1 = ap_frame_rx_feed(&rx, st.data, cut, t_on_frame, &s);
		int r2 = r1 ? r1 : ap_frame_rx_feed(&rx, st.data + cut, st.len - cut, t_on_frame, &s);
		/* The whole header decides; a part of it never does. */
		if (cut >= bad_at + 4)
			assert_int_equal(r1, -EMSGSIZE);
		else
			assert_int_equal(r1, 0);
		if (r2 != -EMSGSIZE)
			fail_msg("split at %zu: %d, not -EMSGSIZE", cut, r2);
		t_assert_frames(&s, lens, 2);
		ap_frame_rx_free(&rx);
		t_seen_free(&s);
	}
	ap_buf_free(&st);
}

static void test_header_split_byte_by_byte_over_max_is_emsgsize(void **state)
{
	(void)state;
	static const uint8_t h[4] = { 0x7f, 0xff, 0xff, 0xff };
	ap_frame_rx rx;
	struct t_seen s;
	t_seen_init(&s);
	ap_frame_rx_init(&rx, 1 << 20);
	for (int i = 0; i < 3; i++)
		assert_int_equal(ap_frame_rx_feed(&rx, h + i, 1, t_on_frame, &s), 0);
	assert_int_equal(ap_frame_rx_feed(&rx, h + 3, 1, t_on_frame, &s), -EMSGSIZE);
	assert_int_equal(s.nframes, 0);
	/* Nothing was reserved for the phantom 2 GiB body. */
	assert_true(rx.part.cap < 4096);
	ap_frame_rx_free(&rx);
}

static void test_default_max_is_64_mib(void **state)
{
	(void)state;
	uint8_t h[4];
	ap_frame_rx rx;
	struct t_seen s;
	t_seen_init(&s);
	ap_frame_rx_init(&rx, 0);
	assert_int_equal(rx.max_frame, AP_FRAME_DEFAULT_MAX);
	ap_put32be(h, AP_FRAME_DEFAULT_MAX + 1);
	assert_int_equal(ap_frame_rx_feed(&rx, h, 4, t_on_frame, &s), -EMSGSIZE);
	ap_frame_rx_free(&rx);
	/* Exactly the maximum is a frame, still waiting for its body. */
	ap_frame_rx_init(&rx, 0);
	ap_put32be(h, AP_FRAME_DEFAULT_MAX);
	assert_int_equal(ap_frame_rx_feed(&rx, h, 4, t_on_frame, &s), 0);
	assert_int_equal(s.nframes, 0);
	ap_frame_rx_free(&rx);
}

/* A 64 MiB header and 10 body bytes, in one read and split: the buffer
 * holds what came, not what was announced. */
static void test_announced_length_reserves_nothing(void **state)
{
	(void)state;
	uint8_t b[14] = { 0 };
	ap_put32be(b, AP_FRAME_DEFAULT_MAX);
	memset(b + 4, 'x', 10);
	for (size_t cut = 0; cut <= sizeof b; cut++) {
		ap_frame_rx rx;
		struct t_seen s;
		t_seen_init(&s);
		ap_frame_rx_init(&rx, 0);
		assert_int_equal(ap_frame_rx_feed(&rx, b, cut, t_on_frame, &s), 0);
		assert_int_equal(ap_frame_rx_feed(&rx, b + cut, sizeof b - cut, t_on_frame, &s), 0);
		assert_int_equal(s.nframes, 0);
		assert_int_equal(rx.part.len, sizeof b);
		if (rx.part.cap > 4096)
			fail_msg("split at %zu: %zu bytes reserved for %zu received", cut, rx.part.cap, sizeof b);
		ap_frame_rx_free(&rx);
	}
}

/* A large frame in small reads: the buffer doubles with the bytes (never
 * past the frame), and is given back once the frame is delivered. */
static void test_large_frame_grows_with_its_bytes_and_is_given_back(void **state)
{
	(void)state;
	static const size_t lens[] = { 3u << 20, 5 };
	ap_buf st = t_stream(lens, 2);
	ap_frame_rx rx;
	struct t_seen s;
	t_seen_init(&s);
	ap_frame_rx_init(&rx, 0);
	size_t at = 0, step = 64 * 1024;
	while (at < 4 + lens[0]) {
		size_t n = at + step <= 4 + lens[0] ? step : 4 + lens[0] - at;
		assert_int_equal(ap_frame_rx_feed(&rx, st.data + at, n, t_on_frame, &s), 0);
		at += n;
		if (s.nframes == 0) {
			assert_int_equal(rx.part.len, at);
			if (rx.part.cap > 2 * at + 256 || rx.part.cap > 4 + lens[0])
				fail_msg("%zu bytes reserved after %zu received", rx.part.cap, at);
		}
	}
	assert_int_equal(s.nframes, 1);
	assert_true(rx.part.cap <= AP_FRAME_KEEP);
	/* The next frame, split, starts small again. */
	assert_int_equal(ap_frame_rx_feed(&rx, st.data + at, 6, t_on_frame, &s), 0);
	assert_true(rx.part.cap <= 4096);
	assert_int_equal(ap_frame_rx_feed(&rx, st.data + at + 6, st.len - at - 6, t_on_frame, &s), 0);
	t_assert_frames(&s, lens, 2);
	ap_frame_rx_free(&rx);
	t_seen_free(&s);
	ap_buf_free(&st);
}

/* A small frame keeps its buffer for the next one: no churn per frame. */
static void test_small_frames_keep_their_buffer(void **state)
{
	(void)state;
	static const size_t lens[] = { 1000, 1000 };
	ap_buf st = t_stream(lens, 2);
	ap_frame_rx rx;
	struct t_seen s;
	t_seen_init(&s);
	ap_frame_rx_init(&rx, 0);
	assert_int_equal(ap_frame_rx_feed(&rx, st.data, 500, t_on_frame, &s), 0);
	assert_int_equal(ap_frame_rx_feed(&rx, st.data + 500, 504, t_on_frame, &s), 0);
	assert_int_equal(s.nframes, 1);
	assert_non_null(rx.part.data);
	assert_true(rx.part.cap >= 500 && rx.part.cap <= 1004);
	assert_int_equal(ap_frame_rx_feed(&rx, st.data + 1004, st.len - 1004, t_on_frame, &s), 0);
	t_assert_frames(&s, lens, 2);
	ap_frame_rx_free(&rx);
	t_seen_free(&s);
	ap_buf_free(&st);
}

static void test_callback_return_stops_feed_and_is_propagated(void **state)
{
	(void)state;
	ap_buf st = t_stream(mix, NMIX);
	/* Stop at every frame in turn, with the stream fed whole and split at
	 * every offset: the value comes back and nothing after it is seen. */
	for (size_t stop = 0; stop < NMIX; stop++) {
		for (size_t cut = 0; cut <= st.len; cut++) {
			ap_frame_rx rx;
			struct t_seen s;
			t_seen_init(&s);
			s.stop_at = (int)stop;
			s.stop_rc = -1000 - (int)stop;
			ap_frame_rx_init(&rx, 4096);
			int r = t_feed_cut(&rx, &s, &st, &cut, 1);
			if (r != s.stop_rc)
				fail_msg("stop at frame %zu, split at %zu: feed returned %d", stop, cut, r);
			t_assert_frames(&s, mix, stop + 1);
			ap_frame_rx_free(&rx);
			t_seen_free(&s);
		}
	}
	ap_buf_free(&st);
}

/* The frames a plain reading of the whole stream gives, and whether it hits
 * an oversized length: what any chunking must reproduce. */
static int t_reference(const uint8_t *d, size_t n, uint32_t max, struct t_seen *ref)
{
	size_t i = 0;
	while (n - i >= 4) {
		uint32_t flen = ap_get32be(d + i);
		if (flen > max)
			return -EMSGSIZE;
		if (flen > n - i - 4)
			break;
		t_on_frame(ref, d + i + 4, flen);
		i += 4 + flen;
	}
	return 0;
}

/* Random input for max: pure noise (lengths almost always far too large)
 * every third time, else frame-like noise: plausible headers (some a
 * little over max) with random bodies, and now and then a random byte that
 * puts everything after it out of step. */
static uint8_t *t_garbage(t_rng *r, int iter, size_t n, uint32_t max)
{
	uint8_t *d = malloc(n ? n : 1);
	assert_non_null(d);
	if (iter % 3 == 0) {
		for (size_t i = 0; i < n; i++)
			d[i] = (uint8_t)t_rand32(r);
		return d;
	}
	for (size_t i = 0; i < n;) {
		if (t_rand_range(r, 0, 30) == 0) {
			d[i++] = (uint8_t)t_rand32(r);
			continue;
		}
		uint8_t h[4];
		ap_put32be(h, (uint32_t)t_rand_range(r, 0, max + 2));
		for (int k = 0; k < 4 && i < n; k++)
			d[i++] = h[k];
		for (size_t k = ap_get32be(h); k > 0 && i < n; k--)
			d[i++] = (uint8_t)t_rand32(r);
	}
	return d;
}

/* Feed d in random pieces of 1 to 40 bytes, each in its own block. */
static int t_feed_random(t_rng *r, ap_frame_rx *rx, struct t_seen *s, const uint8_t *d, size_t n)
{
	int got = 0;
	for (size_t at = 0; at < n && got == 0;) {
		size_t k = t_rand_range(r, 1, 40);
		if (k > n - at)
			k = n - at;
		uint8_t *piece = t_dup(d + at, k);
		got = ap_frame_rx_feed(rx, piece, k, t_on_frame, s);
		free(piece);
		at += k;
	}
	return got;
}

static void test_garbage_never_crashes_and_matches_a_plain_reading(void **state)
{
	(void)state;
	t_rng r;
	t_rng_seed(&r, t_seed("garbage"));
	int emsgsize = 0, frames = 0;
	for (int iter = 0; iter < 3000; iter++) {
		size_t n = t_rand_range(&r, 0, 2048);
		uint32_t max = (uint32_t)t_rand_range(&r, 1, 64);
		uint8_t *d = t_garbage(&r, iter, n, max);
		struct t_seen ref, s;
		t_seen_init(&ref);
		t_seen_init(&s);
		int want = t_reference(d, n, max, &ref);

		ap_frame_rx rx;
		ap_frame_rx_init(&rx, max);
		int got = t_feed_random(&r, &rx, &s, d, n);
		if (got != 0 && got != -EMSGSIZE)
			fail_msg("iteration %d: feed returned %d", iter, got);
		assert_int_equal(got, want);
		assert_int_equal(s.nframes, ref.nframes);
		for (size_t i = 0; i < s.nframes; i++) {
			assert_true(s.lens[i] <= max);
			assert_int_equal(s.lens[i], ref.lens[i]);
		}
		assert_int_equal(s.bytes.len, ref.bytes.len);
		if (s.bytes.len)
			assert_memory_equal(s.bytes.data, ref.bytes.data, s.bytes.len);
		emsgsize += got == -EMSGSIZE;
		frames += (int)s.nframes;
		ap_frame_rx_free(&rx);
		t_seen_free(&s);
		t_seen_free(&ref);
		free(d);
	}
	/* Both outcomes were exercised. */
	assert_true(emsgsize > 100);
	assert_true(frames > 1000);
}

/* ---- frames over max_frame, passed over (ap_frame_rx_on_oversize) ------- */

/* What a plain reading of the whole stream gives when oversized frames are
 * passed over: their heads, where they are complete, and the frames after. */
static void t_reference_skip(const uint8_t *d, size_t n, uint32_t max, uint32_t head_max, struct t_seen *ref)
{
	size_t i = 0;
	while (n - i >= 4) {
		uint32_t flen = ap_get32be(d + i);
		size_t keep = flen <= max ? flen : flen < head_max ? flen : head_max;
		if (keep > n - i - 4)
			break;
		if (flen <= max)
			t_on_frame(ref, d + i + 4, flen);
		else
			t_on_over(ref, d + i + 4, keep, flen);
		if ((size_t)flen >= n - i - 4)
			break; /* the rest of it never came */
		i += 4 + (size_t)flen;
	}
}

static void t_assert_same(const struct t_seen *s, const struct t_seen *ref, const char *what, size_t at)
{
	if (s->nevents != ref->nevents || memcmp(s->order, ref->order, s->nevents))
		fail_msg("%s %zu: %zu events (%.*s), a plain reading gives %zu (%.*s)", what, at, s->nevents,
			 (int)s->nevents, s->order, ref->nevents, (int)ref->nevents, ref->order);
	assert_int_equal(s->nframes, ref->nframes);
	for (size_t i = 0; i < s->nframes; i++)
		assert_int_equal(s->lens[i], ref->lens[i]);
	assert_int_equal(s->bytes.len, ref->bytes.len);
	if (s->bytes.len)
		assert_memory_equal(s->bytes.data, ref->bytes.data, s->bytes.len);
	assert_int_equal(s->nover, ref->nover);
	for (size_t i = 0; i < s->nover; i++) {
		assert_int_equal(s->head_lens[i], ref->head_lens[i]);
		assert_int_equal(s->over_lens[i], ref->over_lens[i]);
	}
	assert_int_equal(s->heads.len, ref->heads.len);
	if (s->heads.len)
		assert_memory_equal(s->heads.data, ref->heads.data, s->heads.len);
}

/* Normal frames and ticks around oversized ones (max 100): some back to
 * back, one only just over, one far over, one shorter than a head. */
static const size_t omix[] = { 3, 150, 0, 101, 100, 20000, 120, 7, 0, 333, 1000, 5, 101 };
#define NOMIX (sizeof omix / sizeof omix[0])
#define OMAX 100
/* Heads shorter than every oversized frame, and longer than some. */
static const uint32_t ohead[] = { 16, 128 };

static void t_rx_skipping(ap_frame_rx *rx, uint32_t head_max)
{
	ap_frame_rx_init(rx, OMAX);
	ap_frame_rx_on_oversize(rx, t_on_over, head_max);
}

static void test_oversized_frames_are_passed_over_at_every_split(void **state)
{
	(void)state;
	ap_buf st = t_stream(omix, NOMIX);
	for (size_t h = 0; h < 2; h++) {
		struct t_seen ref;
		t_seen_init(&ref);
		t_reference_skip(st.data, st.len, OMAX, ohead[h], &ref);
		assert_int_equal(ref.nover, 7);
		assert_int_equal(ref.nframes, NOMIX - 7);
		for (size_t cut = 0; cut <= st.len; cut++) {
			ap_frame_rx rx;
			struct t_seen s;
			t_seen_init(&s);
			t_rx_skipping(&rx, ohead[h]);
			if (t_feed_cut(&rx, &s, &st, &cut, 1) != 0)
				fail_msg("split at %zu: feed failed", cut);
			t_assert_same(&s, &ref, "split at", cut);
			assert_int_equal(rx.part.len, 0);
			assert_int_equal(rx.skip, 0);
			/* Never more than a normal frame or a head: the 20000-byte
			 * frame took no buffer of its size. */
			assert_true(rx.part.cap <= 256);
			ap_frame_rx_free(&rx);
			t_seen_free(&s);
		}
		t_seen_free(&ref);
	}
	ap_buf_free(&st);
}

static void test_oversized_frames_are_passed_over_byte_by_byte(void **state)
{
	(void)state;
	ap_buf st = t_stream(omix, NOMIX);
	size_t *cuts = malloc(st.len * sizeof *cuts);
	assert_non_null(cuts);
	for (size_t i = 0; i < st.len - 1; i++)
		cuts[i] = i + 1;
	for (size_t h = 0; h < 2; h++) {
		struct t_seen ref, s;
		t_seen_init(&ref);
		t_seen_init(&s);
		t_reference_skip(st.data, st.len, OMAX, ohead[h], &ref);
		ap_frame_rx rx;
		t_rx_skipping(&rx, ohead[h]);
		assert_int_equal(t_feed_cut(&rx, &s, &st, cuts, st.len - 1), 0);
		t_assert_same(&s, &ref, "head", h);
		assert_int_equal(s.zero_copy, 0);
		assert_true(rx.part.cap <= 256);
		ap_frame_rx_free(&rx);
		t_seen_free(&s);
		t_seen_free(&ref);
	}
	free(cuts);
	ap_buf_free(&st);
}

/* Every pair of cuts in a short stream: the header and the head of the
 * oversized frame split over three reads in every way. */
static void test_oversized_header_and_head_split_over_reads(void **state)
{
	(void)state;
	static const size_t lens[] = { 5, 200, 3 };
	ap_buf st = t_stream(lens, 3);
	struct t_seen ref;
	t_seen_init(&ref);
	t_reference_skip(st.data, st.len, OMAX, 16, &ref);
	assert_int_equal(ref.nover, 1);
	assert_int_equal(ref.head_lens[0], 16);
	for (size_t a = 0; a <= st.len; a++)
		for (size_t b = a; b <= st.len; b++) {
			size_t cuts[2] = { a, b };
			ap_frame_rx rx;
			struct t_seen s;
			t_seen_init(&s);
			t_rx_skipping(&rx, 16);
			assert_int_equal(t_feed_cut(&rx, &s, &st, cuts, 2), 0);
			t_assert_same(&s, &ref, "cuts from", a * 1000 + b);
			ap_frame_rx_free(&rx);
			t_seen_free(&s);
		}
	t_seen_free(&ref);
	ap_buf_free(&st);
}

static void test_back_to_back_oversized_and_normal_frames_at_random_splits(void **state)
{
	(void)state;
	t_rng r;
	t_rng_seed(&r, t_seed("oversized random"));
	for (int iter = 0; iter < 500; iter++) {
		/* 1 to 40 frames, half of them oversized, in any order. */
		size_t lens[40], nl = t_rand_range(&r, 1, 40);
		for (size_t i = 0; i < nl; i++)
			lens[i] = t_rand_range(&r, 0, 1) ? t_rand_range(&r, OMAX + 1, 3000) : t_rand_range(&r, 0, OMAX);
		ap_buf st = t_stream(lens, nl);
		uint32_t head_max = (uint32_t)t_rand_range(&r, 1, 200);
		struct t_seen ref, s;
		t_seen_init(&ref);
		t_seen_init(&s);
		t_reference_skip(st.data, st.len, OMAX, head_max, &ref);
		assert_int_equal(ref.nevents, nl);
		ap_frame_rx rx;
		ap_frame_rx_init(&rx, OMAX);
		ap_frame_rx_on_oversize(&rx, t_on_over, head_max);
		assert_int_equal(t_feed_random(&r, &rx, &s, st.data, st.len), 0);
		t_assert_same(&s, &ref, "iteration", (size_t)iter);
		assert_int_equal(rx.skip, 0);
		assert_int_equal(rx.part.len, 0);
		ap_frame_rx_free(&rx);
		t_seen_free(&s);
		t_seen_free(&ref);
		ap_buf_free(&st);
	}
}

/* A frame announced at 4 GiB - 1, all of it sent in 1 MiB reads (the
 * header split), then a normal frame in the read that ends it: the node
 * reads it all and keeps only the head. */
static void test_a_4_gib_frame_costs_reads_not_memory(void **state)
{
	(void)state;
	const size_t chunk = 1u << 20;
	uint8_t *zeros = calloc(1, chunk + 16);
	assert_non_null(zeros);
	ap_frame_rx rx;
	struct t_seen s;
	t_seen_init(&s);
	ap_frame_rx_init(&rx, 1u << 20);
	ap_frame_rx_on_oversize(&rx, t_on_over, 0);
	uint8_t h[4];
	ap_put32be(h, UINT32_MAX);
	assert_int_equal(ap_frame_rx_feed(&rx, h, 2, t_on_frame, &s), 0);
	assert_int_equal(ap_frame_rx_feed(&rx, h + 2, 2, t_on_frame, &s), 0);
	uint64_t left = UINT32_MAX;
	size_t maxcap = 0;
	while (left >= chunk) {
		assert_int_equal(ap_frame_rx_feed(&rx, zeros, chunk, t_on_frame, &s), 0);
		left -= chunk;
		maxcap = rx.part.cap > maxcap ? rx.part.cap : maxcap;
	}
	assert_int_equal(s.nover, 1);
	assert_int_equal(s.over_lens[0], UINT32_MAX);
	assert_int_equal(s.head_lens[0], AP_FRAME_HEAD_DEFAULT);
	assert_int_equal(s.nframes, 0);
	assert_int_equal(rx.skip, left);
	/* The rest of it and a 5-byte frame in one read. */
	uint8_t *last = calloc(1, (size_t)left + 9);
	assert_non_null(last);
	ap_put32be(last + left, 5);
	memcpy(last + left + 4, "hello", 5);
	assert_int_equal(ap_frame_rx_feed(&rx, last, (size_t)left + 9, t_on_frame, &s), 0);
	assert_int_equal(s.nframes, 1);
	assert_int_equal(s.lens[0], 5);
	assert_memory_equal(s.bytes.data, "hello", 5);
	assert_int_equal(rx.skip, 0);
	if (maxcap > 4 + AP_FRAME_HEAD_DEFAULT)
		fail_msg("%zu bytes buffered for a frame passed over", maxcap);
	ap_frame_rx_free(&rx);
	t_seen_free(&s);
	free(last);
	free(zeros);
}

/* The head kept of an oversized frame follows max_frame: a node with a
 * small max_frame keeps AP_FRAME_HEAD_MIN, one with a mid-sized max_frame
 * keeps max_frame, a large one AP_FRAME_HEAD_DEFAULT; and never more
 * buffer than the head and its length. */
static void test_oversized_head_follows_max_frame(void **state)
{
	(void)state;
	static const struct { uint32_t max, head; } cases[] = {
		{ 1024, AP_FRAME_HEAD_MIN },
		{ 16u << 10, 16u << 10 },
		{ 64u << 10, AP_FRAME_HEAD_DEFAULT },
		{ 1u << 20, AP_FRAME_HEAD_DEFAULT },
	};
	const size_t flen = 2u << 20;
	uint8_t *d = calloc(1, 4 + flen);
	assert_non_null(d);
	ap_put32be(d, (uint32_t)flen);
	for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
		ap_frame_rx rx;
		struct t_seen s;
		t_seen_init(&s);
		ap_frame_rx_init(&rx, cases[k].max);
		ap_frame_rx_on_oversize(&rx, t_on_over, 0);
		size_t maxcap = 0;
		for (size_t at = 0; at < 4 + flen; at += 1000) {
			size_t n = 4 + flen - at < 1000 ? 4 + flen - at : 1000;
			assert_int_equal(ap_frame_rx_feed(&rx, d + at, n, t_on_frame, &s), 0);
			maxcap = rx.part.cap > maxcap ? rx.part.cap : maxcap;
		}
		assert_int_equal(s.nover, 1);
		if (s.head_lens[0] != cases[k].head)
			fail_msg("max_frame %u: head of %zu bytes kept, want %u", cases[k].max, s.head_lens[0],
				 cases[k].head);
		if (maxcap > 4 + (size_t)cases[k].head)
			fail_msg("max_frame %u: %zu bytes buffered for a head of %u", cases[k].max, maxcap,
				 cases[k].head);
		ap_frame_rx_free(&rx);
		t_seen_free(&s);
	}
	free(d);
}

/* Oversized frames whose default head (64 KiB, plus 4 bytes of length) is
 * assembled over reads reuse one buffer: it is not freed after each one
 * and grown again for the next. */
static void test_oversized_heads_over_reads_keep_their_buffer(void **state)
{
	(void)state;
	const size_t flen = 100u << 10;
	uint8_t *d = calloc(1, 4 + flen);
	assert_non_null(d);
	ap_put32be(d, (uint32_t)flen);
	ap_frame_rx rx;
	struct t_seen s;
	t_seen_init(&s);
	ap_frame_rx_init(&rx, 64u << 10);
	ap_frame_rx_on_oversize(&rx, t_on_over, 0);
	const uint8_t *buf = NULL;
	for (int f = 0; f < 3; f++) {
		for (size_t at = 0; at < 4 + flen; at += 4096) {
			size_t n = 4 + flen - at < 4096 ? 4 + flen - at : 4096;
			assert_int_equal(ap_frame_rx_feed(&rx, d + at, n, t_on_frame, &s), 0);
		}
		assert_int_equal(s.nover, (size_t)f + 1);
		assert_int_equal(s.head_lens[f], AP_FRAME_HEAD_DEFAULT);
		if (!rx.part.data)
			fail_msg("oversized frame %d: the head's buffer was given back", f);
		if (f > 0)
			assert_ptr_equal(rx.part.data, buf);
		buf = rx.part.data;
		assert_true(rx.part.cap <= 4 + (size_t)AP_FRAME_HEAD_DEFAULT);
	}
	ap_frame_rx_free(&rx);
	t_seen_free(&s);
	free(d);
}

static void test_oversize_callback_return_stops_feed_and_is_propagated(void **state)
{
	(void)state;
	ap_buf st = t_stream(omix, NOMIX);
	for (size_t cut = 0; cut <= st.len; cut++) {
		ap_frame_rx rx;
		struct t_seen s;
		t_seen_init(&s);
		s.stop_at = -2;
		s.stop_rc = -77;
		t_rx_skipping(&rx, 16);
		int r = t_feed_cut(&rx, &s, &st, &cut, 1);
		if (r != -77)
			fail_msg("split at %zu: feed returned %d", cut, r);
		/* The first frame, then the first oversized head, nothing after. */
		assert_int_equal(s.nevents, 2);
		assert_memory_equal(s.order, "fo", 2);
		ap_frame_rx_free(&rx);
		t_seen_free(&s);
	}
	ap_buf_free(&st);
}

/* The garbage test again, passing oversized frames over: the same frames
 * and heads as a plain reading, never an error, memory bounded by a head. */
static void test_garbage_with_oversize_passed_over_matches_a_plain_reading(void **state)
{
	(void)state;
	t_rng r;
	t_rng_seed(&r, t_seed("garbage skipping"));
	size_t overs = 0, frames = 0;
	for (int iter = 0; iter < 3000; iter++) {
		size_t n = t_rand_range(&r, 0, 2048);
		uint32_t max = (uint32_t)t_rand_range(&r, 1, 64);
		uint32_t head_max = (uint32_t)t_rand_range(&r, 1, 80);
		uint8_t *d = t_garbage(&r, iter, n, max);
		struct t_seen ref, s;
		t_seen_init(&ref);
		t_seen_init(&s);
		t_reference_skip(d, n, max, head_max, &ref);
		ap_frame_rx rx;
		ap_frame_rx_init(&rx, max);
		ap_frame_rx_on_oversize(&rx, t_on_over, head_max);
		assert_int_equal(t_feed_random(&r, &rx, &s, d, n), 0);
		t_assert_same(&s, &ref, "iteration", (size_t)iter);
		assert_true(rx.part.cap <= 256);
		overs += s.nover;
		frames += s.nframes;
		ap_frame_rx_free(&rx);
		t_seen_free(&s);
		t_seen_free(&ref);
		free(d);
	}
	assert_true(overs > 1000);
	assert_true(frames > 1000);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_frames_survive_every_single_split),
		cmocka_unit_test(test_frames_survive_byte_by_byte),
		cmocka_unit_test(test_frames_survive_random_splits),
		cmocka_unit_test(test_whole_frames_in_one_buffer_are_passed_without_copy),
		cmocka_unit_test(test_ticks_are_delivered_as_zero_length),
		cmocka_unit_test(test_frame_over_max_is_emsgsize),
		cmocka_unit_test(test_header_split_byte_by_byte_over_max_is_emsgsize),
		cmocka_unit_test(test_default_max_is_64_mib),
		cmocka_unit_test(test_announced_length_reserves_nothing),
		cmocka_unit_test(test_large_frame_grows_with_its_bytes_and_is_given_back),
		cmocka_unit_test(test_small_frames_keep_their_buffer),
		cmocka_unit_test(test_callback_return_stops_feed_and_is_propagated),
		cmocka_unit_test(test_garbage_never_crashes_and_matches_a_plain_reading),
		cmocka_unit_test(test_oversized_frames_are_passed_over_at_every_split),
		cmocka_unit_test(test_oversized_frames_are_passed_over_byte_by_byte),
		cmocka_unit_test(test_oversized_header_and_head_split_over_reads),
		cmocka_unit_test(test_back_to_back_oversized_and_normal_frames_at_random_splits),
		cmocka_unit_test(test_a_4_gib_frame_costs_reads_not_memory),
		cmocka_unit_test(test_oversized_head_follows_max_frame),
		cmocka_unit_test(test_oversized_heads_over_reads_keep_their_buffer),
		cmocka_unit_test(test_oversize_callback_return_stops_feed_and_is_propagated),
		cmocka_unit_test(test_garbage_with_oversize_passed_over_matches_a_plain_reading),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
