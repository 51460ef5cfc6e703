/* thumbnail: an actor_pool handler plugin that shrinks JPEGs with libturbojpeg.
 *
 * Request: {thumbnail, Jpeg :: binary(), MaxSide :: 8..4096}, or a bare JPEG
 * binary, which uses the MaxSide of the Config given at start
 * ({plugin, Path, #{max_side => N}}; 128 without one).
 *
 * Reply: {ok, Jpeg} with the image scaled so that its long side is MaxSide
 * and its aspect ratio kept (the short side rounded to the nearest pixel,
 * at least 1), quality 85. An image whose long side is already <= MaxSide
 * is re-encoded at its own size: a thumbnail is never bigger than the
 * original. Grayscale stays grayscale.
 *
 * Errors: {error, badarg} for any other request shape or a MaxSide out of
 * range; {error, {jpeg_error, Msg :: binary()}} when libturbojpeg cannot
 * read the image (Msg is its message), or the image is too large to decode
 * here. Warnings (e.g. extraneous bytes, a truncated scan) do not fail a
 * request: the image is what libjpeg could decode, as in a browser.
 *
 * init fails with 1 for a bad Config (not a map, an unknown key, max_side
 * not an integer in 8..4096) and 2 when memory or libturbojpeg handles
 * cannot be had.
 *
 * Build: cc -std=gnu11 -O2 -shared -fPIC -fvisibility=hidden \
 *          -I<actor_pool>/c_src/include -I<erl_interface>/include \
 *          -o thumbnail.so thumbnail.c -L<erl_interface>/lib -lei \
 *          -Wl,--exclude-libs,ALL -lturbojpeg
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ei.h>
#include <turbojpeg.h>

#include "actor_pool_handler.h"

#define THUMB_DEFAULT_SIDE 128
#define THUMB_MIN_SIDE 8
#define THUMB_MAX_SIDE 4096
#define THUMB_QUALITY 85
/* Pixels we agree to decode, after DCT scaling: ~100 MB of RGB. Only a
 * source beyond ~46000 px on both sides gets here, as 1/8 is the smallest
 * DCT scale; refusing it keeps one hostile header from taking the node's
 * memory. */
#define THUMB_MAX_PIXELS (1ull << 25)

/* One per worker: libturbojpeg handles are not thread-safe, and the
 * scratch buffers are kept between messages so that a steady stream of
 * same-sized images allocates nothing. */
struct thumb {
	tjhandle dec, enc;
	int max_side;
	uint8_t *pix;   /* the image as decoded, at the DCT scale */
	size_t pix_cap;
	uint16_t *tmp;  /* after the horizontal pass: 8.8 fixed point */
	size_t tmp_cap;
	uint64_t *acc;  /* one output row of the vertical pass */
	size_t acc_cap;
	uint8_t *out;   /* the thumbnail, before encoding */
	size_t out_cap;
};

/* ---- terms ------------------------------------------------------------------- */

/* The pool validated every term before handing it over, so ei's decoders,
 * which take no length, stay inside the buffer; lengths computed here are
 * still checked against it. */

static int parse_config(const uint8_t *cfg, size_t len, int *max_side)
{
	const char *b = (const char *)cfg;
	char key[MAXATOMLEN_UTF8];
	int idx = 0, ver, arity;
	long v;

	*max_side = THUMB_DEFAULT_SIDE;
	if (!cfg || !len)
		return 0;
	if (ei_decode_version(b, &idx, &ver) || ei_decode_map_header(b, &idx, &arity))
		return -1;
	for (int k = 0; k < arity; k++) {
		/* Unknown keys are refused: #{max_size => 64} is a typo that
		 * should not quietly give 128. */
		if (ei_decode_atom_as(b, &idx, key, sizeof key, ERLANG_UTF8, NULL, NULL) || strcmp(key, "max_side"))
			return -1;
		if (ei_decode_long(b, &idx, &v) || v < THUMB_MIN_SIDE || v > THUMB_MAX_SIDE)
			return -1;
		*max_side = (int)v;
	}
	return (size_t)idx == len ? 0 : -1;
}

