"""studies/confirmatory/sat_study.py: the search's rule, the protocol gate (a moved protocol keeps its
commit), the paired analysis, the fingerprint, the committed results, and one tiny study end to end
through the worker pool."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from study_scripts import load_study
from test_job_summary import at, capture_figures, points

REPO = Path(__file__).resolve().parents[1]
STUDY = REPO / "studies" / "confirmatory"


@pytest.fixture
def saved_figures(monkeypatch) -> dict:
    return capture_figures(monkeypatch)


@pytest.fixture(scope="module")
def study():
    return load_study("confirmatory", "sat_study")


def test_the_search_runs_only_baselines_on_seeds_of_its_own(study):
    specs = study.search_specs()
    assert {s.arm for s in specs} == set(study.SEARCH["arms"]) == {"gspo", "gspo_r3"}
    assert all(not s.config().sat_enabled for s in specs)
    assert {s.seed for s in specs} == set(study.SEARCH_SEEDS)
    assert all(s.config().eval_problems >= 512 for s in specs)
    assert {s.lag for s in specs} == {1, 8} and all(s.config().steps >= 30 * 8 for s in specs)


def stat(tag, arm, lag, seed, acc, initial=0.1, below=0.9, intercepting=0.9, frac=0.01):
    return {
        "tag": tag, "arm": arm, "lag": lag, "seed": seed, "heldout_acc": acc, "heldout_acc_initial": initial,
        "q_below_radius_frac": below, "intercepted_steps_frac": intercepting, "intercepted_frac": frac,
    }  # fmt: skip


def grid(tag, lag1, lag8, **kw):
    return [
        stat(tag, arm, lag, seed, acc, **kw)
        for arm in ("gspo", "gspo_r3")
        for lag, acc in ((1, lag1), (8, lag8))
        for seed in (1, 2)
    ]


def test_the_regime_rule_prefers_learning_degrading_and_active(study):
    stats = grid("a", 0.5, 0.48) + grid("b", 0.5, 0.30) + grid("c", 0.6, 0.20, below=0.1)
    picked = study.pick_regime(stats)
    assert picked["picked"] == "b" and picked["why"] == "meets all three"  # c degrades more but SAT is inert there
    verdicts = {v["tag"]: v for v in picked["verdicts"]}
    assert verdicts["c"]["degrades"] and not verdicts["c"]["active"] and not verdicts["a"]["degrades"]
    assert study.pick_regime(grid("a", 0.5, 0.48) + grid("n", 0.15, 0.1))["why"].startswith("learns and SAT")
    inert = study.pick_regime(grid("x", 0.5, 0.3, below=0.0, frac=0.0) + grid("y", 0.5, 0.3, below=0.0, frac=1e-3))
    assert inert == {**inert, "picked": "y", "why": "SAT is inert in every setting"}


def test_the_paired_analysis(study):
    diffs = [0.02, 0.05, -0.01, 0.04, 0.03, 0.015]
    stats = [{"arm": "g", "lag": 8, "seed": k, "tag": "", "acc": 0.5} for k in range(6)]
    stats += [{"arm": "s", "lag": 8, "seed": k, "tag": "", "acc": 0.5 + d} for k, d in enumerate(diffs)]
    row = study.paired(stats, "s", "g", 8, "acc")
    assert row["seeds"] == 6 and row["diff"] == pytest.approx(sum(diffs) / 6)
    lo, hi = row["ci"]
    assert lo < row["diff"] < hi and lo > 0  # every difference but one positive: the interval excludes 0
    assert row["wilcoxon_p"] == pytest.approx(4 / 64)  # W+ = 20 of 21: P(|W+ - 10.5| >= 9.5) = 4/64
    assert 0 < row["permutation_p"] < 0.1
    assert study.paired(stats, "s", "g", 1, "acc") is None  # no seeds at that lag


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def git_repo(path: Path) -> Path:
    git(path, "init", "-q")
    git(path, "config", "user.email", "t@t")
    git(path, "config", "user.name", "t")
    return path


def test_a_confirmatory_run_needs_the_committed_unchanged_protocol(study, tmp_path):
    git_repo(tmp_path)
    protocol = tmp_path / "studies" / "study_protocol.md"
    with pytest.raises(SystemExit, match="does not exist"):
        study.protocol_state(protocol, tmp_path)
    protocol.parent.mkdir()
    protocol.write_text('# p\n\n```json\n{"stress_lag": 8}\n```\n')
    with pytest.raises(SystemExit, match="not committed"):
        study.protocol_state(protocol, tmp_path)
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "protocol")
    state = study.protocol_state(protocol, tmp_path)
    assert len(state["protocol_commit"]) == 40 and len(state["protocol_blob"]) == 40
    assert study.read_protocol(protocol) == {"stress_lag": 8}
    protocol.write_text(protocol.read_text() + "changed\n")
    with pytest.raises(SystemExit, match="uncommitted changes"):
        study.protocol_state(protocol, tmp_path)


def test_a_protocol_moved_with_git_mv_keeps_its_commit_and_blob(study, tmp_path):
    """A move that keeps every byte is not a change: the results that carry the protocol's commit
    and blob still name it; an edit after the move is a new commit."""
    git_repo(tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "p.md").write_text('# p\n\n```json\n{"stress_lag": 8}\n```\n')
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "protocol")
    before = study.protocol_state(tmp_path / "docs" / "p.md", tmp_path)
    (tmp_path / "studies").mkdir()
    git(tmp_path, "mv", "docs/p.md", "studies/p.md")
    with pytest.raises(SystemExit, match="uncommitted changes|not committed"):
        study.protocol_state(tmp_path / "studies" / "p.md", tmp_path)  # the move itself is not committed yet
    git(tmp_path, "commit", "-q", "-m", "move")
    moved = study.protocol_state(tmp_path / "studies" / "p.md", tmp_path)
    assert moved == {**before, "protocol_path": "studies/p.md"}
    (tmp_path / "studies" / "p.md").write_text("# p, edited\n")
    git(tmp_path, "commit", "-q", "-am", "edit")
    assert study.protocol_state(tmp_path / "studies" / "p.md", tmp_path)["protocol_commit"] != before["protocol_commit"]


def test_the_protocols_are_the_committed_results_own(study):
    """Each protocol's blob is the one its committed results carry (a moved protocol is byte-identical)."""
    import csv

    autolag = REPO / "studies" / "autolag"
    for protocol, runs in (
        (STUDY / "study_protocol.md", STUDY / "results" / "runs.csv"),
        (STUDY / "study_protocol.md", STUDY / "results" / "warmup_a44e53f" / "runs.csv"),
        (autolag / "study_protocol_autolag.md", autolag / "results" / "autolag_runs.csv"),
        (autolag / "study_protocol_autolag2.md", autolag / "results2" / "autolag_runs.csv"),
    ):
        blob = subprocess.run(["git", "hash-object", str(protocol)], capture_output=True, text=True, check=True)
        assert {r["protocol_blob"] for r in csv.DictReader(runs.open())} == {blob.stdout.strip()}, protocol.name
    assert study.PROTOCOL == STUDY / "study_protocol.md" and study.REPO == REPO


