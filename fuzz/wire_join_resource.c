/* Fuzz target: spanlet._wire.join_resource on any bytes as a serialized
 * ResourceSpans, against real BPF maps of span_facts' and span_facts_index's
 * key and value sizes (bpf/spanlet.h; made here, root needed), refilled
 * before each input with rows for three spans the seed corpus uses
 * (fuzz/make_corpus.py JOIN_IDS): trace id 16 bytes of 0x10 + k, span id
 * 01 02 03 04 05 06 07 08 + k, k 0..2.
 * Input: three selector bytes, then the blob.
 *   0: the origin: bit 7 None, else bits 0-2 how many of ORIGINS, bit 5 past
 *      ORIGIN_MAX of them, bit 6 one that is no int
 *   1: each index entry: bits 0-2 its n, bit 3 a cgroup listed twice, bit 4
 *      a cgroup 0 listed, bit 7 a facts map fd that is no map (an OSError)
 *   2: bits 0-4 which of ROW_CGROUPS have a row, bit 5 all rows of one
 *      score (a tie), bit 6 rows whose own cgroup_id is 0 */
#include "../native/spanlet_wire.c"
#include "harness.h"

_Static_assert(sizeof(struct facts_key) == 32, "struct span_facts_key");
_Static_assert(sizeof(struct facts_val) == 192, "struct span_facts_val");
_Static_assert(sizeof(struct index_key) == 24, "struct span_facts_index_key");
_Static_assert(sizeof(struct index_val) == 40, "struct span_facts_index_val");

#define N_IDS 3
#define N_ROW_CGROUPS 5
static const uint64_t ROW_CGROUPS[N_ROW_CGROUPS] = {100, 101, 102, 103, 0};
static const uint64_t ORIGINS[] = {100, 103, 104, 0, 1, 101, UINT64_MAX};
static int facts_fd = -1, index_fd = -1;

static int map_create(uint32_t key_size, uint32_t value_size, const char *name)
{
    union bpf_attr attr;
    memset(&attr, 0, sizeof attr);
    attr.map_type = BPF_MAP_TYPE_LRU_HASH;
    attr.key_size = key_size;
    attr.value_size = value_size;
    attr.max_entries = 64;
    strncpy(attr.map_name, name, sizeof attr.map_name - 1);
    return (int)syscall(__NR_bpf, BPF_MAP_CREATE, &attr, sizeof attr);
}

static void close_maps(void)
{
    if (facts_fd >= 0)
        close(facts_fd);
    if (index_fd >= 0)
        close(index_fd);
}

static int target_init(void)
{
    facts_fd = map_create(sizeof(struct facts_key), sizeof(struct facts_val), "fuzz_facts");
    index_fd = map_create(sizeof(struct index_key), sizeof(struct index_val), "fuzz_index");
    atexit(close_maps);
    if (facts_fd < 0 || index_fd < 0) {
        perror("fuzz: BPF_MAP_CREATE (root and a kernel with BPF needed)");
        return -1;
    }
    return 0;
}

static void map_set(int cmd, int fd, const void *k, const void *v)
{
    union bpf_attr attr;
    memset(&attr, 0, sizeof attr);
    attr.map_fd = (uint32_t)fd;
    attr.key = (uint64_t)(uintptr_t)k;
    attr.value = (uint64_t)(uintptr_t)v;
    if (syscall(__NR_bpf, cmd, &attr, sizeof attr) < 0 && errno != ENOENT) {
        perror("fuzz: bpf() on the fuzz maps");
        abort();
    }
}

