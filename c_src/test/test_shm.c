/* test_shm: the snapshot writer against real shm segments, read back through
 * separate read-only mappings (as the NIF reads them); readers racing the
 * writer; hostile and truncated segments. */
#include "t_helpers.h"
#include "t_tmpfs.h"

#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ap_shm.h"

/* Caller memory the writer accepts, at least: the header and two halves of
 * a minimal index and a page of arena. */
#define T_SMALL_SEG 32768u

/* ---- values that prove whose they are ----------------------------------- */

#define T_VAL_HDR 12u
#define T_VAL_BIG 2500u /* added to a big value's length */
#define T_VAL_MAX (T_VAL_HDR + 500u + T_VAL_BIG)

/* Big values (ver's top bit set) fill a small segment nearly to the brim,
 * so that it compacts every few dozen puts. */
static size_t t_val_len(uint32_t id, uint32_t ver)
{
	return T_VAL_HDR + (id * 31u + ver * 17u) % 500u + (ver >> 31 ? T_VAL_BIG : 0);
}

static uint64_t t_val_stream(uint32_t id, uint32_t ver) { return ((uint64_t)id << 32 | ver) * 1024; }

/* A value of key id at version ver: id, ver, its length, then stream bytes
 * that depend on all three, so a torn or misdirected value cannot pass. */
static size_t t_val(uint8_t *buf, uint32_t id, uint32_t ver)
{
	uint32_t n = (uint32_t)t_val_len(id, ver);
	memcpy(buf, &id, 4);
	memcpy(buf + 4, &ver, 4);
	memcpy(buf + 8, &n, 4);
	t_stream_fill(buf + T_VAL_HDR, n - T_VAL_HDR, t_val_stream(id, ver));
	return n;
}

/* 0 when buf[0..n) is exactly a value of key id; its version in *ver. */
static int t_val_check(const uint8_t *buf, size_t n, uint32_t id, uint32_t *ver)
{
	uint32_t i, v, l;
	if (n < T_VAL_HDR)
		return -1;
	memcpy(&i, buf, 4);
	memcpy(&v, buf + 4, 4);
	memcpy(&l, buf + 8, 4);
	if (i != id || l != n || n != t_val_len(id, v))
		return -1;
	if (t_stream_check(buf + T_VAL_HDR, n - T_VAL_HDR, t_val_stream(id, v)) != n - T_VAL_HDR)
		return -1;
	*ver = v;
	return 0;
}

static size_t t_key(char *buf, uint32_t id) { return (size_t)sprintf(buf, "key-%06u", id); }

/* ---- segments ------------------------------------------------------------ */

static void t_name(char *buf, size_t n, const char *what)
{
	static unsigned seq;
	snprintf(buf, n, "/ap_shm_test_%d_%s_%u", (int)getpid(), what, seq++);
}

/* A second, read-only mapping of the whole object, as a reader makes it. */
static const void *t_map_ro(const char *name, size_t *len)
{
	int fd = shm_open(name, O_RDONLY, 0);
	assert_true(fd >= 0);
	struct stat st;
	assert_int_equal(fstat(fd, &st), 0);
	void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
	assert_true(p != MAP_FAILED);
	close(fd);
	*len = (size_t)st.st_size;
	return p;
}

/* A writer on a fresh shm object and a reader's mapping of it. */
struct t_seg {
	char name[64];
	ap_shm_writer *w;
	const void *ro;
	size_t len;
};

static void t_seg_open(struct t_seg *s, const char *what, size_t size)
{
	t_name(s->name, sizeof s->name, what);
	assert_int_equal(ap_shm_writer_create(&s->w, s->name, size, "rcpt@test", 7), 0);
	s->ro = t_map_ro(s->name, &s->len);
	assert_int_equal(s->len, size);
}

static void t_seg_close(struct t_seg *s)
{
	ap_shm_writer_close(s->w, 1);
	munmap((void *)s->ro, s->len);
}

static uint64_t t_gen(const void *seg) { return __atomic_load_n(&((const struct ap_shm_hdr *)seg)->gen, __ATOMIC_ACQUIRE); }

static uint32_t t_state(const void *seg)
{
	return __atomic_load_n(&((const struct ap_shm_hdr *)seg)->state, __ATOMIC_ACQUIRE);
}

/* The counter itself, whatever the state. */
static uint64_t t_changes(const void *seg)
{
	return __atomic_load_n(&((const struct ap_shm_hdr *)seg)->changes, __ATOMIC_ACQUIRE);
}

static uint64_t t_compactions(ap_shm_writer *w)
{
	uint64_t c;
	ap_shm_writer_stats(w, NULL, NULL, &c);
	return c;
}

static uint64_t t_keys(ap_shm_writer *w)
{
	uint64_t k;
	ap_shm_writer_stats(w, &k, NULL, NULL);
	return k;
}

static int t_put_str(ap_shm_writer *w, const char *k, const char *v)
{
	return ap_shm_put(w, k, strlen(k), v, v ? strlen(v) : 0);
}

/* Lookup of k must give exactly v. */
static void t_assert_val(const void *seg, size_t len, const char *k, const void *v, size_t vlen)
{
	static uint8_t out[1 << 17];
	uint32_t got = 0;
	int r = ap_shm_lookup(seg, len, k, strlen(k), out, sizeof out, &got);
	if (r != AP_SHM_OK)
		fail_msg("lookup %s: %d", k, r);
	assert_int_equal(got, vlen);
	assert_memory_equal(out, v, vlen);
}

static void t_assert_str(const void *seg, size_t len, const char *k, const char *v)
{
	t_assert_val(seg, len, k, v, strlen(v));
}

static int t_lookup_rc(const void *seg, size_t len, const char *k)
{
	uint8_t out[64];
	uint32_t got;
	return ap_shm_lookup(seg, len, k, strlen(k), out, sizeof out, &got);
}

/* ---- tests --------------------------------------------------------------- */

/* ---- the hash ------------------------------------------------------------ */

/* ap_shm_hash is SipHash-1-3 keyed (seed, seed ^ AP_SHM_SEED_K1). The
 * expected values come from this Python reference, which gives the
 * SipHash paper's SipHash-2-4 vector (key 00..0f, message 00..0e:
 * 0xa129ca6149be45e5) with c, d = 2, 4, and, with c, d = 1, 3 and a zero
 * key, CPython 3.11's own hash() of bytes under PYTHONHASHSEED=0
 * (sys.hash_info.algorithm == 'siphash13'):
 *
 *   M = (1 << 64) - 1
 *   def rotl(x, b): return ((x << b) | (x >> (64 - b))) & M
 *   def siphash(c, d, k0, k1, msg):
 *       v0 = k0 ^ 0x736f6d6570736575; v1 = k1 ^ 0x646f72616e646f6d
 *       v2 = k0 ^ 0x6c7967656e657261; v3 = k1 ^ 0x7465646279746573
 *       def rnd():
 *           nonlocal v0, v1, v2, v3
 *           v0 = (v0 + v1) & M; v1 = rotl(v1, 13); v1 ^= v0; v0 = rotl(v0, 32)
 *           v2 = (v2 + v3) & M; v3 = rotl(v3, 16); v3 ^= v2
 *           v0 = (v0 + v3) & M; v3 = rotl(v3, 21); v3 ^= v0
 *           v2 = (v2 + v1) & M; v1 = rotl(v1, 17); v1 ^= v2; v2 = rotl(v2, 32)
 *       n = len(msg) // 8 * 8
 *       for i in range(0, n, 8):
 *           m = int.from_bytes(msg[i:i+8], 'little'); v3 ^= m
 *           for _ in range(c): rnd()
 *           v0 ^= m
 *       b = ((len(msg) & 0xff) << 56) | int.from_bytes(msg[n:], 'little')
 *       v3 ^= b
 *       for _ in range(c): rnd()
 *       v0 ^= b; v2 ^= 0xff
 *       for _ in range(d): rnd()
 *       return v0 ^ v1 ^ v2 ^ v3
 *   def ap_hash(seed, msg): return siphash(1, 3, seed, seed ^ 0x9e3779b97f4a7c15, msg)
 */
static void test_hash_known_vectors(void **state)
{
	(void)state;
	uint8_t seq[64];
	for (int i = 0; i < 64; i++)
		seq[i] = (uint8_t)i;
	static const struct {
		uint64_t seed;
		const char *msg; /* NULL: seq[0..len) */
		size_t len;
		uint64_t want;
	} v[] = {
		{ 0, "", 0, 0x61d1b8495b88d5e1ull },
		{ 0, "a", 1, 0x6cd2f1583967b431ull },
		{ 0, "abcdefg", 7, 0xb23b9bf39130a21dull },
		{ 0, "abcdefgh", 8, 0x3d09067e6f99cbe8ull },
		{ 0, NULL, 15, 0x8e92628c2674d2feull },
		{ 0, "key-000042", 10, 0xb105583196c4a5d9ull },
		{ 0, NULL, 64, 0x7e56f13b96de6ecbull },
		{ 0x0706050403020100ull, "", 0, 0xb8caed77a440bbbaull },
		{ 0x0706050403020100ull, "abcdefgh", 8, 0x3c599e837f03032bull },
		{ 0x0706050403020100ull, NULL, 15, 0x1f8336568070576dull },
		{ 0x0123456789abcdefull, "a", 1, 0x9d3d0c2d828ea9a6ull },
		{ 0x0123456789abcdefull, "abcdefg", 7, 0xcfd190c99671d713ull },
		{ 0x0123456789abcdefull, "key-000042", 10, 0x416b62d8a7317b42ull },
		{ 0x0123456789abcdefull, NULL, 64, 0xfed88c2f19252a0full },
		{ UINT64_MAX, "", 0, 0x3e35ada38e8df913ull },
		{ UINT64_MAX, NULL, 15, 0x829b447612f9d75cull },
		{ UINT64_MAX, "key-000042", 10, 0xde3f65e916ea5c83ull },
		{ UINT64_MAX, NULL, 64, 0x99087a07ff64a5aeull },
	};
	for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
		const void *m = v[i].msg ? (const void *)v[i].msg : (const void *)seq;
		uint64_t got = ap_shm_hash(v[i].seed, m, v[i].len);
		if (got != v[i].want)
			fail_msg("vector %zu: 0x%016" PRIx64 ", want 0x%016" PRIx64, i, got, v[i].want);
	}
	/* Unaligned keys hash the same. */
	uint8_t buf[80];
	memcpy(buf + 3, seq, 64);
	assert_true(ap_shm_hash(0x0123456789abcdefull, buf + 3, 64) == 0xfed88c2f19252a0full);
	/* A NULL key of length 0 is fine. */
	assert_true(ap_shm_hash(0, NULL, 0) == 0x61d1b8495b88d5e1ull);
}

/* key's slot index in the active half of the segment at seg (found by
 * its stored hash: the index the writer put it at), or UINT64_MAX. */
static uint64_t t_slot_index(const uint8_t *seg, const char *key)
{
	const struct ap_shm_hdr *h = (const void *)seg;
	const struct ap_shm_half *hh = (const void *)(seg + AP_SHM_HDR_SIZE + (h->gen & 1) * h->half_size);
	const uint64_t *slots = (const uint64_t *)(hh + 1);
	uint64_t hash = ap_shm_hash(h->hash_seed, key, strlen(key));
	for (uint64_t n = 0, i = hash & (hh->cap - 1); n < hh->cap; n++, i = (i + 1) & (hh->cap - 1)) {
		if (!slots[i])
			return UINT64_MAX;
		const struct ap_shm_entry *e =
			(const void *)((const uint8_t *)hh + hh->arena_off + ((slots[i] & 0xffffffffu) << 3));
		if (slots[i] >> 32 == hash >> 32 && e->hash == hash && e->key_len == strlen(key) &&
		    !memcmp(e + 1, key, e->key_len))
			return i;
	}
	return UINT64_MAX;
}

/* Every segment draws its own seed; the writer hashes with it (the
 * entries' hashes are ap_shm_hash(hdr seed, key)), so the same keys land
 * in different slots in two segments. */
static void test_each_segment_has_its_own_seed(void **state)
{
	(void)state;
	struct t_seg a, b;
	char k[32];
	t_seg_open(&a, "seed_a", 1u << 20);
	t_seg_open(&b, "seed_b", 1u << 20);
	const struct ap_shm_hdr *ha = a.ro, *hb = b.ro;
	uint64_t sa = __atomic_load_n(&ha->hash_seed, __ATOMIC_RELAXED);
	uint64_t sb = __atomic_load_n(&hb->hash_seed, __ATOMIC_RELAXED);
	assert_true(sa != sb);
	/* Caller memory gets a seed of its own too. */
	uint8_t *mem = aligned_alloc(8, T_SMALL_SEG);
	assert_non_null(mem);
	memset(mem, 0, T_SMALL_SEG);
	ap_shm_writer *w;
	assert_int_equal(ap_shm_writer_init_mem(&w, mem, T_SMALL_SEG, "seed@test", 1), 0);
	uint64_t sm = ((struct ap_shm_hdr *)mem)->hash_seed;
	assert_true(sm != sa && sm != sb);
	ap_shm_writer_close(w, 0);
	free(mem);

	const unsigned n = 200;
	for (unsigned i = 0; i < n; i++) {
		t_key(k, i);
		assert_int_equal(t_put_str(a.w, k, k), 0);
		assert_int_equal(t_put_str(b.w, k, k), 0);
	}
	unsigned differ = 0;
	for (unsigned i = 0; i < n; i++) {
		t_key(k, i);
		t_assert_str(a.ro, a.len, k, k);
		t_assert_str(b.ro, b.len, k, k);
		uint64_t ia = t_slot_index(a.ro, k), ib = t_slot_index(b.ro, k);
		assert_true(ia != UINT64_MAX && ib != UINT64_MAX);
		differ += ia != ib;
	}
	/* Independent seeds: a key shares its slot with probability ~1/cap. */
	assert_true(differ > n * 9 / 10);
	assert_int_equal(t_lookup_rc(a.ro, a.len, "key-999999"), AP_SHM_ENOTFOUND);
	/* The seed never changes for a segment's life. */
	assert_true(__atomic_load_n(&ha->hash_seed, __ATOMIC_RELAXED) == sa);
	t_seg_close(&a);
	t_seg_close(&b);
}

static void test_create_sets_mode_0600_and_a_live_header(void **state)
{
	(void)state;
	struct t_seg s;
	/* Even a umask that would lock the owner out gives 0600. */
	mode_t old = umask(0777);
	t_name(s.name, sizeof s.name, "mode");
	int r = ap_shm_writer_create(&s.w, s.name, 1u << 20, "rcpt@host", 42);
	umask(old);
	assert_int_equal(r, 0);

	int fd = shm_open(s.name, O_RDONLY, 0);
	assert_true(fd >= 0);
	struct stat st;
	assert_int_equal(fstat(fd, &st), 0);
	assert_int_equal(st.st_mode & 07777, 0600);
	assert_int_equal(st.st_size, 1u << 20);
	close(fd);

	s.ro = t_map_ro(s.name, &s.len);
	const struct ap_shm_hdr *h = s.ro;
	assert_true(h->magic == AP_SHM_MAGIC);
	assert_int_equal(h->version, AP_SHM_VERSION);
	assert_int_equal(h->hdr_size, AP_SHM_HDR_SIZE);
	assert_int_equal(h->seg_size, 1u << 20);
	assert_true(AP_SHM_HDR_SIZE + 2 * h->half_size <= h->seg_size);
	assert_int_equal(h->half_size % 8, 0);
	assert_int_equal(h->gen, 0);
	assert_int_equal(h->writer_pid, (uint64_t)getpid());
	assert_int_equal(h->incarnation, 42);
	assert_int_equal(h->state, AP_SHM_STATE_LIVE);
	assert_string_equal(h->node, "rcpt@host");
	assert_int_equal(ap_shm_state(s.w), AP_SHM_STATE_LIVE);
	assert_int_equal(ap_shm_check(s.ro, s.len), AP_SHM_OK);
	assert_int_equal(t_lookup_rc(s.ro, s.len, "nobody"), AP_SHM_ENOTFOUND);

	ap_shm_heartbeat(s.w, 123456);
	assert_int_equal(__atomic_load_n(&h->heartbeat_ms, __ATOMIC_RELAXED), 123456);
	t_seg_close(&s);
}

