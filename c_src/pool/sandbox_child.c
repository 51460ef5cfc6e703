/* sandbox_child: a worker process sandboxes itself before it loads anything
 * (sandbox.h has the design and the order of the layers). Single-threaded,
 * straight after exec: nothing of the plugin's has run yet.
 */
#include "sandbox.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/audit.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/landlock.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "sandbox_ll.h"

struct ctx {
	const struct iso_sandbox *sb;
	const char *paths, *plugin;
	const char **layer;
	char *why;
	size_t why_len;
	int in_ns;    /* in a pid namespace of our own: its init is our parent */
	int uid_done; /* ... which dropped the uid for us */
};

__attribute__((format(printf, 3, 4))) static int fail(struct ctx *c, const char *layer, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(c->why, c->why_len, fmt, ap);
	va_end(ap);
	*c->layer = layer;
	return -1;
}

/* ---- cgroups --------------------------------------------------------------- */

/* "0" into a cgroup.procs the pool node opened: this process moves there,
 * and every process it makes is born there. */
static int join_cgroup(struct ctx *c, int fd)
{
	ssize_t r = write(fd, "0", 1);
	int e = errno;
	close(fd);
	return r == 1 ? 0 : fail(c, "cgroup", "cannot join: %s", strerror(e));
}

/* ---- the pid namespace ----------------------------------------------------- */

static int write_file(const char *path, const char *s)
{
	int fd = open(path, O_WRONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	ssize_t n = (ssize_t)strlen(s), r = write(fd, s, (size_t)n);
	close(fd);
	return r == n ? 0 : -1;
}

static int drop_uid(uint32_t uid, uint32_t gid)
{
	return setgroups(0, NULL) || setresgid(gid, gid, gid) || setresuid(uid, uid, uid) ? -1 : 0;
}

/* Ends this process as a wait status says: by its signal, or its code. */
__attribute__((noreturn)) static void end_as(int st)
{
	if (WIFSIGNALED(st)) {
		int sig = WTERMSIG(st);
		struct rlimit none = { 0, 0 };
		setrlimit(RLIMIT_CORE, &none); /* it dumped already, if anyone */
		signal(sig, SIG_DFL);
		sigset_t s;
		sigemptyset(&s);
		sigaddset(&s, sig);
		sigprocmask(SIG_UNBLOCK, &s, NULL);
		kill(getpid(), sig);
		_exit(128 + sig);
	}
	_exit(WIFEXITED(st) ? WEXITSTATUS(st) : 77);
}

/* Waits for pid; with any = 1, reaps every other child meanwhile (an
 * init's orphans). Its wait status. */
static int wait_for(pid_t pid, int any)
{
	for (;;) {
		int st = 0;
		pid_t r = waitpid(any ? -1 : pid, &st, __WALL);
		if (r == pid)
			return st;
		if (r < 0 && errno != EINTR)
			_exit(76);
	}
}

/* Pid 1 of the namespace: the kernel ignores any signal its namespace
 * sends it without a handler (abort() in it would end as a SIGSEGV), so
 * the worker is its child. It reaps the orphans that come to it, and when
 * the worker is gone, hands its wait status to the process we started as
 * and exits: the kernel then kills whatever else is in the namespace. */
__attribute__((noreturn)) static void be_init(pid_t worker, int status_fd)
{
	prctl(PR_SET_NAME, "ap_worker_init");
	int st = wait_for(worker, 1);
	ssize_t w = write(status_fd, &st, sizeof st);
	_exit(w == (ssize_t)sizeof st ? 0 : 79);
}

/* The process we started as: outside the namespace, our pool node's child.
 * It ends as the worker ended (the pool node reads the cause from it), and
 * dies with the pool node (PDEATHSIG), the namespace with it. */
__attribute__((noreturn)) static void be_outer(pid_t init, int status_fd, const struct iso_sandbox *sb)
{
	if ((sb->layers & AP_SBL_UID) && drop_uid(sb->uid, sb->gid))
		kill(init, SIGKILL);
	prctl(PR_SET_PDEATHSIG, SIGKILL); /* a change of uid cleared it */
	int ist = wait_for(init, 0), st;
	if (read(status_fd, &st, sizeof st) == (ssize_t)sizeof st)
		end_as(st);
	end_as(ist);
}

/* Every capability gone: a user namespace's creator holds them all in it. */
static int drop_caps(struct ctx *c)
{
	for (int cap = 0; cap <= 63; cap++)
		if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) && errno != EINVAL)
			return fail(c, "pidns", "cannot drop capability %d: %s", cap, strerror(errno));
	struct __user_cap_header_struct h = { .version = _LINUX_CAPABILITY_VERSION_3, .pid = 0 };
	struct __user_cap_data_struct d[2];
	memset(d, 0, sizeof d);
	if (syscall(SYS_capset, &h, d))
		return fail(c, "pidns", "capset: %s", strerror(errno));
	return 0;
}

