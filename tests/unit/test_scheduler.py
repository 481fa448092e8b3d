"""Scheduler feed: every rule of the three policies at and around its
thresholds, missing inputs, hysteresis, the vision step sequence, flapping,
and the JSON of GET /v1/hints."""

import dataclasses
import json
import math

import pytest

from spanlet.config import GIB, SchedulerThresholds
from spanlet.scheduler import (AUDIO_P95, GPU_MEMORY_FREE_MIN, GPU_MEMORY_PEAK_MAX, GPU_UTIL_MAX,
                               TEXT_KV_HIT, TEXT_RTT, TEXT_TOKENS_MAX, TEXT_TOKENS_MEAN, Scheduler,
                               WindowInputs)

BUSY, IDLE, AUDIO_DEFAULT = "audio.high_latency_or_busy", "audio.fast_and_idle", "audio.default"
LONG, SHORT, TEXT_DEFAULT = "text.long_context_or_kv_miss", "text.short_requests", "text.default"
PRESSURE, CLEAR, HOLD = "vision.memory_pressure", "vision.memory_clear", "vision.hold"


def audio(p95=None, util=None):
    return WindowInputs(request_duration_p95_seconds={"audio": p95},
                        gpu_utilization_ratio={"0": util})


def text(mean=None, max_=None, kv=None, rtt=None):
    return WindowInputs(text_input_tokens_mean=mean, text_input_tokens_max=max_,
                        text_kv_cache_hit_ratio=kv, text_network_rtt_seconds=rtt)


def vision(peak=None, free=None):
    return WindowInputs(gpu_memory_peak_ratio={"0": peak}, gpu_memory_free_bytes={"0": free})


def run(windows, modality, thresholds=SchedulerThresholds()):
    """Feeds one window per 10 s; returns the scheduler and the served hint
    of `modality` after each window."""
    s = Scheduler(thresholds)
    seen = []
    for i, w in enumerate(windows):
        s.update(w, now=1000.0 + 10 * i)
        seen.append(s.hints()["hints"][modality])
    return s, seen


def one_window(w, modality):
    return run([w], modality)[1][0]


def batch_changes(seen, start):
    """How many windows changed the served batch (size or range)."""
    values = [start] + [(h["batch_size"], h["batch_range"]) for h in seen]
    return sum(a != b for a, b in zip(values, values[1:]))


# --- audio -------------------------------------------------------------------

@pytest.mark.parametrize("p95, util, batch, rule, missing", [
    (0.005, 0.50, 4, AUDIO_DEFAULT, []),
    (0.008, 0.50, 4, AUDIO_DEFAULT, []),            # p95 at 8 ms: not above
    (0.0081, 0.50, 2, BUSY, []),
    (0.005, 0.75, 4, AUDIO_DEFAULT, []),            # utilisation at 0.75: not above
    (0.005, 0.76, 2, BUSY, []),
    (0.020, 0.95, 2, BUSY, []),
    (0.004, 0.20, 4, AUDIO_DEFAULT, []),            # p95 at 4 ms: not below
    (0.0039, 0.20, 8, IDLE, []),
    (0.002, 0.40, 4, AUDIO_DEFAULT, []),            # utilisation at 0.40: not below
    (0.002, 0.39, 8, IDLE, []),
    (0.002, 0.60, 4, AUDIO_DEFAULT, []),            # fast but not idle
    (0.006, 0.20, 4, AUDIO_DEFAULT, []),            # idle but not fast
    (None, 0.90, 2, BUSY, [AUDIO_P95]),             # "or": utilisation alone decides
    (0.009, None, 2, BUSY, [GPU_UTIL_MAX]),         # "or": p95 alone decides
    (None, 0.50, 4, AUDIO_DEFAULT, [AUDIO_P95]),
    (None, 0.20, 4, AUDIO_DEFAULT, [AUDIO_P95]),    # "and" needs the p95
    (0.002, None, 4, AUDIO_DEFAULT, [GPU_UTIL_MAX]),
    (None, None, 4, AUDIO_DEFAULT, [AUDIO_P95, GPU_UTIL_MAX]),
    (math.nan, 0.20, 4, AUDIO_DEFAULT, [AUDIO_P95]),  # NaN is missing
])
def test_audio_rules(p95, util, batch, rule, missing):
    h = one_window(audio(p95, util), "audio")
    assert (h["batch_size"], h["batch_range"], h["rule"], h["missing"]) == (batch, None, rule, missing)
    assert set(h["inputs"]) == {AUDIO_P95, GPU_UTIL_MAX}


