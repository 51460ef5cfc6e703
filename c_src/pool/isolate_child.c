/* isolate_child: the worker process's side of its channel (isolate.h has
 * the design): main() of a child started with --isolated-worker. It maps
 * the channel it inherited on fd 3, loads the handler, and runs each
 * message the proxy hands it, writing the results back. It trusts nothing
 * but its own checks of the channel: a bad record ends the child.
 */
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <linux/membarrier.h>

#include "ap_log.h"
#include "ap_ring.h"
#include "ap_skip.h"
#include "handlers.h"
#include "isolate_int.h"
#include "pool_int.h"
#include "sandbox.h"

#define AP_STR_(x) #x
#define AP_STR(x) AP_STR_(x)

static struct iso_ctl *cc;

static void child_die(int code) { _exit(code); }

/* Without membarrier(2) registration: a full fence where the pool node's
 * barrier would have stood in for one. */
static int fence_each = 1;

/* A message up to revoke_upto, just started (running_seq stored): whether
 * it moved to another worker while we were stalled (isolate_loop.c,
 * ap_iso_revoke). Our running_seq store and this load need no fence
 * between them: the pool node runs a barrier on us (membarrier) between
 * its store of revoke_upto and its look at running_seq. */
static int revoked(uint64_t seq)
{
	if (fence_each)
		atomic_thread_fence(memory_order_seq_cst);
	else
		atomic_signal_fence(memory_order_seq_cst);
	if (seq > atomic_load_explicit(&cc->revoke_upto, memory_order_acquire))
		return 0;
	uint64_t from;
	while (!(from = atomic_load_explicit(&cc->revoke_from, memory_order_acquire)))
		sched_yield(); /* the loop's verdict comes microseconds after its barrier */
	/* Again: a loop whose barrier failed puts the bound back. */
	return seq >= from && seq <= atomic_load_explicit(&cc->revoke_upto, memory_order_acquire);
}

/* Writes one result (the reply in chunks), waiting for room. */
static void child_result(struct ap_ring *rsp, uint64_t seq, int status, const actor_pool_reply *reply, int send_reply,
			 int not_run)
{
	size_t room = ap_ring_max_payload(ISO_RSP_CAP) - sizeof(struct iso_rec);
	size_t total = send_reply ? reply->len : 0, off = 0;
	if (total > ISO_MAX_MSG)
		child_die(75);
	do {
		size_t chunk = total - off < room ? total - off : room;
		void *rec;
		while (ap_ring_reserve(rsp, sizeof(struct iso_rec) + chunk, &rec) == -EAGAIN) {
			ap_ring_publish(rsp);
			ap_iso_bell(cc, 0);
			if (ap_ring_wait_space(rsp, sizeof(struct iso_rec) + chunk, ISO_SPIN, -1) &&
			    ap_ring_has_room(rsp, sizeof(struct iso_rec) + chunk) != 1)
				child_die(72);
		}
		struct iso_rec h = { .seq = seq, .total = (uint32_t)total, .off = (uint32_t)off, .kind = REC_RESULT,
				     .a = (uint8_t)status, .b = (uint8_t)(send_reply ? reply->kind : 0),
				     .c = (uint8_t)not_run };
		memcpy(rec, &h, sizeof h);
		if (chunk)
			memcpy((uint8_t *)rec + sizeof h, reply->data + off, chunk);
		off += chunk;
	} while (off < total);
}

/* What the proxy has not heard of yet: results with a record, ok tells
 * (no record: done_seq covers them), whether an ask is among them, and
 * when the first such ask was finished (monotonic us). */
struct untold {
	unsigned results, ok_tells;
	int ask;
	int64_t ask_us;
};

/* Rings the proxy's bell (if it sleeps): it reads everything finished so
 * far, so nothing is left untold. */
static void tell_proxy(struct untold *u)
{
	*u = (struct untold){ 0 };
	/* The pool node's loop looks at our results on its own passes while
	 * it is busy (ap_iso_take_direct): no wake-up. The fence pairs with
	 * the loop's when it stops looking: it then sees what we published,
	 * or we see the flag down. */
	atomic_thread_fence(memory_order_seq_cst);
	if (atomic_load(&cc->loop_looks))
		return;
	ap_iso_bell(cc, 0);
}