static void test_create_and_init_reject_bad_arguments(void **state)
{
	(void)state;
	ap_shm_writer *w = (ap_shm_writer *)1;
	char longname[300];
	memset(longname, 'a', sizeof longname);
	longname[0] = '/';
	longname[sizeof longname - 1] = 0;
	const char *bad[] = { NULL, "", "/", "noslash", "/a/b", longname };
	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
		assert_int_equal(ap_shm_writer_create(&w, bad[i], 1u << 20, "n", 1), -EINVAL);
		assert_null(w);
	}
	char name[64];
	t_name(name, sizeof name, "badsize");
	assert_int_equal(ap_shm_writer_create(&w, name, (1u << 20) - 1, "n", 1), -EINVAL);
	assert_int_equal(ap_shm_writer_create(&w, name, (size_t)65 << 30, "n", 1), -EINVAL);
	errno = 0;
	assert_true(shm_open(name, O_RDONLY, 0) < 0 && errno == ENOENT);

	uint64_t *mem = calloc(1, T_SMALL_SEG + 8);
	assert_int_equal(ap_shm_writer_init_mem(&w, (uint8_t *)mem + 4, T_SMALL_SEG, "n", 1), -EINVAL);
	assert_int_equal(ap_shm_writer_init_mem(&w, mem, 8192, "n", 1), -EINVAL);
	assert_int_equal(ap_shm_writer_init_mem(&w, NULL, T_SMALL_SEG, "n", 1), -EINVAL);
	/* A node name longer than the field is cut, NUL-terminated. */
	char node[400];
	memset(node, 'n', sizeof node);
	node[sizeof node - 1] = 0;
	assert_int_equal(ap_shm_writer_init_mem(&w, mem, T_SMALL_SEG, node, 1), 0);
	const struct ap_shm_hdr *h = (const void *)mem;
	assert_int_equal(strlen(h->node), sizeof h->node - 1);
	assert_int_equal(ap_shm_check(mem, T_SMALL_SEG), AP_SHM_OK);
	ap_shm_writer_close(w, 1); /* caller memory: neither unmapped nor freed */
	assert_int_equal(h->state, AP_SHM_STATE_CLOSED);
	free(mem);
}

static void test_put_update_remove_round_trip(void **state)
{
	(void)state;
	struct t_seg s;
	t_seg_open(&s, "rt", 1u << 20);

	assert_int_equal(t_lookup_rc(s.ro, s.len, "a"), AP_SHM_ENOTFOUND);
	assert_int_equal(t_put_str(s.w, "a", "one"), 0);
	t_assert_str(s.ro, s.len, "a", "one");
	assert_int_equal(t_put_str(s.w, "a", "two, longer"), 0);
	t_assert_str(s.ro, s.len, "a", "two, longer");
	assert_int_equal(t_keys(s.w), 1);

	/* Removing: a tombstone, so ENOTFOUND; removing twice or removing a
	 * key never seen changes nothing. */
	assert_int_equal(t_put_str(s.w, "a", NULL), 0);
	assert_int_equal(t_lookup_rc(s.ro, s.len, "a"), AP_SHM_ENOTFOUND);
	assert_int_equal(t_keys(s.w), 0);
	uint64_t used0, used1;
	ap_shm_writer_stats(s.w, NULL, &used0, NULL);
	assert_int_equal(t_put_str(s.w, "a", NULL), 0);
	assert_int_equal(t_put_str(s.w, "never", NULL), 0);
	ap_shm_writer_stats(s.w, NULL, &used1, NULL);
	assert_int_equal(used0, used1);
	assert_int_equal(t_put_str(s.w, "a", "back"), 0);
	t_assert_str(s.ro, s.len, "a", "back");

	/* The empty key and binary keys are keys like any other. */
	assert_int_equal(ap_shm_put(s.w, "", 0, "empty", 5), 0);
	uint8_t bin[] = { 0, 1, 0, 255 }, out[16];
	assert_int_equal(ap_shm_put(s.w, bin, sizeof bin, "bin", 3), 0);
	uint32_t vl = 0;
	assert_int_equal(ap_shm_lookup(s.ro, s.len, "", 0, out, sizeof out, &vl), AP_SHM_OK);
	assert_int_equal(vl, 5);
	assert_memory_equal(out, "empty", 5);
	assert_int_equal(ap_shm_lookup(s.ro, s.len, bin, sizeof bin, out, sizeof out, &vl), AP_SHM_OK);
	assert_int_equal(vl, 3);
	assert_int_equal(ap_shm_lookup(s.ro, s.len, bin, 3, out, sizeof out, &vl), AP_SHM_ENOTFOUND);

	/* find + read: (gen, off) names the value. */
	uint64_t gen = 99, off = 0;
	assert_int_equal(ap_shm_find(s.ro, s.len, "a", 1, &gen, &off, &vl), AP_SHM_OK);
	assert_int_equal(gen, 0);
	assert_int_equal(vl, 4);
	assert_true(off > 0 && off % 8 == 0);
	memset(out, 0, sizeof out);
	assert_int_equal(ap_shm_read(s.ro, s.len, gen, off, out, sizeof out, &vl), AP_SHM_OK);
	assert_memory_equal(out, "back", 4);
	/* An update appends: the old (gen, off) still reads the old bytes. */
	assert_int_equal(t_put_str(s.w, "a", "newer"), 0);
	assert_int_equal(ap_shm_read(s.ro, s.len, gen, off, out, sizeof out, &vl), AP_SHM_OK);
	assert_memory_equal(out, "back", 4);
	assert_int_equal(ap_shm_find(s.ro, s.len, "missing", 7, &gen, &off, &vl), AP_SHM_ENOTFOUND);
	t_seg_close(&s);
}

static void test_etoobig_reports_the_length(void **state)
{
	(void)state;
	struct t_seg s;
	t_seg_open(&s, "toobig", 1u << 20);
	uint8_t v[100], out[100];
	for (size_t i = 0; i < sizeof v; i++)
		v[i] = (uint8_t)i;
	assert_int_equal(ap_shm_put(s.w, "k", 1, v, sizeof v), 0);

	uint32_t vl = 0;
	assert_int_equal(ap_shm_lookup(s.ro, s.len, "k", 1, out, 99, &vl), AP_SHM_ETOOBIG);
	assert_int_equal(vl, 100);
	vl = 0;
	assert_int_equal(ap_shm_lookup(s.ro, s.len, "k", 1, NULL, 0, &vl), AP_SHM_ETOOBIG);
	assert_int_equal(vl, 100);
	assert_int_equal(ap_shm_lookup(s.ro, s.len, "k", 1, out, 100, &vl), AP_SHM_OK);
	assert_memory_equal(out, v, 100);

	uint64_t gen, off;
	assert_int_equal(ap_shm_find(s.ro, s.len, "k", 1, &gen, &off, &vl), AP_SHM_OK);
	vl = 0;
	assert_int_equal(ap_shm_read(s.ro, s.len, gen, off, out, 10, &vl), AP_SHM_ETOOBIG);
	assert_int_equal(vl, 100);
	/* A (gen, off) that names no entry: EBAD, never a read elsewhere. */
	assert_int_equal(ap_shm_read(s.ro, s.len, gen, off + 8, out, sizeof out, &vl), AP_SHM_EBAD);
	assert_int_equal(ap_shm_read(s.ro, s.len, gen, 0, out, sizeof out, &vl), AP_SHM_EBAD);
	assert_int_equal(ap_shm_read(s.ro, s.len, gen, 3, out, sizeof out, &vl), AP_SHM_EBAD);
	assert_int_equal(ap_shm_read(s.ro, s.len, gen, UINT64_MAX - 7, out, sizeof out, &vl), AP_SHM_EBAD);
	/* A gen that is not the current one: EBUSY. */
	assert_int_equal(ap_shm_read(s.ro, s.len, gen + 2, off, out, sizeof out, &vl), AP_SHM_EBUSY);
	t_seg_close(&s);
}

static void test_many_keys_are_all_found_with_their_latest_values(void **state)
{
	(void)state;
	enum { N = 100000 };
	struct t_seg s;
	t_seg_open(&s, "many", 64u << 20);
	uint8_t v[T_VAL_MAX], out[T_VAL_MAX];
	char k[32];

	for (uint32_t i = 0; i < N; i++)
		assert_int_equal(ap_shm_put(s.w, k, t_key(k, i), v, t_val(v, i, 1)), 0);
	/* Every third key updated, every seventh removed. */
	for (uint32_t i = 0; i < N; i += 3)
		assert_int_equal(ap_shm_put(s.w, k, t_key(k, i), v, t_val(v, i, 2)), 0);
	for (uint32_t i = 0; i < N; i += 7)
		assert_int_equal(ap_shm_put(s.w, k, t_key(k, i), NULL, 0), 0);
	uint64_t keys, used, comp;
	ap_shm_writer_stats(s.w, &keys, &used, &comp);
	assert_int_equal(keys, N - (N + 6) / 7);
	print_message("[ info     ] %u keys: %" PRIu64 " compactions, gen %" PRIu64 ", %" PRIu64 " arena bytes\n",
		      N, comp, t_gen(s.ro), used);
	assert_true(comp > 0);
	assert_int_equal(t_gen(s.ro), comp);

	for (uint32_t i = 0; i < N; i++) {
		uint32_t vl = 0, ver = 0;
		int r = ap_shm_lookup(s.ro, s.len, k, t_key(k, i), out, sizeof out, &vl);
		if (i % 7 == 0) {
			assert_int_equal(r, AP_SHM_ENOTFOUND);
			continue;
		}
		if (r != AP_SHM_OK)
			fail_msg("key %u: %d", i, r);
		assert_int_equal(t_val_check(out, vl, i, &ver), 0);
		assert_int_equal(ver, i % 3 == 0 ? 2 : 1);
	}
	t_seg_close(&s);
}

static void test_compaction_switches_gen_and_keeps_everything(void **state)
{
	(void)state;
	enum { N = 200 };
	struct t_seg s;
	t_seg_open(&s, "compact", 1u << 20);
	uint8_t v[T_VAL_MAX], out[T_VAL_MAX];
	char k[32];
	uint32_t ver[N];

	for (uint32_t i = 0; i < N; i++) {
		ver[i] = 1;
		assert_int_equal(ap_shm_put(s.w, k, t_key(k, i), v, t_val(v, i, 1)), 0);
	}
	uint64_t gen0 = t_gen(s.ro), c0 = t_compactions(s.w), ogen, ooff;
	uint32_t vl;
	assert_int_equal(ap_shm_find(s.ro, s.len, "key-000005", 10, &ogen, &ooff, &vl), AP_SHM_OK);

	/* Updates only: the arena fills, the index does not. */
	t_rng rng;
	t_rng_seed(&rng, t_seed("compaction"));
	for (int n = 0; n < 20000; n++) {
		uint32_t i = t_rand32(&rng) % N;
		ver[i]++;
		assert_int_equal(ap_shm_put(s.w, k, t_key(k, i), v, t_val(v, i, ver[i])), 0);
		if (t_compactions(s.w) == c0 + 1 && t_gen(s.ro) == gen0 + 1) {
			/* Right after the switch: the old (gen, off) is refused. */
			uint8_t o[T_VAL_MAX];
			assert_int_equal(ap_shm_read(s.ro, s.len, ogen, ooff, o, sizeof o, &vl), AP_SHM_EBUSY);
		}
	}
	uint64_t comp = t_compactions(s.w);
	assert_true(comp >= 10);
	assert_int_equal(t_gen(s.ro), gen0 + comp - c0);
	assert_int_equal(t_keys(s.w), N);
	for (uint32_t i = 0; i < N; i++) {
		uint32_t got;
		assert_int_equal(ap_shm_lookup(s.ro, s.len, k, t_key(k, i), out, sizeof out, &vl), AP_SHM_OK);
		assert_int_equal(t_val_check(out, vl, i, &got), 0);
		assert_int_equal(got, ver[i]);
	}

	/* New keys: the index fills too (load 1/2), compactions grow it. */
	for (uint32_t i = N; i < N + 5000; i++)
		assert_int_equal(ap_shm_put(s.w, k, t_key(k, i), "x", 1), 0);
	assert_true(t_compactions(s.w) > comp);
	for (uint32_t i = N; i < N + 5000; i++) {
		t_key(k, i);
		t_assert_str(s.ro, s.len, k, "x");
	}
	const struct ap_shm_half *hh =
		(const void *)((const uint8_t *)s.ro + AP_SHM_HDR_SIZE + (t_gen(s.ro) & 1) * ((const struct ap_shm_hdr *)s.ro)->half_size);
	assert_true(hh->cap >= 2 * (N + 5000));
	assert_true(hh->nkeys <= hh->cap / 2);
	t_seg_close(&s);
}

static void test_e2big_changes_nothing(void **state)
{
	(void)state;
	struct t_seg s;
	t_seg_open(&s, "e2big", 64u << 20);
	char key[AP_SHM_MAX_KEY + 1];
	memset(key, 'k', sizeof key);
	uint8_t *big = calloc(1, AP_SHM_MAX_VAL + 1);
	assert_non_null(big);

	assert_int_equal(t_put_str(s.w, "a", "one"), 0);
	uint64_t k0, u0, c0, g0 = t_gen(s.ro);
	ap_shm_writer_stats(s.w, &k0, &u0, &c0);

	assert_int_equal(ap_shm_put(s.w, key, sizeof key, "v", 1), -E2BIG);
	assert_int_equal(ap_shm_put(s.w, "a", 1, big, AP_SHM_MAX_VAL + 1), -E2BIG);
	assert_int_equal(ap_shm_put(s.w, key, sizeof key, NULL, 0), -E2BIG);
	uint64_t k1, u1, c1;
	ap_shm_writer_stats(s.w, &k1, &u1, &c1);
	assert_int_equal(k0, k1);
	assert_int_equal(u0, u1);
	assert_int_equal(c0, c1);
	assert_int_equal(t_gen(s.ro), g0);
	assert_int_equal(ap_shm_state(s.w), AP_SHM_STATE_LIVE);
	t_assert_str(s.ro, s.len, "a", "one");
	assert_int_equal(ap_shm_lookup(s.ro, s.len, key, sizeof key, big, 16, &(uint32_t){ 0 }), AP_SHM_ENOTFOUND);

	/* The limits themselves are fine. */
	assert_int_equal(ap_shm_put(s.w, key, AP_SHM_MAX_KEY, "max key", 7), 0);
	for (size_t i = 0; i < AP_SHM_MAX_VAL; i++)
		big[i] = (uint8_t)(i * 7);
	assert_int_equal(ap_shm_put(s.w, "a", 1, big, AP_SHM_MAX_VAL), 0);
	key[AP_SHM_MAX_KEY] = 0;
	t_assert_str(s.ro, s.len, key, "max key");
	uint8_t *out = malloc(AP_SHM_MAX_VAL);
	assert_non_null(out);
	uint32_t vl = 0;
	assert_int_equal(ap_shm_lookup(s.ro, s.len, "a", 1, out, AP_SHM_MAX_VAL, &vl), AP_SHM_OK);
	assert_int_equal(vl, AP_SHM_MAX_VAL);
	assert_memory_equal(out, big, AP_SHM_MAX_VAL);
	t_seg_close(&s);
	free(out);
	free(big);
}

/* An iterator over a fixed list; a NULL value is an empty one. */
struct t_iter {
	const char **k, **v;
	size_t n, at;
	const uint8_t *big; /* when set, every value is big[0..big_len) */
	size_t big_len;
};

static int t_iter_next(void *arg, const void **key, size_t *klen, const void **val, size_t *vlen)
{
	struct t_iter *it = arg;
	if (it->at == it->n)
		return 0;
	*key = it->k[it->at];
	*klen = strlen(it->k[it->at]);
	if (it->big) {
		*val = it->big;
		*vlen = it->big_len;
	} else {
		*val = it->v[it->at];
		*vlen = it->v[it->at] ? strlen(it->v[it->at]) : 0;
	}
	it->at++;
	return 1;
}

