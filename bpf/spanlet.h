/* spanlet.h: the structs that cross from spanlet's kernel programs into the
 * agent (mirrored once, in agent/events.py), and the helpers every program
 * uses to stamp and emit them. UAPI types and BPF helpers only. */
#ifndef SPANLET_H
#define SPANLET_H

#include <uapi/linux/bpf.h>

/* Record kinds (agent/events.py: Kind). */
#define SPANLET_KIND_GPU_LAUNCH 1
#define SPANLET_KIND_GPU_SYNC 2
#define SPANLET_KIND_SANDBOX 3
#define SPANLET_KIND_HTTP 4
#define SPANLET_KIND_FLOW 5
#define SPANLET_KIND_HTTP_BYTES 6

/* Modalities (agent/events.py: Modality). */
#define SPANLET_MOD_OTHER 0
#define SPANLET_MOD_TEXT 1
#define SPANLET_MOD_IMAGE 2
#define SPANLET_MOD_AUDIO 3
#define SPANLET_MOD_VIDEO 4
#define SPANLET_N_MODALITIES 5

#ifndef SPANLET_SPAN_CTX_MAX
#define SPANLET_SPAN_CTX_MAX 65536
#endif
#ifndef SPANLET_SPAN_FACTS_MAX
#define SPANLET_SPAN_FACTS_MAX 65536
#endif
/* Live rows one cgroup (one pod's container) may hold in span_facts, and
 * the cgroups whose rows are counted so (past that, a cgroup is bounded by
 * the total only; counted in span_facts_cgroups_full). */
#ifndef SPANLET_SPAN_FACTS_MAX_PER_CGROUP
#define SPANLET_SPAN_FACTS_MAX_PER_CGROUP 16384
#endif
#define SPANLET_FACTS_CGROUPS 4096
/* cgroups listed in a span's span_facts_index entry */
#define SPANLET_FACTS_INDEX_CGROUPS 4
#ifndef SPANLET_RINGBUF_PAGES
#define SPANLET_RINGBUF_PAGES 1024
#endif

/* Header of every ring-buffer record. ts_ns is CLOCK_MONOTONIC. */
struct spanlet_hdr {
    __u64 ts_ns;
    __u32 pid;
    __u32 tid;
    __u64 cgroup_id;
    __u8 trace_id[16];
    __u64 span_id;
    __u16 kind;
    __u8 modality;
    __u8 flags;
    __u32 _pad;
};

/* What the span-context marker uprobe stores per thread id. */
struct span_ctx_val {
    __u8 trace_id[16];
    __u64 span_id;
    __u8 modality;
    __u8 _pad[7];
};

/* One span's kernel facts (agent/probes/span_facts.py), written by the
 * process-context programs at the moment of each event, one row per span and
 * cgroup of the writing task: facts made in one pod never land in another
 * pod's row, whatever ids it marks. The trace id is part of the key: a span
 * id reused by another trace gets a row of its own. */
struct span_facts_key {
    __u8 trace_id[16];
    __u64 span_id;
    __u64 cgroup_id;
};

/* The cgroups that made rows for one span (key trace id + span id), in the
 * order their rows were made; written only when a row is made. n counts
 * every row made since the entry was: n > SPANLET_FACTS_INDEX_CGROUPS means
 * cgroups[] lists only the first ones (and fewer distinct cgroups than n,
 * that a slot was lost to a race: spanlet_facts_made). */
struct span_facts_index_key {
    __u8 trace_id[16];
    __u64 span_id;
};

struct span_facts_index_val {
    __u64 cgroups[SPANLET_FACTS_INDEX_CGROUPS];
    __u32 n;
    __u32 _pad;
};

