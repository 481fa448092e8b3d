"""What a test does when something it needs is missing: under
SPANLET_REQUIRE_KERNEL=1 (CI, where setup installs everything the suite needs)
it fails; elsewhere it skips, saying why. The one way every tier does it."""

from __future__ import annotations

import os

import pytest

REQUIRE_KERNEL = os.environ.get("SPANLET_REQUIRE_KERNEL") == "1"


def cannot_run(reason: str):
    """Fail (CI) or skip (elsewhere) the running test, naming what is missing."""
    if REQUIRE_KERNEL:
        pytest.fail(f"SPANLET_REQUIRE_KERNEL=1 but this test cannot run: {reason}", pytrace=False)
    pytest.skip(reason)
