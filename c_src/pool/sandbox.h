/* sandbox: what a worker process may do (the pool option `sandbox`).
 *
 * A worker process (isolate.h) is a security boundary, layered as the
 * known sandboxes are (bubblewrap, minijail, OpenSSH's privsep): it starts
 * from exec with only its channel (and cgroup) fds and an empty
 * environment, then, before any plugin code runs (dlopen runs a plugin's
 * constructors), it applies in order:
 *
 *   cgroup    joins the slot's cgroup(s): memory.max / memory.limit_in_bytes
 *             = max_memory_mb for the worker and every descendant
 *   pidns     fork => true only: it becomes pid 1 of a pid namespace of its
 *             own (a user namespace too, unless root), so every descendant
 *             dies with it (timeout, crash, stop), whatever it blocks
 *   uid       a root pool node's worker drops to `uid`/`gid` (65534)
 *   nnp       no_new_privs
 *   landlock  read-only: the plugin, the system's libraries, /proc/self and
 *             the pool's `read` paths; read-write: the pool's `write` paths;
 *             nothing else; TCP bind/connect denied unless `network`; abstract
 *             Unix sockets and signals scoped to the worker
 *   seccomp   last: ptrace, process_vm_*, pidfd_getfd, bpf, mounts,
 *             namespaces, io_uring (invisible to seccomp), ... refused; fork,
 *             vfork, clone (not threads) and exec refused unless `fork`;
 *             socket() refused unless `network`
 *
 * The pool node decides, the child obeys or dies: which layers hold is
 * probed once in the pool node (ap_sb_probe), every layer the kernel has is
 * required of each child, and a child that cannot apply one exits before it
 * loads anything ({error, {sandbox_failed, Layer, Why}} at start). So a
 * plugin cannot make stats/1 claim a layer: stats reports the pool node's
 * own knowledge. A layer the kernel lacks is reported as such and warned
 * about once, at the pool's start. The pool node itself is not dumpable
 * (ap_main.c): a process of its uid cannot read its memory (the cookie) or
 * its fds (every data-plane segment). docs/stateless-workers.md,
 * "Sandbox", has the user's side; docs/operations.md, "Security", the
 * threat model.
 */
#ifndef AP_SANDBOX_H
#define AP_SANDBOX_H

#include <stddef.h>
#include <stdint.h>

#include "pool_limits.h"

/* The pool's options. */
#define AP_SB_MAX_PATHS AP_POOL_MAX_SANDBOX_PATHS   /* read and write paths together */
#define AP_SB_PATHS_BYTES AP_POOL_MAX_SANDBOX_BYTES /* their bytes, NULs included */
#define AP_SB_NOBODY 65534u         /* a root pool node's workers' uid and gid by default */

typedef struct ap_sandbox_opts {
	int off;                    /* sandbox => off: none of it */
	int fork, network;
	int64_t uid, gid;           /* -1: the default (AP_SB_NOBODY when root) */
	uint32_t n_read, n_write;   /* paths: n_read read-only ones, then n_write writable */
	uint32_t paths_len;
	char paths[AP_SB_PATHS_BYTES];
} ap_sandbox_opts;

void ap_sb_opts_default(ap_sandbox_opts *o);

/* Layers: the bits the pool node requires of a child (iso_sandbox.layers)
 * and reports in stats/1. */
enum {
	AP_SBL_NNP = 1u << 0,
	AP_SBL_UID = 1u << 1,
	AP_SBL_LANDLOCK = 1u << 2,
	AP_SBL_SECCOMP = 1u << 3,
	AP_SBL_PIDNS = 1u << 4,
	AP_SBL_USERNS = 1u << 5,    /* with PIDNS, when not root */
	AP_SBL_CG_V2 = 1u << 6,     /* fd AP_SB_FD_CG_V2 is a cgroup.procs to join */
	AP_SBL_CG_V1MEM = 1u << 7,  /* fd AP_SB_FD_CG_V1 likewise, the v1 memory controller's */
	AP_SBL_CG_V2MEM = 1u << 8,  /* the v2 one has memory.max (stats only: the child just joins) */
};

/* Where a child finds its cgroups' cgroup.procs (after the channel's fd 3),
 * and its plugin, opened by the pool node (AP_SBO_PLUGIN_FD): it loads it
 * through /proc/self/fd, so the plugin's directory need not be open to the
 * worker's uid, and Landlock grants that one file. */
