"""The confirmatory contrast through `verl-sat` itself (issue 35, item 3; docs/study.md).

    python studies/product/product_pairs.py run --out runs/product_pairs      # 12 launches, one at a time
    python studies/product/product_pairs.py quick --out runs/product_quick    # the pipeline on 2 short launches
    python studies/product/product_pairs.py summarize runs/product_pairs      # runs.csv, study.md, figure again

Each run is one `verl-sat` launch (verl's v1 trainer on CPU) with the protocol's overrides
(studies/product/study_protocol_product.md, its ```json block); the held-out metric is the
product's own `sat.heldout` (verl_sat.default.heldout, the study loop's definition). The script
refuses to run while the protocol is uncommitted or changed, writes the protocol's commit and blob
and the assets' fingerprint into every row, skips a run already complete in --out, reruns a
failed one once and reports every failure. One pair by hand (what a user types):

    python -m verl_sat.default.data --out runs/heldout_free --exclude-heldout 512
    verl-sat sat.lag=8 trainer.total_training_steps=30 sat.routing_replay=R3 \\
        actor_rollout_ref.actor.optim.lr=2e-4 actor_rollout_ref.actor.optim.weight_decay=0 \\
        actor_rollout_ref.rollout.engine_kwargs.hf.router_bias_std=0.5 actor_rollout_ref.rollout.seed=0 \\
        sat.heldout.problems=512 sat.heldout.samples=2 'sat.heldout.at=[60,120,180]' \\
        data.train_files=runs/heldout_free/train.parquet data.seed=1001 \\
        actor_rollout_ref.actor.policy_loss.sat_enabled=true sat.run_dir=runs/pair/sat_gspo_r3-seed1001
    # the same with sat_enabled=false and sat.run_dir=runs/pair/gspo_r3-seed1001
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PROTOCOL = HERE / "study_protocol_product.md"
sys.path.insert(0, str(HERE.parent / "confirmatory"))
from sat_study import RADIUS, assets_fingerprint, protocol_state, read_protocol  # noqa: E402  (one protocol check)

from studies.lib.stats import final_mean, paired_comparison  # noqa: E402  (sat_study put the repository root on sys.path)
from verl_sat.default.heldout import HELDOUT_GREEDY_KEY, HELDOUT_KEY  # noqa: E402
from verl_sat.files import read_jsonl  # noqa: E402
from verl_sat.trainer.heldout import STEP_KEY  # noqa: E402

LOOP_RUNS = REPO / "studies" / "confirmatory" / "results" / "runs.csv"
TIMEOUT_S = 3600


def merged(*groups: Sequence[str]) -> list[str]:
    """Hydra overrides, a later value of a key replacing an earlier one (order of first appearance)."""
    out: dict[str, str] = {}
    for group in groups:
        for item in group:
            out[item.split("=", 1)[0]] = item
    return list(out.values())


def cells(protocol: dict[str, Any], quick: bool) -> list[tuple[int, str]]:
    """(seed, arm), seed-major: both arms of a seed before the next one."""
    seeds = protocol["quick"]["seeds"] if quick else protocol["seeds"]
    return [(seed, arm) for seed in seeds for arm in protocol["arms"]]


def command(protocol: dict[str, Any], arm: str, seed: int, out: Path, quick: bool) -> list[str]:
    overrides = merged(
        protocol["overrides"],
        protocol["quick"]["overrides"] if quick else (),
        protocol["arms"][arm],
        [
            f"data.seed={seed}",
            f"data.train_files={out / 'data' / 'train.parquet'}",
            f"sat.run_dir={out / name(arm, seed)}",
        ],
    )
    return [sys.executable, "-m", "verl_sat.main", *overrides]


def name(arm: str, seed: int) -> str:
    return f"{arm}-seed{seed}"


def complete(run_dir: Path, last_step: int) -> bool:
    """The run logged the held-out accuracy after its last optimizer step."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return False
    return any(r["data"].get(STEP_KEY) == float(last_step) for r in read_jsonl(path))


