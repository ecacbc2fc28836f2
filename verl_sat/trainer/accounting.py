"""Sample accounting: which prompts each global step trained, how many responses, how stale.

Every run writes ``<run_dir>/samples.jsonl``, one JSON object a line, appended by the trainer
(``SampleAccountingMixin`` on ``SATTrainerMixin``; docs/faults.md). A prompt's stable id is the
dataset row's ``index`` (verl's ``RLHFDataset`` copies ``extra_info.index`` into every row and
the agent loop carries it into each trajectory's TransferQueue fields, and needs it there). Events:

    {"event": "epoch_order", "ids": [...]}              the sampler's first-epoch order (fresh runs)
    {"event": "submitted", "step": g, "prompts": [[uid, id], ...]}   handed to the rollout at step g
    {"event": "trained", "step": g, "lag": n, "prompts": [{"id", "responses", "staleness": [lo, hi]}]}
    {"event": "reissued", "step": g, "count": k}        in-flight prompts regenerated on resume
    {"event": "in_flight_at_end", "step": g, "uids": [...]}          still in TransferQueue at the end

``staleness`` is in optimizer steps (docs/sat.md#diagnostics, ``verl_sat.trainer.actor.staleness_in_steps``), the
smallest and largest over the prompt's responses.

Resume (verl's ``trainer.resume_mode=auto``): the checkpoint of step k holds the weights after
step k, the dataloader position and TransferQueue (prompts in flight are re-issued). What an
interrupted attempt did after step k is redone, so ``prepare_resume`` moves its rows with
``step > k`` out of ``samples.jsonl`` and ``metrics.jsonl`` into ``*.superseded.jsonl``: both
files then hold one timeline, one row per step. verl 0.9.1's file logger opens ``metrics.jsonl``
with ``"wb"``; ``keep_metrics_on_resume`` writes back the rows it emptied.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from verl_sat.files import METRICS_FILE, append_jsonl, read_jsonl, write_jsonl
from verl_sat.hooks import when_imported, wrap_once
from verl_sat.processes import RUN_DIR_ENV

SAMPLES_FILE = "samples.jsonl"
SUPERSEDED_SUFFIX = ".superseded.jsonl"
# how much of the first epoch's order a fresh run records (enough for any run of its length)
EPOCH_ORDER_MARGIN = 64


# ---------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------
def _sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name.removesuffix(".jsonl") + suffix)


def _split_at(rows: Sequence[dict[str, Any]], step: int) -> tuple[list[dict], list[dict]]:
    """(rows of steps <= step, rows after it); rows without a step (epoch order) are kept."""
    kept = [r for r in rows if int(r.get("step", 0)) <= step]
    later = [r for r in rows if int(r.get("step", 0)) > step]
    return kept, later


def prepare_resume(run_dir: Path, step: int) -> dict[str, int]:
    """Before a resumed attempt starts from the checkpoint of ``step``: one timeline on disk.

    ``samples.jsonl`` and ``metrics.jsonl`` keep the rows of steps <= ``step``; later ones go to
    ``samples.superseded.jsonl`` / ``metrics.superseded.jsonl``. Returns how many step rows of
    each were superseded.
    """
    later: dict[str, list[dict]] = {}
    for name in (SAMPLES_FILE, METRICS_FILE):
        path = Path(run_dir) / name
        kept, later[name] = _split_at(read_jsonl(path), step)
        append_jsonl(_sibling(path, SUPERSEDED_SUFFIX), [{**r, "superseded_by_resume_from": step} for r in later[name]])
        if path.exists():
            write_jsonl(path, kept)
    return {
        "resumed_from_step": step,
        "superseded_metric_steps": len(later[METRICS_FILE]),
        "superseded_trained_steps": sum(r.get("event") == "trained" for r in later[SAMPLES_FILE]),
    }


def keep_metrics_on_resume(tracking: ModuleType) -> None:
    """verl 0.9.1's ``FileLogger`` opens ``VERL_FILE_LOGGER_PATH`` with ``"wb"``, emptying the
    rows a resumed run keeps (``prepare_resume``): they are written back once it has opened it.
    Only in a verl-sat job (``RUN_DIR_ENV`` set by its launch): the plugin loads this in every
    process that imports verl, and another verl run keeps verl's own truncation."""

    def make(original: Any) -> Any:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            path = os.environ.get("VERL_FILE_LOGGER_PATH")
            ours = path and os.environ.get(RUN_DIR_ENV) and os.path.isfile(path)
            kept = Path(path).read_bytes() if ours else b""
            original(self, *args, **kwargs)
            self.fp.write(kept)

        return __init__

    wrap_once(tracking.FileLogger, "__init__", "__verl_sat_keeps_rows__", make)


when_imported("verl.utils.tracking", keep_metrics_on_resume)  # in verl's TaskRunner, before its logger


