"""The metric catalogue against what produces the families: every spanlet_* BPF
map backs the entry named after it, every entry comes out of a real collect()
(on fakes) with the labels it lists, registration reads nothing, and the
settings that repeat a METRICS.md default agree with it."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client import generate_latest

from spanlet.config import SchedulerThresholds, ServingSettings
from spanlet.exporters.prometheus import SpanletCollector
from spanlet.metrics import catalogue
from collector_fakes import engine, every_source

ROOT = Path(__file__).resolve().parents[2]
DECLARATION = re.compile(r"\bBPF_([A-Z_]+)\s*\((.*?)\)\s*;", re.S)
COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)


# CO-RE (libbpf C): SPANLET_MAP / SPANLET_PINNED_MAP(kind, name, ...) of
# span_facts.bpf.h, and BTF-defined maps (`struct { ... } name SEC(".maps")`)
CORE_DECLARATION = re.compile(r"^\s*SPANLET_(?:PINNED_)?MAP\s*\(\s*\w+\s*,\s*(\w+)|}\s*(\w+)\s+SEC\(\"\.maps\"\)",
                              re.M)
DEFINE = re.compile(r"^[ \t]*#define(?:[^\n]*\\\n)*[^\n]*", re.M)


def declared_maps(text: str) -> set[str]:
    """Map names of the BPF_*( ... ) declarations in C text, multi-line ones
    too, and of the CO-RE programs' map declarations."""
    text = DEFINE.sub("", COMMENT.sub("", text))
    names = {a or b for a, b in CORE_DECLARATION.findall(text)}
    for kind, args in DECLARATION.findall(text):
        parts = [a.strip() for a in args.split(",")]
        # BPF_TABLE("type", key, leaf, name, size) and its _PINNED form name the map fourth
        names.add(parts[3] if kind.startswith("TABLE") or kind.startswith("F_TABLE") else parts[0])
    return names


def bpf_maps() -> set[str]:
    text = "\n".join(p.read_text() for p in sorted((ROOT / "bpf").glob("*.[ch]")))
    return declared_maps(text)


def test_declarations_are_found_on_one_line_and_on_several():
    text = """BPF_HASH(one_line, __u32, __u64, 8);
    /* BPF_HASH(in_a_comment, __u32, __u64, 8); */
    BPF_TABLE("lru_percpu_hash", struct flow_key, struct flow_counters,
              several_lines, SPANLET_TC_MAX_FLOWS);
    BPF_TABLE_PINNED("lru_hash", __u32, struct v, pinned, 16, "/sys/fs/bpf/x");
    #define SPANLET_MAP(kind, name, key_t, value_t, entries) \\
        struct { __uint(type, kind); } name SEC(".maps")
    SPANLET_MAP(BPF_MAP_TYPE_HASH, core_one, __u32, __u64, 8);
    SPANLET_PINNED_MAP(BPF_MAP_TYPE_LRU_HASH, core_pinned, __u32, struct v, 16);
    struct {
        __uint(type, BPF_MAP_TYPE_RINGBUF);
    } core_ring SEC(".maps");"""
    assert declared_maps(text) == {"one_line", "several_lines", "pinned", "core_one", "core_pinned", "core_ring"}
    assert {"spanlet_network_bytes_total", "spanlet_events_dropped_total", "events"} <= bpf_maps()


def test_every_spanlet_map_backs_the_entry_named_after_it():
    for name in sorted(m for m in bpf_maps() if m.startswith("spanlet_")):
        entry = catalogue.BY_NAME.get(name)
        assert entry is not None, f"BPF map {name} backs no catalogue entry"
        assert entry.source.bpf_map == name, f"{name}: the entry reads {entry.source.bpf_map!r}"