def test_audio_reads_the_audio_p95_and_the_busiest_gpu():
    w = WindowInputs(request_duration_p95_seconds={"audio": 0.002, "text": 0.9},
                     gpu_utilization_ratio={"0": 0.10, "1": 0.80, "2": None})
    h = one_window(w, "audio")
    assert (h["batch_size"], h["rule"]) == (2, BUSY)
    assert h["inputs"] == {AUDIO_P95: 0.002, GPU_UTIL_MAX: 0.80}
    w = WindowInputs(request_duration_p95_seconds={"audio": 0.002},
                     gpu_utilization_ratio={"0": 0.10, "1": 0.30})
    assert one_window(w, "audio")["batch_size"] == 8
    assert one_window(WindowInputs(), "audio")["missing"] == [AUDIO_P95, GPU_UTIL_MAX]


@pytest.mark.parametrize("windows, batches", [
    # Busy, entered on p95: kept while p95 > 7.2 ms.
    ([audio(0.009, 0.5), audio(0.0075, 0.5), audio(0.0073, 0.5), audio(0.0071, 0.5)], [2, 2, 2, 4]),
    # Busy, entered on utilisation: kept while utilisation > 0.675.
    ([audio(0.005, 0.80), audio(0.005, 0.70), audio(0.005, 0.68), audio(0.005, 0.67)], [2, 2, 2, 4]),
    # Idle: kept while p95 < 4.4 ms and utilisation < 0.44.
    ([audio(0.003, 0.2), audio(0.0043, 0.2), audio(0.0045, 0.2)], [8, 8, 4]),
    ([audio(0.003, 0.3), audio(0.003, 0.43), audio(0.003, 0.45)], [8, 8, 4]),
    # Idle is entered only at the raw thresholds, not inside the margin.
    ([audio(0.0043, 0.2), audio(0.0039, 0.2)], [4, 8]),
    # Busy to idle in one window: one change, straight to 8.
    ([audio(0.009, 0.9), audio(0.002, 0.1)], [2, 8]),
    # A missing input ends a held "and" rule.
    ([audio(0.003, 0.2), audio(0.003, None)], [8, 4]),
])
def test_audio_hysteresis(windows, batches):
    assert [h["batch_size"] for h in run(windows, "audio")[1]] == batches


# --- text --------------------------------------------------------------------