/* The wait for the next ask awake (ask_wait): after an ask, its caller's
 * next ask (and the next batch of 64 callers') is a round trip away. While
 * our wake-ups are slow (ISO_WAKE_SLOW_US or more on average: on a VM a
 * wake-up is a hypervisor exit to run a halted vCPU again, and under steal
 * they took 52 us on average, 5% of them 0.3-1 ms), we wait for it awake,
 * yielding the CPU to whoever wants it, for ISO_ASK_POLL_US, rather than
 * sleep and have the pool node wake us. While they are quick, the wait
 * only burnt CPU the BEAM wanted, so then we sleep at once. Every
 * ISO_WAKE_SAMPLE-th wait sleeps anyway, to keep measuring; a wait that
 * ends with nothing makes the next ones skip (ap_skip). Numbers in
 * docs/stateless-workers.md, "Isolation". */
struct ask_wait {
	int64_t asked_us;  /* when the last ask ended, until the next wait */
	int64_t wake_us64; /* how long our wake-ups took lately: a mean over about 64, us x 64 */
	unsigned waits;
	struct ap_skip skip;
};

/* Caught up: 1 if the next message came while we waited awake. */
static int ask_wait(struct ask_wait *a, struct ap_ring *req)
{
	int64_t asked = a->asked_us;
	a->asked_us = 0;
	if (!asked || a->wake_us64 < ISO_WAKE_SLOW_US * 64 || ++a->waits % ISO_WAKE_SAMPLE == 0 ||
	    !ap_skip_wait(&a->skip))
		return 0;
	while (ap_mono_us() - asked < ISO_ASK_POLL_US && ap_ring_readable(req) != 1)
		sched_yield();
	if (ap_ring_readable(req) == 1) {
		ap_skip_hit(&a->skip);
		return 1;
	}
	ap_skip_miss(&a->skip, ISO_ASK_POLL_SKIP_MAX);
	return 0;
}

/* Following the loop: a child whose handlers are quick spends its time
 * on the hop (taking a message in, writing its answer, waiting for the
 * next), not on the work. Where the loop that feeds it runs makes the
 * difference: on the loop's CPU it runs while the loop waits for its
 * answers (iso_await) and wakes nobody; on another CPU it competes with
 * whatever runs there (the BEAM, on a small host) and each hand-over
 * crosses CPUs. 64 callers of echo asks, 2 vCPUs, epoll, one phase of
 * the host: 217-223K asks/s with the pool node held on one CPU, 140-152K
 * placed by the scheduler (docs/stateless-workers.md, "Isolation"). The
 * scheduler places us by load, not by who feeds whom, so after an ask we
 * move to the loop's CPU ourselves (pin there, then hand back our whole
 * mask: the move stays until the scheduler balances us away again).
 * Only while the pool's handlers are quick: while all its workers'
 * handlers together would take half a CPU or more (this child's handler
 * time over the last window, times the pool's workers, times two), one
 * CPU would hold them back, and the scheduler spreads them as it will.
 * When the scheduler moves us away again soon after a move (that CPU is
 * busy: other pools' children follow the same loop), the next move waits
 * twice as long, up to ISO_FOLLOW_MAX_MS, so the two do not pull us to
 * and fro. */
struct follow {
	cpu_set_t mask; /* ours at start: the CPUs the pool node may use */
	int ok;         /* more than one of them */
	int quick;      /* the last window's verdict */
	int64_t win_us, busy_us, moved_us;
	int64_t gap_us; /* between moves, at least */
};

static void follow_init(struct follow *f)
{
	f->ok = sched_getaffinity(0, sizeof f->mask, &f->mask) == 0 && CPU_COUNT(&f->mask) > 1;
	f->gap_us = ISO_FOLLOW_MS * 1000;
}

