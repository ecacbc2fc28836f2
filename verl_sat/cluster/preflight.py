"""The preflight of a whole Ray cluster (docs/cluster.md): ``python -m verl_sat.cluster.preflight``.

Each node is probed by a Ray task pinned to it (``verl_sat.cluster.nodes``), reusing the single-node
preflight's probe (``verl_sat.preflight.probe``) and checks (``verl_sat.preflight.checks``):

- per node: its GPUs (torch's, and the ``GPU`` slots its raylet declared), host memory and disk at
  the run directory (``check_host_memory``, ``check_disk``, ``check_gpu_memory`` on that node's facts);
- across nodes: the versions of ``COMPARED_DISTRIBUTIONS`` (torch, verl, verl-sat, the inference
  engines, megatron-core and the bridges): one that differs is a failure naming both nodes;
- the run and checkpoint directories: the first node writes a token into each, every other node
  must read it back (the same shared file system);
- the layout: verl's resource pools, placed as verl places them (``pool_bundles``), fit the nodes.

Findings are the single-node preflight's ``Finding`` lines; the exit code is 1 when one fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from verl_sat.cluster.nodes import Node, alive_nodes, on_each_node, on_node
from verl_sat.preflight.facts import ROLLOUT, Finding, get, is_standalone_rollout

# Distributions that must be the same on every node (None: not installed, also compared).
COMPARED_DISTRIBUTIONS = (
    "torch",
    "verl",
    "verl-sat",
    "ray",
    "transformers",
    "vllm",
    "sglang",
    "megatron-core",
    "megatron-bridge",
    "mbridge",
)
TOKEN_FILE = ".cluster_preflight_token"
# The command line's flags that take a value and that Hydra also has a flag for, or not.
OWN_VALUE_FLAGS = ("--address", "--config-name")
# verl's placement (verl/single_controller/ray/base.py): one placement group per node of a pool,
# n_gpus_per_node bundles of {"CPU": max_colocate_count, "GPU": 1}, all on one node. The trainer's
# pools use ResourcePoolManager's default max_colocate_count (3); a standalone rollout replica's
# pool (RolloutReplica.init_standalone) uses 2.
TRAINER_BUNDLE_CPUS = 3
ROLLOUT_BUNDLE_CPUS = 2


# ---------------------------------------------------------------------------------------------
# on each node
# ---------------------------------------------------------------------------------------------
def node_facts(cfg_yaml: str) -> dict[str, Any]:
    """Run on a node: its hostname, GPUs, versions, host memory, disk at the run dir, and the
    single-node checks that read only this node's facts (host memory, disk, GPU memory)."""
    import socket
    from importlib import metadata

    from verl_sat.preflight.checks import check_disk, check_gpu_memory, check_host_memory
    from verl_sat.preflight.facts import Facts
    from verl_sat.preflight.probe import probe_disk, probe_gpus, probe_host_memory, probe_model

    cfg = OmegaConf.create(cfg_yaml)
    gpus, cuda = probe_gpus()
    versions: dict[str, str | None] = {}
    for name in COMPARED_DISTRIBUTIONS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    facts = Facts(
        gpus=gpus,
        cuda_runtime=cuda,
        versions=versions,
        host_mem_available_bytes=probe_host_memory(),
        disk_free_bytes=probe_disk(str(get(cfg, "trainer.default_local_dir", get(cfg, "sat.run_dir", ".")))),
        model=probe_model(str(get(cfg, "actor_rollout_ref.model.path", ""))),
    )
    findings = check_host_memory(cfg, facts) + check_disk(cfg, facts)
    if str(get(cfg, "trainer.device", "cuda")) != "cpu":
        findings += check_gpu_memory(cfg, facts)
    return {
        "hostname": socket.gethostname(),
        "gpus": [asdict(g) for g in gpus],
        "versions": versions,
        "host_mem_available_bytes": facts.host_mem_available_bytes,
        "disk_free_bytes": facts.disk_free_bytes,
        "findings": [asdict(f) for f in findings],
    }


def write_token(paths: Sequence[str], token: str) -> list[str]:
    """Run on the writing node: ``token`` into each directory (created); returns the errors."""
    errors = []
    for path in paths:
        try:
            Path(path).mkdir(parents=True, exist_ok=True)
            (Path(path) / TOKEN_FILE).write_text(token)
        except OSError as err:
            errors.append(f"{path}: {err}")
    return errors


