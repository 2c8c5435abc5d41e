"""Shared test settings: hypothesis profiles sized for a 2-core CI machine; the assertion
helpers rewritten as pytest rewrites test modules; attnlab's C++ extensions built (where not
yet built) before the first test, visibly."""

import contextlib
import importlib
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


def pytest_sessionstart(session):
    """Load attnlab's C++ extensions (attnlab.prebuild's list) before any test, building
    those not built in this environment yet, with pytest's capture suspended: the build's
    one line ("attnlab: building ... (once) ... 23.1 s"), or a failure's one warning, shows
    at once instead of hidden for minutes inside the first test that needs a kernel."""
    from attnlab import prebuild

    capture = session.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        for module, _ in prebuild.EXTENSIONS:
            importlib.import_module(module).load_error()
