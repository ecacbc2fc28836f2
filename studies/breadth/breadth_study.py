"""Evidence as broad as the paper's claim (issue 33; studies/breadth/study_protocol_breadth.md).

    python studies/breadth/breadth_study.py part1 --out runs/breadth    # stabilizers at lag 8 (112 runs)
    python studies/breadth/breadth_study.py part2 --out runs/breadth    # two more router-bias draws, logit noise (96)
    python studies/breadth/breadth_study.py part3 --out runs/breadth    # SAT-GRPO vs GRPO, with and without R3 (64)
    python studies/breadth/breadth_study.py search --out runs/breadth   # the collapse search, baselines only (16)
    python studies/breadth/breadth_study.py confirm --out runs/breadth  # part 4's confirmation, if the search picked
    python studies/breadth/breadth_study.py all --out runs/breadth      # parts 1-3, the search, then the confirmation
    python studies/breadth/breadth_study.py quick --out runs/breadth_q  # the whole pipeline, 2 seeds x 16 steps
    python studies/breadth/breadth_study.py summarize runs/breadth      # runs.csv, study.md, figures again

The confirmatory study's harness (the in-process loop, its arms, its run statistics, its protocol
check; studies/confirmatory/sat_study.py): every run is a :class:`sat_study.Spec`, run on ``--jobs``
workers that load the assets once, skipped when already complete in ``--out``. Every phase but
``quick`` refuses to start while the protocol is uncommitted or changed; every row carries its
commit and blob and the assets' fingerprint.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PROTOCOL = HERE / "study_protocol_breadth.md"
sys.path.insert(0, str(HERE.parent / "confirmatory"))
import sat_study as base  # noqa: E402  (one harness: arms, specs, run statistics, protocol check)

from studies.lib.stats import contrast_cells, holm, mcnemar_exact, p_text  # noqa: E402  (sat_study put the repository root on sys.path)

PHASES = ("part1", "part2", "part3", "search", "confirm")
KEY = "heldout_acc"
LABELS = {
    "sat_gspo_r3": "SAT-GSPO + R3",
    "gspo_r3": "GSPO + R3",
    "gspo_r3_tis": "GSPO + R3 + TIS",
    "gspo_r3_icepop": "GSPO + R3 + IcePop",
    "gspo_r3_geo_rs": "GSPO + R3 + geometric rejection",
    "cispo_r3": "CISPO + R3",
    "dppo_tv_r3": "DPPO-TV + R3",
    "sat_grpo_r3": "SAT-GRPO + R3",
    "grpo_r3": "GRPO + R3",
    "sat_grpo": "SAT-GRPO",
    "grpo": "GRPO",
    "sat_gspo": "SAT-GSPO",
    "gspo": "GSPO",
}


def settings_of(protocol: dict[str, Any], quick: bool = False, **extra: Any) -> dict[str, Any]:
    settings = {**protocol["settings"], "eval_at": tuple(protocol["checkpoints"]), **extra}
    if quick:
        q = protocol["quick"]
        settings.update(steps=q["steps"], eval_problems=q["eval_problems"], eval_at=(q["steps"] // 2,))
    return settings


def search_tag(lr: float, bias: float) -> str:
    return f"search-{base.setting_tag(lr, bias)}"


def phase_specs(protocol: dict[str, Any], phase: str, quick: bool = False, out: Path | None = None) -> list[base.Spec]:
    """The runs of one phase, exactly as the protocol fixes them (seed-major: whole pairs first)."""
    seeds = protocol["quick"]["seeds"] if quick else protocol["seeds"]
    lag = protocol["lag"]
    if phase == "part1":
        p = protocol["part1"]
        specs = base.specs_for(
            [p["treatment"], *p["references"], p["replication"]], (lag,), seeds, settings_of(protocol, quick)
        )
    elif phase == "part2":
        p = protocol["part2"]
        specs = [
            s
            for tag, extra in p["conditions"].items()
            for s in base.specs_for(
                [p["treatment"], p["reference"]], (lag,), seeds, settings_of(protocol, quick, **extra), tag
            )
        ]
    elif phase == "part3":
        arms = [arm for pair in protocol["part3"]["pairs"] for arm in pair]
        specs = base.specs_for(arms, (lag,), seeds, settings_of(protocol, quick))
    elif phase == "search":
        p = protocol["part4"]
        seed = seeds[:1] if quick else [p["seed"]]
        grid = protocol["quick"] if quick else p
        specs = [
            s
            for lr in grid["lrs"]
            for bias in grid["router_bias"]
            for s in base.specs_for(
                p["arms"],
                p["lags"],
                seed,
                settings_of(protocol, quick, lr=lr, router_bias_std=bias),
                search_tag(lr, bias),
            )
        ]
    elif phase == "confirm":
        picked = read_pick(out) if out is not None else None
        if picked is None or picked.get("picked") is None:
            return []
        p = protocol["part4"]
        seeds = protocol["quick"]["seeds"] if quick else p["confirm_seeds"]
        setting = picked["picked"]
        extra = {"lr": setting["lr"], "router_bias_std": setting["router_bias"]}
        arms = [arm for pair in p["confirm_pairs"] for arm in pair]
        specs = base.specs_for(arms, (setting["lag"],), seeds, settings_of(protocol, quick, **extra), "collapse")
    else:
        raise ValueError(f"unknown phase {phase!r}; known: {PHASES}")
    return sorted(specs, key=lambda s: (s.seed, s.tag, s.lag))


# -- part 4's rule (fixed in the protocol before the search ran) ---------------------------------
def pick_collapse(stats: Sequence[dict[str, Any]], protocol: dict[str, Any]) -> dict[str, Any]:
    """Per search run: collapsed (a sentinel alarm) and q below the radius on >= q_below_radius_min
    of steps. A setting (lag, lr, bias) qualifies for an arm when both hold; picked: the setting
    qualifying for the most arms, ties broken by the lowest mean final held-out accuracy of its
    qualifying arms; None when no setting qualifies."""
    p = protocol["part4"]
    settings: dict[tuple[int, float, float], list[dict[str, Any]]] = {}
    runs = []
    for s in stats:
        if not s["tag"].startswith("search-"):
            continue
        lr, bias = (float(x[2:]) for x in s["tag"].removeprefix("search-").split("-"))
        qualifies = bool(s["collapsed"]) and (s["q_below_radius_frac"] or 0.0) >= p["q_below_radius_min"]
        run = {"arm": s["arm"], "lag": s["lag"], "lr": lr, "router_bias": bias, "qualifies": qualifies}
        run.update({k: s[k] for k in ("collapsed", "q_below_radius_frac", KEY)})
        runs.append(run)
        if qualifies:
            settings.setdefault((s["lag"], lr, bias), []).append(run)
    if not settings:
        return {"picked": None, "runs": runs}

    def rank(item: tuple[tuple[int, float, float], list[dict[str, Any]]]) -> tuple[int, float]:
        accs = [r[KEY] for r in item[1] if r[KEY] is not None]
        return (-len(item[1]), sum(accs) / len(accs) if accs else math.inf)

    (lag, lr, bias), arms = min(settings.items(), key=rank)
    picked = {"lag": lag, "lr": lr, "router_bias": bias, "arms": [r["arm"] for r in arms]}
    return {"picked": picked, "runs": runs}


def read_pick(out: Path) -> dict[str, Any] | None:
    path = out / "collapse_pick.json"
    return json.loads(path.read_text()) if path.is_file() else None


# -- analysis ------------------------------------------------------------------------------------
def family(stats: Sequence[dict[str, Any]], pairs: Sequence[tuple[str, str, str, int]]) -> list[dict[str, Any]]:
    """The paired contrasts (arm, reference, tag, lag) on the final held-out accuracy, Holm-adjusted
    within the family (the Wilcoxon p)."""
    rows = [{**r, "tag": tag} for arm, ref, tag, lag in pairs if (r := base.paired(stats, arm, ref, lag, KEY, tag))]
    for r, adjusted in zip(rows, holm([r["wilcoxon_p"] for r in rows]), strict=True):
        r["holm_p"] = adjusted
    return rows


def collapse_rows(stats: Sequence[dict[str, Any]], pairs: Sequence[tuple[str, str]], lag: int) -> list[dict[str, Any]]:
    rows = []
    for arm, ref in pairs:

        def cell(name: str) -> dict[int, bool]:
            return {
                s["seed"]: bool(s["collapsed"])
                for s in stats
                if s["arm"] == name and s["tag"] == "collapse" and s["lag"] == lag
            }

        if r := mcnemar_exact(cell(arm), cell(ref)):
            rows.append({"arm": arm, "reference": ref, **r})
    return rows


def summarize(out: Path, protocol: dict[str, Any]) -> dict[str, Any]:
    specs, runs = base.load_runs(out)
    provenance = json.loads((out / "provenance.json").read_text())
    stats = [{**base.run_stats(s, runs[s.name]), **provenance} for s in specs]
    if stats:
        base.write_csv(out / "runs.csv", stats)
    result = {"provenance": provenance, **from_rows(stats, protocol), "secondary": secondary_lines(stats, protocol)}
    if any(s["tag"].startswith("search-") for s in stats):
        (out / "collapse_pick.json").write_text(json.dumps(result["search"], indent=2))
    (out / "study.json").write_text(json.dumps(result, indent=2, default=list))
    (out / "study.md").write_text(report(result, protocol))
    plot_parts(out, result, protocol["part4"]["q_below_radius_min"])
    return result


def activity(stats: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (tag, arm): mean share of steps with q below log(1.2) and mean intercepted fraction."""
    cells: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for s in stats:
        cells.setdefault((s["tag"], s["arm"], s["lag"]), []).append(s)
    out = []
    for (tag, arm, lag), rows in sorted(cells.items()):
        q = [r["q_below_radius_frac"] for r in rows if r["q_below_radius_frac"] is not None]
        icpt = [r["intercepted_frac"] for r in rows if r["intercepted_frac"] is not None]
        out.append(
            {
                "tag": tag,
                "arm": arm,
                "lag": lag,
                "runs": len(rows),
                "q_below_radius_frac": sum(q) / len(q) if q else None,
                "intercepted_frac": sum(icpt) / len(icpt) if icpt else None,
                "collapsed": sum(bool(r["collapsed"]) for r in rows),
            }
        )
    return out


