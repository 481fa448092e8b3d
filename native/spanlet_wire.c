/* spanlet._wire: the agent's reads of serialized OTLP spans (protobuf wire
 * format), where doing them from Python would cost a proto object per span.
 *
 * serving_spans(blob) -> the (scope index, span index) of the spans of a
 * serialized ResourceSpans of SERVER kind or with events: the only ones that
 * can add to the serving metrics when no span carries a trigger attribute.
 *
 * valid_spans(payload) -> the spans of a serialized ExportTraceServiceRequest
 * when the receiver's id check would drop nothing, else -1.
 *
 * span_proto_rows(blob, resource attributes, service) -> the serialized
 * ResourceSpans' spans as the store's rows (rows.SPAN_PROTO_COLUMNS).
 *
 * trace_native(rows) -> (block or None, skip): those rows as one block of
 * ClickHouse's Native format of otel_traces columns, the values of
 * rows.span_rows (exporters/clickhouse/span_protos.py); skip names the rows
 * left to the Python way (an attribute pcommon writes as JSON or with an
 * exponent, a key twice, bytes not well-formed or not of the OTLP shape).
 *
 * request_facts(blob, start, end, keys) -> (sums or None, has_totals): the
 * facts one serialized Span (blob[start:end]) adds to its request's totals
 * (agent/request_totals.py): its attributes kernel.<keys[i][0]>, int (not
 * negative) or double (finite, above 0), each added to sums[keys[i][1]]
 * (a list of n floats, n the largest index + 1; None when all are 0), and
 * whether it carries a kernel.request.* int or double already. A span not
 * well-formed adds nothing.
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
 * for fixed64 the 8 bytes; a group (wire types 3 and 4, deprecated) skipped
 * whole, nested ones included, as a parse keeps it (an unknown field), its
 * start and end numbers matched. -1 when malformed. */
typedef struct {
    uint32_t num;
    uint32_t type;
    span_t sub;       /* type 2: the payload; type 1: the 8 bytes */
    uint64_t v;       /* type 0: the value */
} field_t;

#define GROUP_DEPTH 100              /* protobuf's own recursion limit */
static int next_field(span_t *s, field_t *f);

static int skip_group(span_t *s, field_t *f)
{
    uint32_t open[GROUP_DEPTH];
    int depth = 1;
    uint64_t tag;
    field_t g;
    open[0] = f->num;
    f->sub.p = s->p;
    while (depth > 0) {
        span_t peek = *s;
        if (varint(&peek, &tag) < 0)
            return -1;
        uint32_t num = (uint32_t)(tag >> 3);
        if ((tag & 7) == 3) {
            if (depth == GROUP_DEPTH)
                return -1;
            open[depth++] = num;
            s->p = peek.p;
        } else if ((tag & 7) == 4) {
            if (open[--depth] != num)
                return -1;
            f->sub.end = s->p;
            s->p = peek.p;
        } else if (next_field(s, &g) < 0) {     /* any other field, whole */
            return -1;
        }
    }
    return 0;
}

