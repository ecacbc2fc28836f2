"""The token level, diagnosed (issue 46, part 2c; studies/token_level/study_protocol_token.md).

    python studies/token_level/token_study.py run --out runs/token_level       # the protocol's runs, one worker
    python studies/token_level/token_study.py quick --out runs/token_level_q   # the pipeline, 1 seed x 24 steps
    python studies/token_level/token_study.py summarize runs/token_level       # runs.csv, study.md, the figure

One process loads the assets once and runs the protocol's runs in its fixed order
(:class:`studies.token_level.token_loop.TokenLoop`), skipping those complete in ``--out`` and
starting none after the protocol's time stop. ``run`` refuses to start while the protocol is
uncommitted or changed; every row carries its commit and blob, the assets' fingerprint and the
blob of the loop code the process imported.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "studies" / "confirmatory"))
import sat_study as base  # noqa: E402  (protocol check, assets fingerprint, paired tests, CSV)

from studies.lib import harness  # noqa: E402
from studies.lib.loop import HELDOUT_KEY  # noqa: E402
from studies.lib.stats import contrast_cells, holm  # noqa: E402
from studies.token_level.instrument import TOKEN_CLASSES  # noqa: E402
from studies.token_level.token_loop import COUNTERFACTUAL, TokenLoopConfig  # noqa: E402

PROTOCOL = HERE / "study_protocol_token.md"
PROTOCOL_REL = "studies/token_level/study_protocol_token.md"
RADIUS = math.log1p(0.2)
KERNEL_BOUND = -math.log(0.9)
"""q above -log(1 - eps/2) (eps 0.2): every gated token's ratio lies beyond its contracted endpoint, so the
kernel's value cannot change which tokens are clipped (the exponent is idle on that step)"""
_TOKEN = {"loss_mode": "sat", "loss_agg_mode": "token-mean"}
ARMS: dict[str, dict[str, Any]] = {
    "grpo": {**_TOKEN, "sat_enabled": False},
    "sat_grpo": dict(_TOKEN),
    "sat_grpo_a95": {**_TOKEN, "sat_alpha": 0.95},
    "sat_grpo_p4": {**_TOKEN, "sat_kernel_exponent": 4.0},
    "sat_grpo_r3": {**_TOKEN, "routing_replay": "R3"},
}
LABELS = {
    "grpo": "GRPO",
    "sat_grpo": "SAT-GRPO",
    "sat_grpo_a95": "SAT-GRPO, alpha 0.95",
    "sat_grpo_p4": "SAT-GRPO, p = 4",
    "sat_grpo_r3": "SAT-GRPO + R3",
    "grpo_r3": "GRPO + R3",
}
CODE = ("studies/lib/loop.py", "studies/token_level/token_loop.py", "studies/token_level/instrument.py")


class Spec(harness.Spec):
    """The harness's run spec on this study's arms, built as a :class:`TokenLoopConfig`."""

    arms: ClassVar[Mapping[str, Mapping[str, Any]]] = ARMS

    def config(self) -> TokenLoopConfig:
        if self.arm not in self.arms:
            raise ValueError(f"unknown arm {self.arm!r}; known: {sorted(self.arms)}")
        fields = {**dict(self.settings), **self.arms[self.arm], "seed": self.seed}
        fields["eval_at"] = tuple(fields.get("eval_at", ()))
        return TokenLoopConfig(**fields)


def settings_of(protocol: dict[str, Any], quick: bool = False) -> dict[str, Any]:
    """The LoopConfig settings: the protocol's regime, checkpoints before the last as ``eval_at``."""
    settings = dict(protocol["settings"])
    checkpoints = protocol["checkpoints"]
    if quick:
        q = protocol["quick"]
        settings.update(steps=q["steps"], eval_problems=q["eval_problems"], grad_every=4)
        checkpoints = q["checkpoints"]
    settings["eval_at"] = tuple(c for c in checkpoints if c < settings["steps"])
    return settings


def specs_of(protocol: dict[str, Any], quick: bool = False) -> list[Spec]:
    """The protocol's runs in its fixed order (seed-major; the limited arms only on their seeds)."""
    settings = tuple(sorted(settings_of(protocol, quick).items()))
    seeds = protocol["quick"]["seeds"] if quick else protocol["seeds"]
    limited = {arm: set(seeds[:1] if quick else on) for arm, on in protocol["limited_arms"].items()}
    return [
        Spec(arm, protocol["settings"]["lag"], seed, settings)
        for seed in seeds
        for arm in protocol["arms_per_seed"]
        if arm not in limited or seed in limited[arm]
    ]


