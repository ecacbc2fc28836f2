"""The ``verl.plugins`` entry point registers the losses in a fresh interpreter (as in a Ray worker)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CLEARED = ("VERL_PLATFORM", "VERL_ENGINE_DEVICE", "VERL_USE_EXTERNAL_PLUGINS", "VERL_USE_EXTERNAL_MODULES")

CHECK = (
    "import sys, verl\n"
    "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R\n"
    "print(sorted(k for k in R if k.startswith('sat')), 'verl_sat.sat.losses' in sys.modules)\n"
)


def run_fresh(policy: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_PLUGINS", "VERL_USE_EXTERNAL_MODULES")}
    if policy is not None:
        env["VERL_USE_EXTERNAL_PLUGINS"] = policy
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_entry_point_registers_losses_on_plain_import_verl():
    assert run_fresh(None) == "['sat', 'sat_gspo'] True"


def test_entry_point_is_the_mechanism():
    # with plugin discovery off, nothing registers them: the entry point is what did it above
    assert run_fresh("none") == "[] False"


def test_importing_verl_sat_first_registers_everything():
    """``import verl_sat`` before verl must not half-import the plugin (verl swallows its errors)."""
    code = (
        "import verl_sat\n"
        "from verl.plugin.platform import PlatformRegistry\n"
        "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R\n"
        "from verl.trainer.ppo.v1 import get_trainer_cls\n"
        "assert PlatformRegistry.get('cpu') is not None\n"
        "assert 'sat' in R and 'sat_gspo' in R\n"
        "print(get_trainer_cls('sat_separate_async').__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "SATPPOTrainerSeparateAsync"


GPU_NODE_CHECK = """
import importlib, os
assert "VERL_PLATFORM" not in os.environ and "VERL_ENGINE_DEVICE" not in os.environ
import torch, torch.distributed as dist
import verl
from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.plugin.platform import PlatformRegistry, platform_manager
from verl_sat.cpu import megatron
patched = ["init_process_group"] if getattr(dist.init_process_group, "_verl_sat_dedupe", False) else []
patched += ["VERL_ENGINE_DEVICE"] if "VERL_ENGINE_DEVICE" in os.environ else []
for name in sorted({*megatron.TORCH_SCOPED, *megatron.PATCHES}):
    module = importlib.import_module(name)
    if getattr(module, "torch", torch) is not torch:
        patched.append(name + ".torch")
    owners = [module, *(v for v in vars(module).values() if isinstance(v, type))]
    patched += [f"{name}.{k}" for o in owners for k, v in vars(o).items() if getattr(v, "_verl_sat_cpu", False)]
random = importlib.import_module("megatron.core.tensor_parallel.random")
patched += [] if random._get_cuda_rng_state.__name__ == "_get_cuda_rng_state" else ["_get_cuda_rng_state"]
print(patched)
print(platform_manager._detect_platform_name(), "cpu" in PlatformRegistry.registered_names())
print(sorted(CheckpointEngineRegistry._registry))
"""


@pytest.mark.gpu_branch
def test_without_verl_platform_no_cpu_patch_is_installed():
    """A GPU node's environment (no ``VERL_PLATFORM``): the plugin registers the CPU platform but
    installs none of ``verl_sat.cpu``'s patches (torch.distributed and every megatron-core / mbridge
    module it would patch are the originals), verl's auto-detection never picks "cpu" (here it falls
    back to "nvidia", as a GPU node detects it), and ``ray_object_store`` (the 1-GPU smoke's weight
    sync) is registered anyway."""
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    out = subprocess.run([sys.executable, "-c", GPU_NODE_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    patched, platform, engines = out.stdout.strip().splitlines()[-3:]
    assert patched == "[]"
    assert platform == "nvidia True"
    assert "ray_object_store" in engines


CPU_NODE_CHECK = """
import torch.distributed as dist
import verl
from verl.utils.device import get_device_name, get_torch_device
from verl_sat.cpu import platform
platform.register()  # a second registration (the plugin ran the first) wraps nothing again
assert not getattr(dist.init_process_group.__wrapped__, "_verl_sat_dedupe", False)
backend = f"cpu:gloo,{get_device_name()}:gloo"  # what verl's initialize_global_process_group builds
dist.init_process_group(backend=backend, init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
print(backend, dist.get_backend(), get_torch_device().device_count(), get_torch_device().synchronize())
"""


def test_with_verl_platform_cpu_verls_duplicated_gloo_backend_initialises_once_wrapped():
    """``VERL_PLATFORM=cpu``: verl's ``"cpu:gloo,cpu:gloo"`` process-group backend, which torch
    rejects, initialises a gloo group, and ``init_process_group`` is wrapped once however often
    the platform registers; the device module answers from torch.cpu."""
    env = {k: v for k, v in os.environ.items() if k not in CLEARED} | {"VERL_PLATFORM": "cpu"}
    out = subprocess.run([sys.executable, "-c", CPU_NODE_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "cpu:gloo,cpu:gloo cpu:gloo 1 None"
