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
 *                    in its low 16 bits; the high 16 bits are the process's
 *                    follow flags (set_follow_flags(): why its spans are
 *                    followed per thread only; spanlet/runtimes.py), 0 when
 *                    every span of the process is followed per coroutine
 * A change to that contract, or to the module's functions and type (mark(),
 * follow(), unmark(), forget(), Follower: the entry points the Python client
 * calls, below), bumps
 * SPANLET_MARKER_ABI_VERSION (the module's ABI_VERSION), which the client
 * checks before it uses the module. 3: follow, unmark and forget added; 4:
 * the Follower type (the client's hot paths) added; 5: the follow flags in
 * the modality's high bits, set_follow_flags(), Follower.wrap() and the
 * FollowedCoroutine type (asyncio task steps), on_start's first_start.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h> /* first: it sets the feature macros (_GNU_SOURCE) for the libc headers */
#include <stdint.h>
#include <structmember.h> /* PyMemberDef, T_OBJECT_EX (3.11's spelling; Py_T_OBJECT_EX from 3.12) */
#ifdef SPANLET_MARKER_RECORD
#include <sys/syscall.h>
#include <unistd.h>
#endif

#ifndef SPANLET_MARKER_ABI_VERSION /* -D only to test the client's version check */
#define SPANLET_MARKER_ABI_VERSION 5
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
	if (m > 0xffff) { /* the high 16 bits of the probed argument are the follow flags */
		PyErr_SetString(PyExc_OverflowError, "modality does not fit in 16 bits");
		return -1;
	}
	*span_id = span;
	*modality = (uint32_t)m;
	return 0;
}

/* The process's follow flags (set_follow_flags()), in the high 16 bits of
 * every mark's modality argument, so that an agent attached at any time sees
 * them with the process's next mark. */
static uint32_t follow_flags;

static inline void mark_now(uint64_t trace_hi, uint64_t trace_lo, uint64_t span_id, uint32_t modality)
{
	spanlet_mark(trace_hi, trace_lo, span_id,
		     (modality & 0xffff) | (__atomic_load_n(&follow_flags, __ATOMIC_RELAXED) << 16));
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
	mark_now(trace_hi, trace_lo, span_id, modality);
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

/* The calling thread is now in `now`: spanlet_mark unless that is what it was
 * last told. 1 if it marked. */
static int follow_mark(const struct last_mark *now)
{
	if (!last.unknown && now->span_id == last.span_id && now->trace_lo == last.trace_lo &&
	    now->trace_hi == last.trace_hi && now->modality == last.modality)
		return 0;
	last = *now;
	last.unknown = 0;
	mark_now(now->trace_hi, now->trace_lo, now->span_id, now->modality);
	return 1;
}

/* A span ends: if it is the calling thread's last mark, the thread is marked as
 * in no span. 1 if it marked. */
static int unmark_span(uint64_t trace_hi, uint64_t trace_lo, uint64_t span_id)
{
	if (last.unknown || span_id == 0 || span_id != last.span_id || trace_lo != last.trace_lo ||
	    trace_hi != last.trace_hi)
		return 0;
	last = (struct last_mark){0};
	mark_now(0, 0, 0, 0);
	return 1;
}

/* follow(trace_id, span_id, modality): the calling thread is now in this span
 * (span_id 0: none); calls spanlet_mark only if that is not what it last
 * told it. True if it marked. */
static PyObject *py_follow(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
	struct last_mark now = {0};

	if (parse_mark(args, nargs, "follow", &now.trace_hi, &now.trace_lo, &now.span_id, &now.modality) < 0)
		return NULL;
	return PyBool_FromLong(follow_mark(&now));
}

/* The trace id and span id of a SpanContext (a tuple: trace_id, span_id, ...). */
static int span_ids(PyObject *ctx, uint64_t *trace_hi, uint64_t *trace_lo, uint64_t *span_id)
{
	PyObject *trace, *span;
	unsigned long long id;
	int rc = -1;

	if (PyTuple_Check(ctx) && PyTuple_GET_SIZE(ctx) >= 2) {
		trace = Py_NewRef(PyTuple_GET_ITEM(ctx, 0));
		span = Py_NewRef(PyTuple_GET_ITEM(ctx, 1));
	} else {
		trace = PySequence_GetItem(ctx, 0);
		span = trace ? PySequence_GetItem(ctx, 1) : NULL;
	}
	if (span && trace_halves(trace, trace_hi, trace_lo) == 0) {
		id = PyLong_AsUnsignedLongLong(span);
		if (!(id == (unsigned long long)-1 && PyErr_Occurred())) {
			*span_id = id;
			rc = 0;
		}
	}
	Py_XDECREF(trace);
	Py_XDECREF(span);
	return rc;
}

/* unmark(trace_id, span_id): a span that ends; if it is the calling thread's
 * last mark, the thread is marked as in no span. True if it marked. */
static PyObject *py_unmark(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
	uint64_t trace_hi, trace_lo, span_id;

	if (nargs != 2) {
		PyErr_Format(PyExc_TypeError, "unmark() takes 2 arguments (%zd given)", nargs);
		return NULL;
	}
	if (trace_halves(args[0], &trace_hi, &trace_lo) < 0)
		return NULL;
	span_id = PyLong_AsUnsignedLongLong(args[1]);
	if (span_id == (uint64_t)-1 && PyErr_Occurred())
		return NULL;
	return PyBool_FromLong(unmark_span(trace_hi, trace_lo, span_id));
}

/*
 * Follower: the client's hot paths in C (ABI 4), so that a span edge costs no
 * Python frame of spanlet's own. The client (agent/client.py) makes one for
 * the newest active processor's marker and points at its bound methods:
 *   attach(context), detach(token)   the OTel runtime context's, wrapped:
 *                                    set/reset, then follow the thread's span
 *   follow_current()                 follow the thread's current OTel context
 *   follow_context(ctx)              follow the OTel context held in the
 *                                    contextvars.Context `ctx` (asyncio and
 *                                    executor hooks)
 *   on_start(span, parent_context)   the processor's: keep the span's mark()
 *                                    arguments on it, as the tuple
 *                                    span._spanlet_mark
 *   on_end(span)                     the processor's: unmark a span that ends
 *                                    while it is its thread's last mark
 * "Follow" reads the current span from the OTel Context (span_key), takes its
 * mark from span._spanlet_mark (none if it ended), and marks if that changed,
 * as follow() does. The SDK's own classes take the direct path; any other span
 * (or an SDK span without the tuple) goes through the client's entry_of(span)
 * (is_recording() and the public API), and a span not of the SDK's class
 * through its start_of(span) at start. Errors never reach the caller: an
 * Exception is handed to the client's report(where, exception) (one warning
 * per process) and the edge goes on; only a BaseException that is no
 * Exception (KeyboardInterrupt) propagates. What the thread was last told is
 * `last` above, shared with follow() and unmark().
 *   wrap(coro)                       a FollowedCoroutine around an asyncio
 *                                    task's coroutine (the client's task
 *                                    factory): each step of the task is
 *                                    followed, in the task's own context
 * on_start also calls the client's first_start() at the first span start of
 * the process, and at the next ones for as long as it answers True (where
 * the client looks at what the process's requests run on).
 */
typedef struct {
	PyObject_HEAD
	PyObject *var;			/* OTel's ContextVar (its default runtime context), or NULL */
	PyObject *runtime;		/* else the runtime context: its attach/detach/get_current */
	PyObject *span_key;		/* the OTel Context key of the current span */
	PyObject *span_type;		/* the SDK's span class (opentelemetry.sdk.trace._Span) */
	PyObject *readable_type;	/* ReadableSpan, what on_end is given */
	PyObject *context_type;		/* OTel's Context: a dict whose get() is dict.get */
	PyObject *modalities;		/* dict: mm.modality value -> its number */
	PyObject *modality_key;		/* "mm.modality" */
	PyObject *entry_of;		/* entry_of(span) -> (trace_id, span_id, modality) */
	PyObject *start_of;		/* start_of(span): on_start's work for any span */
	PyObject *report;		/* report(where, exception) */
	PyObject *first_start;		/* first_start() -> bool, at a span start while it asks again, or NULL */
	PyObject *zero;			/* 0, the modality "other" */
	/* attribute and method names, interned */
	PyObject *n_end_time, *n_mark, *n_private_context, *n_context, *n_attributes, *n_dict, *n_get,
		*n_attach, *n_detach, *n_get_current;
} Follower;

/* Cleared when the calling code should carry on: an Exception is reported
 * (the client warns once per process) and 0 returned; any other error (a
 * KeyboardInterrupt) stays raised: -1. */
static int reported(Follower *f, const char *where)
{
	PyObject *exc, *result;

	if (!PyErr_ExceptionMatches(PyExc_Exception))
		return -1;
#if PY_VERSION_HEX >= 0x030C0000
	exc = PyErr_GetRaisedException();
#else
	PyObject *type, *tb;
	PyErr_Fetch(&type, &exc, &tb);
	PyErr_NormalizeException(&type, &exc, &tb);
	if (exc && tb)
		PyException_SetTraceback(exc, tb);
	Py_XDECREF(type);
	Py_XDECREF(tb);
#endif
	result = PyObject_CallFunction(f->report, "sO", where, exc ? exc : Py_None);
	if (result == NULL)
		PyErr_Clear(); /* the report itself failed: nothing more to tell */
	Py_XDECREF(result);
	Py_XDECREF(exc);
	return 0;
}

static int optional_attr(PyObject *obj, PyObject *name, PyObject **result)
{
#if PY_VERSION_HEX >= 0x030D0000
	return PyObject_GetOptionalAttr(obj, name, result);
#else
	return _PyObject_LookupAttr(obj, name, result);
#endif
}

/* The mark for `span` (None: in no span) into *now; -1 with an exception. */
static int mark_of(Follower *f, PyObject *span, struct last_mark *now)
{
	PyObject *entry = NULL, *end;
	int rc = -1;

	*now = (struct last_mark){0};
	if (span == Py_None)
		return 0;
	if ((PyObject *)Py_TYPE(span) == f->span_type) { /* is_recording() without its call */
		end = PyObject_GetAttr(span, f->n_end_time);
		if (end == NULL)
			return -1;
		Py_DECREF(end);
		if (end != Py_None)
			return 0; /* ended: in no span */
		if (optional_attr(span, f->n_mark, &entry) < 0)
			return -1;
	}
	if (entry == NULL) /* not the SDK's class, or started by a provider without the processor */
		entry = PyObject_CallOneArg(f->entry_of, span);
	if (entry == NULL)
		return -1;
	if (PyTuple_Check(entry))
		rc = parse_mark(PySequence_Fast_ITEMS(entry), PyTuple_GET_SIZE(entry), "a span's mark", &now->trace_hi,
				&now->trace_lo, &now->span_id, &now->modality);
	else
		PyErr_Format(PyExc_TypeError, "a span's mark is a tuple, not %.100s", Py_TYPE(entry)->tp_name);
	Py_DECREF(entry);
	return rc;
}

/* The current span held in the OTel Context `ctx` (NULL, None: none) into *span, a
 * new reference or NULL (none); what is not an OTel Context holds none. -1
 * only with a non-Exception error raised. */
static int span_in(Follower *f, PyObject *ctx, PyObject **span)
{
	*span = NULL;
	if (ctx == NULL || ctx == Py_None)
		return 0;
	if ((PyObject *)Py_TYPE(ctx) == f->context_type || PyDict_CheckExact(ctx)) {
		*span = PyDict_GetItemWithError(ctx, f->span_key);
		Py_XINCREF(*span);
	} else {
		*span = PyObject_CallMethodOneArg(ctx, f->n_get, f->span_key);
	}
	if (*span != NULL || !PyErr_Occurred())
		return 0;
	if (!PyErr_ExceptionMatches(PyExc_Exception))
		return -1;
	PyErr_Clear(); /* not an OTel Context: the OTel API's own checks speak for it */
	return 0;
}

/* Follow the OTel Context `ctx` (NULL: none): mark its span if that changed.
 * -1 only with a non-Exception error raised. */
static int follow_otel(Follower *f, PyObject *ctx)
{
	struct last_mark now;
	PyObject *span;
	int rc;

	if (span_in(f, ctx, &span) < 0)
		return -1;
	rc = mark_of(f, span ? span : Py_None, &now);
	Py_XDECREF(span);
	if (rc == 0)
		follow_mark(&now);
	else if (reported(f, "to mark a context change") < 0)
		return -1;
	return 0;
}

/* The calling thread's current OTel Context (a new reference), or NULL: none
 * (the runtime failed to say). -1 only with a non-Exception error raised. */
static int current_otel(Follower *f, PyObject **ctx)
{
	*ctx = NULL;
	if (f->var != NULL) {
		if (PyContextVar_Get(f->var, NULL, ctx) == 0)
			return 0;
	} else if ((*ctx = PyObject_CallMethodNoArgs(f->runtime, f->n_get_current)) != NULL) {
		return 0;
	}
	if (!PyErr_ExceptionMatches(PyExc_Exception))
		return -1;
	PyErr_Clear();
	return 0;
}

static int follow_current(Follower *f)
{
	PyObject *ctx;
	int rc;

	if (current_otel(f, &ctx) < 0)
		return -1;
	rc = follow_otel(f, ctx);
	Py_XDECREF(ctx);
	return rc;
}

static int one_arg(Py_ssize_t nargs, const char *name)
{
	if (nargs == 1)
		return 0;
	PyErr_Format(PyExc_TypeError, "%s() takes 1 argument (%zd given)", name, nargs);
	return -1;
}

/* attach(context): the runtime context's attach, then the thread's span followed. */
static PyObject *follower_attach(Follower *f, PyObject *const *args, Py_ssize_t nargs)
{
	PyObject *token;

	if (one_arg(nargs, "attach") < 0)
		return NULL;
	if (f->var != NULL)
		token = PyContextVar_Set(f->var, args[0]);
	else
		token = PyObject_CallMethodOneArg(f->runtime, f->n_attach, args[0]);
	if (token == NULL)
		return NULL;
	if (follow_otel(f, args[0]) < 0)
		Py_CLEAR(token);
	return token;
}

/* detach(token): the runtime context's detach (when it raises, OTel logs it
 * and the context did not change), then the thread's span followed. */
static PyObject *follower_detach(Follower *f, PyObject *const *args, Py_ssize_t nargs)
{
	PyObject *result;

	if (one_arg(nargs, "detach") < 0)
		return NULL;
	if (f->var != NULL) {
		if (PyContextVar_Reset(f->var, args[0]) < 0)
			return NULL;
	} else {
		result = PyObject_CallMethodOneArg(f->runtime, f->n_detach, args[0]);
		if (result == NULL)
			return NULL;
		Py_DECREF(result);
	}
	if (follow_current(f) < 0)
		return NULL;
	Py_RETURN_NONE;
}

/* follow_current(): follow the calling thread's current OTel context. */
static PyObject *follower_follow_current(Follower *f, PyObject *unused)
{
	if (follow_current(f) < 0)
		return NULL;
	Py_RETURN_NONE;
}

/* follow_context(ctx): follow the OTel Context that the contextvars.Context
 * `ctx`, about to run on this thread, holds (none if it holds none). */
static PyObject *follower_follow_context(Follower *f, PyObject *const *args, Py_ssize_t nargs)
{
	PyObject *ctx, *otel = NULL;
	int has, rc;

	if (one_arg(nargs, "follow_context") < 0)
		return NULL;
	if (f->var == NULL) /* another runtime context: no contextvar to read another context's span from */
		Py_RETURN_NONE;
	ctx = args[0];
	if (PyContext_CheckExact(ctx)) {
		has = PySequence_Contains(ctx, f->var);
		if (has > 0)
			otel = PyObject_GetItem(ctx, f->var);
		rc = has < 0 || (has > 0 && otel == NULL) ? -1 : 0;
	} else {
		otel = PyObject_CallMethodOneArg(ctx, f->n_get, f->var);
		rc = otel == NULL ? -1 : 0;
	}
	if (rc < 0 && reported(f, "to mark a context change") < 0)
		return NULL;
	rc = rc < 0 ? 0 : follow_otel(f, otel);
	Py_XDECREF(otel);
	if (rc < 0)
		return NULL;
	Py_RETURN_NONE;
}

/* span._spanlet_mark = (trace_id, span_id, modality number) for an SDK span,
 * from its own fields; -1 with an exception (the caller then takes start_of). */
static int keep_mark(Follower *f, PyObject *span)
{
	PyObject *ctx, *attributes = NULL, *dict = NULL, *value = NULL, *number, *entry = NULL;
	int rc = -1;

	ctx = PyObject_GetAttr(span, f->n_private_context); /* a SpanContext: (trace_id, span_id, ...) */
	if (ctx == NULL)
		return -1;
	if (!PyTuple_Check(ctx) || PyTuple_GET_SIZE(ctx) < 2) {
		PyErr_SetString(PyExc_TypeError, "the span's _context is no SpanContext");
		goto out;
	}
	if ((attributes = PyObject_GetAttr(span, f->n_attributes)) == NULL ||
	    (dict = PyObject_GetAttr(attributes, f->n_dict)) == NULL)
		goto out;
	if (PyDict_Check(dict)) { /* dict or OrderedDict: get() is the lookup */
		value = PyDict_GetItemWithError(dict, f->modality_key);
		Py_XINCREF(value);
	} else {
		value = PyObject_CallMethodOneArg(dict, f->n_get, f->modality_key);
	}
	if (value == NULL && PyErr_Occurred())
		goto out;
	number = value ? PyDict_GetItemWithError(f->modalities, value) : NULL; /* borrowed */
	if (number == NULL && PyErr_Occurred())
		goto out;
	entry = PyTuple_Pack(3, PyTuple_GET_ITEM(ctx, 0), PyTuple_GET_ITEM(ctx, 1), number ? number : f->zero);
	if (entry != NULL)
		rc = PyObject_SetAttr(span, f->n_mark, entry);
out:
	Py_DECREF(ctx);
	Py_XDECREF(attributes);
	Py_XDECREF(dict);
	Py_XDECREF(value);
	Py_XDECREF(entry);
	return rc;
}

/* Whether the client's first_start() has said it need not look again (reset
 * in a forked child, whose process may run on something else). */
static int start_checked;

/* first_start(): the client looks at what the process runs on; a true answer
 * asks to be called again at the next span start. -1 only with a
 * non-Exception error raised. */
static int first_start(Follower *f)
{
	PyObject *again = PyObject_CallNoArgs(f->first_start);
	int truth = 0;

	if (again == NULL)
		return reported(f, "to look at the process's runtime") < 0 ? -1 : (start_checked = 1, 0);
	truth = PyObject_IsTrue(again);
	Py_DECREF(again);
	if (truth < 0 && reported(f, "to look at the process's runtime") < 0)
		return -1;
	if (truth <= 0)
		__atomic_store_n(&start_checked, 1, __ATOMIC_RELAXED);
	return 0;
}

/* on_start(span, parent_context=None): keep the span's mark() arguments on it. */
static PyObject *follower_on_start(Follower *f, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
	PyObject *result;

	if (nargs < 1 || nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0) > 2) {
		PyErr_SetString(PyExc_TypeError, "on_start() takes a span and an optional parent_context");
		return NULL;
	}
	if (f->first_start != NULL && !__atomic_load_n(&start_checked, __ATOMIC_RELAXED) && first_start(f) < 0)
		return NULL;
	if ((PyObject *)Py_TYPE(args[0]) == f->span_type) {
		if (keep_mark(f, args[0]) == 0)
			Py_RETURN_NONE;
		if (!PyErr_ExceptionMatches(PyExc_Exception))
			return NULL;
		PyErr_Clear(); /* another SDK version: the public way below */
	}
	result = PyObject_CallOneArg(f->start_of, args[0]);
	if (result == NULL && reported(f, "in on_start") < 0)
		return NULL;
	Py_XDECREF(result);
	Py_RETURN_NONE;
}

/* on_end(span): a span that ends while it is the thread's last mark is unmarked. */
static PyObject *follower_on_end(Follower *f, PyObject *const *args, Py_ssize_t nargs)
{
	uint64_t trace_hi, trace_lo, span_id;
	PyObject *ctx;
	int rc = -1;

	if (one_arg(nargs, "on_end") < 0)
		return NULL;
	ctx = PyObject_GetAttr(args[0], (PyObject *)Py_TYPE(args[0]) == f->readable_type ? f->n_private_context
											 : f->n_context);
	if (ctx != NULL) {
		rc = span_ids(ctx, &trace_hi, &trace_lo, &span_id);
		Py_DECREF(ctx);
	}
	if (rc == 0)
		unmark_span(trace_hi, trace_lo, span_id);
	else if (reported(f, "in on_end") < 0)
		return NULL;
	Py_RETURN_NONE;
}

/*
 * FollowedCoroutine: an asyncio task's coroutine as the client's task factory
 * hands it to the Task (Follower.wrap), so that every step of the task is
 * followed whatever loop runs it (asyncio's, uvloop's, a first eager step):
 * a step runs in the task's own contextvars.Context, so the span current
 * there is marked as the step begins, and what the thread was marked with
 * before is marked again as it ends (the loop's own callbacks between steps
 * run outside the task). The C Task drives it through am_send; send, throw,
 * close and iteration do the same for other callers; any other attribute
 * (cr_frame, cr_code, __qualname__, ...) is the coroutine's.
 */
typedef struct {
	PyObject_HEAD
	Follower *f;
	PyObject *coro;
} FollowedCoroutine;

struct marker_state {
	PyObject *followed_type;
};

/* Mark the task's span for one step; `before` is what to mark again after it.
 * -1 only with a non-Exception error raised. */
static int step_begins(FollowedCoroutine *c, struct last_mark *before)
{
	*before = last;
	return follow_current(c->f);
}

static void step_ends(const struct last_mark *before)
{
	if (!before->unknown)
		follow_mark(before);
}

static PySendResult followed_am_send(FollowedCoroutine *c, PyObject *arg, PyObject **result)
{
	struct last_mark before;
	PySendResult status;

	if (step_begins(c, &before) < 0) {
		*result = NULL;
		return PYGEN_ERROR;
	}
	status = PyIter_Send(c->coro, arg, result);
	step_ends(&before);
	return status;
}

/* A method of the coroutine, called for one step (send, throw, close). */
static PyObject *followed_call(FollowedCoroutine *c, const char *name, PyObject *args)
{
	struct last_mark before;
	PyObject *method, *result;

	if (step_begins(c, &before) < 0)
		return NULL;
	method = PyObject_GetAttrString(c->coro, name);
	result = method ? PyObject_Call(method, args, NULL) : NULL;
	Py_XDECREF(method);
	step_ends(&before);
	return result;
}

static PyObject *followed_send(FollowedCoroutine *c, PyObject *value)
{
	PyObject *args = PyTuple_Pack(1, value), *result;

	if (args == NULL)
		return NULL;
	result = followed_call(c, "send", args);
	Py_DECREF(args);
	return result;
}

static PyObject *followed_throw(FollowedCoroutine *c, PyObject *args)
{
	return followed_call(c, "throw", args);
}

static PyObject *followed_close(FollowedCoroutine *c, PyObject *unused)
{
	PyObject *args = PyTuple_New(0), *result;

	if (args == NULL)
		return NULL;
	result = followed_call(c, "close", args);
	Py_DECREF(args);
	return result;
}

static PyObject *followed_iternext(FollowedCoroutine *c)
{
	PyObject *result, *stop;

	switch (followed_am_send(c, Py_None, &result)) {
	case PYGEN_NEXT:
		return result;
	case PYGEN_RETURN:
		if (result != Py_None) {
			stop = PyObject_CallOneArg(PyExc_StopIteration, result);
			if (stop != NULL) {
				PyErr_SetObject(PyExc_StopIteration, stop);
				Py_DECREF(stop);
			}
		}
		Py_DECREF(result);
		return NULL;
	default:
		return NULL;
	}
}

static PyObject *followed_await(FollowedCoroutine *c)
{
	return Py_NewRef(c);
}

static PyObject *followed_getattro(FollowedCoroutine *c, PyObject *name)
{
	PyObject *value = PyObject_GenericGetAttr((PyObject *)c, name);

	if (value != NULL || !PyErr_ExceptionMatches(PyExc_AttributeError))
		return value;
	PyErr_Clear();
	return PyObject_GetAttr(c->coro, name);
}

static PyObject *followed_repr(FollowedCoroutine *c)
{
	return PyObject_Repr(c->coro);
}

static int followed_traverse(FollowedCoroutine *c, visitproc visit, void *arg)
{
	Py_VISIT(c->f);
	Py_VISIT(c->coro);
	Py_VISIT(Py_TYPE(c));
	return 0;
}

static int followed_clear(FollowedCoroutine *c)
{
	Py_CLEAR(c->f);
	Py_CLEAR(c->coro);
	return 0;
}

static void followed_dealloc(FollowedCoroutine *c)
{
	PyTypeObject *type = Py_TYPE(c);

	PyObject_GC_UnTrack(c);
	followed_clear(c);
	type->tp_free(c);
	Py_DECREF(type);
}

static PyMethodDef followed_methods[] = {
	{"send", (PyCFunction)followed_send, METH_O, "send(value)\n--\n\nOne step of the coroutine, followed."},
	{"throw", (PyCFunction)followed_throw, METH_VARARGS,
	 "throw(...)\n--\n\nThe coroutine's throw(), followed as a step."},
	{"close", (PyCFunction)followed_close, METH_NOARGS, "close()\n--\n\nThe coroutine's close(), followed."},
	{NULL, NULL, 0, NULL},
};

static PyMemberDef followed_members[] = {
	{"__wrapped__", T_OBJECT_EX, offsetof(FollowedCoroutine, coro), READONLY, "the task's own coroutine"},
	{NULL, 0, 0, 0, NULL},
};

static PyType_Slot followed_slots[] = {
	{Py_am_send, followed_am_send},
	{Py_am_await, followed_await},
	{Py_tp_iter, followed_await},
	{Py_tp_iternext, followed_iternext},
	{Py_tp_getattro, followed_getattro},
	{Py_tp_repr, followed_repr},
	{Py_tp_traverse, followed_traverse},
	{Py_tp_clear, followed_clear},
	{Py_tp_dealloc, followed_dealloc},
	{Py_tp_methods, followed_methods},
	{Py_tp_members, followed_members},
	{Py_tp_doc, "An asyncio task's coroutine whose every step is followed (Follower.wrap)."},
	{0, NULL},
};

static PyType_Spec followed_spec = {
	.name = "spanlet.libspanlet_marker.FollowedCoroutine",
	.basicsize = sizeof(FollowedCoroutine),
	.flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
	.slots = followed_slots,
};

/* wrap(coro): the task's coroutine, each of its steps followed. */
static PyObject *follower_wrap(Follower *f, PyObject *coro)
{
	struct marker_state *state = PyType_GetModuleState(Py_TYPE(f));
	FollowedCoroutine *c;

	if (state == NULL)
		return NULL;
	c = PyObject_GC_New(FollowedCoroutine, (PyTypeObject *)state->followed_type);
	if (c == NULL)
		return NULL;
	c->f = (Follower *)Py_NewRef(f);
	c->coro = Py_NewRef(coro);
	PyObject_GC_Track(c);
	return (PyObject *)c;
}

#define FOLLOWER_FIELDS(X)                                                                                   \
	X(var) X(runtime) X(span_key) X(span_type) X(readable_type) X(context_type) X(modalities)            \
	X(modality_key) X(entry_of) X(start_of) X(report) X(first_start) X(zero) X(n_end_time) X(n_mark)    \
	X(n_private_context) X(n_context) X(n_attributes) X(n_dict) X(n_get) X(n_attach) X(n_detach)        \
	X(n_get_current)

static int follower_traverse(Follower *f, visitproc visit, void *arg)
{
#define VISIT(field) Py_VISIT(f->field);
	FOLLOWER_FIELDS(VISIT)
#undef VISIT
	Py_VISIT(Py_TYPE(f));
	return 0;
}

static int follower_clear(Follower *f)
{
#define CLEAR(field) Py_CLEAR(f->field);
	FOLLOWER_FIELDS(CLEAR)
#undef CLEAR
	return 0;
}

static void follower_dealloc(Follower *f)
{
	PyTypeObject *type = Py_TYPE(f);

	PyObject_GC_UnTrack(f);
	follower_clear(f);
	type->tp_free(f);
	Py_DECREF(type);
}

static PyObject *follower_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
	static char *keywords[] = {"span_type", "readable_type", "context_type", "span_key", "modalities",
				   "modality_key", "entry_of", "start_of", "report", "var", "runtime",
				   "first_start", NULL};
	PyObject *span_type, *readable_type, *context_type, *span_key, *modalities, *modality_key, *entry_of,
		*start_of, *report, *var = Py_None, *runtime = Py_None, *first = Py_None;
	Follower *f;

	if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!O!UO!UOOO|OOO:Follower", keywords, &PyType_Type,
					 &span_type, &PyType_Type, &readable_type, &PyType_Type, &context_type,
					 &span_key, &PyDict_Type, &modalities, &modality_key, &entry_of, &start_of,
					 &report, &var, &runtime, &first))
		return NULL;
	if (var != Py_None && !PyContextVar_CheckExact(var)) {
		PyErr_SetString(PyExc_TypeError, "var must be a contextvars.ContextVar or None");
		return NULL;
	}
	if (var == Py_None && runtime == Py_None) {
		PyErr_SetString(PyExc_TypeError, "a Follower needs the runtime context's var or the runtime context");
		return NULL;
	}
	f = (Follower *)type->tp_alloc(type, 0);
	if (f == NULL)
		return NULL;
	f->var = var == Py_None ? NULL : Py_NewRef(var);
	f->runtime = var == Py_None ? Py_NewRef(runtime) : NULL;
	f->span_key = Py_NewRef(span_key);
	f->span_type = Py_NewRef(span_type);
	f->readable_type = Py_NewRef(readable_type);
	f->context_type = Py_NewRef(context_type);
	f->modalities = Py_NewRef(modalities);
	f->modality_key = Py_NewRef(modality_key);
	f->entry_of = Py_NewRef(entry_of);
	f->start_of = Py_NewRef(start_of);
	f->report = Py_NewRef(report);
	f->first_start = first == Py_None ? NULL : Py_NewRef(first);
	if ((f->zero = PyLong_FromLong(0)) == NULL ||
	    (f->n_end_time = PyUnicode_InternFromString("_end_time")) == NULL ||
	    (f->n_mark = PyUnicode_InternFromString("_spanlet_mark")) == NULL ||
	    (f->n_private_context = PyUnicode_InternFromString("_context")) == NULL ||
	    (f->n_context = PyUnicode_InternFromString("context")) == NULL ||
	    (f->n_attributes = PyUnicode_InternFromString("_attributes")) == NULL ||
	    (f->n_dict = PyUnicode_InternFromString("_dict")) == NULL ||
	    (f->n_get = PyUnicode_InternFromString("get")) == NULL ||
	    (f->n_attach = PyUnicode_InternFromString("attach")) == NULL ||
	    (f->n_detach = PyUnicode_InternFromString("detach")) == NULL ||
	    (f->n_get_current = PyUnicode_InternFromString("get_current")) == NULL) {
		Py_DECREF(f);
		return NULL;
	}
	return (PyObject *)f;
}

