"""tests/shared_data_ci.py (registered by tests/conftest.py): in CI a test that skips for missing
../shared/data fails instead; locally it stays a skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from shared_data_ci import REPO, shared_data_failure

REASON = "/nowhere/aime24.jsonl not found (set VERL_SAT_SHARED_DATA)"  # as tests/test_prepare_math.py words it


def test_shared_data_skip_fails_only_in_ci():
    assert shared_data_failure(REASON, {"CI": "true"}).endswith(REASON)
    assert shared_data_failure(REASON, {"CI": "1"}) is not None
    for local in ({}, {"CI": ""}, {"CI": "false"}, {"CI": "0"}):
        assert shared_data_failure(REASON, local) is None
    assert shared_data_failure("needs a GPU", {"CI": "true"}) is None  # other skips stay skips


def test_ci_turns_the_skip_into_a_failure(tmp_path: Path):
    """The hook itself, in a pytest run of its own with CI=true: the skip is reported as a failure."""
    test = tmp_path / "test_needs_data.py"
    test.write_text(
        "import pytest\n\n"
        "def test_data():\n"
        f"    pytest.skip({REASON!r})\n\n"
        "def test_other():\n"
        "    pytest.skip('not about the data')\n"
    )
    env = {**os.environ, "CI": "true", "PYTHONPATH": str(REPO / "tests")}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "shared_data_ci", "-p", "no:cacheprovider", str(test)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "1 failed, 1 skipped" in out, out
    assert "CI is set but the shared data is missing" in out, out
