"""verl_sat.cpu.sglang without SGLang: what its patches do on their own, and that none is installed off CPU.

The engine itself (SGLang 0.5.12 installed by ``recipes/cpu/install_sglang_cpu.sh``) is exercised by
tests/test_sglang_cpu_engine.py (``extended``). Here, each work-around that needs no SGLang is run on
the real library call it replaces (torch's pinned allocation, Python's import system); and a fresh
interpreter imports verl's SGLang server and adapter modules (SGLang's modules from
tests/sglang_stub.py, an ``sglang 0.5.12`` distribution from a metadata directory): without
``VERL_PLATFORM`` nothing is installed; the CPU platform's registration then installs every patch.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import verl_sat.cpu.patching as cpu
from verl_sat.cpu import sglang as cpu_sglang

TESTS = Path(__file__).resolve().parent
CLEARED = ("VERL_PLATFORM", "VERL_ENGINE_DEVICE", "SGLANG_USE_CPU_ENGINE")


def test_server_args_fill_what_the_user_left_unset_and_keep_what_they_passed() -> None:
    """engine_kwargs.sglang gets every CPU server argument, except the ones the user set."""
    user = {"vllm": {}, "sglang": {"attention_backend": "intel_amx", "max_total_tokens": 512}}
    filled = cpu_sglang.fill_server_args(user)
    assert filled is user
    assert user["sglang"]["attention_backend"] == "intel_amx"
    assert user["sglang"]["max_total_tokens"] == 512
    for key in set(cpu_sglang.SERVER_ARGS) - {"attention_backend", "max_total_tokens"}:
        assert user["sglang"][key] == cpu_sglang.SERVER_ARGS[key]
    assert cpu_sglang.fill_server_args({"sglang": None})["sglang"] == cpu_sglang.SERVER_ARGS
    with pytest.raises(TypeError, match="engine_kwargs.sglang must be a mapping, got 'x'"):
        cpu_sglang.fill_server_args({"sglang": "x"})


def test_an_sglang_of_another_release_is_refused_naming_both_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of the post-import hooks :func:`cpu_sglang.install` registers checks the version first."""
    hooks: dict = {}
    monkeypatch.setattr(cpu_sglang, "when_imported", lambda name, hook: hooks.setdefault(name, hook))
    monkeypatch.setattr(cpu_sglang, "installed_version", lambda name: "0.5.23")
    monkeypatch.setattr(cpu_sglang, "prepare_process", lambda: None)
    cpu_sglang.install()
    assert set(hooks) == set(cpu_sglang.PATCHES)
    monkeypatch.setattr(cpu.importlib.metadata, "version", lambda name: cpu_sglang.WRITTEN_FOR)
    hooks["sglang"](ModuleType("sglang"))
    monkeypatch.setattr(cpu.importlib.metadata, "version", lambda name: "0.5.23")
    for name, hook in hooks.items():
        with pytest.raises(cpu.VersionMismatch, match=r"sglang==0\.5\.12, found sglang 0\.5\.23; .*install_sglang_cpu"):
            hook(ModuleType(name))


def test_a_cpu_torch_refuses_pinned_memory_and_the_unpinned_module_torch_allocates() -> None:
    """SGLang's pinned host buffers (R3's routed-experts cache, prompt log-prob indices) on this torch:
    refused as written, allocated through the module-scoped stand-in; torch itself is untouched."""
    with pytest.raises(RuntimeError):
        torch.zeros((3, 4, 2), dtype=torch.int32, device="cpu", pin_memory=True)
    module = type(sys)("sglang_module_under_test")
    module.torch = torch
    cpu_sglang.unpin(module)
    buffer = module.torch.zeros((3, 4, 2), dtype=torch.int32, device="cpu", pin_memory=True)
    index = module.torch.tensor([0, 2], dtype=torch.int64, pin_memory=True)
    assert buffer.shape == (3, 4, 2) and not buffer.is_pinned() and index.tolist() == [0, 2]
    assert module.torch.int32 is torch.int32 and module.torch.cat is torch.cat
    assert torch.zeros is not module.torch.zeros


