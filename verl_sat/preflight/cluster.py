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
It also refuses a layout whose pools the nodes cannot hold (:func:`layout_refusal`, the preflight's
``cluster_layout`` placement) before training, and :class:`PlacementWatch` stops a job whose
placement group Ray has not placed within ``VERL_SAT_PLACEMENT_TIMEOUT_S``.

Ray 2.60's token authentication: :func:`connect` joins as Ray does for ``address="auto"`` (token
mode on when a token exists and ``RAY_AUTH_MODE`` is unset; Ray does not for an explicit address),
and a connection the cluster refuses for authentication ends the launch with one line.
"""

from __future__ import annotations

import functools
import os
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from verl_sat.default.assets import (
    LEGACY_REWARD_PATH_KEY,
    MODEL_PATH_KEY,
    REWARD_PATH_KEY,
    TRAIN_FILES_KEY,
    VAL_FILES_KEY,
)
from verl_sat.processes import Watchdog

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
# Ray 2.60's token authentication: the mode, the token (or its file) and the default file, which
# `ray start --head`, `ray get-auth-token --generate` and a local ray.init() write.
AUTH_MODE_ENV = "RAY_AUTH_MODE"
AUTH_TOKEN_ENV = "RAY_AUTH_TOKEN"
AUTH_TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
# What Ray says when the cluster refuses a connection for authentication (its AuthenticationError,
# or the gRPC status under the ConnectionError it raises after retrying).
AUTH_REFUSED = ("AuthenticationError", "InvalidAuthToken", "Unauthenticated")
# A placement group of this job still pending after this long stops the job (0: no limit).
PLACEMENT_TIMEOUT_ENV = "VERL_SAT_PLACEMENT_TIMEOUT_S"
PLACEMENT_TIMEOUT_S = 300.0
EXIT_NOT_PLACED = 5


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


def on_each_node(fn: Callable[..., Any], *args: Any, nodes: Sequence[Node]) -> dict[Node, Any]:
    """``fn(*args)`` on every node of ``nodes`` at once (``alive_nodes``), each a task pinned to
    its node (no CPU reserved, never retried): node -> result."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(fn)
    pinned = [NodeAffinitySchedulingStrategy(node_id=node.node_id, soft=False) for node in nodes]
    refs = [task.options(scheduling_strategy=strategy).remote(*args) for strategy in pinned]
    return dict(zip(nodes, ray.get(refs), strict=True))


def cluster_address(cfg: DictConfig) -> str | None:
    """The cluster to join: ``ray_kwargs.ray_init.address``, else ``RAY_ADDRESS`` (which
    ``ray job submit`` sets for its entrypoint); None: verl starts a cluster of its own."""
    address = OmegaConf.select(cfg, f"{RAY_INIT}.address")
    return str(address) if address not in (None, "", "local") else os.environ.get("RAY_ADDRESS") or None


# ---------------------------------------------------------------------------------------------
# joining: Ray's token authentication
# ---------------------------------------------------------------------------------------------
def token_source() -> str:
    """Where Ray reads the cluster's token: ``RAY_AUTH_TOKEN``, else the file ``RAY_AUTH_TOKEN_PATH``,
    else ``~/.ray/auth_token`` (Ray's ``AuthenticationTokenLoader`` order)."""
    if os.environ.get(AUTH_TOKEN_ENV):
        return f"${AUTH_TOKEN_ENV}"
    return os.environ.get(AUTH_TOKEN_PATH_ENV) or str(Path.home() / ".ray" / "auth_token")


def join_with_token(log: Any = print) -> bool:
    """Token mode on for joining a cluster by its address, as Ray does only for ``address="auto"``:
    when ``RAY_AUTH_MODE`` is unset and a token exists (a mode the user set is kept). True if on."""
    if os.environ.get(AUTH_MODE_ENV) is not None:
        return os.environ[AUTH_MODE_ENV].lower() == "token"
    from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available

    enabled = maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    if enabled:
        log(f"[verl-sat] joining with Ray's token authentication ({AUTH_MODE_ENV}=token, token: {token_source()})")
    return enabled


