"""Serving metrics #9-#16 from hand-built OTLP spans, each checked against an
independent computation: numpy for percentiles, cosine distances and stddevs,
hand-computed values for the rest; window rolling, every bad-input rule and
bounded label cardinality."""

import math
import threading

import numpy as np
import pytest
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from spanlet.metrics import HistogramSample
from spanlet.config import ServingSettings
from spanlet.metrics.serving import REJECT_REASONS, ServingMetrics
from spanlet.metrics.windows import percentile_linear

SERVER = trace_pb2.Span.SPAN_KIND_SERVER
INTERNAL = trace_pb2.Span.SPAN_KIND_INTERNAL
T0 = 1_700_000_000_000_000_000          # an epoch in ns
HAS_IS_REMOTE, IS_REMOTE = 0x100, 0x200

_ids = iter(range(1, 10**9))


def any_value(v) -> common_pb2.AnyValue:
    out = common_pb2.AnyValue()
    if isinstance(v, bool):
        out.bool_value = v
    elif isinstance(v, int):
        out.int_value = v
    elif isinstance(v, float):
        out.double_value = v
    elif isinstance(v, str):
        out.string_value = v
    elif isinstance(v, (list, tuple, np.ndarray)):
        out.array_value.SetInParent()          # an empty array is still an array
        for x in v:
            out.array_value.values.append(any_value(float(x) if isinstance(x, np.floating) else x))
    else:
        raise TypeError(v)
    return out


def span(*, kind=INTERNAL, start=T0, dur_s=0.1, end=None, parent=b"", flags=0, trace=None,
         events=(), **attrs):
    """attrs: python names with '__' for '.' (mm__modality -> mm.modality)."""
    s = trace_pb2.Span(trace_id=trace or next(_ids).to_bytes(16, "big"),
                       span_id=next(_ids).to_bytes(8, "big"), parent_span_id=parent, kind=kind,
                       flags=flags, start_time_unix_nano=start,
                       end_time_unix_nano=end if end is not None else start + round(dur_s * 1e9))
    for k, v in attrs.items():
        s.attributes.add(key=k.replace("__", ".")).value.CopyFrom(any_value(v))
    for name, t in events:
        s.events.add(name=name, time_unix_nano=t)
    return s


def request(dur_s, modality=None, slo=None, **kw):
    attrs = dict(kw)
    if modality is not None:
        attrs["mm__modality"] = modality
    if slo is not None:
        attrs["slo__class"] = slo
    return span(kind=SERVER, dur_s=dur_s, **attrs)


def batch(*spans, ns=None, pod=None):
    res = resource_pb2.Resource()
    if ns is not None:
        res.attributes.add(key="k8s.namespace.name").value.string_value = ns
    if pod is not None:
        res.attributes.add(key="k8s.pod.name").value.string_value = pod
    return [trace_pb2.ResourceSpans(resource=res, scope_spans=[trace_pb2.ScopeSpans(spans=spans)])]


def family(m, name):
    fams = {f.name: f for f in m.families()}
    return fams[name]


def values(m, name):
    """{frozenset of label items: value or HistogramSample}"""
    return {frozenset(s.labels): (s if isinstance(s, HistogramSample) else s.value)
            for s in family(m, name).samples}


def lab(**kw):
    return frozenset(({"namespace": "", "pod": ""} | kw).items())


def hist_counts(xs, bounds):
    """Independent bucketing: per bound, how many x satisfy prev < x <= bound."""
    edges = [-math.inf] + list(bounds) + [math.inf]
    return tuple(sum(1 for x in xs if lo < x <= hi) for lo, hi in zip(edges, edges[1:]))


# -- #9 request duration ----------------------------------------------------------

def test_request_duration_counts_root_server_spans_only():
    m = ServingMetrics(ServingSettings(), start=0.0)
    m.observe(batch(
        request(0.15, "image", "gold"),
        request(0.25, "image", "gold"),
        request(0.003, "audio"),                                      # no slo.class: "none"
        span(kind=SERVER, dur_s=0.4, parent=b"\1" * 8, flags=HAS_IS_REMOTE | IS_REMOTE,
             mm__modality="image", slo__class="gold"),               # remote parent: a request
        span(kind=SERVER, dur_s=0.5, parent=b"\1" * 8, flags=0,
             mm__modality="image", slo__class="gold"),               # SDK does not say: a request
        span(kind=SERVER, dur_s=9.0, parent=b"\1" * 8, flags=HAS_IS_REMOTE,
             mm__modality="image", slo__class="gold"),               # local parent: not one
        span(kind=INTERNAL, dur_s=9.0, mm__modality="image", slo__class="gold"),
        request(0.7, "hologram", "platinum"),                        # unknown -> other, other
    ), now=1.0)
    v = values(m, "spanlet_request_duration_seconds")
    assert set(v) == {lab(modality="image", slo_class="gold"), lab(modality="audio", slo_class="none"),
                      lab(modality="other", slo_class="other")}
    gold = v[lab(modality="image", slo_class="gold")]
    bounds = ServingSettings().request_duration_bounds_s
    assert gold.count == 4
    assert gold.sum == pytest.approx(0.15 + 0.25 + 0.4 + 0.5)
    assert gold.bucket_counts == hist_counts([0.15, 0.25, 0.4, 0.5], bounds)
    # by hand: 0.15 in (0.1, 0.2], 0.25 in (0.2, 0.3], 0.4 in (0.3, 0.4], 0.5 in (0.4, 0.5]
    i = bounds.index
    assert [gold.bucket_counts[i(b)] for b in (0.2, 0.3, 0.4, 0.5)] == [1, 1, 1, 1]
    assert v[lab(modality="audio", slo_class="none")].bucket_counts[i(0.004)] == 1


