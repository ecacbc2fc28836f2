"""Sample accounting (verl_sat.trainer.accounting) and the fault guards (verl_sat.trainer.faults), without Ray.

verl's own ``PPOTrainer._save_checkpoint`` runs here unchanged (its worker group, dataloader
and TransferQueue stubbed), so the save order it relies on is verl's, not a copy.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from omegaconf import OmegaConf

from verl_sat import files
from verl_sat.config_node import config_from_node
from verl_sat.processes import RUN_DIR_ENV
from verl_sat.trainer import accounting
from verl_sat.trainer.faults import (
    EXIT_COLLAPSED,
    TRACKER,
    FaultConfig,
    FaultMixin,
    check_writable,
    finish_run,
    latest_checkpoint,
    read_tracker,
    write_tracker,
)
from verl_sat.trainer.recipe import SATRecipeConfig


# ---------------------------------------------------------------------------------------------
# sample accounting
# ---------------------------------------------------------------------------------------------
def trained(step: int, ids: list[int], responses: int = 4, staleness: tuple[int, int] = (1, 2)) -> dict:
    prompts = [{"id": i, "uid": f"u{i}", "responses": responses, "staleness": list(staleness)} for i in ids]
    return {"event": "trained", "step": step, "lag": 2, "prompts": prompts}


def submitted(step: int, ids: list[int]) -> dict:
    return {"event": "submitted", "step": step, "prompts": [[f"u{i}", i] for i in ids]}


def test_summary_counts_trained_repeated_skipped_and_lost(tmp_path: Path):
    rows = [
        {"event": "epoch_order", "ids": [5, 1, 7, 3, 9, 2, 8]},
        submitted(1, [5, 1, 7]),  # 3 is passed over by the "dataloader": skipped
        trained(1, [5]),
        submitted(1, [9, 2]),
        trained(2, [1, 7]),
        trained(3, [7, 9]),  # 7 again: repeated
        {"event": "in_flight_at_end", "step": 3, "uids": ["u2"]},
    ]
    files.write_jsonl(tmp_path / "samples.jsonl", rows)
    s = accounting.summarize(tmp_path)
    assert s["prompts_submitted"] == 5 and s["prompts_trained"] == 4 and s["responses_trained"] == 20
    assert s["repeated"] == [7] and s["skipped"] == [3] and s["in_flight_at_end"] == 1 and s["lost_in_flight"] == []
    assert s["staleness"] == {"2": 20} and s["steps"] == 3
    line = accounting.format_summary(s)
    assert "4 prompts trained (20 responses) in 3 steps, 1 repeated, 1 skipped, 0 lost in flight" in line


def test_untrained_prompt_not_in_flight_is_lost(tmp_path: Path):
    rows = [submitted(1, [1, 2, 3]), trained(1, [1]), {"event": "in_flight_at_end", "step": 1, "uids": ["u2"]}]
    files.write_jsonl(tmp_path / "samples.jsonl", rows)
    s = accounting.summarize(tmp_path)
    assert s["lost_in_flight"] == [3] and s["in_flight_at_end"] == 1 and s["skipped"] is None


def metrics_rows(steps: range, attempt: str) -> list[dict]:
    return [{"step": s, "data": {"attempt": attempt}} for s in steps]


def verl_logs(path: Path, steps: range, attempt: str, verl_sat_job: bool = True) -> None:
    """An attempt's metrics, written by verl's own FileLogger (it opens the file with "wb"), in a
    verl-sat job (its launch sets RUN_DIR_ENV) or in another verl run."""
    from verl.utils.tracking import FileLogger

    os.environ["VERL_FILE_LOGGER_PATH"] = str(path)
    if verl_sat_job:
        os.environ[RUN_DIR_ENV] = str(path.parent)
    try:
        logger = FileLogger("project", "experiment")
        for step in steps:
            logger.log({"attempt": attempt}, step=step)
        logger.finish()
    finally:
        del os.environ["VERL_FILE_LOGGER_PATH"]
        os.environ.pop(RUN_DIR_ENV, None)


def test_another_verl_run_keeps_verls_own_truncation(tmp_path: Path):
    """The write-back is verl-sat's: a verl run without verl-sat's launch starts its file anew."""
    metrics = tmp_path / "metrics.jsonl"
    verl_logs(metrics, range(1, 3), "a1", verl_sat_job=False)
    verl_logs(metrics, range(1, 3), "a2", verl_sat_job=False)
    assert [r["data"]["attempt"] for r in files.read_jsonl(metrics)] == ["a2", "a2"]


def test_resume_keeps_one_timeline_of_metrics_and_samples(tmp_path: Path):
    """Attempt 1 ran steps 1-5 (checkpoint at 4) and was killed; attempt 2 resumes from 4, is
    killed after step 7 (checkpoint at 6); attempt 3 resumes from 6 and ends at 8. verl's file
    logger writes every attempt's rows; the rows a resume keeps survive its "wb"
    (``keep_metrics_on_resume``, installed when verl imports its tracking module)."""
    metrics = tmp_path / "metrics.jsonl"
    verl_logs(metrics, range(1, 6), "a1")
    files.write_jsonl(tmp_path / "samples.jsonl", [trained(s, [s]) for s in range(1, 6)])
    moved = accounting.prepare_resume(tmp_path, 4)
    assert moved == {"resumed_from_step": 4, "superseded_metric_steps": 1, "superseded_trained_steps": 1}
    assert [r["step"] for r in files.read_jsonl(metrics)] == [1, 2, 3, 4]
    verl_logs(metrics, range(5, 8), "a2")  # attempt 2, killed
    files.append_jsonl(tmp_path / "samples.jsonl", [trained(s, [s]) for s in range(5, 8)])
    accounting.prepare_resume(tmp_path, 6)
    verl_logs(metrics, range(7, 9), "a3")
    files.append_jsonl(tmp_path / "samples.jsonl", [trained(s, [s]) for s in range(7, 9)])
    rows = files.read_jsonl(metrics)
    assert [r["step"] for r in rows] == list(range(1, 9))  # no step missing or twice
    assert [r["data"]["attempt"] for r in rows] == ["a1"] * 4 + ["a2"] * 2 + ["a3"] * 2
    superseded = files.read_jsonl(tmp_path / "metrics.superseded.jsonl")
    assert [(r["step"], r["superseded_by_resume_from"]) for r in superseded] == [(5, 4), (7, 6)]
    s = accounting.summarize(tmp_path)
    assert s["steps"] == 8 and s["repeated"] == [] and s["superseded_trained_steps"] == 2


def test_a_torn_last_line_is_skipped(tmp_path: Path):
    path = tmp_path / "samples.jsonl"
    path.write_text(json.dumps(trained(1, [1])) + "\n" + '{"event": "trai')
    assert len(files.read_jsonl(path)) == 1


def test_prompt_groups_and_ids():
    keys = ["a_0_0", "a_1_0", "b_0_0"]
    groups = accounting.prompt_groups(keys, [7, 7, 9], [1, 2, 0])
    assert groups == [
        {"id": 7, "uid": "a", "responses": 2, "staleness": [1, 2]},
        {"id": 9, "uid": "b", "responses": 1, "staleness": [0, 0]},
    ]
    import numpy as np
    import torch

    assert accounting.as_ids(torch.tensor([3, 4])) == [3, 4]
    assert accounting.as_ids(np.array([3, "x"], dtype=object)) == [3, "x"]


# ---------------------------------------------------------------------------------------------
# checkpoints: which one is resumed
# ---------------------------------------------------------------------------------------------
def make_checkpoint(root: Path, step: int, complete: bool = True) -> None:
    d = root / f"global_step_{step}"
    (d / "actor").mkdir(parents=True)
    (d / "actor" / "model.pt").write_bytes(b"w")
    if complete:
        (d / "data.pt").write_bytes(b"d")
        (d / "transfer_queue").mkdir()


def test_latest_checkpoint_follows_verls_tracker_and_repairs_a_torn_one(tmp_path: Path):
    lines: list[str] = []
    assert latest_checkpoint(tmp_path, log=lines.append) is None  # nothing saved: from scratch
    make_checkpoint(tmp_path, 2)
    make_checkpoint(tmp_path, 4)
    make_checkpoint(tmp_path, 6, complete=False)  # killed mid-save: the tracker still says 4
    write_tracker(tmp_path, 4)
    assert latest_checkpoint(tmp_path, log=lines.append) == 4 and not lines
    (tmp_path / TRACKER).write_text("")  # killed while verl rewrote the tracker ("w" truncates first)
    assert latest_checkpoint(tmp_path, log=lines.append) == 4  # the newest complete one, not step 6
    assert read_tracker(tmp_path) == 4 and "is empty or torn" in lines[-1]
    write_tracker(tmp_path, 6)  # names an incomplete directory
    assert latest_checkpoint(tmp_path, log=lines.append) == 4 and "global_step_6, which is incomplete" in lines[-1]
    assert latest_checkpoint(tmp_path, async_mode=True) == 4


class SaveStub:
    """What verl's ``PPOTrainer._save_checkpoint`` calls, with an actor that writes a file; at
    ``full_disk_step`` it then fills the disk as ``tests/disk_full.py``'s actor does, and the
    error arrives as Ray delivers a worker's (``RayTaskError(OSError)``)."""

    def __init__(self, full_disk_step: int) -> None:
        self.full_disk_step = full_disk_step

    def save_checkpoint(self, local_path: str, hdfs_path: Any, global_step: int, **kwargs: Any) -> None:
        from disk_full import fill_disk
        from ray.exceptions import RayTaskError

        Path(local_path).mkdir(parents=True, exist_ok=True)
        (Path(local_path) / "model.pt").write_bytes(b"weights")
        if global_step == self.full_disk_step:
            try:
                fill_disk(local_path)
            except OSError as exc:
                raise RayTaskError("save_checkpoint", "Traceback ...", exc).as_instanceof_cause() from None


