/* workload.c: a test process that calls the stand-in (or real) CUDA libraries, driven
 * line by line on stdin (see cuda_standin/__init__.py): it loads the libraries with
 * dlopen when told, collects a script of launches, graph calls and syncs, and runs it
 * on "go", printing its results and then "done"; it can also start a second thread
 * that launches, then exits, when released. Every entry point is called through the
 * pointer dlsym returns for its real name. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "cuda_types.h"   /* agent/demo/standin: the structs CUDA passes by pointer */

#define FUNC ((void *)0xf00d)  /* the "kernel" every launch names */
#define MAX_SCRIPT 256

typedef int (*kernel_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                         unsigned, void *, void **, void **);
typedef int (*coop_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                       unsigned, void *, void **);
typedef int (*ex_fn)(const CUlaunchConfig *, void *, void **, void **);
typedef int (*rt_fn)(const void *, dim3, dim3, void **, size_t, void *);
typedef int (*rtex_fn)(const cudaLaunchConfig_t *, const void *, void **);
typedef int (*launch0_fn)(void *);
typedef int (*grid_fn)(void *, int, int);
typedef int (*grid_async_fn)(void *, int, int, void *);
typedef int (*handle_fn)(void *);
typedef int (*handle2_fn)(void *, void *);
typedef int (*void_fn)(void);

/* The launch entry points, by their real names (short names kept for old scripts). */
enum shape { KERNEL, COOP, EX, RT, RTEX, LEGACY, GRID, GRID_ASYNC };
static struct launch_entry {
    const char *name, *alias;
    int runtime;
    enum shape shape;
    void *fn;
} entries[] = {
    {"cuLaunchKernel", "cu", 0, KERNEL, NULL},
    {"cuLaunchKernel_ptsz", NULL, 0, KERNEL, NULL},
    {"cuLaunchKernelEx", "cuex", 0, EX, NULL},
    {"cuLaunchKernelEx_ptsz", NULL, 0, EX, NULL},
    {"cuLaunchCooperativeKernel", NULL, 0, COOP, NULL},
    {"cuLaunchCooperativeKernel_ptsz", NULL, 0, COOP, NULL},
    {"cuLaunch", NULL, 0, LEGACY, NULL},
    {"cuLaunchGrid", NULL, 0, GRID, NULL},
    {"cuLaunchGridAsync", NULL, 0, GRID_ASYNC, NULL},
    {"cudaLaunchKernel", "cuda", 1, RT, NULL},
    {"cudaLaunchKernel_ptsz", NULL, 1, RT, NULL},
    {"cudaLaunchKernelExC", NULL, 1, RTEX, NULL},
    {"cudaLaunchKernelExC_ptsz", NULL, 1, RTEX, NULL},
    {"cudaLaunchCooperativeKernel", NULL, 1, RT, NULL},
    {"cudaLaunchCooperativeKernel_ptsz", NULL, 1, RT, NULL},
};
#define N_ENTRIES (sizeof(entries) / sizeof(entries[0]))

/* Other calls, looked up by name when first used. */
static void *cu_lib, *rt_lib;
static void (*set_device_sync_us)(unsigned int);

static char script[MAX_SCRIPT][1024];
static int nscript;

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + ts.tv_nsec;
}

static void *lookup(const char *name)
{
    void *p = NULL;
    if (!strncmp(name, "cuda", 4) || !strncmp(name, "standin_set_device", 18))
        p = rt_lib ? dlsym(rt_lib, name) : NULL;
    else
        p = cu_lib ? dlsym(cu_lib, name) : NULL;
    if (!p)
        printf("error no symbol %s\n", name);
    return p;
}

/* load DIR: the driver and runtime of DIR; load-driver PATH, load-runtime PATH: one each */
static int open_lib(const char *path, void **out)
{
    void *h = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    if (!h) {
        printf("error %s\n", dlerror());
        return -1;
    }
    *out = h;
    return 0;
}

