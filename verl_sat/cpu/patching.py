"""What verl-sat's CPU patch modules (``megatron``, ``sglang``, ``vllm``) share: the version gate
(:func:`require`, :func:`checked`), since each patch reaches into one release's internals, and the
module-scoped torch stand-in (:class:`ScopedTorch`, :func:`scope`), since a patch never replaces
``torch`` itself.
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import torch


# ---------------------------------------------------------------------------------------------
# the version gate
# ---------------------------------------------------------------------------------------------
class VersionMismatch(RuntimeError):
    """An installed package that verl-sat's CPU patches were not written for."""


def installed_version(distribution: str) -> str | None:
    """The installed ``distribution``'s version, None without it."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def require(distribution: str, wanted: str, patches: str, install: str) -> None:
    """Refuse an installed ``distribution`` other than ``wanted``, the release the patch module
    ``patches`` was written for: the error names both versions and ``install``, how to get ``wanted``."""
    found = installed_version(distribution)
    if found != wanted:
        raise VersionMismatch(
            f"verl-sat's CPU patches ({patches}) were written for {distribution}=={wanted}, found "
            f"{distribution} {found or 'not installed'}; install it with {install} (or run on a GPU node, "
            f"where no patch is installed)"
        )


def checked(
    patch: Callable[[ModuleType], None], distribution: str, wanted: str, patches: str, install: str
) -> Callable[[ModuleType], None]:
    """``patch`` as a post-import hook, after ``require(distribution, wanted, patches, install)``."""

    def hook(module: ModuleType) -> None:
        require(distribution, wanted, patches, install)
        patch(module)

    return hook


# ---------------------------------------------------------------------------------------------
# the module-scoped torch stand-in
# ---------------------------------------------------------------------------------------------
def _fixed(factory: Callable[..., Any], fix: Callable[[dict[str, Any]], None]) -> Callable[..., Any]:
    @functools.wraps(factory)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        fix(kwargs)
        return factory(*args, **kwargs)

    return wrapper


class ScopedTorch(ModuleType):
    """``torch`` for one patched module: everything forwarded to torch, except the tensor factories
    named in ``factories``, whose keyword arguments ``fix`` changes in place before each call, and
    whatever is set on the stand-in itself."""

    def __init__(self, factories: Iterable[str], fix: Callable[[dict[str, Any]], None]) -> None:
        super().__init__("torch")
        for name in factories:
            setattr(self, name, _fixed(getattr(torch, name), fix))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def scope(module: ModuleType, stand_in: ScopedTorch) -> None:
    """Point ``module``'s global ``torch`` at ``stand_in`` (that module only)."""
    if getattr(module, "torch", None) is torch:
        module.torch = stand_in
