/* spanlet._wire: the agent's reads of serialized OTLP spans (protobuf wire
 * format), where doing them from Python would cost a proto object per span.
 *
 * serving_spans(blob) -> the (scope index, span index) of the spans of a
 * serialized ResourceSpans of SERVER kind or with events: the only ones that
 * can add to the serving metrics when no span carries a trigger attribute.
 *
 * complex_spans(blobs) -> list of the indices of the serialized Spans whose
 * attribute text the embedded store's SQL would not write as the Python row
 * builder does (exporters/clickhouse/span_protos.py): an attribute list
 * (the span's, an event's, a link's) with an array or map value, a double
 * whose shortest text ClickHouse may print with an exponent (or inf/nan), or
 * a key twice. The test is a superset: a span it names is only stored the
 * slower, exact way. A blob that is not well-formed is named too.
 *
 * join_resource(blob, map_fd, index_fd, origin) -> None or
 * (new_blob or None, keys, rows, cgroup, taken): the span join's common case
 * (agent/join.py) for one serialized ResourceSpans: each span's index entry
 * taken from the span facts index (BPF_MAP_LOOKUP_AND_DELETE_ELEM, key trace
 * id + span id), then the row of each cgroup it lists (key trace id + span
 * id + cgroup; where the entry is incomplete, past its four cgroups or a
 * slot lost to a race, also each origin cgroup's); the rows
 * picked as join.pick_rows picks them (origin a sequence of the sender's
 * cgroup ids: only theirs; origin None: one cgroup's rows, else the one with
 * most launches + syncs + violations + graph launches, the first on a tie),
 * the picked rows summed and their non-zero facts appended to the span as
 * kernel.* int attributes, in the order and under the names of
 * join.FACT_ATTRIBUTES. Only the picked rows are deleted: the others stay,
 * listed again in the index, for their own sender's span (or the sweep).
 * rows: spans that got facts; taken: (cgroup, reason) of every row seen,
 * reason 0 picked and taken, 1 another pod's (other_pod), 2 not the cgroup
 * picked (conflict), both left in the map. None, before any row is taken,
 * when the resource is not that case: a span with links, a kernel.* attribute
 * already, ids not 16 + 8 bytes, or bytes not well-formed (the Python join
 * then does it all). keys: the (trace id, span id) of every span; rows: rows
 * taken; cgroup: as SpanJoin.join reports it (a real cgroup id of a row, else
 * 1 when a row had none, 0 when no span got a row); new_blob None when no
 * span got anything. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <endian.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <linux/bpf.h>

typedef struct {
    const uint8_t *p, *end;
} span_t;

static int varint(span_t *s, uint64_t *out)
{
    uint64_t v = 0;
    for (int shift = 0; shift < 64 && s->p < s->end; shift += 7) {
        uint8_t b = *s->p++;
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *out = v;
            return 0;
        }
    }
    return -1;
}

static size_t put_varint(uint8_t *out, uint64_t v)
{
    size_t n = 0;
    while (v > 0x7f) {
        out[n++] = (uint8_t)(v & 0x7f) | 0x80;
        v >>= 7;
    }
    out[n++] = (uint8_t)v;
    return n;
}

static size_t varint_len(uint64_t v)
{
    size_t n = 1;
    while (v > 0x7f) {
        v >>= 7;
        n++;
    }
    return n;
}

/* One field: its number, wire type and, for length-delimited ones, the bytes;
 * for fixed64 the 8 bytes. -1 when malformed. */
typedef struct {
    uint32_t num;
    uint32_t type;
    span_t sub;       /* type 2: the payload; type 1: the 8 bytes */
} field_t;

static int next_field(span_t *s, field_t *f)
{
    uint64_t tag, v;
    if (varint(s, &tag) < 0)
        return -1;
    f->num = (uint32_t)(tag >> 3);
    f->type = (uint32_t)(tag & 7);
    switch (f->type) {
    case 0:
        return varint(s, &v);
    case 1:
        if (s->end - s->p < 8)
            return -1;
        f->sub.p = s->p;
        f->sub.end = s->p + 8;
        s->p += 8;
        return 0;
    case 2:
        if (varint(s, &v) < 0 || v > (uint64_t)(s->end - s->p))
            return -1;
        f->sub.p = s->p;
        f->sub.end = s->p + v;
        s->p += v;
        return 0;
    case 5:
        if (s->end - s->p < 4)
            return -1;
        s->p += 4;
        return 0;
    default:
        return -1;
    }
}

/* Doubles ClickHouse prints in plain decimals for sure: finite, 0 or with a
 * magnitude in [1e-4, 1e15). Others may come out with an exponent. */
static int plain_double(const uint8_t *b)
{
    double d;
    memcpy(&d, b, 8);
    if (!isfinite(d))
        return 0;
    double a = fabs(d);
    return a == 0.0 || (a >= 1e-4 && a < 1e15);
}