struct span_facts_val {
    __u64 launches_driver;    /* outermost launch calls, by API */
    __u64 launches_runtime;
    __u64 launch_ns;          /* time inside launch calls (gpu.launch_timing only) */
    __u64 sync_wait_ns;       /* time inside outermost sync calls */
    __u64 syncs;
    __u64 violations;         /* mmap sandbox */
    __u64 graph_launches;     /* cuGraphLaunch* calls (replays) */
    __u64 graph_kernels;      /* kernels those replays ran, where the graph was seen made */
    /* where the span's threads' time went while in the span (span_ctx.bpf.c,
     * the scheduler's tracepoints and the span marks): */
    __u64 cpu_ns;             /* on a CPU */
    __u64 runqueue_ns;        /* runnable, waiting for a CPU (preempted, woken, CFS-throttled) */
    __u64 blocked_ns;         /* asleep (blocked on I/O, a lock, the network, a sleep) */
    __u64 iowait_ns;          /* the uninterruptible part of blocked_ns */
    __u64 switches;           /* switches out */
    __u64 preemptions;        /* the involuntary ones among them */
    /* GPU memory traffic (gpu_launch.bpf.c, the driver's copy and alloc calls): */
    __u64 memcpy_h2d_bytes;   /* bytes copied host to device, as the call states */
    __u64 memcpy_d2h_bytes;   /* device to host */
    __u64 memcpy_d2d_bytes;   /* device to device (arrays count as device memory) */
    __u64 memcpy_other_bytes; /* unified-address copies (cuMemcpy*): direction not stated */
    __u64 memcpy_calls;       /* copy calls (attempts, counted at entry) */
    __u64 memcpy_ns;          /* time inside synchronous copy calls */
    __u64 alloc_bytes;        /* device memory asked for (cuMemAlloc*, at entry) */
    __u64 cgroup_id;          /* of the first event */
    __u64 first_ns;           /* CLOCK_MONOTONIC of the first event */
    __u32 pid;                /* of the first event */
    __u32 sampled_events;     /* GPU records sent in the sampled side stream */
};

/* GPU APIs and entry points (agent/events.py Api, Entry). API_GRAPH: kernels
 * run by the replay of a graph whose kernels the agent saw recorded. */
#define SPANLET_API_DRIVER 1
#define SPANLET_API_RUNTIME 2
#define SPANLET_API_GRAPH 3
#define SPANLET_ENTRY_CU_LAUNCH_KERNEL 1
#define SPANLET_ENTRY_CU_LAUNCH_KERNEL_EX 2
#define SPANLET_ENTRY_CUDA_LAUNCH_KERNEL 3
#define SPANLET_ENTRY_CU_STREAM_SYNC 4
#define SPANLET_ENTRY_CUDA_STREAM_SYNC 5
#define SPANLET_ENTRY_CUDA_DEVICE_SYNC 6
#define SPANLET_ENTRY_CU_LAUNCH_KERNEL_PTSZ 7
#define SPANLET_ENTRY_CU_LAUNCH_KERNEL_EX_PTSZ 8
#define SPANLET_ENTRY_CU_LAUNCH_COOPERATIVE 9
#define SPANLET_ENTRY_CU_LAUNCH_COOPERATIVE_PTSZ 10
#define SPANLET_ENTRY_CU_LAUNCH 11
#define SPANLET_ENTRY_CU_LAUNCH_GRID 12
#define SPANLET_ENTRY_CU_LAUNCH_GRID_ASYNC 13
#define SPANLET_ENTRY_CUDA_LAUNCH_KERNEL_PTSZ 14
#define SPANLET_ENTRY_CUDA_LAUNCH_KERNEL_EXC 15
#define SPANLET_ENTRY_CUDA_LAUNCH_KERNEL_EXC_PTSZ 16
#define SPANLET_ENTRY_CUDA_LAUNCH_COOPERATIVE 17
#define SPANLET_ENTRY_CUDA_LAUNCH_COOPERATIVE_PTSZ 18
#define SPANLET_ENTRY_CU_GRAPH_LAUNCH 19
#define SPANLET_ENTRY_CU_GRAPH_LAUNCH_PTSZ 20
#define SPANLET_ENTRY_CU_STREAM_SYNC_PTSZ 21
#define SPANLET_ENTRY_CU_CTX_SYNC 22
#define SPANLET_ENTRY_CU_EVENT_SYNC 23
#define SPANLET_ENTRY_CUDA_STREAM_SYNC_PTSZ 24
#define SPANLET_ENTRY_CUDA_EVENT_SYNC 25
#define SPANLET_ENTRY_CU_CTX_SYNC_V2 26

