/* test_thumbnail: the example JPEG plugin makes thumbnails of the asked size and shape, and refuses what is not a JPEG. */
#include "t_reply.h"

#include <turbojpeg.h>

#include "handlers.h"

#ifndef T_BUILD_DIR
#error "T_BUILD_DIR: where the Makefile put the sanitized thumbnail.so"
#endif

struct t_plugin {
	const actor_pool_handler *h;
	void *dl;
};

static struct t_plugin t_open(const char *path)
{
	struct t_plugin p;
	uint32_t got;
	char why[256];

	if (ap_plugin_load(path, &p.h, &p.dl, &got, why, sizeof why))
		fail_msg("%s: %s", path, why);
	assert_string_equal(p.h->name, "thumbnail");
	return p;
}

/* A w x h JPEG whose red grows left to right and green top to bottom, so a
 * thumbnail that is mirrored, shifted or garbled shows. */
static uint8_t *t_jpeg(int w, int h, int gray, size_t *len)
{
	int ch = gray ? 1 : 3;
	uint8_t *px = malloc((size_t)w * (size_t)h * (size_t)ch);
	unsigned char *jpeg = NULL;
	unsigned long jlen = 0;
	tjhandle enc = tjInitCompress();

	assert_non_null(px);
	assert_non_null(enc);
	for (int y = 0; y < h; y++)
		for (int x = 0; x < w; x++) {
			uint8_t *p = px + ((size_t)y * (size_t)w + (size_t)x) * (size_t)ch;
			p[0] = (uint8_t)(x * 255 / (w > 1 ? w - 1 : 1));
			if (!gray) {
				p[1] = (uint8_t)(y * 255 / (h > 1 ? h - 1 : 1));
				p[2] = 128;
			}
		}
	assert_int_equal(tjCompress2(enc, px, w, 0, h, gray ? TJPF_GRAY : TJPF_RGB, &jpeg, &jlen,
				     gray ? TJSAMP_GRAY : TJSAMP_444, 95, 0), 0);
	uint8_t *out = t_dup(jpeg, jlen);
	*len = jlen;
	tjFree(jpeg);
	tjDestroy(enc);
	free(px);
	return out;
}

/* {thumbnail, Jpeg, MaxSide} */
static void t_thumb_req(ei_x_buff *x, const uint8_t *jpeg, size_t len, long max_side)
{
	ei_x_new_with_version(x);
	ei_x_encode_tuple_header(x, 3);
	ei_x_encode_atom(x, "thumbnail");
	ei_x_encode_binary(x, jpeg, (long)len);
	ei_x_encode_long(x, max_side);
}

struct t_img {
	int w, h, samp, cs;
	uint8_t *px; /* RGB, or gray for a gray JPEG */
};

static struct t_img t_decode(const uint8_t *jpeg, size_t len)
{
	struct t_img im = { 0 };
	tjhandle dec = tjInitDecompress();

	assert_non_null(dec);
	assert_int_equal(tjDecompressHeader3(dec, jpeg, len, &im.w, &im.h, &im.samp, &im.cs), 0);
	int pf = im.cs == TJCS_GRAY ? TJPF_GRAY : TJPF_RGB;
	im.px = malloc((size_t)im.w * (size_t)im.h * (size_t)tjPixelSize[pf]);
	assert_non_null(im.px);
	assert_int_equal(tjDecompress2(dec, jpeg, len, im.px, im.w, 0, im.h, pf, 0), 0);
	tjDestroy(dec);
	return im;
}

/* Asks for a thumbnail and decodes it; checks the size against want_w x
 * want_h. */
static struct t_img t_thumb(const actor_pool_handler *h, void *state, const void *req, size_t len, int is_binary,
			    int want_w, int want_h)
{
	actor_pool_reply reply;

	t_reply_init(&reply);
	assert_int_equal(t_call(h, state, req, len, is_binary, 1, &reply), AP_HANDLER_OK);
	assert_int_equal(reply.kind, AP_REPLY_BINARY);
	struct t_img im = t_decode(reply.data, reply.len);
	if (im.w != want_w || im.h != want_h)
		fail_msg("thumbnail is %dx%d, want %dx%d", im.w, im.h, want_w, want_h);
	t_reply_free(&reply);
	return im;
}

/* The thumbnail of a w x h source asked at max_side: long side max_side,
 * short side the original ratio to +-1 px. */