# ---------------------------------------------------------------------------------------------
# the summary (run.json's "samples", the report)
# ---------------------------------------------------------------------------------------------
def summarize(run_dir: Path) -> dict[str, Any]:
    """Prompts trained, repeated, skipped and lost in flight, from ``samples.jsonl``.

    - ``prompts_trained``: distinct prompt ids trained; ``responses_trained``: their responses;
    - ``repeated``: ids trained in more than one step (0 within an epoch);
    - ``in_flight_at_end``: handed to the rollout, not trained, still in TransferQueue at the end;
    - ``lost_in_flight``: handed to the rollout and neither trained nor in flight at the end;
    - ``skipped``: ids the sampler's first epoch put before the last one handed out that were
      never handed out (null when the epoch order is not recorded);
    - ``regenerated``: in-flight prompts re-issued on resume;
    - ``staleness``: responses trained per staleness (optimizer steps, the response's worst case).
    """
    rows = read_jsonl(Path(run_dir) / SAMPLES_FILE)
    trained_steps: dict[Any, list[int]] = {}
    responses = 0
    staleness: Counter[int] = Counter()
    uid_to_id: dict[str, Any] = {}
    submitted: list[Any] = []
    in_flight_uids: set[str] | None = None
    regenerated = 0
    order: list[Any] | None = None
    for row in rows:
        event = row.get("event")
        if event == "trained":
            for p in row["prompts"]:
                trained_steps.setdefault(p["id"], []).append(int(row["step"]))
                responses += int(p["responses"])
                staleness[int(p["staleness"][1])] += int(p["responses"])
        elif event == "submitted":
            for uid, pid in row["prompts"]:
                uid_to_id[uid] = pid
                submitted.append(pid)
        elif event == "reissued":
            regenerated += int(row["count"])
        elif event == "in_flight_at_end":
            in_flight_uids = set(row["uids"])
        elif event == "epoch_order":
            order = list(row["ids"])
    trained = set(trained_steps)
    in_flight = {uid_to_id[u] for u in in_flight_uids or () if u in uid_to_id}
    untrained = set(submitted) - trained
    summary: dict[str, Any] = {
        "steps": len({int(r["step"]) for r in rows if r.get("event") == "trained"}),
        "prompts_submitted": len(set(submitted)),
        "prompts_trained": len(trained),
        "responses_trained": responses,
        "repeated": sorted(_jsonable(k) for k, v in trained_steps.items() if len(set(v)) > 1),
        "in_flight_at_end": None if in_flight_uids is None else len(untrained & in_flight),
        "lost_in_flight": None if in_flight_uids is None else sorted(_jsonable(k) for k in untrained - in_flight),
        "regenerated": regenerated,
        "skipped": skipped_ids(order, set(submitted)),
        "staleness": {str(s): n for s, n in sorted(staleness.items())},
    }
    superseded = read_jsonl(_sibling(Path(run_dir) / SAMPLES_FILE, SUPERSEDED_SUFFIX))
    summary["superseded_trained_steps"] = sum(r.get("event") == "trained" for r in superseded)
    return summary


def skipped_ids(order: Sequence[Any] | None, submitted: set[Any]) -> list[Any] | None:
    """Ids before the last submitted one in the epoch order that were never submitted."""
    if order is None:
        return None
    positions = [i for i, pid in enumerate(order) if pid in submitted]
    if not positions:
        return []
    return [_jsonable(pid) for pid in order[: max(positions) + 1] if pid not in submitted]


