/* Stand-in libnvidia-ml.so.1 for the demo and the tests: the NVML C entry points pynvml calls for
 * spanlet's device metrics, answering fixed values for two fake GPUs. */
#include <stdlib.h>
#include <string.h>

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
};
enum { NVML_PCIE_UTIL_TX_BYTES = 0, NVML_PCIE_UTIL_RX_BYTES = 1 };

/* Layouts as pynvml declares them (c_nvmlUtilization_t, c_nvmlMemory_t). */
typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;
#define NVML_ERROR_FUNCTION_NOT_FOUND 13
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25
#define NVML_MEMORY_V2 0x02000028   /* nvml.h: NVML_STRUCT_VERSION(Memory, 2) */
/* What the driver keeps for itself on each GPU: version 1 of the memory call
 * counts it as used, version 2 apart (616 MiB, an H200's with driver 580). */
#define RESERVED (616ULL * 1024 * 1024)

#define GIB (1024ULL * 1024 * 1024)
#define MEM_STEPS 3

/* Keep in step with the known values in tests/unit/test_nvml.py (the demo shows them as two GPUs). */
struct standin_device {
    const char *uuid, *name;
    unsigned int sm_percent;
    unsigned long long mem_total, mem_used[MEM_STEPS]; /* used cycles per call */
    unsigned int pcie_gen, pcie_width;
    unsigned int pcie_kbps[2];                         /* TX, RX */
    int rx_fails;                                      /* RX counter errors */
    unsigned int mem_calls;
};
typedef struct standin_device *nvmlDevice_t;

static struct standin_device devices[] = {
    {"GPU-00000000-1111-2222-3333-444444444444", "Stand-in H200", 73,
     80 * GIB, {20 * GIB, 60 * GIB, 40 * GIB}, 5, 16, {12000000, 3000000}, 0, 0},
    {"GPU-55555555-6666-7777-8888-999999999999", "Stand-in L4", 12,
     24 * GIB, {6 * GIB, 3 * GIB, 9 * GIB}, 4, 8, {5000000, 0}, 1, 0},
};
#define NDEV (sizeof(devices) / sizeof(devices[0]))

static int init_calls, shutdown_calls;

/* Test hooks (not NVML): counts a test reads through ctypes. */
int standin_init_calls(void) { return init_calls; }
int standin_shutdown_calls(void) { return shutdown_calls; }

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    init_calls++;
    /* STANDIN_NVML_INIT_FAIL=1: behave like a node whose driver is not loaded. */
    const char *fail = getenv("STANDIN_NVML_INIT_FAIL");
    return fail && *fail == '1' ? NVML_ERROR_DRIVER_NOT_LOADED : NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void)
{
    shutdown_calls++;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t r)
{
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = NDEV;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *dev)
{
    if (index >= NDEV || !dev)
        return NVML_ERROR_INVALID_ARGUMENT;
    *dev = &devices[index];
    return NVML_SUCCESS;
}

static int valid(nvmlDevice_t d)
{
    return d >= devices && d < devices + NDEV;
}

static nvmlReturn_t copy_string(const char *s, char *buf, unsigned int len)
{
    if (!buf || strlen(s) + 1 > len)
        return NVML_ERROR_INVALID_ARGUMENT;
    memcpy(buf, s, strlen(s) + 1);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *buf, unsigned int len)
{
    return valid(d) ? copy_string(d->uuid, buf, len) : NVML_ERROR_INVALID_ARGUMENT;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *buf, unsigned int len)
{
    return valid(d) ? copy_string(d->name, buf, len) : NVML_ERROR_INVALID_ARGUMENT;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u)
{
    if (!valid(d) || !u)
        return NVML_ERROR_INVALID_ARGUMENT;
    u->gpu = d->sm_percent;
    u->memory = d->sm_percent / 2;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m)
{
    if (!valid(d) || !m)
        return NVML_ERROR_INVALID_ARGUMENT;
    m->total = d->mem_total;
    m->used = d->mem_used[d->mem_calls++ % MEM_STEPS] + RESERVED;
    m->free = m->total - m->used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m)
{
    /* STANDIN_NVML_NO_MEMORY_V2=1: a driver from before version 2 */
    const char *old = getenv("STANDIN_NVML_NO_MEMORY_V2");
    if (old && *old == '1')
        return NVML_ERROR_FUNCTION_NOT_FOUND;
    if (!valid(d) || !m)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (m->version != NVML_MEMORY_V2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    m->total = d->mem_total;
    m->reserved = RESERVED;
    m->used = d->mem_used[d->mem_calls++ % MEM_STEPS];
    m->free = m->total - m->reserved - m->used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCurrPcieLinkGeneration(nvmlDevice_t d, unsigned int *gen)
{
    if (!valid(d) || !gen)
        return NVML_ERROR_INVALID_ARGUMENT;
    *gen = d->pcie_gen;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCurrPcieLinkWidth(nvmlDevice_t d, unsigned int *width)
{
    if (!valid(d) || !width)
        return NVML_ERROR_INVALID_ARGUMENT;
    *width = d->pcie_width;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t d, unsigned int counter,
                                         unsigned int *kbps)
{
    if (!valid(d) || !kbps || counter > NVML_PCIE_UTIL_RX_BYTES)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (counter == NVML_PCIE_UTIL_RX_BYTES && d->rx_fails)
        return NVML_ERROR_NOT_SUPPORTED;
    *kbps = d->pcie_kbps[counter];
    return NVML_SUCCESS;
}
