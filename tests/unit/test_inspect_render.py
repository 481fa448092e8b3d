"""`spanlet inspect` without an agent: the thresholds it shows are those of
daemonset/prometheus-rules.yaml, the histogram quantile and breach logic are
exact, and every view of a crafted answer (long reasons, not-attached probes,
breaches) renders within 80 columns."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from spanlet import admin, inspect
from spanlet.metrics import Family, HistogramSample, Sample, labels

ROOT = Path(__file__).resolve().parents[2]


def rules_thresholds() -> dict[str, dict[str, float]]:
    """{metric: {"label=value" or "": threshold}} from the alert rules."""
    out: dict[str, dict[str, float]] = {}
    doc = yaml.safe_load((ROOT / "daemonset" / "prometheus-rules.yaml").read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            metric = rule.get("labels", {}).get("metric")
            expr = " ".join(rule["expr"].split())
            m = re.search(r"([<>])\s*([0-9.]+)\s*$", expr)
            if metric is None or m is None or "rate(" in expr and "histogram_quantile" not in expr:
                continue
            sel = re.search(r'\{(\w+)="(\w+)"\}', expr)
            where = f"{sel.group(1)}={sel.group(2)}" if sel else ""
            out.setdefault(metric, {})[where] = (m.group(1), float(m.group(2)))
    return out


def test_thresholds_match_the_alert_rules():
    from_rules = rules_thresholds()
    mine = {name: {w: (op, t) for w, t in th.items()} for name, _, op, th in admin.THRESHOLDS if th}
    # the sandbox alert is "any increase" (> 0), written with increase()/offset
    from_rules.setdefault("spanlet_sandbox_violations_total", {"": (">", 0.0)})
    assert mine == {k: v for k, v in from_rules.items() if k in mine}
    assert set(from_rules) - set(mine) <= {"spanlet_probe_attached", "spanlet_scrape_errors_total",
                                           "spanlet_events_dropped_total"}
    assert len(admin.THRESHOLDS) == 17


def test_quantile_interpolates_like_prometheus():
    # 10 in (0, 1], 10 in (1, 2]: the median is the top of the first bucket
    assert admin.quantile(0.5, (1.0, 2.0), (10, 10, 0)) == 1.0
    assert admin.quantile(0.75, (1.0, 2.0), (10, 10, 0)) == 1.5
    assert admin.quantile(0.99, (1.0, 2.0), (0, 0, 5)) == 2.0      # +Inf: the largest bound
    assert admin.quantile(0.5, (1.0,), (0, 0)) is None


def test_metric_rows_breaches_by_class():
    fams = [
        Family("spanlet_slo_compliance_ratio", "gauge", "", samples=[
            Sample(labels(slo_class="gold"), 0.99), Sample(labels(slo_class="silver"), 0.80)]),
        Family("spanlet_request_duration_seconds", "histogram", "", samples=[
            HistogramSample(labels(slo_class="gold"), (0.1, 0.2, 0.4), (0, 0, 10, 0), 3.0, 10)]),
        Family("spanlet_span_kernel_coverage_ratio", "gauge", "", samples=[Sample((), 0.96)]),
    ]
    rows = {r["metric"]: r for r in admin.metric_rows(fams)}
    assert len(rows) == 17
    slo = rows["spanlet_slo_compliance_ratio"]
    assert slo["breach"] and slo["where"] == "slo_class=silver" and slo["value"] == 0.80
    assert [b["breach"] for b in slo["by"]] == [False, True, False]
    dur = rows["spanlet_request_duration_seconds"]
    assert dur["breach"] and dur["value"] == pytest.approx(0.39) and dur["threshold"] == 0.2
    cov = rows["spanlet_span_kernel_coverage_ratio"]
    assert not cov["breach"] and cov["value"] == 0.96 and cov["by"] == []
    assert rows["spanlet_embedding_drift_score"]["value"] is None
    assert not rows["spanlet_embedding_drift_score"]["breach"]


LONG = "x" * 150


def answer(op: str, data: dict) -> dict:
    return {"ok": True, "protocol": 1, "op": op, "node": "node-" + "n" * 60,
            "time_unix_ns": 1_700_000_000_000_000_000, "data": data}


SUMMARY = {
    "uptime_s": 12.0,
    "probes": [
        {"name": "span_ctx", "attached": True, "reason": "", "attachments": 2,
         "failed_attachments": [], "events_read": 0, "events_dropped": 0, "decode_errors": 0,
         "events_per_s": 0.0, "drops_per_s": 0.0},
        {"name": "tc_classify", "attached": True, "reason": "", "attachments": 2,
         "failed_attachments": [f"nosuch0: no such interface {LONG}"], "events_read": 123456789,
         "events_dropped": 17, "decode_errors": 0, "events_per_s": 123456.7, "drops_per_s": 1.5},
        {"name": "gpu_launch", "attached": False, "reason": "no libcuda.so " + LONG, "attachments": 0,
         "failed_attachments": [], "events_read": 0, "events_dropped": 0, "decode_errors": 0,
         "events_per_s": None, "drops_per_s": None}],
    "nvml": {"available": False, "reason": "libnvidia-ml.so.1 not found", "gpus": 0},
    "join": {"span_coverage": 0.5, "event_coverage": None, "pending_events": 3, "spans_in": 4,
             "spans_joined": 2, "events_in": 9, "events_joined": 6, "events_evicted": 0,
             "late_records": 0, "span_events_capped": 0, "rows_expired": 2, "rows_late": 1,
             "batch_steps": 40, "batch_held_now": 3, "batch_pending_now": 5, "batch_requests": 77,
             "batch_late": 4, "batch_expired": 6, "batch_links_dropped": 7,
             "foreign_other_pod": 11, "foreign_conflict": 2,
             "span_facts": {"created": 9, "taken": 3, "swept": 2, "evicted": 1, "present": 3,
                            "refused": 40},
             "by_pod": [{"cgroup": 5, "namespace": "serving", "pod": "engine-" + LONG[:40],
                         "container": "c", "foreign": 11, "refused": 40, "live_rows": 16384,
                         "batch_dropped": 3, "batch_hold_full": 1},
                        {"cgroup": 6, "namespace": "", "pod": "", "container": "",
                         "foreign": 2, "refused": 0, "live_rows": 0, "batch_dropped": 0,
                         "batch_hold_full": 0}]},
    "exporters": [
        {"name": "otlp_receiver", "enabled": True,
         "stats": {"spans_accepted": 4, "spans_rejected": {"too_big": 1},
                   "origins": {"socket": 7, "pod_ip": 2, "unknown": 1}}},
        {"name": "otlp_span_export", "enabled": True, "queue": 8000, "queue_capacity": 8192,
         "stats": {"exported": 10, "dropped_queue_full": 5}},
        {"name": "store", "enabled": False, "stats": {}, "events_overflow": 0}],
    "metrics": admin.metric_rows([Family("spanlet_slo_compliance_ratio", "gauge", "", samples=[
        Sample(labels(slo_class="bronze"), 0.5)])]),
}
VIEWS = {
    "summary": SUMMARY,
    "spans": {"source": "ring", "ring_size": 512, "spans": [
        {"trace_id": "ab" * 16, "span_id": "cd" * 8, "name": "n" * 70, "service": "s" * 50,
         "namespace": "ns", "pod": "pod-" + "p" * 60, "start_unix_ns": 1, "duration_s": 12345.6789,
         "received_unix_ns": 2, "gpu_launches": 10 ** 9, "gpu_sync_wait_s": 1.5,
         "rx_bytes": 10 ** 12, "tx_bytes": 5, "violations": 2},
        {"trace_id": "ab" * 16, "span_id": "ce" * 8, "name": "POST /generate", "service": "front",
         "namespace": "ns", "pod": "front-0", "start_unix_ns": 1, "duration_s": 0.5,
         "received_unix_ns": 2, "gpu_launches": 0, "gpu_sync_wait_s": 0.0, "rx_bytes": 0,
         "tx_bytes": 0, "violations": 0, "links": 0, "batch_steps": 12,
         "batch_gpu_launches": 1234.5678, "batch_gpu_graph_launches": 3.25,
         "batch_gpu_sync_wait_s": 0.0123456, "cpu_s": 0.0213, "runqueue_s": 0.0199, "blocked_s": 0.4512,
         "memcpy_h2d_bytes": 3 << 20, "memcpy_d2h_bytes": 4096},
        {"trace_id": "ef" * 16, "span_id": "cf" * 8, "name": "engine.step", "service": "engine",
         "namespace": "ns", "pod": "engine-0", "start_unix_ns": 1, "duration_s": 0.02,
         "received_unix_ns": 2, "gpu_launches": 400, "gpu_sync_wait_s": 0.1, "rx_bytes": 0,
         "tx_bytes": 0, "violations": 0, "links": 8, "batch_steps": 0,
         "batch_gpu_launches": 0.0, "batch_gpu_graph_launches": 0.0,
         "batch_gpu_sync_wait_s": 0.0}]},
    "flows": {"attached": True, "jss": [], "totals": [], "flows": [
        {"src": "fd00:1234:5678:9abc:def0:1234:5678:9abc", "dst": "fd00::1", "sport": 65535,
         "dport": 443, "l4proto": 6, "protocol": "websocket", "modality": "video",
         "packets": {"ingress": 1, "egress": 2}, "bytes": {"ingress": 10 ** 10, "egress": 3},
         "jitter_ms": {"ingress": 1.25, "egress": 0.0}, "jss": 0.5}]},
    "sandbox": {"attached": True, "mode": "enforce", "ring_size": 256, "violations": [
        {"time_unix_ns": 1, "pid": 4194304, "comm": "python3-long-name", "cgroup_id": 9,
         "namespace": "team-" + "a" * 40, "pod": "p" * 60, "container": "c", "pool": "/dev/shm/" + LONG,
         "pool_id": 3, "rule": "write_on_readonly", "action": "kill", "len": 1, "prot": 3}],
        "totals": [{"cgroup_id": 9, "namespace": "", "pod": "", "container": "",
                    "rule": "oversize", "action": "audit", "count": 4}]},
    "gpu": {"attached": True, "launch_events": "spanned",
            "nvml": {"available": True, "reason": ""},
            "devices": [{"gpu": "GPU-" + "f" * 36, "index": 0, "name": "NVIDIA H200 " + "x" * 40,
                         "sm_utilization_ratio": 0.5, "memory_used_bytes": 1, "memory_total_bytes": 2,
                         "memory_used_ratio": 0.5, "memory_peak_ratio": 0.9, "pcie_tx_ratio": None,
                         "pcie_rx_ratio": 0.1}],
            "processes": [{"pid": 1, "comm": "vllm", "launches": 10 ** 12}],
            "by_cgroup": [{"cgroup_id": 5, "namespace": "ns", "pod": "p" * 70, "container": "",
                           "modality": "text", "api": "runtime", "launches": 3, "syncs": 1,
                           "sync_wait_s": 0.25}], "libraries": []},
    "hints": {"window_s": 10.0, "updated_at": 1.0, "hints": {
        "text": {"modality": "text", "batch_size": 16, "batch_range": [4, 32],
                 "rule": "text.kv_cache_" + "r" * 40, "inputs": {}, "missing": ["a" * 90],
                 "changed_at": None}}},
}


@pytest.mark.parametrize("op", sorted(VIEWS))
def test_every_view_fits_80_columns(op):
    console = Console(width=80, record=True, force_terminal=True, color_system="truecolor")
    console.print(inspect.render(op, answer(op, VIEWS[op])))
    text = console.export_text()
    assert text.strip()
    wide = [line for line in text.splitlines() if len(line) > 80]
    assert not wide, "\n".join(wide)
    if op == "summary":
        assert "NOT attached" in text and "slo_compliance_ratio" in text
        assert "< 0.75 (slo_class=bronze)" in text       # the breaching class is the one shown
        assert ("span facts: 3 rows waiting, 1 evicted, 2 expired, 1 late, 40 events refused "
                "(pod bound)") in " ".join(text.split())
        assert "foreign facts: 11 other pod, 2 conflict" in " ".join(text.split())
        assert "Facts by pod" in text and "cgroup 6" in text and "16384" in text
        assert ("OTLP senders: 7 requests by their socket, 2 by pod IP, 1 unknown (no kernel "
                "facts)") in " ".join(text.split())
        assert ("batched steps: 40 steps, 3 requests held now, 5 waiting shares, 77 requests with "
                "shares, 4 late, 6 expired, 7 links dropped") in " ".join(text.split())
    if op == "hints":
        assert "text.kv_cache_" in text
    if op == "spans":
        # the span column's words, top to bottom (the cells wrap)
        words = " ".join(w for line in text.splitlines() if len(line.split("│")) > 3
                         for w in line.split("│")[3].split())
        assert "12 steps, share: 1.23e+03 launch, 3.25 graph, 0.0123 stall s" in words, words
        assert "step of 8 requests" in words
        assert "cpu 0.021 runq 0.020 blk 0.451" in words, words
        assert "h2d 3.0 MiB d2h 4.0 KiB" in words, words


def test_ask_reports_a_missing_socket(tmp_path):
    with pytest.raises(inspect.InspectError) as e:
        inspect.ask(str(tmp_path / "nope.sock"), "summary")
    assert e.value.code == inspect.EXIT_NOT_RUNNING


def test_ask_reports_a_path_that_is_not_a_socket(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(inspect.InspectError) as e:
        inspect.ask(str(tmp_path / "file"), "summary")
    assert e.value.code == inspect.EXIT_NOT_RUNNING
