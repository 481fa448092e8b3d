/* The span marker that agent/client.py calls whenever a thread's current span
 * changes: the CPython extension spanlet.libspanlet_marker, whose spanlet_mark
 * the agent's uprobe (bpf/span_ctx.bpf.c) reads the arguments of. */

/*
 * Built by the package build itself (pyproject.toml, [tool.setuptools]
 * ext-modules) into spanlet/libspanlet_marker.cpython-*.so; the agent's
 * discovery finds it by the base name libspanlet_marker. The test build adds
 * -DSPANLET_MARKER_RECORD, which makes spanlet_mark also keep a bounded log of
 * its calls, read through the module's record_* functions
 * (tests/unit/test_client.py); the production build contains none of that code.
 *
 * ABI of spanlet_mark (x86-64 SysV, all four arguments in registers, read by
 * the uprobe at entry):
 *   rdi = trace_hi   high 64 bits of the 128-bit trace id (big-endian bytes 0..7)
 *   rsi = trace_lo   low 64 bits (bytes 8..15)
 *   rdx = span_id    the 64-bit span id; 0 means "this thread is in no span"
 *   ecx = modality   0 other, 1 text, 2 image, 3 audio, 4 video (agent/events.py)
 * A change to that contract, or to the module's functions (mark(), follow(),
 * unmark(), forget(): the entry points the Python client calls, below), bumps
 * SPANLET_MARKER_ABI_VERSION (the module's ABI_VERSION), which the client
 * checks before it uses the module. 3: follow, unmark and forget added.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h> /* first: it sets the feature macros (_GNU_SOURCE) for the libc headers */
#include <stdint.h>
#ifdef SPANLET_MARKER_RECORD
#include <sys/syscall.h>
#include <unistd.h>
#endif

#ifndef SPANLET_MARKER_ABI_VERSION /* -D only to test the client's version check */
#define SPANLET_MARKER_ABI_VERSION 3
#endif
#define SPANLET_EXPORT __attribute__((visibility("default"), noinline, used))
/* GCC may otherwise clone a noinline function for a caller in the same file
 * (.isra, .constprop) and call the clone: mark() must reach the probed symbol. */
#if defined(__has_attribute)
#if __has_attribute(noipa)
#define SPANLET_NO_CLONE __attribute__((noipa))
#endif
#endif
#ifndef SPANLET_NO_CLONE
#define SPANLET_NO_CLONE
#endif

#ifdef SPANLET_MARKER_RECORD
/* Big enough for every test; calls past it are counted but not kept. */
#define SPANLET_MARKER_RECORD_CAP 65536

struct spanlet_marker_record {
	uint64_t trace_hi;
	uint64_t trace_lo;
	uint64_t span_id;
	uint32_t modality;
	uint32_t tid;
};

static struct spanlet_marker_record records[SPANLET_MARKER_RECORD_CAP];
static uint64_t records_seen;

static void record(uint64_t trace_hi, uint64_t trace_lo, uint64_t span_id, uint32_t modality)
{
	uint64_t slot = __atomic_fetch_add(&records_seen, 1, __ATOMIC_RELAXED);

	if (slot >= SPANLET_MARKER_RECORD_CAP)
		return;
	records[slot] = (struct spanlet_marker_record){
		.trace_hi = trace_hi,
		.trace_lo = trace_lo,
		.span_id = span_id,
		.modality = modality,
		.tid = (uint32_t)syscall(SYS_gettid),
	};
}

/* record_count(): the number of calls since the last reset, kept or not. */
static PyObject *py_record_count(PyObject *module, PyObject *unused)
{
	return PyLong_FromUnsignedLongLong(__atomic_load_n(&records_seen, __ATOMIC_ACQUIRE));
}

/* record_get(index): (trace_hi, trace_lo, span_id, modality, tid) of call
 * number `index`; IndexError if it was not kept. */
static PyObject *py_record_get(PyObject *module, PyObject *arg)
{
	unsigned long long index = PyLong_AsUnsignedLongLong(arg);
	struct spanlet_marker_record r;

	if (index == (unsigned long long)-1 && PyErr_Occurred())
		return NULL;
	if (index >= SPANLET_MARKER_RECORD_CAP || index >= __atomic_load_n(&records_seen, __ATOMIC_ACQUIRE)) {
		PyErr_Format(PyExc_IndexError, "marker call %llu was not recorded", index);
		return NULL;
	}
	r = records[index];
	return Py_BuildValue("(KKKII)", (unsigned long long)r.trace_hi, (unsigned long long)r.trace_lo,
			     (unsigned long long)r.span_id, (unsigned int)r.modality, (unsigned int)r.tid);
}

#endif /* SPANLET_MARKER_RECORD */

/*
 * Where the uprobe goes on x86-64: a 5-byte NOP. Since Linux 6.18
 * (arch_uprobe_optimize, "uprobes/x86: Add support to optimize uprobes") a
 * uprobe on exactly this instruction is turned, after its first hit, into a
 * call to a trampoline instead of an int3 trap: under 1 µs a hit instead of
 * about 7 µs, measured on the 6.18 VM this was written on. Older kernels trap
 * on it like on any instruction. At -O2 it is the function's first instruction
 * (unless the compiler adds endbr64 for -fcf-protection: then it follows at +4).
 */