static PyMethodDef follower_methods[] = {
	{"attach", (PyCFunction)(void (*)(void))follower_attach, METH_FASTCALL,
	 "attach(context)\n--\n\nThe runtime context's attach, then this thread's span followed."},
	{"detach", (PyCFunction)(void (*)(void))follower_detach, METH_FASTCALL,
	 "detach(token)\n--\n\nThe runtime context's detach, then this thread's span followed."},
	{"follow_current", (PyCFunction)follower_follow_current, METH_NOARGS,
	 "follow_current()\n--\n\nMark this thread's current span if it changed."},
	{"follow_context", (PyCFunction)(void (*)(void))follower_follow_context, METH_FASTCALL,
	 "follow_context(ctx)\n--\n\nMark the span of the contextvars.Context about to run here if it changed."},
	{"on_start", (PyCFunction)(void (*)(void))follower_on_start, METH_FASTCALL | METH_KEYWORDS,
	 "on_start(span, parent_context=None)\n--\n\nKeep the span's mark() arguments on it."},
	{"on_end", (PyCFunction)(void (*)(void))follower_on_end, METH_FASTCALL,
	 "on_end(span)\n--\n\nUnmark this thread if the span is its last mark."},
	{"wrap", (PyCFunction)follower_wrap, METH_O,
	 "wrap(coro)\n--\n\nAn asyncio task's coroutine whose every step is followed."},
	{NULL, NULL, 0, NULL},
};

