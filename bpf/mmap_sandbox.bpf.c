/* mmap_sandbox.bpf.c: the tensor-pool sandbox. Remembers which fds name a
 * pool file (openat, and open/openat2 where they exist), checks every mmap of
 * such an fd against the policy the agent pushed into the maps, and reports
 * (audit) or kills (enforce) offenders.
 *
 * Syscall tracepoints only (no kprobes/LSM on the target kernels), so the
 * sandbox sees what a process *asked* for, by path string and fd number.
 * What the path string cannot judge is noticed when it happens and resolved
 * by the agent from /proc at once (agent/probes/sandbox/probe.py), by inode:
 *  - a pool is recognised at open by the path string. Paths are normalised
 *    for repeated '/' and '.' components only. Paths relative to a dirfd or
 *    the cwd and symlinks are not resolved here; the agent writes the
 *    symlinks and hard links it finds under a prefix into sandbox_pools as
 *    aliases (pool id 0: leads to no pool). A path under a prefix with a '..'
 *    component cannot be judged from its string: its fd is not tracked
 *    (counted in spanlet_sandbox_unresolved_opens_total);
 *  - so every file mmap of an fd this program does not know as a pool's
 *    (opened one of those ways, inherited across fork, dup*, fcntl F_DUPFD,
 *    SCM_RIGHTS, io_uring...) is sent as a notice (sandbox_notices) with the
 *    address it returned; the agent stats the mapping and the fd, judges a
 *    pool mapping by the same rules, and hands the fd to sandbox_pool_fds so
 *    that its next mmap is judged here. A second mmap of the same fd before
 *    the agent read the first notice is only counted (sandbox_unknown_fds):
 *    the agent then reads that process's maps. A "not a pool" answer is never
 *    kept here: an fd number can get another file in ways no tracepoint here
 *    shows;
 *  - mprotect/pkey_mprotect adding write or exec, and mremap, by a process
 *    known to map a pool (sandbox_pool_procs), and forks of such a process,
 *    are noticed too: the agent reads that process's maps;
 *  - fds dropped without close(2) (close_range, exec closing O_CLOEXEC fds,
 *    dup2 over them, process exit) are forgotten by the agent's refresh, not
 *    here; 32-bit compat syscalls are not traced at all;
 *  - in enforce mode the mmap itself completes; SIGKILL is delivered before
 *    the offender returns to user space, so it never touches the mapping.
 *    What a notice shows is killed by the agent, as soon as it resolved it.
 * Unrelated processes pay: per open, a 17-byte read of the path compared with
 * the prefixes' first bytes (paths that could need normalising there, or that
 * start like a prefix, take the full path read and LPM lookup), and an array
 * read at its exit; an array read per close; per file mmap a failed hash
 * lookup (a notice for an fd new to it) and an array read at its exit. */
#include <uapi/linux/mman.h>
#include "spanlet.h"
#include "mmap_sandbox.h"

#ifndef SANDBOX_NOTICE_PAGES
#define SANDBOX_NOTICE_PAGES 16
#endif

BPF_ARRAY(sandbox_heads, struct sandbox_heads, 1);
BPF_LPM_TRIE(sandbox_prefixes, struct sandbox_lpm_key, struct sandbox_prefix, SANDBOX_MAX_PREFIX_ENTRIES);
BPF_HASH(sandbox_pools, struct sandbox_path, struct sandbox_pool_ref, SANDBOX_MAX_POOLS);
BPF_HASH(sandbox_grants, struct sandbox_grant_key, __u8, SANDBOX_MAX_GRANTS);
BPF_HASH(sandbox_pool_fds, struct sandbox_fd_key, struct sandbox_pool_ref, SANDBOX_MAX_POOL_FDS);
/* Pool opens between entry and exit of the open call, by thread. */
BPF_HASH(sandbox_pending_opens, __u64, struct sandbox_pool_ref, 16384);
BPF_PERCPU_ARRAY(sandbox_scratch_buf, struct sandbox_scratch, 1);
/* Pool mmaps between entry and exit of the call, by thread. */
BPF_HASH(sandbox_pending_maps, __u64, struct sandbox_pending_map, 16384);
BPF_TABLE("lru_hash", struct sandbox_map_key, struct sandbox_judged, sandbox_judged_maps,
          SANDBOX_MAX_JUDGED_MAPS);