/* A pid namespace of our own: every descendant dies with us, whatever
 * signals it blocks, and nothing outside is ours to name. Not root: a user
 * namespace too, mapping our own ids (nothing else to map). Three
 * processes: the one we started as (be_outer), the namespace's init
 * (be_init), and the worker, which carries on here. */
static int enter_pidns(struct ctx *c, int userns)
{
	uid_t uid = geteuid();
	gid_t gid = getegid();
	if (unshare(CLONE_NEWPID | (userns ? CLONE_NEWUSER : 0)))
		return fail(c, "pidns", "unshare: %s", strerror(errno));
	if (userns) {
		char m[64];
		snprintf(m, sizeof m, "%u %u 1\n", (unsigned)uid, (unsigned)uid);
		if (write_file("/proc/self/setgroups", "deny") || write_file("/proc/self/uid_map", m))
			return fail(c, "pidns", "uid_map: %s", strerror(errno));
		snprintf(m, sizeof m, "%u %u 1\n", (unsigned)gid, (unsigned)gid);
		if (write_file("/proc/self/gid_map", m))
			return fail(c, "pidns", "gid_map: %s", strerror(errno));
	}
	/* p: the worker's wait status, init to outer; a: the outer's life,
	 * whose write end only the outer holds (EOF: it is gone). */
	int p[2], a[2];
	if (pipe2(p, O_CLOEXEC) || pipe2(a, O_CLOEXEC | O_NONBLOCK))
		return fail(c, "pidns", "pipe: %s", strerror(errno));
	pid_t init = fork();
	if (init < 0)
		return fail(c, "pidns", "fork: %s", strerror(errno));
	if (init > 0) {
		close(p[1]);
		close(a[0]);
		be_outer(init, p[0], c->sb);
	}
	close(p[0]);
	close(a[1]);
	/* pid 1 drops its uid (for itself and the worker it forks) before it
	 * sets its parent-death signal: a change of uid clears it. */
	if (c->sb->layers & AP_SBL_UID) {
		if (drop_uid(c->sb->uid, c->sb->gid))
			_exit(78);
		c->uid_done = 1;
	}
	/* It dies with the process we started as (that signal comes from
	 * outside the namespace: it counts), if that one still lives now
	 * that the signal is set. */
	prctl(PR_SET_PDEATHSIG, SIGKILL);
	char b;
	if (read(a[0], &b, 1) == 0)
		_exit(70);
	close(a[0]);
	pid_t worker = fork();
	if (worker < 0)
		_exit(75);
	if (worker > 0)
		be_init(worker, p[1]);
	close(p[1]);
	c->in_ns = 1;
	return userns ? drop_caps(c) : 0;
}

/* Still the child of who started us (a uid change clears PDEATHSIG: set
 * again, then look). In a pid namespace its init is our parent, and the
 * kernel takes us with it. */
static void recheck_parent(struct ctx *c, pid_t parent)
{
	if (c->in_ns)
		return;
	prctl(PR_SET_PDEATHSIG, SIGKILL);
	if (getppid() != parent)
		_exit(70);
}

/* ---- Landlock -------------------------------------------------------------- */

/* Rights a rule on a file (not a directory) may hold. */
#define LL_FILE_RIGHTS                                                                                           \
	(LANDLOCK_ACCESS_FS_EXECUTE | LANDLOCK_ACCESS_FS_WRITE_FILE | LANDLOCK_ACCESS_FS_READ_FILE | AP_LL_FS_TRUNCATE | \
	 AP_LL_FS_IOCTL_DEV)

/* Adds fd (named path) with rights (cut to what is handled, and to a
 * file's rights for a file). */
