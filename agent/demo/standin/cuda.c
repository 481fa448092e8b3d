/* cuda.c: stand-in libcuda.so.1 for the demo and the GPU probe tests: the driver API entry
 * points spanlet hooks, exported under their real names with CUDA's signatures, and no GPU
 * behind them. It keeps just enough state to behave like the driver where the agent's
 * counts depend on it: a launch on a stream that is capturing is recorded into the
 * capture's graph, not run; a graph is made by capture or node by node, instantiated
 * into an executable graph, replayed (running its kernels) and destroyed; calls on
 * handles it does not know fail with CUDA's error codes. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include "cuda_types.h"

typedef int CUresult;
typedef void *CUfunction;
typedef void *CUevent;
typedef void *CUgraphNode;
typedef void *CUcontext;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_INVALID_HANDLE 400
#define CUDA_ERROR_ILLEGAL_STATE 401
#define CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED 900
/* What the stand-in returns for a launch whose function handle is this value,
 * so that tests can make a launch fail as a real invalid launch does. */
#define STANDIN_BAD_FUNCTION ((CUfunction)0xbad)


struct CUgraph_st { unsigned long kernels; };
struct CUgraphExec_st { unsigned long kernels; };
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphExec_st *CUgraphExec;

/* Observable side effects, so that no call can be optimised away: kernels run
 * (launched outside a capture, or by a graph replay) and launches recorded. */
volatile unsigned long standin_driver_launches;
volatile unsigned long standin_captured_launches;
static volatile unsigned int ctx_sync_us;

/* Streams capturing now (a handful is plenty for a stand-in). The per-thread
 * default stream (CU_STREAM_PER_THREAD, or NULL in a _ptsz call) is one stream
 * per thread: its slot is keyed by the thread too. */
#define CU_STREAM_PER_THREAD ((CUstream)0x2)
#define MAX_CAPTURES 16
static struct { CUstream stream; long tid; CUgraph graph; } captures[MAX_CAPTURES];

static long stream_tid(CUstream s)
{
    return s == CU_STREAM_PER_THREAD ? (long)gettid() : 0;
}

static int capture_slot(CUstream s)
{
    for (int i = 0; i < MAX_CAPTURES; i++)
        if (captures[i].graph && captures[i].stream == s && captures[i].tid == stream_tid(s))
            return i;
    return -1;
}

static CUstream ptsz(CUstream s)
{
    return s ? s : CU_STREAM_PER_THREAD;
}

/* A launch on `s`: recorded when `s` is capturing, else run (or refused). */
static CUresult launch(CUfunction f, CUstream s)
{
    if (f == STANDIN_BAD_FUNCTION)
        return CUDA_ERROR_INVALID_HANDLE;
    int i = capture_slot(s);
    if (i >= 0) {
        captures[i].graph->kernels++;
        standin_captured_launches++;
    } else {
        standin_driver_launches++;
    }
    return CUDA_SUCCESS;
}

/* The driver's exports are trampolines, as NVIDIA's are (../shared/CUDA.md,
 * 30 bytes each): a compare of the driver's state with its "deinitialised"
 * value, a conditional jump to `return CUDA_ERROR_DEINITIALIZED`, an indirect
 * jump into the function. DRIVER_EXPORT(name) makes the export `name` that
 * trampoline into impl_<name>, the C function below, hidden. */
#define EXPORT __attribute__((noinline, used, visibility("hidden")))
static volatile unsigned int driver_state __attribute__((used));   /* never deinitialised */
#define DRIVER_EXPORT(n)                                                                      \
    static void *const n##_impl __attribute__((used)) = (void *)impl_##n;                     \
    __asm__(".pushsection .text\n.p2align 4\n.globl " #n "\n.type " #n ", @function\n" #n ":\n"          \
            "    cmpl $0x321cba00, driver_state(%rip)\n    je 1f\n    jmp *" #n "_impl(%rip)\n"  \
            "    nopw 0(%rax,%rax,1)\n1:  mov $4, %eax\n    ret\n.size " #n ", .-" #n "\n"      \
            ".popsection\n");

