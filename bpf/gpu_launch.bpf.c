/* gpu_launch.bpf.c: uprobes on every CUDA driver launch entry point (and
 * optionally the runtime's), on graph replays and the calls that make graphs
 * (stream capture, kernel nodes, instantiation, destroy), and entry/return
 * probes on the synchronisation calls. Counts launches (api driver/runtime),
 * the kernels graph replays run (api graph), graph replays and sync wait per
 * (cgroup, modality, api) in per-CPU maps, adds them to the span facts row of
 * the calling thread's span, and sends a sampled side stream of launch/sync
 * records through the ring buffer. */
#include <uapi/linux/ptrace.h>  /* struct pt_regs, as every BCC uprobe tool uses it */
#include "spanlet.h"

/* Which calls become ring-buffer records (GpuConfig.launch_events):
 *   -DSPANLET_GPU_EVENTS_ALL      every outermost launch and sync call;
 *   -DSPANLET_GPU_EVENTS_SAMPLED  the first SPANLET_GPU_SAMPLED_PER_SPAN calls of
 *                                 each span (counted in its facts row), at
 *                                 most SPANLET_RECORDS_PER_CGROUP_S a second
 *                                 for each cgroup (spanlet.h);
 *   neither                       none: counts and span facts only.
 * -DSPANLET_GPU_LAUNCH_TIMING: driver launches get a return probe and their
 * call time is measured (launch_ns); without it a driver launch is one
 * entry-only uprobe. -DSPANLET_GPU_RUNTIME_HOOKS: the runtime's launches are
 * hooked too (the driver call each makes is then nested and not counted again).
 * The per-CPU counts and the span facts are kept in every mode. */
#if defined(SPANLET_GPU_EVENTS_ALL) && defined(SPANLET_GPU_EVENTS_SAMPLED)
#error "SPANLET_GPU_EVENTS_ALL and SPANLET_GPU_EVENTS_SAMPLED are exclusive"
#endif
#ifndef SPANLET_GPU_SAMPLED_PER_SPAN
#define SPANLET_GPU_SAMPLED_PER_SPAN 4
#endif
/* Launch calls are tracked between entry and return only when something
 * needs the return: the time of the call, or a runtime call whose nested
 * driver call must not count again. */
#if defined(SPANLET_GPU_LAUNCH_TIMING) || defined(SPANLET_GPU_RUNTIME_HOOKS)
#define SPANLET_GPU_TRACK_LAUNCHES 1
#endif

/* The argument map below is the x86-64 System V one. arm64 (AAPCS64) needs
 * another: x0-x7 carry eight integer arguments, so cuLaunchKernel's
 * sharedMemBytes and hStream are in x7 and at [sp], the link register (not
 * the stack) holds the return address, and dim3 by value still takes two
 * registers each but starts at x1. */
#if !defined(bpf_target_x86)
#error "gpu_launch.bpf.c: only the x86-64 argument map is written (see the comment above)"
#endif

#ifndef SPANLET_GPU_INFLIGHT_MAX
#define SPANLET_GPU_INFLIGHT_MAX 16384
#endif
#ifndef SPANLET_GPU_KEYS_MAX
#define SPANLET_GPU_KEYS_MAX 10240
#endif
/* One record in this many wakes the reader (see gpu_wakeup_flags): about a
 * sixteenth of what the ring buffer holds. */
#ifndef SPANLET_GPU_WAKEUP_EVERY
#define SPANLET_GPU_WAKEUP_EVERY \
    (SPANLET_RINGBUF_PAGES * 4096 / 16 / (sizeof(struct gpu_launch_event) + 8) + 1)
#endif
/* Sync wait histogram: bucket 0 counts waits under 1 us, bucket i (1..30)
 * waits in [2^(i-1), 2^i) us, bucket 31 everything longer (about 35 min). */
#define SPANLET_GPU_WAIT_BUCKETS 32

struct gpu_count_key {
    __u64 cgroup_id;
    __u8 modality;
    __u8 api;
    __u8 _pad[6];
};

/* Metric 1: outermost launch calls (attempts, counted at entry), and with
 * api graph the kernels run by replays of known graphs. The per-CPU hashes
 * here are not preallocated: a node has a few keys (cgroup, modality, api)
 * and many CPUs, and a preallocated one would hold max_entries values per CPU
 * (2.7 MiB per CPU for the sync waits) from the start, made at each load. */
BPF_F_TABLE("percpu_hash", struct gpu_count_key, __u64, spanlet_gpu_kernel_launches_total,
            SPANLET_GPU_KEYS_MAX, BPF_F_NO_PREALLOC);

/* Metric 2. Named after the metric (seconds) but kept in nanoseconds: sum_ns
 * and the log2 buckets are converted to seconds by the agent at scrape time. */
struct gpu_wait_val {
    __u64 count;
    __u64 sum_ns;
    __u64 bucket[SPANLET_GPU_WAIT_BUCKETS];
};
BPF_F_TABLE("percpu_hash", struct gpu_count_key, struct gpu_wait_val, spanlet_gpu_sync_wait_seconds,
            SPANLET_GPU_KEYS_MAX, BPF_F_NO_PREALLOC);
/* Never written: the zero value new sync-wait keys start from (too big for the stack). */
BPF_PERCPU_ARRAY(gpu_wait_zero, struct gpu_wait_val, 1);

/* The outermost API call a thread is inside. A call made while the same
 * thread is already inside one (cudaLaunchKernel entering cuLaunchKernel,
 * cudaStreamSynchronize entering cuStreamSynchronize) is nested: it is neither
 * counted nor timed. Nesting is told by the stack pointer rather than by a
 * depth counter, which a single missed return would leave off by one for
 * ever: a call whose frame is above the recorded one replaces it. The agent
 * attaches each return probe before its entry probe (no entry is seen without
 * its return) and deletes the records of threads that died inside a call. */
struct gpu_call {
    __u64 pid_tgid;
    __u64 entry_sp;   /* SP at the outermost call's first instruction (points at its return address) */
    __u64 start_ns;
    __u64 func;
    __u64 stream;
    __u32 grid[3];
    __u32 block[3];
    __u32 shared_mem;
    __u8 api;
    __u8 entry;
    __u8 modality;
    __u8 emit;
};
/* Launch and sync calls nest separately: a sync inside a launch still counts. */
BPF_HASH(gpu_launch_calls, __u32, struct gpu_call, SPANLET_GPU_INFLIGHT_MAX);
BPF_HASH(gpu_sync_calls, __u32, struct gpu_call, SPANLET_GPU_INFLIGHT_MAX);

/* Nested when the thread already has a live outer call whose frame is at or
 * above ours (a tail call, cudaStreamSynchronize jumping to
 * cuStreamSynchronize, enters with the same SP). */
static __always_inline int gpu_is_nested(struct gpu_call *outer, __u64 pid_tgid, __u64 sp)
{
    return outer && outer->pid_tgid == pid_tgid && sp <= outer->entry_sp;
}

/* Start a new outermost call in *c: ids, span modality; its time where
 * `timed` (a launch that is neither timed nor sent reads no clock). */
static __always_inline void gpu_call_init(struct gpu_call *c, struct pt_regs *ctx, __u64 pid_tgid,
                                          struct span_ctx_val *span, __u8 api, __u8 entry, int timed)
{
    c->pid_tgid = pid_tgid;
    c->entry_sp = PT_REGS_SP(ctx);
    if (timed)
        c->start_ns = bpf_ktime_get_ns();
    c->api = api;
    c->entry = entry;
    c->modality = span ? span->modality : SPANLET_MOD_OTHER;
}

