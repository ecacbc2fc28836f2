"""The preflight's command line (docs/reproduce.md): resolve the cell as run.sh launches it, probe the
node, run the checks, print the findings (or JSON); exit code 1 when any check fails."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict

from omegaconf import DictConfig, OmegaConf

from verl_sat.preflight.checks import CHECKS, run_checks
from verl_sat.preflight.facts import ROUTED_EXPERTS_ARG, Facts, Finding
from verl_sat.preflight.probe import probe


# ---------------------------------------------------------------------------------------------
# the config, as run.sh launches it
# ---------------------------------------------------------------------------------------------
def resolve_cell(method: str, lag: int, overrides: Sequence[str] = (), run_dir: str | None = None) -> DictConfig:
    """The cell's config as ``verl_sat.main`` hands it to verl: composed by ``verl_sat.paper.grid``,
    ``sat.*`` mapped by ``verl_sat.trainer.recipe`` (Megatron's betas, lag, actor, routing replay), then resolved."""
    from verl_sat.paper.grid import compose_cell
    from verl_sat.trainer.recipe import (
        SATRecipeConfig,
        apply_actor,
        apply_lag,
        apply_megatron_betas,
        apply_routing_replay,
    )

    extra = ([f"sat.run_dir={run_dir}"] if run_dir else []) + list(overrides)
    cfg = compose_cell(method, lag, overrides=extra)
    sat = SATRecipeConfig.from_node(cfg.get("sat"))
    apply_megatron_betas(cfg)
    apply_lag(cfg, sat.lag)
    apply_actor(cfg, sat.actor)
    apply_routing_replay(cfg, sat.routing_replay)
    return OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------
def summary(findings: Sequence[Finding]) -> str:
    fails = sum(f.level == "fail" for f in findings)
    warns = len(findings) - fails
    verdict = "FAILED" if fails else "passed"
    return f"[preflight] {verdict}: {fails} failure(s), {warns} warning(s) over {len(CHECKS)} checks"


def report_json(findings: Sequence[Finding], facts: Facts) -> str:
    facts_dict = asdict(facts)
    for key in ("sglang_server_args", "checkpoint_engines"):
        value = facts_dict[key]
        facts_dict[key] = None if value is None else sorted(value)
    if facts_dict["sglang_server_args"] is not None:
        facts_dict["sglang_server_args"] = ROUTED_EXPERTS_ARG in facts_dict["sglang_server_args"]
    return json.dumps(
        {
            "ok": not any(f.level == "fail" for f in findings),
            "findings": [asdict(f) for f in findings],
            "facts": facts_dict,
        },
        indent=1,
        default=str,
    )


# Hydra's own command-line flags (hydra/_internal/utils.py's get_args_parser) that take a value;
# the others (--resolve, --multirun, --run, --hydra-help, --version, --info [WHAT]) take none or an
# optional one. The preflight checks the cell those overrides compose to; Hydra's flags are Hydra's.
HYDRA_FLAGS_WITH_VALUE = frozenset(
    {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd"}
)
HYDRA_INFO_VALUES = frozenset({"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"})
OWN_FLAGS = frozenset({"--run-dir", "--json", "-h", "--help"})


def split_hydra_flags(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split a launch's arguments into the preflight's own (positionals, ``key=value`` overrides,
    --run-dir, --json) and Hydra's flags (``--cfg job``, ``--info``, ``--resolve``, ...).

    >>> split_hydra_flags(["sat_gspo_r3", "8", "--cfg", "job", "a.b=1", "--resolve"])
    (['sat_gspo_r3', '8', 'a.b=1'], ['--cfg', 'job', '--resolve'])
    """
    own: list[str] = []
    hydra: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        name = arg.split("=", 1)[0]
        if not arg.startswith("-") or name in OWN_FLAGS:
            own.append(arg)
            if arg == "--run-dir" and i + 1 < len(args):
                own.append(args[i + 1])
                i += 1
        elif name in HYDRA_FLAGS_WITH_VALUE and "=" not in arg and i + 1 < len(args):
            hydra += [arg, args[i + 1]]
            i += 1
        elif name in ("--info", "-i") and "=" not in arg and i + 1 < len(args) and args[i + 1] in HYDRA_INFO_VALUES:
            hydra += [arg, args[i + 1]]
            i += 1
        else:
            hydra.append(arg)
        i += 1
    return own, hydra


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m verl_sat.preflight",
        description="Check a cell of the paper's grid against this node before launching it (docs/reproduce.md).",
    )
    parser.add_argument("method", help="a Table-1 method (python -m verl_sat.paper.grid --list)")
    parser.add_argument("lag", type=int, help="the lag (1 or 8)")
    parser.add_argument(
        "hydra_overrides",
        nargs="*",
        help="the Hydra overrides run.sh passes (key=value; Hydra's own flags such as --cfg are ignored)",
    )
    parser.add_argument("--run-dir", default=None, help="the run directory (sat.run_dir), as run.sh sets it")
    parser.add_argument("--json", action="store_true", help="print findings and facts as JSON")
    return parser


def main(argv: Sequence[str] | None = None, probe_fn: Callable[[DictConfig], Facts] = probe) -> int:
    """Resolve the cell, probe the node, run the checks; 0 when nothing fails, 1 otherwise.

    Hydra's own flags among ``argv`` (run.sh forwards the launch's arguments) are dropped with a
    note: they change what Hydra prints or how it runs, not the cell's config."""
    own, hydra_flags = split_hydra_flags(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_intermixed_args(own)
    if hydra_flags:
        print(f"[preflight] left to Hydra: {' '.join(hydra_flags)}", file=sys.stderr)
    cfg = resolve_cell(args.method, args.lag, args.hydra_overrides, run_dir=args.run_dir)
    facts = probe_fn(cfg)
    findings = run_checks(cfg, facts)
    if args.json:
        print(report_json(findings, facts))
    else:
        for finding in findings:
            print(finding.line())
        print(summary(findings))
    return 1 if any(f.level == "fail" for f in findings) else 0
