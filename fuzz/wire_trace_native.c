/* Fuzz target: spanlet._wire.trace_native on the rows span_proto_rows makes
 * of any bytes (the chain the store runs: a ResourceSpans' spans, then their
 * ClickHouse Native block), or on one row whose span is the bytes.
 * Input: a selector byte, then the blob. Selector bits 0-1: the resource's
 * attributes (str texts; none; an int value; a str that is no UTF-8), bit 2:
 * a service that is no UTF-8, bit 3: a resource that is None, not a dict,
 * bit 6: the rows twice, the second time with the next resource (a change of
 * group between rows), bit 7: the blob is one Span's bytes, not a
 * ResourceSpans. */
#include "../native/spanlet_wire.c"
#include "harness.h"

#define N_RESOURCES 4
static PyObject *resources[N_RESOURCES], *services[2];

static int target_init(void)
{
    resources[0] = Py_BuildValue("{ssss}", "service.name", "fuzz", "host.name", "h");
    resources[1] = PyDict_New();
    resources[2] = Py_BuildValue("{si}", "n", 1);
    resources[3] = Py_BuildValue("{sN}", "s", PyUnicode_DecodeUTF8("\xff", 1, "surrogateescape"));
    services[0] = PyUnicode_FromString("fuzz");
    services[1] = PyUnicode_DecodeUTF8("\xff", 1, "surrogateescape");
    for (int i = 0; i < N_RESOURCES; i++)
        if (!resources[i])
            return -1;
    return services[0] && services[1] ? 0 : -1;
}

/* The rows of the blob under one resource; NULL with an exception. */
static PyObject *rows_of(PyObject *blob, unsigned resource, PyObject *service, int one_span)
{
    PyObject *res = resource & 8 ? Py_None : resources[resource % N_RESOURCES];
    if (one_span)
        return Py_BuildValue("[[OOOOss]]", blob, Py_False, res, service, "scope", "1.0");
    PyObject *args = Py_BuildValue("(OOO)", blob, res, service);
    if (!args)
        return NULL;
    PyObject *rows = span_proto_rows(NULL, args);
    Py_DECREF(args);
    return rows;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    input_t in = {data, size};
    unsigned sel = (unsigned)take(&in, 1);
    PyObject *blob = PyBytes_FromStringAndSize((const char *)in.p, (Py_ssize_t)in.left);
    if (!blob)
        abort();
    PyObject *service = services[(sel >> 2) & 1];
    PyObject *rows = rows_of(blob, sel & 11, service, sel & 0x80);
    if (rows && (sel & 0x40)) {
        PyObject *more = rows_of(blob, (sel & 3) + 1, service, sel & 0x80);   /* a dict again */
        int rc = more ? PyList_SetSlice(rows, PyList_GET_SIZE(rows), PyList_GET_SIZE(rows), more) : -1;
        Py_XDECREF(more);
        if (rc < 0)
            Py_CLEAR(rows);
    }
    if (rows) {
        settle(trace_native(NULL, rows), "trace_native");
        Py_DECREF(rows);
    } else {
        settle(NULL, "span_proto_rows");      /* not a ResourceSpans: nothing for trace_native */
    }
    Py_DECREF(blob);
    return 0;
}
