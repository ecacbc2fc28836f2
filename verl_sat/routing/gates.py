"""Routing replay for Hugging Face MoE models: record the top-k experts, replay them later (docs/routing_replay.md).

R3 ("Rollout Routing Replay", arXiv 2510.11370) records, in the rollout, the experts each token
was routed to in each MoE layer, and makes the trainer's forward use exactly those experts. R2
replays the trainer's own routing recorded at old-log-prob time. Both go through the router
contract of transformers 5.x MoE models (the *gate contract*):

    router_logits, router_scores, router_indices = layer.<moe block>.gate(h)   # [T,E], [T,k], [T,k]
    y = layer.<moe block>.experts(h, router_indices, router_scores)

with ``router_scores = renorm(softmax(router_logits)[router_indices])``. Replaying routes R
(indices [T,k]) keeps the current logits z and gathers:

    w_tj = p_t[R_tj] / (sum_j' p_t[R_tj'] if norm_topk_prob else 1),   p_t = softmax(z_t)

so dL/dz (hence the router weights' gradient) still flows through w; only the discrete top-k is
replaced. When R equals the router's own top-k, w is bit-identical to the router's scores.

Models following the contract (read from transformers 5.x source; tested here: Qwen3-MoE):
Qwen2-MoE, Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, Qwen3-VL-MoE and Qwen3-Omni-MoE (text), OLMoE,
FlexOlmo (``norm_topk_prob`` attribute), Mixtral and MiniMax (always renormalise: no attribute,
treated as ``norm_topk_prob=True``). Not supported: GPT-OSS (softmax over the top-k *logits*),
DeepSeek-V3/GLM-4-MoE style sigmoid + group-limited routers, and transformers 4.x (the gate was a
plain Linear there).

Route layout (verl's ``routed_experts``, as SGLang returns it): per sequence an int tensor
``[n, L, k]`` whose row t holds, for every decoder layer l (absolute index; dense layers hold
zeros), the k experts token t was routed to. ``n`` is the sequence length (verl's aligned field)
or the sequence length - 1 (SGLang: the last token never passes through the model). Rows whose
k indices are all equal (the zero rows verl pads with) count as "not recorded" and keep the
router's own choice; so do padding positions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

RouteInput = torch.Tensor | Sequence[torch.Tensor]


# ---------------------------------------------------------------------------------------------
# finding the routers
# ---------------------------------------------------------------------------------------------
def decoder_layers(model: nn.Module) -> Sequence[nn.Module]:
    """The decoder layers of a causal LM (``model.model.layers``), unwrapping FSDP/PEFT wrappers."""
    for path in ("model.layers", "model.model.layers", "model.language_model.layers", "layers"):
        node: Any = model
        for name in path.split("."):
            node = getattr(node, name, None)
            if node is None:
                break
        if isinstance(node, nn.ModuleList):
            return node
    raise ValueError(f"{type(model).__name__}: no decoder layers found (looked for model.layers)")


def _is_router(module: nn.Module) -> bool:
    return hasattr(module, "top_k") and hasattr(module, "num_experts") and isinstance(module.weight, nn.Parameter)


def find_routers(model: nn.Module) -> list[nn.Module | None]:
    """Per decoder layer, its MoE router (a submodule named ``gate`` with ``top_k``), or None (dense)."""
    routers: list[nn.Module | None] = []
    for layer in decoder_layers(model):
        found = [m for name, m in layer.named_modules() if name.split(".")[-1] == "gate" and _is_router(m)]
        if len(found) > 1:
            raise ValueError(f"decoder layer {len(routers)} has {len(found)} routers; one per layer is supported")
        routers.append(found[0] if found else None)
    if not any(r is not None for r in routers):
        raise ValueError(
            f"{type(model).__name__}: no MoE router follows the gate contract (see verl_sat.routing.gates)"
        )
    for router in routers:
        if router is not None and "GptOss" in type(router).__name__:
            raise ValueError("GPT-OSS routers weight the top-k logits, not the full softmax: not supported")
    return routers


def route_shape(model: nn.Module) -> tuple[int, int]:
    """(layers, top_k) of the per-token route rows of ``model``."""
    routers = find_routers(model)
    return len(routers), int(next(r for r in routers if r is not None).top_k)


# ---------------------------------------------------------------------------------------------
# the math
# ---------------------------------------------------------------------------------------------
def replay_weights(router_logits: torch.Tensor, indices: torch.Tensor, normalize: bool) -> torch.Tensor:
    """w = softmax(z)[indices], renormalised over the k entries when ``normalize`` (module docstring).

    Computed exactly as transformers' routers compute their scores (float softmax, then the cast
    back to the logits' dtype), so replaying the router's own choice is bit-identical.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    weights = probs.gather(-1, indices.long())
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype)