TEXT_COLUMNS = ("arm", "name", "tag", "assets_fingerprint", "protocol_commit", "protocol_blob", "protocol_path")


def read_rows(path: Path) -> list[dict[str, Any]]:
    """A committed runs.csv typed as ``sat_study.run_stats`` writes it (``sat_study.read_csv``)."""
    return base.read_csv(path, TEXT_COLUMNS)


def from_rows(stats: Sequence[dict[str, Any]], protocol: dict[str, Any]) -> dict[str, Any]:
    """Every family of the protocol, the search's pick and the confirmation (if picked) from run rows."""
    lag = protocol["lag"]
    p1, p2, p3 = protocol["part1"], protocol["part2"], protocol["part3"]
    result: dict[str, Any] = {
        "part1": family(stats, [(p1["treatment"], ref, "", lag) for ref in p1["references"]]),
        "part1_replication": family(stats, [(p1["treatment"], p1["replication"], "", lag)]),
        "part2": family(stats, [(p2["treatment"], p2["reference"], tag, lag) for tag in p2["conditions"]]),
        "part3": family(stats, [(a, b, "", lag) for a, b in p3["pairs"]]),
        "search": pick_collapse(stats, protocol),
        "activity": activity(stats),
    }
    picked = result["search"].get("picked")
    if picked:
        pairs = [tuple(x) for x in protocol["part4"]["confirm_pairs"]]
        accuracy = family(stats, [(a, b, "collapse", picked["lag"]) for a, b in pairs])
        collapse = collapse_rows(stats, pairs, picked["lag"])
        adjusted = holm([r["wilcoxon_p"] for r in accuracy] + [r["p"] for r in collapse])
        for r, q in zip(accuracy + collapse, adjusted, strict=True):
            r["holm_p"] = q
        result["confirm"] = {"accuracy": accuracy, "collapse": collapse}
    return result


