"""Serving-layer metrics (METRICS.md #9-#16, and the request anatomy's
histograms) computed from the OTLP spans that the receiver has joined to
kernel events; one class per metric, named after it.

How the daemon drives it: `observe(resource_spans, now)` after each join (any
receiver thread), `roll(now, device)` once per window, `families()` at scrape or
export time. Windows are windows of arrival (the agent's clock), not of span
timestamps: a span counts in the window in which it reached the agent.

Readings of METRICS.md that the code rests on (every threshold is a field of
`spanlet.config.ServingSettings`, checked where it is made):

- A *request* (#9, #12) is a span of kind SERVER whose parent is not a local span:
  no `parent_span_id`, or span flags with SPAN_FLAGS_CONTEXT_IS_REMOTE (0x200)
  set. A SERVER span with a parent and without SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE
  (0x100), i.e. from an SDK that does not say, also counts: SERVER spans are
  nearly always the entry span of their process, and otherwise every request
  forwarded by a gateway would be lost. Only a SERVER span whose flags say its
  parent is local (0x100 set, 0x200 clear) is not a request.
- Labels: `modality` is `mm.modality` when it is exactly text, image, audio or
  video (else `other`, as agent/client.py reads it); `slo_class` is `slo.class`
  when it names a class of `slo_target_s`, `none` when the attribute is absent,
  `other` for any other value (so a client cannot grow the label set);
  `namespace`/`pod` are the resource attributes k8s.namespace.name/k8s.pod.name,
  "" when absent. Free-text label values (namespace, pod, degraded from/to) go
  through a limiter: at most `max_label_values` live values per label, more fold
  into "overflow" and are counted; values idle for `series_idle_s` are forgotten,
  and so are the series that carry them. No span or trace id is ever a label.
- A span contributes to a metric when it carries that metric's trigger (SERVER
  root, `first_token` event or TTFT attribute, output tokens, KV-cache ratio,
  `mm.pts_ns`, `mm.degraded_from`/`_to`, `mm.embedding`). A trigger whose value or
  companion is missing, of the wrong type, not finite, negative or out of range
  is rejected and counted by reason (`rejected`, family
  spanlet_serving_rejected_total); the span's other contributions still count.
- #10 TTFT: from the span's start to its earliest `first_token` event; the
  attribute `gen_ai.server.time_to_first_token` (seconds) only for a span
  without that event. Labels as #9, for any span kind.
- #11 volatility: per window and series, p99 of the request durations by linear
  interpolation between closest ranks (numpy's default `method="linear"`,
  Hyndman-Fan type 7) over the window's durations (a uniform reservoir sample of
  `max_window_durations` when there are more); then population stddev / mean
  (ddof=0) of those p99s over the last `volatility_windows` closed windows, those
  that had requests; present with >= 2 such windows and a mean > 0.
- #12 compliance: met / requests in the last closed window, a request meets its
  class when duration <= target; classes without a target (none, other) have no
  compliance. Absent for a series without requests in that window.
- #13 TDR = 1 - (sum of `gen_ai.usage.output_tokens` in the window / window
  length) / `peak_tokens_per_s[model]`, per namespace, pod and model (a pod is
  one serving instance on its GPUs; summing pods of one model against one
  peak would be wrong). Absent for models without a configured peak and for a
  window without tokens of that model (an idle model is not a decayed one). Not
  clamped: below 0 means the configured peak is too low. Every span carrying the
  attribute counts, so an application must put it on one span per generation.
  `bottleneck`: memory_used_ratio_max >= 0.95 -> gpu_memory, else pcie_ratio_max
  >= 0.85 -> pcie, else the window's max `gen_ai.kv_cache.usage_ratio` of that
  pod and model (a span carrying it needs `gen_ai.request.model` too) >= 0.70
  -> kv_cache, else none. A missing (or NaN) input is not past its threshold.
- #14 Δt = max(0, |pts_audio - pts_video| - δ_sync) in seconds, once per trace:
  from the first audio and the first video span of the trace that carry
  `mm.pts_ns`. Clamped at 0, so that the histogram is the delay beyond the
  tolerance; its first bucket (le=0) counts the pairs within δ_sync. Traces
  waiting for their partner are evicted after `alignment_ttl_s` or past
  `alignment_max_pending` and counted (reason alignment_evicted). Labels
  namespace and pod: each the value both spans agree on, else "".
- Request anatomy: spanlet_request_cpu_seconds and
  spanlet_request_runqueue_seconds observe a request's kernel.request.cpu_ns
  and kernel.request.runqueue_ns (its in-process subtree's, summed by
  spanlet.request_totals before the spans come here), in seconds, labels as
  #9, only for requests that carry them (int or double, finite, >= 0, at most
  max_duration_s). Each bucket of a series keeps an exemplar of its latest
  observation: the request's trace and span ids, the value, and the agent's
  wall clock when it was observed (later than the one it replaces, as
  Prometheus's exemplar storage wants).
- #16 CMSD: per window and pod, the mean of the raw (not normalised) sampled
  embeddings of each modality (at most `embedding_samples_per_window`, a
  uniform reservoir sample; the window's first kept embedding fixes its
  dimension); per pair of modalities present (label `pair`, names sorted, e.g.
  "image-text") the cosine distance d_w = 1 - cos(mean_a, mean_b); the gauge is
  the population stddev of d_w over the last `drift_windows` (3) closed
  windows, those in which d_w was defined, present with >= 2 of them. A pair
  whose means differ in dimension or has a zero mean is left out of that
  window and counted.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import threading
import time
from array import array
from bisect import bisect_left
from collections import Counter, OrderedDict
from dataclasses import dataclass
from itertools import combinations
from typing import Callable, Iterable, Mapping

from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from spanlet.metrics import Exemplar, Family, Labels, Sample, labels
from spanlet.request_totals import REQUEST_CPU_NS, REQUEST_RUNQUEUE_NS

try:
    from spanlet._wire import serving_spans as _serving_spans
except ImportError:        # a source tree without its build: every span is looked at from Python
    _serving_spans = None
from spanlet.metrics.catalogue import family
from spanlet.metrics.windows import (EMBEDDING_ZERO_NORM, _Histograms, _LabelLimiter, _Reject,
                                     _Reservoir, _WindowHistory, cosine_distance, percentile_linear)

MODALITIES = ("text", "image", "audio", "video", "other")

ATTR_MODALITY = "mm.modality"
ATTR_SLO_CLASS = "slo.class"
ATTR_MODEL = "gen_ai.request.model"
ATTR_TTFT = "gen_ai.server.time_to_first_token"
ATTR_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
ATTR_KV_CACHE = "gen_ai.kv_cache.usage_ratio"
ATTR_PTS = "mm.pts_ns"
ATTR_DEGRADED_FROM = "mm.degraded_from"
ATTR_DEGRADED_TO = "mm.degraded_to"
ATTR_EMBEDDING = "mm.embedding"
EVENT_FIRST_TOKEN = "first_token"
RES_NAMESPACE = "k8s.namespace.name"
RES_POD = "k8s.pod.name"
_WANTED = frozenset((ATTR_MODALITY, ATTR_SLO_CLASS, ATTR_MODEL, ATTR_TTFT, ATTR_OUTPUT_TOKENS,
                     ATTR_KV_CACHE, ATTR_PTS, ATTR_DEGRADED_FROM, ATTR_DEGRADED_TO, ATTR_EMBEDDING,
                     REQUEST_CPU_NS, REQUEST_RUNQUEUE_NS))

# A span that is not a request, has no events and none of these keys adds to
# no metric (the others of _WANTED only label what these start, or are read
# from requests only).
_TRIGGER_KEYS = tuple(sorted(k.encode() for k in _WANTED - {ATTR_MODALITY, ATTR_SLO_CLASS, ATTR_MODEL,
                                                           REQUEST_CPU_NS, REQUEST_RUNQUEUE_NS}))


def _any_trigger(blob: bytes) -> bool:
    """Whether serialized spans may carry a trigger key (one memmem per key:
    faster than a regular expression of them)."""
    return any(k in blob for k in _TRIGGER_KEYS)

SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE = trace_pb2.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK   # 0x100
SPAN_FLAGS_CONTEXT_IS_REMOTE = trace_pb2.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK           # 0x200

# Upper bounds (seconds) of the request anatomy's histograms (a config key would
# be serving.request_cpu_bounds_s / serving.request_runqueue_bounds_s).
REQUEST_CPU_BOUNDS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                        2.5, 5.0, 10.0, 30.0)
REQUEST_RUNQUEUE_BOUNDS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                             0.1, 0.25, 0.5, 1.0, 2.5)

SLO_NONE = "none"        # no slo.class attribute
SLO_OTHER = "other"      # a class without a configured target

# Why a contribution did not count (label `reason`); all are always exported.
MISSING_TIMESTAMP = "missing_timestamp"
END_BEFORE_START = "end_before_start"
NOT_FINITE = "not_finite"
NEGATIVE_VALUE = "negative_value"
OUT_OF_RANGE = "out_of_range"
WRONG_TYPE = "wrong_type"
MISSING_ATTRIBUTE = "missing_attribute"
EMBEDDING_EMPTY = "embedding_empty"
EMBEDDING_TOO_LARGE = "embedding_too_large"
EMBEDDING_DIMS_MISMATCH = "embedding_dims_mismatch"
ALIGNMENT_EVICTED = "alignment_evicted"
REJECT_REASONS = (MISSING_TIMESTAMP, END_BEFORE_START, NOT_FINITE, NEGATIVE_VALUE, OUT_OF_RANGE,
                  WRONG_TYPE, MISSING_ATTRIBUTE, EMBEDDING_EMPTY, EMBEDDING_TOO_LARGE,
                  EMBEDDING_DIMS_MISMATCH, EMBEDDING_ZERO_NORM, ALIGNMENT_EVICTED)


# -- value checks ----------------------------------------------------------------

def _number(v: common_pb2.AnyValue) -> float:
    kind = v.WhichOneof("value")
    if kind == "double_value":
        x = v.double_value
    elif kind == "int_value":
        x = float(v.int_value)
    else:
        raise _Reject(WRONG_TYPE)
    if not math.isfinite(x):
        raise _Reject(NOT_FINITE)
    return x


def _non_negative(v: common_pb2.AnyValue) -> float:
    x = _number(v)
    if x < 0:
        raise _Reject(NEGATIVE_VALUE)
    return x


def _string(v: common_pb2.AnyValue | None) -> str:
    if v is None:
        raise _Reject(MISSING_ATTRIBUTE)
    if v.WhichOneof("value") != "string_value":
        raise _Reject(WRONG_TYPE)
    if not v.string_value:
        raise _Reject(MISSING_ATTRIBUTE)
    return v.string_value


def _pts_ns(v: common_pb2.AnyValue) -> int | float:
    """Integers stay integers: an epoch in ns does not fit a double's mantissa."""
    x = v.int_value if v.WhichOneof("value") == "int_value" else _number(v)
    if x < 0:
        raise _Reject(NEGATIVE_VALUE)
    return x


