"""verl-sat's main job: ``python -m verl_sat.main`` (or ``verl-sat``), a Hydra app over verl's trainer.

Default config ``sat_gspo_cpu``: SAT-GSPO, separate_async at lag 2, a tiny Qwen3-MoE on CPU
(built, warmed up and cached on first use), the synthetic arithmetic task. Any Hydra override
works, e.g. ``verl-sat sat.lag=8`` or ``actor_rollout_ref.actor.policy_loss.loss_mode=gspo``;
``--config-name sat_paper`` selects the paper's GPU experiment (docs/reproduce.md).

Like verl-recipe's ``main_dapo``, it reuses verl's ``run_ppo`` and adds only what comes before
and around it: :func:`prepare` validates the ``sat:`` node and maps ``sat.*`` onto verl's keys
(``verl_sat.trainer.recipe.resolve``), then fills what the user left unset from the embedded default,
checks every path and makes the run directory (``verl_sat.trainer.launch.prepare_run``); :func:`run`
then runs verl's v1 trainer under the supervisor
(``verl_sat.trainer.supervisor``), with a line a step and a closing summary
(``verl_sat.trainer.progress``) on a console that Ray's and the workers' output does not drown
(``verl_sat.trainer.console``). ``--cfg job`` prints the config verl receives, launching nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import Container, DictConfig, OmegaConf

from verl_sat.files import METRICS_FILE, hydra_config_dir, read_metrics
from verl_sat.preflight.cluster import PlacementWatch, prepare_cluster
from verl_sat.trainer import auto_lag, launch, progress
from verl_sat.trainer.console import CONSOLE_LOG, quiet_console, quiet_sources
from verl_sat.trainer.faults import finish_run
from verl_sat.trainer.recipe import SATRecipeConfig, resolve
from verl_sat.trainer.supervisor import Supervisor


def say(line: str) -> None:
    print(line, flush=True)


def prepare(cfg: DictConfig) -> tuple[SATRecipeConfig, Path]:
    """Make the config verl receives (``recipe.resolve``: the ``sat:`` node validated, ``sat.*`` on verl's
    keys), then fill what the user left unset, check every path (on every node of a cluster started
    beforehand), make the run directory and write its ``run.json`` (``launch.prepare_run``); all before
    the job's Ray starts."""
    sat, derived = resolve(cfg, log=say)
    return sat, launch.prepare_run(cfg, sat, derived, log=say, check_nodes=prepare_cluster)


def run(cfg: DictConfig) -> list[dict[str, Any]]:
    """Run verl's v1 trainer on ``cfg``; returns the per-step metrics."""
    sat, run_dir = prepare(cfg)
    say(f"[verl-sat] run_dir: {run_dir}")
    progress.announce_console(run_dir, sat.verbose)
    quiet_sources()
    with quiet_console(run_dir / CONSOLE_LOG, sat.verbose) as terminal:  # workers' and verl's output: console.log
        import ray
        from verl.trainer.main_ppo import TaskRunnerV1, run_ppo
        from verl.trainer.ppo.utils import need_critic, need_reference_policy
        from verl.utils.config import validate_config

        validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
        actor = "actor_rollout_ref.actor"
        eps_high = OmegaConf.select(cfg, f"{actor}.clip_ratio_high") or OmegaConf.select(cfg, f"{actor}.clip_ratio")
        printer = progress.ProgressPrinter(run_dir / METRICS_FILE, eps_high=float(eps_high or 0.2), out=terminal)
        printer.start()
        start = time.perf_counter()
        try:
            # a dead server/worker: exit 4; a pool Ray does not place: exit 5
            with (
                Supervisor(run_dir, cfg.trainer.get("total_training_steps"), out=terminal),
                PlacementWatch(out=terminal),
            ):
                run_ppo(cfg, task_runner_class=TaskRunnerV1)
        finally:
            printer.stop()
            if ray.is_initialized():
                ray.shutdown()
            status = finish_run(run_dir, log=lambda line: print(line, file=terminal, flush=True))
    rows = read_metrics(run_dir / METRICS_FILE)
    say(progress.summary(rows, time.perf_counter() - start, 1 if sat.lag == auto_lag.AUTO else sat.lag))
    for line in progress.lag_lines(run_dir, rows, sat):
        say(line)
    say(f"[verl-sat] metrics: {run_dir / METRICS_FILE}")
    if rows:
        say(f"[verl-sat] reward curve: {progress.plot_job(rows, run_dir / 'reward.png')}")
    if status:
        raise SystemExit(status)  # a collapsed run never exits 0 (verl_sat.trainer.faults.collapse_exit)
    return rows


DEFAULT_CONFIG = "sat_gspo_cpu"


@hydra.main(config_path=str(hydra_config_dir()), config_name=DEFAULT_CONFIG, version_base=None)
def hydra_main(cfg: DictConfig) -> None:
    run(cfg)


def print_job(args: argparse.Namespace) -> None:
    """``--cfg job``: the config verl receives (``launch.config_verl_receives``), composed as the launch
    composes it (``--config-path``, absolute or relative to this package, ``--config-name``,
    ``--config-dir``), printed as Hydra prints it (``--resolve``, ``--package``)."""
    from hydra import compose, initialize_config_dir

    config_dir = Path(__file__).parent / args.config_path if args.config_path else hydra_config_dir()
    overrides = list(args.overrides)
    if args.config_dir:
        overrides.append(f"hydra.searchpath=[file://{Path(args.config_dir).absolute()}]")
    with initialize_config_dir(config_dir=str(config_dir.absolute()), version_base=None):
        cfg = compose(config_name=args.config_name or DEFAULT_CONFIG, overrides=overrides)
    launch.config_verl_receives(cfg, log=lambda line: print(line, file=sys.stderr))
    package = None if args.package == "_global_" else args.package
    node = cfg if package is None else OmegaConf.select(cfg, package)
    if node is None:
        raise SystemExit(f"package '{package}' not found in config")
    if not isinstance(node, Container):  # a scalar as is; a dict or a list (Containers) as YAML, as Hydra prints them
        print(node)
        return
    if package is not None:
        print(f"# @package {package}")
    print(OmegaConf.to_yaml(node, resolve=args.resolve), end="")


def main() -> None:
    """``verl-sat``: Hydra's app, whose ``--cfg job`` (``-c job``) prints the config verl receives after
    verl-sat's mapping and fills (:func:`print_job`), not only Hydra's composition; every other flag is Hydra's."""
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args()
    if args.cfg == "job" and not (args.help or args.hydra_help or args.info or args.multirun or args.run):
        print_job(args)  # with another command flag, Hydra's own check refuses the mix
    else:
        hydra_main()


if __name__ == "__main__":
    main()