def test_confirmatory_specs_follow_the_protocol(study):
    protocol = {
        "settings": {**study.BASE_SETTINGS, "lr": 2e-4, "router_bias_std": 0.5},
        "checkpoints": [0, 60],
        "stress_lag": 8,
        "primary": ["gspo_r3", "sat_gspo_r3"],
        "primary_seeds": list(range(1001, 1017)),
        "dose_lags": [1, 2, 8],
        "dose_seeds": [1001, 1002],
        "stabilizers": ["gspo_r3_tis", "cispo_r3"],
        "stabilizer_seeds": [1001],
    }
    primary = study.confirmatory_specs(protocol, "primary")
    assert len(primary) == 32 and {s.lag for s in primary} == {8}
    cfg = next(s for s in primary if s.arm == "sat_gspo_r3").config()
    assert cfg.sat_enabled and cfg.routing_replay == "R3" and cfg.lr == 2e-4 and cfg.eval_at == (0, 60)
    dose = study.confirmatory_specs(protocol, "dose")
    assert len(dose) == 12 and set(dose) & set(primary)  # lag 8's dose runs are primary runs
    stabilizers = study.confirmatory_specs(protocol, "stabilizers")
    assert {s.config().correction for s in stabilizers} == {"tis", "none"}
    with pytest.raises(ValueError, match="unknown arm"):
        study.confirmatory_specs({**protocol, "stabilizers": ["ppo"]}, "stabilizers")


