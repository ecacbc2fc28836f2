"""SGLang 0.5.12's engine on a CPU torch under verl's own SGLang rollout: run-time work-arounds.

Installed by :func:`verl_sat.cpu.register` only when the CPU platform is selected (``VERL_PLATFORM=cpu``)
and an ``sglang`` distribution is installed (``recipes/cpu/install_sglang_cpu.sh``), in every process
that imports verl, and in SGLang's scheduler and detokenizer processes: those are ``spawn`` children
that never import verl, so :func:`patch_engine` hands SGLang this module's :func:`run_scheduler_process`
and :func:`run_detokenizer_process` as their targets, and unpickling a target imports verl-sat (whose
plugin installs everything here) before the child imports anything of SGLang's. Any SGLang other than
:data:`WRITTEN_FOR` stops ``import sglang`` with an error naming both versions: each patch reaches
into one release's internals. Nothing in site-packages is edited. On a GPU nothing here is installed.

What SGLang 0.5.12 needs on a CPU torch, one item each (docs/cpu.md, "SGLang on CPU"):

- ``SGLANG_USE_CPU_ENGINE=1`` (:data:`CPU_ENGINE_ENV`): SGLang's ``is_cpu()`` (``srt/utils/common.py``),
  so RMSNorm, SiluAndMul, top-k and the MoE take their pure-torch paths;
- :data:`SERVER_ARGS`, filled into ``engine_kwargs.sglang`` where the user set nothing
  (:func:`fill_server_args`);
- :func:`register_torchvision_schemas`: PyPI's torchvision links CUDA, its C extension does not load,
  and its Python then fails on ``register_fake("torchvision::nms")``; SGLang imports it at load time;
- :class:`KernelStandIn`: ``mem_cache/memory_pool_host.py`` imports ``sgl_kernel.kvcacheio``
  unconditionally, and sgl-kernel has no CPU wheel; nothing calls it (HiCache is off);
- :data:`UNPINNED`: host buffers allocated with ``pin_memory=True``, which a CPU torch refuses;
- :func:`share_weights_by_file`: verl's weight sync pickles CPU tensors with torch's default sharing
  (file descriptors passed through ``multiprocessing.resource_sharer``, whose authentication key only
  one process tree shares); SGLang's scheduler is not in the sender's tree;
- :func:`reduce_host_tensors_unchanged`: SGLang's tensor reducer assumes every tensor it pickles for a
  weight update is a CUDA tensor.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

import torch

from verl_sat.cpu.patching import ScopedTorch, checked, installed_version, scope
from verl_sat.hooks import when_imported, wrap_once

WRITTEN_FOR = "0.5.12"
INSTALL = "bash recipes/cpu/install_sglang_cpu.sh"  # how to install :data:`WRITTEN_FOR` on a CPU torch
MARKER = "_verl_sat_sglang_cpu"  # set on each function a patch wraps, so that it is wrapped once
SERVER_MODULE = "verl.workers.rollout.sglang_rollout.async_sglang_server"
ADAPTER_MODULE = "verl.workers.rollout.sglang_rollout.sglang_rollout"

# The environment SGLang's CPU engine needs, in every process that imports SGLang (children inherit it).
CPU_ENGINE_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}  # is_cpu(): SGLang's CPU device and its pure-torch layers

# SGLang ``ServerArgs`` that verl's ``SGLangHttpServer.launch_server`` sets (or leaves) for a GPU; each
# value is the one SGLang 0.5.12 accepts and runs correctly on a CPU, with the reason.
SERVER_ARGS: dict[str, Any] = {
    # verl picks flashinfer (CUDA); SGLang's CPU default intel_amx needs AMX and sgl-kernel's CPU build.
    "attention_backend": "torch_native",
    # verl sets True, which needs torch_memory_saver (CUDA virtual memory).
    "enable_memory_saver": False,
    # The overlap scheduler copies the captured routes with .to("cpu", non_blocking=True), which on a CPU
    # returns the same tensor; the next forward overwrites it, so R3's routes came one decode step late
    # (12 of 24 pairs matched). SGLang 0.5.23 adds the missing .clone().
    "disable_overlap_schedule": True,
    # xgrammar (SGLang's default grammar backend) is not needed: verl sends no constrained requests.
    "grammar_backend": "none",
    # The KV cache's size in tokens. Without it SGLang takes mem_fraction_static (verl's
    # gpu_memory_utilization) of the host's free memory, and zeroing it touches every page: gigabytes
    # per engine for a model that needs megabytes. 16384 tokens of the tiny MoE's fp32 KV are 32 MiB.
    "max_total_tokens": 16384,
}

# torchvision's two ops whose fake kernels its Python registers whether or not its C extension loaded
# (torchvision/_meta_registrations.py, 0.28.0); the schemas are those of its csrc/ops.
TORCHVISION_SCHEMAS: dict[str, str] = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}

# The modules of sgl_kernel that SGLang 0.5.12 imports unconditionally on a CPU.
KERNEL_MODULES = ("sgl_kernel", "sgl_kernel.kvcacheio")

# Modules whose global ``torch`` becomes :data:`UNPINNED_TORCH`, each with its pinned allocation.
UNPINNED: dict[str, str] = {
    "sglang.srt.state_capturer.base": "R3: the routed-experts host cache (BaseHostCache) is pinned",
    "sglang.srt.layers.logits_processor": "prompt log-probs (logprob_start_len=0) pin their index tensors",
}

_TORCHVISION_LIBRARY: list[Any] = []  # keeps the torch.library.Library holding the schemas alive


# ---------------------------------------------------------------------------------------------
# server arguments
# ---------------------------------------------------------------------------------------------
def fill_server_args(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``engine_kwargs`` (verl's ``rollout.engine_kwargs``) with :data:`SERVER_ARGS` added under
    ``"sglang"`` where the user set no value; what the user passed is kept. Returns it, changed in place."""
    sglang = engine_kwargs.get("sglang")
    if sglang is None:
        sglang = engine_kwargs["sglang"] = {}
    if not isinstance(sglang, dict):
        raise TypeError(f"actor_rollout_ref.rollout.engine_kwargs.sglang must be a mapping, got {sglang!r}")
    for key, value in SERVER_ARGS.items():
        if sglang.get(key) is None:
            sglang[key] = value
    return engine_kwargs