static int next_field(span_t *s, field_t *f)
{
    uint64_t tag, v;
    if (varint(s, &tag) < 0)
        return -1;
    f->num = (uint32_t)(tag >> 3);
    f->type = (uint32_t)(tag & 7);
    switch (f->type) {
    case 0:
        return varint(s, &f->v);
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
    case 3:
        return skip_group(s, f);
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

/* -- the receiver's check ------------------------------------------------- */

/* The ids of one Span (the last of each field, as a parse keeps): 1 if
 * valid (trace id 16 bytes not all zero, span id 8 bytes not all zero,
 * parent id none or 8 bytes), 0 if not, -1 if not well-formed. */
static int nonzero(span_t t)
{
    for (const uint8_t *p = t.p; p < t.end; p++)
        if (*p)
            return 1;
    return 0;
}

static int valid_ids(span_t s)
{
    span_t trace = {0, 0}, span = {0, 0}, parent = {0, 0};
    field_t f;
    while (s.p < s.end) {
        if (next_field(&s, &f) < 0)
            return -1;
        if (f.num == 1 || f.num == 2 || f.num == 4) {
            if (f.type != 2)
                return -1;
            *(f.num == 1 ? &trace : f.num == 2 ? &span : &parent) = f.sub;
        }
    }
    return trace.end - trace.p == 16 && nonzero(trace) && span.end - span.p == 8 && nonzero(span) &&
           (parent.end - parent.p == 0 || parent.end - parent.p == 8);
}

/* The messages of field `num` in m, each passed to fn (0: stop, -1 on the
 * first that fails); 1 when there is at least one and all passed. */
static int each_of(span_t m, uint32_t num, int (*fn)(span_t, Py_ssize_t *), Py_ssize_t *count)
{
    field_t f;
    int seen = 0;
    while (m.p < m.end) {
        if (next_field(&m, &f) < 0)
            return -1;
        if (f.num != num)
            continue;
        if (f.type != 2)
            return -1;
        int r = fn(f.sub, count);
        if (r <= 0)
            return r;
        seen = 1;
    }
    return seen;
}

static int count_valid_span(span_t s, Py_ssize_t *count)
{
    int r = valid_ids(s);
    *count += r == 1;
    return r;
}

static int valid_scope(span_t ss, Py_ssize_t *count)
{
    return each_of(ss, 2, count_valid_span, count);
}

static int valid_resource(span_t rs, Py_ssize_t *count)
{
    return each_of(rs, 2, valid_scope, count);
}

/* valid_spans(payload) -> the spans of a serialized ExportTraceServiceRequest
 * when every span's ids are valid and no resource or scope is empty (what
 * receiver.drop_invalid_spans would leave as it is), else -1: that check
 * runs span by span. */
static PyObject *valid_spans(PyObject *self, PyObject *arg)
{
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0)
        return NULL;
    span_t req = {b.buf, (const uint8_t *)b.buf + b.len};
    Py_ssize_t count = 0;
    field_t f;
    int ok = 1;
    for (span_t m = req; ok && m.p < m.end;) {          /* an empty request: 0, nothing to drop */
        if (next_field(&m, &f) < 0 || (f.num == 1 && (f.type != 2 || valid_resource(f.sub, &count) != 1)))
            ok = 0;
    }
    PyBuffer_Release(&b);
    return PyLong_FromSsize_t(ok ? count : -1);
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

/* -- the store's Native block ---------------------------------------------- */

/* trace_native(rows) -> (block or None, skip): rows.SPAN_PROTO_COLUMNS rows
 * as one block of ClickHouse's Native format, the otel_traces columns
 * (rows.TRACE_COLUMNS, in order) of every row but those in skip, whose
 * values are exactly rows.span_rows' (pcommon's text of each attribute
 * value; ids in lower hex, '' when all zero; the collector's names of span
 * kinds and status codes). skip: the indices of the rows whose span is
 * complex (complex_span) or not of the shape this reads (a field of another
 * wire type than the OTLP proto declares, a singular message twice), or
 * whose resource or scope is not str texts: the caller stores those the
 * Python way. Plain types (String where the table has LowCardinality): the
 * INSERT converts them. */

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

static int put(out_t *o, const void *p, size_t len)
{
    if (reserve(o, len) < 0)
        return -1;
    if (len)
        memcpy(o->buf + o->n, p, len);
    o->n += len;
    return 0;
}

static int put_u64(out_t *o, uint64_t v)
{
    v = htole64(v);
    return put(o, &v, 8);
}

/* A String value: its length as a varint, then its bytes. */
static int put_str(out_t *o, const void *p, size_t len)
{
    if (reserve(o, 10 + len) < 0)
        return -1;
    o->n += put_varint(o->buf + o->n, len);
    if (len)
        memcpy(o->buf + o->n, p, len);
    o->n += len;
    return 0;
}

static int put_span(out_t *o, span_t t)
{
    return put_str(o, t.p, t.p ? (size_t)(t.end - t.p) : 0);
}

static int put_cstr(out_t *o, const char *s)
{
    return put_str(o, s, strlen(s));
}

/* rows._hex_or_empty */
static int put_hex(out_t *o, span_t id)
{
    static const char digits[] = "0123456789abcdef";
    size_t len = id.p ? (size_t)(id.end - id.p) : 0, i;
    for (i = 0; i < len && !id.p[i]; i++)
        ;
    if (i == len)
        return put_str(o, "", 0);
    if (reserve(o, 10 + 2 * len) < 0)
        return -1;
    o->n += put_varint(o->buf + o->n, 2 * len);
    for (i = 0; i < len; i++) {
        o->buf[o->n++] = (uint8_t)digits[id.p[i] >> 4];
        o->buf[o->n++] = (uint8_t)digits[id.p[i] & 15];
    }
    return 0;
}

static int put_base64(out_t *o, span_t b)
{
    static const char abc[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    size_t len = (size_t)(b.end - b.p), out = (len + 2) / 3 * 4;
    if (reserve(o, 10 + out) < 0)
        return -1;
    o->n += put_varint(o->buf + o->n, out);
    uint8_t *w = o->buf + o->n;
    for (size_t i = 0; i < len; i += 3) {
        uint32_t v = (uint32_t)b.p[i] << 16;
        if (i + 1 < len)
            v |= (uint32_t)b.p[i + 1] << 8;
        if (i + 2 < len)
            v |= b.p[i + 2];
        *w++ = (uint8_t)abc[v >> 18];
        *w++ = (uint8_t)abc[(v >> 12) & 63];
        *w++ = i + 1 < len ? (uint8_t)abc[(v >> 6) & 63] : '=';
        *w++ = i + 2 < len ? (uint8_t)abc[v & 63] : '=';
    }
    o->n += out;
    return 0;
}

/* str() of an int64. */
static int put_int_text(out_t *o, int64_t v)
{
    char text[24], *p = text + sizeof text;
    uint64_t u = v < 0 ? 0 - (uint64_t)v : (uint64_t)v;
    do {
        *--p = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0)
        *--p = '-';
    return put_str(o, p, (size_t)(text + sizeof text - p));
}

/* rows._go_float of a plain double (plain_double): Python's shortest repr,
 * which has no exponent there, without its trailing zeros and point. */
static int put_plain_double(out_t *o, const uint8_t *b)
{
    double d;
    memcpy(&d, b, 8);
    char *r = PyOS_double_to_string(d, 'r', 0, 0, NULL);
    if (!r)
        return -1;
    size_t len = strlen(r);
    if (strchr(r, '.')) {
        while (r[len - 1] == '0')
            len--;
        if (r[len - 1] == '.')
            len--;
    }
    int rc = put_str(o, r, len);
    PyMem_Free(r);
    return rc;
}

/* rows.attribute_string of an AnyValue that is not complex (the last member
 * set wins; string_value_strindex, 8, a dictionary index of profiles, is ''). */
static int put_value_text(out_t *o, span_t v)
{
    field_t f, last = {0};
    while (v.p < v.end) {
        next_field(&v, &f);                   /* well-formed: readable walked it */
        if (f.num >= 1 && f.num <= 8)
            last = f;
    }
    switch (last.num) {
    case 1:
        return put_span(o, last.sub);
    case 2:
        return put_cstr(o, last.v ? "true" : "false");
    case 3:
        return put_int_text(o, (int64_t)last.v);
    case 4:
        return put_plain_double(o, last.sub.p);
    case 7:
        return put_base64(o, last.sub);
    default:
        return put_str(o, "", 0);
    }
}

/* One attribute (a KeyValue) as a Map's entry. */
static int put_kv(span_t kv, out_t *keys, out_t *values)
{
    span_t key = {0, 0}, value = {0, 0};
    field_t f;
    while (kv.p < kv.end) {
        next_field(&kv, &f);
        if (f.num == 1)
            key = f.sub;
        else if (f.num == 2)
            value = f.sub;
    }
    return put_span(keys, key) < 0 || put_value_text(values, value) < 0 ? -1 : 0;
}

/* The OTLP proto's wire type of each field the store reads, by message
 * (ANY: a field it does not read); and the message a field holds. */
enum { M_SPAN, M_EVENT, M_LINK, M_STATUS, M_KV, M_VALUE };
#define ANY 9
#define TYPED_FIELDS 17
static const uint8_t WIRE_TYPES[][TYPED_FIELDS] = {
    [M_SPAN] = {ANY, 2, 2, 2, 2, 2, 0, 1, 1, 2, 0, 2, 0, 2, 0, 2, 5},
    [M_EVENT] = {ANY, 1, 2, 2, 0, ANY, ANY, ANY, ANY, ANY, ANY, ANY, ANY, ANY, ANY, ANY, ANY},
    [M_LINK] = {ANY, 2, 2, 2, 2, 0, 5, ANY, ANY, ANY, ANY, ANY, ANY, ANY, ANY, ANY, ANY},
    [M_STATUS] = {ANY, ANY, 2, 0, ANY, ANY, ANY, ANY, ANY, ANY, ANY, ANY, ANY, ANY, ANY, ANY, ANY},
    [M_KV] = {ANY, 2, 2, 0, ANY, ANY, ANY, ANY, ANY, ANY, ANY, ANY, ANY, ANY, ANY, ANY, ANY},
    [M_VALUE] = {ANY, 2, 0, 0, 1, 2, 2, 2, 0, ANY, ANY, ANY, ANY, ANY, ANY, ANY, ANY},
};

static int sub_message(int kind, uint32_t num)
{
    switch (kind) {
    case M_SPAN:
        return num == 9 ? M_KV : num == 11 ? M_EVENT : num == 13 ? M_LINK : num == 15 ? M_STATUS : -1;
    case M_EVENT:
        return num == 3 ? M_KV : -1;
    case M_LINK:
        return num == 4 ? M_KV : -1;
    case M_KV:
        return num == 2 ? M_VALUE : -1;
    default:
        return -1;                            /* an AnyValue's array or kvlist: never read here */
    }
}

#define MAX_KEYS 64     /* past this many attributes in one list: left out (keys not compared) */

/* A KeyValue's key (the last field 1, as a parse keeps). */
static span_t kv_key(span_t kv)
{
    span_t key = {0, 0};
    field_t f;
    while (kv.p < kv.end && next_field(&kv, &f) == 0)
        if (f.num == 1)
            key = f.sub;
    return key;
}

/* 1 if the C block writes the message as rows.span_rows stores it: every
 * field (and every field of the messages in it) of its declared wire type,
 * none numbered 0, its one singular message (a span's status, a KeyValue's
 * value) at most once; and no attribute that pcommon writes in a way not done
 * here: an array or map value (JSON), a double that is not plain_double, a
 * key twice in one attribute list (a dict keeps its first place and last
 * value), a list of more than MAX_KEYS. */
static int readable(span_t m, int kind)
{
    span_t keys[MAX_KEYS];
    int n_keys = 0, singular = 0;
    field_t f;
    while (m.p < m.end) {
        if (next_field(&m, &f) < 0 || f.num == 0)
            return 0;
        if (f.num < TYPED_FIELDS && WIRE_TYPES[kind][f.num] != ANY && WIRE_TYPES[kind][f.num] != f.type)
            return 0;
        if (kind == M_VALUE) {
            if (f.num == 5 || f.num == 6 || (f.num == 4 && !plain_double(f.sub.p)))
                return 0;
            continue;
        }
        int sub = sub_message(kind, f.num);
        if (sub < 0)
            continue;
        if ((sub == M_STATUS || sub == M_VALUE) && singular++)
            return 0;
        if (!readable(f.sub, sub))
            return 0;
        if (sub != M_KV)
            continue;
        if (n_keys == MAX_KEYS)
            return 0;
        span_t key = kv_key(f.sub);
        size_t len = (size_t)(key.end - key.p);
        for (int i = 0; i < n_keys; i++)
            if ((size_t)(keys[i].end - keys[i].p) == len && (len == 0 || memcmp(keys[i].p, key.p, len) == 0))
                return 0;
        keys[n_keys++] = key;
    }
    return 1;
}

/* The buffers of the block's columns (a Map: its offsets, keys and values;
 * an Array: its offsets, shared by the columns of one Nested). */
enum {
    B_TS, B_TRACE, B_SPAN, B_PARENT, B_STATE, B_NAME, B_KIND, B_SERVICE, B_RES_AT, B_RES_K, B_RES_V,
    B_SCOPE, B_SCOPE_V, B_ATTR_AT, B_ATTR_K, B_ATTR_V, B_DURATION, B_STATUS, B_STATUS_MSG,
    B_EV_AT, B_EV_TS, B_EV_NAME, B_EV_ATTR_AT, B_EV_ATTR_K, B_EV_ATTR_V,
    B_LK_AT, B_LK_TRACE, B_LK_SPAN, B_LK_STATE, B_LK_ATTR_AT, B_LK_ATTR_K, B_LK_ATTR_V,
    N_BUFFERS
};

static const struct {
    const char *name, *type;
    int8_t buffers[4];                        /* -1 past the last */
} TRACE_COLUMNS[] = {
    {"Timestamp", "DateTime64(9)", {B_TS, -1}},
    {"TraceId", "String", {B_TRACE, -1}},
    {"SpanId", "String", {B_SPAN, -1}},
    {"ParentSpanId", "String", {B_PARENT, -1}},
    {"TraceState", "String", {B_STATE, -1}},
    {"SpanName", "String", {B_NAME, -1}},
    {"SpanKind", "String", {B_KIND, -1}},
    {"ServiceName", "String", {B_SERVICE, -1}},
    {"ResourceAttributes", "Map(String, String)", {B_RES_AT, B_RES_K, B_RES_V, -1}},
    {"ScopeName", "String", {B_SCOPE, -1}},
    {"ScopeVersion", "String", {B_SCOPE_V, -1}},
    {"SpanAttributes", "Map(String, String)", {B_ATTR_AT, B_ATTR_K, B_ATTR_V, -1}},
    {"Duration", "UInt64", {B_DURATION, -1}},
    {"StatusCode", "String", {B_STATUS, -1}},
    {"StatusMessage", "String", {B_STATUS_MSG, -1}},
    {"Events.Timestamp", "Array(DateTime64(9))", {B_EV_AT, B_EV_TS, -1}},
    {"Events.Name", "Array(String)", {B_EV_AT, B_EV_NAME, -1}},
    {"Events.Attributes", "Array(Map(String, String))", {B_EV_AT, B_EV_ATTR_AT, B_EV_ATTR_K, B_EV_ATTR_V}},
    {"Links.TraceId", "Array(String)", {B_LK_AT, B_LK_TRACE, -1}},
    {"Links.SpanId", "Array(String)", {B_LK_AT, B_LK_SPAN, -1}},
    {"Links.TraceState", "Array(String)", {B_LK_AT, B_LK_STATE, -1}},
    {"Links.Attributes", "Array(Map(String, String))", {B_LK_AT, B_LK_ATTR_AT, B_LK_ATTR_K, B_LK_ATTR_V}},
};
#define N_TRACE_COLUMNS (sizeof TRACE_COLUMNS / sizeof TRACE_COLUMNS[0])

/* rows.SPAN_KINDS, rows.STATUS_CODES */
static const char *const SPAN_KIND_NAMES[] = {"Unspecified", "Internal", "Server", "Client", "Producer", "Consumer"};
static const char *const STATUS_NAMES[] = {"Unset", "Ok", "Error"};

typedef struct {
    out_t b[N_BUFFERS];
    uint64_t res, attrs, events, event_attrs, links, link_attrs;   /* the arrays' running offsets */
} block_t;

/* A row's resource and scope, encoded once for the run of rows that share them. */
typedef struct {
    PyObject *key[4];                         /* borrowed: the row's resource dict, service, scope name, version */
    out_t keys, values, service, scope, version;
    uint64_t count;
    int usable;                               /* 0: str texts it is not; its rows go the Python way */
} group_t;

static int put_pystr(out_t *o, PyObject *s)
{
    Py_ssize_t len;
    const char *u = PyUnicode_Check(s) ? PyUnicode_AsUTF8AndSize(s, &len) : NULL;
    if (!u) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "not a str");
        return -1;
    }
    return put_str(o, u, (size_t)len);
}

/* The group of row values v[2..5]; -1 on a memory error only. */
static int set_group(group_t *g, PyObject **v)
{
    if (g->key[0] == v[2] && g->key[1] == v[3] && g->key[2] == v[4] && g->key[3] == v[5])
        return 0;
    for (int i = 0; i < 4; i++)
        g->key[i] = v[i + 2];
    g->keys.n = g->values.n = g->service.n = g->scope.n = g->version.n = 0;
    g->count = 0;
    g->usable = 0;
    int bad = !PyDict_Check(v[2]);
    PyObject *k, *val;
    Py_ssize_t pos = 0;
    while (!bad && PyDict_Next(v[2], &pos, &k, &val)) {
        bad = put_pystr(&g->keys, k) < 0 || put_pystr(&g->values, val) < 0;
        g->count++;
    }
    bad = bad || put_pystr(&g->service, v[3]) < 0 || put_pystr(&g->scope, v[4]) < 0 ||
          put_pystr(&g->version, v[5]) < 0;
    if (bad && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_MemoryError))
            return -1;
        PyErr_Clear();                        /* not str, or not UTF-8: the Python way */
    }
    g->usable = !bad;
    return 0;
}

