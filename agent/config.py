"""One typed configuration for the agent: YAML file, then SPANLET_* environment,
then command-line flags, with every default named here and nowhere else."""

from __future__ import annotations

import base64
import dataclasses
import math
import os
import socket
import ssl
import typing
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal
from urllib.parse import quote, unquote, urlsplit

import yaml
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator,
                      model_validator)

from spanlet import modality

ENV_PREFIX = "SPANLET_"
DEFAULT_CONFIG_FILE = Path("/etc/spanlet/config.yaml")
# A config file is a few KiB; past this it is a mistake (or an attack on the
# parser), refused before parsing.
MAX_CONFIG_BYTES = 1024 * 1024
# Values (mappings, lists and scalars) a document may expand to through its
# YAML aliases: a few hundred bytes of anchors can otherwise stand for 10^9
# values ("billion laughs"), and some checks print the value they refuse.
MAX_CONFIG_VALUES = 1_000_000
# Problems listed in one ConfigError; the rest are counted.
MAX_PROBLEMS = 20
# Characters of a key or message quoted in an error line.
MAX_QUOTED = 200


class ConfigError(Exception):
    """Bad configuration: names the key and where its value came from."""


# A modality as the config spells it (its name): spanlet.modality holds the one list.
Modality = Enum("Modality", [(name, name) for name in modality.NAMES], type=str, module=__name__)


class _Section(BaseModel):
    # NaN or infinity is never a meaningful setting (and NaN passes every bound check).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, v: Any, info) -> Any:
        # Pydantic's lax mode reads `true` as 1: a port or a size of `true` is a typo.
        if isinstance(v, bool) and cls.model_fields[info.field_name].annotation in (int, float):
            raise ValueError(f"expected a number, not {str(v).lower()}")
        return v


class RtpPayloadType(_Section):
    modality: Modality
    clock_hz: int = Field(gt=0, le=1_000_000)


# Static payload types of RFC 3551, plus the dynamic numbers WebRTC stacks
# usually give H.264 (96) and Opus (111). Negotiated numbers go in the config.
DEFAULT_RTP_PAYLOAD_TYPES = {
    0: RtpPayloadType(modality=Modality.audio, clock_hz=8000),
    8: RtpPayloadType(modality=Modality.audio, clock_hz=8000),
    9: RtpPayloadType(modality=Modality.audio, clock_hz=8000),
    10: RtpPayloadType(modality=Modality.audio, clock_hz=44100),
    11: RtpPayloadType(modality=Modality.audio, clock_hz=44100),
    26: RtpPayloadType(modality=Modality.video, clock_hz=90000),
    31: RtpPayloadType(modality=Modality.video, clock_hz=90000),
    32: RtpPayloadType(modality=Modality.video, clock_hz=90000),
    33: RtpPayloadType(modality=Modality.video, clock_hz=90000),
    34: RtpPayloadType(modality=Modality.video, clock_hz=90000),
    96: RtpPayloadType(modality=Modality.video, clock_hz=90000),
    111: RtpPayloadType(modality=Modality.audio, clock_hz=48000),
}


class TcConfig(_Section):
    enabled: bool = True
    # Empty: every non-loopback interface of the agent's network namespace,
    # including ones that appear later (pod veths).
    interfaces: list[str] = []
    exclude_interfaces: list[str] = ["lo"]
    # A named network namespace (/run/netns/NAME) whose interfaces are
    # classified instead of the agent's own; empty: the agent's own.
    netns: str = ""
    port_modality: dict[int, Modality] = {}
    rtp_payload_types: dict[int, RtpPayloadType] = Field(
        default_factory=lambda: dict(DEFAULT_RTP_PAYLOAD_TYPES))
    # Jitter Sensitivity Score threshold = tau_plc + delta_buffer (METRICS.md #4).
    tau_plc_ms: float = Field(default=30.0, ge=0, le=10_000)
    delta_buffer_ms: float = Field(default=10.0, ge=0, le=10_000)
    max_flows: int = Field(default=65536, ge=64, le=4_194_304)
    # Bytes of a request's first packet searched for HTTP headers.
    http_scan_bytes: int = Field(default=512, ge=64, le=1024)
    filter_priority: int = Field(default=0x5370, ge=1, le=0xFFFF)
    # A flow whose counters have not moved for this long is deleted from the
    # kernel maps (its counts stay in the totals).
    flow_idle_timeout_s: float = Field(default=120.0, gt=0, le=86_400)
    # Window of the Jitter Sensitivity Score (late / media packets).
    jss_window_s: float = Field(default=10.0, gt=0, le=3600)

    @field_validator("port_modality")
    @classmethod
    def _ports_in_range(cls, v: dict[int, Modality]) -> dict[int, Modality]:
        for port in v:
            if not 0 < port < 65536:
                raise ValueError(f"port {port} is not in 1..65535")
        return v

    @field_validator("rtp_payload_types")
    @classmethod
    def _pt_in_range(cls, v: dict[int, RtpPayloadType]) -> dict[int, RtpPayloadType]:
        for pt in v:
            if not 0 <= pt <= 127:
                raise ValueError(f"RTP payload type {pt} is not in 0..127")
        return v


