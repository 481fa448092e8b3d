"""cgroup path → container id and pod UID, on the path shapes each runtime and
driver really writes."""

import os

import pytest

from spanlet.cgroups import CgroupIndex, Container, cgroup2_root, parse_cgroup_path

CID = "3f2a" + "0" * 56 + "beef"
UID = "5c1e3f4a-1b2c-4d5e-8f90-0123456789ab"
UID_ = UID.replace("-", "_")


@pytest.mark.parametrize("path, expected", [
    # systemd driver
    (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/"
     f"cri-containerd-{CID}.scope", Container("containerd", CID, UID)),
    (f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/"
     f"crio-{CID}.scope", Container("cri-o", CID, UID)),
    (f"/kubepods.slice/kubepods-pod{UID_}.slice/crio-{CID}.scope", Container("cri-o", CID, UID)),
    (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/"
     f"docker-{CID}.scope", Container("docker", CID, UID)),
    # cgroupfs driver
    (f"/kubepods/burstable/pod{UID}/{CID}", Container("containerd", CID, UID)),
    (f"/kubepods/pod{UID}/{CID}", Container("containerd", CID, UID)),
    (f"/kubepods/besteffort/pod{UID}/crio-{CID}", Container("cri-o", CID, UID)),
    # plain docker, no Kubernetes
    (f"/system.slice/docker-{CID}.scope", Container("docker", CID, "")),
    (f"/docker/{CID}", Container("docker", CID, "")),
    # pod-level cgroup (pause/sandbox) and host services
    (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice",
     Container("", "", UID)),
    ("/system.slice/containerd.service", Container()),
    ("/user.slice/user-0.slice/session-1.scope", Container()),
    ("/", Container()),
])
def test_parse_cgroup_path(path, expected):
    assert parse_cgroup_path(path) == expected


def test_index_maps_ids_of_a_real_tree(tmp_path):
    leaf = tmp_path / "kubepods" / f"pod{UID}" / CID
    leaf.mkdir(parents=True)
    idx = CgroupIndex(root=tmp_path, rescan_s=0)
    assert idx.path(os.stat(leaf).st_ino) == f"/kubepods/pod{UID}/{CID}"
    assert idx.container(os.stat(leaf).st_ino) == Container("containerd", CID, UID)
    assert idx.path(1) is None


def test_cgroup2_root_from_mountinfo(tmp_path):
    mi = tmp_path / "mountinfo"
    mi.write_text("22 1 0:20 / /sys/fs/cgroup/unified rw,relatime shared:7 - cgroup2 cgroup2 rw\n"
                  "23 1 0:21 / /sys rw - sysfs sysfs rw\n")
    assert str(cgroup2_root(str(mi))) == "/sys/fs/cgroup/unified"
    mi.write_text("23 1 0:21 / /sys rw - sysfs sysfs rw\n")
    assert cgroup2_root(str(mi)) is None
