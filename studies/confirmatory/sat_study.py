"""SAT's working range, and the pre-registered study of what SAT does in it (docs/study.md).

Every run is one :class:`studies.lib.loop.StudyLoop` (the CPU trainer's HF rollout engine,
verl's registered losses, GRPO advantage and rollout correction, one process; docs/study.md says
what it does and does not exercise), run on ``--jobs`` worker processes that load the assets once
(:func:`studies.lib.harness.run_all`).

    python studies/confirmatory/sat_study.py search --out runs/sat_search     # baselines only, search seeds
    python studies/confirmatory/sat_study.py primary --out runs/sat_study     # the protocol's primary contrast
    python studies/confirmatory/sat_study.py dose --out runs/sat_study        # lags 1..16, both arms
    python studies/confirmatory/sat_study.py stabilizers --out runs/sat_study # the field's stabilizers
    python studies/confirmatory/sat_study.py quick --out runs/sat_quick       # <= 10 min: the whole pipeline
    python studies/confirmatory/sat_study.py summarize runs/sat_study         # tables, CSV and figures again

The committed results: studies/confirmatory/search/ (the search) and studies/confirmatory/results/
(the confirmatory phases; results/warmup_a44e53f/ the runs from the second warm-up).

``search`` runs the baselines alone (GSPO and GSPO + R3 at lags 1 and 8, over learning rates
and routing mismatches) on a seed that is never used again, and picks the regime by the rule in
``pick_regime`` (fixed before the search ran). The confirmatory phases read everything they run
(regime, arms, seeds, horizon, evaluation) from the JSON block of study_protocol.md (next to
this script), and
refuse to start while that file is uncommitted or changed; each result carries the protocol's
commit and blob hashes and the assets' fingerprint.

Primary metric: the *trained* policy's accuracy on a fixed held-out set (``eval/heldout_acc``:
512 problems never trained on, temperature 1, the same random numbers in every run), at the last
step and at fixed checkpoints. Analysis: per-seed paired differences, a paired t-interval at 95%,
the exact Wilcoxon signed-rank test and the exact sign-flip permutation test (studies.lib.stats).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, ClassVar

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))  # the studies' shared code: studies.lib
from studies.lib import harness  # noqa: E402
from studies.lib.harness import run_all, smooth  # noqa: E402
from studies.lib.loop import HELDOUT_GREEDY_KEY, HELDOUT_KEY  # noqa: E402
from studies.lib.stats import (  # noqa: E402
    cpu_sentinel_config,
    final_mean,
    paired_comparison,
    paired_t_interval,
    replay_sentinel,
)
from verl_sat.files import METRICS_FILE, read_metrics  # noqa: E402

PROTOCOL = HERE / "study_protocol.md"
RADIUS = math.log1p(0.2)  # log(1 + eps_high): SAT's positive-side band is empty for q above it
REWARD_KEY, DBAR_PI_KEY = "critic/score/mean", "actor/mismatch_abs_mean"
Q_KEY, INTERCEPT_KEY, GATE_KEY = "study/q", "study/intercepted_frac", "study/gate_rate"
STALENESS_KEY = "training/sat/staleness_steps/max"

_GSPO = {"loss_mode": "sat_gspo", "loss_agg_mode": "seq-mean-token-mean"}
_TOKEN = {"loss_agg_mode": "token-mean"}
# arm -> LoopConfig fields. Baselines are the SAT losses with sat_enabled=false: verl's own
# vanilla / gspo bit for bit (tests/test_losses_on_cpu.py). Decoupled arms (a rollout
# correction) take the ratio against pi_old, fixed for the sync cycle, as verl's decoupled mode.
ARMS: dict[str, dict[str, Any]] = {
    "grpo": {"loss_mode": "sat", "sat_enabled": False, **_TOKEN},
    "sat_grpo": {"loss_mode": "sat", **_TOKEN},
    "grpo_r3": {"loss_mode": "sat", "sat_enabled": False, "routing_replay": "R3", **_TOKEN},
    "sat_grpo_r3": {"loss_mode": "sat", "routing_replay": "R3", **_TOKEN},
    "gspo": {**_GSPO, "sat_enabled": False},
    "sat_gspo": dict(_GSPO),
    "gspo_r3": {**_GSPO, "sat_enabled": False, "routing_replay": "R3"},
    "sat_gspo_r3": {**_GSPO, "routing_replay": "R3"},
    "gspo_r3_tis": {**_GSPO, "sat_enabled": False, "routing_replay": "R3", "correction": "tis"},
    "gspo_r3_icepop": {**_GSPO, "sat_enabled": False, "routing_replay": "R3", "correction": "icepop"},
    "gspo_r3_geo_rs": {**_GSPO, "sat_enabled": False, "routing_replay": "R3", "correction": "geo_rs"},
    "cispo_r3": {"loss_mode": "cispo", "routing_replay": "R3", **_TOKEN},
    # hydra_configs/algorithm/dppo.yaml: delta 1e-3 in probability, IS cap 20
    "dppo_tv_r3": {
        "loss_mode": "dppo_tv",
        "routing_replay": "R3",
        "eps_low": 1e-3,
        "eps_high": 1e-3,
        "clip_ratio_c": 20.0,
        **_TOKEN,
    },
}

# -- the search: baselines alone, on seeds never used again -------------------------------------
SEARCH_SEEDS = (901,)
# (lr, router_bias_std): a smaller and a larger step size under a small routing mismatch, and the
# larger one under a stronger mismatch. One seed, no GRPO: at ~1 s per optimizer step on the
# shared 2-core machine, 240-step runs cost ~4 min each, and the rule below reads GSPO and
# GSPO + R3 only (GRPO's trouble is not the paper's headline).
SEARCH = {
    "arms": ("gspo", "gspo_r3"),
    "lags": (1, 8),
    "settings": ((2e-4, 0.5), (5e-4, 0.5), (5e-4, 1.5)),
}
BASE_SETTINGS: dict[str, Any] = {
    "steps": 240,  # 30 weight versions at lag 8
    "prompts_per_step": 8,
    "rollout_n": 4,
    "eval_problems": 512,
    "eval_samples": 2,
    "mismatch_seed": 0,
}
QUICK = {"arms": ("gspo_r3", "sat_gspo_r3"), "lags": (1, 8), "seeds": (801,), "steps": 48, "eval_problems": 128}


class Spec(harness.Spec):
    """The harness's run spec (arm, lag, seed, settings, tag) on this study's arms."""

    arms: ClassVar[Mapping[str, Mapping[str, Any]]] = ARMS


def specs_for(
    arms: Sequence[str], lags: Sequence[int], seeds: Sequence[int], settings: dict, tag: str = ""
) -> list[Spec]:
    """Every (lag, arm, seed); each validated here (an unknown arm or a bad setting fails before any run)."""
    out = []
    for lag in lags:
        for arm in arms:
            for seed in seeds:
                spec = Spec(arm, lag, seed, tuple(sorted(settings.items())), tag)
                spec.config()
                out.append(spec)
    return out


def setting_tag(lr: float, router_bias_std: float) -> str:
    return f"lr{lr:g}-rb{router_bias_std:g}"


def search_specs(seeds: Sequence[int] = SEARCH_SEEDS) -> list[Spec]:
    specs = []
    for lr, bias in SEARCH["settings"]:
        settings = {**BASE_SETTINGS, "lr": lr, "router_bias_std": bias, "eval_at": (0,)}
        specs += specs_for(SEARCH["arms"], SEARCH["lags"], seeds, settings, setting_tag(lr, bias))
    return specs


# -- per-run statistics ------------------------------------------------------------------------
def run_stats(spec: Spec, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One run's numbers: held-out accuracy (final, checkpoints, initial), training reward, dbar_pi,
    SAT's activity (share of steps with q below the radius, intercepted fraction), sentinel alarms."""
    evals = {int(r["step"]): r[HELDOUT_KEY] for r in rows if HELDOUT_KEY in r}
    alarms, scored = replay_sentinel(rows, cpu_sentinel_config())
    q = [r[Q_KEY] for r in rows if Q_KEY in r]
    intercepted = [r[INTERCEPT_KEY] for r in rows if INTERCEPT_KEY in r]
    out = {
        "name": spec.name,
        "arm": spec.arm,
        "lag": spec.lag,
        "seed": spec.seed,
        "tag": spec.tag,
        "heldout_acc": evals.get(max(evals)) if evals else None,
        "heldout_greedy_acc": next((r[HELDOUT_GREEDY_KEY] for r in reversed(rows) if HELDOUT_GREEDY_KEY in r), None),
        "heldout_acc_initial": rows[0].get(f"{HELDOUT_KEY}_initial") if rows else None,
        "final_reward": final_mean([r[REWARD_KEY] for r in rows]),
        "dbar_pi_final": final_mean([r[DBAR_PI_KEY] for r in rows]),
        "q_median": sorted(q)[len(q) // 2] if q else None,
        "q_below_radius_frac": sum(v < RADIUS for v in q) / len(q) if q else None,
        "intercepted_frac": sum(intercepted) / len(intercepted) if intercepted else None,
        "intercepted_steps_frac": sum(v > 0 for v in intercepted) / len(intercepted) if intercepted else None,
        "collapsed": bool(alarms) if scored else None,
        "steps": len(rows),
    }
    for step, acc in sorted(evals.items()):
        out[f"heldout_acc@{step}"] = acc
    return out


def by_staleness(rows: Sequence[dict[str, Any]], key: str) -> dict[int, list[float]]:
    """key's per-step values grouped by the step's staleness (one staleness per step in the loop)."""
    out: dict[int, list[float]] = {}
    for r in rows:
        if key in r and STALENESS_KEY in r:
            out.setdefault(int(r[STALENESS_KEY]), []).append(float(r[key]))
    return out


# -- the regime rule (fixed before the search ran) -----------------------------------------------
def pick_regime(stats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The search's verdict per setting, and the setting picked. For a setting (lr, router bias):

    learns:    at lag 1, GSPO and GSPO + R3 gain >= 0.10 held-out accuracy over the start (seed mean)
    degrades:  at lag 8, GSPO + R3 ends >= 0.05 below its lag-1 accuracy (seed mean)
    active:    at lag 8, in GSPO + R3, q < log(1 + eps_high) on >= 50% of steps and SAT would
               intercept a token on >= 50% of steps (the counterfactual study/* metrics)
    Picked: the setting meeting all three with the largest lag-8 drop; if none, the one meeting
    learns + active with the largest drop (the contrast still tests SAT where it acts, with no
    trouble to fix: the write-up says so); if none is active, the one with the largest
    intercepted fraction (SAT is inert everywhere: the write-up says so).
    """

    def mean(tag: str, arm: str, lag: int, key: str) -> float | None:
        values = [s[key] for s in stats if (s["tag"], s["arm"], s["lag"]) == (tag, arm, lag) and s[key] is not None]
        return sum(values) / len(values) if values else None

    verdicts = []
    for tag in sorted({s["tag"] for s in stats}):
        gains = [
            (mean(tag, arm, 1, "heldout_acc") or 0.0) - (mean(tag, arm, 1, "heldout_acc_initial") or 0.0)
            for arm in ("gspo", "gspo_r3")
        ]
        drop = (mean(tag, "gspo_r3", 1, "heldout_acc") or 0.0) - (mean(tag, "gspo_r3", 8, "heldout_acc") or 0.0)
        below = mean(tag, "gspo_r3", 8, "q_below_radius_frac") or 0.0
        acting = mean(tag, "gspo_r3", 8, "intercepted_steps_frac") or 0.0
        verdicts.append(
            {
                "tag": tag,
                "lag1_gain_min": min(gains),
                "lag8_drop": drop,
                "q_below_radius_frac": below,
                "intercepted_steps_frac": acting,
                "intercepted_frac": mean(tag, "gspo_r3", 8, "intercepted_frac") or 0.0,
                "learns": min(gains) >= 0.10,
                "degrades": drop >= 0.05,
                "active": below >= 0.5 and acting >= 0.5,
            }
        )
    for need, why in (
        (("learns", "degrades", "active"), "meets all three"),
        (("learns", "active"), "learns and SAT is active, but lag 8 does not degrade"),
    ):
        ok = [v for v in verdicts if all(v[k] for k in need)]
        if ok:
            return {"picked": max(ok, key=lambda v: v["lag8_drop"])["tag"], "why": why, "verdicts": verdicts}
    best = max(verdicts, key=lambda v: v["intercepted_frac"])
    return {"picked": best["tag"], "why": "SAT is inert in every setting", "verdicts": verdicts}


# -- the protocol ------------------------------------------------------------------------------
def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=False).stdout.strip()


def content_commit(rel: str, repo: Path = REPO) -> str:
    """The last commit that changed the content of ``rel``, following renames: a move that keeps every
    byte (git's R100) is not a change, so a protocol moved into its study's folder keeps its commit."""
    log = _git(repo, "log", "--follow", "--format=%x00%H", "--name-status", "--", rel)
    for entry in log.split("\0")[1:]:
        commit, *status = entry.split()
        if not status or status[0] != "R100":
            return commit
    return ""


def protocol_state(path: Path = PROTOCOL, repo: Path = REPO) -> dict[str, str]:
    """The protocol's commit (:func:`content_commit`) and blob hash; raises unless it is committed
    and unchanged. A protocol is moved only with ``git mv`` and never edited: the blob names it."""
    rel = str(path.relative_to(repo))
    if not path.is_file():
        raise SystemExit(f"[study] {rel} does not exist: write and commit the protocol before a confirmatory run")
    commit = content_commit(rel, repo)
    if not commit:
        raise SystemExit(f"[study] {rel} is not committed: commit the protocol before a confirmatory run")
    if _git(repo, "status", "--porcelain", "--", rel):
        raise SystemExit(f"[study] {rel} has uncommitted changes: the confirmatory runs follow the committed protocol")
    return {"protocol_commit": commit, "protocol_blob": _git(repo, "hash-object", rel), "protocol_path": rel}


def read_protocol(path: Path = PROTOCOL) -> dict[str, Any]:
    """The protocol's machine-readable block: the first ```json fenced block of the file."""
    match = re.search(r"```json\n(.*?)\n```", path.read_text(), re.S)
    if not match:
        raise SystemExit(f"[study] {path} has no ```json block with the regime, arms and seeds")
    return json.loads(match.group(1))


def confirmatory_specs(protocol: dict[str, Any], phase: str) -> list[Spec]:
    """The runs of one confirmatory phase, exactly as the protocol fixes them."""
    settings = {**protocol["settings"], "eval_at": tuple(protocol["checkpoints"])}
    lag = protocol["stress_lag"]
    if phase == "primary":
        specs = specs_for(protocol["primary"], (lag,), protocol["primary_seeds"], settings)
    elif phase == "dose":
        specs = specs_for(protocol["primary"], protocol["dose_lags"], protocol["dose_seeds"], settings)
    elif phase == "stabilizers":
        specs = specs_for(protocol["stabilizers"], (lag,), protocol["stabilizer_seeds"], settings)
    else:
        raise ValueError(f"unknown phase {phase!r}")
    return sorted(specs, key=lambda s: (s.seed, s.lag))  # seed-major: a cut-short phase keeps whole pairs


def assets_fingerprint(assets: Path) -> str:
    """sha256 over the model directory's files (names and bytes): which warm-up every run started from."""
    digest = hashlib.sha256()
    for path in sorted((assets / "model").rglob("*")):
        if path.is_file():
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


# -- analysis -----------------------------------------------------------------------------------
def paired(stats: Sequence[dict[str, Any]], arm: str, ref: str, lag: int, key: str, tag: str = "") -> dict | None:
    """Per-seed differences arm - ref at ``lag`` (``studies.lib.stats.paired_comparison``)."""

    def cell(name: str) -> dict[int, float]:
        return {
            s["seed"]: s[key]
            for s in stats
            if s["arm"] == name and s["lag"] == lag and s["tag"] == tag and s.get(key) is not None
        }

    result = paired_comparison(cell(arm), cell(ref))
    if result is None:
        return None
    result["arm_mean"], result["ref_mean"] = result.pop("a_mean"), result.pop("b_mean")
    return {"arm": arm, "reference": ref, "lag": lag, "metric": key, **result}


def format_paired(rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = [
        "| lag | arm - reference | metric | seeds | arm | reference | difference [paired t 95%] "
        "| Wilcoxon p | perm. p |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lo, hi = r["ci"]
        perm = f"{r['permutation_p']:.3f}" if r["permutation_p"] is not None else "–"
        lines.append(
            f"| {r['lag']} | {r['arm']} - {r['reference']} | {r['metric']} | {r['seeds']} | {r['arm_mean']:.4f} | "
            f"{r['ref_mean']:.4f} | {r['diff']:+.4f} [{lo:+.4f}, {hi:+.4f}] | {r['wilcoxon_p']:.3f} | {perm} |"
        )
    return lines


def write_csv(path: Path, stats: Sequence[dict[str, Any]]) -> Path:
    keys = sorted({k for s in stats for k in s}, key=lambda k: (k not in stats[0], k))
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=keys)
        writer.writeheader()
        writer.writerows(stats)
    return path


def read_csv(
    path: Path,
    text: Collection[str],
    flags: Collection[str] = ("collapsed", "quick"),
    ints: Collection[str] = ("seed", "lag", "steps"),
) -> list[dict[str, Any]]:
    """A runs.csv typed back as :func:`write_csv` wrote it: ``text`` columns as written, ``flags`` as
    bools, ``ints`` as ints, every other column a float (None when empty). Each study names its text
    columns; the analysis of the committed rows is then the analysis of the runs."""

    def typed(key: str, value: str) -> Any:
        if key in text:
            return value
        if key in flags:
            return {"True": True, "False": False}.get(value)
        if key in ints:
            return int(value)
        return float(value) if value != "" else None

    with path.open(newline="") as handle:
        return [{k: typed(k, v) for k, v in row.items()} for row in csv.DictReader(handle)]


def load_runs(out: Path) -> tuple[list[Spec], dict[str, list[dict[str, Any]]]]:
    """The complete runs under ``out/runs`` (a run still being written is left out)."""
    specs = [_spec(json.loads(p.read_text())) for p in sorted(out.glob("runs/*/study_spec.json"))]
    runs = {s.name: read_metrics(out / "runs" / s.name / METRICS_FILE) for s in specs}
    done = [s for s in specs if len(runs[s.name]) >= s.config().steps]
    return done, {s.name: runs[s.name] for s in done}


def _spec(raw: dict[str, Any]) -> Spec:
    raw["settings"] = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in raw["settings"])
    return Spec(**raw)


def summarize_search(out: Path) -> dict[str, Any]:
    """search.md (per setting, lag and arm: held-out accuracy, SAT's activity), the verdicts and the pick."""
    specs, runs = load_runs(out)
    stats = [run_stats(s, runs[s.name]) for s in specs]
    write_csv(out / "search_runs.csv", stats)
    regime = pick_regime(stats)
    lines = ["# Regime search: the baselines alone (search seeds, never reused)", ""]
    lines += [
        "| setting | lag | arm | seeds | held-out acc (start -> final) | final reward | dbar_pi | q median | "
        "steps q < log(1.2) | steps intercepting | intercepted frac |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple, list] = {}
    for s in stats:
        groups.setdefault((s["tag"], s["lag"], s["arm"]), []).append(s)
    for (tag, lag, arm), cell in sorted(groups.items()):
        m = {k: _mean([c[k] for c in cell]) for k in cell[0] if k not in ("name", "arm", "tag", "lag", "seed")}
        lines.append(
            f"| {tag} | {lag} | {arm} | {len(cell)} | {_f(m['heldout_acc_initial'])} -> {_f(m['heldout_acc'])} | "
            f"{_f(m['final_reward'])} | {_f(m['dbar_pi_final'], '.4f')} | {_f(m['q_median'])} | "
            f"{_f(m['q_below_radius_frac'], '.2f')} | {_f(m['intercepted_steps_frac'], '.2f')} | "
            f"{_f(m['intercepted_frac'], '.4f')} |"
        )
    lines += [
        "",
        "Verdicts (`pick_regime`):",
        "",
        "| setting | lag-1 gain (min) | lag-8 drop | q below | intercepting | learns | degrades | active |",
    ]
    lines.append("|---|---|---|---|---|---|---|---|")
    for v in regime["verdicts"]:
        lines.append(
            f"| {v['tag']} | {v['lag1_gain_min']:+.3f} | {v['lag8_drop']:+.3f} | {v['q_below_radius_frac']:.2f} | "
            f"{v['intercepted_steps_frac']:.2f} | {v['learns']} | {v['degrades']} | {v['active']} |"
        )
    lines += ["", f"Picked: **{regime['picked']}** ({regime['why']})."]
    (out / "search.md").write_text("\n".join(lines) + "\n")
    (out / "search.json").write_text(json.dumps({"runs": stats, "regime": regime}, indent=2))
    plot_working_range(out / "working_range.png", specs, runs)
    return regime


def summarize_confirmatory(out: Path, protocol: dict[str, Any]) -> list[dict[str, Any]]:
    """study.md, runs.csv, study.json and the figures of every confirmatory run under ``out``."""
    specs, runs = load_runs(out)
    stats = [run_stats(s, runs[s.name]) for s in specs]
    if not stats:
        return []
    meta = json.loads((out / "provenance.json").read_text()) if (out / "provenance.json").is_file() else {}
    for s in stats:
        s.update({k: meta.get(k) for k in ("protocol_commit", "protocol_blob", "assets_fingerprint")})
    write_csv(out / "runs.csv", stats)
    lag, (ref, arm) = protocol["stress_lag"], protocol["primary"]  # [reference, SAT arm]
    checkpoints = [c for c in protocol["checkpoints"] if c > 0] + [protocol["settings"]["steps"]]
    primary = [paired(stats, arm, ref, lag, "heldout_acc")]
    secondary = [paired(stats, arm, ref, lag, f"heldout_acc@{c}") for c in checkpoints[:-1]]
    secondary += [paired(stats, arm, ref, lag, k) for k in ("heldout_greedy_acc", "final_reward", "dbar_pi_final")]
    dose = [paired(stats, arm, ref, n, "heldout_acc") for n in protocol["dose_lags"]]
    stabilizers = [paired(stats, s, ref, lag, "heldout_acc") for s in protocol["stabilizers"]]
    activity = [
        f"| {s['arm']} | {s['lag']} | {s['seed']} | {_f(s['q_median'])} | {_f(s['q_below_radius_frac'], '.2f')} | "
        f"{_f(s['intercepted_steps_frac'], '.2f')} | {_f(s['intercepted_frac'], '.4f')} |"
        for s in sorted(stats, key=lambda s: (s["arm"], s["lag"], s["seed"]))
        if s["arm"] in protocol["primary"] and s["lag"] == lag
    ]
    text = [
        f"# Confirmatory study ({meta.get('protocol_path', 'studies/confirmatory/study_protocol.md')})",
        "",
        f"Protocol commit `{meta.get('protocol_commit')}` (blob `{meta.get('protocol_blob')}`), assets "
        f"`{meta.get('assets_fingerprint')}`. Settings: "
        + ", ".join(f"{k}={v}" for k, v in sorted(protocol["settings"].items()))
        + f"; stress lag {lag}.",
        "",
        primary_heading(primary[0], len(protocol["primary_seeds"])),
        "",
        *format_paired([r for r in primary if r]),
        "",
        "## Secondary (same seeds)",
        "",
        *format_paired([r for r in secondary if r]),
        "",
        "## Dose-response (held-out accuracy at the last step)",
        "",
        *format_paired([r for r in dose if r]),
        "",
        f"## Stabilizers at lag {lag}, each against {ref}",
        "",
        *format_paired([r for r in stabilizers if r]),
        "",
        f"## SAT's activity at lag {lag} (counterfactual for the baseline)",
        "",
        "| arm | lag | seed | q median | steps q < log(1.2) | steps intercepting | intercepted frac |",
        "|---|---|---|---|---|---|---|",
        *activity,
    ]
    (out / "study.md").write_text("\n".join(text) + "\n")
    results = {"runs": stats, "primary": primary, "secondary": secondary, "dose": dose, "stabilizers": stabilizers}
    (out / "study.json").write_text(json.dumps(results, indent=2, default=str))
    plot_dose(out / "dose_response.png", stats, protocol)
    plot_by_staleness(out / "intercepted_by_staleness.png", specs, runs, protocol)
    plot_curves(out / "heldout_curves.png", specs, runs, protocol)
    return stats


def primary_heading(primary: dict[str, Any] | None, wanted: int) -> str:
    """The primary section's heading; for a directory that holds fewer seeds at the stress lag than
    the protocol's primary (the dose phase alone), one that says this is not the primary result."""
    seeds = primary["seeds"] if primary else 0
    if seeds >= wanted:
        return "## Primary"
    return f"## The primary contrast on this directory's {seeds} seeds (not the primary result: that has {wanted})"


def _mean(values: Sequence[Any]) -> float | None:
    values = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool) and v is not None]
    return sum(values) / len(values) if values else None


def _f(value: float | None, spec: str = ".3f") -> str:
    return "–" if value is None else f"{value:{spec}}"


# -- figures ------------------------------------------------------------------------------------
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_working_range(path: Path, specs: Sequence[Spec], runs: dict[str, list[dict]]) -> Path:
    """Left: q per step against log(1 + eps_high), per setting and lag (baselines); right: the
    share of tokens SAT would intercept, by staleness."""
    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    groups: dict[tuple[str, int], list[dict]] = {}
    for s in specs:
        if s.arm == "gspo_r3" or (s.arm == "gspo" and not any(x.arm == "gspo_r3" for x in specs)):
            groups.setdefault((s.tag, s.lag), []).extend(runs[s.name])
    labels = [f"{tag or 'protocol'}\nlag {lag}" for tag, lag in sorted(groups)]
    left.boxplot([[r[Q_KEY] for r in groups[k] if Q_KEY in r] for k in sorted(groups)], showfliers=False)
    left.set_xticks(range(1, len(labels) + 1), labels, fontsize=7)
    left.axhline(RADIUS, color="red", ls="--", label="log(1 + eps_high) = 0.182")
    left.set_ylabel("q (alpha = 0.9 quantile of |d|), GSPO + R3")
    left.set_yscale("log")
    left.legend(fontsize=8)
    for key in sorted(groups):
        staleness = by_staleness(groups[key], INTERCEPT_KEY)
        xs = sorted(staleness)
        right.plot(xs, [sum(staleness[x]) / len(staleness[x]) for x in xs], marker="o", label=f"{key[0]} lag {key[1]}")
    right.set_xlabel("staleness (optimizer steps)")
    right.set_ylabel("share of tokens SAT would intercept")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_dose(path: Path, stats: Sequence[dict[str, Any]], protocol: dict[str, Any]) -> Path:
    """Held-out accuracy at the last step against lag, per primary arm: seed mean and t 95% interval."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for offset, arm in zip((-0.04, 0.04), protocol["primary"], strict=True):
        xs, means, errs = [], [], []
        for lag in protocol["dose_lags"]:
            values = [
                s["heldout_acc"] for s in stats if s["arm"] == arm and s["lag"] == lag and s["heldout_acc"] is not None
            ]
            if len(values) < 2:
                continue
            mean, lo, _ = paired_t_interval(values)
            xs.append(lag * (1 + offset))
            means.append(mean)
            errs.append(mean - lo)
        ax.errorbar(xs, means, yerr=errs, marker="o", capsize=3, label=arm)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("lag n (optimizer steps per broadcast)")
    ax.set_ylabel("held-out accuracy of the trained policy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_by_staleness(path: Path, specs: Sequence[Spec], runs: dict[str, list[dict]], protocol: dict) -> Path:
    """Share of tokens SAT intercepts, by staleness, for the primary arms at each dose lag."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for arm in protocol["primary"]:
        for lag in protocol["dose_lags"]:
            rows = [r for s in specs if s.arm == arm and s.lag == lag for r in runs[s.name]]
            staleness = by_staleness(rows, INTERCEPT_KEY)
            if staleness:
                xs = sorted(staleness)
                style = "-" if arm.startswith("sat") else ":"
                ax.plot(
                    xs, [sum(staleness[x]) / len(staleness[x]) for x in xs], style, marker=".", label=f"{arm} lag {lag}"
                )
    ax.set_xlabel("staleness (optimizer steps)")
    ax.set_ylabel("intercepted fraction (SAT clips, PPO does not)")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_curves(path: Path, specs: Sequence[Spec], runs: dict[str, list[dict]], protocol: dict) -> Path:
    """Training reward (10-step moving average, seed mean) and held-out accuracy at the
    checkpoints, primary arms at the stress lag."""
    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    lag = protocol["stress_lag"]
    for arm in protocol["primary"] + protocol["stabilizers"]:
        chosen = [runs[s.name] for s in specs if s.arm == arm and s.lag == lag]
        if not chosen:
            continue
        length = min(len(r) for r in chosen)
        curves = [smooth([row[REWARD_KEY] for row in r[:length]], 10) for r in chosen]
        left.plot(
            range(1, length + 1),
            [sum(c[i] for c in curves) / len(curves) for i in range(length)],
            label=f"{arm} ({len(chosen)})",
        )
        points: dict[int, list[float]] = {}
        for r in chosen:
            for row in r:
                if HELDOUT_KEY in row:
                    points.setdefault(int(row["step"]), []).append(row[HELDOUT_KEY])
        xs = sorted(points)
        right.plot(xs, [sum(points[x]) / len(points[x]) for x in xs], marker="o", label=arm)
    left.set_xlabel("optimizer step")
    left.set_ylabel("training reward (stale rollout)")
    right.set_xlabel("optimizer step")
    right.set_ylabel("held-out accuracy (trained policy)")
    for ax in (left, right):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- CLI ----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("phase", choices=("search", "primary", "dose", "stabilizers", "confirm", "quick", "summarize"))
    parser.add_argument("dir", nargs="?", type=Path, help="summarize: the output directory")
    parser.add_argument("--out", type=Path, default=Path("runs/sat_study"))
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (2 cores: 2)")
    parser.add_argument("--assets", type=Path, help="the default's assets (default: verl-sat's cache, built if absent)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan only")
    return parser


def _default_assets() -> Path:
    from verl_sat.default.assets import build_assets_once, default_assets_dir

    assets = default_assets_dir()
    build_assets_once(assets)
    return assets


def execute(specs: Sequence[Spec], out: Path, assets: Path, jobs: int, provenance: dict[str, Any]) -> float:
    """Write each run's spec and the provenance, then run what is not complete; returns minutes."""
    out.mkdir(parents=True, exist_ok=True)
    old = json.loads((out / "provenance.json").read_text()) if (out / "provenance.json").is_file() else None
    if old and any(old.get(k) != provenance.get(k) for k in ("protocol_blob", "assets_fingerprint")):
        raise SystemExit(f"[study] {out} holds runs of another protocol or assets ({old}); use a new --out")
    (out / "provenance.json").write_text(json.dumps(provenance, indent=2))
    for spec in specs:
        run_dir = out / "runs" / spec.name
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "study_spec.json").write_text(json.dumps(asdict(spec), default=list))
    print(f"[study] load average {os.getloadavg()[0]:.1f}; assets {assets} ({provenance['assets_fingerprint']})")
    start = time.perf_counter()
    run_all(specs, out, assets, jobs)
    return (time.perf_counter() - start) / 60


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.phase == "summarize":
        out = (args.dir or args.out).resolve()
        if (out / "search.md").exists() or not PROTOCOL.is_file():
            print(json.dumps(summarize_search(out), indent=2))
        else:
            summarize_confirmatory(out, read_protocol())
            print((out / "study.md").read_text())
        return 0
    out = args.out.resolve()
    provenance: dict[str, Any] = {}
    if args.phase == "search":
        specs = search_specs()
    elif args.phase == "quick":
        settings = {**BASE_SETTINGS, "steps": QUICK["steps"], "eval_problems": QUICK["eval_problems"], "eval_at": (0,)}
        specs = specs_for(QUICK["arms"], QUICK["lags"], QUICK["seeds"], settings, "quick")
    else:
        provenance.update(protocol_state())
        protocol = read_protocol()
        phases = ("primary", "stabilizers", "dose") if args.phase == "confirm" else (args.phase,)
        specs = list(dict.fromkeys(s for p in phases for s in confirmatory_specs(protocol, p)))
    print(f"[study] {args.phase}: {len(specs)} runs x {specs[0].config().steps} optimizer steps", flush=True)
    if args.dry_run:
        for spec in specs:
            print(spec.name, asdict(spec.config()))
        return 0
    assets = args.assets or _default_assets()
    provenance["assets_fingerprint"] = assets_fingerprint(assets)
    minutes = execute(specs, out, assets, args.jobs, provenance)
    print(f"[study] {len(specs)} runs in {minutes:.1f} min wall", flush=True)
    if args.phase in ("search", "quick"):
        print(json.dumps(summarize_search(out), indent=2))
    else:
        summarize_confirmatory(out, read_protocol())
        print((out / "study.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