def verl_saving_trainer(tmp_path: Path, full_disk_step: int) -> Any:
    """verl's PPOTrainer with verl-sat's save guard, set up just enough for ``_save_checkpoint``."""
    from verl.trainer.ppo.v1 import trainer_base

    class Trainer(FaultMixin, trainer_base.PPOTrainer):
        def on_step_end(self) -> None: ...

        def on_sample_end(self) -> None: ...

    trainer = object.__new__(Trainer)
    trainer.config = OmegaConf.create(
        {
            "sat": {},
            "trainer": {"default_local_dir": str(tmp_path / "ckpt"), "default_hdfs_dir": None},
            "actor_rollout_ref": {"actor": {"checkpoint": {}}},
        }
    )
    trainer.trainer_mode, trainer.use_critic = "separate_async", False
    trainer.actor_rollout_wg = SaveStub(full_disk_step)
    trainer.train_dataloader = mock.Mock(state_dict=lambda: {"pos": 1})
    trainer.checkpoint_callback = mock.Mock()
    return trainer


def test_a_disk_that_fills_mid_checkpoint_names_the_path_and_keeps_the_latest(tmp_path: Path, capsys, monkeypatch):
    from verl.trainer.ppo.v1 import trainer_base

    tq = mock.Mock()
    tq.save_checkpoint.side_effect = lambda path, metadata=None: Path(path).mkdir(parents=True)
    monkeypatch.setattr(trainer_base, "tq", tq)
    trainer = verl_saving_trainer(tmp_path, full_disk_step=4)
    trainer.global_steps = 2
    trainer._save_checkpoint()  # verl's save, unchanged: actor, data.pt, TransferQueue, tracker
    assert read_tracker(tmp_path / "ckpt") == 2
    trainer.global_steps = 4
    with pytest.raises(OSError) as caught:
        trainer._save_checkpoint()
    assert caught.value.cause.errno == errno.ENOSPC  # the worker's error, as Ray delivers it
    out = capsys.readouterr().out
    partial = tmp_path / "ckpt" / "global_step_4" / "actor" / "extra_state.pt"
    assert f"the checkpoint of step 4 could not be written to {partial}: No space left on device" in out
    assert "the latest checkpoint stays global_step_2" in out
    # the actor's files of step 4 are there, the tracker (written last by verl) is not moved to it
    assert (tmp_path / "ckpt" / "global_step_4" / "actor" / "model.pt").exists()
    assert read_tracker(tmp_path / "ckpt") == 2 and latest_checkpoint(tmp_path / "ckpt") == 2


