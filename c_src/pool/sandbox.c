/* sandbox: the pool node's side of a worker's sandbox (sandbox.h has the
 * design): what the kernel offers, probed once; each slot's cgroups; the
 * layers each child must apply; the warning for what is missing.
 */
#include "sandbox.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <linux/landlock.h>

#include <ei.h>

#include "ap_log.h"
#include "sandbox_ll.h"

void ap_sb_opts_default(ap_sandbox_opts *o)
{
	memset(o, 0, offsetof(ap_sandbox_opts, paths));
	o->paths[0] = 0;
	o->uid = o->gid = -1;
}

/* ---- probing --------------------------------------------------------------- */

static struct ap_sb_probe probed;
static pthread_once_t probe_once = PTHREAD_ONCE_INIT;

static int probe_child(void *arg)
{
	(void)arg;
	return 0;
}

/* Whether a child can make a pid namespace (and, not root, a user one):
 * one throwaway clone that exits at once. CLONE_VM|CLONE_VFORK: nothing of
 * ours is copied, and it is gone when clone returns. */
static int probe_pidns(int root)
{
	size_t sz = 64 << 10;
	char *stack = malloc(sz);
	if (!stack)
		return 0;
	int flags = CLONE_VM | CLONE_VFORK | CLONE_NEWPID | (root ? 0 : CLONE_NEWUSER) | SIGCHLD;
	pid_t pid = clone(probe_child, stack + sz, flags, NULL);
	int ok = 0;
	if (pid > 0) {
		int st;
		while (waitpid(pid, &st, __WALL) < 0 && errno == EINTR)
			;
		ok = WIFEXITED(st) && WEXITSTATUS(st) == 0;
	}
	free(stack);
	return ok;
}

static void sweep_stale(void);

static void probe(void)
{
	probed.root = geteuid() == 0;
	long abi = syscall(SYS_landlock_create_ruleset, NULL, 0, LANDLOCK_CREATE_RULESET_VERSION);
	probed.landlock_abi = abi > 0 ? (int)abi : 0;
#if defined(__x86_64__) || defined(__aarch64__)
	probed.seccomp = prctl(PR_GET_SECCOMP, 0, 0, 0, 0) >= 0;
#endif
	probed.pidns = probe_pidns(probed.root);
	probed.nodump = prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) == 0;
	sweep_stale();
}

const struct ap_sb_probe *ap_sb_probe(void)
{
	pthread_once(&probe_once, probe);
	return &probed;
}

/* ---- cgroups --------------------------------------------------------------- */

/* Our own cgroup's directory in the v2 tree and in the v1 memory
 * controller's, if mounted: a mount point (mountinfo) joined with our path
 * in that hierarchy (/proc/self/cgroup) less the mount's own root. */
static char v2_base[4096], v1_base[4096];

static void own_path(const char *want, char *out, size_t cap)
{
	FILE *f = fopen("/proc/self/cgroup", "re");
	char line[4096];
	out[0] = 0;
	while (f && fgets(line, sizeof line, f)) {
		line[strcspn(line, "\n")] = 0;
		char *a = strchr(line, ':'), *b = a ? strchr(a + 1, ':') : NULL;
		if (!b)
			continue;
		*b = 0;
		const char *ctl = a + 1;
		int hit = want ? (strcmp(ctl, want) == 0 || (strstr(ctl, want) && strchr(ctl, ','))) : *ctl == 0;
		if (hit) {
			snprintf(out, cap, "%s", b + 1);
			break;
		}
	}
	if (f)
		fclose(f);
}

static void find_bases(void)
{
	char v2p[4096], v1p[4096];
	own_path(NULL, v2p, sizeof v2p);
	own_path("memory", v1p, sizeof v1p);
	FILE *f = fopen("/proc/self/mountinfo", "re");
	char line[8192];
	while (f && fgets(line, sizeof line, f)) {
		/* id parent maj:min root mountpoint opts [tags] - fstype source superopts */
		char root[4096], mnt[4096], fstype[64], super[1024];
		char *dash = strstr(line, " - ");
		if (!dash || sscanf(line, "%*s %*s %*s %4095s %4095s", root, mnt) != 2 ||
		    sscanf(dash + 3, "%63s %*s %1023s", fstype, super) != 2)
			continue;
		const char *path = NULL;
		char *base = NULL;
		if (!strcmp(fstype, "cgroup2") && v2p[0] && !v2_base[0]) {
			path = v2p;
			base = v2_base;
		} else if (!strcmp(fstype, "cgroup") && v1p[0] && !v1_base[0]) {
			char *s = super, *tok, *save = NULL;
			while ((tok = strtok_r(s, ",", &save))) {
				s = NULL;
				if (!strcmp(tok, "memory")) {
					path = v1p;
					base = v1_base;
				}
			}
		}
		if (!base)
			continue;
		size_t rl = strcmp(root, "/") ? strlen(root) : 0;
		if (strncmp(path, root, rl) || (path[rl] && path[rl] != '/'))
			continue; /* our cgroup is not under this mount */
		if ((size_t)snprintf(base, 4096, "%.2047s%.2047s", mnt, path + rl) >= 4096)
			base[0] = 0;
	}
	if (f)
		fclose(f);
}