def test_request_duration_labels_come_from_the_resource():
    m = ServingMetrics(ServingSettings(), start=0.0)
    m.observe(batch(request(0.1, "text"), ns="serving", pod="llm-0"), now=1.0)
    (s,) = family(m, "spanlet_request_duration_seconds").samples
    assert dict(s.labels) == {"namespace": "serving", "pod": "llm-0", "modality": "text",
                              "slo_class": "none"}


def test_histograms_are_cumulative_across_windows():
    m = ServingMetrics(ServingSettings(), start=0.0)
    m.observe(batch(request(0.1, "text")), now=1.0)
    m.roll(10.0)
    m.observe(batch(request(0.2, "text")), now=11.0)
    m.roll(20.0)
    (s,) = family(m, "spanlet_request_duration_seconds").samples
    assert s.count == 2 and s.sum == pytest.approx(0.3)


# -- #10 time to first token --------------------------------------------------------

def test_time_to_first_token_from_event_else_attribute():
    m = ServingMetrics(ServingSettings(), start=0.0)
    m.observe(batch(
        span(events=[("kernel.gpu.launch", T0 + 10), ("first_token", T0 + 300_000_000),
                     ("first_token", T0 + 120_000_000)], mm__modality="text"),   # earliest: 0.12
        span(gen_ai__server__time_to_first_token=0.45, mm__modality="text"),
        span(events=[("first_token", T0 + 50_000_000)], gen_ai__server__time_to_first_token=9.0,
             mm__modality="text"),                                               # event wins: 0.05
        span(mm__modality="text"),                                               # neither: nothing
    ), now=1.0)
    (s,) = family(m, "spanlet_time_to_first_token_seconds").samples
    assert s.count == 3
    assert s.sum == pytest.approx(0.12 + 0.45 + 0.05)
    assert s.bucket_counts == hist_counts([0.12, 0.45, 0.05],
                                          ServingSettings().time_to_first_token_bounds_s)


# -- #11 p99 volatility ------------------------------------------------------------

def test_p99_volatility_matches_numpy_over_the_last_n_windows():
    rng = np.random.default_rng(7)
    s = ServingSettings(volatility_windows=4)
    m = ServingMetrics(s, start=0.0)
    p99s = []
    for w in range(7):
        if w == 2:                       # a window without requests: not among the p99s
            p99s.append(None)
        else:
            # as the spans carry them: whole nanoseconds
            durations = np.round(rng.lognormal(-2.0, 0.5 + 0.1 * w, size=37 + w) * 1e9) / 1e9
            m.observe(batch(*[request(float(d), "video", "silver") for d in durations]),
                      now=10.0 * w + 1)
            p99s.append(np.percentile(durations, 99, method="linear"))
        m.roll(10.0 * (w + 1))
        last = [p for p in p99s[-4:] if p is not None]
        got = values(m, "spanlet_p99_latency_volatility_ratio")
        if len(last) < 2:
            assert got == {}
        else:
            want = np.std(last) / np.mean(last)          # population stddev (ddof=0)
            assert got == {lab(modality="video", slo_class="silver"): pytest.approx(want, rel=1e-9)}


def test_volatility_disappears_when_the_windows_with_requests_age_out():
    m = ServingMetrics(ServingSettings(volatility_windows=2), start=0.0)
    for w in range(2):
        m.observe(batch(request(0.1 * (w + 1), "text")), now=10.0 * w + 1)
        m.roll(10.0 * (w + 1))
    assert values(m, "spanlet_p99_latency_volatility_ratio") == {
        lab(modality="text", slo_class="none"): pytest.approx(np.std([0.1, 0.2]) / 0.15)}
    m.roll(30.0)
    assert values(m, "spanlet_p99_latency_volatility_ratio") == {}    # one window left


