/* spanlet_types.h: the structs that cross from spanlet's kernel programs
 * into the agent, and the constants they use; included by the BCC programs
 * (through spanlet.h) and the CO-RE ones (through span_facts.bpf.h) alike.
 * UAPI integer types only: the includer brings them. */
#ifndef SPANLET_TYPES_H
#define SPANLET_TYPES_H

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

#endif
