"""Import a study's script (studies/<folder>/<name>.py) as a module, by its path, for the tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

STUDIES = Path(__file__).resolve().parents[1] / "studies"


def load_study(folder: str, name: str) -> ModuleType:
    """``studies/<folder>/<name>.py`` executed as the module ``name`` (registered in sys.modules,
    so the dataclasses and pickling it defines resolve)."""
    spec = importlib.util.spec_from_file_location(name, STUDIES / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
