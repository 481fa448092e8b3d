/* spanlet._ring: the agent's reader of a BPF ring buffer (BPF_MAP_TYPE_RINGBUF),
 * the walk over its records in C, so that one wake-up drains thousands of
 * records with no Python per record but the consumer's own call.
 *
 * Layout (include/uapi/linux/bpf.h, kernel/bpf/ringbuf.c, as libbpf maps it):
 * the consumer page (its first u64 the consumer position) mapped read-write,
 * then the producer page (its first u64 the producer position) and the data
 * area mapped twice in a row, read-only, so that a record that wraps round the
 * end of the ring is contiguous. Each record: a u32 length whose top bits are
 * BUSY (reserved, not yet committed: it and every record after it wait) and
 * DISCARD (skipped), a u32 page offset, then the record, padded to 8 bytes.
 * A length past the data area, or a producer position more than the data
 * area ahead of the consumer's, is no state the kernel makes (it refuses such
 * a reservation, kernel/bpf/ringbuf.c): the walk reads nothing more and gives
 * the ring back up to the producer position, what is there lost (read counts
 * it as one error), as no record in it can be trusted.
 *
 * Ring(map_fd, size): size a power-of-two number of pages.
 * Ring.read(limit, layout, clock, offset_ns, next_ns) -> (records, errors):
 *   at most `limit` committed records (discarded ones not counted), each one
 *   a Record: its bytes (the first sizes[kind] of the record) and its epoch
 *   time, decoded into its struct only when a field is asked for. records is
 *   a Batch: len() the records read, iterated once, each record let go by the
 *   batch as it is handed out (a consumer that decodes them and keeps none
 *   does not hold a wake-up's structs at once). layout is
 *   (header size, offset of the u16 kind in the header, classes, sizes),
 *   classes[kind] the ctypes struct of a kind (None: unknown kind), sizes[kind]
 *   its size. A record shorter than the header, of an unknown kind or shorter
 *   than its struct is not returned but counted in errors (and in `limit`).
 *   The epoch time is what clock.to_epoch(ts) would give (agent/events.py
 *   MonotonicClock): ts + offset_ns while ts <= next_ns, else clock.to_epoch(ts)
 *   is called (it refreshes the clock) and clock.offset_ns and clock._next
 *   read again. next_ns < 0: clock.to_epoch(ts) for every record (any clock).
 * Ring.read_raw(limit) -> list of bytes: the committed records as they are.
 * Ring.pending() -> bool: producer position != consumer position.
 * Ring.positions() -> (consumer, producer).
 * Ring.close(): unmaps (at the end of a read in progress, if there is one).
 *
 * Space is given back (the consumer position stored) every 256 records of a
 * long drain, and the producer position read again then, as libbpf's reader
 * does per record. Positions and lengths are read with acquire loads and the
 * consumer position stored with a release store (on x86-64 plain moves). A
 * read that fails (an exception: memory, the clock) gives back the records
 * before the failing one; the ones it made are lost with the exception.
 *
 * Record: what the consumer gets for a record; every attribute but `raw`,
 * `epoch_ns`, `hdr` and the dunder ones is the decoded struct's (decoded once,
 * by classes[kind].from_buffer_copy(raw), its epoch_ns set), so a Record reads
 * as the struct does (ev.flow, ev.as_dict(), ev.rx_tx()); bytes(ev) and its
 * buffer are the struct's bytes, and ev.__class__ is the struct's class (so
 * isinstance(ev, GpuLaunch) holds, as it did for the struct). ev.hdr is a view of the header: its integer
 * fields (struct spanlet_hdr, bpf/spanlet.h: ts_ns, pid, tid, cgroup_id,
 * span_id, kind, modality, flags) read from the bytes with no decode, what
 * else is asked of it (trace_id, a ctypes array as before) from the decoded
 * struct's hdr. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define BUSY_BIT (1u << 31)
#define DISCARD_BIT (1u << 30)
#define RECORD_HDR 8
#define GIVE_BACK_MASK 0xFF
#define MAX_KINDS 256

/* -- Record ----------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *raw;      /* bytes of the struct */
    PyObject *cls;      /* the ctypes struct of its kind */
    PyObject *epoch;    /* int */
    PyObject *ev;       /* the decoded struct, NULL until asked */
} Record;

