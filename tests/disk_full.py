"""A disk that fills during a checkpoint, injected through verl-sat's own extension point.

``sat.actor_class=disk_full.DiskFullActor`` (with ``tests/`` on ``PYTHONPATH``, inherited by the
Ray workers) makes the actor's save of global step ``VERL_SAT_TEST_ENOSPC_STEP`` write the actor's
files, then fail with ``ENOSPC`` on one more file after a few bytes: a disk that fills mid-save,
before verl writes ``data.pt`` and the tracker. The TaskRunner gets it as Ray's
``RayTaskError(OSError)`` (docs/faults.md, "Bad places to write").
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

from verl.single_controller.base.decorator import Dispatch, register

from verl_sat.trainer.actor import AsyncSATActor

STEP_ENV = "VERL_SAT_TEST_ENOSPC_STEP"  # a VERL_SAT_* variable: the job passes it to every worker


def fill_disk(local_path: str) -> None:
    """Write a few bytes of one more file in ``local_path``, then fail as a full disk does."""
    partial = Path(local_path) / "extra_state.pt"
    partial.write_bytes(b"\x80\x02partial")
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(partial))


class DiskFullActor(AsyncSATActor):
    """SAT's actor worker whose checkpoint of one global step fills the disk."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str, hdfs_path: Any = None, global_step: int = 0, **kwargs: Any) -> None:
        super().save_checkpoint(local_path, hdfs_path, global_step, **kwargs)  # type: ignore[misc]
        if int(global_step) == int(os.environ.get(STEP_ENV, -1)):
            fill_disk(local_path)
