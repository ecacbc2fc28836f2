"""Where verl-sat's files live, and the one reader (and writer) of each file format a run leaves.

- the Hydra configs: the repository's top-level ``hydra_configs/`` (:func:`hydra_config_dir`);
- JSON lines (``samples.jsonl``, and any ``*.jsonl`` a run writes): :func:`read_jsonl`,
  :func:`write_jsonl`, :func:`append_jsonl`;
- ``metrics.jsonl``, verl's file logger (one ``{"step", "data"}`` line per step):
  :func:`read_metrics`, rows flattened to ``{"step", **data}``;
- ``run.json``, the run record: :func:`read_run_record`, :func:`update_run_record`.

Checkpoints are verl's own layout and are read by ``verl_sat.trainer.faults``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import verl_sat

HYDRA_CONFIG_DIRNAME = "hydra_configs"
METRICS_FILE = "metrics.jsonl"
RUN_RECORD = "run.json"


def repo_root() -> Path:
    """The directory that holds the ``verl_sat`` package (the repository root in a checkout)."""
    return Path(verl_sat.__file__).resolve().parents[1]


def hydra_config_dir() -> Path:
    """The ``hydra_configs`` directory next to the ``verl_sat`` package.

    The YAML is kept at the repository's top level so that a reader finds it beside ``recipes/``;
    an editable install (``pip install -e .``) imports ``verl_sat`` from the checkout, so the same
    directory is found both ways.

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


# ---------------------------------------------------------------------------------------------
# JSON lines
# ---------------------------------------------------------------------------------------------
def _objects(path: Path, strict: bool) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, JSON object) of each line of ``path`` that holds one."""
    path = Path(path)
    if not path.exists():
        return
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if strict:
                raise ValueError(f"{path}: line {lineno} is not valid JSON ({exc.msg})") from exc
            continue
        if isinstance(row, dict):
            yield lineno, row
        elif strict:
            raise ValueError(f"{path}: line {lineno} is not a JSON object")


def read_jsonl(path: Path, strict: bool = False) -> list[dict[str, Any]]:
    """The JSON objects of ``path``, one a line ([] if the file is missing).

    ``strict=False`` (a file being written, or one a killed writer left): a line that does not
    parse is skipped. ``strict=True`` (a finished run read for a report): such a line, or one
    that is not a JSON object, raises ``ValueError`` naming the file and the line number.
    """
    return [row for _, row in _objects(path, strict)]


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    """Replace ``path`` atomically (temporary file, then rename)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


def append_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    """Append ``rows`` to ``path``, one JSON line each."""
    rows = list(rows)
    if rows:
        with open(path, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


def read_metrics(path: Path, strict: bool = False) -> list[dict[str, Any]]:
    """Rows of verl's file logger (``{"step", "data"}``) flattened to ``{"step", **data}``.

    A row already flat (``{"step", ...}``) is kept as it is. ``strict``: as :func:`read_jsonl`,
    and a line without an integer ``step`` raises ``ValueError`` naming the file and the line.
    """
    rows = []
    for lineno, row in _objects(path, strict):
        step = row.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            if strict:
                raise ValueError(f"{path}: line {lineno} has no integer 'step' (got {step!r})")
            continue
        data = row.get("data")
        rows.append({"step": step, **data} if isinstance(data, dict) else row)
    return rows


# ---------------------------------------------------------------------------------------------
# run.json
# ---------------------------------------------------------------------------------------------
def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path`` (None if missing, unreadable or not an object)."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def write_json(path: Path, record: dict[str, Any], indent: int = 1) -> None:
    """Write ``record`` to ``path`` atomically (temporary file, then rename)."""
    tmp = Path(path).with_name(Path(path).name + ".tmp")
    tmp.write_text(json.dumps(record, indent=indent, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_run_record(run_dir: Path) -> dict[str, Any]:
    """``<run_dir>/run.json`` ({} if missing or unreadable)."""
    return read_json(Path(run_dir) / RUN_RECORD) or {}


def update_run_record(run_dir: Path, **sections: Any) -> None:
    """Add ``sections`` to ``run.json``."""
    write_json(Path(run_dir) / RUN_RECORD, {**read_run_record(run_dir), **sections})