def test_the_assets_fingerprint_names_the_weights(study, tmp_path):
    (tmp_path / "a" / "model").mkdir(parents=True)
    (tmp_path / "a" / "model" / "model.safetensors").write_bytes(b"weights")
    first = study.assets_fingerprint(tmp_path / "a")
    (tmp_path / "a" / "model" / "model.safetensors").write_bytes(b"weightz")
    assert study.assets_fingerprint(tmp_path / "a") != first and len(first) == 16


def test_a_tiny_search_end_to_end(study, tmp_path, monkeypatch, saved_figures):
    """Two worker processes, the quick phase at 3 steps: runs, search.md, CSV, the figure (read back
    against the runs it was drawn from)."""
    from verl_sat.default import model as tiny

    tiny.create(tmp_path / "assets" / "model", seed=0)
    monkeypatch.setattr(study, "QUICK", {**study.QUICK, "steps": 3, "eval_problems": 8})
    argv = ["quick", "--jobs", "2", "--out", str(tmp_path / "s"), "--assets", str(tmp_path / "assets")]
    assert study.main(argv) == 0
    out = tmp_path / "s"
    rows = [json.loads(line) for line in (out / "runs" / "quick-sat_gspo_r3-lag8-seed801" / "metrics.jsonl").open()]
    assert len(rows) == 3 and "eval/heldout_acc" in rows[-1]["data"] and "study/q" in rows[0]["data"]
    assert "eval/heldout_acc_initial" in rows[0]["data"]
    assert "quick" in (out / "search.md").read_text() and (out / "working_range.png").stat().st_size > 1000
    assert len((out / "search_runs.csv").read_text().splitlines()) == 1 + 4
    assert json.loads((out / "provenance.json").read_text())["assets_fingerprint"]
    check_working_range(study, saved_figures["working_range.png"], out)


def check_working_range(study, fig, out: Path) -> None:
    """working_range.png, left: per (setting, lag) of the GSPO + R3 runs, a box of their steps' q
    (quartiles and median) and the clip radius; right: per group, the mean intercepted share at
    each staleness. Recomputed from the runs' metrics.jsonl."""
    import statistics

    import numpy as np

    specs, runs = study.load_runs(out)
    groups: dict = {}
    for s in specs:
        if s.arm == "gspo_r3":
            groups.setdefault((s.tag, s.lag), []).extend(runs[s.name])
    left, right = fig.axes
    assert groups and [t.get_text() for t in left.get_xticklabels()] == [f"{t}\nlag {n}" for t, n in sorted(groups)]
    lines = left.get_lines()
    assert [list(line.get_ydata()) for line in lines if line.get_label().startswith("log(1 + eps_high)")] == [
        [study.RADIUS] * 2
    ]
    for position, key in enumerate(sorted(groups), 1):
        q = [r[study.Q_KEY] for r in groups[key] if study.Q_KEY in r]
        at_box = [line for line in lines if min(line.get_xdata()) <= position <= max(line.get_xdata()) < position + 1]
        box = next(line for line in at_box if len(line.get_ydata()) == 5)  # the box outline
        assert sorted(set(box.get_ydata())) == pytest.approx(list(np.percentile(q, [25, 75]))), key
        flat = [tuple(line.get_ydata()) for line in at_box if len(line.get_ydata()) == 2 and np.ptp(line.get_xdata())]
        assert (statistics.median(q),) * 2 in [pytest.approx(y) for y in flat], key  # the median mark
    assert [line.get_label() for line in right.get_lines()] == [f"{t} lag {n}" for t, n in sorted(groups)]
    for key, line in zip(sorted(groups), right.get_lines(), strict=True):
        shares = study.by_staleness(groups[key], study.INTERCEPT_KEY)
        assert points(line) == at((x, sum(shares[x]) / len(shares[x])) for x in sorted(shares)), key


