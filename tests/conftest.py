"""Shared test settings: hypothesis profiles sized for a 2-core CI machine; the assertion
helpers rewritten as pytest rewrites test modules."""

import os

import pytest
from hypothesis import HealthCheck, settings

# the shared assertion helpers are rewritten like test modules, so they keep checking
# under python -O (which strips plain assert statements)
pytest.register_assert_rewrite("tests.definitions", "tests.invariants")

settings.register_profile(
    "default", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("ci", parent=settings.get_profile("default"), derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")