/* An event (11) or a link (13) of the span, its attributes written as met. */
static int put_event(block_t *k, span_t e)
{
    uint64_t ts = 0, n = 0;
    span_t name = {0, 0};
    field_t f;
    while (e.p < e.end) {
        next_field(&e, &f);
        if (f.num == 1)
            memcpy(&ts, f.sub.p, 8);
        else if (f.num == 2)
            name = f.sub;
        else if (f.num == 3 && (++n, put_kv(f.sub, &k->b[B_EV_ATTR_K], &k->b[B_EV_ATTR_V]) < 0))
            return -1;
    }
    k->events++;
    k->event_attrs += n;
    return put_u64(&k->b[B_EV_TS], le64toh(ts)) < 0 || put_span(&k->b[B_EV_NAME], name) < 0 ||
           put_u64(&k->b[B_EV_ATTR_AT], k->event_attrs) < 0 ? -1 : 0;
}

static int put_link(block_t *k, span_t l)
{
    span_t trace = {0, 0}, span = {0, 0}, state = {0, 0};
    uint64_t n = 0;
    field_t f;
    while (l.p < l.end) {
        next_field(&l, &f);
        if (f.num == 1)
            trace = f.sub;
        else if (f.num == 2)
            span = f.sub;
        else if (f.num == 3)
            state = f.sub;
        else if (f.num == 4 && (++n, put_kv(f.sub, &k->b[B_LK_ATTR_K], &k->b[B_LK_ATTR_V]) < 0))
            return -1;
    }
    k->links++;
    k->link_attrs += n;
    return put_hex(&k->b[B_LK_TRACE], trace) < 0 || put_hex(&k->b[B_LK_SPAN], span) < 0 ||
           put_span(&k->b[B_LK_STATE], state) < 0 || put_u64(&k->b[B_LK_ATTR_AT], k->link_attrs) < 0 ? -1 : 0;
}

