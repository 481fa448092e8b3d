"""The running agent's admin API for `spanlet inspect`: a Unix socket (mode 0600,
root only), one JSON request and one JSON answer per connection, served by one
thread; plus the small bounded rings (recent violations, recently joined spans,
launch counts per process) that the kernel maps alone cannot answer."""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import tempfile
import threading
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any, Callable

from spanlet import events, runtimes
from spanlet.config import Config, redact
from spanlet.memory import MemoryReport
from spanlet.metrics import Family, catalogue
from spanlet.metrics.engine import CgroupNames, JoinStats, NvmlSource, ProbeSources, Stats, StoreStats

log = logging.getLogger("spanlet.admin")

PROTOCOL = 1                    # bumped when an answer's fields change incompatibly
MAX_REQUEST = 64 * 1024
RING_VIOLATIONS = 256
RING_SPANS = 512
MAX_PIDS = 4096                 # processes whose launches are counted from events
RATE_WINDOW_S = 10.0


def _stat(m: catalogue.Metric) -> str:
    """How a value is read now: gauge_max / gauge_min, the largest / smallest
    sample (smallest where low is bad); pNN, that quantile of the cumulative
    (since start) histogram; total, the counter's sum."""
    quantile = next((t.quantile for t in m.thresholds if t.quantile), None)
    if quantile is not None:
        return f"p{round(quantile * 100)}"
    if m.type == "counter":
        return "total"
    return "gauge_min" if any(t.op == "<" for t in m.thresholds) else "gauge_max"


def _readable(m: catalogue.Metric) -> tuple[str, dict[str, float]]:
    """The comparison and the defaults one reading can be held against: those
    with an alert rule that is not on a rate (#15's is, over 5m). Keyed "" or,
    where the rules differ by a label, "label=value"."""
    mine = [t for t in m.thresholds if t.alert and not t.rate]
    return (mine[0].op if mine else "",
            {(f"slo_class={t.slo_class}" if t.slo_class else ""): float(t.value) for t in mine})


# Per metric of METRICS.md, from the catalogue: (metric, how the value now is
# read, comparison, thresholds); tests/unit/test_inspect_render.py checks them
# against daemonset/prometheus-rules.yaml.
THRESHOLDS: list[tuple[str, str, str, dict[str, float]]] = [
    (m.name, _stat(m), *_readable(m)) for m in catalogue.SERVING_METRICS]

_RULES = {r.value: r.name for r in events.Rule}
_ACTIONS = {a.value: a.name for a in events.Action}


def quantile(q: float, bounds, bucket_counts) -> float | None:
    """Prometheus-style histogram_quantile over non-cumulative buckets
    (the last bucket is +Inf): linear within the bucket."""
    total = sum(bucket_counts)
    if not total:
        return None
    rank, seen, lower = q * total, 0, 0.0
    for i, n in enumerate(bucket_counts):
        if i >= len(bounds):           # in +Inf: the largest finite bound
            return bounds[-1] if bounds else None
        if seen + n >= rank and n:
            return lower + (bounds[i] - lower) * (rank - seen) / n
        seen += n
        lower = bounds[i]
    return bounds[-1] if bounds else None


def _read(how: str, samples) -> float | None:
    if not samples:
        return None
    if how == "total":
        return float(sum(s.value for s in samples))
    if how == "gauge_max":
        return max(s.value for s in samples)
    if how == "gauge_min":
        return min(s.value for s in samples)
    bounds = samples[0].bounds
    buckets = [0] * (len(bounds) + 1)
    for s in samples:
        if s.bounds == bounds:
            buckets = [a + b for a, b in zip(buckets, s.bucket_counts)]
    return quantile(int(how[1:]) / 100, bounds, buckets)


