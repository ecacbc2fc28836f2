"""Put training runs beside the paper's Table 1 and figures (docs/sat.md#diagnostics, §7).

Command line::

    python -m verl_sat.paper.report RUN_DIR [RUN_DIR ...] --out OUT_DIR [--last-n 120] [--all-paper-rows]

Each RUN_DIR holds ``metrics.jsonl`` (one object per line, ``{"step": int, "<metric>": float,
...}``) or verl's file-logger output (``{"step": int, "data": {...}}``, any single ``*.jsonl``
in the directory; a ``.jsonl`` file may also be given directly), and optionally ``run.json``
(``{"method": "sat_gspo_r3", "lag": 8}``). Without ``run.json`` the method and lag come from
the directory name, ``<method>-lag<n>[-anything]``.

A run is a pandas DataFrame (a row per step, a column per metric); Table 1 is one of our runs merged with the paper's.

Outputs in OUT_DIR (metric definitions: docs/eval.md):

- ``table1.md`` / ``table1.csv`` / ``report.json``: one row per run: best AIME24 and its step,
  last-N-steps mean ``dbar_pi``, collapse flag, the paper's numbers and the differences;
- ``fig4_dbar_pi.png`` (lag 1 and lag 8 panels), ``fig5_aime24.png`` (ours vs paper),
  ``reward.png``, ``aime24_curve.png``, ``sat_gate.png`` (gate rate and q).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from verl_sat.files import read_metrics
from verl_sat.paper.table import LAGS, PAPER_TABLE1, normalize_method
from verl_sat.trainer.progress import DBAR_PI_KEY, GATE_KEY, Q_KEY, REWARD_KEY

# verl metric names (docs/sat.md#diagnostics; verl's trainer for the reward and validation keys).
REWARD_KEYS = (REWARD_KEY, "critic/rewards/mean")
# AIME24 accuracy, first match wins: our evaluator's key, then verl's validation keys.
ACC_KEY_PATTERNS = (
    r"^eval/aime[-_]?(?:20)?24[^/]*/avg@(\d+)$",
    r"^val-core/[^/]*aime[^/]*/acc/mean@(\d+)$",
    r"^val-core/[^/]*aime[^/]*/reward/mean@(\d+)$",
    r"^val-core/[^/]*aime[^/]*/score/mean@(\d+)$",
)
# One epoch of the paper's data: 30,712 prompts / 256 per iteration ~ 120 iterations (docs/reproduce.md).
DEFAULT_LAST_N = 120


# ---------------------------------------------------------------------------------------------
# Reading runs
# ---------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One training run: where it came from, its method and lag, and its metrics by step."""

    name: str
    path: Path
    method: str
    lag: int
    metrics: pd.DataFrame = field(default_factory=pd.DataFrame)  # index: step; a column per metric

    def series(self, key: str | None) -> pd.Series:
        """The metric ``key`` by step, steps without it left out (empty when never logged)."""
        return self.metrics[key].dropna() if key in self.metrics else pd.Series(dtype=float)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def metric_frame(path: Path) -> pd.DataFrame:
    """A metrics JSONL (``verl_sat.files.read_metrics``, strict) as one row per step and one column
    per metric. Lines of one step are merged, later wins; non-numeric and non-finite values are skipped."""
    rows = [{k: v for k, v in row.items() if _is_number(v)} for row in read_metrics(path, strict=True)]
    return pd.DataFrame(rows or {"step": []}).groupby("step").last().astype(float)


def _metrics_file(path: Path) -> Path:
    """The metrics JSONL of a run directory (or the file itself)."""
    if path.is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"run directory not found: {path}")
    if (path / "metrics.jsonl").is_file():
        return path / "metrics.jsonl"
    candidates = sorted(path.glob("*.jsonl"))
    if len(candidates) == 1:
        return candidates[0]
    found = ", ".join(c.name for c in candidates) or "none"
    raise FileNotFoundError(f"{path}: expected metrics.jsonl or exactly one *.jsonl file (found: {found})")


def infer_method_lag(name: str) -> tuple[str, int]:
    """``"sat_gspo_r3-lag8"`` -> ``("sat_gspo_r3", 8)``; ValueError when the name has no lag."""
    match = re.match(r"^(?P<method>.+?)[-_.]lag[-_]?(?P<lag>\d+)(?:$|[-_.])", name, flags=re.IGNORECASE)
    if not match:
        raise ValueError(f"cannot infer method and lag from the name {name!r}: use '<method>-lag<n>' or add run.json")
    return normalize_method(match.group("method")), int(match.group("lag"))


