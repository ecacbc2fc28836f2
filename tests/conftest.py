"""Shared helpers for the test suite (CPU only, nothing downloaded)."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest
import torch
from verl.workers.config.actor import ActorConfig

import verl_sat.trainer.recipe  # noqa: F401  (registers the ConfigStore nodes the YAML composes)
from verl_sat import SATPolicyLossConfig
from verl_sat.default import model as tiny

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # the studies' shared code (studies/lib, not installed) imports as studies.lib
SHARED_DATA = Path(os.environ.get("VERL_SAT_SHARED_DATA", REPO.parent / "shared" / "data"))
# under CI=true every skip fails (tests/shared_data_ci.py); re-exported: the hooks
from shared_data_ci import in_ci, pytest_make_collect_report, pytest_runtest_makereport  # noqa: E402, F401


def actor_config(
    loss_mode: str = "sat",
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    global_batch_info: dict | None = None,
    **sat: object,
) -> ActorConfig:
    """An ActorConfig as verl's worker builds it, carrying a SATPolicyLossConfig."""
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=eps_high,
        clip_ratio_low=eps_low,
        clip_ratio_high=eps_high,
        clip_ratio_c=clip_ratio_c,
        policy_loss=SATPolicyLossConfig(loss_mode=loss_mode, **sat),
        global_batch_info=global_batch_info or {},
    )


@functools.lru_cache(maxsize=512)
def cached_actor_config(loss_mode: str = "sat", **settings: object) -> ActorConfig:
    """``actor_config``, built once per distinct settings (a validated ActorConfig costs ~1 ms;
    property tests ask for the same few thousands of times). Shared: do not mutate it."""
    return actor_config(loss_mode, **settings)


@pytest.fixture
def make_config():
    return actor_config


def random_batch(
    seed: int,
    batch: int,
    length: int,
    scale: float = 0.3,
    dtype: torch.dtype = torch.float32,
    ties: bool = False,
) -> dict[str, torch.Tensor]:
    """old/new log-probs, advantages (one per sequence, GRPO-style) and a response mask."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=g, dtype=torch.float64) * 3
    d = torch.randn(batch, length, generator=g, dtype=torch.float64) * scale
    if ties:
        d = torch.round(d * 10) / 10  # many equal |d|: exercises the quantile's tie handling
    adv = torch.randn(batch, 1, generator=g, dtype=torch.float64).expand(batch, length).clone()
    lengths = torch.randint(0, length + 1, (batch,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(dtype)
    return {
        "old_log_prob": old.to(dtype),
        "log_prob": (old + d).to(dtype),
        "advantages": adv.to(dtype),
        "response_mask": mask,
    }


@pytest.fixture(scope="module")
def model_and_tokenizer():
    """The tiny MoE (seed 0, eval mode) and its tokenizer, built in code; one thread."""
    torch.set_num_threads(1)
    tokenizer = tiny.build_tokenizer()
    return tiny.build_model(tiny.build_config(tokenizer), seed=0).eval(), tokenizer


@pytest.fixture
def varied_reward(monkeypatch):
    """An untrained model never answers right: score by response length so groups have variance."""
    from verl_sat.default import reward

    monkeypatch.setattr(reward, "compute_score", lambda source, text, answer: float(len(text) % 2))


@pytest.fixture(scope="session")
def cached_default_assets() -> Path:
    """The default job's assets (full warm-up) in the user cache that `verl-sat` itself uses:
    built once per machine (~3 min, under a lock), then reused by every test and run."""
    from verl_sat.default.assets import build_assets_once, default_assets_dir

    assets = default_assets_dir()
    build_assets_once(assets)
    return assets


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Path:
    """The embedded tiny MoE and task with a short warm-up (the end-to-end tests need no reward
    signal), built once per test session for every module that launches the job (here, not
    imported into each module: an imported session fixture is a new fixture per module, built again).
    A module may define its own ``assets`` (tests/test_main_on_cpu.py's stand-in files)."""
    from verl_sat.default.warmup import WarmupArgs, build

    out = tmp_path_factory.mktemp("assets")
    build(out, WarmupArgs(steps=20, eval_samples=8))
    return out


def pytest_configure(config: pytest.Config) -> None:
    """Under CI (``CI=true``, as .ci/run's environment sets it) print the 25 slowest tests, so every
    CI log shows where the suite's time goes without a flag on the README's command."""
    if in_ci() and not config.option.durations:
        config.option.durations = 25


EXTENDED_ENV = "VERL_SAT_EXTENDED"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave the ``extended`` launches out unless asked (``VERL_SAT_EXTENDED=1``, or a ``-m``
    expression naming ``extended``): deselected, not skipped, and said in the summary, so the
    default run (and CI's) stays under its time budget (tests/README.md says which and who runs them)."""
    asked = os.environ.get(EXTENDED_ENV, "") not in ("", "0") or "extended" in (config.option.markexpr or "")
    if asked:
        return
    extended = [item for item in items if item.get_closest_marker("extended")]
    if extended:
        config.hook.pytest_deselected(items=extended)
        items[:] = [item for item in items if not item.get_closest_marker("extended")]
        config._verl_sat_extended = len(extended)  # type: ignore[attr-defined]
        if hasattr(config, "workeroutput"):  # a pytest-xdist worker: the controller prints the summary
            config.workeroutput["extended_left_out"] = len(extended)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """pytest-xdist's controller: each worker collects the whole suite, so any one's count is the run's."""
    left = getattr(node, "workeroutput", {}).get("extended_left_out", 0)
    node.config._verl_sat_extended = max(left, getattr(node.config, "_verl_sat_extended", 0))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    left = getattr(config, "_verl_sat_extended", 0)
    if left:
        terminalreporter.write_line(
            f"{left} extended end-to-end test(s) left out (tests/README.md); {EXTENDED_ENV}=1 runs them"
        )