static void load(const char *dir)
{
    char path[1100];
    snprintf(path, sizeof(path), "%s/libcuda.so.1", dir);
    if (open_lib(path, &cu_lib))
        return;
    snprintf(path, sizeof(path), "%s/libcudart.so.12", dir);
    if (open_lib(path, &rt_lib))
        return;
    printf("loaded\n");
}

static void bind_entries(void)
{
    for (size_t i = 0; i < N_ENTRIES; i++)
        entries[i].fn = dlsym(entries[i].runtime ? rt_lib : cu_lib, entries[i].name);
}

static struct launch_entry *entry_named(const char *name)
{
    for (size_t i = 0; i < N_ENTRIES; i++)
        if (!strcmp(entries[i].name, name) || (entries[i].alias && !strcmp(entries[i].alias, name)))
            return &entries[i];
    return NULL;
}

/* One launch; returns its CUresult / cudaError_t. */
static int launch_once(struct launch_entry *e, void *f, unsigned long *g, unsigned long *b,
                       unsigned long shmem, void *s)
{
    dim3 gd = {g[0], g[1], g[2]}, bd = {b[0], b[1], b[2]};
    switch (e->shape) {
    case KERNEL:
        return ((kernel_fn)e->fn)(f, g[0], g[1], g[2], b[0], b[1], b[2], shmem, s, NULL, NULL);
    case COOP:
        return ((coop_fn)e->fn)(f, g[0], g[1], g[2], b[0], b[1], b[2], shmem, s, NULL);
    case EX: {
        CUlaunchConfig c = {g[0], g[1], g[2], b[0], b[1], b[2], shmem, s, NULL, 0};
        return ((ex_fn)e->fn)(&c, f, NULL, NULL);
    }
    case RT:
        return ((rt_fn)e->fn)(f, gd, bd, NULL, shmem, s);
    case RTEX: {
        cudaLaunchConfig_t c = {gd, bd, shmem, s, NULL, 0};
        return ((rtex_fn)e->fn)(&c, f, NULL);
    }
    case LEGACY:
        return ((launch0_fn)e->fn)(f);
    case GRID:
        return ((grid_fn)e->fn)(f, (int)g[0], (int)g[1]);
    case GRID_ASYNC:
        return ((grid_async_fn)e->fn)(f, (int)g[0], (int)g[1], s);
    }
    return -1;
}

/* ENTRY N GX GY GZ BX BY BZ SHMEM STREAM [FUNC]: prints "failed K RC" when K of them failed */
static void launches(struct launch_entry *e, const char *args)
{
    unsigned long n, g[3], b[3], shmem;
    unsigned long long stream, func = (uintptr_t)FUNC;
    int got = sscanf(args, "%lu %lu %lu %lu %lu %lu %lu %lu %lli %lli", &n, &g[0], &g[1], &g[2],
                     &b[0], &b[1], &b[2], &shmem, &stream, &func);
    if (got < 9) {
        printf("error bad launch line: %s %s\n", e->name, args);
        return;
    }
    if (!e->fn) {
        printf("error no symbol %s\n", e->name);
        return;
    }
    void *s = (void *)(uintptr_t)stream;
    unsigned long failed = 0;
    int rc = 0;
    for (unsigned long i = 0; i < n; i++) {
        int r = launch_once(e, (void *)(uintptr_t)func, g, b, shmem, s);
        if (r) {
            failed++;
            rc = r;
        }
    }
    if (failed)
        printf("failed %lu %d\n", failed, rc);
}