#if defined(__x86_64__)
#define SPANLET_PROBE_SITE ".byte 0x0f, 0x1f, 0x44, 0x00, 0x00" /* nopl 0x0(%rax,%rax,1) */
#else
#define SPANLET_PROBE_SITE ""
#endif

/*
 * The probed function. Its whole production body is the probe-site NOP in an
 * asm that claims to read the arguments and clobber memory, so the compiler
 * can neither drop the call site's argument setup nor fold this function into
 * another one.
 */
SPANLET_EXPORT SPANLET_NO_CLONE void spanlet_mark(uint64_t trace_hi, uint64_t trace_lo,
						  uint64_t span_id, uint32_t modality)
{
	__asm__ volatile(SPANLET_PROBE_SITE : : "r"(trace_hi), "r"(trace_lo), "r"(span_id),
			 "r"(modality) : "memory");
#ifdef SPANLET_MARKER_RECORD
	record(trace_hi, trace_lo, span_id, modality);
#endif
}

/* The 128-bit trace id as its two 64-bit halves; -1 with an exception set if
 * it is not an int in [0, 2**128). */
static int trace_halves(PyObject *trace_id, uint64_t *hi, uint64_t *lo)
{
	uint64_t words[2]; /* the id's 16 bytes in the machine's order */

	if (!PyLong_Check(trace_id)) {
		PyErr_SetString(PyExc_TypeError, "trace_id must be an int");
		return -1;
	}
#if PY_VERSION_HEX >= 0x030D0000
	Py_ssize_t need = PyLong_AsNativeBytes(trace_id, words, sizeof(words),
					       Py_ASNATIVEBYTES_NATIVE_ENDIAN |
					       Py_ASNATIVEBYTES_UNSIGNED_BUFFER |
					       Py_ASNATIVEBYTES_REJECT_NEGATIVE);
	if (need < 0)
		return -1;
	if ((size_t)need > sizeof(words)) {
		PyErr_SetString(PyExc_OverflowError, "trace_id does not fit in 128 bits");
		return -1;
	}
#else /* 3.11, 3.12: the private converter (its signature changed in 3.13) */
	if (_PyLong_AsByteArray((PyLongObject *)trace_id, (unsigned char *)words, sizeof(words),
				PY_LITTLE_ENDIAN, 0) < 0)
		return -1;
#endif
	*hi = words[PY_LITTLE_ENDIAN ? 1 : 0];
	*lo = words[PY_LITTLE_ENDIAN ? 0 : 1];
	return 0;
}

/* mark()'s arguments as the probed function takes them; 0 and -1 with an
 * exception set if they are not ints in range. */
static int parse_mark(PyObject *const *args, Py_ssize_t nargs, const char *name, uint64_t *trace_hi,
		      uint64_t *trace_lo, uint64_t *span_id, uint32_t *modality)
{
	unsigned long long span;
	unsigned long m;

	if (nargs != 3) {
		PyErr_Format(PyExc_TypeError, "%s() takes 3 arguments (%zd given)", name, nargs);
		return -1;
	}
	if (trace_halves(args[0], trace_hi, trace_lo) < 0)
		return -1;
	span = PyLong_AsUnsignedLongLong(args[1]);
	if (span == (unsigned long long)-1 && PyErr_Occurred())
		return -1;
	m = PyLong_AsUnsignedLong(args[2]);
	if (m == (unsigned long)-1 && PyErr_Occurred())
		return -1;
	if (m > UINT32_MAX) {
		PyErr_SetString(PyExc_OverflowError, "modality does not fit in 32 bits");
		return -1;
	}
	*span_id = span;
	*modality = (uint32_t)m;
	return 0;
}

/*
 * mark(trace_id, span_id, modality): calls spanlet_mark unconditionally.
 * METH_FASTCALL: the arguments arrive as a C array, with no tuple built
 * and no ctypes conversion objects (the ctypes entry point this replaces cost
 * about 0.3 µs a call). The GIL is kept: a release and re-take would cost more
 * than the call. The call to spanlet_mark is a real call (noinline, noipa,
 * interposable), so the uprobe on it fires.
 */
static PyObject *py_mark(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
	uint64_t trace_hi, trace_lo, span_id;
	uint32_t modality;

	if (parse_mark(args, nargs, "mark", &trace_hi, &trace_lo, &span_id, &modality) < 0)
		return NULL;
	spanlet_mark(trace_hi, trace_lo, span_id, modality);
	Py_RETURN_NONE;
}

/*
 * What spanlet_mark was last called with on this thread: plain integers in
 * thread-local storage, so they hold no reference and go with the thread.
 * A thread that never marked starts as "in no span" (all zero), which is what
 * the agent holds for a thread it has never seen. `unknown` set (forget()):
 * the next follow() marks whatever it is given.
 */
