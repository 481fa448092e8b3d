"""Start-up checks of the node: which kernel headers the agent compiles against
(the host's when mounted and complete, else the image's), and which
capabilities it needs, with one line for each that is missing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from require import cannot_run
from spanlet.probes import node_check, privileges


def _tree(root: Path, release: str = "6.1.0-57-cloud-amd64") -> Path:
    (root / "include" / "linux").mkdir(parents=True)
    (root / "include" / "linux" / "kconfig.h").write_text("")
    (root / "include" / "generated").mkdir()
    (root / "include" / "generated" / "autoconf.h").write_text("")
    (root / "include" / "generated" / "utsrelease.h").write_text(f'#define UTS_RELEASE "{release}"\n')
    (root / "arch" / "x86" / "include" / "generated").mkdir(parents=True)
    return root


@pytest.fixture
def modules(tmp_path, monkeypatch):
    root = tmp_path / "lib-modules"
    root.mkdir()
    monkeypatch.setattr(node_check, "MODULES", root)
    return root / os.uname().release


def test_host_headers_win_when_mounted_and_complete(modules, tmp_path):
    host = _tree(tmp_path / "host", "6.18.0-host")
    modules.mkdir()
    (modules / "build").symlink_to(host)
    image = _tree(tmp_path / "image")
    h = node_check.find_headers("", str(image))
    assert (h.origin, h.via_env, h.path) == ("host", False, modules / "build")
    assert h.describe().startswith(f"host's {host}")
    assert "headers of 6.18.0-host" in h.describe()


@pytest.mark.parametrize("host_state", ["absent", "empty", "no-generated"])
def test_the_images_headers_when_the_hosts_are_missing_or_incomplete(modules, tmp_path, host_state):
    if host_state != "absent":
        modules.mkdir()
        (modules / "build" / "include").mkdir(parents=True)
    if host_state == "no-generated":
        (modules / "build" / "include" / "linux").mkdir()
        (modules / "build" / "include" / "linux" / "kconfig.h").write_text("")
    image = _tree(tmp_path / "image")
    h = node_check.find_headers("", str(image))
    assert (h.origin, h.via_env, h.path) == ("image", True, image)
    assert h.describe() == (f"image's {image} (headers of 6.1.0-57-cloud-amd64; "
                            f"running {os.uname().release})")


def test_no_headers_at_all_names_both_places(modules, tmp_path):
    incomplete = tmp_path / "image"
    (incomplete / "include" / "linux").mkdir(parents=True)
    with pytest.raises(node_check.EnvironmentProblem) as e:
        node_check.find_headers("", str(incomplete))
    assert str(modules / "build") in str(e.value) and str(incomplete) in str(e.value)
    with pytest.raises(node_check.EnvironmentProblem):
        node_check.find_headers("", "")


def test_configured_headers_come_first(modules, tmp_path):
    mine = _tree(tmp_path / "mine")
    h = node_check.find_headers(str(mine), str(_tree(tmp_path / "image")))
    assert (h.origin, h.path) == ("configured", mine)
    assert h.describe().startswith(f"kernel_headers {mine}")


STATUS = "Name:\tx\nCapInh:\t0000000000000000\nCapPrm:\t000001ffffffffff\nCapEff:\t{:016x}\n"


def _mask(*caps: str) -> int:
    return sum(1 << privileges.CAP_NUMBERS[c] for c in caps)


def test_effective_capabilities_are_read_from_capeff():
    text = STATUS.format(_mask("BPF", "PERFMON", "NET_ADMIN"))
    assert privileges.effective_capabilities(text) == {"BPF", "PERFMON", "NET_ADMIN"}
    assert privileges.effective_capabilities(STATUS.format(0)) == set()


ALL = {"SYS_ADMIN", "NET_ADMIN", "SYS_PTRACE"}


def test_sys_resource_is_needed_only_where_memlock_is_charged():
    assert privileges.check(True, caps=ALL, memcg=True).missing == []
    p = privileges.check(True, caps=ALL, memcg=False)
    assert p.missing == ["SYS_RESOURCE"]
    assert p.missing_lines() == [
        "capability CAP_SYS_RESOURCE missing: this kernel charges BPF maps to RLIMIT_MEMLOCK and "
        "the limit cannot be raised: maps larger than the limit are refused"]
    assert "not needed" in privileges.check(True, caps=ALL, memcg=True).summary()


@pytest.mark.parametrize("cap", sorted(ALL))
def test_each_missing_capability_gets_one_line_saying_what_fails(cap):
    p = privileges.check(True, caps=ALL - {cap}, memcg=True)
    assert p.missing == [cap]
    [line] = p.missing_lines()
    why = privileges.WHAT_FAILS["SYS_ADMIN-alone" if cap == "SYS_ADMIN" else cap]
    assert line == f"capability CAP_{cap} missing: {why}"


def test_without_sys_admin_bpf_and_perfmon_leave_the_pinned_maps_unopened():
    p = privileges.check(False, caps={"BPF", "PERFMON", "SYS_PTRACE"}, memcg=True)
    assert p.missing_lines() == [f"capability CAP_SYS_ADMIN missing: {privileges.WHAT_FAILS['SYS_ADMIN']}"]
    assert "NET_ADMIN" not in p.needed          # tc disabled


def test_memcg_probe_on_this_kernel_creates_maps_under_a_zero_memlock_limit():
    if os.geteuid() != 0:
        cannot_run("bpf() needs root")
    # Kernels from 5.11 on charge maps to the memory cgroup: this one is 6.x.
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    assert privileges.memcg_charged() is ((major, minor) >= (5, 11))
