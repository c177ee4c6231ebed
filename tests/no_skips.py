"""pytest plugin (tests/conftest.py loads it): a run with a skipped or xfailed test fails, so a missing control plane,
node or privilege cannot turn into a green run. HYBRID_ALLOW_SKIP=1 lets a developer's machine without
../shared or root skip those tests instead; CI never sets it."""
import os

import pytest

ALLOW_SKIP = os.environ.get("HYBRID_ALLOW_SKIP") == "1"


def unavailable(reason: str):
    """What a test does when something it needs is missing here: fail, or skip where skipping is allowed."""
    if ALLOW_SKIP:
        pytest.skip(reason)
    pytest.fail(f"{reason} (HYBRID_ALLOW_SKIP=1 skips this instead, outside CI)")


def pytest_sessionfinish(session, exitstatus):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    stats = reporter.stats if reporter else {}
    passed_over = [r for key in ("skipped", "xfailed", "xpassed") for r in stats.get(key, [])]
    if passed_over and not ALLOW_SKIP and exitstatus == pytest.ExitCode.OK:
        reporter.write_line(f"no_skips: {len(passed_over)} test(s) skipped or xfailed: the run fails "
                            "(HYBRID_ALLOW_SKIP=1 allows it)", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
