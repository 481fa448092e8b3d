"""Scheduler feed (METRICS.md "Scheduler feed"): turns one window of metrics
into per-modality batch hints, with hysteresis, served at GET /v1/hints.

The metric engine calls `Scheduler.update(inputs, now)` once per window; the
HTTP server and the Prometheus collector read `Scheduler.hints()` whenever
they like (it returns a snapshot that one update swaps in whole).

Policies, with the defaults of `SchedulerThresholds`:

- audio, from the audio p95 of `spanlet_request_duration_seconds` and GPU
  utilisation: rule `audio.high_latency_or_busy` (p95 > 8 ms or utilisation
  > 0.75) gives 2; `audio.fast_and_idle` (p95 < 4 ms and utilisation < 0.40)
  gives 8; otherwise `audio.default` gives 4.
- text, from input tokens, KV-cache hit ratio and network round trip: rule
  `text.long_context_or_kv_miss` (max input > 2048 tokens or KV-cache hit
  ratio < 0.72) gives the batch window 2-4; `text.short_requests` (mean input
  < 64 tokens and round trip < 15 ms) gives 8-16; otherwise `text.default`
  gives 4-8: the band between the other two, so that leaving either extreme
  moves the window one notch, and wide enough that a scheduler can still
  adapt inside it. Long context is checked first: a few long prompts among
  many short ones decide, because they are what runs out of KV memory.
- image and video (one "vision" policy, each modality with its own batch),
  from the worst GPU's memory: `vision.memory_pressure` (peak ratio > 0.87
  or free < 1.2 GiB) halves the batch, floor 1; `vision.memory_clear` (peak
  and free both past their threshold by the margin) doubles it, up to 16;
  `vision.hold` keeps it (inside the margin, or inputs missing). Start: 8.

GPU inputs are per GPU; the scheduler takes the worst GPU (max utilisation,
max memory peak ratio, min free bytes). The hints are per node, not per GPU,
and one saturated or nearly full GPU is where requests queue or run out of
memory: a mean would hide one hot GPU among idle ones and hint a bigger
batch onto it. The worst GPU errs towards smaller batches, the safe side.

Missing inputs (None, NaN, no GPU reported): a rule fires only when the inputs
that are present decide it. An "or" rule fires when any present input is past
its threshold (the missing one cannot make it false); an "and" rule needs all
of its inputs. A rule left undecided does not fire, and every hint lists its
missing inputs under `missing`.

Hysteresis: a margin on the way out. A rule is entered at its threshold; the
rule in force stays in force until its inputs cross back past the threshold by
`hysteresis_ratio` (default 10 %) of the threshold: audio stays at 2 while
p95 > 7.2 ms or utilisation > 0.675, at 8 while p95 < 4.4 ms and utilisation
< 0.44; text stays at 2-4 while max input > 1843.2 tokens or hit ratio
< 0.792, at 8-16 while mean input < 70.4 tokens and round trip < 16.5 ms;
vision grows only when peak <= 0.783 and free >= 1.32 GiB, and in between it
holds. Inputs that wobble around a threshold by less than the margin change a
hint once; a swing wider than the margin is a real change of load and is
followed, one change per window at most (one update, one decision).

JSON of GET /v1/hints (`Scheduler.hints()`):

    {"window_s": 10.0, "updated_at": 1700000000.0 | null,
     "hints": {"audio": HINT, "text": HINT, "image": HINT, "video": HINT}}

    HINT = {"modality": "text",
            "batch_size": 16,                 # the gauge value
            "batch_range": [8, 16] | null,    # text only; null elsewhere
            "rule": "text.short_requests",
            "inputs": {"<input name>": number | null, ...},  # those the policy reads
            "missing": ["<input name>", ...],
            "changed_at": 1700000000.0 | null}  # window since which batch_size
                                                # and batch_range hold; null
                                                # before the first window

For text, `batch_size` (the gauge `spanlet_scheduler_batch_size_hint`) is the
upper end of the window: every consumer of the gauge reads it as the largest
batch to form, the meaning it has for audio and vision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from spanlet.config import SchedulerThresholds

MODALITIES = ("audio", "text", "image", "video")

# Input names, as they appear under "inputs" and "missing" of a hint.
AUDIO_P95 = "request_duration_p95_seconds"
GPU_UTIL_MAX = "gpu_utilization_ratio_max"
GPU_MEMORY_PEAK_MAX = "gpu_memory_peak_ratio_max"
GPU_MEMORY_FREE_MIN = "gpu_memory_free_bytes_min"
TEXT_TOKENS_MEAN = "text_input_tokens_mean"
TEXT_TOKENS_MAX = "text_input_tokens_max"
TEXT_KV_HIT = "text_kv_cache_hit_ratio"
TEXT_RTT = "text_network_rtt_seconds"


@dataclass(frozen=True)
class WindowInputs:
    """One window of the metrics the hints are made from; anything may be
    missing (absent key, None or NaN)."""

    # p95 of metric 9 (spanlet_request_duration_seconds), seconds, by modality.
    request_duration_p95_seconds: Mapping[str, float | None] = field(default_factory=dict)
    # Metric 6, 0..1, by GPU.
    gpu_utilization_ratio: Mapping[str, float | None] = field(default_factory=dict)
    # Metric 7, 0..1, by GPU, and the free memory at that peak, bytes, by GPU.
    gpu_memory_peak_ratio: Mapping[str, float | None] = field(default_factory=dict)
    gpu_memory_free_bytes: Mapping[str, float | None] = field(default_factory=dict)
    # Text requests of the window.
    text_input_tokens_mean: float | None = None
    text_input_tokens_max: float | None = None
    text_kv_cache_hit_ratio: float | None = None
    text_network_rtt_seconds: float | None = None


@dataclass(frozen=True)
class Hint:
    """One modality's hint, as served."""

    modality: str
    batch_size: int
    batch_range: tuple[int, int] | None
    rule: str
    inputs: Mapping[str, float | None]
    missing: tuple[str, ...]
    changed_at: float | None

    def as_json(self) -> dict:
        return {
            "modality": self.modality,
            "batch_size": self.batch_size,
            "batch_range": list(self.batch_range) if self.batch_range else None,
            "rule": self.rule,
            "inputs": dict(self.inputs),
            "missing": list(self.missing),
            "changed_at": self.changed_at,
        }