def metric_rows(families) -> list[dict]:
    """The 17 metrics now against their thresholds: one row each; where the
    threshold depends on a label, `by` has one entry per value and the row
    shows the first breaching one (else the first with a value)."""
    by_name = {f.name: f for f in families}
    rows = []
    for name, how, op, thresholds in THRESHOLDS:
        fam = by_name.get(name)
        samples = list(fam.samples) if fam else []
        by = []
        for where, threshold in (thresholds or {"": None}).items():
            k, _, v = where.partition("=")
            mine = [s for s in samples if not k or dict(s.labels).get(k) == v]
            value = _read(how, mine)
            breach = value is not None and threshold is not None and \
                (value > threshold if op == ">" else value < threshold)
            by.append({"where": where, "value": value, "threshold": threshold,
                       "breach": breach, "series": len(mine)})
        shown = next((b for b in by if b["breach"]), None) or \
            next((b for b in by if b["value"] is not None), by[0])
        rows.append({"metric": name, "stat": how, "op": op, "value": shown["value"],
                     "threshold": shown["threshold"], "where": shown["where"],
                     "breach": any(b["breach"] for b in by), "series": len(samples),
                     "by": by if len(by) > 1 else []})
    return rows


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _any_value(v) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind in ("string_value", "int_value", "double_value",
                                        "bool_value") else None


def _span_row(s, received_unix_ns: int, resources: dict, resource) -> dict:
    """A recent span as inspect shows it (`resources`: a cache by resource)."""
    res = resources.get(id(resource))
    if res is None:
        res = resources[id(resource)] = {kv.key: _any_value(kv.value) for kv in resource.attributes}
    attrs = {kv.key: _any_value(kv.value) for kv in s.attributes if kv.key.startswith("kernel.")}
    return {"trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
            "name": s.name, "service": res.get("service.name") or "",
            "namespace": res.get("k8s.namespace.name") or "",
            "pod": res.get("k8s.pod.name") or "",
            "start_unix_ns": s.start_time_unix_nano,
            "duration_s": max(0, s.end_time_unix_nano - s.start_time_unix_nano) / 1e9,
            "received_unix_ns": received_unix_ns,
            "gpu_launches": attrs.get("kernel.gpu.launches", 0),
            "gpu_sync_wait_s": attrs.get("kernel.gpu.sync_wait_ns", 0) / 1e9,
            "rx_bytes": attrs.get("kernel.net.rx_bytes", 0),
            "tx_bytes": attrs.get("kernel.net.tx_bytes", 0),
            "violations": attrs.get("kernel.sandbox.violations", 0),
            # request anatomy (sched.enabled): where its threads' time went
            "cpu_s": attrs.get("kernel.sched.cpu_ns", 0) / 1e9,
            "runqueue_s": attrs.get("kernel.sched.runqueue_ns", 0) / 1e9,
            "blocked_s": attrs.get("kernel.sched.blocked_ns", 0) / 1e9,
            # and the GPU memory traffic: bytes copied to and from the device
            "memcpy_h2d_bytes": attrs.get("kernel.gpu.memcpy_h2d_bytes", 0),
            "memcpy_d2h_bytes": attrs.get("kernel.gpu.memcpy_d2h_bytes", 0),
            # batched steps: a step's links to its requests; a request's steps and shares
            "links": len(s.links),
            "batch_steps": attrs.get("kernel.batch.steps", 0),
            "batch_gpu_launches": attrs.get("kernel.batch.gpu.launches", 0.0),
            "batch_gpu_graph_launches": attrs.get("kernel.batch.gpu.graph_launches", 0.0),
            "batch_gpu_sync_wait_s": attrs.get("kernel.batch.gpu.sync_wait_ns", 0.0) / 1e9}


