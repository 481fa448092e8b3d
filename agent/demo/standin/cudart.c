/* cudart.c: stand-in libcudart.so.12 for the demo and the GPU probe tests. Like the real
 * runtime it imports no driver symbol: it dlopens libcuda.so.1 and calls the driver through
 * pointers it looked up there (real cudart gets them from cuGetProcAddress, which returns
 * libcuda's exported functions), so a uprobe on the driver sees every call it makes.
 * cudaStreamSynchronize is a tail call (a jump through the pointer, as an optimising
 * compiler makes it), the launches plain calls with work after them. */
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda_types.h"

typedef int cudaError_t;
typedef void *cudaStream_t;
typedef void *cudaEvent_t;
typedef void *cudaGraph_t;
typedef void *cudaGraphExec_t;

typedef int (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                         unsigned, void *, void **, void **);
typedef int (*coop_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                       unsigned, void *, void **);
typedef int (*launch_ex_fn)(const CUlaunchConfig *, void *, void **, void **);
typedef int (*handle_fn)(void *);
typedef int (*handle2_fn)(void *, void *);
typedef int (*begin_fn)(void *, int);
typedef int (*inst_fn)(void *, void *, unsigned long long);
typedef int (*void_fn)(void);
typedef void (*set_us_fn)(unsigned int);
typedef int (*copy_fn)(void *, const void *, size_t);
typedef int (*copy_async_fn)(void *, const void *, size_t, void *);
typedef int (*alloc_fn)(void *, size_t);

static struct {
    launch_fn launch, launch_ptsz;
    launch_ex_fn launch_ex, launch_ex_ptsz;
    coop_fn coop, coop_ptsz;
    handle2_fn graph_launch, graph_launch_ptsz, end_capture;
    begin_fn begin_capture;
    inst_fn instantiate;
    handle_fn stream_sync, stream_sync_ptsz, event_sync, exec_destroy, graph_destroy;
    void_fn ctx_sync;
    set_us_fn set_ctx_sync_us;
    copy_fn copy[5];          /* by cudaMemcpyKind */
    copy_async_fn copy_async[5];
    alloc_fn alloc;
} cu;

volatile unsigned long standin_runtime_launches;
volatile unsigned long standin_runtime_copies;

static void *sym(void *h, const char *name)
{
    void *p = dlsym(h, name);
    if (!p) {
        fprintf(stderr, "stand-in cudart: libcuda.so.1 has no %s\n", name);
        abort();
    }
    return p;
}

/* The driver, found as real cudart finds it: by its soname. */
__attribute__((constructor)) static void load_driver(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!h) {
        fprintf(stderr, "stand-in cudart: %s\n", dlerror());
        abort();
    }
    cu.launch = (launch_fn)sym(h, "cuLaunchKernel");
    cu.launch_ptsz = (launch_fn)sym(h, "cuLaunchKernel_ptsz");
    cu.launch_ex = (launch_ex_fn)sym(h, "cuLaunchKernelEx");
    cu.launch_ex_ptsz = (launch_ex_fn)sym(h, "cuLaunchKernelEx_ptsz");
    cu.coop = (coop_fn)sym(h, "cuLaunchCooperativeKernel");
    cu.coop_ptsz = (coop_fn)sym(h, "cuLaunchCooperativeKernel_ptsz");
    cu.graph_launch = (handle2_fn)sym(h, "cuGraphLaunch");
    cu.graph_launch_ptsz = (handle2_fn)sym(h, "cuGraphLaunch_ptsz");
    cu.begin_capture = (begin_fn)sym(h, "cuStreamBeginCapture_v2");
    cu.end_capture = (handle2_fn)sym(h, "cuStreamEndCapture");
    cu.instantiate = (inst_fn)sym(h, "cuGraphInstantiateWithFlags");
    cu.exec_destroy = (handle_fn)sym(h, "cuGraphExecDestroy");
    cu.graph_destroy = (handle_fn)sym(h, "cuGraphDestroy");
    cu.stream_sync = (handle_fn)sym(h, "cuStreamSynchronize");
    cu.stream_sync_ptsz = (handle_fn)sym(h, "cuStreamSynchronize_ptsz");
    cu.event_sync = (handle_fn)sym(h, "cuEventSynchronize");
    cu.ctx_sync = (void_fn)sym(h, "cuCtxSynchronize");
    cu.set_ctx_sync_us = (set_us_fn)sym(h, "standin_set_ctx_sync_us");
    /* cudaMemcpyKind: host to host, host to device, device to host, device
     * to device, default (unified addressing: the driver finds the direction) */
    static const char *const copies[5] = {"cuMemcpy", "cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2",
                                          "cuMemcpyDtoD_v2", "cuMemcpy"};
    static const char *const async_copies[5] = {"cuMemcpyAsync", "cuMemcpyHtoDAsync_v2",
                                                "cuMemcpyDtoHAsync_v2", "cuMemcpyDtoDAsync_v2",
                                                "cuMemcpyAsync"};
    for (int i = 0; i < 5; i++) {
        cu.copy[i] = (copy_fn)sym(h, copies[i]);
        cu.copy_async[i] = (copy_async_fn)sym(h, async_copies[i]);
    }
    cu.alloc = (alloc_fn)sym(h, "cuMemAlloc_v2");
}

#define EXPORT __attribute__((noinline, visibility("default")))