/* The JPEG bytes (in place, not copied) and MaxSide of a request. */
static int parse_request(const actor_pool_request *req, int def_side, const uint8_t **jpeg, size_t *jlen,
			 int *max_side)
{
	const char *b = (const char *)req->data;
	char tag[MAXATOMLEN_UTF8];
	int idx = 0, ver, arity, type, size;
	long v;

	if (req->is_binary) {
		*jpeg = req->data;
		*jlen = req->len;
		*max_side = def_side;
		return 0;
	}
	if (ei_decode_version(b, &idx, &ver) || ei_decode_tuple_header(b, &idx, &arity) || arity != 3 ||
	    ei_decode_atom_as(b, &idx, tag, sizeof tag, ERLANG_UTF8, NULL, NULL) || strcmp(tag, "thumbnail"))
		return -1;
	/* ei_decode_binary would copy the image: take the bytes where they
	 * are, after BINARY_EXT's tag and 4-byte length. A bitstring
	 * (BIT_BINARY_EXT) is no JPEG. */
	if (ei_get_type(b, &idx, &type, &size) || type != ERL_BINARY_EXT || size < 0 ||
	    (size_t)idx + 5 + (size_t)size > req->len)
		return -1;
	*jpeg = req->data + idx + 5;
	*jlen = (size_t)size;
	idx += 5 + size;
	if (ei_decode_long(b, &idx, &v) || v < THUMB_MIN_SIDE || v > THUMB_MAX_SIDE || (size_t)idx != req->len)
		return -1;
	*max_side = (int)v;
	return 0;
}

/* A reply that cannot be allocated is a crash: an error without its reason
 * would be a wrong answer. */
static actor_pool_status reply_badarg(actor_pool_reply *r)
{
	return actor_pool_reply_set(r, AP_REPLY_ATOM, "badarg", 6) ? AP_HANDLER_CRASH : AP_HANDLER_ERROR;
}

static actor_pool_status reply_jpeg_error(actor_pool_reply *r, const char *msg)
{
	size_t mlen = strlen(msg);
	int idx = 0;

	if (mlen > 1024) /* libjpeg's messages are short; bound what we trust */
		mlen = 1024;
	r->kind = AP_REPLY_TERM;
	r->len = 0;
	/* 131, tuple header, the atom (13) and the binary's header (5). */
	if (r->reserve(r, mlen + 32))
		return AP_HANDLER_CRASH;
	char *b = (char *)r->data;
	if (ei_encode_version(b, &idx) || ei_encode_tuple_header(b, &idx, 2) || ei_encode_atom(b, &idx, "jpeg_error") ||
	    ei_encode_binary(b, &idx, msg, (long)mlen))
		return AP_HANDLER_CRASH;
	r->len = (size_t)idx;
	return AP_HANDLER_ERROR;
}

/* ---- scaling ----------------------------------------------------------------- */

/* The DCT scale to decode at. libjpeg can decode at n/8 for n = 1..8 almost
 * for the price of the smaller image; what it cannot do is hit an exact
 * size. So: the smallest scale <= 1 whose long side is still >= max_side
 * (never below it, which would lose detail the box filter below would then
 * have to invent), and the box filter takes the rest of the way, a factor
 * below 2 except when even 1/8 is larger than needed. When the image is
 * already no longer than max_side, 1/1: nothing is enlarged. */
static tjscalingfactor pick_scale(int w, int h, int max_side)
{
	tjscalingfactor best = { 1, 1 }, *sf;
	int n = 0, longest = w > h ? w : h, best_long = longest;

	sf = tjGetScalingFactors(&n);
	for (int k = 0; sf && k < n; k++) {
		tjscalingfactor f = sf[k];
		if (f.num > f.denom)
			continue;
		int l = TJSCALED(longest, f);
		if (l >= max_side && l < best_long) {
			best = f;
			best_long = l;
		}
	}
	return best;
}

static int grow(void **p, size_t *cap, size_t need)
{
	if (need <= *cap)
		return 0;
	void *q = realloc(*p, need);
	if (!q)
		return -1;
	*p = q;
	*cap = need;
	return 0;
}

/* Box filter (area average) from sw x sh to tw x th, tw <= sw, th <= sh,
 * ch bytes a pixel. Exact integer weights: in units of 1/t of a source
 * pixel, output pixel j covers [j*s, (j+1)*s) and source pixel i covers
 * [i*t, (i+1)*t); a weight is their overlap, and an output's weights add
 * up to s. Two separable passes, the first kept to 8 fractional bits. */