class SandboxGrant(_Section):
    pids: list[int] = []
    # cgroup v2 paths, absolute or relative to the cgroup2 mount.
    cgroups: list[str] = []
    access: Literal["ro", "rw"] = "ro"

    @model_validator(mode="after")
    def _names_someone(self) -> "SandboxGrant":
        if not self.pids and not self.cgroups:
            raise ValueError("a grant needs at least one of 'pids' or 'cgroups'")
        for pid in self.pids:
            if pid <= 0:
                raise ValueError(f"pid {pid} is not a process id (> 0)")
        return self


class SandboxPool(_Section):
    path: str
    # 0: no size limit.
    max_bytes: int = Field(default=0, ge=0)
    grants: list[SandboxGrant] = []


class SandboxConfig(_Section):
    enabled: bool = True
    mode: Literal["audit", "enforce"] = "audit"
    prefixes: list[str] = ["/dev/shm/tensor_pool/"]
    pools: list[SandboxPool] = []
    # What the path match at open cannot see (links, relative paths,
    # inherited or dup'd fds, mprotect) is noticed as it happens; this is how
    # often the prefixes' folders are walked again besides their inotify
    # watch, and the least time between two full /proc sweeps after lost
    # notices.
    sweep_interval_s: float = Field(default=5.0, gt=0, le=3600)

    @model_validator(mode="after")
    def _pools_under_prefixes(self) -> "SandboxConfig":
        for p in self.prefixes:
            if not p.startswith("/") or len(p.encode()) > 120:
                raise ValueError(f"prefix {p!r} must be an absolute path of at most 120 bytes")
        for path in self.prefixes + [pool.path for pool in self.pools]:
            # The sandbox matches path strings; it does not resolve '..'.
            if "/../" in path + "/":
                raise ValueError(f"path {path!r} contains '..'")
        for pool in self.pools:
            if not any(pool.path.startswith(p) for p in self.prefixes):
                raise ValueError(f"pool {pool.path!r} is not under any of the prefixes {self.prefixes}")
            if len(pool.path.encode()) > 250:
                raise ValueError(f"pool path {pool.path!r} is longer than 250 bytes")
        if len(self.prefixes) > 8:
            raise ValueError("at most 8 prefixes")
        return self


class GpuConfig(_Section):
    enabled: bool = True
    # File names (as in /proc/<pid>/maps) that hold the driver and runtime API.
    driver_libraries: list[str] = ["libcuda.so"]
    runtime_libraries: list[str] = ["libcudart.so"]
    # Individual launch and sync records through the ring buffer, a side
    # stream only (counts and span facts are kept in the kernel in every
    # mode): none, the first sampled_events_per_span of each span, or all.
    launch_events: Literal["off", "sampled", "all"] = "off"
    sampled_events_per_span: int = Field(default=4, ge=1, le=1000)
    # Time inside launch calls (kernel.gpu.launch_ns): a return probe on
    # every launch, a second trap per launch. Off: one entry-only uprobe.
    launch_timing: bool = False
    # Also hook libcudart's launch and sync calls (the driver sees every call
    # the runtime makes: ../shared/CUDA.md); the driver call each makes is
    # then nested, not counted again. Off: libcudart is not looked for.
    runtime_hooks: bool = False
    # Attach the hooks of each library as uprobe_multi links (Linux 6.6+; a
    # few links per library, each detached in one grace period) instead of a
    # perf-event uprobe per hook (one grace period each at stop); older
    # kernels fall back to the latter by themselves.
    uprobe_multi: bool = True

    @field_validator("launch_events", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare `off` as false: `launch_events: off` means "off".
        return "off" if v is False else v


class DiscoveryConfig(_Section):
    # How often the agent reads the processes the kernel saw change (an exec,
    # a file mapped executable, an exit: span_ctx's maps_changed_pids) for
    # new libraries.
    interval_s: float = Field(default=1.0, gt=0, le=60)
    # How often every process's stat line is read (and the maps of those not
    # seen before). Without the kernel's list (span_ctx not attached) a
    # process is re-read when its mapped size changes, and after this long.
    full_rescan_s: float = Field(default=30.0, gt=0, le=3600)
    # A library no process has mapped for this long is detached (its uprobes
    # freed); a process mapping it within that time is traced from its start.
    unmapped_grace_s: float = Field(default=600.0, ge=0, le=86_400)


class OtlpConfig(_Section):
    # The receiver serving processes export their spans to. The DaemonSet sets
    # the node's address; the default keeps a single machine private.
    receiver_address: str = "127.0.0.1"
    grpc_port: int = Field(default=4317, ge=0, le=65535)
    http_port: int = Field(default=4318, ge=0, le=65535)
    max_message_bytes: int = Field(default=4 * 1024 * 1024, ge=1024, le=256 * 1024 * 1024)
    # Upstream export of enriched spans; empty endpoint (and no
    # OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT) means no export, not an error.
    upstream_endpoint: str = ""
    upstream_protocol: Literal["", "grpc", "http/protobuf"] = ""
    upstream_headers: dict[str, str] = {}
    upstream_timeout_s: float = Field(default=10.0, gt=0, le=300)
    queue_size: int = Field(default=8192, ge=1, le=10_000_000)
    # ...and in serialized bytes: whichever bound is reached first drops.
    queue_max_bytes: int = Field(default=64 * 1024 * 1024, ge=1024, le=16 * 1024 ** 3)
    batch_size: int = Field(default=512, ge=1, le=100_000)
    batch_interval_s: float = Field(default=1.0, gt=0, le=60)
    max_retry_s: float = Field(default=60.0, ge=0, le=3600)
    # Lock-down of the receiver (README, "Trust and multi-tenancy"); the
    # defaults keep it as it was: plain, no token, no limit.
    # TLS on both ports with this certificate (PEM, chain after it) and key:
    # senders know they talk to the agent, and nobody on the path reads spans.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    # When set, a client must present a certificate this CA (PEM) signed, or
    # the TLS handshake is refused: only holders of such a certificate send.
    tls_client_ca_file: str = ""
    # A mounted secret holding the one token clients must send
    # (authorization: Bearer <token>; else UNAUTHENTICATED / 401). Re-read
    # when the file changes; never logged.
    bearer_token_file: str = ""
    # Spans a second each sender (peer IP address) may send, both ports
    # together (over it: RESOURCE_EXHAUSTED with RetryInfo / 429 with
    # Retry-After), so one client cannot crowd out the rest; 0: no limit.
    rate_limit_spans_per_s: float = Field(default=0.0, ge=0, le=100_000_000)
    # Spans a sender may send at once on top of its rate; 0: one second's worth.
    rate_limit_burst: int = Field(default=0, ge=0, le=100_000_000)
    # Senders whose buckets are kept (the least recently seen is forgotten).
    rate_limit_max_senders: int = Field(default=4096, ge=1, le=1_000_000)

    @model_validator(mode="after")
    def _receiver_trust(self) -> "OtlpConfig":
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file are set together or not at all")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("tls_client_ca_file needs tls_cert_file and tls_key_file "
                             "(client certificates are checked in TLS)")
        problem = _trust_files_problem(self)
        if problem:
            raise ValueError(problem)
        return self


