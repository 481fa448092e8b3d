/* span_ctx.bpf.c: owner of the per-thread span context map (tid → trace id,
 * span id, modality) and of the span facts maps the other programs write
 * (span_facts.bpf.h): it makes them and libbpf pins them by name in the
 * agent's pin folder, where the other programs open them. A uprobe on the
 * client's spanlet_mark() fills the context on every span start and end.
 * Loaded first. A CO-RE object (libbpf C), built with the package. */
#include "core.h"
#include "span_facts.bpf.h"

char LICENSE[] SEC("license") = "GPL";

/* Settings (the agent sets them before load; the programs a setting turns
 * off are not loaded at all). */
const volatile bool otel_map_on = false;    /* span_context.otel_map: traces_ctx_v1 written */

SPANLET_MAP(BPF_MAP_TYPE_PERCPU_ARRAY, spanlet_span_marks_total, __u32, __u64, 1);
/* Marks no span can have (W3C: an all-zero trace id is invalid): the thread
 * is taken out of its span, as a mark with span id 0 would. */
SPANLET_MAP(BPF_MAP_TYPE_PERCPU_ARRAY, spanlet_span_marks_invalid_total, __u32, __u64, 1);

/* Processes whose spans are followed per thread only, by why (the follow
 * flags each of their marks carries in its modality's high 16 bits:
 * spanlet/runtimes.py): tgid -> flags; removed when the process exits. Named
 * after the metric it feeds. */
SPANLET_MAP(BPF_MAP_TYPE_LRU_HASH, spanlet_client_thread_only_processes, __u32, __u32, 4096);

/* Processes whose mapped libraries may have changed since library discovery
 * last looked (spanlet.discovery.MapsWatch drains it each refresh and reads
 * only these processes' maps between its slow full scans): an exec, a file
 * mapped executable (how the dynamic loader maps each library it loads, at
 * start and on dlopen), a process's exit. tgid → ktime of the last change. */
SPANLET_MAP(BPF_MAP_TYPE_LRU_HASH, maps_changed_pids, __u32, __u64, 16384);

#define SPANLET_PROT_EXEC 0x4        /* uapi/asm-generic/mman-common.h */
#define SPANLET_MAP_ANONYMOUS 0x20

static __always_inline void maps_changed(__u32 tgid)
{
    __u64 now = bpf_ktime_get_ns();
    bpf_map_update_elem(&maps_changed_pids, &tgid, &now, BPF_ANY);
}

SEC("tracepoint/sched/sched_process_exec")
int sched_process_exec(void *ctx)
{
    maps_changed((__u32)(bpf_get_current_pid_tgid() >> 32));
    return 0;
}

/* mmap(addr, len, prot, flags, fd, off) */
SEC("tracepoint/syscalls/sys_enter_mmap")
int sys_enter_mmap(struct trace_event_raw_sys_enter *args)
{
    __u64 prot = args->args[2], flags = args->args[3];
    int fd = (int)args->args[4];
    if (!(prot & SPANLET_PROT_EXEC) || (flags & SPANLET_MAP_ANONYMOUS) || fd < 0)
        return 0;
    maps_changed((__u32)(bpf_get_current_pid_tgid() >> 32));
    return 0;
}

const volatile bool sched_on = false;      /* sched.enabled: the anatomy (its programs loaded) */

/* Request anatomy: where the time of each thread that is in a span goes. A
 * thread has an entry here only while it is in a span (its marks put it in
 * and take it out), in its task's own storage (task-local storage: the
 * lookup of a thread without one reads one pointer of its task, and the
 * kernel frees it with the task). The scheduler's tracepoints (tp_btf: their
 * task arguments typed) add each interval to the entry; the entry's sums go
 * to the span's facts row at the thread's next mark or exit, before the span
 * can be exported. sched_switch's arguments (Linux 5.18+): preempt,
 * prev, next, prev_state; a switch out is involuntary as the kernel counts
 * them (nivcsw: preempted, or still runnable: its slice used up, CFS quota
 * throttling), and the thread is then in the run queue; else it sleeps
 * (TASK_UNINTERRUPTIBLE without TASK_NOLOAD: iowait as well).
 * Its CPU time is the scheduler's own account of it (sched_stat_runtime's
 * runtime: the thread clock's measure, which leaves out the time the
 * hypervisor took from the virtual CPU, steal, and interrupts where the
 * kernel accounts them); the rest of the time it held a CPU it was runnable
 * and not running, run queue. The time since the scheduler's last account,
 * when a mark or a switch closes the interval, is timed by the clock (at
 * most a tick). */