def test_unwritable_directories_are_named(tmp_path: Path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(OSError, match=rf"sat.run_dir: cannot write to {blocker / 'run'}"):
        check_writable(blocker / "run", "sat.run_dir")
    with pytest.raises(OSError, match="trainer.default_local_dir: cannot write to /proc/verl-sat"):
        check_writable(Path("/proc/verl-sat"), "trainer.default_local_dir")
    check_writable(tmp_path / "ok" / "deep", "sat.run_dir")
    assert (tmp_path / "ok" / "deep").is_dir() and not list((tmp_path / "ok" / "deep").iterdir())


def test_main_refuses_an_unwritable_run_dir_before_ray(tmp_path: Path):
    from verl_sat.trainer.launch import make_run_dir

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    cfg = OmegaConf.create(
        {
            "sat": {"run_dir": str(blocker / "run")},
            "trainer": {"experiment_name": "e", "logger": ["console"], "default_local_dir": None, "save_freq": -1},
        }
    )
    with pytest.raises(OSError, match="sat.run_dir: cannot write to"):
        make_run_dir(cfg, SATRecipeConfig.from_node(cfg.sat))


@pytest.mark.parametrize("save_freq", [1, -1])
def test_main_refuses_an_unwritable_checkpoint_dir_before_ray(tmp_path: Path, save_freq: int):
    """Guards make_run_dir's checkpoint-directory probe: a writable run directory with
    ``trainer.default_local_dir`` under a file fails before Ray starts, naming the key and the
    path, and nothing is left half-made; without saves (save_freq -1) the directory is not needed."""
    from verl_sat.trainer.launch import make_run_dir

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    checkpoints = blocker / "ckpt"
    cfg = OmegaConf.create(
        {
            "sat": {"run_dir": str(tmp_path / "run")},
            "trainer": {
                "experiment_name": "e",
                "logger": ["console"],
                "default_local_dir": str(checkpoints),
                "save_freq": save_freq,
            },
        }
    )
    if save_freq < 0:
        assert make_run_dir(cfg, SATRecipeConfig.from_node(cfg.sat)) == tmp_path / "run"
        return
    with pytest.raises(OSError, match=rf"trainer.default_local_dir: cannot write to {checkpoints}"):
        make_run_dir(cfg, SATRecipeConfig.from_node(cfg.sat))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ---------------------------------------------------------------------------------------------
# config and the exit status
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "node,message",
    [
        ({"lr_spike_steps": [0]}, r"sat.faults.lr_spike_steps must be a list of global steps >= 1, got \[0\]"),
        ({"lr_spike_factor": 0}, "sat.faults.lr_spike_factor must be a number > 0, got 0"),
        ({"checkpoint_enospc_step": 4}, "unknown key.*sat.faults.checkpoint_enospc_step"),  # now tests/disk_full.py
        ({"lr_spike": 3}, "unknown key.*sat.faults.lr_spike"),
    ],
)
def test_fault_config_errors_name_key_and_value(node: dict, message: str):
    with pytest.raises(ValueError, match=message):
        SATRecipeConfig.from_node(OmegaConf.create({"faults": node}))


