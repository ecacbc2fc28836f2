"""Faults: injected on purpose (``sat.faults``), and guarded against (docs/faults.md).

The knob (``sat.faults.*``, off by default), to watch the sentinel's rollback:

- ``lr_spike_steps`` / ``lr_spike_factor``: the actor's learning rate is multiplied by the factor
  for every optimizer step of those global steps (a transient divergence *in training*, which a
  rollback to a checkpoint saved before it undoes). The rollout-side, persistent fault is
  ``actor_rollout_ref.rollout.engine_kwargs.hf.fault_step`` (``verl_sat.rollout``). A disk that
  fills mid-save is injected by the tests, through ``sat.actor_class`` (``tests/disk_full.py``).

Guards:

- ``latest_checkpoint``: the step verl resumes from is the one ``latest_checkpointed_iteration.txt``
  names, and verl writes that file last in ``_save_checkpoint`` (actor, critic, ``data.pt``,
  TransferQueue, then the tracker; its name from verl's ``get_checkpoint_tracker_filename``), so a
  save killed midway leaves the previous checkpoint the latest. A tracker that is empty or torn (a
  kill while verl rewrites it) or names an incomplete directory is repaired to the newest complete
  checkpoint before Ray starts, with a line.
- ``check_writable``: the run directory and the checkpoint directory are created and probed
  before Ray starts; an error names the key and the path.
- ``FaultMixin._save_checkpoint``: an ``OSError`` while saving is re-raised with a line naming
  the path and the checkpoint that stays the latest.
- ``prune_snapshots`` (after each successful save): verl's ``trainer.max_actor_ckpt_to_keep``
  removes only ``global_step_k/actor``; the TransferQueue snapshot of that step
  (``global_step_k/transfer_queue``, the whole queue pickled) and the ``data.pt`` left alone in
  it go too (docs/faults.md#checkpoints-on-disk).
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_sat.config_node import check_fields, checked, config_from_node, number
from verl_sat.files import read_json, update_run_record

TRACKER = "latest_checkpointed_iteration.txt"  # verl's get_checkpoint_tracker_filename (read_tracker)
_STEP_DIR = re.compile(r"^global_step_(\d+)$")
# verl's PPOTrainer._save_checkpoint: tq.save_checkpoint(global_step_k/transfer_queue); TransferQueue
# writes <name>.tmp and moves a previous <name> aside to <name>.old while it saves
# (transfer_queue/interface.py save_checkpoint).
SNAPSHOT = "transfer_queue"
SNAPSHOT_PARTS = (SNAPSHOT, SNAPSHOT + ".tmp", SNAPSHOT + ".old")
# what verl writes into global_step_k besides the actor, critic and snapshot: the dataloader state
DATALOADER_STATE = "data.pt"
SENTINEL_RECORD = "sentinel.json"
# exit status of a job that ran to its end (or was stopped) with the collapse signature standing
EXIT_COLLAPSED = 3


def _global_steps(value: Any) -> bool:
    """One global step >= 1, or a list of them."""
    steps = value if isinstance(value, list | tuple) else [value]
    return all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in steps)


@dataclass
class FaultConfig:
    """``sat.faults``: an injected fault, to watch a rollback (docs/faults.md). Off by default.

    Args:
        lr_spike_steps: global steps whose optimizer steps run at ``lr_spike_factor`` x the lr.
        lr_spike_factor: the factor (> 0).
    """

    lr_spike_steps: tuple[int, ...] = checked((), _global_steps, "a list of global steps >= 1")
    lr_spike_factor: float = number(100.0, strictly_positive=True, expected="a number")

    def __post_init__(self) -> None:
        check_fields(self, "sat.faults")
        steps = self.lr_spike_steps
        self.lr_spike_steps = (steps,) if isinstance(steps, int) else tuple(steps)


# ---------------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------------
def checkpoint_complete(step_dir: Path, async_mode: bool = True) -> bool:
    """verl wrote every part of ``global_step_k``: actor files, ``data.pt`` (written after the
    actor and critic) and, in the async modes, TransferQueue's state (written after ``data.pt``)."""
    actor = step_dir / "actor"
    if not (actor.is_dir() and any(actor.iterdir()) and (step_dir / "data.pt").is_file()):
        return False
    return not async_mode or (step_dir / "transfer_queue").exists()


def read_tracker(checkpoint_dir: Path) -> int | None:
    """The step in verl's tracker file, or None if it is missing, empty or torn (where verl's own
    ``find_latest_ckpt_path`` raises)."""
    from verl.utils.checkpoint.checkpoint_manager import get_checkpoint_tracker_filename

    try:
        return int(Path(get_checkpoint_tracker_filename(str(checkpoint_dir))).read_text().strip())
    except (OSError, ValueError):
        return None