def test_a_directory_without_the_primary_seeds_does_not_call_itself_primary(study):
    # the dose phase holds 5 seeds at the stress lag: its paired lag-8 row is not the 16-seed primary
    assert study.primary_heading({"seeds": 16}, 16) == "## Primary"
    assert "5 seeds (not the primary result: that has 16)" in study.primary_heading({"seeds": 5}, 16)
    assert "not the primary result" in study.primary_heading(None, 16)


NUMBERS = ("heldout_acc", "heldout_acc@60", "heldout_acc@120", "heldout_acc@180", "heldout_greedy_acc")
NUMBERS += ("final_reward", "dbar_pi_final")


def committed_runs(directory: str) -> list[dict]:
    """A committed runs.csv, typed as ``run_stats`` writes it (the fields the paired analysis reads)."""
    import csv

    rows = list(csv.DictReader((STUDY / "results" / directory / "runs.csv").open()))
    return [
        {
            **r,
            "lag": int(r["lag"]),
            "seed": int(r["seed"]),
            **{k: float(r[k]) if r[k] else None for k in NUMBERS},
        }
        for r in rows
    ]


def quoted(study, stats: list[dict], arm: str, ref: str, lag: int, digits: int = 3, key: str = "heldout_acc") -> dict:
    """The paired row of arm - ref at ``lag``, with its difference and interval as the docs print them."""
    row = study.paired(stats, arm, ref, lag, key)
    lo, hi = row["ci"]
    return {**row, "text": f"{row['diff']:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}]"}


def test_the_readme_quotes_the_committed_primary_result(study):
    """The study number the README quotes is recomputed here from the committed runs.csv."""
    readme = (REPO / "README.md").read_text()
    protocol = study.read_protocol()
    ref, arm = protocol["primary"]
    primary = committed_runs(".")
    row = quoted(study, primary, arm, ref, protocol["stress_lag"])
    assert row["seeds"] == len(protocol["primary_seeds"])
    assert row["text"] in readme
    assert f"{row['text']} (paired t, 95%) on {row['seeds']} seeds" in " ".join(readme.split())
    assert "studies/confirmatory/study_protocol.md" in readme


def test_docs_study_quotes_the_committed_results(study):
    """Every number of docs/study.md's primary, stabilizer and dose-response tables is recomputed here
    from a committed runs.csv (the primary's warm-up, and the second warm-up's directory)."""
    page = (REPO / "docs" / "study.md").read_text()
    protocol = study.read_protocol()
    ref, arm = protocol["primary"]
    lag = protocol["stress_lag"]
    first = committed_runs(".")
    primary = quoted(study, first, arm, ref, lag, digits=4)
    assert f"| GSPO + R3 | {primary['ref_mean']:.4f} | | | |" in page
    p = f"{primary['wilcoxon_p']:.3f} | {primary['permutation_p']:.3f} |"
    assert f"| SAT-GSPO + R3 | {primary['arm_mean']:.4f} | {primary['text']} | {p}" in page
    secondary = {
        "held-out accuracy after step 60": "heldout_acc@60",
        "after step 120": "heldout_acc@120",
        "after step 180": "heldout_acc@180",
        "greedy held-out accuracy (240)": "heldout_greedy_acc",
        "training reward, last quarter (stale rollout)": "final_reward",
        "dbar_pi, last quarter": "dbar_pi_final",
    }
    for measure, key in secondary.items():
        row = quoted(study, first, arm, ref, lag, key=key)
        p = "< 0.001" if row["wilcoxon_p"] < 0.001 else f"{row['wilcoxon_p']:.3f}"
        line = f"| {measure} | {row['arm_mean']:.3f} | {row['ref_mean']:.3f} | {row['text']} | {p} |"
        assert row["seeds"] == len(protocol["primary_seeds"]) and line in page, line
    second = committed_runs("warmup_a44e53f")
    assert {r["assets_fingerprint"] for r in second} == {"a44e53f246d0502a"}
    for stabilizer in protocol["stabilizers"]:
        row = quoted(study, second, stabilizer, ref, lag)
        assert row["seeds"] == len(protocol["stabilizer_seeds"]), stabilizer
        assert f"| {row['arm_mean']:.3f} | {row['text']} | {row['wilcoxon_p']:.3f} |" in page, stabilizer
    for n in protocol["dose_lags"]:
        row = quoted(study, second, arm, ref, n)
        assert row["seeds"] == len(protocol["dose_seeds"]), n
        line = f"| {n} | {row['ref_mean']:.3f} | {row['arm_mean']:.3f} | {row['text']} | {row['wilcoxon_p']:.3f} |"
        assert line in page, line
    sat = quoted(study, second, arm, ref, lag)  # the stabilizer table's last row, and its reference
    line = f"| {sat['arm_mean']:.3f} | {sat['text']} | {sat['wilcoxon_p']:.3f} |"
    line = "| (SAT-GSPO + R3, the same seeds and warm-up) " + line
    assert line in page and f"GSPO + R3, mean {sat['ref_mean']:.3f};" in page, line
    text = " ".join(page.split())
    assert f"lag-8 row on these 5 seeds ({sat['diff']:+.3f}) agrees with the 16-seed primary on the other" in text
    assert f"primary on the other warm-up ({primary['diff']:+.3f})" in text


