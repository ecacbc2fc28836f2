"""A Ray cluster started beforehand (docs/cluster.md): its nodes, a function run on each of them,
and the paths every node must see.

Each call on a node is a Ray task pinned to it (``NodeAffinitySchedulingStrategy``, ``soft=False``)
reserving no CPU, so it runs beside a job that holds every slot; its function must be importable
there (verl-sat installed on every node, as every worker of the job needs it anyway). The
preflight runs ``verl_sat.preflight.facts.gather`` on each node this way.

:func:`prepare_cluster` (one call in ``verl_sat.main.prepare``, a no-op without a cluster) drops the
``ray_kwargs.ray_init`` keys only a local cluster takes, makes the config's local paths absolute,
and checks them on every node (``paths_on_nodes``, which the cluster preflight runs too): a path
only the driver's machine can see fails before training, with the key, the node and the path.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from verl_sat.default.assets import (
    LEGACY_REWARD_PATH_KEY,
    MODEL_PATH_KEY,
    REWARD_PATH_KEY,
    TRAIN_FILES_KEY,
    VAL_FILES_KEY,
)

# Ray's resource that only the head node holds.
HEAD_RESOURCE = "node:__internal_head__"
RAY_INIT = "ray_kwargs.ray_init"
# ray.init arguments that start a cluster; Ray refuses them (or ignores them) when it connects.
LOCAL_CLUSTER_KEYS = (
    "num_cpus",
    "num_gpus",
    "resources",
    "labels",
    "object_store_memory",
    "include_dashboard",
    "dashboard_host",
    "dashboard_port",
    "_temp_dir",
    "_system_config",
)
# Local paths every node must see: the data, the model and tokenizer, the reward function, the run
# and checkpoint directories (workers write metrics, checkpoints and pids there).
PATH_KEYS = (
    TRAIN_FILES_KEY,
    VAL_FILES_KEY,
    MODEL_PATH_KEY,
    "actor_rollout_ref.model.tokenizer_path",  # verl_sat.trainer.launch.TOKENIZER_PATH_KEY
    REWARD_PATH_KEY,
    LEGACY_REWARD_PATH_KEY,
    "sat.run_dir",
    "trainer.default_local_dir",
)
TOKEN_FILE = ".cluster_token"


# ---------------------------------------------------------------------------------------------
# nodes
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Node:
    """One alive Ray node: its id, IP, hostname and declared resources (``GPU``, ``CPU``, ...)."""

    node_id: str
    ip: str
    hostname: str
    resources: dict[str, float] = field(compare=False, hash=False)

    @property
    def is_head(self) -> bool:
        return HEAD_RESOURCE in self.resources

    @property
    def gpus(self) -> int:
        """Accelerator slots Ray schedules on (verl's bundles ask for ``GPU``, or ``NPU``)."""
        return int(self.resources.get("GPU", self.resources.get("NPU", 0)))

    @property
    def cpus(self) -> int:
        return int(self.resources.get("CPU", 0))

    @property
    def name(self) -> str:
        """How findings name the node: ``<id prefix> (<ip>, <hostname>[, head])``."""
        head = ", head" if self.is_head else ""
        return f"{self.node_id[:12]} ({self.ip}, {self.hostname}{head})"


def alive_nodes() -> list[Node]:
    """The connected cluster's alive nodes, head first, then by IP and id (``ray.nodes()``)."""
    import ray

    nodes = [
        Node(n["NodeID"], n["NodeManagerAddress"], n.get("NodeManagerHostname", ""), dict(n.get("Resources", {})))
        for n in ray.nodes()
        if n.get("Alive")
    ]
    return sorted(nodes, key=lambda n: (not n.is_head, n.ip, n.node_id))


def on_node(node: Node, fn: Callable[..., Any], *args: Any) -> Any:
    """An ``ObjectRef`` of ``fn(*args)`` run on ``node`` (no CPU reserved, never retried)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(fn)
    strategy = NodeAffinitySchedulingStrategy(node_id=node.node_id, soft=False)
    return task.options(scheduling_strategy=strategy).remote(*args)


def on_each_node(fn: Callable[..., Any], *args: Any, nodes: Sequence[Node] | None = None) -> dict[Node, Any]:
    """``fn(*args)`` on every node at once (``nodes``, default all alive ones): node -> result."""
    import ray

    nodes = list(nodes) if nodes is not None else alive_nodes()
    refs = [on_node(node, fn, *args) for node in nodes]
    return dict(zip(nodes, ray.get(refs), strict=True))


def cluster_address(cfg: DictConfig) -> str | None:
    """The cluster to join: ``ray_kwargs.ray_init.address``, else ``RAY_ADDRESS`` (which
    ``ray job submit`` sets for its entrypoint); None: verl starts a cluster of its own."""
    address = OmegaConf.select(cfg, f"{RAY_INIT}.address")
    return str(address) if address not in (None, "", "local") else os.environ.get("RAY_ADDRESS") or None


# ---------------------------------------------------------------------------------------------
# the paths every node must see
# ---------------------------------------------------------------------------------------------
def local_paths(cfg: DictConfig) -> dict[str, list[str]]:
    """Key -> the local paths its value names (URLs and Hub ids that do not exist locally left out)."""
    out: dict[str, list[str]] = {}
    for key in PATH_KEYS:
        value = OmegaConf.select(cfg, key, default=None)  # null, ??? or absent: unset
        if value is None:
            continue
        items = [str(v) for v in (value if isinstance(value, (list, tuple, ListConfig)) else [value])]
        paths = [p for p in items if "://" not in p and (Path(p).expanduser().exists() or key in ("sat.run_dir",))]
        if paths:
            out[key] = paths
    return out


def make_absolute(cfg: DictConfig) -> list[str]:
    """Rewrite relative local paths of ``PATH_KEYS`` as absolute ones; returns the keys changed."""
    changed = []
    with open_dict(cfg):
        for key, paths in local_paths(cfg).items():
            absolute = [str(Path(p).expanduser().absolute()) for p in paths]
            if absolute == paths:
                continue
            value = OmegaConf.select(cfg, key)
            is_list = isinstance(value, (list, tuple, ListConfig))
            OmegaConf.update(cfg, key, absolute if is_list else absolute[0], merge=False)
            changed.append(key)
    return changed


@dataclass(frozen=True)
class Unseen:
    """A path of ``key`` that ``node`` does not see: absent there, or (``missing`` false) a shared
    directory there that is not the driver's (the token the driver wrote into it is not found)."""

    key: str
    path: str
    node: Node
    missing: bool

    def line(self) -> str:
        if self.missing:
            return f"{self.key}: {self.path} does not exist on node {self.node.name}"
        return (
            f"{self.key}: {self.path} on node {self.node.name} is not the driver's directory (a file written "
            "there by the driver was not found): put the run and checkpoint directories on a file system every "
            "node mounts at the same path"
        )


def seen_on_node(paths: dict[str, list[str]], tokens: dict[str, str], token: str) -> dict[str, dict[str, list[str]]]:
    """Run on a node: key -> its paths missing there, then key -> [dir] for each shared directory
    whose token file (``tokens``: key -> file) does not hold ``token``."""
    missing = {key: [p for p in ps if not os.path.exists(p)] for key, ps in paths.items()}
    missing = {key: ps for key, ps in missing.items() if ps}
    unseen = {}
    for key, token_file in tokens.items():
        try:
            same = Path(token_file).read_text() == token
        except OSError:
            same = False
        if not same and key not in missing:
            unseen[key] = [str(Path(token_file).parent)]
    return {"missing": missing, "unseen": unseen}


def paths_on_nodes(cfg: DictConfig, shared: dict[str, Path], nodes: Sequence[Node] | None = None) -> list[Unseen]:
    """On every node of the connected cluster: each local path the config names exists, and each
    ``shared`` directory (key -> directory, created here) holds the token the driver wrote into it."""
    token = uuid.uuid4().hex
    tokens = {}
    for key, directory in shared.items():
        directory.mkdir(parents=True, exist_ok=True)
        tokens[key] = str(directory.absolute() / TOKEN_FILE)
        Path(tokens[key]).write_text(token)
    paths = {key: [str(Path(p).expanduser().absolute()) for p in ps] for key, ps in local_paths(cfg).items()}
    try:
        seen = on_each_node(seen_on_node, paths, tokens, token, nodes=nodes)
    finally:
        for token_file in tokens.values():
            Path(token_file).unlink(missing_ok=True)
    return [
        Unseen(key, path, node, kind == "missing")
        for node, result in seen.items()
        for kind in ("missing", "unseen")
        for key, found in result[kind].items()
        for path in found
    ]


def drop_local_cluster_keys(cfg: DictConfig) -> list[str]:
    """Remove ``LOCAL_CLUSTER_KEYS`` from ``ray_kwargs.ray_init``; returns the dotted keys removed."""
    node = OmegaConf.select(cfg, RAY_INIT)
    dropped = []
    if node is None:
        return dropped
    with open_dict(cfg):
        for key in LOCAL_CLUSTER_KEYS:
            if key in node and node[key] is not None:
                dropped.append(f"{RAY_INIT}.{key}={node[key]}")
                node.pop(key)
    return dropped


def prepare_cluster(cfg: DictConfig, run_dir: Path, log: Any = print) -> bool:
    """On a cluster started beforehand: drop the local-cluster ``ray.init`` keys, make the paths
    absolute and check them on every node (``FileNotFoundError`` naming key, node and path).
    Returns False, changing nothing, when verl starts its own cluster."""
    address = cluster_address(cfg)
    if address is None:
        return False
    dropped = drop_local_cluster_keys(cfg)
    if dropped:
        log(
            f"[verl-sat] joining the Ray cluster at {address}: the nodes declare their resources, so "
            f"{', '.join(dropped)} is not passed to ray.init"
        )
    changed = make_absolute(cfg)
    if changed:
        log(f"[verl-sat] made absolute for the workers: {', '.join(changed)}")
    import ray

    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    try:
        problems = paths_on_nodes(cfg, {"sat.run_dir": Path(run_dir)})
    finally:
        ray.shutdown()
    if problems:
        raise FileNotFoundError(
            "a path only the driver's machine can see (the workers run on every node):\n  "
            + "\n  ".join(p.line() for p in problems)
        )
    return True
