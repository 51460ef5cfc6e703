/* ap_shm_sweep: segments whose writer is gone: judging a header (by its
 * lock, or by pid for old layouts), removing one segment, sweeping a
 * directory (see "Writers that are gone" in ap_shm.h). */
#include "ap_shm.h"
#include "ap_shm_int.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- writers that are gone ---------------------------------------------- */

int ap_proc_stat(long pid, uint64_t *start, char *state)
{
	char path[64], buf[2048], *p, *end;
	unsigned long long v;
	ssize_t n;
	int fd, e;

	if (pid <= 0 || pid > INT_MAX)
		return -EINVAL;
	snprintf(path, sizeof path, "/proc/%ld/stat", pid);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return errno == ENOENT || errno == ESRCH ? -ENOENT : -errno;
	n = read(fd, buf, sizeof buf - 1);
	e = errno;
	close(fd);
	if (n < 0)
		return e == ESRCH ? -ENOENT : -e; /* it exited between open and read */
	buf[n] = 0;
	/* "pid (comm) S f4 ... f22 ...": comm may hold spaces and ')', so
	 * the fields start after the last ')'. */
	p = memrchr(buf, ')', (size_t)n);
	if (!p || p[1] != ' ' || !p[2])
		return -EINVAL;
	p += 2;
	if (state)
		*state = *p;
	for (int f = 3; f < 22; f++) {
		p = strchr(p, ' ');
		if (!p)
			return -EINVAL;
		p++;
	}
	if (*p < '0' || *p > '9')
		return -EINVAL;
	errno = 0;
	v = strtoull(p, &end, 10);
	if (errno || (*end != ' ' && *end != '\n' && *end))
		return -EINVAL;
	if (start)
		*start = v;
	return 0;
}

