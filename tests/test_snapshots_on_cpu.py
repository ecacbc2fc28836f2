"""TransferQueue snapshots are pruned with the checkpoints they belong to (verl_sat.trainer.faults,
docs/faults.md#checkpoints-on-disk).

verl 0.9.1's ``_save_checkpoint`` pickles the whole queue into ``global_step_k/transfer_queue``;
its ``trainer.max_actor_ckpt_to_keep`` removes only ``global_step_k/actor``. ``prune_snapshots``
removes the rest of a pruned step, never the tracked one nor one whose actor verl kept. Here: on a
fake directory tree, through verl's own ``_save_checkpoint`` and checkpoint-manager retention
(``BaseCheckpointManager.register_checkpoint``), and in one end-to-end CPU run (about 2.5 min) that
also fills the disk at its last save.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from omegaconf import OmegaConf

from verl_sat.trainer.faults import (
    TRACKER,
    FaultMixin,
    checkpoint_complete,
    checkpoint_steps,
    latest_checkpoint,
    prune_snapshots,
    pruned_steps,
    read_tracker,
    write_tracker,
)


def step_dir(root: Path, step: int, *parts: str) -> Path:
    """``global_step_<step>`` holding ``parts``: directories (``actor``, ``transfer_queue``...) or
    ``data.pt``, each with a file in it."""
    d = root / f"global_step_{step}"
    d.mkdir(parents=True, exist_ok=True)
    for part in parts:
        if part == "data.pt":
            (d / part).write_bytes(b"d")
        else:
            (d / part).mkdir()
            (d / part / "state.pkl").write_bytes(b"x")
    return d


def names(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}


# ---------------------------------------------------------------------------------------------
# the pruning rule, on a fake tree
# ---------------------------------------------------------------------------------------------
def test_only_what_verl_pruned_goes(tmp_path: Path) -> None:
    step_dir(tmp_path, 1, "data.pt", "transfer_queue")  # actor pruned by verl: all of it goes
    step_dir(tmp_path, 2, "data.pt", "transfer_queue", "transfer_queue.old", "critic")  # critic kept by verl
    step_dir(tmp_path, 3, "actor", "data.pt", "transfer_queue")  # kept by verl: untouched
    step_dir(tmp_path, 4, "actor", "data.pt", "transfer_queue")  # the tracked checkpoint
    step_dir(tmp_path, 5, "data.pt")  # newer than the tracker: a save in progress, untouched
    write_tracker(tmp_path, 4)
    lines: list[str] = []
    assert pruned_steps(tmp_path) == [1, 2]
    assert prune_snapshots(tmp_path, log=lines.append) == [1, 2]
    assert checkpoint_steps(tmp_path) == [2, 3, 4, 5]
    assert names(tmp_path / "global_step_2") == {"data.pt", "critic"}
    complete = {"actor", "data.pt", "transfer_queue"}
    assert names(tmp_path / "global_step_3") == names(tmp_path / "global_step_4") == complete
    assert names(tmp_path / "global_step_5") == {"data.pt"}
    (line,) = lines
    assert "global_step_1, global_step_2" in line and "actor pruned by verl" in line
    # what a resume or a rollback reads is unchanged
    assert read_tracker(tmp_path) == 4 and latest_checkpoint(tmp_path, async_mode=True) == 4
    assert checkpoint_steps(tmp_path, with_actor=True) == [3, 4]
    # idempotent: a second call finds nothing, and says nothing
    assert prune_snapshots(tmp_path, log=lines.append) == [] and len(lines) == 1


@pytest.mark.parametrize("tracker", [None, "", "4x"], ids=["missing", "empty", "torn"])
def test_without_a_readable_tracker_nothing_is_pruned(tmp_path: Path, tracker: str | None) -> None:
    step_dir(tmp_path, 1, "data.pt", "transfer_queue")
    step_dir(tmp_path, 2, "actor", "data.pt", "transfer_queue")
    if tracker is not None:
        (tmp_path / TRACKER).write_text(tracker)
    assert prune_snapshots(tmp_path, log=pytest.fail) == []
    assert names(tmp_path / "global_step_1") == {"data.pt", "transfer_queue"}


def test_the_tracked_step_is_kept_even_without_its_actor(tmp_path: Path) -> None:
    # verl's max_ckpt_to_keep=1 removes the previous actor during the next save, before the tracker
    # moves: a torn save leaves the tracker naming a step without actor; it is never pruned
    step_dir(tmp_path, 3, "data.pt", "transfer_queue")
    write_tracker(tmp_path, 3)
    assert prune_snapshots(tmp_path, log=pytest.fail) == []
    assert names(tmp_path / "global_step_3") == {"data.pt", "transfer_queue"}


def test_a_removal_that_fails_is_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    step_dir(tmp_path, 1, "data.pt", "transfer_queue")
    step_dir(tmp_path, 2, "actor", "data.pt", "transfer_queue")
    write_tracker(tmp_path, 2)

    def read_only(path: Any, *args: Any, **kwargs: Any) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(shutil, "rmtree", read_only)
    lines: list[str] = []
    assert prune_snapshots(tmp_path, log=lines.append) == []
    assert lines == [f"[verl-sat] warning: could not prune {tmp_path / 'global_step_1'}: Permission denied"]


# ---------------------------------------------------------------------------------------------
# through verl's own _save_checkpoint and verl's own actor retention
# ---------------------------------------------------------------------------------------------
class RetainingActor:
    """The actor worker group as verl's ``_save_checkpoint`` calls it: writes the actor's files,
    then applies verl's own retention (``BaseCheckpointManager.register_checkpoint``, what the
    FSDP and Megatron checkpoint managers call after a save)."""

    def __init__(self) -> None:
        from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager

        self.manager = object.__new__(BaseCheckpointManager)
        self.manager.previous_saved_paths = []

    def save_checkpoint(self, local_path: str, hdfs_path: Any, global_step: int, max_ckpt_to_keep: Any) -> None:
        Path(local_path).mkdir(parents=True, exist_ok=True)
        (Path(local_path) / "model.pt").write_bytes(b"weights")
        self.manager.register_checkpoint(local_path, max_ckpt_to_keep)


def verl_saving_trainer(root: Path, keep: int | None) -> Any:
    """verl's PPOTrainer (separate_async) with verl-sat's FaultMixin, set up for ``_save_checkpoint``."""
    from verl.trainer.ppo.v1 import trainer_base

    class Trainer(FaultMixin, trainer_base.PPOTrainer):
        def on_step_end(self) -> None: ...

        def on_sample_end(self) -> None: ...

    trainer = object.__new__(Trainer)
    trainer.config = OmegaConf.create(
        {
            "sat": {},
            "trainer": {"default_local_dir": str(root), "default_hdfs_dir": None, "max_actor_ckpt_to_keep": keep},
            "actor_rollout_ref": {"actor": {"checkpoint": {}}},
        }
    )
    trainer.trainer_mode, trainer.use_critic = "separate_async", False
    trainer.actor_rollout_wg = RetainingActor()
    trainer.train_dataloader = mock.Mock(state_dict=lambda: {"pos": 1})
    trainer.checkpoint_callback = mock.Mock()
    return trainer


@pytest.mark.parametrize(("keep", "left"), [(1, [3]), (2, [2, 3]), (None, [1, 2, 3])])
def test_verls_save_keeps_as_many_snapshots_as_actors(tmp_path: Path, monkeypatch, capsys, keep, left) -> None:
    from verl.trainer.ppo.v1 import trainer_base

    tq = mock.Mock()
    tq.save_checkpoint.side_effect = lambda path, metadata=None: Path(path).mkdir(parents=True)
    monkeypatch.setattr(trainer_base, "tq", tq)
    trainer = verl_saving_trainer(tmp_path, keep)
    for step in (1, 2, 3):
        trainer.global_steps = step
        trainer._save_checkpoint()  # verl's save, unchanged; then verl-sat's prune
    assert checkpoint_steps(tmp_path) == left
    assert all(checkpoint_complete(tmp_path / f"global_step_{k}") for k in left)  # actor, data.pt and snapshot
    assert read_tracker(tmp_path) == 3
    out = capsys.readouterr().out
    assert ("removed the TransferQueue snapshot" in out) == (keep is not None)


# ---------------------------------------------------------------------------------------------
# end to end: the default CPU job, a save every step, one checkpoint kept
# ---------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_a_cpu_run_keeps_only_the_kept_snapshots_and_a_full_disk_ends_it(cached_default_assets: Path, tmp_path: Path):
    """``python -m verl_sat.main`` on the CPU default (separate_async, lag 2), 4 steps with
    ``save_freq=1`` and ``max_actor_ckpt_to_keep=2``, the disk filling during step 4's checkpoint
    (``sat.actor_class=disk_full.DiskFullActor``, tests/disk_full.py). One launch for two guards (CI time):

    - snapshots go with their actors: after step 3's save verl pruned step 1's actor and verl-sat
      its snapshot, so nothing of step 1 is left;
    - a full disk (``FaultMixin._save_checkpoint``) stops the job with exit 1 and its line naming the
      path, and the tracker still names step 3, complete, which is what a resume loads. Step 4's
      half-written save stays (verl wrote its actor first), and no pruning follows a failed save;
    - ``sat.heldout`` (64 problems, at steps 0 and 2): before training the worker's number is the
      study's definition on the same weights (``verl_sat.default.heldout`` on the assets' model, in
      this process); optimizer step 2's lands on global step 1's row and on the console."""
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "verl_sat.main",
        f"sat.assets_dir={cached_default_assets}",
        f"sat.run_dir={run_dir}",
        "trainer.total_training_steps=4",
        "trainer.save_freq=1",
        "trainer.max_actor_ckpt_to_keep=2",
        "sat.actor_class=disk_full.DiskFullActor",
        f"sat.heldout.problems={HELDOUT_N}",
        "sat.heldout.at=[0,2]",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VERL_FILE_LOGGER", "VERL_SAT_RUN_DIR"))}
    tests = str(Path(__file__).resolve().parent)  # disk_full, for the driver and (inherited) every worker
    env["PYTHONPATH"] = os.pathsep.join([tests, *filter(None, [env.get("PYTHONPATH")])])
    env["VERL_SAT_TEST_ENOSPC_STEP"] = "4"  # the global step whose checkpoint fills the disk
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    console = out.stdout + out.stderr
    assert out.returncode == 1, console[-6000:]
    checkpoints = run_dir / "checkpoints"
    errors = [line for line in out.stdout.splitlines() if line.startswith("[verl-sat] error: the checkpoint of step 4")]
    assert len(errors) == 1, console[-6000:]
    assert "No space left on device" in errors[0] and str(checkpoints / "global_step_4") in errors[0]
    assert "the latest checkpoint stays global_step_3" in errors[0]
    assert checkpoint_steps(checkpoints) == [2, 3, 4]  # step 1: actor (verl) and snapshot (verl-sat) gone
    assert names(checkpoints / "global_step_3") == {"actor", "data.pt", "transfer_queue"}
    assert (checkpoints / "global_step_3" / "transfer_queue" / "metadata.json").is_file()
    assert "actor" not in names(checkpoints / "global_step_2")  # verl's keep-2 during step 4's save
    assert not checkpoint_complete(checkpoints / "global_step_4")
    assert read_tracker(checkpoints) == 3 and latest_checkpoint(checkpoints, async_mode=True) == 3
    logs = console + (run_dir / "console.log").read_text()
    assert "removed the TransferQueue snapshot of global_step_1" in logs
    assert "removed the TransferQueue snapshot of global_step_2" not in logs  # nothing after the failed save
    check_heldout_rows(cached_default_assets, run_dir, out.stdout)


HELDOUT_N = 64


def check_heldout_rows(assets: Path, run_dir: Path, stdout: str) -> None:
    """The product's held-out numbers against the study's definition (sat.heldout, docs/study.md)."""
    from studies.lib.loop import load_assets
    from verl_sat.default.heldout import heldout_accuracy, heldout_problems
    from verl_sat.files import read_jsonl

    rows = {int(r["step"]): r["data"] for r in read_jsonl(run_dir / "metrics.jsonl")}
    model, tokenizer = load_assets(assets)
    study = heldout_accuracy(model, tokenizer, heldout_problems(HELDOUT_N), 2, 20261201, 8)
    first = rows[1]
    # the same problems, random numbers and scoring: at most one sample in 128 may flip on the
    # float32 rounding between FSDP's forward and the plain model's
    assert first["eval/heldout_acc_initial"] == pytest.approx(study["eval/heldout_acc"], abs=1.01 / (2 * HELDOUT_N))
    assert first["eval/heldout_greedy_acc_initial"] == pytest.approx(
        study["eval/heldout_greedy_acc"], abs=1.01 / HELDOUT_N
    )
    assert study["eval/heldout_greedy_acc"] > 0.5  # the cached warm-up's greedy accuracy: a number that can differ
    assert first["eval/heldout_step"] == 2.0 and 0.0 <= first["eval/heldout_acc"] <= 1.0
    assert not any("eval/heldout_step" in rows[s] for s in (2, 3))  # the named step and the last (8) only
    assert f"[verl-sat] held-out accuracy after optimizer step 2: {first['eval/heldout_acc']:.3f}" in stdout
    assert "held-out problems (sat.heldout) are also in data.train_files" in stdout  # the default's train set