def doc_section(doc: str, heading: str) -> str:
    """``doc`` from ``heading`` to the next heading of its level or above, on one line (a sentence may wrap)."""
    page = (REPO / doc).read_text()
    start = page.index(heading)
    level = "\n" + heading.split(" ")[0] + " "
    ends = [i for i in (page.find(level, start + 1), page.find("\n## ", start + 1)) if i > 0]
    return " ".join(page[start : min(ends, default=len(page))].split())


def printed_as(value: float, text: str) -> str:
    """``value`` at the precision of ``text`` as a doc prints it: "0.834", "45%", "0.0005"."""
    if text.endswith("%"):
        return f"{value:.0%}"
    return f"{value:.{len(text.partition('.')[2])}f}"


def committed_search() -> list[dict]:
    """The committed search_runs.csv, typed as ``run_stats`` writes it (the fields ``pick_regime`` reads)."""
    import csv

    keys = ("heldout_acc", "heldout_acc_initial", "q_median", "q_below_radius_frac", "intercepted_steps_frac")
    keys += ("intercepted_frac",)
    rows = csv.DictReader((STUDY / "search" / "search_runs.csv").open())
    return [{**r, "lag": int(r["lag"]), "seed": int(r["seed"]), **{k: float(r[k]) for k in keys}} for r in rows]


def test_docs_study_quotes_the_committed_search(study):
    """docs/study.md's account of the search (the run count and seed, every setting learns, none
    degrades, none intercepting on half the lag-8 steps, the lag-1 -> lag-8 accuracy, the
    intercepting and q-below shares, the setting picked by the rule's last clause) is recomputed
    here from the committed search_runs.csv with the search's own rule, ``pick_regime``."""
    import re

    search = committed_search()
    regime = study.pick_regime(search)
    verdicts = {v["tag"]: v for v in regime["verdicts"]}
    text = doc_section("docs/study.md", "### The search and the regime")
    runs, seed = re.search(r"seed (\d+), 240 steps each: (\d+) runs", text).group(2, 1)
    assert (int(runs), {int(seed)}) == (len(search), {s["seed"] for s in search})
    assert all(v["learns"] for v in verdicts.values()) and "every setting learns at lag 1" in text
    assert not any(v["degrades"] for v in verdicts.values()) and "none drops by 0.05 at lag 8" in text
    assert max(v["intercepted_steps_frac"] for v in verdicts.values()) < 0.5
    assert "none has SAT intercepting on half of the lag-8 steps" in text
    assert regime["why"] == "SAT is inert in every setting" and "the rule's last clause picked" in text
    assert regime["picked"] == study.setting_tag(2e-4, 0.5) and "lr 2e-4 / router bias 0.5" in text
    picked = verdicts[regime["picked"]]
    assert picked["intercepted_frac"] == max(v["intercepted_frac"] for v in verdicts.values())
    lag1, lag8 = re.search(r"lr 2e-4: ([\d.]+) -> ([\d.]+)\)", text).groups()
    accs = {s["lag"]: s["heldout_acc"] for s in search if s["tag"] == regime["picked"] and s["arm"] == "gspo_r3"}
    assert (printed_as(accs[1], lag1), printed_as(accs[8], lag8)) == (lag1, lag8)
    assert accs[1] - accs[8] == pytest.approx(picked["lag8_drop"])
    intercepting = re.search(r"\(lr 2e-4: (\d+%)\)", text).group(1)
    assert printed_as(picked["intercepted_steps_frac"], intercepting) == intercepting
    below = re.search(r"`q < log\(1\.2\)` on (\d+%) of lag-8 steps", text).group(1)
    assert printed_as(picked["q_below_radius_frac"], below) == below


