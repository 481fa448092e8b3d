"""The store path: spans, kernel events and metric samples written to
ClickHouse (embedded chdb by default) through the one sink."""

from __future__ import annotations

import logging
import time
from collections import deque
from pathlib import Path

from spanlet import events
from spanlet.config import Config
from spanlet.k8s import K8sEnricher

log = logging.getLogger("spanlet")


class StorePath:
    """Spans, kernel events and metric samples into ClickHouse (embedded chdb
    by default) through one sink: batched, retried, spooled to disk."""

    def __init__(self, cfg: Config, enricher: K8sEnricher):
        self.cfg = cfg
        self.enricher = enricher
        self.sink = None
        self._engine = None          # the embedded backend (chdb), for its engine's stats
        # decoded events wait here (reader threads append) until the next refresh
        self._events: deque = deque(maxlen=cfg.store.queue_rows)
        self.events_overflow = 0

    def start(self) -> None:
        from spanlet.exporters.clickhouse import rows
        from spanlet.exporters.clickhouse.sink import ClickHouseSink

        st, data = self.cfg.store, Path(self.cfg.data_dir)
        self.rows = rows
        try:
            if st.backend == "chdb":
                from spanlet.exporters.clickhouse.chdb_backend import ChdbBackend
                (data / "chdb").mkdir(parents=True, exist_ok=True)
                backend = ChdbBackend(str(data / "chdb"), database=st.database, ttl_days=st.ttl_days,
                                      own_process=st.engine_process, memory_mb=st.engine_memory_mb,
                                      statement_timeout_s=st.engine_timeout_s)
                where = f"embedded chdb in {data / 'chdb'}" + (
                    f" (engine process {backend.engine.pid})" if backend.engine is not None else "")
                self._engine = backend
            else:
                from spanlet.exporters.clickhouse.http_backend import HttpBackend
                backend = HttpBackend(st.url, database=st.database, user=st.user or None,
                                      password_file=st.password_file or None,
                                      ca_file=st.ca_file or None, ttl_days=st.ttl_days,
                                      cluster=st.cluster or None)
                where = f"ClickHouse at {st.url}" + (f" (cluster {st.cluster})" if st.cluster else "")
            self.sink = ClickHouseSink(backend, batch_rows=st.batch_rows,
                                       batch_interval_s=st.batch_interval_s, queue_rows=st.queue_rows,
                                       spool_dir=data / "spool", spool_max_bytes=st.spool_max_bytes)
        except Exception as e:  # the store is one consumer: the agent runs without it
            log.error("store NOT started: %s", e)
            return
        log.info("store: %s, database %s", where, st.database)

    def stats(self) -> dict | None:
        """The sink's queue, spool and drops, and the engine process's memory
        and restarts where it has one; None while there is no sink."""
        if self.sink is None:
            return None
        out = self.sink.stats()
        engine = self._engine.engine_stats() if self._engine is not None else None
        if engine is not None:
            out["engine_rss_bytes"], out["engine_restarts"] = engine["rss_bytes"], engine["restarts"]
        return out

    def release_memory(self) -> int:
        """What the engine process's start left resident, given back (the agent's
        own: daemon.py); the bytes of mappings paged out."""
        if self._engine is not None:
            try:
                return self._engine.release_engine_memory()
            except Exception as e:     # noqa: BLE001 - only memory left resident
                log.warning("store engine: start-up memory not given back: %s", e)
        return 0

    def _resolve(self, cgroup_id: int) -> tuple[str, str, str]:
        a = self.enricher.attributes(cgroup_id) if cgroup_id else {}
        return (a.get("k8s.namespace.name", ""), a.get("k8s.pod.name", ""),
                a.get("k8s.container.name", ""))

    def add_event(self, ev: events._Event) -> None:
        if self.sink is not None:
            if len(self._events) == self._events.maxlen:
                self.events_overflow += 1
            self._events.append(ev)

    def add_spans(self, resource_spans, blobs=None) -> None:
        """`blobs`: the join's bytes of each resource's spans (SpanJoin.join), or None."""
        if self.sink is not None:
            self.sink.write("otel_traces", self.rows.SPAN_PROTO_COLUMNS,
                            self.rows.span_proto_rows(resource_spans, blobs))

    def add_metrics(self, families) -> None:
        if self.sink is not None:
            self.sink.write("metric_samples", self.rows.METRIC_SERIES_COLUMNS,
                            self.rows.metric_series_rows(families, time.time_ns()))

    def tick(self) -> None:
        if self.sink is None or not self._events:
            return
        batch = []
        while self._events:
            batch.append(self._events.popleft())
        self.sink.write("kernel_events", self.rows.KERNEL_RECORD_COLUMNS,
                        self.rows.kernel_record_rows(batch, self._resolve, self.cfg.node_name))

    def stop(self, deadline: float) -> None:
        if self.sink is not None:
            self.tick()
            self.sink.shutdown(max(0.1, deadline - time.monotonic()))
