"""In CI, a test that skips because ../shared/data is missing fails instead (a pytest hook).

Registered by tests/conftest.py, which re-exports the hook; kept free of heavy imports so a
pytest run of its own can load it (``-p shared_data_ci``) to test it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("VERL_SAT_SHARED_DATA", REPO.parent / "shared" / "data"))
# a skip whose reason names the shared data (every such skip in the suite mentions VERL_SAT_SHARED_DATA)
SHARED_DATA_MARKERS = ("VERL_SAT_SHARED_DATA", "shared/data", str(SHARED_DATA))


def in_ci(environ: dict[str, str] | None = None) -> bool:
    """CI sets CI (GitHub Actions, GitLab and most runners: CI=true); 0/false/no/empty mean unset."""
    value = (os.environ if environ is None else environ).get("CI", "")
    return value.strip().lower() not in ("", "0", "false", "no")


def shared_data_failure(skip_reason: str, environ: dict[str, str] | None = None) -> str | None:
    """The failure message for a skip that hides missing shared data in CI, else None.

    Locally a test may skip when ../shared/data (or $VERL_SAT_SHARED_DATA) is missing; in CI the
    data must be there, so the same skip is a failure that says what is missing.
    """
    if not in_ci(environ) or not any(marker in skip_reason for marker in SHARED_DATA_MARKERS):
        return None
    return f"CI is set but the shared data is missing, so this test did not run: {skip_reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """In CI, turn a skip for missing ../shared/data into a failure (locally it stays a skip)."""
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or hasattr(report, "wasxfail") or not isinstance(report.longrepr, tuple):
        return
    message = shared_data_failure(str(report.longrepr[2]))
    if message is not None:
        report.outcome = "failed"
        report.longrepr = message