@pytest.mark.parametrize("q", [0, 1, 50, 95, 99, 100])
def test_percentile_is_numpys_linear_method(q):
    xs = np.random.default_rng(q).exponential(size=101)
    assert percentile_linear(xs, q) == pytest.approx(np.percentile(xs, q, method="linear"))
    assert percentile_linear([3.0], q) == 3.0


def test_window_quantile_pools_one_modality_of_the_last_window():
    m = ServingMetrics(ServingSettings(), start=0.0)
    audio = [0.002, 0.004, 0.006, 0.010]
    m.observe(batch(*[request(d, "audio", "gold") for d in audio[:2]], ns="a", pod="p1")
              + batch(*[request(d, "audio") for d in audio[2:]], ns="a", pod="p2")
              + batch(request(5.0, "text")), now=1.0)
    assert m.window_quantile("audio", 95) is None       # nothing closed yet
    m.roll(10.0)
    assert m.window_quantile("audio", 95) == pytest.approx(np.percentile(audio, 95))
    assert m.window_quantile("video", 95) is None


# -- #12 SLO compliance --------------------------------------------------------------

def test_slo_compliance_per_class_and_window():
    m = ServingMetrics(ServingSettings(), start=0.0)
    m.observe(batch(*[request(d, "text", "gold") for d in (0.1, 0.2, 0.21, 0.5)],   # 2 of 4 (<= 0.2 meets)
                    *[request(d, "text", "silver") for d in (0.4, 0.6, 0.45)],       # 2 of 3
                    request(0.79, "image", "bronze"),                                 # 1 of 1
                    request(0.1, "text")), now=1.0)                                   # no class: none
    assert values(m, "spanlet_slo_compliance_ratio") == {}     # gauges: closed windows only
    m.roll(10.0)
    assert values(m, "spanlet_slo_compliance_ratio") == {
        lab(modality="text", slo_class="gold"): 0.5,
        lab(modality="text", slo_class="silver"): 2 / 3,
        lab(modality="image", slo_class="bronze"): 1.0}
    m.observe(batch(request(0.9, "text", "gold")), now=11.0)
    m.roll(20.0)
    assert values(m, "spanlet_slo_compliance_ratio") == {lab(modality="text", slo_class="gold"): 0.0}


def test_slo_targets_are_configurable():
    m = ServingMetrics(ServingSettings(slo_target_s={"fast": 0.05}), start=0.0)
    m.observe(batch(request(0.04, "text", "fast"), request(0.06, "text", "fast"),
                    request(0.01, "text", "gold")), now=1.0)       # gold is not configured now
    m.roll(10.0)
    assert values(m, "spanlet_slo_compliance_ratio") == {lab(modality="text", slo_class="fast"): 0.5}
    assert lab(modality="text", slo_class="other") in values(m, "spanlet_request_duration_seconds")


# -- #13 throughput decay --------------------------------------------------------------

PEAKS = {"llava-13b": 1000.0, "whisper": 50.0}


def tokens_span(model, tokens, kv=None):
    attrs = {"gen_ai__request__model": model, "gen_ai__usage__output_tokens": tokens}
    if kv is not None:
        attrs["gen_ai__kv_cache__usage_ratio"] = kv
    return span(**attrs)


def tdr_for(spans, device=None, length=10.0):
    m = ServingMetrics(ServingSettings(peak_tokens_per_s=PEAKS), start=100.0)
    m.observe(batch(*spans, ns="serving", pod="vlm-0"), now=101.0)
    m.roll(100.0 + length, device)
    return {(dict(s.labels)["model"], dict(s.labels)["bottleneck"]): s.value
            for s in family(m, "spanlet_throughput_decay_ratio").samples}


def test_throughput_decay_is_one_minus_observed_over_peak():
    got = tdr_for([tokens_span("llava-13b", 1500), tokens_span("llava-13b", 2500.0),
                   tokens_span("whisper", 100), tokens_span("unknown-model", 10**6)], length=8.0)
    # llava: 4000 tokens / 8 s = 500/s of 1000 -> 0.5; whisper: 12.5/s of 50 -> 0.75
    assert got == {("llava-13b", "none"): pytest.approx(0.5), ("whisper", "none"): pytest.approx(0.75)}


def test_throughput_decay_absent_without_tokens_or_peak():
    assert tdr_for([span(mm__modality="text")]) == {}
    m = ServingMetrics(ServingSettings(), start=0.0)   # no peaks configured: no TDR at all
    m.observe(batch(tokens_span("llava-13b", 100)), now=1.0)
    m.roll(10.0)
    assert values(m, "spanlet_throughput_decay_ratio") == {}


