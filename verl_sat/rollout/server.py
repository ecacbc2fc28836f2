"""The HF rollout server: a Ray actor with verl's token-in/token-out rollout-server interface.

Concurrent ``generate`` calls are queued; a single serving task waits ``batch_wait_ms`` for more
to arrive, then decodes everything pending as one padded batch (:class:`HFEngine`) in a worker
thread, so control calls (abort, weight updates) stay responsive. Every output carries
``extra_fields["global_steps"]``: the weight version that generated it (a batch never spans a
weight update, because updates wait for the running batch and aborts stop it first).

``abort_all_requests`` stops the running batch after its current step, answers it and all
queued requests with their partial tokens (``stop_reason="aborted"``) and holds new requests
until ``resume_generation`` (or fails them at once with ``reject_request=True``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections import deque
from dataclasses import dataclass, fields
from typing import Any

from verl_sat.rollout.engine import EngineOptions, GenerationRequest, GenerationResult, HFEngine, logit_noise_for
from verl_sat.rollout.sampling import SamplingParams

logger = logging.getLogger(__name__)

ENV_PREFIX = "VERL_SAT_ROLLOUT_"


def server_name(replica_rank: int, suffix: str = "") -> str:
    """Ray actor name of the server of replica ``replica_rank``."""
    return f"verl_sat_hf_server_{replica_rank}{suffix}"


def engine_options(config: Any, replica_rank: int) -> EngineOptions:
    """``EngineOptions`` from ``rollout.engine_kwargs.hf`` overridden by ``VERL_SAT_ROLLOUT_<KEY>`` env vars."""
    engine_kwargs = getattr(config, "engine_kwargs", None) or {}
    hf_kwargs = dict(engine_kwargs.get("hf", None) or {})
    values: dict[str, Any] = {"seed": int(getattr(config, "seed", 0)) + 1000 * replica_rank}
    for f in fields(EngineOptions):
        raw = os.environ.get(ENV_PREFIX + f.name.upper(), hf_kwargs.get(f.name))
        if raw is not None:
            values[f.name] = type(EngineOptions.__dataclass_fields__[f.name].default)(raw)
    return EngineOptions(**values)


def _model_path(model_config: Any) -> str:
    """Local model dir from an ``HFModelConfig`` or its raw DictConfig."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import HFModelConfig

    return omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig).local_path


@dataclass
class _Pending:
    request: GenerationRequest
    future: asyncio.Future