/* One span's row (readable) in the group g: one walk of its fields, the
 * attributes, events and links written as met (each to its own buffers). */
static int put_row(block_t *k, span_t s, group_t *g)
{
    span_t trace = {0, 0}, span = {0, 0}, parent = {0, 0}, state = {0, 0}, name = {0, 0}, message = {0, 0};
    uint64_t start = 0, end = 0, kind = 0, code = 0, attrs = 0;
    out_t *b = k->b;
    field_t f, h;
    while (s.p < s.end) {
        next_field(&s, &f);
        switch (f.num) {
        case 1: trace = f.sub; break;
        case 2: span = f.sub; break;
        case 3: state = f.sub; break;
        case 4: parent = f.sub; break;
        case 5: name = f.sub; break;
        case 6: kind = f.v; break;
        case 7: memcpy(&start, f.sub.p, 8); break;
        case 8: memcpy(&end, f.sub.p, 8); break;
        case 9:
            attrs++;
            if (put_kv(f.sub, &b[B_ATTR_K], &b[B_ATTR_V]) < 0)
                return -1;
            break;
        case 11:
            if (put_event(k, f.sub) < 0)
                return -1;
            break;
        case 13:
            if (put_link(k, f.sub) < 0)
                return -1;
            break;
        case 15:
            for (span_t st = f.sub; st.p < st.end;) {
                next_field(&st, &h);
                if (h.num == 2)
                    message = h.sub;
                else if (h.num == 3)
                    code = h.v;
            }
            break;
        }
    }
    start = le64toh(start);
    end = le64toh(end);
    k->attrs += attrs;
    k->res += g->count;
    int32_t kind32 = (int32_t)kind, code32 = (int32_t)code;    /* enums: int32 on the wire */
    return put_u64(&b[B_TS], start) < 0 || put_hex(&b[B_TRACE], trace) < 0 || put_hex(&b[B_SPAN], span) < 0 ||
        put_hex(&b[B_PARENT], parent) < 0 || put_span(&b[B_STATE], state) < 0 ||
        put_span(&b[B_NAME], name) < 0 ||
        put_cstr(&b[B_KIND], kind32 >= 0 && kind32 < 6 ? SPAN_KIND_NAMES[kind32] : "") < 0 ||
        put(&b[B_SERVICE], g->service.buf, g->service.n) < 0 || put_u64(&b[B_RES_AT], k->res) < 0 ||
        put(&b[B_RES_K], g->keys.buf, g->keys.n) < 0 || put(&b[B_RES_V], g->values.buf, g->values.n) < 0 ||
        put(&b[B_SCOPE], g->scope.buf, g->scope.n) < 0 || put(&b[B_SCOPE_V], g->version.buf, g->version.n) < 0 ||
        put_u64(&b[B_ATTR_AT], k->attrs) < 0 || put_u64(&b[B_DURATION], end > start ? end - start : 0) < 0 ||
        put_cstr(&b[B_STATUS], code32 >= 0 && code32 < 3 ? STATUS_NAMES[code32] : "") < 0 ||
        put_span(&b[B_STATUS_MSG], message) < 0 ||
        put_u64(&b[B_EV_AT], k->events) < 0 || put_u64(&b[B_LK_AT], k->links) < 0 ? -1 : 0;
}

