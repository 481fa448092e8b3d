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
/* CUDA_MEMCPY2D and CUDA_MEMCPY3D (cuda.h, the _v2 layouts). */
typedef enum { CU_MEMORYTYPE_HOST = 1, CU_MEMORYTYPE_DEVICE = 2, CU_MEMORYTYPE_ARRAY = 3,
               CU_MEMORYTYPE_UNIFIED = 4 } CUmemorytype;
typedef struct {
    size_t srcXInBytes, srcY;
    CUmemorytype srcMemoryType;
    const void *srcHost;
    unsigned long long srcDevice;
    void *srcArray;
    size_t srcPitch;
    size_t dstXInBytes, dstY;
    CUmemorytype dstMemoryType;
    void *dstHost;
    unsigned long long dstDevice;
    void *dstArray;
    size_t dstPitch;
    size_t WidthInBytes, Height;
} CUDA_MEMCPY2D;
typedef struct {
    size_t srcXInBytes, srcY, srcZ, srcLOD;
    CUmemorytype srcMemoryType;
    const void *srcHost;
    unsigned long long srcDevice;
    void *srcArray;
    void *reserved0;
    size_t srcPitch, srcHeight;
    size_t dstXInBytes, dstY, dstZ, dstLOD;
    CUmemorytype dstMemoryType;
    void *dstHost;
    unsigned long long dstDevice;
    void *dstArray;
    void *reserved1;
    size_t dstPitch, dstHeight;
    size_t WidthInBytes, Height, Depth;
} CUDA_MEMCPY3D;
#endif
