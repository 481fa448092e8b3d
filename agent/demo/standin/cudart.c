/* cudart.c: stand-in libcudart.so.12 for the demo and the GPU probe tests. Its launch and
 * stream-sync calls enter the stand-in driver through the PLT (nested calls),
 * cudaStreamSynchronize as a tail call (a jump, as an optimising compiler
 * makes it), cudaLaunchKernel as a plain call. */
#include <stddef.h>
#include <stdint.h>
#include <unistd.h>

typedef int cudaError_t;
typedef void *cudaStream_t;
typedef struct { unsigned int x, y, z; } dim3;

extern int cuLaunchKernel(void *f, unsigned int gx, unsigned int gy, unsigned int gz,
                          unsigned int bx, unsigned int by, unsigned int bz,
                          unsigned int shmem, void *stream, void **params, void **extra);
extern int cuStreamSynchronize(void *stream);

volatile unsigned long standin_runtime_launches;
static volatile unsigned int device_sync_us;

__attribute__((visibility("default")))
void standin_set_device_sync_us(unsigned int us)
{
    device_sync_us = us;
}

__attribute__((noinline, visibility("default")))
cudaError_t cudaLaunchKernel(const void *func, dim3 gridDim, dim3 blockDim, void **args,
                             size_t sharedMem, cudaStream_t stream)
{
    int r = cuLaunchKernel((void *)func, gridDim.x, gridDim.y, gridDim.z, blockDim.x,
                           blockDim.y, blockDim.z, (unsigned int)sharedMem, stream, args, NULL);
    standin_runtime_launches++;  /* work after the call: not a tail call */
    return r;
}

__attribute__((noinline, visibility("default")))
cudaError_t cudaStreamSynchronize(cudaStream_t stream)
{
    return cuStreamSynchronize(stream);
}

__attribute__((noinline, visibility("default")))
cudaError_t cudaDeviceSynchronize(void)
{
    usleep(device_sync_us);
    return 0;
}