def patch_server(module: ModuleType) -> None:
    """verl's ``SGLangHttpServer.launch_server``: the CPU server arguments go into its ``engine_kwargs``."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        async def launch_server(self: Any, *args: Any, **kwargs: Any) -> Any:
            if self.config.engine_kwargs is None:
                self.config.engine_kwargs = {}
            fill_server_args(self.config.engine_kwargs)
            return await original(self, *args, **kwargs)

        return launch_server

    wrap_once(module.SGLangHttpServer, "launch_server", MARKER, make)


# ---------------------------------------------------------------------------------------------
# torchvision
# ---------------------------------------------------------------------------------------------
def torchvision_extension() -> str | None:
    """The path of the installed torchvision's C extension (``_C.so``), None without one; found
    without importing torchvision."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            found = glob.glob(os.path.join(folder, f"_C{suffix}"))
            if found:
                return found[0]
    return None


def extension_loads(path: str) -> bool:
    """Whether torch can load the extension at ``path`` (as torchvision's ``extension._load_library`` does)."""
    try:
        torch.ops.load_library(path)
    except (ImportError, OSError):
        return False
    return True


def register_torchvision_schemas() -> bool:
    """Register :data:`TORCHVISION_SCHEMAS` with ``torch.library`` when torchvision is installed but its
    C extension does not load (PyPI's CUDA build on a CPU torch), so that its Python imports; returns
    whether it registered. A torchvision whose extension loads defines them itself and is left alone."""
    path = torchvision_extension()
    if path is None or _TORCHVISION_LIBRARY or extension_loads(path):
        return False
    library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in TORCHVISION_SCHEMAS.values():
        library.define(schema)
    _TORCHVISION_LIBRARY.append(library)
    return True


# ---------------------------------------------------------------------------------------------
# sgl_kernel
# ---------------------------------------------------------------------------------------------
def _absent_kernel(module: str, name: str) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{module}.{name} is verl-sat's CPU stand-in (verl_sat.cpu.sglang): sgl-kernel has no CPU build, "
            f"and SGLang's hierarchical KV cache (HiCache), which calls it, is not supported on CPU"
        )

    kernel.__name__ = name
    return kernel


class _KernelModule(ModuleType):
    """``sgl_kernel.kvcacheio`` on a CPU: every attribute is a kernel that raises when called."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _absent_kernel(self.__name__, name)


class KernelStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The last finder on ``sys.meta_path``: answers for :data:`KERNEL_MODULES` only, and only when no
    installed package does (a real sgl_kernel is found first). ``sgl_kernel`` itself holds nothing, so
    ``from sgl_kernel import X`` fails as it does without the package, and SGLang's guarded imports
    fall back as before."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None, target: Any = None) -> Any:
        if fullname not in KERNEL_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=fullname == KERNEL_MODULES[0])

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        if spec.name == KERNEL_MODULES[0]:
            module = ModuleType(spec.name, "verl-sat's CPU stand-in for sgl-kernel (verl_sat.cpu.sglang)")
            module.__path__ = []
            return module
        return _KernelModule(spec.name, "sgl_kernel.kvcacheio stand-in: every kernel raises when called")

    def exec_module(self, module: ModuleType) -> None:
        return None


def install_kernel_stand_in() -> None:
    """Append one :class:`KernelStandIn` to ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, KernelStandIn) for finder in sys.meta_path):
        sys.meta_path.append(KernelStandIn())


# ---------------------------------------------------------------------------------------------
# pinned host memory
# ---------------------------------------------------------------------------------------------
def _unpinned(kwargs: dict[str, Any]) -> None:
    kwargs.pop("pin_memory", None)


