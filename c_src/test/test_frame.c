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
	if ((int)s->nframes++ == s->stop_at)
		return s->stop_rc;
	return 0;
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
		ap_buf_free(&s.bytes);
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
	ap_buf_free(&s.bytes);
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
		ap_buf_free(&s.bytes);
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
	ap_buf_free(&s.bytes);
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
		ap_buf_free(&s.bytes);
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
		ap_buf_free(&s.bytes);
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
	ap_buf_free(&s.bytes);
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
	ap_buf_free(&s.bytes);
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
			ap_buf_free(&s.bytes);
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

static void test_garbage_never_crashes_and_matches_a_plain_reading(void **state)
{
	(void)state;
	t_rng r;
	t_rng_seed(&r, t_seed("garbage"));
	int emsgsize = 0, frames = 0;
	for (int iter = 0; iter < 3000; iter++) {
		size_t n = t_rand_range(&r, 0, 2048);
		uint32_t max = (uint32_t)t_rand_range(&r, 1, 64);
		uint8_t *d = malloc(n ? n : 1);
		assert_non_null(d);
		if (iter % 3 == 0) {
			/* Pure noise: lengths are almost always far too large. */
			for (size_t i = 0; i < n; i++)
				d[i] = (uint8_t)t_rand32(&r);
		} else {
			/* Frame-like noise: plausible headers (some a little over
			 * max) with random bodies, and now and then a random byte
			 * that puts everything after it out of step. */
			for (size_t i = 0; i < n;) {
				if (t_rand_range(&r, 0, 30) == 0) {
					d[i++] = (uint8_t)t_rand32(&r);
					continue;
				}
				uint8_t h[4];
				ap_put32be(h, (uint32_t)t_rand_range(&r, 0, max + 2));
				for (int k = 0; k < 4 && i < n; k++)
					d[i++] = h[k];
				for (size_t k = ap_get32be(h); k > 0 && i < n; k--)
					d[i++] = (uint8_t)t_rand32(&r);
			}
		}
		struct t_seen ref, s;
		t_seen_init(&ref);
		t_seen_init(&s);
		int want = t_reference(d, n, max, &ref);

		ap_frame_rx rx;
		ap_frame_rx_init(&rx, max);
		int got = 0;
		for (size_t at = 0; at < n && got == 0;) {
			size_t k = t_rand_range(&r, 1, 40);
			if (k > n - at)
				k = n - at;
			uint8_t *piece = t_dup(d + at, k);
			got = ap_frame_rx_feed(&rx, piece, k, t_on_frame, &s);
			free(piece);
			at += k;
		}
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
		ap_buf_free(&s.bytes);
		ap_buf_free(&ref.bytes);
		free(d);
	}
	/* Both outcomes were exercised. */
	assert_true(emsgsize > 100);
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
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