static PyTypeObject RecordType;
static PyTypeObject HeaderType;

/* struct spanlet_hdr (bpf/spanlet.h; agent/events.py Header): the integer
 * fields the header view reads itself, by offset and size. */
static const struct {
    const char *name;
    Py_ssize_t at, size;
} HDR_FIELDS[] = {
    {"ts_ns", 0, 8}, {"pid", 8, 4}, {"tid", 12, 4}, {"cgroup_id", 16, 8},
    {"span_id", 40, 8}, {"kind", 48, 2}, {"modality", 50, 1}, {"flags", 51, 1},
};
#define N_HDR_FIELDS ((int)(sizeof(HDR_FIELDS) / sizeof(HDR_FIELDS[0])))
#define HDR_SIZE 56
static PyObject *hdr_names[N_HDR_FIELDS];
static PyObject *str_hdr, *str_raw, *str_epoch_ns, *str_class, *str_from_buffer_copy;

static int same_name(PyObject *name, PyObject *interned)
{
    return name == interned || (PyUnicode_Check(name) && PyUnicode_Compare(name, interned) == 0);
}

static void record_dealloc(Record *self)
{
    Py_XDECREF(self->raw);
    Py_XDECREF(self->cls);
    Py_XDECREF(self->epoch);
    Py_XDECREF(self->ev);
    PyObject_Free(self);
}

static PyObject *record_decoded(Record *self)
{
    if (self->ev == NULL) {
        PyObject *ev = PyObject_CallMethodOneArg(self->cls, str_from_buffer_copy, self->raw);
        if (ev == NULL)
            return NULL;
        if (PyObject_SetAttr(ev, str_epoch_ns, self->epoch) < 0) {
            Py_DECREF(ev);
            return NULL;
        }
        self->ev = ev;
    }
    return self->ev;
}

typedef struct {
    PyObject_HEAD
    Record *rec;
} Header;

static PyObject *record_getattro(PyObject *o, PyObject *name)
{
    if (same_name(name, str_class)) {      /* isinstance(ev, events.GpuLaunch) holds */
        Py_INCREF(((Record *)o)->cls);
        return ((Record *)o)->cls;
    }
    if (same_name(name, str_hdr)) {
        Header *h = PyObject_New(Header, &HeaderType);
        if (h != NULL) {
            Py_INCREF(o);
            h->rec = (Record *)o;
        }
        return (PyObject *)h;
    }
    if (PyUnicode_Check(name)) {
        Py_ssize_t n = PyUnicode_GET_LENGTH(name);
        int dunder = n >= 2 && PyUnicode_READ_CHAR(name, 0) == '_' &&
                     PyUnicode_READ_CHAR(name, 1) == '_';
        if (!dunder && !same_name(name, str_raw) && !same_name(name, str_epoch_ns)) {
            PyObject *ev = record_decoded((Record *)o);
            return ev == NULL ? NULL : PyObject_GetAttr(ev, name);
        }
    }
    return PyObject_GenericGetAttr(o, name);
}

static PyObject *record_bytes(Record *self, PyObject *Py_UNUSED(ignored))
{
    Py_INCREF(self->raw);
    return self->raw;
}

static int record_getbuffer(Record *self, Py_buffer *view, int flags)
{
    return PyObject_GetBuffer(self->raw, view, flags);
}

static PyBufferProcs record_as_buffer = {(getbufferproc)record_getbuffer, NULL};

