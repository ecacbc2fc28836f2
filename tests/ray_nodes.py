"""A Ray cluster of several raylets on this machine, for the cluster tests (docs/cluster.md).

Each node is its own ``ray start --block`` process group, started here and stopped here by the
process-group ids it started (never ``ray stop``, which stops every Ray on the machine). A node
may run in a private mount namespace (``unshare -m``, root only) with an empty tmpfs over some
directories: what the driver writes there, that node cannot see, as a node without the shared
file system. ``env`` adds variables to one node's raylet (e.g. a ``PYTHONPATH`` that makes it
report another version of a package).
"""

from __future__ import annotations

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


@dataclass
class LocalCluster:
    """Raylets on this machine; ``address`` is the head's GCS (``host:port``)."""

    temp_dir: Path
    address: str = ""
    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

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
        # Nothing of verl-sat's environment: what the job's workers need must come through its runtime env.
        full_env = {k: v for k, v in os.environ.items() if not k.startswith(("VERL_", "RAY_ADDRESS"))}
        # A token left in ~/.ray by another cluster would switch token authentication on for this one.
        full_env.update({"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", **(env or {})})
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        log = self.temp_dir / f"{name}.log"  # removed with the temp dir
        self.logs.append(log)
        with log.open("w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
        self.procs.append(proc)

    def wait_for_nodes(self, count: int, timeout_s: float = 120) -> None:
        """Until ``count`` nodes are alive (a short-lived driver connection)."""
        import ray

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = [p for p in self.procs if p.poll() is not None]
            assert not dead, "a raylet exited:\n" + "\n".join(log.read_text()[-2000:] for log in self.logs)
            try:
                ray.init(address=self.address, log_to_driver=False, logging_level="ERROR")
                alive = sum(n["Alive"] for n in ray.nodes())
                ray.shutdown()
                if alive >= count:
                    return
            except Exception:  # noqa: BLE001 (the head is still starting)
                if ray.is_initialized():
                    ray.shutdown()
            time.sleep(1)
        raise TimeoutError(f"{count} Ray nodes not alive after {timeout_s}s")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL, to each process group this cluster started; nothing else."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