@pytest.mark.parametrize("mean, max_, kv, rtt, batch_range, rule, missing", [
    (63, 100, 0.9, 0.014, (8, 16), SHORT, []),
    (64, 100, 0.9, 0.005, (4, 8), TEXT_DEFAULT, []),      # mean at 64: not below
    (30, 100, 0.9, 0.015, (4, 8), TEXT_DEFAULT, []),      # round trip at 15 ms: not below
    (200, 1000, 0.9, 0.005, (4, 8), TEXT_DEFAULT, []),
    (30, 2048, 0.9, 0.005, (8, 16), SHORT, []),           # max at 2048: not above
    (30, 2049, 0.9, 0.005, (2, 4), LONG, []),             # long context wins over short
    (500, 100, 0.72, 0.005, (4, 8), TEXT_DEFAULT, []),    # hit ratio at 0.72: not below
    (500, 100, 0.71, 0.005, (2, 4), LONG, []),
    (500, 4096, 0.50, 0.005, (2, 4), LONG, []),
    (None, 100, 0.9, 0.005, (4, 8), TEXT_DEFAULT, [TEXT_TOKENS_MEAN]),
    (30, 100, 0.9, None, (4, 8), TEXT_DEFAULT, [TEXT_RTT]),
    (30, None, None, 0.005, (8, 16), SHORT, [TEXT_TOKENS_MAX, TEXT_KV_HIT]),  # long undecided
    (30, None, 0.9, 0.005, (8, 16), SHORT, [TEXT_TOKENS_MAX]),
    (500, None, 0.50, 0.005, (2, 4), LONG, [TEXT_TOKENS_MAX]),  # "or": hit ratio decides
    (500, 3000, None, 0.005, (2, 4), LONG, [TEXT_KV_HIT]),      # "or": max decides
    (None, None, None, None, (4, 8), TEXT_DEFAULT,
     [TEXT_TOKENS_MEAN, TEXT_TOKENS_MAX, TEXT_KV_HIT, TEXT_RTT]),
])
def test_text_rules(mean, max_, kv, rtt, batch_range, rule, missing):
    h = one_window(text(mean, max_, kv, rtt), "text")
    # The gauge value is the upper end of the batch window.
    assert (h["batch_size"], h["batch_range"]) == (batch_range[1], list(batch_range))
    assert (h["rule"], h["missing"]) == (rule, missing)
    assert h["inputs"] == {TEXT_TOKENS_MEAN: mean, TEXT_TOKENS_MAX: max_, TEXT_KV_HIT: kv,
                           TEXT_RTT: rtt}


@pytest.mark.parametrize("windows, batches", [
    # Short: kept while mean < 70.4 tokens and round trip < 16.5 ms.
    ([text(30, 100, 0.9, 0.005), text(70, 100, 0.9, 0.005), text(71, 100, 0.9, 0.005)], [16, 16, 8]),
    ([text(30, 100, 0.9, 0.005), text(30, 100, 0.9, 0.016), text(30, 100, 0.9, 0.017)], [16, 16, 8]),
    # Long context: kept while max > 1843.2 tokens or hit ratio < 0.792.
    ([text(500, 3000, 0.9, 0.005), text(500, 1900, 0.9, 0.005), text(500, 1800, 0.9, 0.005)], [4, 4, 8]),
    ([text(500, 100, 0.50, 0.005), text(500, 100, 0.78, 0.005), text(500, 100, 0.80, 0.005)], [4, 4, 8]),
    # Long context held inside its margin keeps priority over short requests.
    ([text(30, 3000, 0.9, 0.005), text(30, 1900, 0.9, 0.005), text(30, 1800, 0.9, 0.005)], [4, 4, 16]),
])
def test_text_hysteresis(windows, batches):
    assert [h["batch_size"] for h in run(windows, "text")[1]] == batches


# --- image and video -----------------------------------------------------------

@pytest.mark.parametrize("peak, free, batch, rule, missing", [
    (0.50, 8 * GIB, 16, CLEAR, []),                 # start 8, clear: one step up
    (0.78, 1.33 * GIB, 16, CLEAR, []),              # clear by the margin on both
    (0.79, 8 * GIB, 8, HOLD, []),                   # peak inside the margin (0.783..0.87)
    (0.50, 1.3 * GIB, 8, HOLD, []),                 # free inside the margin (1.2..1.32 GiB)
    (0.87, 8 * GIB, 8, HOLD, []),                   # peak at 0.87: not above
    (0.8701, 8 * GIB, 4, PRESSURE, []),
    (0.50, 1.2 * GIB, 8, HOLD, []),                 # free at 1.2 GiB: not under
    (0.50, 1.2 * GIB - 1, 4, PRESSURE, []),
    (0.95, 0.5 * GIB, 4, PRESSURE, []),
    (0.90, None, 4, PRESSURE, [GPU_MEMORY_FREE_MIN]),   # "or": peak decides
    (None, 1 * GIB, 4, PRESSURE, [GPU_MEMORY_PEAK_MAX]),  # "or": free decides
    (0.50, None, 8, HOLD, [GPU_MEMORY_FREE_MIN]),       # growing needs both
    (None, 8 * GIB, 8, HOLD, [GPU_MEMORY_PEAK_MAX]),
    (None, None, 8, HOLD, [GPU_MEMORY_PEAK_MAX, GPU_MEMORY_FREE_MIN]),
])
@pytest.mark.parametrize("modality", ["image", "video"])
def test_vision_rules(modality, peak, free, batch, rule, missing):
    h = one_window(vision(peak, free), modality)
    assert (h["batch_size"], h["batch_range"], h["rule"], h["missing"]) == (batch, None, rule, missing)
    assert h["inputs"] == {GPU_MEMORY_PEAK_MAX: peak, GPU_MEMORY_FREE_MIN: free}