static PyMethodDef record_methods[] = {
    {"__bytes__", (PyCFunction)record_bytes, METH_NOARGS, "the struct's bytes"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef record_members[] = {
    {"raw", T_OBJECT_EX, offsetof(Record, raw), READONLY, "the struct's bytes"},
    {"epoch_ns", T_OBJECT_EX, offsetof(Record, epoch), READONLY, "epoch time of ts_ns"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject RecordType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "spanlet._ring.Record",
    .tp_basicsize = sizeof(Record),
    .tp_dealloc = (destructor)record_dealloc,
    .tp_getattro = record_getattro,
    .tp_as_buffer = &record_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "one ring-buffer record, decoded into its struct when a field is read",
    .tp_methods = record_methods,
    .tp_members = record_members,
};

/* -- Header: the view of a record's header ------------------------------------ */

static void header_dealloc(Header *self)
{
    Py_XDECREF(self->rec);
    PyObject_Free(self);
}

static PyObject *header_getattro(PyObject *o, PyObject *name)
{
    Record *rec = ((Header *)o)->rec;
    const uint8_t *raw = (const uint8_t *)PyBytes_AS_STRING(rec->raw);
    for (int i = 0; i < N_HDR_FIELDS; i++) {
        if (name != hdr_names[i])
            continue;
        uint64_t v = 0;
        memcpy(&v, raw + HDR_FIELDS[i].at, HDR_FIELDS[i].size);   /* little-endian */
        return PyLong_FromUnsignedLongLong(v);
    }
    if (PyUnicode_Check(name)) {
        for (int i = 0; i < N_HDR_FIELDS; i++) {
            if (PyUnicode_Compare(name, hdr_names[i]) == 0) {
                uint64_t v = 0;
                memcpy(&v, raw + HDR_FIELDS[i].at, HDR_FIELDS[i].size);
                return PyLong_FromUnsignedLongLong(v);
            }
        }
        Py_ssize_t n = PyUnicode_GET_LENGTH(name);
        if (!(n >= 2 && PyUnicode_READ_CHAR(name, 0) == '_' && PyUnicode_READ_CHAR(name, 1) == '_')) {
            PyObject *ev = record_decoded(rec);
            if (ev == NULL)
                return NULL;
            PyObject *hdr = PyObject_GetAttr(ev, str_hdr);
            if (hdr == NULL)
                return NULL;
            PyObject *out = PyObject_GetAttr(hdr, name);
            Py_DECREF(hdr);
            return out;
        }
    }
    return PyObject_GenericGetAttr(o, name);
}

static PyObject *header_bytes(Header *self, PyObject *Py_UNUSED(ignored))
{
    return PyBytes_FromStringAndSize(PyBytes_AS_STRING(self->rec->raw), HDR_SIZE);
}

static int header_getbuffer(Header *self, Py_buffer *view, int flags)
{
    return PyBuffer_FillInfo(view, (PyObject *)self, PyBytes_AS_STRING(self->rec->raw),
                             HDR_SIZE, 1, flags);
}

static PyBufferProcs header_as_buffer = {(getbufferproc)header_getbuffer, NULL};

static PyMethodDef header_methods[] = {
    {"__bytes__", (PyCFunction)header_bytes, METH_NOARGS, "the header's bytes"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject HeaderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "spanlet._ring.Header",
    .tp_basicsize = sizeof(Header),
    .tp_dealloc = (destructor)header_dealloc,
    .tp_getattro = header_getattro,
    .tp_as_buffer = &header_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "a record's header: its integer fields read from its bytes",
    .tp_methods = header_methods,
};

/* -- Batch: a read's records, handed out once ----------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *list;
    Py_ssize_t next;
} Batch;

static void batch_dealloc(Batch *self)
{
    Py_XDECREF(self->list);
    PyObject_Free(self);
}

static PyObject *batch_iter(PyObject *self)
{
    Py_INCREF(self);
    return self;
}

static PyObject *batch_next(Batch *self)
{
    if (self->next >= PyList_GET_SIZE(self->list))
        return NULL;        /* StopIteration */
    PyObject *item = PyList_GET_ITEM(self->list, self->next);
    Py_INCREF(Py_None);
    PyList_SET_ITEM(self->list, self->next, Py_None);   /* the reference goes to the caller */
    self->next++;
    return item;
}

static Py_ssize_t batch_len(Batch *self)
{
    return PyList_GET_SIZE(self->list);
}

static PySequenceMethods batch_as_sequence = {.sq_length = (lenfunc)batch_len};

static PyTypeObject BatchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "spanlet._ring.Batch",
    .tp_basicsize = sizeof(Batch),
    .tp_dealloc = (destructor)batch_dealloc,
    .tp_as_sequence = &batch_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "the records of one read: len() of them, iterated once",
    .tp_iter = batch_iter,
    .tp_iternext = (iternextfunc)batch_next,
};

/* -- Ring ------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    uint64_t *consumer;         /* mapped read-write */
    uint8_t *producer;          /* producer page + data twice, read-only */
    size_t page, size, mask;
    int busy;                   /* reads in progress (the clock may run Python) */
    int closing;
} Ring;

static void ring_unmap(Ring *r)
{
    if (r->consumer != NULL)
        munmap(r->consumer, r->page);
    if (r->producer != NULL)
        munmap(r->producer, r->page + 2 * r->size);
    r->consumer = NULL;
    r->producer = NULL;
}

static int ring_init(Ring *r, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"map_fd", "size", NULL};
    int fd;
    Py_ssize_t size;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "in", kwlist, &fd, &size))
        return -1;
    long page = sysconf(_SC_PAGESIZE);
    if (size <= 0 || (size & (size - 1)) || size % page) {
        PyErr_Format(PyExc_ValueError,
                     "ring buffer size %zd is not a power-of-two number of pages", size);
        return -1;
    }
    ring_unmap(r);
    r->page = (size_t)page;
    r->size = (size_t)size;
    r->mask = (size_t)size - 1;
    void *c = mmap(NULL, r->page, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (c == MAP_FAILED) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    r->consumer = c;
    void *p = mmap(NULL, r->page + 2 * r->size, PROT_READ, MAP_SHARED, fd, (off_t)r->page);
    if (p == MAP_FAILED) {
        PyErr_SetFromErrno(PyExc_OSError);
        ring_unmap(r);
        return -1;
    }
    r->producer = p;
    return 0;
}