/* Graph and capture calls: NAME ARGS..., each printing "NAME RC [HANDLE]". */
static void graph_call(const char *cmd, const char *rest)
{
    char name[64];
    unsigned long long a = 0, b = 0;
    int n = sscanf(rest, "%63s %lli %lli", name, &a, &b);
    if (n < 1) {
        printf("error bad graph line: %s %s\n", cmd, rest);
        return;
    }
    void *fn = lookup(name);
    if (!fn)
        return;
    void *out = NULL;
    int rc;
    if (!strcmp(cmd, "begin")) {           /* begin SYMBOL STREAM [MODE or GRAPH] */
        if (strstr(name, "ToGraph"))
            rc = ((int (*)(void *, void *, void *, void *, size_t, int))fn)(
                (void *)(uintptr_t)a, (void *)(uintptr_t)b, NULL, NULL, 0, 0);
        else if (strstr(name, "_v2") || !strncmp(name, "cuda", 4))
            rc = ((int (*)(void *, int))fn)((void *)(uintptr_t)a, (int)b);
        else
            rc = ((handle_fn)fn)((void *)(uintptr_t)a);
        printf("begin %d\n", rc);
    } else if (!strcmp(cmd, "end")) {      /* end SYMBOL STREAM -> graph */
        rc = ((handle2_fn)fn)((void *)(uintptr_t)a, &out);
        printf("end %d %#llx\n", rc, (unsigned long long)(uintptr_t)out);
    } else if (!strcmp(cmd, "create")) {   /* create cuGraphCreate -> graph */
        rc = ((int (*)(void **, unsigned))fn)(&out, 0);
        printf("create %d %#llx\n", rc, (unsigned long long)(uintptr_t)out);
    } else if (!strcmp(cmd, "addnode")) {  /* addnode SYMBOL GRAPH N */
        rc = 0;
        for (unsigned long long i = 0; i < (b ? b : 1); i++)
            rc |= ((int (*)(void **, void *, void *, size_t, void *))fn)(
                &out, (void *)(uintptr_t)a, NULL, 0, NULL);
        printf("addnode %d\n", rc);
    } else if (!strcmp(cmd, "inst")) {     /* inst SYMBOL GRAPH -> exec */
        if (!strcmp(name, "cuGraphInstantiate") || !strcmp(name, "cuGraphInstantiate_v2"))
            rc = ((int (*)(void **, void *, void *, char *, size_t))fn)(
                &out, (void *)(uintptr_t)a, NULL, NULL, 0);
        else   /* WithFlags, WithParams(_ptsz), cudaGraphInstantiate: a third word */
            rc = ((int (*)(void **, void *, unsigned long long))fn)(&out, (void *)(uintptr_t)a, 0);
        printf("inst %d %#llx\n", rc, (unsigned long long)(uintptr_t)out);
    } else if (!strcmp(cmd, "replay")) {   /* replay SYMBOL EXEC N [STREAM as 4th word] */
        unsigned long long stream = 0;
        int failed = 0;
        sscanf(rest, "%*s %*i %*i %lli", &stream);
        for (unsigned long long i = 0; i < b; i++)
            failed += ((handle2_fn)fn)((void *)(uintptr_t)a, (void *)(uintptr_t)stream) != 0;
        printf("replay %d\n", failed);
    } else {                               /* destroy SYMBOL HANDLE */
        rc = ((handle_fn)fn)((void *)(uintptr_t)a);
        printf("destroy %d\n", rc);
    }
}

/* SYNC-SYMBOL US (or the short names cusync, cudasync, devsync): prints
 * "sync NAME NS", how long the call took */
static void sync_call(const char *name, unsigned long us)
{
    const char *sym = !strcmp(name, "cusync") ? "cuStreamSynchronize"
                    : !strcmp(name, "cudasync") ? "cudaStreamSynchronize"
                    : !strcmp(name, "devsync") ? "cudaDeviceSynchronize" : name;
    void *fn = lookup(sym);
    if (!fn)
        return;
    uint64_t t0 = now_ns();
    int v2 = !strcmp(sym, "cuCtxSynchronize_v2");   /* its argument: NULL, the current context */
    if (v2 || !strcmp(sym, "cudaDeviceSynchronize") || !strcmp(sym, "cuCtxSynchronize")) {
        if (!set_device_sync_us && rt_lib)   /* stand-ins only: a real driver has no setter */
            set_device_sync_us = dlsym(rt_lib, "standin_set_device_sync_us");
        if (!set_device_sync_us && cu_lib)
            set_device_sync_us = dlsym(cu_lib, "standin_set_ctx_sync_us");
        if (set_device_sync_us)
            set_device_sync_us(us);
        if (v2)
            ((handle_fn)fn)(NULL);
        else
            ((void_fn)fn)();
    } else {
        ((handle_fn)fn)((void *)(uintptr_t)us);
    }
    printf("sync %s %llu\n", name, (unsigned long long)(now_ns() - t0));
}