def test_vision_reads_the_fullest_gpu():
    w = WindowInputs(gpu_memory_peak_ratio={"0": 0.30, "1": 0.90},
                     gpu_memory_free_bytes={"0": 60 * GIB, "1": 20 * GIB})
    h = one_window(w, "image")
    assert (h["batch_size"], h["rule"]) == (4, PRESSURE)
    assert h["inputs"] == {GPU_MEMORY_PEAK_MAX: 0.90, GPU_MEMORY_FREE_MIN: 20 * GIB}
    w = WindowInputs(gpu_memory_peak_ratio={"0": 0.30, "1": 0.40},
                     gpu_memory_free_bytes={"0": 60 * GIB, "1": 1 * GIB})
    h = one_window(w, "video")
    assert (h["batch_size"], h["inputs"][GPU_MEMORY_FREE_MIN]) == (4, 1 * GIB)


def test_vision_shrinks_and_grows_one_step_per_window():
    clear, full, between = vision(0.5, 8 * GIB), vision(0.95, 8 * GIB), vision(0.80, 8 * GIB)
    windows = [clear, clear, full, full, full, full, full, between, vision(), clear, clear,
               clear, clear, clear]
    s, seen = run(windows, "image")
    assert [(h["batch_size"], h["rule"], h["changed_at"]) for h in seen] == [
        (16, CLEAR, 1000.0),          # the default 8 grows to the max 16
        (16, CLEAR, 1000.0),          # at the max: no change
        (8, PRESSURE, 1020.0),
        (4, PRESSURE, 1030.0),
        (2, PRESSURE, 1040.0),
        (1, PRESSURE, 1050.0),
        (1, PRESSURE, 1050.0),        # at the floor: no change
        (1, HOLD, 1050.0),            # inside the margin: hold
        (1, HOLD, 1050.0),            # inputs missing: hold
        (2, CLEAR, 1090.0),
        (4, CLEAR, 1100.0),
        (8, CLEAR, 1110.0),
        (16, CLEAR, 1120.0),
        (16, CLEAR, 1120.0),
    ]
    assert seen[8]["missing"] == [GPU_MEMORY_PEAK_MAX, GPU_MEMORY_FREE_MIN]
    assert s.hints()["hints"]["video"] == dict(seen[-1], modality="video")


def test_vision_steps_respect_configured_bounds():
    t = SchedulerThresholds(vision_batch_min=2, vision_batch_default=6, vision_batch_max=12)
    clear, full = vision(0.5, 8 * GIB), vision(0.95, 8 * GIB)
    seen = run([clear, clear, full, full, full, full, clear], "video", t)[1]
    assert [h["batch_size"] for h in seen] == [12, 12, 6, 3, 2, 2, 4]


# --- flapping ------------------------------------------------------------------

WINDOWS = 20
SHORT_TEXT = dict(mean=30, max_=100, kv=0.9, rtt=0.005)
PLAIN_TEXT = dict(SHORT_TEXT, mean=500)         # neither short nor long: the default 4-8