def run(out: Path, quick: bool) -> int:
    state = protocol_state(PROTOCOL, REPO)
    protocol = read_protocol(PROTOCOL)
    last = protocol["quick"]["optimizer_steps"] if quick else protocol["optimizer_steps"]
    from verl_sat.default import data as task
    from verl_sat.default.assets import build_assets_once, default_assets_dir

    assets = Path(default_assets_dir())
    build_assets_once(assets)
    provenance = {**state, "assets_fingerprint": assets_fingerprint(assets), "quick": quick}
    out.mkdir(parents=True, exist_ok=True)
    old = out / "provenance.json"
    if old.is_file() and json.loads(old.read_text()) != provenance:
        raise SystemExit(f"[study] {out} holds runs of another protocol or warm-up ({old}): use another --out")
    old.write_text(json.dumps(provenance, indent=2))
    if not (out / "data" / "train.parquet").is_file():
        task.write_parquet(out / "data", exclude_heldout=protocol["exclude_heldout"])
    failures: list[str] = []
    for seed, arm in cells(protocol, quick):
        run_dir = out / name(arm, seed)
        for attempt in (1, 2):
            if complete(run_dir, last):
                break
            if run_dir.exists():
                run_dir.rename(out / f"{name(arm, seed)}.failed{attempt - 1}-{int(time.time())}")
            start = time.time()
            log = out / f"{name(arm, seed)}.log"
            with log.open("w") as sink:
                rc = subprocess.run(
                    command(protocol, arm, seed, out, quick),
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    timeout=TIMEOUT_S,
                    cwd=out,
                    check=False,
                ).returncode
            print(
                f"[study] {name(arm, seed)}: exit {rc} after {time.time() - start:.0f} s (attempt {attempt})",
                flush=True,
            )
            if rc != 0:
                failures.append(f"{name(arm, seed)} attempt {attempt}: exit {rc} ({log})")
    summarize(out)
    for line in failures:
        print(f"[study] failed: {line}", flush=True)
    return 1 if failures else 0