static PyType_Slot follower_slots[] = {
	{Py_tp_new, follower_new},
	{Py_tp_dealloc, follower_dealloc},
	{Py_tp_traverse, follower_traverse},
	{Py_tp_clear, follower_clear},
	{Py_tp_methods, follower_methods},
	{Py_tp_doc, "Follower(span_type, readable_type, context_type, span_key, modalities, modality_key, "
		    "entry_of, start_of, report, var=None, runtime=None, first_start=None)\n--\n\n"
		    "The span processor's and the context hooks' hot paths (agent/client.py)."},
	{0, NULL},
};

static PyType_Spec follower_spec = {
	.name = "spanlet.libspanlet_marker.Follower",
	.basicsize = sizeof(Follower),
	.flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
	.slots = follower_slots,
};

#ifdef SPANLET_MARKER_RECORD
/* record_reset(): forget the recorded calls, the calling thread's last mark
 * (back to "in no span"), the follow flags and the first-start look, as a
 * fresh process would be. */
static PyObject *py_record_reset(PyObject *module, PyObject *unused)
{
	__atomic_store_n(&records_seen, 0, __ATOMIC_RELEASE);
	__atomic_store_n(&follow_flags, 0, __ATOMIC_RELAXED);
	__atomic_store_n(&start_checked, 0, __ATOMIC_RELAXED);
	last = (struct last_mark){0};
	Py_RETURN_NONE;
}
#endif

