/* workload.c: a test process that launches "kernels" through the stand-in
 * CUDA libraries, driven line by line on stdin (see cuda_standin/__init__.py):
 * it loads the libraries with dlopen when told, collects a script of launches
 * and syncs, and runs it on "go", printing its results and then "done"; it can
 * also start a second thread that launches, then exits, when released. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define FUNC ((void *)0xf00d)  /* the "kernel" every launch names */
#define MAX_SCRIPT 256

typedef struct { unsigned int x, y, z; } dim3;
typedef struct {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    void *hStream;
    void *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

static int (*cu_launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        unsigned, void *, void **, void **);
static int (*cu_launch_ex)(const CUlaunchConfig *, void *, void **, void **);
static int (*cu_stream_sync)(void *);
static int (*cuda_launch)(const void *, dim3, dim3, void **, size_t, void *);
static int (*cuda_stream_sync)(void *);
static int (*cuda_device_sync)(void);
static void (*set_device_sync_us)(unsigned int);

static char script[MAX_SCRIPT][1024];
static int nscript;

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + ts.tv_nsec;
}

static void *must_sym(void *h, const char *name)
{
    void *p = dlsym(h, name);
    if (!p) {
        printf("error no symbol %s\n", name);
        exit(3);
    }
    return p;
}

/* load DIR: the driver and runtime stand-ins of DIR */
static void load(const char *dir)
{
    char path[1100];
    snprintf(path, sizeof(path), "%s/libcuda.so.1", dir);
    void *cu = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    snprintf(path, sizeof(path), "%s/libcudart.so.12", dir);
    void *rt = cu ? dlopen(path, RTLD_NOW | RTLD_GLOBAL) : NULL;
    if (!cu || !rt) {
        printf("error %s\n", dlerror());
        return;
    }
    cu_launch = must_sym(cu, "cuLaunchKernel");
    cu_launch_ex = must_sym(cu, "cuLaunchKernelEx");
    cu_stream_sync = must_sym(cu, "cuStreamSynchronize");
    cuda_launch = must_sym(rt, "cudaLaunchKernel");
    cuda_stream_sync = must_sym(rt, "cudaStreamSynchronize");
    cuda_device_sync = must_sym(rt, "cudaDeviceSynchronize");
    set_device_sync_us = must_sym(rt, "standin_set_device_sync_us");
    printf("loaded\n");
}

/* API N GX GY GZ BX BY BZ SHMEM STREAM */
static void launches(const char *api, const char *args)
{
    unsigned long n, g[3], b[3], shmem;
    unsigned long long stream;
    if (sscanf(args, "%lu %lu %lu %lu %lu %lu %lu %lu %lli", &n, &g[0], &g[1], &g[2], &b[0],
               &b[1], &b[2], &shmem, &stream) != 9) {
        printf("error bad launch line: %s %s\n", api, args);
        return;
    }
    void *s = (void *)(uintptr_t)stream;
    for (unsigned long i = 0; i < n; i++) {
        if (!strcmp(api, "cu")) {
            cu_launch(FUNC, g[0], g[1], g[2], b[0], b[1], b[2], shmem, s, NULL, NULL);
        } else if (!strcmp(api, "cuex")) {
            CUlaunchConfig c = {g[0], g[1], g[2], b[0], b[1], b[2], shmem, s, NULL, 0};
            cu_launch_ex(&c, FUNC, NULL, NULL);
        } else {
            dim3 gd = {g[0], g[1], g[2]}, bd = {b[0], b[1], b[2]};
            cuda_launch(FUNC, gd, bd, NULL, shmem, s);
        }
    }
}

/* cusync|cudasync|devsync MICROSECONDS: prints how long the call took */
static void sync_call(const char *api, unsigned long us)
{
    uint64_t t0 = now_ns();
    if (!strcmp(api, "cusync")) {
        cu_stream_sync((void *)(uintptr_t)us);
    } else if (!strcmp(api, "cudasync")) {
        cuda_stream_sync((void *)(uintptr_t)us);
    } else {
        set_device_sync_us(us);
        cuda_device_sync();
    }
    printf("sync %s %llu\n", api, (unsigned long long)(now_ns() - t0));
}

/* bench N: N back-to-back cuLaunchKernel calls; benchrt N: cudaLaunchKernel */
static void bench(const char *api, unsigned long n)
{
    dim3 one = {1, 1, 1};
    uint64_t t0 = now_ns();
    if (!strcmp(api, "bench")) {
        for (unsigned long i = 0; i < n; i++)
            cu_launch(FUNC, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
    } else {
        for (unsigned long i = 0; i < n; i++)
            cuda_launch(FUNC, one, one, NULL, 0, NULL);
    }
    printf("%s %lu %llu\n", api, n, (unsigned long long)(now_ns() - t0));
}

/* paced N RATE: N cuLaunchKernel calls spread evenly at RATE per second */
static void paced(unsigned long n, double rate)
{
    uint64_t t0 = now_ns();
    double step = 1e9 / rate;
    for (unsigned long i = 0; i < n; i++) {
        uint64_t due = t0 + (uint64_t)(i * step);
        while (now_ns() < due)
            ;
        cu_launch(FUNC, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
    }
    printf("paced %lu %llu\n", n, (unsigned long long)(now_ns() - t0));
}

static void run(const char *line)
{
    char cmd[32];
    int off = 0;
    if (sscanf(line, "%31s %n", cmd, &off) < 1)
        return;
    const char *rest = line + off;
    if (!strcmp(cmd, "cu") || !strcmp(cmd, "cuex") || !strcmp(cmd, "cuda"))
        launches(cmd, rest);
    else if (!strcmp(cmd, "cusync") || !strcmp(cmd, "cudasync") || !strcmp(cmd, "devsync"))
        sync_call(cmd, strtoul(rest, NULL, 0));
    else if (!strcmp(cmd, "bench") || !strcmp(cmd, "benchrt"))
        bench(cmd, strtoul(rest, NULL, 0));
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
    printf("thread %ld\n", (long)syscall(SYS_gettid));
    sem_wait(&worker_go);
    for (unsigned long i = 0; i < worker_launches; i++)
        cu_launch(FUNC, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
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