/* After an ask that ended at now (monotonic us), caught up. */
static void follow_loop(struct follow *f, int64_t now)
{
	if (!f->ok)
		return;
	if (now - f->win_us >= ISO_FOLLOW_WINDOW_US) {
		int64_t n = cc->workers ? cc->workers : 1;
		f->quick = f->win_us && f->busy_us * n * 2 < now - f->win_us;
		f->win_us = now;
		f->busy_us = 0;
	}
	if (!f->quick || now - f->moved_us < f->gap_us)
		return;
	int cpu = atomic_load_explicit(&cc->loop_cpu, memory_order_relaxed);
	if (cpu < 0 || cpu >= CPU_SETSIZE || !CPU_ISSET(cpu, &f->mask) || sched_getcpu() == cpu)
		return;
	/* Moved away within four gaps of our last move: wait longer. */
	if (f->moved_us && now - f->moved_us < 4 * f->gap_us)
		f->gap_us = f->gap_us * 2 > ISO_FOLLOW_MAX_MS * 1000 ? ISO_FOLLOW_MAX_MS * 1000 : f->gap_us * 2;
	else
		f->gap_us = ISO_FOLLOW_MS * 1000;
	cpu_set_t one;
	CPU_ZERO(&one);
	CPU_SET(cpu, &one);
	f->moved_us = now;
	if (sched_setaffinity(0, sizeof one, &one) == 0) {
		/* Never left on one CPU: if our mask is refused now (the
		 * cpuset changed), every CPU, which the kernel cuts to the
		 * cpuset's. */
		if (sched_setaffinity(0, sizeof f->mask, &f->mask)) {
			cpu_set_t all;
			memset(&all, 0xff, sizeof all);
			(void)sched_setaffinity(0, sizeof all, &all);
		}
		atomic_fetch_add_explicit(&cc->follows, 1, memory_order_relaxed);
	}
}

/* Woken (or found work while spinning): how long since the pool node
 * rang, each counted up to 1 ms. */
static void ask_wait_woken(struct ask_wait *a)
{
	int64_t took = ap_mono_us() - atomic_load_explicit(&cc->rang_us, memory_order_relaxed);
	took = took < 0 ? 0 : took > 1000 ? 1000 : took;
	a->wake_us64 += (took * 64 - a->wake_us64) / 64;
}

/* Our start failed: say why (sandbox.h, ISO_FAIL_*) and go. */
__attribute__((noreturn)) static void init_failed(uint32_t kind, int32_t num, int rc)
{
	cc->fail_kind = kind;
	cc->fail_num = num;
	cc->init_rc = rc;
	atomic_store(&cc->init_state, 2);
	ap_iso_bell(cc, 1);
	_exit(0);
}

/* dlerror names the file as it was opened: /proc/self/fd/N is the plugin's
 * path to whoever reads why. */
static void name_plugin(char *why, size_t cap, const char *opened, const char *path)
{
	size_t n = strlen(opened);
	if (opened == path || strncmp(why, opened, n))
		return;
	char rest[256];
	snprintf(rest, sizeof rest, "%s", why + n);
	snprintf(why, cap, "%s%s", path, rest);
}

/* The sandbox, before anything is loaded (sandbox.h): each layer the pool
 * node asks for, or we go, saying which failed. What to load the plugin
 * (spec, NULL for a built-in) from: its path, or the file the pool node
 * opened for us. */
static const char *sandbox(uint8_t *mem, const char *spec)
{
	static const char by_fd[] = "/proc/self/fd/" AP_STR(AP_SB_FD_PLUGIN);
	struct iso_sandbox sb;
	memcpy(&sb, mem + cc->sb_off, sizeof sb);
	for (int fd = AP_SB_FD_CG_V2; fd <= AP_SB_FD_LAST; fd++)
		if ((fd == AP_SB_FD_CG_V2 && (sb.layers & AP_SBL_CG_V2)) ||
		    (fd == AP_SB_FD_CG_V1 && (sb.layers & AP_SBL_CG_V1MEM)) ||
		    (fd == AP_SB_FD_PLUGIN && sb.on && (sb.opts & AP_SBO_PLUGIN_FD)))
			continue;
		else
			close(fd);
	if (!sb.on)
		return spec;
	const char *plugin = spec && (sb.opts & AP_SBO_PLUGIN_FD) ? by_fd : spec;
	/* Its paths: n_read + n_write strings, each ended inside paths_len. */
	const char *paths = (const char *)mem + cc->sb_off + sizeof sb;
	size_t room = cc->sb_len - sizeof sb, at = 0;
	if (sb.paths_len > room)
		_exit(71);
	for (uint32_t i = 0; i < sb.n_read + sb.n_write; i++) {
		const char *z = at < sb.paths_len ? memchr(paths + at, 0, sb.paths_len - at) : NULL;
		if (!z)
			_exit(71);
		at = (size_t)(z - paths) + 1;
	}
	const char *layer = "sandbox";
	if (ap_sb_apply(&sb, paths, plugin, &layer, cc->fail_why, sizeof cc->fail_why)) {
		snprintf(cc->fail_layer, sizeof cc->fail_layer, "%s", layer);
		init_failed(ISO_FAIL_SANDBOX, 0, -EPERM);
	}
	return plugin;
}