def _blob(rel: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), "hash-object", rel], capture_output=True, text=True).stdout.strip()


def run(specs: Sequence[Spec], out: Path, assets: Path, provenance: dict[str, Any], stop: datetime | None) -> int:
    """Run ``specs`` in order in this process (assets loaded once); none starts after ``stop``."""
    from studies.lib.loop import load_assets
    from studies.token_level.token_loop import TokenLoop

    out.mkdir(parents=True, exist_ok=True)
    old = json.loads((out / "provenance.json").read_text()) if (out / "provenance.json").is_file() else None
    if old and any(old.get(k) != provenance.get(k) for k in ("protocol_blob", "assets_fingerprint")):
        raise SystemExit(f"[token] {out} holds runs of another protocol or assets ({old}); use a new --out")
    (out / "provenance.json").write_text(json.dumps(provenance, indent=2))
    model, tokenizer = load_assets(assets)
    done = 0
    start = time.perf_counter()
    for i, spec in enumerate(specs, 1):
        cfg = spec.config()
        run_dir = out / "runs" / spec.name
        if harness.complete(run_dir, cfg.steps):
            continue
        if stop is not None and datetime.now(UTC) >= stop:
            print(f"[token] time stop {stop.isoformat()}: {len(specs) - i + 1} runs not started", flush=True)
            break
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "study_spec.json").write_text(json.dumps(asdict(spec), default=list))
        t = time.perf_counter()
        TokenLoop(cfg, model, tokenizer).run(run_dir, method=spec.arm)
        done += 1
        print(
            f"[token] {i}/{len(specs)} {spec.name}: {time.perf_counter() - t:.0f} s | "
            f"{(time.perf_counter() - start) / 60:.1f} min | {datetime.now(UTC):%H:%M:%S}",
            flush=True,
        )
    return done