def _seconds_between(start_ns: int, end_ns: int, max_s: float) -> float:
    if not start_ns or not end_ns:
        raise _Reject(MISSING_TIMESTAMP)
    if end_ns < start_ns:
        raise _Reject(END_BEFORE_START)
    s = (end_ns - start_ns) / 1e9
    if s > max_s:
        raise _Reject(OUT_OF_RANGE)
    return s


def _vector(values) -> array:
    """An embedding's values as doubles; ints count as numbers."""
    return array("d", map(_number, values))


@dataclass(frozen=True, order=True)
class _Workload:
    namespace: str
    pod: str


def _agree(a: str, b: str) -> str:
    return a if a == b else ""


# -- one class per metric --------------------------------------------------------

class _HistogramMetric:
    """A metric that is one histogram per series, in `hist`; `name` is its family."""

    name: str
    hist: _Histograms

    def family(self) -> Family:
        return family(self.name, self.hist.samples())


class _WindowGauge:
    """A gauge per series that `roll` recomputes into `values`; `name` is its family."""

    name: str
    values: list[Sample]

    def family(self) -> Family:
        return family(self.name, list(self.values))


class RequestDurationSeconds(_HistogramMetric):
    """#9: duration of request (SERVER root) spans; also the window's durations
    per series, sampled, which #11 and the scheduler feed read."""

    name = "spanlet_request_duration_seconds"

    def __init__(self, s, rng: random.Random):
        self.hist = _Histograms(s.request_duration_bounds_s)
        self.cap = s.max_window_durations
        self.rng = rng
        self.window: dict[Labels, _Reservoir] = {}

    def observe(self, lab: Labels, seconds: float, now: float) -> None:
        self.hist.observe(lab, seconds, now)
        r = self.window.get(lab)
        if r is None:
            r = self.window[lab] = _Reservoir(self.cap, array("d"))
        slot = r.slot(self.rng)
        if slot is not None:
            r.put(slot, seconds)

    def close_window(self) -> dict[Labels, array]:
        closed = {lab: r.items for lab, r in self.window.items()}
        self.window = {}
        return closed



