"""studies/curve/curve_study.py (issue 46): the runs follow the protocol on fresh seeds, the
analysis keeps whole seeds and reads nothing before all 16, every row carries the protocol, and
the harness's time stop starts no run that cannot end."""

from __future__ import annotations

import csv
import json
import time
from dataclasses import asdict
from pathlib import Path

import pytest
from study_scripts import load_study

from studies.lib import harness

REPO = Path(__file__).resolve().parents[1]
USED_SEEDS = {801, 802, 851, 852, 901, 2901, 3901, *range(1001, 1017), *range(2001, 2019), *range(3001, 3017)}
USED_SEEDS |= {*range(3101, 3117), *range(4501, 4517), *range(9101, 9109), *range(9201, 9209)}
USED_SEEDS |= {*range(9301, 9309), *range(9401, 9409)}


@pytest.fixture(scope="module")
def curve():
    return load_study("curve", "curve_study")


@pytest.fixture(scope="module")
def protocol(curve):
    protocol = curve.base.read_protocol(curve.PROTOCOL)
    curve.register_arms(protocol)
    return protocol


def test_the_runs_are_the_protocols_on_fresh_seeds_seed_major(curve, protocol):
    specs = curve.specs(protocol)
    assert len(specs) == 64 and len({s.name for s in specs}) == 64
    assert [s.seed for s in specs] == sorted(s.seed for s in specs)  # seed-major: a cut keeps whole seeds
    assert not {s.seed for s in specs} & USED_SEEDS
    cfg = {s.arm: s.config() for s in specs if s.seed == 4001}
    assert (cfg["sat_gspo_r3_mbq"].sat_quantile_scope, cfg["sat_gspo_r3_mbq"].max_token_len) == ("micro_batch", 96)
    assert (cfg["sat_gspo_r3"].sat_quantile_scope, cfg["sat_gspo_r3"].max_token_len) == ("step", 0)
    assert cfg["sat_gspo_r3_dppo"].dppo_tv_mask == 1e-3 and cfg["sat_gspo_r3_dppo"].loss_mode == "sat_gspo"
    assert cfg["dppo_tv_r3"].loss_mode == "dppo_tv" and cfg["dppo_tv_r3"].dppo_tv_mask == 0.0
    for c in cfg.values():
        assert (c.lag, c.steps, c.lr, c.router_bias_std, c.routing_replay, c.eval_at) == (
            8,
            240,
            2e-4,
            0.5,
            "R3",
            (60, 120, 180),
        )


def fake_run(out: Path, spec, acc: float) -> None:
    """A complete run's files: its spec and 240 metric rows with the checkpoints' accuracy."""
    run = out / "runs" / spec.name
    run.mkdir(parents=True)
    (run / "study_spec.json").write_text(json.dumps(asdict(spec), default=list))
    lines = []
    for step in range(1, 241):
        data = {"critic/score/mean": 0.5, "actor/mismatch_abs_mean": 0.02, "study/q": 0.1}
        data |= {
            "study/intercepted_frac": 0.01,
            "study/dppo_masked_frac": 0.2,
            "study/dppo_intercepted_overlap_frac": 0.005,
        }
        if step in (60, 120, 180, 240):
            data["eval/heldout_acc"] = acc * step / 240
        lines.append(json.dumps({"step": step, "data": data}))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_the_analysis_keeps_whole_seeds_and_reads_nothing_before_16(curve, protocol, tmp_path):
    specs = [s for s in curve.specs(protocol) if s.seed <= 4003]
    for spec in specs:
        if spec.seed == 4003 and spec.arm == "dppo_tv_r3":
            continue  # seed 4003 was cut: its other arms must be left out
        bonus = 0.04 + 0.02 * (spec.seed - 4001) if spec.arm == "sat_gspo_r3" else 0.0  # mean 0.05 over 4001-4002
        fake_run(tmp_path, spec, 0.6 + bonus + 0.01 * (spec.seed - 4000))
    provenance = {"quick": False, "protocol_commit": "abc", "protocol_blob": "def", "assets_fingerprint": "f"}
    (tmp_path / "provenance.json").write_text(json.dumps(provenance))
    result = curve.summarize(tmp_path, protocol)
    assert result["seeds"] == [4001, 4002]
    primary = result["families"]["b_reference"][curve.AUC][0]
    assert primary["seeds"] == 2 and primary["diff"] == pytest.approx(0.05 * 0.625)  # mean of 1/4 .. 4/4
    assert curve.reading(primary, 0.05) == "interim (2 of 16 seeds)"
    assert "interim (2 of 16 seeds)" in (tmp_path / "study.md").read_text()
    rows = list(csv.DictReader((tmp_path / "runs.csv").open()))
    assert len(rows) == 11 and {r["protocol_blob"] for r in rows} == {"def"}
    assert (tmp_path / "curve.png").is_file() and (tmp_path / "contrasts.png").is_file()


def test_a_time_stop_starts_no_run_that_cannot_end():
    now = time.time()
    assert harness.fits([], now + 1)  # nothing measured yet: start
    timings = [{"run_s": 600.0}, {"run_s": 700.0}, {"run_s": 800.0}]
    assert harness.fits(timings, now + 760) and not harness.fits(timings, now + 680)


def test_docs_quote_the_committed_interim_rows(curve):
    """docs/study.md's curve-study sentences recompute from the committed in_progress.csv, whose
    every row carries the protocol's commit and blob."""
    path = REPO / "studies" / "curve" / "results" / "in_progress.csv"
    rows = list(csv.DictReader(path.open()))
    state = curve.base.protocol_state(curve.PROTOCOL)
    assert rows and {(r["protocol_commit"], r["protocol_blob"]) for r in rows} == {
        (state["protocol_commit"], state["protocol_blob"])
    }
    docs = " ".join((REPO / "docs" / "study.md").read_text().split())
    quotes = curve.interim_quotes(rows)
    assert quotes
    for quote in quotes:
        assert quote in docs, quote


def test_docs_quote_the_complete_study_recomputed_from_the_committed_rows(curve, protocol):
    """docs/study.md's contrast and activity tables and README's curve-study figures, from the committed
    runs.csv (all 64 runs, the protocol's commit and blob in every row) through the harness's analysis."""
    path = REPO / "studies" / "curve" / "results" / "runs.csv"
    stats = curve.read_rows(path)
    state = curve.base.protocol_state(curve.PROTOCOL)
    assert len(stats) == 64 and {(r["protocol_commit"], r["protocol_blob"]) for r in stats} == {
        (state["protocol_commit"], state["protocol_blob"])
    }
    result = curve.analyse(stats, protocol, curve.auc_checkpoints(protocol))
    assert result["seeds"] == list(range(4001, 4017))
    docs = (REPO / "docs" / "study.md").read_text()
    lines = curve.quote_lines(result, protocol["alpha"])[2:] + curve.activity_lines(result)[2:]
    for line in lines:
        assert line in docs, line
    readme = " ".join((REPO / "README.md").read_text().split())

    def quoted(family: str, measure: str) -> str:
        (r,) = result["families"][family][measure]
        lo, hi = r["ci"]
        return f"{r['diff']:+.3f} [{lo:+.3f}, {hi:+.3f}]"

    assert f"on 16 fresh seeds {quoted('b_reference', curve.AUC)} over the curve" in readme
    assert f"{quoted('b_reference', 'heldout_acc@240')} at step 240" in readme
    assert f"the paper's packing: {quoted('a', curve.AUC)} over the curve" in readme
