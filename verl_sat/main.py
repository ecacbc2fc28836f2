"""verl-sat's main job: ``python -m verl_sat.main`` (or ``verl-sat``), a Hydra app over verl's trainer.

Default config ``sat_gspo_cpu``: SAT-GSPO, separate_async at lag 2, a tiny Qwen3-MoE on CPU
(built, warmed up and cached on first use), the synthetic arithmetic task. Any Hydra override
works, e.g. ``verl-sat sat.lag=8`` or ``actor_rollout_ref.actor.policy_loss.loss_mode=gspo``;
``--config-name sat_paper`` selects the paper's GPU experiment (docs/reproduce.md).

What it adds around verl's ``run_ppo``:
1. ``sat:`` settings validated (``SATRecipeConfig``), ``sat.lag`` mapped onto verl's v1 keys
   (``verl_sat.trainer.recipe``), AsyncSATActor selected (``trainer_mode=sat_<mode>``);
2. the embedded default (``sat.default_assets``) filling only the keys left null, and every
   path checked before Ray starts;
3. a run directory (printed at start; ``sat.run_dir=``) with ``run.json`` (the method that ran,
   what the default filled) and ``metrics.jsonl`` (verl's file logger: one JSON line per step;
   its path reaches the Ray workers through the job's runtime environment, ``pass_env_to_ray``);
4. one progress line per step (step, reward, SAT gate rate, dbar_pi, staleness, seconds) and
   a closing summary, on a console that Ray's and the workers' output does not drown
   (``verl_sat.trainer.console``; ``sat.verbose=true`` shows it).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from verl_sat.files import hydra_config_dir
from verl_sat.paper.table import derive_method
from verl_sat.trainer import auto_lag
from verl_sat.trainer import progress as job_summary
from verl_sat.trainer.console import CONSOLE_LOG, quiet_console, quiet_sources
from verl_sat.trainer.faults import check_writable, finish_run
from verl_sat.trainer.recipe import (
    SATRecipeConfig,
    apply_actor,
    apply_lag,
    apply_routing_replay,
    apply_strategy,
    gate_starvation_warning,
)
from verl_sat.trainer.supervisor import RUN_DIR_ENV, Supervisor

METRICS_FILE = "metrics.jsonl"
# Environment the Ray workers need from the driver, passed through Ray's runtime environment too:
# on a cluster started beforehand (`ray start`), workers inherit the raylet's environment, not ours.
RAY_ENV_VARS = ("VERL_FILE_LOGGER_PATH", RUN_DIR_ENV)
PROGRESS_KEYS = {
    "reward": "critic/score/mean",
    "gate": "actor/sat_gate_rate",
    "intercepted": "actor/sat_intercepted_frac",
    "dbar_pi": "actor/mismatch_abs_mean",
    "staleness": "training/sat/staleness_steps/max",
    "seconds": "timing_s/step",
}


# ---------------------------------------------------------------------------------------------
# set-up
# ---------------------------------------------------------------------------------------------
def default_assets_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))
    return Path(root) / "verl-sat" / "tiny_moe_v5"


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
        greedy = f" (greedy {info['greedy_accuracy']:.2f})" if "greedy_accuracy" in info else ""
        print(f"[verl-sat] warm-up done: sampled accuracy {accuracy:.2f}{greedy} after {steps} steps", flush=True)


def make_run_dir(cfg: DictConfig, sat: SATRecipeConfig) -> Path:
    """The run directory (created), with verl's file logger and checkpoints pointed into it."""
    run_dir = Path(sat.run_dir or f"runs/{cfg.trainer.experiment_name}-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir = run_dir.resolve()
    check_writable(run_dir, "sat.run_dir")
    with open_dict(cfg):
        cfg.sat.run_dir = str(run_dir)
        loggers = list(cfg.trainer.logger) if cfg.trainer.logger else []
        if "file" not in loggers:
            cfg.trainer.logger = loggers + ["file"]
        if cfg.trainer.default_local_dir in (None, "") or "checkpoints/" in str(cfg.trainer.default_local_dir):
            cfg.trainer.default_local_dir = str(run_dir / "checkpoints")
    if int(cfg.trainer.get("save_freq", -1)) > 0:
        check_writable(Path(str(cfg.trainer.default_local_dir)), "trainer.default_local_dir")
    metrics = run_dir / METRICS_FILE
    if metrics.exists() and metrics.stat().st_size > 0:
        keep_earlier_metrics(cfg, run_dir, metrics)
    os.environ["VERL_FILE_LOGGER_PATH"] = str(metrics)
    os.environ[RUN_DIR_ENV] = str(run_dir)  # rollout servers and workers register their pids there
    return run_dir


def pass_env_to_ray(cfg: DictConfig, names: tuple[str, ...] = RAY_ENV_VARS) -> None:
    """Add the driver's ``names`` to ``ray_kwargs.ray_init.runtime_env.env_vars``.

    verl's ``run_ppo`` merges that node over its own defaults (``get_ppo_ray_runtime_env``) and
    passes it to ``ray.init``, so every worker of the job gets the variables, on a pre-started
    cluster too. A variable the user already set there, and every other entry, is kept.
    """
    with open_dict(cfg):
        env_vars = cfg
        for key in ("ray_kwargs", "ray_init", "runtime_env", "env_vars"):
            if env_vars.get(key) is None:
                env_vars[key] = {}
            env_vars = env_vars[key]
        for name in names:
            if name in os.environ and name not in env_vars:
                env_vars[name] = os.environ[name]


def keep_earlier_metrics(cfg: DictConfig, run_dir: Path, metrics: Path) -> None:
    """A run dir that already holds metrics: resume (keeping them) or refuse.

    verl resumes (``trainer.resume_mode`` auto) from the checkpoint its tracker names; a torn
    tracker is repaired first (``verl_sat.trainer.faults.latest_checkpoint``). The rows of the steps after
    that checkpoint, which this attempt redoes, move to ``*.superseded.jsonl``, so that
    ``metrics.jsonl`` and ``samples.jsonl`` hold one row per step (``verl_sat.trainer.accounting``).
    """
    from verl_sat.trainer import accounting, faults

    resume = str(cfg.trainer.get("resume_mode", "disable")) == "auto"
    async_mode = str(cfg.trainer.v1.trainer_mode).removeprefix("sat_") != "sync"
    step = faults.latest_checkpoint(Path(str(cfg.trainer.default_local_dir)), async_mode) if resume else None
    if step is None:
        raise FileExistsError(
            f"{metrics} already holds a run and there is no checkpoint to resume from "
            f"(trainer.resume_mode={cfg.trainer.get('resume_mode')}); choose another sat.run_dir= "
            "(nothing was overwritten)"
        )
    moved = accounting.prepare_resume(run_dir, step)
    print(
        f"[verl-sat] resuming from the checkpoint of step {step}: {moved['superseded_metric_steps']} later "
        "step(s) will be redone (their rows kept in metrics.superseded.jsonl)",
        flush=True,
    )


def set_platform_env(cfg: DictConfig) -> None:
    """CPU runs: the verl-sat CPU platform in every process (inherited by Ray workers)."""
    if str(cfg.trainer.device) == "cpu":
        os.environ.setdefault("VERL_PLATFORM", "cpu")
        os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")  # FSDP engine is registered under "cuda"
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")


# ---------------------------------------------------------------------------------------------
# the embedded default: fills only what the user left unset
# ---------------------------------------------------------------------------------------------
MODEL_PATH_KEY = "actor_rollout_ref.model.path"
TOKENIZER_PATH_KEY = "actor_rollout_ref.model.tokenizer_path"
TRAIN_FILES_KEY = "data.train_files"
VAL_FILES_KEY = "data.val_files"
REWARD_PATH_KEY = "reward.custom_reward_function.path"
REWARD_NAME_KEY = "reward.custom_reward_function.name"
LEGACY_REWARD_PATH_KEY = "custom_reward_function.path"  # verl's old top-level node, migrated by verl
REWARD_FUNCTION = "compute_score"
# Keys a run cannot start without (checked whether or not the embedded default fills them).
REQUIRED_KEYS = (MODEL_PATH_KEY, TRAIN_FILES_KEY, VAL_FILES_KEY)
# A Hugging Face Hub id ("org/name"): verl downloads it, so it need not exist locally.
HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_unset(cfg: DictConfig, key: str) -> bool:
    """The user left ``key`` unset: null, ``???`` or absent (our default configs leave these null)."""
    return OmegaConf.select(cfg, key, default=None) is None


def default_values(assets: Path) -> dict[str, str]:
    """What the embedded default puts in each key (``assets``: the built model and data)."""
    from verl_sat.default import reward

    return {
        MODEL_PATH_KEY: str(assets / "model"),
        TRAIN_FILES_KEY: str(assets / "data" / "train.parquet"),
        VAL_FILES_KEY: str(assets / "data" / "val.parquet"),
        REWARD_PATH_KEY: reward.__file__,
    }


def keys_to_fill(cfg: DictConfig) -> list[str]:
    """The embedded default's keys the user left unset (the reward also counts as set through
    verl's legacy top-level ``custom_reward_function.path``)."""
    keys = [k for k in (MODEL_PATH_KEY, TRAIN_FILES_KEY, VAL_FILES_KEY) if is_unset(cfg, k)]
    if is_unset(cfg, REWARD_PATH_KEY) and is_unset(cfg, LEGACY_REWARD_PATH_KEY):
        keys.append(REWARD_PATH_KEY)
    return keys


def ensure_default_assets(cfg: DictConfig, sat: SATRecipeConfig) -> dict[str, str]:
    """Fill each key of the embedded default that the user left unset; returns ``{key: value}`` filled.

    A value the user passed (command line, their own config, a recipe) is kept, whatever it is;
    our default configs leave the four keys null so that "null" is what "unset" means. The tiny
    model and data are built (once, ~2-3 min) only when the model or a data split is to be filled.
    The reward's function name defaults to ``compute_score``; a name the user set must exist in
    the embedded reward module.
    """
    from verl_sat.default import reward

    fill = keys_to_fill(cfg)
    assets = Path(sat.assets_dir) if sat.assets_dir else default_assets_dir()
    if any(k != REWARD_PATH_KEY for k in fill) and not assets_complete(assets):
        build_assets_once(assets)
    values = default_values(assets)
    filled = {key: values[key] for key in fill}
    if REWARD_PATH_KEY in fill:
        name = OmegaConf.select(cfg, REWARD_NAME_KEY, default=None)
        if name is None:
            filled[REWARD_NAME_KEY] = REWARD_FUNCTION
        elif not callable(getattr(reward, str(name), None)):
            raise ValueError(
                f"{REWARD_NAME_KEY}={name!r} is not a function of the embedded reward {reward.__file__} "
                f"(it has {REWARD_FUNCTION!r}); set {REWARD_PATH_KEY}= to your own reward file or drop the name"
            )
    with open_dict(cfg):
        for key, value in filled.items():
            OmegaConf.update(cfg, key, value, merge=False)
    return filled


def is_remote(path: str) -> bool:
    """A URL (``hdfs://``, ``s3://``, ...): verl copies it, so it is not checked here."""
    return "://" in path


def check_local_path(key: str, value: Any, hub_ok: bool = False) -> None:
    """``value`` (a path or a list of paths) exists; ``hub_ok``: a Hub id ``org/name`` may be remote."""
    for item in value if isinstance(value, (list, tuple, ListConfig)) else [value]:
        path = str(item)
        if is_remote(path) or Path(path).expanduser().exists():
            continue
        if hub_ok and HUB_ID_RE.match(path):
            continue  # a Hub id, downloaded by verl
        raise FileNotFoundError(f"{key}: {path} does not exist (resolved: {Path(path).expanduser().resolve()})")


def check_paths(cfg: DictConfig) -> None:
    """Fail before Ray starts when a required key is unset or a path the config names is missing."""
    for key in REQUIRED_KEYS:
        if is_unset(cfg, key):
            raise ValueError(f"{key} is not set: pass {key}=PATH (or sat.default_assets=true for the embedded default)")
    check_local_path(TRAIN_FILES_KEY, OmegaConf.select(cfg, TRAIN_FILES_KEY))
    check_local_path(VAL_FILES_KEY, OmegaConf.select(cfg, VAL_FILES_KEY))
    check_local_path(MODEL_PATH_KEY, OmegaConf.select(cfg, MODEL_PATH_KEY), hub_ok=True)
    if not is_unset(cfg, TOKENIZER_PATH_KEY):
        check_local_path(TOKENIZER_PATH_KEY, OmegaConf.select(cfg, TOKENIZER_PATH_KEY), hub_ok=True)
    for key in (REWARD_PATH_KEY, LEGACY_REWARD_PATH_KEY):
        if not is_unset(cfg, key):
            check_local_path(key, OmegaConf.select(cfg, key))


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

    line = (
        f"[verl-sat] step {row['step']:>4} | reward {fmt('reward', '.3f')} | gate {fmt('gate', '.3f')} | "
        f"intercepted {fmt('intercepted', '.4f')} | dbar_pi {fmt('dbar_pi', '.4f')} | "
        f"staleness<= {fmt('staleness', '.0f')} | {fmt('seconds', '.1f')} s"
    )
    if isinstance(row.get(auto_lag.LAG_KEY), int | float):  # sat.lag=auto: the lag this step ran at
        line += f" | lag {row[auto_lag.LAG_KEY]:.0f}{' -> broadcast' if row.get(auto_lag.BROADCAST_KEY) else ''}"
    return line


class ProgressPrinter(threading.Thread):
    """Tails metrics.jsonl (written by verl's trainer in its Ray actor) and prints a line a step."""

    def __init__(self, path: Path, interval: float = 1.0, eps_high: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.path, self.interval, self.printed = path, interval, 0
        self.eps_high, self.warned = eps_high, False
        self.stopped = threading.Event()

    def flush(self) -> None:
        rows = read_metrics(self.path)
        for row in rows[self.printed :]:
            print(progress_line(row), flush=True)
        self.printed = len(rows)
        warning = None if self.warned else job_summary.inert_warning(rows, self.eps_high)
        if warning:
            print(warning, flush=True)
            self.warned = True

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
    """Validate ``sat:``, fill what the user left unset, map lag/actor onto verl keys, make the run
    directory and write its ``run.json``; every path is checked here, before Ray starts."""
    derived = label_method(cfg)
    sat = SATRecipeConfig.from_node(cfg.get("sat"))
    filled = ensure_default_assets(cfg, sat) if sat.default_assets else {}
    if filled:
        print(f"[verl-sat] embedded default fills what was left unset: {', '.join(filled)}", flush=True)
    check_paths(cfg)
    dropped = apply_strategy(cfg, sat.strategy)
    if sat.strategy != "fsdp":
        print(
            f"[verl-sat] sat.strategy={sat.strategy}: actor and reference on verl's {sat.strategy} engine"
            + (
                f" (dropped, FSDP-only: {', '.join(sorted({'.'.join(k.split('.')[1:3]) for k in dropped}))})"
                if dropped
                else ""
            ),
            flush=True,
        )
    apply_lag(cfg, sat.lag)
    apply_actor(cfg, sat.actor)
    apply_routing_replay(cfg, sat.routing_replay)
    warning = gate_starvation_warning(cfg)
    if warning:
        print(f"[verl-sat] warning: {warning}", flush=True)
    set_platform_env(cfg)
    run_dir = make_run_dir(cfg, sat)
    pass_env_to_ray(cfg)
    write_run_record(run_dir, cfg, sat, derived, filled)
    return sat, run_dir


def label_method(cfg: DictConfig) -> str:
    """The method the config runs (``derive_method``); fills ``sat.method`` when left null.

    Runs before anything resolves ``sat.method`` (``sat_paper.yaml`` names the experiment and
    run directory after it). Returns the derived label, also when an explicit one wins.
    """
    derived = derive_method(cfg)
    if is_unset(cfg, "sat.method"):
        with open_dict(cfg):
            OmegaConf.update(cfg, "sat.method", derived, merge=False)
    return derived


def write_run_record(
    run_dir: Path, cfg: DictConfig, sat: SATRecipeConfig, derived: str, filled: dict[str, str]
) -> None:
    """``run.json``: the method (explicit ``sat.method`` or derived), the lag, the values the
    embedded default filled in, and the resolved config."""
    record = {
        "method": sat.method,
        "method_derived": derived,
        "lag": sat.lag,
        "filled_by_default": filled,
        **({"auto_lag": dict(sat.auto_lag.__dict__)} if sat.lag == auto_lag.AUTO else {}),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    (run_dir / "run.json").write_text(json.dumps(record, indent=1))


def run(cfg: DictConfig) -> list[dict[str, Any]]:
    """Run verl's v1 trainer on ``cfg``; returns the per-step metrics."""
    sat, run_dir = prepare(cfg)
    print(f"[verl-sat] run_dir: {run_dir}", flush=True)
    announce_console(run_dir, sat.verbose)
    quiet_sources()
    with quiet_console(run_dir / CONSOLE_LOG, sat.verbose):
        import ray
        from verl.trainer.main_ppo import TaskRunnerV1, run_ppo
        from verl.trainer.ppo.utils import need_critic, need_reference_policy
        from verl.utils.config import validate_config

        validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
        actor = "actor_rollout_ref.actor"
        eps_high = OmegaConf.select(cfg, f"{actor}.clip_ratio_high") or OmegaConf.select(cfg, f"{actor}.clip_ratio")
        printer = ProgressPrinter(run_dir / METRICS_FILE, eps_high=float(eps_high or 0.2))
        printer.start()
        start = time.perf_counter()
        try:
            with Supervisor(run_dir, cfg.trainer.get("total_training_steps")):  # a dead server/worker: exit 4
                run_ppo(cfg, task_runner_class=TaskRunnerV1)
        finally:
            printer.stop()
            if ray.is_initialized():
                ray.shutdown()
            status = finish_run(run_dir, log=lambda line: print(line, flush=True))
    rows = read_metrics(run_dir / METRICS_FILE)
    print(summary(rows, time.perf_counter() - start, 1 if sat.lag == auto_lag.AUTO else sat.lag), flush=True)
    for line in lag_lines(run_dir, rows, sat):
        print(line, flush=True)
    print(f"[verl-sat] metrics: {run_dir / METRICS_FILE}", flush=True)
    if rows:
        print(f"[verl-sat] reward curve: {job_summary.plot_job(rows, run_dir / 'reward.png')}", flush=True)
    if status:
        raise SystemExit(status)  # a collapsed run never exits 0 (verl_sat.trainer.faults.collapse_exit)
    return rows


def lag_lines(run_dir: Path, rows: list[dict[str, Any]], sat: SATRecipeConfig) -> list[str]:
    """sat.lag=auto: the broadcasts, also into ``run.json`` (``auto_lag``); a fixed lag: the
    ``sat.auto_lag.target`` values its staleness levels suggest (``verl_sat.trainer.auto_lag.suggestion_line``)."""
    if sat.lag != auto_lag.AUTO:
        line = auto_lag.suggestion_line(rows)
        return [line] if line else []
    from verl_sat.trainer.faults import update_run_record

    decided = [r for r in rows if auto_lag.BROADCAST_KEY in r]
    broadcasts = sum(bool(r[auto_lag.BROADCAST_KEY]) for r in decided)
    lags = [int(r[auto_lag.LAG_KEY]) for r in decided if r[auto_lag.BROADCAST_KEY]]
    record = {**sat.auto_lag.__dict__, "broadcasts": broadcasts, "steps": len(decided), "lags": lags}
    update_run_record(run_dir, auto_lag=record)
    mean = f"{sum(lags) / len(lags):.2f}" if lags else "-"
    return [
        f"[verl-sat] sat.lag=auto ({sat.auto_lag.signal} > {sat.auto_lag.target:g}, lag in "
        f"[{sat.auto_lag.min}, {sat.auto_lag.max}]): {broadcasts} broadcasts in {len(decided)} optimizer steps, "
        f"mean lag {mean}"
    ]


def announce_console(run_dir: Path, verbose: bool) -> None:
    """Say where Ray's and the workers' output goes (``verl_sat.trainer.console``)."""
    if verbose:
        print("[verl-sat] sat.verbose=true: Ray's and the workers' output shown as it comes", flush=True)
    else:
        print(
            f"[verl-sat] Ray and worker output: {run_dir / CONSOLE_LOG} (errors still show here; "
            "sat.verbose=true shows everything)",
            flush=True,
        )


@hydra.main(config_path=str(hydra_config_dir()), config_name="sat_gspo_cpu", version_base=None)
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