static int box_resample(struct thumb *t, const uint8_t *src, int sw, int sh, int tw, int th, int ch)
{
	const uint64_t sx = (uint64_t)sw, dx = (uint64_t)tw, sy = (uint64_t)sh, dy = (uint64_t)th;
	const size_t orow = (size_t)tw * (size_t)ch;

	if (grow((void **)&t->tmp, &t->tmp_cap, (size_t)sh * orow * sizeof *t->tmp) ||
	    grow((void **)&t->acc, &t->acc_cap, orow * sizeof *t->acc) ||
	    grow((void **)&t->out, &t->out_cap, (size_t)th * orow))
		return -1;

	for (int y = 0; y < sh; y++) {
		const uint8_t *s = src + (size_t)y * (size_t)sw * (size_t)ch;
		uint16_t *d = t->tmp + (size_t)y * orow;
		for (uint64_t x = 0; x < dx; x++) {
			uint64_t lo = x * sx, hi = lo + sx, sum[4] = { 0 };
			for (uint64_t i = lo / dx; i <= (hi - 1) / dx; i++) {
				uint64_t a = i * dx > lo ? i * dx : lo, b = (i + 1) * dx < hi ? (i + 1) * dx : hi;
				for (int c = 0; c < ch; c++)
					sum[c] += (b - a) * s[i * (uint64_t)ch + (uint64_t)c];
			}
			for (int c = 0; c < ch; c++)
				d[x * (uint64_t)ch + (uint64_t)c] = (uint16_t)((sum[c] * 256 + sx / 2) / sx);
		}
	}
	for (uint64_t y = 0; y < dy; y++) {
		uint64_t lo = y * sy, hi = lo + sy;
		uint8_t *d = t->out + y * orow;
		memset(t->acc, 0, orow * sizeof *t->acc);
		for (uint64_t i = lo / dy; i <= (hi - 1) / dy; i++) {
			uint64_t a = i * dy > lo ? i * dy : lo, b = (i + 1) * dy < hi ? (i + 1) * dy : hi;
			const uint16_t *s = t->tmp + i * orow;
			for (size_t k = 0; k < orow; k++)
				t->acc[k] += (b - a) * s[k];
		}
		for (size_t k = 0; k < orow; k++)
			d[k] = (uint8_t)((t->acc[k] + sy * 128) / (sy * 256));
	}
	return 0;
}

/* ---- the handler ------------------------------------------------------------- */

/* libturbojpeg 2.1 leaves a handle mid-image after an error (its
 * tjDecompressHeader3 returns without aborting the decompressor), and the
 * next, good, JPEG then fails ("Bogus Huffman table definition"). So a
 * handle that failed is replaced; the message is saved first, as it lives
 * in the handle. A replacement that cannot be had leaves NULL, and the
 * next message crashes the worker, whose successor tries again. */
static actor_pool_status tj_failed(tjhandle *hp, int compress, const char *why, actor_pool_reply *reply)
{
	char msg[256];

	snprintf(msg, sizeof msg, "%s", why ? why : tjGetErrorStr2(*hp));
	tjDestroy(*hp);
	*hp = compress ? tjInitCompress() : tjInitDecompress();
	return reply_jpeg_error(reply, msg);
}

static void thumb_terminate(void *state)
{
	struct thumb *t = state;

	if (!t)
		return;
	if (t->dec)
		tjDestroy(t->dec);
	if (t->enc)
		tjDestroy(t->enc);
	free(t->pix);
	free(t->tmp);
	free(t->acc);
	free(t->out);
	free(t);
}

static int thumb_init(void **state, const uint8_t *config, size_t config_len)
{
	struct thumb *t;
	int side;

	if (parse_config(config, config_len, &side))
		return 1;
	t = calloc(1, sizeof *t);
	if (!t)
		return 2;
	t->max_side = side;
	t->dec = tjInitDecompress();
	t->enc = tjInitCompress();
	if (!t->dec || !t->enc) {
		thumb_terminate(t);
		return 2;
	}
	*state = t;
	return 0;
}