class TimeToFirstTokenSeconds(_HistogramMetric):
    """#10: span start to its first `first_token` event, else the attribute."""

    name = "spanlet_time_to_first_token_seconds"

    def __init__(self, s):
        self.hist = _Histograms(s.time_to_first_token_bounds_s)
        self.max_s = s.max_duration_s

    def observe(self, span: trace_pb2.Span, first_token_ns: int | None,
                attr: common_pb2.AnyValue | None, lab: Labels, now: float) -> None:
        self.hist.observe(lab, self.seconds(span.start_time_unix_nano, first_token_ns, attr), now)

    def seconds(self, start_ns: int, first_token_ns: int | None,
                attr: common_pb2.AnyValue | None) -> float:
        """From the event when there is one, else from the attribute."""
        if first_token_ns is not None:
            if first_token_ns and start_ns and first_token_ns < start_ns:
                raise _Reject(NEGATIVE_VALUE)
            return _seconds_between(start_ns, first_token_ns, self.max_s)
        x = _non_negative(attr)
        if x > self.max_s:
            raise _Reject(OUT_OF_RANGE)
        return x



class _RequestAnatomySeconds(_HistogramMetric):
    """A histogram per series of one kernel.request.* attribute (ns) of
    requests, in seconds; each bucket keeps the exemplar of its latest
    observation."""

    attribute: str
    bounds: tuple[float, ...]

    def __init__(self, s):
        self.hist = _Histograms(self.bounds)
        self.max_s = s.max_duration_s
        self.exemplars: dict[Labels, list] = {}      # per series, per bucket: Exemplar or None
        self.seen: dict[Labels, float] = {}          # when each series was last observed

    def observe(self, span: trace_pb2.Span, value: common_pb2.AnyValue, lab: Labels, now: float,
                wall_s: float) -> None:
        seconds = _non_negative(value) / 1e9
        if seconds > self.max_s:
            raise _Reject(OUT_OF_RANGE)
        self.hist.observe(lab, seconds, now)
        row = self.exemplars.get(lab)
        if row is None:
            row = self.exemplars[lab] = [None] * (len(self.bounds) + 1)
        row[bisect_left(self.bounds, seconds)] = Exemplar(bytes(span.trace_id), bytes(span.span_id),
                                                          seconds, wall_s)
        self.seen[lab] = now

    def expire(self, cutoff: float) -> None:
        self.hist.expire(cutoff)
        for lab in [k for k, t in self.seen.items() if t < cutoff]:
            del self.seen[lab], self.exemplars[lab]

    def family(self) -> Family:
        return family(self.name, [dataclasses.replace(h, exemplars=tuple(self.exemplars[h.labels]))
                                  for h in self.hist.samples()])