struct gpu_launch_event {
    struct spanlet_hdr hdr;
    __u64 func;
    __u64 stream;
    __u64 duration_ns;
    __u32 grid[3];
    __u32 block[3];
    __u32 shared_mem;
    __u8 api;
    __u8 entry;
    __u8 _pad[2];
};

struct gpu_sync_event {
    struct spanlet_hdr hdr;
    __u64 stream;
    __u64 duration_ns;
    __u8 api;
    __u8 entry;
    __u8 _pad[6];
};

/* Sandbox rules and actions. */
#define SPANLET_RULE_UNAUTHORIZED 1
#define SPANLET_RULE_WRITE_ON_READONLY 2
#define SPANLET_RULE_EXEC 3
#define SPANLET_RULE_OVERSIZE 4
#define SPANLET_ACTION_AUDIT 1
#define SPANLET_ACTION_KILL 2

struct sandbox_event {
    struct spanlet_hdr hdr;
    __u64 addr;
    __u64 len;
    __u64 pool_max_bytes;
    __u32 prot;
    __u32 flags;
    __u32 pool_id;
    __s32 fd;
    __u8 rule;
    __u8 action;
    __u8 _pad[6];
};

/* Protocol classes of the TC classifier. */
#define SPANLET_PROTO_UNKNOWN 0
#define SPANLET_PROTO_HTTP1 1
#define SPANLET_PROTO_HTTP2 2
#define SPANLET_PROTO_WEBSOCKET 3
#define SPANLET_PROTO_RTP 4
#define SPANLET_PROTO_TCP 5
#define SPANLET_PROTO_UDP 6
#define SPANLET_N_PROTOS 7

#define SPANLET_DIR_INGRESS 0
#define SPANLET_DIR_EGRESS 1

/* A flow as the classifier keys it: addresses in network byte order (IPv4
 * in the first 4 bytes), ports in host byte order. */
struct flow_key {
    __u8 saddr[16];
    __u8 daddr[16];
    __u16 sport;
    __u16 dport;
    __u8 l4proto;
    __u8 family;
    __u8 _pad[2];
};

/* HTTP/1.x request seen on the wire. hdr.trace_id/hdr.span_id hold the
 * traceparent's trace id and parent id when flags & SPANLET_HTTP_TRACEPARENT. */
#define SPANLET_HTTP_TRACEPARENT 1
struct http_event {
    struct spanlet_hdr hdr;
    struct flow_key flow;
    __u32 ifindex;
    __u32 path_hash;
    __u8 method;
    __u8 direction;
    __u8 trace_flags;
    __u8 _pad[5];
};

/* Wire bytes of one HTTP/1.x request with a traceparent (hdr ids), from its
 * first packet up to the next request on its connection: bytes[] by TC
 * direction, req_dir the direction the request travelled. */
struct http_bytes_event {
    struct spanlet_hdr hdr;
    struct flow_key flow;
    __u64 bytes[2];
    __u8 req_dir;
    __u8 _pad[7];
};

/* A flow classified for the first time. */
struct flow_event {
    struct spanlet_hdr hdr;
    struct flow_key flow;
    __u32 ifindex;
    __u8 proto_class;
    __u8 direction;
    __u8 _pad[2];
};

/* The per-thread span context map, the span facts map and the count of
 * facts rows created are made by span_ctx.bpf.c and pinned in
 * SPANLET_PIN_DIR (a folder unique to one agent, removed at its stop);
 * every other program of that agent opens the same maps there. A program
 * compiled without the flag gets private, empty copies. (BCC's own shared
 * tables are not used: its process-wide registry keeps a table's fd after
 * the table is gone, and a reused fd number then names another map.) */
#ifdef SPANLET_PIN_DIR
BPF_TABLE_PINNED("lru_hash", __u32, struct span_ctx_val, span_ctx, SPANLET_SPAN_CTX_MAX,
                 SPANLET_PIN_DIR "/span_ctx");
