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

#define EXPORT __attribute__((noinline, visibility("default")))

/* -- launches ------------------------------------------------------------------ */
EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                               unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                               unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                               void **kernelParams, void **extra)
{
    return launch(f, hStream);
}

EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                    unsigned int gridDimZ, unsigned int blockDimX,
                                    unsigned int blockDimY, unsigned int blockDimZ,
                                    unsigned int sharedMemBytes, CUstream hStream,
                                    void **kernelParams, void **extra)
{
    return launch(f, ptsz(hStream));
}

EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                                 void **extra)
{
    return config ? launch(f, config->hStream) : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f,
                                      void **kernelParams, void **extra)
{
    return config ? launch(f, ptsz(config->hStream)) : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX,
                                          unsigned int gridDimY, unsigned int gridDimZ,
                                          unsigned int blockDimX, unsigned int blockDimY,
                                          unsigned int blockDimZ, unsigned int sharedMemBytes,
                                          CUstream hStream, void **kernelParams)
{
    return launch(f, hStream);
}

EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gridDimX,
                                               unsigned int gridDimY, unsigned int gridDimZ,
                                               unsigned int blockDimX, unsigned int blockDimY,
                                               unsigned int blockDimZ, unsigned int sharedMemBytes,
                                               CUstream hStream, void **kernelParams)
{
    return launch(f, ptsz(hStream));
}

/* The legacy launches (block shape set before with cuFuncSetBlockShape). */
EXPORT CUresult cuLaunch(CUfunction f)
{
    return launch(f, 0);
}

EXPORT CUresult cuLaunchGrid(CUfunction f, int grid_width, int grid_height)
{
    return launch(f, 0);
}

EXPORT CUresult cuLaunchGridAsync(CUfunction f, int grid_width, int grid_height, CUstream hStream)
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

EXPORT CUresult cuStreamBeginCapture(CUstream hStream)
{
    return begin_capture(hStream, NULL);
}

EXPORT CUresult cuStreamBeginCapture_v2(CUstream hStream, int mode)
{
    return begin_capture(hStream, NULL);
}

EXPORT CUresult cuStreamBeginCapture_ptsz(CUstream hStream)
{
    return begin_capture(ptsz(hStream), NULL);
}

EXPORT CUresult cuStreamBeginCapture_v2_ptsz(CUstream hStream, int mode)
{
    return begin_capture(ptsz(hStream), NULL);
}

EXPORT CUresult cuStreamBeginCaptureToGraph(CUstream hStream, CUgraph hGraph,
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

EXPORT CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph)
{
    return end_capture(hStream, phGraph);
}

EXPORT CUresult cuStreamEndCapture_ptsz(CUstream hStream, CUgraph *phGraph)
{
    return end_capture(ptsz(hStream), phGraph);
}

/* -- graphs -------------------------------------------------------------------- */
EXPORT CUresult cuGraphCreate(CUgraph *phGraph, unsigned int flags)
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

EXPORT CUresult cuGraphAddKernelNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                     const CUgraphNode *dependencies, size_t numDependencies,
                                     const void *nodeParams)
{
    return add_kernel_node(phGraphNode, hGraph);
}

EXPORT CUresult cuGraphAddKernelNode_v2(CUgraphNode *phGraphNode, CUgraph hGraph,
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
EXPORT CUresult cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                   char *logBuffer, size_t bufferSize)
{
    return instantiate(phGraphExec, hGraph);
}

EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph,
                                      CUgraphNode *phErrorNode, char *logBuffer, size_t bufferSize)
{
    return instantiate(phGraphExec, hGraph);
}

EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph,
                                            unsigned long long flags)
{
    return instantiate(phGraphExec, hGraph);
}

EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *phGraphExec, CUgraph hGraph,
                                             void *instantiateParams)
{
    return instantiate(phGraphExec, hGraph);
}

EXPORT CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *phGraphExec, CUgraph hGraph,
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

EXPORT CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)
{
    return graph_launch(hGraphExec, hStream);
}

EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream)
{
    return graph_launch(hGraphExec, ptsz(hStream));
}

EXPORT CUresult cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    free(hGraphExec);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphDestroy(CUgraph hGraph)
{
    free(hGraph);
    return CUDA_SUCCESS;
}

/* -- synchronisation ------------------------------------------------------------- */
/* The stream (and event) handle's value is how long to "wait", in microseconds. */
EXPORT CUresult cuStreamSynchronize(CUstream hStream)
{
    usleep((useconds_t)(uintptr_t)hStream);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamSynchronize_ptsz(CUstream hStream)
{
    usleep((useconds_t)(uintptr_t)hStream);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventSynchronize(CUevent hEvent)
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

EXPORT CUresult cuCtxSynchronize(void)
{
    usleep(ctx_sync_us);
    return CUDA_SUCCESS;
}
