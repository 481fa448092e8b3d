/* span_ctx.bpf.c: owner of the per-thread span context map (tid → trace id,
 * span id, modality) and of the span facts map the other programs write
 * (spanlet.h). A uprobe on the client's spanlet_mark() fills the context on
 * every span start and end; the other process-context programs open both
 * maps where this one pinned them. Loaded first. */
#include "spanlet.h"

#include <uapi/linux/ptrace.h>

BPF_PERCPU_ARRAY(spanlet_span_marks_total, __u64, 1);
/* Marks no span can have (W3C: an all-zero trace id is invalid): the thread
 * is taken out of its span, as a mark with span id 0 would. */
BPF_PERCPU_ARRAY(spanlet_span_marks_invalid_total, __u64, 1);

/* Processes whose spans are followed per thread only, by why (the follow
 * flags each of their marks carries in its modality's high 16 bits:
 * spanlet/runtimes.py): tgid -> flags; removed when the process exits. Named
 * after the metric it feeds. */
BPF_TABLE("lru_hash", __u32, __u32, spanlet_client_thread_only_processes, 4096);

/* Processes whose mapped libraries may have changed since library discovery
 * last looked (spanlet.discovery.MapsWatch drains it each refresh and reads
 * only these processes' maps between its slow full scans): an exec, a file
 * mapped executable (how the dynamic loader maps each library it loads, at
 * start and on dlopen), a process's exit. tgid → ktime of the last change. */
BPF_TABLE("lru_hash", __u32, __u64, maps_changed_pids, 16384);

#define SPANLET_PROT_EXEC 0x4        /* uapi/asm-generic/mman-common.h */
#define SPANLET_MAP_ANONYMOUS 0x20

static __always_inline void maps_changed(__u32 tgid)
{
    __u64 now = bpf_ktime_get_ns();
    maps_changed_pids.update(&tgid, &now);
}

TRACEPOINT_PROBE(sched, sched_process_exec)
{
    maps_changed((__u32)(bpf_get_current_pid_tgid() >> 32));
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_mmap)
{
    if (!(args->prot & SPANLET_PROT_EXEC) || (args->flags & SPANLET_MAP_ANONYMOUS) ||
        (int)args->fd < 0)
        return 0;
    maps_changed((__u32)(bpf_get_current_pid_tgid() >> 32));
    return 0;
}

#ifdef SPANLET_OTEL_MAP
/* The OpenTelemetry shared context map (span_context.otel_map): the OTel eBPF
 * profiler and OBI read a thread's current span here. Key: pid_tgid; ids in
 * W3C byte order. Pinned at SPANLET_OTEL_MAP (created, or opened when another
 * tool pinned it first). */
struct otel_ctx_val {
    __u8 trace_id[16];
    __u8 span_id[8];
};
BPF_TABLE_PINNED("lru_hash", __u64, struct otel_ctx_val, traces_ctx_v1, 16384, SPANLET_OTEL_MAP);
#endif

/* void spanlet_mark(u64 trace_hi, u64 trace_lo, u64 span_id, u32 modality)
 * (native/spanlet_marker.c). span_id 0: the thread left its last span. */
int span_ctx_mark(struct pt_regs *ctx)
{
    __u32 tid = (__u32)bpf_get_current_pid_tgid();
    __u64 span_id = PT_REGS_PARM3(ctx);
    int zero = 0;
    __u64 *marks = spanlet_span_marks_total.lookup(&zero);
    if (marks)
        *marks += 1;
#ifdef SPANLET_OTEL_MAP
    __u64 pid_tgid = bpf_get_current_pid_tgid();
#endif
    __u32 follow_flags = (__u32)PT_REGS_PARM4(ctx) >> 16;
    if (follow_flags) {
        __u32 tgid = (__u32)(bpf_get_current_pid_tgid() >> 32);
        __u32 *known = spanlet_client_thread_only_processes.lookup(&tgid);
        if (!known || *known != follow_flags)
            spanlet_client_thread_only_processes.update(&tgid, &follow_flags);
    }
    __u64 hi = __builtin_bswap64((__u64)PT_REGS_PARM1(ctx));
    __u64 lo = __builtin_bswap64((__u64)PT_REGS_PARM2(ctx));
    if (span_id != 0 && hi == 0 && lo == 0) {
        __u64 *invalid = spanlet_span_marks_invalid_total.lookup(&zero);
        if (invalid)
            *invalid += 1;
        span_id = 0;
    }
    if (span_id == 0) {
        span_ctx.delete(&tid);
#ifdef SPANLET_OTEL_MAP
        traces_ctx_v1.delete(&pid_tgid);
#endif
        return 0;
    }
    struct span_ctx_val v = {};
    /* trace id bytes in W3C order: the high half first, big-endian */
    __builtin_memcpy(v.trace_id, &hi, 8);
    __builtin_memcpy(v.trace_id + 8, &lo, 8);
    v.span_id = span_id;
    __u32 modality = (__u32)PT_REGS_PARM4(ctx) & 0xffff;
    v.modality = modality < SPANLET_N_MODALITIES ? modality : SPANLET_MOD_OTHER;
    span_ctx.update(&tid, &v);
#ifdef SPANLET_OTEL_MAP
    struct otel_ctx_val o = {};
    __builtin_memcpy(o.trace_id, v.trace_id, 16);
    __u64 sid = __builtin_bswap64(span_id);
    __builtin_memcpy(o.span_id, &sid, 8);
    traces_ctx_v1.update(&pid_tgid, &o);
#endif
    return 0;
}