static void ring_dealloc(Ring *r)
{
    ring_unmap(r);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static int ring_open(Ring *r)
{
    if (r->consumer == NULL || r->closing) {
        PyErr_SetString(PyExc_ValueError, "ring buffer reader is closed");
        return -1;
    }
    return 0;
}

static inline uint64_t load_u64(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

static inline void give_back(Ring *r, uint64_t cons)
{
    __atomic_store_n(r->consumer, cons, __ATOMIC_RELEASE);
}

/* Calls visit(ctx, record, size) for each committed record, at most limit;
 * returns how many, or -1 (an exception set by visit). *corrupt set: a ring
 * the kernel cannot have made ended the walk. */
typedef int (*visit_fn)(void *ctx, const uint8_t *rec, uint32_t size);

static Py_ssize_t ring_walk(Ring *r, Py_ssize_t limit, visit_fn visit, void *ctx, int *corrupt)
{
    const uint64_t *prod_pos = (const uint64_t *)r->producer;
    const uint8_t *data = r->producer + r->page;
    uint64_t cons = load_u64(r->consumer);
    uint64_t prod = load_u64(prod_pos);
    Py_ssize_t n = 0;
    while (cons < prod && n < limit) {
        const uint8_t *hdr = data + (cons & r->mask);
        uint32_t len = __atomic_load_n((const uint32_t *)hdr, __ATOMIC_ACQUIRE);
        if (len & BUSY_BIT)
            break;          /* reserved, not yet committed: records after it wait too */
        uint32_t size = len & ~(BUSY_BIT | DISCARD_BIT);
        if ((uint64_t)size + RECORD_HDR > r->size || prod - cons > r->size) {
            /* its bytes would run past the second copy of the data; records
             * that are no records would be walked past without end */
            *corrupt = 1;
            cons = prod;
            break;
        }
        if (!(len & DISCARD_BIT)) {
            if (visit(ctx, hdr + RECORD_HDR, size) < 0) {
                give_back(r, cons);
                return -1;
            }
            n++;
        }
        cons += ((uint64_t)size + RECORD_HDR + 7) & ~(uint64_t)7;
        if ((n & GIVE_BACK_MASK) == 0) {
            give_back(r, cons);      /* give space back on long drains */
            prod = load_u64(prod_pos);
        }
    }
    give_back(r, cons);
    return n;
}

static PyObject *ring_finish(Ring *r, PyObject *out)
{
    if (--r->busy == 0 && r->closing)
        ring_unmap(r);
    return out;
}

/* read_raw */

static int visit_raw(void *ctx, const uint8_t *rec, uint32_t size)
{
    PyObject *b = PyBytes_FromStringAndSize((const char *)rec, size);
    if (b == NULL)
        return -1;
    int rc = PyList_Append((PyObject *)ctx, b);
    Py_DECREF(b);
    return rc;
}

static PyObject *ring_read_raw(Ring *r, PyObject *args)
{
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "n", &limit) || ring_open(r) < 0)
        return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    r->busy++;
    int corrupt = 0;
    if (ring_walk(r, limit, visit_raw, out, &corrupt) < 0)
        Py_CLEAR(out);
    return ring_finish(r, out);
}