static void t_check_size(const actor_pool_handler *h, void *state, int w, int h_, int max_side)
{
	size_t jlen;
	uint8_t *jpeg = t_jpeg(w, h_, 0, &jlen);
	ei_x_buff x;
	actor_pool_reply reply;

	t_reply_init(&reply);
	t_thumb_req(&x, jpeg, jlen, max_side);
	assert_int_equal(t_call(h, state, x.buff, (size_t)x.index, 0, 1, &reply), AP_HANDLER_OK);
	struct t_img im = t_decode(reply.data, reply.len);
	int lng = im.w > im.h ? im.w : im.h, shrt = im.w > im.h ? im.h : im.w;
	int olng = w > h_ ? w : h_, oshrt = w > h_ ? h_ : w;
	double want_short = (double)oshrt * max_side / olng;
	if (lng != max_side || shrt < want_short - 1 || shrt > want_short + 1 || (w >= h_) != (im.w >= im.h))
		fail_msg("%dx%d at %d gave %dx%d", w, h_, max_side, im.w, im.h);
	free(im.px);
	t_reply_free(&reply);
	ei_x_free(&x);
	free(jpeg);
}

static void test_thumbnail_has_long_side_max_side_and_keeps_aspect(void **state)
{
	struct t_plugin p = t_open(T_BUILD_DIR "/thumbnail.so");
	void *s;

	(void)state;
	assert_int_equal(p.h->init(&s, NULL, 0), 0);
	t_check_size(p.h, s, 640, 480, 100);
	t_check_size(p.h, s, 640, 480, 64);
	t_check_size(p.h, s, 480, 640, 100); /* portrait */
	t_check_size(p.h, s, 1001, 37, 100); /* a sliver: 3.7 rounds to 4 */
	t_check_size(p.h, s, 1000, 1000, 8);
	t_check_size(p.h, s, 2000, 300, 333);
	t_check_size(p.h, s, 641, 479, 640); /* DCT scale 1/1, box filter only */
	p.h->terminate(s);
	ap_plugin_unload(p.dl);
}

static void test_thumbnail_keeps_the_picture(void **state)
{
	struct t_plugin p = t_open(T_BUILD_DIR "/thumbnail.so");
	size_t jlen;
	uint8_t *jpeg = t_jpeg(640, 480, 0, &jlen);
	ei_x_buff x;
	void *s;

	(void)state;
	assert_int_equal(p.h->init(&s, NULL, 0), 0);
	t_thumb_req(&x, jpeg, jlen, 100);
	struct t_img im = t_thumb(p.h, s, x.buff, (size_t)x.index, 0, 100, 75);
	/* Red follows x, green follows y, blue stays 128, at the corners and
	 * the middle, within JPEG's error. */
	static const int at[][2] = { { 2, 2 }, { 97, 2 }, { 2, 72 }, { 97, 72 }, { 50, 37 } };
	for (size_t k = 0; k < sizeof at / sizeof at[0]; k++) {
		int xx = at[k][0], yy = at[k][1];
		const uint8_t *px = im.px + ((size_t)yy * 100 + (size_t)xx) * 3;
		int r = (xx * 2 + 1) * 255 / 200, g = (yy * 2 + 1) * 255 / 150;
		if (abs(px[0] - r) > 12 || abs(px[1] - g) > 12 || abs(px[2] - 128) > 12)
			fail_msg("pixel (%d,%d) is %d,%d,%d; want about %d,%d,128", xx, yy, px[0], px[1], px[2], r, g);
	}
	free(im.px);
	ei_x_free(&x);
	free(jpeg);
	p.h->terminate(s);
	ap_plugin_unload(p.dl);
}

static void test_thumbnail_bare_binary_uses_the_config_max_side(void **state)
{
	struct t_plugin p = t_open(T_BUILD_DIR "/thumbnail.so");
	size_t jlen;
	uint8_t *jpeg = t_jpeg(640, 480, 0, &jlen);
	struct t_img im;
	ei_x_buff cfg;
	void *s;

	(void)state;
	assert_int_equal(p.h->init(&s, NULL, 0), 0);
	im = t_thumb(p.h, s, jpeg, jlen, 1, 128, 96); /* the default */
	free(im.px);
	p.h->terminate(s);

	ei_x_new_with_version(&cfg);
	ei_x_encode_map_header(&cfg, 1);
	ei_x_encode_atom(&cfg, "max_side");
	ei_x_encode_long(&cfg, 64);
	assert_int_equal(p.h->init(&s, (const uint8_t *)cfg.buff, (size_t)cfg.index), 0);
	im = t_thumb(p.h, s, jpeg, jlen, 1, 64, 48);
	free(im.px);
	p.h->terminate(s);
	ei_x_free(&cfg);

	/* An empty map is the default too. */
	ei_x_new_with_version(&cfg);
	ei_x_encode_map_header(&cfg, 0);
	assert_int_equal(p.h->init(&s, (const uint8_t *)cfg.buff, (size_t)cfg.index), 0);
	im = t_thumb(p.h, s, jpeg, jlen, 1, 128, 96);
	free(im.px);
	p.h->terminate(s);
	ei_x_free(&cfg);

	free(jpeg);
	ap_plugin_unload(p.dl);
}