/* Calls of this thread slot that left state for their exit (counted, so that
 * two threads sharing a slot only cost each other a lookup). */
BPF_ARRAY(sandbox_thread_slots, __u32, SANDBOX_SLOTS);
/* Non-zero: a process of this tgid slot may have pool fds (written before
 * any entry of sandbox_pool_fds, by this program and by the agent). */
BPF_ARRAY(sandbox_proc_slots, __u32, SANDBOX_SLOTS);
/* Unknown fds noticed and not yet read by the agent: mmaps of them since. */
BPF_HASH(sandbox_unknown_fds, struct sandbox_fd_key, __u32, 4096);
/* Processes that map a pool (written here at a pool mmap, and by the agent). */
BPF_HASH(sandbox_pool_procs, __u32, __u8, 16384);
/* mprotect/mremap of those between entry and exit, by thread. */
BPF_HASH(sandbox_pending_changes, __u64, __u32, 16384);
/* Changes noticed and not yet read by the agent: changes since, by tgid. */
BPF_HASH(sandbox_changed_procs, __u32, __u32, 4096);
BPF_RINGBUF_OUTPUT(sandbox_notices, SANDBOX_NOTICE_PAGES);
/* Notices that did not fit in sandbox_notices (the agent then sweeps). */
BPF_PERCPU_ARRAY(sandbox_lost_notices, __u64, 1);
/* Opens of a path under a prefix with a '..' component (not tracked). */
BPF_PERCPU_ARRAY(spanlet_sandbox_unresolved_opens_total, __u64, 1);
/* Metric 5, keyed by the offender's cgroup, rule and action; not
 * preallocated: a value per CPU for each key seen, not 16384 from the start. */
BPF_F_TABLE("percpu_hash", struct sandbox_violation_key, __u64, spanlet_sandbox_violations_total,
            16384, BPF_F_NO_PREALLOC);
/* Pool fds that could not be remembered because sandbox_pool_fds was full. */
BPF_PERCPU_ARRAY(spanlet_sandbox_untracked_fds_total, __u64, 1);

/* Copy s->raw into s->norm without repeated '/' and without '.' components
 * (agent/probes/sandbox/policy.py: normalise_path is the same rule in Python). */
static __always_inline void sandbox_normalise(struct sandbox_scratch *s, __u32 len)
{
    __builtin_memset(&s->norm.p, 0, sizeof(s->norm.p));
    s->out = 0;
    s->prev = 0;
    s->dotdot = 0;
    for (__u32 i = 0; i < SANDBOX_PATH_MAX - 1; i++) {
        if (i >= len)
            break;
        char c = s->raw.p.path[i];
        __u8 prev = *(volatile __u8 *)&s->prev;
        if (c == '/' && prev == '/')
            continue;
        if (c == '.' && prev == '/') {
            char next = i + 1 < len ? s->raw.p.path[(i + 1) & (SANDBOX_PATH_MAX - 1)] : 0;
            if (next == '/' || next == 0)
                continue; /* the '/' that follows collapses into the last one */
            char after = i + 2 < len ? s->raw.p.path[(i + 2) & (SANDBOX_PATH_MAX - 1)] : 0;
            if (next == '.' && (after == '/' || after == 0))
                *(volatile __u8 *)&s->dotdot = 1; /* kept as it is: see sandbox_open_enter */
        }
        __u32 o = *(volatile __u32 *)&s->out;
        s->norm.p.path[o & (SANDBOX_PATH_MAX - 1)] = c;
        s->out = o + 1;
        s->prev = c;
    }
    s->norm.prefixlen = (s->out & (SANDBOX_PATH_MAX - 1)) * 8;
}

/* Slot helpers: the counter of this thread's slot, and the flag of this
 * process's slot (array reads, which the verifier inlines). */
static __always_inline __u32 *sandbox_thread_slot(__u64 pid_tgid)
{
    __u32 i = (__u32)pid_tgid & (SANDBOX_SLOTS - 1);
    return sandbox_thread_slots.lookup(&i);
}

