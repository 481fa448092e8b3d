"""Pod CPU throttling (spanlet_pod_cpu_throttled_seconds_total) on fake cgroup
trees: cgroup v2, v1 (hybrid and v1-only), the systemd and cgroupfs drivers;
each pod's own cpu.stat, named through the agent's pod naming, exact; a file
missing or unreadable, or a pod gone, leaves the others and the scrape whole."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pod_throttle import pod_names, registry, samples, throttle_engine, throttled
from spanlet import cpu_throttle
from spanlet.cpu_throttle import CpuHierarchy, PodCpuThrottle, find_hierarchy, pod_cgroups
from spanlet.metrics import labels

UID = "5c1e3f4a-1b2c-4d5e-8f90-0123456789ab"
UID2 = "0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d"
CID = "3f2a" + "0" * 56 + "beef"
SYSTEMD_POD = f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice"
SYSTEMD_POD2 = f"kubepods.slice/kubepods-pod{UID2.replace('-', '_')}.slice"
CGROUPFS_POD = f"kubepods/burstable/pod{UID}"
CGROUPFS_POD2 = f"kubepods/pod{UID2}"
PODS = {UID: ("serving", "asr-0"), UID2: ("serving", "tts-0")}


def mountinfo(tmp: Path, *mounts: tuple[Path, str, str]) -> str:
    """A mountinfo file with these (mount point, fs type, super options)."""
    path = tmp / "mountinfo"
    path.write_text("".join(f"{30 + i} 1 0:{40 + i} / {point} rw,relatime - {fs} {fs} {opts}\n"
                            for i, (point, fs, opts) in enumerate(mounts)))
    return str(path)


def cgroup(root: Path, path: str, cpu_stat: str | None = None) -> Path:
    d = root / path
    d.mkdir(parents=True, exist_ok=True)
    if cpu_stat is not None:
        (d / "cpu.stat").write_text(cpu_stat)
    return d


def v2_stat(throttled_usec: int) -> str:
    return (f"usage_usec 9000000\nuser_usec 8000000\nsystem_usec 1000000\nnr_periods 70\n"
            f"nr_throttled 12\nthrottled_usec {throttled_usec}\nnr_bursts 0\nburst_usec 0\n")


def v1_stat(throttled_ns: int) -> str:
    return f"nr_periods 70\nnr_throttled 12\nthrottled_time {throttled_ns}\nnr_bursts 0\nburst_time 0\n"


@pytest.fixture
def v2(tmp_path):
    """A cgroup v2 host, systemd driver: two pods, one with a container that
    was throttled too (its own quota), and a throttled node service."""
    root = tmp_path / "cgroup"
    cgroup(root, "", "usage_usec 1\n")
    (root / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids rdma misc\n")
    cgroup(root, SYSTEMD_POD, v2_stat(1_500_000))
    cgroup(root, f"{SYSTEMD_POD}/cri-containerd-{CID}.scope", v2_stat(700_000))
    cgroup(root, SYSTEMD_POD2, v2_stat(250))
    cgroup(root, "system.slice/containerd.service", v2_stat(3_000_000))
    return root, mountinfo(tmp_path, (root, "cgroup2", "rw,nsdelegate"))


@pytest.fixture
def hybrid(tmp_path):
    """A hybrid host, cgroupfs driver: the cpu controller in v1 (cpu,cpuacct),
    the pods' cgroup ids in the unified hierarchy, which has no cpu controller."""
    v1, unified = tmp_path / "cpu,cpuacct", tmp_path / "unified"
    cgroup(unified, "")
    (unified / "cgroup.controllers").write_text("")
    cgroup(v1, CGROUPFS_POD, v1_stat(2_500_000_000))
    cgroup(v1, f"{CGROUPFS_POD}/{CID}", v1_stat(1_000_000_000))
    cgroup(v1, CGROUPFS_POD2, v1_stat(1))
    for path in (CGROUPFS_POD, f"{CGROUPFS_POD}/{CID}", CGROUPFS_POD2):
        cgroup(unified, path, "usage_usec 5\n")
    mi = mountinfo(tmp_path, (tmp_path / "memory", "cgroup", "rw,memory"),
                   (v1, "cgroup", "rw,cpu,cpuacct"), (unified, "cgroup2", "rw"))
    return v1, unified, mi


def scrape(cgroup2: Path | None, mi: str):
    return registry(throttle_engine(PodCpuThrottle(mountinfo_path=mi), pod_names(cgroup2, PODS)))


# -- where the cpu controller is -----------------------------------------------------------

def test_cgroup_v2_with_the_cpu_controller_is_read_in_microseconds(v2):
    root, mi = v2
    assert find_hierarchy(mi) == CpuHierarchy(root, "throttled_usec", 10**6, root)


def test_a_hybrid_host_is_read_in_the_v1_cpu_hierarchy_in_nanoseconds(hybrid):
    v1, unified, mi = hybrid
    assert find_hierarchy(mi) == CpuHierarchy(v1, "throttled_time", 10**9, unified)


def test_a_v1_only_host_has_no_cgroup_ids_and_no_controller_means_nothing(tmp_path):
    v1 = cgroup(tmp_path, "cpu")
    assert find_hierarchy(mountinfo(tmp_path, (v1, "cgroup", "rw,cpu"))) == \
        CpuHierarchy(v1, "throttled_time", 10**9, None)
    assert find_hierarchy(mountinfo(tmp_path, (v1, "cgroup", "rw,cpuacct"))) is None
    assert find_hierarchy(str(tmp_path / "no-mountinfo")) is None


