/* Fuzz target: spanlet._wire.span_proto_rows on any bytes as a serialized
 * ResourceSpans (the store's rows: each span's bytes, its scope's texts). */
#include "../native/spanlet_wire.c"
#include "harness.h"

static PyObject *resource_attrs, *service;

static int target_init(void)
{
    resource_attrs = Py_BuildValue("{ss}", "service.name", "fuzz");
    service = PyUnicode_FromString("fuzz");
    return resource_attrs && service ? 0 : -1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    exact_t blob;
    PyObject *args = Py_BuildValue("(OOO)", exact_view(&blob, data, size), resource_attrs, service);
    if (!args)
        abort();
    settle(span_proto_rows(NULL, args), "span_proto_rows");
    Py_DECREF(args);
    exact_free(&blob);
    return 0;
}