def _trust_files_problem(otlp: OtlpConfig) -> str:
    """Why the receiver's certificate, key, CA or token file cannot serve
    ('' when they can): found when the config is read, so a bad file stops
    the start with one line. Never quotes a file's content."""
    files = [(k, getattr(otlp, k)) for k in ("tls_cert_file", "tls_key_file",
                                              "tls_client_ca_file", "bearer_token_file")]
    for key, path in files:
        if not path:
            continue
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            return f"{key} {path!r} cannot be read: {e.strerror}"
        if key == "bearer_token_file" and not data.strip():
            return f"{key} {path!r} is empty"
    try:
        if otlp.tls_cert_file:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(otlp.tls_cert_file,
                                                                   otlp.tls_key_file)
    except ssl.SSLError as e:
        return f"tls_cert_file / tls_key_file are not a PEM certificate and its key ({e.reason or e})"
    try:
        if otlp.tls_client_ca_file:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_verify_locations(otlp.tls_client_ca_file)
    except ssl.SSLError as e:
        return f"tls_client_ca_file is not PEM CA certificates ({e.reason or e})"
    return ""


class SpanContextConfig(_Section):
    # Also keep every instrumented thread's current span in the OpenTelemetry
    # shared context map (LRU hash, key u64 pid_tgid, value trace id[16] and
    # span id[8] in W3C byte order), pinned at otel_map_path: created when no
    # other tool pinned it (and removed at stop), else shared (and left).
    otel_map: bool = False
    otel_map_path: str = "/sys/fs/bpf/otel/traces_ctx_v1"


class SchedConfig(_Section):
    # Request anatomy: each span's threads' time on a CPU, in the run queue
    # and blocked (kernel.sched.*), from the scheduler's raw tracepoints
    # (every context switch of the node passes through them; a thread
    # outside any span costs one map lookup there). Off by default until its
    # cost per switch meets the goal of 100 ns (bench/sched_bench.py; the
    # CO-RE programs' task storage is the way there).
    enabled: bool = False


class JoinConfig(_Section):
    # Sampled kernel events (span events) wait here for their span; bounded
    # in count and age. Counts never wait here: they are in span_facts.
    buffer_events: int = Field(default=100_000, ge=100, le=10_000_000)
    # How long a facts row may wait for its span (then it is deleted and
    # counted as expired), and how long a span passed on is remembered for
    # facts that come after it (late records).
    ttl_s: float = Field(default=30.0, gt=0, le=3600)
    # Rows of the kernel's span facts map (LRU: a row past the bound is
    # evicted and counted).
    span_facts_max: int = Field(default=65_536, ge=16, le=4_194_304)
    # Live rows one cgroup may hold there: past it the kernel refuses that
    # cgroup's new rows (counted per cgroup), so a pod that marks spans that
    # never arrive fills only its own part of the map.
    span_facts_max_per_cgroup: int = Field(default=16_384, ge=16, le=4_194_304)
    # How often the daemon sweeps the span facts map for late and expired rows.
    sweep_interval_s: float = Field(default=2.0, gt=0, le=60)
    # Individual kernel events added to a span as span events, at most.
    max_span_events: int = Field(default=32, ge=0, le=10_000)
    # Batched steps (a span with links to request spans): once the agent has
    # seen a step span with facts to share (GPU work, or CPU time with
    # sched.enabled), a request (SERVER) span is held back
    # at most this long for the steps that served it; a step that comes later
    # goes out as a late record of the request. 0: never hold. Nodes without
    # steps pay nothing.
    batch_wait_s: float = Field(default=2.0, ge=0, le=60)
    # Links read per step (more are counted as dropped, their weight still in
    # the step's total); request shares waiting for their request span
    # (bounded in count and join.ttl_s in age); spans held back at most.
    batch_max_links: int = Field(default=1024, ge=1, le=1_000_000)
    batch_max_pending: int = Field(default=65_536, ge=16, le=10_000_000)
    batch_max_held_spans: int = Field(default=100_000, ge=16, le=10_000_000)
    # The same per sender pod (its origin, as the receiver established it;
    # one share for every unknown sender): a pod past its bound drops its
    # own oldest shares (or holds no more of its spans), never another's.
    batch_max_pending_per_pod: int = Field(default=16_384, ge=16, le=10_000_000)
    batch_max_held_per_pod: int = Field(default=25_000, ge=16, le=10_000_000)
    # Request totals (kernel.request.*): span subtrees that wait for their
    # server span, which the process exports after them. Bounded in traces
    # (process and trace id), in subtrees in all and in one trace, and in age
    # after the trace's last span; past a bound the oldest go, counted in
    # spanlet_request_totals_dropped_subtrees_total.
    request_totals_max_traces: int = Field(default=16_384, ge=16, le=10_000_000)
    request_totals_max_subtrees: int = Field(default=32_768, ge=16, le=10_000_000)
    request_totals_max_subtrees_per_trace: int = Field(default=256, ge=1, le=1_000_000)
    request_totals_ttl_s: float = Field(default=600.0, gt=0, le=86_400)


