"""Post-import hooks: register verl-sat's pieces when verl imports the registries they join.

Used by the plugin (``sat_<mode>`` trainers), the CPU platform (weight sync engine) and the HF
rollout (replica and adapter), so that ``import verl`` stays as cheap as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import wrapt


def when_imported(module_name: str, hook: Callable[[ModuleType], None]) -> None:
    """Run ``hook(module)`` once ``module_name`` is imported (now, if it already is): wrapt's
    ``register_post_import_hook`` (a dependency of verl-sat), with the module name first."""
    wrapt.register_post_import_hook(hook, module_name)


def wrap_once(owner: Any, name: str, marker: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Replace ``owner.<name>`` by ``make(original)``, unless it already carries ``marker``.

    The replacement gets ``functools.wraps(original)`` (so ``__wrapped__`` is the original) and
    ``marker`` set, so a second call (a re-import, a second hook) leaves it as it is. ``owner`` is
    a class or an instance. Returns whether it wrapped.
    """
    original = getattr(owner, name)
    if getattr(original, marker, False):
        return False
    wrapped = functools.wraps(original)(make(original))
    setattr(wrapped, marker, True)
    setattr(owner, name, wrapped)
    return True