/* AnyValue: 1 if its text could differ (array 5, kvlist 6, a double not plain). */
static int complex_value(span_t v)
{
    field_t f;
    while (v.p < v.end) {
        if (next_field(&v, &f) < 0)
            return 1;
        if (f.num == 5 || f.num == 6)
            return 1;
        if (f.num == 4 && (f.type != 1 || !plain_double(f.sub.p)))
            return 1;
    }
    return 0;
}

#define MAX_KEYS 64     /* past this many attributes in one list: named (keys not compared) */

/* The attribute list of field `attr_num` in message `m`: 1 if complex. */
static int complex_attributes(span_t m, uint32_t attr_num)
{
    span_t keys[MAX_KEYS];
    int n = 0;
    field_t f, g;
    while (m.p < m.end) {
        if (next_field(&m, &f) < 0)
            return 1;
        if (f.num != attr_num)
            continue;
        if (f.type != 2 || n == MAX_KEYS)
            return 1;
        span_t kv = f.sub, key = {0, 0};
        while (kv.p < kv.end) {
            if (next_field(&kv, &g) < 0)
                return 1;
            if (g.num == 1 && g.type == 2)
                key = g.sub;
            else if (g.num == 2 && g.type == 2 && complex_value(g.sub))
                return 1;
        }
        size_t len = key.p ? (size_t)(key.end - key.p) : 0;
        for (int i = 0; i < n; i++) {
            size_t l = keys[i].p ? (size_t)(keys[i].end - keys[i].p) : 0;
            if (l == len && (len == 0 || memcmp(keys[i].p, key.p, len) == 0))
                return 1;
        }
        keys[n++] = key;
    }
    return 0;
}

/* Span: attributes 9; events 11 (their attributes 3); links 13 (theirs 4). */
static int complex_span(span_t s)
{
    if (complex_attributes(s, 9))
        return 1;
    field_t f;
    while (s.p < s.end) {
        if (next_field(&s, &f) < 0)
            return 1;
        if ((f.num == 11 || f.num == 13) && f.type == 2 &&
            complex_attributes(f.sub, f.num == 11 ? 3 : 4))
            return 1;
    }
    return 0;
}

static PyObject *complex_spans(PyObject *self, PyObject *arg)
{
    PyObject *seq = PySequence_Fast(arg, "complex_spans() takes a sequence of bytes");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(0);
    if (!out)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        char *buf;
        Py_ssize_t len;
        if (PyBytes_AsStringAndSize(items[i], &buf, &len) < 0)
            goto fail;
        span_t s = {(const uint8_t *)buf, (const uint8_t *)buf + len};
        if (complex_span(s)) {
            PyObject *idx = PyLong_FromSsize_t(i);
            if (!idx || PyList_Append(out, idx) < 0) {
                Py_XDECREF(idx);
                goto fail;
            }
            Py_DECREF(idx);
        }
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(seq);
    return NULL;
}

/* -- the store's rows ------------------------------------------------------ */

/* A string field's bytes as str (a proto3 string: UTF-8, as the parse that
 * made the blob checked). */
static PyObject *text(span_t t)
{
    return PyUnicode_DecodeUTF8((const char *)t.p, t.end - t.p, "surrogateescape");
}

/* InstrumentationScope: name 1, version 2 (the last of each wins, as a parse
 * merges). -1 when malformed. */
static int read_scope(span_t m, span_t *name, span_t *version)
{
    field_t f;
    while (m.p < m.end) {
        if (next_field(&m, &f) < 0)
            return -1;
        if ((f.num == 1 || f.num == 2) && f.type != 2)
            return -1;
        if (f.num == 1)
            *name = f.sub;
        else if (f.num == 2)
            *version = f.sub;
    }
    return 0;
}

/* 1 if the Span has an event (11) or a link (13). */
static int has_nested(span_t s)
{
    field_t f;
    while (s.p < s.end) {
        if (next_field(&s, &f) < 0)
            return 1;
        if (f.num == 11 || f.num == 13)
            return 1;
    }
    return 0;
}

