"""The actor's optimizer state right after a resume, recorded through verl-sat's own extension point.

``sat.actor_class=optimizer_dump.OptimizerDumpActor`` (with ``tests/`` on ``PYTHONPATH``, inherited
by the Ray workers) makes each actor worker write, after verl's ``load_checkpoint`` returns, the
optimizer state its engine then holds (``optimizer_state.optimizer_state``: Adam steps, lr
scheduler step, a sample of the moments) to ``$VERL_SAT_TEST_OPTIMIZER_DUMP.rank<r>.json``, with
the checkpoint path it loaded (``tests/test_megatron_e2e.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from optimizer_state import optimizer_state
from verl.single_controller.base.decorator import Dispatch, register

from verl_sat.trainer.actor import AsyncSATActor

DUMP_ENV = "VERL_SAT_TEST_OPTIMIZER_DUMP"  # a VERL_SAT_* variable: the job passes it to every worker


class OptimizerDumpActor(AsyncSATActor):
    """SAT's actor worker that records its optimizer state once a checkpoint is loaded."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str, hdfs_path: Any = None, del_local_after_load: bool = False) -> None:
        super().load_checkpoint(local_path, hdfs_path, del_local_after_load)  # type: ignore[misc]
        prefix = os.environ.get(DUMP_ENV)
        if prefix:
            state = {"local_path": local_path, **optimizer_state(self.actor.engine)}  # type: ignore[attr-defined]
            Path(f"{prefix}.rank{os.environ.get('RANK', 0)}.json").write_text(json.dumps(state))