/* bench N: N back-to-back cuLaunchKernel calls; benchrt N: cudaLaunchKernel;
 * benchx ENTRY N: any launch entry point; benchgraph SYMBOL EXEC N: replays */
static void bench(const char *name, struct launch_entry *e, unsigned long n)
{
    unsigned long one[3] = {1, 1, 1};
    uint64_t t0 = now_ns();
    for (unsigned long i = 0; i < n; i++)
        launch_once(e, FUNC, one, one, 0, NULL);
    printf("%s %lu %llu\n", name, n, (unsigned long long)(now_ns() - t0));
}

static void bench_graph(const char *rest)
{
    char name[64];
    unsigned long long exec, n;
    if (sscanf(rest, "%63s %lli %llu", name, &exec, &n) != 3) {
        printf("error bad benchgraph line\n");
        return;
    }
    handle2_fn fn = (handle2_fn)lookup(name);
    if (!fn)
        return;
    uint64_t t0 = now_ns();
    for (unsigned long long i = 0; i < n; i++)
        fn((void *)(uintptr_t)exec, NULL);
    printf("benchgraph %llu %llu\n", n, (unsigned long long)(now_ns() - t0));
}

/* paced N RATE: N cuLaunchKernel calls spread evenly at RATE per second. Each
 * one's time is fixed from the start, so a late wake-up delays one launch, not
 * the ones after it; up to PACE_SPIN_NS before it the loop spins, and sleeps
 * until then (a slow pace, e.g. the soak's 1,000/s, would otherwise keep a
 * core busy that the agent it measures shares). */
#define PACE_SPIN_NS 100000ull
static void paced(unsigned long n, double rate)
{
    unsigned long one[3] = {1, 1, 1};
    struct launch_entry *e = entry_named("cuLaunchKernel");
    uint64_t t0 = now_ns();
    double step = 1e9 / rate;
    for (unsigned long i = 0; i < n; i++) {
        uint64_t due = t0 + (uint64_t)(i * step);
        uint64_t now = now_ns();
        if (due > now + PACE_SPIN_NS) {
            uint64_t wake = due - PACE_SPIN_NS;
            struct timespec ts = {.tv_sec = wake / 1000000000ull, .tv_nsec = wake % 1000000000ull};
            while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
                ;
        }
        while (now_ns() < due)
            ;
        launch_once(e, FUNC, one, one, 0, NULL);
    }
    printf("paced %lu %llu\n", n, (unsigned long long)(now_ns() - t0));
}

/* copy SYMBOL N ARGS...: N calls of a driver copy or allocation call, or of
 * the runtime's cudaMemcpy(Async)/cudaMalloc, by its real name; the arguments
 * that matter per shape:
 *   1D copies (cuMemcpy*, _v2, Async, _ptds, _ptsz, Peer)   BYTES
 *   2D/3D copies (cuMemcpy2D*, cuMemcpy3D*)   SRC-TYPE DST-TYPE WIDTH HEIGHT [DEPTH]
 *   cuMemAlloc_v2, cuMemAllocAsync(_ptsz)     BYTES
 *   cuMemAllocPitch_v2                        WIDTH HEIGHT
 *   cudaMemcpy, cudaMemcpyAsync               BYTES KIND (cudaMemcpyKind)
 *   cudaMalloc                                BYTES
 * prints "copy NAME FAILED NS" (how long the N calls took) */
static char host_buf[64];