def test_throughput_decay_labels_carry_the_pod():
    m = ServingMetrics(ServingSettings(peak_tokens_per_s=PEAKS), start=0.0)
    m.observe(batch(tokens_span("whisper", 250), ns="asr", pod="w-0")
              + batch(tokens_span("whisper", 400), ns="asr", pod="w-1"), now=1.0)
    m.roll(10.0)
    assert values(m, "spanlet_throughput_decay_ratio") == {
        frozenset({"namespace": "asr", "pod": "w-0", "model": "whisper", "bottleneck": "none"}.items()): 0.5,
        frozenset({"namespace": "asr", "pod": "w-1", "model": "whisper", "bottleneck": "none"}.items()): pytest.approx(0.2)}


@pytest.mark.parametrize("device, kv, bottleneck", [
    ({"memory_used_ratio_max": 0.95, "pcie_ratio_max": 0.99}, 0.9, "gpu_memory"),   # level 1 first
    ({"memory_used_ratio_max": 0.949, "pcie_ratio_max": 0.85}, 0.9, "pcie"),
    ({"memory_used_ratio_max": 0.5, "pcie_ratio_max": 0.849}, 0.70, "kv_cache"),
    ({"memory_used_ratio_max": 0.5, "pcie_ratio_max": 0.5}, 0.699, "none"),
    ({"memory_used_ratio_max": None, "pcie_ratio_max": None}, 0.8, "kv_cache"),     # NVML absent
    (None, None, "none"),
])
def test_throughput_decay_bottleneck_rule(device, kv, bottleneck):
    spans = [tokens_span("llava-13b", 5000, kv)]
    if kv is not None:                      # the max over the window decides
        spans.append(tokens_span("llava-13b", 0, kv / 2))
    assert tdr_for(spans, device) == {("llava-13b", bottleneck): pytest.approx(0.5)}


def test_throughput_decay_uses_the_real_window_length():
    m = ServingMetrics(ServingSettings(peak_tokens_per_s=PEAKS), start=0.0)
    m.observe(batch(tokens_span("whisper", 200)), now=1.0)
    m.roll(20.0)                                     # a late roll: 20 s, not window_s
    (s,) = family(m, "spanlet_throughput_decay_ratio").samples
    assert s.value == pytest.approx(1 - (200 / 20) / 50)
    m.roll(30.0)                                     # no tokens in the next window: absent
    assert family(m, "spanlet_throughput_decay_ratio").samples == []


# -- #14 alignment delay ---------------------------------------------------------------

def media(trace, modality, pts, **kw):
    return span(trace=trace, mm__modality=modality, mm__pts_ns=pts, **kw)


def test_alignment_delay_per_trace_pair_clamped_at_zero():
    t1, t2, t3 = (bytes([i]) * 16 for i in (1, 2, 3))
    m = ServingMetrics(ServingSettings(), start=0.0)
    m.observe(batch(media(t1, "audio", T0), media(t1, "video", T0 + 56_700_000),       # 40 ms beyond
                    media(t2, "video", T0 + 10_000_000), media(t2, "audio", T0),        # 10 ms: within
                    media(t3, "audio", T0 + 200_000_000)), now=1.0)                    # t3 waits
    m.observe(batch(media(t3, "video", T0)), now=2.0)                                   # 200-16.7 ms
    m.observe(batch(media(t1, "video", T0 + 9_000_000_000),
                    media(t1, "audio", T0 - 9_000_000_000)), now=3.0)                   # t1 done: ignored
    (s,) = family(m, "spanlet_modality_alignment_delay_seconds").samples
    want = [0.0567 - 0.0167, 0.0, 0.2 - 0.0167]
    assert s.count == 3
    assert s.sum == pytest.approx(sum(want))
    assert s.bucket_counts == hist_counts(want, ServingSettings().alignment_delay_bounds_s)
    assert s.bucket_counts[0] == 1                   # le=0: the pair within delta_sync
    assert m.alignment.pending() == 0


def test_alignment_needs_both_modalities_and_ignores_others():
    t = b"\7" * 16
    m = ServingMetrics(ServingSettings(), start=0.0)
    m.observe(batch(media(t, "audio", T0), media(t, "audio", T0 + 1), media(t, "text", T0 + 5),
                    media(t, "image", T0 + 5)), now=1.0)
    assert family(m, "spanlet_modality_alignment_delay_seconds").samples == []
    m.observe(batch(media(t, "video", T0 + 116_700_000)), now=2.0)     # pairs with the FIRST audio
    (s,) = family(m, "spanlet_modality_alignment_delay_seconds").samples
    assert s.sum == pytest.approx(0.1)