def test_pods_are_their_own_cgroups_not_their_containers_nor_node_services(v2, hybrid):
    assert pod_cgroups(v2[0]) == sorted([f"/{SYSTEMD_POD}", f"/{SYSTEMD_POD2}"])
    assert pod_cgroups(hybrid[0]) == sorted([f"/{CGROUPFS_POD}", f"/{CGROUPFS_POD2}"])


# -- values, as a scrape has them ----------------------------------------------------------

def test_v2_pods_exact_in_seconds_named_by_the_agent(v2):
    root, mi = v2
    reg = scrape(root, mi)
    assert throttled(reg, "serving", "asr-0") == 1.5        # the pod's own 1,500,000 µs
    assert throttled(reg, "serving", "tts-0") == 0.00025
    # the container's 0.7 s is part of the pod's own throttling; the node service is in no pod
    engine = throttle_engine(PodCpuThrottle(mountinfo_path=mi), pod_names(root, PODS))
    assert samples(engine) == {labels(namespace="serving", pod="asr-0"): 1.5,
                               labels(namespace="serving", pod="tts-0"): 0.00025}


def test_v1_pods_exact_in_seconds_named_through_the_unified_ids(hybrid):
    v1, unified, mi = hybrid
    reg = scrape(unified, mi)
    assert throttled(reg, "serving", "asr-0") == 2.5        # 2,500,000,000 ns
    assert throttled(reg, "serving", "tts-0") == 1e-9


def test_pods_the_watcher_does_not_know_share_the_empty_labels(v2):
    root, mi = v2
    engine = throttle_engine(PodCpuThrottle(mountinfo_path=mi), pod_names(root, {}))
    assert samples(engine) == {labels(namespace="", pod=""): 1.5 + 0.00025}


def test_a_v1_only_host_adds_its_pods_under_the_empty_labels(tmp_path):
    v1 = tmp_path / "cpu"
    cgroup(v1, CGROUPFS_POD, v1_stat(1_000_000_000))
    cgroup(v1, CGROUPFS_POD2, v1_stat(500_000_000))
    engine = throttle_engine(PodCpuThrottle(mountinfo_path=mountinfo(tmp_path, (v1, "cgroup", "cpu"))),
                             pod_names(None, PODS))
    assert samples(engine) == {labels(namespace="", pod=""): 1.5}


# -- what is missing, unreadable or gone ---------------------------------------------------

def scrape_errors(reg) -> float | None:
    return reg.get_sample_value("spanlet_scrape_errors_total", {"node": "n1", "source": "cpu_throttle"})


@pytest.mark.parametrize("damage", ["missing", "a directory", "not a number", "no throttled field"])
def test_a_pod_whose_cpu_stat_cannot_be_read_is_left_out_alone(v2, damage):
    root, mi = v2
    stat = root / SYSTEMD_POD / "cpu.stat"
    stat.unlink()
    if damage == "a directory":
        stat.mkdir()                                  # reading it fails as an unreadable file does
    elif damage == "not a number":
        stat.write_text("throttled_usec lots\n")
    elif damage == "no throttled field":
        stat.write_text("usage_usec 5\n")             # the cpu controller not enabled there
    reg = scrape(root, mi)
    assert throttled(reg, "serving", "asr-0") is None
    assert throttled(reg, "serving", "tts-0") == 0.00025
    assert scrape_errors(reg) is None


def test_a_pod_removed_between_scrapes_goes_and_the_others_stay(v2):
    root, mi = v2
    engine = throttle_engine(PodCpuThrottle(mountinfo_path=mi), pod_names(root, PODS))
    reg = registry(engine)
    assert throttled(reg, "serving", "asr-0") == 1.5
    (root / SYSTEMD_POD2 / "cpu.stat").write_text(v2_stat(2_000_000))
    shutil.rmtree(root / SYSTEMD_POD)
    assert throttled(reg, "serving", "asr-0") is None
    assert throttled(reg, "serving", "tts-0") == 2.0          # read again at this scrape
    assert scrape_errors(reg) is None


def test_a_pod_gone_between_the_walk_and_the_read_is_left_out(v2, monkeypatch):
    root, mi = v2
    walked = pod_cgroups(root)
    shutil.rmtree(root / SYSTEMD_POD)
    monkeypatch.setattr(cpu_throttle, "pod_cgroups", lambda _root: walked)
    reg = scrape(root, mi)
    assert throttled(reg, "serving", "asr-0") is None
    assert throttled(reg, "serving", "tts-0") == 0.00025


def test_a_source_that_fails_is_counted_and_the_scrape_goes_on(v2):
    class Broken:
        def throttled(self):
            raise OSError("gone")

    reg = registry(throttle_engine(Broken(), pod_names(v2[0], PODS)))
    assert scrape_errors(reg) == 1
    assert reg.get_sample_value("spanlet_join_buffer_events", {"node": "n1"}) == 0


def test_building_the_engine_reads_nothing(tmp_path):
    mi = tmp_path / "mountinfo"
    throttle = PodCpuThrottle(mountinfo_path=str(mi))
    throttle_engine(throttle, pod_names(None, PODS))
    v1 = cgroup(tmp_path, "cpu")
    cgroup(v1, CGROUPFS_POD, v1_stat(3_000_000_000))
    mi.write_text(f"32 31 0:29 / {v1} rw - cgroup cgroup rw,cpu\n")   # there by the first read
    assert throttle.throttled() == {0: 3.0}
