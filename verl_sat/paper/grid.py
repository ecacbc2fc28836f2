"""The paper's experiment as Hydra cells: Table 1's rows mapped onto verl-sat's config groups.

A *cell* is one row of Table 1 (a method) at one lag. It is the main config
``hydra_configs/sat_paper.yaml`` with one option of each group::

    algorithm=<METHODS[method][0]> stabilizer=<METHODS[method][1]> lag=n<lag>

plus the run's name and directory (``sat.method``, ``sat.run_dir``). ``recipes/sat_paper/run.sh``
launches a cell with the overrides printed by ``--overrides``; ``--print`` is a dry run that prints
the config verl receives for any cell (composed, then changed by
``verl_sat.trainer.launch.config_verl_receives``: the launch's own ``recipe.resolve`` and fills; the
run directory's own keys are set when the run starts)::

    python -m verl_sat.paper.grid --list
    python -m verl_sat.paper.grid --print sat_gspo_r3 8 [hydra overrides...]
    python -m verl_sat.paper.grid --overrides sat_gspo_r3 8 [--run-dir DIR]

``base`` is the untrained Qwen3-30B-A3B-Base: an evaluation-only cell (``trainer.val_only=true``)
whose score does not depend on the lag, so the grid runs it once (at lag 1) and the paper's two
"base model" columns both read it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from verl_sat.paper.table import LAGS  # the paper's lags n: trainer optimizer steps per weight broadcast

# Table 1 row -> (algorithm group option, stabilizer group option).
METHODS: dict[str, tuple[str, str]] = {
    "base": ("grpo", "none"),
    "grpo": ("grpo", "none"),
    "gspo": ("gspo", "none"),
    "grpo_r3": ("grpo", "r3"),
    "gspo_r3": ("gspo", "r3"),
    "grpo_tis": ("grpo", "tis"),
    "gspo_tis": ("gspo", "tis"),
    "grpo_tis_r3": ("grpo", "tis_r3"),
    "gspo_tis_r3": ("gspo", "tis_r3"),
    "dppo": ("dppo", "none"),
    "sat_grpo": ("sat_grpo", "none"),
    "sat_gspo": ("sat_gspo", "none"),
    "sat_grpo_r3": ("sat_grpo", "r3"),
    "sat_gspo_r3": ("sat_gspo", "r3"),
}

# Rows that are evaluated, not trained (the base model's AIME24 score).
EVAL_ONLY: frozenset[str] = frozenset({"base"})

# The main config in hydra_configs/.
CONFIG_NAME = "sat_paper"

# Where run directories go unless told otherwise (relative to the launch directory).
DEFAULT_RUN_ROOT = "runs"


@dataclass(frozen=True)
class Cell:
    """One run of the grid: a Table-1 method at one lag."""

    method: str
    lag: int

    @property
    def name(self) -> str:
        """``<method>-lag<lag>``: the experiment name and the run directory's name."""
        return f"{self.method}-lag{self.lag}"

    @property
    def algorithm(self) -> str:
        return METHODS[self.method][0]

    @property
    def stabilizer(self) -> str:
        return METHODS[self.method][1]

    @property
    def eval_only(self) -> bool:
        return self.method in EVAL_ONLY