/* A String written at w (room made); returns the end. */
static uint8_t *write_text(uint8_t *w, const char *text)
{
    size_t len = strlen(text);
    w += put_varint(w, len);
    memcpy(w, text, len);
    return w + len;
}

/* The block: column and row counts, then each column's name, type and
 * buffers, written once into the bytes object. */
static PyObject *block_bytes(block_t *k, uint64_t rows)
{
    size_t size = varint_len(N_TRACE_COLUMNS) + varint_len(rows);
    for (size_t c = 0; c < N_TRACE_COLUMNS; c++) {
        size += varint_len(strlen(TRACE_COLUMNS[c].name)) + strlen(TRACE_COLUMNS[c].name) +
                varint_len(strlen(TRACE_COLUMNS[c].type)) + strlen(TRACE_COLUMNS[c].type);
        for (int i = 0; i < 4 && TRACE_COLUMNS[c].buffers[i] >= 0; i++)
            size += k->b[TRACE_COLUMNS[c].buffers[i]].n;
    }
    PyObject *data = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)size);
    if (!data)
        return NULL;
    uint8_t *w = (uint8_t *)PyBytes_AS_STRING(data);
    w += put_varint(w, N_TRACE_COLUMNS);
    w += put_varint(w, rows);
    for (size_t c = 0; c < N_TRACE_COLUMNS; c++) {
        w = write_text(write_text(w, TRACE_COLUMNS[c].name), TRACE_COLUMNS[c].type);
        for (int i = 0; i < 4 && TRACE_COLUMNS[c].buffers[i] >= 0; i++) {
            out_t *b = &k->b[TRACE_COLUMNS[c].buffers[i]];
            if (b->n)
                memcpy(w, b->buf, b->n);
            w += b->n;
        }
    }
    return data;
}

