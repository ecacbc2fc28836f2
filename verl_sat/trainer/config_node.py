"""The ``sat:`` node of a Hydra config read into its dataclasses, in one pass (docs/sat.md#setting).

``verl_sat.trainer.recipe.SATRecipeConfig`` and its nested sections (``sat.sentinel``, ``sat.faults``,
``sat.auto_lag``, ``sat.heldout``) are plain dataclasses whose ``__post_init__`` checks each value and
names its dotted key; :func:`config_from_node` checks the keys, naming an unknown one under its prefix.
"""

from __future__ import annotations

import dataclasses
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
