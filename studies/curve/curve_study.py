"""The learning curve: q per micro-batch against q per step, and SAT with DPPO-TV (issue 46;
studies/curve/study_protocol_curve_v2.md).

    python studies/curve/curve_study.py run --out runs/curve --stop-starting 08:00 --cut-at 08:08
                                                                      # the 64 runs, seed-major, until the stop
    python studies/curve/curve_study.py quick --out runs/curve_q      # the whole pipeline, 2 seeds x 16 steps
    python studies/curve/curve_study.py summarize runs/curve          # runs.csv, study.md, figures again
    python studies/curve/curve_study.py summarize runs/curve --results studies/curve/results   # and commit-ready copies

The breadth study's harness (the confirmatory study's loop, arms, run statistics and protocol
check; studies/confirmatory/sat_study.py) with two arms more, built from the protocol's
``new_arms``. ``run`` refuses to start while the protocol is uncommitted or changed; every row
carries its commit and blob and the assets' fingerprint. The primary measure is the mean
held-out accuracy over the checkpoints (the area under the learning curve); the analysis uses the
seeds whose every arm completed; readings only once all 16 are (before: "interim").
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PROTOCOL = HERE / "study_protocol_curve_v2.md"
"""v2 supersedes study_protocol_curve.md (which named assets not on this machine; no run under it finished)"""
sys.path.insert(0, str(HERE.parent / "confirmatory"))
import sat_study as base  # noqa: E402  (one harness: arms, specs, run statistics, protocol check)

from studies.lib import harness  # noqa: E402  (sat_study put the repository root on sys.path)
from studies.lib.stats import contrast_cells, holm, paired_t_interval  # noqa: E402

AUC = "auc"
LABELS = {
    "sat_gspo_r3": "SAT-GSPO + R3",
    "sat_gspo_r3_mbq": "SAT-GSPO + R3, q per micro-batch",
    "sat_gspo_r3_dppo": "SAT-GSPO + R3 + DPPO-TV mask",
    "dppo_tv_r3": "DPPO-TV + R3",
}
MEASURES = {
    AUC: "mean of steps 60-240 (primary)",
    "heldout_acc@240": "after step 240",
    "heldout_acc@60": "after step 60",
    "heldout_acc@120": "after step 120",
    "heldout_acc@180": "after step 180",
}
ACTIVITY = {
    "q_below_radius_frac": None,  # from sat_study.run_stats
    "intercepted_frac": None,
    "dppo_masked_frac": "study/dppo_masked_frac",
    "dppo_intercepted_overlap_frac": "study/dppo_intercepted_overlap_frac",
    "dppo_arm_masked_frac": "study/dppo_arm_masked_frac",
    "micro_batches": "study/micro_batches",
    "seqs_per_mb_min": "study/seqs_per_micro_batch_min",
    "seqs_per_mb_mean": "study/seqs_per_micro_batch_mean",
    "seqs_per_mb_max": "study/seqs_per_micro_batch_max",
    "mb_starved_frac": "study/mb_starved_frac",
    "mb_gate_rate": "study/mb_gate_rate",
    "sat_gate_rate": "actor/sat_gate_rate",
}


def register_arms(protocol: dict[str, Any]) -> None:
    """The protocol's new arms: a confirmatory arm's LoopConfig fields plus the named changes."""
    for name, spec in protocol["new_arms"].items():
        fields = {k: v for k, v in spec.items() if k != "base"}
        base.ARMS[name] = {**base.ARMS[spec["base"]], **fields}


def settings_of(protocol: dict[str, Any], quick: bool = False) -> dict[str, Any]:
    settings = {**protocol["settings"], "eval_at": tuple(protocol["checkpoints"])}
    if quick:
        q = protocol["quick"]
        settings.update(steps=q["steps"], eval_problems=q["eval_problems"], eval_at=(4, 8, 12))
    return settings


def auc_checkpoints(protocol: dict[str, Any], quick: bool = False) -> list[int]:
    """The checkpoints the area under the curve averages (quick: its own four)."""
    return [4, 8, 12, protocol["quick"]["steps"]] if quick else list(protocol["auc_checkpoints"])


def specs(protocol: dict[str, Any], quick: bool = False) -> list[base.Spec]:
    """Every (arm, seed), seed-major: the arms of the first seed, then the next (a cut keeps whole seeds)."""
    seeds = protocol["quick"]["seeds"] if quick else protocol["seeds"]
    out = base.specs_for(protocol["arms"], (protocol["lag"],), seeds, settings_of(protocol, quick))
    order = {arm: i for i, arm in enumerate(protocol["arms"])}
    return sorted(out, key=lambda s: (s.seed, order[s.arm]))


# -- per-run numbers -----------------------------------------------------------------------------
def run_stats(spec: base.Spec, rows: Sequence[dict[str, Any]], checkpoints: Sequence[int]) -> dict[str, Any]:
    """sat_study's run statistics, the area under the curve (the checkpoints' mean accuracy) and the
    per-step means of the activity metrics (a metric the arm never logs is left empty)."""
    out = base.run_stats(spec, rows)
    accs = [out.get(f"heldout_acc@{c}") for c in checkpoints]
    out[AUC] = sum(accs) / len(accs) if all(a is not None for a in accs) else None
    for column, key in ACTIVITY.items():
        if key is None:
            continue
        values = [r[key] for r in rows if key in r]
        out[column] = sum(values) / len(values) if values else None
    return out


def complete_seeds(stats: Sequence[dict[str, Any]], arms: Sequence[str]) -> list[int]:
    """The seeds whose every arm completed (the protocol's analysis set under its time stop)."""
    have: dict[int, set[str]] = {}
    for s in stats:
        have.setdefault(s["seed"], set()).add(s["arm"])
    return sorted(seed for seed, got in have.items() if set(arms) <= got)


# -- analysis ------------------------------------------------------------------------------------
def family(stats: Sequence[dict[str, Any]], pairs: Sequence[Sequence[str]], lag: int, key: str) -> list[dict]:
    """The paired contrasts of one family on one measure, Holm-adjusted (the Wilcoxon p)."""
    rows = [r for arm, ref in pairs if (r := base.paired(stats, arm, ref, lag, key))]
    for r, adjusted in zip(rows, holm([r["wilcoxon_p"] for r in rows]), strict=True):
        r["holm_p"] = adjusted
    return rows


def activity(stats: Sequence[dict[str, Any]], arms: Sequence[str]) -> list[dict[str, Any]]:
    """Per arm: the mean over its runs of every activity column (None where the arm logs none)."""
    out = []
    for arm in arms:
        runs = [s for s in stats if s["arm"] == arm]
        row: dict[str, Any] = {"arm": arm, "runs": len(runs)}
        for column in ACTIVITY:
            values = [s[column] for s in runs if s.get(column) is not None]
            row[column] = sum(values) / len(values) if values else None
        out.append(row)
    return out


def curve(stats: Sequence[dict[str, Any]], arms: Sequence[str], checkpoints: Sequence[int]) -> dict[str, list]:
    """Per arm and checkpoint: (seed mean, t 95% lo, hi) of the held-out accuracy."""
    out: dict[str, list] = {}
    for arm in arms:
        points = []
        for c in checkpoints:
            values = [s[f"heldout_acc@{c}"] for s in stats if s["arm"] == arm and s.get(f"heldout_acc@{c}") is not None]
            if len(values) >= 2:
                points.append(paired_t_interval(values))
            else:  # one seed: its value, no interval
                points.append((values[0], values[0], values[0]) if values else (None, None, None))
        out[arm] = points
    return out


def analyse(stats: Sequence[dict[str, Any]], protocol: dict[str, Any], checkpoints: Sequence[int]) -> dict[str, Any]:
    """Every family on every measure over the complete seeds, the activity and the curve."""
    seeds = complete_seeds(stats, protocol["arms"])
    kept = [s for s in stats if s["seed"] in seeds]
    families = {
        name: {key: family(kept, pairs, protocol["lag"], key) for key in MEASURES}
        for name, pairs in protocol["families"].items()
    }
    return {
        "seeds": seeds,
        "planned_seeds": len(protocol["seeds"]),
        "families": families,
        "activity": activity(kept, protocol["arms"]),
        "checkpoints": list(checkpoints),
        "curve": curve(kept, protocol["arms"], checkpoints),
    }


PLANNED = 16
"""seeds per arm the protocol plans; readings are made only at that many complete seeds"""


def reading(r: dict[str, Any], alpha: float) -> str:
    """The protocol's reading, or "interim" before all planned seeds are complete."""
    if r["seeds"] < PLANNED:
        return f"interim ({r['seeds']} of {PLANNED} seeds)"
    return "differs" if r["holm_p"] < alpha else "no difference detected"


def _f(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, int | float) else "-"


TITLES = {
    "a": "(a) q per micro-batch against q per step (Holm over 1)",
    "b": "(b) SAT with DPPO-TV (Holm over 2)",
    "b_reference": "(b) SAT-GSPO + R3 against DPPO-TV + R3, fresh seeds (alone)",
}


def quote_lines(result: dict[str, Any], alpha: float) -> list[str]:
    """The table docs/study.md quotes: every contrast on every measure, three decimals."""
    lines = [
        "| family | arm | reference | measure | arm acc. | ref. acc. | difference [paired t 95%] | Wilcoxon p "
        "| Holm p | positive pairs | reading |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, measures in result["families"].items():
        for key, rows in measures.items():
            for r in rows:
                lines.append(
                    f"| {name} | {LABELS[r['arm']]} | {LABELS[r['reference']]} | {MEASURES[key]} | "
                    f"{contrast_cells(r)} | {reading(r, alpha)} |"
                )
    return lines


def activity_lines(result: dict[str, Any]) -> list[str]:
    lines = [
        "| arm | runs | q below log(1.2) | SAT intercepted | DPPO-TV masked (counterfactual) | both | "
        "DPPO mask applied | micro-batches | responses per micro-batch (step min / mean / max, averaged) "
        "| starved micro-batches | gate rate applied |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for a in result["activity"]:
        sizes = "-"
        if a["seqs_per_mb_mean"] is not None:
            sizes = f"{a['seqs_per_mb_min']:.2f} / {a['seqs_per_mb_mean']:.2f} / {a['seqs_per_mb_max']:.2f}"
        gate = a["mb_gate_rate"] if a["mb_gate_rate"] is not None else a["sat_gate_rate"]
        lines.append(
            f"| {LABELS[a['arm']]} | {a['runs']} | {_f(a['q_below_radius_frac'], '.3f')} | "
            f"{_f(a['intercepted_frac'], '.4f')} | {_f(a['dppo_masked_frac'], '.4f')} | "
            f"{_f(a['dppo_intercepted_overlap_frac'], '.4f')} | {_f(a['dppo_arm_masked_frac'], '.4f')} | "
            f"{_f(a['micro_batches'], '.1f')} | {sizes} | {_f(a['mb_starved_frac'], '.3f')} | {_f(gate, '.4f')} |"
        )
    return lines


def report(result: dict[str, Any], protocol: dict[str, Any], provenance: dict[str, Any]) -> str:
    alpha = protocol["alpha"]
    seeds = result["seeds"]
    span = f"{seeds[0]}-{seeds[-1]}" if seeds else "none"
    lines = [
        "# Curve study (studies/curve/study_protocol_curve_v2.md)",
        "",
        f"Protocol commit `{provenance.get('protocol_commit')}` (blob `{provenance.get('protocol_blob')}`), assets "
        f"`{provenance.get('assets_fingerprint')}`" + (" (quick: not evidence)" if provenance.get("quick") else ""),
        "",
        f"Seeds with every arm complete: {len(seeds)} of the planned {result['planned_seeds']} ({span}).",
        "",
        "## Every contrast (the table docs/study.md quotes)",
        "",
        *quote_lines(result, alpha),
        "",
        "## Where each acts (per arm: means over steps, then runs)",
        "",
        *activity_lines(result),
        "",
        "## The curve (seed mean [t 95%])",
        "",
        "| arm | " + " | ".join(f"after step {c}" for c in result["checkpoints"]) + " |",
        "|---|" + "---|" * len(result["checkpoints"]),
    ]
    for arm, points in result["curve"].items():
        cells = [f"{m:.3f} [{lo:.3f}, {hi:.3f}]" if m is not None else "-" for m, lo, hi in points]
        lines.append(f"| {LABELS[arm]} | " + " | ".join(cells) + " |")
    for name, title in TITLES.items():
        lines += ["", f"## {title}", ""]
        for key, rows in result["families"][name].items():
            for r in rows:
                lines.append(
                    f"- {MEASURES[key]}: {r['arm']} - {r['reference']}: {r['diff']:+.4f} "
                    f"[{r['ci'][0]:+.4f}, {r['ci'][1]:+.4f}], Wilcoxon p {r['wilcoxon_p']:.4f}, Holm p "
                    f"{r['holm_p']:.4f}, perm. p {_f(r['permutation_p'], '.4f')} ({reading(r, alpha)})"
                )
    return "\n".join(lines) + "\n"


def plot(out: Path, result: dict[str, Any], protocol: dict[str, Any]) -> None:
    """curve.png: each arm's seed-mean curve with t 95% intervals; contrasts.png: every contrast."""
    plt = base._plt()
    checkpoints = result["checkpoints"]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, (arm, points) in enumerate(result["curve"].items()):
        xs = [c + (i - 1.5) * 2 for c, (m, _, _) in zip(checkpoints, points, strict=True) if m is not None]
        ms = [m for m, _, _ in points if m is not None]
        err = [[m - lo for m, lo, _ in points if m is not None], [hi - m for m, _, hi in points if m is not None]]
        ax.errorbar(xs, ms, yerr=err, marker="o", capsize=3, label=LABELS[arm])
    ax.set_xticks(checkpoints)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out accuracy (seed mean, t 95%)")
    ax.set_title(f"lag 8, {len(result['seeds'])} seeds with every arm")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "curve.png", dpi=110)
    plt.close(fig)
    rows = [(name, key, r) for name, measures in result["families"].items() for key, rs in measures.items() for r in rs]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(rows) + 1.4))
    for y, (_, key, r) in enumerate(rows):
        lo, hi = r["ci"]
        ax.errorbar(r["diff"], y, xerr=[[r["diff"] - lo], [hi - r["diff"]]], fmt="o" if key == AUC else ".", capsize=2)
    ax.axvline(0.0, color="gray", lw=0.8)
    labels = [f"{name}: {LABELS[r['arm']]} - {LABELS[r['reference']]}, {MEASURES[key]}" for name, key, r in rows]
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.set_xlabel("held-out accuracy difference [paired t 95%]")
    fig.tight_layout()
    fig.savefig(out / "contrasts.png", dpi=110)
    plt.close(fig)