static int copy_once(const char *name, void *fn, unsigned long long *a)
{
    unsigned long long dev = 0x7f0000001000ULL;
    void *host = host_buf, *stream = (void *)0x21;
    if (!strncmp(name, "cudaMemcpy", 10)) {
        if (strstr(name, "Async"))
            return ((int (*)(void *, const void *, size_t, int, void *))fn)(host, host, a[0], (int)a[1], stream);
        return ((int (*)(void *, const void *, size_t, int))fn)(host, host, a[0], (int)a[1]);
    }
    if (!strcmp(name, "cudaMalloc") || !strncmp(name, "cuMemAlloc_v2", 13)
        || !strncmp(name, "cuMemAllocAsync", 15)) {
        void *out = NULL;
        if (strstr(name, "Async"))
            return ((int (*)(void **, size_t, void *))fn)(&out, a[0], stream);
        return ((int (*)(void **, size_t))fn)(&out, a[0]);
    }
    if (!strcmp(name, "cuMemAllocPitch_v2")) {
        unsigned long long out;
        size_t pitch;
        return ((int (*)(void *, size_t *, size_t, size_t, unsigned))fn)(&out, &pitch, a[0], a[1], 4);
    }
    if (strstr(name, "2D") || strstr(name, "3D")) {
        CUDA_MEMCPY2D d2 = {0};
        CUDA_MEMCPY3D d3 = {0};
        void *desc;
        if (strstr(name, "2D")) {
            d2.srcMemoryType = (CUmemorytype)a[0];
            d2.dstMemoryType = (CUmemorytype)a[1];
            d2.WidthInBytes = a[2];
            d2.Height = a[3];
            desc = &d2;
        } else {
            d3.srcMemoryType = (CUmemorytype)a[0];
            d3.dstMemoryType = (CUmemorytype)a[1];
            d3.WidthInBytes = a[2];
            d3.Height = a[3];
            d3.Depth = a[4];
            desc = &d3;
        }
        if (strstr(name, "Async"))
            return ((int (*)(const void *, void *))fn)(desc, stream);
        return ((int (*)(const void *))fn)(desc);
    }
    if (strstr(name, "Peer")) {
        if (strstr(name, "Async"))
            return ((int (*)(unsigned long long, void *, unsigned long long, void *, size_t, void *))fn)(
                dev, NULL, dev, NULL, a[0], stream);
        return ((int (*)(unsigned long long, void *, unsigned long long, void *, size_t))fn)(
            dev, NULL, dev, NULL, a[0]);
    }
    /* HtoD, DtoH, DtoD, cuMemcpy: (dst, src, bytes[, stream]); pointers as words */
    if (strstr(name, "Async"))
        return ((int (*)(unsigned long long, unsigned long long, size_t, void *))fn)(dev, dev, a[0], stream);
    return ((int (*)(unsigned long long, unsigned long long, size_t))fn)(dev, dev, a[0]);
}

static void copies(const char *rest)
{
    char name[64];
    unsigned long long n, a[5] = {0, 0, 0, 0, 1};
    if (sscanf(rest, "%63s %lli %lli %lli %lli %lli %lli", name, &n, &a[0], &a[1], &a[2], &a[3], &a[4]) < 3) {
        printf("error bad copy line: %s\n", rest);
        return;
    }
    void *fn = lookup(name);
    if (!fn)
        return;
    int failed = 0;
    uint64_t t0 = now_ns();
    for (unsigned long long i = 0; i < n; i++)
        failed += copy_once(name, fn, a) != 0;
    printf("copy %s %d %llu\n", name, failed, (unsigned long long)(now_ns() - t0));
}

static int is_sync(const char *cmd)
{
    return !strcmp(cmd, "cusync") || !strcmp(cmd, "cudasync") || !strcmp(cmd, "devsync")
        || strstr(cmd, "Synchronize") != NULL;
}