int ap_iso_child_main(int argc, char **argv)
{
	/* Die with the proxy thread that started us; if it is gone already,
	 * the parent changed before the flag was set: leave now. */
	prctl(PR_SET_PDEATHSIG, SIGKILL);
	if (argc < 3 || getppid() != (pid_t)atoi(argv[2]))
		_exit(70);
	/* Nothing of the pool node's but the channel and our cgroups (its
	 * sockets, epmd's); they are closed-on-exec there, this makes sure. */
	if (syscall(SYS_close_range, AP_SB_FD_LAST + 1, ~0U, 0)) {
		/* Before Linux 5.9. */
		long max = sysconf(_SC_OPEN_MAX);
		for (int fd = AP_SB_FD_LAST + 1; fd < (max > 0 && max < 65536 ? max : 65536); fd++)
			close(fd);
	}
	struct stat st;
	if (fstat(ISO_FD, &st) || st.st_size < (off_t)ISO_CTL_SIZE)
		_exit(71);
	size_t size = (size_t)st.st_size;
	uint8_t *mem = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, ISO_FD, 0);
	if (mem == MAP_FAILED)
		_exit(71);
	close(ISO_FD);
	cc = (struct iso_ctl *)mem;
	if (cc->magic != ISO_MAGIC || cc->size != size || cc->spec_off + (size_t)cc->spec_len > size ||
	    cc->cfg_off + (size_t)cc->cfg_len > size || cc->req_off + (size_t)cc->req_size > size ||
	    cc->rsp_off + (size_t)cc->rsp_size > size || cc->spec_len == 0 || mem[cc->spec_off + cc->spec_len - 1] ||
	    cc->sb_len < sizeof(struct iso_sandbox) || cc->sb_off + (size_t)cc->sb_len > size)
		_exit(71);
	const char *spec = (const char *)mem + cc->spec_off;
	const actor_pool_handler *h = ap_builtin_handler(spec);
	const char *plugin = sandbox(mem, h ? NULL : spec);
	/* Here, in the process that runs the handler (the sandbox may have
	 * forked it), and allowed by its seccomp filter: the pool node's
	 * barrier reaches us (revoked). */
	fence_each = syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED, 0, 0) != 0;
	struct ap_ring req, rsp;
	if (ap_ring_attach_consumer(&req, mem + cc->req_off, cc->req_size) ||
	    ap_ring_attach_producer(&rsp, mem + cc->rsp_off, cc->rsp_size))
		_exit(71);
	/* The request ring's records are read-only here (the pool node lays
	 * them out on a page of their own): some are the pool node's only copy
	 * of a tell (isolate_loop.c, bare tells), which it hands to another worker
	 * if we die first; a stray write of a handler must not change them. */
	if (mprotect(mem + cc->req_off + AP_RING_HDR_SIZE, cc->req_size - AP_RING_HDR_SIZE, PROT_READ))
		_exit(71);
	char tname[16];
	snprintf(tname, sizeof tname, "ap_worker/%u", cc->worker);
	prctl(PR_SET_NAME, tname);
#ifndef ISO_ASAN
	if (cc->max_memory_mb > 0) {
		struct rlimit rl = { .rlim_cur = (rlim_t)cc->max_memory_mb << 20, .rlim_max = (rlim_t)cc->max_memory_mb << 20 };
		setrlimit(RLIMIT_DATA, &rl);
	}
