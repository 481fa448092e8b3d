/* What every fuzz target (the .c files beside it) shares: the embedded interpreter, started
 * once, the fuzz input handed to the native code with no slack round it, and
 * the checks on what a call returns. A target includes the native source it
 * tests first (so its static functions are callable), then this file, and
 * defines target_init() and LLVMFuzzerTestOneInput(). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The target's own start-up, after the interpreter's; non-zero stops the run. */
static int target_init(void);

/* Python's allocator is the C library's, whatever the environment says:
 * pymalloc's arenas would hide an overread past an object's end from ASan. */
static void start_python(void)
{
    PyPreConfig pre;
    PyPreConfig_InitIsolatedConfig(&pre);
    pre.allocator = PYMEM_ALLOCATOR_MALLOC;
    PyStatus st = Py_PreInitialize(&pre);
    if (PyStatus_Exception(st))
        Py_ExitStatusException(st);
    PyConfig config;
    PyConfig_InitIsolatedConfig(&config);
    config.install_signal_handlers = 0;      /* libFuzzer's own handlers stay */
    config.site_import = 0;
    st = Py_InitializeFromConfig(&config);
    PyConfig_Clear(&config);
    if (PyStatus_Exception(st))
        Py_ExitStatusException(st);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    start_python();
    if (target_init() != 0) {
        PyErr_Print();
        fprintf(stderr, "fuzz: the target's start-up failed\n");
        exit(1);
    }
    return 0;
}

/* Fuzz bytes as a read-only memoryview over a copy of exactly their size (a
 * bytes object has a NUL past its end, and libFuzzer's own buffer may have
 * room after it): a read one byte past the end is an ASan report. */
typedef struct {
    uint8_t *copy;
    PyObject *view;
} exact_t;

static PyObject *exact_view(exact_t *e, const uint8_t *data, size_t size)
{
    e->copy = malloc(size ? size : 1);
    if (!e->copy)
        abort();
    if (size)
        memcpy(e->copy, data, size);
    e->view = PyMemoryView_FromMemory((char *)e->copy, (Py_ssize_t)size, PyBUF_READ);
    if (!e->view)
        abort();
    return e->view;
}

/* The view let go, then its memory: a view still held past the call (a
 * reference the native code kept) is reported on its next use. */
static void exact_free(exact_t *e)
{
    PyObject *view = e->view;
    if (Py_REFCNT(view) != 1) {
        fprintf(stderr, "fuzz: the input's view is still referenced after the call\n");
        abort();
    }
    Py_DECREF(view);
    free(e->copy);
}

/* The fuzz input read from the front: a selector byte or two, then the rest. */
typedef struct {
    const uint8_t *p;
    size_t left;
} input_t;

static uint64_t take(input_t *in, size_t bytes)
{
    uint64_t v = 0;
    for (size_t i = 0; i < bytes && in->left; i++, in->left--)
        v |= (uint64_t)*in->p++ << (8 * i);      /* little-endian; 0 past the end */
    return v;
}

/* What a native call gave back, checked as the interpreter would: a result
 * and no exception, or no result and an exception that a caller may get
 * (not a SystemError, which is CPython's word for a C extension's bug). The
 * result is let go; any exception cleared. */
static void settle(PyObject *result, const char *call)
{
    if (result) {
        if (PyErr_Occurred()) {
            PyErr_Print();
            fprintf(stderr, "fuzz: %s returned a value with an exception set\n", call);
            abort();
        }
        Py_DECREF(result);
        return;
    }
    if (!PyErr_Occurred()) {
        fprintf(stderr, "fuzz: %s returned NULL with no exception set\n", call);
        abort();
    }
    if (PyErr_ExceptionMatches(PyExc_SystemError)) {
        PyErr_Print();
        fprintf(stderr, "fuzz: %s raised SystemError\n", call);
        abort();
    }
    PyErr_Clear();
}

/* Python source run once at start-up in the namespace `ns` (the helpers a
 * target calls); NULL with the error printed if it fails. */
static PyObject *python_helpers(const char *source)
{
    PyObject *ns = PyDict_New();
    if (!ns)
        return NULL;
    if (PyDict_SetItemString(ns, "__builtins__", PyEval_GetBuiltins()) < 0) {
        Py_DECREF(ns);
        return NULL;
    }
    PyObject *r = PyRun_String(source, Py_file_input, ns, ns);
    if (!r) {
        Py_DECREF(ns);
        return NULL;
    }
    Py_DECREF(r);
    return ns;
}

/* A whole target that hands the input, as exact-size bytes, to one METH_O
 * function of the included source. */
#define BYTES_TARGET(fn)                                                     \
    static int target_init(void)                                            \
    {                                                                       \
        return 0;                                                           \
    }                                                                       \
    int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)            \
    {                                                                       \
        exact_t input;                                                      \
        settle(fn(NULL, exact_view(&input, data, size)), #fn);              \
        exact_free(&input);                                                 \
        return 0;                                                           \
    }