/* Whether this call becomes a ring-buffer record (see the modes above). In
 * sampled mode the row counts the records sent. Check and add are two steps
 * (the fetch-and-add's result needs BPF v3 atomics, which BCC 0.26 does not
 * emit): threads of one span racing on the same instant may each send one
 * more than SPANLET_GPU_SAMPLED_PER_SPAN; one thread never does. */
static __always_inline __u8 gpu_should_emit(struct span_facts_val *row)
{
#if defined(SPANLET_GPU_EVENTS_ALL)
    return 1;
#elif defined(SPANLET_GPU_EVENTS_SAMPLED)
    if (!row || row->sampled_events >= SPANLET_GPU_SAMPLED_PER_SPAN || !spanlet_cgroup_may_send())
        return 0;
    __sync_fetch_and_add(&row->sampled_events, 1);
    return 1;
#else
    return 0;
#endif
}

static __always_inline void gpu_count_key_of(struct gpu_count_key *k, struct gpu_call *c)
{
    __builtin_memset(k, 0, sizeof(*k));
    k->cgroup_id = bpf_get_current_cgroup_id();
    k->modality = c->modality;
    k->api = c->api;
}

/* Entry of a launch call: counts it unless nested (in the per-CPU map and
 * in the span's facts row), and returns whether the caller should fill in
 * its arguments: for the return probe (a tracked call) or for a record sent
 * now. By default a driver launch is neither: one entry-only uprobe that
 * counts. */
static __always_inline int gpu_launch_begin(struct pt_regs *ctx, struct gpu_call *c, __u8 api, __u8 entry)
{
    __u64 pid_tgid = bpf_get_current_pid_tgid();
    __u32 tid = (__u32)pid_tgid;
#ifdef SPANLET_GPU_TRACK_LAUNCHES
    if (gpu_is_nested(gpu_launch_calls.lookup(&tid), pid_tgid, PT_REGS_SP(ctx)))
        return 0;
#endif
    struct span_ctx_val *span = span_ctx.lookup(&tid);
    /* The clock at entry for a call whose return probe times it; a record
     * sent from here reads it below, and a launch only counted never. */
#if defined(SPANLET_GPU_LAUNCH_TIMING)
    int timed = 1;
#elif defined(SPANLET_GPU_TRACK_LAUNCHES)
    int timed = api != SPANLET_API_DRIVER;
#else
    int timed = 0;
#endif
    gpu_call_init(c, ctx, pid_tgid, span, api, entry, timed);
    struct gpu_count_key k;
    gpu_count_key_of(&k, c);
    /* Atomic even per CPU: a uprobe program can be preempted by another
     * thread's on the same CPU. */
    __u64 one = 1;
    __u64 *n = spanlet_gpu_kernel_launches_total.lookup(&k);
    if (n)
        __sync_fetch_and_add(n, 1);
    else
        spanlet_gpu_kernel_launches_total.update(&k, &one);
    struct span_facts_val *row = span ? spanlet_span_row_of(span, k.cgroup_id) : 0;
    if (row) {
        if (api == SPANLET_API_DRIVER)
            __sync_fetch_and_add(&row->launches_driver, 1);
        else
            __sync_fetch_and_add(&row->launches_runtime, 1);
    }
    c->emit = gpu_should_emit(row);
#ifdef SPANLET_GPU_LAUNCH_TIMING
    return 1;
#else
    if (api != SPANLET_API_DRIVER || c->emit) {
        if (!timed)
            c->start_ns = bpf_ktime_get_ns();   /* the record's time stamp */
        return 1;
    }
    return 0;
#endif
}

/* Records submitted since start; one in SPANLET_GPU_WAKEUP_EVERY wakes the reader. */
BPF_ARRAY(gpu_records_submitted, __u64, 1);

/* Wake the reader once per batch of records, not per record: a wake-up costs
 * the traced thread an interrupt (an IPI; a VM exit on virtual machines) and
 * the reader a context switch. GpuProbe.poll() also consumes when its wait
 * times out, so a record waits at most one poll period. (bpf_ringbuf_query
 * would size batches by bytes, but BCC 0.26 cannot pass it the map.) */
static __always_inline __u64 gpu_wakeup_flags(void)
{
    int zero = 0;
    __u64 *n = gpu_records_submitted.lookup(&zero);
    if (!n)
        return 0;
    /* Not atomic across CPUs: a lost increment only moves a wake-up by a record. */
    __u64 v = *n + 1;
    *n = v;
    return v % SPANLET_GPU_WAKEUP_EVERY == 0 ? BPF_RB_FORCE_WAKEUP : BPF_RB_NO_WAKEUP;
}

/* One launch record: the call's start as its time stamp, the thread's span
 * context as stamped by spanlet_fill_task_hdr, duration_ns 0 when untimed. */
static __always_inline void gpu_emit_launch(struct gpu_call *c, __u64 duration_ns)
{
    struct gpu_launch_event *e = events.ringbuf_reserve(sizeof(*e));
    if (!e) {
        spanlet_count_drop();
        return;
    }
    spanlet_fill_task_hdr(&e->hdr, SPANLET_KIND_GPU_LAUNCH);
    e->duration_ns = duration_ns;
    e->hdr.ts_ns = c->start_ns;
    e->func = c->func;
    e->stream = c->stream;
    __builtin_memcpy(e->grid, c->grid, sizeof(e->grid));
    __builtin_memcpy(e->block, c->block, sizeof(e->block));
    e->shared_mem = c->shared_mem;
    e->api = c->api;
    e->entry = c->entry;
    e->_pad[0] = 0;
    e->_pad[1] = 0;
    events.ringbuf_submit(e, gpu_wakeup_flags());
}

/* After the arguments are in *c: a tracked call waits for its return probe;
 * an untracked (entry-only) driver launch is sent now if sampled. */
static __always_inline void gpu_launch_commit(struct gpu_call *c)
{
#ifdef SPANLET_GPU_TRACK_LAUNCHES
#ifndef SPANLET_GPU_LAUNCH_TIMING
    if (c->api == SPANLET_API_DRIVER) {
        gpu_emit_launch(c, 0);   /* only reached when c->emit */
        return;
    }
#endif
    __u32 tid = (__u32)c->pid_tgid;
    gpu_launch_calls.update(&tid, c);
#else
    gpu_emit_launch(c, 0);
#endif
}

/* x86-64: a 32-bit argument passed on the stack takes an 8-byte slot; at the
 * first instruction [sp] is the return address, the 7th argument is at sp+8. */
static __always_inline __u64 gpu_stack_arg(struct pt_regs *ctx, int slot)
{
    __u64 v = 0;
    bpf_probe_read_user(&v, sizeof(v), (void *)(PT_REGS_SP(ctx) + 8 * slot));
    return v;
}

static __always_inline __u64 gpu_user_u64(__u64 addr)
{
    __u64 v = 0;
    bpf_probe_read_user(&v, sizeof(v), (void *)addr);
    return v;
}

/* -- stream capture and graphs ----------------------------------------------------
 * A launch on a stream that is capturing is recorded into the capture's graph,
 * not run: it is added to the capture here and not counted as a launch. The
 * kernels a capture recorded, or kernel nodes added to a graph the agent saw
 * created, follow the graph through instantiation to its executable graph;
 * each replay adds them (api graph). Handles are per process, keyed with the
 * tgid. Every map is an LRU: a graph pushed out is replayed as "unknown". */
