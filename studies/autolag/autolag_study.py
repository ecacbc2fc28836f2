"""Mismatch-driven lag against fixed lags, in the study harness (study_protocol_autolag.md, next to this script).

    python studies/autolag/autolag_study.py run --out studies/autolag/results         # the pilot, then 40 runs
    python studies/autolag/autolag_study.py summarize studies/autolag/results         # tables, CSV and figures again
    python studies/autolag/autolag_study.py run --dry-run                             # the plan only
    python studies/autolag/autolag_study.py run --protocol studies/autolag/study_protocol_autolag2.md \
        --out studies/autolag/results2

The committed results: studies/autolag/results/ (protocol 1) and studies/autolag/results2/
(protocol 2, study_protocol_autolag2.md).

Every run is one ``studies.lib.loop.StudyLoop`` of SAT-GSPO + R3 in the regime of
studies/confirmatory/study_protocol.md; the arms differ only in when the weights are broadcast: every 1, 4 or 8
optimizer steps, or by ``verl_sat.trainer.auto_lag``'s rule (the object the trainer uses). The target of
the auto arm comes from a pilot run by the protocol's rule (``pilot_target``). Everything the runs
use is read from the protocol's JSON block, which must be committed and unchanged.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "confirmatory"))
from sat_study import (  # noqa: E402  (the run spec, provenance and per-run statistics)
    DBAR_PI_KEY,
    REPO,
    Spec,
    _default_assets,
    _f,
    assets_fingerprint,
    by_staleness,
    execute,
    load_runs,
    protocol_state,
    read_protocol,
    run_stats,
    write_csv,
)

from studies.lib.harness import smooth  # noqa: E402  (sat_study put the repository root on sys.path)
from studies.lib.stats import paired_comparison, paired_t_interval  # noqa: E402
from verl_sat.trainer.auto_lag import BROADCAST_KEY, LAG_KEY  # noqa: E402

PROTOCOL = Path(__file__).resolve().parent / "study_protocol_autolag.md"
AUTO, PILOT = "auto", "pilot"
TARGET_FILE = "autolag_target.json"


def settings_of(protocol: dict[str, Any]) -> dict[str, Any]:
    return {**protocol["settings"], "eval_at": tuple(protocol["checkpoints"])}


def pilot_spec(protocol: dict[str, Any]) -> Spec:
    pilot = protocol["pilot"]
    return Spec(protocol["arm"], pilot["lag"], pilot["seed"], tuple(sorted(settings_of(protocol).items())), PILOT)


def pilot_target(rows: Sequence[dict[str, Any]], staleness: int) -> float:
    """The protocol's rule: the median dbar_pi over the pilot's steps at ``staleness``."""
    values = by_staleness(rows, DBAR_PI_KEY).get(staleness)
    if not values:
        raise SystemExit(f"[autolag] the pilot has no step at staleness {staleness}")
    return float(statistics.median(values))


def confirmatory_specs(protocol: dict[str, Any], target: float) -> list[Spec]:
    """The fixed-lag arms and the auto arm on every seed, seed-major (a cut-short run keeps whole pairs)."""
    base = settings_of(protocol)
    auto = protocol["auto"]
    auto_settings = {**base, "auto_lag": True, "auto_target": target, "auto_min": auto["min"]}
    auto_settings["auto_signal"] = auto["signal"]
    auto_settings["auto_fresh"] = bool(auto.get("fresh", False))  # the first protocol's rule: any batch triggers
    specs = []
    for seed in protocol["seeds"]:
        for lag in protocol["fixed_lags"]:
            specs.append(Spec(protocol["arm"], lag, seed, tuple(sorted(base.items()))))
        specs.append(Spec(protocol["arm"], auto["max"], seed, tuple(sorted(auto_settings.items())), AUTO))
    for spec in specs:
        spec.config()  # validated before any run
    return specs


def condition(spec_or_stats: Any) -> str:
    """``auto`` or ``lag n``: the arm of a run."""
    tag = spec_or_stats["tag"] if isinstance(spec_or_stats, dict) else spec_or_stats.tag
    lag = spec_or_stats["lag"] if isinstance(spec_or_stats, dict) else spec_or_stats.lag
    return AUTO if tag == AUTO else f"lag {lag}"


def autolag_stats(spec: Spec, rows: Sequence[dict[str, Any]], protocol: dict[str, Any]) -> dict[str, Any]:
    """run_stats plus the broadcasts, the mean lag and the modelled wall time T = steps + c * broadcasts."""
    out = run_stats(spec, rows)
    broadcasts = int(sum(r.get(BROADCAST_KEY, 0.0) for r in rows))
    out.update({"condition": condition(spec), "broadcasts": broadcasts})
    out["mean_lag"] = len(rows) / broadcasts if broadcasts else None
    for c in [protocol["sync_cost"], *protocol["sync_cost_sensitivity"]]:
        out[f"modelled_time@c={c:g}"] = len(rows) + c * broadcasts
    out["lags"] = [int(r[LAG_KEY]) for r in rows if r.get(BROADCAST_KEY) and LAG_KEY in r]
    return out


def paired_conditions(stats: Sequence[dict[str, Any]], a: str, b: str, key: str) -> dict[str, Any] | None:
    """Per-seed differences of arm a - arm b (``studies.lib.stats.paired_comparison``)."""

    def cell(arm: str) -> dict[int, float]:
        return {s["seed"]: s[key] for s in stats if s["condition"] == arm and s.get(key) is not None}

    result = paired_comparison(cell(a), cell(b))
    return None if result is None else {"a": a, "b": b, "metric": key, **result}


def reading(result: dict[str, Any]) -> str:
    """The protocol's fixed reading of one contrast."""
    lo, hi = result["ci"]
    if lo > 0 and result["wilcoxon_p"] < 0.05:
        return f"{result['a']} is better"
    if hi < 0 and result["wilcoxon_p"] < 0.05:
        return f"{result['a']} is worse"
    return "no difference detected"