def test_every_map_of_the_catalogue_is_declared_and_read_by_its_module():
    declared = bpf_maps()
    for m in catalogue.CATALOGUE:
        if not m.source.bpf_map:
            continue
        assert m.source.bpf_map in declared, f"{m.name}: no BPF map {m.source.bpf_map}"
        reader = Path(importlib.util.find_spec(m.source.module).origin).read_text()
        assert f'"{m.source.bpf_map}"' in reader, f"{m.source.module} never reads {m.source.bpf_map}"


def test_every_module_named_as_a_source_exists():
    for m in catalogue.CATALOGUE:
        assert importlib.util.find_spec(m.source.module) is not None, m.name


@pytest.fixture(scope="module")
def collected():
    return {f.name: f for f in engine(every_source()).families()}


def test_a_real_collect_produces_exactly_the_catalogue(collected):
    assert set(collected) == set(catalogue.BY_NAME)


def test_families_carry_the_catalogue_type_help_unit_and_labels(collected):
    sampled = 0
    for name, fam in collected.items():
        m = catalogue.BY_NAME[name]
        assert (fam.type, fam.help, fam.unit) == (m.type, m.help, m.unit), name
        for s in fam.samples:
            assert {k for k, _ in s.labels} == set(m.labels), f"{name}: {s.labels}"
        sampled += bool(fam.samples)
    assert sampled >= len(catalogue.CATALOGUE) - 2     # label overflow and scrape errors: none yet


def test_the_scrape_has_the_catalogue_help_and_labels():
    reg = CollectorRegistry()
    reg.register(SpanletCollector(engine(every_source()), "n1"))
    seen = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    for m in catalogue.CATALOGUE:
        fam = seen[m.name.removesuffix("_total") if m.type == "counter" else m.name]
        assert fam.documentation == m.help and fam.type == m.type
        for s in fam.samples:
            assert set(s.labels) - {"le"} == {"node", *m.labels}, s


def test_registration_reads_no_source_and_knows_every_family():
    class Untouchable:
        def families(self):
            raise AssertionError("registration read a source")

    collector = SpanletCollector(Untouchable(), "n1")
    reg = CollectorRegistry()
    reg.register(collector)
    described = {f.name for f in collector.describe()}
    assert described == {m.name.removesuffix("_total") if m.type == "counter" else m.name
                         for m in catalogue.CATALOGUE}
    # a second collector of the same families is refused by name, as registration should
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        reg.register(SpanletCollector(Untouchable(), "n1"))


def test_the_17_in_metrics_md_order_with_their_layers():
    assert [m.number for m in catalogue.SERVING_METRICS] == list(range(1, 18))
    assert catalogue.by_number(5).name == "spanlet_sandbox_violations_total"
    assert all(m.name.endswith("_total") == (m.type == "counter") for m in catalogue.CATALOGUE)


def test_family_refuses_a_name_outside_the_catalogue():
    with pytest.raises(KeyError):
        catalogue.family("spanlet_made_up_total")


def test_breached_follows_the_side_that_fires():
    assert catalogue.breached("spanlet_jitter_sensitivity_score", 0.081)
    assert not catalogue.breached("spanlet_jitter_sensitivity_score", 0.08)
    assert catalogue.breached("spanlet_span_kernel_coverage_ratio", 0.9)
    assert not catalogue.breached("spanlet_span_kernel_coverage_ratio", None)


def _per_class(name: str) -> dict[str, float]:
    return {t.slo_class: t.value for t in catalogue.BY_NAME[name].thresholds}


def test_settings_that_repeat_a_default_agree_with_the_catalogue():
    s, sched = ServingSettings(), SchedulerThresholds()
    assert _per_class("spanlet_request_duration_seconds") == dict(s.slo_target_s)
    compliance = _per_class("spanlet_slo_compliance_ratio")
    assert {c: compliance[c] for c in s.slo_min_compliance_ratio} == dict(s.slo_min_compliance_ratio)
    (peak,) = catalogue.BY_NAME["spanlet_gpu_memory_peak_ratio"].thresholds
    assert peak.value == sched.vision_memory_peak_max
