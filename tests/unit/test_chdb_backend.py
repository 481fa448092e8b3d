"""The embedded chdb store, for real, in temporary directories: enriched spans,
kernel events and metric samples are read back exactly as written (ids,
nanosecond timestamps, attributes); a retried batch leaves one copy after a
final merge; data survive a restart; inserts from many threads all land; the
dashboards' queries return exactly the expected rows."""

from __future__ import annotations

import ctypes as C
import os
import threading
import time

import pytest
import store_load
from opentelemetry.proto.trace.v1 import trace_pb2

from spanlet import events, join
from spanlet.metrics import Family, HistogramSample, Sample, labels
from spanlet.exporters.clickhouse import BackendError, queries, rows, schema, span_protos
from spanlet.exporters.clickhouse.chdb_backend import OLD_SCHEMA_FILE, ChdbBackend

DB = "spanlet"
NOW = time.time_ns() - 600 * 1_000_000_000   # recent (inside the TTL), fixed for the run


@pytest.fixture
def backend(tmp_path):
    b = ChdbBackend(str(tmp_path / "store"), database=DB)
    try:
        b.ensure_schema()
        yield b
    finally:
        b.close()


# -- builders ---------------------------------------------------------------

def _event(cls, kind, ts, *, pid=100, tid=101, cgroup=7, trace=b"", span=0, **fields):
    ev = cls()
    ev.hdr.kind = kind
    ev.hdr.pid, ev.hdr.tid, ev.hdr.cgroup_id = pid, tid, cgroup
    ev.hdr.ts_ns = ts
    if trace:
        ev.hdr.trace_id = (C.c_uint8 * 16)(*trace)
    ev.hdr.span_id = span
    ev.hdr.modality = events.Modality.image
    for k, v in fields.items():
        setattr(ev, k, v)
    ev.epoch_ns = ts
    return ev


def _flow(src, dst, sport, dport):
    f = events.FlowKey()
    f.saddr = (C.c_uint8 * 16)(*bytes(map(int, src.split("."))))
    f.daddr = (C.c_uint8 * 16)(*bytes(map(int, dst.split("."))))
    f.sport, f.dport, f.l4proto, f.family = sport, dport, 6, 4
    return f


TRACE = bytes(range(1, 17))
SPAN = 0x0102030405060708


def _kernel_events():
    t = NOW
    return [
        _event(events.GpuLaunch, events.Kind.GPU_LAUNCH, t + 1, trace=TRACE, span=SPAN, func=0xdeadbeef, stream=3,
               duration_ns=1234, grid=(C.c_uint32 * 3)(4, 5, 6),
               block=(C.c_uint32 * 3)(32, 1, 1), shared_mem=4096,
               api=events.Api.driver, entry=events.Entry.cuLaunchKernel),
        _event(events.GpuSync, events.Kind.GPU_SYNC, t + 2, trace=TRACE, span=SPAN, stream=3, duration_ns=5000,
               api=events.Api.runtime, entry=events.Entry.cudaStreamSynchronize),
        _event(events.SandboxViolation, events.Kind.SANDBOX, t + 3, pid=200, tid=201, cgroup=8, addr=2**64 - 4096,
               len=1 << 20, pool_max_bytes=1 << 30, prot=3, flags=0x22, pool_id=9, fd=-1,
               rule=events.Rule.oversize, action=events.Action.kill),
        _event(events.HttpRequest, events.Kind.HTTP, t + 4, tid=0, flow=_flow("10.0.0.1", "10.0.0.2", 40000, 80),
               ifindex=3, path_hash=0xabcdef01, method=1, direction=events.Direction.ingress,
               trace_flags=1),
        _event(events.HttpBytes, events.Kind.HTTP_BYTES, t + 5, tid=0, flow=_flow("10.0.0.1", "10.0.0.2", 40000, 80),
               bytes=(C.c_uint64 * 2)(700, 9000), req_dir=0),
        _event(events.FlowSeen, events.Kind.FLOW, t + 6, tid=0, flow=_flow("10.0.0.3", "10.0.0.4", 5000, 443),
               ifindex=4, proto_class=events.Proto.http2, direction=events.Direction.egress),
    ]