#ifndef SPANLET_GPU_CAPTURES_MAX
#define SPANLET_GPU_CAPTURES_MAX 1024
#endif
#ifndef SPANLET_GPU_GRAPHS_MAX
#define SPANLET_GPU_GRAPHS_MAX 16384
#endif
#define GPU_CU_STREAM_PER_THREAD 0x2

struct gpu_stream_key {
    __u32 tgid;
    __u32 tid;        /* the per-thread default stream is one per thread; 0 for others */
    __u64 stream;
};
struct gpu_capture {
    __u64 kernels;    /* launches recorded so far */
    __u64 into;       /* cuStreamBeginCaptureToGraph's graph, else 0 */
};
struct gpu_graph_key {
    __u32 tgid;
    __u32 _pad;
    __u64 handle;     /* CUgraph or CUgraphExec */
};
BPF_TABLE("lru_hash", struct gpu_stream_key, struct gpu_capture, gpu_captures, SPANLET_GPU_CAPTURES_MAX);
/* Kernels of each graph (by CUgraph) and executable graph (by CUgraphExec). */
BPF_TABLE("lru_hash", struct gpu_graph_key, __u64, gpu_graphs, SPANLET_GPU_GRAPHS_MAX);
BPF_TABLE("lru_hash", struct gpu_graph_key, __u64, gpu_execs, SPANLET_GPU_GRAPHS_MAX);
/* Captures begun and not yet ended, node-wide, as two counters: begun minus
 * ended (kernel-written) and the captures of processes that died capturing,
 * which the agent removed (agent-written, GpuProbe._reap_captures). While
 * they are equal, a launch reads neither its stream nor the capture map. An
 * entry lost to the LRU keeps them apart: launches then take the slower path,
 * and still count right. */
BPF_ARRAY(gpu_captures_active, __u64, 1);
BPF_ARRAY(gpu_captures_reaped, __u64, 1);

/* Metric 1's companion (graph replays) and the replays of graphs whose making
 * the agent did not see (their kernels are unknown: a self-metric). */
BPF_F_TABLE("percpu_hash", struct gpu_count_key, __u64, spanlet_gpu_graph_launches_total,
            SPANLET_GPU_KEYS_MAX, BPF_F_NO_PREALLOC);
BPF_F_TABLE("percpu_hash", struct gpu_count_key, __u64, spanlet_gpu_unknown_graph_launches_total,
            SPANLET_GPU_KEYS_MAX, BPF_F_NO_PREALLOC);

static __always_inline void gpu_stream_key_of(struct gpu_stream_key *k, __u64 stream, int ptsz)
{
    __u64 pid_tgid = bpf_get_current_pid_tgid();
    if (ptsz && stream == 0)
        stream = GPU_CU_STREAM_PER_THREAD;   /* NULL in a _ptsz call */
    k->tgid = pid_tgid >> 32;
    k->tid = stream == GPU_CU_STREAM_PER_THREAD ? (__u32)pid_tgid : 0;
    k->stream = stream;
}

static __always_inline int gpu_capturing(void)
{
    int zero = 0;
    __u64 *n = gpu_captures_active.lookup(&zero);
    if (!n || !*n)
        return 0;
    __u64 *reaped = gpu_captures_reaped.lookup(&zero);
    return !reaped || *n != *reaped;
}

/* Whether `stream` is capturing; if so, `kernels` are added to its capture. */
static __always_inline int gpu_capture_add(__u64 stream, int ptsz, __u64 kernels)
{
    struct gpu_stream_key k = {};
    gpu_stream_key_of(&k, stream, ptsz);
    struct gpu_capture *cap = gpu_captures.lookup(&k);
    if (!cap)
        return 0;
    if (kernels)
        __sync_fetch_and_add(&cap->kernels, kernels);
    return 1;
}

/* Captured rather than launched: for a launch on `stream` (read only while a
 * capture is active anywhere). */
#define GPU_CAPTURED(stream_expr, ptsz) (gpu_capturing() && gpu_capture_add((stream_expr), (ptsz), 1))

/* -- driver launches ------------------------------------------------------------- */
/* CUresult cuLaunchKernel(CUfunction f, unsigned gridDimX, gridDimY, gridDimZ,
 *     blockDimX, blockDimY, blockDimZ, unsigned sharedMemBytes, CUstream hStream,
 *     void **kernelParams, void **extra)
 * rdi=f rsi/rdx/rcx=grid r8/r9=blockX/Y, stack: blockZ, sharedMemBytes, hStream.
 * cuLaunchCooperativeKernel takes the same arguments, without `extra`. */
static __always_inline int gpu_cu_launch(struct pt_regs *ctx, __u8 entry, int ptsz)
{
    if (GPU_CAPTURED(gpu_stack_arg(ctx, 3), ptsz))
        return 0;
    struct gpu_call c = {};
    if (!gpu_launch_begin(ctx, &c, SPANLET_API_DRIVER, entry))
        return 0;
    c.func = PT_REGS_PARM1(ctx);
    c.grid[0] = (__u32)PT_REGS_PARM2(ctx);
    c.grid[1] = (__u32)PT_REGS_PARM3(ctx);
    c.grid[2] = (__u32)PT_REGS_PARM4(ctx);
    c.block[0] = (__u32)PT_REGS_PARM5(ctx);
    c.block[1] = (__u32)PT_REGS_PARM6(ctx);
    c.block[2] = (__u32)gpu_stack_arg(ctx, 1);
    c.shared_mem = (__u32)gpu_stack_arg(ctx, 2);
    c.stream = gpu_stack_arg(ctx, 3);
    gpu_launch_commit(&c);
    return 0;
}

int gpu_cuLaunchKernel(struct pt_regs *ctx)
{
    return gpu_cu_launch(ctx, SPANLET_ENTRY_CU_LAUNCH_KERNEL, 0);
}

int gpu_cuLaunchKernel_ptsz(struct pt_regs *ctx)
{
    return gpu_cu_launch(ctx, SPANLET_ENTRY_CU_LAUNCH_KERNEL_PTSZ, 1);
}

int gpu_cuLaunchCooperativeKernel(struct pt_regs *ctx)
{
    return gpu_cu_launch(ctx, SPANLET_ENTRY_CU_LAUNCH_COOPERATIVE, 0);
}

int gpu_cuLaunchCooperativeKernel_ptsz(struct pt_regs *ctx)
{
    return gpu_cu_launch(ctx, SPANLET_ENTRY_CU_LAUNCH_COOPERATIVE_PTSZ, 1);
}

/* The head of CUlaunchConfig (cuda.h, CUDA >= 11.8). */
struct gpu_cu_launch_config {
    __u32 grid[3];
    __u32 block[3];
    __u32 shared_mem;
    __u32 _pad;
    __u64 stream;
};

/* CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f,
 *     void **kernelParams, void **extra): rdi=config (user memory), rsi=f. */
