/* Fuzz target: spanlet._ring's walk over hostile ring-buffer contents (any
 * positions, lengths, BUSY/DISCARD bits, kinds and timestamps), through
 * Ring.read_raw and Ring.read, and every Record and header view that read
 * hands out. The ring is laid out as the kernel maps it (the producer page,
 * then the data area twice) in memory of exactly that size, in place of the
 * mmap of a map fd: a read past the second copy is an ASan report.
 * Input: a selector byte (bit 0: a ring of two pages, not one; bits 1-2: the
 * clock: every record asks it, its offset added while it holds, it holds for
 * no record, an offset that overflows), u16 limit (modulo 1024), u64
 * consumer position (rounded down to 8 bytes, as the reader only ever
 * stores), u64 producer position, then the data area (zeros past the input). */
#include "../native/spanlet_ring.c"
#include "harness.h"

#define PAGE 4096

static PyObject *helpers, *layout;

/* The stand-ins of agent/events.py's structs and MonotonicClock, and the
 * consumer: it reads each of the first records of a batch the way the
 * agent's handlers may, and lets the others go. */
static const char HELPERS[] =
    "class Hdr:\n"
    "    def __init__(self, raw):\n"
    "        self.trace_id = raw[24:40]\n"
    "class Rec:\n"
    "    def __init__(self, raw):\n"
    "        self.raw_len = len(raw)\n"
    "        self.hdr = Hdr(raw)\n"
    "    @classmethod\n"
    "    def from_buffer_copy(cls, raw):\n"
    "        return cls(bytes(raw))\n"
    "class Clock:\n"
    "    def __init__(self, offset_ns, next_ns):\n"
    "        self.offset_ns, self._next = offset_ns, next_ns\n"
    "    def to_epoch(self, ts):\n"
    "        if self._next >= 0:\n"
    "            self._next = ts + 1000\n"
    "        return ts + self.offset_ns\n"
    "CLASSES = (None, Rec, Rec, Rec, Rec, None)\n"
    "SIZES = (0, 56, 64, 200, 5000, 56)\n"
    "def consume(batch):\n"
    "    n = len(batch)\n"
    "    for i, ev in enumerate(batch):\n"
    "        if i >= 16:\n"
    "            continue\n"
    "        h = ev.hdr\n"
    "        (h.ts_ns, h.pid, h.tid, h.cgroup_id, h.span_id, h.kind, h.modality, h.flags)\n"
    "        assert len(h.trace_id) == 16 and len(bytes(h)) == 56 == len(memoryview(h))\n"
    "        assert bytes(ev) == bytes(memoryview(ev)) == ev.raw and ev.raw_len == len(ev.raw)\n"
    "        assert ev.__class__ is Rec and isinstance(ev.epoch_ns, int)\n"
    "    assert next(iter(batch), None) is None\n"
    "    return n\n";

static int target_init(void)
{
    PyObject *module = PyInit__ring();        /* the types readied, the names interned */
    if (!module)
        return -1;
    Py_DECREF(module);
    helpers = python_helpers(HELPERS);
    if (!helpers)
        return -1;
    layout = Py_BuildValue("(iiOO)", HDR_SIZE, 48, PyDict_GetItemString(helpers, "CLASSES"),
                           PyDict_GetItemString(helpers, "SIZES"));
    return layout ? 0 : -1;
}

/* A Ring over memory the harness owns, its positions as given. */
static Ring *fake_ring(size_t size, uint64_t cons, uint64_t prod, const uint8_t *data, size_t len)
{
    Ring *r = (Ring *)PyType_GenericNew(&RingType, NULL, NULL);
    if (!r)
        abort();
    r->page = PAGE;
    r->size = size;
    r->mask = size - 1;
    r->consumer = malloc(sizeof(uint64_t));
    r->producer = calloc(1, PAGE + 2 * size);
    if (!r->consumer || !r->producer)
        abort();
    *r->consumer = cons;
    memcpy(r->producer, &prod, sizeof prod);
    if (len > size)
        len = size;
    memcpy(r->producer + PAGE, data, len);
    memcpy(r->producer + PAGE + size, data, len);
    return r;
}

static void free_ring(Ring *r)
{
    free(r->consumer);
    free(r->producer);
    r->consumer = NULL;                       /* nothing for ring_unmap to unmap */
    r->producer = NULL;
    Py_DECREF(r);
}

/* The clock modes: every record asks the clock; the offset added while it
 * holds (it never stops); the clock asked at each record, as next_ns is 0;
 * an offset that overflows the sum. */
static const long long OFFSETS[4] = {0, 1700000000000000000LL, 1700000000000000000LL, INT64_MAX};
static const long long NEXTS[4] = {-1, INT64_MAX, 0, INT64_MAX};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    input_t in = {data, size};
    unsigned sel = (unsigned)take(&in, 1);
    Py_ssize_t limit = (Py_ssize_t)(take(&in, 2) % 1024);   /* the agent's: the ring's size / 56 */
    uint64_t cons = take(&in, 8) & ~(uint64_t)7, prod = take(&in, 8);
    size_t ring_size = sel & 1 ? 2 * PAGE : PAGE;

    Ring *r = fake_ring(ring_size, cons, prod, in.p, in.left);
    PyObject *args = Py_BuildValue("(n)", limit);
    settle(ring_read_raw(r, args), "Ring.read_raw");
    Py_DECREF(args);
    *r->consumer = cons;

    unsigned mode = (sel >> 1) & 3;
    PyObject *clock = PyObject_CallFunction(PyDict_GetItemString(helpers, "Clock"), "LL",
                                            OFFSETS[mode], NEXTS[mode]);
    if (!clock)
        abort();
    args = Py_BuildValue("(nOOLL)", limit, layout, clock, OFFSETS[mode], NEXTS[mode]);
    PyObject *got = ring_read(r, args);
    Py_DECREF(args);
    if (got) {
        PyObject *n = PyObject_CallOneArg(PyDict_GetItemString(helpers, "consume"), PyTuple_GET_ITEM(got, 0));
        if (!n) {
            PyErr_Print();
            fprintf(stderr, "fuzz: a record read back is not what the reader promises\n");
            abort();
        }
        Py_DECREF(n);
    }
    settle(got, "Ring.read");
    Py_DECREF(clock);
    free_ring(r);
    return 0;
}
