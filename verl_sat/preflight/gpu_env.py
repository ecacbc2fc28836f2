"""The 1-GPU smoke's environment probe (docs/reproduce.md; recipes/sat_paper/smoke_1gpu.sh, stage ``env``).

The smoke puts a trainer and a standalone SGLang server on ONE GPU, so Ray must offer two "GPU"
slots that both land on it. Two ways, tried in this order (``SLOT_MODES``):

- ``repeat``: ``CUDA_VISIBLE_DEVICES=G,G`` and ``ray_init.num_gpus=2``. Ray hands each slot one
  entry of that list, so each worker sees ``CUDA_VISIBLE_DEVICES=G``. Unproven: some drivers (and
  torch's NVML count) treat a repeated ordinal as invalid.
- ``runtime_env``: ``CUDA_VISIBLE_DEVICES=G``, ``ray_init.num_gpus=2`` and, through
  ``ray_kwargs.ray_init.runtime_env.env_vars`` (merged into every worker's environment),
  ``CUDA_VISIBLE_DEVICES=G`` with ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` so that Ray
  does not rewrite it. verl's workers then select ``cuda:<Ray's GPU id>`` (worker.py), which the
  probe does too.

Each mode is probed as the launch would use it: ``torch.cuda.device_count()`` under the exact
``CUDA_VISIBLE_DEVICES``, then a Ray cluster with two one-GPU actors that each allocate a tensor
on the device verl would pick. The probe also imports sglang, megatron-core, the bridge verl's
Megatron engine imports and TransformerEngine. It prints one PASS/FAIL line per item, writes a
JSON report and a bash file of the chosen mode (``SLOT_MODE``, ``SLOT_CUDA_VISIBLE_DEVICES``,
``SLOT_OVERRIDES``) that the smoke sources; exit 1 when an import fails or no mode works.

Runs by path (``python verl_sat/preflight/gpu_env.py ...``): torch, ray and the probed packages
are imported inside the functions only.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

SLOT_MODES = ("repeat", "runtime_env")
NOSET = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
# (label, module) imported by the probe; the bridge is added by --bridge.
IMPORTS = (
    ("sglang", "sglang"),
    ("megatron-core", "megatron.core"),
    ("TransformerEngine", "transformer_engine.pytorch"),
)


def visible_devices(mode: str, gpu: str) -> str:
    """The launch's ``CUDA_VISIBLE_DEVICES`` in ``mode``."""
    if mode not in SLOT_MODES:
        raise ValueError(f"slot mode must be one of {list(SLOT_MODES)}, got {mode!r}")
    return f"{gpu},{gpu}" if mode == "repeat" else gpu


def slot_overrides(mode: str, gpu: str) -> list[str]:
    """The Hydra overrides that give verl two Ray GPU slots on GPU ``gpu`` in ``mode``."""
    visible_devices(mode, gpu)  # validates the mode
    overrides = ["+ray_kwargs.ray_init.num_gpus=2"]
    if mode == "runtime_env":
        env = "+ray_kwargs.ray_init.runtime_env.env_vars"
        overrides += [f"{env}.CUDA_VISIBLE_DEVICES='{gpu}'", f"{env}.{NOSET}='1'"]
    return overrides


def slots_file(mode: str, gpu: str) -> str:
    """The bash lines the smoke sources after the probe."""
    overrides = " ".join(shlex.quote(o) for o in slot_overrides(mode, gpu))
    return (
        f"SLOT_MODE={mode}\n"
        f"SLOT_CUDA_VISIBLE_DEVICES={shlex.quote(visible_devices(mode, gpu))}\n"
        f"SLOT_OVERRIDES=({overrides})\n"
    )


# ---------------------------------------------------------------------------------------------
# probes (each returns a dict with "ok"; run in child processes under the mode's environment)
# ---------------------------------------------------------------------------------------------
def probe_import(module: str) -> dict:
    import importlib
    from importlib import metadata

    try:
        mod = importlib.import_module(module)
    except Exception as err:  # noqa: BLE001 (any failure is the finding)
        return {"ok": False, "error": f"{type(err).__name__}: {str(err).strip()[:300]}"}
    top = module.split(".")[0]
    names = {"megatron": "megatron-core", "transformer_engine": "transformer-engine"}
    dist = "megatron-bridge" if module == "megatron.bridge" else names.get(top, top)
    try:
        version = metadata.version(dist)
    except metadata.PackageNotFoundError:
        version = getattr(mod, "__version__", None)
    return {"ok": True, "version": version}