QUOTED = (
    ("part1_replication", "1 (replication, alone)"),
    ("part1", "1 (Holm over 5)"),
    ("part2", "2 (Holm over 3)"),
    ("part3", "3 (Holm over 2)"),
)


def quote_lines(result: dict[str, Any], alpha: float) -> list[str]:
    """The table docs/study.md quotes: every contrast of parts 1-3 (and the confirmation's
    accuracy), three decimals, the positive pairs and the protocol's reading."""
    lines = [
        "| part | condition | arm | reference | arm acc. | ref. acc. | difference [paired t 95%] "
        "| Wilcoxon p | Holm p | positive pairs | reading |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    parts = [(result[key], part) for key, part in QUOTED]
    if "confirm" in result:
        parts.append((result["confirm"]["accuracy"], "4 (Holm over 4)"))
    for rows, part in parts:
        for r in rows:
            lines.append(
                f"| {part} | {r['tag'] or 'draw0'} | {LABELS[r['arm']]} | {LABELS[r['reference']]} | "
                f"{contrast_cells(r)} | {_reading(r, alpha)} |"
            )
    return lines


SECONDARY = (
    ("heldout_acc@60", "held-out accuracy after step 60"),
    ("heldout_acc@120", "after step 120"),
    ("heldout_acc@180", "after step 180"),
    ("dbar_pi_final", "dbar_pi, last quarter"),
)


def secondary_lines(stats: Sequence[dict[str, Any]], protocol: dict[str, Any]) -> list[str]:
    """The secondary measures (no family, no Holm) of the replication and part 3's two contrasts:
    the held-out accuracy after steps 60/120/180 and dbar_pi over the last quarter."""
    lag = protocol["lag"]
    p1 = protocol["part1"]
    pairs = [(p1["treatment"], p1["replication"]), *[tuple(x) for x in protocol["part3"]["pairs"]]]
    lines = [
        "| arm - reference | measure | arm | reference | difference [paired t 95%] | Wilcoxon p |",
        "|---|---|---|---|---|---|",
    ]
    for arm, ref in pairs:
        for key, measure in SECONDARY:
            if r := base.paired(stats, arm, ref, lag, key):
                lo, hi = r["ci"]
                lines.append(
                    f"| {LABELS[arm]} - {LABELS[ref]} | {measure} | {r['arm_mean']:.3f} | {r['ref_mean']:.3f} | "
                    f"{r['diff']:+.3f} [{lo:+.3f}, {hi:+.3f}] | {p_text(r['wilcoxon_p'])} |"
                )
    return lines


def search_line(search: dict[str, Any], minimum: float) -> str:
    """The search in one sentence: how many runs collapsed, how many left SAT room, the pick."""
    runs = search["runs"]
    collapsed = sum(bool(r["collapsed"]) for r in runs)
    room = sum((r["q_below_radius_frac"] or 0.0) >= minimum for r in runs)
    picked = search["picked"]
    verdict = (
        f"picked lag {picked['lag']}, lr {picked['lr']:g}, router bias {picked['router_bias']:g} "
        f"({', '.join(picked['arms'])})"
        if picked
        else "no setting qualifies"
    )
    return (
        f"{collapsed} of {len(runs)} search runs collapsed by the sentinel's criterion; {room} of {len(runs)} "
        f"had q below log(1.2) on at least {minimum:.0%} of steps; {verdict}"
    )


def _reading(r: dict[str, Any], alpha: float) -> str:
    return "differs" if r["holm_p"] < alpha else "no difference detected"


def report(result: dict[str, Any], protocol: dict[str, Any]) -> str:
    p = result["provenance"]
    alpha = protocol["alpha"]
    lines = [
        "# Breadth study (studies/breadth/study_protocol_breadth.md)",
        "",
        f"Protocol commit `{p.get('protocol_commit')}` (blob `{p.get('protocol_blob')}`), assets "
        f"`{p.get('assets_fingerprint')}`" + (" (quick: not evidence)" if p.get("quick") else ""),
    ]
    lines += ["", "## Summary (the table docs/study.md quotes)", "", *quote_lines(result, alpha)]
    lines += ["", f"Part 4: {search_line(result['search'], protocol['part4']['q_below_radius_min'])}."]
    lines += ["", "Secondary measures (no Holm family):", "", *result.get("secondary", [])]
    titles = {
        "part1": "Part 1: SAT-GSPO + R3 against the stabilizers (Holm over 5)",
        "part1_replication": "Part 1: the primary contrast re-measured on these seeds",
        "part2": "Part 2: the primary contrast under further mismatches (Holm over 3)",
        "part3": "Part 3: the token level (Holm over 2)",
    }
    for key, title in titles.items():
        lines += ["", f"## {title}", "", *table(result[key], alpha)]
    search = result["search"]
    lines += [
        "",
        "## Part 4: the collapse search",
        "",
        "| arm | lag | lr | router bias | collapsed | q below log(1.2) | held-out | qualifies |",
    ]
    lines.append("|---|---|---|---|---|---|---|---|")
    for r in search["runs"]:
        lines.append(
            f"| {r['arm']} | {r['lag']} | {r['lr']:g} | {r['router_bias']:g} | {r['collapsed']} | "
            f"{_f(r['q_below_radius_frac'], '.2f')} | {_f(r[KEY], '.3f')} | {r['qualifies']} |"
        )
    lines += ["", f"Picked: {search['picked']}" if search["picked"] else "Picked: none (no setting qualifies)"]
    if "confirm" in result:
        lines += ["", "### Confirmation (Holm over 4)", "", *table(result["confirm"]["accuracy"], alpha), ""]
        lines += [
            "| arm - reference | collapse rate arm | reference | only arm | only reference | McNemar p | Holm p |"
        ]
        lines.append("|---|---|---|---|---|---|---|")
        for r in result["confirm"]["collapse"]:
            lines.append(
                f"| {r['arm']} - {r['reference']} | {r['a_rate']:.3f} | {r['b_rate']:.3f} | {r['a_only']} | "
                f"{r['b_only']} | {r['p']:.3f} | {r['holm_p']:.3f} |"
            )
    lines += [
        "",
        "## SAT's activity per cell",
        "",
        "| tag | arm | lag | runs | q below log(1.2) | intercepted | collapsed |",
    ]
    lines.append("|---|---|---|---|---|---|---|")
    for a in result["activity"]:
        lines.append(
            f"| {a['tag'] or '-'} | {a['arm']} | {a['lag']} | {a['runs']} | {_f(a['q_below_radius_frac'], '.2f')} | "
            f"{_f(a['intercepted_frac'], '.4f')} | {a['collapsed']} |"
        )
    return "\n".join(lines) + "\n"


def table(rows: Sequence[dict[str, Any]], alpha: float) -> list[str]:
    out = [
        "| condition | arm - reference | seeds | arm | reference | difference [paired t 95%] | Wilcoxon p "
        "| Holm p | perm. p | reading |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lo, hi = r["ci"]
        out.append(
            f"| {r['tag'] or '-'} | {r['arm']} - {r['reference']} | {r['seeds']} | {r['arm_mean']:.4f} | "
            f"{r['ref_mean']:.4f} | {r['diff']:+.4f} [{lo:+.4f}, {hi:+.4f}] | {r['wilcoxon_p']:.3f} | "
            f"{r['holm_p']:.3f} | {_f(r['permutation_p'], '.3f')} | {_reading(r, alpha)} |"
        )
    return out


def _f(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, int | float) else "-"


def plot_parts(out: Path, result: dict[str, Any], minimum: float) -> None:
    """One forest plot per part (differences and their 95% intervals), the search's grid."""
    plt = base._plt()
    for name, key in (("part1_stabilizers", "part1"), ("part2_mismatch", "part2"), ("part3_token", "part3")):
        rows = result[key] + (result["part1_replication"] if key == "part2" else [])
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(11, 0.6 * len(rows) + 1.6))
        labels = [f"{r['tag'] or 'draw0'}: {LABELS[r['arm']]} - {LABELS[r['reference']]}" for r in rows]
        for y, r in enumerate(rows):
            ax.errorbar(r["diff"], y, xerr=[[r["diff"] - r["ci"][0]], [r["ci"][1] - r["diff"]]], fmt="o", capsize=3)
            positive = sum(d > 0 for d in r["diffs"])
            note = f"  Holm p {p_text(r['holm_p'])}, {positive}/{r['seeds']} > 0"
            ax.annotate(note, (r["ci"][1], y), fontsize=7, va="center")
        ax.axvline(0.0, color="gray", lw=0.8)
        low, high = ax.get_xlim()
        ax.set_xlim(low, high + 0.45 * (high - low))  # room for the notes
        ax.set_yticks(range(len(rows)), labels)
        ax.set_xlabel("held-out accuracy difference after step 240 [paired t 95%]")
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=110)
        plt.close(fig)
    runs = result["search"]["runs"]
    if runs:
        # the rule on one page: a setting qualifies in the upper-right (a collapse where SAT can act)
        fig, ax = plt.subplots(figsize=(8, 4.6))
        ax.axvspan(minimum, 1.0, color="tab:green", alpha=0.08, label=f"q below log(1.2) on >= {minimum:.0%} of steps")
        for r in runs:
            x, y = r["q_below_radius_frac"] or 0.0, r[KEY] or 0.0
            color = "tab:red" if r["collapsed"] else "tab:blue"
            ax.scatter(x, y, color=color, marker="o" if r["arm"] == "gspo" else "s", s=40)
            ax.annotate(
                f"{r['arm']} {r['lag']} {r['lr']:g} {r['router_bias']:g}",
                (x, y),
                fontsize=6,
                xytext=(3, 2),
                textcoords="offset points",
            )
        ax.axvline(minimum, color="tab:green", ls="--", lw=0.8)
        ax.set_xlim(-0.02, 1.0)
        ax.set_xlabel("share of steps with q below log(1.2) (SAT can act)")
        ax.set_ylabel("held-out accuracy after the last step")
        ax.set_title("part 4: baselines without R3, seed 3901 (red: a sentinel alarm; label: arm lag lr bias)")
        ax.legend(loc="lower right", fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "part4_search.png", dpi=110)
        plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("phase", choices=(*PHASES, "all", "quick", "summarize"))
    parser.add_argument("dir", nargs="?", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--assets", type=Path)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    protocol = base.read_protocol(PROTOCOL)
    out = (args.dir or args.out).resolve()
    if args.phase == "summarize":
        summarize(out, protocol)
        print((out / "study.md").read_text())
        return 0
    quick = args.phase == "quick"
    provenance: dict[str, Any] = {"quick": quick}
    if not quick:
        provenance.update(base.protocol_state(PROTOCOL))
    phases = PHASES if args.phase in ("all", "quick") else (args.phase,)
    assets = args.assets or base._default_assets()
    provenance["assets_fingerprint"] = base.assets_fingerprint(assets)
    for phase in phases:
        if phase == "confirm":
            summarize(out, protocol)  # the search's pick, by the protocol's rule
        specs = phase_specs(protocol, phase, quick, out)
        print(f"[study] {phase}: {len(specs)} runs", flush=True)
        if args.dry_run:
            for spec in specs:
                print(spec.name)
            continue
        if specs:
            minutes = base.execute(specs, out, assets, args.jobs, provenance)
            print(f"[study] {phase}: {len(specs)} runs in {minutes:.1f} min", flush=True)
    if not args.dry_run:
        summarize(out, protocol)
        print((out / "study.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