def load_run(path: str | Path) -> Run:
    """A ``Run`` from a run directory (or a metrics JSONL file); see the module docstring."""
    path = Path(path)
    metrics_path = _metrics_file(path)
    run_dir = path if path.is_dir() else path.parent
    name = path.name if path.is_dir() else path.stem
    meta_path = run_dir / "run.json"
    meta: dict[str, Any] = {}
    if meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{meta_path}: not valid JSON ({exc.msg})") from exc
    if meta.get("lag") == "auto":  # sat.lag=auto: reported at its staleness bound
        meta = {**meta, "lag": int((meta.get("auto_lag") or {}).get("max", 8))}
    method, lag = (meta["method"], meta["lag"]) if "method" in meta and "lag" in meta else infer_method_lag(name)
    method, lag = normalize_method(str(meta.get("method", method))), int(meta.get("lag", lag))
    metrics = metric_frame(metrics_path)
    return Run(name=str(meta.get("name", name)), path=path, method=method, lag=lag, metrics=metrics)


# ---------------------------------------------------------------------------------------------
# Series and rows
# ---------------------------------------------------------------------------------------------


def find_acc_key(keys: Sequence[str], patterns: Sequence[str] = ACC_KEY_PATTERNS) -> str | None:
    """The AIME24 accuracy key: the first pattern that matches, the largest ``@k`` among its matches."""
    for pattern in patterns:
        matches = [(int(m.group(1)) if m.groups() else 0, key) for key in keys if (m := re.search(pattern, key))]
        if matches:
            return max(matches)[1]
    return None


def acc_series(run: Run, acc_key: str | None = None) -> pd.Series:
    """AIME24 accuracy by step in percent (``acc_key``, else ``find_acc_key``): a series whose
    values are all <= 1 is a fraction and is scaled by 100."""
    series = run.series(acc_key if acc_key is not None else find_acc_key(list(run.metrics)))
    return series * 100.0 if len(series) and series.max() <= 1.0 else series


def reward_series(run: Run) -> pd.Series:
    """The run's mean reward by step (the first of ``REWARD_KEYS`` it logged)."""
    return next((run.series(key) for key in REWARD_KEYS if key in run.metrics), pd.Series(dtype=float))


@dataclass(frozen=True)
class CollapseRule:
    """When a run "collapses" (docs/eval.md): it lost a large part of its gain late in training.

    With ``x`` a series of ``n >= min_points`` points, ``baseline`` = median of its first
    ``ceil(head_frac * n)`` points, ``peak`` = its maximum, ``late`` = the mean of its last
    ``ceil(window_frac * n)`` points: the series collapsed when ``peak > baseline``, the peak is
    not inside the late window, and ``peak - late >= drop * (peak - baseline)``. The rule is
    invariant to shifting and scaling ``x``, so it works for 0/1 and -1/1 rewards alike.
    """

    window_frac: float = 0.2
    head_frac: float = 0.05
    drop: float = 0.5
    min_points: int = 5

    def __post_init__(self) -> None:
        for name in ("window_frac", "head_frac", "drop"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"collapse.{name} must be in (0, 1], got {value}")
        if self.min_points < 2:
            raise ValueError(f"collapse.min_points must be >= 2, got {self.min_points}")

    def collapsed(self, series: pd.Series) -> bool | None:
        """True / False, or None when the series is too short to tell."""
        values = pd.Series(series, dtype=float).reset_index(drop=True)
        n = len(values)
        if n < self.min_points:
            return None
        baseline = values.iloc[: math.ceil(self.head_frac * n)].median()
        window = math.ceil(self.window_frac * n)
        peak, late = values.max(), values.iloc[-window:].mean()
        if peak <= baseline or values.idxmax() >= n - window:  # idxmax: the first peak's position
            return False
        return bool(peak - late >= self.drop * (peak - baseline))


def run_row(run: Run, last_n: int, rule: CollapseRule, acc_key: str | None = None) -> dict[str, Any]:
    """Our half of one table1 row: best AIME24 and its step (earliest on ties), the mean
    ``dbar_pi`` of the last ``last_n`` logged steps, and the collapse flag of the reward and the accuracy."""
    key = acc_key if acc_key is not None else find_acc_key(list(run.metrics))
    acc, dbar = acc_series(run, key), run.series(DBAR_PI_KEY).tail(last_n)
    flags = {"reward": rule.collapsed(reward_series(run)), "acc": rule.collapsed(acc)}
    hits = [name for name, flag in flags.items() if flag]
    collapse = "yes (" + ", ".join(hits) + ")" if hits else ("no" if False in flags.values() else "n/a")
    return {
        "method": run.method, "lag": run.lag, "run": run.name, "acc_key": key,
        "best_acc": acc.max(), "best_step": acc.idxmax() if len(acc) else None,
        "final_acc": acc.iloc[-1] if len(acc) else None, "dbar_pi": dbar.mean(), "dbar_steps": len(dbar),
        "collapse": collapse,
    }  # fmt: skip