#define SCHED_RUNNING 0
#define SCHED_RUNQUEUE 1
#define SCHED_BLOCKED 2
#define SCHED_IOWAIT 3
#define SCHED_TASK_UNINTERRUPTIBLE 0x2
#define SCHED_TASK_NOLOAD 0x400
#define SCHED_SUMS 6                /* cpu, run queue, blocked, iowait, switches, preemptions */
struct sched_thread_val {
    struct span_facts_key key;
    __u64 since_ns;
    __u64 ran_ns;               /* the scheduler's runtime since since_ns (while running) */
    __u64 accounted_ns;         /* when the scheduler last accounted it (since_ns at first) */
    __u64 sum[SCHED_SUMS];
    __u32 state;
    __u32 tgid;
};
struct {
    __uint(type, BPF_MAP_TYPE_TASK_STORAGE);
    __uint(map_flags, BPF_F_NO_PREALLOC);
    __type(key, int);
    __type(value, struct sched_thread_val);
} sched_thread SEC(".maps");

/* The interval the thread was in since s->since_ns, into its sums. */
static __always_inline void sched_close(struct sched_thread_val *s, __u64 now)
{
    __u64 d = now > s->since_ns ? now - s->since_ns : 0;
    if (s->state == SCHED_RUNNING) {
        __u64 ran = s->ran_ns + (now > s->accounted_ns ? now - s->accounted_ns : 0);
        if (ran > d)
            ran = d;
        s->sum[0] += ran;
        s->sum[1] += d - ran;
    } else if (s->state == SCHED_RUNQUEUE) {
        s->sum[1] += d;
    } else {
        s->sum[2] += d;
        if (s->state == SCHED_IOWAIT)
            s->sum[3] += d;
    }
    s->since_ns = now;
    s->accounted_ns = now;
    s->ran_ns = 0;
}

/* The sums so far onto the span's row. */
static __always_inline void sched_flush(struct sched_thread_val *s)
{
    struct span_facts_key k = s->key;
    struct span_facts_val *row = spanlet_span_row_key(&k, s->tgid);
    if (!row)
        return;
    __sync_fetch_and_add(&row->cpu_ns, s->sum[0]);
    __sync_fetch_and_add(&row->runqueue_ns, s->sum[1]);
    __sync_fetch_and_add(&row->blocked_ns, s->sum[2]);
    __sync_fetch_and_add(&row->iowait_ns, s->sum[3]);
    __sync_fetch_and_add(&row->switches, s->sum[4]);
    __sync_fetch_and_add(&row->preemptions, s->sum[5]);
}

/* A mark on the running thread: its time so far goes to the span it leaves;
 * from now on it runs in `c` (NULL: in no span). The uprobe's program can be
 * preempted, and the switch programs then update this thread's entry in the
 * middle of it: the old entry is copied and the new one written at once,
 * right after the time is read, and the copy is closed and flushed after, so
 * that a preemption past that point lands on the new entry as it should. */