def test_docs_sat_tables_the_committed_search():
    """Every row of docs/sat.md's "The range, measured" table (q median, share of steps below the
    radius, share of steps intercepting, intercepted share of tokens) is recomputed here from the
    committed search_runs.csv (one seed per cell), and so is the text's "at most about 2% of tokens"."""
    import re

    search = committed_search()
    text = doc_section("docs/sat.md", "### The range, measured")
    arms = {"GSPO": "gspo", "GSPO + R3": "gspo_r3"}
    row = r"\| ([\de.-]+) \| ([\d.]+) \| (\d+) \| (GSPO(?: \+ R3)?) \| " + r"([^|]+)\|" * 4
    rows = re.findall(row, text)
    assert len(rows) == 7
    for lr, bias, lag, arm, *cells in rows:
        tag = f"lr{float(lr):g}-rb{float(bias):g}"
        (run,) = [s for s in search if (s["tag"], s["lag"], s["arm"]) == (tag, int(lag), arms[arm])]
        keys = ("q_median", "q_below_radius_frac", "intercepted_steps_frac", "intercepted_frac")
        for key, cell in zip(keys, cells, strict=True):
            assert printed_as(run[key], cell.strip()) == cell.strip(), (tag, lag, arm, key)
    reach = re.search(r"at most about (\d+%) of tokens", text).group(1)
    assert printed_as(max(s["intercepted_frac"] for s in search), reach) == reach


def test_docs_study_quotes_the_committed_activity():
    """docs/study.md's paragraph on SAT's activity at lag 8 (per run over the 16 primary seeds: the
    range of q's median and of the share of steps with q below the clip radius, per arm; the mean
    intercepted share of tokens) is recomputed here from the committed runs.csv. The gate rate is
    not in any committed file: the paragraph says so."""
    import re

    runs = committed_runs(".")
    text = doc_section("docs/study.md", "### The confirmatory result")
    text = text[text.index("SAT's activity at lag 8") : text.index("**Stabilizers at lag 8**")]
    assert "from the runs' logs, not committed" in text
    found = re.search(
        r"median of ([\d.]+)-([\d.]+) in SAT-GSPO \+ R3 and, counterfactually, ([\d.]+)-([\d.]+) in GSPO \+ R3, "
        r"below the clip radius 0.18 on (\d+)-(\d+)% and (\d+)-(\d+)% of steps; and about (\d+)% of tokens",
        text,
    ).groups()
    found = found[:4] + tuple(f"{share}%" for share in found[4:])  # "91-96%": each a percentage
    cells = {arm: [r for r in runs if r["arm"] == arm and r["lag"] == 8] for arm in ("sat_gspo_r3", "gspo_r3")}
    assert [len(c) for c in cells.values()] == [16, 16]
    recomputed = []
    for key in ("q_median", "q_below_radius_frac"):
        for cell in cells.values():
            values = [float(r[key]) for r in cell]
            recomputed += [min(values), max(values)]
    shares = [float(r["intercepted_frac"]) for cell in cells.values() for r in cell]
    recomputed.append(sum(shares) / len(shares))
    assert [printed_as(v, t) for v, t in zip(recomputed, found, strict=True)] == list(found)