def _enriched_spans(n=3, pod="web-0", stalls=(5000, 0, 777), t0=NOW):
    """ResourceSpans whose spans went through the span join (kernel.* facts)."""
    rs = trace_pb2.ResourceSpans()
    for k, v in (("service.name", "frontend"), ("k8s.pod.name", pod),
                 ("k8s.namespace.name", "prod")):
        rs.resource.attributes.add(key=k).value.string_value = v
    ss = rs.scope_spans.add()
    ss.scope.name, ss.scope.version = "spanlet", "0.1"
    for i in range(n):
        span = ss.spans.add()
        span.trace_id = bytes([0xA0 + i]) + pod.encode()[:1] + bytes(14)
        span.span_id = (0x1000 + i).to_bytes(8, "big") if pod == "web-0" else \
            (0x2000 + i).to_bytes(8, "big")
        span.parent_span_id = bytes(8) if i == 0 else b"\x00" * 7 + b"\x01"
        span.name = f"GET /item/{i}"
        span.kind = trace_pb2.Span.SPAN_KIND_SERVER
        span.start_time_unix_nano = t0 + i * 1_000_000 + 123_456_789
        span.end_time_unix_nano = span.start_time_unix_nano + 2_000_000 + i
        span.trace_state = "a=b"
        span.status.code = trace_pb2.Status.STATUS_CODE_ERROR if i == 1 else 0
        span.status.message = "boom 'quoted'" if i == 1 else ""
        span.attributes.add(key="http.method").value.string_value = "GET"
        span.attributes.add(key="ratio").value.double_value = 0.25
        span.attributes.add(key="cached").value.bool_value = True
        arr = span.attributes.add(key="list").value.array_value
        arr.values.add().int_value = 1
        arr.values.add().string_value = "x"
        facts = join.Facts(trace_id=span.trace_id, first_ns=span.start_time_unix_nano,
                           launches=1, launch_ns=300)
        if stalls[i % len(stalls)]:
            facts.sync_wait_ns, facts.syncs = stalls[i % len(stalls)], 1
            facts.add_sample(_event(events.GpuSync, events.Kind.GPU_SYNC, span.start_time_unix_nano + 10,
                                    trace=span.trace_id, span=int.from_bytes(span.span_id, "big"),
                                    duration_ns=stalls[i % len(stalls)]), cap=4)
        facts.add_sample(_event(events.GpuLaunch, events.Kind.GPU_LAUNCH, span.start_time_unix_nano + 20,
                                duration_ns=300, grid=(C.c_uint32 * 3)(1, 1, 1),
                                block=(C.c_uint32 * 3)(64, 1, 1)), cap=4)
        join.apply_facts(span, facts)
        link = span.links.add()
        link.trace_id, link.span_id, link.trace_state = TRACE, SPAN.to_bytes(8, "big"), "l=1"
        link.attributes.add(key="n").value.int_value = -5
    return [rs]


SPAN_SELECT = (
    "SELECT toUnixTimestamp64Nano(Timestamp), TraceId, SpanId, ParentSpanId, TraceState, "
    "SpanName, SpanKind, ServiceName, ResourceAttributes, ScopeName, ScopeVersion, "
    "SpanAttributes, Duration, StatusCode, StatusMessage, "
    "arrayMap(x -> toUnixTimestamp64Nano(x), `Events.Timestamp`), `Events.Name`, "
    "`Events.Attributes`, `Links.TraceId`, `Links.SpanId`, `Links.TraceState`, "
    "`Links.Attributes` FROM spanlet.otel_traces ORDER BY Timestamp")


def _insert_spans(b, resource_spans):
    b.insert("otel_traces", rows.TRACE_COLUMNS, rows.span_rows(resource_spans))