def refused_for_auth(exc: BaseException) -> bool:
    """``exc`` (or an exception it was raised from) is the cluster refusing this process's token."""
    seen: BaseException | None = exc
    while seen is not None:
        if any(name in f"{type(seen).__name__}: {seen}" for name in AUTH_REFUSED):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def auth_refusal(address: str, user_mode: str | None) -> str:
    """The line that ends a launch the cluster refused for authentication."""
    source = token_source()
    has = source.startswith("$") or Path(source).is_file()
    mode = f"{AUTH_MODE_ENV}={user_mode} (yours)" if user_mode is not None else f"{AUTH_MODE_ENV} unset"
    token = f"the token in {source} is not the cluster's" if has else f"no token at {source}"
    return (
        f"[verl-sat] error: the Ray cluster at {address} refused this job for authentication ({mode}, {token}): "
        f"export {AUTH_MODE_ENV}=token and put the head's token (`ray get-auth-token` there) at {source} "
        f"(or name its file in {AUTH_TOKEN_PATH_ENV}); docs/cluster.md"
    )


to_stderr = functools.partial(print, file=sys.stderr, flush=True)


def connect(address: str, log: Any = to_stderr) -> None:
    """``ray.init(address=...)`` with Ray's token authentication as ``join_with_token`` sets it; a
    refusal for authentication raises ``SystemExit`` with :func:`auth_refusal`'s line. ``log``: where
    the line saying token mode was turned on goes (stderr by default: the preflight's ``--json`` is stdout)."""
    import ray

    user_mode = os.environ.get(AUTH_MODE_ENV)
    join_with_token(log)
    try:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    except Exception as exc:
        if refused_for_auth(exc):
            raise SystemExit(auth_refusal(address, user_mode)) from None
        raise


# ---------------------------------------------------------------------------------------------
# the pools: do they fit, are they placed
# ---------------------------------------------------------------------------------------------
def largest(nodes: Sequence[Node]) -> Node:
    """The node with the most accelerator slots, then CPUs."""
    return max(nodes, key=lambda n: (n.gpus, n.cpus))


def layout_refusal(cfg: DictConfig, nodes: Sequence[Node]) -> str | None:
    """Why the nodes cannot hold the layout's pools, placed by ``fits`` on ``estimates.pool_bundles``
    (the preflight's ``cluster_layout`` finding, and the job's refusal); None if they fit."""
    from verl_sat.preflight.estimates import pool_bundles

    groups = pool_bundles(cfg)
    if not nodes or fits(groups, nodes):
        return None
    big = largest(nodes)
    pools = Counter(groups)
    asked = ", ".join(f"pool {pool}: {k} group(s) of {g} GPU + {c} CPU" for (pool, g, c), k in pools.items())
    over = [f"pool {pool}'s {g} GPU + {c} CPU" for pool, g, c in pools if g > big.gpus or c > big.cpus]
    why = f"{' and '.join(over)} exceed(s) every node" if over else f"together they exceed the {len(nodes)} node(s)"
    return (
        "verl's pools do not fit this Ray cluster, so its placement would wait forever: "
        f"{asked}, each group on one node; the largest node, {big.name}, has {big.gpus} GPU + {big.cpus} CPU: {why}. "
        "Change trainer.nnodes / trainer.n_gpus_per_node / actor_rollout_ref.rollout.nnodes / "
        "actor_rollout_ref.rollout.n_gpus_per_node, or start the nodes with more --num-gpus / --num-cpus"
    )


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


def fits(groups: Sequence[tuple[str, int, int]], nodes: Sequence[Node]) -> bool:
    """First-fit decreasing of the groups on the nodes' GPU and CPU slots (each group on one node,
    as verl's placement groups are); True when every group finds a node."""
    free = {node: [node.gpus, node.cpus] for node in nodes}
    for _, gpus, cpus in sorted(groups, key=lambda group: -group[1]):
        target = next((n for n in nodes if free[n][0] >= gpus and free[n][1] >= cpus), None)
        if target is None:
            return False
        free[target][0] -= gpus
        free[target][1] -= cpus
    return True


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


def paths_on_nodes(cfg: DictConfig, shared: dict[str, Path], nodes: Sequence[Node]) -> list[Unseen]:
    """On every node of ``nodes`` (the connected cluster's): each local path the config names exists, and each
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
    absolute, join (:func:`connect`), refuse a layout the nodes cannot hold (``SystemExit`` with
    :func:`layout_refusal`'s line) and check the paths on every node (``FileNotFoundError`` naming
    key, node and path). Returns False, changing nothing, when verl starts its own cluster."""
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

    connect(address, log)
    try:
        nodes = alive_nodes()
        refusal = layout_refusal(cfg, nodes)
        problems = [] if refusal else paths_on_nodes(cfg, {"sat.run_dir": Path(run_dir)}, nodes)
    finally:
        ray.shutdown()
    if refusal:
        raise SystemExit(f"[verl-sat] error: {refusal}")
    if problems:
        raise FileNotFoundError(
            "a path only the driver's machine can see (the workers run on every node):\n  "
            + "\n  ".join(p.line() for p in problems)
        )
    return True