def paper_frame() -> pd.DataFrame:
    """The paper's Table 1 (``PAPER_TABLE1``), one row per (method, lag)."""
    return pd.DataFrame(
        [
            {"method": method, "lag": lag, "paper_label": row.label, "paper_acc": row.aime24.get(lag),
             "paper_dbar_pi": row.dbar_pi.get(lag), "paper_collapse": "yes" if lag in row.collapses_later else "no"}
            for method, row in PAPER_TABLE1.items()
            for lag in LAGS
        ]
    )  # fmt: skip


def method_rank(methods: Iterable[str]) -> dict[str, int]:
    """The paper's table order, then any other method by name."""
    return {m: i for i, m in enumerate([*PAPER_TABLE1, *sorted(set(methods) - set(PAPER_TABLE1))])}


def build_table(
    runs: Sequence[Run],
    last_n: int = DEFAULT_LAST_N,
    rule: CollapseRule | None = None,
    acc_key: str | None = None,
    all_paper_rows: bool = False,
) -> pd.DataFrame:
    """Table 1: a row per run beside the paper's (method, lag) and the differences, in the paper's
    order, then lag, then run name; ``all_paper_rows`` adds the paper's rows we have no run for."""
    ours = pd.DataFrame([run_row(run, last_n, rule or CollapseRule(), acc_key) for run in runs])
    table = ours.merge(paper_frame(), on=["method", "lag"], how="outer" if all_paper_rows else "left")
    table = table.fillna({"run": "–", "collapse": "–", "dbar_steps": 0, "paper_collapse": "–"})
    table = table.assign(acc_diff=table.best_acc - table.paper_acc, dbar_diff=table.dbar_pi - table.paper_dbar_pi)
    rank = method_rank(table.method)
    table = table.sort_values(["method", "lag", "run"], key=lambda c: c.map(rank) if c.name == "method" else c)
    return table.astype({"best_step": "Int64", "dbar_steps": int}).reset_index(drop=True)


# ---------------------------------------------------------------------------------------------
# Table output
# ---------------------------------------------------------------------------------------------


