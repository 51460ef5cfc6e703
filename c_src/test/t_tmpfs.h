/* t_tmpfs: run a check in a forked child whose /dev/shm is a small private
 * tmpfs (root only: elsewhere the case is skipped, saying why), for tests
 * of what a full filesystem does to shared-memory segments.
 *
 * The child cannot use cmocka (a failed assert would longjmp into the
 * child's copy of the runner): it checks with T_CK and exits 1; the parent
 * checks that it exited 0 and was not killed by a signal (SIGBUS is what a
 * store past a full tmpfs's end gets). */
#ifndef T_TMPFS_H
#define T_TMPFS_H

#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include "t_helpers.h"

#define T_CHILD_SKIP 77

#define T_CK(c)                                                                                    \
	do {                                                                                       \
		if (!(c)) {                                                                        \
			fprintf(stderr, "%s:%d: in the child: %s\n", __FILE__, __LINE__, #c);      \
			_exit(1);                                                                  \
		}                                                                                  \
	} while (0)

/* size: the tmpfs's size option, e.g. "size=4m". */
static inline void t_in_small_tmpfs(const char *size, void (*fn)(void))
{
	char opts[64];
	int st = 0;
	snprintf(opts, sizeof opts, "%s,mode=1777", size);
	fflush(stdout);
	fflush(stderr);
	pid_t pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		/* Private first, so that the mount does not propagate out. */
		if (unshare(CLONE_NEWNS) < 0 || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0 ||
		    mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, opts) < 0) {
			fprintf(stderr, "no private tmpfs (%s): skipped\n", strerror(errno));
			_exit(T_CHILD_SKIP);
		}
		fn();
		_exit(0);
	}
	assert_int_equal(waitpid(pid, &st, 0), pid);
	if (WIFSIGNALED(st))
		fail_msg("the child was killed by signal %d (SIGBUS is %d)", WTERMSIG(st), SIGBUS);
	assert_true(WIFEXITED(st));
	if (WEXITSTATUS(st) == T_CHILD_SKIP)
		skip();
	assert_int_equal(WEXITSTATUS(st), 0);
}

#endif