static int ll_allow_fd(struct ctx *c, int rs, int fd, const char *path, uint64_t rights, uint64_t handled)
{
	struct stat st;
	if (fstat(fd, &st))
		return fail(c, "landlock", "%s: %s", path, strerror(errno));
	struct landlock_path_beneath_attr pb = { .allowed_access = rights & handled, .parent_fd = fd };
	if (!S_ISDIR(st.st_mode))
		pb.allowed_access &= LL_FILE_RIGHTS;
	if (pb.allowed_access && syscall(SYS_landlock_add_rule, rs, LANDLOCK_RULE_PATH_BENEATH, &pb, 0))
		return fail(c, "landlock", "%s: %s", path, strerror(errno));
	return 0;
}

/* ll_allow_fd by path. A missing optional path is no error. */
static int ll_allow(struct ctx *c, int rs, const char *path, uint64_t rights, uint64_t handled, int optional)
{
	int fd = open(path, O_PATH | O_CLOEXEC);
	if (fd < 0) {
		if (optional)
			return 0;
		return fail(c, "landlock", "%s: %s", path, strerror(errno));
	}
	int r = ll_allow_fd(c, rs, fd, path, rights, handled);
	close(fd);
	return r;
}

/* What every process needs to read: the dynamic loader's files and the
 * system's libraries (public files), its own /proc entry. */
static const char *const sys_read[] = { "/usr", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache",
					"/sys/devices/system/cpu", "/dev/urandom", "/dev/random", "/dev/zero" };
/* ... and, with network, the resolver's. */
static const char *const net_read[] = { "/etc/resolv.conf", "/etc/hosts", "/etc/nsswitch.conf", "/etc/gai.conf",
					"/etc/host.conf", "/etc/services", "/etc/protocols" };

/* A sanitizer's log_path=DIR/prefix in an *SAN_OPTIONS variable: its
 * directory (a sanitized build's reports must still be written). */
static int san_log_dir(const char *var, char *out, size_t cap)
{
	const char *v = getenv(var), *p = v ? strstr(v, "log_path=") : NULL;
	if (!p)
		return -1;
	p += 9;
	size_t n = strcspn(p, ":");
	const char *slash = memrchr(p, '/', n);
	if (!slash || (size_t)(slash - p) >= cap)
		return -1;
	memcpy(out, p, (size_t)(slash - p));
	out[slash - p] = 0;
	return 0;
}

static int landlock(struct ctx *c)
{
	const struct iso_sandbox *sb = c->sb;
	int abi = sb->landlock_abi, fork_ok = !!(sb->opts & AP_SBO_FORK), net = !!(sb->opts & AP_SBO_NETWORK);
	struct ap_ll_ruleset_attr attr = { .handled_access_fs = ap_ll_fs_rights(abi) };
	size_t size = sizeof attr.handled_access_fs;
	if (abi >= 4) {
		size += sizeof attr.handled_access_net;
		if (!net)
			attr.handled_access_net = AP_LL_NET_BIND_TCP | AP_LL_NET_CONNECT_TCP;
	}
	if (abi >= 6) {
		size += sizeof attr.scoped;
		attr.scoped = AP_LL_SCOPE_ABSTRACT_UNIX_SOCKET | AP_LL_SCOPE_SIGNAL;
	}
	uint64_t fs = attr.handled_access_fs;
	int rs = (int)syscall(SYS_landlock_create_ruleset, &attr, size, 0);
	if (rs < 0)
		return fail(c, "landlock", "create_ruleset (ABI %d): %s", abi, strerror(errno));
	uint64_t rd = LANDLOCK_ACCESS_FS_READ_FILE | LANDLOCK_ACCESS_FS_READ_DIR | (fork_ok ? LANDLOCK_ACCESS_FS_EXECUTE : 0);
	uint64_t wr = fs & ~(LANDLOCK_ACCESS_FS_MAKE_CHAR | LANDLOCK_ACCESS_FS_MAKE_BLOCK | AP_LL_FS_IOCTL_DEV |
			     (fork_ok ? 0 : LANDLOCK_ACCESS_FS_EXECUTE) | (net ? 0 : LANDLOCK_ACCESS_FS_MAKE_SOCK));
	int r = 0;
	for (size_t i = 0; !r && i < sizeof sys_read / sizeof *sys_read; i++)
		r = ll_allow(c, rs, sys_read[i], rd, fs, 1);
	for (size_t i = 0; net && !r && i < sizeof net_read / sizeof *net_read; i++)
		r = ll_allow(c, rs, net_read[i], rd, fs, 1);
	if (!r)
		r = ll_allow(c, rs, "/dev/null", LANDLOCK_ACCESS_FS_READ_FILE | LANDLOCK_ACCESS_FS_WRITE_FILE, fs, 1);
	/* Our own /proc entry (the kernel resolves "self" as the pid of
	 * /proc's namespace, ours there even from inside a pid namespace). */
	if (!r)
		r = ll_allow(c, rs, "/proc/self", LANDLOCK_ACCESS_FS_READ_FILE | LANDLOCK_ACCESS_FS_READ_DIR, fs, 0);
	/* The plugin: the file the pool node opened for us, or its path. */
	if (!r && c->plugin && (sb->opts & AP_SBO_PLUGIN_FD))
		r = ll_allow_fd(c, rs, AP_SB_FD_PLUGIN, c->plugin, LANDLOCK_ACCESS_FS_READ_FILE, fs);
	else if (!r && c->plugin)
		r = ll_allow(c, rs, c->plugin, LANDLOCK_ACCESS_FS_READ_FILE, fs, 0);
	const char *p = c->paths;
	for (uint32_t i = 0; !r && i < sb->n_read + sb->n_write; i++) {
		r = ll_allow(c, rs, p, i < sb->n_read ? rd : wr, fs, 0);
		p += strlen(p) + 1;
	}
	char dir[4096];
	if (!r && san_log_dir("ASAN_OPTIONS", dir, sizeof dir) == 0)
		r = ll_allow(c, rs, dir, wr, fs, 1);
	if (!r && san_log_dir("UBSAN_OPTIONS", dir, sizeof dir) == 0)
		r = ll_allow(c, rs, dir, wr, fs, 1);
	if (!r && syscall(SYS_landlock_restrict_self, rs, 0))
		r = fail(c, "landlock", "restrict_self: %s", strerror(errno));
	close(rs);
	return r;
}