def test_alignment_labels_keep_only_what_both_spans_agree_on():
    t, u = b"\1" * 16, b"\2" * 16
    m = ServingMetrics(ServingSettings(), start=0.0)
    m.observe(batch(media(t, "audio", T0), media(u, "audio", T0), ns="av", pod="tts-0"), now=1.0)
    m.observe(batch(media(t, "video", T0), ns="av", pod="avatar-0")
              + batch(media(u, "video", T0), ns="av", pod="tts-0"), now=1.0)
    assert set(values(m, "spanlet_modality_alignment_delay_seconds")) == {
        frozenset({"namespace": "av", "pod": ""}.items()),
        frozenset({"namespace": "av", "pod": "tts-0"}.items())}


def test_alignment_waiting_traces_are_bounded_and_evictions_counted():
    m = ServingMetrics(ServingSettings(alignment_max_pending=10, alignment_ttl_s=5.0), start=0.0)
    m.observe(batch(*[media(i.to_bytes(16, "big"), "audio", T0) for i in range(1, 26)]), now=1.0)
    assert m.alignment.pending() == 10 and m.rejected["alignment_evicted"] == 15
    m.observe(batch(media((25).to_bytes(16, "big"), "video", T0)), now=2.0)   # newest kept: pairs
    assert family(m, "spanlet_modality_alignment_delay_seconds").samples[0].count == 1
    m.observe(batch(media((1).to_bytes(16, "big"), "video", T0)), now=2.0)    # evicted: now waits
    m.roll(7.5)                                                                 # TTL 5 s
    assert m.alignment.pending() == 0 and m.rejected["alignment_evicted"] == 25
    assert values(m, "spanlet_serving_rejected_total")[frozenset({("reason", "alignment_evicted")})] == 25


def test_alignment_pts_keeps_nanosecond_precision():
    t = b"\3" * 16
    m = ServingMetrics(ServingSettings(delta_sync_s=0.0), start=0.0)
    m.observe(batch(media(t, "audio", T0 + 1), media(t, "video", T0 + 2)), now=1.0)
    assert family(m, "spanlet_modality_alignment_delay_seconds").samples[0].sum == 1e-9


# -- #15 degradations ------------------------------------------------------------------

def test_degradations_counted_by_from_and_to():
    m = ServingMetrics(ServingSettings(), start=0.0)
    d = {"mm__degraded_from": "vision", "mm__degraded_to": "ocr_text"}
    m.observe(batch(span(**d), span(**d), span(mm__degraded_from="ocr_text", mm__degraded_to="text"),
                    span(mm__modality="image"), ns="vlm", pod="v-0"), now=1.0)
    m.roll(10.0)
    m.observe(batch(span(**d), ns="vlm", pod="v-0"), now=11.0)
    assert values(m, "spanlet_modality_degradations_total") == {
        frozenset({"namespace": "vlm", "pod": "v-0", "from": "vision", "to": "ocr_text"}.items()): 3,
        frozenset({"namespace": "vlm", "pod": "v-0", "from": "ocr_text", "to": "text"}.items()): 1}


# -- #16 embedding drift ---------------------------------------------------------------

def numpy_cmsd(windows, a, b, n=3):
    """windows: list of {modality: array of embeddings (rows)}; CMSD of pair a-b."""
    ds = []
    for w in windows[-n:]:
        if a in w and b in w:
            ma, mb = w[a].mean(axis=0), w[b].mean(axis=0)
            ds.append(1 - ma @ mb / (np.linalg.norm(ma) * np.linalg.norm(mb)))
    return np.std(ds) if len(ds) >= 2 else None


def test_embedding_drift_matches_numpy():
    rng = np.random.default_rng(3)
    dims = 48
    m = ServingMetrics(ServingSettings(embedding_samples_per_window=20), start=0.0)
    base = rng.normal(size=dims)
    windows = []
    for w in range(5):
        win = {"text": base + rng.normal(scale=0.3, size=(7, dims)),
               "image": base + rng.normal(loc=0.1 * w, scale=0.5, size=(12, dims)),
               "audio": rng.normal(size=(3, dims))}
        if w == 1:
            del win["audio"]             # audio absent in one window: its pairs skip it
        windows.append(win)
        spans = [span(mm__modality=mod, mm__embedding=list(row))
                 for mod, rows in win.items() for row in rows]
        m.observe(batch(*spans, ns="mm", pod="clip-0"), now=10.0 * w + 1)
        m.roll(10.0 * (w + 1))
        got = {dict(k)["pair"]: v for k, v in values(m, "spanlet_embedding_drift_score").items()}
        want = {f"{a}-{b}": numpy_cmsd(windows, a, b)
                for a, b in (("image", "text"), ("audio", "image"), ("audio", "text"))}
        assert got == pytest.approx({p: v for p, v in want.items() if v is not None}, rel=1e-9)
    assert set(got) == {"image-text", "audio-image", "audio-text"}


