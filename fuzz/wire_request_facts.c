/* Fuzz target: spanlet._wire.request_facts on any bytes, with the request
 * totals' own keys (agent/request_totals.py _KEYS).
 * Input: u16 start, u16 end (little-endian), then the blob. start: that value
 * modulo len + 1; end: len less the value modulo (len - start + 1), so 0 0 is
 * the whole blob; a start of 0xffff asks for bounds past the blob's end. */
#include "../native/spanlet_wire.c"
#include "harness.h"

static PyObject *keys;

static int target_init(void)
{
    keys = Py_BuildValue("((y,i)(y,i)(y,i)(y,i)(y,i)(y,i)(y,i)(y,i))",
                         "sched.cpu_ns", 0, "batch.sched.cpu_ns", 0, "sched.runqueue_ns", 1,
                         "batch.sched.runqueue_ns", 1, "sched.blocked_ns", 2, "batch.sched.blocked_ns", 2,
                         "gpu.memcpy_h2d_bytes", 3, "batch.gpu.memcpy_h2d_bytes", 3);
    return keys ? 0 : -1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    input_t in = {data, size};
    Py_ssize_t a = (Py_ssize_t)take(&in, 2), b = (Py_ssize_t)take(&in, 2), len = (Py_ssize_t)in.left;
    Py_ssize_t start = a == 0xffff ? len + 1 : a % (len + 1);
    Py_ssize_t end = a == 0xffff ? len + 2 : len - b % (len - start + 1);
    exact_t blob;
    PyObject *args = Py_BuildValue("(OnnO)", exact_view(&blob, in.p, in.left), start, end, keys);
    if (!args)
        abort();
    settle(request_facts(NULL, args), "request_facts");
    Py_DECREF(args);
    exact_free(&blob);
    return 0;
}
