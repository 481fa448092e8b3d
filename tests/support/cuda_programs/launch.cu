// launch.cu: a real CUDA C++ program with <<<>>> launches, built by the tests with
// this machine's nvcc against the shared and the static runtime. It initialises the
// runtime, prints "ready INIT", waits for a line, makes N launches, prints
// "launched N FIRST LAST" (their error codes) and waits for a line before it exits.
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
__global__ void kernel(int *p) { if (p) p[threadIdx.x] = 1; }
int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 1;
    char line[16];
    int init = (int)cudaFree(0);   /* the runtime loads (and tries) the driver now */
    printf("ready %d\n", init); fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) return 1;
    int first = -1, last = 0;
    for (int i = 0; i < n; i++) {
        kernel<<<dim3(2, 3, 4), dim3(32, 1, 1), 128>>>(nullptr);
        last = (int)cudaGetLastError();
        if (first < 0) first = last;
    }
    printf("launched %d %d %d\n", n, first, last); fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) return 0;
    return 0;
}