static __always_inline int sandbox_may_have_pool_fds(__u32 tgid)
{
    __u32 i = tgid & (SANDBOX_SLOTS - 1);
    __u32 *v = sandbox_proc_slots.lookup(&i);
    return v && *v;
}

static __always_inline void sandbox_mark_proc_slot(__u32 tgid)
{
    __u32 i = tgid & (SANDBOX_SLOTS - 1);
    __u32 *v = sandbox_proc_slots.lookup(&i);
    if (v && !*v)
        *v = 1;
}

/* State for this thread's exit was stored (pending) or taken (done). */
static __always_inline void sandbox_slot_add(__u64 pid_tgid, int d)
{
    __u32 *slot = sandbox_thread_slot(pid_tgid);
    if (slot)
        __sync_fetch_and_add(slot, d);
}

static __always_inline int sandbox_slot_busy(__u64 pid_tgid)
{
    __u32 *slot = sandbox_thread_slot(pid_tgid);
    return slot && *slot;
}

/* 0x80 in each byte of w that is c, 0 elsewhere (exact, no borrow between bytes). */
static __always_inline __u64 sandbox_bytes_eq(__u64 w, __u64 c)
{
    const __u64 low7 = 0x7f7f7f7f7f7f7f7fULL;
    __u64 x = w ^ (c * 0x0101010101010101ULL);
    return ~(((x & low7) + low7) | x | low7);
}

/* The early return of an open: can this path be under a prefix? Only if its
 * first SANDBOX_HEAD_LEN bytes start like one, or hold a "//" or "/." that
 * normalising may remove (then they are not what the normalised path starts
 * with). A relative path never matches a prefix by its string. */
static __always_inline int sandbox_head_may_match(const char *filename)
{
    __u64 w[3] = {};
    long n = bpf_probe_read_user_str(w, SANDBOX_HEAD_LEN + 1, filename);
    if (n <= 1 || (w[0] & 0xff) != '/')
        return 0;
    /* a '/' followed by '/' or '.', within the 16 bytes (little endian: the
     * next byte is the next 8 bits up) */
    __u64 s0 = sandbox_bytes_eq(w[0], '/'), s1 = sandbox_bytes_eq(w[1], '/');
    __u64 f0 = s0 | sandbox_bytes_eq(w[0], '.'), f1 = s1 | sandbox_bytes_eq(w[1], '.');
    if (((s0 << 8) & f0) | ((s1 << 8) & f1) | ((s0 >> 56) & f1))
        return 1;
    int zero = 0;
    struct sandbox_heads *h = sandbox_heads.lookup(&zero);
    if (!h)
        return 1;
#pragma unroll
    for (int i = 0; i < SANDBOX_MAX_HEADS; i++) {
        if (!h->mask[2 * i])
            break;
        if ((w[0] & h->mask[2 * i]) == h->value[2 * i] &&
            (w[1] & h->mask[2 * i + 1]) == h->value[2 * i + 1])
            return 1;
    }
    return 0;
}

