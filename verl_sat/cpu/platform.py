"""A CPU platform for verl, registered through ``verl.plugin.platform.PlatformRegistry``.

verl 0.9.1 only ships nvidia / huawei / amd platforms and falls back to "nvidia" (device "cuda")
when nothing is detected. This module adds a ``"cpu"`` platform, selected by ``VERL_PLATFORM=cpu``:

- ``device_name == "cpu"``, ``current_device() == "cpu"`` (verl calls ``.to(get_device_id())``,
  where an int would mean ``cuda:<int>``), process groups use gloo;
- the Ray resource name stays ``"GPU"`` so that fake accelerator slots
  (``+ray_kwargs.ray_init.num_gpus=N``) satisfy verl's placement groups and
  ``ResourcePoolManager._check_resource_available``, which only count accelerators;
- ``device_module`` is :class:`CPUDeviceModule`, a ``torch.cpu`` wrapper with the ``torch.cuda``
  calls verl makes (rng state for checkpoint resume, memory stats, ``empty_cache``...).

One small CPU fix is installed when the platform is selected (nothing in verl is edited):
verl builds the process-group backend as ``f"cpu:gloo,{device}:{backend}"``, i.e.
``"cpu:gloo,cpu:gloo"``, which torch rejects; :func:`_dedupe_backend` wraps
``torch.distributed.init_process_group`` to drop repeated device entries. It is CPU-only: on a GPU
the string is ``"cpu:gloo,cuda:nccl"``, which torch accepts. Work-arounds for verl bugs that hit
every platform live in ``verl_sat.verl_fixes`` (installed by the plugin everywhere).

``VERL_ENGINE_DEVICE`` defaults to ``cuda`` so that verl's FSDP engine, registered for
cuda/npu only, is found by ``EngineRegistry``; it runs on CPU tensors regardless.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch

from verl_sat.hooks import when_imported, wrap_once

PLATFORM_NAME = "cpu"


class CPUDeviceModule:
    """``torch.cpu`` plus the ``torch.cuda``-style calls verl makes on ``get_torch_device()``.

    Memory statistics report 0 (CPU memory is not tracked per device); ``mem_get_info`` reports
    the host's available/total memory.
    """

    # torch.cpu's own: is_available() is True, device_count() is 1, set_device and synchronize do nothing
    is_available = staticmethod(torch.cpu.is_available)
    device_count = staticmethod(torch.cpu.device_count)
    set_device = staticmethod(torch.cpu.set_device)
    synchronize = staticmethod(torch.cpu.synchronize)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def ipc_collect() -> None:
        return None

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return 0

    @staticmethod
    def max_memory_allocated(device: Any = None) -> int:
        return 0

    @staticmethod
    def memory_reserved(device: Any = None) -> int:
        return 0

    @staticmethod
    def max_memory_reserved(device: Any = None) -> int:
        return 0

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
        return None

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"


def _make_platform_class() -> type:
    """Build the ``PlatformBase`` subclass (deferred so importing this module stays cheap)."""
    from verl.plugin.platform import PlatformBase

    class PlatformCPU(PlatformBase):
        """verl platform for CPU-only hosts (gloo, fake "GPU" Ray slots)."""

        _device_module = CPUDeviceModule()

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> ModuleType:
            return self._device_module  # type: ignore[return-value]

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            # Never auto-detected: only VERL_PLATFORM=cpu selects it.
            return False

        def current_device(self) -> str:  # type: ignore[override]
            # verl passes this straight to ``.to(...)``: an int would mean "cuda:<int>".
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            # Ray sets CUDA_VISIBLE_DEVICES for "GPU" slots; harmless on CPU.
            return "CUDA_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            # "GPU": verl's ray_resource_options then asks Ray for num_gpus slots
            return "GPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    return PlatformCPU


def _dedupe_backend(backend: str | None) -> str | None:
    """``"cpu:gloo,cpu:gloo"`` -> ``"cpu:gloo"``: keep the first backend for each device type."""
    if not isinstance(backend, str) or ":" not in backend:
        return backend
    pairs: dict[str, str] = {}
    for pair in backend.split(","):
        device, _, name = pair.partition(":")
        pairs.setdefault(device.strip(), name.strip())
    return ",".join(f"{device}:{name}" for device, name in pairs.items())


def _install_backend_dedupe() -> None:
    """Wrap ``torch.distributed.init_process_group`` once so duplicated device entries are dropped."""
    import torch.distributed as dist

    def make(original: Any) -> Any:
        def init_process_group(backend: str | None = None, *args: Any, **kwargs: Any) -> Any:
            if "backend" in kwargs:
                kwargs["backend"] = _dedupe_backend(kwargs["backend"])
                return original(*args, **kwargs)
            return original(_dedupe_backend(backend), *args, **kwargs)

        return init_process_group

    wrap_once(dist, "init_process_group", "_verl_sat_dedupe", make)


def is_selected() -> bool:
    """True when ``VERL_PLATFORM=cpu``."""
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM_NAME


def _register_checkpoint_engine(module: ModuleType) -> None:
    import verl_sat.cpu.checkpoint_engine  # noqa: F401  (registers "ray_object_store")


def register() -> None:
    """Register the ``"cpu"`` platform and the ``ray_object_store`` checkpoint engine (lazily);
    when the platform is selected, install the CPU fix named in the module doc."""
    from verl.plugin.platform import PlatformRegistry

    if PlatformRegistry.get(PLATFORM_NAME) is None:
        PlatformRegistry.register(platform=PLATFORM_NAME)(_make_platform_class())
    when_imported("verl.checkpoint_engine.base", _register_checkpoint_engine)
    if not is_selected():
        return
    os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")
    _install_backend_dedupe()