/* -- launches ------------------------------------------------------------------ */
EXPORT CUresult impl_cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                    unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                    unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                    void **kernelParams, void **extra)
{
    return launch(f, hStream);
}

EXPORT CUresult impl_cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                         unsigned int gridDimZ, unsigned int blockDimX,
                                         unsigned int blockDimY, unsigned int blockDimZ,
                                         unsigned int sharedMemBytes, CUstream hStream,
                                         void **kernelParams, void **extra)
{
    return launch(f, ptsz(hStream));
}

EXPORT CUresult impl_cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                                      void **extra)
{
    return config ? launch(f, config->hStream) : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult impl_cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f,
                                           void **kernelParams, void **extra)
{
    return config ? launch(f, ptsz(config->hStream)) : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult impl_cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX,
                                               unsigned int gridDimY, unsigned int gridDimZ,
                                               unsigned int blockDimX, unsigned int blockDimY,
                                               unsigned int blockDimZ, unsigned int sharedMemBytes,
                                               CUstream hStream, void **kernelParams)
{
    return launch(f, hStream);
}

EXPORT CUresult impl_cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gridDimX,
                                                    unsigned int gridDimY, unsigned int gridDimZ,
                                                    unsigned int blockDimX, unsigned int blockDimY,
                                                    unsigned int blockDimZ, unsigned int sharedMemBytes,
                                                    CUstream hStream, void **kernelParams)
{
    return launch(f, ptsz(hStream));
}

/* The legacy launches (block shape set before with cuFuncSetBlockShape). */
EXPORT CUresult impl_cuLaunch(CUfunction f)
{
    return launch(f, 0);
}

EXPORT CUresult impl_cuLaunchGrid(CUfunction f, int grid_width, int grid_height)
{
    return launch(f, 0);
}

EXPORT CUresult impl_cuLaunchGridAsync(CUfunction f, int grid_width, int grid_height, CUstream hStream)
{
    return launch(f, hStream);
}