def test_the_kernel_stand_in_answers_only_for_kvcacheio_and_its_kernels_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    """``from sgl_kernel.kvcacheio import transfer_kv_all_layer`` (SGLang's memory_pool_host.py) imports;
    any other sgl_kernel import fails as without the package; a call says what it stands in for."""
    for name in cpu_sglang.KERNEL_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert importlib.util.find_spec("sgl_kernel") is None  # this machine has no sgl-kernel
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    cpu_sglang.install_kernel_stand_in()
    cpu_sglang.install_kernel_stand_in()
    assert sum(isinstance(finder, cpu_sglang.KernelStandIn) for finder in sys.meta_path) == 1
    assert isinstance(sys.meta_path[-1], cpu_sglang.KernelStandIn)
    from sgl_kernel.kvcacheio import transfer_kv_all_layer, transfer_kv_per_layer_mla  # noqa: F401

    with pytest.raises(NotImplementedError, match=r"sgl_kernel\.kvcacheio\.transfer_kv_all_layer is verl-sat's"):
        transfer_kv_all_layer(None)
    with pytest.raises(ImportError):
        from sgl_kernel import merge_state_v2  # noqa: F401
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("sgl_kernel.allreduce")
    for name in cpu_sglang.KERNEL_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)


def test_the_sharing_strategy_is_file_system_inside_and_restored_after() -> None:
    import torch.multiprocessing as mp

    before = mp.get_sharing_strategy()
    with cpu_sglang.sharing_strategy("file_system"):
        assert mp.get_sharing_strategy() == "file_system"
    assert mp.get_sharing_strategy() == before


def test_torchvision_schemas_are_left_alone_without_torchvision_or_on_a_gpu_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No torchvision extension (the test extra's metadata-only stand-in): nothing to register. A CUDA
    torch with SGLang installed and no CPU platform (a GPU node): ``prepare_process`` registers nothing,
    sets nothing and installs no finder."""
    monkeypatch.setattr(cpu_sglang, "_TORCHVISION_LIBRARY", [])
    monkeypatch.setattr(cpu_sglang, "torchvision_extension", lambda: None)
    assert cpu_sglang.register_torchvision_schemas() is False

    def refuse(*args: object) -> None:
        raise AssertionError("called on a GPU node")

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(cpu_sglang, "installed_version", lambda name: cpu_sglang.WRITTEN_FOR)
    monkeypatch.setattr(cpu_sglang, "register_torchvision_schemas", refuse)
    monkeypatch.setattr(cpu_sglang, "install_kernel_stand_in", refuse)
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    assert cpu_sglang.cpu_torch() is False
    cpu_sglang.prepare_process()
    assert "SGLANG_USE_CPU_ENGINE" not in os.environ


NODE_CHECK = """
import os, sys
sys.path.insert(0, {tests!r})
import sglang_stub
sglang_stub.install()
import verl
import sglang.srt.entrypoints.engine as engine
from verl.workers.rollout.sglang_rollout import async_sglang_server, sglang_rollout
from verl_sat.cpu import sglang as cpu_sglang


def installed():
    return [
        getattr(async_sglang_server.SGLangHttpServer.launch_server, cpu_sglang.MARKER, False),
        getattr(sglang_rollout.ServerAdapter.update_weights, cpu_sglang.MARKER, False),
        getattr(engine, "run_scheduler_process", None) is cpu_sglang.run_scheduler_process,
        getattr(engine, "run_detokenizer_process", None) is cpu_sglang.run_detokenizer_process,
        any(isinstance(finder, cpu_sglang.KernelStandIn) for finder in sys.meta_path),
        os.environ.get("SGLANG_USE_CPU_ENGINE") == "1",
    ]


print(cpu_sglang.installed_version("sglang"), "gpu", installed())
os.environ["VERL_PLATFORM"] = "cpu"  # then what a CPU process's plugin does
import verl_sat.cpu

verl_sat.cpu.register()
print(cpu_sglang.installed_version("sglang"), "cpu", installed())
"""


@pytest.mark.gpu_branch
def test_on_a_gpu_node_with_sglang_installed_no_sglang_patch_is_installed(tmp_path: Path) -> None:
    """No ``VERL_PLATFORM`` (a GPU node), in a fresh interpreter that sees an ``sglang 0.5.12``
    distribution (metadata only) and SGLang's modules (stubs): verl's SGLang server and adapter,
    SGLang's engine module, the import system and the environment are the originals. Then, in the same
    interpreter, the CPU platform's registration installs each patch (so that the first check can fail)."""
    dist = tmp_path / f"sglang-{cpu_sglang.WRITTEN_FOR}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {cpu_sglang.WRITTEN_FOR}\n")
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *filter(None, [env.get("PYTHONPATH")])])
    script = NODE_CHECK.format(tests=str(TESTS))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    gpu, cpu = out.stdout.strip().splitlines()[-2:]
    assert gpu == f"{cpu_sglang.WRITTEN_FOR} gpu [False, False, False, False, False, False]"
    assert cpu == f"{cpu_sglang.WRITTEN_FOR} cpu [True, True, True, True, True, True]"