#endif

	void *dl = NULL;
	if (!h) {
		/* Sandboxed already: a plugin's constructors run inside. */
		uint32_t got = 0;
		int lr = ap_plugin_load(plugin, &h, &dl, &got, cc->fail_why, sizeof cc->fail_why);
		if (plugin != spec)
			close(AP_SB_FD_PLUGIN);
		if (lr) {
			name_plugin(cc->fail_why, sizeof cc->fail_why, plugin, spec);
			init_failed(lr == -2 ? ISO_FAIL_ABI : ISO_FAIL_LOAD, (int32_t)got, -1);
		}
	}
	void *state = NULL;
	int rc = h->init ? h->init(&state, cc->cfg_len ? mem + cc->cfg_off : NULL, cc->cfg_len) : 0;
	if (rc)
		init_failed(ISO_FAIL_INIT, rc, rc);
	atomic_store(&cc->init_state, 1);
	ap_iso_bell(cc, 1);

	actor_pool_reply reply = { .reserve = ap_pool_reply_reserve };
	uint8_t *big = NULL;
	struct untold u = { 0 };
	size_t big_got = 0;
	uint64_t big_seq = 0;
	unsigned unreleased = 0; /* messages read and not given back to the ring */
	uint64_t skip_seq = 0;   /* a message handed back unrun, whose other records are dropped */
	struct ask_wait aw = { 0 };
	struct follow fl = { 0 };
	follow_init(&fl);
	for (;;) {
		const void *p;
		size_t len;
		int r = ap_ring_read(&req, &p, &len);
		if (r == -EAGAIN) {
			/* Caught up: give the ring back before any wait. */
			ap_ring_release(&req);
			unreleased = 0;
			/* Results not rung yet (tells' only: an ask's rings at
			 * once) wait for the spin: more work may come, and one
			 * wake-up then covers them all. Never for our sleep. */
			if (u.results) {
				for (int k = 0; k < ISO_SPIN && ap_ring_readable(&req) != 1; k++)
					ap_ring_cpu_relax();
				if (ap_ring_readable(&req) == 1)
					continue;
				tell_proxy(&u);
			}
			if (aw.asked_us)
				follow_loop(&fl, aw.asked_us);
			if (ask_wait(&aw, &req))
				continue;
			/* Ok tells finished and not told: the pool node's loop
			 * takes them off the mailbox when it sends us the next
			 * message (send_direct), so a stream of tells wakes
			 * nobody for them. If none comes within ISO_DONE_WAIT_MS,
			 * the proxy hears of them. */
			int wr = ap_ring_wait(&req, ISO_SPIN, u.ok_tells ? ISO_DONE_WAIT_MS : -1);
			if (wr == 0)
				ask_wait_woken(&aw);
			if (wr == 0 || ap_ring_readable(&req) == 1)
				continue;
			if (wr != -ETIMEDOUT)
				_exit(72);
			tell_proxy(&u);
			continue;
		}
		struct iso_rec m;
		if (r || len < sizeof m)
			_exit(73);
		memcpy(&m, p, sizeof m);
		if (m.kind == REC_STOP) {
			if (h->terminate)
				h->terminate(state);
			_exit(0);
		}
		size_t chunk = len - sizeof m;
		if (m.kind == REC_MSG && m.off && m.seq == skip_seq) {
			/* The rest of a message handed back unrun. */
			ap_iso_release_every(&req, &unreleased, ISO_RELEASE_BATCH);
			continue;
		}
		if (m.kind != REC_MSG || chunk > m.total - (size_t)m.off ||
		    (m.off && (m.seq != big_seq || m.off != big_got)))
			_exit(73);
		const uint8_t *data = (const uint8_t *)p + sizeof m;
		if (m.off == 0) {
			/* Ours from its first byte: dying while taking it in
			 * (no memory for it) is dying on it. No locked store
			 * (a full fence) per message for it: read after our
			 * death, or by the pool node's loop after its barrier
			 * (revoked). */
			atomic_store_explicit(&cc->running_seq, m.seq, memory_order_release);
			if (revoked(m.seq)) {
				/* Stalled behind a message, and moved to another
				 * worker meanwhile: handed back unrun. */
				skip_seq = m.seq;
				child_result(&rsp, m.seq, AP_HANDLER_OK, &reply, 0, 1);
				ap_ring_publish(&rsp);
				atomic_store_explicit(&cc->done_seq, m.seq, memory_order_release);
				atomic_store_explicit(&cc->running_seq, 0, memory_order_release);
				ap_iso_release_every(&req, &unreleased, ISO_RELEASE_BATCH);
				if (++u.results >= ISO_RESULT_BATCH)
					tell_proxy(&u);
				continue;
			}
		}
		if (m.off == 0 && chunk < m.total) {
			free(big);
			big = malloc(m.total);
			if (!big)
				_exit(74);
			big_seq = m.seq;
			big_got = 0;
		}
		if (chunk < m.total) {
			memcpy(big + m.off, data, chunk);
			big_got += chunk;
			ap_ring_release(&req);
			ap_iso_bell(cc, 0); /* room for the proxy's next chunk */
			if (big_got < m.total)
				continue;
			data = big;
		}
		actor_pool_status rs = AP_HANDLER_OK;
		int not_run = atomic_load(&cc->stopping) != 0;
		/* Timed only where an answer may wait (below), and for the
		 * pool's handler_time histogram (asks): two clock reads per
		 * message cost process-mode tells 12% under a flood. */
		int64_t t0ns = m.a && !not_run ? ap_mono_ns() : 0, t1ns = 0;
		if (!not_run) {
			actor_pool_request rq = { .data = data, .len = m.total, .is_binary = m.b, .is_ask = m.a,
						  .worker = cc->worker };
			reply.len = 0;
			ap_pool_set_atom_reply(&reply, "ok");
			rs = h->handle(state, &rq, &reply);
			if (rs > AP_HANDLER_CRASH)
				rs = AP_HANDLER_ERROR;
		}
		if (m.a || u.ask)
			t1ns = ap_mono_ns();
		if (t0ns)
			ap_hist_add_1w(&cc->run_ns, (uint64_t)(t1ns - t0ns));
		int64_t t0 = t0ns / 1000, t1 = t1ns / 1000;
		if (t0)
			fl.busy_us += t1 - t0;
		/* A tell that went well has no result to say: done_seq
		 * covers it, and neither side touches a record for it. */
		int recorded = m.a || rs != AP_HANDLER_OK || not_run;
		if (recorded) {
			child_result(&rsp, m.seq, rs, &reply, m.a && !not_run && rs != AP_HANDLER_CRASH, not_run);
			ap_ring_publish(&rsp);
		}
		atomic_store_explicit(&cc->done_seq, m.seq, memory_order_release);
		atomic_store_explicit(&cc->running_seq, 0, memory_order_release);
		/* In batches: one release per message was a fifth of our time
		 * under a tell flood. */
		ap_iso_release_every(&req, &unreleased, ISO_RELEASE_BATCH);
		if (data == big) {
			free(big);
			big = NULL;
		}
		/* The proxy hears of results in batches under load (a wake-up
		 * per message would cost more than an echo; a tell's result
		 * only frees its slot in the mailbox), and at once when
		 * we have caught up on an ask: its caller waits for nothing.
		 * An ask's answer waits for the work queued behind it only
		 * while that work is quick: it rings once it has waited
		 * ISO_ASK_WAIT_US (so after at most one more message), and at
		 * once when the ask itself ran that long (a slow handler: a
		 * wake-up is cheap beside it). Without that, an ask ahead of
		 * 30 tells of 1 ms waited for all of them (34 ms, against 2.3
		 * ms in thread mode). Results with records ring before we sleep
		 * (above). */
		if (m.a)
			aw.asked_us = t1;
		if (m.a && !u.ask)
			u.ask_us = t1;
		u.ask |= m.a;
		/* An ok tell counts less: while the proxy sleeps, the pool
		 * node's loop takes finished tells as it sends the next ones
		 * (send_direct), so they ring only in larger batches, or when
		 * no message follows them (above). */
		if (recorded)
			u.results++;
		else
			u.ok_tells++;
		if (u.results >= ISO_RESULT_BATCH || u.ok_tells >= ISO_DONE_BATCH ||
		    (u.ask && (ap_ring_readable(&req) != 1 || t1 - u.ask_us >= ISO_ASK_WAIT_US ||
			       (m.a && t1 - t0 >= ISO_ASK_WAIT_US))))
			tell_proxy(&u);
		if (rs == AP_HANDLER_CRASH) {
			if (h->terminate)
				h->terminate(state);
			_exit(0);
		}
	}
}