static void test_thumbnail_never_enlarges_and_keeps_gray(void **state)
{
	struct t_plugin p = t_open(T_BUILD_DIR "/thumbnail.so");
	size_t jlen;
	uint8_t *jpeg;
	struct t_img im;
	ei_x_buff x;
	void *s;

	(void)state;
	assert_int_equal(p.h->init(&s, NULL, 0), 0);
	jpeg = t_jpeg(50, 40, 0, &jlen);
	t_thumb_req(&x, jpeg, jlen, 100);
	im = t_thumb(p.h, s, x.buff, (size_t)x.index, 0, 50, 40);
	free(im.px);
	ei_x_free(&x);
	free(jpeg);

	jpeg = t_jpeg(100, 80, 0, &jlen); /* exactly max_side: as it is */
	t_thumb_req(&x, jpeg, jlen, 100);
	im = t_thumb(p.h, s, x.buff, (size_t)x.index, 0, 100, 80);
	free(im.px);
	ei_x_free(&x);
	free(jpeg);

	jpeg = t_jpeg(300, 200, 1, &jlen);
	t_thumb_req(&x, jpeg, jlen, 64);
	im = t_thumb(p.h, s, x.buff, (size_t)x.index, 0, 64, 43);
	assert_int_equal(im.cs, TJCS_GRAY);
	assert_int_equal(im.samp, TJSAMP_GRAY);
	free(im.px);
	ei_x_free(&x);
	free(jpeg);

	p.h->terminate(s);
	ap_plugin_unload(p.dl);
}

/* {error, {jpeg_error, Msg}} with a non-empty binary Msg. */
static void t_assert_jpeg_error(actor_pool_status st, actor_pool_reply *reply)
{
	const char *b = (const char *)reply->data;
	char atom[MAXATOMLEN];
	int idx = 0, ver, arity, type, size;

	assert_int_equal(st, AP_HANDLER_ERROR);
	assert_int_equal(reply->kind, AP_REPLY_TERM);
	assert_int_equal(ei_decode_version(b, &idx, &ver), 0);
	assert_int_equal(ei_decode_tuple_header(b, &idx, &arity), 0);
	assert_int_equal(arity, 2);
	assert_int_equal(ei_decode_atom(b, &idx, atom), 0);
	assert_string_equal(atom, "jpeg_error");
	assert_int_equal(ei_get_type(b, &idx, &type, &size), 0);
	assert_int_equal(type, ERL_BINARY_EXT);
	assert_true(size > 0);
	assert_int_equal(ei_skip_term(b, &idx), 0);
	assert_int_equal((size_t)idx, reply->len);
}

static void test_thumbnail_garbage_is_a_jpeg_error(void **state)
{
	struct t_plugin p = t_open(T_BUILD_DIR "/thumbnail.so");
	actor_pool_reply reply;
	uint8_t junk[4096];
	size_t jlen;
	uint8_t *jpeg = t_jpeg(320, 240, 0, &jlen);
	t_rng rng;
	ei_x_buff x;
	void *s;

	(void)state;
	assert_int_equal(p.h->init(&s, NULL, 0), 0);
	t_reply_init(&reply);
	t_rng_seed(&rng, t_seed("thumbnail garbage"));
	for (size_t k = 0; k < sizeof junk; k++)
		junk[k] = (uint8_t)t_rand32(&rng);
	t_assert_jpeg_error(t_call(p.h, s, junk, sizeof junk, 1, 1, &reply), &reply);
	t_assert_jpeg_error(t_call(p.h, s, "", 0, 1, 1, &reply), &reply);
	t_assert_jpeg_error(t_call(p.h, s, "\xff\xd8\xff", 3, 1, 1, &reply), &reply);
	/* SOI then EOI: a tables-only stream, whose header read "succeeds"
	 * without an image. */
	t_assert_jpeg_error(t_call(p.h, s, "\xff\xd8\xff\xd9", 4, 1, 1, &reply), &reply);
	t_thumb_req(&x, junk, 100, 64);
	t_assert_jpeg_error(t_call(p.h, s, x.buff, (size_t)x.index, 0, 1, &reply), &reply);
	ei_x_free(&x);

	/* Cut or damaged JPEGs: an answer either way (libjpeg only warns about
	 * a short scan), never a crash, and the worker still works after. */
	for (int iter = 0; iter < 300; iter++) {
		uint8_t *d = t_dup(jpeg, jlen);
		size_t n = t_rand_range(&rng, 0, jlen);
		for (int m = (int)t_rand_range(&rng, 0, 4); m > 0; m--)
			d[t_rand_range(&rng, 0, jlen - 1)] = (uint8_t)t_rand32(&rng);
		actor_pool_status st = t_call(p.h, s, d, n, 1, 1, &reply);
		assert_true(st == AP_HANDLER_OK || st == AP_HANDLER_ERROR);
		if (st == AP_HANDLER_ERROR)
			t_assert_jpeg_error(st, &reply);
		free(d);
	}
	struct t_img im = t_thumb(p.h, s, jpeg, jlen, 1, 128, 96);
	free(im.px);

	t_reply_free(&reply);
	free(jpeg);
	p.h->terminate(s);
	ap_plugin_unload(p.dl);
}