/* The index entry and rows of each of the N_IDS spans, as the selectors say. */
static void fill_maps(unsigned index_sel, unsigned rows_sel)
{
    for (int id = 0; id < N_IDS; id++) {
        struct index_key ik;
        memset(ik.trace_id, 0x10 + id, 16);
        ik.span_id = 0x0102030405060708ull + (uint64_t)id;
        struct index_val iv = {{100, 101, 102, 103}, index_sel & 7, 0};
        if (index_sel & 8)
            iv.cgroups[1] = iv.cgroups[0];
        if (index_sel & 16)
            iv.cgroups[2] = 0;
        map_set(BPF_MAP_UPDATE_ELEM, index_fd, &ik, &iv);
        struct facts_key k;
        memcpy(k.trace_id, ik.trace_id, 16);
        k.span_id = ik.span_id;
        for (int c = 0; c < N_ROW_CGROUPS; c++) {
            k.cgroup_id = ROW_CGROUPS[c];
            if (!(rows_sel & (1u << c))) {
                map_set(BPF_MAP_DELETE_ELEM, facts_fd, &k, NULL);
                continue;
            }
            struct facts_val v;
            memset(&v, 0, sizeof v);
            v.launches_driver = rows_sel & 32 ? 1 : (uint64_t)c + 1;
            v.cpu_ns = 1000 * ((uint64_t)c + 1);
            v.memcpy_h2d_bytes = UINT64_MAX - (uint64_t)c;   /* sums that wrap */
            v.cgroup_id = rows_sel & 64 ? 0 : ROW_CGROUPS[c];
            map_set(BPF_MAP_UPDATE_ELEM, facts_fd, &k, &v);
        }
    }
}

static PyObject *origin_of(unsigned sel)
{
    if (sel & 0x80)
        return Py_NewRef(Py_None);
    int n = sel & 0x20 ? ORIGIN_MAX + 6 : (int)(sel & 7);
    PyObject *origin = PyList_New(0);
    for (int i = 0; origin && i < n; i++) {
        PyObject *cg = PyLong_FromUnsignedLongLong(ORIGINS[i % (sizeof ORIGINS / sizeof ORIGINS[0])]);
        if (!cg || PyList_Append(origin, cg) < 0)
            Py_CLEAR(origin);
        Py_XDECREF(cg);
    }
    if (origin && (sel & 0x40)) {
        PyObject *bad = PyUnicode_FromString("100");
        if (!bad || PyList_Append(origin, bad) < 0)
            Py_CLEAR(origin);
        Py_XDECREF(bad);
    }
    return origin;
}

static int count_span(void *ctx, span_t span)
{
    field_t f;
    while (span.p < span.end)
        if (next_field(&span, &f) < 0)
            return -1;
    ++*(Py_ssize_t *)ctx;
    return 0;
}

/* A new blob is a well-formed ResourceSpans with every span it had (keys). */
static void check_joined(PyObject *got)
{
    PyObject *new_blob = PyTuple_GET_ITEM(got, 0), *keys = PyTuple_GET_ITEM(got, 1);
    if (new_blob == Py_None)
        return;
    span_t rs = {(const uint8_t *)PyBytes_AS_STRING(new_blob),
                 (const uint8_t *)PyBytes_AS_STRING(new_blob) + PyBytes_GET_SIZE(new_blob)};
    Py_ssize_t spans = 0;
    if (each_span(rs, count_span, &spans) < 0 || spans != PyList_GET_SIZE(keys)) {
        fprintf(stderr, "fuzz: join_resource's new blob is not its spans, grown (%zd spans, %zd keys)\n",
                spans, PyList_GET_SIZE(keys));
        abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    input_t in = {data, size};
    unsigned origin_sel = (unsigned)take(&in, 1), index_sel = (unsigned)take(&in, 1),
             rows_sel = (unsigned)take(&in, 1);
    fill_maps(index_sel, rows_sel);
    PyObject *origin = origin_of(origin_sel);
    if (!origin)
        abort();
    exact_t blob;
    PyObject *args = Py_BuildValue("(OiiO)", exact_view(&blob, in.p, in.left),
                                   index_sel & 0x80 ? -1 : facts_fd, index_fd, origin);
    if (!args)
        abort();
    PyObject *got = join_resource(NULL, args);
    if (got && got != Py_None)
        check_joined(got);
    settle(got, "join_resource");
    Py_DECREF(args);
    Py_DECREF(origin);
    exact_free(&blob);
    return 0;
}
