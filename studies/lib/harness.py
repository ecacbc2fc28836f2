"""The live study harness: the run spec, the worker pool that runs many seeds, the moving average.

A study (studies/confirmatory/sat_study.py, studies/autolag/autolag_study.py) names each run by a
:class:`Spec`: an arm at a lag and a seed, with the study's settings; a subclass gives the arm
table that turns it into a :class:`studies.lib.loop.LoopConfig`. :func:`run_all` runs the specs
on ``jobs`` worker processes, each of which imports verl-sat and loads the default's assets once
(:func:`worker_init`) and then builds one :class:`~studies.lib.loop.StudyLoop` per run in a
fraction of a second (:func:`run_in_worker`); a run already complete in the output directory is
skipped, so a cut-short study resumes. :func:`smooth` is the trailing moving average the figures
draw. docs/study.md reports the studies.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any, ClassVar

from studies.lib.loop import LoopConfig, StudyLoop, load_assets
from verl_sat.files import METRICS_FILE


@dataclass(frozen=True)
class Spec:
    """One run: an arm at a lag and a seed, with the study's settings (and a tag for the condition)."""

    arm: str
    lag: int
    seed: int
    settings: tuple[tuple[str, Any], ...]
    tag: str = ""

    arms: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    """arm -> the LoopConfig fields that make it (a study's subclass gives its own table)"""

    @property
    def name(self) -> str:
        """The run's directory name: ``[tag-]arm-lag<n>-seed<k>``."""
        tag = f"{self.tag}-" if self.tag else ""
        return f"{tag}{self.arm}-lag{self.lag}-seed{self.seed}"

    def config(self) -> LoopConfig:
        """The run's LoopConfig: the settings, then the arm's fields, then the lag and the seed."""
        if self.arm not in self.arms:
            raise ValueError(f"unknown arm {self.arm!r}; known: {sorted(self.arms)}")
        fields = {**dict(self.settings), **self.arms[self.arm], "lag": self.lag, "seed": self.seed}
        if "eval_at" in fields:  # a spec read back from JSON holds a list
            fields["eval_at"] = tuple(fields["eval_at"])
        return LoopConfig(**fields)


# -- the worker pool: processes that import and load once, then run many specs ------------------
_WORKER_ASSETS: tuple[Any, Any] | None = None


def worker_init(assets_dir: str) -> None:
    """A study worker's one start-up: import verl-sat (registering its losses) and load the assets."""
    global _WORKER_ASSETS
    import verl_sat  # noqa: F401

    _WORKER_ASSETS = load_assets(assets_dir)


def run_in_worker(cfg: LoopConfig, run_dir: str, method: str) -> dict[str, Any]:
    """One run on the worker's loaded assets; returns its name, build time and wall time."""
    if _WORKER_ASSETS is None:
        raise RuntimeError("run_in_worker needs worker_init first (the pool's initializer)")
    start = time.perf_counter()
    loop = StudyLoop(cfg, *_WORKER_ASSETS)
    startup = time.perf_counter() - start
    loop.run(run_dir, method=method)
    return {"name": Path(run_dir).name, "startup_s": startup, "run_s": time.perf_counter() - start}


def complete(run_dir: Path, steps: int) -> bool:
    """Whether ``run_dir`` holds a metrics file of at least ``steps`` rows (a finished run)."""
    path = run_dir / METRICS_FILE
    return path.is_file() and len(path.read_text().splitlines()) >= steps


def run_all(
    specs: Sequence[Spec],
    out: Path,
    assets_dir: Path,
    jobs: int,
    stop_starting: float | None = None,
    cut_at: float | None = None,
) -> list[dict[str, Any]]:
    """Run ``specs`` into ``out/runs/<name>`` on ``jobs`` worker processes, skipping the runs already
    complete there; returns each new run's timings (:func:`run_in_worker`), in the order of ``specs``.

    With ``stop_starting`` (epoch seconds) no run starts after that time, and with ``cut_at`` the
    runs still going then are stopped (left incomplete, so the analysis leaves them out): a
    protocol's time stop (:func:`run_until`)."""
    todo = [s for s in specs if not complete(out / "runs" / s.name, s.config().steps)]
    print(f"[study] {len(specs)} runs, {len(specs) - len(todo)} already done; {jobs} worker(s)", flush=True)
    if not todo:
        return []
    if stop_starting is not None or cut_at is not None:
        return run_until(todo, out, assets_dir, jobs, stop_starting or math.inf, cut_at or math.inf)
    start = time.perf_counter()
    timings = []
    ctx = get_context("spawn")
    with ProcessPoolExecutor(jobs, mp_context=ctx, initializer=worker_init, initargs=(str(assets_dir),)) as pool:
        futures = [pool.submit(run_in_worker, spec.config(), str(out / "runs" / spec.name), spec.arm) for spec in todo]
        for i, future in enumerate(futures, 1):
            result = future.result()
            timings.append(result)
            print(
                f"[study] {i}/{len(todo)} {result['name']}: {result['run_s']:.0f} s "
                f"(start-up {result['startup_s']:.2f} s) | {(time.perf_counter() - start) / 60:.1f} min",
                flush=True,
            )
    return timings


def run_until(
    todo: Sequence[Spec], out: Path, assets_dir: Path, jobs: int, stop_starting: float, cut_at: float
) -> list[dict[str, Any]]:
    """:func:`run_all` under a time stop: at most ``jobs`` runs in flight, none started after
    ``stop_starting``, the pool terminated at ``cut_at`` (epoch seconds); returns the finished runs' timings."""
    start, timings, queue = time.perf_counter(), [], list(todo)
    pool = get_context("spawn").Pool(jobs, initializer=worker_init, initargs=(str(assets_dir),))
    running: list[Any] = []
    try:
        while queue or running:
            while queue and len(running) < jobs and time.time() < stop_starting and fits(timings, cut_at):
                spec = queue.pop(0)
                args = (spec.config(), str(out / "runs" / spec.name), spec.arm)
                running.append(pool.apply_async(run_in_worker, args))
            if not running or time.time() >= cut_at:
                break
            time.sleep(1.0)
            for job in [j for j in running if j.ready()]:
                running.remove(job)
                result = job.get()
                timings.append(result)
                print(
                    f"[study] {len(timings)}/{len(todo)} {result['name']}: {result['run_s']:.0f} s "
                    f"| {(time.perf_counter() - start) / 60:.1f} min",
                    flush=True,
                )
            if queue and (time.time() >= stop_starting or not fits(timings, cut_at)):
                print(f"[study] time stop: {len(queue)} run(s) not started", flush=True)
                queue.clear()
    finally:
        if running:
            print(f"[study] cut: {len(running)} run(s) stopped incomplete", flush=True)
            pool.terminate()
        else:
            pool.close()
        pool.join()
    return timings


def fits(timings: Sequence[dict[str, Any]], cut_at: float) -> bool:
    """Whether a run started now ends before ``cut_at`` at the median run time so far (True before any)."""
    if not timings:
        return True
    times = sorted(t["run_s"] for t in timings)
    return time.time() + times[len(times) // 2] < cut_at


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average over ``window`` points (the first points average what exists)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out
