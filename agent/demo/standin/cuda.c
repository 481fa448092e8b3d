/* cuda.c: stand-in libcuda.so.1 for the demo and the GPU probe tests: the driver API entry
 * points spanlet hooks, with CUDA's signatures and no GPU behind them. */
#include <stdint.h>
#include <unistd.h>

typedef int CUresult;
typedef void *CUfunction;
typedef void *CUstream;

/* The head of CUDA's CUlaunchConfig (cuda.h, CUDA >= 11.8). */
typedef struct {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    void *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

/* Observable side effect, so that no call can be optimised away. */
volatile unsigned long standin_driver_launches;

__attribute__((noinline, visibility("default")))
CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                        unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                        unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                        void **kernelParams, void **extra)
{
    (void)f; (void)gridDimX; (void)gridDimY; (void)gridDimZ; (void)blockDimX;
    (void)blockDimY; (void)blockDimZ; (void)sharedMemBytes; (void)hStream;
    (void)kernelParams; (void)extra;
    standin_driver_launches++;
    return 0;
}

__attribute__((noinline, visibility("default")))
CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                          void **extra)
{
    (void)config; (void)f; (void)kernelParams; (void)extra;
    standin_driver_launches++;
    return 0;
}

/* The stream handle's value is how long to "wait", in microseconds. */
__attribute__((noinline, visibility("default")))
CUresult cuStreamSynchronize(CUstream hStream)
{
    usleep((useconds_t)(uintptr_t)hStream);
    return 0;
}