# -- tests ------------------------------------------------------------------

def test_enriched_spans_read_back_exactly(backend):
    rs = _enriched_spans()
    written = rows.span_rows(rs)
    _insert_spans(backend, rs)
    got = [list(r) for r in backend.query(SPAN_SELECT)]
    assert got == written
    first = dict(zip(rows.TRACE_COLUMNS, got[0]))
    # Independent of rows.py: the collector's text forms.
    span = rs[0].scope_spans[0].spans[0]
    assert first["Timestamp"] == span.start_time_unix_nano == NOW + 123_456_789
    assert first["TraceId"] == span.trace_id.hex() and len(first["TraceId"]) == 32
    assert first["SpanId"] == "0000000000001000"
    assert first["ParentSpanId"] == ""                      # all-zero id → ''
    assert first["SpanKind"] == "Server"                 # the collector's spelling
    assert first["StatusCode"] == "Unset"
    assert first["Duration"] == 2_000_000
    assert first["ServiceName"] == "frontend"
    assert first["SpanAttributes"] == {
        "http.method": "GET", "ratio": "0.25", "cached": "true", "list": '[1,"x"]',
        "kernel.gpu.launches": "1", "kernel.gpu.launch_ns": "300",
        "kernel.gpu.sync_wait_ns": "5000", "kernel.gpu.syncs": "1"}
    assert first["Events.Name"] == ["kernel.gpu.sync_wait", "kernel.gpu.launch"]
    assert first["Events.Timestamp"] == [span.start_time_unix_nano + 10,
                                         span.start_time_unix_nano + 20]
    assert first["Events.Attributes"][0]["duration_ns"] == "5000"
    assert first["Links.TraceId"] == [TRACE.hex()]
    assert first["Links.Attributes"] == [{"n": "-5"}]
    second = dict(zip(rows.TRACE_COLUMNS, got[1]))
    assert second["StatusCode"] == "Error"
    assert second["StatusMessage"] == "boom 'quoted'"
    assert "kernel.gpu.sync_wait_ns" not in second["SpanAttributes"]


def test_kernel_events_read_back_exactly(backend):
    evs = _kernel_events()
    written = rows.kernel_event_rows(evs, resolve=lambda cg: ("ns", f"pod-{cg}", "c"),
                                     node="node-1")
    backend.insert("kernel_events", rows.KERNEL_EVENT_COLUMNS, written)
    cols = ", ".join(f"`{c}`" if c != "Timestamp" else "toUnixTimestamp64Nano(Timestamp)"
                     for c in rows.KERNEL_EVENT_COLUMNS)
    got = [list(r) for r in backend.query(
        f"SELECT {cols} FROM spanlet.kernel_events ORDER BY Timestamp")]
    assert got == written
    by_kind = {r[1]: dict(zip(rows.KERNEL_EVENT_COLUMNS, r)) for r in got}
    launch = by_kind["GPU_LAUNCH"]
    assert (launch["Timestamp"], launch["TraceId"], launch["SpanId"]) == (
        NOW + 1, TRACE.hex(), "0102030405060708")
    assert (launch["Api"], launch["Entry"], launch["Func"], launch["Grid"], launch["Block"],
            launch["SharedMem"], launch["Modality"]) == (
        "driver", "cuLaunchKernel", 0xdeadbeef, [4, 5, 6], [32, 1, 1], 4096, "image")
    assert by_kind["GPU_SYNC"]["DurationNs"] == 5000
    sb = by_kind["SANDBOX"]
    assert (sb["Rule"], sb["Action"], sb["Addr"], sb["Fd"], sb["MapFlags"], sb["K8sPodName"],
            sb["TraceId"], sb["SpanId"]) == ("oversize", "kill", 2**64 - 4096, -1, 0x22,
                                             "pod-8", "", "")
    http = by_kind["HTTP"]
    assert (http["SrcAddr"], http["DstAddr"], http["SrcPort"], http["DstPort"],
            http["PathHash"], http["Direction"]) == ("10.0.0.1", "10.0.0.2", 40000, 80,
                                                     0xabcdef01, "ingress")
    assert (by_kind["HTTP_BYTES"]["RequestBytes"], by_kind["HTTP_BYTES"]["ResponseBytes"]) == (
        700, 9000)
    assert (by_kind["FLOW"]["ProtoClass"], by_kind["FLOW"]["Node"]) == ("http2", "node-1")


