/* mmap_sandbox.h: the -D switches, constants and structs of mmap_sandbox.bpf.c:
 * the policy maps' keys and values that agent/probes/sandbox/policy.py writes,
 * and the per-call state. */
#ifndef MMAP_SANDBOX_H
#define MMAP_SANDBOX_H

#include "spanlet.h"

/* -D switches (agent/probes/sandbox/probe.py: SandboxProbe.cflags). */
#ifndef SANDBOX_MAX_POOL_FDS
#define SANDBOX_MAX_POOL_FDS 65536
#endif
#ifndef SANDBOX_MAX_PREFIX_ENTRIES
#define SANDBOX_MAX_PREFIX_ENTRIES 1024
#endif
#ifndef SANDBOX_MAX_POOLS
#define SANDBOX_MAX_POOLS 4096
#endif
#ifndef SANDBOX_MAX_GRANTS
#define SANDBOX_MAX_GRANTS 65536
#endif
#ifndef SANDBOX_MAX_JUDGED_MAPS
#define SANDBOX_MAX_JUDGED_MAPS 65536
#endif
/* Slots of the arrays that let an unrelated call skip a hash lookup: by
 * thread id (a call of this thread left state for its exit) and by tgid (the
 * process may have pool fds). Powers of two. */
#ifndef SANDBOX_SLOTS
#define SANDBOX_SLOTS 65536
#endif
/* Deepest cgroup level whose grant still covers a process below it. */
#ifndef SANDBOX_CGROUP_DEPTH
#define SANDBOX_CGROUP_DEPTH 16
#endif
/* SANDBOX_ENFORCE: kill offenders instead of only reporting them. */

#define SANDBOX_PATH_MAX 256 /* LPM_DATA_SIZE_MAX: longest LPM trie key */

/* The open's early return: its first SANDBOX_HEAD_LEN bytes are compared with
 * the first bytes of each prefix (at most SANDBOX_MAX_HEADS, the config's
 * limit on prefixes) before any other string work. */
#define SANDBOX_HEAD_LEN 16
#define SANDBOX_MAX_HEADS 8

struct sandbox_heads {
    __u64 value[SANDBOX_MAX_HEADS * 2]; /* the prefix's first bytes, as two words each */
    __u64 mask[SANDBOX_MAX_HEADS * 2];  /* which bytes count (0: no head here) */
};

/* What a prefix entry of the trie is: a real prefix (whose unlisted files
 * are pools without grants), or a directory above one ("/dev/", "/dev/shm/"),
 * which says "this path may name a pool once '//' and '/./' are removed, if
 * such a sequence follows right here": a path whose next byte is a name byte
 * would have matched a longer entry if it led to a prefix. */
#define SANDBOX_PREFIX_FULL 1
#define SANDBOX_PREFIX_PARTIAL 2

#define SANDBOX_GRANT_PID 1
#define SANDBOX_GRANT_CGROUP 2
#define SANDBOX_ACCESS_RO 1
#define SANDBOX_ACCESS_RW 2

struct sandbox_path {
    char path[SANDBOX_PATH_MAX];
};

struct sandbox_lpm_key {
    __u32 prefixlen; /* bits */
    struct sandbox_path p;
};

struct sandbox_prefix {
    __u32 kind;
    __u32 unlisted_pool_id; /* pool id of a file under it that is no pool */
    __u32 len;              /* bytes of the entry */
};

/* A pool as the open found it, carried to mmap through the fd. In
 * sandbox_pools, pool id 0 is an alias that leads to no pool (a symlink under
 * a prefix pointing elsewhere): such a path is not tracked. */
struct sandbox_pool_ref {
    __u32 pool_id;
    __u32 _pad;
    __u64 max_bytes;
};

struct sandbox_fd_key {
    __u32 tgid;
    __s32 fd;
};

struct sandbox_grant_key {
    __u32 pool_id;
    __u32 kind; /* SANDBOX_GRANT_PID or SANDBOX_GRANT_CGROUP */
    __u64 id;   /* tgid or cgroup id */
};

struct sandbox_violation_key {
    __u64 cgroup_id;
    __u8 rule;
    __u8 action;
    __u8 _pad[6];
};

/* Per-CPU scratch of the open calls: the path as read, the normalised path, and the
 * normaliser's cursor. The cursor lives in map memory and is read with
 * volatile loads so that the verifier sees it as unknown and prunes the
 * loop's states; kept in registers, every byte forks the states in two. */
struct sandbox_scratch {
    struct sandbox_lpm_key raw;
    struct sandbox_lpm_key norm;
    __u32 out;
    __u8 prev;
    __u8 dotdot;   /* the path has a '..' component */
    __u8 _pad[2];
};

/* A pool mapping the mmap check judged, by where it landed: the agent's sweep
 * of /proc/<pid>/maps judges only the pool mappings not found here (made
 * through an fd this program did not know), or found here with more
 * permissions now than they were judged with (mprotect). */
struct sandbox_map_key {
    __u32 tgid;
    __u32 _pad;
    __u64 addr;
};

struct sandbox_judged {
    __u64 len;
    __u32 pool_id;
    __u32 prot;
    __u32 flags;
    __u8 rule;
    __u8 _pad[3];
};

/* What a call left for its exit, by thread: a pool mmap judged at the call,
 * or an mmap of an fd the sandbox does not know (`unknown`), to be noticed
 * with the address it returns. */
struct sandbox_pending_map {
    struct sandbox_judged judged;
    __u64 off;
    __s32 fd;
    __u32 unknown;
};

/* Notices to the agent (agent/probes/sandbox/probe.py: Notice): what happened
 * that the path match at open could not judge, for the agent to resolve from
 * /proc at once. */
#define SANDBOX_NOTICE_MMAP 1    /* an mmap of an fd the sandbox did not know */
#define SANDBOX_NOTICE_CHANGE 2  /* mprotect/mremap by a process that maps pools */
#define SANDBOX_NOTICE_FORK 3    /* a process that maps pools forked (addr: the parent) */

struct sandbox_notice {
    __u32 kind;
    __u32 tgid;
    __s32 fd;
    __u32 prot;
    __u64 addr;
    __u64 len;
    __u64 off;
    __u32 flags;
    __u32 _pad;
};

#endif /* MMAP_SANDBOX_H */