/* Entry of an open: is this path a pool? Most paths leave at the first bytes. */
static __always_inline int sandbox_open_enter(const char *filename)
{
    if (!sandbox_head_may_match(filename))
        return 0;
    int zero = 0;
    struct sandbox_scratch *s = sandbox_scratch_buf.lookup(&zero);
    if (!s)
        return 0;
    long n = bpf_probe_read_user_str(s->raw.p.path, sizeof(s->raw.p.path), filename);
    if (n <= 1)
        return 0;
    __u32 len = (__u32)(n - 1) & (SANDBOX_PATH_MAX - 1);
    s->raw.prefixlen = len * 8;
    struct sandbox_prefix *m = sandbox_prefixes.lookup(&s->raw);
    if (!m || m->kind == SANDBOX_PREFIX_PARTIAL) {
        /* Only '/' or '.' right after the deepest directory matched (the root
         * when none) can lead to a prefix that the raw path does not show. */
        __u32 at = m ? m->len : 1;
        char c = s->raw.p.path[at & (SANDBOX_PATH_MAX - 1)];
        if (s->raw.p.path[0] != '/' || at >= len || (c != '/' && c != '.'))
            return 0;
    }
    sandbox_normalise(s, len);
    m = sandbox_prefixes.lookup(&s->norm);
    if (!m || m->kind != SANDBOX_PREFIX_FULL)
        return 0;
    if (*(volatile __u8 *)&s->dotdot) {
        /* Which file '..' leads to depends on what the components before it
         * are (symlinks); judged wrong, a granted process would be reported or
         * killed. Its fd is unknown here: its mmap is noticed. */
        int zero = 0;
        __u64 *n = spanlet_sandbox_unresolved_opens_total.lookup(&zero);
        if (n)
            *n += 1;
        return 0;
    }
    struct sandbox_pool_ref ref = {};
    struct sandbox_pool_ref *pool = sandbox_pools.lookup(&s->norm.p);
    if (pool) {
        if (!pool->pool_id)
            return 0; /* an alias that leads to no pool */
        ref = *pool;
    } else {
        ref.pool_id = m->unlisted_pool_id;
        ref.max_bytes = 0;
    }
    __u64 pid_tgid = bpf_get_current_pid_tgid();
    if (sandbox_pending_opens.update(&pid_tgid, &ref) == 0)
        sandbox_slot_add(pid_tgid, 1);
    return 0;
}

/* A delete takes the bucket lock even for an absent key; the lookup does not,
 * and nearly every fd is absent. */
static __always_inline void sandbox_forget_fd(struct sandbox_fd_key *key)
{
    if (sandbox_may_have_pool_fds(key->tgid) && sandbox_pool_fds.lookup(key))
        sandbox_pool_fds.delete(key);
}

/* Exit of an open: the fd of a pool open; any other new fd number forgets a
 * stale pool entry it may have reused (e.g. after an exec closed O_CLOEXEC fds). */
static __always_inline int sandbox_open_exit(long ret)
{
    __u64 pid_tgid = bpf_get_current_pid_tgid();
    struct sandbox_fd_key key = {.tgid = pid_tgid >> 32, .fd = (__s32)ret};
    struct sandbox_pool_ref *ref = 0;
    if (sandbox_slot_busy(pid_tgid))
        ref = sandbox_pending_opens.lookup(&pid_tgid);
    if (!ref) {
        if (ret >= 0)
            sandbox_forget_fd(&key);
        return 0;
    }
    if (ret >= 0) {
        sandbox_mark_proc_slot(key.tgid);
        if (sandbox_pool_fds.update(&key, ref) != 0) {
            int zero = 0;
            __u64 *n = spanlet_sandbox_untracked_fds_total.lookup(&zero);
            if (n)
                *n += 1;
        }
    }
    sandbox_pending_opens.delete(&pid_tgid);
    sandbox_slot_add(pid_tgid, -1);
    return 0;
}

/* The programs, named sbx_* in `bpftool prog show`. openat is always there;
 * open (not on arm64) and openat2 (5.6+) are compiled in where the agent found
 * their tracepoints, so that a direct syscall cannot walk around openat. */
int sbx_openat_in(struct tracepoint__syscalls__sys_enter_openat *args)
{
    return sandbox_open_enter(args->filename);
}

int sbx_openat_out(struct tracepoint__syscalls__sys_exit_openat *args)
{
    return sandbox_open_exit(args->ret);
}

/* The enter/exit pair of another opening syscall that has a `filename`
 * argument, attached by the loader where the tracepoint exists. */
#define SANDBOX_OPEN_SYSCALL(sc)                                                \
    int sbx_##sc##_in(struct tracepoint__syscalls__sys_enter_##sc *args)    \
    {                                                                         \
        return sandbox_open_enter(args->filename);                            \
    }                                                                         \
    int sbx_##sc##_out(struct tracepoint__syscalls__sys_exit_##sc *args)    \
    {                                                                         \
        return sandbox_open_exit(args->ret);                                  \
    }

#ifdef SANDBOX_TP_OPENAT2
SANDBOX_OPEN_SYSCALL(openat2)
#endif

#ifdef SANDBOX_TP_OPEN
SANDBOX_OPEN_SYSCALL(open)
#endif