/* forget(): the calling thread's last mark is unknown (a forked child's
 * thread, another build of the marker taking over); the next follow() marks. */
static PyObject *py_forget(PyObject *module, PyObject *unused)
{
	last = (struct last_mark){.unknown = 1};
	__atomic_store_n(&start_checked, 0, __ATOMIC_RELAXED); /* a forked child looks again */
	Py_RETURN_NONE;
}

/* set_follow_flags(flags): why this process's spans are followed per thread
 * only (spanlet/runtimes.py; 0: none), carried by every mark from now on. */
static PyObject *py_set_follow_flags(PyObject *module, PyObject *arg)
{
	unsigned long flags = PyLong_AsUnsignedLong(arg);

	if (flags == (unsigned long)-1 && PyErr_Occurred())
		return NULL;
	if (flags > 0xffff) {
		PyErr_SetString(PyExc_OverflowError, "follow flags do not fit in 16 bits");
		return NULL;
	}
	__atomic_store_n(&follow_flags, (uint32_t)flags, __ATOMIC_RELAXED);
	last.unknown = 1; /* the next follow() marks, carrying them */
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
	{"set_follow_flags", py_set_follow_flags, METH_O,
	 "set_follow_flags(flags)\n--\n\nWhy this process's spans are followed per thread only "
	 "(0: none), carried by every mark."},
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
	struct marker_state *state = PyModule_GetState(module);
	PyObject *follower = PyType_FromModuleAndSpec(module, &follower_spec, NULL);
	int rc;

	if (follower == NULL)
		return -1;
	rc = PyModule_AddType(module, (PyTypeObject *)follower);
	Py_DECREF(follower);
	if (rc < 0)
		return -1;
	state->followed_type = PyType_FromModuleAndSpec(module, &followed_spec, NULL);
	if (state->followed_type == NULL || PyModule_AddType(module, (PyTypeObject *)state->followed_type) < 0)
		return -1;
	return PyModule_AddIntConstant(module, "ABI_VERSION", SPANLET_MARKER_ABI_VERSION);
}

