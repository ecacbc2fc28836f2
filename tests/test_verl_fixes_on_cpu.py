"""verl_sat.verl_fixes: each work-around holds after a plain ``import verl``, without ``VERL_PLATFORM``.

Each check runs in a fresh interpreter whose environment has no ``VERL_PLATFORM`` (as on a GPU
node) and no plugin policy, so only the ``verl.plugins`` entry point can have installed the fix.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import verl_sat

CLEARED = ("VERL_PLATFORM", "VERL_USE_EXTERNAL_PLUGINS", "VERL_USE_EXTERNAL_MODULES", "VERL_LOGGING_LEVEL")

# The logger of each verl module that calls logger.<level>(..., flush=True), and whether the
# module can be imported here (http_server_engine imports sglang, which a CPU machine lacks).
FLUSH_KWARG_LOGGERS = {
    "verl.trainer.ppo.v1.trainer_separate_async": True,
    "verl.workers.rollout.sglang_rollout.http_server_engine": False,
}

CHECK = """
import importlib, io, logging, os, sys
assert "VERL_PLATFORM" not in os.environ
import verl
name, import_module = sys.argv[1], sys.argv[2] == "1"
logger = importlib.import_module(name).logger if import_module else logging.getLogger(name)
assert logger is logging.getLogger(name)
stream = io.StringIO()
logger.addHandler(logging.StreamHandler(stream))
logger.setLevel(logging.INFO)
logger.info("hybrid replicas disabled", flush=True)  # verl 0.9.1's call, at INFO
assert stream.getvalue() == "hybrid replicas disabled\\n", stream.getvalue()
print("ok")
"""


def run_fresh(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``CHECK`` in a new interpreter that imports the verl_sat this test imported (not the cwd's)."""
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    source = str(Path(verl_sat.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([source, *filter(None, [os.environ.get("PYTHONPATH")])])
    return subprocess.run(
        [sys.executable, "-c", CHECK, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=300
    )


@pytest.mark.gpu_branch
@pytest.mark.parametrize(("name", "import_module"), sorted(FLUSH_KWARG_LOGGERS.items()))
def test_flush_kwarg_logged_without_cpu_platform(tmp_path: Path, name: str, import_module: bool) -> None:
    out = run_fresh(tmp_path, name, "1" if import_module else "0")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "ok"


def test_fix_applies_to_a_logger_verl_created_first() -> None:
    import logging

    from verl_sat.verl_fixes import FlushTolerantLogger, make_flush_tolerant

    name = "verl_sat.tests.created_before_the_fix"
    existing = logging.getLogger(name)
    existing.setLevel(logging.INFO)
    with pytest.raises(TypeError):
        existing.info("x", flush=True)
    assert make_flush_tolerant(name) is existing
    assert isinstance(existing, FlushTolerantLogger) and existing.level == logging.INFO
    existing.info("x", flush=True)