def write_tracker(checkpoint_dir: Path, step: int) -> None:
    """Write verl's tracker atomically (temporary file, fsync, rename)."""
    tracker = Path(checkpoint_dir) / TRACKER
    tmp = tracker.with_name(TRACKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(step))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, tracker)


def checkpoint_steps(checkpoint_dir: Path, with_actor: bool = False) -> list[int]:
    """The k of every ``global_step_k`` directory, ascending (complete or not); ``with_actor``:
    only those holding an ``actor/`` directory (a checkpoint the actor can be reloaded from)."""
    if not Path(checkpoint_dir).is_dir():
        return []
    steps = (int(m.group(1)) for p in Path(checkpoint_dir).iterdir() if (m := _STEP_DIR.match(p.name)))
    return sorted(k for k in steps if not with_actor or (Path(checkpoint_dir) / f"global_step_{k}" / "actor").is_dir())


def latest_checkpoint(checkpoint_dir: Path, async_mode: bool = True, log: Any = print) -> int | None:
    """The step verl will resume from, after repairing a torn tracker (module docstring).

    With a readable tracker naming a complete checkpoint, that step. Otherwise the newest
    complete checkpoint (not newer than a readable tracker's), with the tracker rewritten to it;
    None if there is none (verl then trains from scratch).
    """
    checkpoint_dir = Path(checkpoint_dir)
    tracked = read_tracker(checkpoint_dir)
    if tracked is not None and checkpoint_complete(checkpoint_dir / f"global_step_{tracked}", async_mode):
        return tracked
    tracker_exists = (checkpoint_dir / TRACKER).exists()
    if tracked is None and not tracker_exists:
        return None
    candidates = [
        k
        for k in checkpoint_steps(checkpoint_dir)
        if (tracked is None or k <= tracked) and checkpoint_complete(checkpoint_dir / f"global_step_{k}", async_mode)
    ]
    what = "is empty or torn" if tracked is None else f"names global_step_{tracked}, which is incomplete"
    if not candidates:
        log(
            f"[verl-sat] warning: {checkpoint_dir / TRACKER} {what} and no complete checkpoint is left; "
            "training from scratch"
        )
        (checkpoint_dir / TRACKER).unlink(missing_ok=True)
        return None
    write_tracker(checkpoint_dir, candidates[-1])
    log(
        f"[verl-sat] warning: {checkpoint_dir / TRACKER} {what}; resuming from the newest complete "
        f"checkpoint, global_step_{candidates[-1]}"
    )
    return candidates[-1]


def pruned_steps(checkpoint_dir: Path) -> list[int]:
    """The steps whose checkpoint verl pruned: older than the step the tracker names, and without
    ``actor/`` (verl's checkpoint manager removes ``global_step_k/actor`` beyond
    ``trainer.max_actor_ckpt_to_keep``, and nothing else of the step). Empty without a readable
    tracker: then no checkpoint is known to be superseded."""
    tracked = read_tracker(checkpoint_dir)
    if tracked is None:
        return []
    folder = Path(checkpoint_dir)
    return [k for k in checkpoint_steps(folder) if k < tracked and not (folder / f"global_step_{k}" / "actor").exists()]


def prune_step(step_dir: Path) -> list[str]:
    """Remove the TransferQueue snapshot of one pruned step, then the step's directory when only
    ``data.pt`` is left (a dataloader position without weights resumes nothing). Returns the
    names removed."""
    removed = []
    for name in SNAPSHOT_PARTS:
        part = step_dir / name
        if part.is_dir():
            shutil.rmtree(part)
            removed.append(name)
    rest = [p.name for p in step_dir.iterdir()]
    if set(rest) <= {DATALOADER_STATE}:
        shutil.rmtree(step_dir)
        removed += rest + [step_dir.name]
    return removed


def prune_snapshots(checkpoint_dir: Path, log: Any = print) -> list[int]:
    """After verl's save: prune what verl left of the checkpoints it pruned (``pruned_steps``), so
    that TransferQueue snapshots are kept as the actor checkpoints are (docs/faults.md#checkpoints-on-disk).

    Never touches the step the tracker names, a newer one (a save in progress), or a step whose
    ``actor/`` is still there (a checkpoint a resume or a sentinel rollback can use). A removal
    that fails is a warning line, not an error: the run goes on. Returns the steps pruned.
    """
    done = []
    for step in pruned_steps(checkpoint_dir):
        step_dir = Path(checkpoint_dir) / f"global_step_{step}"
        try:
            removed = prune_step(step_dir)
        except OSError as exc:
            log(f"[verl-sat] warning: could not prune {step_dir}: {exc.strerror or exc}")
            continue
        if removed:
            done.append(step)
    if done:
        steps = ", ".join(f"global_step_{k}" for k in done)
        log(f"[verl-sat] checkpoints: removed the TransferQueue snapshot of {steps} (actor pruned by verl)")
    return done


