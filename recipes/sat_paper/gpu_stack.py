"""What ``install_gpu.sh`` asks of the paper's GPU stack, one list a line (docs/reproduce.md,
"Install on the GPU node"): the pins pip resolves together, those installed with ``--no-deps``, the
requirements those still carry, pip's target for the GPU node, and pip's ``--report`` checked against
the pins.

The stack itself (``GPU_STACK``, ``OVERRIDES``) is ``verl_sat/preflight/stack.py``, the preflight's
data, loaded here by path: this script runs on a fresh Python (standard library and ``packaging``
only), before verl-sat or its requirements are installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

STACK_FILE = Path(__file__).resolve().parents[2] / "verl_sat" / "preflight" / "stack.py"


def _load_stack() -> ModuleType:
    spec = importlib.util.spec_from_file_location("verl_sat_gpu_stack", STACK_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


stack = _load_stack()
GPU_STACK, OVERRIDES, Override = stack.GPU_STACK, stack.OVERRIDES, stack.Override
canonical_name, override_for = stack.canonical_name, stack.override_for

EXTRAS: dict[str, tuple[str, ...]] = {
    "verl": ("verl-core",),
    "ray": ("default",),
    "megatron-core": ("dev", "mlm"),
}
"""Extras installed with a package: verl's core extra (TransferQueue, uvicorn, ...), Ray's dashboard
and job agent (verl asks for ``ray[default]``), and the two megatron-core extras Megatron-Bridge
asks for (``megatron-core[dev,mlm]``)."""

SOURCE_BUILDS: frozenset[str] = frozenset({"transformer-engine-torch"})
"""Packages PyPI ships only as source, built with ``--no-build-isolation`` against the installed
torch; the binary-only dry run cannot resolve them (docs/gpu_path.md)."""

SGLANG_KERNEL_CU130_WHEEL = (
    "https://github.com/sgl-project/whl/releases/download/v0.4.2.post2/"
    "sglang_kernel-0.4.2.post2+cu130-cp310-abi3-manylinux2014_x86_64.whl"
    "#sha256=4e7ce619274234d182b20da883fcf1d20e7e55cbea90d62244e2b6a3d6c0fc85"
)
"""SGLang's CUDA 13 build of its pinned kernel, which verl's SGLang 0.5.12 image installs over the
index's wheel on x86_64 (``0.4.2.post2+cu130`` meets ``==0.4.2.post2``)."""

PURE_PYTHON_SDISTS: tuple[str, ...] = ("antlr4-python3-runtime==4.9.*", "wget", "pylatexenc")
"""Pure-Python packages of the resolved set that the index ships only as source (hydra-core's
antlr4, megatron-core's ``dev`` extra's wget, verl's pylatexenc). pip builds them on the node; the
binary-only dry run gets them as wheels built here first (``py3-none-any``, valid on any node)."""

RESOLVER_PIP = "26.3"
"""The pip the install and the dry run use: pip 23.2 (Python 3.11's bundled pip) checks a
``--python-version 3.12`` target's ``Requires-Python`` against the running interpreter."""

TARGET_PYTHON = "3.12"
"""The only Python both verl 0.9.1 (<3.13) and Megatron-Bridge (>=3.12,<3.13) accept."""

TARGET_PLATFORMS: tuple[str, ...] = (
    "manylinux2014_x86_64",
    *(f"manylinux_2_{minor}_x86_64" for minor in range(17, 36)),
)
"""Every platform tag a current x86_64 GPU node (glibc 2.35) accepts: SGLang 0.5.12's wheels are
``manylinux_2_34``, Ray's ``manylinux2014``, megatron-core's ``manylinux_2_28``."""

TARGET_ENVIRONMENT: dict[str, str] = {
    "python_version": TARGET_PYTHON,
    "python_full_version": f"{TARGET_PYTHON}.0",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
}
"""The markers of that node, to evaluate a no-deps package's requirements for it."""


def no_deps_packages() -> tuple[str, ...]:
    """The packages installed with ``--no-deps``: every dependent of an override, in stack order."""
    dependents = {canonical_name(o.dependent) for o in OVERRIDES}
    return tuple(name for name in GPU_STACK if name in dependents)


def pin(name: str) -> str:
    """``name[extras]==version`` for a package of the stack."""
    key = canonical_name(name)
    if key not in GPU_STACK:
        raise KeyError(f"{name!r} is not a package of GPU_STACK ({', '.join(GPU_STACK)})")
    extras = EXTRAS.get(key, ())
    return f"{key}{'[' + ','.join(extras) + ']' if extras else ''}=={GPU_STACK[key]}"


def resolved_pins() -> list[str]:
    """The pins pip resolves together: the stack without the ``--no-deps`` and source-built packages."""
    skip = set(no_deps_packages()) | SOURCE_BUILDS
    return [pin(name) for name in GPU_STACK if name not in skip]


def project_requirements(pyproject: Path) -> list[str]:
    """verl-sat's own requirements (``[project].dependencies``), installed with the stack."""
    import tomllib

    return list(tomllib.loads(pyproject.read_text())["project"]["dependencies"])


def _met_by_pin(dependent: str, requirement: str) -> None:
    """Check that the pin of a ``--no-deps`` package meets ``dependent``'s requirement on it."""
    from packaging.requirements import Requirement

    req = Requirement(requirement)
    name = canonical_name(req.name)
    missing = {canonical_name(e) for e in req.extras} - set(EXTRAS.get(name, ()))
    if not req.specifier.contains(GPU_STACK[name], prereleases=True) or missing:
        raise ValueError(
            f"{dependent} requires {requirement}, the stack installs {pin(name)}: "
            "change the pin or name an Override with its reason"
        )


