"""Before training on a Ray cluster started beforehand (``ray start``, ``ray job submit``).

:func:`prepare_cluster` (one call in ``verl_sat.main.prepare``, a no-op without a cluster):

- drops the ``ray_kwargs.ray_init`` keys that only a cluster ``ray.init`` starts itself takes
  (``num_cpus``, ``num_gpus``, ...; Ray refuses them when it connects: the nodes declared their
  resources at ``ray start``);
- makes every relative local path the config names absolute (a worker's working directory is not
  the driver's);
- checks on every node, through a Ray task pinned to it, that each of those paths exists there and
  that the run directory is the driver's (a token the driver wrote is read back): a path only the
  driver's machine can see fails here, before training, with the key, the node and the path.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from verl_sat.default.assets import (
    LEGACY_REWARD_PATH_KEY,
    MODEL_PATH_KEY,
    REWARD_PATH_KEY,
    TRAIN_FILES_KEY,
    VAL_FILES_KEY,
    is_unset,
)
from verl_sat.trainer.launch import TOKENIZER_PATH_KEY

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
    TOKENIZER_PATH_KEY,
    REWARD_PATH_KEY,
    LEGACY_REWARD_PATH_KEY,
    "sat.run_dir",
    "trainer.default_local_dir",
)
TOKEN_FILE = ".cluster_token"


def cluster_address(cfg: DictConfig) -> str | None:
    """The cluster to join: ``ray_kwargs.ray_init.address``, else ``RAY_ADDRESS`` (which
    ``ray job submit`` sets for its entrypoint); None: verl starts a cluster of its own."""
    address = OmegaConf.select(cfg, f"{RAY_INIT}.address")
    return str(address) if address not in (None, "", "local") else os.environ.get("RAY_ADDRESS") or None


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


def local_paths(cfg: DictConfig) -> dict[str, list[str]]:
    """Key -> the local paths its value names (URLs and Hub ids that do not exist locally left out)."""
    out: dict[str, list[str]] = {}
    for key in PATH_KEYS:
        if is_unset(cfg, key):
            continue
        value = OmegaConf.select(cfg, key)
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


def seen_on_node(paths: dict[str, list[str]], token_file: str, token: str) -> dict[str, Any]:
    """Run on a node: the paths missing there (key -> paths) and whether ``token_file`` holds ``token``."""
    import socket

    missing = {key: [p for p in ps if not os.path.exists(p)] for key, ps in paths.items()}
    try:
        same = Path(token_file).read_text() == token
    except OSError:
        same = False
    return {"missing": {k: v for k, v in missing.items() if v}, "token": same, "hostname": socket.gethostname()}


def check_on_nodes(cfg: DictConfig, run_dir: Path) -> list[str]:
    """On every node of the connected cluster: the paths the config names, and the run directory
    (a token written here, read there). Returns one line per problem, naming key, node and path."""
    from verl_sat.cluster.nodes import on_each_node

    token_file = run_dir / TOKEN_FILE
    token = uuid.uuid4().hex
    token_file.write_text(token)
    try:
        seen = on_each_node(seen_on_node, local_paths(cfg), str(token_file), token)
    finally:
        token_file.unlink(missing_ok=True)
    problems = []
    for node, result in seen.items():
        for key, paths in result["missing"].items():
            problems += [f"{key}: {p} does not exist on node {node.name}" for p in paths]
        if not result["token"] and "sat.run_dir" not in result["missing"]:
            problems.append(
                f"sat.run_dir: {run_dir} on node {node.name} is not the driver's directory (a file written "
                "there by the driver was not found): put the run directory on a file system every node shares"
            )
    return problems


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
        problems = check_on_nodes(cfg, run_dir)
    finally:
        ray.shutdown()
    if problems:
        raise FileNotFoundError(
            "a path only the driver's machine can see (the workers run on every node):\n  " + "\n  ".join(problems)
        )
    return True