class StoreConfig(_Section):
    enabled: bool = True
    # chdb: embedded, under data_dir/chdb (nothing to install or run);
    # clickhouse: a server or cluster through clickhouse-connect.
    backend: Literal["chdb", "clickhouse"] = "chdb"
    url: str = ""                       # clickhouse: http(s)://host:8123
    database: str = "spanlet"
    user: str = ""
    # A mounted secret holding the password; never logged.
    password_file: str = ""
    ca_file: str = ""
    # A cluster name: ON CLUSTER DDL, Replicated local tables, Distributed tables.
    cluster: str = ""
    ttl_days: int = Field(default=7, ge=1, le=3650)
    batch_rows: int = Field(default=30_000, ge=1, le=1_000_000)
    # Each insert costs the embedded engine ~20-50 ms of CPU however few its
    # rows (the statement's analysis, a part written, then merged again as
    # parts grow; ~5 µs a span, ~3 µs a kernel event on top): 30 s between
    # inserts (30,000 rows at 1,000 spans/s) took the agent at that load from
    # 3.4-4.1% to 2.4-2.8% of a core against 10 s (bench/agent_cpu_bench.py),
    # for ~10 MB more held rows; the store's rows are at most that much behind.
    batch_interval_s: float = Field(default=30.0, gt=0, le=60)
    queue_rows: int = Field(default=200_000, ge=1, le=100_000_000)
    # On-disk spool (data_dir/spool) for what the store cannot take now.
    spool_max_bytes: int = Field(default=256 * 1024 * 1024, ge=0)
    # chdb: the engine in a process of its own (its memory not the agent's; a
    # crash of it costs a restart, with back-off, and the rows wait meanwhile),
    # or in the agent's process.
    engine_process: bool = True
    # chdb: the engine's bound on the memory it tracks (queries, inserts,
    # merges); a statement past it fails and is retried. 0: the engine's default.
    engine_memory_mb: int = Field(default=1024, ge=0)
    # chdb in its own process: the wait for a statement's answer; past it the
    # engine's process is killed and started again, and the rows retried.
    engine_timeout_s: float = Field(default=600.0, gt=0, le=86400)

    @field_validator("url")
    @classmethod
    def _no_password_in_url(cls, v: str) -> str:
        # The value is not echoed: it holds the password.
        if _url_password(v):
            raise ValueError("must not carry a password (user:password@); "
                             "put the password in store.password_file")
        return v

    @model_validator(mode="after")
    def _server_needs_url(self) -> "StoreConfig":
        if self.backend == "clickhouse" and not self.url:
            raise ValueError("backend clickhouse needs url (http[s]://host:8123)")
        return self


def _section_from(settings_cls: type, name: str, exclude: tuple[str, ...] = ()) -> type[_Section]:
    """A config section whose keys, types and defaults are those of a settings
    dataclass of the module that uses them (one place for each default); the
    dataclass's own checks run at load time, so a bad value names its key."""
    hints = typing.get_type_hints(settings_cls)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(settings_cls):
        if f.name in exclude or not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = Field(default_factory=f.default_factory)
        if isinstance(default, Mapping):
            default = Field(default_factory=lambda d=default: dict(d))
        fields[f.name] = (hints[f.name], default)

    def _check(self):
        try:
            settings_cls(**{k: getattr(self, k) for k in fields})
        except (TypeError, ValueError) as e:
            raise ValueError(str(e)) from None
        return self

    return create_model(name, __base__=_Section,
                        __validators__={"_check": model_validator(mode="after")(_check)},
                        **fields)


# -- settings of the metric engine, NVML poller and scheduler feed -----------------
# Plain frozen dataclasses (the modules that use them take any object with these
# attributes); the config sections below are made from them.

