"""``sat.heldout``: the study's held-out accuracy, taken in the product (docs/study.md).

The definition is ``verl_sat.default.heldout``'s, the one the study loop uses: the trainer's
current weights, no rollout mismatch, the same held-out sums and random numbers at every step.
In verl's v1 trainer one global step t holds n = ``parameter_sync_step`` optimizer steps (one per
mini-batch, ``_update_actor``), so the optimizer step after mini-batch i of global step t is

    s = (t - 1) n + i + 1                                      (i = ``local_trigger_step``, 0-based)

the loop's step count. After each ``_update_actor`` whose s is due, the driver asks every actor
worker to score its model (``AsyncSATActor.sat_heldout_accuracy``: every data-parallel rank runs
the same forward passes, which FSDP's all-gathers need) and keeps rank 0's answer; the global
step's row then carries ``eval/heldout_acc``, ``eval/heldout_greedy_acc`` and
``eval/heldout_step`` (= s). Step 0 is taken before the first update, on step 1's row as
``eval/heldout_acc_initial``.

FSDP engine on CPU only: the Megatron engine's module is not a transformers model, and the
held-out sums are the CPU default's task, scored by the CPU rollout engine (both refused at launch).
"""

from __future__ import annotations

import functools
from typing import Any

from verl_sat.config_node import config_from_node
from verl_sat.default.heldout import HELDOUT_GREEDY_KEY, HELDOUT_KEY, HeldoutConfig

STEP_KEY = "eval/heldout_step"
INITIAL_SUFFIX = "_initial"


def optimizer_step(global_step: int, sync_step: int, local_step: int) -> int:
    """s = (t - 1) n + i + 1: the optimizer step that mini-batch i of global step t completes."""
    return (int(global_step) - 1) * int(sync_step) + int(local_step) + 1


def heldout_spec(heldout: HeldoutConfig, tokenizer_path: str, max_response_length: int) -> dict[str, Any]:
    """What the worker needs to score its model (plain values: it crosses Ray)."""
    return {
        "problems": heldout.problems,
        "samples": heldout.samples,
        "seed": heldout.seed,
        "tokenizer": str(tokenizer_path),
        "max_response_length": int(max_response_length),
    }


@functools.lru_cache(maxsize=1)
def heldout_inputs(tokenizer_path: str, problems: int, seed: int) -> tuple[Any, list[Any]]:
    """The tokenizer and the held-out sums, made once per worker process (the same at every step)."""
    from transformers import AutoTokenizer

    from verl_sat.default.heldout import heldout_problems

    return AutoTokenizer.from_pretrained(tokenizer_path), heldout_problems(problems, seed)


def score_worker_model(worker: Any, spec: dict[str, Any]) -> dict[str, float]:
    """On an actor worker: the held-out accuracy of its engine's model (FSDP), in eval mode."""
    import torch

    from verl_sat.default.heldout import heldout_accuracy

    engine = worker.actor.engine
    module = getattr(engine, "module", None)
    if module is None or not hasattr(module, "get_output_embeddings"):
        raise RuntimeError(
            f"sat.heldout: the actor's engine {type(engine).__name__} has no transformers model to score"
        )
    tokenizer, problems = heldout_inputs(spec["tokenizer"], spec["problems"], spec["seed"])
    with engine.eval_mode(), torch.no_grad():
        return heldout_accuracy(module, tokenizer, problems, spec["samples"], spec["seed"], spec["max_response_length"])


class HeldoutTrainerMixin:
    """On verl's v1 trainer (``SATTrainerMixin``): the held-out accuracy at the named optimizer steps."""

    def _heldout(self) -> HeldoutConfig:
        if "_sat_heldout" not in self.__dict__:
            node = (self.config.get("sat") or {}).get("heldout")  # type: ignore[attr-defined]
            self._sat_heldout = config_from_node(HeldoutConfig, node, "sat.heldout")
            self._sat_heldout_rows: dict[str, float] = {}
        return self._sat_heldout

    def _heldout_step(self) -> int:
        local = int(getattr(self, "local_trigger_step", 0))
        return optimizer_step(self.global_steps, getattr(self, "parameter_sync_step", 1), local)  # type: ignore[attr-defined]

    def _heldout_score(self, step: int, suffix: str = "") -> None:
        cfg = self.config  # type: ignore[attr-defined]
        model = cfg.actor_rollout_ref.model
        spec = heldout_spec(self._heldout(), model.get("tokenizer_path") or model.path, cfg.data.max_response_length)
        result = self.actor_rollout_wg.sat_heldout_accuracy(spec)[0]  # type: ignore[attr-defined]
        self._sat_heldout_rows.update({k + suffix: float(v) for k, v in result.items()})
        if not suffix:
            self._sat_heldout_rows[STEP_KEY] = float(step)
        when = "before training" if suffix else f"after optimizer step {step}"
        print(
            f"[verl-sat] held-out accuracy {when}: {result[HELDOUT_KEY]:.3f} (greedy {result[HELDOUT_GREEDY_KEY]:.3f}; "
            f"{spec['problems']} problems x {spec['samples']} samples, sat.heldout)",
            flush=True,
        )

    def _heldout_around_update(self, update: Any) -> Any:
        """Run ``update()`` (one optimizer step), scoring before (step 0) and after it when due."""
        heldout = self._heldout()
        if not heldout.enabled:
            return update()
        step = self._heldout_step()
        last = int(self.total_training_steps) * int(getattr(self, "parameter_sync_step", 1))  # type: ignore[attr-defined]
        if step == 1 and 0 in heldout.at:
            self._heldout_score(0, INITIAL_SUFFIX)
        out = update()
        if heldout.due(step, last):
            self._heldout_score(step)
        return out

    def _heldout_metrics(self, metrics: dict) -> None:
        """Add this global step's held-out rows (if any) to its metrics."""
        if self._heldout().enabled and self._sat_heldout_rows:
            metrics.update(self._sat_heldout_rows)
            self._sat_heldout_rows = {}