static __always_inline void sched_mark(struct span_ctx_val *c)
{
    struct task_struct *task = bpf_get_current_task_btf();
    struct sched_thread_val old = {}, v = {};
    struct sched_thread_val *s = bpf_task_storage_get(&sched_thread, task, 0, 0);
    __u64 now = bpf_ktime_get_ns();
    int had = 0;
    if (s) {
        old = *s;
        had = 1;
    }
    if (c) {
        __builtin_memcpy(v.key.trace_id, c->trace_id, 16);
        v.key.span_id = c->span_id;
        v.key.cgroup_id = bpf_get_current_cgroup_id();
        v.since_ns = now;
        v.accounted_ns = now;
        v.state = SCHED_RUNNING;
        v.tgid = (__u32)(bpf_get_current_pid_tgid() >> 32);
        s = bpf_task_storage_get(&sched_thread, task, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
        if (s)
            *s = v;
    } else if (had) {
        bpf_task_storage_delete(&sched_thread, task);
    }
    if (had) {
        sched_close(&old, now);
        sched_flush(&old);
    }
}

SEC("tp_btf/sched_switch")
int BPF_PROG(sched_switch, bool preempt, struct task_struct *prev, struct task_struct *next, unsigned int state)
{
    struct sched_thread_val *s = bpf_task_storage_get(&sched_thread, prev, 0, 0);
    __u64 now = 0;
    if (s) {
        now = bpf_ktime_get_ns();
        sched_close(s, now);
        s->sum[4] += 1;
        if (preempt || state == 0) {
            s->sum[5] += 1;
            s->state = SCHED_RUNQUEUE;
        } else {
            s->state = (state & SCHED_TASK_UNINTERRUPTIBLE) && !(state & SCHED_TASK_NOLOAD)
                     ? SCHED_IOWAIT : SCHED_BLOCKED;
        }
    }
    s = bpf_task_storage_get(&sched_thread, next, 0, 0);
    if (s) {
        if (!now)
            now = bpf_ktime_get_ns();
        sched_close(s, now);   /* its wait: the run queue (or a sleep whose wake-up was not seen) */
        s->state = SCHED_RUNNING;
    }
    return 0;
}

/* The scheduler accounts a running thread's CPU time (update_curr: at ticks,
 * switches, wake-ups and clock reads): raw arguments task, runtime (Linux 6.8
 * on; vruntime third before). A share no larger than the clock's time since
 * the last account or the mark, so that time before a mark stays out. */
SEC("tp_btf/sched_stat_runtime")
int BPF_PROG(sched_stat_runtime, struct task_struct *task, __u64 runtime)
{
    struct sched_thread_val *s = bpf_task_storage_get(&sched_thread, task, 0, 0);
    if (!s || s->state != SCHED_RUNNING)
        return 0;
    __u64 now = bpf_ktime_get_ns();
    __u64 since = now > s->accounted_ns ? now - s->accounted_ns : 0;
    s->ran_ns += runtime < since ? runtime : since;
    s->accounted_ns = now;
    return 0;
}

SEC("tp_btf/sched_wakeup")
int BPF_PROG(sched_wakeup, struct task_struct *task)
{
    struct sched_thread_val *s = bpf_task_storage_get(&sched_thread, task, 0, 0);
    if (!s || s->state == SCHED_RUNNING || s->state == SCHED_RUNQUEUE)
        return 0;
    sched_close(s, bpf_ktime_get_ns());
    s->state = SCHED_RUNQUEUE;
    return 0;
}

/* The OpenTelemetry shared context map (span_context.otel_map): the OTel eBPF
 * profiler and OBI read a thread's current span here. Key: pid_tgid; ids in
 * W3C byte order. The agent pins it at span_context.otel_map_path (created,
 * or opened when another tool pinned it first); written with otel_map_on. */
struct otel_ctx_val {
    __u8 trace_id[16];
    __u8 span_id[8];
};
SPANLET_MAP(BPF_MAP_TYPE_LRU_HASH, traces_ctx_v1, __u64, struct otel_ctx_val, 16384);

/* void spanlet_mark(u64 trace_hi, u64 trace_lo, u64 span_id, u32 modality)
 * (native/spanlet_marker.c). span_id 0: the thread left its last span. */
SEC("uprobe")
int span_ctx_mark(struct pt_regs *ctx)
{
    __u64 pid_tgid = bpf_get_current_pid_tgid();
    __u32 tid = (__u32)pid_tgid;
    __u64 span_id = PT_REGS_PARM3(ctx);
    __u32 zero = 0;
    __u64 *marks = bpf_map_lookup_elem(&spanlet_span_marks_total, &zero);
    if (marks)
        *marks += 1;
    __u32 follow_flags = (__u32)PT_REGS_PARM4(ctx) >> 16;
    if (follow_flags) {
        __u32 tgid = (__u32)(pid_tgid >> 32);
        __u32 *known = bpf_map_lookup_elem(&spanlet_client_thread_only_processes, &tgid);
        if (!known || *known != follow_flags)
            bpf_map_update_elem(&spanlet_client_thread_only_processes, &tgid, &follow_flags, BPF_ANY);
    }
    __u64 hi = __builtin_bswap64((__u64)PT_REGS_PARM1(ctx));
    __u64 lo = __builtin_bswap64((__u64)PT_REGS_PARM2(ctx));
    if (span_id != 0 && hi == 0 && lo == 0) {
        __u64 *invalid = bpf_map_lookup_elem(&spanlet_span_marks_invalid_total, &zero);
        if (invalid)
            *invalid += 1;
        span_id = 0;
    }
    if (span_id == 0) {
        bpf_map_delete_elem(&span_ctx, &tid);
        if (sched_on)
            sched_mark(0);
        if (otel_map_on)
            bpf_map_delete_elem(&traces_ctx_v1, &pid_tgid);
        return 0;
    }
    struct span_ctx_val v = {};
    /* trace id bytes in W3C order: the high half first, big-endian */
    __builtin_memcpy(v.trace_id, &hi, 8);
    __builtin_memcpy(v.trace_id + 8, &lo, 8);
    v.span_id = span_id;
    __u32 modality = (__u32)PT_REGS_PARM4(ctx) & 0xffff;
    v.modality = modality < SPANLET_N_MODALITIES ? modality : SPANLET_MOD_OTHER;
    bpf_map_update_elem(&span_ctx, &tid, &v, BPF_ANY);
    if (sched_on)
        sched_mark(&v);
    if (otel_map_on) {
        struct otel_ctx_val o = {};
        __builtin_memcpy(o.trace_id, v.trace_id, 16);
        __u64 sid = __builtin_bswap64(span_id);
        __builtin_memcpy(o.span_id, &sid, 8);
        bpf_map_update_elem(&traces_ctx_v1, &pid_tgid, &o, BPF_ANY);
    }
    return 0;
}

/* A thread that exits inside a span must not lend its context to the next
 * thread that gets its id. */
SEC("tracepoint/sched/sched_process_exit")
int sched_process_exit(void *ctx)
{
    __u64 pid_tgid = bpf_get_current_pid_tgid();
    __u32 tid = (__u32)pid_tgid;
    bpf_map_delete_elem(&span_ctx, &tid);
    if (sched_on)
        sched_mark(0);             /* its last running time goes to its span */
    if (otel_map_on)
        bpf_map_delete_elem(&traces_ctx_v1, &pid_tgid);
    if (tid == (__u32)(pid_tgid >> 32)) {   /* the process's main thread: its maps go */
        maps_changed(tid);
        bpf_map_delete_elem(&spanlet_client_thread_only_processes, &tid);
    }
    return 0;
}

/* The sender of an OTLP connection (DESIGN.md, facts stay in their pod): who
 * opened each TCP connection to the agent's receiver ports, from the stable
 * sock:inet_sock_set_state tracepoint alone (its fields; no kernel struct is
 * read). The connect() runs in the connecting task (its cgroup and tgid are
 * taken then, by socket address, before the source port exists); the
 * handshake's end (SYN_SENT -> ESTABLISHED, in softirq) has the whole
 * 4-tuple, and the owner moves to sock_owner under it; TCP_CLOSE forgets
 * both. Only the connecting side gets an entry, and only for a destination
 * port in sock_owner_ports (the receiver's ports, filled once it has bound).
 * The tracepoint names no network namespace: a second live connection with
 * the same addresses and ports (another namespace's loopback, say) makes the
 * entry ambiguous (cgroup id 0: no sender), never another owner's.
 * Loaded where the tracepoint exists (SpanCtxProbe checks tracefs). */
#define SPANLET_TCP_ESTABLISHED 1
#define SPANLET_TCP_SYN_SENT 2
#define SPANLET_TCP_CLOSE 7
#define SPANLET_IPPROTO_TCP 6
#define SPANLET_AF_INET 2
#define SPANLET_AF_INET6 10

struct sock_owner_key {
    __u16 family;        /* AF_INET (also for IPv4-mapped IPv6 sockets) or AF_INET6 */
    __u16 sport;         /* host byte order, as the tracepoint gives them */
    __u16 dport;
    __u16 pad;
    __u8 saddr[16];      /* IPv4: the first 4 bytes */
    __u8 daddr[16];
};
struct sock_owner_val {
    __u64 cgroup_id;
    __u32 tgid;
    __u32 pad;
};
SPANLET_MAP(BPF_MAP_TYPE_LRU_HASH, sock_connecting, __u64, struct sock_owner_val, 4096);
SPANLET_MAP(BPF_MAP_TYPE_LRU_HASH, sock_owner, struct sock_owner_key, struct sock_owner_val, 16384);
SPANLET_MAP(BPF_MAP_TYPE_HASH, sock_owner_ports, __u16, __u8, 8);

static __always_inline int spanlet_v4_mapped(const __u8 *a)
{
    for (int i = 0; i < 10; i++)
        if (a[i])
            return 0;
    return a[10] == 0xff && a[11] == 0xff;
}

/* The key of the connection a tracepoint's args name; the addresses are
 * copied out of the args with a probe read (their offsets are CO-RE
 * relocations, and the verifier allows no load through a ctx pointer moved
 * by a register). */
#define SOCK_OWNER_KEY(k, args)                                                   \
    do {                                                                          \
        (k).sport = (args)->sport;                                                \
        (k).dport = (args)->dport;                                                \
        bpf_probe_read_kernel((k).saddr, 16, (args)->saddr_v6);                   \
        bpf_probe_read_kernel((k).daddr, 16, (args)->daddr_v6);                   \
        if ((args)->family == SPANLET_AF_INET6 && !spanlet_v4_mapped((k).daddr)) { \
            (k).family = SPANLET_AF_INET6;                                        \
        } else {                                                                  \
            (k).family = SPANLET_AF_INET;                                         \
            __builtin_memset((k).saddr, 0, 16);                                   \
            __builtin_memset((k).daddr, 0, 16);                                   \
            bpf_probe_read_kernel((k).saddr, 4, (args)->saddr);                   \
            bpf_probe_read_kernel((k).daddr, 4, (args)->daddr);                   \
        }                                                                         \
    } while (0)

SEC("tracepoint/sock/inet_sock_set_state")
int inet_sock_set_state(struct trace_event_raw_inet_sock_set_state *args)
{
    if (args->protocol != SPANLET_IPPROTO_TCP)
        return 0;
    __u64 sk = (__u64)args->skaddr;
    int state = args->newstate;
    if (state == SPANLET_TCP_SYN_SENT) {
        __u16 dport = args->dport;
        if (!bpf_map_lookup_elem(&sock_owner_ports, &dport))
            return 0;
        struct sock_owner_val v = {};
        v.cgroup_id = bpf_get_current_cgroup_id();
        v.tgid = (__u32)(bpf_get_current_pid_tgid() >> 32);
        bpf_map_update_elem(&sock_connecting, &sk, &v, BPF_ANY);
        return 0;
    }
    if (state == SPANLET_TCP_ESTABLISHED) {
        if (args->oldstate != SPANLET_TCP_SYN_SENT)
            return 0;
        struct sock_owner_val *v = bpf_map_lookup_elem(&sock_connecting, &sk);
        if (!v)
            return 0;
        struct sock_owner_key k = {};
        SOCK_OWNER_KEY(k, args);
        struct sock_owner_val owner = *v;
        if (bpf_map_lookup_elem(&sock_owner, &k))
            owner.cgroup_id = owner.tgid = 0;
        bpf_map_update_elem(&sock_owner, &k, &owner, BPF_ANY);
        bpf_map_delete_elem(&sock_connecting, &sk);
        return 0;
    }
    if (state == SPANLET_TCP_CLOSE) {
        __u16 dport = args->dport;
        if (!bpf_map_lookup_elem(&sock_owner_ports, &dport))
            return 0;
        bpf_map_delete_elem(&sock_connecting, &sk);
        struct sock_owner_key k = {};
        SOCK_OWNER_KEY(k, args);
        bpf_map_delete_elem(&sock_owner, &k);
    }
    return 0;
}
