-- The embedded store's schema at version 4, as commit 18293dd7cf82 (2026-12-01) first shipped it:
-- every statement that version's code ran on a fresh store, in order, one per ';;' separator.
-- Generated once and never edited (the migration tests start from it).
CREATE DATABASE IF NOT EXISTS spanlet
;;
CREATE TABLE IF NOT EXISTS spanlet.schema_version
(
    Version UInt32,
    Description String,
    AppliedAt DateTime64(3) DEFAULT now64(3)
) ENGINE = ReplacingMergeTree()
ORDER BY Version
;;
CREATE TABLE IF NOT EXISTS spanlet.otel_traces
(
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
    INDEX idx_res_attr_key mapKeys(ResourceAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_res_attr_value mapValues(ResourceAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_span_attr_key mapKeys(SpanAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_span_attr_value mapValues(SpanAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_duration Duration TYPE minmax GRANULARITY 1,
    INDEX idx_timestamp Timestamp TYPE minmax GRANULARITY 1,
    INDEX idx_service ServiceName TYPE set(0) GRANULARITY 1
) ENGINE = ReplacingMergeTree()
PARTITION BY toDate(Timestamp)
ORDER BY (TraceId, SpanId)
TTL toDateTime(Timestamp) + toIntervalDay(7)
SETTINGS index_granularity = 8192, ttl_only_drop_parts = 1
;;
CREATE TABLE IF NOT EXISTS spanlet.kernel_events
(
    Timestamp DateTime64(9) CODEC(Delta, ZSTD(1)),
    Kind LowCardinality(String),
    Pid UInt32,
    Tid UInt32,
    CgroupId UInt64,
    TraceId String CODEC(ZSTD(1)),
    SpanId String CODEC(ZSTD(1)),
    Modality LowCardinality(String),
    HeaderFlags UInt8,
    K8sNamespace LowCardinality(String),
    K8sPodName LowCardinality(String),
    K8sContainerName LowCardinality(String),
    Api LowCardinality(String),
    Entry LowCardinality(String),
    Func UInt64,
    Stream UInt64,
    DurationNs UInt64,
    Grid Array(UInt32),
    Block Array(UInt32),
    SharedMem UInt32,
    Rule LowCardinality(String),
    Action LowCardinality(String),
    Addr UInt64,
    Len UInt64,
    PoolMaxBytes UInt64,
    Prot UInt32,
    MapFlags UInt32,
    PoolId UInt32,
    Fd Int32,
    SrcAddr String,
    DstAddr String,
    SrcPort UInt16,
    DstPort UInt16,
    L4Proto UInt8,
    Ifindex UInt32,
    Direction LowCardinality(String),
    ProtoClass LowCardinality(String),
    Method UInt8,
    PathHash UInt32,
    TraceFlags UInt8,
    RequestBytes UInt64,
    ResponseBytes UInt64,
    INDEX idx_trace_id TraceId TYPE bloom_filter(0.001) GRANULARITY 1,
    INDEX idx_timestamp Timestamp TYPE minmax GRANULARITY 1
) ENGINE = ReplacingMergeTree()
PARTITION BY toDate(Timestamp)
ORDER BY (Kind, CgroupId, Timestamp, Pid, Tid, SrcAddr, SrcPort, DstAddr, DstPort)
TTL toDateTime(Timestamp) + toIntervalDay(7)
SETTINGS index_granularity = 8192, ttl_only_drop_parts = 1
;;
CREATE TABLE IF NOT EXISTS spanlet.metric_samples
(
    Timestamp DateTime64(9) CODEC(Delta, ZSTD(1)),
    MetricName LowCardinality(String),
    MetricType LowCardinality(String),
    Unit LowCardinality(String),
    Labels Map(LowCardinality(String), String) CODEC(ZSTD(1)),
    LabelsHash UInt64 MATERIALIZED cityHash64(mapKeys(Labels), mapValues(Labels)),
    Value Float64 CODEC(ZSTD(1)),
    Count UInt64,
    Sum Float64,
    Bounds Array(Float64) CODEC(ZSTD(1)),
    BucketCounts Array(UInt64) CODEC(ZSTD(1))
) ENGINE = ReplacingMergeTree()
PARTITION BY toDate(Timestamp)
ORDER BY (MetricName, LabelsHash, Timestamp)
TTL toDateTime(Timestamp) + toIntervalDay(7)
SETTINGS index_granularity = 8192, ttl_only_drop_parts = 1
;;
INSERT INTO spanlet.schema_version (Version, Description) VALUES (1, 'initial: otel_traces, kernel_events, metric_samples')
;;
ALTER TABLE spanlet.kernel_events ADD COLUMN IF NOT EXISTS Node LowCardinality(String) DEFAULT ''
;;
INSERT INTO spanlet.schema_version (Version, Description) VALUES (2, 'kernel_events.Node')
;;
ALTER TABLE spanlet.otel_traces MODIFY SETTING non_replicated_deduplication_window = 1000
;;
ALTER TABLE spanlet.kernel_events MODIFY SETTING non_replicated_deduplication_window = 1000
;;
ALTER TABLE spanlet.metric_samples MODIFY SETTING non_replicated_deduplication_window = 1000
;;
INSERT INTO spanlet.schema_version (Version, Description) VALUES (3, 'insert deduplication on single-server tables')
;;
ALTER TABLE spanlet.otel_traces UPDATE SpanKind = transform(SpanKind, ['SPAN_KIND_UNSPECIFIED', 'SPAN_KIND_INTERNAL', 'SPAN_KIND_SERVER', 'SPAN_KIND_CLIENT', 'SPAN_KIND_PRODUCER', 'SPAN_KIND_CONSUMER'], ['Unspecified', 'Internal', 'Server', 'Client', 'Producer', 'Consumer'], SpanKind), StatusCode = transform(StatusCode, ['STATUS_CODE_UNSET', 'STATUS_CODE_OK', 'STATUS_CODE_ERROR'], ['Unset', 'Ok', 'Error'], StatusCode) WHERE SpanKind IN ('SPAN_KIND_UNSPECIFIED', 'SPAN_KIND_INTERNAL', 'SPAN_KIND_SERVER', 'SPAN_KIND_CLIENT', 'SPAN_KIND_PRODUCER', 'SPAN_KIND_CONSUMER') OR StatusCode IN ('STATUS_CODE_UNSET', 'STATUS_CODE_OK', 'STATUS_CODE_ERROR') SETTINGS mutations_sync = 2
;;
INSERT INTO spanlet.schema_version (Version, Description) VALUES (4, 'SpanKind and StatusCode as the OpenTelemetry Collector spells them')
