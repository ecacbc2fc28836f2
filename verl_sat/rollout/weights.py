"""Weight names between verl's FSDP engine and a transformers-5 Qwen3-MoE.

verl's ``get_per_tensor_param`` unfuses Transformers-5 packed experts into per-expert
checkpoint keys (``verl/workers/engine/fsdp/utils.py::unfuse_moe_params``); the HF rollout model
holds them packed again (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj``
``[E, H, I]``). :func:`refuse_moe_params` inverts that split. :func:`host_copies` drains verl's
weight stream, for the HF adapter and the ``ray_object_store`` checkpoint engine alike.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

import torch
from verl.workers.rollout.utils import ensure_async_iterator

_EXPERT_KEY = re.compile(r"^(?P<base>.*\.mlp\.experts)\.(?P<idx>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def refuse_moe_params(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pack per-expert ``gate/up/down_proj.weight`` keys back into Transformers-5 3-D tensors."""
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in named.items():
        match = _EXPERT_KEY.match(name)
        if match is None:
            out[name] = tensor
            continue
        experts[match["base"]][match["proj"]][int(match["idx"])] = tensor
    for base, projs in experts.items():
        count = len(projs["down_proj"])
        gate = [projs["gate_proj"][i] for i in range(count)]
        up = [projs["up_proj"][i] for i in range(count)]
        out[f"{base}.gate_up_proj"] = torch.stack([torch.cat([g, u], dim=0) for g, u in zip(gate, up, strict=True)])
        out[f"{base}.down_proj"] = torch.stack([projs["down_proj"][i] for i in range(count)])
    return out


def load_named_tensors(model: torch.nn.Module, named: dict[str, torch.Tensor]) -> None:
    """Copy ``named`` into ``model`` in place; raise on names the model does not have."""
    state = refuse_moe_params(named)
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise KeyError(f"HF rollout: unexpected weight names {result.unexpected_keys[:8]}")


async def host_copies(weights: Any) -> dict[str, torch.Tensor]:
    """verl's ``(name, tensor)`` stream (sync or async), drained whole into detached host copies."""
    named: dict[str, torch.Tensor] = {}
    async for name, tensor in ensure_async_iterator(weights):
        named[name] = tensor.detach().to("cpu").clone()
    return named
