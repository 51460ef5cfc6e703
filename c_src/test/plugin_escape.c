/* plugin_escape: a plugin that tries to leave its worker process's sandbox
 * (c_src/pool/sandbox.h), for test/actor_pool_sandbox_tests.erl. Each
 * command is a binary, words separated by spaces; each answers a term:
 * ok, {error, Errno} (an atom: eacces, eperm, enoent, ...), or as said.
 *
 *   open r|w PATH    open(2) for reading, or to write (creating it)
 *   read PATH        {ok, FirstBytes}: up to 4 KiB of the file
 *   fdopen PID       {Opened, Tried}: opens every /proc/PID/fd/N read-write
 *   ptrace PID       PTRACE_ATTACH (and detach)
 *   vmread PID       process_vm_readv of 8 bytes at PID's first mapping
 *   kill PID         kill(PID, 0)
 *   connect PORT     TCP to 127.0.0.1:PORT
 *   abstract NAME    connect to the abstract Unix socket "\0NAME"
 *   fork N MB        N children that block SIGTERM, each touching MB MiB,
 *                    named ap_escape_kid until done, then ap_escape_full;
 *                    {forked, N} or {error, Errno}
 *   forkhang N       fork N such children (0 MiB), then never return
 *   forkcrash N      fork N such children (0 MiB), then abort()
 *   exec             execve /bin/true
 *   uring            io_uring_setup
 *   env              [Binary]: our environment
 *   fds              [Int]: our open fds
 *   ids              {Uid, Gid, NoNewPrivs, SeccompMode}
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <ei.h>

#include "actor_pool_handler.h"

extern char **environ;

static const char *errname(int e)
{
	switch (e) {
	case EACCES: return "eacces";
	case EPERM: return "eperm";
	case ENOENT: return "enoent";
	case ENOSYS: return "enosys";
	case ECONNREFUSED: return "econnrefused";
	case ESRCH: return "esrch";
	case EFAULT: return "efault";
	case EINVAL: return "einval";
	case EAGAIN: return "eagain";
	case ENOMEM: return "enomem";
	default: return "other";
	}
}

struct out {
	char b[65536];
	int i;
};

static actor_pool_status done(actor_pool_reply *r, struct out *o)
{
	return actor_pool_reply_set(r, AP_REPLY_TERM, o->b, (size_t)o->i) ? AP_HANDLER_CRASH : AP_HANDLER_OK;
}

static actor_pool_status result(actor_pool_reply *r, int rc, int e)
{
	struct out o = { .i = 0 };
	ei_encode_version(o.b, &o.i);
	if (rc == 0) {
		ei_encode_atom(o.b, &o.i, "ok");
	} else {
		ei_encode_tuple_header(o.b, &o.i, 2);
		ei_encode_atom(o.b, &o.i, "error");
		ei_encode_atom(o.b, &o.i, errname(e));
	}
	return done(r, &o);
}

/* A child that will not go quietly: SIGTERM blocked, MB MiB touched. */
static void kid(int mb)
{
	prctl(PR_SET_NAME, "ap_escape_kid");
	sigset_t s;
	sigemptyset(&s);
	sigaddset(&s, SIGTERM);
	sigaddset(&s, SIGINT);
	sigaddset(&s, SIGHUP);
	sigprocmask(SIG_BLOCK, &s, NULL);
	for (int k = 0; k < mb; k++) {
		char *p = malloc(1 << 20);
		if (!p)
			break;
		memset(p, k + 1, 1 << 20);
	}
	prctl(PR_SET_NAME, "ap_escape_full");
	for (;;)
		pause();
}

static int spawn_kids(int n, int mb, int *e)
{
	for (int k = 0; k < n; k++) {
		pid_t pid = fork();
		if (pid < 0) {
			*e = errno;
			return -1;
		}
		if (pid == 0)
			kid(mb);
	}
	return 0;
}

static int first_mapping(int pid, unsigned long *addr)
{
	char p[64];
	snprintf(p, sizeof p, "/proc/%d/maps", pid);
	FILE *f = fopen(p, "r");
	if (!f)
		return -1;
	int ok = fscanf(f, "%lx", addr) == 1;
	fclose(f);
	return ok ? 0 : -1;
}