# --- rules -------------------------------------------------------------------

@dataclass(frozen=True)
class _Bound:
    """One comparison of a rule: input > limit (above) or input < limit."""

    input: str
    above: bool
    limit: float

    def holds(self, values: Mapping[str, float | None], margin: float) -> bool | None:
        v = values[self.input]
        if v is None:
            return None
        if self.above:
            return v > self.limit * (1.0 - margin)
        return v < self.limit * (1.0 + margin)


@dataclass(frozen=True)
class _Rule:
    """Bounds joined by "or" (any_of) or "and", in three-valued logic: None
    when the inputs present cannot decide."""

    bounds: tuple[_Bound, ...]
    any_of: bool

    def fires(self, values: Mapping[str, float | None], margin: float = 0.0) -> bool | None:
        results = [b.holds(values, margin) for b in self.bounds]
        deciding = self.any_of          # one True decides an "or", one False an "and"
        if deciding in results:
            return deciding
        if None in results:
            return None
        return not deciding


@dataclass(frozen=True)
class _Level:
    rule_id: str
    rule: _Rule | None                  # None: the default level
    batch_range: tuple[int, int]


class _LevelPolicy:
    """Audio and text: exclusive levels, each entered when its rule fires at
    the raw thresholds and kept while it fires with the margin; the first
    level (in order) that fires wins, else the default."""

    def __init__(self, inputs: tuple[str, ...], levels: tuple[_Level, ...],
                 default: _Level, margin: float, is_range: bool):
        self.inputs = inputs
        self._levels = levels
        self._default = default
        self._margin = margin
        self._is_range = is_range

    def initial(self) -> tuple[str, int, tuple[int, int] | None]:
        return self._result(self._default)

    def decide(self, prev: Hint, values: Mapping[str, float | None]):
        for level in self._levels:
            margin = self._margin if level.rule_id == prev.rule else 0.0
            if level.rule.fires(values, margin):
                return self._result(level)
        return self._result(self._default)

    def _result(self, level: _Level):
        low, high = level.batch_range
        return level.rule_id, high, ((low, high) if self._is_range else None)


