"""Post-import hooks: register verl-sat's pieces when verl imports the registries they join.

Used by the plugin (``sat_<mode>`` trainers), the CPU platform (weight sync engine) and the HF
rollout (replica and adapter), so that ``import verl`` stays as cheap as before.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from types import ModuleType


def when_imported(module_name: str, hook: Callable[[ModuleType], None]) -> None:
    """Run ``hook(module)`` once ``module_name`` is imported (now, if it already is).

    Uses ``wrapt.register_post_import_hook`` (wrapt is a dependency of verl-sat); without
    wrapt the module is imported eagerly instead.
    """
    if module_name in sys.modules:
        hook(sys.modules[module_name])
        return
    try:
        import wrapt
    except ImportError:
        hook(importlib.import_module(module_name))
        return
    wrapt.register_post_import_hook(hook, module_name)