class HFRolloutServer:
    """Rollout server actor (see module docstring). Created by ``HFReplica.launch_servers``."""

    def __init__(self, config: Any, model_config: Any, replica_rank: int) -> None:
        import torch

        self.config = config
        self.replica_rank = replica_rank
        self.options = engine_options(config, replica_rank)
        torch.set_num_threads(self.options.num_threads)
        self.engine = HFEngine.from_pretrained(_model_path(model_config), self.options)
        # routing replay R3: return SGLang-style routed_experts with every output
        self.engine.record_routes = bool(getattr(config, "enable_rollout_routing_replay", False))
        self.global_steps: int | None = None
        self._pending: list[_Pending] = []
        self._abort = threading.Event()
        self._rejecting = False
        self._started = False
        self.batch_sizes: deque[int] = deque(maxlen=1024)  # sizes of recent decode batches
        from verl_sat.processes import register

        register("rollout replica", str(replica_rank))  # the driver's supervisor watches this pid

    def _ensure_started(self) -> None:
        """Create loop-bound state and the serving task on first use (inside the actor's loop)."""
        if self._started:
            return
        self._started = True
        self._has_work = asyncio.Event()
        self._gate = asyncio.Event()
        self._gate.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._serve_task = asyncio.get_running_loop().create_task(self._serve())

    async def ready(self) -> bool:
        self._ensure_started()
        return True

    # ------------------------------------------------------------------ generation
    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Any = None,
        video_data: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Queue one request; resolves when its batch finishes or is aborted."""
        from verl.workers.rollout.replica import TokenOutput

        self._ensure_started()
        if self._rejecting:
            return self._token_output(GenerationResult(stop_reason="aborted"), self.global_steps, True)
        await self._gate.wait()
        params = SamplingParams.from_request(sampling_params)
        prompt_ids = [int(t) for t in prompt_ids]
        request = GenerationRequest(prompt_ids, params, self._budget(len(prompt_ids), params))
        future = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(request, future))
        self._has_work.set()
        result, version = await future
        output: TokenOutput = self._token_output(result, version, params.logprobs)
        return output

    def _budget(self, prompt_len: int, params: SamplingParams) -> int:
        """Max new tokens: the request's, else response_length, capped by the context length."""
        config = self.config
        default = min(config.response_length, config.prompt_length + config.response_length - prompt_len)
        budget = params.max_tokens if params.max_tokens is not None else default
        max_model_len = config.max_model_len or (config.prompt_length + config.response_length)
        return max(0, min(budget, max_model_len - prompt_len))

    @staticmethod
    def _token_output(result: GenerationResult, version: int | None, with_log_probs: bool) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        return TokenOutput(
            token_ids=result.token_ids,
            log_probs=result.log_probs if with_log_probs else None,
            routed_experts=result.routed_experts,
            stop_reason=result.stop_reason,
            extra_fields={"global_steps": version},
        )

    async def _serve(self) -> None:
        """Serving loop: collect for ``batch_wait_ms``, then decode all pending requests together."""
        while True:
            await self._has_work.wait()
            await asyncio.sleep(self.options.batch_wait_ms / 1000.0)
            batch, self._pending = self._pending, []
            self._has_work.clear()
            if not batch:
                continue
            self._idle.clear()
            self.batch_sizes.append(len(batch))
            version = self.global_steps
            self.engine.logit_noise_std = logit_noise_for(self.options, version)
            try:
                results = await asyncio.to_thread(
                    self.engine.generate_batch, [p.request for p in batch], self._abort.is_set
                )
            except Exception as exc:  # surface engine errors to every caller of the batch
                logger.exception("HF rollout batch failed")
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(exc)
            else:
                for p, result in zip(batch, results, strict=True):
                    if not p.future.done():
                        p.future.set_result((result, version))
            finally:
                self._idle.set()

    # ------------------------------------------------------------------ partial rollout
    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> None:
        """Stop the running batch, answer every request with its partial tokens, hold new ones."""
        self._ensure_started()
        self._gate.clear()
        self._rejecting = reject_request
        self._abort.set()
        queued, self._pending = self._pending, []
        for p in queued:
            if not p.future.done():
                p.future.set_result((GenerationResult(stop_reason="aborted"), self.global_steps))
        await self._idle.wait()
        self._abort.clear()

    async def resume_generation(self) -> None:
        """Reopen the gate closed by ``abort_all_requests``."""
        self._ensure_started()
        self._rejecting = False
        self._gate.set()

    # ------------------------------------------------------------------ weights and memory
    async def update_weights(self, named_tensors: dict[str, Any], global_steps: int | None = None) -> None:
        """Load new weights once the running batch (if any) has finished, then tag their version."""
        self._ensure_started()
        await self._idle.wait()
        self.engine.load_weights(named_tensors)
        if global_steps is not None:
            self.global_steps = global_steps

    async def wake_up(self) -> None:
        """Nothing to restore on CPU: weights stay resident, the KV cache lives per batch."""

    async def sleep(self) -> None:
        """Nothing to free on CPU (see ``wake_up``)."""

    async def clear_kv_cache(self) -> None:
        """The KV cache is built per batch; nothing persists between batches."""

    async def release_kv_cache(self) -> None:
        """See ``clear_kv_cache``."""

    async def resume_kv_cache(self) -> None:
        """See ``clear_kv_cache``."""

    async def start_profile(self, **kwargs: Any) -> None:
        """Profiling is not supported by the HF rollout."""

    async def stop_profile(self) -> None:
        """Profiling is not supported by the HF rollout."""