#define AP_SB_FD_CG_V2 4
#define AP_SB_FD_CG_V1 5
#define AP_SB_FD_PLUGIN 6
#define AP_SB_FD_LAST AP_SB_FD_PLUGIN

/* Option bits (iso_sandbox.opts). */
enum { AP_SBO_FORK = 1u << 0, AP_SBO_NETWORK = 1u << 1, AP_SBO_PLUGIN_FD = 1u << 2 };

/* The sandbox section of a worker's channel (isolate.h), written by the
 * pool node before each spawn from its own copy, read once by the child:
 * then the paths, n_read read-only ones, then n_write writable ones, each
 * NUL-terminated, paths_len bytes in all. */
struct iso_sandbox {
	uint32_t on;                /* 0: sandbox => off */
	uint32_t layers;            /* AP_SBL_*: apply each, or die */
	uint32_t opts;              /* AP_SBO_* */
	int32_t landlock_abi;
	uint32_t uid, gid;          /* AP_SBL_UID */
	uint32_t n_read, n_write, paths_len;
	uint32_t pad;
};

/* What failed in a child before it served (iso_ctl.fail_kind). */
enum { ISO_FAIL_NONE, ISO_FAIL_INIT, ISO_FAIL_LOAD, ISO_FAIL_ABI, ISO_FAIL_SANDBOX };

/* ---- the pool node's side (sandbox.c) ---- */

struct ap_pool;

/* What this kernel and this pool node can do, probed once. */
struct ap_sb_probe {
	int root;                   /* euid 0: workers drop to a uid */
	int landlock_abi;           /* 0: none */
	int seccomp;
	int pidns;                  /* a child may make a pid namespace (and user one, unless root) */
	int nodump;                 /* the pool node itself is not dumpable */
};
const struct ap_sb_probe *ap_sb_probe(void);

/* A slot's cgroups (made where one can be: v2 for kill, and memory where
 * the v2 tree has it, else the v1 memory controller's): -1 fds when none. */
struct ap_sb_cgroup {
	int v2_procs, v1_procs;     /* cgroup.procs, O_WRONLY */
	int has_v2_mem;
	char *v2_dir, *v1_dir;
};

/* Loop thread, at slot init: the slot's cgroups for these options (none
 * unless max_memory_mb or fork). Never fails: what cannot be made is not
 * there. */
void ap_sb_cgroup_make(struct ap_sb_cgroup *cg, const ap_sandbox_opts *o, int max_memory_mb);
/* After the slot's child is reaped: every process left in its cgroup is
 * killed (cgroup.kill, v2); then, at slot free, the directories go. */
void ap_sb_cgroup_kill(const struct ap_sb_cgroup *cg);
void ap_sb_cgroup_free(struct ap_sb_cgroup *cg);

/* fd, moved above the numbers a child finds its fds at (a spawn's dup2s
 * onto them must not close one still to be moved); -1 on failure. */
int ap_sb_fd_above(int fd);

/* The layers a child of this pool must apply (AP_SBL_*), given its slot's
 * cgroups. */
uint32_t ap_sb_layers(const ap_sandbox_opts *o, const struct ap_sb_cgroup *cg);
/* The section for the channel (plugin_fd: AP_SBO_PLUGIN_FD); 0 or -ENOSPC. */
int ap_sb_write(const ap_sandbox_opts *o, uint32_t layers, int plugin_fd, struct iso_sandbox *out, char *paths,
		size_t room);
/* stats/1's `sandbox': off (or a thread pool), or which layers hold, which
 * this host lacks, and the options. */
struct ei_x_buff_TAG;
void ap_sb_encode_stats(struct ei_x_buff_TAG *x, const ap_sandbox_opts *o, int process, int max_memory_mb,
			uint32_t layers);
/* Once per pool start: the layers this pool lacks, in one warning. */
void ap_sb_warn(const char *pool, const ap_sandbox_opts *o, int max_memory_mb, uint32_t layers);

/* ---- the child's side (sandbox_child.c) ---- */

/* Applies every layer sb requires, in order, to this process (the worker,
 * single-threaded, before anything is loaded). plugin: the plugin's path
 * (fd AP_SB_FD_PLUGIN, with AP_SBO_PLUGIN_FD), or NULL. 0, or -1 with the failing layer's name and why in layer/why. A
 * pid namespace forks: the caller carries on in the namespace's pid 1, and
 * the process it started as waits and exits as that one does. */
int ap_sb_apply(const struct iso_sandbox *sb, const char *paths, const char *plugin, const char **layer, char *why,
		size_t why_len);

#endif
