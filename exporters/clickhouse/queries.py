"""The queries that dashboards and `spanlet inspect` run on the store: each a
SQL builder (text only, every value quoted as a literal) and a function that
runs it on a Backend and returns dicts. Timestamps come back as int epoch ns
(toUnixTimestamp64Nano), the same from either backend."""

from __future__ import annotations

from typing import Sequence

from spanlet.exporters.clickhouse import Backend
from spanlet.exporters.clickhouse.schema import (
    KERNEL_EVENTS,
    TRACES,
    check_identifier,
    quote_string,
)

# Every read is deduplicated: the FINAL modifier on tables whose engine has one
# (spanlet's ReplacingMergeTree), nothing on one that has none (a table the
# OpenTelemetry Collector made, plain MergeTree), where FINAL would fail.
FINAL_READ = "SETTINGS final = 1"

POD_ATTRIBUTE = "k8s.pod.name"
NAMESPACE_ATTRIBUTE = "k8s.namespace.name"
GPU_STALL_ATTRIBUTE = "kernel.gpu.sync_wait_ns"


def _ns(value: int) -> str:
    return f"fromUnixTimestamp64Nano(toInt64({int(value)}))"


def _limit(n: int) -> int:
    n = int(n)
    if n < 1:
        raise ValueError("limit must be >= 1")
    return n


def _time_window(since_ns: int | None, until_ns: int | None) -> list[str]:
    where = []
    if since_ns is not None:
        where.append(f"Timestamp >= {_ns(since_ns)}")
    if until_ns is not None:
        where.append(f"Timestamp < {_ns(until_ns)}")
    return where


def _equal(pairs: Sequence[tuple[str, str | None]]) -> list[str]:
    """`column = 'value'` for each (column, value) whose value was given."""
    return [f"{column} = {quote_string(value)}" for column, value in pairs if value is not None]


def _select(database: str, table: str, columns: str, where: list[str],
            window: tuple[int | None, int | None], order_by: str, limit: int) -> str:
    """SELECT the timestamp (epoch ns, the first field of every query) and `columns`
    from the deduplicated table (FINAL where the table's engine has it), within
    the time window, limited."""
    check_identifier(database, "database name")
    where = where + _time_window(*window)
    return (f"SELECT toUnixTimestamp64Nano(Timestamp), {columns}\n"
            f"FROM {database}.{table}\n"
            f"WHERE {' AND '.join(where)}\n"
            f"ORDER BY {order_by}\nLIMIT {_limit(limit)}\n{FINAL_READ}")


def _run(backend: Backend, built: tuple[str, Sequence[str]]) -> list[dict]:
    sql, names = built
    return [dict(zip(names, row)) for row in backend.query(sql)]


# ---------------------------------------------------------------------------

SPAN_FIELDS = ("ts_ns", "trace_id", "span_id", "parent_span_id", "service", "name",
               "duration_ns", "status", "kernel")


def recent_pod_spans_sql(database: str, pod: str, namespace: str | None = None, *,
                         since_ns: int | None = None, until_ns: int | None = None,
                         limit: int = 100) -> tuple[str, tuple[str, ...]]:
    """The pod's most recent spans, newest first, with their kernel.* facts
    (a Map of the kernel.* SpanAttributes)."""
    where = _equal([(f"ResourceAttributes[{quote_string(POD_ATTRIBUTE)}]", pod),
                    (f"ResourceAttributes[{quote_string(NAMESPACE_ATTRIBUTE)}]", namespace)])
    columns = ("TraceId, SpanId, ParentSpanId, ServiceName, SpanName, Duration, StatusCode, "
               "mapFilter((k, v) -> startsWith(k, 'kernel.'), SpanAttributes)")
    return _select(database, TRACES, columns, where, (since_ns, until_ns),
                   "Timestamp DESC, SpanId", limit), SPAN_FIELDS


def recent_pod_spans(backend: Backend, database: str, pod: str, namespace: str | None = None,
                     **kw) -> list[dict]:
    return _run(backend, recent_pod_spans_sql(database, pod, namespace, **kw))


# ---------------------------------------------------------------------------

STALL_FIELDS = ("ts_ns", "trace_id", "span_id", "service", "name", "duration_ns",
                "gpu_sync_wait_ns", "pod")


def slowest_gpu_stall_spans_sql(database: str, *, service: str | None = None,
                                pod: str | None = None, since_ns: int | None = None,
                                until_ns: int | None = None,
                                limit: int = 20) -> tuple[str, tuple[str, ...]]:
    """Spans with the longest GPU synchronisation wait (kernel.gpu.sync_wait_ns),
    longest first."""
    stall = f"toUInt64OrZero(SpanAttributes[{quote_string(GPU_STALL_ATTRIBUTE)}])"
    pod_column = f"ResourceAttributes[{quote_string(POD_ATTRIBUTE)}]"
    where = [f"{stall} > 0", *_equal([("ServiceName", service), (pod_column, pod)])]
    columns = f"TraceId, SpanId, ServiceName, SpanName, Duration, {stall} AS stall, {pod_column}"
    return _select(database, TRACES, columns, where, (since_ns, until_ns),
                   "stall DESC, Timestamp DESC, SpanId", limit), STALL_FIELDS


def slowest_gpu_stall_spans(backend: Backend, database: str, **kw) -> list[dict]:
    return _run(backend, slowest_gpu_stall_spans_sql(database, **kw))


# ---------------------------------------------------------------------------

VIOLATION_FIELDS = ("ts_ns", "namespace", "pod", "container", "pid", "tid", "cgroup_id",
                    "rule", "action", "addr", "len", "pool_id", "pool_max_bytes", "prot",
                    "fd", "trace_id", "span_id")


def sandbox_violations_sql(database: str, *, pod: str | None = None,
                           namespace: str | None = None, since_ns: int | None = None,
                           until_ns: int | None = None,
                           limit: int = 100) -> tuple[str, tuple[str, ...]]:
    """Sandbox violations, newest first."""
    where = ["Kind = 'SANDBOX'", *_equal([("K8sPodName", pod), ("K8sNamespace", namespace)])]
    columns = ("K8sNamespace, K8sPodName, K8sContainerName, Pid, Tid, CgroupId, Rule, Action, "
               "Addr, Len, PoolId, PoolMaxBytes, Prot, Fd, TraceId, SpanId")
    return _select(database, KERNEL_EVENTS, columns, where, (since_ns, until_ns),
                   "Timestamp DESC, Tid", limit), VIOLATION_FIELDS


def sandbox_violations(backend: Backend, database: str, **kw) -> list[dict]:
    return _run(backend, sandbox_violations_sql(database, **kw))