class _StepPolicy:
    """Image and video: halve under memory pressure, double when memory is
    clear by the margin, hold in between or when the inputs cannot decide."""

    inputs = (GPU_MEMORY_PEAK_MAX, GPU_MEMORY_FREE_MIN)

    def __init__(self, t: SchedulerThresholds):
        self._pressure = _Rule((_Bound(GPU_MEMORY_PEAK_MAX, True, t.vision_memory_peak_max),
                                _Bound(GPU_MEMORY_FREE_MIN, False, t.vision_memory_free_min_bytes)),
                               any_of=True)
        self._t = t

    def initial(self) -> tuple[str, int, None]:
        return "vision.hold", self._t.vision_batch_default, None

    def decide(self, prev: Hint, values: Mapping[str, float | None]):
        if self._pressure.fires(values):
            return "vision.memory_pressure", max(self._t.vision_batch_min, prev.batch_size // 2), None
        if self._pressure.fires(values, self._t.hysteresis_ratio) is False:
            return "vision.memory_clear", min(self._t.vision_batch_max, prev.batch_size * 2), None
        return "vision.hold", prev.batch_size, None


def _audio_policy(t: SchedulerThresholds) -> _LevelPolicy:
    busy = _Rule((_Bound(AUDIO_P95, True, t.audio_p95_high_s),
                  _Bound(GPU_UTIL_MAX, True, t.audio_utilization_high)), any_of=True)
    idle = _Rule((_Bound(AUDIO_P95, False, t.audio_p95_low_s),
                  _Bound(GPU_UTIL_MAX, False, t.audio_utilization_low)), any_of=False)

    def level(rule_id: str, rule: _Rule | None, size: int) -> _Level:
        return _Level(rule_id, rule, (size, size))

    return _LevelPolicy(
        inputs=(AUDIO_P95, GPU_UTIL_MAX),
        levels=(level("audio.high_latency_or_busy", busy, t.audio_batch_busy),
                level("audio.fast_and_idle", idle, t.audio_batch_idle)),
        default=level("audio.default", None, t.audio_batch_default),
        margin=t.hysteresis_ratio, is_range=False)


def _text_policy(t: SchedulerThresholds) -> _LevelPolicy:
    long_context = _Rule((_Bound(TEXT_TOKENS_MAX, True, t.text_long_input_tokens),
                          _Bound(TEXT_KV_HIT, False, t.text_kv_cache_hit_min)), any_of=True)
    short = _Rule((_Bound(TEXT_TOKENS_MEAN, False, t.text_short_input_tokens),
                   _Bound(TEXT_RTT, False, t.text_short_rtt_s)), any_of=False)
    return _LevelPolicy(
        inputs=(TEXT_TOKENS_MEAN, TEXT_TOKENS_MAX, TEXT_KV_HIT, TEXT_RTT),
        levels=(_Level("text.long_context_or_kv_miss", long_context, t.text_batch_long),
                _Level("text.short_requests", short, t.text_batch_short)),
        default=_Level("text.default", None, t.text_batch_default),
        margin=t.hysteresis_ratio, is_range=True)


# --- inputs ------------------------------------------------------------------

def _known(v: float | None) -> float | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else v


def _worst(pick: Callable[[Iterable[float]], float], per_gpu: Mapping[str, float | None]) -> float | None:
    present = [x for x in map(_known, per_gpu.values()) if x is not None]
    return pick(present) if present else None


def _window_values(w: WindowInputs) -> dict[str, float | None]:
    """Every input name with its value; only audio's p95 is read by a policy."""
    return {
        AUDIO_P95: _known(w.request_duration_p95_seconds.get("audio")),
        GPU_UTIL_MAX: _worst(max, w.gpu_utilization_ratio),
        GPU_MEMORY_PEAK_MAX: _worst(max, w.gpu_memory_peak_ratio),
        GPU_MEMORY_FREE_MIN: _worst(min, w.gpu_memory_free_bytes),
        TEXT_TOKENS_MEAN: _known(w.text_input_tokens_mean),
        TEXT_TOKENS_MAX: _known(w.text_input_tokens_max),
        TEXT_KV_HIT: _known(w.text_kv_cache_hit_ratio),
        TEXT_RTT: _known(w.text_network_rtt_seconds),
    }


# --- the feed ----------------------------------------------------------------

class Scheduler:
    """Per-modality batch hints. One thread calls update() once per window;
    any thread may call hints()."""

    def __init__(self, thresholds: SchedulerThresholds = SchedulerThresholds(),
                 window_s: float = 10.0):
        self.thresholds = thresholds
        self.window_s = window_s
        vision = _StepPolicy(thresholds)
        self._policies = {"audio": _audio_policy(thresholds), "text": _text_policy(thresholds),
                          "image": vision, "video": vision}
        initial = {}
        for modality, policy in self._policies.items():
            rule, size, batch_range = policy.initial()
            initial[modality] = Hint(modality, size, batch_range, rule,
                                     inputs={n: None for n in policy.inputs},
                                     missing=policy.inputs, changed_at=None)
        # (updated_at, hints): replaced whole by update(), so a reader never
        # sees half a window.
        self._snapshot: tuple[float | None, dict[str, Hint]] = (None, initial)

    def update(self, inputs: WindowInputs, now: float) -> None:
        """Decide every hint for the window that ends at `now` (epoch seconds)."""
        _, prev_hints = self._snapshot
        window = _window_values(inputs)
        hints = {}
        for modality, policy in self._policies.items():
            values = {name: window[name] for name in policy.inputs}
            prev = prev_hints[modality]
            rule, size, batch_range = policy.decide(prev, values)
            changed = (size, batch_range) != (prev.batch_size, prev.batch_range)
            hints[modality] = Hint(
                modality, size, batch_range, rule, inputs=values,
                missing=tuple(name for name, v in values.items() if v is None),
                changed_at=now if changed or prev.changed_at is None else prev.changed_at)
        self._snapshot = (now, hints)

    def hint(self, modality: str) -> Hint:
        return self._snapshot[1][modality]

    def hints(self) -> dict:
        """The JSON-able body of GET /v1/hints."""
        updated_at, hints = self._snapshot
        return {"window_s": self.window_s, "updated_at": updated_at,
                "hints": {m: hints[m].as_json() for m in MODALITIES}}
