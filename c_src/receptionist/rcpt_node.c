/* actor_receptionist_node: the receptionist C node. One registered process,
 * `actor_receptionist`, holds the registry (registry.c) and keeps the
 * shared-memory snapshot (ap_shm) that lookups read without a message.
 *
 * Run by actor_cnode (--port), or by hand:
 *   actor_receptionist_node --name N@host --cookie-file F [--connect app@host]
 *       [--shm /NAME] [--shm-mb MB] [--max-listing-bytes N]
 * --shm     the POSIX shm object of the snapshot; default "/actor_pool." and
 *           the node name (e.g. /actor_pool.rcpt@host).
 * --shm-mb  its size in MiB (sparse: pages cost memory once written);
 *           default 256; 0: no snapshot (shm_state none).
 * --max-listing-bytes  the largest listing (external format, 131 included)
 *           a key may reach; registers past it get {error, too_many_refs}.
 *           Default and maximum AP_SHM_MAX_VAL (16 MiB); smaller for tests.
 *
 * The protocol (what actor_receptionist does with each message):
 * rcpt_proto.c. The snapshot, its health and the sweep of orphaned
 * segments: rcpt_snap.h.
 *
 * Exit: stdin EOF (port mode), SIGTERM, or SIGINT (not under a port: there
 * Ctrl-C at the owner's shell must not take the registry away) stop the
 * loop; the snapshot is then marked CLOSED and its name unlinked. A second
 * signal while stopping unlinks the name and exits at once.
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ap_log.h"
#include "ap_main.h"
#include "ap_shm.h"
#include "rcpt_log.h"
#include "rcpt_proto.h"
#include "rcpt_snap.h"

#define DEFAULT_SHM_MB 256

static int torn_down;
static int under_port; /* started by an owner through a port (--port) */

/* ---- signals: SIGTERM (and SIGINT by hand) stop the loop, so the exit path runs -------- */

static pthread_t sig_thread;
static int sig_thread_started;
static sigset_t stop_sigs;

static void stop_on_loop(ap_node *n, void *arg)
{
	(void)arg;
	ap_log(AP_LOG_INFO, "receptionist: signal received, stopping");
	ap_node_stop(n);
}

/* The first signal asks the loop to stop; a second one (the loop is stuck)
 * unlinks the segment's name and exits at once. */
static void *sig_main(void *arg)
{
	ap_node *n = arg;
	int sig, got = 0;
	while (sigwait(&stop_sigs, &sig) == 0) {
		if (got++ == 0 && ap_node_call_on_loop(n, stop_on_loop, NULL) == 0)
			continue;
		rcpt_snap_unlink();
		_exit(128 + sig);
	}
	return NULL;
}

/* Before any other thread exists (the runtime starts its helper in
 * ap_node_run): every thread then inherits the blocked mask, and the
 * signals reach only sigwait. Under a port, SIGINT is ignored: a Ctrl-C at
 * the owner's shell reaches its whole process group, and the registry must
 * not vanish if the user then continues; the owner ends us by closing
 * stdin. */
static int start_signal_thread(ap_node *n, int port_mode)
{
	sigemptyset(&stop_sigs);
	sigaddset(&stop_sigs, SIGTERM);
	if (port_mode)
		signal(SIGINT, SIG_IGN);
	else
		sigaddset(&stop_sigs, SIGINT);
	if (pthread_sigmask(SIG_BLOCK, &stop_sigs, NULL))
		return -1;
	if (pthread_create(&sig_thread, NULL, sig_main, n))
		return -1;
	sig_thread_started = 1;
	return 0;
}

/* ---- life cycle ---------------------------------------------------------------------------- */

static void teardown(void)
{
	if (torn_down)
		return;
	torn_down = 1;
	if (sig_thread_started) {
		pthread_cancel(sig_thread);
		pthread_join(sig_thread, NULL);
		sig_thread_started = 0;
	}
	rcpt_snap_close();
	rcpt_proto_free();
}

struct args {
	char shm_name[RCPT_SNAP_NAME_MAX]; /* "": the default */
	long long mb, max_listing;
};

static int parse_args(int argc, char **argv, struct args *a)
{
	for (int k = 0; k < argc; k++) {
		if (!strcmp(argv[k], "--shm") && k + 1 < argc) {
			const char *v = argv[++k];
			if (strlen(v) >= sizeof a->shm_name) {
				ap_log(AP_LOG_ERROR, "--shm name too long");
				return -1;
			}
			snprintf(a->shm_name, sizeof a->shm_name, "%s", v);
		} else if (!strcmp(argv[k], "--shm-mb") && k + 1 < argc) {
			char *end;
			a->mb = strtoll(argv[++k], &end, 10);
			if (*end || a->mb < 0 || a->mb > 65536) {
				ap_log(AP_LOG_ERROR, "bad --shm-mb '%s': want 0..65536 (MiB)", argv[k]);
				return -1;
			}
		} else if (!strcmp(argv[k], "--max-listing-bytes") && k + 1 < argc) {
			char *end;
			a->max_listing = strtoll(argv[++k], &end, 10);
			if (*end || a->max_listing < 2 || a->max_listing > (long long)AP_SHM_MAX_VAL) {
				ap_log(AP_LOG_ERROR, "bad --max-listing-bytes '%s': want 2..%u", argv[k], AP_SHM_MAX_VAL);
				return -1;
			}
		} else {
			ap_log(AP_LOG_ERROR, "unknown argument '%s'", argv[k]);
			return -1;
		}
	}
	return 0;
}

static int rcpt_init(ap_node *n, int argc, char **argv)
{
	struct args a = { .mb = DEFAULT_SHM_MB, .max_listing = AP_SHM_MAX_VAL };
	rcpt_log_init(n);
	if (parse_args(argc, argv, &a))
		return 1;
	if (!a.shm_name[0])
		snprintf(a.shm_name, sizeof a.shm_name, "/actor_pool.%s", ap_node_name(n));
	ap_proc *self = rcpt_proto_start(n, (size_t)a.max_listing);
	if (!self)
		return 1;
	if (start_signal_thread(n, under_port))
		ap_log(AP_LOG_WARNING, "receptionist: cannot handle SIGTERM/SIGINT: %s", strerror(errno));
	rcpt_snap_sweep();
	uint64_t incarnation = self->pid.creation ? self->pid.creation : (uint64_t)getpid();
	rcpt_snap_open(a.shm_name, (size_t)a.mb << 20, incarnation);
	return 0;
}

int main(int argc, char **argv)
{
	/* Also on exit() from elsewhere: the segment name must not outlive us. */
	atexit(teardown);
	under_port = argc == 2 && !strcmp(argv[1], "--port");
	int rc = ap_cnode_main(argc, argv, "actor_receptionist_node", rcpt_init);
	teardown();
	return rc;
}