def test_embedding_sampling_keeps_at_most_k_per_window():
    m = ServingMetrics(ServingSettings(embedding_samples_per_window=4), start=0.0)
    spans = [span(mm__modality="text", mm__embedding=[1.0, 0.0, float(i)]) for i in range(100)]
    m.observe(batch(*spans), now=1.0)
    (r,) = m.drift.window.values()
    assert len(r.items) == 4 and r.seen == 100
    values_seen = [v[2] for v in r.items]
    assert len(set(values_seen)) == 4 and max(values_seen) > 3      # not just the first four


def test_embedding_integer_values_count_as_numbers():
    m = ServingMetrics(ServingSettings(), start=0.0)
    for w in range(2):
        m.observe(batch(span(mm__modality="text", mm__embedding=[1, 0]),
                        span(mm__modality="image", mm__embedding=[1.0, float(w)])), now=10.0 * w + 1)
        m.roll(10.0 * (w + 1))
    d = [0.0, 1 - 1 / math.sqrt(2)]
    assert values(m, "spanlet_embedding_drift_score") == {
        lab(pair="image-text"): pytest.approx(np.std(d))}


# -- bad input -------------------------------------------------------------------------

def _reject_case(m, rejected_before, reason, spans, now=1.0):
    m.observe(batch(*spans), now=now)
    after = m.rejected
    assert after[reason] == rejected_before[reason] + 1, reason
    assert {r: n for r, n in after.items() if r != reason} == \
        {r: n for r, n in rejected_before.items() if r != reason}


BAD = [
    ("missing_timestamp", lambda: request(0.1, "text", start=0, end=T0)),
    ("missing_timestamp", lambda: request(0.1, "text", end=0)),
    ("end_before_start", lambda: request(0.1, "text", end=T0 - 1)),
    ("out_of_range", lambda: request(0.1, "text", end=T0 + 10**15)),            # 11.6 days
    ("negative_value", lambda: span(events=[("first_token", T0 - 5)])),
    ("missing_timestamp", lambda: span(events=[("first_token", 0)])),
    ("negative_value", lambda: span(gen_ai__server__time_to_first_token=-0.1)),
    ("not_finite", lambda: span(gen_ai__server__time_to_first_token=math.nan)),
    ("not_finite", lambda: span(gen_ai__server__time_to_first_token=math.inf)),
    ("wrong_type", lambda: span(gen_ai__server__time_to_first_token="0.3")),
    ("wrong_type", lambda: span(gen_ai__server__time_to_first_token=True)),
    ("out_of_range", lambda: span(gen_ai__server__time_to_first_token=1e9)),
    ("missing_attribute", lambda: span(gen_ai__usage__output_tokens=5)),          # no model
    ("wrong_type", lambda: span(gen_ai__request__model=7, gen_ai__usage__output_tokens=5)),
    ("negative_value", lambda: tokens_span("whisper", -5)),
    ("not_finite", lambda: tokens_span("whisper", math.inf)),
    ("wrong_type", lambda: tokens_span("whisper", "5")),
    ("out_of_range", lambda: tokens_span("whisper", 5, kv=1.5)),
    ("not_finite", lambda: tokens_span("whisper", 5, kv=math.nan)),
    ("missing_attribute", lambda: span(mm__pts_ns=T0)),                           # no modality
    ("negative_value", lambda: media(b"\5" * 16, "audio", -1)),
    ("wrong_type", lambda: media(b"\5" * 16, "audio", "12")),
    ("not_finite", lambda: media(b"\5" * 16, "audio", math.nan)),
    ("missing_attribute", lambda: span(mm__degraded_from="vision")),
    ("missing_attribute", lambda: span(mm__degraded_to="text")),
    ("missing_attribute", lambda: span(mm__degraded_from="vision", mm__degraded_to="")),
    ("wrong_type", lambda: span(mm__degraded_from="vision", mm__degraded_to=3)),
    ("wrong_type", lambda: span(mm__modality="text", mm__embedding="0.1,0.2")),
    ("embedding_empty", lambda: span(mm__modality="text", mm__embedding=[])),
    ("embedding_too_large", lambda: span(mm__modality="text", mm__embedding=[0.5] * 4097)),
    ("not_finite", lambda: span(mm__modality="text", mm__embedding=[0.5, math.nan])),
    ("wrong_type", lambda: span(mm__modality="text", mm__embedding=[0.5, "x"])),
]