static int marker_traverse(PyObject *module, visitproc visit, void *arg)
{
	struct marker_state *state = PyModule_GetState(module);

	Py_VISIT(state ? state->followed_type : NULL);
	return 0;
}

static int marker_clear(PyObject *module)
{
	struct marker_state *state = PyModule_GetState(module);

	if (state)
		Py_CLEAR(state->followed_type);
	return 0;
}

static PyModuleDef_Slot marker_slots[] = {
	{Py_mod_exec, marker_exec},
#if PY_VERSION_HEX >= 0x030C0000
	{Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
#if PY_VERSION_HEX >= 0x030D0000
	{Py_mod_gil, Py_MOD_GIL_NOT_USED}, /* state is thread-local (a Follower is read-only once made); the record log uses atomics */
#endif
	{0, NULL},
};

static struct PyModuleDef marker_module = {
	PyModuleDef_HEAD_INIT,
	.m_name = "spanlet.libspanlet_marker",
	.m_doc = "The span marker whose spanlet_mark the spanlet agent uprobes.",
	.m_size = sizeof(struct marker_state),
	.m_methods = marker_methods,
	.m_traverse = marker_traverse,
	.m_clear = marker_clear,
	.m_slots = marker_slots,
};

PyMODINIT_FUNC PyInit_libspanlet_marker(void)
{
	return PyModuleDef_Init(&marker_module);
}