/* One ScopeSpans' spans appended to `out` as rows.SPAN_PROTO_COLUMNS rows. */
static int scope_rows(span_t ss, PyObject *res_attrs, PyObject *service, PyObject *out)
{
    span_t name = {0, 0}, version = {0, 0};
    field_t f;
    span_t m = ss;
    while (m.p < m.end) {                     /* the scope first, wherever it is */
        if (next_field(&m, &f) < 0)
            return -1;
        if (f.num == 1 && (f.type != 2 || read_scope(f.sub, &name, &version) < 0))
            return -1;
    }
    PyObject *py_name = text(name), *py_version = text(version);
    int rc = -1;
    if (!py_name || !py_version)
        goto done;
    m = ss;
    while (m.p < m.end) {
        next_field(&m, &f);                   /* well-formed: walked above */
        if (f.num != 2)
            continue;
        if (f.type != 2)
            goto done;
        PyObject *row = PyList_New(6);
        if (!row)
            goto done;
        PyObject *blob = PyBytes_FromStringAndSize((const char *)f.sub.p, f.sub.end - f.sub.p);
        if (!blob) {
            Py_DECREF(row);
            goto done;
        }
        PyObject *nested = PyBool_FromLong(has_nested(f.sub));
        PyList_SET_ITEM(row, 0, blob);
        PyList_SET_ITEM(row, 1, nested);
        Py_INCREF(res_attrs);
        PyList_SET_ITEM(row, 2, res_attrs);
        Py_INCREF(service);
        PyList_SET_ITEM(row, 3, service);
        Py_INCREF(py_name);
        PyList_SET_ITEM(row, 4, py_name);
        Py_INCREF(py_version);
        PyList_SET_ITEM(row, 5, py_version);
        int r = PyList_Append(out, row);
        Py_DECREF(row);
        if (r < 0)
            goto done;
    }
    rc = 0;
done:
    Py_XDECREF(py_name);
    Py_XDECREF(py_version);
    return rc;
}

static PyObject *span_proto_rows(PyObject *self, PyObject *args)
{
    Py_buffer blob;
    PyObject *res_attrs, *service;
    if (!PyArg_ParseTuple(args, "y*OU", &blob, &res_attrs, &service))
        return NULL;
    span_t rs = {blob.buf, (const uint8_t *)blob.buf + blob.len};
    PyObject *out = PyList_New(0);
    field_t f;
    if (!out)
        goto fail;
    while (rs.p < rs.end) {
        if (next_field(&rs, &f) < 0)
            goto malformed;
        if (f.num != 2)
            continue;
        if (f.type != 2)
            goto malformed;
        if (scope_rows(f.sub, res_attrs, service, out) < 0) {
            if (PyErr_Occurred())
                goto fail;
            goto malformed;
        }
    }
    PyBuffer_Release(&blob);
    return out;
malformed:
    PyErr_SetString(PyExc_ValueError, "not a well-formed ResourceSpans");
fail:
    Py_XDECREF(out);
    PyBuffer_Release(&blob);
    return NULL;
}

/* The ProtobufList data of span_protos.envelope: each row's span framed as
 * one message of the list, tagged with its group (field GROUP_FIELD). */
#define GROUP_FIELD 1000

typedef struct {
    uint8_t *buf;
    size_t n, cap;
} out_t;

static int reserve(out_t *o, size_t more)
{
    if (o->n + more <= o->cap)
        return 0;
    size_t cap = o->cap ? o->cap : 4096;
    while (cap < o->n + more)
        cap *= 2;
    uint8_t *grown = PyMem_Realloc(o->buf, cap);
    if (!grown) {
        PyErr_NoMemory();
        return -1;
    }
    o->buf = grown;
    o->cap = cap;
    return 0;
}