def test_fault_config_defaults_off_and_the_composed_cpu_default_has_every_key():
    from dataclasses import fields

    from hydra import compose, initialize_config_dir

    from verl_sat.files import hydra_config_dir

    assert config_from_node(FaultConfig, None, "sat.faults") == FaultConfig()
    assert FaultConfig(lr_spike_steps=9).lr_spike_steps == (9,)
    with initialize_config_dir(config_dir=str(hydra_config_dir()), version_base=None):
        cfg = compose(config_name="sat_gspo_cpu")  # sat.faults comes from SATRecipeConfig (sat_defaults)
    assert set(cfg.sat.faults) == {f.name for f in fields(FaultConfig)}
    assert SATRecipeConfig.from_node(cfg.sat).faults == FaultConfig()


def test_finish_run_summarises_into_run_json_and_a_collapse_exits_nonzero(tmp_path: Path):
    (tmp_path / "run.json").write_text(json.dumps({"method": "sat_gspo"}))
    files.write_jsonl(tmp_path / "samples.jsonl", [submitted(1, [1]), trained(1, [1])])
    lines: list[str] = []
    assert finish_run(tmp_path, log=lines.append) == 0
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["method"] == "sat_gspo" and record["samples"]["prompts_trained"] == 1
    sentinel = {
        "alarms": [{"step": 12}],
        "rollbacks": [
            {"step": 13, "target": 8, "alarm_step": 12, "reason": "r", "setting_changed": {"sat.lag": [2, 1]}}
        ],
        "verdict": {"collapsed": True, "why": "the alarm of step 12 still stands at the last step 16"},
    }
    (tmp_path / "sentinel.json").write_text(json.dumps(sentinel))
    assert finish_run(tmp_path, log=lines.append) == EXIT_COLLAPSED
    rollback = "[verl-sat] rollback at step 13 to the checkpoint of step 8 (alarm of step 12); changed: sat.lag 2 -> 1"
    assert rollback in lines
    assert lines[-1] == "[verl-sat] error: the run ended collapsed: " + sentinel["verdict"]["why"]
    assert json.loads((tmp_path / "run.json").read_text())["sentinel"]["rollbacks"][0]["target"] == 8
