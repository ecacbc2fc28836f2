"""Where verl-sat's files live: the Hydra configs next to the package.

The YAML is kept in the repository's top-level ``hydra_configs/`` so that a reader finds it
beside ``recipes/``; an editable install (``pip install -e .``) imports ``verl_sat`` from the
checkout, so the same directory is found both ways.
"""

from __future__ import annotations

from pathlib import Path

import verl_sat

HYDRA_CONFIG_DIRNAME = "hydra_configs"


def repo_root() -> Path:
    """The directory that holds the ``verl_sat`` package (the repository root in a checkout)."""
    return Path(verl_sat.__file__).resolve().parents[1]


def hydra_config_dir() -> Path:
    """The ``hydra_configs`` directory next to the ``verl_sat`` package.

    Raises:
        FileNotFoundError: when the directory is missing, e.g. after a non-editable install
            that did not ship the configs.
    """
    path = repo_root() / HYDRA_CONFIG_DIRNAME
    if not path.is_dir():
        raise FileNotFoundError(
            f"verl-sat's Hydra configs were not found at {path}. They live in the repository's "
            f"top-level '{HYDRA_CONFIG_DIRNAME}/' directory: install verl-sat editable from a checkout "
            "(pip install -e .) or pass --config-path to the launcher."
        )
    return path