BPF_TABLE_PINNED("lru_hash", struct span_facts_key, struct span_facts_val, span_facts,
                 SPANLET_SPAN_FACTS_MAX, SPANLET_PIN_DIR "/span_facts");
BPF_TABLE_PINNED("percpu_array", int, __u64, span_facts_created, 1,
                 SPANLET_PIN_DIR "/span_facts_created");
BPF_TABLE_PINNED("lru_hash", struct span_facts_index_key, struct span_facts_index_val,
                 span_facts_index, SPANLET_SPAN_FACTS_MAX, SPANLET_PIN_DIR "/span_facts_index");
BPF_TABLE_PINNED("hash", __u64, __u64, span_facts_cg_created, SPANLET_FACTS_CGROUPS,
                 SPANLET_PIN_DIR "/span_facts_cg_created");
BPF_TABLE_PINNED("hash", __u64, __u64, span_facts_cg_released, SPANLET_FACTS_CGROUPS,
                 SPANLET_PIN_DIR "/span_facts_cg_released");
BPF_TABLE_PINNED("lru_hash", __u64, __u64, span_facts_cg_refused, SPANLET_FACTS_CGROUPS,
                 SPANLET_PIN_DIR "/span_facts_cg_refused");
BPF_TABLE_PINNED("percpu_array", int, __u64, span_facts_refused, 2,
                 SPANLET_PIN_DIR "/span_facts_refused");
#else
BPF_TABLE("lru_hash", __u32, struct span_ctx_val, span_ctx, 1);
BPF_TABLE("lru_hash", struct span_facts_key, struct span_facts_val, span_facts, 1);
BPF_PERCPU_ARRAY(span_facts_created, __u64, 1);
BPF_TABLE("lru_hash", struct span_facts_index_key, struct span_facts_index_val,
          span_facts_index, 1);
BPF_TABLE("hash", __u64, __u64, span_facts_cg_created, 1);
BPF_TABLE("hash", __u64, __u64, span_facts_cg_released, 1);
BPF_TABLE("lru_hash", __u64, __u64, span_facts_cg_refused, 1);
BPF_PERCPU_ARRAY(span_facts_refused, __u64, 2);
#endif
/* span_facts_refused: [0] events refused a row by the per-cgroup bound, [1] rows of
 * cgroups past SPANLET_FACTS_CGROUPS (made, bounded by the total only) */
#define SPANLET_FACTS_REFUSED 0
#define SPANLET_FACTS_CGROUPS_FULL 1

/* The calling thread's span context, NULL outside spans. */
static __always_inline struct span_ctx_val *spanlet_current_span(void)
{
    __u32 tid = (__u32)bpf_get_current_pid_tgid();
    return span_ctx.lookup(&tid);
}

static __always_inline void spanlet_facts_count(int slot)
{
    __u64 *n = span_facts_refused.lookup(&slot);
    if (n)
        __sync_fetch_and_add(n, 1);
}

/* Whether cgroup `cg` may make another row: live rows (rows made, counted
 * here, less rows gone, written by the agent's sweep and join) under
 * SPANLET_SPAN_FACTS_MAX_PER_CGROUP. A refusal is counted for the cgroup,
 * once per event (launch, sync, violation) that gets no row. */
static __always_inline int spanlet_facts_room(__u64 cg)
{
    __u64 *made = span_facts_cg_created.lookup(&cg);
    if (!made)
        return 1;
    __u64 *gone = span_facts_cg_released.lookup(&cg);
    __u64 live = *made, released = gone ? *gone : 0;
    live = live > released ? live - released : 0;
    if (live < SPANLET_SPAN_FACTS_MAX_PER_CGROUP)
        return 1;
    spanlet_facts_count(SPANLET_FACTS_REFUSED);
    __u64 one = 1;
    __u64 *refused = span_facts_cg_refused.lookup(&cg);
    if (refused)
        __sync_fetch_and_add(refused, 1);
    else if (span_facts_cg_refused.insert(&cg, &one) != 0 &&
             (refused = span_facts_cg_refused.lookup(&cg)))
        __sync_fetch_and_add(refused, 1);
    return 0;
}