int sbx_close(struct tracepoint__syscalls__sys_enter_close *args)
{
    struct sandbox_fd_key key = {
        .tgid = bpf_get_current_pid_tgid() >> 32,
        .fd = (__s32)args->fd,
    };
    sandbox_forget_fd(&key);
    return 0;
}

static __always_inline __u8 sandbox_grant(__u32 pool_id, __u32 kind, __u64 id)
{
    struct sandbox_grant_key key = {.pool_id = pool_id, .kind = kind, .id = id};
    __u8 *access = sandbox_grants.lookup(&key);
    return access ? *access : 0;
}

/* The widest access any grant gives the current process: by its tgid, by its
 * cgroup, or by any ancestor cgroup (a pod's grant covers its containers). */
static __always_inline __u8 sandbox_access(__u32 pool_id, __u32 tgid)
{
    __u8 best = sandbox_grant(pool_id, SANDBOX_GRANT_PID, tgid);
    for (int level = 0; level <= SANDBOX_CGROUP_DEPTH; level++) {
        if (best == SANDBOX_ACCESS_RW)
            break;
        __u64 cg = bpf_get_current_ancestor_cgroup_id(level);
        if (cg == 0)
            break; /* past the current cgroup */
        __u8 a = sandbox_grant(pool_id, SANDBOX_GRANT_CGROUP, cg);
        if (a > best)
            best = a;
    }
    return best;
}

/* The first rule broken, in this order (0: none):
 *  unauthorized > write_on_readonly > exec > oversize.
 * No grant makes every other question moot; a write through a read-only
 * grant is the breach of the pool's contents, so it outranks the executable
 * mapping, and size comes last because it only matters for a mapping that is
 * otherwise allowed. A writable MAP_PRIVATE mapping is copy-on-write: its
 * writes never reach the pool, so a read-only grant allows it. */
static __always_inline __u8 sandbox_rule(__u8 access, __u64 prot, __u64 flags,
                                         __u64 len, __u64 off, __u64 max_bytes)
{
    __u64 type = flags & MAP_TYPE;
    int shared = type == MAP_SHARED || type == MAP_SHARED_VALIDATE;
    if (access == 0)
        return SPANLET_RULE_UNAUTHORIZED;
    if (access == SANDBOX_ACCESS_RO && (prot & PROT_WRITE) && shared)
        return SPANLET_RULE_WRITE_ON_READONLY;
    if (prot & PROT_EXEC)
        return SPANLET_RULE_EXEC;
    if (max_bytes && (len > max_bytes || off > max_bytes - len))
        return SPANLET_RULE_OVERSIZE;
    return 0;
}

#ifdef SANDBOX_ENFORCE
#define SANDBOX_ACTION SPANLET_ACTION_KILL
#else
#define SANDBOX_ACTION SPANLET_ACTION_AUDIT
#endif

static __always_inline void sandbox_count_lost(void)
{
    int zero = 0;
    __u64 *n = sandbox_lost_notices.lookup(&zero);
    if (n)
        *n += 1;
}

/* -1 when it did not fit (counted). */
static __always_inline int sandbox_notice(__u32 kind, __u32 tgid, __s32 fd, __u64 addr,
                                          __u64 len, __u64 off, __u32 prot, __u32 flags)
{
    struct sandbox_notice *n = sandbox_notices.ringbuf_reserve(sizeof(*n));
    if (!n) {
        sandbox_count_lost();
        return -1;
    }
    n->kind = kind;
    n->tgid = tgid;
    n->fd = fd;
    n->prot = prot;
    n->addr = addr;
    n->len = len;
    n->off = off;
    n->flags = flags;
    n->_pad = 0;
    sandbox_notices.ringbuf_submit(n, 0);
    return 0;
}

/* An mmap of an fd not known as a pool's: noticed at its exit (with the
 * address), unless a notice of this fd is still unread (then counted). */
