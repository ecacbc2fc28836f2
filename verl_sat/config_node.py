"""The ``sat:`` node of a Hydra config read into its dataclasses, in one pass (docs/sat.md#setting).

``verl_sat.trainer.recipe.SATRecipeConfig`` and its nested sections (``sat.sentinel``, ``sat.faults``,
``sat.auto_lag``, ``sat.heldout``) are plain dataclasses. A field declared with :func:`checked` (or
:func:`flag`, :func:`one_of`, :func:`integer`, :func:`number`) carries its own check, which
:func:`check_fields` runs in the class's ``__post_init__``, naming the dotted key and the value;
:func:`config_from_node` checks the keys, naming an unknown one under its prefix.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection
from typing import Any, TypeVar

Config = TypeVar("Config")


def config_from_node(cls: type[Config], node: Any, prefix: str) -> Config:
    """``cls`` (a dataclass) from its Hydra node (DictConfig, mapping or None), in one pass.

    A field whose ``default_factory`` is a dataclass (``sat.sentinel``, ``sat.faults``...) is built
    from its sub-node the same way. An unknown key is a ValueError naming it under its dotted prefix
    (``sat.sentinel.foo``) and listing the known ones; each class's ``__post_init__`` checks the values.
    """
    if node is not None and hasattr(node, "_metadata"):  # an OmegaConf node
        from omegaconf import OmegaConf

        node = OmegaConf.to_container(node, resolve=True)
    if node is not None and not isinstance(node, dict):
        raise ValueError(f"{prefix} must be a mapping of keys, got {node!r}")
    values = dict(node or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        names = ", ".join(f"{prefix}.{key}" for key in unknown)
        raise ValueError(f"unknown key(s) under {prefix}: {names}; known: {sorted(fields)}")
    for name, field in fields.items():
        nested = field.default_factory
        if dataclasses.is_dataclass(nested) and not isinstance(values.get(name), nested):
            values[name] = config_from_node(nested, values.get(name), f"{prefix}.{name}")
    return cls(**values)


# ---------------------------------------------------------------------------------------------
# fields that carry their check
# ---------------------------------------------------------------------------------------------
def checked(default: Any, ok: Callable[[Any], bool], expected: str) -> Any:
    """A dataclass field whose value must satisfy ``ok``; ``expected`` says what it must be."""
    return dataclasses.field(default=default, metadata={"ok": ok, "expected": expected})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def flag(default: bool, expected: str = "a bool") -> Any:
    """A bool field (``true`` / ``false`` in YAML; no 1 or ``"yes"``)."""
    return checked(default, lambda value: isinstance(value, bool), expected)


def one_of(default: str, choices: Collection[str]) -> Any:
    """A field holding one of ``choices`` (listed in the error as given)."""
    return checked(default, lambda value: value in choices, f"one of {list(choices)}")


def text(default: str) -> Any:
    """A non-empty string field."""
    return checked(default, lambda value: isinstance(value, str) and bool(value), "a non-empty string")


def integer(default: int, low: int) -> Any:
    """An integer field >= ``low`` (a bool or a float is refused)."""
    return checked(default, lambda value: _is_int(value) and value >= low, f"an integer >= {low}")


def number(default: float, strictly_positive: bool, expected: str = "a finite number") -> Any:
    """A finite number > 0 (``strictly_positive``) or >= 0 (a bool is refused)."""
    bound = "> 0" if strictly_positive else ">= 0"

    def ok(value: Any) -> bool:
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
            return False
        return value > 0 if strictly_positive else value >= 0

    return checked(default, ok, f"{expected} {bound}")


def check_fields(config: Any, prefix: str) -> None:
    """Run each field's check (:func:`checked`): ValueError ``<prefix>.<name> must be <expected>, got <value>``."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if "ok" in field.metadata and not field.metadata["ok"](value):
            raise ValueError(f"{prefix}.{field.name} must be {field.metadata['expected']}, got {value!r}")