class RequestCpuSeconds(_RequestAnatomySeconds):
    """Request anatomy: CPU time of a request's in-process span subtree."""

    name = "spanlet_request_cpu_seconds"
    attribute = REQUEST_CPU_NS
    bounds = REQUEST_CPU_BOUNDS_S


class RequestRunqueueSeconds(_RequestAnatomySeconds):
    """Request anatomy: the same request's time runnable, waiting for a CPU."""

    name = "spanlet_request_runqueue_seconds"
    attribute = REQUEST_RUNQUEUE_NS
    bounds = REQUEST_RUNQUEUE_BOUNDS_S


class P99LatencyVolatilityRatio(_WindowGauge):
    """#11: stddev / mean of the per-window p99 of #9 over the last N windows."""

    name = "spanlet_p99_latency_volatility_ratio"

    def __init__(self, s):
        self.history = _WindowHistory(s.volatility_windows)
        self.values: list[Sample] = []

    def roll(self, window_durations: Mapping[Labels, array]) -> None:
        self.history.push({lab: percentile_linear(d, 99) for lab, d in window_durations.items()
                           if len(d)})
        self.values = []
        for lab, p99s in self.history.defined():
            if len(p99s) >= 2 and (mean := statistics.fmean(p99s)) > 0:
                self.values.append(Sample(lab, statistics.pstdev(p99s) / mean))



class SloComplianceRatio(_WindowGauge):
    """#12: share of the window's requests that met their class target."""

    name = "spanlet_slo_compliance_ratio"

    def __init__(self, s):
        self.targets = s.slo_target_s
        self.window: dict[Labels, list[int]] = {}    # labels -> [met, requests]
        self.values: list[Sample] = []

    def observe(self, lab: Labels, slo_class: str, seconds: float) -> None:
        target = self.targets.get(slo_class)
        if target is None:
            return
        c = self.window.setdefault(lab, [0, 0])
        c[0] += seconds <= target
        c[1] += 1

    def roll(self) -> None:
        self.values = [Sample(lab, met / n) for lab, (met, n) in sorted(self.window.items())]
        self.window = {}