@dataclasses.dataclass(frozen=True)
class ServingSettings:
    """Defaults of the `serving` config section; ServingMetrics also takes any
    object with these attributes (the daemon's cfg.serving)."""
    # Length of a window; the daemon calls roll() at this period.
    window_s: float = 10.0
    # #11: closed windows the p99 volatility looks back over.
    volatility_windows: int = 12
    # #12: latency target per SLO class, seconds.
    slo_target_s: Mapping[str, float] = dataclasses.field(
        default_factory=lambda: {"gold": 0.2, "silver": 0.5, "bronze": 0.8})
    # #12: the compliance each class must reach (alert thresholds, not used here).
    slo_min_compliance_ratio: Mapping[str, float] = dataclasses.field(
        default_factory=lambda: {"gold": 0.95, "silver": 0.85})
    # #13: peak output tokens/s per model (gen_ai.request.model); no entry, no TDR.
    peak_tokens_per_s: Mapping[str, float] = dataclasses.field(default_factory=dict)
    # #13: the three-level bottleneck rule.
    memory_bottleneck_ratio: float = 0.95
    pcie_bottleneck_ratio: float = 0.85
    kv_cache_bottleneck_ratio: float = 0.70
    # #14: audio/video sync tolerance, and the bounds on traces awaiting a partner.
    delta_sync_s: float = 0.0167
    alignment_ttl_s: float = 30.0
    alignment_max_pending: int = 10_000
    # #16: closed windows of the drift stddev; embeddings sampled per window,
    # modality and pod; the largest embedding accepted.
    drift_windows: int = 3
    embedding_samples_per_window: int = 32
    embedding_max_dims: int = 4096
    # #9/#10: longer durations are rejected as out_of_range.
    max_duration_s: float = 86_400.0
    # #11: request durations kept per series and window (uniform sample beyond).
    max_window_durations: int = 10_000
    # Cardinality: live values per free-text label; idle series are dropped.
    max_label_values: int = 256
    series_idle_s: float = 3600.0
    # Histogram upper bounds (seconds). They hold the thresholds of METRICS.md
    # and the scheduler feed (4/8 ms audio p95, class targets, TTFT 0.4 s,
    # alignment 20/120 ms) so that those can be read off the buckets.
    request_duration_bounds_s: tuple[float, ...] = (
        0.002, 0.004, 0.008, 0.016, 0.025, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.8,
        1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0)
    time_to_first_token_bounds_s: tuple[float, ...] = (
        0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0)
    alignment_delay_bounds_s: tuple[float, ...] = (
        0.0, 0.005, 0.01, 0.02, 0.04, 0.08, 0.12, 0.25, 0.5, 1.0, 2.5, 5.0)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Mapping):
                object.__setattr__(self, f.name, MappingProxyType(dict(v)))
            elif isinstance(v, list):
                object.__setattr__(self, f.name, tuple(v))
        check_settings(self)


def check_settings(s) -> None:
    """ValueError naming the key for settings no metric could work with."""
    def need(ok: bool, key: str, what: str) -> None:
        if not ok:
            raise ValueError(f"serving.{key}: {what}")
    for key in ("window_s", "alignment_ttl_s", "max_duration_s", "series_idle_s"):
        need(getattr(s, key) > 0, key, "must be > 0")
    for key in ("volatility_windows", "drift_windows"):
        need(getattr(s, key) >= 2, key, "must be >= 2 (a stddev needs two windows)")
    for key in ("alignment_max_pending", "embedding_samples_per_window", "embedding_max_dims",
                "max_window_durations", "max_label_values"):
        need(getattr(s, key) >= 1, key, "must be >= 1")
    for key in ("memory_bottleneck_ratio", "pcie_bottleneck_ratio", "kv_cache_bottleneck_ratio"):
        need(0 <= getattr(s, key) <= 1, key, "must be in 0..1")
    need(s.delta_sync_s >= 0, "delta_sync_s", "must be >= 0")
    for key in ("slo_target_s", "peak_tokens_per_s"):
        for name, v in getattr(s, key).items():
            need(math.isfinite(v) and v > 0, f"{key}.{name}", "must be a finite number > 0")
    for key in ("request_duration_bounds_s", "time_to_first_token_bounds_s",
                "alignment_delay_bounds_s"):
        b = list(getattr(s, key))
        need(bool(b) and all(math.isfinite(x) for x in b)
             and all(x < y for x, y in zip(b, b[1:])), key,
             "must be finite upper bounds in strictly ascending order")


GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class SchedulerThresholds:
    """The policy numbers of METRICS.md "Scheduler feed"; field names are the
    keys of the config section `scheduler`."""

    # Share of a threshold an input must cross back by to leave a rule.
    hysteresis_ratio: float = 0.10
    audio_p95_high_s: float = 0.008
    audio_utilization_high: float = 0.75
    audio_p95_low_s: float = 0.004
    audio_utilization_low: float = 0.40
    audio_batch_busy: int = 2
    audio_batch_default: int = 4
    audio_batch_idle: int = 8
    text_short_input_tokens: float = 64
    text_short_rtt_s: float = 0.015
    text_long_input_tokens: float = 2048
    text_kv_cache_hit_min: float = 0.72
    text_batch_short: tuple[int, int] = (8, 16)
    text_batch_default: tuple[int, int] = (4, 8)
    text_batch_long: tuple[int, int] = (2, 4)
    vision_memory_peak_max: float = 0.87
    vision_memory_free_min_bytes: float = 1.2 * GIB
    vision_batch_min: int = 1
    vision_batch_default: int = 8
    vision_batch_max: int = 16

    def __post_init__(self) -> None:
        if not 0.0 <= self.hysteresis_ratio < 1.0:
            raise ValueError(f"hysteresis_ratio: {self.hysteresis_ratio} is not in [0, 1)")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.startswith("text_batch_"):
                if len(value) != 2 or not 1 <= value[0] <= value[1]:
                    raise ValueError(f"{f.name}: {value} is not a range (min, max), 1 <= min <= max")
            elif "_batch_" in f.name and value < 1:
                raise ValueError(f"{f.name}: {value} is below 1")
        if not self.vision_batch_min <= self.vision_batch_default <= self.vision_batch_max:
            raise ValueError("vision_batch_default must lie in [vision_batch_min, vision_batch_max]")