/* -- launches ------------------------------------------------------------------ */
EXPORT cudaError_t cudaLaunchKernel(const void *func, dim3 gridDim, dim3 blockDim, void **args,
                                    size_t sharedMem, cudaStream_t stream)
{
    int r = cu.launch((void *)func, gridDim.x, gridDim.y, gridDim.z, blockDim.x, blockDim.y,
                      blockDim.z, (unsigned int)sharedMem, stream, args, NULL);
    standin_runtime_launches++;  /* work after the call: not a tail call */
    return r;
}

EXPORT cudaError_t cudaLaunchKernel_ptsz(const void *func, dim3 gridDim, dim3 blockDim,
                                         void **args, size_t sharedMem, cudaStream_t stream)
{
    int r = cu.launch_ptsz((void *)func, gridDim.x, gridDim.y, gridDim.z, blockDim.x, blockDim.y,
                           blockDim.z, (unsigned int)sharedMem, stream, args, NULL);
    standin_runtime_launches++;
    return r;
}

static CUlaunchConfig driver_config(const cudaLaunchConfig_t *c)
{
    CUlaunchConfig d = {c->gridDim.x, c->gridDim.y, c->gridDim.z, c->blockDim.x, c->blockDim.y,
                        c->blockDim.z, (unsigned int)c->dynamicSmemBytes, c->stream, NULL, 0};
    return d;
}

EXPORT cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t *config, const void *func,
                                       void **args)
{
    CUlaunchConfig d = driver_config(config);
    int r = cu.launch_ex(&d, (void *)func, args, NULL);
    standin_runtime_launches++;
    return r;
}

EXPORT cudaError_t cudaLaunchKernelExC_ptsz(const cudaLaunchConfig_t *config, const void *func,
                                            void **args)
{
    CUlaunchConfig d = driver_config(config);
    int r = cu.launch_ex_ptsz(&d, (void *)func, args, NULL);
    standin_runtime_launches++;
    return r;
}

EXPORT cudaError_t cudaLaunchCooperativeKernel(const void *func, dim3 gridDim, dim3 blockDim,
                                               void **args, size_t sharedMem, cudaStream_t stream)
{
    int r = cu.coop((void *)func, gridDim.x, gridDim.y, gridDim.z, blockDim.x, blockDim.y,
                    blockDim.z, (unsigned int)sharedMem, stream, args);
    standin_runtime_launches++;
    return r;
}

EXPORT cudaError_t cudaLaunchCooperativeKernel_ptsz(const void *func, dim3 gridDim, dim3 blockDim,
                                                    void **args, size_t sharedMem,
                                                    cudaStream_t stream)
{
    int r = cu.coop_ptsz((void *)func, gridDim.x, gridDim.y, gridDim.z, blockDim.x, blockDim.y,
                         blockDim.z, (unsigned int)sharedMem, stream, args);
    standin_runtime_launches++;
    return r;
}

/* -- graphs and capture ------------------------------------------------------------ */
EXPORT cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream)
{
    int r = cu.graph_launch(exec, stream);
    standin_runtime_launches++;
    return r;
}

EXPORT cudaError_t cudaGraphLaunch_ptsz(cudaGraphExec_t exec, cudaStream_t stream)
{
    int r = cu.graph_launch_ptsz(exec, stream);
    standin_runtime_launches++;
    return r;
}

EXPORT cudaError_t cudaStreamBeginCapture(cudaStream_t stream, int mode)
{
    return cu.begin_capture(stream, mode);
}

EXPORT cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t *graph)
{
    return cu.end_capture(stream, graph);
}

EXPORT cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph,
                                        unsigned long long flags)
{
    return cu.instantiate(exec, graph, flags);
}

EXPORT cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec)
{
    return cu.exec_destroy(exec);
}

EXPORT cudaError_t cudaGraphDestroy(cudaGraph_t graph)
{
    return cu.graph_destroy(graph);
}

/* -- synchronisation ------------------------------------------------------------- */
EXPORT cudaError_t cudaStreamSynchronize(cudaStream_t stream)
{
    return cu.stream_sync(stream);
}

EXPORT cudaError_t cudaStreamSynchronize_ptsz(cudaStream_t stream)
{
    return cu.stream_sync_ptsz(stream);
}

EXPORT cudaError_t cudaEventSynchronize(cudaEvent_t event)
{
    return cu.event_sync(event);
}

/* How long the next cudaDeviceSynchronize "waits" (the driver's context sync). */
__attribute__((visibility("default")))
void standin_set_device_sync_us(unsigned int us)
{
    cu.set_ctx_sync_us(us);
}

EXPORT cudaError_t cudaDeviceSynchronize(void)
{
    return cu.ctx_sync();
}

/* -- memory -------------------------------------------------------------------- */
enum cudaMemcpyKind { cudaMemcpyHostToHost, cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost,
                      cudaMemcpyDeviceToDevice, cudaMemcpyDefault };
#define cudaErrorInvalidMemcpyDirection 21

EXPORT cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind)
{
    if ((unsigned)kind > cudaMemcpyDefault)
        return cudaErrorInvalidMemcpyDirection;
    int r = cu.copy[kind](dst, src, count);
    standin_runtime_copies++;   /* work after the call: not a tail call */
    return r;
}

EXPORT cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
                                   cudaStream_t stream)
{
    if ((unsigned)kind > cudaMemcpyDefault)
        return cudaErrorInvalidMemcpyDirection;
    int r = cu.copy_async[kind](dst, src, count, stream);
    standin_runtime_copies++;
    return r;
}

EXPORT cudaError_t cudaMalloc(void **devPtr, size_t size)
{
    int r = cu.alloc(devPtr, size);
    standin_runtime_copies++;
    return r;
}