static int skip_row(PyObject *skip, Py_ssize_t i)
{
    PyObject *idx = PyLong_FromSsize_t(i);
    int rc = idx ? PyList_Append(skip, idx) : -1;
    Py_XDECREF(idx);
    return rc;
}

static PyObject *trace_native(PyObject *self, PyObject *arg)
{
    PyObject *seq = PySequence_Fast(arg, "trace_native() takes a sequence of rows");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *skip = PyList_New(0), *result = NULL;
    block_t k;
    group_t g;
    memset(&k, 0, sizeof k);
    memset(&g, 0, sizeof g);
    uint64_t rows = 0;
    if (!skip)
        goto out;
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
        int rc = PyBytes_AsStringAndSize(v[0], &buf, &len);
        if (rc == 0)
            rc = set_group(&g, v);
        if (rc == 0) {
            span_t s = {(const uint8_t *)buf, (const uint8_t *)buf + len};
            if (g.usable && readable(s, M_SPAN)) {
                rc = put_row(&k, s, &g);
                rows++;
            } else {
                rc = skip_row(skip, i);
            }
        }
        if (row != items[i])                  /* a copy made here: the group's keys went with it */
            memset(g.key, 0, sizeof g.key);
        Py_DECREF(row);
        if (rc < 0)
            goto out;
    }
    PyObject *data = rows ? block_bytes(&k, rows) : Py_NewRef(Py_None);
    if (data)
        result = Py_BuildValue("(NO)", data, skip);