/* A row was made for cgroup `cg` and span `k`: counted (in total and for the
 * cgroup) and the cgroup listed in the span's index entry. */
static __always_inline void spanlet_facts_made(struct span_facts_key *k)
{
    int zero = 0;
    __u64 *created = span_facts_created.lookup(&zero);
    if (created)
        __sync_fetch_and_add(created, 1);
    __u64 cg = k->cgroup_id, one = 1;
    __u64 *made = span_facts_cg_created.lookup(&cg);
    if (made)
        __sync_fetch_and_add(made, 1);
    else if (span_facts_cg_created.insert(&cg, &one) != 0) {
        made = span_facts_cg_created.lookup(&cg);    /* another CPU made it, or the map is full */
        if (made)
            __sync_fetch_and_add(made, 1);
        else
            spanlet_facts_count(SPANLET_FACTS_CGROUPS_FULL);
    }
    struct span_facts_index_key ik = {};
    __builtin_memcpy(ik.trace_id, k->trace_id, 16);
    ik.span_id = k->span_id;
    struct span_facts_index_val iv = {};
    iv.cgroups[0] = cg;
    iv.n = 1;
    if (span_facts_index.insert(&ik, &iv) == 0)
        return;
    struct span_facts_index_val *v = span_facts_index.lookup(&ik);
    if (!v)
        return;
    /* BCC's target has no atomic that returns the old value: two CPUs that
     * read the same n write the same slot, one cgroup is lost from the list
     * and n (added atomically) is larger than the cgroups listed, which the
     * agent reads as an incomplete entry (as past SPANLET_FACTS_INDEX_CGROUPS):
     * it then also looks up the sender's own cgroups' rows, and any other
     * row waits for the sweep. */
    __u32 idx = *(volatile __u32 *)&v->n;
    __sync_fetch_and_add(&v->n, 1);
    if (idx < SPANLET_FACTS_INDEX_CGROUPS)
        v->cgroups[idx & (SPANLET_FACTS_INDEX_CGROUPS - 1)] = cg;
}

/* Never written: the zero value new facts rows start from. */
BPF_ARRAY(span_facts_zero, struct span_facts_val, 1);

/* The facts row of span `c` for the calling task's cgroup (`cgroup_id`), created (cgroup,
 * pid and time of this first event) when absent and the cgroup is under its
 * bound. Another CPU may create it between our lookup and our insert:
 * BPF_NOEXIST then fails and the row it made is looked up again. Rows
 * created are counted so that the agent can tell LRU evictions (created -
 * taken - swept - present). NULL when the row is refused (the cgroup's bound)
 * or the map refuses it. */
static __always_inline struct span_facts_val *spanlet_span_row_key(struct span_facts_key *k, __u32 pid)
{
    struct span_facts_val *row = span_facts.lookup(k);
    if (row)
        return row;
    if (!spanlet_facts_room(k->cgroup_id))
        return 0;
    /* Inserted from a zero value (the row is too big for the stack of the
     * programs that make rows), then stamped: a reader that takes the row in
     * between (the span exported while a thread makes its first fact) sees
     * cgroup 0 and time 0 on a row its key still names. */
    int zero = 0;
    struct span_facts_val *init = span_facts_zero.lookup(&zero);
    if (!init)
        return 0;
    if (span_facts.insert(k, init) != 0)
        return span_facts.lookup(k);
    spanlet_facts_made(k);
    row = span_facts.lookup(k);
    if (row) {
        row->cgroup_id = k->cgroup_id;
        row->first_ns = bpf_ktime_get_ns();
        row->pid = pid;
    }
    return row;
}

static __always_inline struct span_facts_val *spanlet_span_row_of(struct span_ctx_val *c, __u64 cgroup_id)
{
    struct span_facts_key k = {};
    __builtin_memcpy(k.trace_id, c->trace_id, 16);
    k.span_id = c->span_id;
    k.cgroup_id = cgroup_id;
    return spanlet_span_row_key(&k, (__u32)(bpf_get_current_pid_tgid() >> 32));
}

