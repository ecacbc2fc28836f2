"""Put training runs beside the paper's Table 1 and figures (docs/sat.md#diagnostics, §7).

Command line::

    python -m verl_sat.paper.report RUN_DIR [RUN_DIR ...] --out OUT_DIR [--last-n 120] [--all-paper-rows]

Each RUN_DIR holds ``metrics.jsonl`` (one object per line, ``{"step": int, "<metric>": float,
...}``) or verl's file-logger output (``{"step": int, "data": {...}}``, any single ``*.jsonl``
in the directory; a ``.jsonl`` file may also be given directly), and optionally ``run.json``
(``{"method": "sat_gspo_r3", "lag": 8}``). Without ``run.json`` the method and lag come from
the directory name, ``<method>-lag<n>[-anything]``.

Outputs in OUT_DIR (metric definitions: docs/eval.md):

- ``table1.md`` / ``table1.csv`` / ``report.json``: one row per run: best AIME24 and its step,
  last-N-steps mean ``dbar_pi``, collapse flag, the paper's numbers and the differences;
- ``fig4_dbar_pi.png`` (lag 1 and lag 8 panels), ``fig5_aime24.png`` (ours vs paper),
  ``reward.png``, ``aime24_curve.png``, ``sat_gate.png`` (gate rate and q).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from verl_sat.files import read_metrics
from verl_sat.paper.table import LAGS, PAPER_TABLE1, normalize_method

# verl metric names (docs/sat.md#diagnostics; verl's trainer for the reward and validation keys).
REWARD_KEYS = ("critic/score/mean", "critic/rewards/mean")
DBAR_PI_KEY = "actor/mismatch_abs_mean"
GATE_RATE_KEY = "actor/sat_gate_rate"
Q_KEY = "actor/sat_q"
C_MIN_KEY = "actor/sat_c_min"
# AIME24 accuracy, first match wins: our evaluator's key, then verl's validation keys.
ACC_KEY_PATTERNS = (
    r"^eval/aime[-_]?(?:20)?24[^/]*/avg@(\d+)$",
    r"^val-core/[^/]*aime[^/]*/acc/mean@(\d+)$",
    r"^val-core/[^/]*aime[^/]*/reward/mean@(\d+)$",
    r"^val-core/[^/]*aime[^/]*/score/mean@(\d+)$",
)
# One epoch of the paper's data: 30,712 prompts / 256 per iteration ~ 120 iterations (docs/reproduce.md).
DEFAULT_LAST_N = 120

Series = list[tuple[int, float]]


# ---------------------------------------------------------------------------------------------
# Reading runs
# ---------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One training run: where it came from, its method and lag, and every metric as a series."""

    name: str
    path: Path
    method: str
    lag: int
    metrics: dict[str, dict[int, float]] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict)  # run.json (samples, sentinel: docs/faults.md)

    def series(self, key: str) -> Series:
        """``[(step, value), ...]`` sorted by step ([] when the run never logged ``key``)."""
        return sorted(self.metrics.get(key, {}).items())


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def metric_series(path: Path) -> dict[str, dict[int, float]]:
    """``{metric: {step: value}}`` of a metrics JSONL (``verl_sat.files.read_metrics``, strict;
    later lines win). Non-numeric and non-finite values are skipped."""
    metrics: dict[str, dict[int, float]] = {}
    for row in read_metrics(path, strict=True):
        for key, value in row.items():
            if key != "step" and _is_number(value):
                metrics.setdefault(key, {})[row["step"]] = float(value)
    return metrics


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
    if "method" in meta and "lag" in meta:
        method, lag = normalize_method(str(meta["method"])), int(meta["lag"])
    else:
        method, lag = infer_method_lag(name)
        method, lag = normalize_method(str(meta.get("method", method))), int(meta.get("lag", lag))
    metrics = metric_series(metrics_path)
    return Run(name=str(meta.get("name", name)), path=path, method=method, lag=lag, metrics=metrics, record=meta)


# ---------------------------------------------------------------------------------------------
# Row statistics
# ---------------------------------------------------------------------------------------------


def find_acc_key(keys: Sequence[str], patterns: Sequence[str] = ACC_KEY_PATTERNS) -> str | None:
    """The AIME24 accuracy key: the first pattern that matches, the largest ``@k`` among its matches."""
    for pattern in patterns:
        matches = [(int(m.group(1)) if m.groups() else 0, key) for key in keys if (m := re.search(pattern, key))]
        if matches:
            return max(matches)[1]
    return None


