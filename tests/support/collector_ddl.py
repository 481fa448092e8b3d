"""The OpenTelemetry Collector ClickHouse exporter's traces DDL in its stable
form (exporter/clickhouseexporter: traces_table.sql with `MergeTree` and
ORDER BY (ServiceName, SpanName, toDateTime(Timestamp)), its trace-id lookup
table and view), as it creates them when it reaches a store first; and the
SQL that Grafana's ClickHouse plugin (4.x, src/data/sqlGenerator.ts,
generateTraceIdQuery) generates for its OpenTelemetry trace view, with and
without the lookup table (as ClickHouse's observability guide, "View trace
details", prints it), and the Collector's documented queries."""

from __future__ import annotations


def traces_ddl(db: str, ttl_days: int = 7) -> list[str]:
    return [
        f"CREATE DATABASE IF NOT EXISTS {db}",
        f"""CREATE TABLE IF NOT EXISTS {db}.otel_traces (
    Timestamp DateTime64(9) CODEC(Delta, ZSTD(1)),
    TraceId String CODEC(ZSTD(1)),
    SpanId String CODEC(ZSTD(1)),
    ParentSpanId String CODEC(ZSTD(1)),
    TraceState String CODEC(ZSTD(1)),
    SpanName LowCardinality(String) CODEC(ZSTD(1)),
    SpanKind LowCardinality(String) CODEC(ZSTD(1)),
    ServiceName LowCardinality(String) CODEC(ZSTD(1)),
    ResourceAttributes Map(LowCardinality(String), String) CODEC(ZSTD(1)),
    ScopeName String CODEC(ZSTD(1)),
    ScopeVersion String CODEC(ZSTD(1)),
    SpanAttributes Map(LowCardinality(String), String) CODEC(ZSTD(1)),
    Duration UInt64 CODEC(ZSTD(1)),
    StatusCode LowCardinality(String) CODEC(ZSTD(1)),
    StatusMessage String CODEC(ZSTD(1)),
    Events Nested (
        Timestamp DateTime64(9),
        Name LowCardinality(String),
        Attributes Map(LowCardinality(String), String)
    ) CODEC(ZSTD(1)),
    Links Nested (
        TraceId String,
        SpanId String,
        TraceState String,
        Attributes Map(LowCardinality(String), String)
    ) CODEC(ZSTD(1)),
    INDEX idx_trace_id TraceId TYPE bloom_filter(0.001) GRANULARITY 1,
    INDEX idx_res_attr_key mapKeys(ResourceAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_res_attr_value mapValues(ResourceAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_span_attr_key mapKeys(SpanAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_span_attr_value mapValues(SpanAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_duration Duration TYPE minmax GRANULARITY 1
) ENGINE = MergeTree()
PARTITION BY toDate(Timestamp)
ORDER BY (ServiceName, SpanName, toDateTime(Timestamp))
TTL toDateTime(Timestamp) + toIntervalDay({ttl_days})
SETTINGS index_granularity = 8192, ttl_only_drop_parts = 1""",
        f"""CREATE TABLE IF NOT EXISTS {db}.otel_traces_trace_id_ts (
    TraceId String CODEC(ZSTD(1)),
    Start DateTime CODEC(Delta, ZSTD(1)),
    End DateTime CODEC(Delta, ZSTD(1)),
    INDEX idx_trace_id TraceId TYPE bloom_filter(0.01) GRANULARITY 1
) ENGINE = MergeTree()
PARTITION BY toDate(Start)
ORDER BY (TraceId, Start)
TTL toDateTime(Start) + toIntervalDay({ttl_days})
SETTINGS index_granularity = 8192, ttl_only_drop_parts = 1""",
        f"""CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.otel_traces_trace_id_ts_mv
TO {db}.otel_traces_trace_id_ts
AS SELECT
    TraceId,
    min(Timestamp) as Start,
    max(Timestamp) as End
FROM {db}.otel_traces
WHERE TraceId != ''
GROUP BY TraceId""",
    ]


_TRACE_VIEW_COLUMNS = (
    '"TraceId" as traceID, "SpanId" as spanID, "ParentSpanId" as parentSpanID, '
    '"ServiceName" as serviceName, "SpanName" as operationName, '
    '"Timestamp" as startTime, '
    'multiply("Duration", 0.000001) as duration, '
    "arrayMap(key -> map('key', key, 'value',\"SpanAttributes\"[key]), mapKeys(\"SpanAttributes\")) as tags, "
    "arrayMap(key -> map('key', key, 'value',\"ResourceAttributes\"[key]), mapKeys(\"ResourceAttributes\")) "
    "as serviceTags")


def plugin_trace_id_sql(db: str, trace_id: str, lookup: bool) -> str:
    """generateTraceIdQuery with the OTel column defaults: with `lookup`, the
    form it builds once the data source has otelEnabled and an otelVersion
    (the trace's time range from otel_traces_trace_id_ts), else the fallback."""
    table = f'"{db}"."otel_traces"'
    if lookup:
        ts = f'"{db}"."otel_traces_trace_id_ts"'
        return (f"WITH '{trace_id}' as trace_id, "
                f"(SELECT min(Start) FROM {ts} WHERE TraceId = trace_id) as trace_start, "
                f"(SELECT max(End) + 1 FROM {ts} WHERE TraceId = trace_id) as trace_end "
                f"SELECT {_TRACE_VIEW_COLUMNS} FROM {table} WHERE traceID = trace_id AND "
                f"startTime >= trace_start AND startTime <= trace_end ORDER BY startTime ASC LIMIT 1000")
    return (f"SELECT {_TRACE_VIEW_COLUMNS} FROM {table} WHERE traceID = '{trace_id}' "
            f"ORDER BY startTime ASC LIMIT 1000")


def collector_documented_queries(db: str, trace_id: str, service: str) -> dict[str, str]:
    """The exporter README's example queries, and the service dashboards'
    filters on the Collector's spellings."""
    return {
        "trace by id (lookup)": (
            f"WITH '{trace_id}' as trace_id, "
            f"(SELECT min(Start) FROM {db}.otel_traces_trace_id_ts WHERE TraceId = trace_id) as start, "
            f"(SELECT max(End) + 1 FROM {db}.otel_traces_trace_id_ts WHERE TraceId = trace_id) as end "
            "SELECT Timestamp as log_time, TraceId, SpanId, ParentSpanId, SpanName, SpanKind, ServiceName, "
            "Duration, StatusCode, StatusMessage, toString(SpanAttributes), toString(ResourceAttributes), "
            f"toString(Events.Name), toString(Links.TraceId) FROM {db}.otel_traces "
            "WHERE TraceId = trace_id AND Timestamp >= start AND Timestamp <= end Limit 100"),
        "server spans of a service": (
            f"SELECT count() FROM {db}.otel_traces WHERE ServiceName = '{service}' AND SpanKind = 'Server'"),
        "errors of a service": (
            f"SELECT count() FROM {db}.otel_traces WHERE ServiceName = '{service}' AND StatusCode = 'Error'"),
    }