def read_token(paths: Sequence[str], token: str) -> list[str]:
    """Run on a reading node: the directories whose token file is missing or different."""
    unseen = []
    for path in paths:
        try:
            if (Path(path) / TOKEN_FILE).read_text() != token:
                unseen.append(path)
        except OSError:
            unseen.append(path)
    return unseen


def remove_token(paths: Sequence[str]) -> None:
    """Run on the writing node: the token files removed."""
    for path in paths:
        (Path(path) / TOKEN_FILE).unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# checks: pure functions over the nodes' results
# ---------------------------------------------------------------------------------------------
def check_node_findings(facts: dict[Node, dict[str, Any]]) -> list[Finding]:
    """Each node's own findings (host memory, disk, GPU memory), prefixed with the node."""
    out = []
    for node, result in facts.items():
        for f in result["findings"]:
            out.append(Finding(f["check"], f["key"], f"node {node.name}: {f['message']}", f["level"]))
    return out


def check_same_versions(facts: dict[Node, dict[str, Any]]) -> list[Finding]:
    """Every ``COMPARED_DISTRIBUTIONS`` at the first node's version on every other node."""
    nodes = list(facts)
    if not nodes:
        return []
    first, out = nodes[0], []
    for name in COMPARED_DISTRIBUTIONS:
        want = facts[first]["versions"].get(name)
        for node in nodes[1:]:
            have = facts[node]["versions"].get(name)
            if have != want:
                out.append(
                    Finding(
                        "cluster_versions",
                        name,
                        f"{name} {have or 'not installed'} on node {node.name}, but {want or 'not installed'} "
                        f"on node {first.name}: install the same {name} on every node",
                    )
                )
    return out


def check_gpu_slots(cfg: DictConfig, facts: dict[Node, dict[str, Any]]) -> list[Finding]:
    """On a GPU run, each raylet's ``GPU`` slots are the GPUs torch sees there (verl places a
    worker per slot; a raylet started with another --num-gpus misplaces or starves them)."""
    if str(get(cfg, "trainer.device", "cuda")) == "cpu":
        return []
    out = []
    for node, result in facts.items():
        if node.gpus != len(result["gpus"]):
            out.append(
                Finding(
                    "cluster_gpus",
                    "trainer.n_gpus_per_node",
                    f"node {node.name}: its raylet declares {node.gpus} GPU slots but torch sees "
                    f"{len(result['gpus'])} GPUs (CUDA_VISIBLE_DEVICES at `ray start`; start it with --num-gpus)",
                )
            )
    return out