def test_metric_samples_read_back_exactly(backend):
    fams = [
        Family("spanlet_gpu_launches_total", "counter", "launches", "",
               [Sample(labels(pod="a", namespace="n"), 12.0),
                Sample(labels(pod="b", namespace="n"), 2.5e-9)]),
        Family("spanlet_request_duration_seconds", "histogram", "latency", "seconds",
               [HistogramSample(labels(route="/x"), (0.1, 0.5), (3, 1, 2), 4.25, 6)]),
    ]
    written = rows.metric_rows(fams, NOW)
    backend.insert("metric_samples", rows.METRIC_COLUMNS, written)
    got = [list(r) for r in backend.query(
        "SELECT toUnixTimestamp64Nano(Timestamp), MetricName, MetricType, Unit, Labels, Value, "
        "Count, Sum, Bounds, BucketCounts FROM spanlet.metric_samples "
        "ORDER BY MetricName, Labels['pod']")]
    assert got == written
    assert got[0][4] == {"namespace": "n", "pod": "a"} and got[1][5] == 2.5e-9
    assert got[2][8:] == [[0.1, 0.5], [3, 1, 2]] and got[2][6:8] == [6, 4.25]


def test_retried_batch_leaves_one_copy(backend):
    rs = _enriched_spans()
    evs = rows.kernel_event_rows(_kernel_events())
    for _ in range(2):
        _insert_spans(backend, rs)
        backend.insert("kernel_events", rows.KERNEL_EVENT_COLUMNS, evs)
    for table in ("otel_traces", "kernel_events"):
        backend.query(f"OPTIMIZE TABLE spanlet.{table} FINAL")
    assert backend.query("SELECT count(), uniqExact(TraceId, SpanId) FROM spanlet.otel_traces") \
        == [(3, 3)]
    assert backend.query("SELECT count() FROM spanlet.kernel_events") == [(len(evs),)]
    # A span re-sent with the same ids but more facts replaces the old copy.
    later = _enriched_spans(stalls=(6000, 0, 777))
    _insert_spans(backend, later)
    assert backend.query(
        "SELECT SpanAttributes['kernel.gpu.sync_wait_ns'] FROM spanlet.otel_traces FINAL "
        "WHERE SpanId = '0000000000001000'") == [("6000",)]


def test_data_survive_restart(tmp_path):
    path = str(tmp_path / "store")
    b = ChdbBackend(path)
    try:
        b.ensure_schema()
        _insert_spans(b, _enriched_spans())
    finally:
        b.close()
    with pytest.raises(BackendError):
        b.query("SELECT 1")                       # closed
    (tmp_path / "store" / OLD_SCHEMA_FILE).write_text("syntax = ...")    # an older agent's file
    b = ChdbBackend(path)
    try:
        assert b.ensure_schema() == schema.SCHEMA_VERSION
        assert b.query("SELECT count() FROM spanlet.otel_traces") == [(3,)]
        assert not (tmp_path / "store" / OLD_SCHEMA_FILE).exists()      # removed, not read
    finally:
        b.close()


def test_values_are_never_spliced_into_sql(backend):
    evil = "x'); DROP TABLE spanlet.otel_traces; --\\' \n\t\0 ✓"
    backend.insert("otel_traces", ["Timestamp", "TraceId", "SpanId", "SpanName",
                                   "SpanAttributes"],
                   [[NOW, "t", "s", evil, {evil: evil}]])
    assert backend.query("SELECT SpanName, SpanAttributes FROM spanlet.otel_traces") == [
        (evil, {evil: evil})]