static __always_inline int gpu_cu_launch_ex(struct pt_regs *ctx, __u8 entry, int ptsz)
{
    __u64 cfg_p = PT_REGS_PARM1(ctx);
    if (GPU_CAPTURED(gpu_user_u64(cfg_p + __builtin_offsetof(struct gpu_cu_launch_config, stream)), ptsz))
        return 0;
    struct gpu_call c = {};
    if (!gpu_launch_begin(ctx, &c, SPANLET_API_DRIVER, entry))
        return 0;
    struct gpu_cu_launch_config cfg = {};
    bpf_probe_read_user(&cfg, sizeof(cfg), (void *)cfg_p);
    c.func = PT_REGS_PARM2(ctx);
    __builtin_memcpy(c.grid, cfg.grid, sizeof(c.grid));
    __builtin_memcpy(c.block, cfg.block, sizeof(c.block));
    c.shared_mem = cfg.shared_mem;
    c.stream = cfg.stream;
    gpu_launch_commit(&c);
    return 0;
}

int gpu_cuLaunchKernelEx(struct pt_regs *ctx)
{
    return gpu_cu_launch_ex(ctx, SPANLET_ENTRY_CU_LAUNCH_KERNEL_EX, 0);
}

int gpu_cuLaunchKernelEx_ptsz(struct pt_regs *ctx)
{
    return gpu_cu_launch_ex(ctx, SPANLET_ENTRY_CU_LAUNCH_KERNEL_EX_PTSZ, 1);
}

/* The legacy launches: cuLaunch(f) runs a 1x1 grid, cuLaunchGrid(f, w, h) and
 * cuLaunchGridAsync(f, w, h, hStream) a w x h one, with the block shape set
 * before by cuFuncSetBlockShape (not known here: block 0). */
static __always_inline int gpu_cu_launch_legacy(struct pt_regs *ctx, __u8 entry, __u32 gx, __u32 gy,
                                                __u64 stream)
{
    struct gpu_call c = {};
    if (!gpu_launch_begin(ctx, &c, SPANLET_API_DRIVER, entry))
        return 0;
    c.func = PT_REGS_PARM1(ctx);
    c.grid[0] = gx;
    c.grid[1] = gy;
    c.grid[2] = 1;
    c.stream = stream;
    gpu_launch_commit(&c);
    return 0;
}

int gpu_cuLaunch(struct pt_regs *ctx)
{
    return gpu_cu_launch_legacy(ctx, SPANLET_ENTRY_CU_LAUNCH, 1, 1, 0);
}

int gpu_cuLaunchGrid(struct pt_regs *ctx)
{
    return gpu_cu_launch_legacy(ctx, SPANLET_ENTRY_CU_LAUNCH_GRID, (__u32)PT_REGS_PARM2(ctx),
                                (__u32)PT_REGS_PARM3(ctx), 0);
}

int gpu_cuLaunchGridAsync(struct pt_regs *ctx)
{
    if (GPU_CAPTURED(PT_REGS_PARM4(ctx), 0))
        return 0;
    return gpu_cu_launch_legacy(ctx, SPANLET_ENTRY_CU_LAUNCH_GRID_ASYNC, (__u32)PT_REGS_PARM2(ctx),
                                (__u32)PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx));
}

/* -- runtime launches (gpu.runtime_hooks) ------------------------------------------
 * A captured runtime launch is left to the driver call it makes, which adds it
 * to the capture: it is neither counted nor tracked here. */
/* cudaError_t cudaLaunchKernel(const void *func, dim3 gridDim, dim3 blockDim,
 *     void **args, size_t sharedMem, cudaStream_t stream)
 * dim3 (12 bytes) by value is two INTEGER eightbytes: gridDim arrives as
 * rsi = x | y << 32 and rdx = z, blockDim as rcx and r8; args in r9,
 * sharedMem and stream on the stack. cudaLaunchCooperativeKernel: the same. */
static __always_inline int gpu_cuda_launch(struct pt_regs *ctx, __u8 entry, int ptsz)
{
    if (gpu_capturing() && gpu_capture_add(gpu_stack_arg(ctx, 2), ptsz, 0))
        return 0;
    struct gpu_call c = {};
    if (!gpu_launch_begin(ctx, &c, SPANLET_API_RUNTIME, entry))
        return 0;
    __u64 grid_xy = PT_REGS_PARM2(ctx), block_xy = PT_REGS_PARM4(ctx);
    c.func = PT_REGS_PARM1(ctx);
    c.grid[0] = (__u32)grid_xy;
    c.grid[1] = (__u32)(grid_xy >> 32);
    c.grid[2] = (__u32)PT_REGS_PARM3(ctx);
    c.block[0] = (__u32)block_xy;
    c.block[1] = (__u32)(block_xy >> 32);
    c.block[2] = (__u32)PT_REGS_PARM5(ctx);
    c.shared_mem = (__u32)gpu_stack_arg(ctx, 1);
    c.stream = gpu_stack_arg(ctx, 2);
    gpu_launch_commit(&c);
    return 0;
}

int gpu_cudaLaunchKernel(struct pt_regs *ctx)
{
    return gpu_cuda_launch(ctx, SPANLET_ENTRY_CUDA_LAUNCH_KERNEL, 0);
}

int gpu_cudaLaunchKernel_ptsz(struct pt_regs *ctx)
{
    return gpu_cuda_launch(ctx, SPANLET_ENTRY_CUDA_LAUNCH_KERNEL_PTSZ, 1);
}

int gpu_cudaLaunchCooperativeKernel(struct pt_regs *ctx)
{
    return gpu_cuda_launch(ctx, SPANLET_ENTRY_CUDA_LAUNCH_COOPERATIVE, 0);
}

int gpu_cudaLaunchCooperativeKernel_ptsz(struct pt_regs *ctx)
{
    return gpu_cuda_launch(ctx, SPANLET_ENTRY_CUDA_LAUNCH_COOPERATIVE_PTSZ, 1);
}

/* cudaLaunchConfig_t: dim3 gridDim, dim3 blockDim, size_t dynamicSmemBytes,
 * cudaStream_t stream, attrs, numAttrs. */
struct gpu_cuda_launch_config {
    __u32 grid[3];
    __u32 block[3];
    __u64 shared_mem;
    __u64 stream;
};

/* cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t *config,
 *     const void *func, void **args): rdi=config, rsi=func. */
static __always_inline int gpu_cuda_launch_ex(struct pt_regs *ctx, __u8 entry, int ptsz)
{
    __u64 cfg_p = PT_REGS_PARM1(ctx);
    struct gpu_cuda_launch_config cfg = {};
    bpf_probe_read_user(&cfg, sizeof(cfg), (void *)cfg_p);
    if (gpu_capturing() && gpu_capture_add(cfg.stream, ptsz, 0))
        return 0;
    struct gpu_call c = {};
    if (!gpu_launch_begin(ctx, &c, SPANLET_API_RUNTIME, entry))
        return 0;
    c.func = PT_REGS_PARM2(ctx);
    __builtin_memcpy(c.grid, cfg.grid, sizeof(c.grid));
    __builtin_memcpy(c.block, cfg.block, sizeof(c.block));
    c.shared_mem = (__u32)cfg.shared_mem;
    c.stream = cfg.stream;
    gpu_launch_commit(&c);
    return 0;
}

int gpu_cudaLaunchKernelExC(struct pt_regs *ctx)
{
    return gpu_cuda_launch_ex(ctx, SPANLET_ENTRY_CUDA_LAUNCH_KERNEL_EXC, 0);
}

int gpu_cudaLaunchKernelExC_ptsz(struct pt_regs *ctx)
{
    return gpu_cuda_launch_ex(ctx, SPANLET_ENTRY_CUDA_LAUNCH_KERNEL_EXC_PTSZ, 1);
}