# ``torch`` for one SGLang module: everything forwarded, the tensor factories without ``pin_memory``.
UNPINNED_TORCH = ScopedTorch(("tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange"), _unpinned)

# Point a module's global ``torch`` at UNPINNED_TORCH (that module only).
unpin = functools.partial(scope, stand_in=UNPINNED_TORCH)


# ---------------------------------------------------------------------------------------------
# SGLang's child processes
# ---------------------------------------------------------------------------------------------
def run_scheduler_process(*args: Any, **kwargs: Any) -> Any:
    """SGLang's scheduler process, after its import installed this module's patches in the child."""
    from sglang.srt.managers.scheduler import run_scheduler_process as run

    return run(*args, **kwargs)


def run_detokenizer_process(*args: Any, **kwargs: Any) -> Any:
    """SGLang's detokenizer process, after its import installed this module's patches in the child."""
    from sglang.srt.managers.detokenizer_manager import run_detokenizer_process as run

    return run(*args, **kwargs)


def patch_engine(module: ModuleType) -> None:
    """``sglang.srt.entrypoints.engine``: its child processes start from this module's targets (the
    ones verl reads from the module when it launches, and the offline ``Engine``'s)."""
    module.run_scheduler_process = run_scheduler_process
    module.run_detokenizer_process = run_detokenizer_process
    module.Engine.run_scheduler_process_func = staticmethod(run_scheduler_process)
    module.Engine.run_detokenizer_process_func = staticmethod(run_detokenizer_process)


# ---------------------------------------------------------------------------------------------
# weight sync
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def sharing_strategy(strategy: str) -> Iterator[None]:
    """``torch.multiprocessing``'s sharing strategy set to ``strategy`` inside the block, restored after."""
    import torch.multiprocessing as mp

    previous = mp.get_sharing_strategy()
    mp.set_sharing_strategy(strategy)
    try:
        yield
    finally:
        mp.set_sharing_strategy(previous)


def share_weights_by_file(module: ModuleType) -> None:
    """verl's SGLang ``ServerAdapter.update_weights``: CPU tensors go to the scheduler as named shared
    memory files (``file_system``), which any process on the host can open."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        async def update_weights(self: Any, *args: Any, **kwargs: Any) -> Any:
            with sharing_strategy("file_system"):
                return await original(self, *args, **kwargs)

        return update_weights

    wrap_once(module.ServerAdapter, "update_weights", MARKER, make)


def reduce_host_tensors_unchanged(module: ModuleType) -> None:
    """``sglang.srt.utils.patch_torch``: SGLang's tensor reducer (``monkey_patch_torch_reductions``, run
    before each weight update) rewrites the device slot of a CUDA tensor's reduction, an index a CPU
    tensor's shorter reduction does not have (IndexError); a host tensor is reduced as torch reduces it."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def _reduce_tensor_modified(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if tensor.device.type == "cpu":
                return module.reductions._reduce_tensor_original(tensor, *args, **kwargs)
            return original(tensor, *args, **kwargs)

        return _reduce_tensor_modified

    wrap_once(module, "_reduce_tensor_modified", MARKER, make)


# ---------------------------------------------------------------------------------------------
PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "sglang": lambda module: None,  # the version check, before anything of SGLang's runs
    "sglang.srt.entrypoints.engine": patch_engine,
    SERVER_MODULE: patch_server,
    ADAPTER_MODULE: share_weights_by_file,
    "sglang.srt.utils.patch_torch": reduce_host_tensors_unchanged,
    **{name: unpin for name in UNPINNED},
}


def cpu_torch() -> bool:
    """Whether this torch is a CPU build (no CUDA, no ROCm)."""
    return torch.version.cuda is None and getattr(torch.version, "hip", None) is None


def prepare_process() -> None:
    """With SGLang :data:`WRITTEN_FOR` installed: on a CPU torch, torchvision's schemas (the driver too:
    it imports transformers before it reads ``trainer.device``); with ``VERL_PLATFORM=cpu`` also
    :data:`CPU_ENGINE_ENV` (a value already set wins) and the sgl_kernel stand-in. ``verl_sat/__init__``
    calls it before anything imports transformers (which imports torchvision); it imports nothing of verl's."""
    from verl_sat.cpu.platform import is_selected

    if installed_version("sglang") != WRITTEN_FOR:
        return
    if cpu_torch():
        register_torchvision_schemas()
    if not is_selected():
        return
    for name, value in CPU_ENGINE_ENV.items():
        os.environ.setdefault(name, value)
    install_kernel_stand_in()


def install() -> None:
    """CPU platform only (:func:`verl_sat.cpu.register`): with an ``sglang`` installed,
    :func:`prepare_process` and a post-import hook for each of :data:`PATCHES` (whose version check
    stops ``import sglang`` for any other release)."""
    if installed_version("sglang") is None:
        return
    prepare_process()
    for name, patch in PATCHES.items():
        when_imported(name, checked(patch, "sglang", WRITTEN_FOR, __name__, INSTALL))
