"""tests/shared_data_ci.py (registered by tests/conftest.py): under CI=true every skip is a failure
that gives its reason, at collection too; locally a skip stays a skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from shared_data_ci import REPO, ci_skip_failure

REASON = "/nowhere/aime24.jsonl not found (set VERL_SAT_SHARED_DATA)"

SKIPS = f"""import pytest

def test_data():
    pytest.skip({REASON!r})

@pytest.mark.skipif(True, reason="needs a GPU")
def test_gpu():
    pass

def test_import():
    pytest.importorskip("no_such_module_anywhere")

@pytest.mark.xfail(reason="known bug", strict=True)
def test_known_bug():
    assert False

def test_runs():
    pass
"""

MODULE_SKIP = """import pytest

pytest.importorskip("no_such_module_anywhere")

def test_never_collected():
    pass
"""


def run_pytest(tmp_path: Path, source: str, ci: str) -> str:
    """``source`` as a test file, in a pytest run of its own with only the hooks loaded."""
    test = tmp_path / "test_skips.py"
    test.write_text(source)
    env = {**os.environ, "CI": ci, "PYTHONPATH": str(REPO / "tests")}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "shared_data_ci", "-p", "no:cacheprovider", str(test)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return f"rc={run.returncode}\n{run.stdout}{run.stderr}"


def test_a_skip_fails_only_in_ci():
    """The message gives the skip's reason under any CI value that means set, and None when unset."""
    assert ci_skip_failure(REASON, {"CI": "true"}).endswith(REASON)
    assert ci_skip_failure("needs a GPU", {"CI": "1"}).endswith("needs a GPU")  # any skip, not only data
    for local in ({}, {"CI": ""}, {"CI": "false"}, {"CI": "0"}, {"CI": "no"}):
        assert ci_skip_failure(REASON, local) is None


def test_ci_turns_every_skip_into_a_failure(tmp_path: Path):
    """pytest.skip, skipif and importorskip in a test each fail with their reason (skipif's at setup:
    an error); xfail is untouched."""
    out = run_pytest(tmp_path, SKIPS, "true")
    assert out.startswith("rc=1"), out
    assert "2 failed, 1 passed, 1 xfailed, 1 error" in out and "skipped" not in out, out
    for reason in (REASON, "needs a GPU", "could not import 'no_such_module_anywhere'"):
        assert f"CI is set, so a skip is a failure; this did not run: {reason}" in out, out


def test_ci_turns_a_module_level_skip_into_a_collection_error(tmp_path: Path):
    """A module-level importorskip (as tests/test_eval_vllm.py once had) is an error, not a skip."""
    out = run_pytest(tmp_path, MODULE_SKIP, "true")
    assert out.startswith("rc=2"), out
    assert "1 error" in out and "skipped" not in out, out
    assert "this did not run: could not import 'no_such_module_anywhere'" in out, out


def test_locally_the_skips_stay_skips(tmp_path: Path):
    """Without CI the same files skip, as pytest has them."""
    assert "1 passed, 3 skipped, 1 xfailed" in run_pytest(tmp_path, SKIPS, "false")
    assert "1 skipped" in run_pytest(tmp_path, MODULE_SKIP, "")