def in_progress(out: Path) -> list[dict[str, Any]]:
    """Every started run, complete or not: its arm, seed, steps logged so far and the per-step mean
    of each activity metric over them (SAT's counterfactual q share and intercepted share included).
    Descriptive only: never an analysis row (the analysis reads complete runs of complete seeds)."""
    from verl_sat.files import METRICS_FILE, read_metrics

    rows = []
    for path in sorted(out.glob("runs/*/study_spec.json")):
        raw = json.loads(path.read_text())
        metrics = read_metrics(path.parent / METRICS_FILE) if (path.parent / METRICS_FILE).is_file() else []
        if not metrics:
            continue
        row: dict[str, Any] = {"arm": raw["arm"], "seed": raw["seed"], "steps": len(metrics)}
        q = [r[base.Q_KEY] for r in metrics if base.Q_KEY in r]
        row["q_below_radius_frac"] = sum(v < base.RADIUS for v in q) / len(q) if q else None
        for column, key in {**ACTIVITY, "intercepted_frac": base.INTERCEPT_KEY}.items():
            if key is not None:
                values = [r[key] for r in metrics if key in r]
                row[column] = sum(values) / len(values) if values else None
        rows.append(row)
    return rows


def in_progress_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = [
        "| arm | seed | steps logged | q below log(1.2) | SAT intercepted | DPPO-TV masked (counterfactual) "
        "| both | DPPO mask applied | responses per micro-batch (step min / mean / max, averaged) "
        "| starved micro-batches | gate rate applied |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for a in rows:
        sizes = "-"
        if a["seqs_per_mb_mean"] is not None:
            sizes = f"{a['seqs_per_mb_min']:.2f} / {a['seqs_per_mb_mean']:.2f} / {a['seqs_per_mb_max']:.2f}"
        gate = a["mb_gate_rate"] if a["mb_gate_rate"] is not None else a["sat_gate_rate"]
        lines.append(
            f"| {LABELS[a['arm']]} | {a['seed']} | {a['steps']} | {_f(a['q_below_radius_frac'], '.3f')} | "
            f"{_f(a['intercepted_frac'], '.4f')} | {_f(a['dppo_masked_frac'], '.4f')} | "
            f"{_f(a['dppo_intercepted_overlap_frac'], '.4f')} | {_f(a['dppo_arm_masked_frac'], '.4f')} | "
            f"{sizes} | {_f(a['mb_starved_frac'], '.3f')} | {_f(gate, '.4f')} |"
        )
    return lines


def _pooled(rows: Sequence[dict[str, Any]], column: str) -> float | None:
    """The per-step mean of ``column`` over every logged step of ``rows`` (runs weighted by steps)."""
    have = [(float(r[column]), int(r["steps"])) for r in rows if r.get(column) not in (None, "")]
    steps = sum(n for _, n in have)
    return sum(v * n for v, n in have) / steps if steps else None


def interim_quotes(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The sentences docs/study.md quotes from ``in_progress.csv`` (tests/test_curve_study.py checks
    them there): the micro-batch gate's starvation and where DPPO-TV and SAT act, per arm."""

    def arm(name: str) -> list[dict[str, Any]]:
        return [r for r in rows if r["arm"] == name]

    def seeds(runs: Sequence[dict[str, Any]]) -> str:
        numbers = sorted(int(r["seed"]) for r in runs)
        if len(numbers) > 2 and numbers == list(range(numbers[0], numbers[-1] + 1)):
            return f"seeds {numbers[0]}-{numbers[-1]}"
        return ("seed " if len(numbers) == 1 else "seeds ") + ", ".join(map(str, numbers))

    quotes = []
    mbq, sat = arm("sat_gspo_r3_mbq"), arm("sat_gspo_r3")
    if mbq and sat:
        quotes.append(
            f"over the {sum(int(r['steps']) for r in mbq)} steps the q-per-micro-batch runs logged ("
            f"{seeds(mbq)}), {_f(_pooled(mbq, 'mb_starved_frac'), '.3f')} of their micro-batches starved, with "
            f"{_f(_pooled(mbq, 'seqs_per_mb_mean'), '.2f')} responses per micro-batch and a gate rate of "
            f"{_f(_pooled(mbq, 'mb_gate_rate'), '.4f')}, against "
            f"{_f(_pooled(sat, 'sat_gate_rate'), '.4f')} with q per step"
        )
    for name in ("sat_gspo_r3", "sat_gspo_r3_dppo", "dppo_tv_r3"):
        runs = arm(name)
        if not runs:
            continue
        masked, icpt, both = (
            _pooled(runs, c) for c in ("dppo_masked_frac", "intercepted_frac", "dppo_intercepted_overlap_frac")
        )
        share = f"{both / icpt:.2f}" if icpt and both is not None else "-"
        quotes.append(
            f"on {LABELS[name]}'s batches ({sum(int(r['steps']) for r in runs)} steps, {seeds(runs)}), "
            f"DPPO-TV's mask at delta 1e-3 would remove {_f(masked, '.3f')} of the tokens, SAT intercepts "
            f"{_f(icpt, '.4f')} "
            f"and {_f(both, '.4f')} are both ({share} of SAT's intercepted tokens)"
        )
        if name == "sat_gspo_r3_dppo":
            quotes.append(
                "the combination's own DPPO-TV mask removed "
                f"{_f(_pooled(runs, 'dppo_arm_masked_frac'), '.3f')} of its tokens"
            )
    return quotes


TEXT_COLUMNS = ("arm", "name", "tag", "assets_fingerprint", "protocol_commit", "protocol_blob", "protocol_path")


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The committed runs.csv typed back as ``run_stats`` wrote it (``sat_study.read_csv``)."""
    return base.read_csv(path, TEXT_COLUMNS)


def summarize(out: Path, protocol: dict[str, Any], results: Path | None = None) -> dict[str, Any]:
    """runs.csv (the provenance in every row), study.json, study.md and the figures in ``out``
    (and copies in ``results``)."""
    register_arms(protocol)
    done, runs = base.load_runs(out)
    provenance = json.loads((out / "provenance.json").read_text())
    checkpoints = auc_checkpoints(protocol, bool(provenance.get("quick")))
    stats = [{**run_stats(s, runs[s.name], checkpoints), **provenance} for s in done]
    if stats:
        base.write_csv(out / "runs.csv", stats)
    result = analyse(stats, protocol, checkpoints)
    (out / "study.json").write_text(json.dumps({"provenance": provenance, **result}, indent=2, default=list))
    started = in_progress(out)
    if started:
        base.write_csv(out / "in_progress.csv", [{**r, **provenance} for r in started])
    text = report(result, protocol, provenance)
    text += "\n## Interim quotes (docs/study.md)\n\n" + "\n".join(f"- {q}" for q in interim_quotes(started)) + "\n"
    text += "\n## Every started run, complete or not (descriptive, not evidence)\n\n" + "\n".join(
        in_progress_lines(started)
    )
    (out / "study.md").write_text(text + "\n")
    plot(out, result, protocol)
    if results is not None:
        results.mkdir(parents=True, exist_ok=True)
        names = ("runs.csv", "in_progress.csv", "study.json", "study.md", "curve.png", "contrasts.png")
        for name in (*names, "provenance.json"):
            if (out / name).is_file():
                shutil.copy(out / name, results / name)
    return result


def utc_today(hhmm: str) -> float:
    """Epoch seconds of ``hh:mm`` UTC today."""
    hour, minute = (int(x) for x in hhmm.split(":"))
    now = dt.datetime.now(dt.UTC)
    return now.replace(hour=hour, minute=minute, second=0, microsecond=0).timestamp()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("phase", choices=("run", "quick", "summarize"))
    parser.add_argument("dir", nargs="?", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--results", type=Path)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--assets", type=Path)
    parser.add_argument("--stop-starting", help="HH:MM UTC: no run starts after it (this session's stop)")
    parser.add_argument("--cut-at", help="HH:MM UTC: runs still going are stopped incomplete")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    protocol = base.read_protocol(PROTOCOL)
    register_arms(protocol)
    out = (args.dir or args.out).resolve()
    if args.phase == "summarize":
        summarize(out, protocol, args.results)
        print((out / "study.md").read_text())
        return 0
    quick = args.phase == "quick"
    provenance: dict[str, Any] = {"quick": quick}
    if not quick:
        provenance.update(base.protocol_state(PROTOCOL))
    todo = specs(protocol, quick)
    print(f"[study] {len(todo)} runs", flush=True)
    if args.dry_run:
        print("\n".join(s.name for s in todo))
        return 0
    assets = args.assets or base._default_assets()
    provenance["assets_fingerprint"] = base.assets_fingerprint(assets)
    pinned = protocol.get("assets_fingerprint")
    if not quick and pinned and provenance["assets_fingerprint"] != pinned:
        raise SystemExit(f"[study] assets {assets} are {provenance['assets_fingerprint']}, the protocol pins {pinned}")
    stop = utc_today(args.stop_starting) if args.stop_starting else None
    cut = utc_today(args.cut_at) if args.cut_at else None
    out.mkdir(parents=True, exist_ok=True)
    (out / "provenance.json").write_text(json.dumps(provenance, indent=2))
    for spec in todo:
        run_dir = out / "runs" / spec.name
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "study_spec.json").write_text(json.dumps(asdict(spec), default=list))
    harness.run_all(todo, out, assets, args.jobs, stop_starting=stop, cut_at=cut)
    summarize(out, protocol, args.results)
    print((out / "study.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