def test_concurrent_inserts_all_land(backend):
    errors = []

    def worker(w):
        try:
            for k in range(10):
                backend.insert("kernel_events", ["Timestamp", "Kind", "Tid", "CgroupId"],
                               [[NOW + i, "GPU_SYNC", w, k] for i in range(100)])
                backend.query("SELECT count() FROM spanlet.kernel_events")
        except Exception as e:   # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert backend.query("SELECT count(), uniqExact(Tid, CgroupId, Timestamp) "
                         "FROM spanlet.kernel_events") == [(8000, 8000)]


# -- queries ----------------------------------------------------------------

@pytest.fixture
def populated(backend):
    _insert_spans(backend, _enriched_spans(3, "web-0", stalls=(5000, 0, 777)))
    _insert_spans(backend, _enriched_spans(2, "web-1", stalls=(90_000, 10), t0=NOW + 10**9))
    resolve = lambda cg: ("prod", f"pod-{cg}", "main")   # noqa: E731
    backend.insert("kernel_events", rows.KERNEL_EVENT_COLUMNS,
                   rows.kernel_event_rows(_kernel_events(), resolve=resolve))
    backend.insert("kernel_events", rows.KERNEL_EVENT_COLUMNS,   # a retry of the violation
                   rows.kernel_event_rows(_kernel_events()[2:3], resolve=resolve))
    return backend


def test_recent_pod_spans(populated):
    got = queries.recent_pod_spans(populated, DB, "web-0", "prod", limit=2)
    assert [(r["span_id"], r["name"]) for r in got] == [
        ("0000000000001002", "GET /item/2"), ("0000000000001001", "GET /item/1")]
    assert got[0]["kernel"] == {"kernel.gpu.launches": "1", "kernel.gpu.launch_ns": "300",
                                "kernel.gpu.sync_wait_ns": "777", "kernel.gpu.syncs": "1"}
    assert got[0]["ts_ns"] == NOW + 2_000_000 + 123_456_789
    assert got[0]["duration_ns"] == 2_000_002 and got[1]["status"] == "Error"
    assert queries.recent_pod_spans(populated, DB, "web-0", "other-ns") == []
    assert queries.recent_pod_spans(populated, DB, "x' OR '1'='1") == []
    since = queries.recent_pod_spans(populated, DB, "web-0", since_ns=NOW + 1_000_000 + 123_456_789)
    assert [r["span_id"] for r in since] == ["0000000000001002", "0000000000001001"]


def test_slowest_gpu_stall_spans(populated):
    got = queries.slowest_gpu_stall_spans(populated, DB, limit=3)
    assert [(r["pod"], r["span_id"], r["gpu_sync_wait_ns"]) for r in got] == [
        ("web-1", "0000000000002000", 90_000), ("web-0", "0000000000001000", 5000),
        ("web-0", "0000000000001002", 777)]
    only = queries.slowest_gpu_stall_spans(populated, DB, pod="web-1", service="frontend")
    assert [r["gpu_sync_wait_ns"] for r in only] == [90_000, 10]


def test_sandbox_violations(populated):
    got = queries.sandbox_violations(populated, DB)
    assert got == [{
        "ts_ns": NOW + 3, "namespace": "prod", "pod": "pod-8", "container": "main",
        "pid": 200, "tid": 201, "cgroup_id": 8, "rule": "oversize", "action": "kill",
        "addr": 2**64 - 4096, "len": 1 << 20, "pool_id": 9, "pool_max_bytes": 1 << 30,
        "prot": 3, "fd": -1, "trace_id": "", "span_id": ""}]
    assert queries.sandbox_violations(populated, DB, pod="pod-8", namespace="prod",
                                      since_ns=NOW + 3) == got
    assert queries.sandbox_violations(populated, DB, pod="pod-7") == []
    assert queries.sandbox_violations(populated, DB, until_ns=NOW + 3) == []