def test_docs_study_text_repeats_the_committed_numbers(study):
    """The numbers docs/study.md's text repeats outside its tables (the stabilizers' reading, the
    dose-response's ends and gaps, the smallest 5-pair Wilcoxon p, and the summary's effect and
    dbar_pi) are recomputed here from the committed runs.csv files."""
    import re

    from studies.lib.stats import wilcoxon_p

    protocol = study.read_protocol()
    ref, arm = protocol["primary"]
    first, second = committed_runs("."), committed_runs("warmup_a44e53f")
    text = doc_section("docs/study.md", "### The confirmatory result")
    cispo = study.paired(second, "cispo_r3", ref, 8, "heldout_acc")
    reach = re.search(r"CISPO is lower on average \(its interval reaches ([+-][\d.]+)\)", text).group(1)
    assert cispo["diff"] < 0 and f"{cispo['ci'][1]:+.{len(reach) - 3}f}" == reach
    dppo = study.paired(second, "dppo_tv_r3", ref, 8, "heldout_acc")
    positive = {r["seed"]: r["heldout_acc"] for r in second if r["arm"] == "dppo_tv_r3"}
    baseline = {r["seed"]: r["heldout_acc"] for r in second if r["arm"] == ref and r["lag"] == 8}
    assert dppo["diff"] > 0 and all(positive[s] > baseline[s] for s in baseline) and len(baseline) == 5
    assert "DPPO-TV higher (all five pairs positive)" in text
    dose = {n: study.paired(second, arm, ref, n, "heldout_acc") for n in protocol["dose_lags"]}
    low, high = min(dose), max(dose)
    ends = re.search(
        rf"\(([\d.]+) at lag {low} to ([\d.]+) at lag {high}\); SAT-GSPO \+ R3 is above it at every lag and "
        r"loses less \(([\d.]+) to ([\d.]+)\)",
        text,
    ).groups()
    recomputed = [dose[low]["ref_mean"], dose[high]["ref_mean"], dose[low]["arm_mean"], dose[high]["arm_mean"]]
    assert [printed_as(v, t) for v, t in zip(recomputed, ends, strict=True)] == list(ends)
    assert all(r["diff"] > 0 for r in dose.values()) and recomputed[2] - recomputed[3] < recomputed[0] - recomputed[1]
    gaps = re.search(r"the gap is about (\d+)-(\d+) points at lags 1-4 and (\d+)-(\d+) points at 8-16", text).groups()
    points = [round(100 * dose[n]["diff"]) for n in protocol["dose_lags"]]
    near = [p for n, p in zip(dose, points, strict=True) if n <= 4]
    far = [p for n, p in zip(dose, points, strict=True) if n >= 8]
    assert [str(p) for p in (min(near), max(near), min(far), max(far))] == list(gaps)
    smallest = re.search(r"the smallest exact two-sided Wilcoxon p with 5 pairs is ([\d.]+)\)", text).group(1)
    assert f"{wilcoxon_p([0.01, 0.02, 0.03, 0.04, 0.05]):.4f}" == smallest
    primary = study.paired(first, arm, ref, protocol["stress_lag"], "heldout_acc")
    summary = doc_section("docs/study.md", "### What this does and does not say")
    size = re.search(r"by about (\d+) points of held-out accuracy, on (\d+) seeds", summary).groups()
    assert (str(round(100 * primary["diff"])), str(primary["seeds"])) == size
    mismatch = study.paired(first, arm, ref, protocol["stress_lag"], "dbar_pi_final")
    quoted_pi = re.search(r"`dbar_pi` ([\d.]+) against ([\d.]+)\)", summary).groups()
    recomputed = [mismatch["arm_mean"], mismatch["ref_mean"]]
    assert [printed_as(v, t) for v, t in zip(recomputed, quoted_pi, strict=True)] == list(quoted_pi)