def probe_torch_devices() -> dict:
    """``torch.cuda.device_count()`` here, and a tensor on every ordinal it reports."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    report = {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "device_count": count}
    try:
        for i in range(count):
            torch.ones(1, device=f"cuda:{i}").sum().item()
    except Exception as err:  # noqa: BLE001
        return {**report, "ok": False, "error": f"{type(err).__name__}: {err}"}
    return {**report, "ok": count >= 1}


def probe_ray_slots(mode: str, gpu: str) -> dict:
    """Two one-GPU Ray actors as verl places them; each allocates on the device verl selects."""
    import ray

    env_vars = {"CUDA_VISIBLE_DEVICES": gpu, NOSET: "1"} if mode == "runtime_env" else {}
    ray.init(num_gpus=2, num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env_vars})
    try:

        @ray.remote(num_gpus=1)
        class Slot:
            def check(self) -> dict:
                import torch

                ids = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
                out = {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "ray_gpu_ids": ids}
                try:
                    device = int(ids[0]) if os.environ.get(NOSET) and ids else 0  # verl's worker.py
                    torch.cuda.set_device(device)
                    torch.ones(1, device=f"cuda:{device}").sum().item()
                    return {**out, "device": device, "ok": True}
                except Exception as err:  # noqa: BLE001
                    return {**out, "ok": False, "error": f"{type(err).__name__}: {err}"}

        slots = [Slot.remote() for _ in range(2)]
        results = ray.get([s.check.remote() for s in slots], timeout=180)
    finally:
        ray.shutdown()
    return {"ok": all(r["ok"] for r in results), "slots": results}


def probe_mode(mode: str, gpu: str, runner: Callable[[list[str], dict], dict] | None = None) -> dict:
    """``probe_torch_devices`` and ``probe_ray_slots`` in a child process under ``mode``'s
    ``CUDA_VISIBLE_DEVICES`` (CUDA reads it once per process)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=visible_devices(mode, gpu))
    command = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--gpu", gpu]
    return (runner or run_child)(command, env)


def run_child(command: list[str], env: dict) -> dict:
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    lines = done.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return {"ok": False, "error": f"exit {done.returncode}: {(done.stderr or done.stdout).strip()[-600:]}"}


def child(mode: str, gpu: str) -> dict:
    torch_report = probe_torch_devices()
    if not torch_report["ok"]:
        return {"ok": False, "torch": torch_report}
    try:
        ray_report = probe_ray_slots(mode, gpu)
    except Exception as err:  # noqa: BLE001
        ray_report = {"ok": False, "error": f"{type(err).__name__}: {err}"}
    return {"ok": ray_report["ok"], "torch": torch_report, "ray": ray_report}


# ---------------------------------------------------------------------------------------------
# the stage
# ---------------------------------------------------------------------------------------------
def choose_mode(reports: dict[str, dict]) -> str | None:
    """The first of ``SLOT_MODES`` whose probe passed."""
    return next((mode for mode in SLOT_MODES if reports.get(mode, {}).get("ok")), None)


def describe(report: dict) -> str:
    torch_report = report.get("torch", {})
    parts = []
    if torch_report:
        parts.append(
            f"torch.cuda.device_count()={torch_report.get('device_count')} under "
            f"CUDA_VISIBLE_DEVICES={torch_report.get('cuda_visible_devices')}"
        )
    for slot in report.get("ray", {}).get("slots", []):
        parts.append(f"slot ids={slot.get('ray_gpu_ids')} -> {'ok' if slot['ok'] else slot.get('error')}")
    error = report.get("error") or torch_report.get("error") or report.get("ray", {}).get("error")
    return "; ".join(parts + ([error] if error else []))


def run_probe(
    gpu: str,
    bridge: str,
    import_fn: Callable[[str], dict] = probe_import,
    mode_fn: Callable[[str, str], dict] = probe_mode,
) -> dict:
    """Imports, then the slot modes in order until one works (the fallback only if needed)."""
    imports = {label: import_fn(module) for label, module in (*IMPORTS, (bridge, bridge))}
    modes: dict[str, dict] = {}
    for mode in SLOT_MODES:
        modes[mode] = mode_fn(mode, gpu)
        if modes[mode].get("ok"):
            break
    chosen = choose_mode(modes)
    ok = chosen is not None and all(r["ok"] for r in imports.values())
    return {"ok": ok, "gpu": gpu, "mode": chosen, "imports": imports, "modes": modes}


def print_report(report: dict) -> None:
    for label, result in report["imports"].items():
        status = "PASS" if result["ok"] else "FAIL"
        print(f"[smoke]   {status} import {label}: {result.get('version') if result['ok'] else result['error']}")
    for mode, result in report["modes"].items():
        status = "PASS" if result.get("ok") else "FAIL"
        print(f"[smoke]   {status} two Ray GPU slots, mode {mode}: {describe(result)}")
    if report["mode"] is None:
        print("[smoke]   no way to give Ray two GPU slots on one device was found")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", default="0", help="the physical GPU index the smoke uses")
    parser.add_argument("--bridge", default="megatron.bridge", help="the bridge module verl imports")
    parser.add_argument("--slots-file", type=Path, help="write the chosen mode as bash assignments here")
    parser.add_argument("--json", type=Path, help="write the whole report here")
    parser.add_argument("--child", choices=SLOT_MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.gpu)))
        return 0
    report = run_probe(args.gpu, args.bridge)
    print_report(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if report["mode"] and args.slots_file:
        args.slots_file.parent.mkdir(parents=True, exist_ok=True)
        args.slots_file.write_text(slots_file(report["mode"], args.gpu))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