@pytest.mark.parametrize("reason, make", BAD, ids=[f"{r}-{i}" for i, (r, _) in enumerate(BAD)])
def test_bad_input_is_rejected_counted_and_changes_no_metric(reason, make):
    m = ServingMetrics(ServingSettings(peak_tokens_per_s=PEAKS), start=0.0)
    good = [request(0.1, "text", "gold", events=[("first_token", T0 + 20_000_000)],
                    gen_ai__request__model="whisper", gen_ai__usage__output_tokens=100,
                    gen_ai__kv_cache__usage_ratio=0.2),
            span(mm__modality="text", mm__embedding=[1.0, 0.0]),
            span(mm__modality="image", mm__embedding=[1.0, 1.0])]
    m.observe(batch(*good), now=1.0)
    m.roll(10.0)
    before_values = {f.name: f.samples for f in m.families() if "rejected" not in f.name}
    before = m.rejected
    assert set(before) == set(REJECT_REASONS) and not any(before.values())
    _reject_case(m, before, reason, [make()], now=11.0)
    after_values = {f.name: f.samples for f in m.families() if "rejected" not in f.name}
    assert after_values == before_values             # nothing moved, cumulative or gauge
    # the next window is clean too: a rejected token count or embedding did not
    # enter the window's sums (the good ones of window 1 are gone, so: absent)
    m.roll(20.0)
    assert family(m, "spanlet_throughput_decay_ratio").samples == []
    assert all(math.isfinite(s.value) for s in family(m, "spanlet_embedding_drift_score").samples)
    assert values(m, "spanlet_serving_rejected_total")[frozenset({("reason", reason)})] >= 1


def test_embedding_dims_must_match_within_a_window_and_pair():
    m = ServingMetrics(ServingSettings(), start=0.0)
    before = m.rejected
    m.observe(batch(span(mm__modality="text", mm__embedding=[1.0, 2.0, 3.0])), now=1.0)
    _reject_case(m, before, "embedding_dims_mismatch",
                 [span(mm__modality="text", mm__embedding=[1.0, 2.0])])
    (r,) = m.drift.window.values()
    assert len(r.items) == 1
    # a pair whose modalities disagree on dims is left out of the window, counted
    before = m.rejected
    m.observe(batch(span(mm__modality="image", mm__embedding=[1.0, 2.0])), now=2.0)
    m.roll(10.0)
    assert m.rejected["embedding_dims_mismatch"] == before["embedding_dims_mismatch"] + 1
    assert m.drift.history._h == {}


def test_a_bad_first_embedding_does_not_fix_the_window_dims():
    m = ServingMetrics(ServingSettings(), start=0.0)
    m.observe(batch(span(mm__modality="text", mm__embedding=[1.0, math.nan, 3.0]),
                    span(mm__modality="text", mm__embedding=[1.0, 2.0])), now=1.0)
    assert m.rejected["not_finite"] == 1 and m.rejected["embedding_dims_mismatch"] == 0
    (r,) = m.drift.window.values()
    assert [list(v) for v in r.items] == [[1.0, 2.0]] and r.seen == 1


def test_zero_mean_embedding_leaves_the_pair_out():
    m = ServingMetrics(ServingSettings(), start=0.0)
    m.observe(batch(span(mm__modality="text", mm__embedding=[1.0, -1.0]),
                    span(mm__modality="text", mm__embedding=[-1.0, 1.0]),
                    span(mm__modality="image", mm__embedding=[1.0, 0.0])), now=1.0)
    m.roll(10.0)
    assert m.rejected["embedding_zero_norm"] == 1
    assert m.drift.history._h == {}


def test_max_embedding_dims_is_configurable():
    m = ServingMetrics(ServingSettings(embedding_max_dims=2), start=0.0)
    m.observe(batch(span(mm__modality="text", mm__embedding=[1.0, 2.0, 3.0])), now=1.0)
    assert m.rejected["embedding_too_large"] == 1


def test_a_rejected_contribution_does_not_drop_the_spans_others():
    m = ServingMetrics(ServingSettings(), start=0.0)
    m.observe(batch(request(0.1, "text", gen_ai__server__time_to_first_token="soon")), now=1.0)
    assert m.rejected["wrong_type"] == 1
    assert family(m, "spanlet_request_duration_seconds").samples[0].count == 1


# -- cardinality, expiry, threads, settings ------------------------------------------------

def test_label_cardinality_is_bounded():
    m = ServingMetrics(ServingSettings(max_label_values=8), start=0.0)
    for i in range(200):
        trace = i.to_bytes(16, "big")
        m.observe(batch(request(0.1, "text", f"class-{i}"),
                        span(mm__degraded_from=f"f{i}", mm__degraded_to="text"),
                        media(trace, "audio", T0), media(trace, "video", T0 + i),
                        span(events=[("first_token", T0 + 1)]),
                        ns=f"ns-{i}", pod=f"pod-{i}"), now=1.0 + i / 1000)
    fams = {f.name: f for f in m.families()}
    for name in ("spanlet_request_duration_seconds", "spanlet_time_to_first_token_seconds",
                 "spanlet_modality_degradations_total", "spanlet_modality_alignment_delay_seconds"):
        samples = fams[name].samples
        assert len(samples) <= 9, name                  # 8 pods, then "overflow"
        names = {tuple(k for k, _ in s.labels) for s in samples}
        assert len(names) == 1, name                    # one label set per family
        assert "overflow" in {dict(s.labels)["pod"] for s in samples}
        for s in samples:
            for _, v in s.labels:
                assert len(v) < 32                       # no trace/span ids in there
    assert {dict(s.labels)["slo_class"] for s in fams["spanlet_request_duration_seconds"].samples} \
        == {"other"}
    overflow = {dict(s.labels)["label"]: s.value for s in fams["spanlet_serving_label_overflow_total"].samples}
    assert overflow["pod"] == 192 * 1 and overflow["namespace"] == 192 and overflow["from"] == 192