/* The outermost call of this thread in *calls returns: SP is then above the
 * entry SP (the return address was popped); an inner call's return is below
 * it. Returns the call to finish, or NULL. */
static __always_inline struct gpu_call *gpu_outermost_return(struct gpu_call *c, struct pt_regs *ctx,
                                                             __u64 pid_tgid)
{
    if (!c || c->pid_tgid != pid_tgid || PT_REGS_SP(ctx) <= c->entry_sp)
        return 0;
    return c;
}

int gpu_launch_return(struct pt_regs *ctx)
{
#ifdef SPANLET_GPU_TRACK_LAUNCHES
    __u64 pid_tgid = bpf_get_current_pid_tgid();
    __u32 tid = (__u32)pid_tgid;
    struct gpu_call *c = gpu_outermost_return(gpu_launch_calls.lookup(&tid), ctx, pid_tgid);
    if (!c)
        return 0;
    __u64 ns = bpf_ktime_get_ns() - c->start_ns;
#ifdef SPANLET_GPU_LAUNCH_TIMING
    struct span_ctx_val *span = span_ctx.lookup(&tid);
    struct span_facts_val *row = span ? spanlet_span_row(span) : 0;
    if (row)
        __sync_fetch_and_add(&row->launch_ns, ns);
#endif
    if (c->emit)
        gpu_emit_launch(c, ns);
    gpu_launch_calls.delete(&tid);
#endif
    return 0;
}

/* -- graph replays ----------------------------------------------------------------
 * CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream): one entry-
 * only probe. A replay is a graph launch; the kernels of its graph, when known,
 * are kernel launches with api graph. A replay on a capturing stream is
 * recorded as a child graph: its kernels go to the capture, nothing counts. */
static __always_inline int gpu_graph_launch(struct pt_regs *ctx, __u8 entry, int ptsz)
{
    __u64 pid_tgid = bpf_get_current_pid_tgid();
    __u32 tid = (__u32)pid_tgid;
    struct gpu_graph_key gk = {};
    gk.tgid = pid_tgid >> 32;
    gk.handle = PT_REGS_PARM1(ctx);
    __u64 *known = gpu_execs.lookup(&gk);
    __u64 kernels = known ? *known : 0;
    if (gpu_capturing() && gpu_capture_add(PT_REGS_PARM2(ctx), ptsz, kernels))
        return 0;
    struct span_ctx_val *span = span_ctx.lookup(&tid);
    struct gpu_count_key k = {};
    k.cgroup_id = bpf_get_current_cgroup_id();
    k.modality = span ? span->modality : SPANLET_MOD_OTHER;
    k.api = SPANLET_API_GRAPH;
    /* (BCC rewrites map calls only outside macros: written out twice) */
    __u64 one = 1;
    __u64 *n = spanlet_gpu_graph_launches_total.lookup(&k);
    if (n)
        __sync_fetch_and_add(n, 1);
    else
        spanlet_gpu_graph_launches_total.update(&k, &one);
    if (!known) {
        n = spanlet_gpu_unknown_graph_launches_total.lookup(&k);
        if (n)
            __sync_fetch_and_add(n, 1);
        else
            spanlet_gpu_unknown_graph_launches_total.update(&k, &one);
    } else if (kernels) {
        n = spanlet_gpu_kernel_launches_total.lookup(&k);
        if (n)
            __sync_fetch_and_add(n, kernels);
        else
            spanlet_gpu_kernel_launches_total.update(&k, &kernels);
    }
    struct span_facts_val *row = span ? spanlet_span_row(span) : 0;
    if (row) {
        __sync_fetch_and_add(&row->graph_launches, 1);
        if (kernels)
            __sync_fetch_and_add(&row->graph_kernels, kernels);
    }
    return 0;
}

int gpu_cuGraphLaunch(struct pt_regs *ctx)
{
    return gpu_graph_launch(ctx, SPANLET_ENTRY_CU_GRAPH_LAUNCH, 0);
}

int gpu_cuGraphLaunch_ptsz(struct pt_regs *ctx)
{
    return gpu_graph_launch(ctx, SPANLET_ENTRY_CU_GRAPH_LAUNCH_PTSZ, 1);
}

/* -- making graphs: the rare calls, with a return probe where the result is
 * written through a pointer (read at return, kept only when the call succeeded) */
#define GPU_GRAPH_BEGIN 1
#define GPU_GRAPH_BEGIN_TO_GRAPH 2
#define GPU_GRAPH_END 3
#define GPU_GRAPH_INSTANTIATE 4
#define GPU_GRAPH_CREATE 5

struct gpu_graph_call {
    __u64 pid_tgid;
    __u64 entry_sp;
    __u64 out;        /* where the result is written (CUgraph *, CUgraphExec *) */
    __u64 graph;      /* the graph instantiated, or captured into */
    struct gpu_stream_key stream;
    __u8 kind;
    __u8 _pad[7];
};
BPF_HASH(gpu_graph_calls, __u32, struct gpu_graph_call, SPANLET_GPU_INFLIGHT_MAX);

static __always_inline int gpu_graph_call(struct pt_regs *ctx, __u8 kind, __u64 out, __u64 graph,
                                          __u64 stream, int ptsz)
{
    __u64 pid_tgid = bpf_get_current_pid_tgid();
    __u32 tid = (__u32)pid_tgid;
    struct gpu_graph_call c = {};
    c.pid_tgid = pid_tgid;
    c.entry_sp = PT_REGS_SP(ctx);
    c.out = out;
    c.graph = graph;
    c.kind = kind;
    gpu_stream_key_of(&c.stream, stream, ptsz);
    gpu_graph_calls.update(&tid, &c);
    return 0;
}

/* cuStreamBeginCapture(hStream), _v2(hStream, mode), and their _ptsz twins */
int gpu_cuStreamBeginCapture(struct pt_regs *ctx)
{
    return gpu_graph_call(ctx, GPU_GRAPH_BEGIN, 0, 0, PT_REGS_PARM1(ctx), 0);
}

int gpu_cuStreamBeginCapture_ptsz(struct pt_regs *ctx)
{
    return gpu_graph_call(ctx, GPU_GRAPH_BEGIN, 0, 0, PT_REGS_PARM1(ctx), 1);
}

/* cuStreamBeginCaptureToGraph(hStream, hGraph, dependencies, edgeData, numDependencies, mode) */
int gpu_cuStreamBeginCaptureToGraph(struct pt_regs *ctx)
{
    return gpu_graph_call(ctx, GPU_GRAPH_BEGIN_TO_GRAPH, 0, PT_REGS_PARM2(ctx), PT_REGS_PARM1(ctx), 0);
}

/* cuStreamEndCapture(CUstream hStream, CUgraph *phGraph) */
int gpu_cuStreamEndCapture(struct pt_regs *ctx)
{
    return gpu_graph_call(ctx, GPU_GRAPH_END, PT_REGS_PARM2(ctx), 0, PT_REGS_PARM1(ctx), 0);
}

int gpu_cuStreamEndCapture_ptsz(struct pt_regs *ctx)
{
    return gpu_graph_call(ctx, GPU_GRAPH_END, PT_REGS_PARM2(ctx), 0, PT_REGS_PARM1(ctx), 1);
}

/* cuGraphInstantiate*(CUgraphExec *phGraphExec, CUgraph hGraph, ...) */
int gpu_cuGraphInstantiate(struct pt_regs *ctx)
{
    return gpu_graph_call(ctx, GPU_GRAPH_INSTANTIATE, PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), 0, 0);
}

