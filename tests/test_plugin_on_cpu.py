"""The ``verl.plugins`` entry point registers the losses in a fresh interpreter (as in a Ray worker)."""

from __future__ import annotations

import os
import subprocess
import sys

CHECK = (
    "import sys, verl\n"
    "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R\n"
    "print(sorted(k for k in R if k.startswith('sat')), 'verl_sat.sat.losses' in sys.modules)\n"
)


def run_fresh(policy: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_PLUGINS", "VERL_USE_EXTERNAL_MODULES")}
    if policy is not None:
        env["VERL_USE_EXTERNAL_PLUGINS"] = policy
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_entry_point_registers_losses_on_plain_import_verl():
    assert run_fresh(None) == "['sat', 'sat_gspo'] True"


def test_entry_point_is_the_mechanism():
    # with plugin discovery off, nothing registers them: the entry point is what did it above
    assert run_fresh("none") == "[] False"


def test_importing_verl_sat_first_registers_everything():
    """``import verl_sat`` before verl must not half-import the plugin (verl swallows its errors)."""
    code = (
        "import verl_sat\n"
        "from verl.plugin.platform import PlatformRegistry\n"
        "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R\n"
        "from verl.trainer.ppo.v1 import get_trainer_cls\n"
        "assert PlatformRegistry.get('cpu') is not None\n"
        "assert 'sat' in R and 'sat_gspo' in R\n"
        "print(get_trainer_cls('sat_separate_async').__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "SATPPOTrainerSeparateAsync"