# -- the embedded engine's configuration ------------------------------------

def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_engine_config_is_applied(tmp_path):
    b = ChdbBackend(str(tmp_path / "store"))
    try:
        assert b.query("SELECT value FROM system.merge_tree_settings "
                       "WHERE name = 'concurrent_part_removal_threshold'") == [("1000000000",)]
    finally:
        b.close()


def test_removing_many_outdated_parts_starts_no_thread_pool(tmp_path):
    b = ChdbBackend(str(tmp_path / "store"))
    try:
        b.query("CREATE DATABASE IF NOT EXISTS spanlet")
        b.query("CREATE TABLE spanlet.parts_test (a UInt64) ENGINE = MergeTree ORDER BY a")
        before = _threads()
        for i in range(300):                       # one part each; merges leave them outdated
            b.query(f"INSERT INTO spanlet.parts_test VALUES ({i})")

        def outdated():
            return b.query("SELECT count() FROM system.parts WHERE database = 'spanlet' "
                           "AND table = 'parts_test' AND NOT active")[0][0]

        most, seen, deadline = 0, 0, time.monotonic() + 75
        while time.monotonic() < deadline:
            most, n = max(most, _threads()), outdated()
            seen = max(seen, n)
            if seen > 100 and n == 0:
                break
            time.sleep(0.2)
        most = max(most, _threads())
        assert seen > 100 and outdated() == 0, seen   # over the threshold, then all removed
        assert most - before < 20, (before, most)      # without the setting: ~+125 threads
    finally:
        b.close()


_IDLE_WAKEUPS = r"""
import os, shutil, sys, tempfile, time
from spanlet.exporters.clickhouse.chdb_backend import ChdbBackend

def wakeups():
    n = 0
    for t in os.listdir("/proc/self/task"):
        try:
            if open(f"/proc/self/task/{t}/comm").read().strip() != "BgSchPool":
                continue
            for line in open(f"/proc/self/task/{t}/status"):
                if line.startswith("voluntary_ctxt_switches"):
                    n += int(line.split()[1])
        except OSError:
            pass
    return n

path = tempfile.mkdtemp(prefix="spanlet-idle-")
b = ChdbBackend(path)
b.ensure_schema()
time.sleep(2)                      # the tables' first background rounds
w0 = wakeups()
time.sleep(4)
print(wakeups() - w0)
b.close()
shutil.rmtree(path)
"""


def test_an_idle_store_s_table_tasks_sleep():
    """The embedded engine (a fresh process: it reads its configuration once)
    with every table made and nothing to do: the tables' background tasks wake
    the schedule pool a few times in 4 s, not about 1.5 times a second a table
    (the engine's defaults: ~50 for the schema's tables)."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _IDLE_WAKEUPS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) <= 12, out.stdout


_CODECS = r"""
import shutil, tempfile, time
from opentelemetry.proto.trace.v1 import trace_pb2
from spanlet.exporters.clickhouse import chdb_backend, rows, schema
from spanlet.exporters.clickhouse.chdb_backend import ChdbBackend
# the rule's threshold made 1 byte: every merged part is past it
chdb_backend._ENGINE_CONFIG = chdb_backend._ENGINE_CONFIG.replace(
    "<min_part_size>%(zstd)d<", "<min_part_size>1<")
path = tempfile.mkdtemp(prefix="spanlet-codecs-")
b = ChdbBackend(path)
try:
    b.ensure_schema()
    for n in range(2):
        rs = trace_pb2.ResourceSpans()
        rs.scope_spans.add().spans.add(name="x", trace_id=bytes([n + 1]) * 16, span_id=b"s" * 8,
                                       start_time_unix_nano=time.time_ns())
        b.insert("otel_traces", rows.SPAN_PROTO_COLUMNS, rows.span_proto_rows([rs]))
    print(sorted(r[0] for r in b.query("SELECT default_compression_codec FROM system.parts "
                                       "WHERE table = 'otel_traces' AND active")))
    b.query("OPTIMIZE TABLE spanlet.otel_traces FINAL")
    print(b.query("SELECT default_compression_codec FROM system.parts WHERE table = 'otel_traces' AND active"))