def _normalizes(router: nn.Module) -> bool:
    return bool(getattr(router, "norm_topk_prob", True))


# ---------------------------------------------------------------------------------------------
# aligning per-sequence routes with a (padded or packed) model input
# ---------------------------------------------------------------------------------------------
def align_routes(
    routes: RouteInput, attention_mask: torch.Tensor, num_layers: int, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Place per-sequence routes at the real tokens of a padded batch.

    Args:
        routes: a ``[B, T, L, k]`` tensor already aligned with ``attention_mask``, or one
            ``[n_i, L, k]`` tensor per sequence (a list or a nested jagged tensor), n_i = number of
            real tokens of row i (or that minus one); rows fill the real positions in order, so
            left, right and packed padding all work.
        attention_mask: ``[B, T]``, nonzero at real tokens.

    Returns:
        ``(indices [B, T, L, k] int64, replay [B, T, L] bool)``: replay is False at padding,
        at positions without a recorded row, and at rows whose k indices are all equal.
    """
    mask = attention_mask.bool()
    batch, width = mask.shape
    if isinstance(routes, torch.Tensor) and not routes.is_nested:
        if tuple(routes.shape) != (batch, width, num_layers, top_k):
            raise ValueError(
                f"routes of shape {tuple(routes.shape)} do not match the input: expected "
                f"(batch={batch}, tokens={width}, layers={num_layers}, top_k={top_k})"
            )
        indices = routes.to(torch.int64)
        placed = mask.clone()
    else:
        per_sample = list(routes.unbind(0)) if isinstance(routes, torch.Tensor) else list(routes)
        if len(per_sample) != batch:
            raise ValueError(f"{len(per_sample)} route tensors for a batch of {batch} sequences")
        indices = torch.zeros((batch, width, num_layers, top_k), dtype=torch.int64, device=mask.device)
        placed = torch.zeros_like(mask)
        for i, sample in enumerate(per_sample):
            real = mask[i].nonzero().squeeze(-1)
            n = int(sample.shape[0]) if sample.dim() else -1
            if (
                sample.dim() != 3
                or tuple(sample.shape[1:]) != (num_layers, top_k)
                or n not in (len(real), len(real) - 1)
            ):
                raise ValueError(
                    f"routes of sample {i} have shape {tuple(sample.shape)}; sample {i} has {len(real)} tokens, "
                    f"so expected ({len(real)}, {num_layers}, {top_k}) or ({len(real) - 1}, {num_layers}, {top_k})"
                )
            indices[i, real[:n]] = sample.to(device=mask.device, dtype=torch.int64)
            placed[i, real[:n]] = True
    return indices, placed.unsqueeze(-1) & recorded_routes(indices)


def router_replay_mode(engine_config: Any) -> str:
    """``router_replay.mode`` of an engine's config node (a mapping, a DictConfig or verl's dataclass;
    None without one), else ``disabled``: the one reader for the FSDP and the Megatron engine."""
    node = engine_config
    for key in ("router_replay", "mode"):
        node = node.get(key) if hasattr(node, "get") else getattr(node, key, None)
    return str(node or "disabled")


def recorded_routes(indices: torch.Tensor) -> torch.Tensor:
    """``indices[..., k]`` -> bool ``[...]``: a recorded route, not the filler verl aligns with (its k
    experts all equal: zeros); with top-1 every row counts as recorded."""
    if indices.shape[-1] == 1:
        return torch.ones(indices.shape[:-1], dtype=torch.bool, device=indices.device)
    return ~(indices == indices[..., :1]).all(-1)


def loss_rows(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` bool: the real rows whose routing reaches the loss, all but each sequence's last.

    The last row's logits predict a token after the sequence, so no loss term depends on it (nor,
    causally, on its routes); a rollout never routes it. verl's ``build_r3_replay_mask`` skips
    the same row on Megatron.
    """
    real = attention_mask.bool()
    after = torch.zeros_like(real)
    after[:, :-1] = real[:, 1:]
    return real & after