static void test_enospc_goes_stale_and_rebuild_brings_it_back(void **state)
{
	(void)state;
	struct t_seg s;
	t_seg_open(&s, "nospc", 1u << 20);
	static uint8_t big[64 << 10];
	memset(big, 0xab, sizeof big);
	char k[32];
	int r = 0, n = 0;

	assert_int_equal(t_put_str(s.w, "small", "s"), 0);
	uint64_t gen = t_gen(s.ro);
	for (n = 0; n < 64 && r == 0; n++) {
		sprintf(k, "big-%d", n);
		gen = t_gen(s.ro);
		r = ap_shm_put(s.w, k, strlen(k), big, sizeof big);
	}
	assert_int_equal(r, -ENOSPC);
	assert_true(n > 2);
	assert_int_equal(t_gen(s.ro), gen); /* a failed put publishes nothing */
	assert_int_equal(ap_shm_state(s.w), AP_SHM_STATE_STALE);
	assert_int_equal(t_state(s.ro), AP_SHM_STATE_STALE);
	assert_int_equal(ap_shm_check(s.ro, s.len), AP_SHM_ESTALE);
	assert_int_equal(t_lookup_rc(s.ro, s.len, "small"), AP_SHM_ESTALE);
	uint64_t g, o;
	uint32_t vl;
	assert_int_equal(ap_shm_find(s.ro, s.len, "small", 5, &g, &o, &vl), AP_SHM_ESTALE);
	/* Stale stays stale, even for a put that would fit. */
	assert_int_equal(t_put_str(s.w, "tiny", "t"), -ENOSPC);
	assert_int_equal(t_put_str(s.w, "small", NULL), -ENOSPC);
	assert_int_equal(t_gen(s.ro), gen);

	/* Too much for a half: still stale, gen unchanged. */
	const char *ks[16];
	char kbuf[16][16];
	for (int i = 0; i < 16; i++) {
		sprintf(kbuf[i], "big-%d", i);
		ks[i] = kbuf[i];
	}
	struct t_iter it = { .k = ks, .n = 16, .big = big, .big_len = sizeof big };
	assert_int_equal(ap_shm_rebuild(s.w, t_iter_next, &it), -ENOSPC);
	assert_int_equal(ap_shm_state(s.w), AP_SHM_STATE_STALE);
	assert_int_equal(t_gen(s.ro), gen);

	/* What fits: live again, with exactly that content. */
	it = (struct t_iter){ .k = ks, .n = 3, .big = big, .big_len = sizeof big };
	assert_int_equal(ap_shm_rebuild(s.w, t_iter_next, &it), 0);
	assert_int_equal(ap_shm_state(s.w), AP_SHM_STATE_LIVE);
	assert_int_equal(t_state(s.ro), AP_SHM_STATE_LIVE);
	assert_int_equal(t_gen(s.ro), gen + 1);
	assert_int_equal(ap_shm_check(s.ro, s.len), AP_SHM_OK);
	assert_int_equal(t_keys(s.w), 3);
	for (int i = 0; i < 3; i++)
		t_assert_val(s.ro, s.len, ks[i], big, sizeof big);
	assert_int_equal(t_lookup_rc(s.ro, s.len, "big-3"), AP_SHM_ENOTFOUND);
	assert_int_equal(t_lookup_rc(s.ro, s.len, "small"), AP_SHM_ENOTFOUND);
	assert_int_equal(t_put_str(s.w, "small", "again"), 0);
	t_assert_str(s.ro, s.len, "small", "again");

	/* Empty values are skipped, a repeated key keeps its last value. */
	const char *k2[] = { "x", "gone", "y", "x" }, *v2[] = { "x1", NULL, "y1", "x2" };
	it = (struct t_iter){ .k = k2, .v = v2, .n = 4 };
	assert_int_equal(ap_shm_rebuild(s.w, t_iter_next, &it), 0);
	assert_int_equal(t_keys(s.w), 2);
	t_assert_str(s.ro, s.len, "x", "x2");
	t_assert_str(s.ro, s.len, "y", "y1");
	assert_int_equal(t_lookup_rc(s.ro, s.len, "gone"), AP_SHM_ENOTFOUND);
	assert_int_equal(t_lookup_rc(s.ro, s.len, "big-0"), AP_SHM_ENOTFOUND);
	/* Still a working segment afterwards: updates, removals, compaction. */
	uint64_t c0 = t_compactions(s.w);
	for (int i = 0; i < 200 && t_compactions(s.w) == c0; i++) {
		sprintf(k, "p-%d", i % 5);
		assert_int_equal(ap_shm_put(s.w, k, strlen(k), big, 4096 + (size_t)i), 0);
	}
	assert_true(t_compactions(s.w) > c0);
	t_assert_str(s.ro, s.len, "x", "x2");
	assert_int_equal(t_put_str(s.w, "x", NULL), 0);
	assert_int_equal(t_lookup_rc(s.ro, s.len, "x"), AP_SHM_ENOTFOUND);

	/* A value over the limit: -E2BIG, stale, gen unchanged. */
	static uint8_t huge[1];
	struct t_iter it3 = { .k = k2, .n = 1, .big = huge, .big_len = (size_t)AP_SHM_MAX_VAL + 1 };
	gen = t_gen(s.ro);
	assert_int_equal(ap_shm_rebuild(s.w, t_iter_next, &it3), -E2BIG);
	assert_int_equal(ap_shm_state(s.w), AP_SHM_STATE_STALE);
	assert_int_equal(t_gen(s.ro), gen);
	t_seg_close(&s);
}

/* `changes` counts every put that changed something, compactions and
 * rebuilds once each, and every state store; nothing else. ap_shm_changes
 * gives it while LIVE, AP_SHM_NO_CHANGES otherwise. */
static void test_changes_counts_every_change_and_nothing_else(void **state)
{
	(void)state;
	struct t_seg s;
	t_seg_open(&s, "changes", 1u << 20);
	static uint8_t big[64 << 10];
	uint8_t out[64];
	uint64_t c = ap_shm_changes(s.ro, s.len), g, o;
	uint32_t vl;
	char k[32];

	assert_int_equal(c, 1);
	assert_int_equal(t_changes(s.ro), 1);
	/* Lookups, finds, reads, checks and heartbeats count nothing. */
	assert_int_equal(t_lookup_rc(s.ro, s.len, "a"), AP_SHM_ENOTFOUND);
	assert_int_equal(ap_shm_check(s.ro, s.len), AP_SHM_OK);
	ap_shm_heartbeat(s.w, 99);
	assert_int_equal(ap_shm_changes(s.ro, s.len), c);

	assert_int_equal(t_put_str(s.w, "a", "one"), 0);
	assert_int_equal(ap_shm_changes(s.ro, s.len), ++c);
	assert_int_equal(t_put_str(s.w, "a", "two"), 0);
	assert_int_equal(ap_shm_changes(s.ro, s.len), ++c);
	assert_int_equal(t_put_str(s.w, "b", "bee"), 0);
	assert_int_equal(ap_shm_changes(s.ro, s.len), ++c);
	assert_int_equal(ap_shm_find(s.ro, s.len, "a", 1, &g, &o, &vl), AP_SHM_OK);
	assert_int_equal(ap_shm_read(s.ro, s.len, g, o, out, sizeof out, &vl), AP_SHM_OK);
	t_assert_str(s.ro, s.len, "b", "bee");
	assert_int_equal(ap_shm_changes(s.ro, s.len), c);
	assert_int_equal(t_put_str(s.w, "a", NULL), 0);
	assert_int_equal(ap_shm_changes(s.ro, s.len), ++c);
	/* Puts that change nothing are not counted. */
	assert_int_equal(t_put_str(s.w, "a", NULL), 0);
	assert_int_equal(t_put_str(s.w, "never", NULL), 0);
	memset(k, 'k', sizeof k);
	assert_int_equal(ap_shm_put(s.w, "a", 1, big, AP_SHM_MAX_VAL + 1), -E2BIG);
	assert_int_equal(ap_shm_changes(s.ro, s.len), c);

	/* A put that compacts: one change, visible with the new gen. */
	uint64_t c0 = t_compactions(s.w), gen = t_gen(s.ro);
	for (int i = 0; t_compactions(s.w) == c0; i++) {
		sprintf(k, "p-%d", i % 3);
		assert_int_equal(ap_shm_put(s.w, k, strlen(k), big, 8192 + (size_t)i), 0);
		assert_int_equal(ap_shm_changes(s.ro, s.len), ++c);
	}
	assert_int_equal(t_gen(s.ro), gen + 1);

	/* Full: STALE is counted, and read as no label; puts while STALE
	 * change nothing and count nothing. */
	int r = 0;
	for (int n = 0; n < 64 && r == 0; n++) {
		sprintf(k, "big-%d", n);
		r = ap_shm_put(s.w, k, strlen(k), big, sizeof big);
		if (!r)
			assert_int_equal(ap_shm_changes(s.ro, s.len), ++c);
	}
	assert_int_equal(r, -ENOSPC);
	assert_int_equal(t_state(s.ro), AP_SHM_STATE_STALE);
	assert_int_equal(t_changes(s.ro), ++c);
	assert_int_equal(ap_shm_changes(s.ro, s.len), AP_SHM_NO_CHANGES);
	assert_int_equal(t_put_str(s.w, "tiny", "t"), -ENOSPC);
	assert_int_equal(t_changes(s.ro), c);

	/* A rebuild: one change (publish and LIVE together). */
	const char *ks[] = { "x", "y" }, *vs[] = { "x1", "y1" };
	struct t_iter it = { .k = ks, .v = vs, .n = 2 };
	gen = t_gen(s.ro);
	assert_int_equal(ap_shm_rebuild(s.w, t_iter_next, &it), 0);
	assert_int_equal(t_gen(s.ro), gen + 1);
	assert_int_equal(ap_shm_changes(s.ro, s.len), ++c);
	it = (struct t_iter){ .k = ks, .v = vs, .n = 2 };
	assert_int_equal(ap_shm_rebuild(s.w, t_iter_next, &it), 0);
	assert_int_equal(ap_shm_changes(s.ro, s.len), ++c);
	/* A failed one: STALE, counted. */
	struct t_iter it2 = { .k = ks, .n = 1, .big = big, .big_len = (size_t)AP_SHM_MAX_VAL + 1 };
	assert_int_equal(ap_shm_rebuild(s.w, t_iter_next, &it2), -E2BIG);
	assert_int_equal(t_changes(s.ro), ++c);
	assert_int_equal(ap_shm_changes(s.ro, s.len), AP_SHM_NO_CHANGES);
	it = (struct t_iter){ .k = ks, .v = vs, .n = 2 };
	assert_int_equal(ap_shm_rebuild(s.w, t_iter_next, &it), 0);
	assert_int_equal(ap_shm_changes(s.ro, s.len), ++c);
	t_assert_str(s.ro, s.len, "x", "x1");

	/* Closing is a state change too; the mapping keeps the object. */
	ap_shm_writer_close(s.w, 1);
	assert_int_equal(t_changes(s.ro), ++c);
	assert_int_equal(ap_shm_changes(s.ro, s.len), AP_SHM_NO_CHANGES);
	munmap((void *)s.ro, s.len);
}

/* ap_shm_changes reads the header only, and nothing of it unless len
 * covers it: exact-size copies (ASan) of every short length, misaligned
 * and NULL bases, and each checked field broken. */
static void test_changes_on_hostile_headers_is_no_label(void **state)
{
	(void)state;
	uint8_t *mem = aligned_alloc(8, T_SMALL_SEG);
	assert_non_null(mem);
	memset(mem, 0, T_SMALL_SEG);
	ap_shm_writer *w;
	assert_int_equal(ap_shm_writer_init_mem(&w, mem, T_SMALL_SEG, "n@h", 1), 0);
	assert_int_equal(t_put_str(w, "k", "v"), 0);
	uint64_t c = ap_shm_changes(mem, T_SMALL_SEG);
	assert_int_equal(c, 2);

	for (size_t len = 0; len <= AP_SHM_HDR_SIZE + 8; len++) {
		uint8_t *d = t_dup(mem, len);
		assert_int_equal(ap_shm_changes(d, len), len < AP_SHM_HDR_SIZE ? AP_SHM_NO_CHANGES : c);
		free(d);
	}
	assert_int_equal(ap_shm_changes(NULL, T_SMALL_SEG), AP_SHM_NO_CHANGES);
	uint64_t *odd = malloc(T_SMALL_SEG + 8);
	assert_non_null(odd);
	memcpy((uint8_t *)odd + 4, mem, T_SMALL_SEG);
	assert_int_equal(ap_shm_changes((uint8_t *)odd + 4, T_SMALL_SEG), AP_SHM_NO_CHANGES);
	free(odd);

	uint8_t *m = t_dup(mem, AP_SHM_HDR_SIZE);
	struct ap_shm_hdr *h = (struct ap_shm_hdr *)m;
	assert_int_equal(ap_shm_changes(m, AP_SHM_HDR_SIZE), c);
	h->magic ^= 1;
	assert_int_equal(ap_shm_changes(m, AP_SHM_HDR_SIZE), AP_SHM_NO_CHANGES);
	h->magic ^= 1;
	h->version++;
	assert_int_equal(ap_shm_changes(m, AP_SHM_HDR_SIZE), AP_SHM_NO_CHANGES);
	h->version--;
	h->hdr_size = 64;
	assert_int_equal(ap_shm_changes(m, AP_SHM_HDR_SIZE), AP_SHM_NO_CHANGES);
	h->hdr_size = AP_SHM_HDR_SIZE;
	const uint32_t states[] = { 0, AP_SHM_STATE_STALE, AP_SHM_STATE_CLOSED, 0xdead };
	for (size_t i = 0; i < sizeof states / sizeof states[0]; i++) {
		h->state = states[i];
		assert_int_equal(ap_shm_changes(m, AP_SHM_HDR_SIZE), AP_SHM_NO_CHANGES);
	}
	h->state = AP_SHM_STATE_LIVE;
	/* The counter is just a number: any value but 0 is a label. */
	h->changes = UINT64_MAX;
	assert_true(ap_shm_changes(m, AP_SHM_HDR_SIZE) == UINT64_MAX);
	h->changes = 0;
	assert_int_equal(ap_shm_changes(m, AP_SHM_HDR_SIZE), AP_SHM_NO_CHANGES);
	/* Sizes are not its business: a header ap_shm_check refuses still
	 * has a label, and lookups then say EBAD. */
	h->changes = 5;
	h->seg_size = UINT64_MAX;
	assert_int_equal(ap_shm_changes(m, AP_SHM_HDR_SIZE), 5);
	assert_int_equal(ap_shm_check(m, AP_SHM_HDR_SIZE), AP_SHM_EBAD);
	free(m);
	ap_shm_writer_close(w, 0);
	free(mem);
}

static void test_close_unlinks_and_marks_closed(void **state)
{
	(void)state;
	struct t_seg s;
	t_seg_open(&s, "close", 1u << 20);
	assert_int_equal(t_put_str(s.w, "a", "b"), 0);
	ap_shm_writer_close(s.w, 1);
	errno = 0;
	assert_true(shm_open(s.name, O_RDONLY, 0) < 0);
	assert_int_equal(errno, ENOENT);
	/* The mapping made before keeps the object, and says it is closed. */
	assert_int_equal(t_state(s.ro), AP_SHM_STATE_CLOSED);
	assert_int_equal(ap_shm_check(s.ro, s.len), AP_SHM_ESTALE);
	assert_int_equal(t_lookup_rc(s.ro, s.len, "a"), AP_SHM_ESTALE);
	munmap((void *)s.ro, s.len);

	/* Without unlink the name stays; a new create replaces it. */
	t_seg_open(&s, "keep", 1u << 20);
	assert_int_equal(t_put_str(s.w, "a", "b"), 0);
	ap_shm_writer_close(s.w, 0);
	size_t len;
	const void *again = t_map_ro(s.name, &len);
	assert_int_equal(t_state(again), AP_SHM_STATE_CLOSED);
	ap_shm_writer *w;
	assert_int_equal(ap_shm_writer_create(&w, s.name, 2u << 20, "n", 2), 0);
	assert_int_equal(t_state(again), AP_SHM_STATE_CLOSED); /* the old object, still mapped */
	size_t len2;
	const void *fresh = t_map_ro(s.name, &len2);
	assert_int_equal(len2, 2u << 20);
	assert_int_equal(ap_shm_check(fresh, len2), AP_SHM_OK);
	assert_int_equal(t_lookup_rc(fresh, len2, "a"), AP_SHM_ENOTFOUND);
	ap_shm_writer_close(w, 1);
	munmap((void *)again, len);
	munmap((void *)fresh, len2);
	munmap((void *)s.ro, s.len);
}