out:
    for (int i = 0; i < N_BUFFERS; i++)
        PyMem_Free(k.b[i].buf);
    PyMem_Free(g.keys.buf);
    PyMem_Free(g.values.buf);
    PyMem_Free(g.service.buf);
    PyMem_Free(g.scope.buf);
    PyMem_Free(g.version.buf);
    Py_XDECREF(skip);
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
        graph_launches, graph_kernels, cpu_ns, runqueue_ns, blocked_ns, iowait_ns, switches,
        preemptions, memcpy_h2d_bytes, memcpy_d2h_bytes, memcpy_d2d_bytes, memcpy_other_bytes,
        memcpy_calls, memcpy_ns, alloc_bytes, cgroup_id, first_ns;
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
    "kernel.sandbox.violations", "kernel.sched.cpu_ns", "kernel.sched.runqueue_ns",
    "kernel.sched.blocked_ns", "kernel.sched.iowait_ns", "kernel.sched.switches",
    "kernel.sched.preemptions", "kernel.gpu.memcpy_h2d_bytes", "kernel.gpu.memcpy_d2h_bytes",
    "kernel.gpu.memcpy_d2d_bytes", "kernel.gpu.memcpy_other_bytes", "kernel.gpu.memcpy_calls",
    "kernel.gpu.memcpy_ns", "kernel.gpu.alloc_bytes",
};
#define N_FACTS 20
#define ATTR_MAX 48        /* one attribute's bytes at most: tag, lengths, key, int */

/* Span field 9 entries for the row's non-zero facts; returns their length. */
static size_t fact_attributes(const struct facts_val *v, uint8_t *out)
{
    uint64_t vals[N_FACTS] = {v->launches_driver + v->launches_runtime, v->graph_launches,
                              v->graph_kernels, v->launch_ns, v->sync_wait_ns, v->syncs,
                              v->violations, v->cpu_ns, v->runqueue_ns, v->blocked_ns,
                              v->iowait_ns, v->switches, v->preemptions, v->memcpy_h2d_bytes,
                              v->memcpy_d2h_bytes, v->memcpy_d2d_bytes, v->memcpy_other_bytes,
                              v->memcpy_calls, v->memcpy_ns, v->alloc_bytes};
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
            sum.cpu_ns += v->cpu_ns;
            sum.runqueue_ns += v->runqueue_ns;
            sum.blocked_ns += v->blocked_ns;
            sum.iowait_ns += v->iowait_ns;
            sum.switches += v->switches;
            sum.preemptions += v->preemptions;
            sum.memcpy_h2d_bytes += v->memcpy_h2d_bytes;
            sum.memcpy_d2h_bytes += v->memcpy_d2h_bytes;
            sum.memcpy_d2d_bytes += v->memcpy_d2d_bytes;
            sum.memcpy_other_bytes += v->memcpy_other_bytes;
            sum.memcpy_calls += v->memcpy_calls;
            sum.memcpy_ns += v->memcpy_ns;
            sum.alloc_bytes += v->alloc_bytes;
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
    int server = 0;
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
            /* the last kind wins, as a parse keeps it; an enum is 32 bits */
            server = (uint32_t)kind == 2;
        }
    }
    return server;
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

/* -- request totals ------------------------------------------------------- */

#define REQUEST_FACTS_MAX 16
static const char REQUEST_PREFIX[] = "request.";

/* The number an AnyValue holds: 1 with *out set for an int (field 3) or a
 * double (field 4), 0 for anything else; the last one wins, as a parse keeps. */
static int any_number(span_t v, double *out, int *is_int, uint64_t *iv)
{
    field_t f;
    int got = 0;
    while (v.p < v.end) {
        if (next_field(&v, &f) < 0)
            return 0;
        if (f.num == 3 && f.type == 0) {
            *iv = f.v;
            *is_int = 1;
            got = 1;
        } else if (f.num == 4 && f.type == 1) {
            memcpy(out, f.sub.p, 8);
            *is_int = 0;
            got = 1;
        } else if (f.num >= 1 && f.num <= 7) {
            got = 0;          /* another kind of value: the oneof's last field wins */
        }
    }
    return got;
}