def test_idle_series_and_label_values_expire():
    m = ServingMetrics(ServingSettings(series_idle_s=100.0, max_label_values=1), start=0.0)
    m.observe(batch(request(0.1, "text"), ns="a", pod="old"), now=1.0)
    m.observe(batch(request(0.1, "text"), ns="a", pod="new"), now=50.0)      # over the cap
    pods = {dict(s.labels)["pod"] for s in family(m, "spanlet_request_duration_seconds").samples}
    assert pods == {"old", "overflow"}
    m.roll(150.0)                                   # "old" idle for 149 s: gone, room again
    assert {dict(s.labels)["pod"] for s in family(m, "spanlet_request_duration_seconds").samples} \
        == {"overflow"}
    m.observe(batch(request(0.1, "text"), ns="a", pod="new"), now=151.0)
    assert {dict(s.labels)["pod"] for s in family(m, "spanlet_request_duration_seconds").samples} \
        == {"overflow", "new"}


def test_observe_is_thread_safe_while_scraping():
    m = ServingMetrics(ServingSettings(), start=0.0)
    per_thread, threads = 500, 4
    spans = [[request(0.01 * (i % 7 + 1), "audio", "gold") for i in range(per_thread)]
             for _ in range(threads)]
    stop = threading.Event()

    def scrape():
        while not stop.is_set():
            m.families()

    def feed(own):
        for s in own:
            m.observe(batch(s), now=1.0)

    scraper = threading.Thread(target=scrape)
    scraper.start()
    workers = [threading.Thread(target=feed, args=(own,)) for own in spans]
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        stop.set()
        scraper.join()
    (s,) = family(m, "spanlet_request_duration_seconds").samples
    assert s.count == per_thread * threads
    assert s.sum == pytest.approx(threads * sum(0.01 * (i % 7 + 1) for i in range(per_thread)))


def test_first_window_starts_at_the_first_call_without_start():
    m = ServingMetrics(ServingSettings(peak_tokens_per_s=PEAKS))
    m.observe(batch(tokens_span("whisper", 100)), now=5.0)
    m.roll(9.0)                                     # 4 s window: 25 tokens/s of 50
    assert family(m, "spanlet_throughput_decay_ratio").samples[0].value == pytest.approx(0.5)


@pytest.mark.parametrize("kw, key", [
    ({"window_s": 0}, "window_s"),
    ({"volatility_windows": 1}, "volatility_windows"),
    ({"drift_windows": 1}, "drift_windows"),
    ({"slo_target_s": {"gold": -1.0}}, "slo_target_s.gold"),
    ({"peak_tokens_per_s": {"m": math.nan}}, "peak_tokens_per_s.m"),
    ({"pcie_bottleneck_ratio": 1.5}, "pcie_bottleneck_ratio"),
    ({"request_duration_bounds_s": (0.1, 0.1)}, "request_duration_bounds_s"),
    ({"alignment_delay_bounds_s": ()}, "alignment_delay_bounds_s"),
    ({"embedding_max_dims": 0}, "embedding_max_dims"),
])
def test_bad_settings_name_the_key(kw, key):
    with pytest.raises(ValueError, match=rf"serving\.{key}:"):
        ServingSettings(**kw)


def test_settings_are_frozen_with_the_documented_defaults():
    s = ServingSettings()
    assert (s.window_s, s.volatility_windows, s.drift_windows, s.delta_sync_s) == (10.0, 12, 3, 0.0167)
    assert dict(s.slo_target_s) == {"gold": 0.2, "silver": 0.5, "bronze": 0.8}
    assert dict(s.slo_min_compliance_ratio) == {"gold": 0.95, "silver": 0.85}
    assert (s.memory_bottleneck_ratio, s.pcie_bottleneck_ratio, s.kv_cache_bottleneck_ratio) == \
        (0.95, 0.85, 0.70)
    assert dict(s.peak_tokens_per_s) == {} and s.embedding_max_dims == 4096
    with pytest.raises(Exception):
        s.window_s = 5.0
    with pytest.raises(TypeError):
        s.slo_target_s["gold"] = 1.0