/* cuGraphCreate(CUgraph *phGraph, unsigned flags) */
int gpu_cuGraphCreate(struct pt_regs *ctx)
{
    return gpu_graph_call(ctx, GPU_GRAPH_CREATE, PT_REGS_PARM1(ctx), 0, 0, 0);
}

static __always_inline void gpu_graph_end(struct gpu_graph_call *c, struct gpu_graph_key *gk, int ok)
{
    struct gpu_capture *cap = gpu_captures.lookup(&c->stream);
    if (!cap)
        return;   /* begun before the agent started (or lost): its graph stays unknown */
    struct gpu_capture v = *cap;
    if (gpu_captures.delete(&c->stream) == 0) {
        int zero = 0;
        __u64 *active = gpu_captures_active.lookup(&zero);
        if (active)
            __sync_fetch_and_add(active, (__u64)-1);
    }
    if (!ok)
        return;
    gk->handle = gpu_user_u64(c->out);
    if (v.into) {
        /* into an existing graph: adds to it, when the agent knows it */
        __u64 *n = gpu_graphs.lookup(gk);
        if (n)
            __sync_fetch_and_add(n, v.kernels);
        return;
    }
    gpu_graphs.update(gk, &v.kernels);
}

int gpu_graph_return(struct pt_regs *ctx)
{
    __u64 pid_tgid = bpf_get_current_pid_tgid();
    __u32 tid = (__u32)pid_tgid;
    struct gpu_graph_call *c = gpu_graph_calls.lookup(&tid);
    if (!c || c->pid_tgid != pid_tgid || PT_REGS_SP(ctx) <= c->entry_sp)
        return 0;
    int ok = (int)PT_REGS_RC(ctx) == 0;   /* CUDA_SUCCESS */
    struct gpu_graph_key gk = {};
    gk.tgid = pid_tgid >> 32;
    __u64 zero64 = 0;
    if (c->kind == GPU_GRAPH_BEGIN || c->kind == GPU_GRAPH_BEGIN_TO_GRAPH) {
        if (ok) {
            struct gpu_capture v = {};
            v.into = c->kind == GPU_GRAPH_BEGIN_TO_GRAPH ? c->graph : 0;
            if (gpu_captures.insert(&c->stream, &v) == 0) {
                int zero = 0;
                __u64 *active = gpu_captures_active.lookup(&zero);
                if (active)
                    __sync_fetch_and_add(active, 1);
            } else {
                gpu_captures.update(&c->stream, &v);   /* a stale one of a reused handle */
            }
        }
    } else if (c->kind == GPU_GRAPH_END) {
        gpu_graph_end(c, &gk, ok);
    } else if (c->kind == GPU_GRAPH_INSTANTIATE) {
        if (ok) {
            struct gpu_graph_key g = {};
            g.tgid = gk.tgid;
            g.handle = c->graph;
            __u64 *n = gpu_graphs.lookup(&g);
            gk.handle = gpu_user_u64(c->out);
            if (n) {
                __u64 kernels = *n;
                gpu_execs.update(&gk, &kernels);
            } else {
                gpu_execs.delete(&gk);   /* a graph made before the agent: unknown */
            }
        }
    } else if (c->kind == GPU_GRAPH_CREATE && ok) {
        gk.handle = gpu_user_u64(c->out);
        gpu_graphs.update(&gk, &zero64);
    }
    gpu_graph_calls.delete(&tid);
    return 0;
}

/* cuGraphAddKernelNode(_v2)(CUgraphNode *phGraphNode, CUgraph hGraph, ...):
 * entry only (an attempt that fails still counts: a program bug, not a path
 * a serving stack takes). A graph the agent did not see made stays unknown. */
int gpu_cuGraphAddKernelNode(struct pt_regs *ctx)
{
    struct gpu_graph_key gk = {};
    gk.tgid = bpf_get_current_pid_tgid() >> 32;
    gk.handle = PT_REGS_PARM2(ctx);
    __u64 *n = gpu_graphs.lookup(&gk);
    if (n)
        __sync_fetch_and_add(n, 1);
    return 0;
}

/* cuGraphDestroy(CUgraph), cuGraphExecDestroy(CUgraphExec): forgotten. */
int gpu_cuGraphDestroy(struct pt_regs *ctx)
{
    struct gpu_graph_key gk = {};
    gk.tgid = bpf_get_current_pid_tgid() >> 32;
    gk.handle = PT_REGS_PARM1(ctx);
    gpu_graphs.delete(&gk);
    return 0;
}

int gpu_cuGraphExecDestroy(struct pt_regs *ctx)
{
    struct gpu_graph_key gk = {};
    gk.tgid = bpf_get_current_pid_tgid() >> 32;
    gk.handle = PT_REGS_PARM1(ctx);
    gpu_execs.delete(&gk);
    return 0;
}

/* -- synchronisation ------------------------------------------------------------- */
static __always_inline int gpu_sync_begin(struct pt_regs *ctx, __u8 api, __u8 entry, __u64 stream)
{
    __u64 pid_tgid = bpf_get_current_pid_tgid();
    __u32 tid = (__u32)pid_tgid;
    if (gpu_is_nested(gpu_sync_calls.lookup(&tid), pid_tgid, PT_REGS_SP(ctx)))
        return 0;
    struct gpu_call c = {};
    gpu_call_init(&c, ctx, pid_tgid, span_ctx.lookup(&tid), api, entry, 1);
    c.stream = stream;
    gpu_sync_calls.update(&tid, &c);
    return 0;
}

/* CUresult cuStreamSynchronize(CUstream hStream) (and _ptsz) */
int gpu_cuStreamSynchronize(struct pt_regs *ctx)
{
    return gpu_sync_begin(ctx, SPANLET_API_DRIVER, SPANLET_ENTRY_CU_STREAM_SYNC, PT_REGS_PARM1(ctx));
}

int gpu_cuStreamSynchronize_ptsz(struct pt_regs *ctx)
{
    return gpu_sync_begin(ctx, SPANLET_API_DRIVER, SPANLET_ENTRY_CU_STREAM_SYNC_PTSZ, PT_REGS_PARM1(ctx));
}

/* CUresult cuCtxSynchronize(void) */
int gpu_cuCtxSynchronize(struct pt_regs *ctx)
{
    return gpu_sync_begin(ctx, SPANLET_API_DRIVER, SPANLET_ENTRY_CU_CTX_SYNC, 0);
}

/* CUresult cuCtxSynchronize_v2(CUcontext ctx): CUDA 13's runtime reaches this one
 * for cudaDeviceSynchronize (seen on an H200 with driver 580), not cuCtxSynchronize */
int gpu_cuCtxSynchronize_v2(struct pt_regs *ctx)
{
    return gpu_sync_begin(ctx, SPANLET_API_DRIVER, SPANLET_ENTRY_CU_CTX_SYNC_V2, 0);
}

/* CUresult cuEventSynchronize(CUevent hEvent): the event is recorded as the stream */
int gpu_cuEventSynchronize(struct pt_regs *ctx)
{
    return gpu_sync_begin(ctx, SPANLET_API_DRIVER, SPANLET_ENTRY_CU_EVENT_SYNC, PT_REGS_PARM1(ctx));
}

/* The runtime's (gpu.runtime_hooks): each reaches the driver call above,
 * nested and not counted again. */