/* Slots' cgroups left by a pool node that died: empty once its workers
 * died with it, so rmdir takes them. */
static void sweep_dir(const char *base)
{
	DIR *d = base[0] ? opendir(base) : NULL;
	struct dirent *e;
	while (d && (e = readdir(d))) {
		long pid;
		if (sscanf(e->d_name, "actor_pool.%ld.", &pid) != 1 || pid == (long)getpid())
			continue;
		if (kill((pid_t)pid, 0) == 0 || errno != ESRCH)
			continue; /* alive */
		char p[4096 + 256];
		snprintf(p, sizeof p, "%s/%s", base, e->d_name);
		rmdir(p);
	}
	if (d)
		closedir(d);
}

static void sweep_stale(void)
{
	find_bases();
	sweep_dir(v2_base);
	sweep_dir(v1_base);
}

static int write_at(const char *dir, const char *file, const char *val)
{
	char p[4096 + 64];
	snprintf(p, sizeof p, "%s/%s", dir, file);
	int fd = open(p, O_WRONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	ssize_t n = (ssize_t)strlen(val), r = write(fd, val, (size_t)n);
	close(fd);
	return r == n ? 0 : -1;
}

static int has_word(const char *dir, const char *file, const char *word)
{
	char p[4096 + 64], buf[512];
	snprintf(p, sizeof p, "%s/%s", dir, file);
	int fd = open(p, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return 0;
	ssize_t n = read(fd, buf, sizeof buf - 1);
	close(fd);
	if (n <= 0)
		return 0;
	buf[n] = 0;
	for (char *s = buf, *t, *save = NULL; (t = strtok_r(s, " \n", &save)); s = NULL)
		if (!strcmp(t, word))
			return 1;
	return 0;
}

int ap_sb_fd_above(int fd)
{
	if (fd < 0 || fd > AP_SB_FD_LAST)
		return fd;
	int up = fcntl(fd, F_DUPFD_CLOEXEC, AP_SB_FD_LAST + 1);
	close(fd);
	return up;
}

/* A new directory under base, its cgroup.procs open; NULL if either fails. */
static char *cg_mkdir(const char *base, int *procs)
{
	static _Atomic unsigned seq;
	char *dir = malloc(4096 + 64);
	if (!dir)
		return NULL;
	snprintf(dir, 4096 + 64, "%s/actor_pool.%ld.%u", base, (long)getpid(), atomic_fetch_add(&seq, 1));
	if (mkdir(dir, 0755)) {
		free(dir);
		return NULL;
	}
	char p[4096 + 96];
	snprintf(p, sizeof p, "%s/cgroup.procs", dir);
	*procs = open(p, O_WRONLY | O_CLOEXEC);
	*procs = ap_sb_fd_above(*procs);
	if (*procs < 0) {
		rmdir(dir);
		free(dir);
		return NULL;
	}
	return dir;
}

void ap_sb_cgroup_make(struct ap_sb_cgroup *cg, const ap_sandbox_opts *o, int max_memory_mb)
{
	memset(cg, 0, sizeof *cg);
	cg->v2_procs = cg->v1_procs = -1;
	ap_sb_probe();
	if (o->off || (!max_memory_mb && !o->fork))
		return;
	char lim[32];
	snprintf(lim, sizeof lim, "%llu", (unsigned long long)max_memory_mb << 20);
	/* v2: cgroup.kill takes every descendant with the worker (a pid
	 * namespace does too, where there is one), and memory.max where the
	 * tree hands the controller down to us. */
	int v2_mem = v2_base[0] && has_word(v2_base, "cgroup.subtree_control", "memory");
	if (v2_base[0] && (o->fork || (max_memory_mb && v2_mem)) && (cg->v2_dir = cg_mkdir(v2_base, &cg->v2_procs))) {
		if (max_memory_mb && v2_mem && write_at(cg->v2_dir, "memory.max", lim) == 0) {
			write_at(cg->v2_dir, "memory.swap.max", "0");
			cg->has_v2_mem = 1;
		}
	}
	if (max_memory_mb && !cg->has_v2_mem && v1_base[0] && (cg->v1_dir = cg_mkdir(v1_base, &cg->v1_procs))) {
		if (write_at(cg->v1_dir, "memory.limit_in_bytes", lim)) {
			close(cg->v1_procs);
			cg->v1_procs = -1;
			rmdir(cg->v1_dir);
			free(cg->v1_dir);
			cg->v1_dir = NULL;
		} else {
			write_at(cg->v1_dir, "memory.memsw.limit_in_bytes", lim); /* swap counted too, where it is */
		}
	}
}

void ap_sb_cgroup_kill(const struct ap_sb_cgroup *cg)
{
	if (cg->v2_dir)
		write_at(cg->v2_dir, "cgroup.kill", "1");
}

static void cg_rmdir(char **dir, int *procs, int v2)
{
	if (*procs >= 0)
		close(*procs);
	*procs = -1;
	if (!*dir)
		return;
	/* Killed processes leave their cgroup a little after they die. */
	for (int k = 0; rmdir(*dir) && errno == EBUSY && k < 100; k++) {
		if (v2)
			write_at(*dir, "cgroup.kill", "1");
		usleep(2000);
	}
	free(*dir);
	*dir = NULL;
}

void ap_sb_cgroup_free(struct ap_sb_cgroup *cg)
{
	cg_rmdir(&cg->v2_dir, &cg->v2_procs, 1);
	cg_rmdir(&cg->v1_dir, &cg->v1_procs, 0);
}

/* ---- a child's orders -------------------------------------------------------- */

uint32_t ap_sb_layers(const ap_sandbox_opts *o, const struct ap_sb_cgroup *cg)
{
	const struct ap_sb_probe *pr = ap_sb_probe();
	if (o->off)
		return 0;
	uint32_t l = AP_SBL_NNP;
	if (pr->root || o->uid >= 0)
		l |= AP_SBL_UID;
	if (pr->landlock_abi > 0)
		l |= AP_SBL_LANDLOCK;
	if (pr->seccomp)
		l |= AP_SBL_SECCOMP;
	if (o->fork && pr->pidns)
		l |= AP_SBL_PIDNS | (pr->root ? 0 : AP_SBL_USERNS);
	if (cg->v2_procs >= 0)
		l |= AP_SBL_CG_V2;
	if (cg->v1_procs >= 0)
		l |= AP_SBL_CG_V1MEM;
	if (cg->has_v2_mem)
		l |= AP_SBL_CG_V2MEM;
	return l;
}

/* What this pool lacks of what it asked for (names as in stats/1). */
static unsigned missing(const ap_sandbox_opts *o, int max_memory_mb, uint32_t layers, const char **out)
{
	const struct ap_sb_probe *pr = ap_sb_probe();
	unsigned n = 0;
	if (!pr->nodump)
		out[n++] = "nodump";
	if (!(layers & AP_SBL_LANDLOCK))
		out[n++] = "landlock";
	if (!(layers & AP_SBL_SECCOMP))
		out[n++] = "seccomp";
	if (o->fork && !(layers & AP_SBL_PIDNS))
		out[n++] = "pidns";
	if (o->fork && max_memory_mb && !(layers & (AP_SBL_CG_V1MEM | AP_SBL_CG_V2MEM)))
		out[n++] = "memory_cgroup";
	return n;
}

void ap_sb_encode_stats(struct ei_x_buff_TAG *x, const ap_sandbox_opts *o, int process, int max_memory_mb,
			uint32_t layers)
{
	if (!process || o->off) {
		ei_x_encode_atom(x, "off");
		return;
	}
	const struct ap_sb_probe *pr = ap_sb_probe();
	const char *held[9], *miss[5];
	unsigned nh = 0, nm = missing(o, max_memory_mb, layers, miss);
	if (pr->nodump)
		held[nh++] = "nodump";
	held[nh++] = "exec"; /* fresh, with only its channel's fds and no environment */
	const struct {
		uint32_t bit;
		const char *name;
	} names[] = { { AP_SBL_NNP, "no_new_privs" }, { AP_SBL_UID, "uid" },	    { AP_SBL_LANDLOCK, "landlock" },
		      { AP_SBL_SECCOMP, "seccomp" },  { AP_SBL_PIDNS, "pidns" },
		      { AP_SBL_CG_V1MEM | AP_SBL_CG_V2, "cgroup" } };
	for (size_t i = 0; i < sizeof names / sizeof *names; i++)
		if (layers & names[i].bit)
			held[nh++] = names[i].name;
	ei_x_encode_map_header(x, 8);
	ei_x_encode_atom(x, "layers");
	ei_x_encode_list_header(x, nh);
	for (unsigned i = 0; i < nh; i++)
		ei_x_encode_atom(x, held[i]);
	ei_x_encode_empty_list(x);
	ei_x_encode_atom(x, "missing");
	if (nm)
		ei_x_encode_list_header(x, nm);
	for (unsigned i = 0; i < nm; i++)
		ei_x_encode_atom(x, miss[i]);
	ei_x_encode_empty_list(x);
	ei_x_encode_atom(x, "landlock_abi");
	ei_x_encode_long(x, (layers & AP_SBL_LANDLOCK) ? pr->landlock_abi : 0);
	ei_x_encode_atom(x, "uid");
	if (layers & AP_SBL_UID)
		ei_x_encode_ulong(x, o->uid >= 0 ? (unsigned long)o->uid : AP_SB_NOBODY);
	else
		ei_x_encode_atom(x, "inherited");
	ei_x_encode_atom(x, "memory");
	ei_x_encode_atom(x, !max_memory_mb ? "infinity"
			    : layers & (AP_SBL_CG_V1MEM | AP_SBL_CG_V2MEM) ? "cgroup"
									     : "rlimit");
	ei_x_encode_atom(x, "fork");
	ei_x_encode_boolean(x, o->fork);
	ei_x_encode_atom(x, "network");
	ei_x_encode_boolean(x, o->network);
	ei_x_encode_atom(x, "paths");
	ei_x_encode_tuple_header(x, 2);
	const char *p = o->paths;
	for (int rw = 0; rw < 2; rw++) {
		uint32_t k = rw ? o->n_write : o->n_read;
		if (k)
			ei_x_encode_list_header(x, k);
		for (uint32_t i = 0; i < k; i++) {
			ei_x_encode_binary(x, p, (long)strlen(p));
			p += strlen(p) + 1;
		}
		ei_x_encode_empty_list(x);
	}
}

int ap_sb_write(const ap_sandbox_opts *o, uint32_t layers, int plugin_fd, struct iso_sandbox *out, char *paths,
		size_t room)
{
	if (o->paths_len > room)
		return -ENOSPC;
	const struct ap_sb_probe *pr = ap_sb_probe();
	*out = (struct iso_sandbox){
		.on = !o->off,
		.layers = layers,
		.opts = (o->fork ? AP_SBO_FORK : 0) | (o->network ? AP_SBO_NETWORK : 0) |
			(plugin_fd ? AP_SBO_PLUGIN_FD : 0),
		.landlock_abi = pr->landlock_abi,
		.uid = o->uid >= 0 ? (uint32_t)o->uid : AP_SB_NOBODY,
		.gid = o->gid >= 0 ? (uint32_t)o->gid : o->uid >= 0 ? (uint32_t)o->uid : AP_SB_NOBODY,
		.n_read = o->n_read,
		.n_write = o->n_write,
		.paths_len = o->paths_len,
	};
	memcpy(paths, o->paths, o->paths_len);
	return 0;
}

void ap_sb_warn(const char *pool, const ap_sandbox_opts *o, int max_memory_mb, uint32_t layers)
{
	if (o->off) {
		ap_log(AP_LOG_WARNING, "pool %s: sandbox => off: its worker processes run with the pool node's rights",
		       pool);
		return;
	}
	const char *m[5];
	unsigned nm = missing(o, max_memory_mb, layers, m);
	char miss[256] = "";
	size_t k = 0;
	for (unsigned i = 0; i < nm && k < sizeof miss; i++)
		k += (size_t)snprintf(miss + k, sizeof miss - k, "%s%s", i ? ", " : "", m[i]);
	if (nm)
		ap_log(AP_LOG_WARNING, "pool %s: sandbox layers this host lacks: %s (stats/1: sandbox)", pool, miss);
}