def as_percent(series: Series) -> Series:
    """Accuracy in percent: a series whose values are all <= 1 is a fraction and is scaled by 100."""
    if series and max(v for _, v in series) <= 1.0:
        return [(s, 100.0 * v) for s, v in series]
    return series


def best_point(series: Series) -> tuple[int, float] | None:
    """``(step, value)`` of the maximum (earliest step on ties), or None for an empty series."""
    if not series:
        return None
    best = max(v for _, v in series)
    return next((s, v) for s, v in series if v == best)


def last_n_mean(series: Series, n: int) -> float | None:
    """Mean of the values of the last ``n`` logged steps (all of them when fewer)."""
    if not series:
        return None
    tail = series[-n:]
    return sum(v for _, v in tail) / len(tail)


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

    def collapsed(self, series: Series) -> bool | None:
        """True / False, or None when the series is too short to tell."""
        values = [v for _, v in series]
        n = len(values)
        if n < self.min_points:
            return None
        head = sorted(values[: max(1, math.ceil(self.head_frac * n))])
        baseline = head[len(head) // 2] if len(head) % 2 else 0.5 * (head[len(head) // 2 - 1] + head[len(head) // 2])
        window = max(1, math.ceil(self.window_frac * n))
        peak = max(values)
        peak_index = values.index(peak)
        late = sum(values[-window:]) / window
        if peak <= baseline or peak_index >= n - window:
            return False
        return peak - late >= self.drop * (peak - baseline)


@dataclass
class Row:
    """One row of table1: our run's numbers beside the paper's (accuracies in percent)."""

    method: str
    lag: int
    run: str
    acc_key: str | None
    best_acc: float | None
    best_step: int | None
    final_acc: float | None
    dbar_pi: float | None
    dbar_steps: int
    collapse: str
    paper_label: str | None
    paper_acc: float | None
    paper_dbar_pi: float | None
    paper_collapse: str

    @property
    def acc_diff(self) -> float | None:
        return None if self.best_acc is None or self.paper_acc is None else self.best_acc - self.paper_acc

    @property
    def dbar_diff(self) -> float | None:
        return None if self.dbar_pi is None or self.paper_dbar_pi is None else self.dbar_pi - self.paper_dbar_pi


def _paper_cells(method: str, lag: int) -> tuple[str | None, float | None, float | None, str]:
    row = PAPER_TABLE1.get(method)
    if row is None:
        return None, None, None, "–"
    collapse = "yes" if lag in row.collapses_later else ("no" if lag in row.aime24 else "–")
    return row.label, row.aime24.get(lag), row.dbar_pi.get(lag), collapse


def reward_series(run: Run) -> Series:
    """The run's mean reward per step (the first of ``REWARD_KEYS`` it logged)."""
    for key in REWARD_KEYS:
        if key in run.metrics:
            return run.series(key)
    return []


def build_row(
    run: Run, last_n: int = DEFAULT_LAST_N, rule: CollapseRule | None = None, acc_key: str | None = None
) -> Row:
    """The table1 row of one run."""
    rule = rule or CollapseRule()
    key = acc_key if acc_key is not None else find_acc_key(list(run.metrics))
    acc = as_percent(run.series(key)) if key else []
    best = best_point(acc)
    dbar = run.series(DBAR_PI_KEY)
    flags = {"reward": rule.collapsed(reward_series(run)), "acc": rule.collapsed(acc)}
    hits = [name for name, flag in flags.items() if flag]
    if hits:
        collapse = "yes (" + ", ".join(hits) + ")"
    else:
        collapse = "no" if any(flag is False for flag in flags.values()) else "n/a"
    label, paper_acc, paper_dbar, paper_collapse = _paper_cells(run.method, run.lag)
    return Row(
        method=run.method,
        lag=run.lag,
        run=run.name,
        acc_key=key,
        best_acc=None if best is None else best[1],
        best_step=None if best is None else best[0],
        final_acc=acc[-1][1] if acc else None,
        dbar_pi=last_n_mean(dbar, last_n),
        dbar_steps=min(len(dbar), last_n),
        collapse=collapse,
        paper_label=label,
        paper_acc=paper_acc,
        paper_dbar_pi=paper_dbar,
        paper_collapse=paper_collapse,
    )


def _method_order(method: str) -> int:
    keys = list(PAPER_TABLE1)
    return keys.index(method) if method in keys else len(keys)


def build_rows(
    runs: Sequence[Run],
    last_n: int = DEFAULT_LAST_N,
    rule: CollapseRule | None = None,
    acc_key: str | None = None,
    all_paper_rows: bool = False,
) -> list[Row]:
    """Rows for every run (paper table order, then lag, then run name); optionally the paper's other rows."""
    rows = [build_row(run, last_n, rule, acc_key) for run in runs]
    if all_paper_rows:
        present = {(r.method, r.lag) for r in rows}
        for method in PAPER_TABLE1:
            for lag in LAGS:
                if (method, lag) not in present:
                    label, paper_acc, paper_dbar, paper_collapse = _paper_cells(method, lag)
                    rows.append(
                        Row(method, lag, "–", None, None, None, None, None, 0, "–", label, paper_acc, paper_dbar,
                            paper_collapse)
                    )  # fmt: skip
    return sorted(rows, key=lambda r: (_method_order(r.method), r.method, r.lag, r.run))


# ---------------------------------------------------------------------------------------------
# Table output
# ---------------------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str, signed: bool = False) -> str:
    if value is None:
        return "–"
    digits = int(spec.strip(".f"))
    return format(round(value, digits) + 0.0, ("+" if signed else "") + spec)  # + 0.0: no "-0.0000"


def format_table1(rows: Sequence[Row], last_n: int = DEFAULT_LAST_N) -> str:
    """table1.md: our runs beside the paper's Table 1 (AIME24 in percent)."""
    header = (
        "| method | lag | run | AIME24 best (ours) | at step | AIME24 (paper) | Δ AIME24 "
        f"| dbar_pi last {last_n} (ours) | dbar_pi (paper) | Δ dbar_pi | collapse (ours) | collapses (paper) |"
    )
    lines = [
        "# AIME24 and last-epoch mismatch: our runs beside the paper's Table 1",
        "",
        header,
        "|" + "---|" * 12,
    ]
    for r in rows:
        method = f"{r.method} ({r.paper_label})" if r.paper_label else r.method
        cells = [
            method,
            str(r.lag),
            r.run,
            _fmt(r.best_acc, ".2f"),
            "–" if r.best_step is None else str(r.best_step),
            _fmt(r.paper_acc, ".2f"),
            _fmt(r.acc_diff, ".2f", signed=True),
            _fmt(r.dbar_pi, ".4f"),
            _fmt(r.paper_dbar_pi, ".4f"),
            _fmt(r.dbar_diff, ".4f", signed=True),
            r.collapse,
            r.paper_collapse,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "AIME24: the best avg@k over the run's evaluations (percent), as the paper reports the best checkpoint.",
        f"dbar_pi: mean of `{DBAR_PI_KEY}` over the last {last_n} logged steps (the paper: the last epoch).",
        "Collapse: the reward or the accuracy lost at least half of its gain late in training (docs/eval.md).",
        "Paper: Yang et al. 2026, arXiv 2607.18722, Table 1 (Qwen3-30B-A3B-Base, single seeds).",
    ]
    return "\n".join(lines) + "\n"


def write_table_files(rows: Sequence[Row], out: Path, last_n: int) -> None:
    """table1.md, table1.csv and report.json."""
    (out / "table1.md").write_text(format_table1(rows, last_n), encoding="utf-8")
    records = [{**asdict(r), "acc_diff": r.acc_diff, "dbar_diff": r.dbar_diff} for r in rows]
    with (out / "table1.csv").open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(records[0]) if records else ["method"])
        writer.writeheader()
        writer.writerows(records)
    (out / "report.json").write_text(json.dumps({"last_n": last_n, "rows": records}, indent=2) + "\n", encoding="utf-8")