/* ---- seccomp --------------------------------------------------------------- */

#if defined(__x86_64__)
#define SB_ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define SB_ARCH AUDIT_ARCH_AARCH64
#endif

#ifdef SB_ARCH
#define PROG_MAX 256

struct prog {
	struct sock_filter f[PROG_MAX];
	unsigned n;
};

static void emit(struct prog *p, struct sock_filter s)
{
	if (p->n < PROG_MAX)
		p->f[p->n] = s;
	p->n++;
}

/* nr answers -errno. */
static void refuse(struct prog *p, long nr, int err)
{
	emit(p, (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (uint32_t)nr, 0, 1));
	emit(p, (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (uint32_t)err));
}

/* What no worker has a use for and each could reach outside it: another
 * process's memory or fds, the kernel's state, new namespaces or mounts,
 * io_uring (whose operations seccomp never sees). */
static const long refused[] = {
	SYS_ptrace, SYS_process_vm_readv, SYS_process_vm_writev, SYS_kcmp, SYS_bpf, SYS_perf_event_open,
	SYS_userfaultfd, SYS_keyctl, SYS_add_key, SYS_request_key, SYS_mount, SYS_umount2, SYS_pivot_root,
	SYS_chroot, SYS_unshare, SYS_setns, SYS_kexec_load, SYS_init_module, SYS_finit_module, SYS_delete_module,
	SYS_reboot, SYS_swapon, SYS_swapoff, SYS_acct, SYS_quotactl, SYS_open_by_handle_at, SYS_name_to_handle_at,
	SYS_syslog, SYS_move_pages, SYS_migrate_pages, SYS_vhangup, SYS_fanotify_init, SYS_settimeofday,
	SYS_clock_settime, SYS_lookup_dcookie,
#ifdef SYS_pidfd_getfd
	SYS_pidfd_getfd,
#endif
#ifdef SYS_kexec_file_load
	SYS_kexec_file_load,
#endif
#ifdef SYS_process_madvise
	SYS_process_madvise,
#endif
#ifdef SYS_process_mrelease
	SYS_process_mrelease,
#endif
#ifdef SYS_open_tree
	SYS_open_tree, SYS_move_mount, SYS_fsopen, SYS_fsconfig, SYS_fsmount, SYS_fspick,
#endif
#ifdef SYS_mount_setattr
	SYS_mount_setattr,
#endif
#ifdef SYS_quotactl_fd
	SYS_quotactl_fd,
#endif
#ifdef SYS_iopl
	SYS_iopl, SYS_ioperm, SYS_modify_ldt, SYS_uselib,
#endif
};