/* A thread that exits inside a span must not lend its context to the next
 * thread that gets its id. */
TRACEPOINT_PROBE(sched, sched_process_exit)
{
    __u64 pid_tgid = bpf_get_current_pid_tgid();
    __u32 tid = (__u32)pid_tgid;
    span_ctx.delete(&tid);
#ifdef SPANLET_OTEL_MAP
    traces_ctx_v1.delete(&pid_tgid);
#endif
    if (tid == (__u32)(pid_tgid >> 32)) {   /* the process's main thread: its maps go */
        maps_changed(tid);
        spanlet_client_thread_only_processes.delete(&tid);
    }
    return 0;
}

#ifdef SPANLET_SOCK_OWNER
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
 * Compiled where the tracepoint exists (SpanCtxProbe checks tracefs). */
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
BPF_TABLE("lru_hash", __u64, struct sock_owner_val, sock_connecting, 4096);
BPF_TABLE("lru_hash", struct sock_owner_key, struct sock_owner_val, sock_owner, 16384);
BPF_HASH(sock_owner_ports, __u16, __u8, 8);

static __always_inline int spanlet_v4_mapped(const __u8 *a)
{
    for (int i = 0; i < 10; i++)
        if (a[i])
            return 0;
    return a[10] == 0xff && a[11] == 0xff;
}

/* The key of the connection a tracepoint's args name (a macro: BCC makes the
 * args struct at the probe below); the addresses are copied out of the args
 * before they are looked at (the verifier allows no pointer into them). */
#define SOCK_OWNER_KEY(k, args)                                                   \
    do {                                                                          \
        (k).sport = (args)->sport;                                                \
        (k).dport = (args)->dport;                                                \
        __builtin_memcpy((k).saddr, (args)->saddr_v6, 16);                        \
        __builtin_memcpy((k).daddr, (args)->daddr_v6, 16);                        \
        if ((args)->family == SPANLET_AF_INET6 && !spanlet_v4_mapped((k).daddr)) { \
            (k).family = SPANLET_AF_INET6;                                        \
        } else {                                                                  \
            (k).family = SPANLET_AF_INET;                                         \
            __builtin_memset((k).saddr, 0, 16);                                   \
            __builtin_memset((k).daddr, 0, 16);                                   \
            __builtin_memcpy((k).saddr, (args)->saddr, 4);                        \
            __builtin_memcpy((k).daddr, (args)->daddr, 4);                        \
        }                                                                         \
    } while (0)

TRACEPOINT_PROBE(sock, inet_sock_set_state)
{
    if (args->protocol != SPANLET_IPPROTO_TCP)
        return 0;
    __u64 sk = (__u64)args->skaddr;
    int state = args->newstate;
    if (state == SPANLET_TCP_SYN_SENT) {
        __u16 dport = args->dport;
        if (!sock_owner_ports.lookup(&dport))
            return 0;
        struct sock_owner_val v = {};
        v.cgroup_id = bpf_get_current_cgroup_id();
        v.tgid = (__u32)(bpf_get_current_pid_tgid() >> 32);
        sock_connecting.update(&sk, &v);
        return 0;
    }
    if (state == SPANLET_TCP_ESTABLISHED) {
        if (args->oldstate != SPANLET_TCP_SYN_SENT)
            return 0;
        struct sock_owner_val *v = sock_connecting.lookup(&sk);
        if (!v)
            return 0;
        struct sock_owner_key k = {};
        SOCK_OWNER_KEY(k, args);
        struct sock_owner_val owner = *v;
        if (sock_owner.lookup(&k))
            owner.cgroup_id = owner.tgid = 0;
        sock_owner.update(&k, &owner);
        sock_connecting.delete(&sk);
        return 0;
    }
    if (state == SPANLET_TCP_CLOSE) {
        __u16 dport = args->dport;
        if (!sock_owner_ports.lookup(&dport))
            return 0;
        sock_connecting.delete(&sk);
        struct sock_owner_key k = {};
        SOCK_OWNER_KEY(k, args);
        sock_owner.delete(&k);
    }
    return 0;
}
#endif /* SPANLET_SOCK_OWNER */
