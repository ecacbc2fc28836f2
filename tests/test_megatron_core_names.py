"""Every ``megatron.core`` name verl 0.9.1 imports on the paper cell's path exists in the megatron-core
the GPU install pins (``verl_sat.preflight.stack``), read from that version's wheel: it needs
Python >= 3.12 and cannot be imported here, so its ``.py`` files are parsed with ``ast``.

The path: verl's Megatron engine (``verl.workers.engine.megatron``) and its workers
(``verl.workers.engine_workers``), with every verl module they import, at module level or inside a
function (router replay, checkpointing, the optimizer, the model patches). docs/gpu_path.md lists the
names; the list is checked against what verl's installed source imports.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from verl_sat.preflight.stack import GPU_STACK

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes" / "sat_paper"))
from gpu_stack import TARGET_PLATFORMS, TARGET_PYTHON  # noqa: E402  (install_gpu.sh's target)

ROOTS = ("verl.workers.engine.megatron", "verl.workers.engine_workers")
DOC = Path(__file__).resolve().parents[1] / "docs" / "gpu_path.md"
WHEELS = Path.home() / ".cache" / "verl-sat" / "wheels"
OFF_PATH = {
    ("megatron.core.dist_checkpointing.strategies.base", "async_calls"): (
        "imported inside verl's checkpoint manager only with checkpoint.async_save=true; the paper cells keep "
        "verl's default false"
    ),
}
"""Unguarded names the pinned megatron-core lacks, each off the paper cell's path (docs/gpu_path.md)."""


@dataclass(frozen=True)
class Imported:
    """One ``megatron.core`` name a verl module imports (``name`` None: ``import module``)."""

    module: str
    name: str | None
    guarded: bool


def _verl_source(module: str) -> Path | None:
    """The file of a verl module in the installed package, or None (not a module: a name)."""
    root = Path(importlib.util.find_spec("verl").origin).parent
    path = root.joinpath(*module.split(".")[1:])
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _guarded_lines(tree: ast.Module) -> set[int]:
    """Lines inside a ``try`` whose handlers catch an import failure."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
            h.type is None or re.search(r"Error|Exception", ast.unparse(h.type)) for h in node.handlers
        ):
            lines.update(n.lineno for stmt in node.body for n in ast.walk(stmt) if hasattr(n, "lineno"))
    return lines


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    """The absolute module of a (possibly relative) ``from ... import``."""
    if not node.level:
        return node.module or ""
    base = module.split(".")[: None if is_package else -1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@cache
def verl_megatron_core_imports() -> frozenset[Imported]:
    """The ``megatron.core`` imports of every verl module reachable from ROOTS (verl's installed source).

    A name counts as guarded only when every import of it sits in a ``try``.
    """
    found: list[Imported] = []
    seen: set[str] = set()
    todo = list(ROOTS)
    while todo:
        module = todo.pop()
        path = _verl_source(module)
        if module in seen or path is None:
            continue
        seen.add(module)
        tree = ast.parse(path.read_text())
        guarded = _guarded_lines(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _absolute(module, node, path.name == "__init__.py")
                if source.split(".")[0] == "verl":
                    todo += [source, *(f"{source}.{alias.name}" for alias in node.names)]
                elif source == "megatron.core" or source.startswith("megatron.core."):
                    found += [Imported(source, a.name, node.lineno in guarded) for a in node.names]
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "verl":
                        todo.append(alias.name)
                    elif alias.name.startswith("megatron.core"):
                        found.append(Imported(alias.name, None, node.lineno in guarded))
    keys = {(i.module, i.name) for i in found}
    return frozenset(Imported(m, n, all(i.guarded for i in found if (i.module, i.name) == (m, n))) for m, n in keys)


def megatron_core_wheel(version: str) -> Path:
    """megatron-core ``version``'s wheel for the GPU node, downloaded once into ~/.cache/verl-sat/wheels."""
    hits = sorted(WHEELS.glob(f"megatron_core-{version}-*.whl"))
    if not hits:
        platforms = [arg for tag in TARGET_PLATFORMS for arg in ("--platform", tag)]
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(WHEELS)]
            + ["--python-version", TARGET_PYTHON, "--implementation", "cp", *platforms, f"megatron-core=={version}"],
            check=True,
        )
        hits = sorted(WHEELS.glob(f"megatron_core-{version}-*.whl"))
    return hits[0]