static PyObject *envelope(PyObject *self, PyObject *arg)
{
    PyObject *seq = PySequence_Fast(arg, "envelope() takes a sequence of rows");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *groups = PyDict_New(), *order = PyList_New(0), *result = NULL;
    PyObject *prev[4] = {NULL, NULL, NULL, NULL};
    uint64_t g = 0;
    int nested = 0;
    out_t o = {NULL, 0, 0};
    if (!groups || !order || reserve(&o, 10) < 0)
        goto out;
    o.n = 10;                                 /* room for the list's length, moved down at the end */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = PySequence_Fast(items[i], "a row must be a sequence");
        if (!row)
            goto out;
        if (PySequence_Fast_GET_SIZE(row) != 6) {
            PyErr_SetString(PyExc_ValueError, "a row of rows.SPAN_PROTO_COLUMNS has 6 values");
            Py_DECREF(row);
            goto out;
        }
        PyObject **v = PySequence_Fast_ITEMS(row);
        char *buf;
        Py_ssize_t len;
        if (PyBytes_AsStringAndSize(v[0], &buf, &len) < 0) {
            Py_DECREF(row);
            goto out;
        }
        int t = PyObject_IsTrue(v[1]);
        if (t < 0) {
            Py_DECREF(row);
            goto out;
        }
        nested |= t;
        /* the group: the identity of the resource's dict and the scope's strings */
        if (!(prev[0] == v[2] && prev[1] == v[3] && prev[2] == v[4] && prev[3] == v[5])) {
            PyObject *id = PyLong_FromVoidPtr(v[2]);
            PyObject *key = id ? PyTuple_Pack(4, id, v[3], v[4], v[5]) : NULL;
            Py_XDECREF(id);
            if (!key) {
                Py_DECREF(row);
                goto out;
            }
            PyObject *found = PyDict_GetItemWithError(groups, key);
            if (found) {
                g = PyLong_AsUnsignedLongLong(found);
            } else if (PyErr_Occurred()) {
                g = (uint64_t)-1;
            } else {
                g = (uint64_t)PyList_GET_SIZE(order);
                PyObject *gi = PyLong_FromUnsignedLongLong(g);
                PyObject *entry = PyTuple_Pack(4, v[2], v[3], v[4], v[5]);
                int bad = !gi || !entry || PyDict_SetItem(groups, key, gi) < 0 ||
                          PyList_Append(order, entry) < 0;
                Py_XDECREF(gi);
                Py_XDECREF(entry);
                if (bad)
                    g = (uint64_t)-1;
            }
            Py_DECREF(key);
            if (g == (uint64_t)-1 && PyErr_Occurred()) {
                Py_DECREF(row);
                goto out;
            }
            /* rows hold their values, and seq holds the rows (lists, tuples): borrowed is enough */
            prev[0] = v[2], prev[1] = v[3], prev[2] = v[4], prev[3] = v[5];
        }
        uint8_t tag[20];
        size_t tl = put_varint(tag, (uint64_t)GROUP_FIELD << 3);
        tl += put_varint(tag + tl, g);
        size_t inner = (size_t)len + tl;
        if (reserve(&o, 11 + inner) < 0) {
            Py_DECREF(row);
            goto out;
        }
        o.buf[o.n++] = 0x0a;
        o.n += put_varint(o.buf + o.n, inner);
        memcpy(o.buf + o.n, buf, (size_t)len);
        o.n += (size_t)len;
        memcpy(o.buf + o.n, tag, tl);
        o.n += tl;
        if (row != items[i])                  /* a copy made here: its values go with it */
            prev[0] = NULL;
        Py_DECREF(row);
    }
    uint8_t head[10];
    size_t body = o.n - 10, hl = put_varint(head, body);
    memcpy(o.buf + 10 - hl, head, hl);
    PyObject *data = PyBytes_FromStringAndSize((const char *)o.buf + 10 - hl, (Py_ssize_t)(hl + body));
    if (data) {
        result = Py_BuildValue("(NOO)", data, order, nested ? Py_True : Py_False);
    }
out:
    PyMem_Free(o.buf);
    Py_XDECREF(groups);
    Py_XDECREF(order);
    Py_DECREF(seq);
    return result;
}

/* -- the join ------------------------------------------------------------- */

/* struct span_facts_key / span_facts_val / span_facts_index_* (bpf/spanlet.h) */
struct facts_key {
    uint8_t trace_id[16];
    uint64_t span_id;
    uint64_t cgroup_id;
};
struct index_key {
    uint8_t trace_id[16];
    uint64_t span_id;
};
#define INDEX_CGROUPS 4
struct index_val {
    uint64_t cgroups[INDEX_CGROUPS];
    uint32_t n, _pad;
};
#define ORIGIN_MAX 64      /* origin cgroups looked at (a pod has a few) */
#define REASON_KEPT 0
#define REASON_OTHER_POD 1
#define REASON_CONFLICT 2
struct facts_val {
    uint64_t launches_driver, launches_runtime, launch_ns, sync_wait_ns, syncs, violations,
        graph_launches, graph_kernels, cgroup_id, first_ns;
    uint32_t pid, sampled_events;
};

/* One map element call (bpf(2)): 1 done, 0 no such element, -1 an error
 * (the Python exception set). */
static int map_elem(int cmd, int fd, const void *k, const void *v)
{
    union bpf_attr attr;
    memset(&attr, 0, sizeof(attr));
    attr.map_fd = (uint32_t)fd;
    attr.key = (uint64_t)(uintptr_t)k;
    attr.value = (uint64_t)(uintptr_t)v;
    /* The GIL is kept: a hash map's element call never blocks and takes
     * about a microsecond, less than handing the GIL over and back costs. */
    long r = syscall(__NR_bpf, cmd, &attr, sizeof(attr));
    int err = errno;
    if (r == 0)
        return 1;
    if (err == ENOENT)
        return 0;
    errno = err;
    PyErr_SetFromErrno(PyExc_OSError);
    return -1;
}

/* A row read and deleted in one call. */
static int facts_take(int fd, const void *k, void *v)
{
    return map_elem(BPF_MAP_LOOKUP_AND_DELETE_ELEM, fd, k, v);
}

/* Read, not deleted: a row another pod's span may still take. */
static int facts_peek(int fd, const void *k, void *v)
{
    return map_elem(BPF_MAP_LOOKUP_ELEM, fd, k, v);
}