/* read */

typedef struct {
    PyObject *out;
    Py_ssize_t errors;
    Py_ssize_t hdr_size, kind_at;
    Py_ssize_t nkinds;
    PyObject *classes[MAX_KINDS];
    Py_ssize_t sizes[MAX_KINDS];
    PyObject *clock;
    int64_t offset, next;      /* next < 0: the clock for every record */
} read_ctx;

static int clock_state(read_ctx *c)
{
    PyObject *off = PyObject_GetAttrString(c->clock, "offset_ns");
    if (off == NULL)
        return -1;
    PyObject *nxt = PyObject_GetAttrString(c->clock, "_next");
    if (nxt == NULL) {
        Py_DECREF(off);
        return -1;
    }
    int overflow = 0;
    long long o = PyLong_AsLongLongAndOverflow(off, &overflow);
    int overflow2 = 0;
    long long x = PyLong_AsLongLongAndOverflow(nxt, &overflow2);
    Py_DECREF(off);
    Py_DECREF(nxt);
    if (PyErr_Occurred())
        return -1;
    if (overflow || overflow2 || x < 0) {
        c->next = -1;          /* not this module's to add: the clock does each */
    } else {
        c->offset = o;
        c->next = x;
    }
    return 0;
}

static PyObject *epoch_of(read_ctx *c, uint64_t ts)
{
    int64_t sum;
    if (c->next >= 0 && ts <= (uint64_t)c->next &&
        !__builtin_add_overflow((int64_t)ts, c->offset, &sum))
        return PyLong_FromLongLong(sum);
    PyObject *epoch = PyObject_CallMethod(c->clock, "to_epoch", "K", (unsigned long long)ts);
    if (epoch != NULL && c->next >= 0 && clock_state(c) < 0)
        Py_CLEAR(epoch);
    return epoch;
}

static int visit_record(void *ctx, const uint8_t *rec, uint32_t size)
{
    read_ctx *c = ctx;
    if ((Py_ssize_t)size < c->hdr_size) {
        c->errors++;
        return 0;
    }
    uint16_t kind;
    memcpy(&kind, rec + c->kind_at, sizeof(kind));
    if (kind >= c->nkinds || c->classes[kind] == NULL || (Py_ssize_t)size < c->sizes[kind]) {
        c->errors++;
        return 0;
    }
    uint64_t ts;
    memcpy(&ts, rec, sizeof(ts));
    Record *ev = PyObject_New(Record, &RecordType);
    if (ev == NULL)
        return -1;
    ev->cls = NULL;
    ev->ev = NULL;
    ev->epoch = NULL;
    ev->raw = PyBytes_FromStringAndSize((const char *)rec, c->sizes[kind]);
    if (ev->raw == NULL || (ev->epoch = epoch_of(c, ts)) == NULL) {
        Py_DECREF(ev);
        return -1;
    }
    Py_INCREF(c->classes[kind]);
    ev->cls = c->classes[kind];
    int rc = PyList_Append(c->out, (PyObject *)ev);
    Py_DECREF(ev);
    return rc;
}