/* -- capture ------------------------------------------------------------------- */
static CUresult begin_capture(CUstream s, CUgraph into)
{
    if (s == 0 || capture_slot(s) >= 0)   /* the legacy stream cannot capture; nor can a capturing one */
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    for (int i = 0; i < MAX_CAPTURES; i++) {
        if (!captures[i].graph) {
            captures[i].stream = s;
            captures[i].tid = stream_tid(s);
            captures[i].graph = into ? into : calloc(1, sizeof(struct CUgraph_st));
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult impl_cuStreamBeginCapture(CUstream hStream)
{
    return begin_capture(hStream, NULL);
}

EXPORT CUresult impl_cuStreamBeginCapture_v2(CUstream hStream, int mode)
{
    return begin_capture(hStream, NULL);
}

EXPORT CUresult impl_cuStreamBeginCapture_ptsz(CUstream hStream)
{
    return begin_capture(ptsz(hStream), NULL);
}

EXPORT CUresult impl_cuStreamBeginCapture_v2_ptsz(CUstream hStream, int mode)
{
    return begin_capture(ptsz(hStream), NULL);
}

EXPORT CUresult impl_cuStreamBeginCaptureToGraph(CUstream hStream, CUgraph hGraph,
                                                 const CUgraphNode *dependencies, const void *edgeData,
                                                 size_t numDependencies, int mode)
{
    return hGraph ? begin_capture(hStream, hGraph) : CUDA_ERROR_INVALID_VALUE;
}

static CUresult end_capture(CUstream s, CUgraph *phGraph)
{
    int i = capture_slot(s);
    if (i < 0)
        return CUDA_ERROR_ILLEGAL_STATE;
    *phGraph = captures[i].graph;
    captures[i].graph = NULL;
    return CUDA_SUCCESS;
}

EXPORT CUresult impl_cuStreamEndCapture(CUstream hStream, CUgraph *phGraph)
{
    return end_capture(hStream, phGraph);
}

EXPORT CUresult impl_cuStreamEndCapture_ptsz(CUstream hStream, CUgraph *phGraph)
{
    return end_capture(ptsz(hStream), phGraph);
}

/* -- graphs -------------------------------------------------------------------- */
EXPORT CUresult impl_cuGraphCreate(CUgraph *phGraph, unsigned int flags)
{
    *phGraph = calloc(1, sizeof(struct CUgraph_st));
    return CUDA_SUCCESS;
}

static CUresult add_kernel_node(CUgraphNode *phGraphNode, CUgraph hGraph)
{
    if (!hGraph)
        return CUDA_ERROR_INVALID_VALUE;
    hGraph->kernels++;
    *phGraphNode = (CUgraphNode)(uintptr_t)hGraph->kernels;
    return CUDA_SUCCESS;
}

EXPORT CUresult impl_cuGraphAddKernelNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                          const CUgraphNode *dependencies, size_t numDependencies,
                                          const void *nodeParams)
{
    return add_kernel_node(phGraphNode, hGraph);
}

EXPORT CUresult impl_cuGraphAddKernelNode_v2(CUgraphNode *phGraphNode, CUgraph hGraph,
                                             const CUgraphNode *dependencies, size_t numDependencies,
                                             const void *nodeParams)
{
    return add_kernel_node(phGraphNode, hGraph);
}

static CUresult instantiate(CUgraphExec *phGraphExec, CUgraph hGraph)
{
    if (!hGraph)
        return CUDA_ERROR_INVALID_VALUE;
    *phGraphExec = calloc(1, sizeof(struct CUgraphExec_st));
    (*phGraphExec)->kernels = hGraph->kernels;
    return CUDA_SUCCESS;
}

/* CUDA < 12's signature, still exported (and so the _v2 one). */
EXPORT CUresult impl_cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                        char *logBuffer, size_t bufferSize)
{
    return instantiate(phGraphExec, hGraph);
}

EXPORT CUresult impl_cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph,
                                           CUgraphNode *phErrorNode, char *logBuffer, size_t bufferSize)
{
    return instantiate(phGraphExec, hGraph);
}

EXPORT CUresult impl_cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                 unsigned long long flags)
{
    return instantiate(phGraphExec, hGraph);
}

EXPORT CUresult impl_cuGraphInstantiateWithParams(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                  void *instantiateParams)
{
    return instantiate(phGraphExec, hGraph);
}

EXPORT CUresult impl_cuGraphInstantiateWithParams_ptsz(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                       void *instantiateParams)
{
    return instantiate(phGraphExec, hGraph);
}

/* A replay runs the executable graph's kernels (or, on a capturing stream, is
 * recorded as a child graph of the capture). */
static CUresult graph_launch(CUgraphExec hGraphExec, CUstream s)
{
    if (!hGraphExec)
        return CUDA_ERROR_INVALID_VALUE;
    int i = capture_slot(s);
    if (i >= 0)
        captures[i].graph->kernels += hGraphExec->kernels;
    else
        standin_driver_launches += hGraphExec->kernels;
    return CUDA_SUCCESS;
}

EXPORT CUresult impl_cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)
{
    return graph_launch(hGraphExec, hStream);
}

EXPORT CUresult impl_cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream)
{
    return graph_launch(hGraphExec, ptsz(hStream));
}

EXPORT CUresult impl_cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    free(hGraphExec);
    return CUDA_SUCCESS;
}

EXPORT CUresult impl_cuGraphDestroy(CUgraph hGraph)
{
    free(hGraph);
    return CUDA_SUCCESS;
}

/* -- synchronisation ------------------------------------------------------------- */
/* The stream (and event) handle's value is how long to "wait", in microseconds. */
EXPORT CUresult impl_cuStreamSynchronize(CUstream hStream)
{
    usleep((useconds_t)(uintptr_t)hStream);
    return CUDA_SUCCESS;
}