/* Written (BPF_ANY): 0 done, -1 an error. */
static int facts_put(int fd, const void *k, const void *v)
{
    return map_elem(BPF_MAP_UPDATE_ELEM, fd, k, v) == 1 ? 0 : -1;
}

/* join.FACT_ATTRIBUTES, in order (rx/tx bytes never come from a row). */
static const char *const FACT_KEYS[] = {
    "kernel.gpu.launches", "kernel.gpu.graph_launches", "kernel.gpu.graph_kernels",
    "kernel.gpu.launch_ns", "kernel.gpu.sync_wait_ns", "kernel.gpu.syncs",
    "kernel.sandbox.violations",
};
#define N_FACTS 7
#define ATTR_MAX 48        /* one attribute's bytes at most: tag, lengths, key, int */

/* Span field 9 entries for the row's non-zero facts; returns their length. */
static size_t fact_attributes(const struct facts_val *v, uint8_t *out)
{
    uint64_t vals[N_FACTS] = {v->launches_driver + v->launches_runtime, v->graph_launches,
                              v->graph_kernels, v->launch_ns, v->sync_wait_ns, v->syncs,
                              v->violations};
    size_t n = 0;
    for (int i = 0; i < N_FACTS; i++) {
        if (!vals[i])
            continue;
        size_t klen = strlen(FACT_KEYS[i]);
        size_t any = 1 + varint_len(vals[i]);                 /* AnyValue{int_value (3)} */
        size_t kv = 1 + 1 + klen + 1 + 1 + any;                /* KeyValue{key (1), value (2)} */
        out[n++] = 0x4a;                                       /* Span.attributes (9) */
        n += put_varint(out + n, kv);
        out[n++] = 0x0a;
        out[n++] = (uint8_t)klen;
        memcpy(out + n, FACT_KEYS[i], klen);
        n += klen;
        out[n++] = 0x12;
        out[n++] = (uint8_t)any;
        out[n++] = 0x18;
        n += put_varint(out + n, vals[i]);
    }
    return n;
}

/* A span as the join sees it. */
typedef struct {
    span_t whole;              /* the Span's bytes in the blob */
    const uint8_t *trace_id;   /* 16 bytes */
    uint64_t span_id;          /* big-endian bytes as a number */
    size_t added;              /* attribute bytes appended */
    uint8_t extra[N_FACTS * ATTR_MAX];
} jspan_t;

#define KERNEL_PREFIX "kernel."

/* 1 if the attribute (a KeyValue's bytes) has a key starting "kernel.". */
static int kernel_key(span_t kv)
{
    field_t f;
    while (kv.p < kv.end) {
        if (next_field(&kv, &f) < 0)
            return 1;
        if (f.num == 1 && f.type == 2)
            return f.sub.end - f.sub.p >= 7 && memcmp(f.sub.p, KERNEL_PREFIX, 7) == 0;
    }
    return 0;
}

/* Fill `js` from the Span bytes; -1: not the common case. */
static int read_span(span_t s, jspan_t *js)
{
    field_t f;
    js->whole = s;
    js->trace_id = NULL;
    js->added = 0;
    int have_sid = 0;
    while (s.p < s.end) {
        if (next_field(&s, &f) < 0)
            return -1;
        if (f.num == 1) {
            if (f.type != 2 || f.sub.end - f.sub.p != 16)
                return -1;
            js->trace_id = f.sub.p;
        } else if (f.num == 2) {
            if (f.type != 2 || f.sub.end - f.sub.p != 8)
                return -1;
            uint64_t be;
            memcpy(&be, f.sub.p, 8);
            js->span_id = be64toh(be);
            have_sid = 1;
        } else if (f.num == 13) {
            return -1;                                          /* a link: a batch step */
        } else if (f.num == 9 && (f.type != 2 || kernel_key(f.sub))) {
            return -1;                                          /* facts from an earlier join */
        }
    }
    return js->trace_id && have_sid ? 0 : -1;
}

/* The ResourceSpans' fields: resource (1), scope_spans (2: scope 1, spans 2),
 * schema_url (3). Walks it calling `fn` on each span; -1 stops. */
typedef int (*span_fn)(void *ctx, span_t span);

static int each_span(span_t rs, span_fn fn, void *ctx)
{
    field_t f, g;
    while (rs.p < rs.end) {
        if (next_field(&rs, &f) < 0)
            return -1;
        if (f.num != 2)
            continue;
        if (f.type != 2)
            return -1;
        span_t ss = f.sub;
        while (ss.p < ss.end) {
            if (next_field(&ss, &g) < 0)
                return -1;
            if (g.num == 2) {
                if (g.type != 2 || fn(ctx, g.sub) < 0)
                    return -1;
            }
        }
    }
    return 0;
}

typedef struct {
    jspan_t *spans;
    Py_ssize_t n, cap;
} jlist_t;

