"""The CO-RE objects the package build makes (bpf/objects/<arch>/, setup.py):
each shipped program is built for x86-64 and arm64, and libbpf opens both
(nothing is loaded: no kernel needed) with the same programs, sections,
maps and settings; the probe loads this machine's."""

from __future__ import annotations

import pytest

import core_fixture
from spanlet.probes.base import BPF_DIR
from spanlet.probes.libbpf import Object
from spanlet.probes.span_ctx import SpanCtxProbe

PROGRAMS = core_fixture.build_bpf.CORE_PROGRAMS


def opened(name: str, arch: str) -> tuple[dict, list, list]:
    path = BPF_DIR / "objects" / arch / f"{name}.bpf.o"
    assert path.is_file(), f"{path} was not built (pip install -e . builds it)"
    with Object.open_file(path) as obj:
        return obj.programs(), obj.maps(), sorted(obj.settings())


@pytest.mark.parametrize("name", PROGRAMS)
def test_both_architectures_hold_the_same_programs_maps_and_settings(name):
    x86, arm64 = opened(name, "x86"), opened(name, "arm64")
    assert x86 == arm64
    programs, maps, settings = x86
    assert programs and maps and settings


def test_the_probe_loads_this_machines_object(cfg):
    assert SpanCtxProbe.name in PROGRAMS
    path = SpanCtxProbe(cfg).object_path
    assert path.is_file() and path.parent.parent == BPF_DIR / "objects"
    assert path.parent.name in core_fixture.ARCHES