EXPORT CUresult impl_cuStreamSynchronize_ptsz(CUstream hStream)
{
    usleep((useconds_t)(uintptr_t)hStream);
    return CUDA_SUCCESS;
}

EXPORT CUresult impl_cuEventSynchronize(CUevent hEvent)
{
    usleep((useconds_t)(uintptr_t)hEvent);
    return CUDA_SUCCESS;
}

/* How long the next cuCtxSynchronize "waits". */
__attribute__((visibility("default")))
void standin_set_ctx_sync_us(unsigned int us)
{
    ctx_sync_us = us;
}

EXPORT CUresult impl_cuCtxSynchronize(void)
{
    usleep(ctx_sync_us);
    return CUDA_SUCCESS;
}

/* CUDA 13's (driver 580): the context to wait for, NULL for the current one. */
EXPORT CUresult impl_cuCtxSynchronize_v2(CUcontext ctx)
{
    (void)ctx;
    usleep(ctx_sync_us);
    return CUDA_SUCCESS;
}

/* -- memory traffic ---------------------------------------------------------------
 * No device memory: copies check their arguments and move nothing, allocations
 * hand out distinct fake addresses. Bytes asked for are kept (observable). */
typedef unsigned long long CUdeviceptr;
volatile unsigned long long standin_copied_bytes;
static volatile unsigned long long next_device_address = 0x7f0000000000ULL;

static CUresult copy(size_t bytes)
{
    standin_copied_bytes += bytes;
    return CUDA_SUCCESS;
}

#define COPY_1D(n, ...) EXPORT CUresult impl_##n(__VA_ARGS__) { return copy(ByteCount); }
COPY_1D(cuMemcpyHtoD_v2, CUdeviceptr dst, const void *src, size_t ByteCount)
COPY_1D(cuMemcpyHtoD_v2_ptds, CUdeviceptr dst, const void *src, size_t ByteCount)
COPY_1D(cuMemcpyDtoH_v2, void *dst, CUdeviceptr src, size_t ByteCount)
COPY_1D(cuMemcpyDtoH_v2_ptds, void *dst, CUdeviceptr src, size_t ByteCount)
COPY_1D(cuMemcpyDtoD_v2, CUdeviceptr dst, CUdeviceptr src, size_t ByteCount)
COPY_1D(cuMemcpyDtoD_v2_ptds, CUdeviceptr dst, CUdeviceptr src, size_t ByteCount)
COPY_1D(cuMemcpy, CUdeviceptr dst, CUdeviceptr src, size_t ByteCount)
COPY_1D(cuMemcpy_ptds, CUdeviceptr dst, CUdeviceptr src, size_t ByteCount)
COPY_1D(cuMemcpyHtoDAsync_v2, CUdeviceptr dst, const void *src, size_t ByteCount, CUstream s)
COPY_1D(cuMemcpyHtoDAsync_v2_ptsz, CUdeviceptr dst, const void *src, size_t ByteCount, CUstream s)
COPY_1D(cuMemcpyDtoHAsync_v2, void *dst, CUdeviceptr src, size_t ByteCount, CUstream s)
COPY_1D(cuMemcpyDtoHAsync_v2_ptsz, void *dst, CUdeviceptr src, size_t ByteCount, CUstream s)
COPY_1D(cuMemcpyDtoDAsync_v2, CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream s)
COPY_1D(cuMemcpyDtoDAsync_v2_ptsz, CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream s)
COPY_1D(cuMemcpyAsync, CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream s)
COPY_1D(cuMemcpyAsync_ptsz, CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream s)
COPY_1D(cuMemcpyPeer, CUdeviceptr dst, CUcontext dc, CUdeviceptr src, CUcontext sc, size_t ByteCount)
COPY_1D(cuMemcpyPeer_ptds, CUdeviceptr dst, CUcontext dc, CUdeviceptr src, CUcontext sc, size_t ByteCount)
COPY_1D(cuMemcpyPeerAsync, CUdeviceptr dst, CUcontext dc, CUdeviceptr src, CUcontext sc, size_t ByteCount,
        CUstream s)