/* ---- readers racing the writer ------------------------------------------ */

#define T_CONC_KEYS 300u
#define T_CONC_VER0 (1u << 31) /* big values: ~850 KB live in a ~1 MB arena */

struct t_conc {
	const void *seg;
	size_t len;
	ap_shm_writer *w;
	int stop;
	uint64_t puts;
	uint64_t comps; /* atomic: compactions so far, as the writer thread saw them */
};

/* Run the threads for at least min_ms and until done(arg) holds, at most
 * 30 s: a loaded machine gets more time instead of a failed threshold. */
static void t_run_until(int *stop, int (*done)(void *), void *arg, int min_ms)
{
	int64_t t0 = t_now_ms();
	while (t_now_ms() - t0 < 30000 && (t_now_ms() - t0 < min_ms || !done(arg)))
		usleep(20 * 1000);
	__atomic_store_n(stop, 1, __ATOMIC_RELAXED);
}

struct t_reader {
	struct t_conc *c;
	int use_find; /* find + read instead of lookup */
	uint64_t seed;
	uint64_t ok, busy, notfound, wrong_notfound, bad, torn, backwards;
	int last_rc;
};

/* Keys id % 10 == 0 are removed and put back now and then; the others are
 * always there once the first round is in. The segment is nearly full, so
 * the writer compacts every few dozen puts and spends most of its time
 * rewriting the inactive half: readers that fall behind a gen (preempted,
 * say) are then likely to read it mid-rewrite, which the gen check must
 * catch. */
static void *t_conc_writer(void *arg)
{
	struct t_conc *c = arg;
	uint8_t v[T_VAL_MAX];
	char k[32];
	t_rng rng;
	uint32_t ver = T_CONC_VER0;
	t_rng_seed(&rng, 0x77);
	while (!__atomic_load_n(&c->stop, __ATOMIC_RELAXED)) {
		uint32_t id = t_rand32(&rng) % T_CONC_KEYS;
		ver++;
		int r;
		if (id % 10 == 0 && ver % 3 == 0)
			r = ap_shm_put(c->w, k, t_key(k, id), NULL, 0);
		else
			r = ap_shm_put(c->w, k, t_key(k, id), v, t_val(v, id, ver));
		if (r)
			return (void *)(intptr_t)r;
		c->puts++;
		__atomic_store_n(&c->comps, t_compactions(c->w), __ATOMIC_RELAXED);
		if ((ver & 1023) == 0)
			ap_shm_heartbeat(c->w, (uint64_t)t_now_ms());
	}
	return NULL;
}

struct t_conc_run {
	struct t_conc *c;
	struct t_reader *rd;
	uint64_t c0;
};

static int t_conc_done(void *arg)
{
	struct t_conc_run *r = arg;
	return __atomic_load_n(&r->rd[0].ok, __ATOMIC_RELAXED) > 10000 &&
	       __atomic_load_n(&r->rd[1].ok, __ATOMIC_RELAXED) > 10000 &&
	       __atomic_load_n(&r->c->comps, __ATOMIC_RELAXED) > r->c0 + 20;
}

static void *t_conc_reader(void *arg)
{
	struct t_reader *rd = arg;
	struct t_conc *c = rd->c;
	static __thread uint32_t last[T_CONC_KEYS];
	uint8_t out[T_VAL_MAX];
	char k[32];
	t_rng rng;
	t_rng_seed(&rng, rd->seed);
	while (!__atomic_load_n(&c->stop, __ATOMIC_RELAXED)) {
		uint32_t id = t_rand32(&rng) % T_CONC_KEYS, vl = 0, ver;
		size_t kl = t_key(k, id);
		int r;
		if (rd->use_find) {
			uint64_t gen, off;
			r = ap_shm_find(c->seg, c->len, k, kl, &gen, &off, &vl);
			if (r == AP_SHM_OK)
				r = ap_shm_read(c->seg, c->len, gen, off, out, sizeof out, &vl);
		} else {
			r = ap_shm_lookup(c->seg, c->len, k, kl, out, sizeof out, &vl);
		}
		switch (r) {
		case AP_SHM_OK:
			if (t_val_check(out, vl, id, &ver)) {
				rd->torn++;
				break;
			}
			if (ver < last[id])
				rd->backwards++;
			last[id] = ver;
			__atomic_fetch_add(&rd->ok, 1, __ATOMIC_RELAXED);
			break;
		case AP_SHM_EBUSY:
			rd->busy++;
			break;
		case AP_SHM_ENOTFOUND:
			rd->notfound++;
			if (id % 10)
				rd->wrong_notfound++;
			break;
		default:
			rd->bad++;
			rd->last_rc = r;
		}
	}
	return NULL;
}

static void test_readers_racing_the_writer_see_whole_values(void **state)
{
	(void)state;
	struct t_seg s;
	t_seg_open(&s, "conc", 2u << 20);
	uint8_t v[T_VAL_MAX];
	char k[32];
	for (uint32_t i = 0; i < T_CONC_KEYS; i++)
		assert_int_equal(ap_shm_put(s.w, k, t_key(k, i), v, t_val(v, i, T_CONC_VER0)), 0);

	struct t_conc c = { .seg = s.ro, .len = s.len, .w = s.w };
	struct t_reader rd[2] = { { .c = &c, .seed = 1 }, { .c = &c, .use_find = 1, .seed = 2 } };
	pthread_t wt, rt[2];
	uint64_t c0 = t_compactions(s.w);
	for (int i = 0; i < 2; i++)
		assert_int_equal(pthread_create(&rt[i], NULL, t_conc_reader, &rd[i]), 0);
	assert_int_equal(pthread_create(&wt, NULL, t_conc_writer, &c), 0);
	struct t_conc_run run = { &c, rd, c0 };
	t_run_until(&c.stop, t_conc_done, &run, 1500);
	void *wr;
	pthread_join(wt, &wr);
	for (int i = 0; i < 2; i++)
		pthread_join(rt[i], NULL);
	assert_null(wr);

	uint64_t comp = t_compactions(s.w) - c0;
	print_message("[ info     ] %" PRIu64 " puts, %" PRIu64 " compactions\n", c.puts, comp);
	for (int i = 0; i < 2; i++) {
		print_message("[ info     ] reader %d (%s): ok %" PRIu64 " busy %" PRIu64 " notfound %" PRIu64
			      " bad %" PRIu64 " torn %" PRIu64 " backwards %" PRIu64 "\n",
			      i, rd[i].use_find ? "find+read" : "lookup", rd[i].ok, rd[i].busy, rd[i].notfound,
			      rd[i].bad, rd[i].torn, rd[i].backwards);
		assert_int_equal(rd[i].torn, 0);
		assert_int_equal(rd[i].backwards, 0);
		assert_int_equal(rd[i].wrong_notfound, 0);
		if (rd[i].bad)
			fail_msg("reader %d: %" PRIu64 " unexpected results, last %d", i, rd[i].bad, rd[i].last_rc);
		assert_true(rd[i].ok > 10000);
	}
	assert_true(comp > 20);

	/* Quiet again: every key at its latest value. */
	uint8_t out[T_VAL_MAX];
	for (uint32_t i = 0; i < T_CONC_KEYS; i++) {
		uint32_t vl, ver;
		int r = ap_shm_lookup(s.ro, s.len, k, t_key(k, i), out, sizeof out, &vl);
		if (i % 10 == 0 && r == AP_SHM_ENOTFOUND)
			continue;
		assert_int_equal(r, AP_SHM_OK);
		assert_int_equal(t_val_check(out, vl, i, &ver), 0);
	}
	t_seg_close(&s);
}

/* A reader that caches answers by key under the label ap_shm_changes gave
 * BEFORE its lookup (as the NIF does) never answers a version older than
 * one whose put had returned before it started: the writer acknowledges
 * each version (acked[id]) after put returns, and the reader compares what
 * it answers with what was acknowledged before it began. Few keys, and a
 * writer that pauses between puts, so that most answers are cache hits;
 * big values, so that puts compact too. */
#define T_LBL_KEYS 4u

struct t_lbl {
	const void *seg;
	size_t len;
	ap_shm_writer *w;
	int stop;
	uint32_t acked[T_LBL_KEYS];
	uint64_t puts;
	uint64_t comps; /* atomic, as for t_conc */
};

struct t_lbl_reader {
	struct t_lbl *c;
	uint64_t hits, misses, other, late, torn;
};

static void *t_lbl_writer(void *arg)
{
	struct t_lbl *c = arg;
	uint8_t v[T_VAL_MAX];
	char k[32];
	t_rng rng;
	uint32_t ver = T_CONC_VER0;
	t_rng_seed(&rng, 0x1abe1);
	while (!__atomic_load_n(&c->stop, __ATOMIC_RELAXED)) {
		uint32_t id = t_rand32(&rng) % T_LBL_KEYS;
		int r = ap_shm_put(c->w, k, t_key(k, id), v, t_val(v, id, ++ver));
		if (r)
			return (void *)(intptr_t)r;
		__atomic_store_n(&c->acked[id], ver, __ATOMIC_RELEASE);
		c->puts++;
		__atomic_store_n(&c->comps, t_compactions(c->w), __ATOMIC_RELAXED);
		for (uint32_t n = t_rand32(&rng) % 4096; n; n--)
			__asm__ __volatile__("" ::: "memory");
	}
	return NULL;
}

static void *t_lbl_read(void *arg)
{
	struct t_lbl_reader *rd = arg;
	struct t_lbl *c = rd->c;
	struct {
		uint64_t label;
		uint32_t ver;
	} cache[T_LBL_KEYS] = { { 0, 0 } };
	uint8_t out[T_VAL_MAX];
	char k[32];
	t_rng rng;
	t_rng_seed(&rng, 0x5ead);
	while (!__atomic_load_n(&c->stop, __ATOMIC_RELAXED)) {
		uint32_t id = t_rand32(&rng) % T_LBL_KEYS, vl = 0, ver;
		uint32_t acked = __atomic_load_n(&c->acked[id], __ATOMIC_ACQUIRE);
		/* The label first, then the lookup: never the other way. */
		uint64_t label = ap_shm_changes(c->seg, c->len);
		if (label != AP_SHM_NO_CHANGES && cache[id].label == label) {
			ver = cache[id].ver;
			__atomic_fetch_add(&rd->hits, 1, __ATOMIC_RELAXED);
		} else {
			int r = ap_shm_lookup(c->seg, c->len, k, t_key(k, id), out, sizeof out, &vl);
			if (r != AP_SHM_OK) {
				rd->other++;
				continue;
			}
			if (t_val_check(out, vl, id, &ver)) {
				rd->torn++;
				continue;
			}
			cache[id].label = label;
			cache[id].ver = ver;
			__atomic_fetch_add(&rd->misses, 1, __ATOMIC_RELAXED);
		}
		if (ver < acked)
			rd->late++;
	}
	return NULL;
}

struct t_lbl_run {
	struct t_lbl *c;
	struct t_lbl_reader *rd;
	uint64_t c0;
};

static int t_lbl_done(void *arg)
{
	struct t_lbl_run *r = arg;
	return __atomic_load_n(&r->rd->hits, __ATOMIC_RELAXED) > 10000 &&
	       __atomic_load_n(&r->rd->misses, __ATOMIC_RELAXED) > 1000 &&
	       __atomic_load_n(&r->c->comps, __ATOMIC_RELAXED) > r->c0;
}

static void test_changes_label_never_answers_an_acknowledged_put_late(void **state)
{
	(void)state;
	struct t_seg s;
	t_seg_open(&s, "label", 1u << 20);
	uint8_t v[T_VAL_MAX];
	char k[32];
	struct t_lbl c = { .w = s.w };
	for (uint32_t i = 0; i < T_LBL_KEYS; i++) {
		assert_int_equal(ap_shm_put(s.w, k, t_key(k, i), v, t_val(v, i, T_CONC_VER0)), 0);
		c.acked[i] = T_CONC_VER0;
	}
	c.seg = s.ro;
	c.len = s.len;
	struct t_lbl_reader rd = { .c = &c };
	pthread_t wt, rt;
	uint64_t c0 = t_compactions(s.w);
	assert_int_equal(pthread_create(&rt, NULL, t_lbl_read, &rd), 0);
	assert_int_equal(pthread_create(&wt, NULL, t_lbl_writer, &c), 0);
	struct t_lbl_run run = { &c, &rd, c0 };
	t_run_until(&c.stop, t_lbl_done, &run, 1000);
	void *wr;
	pthread_join(wt, &wr);
	pthread_join(rt, NULL);
	assert_null(wr);
	print_message("[ info     ] %" PRIu64 " puts, %" PRIu64 " compactions; hits %" PRIu64 " misses %" PRIu64
		      " other %" PRIu64 " late %" PRIu64 " torn %" PRIu64 "\n",
		      c.puts, t_compactions(s.w) - c0, rd.hits, rd.misses, rd.other, rd.late, rd.torn);
	assert_int_equal(rd.late, 0);
	assert_int_equal(rd.torn, 0);
	assert_true(rd.hits > 10000 && rd.misses > 1000);
	assert_true(t_compactions(s.w) > c0);
	t_seg_close(&s);
}

/* ---- hostile segments ---------------------------------------------------- */

static const char *t_hkeys[] = { "alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta" };
#define T_NHKEYS (sizeof t_hkeys / sizeof t_hkeys[0])

/* A small valid segment: the keys with values, one removed, and enough
 * updates that it compacted (gen > 0) when `compacted`. */
static uint8_t *t_small_seg(int compacted)
{
	uint8_t *mem = aligned_alloc(8, T_SMALL_SEG);
	assert_non_null(mem);
	memset(mem, 0, T_SMALL_SEG);
	ap_shm_writer *w;
	assert_int_equal(ap_shm_writer_init_mem(&w, mem, T_SMALL_SEG, "hostile@test", 1), 0);
	char v[200];
	for (size_t i = 0; i < T_NHKEYS; i++) {
		snprintf(v, sizeof v, "value of %s", t_hkeys[i]);
		assert_int_equal(t_put_str(w, t_hkeys[i], v), 0);
	}
	assert_int_equal(t_put_str(w, "eta", NULL), 0);
	if (compacted) {
		memset(v, 'u', sizeof v - 1);
		v[sizeof v - 1] = 0;
		for (int i = 0; t_compactions(w) < 1; i++)
			assert_int_equal(t_put_str(w, t_hkeys[i % 3], v), 0);
		for (size_t i = 0; i < 3; i++) {
			snprintf(v, sizeof v, "value of %s", t_hkeys[i]);
			assert_int_equal(t_put_str(w, t_hkeys[i], v), 0);
		}
	}
	ap_shm_writer_close(w, 0);
	/* Closed marks it CLOSED: readers would refuse it. Make it LIVE. */
	((struct ap_shm_hdr *)mem)->state = AP_SHM_STATE_LIVE;
	assert_int_equal(ap_shm_check(mem, T_SMALL_SEG), AP_SHM_OK);
	return mem;
}

static struct ap_shm_hdr *t_hdr(uint8_t *seg) { return (struct ap_shm_hdr *)seg; }

static struct ap_shm_half *t_active(uint8_t *seg)
{
	struct ap_shm_hdr *h = t_hdr(seg);
	return (struct ap_shm_half *)(seg + AP_SHM_HDR_SIZE + (h->gen & 1) * h->half_size);
}