class ThroughputDecayRatio(_WindowGauge):
    """#13: 1 - observed output tokens/s / the model's configured peak."""

    name = "spanlet_throughput_decay_ratio"

    def __init__(self, s):
        self.s = s
        self.tokens: dict[tuple[_Workload, str], float] = {}
        self.kv_max: dict[tuple[_Workload, str], float] = {}
        self.values: list[Sample] = []

    def observe(self, w: _Workload, attrs: Mapping[str, common_pb2.AnyValue]) -> None:
        tokens, kv = attrs.get(ATTR_OUTPUT_TOKENS), attrs.get(ATTR_KV_CACHE)
        if tokens is None and kv is None:
            return
        model = _string(attrs.get(ATTR_MODEL))
        if model not in self.s.peak_tokens_per_s:
            return
        n = None if tokens is None else _non_negative(tokens)
        r = None if kv is None else _non_negative(kv)
        if r is not None and r > 1:
            raise _Reject(OUT_OF_RANGE)
        key = (w, model)                  # both checked: a span counts whole or not at all
        if n is not None:
            self.tokens[key] = self.tokens.get(key, 0.0) + n
        if r is not None:
            self.kv_max[key] = max(self.kv_max.get(key, 0.0), r)

    def bottleneck(self, device: Mapping | None, kv: float | None) -> str:
        device = device or {}
        mem, pcie = device.get("memory_used_ratio_max"), device.get("pcie_ratio_max")
        if mem is not None and mem >= self.s.memory_bottleneck_ratio:
            return "gpu_memory"
        if pcie is not None and pcie >= self.s.pcie_bottleneck_ratio:
            return "pcie"
        if kv is not None and kv >= self.s.kv_cache_bottleneck_ratio:
            return "kv_cache"
        return "none"

    def roll(self, length_s: float | None, device: Mapping | None) -> None:
        self.values = []
        if length_s is not None and length_s > 0:
            for (w, model), n in sorted(self.tokens.items()):
                tdr = 1.0 - (n / length_s) / self.s.peak_tokens_per_s[model]
                lab = labels(namespace=w.namespace, pod=w.pod, model=model,
                             bottleneck=self.bottleneck(device, self.kv_max.get((w, model))))
                self.values.append(Sample(lab, tdr))
        self.tokens, self.kv_max = {}, {}



class ModalityAlignmentDelaySeconds(_HistogramMetric):
    """#14: audio/video presentation time skew beyond δ_sync, once per trace."""

    name = "spanlet_modality_alignment_delay_seconds"

    def __init__(self, s):
        self.s = s
        self.hist = _Histograms(s.alignment_delay_bounds_s)
        # trace id -> (arrival, modality, pts_ns, workload) of its first media span
        self._waiting: OrderedDict[bytes, tuple[float, str, int, _Workload]] = OrderedDict()
        self._paired: OrderedDict[bytes, float] = OrderedDict()   # traces already measured
        self.evicted = 0

    def observe(self, trace_id: bytes, modality: str, pts: common_pb2.AnyValue, w: _Workload,
                now: float) -> None:
        pts_ns = _pts_ns(pts)
        if modality not in ("audio", "video"):
            return
        if len(trace_id) != 16:
            raise _Reject(MISSING_ATTRIBUTE)
        if trace_id in self._paired:
            return
        first = self._waiting.get(trace_id)
        if first is None:
            self._waiting[trace_id] = (now, modality, pts_ns, w)
            self.expire(now)
            return
        if first[1] == modality:
            return
        del self._waiting[trace_id]
        self._paired[trace_id] = now
        delay = max(0.0, abs(pts_ns - first[2]) / 1e9 - self.s.delta_sync_s)
        lab = labels(namespace=_agree(first[3].namespace, w.namespace),
                     pod=_agree(first[3].pod, w.pod))
        self.hist.observe(lab, delay, now)
        self.expire(now)

    def expire(self, now: float) -> None:
        cutoff, cap = now - self.s.alignment_ttl_s, self.s.alignment_max_pending
        while self._waiting and (len(self._waiting) > cap
                                 or next(iter(self._waiting.values()))[0] < cutoff):
            self._waiting.popitem(last=False)
            self.evicted += 1
        while self._paired and (len(self._paired) > cap or next(iter(self._paired.values())) < cutoff):
            self._paired.popitem(last=False)

    def pending(self) -> int:
        return len(self._waiting)