# -- per-run statistics ----------------------------------------------------------------------------
def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def run_stats(spec: Spec, rows: Sequence[dict[str, Any]], checkpoints: Sequence[int]) -> dict[str, Any]:
    """One run: accuracy (auc, final, checkpoints), SAT's activity, and the diagnosis's per-step means."""
    evals = {int(r["step"]): r[HELDOUT_KEY] for r in rows if HELDOUT_KEY in r}
    out: dict[str, Any] = {"name": spec.name, "arm": spec.arm, "lag": spec.lag, "seed": spec.seed, "tag": spec.tag}
    for c in checkpoints:
        out[f"heldout_acc@{c}"] = evals.get(c)
    accs = [evals.get(c) for c in checkpoints]
    out["auc"] = _mean(accs) if all(a is not None for a in accs) else None
    out["heldout_acc"] = evals.get(max(evals)) if evals else None
    q = [r["token/q"] for r in rows if "token/q" in r]
    out["q_median"] = sorted(q)[len(q) // 2] if q else None
    out["q_below_radius_frac"] = _mean([float(v < RADIUS) for v in q])
    active = sum(r.get("token/active", 0.0) for r in rows)
    keys = sorted({k for r in rows for k in r if k.startswith("token/") and k != "token/q"})
    totals = {k: sum(r.get(k, 0.0) for r in rows) for k in keys}
    out["intercepted_frac"] = totals.get("token/intercepted", 0.0) / active if active else None
    out["gated_frac"] = totals.get("token/gated", 0.0) / active if active else None
    out["intercepted_steps_frac"] = _mean([float(r.get("token/intercepted", 0.0) > 0) for r in rows])
    out["removed_weight_share"] = (
        totals["token/wrem"] / totals["token/wbase"] if totals.get("token/wbase") else None
    )  # pooled over the run's steps
    for k in ("grad_removed_share", "grad_removed_proj"):
        out[k] = _mean([r[f"token/{k}"] for r in rows if f"token/{k}" in r])
    for k in keys:  # per class: the run's totals (counts and weights)
        name = k.removeprefix("token/")
        if any(name.endswith(f"_{c}") for c in TOKEN_CLASSES):
            out[f"sum_{name}"] = totals[k]
    for k in ("active", "gated", "intercepted", "wbase", "wrem"):
        out[f"sum_{k}"] = totals.get(f"token/{k}", 0.0)
    for name in COUNTERFACTUAL:  # what the variants' rule would intercept on this arm's steps
        out[f"icpt_frac_{name}"] = totals.get(f"token/icpt_{name}", 0.0) / active if active else None
        values = [r[f"token/q_{name}"] for r in rows if f"token/q_{name}" in r]
        out[f"q_below_radius_frac_{name}"] = _mean([float(v < RADIUS) for v in values])
    out["kernel_matters_frac"] = _mean([float(v < KERNEL_BOUND) for v in q])
    out["p4_differs_frac"] = _mean(
        [float(r["token/icpt_p4"] != r["token/icpt_p2"]) for r in rows if "token/icpt_p4" in r]
    )
    out["steps"] = len(rows)
    return out


# -- analysis ----------------------------------------------------------------------------------------
def family(stats: Sequence[dict[str, Any]], pairs: Sequence[Sequence[str]], key: str, lag: int) -> list[dict]:
    """Paired contrasts on ``key``, Holm-adjusted (Wilcoxon p) within the family."""
    rows = [r for a, b in pairs if (r := base.paired(stats, a, b, lag, key))]
    for r, adjusted in zip(rows, holm([r["wilcoxon_p"] for r in rows]), strict=True):
        r["holm_p"] = adjusted
    return rows


def class_shares(stats: Sequence[dict[str, Any]], arm: str) -> dict[str, Any]:
    """Per class, pooled over the arm's runs: its share of the active, gated and intercepted tokens
    and of the removed weight; intercepted tokens by advantage sign; gated tokens with d > 0."""
    runs = [s for s in stats if s["arm"] == arm]

    def total(key: str) -> float:
        return sum(s.get(key) or 0.0 for s in runs)

    out: dict[str, Any] = {"arm": arm, "runs": len(runs)}
    icpt = sum(total(f"sum_icpt_{s}_{c}") for s in ("apos", "aneg") for c in TOKEN_CLASSES)
    for c in TOKEN_CLASSES:
        out[c] = {
            "active": _share(total(f"sum_active_{c}"), total("sum_active")),
            "gated": _share(total(f"sum_gated_{c}"), total("sum_gated")),
            "intercepted": _share(total(f"sum_icpt_apos_{c}") + total(f"sum_icpt_aneg_{c}"), icpt),
            "removed_weight": _share(total(f"sum_wrem_{c}"), total("sum_wrem")),
            "gated_dpos": _share(total(f"sum_gated_dpos_{c}"), total(f"sum_gated_{c}")),
            "gated_azero": _share(total(f"sum_gated_azero_{c}"), total(f"sum_gated_{c}")),
        }
    out["intercepted_apos"] = _share(sum(total(f"sum_icpt_apos_{c}") for c in TOKEN_CLASSES), icpt)
    return out


def _share(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def over_seeds(stats: Sequence[dict[str, Any]], arm: str, key: str) -> dict[str, Any] | None:
    """Mean and t 95% interval over the arm's seeds of a per-run measure."""
    from studies.lib.stats import paired_t_interval

    values = [s[key] for s in stats if s["arm"] == arm and s.get(key) is not None]
    if len(values) < 2:
        return {"n": len(values), "mean": values[0], "ci": None} if values else None
    mean, lo, hi = paired_t_interval(values)
    return {"n": len(values), "mean": mean, "ci": (lo, hi)}


def analyse(stats: Sequence[dict[str, Any]], protocol: dict[str, Any]) -> dict[str, Any]:
    """Family A, the secondaries, SAT's activity and the diagnosis, from run rows."""
    lag = protocol["settings"]["lag"]
    arms = [a for a in protocol["arms_per_seed"] if any(s["arm"] == a for s in stats)]
    checkpoints = protocol["checkpoints"]
    secondary = {
        key: family(stats, protocol["family_a"], key, lag)
        for key in ("heldout_acc", *(f"heldout_acc@{c}" for c in checkpoints[:-1]))
    }
    diag_keys = ("q_below_radius_frac", "gated_frac", "intercepted_frac", "removed_weight_share")
    diag_keys += ("grad_removed_share", "grad_removed_proj", "auc", "heldout_acc", "kernel_matters_frac")
    diag_keys += ("p4_differs_frac", *(f"icpt_frac_{n}" for n in COUNTERFACTUAL))
    diag_keys += tuple(f"q_below_radius_frac_{n}" for n in COUNTERFACTUAL)
    result = {
        "family_a": family(stats, protocol["family_a"], "auc", lag),
        "secondary": secondary,
        "secondary_pairs": family(stats, protocol["secondary_pairs"], "auc", lag),
        "per_arm": {a: {k: over_seeds(stats, a, k) for k in diag_keys} for a in arms},
        "classes": {a: class_shares(stats, a) for a in arms},
        "seeds": {a: sorted(s["seed"] for s in stats if s["arm"] == a) for a in arms},
    }
    result["association"] = association(stats)
    result["breadth_auc"] = breadth_auc(BREADTH_ROWS)
    return result


BREADTH_ROWS = REPO / "studies" / "breadth" / "results" / "runs.csv"
BREADTH_PAIRS = (("sat_grpo", "grpo"), ("sat_grpo_r3", "grpo_r3"))


def breadth_auc(path: Path) -> list[dict[str, Any]]:
    """Exploratory (in no protocol): this protocol's auc on the breadth study's committed part 3 rows
    (seeds 3001-3016, assets a44e53f246d0502a): the mean of the accuracy after 60, 120, 180 and 240."""
    import csv

    keys = ("heldout_acc@60", "heldout_acc@120", "heldout_acc@180", "heldout_acc")
    arms = {a for pair in BREADTH_PAIRS for a in pair}
    stats = [
        {
            "arm": r["arm"],
            "lag": int(r["lag"]),
            "seed": int(r["seed"]),
            "tag": "",
            "auc": _mean([float(r[k]) for k in keys]),
        }
        for r in csv.DictReader(path.open())
        if r["tag"] == "" and r["arm"] in arms
    ]
    return family(stats, BREADTH_PAIRS, "auc", 8)


def association(stats: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Exploratory: per seed, auc(sat_grpo) - auc(grpo) against sat_grpo's projected removed share."""
    from scipy.stats import spearmanr

    cell = {s["seed"]: s for s in stats if s["arm"] == "sat_grpo"}
    ref = {s["seed"]: s for s in stats if s["arm"] == "grpo"}
    seeds = [k for k in sorted(cell) if k in ref and cell[k]["auc"] is not None and ref[k]["auc"] is not None]
    if len(seeds) < 3:
        return None
    x = [cell[k]["grad_removed_proj"] for k in seeds]
    y = [cell[k]["auc"] - ref[k]["auc"] for k in seeds]
    rho = spearmanr(x, y)
    return {"seeds": len(seeds), "rho": float(rho.statistic), "p": float(rho.pvalue)}


# -- report ------------------------------------------------------------------------------------------
def _f(v: float | None, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def _ci(cell: dict[str, Any] | None, spec: str = ".3f") -> str:
    if not cell:
        return "-"
    if cell["ci"] is None:
        return f"{cell['mean']:{spec}} (n 1)"
    lo, hi = cell["ci"]
    return f"{cell['mean']:{spec}} [{lo:{spec}}, {hi:{spec}}]"


def contrast_lines(rows: Sequence[dict[str, Any]], alpha: float) -> list[str]:
    lines = [
        "| arm - reference | seeds | arm | reference | difference [paired t 95%] | Wilcoxon p | Holm p "
        "| positive | reading |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        reading = "differs" if r["holm_p"] < alpha else "no difference detected"
        lines.append(
            f"| {LABELS[r['arm']]} - {LABELS[r['reference']]} | {r['seeds']} | {contrast_cells(r)} | {reading} |"
        )
    return lines


RUN_COLUMNS = (
    ("q_below_radius_frac", ".2f"),
    ("intercepted_frac", ".4f"),
    ("removed_weight_share", ".4f"),
    ("grad_removed_share", ".3f"),
    ("grad_removed_proj", ".3f"),
    ("auc", ".3f"),
    ("heldout_acc", ".3f"),
)


def run_table(stats: Sequence[dict[str, Any]], arms: Sequence[str]) -> list[str]:
    """One line per run (docs/study.md quotes it; tests/test_token_level_results.py reads it back)."""
    lines = [
        "| arm | seed | steps q < log(1.2) | intercepted frac | removed weight share | removed gradient share "
        "| projected removed share | auc | final acc |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    order = {a: i for i, a in enumerate(arms)}
    for s in sorted(stats, key=lambda s: (order.get(s["arm"], 99), s["seed"])):
        cells = " | ".join(_f(s.get(k), spec) for k, spec in RUN_COLUMNS)
        lines.append(f"| {LABELS[s['arm']]} | {s['seed']} | {cells} |")
    return lines


def class_lines(result: dict[str, Any]) -> list[str]:
    """One line per arm: each class's share of the active, intercepted tokens and of the removed
    weight (digit / format / eos / other), and the intercepted tokens' share with A < 0."""
    lines = [
        "| arm | active: digit / format / eos / other | intercepted | removed weight | intercepted with A < 0 |",
        "|---|---|---|---|---|",
    ]
    for arm, cls in result["classes"].items():
        cols = [
            " / ".join(_f(cls[c][k], ".2f") for c in TOKEN_CLASSES) for k in ("active", "intercepted", "removed_weight")
        ]
        negative = None if cls["intercepted_apos"] is None else 1.0 - cls["intercepted_apos"]
        lines.append(f"| {LABELS[arm]} | {' | '.join(cols)} | {_f(negative, '.2f')} |")
    return lines


TEXT_COLUMNS = ("name", "arm", "tag", "quick", "protocol_commit", "protocol_blob", "protocol_path")
TEXT_COLUMNS += ("assets_fingerprint", "loop_blob", "instrument_blobs")


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The committed runs.csv typed back (``sat_study.read_csv``; ``quick`` is text here)."""
    return base.read_csv(path, TEXT_COLUMNS, flags=())


def report(
    result: dict[str, Any], provenance: dict[str, Any], protocol: dict[str, Any], stats: Sequence[dict[str, Any]]
) -> str:
    alpha = protocol["alpha"]
    text = [
        "# The token level, diagnosed (issue 46, part 2c)",
        "",
        f"Protocol `{provenance.get('protocol_path')}` commit `{provenance.get('protocol_commit')}` (blob "
        f"`{provenance.get('protocol_blob')}`), assets `{provenance.get('assets_fingerprint')}`, loop blob "
        f"`{provenance.get('loop_blob')}`. Seeds per arm: "
        + "; ".join(f"{LABELS[a]} {s[0]}-{s[-1]} ({len(s)})" for a, s in result["seeds"].items() if s)
        + ".",
        "",
        "## Every run (GRPO's SAT columns: counterfactual)",
        "",
        *run_table(stats, protocol["arms_per_seed"]),
        "",
        "## Family A: the area under the learning curve (Holm over 3; exploratory below 8 seeds)",
        "",
        *contrast_lines(result["family_a"], alpha),
        "",
        "## Secondaries (same contrasts; Holm within each measure)",
        "",
    ]
    for key, rows in result["secondary"].items():
        text += [f"### {key}", "", *contrast_lines(rows, alpha), ""]
    text += ["### variants against SAT-GRPO (auc)", "", *contrast_lines(result["secondary_pairs"], alpha), ""]
    text += [
        "## SAT's activity and the share of the update it removes (mean [t 95%] over seeds)",
        "",
        "| arm | steps q < log(1.2) | gated frac | intercepted frac | removed weight share "
        "| removed gradient share | projected removed share | auc | final acc |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, cells in result["per_arm"].items():
        text.append(
            f"| {LABELS[arm]} | {_ci(cells['q_below_radius_frac'], '.2f')} | {_ci(cells['gated_frac'])} | "
            f"{_ci(cells['intercepted_frac'], '.4f')} | {_ci(cells['removed_weight_share'], '.4f')} | "
            f"{_ci(cells['grad_removed_share'])} | {_ci(cells['grad_removed_proj'])} | {_ci(cells['auc'])} | "
            f"{_ci(cells['heldout_acc'])} |"
        )
    text += [
        "",
        "| arm | intercepted frac at alpha 0.9 / 0.95 / 0.99 (p = 2) | at p = 4 | steps q < log(1.2) at "
        "alpha 0.95 / 0.99 | steps q < -log(0.9) (the kernel can matter) | steps where p = 4 changes the count |",
        "|---|---|---|---|---|---|",
    ]
    for arm, cells in result["per_arm"].items():
        text.append(
            f"| {LABELS[arm]} | {_ci(cells['icpt_frac_p2'], '.4f')} / {_ci(cells['icpt_frac_a95'], '.4f')} / "
            f"{_ci(cells['icpt_frac_a99'], '.4f')} | {_ci(cells['icpt_frac_p4'], '.4f')} | "
            f"{_ci(cells['q_below_radius_frac_a95'], '.2f')} / {_ci(cells['q_below_radius_frac_a99'], '.2f')} | "
            f"{_ci(cells['kernel_matters_frac'], '.2f')} | {_ci(cells['p4_differs_frac'], '.2f')} |"
        )
    text += [
        "",
        "GRPO's row is counterfactual: what SAT (alpha 0.9, p = 2) would gate and remove on GRPO's steps.",
        "",
        "## Which tokens (pooled over each arm's runs and steps)",
        "",
        *class_lines(result),
        "",
        "| arm | class | share of active | of gated | of intercepted | of removed weight | gated with d > 0 "
        "| gated with A = 0 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm, cls in result["classes"].items():
        for c in TOKEN_CLASSES:
            v = cls[c]
            text.append(
                f"| {LABELS[arm]} | {c} | {_f(v['active'])} | {_f(v['gated'])} | {_f(v['intercepted'])} | "
                f"{_f(v['removed_weight'])} | {_f(v['gated_dpos'])} | {_f(v['gated_azero'])} |"
            )
        text.append(f"| {LABELS[arm]} | intercepted with A > 0 | {_f(cls['intercepted_apos'])} | | | | | |")
    text += [
        "",
        "## Exploratory: this protocol's auc on the breadth study's committed part 3 rows (seeds 3001-3016)",
        "",
        *contrast_lines(result["breadth_auc"], alpha),
    ]
    a = result["association"]
    text += [
        "",
        "## Exploratory: per seed, SAT-GRPO's auc loss against its projected removed share",
        "",
        f"Spearman rho {a['rho']:+.2f} (p {a['p']:.3f}, {a['seeds']} seeds)." if a else "Fewer than 3 seeds.",
    ]
    return "\n".join(text) + "\n"


def _tick(arm: str) -> str:
    return LABELS[arm].replace(", ", "\n").replace(" + ", "\n+ ")


def plot(out: Path, result: dict[str, Any], stats: Sequence[dict[str, Any]]) -> Path:
    """token_level.png: (a) intercepted tokens by class and advantage sign per arm, (b) the
    parameter-space shares per arm (seeds as dots), (c) family A's contrasts with intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(result["classes"])
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2), gridspec_kw={"width_ratios": [1, 1, 1.15]})
    ax = axes[0]
    colors = {"digit": "tab:blue", "format": "tab:orange", "eos": "tab:green", "other": "tab:gray"}
    for i, arm in enumerate(arms):
        runs = [s for s in stats if s["arm"] == arm]
        active = sum(s["sum_active"] for s in runs) or 1.0
        bottom = {"apos": 0.0, "aneg": 0.0}
        for c in TOKEN_CLASSES:
            for j, sign in enumerate(("apos", "aneg")):
                v = 1000 * sum(s.get(f"sum_icpt_{sign}_{c}") or 0.0 for s in runs) / active
                x = i + (j - 0.5) * 0.38
                ax.bar(
                    x,
                    v,
                    0.36,
                    bottom=bottom[sign],
                    color=colors[c],
                    label=c if i == 0 and j == 0 else None,
                    hatch="" if sign == "apos" else "//",
                    edgecolor="black",
                    lw=0.4,
                )
                bottom[sign] += v
    ax.set_xticks(range(len(arms)), [_tick(a) for a in arms], fontsize=7)
    ax.set_ylabel("intercepted tokens per 1000 active")
    ax.set_title("(a) tokens SAT intercepts: left A > 0, right (hatched) A < 0", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[1]
    for i, arm in enumerate(arms):
        for j, (key, marker) in enumerate((("grad_removed_share", "o"), ("grad_removed_proj", "s"))):
            vals = [s[key] for s in stats if s["arm"] == arm and s.get(key) is not None]
            x = i + (j - 0.5) * 0.3
            ax.scatter(
                [x] * len(vals),
                vals,
                marker=marker,
                color="tab:red" if j else "tab:purple",
                s=14,
                label=(["||G_I|| / ||G_base||", "<G_I, G_base> / ||G_base||^2"][j] if i == 0 else None),
            )
            if vals:
                ax.hlines(sum(vals) / len(vals), x - 0.12, x + 0.12, color="black")
    ax.axhline(0, color="gray", lw=0.6)
    ax.set_xticks(range(len(arms)), [_tick(a) for a in arms], fontsize=7)
    ax.set_title("(b) the share of GRPO's step SAT removes (GRPO: counterfactual)", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[2]
    rows = [(r, "breadth rows, auc", "tab:blue") for r in result["breadth_auc"]]
    rows += [(r, "auc", "black") for r in result["family_a"]]
    rows += [(r, "final", "tab:gray") for r in result["secondary"]["heldout_acc"]]
    for k, (r, _, color) in enumerate(rows):
        lo, hi = r["ci"]
        err = [[r["diff"] - lo], [hi - r["diff"]]]
        ax.errorbar(r["diff"], len(rows) - k, xerr=err, fmt="o", capsize=3, color=color)
    ax.axvline(0, color="gray", lw=0.6)
    names = [f"{LABELS[r['arm']]} - {LABELS[r['reference']]} ({what}, n {r['seeds']})" for r, what, _ in rows]
    ax.set_yticks([len(rows) - k for k in range(len(rows))], names, fontsize=7)
    ax.set_xlabel("held-out accuracy difference [paired t 95%]")
    ax.set_title("(c) accuracy against GRPO, paired by seed", fontsize=9)
    fig.tight_layout()
    path = out / "token_level.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summarize(out: Path, protocol: dict[str, Any], quick: bool = False) -> dict[str, Any]:
    specs, runs = load_runs(out)
    provenance = json.loads((out / "provenance.json").read_text())
    checkpoints = protocol["quick"]["checkpoints"] if quick else protocol["checkpoints"]
    stats = [{**run_stats(s, runs[s.name], checkpoints), **provenance} for s in specs]
    base.write_csv(out / "runs.csv", stats)
    result = analyse(stats, protocol)
    (out / "study.json").write_text(json.dumps({"provenance": provenance, **result}, indent=2, default=list))
    (out / "study.md").write_text(report(result, provenance, protocol, stats))
    plot(out, result, stats)
    return result


def load_runs(out: Path) -> tuple[list[Spec], dict[str, list[dict[str, Any]]]]:
    """The complete runs under ``out/runs``."""
    from verl_sat.files import METRICS_FILE, read_metrics

    specs = []
    for p in sorted(out.glob("runs/*/study_spec.json")):
        raw = json.loads(p.read_text())
        raw["settings"] = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in raw["settings"])
        specs.append(Spec(**raw))
    runs = {s.name: read_metrics(out / "runs" / s.name / METRICS_FILE) for s in specs}
    done = [s for s in specs if len(runs[s.name]) >= s.config().steps]
    return done, {s.name: runs[s.name] for s in done}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("phase", choices=("run", "quick", "summarize"))
    parser.add_argument("dir", nargs="?", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--assets", type=Path)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    protocol = base.read_protocol(PROTOCOL)
    out = (args.dir or args.out).resolve()
    quick = args.phase == "quick"
    if args.phase == "summarize":
        summarize(out, protocol, quick=json.loads((out / "provenance.json").read_text()).get("quick", False))
        print((out / "study.md").read_text())
        return 0
    provenance: dict[str, Any] = {"quick": quick}
    if not quick:
        provenance.update(base.protocol_state(PROTOCOL))
    provenance["loop_blob"] = _blob(CODE[0])
    provenance["instrument_blobs"] = ",".join(_blob(c) for c in CODE[1:])
    specs = specs_of(protocol, quick)
    print(f"[token] {args.phase}: {len(specs)} runs in order", flush=True)
    if args.dry_run:
        for s in specs:
            print(s.name)
        return 0
    assets = args.assets or base._default_assets()
    provenance["assets_fingerprint"] = base.assets_fingerprint(assets)
    stop = None if quick else datetime.fromisoformat(protocol["stop_utc"])
    run(specs, out, assets, provenance, stop)
    summarize(out, protocol, quick)
    print((out / "study.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
