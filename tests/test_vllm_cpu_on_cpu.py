"""verl_sat.cpu.vllm: the version gate and the live-weights patch, without starting an engine.

The patches' end-to-end effect (verl's weight sync reaching vLLM's kernels, routes captured for
R3) is checked by tests/test_vllm_e2e.py through the trainer.
"""

from __future__ import annotations

import pytest
import torch

import verl_sat.cpu.patching as cpu
from verl_sat.cpu import vllm as vllm_cpu


def test_version_gate_names_both_versions(monkeypatch):
    monkeypatch.setattr(cpu.importlib.metadata, "version", lambda name: "0.29.1")
    with pytest.raises(cpu.VersionMismatch, match=r"vllm-cpu==0\.28\.0, found vllm-cpu 0\.29\.1; .*\[vllm-cpu\]"):
        vllm_cpu.install()


@pytest.mark.gpu_branch
def test_install_is_a_no_op_without_vllm_cpu(monkeypatch):
    import vllm.model_executor.layers.utils as layer_utils

    before = layer_utils.dispatch_cpu_unquantized_gemm
    monkeypatch.setattr(vllm_cpu, "installed_version", lambda name: None)
    vllm_cpu.install()
    assert layer_utils.dispatch_cpu_unquantized_gemm is before


def test_linear_keeps_its_weight_and_computes_with_the_new_one(monkeypatch):
    """vLLM's dispatch would drop the parameter (remove_weight=True); patched, it stays, and a
    re-dispatch after a load (what verl's process_weights_after_loading does) uses the new values."""
    import vllm.model_executor.layers.utils as layer_utils

    monkeypatch.setattr(layer_utils, "dispatch_cpu_unquantized_gemm", layer_utils.dispatch_cpu_unquantized_gemm)
    vllm_cpu.keep_live_linear_weights()
    vllm_cpu.keep_live_linear_weights()  # plugins load many times: wrapped once
    patched = layer_utils.dispatch_cpu_unquantized_gemm
    assert getattr(patched, vllm_cpu._INSTALLED) and getattr(patched, "__wrapped__", None) is not None
    assert not getattr(patched.__wrapped__, vllm_cpu._INSTALLED, False)

    layer = torch.nn.Linear(64, 32, bias=False)
    weight = layer.weight
    patched(layer, remove_weight=True)
    assert layer.weight is weight and layer.weight.shape == (32, 64)
    x = torch.randn(5, 64)
    torch.testing.assert_close(layer.cpu_linear(x, layer.weight, None), x @ weight.T)
    with torch.no_grad():
        weight.copy_(torch.randn_like(weight))  # a weight sync loads in place ...
    patched(layer, remove_weight=True)  # ... then verl re-runs process_weights_after_loading
    torch.testing.assert_close(layer.cpu_linear(x, layer.weight, None), x @ weight.T)
