"""verl's Megatron engine on CPU (verl_sat.cpu.megatron): the patches, and the engine they make run.

The engine test runs ``tests/megatron_engine_run.py`` in a subprocess (it initialises
torch.distributed and Megatron's parallel state): verl's own ``MegatronEngineWithLMHead``, the tiny
Qwen3-MoE built through mbridge with megatron's local layers in fp32, log-probs through verl's own
Megatron forward against Hugging Face's on a left/right padded batch, packed (remove-padding, thd)
and padded (bshd); then three train steps that lower the loss. About a minute on 2 idle cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import verl_sat.cpu.patching as cpu
from verl_sat.cpu import megatron

HERE = Path(__file__).resolve().parent


def registered_hooks(monkeypatch) -> dict:
    """The post-import hooks :func:`megatron.install` registers, by module name (none is registered)."""
    hooks: dict = {}
    monkeypatch.setattr(megatron, "when_imported", lambda name, hook: hooks.setdefault(name, hook))
    megatron.install()
    return hooks


def test_a_version_the_patches_were_not_written_for_is_refused_naming_both(monkeypatch):
    hooks = registered_hooks(monkeypatch)
    monkeypatch.setattr(cpu.importlib.metadata, "version", lambda name: "0.17.0")
    with pytest.raises(cpu.VersionMismatch, match=r"megatron-core==0\.16\.1, found megatron-core 0\.17\.0"):
        hooks["megatron.core.utils"](ModuleType("megatron.core.utils"))
    with pytest.raises(cpu.VersionMismatch, match=r"mbridge==0\.15\.1, found mbridge 0\.17\.0; .*megatron-cpu"):
        hooks["mbridge.core.bridge"](ModuleType("mbridge.core.bridge"))  # refused before the patch runs


def test_installed_versions_are_the_supported_ones(monkeypatch):
    hooks = registered_hooks(monkeypatch)
    for name in ("megatron.core", "mbridge"):
        hooks[name](ModuleType(name))  # the megatron-cpu extra installs exactly megatron.SUPPORTED


def test_local_spec_names_map_onto_mbridges_te_tables():
    assert (
        megatron.te_style_name("decoder.layers.3.input_layernorm.weight")
        == "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"
    )
    name = "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"
    assert megatron.te_style_name(name) == "decoder.layers.1.mlp.experts.linear_fc1.weight2"
    assert megatron.te_style_name(name, expert_offset=4) == "decoder.layers.1.mlp.experts.linear_fc1.weight6"
    norm = "decoder.layers.1.pre_mlp_layernorm.weight"
    assert megatron.te_style_name(norm) == norm


def test_the_torch_stand_in_keeps_megatrons_cuda_requests_on_the_host():
    t = megatron.CPU_TORCH
    assert t.zeros(2, device="cuda").device.type == "cpu"
    assert t.tensor([1.0], device=t.cuda.current_device()).device.type == "cpu"
    assert t.device("cuda").type == "cpu" and t.Tensor is torch.Tensor
    state = torch.get_rng_state()
    t.cuda.manual_seed(3)
    a = torch.rand(1)
    t.cuda.set_rng_state(t.cuda.get_rng_state())  # the host generator, untouched by the round trip
    torch.manual_seed(3)
    assert torch.equal(a, torch.rand(1))
    torch.set_rng_state(state)
    assert torch.cuda is not t.cuda  # torch itself is never patched


def test_local_attention_masks_are_causal_per_sequence():
    from types import SimpleNamespace

    query = torch.zeros(5, 1, 1, 1)
    packed = SimpleNamespace(cu_seqlens_q=torch.tensor([0, 2, 4]), cu_seqlens_q_padded=None)
    masked = megatron.local_attention_mask(query, None, packed)[0, 0]
    visible = ~masked
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 1]], dtype=torch.bool
    )
    assert torch.equal(visible, expected)
    padded = megatron.local_attention_mask(torch.zeros(3, 2, 1, 1), torch.tensor([[1, 1, 0], [1, 1, 1]]), None)
    assert padded.shape == (2, 1, 3, 3)
    assert bool(padded[0, 0, 2, 2]) and not bool(padded[1, 0, 2, 2])  # a padded key is never seen


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory) -> dict:
    from verl_sat.default.model import create

    model = create(tmp_path_factory.mktemp("tiny_moe") / "model")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.setdefault("OMP_NUM_THREADS", "1")
    out = subprocess.run(
        [sys.executable, str(HERE / "megatron_engine_run.py"), str(model)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_verls_megatron_forward_matches_hf_in_fp32_packed_and_padded(engine_run):
    assert engine_run["engine"] == "MegatronEngineWithLMHead"  # verl's own engine class, not a subclass
    assert engine_run["params_dtype"] == "torch.float32"
    assert engine_run["attention"] == "DotProductAttention"  # megatron's local attention, no TransformerEngine
    assert engine_run["max_abs_diff_packed"] <= 1e-5, engine_run
    assert engine_run["max_abs_diff_padded"] <= 1e-5, engine_run


def test_verls_megatron_train_steps_lower_the_loss(engine_run):
    nll = engine_run["nll"]
    assert all(later < earlier for earlier, later in zip(nll, nll[1:], strict=False)), nll
    assert engine_run["grad_norm"] > 0
