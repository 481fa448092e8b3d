"""Fixtures of the kernel tier: real programs loaded into the running kernel,
driven by child processes and namespaces the tests make."""

from __future__ import annotations

import secrets

import pytest

from sandbox_harness import Harness, Pools, _own_cgroup
from spanlet.cgroups import CgroupResolver


@pytest.fixture(scope="module")
def pools():
    p = Pools(secrets.token_hex(4))
    try:
        p.create()
        yield p
    finally:
        p.remove()


@pytest.fixture(scope="module")
def audit(pools):
    h = Harness(pools.config())
    try:
        yield h
    finally:
        h.stop()


@pytest.fixture(scope="module")
def own_cgroup_id():
    return CgroupResolver().id(_own_cgroup())