class ModalityDegradationsTotal:
    """#15: modality fallbacks reported by spans."""

    def __init__(self):
        self.counts: dict[Labels, list] = {}      # labels -> [count, last seen]

    def observe(self, lab: Labels, now: float) -> None:
        c = self.counts.setdefault(lab, [0, now])
        c[0] += 1
        c[1] = now

    def expire(self, cutoff: float) -> None:
        for lab in [k for k, c in self.counts.items() if c[1] < cutoff]:
            del self.counts[lab]

    def family(self) -> Family:
        return family("spanlet_modality_degradations_total",
                      [Sample(lab, c[0]) for lab, c in sorted(self.counts.items())])


class EmbeddingDriftScore(_WindowGauge):
    """#16: CMSD, stddev over windows of the cosine distance between two
    modalities' mean embeddings."""

    name = "spanlet_embedding_drift_score"

    def __init__(self, s, rng: random.Random):
        self.s = s
        self.rng = rng
        self.window: dict[tuple[_Workload, str], _Reservoir] = {}
        self.dims: dict[tuple[_Workload, str], int] = {}     # of the window's first kept one
        self.history = _WindowHistory(s.drift_windows)
        self.values: list[Sample] = []

    def observe(self, w: _Workload, modality: str, value: common_pb2.AnyValue) -> None:
        if value.WhichOneof("value") != "array_value":
            raise _Reject(WRONG_TYPE)
        raw = value.array_value.values
        if not raw:
            raise _Reject(EMBEDDING_EMPTY)
        if len(raw) > self.s.embedding_max_dims:
            raise _Reject(EMBEDDING_TOO_LARGE)
        key = (w, modality)
        if self.dims.get(key, len(raw)) != len(raw):
            raise _Reject(EMBEDDING_DIMS_MISMATCH)
        r = self.window.get(key)
        if r is None:
            r = self.window[key] = _Reservoir(self.s.embedding_samples_per_window)
        slot = r.slot(self.rng)
        if slot is None:
            return                      # not sampled: never parsed, the costly part
        try:
            r.put(slot, _vector(raw))
        except _Reject:
            r.retract()
            raise
        self.dims[key] = len(raw)

    def roll(self) -> Counter:
        """Close the window; returns the pairs left out of it, by reason."""
        means: dict[_Workload, dict[str, list[float]]] = {}
        for (w, modality), r in self.window.items():
            if r.items:
                n = len(r.items)
                means.setdefault(w, {})[modality] = [math.fsum(c) / n for c in zip(*r.items)]
        distances, left_out = {}, Counter()
        for w, by_modality in means.items():
            for a, b in combinations(sorted(by_modality), 2):
                try:
                    if len(by_modality[a]) != len(by_modality[b]):
                        raise _Reject(EMBEDDING_DIMS_MISMATCH)
                    d = cosine_distance(by_modality[a], by_modality[b])
                except _Reject as r:
                    left_out[r.reason] += 1
                    continue
                distances[labels(namespace=w.namespace, pod=w.pod, pair=f"{a}-{b}")] = d
        self.history.push(distances)
        self.values = [Sample(lab, statistics.pstdev(ds))
                       for lab, ds in self.history.defined() if len(ds) >= 2]
        self.window, self.dims = {}, {}
        return left_out



# -- the engine ------------------------------------------------------------------

def is_request(span: trace_pb2.Span) -> bool:
    """A SERVER span whose parent is not a local span (see the module doc)."""
    if span.kind != trace_pb2.Span.SPAN_KIND_SERVER:
        return False
    if not span.parent_span_id or span.flags & SPAN_FLAGS_CONTEXT_IS_REMOTE:
        return True
    return not span.flags & SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE


def _first_token_ns(span: trace_pb2.Span) -> int | None:
    """Time of the span's earliest `first_token` event, None without one."""
    return min((e.time_unix_nano for e in span.events if e.name == EVENT_FIRST_TOKEN),
               default=None)


def _modality(v: common_pb2.AnyValue | None) -> str:
    if v is not None and v.WhichOneof("value") == "string_value" and v.string_value in MODALITIES:
        return v.string_value
    return "other"


def _resource_strings(rs: trace_pb2.ResourceSpans) -> tuple[str, str]:
    ns = pod = ""
    for kv in rs.resource.attributes:
        if kv.key == RES_NAMESPACE and kv.value.WhichOneof("value") == "string_value":
            ns = kv.value.string_value
        elif kv.key == RES_POD and kv.value.WhichOneof("value") == "string_value":
            pod = kv.value.string_value
    return ns, pod


