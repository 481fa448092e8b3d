"""`spanlet inspect`: asks the running agent's admin socket (agent/admin.py) one
question and shows the answer as rich tables, as a live view (--watch) or as
JSON (--json) for scripts."""

from __future__ import annotations

import argparse
import errno
import json
import socket
import sys
import time
from datetime import datetime, timezone

from spanlet.metrics import catalogue

EXIT_OK = 0
EXIT_NOT_RUNNING = 3      # no socket, or nothing listening on it
EXIT_PERMISSION = 4       # the socket is root's (mode 0600)
EXIT_BAD_ANSWER = 5       # not JSON, wrong shape, no answer in time, or the agent's own error

TIMEOUT_S = 10.0


class InspectError(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def ask(path: str, op: str, args: dict | None = None, timeout: float = TIMEOUT_S) -> dict:
    """One request, one answer; raises InspectError with the exit code."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        try:
            s.connect(path)
        except FileNotFoundError:
            raise InspectError(EXIT_NOT_RUNNING,
                               f"agent not running: no admin socket at {path}") from None
        except PermissionError:
            raise InspectError(EXIT_PERMISSION,
                               f"permission denied on {path}: run as root (sudo, or kubectl exec "
                               "into the spanlet container)") from None
        except ConnectionRefusedError:
            raise InspectError(EXIT_NOT_RUNNING,
                               f"agent not running: nothing listens on {path}") from None
        except OSError as e:
            if e.errno in (errno.ENOTSOCK, errno.ENOTDIR):
                raise InspectError(EXIT_NOT_RUNNING, f"agent not running: {path} is not a socket") from None
            raise InspectError(EXIT_NOT_RUNNING, f"cannot reach the agent at {path}: {e.strerror}") from None
        try:
            s.sendall(json.dumps({"op": op, "args": args or {}}).encode() + b"\n")
            buf = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
        except socket.timeout:
            raise InspectError(EXIT_BAD_ANSWER, f"bad answer: the agent did not answer within "
                                                f"{timeout:g} s") from None
        except OSError as e:
            raise InspectError(EXIT_BAD_ANSWER, f"bad answer: connection failed: {e.strerror}") from None
    finally:
        s.close()
    try:
        answer = json.loads(buf)
    except (ValueError, UnicodeDecodeError):
        raise InspectError(EXIT_BAD_ANSWER,
                           f"bad answer: not JSON ({len(buf)} bytes from {path})") from None
    if not isinstance(answer, dict) or "ok" not in answer:
        raise InspectError(EXIT_BAD_ANSWER, "bad answer: not a spanlet admin answer")
    if not answer["ok"]:
        err = str(answer.get("error", "unknown error"))
        if err == "permission denied":
            raise InspectError(EXIT_PERMISSION, f"permission denied by the agent on {path}")
        raise InspectError(EXIT_BAD_ANSWER, f"bad answer: the agent says: {err}")
    if not isinstance(answer.get("data"), dict) or answer.get("op") != op:
        raise InspectError(EXIT_BAD_ANSWER, "bad answer: no data for this question")
    return answer


# -- rendering ------------------------------------------------------------------

def _num(v, fmt: str = "{:.3g}") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return fmt.format(v)
    return str(v)


def _bytes(n) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _when(ns) -> str:
    if not ns:
        return "-"
    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).strftime("%H:%M:%S")


def _table(title: str, *cols: str, **kw):
    from rich.table import Table
    t = Table(title=title, title_justify="left", expand=False, **kw)
    for c in cols:
        t.add_column(c, overflow="fold")
    return t


def render(op: str, answer: dict):
    """A rich renderable for one answer."""
    from rich.console import Group
    from rich.text import Text
    d = answer["data"]
    head = Text(f"spanlet on {answer.get('node', '?')}  {_when(answer.get('time_unix_ns'))} UTC",
                style="bold")
    parts = [head] + {"summary": _summary, "spans": _spans, "flows": _flows,
                      "sandbox": _sandbox, "gpu": _gpu, "hints": _hints, "memory": _memory}[op](d)
    return Group(*parts)


def _summary(d: dict) -> list:
    trust = _trust_table(d["join"].get("by_pod") or [])
    return [*_probes(d["probes"], d["nvml"]), _join_line(d["join"]), *trust,
            *_thread_only_lines(d.get("thread_only") or []),
            _exporters_table(d["exporters"]), *_senders_line(d["exporters"]),
            _metrics_table(d["metrics"])]


def _thread_only_lines(rows: list) -> list:
    """One line per process whose spans are followed per thread only."""
    from rich.text import Text
    return [Text(f"pid {r['pid']} ({r['comm']}): requests on {' and '.join(r['runtimes'])}: its spans are "
                 "followed per thread only", style="yellow") for r in rows]


def _trust_table(rows: list) -> list:
    """Pods whose facts were kept from others' spans, refused or bounded."""
    if not rows:
        return []
    t = _table("Facts by pod", "pod", "foreign rows", "refused events", "live rows",
               "batch dropped")
    for r in rows:
        pod = f"{r['namespace']}/{r['pod']}" if r["pod"] else f"cgroup {r['cgroup']}"
        t.add_row(pod, str(r["foreign"]), str(r["refused"]), str(r["live_rows"]),
                  str(r["batch_dropped"] + r["batch_hold_full"]))
    return [t]


def _probes(probes: list, nvml: dict) -> list:
    """The probes table, NVML as its last row, then a dim line for each probe or
    attachment that failed and why."""
    from rich.text import Text
    t = _table("Probes", "probe", "state", "ev/s", "drop/s", "read", "dropped")
    notes = []
    for p in probes:
        t.add_row(p["name"], _probe_state(p), _num(p["events_per_s"], "{:.1f}"),
                  _num(p["drops_per_s"], "{:.1f}"), str(p["events_read"]),
                  Text(str(p["events_dropped"]), style="red" if p["events_dropped"] else ""))
        if not p["attached"]:
            notes.append(f"{p['name']}: {p['reason']}")
        for f in p["failed_attachments"]:
            notes.append(f"{p['name']}: {f}")
    t.add_row("nvml", Text(f"{nvml['gpus']} GPU(s)", style="green") if nvml["available"]
              else Text("unavailable", style="yellow"), "", "", "", "")
    if not nvml["available"] and nvml["reason"]:
        notes.append(f"nvml: {nvml['reason']}")
    return [t] + [Text("  " + n, style="dim") for n in notes]


def _probe_state(p: dict):
    from rich.text import Text
    if not p["attached"]:
        return Text("NOT attached", style="bold red")
    if p["failed_attachments"]:
        return Text(f"attached, {len(p['failed_attachments'])} failed", style="yellow")
    return Text("attached", style="green")


def _join_line(j: dict):
    from rich.text import Text
    cov = j["span_coverage"]
    return Text.assemble(
        "Join: span coverage ", Text(_pct(cov), style=_alarm("spanlet_span_kernel_coverage_ratio", cov)),
        f", event coverage {_pct(j['event_coverage'])}, pending {j['pending_events']} events, "
        f"{j['spans_in']} spans in, {j['events_evicted']} events evicted"
        + (f"; span facts: {sf['present']} rows waiting, {sf['evicted']} evicted, "
           f"{j.get('rows_expired', 0)} expired, {j.get('rows_late', 0)} late"
           + (f", {sf['refused']} events refused (pod bound)" if sf.get("refused") else "")
           if (sf := j.get("span_facts")) else "")
        + (f"; foreign facts: {j.get('foreign_other_pod', 0)} other pod, "
           f"{j.get('foreign_conflict', 0)} conflict"
           if j.get("foreign_other_pod") or j.get("foreign_conflict") else "")
        + (f"; batched steps: {j['batch_steps']} steps, {j.get('batch_held_now', 0)} requests "
           f"held now, {j.get('batch_pending_now', 0)} waiting shares, {j['batch_requests']} "
           f"requests with shares, {j['batch_late']} late, {j['batch_expired']} expired, "
           f"{j['batch_links_dropped']} links dropped" if j.get("batch_steps") else ""))


def _exporters_table(exporters: list):
    e = _table("Exporters", "exporter", "state", "queue", "sent", "dropped")
    for x in exporters:
        e.add_row(*_exporter_row(x))
    return e


def _senders_line(exporters: list) -> list:
    """How the receiver's requests had their sender established (the origin
    of the kernel facts their spans may get)."""
    from rich.text import Text
    got = next((x["stats"].get("origins") for x in exporters if x["name"] == "otlp_receiver"), None)
    if not got:
        return []
    unknown = got.get("unknown", 0)
    return [Text.assemble(f"OTLP senders: {got.get('socket', 0)} requests by their socket, "
                          f"{got.get('pod_ip', 0)} by pod IP, ",
                          Text(f"{unknown} unknown (no kernel facts)",
                               style="yellow" if unknown else ""))]


def _exporter_row(x: dict) -> tuple:
    """One exporter's cells; the receiver and the span export keep stats of their own shape."""
    from rich.text import Text
    st = x.get("stats", {})
    if x["name"] == "otlp_receiver":
        return ("otlp receiver", "listening", "-", str(st.get("spans_accepted", 0)),
                str(sum(st.get("spans_rejected", {}).values())))
    if x["name"] == "otlp_span_export":
        dropped = sum(st.get(k, 0) for k in ("dropped_queue_full", "dropped_failed",
                                             "dropped_shutdown"))
        return ("otlp export", "on" if x["enabled"] else "off (no endpoint)",
                f"{x['queue']}/{x['queue_capacity']}", str(st.get("exported", 0)),
                Text(str(dropped), style="red" if dropped else ""))
    return (x["name"], "on" if x["enabled"] else Text("NOT started", style="red"),
            str(st.get("queued_rows", "-")), str(st.get("rows_written", "-")),
            str(st.get("dropped_rows_total", "-")))


def _metrics_table(metrics: list):
    from rich.text import Text
    m = _table("Metrics now (breaches in red)", "metric", "stat", "now", "alert if")
    for r in metrics:
        name = r["metric"].removeprefix("spanlet_")
        cond = f"{r['op']} {r['threshold']:g}" if r["threshold"] is not None else "-"
        if r["where"]:
            cond += f" ({r['where']})"
        style = "bold red" if r["breach"] else ""
        m.add_row(Text(name, style=style), r["stat"], Text(_num(r["value"]), style=style), cond)
    return m


def _spans(d: dict) -> list:
    t = _table(f"Recent spans (from the agent's ring of the last {d['ring_size']})",
               "time", "pod / service", "span", "dur s", "launch", "stall s", "rx/tx", "viol")
    for s in d["spans"]:
        t.add_row(_when(s["received_unix_ns"]), s["pod"] or s["service"] or "-",
                  s["name"] + _anatomy(s) + _batch(s),
                  f"{s['duration_s']:.3f}", str(s["gpu_launches"]), f"{s['gpu_sync_wait_s']:.3f}",
                  f"{_bytes(s['rx_bytes'])}/{_bytes(s['tx_bytes'])}", str(s["violations"]))
    return [t]


def _anatomy(s: dict) -> str:
    """Lines under a span's name: where its threads' time went (seconds), and
    the bytes it copied to and from the GPU."""
    out = ""
    if s.get("cpu_s") or s.get("runqueue_s") or s.get("blocked_s"):
        out += f"\ncpu {s['cpu_s']:.3f} runq {s['runqueue_s']:.3f} blk {s['blocked_s']:.3f}"
    if s.get("memcpy_h2d_bytes") or s.get("memcpy_d2h_bytes"):
        out += f"\nh2d {_bytes(s['memcpy_h2d_bytes'])} d2h {_bytes(s['memcpy_d2h_bytes'])}"
    return out


def _batch(s: dict) -> str:
    """Lines under a span's name: a step's requests; a request's steps and its
    shares of their launches, graph launches and stall."""
    out = ""
    if s.get("links"):
        out += f"\nstep of {s['links']} requests"
    if s.get("batch_steps"):
        out += (f"\n{s['batch_steps']} steps, share: {_num(s['batch_gpu_launches'])} launch, "
                f"{_num(s['batch_gpu_graph_launches'])} graph, "
                f"{_num(s['batch_gpu_sync_wait_s'])} stall s")
    return out


def _flows(d: dict) -> list:
    from rich.text import Text
    if not d["attached"]:
        return [Text("tc_classify is not attached: no flows", style="yellow")]
    t = _table("Flows (by bytes)", "flow", "proto", "modality", "bytes in/out", "jitter ms", "JSS")
    for f in d["flows"]:
        ends = f"{f['src']}:{f['sport']} > {f['dst']}:{f['dport']}"
        jit = max(f["jitter_ms"].values()) if f["jitter_ms"] else None
        b = f["bytes"]
        t.add_row(ends, f["protocol"], f["modality"],
                  "/".join(_bytes(v) for v in b.values()), _num(jit, "{:.2f}"),
                  Text(_num(f["jss"]), style=_alarm("spanlet_jitter_sensitivity_score", f["jss"])))
    return [t]


def _alarm(metric: str, value: float | None) -> str:
    """Red where the value is past the metric's default alert threshold."""
    return "bold red" if catalogue.breached(metric, value) else ""


def _sandbox(d: dict) -> list:
    t = _table(f"Sandbox violations (mode {d['mode']}; last {d['ring_size']} kept)",
               "time", "pid", "pod", "pool", "rule", "action")
    for v in d["violations"]:
        who = f"{v['namespace']}/{v['pod']}" if v["pod"] else f"cgroup {v['cgroup_id']}"
        t.add_row(_when(v["time_unix_ns"]), f"{v['pid']} {v['comm']}", who, v["pool"], v["rule"],
                  v["action"])
    s = _table("Totals since start", "pod / cgroup", "rule", "action", "seen", "count")
    for x in d["totals"]:
        s.add_row(f"{x['namespace']}/{x['pod']}" if x["pod"] else f"cgroup {x['cgroup_id']}",
                  x["rule"], x["action"], x.get("seen", "mmap"), str(x["count"]))
    return [t, s]


def _gpu(d: dict) -> list:
    from rich.text import Text
    out = []
    if d["devices"]:
        t = _table("GPUs", "#", "name", "SM util", "mem used", "mem peak", "PCIe tx/rx")
        for g in d["devices"]:
            t.add_row(str(g["index"]), g["name"] or g["gpu"], _pct(g["sm_utilization_ratio"]),
                      _pct(g["memory_used_ratio"]),
                      Text(_pct(g["memory_peak_ratio"]),
                           style=_alarm("spanlet_gpu_memory_peak_ratio", g["memory_peak_ratio"])),
                      f"{_pct(g['pcie_tx_ratio'])}/{_pct(g['pcie_rx_ratio'])}")
        out.append(t)
    else:
        out.append(Text(f"NVML: {d['nvml']['reason'] or 'no GPUs'}", style="yellow"))
    p = _table(f"Top processes by launches (launch events: {d['launch_events']})",
               "pid", "command", "launches")
    for x in d["processes"]:
        p.add_row(str(x["pid"]), x["comm"], str(x["launches"]))
    out.append(p)
    c = _table("Launches and sync waits by pod", "pod / cgroup", "modality", "api", "launches",
               "syncs", "wait s")
    for x in d["by_cgroup"]:
        c.add_row(f"{x['namespace']}/{x['pod']}" if x["pod"] else f"cgroup {x['cgroup_id']}",
                  x["modality"], x["api"], str(x["launches"]), str(x["syncs"]),
                  f"{x['sync_wait_s']:.3f}")
    out.append(c)
    return out


def _hints(d: dict) -> list:
    t = _table(f"Scheduler hints (window {d['window_s']:g} s)", "modality", "batch", "range",
               "rule fired", "missing inputs")
    for m, h in d["hints"].items():
        rng = "-" if not h["batch_range"] else f"{h['batch_range'][0]}-{h['batch_range'][1]}"
        t.add_row(m, str(h["batch_size"]), rng, h["rule"], ", ".join(h["missing"]) or "-")
    return [t]


def _signed_bytes(n) -> str:
    return "-" if n is None else ("+" if n > 0 else "") + _bytes(n)


def _memory(d: dict) -> list:
    then = d["since_mark"] or {}
    since = f" (change since the mark {then['seconds']:.0f} s ago)" if then else ""
    t = _table("Agent memory" + since, "part", "now", "change")
    rows = [(f"RSS {k}", d["rss"].get(k), (then.get("rss") or {}).get(k)) for k in ("rss", "anon", "file")]
    if d["malloc"] is not None:
        rows += [(f"malloc {k}", d["malloc"][k], (then.get("malloc") or {}).get(k))
                 for k in ("in_use", "free", "mmapped")]
    for label, now, old in rows:
        t.add_row(label, _bytes(now), "-" if old is None or now is None else _signed_bytes(now - old))
    py, old_py = d["python"], then.get("python") or {}
    for k in ("allocated_blocks", "gc_objects"):
        t.add_row(f"Python {k.replace('_', ' ')}", str(py[k]),
                  "-" if k not in old_py else f"{py[k] - old_py[k]:+d}")
    types = _table("Python objects by type (tracked by gc)", "type", "count", "change")
    for r in py["types"]:
        types.add_row(r["type"], str(r["count"]), "-" if r["change"] is None else f"{r['change']:+d}")
    out = [t, types]
    tm = d["tracemalloc"]
    if tm is not None:
        lines = _table(f"Allocations by line (tracemalloc: {_bytes(tm['traced'])} traced)",
                       "where", "size", "blocks", "change")
        for r in tm["top"]:
            lines.add_row(r["where"], _bytes(r["size"]), str(r["count"]), _signed_bytes(r["size_change"]))
        out.append(lines)
    return out


# -- command ----------------------------------------------------------------------

def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="show what the running agent sees (its admin socket)")
    p.add_argument("what", nargs="?", default="summary",
                   choices=["summary", "spans", "flows", "sandbox", "gpu", "hints", "memory"])
    p.add_argument("--socket", metavar="PATH",
                   help="admin socket (default: admin_socket of the config: $SPANLET_ADMIN_SOCKET, "
                        "--config, else /run/spanlet/admin.sock)")
    p.add_argument("--config", metavar="FILE", help="read admin_socket from this config file")
    p.add_argument("--pod", help="spans: only this pod's")
    p.add_argument("--slowest", type=int, metavar="N", help="spans: the N slowest")
    p.add_argument("--mark", action="store_true",
                   help="memory: keep this answer's figures; later answers show the change since")
    p.add_argument("--json", action="store_true", help="print the agent's answer as JSON")
    p.add_argument("--watch", action="store_true", help="refresh the view until Ctrl-C")
    p.add_argument("--interval", type=float, default=2.0, help="--watch refresh period, s")