def _jsonable(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


def format_summary(summary: dict[str, Any]) -> str:
    """One console line: ``samples: 24 prompts trained (192 responses), 0 repeated, ...``."""

    def count(key: str) -> str:
        value = summary.get(key)
        return "?" if value is None else str(len(value) if isinstance(value, list) else value)

    return (
        f"[verl-sat] samples: {summary['prompts_trained']} prompts trained ({summary['responses_trained']} "
        f"responses) in {summary['steps']} steps, {count('repeated')} repeated, {count('skipped')} skipped, "
        f"{count('lost_in_flight')} lost in flight, {count('in_flight_at_end')} in flight at the end, "
        f"{summary['regenerated']} regenerated on resume"
    )


# ---------------------------------------------------------------------------------------------
# prompt ids
# ---------------------------------------------------------------------------------------------
def as_ids(values: Any) -> list[Any]:
    """A TransferQueue / TensorDict column (tensor, NonTensorStack, array, list) as plain ids."""
    if hasattr(values, "tolist"):
        values = values.tolist()
    out = []
    for v in list(values):
        v = getattr(v, "data", v)
        v = v.item() if hasattr(v, "item") else v
        out.append(int(v) if isinstance(v, (int, float)) and float(v).is_integer() else v)
    return out


def prompt_groups(keys: Sequence[str], ids: Sequence[Any], staleness: Sequence[int]) -> list[dict[str, Any]]:
    """Group trajectories (``{uid}_{session}_{i}`` keys) by prompt: responses and staleness range."""
    groups: dict[str, dict[str, Any]] = {}
    for key, pid, s in zip(keys, ids, staleness, strict=True):
        uid = key.split("_", 1)[0]
        g = groups.setdefault(uid, {"id": pid, "uid": uid, "responses": 0, "staleness": [int(s), int(s)]})
        g["responses"] += 1
        g["staleness"] = [min(g["staleness"][0], int(s)), max(g["staleness"][1], int(s))]
    return list(groups.values())


# ---------------------------------------------------------------------------------------------
# the trainer side (runs in verl's TaskRunner; TransferQueue imported lazily)
# ---------------------------------------------------------------------------------------------
class SampleAccountingMixin:
    """Writes ``samples.jsonl`` from verl's v1 trainer (``SATTrainerMixin`` calls these).

    ``_account_mini_batch`` after each mini-batch's staleness is known, ``_account_step`` in
    ``_compute_metrics`` (once per global step), ``_account_submitted`` when prompts go to the
    rollout, ``_account_reissued`` when verl re-issues in-flight prompts on resume.
    """

    def _samples_path(self) -> Path | None:
        run_dir = (self.config.get("sat") or {}).get("run_dir")  # type: ignore[attr-defined]
        return Path(str(run_dir)) / SAMPLES_FILE if run_dir else None

    def _account_write(self, row: dict[str, Any]) -> None:
        path = self._samples_path()
        if path is not None:
            append_jsonl(path, [row])

    def _account_mini_batch(self, batch: Any, staleness: Sequence[int]) -> None:
        """Remember which prompts this mini-batch trains (real rows only) and at what staleness."""
        real = [i for i, tag in enumerate(batch.tags) if not tag.get("is_padding", False)]
        if not real:
            return
        keys = [batch.keys[i] for i in real]
        ids = self._account_prompt_ids(keys, batch.partition_id)
        pending = self.__dict__.setdefault("_sat_account_pending", [])
        pending.extend(prompt_groups(keys, ids, [int(staleness[i]) for i in real]))

    def _account_prompt_ids(self, keys: list[str], partition_id: str) -> list[Any]:
        import transfer_queue as tq

        data = tq.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=["index"])
        return as_ids(data["index"])

    def _account_step(self, step: int) -> None:
        """One ``trained`` row for the global step (and, on the last step, what is still in flight)."""
        pending = self.__dict__.pop("_sat_account_pending", [])
        if self._samples_path() is None:  # no run directory: nothing is accounted
            return
        lag = int(getattr(self, "parameter_sync_step", 1))
        self._sat_account_last_uids = [g["uid"] for g in pending]
        self._account_write({"event": "trained", "step": step, "lag": lag, "prompts": pending})
        if step >= int(self.total_training_steps):  # type: ignore[attr-defined]
            self._account_in_flight(step)

    def _account_in_flight(self, step: int) -> None:
        import transfer_queue as tq

        try:
            items = (tq.kv_list("train") or {}).get("train", {})
        except Exception:
            return
        uids = {key.split("_", 1)[0] for key in items}
        trained_now = set(getattr(self, "_sat_account_last_uids", ()))
        self._account_write({"event": "in_flight_at_end", "step": step, "uids": sorted(uids - trained_now)})

    def _account_submitted(self, batch: Any) -> None:
        uids = [str(u) for u in as_ids(batch["uid"])]
        ids = as_ids(batch["index"])
        step = int(getattr(self, "global_steps", 0))
        prompts = [list(p) for p in zip(uids, ids, strict=True)]
        self._account_write({"event": "submitted", "step": step, "prompts": prompts})

    def _account_reissued(self, count: int) -> None:
        if count:
            self._account_write({"event": "reissued", "step": int(self.global_steps), "count": int(count)})  # type: ignore[attr-defined]

    def _account_epoch_order(self) -> None:
        """A fresh run records its sampler's first-epoch order (ids), for ``skipped``."""
        if int(getattr(self, "global_steps", 0)) != 0:
            return
        try:
            from verl.trainer.ppo.utils import create_rl_sampler

            sampler = create_rl_sampler(self.config.data, self.train_dataset)  # type: ignore[attr-defined]
            frame = self.train_dataset.dataframe  # type: ignore[attr-defined]
            wanted = int(self.total_training_steps) * int(self.config.data.train_batch_size)  # type: ignore[attr-defined]
            positions = []
            for position in sampler:
                positions.append(int(position))
                if len(positions) >= wanted * 2 + EPOCH_ORDER_MARGIN:
                    break
            extra = frame["extra_info"] if "extra_info" in frame.column_names else [None] * len(frame)
            ids = [_row_index({"extra_info": extra[p]}, p) for p in positions]
        except Exception:
            return
        self._account_write({"event": "epoch_order", "ids": ids})


def _row_index(row: dict[str, Any], position: int) -> Any:
    """The id verl's RLHFDataset gives a row: ``extra_info.index`` (its default 0 if absent)."""
    extra = row.get("extra_info") or {}
    return _jsonable(extra.get("index", 0)) if isinstance(extra, dict) else position
