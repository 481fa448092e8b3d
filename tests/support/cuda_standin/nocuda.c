/* nocuda.c: a library named like libcuda but without any CUDA symbol, for the
 * test that such a library is reported and nothing else breaks. */
__attribute__((visibility("default"))) int standin_not_cuda(void) { return 42; }