/* key's slot in the active half of a valid segment. */
static uint64_t *t_slot(uint8_t *seg, const char *key)
{
	struct ap_shm_half *hh = t_active(seg);
	uint64_t *slots = (uint64_t *)(hh + 1), h = ap_shm_hash(t_hdr(seg)->hash_seed, key, strlen(key));
	for (uint64_t i = h & (hh->cap - 1);; i = (i + 1) & (hh->cap - 1)) {
		assert_true(slots[i] != 0);
		if (slots[i] >> 32 == h >> 32)
			return &slots[i];
	}
}

static struct ap_shm_entry *t_entry(uint8_t *seg, const char *key)
{
	struct ap_shm_half *hh = t_active(seg);
	return (struct ap_shm_entry *)((uint8_t *)hh + hh->arena_off + ((*t_slot(seg, key) & 0xffffffffu) << 3));
}

/* Every reader call over seg[0..len) (an exact-size copy, so ASan sees any
 * read past it): results must be ones the API names, and no crash. Returns
 * a bitmask of the lookup results seen. */
static unsigned t_read_all(const uint8_t *seg, size_t len)
{
	uint8_t *d = t_dup(seg, len);
	unsigned seen = 0;
	int r = ap_shm_check(d, len);
	assert_true(r == AP_SHM_OK || r == AP_SHM_EBAD || r == AP_SHM_ESTALE);
	for (size_t i = 0; i <= T_NHKEYS; i++) {
		const char *k = i < T_NHKEYS ? t_hkeys[i] : "missing";
		static uint8_t big[1 << 16]; /* more than a small segment: a value past the arena gets copied */
		uint8_t small[4];
		uint32_t vl = 0;
		uint64_t gen = 0, off = 0;
		r = ap_shm_lookup(d, len, k, strlen(k), big, sizeof big, &vl);
		assert_true(r >= AP_SHM_OK && r <= AP_SHM_ETOOBIG && r != AP_SHM_EBUSY);
		if (r == AP_SHM_OK)
			assert_true(vl <= sizeof big);
		seen |= 1u << r;
		r = ap_shm_lookup(d, len, k, strlen(k), small, sizeof small, &vl);
		assert_true(r >= AP_SHM_OK && r <= AP_SHM_ETOOBIG && r != AP_SHM_EBUSY);
		r = ap_shm_find(d, len, k, strlen(k), &gen, &off, &vl);
		assert_true(r >= AP_SHM_OK && r <= AP_SHM_ESTALE && r != AP_SHM_EBUSY);
		if (r == AP_SHM_OK) {
			r = ap_shm_read(d, len, gen, off, big, sizeof big, &vl);
			assert_true(r == AP_SHM_OK || r == AP_SHM_ETOOBIG);
		}
	}
	/* A label only for a header that passes the cheap checks and is LIVE
	 * (seg holds at least len bytes: its header is d's when len covers it). */
	uint64_t c = ap_shm_changes(d, len);
	if (c != AP_SHM_NO_CHANGES)
		assert_true(len >= AP_SHM_HDR_SIZE && c == t_changes(seg) && t_state(seg) == AP_SHM_STATE_LIVE);
	if (ap_shm_check(d, len) == AP_SHM_OK)
		assert_true(c == t_changes(seg));
	free(d);
	return seen;
}

#define T_ONLY(code) (1u << (code))

typedef void (*t_mutate_fn)(uint8_t *seg);

#define T_MUT(name, ...)                         \
	static void name(uint8_t *seg)           \
	{                                        \
		(void)seg;                       \
		__VA_ARGS__;                     \
	}

T_MUT(m_magic, t_hdr(seg)->magic ^= 1)
T_MUT(m_version, t_hdr(seg)->version = AP_SHM_VERSION + 1)
T_MUT(m_hdr_size, t_hdr(seg)->hdr_size = 64)
T_MUT(m_seg_big, t_hdr(seg)->seg_size = T_SMALL_SEG + 8)
T_MUT(m_seg_max, t_hdr(seg)->seg_size = UINT64_MAX)
T_MUT(m_seg_tiny, t_hdr(seg)->seg_size = 100)
T_MUT(m_half_huge, t_hdr(seg)->half_size = UINT64_MAX - 7)
T_MUT(m_half_wrap, t_hdr(seg)->half_size = 1ull << 63)
T_MUT(m_half_odd, t_hdr(seg)->half_size -= 4)
T_MUT(m_half_small, t_hdr(seg)->half_size = 64)
T_MUT(m_half_zero, t_hdr(seg)->half_size = 0)
T_MUT(m_gen_flip, t_hdr(seg)->gen ^= 1)
T_MUT(m_stale, t_hdr(seg)->state = AP_SHM_STATE_STALE)
T_MUT(m_closed, t_hdr(seg)->state = AP_SHM_STATE_CLOSED)
T_MUT(m_state_junk, t_hdr(seg)->state = 0xdead)
T_MUT(m_node_unterminated, memset(t_hdr(seg)->node, 'x', sizeof t_hdr(seg)->node))
T_MUT(m_cap_odd, t_active(seg)->cap = AP_SHM_MIN_CAP + 1)
T_MUT(m_cap_small, t_active(seg)->cap = AP_SHM_MIN_CAP / 2)
T_MUT(m_cap_zero, t_active(seg)->cap = 0)
T_MUT(m_cap_huge, t_active(seg)->cap = 1ull << 40)
T_MUT(m_cap_top, t_active(seg)->cap = 1ull << 63)
T_MUT(m_cap_bigger, t_active(seg)->cap = 2048) /* a power of two past the arena start */
T_MUT(m_aoff_out, t_active(seg)->arena_off = t_hdr(seg)->half_size + 8)
T_MUT(m_aoff_odd, t_active(seg)->arena_off += 4)
T_MUT(m_aoff_in_index, t_active(seg)->arena_off -= 8)
T_MUT(m_aoff_huge, t_active(seg)->arena_off = UINT64_MAX - 7)
T_MUT(m_asize_huge, t_active(seg)->arena_size = UINT64_MAX - 7)
T_MUT(m_asize_wrap, t_active(seg)->arena_size = UINT64_MAX - t_active(seg)->arena_off + 9)
T_MUT(m_asize_past, t_active(seg)->arena_size += 8)
T_MUT(m_asize_odd, t_active(seg)->arena_size -= 3)
T_MUT(m_asize_zero, t_active(seg)->arena_size = 0)
T_MUT(m_slot_out, *t_slot(seg, "alpha") |= 0xffffffffu)
T_MUT(m_slot_past, *t_slot(seg, "alpha") = (*t_slot(seg, "alpha") & ~0xffffffffull) |
				     (t_active(seg)->arena_size >> 3))
T_MUT(m_slot_last, *t_slot(seg, "alpha") = (*t_slot(seg, "alpha") & ~0xffffffffull) |
				     ((t_active(seg)->arena_size - 8) >> 3))
T_MUT(m_slot_zero_tag, *t_slot(seg, "alpha") &= 0xffffffffull)
T_MUT(m_klen_huge, t_entry(seg, "alpha")->key_len = UINT32_MAX)
T_MUT(m_klen_max, t_entry(seg, "alpha")->key_len = AP_SHM_MAX_KEY)
T_MUT(m_vlen_huge, t_entry(seg, "alpha")->val_len = UINT32_MAX)
T_MUT(m_vlen_wrap, t_entry(seg, "alpha")->val_len = UINT32_MAX - 6)
T_MUT(m_vlen_past, t_entry(seg, "alpha")->val_len = AP_SHM_MAX_VAL)
T_MUT(m_vlen_arena, t_entry(seg, "alpha")->val_len = (uint32_t)t_active(seg)->arena_size)
T_MUT(m_hash, t_entry(seg, "alpha")->hash ^= 1)
T_MUT(m_seed, t_hdr(seg)->hash_seed ^= 1) /* every key hashes elsewhere: all miss */
/* One byte past the arena's end, which for gen 1 is the segment's end. */
T_MUT(m_vlen_edge, {
	struct ap_shm_entry *e = t_entry(seg, "alpha");
	uint64_t at = (uint64_t)((uint8_t *)e - ((uint8_t *)t_active(seg) + t_active(seg)->arena_off));
	e->val_len = (uint32_t)(t_active(seg)->arena_size - at - 16 - ((e->key_len + 7) & ~7u) + 1);
})
/* alpha's entry header moved to the arena's last 16 bytes: no room for its key. */
T_MUT(m_klen_edge, {
	struct ap_shm_half *hh = t_active(seg);
	uint64_t at = hh->arena_size - 16, *slot = t_slot(seg, "alpha");
	memcpy((uint8_t *)hh + hh->arena_off + at, t_entry(seg, "alpha"), 16);
	*slot = (*slot & ~0xffffffffull) | at >> 3;
})
T_MUT(m_index_full, {
	struct ap_shm_half *hh = t_active(seg);
	uint64_t *slots = (uint64_t *)(hh + 1);
	for (uint64_t i = 0; i < hh->cap; i++)
		if (!slots[i])
			slots[i] = 0x0000000100000001ull; /* tag 1, offset 8: a real entry, another key */
})
T_MUT(m_index_full_bad, {
	struct ap_shm_half *hh = t_active(seg);
	uint64_t *slots = (uint64_t *)(hh + 1);
	for (uint64_t i = 0; i < hh->cap; i++)
		slots[i] = 0xffffffffffffffffull;
})

struct t_mutation {
	const char *name;
	t_mutate_fn fn;
	unsigned allowed; /* lookup results allowed (bitmask); 0: anything but a crash */
};

#define T_M(fn, allowed) { #fn, fn, allowed }

static void test_hostile_segments_never_crash(void **state)
{
	(void)state;
	const unsigned bad = T_ONLY(AP_SHM_EBAD), stale = T_ONLY(AP_SHM_ESTALE);
	const unsigned soft = T_ONLY(AP_SHM_EBAD) | T_ONLY(AP_SHM_ENOTFOUND) | T_ONLY(AP_SHM_OK) | T_ONLY(AP_SHM_ETOOBIG);
	const struct t_mutation muts[] = {
		T_M(m_magic, bad),          T_M(m_version, bad),        T_M(m_hdr_size, bad),
		T_M(m_seg_big, bad),        T_M(m_seg_max, bad),        T_M(m_seg_tiny, bad),
		T_M(m_half_huge, bad),      T_M(m_half_wrap, bad),      T_M(m_half_odd, bad),
		T_M(m_half_small, bad),     T_M(m_half_zero, bad),      T_M(m_gen_flip, 0),
		T_M(m_stale, stale),        T_M(m_closed, stale),       T_M(m_state_junk, stale),
		T_M(m_node_unterminated, 0), T_M(m_cap_odd, bad),       T_M(m_cap_small, bad),
		T_M(m_cap_zero, bad),       T_M(m_cap_huge, bad),       T_M(m_cap_top, bad),
		T_M(m_cap_bigger, bad),     T_M(m_aoff_out, bad),       T_M(m_aoff_odd, bad),
		T_M(m_aoff_in_index, bad),  T_M(m_aoff_huge, bad),      T_M(m_asize_huge, bad),
		T_M(m_asize_wrap, bad),     T_M(m_asize_past, bad),     T_M(m_asize_odd, bad),
		T_M(m_asize_zero, soft),    T_M(m_slot_out, soft),      T_M(m_slot_past, soft),
		T_M(m_slot_last, soft),     T_M(m_slot_zero_tag, soft), T_M(m_klen_huge, soft),
		T_M(m_klen_max, soft),      T_M(m_vlen_huge, soft),     T_M(m_vlen_wrap, soft),
		T_M(m_vlen_past, soft),     T_M(m_vlen_arena, soft),    T_M(m_hash, soft),
		T_M(m_index_full, soft),    T_M(m_index_full_bad, soft), T_M(m_vlen_edge, soft),
		T_M(m_klen_edge, soft),     T_M(m_seed, T_ONLY(AP_SHM_ENOTFOUND)),
	};
	for (int compacted = 0; compacted < 2; compacted++) {
		uint8_t *seg = t_small_seg(compacted);
		assert_int_equal(t_gen(seg) != 0, compacted);
		unsigned seen = t_read_all(seg, T_SMALL_SEG);
		assert_int_equal(seen, T_ONLY(AP_SHM_OK) | T_ONLY(AP_SHM_ENOTFOUND));
		for (size_t i = 0; i < T_NHKEYS; i++)
			if (strcmp(t_hkeys[i], "eta")) {
				char v[64];
				snprintf(v, sizeof v, "value of %s", t_hkeys[i]);
				t_assert_str(seg, T_SMALL_SEG, t_hkeys[i], v);
			}

		uint8_t *m = malloc(T_SMALL_SEG);
		assert_non_null(m);
		for (size_t i = 0; i < sizeof muts / sizeof muts[0]; i++) {
			memcpy(m, seg, T_SMALL_SEG);
			muts[i].fn(m);
			seen = t_read_all(m, T_SMALL_SEG);
			if (muts[i].allowed && (seen & ~muts[i].allowed))
				fail_msg("%s (compacted %d): lookups gave 0x%x, allowed 0x%x", muts[i].name, compacted,
					 seen, muts[i].allowed);
		}
		/* The entry corruptions hit alpha only: its result is EBAD
		 * (or not found: a hash or tag that no longer matches). */
		memcpy(m, seg, T_SMALL_SEG);
		m_vlen_wrap(m);
		assert_int_equal(t_lookup_rc(m, T_SMALL_SEG, "alpha"), AP_SHM_EBAD);
		t_assert_str(m, T_SMALL_SEG, "beta", "value of beta");
		memcpy(m, seg, T_SMALL_SEG);
		m_vlen_edge(m);
		assert_int_equal(t_lookup_rc(m, T_SMALL_SEG, "alpha"), AP_SHM_EBAD);
		memcpy(m, seg, T_SMALL_SEG);
		m_klen_edge(m);
		assert_int_equal(t_lookup_rc(m, T_SMALL_SEG, "alpha"), AP_SHM_EBAD);
		memcpy(m, seg, T_SMALL_SEG);
		m_slot_out(m);
		assert_int_equal(t_lookup_rc(m, T_SMALL_SEG, "alpha"), AP_SHM_EBAD);
		memcpy(m, seg, T_SMALL_SEG);
		m_hash(m);
		assert_int_equal(t_lookup_rc(m, T_SMALL_SEG, "alpha"), AP_SHM_ENOTFOUND);
		memcpy(m, seg, T_SMALL_SEG);
		m_seed(m);
		assert_int_equal(t_lookup_rc(m, T_SMALL_SEG, "alpha"), AP_SHM_ENOTFOUND);
		memcpy(m, seg, T_SMALL_SEG);
		m_index_full(m);
		assert_int_equal(t_lookup_rc(m, T_SMALL_SEG, "missing"), AP_SHM_EBAD);
		/* Not 8-aligned: refused before any load. */
		memcpy(m, seg, T_SMALL_SEG);
		assert_int_equal(ap_shm_check(m + 1, T_SMALL_SEG - 1), AP_SHM_EBAD);
		assert_int_equal(ap_shm_check(NULL, T_SMALL_SEG), AP_SHM_EBAD);
		free(m);
		free(seg);
	}
}

/* A hostile segment whose index (cap T_CHAIN_CAP, more than
 * AP_SHM_MAX_PROBES) holds a chain of `chain` slots from "victim"'s home
 * slot, every one with victim's tag but pointing at another key's entry
 * (the costliest probe: an entry check and a compare), except victim's own
 * at position key_at (< 0: nowhere). Past the chain, an empty slot. */
#define T_CHAIN_CAP 8192u
#define T_CHAIN_HALF (64u + T_CHAIN_CAP * 8u + 4096u)
#define T_CHAIN_SEG (AP_SHM_HDR_SIZE + 2u * T_CHAIN_HALF)