static int seccomp(struct ctx *c)
{
	int fork_ok = !!(c->sb->opts & AP_SBO_FORK), net = !!(c->sb->opts & AP_SBO_NETWORK);
	struct prog p = { .n = 0 };
	/* Our architecture's numbers only: an x86_64 process may make x32 or
	 * i386 calls, whose numbers mean other calls. */
	emit(&p, (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)));
	emit(&p, (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SB_ARCH, 1, 0));
	emit(&p, (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS));
	emit(&p, (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)));
#ifdef __x86_64__
	emit(&p, (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, 0x40000000u /* __X32_SYSCALL_BIT */, 0, 1));
	emit(&p, (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS));
#endif
	/* The calls of a worker's every message first: through at once. */
	static const long hot[] = { SYS_futex, SYS_read, SYS_write, SYS_sched_yield, SYS_madvise, SYS_mmap,
				    SYS_munmap, SYS_brk, SYS_clock_nanosleep, SYS_sched_setaffinity };
	const unsigned nhot = sizeof hot / sizeof *hot;
	for (unsigned i = 0; i < nhot; i++)
		emit(&p, (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (uint32_t)hot[i], nhot - i, 0));
	emit(&p, (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JA, 1, 0, 0));
	emit(&p, (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW));
	for (size_t i = 0; i < sizeof refused / sizeof *refused; i++)
		refuse(&p, refused[i], EPERM);
	/* glibc falls back to clone, whose flags we can read; clone3's are
	 * behind a pointer. */
#ifdef SYS_clone3
	refuse(&p, SYS_clone3, ENOSYS);
#endif
#ifdef SYS_io_uring_setup
	refuse(&p, SYS_io_uring_setup, ENOSYS);
	refuse(&p, SYS_io_uring_enter, ENOSYS);
	refuse(&p, SYS_io_uring_register, ENOSYS);
#endif
	if (!fork_ok) {
#ifdef SYS_fork
		refuse(&p, SYS_fork, EPERM);
		refuse(&p, SYS_vfork, EPERM);
#endif
		refuse(&p, SYS_execve, EPERM);
		refuse(&p, SYS_execveat, EPERM);
		/* clone: threads only (CLONE_THREAD in its flags, argument 0). */
		emit(&p, (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_clone, 0, 4));
		emit(&p, (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[0])));
		emit(&p, (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, CLONE_THREAD, 1, 0));
		emit(&p, (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM));
		emit(&p, (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW));
	}
	if (!net)
		refuse(&p, SYS_socket, EACCES); /* socketpair stays: no address, no one else */
	emit(&p, (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW));
	if (p.n > PROG_MAX)
		return fail(c, "seccomp", "filter too long (%u)", p.n);
	struct sock_fprog fp = { .len = (unsigned short)p.n, .filter = p.f };
	if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &fp, 0, 0))
		return fail(c, "seccomp", "%s", strerror(errno));
	return 0;
}
#else
static int seccomp(struct ctx *c) { return fail(c, "seccomp", "no filter for this architecture"); }
#endif

/* ---- all of it, in order --------------------------------------------------- */

int ap_sb_apply(const struct iso_sandbox *sb, const char *paths, const char *plugin, const char **layer, char *why,
		size_t why_len)
{
	struct ctx c = { .sb = sb, .paths = paths, .plugin = plugin, .layer = layer, .why = why, .why_len = why_len };
	pid_t parent = getppid();
	uint32_t l = sb->layers;
	if ((l & AP_SBL_CG_V2) && join_cgroup(&c, AP_SB_FD_CG_V2))
		return -1;
	if ((l & AP_SBL_CG_V1MEM) && join_cgroup(&c, AP_SB_FD_CG_V1))
		return -1;
	if ((l & AP_SBL_PIDNS) && enter_pidns(&c, !!(l & AP_SBL_USERNS)))
		return -1;
	if (l & AP_SBL_UID) {
		if (!c.uid_done && drop_uid(sb->uid, sb->gid))
			return fail(&c, "uid", "cannot become %u:%u: %s", sb->uid, sb->gid, strerror(errno));
		if (getuid() != sb->uid || geteuid() != sb->uid || getgid() != sb->gid)
			return fail(&c, "uid", "still %u:%u", (unsigned)geteuid(), (unsigned)getegid());
		recheck_parent(&c, parent);
	}
	if ((l & AP_SBL_NNP) && prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))
		return fail(&c, "no_new_privs", "%s", strerror(errno));
	if ((l & AP_SBL_LANDLOCK) && landlock(&c))
		return -1;
	if ((l & AP_SBL_SECCOMP) && seccomp(&c))
		return -1;
	return 0;
}