def kept_requirements(report: dict) -> list[str]:
    """Requirements of the ``--no-deps`` packages in a pip ``--report`` that the install still meets.

    Each package's declared requirements, evaluated for the GPU node's markers and the extras it is
    installed with, less the named overrides. A requirement on another ``--no-deps`` package is met
    by that package's pin (checked here, not passed to pip); a version other than the pin is an
    error naming both.
    """
    from packaging.requirements import Requirement

    no_deps = set(no_deps_packages())
    kept: list[str] = []
    for item in report["install"]:
        meta = item["metadata"]
        name = canonical_name(meta["name"])
        if name not in no_deps:
            continue
        if meta["version"] != GPU_STACK[name]:
            raise ValueError(f"pip chose {name} {meta['version']}, the stack pins {GPU_STACK[name]}")
        environments = [{**TARGET_ENVIRONMENT, "extra": extra} for extra in ("", *EXTRAS.get(name, ()))]
        for line in meta.get("requires_dist", []):
            req = Requirement(line)
            if req.marker is not None and not any(req.marker.evaluate(env) for env in environments):
                continue
            if override_for(name, line) is not None:
                continue
            if canonical_name(req.name) in no_deps:
                _met_by_pin(name, line)
                continue
            req.marker = None
            kept.append(str(req))
    return kept


def stale_overrides(report: dict) -> list[Override]:
    """Overrides whose requirement the dependent in a pip ``--report`` no longer declares."""
    from packaging.requirements import Requirement

    declared: dict[str, list[str]] = {
        canonical_name(i["metadata"]["name"]): i["metadata"].get("requires_dist", []) for i in report["install"]
    }
    return [
        o
        for o in OVERRIDES
        if not any(
            Requirement(o.requirement) == Requirement(line) for line in declared.get(canonical_name(o.dependent), [])
        )
    ]


def resolved_summary(report: dict) -> list[str]:
    """The stack as pip's resolver answered it, one ``name==version`` a line, checked against the pins.

    Raises ValueError naming the package when pip chose another version than the pin, or pulled in
    a ``--no-deps`` package (pip would then install that package's own pins too).
    """
    chosen = {canonical_name(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}
    skipped = set(no_deps_packages()) | SOURCE_BUILDS
    pulled = sorted(skipped & set(chosen))
    if pulled:
        raise ValueError(f"the resolved set pulls in {', '.join(pulled)}, which the install builds or adds on its own")
    lines = [f"resolved {len(chosen)} packages for Python {TARGET_PYTHON} on manylinux x86_64:"]
    for name, version in GPU_STACK.items():
        if name in skipped:
            how = "--no-deps" if name in no_deps_packages() else "built from source on the node"
            lines.append(f"  {name}=={version} ({how})")
        elif chosen.get(name) != version:
            raise ValueError(f"pip chose {name} {chosen.get(name, '(none)')}, the stack pins {version}")
        else:
            lines.append(f"  {name}=={version}")
    return lines


def _kept_lines(report: dict) -> list[str]:
    """The kept requirements, after checking that every override is still declared."""
    stale = stale_overrides(report)
    if stale:
        named = "; ".join(f"{o.dependent}: {o.requirement}" for o in stale)
        raise ValueError(f"the packages no longer declare these overridden requirements (update OVERRIDES): {named}")
    return kept_requirements(report)


_PRINTERS = {
    "requirements": ("the pins pip resolves together", resolved_pins),
    "no_deps": ("the pins installed with --no-deps", lambda: [pin(n) for n in no_deps_packages()]),
    "source_builds": ("the pins built from source", lambda: [pin(n) for n in GPU_STACK if n in SOURCE_BUILDS]),
    "pure_sdists": ("pure-Python sdists the dry run builds", lambda: list(PURE_PYTHON_SDISTS)),
    "overrides": (
        "the overrides with their reasons",
        lambda: [f"{o.dependent}: {o.requirement} ({o.reason})" for o in OVERRIDES],
    ),
    "platforms": ("pip's --platform tags for the GPU node", lambda: list(TARGET_PLATFORMS)),
    "python_version": ("the GPU node's Python", lambda: [TARGET_PYTHON]),
    "pip": ("the pip the install uses", lambda: [RESOLVER_PIP]),
    "sglang_kernel_wheel": ("SGLang's CUDA 13 kernel wheel", lambda: [SGLANG_KERNEL_CU130_WHEEL]),
}


def main(argv: list[str] | None = None) -> int:
    """Print one list for ``install_gpu.sh``, one item a line; exit 1 with the reason on a bad report."""
    parser = argparse.ArgumentParser(prog="gpu_stack.py", description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    for key, (text, _) in _PRINTERS.items():
        group.add_argument(f"--{key.replace('_', '-')}", action="store_true", help=text)
    group.add_argument("--project", type=Path, metavar="PYPROJECT", help="verl-sat's own requirements")
    group.add_argument("--kept", type=Path, metavar="REPORT", help="kept requirements of the --no-deps packages")
    group.add_argument("--check-resolved", type=Path, metavar="REPORT", help="the resolved stack, checked")
    args = parser.parse_args(argv)
    try:
        if args.project:
            lines = project_requirements(args.project)
        elif args.kept:
            lines = _kept_lines(json.loads(args.kept.read_text()))
        elif args.check_resolved:
            lines = resolved_summary(json.loads(args.check_resolved.read_text()))
        else:
            lines = next(make() for key, (_, make) in _PRINTERS.items() if getattr(args, key))
    except ValueError as err:
        print(f"gpu_stack.py: {err}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