static uint8_t *t_chain_seg(uint64_t chain, int64_t key_at)
{
	uint8_t *mem = aligned_alloc(8, T_CHAIN_SEG);
	assert_non_null(mem);
	memset(mem, 0, T_CHAIN_SEG);
	ap_shm_writer *w;
	assert_int_equal(ap_shm_writer_init_mem(&w, mem, T_CHAIN_SEG, "chain@test", 1), 0);
	ap_shm_writer_close(w, 0);
	struct ap_shm_hdr *h = t_hdr(mem);
	h->state = AP_SHM_STATE_LIVE;
	assert_int_equal(h->gen, 0);
	struct ap_shm_half *hh = t_active(mem);
	hh->cap = T_CHAIN_CAP;
	hh->arena_off = 64 + T_CHAIN_CAP * 8;
	hh->arena_size = h->half_size - hh->arena_off;
	uint64_t *slots = (uint64_t *)(hh + 1);
	uint8_t *arena = (uint8_t *)hh + hh->arena_off;
	memset(slots, 0, T_CHAIN_CAP * 8);

	uint64_t hv = ap_shm_hash(h->hash_seed, "victim", 6), ho = ap_shm_hash(h->hash_seed, "other!", 6);
	struct ap_shm_entry ev = { hv, 6, 3 }, eo = { ho, 6, 3 };
	memcpy(arena + 8, &ev, 16);
	memcpy(arena + 24, "victim\0\0hit\0\0\0\0\0", 16);
	memcpy(arena + 40, &eo, 16);
	memcpy(arena + 56, "other!\0\0mis\0\0\0\0\0", 16);
	uint64_t tag = hv & ~0xffffffffull, mask = T_CHAIN_CAP - 1;
	for (uint64_t n = 0; n < chain; n++)
		slots[(hv + n) & mask] = tag | (40 >> 3);
	if (key_at >= 0)
		slots[(hv + (uint64_t)key_at) & mask] = tag | (8 >> 3);
	assert_int_equal(ap_shm_check(mem, T_CHAIN_SEG), AP_SHM_OK);
	return mem;
}

static int t_chain_rc(uint64_t chain, int64_t key_at)
{
	uint8_t *seg = t_chain_seg(chain, key_at);
	uint8_t out[16];
	uint32_t vl = 0;
	uint64_t gen, off;
	int r = ap_shm_lookup(seg, T_CHAIN_SEG, "victim", 6, out, sizeof out, &vl);
	if (r == AP_SHM_OK)
		assert_true(vl == 3 && !memcmp(out, "hit", 3));
	/* find agrees with lookup. */
	assert_int_equal(ap_shm_find(seg, T_CHAIN_SEG, "victim", 6, &gen, &off, &vl), r);
	free(seg);
	return r;
}

/* Chains past AP_SHM_MAX_PROBES are EBAD, found in bounded time; shorter
 * ones are walked to their end. */
static void test_overlong_probe_chain_is_ebad(void **state)
{
	(void)state;
	assert_true(T_CHAIN_CAP > AP_SHM_MAX_PROBES + 1000);
	/* Within the bound: walked, not found / found at the last probe. */
	assert_int_equal(t_chain_rc(AP_SHM_MAX_PROBES - 1, -1), AP_SHM_ENOTFOUND);
	assert_int_equal(t_chain_rc(AP_SHM_MAX_PROBES + 1000, AP_SHM_MAX_PROBES - 1), AP_SHM_OK);
	/* Past it: EBAD, though an empty slot (or the key) comes later. */
	assert_int_equal(t_chain_rc(AP_SHM_MAX_PROBES, -1), AP_SHM_EBAD);
	assert_int_equal(t_chain_rc(AP_SHM_MAX_PROBES + 1000, -1), AP_SHM_EBAD);
	assert_int_equal(t_chain_rc(AP_SHM_MAX_PROBES + 1000, AP_SHM_MAX_PROBES), AP_SHM_EBAD);
	/* The whole index full: EBAD too. */
	assert_int_equal(t_chain_rc(T_CHAIN_CAP, -1), AP_SHM_EBAD);
	/* And quickly: a bounded walk is microseconds, not a hang. */
	uint8_t *seg = t_chain_seg(T_CHAIN_CAP, -1);
	uint32_t vl;
	int64_t t0 = t_now_ms();
	for (int i = 0; i < 100; i++)
		assert_int_equal(ap_shm_lookup(seg, T_CHAIN_SEG, "victim", 6, NULL, 0, &vl), AP_SHM_EBAD);
	assert_true(t_now_ms() - t0 < 5000);
	free(seg);
}

/* Random bytes over random spots of a valid segment. */
static void test_random_corruption_never_crashes(void **state)
{
	(void)state;
	t_rng rng;
	t_rng_seed(&rng, t_seed("corruption"));
	uint8_t *segs[2] = { t_small_seg(0), t_small_seg(1) };
	uint8_t *m = malloc(T_SMALL_SEG);
	assert_non_null(m);
	for (int n = 0; n < 3000; n++) {
		memcpy(m, segs[n & 1], T_SMALL_SEG);
		int k = (int)t_rand_range(&rng, 1, 8);
		for (int j = 0; j < k; j++) {
			/* Mostly where the structure is: header, half headers, index, arena starts. */
			size_t at;
			switch (t_rand32(&rng) % 4) {
			case 0: at = t_rand_range(&rng, 0, 80); break;
			case 1: at = AP_SHM_HDR_SIZE + t_rand_range(&rng, 0, 64); break;
			case 2: at = AP_SHM_HDR_SIZE + t_hdr(segs[1])->half_size + t_rand_range(&rng, 0, 64); break;
			default: at = t_rand_range(&rng, 0, T_SMALL_SEG - 1);
			}
			size_t l = t_rand_range(&rng, 1, 8);
			for (size_t b = 0; b < l && at + b < T_SMALL_SEG; b++)
				m[at + b] = (uint8_t)t_rand32(&rng);
		}
		size_t len = t_rand32(&rng) % 8 ? T_SMALL_SEG : t_rand_range(&rng, 0, T_SMALL_SEG);
		t_read_all(m, len);
	}
	free(m);
	free(segs[0]);
	free(segs[1]);
}

/* Every truncation: as a short mapping (seg_size > len: EBAD), and as a
 * header that claims the short length (whatever the result, no read past it). */
static void test_truncations_never_read_past_len(void **state)
{
	(void)state;
	uint8_t *seg = t_small_seg(1);
	uint8_t *liar = malloc(T_SMALL_SEG);
	assert_non_null(liar);
	for (size_t len = 0; len < T_SMALL_SEG; len++) {
		uint8_t *d = t_dup(seg, len);
		uint8_t out[64];
		uint32_t vl;
		assert_int_equal(ap_shm_check(d, len), AP_SHM_EBAD);
		assert_int_equal(ap_shm_lookup(d, len, "alpha", 5, out, sizeof out, &vl), AP_SHM_EBAD);
		free(d);
		if (len % 8 == 0 || len < 4200 || len > T_SMALL_SEG - 200) {
			memcpy(liar, seg, T_SMALL_SEG);
			if (len >= AP_SHM_HDR_SIZE) {
				t_hdr(liar)->seg_size = len;
				t_hdr(liar)->half_size = ((len - AP_SHM_HDR_SIZE) / 2) & ~7ull;
			}
			t_read_all(liar, len);
		}
	}
	free(liar);
	free(seg);
}

/* ---- a tmpfs smaller than the segment ----------------------------------- */

/* A forked child mounts a 4 MiB tmpfs on /dev/shm in a private mount
 * namespace (root only: otherwise the tests skip) and runs a writer there
 * whose segment is larger than the filesystem. Before the writer reserved
 * its pages, the first store past the filesystem's end was SIGBUS. The
 * child cannot use cmocka (a failed assert would longjmp into the child's
 * copy of the runner): it checks with T_CK and exits 1; the parent checks
 * that it exited 0 and was not killed by a signal. */
#define T_FS_SIZE "size=4m"


static const void *t_child_map_ro(const char *name, size_t *len)
{
	struct stat st;
	int fd = shm_open(name, O_RDONLY, 0);
	T_CK(fd >= 0);
	T_CK(fstat(fd, &st) == 0);
	void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
	T_CK(p != MAP_FAILED);
	close(fd);
	*len = (size_t)st.st_size;
	return p;
}

/* A shm object of `bytes` backed bytes; bytes 0: as many as still fit
 * (the filesystem is then full to the last page). */
static void t_filler(const char *name, size_t bytes)
{
	int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
	T_CK(fd >= 0);
	if (bytes) {
		T_CK(posix_fallocate(fd, 0, (off_t)bytes) == 0);
	} else {
		int e = 0;
		for (off_t off = 0; !e; off += 4096)
			e = posix_fallocate(fd, off, 4096);
		T_CK(e == ENOSPC);
	}
	close(fd);
}

static int t_shm_exists(const char *name)
{
	int fd = shm_open(name, O_RDONLY, 0);
	if (fd >= 0)
		close(fd);
	return fd >= 0;
}

/* Distinct keys until the filesystem is full: arena appends. Then a
 * rebuild that cannot be backed, a create that cannot, and a rebuild once
 * there is room again. */
static void t_child_appends(void)
{
	char name[64], filler[64], top[64], other[64], k[32];
	static uint8_t big[64 << 10];
	size_t len;
	ap_shm_writer *w, *w2 = NULL;
	int r = 0, n;

	t_name(name, sizeof name, "smallfs");
	t_name(filler, sizeof filler, "filler");
	t_name(top, sizeof top, "top");
	t_name(other, sizeof other, "other");
	memset(big, 0xab, sizeof big);
	t_filler(filler, 1u << 20);
	T_CK(ap_shm_writer_create(&w, name, 64u << 20, "rcpt@test", 7) == 0);
	const void *ro = t_child_map_ro(name, &len);
	T_CK(t_put_str(w, "small", "s") == 0);
	uint64_t gen = t_gen(ro), c = 0;
	for (n = 0; n < 1000 && r == 0; n++) {
		sprintf(k, "big-%d", n);
		c = t_changes(ro);
		r = ap_shm_put(w, k, strlen(k), big, sizeof big);
	}
	T_CK(r == -ENOSPC);
	T_CK(n > 4 && n < 1000);
	T_CK(t_gen(ro) == gen);         /* nothing published */
	T_CK(t_changes(ro) == c + 1);   /* the STALE store, counted */
	T_CK(ap_shm_state(w) == AP_SHM_STATE_STALE);
	T_CK(t_state(ro) == AP_SHM_STATE_STALE);
	T_CK(ap_shm_check(ro, len) == AP_SHM_ESTALE);
	T_CK(t_lookup_rc(ro, len, "small") == AP_SHM_ESTALE);
	T_CK(t_lookup_rc(ro, len, "big-0") == AP_SHM_ESTALE);
	T_CK(ap_shm_changes(ro, len) == AP_SHM_NO_CHANGES);
	T_CK(t_put_str(w, "tiny", "t") == -ENOSPC);
	T_CK(t_changes(ro) == c + 1);

	/* Full to the last page: a rebuild fails (still STALE, gen kept),
	 * and so does a create, leaving nothing behind. */
	t_filler(top, 0);
	const char *ks[] = { "a", "b", "c" }, *vs[] = { "1", "2", "3" };
	struct t_iter it = { .k = ks, .v = vs, .n = 3 };
	T_CK(ap_shm_rebuild(w, t_iter_next, &it) == -ENOSPC);
	T_CK(ap_shm_state(w) == AP_SHM_STATE_STALE);
	T_CK(t_gen(ro) == gen);
	T_CK(ap_shm_check(ro, len) == AP_SHM_ESTALE);
	T_CK(ap_shm_writer_create(&w2, other, 1u << 20, "rcpt@test", 8) == -ENOSPC);
	T_CK(w2 == NULL);
	T_CK(!t_shm_exists(other));

	/* Room again: the next rebuild fits. */
	T_CK(shm_unlink(top) == 0);
	T_CK(shm_unlink(filler) == 0);
	it.at = 0;
	T_CK(ap_shm_rebuild(w, t_iter_next, &it) == 0);
	T_CK(ap_shm_state(w) == AP_SHM_STATE_LIVE);
	T_CK(t_gen(ro) == gen + 1);
	T_CK(ap_shm_check(ro, len) == AP_SHM_OK);
	uint8_t out[8];
	uint32_t vl = 0;
	T_CK(ap_shm_lookup(ro, len, "b", 1, out, sizeof out, &vl) == AP_SHM_OK && vl == 1 && out[0] == '2');
	T_CK(t_lookup_rc(ro, len, "big-0") == AP_SHM_ENOTFOUND);
	T_CK(t_put_str(w, "d", "4") == 0);
	T_CK(ap_shm_lookup(ro, len, "d", 1, out, sizeof out, &vl) == AP_SHM_OK && vl == 1 && out[0] == '4');
	ap_shm_writer_close(w, 1);
	munmap((void *)ro, len);
	T_CK(!t_shm_exists(name));
}

/* Updates of a few keys until the active half is full: the compaction
 * into the other half cannot be backed. A rebuild once there is room, and
 * compactions afterwards (both halves backed by then). */
static void t_child_compaction(void)
{
	char name[64], filler[64], k[32];
	static uint8_t big[60 << 10];
	size_t len;
	ap_shm_writer *w;
	int r = 0, n;

	t_name(name, sizeof name, "smallfs_c");
	t_name(filler, sizeof filler, "filler_c");
	memset(big, 0xcd, sizeof big);
	/* 4 MiB: the 4 MiB segment's half 0 fits, the second half does not. */
	t_filler(filler, 3u << 19);
	T_CK(ap_shm_writer_create(&w, name, 4u << 20, "rcpt@test", 7) == 0);
	const void *ro = t_child_map_ro(name, &len);
	uint64_t gen = t_gen(ro), c = 0;
	for (n = 0; n < 1000 && r == 0; n++) {
		sprintf(k, "k-%d", n % 4);
		c = t_changes(ro);
		r = ap_shm_put(w, k, strlen(k), big, sizeof big - (size_t)n);
	}
	T_CK(r == -ENOSPC);
	T_CK(n > 20); /* the half filled up: it was a compaction that failed */
	T_CK(t_compactions(w) == 0);
	T_CK(t_gen(ro) == gen);
	T_CK(t_changes(ro) == c + 1);
	T_CK(ap_shm_state(w) == AP_SHM_STATE_STALE);
	T_CK(ap_shm_check(ro, len) == AP_SHM_ESTALE);
	T_CK(t_lookup_rc(ro, len, "k-0") == AP_SHM_ESTALE);

	T_CK(shm_unlink(filler) == 0);
	const char *ks[] = { "k-0", "k-1", "k-2", "k-3" };
	struct t_iter it = { .k = ks, .n = 4, .big = big, .big_len = sizeof big };
	T_CK(ap_shm_rebuild(w, t_iter_next, &it) == 0);
	T_CK(ap_shm_state(w) == AP_SHM_STATE_LIVE);
	T_CK(t_gen(ro) == gen + 1);
	uint64_t c0 = t_compactions(w);
	for (n = 0; n < 1000 && t_compactions(w) < c0 + 3; n++) {
		sprintf(k, "k-%d", n % 4);
		T_CK(ap_shm_put(w, k, strlen(k), big, sizeof big - (size_t)n) == 0);
	}
	T_CK(t_compactions(w) >= c0 + 3);
	static uint8_t out[sizeof big];
	uint32_t vl = 0;
	sprintf(k, "k-%d", (n - 1) % 4);
	T_CK(ap_shm_lookup(ro, len, k, strlen(k), out, sizeof out, &vl) == AP_SHM_OK);
	T_CK(vl == sizeof big - (size_t)(n - 1) && !memcmp(out, big, vl));
	ap_shm_writer_close(w, 1);
	munmap((void *)ro, len);
	T_CK(!t_shm_exists(name));
}

static void test_full_tmpfs_is_enospc_not_sigbus(void **state)
{
	(void)state;
	t_in_small_tmpfs(T_FS_SIZE, t_child_appends);
}

static void test_full_tmpfs_compaction_is_enospc_not_sigbus(void **state)
{
	(void)state;
	t_in_small_tmpfs(T_FS_SIZE, t_child_compaction);
}

/* ---- writers that are gone: the stamp, the verdict, the sweep ----------- */

/* A child that exited and was reaped: its pid names no process (until the
 * kernel hands it out again, which takes a full turn of pid_max). */
