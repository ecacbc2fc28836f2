"""Routing replay on verl's FSDP engine: record or replay each micro-batch's routes (docs/routing_replay.md).

verl replays routes only on Megatron and VeOmni; on FSDP its router replay is always disabled.
:class:`RoutingReplayFSDP` is mixed over verl's ``FSDPEngineWithLMHead`` by
``verl_sat.trainer.engines`` (one composed class, registered in verl's engine registry) and drives
the gate hooks of ``verl_sat.routing.gates`` from verl's own per-batch flag.

Per ``forward_backward_batch`` the action follows verl's worker flag ``enable_routing_replay``
(set by ``compute_log_prob`` / ``update_actor``, cleared by ``compute_ref_log_prob``) and the
engine's ``router_replay.mode``: R2 records in forward-only passes without routes and replays
otherwise; R3 always replays the micro-batch's ``routed_experts`` (nested ``[bs, seq, L, k]``,
aligned with ``input_ids``). In a recording pass the routes are returned as
``model_output["routed_experts"]``, as verl's VeOmni engine does. Ulysses sequence parallelism is
not supported.
"""

from __future__ import annotations

from typing import Any

import torch

from verl_sat.routing.gates import RouteCounts, RouteInput, RouterHooks, router_replay_mode, routes_per_sample


def fsdp_replay_mode(actor_config: Any) -> str:
    """``actor.fsdp_config.router_replay.mode`` of an FSDP actor, else ``disabled``."""
    if str(actor_config.get("strategy", "")) not in ("fsdp", "fsdp2"):
        return "disabled"
    return router_replay_mode(actor_config.get("fsdp_config"))


class RoutingReplayFSDP:
    """Mixed over ``FSDPEngineWithLMHead``: R2/R3 through forward hooks on the HF routers."""

    _rr_action = "off"
    _rr_hooks: RouterHooks | None = None
    _rr_mask: torch.Tensor | None = None
    _rr_announced: frozenset[str] = frozenset()  # actions already reported in the log

    def forward_backward_batch(self, data: Any, loss_function: Any, forward_only: bool = False) -> Any:
        from verl.utils import tensordict_utils as tu

        mode = router_replay_mode(self.engine_config)  # type: ignore[attr-defined]
        flagged = bool(tu.get_non_tensor_data(data, "enable_routing_replay", default=False))
        if mode != "disabled" and not forward_only and not flagged:
            # a training pass that routes on its own while R2/R3 is configured trains on other
            # experts than the log-probs it is scored against: refuse it instead of a silent dbar_pi
            raise RuntimeError(
                f"routing replay {mode}: a training pass arrived without verl's 'enable_routing_replay' "
                "flag, so it would route on its own; the worker must set enable_routing_replay "
                "(verl_sat.routing.prepare_worker, before verl's init_model)"
            )
        active = mode != "disabled" and flagged
        # R2 records in the forward-only pass that has no routes yet (compute_log_prob), as verl's
        # Megatron engine does; a forward-only pass over recorded routes (the step-scope scoring
        # pass, verl_sat.trainer.engines) replays them like the training pass it precedes
        record = mode == "R2" and forward_only and data.get("routed_experts", None) is None
        self._rr_action = ("record" if record else "replay") if active else "off"
        if self._rr_action != "off" and self._rr_action not in self._rr_announced:  # once per action
            self._rr_announced = self._rr_announced | {self._rr_action}
            what = "recording routes (forward only)" if self._rr_action == "record" else "replaying recorded routes"
            print(f"[verl-sat] routing replay {mode}: {what}", flush=True)
        if self._rr_hooks is not None:
            self._rr_hooks.counts = RouteCounts()
        try:
            output = super().forward_backward_batch(data, loss_function, forward_only)  # type: ignore[misc]
            if self._rr_action == "replay" and self._rr_hooks is not None and isinstance(output, dict):
                metrics = output.setdefault("metrics", {})
                metrics.update({k: [v] for k, v in self._rr_hooks.counts.metrics().items()})
            return output
        finally:
            self._rr_action = "off"
            if self._rr_hooks is not None:
                self._rr_hooks.off()

    def prepare_model_inputs(self, micro_batch: Any) -> Any:
        model_inputs, output_args = super().prepare_model_inputs(micro_batch)  # type: ignore[misc]
        if self._rr_action == "off":
            return model_inputs, output_args
        if self.use_ulysses_sp:  # type: ignore[attr-defined]
            raise NotImplementedError("routing replay on the FSDP engine does not support Ulysses SP")
        if self._rr_hooks is None:
            self._rr_hooks = RouterHooks(self.module).install()  # type: ignore[attr-defined]
        ids = model_inputs["input_ids"]
        mask = model_inputs.get("attention_mask")
        if mask is None:  # packed (remove-padding) input [1, nnz + pad]: pad is a suffix
            mask = torch.ones_like(ids)
            pad = int(output_args.get("pad_size", 0))
            if pad:
                mask[:, -pad:] = 0
        self._rr_mask = mask
        if self._rr_action == "record":
            self._rr_hooks.record()
            return model_inputs, output_args
        routed = micro_batch.get("routed_experts", None)
        if routed is None:
            raise RuntimeError(
                "routing replay: the micro-batch has no 'routed_experts' (R3: set "
                "rollout.enable_rollout_routing_replay=True; R2: compute_log_prob must run, bypass_mode=false)"
            )
        if model_inputs.get("attention_mask") is None:  # packed: one row holding all sequences
            values = routed.values() if routed.is_nested else routed.flatten(0, 1)
            routes: RouteInput = [values]
            mask = mask.clone()
            mask[:, values.shape[0] :] = 0
            self._rr_mask = mask
        else:
            routes = list(routed.unbind(0)) if routed.is_nested else routed
        self._rr_hooks.replay(routes, self._rr_mask)
        return model_inputs, output_args

    def prepare_model_outputs(self, output: Any, output_args: Any, micro_batch: Any, logits_processor_func: Any):
        model_output = super().prepare_model_outputs(output, output_args, micro_batch, logits_processor_func)  # type: ignore[misc]
        hooks = self._rr_hooks
        if self._rr_action == "record" and hooks is not None:
            rows = routes_per_sample(hooks.recorded(self._rr_mask.shape[0]), self._rr_mask)
            values = torch.cat(rows).to(torch.int16)
            offsets = micro_batch["input_ids"].offsets().to(values.device)
            model_output["routed_experts"] = torch.nested.nested_tensor_from_jagged(values, offsets)
        elif self._rr_action == "replay" and hooks is not None:
            moe_layers = sum(r is not None for r in hooks.routers)
            if hooks.replayed_layers != moe_layers:
                raise RuntimeError(f"routing replay: {hooks.replayed_layers} of {moe_layers} MoE layers replayed")
        return model_output