COPY_1D(cuMemcpyPeerAsync_ptsz, CUdeviceptr dst, CUcontext dc, CUdeviceptr src, CUcontext sc,
        size_t ByteCount, CUstream s)

/* The 2D and 3D copies: the extent from the descriptor (CUDA_MEMCPY2D / 3D). */
#define COPY_DESC(n, T, ...) EXPORT CUresult impl_##n(const T *p, ##__VA_ARGS__) \
    { return p ? copy(EXTENT_##T(p)) : CUDA_ERROR_INVALID_VALUE; }
#define EXTENT_CUDA_MEMCPY2D(p) ((p)->WidthInBytes * (p)->Height)
#define EXTENT_CUDA_MEMCPY3D(p) ((p)->WidthInBytes * (p)->Height * (p)->Depth)
COPY_DESC(cuMemcpy2D_v2, CUDA_MEMCPY2D)
COPY_DESC(cuMemcpy2D_v2_ptds, CUDA_MEMCPY2D)
COPY_DESC(cuMemcpy2DUnaligned_v2, CUDA_MEMCPY2D)
COPY_DESC(cuMemcpy2DUnaligned_v2_ptds, CUDA_MEMCPY2D)
COPY_DESC(cuMemcpy2DAsync_v2, CUDA_MEMCPY2D, CUstream s)
COPY_DESC(cuMemcpy2DAsync_v2_ptsz, CUDA_MEMCPY2D, CUstream s)
COPY_DESC(cuMemcpy3D_v2, CUDA_MEMCPY3D)
COPY_DESC(cuMemcpy3D_v2_ptds, CUDA_MEMCPY3D)
COPY_DESC(cuMemcpy3DAsync_v2, CUDA_MEMCPY3D, CUstream s)
COPY_DESC(cuMemcpy3DAsync_v2_ptsz, CUDA_MEMCPY3D, CUstream s)

static CUresult alloc(CUdeviceptr *dptr, size_t bytes)
{
    if (!dptr || !bytes)
        return CUDA_ERROR_INVALID_VALUE;
    *dptr = __sync_fetch_and_add(&next_device_address, (bytes + 255) & ~255ULL);
    return CUDA_SUCCESS;
}

EXPORT CUresult impl_cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    return alloc(dptr, bytesize);
}

EXPORT CUresult impl_cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream s)
{
    return alloc(dptr, bytesize);
}

EXPORT CUresult impl_cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream s)
{
    return alloc(dptr, bytesize);
}

/* Rows padded to a pitch of 512 bytes, as drivers pad them. */
EXPORT CUresult impl_cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes,
                                        size_t Height, unsigned int ElementSizeBytes)
{
    if (!pPitch)
        return CUDA_ERROR_INVALID_VALUE;
    *pPitch = (WidthInBytes + 511) & ~(size_t)511;
    return alloc(dptr, *pPitch * Height);
}