# (inputs on the quiet side of the threshold, inputs past it by 5 %,
#  served batch changes over 20 alternating windows with the default 10 %
#  margin, and with no margin)
FLAPS = {
    "audio p95 ~8 ms": ("audio", audio(0.0076, 0.5), audio(0.0084, 0.5), 1, WINDOWS - 1),
    "audio util ~0.75": ("audio", audio(0.005, 0.72), audio(0.005, 0.78), 1, WINDOWS - 1),
    "audio p95 ~4 ms": ("audio", audio(0.0042, 0.2), audio(0.0038, 0.2), 1, WINDOWS - 1),
    "audio util ~0.40": ("audio", audio(0.002, 0.42), audio(0.002, 0.38), 1, WINDOWS - 1),
    "text mean ~64": ("text", text(**dict(SHORT_TEXT, mean=67)), text(**dict(SHORT_TEXT, mean=61)),
                      1, WINDOWS - 1),
    "text rtt ~15 ms": ("text", text(**dict(SHORT_TEXT, rtt=0.0155)),
                        text(**dict(SHORT_TEXT, rtt=0.0145)), 1, WINDOWS - 1),
    "text max ~2048": ("text", text(**dict(PLAIN_TEXT, max_=2000)),
                       text(**dict(PLAIN_TEXT, max_=2100)), 1, WINDOWS - 1),
    "text kv ~0.72": ("text", text(**dict(PLAIN_TEXT, kv=0.74)), text(**dict(PLAIN_TEXT, kv=0.70)),
                      1, WINDOWS - 1),
    # Vision with the margin: each excursion shrinks, the return is inside the
    # margin and holds, so 8 -> 4 -> 2 -> 1 and no more. Without a margin the
    # quiet side is "clear" and every window moves the batch.
    "vision peak ~0.87": ("image", vision(0.85, 8 * GIB), vision(0.89, 8 * GIB), 3, WINDOWS),
    "vision free ~1.2 GiB": ("video", vision(0.5, 1.25 * GIB), vision(0.5, 1.15 * GIB), 3, WINDOWS),
}