static int collect(void *ctx, span_t span)
{
    jlist_t *l = ctx;
    if (l->n == l->cap) {
        Py_ssize_t cap = l->cap ? l->cap * 2 : 64;
        jspan_t *grown = PyMem_Realloc(l->spans, (size_t)cap * sizeof(jspan_t));
        if (!grown)
            return -1;
        l->spans = grown;
        l->cap = cap;
    }
    if (read_span(span, &l->spans[l->n]) < 0)
        return -1;
    l->n++;
    return 0;
}

/* Copy `m` (a message of the blob) to out, spans grown by their extra bytes;
 * depth 0: ResourceSpans, 1: ScopeSpans. Returns the bytes written; `*next`
 * walks the spans in blob order. With out NULL only measures. */
static size_t rebuild(span_t m, int depth, jlist_t *l, Py_ssize_t *next, uint8_t *out)
{
    size_t n = 0;
    field_t f;
    while (m.p < m.end) {
        const uint8_t *start = m.p;
        next_field(&m, &f);                   /* well-formed: read_span saw it all */
        if (f.num != 2 || f.type != 2) {
            if (out)
                memcpy(out + n, start, (size_t)(m.p - start));
            n += (size_t)(m.p - start);
            continue;
        }
        size_t inner;
        if (depth == 0) {
            Py_ssize_t save = *next;
            inner = rebuild(f.sub, 1, l, next, NULL);
            *next = save;
        } else {
            jspan_t *js = &l->spans[*next];
            inner = (size_t)(js->whole.end - js->whole.p) + js->added;
        }
        uint8_t head[11];
        size_t h = 0;
        head[h++] = 0x12;                     /* field 2, length-delimited */
        h += put_varint(head + h, inner);
        if (out)
            memcpy(out + n, head, h);
        n += h;
        if (depth == 0) {
            rebuild(f.sub, 1, l, next, out ? out + n : NULL);
        } else {
            jspan_t *js = &l->spans[(*next)++];
            size_t len = (size_t)(js->whole.end - js->whole.p);
            if (out) {
                memcpy(out + n, js->whole.p, len);
                memcpy(out + n + len, js->extra, js->added);
            }
        }
        n += inner;
    }
    return n;
}

static int in_origin(const uint64_t *origin, Py_ssize_t n, uint64_t cg)
{
    for (Py_ssize_t i = 0; i < n; i++)
        if (origin[i] == cg)
            return 1;
    return 0;
}

static uint64_t score(const struct facts_val *v)
{
    return v->launches_driver + v->launches_runtime + v->syncs + v->violations + v->graph_launches;
}

/* origin: None, or a sequence of ints read into `out` (at most ORIGIN_MAX,
 * sorted as Python's sorted() would, for the same order of takes). */