class ServingMetrics:
    """Metrics #9-#16 from joined spans. Thread-safe: one lock around observe,
    roll and families; a batch holds it ~3 µs per span without triggers, ~20 µs
    for a request span, ~1 ms per sampled 1024-d embedding (K per window).

    `settings`: a spanlet.config.ServingSettings, or any object with its
    attributes. `start`: the beginning of the first window on the caller's clock (the same
    clock as `now`); without it the first window starts at the first call.
    `wall_clock`: epoch seconds, for exemplars (never going back)."""

    def __init__(self, settings, start: float | None = None,
                 wall_clock: Callable[[], float] = time.time):
        s = self.s = settings
        rng = random.Random(0)        # sampling need not be unpredictable, only uniform
        self._lock = threading.Lock()
        self._window_start = start
        self._rejected: Counter = Counter()
        self._limiter = _LabelLimiter(s.max_label_values, s.series_idle_s)
        self._last_durations: dict[Labels, array] = {}
        self._label_cache: dict[tuple[_Workload, str, str], Labels] = {}
        self.request_duration = RequestDurationSeconds(s, rng)
        self.time_to_first_token = TimeToFirstTokenSeconds(s)
        self.volatility = P99LatencyVolatilityRatio(s)
        self.compliance = SloComplianceRatio(s)
        self.throughput_decay = ThroughputDecayRatio(s)
        self.alignment = ModalityAlignmentDelaySeconds(s)
        self.degradations = ModalityDegradationsTotal()
        self.drift = EmbeddingDriftScore(s, rng)
        self.anatomy = (RequestCpuSeconds(s), RequestRunqueueSeconds(s))
        self._wall_clock = wall_clock
        self._wall_s = 0.0                # of the observe() under way, never less than before

    # -- input -------------------------------------------------------------------
    def observe(self, resource_spans: Iterable[trace_pb2.ResourceSpans], now: float,
                blobs: list | None = None) -> None:
        """`blobs`: per ResourceSpans, serialized bytes of its spans as they
        are (SpanJoin.join's), or None; without them each is serialized."""
        with self._lock:
            if self._window_start is None:
                self._window_start = now
            self._wall_s = max(self._wall_s, self._wall_clock())
            for i, rs in enumerate(resource_spans):
                ns, pod = _resource_strings(rs)
                w = _Workload(self._limiter.value("namespace", ns, now) if ns else "",
                              self._limiter.value("pod", pod, now) if pod else "")
                blob = blobs[i] if blobs is not None and blobs[i] is not None else rs.SerializeToString()
                # Reading attributes from Python costs ~1.5 µs each: a search
                # of the bytes says which spans may carry a trigger at all.
                hot = _any_trigger(blob)
                # Without one, only requests and spans with events can count:
                # C names them (a span costs ~0.1 µs there, ~3 µs here).
                picked = None if hot or _serving_spans is None else _serving_spans(blob)
                if picked is not None:
                    scopes = rs.scope_spans
                    for s, j in picked:
                        self._observe_span(scopes[s].spans[j], w, now, False)
                    continue
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        self._observe_span(span, w, now, hot)

    def _observe_span(self, span: trace_pb2.Span, w: _Workload, now: float, hot: bool = True) -> None:
        # Triggers are tested before anything is computed: most spans carry none.
        request = is_request(span)
        if not request and not span.events and \
                (not hot or not _any_trigger(span.SerializeToString())):
            return
        attrs = {kv.key: kv.value for kv in span.attributes if kv.key in _WANTED}
        modality = _modality(attrs.get(ATTR_MODALITY))
        ttft = attrs.get(ATTR_TTFT)
        first_token = _first_token_ns(span) if span.events else None
        if request or ttft is not None or first_token is not None:
            slo_class = self._slo_class(attrs.get(ATTR_SLO_CLASS))
            lab = self._labels(w, modality, slo_class)
            if request:
                self._try(self._observe_request, span, lab, slo_class, now)
                for metric in self.anatomy:
                    value = attrs.get(metric.attribute)
                    if value is not None:
                        self._try(metric.observe, span, value, lab, now, self._wall_s)
            if ttft is not None or first_token is not None:
                self._try(self.time_to_first_token.observe, span, first_token, ttft, lab, now)
        if ATTR_OUTPUT_TOKENS in attrs or ATTR_KV_CACHE in attrs:
            self._try(self.throughput_decay.observe, w, attrs)
        if ATTR_PTS in attrs:
            self._try(self._observe_alignment, span, attrs, w, now)
        if ATTR_DEGRADED_FROM in attrs or ATTR_DEGRADED_TO in attrs:
            self._try(self._observe_degradation, attrs, w, now)
        if ATTR_EMBEDDING in attrs:
            self._try(self.drift.observe, w, modality, attrs[ATTR_EMBEDDING])

    def _labels(self, w: _Workload, modality: str, slo_class: str) -> Labels:
        """Labels of #9-#12, cached: bounded by the limiter, emptied at roll."""
        key = (w, modality, slo_class)
        lab = self._label_cache.get(key)
        if lab is None:
            lab = self._label_cache[key] = labels(namespace=w.namespace, pod=w.pod,
                                                  modality=modality, slo_class=slo_class)
        return lab

    def _try(self, contribute, *args) -> None:
        try:
            contribute(*args)
        except _Reject as r:
            self._rejected[r.reason] += 1

    def _slo_class(self, v: common_pb2.AnyValue | None) -> str:
        if v is None:
            return SLO_NONE
        if v.WhichOneof("value") == "string_value" and v.string_value in self.s.slo_target_s:
            return v.string_value
        return SLO_OTHER

    def _observe_request(self, span, lab: Labels, slo_class: str, now: float) -> None:
        seconds = _seconds_between(span.start_time_unix_nano, span.end_time_unix_nano,
                                   self.s.max_duration_s)
        self.request_duration.observe(lab, seconds, now)
        self.compliance.observe(lab, slo_class, seconds)

    def _observe_alignment(self, span, attrs, w: _Workload, now: float) -> None:
        if ATTR_MODALITY not in attrs:
            raise _Reject(MISSING_ATTRIBUTE)
        self.alignment.observe(bytes(span.trace_id), _modality(attrs[ATTR_MODALITY]),
                               attrs[ATTR_PTS], w, now)

    def _observe_degradation(self, attrs, w: _Workload, now: float) -> None:
        src = _string(attrs.get(ATTR_DEGRADED_FROM))
        dst = _string(attrs.get(ATTR_DEGRADED_TO))
        lab = labels(namespace=w.namespace, pod=w.pod,
                     **{"from": self._limiter.value("from", src, now),
                        "to": self._limiter.value("to", dst, now)})
        self.degradations.observe(lab, now)

    # -- windows -----------------------------------------------------------------
    def roll(self, now: float, device: Mapping | None = None) -> None:
        """Close the window that ends now. `device`: memory_used_ratio_max and
        pcie_ratio_max of the window from NVML (None or missing: unknown)."""
        with self._lock:
            length = None if self._window_start is None else now - self._window_start
            self._window_start = now
            self._last_durations = self.request_duration.close_window()
            self.volatility.roll(self._last_durations)
            self.compliance.roll()
            self.throughput_decay.roll(length, device)
            self._rejected.update(self.drift.roll())
            self.alignment.expire(now)
            cutoff = now - self.s.series_idle_s
            for hist in (self.request_duration.hist, self.time_to_first_token.hist,
                         self.alignment.hist):
                hist.expire(cutoff)
            self.degradations.expire(cutoff)
            for metric in self.anatomy:
                metric.expire(cutoff)
            self._limiter.prune(now)
            self._label_cache = {}

    def window_quantile(self, modality: str, q: float) -> float | None:
        """The q-th percentile (0..100) of request durations of one modality in
        the last closed window, all pods and classes together (the scheduler
        feed's audio p95); None without requests."""
        with self._lock:
            pooled = [x for lab, d in self._last_durations.items()
                      if dict(lab)["modality"] == modality for x in d]
        return percentile_linear(pooled, q) if pooled else None

    # -- output ------------------------------------------------------------------
    @property
    def rejected(self) -> dict[str, int]:
        """Contributions that did not count since start, by reason (all reasons)."""
        with self._lock:
            return self._rejected_locked()

    def _rejected_locked(self) -> dict[str, int]:
        counts = {r: self._rejected[r] for r in REJECT_REASONS}
        counts[ALIGNMENT_EVICTED] = self.alignment.evicted
        return counts

    def families(self) -> list[Family]:
        with self._lock:
            rejected = family("spanlet_serving_rejected_total",
                              [Sample(labels(reason=r), n)
                               for r, n in self._rejected_locked().items()])
            overflow = family("spanlet_serving_label_overflow_total",
                              [Sample(labels(label=k), n)
                               for k, n in sorted(self._limiter.overflows.items())])
            return [self.request_duration.family(), self.time_to_first_token.family(),
                    self.volatility.family(), self.compliance.family(),
                    self.throughput_decay.family(), self.alignment.family(),
                    self.degradations.family(), self.drift.family(),
                    *(metric.family() for metric in self.anatomy), rejected, overflow]