@pytest.mark.parametrize("case", FLAPS)
def test_oscillation_around_a_threshold_changes_the_hint_once(case):
    modality, quiet, past, with_margin, without_margin = FLAPS[case]
    windows = [quiet, past] * (WINDOWS // 2)
    start = Scheduler().hint(modality)
    start = (start.batch_size, list(start.batch_range) if start.batch_range else None)
    assert batch_changes(run(windows, modality)[1], start) == with_margin
    no_margin = SchedulerThresholds(hysteresis_ratio=0.0)
    assert batch_changes(run(windows, modality, no_margin)[1], start) == without_margin


def test_a_swing_wider_than_the_margin_is_followed_once_per_window():
    seen = run([audio(0.005, 0.5), audio(0.009, 0.5)] * (WINDOWS // 2), "audio")[1]
    assert [h["batch_size"] for h in seen] == [4, 2] * (WINDOWS // 2)
    assert batch_changes(seen, (4, None)) == WINDOWS - 1


# --- JSON and thresholds ------------------------------------------------------

def test_hints_before_the_first_window():
    body = Scheduler(window_s=5.0).hints()
    assert body["window_s"] == 5.0 and body["updated_at"] is None
    assert list(body["hints"]) == ["audio", "text", "image", "video"]
    assert body["hints"]["text"] == {
        "modality": "text", "batch_size": 8, "batch_range": [4, 8], "rule": TEXT_DEFAULT,
        "inputs": {TEXT_TOKENS_MEAN: None, TEXT_TOKENS_MAX: None, TEXT_KV_HIT: None, TEXT_RTT: None},
        "missing": [TEXT_TOKENS_MEAN, TEXT_TOKENS_MAX, TEXT_KV_HIT, TEXT_RTT],
        "changed_at": None,
    }
    assert [body["hints"][m]["batch_size"] for m in ("audio", "image", "video")] == [4, 8, 8]


def test_hints_json_after_a_window():
    s = Scheduler()
    s.update(WindowInputs(request_duration_p95_seconds={"audio": 0.009},
                          gpu_utilization_ratio={"0": 0.5},
                          gpu_memory_peak_ratio={"0": 0.5}, gpu_memory_free_bytes={"0": 8 * GIB},
                          text_input_tokens_mean=30, text_input_tokens_max=100,
                          text_kv_cache_hit_ratio=0.9, text_network_rtt_seconds=0.005), now=1234.5)
    body = json.loads(json.dumps(s.hints()))
    assert body == {
        "window_s": 10.0, "updated_at": 1234.5,
        "hints": {
            "audio": {"modality": "audio", "batch_size": 2, "batch_range": None, "rule": BUSY,
                      "inputs": {AUDIO_P95: 0.009, GPU_UTIL_MAX: 0.5}, "missing": [],
                      "changed_at": 1234.5},
            "text": {"modality": "text", "batch_size": 16, "batch_range": [8, 16], "rule": SHORT,
                     "inputs": {TEXT_TOKENS_MEAN: 30, TEXT_TOKENS_MAX: 100, TEXT_KV_HIT: 0.9,
                                TEXT_RTT: 0.005},
                     "missing": [], "changed_at": 1234.5},
            "image": {"modality": "image", "batch_size": 16, "batch_range": None, "rule": CLEAR,
                      "inputs": {GPU_MEMORY_PEAK_MAX: 0.5, GPU_MEMORY_FREE_MIN: 8 * GIB},
                      "missing": [], "changed_at": 1234.5},
            "video": {"modality": "video", "batch_size": 16, "batch_range": None, "rule": CLEAR,
                      "inputs": {GPU_MEMORY_PEAK_MAX: 0.5, GPU_MEMORY_FREE_MIN: 8 * GIB},
                      "missing": [], "changed_at": 1234.5},
        },
    }


def test_changed_at_is_set_by_the_first_window_and_moves_only_on_a_change():
    s, seen = run([audio(0.005, 0.5), audio(0.006, 0.5), audio(0.009, 0.5), audio(0.0075, 0.5)],
                  "audio")
    assert [(h["batch_size"], h["changed_at"]) for h in seen] == [
        (4, 1000.0), (4, 1000.0), (2, 1020.0), (2, 1020.0)]
    assert s.hints()["updated_at"] == 1030.0


def test_default_thresholds_are_those_of_metrics_md():
    t = SchedulerThresholds()
    assert dataclasses.asdict(t) == {
        "hysteresis_ratio": 0.10,
        "audio_p95_high_s": 0.008, "audio_utilization_high": 0.75,
        "audio_p95_low_s": 0.004, "audio_utilization_low": 0.40,
        "audio_batch_busy": 2, "audio_batch_default": 4, "audio_batch_idle": 8,
        "text_short_input_tokens": 64, "text_short_rtt_s": 0.015,
        "text_long_input_tokens": 2048, "text_kv_cache_hit_min": 0.72,
        "text_batch_short": (8, 16), "text_batch_default": (4, 8), "text_batch_long": (2, 4),
        "vision_memory_peak_max": 0.87, "vision_memory_free_min_bytes": 1.2 * 2**30,
        "vision_batch_min": 1, "vision_batch_default": 8, "vision_batch_max": 16,
    }
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.audio_batch_busy = 3


@pytest.mark.parametrize("bad, names", [
    (dict(hysteresis_ratio=1.0), "hysteresis_ratio"),
    (dict(hysteresis_ratio=-0.1), "hysteresis_ratio"),
    (dict(text_batch_short=(16, 8)), "text_batch_short"),
    (dict(text_batch_long=(0, 4)), "text_batch_long"),
    (dict(audio_batch_busy=0), "audio_batch_busy"),
    (dict(vision_batch_default=32), "vision_batch_default"),
])
def test_bad_thresholds_name_the_field(bad, names):
    with pytest.raises(ValueError, match=names):
        SchedulerThresholds(**bad)