static actor_pool_status thumb_handle(void *state, const actor_pool_request *req, actor_pool_reply *reply)
{
	struct thumb *t = state;
	const uint8_t *jpeg, *src;
	size_t jlen;
	int max_side, w, h, subsamp, cs, sw, sh, tw, th, pf, ch, osamp;

	if (!t->dec || !t->enc)
		return AP_HANDLER_CRASH;
	if (parse_request(req, t->max_side, &jpeg, &jlen, &max_side))
		return reply_badarg(reply);
	/* Nobody would see the thumbnail of a tell. */
	if (!req->is_ask)
		return AP_HANDLER_OK;
	w = h = 0;
	subsamp = cs = -1;
	if (tjDecompressHeader3(t->dec, jpeg, (unsigned long)jlen, &w, &h, &subsamp, &cs))
		return tj_failed(&t->dec, 0, NULL, reply);
	/* A tables-only stream (which a cut JPEG can become) passes without
	 * setting any of the four, and leaves its tables in the handle for
	 * whatever JPEG comes next: refused, and the handle replaced. */
	if (w <= 0 || h <= 0 || cs < 0)
		return tj_failed(&t->dec, 0, "no image in the JPEG data", reply);

	tjscalingfactor f = pick_scale(w, h, max_side);
	sw = TJSCALED(w, f);
	sh = TJSCALED(h, f);
	if ((uint64_t)sw * (uint64_t)sh > THUMB_MAX_PIXELS)
		return reply_jpeg_error(reply, "image too large");
	if (cs == TJCS_GRAY) {
		pf = TJPF_GRAY;
		osamp = TJSAMP_GRAY;
	} else {
		pf = TJPF_RGB;
		osamp = TJSAMP_420;
	}
	ch = tjPixelSize[pf];
	if (grow((void **)&t->pix, &t->pix_cap, (size_t)sw * (size_t)sh * (size_t)ch))
		return AP_HANDLER_CRASH;
	/* Asking for sw x sh is how tjDecompress2 is told the scale. */
	if (tjDecompress2(t->dec, jpeg, (unsigned long)jlen, t->pix, sw, 0, sh, pf, TJFLAG_LIMITSCANS) &&
	    tjGetErrorCode(t->dec) != TJERR_WARNING)
		return tj_failed(&t->dec, 0, NULL, reply);

	/* The target keeps the original's aspect ratio, not the scaled one's
	 * (TJSCALED rounds up each side on its own). */
	if ((sw > sh ? sw : sh) <= max_side) {
		tw = sw;
		th = sh;
		src = t->pix;
	} else {
		if (w >= h) {
			tw = max_side;
			th = (int)(((uint64_t)h * (uint64_t)max_side * 2 + (uint64_t)w) / (2 * (uint64_t)w));
		} else {
			th = max_side;
			tw = (int)(((uint64_t)w * (uint64_t)max_side * 2 + (uint64_t)h) / (2 * (uint64_t)h));
		}
		if (tw < 1)
			tw = 1;
		if (th < 1)
			th = 1;
		if (box_resample(t, t->pix, sw, sh, tw, th, ch))
			return AP_HANDLER_CRASH;
		src = t->out;
	}

	/* Straight into the reply, sized for the worst case so libturbojpeg
	 * never has to reallocate a buffer it does not own. */
	unsigned long cap = tjBufSize(tw, th, osamp), jsize = cap;
	unsigned char *dst;
	if (cap == (unsigned long)-1)
		return reply_jpeg_error(reply, tjGetErrorStr2(NULL));
	reply->kind = AP_REPLY_BINARY;
	reply->len = 0;
	if (reply->reserve(reply, cap))
		return AP_HANDLER_CRASH;
	dst = reply->data;
	if (tjCompress2(t->enc, src, tw, 0, th, pf, &dst, &jsize, osamp, THUMB_QUALITY, TJFLAG_NOREALLOC))
		return tj_failed(&t->enc, 1, NULL, reply);
	reply->len = jsize;
	return AP_HANDLER_OK;
}

static const actor_pool_handler thumb_handler = {
	.abi_version = ACTOR_POOL_HANDLER_ABI,
	.name = "thumbnail",
	.init = thumb_init,
	.handle = thumb_handle,
	.terminate = thumb_terminate,
};

__attribute__((visibility("default"))) const actor_pool_handler *actor_pool_handler_get(void)
{
	return &thumb_handler;
}