def check_cell(method: str, lag: int) -> Cell:
    """Validate a (method, lag) pair and return its ``Cell``.

    Raises:
        ValueError: naming the unknown method or lag and listing the valid ones.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; Table 1 has: {', '.join(METHODS)}")
    if lag not in LAGS:
        raise ValueError(f"unknown lag {lag!r}; the paper's lags are {list(LAGS)} (hydra_configs/lag/n<lag>.yaml)")
    return Cell(method, lag)


def lag_option(lag: int) -> str:
    """The ``lag`` group option of a lag (``n8`` for 8: Hydra option names cannot be integers)."""
    return f"n{lag}"


def cell_overrides(method: str, lag: int, run_dir: str | None = None) -> list[str]:
    """The Hydra overrides that turn ``sat_paper`` into one cell.

    Args:
        method: a key of ``METHODS``.
        lag: one of ``LAGS``.
        run_dir: the run directory; default ``runs/<method>-lag<lag>``.
    """
    cell = check_cell(method, lag)
    overrides = [
        f"algorithm={cell.algorithm}",
        f"stabilizer={cell.stabilizer}",
        f"lag={lag_option(lag)}",
        f"sat.method={cell.method}",
        f"sat.run_dir={run_dir or f'{DEFAULT_RUN_ROOT}/{cell.name}'}",
    ]
    if cell.eval_only:
        overrides.append("trainer.val_only=true")
    return overrides


def grid() -> list[Cell]:
    """Every run of the paper's grid: 13 trained methods × 2 lags, plus ``base`` once (27 runs)."""
    cells = []
    for method in METHODS:
        lags = LAGS[:1] if method in EVAL_ONLY else LAGS
        cells.extend(Cell(method, lag) for lag in lags)
    return cells


def compose_cell(method: str, lag: int, overrides: Sequence[str] = ()) -> DictConfig:
    """Compose one cell against verl 0.9.1's packaged configs (nothing is launched).

    Args:
        method: a key of ``METHODS``.
        lag: one of ``LAGS``.
        overrides: further Hydra overrides, applied after the cell's own.

    Returns:
        The composed (unresolved) config, as ``verl_sat.main`` would receive it.
    """
    from hydra import compose, initialize_config_dir

    import verl_sat.trainer.recipe  # noqa: F401  (registers sat_defaults, which sat_paper.yaml composes)
    from verl_sat.files import hydra_config_dir

    cell_args = cell_overrides(method, lag) + list(overrides)
    with initialize_config_dir(config_dir=str(hydra_config_dir()), version_base=None):
        return compose(config_name=CONFIG_NAME, overrides=cell_args)


def format_grid(cells: Sequence[Cell]) -> str:
    """One line per run: method, lag, run name, algorithm and stabilizer options."""
    lines = []
    for cell in cells:
        note = "  (eval only)" if cell.eval_only else ""
        lines.append(f"{cell.method:<13} {cell.lag:>2}  {cell.name:<18} {cell.algorithm:<9} {cell.stabilizer}{note}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m verl_sat.paper.grid",
        description="The paper's grid (Table 1) as Hydra cells of hydra_configs/sat_paper.yaml.",
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--list", action="store_true", help="list every run of the grid: method lag name algorithm stabilizer"
    )
    mode.add_argument("--print", action="store_true", help="print the config verl receives for METHOD LAG (a dry run)")
    mode.add_argument("--overrides", action="store_true", help="print the Hydra overrides of METHOD LAG, one a line")
    parser.add_argument("method", nargs="?", help=f"one of: {', '.join(METHODS)}")
    parser.add_argument("lag", nargs="?", type=int, help=f"one of: {', '.join(map(str, LAGS))}")
    parser.add_argument("hydra_overrides", nargs="*", help="extra Hydra overrides (--print only)")
    parser.add_argument("--run-dir", default=None, help="run directory (--overrides; default runs/<method>-lag<lag>)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``--list``, ``--print METHOD LAG [overrides]``, ``--overrides METHOD LAG``."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.list:
        print(format_grid(grid()))
        return 0
    if args.method is None or args.lag is None:
        parser.error("--print and --overrides need METHOD and LAG")
    try:
        check_cell(args.method, args.lag)
    except ValueError as err:
        parser.error(str(err))
    if args.overrides:
        print("\n".join(cell_overrides(args.method, args.lag, run_dir=args.run_dir)))
        return 0
    from verl_sat.trainer.launch import config_verl_receives

    cfg = compose_cell(args.method, args.lag, args.hydra_overrides)
    config_verl_receives(cfg, log=lambda line: print(line, file=sys.stderr))  # what verl_sat.main.prepare changes
    print(OmegaConf.to_yaml(cfg, resolve=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
