"""verl-sat's main job: ``python -m verl_sat.main`` (or ``verl-sat``), a Hydra app over verl's trainer.

Default config ``sat_gspo_cpu``: SAT-GSPO, separate_async at lag 2, a tiny Qwen3-MoE on CPU
(built, warmed up and cached on first use), the synthetic arithmetic task. Any Hydra override
works, e.g. ``verl-sat sat.lag=8`` or ``actor_rollout_ref.actor.policy_loss.loss_mode=gspo``;
``--config-name sat_paper`` selects the paper's GPU experiment (docs/reproduce.md).

What it adds around verl's ``run_ppo``:
1. ``sat:`` settings validated (``SATRecipeConfig``), ``sat.lag`` mapped onto verl's v1 keys
   (``verl_sat.schedule``), AsyncSATActor selected (``trainer_mode=sat_<mode>``);
2. a run directory (printed at start; ``sat.run_dir=``) with ``run.json`` and ``metrics.jsonl``
   (verl's file logger: one JSON line per step);
3. one progress line per step (step, reward, SAT gate rate, dbar_pi, staleness, seconds) and
   a closing summary.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

from verl_sat import job_summary
from verl_sat.paths import hydra_config_dir
from verl_sat.schedule import (
    SATRecipeConfig,
    apply_actor,
    apply_lag,
    apply_routing_replay,
    gate_starvation_warning,
)

METRICS_FILE = "metrics.jsonl"
PROGRESS_KEYS = {
    "reward": "critic/score/mean",
    "gate": "actor/sat_gate_rate",
    "dbar_pi": "actor/mismatch_abs_mean",
    "staleness": "training/sat/staleness_steps/max",
    "seconds": "timing_s/step",
}


# ---------------------------------------------------------------------------------------------
# set-up
# ---------------------------------------------------------------------------------------------
def default_assets_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))
    return Path(root) / "verl-sat" / "tiny_moe_v2"


def assets_complete(assets: Path) -> bool:
    """The model and both data splits are there."""
    return all((assets / p).exists() for p in ("model/config.json", "data/train.parquet", "data/val.parquet"))


def build_assets_once(assets: Path) -> None:
    """Build the default's assets unless complete (~2-3 min); safe when several jobs start at once.

    Builders queue on a lock file beside ``assets`` and re-check after taking it, so one builds
    and the others reuse its result. A fresh build goes to a temporary directory renamed into
    place, so no job ever sees half-written weights. An existing, incomplete directory (one the
    user pointed ``sat.assets_dir`` at) is completed in place, never deleted.
    """
    from verl_sat.default import warmup

    assets.parent.mkdir(parents=True, exist_ok=True)
    with open(assets.parent / f".{assets.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if assets_complete(assets):
            return
        print(f"[verl-sat] building the embedded tiny MoE and task in {assets} (once, ~2-3 min)", flush=True)
        for stale in assets.parent.glob(f".{assets.name}.building-*"):  # a crashed build; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        target = assets if assets.exists() else assets.parent / f".{assets.name}.building-{os.getpid()}"
        info = warmup.build(target)
        if target != assets:
            os.replace(target, assets)
        accuracy, steps = info["sampled_accuracy"], info.get("steps", "?")
        print(f"[verl-sat] warm-up done: sampled accuracy {accuracy:.2f} after {steps} steps", flush=True)


def ensure_default_assets(cfg: DictConfig, sat: SATRecipeConfig) -> None:
    """Build (once, ~2-3 min) and point the config at the embedded tiny model, data and reward."""
    from verl_sat.default import reward

    assets = Path(sat.assets_dir) if sat.assets_dir else default_assets_dir()
    model_dir, data_dir = assets / "model", assets / "data"
    if not assets_complete(assets):
        build_assets_once(assets)
    with open_dict(cfg):
        cfg.actor_rollout_ref.model.path = str(model_dir)
        cfg.data.train_files = str(data_dir / "train.parquet")
        cfg.data.val_files = str(data_dir / "val.parquet")
        cfg.reward.custom_reward_function.path = reward.__file__
        cfg.reward.custom_reward_function.name = "compute_score"


def make_run_dir(cfg: DictConfig, sat: SATRecipeConfig) -> Path:
    """The run directory (created), with verl's file logger and checkpoints pointed into it."""
    run_dir = Path(sat.run_dir or f"runs/{cfg.trainer.experiment_name}-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir = run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    with open_dict(cfg):
        cfg.sat.run_dir = str(run_dir)
        loggers = list(cfg.trainer.logger) if cfg.trainer.logger else []
        if "file" not in loggers:
            cfg.trainer.logger = loggers + ["file"]
        if cfg.trainer.default_local_dir in (None, "") or "checkpoints/" in str(cfg.trainer.default_local_dir):
            cfg.trainer.default_local_dir = str(run_dir / "checkpoints")
    metrics = run_dir / METRICS_FILE
    if metrics.exists() and metrics.stat().st_size > 0:
        keep_earlier_metrics(cfg, run_dir, metrics)
    os.environ["VERL_FILE_LOGGER_PATH"] = str(metrics)
    return run_dir


def keep_earlier_metrics(cfg: DictConfig, run_dir: Path, metrics: Path) -> None:
    """A run dir that already holds metrics: resume (keeping them) or refuse.

    verl's file logger truncates its file, so when verl will resume from a checkpoint
    (``trainer.resume_mode`` auto/resume_path and checkpoints present) the earlier lines are moved
    to ``metrics.part<k>.jsonl`` first; otherwise the run stops before touching anything.
    """
    resume = str(cfg.trainer.get("resume_mode", "disable")) in ("auto", "resume_path")
    checkpoints = Path(str(cfg.trainer.default_local_dir))
    if not (resume and checkpoints.is_dir() and any(checkpoints.glob("global_step_*"))):
        raise FileExistsError(
            f"{metrics} already holds a run and there is no checkpoint to resume from "
            f"(trainer.resume_mode={cfg.trainer.get('resume_mode')}); choose another sat.run_dir= "
            "(nothing was overwritten)"
        )
    k = 1 + len(list(run_dir.glob("metrics.part*.jsonl")))
    metrics.rename(run_dir / f"metrics.part{k}.jsonl")
    print(f"[verl-sat] resuming: earlier metrics kept in metrics.part{k}.jsonl", flush=True)


def set_platform_env(cfg: DictConfig) -> None:
    """CPU runs: the verl-sat CPU platform in every process (inherited by Ray workers)."""
    if str(cfg.trainer.device) == "cpu":
        os.environ.setdefault("VERL_PLATFORM", "cpu")
        os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")  # FSDP engine is registered under "cuda"
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")


# ---------------------------------------------------------------------------------------------
# progress
# ---------------------------------------------------------------------------------------------
def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Rows of verl's file logger (``{"step", "data"}``) flattened to ``{"step", **data}``."""
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows.append({"step": row["step"], **row.get("data", {})} if "data" in row else row)
    return rows


def progress_line(row: dict[str, Any]) -> str:
    def fmt(key: str, spec: str) -> str:
        value = row.get(PROGRESS_KEYS[key])
        return format(value, spec) if isinstance(value, (int, float)) else "-"

    return (
        f"[verl-sat] step {row['step']:>4} | reward {fmt('reward', '.3f')} | gate {fmt('gate', '.3f')} | "
        f"dbar_pi {fmt('dbar_pi', '.4f')} | staleness<= {fmt('staleness', '.0f')} | {fmt('seconds', '.1f')} s"
    )


class ProgressPrinter(threading.Thread):
    """Tails metrics.jsonl (written by verl's trainer in its Ray actor) and prints a line a step."""

    def __init__(self, path: Path, interval: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.path, self.interval, self.printed = path, interval, 0
        self.stopped = threading.Event()

    def flush(self) -> None:
        rows = read_metrics(self.path)
        for row in rows[self.printed :]:
            print(progress_line(row), flush=True)
        self.printed = len(rows)

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                self.flush()
            except (OSError, ValueError):
                continue  # a line being written; read it next time

    def stop(self) -> None:
        self.stopped.set()
        self.join()
        self.flush()


def summary(rows: list[dict[str, Any]], seconds: float, lag: int = 1) -> str:
    """The closing line: steps, quarter rewards, gate, staleness and where a step's time went."""
    if not rows:
        return f"[verl-sat] no training step completed ({seconds:.0f} s)"
    rewards = [r[PROGRESS_KEYS["reward"]] for r in rows if PROGRESS_KEYS["reward"] in r]
    staleness = [r[PROGRESS_KEYS["staleness"]] for r in rows if PROGRESS_KEYS["staleness"] in r]
    gate = [r[PROGRESS_KEYS["gate"]] for r in rows if PROGRESS_KEYS["gate"] in r]
    k = max(1, len(rewards) // 4)
    parts = [f"[verl-sat] {len(rows)} steps in {seconds:.0f} s"]
    if rewards:
        parts.append(f"reward first-quarter {sum(rewards[:k]) / k:.3f} -> last-quarter {sum(rewards[-k:]) / k:.3f}")
    if gate:
        parts.append(f"mean gate rate {sum(gate) / len(gate):.3f}")
    if staleness:
        parts.append(f"max staleness {max(staleness):.0f} steps")
    split = job_summary.format_split(job_summary.timing_split(rows), lag)
    if split:
        parts.append(split)
    return " | ".join(parts)


# ---------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------
def prepare(cfg: DictConfig) -> tuple[SATRecipeConfig, Path]:
    """Validate ``sat:``, build assets, map lag/actor onto verl keys, make the run directory."""
    sat = SATRecipeConfig.from_node(cfg.get("sat"))
    if sat.default_assets:
        ensure_default_assets(cfg, sat)
    apply_lag(cfg, sat.lag)
    apply_actor(cfg, sat.actor)
    apply_routing_replay(cfg, sat.routing_replay)
    warning = gate_starvation_warning(cfg)
    if warning:
        print(f"[verl-sat] warning: {warning}", flush=True)
    set_platform_env(cfg)
    run_dir = make_run_dir(cfg, sat)
    return sat, run_dir


def run(cfg: DictConfig) -> list[dict[str, Any]]:
    """Run verl's v1 trainer on ``cfg``; returns the per-step metrics."""
    sat, run_dir = prepare(cfg)
    print(f"[verl-sat] run_dir: {run_dir}", flush=True)
    (run_dir / "run.json").write_text(
        json.dumps(
            {"method": sat.method, "lag": sat.lag, "config": OmegaConf.to_container(cfg, resolve=True)}, indent=1
        )
    )
    import ray
    from verl.trainer.main_ppo import TaskRunnerV1, run_ppo
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    printer = ProgressPrinter(run_dir / METRICS_FILE)
    printer.start()
    start = time.perf_counter()
    try:
        run_ppo(cfg, task_runner_class=TaskRunnerV1)
    finally:
        printer.stop()
        if ray.is_initialized():
            ray.shutdown()
    rows = read_metrics(run_dir / METRICS_FILE)
    print(summary(rows, time.perf_counter() - start, sat.lag), flush=True)
    print(f"[verl-sat] metrics: {run_dir / METRICS_FILE}", flush=True)
    if rows:
        print(f"[verl-sat] reward curve: {job_summary.plot_job(rows, run_dir / 'reward.png')}", flush=True)
    return rows


@hydra.main(config_path=str(hydra_config_dir()), config_name="sat_gspo_cpu", version_base=None)
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
