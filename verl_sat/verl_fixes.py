"""Work-arounds for verl 0.9.1 bugs that hit every platform, installed by the plugin everywhere.

``verl_sat.plugin`` (the ``verl.plugins`` entry point, loaded by every ``import verl``: driver and
Ray workers) calls :func:`install` on every platform; nothing in verl is edited. One function per
bug, named after the bug and the verl version it was read in. CPU-only fixes stay in
``verl_sat.cpu.platform`` (installed with ``VERL_PLATFORM=cpu``).

- :func:`separate_async_logger_flush_kwarg_0_9_1`: ``trainer/ppo/v1/trainer_separate_async.py``
  ``_setup`` calls ``logger.info(..., flush=True)`` when ``actor_rollout_ref.hybrid_engine=False``
  (every separate_async cell of the paper's recipe). ``Logger._log`` has no ``flush`` keyword, so
  at INFO level (that module's default, ``VERL_LOGGING_LEVEL``) ``trainer.init()`` raises
  ``TypeError`` after the models are built.
- :func:`sglang_launch_logger_flush_kwarg_0_9_1`: the same call in
  ``workers/rollout/sglang_rollout/http_server_engine.py`` ``launch_server_process`` for a
  non-leader node (multi-node SGLang); that module logs at WARN by default, so it raises only with
  ``VERL_LOGGING_LEVEL=INFO`` or lower.
"""

from __future__ import annotations

import logging
from typing import Any

SEPARATE_ASYNC_LOGGER = "verl.trainer.ppo.v1.trainer_separate_async"
SGLANG_HTTP_ENGINE_LOGGER = "verl.workers.rollout.sglang_rollout.http_server_engine"


class FlushTolerantLogger(logging.Logger):
    """A ``Logger`` that ignores a stray ``flush=`` keyword (a ``print`` habit) instead of raising."""

    def _log(self, level: int, msg: object, args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        kwargs.pop("flush", None)
        super()._log(level, msg, args, **kwargs)


def make_flush_tolerant(name: str) -> logging.Logger:
    """Make logger ``name`` a :class:`FlushTolerantLogger`, whether or not verl has created it yet.

    verl's modules take their logger with ``logging.getLogger(__name__)``, which returns this same
    object, before or after their import; only the class changes (no state is added), so handlers,
    level and propagation are kept.
    """
    logger = logging.getLogger(name)
    if not isinstance(logger, FlushTolerantLogger):
        logger.__class__ = FlushTolerantLogger
    return logger


def separate_async_logger_flush_kwarg_0_9_1() -> None:
    """``trainer_separate_async._setup``: ``logger.info(..., flush=True)`` with hybrid_engine=False."""
    make_flush_tolerant(SEPARATE_ASYNC_LOGGER)


def sglang_launch_logger_flush_kwarg_0_9_1() -> None:
    """``http_server_engine.launch_server_process``: ``logger.info(..., flush=True)`` off the leader node."""
    make_flush_tolerant(SGLANG_HTTP_ENGINE_LOGGER)


FIXES = (separate_async_logger_flush_kwarg_0_9_1, sglang_launch_logger_flush_kwarg_0_9_1)


def install() -> None:
    """Install every work-around in :data:`FIXES` (idempotent, cheap: no verl module is imported)."""
    for fix in FIXES:
        fix()