@dataclasses.dataclass(frozen=True)
class NvmlSettings:
    """Defaults of the `nvml` config section (the daemon may pass cfg.nvml instead,
    anything with these attributes)."""
    enabled: bool = True
    poll_interval_s: float = 1.0
    # Empty: libnvidia-ml.so.1 as the dynamic linker finds it. An absolute path
    # where the driver is mounted elsewhere (e.g. /usr/local/nvidia/lib64/...).
    library: str = ""


ServingConfig = _section_from(ServingSettings, "ServingConfig", exclude=("window_s",))
NvmlConfig = _section_from(NvmlSettings, "NvmlConfig")
SchedulerConfig = _section_from(SchedulerThresholds, "SchedulerConfig")


class Config(_Section):
    node_name: str = Field(default_factory=socket.gethostname)
    data_dir: str = "/var/lib/spanlet"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # Folder of kernel headers for BCC; empty: /lib/modules/$(uname -r)/build.
    kernel_headers: str = ""
    # A complete header tree to fall back on when kernel_headers is empty and the
    # host's are not mounted or incomplete; the image sets it to the headers it
    # carries (SPANLET_IMAGE_KERNEL_HEADERS=/opt/spanlet/kernel-headers).
    image_kernel_headers: str = ""
    # The kernel's BTF for the CO-RE programs (probes/libbpf.py); empty:
    # /sys/kernel/btf/vmlinux. A kernel built without BTF needs a file for it
    # (BTFHub has them for the distributions' kernels).
    btf_path: str = ""
    # Keep each probe's compiled instructions in data_dir/bpf-cache and load
    # them at a later start with the same program, flags, kernel, headers and
    # BCC instead of compiling again (probes/compile_cache.py).
    compile_cache: bool = True
    # Each probe's ring buffer (4 MB: ~35,000 GPU launch records, ~70 ms at
    # 500,000 a second): room for a reader that a busy node runs late
    # (bench/ringbuf_bench.py --busy); 256 pages dropped below 500,000/s there.
    ringbuf_pages: int = Field(default=1024, ge=1, le=65536)
    # Records a cgroup may send a second through the sampled GPU stream and the
    # sandbox's records (one pod cannot fill the ring the others' go through);
    # refusals counted per pod. 0: no bound. launch_events "all" is not bounded.
    ringbuf_records_per_cgroup_s: int = Field(default=2000, ge=0, le=100_000_000)
    # The one HTTP port for people and scrapers: /metrics, /healthz, /readyz.
    http_address: str = "0.0.0.0"
    http_port: int = Field(default=9464, ge=0, le=65535)
    # Length of a metric window (gauges such as the GPU memory peak).
    window_s: float = Field(default=10.0, gt=0, le=3600)
    shutdown_timeout_s: float = Field(default=5.0, gt=0, le=60)
    # Unix socket (0600, root only) of the admin API read by `spanlet inspect`.
    admin_socket: str = "/run/spanlet/admin.sock"
    tc: TcConfig = TcConfig()
    sandbox: SandboxConfig = SandboxConfig()
    gpu: GpuConfig = GpuConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    otlp: OtlpConfig = OtlpConfig()
    join: JoinConfig = JoinConfig()
    span_context: SpanContextConfig = SpanContextConfig()
    sched: SchedConfig = SchedConfig()
    nvml: NvmlConfig = NvmlConfig()
    serving: ServingConfig = ServingConfig()
    store: StoreConfig = StoreConfig()
    scheduler: SchedulerConfig = SchedulerConfig()

    @field_validator("ringbuf_pages")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"{v} is not a power of two")
        return v

    @model_validator(mode="after")
    def _absolute_paths(self) -> "Config":
        """Relative paths are taken from the directory the config was loaded
        in, once: BCC changes the process's working directory while it
        compiles, which the agent does beside its other start-up work. (A
        library name without a slash stays a name for the dynamic linker.)"""
        for section, key in _PATH_KEYS:
            owner = getattr(self, section) if section else self
            value = getattr(owner, key)
            if value and not os.path.isabs(value) and (key != "library" or "/" in value):
                setattr(owner, key, os.path.abspath(value))
        return self

    def secrets(self, env: Mapping[str, str] | None = None) -> list[str]:
        """Every credential this config (and the OTEL_EXPORTER_OTLP_*HEADERS
        it is used with) names, longest first, for `redact`."""
        env = os.environ if env is None else env
        found: set[str] = set()
        if self.store.password_file:
            try:
                text = Path(self.store.password_file).read_text(encoding="utf-8", errors="replace")
            except OSError:
                text = ""    # the store reports it; nothing to hide yet
            password = text.removesuffix("\n")
            found.update((text, password))
            user = self.store.user or _url_part(self.store.url, "username") or "default"
            if password:   # as HTTP basic auth carries it
                found.add(base64.b64encode(f"{user}:{password}".encode()).decode())
        if self.otlp.bearer_token_file:
            try:
                text = Path(self.otlp.bearer_token_file).read_text(encoding="utf-8",
                                                                   errors="replace")
            except OSError:
                text = ""
            found.update((text, text.strip()))
        for url in (self.store.url, self.otlp.upstream_endpoint):
            password = _url_password(url)
            found.update((password, unquote(password)))
        values = list(self.otlp.upstream_headers.values())
        for name, text in env.items():
            if name.startswith("OTEL_EXPORTER_OTLP_") and name.endswith("HEADERS"):
                # Lenient on purpose: a malformed entry ("authorization: x")
                # is logged as malformed, and must be hidden there too.
                for item in text.split(","):
                    values.append(item)
                    values.append(unquote(item.partition("=")[2] or item.partition(":")[2]))
        for v in values:
            v = v.strip()
            found.add(v)
            scheme, _, token = v.partition(" ")     # "Bearer <token>", "Basic <b64>"
            if token and scheme.isalpha():
                found.add(token.strip())
        out: set[str] = set()
        for v in found:
            if len(v) >= MIN_SECRET_CHARS:
                out.update((v, quote(v, safe=""), quote(v)))
        return sorted(out, key=len, reverse=True)