def _socket_path(args) -> str:
    if args.socket:
        return args.socket
    from spanlet import config as config_mod
    try:
        return config_mod.load(args.config).admin_socket
    except config_mod.ConfigError:
        return config_mod.Config.model_fields["admin_socket"].default


def _unmarked(req: dict) -> dict:
    """--watch --mark: the first answer is the mark, the refreshes are compared with it."""
    return {k: v for k, v in req.items() if k != "mark"}


def run(args) -> int:
    path = _socket_path(args)
    req = {}
    if args.what == "spans":
        req = {"pod": args.pod, "slowest": args.slowest}
    elif args.what == "memory":
        req = {"mark": args.mark}
    try:
        if args.json:
            while True:
                print(json.dumps(ask(path, args.what, req), sort_keys=True), flush=True)
                if not args.watch:
                    return EXIT_OK
                req = _unmarked(req)
                time.sleep(args.interval)
        from rich.console import Console
        console = Console()
        answer = ask(path, args.what, req)
        if not args.watch:
            console.print(render(args.what, answer))
            return EXIT_OK
        req = _unmarked(req)
        from rich.live import Live
        with Live(render(args.what, answer), console=console, screen=False,
                  auto_refresh=False) as live:
            while True:
                time.sleep(args.interval)
                live.update(render(args.what, ask(path, args.what, req)), refresh=True)
    except InspectError as e:
        print(f"spanlet inspect: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        return EXIT_OK
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        print(f"spanlet inspect: bad answer: unexpected shape ({type(e).__name__}: {e})",
              file=sys.stderr)
        return EXIT_BAD_ANSWER


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="spanlet")
    add_parser(p.add_subparsers(dest="command", required=True))
    return run(p.parse_args(argv))