static int read_origin(PyObject *origin, uint64_t *out, Py_ssize_t *n)
{
    *n = -1;
    if (origin == Py_None)
        return 0;
    PyObject *seq = PySequence_Fast(origin, "origin must be a sequence of cgroup ids");
    if (!seq)
        return -1;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    if (len > ORIGIN_MAX)
        len = ORIGIN_MAX;
    for (Py_ssize_t i = 0; i < len; i++) {
        unsigned long long x = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (x == (unsigned long long)-1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
        Py_ssize_t j = i;                 /* insertion sort: a few ids */
        while (j > 0 && out[j - 1] > x) {
            out[j] = out[j - 1];
            j--;
        }
        out[j] = x;
    }
    Py_DECREF(seq);
    *n = len;
    return 0;
}

static int add_taken(PyObject *taken, uint64_t cg, int reason)
{
    PyObject *t = Py_BuildValue("(Ki)", (unsigned long long)cg, reason);
    if (!t)
        return -1;
    int r = PyList_Append(taken, t);
    Py_DECREF(t);
    return r;
}

static PyObject *join_resource(PyObject *self, PyObject *args)
{
    Py_buffer blob;
    int fd, index_fd;
    PyObject *origin_obj = Py_None;
    if (!PyArg_ParseTuple(args, "y*ii|O", &blob, &fd, &index_fd, &origin_obj))
        return NULL;
    span_t rs = {blob.buf, (const uint8_t *)blob.buf + blob.len};
    jlist_t l = {NULL, 0, 0};
    PyObject *result = NULL, *keys = NULL, *new_blob = NULL, *taken = NULL;
    uint64_t origin[ORIGIN_MAX];
    Py_ssize_t n_origin;
    if (read_origin(origin_obj, origin, &n_origin) < 0) {
        PyBuffer_Release(&blob);
        return NULL;
    }
    if (each_span(rs, collect, &l) < 0) {
        if (PyErr_Occurred())
            goto out;
        result = Py_None;                     /* not the common case */
        Py_INCREF(result);
        goto out;
    }
    keys = PyList_New(l.n);
    taken = PyList_New(0);
    if (!keys || !taken)
        goto out;
    Py_ssize_t rows = 0;
    uint64_t cgroup = 0;
    size_t grown = 0;
    for (Py_ssize_t i = 0; i < l.n; i++) {
        jspan_t *js = &l.spans[i];
        struct index_key ik;
        memcpy(ik.trace_id, js->trace_id, 16);
        ik.span_id = js->span_id;
        PyObject *key = Py_BuildValue("(y#K)", (const char *)js->trace_id, (Py_ssize_t)16,
                                      (unsigned long long)js->span_id);
        if (!key)
            goto out;
        PyList_SET_ITEM(keys, i, key);
        struct index_val iv;
        int got;
        if ((got = facts_take(index_fd, &ik, &iv)) < 0)
            goto out;
        if (!got)
            continue;
        /* the cgroups to take, as SpanFacts._take_index lists them */
        uint64_t cgs[INDEX_CGROUPS + ORIGIN_MAX];
        int ncg = 0;
        uint32_t listed = iv.n < INDEX_CGROUPS ? iv.n : INDEX_CGROUPS;
        for (uint32_t j = 0; j < listed; j++)
            if (!in_origin(cgs, ncg, iv.cgroups[j]))
                cgs[ncg++] = iv.cgroups[j];
        int nonzero = 0;
        for (int j = 0; j < ncg; j++)
            nonzero += cgs[j] != 0;
        if (n_origin > 0 && (iv.n > INDEX_CGROUPS || iv.n != (uint32_t)nonzero))
            for (Py_ssize_t j = 0; j < n_origin; j++)
                if (!in_origin(cgs, ncg, origin[j]))
                    cgs[ncg++] = origin[j];
        struct facts_val got_v[INDEX_CGROUPS + ORIGIN_MAX];
        uint64_t got_cg[INDEX_CGROUPS + ORIGIN_MAX];
        int got_taken[INDEX_CGROUPS + ORIGIN_MAX];
        int nrows = 0;
        struct facts_key k;
        memcpy(k.trace_id, js->trace_id, 16);
        k.span_id = js->span_id;
        /* Only the rows the span gets are deleted: those it gets for sure
         * (its origin's; the one row, sender unknown) at once, the others
         * read, and of those the one picked taken after the pick; the rest
         * stay, listed again, for their own sender's span or the sweep. */
        for (int j = 0; j < ncg; j++) {
            int sure = n_origin >= 0 ? in_origin(origin, n_origin, cgs[j]) : ncg == 1;
            k.cgroup_id = cgs[j];
            got = sure ? facts_take(fd, &k, &got_v[nrows]) : facts_peek(fd, &k, &got_v[nrows]);
            if (got < 0)
                goto out;
            if (got) {
                got_taken[nrows] = sure;
                got_cg[nrows++] = cgs[j];
            }
        }
        if (!nrows)
            continue;
        /* the pick (join.pick_rows) */
        int best = 0;
        if (n_origin < 0)
            for (int j = 1; j < nrows; j++)
                if (score(&got_v[j]) > score(&got_v[best]))
                    best = j;
        struct facts_val sum;
        int kept = 0;
        memset(&sum, 0, sizeof(sum));
        struct index_val left;
        uint32_t nleft = 0;
        memset(&left, 0, sizeof(left));
        for (int j = 0; j < nrows; j++) {
            int reason = n_origin < 0 ? (nrows == 1 || j == best ? REASON_KEPT : REASON_CONFLICT)
                                      : (in_origin(origin, n_origin, got_cg[j]) ? REASON_KEPT
                                                                               : REASON_OTHER_POD);
            if (add_taken(taken, got_cg[j], reason) < 0)
                goto out;
            if (reason != REASON_KEPT) {
                if (!got_taken[j] && nleft < INDEX_CGROUPS)
                    left.cgroups[nleft++] = got_cg[j];
                continue;
            }
            if (!got_taken[j]) {          /* picked among others: taken now, as it is now */
                struct facts_val now_v;
                k.cgroup_id = got_cg[j];
                int again;
                if ((again = facts_take(fd, &k, &now_v)) < 0)
                    goto out;
                if (again)
                    got_v[j] = now_v;
            }
            struct facts_val *v = &got_v[j];
            if (!kept++)
                sum.cgroup_id = v->cgroup_id;
            sum.launches_driver += v->launches_driver;
            sum.launches_runtime += v->launches_runtime;
            sum.launch_ns += v->launch_ns;
            sum.sync_wait_ns += v->sync_wait_ns;
            sum.syncs += v->syncs;
            sum.violations += v->violations;
            sum.graph_launches += v->graph_launches;
            sum.graph_kernels += v->graph_kernels;
        }
        if (nleft) {
            left.n = nleft;
            int put;
            if ((put = facts_put(index_fd, &ik, &left)) < 0)
                goto out;
        }
        if (!kept)
            continue;
        rows++;
        uint64_t g = sum.cgroup_id ? sum.cgroup_id : 1;
        if (g > 1 || !cgroup)
            cgroup = g;
        js->added = fact_attributes(&sum, js->extra);
        grown += js->added;
    }
    if (grown) {
        Py_ssize_t next = 0;
        size_t size = rebuild(rs, 0, &l, &next, NULL);
        new_blob = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)size);
        if (!new_blob)
            goto out;
        next = 0;
        rebuild(rs, 0, &l, &next, (uint8_t *)PyBytes_AS_STRING(new_blob));
    } else {
        new_blob = Py_None;
        Py_INCREF(new_blob);
    }
    result = Py_BuildValue("(NNnKN)", new_blob, keys, rows, (unsigned long long)cgroup, taken);
    new_blob = keys = taken = NULL;