# Shorter configured "secrets" are not hidden: replacing every "abc" in the
# logs would garble them and protect nothing.
MIN_SECRET_CHARS = 4
REDACTED = "***"


def _url_part(url: str, part: str) -> str:
    """The username or password of a URL ('' when none, or not a URL)."""
    if "@" not in url:
        return ""
    try:
        return getattr(urlsplit(url if "://" in url else f"//{url}"), part) or ""
    except ValueError:
        return ""


def _url_password(url: str) -> str:
    return _url_part(url, "password")


def redact(text: str, secrets: list[str]) -> str:
    """`text` with every secret (Config.secrets) replaced by ***: the one
    place logs and admin answers are cleaned."""
    for s in secrets:
        if s in text:
            text = text.replace(s, REDACTED)
    return text


def _env_keys(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> dict[str, tuple[str, ...]]:
    """SPANLET_* variable name for every leaf key of the model."""
    out: dict[str, tuple[str, ...]] = {}
    for name, field in model.model_fields.items():
        path = prefix + (name,)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, _Section):
            out.update(_env_keys(ann, path))
        else:
            out[ENV_PREFIX + "_".join(path).upper()] = path
    return out


ENV_KEYS = _env_keys(Config)
# The same leaf keys as --set writes them: "tc.interfaces".
DOTTED_KEYS = {".".join(path): path for path in ENV_KEYS.values()}


def _leaf_annotation(path: tuple[str, ...]) -> Any:
    model: type[BaseModel] = Config
    for part in path[:-1]:
        model = model.model_fields[part].annotation
    return model.model_fields[path[-1]].annotation


def _parse_scalar(path: tuple[str, ...], raw: str, where: str) -> Any:
    """Environment and --set values are YAML scalars; a list may also be
    written comma-separated (SPANLET_TC_INTERFACES=eth0,eth1)."""
    ann = _leaf_annotation(path)
    if getattr(ann, "__origin__", None) is list and not raw.lstrip().startswith("["):
        return [p.strip() for p in raw.split(",") if p.strip()]
    try:
        return _load_yaml(raw)
    except yaml.YAMLError:
        return raw
    except ValueError as e:
        raise ConfigError(f"{where}: key '{'.'.join(path)}': {e}") from None


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _set_path(tree: dict, path: tuple[str, ...], value: Any, origins: dict[tuple, str],
              where: str) -> None:
    for n, part in enumerate(path[:-1], 1):
        node = tree.setdefault(part, {})
        if not isinstance(node, dict):
            # Replacing it would silently drop what the file wrote there.
            raise ConfigError(f"{origins.get(path[:n], 'defaults')}: key '{'.'.join(path[:n])}': "
                              f"must be a mapping of keys, not {_type_name(node)} "
                              f"({where} sets a key inside it)")
        tree = node
    tree[path[-1]] = value