uint64_t ap_proc_pidns(void)
{
	struct stat st;

	return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

static enum ap_shm_fate v_set(struct ap_shm_verdict *v, enum ap_shm_fate fate, const char *why)
{
	v->fate = fate;
	v->why = why;
	return fate;
}

enum ap_shm_fate ap_shm_judge(const void *buf, size_t len, int held, struct ap_shm_verdict *v)
{
	struct ap_shm_hdr h;

	memset(v, 0, sizeof *v);
	/* A copy: buf may be anyone's bytes, and judging reads them once. */
	memset(&h, 0, sizeof h);
	memcpy(&h, buf, len < sizeof h ? len : sizeof h);
	if (len >= offsetof(struct ap_shm_hdr, incarnation) &&
	    (h.magic == AP_SHM_MAGIC || h.magic == AP_SHM_MAGIC_CREATING)) {
		v->version = h.version;
		v->pid = h.writer_pid;
		if (len >= sizeof h)
			v->start = h.writer_start;
	}
	/* The lock is the only evidence about a layout-4 writer. */
	if (held)
		return v_set(v, AP_SHM_FATE_LIVE, NULL);
	if (len == 0)
		return v_set(v, AP_SHM_FATE_GONE, "empty: its writer died while creating it");
	if (len < sizeof h.magic)
		return v_set(v, AP_SHM_FATE_UNREADABLE, "shorter than a snapshot header");
	if (h.magic == 0)
		return v_set(v, AP_SHM_FATE_GONE, "no magic: its writer died while creating it");
	if (h.magic == AP_SHM_MAGIC_CREATING)
		return v_set(v, AP_SHM_FATE_GONE, "its writer died while creating it");
	if (h.magic != AP_SHM_MAGIC)
		return v_set(v, AP_SHM_FATE_UNREADABLE, "not a snapshot (magic)");
	if (len < offsetof(struct ap_shm_hdr, incarnation))
		return v_set(v, AP_SHM_FATE_UNREADABLE, "shorter than a snapshot header");
	if (h.version == AP_SHM_VERSION)
		return v_set(v, AP_SHM_FATE_GONE, NULL);
	if (h.version != 3 && h.version != 4)
		return v_set(v, AP_SHM_FATE_UNREADABLE, "unknown layout version");
	/* Layouts 3 and 4 predate the lock: gone only if nobody here has
	 * the pid (a stamp is all there is). */
	if (!h.writer_pid || h.writer_pid > INT_MAX)
		return v_set(v, AP_SHM_FATE_UNKNOWN, "an old layout without a writer pid");
	if (kill((pid_t)h.writer_pid, 0) < 0 && errno == ESRCH)
		return v_set(v, AP_SHM_FATE_GONE, NULL);
	return v_set(v, AP_SHM_FATE_UNKNOWN, "an old layout, and a process here has its writer's pid");
}

/* fd is open on name in dfd, and st is its fstat (our regular file).
 * Lock it LOCK_EX | LOCK_NB, read and judge its header and, when GONE (or
 * UNREADABLE, if remove says so), unlink the name while still holding the lock if the name still
 * names that object. The caller closes fd (which drops the lock). Reads
 * the header with pread, never maps it: the object may be truncated under
 * us. */
enum ap_shm_fate shm_judge_at(int dfd, const char *name, int fd, const struct stat *st, int remove,
			      struct ap_shm_swept *s)
{
	struct ap_shm_hdr h;
	struct stat again;
	ssize_t n;
	int held = 0;

	if (flock(fd, LOCK_EX | LOCK_NB) < 0) {
		if (errno != EWOULDBLOCK) {
			s->err = errno;
			return v_set(&s->v, AP_SHM_FATE_UNREADABLE, "cannot lock it");
		}
		held = 1;
	}
	n = pread(fd, &h, sizeof h, 0);
	if (n < 0) {
		s->err = errno;
		return v_set(&s->v, AP_SHM_FATE_UNREADABLE, "cannot read it");
	}
	ap_shm_judge(&h, (size_t)n, held, &s->v);
	if (!(s->v.fate == AP_SHM_FATE_GONE && remove) &&
	    !(s->v.fate == AP_SHM_FATE_UNREADABLE && !held && remove == REMOVE_UNREADABLE))
		return s->v.fate;
	/* Under LOCK_EX: whoever replaced the object under this name since
	 * we opened it did so before we locked, and the name names theirs. */
	if (fstatat(dfd, name, &again, AT_SYMLINK_NOFOLLOW) < 0)
		s->err = errno;
	else if (again.st_ino != st->st_ino || again.st_dev != st->st_dev)
		s->err = ESTALE;
	else if (unlinkat(dfd, name, 0) < 0)
		s->err = errno;
	else
		s->removed = 1;
	return s->v.fate;
}

/* Open name in dfd for judging: never follows a symlink nor blocks on a
 * FIFO, and must be the object pre (an fstatat of the name, or NULL)
 * described. Returns the fd, or -1 with s->err set. */
static int open_judged(int dfd, const char *name, const struct stat *pre, struct stat *st, struct ap_shm_swept *s)
{
	int fd = openat(dfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);

	if (fd < 0) {
		s->err = errno;
		return -1;
	}
	if (fstat(fd, st) < 0) {
		s->err = errno;
	} else if (!ours(st)) {
		s->err = EPERM;
	} else if (pre && (pre->st_ino != st->st_ino || pre->st_dev != st->st_dev)) {
		s->err = ESTALE;
	} else {
		return fd;
	}
	close(fd);
	return -1;
}

int ap_shm_remove(const char *dir, const char *name, struct ap_shm_verdict *v)
{
	struct ap_shm_swept s = { .name = name };
	struct stat st;
	int dfd, fd, rc;

	if (v)
		memset(v, 0, sizeof *v);
	if (!name || !name[0] || strchr(name, '/') || !strcmp(name, ".") || !strcmp(name, ".."))
		return -EINVAL;
	dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (dfd < 0)
		return -errno;
	fd = open_judged(dfd, name, NULL, &st, &s);
	if (fd < 0) {
		close(dfd);
		/* ELOOP: a symlink (O_NOFOLLOW); ENXIO: a FIFO or socket. */
		return s.err == ELOOP || s.err == ENXIO ? -EPERM : -s.err;
	}
	shm_judge_at(dfd, name, fd, &st, REMOVE_GONE, &s);
	close(fd);
	close(dfd);
	if (v)
		*v = s.v;
	if (s.removed)
		return 0;
	switch (s.v.fate) {
	case AP_SHM_FATE_LIVE:
	case AP_SHM_FATE_UNKNOWN:
		return -EBUSY;
	case AP_SHM_FATE_UNREADABLE:
		rc = s.err ? -s.err : -EPROTO;
		return rc;
	default:
		return s.err ? -s.err : -EIO;
	}
}

int ap_shm_sweep(const char *dir, const char *prefix, const char *skip, ap_shm_sweep_fn fn, void *arg,
		 struct ap_shm_sweep_sum *sum)
{
	struct ap_shm_sweep_sum t = { 0 };
	size_t plen = strlen(prefix);
	struct dirent *de;
	DIR *d;

	d = opendir(dir);
	if (!d)
		return -errno;
	while ((de = readdir(d))) {
		struct ap_shm_swept s = { .name = de->d_name };
		struct stat pre, st;
		int fd;

		if (strncmp(de->d_name, prefix, plen) || (skip && !strcmp(de->d_name, skip)))
			continue;
		/* Cheap, and opens nothing: anybody can fill the directory
		 * with FIFOs, symlinks and files of their own, and none of
		 * them may cost us a place under the cap or a log line. */
		if (fstatat(dirfd(d), de->d_name, &pre, AT_SYMLINK_NOFOLLOW) < 0)
			continue; /* gone meanwhile */
		if (!ours(&pre)) {
			t.foreign++;
			continue;
		}
		if (t.judged >= AP_SHM_SWEEP_MAX) {
			t.capped = 1;
			break;
		}
		t.judged++;
		fd = open_judged(dirfd(d), de->d_name, &pre, &st, &s);
		if (fd < 0) {
			if (s.err == ENOENT || s.err == ESTALE)
				continue; /* removed or replaced since the fstatat */
			v_set(&s.v, AP_SHM_FATE_UNREADABLE, "cannot open it");
		} else {
			shm_judge_at(dirfd(d), de->d_name, fd, &st, REMOVE_GONE, &s);
			close(fd);
		}
		t.removed += (unsigned)s.removed;
		t.live += s.v.fate == AP_SHM_FATE_LIVE;
		t.v3_kept += s.v.fate == AP_SHM_FATE_UNKNOWN;
		if (fn)
			fn(arg, &s);
	}
	closedir(d);
	if (sum)
		*sum = t;
	return (int)t.removed;
}