class AdminState:
    """What inspect needs beyond the daemon's own readers, fed by the daemon's
    event sink and by the span path; every collection is bounded."""

    def __init__(self):
        self._lock = threading.Lock()
        self.violations: deque = deque(maxlen=RING_VIOLATIONS)
        # the newest RING_SPANS spans, kept as the containers they came in:
        # (resource, its scope's spans, when they came); _chunked spans in all
        self._chunks: deque = deque()
        self._chunked = 0
        self.launches_by_pid: Counter = Counter()
        self.launch_pids_dropped = 0

    def on_event(self, ev: events._Event) -> None:
        kind = ev.hdr.kind
        if kind == events.Kind.SANDBOX:
            with self._lock:
                self.violations.append(ev)
        elif kind == events.Kind.GPU_LAUNCH:
            pid = ev.hdr.pid
            with self._lock:
                if pid in self.launches_by_pid or len(self.launches_by_pid) < MAX_PIDS:
                    self.launches_by_pid[pid] += 1
                else:
                    self.launch_pids_dropped += 1

    def on_joined(self, resource_spans) -> None:
        """Keeps the last RING_SPANS spans as they are (with their resource
        and when they came): a reference to each scope's list of spans,
        nothing per span; rows are built only when inspect asks."""
        now = time.time_ns()
        with self._lock:
            chunks = self._chunks
            for rs in resource_spans:
                for ss in rs.scope_spans:
                    n = len(ss.spans)
                    if n:
                        chunks.append((rs.resource, ss.spans, now))
                        self._chunked += n
            # the oldest lists the newest RING_SPANS spans no longer reach
            while chunks and self._chunked - len(chunks[0][1]) >= RING_SPANS:
                self._chunked -= len(chunks.popleft()[1])

    @property
    def spans(self) -> list:
        """(resource, span, received ns) of the newest RING_SPANS spans, oldest first."""
        with self._lock:
            kept = [(res, s, now) for res, spans, now in self._chunks for s in spans]
        return kept[-RING_SPANS:]

    def snapshot(self):
        spans = self.spans
        with self._lock:
            violations, by_pid = list(self.violations), Counter(self.launches_by_pid)
        resources: dict[int, dict] = {}
        return violations, [_span_row(s, now, resources, res) for res, s, now in spans], by_pid