def routes_per_sample(indices: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
    """Inverse of :func:`align_routes`: the rows ``[n_i, L, k]`` at each sequence's real tokens."""
    mask = attention_mask.bool()
    return [indices[i][mask[i]] for i in range(mask.shape[0])]


# ---------------------------------------------------------------------------------------------
# the hooks
# ---------------------------------------------------------------------------------------------
class RouteCounts:
    """Token-layer counts behind the routing metrics of a replayed forward (R3 paper's agreement).

    ``real``: the rows whose routing reaches the loss (:func:`loss_rows`) x MoE layers;
    ``replayed``: of those, the ones given a recorded route; ``agreed``: of the replayed, the
    ones whose own top-k (the trainer's routing, before replay) is the same set of experts as
    the replayed one. Under R3 every row that reaches the loss is replayed: ``replayed_frac`` 1.
    """

    def __init__(self) -> None:
        self._sums: torch.Tensor | None = None  # [real, replayed, agreed], on the router's device

    def add(self, own: torch.Tensor, target: torch.Tensor, replay: torch.Tensor, real: torch.Tensor) -> None:
        """One MoE layer's call: ``own``/``target`` ``[N, k]`` experts, ``replay``/``real`` ``[N]`` bool.

        Summed on the device, without a host sync per layer; :meth:`metrics` reads them once.
        """
        real = real.to(own.device)
        replay = replay.to(own.device) & real
        same = (own.sort(-1).values == target.to(own).sort(-1).values).all(-1)
        sums = torch.stack([real.sum(), replay.sum(), (same & replay).sum()])
        self._sums = sums if self._sums is None else self._sums + sums

    def metrics(self, prefix: str = "actor/routing_replay") -> dict[str, float]:
        """``{prefix}/replayed_frac`` (replayed / real) and ``{prefix}/topk_agreement`` (agreed / replayed)."""
        if self._sums is None:
            return {}
        real, replayed, agreed = self._sums.tolist()
        if real == 0:
            return {}
        out = {f"{prefix}/replayed_frac": replayed / real}
        if replayed:
            out[f"{prefix}/topk_agreement"] = agreed / replayed
        return out


class RouterHooks:
    """Forward hooks on every router of ``model``, in one of three modes: off, record, replay.

    Installed once (``install``) and switched per forward pass: ``record()`` collects each
    router call's indices; ``replay(routes, mask)`` makes the routers return the given experts
    with :func:`replay_weights`; ``off()`` passes outputs through untouched.
    """

    def __init__(self, model: nn.Module) -> None:
        self.routers = find_routers(model)
        self.num_layers, self.top_k = route_shape(model)
        self.mode = "off"
        self._handles: list[Any] = []
        self._recorded: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self._targets: torch.Tensor | None = None  # [N, L, k], N = flat tokens of the forward
        self._replay: torch.Tensor | None = None  # [N, L] bool
        self._real: torch.Tensor | None = None  # [N] bool, the rows whose routing reaches the loss
        self.replayed_layers = 0
        self.counts = RouteCounts()

    def install(self) -> RouterHooks:
        if not self._handles:
            for layer, router in enumerate(self.routers):
                if router is not None:
                    self._handles.append(router.register_forward_hook(self._hook(layer, router)))
        return self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.off()

    def off(self) -> None:
        self.mode, self._targets, self._replay = "off", None, None
        self._recorded = [[] for _ in self.routers]

    def record(self) -> None:
        self.off()
        self.mode = "record"

    def replay(self, routes: RouteInput, attention_mask: torch.Tensor) -> None:
        """Arm replay for the next forward over a ``[B, T]`` input (see :func:`align_routes`)."""
        indices, replay = align_routes(routes, attention_mask, self.num_layers, self.top_k)
        self.off()
        self.mode = "replay"
        self._targets = indices.flatten(0, 1)
        self._replay = replay.flatten(0, 1)
        self._real = loss_rows(attention_mask).flatten()
        self.replayed_layers = 0

    def recorded(self, batch_size: int) -> torch.Tensor:
        """``[B, T, L, k]`` int32: the recorded calls, concatenated along the tokens (dense layers: 0).

        Each router call covers ``batch_size`` rows (generation: the prompt, then one token
        per call), so calls are reshaped to ``[B, t, k]`` and joined along t.
        """
        calls = [len(c) for c in self._recorded if c]
        if not calls:
            return torch.zeros((batch_size, 0, self.num_layers, self.top_k), dtype=torch.int32)
        per_layer = []
        for layer_calls in self._recorded:
            if layer_calls:
                per_layer.append(torch.cat([c.view(batch_size, -1, self.top_k) for c in layer_calls], dim=1))
            else:
                per_layer.append(None)
        width = next(t for t in per_layer if t is not None).shape[1]
        zeros = torch.zeros((batch_size, width, self.top_k), dtype=torch.int32)
        return torch.stack([t if t is not None else zeros for t in per_layer], dim=2)

    def _hook(self, layer: int, router: nn.Module) -> Any:
        normalize = _normalizes(router)

        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if self.mode == "record":
                self._recorded[layer].append(output[2].detach().to("cpu", torch.int32))
                return None
            if self.mode != "replay":
                return None
            logits, scores, own = output
            targets, replay = self._targets, self._replay
            if targets.shape[0] != logits.shape[0]:
                raise ValueError(
                    f"layer {layer}: the router saw {logits.shape[0]} tokens but the replayed routes "
                    f"cover {targets.shape[0]} (batch x tokens of the mask given to replay)"
                )
            chosen = torch.where(replay[:, layer, None].to(own.device), targets[:, layer].to(own.device), own)
            self.replayed_layers += 1
            self.counts.add(own, targets[:, layer], replay[:, layer], self._real)
            return logits, replay_weights(logits, chosen, normalize).to(scores.dtype), chosen.to(own.dtype)

        return hook


@contextlib.contextmanager
def replay_routes(model: nn.Module, routes: RouteInput, attention_mask: torch.Tensor) -> Iterator[RouterHooks]:
    """``with replay_routes(model, routes, mask): model(...)``: forwards inside use ``routes``."""
    hooks = RouterHooks(model).install()
    hooks.replay(routes, attention_mask)
    try:
        yield hooks
    finally:
        hooks.remove()


@contextlib.contextmanager
def record_routes(model: nn.Module) -> Iterator[RouterHooks]:
    """``with record_routes(model) as rec: model(...)``; then ``rec.recorded(batch_size)``."""
    hooks = RouterHooks(model).install()
    hooks.record()
    try:
        yield hooks
    finally:
        for handle in hooks._handles:
            handle.remove()
        hooks._handles = []


# ---------------------------------------------------------------------------------------------
# a routing-only perturbation (to induce a rollout/trainer routing mismatch on purpose)
# ---------------------------------------------------------------------------------------------
def perturb_routing(model: nn.Module, std: float, generator: torch.Generator, bias_std: float = 0.0) -> list[Any]:
    """Hooks choosing each router's top-k from ``z + b_l + std * N(0, 1)``; weights from the clean z.

    ``b_l ~ bias_std * N(0, 1)`` is one fixed offset per layer and expert (drawn once from
    ``generator``): a systematic routing mismatch, the same experts favoured at every step; the
    ``std`` term is i.i.d. per call. Emulates numerics flipping near-tied experts: only *which*
    experts are chosen changes, and their weights are :func:`replay_weights` of the clean logits,
    so replaying these routes in a clean forward reproduces the perturbed forward. Returns the
    hook handles.
    """
    handles = []
    for router in find_routers(model):
        if router is None:
            continue
        normalize = _normalizes(router)
        experts = int(router.weight.shape[0])
        bias = bias_std * torch.randn(experts, generator=generator) if bias_std > 0 else torch.zeros(experts)

        def hook(module: nn.Module, args: Any, output: Any, normalize: bool = normalize, bias: Any = bias) -> Any:
            logits, scores, own = output
            shifted = logits.float() + bias.to(logits.device)
            if std > 0:
                shifted = shifted + std * torch.randn(logits.shape, generator=generator, dtype=torch.float32).to(logits)
            chosen = torch.topk(torch.softmax(shifted, dim=-1), own.shape[-1]).indices
            return logits, replay_weights(logits, chosen, normalize).to(scores.dtype), chosen.to(own.dtype)

        handles.append(router.register_forward_hook(hook))
    return handles