static __always_inline int sandbox_unknown_mmap(__u64 pid_tgid, struct sandbox_fd_key *key,
                                                __u64 len, __u64 prot, __u64 flags, __u64 off)
{
    __u32 *count = sandbox_unknown_fds.lookup(key);
    if (count) {
        __sync_fetch_and_add(count, 1);
        return 0;
    }
    __u32 one = 1;
    sandbox_unknown_fds.update(key, &one); /* full: every mmap is noticed */
    struct sandbox_pending_map p = {};
    p.judged.len = len;
    p.judged.prot = (__u32)prot;
    p.judged.flags = (__u32)flags;
    p.off = off;
    p.fd = key->fd;
    p.unknown = 1;
    if (sandbox_pending_maps.update(&pid_tgid, &p) == 0)
        sandbox_slot_add(pid_tgid, 1);
    else
        sandbox_unknown_fds.delete(key);
    return 0;
}

int sbx_mmap(struct tracepoint__syscalls__sys_enter_mmap *args)
{
    __u64 flags = args->flags;
    if (flags & MAP_ANONYMOUS)
        return 0;
    __u64 pid_tgid = bpf_get_current_pid_tgid();
    struct sandbox_fd_key key = {.tgid = pid_tgid >> 32, .fd = (__s32)args->fd};
    if (key.fd < 0)
        return 0; /* fails: EBADF */
    struct sandbox_pool_ref *ref = 0;
    if (sandbox_may_have_pool_fds(key.tgid))
        ref = sandbox_pool_fds.lookup(&key);
    if (!ref)
        return sandbox_unknown_mmap(pid_tgid, &key, args->len, args->prot, flags, args->off);

    __u32 pool_id = ref->pool_id;
    __u64 max_bytes = ref->max_bytes;
    __u64 prot = args->prot, len = args->len, off = args->off;
    __u8 rule = sandbox_rule(sandbox_access(pool_id, key.tgid), prot, flags, len, off, max_bytes);
    struct sandbox_pending_map pending = {
        .judged = {.len = len, .pool_id = pool_id, .prot = (__u32)prot, .flags = (__u32)flags,
                   .rule = rule},
        .off = off, .fd = key.fd};
    if (sandbox_pending_maps.update(&pid_tgid, &pending) == 0)
        sandbox_slot_add(pid_tgid, 1);
    if (!rule)
        return 0;
#ifdef SANDBOX_ENFORCE
    bpf_send_signal(9);
#endif
    struct sandbox_violation_key vk = {
        .cgroup_id = bpf_get_current_cgroup_id(),
        .rule = rule,
        .action = SANDBOX_ACTION,
    };
    __u64 zero = 0;
    __u64 *count = spanlet_sandbox_violations_total.lookup_or_try_init(&vk, &zero);
    if (count)
        __sync_fetch_and_add(count, 1);
    struct span_ctx_val *span = spanlet_current_span();
    struct span_facts_val *row = span ? spanlet_span_row(span) : 0;
    if (row)
        __sync_fetch_and_add(&row->violations, 1);
    if (!spanlet_cgroup_may_send())
        return 0;   /* counted above; only the record is bounded */

    struct sandbox_event *ev = events.ringbuf_reserve(sizeof(*ev));
    if (!ev) {
        spanlet_count_drop();
        return 0;
    }
    spanlet_fill_task_hdr(&ev->hdr, SPANLET_KIND_SANDBOX);
    ev->addr = args->addr;
    ev->len = len;
    ev->pool_max_bytes = max_bytes;
    ev->prot = (__u32)prot;
    ev->flags = (__u32)flags;
    ev->pool_id = pool_id;
    ev->fd = key.fd;
    ev->rule = rule;
    ev->action = SANDBOX_ACTION;
    __builtin_memset(ev->_pad, 0, sizeof(ev->_pad));
    events.ringbuf_submit(ev, 0);
    return 0;
}

/* Exit of every mmap: where a judged pool mapping landed, or the notice of
 * an unknown fd's. */