finally:
    b.close()
    shutil.rmtree(path)
"""


def test_otel_traces_parts_are_lz4_while_small_and_zstd_once_large(tmp_path):
    """Schema migration 7 and the engine's <compression> rule: otel_traces'
    columns have no codec but Timestamp's, so a part is LZ4 below
    schema.TRACES_ZSTD_PART_BYTES and ZSTD(1) from there (a fresh process
    with the threshold at 1 byte, as the engine reads its configuration
    once); the kernel_events and metric_samples columns keep theirs."""
    import subprocess
    import sys
    b = ChdbBackend(str(tmp_path / "store"))
    try:
        b.ensure_schema()
        codecs = dict(b.query("SELECT name, compression_codec FROM system.columns "
                              "WHERE database = 'spanlet' AND table = 'otel_traces'"))
        assert codecs.pop("Timestamp") == "CODEC(Delta(8), ZSTD(1))"
        assert set(codecs.values()) == {""} and len(codecs) == len(rows.TRACE_COLUMNS) - 1
        assert "ZSTD(1)" in dict(b.query("SELECT name, compression_codec FROM system.columns "
                                         "WHERE database = 'spanlet' AND table = 'metric_samples'"))["Labels"]
        _insert_spans(b, _enriched_spans())
        assert b.query("SELECT default_compression_codec FROM system.parts "
                       "WHERE table = 'otel_traces' AND active") == [("LZ4",)]
    finally:
        b.close()
    out = subprocess.run([sys.executable, "-c", _CODECS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["['LZ4', 'LZ4']", "[('ZSTD(1)',)]"], out.stdout


def test_the_spans_bloom_filters_are_built_at_a_parts_first_merge(backend):
    """The agent's span insert (the Native block) leaves the attribute maps'
    bloom-filter indexes (schema.TRACES_INSERT_DEFERRED_INDEXES) to the
    part's first merge: before it, a query for a key no span has reads every
    part; after it, the index skips the part. A query by attribute finds the
    same rows before and after."""
    indexes = dict(backend.query("SELECT name, type FROM system.data_skipping_indices "
                                 "WHERE database = 'spanlet' AND table = 'otel_traces'"))
    assert {indexes[n] for n in schema.TRACES_INSERT_DEFERRED_INDEXES} == {"bloom_filter"}
    for start in (0, 20):                    # two parts, merged into one below
        given = rows.span_proto_rows(store_load.resource_spans(start, 20))
        assert span_protos.native(given)[1] == []         # all through the Native block
        backend.insert(schema.TRACES, rows.SPAN_PROTO_COLUMNS, given)
    by_attribute = ("SELECT SpanId FROM spanlet.otel_traces WHERE SpanAttributes['http.method'] = 'POST' "
                    "AND ResourceAttributes['k8s.pod.name'] = 'web-0' ORDER BY SpanId")
    ids = [store_load.span_id_hex(n) for n in range(40)]

    def parts_read() -> str:
        plan = [r[0].strip("│└─ ") for r in backend.query(
            "EXPLAIN indexes = 1 SELECT count() FROM spanlet.otel_traces "
            "WHERE mapContains(SpanAttributes, 'no.such.key')")]
        return plan[plan.index("ReadFromMergeTree (spanlet.otel_traces)") + 2]
    assert [r[0] for r in backend.query(by_attribute)] == ids
    assert parts_read() == "Parts: 2 | Granules: 2"
    backend.query("OPTIMIZE TABLE spanlet.otel_traces FINAL")
    assert parts_read() == "Parts: 0 | Granules: 0"
    assert [r[0] for r in backend.query(by_attribute)] == ids