/* libturbojpeg 2.1 leaves a handle unusable after some errors: the plugin
 * must replace it, or every later good JPEG fails on that worker. */
static void test_thumbnail_worker_recovers_after_a_bad_jpeg(void **state)
{
	struct t_plugin p = t_open(T_BUILD_DIR "/thumbnail.so");
	actor_pool_reply reply;
	size_t jlen;
	uint8_t *jpeg = t_jpeg(320, 240, 0, &jlen);
	int errors = 0;
	void *s;

	(void)state;
	assert_int_equal(p.h->init(&s, NULL, 0), 0);
	t_reply_init(&reply);
	for (size_t cut = 1; cut < 700 && cut < jlen; cut += 3) {
		actor_pool_status st = t_call(p.h, s, jpeg, cut, 1, 1, &reply);
		errors += st == AP_HANDLER_ERROR;
		struct t_img im = t_thumb(p.h, s, jpeg, jlen, 1, 128, 96);
		free(im.px);
	}
	assert_true(errors > 100);
	t_reply_free(&reply);
	free(jpeg);
	p.h->terminate(s);
	ap_plugin_unload(p.dl);
}

static void test_thumbnail_bad_request_shape_is_badarg(void **state)
{
	struct t_plugin p = t_open(T_BUILD_DIR "/thumbnail.so");
	actor_pool_reply reply;
	size_t jlen;
	uint8_t *jpeg = t_jpeg(64, 64, 0, &jlen);
	ei_x_buff x;
	void *s;

	(void)state;
	assert_int_equal(p.h->init(&s, NULL, 0), 0);
	t_reply_init(&reply);
	for (int k = 0; k < 9; k++) {
		ei_x_new_with_version(&x);
		switch (k) {
		case 0: /* MaxSide too small */
		case 1: /* MaxSide too large */
			ei_x_encode_tuple_header(&x, 3);
			ei_x_encode_atom(&x, "thumbnail");
			ei_x_encode_binary(&x, jpeg, (long)jlen);
			ei_x_encode_long(&x, k == 0 ? 7 : 4097);
			break;
		case 2: /* not a binary */
			ei_x_encode_tuple_header(&x, 3);
			ei_x_encode_atom(&x, "thumbnail");
			ei_x_encode_string(&x, "jpeg");
			ei_x_encode_long(&x, 64);
			break;
		case 3: /* too short */
			ei_x_encode_tuple_header(&x, 2);
			ei_x_encode_atom(&x, "thumbnail");
			ei_x_encode_binary(&x, jpeg, (long)jlen);
			break;
		case 4: /* too long */
			ei_x_encode_tuple_header(&x, 4);
			ei_x_encode_atom(&x, "thumbnail");
			ei_x_encode_binary(&x, jpeg, (long)jlen);
			ei_x_encode_long(&x, 64);
			ei_x_encode_long(&x, 64);
			break;
		case 5: /* another tag */
			ei_x_encode_tuple_header(&x, 3);
			ei_x_encode_atom(&x, "thumb");
			ei_x_encode_binary(&x, jpeg, (long)jlen);
			ei_x_encode_long(&x, 64);
			break;
		case 6:
			ei_x_encode_atom(&x, "thumbnail");
			break;
		case 7: /* a bitstring */
			ei_x_encode_tuple_header(&x, 3);
			ei_x_encode_atom(&x, "thumbnail");
			ei_x_encode_bitstring(&x, (const char *)jpeg, 0, jlen * 8 - 3);
			ei_x_encode_long(&x, 64);
			break;
		case 8: /* MaxSide not an integer */
			ei_x_encode_tuple_header(&x, 3);
			ei_x_encode_atom(&x, "thumbnail");
			ei_x_encode_binary(&x, jpeg, (long)jlen);
			ei_x_encode_double(&x, 64.0);
			break;
		}
		if (t_call(p.h, s, x.buff, (size_t)x.index, 0, 1, &reply) != AP_HANDLER_ERROR)
			fail_msg("request shape %d was not refused", k);
		t_assert_reply_atom(&reply, "badarg");
		ei_x_free(&x);
	}
	/* Bounds are inclusive. */
	t_thumb_req(&x, jpeg, jlen, 8);
	assert_int_equal(t_call(p.h, s, x.buff, (size_t)x.index, 0, 1, &reply), AP_HANDLER_OK);
	ei_x_free(&x);
	t_thumb_req(&x, jpeg, jlen, 4096);
	assert_int_equal(t_call(p.h, s, x.buff, (size_t)x.index, 0, 1, &reply), AP_HANDLER_OK);
	ei_x_free(&x);
	/* A tell does no work and replies nothing. */
	t_thumb_req(&x, jpeg, jlen, 64);
	assert_int_equal(t_call(p.h, s, x.buff, (size_t)x.index, 0, 0, &reply), AP_HANDLER_OK);
	t_assert_reply_atom(&reply, "ok");
	ei_x_free(&x);

	t_reply_free(&reply);
	free(jpeg);
	p.h->terminate(s);
	ap_plugin_unload(p.dl);
}

