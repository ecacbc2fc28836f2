"""The preflight's command line (docs/reproduce.md, docs/cluster.md)::

    python -m verl_sat.preflight [<method> <lag>] [overrides...] [--run-dir DIR] [--json]
                                 [--config-name NAME] [--address ADDR]
    python -m verl_sat.preflight --memory-table [overrides...]

resolves the run as the launch does (a cell of the paper's grid, else ``--config-name`` composed
with the overrides), gathers the facts (``verl_sat.preflight.facts.gather``) and runs the checks.
Without a cluster, on this node: every check of ``CHECKS``. On a Ray cluster started beforehand
(``--address``, ``ray_kwargs.ray_init.address`` or ``RAY_ADDRESS``): ``gather`` runs as a Ray task
pinned to each node, then ``run_cluster_checks`` (each node's memory and disk, the same versions on
every node, GPU slots, verl's pools on the nodes, the paths every node must see). One line per
finding and a verdict; the exit code is 1 when any check fails. The arguments are read by Hydra's
own parser, as the launch reads them; Hydra's flags (``--cfg job``, ...) are left to Hydra with a note.
``--memory-table`` prints docs/reproduce.md's host-memory table instead (``memory_rows``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from verl_sat.preflight.checks import CHECKS, run_checks, run_cluster_checks
from verl_sat.preflight.cluster import Node, alive_nodes, cluster_address, connect, on_each_node, paths_on_nodes
from verl_sat.preflight.estimates import get, host_memory_bytes
from verl_sat.preflight.facts import RAY_MEMORY_USAGE_THRESHOLD, Facts, Finding, ModelFacts, gather, probe_model

# The arguments that are the preflight's own; every other flag Hydra's parser knows (``--cfg job``,
# ``--resolve``, ``--info``, ...) changes what Hydra prints, not the run, and is left to Hydra.
OWN_DESTS = frozenset({"overrides", "help", "config_name", "run_dir", "json", "address", "memory_table"})
# The rows of docs/reproduce.md's host-memory table: (row, method, lag), the paper's cells with and
# without R3 at both lags.
MEMORY_CELLS = (
    ("lag 1, R3", "sat_gspo_r3", 1),
    ("lag 1, no R3", "sat_gspo", 1),
    ("lag 8, R3", "sat_gspo_r3", 8),
    ("lag 8, no R3", "sat_gspo", 8),
)


# ---------------------------------------------------------------------------------------------
# the config, as the launch resolves it
# ---------------------------------------------------------------------------------------------
def resolve(
    method: str | None = None,
    lag: int | None = None,
    overrides: Sequence[str] = (),
    run_dir: str | None = None,
    config_name: str = "sat_gspo_cpu",
    build: bool = False,
) -> DictConfig:
    """The config as ``verl_sat.main`` hands it to verl: the grid's cell (``verl_sat.paper.grid``)
    or ``config_name`` composed with ``overrides``, then changed as the launch changes it
    (``verl_sat.trainer.launch.config_verl_receives``: ``recipe.resolve`` and the embedded default's
    fills, built once when ``build``, as the launch would; its lines go to stderr), then resolved."""
    from verl_sat.trainer.launch import config_verl_receives

    extra = ([f"sat.run_dir={run_dir}"] if run_dir else []) + list(overrides)
    if method is not None and lag is not None:
        from verl_sat.paper.grid import compose_cell

        cfg = compose_cell(method, lag, overrides=extra)
    else:
        from hydra import compose, initialize_config_dir

        from verl_sat.files import hydra_config_dir

        with initialize_config_dir(config_dir=str(hydra_config_dir()), version_base=None):
            cfg = compose(config_name=config_name, overrides=extra)
    config_verl_receives(cfg, log=lambda line: print(line, file=sys.stderr), build=build)
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    local_dir = str(get(cfg, "trainer.default_local_dir", ""))
    if get(cfg, "sat.run_dir") and (not local_dir or "checkpoints/" in local_dir):
        OmegaConf.update(cfg, "trainer.default_local_dir", str(Path(str(cfg.sat.run_dir)) / "checkpoints"))
    return cfg


def shared_dirs(cfg: DictConfig) -> dict[str, Path]:
    """The run and checkpoint directories every node must share (key -> directory, each once)."""
    dirs: dict[str, Path] = {}
    for key in ("sat.run_dir", "trainer.default_local_dir"):
        path = Path(str(get(cfg, key, ""))).expanduser().absolute()
        if get(cfg, key) and path not in dirs.values():
            dirs[key] = path
    return dirs


# ---------------------------------------------------------------------------------------------
# docs/reproduce.md's host-memory table
# ---------------------------------------------------------------------------------------------
def decimal_size(n: float) -> str:
    """Bytes as the docs write them: ``488 GB`` below a terabyte, ``1.15 TB`` above."""
    return f"{n / 1e9:.0f} GB" if n < 1e12 else f"{n / 1e12:.2f} TB"


def memory_rows(overrides: Sequence[str] = ()) -> list[dict]:
    """docs/reproduce.md's host-memory rows (``MEMORY_CELLS``), each computed by the preflight's own
    estimates on the cell resolved as the launch resolves it with ``overrides``: ``host_memory_bytes``
    (the sum ``check_host_memory`` compares with a node), ``rollout_buffer_bytes`` and
    ``rank_copy_bytes``; the model's parameters and layers are read from its local ``config.json``
    (``actor_rollout_ref.model.path``)."""
    rows: list[dict] = []
    models: dict[str, ModelFacts] = {}
    for row, method, lag in MEMORY_CELLS:
        cfg = resolve(method, lag, overrides)
        path = str(get(cfg, "actor_rollout_ref.model.path", ""))
        if path not in models:
            models[path] = probe_model(path)  # once per model: transformers builds it on the meta device
        model = models[path]
        if model.config is None or model.params is None:
            raise ValueError(
                f"actor_rollout_ref.model.path={path}: no local config.json transformers can build; pass "
                "actor_rollout_ref.model.path=DIR (e.g. tests/fixtures/qwen3_30b_a3b_base)"
            )
        need = host_memory_bytes(cfg, model.params, model.config)
        assert need is not None  # the layers are in config.json
        buffer, copies = need["buffer_detail"], need["copies_detail"]
        rows.append({"row": row, "method": method, "lag": lag, "need": need, "buffer": buffer, "copies": copies})
    return rows


def memory_table(rows: Sequence[dict], threshold: float = RAY_MEMORY_USAGE_THRESHOLD) -> list[str]:
    """``memory_rows`` as docs/reproduce.md's markdown table; the last column is the RAM a node needs
    for the total to stay under Ray's memory-kill threshold: total / threshold."""
    lines = [
        "| cell | offloaded Adam | rollout buffer (of which R3 routes) | trainer ranks' batch copies | total "
        f"| RAM under Ray's {threshold:g} threshold |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        need, copies = r["need"], r["copies"]
        held = decimal_size(need["buffer"]) + (f" ({decimal_size(need['routes'])})" if need["routes"] else "")
        ranks = f"{copies['ranks']} × {decimal_size(copies['per_rank'])} = {decimal_size(need['rank_copies'])}"
        lines.append(
            f"| {r['row']} | {decimal_size(need['optimizer'])} | {held} | {ranks} | {decimal_size(need['total'])} "
            f"| {decimal_size(need['total'] / threshold)} |"
        )
    return lines


# ---------------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------------
def verdict(findings: Sequence[Finding], over: str, prefix: str = "[preflight]") -> str:
    fails = sum(f.level == "fail" for f in findings)
    word = "FAILED" if fails else "passed"
    return f"{prefix} {word}: {fails} failure(s), {len(findings) - fails} warning(s) over {over}"


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    """Hydra's own command-line parser (``hydra.main`` parses the launch's arguments with it, so the
    preflight reads them as the launch does), with the preflight's flags added."""
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()
    parser.prog = "python -m verl_sat.preflight"
    parser.description = (
        "Check a run against this node, or every node of a Ray cluster, before launching it "
        "(docs/reproduce.md, docs/cluster.md); --config-name: the config without <method> <lag>."
    )
    for action in parser._actions:
        if action.dest == "overrides":
            action.help = "[<method> <lag>] (python -m verl_sat.paper.grid --list), then key=value"
        elif action.dest == "shell_completion":
            action.help = argparse.SUPPRESS  # Hydra's, and its text is built lazily for Hydra's own help
    parser.add_argument("--run-dir", default=None, help="the run directory (sat.run_dir), as run.sh sets it")
    parser.add_argument("--json", action="store_true", help="print findings and facts as JSON")
    parser.add_argument(
        "--address", default=None, help="a Ray cluster (default: ray_kwargs.ray_init.address, else RAY_ADDRESS)"
    )
    parser.add_argument(
        "--memory-table",
        action="store_true",
        help="print docs/reproduce.md's host-memory table (overrides: actor_rollout_ref.model.path=DIR)",
    )
    return parser


def hydra_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """Hydra's flags among the parsed arguments, as a command line (those not ``OWN_DESTS``).

    >>> hydra_flags(_parser(), _parser().parse_intermixed_args(["m", "1", "-c", "job", "a=b", "-m"]))
    ['--cfg', 'job', '--multirun']
    """
    out: list[str] = []
    for action in parser._actions:
        value = getattr(args, action.dest, action.default)
        if action.dest not in OWN_DESTS and value != action.default:
            out += [action.option_strings[0]] + ([] if action.nargs == 0 else [str(value)])
    return out


def split_cell(args: Sequence[str]) -> tuple[str | None, int | None, list[str]]:
    """``[method, lag, *overrides]`` or ``overrides``: a cell when the first two are not ``key=value``."""
    if len(args) >= 2 and "=" not in args[0] and "=" not in args[1]:
        return args[0], int(args[1]), list(args[2:])
    return None, None, list(args)


def report(
    findings: Sequence[Finding], as_json: bool, facts: dict, lines: Sequence[str], over: str, prefix: str
) -> bool:
    """Print the findings and the verdict (or, ``as_json``, them and ``facts``); True when none fails."""
    ok = not any(f.level == "fail" for f in findings)
    if as_json:
        print(json.dumps({"ok": ok, **facts, "findings": [asdict(f) for f in findings]}, indent=1, default=str))
        return ok
    for line in [*lines, *(f.line(prefix) for f in findings), verdict(findings, over, prefix)]:
        print(line)
    return ok


def on_this_node(cfg: DictConfig, as_json: bool, gather_fn: Callable[[DictConfig], Facts]) -> bool:
    """``gather`` here, then every check of ``CHECKS``."""
    facts = gather_fn(cfg)
    findings = run_checks(cfg, facts)
    return report(findings, as_json, {"facts": asdict(facts)}, [], f"{len(CHECKS)} checks", "[preflight]")


def on_the_cluster(cfg: DictConfig, address: str, as_json: bool) -> bool:
    """``gather`` on every node of the cluster at ``address``, then the cluster checks."""
    import ray

    connect(address)  # Ray's token authentication as the job joins (verl_sat.preflight.cluster.connect)
    try:
        nodes = alive_nodes()
        facts: dict[Node, Facts] = on_each_node(gather, cfg, nodes=nodes)
        findings = run_cluster_checks(cfg, facts, paths_on_nodes(cfg, shared_dirs(cfg), nodes))
    finally:
        ray.shutdown()
    prefix = "[cluster-preflight]"
    rows = [{"node": n.name, "node_id": n.node_id, **asdict(facts[n])} for n in nodes]
    lines = [
        f"{prefix} node {n.name}: {n.gpus} GPU slots, {n.cpus} CPUs, {len(facts[n].gpus)} GPUs by NVML" for n in nodes
    ]
    return report(findings, as_json, {"nodes": rows}, lines, f"{len(nodes)} node(s)", prefix)


def main(argv: Sequence[str] | None = None, gather_fn: Callable[[DictConfig], Facts] = gather) -> int:
    """Resolve the run, gather the facts (here, or on each node of a cluster), check them; 0 when
    nothing fails, 1 otherwise."""
    parser = _parser()
    args = parser.parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    if args.help:
        parser.print_help()
        return 0
    if left := hydra_flags(parser, args):  # run.sh forwards the launch's arguments, Hydra's flags too
        print(f"[preflight] left to Hydra: {' '.join(left)}", file=sys.stderr)
    if args.memory_table:
        print("\n".join(memory_table(memory_rows(args.overrides))))
        return 0
    method, lag, overrides = split_cell(args.overrides)
    cfg = resolve(method, lag, overrides, args.run_dir, args.config_name or "sat_gspo_cpu", build=True)
    address = args.address or cluster_address(cfg)
    ok = on_the_cluster(cfg, address, args.json) if address else on_this_node(cfg, args.json, gather_fn)
    return 0 if ok else 1
