/* sandbox_ll: Landlock's ABI beyond what this system's <linux/landlock.h>
 * declares (Debian 12's stops at ABI 2); the kernel is probed at run time
 * (ap_sb_probe), so these are only names for its bits. */
#ifndef AP_SANDBOX_LL_H
#define AP_SANDBOX_LL_H

#include <stdint.h>
#include <sys/syscall.h>

#ifndef SYS_landlock_create_ruleset
#define SYS_landlock_create_ruleset 444
#define SYS_landlock_add_rule 445
#define SYS_landlock_restrict_self 446
#endif

#define AP_LL_FS_TRUNCATE (1ULL << 14)  /* ABI 3 */
#define AP_LL_FS_IOCTL_DEV (1ULL << 15) /* ABI 5 */
#define AP_LL_NET_BIND_TCP (1ULL << 0)  /* ABI 4 */
#define AP_LL_NET_CONNECT_TCP (1ULL << 1)
#define AP_LL_SCOPE_ABSTRACT_UNIX_SOCKET (1ULL << 0) /* ABI 6 */
#define AP_LL_SCOPE_SIGNAL (1ULL << 1)

/* struct landlock_ruleset_attr as of ABI 6; a kernel is given the prefix
 * its ABI knows. */
struct ap_ll_ruleset_attr {
	uint64_t handled_access_fs;
	uint64_t handled_access_net;
	uint64_t scoped;
};

/* The filesystem rights an ABI handles: every one of them, so that
 * whatever is not granted is denied. */
static inline uint64_t ap_ll_fs_rights(int abi)
{
	uint64_t r = (1ULL << 13) - 1; /* ABI 1: EXECUTE .. MAKE_SYM */
	if (abi >= 2)
		r |= 1ULL << 13; /* REFER */
	if (abi >= 3)
		r |= AP_LL_FS_TRUNCATE;
	if (abi >= 5)
		r |= AP_LL_FS_IOCTL_DEV;
	return r;
}

#endif
