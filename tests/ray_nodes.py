"""A Ray cluster of several raylets on this machine, for the cluster tests (docs/cluster.md).

Each node is its own ``ray start --block`` process group, started here and stopped here by the
process-group ids it started (never ``ray stop``, which stops every Ray on the machine). A node
may run in a private mount namespace (``unshare -m``, root only) with an empty tmpfs over some
directories: what the driver writes there, that node cannot see, as a node without the shared
file system. ``env`` adds variables to one node's raylet (e.g. a ``PYTHONPATH`` that makes it
report another version of a package).

Authentication as Ray 2.60 sets it by default (``auth=True``, docs/cluster.md "Start a cluster"):
a token made by ``ray get-auth-token --generate``, then the head started without ``RAY_AUTH_MODE``
(Ray turns token mode on because a token exists) and every other node with ``RAY_AUTH_MODE=token``.
The token is this cluster's own: generated under a temporary HOME and named to every process by
``RAY_AUTH_TOKEN_PATH``, so nothing under the user's ``~/.ray`` is read or written. Drivers
(:meth:`LocalCluster.driver_env`, :meth:`LocalCluster.run_driver`) run as subprocesses, so the test
process itself never switches Ray's authentication mode.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_cli() -> str:
    return str(Path(sys.executable).with_name("ray"))


def clean_env() -> dict[str, str]:
    """This process's environment without verl-sat's (what the job's workers need must come through
    its runtime env) nor Ray's address and authentication."""
    drop = ("VERL_", "RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)} | {"RAY_USAGE_STATS_ENABLED": "0"}


# A driver that waits until `count` nodes are alive, then prints them as JSON (head first).
NODES = """
import json, sys, time, ray
address, count, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + timeout
while True:
    try:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR")
        nodes = [n for n in ray.nodes() if n["Alive"]]
        ray.shutdown()
        if len(nodes) >= count:
            nodes.sort(key=lambda n: "node:__internal_head__" not in n["Resources"])
            print(json.dumps([{"id": n["NodeID"], "resources": n["Resources"]} for n in nodes]))
            break
    except Exception as exc:  # the head still starting
        if ray.is_initialized():
            ray.shutdown()
        if time.monotonic() > deadline:
            raise SystemExit(f"{count} nodes not alive after {timeout}s: {exc}")
    if time.monotonic() > deadline:
        raise SystemExit(f"{count} nodes not alive after {timeout}s")
    time.sleep(1)
"""


@dataclass
class LocalCluster:
    """Raylets on this machine; ``address`` is the head's GCS (``host:port``); ``auth``: Ray's
    default token authentication (module docstring), else every node with ``RAY_AUTH_MODE=disabled``."""

    temp_dir: Path
    auth: bool = True
    address: str = ""
    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    @property
    def token_path(self) -> Path:
        """The cluster's token, as ``ray get-auth-token --generate`` wrote it under the temporary HOME."""
        return self.temp_dir / "home" / ".ray" / "auth_token"

    def make_token(self) -> None:
        """The head's token (Ray's own CLI, under the temporary HOME), once."""
        if self.token_path.is_file():
            return
        env = {**clean_env(), "HOME": str(self.token_path.parents[1])}
        subprocess.run(
            [ray_cli(), "get-auth-token", "--generate"], env=env, check=True, capture_output=True, timeout=120
        )
        assert self.token_path.is_file(), f"ray get-auth-token --generate wrote no {self.token_path}"

    def driver_env(self, **extra: str) -> dict[str, str]:
        """A driver's environment: the token's file named (``RAY_AUTH_TOKEN_PATH``), ``RAY_AUTH_MODE``
        unset as a user leaves it (``extra`` adds or, with "", removes variables)."""
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_ADDRESS")}
        if self.auth:
            env["RAY_AUTH_TOKEN_PATH"] = str(self.token_path)
        env.update(extra)
        return {k: v for k, v in env.items() if v != ""}

    def run_driver(self, code: str, *args: str, timeout_s: float = 300) -> str:
        """``python -c code args...`` as a driver of this cluster (``RAY_AUTH_MODE=token`` exported, as
        docs/cluster.md says); its stdout. A raylet of the cluster that exits meanwhile fails here."""
        env = self.driver_env(**({"RAY_AUTH_MODE": "token"} if self.auth else {}))
        with subprocess.Popen(
            [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        ) as proc:
            deadline = time.monotonic() + timeout_s
            while proc.poll() is None and time.monotonic() < deadline:
                dead = [p for p in self.procs if p.poll() is not None]
                if dead:
                    proc.kill()
                    raise AssertionError("a raylet exited:\n" + "\n".join(log.read_text()[-2000:] for log in self.logs))
                time.sleep(0.5)
            if proc.poll() is None:
                proc.kill()
            out, err = proc.communicate()
        assert proc.returncode == 0, out[-2000:] + err[-3000:]
        return out

    def nodes(self, count: int = 1, timeout_s: float = 120) -> list[dict]:
        """The alive nodes (head first: ``id``, ``resources``), once ``count`` are alive."""
        return json.loads(self.run_driver(NODES, self.address, str(count), str(timeout_s), timeout_s=timeout_s + 60))

    def start_head(
        self, num_cpus: int, num_gpus: int, env: dict[str, str] | None = None, dashboard: bool = False
    ) -> None:
        """The head; ``dashboard``: with Ray's dashboard, which serves the state API (``ray.util.state``)."""
        port = free_port()
        self.address = f"127.0.0.1:{port}"
        board = ["--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={free_port()}"]
        self._start(
            "head",
            [
                "--head",
                f"--port={port}",
                "--node-ip-address=127.0.0.1",
                f"--ray-client-server-port={free_port()}",
                *(board if dashboard else ["--include-dashboard=false"]),
                f"--temp-dir={self.temp_dir}",
            ],
            num_cpus,
            num_gpus,
            env,
        )

    def add_node(
        self, num_cpus: int, num_gpus: int, env: dict[str, str] | None = None, hide: tuple[Path, ...] = ()
    ) -> None:
        """A worker node; ``hide``: directories this node sees as empty (a tmpfs of its own over each)."""
        self._start(
            f"node{len(self.procs)}",
            [f"--address={self.address}", "--node-ip-address=127.0.0.1"],
            num_cpus,
            num_gpus,
            env,
            hide,
        )

    def _start(
        self,
        name: str,
        args: list[str],
        num_cpus: int,
        num_gpus: int,
        env: dict[str, str] | None,
        hide: tuple[Path, ...] = (),
    ) -> None:
        cmd = [
            ray_cli(),
            "start",
            *args,
            f"--num-cpus={num_cpus}",
            f"--num-gpus={num_gpus}",
            "--object-store-memory=200000000",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            "--disable-usage-stats",
            "--block",
        ]
        if hide:
            mounts = " && ".join(f"mount -t tmpfs none '{d}'" for d in hide)
            cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", f'{mounts} && exec "$@"', "sh", *cmd]
        full_env = clean_env()
        if not self.auth:  # a token left in ~/.ray by another cluster would switch token authentication on
            full_env["RAY_AUTH_MODE"] = "disabled"
        else:  # the head as `ray start --head` runs by default; the others as docs/cluster.md starts them
            self.make_token()
            full_env["RAY_AUTH_TOKEN_PATH"] = str(self.token_path)
            if name != "head":
                full_env["RAY_AUTH_MODE"] = "token"
        full_env.update(env or {})
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        log = self.temp_dir / f"{name}.log"  # removed with the temp dir
        self.logs.append(log)
        with log.open("w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
        self.procs.append(proc)

    def wait_for_nodes(self, count: int, timeout_s: float = 120) -> None:
        """Until ``count`` nodes are alive (a driver subprocess)."""
        self.nodes(count, timeout_s)

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then after ``grace_s`` SIGKILL, to each process group this cluster started; nothing
        else. (A `ray start --block` node often outlasts any grace: CI waited 30 s on one.)"""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