static PyObject *request_facts(PyObject *self, PyObject *args)
{
    Py_buffer buf;
    Py_ssize_t start, end;
    PyObject *keys;
    if (!PyArg_ParseTuple(args, "y*nnO!", &buf, &start, &end, &PyTuple_Type, &keys))
        return NULL;
    Py_ssize_t nk = PyTuple_GET_SIZE(keys);
    const char *kp[REQUEST_FACTS_MAX];
    Py_ssize_t kl[REQUEST_FACTS_MAX];
    long ki[REQUEST_FACTS_MAX];
    long n = 0;
    double sums[REQUEST_FACTS_MAX] = {0};
    int has_totals = 0;
    PyObject *out = NULL;
    if (nk > REQUEST_FACTS_MAX || start < 0 || end < start || end > buf.len) {
        PyErr_SetString(PyExc_ValueError, "request_facts: bad bounds or too many keys");
        goto done;
    }
    for (Py_ssize_t i = 0; i < nk; i++) {
        PyObject *k = PyTuple_GET_ITEM(keys, i);
        if (!PyTuple_Check(k) || PyTuple_GET_SIZE(k) != 2 || !PyBytes_Check(PyTuple_GET_ITEM(k, 0))) {
            PyErr_SetString(PyExc_TypeError, "request_facts: keys are (bytes, index) pairs");
            goto done;
        }
        kp[i] = PyBytes_AS_STRING(PyTuple_GET_ITEM(k, 0));
        kl[i] = PyBytes_GET_SIZE(PyTuple_GET_ITEM(k, 0));
        ki[i] = PyLong_AsLong(PyTuple_GET_ITEM(k, 1));
        if (ki[i] < 0 || ki[i] >= REQUEST_FACTS_MAX) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "request_facts: index out of range");
            goto done;
        }
        if (ki[i] + 1 > n)
            n = ki[i] + 1;
    }
    span_t sp = {(const uint8_t *)buf.buf + start, (const uint8_t *)buf.buf + end};
    field_t f, g;
    int bad = 0;
    const size_t pre = sizeof(KERNEL_PREFIX) - 1, req = sizeof REQUEST_PREFIX - 1;
    while (!bad && sp.p < sp.end) {
        if (next_field(&sp, &f) < 0) {
            bad = 1;
            break;
        }
        if (f.num != 9 || f.type != 2)           /* Span.attributes */
            continue;
        span_t kv = f.sub, key = {0}, value = {0};
        int has_key = 0, has_value = 0;
        while (kv.p < kv.end) {
            if (next_field(&kv, &g) < 0) {
                bad = 1;
                break;
            }
            if (g.num == 1 && g.type == 2) {
                key = g.sub;
                has_key = 1;
            } else if (g.num == 2 && g.type == 2) {
                value = g.sub;
                has_value = 1;
            }
        }
        size_t len = has_key ? (size_t)(key.end - key.p) : 0;
        if (bad || !has_value || len <= pre || memcmp(key.p, KERNEL_PREFIX, pre))
            continue;
        const uint8_t *rest = key.p + pre;
        len -= pre;
        double d = 0;
        uint64_t iv = 0;
        int is_int = 0;
        if (!any_number(value, &d, &is_int, &iv))
            continue;
        if (len > req && !memcmp(rest, REQUEST_PREFIX, req)) {
            has_totals = 1;
            continue;
        }
        for (Py_ssize_t i = 0; i < nk; i++) {
            if ((size_t)kl[i] != len || memcmp(kp[i], rest, len))
                continue;
            if (is_int) {
                if (iv <= (uint64_t)INT64_MAX)       /* a negative int is no fact */
                    sums[ki[i]] += (double)iv;
            } else if (d > 0.0 && isfinite(d)) {
                sums[ki[i]] += d;
            }
            break;
        }
    }
    PyObject *own = Py_None;
    int any = 0;
    for (long i = 0; i < n && !bad; i++)
        any |= sums[i] != 0.0;
    if (any) {
        own = PyList_New(n);
        if (!own)
            goto done;
        for (long i = 0; i < n; i++) {
            PyObject *x = PyFloat_FromDouble(sums[i]);
            if (!x) {
                Py_DECREF(own);
                goto done;
            }
            PyList_SET_ITEM(own, i, x);
        }
    } else {
        Py_INCREF(own);
    }
    out = Py_BuildValue("(NO)", own, (has_totals && !bad) ? Py_True : Py_False);
done:
    PyBuffer_Release(&buf);
    return out;
}

static PyMethodDef methods[] = {
    {"join_resource", join_resource, METH_VARARGS,
     "join_resource(blob, map_fd, index_fd, origin=None) -> None or (new_blob or None, keys, "
     "rows, cgroup, taken): the span join's common case for one serialized ResourceSpans"},
    {"request_facts", request_facts, METH_VARARGS,
     "request_facts(blob, start, end, keys) -> (sums or None, has_totals): what the serialized Span "
     "blob[start:end] adds to its request's totals; keys: (key after 'kernel.', sums index) pairs"},
    {"valid_spans", valid_spans, METH_O,
     "valid_spans(payload) -> the spans of a serialized ExportTraceServiceRequest when all their ids "
     "are valid and no resource or scope is empty, else -1"},
    {"span_proto_rows", span_proto_rows, METH_VARARGS,
     "span_proto_rows(resource_spans_blob, resource_attributes, service) -> the serialized "
     "ResourceSpans' spans as rows.SPAN_PROTO_COLUMNS rows (each span's bytes, events or links, "
     "the resource's dict and service, its scope's name and version)"},
    {"serving_spans", serving_spans, METH_O,
     "serving_spans(blob) -> [(scope index, span index)] of the serialized ResourceSpans' spans "
     "of SERVER kind or with events (None: not well-formed)"},
    {"trace_native", trace_native, METH_O,
     "trace_native(rows) -> (block or None, skip): rows.SPAN_PROTO_COLUMNS rows as one Native block "
     "of otel_traces columns, but the rows at the indices in skip (the Python way's)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "spanlet._wire", NULL, -1, methods};

PyMODINIT_FUNC PyInit__wire(void)
{
    return PyModule_Create(&module);
}