def pool_bundles(cfg: DictConfig) -> list[tuple[str, int, int]]:
    """verl's placement groups for ``cfg``: (pool, GPUs, CPUs), one per node of each pool.

    The trainer: ``trainer.nnodes`` groups of ``trainer.n_gpus_per_node``; a standalone rollout
    (separate_async, hybrid_engine=false): ``rollout.nnodes × rollout.n_gpus_per_node`` GPUs in
    replicas of TP × DP × PP, each replica ``ceil(size / n_gpus_per_node)`` groups of
    ``min(size, n_gpus_per_node)`` (``RolloutReplica.gpus_per_replica_node``)."""
    from verl_sat.preflight.facts import rollout_pool_gpus, rollout_replica_gpus

    n_train = int(get(cfg, "trainer.n_gpus_per_node", 0))
    groups = [("trainer", n_train, n_train * TRAINER_BUNDLE_CPUS)] * int(get(cfg, "trainer.nnodes", 1))
    if is_standalone_rollout(cfg):
        per_node = int(get(cfg, f"{ROLLOUT}.n_gpus_per_node", 0))
        size = max(1, rollout_replica_gpus(cfg))
        on_node_gpus = min(size, per_node) if per_node else 0
        replicas = rollout_pool_gpus(cfg) // size
        nodes_per_replica = -(-size // per_node) if per_node else 0
        groups += [("rollout", on_node_gpus, on_node_gpus * ROLLOUT_BUNDLE_CPUS)] * (replicas * nodes_per_replica)
    return [g for g in groups if g[1] > 0]


def place(groups: Sequence[tuple[str, int, int]], nodes: Sequence[Node]) -> dict[int, Node] | None:
    """First-fit decreasing of the groups on the nodes' GPU and CPU slots (each group on one node,
    as verl's placement groups are); group index -> node, or None when they do not fit."""
    free = {node: [node.gpus, node.cpus] for node in nodes}
    placed: dict[int, Node] = {}
    for i in sorted(range(len(groups)), key=lambda i: -groups[i][1]):
        _, gpus, cpus = groups[i]
        target = next((n for n in nodes if free[n][0] >= gpus and free[n][1] >= cpus), None)
        if target is None:
            return None
        free[target][0] -= gpus
        free[target][1] -= cpus
        placed[i] = target
    return placed


def check_layout(cfg: DictConfig, nodes: Sequence[Node]) -> list[Finding]:
    """The trainer and rollout pools fit the nodes' GPU (and CPU) slots as verl places them."""
    groups = pool_bundles(cfg)
    if place(groups, nodes) is not None:
        return []
    need = ", ".join(f"{pool} {g} GPU + {c} CPU" for pool, g, c in groups)
    have = ", ".join(f"{n.name}: {n.gpus} GPU, {n.cpus} CPU" for n in nodes)
    key = "trainer.nnodes" if len(groups) > len(nodes) else "trainer.n_gpus_per_node"
    return [
        Finding(
            "cluster_layout",
            key,
            f"verl places one group per node of each pool ({need}); they do not fit the cluster's "
            f"{len(nodes)} node(s) ({have}): change trainer.nnodes / trainer.n_gpus_per_node / "
            f"{ROLLOUT}.nnodes / {ROLLOUT}.n_gpus_per_node, or add nodes",
        )
    ]


def shared_dirs(cfg: DictConfig) -> list[str]:
    """The run and checkpoint directories every node must share (absolute, as the driver sees them)."""
    keys = ("sat.run_dir", "trainer.default_local_dir")
    dirs = [str(Path(str(get(cfg, k))).expanduser().absolute()) for k in keys if get(cfg, k)]
    return list(dict.fromkeys(dirs))


def check_shared_dirs(cfg: DictConfig, nodes: Sequence[Node]) -> list[Finding]:
    """The first node writes a token into each shared directory; every other node reads it back."""
    import ray

    dirs = shared_dirs(cfg)
    if not dirs or not nodes:
        return []
    writer, token = nodes[0], uuid.uuid4().hex
    errors = ray.get(on_node(writer, write_token, dirs, token))
    out = [Finding("cluster_shared_dir", "sat.run_dir", f"node {writer.name} cannot write {e}") for e in errors]
    try:
        unseen = on_each_node(read_token, dirs, token, nodes=nodes[1:])
    finally:
        ray.get(on_node(writer, remove_token, dirs))
    for node, paths in unseen.items():
        for path in paths:
            out.append(
                Finding(
                    "cluster_shared_dir",
                    "sat.run_dir" if path == dirs[0] else "trainer.default_local_dir",
                    f"{path}: written on node {writer.name}, not seen on node {node.name}: put the run and "
                    "checkpoint directories on a file system every node mounts at the same path",
                )
            )
    return out


@dataclass
class ClusterReport:
    """The nodes, each node's facts, and every finding."""

    nodes: list[Node]
    facts: dict[Node, dict[str, Any]]
    findings: list[Finding]

    @property
    def ok(self) -> bool:
        return not any(f.level == "fail" for f in self.findings)


def run_cluster_checks(cfg: DictConfig) -> ClusterReport:
    """On the connected cluster: probe each node, then every check."""
    nodes = alive_nodes()
    cfg_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    facts = on_each_node(node_facts, cfg_yaml, nodes=nodes)
    findings = (
        check_node_findings(facts)
        + check_same_versions(facts)
        + check_gpu_slots(cfg, facts)
        + check_layout(cfg, nodes)
        + check_shared_dirs(cfg, nodes)
    )
    return ClusterReport(nodes, facts, findings)


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------
def resolve(
    method: str | None, lag: int | None, config_name: str, overrides: Sequence[str], run_dir: str | None
) -> DictConfig:
    """A grid cell (``verl_sat.preflight.cli.resolve_cell``), or ``config_name`` composed with the
    overrides; ``sat.run_dir`` and ``trainer.default_local_dir`` as ``verl_sat.main`` sets them."""
    if method is not None and lag is not None:
        from verl_sat.preflight.cli import resolve_cell

        return resolve_cell(method, lag, overrides, run_dir=run_dir)
    from hydra import compose, initialize_config_dir

    from verl_sat.files import hydra_config_dir
    from verl_sat.trainer.recipe import SATRecipeConfig, apply_lag  # also registers sat_defaults

    extra = ([f"sat.run_dir={run_dir}"] if run_dir else []) + list(overrides)
    with initialize_config_dir(config_dir=str(hydra_config_dir()), version_base=None):
        cfg = compose(config_name=config_name, overrides=extra)
    apply_lag(cfg, SATRecipeConfig.from_node(cfg.get("sat")).lag)
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    if get(cfg, "sat.run_dir") and (
        not get(cfg, "trainer.default_local_dir") or "checkpoints/" in str(get(cfg, "trainer.default_local_dir"))
    ):
        OmegaConf.update(cfg, "trainer.default_local_dir", str(Path(str(cfg.sat.run_dir)) / "checkpoints"))
    return cfg


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m verl_sat.cluster.preflight",
        description="Check a Ray cluster against a run before launching it (docs/cluster.md).",
    )
    parser.add_argument("args", nargs="*", help="[<method> <lag>] then Hydra overrides (key=value)")
    parser.add_argument(
        "--address", default=None, help="the cluster (default: ray_kwargs.ray_init.address, RAY_ADDRESS, else auto)"
    )
    parser.add_argument("--config-name", default="sat_gspo_cpu", help="the config without <method> <lag>")
    parser.add_argument("--run-dir", default=None, help="the run directory (sat.run_dir) to check is shared")
    parser.add_argument("--json", action="store_true", help="print the nodes, their facts and findings as JSON")
    return parser