struct last_mark {
	uint64_t trace_hi, trace_lo, span_id;
	uint32_t modality;
	uint32_t unknown;
};
static _Thread_local struct last_mark last;

/* follow(trace_id, span_id, modality): the calling thread is now in this span
 * (span_id 0: none); calls spanlet_mark only if that is not what it last
 * told it. True if it marked. */
static PyObject *py_follow(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
	struct last_mark now = {0};

	if (parse_mark(args, nargs, "follow", &now.trace_hi, &now.trace_lo, &now.span_id, &now.modality) < 0)
		return NULL;
	if (!last.unknown && now.span_id == last.span_id && now.trace_lo == last.trace_lo &&
	    now.trace_hi == last.trace_hi && now.modality == last.modality)
		Py_RETURN_FALSE;
	last = now;
	spanlet_mark(now.trace_hi, now.trace_lo, now.span_id, now.modality);
	Py_RETURN_TRUE;
}

/* unmark(trace_id, span_id): a span that ends; if it is the calling thread's
 * last mark, the thread is marked as in no span. True if it marked. */
static PyObject *py_unmark(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
	uint64_t trace_hi, trace_lo;
	unsigned long long span_id;

	if (nargs != 2) {
		PyErr_Format(PyExc_TypeError, "unmark() takes 2 arguments (%zd given)", nargs);
		return NULL;
	}
	if (trace_halves(args[0], &trace_hi, &trace_lo) < 0)
		return NULL;
	span_id = PyLong_AsUnsignedLongLong(args[1]);
	if (span_id == (unsigned long long)-1 && PyErr_Occurred())
		return NULL;
	if (last.unknown || span_id == 0 || span_id != last.span_id || trace_lo != last.trace_lo ||
	    trace_hi != last.trace_hi)
		Py_RETURN_FALSE;
	last = (struct last_mark){0};
	spanlet_mark(0, 0, 0, 0);
	Py_RETURN_TRUE;
}

#ifdef SPANLET_MARKER_RECORD
/* record_reset(): forget the recorded calls, and the calling thread's last
 * mark (back to "in no span"), as a fresh process would be. */
static PyObject *py_record_reset(PyObject *module, PyObject *unused)
{
	__atomic_store_n(&records_seen, 0, __ATOMIC_RELEASE);
	last = (struct last_mark){0};
	Py_RETURN_NONE;
}
#endif

/* forget(): the calling thread's last mark is unknown (a forked child's
 * thread, another build of the marker taking over); the next follow() marks. */
static PyObject *py_forget(PyObject *module, PyObject *unused)
{
	last = (struct last_mark){.unknown = 1};
	Py_RETURN_NONE;
}

static PyMethodDef marker_methods[] = {
	{"mark", (PyCFunction)(void (*)(void))py_mark, METH_FASTCALL,
	 "mark(trace_id, span_id, modality)\n--\n\n"
	 "Tell the spanlet agent that the calling thread is now in this span "
	 "(span_id 0: in none)."},
	{"follow", (PyCFunction)(void (*)(void))py_follow, METH_FASTCALL,
	 "follow(trace_id, span_id, modality)\n--\n\n"
	 "mark() unless it is what this thread last marked; True if it marked."},
	{"unmark", (PyCFunction)(void (*)(void))py_unmark, METH_FASTCALL,
	 "unmark(trace_id, span_id)\n--\n\n"
	 "Mark this thread as in no span if this span is its last mark; True if it marked."},
	{"forget", py_forget, METH_NOARGS,
	 "forget()\n--\n\nThis thread's last mark is unknown: the next follow() marks."},
#ifdef SPANLET_MARKER_RECORD
	{"record_count", py_record_count, METH_NOARGS, "Calls since the last reset, kept or not."},
	{"record_get", py_record_get, METH_O,
	 "(trace_hi, trace_lo, span_id, modality, tid) of one recorded call."},
	{"record_reset", py_record_reset, METH_NOARGS,
	 "Forget the recorded calls and this thread's last mark."},
#endif
	{NULL, NULL, 0, NULL},
};

static int marker_exec(PyObject *module)
{
	return PyModule_AddIntConstant(module, "ABI_VERSION", SPANLET_MARKER_ABI_VERSION);
}

static PyModuleDef_Slot marker_slots[] = {
	{Py_mod_exec, marker_exec},
#if PY_VERSION_HEX >= 0x030C0000
	{Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
#if PY_VERSION_HEX >= 0x030D0000
	{Py_mod_gil, Py_MOD_GIL_NOT_USED}, /* state is thread-local; the record log uses atomics */
#endif
	{0, NULL},
};

static struct PyModuleDef marker_module = {
	PyModuleDef_HEAD_INIT,
	.m_name = "spanlet.libspanlet_marker",
	.m_doc = "The span marker whose spanlet_mark the spanlet agent uprobes.",
	.m_size = 0,
	.m_methods = marker_methods,
	.m_slots = marker_slots,
};

PyMODINIT_FUNC PyInit_libspanlet_marker(void)
{
	return PyModuleDef_Init(&marker_module);
}