class WheelSource:
    """A wheel's Python modules, parsed on demand: which modules exist and the names each defines."""

    def __init__(self, wheel: Path) -> None:
        self.zip = zipfile.ZipFile(wheel)
        self.files = {n for n in self.zip.namelist() if n.endswith(".py")}

    def file_of(self, module: str) -> str | None:
        """The wheel path of ``module`` (a package's ``__init__.py``), or None when absent."""
        base = module.replace(".", "/")
        return next((f for f in (f"{base}/__init__.py", f"{base}.py") if f in self.files), None)

    @cache  # noqa: B019 - one instance per test session
    def names(self, module: str) -> frozenset[str]:
        """Names bound at the top level of ``module`` (also under ``if``/``try``), star imports followed."""
        path = self.file_of(module)
        tree = ast.parse(self.zip.read(path))
        names: set[str] = set()
        body = list(tree.body)
        while body:
            stmt = body.pop()
            if isinstance(stmt, (ast.If, ast.Try, ast.With)):
                body += stmt.body + getattr(stmt, "orelse", []) + getattr(stmt, "finalbody", [])
                body += [s for h in getattr(stmt, "handlers", []) for s in h.body]
            elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(stmt.name)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(stmt, ast.Import):
                names.update((a.asname or a.name).split(".")[0] for a in stmt.names)
            elif isinstance(stmt, ast.ImportFrom):
                for alias in stmt.names:
                    if alias.name == "*":
                        source = _absolute(module, stmt, path.endswith("__init__.py"))
                        names |= self.names(source) if self.file_of(source) else set()
                    else:
                        names.add(alias.asname or alias.name)
        return frozenset(names)

    def defines(self, item: Imported) -> bool:
        """Whether ``from item.module import item.name`` (or ``import item.module``) would find it."""
        if self.file_of(item.module) is None:
            return False
        if item.name is None:
            return True
        return item.name in self.names(item.module) or self.file_of(f"{item.module}.{item.name}") is not None


def documented_names() -> set[tuple[str, str | None]]:
    """The names docs/gpu_path.md lists between its ``megatron-core-names`` markers."""
    text = DOC.read_text()
    block = text.split("<!-- megatron-core-names -->")[1].split("<!-- /megatron-core-names -->")[0]
    listed: set[tuple[str, str | None]] = set()
    for module, rest in re.findall(r"^- `(megatron\.core[\w.]*)`(.*)$", block, flags=re.M):
        names = re.findall(r"`([\w]+)`", rest.split(":", 1)[1]) if ":" in rest else []
        listed |= {(module, n) for n in names}
        if not names or "the module itself" in rest:
            listed.add((module, None))
    return listed


@pytest.fixture(scope="module")
def pinned_wheel() -> WheelSource:
    """The pinned megatron-core's source, from its wheel."""
    return WheelSource(megatron_core_wheel(GPU_STACK["megatron-core"]))


def test_verl_path_imports_found() -> None:
    """The walk reaches the engine, router replay, checkpointing and the optimizer."""
    modules = {i.module for i in verl_megatron_core_imports()}
    for expected in (
        "megatron.core.pipeline_parallel",  # the engine's forward/backward
        "megatron.core.transformer.moe.router",  # router replay
        "megatron.core.dist_checkpointing.strategies.torch",  # checkpointing
        "megatron.core.optimizer",  # the optimizer
    ):
        assert expected in modules, f"{expected} not among verl's imports: {sorted(modules)}"


def test_pinned_megatron_core_defines_every_name_verl_imports(pinned_wheel: WheelSource) -> None:
    """Each unguarded name exists in the pinned megatron-core's source, but those OFF_PATH names."""
    missing = {
        (i.module, i.name) for i in verl_megatron_core_imports() if not i.guarded and not pinned_wheel.defines(i)
    }
    assert missing == set(OFF_PATH), (
        f"megatron-core {GPU_STACK['megatron-core']} lacks what verl 0.9.1 imports: {sorted(missing - set(OFF_PATH))}"
        f"; present now (drop from OFF_PATH): {sorted(set(OFF_PATH) - missing)}"
    )


def test_wheel_reader_finds_absent_names(pinned_wheel: WheelSource) -> None:
    """The reader tells a missing name and a missing module from present ones."""
    assert pinned_wheel.defines(Imported("megatron.core.optimizer", "get_megatron_optimizer", False))
    assert not pinned_wheel.defines(Imported("megatron.core.optimizer", "no_such_optimizer", False))
    assert not pinned_wheel.defines(Imported("megatron.core.no_such_module", None, False))


def test_docs_list_the_names_verl_imports(pinned_wheel: WheelSource) -> None:
    """docs/gpu_path.md lists exactly the names verl imports on the path."""
    imported = {(i.module, i.name) for i in verl_megatron_core_imports()}
    listed = documented_names()
    unlisted, stale = sorted(imported - listed, key=str), sorted(listed - imported, key=str)
    assert imported == listed, f"not listed: {unlisted}; listed but not imported: {stale}"