def markdown(cells: pd.DataFrame) -> str:
    """A markdown table of string cells (pandas' ``to_markdown`` needs tabulate, not a dependency)."""
    lines = ["| " + " | ".join(cells.columns) + " |", "|" + "---|" * cells.shape[1]]
    lines += ["| " + " | ".join(row) + " |" for row in cells.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def _fmt(column: pd.Series, spec: str) -> pd.Series:
    """Each value formatted by ``spec``, "–" when missing (``+ 0.0``: no "-0.0000")."""
    digits = int(spec.strip("+.f"))
    return column.map(lambda v: "–" if pd.isna(v) else format(round(v, digits) + 0.0, spec))


def format_table1(table: pd.DataFrame, last_n: int = DEFAULT_LAST_N) -> str:
    """table1.md: our runs beside the paper's Table 1 (AIME24 in percent)."""
    cells = pd.DataFrame({
        "method": table.method.where(table.paper_label.isna(), table.method + " (" + table.paper_label + ")"),
        "lag": table.lag.astype(str),
        "run": table.run,
        "AIME24 best (ours)": _fmt(table.best_acc, ".2f"),
        "at step": table.best_step.astype("string").fillna("–"),
        "AIME24 (paper)": _fmt(table.paper_acc, ".2f"),
        "Δ AIME24": _fmt(table.acc_diff, "+.2f"),
        f"dbar_pi last {last_n} (ours)": _fmt(table.dbar_pi, ".4f"),
        "dbar_pi (paper)": _fmt(table.paper_dbar_pi, ".4f"),
        "Δ dbar_pi": _fmt(table.dbar_diff, "+.4f"),
        "collapse (ours)": table.collapse,
        "collapses (paper)": table.paper_collapse,
    })  # fmt: skip
    notes = [
        "AIME24: the best avg@k over the run's evaluations (percent), as the paper reports the best checkpoint.",
        f"dbar_pi: mean of `{DBAR_PI_KEY}` over the last {last_n} logged steps (the paper: the last epoch).",
        "Collapse: the reward or the accuracy lost at least half of its gain late in training (docs/eval.md).",
        "Paper: Yang et al. 2026, arXiv 2607.18722, Table 1 (Qwen3-30B-A3B-Base, single seeds).",
    ]
    title = "# AIME24 and last-epoch mismatch: our runs beside the paper's Table 1"
    return f"{title}\n\n{markdown(cells)}\n" + "\n".join(notes) + "\n"


def write_tables(table: pd.DataFrame, out: Path, last_n: int) -> None:
    """table1.md, table1.csv, report.json."""
    (out / "table1.md").write_text(format_table1(table, last_n), encoding="utf-8")
    table.to_csv(out / "table1.csv", index=False)
    records = table.astype(object).where(table.notna(), None).to_dict("records")
    (out / "report.json").write_text(json.dumps({"last_n": last_n, "rows": records}, indent=2) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# Runs of one method share its colour and differ in line style, then marker (24 runs a method).
LINESTYLES = ("-", "--", ":", "-.")
MARKERS = (None, "o", "s", "^", "D", "v")


def run_label(run: Run) -> str:
    """The legend entry: the run's name, led by its method unless the name already starts with it."""
    if run.name == run.method or run.name.startswith(f"{run.method}-"):
        return run.name
    return f"{run.method} · {run.name}"


def run_styles(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """``plot`` keywords for each run (aligned with ``runs``): a colour per method, and a line style
    (then a marker) per run of that method, so that no two runs are drawn alike."""
    methods = pd.Series([run.method for run in runs], dtype=object)
    rank, cmap = method_rank(methods), _pyplot().get_cmap("tab20")
    colors = {m: cmap(i % 20) for i, m in enumerate(sorted(set(methods), key=rank.__getitem__))}
    styles = []
    for run, k in zip(runs, methods.groupby(methods).cumcount(), strict=True):  # k: the run's rank in its method
        style: dict[str, Any] = {"color": colors[run.method], "ls": LINESTYLES[k % len(LINESTYLES)]}
        marker = MARKERS[(k // len(LINESTYLES)) % len(MARKERS)]
        if marker is not None:
            style.update(marker=marker, markevery=0.1, ms=4)
        styles.append({**style, "label": run_label(run)})
    return styles


def _no_data(ax: Any) -> None:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")


def _save(fig: Any, title: str | None, path: Path) -> Path:
    """Title the figure (if ``title``), write it as PNG and close it."""
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


Curve = tuple[Callable[[Run], pd.Series], str]  # (the run's series, the panel's y label)
Paper = Callable[[str, int], Any] | None  # (method, lag) -> the paper's number, starred at the run's last step


def plot_panels(
    runs: Sequence[Run], curves: Sequence[Curve], title: str, path: Path, smooth: float = 0.0, paper: Paper = None
) -> Path:
    """One column per lag (1, 8 and any other), one row per curve, one line per run: its series by
    step, an EMA with weight ``smooth`` on the past (pandas ``ewm``, 0 = none)."""
    plt = _pyplot()
    lags = sorted(set(LAGS) | {r.lag for r in runs})
    styles = run_styles(runs)
    fig, axes = plt.subplots(
        len(curves), len(lags), figsize=(5.5 * len(lags), 1.5 + 2.5 * len(curves)), squeeze=False, sharex="col",
        sharey="row",
    )  # fmt: skip
    for i, ((series_of, ylabel), row) in enumerate(zip(curves, axes, strict=True)):
        for ax, lag in zip(row, lags, strict=True):
            plotted = [(run, style, series_of(run)) for run, style in zip(runs, styles, strict=True) if run.lag == lag]
            plotted = [(run, style, series) for run, style, series in plotted if len(series)]
            for run, style, series in plotted:
                ax.plot(series.index, series.ewm(alpha=1.0 - smooth, adjust=False).mean(), lw=1.4, **style)
                value = paper(run.method, lag) if paper else None
                if pd.notna(value):
                    ax.plot([series.index[-1]], [value], marker="*", ms=11, color=style["color"], ls="none")
            if plotted:
                ax.legend(fontsize=7)
            else:
                _no_data(ax)
            ax.set_title(f"lag {lag}" if i == 0 else "")
            ax.grid(alpha=0.3)
        row[0].set_ylabel(ylabel)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    return _save(fig, title, path)


def plot_aime24_bars(table: pd.DataFrame, path: Path) -> Path:
    """Paper Figure 5: best AIME24 per method, ours beside the paper's, one panel per lag."""
    plt = _pyplot()
    lags = sorted(set(LAGS) | set(table.lag))
    fig, axes = plt.subplots(1, len(lags), figsize=(6.5 * len(lags), 4.2), squeeze=False, sharey=True)
    for ax, lag in zip(axes[0], lags, strict=True):
        panel = table[(table.lag == lag) & (table.best_acc.notna() | table.paper_acc.notna())]
        alone = panel.run.isin(["–"]) | (panel.run == panel.method)  # no run, or one named as its method
        labels = panel.method.where(alone, panel.method + "\n" + panel.run)
        bars = panel.set_index(labels)[["best_acc", "paper_acc"]].fillna(0.0).set_axis(["ours (best)", "paper"], axis=1)
        if bars.empty:
            _no_data(ax)
        else:
            bars.plot.bar(ax=ax, width=0.8, color=["tab:blue", "tab:gray"], rot=45, xlabel="")
            plt.setp(ax.get_xticklabels(), ha="right", fontsize=7)
            ax.legend(fontsize=8)
        ax.set_title(f"AIME24, lag {lag}")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("AIME24 avg@k (%)")
    return _save(fig, None, path)


def write_plots(
    runs: Sequence[Run], table: pd.DataFrame, out: Path, smooth: float = 0.0, acc_key: str | None = None
) -> list[Path]:
    """All figures; returns their paths."""
    cells = paper_frame().set_index(["method", "lag"])

    def paper(column: str) -> Paper:
        return lambda method, lag: cells[column].get((method, lag))

    def metric(key: str) -> Callable[[Run], pd.Series]:
        return lambda run: run.series(key)

    fig4 = "Mismatch over training (paper Figure 4; * = paper's last-epoch value)"
    gate = [(metric(GATE_KEY), "gate rate"), (metric(Q_KEY), "q (alpha-quantile of |d|)")]
    return [
        plot_panels(runs, [(metric(DBAR_PI_KEY), "dbar_pi = mean |log r|")], fig4, out / "fig4_dbar_pi.png", smooth,
                    paper("paper_dbar_pi")),
        plot_aime24_bars(table, out / "fig5_aime24.png"),
        plot_panels(runs, [(reward_series, "mean reward")], "Training reward", out / "reward.png", smooth),
        plot_panels(runs, [(lambda r: acc_series(r, acc_key), "AIME24 avg@k (%)")],
                    "AIME24 over training (* = paper's best)", out / "aime24_curve.png", 0.0, paper("paper_acc")),
        plot_panels(runs, gate, "SAT gate rate and reference q", out / "sat_gate.png", smooth),
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m verl_sat.paper.report`` argument parser."""
    p = argparse.ArgumentParser(prog="python -m verl_sat.paper.report", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (or metrics .jsonl files)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--last-n", type=int, default=DEFAULT_LAST_N, help="steps averaged for dbar_pi (one epoch)")
    p.add_argument("--acc-key", default=None, help="accuracy metric key (default: auto, see ACC_KEY_PATTERNS)")
    p.add_argument("--smooth", type=float, default=0.0, help="EMA weight on the past for curves, in [0, 1)")
    p.add_argument("--collapse-window", type=float, default=0.2, help="late window, fraction of points")
    p.add_argument("--collapse-drop", type=float, default=0.5, help="fraction of the gain lost that is a collapse")
    p.add_argument("--all-paper-rows", action="store_true", help="also list the paper's rows we have no run for")
    p.add_argument("--no-plots", action="store_true", help="write the tables only")
    return p


def main(argv: Sequence[str] | None = None) -> pd.DataFrame:
    """Entry point of ``python -m verl_sat.paper.report``; returns Table 1."""
    args = build_parser().parse_args(argv)
    if args.last_n < 1:
        raise SystemExit(f"--last-n must be >= 1, got {args.last_n}")
    if not 0 <= args.smooth < 1:
        raise SystemExit(f"--smooth must be in [0, 1), got {args.smooth}")
    rule = CollapseRule(window_frac=args.collapse_window, drop=args.collapse_drop)
    runs = [load_run(p) for p in args.runs]
    table = build_table(runs, args.last_n, rule, args.acc_key, args.all_paper_rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_tables(table, out, args.last_n)
    if not args.no_plots:
        write_plots(runs, table, out, args.smooth, args.acc_key)
    print(format_table1(table, args.last_n))
    return table


if __name__ == "__main__":
    main()