static pid_t t_dead_pid(void)
{
	int st;
	pid_t pid = fork();
	assert_true(pid >= 0);
	if (pid == 0)
		_exit(0);
	assert_int_equal(waitpid(pid, &st, 0), pid);
	return pid;
}

static uint64_t t_own_start(void)
{
	uint64_t start = 0;
	assert_int_equal(ap_proc_stat((long)getpid(), &start, NULL), 0);
	assert_true(start > 0);
	return start;
}

/* A header as a writer with this stamp would leave it. */
static struct ap_shm_hdr t_stamp(uint64_t pid, uint64_t start, uint64_t pidns)
{
	struct ap_shm_hdr h;
	memset(&h, 0, sizeof h);
	h.magic = AP_SHM_MAGIC;
	h.version = AP_SHM_VERSION;
	h.hdr_size = AP_SHM_HDR_SIZE;
	h.writer_pid = pid;
	h.writer_start = start;
	h.writer_pidns = pidns;
	return h;
}

static enum ap_shm_fate t_judge(const struct ap_shm_hdr *h, size_t len, int held)
{
	struct ap_shm_verdict v;
	enum ap_shm_fate f = ap_shm_judge(h, len, held, &v);
	assert_int_equal(f, v.fate);
	return f;
}

static void test_header_stamps_the_writers_pid_start_time_and_pid_namespace(void **state)
{
	(void)state;
	struct t_seg s;
	struct stat ns;
	t_seg_open(&s, "stamp", 1u << 20);
	const struct ap_shm_hdr *h = s.ro;
	assert_int_equal(stat("/proc/self/ns/pid", &ns), 0);
	assert_int_equal(h->magic, AP_SHM_MAGIC);
	assert_int_equal(h->writer_pid, (uint64_t)getpid());
	assert_int_equal(h->writer_start, t_own_start());
	assert_int_equal(h->writer_pidns, (uint64_t)ns.st_ino);
	assert_int_equal(ap_proc_pidns(), (uint64_t)ns.st_ino);
	struct ap_shm_verdict v;
	assert_int_equal(ap_shm_judge(h, s.len, 1, &v), AP_SHM_FATE_LIVE);
	assert_int_equal(v.pid, (uint64_t)getpid());
	assert_int_equal(v.start, h->writer_start);
	t_seg_close(&s);
}

/* The start time is field 22 counted after the last ')': a name holding
 * spaces and parentheses must not shift it. */
static void test_proc_stat_survives_a_name_with_spaces_and_parens(void **state)
{
	(void)state;
	int up[2], down[2];
	uint64_t before = 0, after = 0;
	char st = 0, c = 0;
	assert_int_equal(pipe(up), 0);
	assert_int_equal(pipe(down), 0);
	pid_t pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		uint64_t mine = 0;
		if (ap_proc_stat((long)getpid(), &mine, NULL) < 0)
			_exit(1);
		prctl(PR_SET_NAME, ") 1 2 (3) 4", 0, 0, 0);
		if (write(up[1], &mine, sizeof mine) != (ssize_t)sizeof mine)
			_exit(1);
		(void)!read(down[0], &c, 1); /* until the parent has looked */
		_exit(0);
	}
	assert_int_equal(read(up[0], &before, sizeof before), (ssize_t)sizeof before);
	assert_int_equal(ap_proc_stat((long)pid, &after, &st), 0);
	assert_true(before > 0);
	assert_int_equal(after, before);
	assert_true(st == 'S' || st == 'R');
	assert_int_equal(write(down[1], "x", 1), 1);
	int ws;
	assert_int_equal(waitpid(pid, &ws, 0), pid);
	assert_true(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
	assert_int_equal(ap_proc_stat((long)pid, &after, NULL), -ENOENT);
	assert_int_equal(ap_proc_stat(0, &after, NULL), -EINVAL);
	assert_int_equal(ap_proc_stat(-1, &after, NULL), -EINVAL);
	for (int k = 0; k < 4; k++)
		close(k < 2 ? up[k] : down[k - 2]);
}

/* The lock decides, the stamps never do: a held lock is LIVE whatever the
 * header names (a dead pid, another namespace, garbage), and a free one is
 * GONE even when the stamp names a running process with its very start
 * time (what a foreign /proc or a time namespace would show). */
static void test_judge_trusts_the_lock_not_the_stamps(void **state)
{
	(void)state;
	uint64_t me = (uint64_t)getpid(), start = t_own_start(), ns = ap_proc_pidns();
	uint64_t dead = (uint64_t)t_dead_pid();
	struct ap_shm_hdr h;

	h = t_stamp(me, start, ns);
	assert_int_equal(t_judge(&h, sizeof h, 1), AP_SHM_FATE_LIVE);
	assert_int_equal(t_judge(&h, sizeof h, 0), AP_SHM_FATE_GONE);
	h = t_stamp(dead, start, ns + 1);
	assert_int_equal(t_judge(&h, sizeof h, 1), AP_SHM_FATE_LIVE);
	assert_int_equal(t_judge(&h, sizeof h, 0), AP_SHM_FATE_GONE);
	h = t_stamp(0, 0, 0);
	assert_int_equal(t_judge(&h, sizeof h, 0), AP_SHM_FATE_GONE);
	h.magic ^= 1;
	assert_int_equal(t_judge(&h, sizeof h, 1), AP_SHM_FATE_LIVE);
	assert_int_equal(t_judge(&h, sizeof h, 0), AP_SHM_FATE_UNREADABLE);

	/* A writer killed while creating: empty, no magic yet, or the
	 * creating magic. */
	assert_int_equal(t_judge(&h, 0, 0), AP_SHM_FATE_GONE);
	h = t_stamp(me, start, ns);
	h.magic = 0;
	assert_int_equal(t_judge(&h, sizeof h, 0), AP_SHM_FATE_GONE);
	h.magic = AP_SHM_MAGIC_CREATING;
	assert_int_equal(t_judge(&h, sizeof h, 0), AP_SHM_FATE_GONE);
	assert_int_equal(t_judge(&h, sizeof h, 1), AP_SHM_FATE_LIVE);

	/* Layouts 3 and 4 predate the lock: gone only if nobody here has
	 * the pid. */
	for (uint32_t old = 3; old <= 4; old++) {
		h = t_stamp(dead, 0, 0);
		h.version = old;
		assert_int_equal(t_judge(&h, sizeof h, 0), AP_SHM_FATE_GONE);
		h.writer_pid = me;
		assert_int_equal(t_judge(&h, sizeof h, 0), AP_SHM_FATE_UNKNOWN);
		assert_int_equal(t_judge(&h, sizeof h, 1), AP_SHM_FATE_LIVE);
		h.writer_pid = 0;
		assert_int_equal(t_judge(&h, sizeof h, 0), AP_SHM_FATE_UNKNOWN);
		h.writer_pid = 1ull << 40;
		assert_int_equal(t_judge(&h, sizeof h, 0), AP_SHM_FATE_UNKNOWN);
	}

	/* Not a header we know: too short for a magic, a short header,
	 * another layout. */
	h = t_stamp(dead, start, ns);
	assert_int_equal(t_judge(&h, 7, 0), AP_SHM_FATE_UNREADABLE);
	assert_int_equal(t_judge(&h, offsetof(struct ap_shm_hdr, incarnation) - 1, 0), AP_SHM_FATE_UNREADABLE);
	h.version = AP_SHM_VERSION + 1;
	assert_int_equal(t_judge(&h, sizeof h, 0), AP_SHM_FATE_UNREADABLE);
}

/* Random bytes and every truncation of a valid header: a verdict, never a
 * read past len (ASan would say). */
static void test_judge_of_hostile_bytes_is_never_gone_without_our_magic(void **state)
{
	(void)state;
	t_rng r;
	t_rng_seed(&r, t_seed("judge"));
	struct ap_shm_hdr h = t_stamp((uint64_t)t_dead_pid(), t_own_start(), ap_proc_pidns());
	for (size_t len = 0; len <= sizeof h; len++) {
		uint8_t *copy = t_dup(&h, len);
		enum ap_shm_fate f = t_judge((const struct ap_shm_hdr *)copy, len, 0);
		assert_true(f == (len == 0 || len >= offsetof(struct ap_shm_hdr, incarnation) ? AP_SHM_FATE_GONE
											  : AP_SHM_FATE_UNREADABLE));
		assert_int_equal(t_judge((const struct ap_shm_hdr *)copy, len, 1), AP_SHM_FATE_LIVE);
		free(copy);
	}
	for (int k = 0; k < 2000; k++) {
		uint8_t buf[sizeof h];
		for (size_t i = 0; i < sizeof buf; i++)
			buf[i] = (uint8_t)t_rand32(&r);
		buf[0] |= 1; /* never a zero magic */
		/* Random bytes are never our magic: unreadable. */
		assert_int_equal(t_judge((const struct ap_shm_hdr *)buf, sizeof buf, 0), AP_SHM_FATE_UNREADABLE);
	}
}

struct t_swept {
	char name[16][64];
	enum ap_shm_fate fate[16];
	int removed[16];
	int n;
};

static void t_on_swept(void *arg, const struct ap_shm_swept *s)
{
	struct t_swept *t = arg;
	assert_true(t->n < 16);
	snprintf(t->name[t->n], sizeof t->name[0], "%s", s->name);
	t->fate[t->n] = s->v.fate;
	t->removed[t->n] = s->removed;
	t->n++;
}

/* name's fate as the sweep reported it, or -1 if it was not reported. */
static int t_fate_of(const struct t_swept *t, const char *name, int *removed)
{
	for (int i = 0; i < t->n; i++)
		if (!strcmp(t->name[i], name)) {
			*removed = t->removed[i];
			return (int)t->fate[i];
		}
	return -1;
}

static void t_write_file(int dfd, const char *name, const void *p, size_t n, mode_t mode)
{
	int fd = openat(dfd, name, O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, mode);
	assert_true(fd >= 0);
	assert_int_equal(write(fd, p, n), (ssize_t)n);
	close(fd);
}

static int t_exists_at(int dfd, const char *name)
{
	struct stat st;
	return fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) == 0;
}

static void test_sweep_removes_proven_orphans_and_nothing_else(void **state)
{
	(void)state;
	char dir[] = "/tmp/ap_sweep_XXXXXX";
	assert_non_null(mkdtemp(dir));
	int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	assert_true(dfd >= 0);
	uint64_t start = t_own_start(), ns = ap_proc_pidns();
	struct ap_shm_hdr dead = t_stamp((uint64_t)t_dead_pid(), start, ns);
	struct ap_shm_hdr stamped = t_stamp((uint64_t)getpid(), start, ns);
	struct ap_shm_hdr v3dead = dead, v3live = stamped, v4live = stamped, creating = stamped;
	v3dead.version = v3live.version = 3;
	v4live.version = 4;
	creating.magic = AP_SHM_MAGIC_CREATING;

	t_write_file(dfd, "ap.dead", &dead, sizeof dead, 0600);
	t_write_file(dfd, "ap.stamped", &stamped, sizeof stamped, 0600); /* names us, but no lock */
	t_write_file(dfd, "ap.locked", &dead, sizeof dead, 0600);        /* names nobody, but locked */
	t_write_file(dfd, "ap.v3dead", &v3dead, sizeof v3dead, 0600);
	t_write_file(dfd, "ap.v3live", &v3live, sizeof v3live, 0600);
	t_write_file(dfd, "ap.v4live", &v4live, sizeof v4live, 0600);
	t_write_file(dfd, "ap.creating", &creating, sizeof creating, 0600);
	t_write_file(dfd, "ap.empty", "", 0, 0600);
	t_write_file(dfd, "ap.short", "ARCPTS1", 7, 0600);
	t_write_file(dfd, "ap.skipme", &dead, sizeof dead, 0600);
	t_write_file(dfd, "other.dead", &dead, sizeof dead, 0600);
	assert_int_equal(symlinkat("ap.dead", dfd, "ap.link"), 0);
	assert_int_equal(mkfifoat(dfd, "ap.fifo", 0600), 0);
	assert_int_equal(mkdirat(dfd, "ap.dir", 0700), 0);
	int root = geteuid() == 0;
	if (root) {
		t_write_file(dfd, "ap.theirs", &dead, sizeof dead, 0600);
		assert_int_equal(fchownat(dfd, "ap.theirs", 65534, 65534, AT_SYMLINK_NOFOLLOW), 0);
	}
	int lfd = openat(dfd, "ap.locked", O_RDONLY | O_CLOEXEC);
	assert_true(lfd >= 0);
	assert_int_equal(flock(lfd, LOCK_SH), 0);

	struct t_swept t = { 0 };
	struct ap_shm_sweep_sum sum;
	assert_int_equal(ap_shm_sweep(dir, "ap.", "ap.skipme", t_on_swept, &t, &sum), 5);
	int removed = -1;
	const char *gone[] = { "ap.dead", "ap.stamped", "ap.v3dead", "ap.creating", "ap.empty" };
	for (size_t i = 0; i < sizeof gone / sizeof *gone; i++) {
		assert_int_equal(t_fate_of(&t, gone[i], &removed), AP_SHM_FATE_GONE);
		assert_int_equal(removed, 1);
		assert_false(t_exists_at(dfd, gone[i]));
	}
	assert_int_equal(t_fate_of(&t, "ap.locked", &removed), AP_SHM_FATE_LIVE);
	assert_int_equal(removed, 0);
	assert_int_equal(t_fate_of(&t, "ap.v3live", &removed), AP_SHM_FATE_UNKNOWN);
	assert_int_equal(removed, 0);
	assert_int_equal(t_fate_of(&t, "ap.v4live", &removed), AP_SHM_FATE_UNKNOWN);
	assert_int_equal(removed, 0);
	assert_int_equal(t_fate_of(&t, "ap.short", &removed), AP_SHM_FATE_UNREADABLE);
	/* Symlinks, FIFOs, directories and another user's files are passed
	 * over without a word: not opened, not reported, only counted. */
	const char *unheard[] = { "ap.link", "ap.fifo", "ap.dir", "ap.theirs", "ap.skipme", "other.dead" };
	for (size_t i = 0; i < sizeof unheard / sizeof *unheard; i++)
		assert_int_equal(t_fate_of(&t, unheard[i], &removed), -1);
	assert_int_equal(t.n, 9);
	assert_int_equal(sum.judged, 9);
	assert_int_equal(sum.removed, 5);
	assert_int_equal(sum.live, 1);
	assert_int_equal(sum.v3_kept, 2);
	assert_int_equal(sum.foreign, root ? 4 : 3);
	assert_int_equal(sum.capped, 0);

	const char *kept[] = { "ap.locked", "ap.v3live", "ap.v4live", "ap.short", "ap.skipme",
			       "other.dead", "ap.link", "ap.fifo", "ap.dir" };
	for (size_t i = 0; i < sizeof kept / sizeof *kept; i++)
		assert_true(t_exists_at(dfd, kept[i]));
	if (root)
		assert_true(t_exists_at(dfd, "ap.theirs"));

	/* Nothing is left to prove: a second sweep removes nothing. Once the
	 * lock is dropped, the locked one goes. */
	struct t_swept t2 = { 0 };
	assert_int_equal(ap_shm_sweep(dir, "ap.", "ap.skipme", t_on_swept, &t2, NULL), 0);
	close(lfd);
	struct t_swept t3 = { 0 };
	assert_int_equal(ap_shm_sweep(dir, "ap.", "ap.skipme", t_on_swept, &t3, NULL), 1);
	assert_false(t_exists_at(dfd, "ap.locked"));
	assert_int_equal(ap_shm_sweep("/nonexistent-ap-dir", "ap.", NULL, NULL, NULL, NULL), -ENOENT);

	const char *all[] = { "ap.v3live", "ap.v4live", "ap.short", "ap.skipme",
			      "other.dead", "ap.link", "ap.fifo", "ap.theirs" };
	for (size_t i = 0; i < sizeof all / sizeof *all; i++)
		unlinkat(dfd, all[i], 0);
	assert_int_equal(unlinkat(dfd, "ap.dir", AT_REMOVEDIR), 0);
	close(dfd);
	assert_int_equal(rmdir(dir), 0);
}

