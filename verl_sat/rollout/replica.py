"""``HFReplica``: verl's ``RolloutReplica`` for the HF rollout server (one server actor per replica).

Hybrid replicas (sync, colocate_async, the hybrid part of separate_async) get their workers
from the trainer's worker group; standalone replicas (separate_async) get
``CheckpointEngineWorker`` actors from verl. In both cases the model runs in a separate
:class:`~verl_sat.rollout.server.HFRolloutServer` actor and the workers' ``HFServerAdapter``
forward weight updates to it.
"""

from __future__ import annotations

import ray
from verl.workers.rollout.replica import RolloutReplica

from verl_sat.rollout.server import HFRolloutServer, server_name


class HFReplica(RolloutReplica):
    """Rollout replica backed by one :class:`HFRolloutServer`."""

    async def launch_servers(self) -> None:
        """Start the server actor and set ``servers``, ``_server_handle`` and ``_server_address``."""
        name = server_name(self.replica_rank, self.name_suffix)
        server_cls = ray.remote(HFRolloutServer)
        server = server_cls.options(name=name, num_cpus=0, max_concurrency=self.max_concurrency).remote(
            config=self.config,
            model_config=self.model_config,
            replica_rank=self.replica_rank,
        )
        await server.ready.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = name