int gpu_cudaStreamSynchronize(struct pt_regs *ctx)
{
    return gpu_sync_begin(ctx, SPANLET_API_RUNTIME, SPANLET_ENTRY_CUDA_STREAM_SYNC, PT_REGS_PARM1(ctx));
}

int gpu_cudaStreamSynchronize_ptsz(struct pt_regs *ctx)
{
    return gpu_sync_begin(ctx, SPANLET_API_RUNTIME, SPANLET_ENTRY_CUDA_STREAM_SYNC_PTSZ,
                          PT_REGS_PARM1(ctx));
}

int gpu_cudaDeviceSynchronize(struct pt_regs *ctx)
{
    return gpu_sync_begin(ctx, SPANLET_API_RUNTIME, SPANLET_ENTRY_CUDA_DEVICE_SYNC, 0);
}

int gpu_cudaEventSynchronize(struct pt_regs *ctx)
{
    return gpu_sync_begin(ctx, SPANLET_API_RUNTIME, SPANLET_ENTRY_CUDA_EVENT_SYNC, PT_REGS_PARM1(ctx));
}

static __always_inline __u32 gpu_wait_bucket(__u64 ns)
{
    __u64 us = ns / 1000;
    __u32 b = 0;
    /* floor(log2(us)) + 1 without a loop */
    if (us >> 32) { b += 32; us >>= 32; }
    if (us >> 16) { b += 16; us >>= 16; }
    if (us >> 8) { b += 8; us >>= 8; }
    if (us >> 4) { b += 4; us >>= 4; }
    if (us >> 2) { b += 2; us >>= 2; }
    if (us >> 1) { b += 1; us >>= 1; }
    return b + (__u32)us;
}

static __always_inline void gpu_wait_add(struct gpu_call *c, __u64 ns)
{
    struct gpu_count_key k;
    gpu_count_key_of(&k, c);
    int zero = 0;
    struct gpu_wait_val *init = gpu_wait_zero.lookup(&zero);
    if (!init)
        return;
    struct gpu_wait_val *w = spanlet_gpu_sync_wait_seconds.lookup_or_try_init(&k, init);
    if (!w)
        return;
    __sync_fetch_and_add(&w->count, 1);
    __sync_fetch_and_add(&w->sum_ns, ns);
    __u32 b = gpu_wait_bucket(ns);
    if (b >= SPANLET_GPU_WAIT_BUCKETS)
        b = SPANLET_GPU_WAIT_BUCKETS - 1;
    /* Hide the bound from the compiler so that the mask the verifier needs
     * is not optimised away. */
    asm volatile("" : "+r"(b));
    __sync_fetch_and_add(&w->bucket[b & (SPANLET_GPU_WAIT_BUCKETS - 1)], 1);
}

int gpu_sync_return(struct pt_regs *ctx)
{
    __u64 pid_tgid = bpf_get_current_pid_tgid();
    __u32 tid = (__u32)pid_tgid;
    struct gpu_call *c = gpu_outermost_return(gpu_sync_calls.lookup(&tid), ctx, pid_tgid);
    if (!c)
        return 0;
    __u64 now = bpf_ktime_get_ns();
    __u64 ns = now - c->start_ns;
    gpu_wait_add(c, ns);
    struct span_ctx_val *span = span_ctx.lookup(&tid);
    struct span_facts_val *row = span ? spanlet_span_row(span) : 0;
    if (row) {
        __sync_fetch_and_add(&row->sync_wait_ns, ns);
        __sync_fetch_and_add(&row->syncs, 1);
    }
    if (gpu_should_emit(row)) {
        struct gpu_sync_event *e = events.ringbuf_reserve(sizeof(*e));
        if (!e) {
            spanlet_count_drop();
        } else {
            spanlet_fill_task_hdr(&e->hdr, SPANLET_KIND_GPU_SYNC);
            e->hdr.ts_ns = c->start_ns;
            e->stream = c->stream;
            e->duration_ns = ns;
            e->api = c->api;
            e->entry = c->entry;
            __builtin_memset(e->_pad, 0, sizeof(e->_pad));
            events.ringbuf_submit(e, gpu_wakeup_flags());
        }
    }
    gpu_sync_calls.delete(&tid);
    return 0;
}

/* -- memory traffic ----------------------------------------------------------------
 * The driver's copy and allocation calls (../shared/CUDA.md): every runtime
 * copy (cudaMemcpy*, PyTorch's .to()/.cpu()) reaches one of them once, so
 * only the driver is hooked and nothing nests. A copy counts at entry
 * (attempts, like launches): bytes by the direction the call states, per
 * cgroup in spanlet_gpu_memcpy_bytes_total and on the span's facts row; a
 * synchronous copy is timed by its return probe (memcpy_ns). Allocations add
 * the bytes asked for to the row. No ring-buffer record: counts only. */
#define GPU_COPY_H2D 0
#define GPU_COPY_D2H 1
#define GPU_COPY_D2D 2
#define GPU_COPY_OTHER 3
/* CUmemorytype (cuda.h) */
#define GPU_MEM_HOST 1
#define GPU_MEM_DEVICE 2
#define GPU_MEM_ARRAY 3

struct gpu_copy_key {
    __u64 cgroup_id;
    __u8 direction;   /* GPU_COPY_* */
    __u8 _pad[7];
};
BPF_F_TABLE("percpu_hash", struct gpu_copy_key, __u64, spanlet_gpu_memcpy_bytes_total,
            SPANLET_GPU_KEYS_MAX, BPF_F_NO_PREALLOC);
/* The synchronous copy each thread is inside: its start, for the return probe. */
BPF_HASH(gpu_copy_calls, __u32, struct gpu_call, SPANLET_GPU_INFLIGHT_MAX);

static __always_inline void gpu_copy_row(struct span_facts_val *row, __u8 dir, __u64 bytes)
{
    if (dir == GPU_COPY_H2D)
        __sync_fetch_and_add(&row->memcpy_h2d_bytes, bytes);
    else if (dir == GPU_COPY_D2H)
        __sync_fetch_and_add(&row->memcpy_d2h_bytes, bytes);
    else if (dir == GPU_COPY_D2D)
        __sync_fetch_and_add(&row->memcpy_d2d_bytes, bytes);
    else
        __sync_fetch_and_add(&row->memcpy_other_bytes, bytes);
    __sync_fetch_and_add(&row->memcpy_calls, 1);
}

static __always_inline int gpu_copy(struct pt_regs *ctx, __u8 dir, __u64 bytes, int sync)
{
    __u64 pid_tgid = bpf_get_current_pid_tgid();
    __u32 tid = (__u32)pid_tgid;
    struct gpu_copy_key k = {};
    k.cgroup_id = bpf_get_current_cgroup_id();
    k.direction = dir;
    __u64 *n = spanlet_gpu_memcpy_bytes_total.lookup(&k);
    if (n)
        __sync_fetch_and_add(n, bytes);
    else
        spanlet_gpu_memcpy_bytes_total.update(&k, &bytes);
    struct span_ctx_val *span = span_ctx.lookup(&tid);
    struct span_facts_val *row = span ? spanlet_span_row_of(span, k.cgroup_id) : 0;
    if (row)
        gpu_copy_row(row, dir, bytes);
    if (sync && row) {
        struct gpu_call c = {};
        gpu_call_init(&c, ctx, pid_tgid, span, SPANLET_API_DRIVER, 0, 1);
        gpu_copy_calls.update(&tid, &c);
    }
    return 0;
}