class AdminServer:
    """Serves the agent's state on cfg.admin_socket from the parts the daemon
    hands it (the metric engine's sources, the families and the hints); start()
    and stop() are called by the daemon, stop() is safe twice."""

    def __init__(self, cfg: Config, *, probes: ProbeSources, names: CgroupNames, join: JoinStats,
                 receiver: Stats, span_export: Stats, store: StoreStats | None, nvml: NvmlSource,
                 memory_peaks: Callable[[], dict[str, float]],
                 families: Callable[[], list[Family]], hints: Callable[[], dict],
                 path: str | None = None):
        self.cfg, self.probes, self.names, self.join = cfg, probes, names, join
        self.receiver, self.span_export, self.store = receiver, span_export, store
        self.nvml, self.memory_peaks = nvml, memory_peaks
        self.families, self.hints_source = families, hints
        self.path = Path(path or cfg.admin_socket)
        self.state = AdminState()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._made_dir = False               # removed at stop when empty
        self._started = time.monotonic()
        self._history: deque = deque()     # (monotonic, {probe: (read, dropped)})
        self._secrets = cfg.secrets()
        self.handlers: dict[str, Callable[[dict], dict]] = {
            "summary": self.summary, "spans": self.spans, "flows": self.flows,
            "sandbox": self.sandbox, "gpu": self.gpu, "hints": self.hints, "memory": self.memory}
        self._memory = MemoryReport()

    # -- life cycle ------------------------------------------------------------
    def start(self) -> None:
        try:
            self._sock = self._bind()
        except OSError as e:
            log.error("admin socket %s NOT open: %s; `spanlet inspect` will not work", self.path, e)
            return
        self._thread = threading.Thread(target=self._serve, name="admin", daemon=True)
        self._thread.start()
        log.info("admin socket on %s", self.path)

    def _bind(self) -> socket.socket:
        if not self.path.parent.exists():
            self.path.parent.mkdir(parents=True, mode=0o755)
            self._made_dir = True
        if self.path.exists() or self.path.is_symlink():
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.settimeout(1.0)
                probe.connect(str(self.path))
            except OSError:
                self.path.unlink()           # left by an agent that died
            else:
                raise OSError(f"another agent answers on {self.path}")
            finally:
                probe.close()
        # bound in a private (0700, unpredictable) directory, made 0600, then
        # renamed: the final path is never reachable with a looser mode, and
        # nobody can swap the file between bind and chmod
        private = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.", dir=self.path.parent))
        tmp = private / "s"
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind(str(tmp))
            os.chmod(tmp, 0o600)
            os.rename(tmp, self.path)
            s.listen(16)       # accept() waits for a client: stop() wakes it itself
        except OSError:
            s.close()
            tmp.unlink(missing_ok=True)
            raise
        finally:
            private.rmdir()
        return s

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            try:                      # wake accept(): a connection the loop drops
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as wake:
                    wake.settimeout(1.0)
                    wake.connect(str(self.path))
            except OSError:
                pass
            self._thread.join(timeout=2.0)
            self._thread = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            try:
                self.path.unlink()
                if self._made_dir:
                    self.path.parent.rmdir()
            except OSError:
                pass

    def on_event(self, ev: events._Event) -> None:
        self.state.on_event(ev)

    def on_joined(self, resource_spans) -> None:
        """The span path's joined spans, for the recent-spans ring."""
        try:
            self.state.on_joined(resource_spans)
        except Exception:
            log.exception("admin: recording joined spans failed")

    # -- serving ---------------------------------------------------------------
    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.1)
                continue
            if self._stop.is_set():
                conn.close()
                return
            try:
                self._answer(conn)
            except Exception:
                log.exception("admin: answering a request failed")
            finally:
                conn.close()

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(5.0)
        pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        buf = b""
        while b"\n" not in buf and len(buf) < MAX_REQUEST:
            chunk = conn.recv(4096)
            if not chunk:
                break
            buf += chunk
        # The file mode already says so; this holds even if someone loosens it.
        # (Answered after the request is read: closing on unread bytes would
        # reset the connection, and the client would never see why.)
        if uid not in (0, os.geteuid()):
            log.warning("admin: refused a request from uid %d (pid %d): root only", uid, pid)
            conn.sendall(json.dumps({"ok": False, "error": "permission denied"}).encode())
            return
        try:
            req = json.loads(buf.split(b"\n", 1)[0] or b"{}")
            op = req.get("op", "summary")
            handler = self.handlers[op]
            answer = {"ok": True, "protocol": PROTOCOL, "op": op,
                      "node": self.cfg.node_name, "time_unix_ns": time.time_ns(),
                      "data": handler(req.get("args") or {})}
        except (ValueError, KeyError, AttributeError, TypeError) as e:
            answer = {"ok": False, "protocol": PROTOCOL, "error": f"bad request: {e!r}"}
        except Exception as e:
            log.exception("admin: %s failed", buf[:200])
            answer = {"ok": False, "protocol": PROTOCOL, "error": f"{type(e).__name__}: {e}"}
        if self._secrets:
            answer = _redacted(json.loads(json.dumps(answer, default=str)), self._secrets)
        conn.sendall(json.dumps(answer, default=str).encode() + b"\n")

    def sample(self) -> None:
        """One point of the read/drop history the rates come from: the agent's
        refresh loop calls this each second (and every answer first), so
        that the admin thread sleeps until a client comes."""
        now = time.monotonic()
        if self._history and now - self._history[-1][0] < 0.9:
            return
        counts = {p.name: (p.events_read, p.events_dropped())
                  for p in self.probes if p.status.attached}
        self._history.append((now, counts))
        while len(self._history) > 2 and self._history[1][0] <= now - RATE_WINDOW_S:
            self._history.popleft()

    def _pod(self, cgroup_id: int) -> dict:
        if not cgroup_id:
            return {"namespace": "", "pod": "", "container": ""}
        a = self.names.attributes(cgroup_id)
        return {"namespace": a.get("k8s.namespace.name", ""), "pod": a.get("k8s.pod.name", ""),
                "container": a.get("k8s.container.name", "")}

    # -- answers ---------------------------------------------------------------
    def summary(self, args: dict) -> dict:
        self.sample()
        now = time.monotonic()
        t0, first = self._history[0] if self._history else (self._started, {})
        probes = []
        for p in self.probes:
            st = p.status
            read = p.events_read if st.attached else 0
            dropped = p.events_dropped() if st.attached else 0
            dt = now - t0
            r0, d0 = first.get(p.name, (0, 0))
            probes.append({
                "name": p.name, "attached": bool(st.attached), "reason": st.reason or "",
                "attachments": len(st.attachments),
                "failed_attachments": list(st.failed_attachments),
                "events_read": read, "events_dropped": dropped,
                "decode_errors": getattr(p, "decode_errors", 0),
                "events_per_s": (read - r0) / dt if dt > 0.5 else None,
                "drops_per_s": (dropped - d0) / dt if dt > 0.5 else None})
        span_cov, event_cov = self.join.coverage()
        nv = self.nvml.status
        exporters = [{"name": "otlp_receiver", "enabled": True, "stats": self.receiver.stats()},
                     {"name": "otlp_span_export", **_export_health(self.span_export.stats())}]
        if self.store is not None:
            st = self.store.stats()
            exporters.append({"name": "store", "enabled": st is not None, "stats": st or {},
                              "events_overflow": self.store.events_overflow})
        return {
            "uptime_s": now - self._started,
            "probes": probes,
            "nvml": {"available": nv.available, "reason": nv.reason, "gpus": nv.gpus},
            "join": {"span_coverage": span_cov, "event_coverage": event_cov,
                     "pending_events": self.join.pending_events(),
                     **self.join.stats.as_dict(), "span_facts": self._span_facts(),
                     **dict(zip(("batch_held_now", "batch_pending_now"),
                                self.join.batch_pending())),
                     "by_pod": self._trust()},
            "exporters": exporters,
            "thread_only": self._thread_only(),
            "metrics": metric_rows(self.families()),
        }

    def _thread_only(self) -> list[dict]:
        """The instrumented processes whose spans are followed per thread only,
        and why (their marks' follow flags)."""
        span_ctx = next((p for p in self.probes if p.name == "span_ctx" and p.status.attached), None)
        if span_ctx is None:
            return []
        out = []
        for pid, flags in sorted(span_ctx.thread_only_processes().items()):
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                comm = ""
            out.append({"pid": pid, "comm": comm, "runtimes": runtimes.names(flags)})
        return out

    def _trust(self) -> list[dict]:
        """Per cgroup (pod): foreign facts rows it made that a span of another
        sender did not get, kernel events refused a row by its bound, its live
        rows at the last sweep, and its batch waiting room's drops."""
        st = self.join.facts_stats()
        refused = st.refused_by_cgroup if st is not None else {}
        live = st.live_by_cgroup if st is not None else {}
        foreign = self.join.foreign()
        batch = self.join.batch_by_owner()
        rows = []
        for cg in sorted(set(refused) | set(foreign) | set(batch)):
            b = batch.get(cg, {})
            rows.append({"cgroup": cg, **self._pod(cg), "foreign": foreign.get(cg, 0),
                         "refused": refused.get(cg, 0), "live_rows": live.get(cg, 0),
                         "batch_dropped": b.get("dropped", 0), "batch_hold_full": b.get("hold_full", 0)})
        return rows

    def _span_facts(self) -> dict | None:
        """The kernel's span facts map: rows created, taken, swept, evicted, present."""
        st = self.join.facts_stats()
        return dict(st.__dict__) if st is not None else None

    def spans(self, args: dict) -> dict:
        pod, slowest = args.get("pod") or None, args.get("slowest")
        limit = int(args.get("limit") or 50)
        _, spans, _ = self.state.snapshot()
        if pod:
            spans = [s for s in spans if s["pod"] == pod]
        if slowest:
            spans = sorted(spans, key=lambda s: s["duration_s"], reverse=True)[:int(slowest)]
        else:
            spans = spans[::-1][:limit]            # newest first
        return {"source": "ring", "ring_size": RING_SPANS, "spans": spans}

    def flows(self, args: dict) -> dict:
        tc = self.probes.tc
        if tc is None:
            return {"attached": False, "flows": [], "jss": []}
        jitter = tc.jitter()
        flows = []
        for f in tc.flows():
            j = jitter.get((f["protocol"], f["modality"]))
            flows.append({**f, "jss": j.jss if j is not None else None})
        flows.sort(key=lambda f: -sum(f["bytes"].values()))
        return {"attached": True, "flows": flows,
                "jss": [{"protocol": p, "modality": m, "jss": j.jss,
                         "media_packets": j.media_packets, "late_packets": j.late_packets}
                        for (p, m), j in sorted(jitter.items())],
                "totals": [{"direction": d, "protocol": p, "modality": m,
                            "packets": v[0], "bytes": v[1]}
                           for (d, p, m), v in sorted(tc.totals().items())]}

    def sandbox(self, args: dict) -> dict:
        sb = self.probes.sandbox
        recent, _, _ = self.state.snapshot()
        out = []
        for ev in reversed(recent):
            pool = sb.pool_path(ev.pool_id) if sb is not None else None
            out.append({"time_unix_ns": ev.epoch_ns, "pid": ev.hdr.pid, "comm": _comm(ev.hdr.pid),
                        "cgroup_id": ev.hdr.cgroup_id, **self._pod(ev.hdr.cgroup_id),
                        "pool": pool or f"#{ev.pool_id}", "pool_id": ev.pool_id,
                        "rule": _RULES.get(ev.rule, "unknown"),
                        "action": _ACTIONS.get(ev.action, "unknown"),
                        "len": ev.len, "prot": ev.prot})
        totals = []
        if sb is not None:
            # seen: at the mmap call, or later by the /proc sweep (links,
            # relative paths, inherited fds, mprotect)
            totals = [{"cgroup_id": cg, **self._pod(cg), "rule": rule, "action": action,
                       "count": n, "seen": seen}
                      for seen, counts in (("mmap", sb.violations()), ("sweep", sb.sweep_violations()))
                      for (cg, rule, action), n in sorted(counts.items())]
        return {"attached": sb is not None,
                "mode": self.cfg.sandbox.mode, "ring_size": RING_VIOLATIONS,
                "violations": out, "totals": totals}

    def gpu(self, args: dict) -> dict:
        gp = self.probes.gpu
        devices = []
        peaks = self.memory_peaks()
        for uuid, g in sorted(self.nvml.snapshot().items(), key=lambda kv: kv[1].index):
            devices.append({"gpu": uuid, "index": g.index, "name": g.name,
                            "sm_utilization_ratio": g.sm_utilization_ratio,
                            "memory_used_bytes": g.memory_used_bytes,
                            "memory_total_bytes": g.memory_total_bytes,
                            "memory_used_ratio": g.memory_used_ratio,
                            "memory_peak_ratio": peaks.get(uuid),
                            "pcie_tx_ratio": g.pcie_tx_ratio, "pcie_rx_ratio": g.pcie_rx_ratio})
        _, _, by_pid = self.state.snapshot()
        top = int(args.get("top") or 10)
        processes = [{"pid": pid, "comm": _comm(pid), "launches": n}
                     for pid, n in by_pid.most_common(top)]
        cgroups = []
        libraries = []
        if gp is not None:
            launches = gp.launches()
            waits = gp.sync_wait()
            for key in sorted(set(launches) | set(waits), key=lambda k: -launches.get(k, 0)):
                cg, modality, api = key
                count, total_ns = waits.get(key, (0, 0))
                cgroups.append({"cgroup_id": cg, **self._pod(cg), "modality": modality.name,
                                "api": api.name, "launches": launches.get(key, 0),
                                "syncs": count, "sync_wait_s": total_ns / 1e9})
            libraries = [{"pid": lib.pid, "path": lib.path, "api": lib.api.name,
                          "symbols": lib.symbols, "missing": lib.missing}
                         for lib in gp.libraries()]
        nv = self.nvml.status
        return {"attached": gp is not None, "launch_events": self.cfg.gpu.launch_events,
                "nvml": {"available": nv.available, "reason": nv.reason},
                "devices": devices, "processes": processes, "by_cgroup": cgroups,
                "libraries": libraries}

    def hints(self, args: dict) -> dict:
        return self.hints_source()

    def memory(self, args: dict) -> dict:
        """The agent's own memory (MemoryReport); {"mark": true} keeps this answer as the
        one the next are compared with."""
        return self._memory.answer(mark=bool(args.get("mark")))


def _redacted(tree: Any, secrets: list[str]) -> Any:
    """The answer with every configured credential hidden in its strings
    (never in numbers: a digits-only password must not corrupt counters)."""
    if not secrets:
        return tree
    if isinstance(tree, str):
        return redact(tree, secrets)
    if isinstance(tree, dict):
        return {redact(str(k), secrets): _redacted(v, secrets) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_redacted(v, secrets) for v in tree]
    return tree


def _export_health(stats: dict) -> dict:
    return {"enabled": stats.get("enabled", False), "queue": stats.get("queue_spans", 0),
            "queue_capacity": stats.get("queue_capacity", 0), "stats": stats}