static actor_pool_status escape_handle(void *state, const actor_pool_request *rq, actor_pool_reply *r)
{
	(void)state;
	char cmd[4096];
	if (!rq->is_binary || rq->len >= sizeof cmd)
		return result(r, -1, EINVAL);
	memcpy(cmd, rq->data, rq->len);
	cmd[rq->len] = 0;
	char *save = NULL, *verb = strtok_r(cmd, " ", &save), *a1 = strtok_r(NULL, " ", &save),
	     *a2 = strtok_r(NULL, " ", &save);
	if (!verb)
		return result(r, -1, EINVAL);
	struct out o = { .i = 0 };
	ei_encode_version(o.b, &o.i);
	if (!strcmp(verb, "open") && a1 && a2) {
		int fd = open(a2, a1[0] == 'w' ? O_WRONLY | O_CREAT | O_TRUNC : O_RDONLY, 0644);
		int e = errno;
		if (fd >= 0)
			close(fd);
		return result(r, fd >= 0 ? 0 : -1, e);
	}
	if (!strcmp(verb, "read") && a1) {
		int fd = open(a1, O_RDONLY);
		if (fd < 0)
			return result(r, -1, errno);
		char b[4096];
		ssize_t n = read(fd, b, sizeof b);
		int e = errno;
		close(fd);
		if (n < 0)
			return result(r, -1, e);
		ei_encode_tuple_header(o.b, &o.i, 2);
		ei_encode_atom(o.b, &o.i, "ok");
		ei_encode_binary(o.b, &o.i, b, n);
		return done(r, &o);
	}
	if (!strcmp(verb, "fdopen") && a1) {
		char dir[64];
		snprintf(dir, sizeof dir, "/proc/%s/fd", a1);
		DIR *d = opendir(dir);
		if (!d)
			return result(r, -1, errno);
		long opened = 0, tried = 0;
		struct dirent *de;
		while ((de = readdir(d))) {
			if (de->d_name[0] == '.')
				continue;
			char p[600];
			snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
			int fd = open(p, O_RDWR);
			tried++;
			if (fd >= 0) {
				opened++;
				close(fd);
			}
		}
		closedir(d);
		ei_encode_tuple_header(o.b, &o.i, 2);
		ei_encode_long(o.b, &o.i, opened);
		ei_encode_long(o.b, &o.i, tried);
		return done(r, &o);
	}
	if (!strcmp(verb, "ptrace") && a1) {
		long rc = ptrace(PTRACE_ATTACH, atoi(a1), NULL, NULL);
		int e = errno;
		if (rc == 0) {
			waitpid(atoi(a1), NULL, __WALL);
			ptrace(PTRACE_DETACH, atoi(a1), NULL, NULL);
		}
		return result(r, rc ? -1 : 0, e);
	}
	if (!strcmp(verb, "vmread") && a1) {
		unsigned long addr = 0x400000;
		(void)first_mapping(atoi(a1), &addr);
		char b[8];
		struct iovec local = { b, sizeof b }, remote = { (void *)addr, sizeof b };
		ssize_t n = process_vm_readv(atoi(a1), &local, 1, &remote, 1, 0);
		return result(r, n < 0 ? -1 : 0, errno);
	}
	if (!strcmp(verb, "kill") && a1) {
		int rc = kill(atoi(a1), 0);
		return result(r, rc, errno);
	}
	if (!strcmp(verb, "connect") && a1) {
		int s = socket(AF_INET, SOCK_STREAM, 0);
		if (s < 0)
			return result(r, -1, errno);
		struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(a1)) };
		sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
		int rc = connect(s, (struct sockaddr *)&sa, sizeof sa), e = errno;
		close(s);
		return result(r, rc, e);
	}
	if (!strcmp(verb, "abstract") && a1) {
		int s = socket(AF_UNIX, SOCK_STREAM, 0);
		if (s < 0)
			return result(r, -1, errno);
		struct sockaddr_un sa = { .sun_family = AF_UNIX };
		size_t n = strlen(a1) < sizeof sa.sun_path - 1 ? strlen(a1) : sizeof sa.sun_path - 1;
		memcpy(sa.sun_path + 1, a1, n);
		int rc = connect(s, (struct sockaddr *)&sa, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n));
		int e = errno;
		close(s);
		return result(r, rc, e);
	}
	if ((!strcmp(verb, "fork") && a1 && a2) || (!strcmp(verb, "forkhang") && a1) ||
	    (!strcmp(verb, "forkcrash") && a1)) {
		int e = 0;
		if (spawn_kids(atoi(a1), a2 && verb[4] == 0 ? atoi(a2) : 0, &e))
			return result(r, -1, e);
		if (!strcmp(verb, "forkhang"))
			for (;;)
				pause();
		if (!strcmp(verb, "forkcrash"))
			abort();
		ei_encode_tuple_header(o.b, &o.i, 2);
		ei_encode_atom(o.b, &o.i, "forked");
		ei_encode_long(o.b, &o.i, atoi(a1));
		return done(r, &o);
	}
	if (!strcmp(verb, "exec")) {
		char *argv[] = { "/bin/true", NULL };
		execve("/bin/true", argv, environ);
		return result(r, -1, errno);
	}
	if (!strcmp(verb, "uring")) {
		char params[120];
		memset(params, 0, sizeof params);
		long fd = syscall(SYS_io_uring_setup, 1, params);
		int e = errno;
		if (fd >= 0)
			close((int)fd);
		return result(r, fd >= 0 ? 0 : -1, e);
	}
	if (!strcmp(verb, "env")) {
		for (char **e = environ; *e && o.i < (int)sizeof o.b - 8192; e++) {
			ei_encode_list_header(o.b, &o.i, 1);
			ei_encode_binary(o.b, &o.i, *e, (long)strlen(*e));
		}
		ei_encode_empty_list(o.b, &o.i);
		return done(r, &o);
	}
	if (!strcmp(verb, "fds")) {
		DIR *d = opendir("/proc/self/fd");
		if (!d)
			return result(r, -1, errno);
		int self = dirfd(d);
		struct dirent *de;
		while ((de = readdir(d)))
			if (de->d_name[0] != '.' && atoi(de->d_name) != self) {
				ei_encode_list_header(o.b, &o.i, 1);
				ei_encode_long(o.b, &o.i, atoi(de->d_name));
			}
		closedir(d);
		ei_encode_empty_list(o.b, &o.i);
		return done(r, &o);
	}
	if (!strcmp(verb, "ids")) {
		ei_encode_tuple_header(o.b, &o.i, 4);
		ei_encode_ulong(o.b, &o.i, getuid());
		ei_encode_ulong(o.b, &o.i, getgid());
		ei_encode_long(o.b, &o.i, prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0));
		ei_encode_long(o.b, &o.i, prctl(PR_GET_SECCOMP, 0, 0, 0, 0));
		return done(r, &o);
	}
	return result(r, -1, EINVAL);
}

static const actor_pool_handler escape = {
	.abi_version = ACTOR_POOL_HANDLER_ABI,
	.name = "escape",
	.handle = escape_handle,
};

__attribute__((visibility("default"))) const actor_pool_handler *actor_pool_handler_get(void) { return &escape; }