def _quote(text: str) -> str:
    """One line, bounded: a hostile key or value cannot flood or split the error."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))
    return text if len(text) <= MAX_QUOTED else text[:MAX_QUOTED] + "..."


def _describe(err: dict, origins: dict[tuple, str]) -> str:
    loc = tuple(str(p) for p in err["loc"])
    key = _quote(".".join(loc)) or "(top level)"
    where = "defaults"
    for n in range(len(loc), 0, -1):
        if loc[:n] in origins:
            where = origins[loc[:n]]
            break
    else:  # a whole-section check: the keys set inside it say where it came from
        inside = sorted({o for k, o in origins.items() if k[:len(loc)] == loc})
        if inside:
            where = ", ".join(inside)
    if err["type"] == "extra_forbidden":
        return f"{where}: unknown key '{key}'"
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return f"{where}: key '{key}': {_quote(msg)}"


# Deep enough for every key of Config (tc.rtp_payload_types.96.clock_hz);
# deeper keys are named by their prefix.
_ORIGIN_DEPTH = 6


def _file_origins(tree: Any, label: str, out: dict) -> None:
    """Record the keys the file sets. Bounded: a YAML alias makes the same
    mapping appear under many keys (a "billion laughs" file), so a mapping
    is walked once, and only as deep as the config goes."""
    seen: set[int] = set()
    stack: list[tuple[tuple, Any]] = [((), tree)]
    while stack:
        path, node = stack.pop()
        if path:
            out.setdefault(path, label)
        if isinstance(node, dict) and len(path) < _ORIGIN_DEPTH and id(node) not in seen:
            seen.add(id(node))
            stack.extend((path + (str(k),), v) for k, v in node.items())


def _expanded_size(data: Any) -> int:
    """How many values `data` stands for once every alias is expanded,
    counted without expanding (each shared node once); raises ValueError
    when that is over MAX_CONFIG_VALUES or an alias contains itself."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()
    stack: list[tuple[Any, bool]] = [(data, False)]

    def children(node):
        return node.values() if isinstance(node, dict) else node

    while stack:
        node, closing = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        key = id(node)
        if closing:
            open_.discard(key)
            size = 1 + sum(sizes.get(id(c), 1) for c in children(node))
            if size > MAX_CONFIG_VALUES:
                raise ValueError(f"expands to more than {MAX_CONFIG_VALUES} values (YAML aliases)")
            sizes[key] = size
        elif key in open_:
            raise ValueError("a YAML alias refers to a mapping or list that contains it")
        elif key not in sizes:
            open_.add(key)
            stack.append((node, True))
            stack.extend((c, False) for c in children(node))
    return sizes.get(id(data), 1)


def _load_yaml(text: str) -> Any:
    """yaml.safe_load, bounded; raises yaml.YAMLError or ValueError (one line each)."""
    try:
        data = yaml.load(text, Loader=_YAML_LOADER)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    _expanded_size(data)
    return data


def _yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's message on one line, without the quoted source line (which
    may hold a secret)."""
    mark = getattr(e, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    what = " ".join(p for p in (getattr(e, "context", None), getattr(e, "problem", None)) if p)
    return where + _quote(what or type(e).__name__)


def _read_file(file_path: Path) -> Any:
    try:
        with open(file_path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"config file {file_path}: {e.strerror}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {file_path}: larger than {MAX_CONFIG_BYTES} bytes; "
                          "not a spanlet config")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigError(f"config file {file_path}: line {line}: not UTF-8 text "
                          f"(byte 0x{raw[e.start]:02x})") from None
    try:
        return _load_yaml(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {file_path}: not valid YAML: {_yaml_problem(e)}") from None
    except ValueError as e:
        raise ConfigError(f"config file {file_path}: {e}") from None


_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


# Settings that name a file or folder (Config._absolute_paths).
_PATH_KEYS = (("", "data_dir"), ("", "admin_socket"), ("", "kernel_headers"),
              ("", "image_kernel_headers"), ("", "btf_path"), ("nvml", "library"), ("otlp", "tls_cert_file"),
              ("otlp", "tls_key_file"), ("otlp", "tls_client_ca_file"), ("otlp", "bearer_token_file"),
              ("store", "password_file"), ("store", "ca_file"), ("span_context", "otel_map_path"))


def load(path: str | os.PathLike | None = None,
         env: dict[str, str] | None = None,
         overrides: list[str] | None = None) -> Config:
    """Build the config: file (if any), then SPANLET_* environment, then
    `key.sub=value` overrides. Raises ConfigError naming the key and source."""
    env = os.environ if env is None else env
    tree: dict[str, Any] = {}
    origins: dict[tuple, str] = {}
    file_path = Path(path) if path else None
    if file_path is None and env.get(ENV_PREFIX + "CONFIG"):
        file_path = Path(env[ENV_PREFIX + "CONFIG"])
    if file_path is not None:
        data = _read_file(file_path)
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {file_path}: the top level must be a mapping of keys, "
                              f"not {_type_name(data)}")
        tree = data
        _file_origins(tree, f"config file {file_path}", origins)
    for name, value in env.items():
        keypath = ENV_KEYS.get(name)
        if keypath is not None:
            where = f"environment variable {name}"
            _set_path(tree, keypath, _parse_scalar(keypath, value, where), origins, where)
            origins[keypath] = where
    for item in overrides or []:
        key, sep, value = item.partition("=")
        keypath = DOTTED_KEYS.get(key.strip())
        if not sep or keypath is None:
            # The value is not echoed: it may be a secret given to a mistyped key.
            raise ConfigError(f"--set: unknown key '{_quote(key.strip())}' "
                              "(use --set section.key=value)")
        where = f"--set {key.strip()}"
        _set_path(tree, keypath, _parse_scalar(keypath, value, where), origins, where)
        origins[keypath] = where
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        errors = e.errors(include_url=False, include_input=False)
    except RecursionError:   # pydantic-core bounds its own depth; this is a last guard
        raise ConfigError("bad configuration: nested too deeply") from None
    lines = [_describe(err, origins) for err in errors[:MAX_PROBLEMS]]
    if len(errors) > MAX_PROBLEMS:
        lines.append(f"... and {len(errors) - MAX_PROBLEMS} more problems")
    # One self-contained line per problem (the CLI prefixes each).
    raise ConfigError("\n".join(lines))
