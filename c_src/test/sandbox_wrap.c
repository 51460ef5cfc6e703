/* sandbox_wrap: runs a command (a pool node) on a host with less: Landlock
 * hidden (--no-landlock: its calls answer ENOSYS, as on a kernel without
 * it, for the command and every process it starts) and/or as another user
 * (--uid N: uid and gid N, no groups). For test/actor_pool_sandbox_tests.erl:
 *
 *   sandbox_wrap [--no-landlock] [--uid N] EXE [ARGS...]
 */
#include <errno.h>
#include <grp.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

static int hide_landlock(void)
{
	struct sock_filter f[] = {
		BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 444 /* landlock_create_ruleset */, 3, 0),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 445 /* landlock_add_rule */, 2, 0),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 446 /* landlock_restrict_self */, 1, 0),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
	};
	struct sock_fprog p = { .len = sizeof f / sizeof *f, .filter = f };
	return prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &p, 0, 0);
}

int main(int argc, char **argv)
{
	int k = 1, no_ll = 0;
	long uid = -1;
	for (; k < argc && !strncmp(argv[k], "--", 2); k++) {
		if (!strcmp(argv[k], "--no-landlock"))
			no_ll = 1;
		else if (!strcmp(argv[k], "--uid") && k + 1 < argc)
			uid = atol(argv[++k]);
		else
			break;
	}
	if (k >= argc) {
		fprintf(stderr, "usage: %s [--no-landlock] [--uid N] EXE [ARGS...]\n", argv[0]);
		return 2;
	}
	if (uid >= 0 && (setgroups(0, NULL) || setresgid((gid_t)uid, (gid_t)uid, (gid_t)uid) ||
			 setresuid((uid_t)uid, (uid_t)uid, (uid_t)uid))) {
		perror("sandbox_wrap: uid");
		return 2;
	}
	if (no_ll && hide_landlock()) {
		perror("sandbox_wrap: seccomp");
		return 2;
	}
	execv(argv[k], argv + k);
	perror("sandbox_wrap: exec");
	return 2;
}
