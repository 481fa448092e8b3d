/* Fuzz target: the span marker's argument handling (spanlet.libspanlet_marker:
 * mark, follow, unmark, set_follow_flags, forget, and the trace id and span
 * context readers the Follower uses) on any arguments: ints of any size and
 * sign, other types, the wrong number of them. A trace id read back must be
 * the int it was read from.
 * Input: calls, one after another: a call byte (bits 0-2: which function;
 * bits 3-4: its argument count right, one short, one over, none), then each
 * argument as an argument byte and the bytes it takes (make_arg). */
#include "../native/spanlet_marker.c"
#include "harness.h"

#define MAX_CALLS 64
#define MAX_ARGS 4

static int target_init(void)
{
    return 0;
}

static PyObject *make_arg(input_t *in, int depth);

/* An int of n little-endian bytes, signed or not. */
static PyObject *int_arg(input_t *in, int is_signed)
{
    size_t n = (size_t)take(in, 1) % 33;
    if (n > in->left)
        n = in->left;
    PyObject *v = _PyLong_FromByteArray(in->p, n, 1, is_signed);
    in->p += n;
    in->left -= n;
    return v;
}

/* Argument byte: 0 an unsigned int, 1 a signed one, 2 None, 3 a float, 4 a
 * str, 5 True, 6 an edge of a range (2**64, 2**128 and their neighbours,
 * -1), 7 a (trace, span) pair as a tuple or a list (a span context). */
static PyObject *make_arg(input_t *in, int depth)
{
    static const char *const EDGES[] = {"18446744073709551615", "18446744073709551616",
                                        "340282366920938463463374607431768211455",
                                        "340282366920938463463374607431768211456", "-1", "65535", "65536"};
    unsigned t = (unsigned)take(in, 1);
    switch (t & 7) {
    case 0:
    case 1:
        return int_arg(in, t & 1);
    case 2:
        return Py_NewRef(Py_None);
    case 3: {
        uint64_t bits = take(in, 8);
        double d;
        memcpy(&d, &bits, sizeof d);
        return PyFloat_FromDouble(d);
    }
    case 4:
        return PyUnicode_FromString("1");
    case 5:
        return Py_NewRef(Py_True);
    case 6:
        return PyLong_FromString(EDGES[(t >> 3) % (sizeof EDGES / sizeof EDGES[0])], NULL, 10);
    default: {
        if (depth > 0)
            return Py_NewRef(Py_None);
        PyObject *a = make_arg(in, depth + 1), *b = make_arg(in, depth + 1);
        PyObject *pair = a && b ? Py_BuildValue(t & 8 ? "[OO]" : "(OO)", a, b) : NULL;
        Py_XDECREF(a);
        Py_XDECREF(b);
        return pair;
    }
    }
}

/* trace_halves' two halves must make up the int it was given. */
static void check_halves(PyObject *trace_id, uint64_t hi, uint64_t lo)
{
    PyObject *h = PyLong_FromUnsignedLongLong(hi), *l = PyLong_FromUnsignedLongLong(lo);
    PyObject *sixty_four = PyLong_FromLong(64);
    PyObject *shifted = h && sixty_four ? PyNumber_Lshift(h, sixty_four) : NULL;
    PyObject *whole = shifted && l ? PyNumber_Or(shifted, l) : NULL;
    int same = whole ? PyObject_RichCompareBool(whole, trace_id, Py_EQ) : -1;
    Py_XDECREF(h);
    Py_XDECREF(l);
    Py_XDECREF(sixty_four);
    Py_XDECREF(shifted);
    Py_XDECREF(whole);
    if (same != 1) {
        PyErr_Print();
        fprintf(stderr, "fuzz: trace_halves gave %016llx %016llx for another int\n",
                (unsigned long long)hi, (unsigned long long)lo);
        abort();
    }
}

static PyObject *call(unsigned fn, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t hi, lo, span;
    switch (fn) {
    case 0:
        return py_mark(NULL, args, nargs);
    case 1:
        return py_follow(NULL, args, nargs);
    case 2:
        return py_unmark(NULL, args, nargs);
    case 3:
        return nargs ? py_set_follow_flags(NULL, args[0]) : py_forget(NULL, NULL);
    case 4:
        return py_forget(NULL, NULL);
    case 5:
        if (!nargs)
            return Py_NewRef(Py_None);
        return span_ids(args[0], &hi, &lo, &span) < 0 ? NULL : Py_NewRef(Py_None);
    default:
        if (!nargs)
            return Py_NewRef(Py_None);
        if (trace_halves(args[0], &hi, &lo) < 0)
            return NULL;
        check_halves(args[0], hi, lo);
        return Py_NewRef(Py_None);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const Py_ssize_t ARITY[8] = {3, 3, 2, 1, 0, 1, 1, 1};
    static const char *const NAMES[8] = {"mark", "follow", "unmark", "set_follow_flags", "forget",
                                         "span_ids", "trace_halves", "trace_halves"};
    input_t in = {data, size};
    last = (struct last_mark){0};             /* each input starts as a fresh process (record_reset) */
    follow_flags = 0;
    for (int c = 0; c < MAX_CALLS && in.left; c++) {
        unsigned op = (unsigned)take(&in, 1), fn = op & 7, shape = (op >> 3) & 3;
        Py_ssize_t nargs = ARITY[fn] + (shape == 1 ? -1 : shape == 2 ? 1 : 0);
        if (shape == 3 || nargs < 0)
            nargs = 0;
        PyObject *args[MAX_ARGS] = {NULL};
        int made = 1;
        for (Py_ssize_t i = 0; made && i < nargs; i++)
            made = (args[i] = make_arg(&in, 0)) != NULL;
        if (made)
            settle(call(fn, args, nargs), NAMES[fn]);
        else
            PyErr_Clear();
        for (Py_ssize_t i = 0; i < nargs; i++)
            Py_XDECREF(args[i]);
    }
    return 0;
}
