"""``ray_object_store``: a CPU checkpoint engine for verl's separate_async weight sync.

Every shipped verl checkpoint engine except ``naive`` needs CUDA/NPU collectives, and ``naive``
only works inside one process. This engine moves weights through the Ray object store: the
trainer's rank 0 puts one ``{name: tensor}`` dict per sync into the object store and hands the
reference to a small named broker actor; each rollout-side ``CheckpointEngineWorker`` fetches the
reference for the same ``global_steps`` and yields the tensors to its ``HFServerAdapter``.

Select with ``actor_rollout_ref.rollout.checkpoint_engine.backend=ray_object_store`` (and, to be
explicit, ``...checkpoint_engine.custom_backend_module=verl_sat.cpu.checkpoint_engine``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import ray
import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from verl_sat.rollout.weights import host_copies

BACKEND = "ray_object_store"
BROKER_NAME = "verl_sat_weight_broker"


class WeightBroker:
    """Named Ray actor holding the object ref of the latest published weights, by version."""

    def __init__(self) -> None:
        self._refs: dict[Any, list[ray.ObjectRef]] = {}

    def publish(self, version: Any, ref_box: list[ray.ObjectRef]) -> None:
        # Keep only the newest version: older ones are never asked for again.
        self._refs = {version: ref_box}

    def lookup(self, version: Any) -> list[ray.ObjectRef] | None:
        return self._refs.get(version)


_broker_handle: Any = None


def _broker() -> Any:
    """Get or create the broker actor (one per Ray namespace); the handle is cached per process.

    Creating (or even re-declaring) the actor costs a Ray round trip and, the first time, a worker
    process start; caching keeps every later sync at one ``publish``/``lookup`` call.
    """
    global _broker_handle
    if _broker_handle is None:
        _broker_handle = ray.remote(WeightBroker).options(name=BROKER_NAME, get_if_exists=True, num_cpus=0).remote()
    return _broker_handle


@CheckpointEngineRegistry.register(BACKEND)
class RayObjectStoreCheckpointEngine(CheckpointEngine):
    """Weight transfer through the Ray object store (CPU, any number of rollout workers)."""

    def __init__(self, bucket_size: int = 0, is_master: bool = False, poll_interval_s: float = 0.05, **kwargs: Any):
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.poll_interval_s = poll_interval_s

    def prepare(self) -> dict[str, Any]:
        _broker()  # start the broker before the first transfer
        return {}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        return None

    def finalize(self) -> None:
        return None

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict:
        """Drain the stream on every rank (FSDP gathers are collective); rank 0 publishes it."""
        named = await host_copies(weights)
        if self.is_master:
            ref = ray.put(named)
            await _broker().publish.remote(global_steps, [ref])
        return {}

    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Wait for the weights of ``global_steps`` and yield them."""
        broker = _broker()
        while (box := await broker.lookup.remote(global_steps)) is None:
            await asyncio.sleep(self.poll_interval_s)
        named = await box[0]
        for name, tensor in named.items():
            yield name, tensor