int gpu_copy_return(struct pt_regs *ctx)
{
    __u64 pid_tgid = bpf_get_current_pid_tgid();
    __u32 tid = (__u32)pid_tgid;
    struct gpu_call *c = gpu_outermost_return(gpu_copy_calls.lookup(&tid), ctx, pid_tgid);
    if (!c)
        return 0;
    __u64 ns = bpf_ktime_get_ns() - c->start_ns;
    struct span_ctx_val *span = span_ctx.lookup(&tid);
    struct span_facts_val *row = span ? spanlet_span_row(span) : 0;
    if (row)
        __sync_fetch_and_add(&row->memcpy_ns, ns);
    gpu_copy_calls.delete(&tid);
    return 0;
}

/* cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t ByteCount), DtoH,
 * DtoD and their _v2_ptds twins; the Async forms add hStream (_v2_ptsz). */
int gpu_copy_h2d(struct pt_regs *ctx)
{
    return gpu_copy(ctx, GPU_COPY_H2D, PT_REGS_PARM3(ctx), 1);
}

int gpu_copy_d2h(struct pt_regs *ctx)
{
    return gpu_copy(ctx, GPU_COPY_D2H, PT_REGS_PARM3(ctx), 1);
}

int gpu_copy_d2d(struct pt_regs *ctx)
{
    return gpu_copy(ctx, GPU_COPY_D2D, PT_REGS_PARM3(ctx), 1);
}

int gpu_copy_h2d_async(struct pt_regs *ctx)
{
    return gpu_copy(ctx, GPU_COPY_H2D, PT_REGS_PARM3(ctx), 0);
}

int gpu_copy_d2h_async(struct pt_regs *ctx)
{
    return gpu_copy(ctx, GPU_COPY_D2H, PT_REGS_PARM3(ctx), 0);
}

int gpu_copy_d2d_async(struct pt_regs *ctx)
{
    return gpu_copy(ctx, GPU_COPY_D2D, PT_REGS_PARM3(ctx), 0);
}

/* cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount): unified
 * addressing, the direction is the driver's to find (other). */
int gpu_copy_unified(struct pt_regs *ctx)
{
    return gpu_copy(ctx, GPU_COPY_OTHER, PT_REGS_PARM3(ctx), 1);
}

int gpu_copy_unified_async(struct pt_regs *ctx)
{
    return gpu_copy(ctx, GPU_COPY_OTHER, PT_REGS_PARM3(ctx), 0);
}

/* cuMemcpyPeer(dstDevice, dstContext, srcDevice, srcContext, ByteCount):
 * device to device, across contexts. */
int gpu_copy_peer(struct pt_regs *ctx)
{
    return gpu_copy(ctx, GPU_COPY_D2D, PT_REGS_PARM5(ctx), 1);
}

int gpu_copy_peer_async(struct pt_regs *ctx)
{
    return gpu_copy(ctx, GPU_COPY_D2D, PT_REGS_PARM5(ctx), 0);
}

/* The direction two CUmemorytype values state: arrays are device memory;
 * unified (or anything else) on either side is not a stated direction. */
static __always_inline __u8 gpu_copy_direction(__u32 src, __u32 dst)
{
    int src_dev = src == GPU_MEM_DEVICE || src == GPU_MEM_ARRAY;
    int dst_dev = dst == GPU_MEM_DEVICE || dst == GPU_MEM_ARRAY;
    if (src == GPU_MEM_HOST && dst_dev)
        return GPU_COPY_H2D;
    if (src_dev && dst == GPU_MEM_HOST)
        return GPU_COPY_D2H;
    if (src_dev && dst_dev)
        return GPU_COPY_D2D;
    return GPU_COPY_OTHER;
}

/* A copy described by a CUDA_MEMCPY2D / CUDA_MEMCPY3D (cuda.h, x86-64
 * offsets): the memory types of both sides and the extent copied. */
#define GPU_2D_SRC_TYPE 16
#define GPU_2D_DST_TYPE 72
#define GPU_2D_WIDTH 112     /* WidthInBytes, then Height */
#define GPU_3D_SRC_TYPE 32
#define GPU_3D_DST_TYPE 120
#define GPU_3D_WIDTH 176     /* WidthInBytes, Height, Depth */

static __always_inline int gpu_copy_desc(struct pt_regs *ctx, __u64 desc, int dims, int sync)
{
    __u32 src = 0, dst = 0;
    __u64 extent[3];   /* (set one by one: an initialiser list would be a constant BCC cannot relocate) */
    extent[0] = 0;
    extent[1] = 0;
    extent[2] = 1;
    int three = dims == 3;
    bpf_probe_read_user(&src, sizeof(src), (void *)(desc + (three ? GPU_3D_SRC_TYPE : GPU_2D_SRC_TYPE)));
    bpf_probe_read_user(&dst, sizeof(dst), (void *)(desc + (three ? GPU_3D_DST_TYPE : GPU_2D_DST_TYPE)));
    if (three)
        bpf_probe_read_user(extent, sizeof(extent), (void *)(desc + GPU_3D_WIDTH));
    else
        bpf_probe_read_user(extent, 2 * sizeof(__u64), (void *)(desc + GPU_2D_WIDTH));
    return gpu_copy(ctx, gpu_copy_direction(src, dst), extent[0] * extent[1] * extent[2], sync);
}

/* cuMemcpy2D_v2(const CUDA_MEMCPY2D *), cuMemcpy2DUnaligned_v2, their
 * _v2_ptds twins; cuMemcpy2DAsync_v2(desc, hStream) and _v2_ptsz. */
int gpu_copy_2d(struct pt_regs *ctx)
{
    return gpu_copy_desc(ctx, PT_REGS_PARM1(ctx), 2, 1);
}

int gpu_copy_2d_async(struct pt_regs *ctx)
{
    return gpu_copy_desc(ctx, PT_REGS_PARM1(ctx), 2, 0);
}

/* cuMemcpy3D_v2(const CUDA_MEMCPY3D *) and _v2_ptds; cuMemcpy3DAsync_v2 and _v2_ptsz. */
int gpu_copy_3d(struct pt_regs *ctx)
{
    return gpu_copy_desc(ctx, PT_REGS_PARM1(ctx), 3, 1);
}

int gpu_copy_3d_async(struct pt_regs *ctx)
{
    return gpu_copy_desc(ctx, PT_REGS_PARM1(ctx), 3, 0);
}

static __always_inline int gpu_alloc(__u64 bytes)
{
    __u32 tid = (__u32)bpf_get_current_pid_tgid();
    struct span_ctx_val *span = span_ctx.lookup(&tid);
    struct span_facts_val *row = span ? spanlet_span_row(span) : 0;
    if (row)
        __sync_fetch_and_add(&row->alloc_bytes, bytes);
    return 0;
}

/* cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize); cuMemAllocAsync(dptr,
 * bytesize, hStream) and _ptsz: the size asked for, at entry. */
int gpu_alloc_bytes(struct pt_regs *ctx)
{
    return gpu_alloc(PT_REGS_PARM2(ctx));
}

/* cuMemAllocPitch_v2(dptr, size_t *pPitch, WidthInBytes, Height, ElementSizeBytes):
 * width times height, the least the driver gives (the pitch it picks may pad rows). */
int gpu_alloc_pitch(struct pt_regs *ctx)
{
    return gpu_alloc(PT_REGS_PARM3(ctx) * PT_REGS_PARM4(ctx));
}
