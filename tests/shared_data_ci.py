"""In CI, a skipped test fails instead (pytest hooks): CI runs every test it collects, or says why not.

A skip hides a test that did not run. Locally one may skip (vLLM not installed, say); under CI=true
the same skip is a failure that gives its reason, and a skip while collecting a module (a
module-level ``pytest.importorskip``) is a collection error. So a test must not depend on
../shared/data: the data it needs ships in tests/fixtures. An expected failure (xfail) stays one.

Registered by tests/conftest.py, which re-exports the hooks; kept free of heavy imports so a
pytest run of its own can load it (``-p shared_data_ci``) to test it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def in_ci(environ: dict[str, str] | None = None) -> bool:
    """CI sets CI (GitHub Actions, GitLab and most runners: CI=true); 0/false/no/empty mean unset."""
    value = (os.environ if environ is None else environ).get("CI", "")
    return value.strip().lower() not in ("", "0", "false", "no")


def ci_skip_failure(skip_reason: str, environ: dict[str, str] | None = None) -> str | None:
    """The failure message for a skip in CI, else None (locally a skip stays a skip)."""
    if not in_ci(environ):
        return None
    return f"CI is set, so a skip is a failure; this did not run: {skip_reason}"


def fail_if_skipped(report: pytest.TestReport | pytest.CollectReport) -> None:
    """In CI, turn a skipped report into a failed one that gives the skip's reason."""
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
    message = ci_skip_failure(reason.removeprefix("Skipped: "))
    if message is not None:
        report.outcome = "failed"
        report.longrepr = message


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """In CI, a test that skips (``pytest.skip``, ``skipif``, ``importorskip`` in the test) fails."""
    outcome = yield
    fail_if_skipped(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    """In CI, a module that skips while it is collected is a collection error."""
    outcome = yield
    fail_if_skipped(outcome.get_result())