def run_row(run_dir: Path, protocol: dict[str, Any], checkpoints: Sequence[int]) -> dict[str, Any]:
    rows = [r["data"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    by_step = {int(r[STEP_KEY]): r for r in rows if STEP_KEY in r}
    qs = [r["actor/sat_q"] for r in rows if "actor/sat_q" in r]
    out: dict[str, Any] = {f"heldout_acc@{s}": by_step[s][HELDOUT_KEY] for s in checkpoints if s in by_step}
    last = max(checkpoints)
    out["heldout_acc"] = by_step.get(last, {}).get(HELDOUT_KEY)
    out["heldout_greedy_acc"] = by_step.get(last, {}).get(HELDOUT_GREEDY_KEY)
    out["dbar_pi_final"] = final_mean([r["actor/mismatch_abs_mean"] for r in rows])  # the studies' last quarter
    out["q_below_radius_frac"] = sum(q < RADIUS for q in qs) / len(qs) if qs else None  # SAT off logs no q
    out["intercepted_frac"] = sum(r.get("actor/sat_intercepted_frac", 0.0) for r in rows) / max(1, len(rows))
    out["steps"] = len(rows)
    return out


def loop_pairs(seeds: Sequence[int], protocol: dict[str, Any]) -> dict[str, Any] | None:
    """The loop's committed held-out accuracy at step 240, lag 8, for the same seeds and arms."""
    values: dict[str, dict[int, float]] = {protocol["treatment"]: {}, protocol["reference"]: {}}
    fingerprints = set()
    for row in csv.DictReader(LOOP_RUNS.open()):
        if row["lag"] == "8" and int(row["seed"]) in seeds and row["arm"] in values and row["heldout_acc"]:
            values[row["arm"]][int(row["seed"])] = float(row["heldout_acc"])
            fingerprints.add(row["assets_fingerprint"])
    comparison = compare(values[protocol["treatment"]], values[protocol["reference"]])
    return comparison and {**comparison, "assets": sorted(fingerprints)}


def compare(a: dict[int, float], b: dict[int, float]) -> dict[str, Any] | None:
    """studies.lib.stats.paired_comparison, plus the count of positive pairs."""
    c = paired_comparison(a, b)
    return c and {**c, "positive": sum(d > 0 for d in c["diffs"])}


def summarize(out: Path) -> dict[str, Any]:
    protocol = read_protocol(PROTOCOL)
    provenance = json.loads((out / "provenance.json").read_text())
    quick = provenance.get("quick", False)
    checkpoints = protocol["quick"]["checkpoints"] if quick else protocol["checkpoints"]
    rows = []
    for seed, arm in cells(protocol, quick):
        run_dir = out / name(arm, seed)
        if complete(run_dir, max(checkpoints)):
            rows.append({"arm": arm, "seed": seed, **run_row(run_dir, protocol, checkpoints), **provenance})
    keys = sorted({k for r in rows for k in r})
    with (out / "runs.csv").open("w", newline="") as sink:
        writer = csv.DictWriter(sink, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    treat, ref = protocol["treatment"], protocol["reference"]

    def cell(arm: str, key: str) -> dict[int, float]:
        return {r["seed"]: r[key] for r in rows if r["arm"] == arm and r.get(key) is not None}

    result: dict[str, Any] = {"provenance": provenance, "measures": {}}
    for key in ["heldout_acc", *(f"heldout_acc@{s}" for s in checkpoints[:-1]), "heldout_greedy_acc", "dbar_pi_final"]:
        result["measures"][key] = compare(cell(treat, key), cell(ref, key))
    seeds = sorted(set(cell(treat, "heldout_acc")) & set(cell(ref, "heldout_acc")))
    result["loop_same_seeds"] = loop_pairs(seeds, protocol) if not quick else None
    result["activity"] = {
        arm: {
            k: _mean([r[k] for r in rows if r["arm"] == arm and r[k] is not None])
            for k in ("q_below_radius_frac", "intercepted_frac")
        }
        for arm in (treat, ref)
    }
    (out / "study.json").write_text(json.dumps(result, indent=2, default=str))
    (out / "study.md").write_text(report(result, rows, treat, ref))
    if rows:
        plot(out / "heldout_pairs.png", rows, treat, ref, checkpoints)
    print((out / "study.md").read_text(), flush=True)
    return result


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _f(value: Any, spec: str = "+.3f") -> str:
    return format(value, spec) if isinstance(value, int | float) else "-"


def report(result: dict[str, Any], rows: list[dict[str, Any]], treat: str, ref: str) -> str:
    p = result["provenance"]
    lines = [
        "# The confirmatory contrast through `verl-sat` (studies/product/study_protocol_product.md)",
        "",
        f"Protocol commit `{p['protocol_commit']}` (blob `{p['protocol_blob']}`), assets `{p['assets_fingerprint']}`"
        + (" (quick)" if p.get("quick") else ""),
        "",
        f"| measure | {treat} - {ref} | [paired t 95%] | Wilcoxon p | permutation p | positive pairs |",
        "|---|---|---|---|---|---|",
    ]
    for key, c in result["measures"].items():
        if c:
            low, high = c["ci"]
            lines.append(
                f"| {key} | {_f(c['diff'])} | [{_f(low)}, {_f(high)}] | {_f(c['wilcoxon_p'], '.3f')} | "
                f"{_f(c['permutation_p'], '.3f')} | {c['positive']} of {c['seeds']} |"
            )
    loop = result.get("loop_same_seeds")
    if loop:
        low, high = loop["ci"]
        lines += [
            "",
            "The study loop on the same seeds (studies/confirmatory/results/runs.csv, assets "
            f"{', '.join(loop['assets'])}): "
            f"{_f(loop['diff'])} [{_f(low)}, {_f(high)}], {loop['positive']} of {loop['seeds']} pairs positive.",
        ]
    lines += [
        "",
        "| arm | seed | held-out accuracy (240) | greedy | q below log(1.2) | intercepted |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["seed"], r["arm"])):
        lines.append(
            f"| {r['arm']} | {r['seed']} | {_f(r.get('heldout_acc'), '.3f')} | "
            f"{_f(r.get('heldout_greedy_acc'), '.3f')} | "
            f"{_f(r.get('q_below_radius_frac'), '.2f')} | {_f(r['intercepted_frac'], '.4f')} |"
        )
    return "\n".join(lines) + "\n"


def plot(path: Path, rows: list[dict[str, Any]], treat: str, ref: str, checkpoints: Sequence[int]) -> Path:
    """Held-out accuracy by optimizer step, one line per run, both arms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for arm, color in ((treat, "tab:blue"), (ref, "tab:orange")):
        for i, r in enumerate(x for x in rows if x["arm"] == arm):
            steps = [s for s in checkpoints if r.get(f"heldout_acc@{s}") is not None or s == max(checkpoints)]
            values = [r.get(f"heldout_acc@{s}", r.get("heldout_acc")) for s in steps]
            ax.plot(steps, values, color=color, alpha=0.7, marker="o", ms=3, label=arm if i == 0 else None)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out accuracy (sat.heldout)")
    ax.set_title("through verl-sat, lag 8, R3: one line per seed")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for cmd in ("run", "quick"):
        sub.add_parser(cmd).add_argument("--out", type=Path, required=True)
    sub.add_parser("summarize").add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.cmd == "summarize":
        summarize(args.out)
        return 0
    return run(args.out.resolve(), quick=args.cmd == "quick")


if __name__ == "__main__":
    raise SystemExit(main())
