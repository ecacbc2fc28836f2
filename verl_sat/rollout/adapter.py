"""``HFServerAdapter``: verl's trainer/checkpoint-engine side ``BaseRollout`` for the HF rollout.

It lives in each hybrid trainer worker (``ActorRolloutRefWorker``) and in each standalone
``CheckpointEngineWorker``. ``update_weights`` drains verl's ``(name, tensor)`` stream on every
rank (FSDP gathers are collective) and the replica's leader rank ships the tensors to its
server actor with the weight version (``global_steps``).
"""

from __future__ import annotations

import os
from typing import Any

import ray
from verl.workers.rollout.base import BaseRollout

from verl_sat.rollout.server import server_name
from verl_sat.rollout.weights import host_copies


class HFServerAdapter(BaseRollout):
    """Forwards weight updates and memory calls to the replica's :class:`HFRolloutServer`."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1, **kwargs: Any):
        super().__init__(config, model_config, device_mesh)
        world_size = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        rank = int(os.environ.get("RANK", 0))
        self.replica_rank = rank // world_size if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % world_size
        self._server: Any = None

    @property
    def is_leader_rank(self) -> bool:
        return self.rollout_rank == 0

    def _server_actor(self) -> Any:
        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]) -> None:
        """Weights and KV cache stay resident on CPU (see ``HFRolloutServer.wake_up``)."""
        if self.is_leader_rank:
            await self._server_actor().wake_up.remote()

    async def release(self) -> None:
        if self.is_leader_rank:
            await self._server_actor().sleep.remote()

    async def update_weights(
        self, weights: Any, global_steps: int | None = None, wire_format: str = "named_tensors", **kwargs: Any
    ) -> None:
        """Collect the full ``(name, tensor)`` stream and send it to the server (leader rank only)."""
        if wire_format != "named_tensors":
            raise NotImplementedError(f"HF rollout supports wire_format='named_tensors' only, got {wire_format!r}")
        named = await host_copies(weights)
        if self.is_leader_rank:
            await self._server_actor().update_weights.remote(named, global_steps)