static PyObject *ring_read(Ring *r, PyObject *args)
{
    Py_ssize_t limit;
    PyObject *layout, *classes, *sizes;
    read_ctx c;
    long long offset, next;
    if (!PyArg_ParseTuple(args, "nO!OLL", &limit, &PyTuple_Type, &layout, &c.clock,
                          &offset, &next) ||
        !PyArg_ParseTuple(layout, "nnO!O!", &c.hdr_size, &c.kind_at, &PyTuple_Type, &classes,
                          &PyTuple_Type, &sizes))
        return NULL;
    c.nkinds = PyTuple_GET_SIZE(classes);
    if (c.nkinds > MAX_KINDS || PyTuple_GET_SIZE(sizes) != c.nkinds || c.hdr_size != HDR_SIZE ||
        c.kind_at < 0 || c.kind_at + 2 > c.hdr_size) {
        PyErr_SetString(PyExc_ValueError, "layout: (header size (56: struct spanlet_hdr), kind offset, classes, sizes)");
        return NULL;
    }
    for (Py_ssize_t k = 0; k < c.nkinds; k++) {
        PyObject *cls = PyTuple_GET_ITEM(classes, k);
        c.classes[k] = cls == Py_None ? NULL : cls;
        c.sizes[k] = PyLong_AsSsize_t(PyTuple_GET_ITEM(sizes, k));
        if (c.sizes[k] == -1 && PyErr_Occurred())
            return NULL;
        if (c.sizes[k] < c.hdr_size)
            c.sizes[k] = c.hdr_size;
    }
    if (ring_open(r) < 0)
        return NULL;
    c.offset = offset;
    c.next = next;
    c.errors = 0;
    c.out = PyList_New(0);
    if (c.out == NULL)
        return NULL;
    r->busy++;
    PyObject *result = NULL;
    int corrupt = 0;
    if (ring_walk(r, limit, visit_record, &c, &corrupt) >= 0) {
        c.errors += corrupt;
        Batch *b = PyObject_New(Batch, &BatchType);
        if (b != NULL) {
            b->list = c.out;          /* the list's reference goes to the batch */
            b->next = 0;
            result = Py_BuildValue("(Nn)", (PyObject *)b, c.errors);
            return ring_finish(r, result);
        }
    }
    Py_DECREF(c.out);
    return ring_finish(r, result);
}

static PyObject *ring_pending(Ring *r, PyObject *Py_UNUSED(ignored))
{
    if (ring_open(r) < 0)
        return NULL;
    return PyBool_FromLong(load_u64((const uint64_t *)r->producer) != load_u64(r->consumer));
}

static PyObject *ring_positions(Ring *r, PyObject *Py_UNUSED(ignored))
{
    if (ring_open(r) < 0)
        return NULL;
    return Py_BuildValue("(KK)", (unsigned long long)load_u64(r->consumer),
                         (unsigned long long)load_u64((const uint64_t *)r->producer));
}

static PyObject *ring_close(Ring *r, PyObject *Py_UNUSED(ignored))
{
    if (r->busy)
        r->closing = 1;      /* the read in progress unmaps at its end */
    else
        ring_unmap(r);
    Py_RETURN_NONE;
}

static PyMethodDef ring_methods[] = {
    {"read", (PyCFunction)ring_read, METH_VARARGS,
     "read(limit, layout, clock, offset_ns, next_ns) -> (records, errors)"},
    {"read_raw", (PyCFunction)ring_read_raw, METH_VARARGS, "read_raw(limit) -> list of bytes"},
    {"pending", (PyCFunction)ring_pending, METH_NOARGS, "records not yet read"},
    {"positions", (PyCFunction)ring_positions, METH_NOARGS, "(consumer, producer)"},
    {"close", (PyCFunction)ring_close, METH_NOARGS, "unmap the ring"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "spanlet._ring.Ring",
    .tp_basicsize = sizeof(Ring),
    .tp_dealloc = (destructor)ring_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Ring(map_fd, size): a BPF ring buffer mapped for reading",
    .tp_methods = ring_methods,
    .tp_init = (initproc)ring_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "spanlet._ring", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__ring(void)
{
    if (PyType_Ready(&RecordType) < 0 || PyType_Ready(&HeaderType) < 0 ||
        PyType_Ready(&BatchType) < 0 || PyType_Ready(&RingType) < 0)
        return NULL;
    for (int i = 0; i < N_HDR_FIELDS; i++)
        if ((hdr_names[i] = PyUnicode_InternFromString(HDR_FIELDS[i].name)) == NULL)
            return NULL;
    if ((str_hdr = PyUnicode_InternFromString("hdr")) == NULL ||
        (str_raw = PyUnicode_InternFromString("raw")) == NULL ||
        (str_epoch_ns = PyUnicode_InternFromString("epoch_ns")) == NULL ||
        (str_class = PyUnicode_InternFromString("__class__")) == NULL ||
        (str_from_buffer_copy = PyUnicode_InternFromString("from_buffer_copy")) == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&RecordType);
    Py_INCREF(&RingType);
    Py_INCREF(&HeaderType);
    if (PyModule_AddObject(m, "Record", (PyObject *)&RecordType) < 0 ||
        PyModule_AddObject(m, "Header", (PyObject *)&HeaderType) < 0 ||
        PyModule_AddObject(m, "Ring", (PyObject *)&RingType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