/* Anybody can fill the directory with FIFOs, symlinks and (root here)
 * files of another user under our prefix: none of them takes a place
 * under the cap, so an orphan of ours is still found, and none is heard
 * of one by one. */
static void test_sweep_cap_counts_our_own_files_only(void **state)
{
	(void)state;
	char dir[] = "/tmp/ap_sweepcap_XXXXXX", name[32];
	assert_non_null(mkdtemp(dir));
	int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	assert_true(dfd >= 0);
	int root = geteuid() == 0, n = AP_SHM_SWEEP_MAX + 64;
	struct ap_shm_hdr dead = t_stamp((uint64_t)t_dead_pid(), 0, 0);
	for (int i = 0; i < n; i++) {
		snprintf(name, sizeof name, "ap.x%05d", i);
		if (i % 3 == 0)
			assert_int_equal(mkfifoat(dfd, name, 0600), 0);
		else if (i % 3 == 1 || !root)
			assert_int_equal(symlinkat("ap.orphan", dfd, name), 0);
		else {
			t_write_file(dfd, name, &dead, sizeof dead, 0600);
			assert_int_equal(fchownat(dfd, name, 65534, 65534, AT_SYMLINK_NOFOLLOW), 0);
		}
	}
	t_write_file(dfd, "ap.orphan", &dead, sizeof dead, 0600);
	struct t_swept t = { 0 };
	struct ap_shm_sweep_sum sum;
	assert_int_equal(ap_shm_sweep(dir, "ap.", NULL, t_on_swept, &t, &sum), 1);
	assert_int_equal(t.n, 1);
	assert_string_equal(t.name[0], "ap.orphan");
	assert_int_equal(sum.judged, 1);
	assert_int_equal(sum.foreign, (unsigned)n);
	assert_int_equal(sum.capped, 0);
	assert_false(t_exists_at(dfd, "ap.orphan"));
	for (int i = 0; i < n; i++) {
		snprintf(name, sizeof name, "ap.x%05d", i);
		assert_int_equal(unlinkat(dfd, name, 0), 0);
	}
	close(dfd);
	assert_int_equal(rmdir(dir), 0);
}

/* A child that creates name and waits (pipe p: "r" once created); kill it
 * to leave the segment of a writer killed. */
static pid_t t_writer_child(const char *name, int p[2])
{
	char c = 0;
	assert_int_equal(pipe(p), 0);
	pid_t pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		ap_shm_writer *cw;
		if (ap_shm_writer_create(&cw, name, 1u << 20, "child@test", 1) < 0 || write(p[1], "r", 1) != 1)
			_exit(1);
		pause();
		_exit(0);
	}
	assert_int_equal(read(p[0], &c, 1), 1);
	return pid;
}

static void t_kill_child(pid_t pid, int p[2])
{
	int ws;
	assert_int_equal(kill(pid, SIGKILL), 0);
	assert_int_equal(waitpid(pid, &ws, 0), pid);
	assert_true(WIFSIGNALED(ws));
	close(p[0]);
	close(p[1]);
}

/* The real thing in /dev/shm: a writer killed with SIGKILL leaves its
 * segment; the sweep removes it and keeps a live writer's. */
static void test_sweep_removes_a_killed_writers_segment_and_keeps_a_live_one(void **state)
{
	(void)state;
	char prefix[64], dead[80], alive[80];
	int p[2];
	snprintf(prefix, sizeof prefix, "ap_shm_test_%d_sweep_", (int)getpid());
	snprintf(dead, sizeof dead, "/%sdead", prefix);
	snprintf(alive, sizeof alive, "/%salive", prefix);
	t_kill_child(t_writer_child(dead, p), p);
	assert_true(t_shm_exists(dead));

	ap_shm_writer *w;
	assert_int_equal(ap_shm_writer_create(&w, alive, 1u << 20, "alive@test", 2), 0);
	struct t_swept t = { 0 };
	assert_int_equal(ap_shm_sweep(AP_SHM_DIR, prefix, NULL, t_on_swept, &t, NULL), 1);
	int removed = -1;
	assert_int_equal(t_fate_of(&t, dead + 1, &removed), AP_SHM_FATE_GONE);
	assert_int_equal(removed, 1);
	assert_int_equal(t_fate_of(&t, alive + 1, &removed), AP_SHM_FATE_LIVE);
	assert_int_equal(t.n, 2);
	assert_false(t_shm_exists(dead));
	assert_true(t_shm_exists(alive));
	ap_shm_writer_close(w, 1);
	assert_false(t_shm_exists(alive));
}

/* A live writer's segment whose stamps lie (a dead pid, another start
 * time: what a foreign /proc mount or a time namespace shows a sweeper)
 * is kept: its writer holds the lock. */
static void test_sweep_keeps_a_locked_segment_whatever_its_stamps_say(void **state)
{
	(void)state;
	char prefix[64], name[80];
	snprintf(prefix, sizeof prefix, "ap_shm_test_%d_lie_", (int)getpid());
	snprintf(name, sizeof name, "/%sw", prefix);
	ap_shm_writer *w;
	assert_int_equal(ap_shm_writer_create(&w, name, 1u << 20, "liar@test", 2), 0);
	int fd = shm_open(name, O_RDWR, 0);
	assert_true(fd >= 0);
	struct ap_shm_hdr *h = mmap(NULL, AP_SHM_HDR_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	assert_true(h != MAP_FAILED);
	close(fd);
	h->writer_pid = (uint64_t)t_dead_pid();
	h->writer_start = 1;
	h->writer_pidns = 1;
	struct t_swept t = { 0 };
	assert_int_equal(ap_shm_sweep(AP_SHM_DIR, prefix, NULL, t_on_swept, &t, NULL), 0);
	int removed = -1;
	assert_int_equal(t_fate_of(&t, name + 1, &removed), AP_SHM_FATE_LIVE);
	assert_true(t_shm_exists(name));
	assert_int_equal(ap_shm_remove(AP_SHM_DIR, name + 1, NULL), -EBUSY);
	assert_true(t_shm_exists(name));
	munmap(h, AP_SHM_HDR_SIZE);
	ap_shm_writer_close(w, 1);
	assert_false(t_shm_exists(name));
}

/* A second writer under a name in use gets -EEXIST and changes nothing,
 * whatever the stamps say; a writer that closed it, or died, gives the
 * name up, and a retry then takes it. */
static void test_create_never_takes_a_live_writers_name(void **state)
{
	(void)state;
	struct t_seg s;
	ap_shm_writer *w2;
	int p[2];
	t_seg_open(&s, "held", 1u << 20);
	assert_int_equal(t_put_str(s.w, "a", "b"), 0);
	assert_int_equal(ap_shm_writer_create(&w2, s.name, 1u << 20, "second@test", 9), -EEXIST);
	assert_null(w2);
	size_t len;
	const void *now = t_map_ro(s.name, &len);
	assert_int_equal(((const struct ap_shm_hdr *)now)->incarnation, 7); /* still the first */
	assert_int_equal(t_lookup_rc(now, len, "a"), AP_SHM_OK);
	munmap((void *)now, len);
	assert_int_equal(t_put_str(s.w, "c", "d"), 0);
	assert_int_equal(t_lookup_rc(s.ro, s.len, "c"), AP_SHM_OK);
	t_seg_close(&s);

	/* A live writer in another process, then killed with SIGKILL: its
	 * name is taken over by the next try. */
	char name[64];
	t_name(name, sizeof name, "held_dead");
	pid_t pid = t_writer_child(name, p);
	assert_int_equal(ap_shm_writer_create(&w2, name, 1u << 20, "next@test", 2), -EEXIST);
	t_kill_child(pid, p);
	assert_int_equal(ap_shm_writer_create(&w2, name, 1u << 20, "next@test", 2), 0);
	ap_shm_writer_close(w2, 1);
	assert_false(t_shm_exists(name));

	/* Another user's object, a FIFO or a symlink under the name: never
	 * replaced, never blocked on. */
	t_name(name, sizeof name, "held_fifo");
	char path[128];
	snprintf(path, sizeof path, AP_SHM_DIR "%s", name);
	assert_int_equal(mkfifo(path, 0600), 0);
	assert_int_equal(ap_shm_writer_create(&w2, name, 1u << 20, "next@test", 2), -EPERM);
	assert_int_equal(unlink(path), 0);
	assert_int_equal(symlink("/dev/null", path), 0);
	assert_int_equal(ap_shm_writer_create(&w2, name, 1u << 20, "next@test", 2), -EPERM);
	assert_int_equal(unlink(path), 0);
}

/* Close unlinks only its own object: a name replaced behind the writer's
 * back (rm, then another object) stays; then it marks CLOSED. */
static void test_close_unlinks_only_its_own_object(void **state)
{
	(void)state;
	struct t_seg s;
	char path[128];
	t_seg_open(&s, "replaced", 1u << 20);
	snprintf(path, sizeof path, AP_SHM_DIR "%s", s.name);
	assert_int_equal(unlink(path), 0);
	int fd = open(path, O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0600);
	assert_true(fd >= 0);
	close(fd);
	assert_int_equal(ap_shm_writer_unlink(s.w), -ESTALE);
	t_seg_close(&s); /* close(w, 1) */
	assert_true(t_shm_exists(s.name));
	assert_int_equal(unlink(path), 0);

	/* Our own: unlinked once, and a second unlink says so. */
	t_seg_open(&s, "own", 1u << 20);
	assert_int_equal(ap_shm_writer_unlink(s.w), 0);
	assert_false(t_shm_exists(s.name));
	assert_int_equal(ap_shm_writer_unlink(s.w), -ENOENT);
	assert_int_equal(t_state(s.ro), AP_SHM_STATE_LIVE);
	t_seg_close(&s);
}

/* The owner's way to remove a dead node's segment: only an object of ours
 * that no writer holds; a FIFO, a symlink or another user's file under
 * the name is refused at once, never waited on nor followed. */
static void test_remove_takes_only_a_dead_writers_object(void **state)
{
	(void)state;
	char name[64], path[128], target[160];
	int p[2];
	t_name(name, sizeof name, "remove");
	snprintf(path, sizeof path, AP_SHM_DIR "%s", name);
	assert_int_equal(ap_shm_remove(AP_SHM_DIR, name + 1, NULL), -ENOENT);
	assert_int_equal(ap_shm_remove(AP_SHM_DIR, "a/b", NULL), -EINVAL);

	pid_t pid = t_writer_child(name, p);
	struct ap_shm_verdict v;
	assert_int_equal(ap_shm_remove(AP_SHM_DIR, name + 1, &v), -EBUSY);
	assert_int_equal(v.pid, (uint64_t)pid);
	assert_true(t_shm_exists(name));
	t_kill_child(pid, p);
	assert_int_equal(ap_shm_remove(AP_SHM_DIR, name + 1, &v), 0);
	assert_int_equal(v.fate, AP_SHM_FATE_GONE);
	assert_int_equal(v.pid, (uint64_t)pid);
	assert_false(t_shm_exists(name));

	assert_int_equal(mkfifo(path, 0600), 0);
	assert_int_equal(ap_shm_remove(AP_SHM_DIR, name + 1, NULL), -EPERM);
	assert_int_equal(unlink(path), 0);

	snprintf(target, sizeof target, "%s.target", path);
	struct ap_shm_hdr dead = t_stamp((uint64_t)t_dead_pid(), 0, 0);
	int fd = open(target, O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0600);
	assert_true(fd >= 0);
	assert_int_equal(write(fd, &dead, sizeof dead), (ssize_t)sizeof dead);
	close(fd);
	assert_int_equal(symlink(target, path), 0);
	assert_int_equal(ap_shm_remove(AP_SHM_DIR, name + 1, NULL), -EPERM);
	assert_int_equal(access(target, F_OK), 0);
	assert_int_equal(unlink(path), 0);
	if (geteuid() == 0) {
		assert_int_equal(rename(target, path), 0);
		assert_int_equal(chown(path, 65534, 65534), 0);
		assert_int_equal(ap_shm_remove(AP_SHM_DIR, name + 1, NULL), -EPERM);
		assert_int_equal(unlink(path), 0);
	} else {
		assert_int_equal(unlink(target), 0);
	}
}

/* A writer killed while creating leaves an object the sweep can tell: the
 * creating magic and the stamps are written as soon as it is sized, and
 * an object not yet sized is empty; both go once no lock is held. */
static void test_a_writer_killed_while_creating_leaves_a_sweepable_object(void **state)
{
	(void)state;
	char prefix[64], path[160];
	snprintf(prefix, sizeof prefix, "ap_shm_test_%d_creating_", (int)getpid());
	int dfd = open(AP_SHM_DIR, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	assert_true(dfd >= 0);
	struct ap_shm_hdr h = t_stamp((uint64_t)t_dead_pid(), 0, 0);
	h.magic = AP_SHM_MAGIC_CREATING;
	snprintf(path, sizeof path, "%smid", prefix);
	t_write_file(dfd, path, &h, sizeof h, 0600);
	int fd = openat(dfd, path, O_WRONLY | O_CLOEXEC);
	assert_true(fd >= 0);
	assert_int_equal(ftruncate(fd, 1u << 20), 0);
	close(fd);
	snprintf(path, sizeof path, "%sempty", prefix);
	t_write_file(dfd, path, "", 0, 0600);
	struct t_swept t = { 0 };
	assert_int_equal(ap_shm_sweep(AP_SHM_DIR, prefix, NULL, t_on_swept, &t, NULL), 2);
	assert_int_equal(t.n, 2);
	close(dfd);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_hash_known_vectors),
		cmocka_unit_test(test_each_segment_has_its_own_seed),
		cmocka_unit_test(test_create_sets_mode_0600_and_a_live_header),
		cmocka_unit_test(test_create_and_init_reject_bad_arguments),
		cmocka_unit_test(test_put_update_remove_round_trip),
		cmocka_unit_test(test_etoobig_reports_the_length),
		cmocka_unit_test(test_many_keys_are_all_found_with_their_latest_values),
		cmocka_unit_test(test_compaction_switches_gen_and_keeps_everything),
		cmocka_unit_test(test_e2big_changes_nothing),
		cmocka_unit_test(test_enospc_goes_stale_and_rebuild_brings_it_back),
		cmocka_unit_test(test_changes_counts_every_change_and_nothing_else),
		cmocka_unit_test(test_changes_on_hostile_headers_is_no_label),
		cmocka_unit_test(test_close_unlinks_and_marks_closed),
		cmocka_unit_test(test_readers_racing_the_writer_see_whole_values),
		cmocka_unit_test(test_changes_label_never_answers_an_acknowledged_put_late),
		cmocka_unit_test(test_hostile_segments_never_crash),
		cmocka_unit_test(test_overlong_probe_chain_is_ebad),
		cmocka_unit_test(test_random_corruption_never_crashes),
		cmocka_unit_test(test_truncations_never_read_past_len),
		cmocka_unit_test(test_full_tmpfs_is_enospc_not_sigbus),
		cmocka_unit_test(test_full_tmpfs_compaction_is_enospc_not_sigbus),
		cmocka_unit_test(test_header_stamps_the_writers_pid_start_time_and_pid_namespace),
		cmocka_unit_test(test_proc_stat_survives_a_name_with_spaces_and_parens),
		cmocka_unit_test(test_judge_trusts_the_lock_not_the_stamps),
		cmocka_unit_test(test_judge_of_hostile_bytes_is_never_gone_without_our_magic),
		cmocka_unit_test(test_sweep_removes_proven_orphans_and_nothing_else),
		cmocka_unit_test(test_sweep_cap_counts_our_own_files_only),
		cmocka_unit_test(test_sweep_removes_a_killed_writers_segment_and_keeps_a_live_one),
		cmocka_unit_test(test_sweep_keeps_a_locked_segment_whatever_its_stamps_say),
		cmocka_unit_test(test_create_never_takes_a_live_writers_name),
		cmocka_unit_test(test_close_unlinks_only_its_own_object),
		cmocka_unit_test(test_remove_takes_only_a_dead_writers_object),
		cmocka_unit_test(test_a_writer_killed_while_creating_leaves_a_sweepable_object),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