static void run(const char *line)
{
    char cmd[64];
    int off = 0;
    if (sscanf(line, "%63s %n", cmd, &off) < 1)
        return;
    const char *rest = line + off;
    struct launch_entry *e = entry_named(cmd);
    if (e)
        launches(e, rest);
    else if (is_sync(cmd))
        sync_call(cmd, strtoul(rest, NULL, 0));
    else if (!strcmp(cmd, "begin") || !strcmp(cmd, "end") || !strcmp(cmd, "create")
             || !strcmp(cmd, "addnode") || !strcmp(cmd, "inst") || !strcmp(cmd, "replay")
             || !strcmp(cmd, "destroy"))
        graph_call(cmd, rest);
    else if (!strcmp(cmd, "copy"))
        copies(rest);
    else if (!strcmp(cmd, "bench"))
        bench(cmd, entry_named("cuLaunchKernel"), strtoul(rest, NULL, 0));
    else if (!strcmp(cmd, "benchrt"))
        bench(cmd, entry_named("cudaLaunchKernel"), strtoul(rest, NULL, 0));
    else if (!strcmp(cmd, "benchx")) {
        char name[64];
        unsigned long n;
        struct launch_entry *x;
        if (sscanf(rest, "%63s %lu", name, &n) == 2 && (x = entry_named(name)) && x->fn)
            bench(cmd, x, n);
        else
            printf("error bad benchx line: %s\n", rest);
    } else if (!strcmp(cmd, "benchgraph"))
        bench_graph(rest);
    else if (!strcmp(cmd, "paced")) {
        unsigned long n;
        double rate;
        if (sscanf(rest, "%lu %lf", &n, &rate) == 2)
            paced(n, rate);
    } else
        printf("error unknown command %s\n", cmd);
}

/* thread N: a thread that prints "thread TID", waits for "release", makes N
 * cuLaunchKernel calls and exits (inside whatever span it was given). */
static pthread_t worker;
static sem_t worker_go;
static unsigned long worker_launches;

static void *worker_main(void *arg)
{
    (void)arg;
    unsigned long one[3] = {1, 1, 1};
    struct launch_entry *e = entry_named("cuLaunchKernel");
    printf("thread %ld\n", (long)syscall(SYS_gettid));
    sem_wait(&worker_go);
    for (unsigned long i = 0; i < worker_launches; i++)
        launch_once(e, FUNC, one, one, 0, NULL);
    return NULL;
}

int main(void)
{
    char line[1024];
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ready %d %ld\n", getpid(), (long)syscall(SYS_gettid));
    while (fgets(line, sizeof(line), stdin)) {
        line[strcspn(line, "\n")] = 0;
        if (!strncmp(line, "load ", 5)) {
            load(line + 5);
            bind_entries();
        } else if (!strncmp(line, "load-driver ", 12)) {
            if (!open_lib(line + 12, &cu_lib)) {
                bind_entries();
                printf("loaded\n");
            }
        } else if (!strncmp(line, "load-runtime ", 13)) {
            if (!open_lib(line + 13, &rt_lib)) {
                bind_entries();
                printf("loaded\n");
            }
        } else if (!strncmp(line, "dlopen ", 7)) {
            if (dlopen(line + 7, RTLD_NOW | RTLD_LOCAL))
                printf("opened\n");
            else
                printf("error %s\n", dlerror());
        } else if (!strcmp(line, "go")) {
            for (int i = 0; i < nscript; i++)
                run(script[i]);
            nscript = 0;
            printf("done\n");
        } else if (!strncmp(line, "thread ", 7)) {
            worker_launches = strtoul(line + 7, NULL, 0);
            sem_init(&worker_go, 0, 0);
            if (pthread_create(&worker, NULL, worker_main, NULL))
                printf("error pthread_create\n");
        } else if (!strcmp(line, "release")) {
            sem_post(&worker_go);
            pthread_join(worker, NULL);
            printf("joined\n");
        } else if (!strcmp(line, "exit")) {
            break;
        } else if (line[0] && nscript < MAX_SCRIPT) {
            snprintf(script[nscript++], sizeof(script[0]), "%s", line);
        } else if (line[0]) {
            printf("error script longer than %d lines\n", MAX_SCRIPT);
        }
    }
    return 0;
}