/* The same for the calling task's cgroup, where the caller has not read it. */
static __always_inline struct span_facts_val *spanlet_span_row(struct span_ctx_val *c)
{
    return spanlet_span_row_of(c, bpf_get_current_cgroup_id());
}

/* Each program has its own ring buffer and a count of records it could not
 * reserve there (read by the agent as events dropped). */
BPF_RINGBUF_OUTPUT(events, SPANLET_RINGBUF_PAGES);
BPF_PERCPU_ARRAY(spanlet_events_dropped_total, __u64, 1);

static __always_inline void spanlet_count_drop(void)
{
    int zero = 0;
    __u64 *n = spanlet_events_dropped_total.lookup(&zero);
    if (n)
        *n += 1;
}

/* A bound per cgroup on the records a process-context program sends (the
 * sampled GPU stream, sandbox records): SPANLET_RECORDS_PER_CGROUP_S a
 * second for each cgroup, so one pod that floods its own spans or pools
 * cannot fill the ring the others' records go through. 0: no bound. Records
 * refused are counted for their cgroup (the agent reads the map and keeps
 * the totals of cgroups the LRU forgets). Window start and count are reset
 * without a lock: two CPUs racing at a window's edge may each let one more
 * record through. */
#ifndef SPANLET_RECORDS_PER_CGROUP_S
#define SPANLET_RECORDS_PER_CGROUP_S 0
#endif
struct spanlet_cgroup_budget_val {
    __u64 window_ns;     /* CLOCK_MONOTONIC start of this one-second window */
    __u64 sent;          /* records sent in it */
    __u64 limited;       /* records refused since the entry was made */
};
BPF_TABLE("lru_hash", __u64, struct spanlet_cgroup_budget_val, cgroup_record_budget, 4096);

static __always_inline int spanlet_cgroup_may_send(void)
{
    if (SPANLET_RECORDS_PER_CGROUP_S == 0)
        return 1;
    __u64 cg = bpf_get_current_cgroup_id();
    __u64 now = bpf_ktime_get_ns();
    struct spanlet_cgroup_budget_val *b = cgroup_record_budget.lookup(&cg);
    if (!b) {
        struct spanlet_cgroup_budget_val init = {.window_ns = now, .sent = 1, .limited = 0};
        cgroup_record_budget.update(&cg, &init);
        return 1;
    }
    if (now - b->window_ns >= 1000000000ULL) {
        b->window_ns = now;
        b->sent = 0;
    }
    if (b->sent >= SPANLET_RECORDS_PER_CGROUP_S) {
        __sync_fetch_and_add(&b->limited, 1);
        return 0;
    }
    __sync_fetch_and_add(&b->sent, 1);
    return 1;
}

/* Fill the header for the current task: ids, cgroup, and the span context
 * of the calling thread when the marker has set one. */
static __always_inline void spanlet_fill_task_hdr(struct spanlet_hdr *h, __u16 kind)
{
    __u64 pid_tgid = bpf_get_current_pid_tgid();
    __u32 tid = (__u32)pid_tgid;
    h->ts_ns = bpf_ktime_get_ns();
    h->pid = pid_tgid >> 32;
    h->tid = tid;
    h->cgroup_id = bpf_get_current_cgroup_id();
    h->kind = kind;
    h->flags = 0;
    h->_pad = 0;
    struct span_ctx_val *c = span_ctx.lookup(&tid);
    if (c) {
        __builtin_memcpy(h->trace_id, c->trace_id, 16);
        h->span_id = c->span_id;
        h->modality = c->modality;
    } else {
        __builtin_memset(h->trace_id, 0, 16);
        h->span_id = 0;
        h->modality = SPANLET_MOD_OTHER;
    }
}

/* Span-context modality of the calling thread (OTHER when none). */
static __always_inline __u8 spanlet_current_modality(void)
{
    __u32 tid = (__u32)bpf_get_current_pid_tgid();
    struct span_ctx_val *c = span_ctx.lookup(&tid);
    return c ? c->modality : SPANLET_MOD_OTHER;
}

#endif