int sbx_mmap_out(struct tracepoint__syscalls__sys_exit_mmap *args)
{
    __u64 pid_tgid = bpf_get_current_pid_tgid();
    if (!sandbox_slot_busy(pid_tgid))
        return 0;
    struct sandbox_pending_map *p = sandbox_pending_maps.lookup(&pid_tgid);
    if (!p)
        return 0;
    struct sandbox_pending_map got = *p;
    sandbox_pending_maps.delete(&pid_tgid);
    sandbox_slot_add(pid_tgid, -1);
    __u32 tgid = pid_tgid >> 32;
    long ret = args->ret;
    int failed = ret < 0 && ret > -4096; /* an error, not an address */
    if (got.unknown) {
        struct sandbox_fd_key key = {.tgid = tgid, .fd = got.fd};
        if (failed) {
            sandbox_unknown_fds.delete(&key);
            return 0;
        }
        if (sandbox_notice(SANDBOX_NOTICE_MMAP, tgid, got.fd, (__u64)ret, got.judged.len,
                           got.off, got.judged.prot, got.judged.flags) != 0)
            sandbox_unknown_fds.delete(&key); /* the next mmap tries again */
        return 0;
    }
    if (failed)
        return 0;
    struct sandbox_map_key key = {.tgid = tgid, .addr = (__u64)ret};
    sandbox_judged_maps.update(&key, &got.judged);
    __u8 one = 1;
    sandbox_pool_procs.update(&tgid, &one);
    return 0;
}

/* mprotect (adding write or exec) and mremap of a process that maps a pool:
 * noticed at the exit, once until the agent read it. */
static __always_inline int sandbox_change_enter(void)
{
    __u64 pid_tgid = bpf_get_current_pid_tgid();
    __u32 tgid = pid_tgid >> 32;
    if (!sandbox_pool_procs.lookup(&tgid))
        return 0;
    __u32 one = 1;
    if (sandbox_pending_changes.update(&pid_tgid, &one) == 0)
        sandbox_slot_add(pid_tgid, 1);
    return 0;
}

static __always_inline int sandbox_change_exit(long ret)
{
    __u64 pid_tgid = bpf_get_current_pid_tgid();
    if (!sandbox_slot_busy(pid_tgid) || !sandbox_pending_changes.lookup(&pid_tgid))
        return 0;
    sandbox_pending_changes.delete(&pid_tgid);
    sandbox_slot_add(pid_tgid, -1);
    if (ret < 0 && ret > -4096)
        return 0;
    __u32 tgid = pid_tgid >> 32;
    __u32 *count = sandbox_changed_procs.lookup(&tgid);
    if (count) {
        __sync_fetch_and_add(count, 1);
        return 0;
    }
    __u32 one = 1;
    sandbox_changed_procs.update(&tgid, &one);
    sandbox_notice(SANDBOX_NOTICE_CHANGE, tgid, -1, 0, 0, 0, 0, 0);
    return 0;
}

/* Programs named sbx_<name>_in/_out: a program name has at most 15 bytes. */
#define SANDBOX_CHANGE_SYSCALL(sc, name, test)                                  \
    int sbx_##name##_in(struct tracepoint__syscalls__sys_enter_##sc *args)  \
    {                                                                         \
        if (!(test))                                                          \
            return 0;                                                         \
        return sandbox_change_enter();                                        \
    }                                                                         \
    int sbx_##name##_out(struct tracepoint__syscalls__sys_exit_##sc *args)  \
    {                                                                         \
        return sandbox_change_exit(args->ret);                                \
    }

SANDBOX_CHANGE_SYSCALL(mprotect, mprot, args->prot & (PROT_WRITE | PROT_EXEC))
SANDBOX_CHANGE_SYSCALL(mremap, mremap, 1)
#ifdef SANDBOX_TP_PKEY_MPROTECT
SANDBOX_CHANGE_SYSCALL(pkey_mprotect, pkey, args->prot & (PROT_WRITE | PROT_EXEC))
#endif

/* A fork of a process that maps a pool: the child holds the mappings now. */
int sbx_fork(struct tracepoint__sched__sched_process_fork *args)
{
    __u32 parent = bpf_get_current_pid_tgid() >> 32;
    if (!sandbox_pool_procs.lookup(&parent))
        return 0;
    __u32 child = (__u32)args->child_pid;
    __u8 one = 1;
    sandbox_pool_procs.update(&child, &one);
    sandbox_notice(SANDBOX_NOTICE_FORK, child, -1, parent, 0, 0, 0, 0);
    return 0;
}