def split_cell(args: Sequence[str]) -> tuple[str | None, int | None, list[str]]:
    """``[method, lag, *overrides]`` or ``overrides``: a cell when the first two are not ``key=value``."""
    if len(args) >= 2 and "=" not in args[0] and "=" not in args[1]:
        return args[0], int(args[1]), list(args[2:])
    return None, None, list(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Resolve the run, connect to the cluster, check it; 0 when nothing fails, 1 otherwise."""
    import ray

    from verl_sat.cluster.paths import cluster_address
    from verl_sat.preflight.cli import split_hydra_flags

    argv = list(sys.argv[1:] if argv is None else argv)
    ours = [
        a
        for i, a in enumerate(argv)
        if a.split("=", 1)[0] in OWN_VALUE_FLAGS or (i > 0 and argv[i - 1] in OWN_VALUE_FLAGS)
    ]
    rest, hydra_flags = split_hydra_flags([a for a in argv if a not in ours])
    if hydra_flags:  # run.sh forwards the launch's arguments, Hydra's flags too
        print(f"[cluster-preflight] left to Hydra: {' '.join(hydra_flags)}", file=sys.stderr)
    args = _parser().parse_intermixed_args(ours + rest)
    method, lag, overrides = split_cell(args.args)
    cfg = resolve(method, lag, args.config_name, overrides, args.run_dir)
    address = args.address or cluster_address(cfg) or "auto"
    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    try:
        report = run_cluster_checks(cfg)
    finally:
        ray.shutdown()
    if args.json:
        print(
            json.dumps(
                {
                    "ok": report.ok,
                    "nodes": [{"node": n.name, "node_id": n.node_id, **report.facts[n]} for n in report.nodes],
                    "findings": [asdict(f) for f in report.findings],
                },
                indent=1,
                default=str,
            )
        )
    else:
        for node in report.nodes:
            facts = report.facts[node]
            print(
                f"[cluster-preflight] node {node.name}: {node.gpus} GPU slots, {node.cpus} CPUs, "
                f"{len(facts['gpus'])} GPUs seen by torch"
            )
        for finding in report.findings:
            print(finding.line().replace("[preflight]", "[cluster-preflight]", 1))
        fails = sum(f.level == "fail" for f in report.findings)
        verdict = "FAILED" if fails else "passed"
        print(
            f"[cluster-preflight] {verdict}: {fails} failure(s), {len(report.findings) - fails} warning(s) "
            f"over {len(report.nodes)} node(s)"
        )
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
