/* gpu_launch.bpf.c: uprobes on the CUDA driver (and optionally runtime) launch
 * calls and entry/return probes on the synchronisation calls. Counts launches
 * and sync wait per (cgroup, modality, api) in per-CPU maps, adds them to the
 * span facts row of the calling thread's span, and sends a sampled side
 * stream of launch/sync records through the ring buffer. */
#include <uapi/linux/ptrace.h>  /* struct pt_regs, as every BCC uprobe tool uses it */
#include "spanlet.h"

/* Which calls become ring-buffer records (GpuConfig.launch_events):
 *   -DSPANLET_GPU_EVENTS_ALL      every outermost launch and sync call;
 *   -DSPANLET_GPU_EVENTS_SAMPLED  the first SPANLET_GPU_SAMPLED_PER_SPAN calls of
 *                                 each span (counted in its facts row);
 *   neither                       none: counts and span facts only.
 * -DSPANLET_GPU_LAUNCH_TIMING: driver launches get a return probe and their
 * call time is measured (launch_ns); without it a driver launch is one
 * entry-only uprobe. -DSPANLET_GPU_RUNTIME_HOOKS: cudaLaunchKernel is hooked
 * too (the driver call it makes is then nested and not counted again).
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

/* Metric 1: outermost launch calls. */
BPF_PERCPU_HASH(spanlet_gpu_kernel_launches_total, struct gpu_count_key, __u64, SPANLET_GPU_KEYS_MAX);

/* Metric 2. Named after the metric (seconds) but kept in nanoseconds: sum_ns
 * and the log2 buckets are converted to seconds by the agent at scrape time. */
struct gpu_wait_val {
    __u64 count;
    __u64 sum_ns;
    __u64 bucket[SPANLET_GPU_WAIT_BUCKETS];
};
BPF_PERCPU_HASH(spanlet_gpu_sync_wait_seconds, struct gpu_count_key, struct gpu_wait_val, SPANLET_GPU_KEYS_MAX);
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

/* Start a new outermost call in *c: ids, time, span modality. */
static __always_inline void gpu_call_init(struct gpu_call *c, struct pt_regs *ctx, __u64 pid_tgid,
                                          struct span_ctx_val *span, __u8 api, __u8 entry)
{
    c->pid_tgid = pid_tgid;
    c->entry_sp = PT_REGS_SP(ctx);
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
    if (!row || row->sampled_events >= SPANLET_GPU_SAMPLED_PER_SPAN)
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
    gpu_call_init(c, ctx, pid_tgid, span, api, entry);
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
    struct span_facts_val *row = span ? spanlet_span_row(span) : 0;
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
    return api != SPANLET_API_DRIVER || c->emit;
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

/* CUresult cuLaunchKernel(CUfunction f, unsigned gridDimX, gridDimY, gridDimZ,
 *     blockDimX, blockDimY, blockDimZ, unsigned sharedMemBytes, CUstream hStream,
 *     void **kernelParams, void **extra)
 * rdi=f rsi/rdx/rcx=grid r8/r9=blockX/Y, stack: blockZ, sharedMemBytes, hStream. */
static __always_inline int gpu_cu_launch(struct pt_regs *ctx, __u8 entry)
{
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

int gpu_cu_launch_kernel(struct pt_regs *ctx)
{
    return gpu_cu_launch(ctx, SPANLET_ENTRY_CU_LAUNCH_KERNEL);
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
int gpu_cu_launch_kernel_ex(struct pt_regs *ctx)
{
    struct gpu_call c = {};
    if (!gpu_launch_begin(ctx, &c, SPANLET_API_DRIVER, SPANLET_ENTRY_CU_LAUNCH_KERNEL_EX))
        return 0;
    struct gpu_cu_launch_config cfg = {};
    bpf_probe_read_user(&cfg, sizeof(cfg), (void *)PT_REGS_PARM1(ctx));
    c.func = PT_REGS_PARM2(ctx);
    __builtin_memcpy(c.grid, cfg.grid, sizeof(c.grid));
    __builtin_memcpy(c.block, cfg.block, sizeof(c.block));
    c.shared_mem = cfg.shared_mem;
    c.stream = cfg.stream;
    gpu_launch_commit(&c);
    return 0;
}

/* cudaError_t cudaLaunchKernel(const void *func, dim3 gridDim, dim3 blockDim,
 *     void **args, size_t sharedMem, cudaStream_t stream)
 * dim3 (12 bytes) by value is two INTEGER eightbytes: gridDim arrives as
 * rsi = x | y << 32 and rdx = z, blockDim as rcx and r8; args in r9,
 * sharedMem and stream on the stack. */
int gpu_cuda_launch_kernel(struct pt_regs *ctx)
{
    struct gpu_call c = {};
    if (!gpu_launch_begin(ctx, &c, SPANLET_API_RUNTIME, SPANLET_ENTRY_CUDA_LAUNCH_KERNEL))
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

static __always_inline int gpu_sync_begin(struct pt_regs *ctx, __u8 api, __u8 entry, __u64 stream)
{
    __u64 pid_tgid = bpf_get_current_pid_tgid();
    __u32 tid = (__u32)pid_tgid;
    if (gpu_is_nested(gpu_sync_calls.lookup(&tid), pid_tgid, PT_REGS_SP(ctx)))
        return 0;
    struct gpu_call c = {};
    gpu_call_init(&c, ctx, pid_tgid, span_ctx.lookup(&tid), api, entry);
    c.stream = stream;
    gpu_sync_calls.update(&tid, &c);
    return 0;
}

/* CUresult cuStreamSynchronize(CUstream hStream) */
int gpu_cu_stream_sync(struct pt_regs *ctx)
{
    return gpu_sync_begin(ctx, SPANLET_API_DRIVER, SPANLET_ENTRY_CU_STREAM_SYNC, PT_REGS_PARM1(ctx));
}

/* cudaError_t cudaStreamSynchronize(cudaStream_t stream) */
int gpu_cuda_stream_sync(struct pt_regs *ctx)
{
    return gpu_sync_begin(ctx, SPANLET_API_RUNTIME, SPANLET_ENTRY_CUDA_STREAM_SYNC, PT_REGS_PARM1(ctx));
}

/* cudaError_t cudaDeviceSynchronize(void) */
int gpu_cuda_device_sync(struct pt_regs *ctx)
{
    return gpu_sync_begin(ctx, SPANLET_API_RUNTIME, SPANLET_ENTRY_CUDA_DEVICE_SYNC, 0);
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