# ---------------------------------------------------------------------------------------------
# a placement that never comes
# ---------------------------------------------------------------------------------------------
def placement_timeout_s() -> float:
    """``VERL_SAT_PLACEMENT_TIMEOUT_S`` (seconds; 0: no limit), else ``PLACEMENT_TIMEOUT_S``."""
    raw = os.environ.get(PLACEMENT_TIMEOUT_ENV, "")
    try:
        value = float(raw) if raw else PLACEMENT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{PLACEMENT_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if value < 0:
        raise ValueError(f"{PLACEMENT_TIMEOUT_ENV}={raw!r} must be >= 0 (0: no limit)")
    return value


def pending_groups() -> dict[str, dict[str, Any]]:
    """This job's placement groups Ray has not placed (``PENDING``), by id, from the GCS's table
    (``ray.util.placement_group_table``; a group's id ends with its creator job's id)."""
    import ray
    from ray.util import placement_group_table

    job = ray.get_runtime_context().get_job_id()
    return {
        pg_id: info
        for pg_id, info in placement_group_table().items()
        if pg_id.endswith(job) and info.get("state") == "PENDING"
    }


def not_placed_line(info: dict[str, Any], waited_s: float, nodes: Sequence[Node]) -> str:
    """The line that stops a job whose placement group ``info`` has waited ``waited_s``."""
    name = str(info.get("name", ""))
    pool = name.split("verl_group_")[0] or name or info.get("placement_group_id", "?")
    bundles = list((info.get("bundles") or {}).values())
    shape = ", ".join(f"{k} {v:g}" for k, v in sorted((bundles[0] if bundles else {}).items()))
    state = (info.get("stats") or {}).get("scheduling_state", "?")
    top = largest(nodes) if nodes else None
    big = f"the largest node, {top.name}, has {top.gpus} GPU + {top.cpus} CPU" if top else "no alive node"
    return (
        f"[verl-sat] error: verl's placement group {name} (pool {pool}: {len(bundles)} bundle(s) of {{{shape}}}, "
        f"{info.get('strategy', '')}) not placed after {waited_s:.0f} s (Ray: {state}); {big}: the nodes are too "
        f"small for the pool or another job holds their slots; the job stops (exit {EXIT_NOT_PLACED}). "
        f"{PLACEMENT_TIMEOUT_ENV}=<seconds> waits longer (0: no limit)"
    )


class PlacementWatch(Watchdog):
    """Stops the job when one of its placement groups stays pending past ``timeout_s``: verl waits
    on ``pg.ready()`` without a limit (``RayResourcePool.get_placement_groups``), inside its task
    runner, so the driver polls Ray's placement-group table every ``interval`` seconds, prints one
    line, interrupts itself and exits ``EXIT_NOT_PLACED`` (forced ``verl_sat.processes.GRACE_S`` later if it hangs)."""

    exit_code = EXIT_NOT_PLACED

    def __init__(self, timeout_s: float | None = None, interval: float = 2.0, out: TextIO | None = None) -> None:
        super().__init__("verl-sat-placement", interval, out)
        self.timeout_s = placement_timeout_s() if timeout_s is None else float(timeout_s)
        self.first_seen: dict[str, float] = {}

    def enabled(self) -> bool:
        return self.timeout_s > 0

    def report(self, failure: str) -> None:
        self.failure = failure
        print(failure, file=self.out or sys.stdout, flush=True)

    def check(self) -> str | None:
        """The line for the first of this job's groups pending past the timeout, else None."""
        import ray

        if not ray.is_initialized():
            return None
        try:
            pending = pending_groups()
        except Exception:  # Ray starting or shutting down under us
            return None
        now = time.monotonic()
        self.first_seen = {pg: self.first_seen.get(pg, now) for pg in pending}
        late = [pg for pg, since in self.first_seen.items() if now - since >= self.timeout_s]
        if not late:
            return None
        return not_placed_line(pending[late[0]], now - self.first_seen[late[0]], alive_nodes())