def format_contrasts(rows: Sequence[dict[str, Any] | None]) -> list[str]:
    lines = [
        "| contrast | seeds | a | b | difference [paired t 95%] | Wilcoxon p | perm. p | reading |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r is None:
            continue
        lo, hi = r["ci"]
        lines.append(
            f"| {r['a']} - {r['b']} ({r['metric']}) | {r['seeds']} | {r['a_mean']:.4f} | {r['b_mean']:.4f} | "
            f"{r['diff']:+.4f} [{lo:+.4f}, {hi:+.4f}] | {r['wilcoxon_p']:.3f} | {r['permutation_p']:.3f} | "
            f"{reading(r)} |"
        )
    return lines


def arm_table(stats: Sequence[dict[str, Any]], protocol: dict[str, Any]) -> list[str]:
    """Per arm: held-out accuracy (mean, t 95%), broadcasts (mean, min-max), mean lag, modelled time."""
    costs = [protocol["sync_cost"], *protocol["sync_cost_sensitivity"]]
    head = "| arm | seeds | held-out acc [t 95%] | broadcasts mean (min-max) | mean lag | "
    head += " | ".join(f"T (c={c:g}) vs lag 1" for c in costs) + " | last-quarter dbar_pi |"
    lines = [head, "|" + "---|" * (6 + len(costs))]
    order = [f"lag {n}" for n in protocol["fixed_lags"]] + [AUTO]
    ref = [s for s in stats if s["condition"] == "lag 1"]
    for arm in order:
        cell = [s for s in stats if s["condition"] == arm]
        if not cell:
            continue
        acc = [s["heldout_acc"] for s in cell]
        mean, lo, hi = paired_t_interval(acc) if len(acc) > 1 else (acc[0], acc[0], acc[0])
        b = [s["broadcasts"] for s in cell]
        ratios = []
        for c in costs:
            key = f"modelled_time@c={c:g}"
            base = sum(s[key] for s in ref) / len(ref) if ref else None
            ratios.append(_f(sum(s[key] for s in cell) / len(cell) / base, ".3f") if base else "–")
        lags = [s["mean_lag"] for s in cell if s["mean_lag"]]
        dbar = [s["dbar_pi_final"] for s in cell if s["dbar_pi_final"] is not None]
        lines.append(
            f"| {arm} | {len(cell)} | {mean:.4f} [{lo:.4f}, {hi:.4f}] | {sum(b) / len(b):.1f} ({min(b)}-{max(b)}) | "
            f"{_f(sum(lags) / len(lags) if lags else None, '.2f')} | " + " | ".join(ratios) + f" | "
            f"{_f(sum(dbar) / len(dbar) if dbar else None, '.4f')} |"
        )
    return lines


def summarize(out: Path, protocol: dict[str, Any]) -> list[dict[str, Any]]:
    """autolag.md, autolag_runs.csv, autolag.json and the figures of every complete run under ``out``."""
    specs, runs = load_runs(out)
    specs = [s for s in specs if s.tag != PILOT]
    stats = [autolag_stats(s, runs[s.name], protocol) for s in specs]
    if not stats:
        return []
    meta = json.loads((out / "provenance.json").read_text()) if (out / "provenance.json").is_file() else {}
    target = json.loads((out / TARGET_FILE).read_text()) if (out / TARGET_FILE).is_file() else {}
    for s in stats:
        s.update({k: meta.get(k) for k in ("protocol_commit", "protocol_blob", "assets_fingerprint")})
    write_csv(out / "autolag_runs.csv", [{k: v for k, v in s.items() if k != "lags"} for s in stats])
    primary = [paired_conditions(stats, a, b, "heldout_acc") for a, b in protocol["primary"]]
    secondary = [paired_conditions(stats, a, b, "heldout_acc") for a, b in protocol["secondary"]]
    checkpoints = [c for c in protocol["checkpoints"] if c > 0]
    for a, b in protocol["primary"]:
        secondary += [paired_conditions(stats, a, b, f"heldout_acc@{c}") for c in checkpoints]
    lags = [k for s in stats if s["condition"] == AUTO for k in s["lags"]]
    histogram = {k: lags.count(k) for k in sorted(set(lags))}
    pilot = protocol["pilot"]
    trigger = "a fresh batch only" if protocol["auto"].get("fresh") else "any batch"
    text = [
        f"# Mismatch-driven lag against fixed lags ({meta.get('protocol_path', PROTOCOL.relative_to(REPO))})",
        "",
        f"Protocol commit `{meta.get('protocol_commit')}` (blob `{meta.get('protocol_blob')}`), assets "
        f"`{meta.get('assets_fingerprint')}`. SAT-GSPO + R3 in every arm; settings: "
        + ", ".join(f"{k}={v}" for k, v in sorted(protocol["settings"].items()))
        + f". Auto ({trigger} triggers): dbar_pi > target = {_f(target.get('target'), '.5f')} "
        "(the pilot's median dbar_pi at "
        f"staleness {pilot['staleness']}, seed {pilot['seed']}, lag {pilot['lag']}), "
        f"lag in [{protocol['auto']['min']}, {protocol['auto']['max']}].",
        "",
        "## Per arm",
        "",
        *arm_table(stats, protocol),
        "",
        "T = optimizer steps + c x broadcasts: the modelled wall time with a sync costing c optimizer steps "
        f"(c = {protocol['sync_cost']:g} pre-registered), as a ratio to lag 1's.",
        "",
        "## Primary contrasts (held-out accuracy at the last step)",
        "",
        *format_contrasts(primary),
        "",
        "## Secondary",
        "",
        *format_contrasts(secondary),
        "",
        "## Auto's lags between broadcasts (all seeds)",
        "",
        "| lag | broadcasts |",
        "|---|---|",
        *[f"| {k} | {n} |" for k, n in histogram.items()],
    ]
    (out / "autolag.md").write_text("\n".join(text) + "\n")
    result = {"runs": stats, "primary": primary, "secondary": secondary, "target": target, "lag_histogram": histogram}
    (out / "autolag.json").write_text(json.dumps(result, indent=2, default=str))
    plot_tradeoff(out / "autolag_tradeoff.png", stats, protocol)
    plot_trajectory(out / "autolag_trajectory.png", specs, runs, target.get("target"))
    return stats


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_tradeoff(path: Path, stats: Sequence[dict[str, Any]], protocol: dict[str, Any]) -> Path:
    """Held-out accuracy (seed mean, t 95%) against broadcasts per run, per arm."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm in [f"lag {n}" for n in protocol["fixed_lags"]] + [AUTO]:
        cell = [s for s in stats if s["condition"] == arm]
        if len(cell) < 2:
            continue
        mean, lo, _ = paired_t_interval([s["heldout_acc"] for s in cell])
        b = sum(s["broadcasts"] for s in cell) / len(cell)
        ax.errorbar([b], [mean], yerr=[mean - lo], marker="o" if arm != AUTO else "*", ms=9, capsize=3, label=arm)
    ax.set_xscale("log")
    ax.set_xlabel("weight broadcasts in 240 optimizer steps (seed mean)")
    ax.set_ylabel("held-out accuracy of the trained policy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_trajectory(path: Path, specs: Sequence[Spec], runs: dict[str, list[dict]], target: float | None) -> Path:
    """Left: auto's lag at each broadcast over training (all seeds); right: dbar_pi (10-step moving
    average, seed mean) for each arm, with auto's target."""
    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    for s in specs:
        if s.tag == AUTO:
            points = [(r["step"], r[LAG_KEY]) for r in runs[s.name] if r.get(BROADCAST_KEY)]
            left.scatter([p[0] for p in points], [p[1] for p in points], s=6, alpha=0.4)
    left.set_xlabel("optimizer step")
    left.set_ylabel("auto: steps since the previous broadcast")
    for arm in sorted({condition(s) for s in specs}):
        chosen = [runs[s.name] for s in specs if condition(s) == arm]
        length = min(len(r) for r in chosen)
        curves = [smooth([row[DBAR_PI_KEY] for row in r[:length]], 10) for r in chosen]
        right.plot(range(1, length + 1), [sum(c[i] for c in curves) / len(curves) for i in range(length)], label=arm)
    if target:
        right.axhline(target, color="gray", ls=":", label=f"auto's target {target:.4f}")
    right.set_xlabel("optimizer step")
    right.set_ylabel("dbar_pi (batch mean |log pi - log mu|)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(out: Path, assets: Path | None, jobs: int, dry_run: bool, protocol_path: Path = PROTOCOL) -> int:
    provenance: dict[str, Any] = dict(protocol_state(protocol_path))
    protocol = read_protocol(protocol_path)
    pilot = pilot_spec(protocol)
    pilot.config()
    print(f"[autolag] pilot {pilot.name}; then {len(protocol['seeds'])} seeds x {len(protocol['fixed_lags']) + 1} arms")
    if dry_run:
        for spec in [pilot, *confirmatory_specs(protocol, target=1.0)]:
            print(spec.name, {k: v for k, v in asdict(spec.config()).items() if k.startswith(("lag", "auto", "seed"))})
        return 0
    assets = assets or _default_assets()
    provenance["assets_fingerprint"] = assets_fingerprint(assets)
    execute([pilot], out, assets, jobs, provenance)
    _, runs = load_runs(out)
    target = pilot_target(runs[pilot.name], protocol["pilot"]["staleness"])
    (out / TARGET_FILE).write_text(json.dumps({"target": target, "pilot": pilot.name, **protocol["pilot"]}, indent=2))
    print(f"[autolag] target = {target:.5f} (median dbar_pi at staleness {protocol['pilot']['staleness']})", flush=True)
    specs = confirmatory_specs(protocol, target)
    minutes = execute(specs, out, assets, jobs, provenance)
    print(f"[autolag] {len(specs)} runs in {minutes:.1f} min wall", flush=True)
    summarize(out, protocol)
    print((out / "autolag.md").read_text())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("phase", choices=("run", "summarize"))
    parser.add_argument("dir", nargs="?", type=Path, help="summarize: the output directory")
    parser.add_argument("--out", type=Path, default=Path("runs/autolag_study"))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--assets", type=Path)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--protocol", type=Path, default=PROTOCOL, help="the committed protocol file")
    args = parser.parse_args(argv)
    protocol_path = args.protocol.resolve()
    if args.phase == "summarize":
        out = (args.dir or args.out).resolve()
        summarize(out, read_protocol(protocol_path))
        print((out / "autolag.md").read_text())
        return 0
    return run(args.out.resolve(), args.assets, args.jobs, args.dry_run, protocol_path)


if __name__ == "__main__":
    sys.exit(main())