def check_writable(path: Path, key: str) -> None:
    """Create ``path`` and write a probe file in it; an ``OSError`` names the key and the path."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".verl-sat-write-probe-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise OSError(exc.errno, f"{key}: cannot write to {path}: {reason}; choose a writable directory") from exc


# ---------------------------------------------------------------------------------------------
# the trainer side (verl's TaskRunner): injected faults and the save guard
# ---------------------------------------------------------------------------------------------
def scale_lr(worker: Any, factor: float) -> list[float]:
    """On an actor worker: multiply the optimizer's learning rates by ``factor`` until verl's lr
    scheduler next sets them (after the next optimizer step). Returns the new rates."""
    optimizer = worker.actor.engine.optimizer
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * factor
    return [float(g["lr"]) for g in optimizer.param_groups]


class FaultMixin:
    """``sat.faults`` on verl's v1 trainer, and the checkpoint save guard (``SATTrainerMixin``)."""

    def _faults(self) -> FaultConfig:
        if "_sat_faults" not in self.__dict__:
            self._sat_faults = config_from_node(FaultConfig, (self.config.get("sat") or {}).get("faults"), "sat.faults")  # type: ignore[attr-defined]
        return self._sat_faults

    def _fault_before_update(self) -> None:
        """An lr spike for this optimizer step, when the global step is one of ``lr_spike_steps``."""
        faults = self._faults()
        if int(self.global_steps) not in faults.lr_spike_steps:  # type: ignore[attr-defined]
            return
        rates = self.actor_rollout_wg.sat_scale_lr(faults.lr_spike_factor)  # type: ignore[attr-defined]
        print(
            f"[verl-sat] fault: step {self.global_steps}: learning rate x{faults.lr_spike_factor:g} "  # type: ignore[attr-defined]
            f"for one optimizer step (lr {rates[0][0]:.3g}; sat.faults.lr_spike_steps)",
            flush=True,
        )

    def _save_checkpoint(self) -> None:
        """verl's save; an ``OSError`` (a full disk, a read-only mount) stops the run with a line
        naming the path, and the tracker verl writes last still names the previous checkpoint.
        After a save that succeeded, the snapshots of the checkpoints verl pruned go (``prune_snapshots``)."""
        folder = Path(str(self.config.trainer.default_local_dir))  # type: ignore[attr-defined]
        step = int(self.global_steps)  # type: ignore[attr-defined]
        try:
            super()._save_checkpoint()  # type: ignore[misc]
        except OSError as exc:
            cause = getattr(exc, "cause", exc)  # an actor worker's arrives as Ray's RayTaskError(OSError)
            kept = read_tracker(folder)
            latest = f"global_step_{kept}" if kept is not None else "none"
            print(
                f"[verl-sat] error: the checkpoint of step {step} could not be written to "
                f"{getattr(cause, 'filename', None) or folder / f'global_step_{step}'}: {cause.strerror or cause}; "
                f"the latest checkpoint stays {latest} ({folder / TRACKER} unchanged)",
                flush=True,
            )
            raise
        prune_snapshots(folder, log=lambda line: print(line, flush=True))


# ---------------------------------------------------------------------------------------------
# the driver side: what the job's exit status says
# ---------------------------------------------------------------------------------------------
def read_sentinel_record(run_dir: Path) -> dict[str, Any] | None:
    return read_json(Path(run_dir) / SENTINEL_RECORD)


def collapse_exit(record: dict[str, Any] | None) -> tuple[int, str | None]:
    """(exit status, line): ``EXIT_COLLAPSED`` and why when the sentinel's verdict is a collapse."""
    verdict = (record or {}).get("verdict") or {}
    if verdict.get("collapsed"):
        return EXIT_COLLAPSED, f"[verl-sat] error: the run ended collapsed: {verdict.get('why', 'sentinel alarm')}"
    return 0, None


def finish_run(run_dir: Path, log: Any = print) -> int:
    """After verl's trainer returns (or fails): the sample accounting and the sentinel's record in
    ``run.json``, their lines on the console; returns the exit status."""
    from verl_sat.trainer import accounting

    samples = accounting.summarize(run_dir)
    record = read_sentinel_record(run_dir)
    update_run_record(run_dir, samples=samples, **({"sentinel": record} if record is not None else {}))
    log(accounting.format_summary(samples))
    for rollback in (record or {}).get("rollbacks", []):
        changed = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in rollback["setting_changed"].items()) or "nothing"
        log(
            f"[verl-sat] rollback at step {rollback['step']} to the checkpoint of step {rollback['target']} "
            f"(alarm of step {rollback['alarm_step']}); changed: {changed}"
        )
    status, line = collapse_exit(record)
    if line:
        log(line)
    return status