def samples_table(runs: Sequence[Run]) -> str:
    """samples.md: each run's sample accounting and sentinel record from run.json (docs/faults.md)."""

    def n(value: Any) -> str:
        return "-" if value is None else str(len(value) if isinstance(value, list) else value)

    lines = [
        "| run | prompts trained | responses | repeated | skipped | lost in flight | in flight at end | "
        "regenerated | rollbacks | collapsed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        s, sentinel = run.record.get("samples"), run.record.get("sentinel") or {}
        if s is None:
            continue
        collapsed = "yes" if (sentinel.get("verdict") or {}).get("collapsed") else "no"
        cells = [s.get(k) for k in ("prompts_trained", "responses_trained", "repeated", "skipped")]
        cells += [s.get(k) for k in ("lost_in_flight", "in_flight_at_end", "regenerated")]
        cells += [sentinel.get("rollbacks", []), collapsed]
        lines.append(f"| {run.name} | " + " | ".join(n(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def write_samples_table(runs: Sequence[Run], out: Path) -> None:
    if any("samples" in run.record for run in runs):
        (out / "samples.md").write_text(samples_table(runs), encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colors(methods: Sequence[str]) -> dict[str, Any]:
    plt = _pyplot()
    cmap = plt.get_cmap("tab20")
    ordered = sorted(set(methods), key=lambda m: (_method_order(m), m))
    return {m: cmap(i % 20) for i, m in enumerate(ordered)}


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
    colors = _colors([r.method for r in runs])
    seen: dict[str, int] = {}
    styles = []
    for run in runs:
        k = seen.get(run.method, 0)
        seen[run.method] = k + 1
        style: dict[str, Any] = {"color": colors[run.method], "ls": LINESTYLES[k % len(LINESTYLES)]}
        marker = MARKERS[(k // len(LINESTYLES)) % len(MARKERS)]
        if marker is not None:
            style.update(marker=marker, markevery=0.1, ms=4)
        styles.append({**style, "label": run_label(run)})
    return styles


def ema(values: Sequence[float], alpha: float) -> list[float]:
    """Exponential moving average with weight ``alpha`` on the past (0 = no smoothing)."""
    out, acc = [], None
    for v in values:
        acc = v if acc is None else alpha * acc + (1 - alpha) * v
        out.append(acc)
    return out


def _panel_lags(runs: Sequence[Run]) -> list[int]:
    return sorted(set(LAGS) | {r.lag for r in runs})


def _no_data(ax: Any) -> None:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")


def finish_lag_panel(ax: Any, lag: int, plotted: bool, xlabel: str) -> None:
    """Legend (or a "no data" mark), the lag as title, the x label and a light grid."""
    if plotted:
        ax.legend(fontsize=7)
    else:
        _no_data(ax)
    ax.set_title(f"lag {lag}")
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3)


def save_panels(fig: Any, axes: Any, ylabel: str, title: str, path: Path) -> Path:
    """Label the first panel, title the figure, write it as PNG and close it."""
    axes[0][0].set_ylabel(ylabel)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def plot_series(
    runs: Sequence[Run], key_fn: Any, ylabel: str, title: str, path: Path, smooth: float = 0.0, paper: Any = None
) -> Path:
    """One panel per lag, one line per run: ``key_fn(run) -> Series``; ``paper(method, lag)`` adds a marker."""
    plt = _pyplot()
    lags = _panel_lags(runs)
    styles = run_styles(runs)
    fig, axes = plt.subplots(1, len(lags), figsize=(5.5 * len(lags), 4), squeeze=False, sharey=True)
    for ax, lag in zip(axes[0], lags, strict=True):
        plotted = False
        for run, style in zip(runs, styles, strict=True):
            series = key_fn(run) if run.lag == lag else []
            if not series:
                continue
            steps = [s for s, _ in series]
            ax.plot(steps, ema([v for _, v in series], smooth), lw=1.4, **style)
            value = paper(run.method, lag) if paper else None
            if value is not None:
                ax.plot([steps[-1]], [value], marker="*", ms=11, color=style["color"], ls="none")
            plotted = True
        finish_lag_panel(ax, lag, plotted, "step")
    return save_panels(fig, axes, ylabel, title, path)


def plot_aime24_bars(rows: Sequence[Row], path: Path) -> Path:
    """Paper Figure 5: best AIME24 per method, ours beside the paper's, one panel per lag."""
    plt = _pyplot()
    lags = sorted(set(LAGS) | {r.lag for r in rows})
    fig, axes = plt.subplots(1, len(lags), figsize=(6.5 * len(lags), 4.2), squeeze=False, sharey=True)
    for ax, lag in zip(axes[0], lags, strict=True):
        panel = [r for r in rows if r.lag == lag and (r.best_acc is not None or r.paper_acc is not None)]
        if not panel:
            _no_data(ax)
        xs = list(range(len(panel)))
        ours = [r.best_acc if r.best_acc is not None else 0.0 for r in panel]
        paper = [r.paper_acc if r.paper_acc is not None else 0.0 for r in panel]
        ax.bar([x - 0.2 for x in xs], ours, width=0.4, label="ours (best)", color="tab:blue")
        ax.bar([x + 0.2 for x in xs], paper, width=0.4, label="paper", color="tab:gray")
        ax.set_xticks(xs)
        labels = [r.method if r.run in ("–", r.method) else f"{r.method}\n{r.run}" for r in panel]
        ax.set_xticklabels(labels, rotation=45, ha="right", fontsize=7)
        ax.set_title(f"AIME24, lag {lag}")
        ax.grid(axis="y", alpha=0.3)
        if panel:
            ax.legend(fontsize=8)
    axes[0][0].set_ylabel("AIME24 avg@k (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sat_gate(runs: Sequence[Run], path: Path, smooth: float = 0.0) -> Path:
    """SAT's gate rate (top) and reference q (bottom) over training, one column per lag."""
    plt = _pyplot()
    lags = _panel_lags(runs)
    styles = run_styles(runs)
    fig, axes = plt.subplots(2, len(lags), figsize=(5.5 * len(lags), 6.5), squeeze=False, sharex="col")
    for col, lag in enumerate(lags):
        for row, (key, label) in enumerate(((GATE_RATE_KEY, "gate rate"), (Q_KEY, "q (alpha-quantile of |d|)"))):
            ax = axes[row][col]
            plotted = False
            for run, style in zip(runs, styles, strict=True):
                series = run.series(key) if run.lag == lag else []
                if series:
                    steps = [s for s, _ in series]
                    ax.plot(steps, ema([v for _, v in series], smooth), **style)
                    plotted = True
            if plotted:
                ax.legend(fontsize=7)
            else:
                _no_data(ax)
            ax.set_ylabel(label)
            ax.set_title(f"lag {lag}" if row == 0 else "")
            ax.grid(alpha=0.3)
        axes[1][col].set_xlabel("step")
    fig.suptitle("SAT gate rate and reference q")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(
    runs: Sequence[Run], rows: Sequence[Row], out: Path, smooth: float = 0.0, acc_key: str | None = None
) -> list[Path]:
    """All figures; returns their paths."""

    def paper_dbar(method: str, lag: int) -> float | None:
        row = PAPER_TABLE1.get(method)
        return None if row is None else row.dbar_pi.get(lag)

    def acc(run: Run) -> Series:
        key = acc_key if acc_key is not None else find_acc_key(list(run.metrics))
        return as_percent(run.series(key)) if key else []

    def paper_acc(method: str, lag: int) -> float | None:
        row = PAPER_TABLE1.get(method)
        return None if row is None else row.aime24.get(lag)

    return [
        plot_series(
            runs,
            lambda r: r.series(DBAR_PI_KEY),
            "dbar_pi = mean |log r|",
            "Mismatch over training (paper Figure 4; * = paper's last-epoch value)",
            out / "fig4_dbar_pi.png",
            smooth,
            paper_dbar,
        ),
        plot_aime24_bars(rows, out / "fig5_aime24.png"),
        plot_series(runs, reward_series, "mean reward", "Training reward", out / "reward.png", smooth),
        plot_series(
            runs,
            acc,
            "AIME24 avg@k (%)",
            "AIME24 over training (* = paper's best)",
            out / "aime24_curve.png",
            0.0,
            paper_acc,
        ),  # fmt: skip
        plot_sat_gate(runs, out / "sat_gate.png", smooth),
    ]


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


def main(argv: Sequence[str] | None = None) -> list[Row]:
    """Entry point of ``python -m verl_sat.paper.report``; returns the table rows."""
    args = build_parser().parse_args(argv)
    if args.last_n < 1:
        raise SystemExit(f"--last-n must be >= 1, got {args.last_n}")
    if not 0 <= args.smooth < 1:
        raise SystemExit(f"--smooth must be in [0, 1), got {args.smooth}")
    rule = CollapseRule(window_frac=args.collapse_window, drop=args.collapse_drop)
    runs = [load_run(p) for p in args.runs]
    rows = build_rows(runs, args.last_n, rule, args.acc_key, args.all_paper_rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_table_files(rows, out, args.last_n)
    write_samples_table(runs, out)
    if not args.no_plots:
        write_plots(runs, rows, out, args.smooth, args.acc_key)
    print(format_table1(rows, args.last_n))
    return rows


if __name__ == "__main__":
    main()
