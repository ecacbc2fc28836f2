"""A resumed Megatron optimizer keeps Adam's step, its moments and, when verl is asked, its lr schedule.

``tests/megatron_resume_run.py`` (a subprocess: it initialises torch.distributed) trains verl's own
``MegatronEngineWithLMHead`` for 3 optimizer steps, saves verl's checkpoint and loads it into fresh
engines through verl's ``MegatronCheckpointManager`` and megatron-core 0.16.1's ``dp_reshardable``
load (verl's default). With verl-sat's plugin (``verl_sat.verl_fixes.keep_adam_step``) the
resumed optimizer holds the saved step, one tensor per parameter, and the next step is step 4;
megatron-core's own load gives step 0 (and one step tensor shared by every parameter). About 45 s
on 2 shared cores, most of it imports and three engine builds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from optimizer_state import saved_moments, saved_state

pytestmark = pytest.mark.gpu_branch  # docs/gpu_path.md, "Adam on resume"
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "recipes/sat_paper"))  # the smoke's check, run by path
import smoke  # noqa: E402

STEPS = 3  # megatron_resume_run.STEPS


@pytest.fixture(scope="module")
def resume_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    from verl_sat.default.model import create

    tmp = tmp_path_factory.mktemp("megatron_resume")
    model = create(tmp / "model")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.setdefault("OMP_NUM_THREADS", "1")
    out = subprocess.run(
        [sys.executable, str(HERE / "megatron_resume_run.py"), str(model), str(tmp / "ckpt")],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=HERE,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), tmp / "ckpt"


def test_the_checkpoint_files_hold_what_the_optimizer_held(resume_run: tuple[dict, Path]) -> None:
    run, ckpt = resume_run
    assert run["optimizer"] == "ChainedOptimizer" and run["inner"] == ["AdamW"]  # torch's: no TE on CPU
    saved = saved_state(ckpt)
    assert {g["step"] for g in saved["param_groups"]} == {STEPS} and smoke.adam_step(ckpt) == STEPS
    assert saved["lr_scheduler_num_steps"] == run["saved"]["lr_scheduler_num_steps"] == STEPS
    for chained in run["saved"]["chained"]:
        assert chained["steps"] == [STEPS]
        assert saved_moments(saved, chained["moments"]) == chained["moments"]


def test_a_resumed_optimizer_has_the_saved_adam_step_moments_and_schedule(resume_run: tuple[dict, Path]) -> None:
    run, _ = resume_run
    assert run["fix_installed"]  # by verl-sat's plugin, in a process that only imported verl
    saved, loaded, after = run["saved"], run["loaded"], run["after_one_more_step"]
    assert loaded["lr_scheduler_num_steps"] == STEPS  # optim.use_checkpoint_opt_param_scheduler=true
    for was, now, next_ in zip(saved["chained"], loaded["chained"], after["chained"], strict=True):
        assert now["steps"] == [STEPS] and now["group_steps"] == [STEPS]
        assert now["moments"] == was["moments"] and now["lr"] == was["lr"]
        assert next_["steps"] == [STEPS + 1]  # one step each: no step tensor shared between parameters
        assert next_["moments"] != was["moments"]
    assert after["lr_scheduler_num_steps"] == STEPS + 1


def test_megatron_cores_own_load_resumes_adam_at_step_0(resume_run: tuple[dict, Path]) -> None:
    """Why the plugin's fix is there (it fails, and the fix can go, once megatron-core loads the step)."""
    run, _ = resume_run
    unfixed = run["unfixed"]
    for was, now in zip(run["saved"]["chained"], unfixed["chained"], strict=True):
        assert now["group_steps"] == [STEPS] and now["steps"] == [0.0]  # the template's step, not the saved one
        assert now["moments"] == was["moments"]
    assert unfixed["lr_scheduler_num_steps"] == 0  # verl's default: the scheduler is not loaded


def test_the_plugin_installs_the_fix_on_every_platform() -> None:
    """Among verl-sat's work-arounds the plugin installs whatever the platform (``verl_fixes.install``,
    before any ``VERL_PLATFORM`` check), and megatron-core's optimizer carries it once imported."""
    import verl  # noqa: F401  (the plugin)
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from verl_sat import verl_fixes
    from verl_sat.verl_fixes import ADAM_STEP_MARKER, megatron_core_adam_step_on_resume_0_16_to_0_19

    assert megatron_core_adam_step_on_resume_0_16_to_0_19 in verl_fixes.FIXES
    assert getattr(DistributedOptimizer.load_state_dict, ADAM_STEP_MARKER, False)
    megatron_core_adam_step_on_resume_0_16_to_0_19()  # a second install wraps nothing again
    assert not getattr(DistributedOptimizer.load_state_dict.__wrapped__, ADAM_STEP_MARKER, False)