out:
    Py_XDECREF(new_blob);
    Py_XDECREF(keys);
    Py_XDECREF(taken);
    PyMem_Free(l.spans);
    PyBuffer_Release(&blob);
    return result;
}

/* serving_spans(blob) -> list of (scope index, span index) of the spans of a
 * serialized ResourceSpans that may add to the serving metrics whatever their
 * attributes: a SERVER kind (a request) or an event (a first token); None when
 * the bytes are not well-formed. The others add to none unless they carry a
 * trigger attribute, which the caller rules out on the resource's bytes first
 * (agent/metrics/serving.py). */
static int serving_span(span_t s)
{
    field_t f;
    while (s.p < s.end) {
        const uint8_t *at = s.p;
        if (next_field(&s, &f) < 0)
            return -1;
        if (f.num == 11 && f.type == 2)
            return 1;
        if (f.num == 6 && f.type == 0) {
            span_t v = {at, s.p};
            uint64_t tag, kind;
            if (varint(&v, &tag) < 0 || varint(&v, &kind) < 0)
                return -1;
            if (kind == 2)
                return 1;
        }
    }
    return 0;
}

static PyObject *serving_spans(PyObject *self, PyObject *arg)
{
    Py_buffer buf;
    if (PyObject_GetBuffer(arg, &buf, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *out = PyList_New(0);
    span_t rs = {buf.buf, (const uint8_t *)buf.buf + buf.len};
    field_t f, g;
    long scope = 0;
    int bad = 0;
    while (out && !bad && rs.p < rs.end) {
        if (next_field(&rs, &f) < 0) {
            bad = 1;
            break;
        }
        if (f.num != 2)
            continue;
        if (f.type != 2) {
            bad = 1;
            break;
        }
        span_t ss = f.sub;
        long n = 0;
        while (ss.p < ss.end) {
            if (next_field(&ss, &g) < 0) {
                bad = 1;
                break;
            }
            if (g.num != 2)
                continue;
            int hit = g.type == 2 ? serving_span(g.sub) : -1;
            if (hit < 0) {
                bad = 1;
                break;
            }
            if (hit) {
                PyObject *t = Py_BuildValue("(ll)", scope, n);
                if (!t || PyList_Append(out, t) < 0) {
                    Py_XDECREF(t);
                    Py_CLEAR(out);
                    break;
                }
                Py_DECREF(t);
            }
            n++;
        }
        scope++;
    }
    PyBuffer_Release(&buf);
    if (out && bad) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    return out;
}

static PyMethodDef methods[] = {
    {"join_resource", join_resource, METH_VARARGS,
     "join_resource(blob, map_fd, index_fd, origin=None) -> None or (new_blob or None, keys, "
     "rows, cgroup, taken): the span join's common case for one serialized ResourceSpans"},
    {"complex_spans", complex_spans, METH_O,
     "complex_spans(blobs) -> indices of the serialized Spans whose attribute text the "
     "store's SQL may write differently (arrays, maps, exponent doubles, a key twice)"},
    {"span_proto_rows", span_proto_rows, METH_VARARGS,
     "span_proto_rows(resource_spans_blob, resource_attributes, service) -> the serialized "
     "ResourceSpans' spans as rows.SPAN_PROTO_COLUMNS rows (each span's bytes, events or links, "
     "the resource's dict and service, its scope's name and version)"},
    {"serving_spans", serving_spans, METH_O,
     "serving_spans(blob) -> [(scope index, span index)] of the serialized ResourceSpans' spans "
     "of SERVER kind or with events (None: not well-formed)"},
    {"envelope", envelope, METH_O,
     "envelope(rows) -> (data, groups, nested): span_protos.envelope of rows.SPAN_PROTO_COLUMNS rows"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "spanlet._wire", NULL, -1, methods};

PyMODINIT_FUNC PyInit__wire(void)
{
    return PyModule_Create(&module);
}
