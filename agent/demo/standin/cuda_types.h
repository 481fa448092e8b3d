/* cuda_types.h: the CUDA types the stand-ins and the test workload pass, laid
 * out as cuda.h and cuda_runtime_api.h lay them out (x86-64). */
#ifndef SPANLET_STANDIN_CUDA_TYPES_H
#define SPANLET_STANDIN_CUDA_TYPES_H
#include <stddef.h>

typedef void *CUstream;
typedef struct { unsigned int x, y, z; } dim3;

/* The head of CUDA's CUlaunchConfig (cuda.h, CUDA >= 11.8). */
typedef struct {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    void *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

/* cudaLaunchConfig_t (cuda_runtime_api.h, CUDA >= 11.8). */
typedef struct {
    dim3 gridDim;
    dim3 blockDim;
    size_t dynamicSmemBytes;
    void *stream;
    void *attrs;
    unsigned int numAttrs;
} cudaLaunchConfig_t;
#endif