static void test_thumbnail_bad_config_fails_init(void **state)
{
	struct t_plugin p = t_open(T_BUILD_DIR "/thumbnail.so");
	ei_x_buff cfg;
	void *s = NULL;

	(void)state;
	for (int k = 0; k < 5; k++) {
		ei_x_new_with_version(&cfg);
		switch (k) {
		case 0:
		case 1:
			ei_x_encode_map_header(&cfg, 1);
			ei_x_encode_atom(&cfg, "max_side");
			ei_x_encode_long(&cfg, k == 0 ? 7 : 4097);
			break;
		case 2:
			ei_x_encode_map_header(&cfg, 1);
			ei_x_encode_atom(&cfg, "max_size");
			ei_x_encode_long(&cfg, 64);
			break;
		case 3:
			ei_x_encode_atom(&cfg, "not_a_map");
			break;
		case 4:
			ei_x_encode_map_header(&cfg, 1);
			ei_x_encode_atom(&cfg, "max_side");
			ei_x_encode_atom(&cfg, "big");
			break;
		}
		if (p.h->init(&s, (const uint8_t *)cfg.buff, (size_t)cfg.index) != 1)
			fail_msg("config %d was accepted", k);
		ei_x_free(&cfg);
	}
	ap_plugin_unload(p.dl);
}

/* What `make` installs (no sanitizers) is the same plugin. */
static void test_thumbnail_installed_plugin_loads_and_runs(void **state)
{
	struct t_plugin p = t_open(T_PRIV_DIR "/examples/thumbnail.so");
	size_t jlen;
	uint8_t *jpeg = t_jpeg(640, 480, 0, &jlen);
	ei_x_buff x;
	void *s;

	(void)state;
	assert_int_equal(p.h->init(&s, NULL, 0), 0);
	t_thumb_req(&x, jpeg, jlen, 64);
	struct t_img im = t_thumb(p.h, s, x.buff, (size_t)x.index, 0, 64, 48);
	free(im.px);
	ei_x_free(&x);
	free(jpeg);
	p.h->terminate(s);
	ap_plugin_unload(p.dl);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_thumbnail_has_long_side_max_side_and_keeps_aspect),
		cmocka_unit_test(test_thumbnail_keeps_the_picture),
		cmocka_unit_test(test_thumbnail_bare_binary_uses_the_config_max_side),
		cmocka_unit_test(test_thumbnail_never_enlarges_and_keeps_gray),
		cmocka_unit_test(test_thumbnail_garbage_is_a_jpeg_error),
		cmocka_unit_test(test_thumbnail_worker_recovers_after_a_bad_jpeg),
		cmocka_unit_test(test_thumbnail_bad_request_shape_is_badarg),
		cmocka_unit_test(test_thumbnail_bad_config_fails_init),
		cmocka_unit_test(test_thumbnail_installed_plugin_loads_and_runs),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