/* -- the exports ---------------------------------------------------------------- */
DRIVER_EXPORT(cuLaunchKernel)
DRIVER_EXPORT(cuLaunchKernel_ptsz)
DRIVER_EXPORT(cuLaunchKernelEx)
DRIVER_EXPORT(cuLaunchKernelEx_ptsz)
DRIVER_EXPORT(cuLaunchCooperativeKernel)
DRIVER_EXPORT(cuLaunchCooperativeKernel_ptsz)
DRIVER_EXPORT(cuLaunch)
DRIVER_EXPORT(cuLaunchGrid)
DRIVER_EXPORT(cuLaunchGridAsync)
DRIVER_EXPORT(cuStreamBeginCapture)
DRIVER_EXPORT(cuStreamBeginCapture_v2)
DRIVER_EXPORT(cuStreamBeginCapture_ptsz)
DRIVER_EXPORT(cuStreamBeginCapture_v2_ptsz)
DRIVER_EXPORT(cuStreamBeginCaptureToGraph)
DRIVER_EXPORT(cuStreamEndCapture)
DRIVER_EXPORT(cuStreamEndCapture_ptsz)
DRIVER_EXPORT(cuGraphCreate)
DRIVER_EXPORT(cuGraphAddKernelNode)
DRIVER_EXPORT(cuGraphAddKernelNode_v2)
DRIVER_EXPORT(cuGraphInstantiate)
DRIVER_EXPORT(cuGraphInstantiate_v2)
DRIVER_EXPORT(cuGraphInstantiateWithFlags)
DRIVER_EXPORT(cuGraphInstantiateWithParams)
DRIVER_EXPORT(cuGraphInstantiateWithParams_ptsz)
DRIVER_EXPORT(cuGraphLaunch)
DRIVER_EXPORT(cuGraphLaunch_ptsz)
DRIVER_EXPORT(cuGraphExecDestroy)
DRIVER_EXPORT(cuGraphDestroy)
DRIVER_EXPORT(cuStreamSynchronize)
DRIVER_EXPORT(cuStreamSynchronize_ptsz)
DRIVER_EXPORT(cuEventSynchronize)
DRIVER_EXPORT(cuCtxSynchronize)
DRIVER_EXPORT(cuCtxSynchronize_v2)
DRIVER_EXPORT(cuMemcpyHtoD_v2)
DRIVER_EXPORT(cuMemcpyHtoD_v2_ptds)
DRIVER_EXPORT(cuMemcpyDtoH_v2)
DRIVER_EXPORT(cuMemcpyDtoH_v2_ptds)
DRIVER_EXPORT(cuMemcpyDtoD_v2)
DRIVER_EXPORT(cuMemcpyDtoD_v2_ptds)
DRIVER_EXPORT(cuMemcpy)
DRIVER_EXPORT(cuMemcpy_ptds)
DRIVER_EXPORT(cuMemcpyHtoDAsync_v2)
DRIVER_EXPORT(cuMemcpyHtoDAsync_v2_ptsz)
DRIVER_EXPORT(cuMemcpyDtoHAsync_v2)
DRIVER_EXPORT(cuMemcpyDtoHAsync_v2_ptsz)
DRIVER_EXPORT(cuMemcpyDtoDAsync_v2)
DRIVER_EXPORT(cuMemcpyDtoDAsync_v2_ptsz)
DRIVER_EXPORT(cuMemcpyAsync)
DRIVER_EXPORT(cuMemcpyAsync_ptsz)
DRIVER_EXPORT(cuMemcpyPeer)
DRIVER_EXPORT(cuMemcpyPeer_ptds)
DRIVER_EXPORT(cuMemcpyPeerAsync)
DRIVER_EXPORT(cuMemcpyPeerAsync_ptsz)
DRIVER_EXPORT(cuMemcpy2D_v2)
DRIVER_EXPORT(cuMemcpy2D_v2_ptds)
DRIVER_EXPORT(cuMemcpy2DUnaligned_v2)
DRIVER_EXPORT(cuMemcpy2DUnaligned_v2_ptds)
DRIVER_EXPORT(cuMemcpy2DAsync_v2)
DRIVER_EXPORT(cuMemcpy2DAsync_v2_ptsz)
DRIVER_EXPORT(cuMemcpy3D_v2)
DRIVER_EXPORT(cuMemcpy3D_v2_ptds)
DRIVER_EXPORT(cuMemcpy3DAsync_v2)
DRIVER_EXPORT(cuMemcpy3DAsync_v2_ptsz)
DRIVER_EXPORT(cuMemAlloc_v2)
DRIVER_EXPORT(cuMemAllocAsync)
DRIVER_EXPORT(cuMemAllocAsync_ptsz)
DRIVER_EXPORT(cuMemAllocPitch_v2)
